//! A cluster of hosts serving one service: live sessions move between them
//! mid-stream, exactly once, and their clients follow (`docs/PROTOCOL.md`
//! §14; the Migrate paper's §V-D and Fig. 9, Service Continuations' M-TCP).
//!
//! - [`config`]: the cluster file (hosts, their addresses and host keys,
//!   operators).
//! - [`link`]: the host-to-host channel, Noise IK over TCP with the
//!   cluster's keys.
//! - [`wire`]: the messages of a move and of the operator's requests.
//! - This module: the move itself, on both sides, and the peer server.
//!
//! ## A move (source S, destination D, client C)
//! 1. S → D `Offer` with the session's compatibility vector and the next
//!    ownership revision; D checks it against its services (refusing names
//!    the property) and its revisions (refusing a stale one), then holds
//!    resumes of the session until the move ends. D → S `Accept`.
//! 2. S → D `Precopy`: the session's attributes, while it keeps running
//!    (an empty one if `HostConfig::precopy` is off). D → S `Accept` once
//!    it has them, so the freeze never waits behind the copy.
//! 3. S tells C `MOVE_TO D` and asks the application for its continuation
//!    (`FreezeReason::Move`). C abandons S and resumes at D, which waits.
//! 4. The application suspends at its next quiescent point; S sends the
//!    continuation (`Transfer`: protocol snapshot, routine, streams, and only
//!    the attributes changed since the pre-copy), zstd-compressed.
//!    D decodes and checks it (the service's `on_move_in`, then its
//!    `prepare_move_in`, which may start what the session needs here and
//!    keep it with the session): `Installed`. An application that cannot
//!    give its continuation declines, and the move is called off at once.
//! 5. S records that the session lives at D (its resumes are redirected
//!    there from now on) and sends `Commit`; D stores the continuation
//!    durably, lets the waiting resume restore it: `Committed`.
//!
//! A failure before step 5 (refusal, timeout, lost connection, D killed)
//! leaves the session at S: S keeps the continuation locally (or never took
//! it), D forgets what it got and redirects the client back to S.

pub mod config;
pub mod etcd;
pub mod link;
pub mod wire;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use roam::SessionId;
use roam_proto::{Keypair, PublicKey};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::time::timeout;

use crate::host::{Frozen, HostInner, Record, Slot};
use crate::record::{open_body, seal_body, Body, Meta};
use crate::session::FreezeReason;
use config::{ClusterConfig, Member};
use link::{Link, LinkError};
use wire::{Msg, Refusal, SessionRow};

/// How many sessions each other host holds (asked with STATUS; a host
/// that does not answer is left out).
async fn loads(ident: &ClusterIdentity) -> Vec<(usize, String)> {
    let mut loads = Vec::new();
    for m in ident.config.hosts.values().filter(|m| m.name != ident.me) {
        let asked = timeout(CONNECT_WAIT + ANSWER_WAIT, async {
            let mut l =
                Link::connect(&m.peers, &ident.config.name, &ident.host_key, &m.key).await?;
            l.call(&Msg::Status).await
        })
        .await;
        match asked {
            Ok(Ok(Msg::StatusReply { sessions, .. })) => {
                loads.push((sessions.len(), m.name.clone()))
            }
            other => tracing::warn!("{} does not answer STATUS ({other:?}); left out", m.name),
        }
    }
    loads
}

/// An idle link is reused for this long (the destination closes links idle
/// for [`PEER_IDLE`]).
const LINK_REUSE: Duration = Duration::from_secs(20);

/// Idle links to the other hosts, by host name, each after a finished move:
/// the next move to that host takes one instead of a new handshake.
#[derive(Default)]
pub(crate) struct LinkPool {
    idle: std::sync::Mutex<std::collections::HashMap<String, Vec<(Link, Instant)>>>,
}

impl LinkPool {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Vec<(Link, Instant)>>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A recently used idle link to `host`, if any.
    fn take(&self, host: &str) -> Option<Link> {
        let mut idle = self.lock();
        let links = idle.get_mut(host)?;
        while let Some((link, since)) = links.pop() {
            if since.elapsed() < LINK_REUSE {
                return Some(link);
            }
        }
        None
    }

    /// Keeps `link` for the next move to `host` (at most `DRAIN_PARALLEL`).
    fn put(&self, host: &str, link: Link) {
        let mut idle = self.lock();
        let links = idle.entry(host.to_string()).or_default();
        links.retain(|(_, since)| since.elapsed() < LINK_REUSE);
        if links.len() < DRAIN_PARALLEL {
            links.push((link, Instant::now()));
        }
    }
}

/// What the move's mover receives from the suspending application.
pub(crate) type Handover = Record;

/// How long each step of a move may take before the move is called off.
const CONNECT_WAIT: Duration = Duration::from_secs(3);
/// The application's answer to the freeze request.
const FREEZE_WAIT: Duration = Duration::from_secs(10);
/// The destination's answer to a transfer or a commit.
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// A destination's limit for a service's `prepare_move_in` (well inside
/// the source's `ANSWER_WAIT`, so its refusal, not a timeout, reaches the
/// source).
const PREPARE_WAIT: Duration = Duration::from_secs(5);
/// A destination's limit for taking ownership in etcd at a commit (well
/// under [`ANSWER_WAIT`]).
const DIRECTORY_WAIT: Duration = Duration::from_secs(4);
/// The name of the first step, for errors (and for skipping a host a
/// drain cannot reach).
const CONNECT_STEP: &str = "the destination's cluster port";
/// Idle peer connections are closed after this long.
const PEER_IDLE: Duration = Duration::from_secs(60);
/// A session moved in is written to the store if it is still frozen this
/// long after its commit (until then it is in memory, like a live session).
const PERSIST_AFTER: Duration = Duration::from_millis(200);
/// Moves a drain runs at once.
const DRAIN_PARALLEL: usize = 32;

/// This host's place in a cluster.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClusterIdentity {
    /// The cluster file.
    pub config: ClusterConfig,
    /// This host's name in it.
    pub me: String,
    /// This host's host key (its public half is in the file).
    pub host_key: Keypair,
    /// The shared directory on etcd, if any (`docs/PROTOCOL.md` §14.6):
    /// suspended sessions' continuations are kept there too, so another
    /// host resumes them if this one dies.
    pub etcd: Option<etcd::EtcdOptions>,
}

