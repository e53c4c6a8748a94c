//! The cluster's shared directory on etcd (`docs/PROTOCOL.md` §14.6): who
//! is up, who owns which suspended session, and the suspended sessions'
//! continuations themselves, so that a host killed outright does not take
//! them with it.
//!
//! Keys, under `/roam/<cluster>/`:
//! - `host/<name>`: the host's client address, under the host's lease (it
//!   disappears a TTL after the host stops renewing).
//! - `owner/<session id hex>`: the name of the host that holds the
//!   session, under that host's lease: suspended there (its continuation
//!   is in `record/`), or live there after it moved in (a session that
//!   never suspended nor moved has no key: its first host knows it).
//! - `record/<session id hex>`: the continuation (its meta and sealed body,
//!   exactly as the host's own store keeps them), under no lease: it
//!   outlives its host.
//!
//! Records are sealed (AES-256-GCM, a fresh random nonce each, the key name
//! as associated data) under a key derived from the service key every host
//! holds: etcd, its backups and whoever reads them see neither resume
//! secrets nor application state, and cannot move a record to another
//! session's key.
//!
//! Single winner: every change of a record or an owner goes through a
//! transaction that compares the owner key. A host deletes its record before
//! it resumes the session (only while it still owns it); another host claims
//! a record only when its owner key is gone (the owner's lease expired), and
//! in the same transaction takes ownership and deletes the record. A move's
//! destination becomes the owner at the commit, comparing the owner key to
//! the source (or to nobody, with no record either). So a continuation is
//! restored at most once, and a session has at most one owner, whoever wins
//! the compare.
//!
//! Leases are renewed with one-shot keep-alive requests (no long-lived
//! stream to lose when etcd's leader changes). A host that finds its lease
//! gone takes a new one and re-owns its records that nobody claimed; the
//! ones that were claimed meanwhile are another host's now, and dropped
//! here. A leader change may extend a dead host's lease beyond its TTL:
//! claims then wait longer, they are never wrong.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use roam::SessionId;
use roam_etcd::{Client, CmpOp, Compare, LeaseId, Op, OpResponse, Txn};
use roam_proto::Keypair;

/// The default lease TTL: how long after a host's death its suspended
/// sessions can be claimed by another host.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// The default cap on a continuation kept in etcd (its requests are
/// limited to 1.5 MiB by default).
pub const DEFAULT_RECORD_CAP: usize = 1 << 20;

/// How a host uses etcd.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// etcd's client URLs (`http://HOST:PORT`).
    pub endpoints: Vec<String>,
    /// The lease TTL ([`DEFAULT_LEASE_TTL`]).
    pub lease_ttl: Duration,
    /// Continuations larger than this stay on their host only
    /// ([`DEFAULT_RECORD_CAP`]).
    pub record_cap: usize,
}

impl EtcdOptions {
    /// etcd at `endpoints`, default TTL and cap.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            lease_ttl: DEFAULT_LEASE_TTL,
            record_cap: DEFAULT_RECORD_CAP,
        }
    }
}

/// Why the shared directory could not do something.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedError {
    /// etcd did not answer, or answered with an error.
    Etcd(String),
    /// The continuation is larger than the cap.
    TooLarge {
        /// Its size.
        size: usize,
        /// The cap.
        cap: usize,
    },
    /// Another host owns the session now (it claimed it after this host's
    /// lease lapsed).
    Lost(String),
    /// A record in etcd that does not decode.
    Corrupt(String),
}

impl std::fmt::Display for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Etcd(e) => write!(f, "etcd: {e}"),
            Self::TooLarge { size, cap } => write!(
                f,
                "the continuation is {size} bytes, above the cluster's cap of {cap} bytes: \
                 it is kept on this host only and will not survive this host's loss"
            ),
            Self::Lost(owner) => write!(f, "host {owner} owns the session now"),
            Self::Corrupt(why) => write!(f, "the record in etcd is corrupt: {why}"),
        }
    }
}