impl ClusterIdentity {
    /// Checks that `me` is in the file with `host_key`'s public key.
    pub fn new(config: ClusterConfig, me: &str, host_key: Keypair) -> Result<Self, String> {
        let m = config
            .hosts
            .get(me)
            .ok_or_else(|| format!("host {me:?} is not in cluster {}", config.name))?;
        if m.key != host_key.public() {
            return Err(format!(
                "the cluster file lists key {} for {me}, but this host's key is {}",
                m.key,
                host_key.public()
            ));
        }
        Ok(Self {
            config,
            me: me.to_string(),
            host_key,
            etcd: None,
        })
    }

    /// Uses etcd as the cluster's shared directory.
    pub fn with_etcd(mut self, opts: etcd::EtcdOptions) -> Self {
        self.etcd = Some(opts);
        self
    }

    fn member(&self, name: &str) -> Option<&Member> {
        self.config.hosts.get(name)
    }
}

/// A session that moved away: its resumes here are redirected.
#[derive(Debug, Clone)]
pub(crate) struct Tombstone {
    /// The client address of the host it moved to.
    pub(crate) clients: String,
    /// Redirect until then (the protocol's resume timeout).
    pub(crate) until: Instant,
}

/// The destination's side of a move in progress.
pub(crate) struct Incoming {
    /// The source host.
    from: String,
    revision: u64,
    precopy: BTreeMap<String, Vec<u8>>,
    /// The transfer, decoded and checked, waiting for the commit.
    staged: Option<Record>,
    /// What the service's `prepare_move_in` started for it (dropped,
    /// stopping it, if the move is called off).
    prepared: Option<crate::service::Prepared>,
}

impl crate::host::State {
    /// The destination's offer for session `id`, if it is for this
    /// `revision` of the transfer; otherwise the refusal to answer with.
    fn offer_at(&mut self, id: SessionId, revision: u64) -> Result<&mut Incoming, Msg> {
        let Some(Slot::Incoming(inc)) = self.slots.get_mut(&id) else {
            return Err(Msg::Refuse(Refusal::Unavailable(format!(
                "no offer for session {id}"
            ))));
        };
        if inc.revision != revision {
            return Err(Msg::Refuse(Refusal::Unavailable(format!(
                "transfer at revision {revision}, offer at {}",
                inc.revision
            ))));
        }
        Ok(inc)
    }
}

/// What a finished move measured.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MoveReport {
    /// The session.
    pub id: SessionId,
    /// The destination host.
    pub to: String,
    /// The session's new ownership revision.
    pub revision: u64,
    /// Attribute bytes copied before the freeze.
    pub precopy_bytes: usize,
    /// Bytes of the final transfer (compressed record).
    pub transfer_bytes: usize,
    /// From the freeze request to the commit: how long the session was
    /// served by neither host.
    pub frozen: Duration,
    /// The whole move, from the offer.
    pub total: Duration,
}

/// Why a move failed. In every case the session stays at (or returns to)
/// the source and keeps working.
#[derive(Debug)]
#[non_exhaustive]
pub enum MoveError {
    /// This host is not in a cluster.
    NotClustered,
    /// No host of that name in the cluster file (or it is this host).
    UnknownHost(String),
    /// The session is not held here, or not in a state that can move.
    NotHere(SessionId),
    /// The connection to the destination failed.
    Link(LinkError),
    /// The destination refused.
    Refused(Refusal),
    /// A step took too long; names the step.
    Timeout(&'static str),
    /// The destination answered out of turn.
    Protocol(String),
    /// This host could not let the session go (its store or the cluster's
    /// etcd failed); the text says which.
    Local(String),
    /// The session's application declined to give its continuation
    /// ([`ManagedSession::decline_freeze`](crate::ManagedSession::decline_freeze),
    /// e.g. a service set's back-end refused its part or died); the text
    /// is its reason.
    Declined(String),
}

impl std::fmt::Display for MoveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotClustered => write!(f, "this host is not in a cluster"),
            Self::UnknownHost(h) => write!(f, "no other host named {h:?} in the cluster file"),
            Self::NotHere(id) => {
                write!(f, "session {id} is not held here in a state that can move")
            }
            Self::Link(e) => write!(f, "{e}"),
            Self::Refused(r) => write!(f, "the destination refused: {r}"),
            Self::Timeout(step) => write!(f, "timed out waiting for {step}"),
            Self::Protocol(what) => write!(f, "the destination answered out of turn: {what}"),
            Self::Local(what) => write!(f, "this host could not let the session go: {what}"),
            Self::Declined(why) => write!(f, "the application declined to freeze: {why}"),
        }
    }
}

impl std::error::Error for MoveError {}

impl From<LinkError> for MoveError {
    fn from(e: LinkError) -> Self {
        Self::Link(e)
    }
}

/// What a drain did.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DrainReport {
    /// Sessions moved.
    pub moved: usize,
    /// Sessions that could not move, with why (they stay here).
    pub failed: Vec<(SessionId, String)>,
    /// How long the drain took.
    pub elapsed: Duration,
}

/// Which live sessions a host sheds to the least-loaded replicas
/// ([`Host::shed`](crate::Host::shed); M-Apache's load shedding, Service
/// Continuations §5.2): those live here longer than `older_than`, or that
/// moved more than `heavier_than` bytes (both directions, whole life), at
/// most `max`.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ShedPolicy {
    /// Shed sessions live on this host at least this long.
    pub older_than: Option<Duration>,
    /// Shed sessions that carried at least this many bytes.
    pub heavier_than: Option<u64>,
    /// At most this many sessions per call.
    pub max: usize,
}

impl ShedPolicy {
    /// Sessions older than `t`, at most `max`.
    pub fn older_than(t: Duration, max: usize) -> Self {
        Self {
            older_than: Some(t),
            heavier_than: None,
            max,
        }
    }

    /// Sessions heavier than `bytes`, at most `max`.
    pub fn heavier_than(bytes: u64, max: usize) -> Self {
        Self {
            older_than: None,
            heavier_than: Some(bytes),
            max,
        }
    }
}

async fn step<T>(
    what: &'static str,
    wait: Duration,
    f: impl std::future::Future<Output = Result<T, LinkError>>,
) -> Result<T, MoveError> {
    match timeout(wait, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(MoveError::Timeout(what)),
    }
}

fn expect(got: Msg, want: &'static str) -> Result<(), MoveError> {
    match got {
        Msg::Refuse(r) => Err(MoveError::Refused(r)),
        m => {
            let ok = matches!(
                (&m, want),
                (Msg::Accept, "accept")
                    | (Msg::Installed, "installed")
                    | (Msg::Committed, "committed")
            );
            if ok {
                Ok(())
            } else {
                Err(MoveError::Protocol(format!("expected {want}, got {m:?}")))
            }
        }
    }
}

/// What is known of a session about to move.
struct Source {
    service: String,
    requires: BTreeMap<String, String>,
    routine: Option<String>,
    revision: u64,
    attrs: BTreeMap<String, Vec<u8>>,
    /// Live: the application must suspend it first. Frozen: its record.
    live: Option<Arc<crate::session::Live>>,
    frozen: Option<Record>,
}

impl HostInner {
    fn identity(&self) -> Result<&ClusterIdentity, MoveError> {
        self.config.cluster.as_ref().ok_or(MoveError::NotClustered)
    }