impl std::error::Error for SharedError {}

fn etcd(e: roam_etcd::Error) -> SharedError {
    SharedError::Etcd(e.to_string())
}

/// Where a session not held here is, by the shared directory.
pub(crate) enum Found {
    /// Owned by this live host (its name).
    Owned(String),
    /// Claimed by this host: the continuation (meta, sealed body).
    Claimed(Vec<u8>, Vec<u8>),
    /// Nobody has it, as far as etcd knows (a session live on the host
    /// that created it, never suspended nor moved, has no owner key).
    Nothing,
}

/// This host's connection to the shared directory.
pub(crate) struct Registry {
    client: Client,
    prefix: String,
    me: String,
    clients_addr: String,
    opts: EtcdOptions,
    lease: Mutex<LeaseId>,
    /// Seals and opens records (see the module documentation).
    sealer: LessSafeKey,
    /// Sessions whose record this host put in etcd (and has not taken
    /// back): after a lost lease, those whose record is gone were claimed.
    mirrored: Mutex<HashSet<SessionId>>,
    /// Sessions whose owner key this host wrote (records put, claims,
    /// moves in) and still holds: their end or departure releases it.
    owned: Mutex<HashSet<SessionId>>,
}

fn hex(id: &SessionId) -> String {
    id.0.iter().map(|b| format!("{b:02x}")).collect()
}

impl Registry {
    /// Connects, takes a lease and announces this host.
    pub(crate) async fn open(
        cluster: &str,
        me: &str,
        clients_addr: &str,
        service_key: &Keypair,
        opts: EtcdOptions,
    ) -> Result<Arc<Self>, SharedError> {
        let sealer = record_key(service_key, cluster);
        let client = Client::connect(&opts.endpoints).await.map_err(etcd)?;
        let lease = client.grant(opts.lease_ttl).await.map_err(etcd)?;
        let r = Arc::new(Self {
            client,
            prefix: format!("/roam/{cluster}/"),
            me: me.to_string(),
            clients_addr: clients_addr.to_string(),
            opts,
            lease: Mutex::new(lease.id),
            sealer,
            mirrored: Mutex::new(HashSet::new()),
            owned: Mutex::new(HashSet::new()),
        });
        r.client
            .put(&r.host_key(me), clients_addr.as_bytes(), lease.id)
            .await
            .map_err(etcd)?;
        Ok(r)
    }

    fn host_key(&self, name: &str) -> Vec<u8> {
        format!("{}host/{name}", self.prefix).into_bytes()
    }

    fn owner_key(&self, id: &SessionId) -> Vec<u8> {
        format!("{}owner/{}", self.prefix, hex(id)).into_bytes()
    }

    fn record_key(&self, id: &SessionId) -> Vec<u8> {
        format!("{}record/{}", self.prefix, hex(id)).into_bytes()
    }

    fn lease(&self) -> LeaseId {
        *self.lease.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mirrored(&self) -> std::sync::MutexGuard<'_, HashSet<SessionId>> {
        self.mirrored.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn owned(&self) -> std::sync::MutexGuard<'_, HashSet<SessionId>> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this host holds `id`'s owner key (so the session's end must
    /// release it).
    pub(crate) fn owns(&self, id: SessionId) -> bool {
        self.owned().contains(&id)
    }

    /// The session left for another host, which owns it now (its commit
    /// changed the key): nothing of it is this host's to release.
    pub(crate) fn disown(&self, id: SessionId) {
        self.owned().remove(&id);
        self.mirrored().remove(&id);
    }

    /// A move's destination, at the commit: becomes the owner of `id` if
    /// `from` (the source) owns it, or nobody does and no record of it is
    /// kept. [`SharedError::Lost`] names the owner otherwise: the source
    /// was not the session's owner, and the move must not happen.
    pub(crate) async fn move_in(&self, id: SessionId, from: &str) -> Result<(), SharedError> {
        let owner = self.owner_key(&id);
        let mine = Op::Put {
            key: owner.clone(),
            value: self.me.as_bytes().to_vec(),
            lease: self.lease(),
        };
        let r = self
            .client
            .txn(Txn {
                compare: vec![Compare::Value(
                    owner.clone(),
                    CmpOp::Equal,
                    from.as_bytes().to_vec(),
                )],
                success: vec![mine.clone()],
                failure: vec![],
            })
            .await
            .map_err(etcd)?;
        if !r.succeeded {
            let r = self
                .client
                .txn(Txn {
                    compare: vec![
                        Compare::Version(owner.clone(), CmpOp::Equal, 0),
                        Compare::Version(self.record_key(&id), CmpOp::Equal, 0),
                    ],
                    success: vec![mine],
                    failure: vec![Op::Get { key: owner }],
                })
                .await
                .map_err(etcd)?;
            if !r.succeeded {
                let holder = owner_in(&r.responses);
                return Err(SharedError::Lost(if holder.is_empty() {
                    "nobody: its continuation waits in etcd to be claimed".into()
                } else {
                    holder
                }));
            }
        }
        self.owned().insert(id);
        Ok(())
    }

    /// Keeps a suspended session's continuation in etcd, owned by this
    /// host. Above the cap it is refused ([`SharedError::TooLarge`]).
    pub(crate) async fn put_record(
        &self,
        id: SessionId,
        meta: &[u8],
        stored: &[u8],
    ) -> Result<(), SharedError> {
        let size = NONCE_LEN + 4 + meta.len() + stored.len() + AES_256_GCM.tag_len();
        if size > self.opts.record_cap {
            return Err(SharedError::TooLarge {
                size,
                cap: self.opts.record_cap,
            });
        }
        let mut plain = Vec::with_capacity(size);
        plain.extend_from_slice(&(meta.len() as u32).to_be_bytes());
        plain.extend_from_slice(meta);
        plain.extend_from_slice(stored);
        let value = self.seal(&self.record_key(&id), plain)?;
        let owner = self.owner_key(&id);
        // Ours already, or nobody's: never overwrite another host's.
        let txn = |compare| Txn {
            compare: vec![compare],
            success: vec![
                Op::Put {
                    key: owner.clone(),
                    value: self.me.as_bytes().to_vec(),
                    lease: self.lease(),
                },
                Op::Put {
                    key: self.record_key(&id),
                    value: value.clone(),
                    lease: 0,
                },
            ],
            failure: vec![Op::Get { key: owner.clone() }],
        };
        let r = self
            .client
            .txn(txn(Compare::Version(owner.clone(), CmpOp::Equal, 0)))
            .await
            .map_err(etcd)?;
        if !r.succeeded {
            let r = self
                .client
                .txn(txn(Compare::Value(
                    owner.clone(),
                    CmpOp::Equal,
                    self.me.as_bytes().to_vec(),
                )))
                .await
                .map_err(etcd)?;
            if !r.succeeded {
                return Err(SharedError::Lost(owner_in(&r.responses)));
            }
        }
        self.mirrored().insert(id);
        self.owned().insert(id);
        Ok(())
    }

    /// Takes this host's record of `id` out of etcd before the session
    /// resumes here or moves away; the owner key stays (the session is
    /// still this host's until it ends or a destination commits). `Ok` if
    /// there was none; [`SharedError::Lost`] if another host owns it now.
    pub(crate) async fn take(&self, id: SessionId) -> Result<(), SharedError> {
        self.release(id, false).await
    }

    /// Deletes `id`'s record and, with `owner_too`, its owner key, in one
    /// transaction comparing the owner key to this host.
    async fn release(&self, id: SessionId, owner_too: bool) -> Result<(), SharedError> {
        let owner = self.owner_key(&id);
        let mut success = vec![Op::Delete {
            key: self.record_key(&id),
        }];
        if owner_too {
            success.push(Op::Delete { key: owner.clone() });
        }
        let r = self
            .client
            .txn(Txn {
                compare: vec![Compare::Value(
                    owner.clone(),
                    CmpOp::Equal,
                    self.me.as_bytes().to_vec(),
                )],
                success,
                failure: vec![Op::Get { key: owner }],
            })
            .await
            .map_err(etcd)?;
        let was_mirrored = self.mirrored().remove(&id);
        if r.succeeded {
            if owner_too {
                self.owned().remove(&id);
            }
            return Ok(());
        }
        self.owned().remove(&id);
        let holder = owner_in(&r.responses);
        if !holder.is_empty() {
            return Err(SharedError::Lost(holder));
        }
        // No owner: our key lapsed with a lease (this process's or, after a
        // restart, the last one's). A record still there is unclaimed: take
        // it out in one compare on both keys.
        let r = self
            .client
            .txn(Txn {
                compare: vec![
                    Compare::Version(self.owner_key(&id), CmpOp::Equal, 0),
                    Compare::Version(self.record_key(&id), CmpOp::Greater, 0),
                ],
                success: vec![Op::Delete {
                    key: self.record_key(&id),
                }],
                failure: vec![],
            })
            .await
            .map_err(etcd)?;
        if r.succeeded || !was_mirrored {
            // Taken out, or nothing there that this process ever put (too
            // large, etcd down then, or before a restart: see `reown`).
            return Ok(());
        }
        Err(SharedError::Lost("another host (it has resumed it)".into()))
    }

    /// Re-owns, under the current lease, continuations this host holds
    /// (at start-up: those its store kept; after a lost lease: those it had
    /// put). Returns the ones another host took meanwhile: claimed (owned by
    /// it) or, for those this process had put, claimed and resumed already
    /// (owner and record both gone).
    pub(crate) async fn reown(
        &self,
        ids: &[SessionId],
        put_here: bool,
    ) -> Result<Vec<SessionId>, SharedError> {
        let lease = self.lease();
        let mut gone = Vec::new();
        for &id in ids {
            let owner = self.owner_key(&id);
            let mine = Op::Put {
                key: owner.clone(),
                value: self.me.as_bytes().to_vec(),
                lease,
            };
            // Still ours (a restart within the old lease's TTL) or nobody's
            // with the record there: ours again.
            let r = self
                .client
                .txn(Txn {
                    compare: vec![Compare::Value(
                        owner.clone(),
                        CmpOp::Equal,
                        self.me.as_bytes().to_vec(),
                    )],
                    success: vec![mine.clone()],
                    failure: vec![],
                })
                .await
                .map_err(etcd)?;
            if r.succeeded {
                self.mirrored().insert(id);
                self.owned().insert(id);
                continue;
            }
            let r = self
                .client
                .txn(Txn {
                    compare: vec![
                        Compare::Version(owner.clone(), CmpOp::Equal, 0),
                        Compare::Version(self.record_key(&id), CmpOp::Greater, 0),
                    ],
                    success: vec![mine],
                    failure: vec![Op::Get { key: owner }],
                })
                .await
                .map_err(etcd)?;
            if r.succeeded {
                self.mirrored().insert(id);
                self.owned().insert(id);
                continue;
            }
            let holder = owner_in(&r.responses);
            if !holder.is_empty() || put_here {
                self.mirrored().remove(&id);
                self.owned().remove(&id);
                gone.push(id);
            }
            // Else never in etcd as far as this process knows: kept here.
        }
        Ok(gone)
    }

    /// Forgets `id` in etcd if it is ours: its record and its owner key (a
    /// discarded continuation, or a session that ended here).
    pub(crate) async fn forget(&self, id: SessionId) {
        if let Err(e) = self.release(id, true).await {
            tracing::debug!("session {id}: not removed from etcd: {e}");
        }
    }

    /// Where a session this host does not hold is: with a live owner, or
    /// claimed here now (its owner's lease expired), or nowhere.
    pub(crate) async fn locate(&self, id: SessionId) -> Result<Found, SharedError> {
        let owner = self.owner_key(&id);
        let record = self.record_key(&id);
        // Reads first: a resume naming a session nobody has (a stale or
        // forged id) costs two reads, not a write transaction.
        if let Some(kv) = self.client.get(&owner).await.map_err(etcd)? {
            let holder = String::from_utf8_lossy(&kv.value).into_owned();
            return Ok(if holder == self.me {
                Found::Nothing
            } else {
                Found::Owned(holder)
            });
        }
        if self.client.get(&record).await.map_err(etcd)?.is_none() {
            return Ok(Found::Nothing);
        }
        let r = self
            .client
            .txn(Txn {
                compare: vec![
                    Compare::Version(owner.clone(), CmpOp::Equal, 0),
                    Compare::Version(record.clone(), CmpOp::Greater, 0),
                ],
                success: vec![
                    Op::Get {
                        key: record.clone(),
                    },
                    Op::Delete { key: record },
                    Op::Put {
                        key: owner.clone(),
                        value: self.me.as_bytes().to_vec(),
                        lease: self.lease(),
                    },
                ],
                failure: vec![Op::Get { key: owner }],
            })
            .await
            .map_err(etcd)?;
        if !r.succeeded {
            let holder = owner_in(&r.responses);
            return Ok(if holder.is_empty() || holder == self.me {
                Found::Nothing
            } else {
                Found::Owned(holder)
            });
        }
        let sealed = match r.responses.first() {
            Some(OpResponse::Get(kvs)) if !kvs.is_empty() => kvs[0].value.clone(),
            _ => return Err(SharedError::Corrupt("claimed, but no record came".into())),
        };
        let value = self.open_sealed(&self.record_key(&id), sealed)?;
        if value.len() < 4 {
            return Err(SharedError::Corrupt(format!("{} bytes", value.len())));
        }
        let n = u32::from_be_bytes(value[..4].try_into().expect("4 bytes")) as usize;
        if value.len() < 4 + n {
            return Err(SharedError::Corrupt(format!(
                "meta of {n} bytes in a record of {}",
                value.len()
            )));
        }
        self.owned().insert(id);
        tracing::info!("session {id}: claimed from the cluster (its host's lease expired)");
        Ok(Found::Claimed(
            value[4..4 + n].to_vec(),
            value[4 + n..].to_vec(),
        ))
    }

    /// `nonce ‖ AES-256-GCM(plain)` with `key` as associated data.
    fn seal(&self, key: &[u8], mut plain: Vec<u8>) -> Result<Vec<u8>, SharedError> {
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| SharedError::Etcd("no randomness for a record's nonce".into()))?;
        self.sealer
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(key),
                &mut plain,
            )
            .map_err(|_| SharedError::Corrupt("record too large to seal".into()))?;
        let mut out = Vec::with_capacity(NONCE_LEN + plain.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&plain);
        Ok(out)
    }