    /// Takes what a move needs from session `id`'s slot; a frozen session's
    /// slot becomes Moving.
    async fn source(self: &Arc<Self>, id: SessionId) -> Result<Source, MoveError> {
        // A session that is being frozen, thawed or moved in is waited for.
        let deadline = tokio::time::Instant::now() + crate::host::TRANSITION_WAIT;
        enum Found {
            Live(Arc<crate::session::Live>),
            Frozen(Frozen),
            Wait,
            Gone,
        }
        let frozen = loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let found = {
                let mut st = self.state();
                match st.slots.get(&id) {
                    Some(Slot::Live(l)) => Found::Live(l.clone()),
                    Some(Slot::Frozen(_)) => {
                        let Some(Slot::Frozen(f)) = st.slots.insert(id, Slot::Moving) else {
                            unreachable!("matched above")
                        };
                        if let Some(t) = f.offload_at {
                            st.offloads.remove(&(t, id));
                        }
                        st.expiries.remove(&(f.meta.deadline, id));
                        Found::Frozen(f)
                    }
                    Some(Slot::Freezing | Slot::Thawing | Slot::Incoming(_)) => Found::Wait,
                    Some(Slot::Moving) | None => Found::Gone,
                }
            };
            match found {
                Found::Live(l) => {
                    let ls = l.lock();
                    if ls.suspending || ls.moving.is_some() || ls.handle.is_none() {
                        return Err(MoveError::NotHere(id));
                    }
                    let mut requires = ls.requires.clone();
                    if let Some(v) = l.service.properties.get("version") {
                        requires
                            .entry("version".into())
                            .or_insert_with(|| v.clone());
                    }
                    let s = Source {
                        service: l.service.name.clone(),
                        requires,
                        routine: None,
                        revision: ls.revision + 1,
                        attrs: ls.attrs.values.clone(),
                        live: None,
                        frozen: None,
                    };
                    drop(ls);
                    return Ok(Source { live: Some(l), ..s });
                }
                Found::Frozen(f) => break f,
                Found::Gone => return Err(MoveError::NotHere(id)),
                Found::Wait => {}
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(MoveError::Timeout(
                    "the session to settle (freezing or thawing)",
                ));
            }
        };
        let body = match frozen.hot.clone() {
            Some(b) => b,
            None => match self.load(id).await {
                Ok(Some((_, b))) => b,
                _ => {
                    self.unmove_frozen(id, frozen);
                    return Err(MoveError::NotHere(id));
                }
            },
        };
        let body = Arc::try_unwrap(body).unwrap_or_else(|b| (*b).clone());
        let meta = frozen.meta.clone();
        Ok(Source {
            service: meta.service.clone(),
            requires: body.requires.clone(),
            routine: Some(body.routine.clone()),
            revision: meta.revision + 1,
            attrs: body.attrs.values.clone(),
            live: None,
            // Sealed only if it has to stay here after all.
            frozen: Some(Record {
                meta_bytes: Vec::new(),
                meta,
                body,
                stored: Vec::new(),
            }),
        })
    }

    /// Puts a frozen session whose move could not start back to Frozen.
    fn unmove_frozen(&self, id: SessionId, f: Frozen) {
        let mut st = self.state();
        st.expiries.insert((f.meta.deadline, id));
        st.slots.insert(id, Slot::Frozen(f));
        drop(st);
        self.changed.notify_waiters();
    }

    /// Moves session `id` to host `to` (see the module documentation).
    pub(crate) async fn move_session(
        self: &Arc<Self>,
        id: SessionId,
        to: &str,
    ) -> Result<MoveReport, MoveError> {
        let ident = self.identity()?.clone();
        let member = ident
            .member(to)
            .filter(|_| to != ident.me)
            .ok_or_else(|| MoveError::UnknownHost(to.to_string()))?
            .clone();
        let started = Instant::now();
        let src = self.source(id).await?;
        let frozen_from_start = src.frozen.is_some();
        match self.run_move(id, &ident, &member, src, started).await {
            Ok(r) => Ok(r),
            Err((e, record, live)) => {
                tracing::warn!("move of session {id} to {to} failed: {e}; it stays here");
                if let Some(l) = live {
                    l.withdraw_move();
                }
                match record {
                    Some(r) => {
                        self.freeze_local(id, r.sealed()).await;
                    }
                    None if frozen_from_start => {
                        // Lost with a failed load: nothing to put back.
                        self.state().slots.remove(&id);
                    }
                    None => {}
                }
                self.changed.notify_waiters();
                Err(e)
            }
        }
    }

    /// The move's steps. On failure returns the record to keep here (if the
    /// application already gave it up) and the live session to un-freeze.
    #[allow(clippy::type_complexity)]
    async fn run_move(
        self: &Arc<Self>,
        id: SessionId,
        ident: &ClusterIdentity,
        member: &Member,
        src: Source,
        started: Instant,
    ) -> Result<MoveReport, (MoveError, Option<Record>, Option<Arc<crate::session::Live>>)> {
        let Source {
            service,
            requires,
            routine,
            revision,
            attrs,
            live,
            frozen,
        } = src;
        let fail = |e: MoveError, rec: Option<Record>, live: &Option<Arc<crate::session::Live>>| {
            (e, rec, live.clone())
        };
        // 1. Offer with the compatibility vector, on an idle link to the
        // destination if there is one (a drain makes hundreds of moves to
        // the same few hosts; each new link costs a Noise handshake).
        let connect = || {
            step(
                CONNECT_STEP,
                CONNECT_WAIT,
                Link::connect(
                    &member.peers,
                    &ident.config.name,
                    &ident.host_key,
                    &member.key,
                ),
            )
        };
        let offer = Msg::Offer {
            id,
            service,
            routine,
            requires,
            revision,
        };
        let offered = |mut link: Link| {
            let offer = &offer;
            async move {
                let got = step(
                    "the destination's answer to the offer",
                    ANSWER_WAIT,
                    link.call(offer),
                )
                .await;
                (link, got)
            }
        };
        let pooled = self
            .config
            .reuse_links
            .then(|| self.links.take(&member.name))
            .flatten();
        let (mut link, answer) = match pooled {
            Some(pooled) => match offered(pooled).await {
                // The idle link had been closed meanwhile: a new one.
                (_, Err(MoveError::Link(_))) => match connect().await {
                    Ok(l) => offered(l).await,
                    Err(e) => return Err(fail(e, frozen, &live)),
                },
                done => done,
            },
            None => match connect().await {
                Ok(l) => offered(l).await,
                Err(e) => return Err(fail(e, frozen, &live)),
            },
        };
        if let Err(e) = answer.and_then(|got| expect(got, "accept")) {
            return Err(fail(e, frozen, &live));
        }
        // 2. Pre-copy the attributes while the session runs on (none if
        // `HostConfig::precopy` is off: then they all go in the transfer).
        let attrs = if self.config.precopy {
            attrs
        } else {
            BTreeMap::new()
        };
        let precopy_bytes: usize = attrs.iter().map(|(k, v)| k.len() + v.len()).sum();
        // Acknowledged once the destination has decoded and kept it: the
        // freeze must not wait behind a large pre-copy still on its way or
        // being decoded (M-TCP's overlap: the copy costs the session
        // nothing, only the delta is on the stall's path).
        let precopied = async {
            let got = step(
                "the pre-copy",
                ANSWER_WAIT,
                link.call(&Msg::Precopy {
                    id,
                    attrs: attrs.clone(),
                }),
            )
            .await?;
            expect(got, "accept")
        }
        .await;
        if let Err(e) = precopied {
            let _ = link.send(&Msg::Abort { id }).await;
            return Err(fail(e, frozen, &live));
        }
        // 3. Freeze: ask the application (its answer tells the client
        // where to go).
        let src_frozen = frozen.is_some();
        let freeze_at = Instant::now();
        let record = match (frozen, &live) {
            (Some(r), _) => r,
            (None, Some(l)) => {
                let (tx, rx) = oneshot::channel();
                {
                    let mut ls = l.lock();
                    ls.moving = Some(tx);
                    ls.move_to = Some(member.clients.clone());
                }
                l.request_freeze(FreezeReason::Move);
                match timeout(FREEZE_WAIT, rx).await {
                    Ok(Ok(Ok(r))) => r,
                    Ok(Ok(Err(why))) => {
                        let _ = link.send(&Msg::Abort { id }).await;
                        return Err(fail(MoveError::Declined(why), None, &live));
                    }
                    _ => {
                        let _ = link.send(&Msg::Abort { id }).await;
                        return Err(fail(
                            MoveError::Timeout("the application's continuation"),
                            None,
                            &live,
                        ));
                    }
                }
            }
            (None, None) => unreachable!("a source is live or frozen"),
        };
        // 4. Transfer: only what changed since the pre-copy.
        let (transfer, transfer_bytes) = delta_transfer(id, revision, &record, &attrs);
        let sent = async {
            let got = step(
                "the destination's install",
                ANSWER_WAIT,
                link.call(&transfer),
            )
            .await?;
            expect(got, "installed")
        }
        .await;
        if let Err(e) = sent {
            let _ = timeout(Duration::from_secs(1), link.send(&Msg::Abort { id })).await;
            return Err(fail(e, Some(record), &live));
        }
        // 5. Let go, then commit. A session that was suspended here leaves no copy behind: a stale
        // one must never resume, here after a restart or from etcd.
        if src_frozen {
            let gone = async {
                self.store
                    .delete(vec![id])
                    .await
                    .map_err(|e| MoveError::Local(format!("deleting the local copy: {e}")))?;
                if let Some(r) = &self.shared {
                    r.take(id)
                        .await
                        .map_err(|e| MoveError::Local(format!("the cluster's copy: {e}")))?;
                }
                Ok::<(), MoveError>(())
            }
            .await;
            if let Err(e) = gone {
                let _ = timeout(Duration::from_secs(1), link.send(&Msg::Abort { id })).await;
                return Err(fail(e, Some(record), &live));
            }
        }
        // The slot stays `Moving` until the destination answers: a resume
        // arriving here meanwhile waits for the outcome.
        let committed = async {
            let got = step(
                "the destination's commit",
                ANSWER_WAIT,
                link.call(&Msg::Commit { id, revision }),
            )
            .await?;
            expect(got, "committed")
        }
        .await;
        if let Err(e @ MoveError::Refused(_)) = committed {
            // Refused, so certainly not committed (with etcd: this host is
            // not the session's owner there, or etcd could not say): the
            // destination sends the client back, and the session stays.
            return Err(fail(e, Some(record), &live));
        }
        // From here on resumes here are redirected.
        {
            let mut st = self.state();
            st.moved.insert(
                id,
                Tombstone {
                    clients: member.clients.clone(),
                    until: Instant::now() + self.config.server.proto.session.resume_timeout,
                },
            );
            st.revisions.insert(id, revision);
            st.slots.remove(&id);
        }
        self.changed.notify_waiters();
        if let Some(r) = &self.shared {
            r.disown(id);
        }
        match committed {
            Ok(()) if self.config.reuse_links => self.links.put(&member.name, link),
            Ok(()) => {}
            Err(e) => {
                // The destination may or may not have committed: it holds
                // a checked copy and the client is sent there; keeping ours
                // too could serve a stale state. Report it, keep the redirect.
                tracing::error!(
                    "move of session {id} to {}: commit unconfirmed ({e}); the session is left to the destination",
                    member.name
                );
            }
        }
        self.counters.moves_out.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        tracing::info!(
            "session {id} moved to {} (revision {revision}, {transfer_bytes} bytes, frozen {:?})",
            member.name,
            now - freeze_at
        );
        Ok(MoveReport {
            id,
            to: member.name.clone(),
            revision,
            precopy_bytes,
            transfer_bytes,
            frozen: now - freeze_at,
            total: now - started,
        })
    }

    /// Moves every session held here to the other hosts (round robin,
    /// `DRAIN_PARALLEL` at a time).
    pub(crate) async fn drain(self: &Arc<Self>) -> Result<DrainReport, MoveError> {
        let ident = self.identity()?.clone();
        let others: Vec<String> = ident
            .config
            .hosts
            .keys()
            .filter(|n| **n != ident.me)
            .cloned()
            .collect();
        if others.is_empty() {
            return Err(MoveError::UnknownHost(
                "(no other host in the cluster)".into(),
            ));
        }
        let started = Instant::now();
        let ids: Vec<SessionId> = {
            let st = self.state();
            st.slots
                .iter()
                .filter(|(_, s)| matches!(s, Slot::Live(_) | Slot::Frozen(_)))
                .map(|(id, _)| *id)
                .collect()
        };
        let mut report = DrainReport::default();
        let sem = Arc::new(tokio::sync::Semaphore::new(DRAIN_PARALLEL));
        let mut tasks = Vec::with_capacity(ids.len());
        let others = Arc::new(others);
        for (i, id) in ids.into_iter().enumerate() {
            let host = self.clone();
            let sem = sem.clone();
            let others = others.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire_owned().await;
                // Round robin; a host that cannot be reached is skipped
                // (nothing happened to the session yet) for the next one.
                let mut last = None;
                for k in 0..others.len() {
                    let to = &others[(i + k) % others.len()];
                    match host.move_session(id, to).await {
                        Ok(r) => return (id, Ok(r)),
                        Err(e @ (MoveError::Link(_) | MoveError::Timeout(CONNECT_STEP))) => {
                            last = Some(e)
                        }
                        Err(e) => return (id, Err(e)),
                    }
                }
                (id, Err(last.unwrap_or(MoveError::NotHere(id))))
            }));
        }
        for t in tasks {
            match t.await {
                Ok((_, Ok(_))) => report.moved += 1,
                Ok((id, Err(e))) => report.failed.push((id, e.to_string())),
                Err(e) => tracing::error!("drain: a move task failed: {e}"),
            }
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// The client of session `id` asked to be moved (`MOVE_ASK`, §9.4): to
    /// host `to`, or, if empty, to the replica holding the fewest sessions.
    /// Declined (and logged) when this host is not in a cluster, `to` is
    /// not another host of it, or no other host answers.
    pub(crate) async fn asked_move(self: &Arc<Self>, id: SessionId, to: String) {
        let Ok(ident) = self.identity().cloned() else {
            tracing::debug!("session {id} asked to move; this host is not in a cluster");
            return;
        };
        let to = if to.is_empty() {
            match loads(&ident).await.into_iter().min() {
                Some((_, name)) => name,
                None => {
                    tracing::warn!("session {id} asked to move; no other host answers");
                    return;
                }
            }
        } else {
            to
        };
        match self.move_session(id, &to).await {
            Ok(r) => tracing::info!(
                "session {id} moved to {to} at its client's request (frozen {:?})",
                r.frozen
            ),
            Err(e) => tracing::warn!("session {id} asked to move to {to}: {e}"),
        }
    }

    /// Moves the live sessions `policy` selects, each to the replica that
    /// holds the fewest sessions at that moment (asked with STATUS; hosts
    /// that do not answer are left out).
    pub(crate) async fn shed(
        self: &Arc<Self>,
        policy: &ShedPolicy,
    ) -> Result<DrainReport, MoveError> {
        let ident = self.identity()?.clone();
        let started = Instant::now();
        let picked: Vec<SessionId> = {
            let st = self.state();
            st.slots
                .iter()
                .filter_map(|(id, s)| match s {
                    Slot::Live(l) => Some((*id, l.clone())),
                    _ => None,
                })
                .filter(|(_, l)| {
                    let old = policy.older_than.is_some_and(|t| l.since.elapsed() >= t);
                    let heavy = policy.heavier_than.is_some_and(|b| {
                        l.lock().handle.as_ref().is_some_and(|h| {
                            let s = h.stats();
                            s.bytes_sent + s.bytes_received >= b
                        })
                    });
                    old || heavy
                })
                .map(|(id, _)| id)
                .take(policy.max)
                .collect()
        };
        let mut loads = loads(&ident).await;
        let mut report = DrainReport::default();
        if loads.is_empty() {
            return Err(MoveError::UnknownHost("(no other host answers)".into()));
        }
        let sem = Arc::new(tokio::sync::Semaphore::new(DRAIN_PARALLEL));
        let mut tasks = Vec::new();
        for id in picked {
            let least = loads.iter_mut().min().expect("not empty");
            least.0 += 1;
            let to = least.1.clone();
            let host = self.clone();
            let sem = sem.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire_owned().await;
                (id, host.move_session(id, &to).await)
            }));
        }
        for t in tasks {
            match t.await {
                Ok((_, Ok(_))) => report.moved += 1,
                Ok((id, Err(e))) => report.failed.push((id, e.to_string())),
                Err(e) => tracing::error!("shed: a move task failed: {e}"),
            }
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// This host's sessions, for `roam cluster status`.
    pub(crate) fn status_rows(&self) -> Vec<SessionRow> {
        let st = self.state();
        let mut rows: Vec<SessionRow> = st
            .slots
            .iter()
            .map(|(id, s)| {
                let (service, state) = match s {
                    Slot::Live(l) => (
                        l.service.name.clone(),
                        if l.lock().suspended.is_some() {
                            "suspended"
                        } else {
                            "live"
                        }
                        .to_string(),
                    ),
                    Slot::Frozen(f) => (f.meta.service.clone(), "frozen".to_string()),
                    Slot::Freezing => (String::new(), "freezing".to_string()),
                    Slot::Thawing => (String::new(), "thawing".to_string()),
                    Slot::Moving => (String::new(), "moving".to_string()),
                    Slot::Incoming(i) => (String::new(), format!("incoming from {}", i.from)),
                };
                SessionRow {
                    id: *id,
                    service,
                    state,
                }
            })
            .collect();
        rows.sort_by_key(|r| r.id.0);
        rows
    }

    /// Accepts connections from the other hosts and operators on `listener`
    /// until `shutdown`.
    pub(crate) async fn serve_peers(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> std::io::Result<()> {
        let ident = self
            .config
            .cluster
            .clone()
            .ok_or_else(|| std::io::Error::other("this host is not in a cluster"))?;
        let ident = Arc::new(ident);
        tokio::pin!(shutdown);
        loop {
            let (sock, peer) = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!("cluster port: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let host = self.clone();
            let ident = ident.clone();
            tokio::spawn(async move {
                let accepted = timeout(
                    CONNECT_WAIT,
                    Link::accept(sock, &ident.config.name, &ident.host_key, |k| {
                        ident.config.host_by_key(k).is_some()
                            || ident.config.operator_by_key(k).is_some()
                    }),
                )
                .await;
                match accepted {
                    Ok(Ok(link)) => host.peer_session(&ident, link).await,
                    Ok(Err(e)) => tracing::warn!("cluster port: refused {peer}: {e}"),
                    Err(_) => tracing::warn!("cluster port: {peer} did not finish its handshake"),
                }
            });
        }
    }

    /// Serves one authenticated peer connection.
    async fn peer_session(self: Arc<Self>, ident: &ClusterIdentity, mut link: Link) {
        let key: PublicKey = link.peer();
        let host_name = ident.config.host_by_key(&key).map(|m| m.name.clone());
        // The move this connection offered, if any: aborted if it drops.
        let mut offered: Option<SessionId> = None;
        loop {
            let msg = match timeout(PEER_IDLE, link.recv()).await {
                Ok(Ok(m)) => m,
                Ok(Err(e)) => {
                    if !matches!(&e, LinkError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof)
                    {
                        tracing::warn!("cluster connection from {key}: {e}");
                    }
                    break;
                }
                Err(_) => break,
            };
            let reply = match (&host_name, msg) {
                (_, Msg::Status) => Some(Msg::StatusReply {
                    host: ident.me.clone(),
                    sessions: self.status_rows(),
                }),
                (_, Msg::Move { id, to }) => Some(match self.move_session(id, &to).await {
                    Ok(_) => Msg::Done {
                        moved: 1,
                        failures: Vec::new(),
                    },
                    Err(e) => Msg::Done {
                        moved: 0,
                        failures: vec![format!("{id}: {e}")],
                    },
                }),
                (_, Msg::Drain) => Some(match self.drain().await {
                    Ok(r) => Msg::Done {
                        moved: r.moved as u64,
                        failures: r
                            .failed
                            .iter()
                            .map(|(id, e)| format!("{id}: {e}"))
                            .collect(),
                    },
                    Err(e) => Msg::Done {
                        moved: 0,
                        failures: vec![e.to_string()],
                    },
                }),
                (None, m) => {
                    tracing::warn!("cluster: operator {key} sent a host message ({m:?}); refused");
                    Some(Msg::Refuse(Refusal::Unavailable(
                        "operators may send only status, move and drain".into(),
                    )))
                }
                (
                    Some(from),
                    Msg::Offer {
                        id,
                        service,
                        routine,
                        requires,
                        revision,
                    },
                ) => {
                    let r =
                        self.offered(id, from, &service, routine.as_deref(), &requires, revision);
                    if matches!(r, Msg::Accept) {
                        offered = Some(id);
                    }
                    Some(r)
                }
                (Some(_), Msg::Precopy { id, attrs }) => {
                    Some(match self.state().slots.get_mut(&id) {
                        Some(Slot::Incoming(inc)) => {
                            inc.precopy = attrs;
                            Msg::Accept
                        }
                        _ => {
                            Msg::Refuse(Refusal::Unavailable(format!("no offer for session {id}")))
                        }
                    })
                }
                (
                    Some(_),
                    Msg::Transfer {
                        id,
                        revision,
                        meta,
                        body,
                        precopied,
                    },
                ) => Some(
                    self.transferred(id, revision, &meta, &body, &precopied)
                        .await,
                ),
                (Some(from), Msg::Commit { id, revision }) => {
                    let r = self.commit(id, revision, from).await;
                    if matches!(r, Msg::Committed) {
                        offered = None;
                    }
                    Some(r)
                }
                (Some(from), Msg::Abort { id }) => {
                    self.abort_incoming(id, from);
                    offered = None;
                    None
                }
                (Some(_), m) => Some(Msg::Refuse(Refusal::Unavailable(format!(
                    "unexpected message {m:?}"
                )))),
            };
            if let Some(r) = reply {
                if let Err(e) = link.send(&r).await {
                    tracing::warn!("cluster connection from {key}: {e}");
                    break;
                }
            }
        }
        if let (Some(id), Some(from)) = (offered, host_name) {
            self.abort_incoming(id, &from);
        }
    }

    /// Destination: an offer. Checks compatibility and revision, then holds
    /// the session's resumes until the move ends.
    fn offered(
        &self,
        id: SessionId,
        from: &str,
        service: &str,
        routine: Option<&str>,
        requires: &BTreeMap<String, String>,
        revision: u64,
    ) -> Msg {
        let incompatible = |property: &str, required: &str, found: Option<&String>| {
            Msg::Refuse(Refusal::Incompatible {
                property: property.to_string(),
                required: required.to_string(),
                found: found.cloned(),
            })
        };
        let Some(svc) = self.services.get(service) else {
            return incompatible("service", service, None);
        };
        if let Some(r) = routine {
            if !svc.routines.contains_key(r) {
                return incompatible("routine", r, None);
            }
        }
        for (p, v) in requires {
            let found = svc.properties.get(p);
            if found != Some(v) {
                return incompatible(p, v, found);
            }
        }
        let mut st = self.state();
        if let Some(known) = st.revisions.get(&id).copied() {
            if revision <= known {
                return Msg::Refuse(Refusal::Stale { known });
            }
        }
        if st.slots.contains_key(&id) {
            return Msg::Refuse(Refusal::Unavailable(format!(
                "session {id} is already here"
            )));
        }
        st.moved.remove(&id);
        st.slots.insert(
            id,
            Slot::Incoming(Box::new(Incoming {
                from: from.to_string(),
                revision,
                precopy: BTreeMap::new(),
                staged: None,
                prepared: None,
            })),
        );
        Msg::Accept
    }

    /// Destination: the transfer. Decodes and checks it, merges the
    /// pre-copied attributes, runs the service's checks (`on_move_in`, then
    /// `prepare_move_in` off the state lock), and stages it and what the
    /// preparation started for the commit.
    async fn transferred(
        &self,
        id: SessionId,
        revision: u64,
        meta: &[u8],
        body: &[u8],
        precopied: &[String],
    ) -> Msg {
        let refused = |why: String| {
            Msg::Refuse(Refusal::Unavailable(format!(
                "the service refused session {id}: {why}"
            )))
        };
        // Under the state lock (a block, so the guard is not held across
        // the preparation's await).
        let (mut meta, body, preparing) = {
            let mut st = self.state();
            let inc = match st.offer_at(id, revision) {
                Ok(inc) => inc,
                Err(refusal) => return refusal,
            };
            let checked = Meta::decode(meta)
                .and_then(|m| open_body(&m, body).map(|b| (m, b)))
                .map_err(|c| c.0.to_string());
            let (meta, mut body) = match checked {
                Ok(x) => x,
                Err(what) => {
                    return Msg::Refuse(Refusal::Unavailable(format!("corrupt transfer: {what}")))
                }
            };
            for name in precopied {
                match inc.precopy.remove(name) {
                    Some(v) => {
                        body.attrs.values.insert(name.clone(), v);
                    }
                    None => {
                        return Msg::Refuse(Refusal::Unavailable(format!(
                            "attribute {name:?} was not pre-copied"
                        )))
                    }
                }
            }
            if let Err(inc) = crate::compat::check(&self.services, &meta.service, &body) {
                let (property, required, found) = match inc {
                    crate::Incompatible::UnknownService(s) => ("service".to_string(), s, None),
                    crate::Incompatible::UnknownRoutine { routine, .. } => {
                        ("routine".to_string(), routine, None)
                    }
                    crate::Incompatible::Mismatch {
                        property,
                        required,
                        found,
                        ..
                    } => (property, required, found),
                };
                return Msg::Refuse(Refusal::Incompatible {
                    property,
                    required,
                    found,
                });
            }
            let svc = self.services.get(&meta.service);
            if let Some(check) = svc.and_then(|s| s.on_move_in.as_ref()) {
                if let Err(why) = check(&body.attrs.values) {
                    return refused(why);
                }
            }
            let preparing = svc
                .and_then(|s| s.prepare_move_in.as_ref())
                .map(|p| p(&body.attrs.values));
            (meta, body, preparing)
        };
        // Off the state lock: starting processes takes milliseconds. This
        // connection's next message (the commit, or an abort) waits for
        // the answer, and the source's wait for it is longer.
        let prepared = match preparing {
            None => None,
            Some(fut) => match timeout(PREPARE_WAIT, fut).await {
                Ok(Ok(p)) => p,
                Ok(Err(why)) => return refused(why),
                Err(_) => return refused(format!("not prepared within {PREPARE_WAIT:?}")),
            },
        };
        let mut st = self.state();
        let inc = match st.offer_at(id, revision) {
            Ok(inc) => inc,
            // Gone meanwhile: `prepared` is dropped, stopping it.
            Err(refusal) => return refusal,
        };
        // Sealed for the store only after the commit, off the freeze's path.
        meta.revision = revision;
        meta.frozen_at = SystemTime::now();
        inc.staged = Some(Record {
            meta_bytes: Vec::new(),
            meta,
            body,
            stored: Vec::new(),
        });
        inc.prepared = prepared;
        Msg::Installed
    }

    /// Destination: the source let go. With etcd, becomes the session's
    /// owner there first (refused if `from` does not own it, or etcd cannot
    /// say: the move is then called off and the session stays at the
    /// source). Stores the continuation durably and lets the waiting resume
    /// restore it.
    async fn commit(self: &Arc<Self>, id: SessionId, revision: u64, from: &str) -> Msg {
        let (record, prepared) = {
            let mut st = self.state();
            match st.slots.get_mut(&id) {
                Some(Slot::Incoming(inc)) if inc.revision == revision && inc.staged.is_some() => {
                    (inc.staged.take(), inc.prepared.take())
                }
                _ => (None, None),
            }
        };
        let Some(record) = record else {
            return Msg::Refuse(Refusal::Unavailable(format!(
                "nothing staged for session {id} at revision {revision}"
            )));
        };
        if let Some(r) = &self.shared {
            // Bounded well inside the source's wait for this answer, so a
            // refusal (not a timeout) reaches it and the session stays.
            let owned = match timeout(DIRECTORY_WAIT, r.move_in(id, from)).await {
                Ok(r) => r,
                Err(_) => Err(etcd::SharedError::Etcd(format!(
                    "no answer within {DIRECTORY_WAIT:?}"
                ))),
            };
            if let Err(e) = owned {
                tracing::warn!("move of session {id} from {from} refused at the commit: {e}");
                self.abort_incoming(id, from);
                return Msg::Refuse(Refusal::Unavailable(format!(
                    "ownership of session {id} in the cluster's etcd: {e}"
                )));
            }
        }
        // Served from memory at once (the client waits for it); written to
        // the store in the background, like any live session's state is
        // only in memory until it is suspended.
        {
            let mut st = self.state();
            st.revisions.insert(id, revision);
            st.expiries.insert((record.meta.deadline, id));
            st.slots.insert(
                id,
                Slot::Frozen(Frozen {
                    meta: record.meta,
                    hot: Some(Arc::new(record.body)),
                    offload_at: None,
                    persisted: false,
                    prepared,
                }),
            );
        }
        self.changed.notify_waiters();
        self.gc_wake.notify_one();
        self.counters.moves_in.fetch_add(1, Ordering::Relaxed);
        self.persist_moved_in(id, revision);
        Msg::Committed
    }

    /// Writes a session that moved in to the store, unless it has moved on
    /// (resumed, discarded, moved again) first. The write is queued under the
    /// state lock, so a resume's delete of the same entry always follows it.
    fn persist_moved_in(self: &Arc<Self>, id: SessionId, revision: u64) {
        let host = self.clone();
        tokio::spawn(async move {
            // Its client is usually resuming already: wait a little, and
            // write only a session that is still frozen then (the write
            // would otherwise compete with the resume for the CPU).
            tokio::time::sleep(PERSIST_AFTER).await;
            let pending = |st: &crate::host::State| match st.slots.get(&id) {
                Some(Slot::Frozen(f)) if !f.persisted && f.meta.revision == revision => {
                    Some((f.meta.clone(), f.hot.clone()))
                }
                _ => None,
            };
            let Some((meta, Some(body))) = pending(&host.state()) else {
                return;
            };
            let sealed =
                tokio::task::spawn_blocking(move || Record::seal(meta, (*body).clone())).await;
            let Ok(rec) = sealed else { return };
            let (meta_bytes, stored);
            let queued = {
                let mut st = host.state();
                if pending(&st).is_none() {
                    return;
                }
                meta_bytes = rec.meta_bytes.clone();
                stored = rec.stored.clone();
                match host.store.put_queued(id, rec.meta_bytes, rec.stored) {
                    Ok(rx) => {
                        let offload_at = Instant::now() + host.config.offload_after;
                        if let Some(Slot::Frozen(f)) = st.slots.get_mut(&id) {
                            f.persisted = true;
                            f.meta = rec.meta;
                            f.offload_at = Some(offload_at);
                        }
                        st.offloads.insert((offload_at, id));
                        rx
                    }
                    Err(e) => {
                        tracing::error!("session {id} moved here; kept in memory only: {e}");
                        return;
                    }
                }
            };
            match crate::store::Store::put_done(queued).await {
                Ok(()) => host.mirror(id, &meta_bytes, &stored).await,
                Err(e) => {
                    tracing::error!("session {id} moved here; writing it to the store failed: {e}")
                }
            }
        });
    }

    /// Destination: the move is off (or its connection dropped before the
    /// commit). Forgets it and sends the client back to the source.
    fn abort_incoming(&self, id: SessionId, from: &str) {
        let mut st = self.state();
        if !matches!(st.slots.get(&id), Some(Slot::Incoming(_))) {
            return;
        }
        st.slots.remove(&id);
        if let Some(m) = self.config.cluster.as_ref().and_then(|c| c.member(from)) {
            st.moved.insert(
                id,
                Tombstone {
                    clients: m.clients.clone(),
                    until: Instant::now() + self.config.server.proto.session.resume_timeout,
                },
            );
        }
        drop(st);
        self.changed.notify_waiters();
        tracing::info!("move of session {id} from {from} called off; its client goes back there");
    }
}

/// The transfer message for `record`: attributes whose value equals the
/// pre-copied one travel as names only.
fn delta_transfer(
    id: SessionId,
    revision: u64,
    record: &Record,
    precopy: &BTreeMap<String, Vec<u8>>,
) -> (Msg, usize) {
    // Unchanged attributes travel as names with empty values; nothing
    // large is copied.
    let mut precopied = Vec::new();
    let values = record
        .body
        .attrs
        .values
        .iter()
        .map(|(name, v)| {
            if precopy.get(name) == Some(v) && !v.is_empty() {
                precopied.push(name.clone());
                (name.clone(), Vec::new())
            } else {
                (name.clone(), v.clone())
            }
        })
        .collect();
    let b = &record.body;
    let body = Body {
        routine: b.routine.clone(),
        attrs: crate::attrs::AttrStore {
            values,
            exported: b.attrs.exported.clone(),
        },
        requires: b.requires.clone(),
        streams: b.streams.clone(),
        unaccepted: b.unaccepted.clone(),
        orphans: b.orphans.clone(),
        expiry: b.expiry,
        blob: b.blob.clone(),
    };
    let raw = body.encode();
    let (stored, digest) = seal_body(&raw);
    let mut meta = record.meta.clone();
    meta.body_len = raw.len() as u64;
    meta.body_digest = digest;
    meta.revision = revision;
    let meta = meta.encode();
    let bytes = meta.len() + stored.len();
    (
        Msg::Transfer {
            id,
            revision,
            meta,
            body: stored,
            precopied,
        },
        bytes,
    )
}

/// An operator's connection to a host's cluster port (`roam cluster`).
pub async fn operator_request(
    addr: &str,
    cluster: &str,
    operator_key: &Keypair,
    host_key: &PublicKey,
    request: &Msg,
    wait: Duration,
) -> Result<Msg, String> {
    let mut link = timeout(
        CONNECT_WAIT,
        Link::connect(addr, cluster, operator_key, host_key),
    )
    .await
    .map_err(|_| format!("{addr}: no answer within {CONNECT_WAIT:?}"))?
    .map_err(|e| format!("{addr}: {e}"))?;
    timeout(wait, link.call(request))
        .await
        .map_err(|_| format!("{addr}: no answer within {wait:?}"))?
        .map_err(|e| format!("{addr}: {e}"))
}