    /// The inverse of [`Registry::seal`].
    fn open_sealed(&self, key: &[u8], mut sealed: Vec<u8>) -> Result<Vec<u8>, SharedError> {
        if sealed.len() < NONCE_LEN + AES_256_GCM.tag_len() {
            return Err(SharedError::Corrupt(format!(
                "a sealed record of {} bytes",
                sealed.len()
            )));
        }
        let nonce: [u8; NONCE_LEN] = sealed[..NONCE_LEN].try_into().expect("checked length");
        let plain = self
            .sealer
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(key),
                &mut sealed[NONCE_LEN..],
            )
            .map_err(|_| {
                SharedError::Corrupt(
                    "the record does not open with this service's key (another service, or altered)"
                        .into(),
                )
            })?
            .to_vec();
        Ok(plain)
    }

    /// Client address of host `name`, if it is up (its key exists).
    pub(crate) async fn host_addr(&self, name: &str) -> Result<Option<String>, SharedError> {
        Ok(self
            .client
            .get(&self.host_key(name))
            .await
            .map_err(etcd)?
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
    }

    /// Renews the lease every third of its TTL until `stop` fires. A lease
    /// found gone is replaced; `lost` gets the sessions claimed meanwhile.
    pub(crate) async fn keep_alive(
        self: Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<()>,
        lost: impl Fn(Vec<SessionId>) + Send + 'static,
    ) {
        let every = (self.opts.lease_ttl / 3).max(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => break,
            }
            match self.client.keep_alive_once(self.lease()).await {
                Ok(Some(_)) => {}
                Ok(None) => match self.renew().await {
                    Ok(gone) if !gone.is_empty() => lost(gone),
                    Ok(_) => {}
                    Err(e) => tracing::warn!("etcd: could not take a new lease: {e}"),
                },
                Err(e) => tracing::warn!("etcd: lease keep-alive failed: {e}"),
            }
        }
        let _ = self.client.revoke(self.lease()).await;
    }

    /// The lease expired: a new one, this host announced again, and its
    /// records re-owned where nobody claimed them. Returns those claimed.
    async fn renew(&self) -> Result<Vec<SessionId>, SharedError> {
        let lease = self.client.grant(self.opts.lease_ttl).await.map_err(etcd)?;
        *self.lease.lock().unwrap_or_else(|e| e.into_inner()) = lease.id;
        tracing::warn!("etcd: this host's lease had expired; took a new one");
        self.client
            .put(
                &self.host_key(&self.me),
                self.clients_addr.as_bytes(),
                lease.id,
            )
            .await
            .map_err(etcd)?;
        let ids: Vec<SessionId> = self.mirrored().iter().copied().collect();
        let gone = self.reown(&ids, true).await?;
        // Sessions live here after moving in: their owner key went with the
        // old lease. Nobody can have claimed them (no record): ours again.
        let live: Vec<SessionId> = {
            let mirrored = self.mirrored();
            self.owned()
                .iter()
                .filter(|id| !mirrored.contains(id))
                .copied()
                .collect()
        };
        for id in live {
            let owner = self.owner_key(&id);
            let r = self
                .client
                .txn(Txn {
                    compare: vec![Compare::Version(owner.clone(), CmpOp::Equal, 0)],
                    success: vec![Op::Put {
                        key: owner,
                        value: self.me.as_bytes().to_vec(),
                        lease: lease.id,
                    }],
                    failure: vec![],
                })
                .await
                .map_err(etcd)?;
            if !r.succeeded {
                tracing::warn!("session {id}: another host owns it in etcd now");
                self.owned().remove(&id);
            }
        }
        Ok(gone)
    }
}

/// The records' key: HKDF-SHA256 of the service's private key, salted
/// and labelled so it is used for nothing else, bound to the cluster name.
fn record_key(service_key: &Keypair, cluster: &str) -> LessSafeKey {
    use ring::hkdf::{Salt, HKDF_SHA256};
    let prk =
        Salt::new(HKDF_SHA256, b"roam-cluster-etcd-record/1").extract(&service_key.private_bytes());
    let info = [cluster.as_bytes()];
    let okm = prk
        .expand(&info, &AES_256_GCM)
        .expect("32 bytes is a valid HKDF-SHA256 output length");
    let mut key = [0u8; 32];
    okm.fill(&mut key)
        .expect("the length AES-256-GCM asked for");
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).expect("32-byte key"))
}

/// The owner named by a transaction's failure branch (`Get` of the owner
/// key), empty if it has none.
fn owner_in(responses: &[OpResponse]) -> String {
    match responses.first() {
        Some(OpResponse::Get(kvs)) if !kvs.is_empty() => {
            String::from_utf8_lossy(&kvs[0].value).into_owned()
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use roam_etcd::testing::EtcdServer;

    async fn host(etcd: &EtcdServer, key: &Keypair, name: &str) -> Arc<Registry> {
        let opts = EtcdOptions::new(vec![etcd.url()]);
        Registry::open("t", name, "127.0.0.1:1", key, opts)
            .await
            .expect("registry")
    }

    async fn owner_of(etcd: &Client, id: &SessionId) -> Option<String> {
        let key = format!("/roam/t/owner/{}", hex(id)).into_bytes();
        etcd.get(&key)
            .await
            .expect("get")
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
    }

    /// The ownership of a session is a single-winner compare in etcd: a
    /// move's destination becomes the owner only if the source is (or
    /// nobody is, with no record waiting to be claimed); a stale source
    /// loses, naming the owner; of many destinations racing, one wins; only
    /// the owner's release deletes the key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn move_in_is_a_single_winner_compare_on_the_owner() {
        let etcd = EtcdServer::start().await.expect("etcd");
        let db = Client::connect(&[etcd.url()]).await.unwrap();
        let key = Keypair::generate().unwrap();
        let a = host(&etcd, &key, "a").await;
        let b = host(&etcd, &key, "b").await;
        let c = host(&etcd, &key, "c").await;
        let id = SessionId([7; 16]);
        // Nobody's: a's move to b (a live session never in etcd) commits.
        b.move_in(id, "a").await.expect("first move");
        assert_eq!(owner_of(&db, &id).await.as_deref(), Some("b"));
        assert!(b.owns(id));
        // a is a stale source now: its move to c is refused, naming b.
        match c.move_in(id, "a").await {
            Err(SharedError::Lost(h)) => assert_eq!(h, "b"),
            other => panic!("a stale source's move: {other:?}"),
        }
        assert!(!c.owns(id));
        // b's move to c commits; b lets go.
        c.move_in(id, "b").await.expect("second move");
        b.disown(id);
        assert_eq!(owner_of(&db, &id).await.as_deref(), Some("c"));
        // Only the owner's release deletes the key.
        b.forget(id).await;
        assert_eq!(owner_of(&db, &id).await.as_deref(), Some("c"));
        c.forget(id).await;
        assert_eq!(owner_of(&db, &id).await, None);
        assert!(!c.owns(id));

        // A record with no owner (its host's lease expired) is for a claim
        // to take, not for a move to step over.
        let id2 = SessionId([8; 16]);
        a.put_record(id2, b"meta", b"body").await.expect("record");
        assert_eq!(owner_of(&db, &id2).await.as_deref(), Some("a"));
        db.delete(&a.owner_key(&id2)).await.unwrap();
        match b.move_in(id2, "x").await {
            Err(SharedError::Lost(h)) => assert!(h.contains("claimed"), "{h}"),
            other => panic!("a move over a claimable record: {other:?}"),
        }
        assert_eq!(owner_of(&db, &id2).await, None);

        // Eight destinations race for one unowned session: one wins, and
        // every loser names the winner.
        let id3 = SessionId([9; 16]);
        let mut racers = Vec::new();
        for i in 0..8 {
            racers.push(host(&etcd, &key, &format!("r{i}")).await);
        }
        let mut set = tokio::task::JoinSet::new();
        for (i, r) in racers.iter().enumerate() {
            let r = r.clone();
            set.spawn(async move { (i, r.move_in(id3, "src").await) });
        }
        let mut results: Vec<Result<(), SharedError>> = vec![Ok(()); 8];
        while let Some(j) = set.join_next().await {
            let (i, r) = j.expect("racer");
            results[i] = r;
        }
        let winners: Vec<usize> = (0..8).filter(|&i| results[i].is_ok()).collect();
        assert_eq!(winners.len(), 1, "{results:?}");
        let winner = format!("r{}", winners[0]);
        assert_eq!(owner_of(&db, &id3).await.as_deref(), Some(winner.as_str()));
        for r in &results {
            if let Err(e) = r {
                assert_eq!(e, &SharedError::Lost(winner.clone()));
            }
        }
    }
}
