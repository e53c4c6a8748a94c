//! The [`Host`]: serves roam sessions, keeps each managed session in one of
//! four slots (live, freezing, frozen, thawing), persists continuations,
//! restores them when their clients resume, and discards them when they
//! expire or their parent goes away.
//!
//! Slot transitions (all under one mutex, never held across an `.await`):
//!
//! ```text
//!  adopt ──> Live ──suspend──> Freezing ──stored──> Frozen ──resume──> Thawing ──installed──> Live
//!             │                    │ (export failed: closed)   │                 │ (corrupt, expired,
//!             └── closed/expired ──┴──> gone <── discard/GC ───┘                 │  incompatible)
//!                                                                               └──> gone / Frozen
//! ```
//!
//! A resume that arrives while its session is Freezing or Thawing waits for
//! the transition, so it never sees a half-written continuation.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use roam::{SessionHandle, SessionId};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::attrs::AttrStore;
use crate::compat;
use crate::error::{DiscardReason, Error, Incompatible, SuspendError};
use crate::record::{seal_body, Body, Meta};
use crate::service::Service;
use crate::session::{Continuation, FreezeReason, Live, ManagedSession, SuspendReport};
use crate::store::Store;

mod gc;
mod restore;
mod watcher;

use gc::gc;
use watcher::{watch_live, Start};

/// How long a resume waits for its session to finish freezing or thawing.
pub(crate) const TRANSITION_WAIT: Duration = Duration::from_secs(10);
/// A restored session that has not completed its resume after this long
/// counts as suspended again (its client gave up on that attempt). A
/// resume whose transport dies here says so at once
/// (`SessionEvent::ResumeAbandoned`); this wait covers the rest.
const RESUME_HANDSHAKE_WAIT: Duration = Duration::from_secs(15);
/// Longest sleep of the collector: wall-clock deadlines are re-read at least
/// this often, so a clock step is noticed.
const GC_MAX_SLEEP: Duration = Duration::from_secs(30);

/// How a [`Host`] runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HostConfig {
    /// Where the continuation database lives (created 0700 if missing).
    pub state_dir: PathBuf,
    /// The roam server's identity and knobs.
    pub server: roam::ServerConfig,
    /// A suspended session's continuation stays in memory (for a fast
    /// resume) this long after it was stored, then only the store has it
    /// (default 30 s; zero drops it at once).
    pub offload_after: Duration,
    /// On shutdown, how long applications get to answer the freeze request
    /// with their continuations (default 5 s). Sessions that do not answer
    /// are closed as by `roam::serve`.
    pub shutdown_grace: Duration,
    /// The cluster this host belongs to, if any: its sessions can then move
    /// to the other hosts ([`Host::move_session`], [`Host::drain`]) and
    /// theirs to it ([`Host::serve_peers`]).
    pub cluster: Option<crate::cluster::ClusterIdentity>,
    /// Whether a move pre-copies the session's attributes to the destination
    /// while the session still runs (default true). When false the pre-copy
    /// is empty and every attribute travels in the final transfer, after the
    /// freeze; for measuring what the pre-copy saves.
    pub precopy: bool,
    /// Whether moves reuse idle links to their destination (default true).
    /// When false every move opens its own (a Noise handshake each); for
    /// measuring what the reuse saves.
    pub reuse_links: bool,
}

impl HostConfig {
    /// Defaults around a state directory and a roam server configuration.
    pub fn new(state_dir: impl Into<PathBuf>, server: roam::ServerConfig) -> Self {
        Self {
            state_dir: state_dir.into(),
            server,
            offload_after: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(5),
            cluster: None,
            precopy: true,
            reuse_links: true,
        }
    }
}

/// A continuation that will never resume, as told to
/// [`Service::on_discard`](crate::Service::on_discard).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Discarded {
    /// The session.
    pub id: SessionId,
    /// Its service.
    pub service: String,
    /// Why.
    pub reason: DiscardReason,
    /// Its last attributes (empty if they could not be read).
    pub attrs: BTreeMap<String, Vec<u8>>,
}

/// One stored entry that failed its checks at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CorruptEntry {
    /// The entry's key in hex (a session id if it is 16 bytes).
    pub key: String,
    /// Which check failed.
    pub reason: String,
}

/// What [`HostBuilder::open`] found in the store.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct OpenReport {
    /// Continuations loaded and waiting for their clients.
    pub loaded: usize,
    /// Entries that failed a check: moved to quarantine, never resumed.
    pub corrupt: Vec<CorruptEntry>,
}

/// Counters and gauges of a host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostStats {
    /// Managed sessions with a roam driver (connected or suspended).
    pub live: usize,
    /// Of those, how many are without a transport now.
    pub live_suspended: usize,
    /// Suspended sessions held only as continuations (no task, no socket).
    pub frozen: usize,
    /// Of those, how many also have a copy in memory (see `offload_after`).
    pub frozen_in_memory: usize,
    /// Sessions being frozen or thawed right now.
    pub in_transition: usize,
    /// Continuations written since the host opened.
    pub suspends: u64,
    /// Continuations resumed since the host opened.
    pub resumes: u64,
    /// Continuations discarded (expired, parent gone, corrupt).
    pub discarded: u64,
    /// Corrupt entries found (at start-up or on resume).
    pub corrupt: u64,
    /// Resumes refused because the continuation is incompatible with this host.
    pub refused: u64,
    /// Sessions moved to other hosts of the cluster.
    pub moves_out: u64,
    /// Sessions moved here from other hosts.
    pub moves_in: u64,
    /// Continuations claimed here from the cluster's etcd after their host
    /// died.
    pub claimed: u64,
    /// Continuations that could not be kept in the cluster's etcd (too
    /// large, etcd unreachable): they live on this host only.
    pub unshared: u64,
}

type RefusedHandler = Arc<dyn Fn(SessionId, &Incompatible) + Send + Sync>;

/// Builds a [`Host`]: its configuration and every service it runs.
pub struct HostBuilder {
    config: HostConfig,
    services: Vec<Service>,
    on_refused: Option<RefusedHandler>,
}

impl std::fmt::Debug for HostBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuilder")
            .field("config", &self.config)
            .field("services", &self.services)
            .finish_non_exhaustive()
    }
}

impl HostBuilder {
    /// Registers a service (its compatibility properties, routines and handlers).
    pub fn service(mut self, s: Service) -> Self {
        self.services.push(s);
        self
    }

    /// Called when a resume is refused because its continuation does not fit
    /// this host (the client is told to retry later; the continuation stays
    /// until it expires).
    pub fn on_refused(
        mut self,
        f: impl Fn(SessionId, &Incompatible) + Send + Sync + 'static,
    ) -> Self {
        self.on_refused = Some(Arc::new(f));
        self
    }

    /// Opens the store, loads the continuations it holds (quarantining and
    /// reporting corrupt entries) and starts the collector. Must run inside
    /// a tokio runtime.
    pub async fn open(self) -> Result<(Host, OpenReport), Error> {
        let mut services = HashMap::new();
        for s in self.services {
            for n in std::iter::once(&s.name).chain(s.routines.keys()) {
                if n.is_empty() || n.len() > crate::attrs::MAX_NAME_LEN {
                    return Err(Error::BadName(n.clone()));
                }
            }
            if services.contains_key(&s.name) {
                return Err(Error::DuplicateService(s.name));
            }
            services.insert(s.name.clone(), Arc::new(s));
        }
        let mut config = self.config;
        let mut shared = None;
        if let Some(c) = &config.cluster {
            // Clients learn every host of the cluster (§9.1), this one
            // first: if it dies, they look for their session at the others.
            if config.server.proto.addresses.is_empty() {
                let mut addrs = vec![c.config.hosts[&c.me].clients.clone()];
                addrs.extend(
                    c.config
                        .hosts
                        .iter()
                        .filter(|(n, _)| **n != c.me)
                        .map(|(_, m)| m.clients.clone()),
                );
                config.server.proto.addresses = addrs;
            }
            if let Some(opts) = &c.etcd {
                let r = crate::cluster::etcd::Registry::open(
                    &c.config.name,
                    &c.me,
                    &c.config.hosts[&c.me].clients,
                    &config.server.proto.keypair,
                    opts.clone(),
                )
                .await
                .map_err(Error::Shared)?;
                shared = Some(r);
            }
        }
        let dir = config.state_dir.clone();
        let (store, scanned) = tokio::task::spawn_blocking(move || {
            let store = Store::open(&dir)?;
            let scanned = store.scan()?;
            Ok::<_, Error>((store, scanned))
        })
        .await
        .map_err(|e| Error::Store(crate::store::StoreError::Db(e.to_string())))??;

        let (stop, stop_rx) = watch::channel(());
        let inner = Arc::new(HostInner {
            config,
            services,
            store,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            gc_wake: Arc::new(Notify::new()),
            counters: Counters::default(),
            on_refused: self.on_refused,
            shared: shared.clone(),
            links: Default::default(),
            _stop: stop,
        });
        if let Some(r) = shared {
            let weak = Arc::downgrade(&inner);
            tokio::spawn(r.keep_alive(stop_rx.clone(), move |gone| {
                let Some(host) = weak.upgrade() else { return };
                tokio::spawn(async move {
                    let why = DiscardReason::Claimed("another host of the cluster".into());
                    host.discard_many(gone.into_iter().map(|id| (id, why.clone())).collect())
                        .await;
                });
            }));
        }
        let mut report = OpenReport::default();
        for s in scanned {
            match s.meta {
                Ok(meta) => {
                    let id =
                        SessionId(s.key.as_slice().try_into().expect("scan checks the length"));
                    let mut st = inner.state();
                    st.expiries.insert((meta.deadline, id));
                    if let Some(p) = meta.parent {
                        st.children.entry(p).or_default().insert(id);
                    }
                    st.slots.insert(
                        id,
                        Slot::Frozen(Frozen {
                            meta,
                            hot: None,
                            offload_at: None,
                            persisted: true,
                            prepared: None,
                        }),
                    );
                    report.loaded += 1;
                }
                Err(c) => {
                    let key = hex(&s.key);
                    tracing::error!(
                        "continuation store: entry {key} is corrupt ({}); quarantined, it will not resume",
                        c.0
                    );
                    inner.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                    inner.store.quarantine(s.key, c.0.to_string()).await?;
                    report.corrupt.push(CorruptEntry {
                        key,
                        reason: c.0.to_string(),
                    });
                }
            }
        }
        // With etcd, the continuations kept here are this host's again
        // under its new lease, unless another host claimed them while this
        // one was down: those are its now, and go here.
        if let Some(r) = &inner.shared {
            let ids: Vec<SessionId> = {
                let st = inner.state();
                st.slots
                    .iter()
                    .filter(|(_, s)| matches!(s, Slot::Frozen(_)))
                    .map(|(id, _)| *id)
                    .collect()
            };
            let gone = r.reown(&ids, false).await.map_err(Error::Shared)?;
            report.loaded -= gone.len();
            inner
                .discard_many(
                    gone.into_iter()
                        .map(|id| {
                            (
                                id,
                                DiscardReason::Claimed("another host of the cluster".into()),
                            )
                        })
                        .collect(),
                )
                .await;
        }
        // Children whose parent is no longer stored (a crash between the
        // parent's discard and theirs) go now.
        let orphans: Vec<SessionId> = {
            let st = inner.state();
            st.slots
                .iter()
                .filter_map(|(id, s)| match s {
                    Slot::Frozen(f) => f
                        .meta
                        .parent
                        .filter(|p| !st.slots.contains_key(p))
                        .map(|_| *id),
                    _ => None,
                })
                .collect()
        };
        for id in orphans {
            let parent = inner.frozen_parent(&id);
            report.loaded -= 1;
            inner
                .discard_many(vec![(id, DiscardReason::ParentGone(parent.unwrap_or(id)))])
                .await;
        }
        tokio::spawn(gc(Arc::downgrade(&inner), inner.gc_wake.clone(), stop_rx));
        Ok((Host { inner }, report))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs roam sessions and their continuations. Cheap to clone.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use roam_continuation::{Continuation, Host, HostConfig, Service};
///
/// let server = roam::ServerConfig::new(roam_proto::ServerConfig {
///     keypair: roam_proto::Keypair::generate()?,
///     authorized_keys: None,
///     addresses: Vec::new(),
///     session: Default::default(),
/// });
/// let service = Service::new("echo").version("1").routine("echo", |mut r| async move {
///     let stream = r.take_stream("main");
///     // ... carry on with `r.session` and `stream`
///     # let _ = stream;
/// });
/// let (host, report) = Host::builder(HostConfig::new("/var/lib/echo", server))
///     .service(service)
///     .open()
///     .await?;
/// println!("{} suspended sessions waiting for their clients", report.loaded);
/// let listener = tokio::net::TcpListener::bind("0.0.0.0:7447").await?;
/// let h = host.clone();
/// host.serve(listener, std::future::pending(), move |handle| {
///     let Ok(session) = h.adopt("echo", handle) else { return };
///     tokio::spawn(async move {
///         let (stream, _meta) = session.handle().accept_stream().await.unwrap();
///         session.freeze_requested().await;
///         let _ = session.suspend(Continuation::new("echo").stream("main", stream)).await;
///     });
/// })
/// .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Host {
    inner: Arc<HostInner>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("store", &self.inner.store)
            .field("stats", &self.stats())
            .finish()
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) moves_out: AtomicU64,
    pub(crate) moves_in: AtomicU64,
    suspends: AtomicU64,
    resumes: AtomicU64,
    discarded: AtomicU64,
    corrupt: AtomicU64,
    refused: AtomicU64,
    pub(crate) claimed: AtomicU64,
    pub(crate) unshared: AtomicU64,
}

pub(crate) struct HostInner {
    pub(crate) config: HostConfig,
    pub(crate) services: HashMap<String, Arc<Service>>,
    pub(crate) store: Store,
    state: Mutex<State>,
    /// Woken (all waiters) on every slot transition out of Freezing/Thawing.
    pub(crate) changed: Notify,
    /// Wakes the collector when a nearer deadline appears.
    pub(crate) gc_wake: Arc<Notify>,
    pub(crate) counters: Counters,
    on_refused: Option<RefusedHandler>,
    /// The cluster's shared directory on etcd, if configured.
    pub(crate) shared: Option<Arc<crate::cluster::etcd::Registry>>,
    /// Idle links to the other hosts of the cluster.
    pub(crate) links: crate::cluster::LinkPool,
    /// Dropped with the host: stops the collector.
    _stop: watch::Sender<()>,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) slots: HashMap<SessionId, Slot>,
    /// Sessions that moved to another host: their clients are redirected
    /// there until the entry expires (the resume timeout).
    pub(crate) moved: HashMap<SessionId, crate::cluster::Tombstone>,
    /// The newest ownership revision seen for each session that moved here
    /// or away: an offer at or below it is stale (§14.4).
    pub(crate) revisions: HashMap<SessionId, u64>,
    /// parent → sessions that depend on it (live or frozen).
    children: HashMap<SessionId, BTreeSet<SessionId>>,
    /// Frozen sessions by discard deadline.
    pub(crate) expiries: BTreeSet<(SystemTime, SessionId)>,
    /// Frozen sessions whose in-memory copy goes at that time.
    pub(crate) offloads: BTreeSet<(Instant, SessionId)>,
}

pub(crate) enum Slot {
    Live(Arc<Live>),
    Freezing,
    Frozen(Frozen),
    Thawing,
    /// Source of a move: the continuation is on its way to another host.
    Moving,
    /// Destination of a move: offered, not yet committed (boxed: it holds
    /// the staged record).
    Incoming(Box<crate::cluster::Incoming>),
}

/// A continuation ready to keep or to send: decoded, and encoded for the store.
pub(crate) struct Record {
    pub(crate) meta: Meta,
    pub(crate) body: Body,
    pub(crate) meta_bytes: Vec<u8>,
    /// The body as stored: zstd-compressed (empty, and the meta's length
    /// and digest zero, for a record handed to a move: see [`Record::sealed`]).
    pub(crate) stored: Vec<u8>,
}

impl Record {
    /// A record from its parts, sealed for the store.
    pub(crate) fn seal(mut meta: Meta, body: Body) -> Self {
        let raw = body.encode();
        let (stored, digest) = seal_body(&raw);
        meta.body_len = raw.len() as u64;
        meta.body_digest = digest;
        Self {
            meta_bytes: meta.encode(),
            meta,
            body,
            stored,
        }
    }

    /// This record sealed for the store, if it is not already.
    pub(crate) fn sealed(self) -> Self {
        if self.stored.is_empty() {
            Self::seal(self.meta, self.body)
        } else {
            self
        }
    }
}

pub(crate) struct Frozen {
    pub(crate) meta: Meta,
    /// The decoded body while it is still in memory.
    pub(crate) hot: Option<Arc<Body>>,
    pub(crate) offload_at: Option<Instant>,
    /// Whether the store has (or has been asked to write) this state. A
    /// session moved in is served from memory at once and written in the
    /// background; until then there is nothing to delete on its resume.
    pub(crate) persisted: bool,
    /// What the service's `prepare_move_in` started for a session that
    /// moved in, until its resume hands it to the routine (dropped if the
    /// session moves on, is offloaded or fails to resume).
    pub(crate) prepared: Option<crate::service::Prepared>,
}

impl Host {
    /// Starts building a host.
    pub fn builder(config: HostConfig) -> HostBuilder {
        HostBuilder {
            config,
            services: Vec::new(),
            on_refused: None,
        }
    }

    /// Takes a new session under management as a session of `service`:
    /// from now on it can be suspended into a continuation and resumed from
    /// one. Call it from `serve`'s `on_session` (or right after).
    pub fn adopt(&self, service: &str, handle: SessionHandle) -> Result<ManagedSession, Error> {
        let svc = self
            .inner
            .services
            .get(service)
            .cloned()
            .ok_or_else(|| Error::UnknownService(service.to_string()))?;
        let id = handle.id().ok_or(Error::NotEstablished)?;
        let events = handle.events();
        let live = Live::new(id, svc, AttrStore::default(), handle.clone());
        self.inner
            .state()
            .slots
            .insert(id, Slot::Live(live.clone()));
        let suspended = handle.stats().state == roam::State::Suspended;
        tokio::spawn(watch_live(
            Arc::downgrade(&self.inner),
            live.clone(),
            events,
            if suspended {
                Start::Suspended
            } else {
                Start::Active
            },
        ));
        Ok(ManagedSession::new(live, self.inner.clone(), handle))
    }

    /// Serves roam on `listener` until `shutdown` completes, like
    /// `roam::serve`, and resumes suspended sessions from their
    /// continuations. On shutdown every live managed session is asked for
    /// its continuation (reason [`FreezeReason::Shutdown`]) and given
    /// `shutdown_grace` to answer, so a restarted process resumes them.
    pub async fn serve<F>(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
        on_session: F,
    ) -> io::Result<()>
    where
        F: Fn(SessionHandle) + Send + Sync + 'static,
    {
        let host = self.inner.clone();
        let grace = host.config.shutdown_grace;
        let stop = async move {
            shutdown.await;
            host.freeze_all(FreezeReason::Shutdown, grace).await;
        };
        roam::serve_with_directory(
            listener,
            self.inner.config.server.clone(),
            stop,
            on_session,
            Arc::new(restore::HostDirectory(self.inner.clone())),
        )
        .await
    }

    /// Asks the application of live session `id` for its continuation now
    /// (the paper's `freeze`). Returns whether the session is live here.
    pub fn freeze(&self, id: SessionId) -> bool {
        match self.inner.state().slots.get(&id) {
            Some(Slot::Live(l)) => {
                l.request_freeze(FreezeReason::Requested);
                true
            }
            _ => false,
        }
    }

    /// Asks every live managed session for its continuation and waits up to
    /// `grace` for them to be stored.
    pub async fn freeze_all(&self, grace: Duration) {
        self.inner.freeze_all(FreezeReason::Requested, grace).await;
    }

    /// Drops session `id` for good: a frozen continuation is deleted, a live
    /// session is taken out of roam and forgotten (its client's next resume
    /// is refused). Dependents go with it.
    pub async fn discard(&self, id: SessionId) -> Result<(), Error> {
        if !self.inner.state().slots.contains_key(&id) {
            return Err(Error::UnknownSession(id));
        }
        self.inner
            .discard_many(vec![(id, DiscardReason::Requested)])
            .await;
        Ok(())
    }

    /// Checks whether suspended session `id` could resume on this host:
    /// its entry is intact and its service, routine and required properties
    /// are all here.
    pub async fn check(&self, id: SessionId) -> Result<(), Error> {
        let hot = match self.inner.state().slots.get(&id) {
            Some(Slot::Frozen(f)) => f.hot.clone().map(|b| (f.meta.clone(), b)),
            Some(_) => return Ok(()),
            None => return Err(Error::UnknownSession(id)),
        };
        let (meta, body) = match hot {
            Some(x) => x,
            None => match self.inner.load(id).await {
                Ok(Some(x)) => x,
                Ok(None) => return Err(Error::UnknownSession(id)),
                Err(what) => return Err(Error::Corrupt(what)),
            },
        };
        compat::check(&self.inner.services, &meta.service, &body).map_err(Error::Incompatible)
    }

    /// Counters and gauges.
    pub fn stats(&self) -> HostStats {
        let st = self.inner.state();
        let mut s = HostStats::default();
        for slot in st.slots.values() {
            match slot {
                Slot::Live(l) => {
                    s.live += 1;
                    if l.lock().suspended.is_some() {
                        s.live_suspended += 1;
                    }
                }
                Slot::Frozen(f) => {
                    s.frozen += 1;
                    if f.hot.is_some() {
                        s.frozen_in_memory += 1;
                    }
                }
                Slot::Freezing | Slot::Thawing | Slot::Moving | Slot::Incoming(_) => {
                    s.in_transition += 1
                }
            }
        }
        let c = &self.inner.counters;
        s.suspends = c.suspends.load(Ordering::Relaxed);
        s.resumes = c.resumes.load(Ordering::Relaxed);
        s.discarded = c.discarded.load(Ordering::Relaxed);
        s.corrupt = c.corrupt.load(Ordering::Relaxed);
        s.refused = c.refused.load(Ordering::Relaxed);
        s.moves_out = c.moves_out.load(Ordering::Relaxed);
        s.moves_in = c.moves_in.load(Ordering::Relaxed);
        s.claimed = c.claimed.load(Ordering::Relaxed);
        s.unshared = c.unshared.load(Ordering::Relaxed);
        s
    }

    /// Ids of the sessions held as continuations.
    pub fn frozen_ids(&self) -> Vec<SessionId> {
        self.inner
            .state()
            .slots
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Frozen(_)))
            .map(|(id, _)| *id)
            .collect()
    }

    /// The continuation store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// Moves session `id` — live or suspended — to host `to` of this host's
    /// cluster (`docs/PROTOCOL.md` §14.3): the destination checks the
    /// session's compatibility vector, the attributes are pre-copied while
    /// it runs, its client is told `MOVE_TO` the destination, its
    /// application is asked for its continuation ([`FreezeReason::Move`]),
    /// and only the changes since the pre-copy travel with the frozen
    /// state. On any failure the session stays here and keeps working, and
    /// the error says why.
    pub async fn move_session(
        &self,
        id: SessionId,
        to: &str,
    ) -> Result<crate::cluster::MoveReport, crate::cluster::MoveError> {
        self.inner.move_session(id, to).await
    }

    /// Moves every session held here to the other hosts of the cluster
    /// (before this host stops): round robin, 32 moves at a time. Sessions
    /// that cannot move stay here and are listed in the report.
    pub async fn drain(&self) -> Result<crate::cluster::DrainReport, crate::cluster::MoveError> {
        self.inner.drain().await
    }

    /// Load shedding: moves the live sessions `policy` selects (older than
    /// T on this host, or heavier than B bytes) to the replicas holding the
    /// fewest sessions, as M-Apache does (Service Continuations §5.2).
    pub async fn shed(
        &self,
        policy: &crate::cluster::ShedPolicy,
    ) -> Result<crate::cluster::DrainReport, crate::cluster::MoveError> {
        self.inner.shed(policy).await
    }

    /// Serves the cluster port on `listener` until `shutdown`: moves from
    /// the other hosts, and the operator's `status`, `move` and `drain`.
    /// Only keys listed in the cluster file get past the handshake.
    pub async fn serve_peers(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> io::Result<()> {
        self.inner.clone().serve_peers(listener, shutdown).await
    }

    /// The sessions held here and their states (`roam cluster status`).
    pub fn sessions(&self) -> Vec<crate::cluster::wire::SessionRow> {
        self.inner.status_rows()
    }
}

impl HostInner {
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn frozen_parent(&self, id: &SessionId) -> Option<SessionId> {
        match self.state().slots.get(id) {
            Some(Slot::Frozen(f)) => f.meta.parent,
            _ => None,
        }
    }

    fn parent_of(st: &State, id: &SessionId) -> Option<SessionId> {
        match st.slots.get(id)? {
            Slot::Live(l) => l.lock().parent,
            Slot::Frozen(f) => f.meta.parent,
            _ => None,
        }
    }

    pub(crate) fn add_dependency(&self, live: &Arc<Live>, parent: SessionId) -> Result<(), Error> {
        let mut st = self.state();
        if !st.slots.contains_key(&parent) {
            return Err(Error::UnknownSession(parent));
        }
        // Walk up from the parent: reaching ourselves would close a cycle.
        let mut p = Some(parent);
        let mut steps = 0;
        while let Some(cur) = p {
            if cur == live.id || steps > st.slots.len() {
                return Err(Error::DependencyCycle(parent));
            }
            p = Self::parent_of(&st, &cur);
            steps += 1;
        }
        let old = live.lock().parent.replace(parent);
        if let Some(old) = old {
            if let Some(set) = st.children.get_mut(&old) {
                set.remove(&live.id);
            }
        }
        st.children.entry(parent).or_default().insert(live.id);
        Ok(())
    }

    async fn freeze_all(&self, reason: FreezeReason, grace: Duration) {
        let ids: Vec<SessionId> = {
            let st = self.state();
            st.slots
                .iter()
                .filter_map(|(id, s)| match s {
                    Slot::Live(l) => {
                        l.request_freeze(reason);
                        Some(*id)
                    }
                    _ => None,
                })
                .collect()
        };
        if ids.is_empty() {
            return;
        }
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let pending = {
                let st = self.state();
                ids.iter()
                    .filter(|id| matches!(st.slots.get(id), Some(Slot::Live(_) | Slot::Freezing)))
                    .count()
            };
            if pending == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                tracing::warn!("{pending} sessions did not produce a continuation in {grace:?}");
                return;
            }
        }
    }

    /// `ManagedSession::suspend`: export, store, forget.
    pub(crate) async fn suspend(
        self: &Arc<Self>,
        live: Arc<Live>,
        handle: SessionHandle,
        cont: Continuation,
    ) -> Result<SuspendReport, SuspendError> {
        let id = live.id;
        {
            let mut st = self.state();
            match st.slots.get(&id) {
                Some(Slot::Live(l)) if Arc::ptr_eq(l, &live) => {
                    st.slots.insert(id, Slot::Freezing);
                }
                _ => return Err(SuspendError::AlreadySuspended),
            }
        }
        // A move tells the client where to go now, as the session's
        // parting words: the application has answered, so nothing here
        // waits any more for credit from the client it sends away.
        let move_to = {
            let st = live.lock();
            st.moving.as_ref().and(st.move_to.clone())
        };
        if let Some(addr) = move_to {
            handle.move_to(addr);
        }
        let detached = match handle.detach().await {
            Ok(d) => d,
            Err(e) => {
                // The session ended meanwhile: nothing to keep.
                live.lock().handle = None;
                self.forget_closed(id, &live, false).await;
                return Err(SuspendError::Export(e));
            }
        };
        // Only now may the stream handles go: the export already holds
        // their state, so their drop (a FIN) reaches nobody.
        let streams: BTreeMap<String, roam::StreamId> = cont
            .streams
            .iter()
            .map(|(n, s)| (n.clone(), s.id()))
            .collect();
        drop(cont.streams);
        drop(handle);
        let now_wall = SystemTime::now();
        let (body, parent, suspended_at, expiry) = {
            let mut st = live.lock();
            st.handle = None;
            let mut requires = st.requires.clone();
            if let Some(v) = live.service.properties.get("version") {
                requires
                    .entry("version".into())
                    .or_insert_with(|| v.clone());
            }
            let body = Body {
                routine: cont.routine,
                attrs: std::mem::take(&mut st.attrs),
                requires,
                streams,
                unaccepted: detached.unaccepted,
                orphans: detached.orphans,
                expiry: st.expiry,
                blob: detached.blob,
            };
            let expiry = st.expiry.unwrap_or(live.service.expiry);
            (
                body,
                st.parent,
                st.suspended.map_or(now_wall, |(_, w)| w),
                expiry,
            )
        };
        let expiry = expiry.min(self.config.server.proto.session.resume_timeout);
        let (revision, mover) = {
            let mut st = live.lock();
            (st.revision, st.moving.take())
        };
        // A move sends only what changed since its pre-copy (and the
        // destination stores it): compressing the whole body here would
        // only lengthen the freeze. Local keeping needs it sealed.
        let (raw_len, stored, digest) = if mover.is_some() {
            (0, Vec::new(), [0u8; 32])
        } else {
            let raw = body.encode();
            let (stored, digest) = seal_body(&raw);
            (raw.len(), stored, digest)
        };
        let meta = Meta {
            service: live.service.name.clone(),
            parent,
            suspended_at,
            frozen_at: now_wall,
            deadline: suspended_at + expiry,
            body_len: raw_len as u64,
            body_digest: digest,
            revision,
        };
        let meta_bytes = meta.encode();
        let report = SuspendReport {
            id,
            protocol_bytes: body.blob.len(),
            raw_bytes: raw_len,
            stored_bytes: stored.len() + meta_bytes.len(),
            persisted: false,
        };
        let record = Record {
            meta,
            body,
            meta_bytes,
            stored,
        };
        let record = match mover {
            Some(tx) => {
                // A move waits for this continuation: it goes to the other
                // host, not to the store (the mover keeps it locally if the
                // move fails).
                self.state().slots.insert(id, Slot::Moving);
                match tx.send(Ok(record)) {
                    Ok(()) => {
                        self.changed.notify_waiters();
                        tracing::debug!("session {id} frozen for its move");
                        return Ok(report);
                    }
                    Err(Ok(back)) => back.sealed(),
                    Err(Err(_)) => unreachable!("sent Ok"),
                }
            }
            None => record,
        };
        let persisted = self.freeze_local(id, record).await;
        Ok(SuspendReport {
            persisted,
            ..report
        })
    }

    /// Keeps a continuation on this host: writes it to the store and puts
    /// its slot to Frozen; asks its dependents for theirs. Returns whether
    /// the store has it (else it is kept in memory only).
    pub(crate) async fn freeze_local(self: &Arc<Self>, id: SessionId, record: Record) -> bool {
        let Record {
            meta,
            body,
            meta_bytes,
            stored,
        } = record;
        let persisted = match self.store.put(id, meta_bytes.clone(), stored.clone()).await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(
                    "session {id}: continuation kept in memory only, the store failed: {e}"
                );
                false
            }
        };
        if persisted {
            self.mirror(id, &meta_bytes, &stored).await;
        }
        let children: Vec<Arc<Live>> = {
            let mut st = self.state();
            let offload_at = persisted.then(|| Instant::now() + self.config.offload_after);
            st.expiries.insert((meta.deadline, id));
            if let Some(t) = offload_at {
                st.offloads.insert((t, id));
            }
            st.slots.insert(
                id,
                Slot::Frozen(Frozen {
                    meta,
                    hot: Some(Arc::new(body)),
                    offload_at,
                    persisted,
                    prepared: None,
                }),
            );
            st.children
                .get(&id)
                .into_iter()
                .flatten()
                .filter_map(|c| match st.slots.get(c) {
                    Some(Slot::Live(l)) => Some(l.clone()),
                    _ => None,
                })
                .collect()
        };
        for c in children {
            c.request_freeze(FreezeReason::ParentSuspended);
        }
        self.counters.suspends.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_waiters();
        self.gc_wake.notify_one();
        tracing::debug!("session {id} suspended into a continuation");
        persisted
    }

    /// Keeps a stored continuation in the cluster's shared directory too
    /// (with etcd): it then survives this host. A failure is logged; the
    /// continuation stays here either way.
    pub(crate) async fn mirror(&self, id: SessionId, meta: &[u8], stored: &[u8]) {
        if let Some(r) = &self.shared {
            if let Err(e) = r.put_record(id, meta, stored).await {
                self.counters.unshared.fetch_add(1, Ordering::Relaxed);
                tracing::error!("session {id}: not kept in the cluster: {e}");
            }
        }
    }

    /// A live session ended (or its suspend found it ended): forget it and
    /// take its dependents with it.
    async fn forget_closed(self: &Arc<Self>, id: SessionId, live: &Arc<Live>, expired: bool) {
        let removed = {
            let mut st = self.state();
            let ours = match st.slots.get(&id) {
                Some(Slot::Live(l)) => Arc::ptr_eq(l, live),
                Some(Slot::Freezing) => true,
                _ => false,
            };
            if ours {
                st.slots.remove(&id);
                if let Some(p) = live.lock().parent {
                    if let Some(set) = st.children.get_mut(&p) {
                        set.remove(&id);
                    }
                }
            }
            ours
        };
        self.changed.notify_waiters();
        if !removed {
            return;
        }
        // Owned in etcd (it moved in, or was suspended here): released, so
        // no other host sends its client here.
        if let Some(r) = self.shared.as_ref().filter(|r| r.owns(id)) {
            r.forget(id).await;
        }
        if expired {
            let attrs = live.lock().attrs.values.clone();
            self.report_discard(&live.service, id, DiscardReason::Expired, attrs);
        }
        let children: Vec<SessionId> = self
            .state()
            .children
            .remove(&id)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default();
        self.discard_many(
            children
                .into_iter()
                .map(|c| (c, DiscardReason::ParentGone(id)))
                .collect(),
        )
        .await;
    }

    async fn live_closed(self: &Arc<Self>, live: &Arc<Live>, expired: bool) {
        self.forget_closed(live.id, live, expired).await;
    }

    fn report_discard(
        &self,
        svc: &Service,
        id: SessionId,
        reason: DiscardReason,
        attrs: BTreeMap<String, Vec<u8>>,
    ) {
        self.counters.discarded.fetch_add(1, Ordering::Relaxed);
        tracing::info!("session {id} ({}) discarded: {reason}", svc.name);
        if let Some(f) = &svc.on_discard {
            f(&Discarded {
                id,
                service: svc.name.clone(),
                reason,
                attrs,
            });
        }
    }

    /// Discards sessions and, transitively, their dependents.
    async fn discard_many(self: &Arc<Self>, mut work: Vec<(SessionId, DiscardReason)>) {
        while let Some((id, reason)) = work.pop() {
            let slot = {
                let mut st = self.state();
                match st.slots.get(&id) {
                    Some(Slot::Live(_) | Slot::Frozen(_)) => st.slots.remove(&id),
                    _ => None,
                }
            };
            let Some(slot) = slot else { continue };
            match slot {
                Slot::Frozen(f) => {
                    {
                        let mut st = self.state();
                        st.expiries.remove(&(f.meta.deadline, id));
                        if let Some(t) = f.offload_at {
                            st.offloads.remove(&(t, id));
                        }
                        if let Some(p) = f.meta.parent {
                            if let Some(set) = st.children.get_mut(&p) {
                                set.remove(&id);
                            }
                        }
                    }
                    let attrs = match &f.hot {
                        Some(b) => b.attrs.values.clone(),
                        None => match self.load(id).await {
                            Ok(Some((_, b))) => b.attrs.values.clone(),
                            _ => BTreeMap::new(),
                        },
                    };
                    if let Err(e) = self.store.delete(vec![id]).await {
                        tracing::error!("session {id}: deleting its continuation failed: {e}");
                    }
                    if let Some(r) = &self.shared {
                        r.forget(id).await;
                    }
                    if let Some(svc) = self.services.get(&f.meta.service).cloned() {
                        self.report_discard(&svc, id, reason, attrs);
                    } else {
                        self.counters.discarded.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(
                            "session {id} (service {} not here) discarded: {reason}",
                            f.meta.service
                        );
                    }
                }
                Slot::Live(l) => {
                    let handle = {
                        let mut st = l.lock();
                        st.suspending = true;
                        st.handle.take()
                    };
                    {
                        let mut st = self.state();
                        if let Some(p) = l.lock().parent {
                            if let Some(set) = st.children.get_mut(&p) {
                                set.remove(&id);
                            }
                        }
                    }
                    // Taking it out of roam frees its driver and sockets at
                    // once, without waiting for a peer that may never ack.
                    if let Some(h) = handle {
                        let _ = h.detach().await;
                    }
                    if let Some(r) = self.shared.as_ref().filter(|r| r.owns(id)) {
                        r.forget(id).await;
                    }
                    let attrs = l.lock().attrs.values.clone();
                    self.report_discard(&l.service, id, reason, attrs);
                }
                Slot::Freezing | Slot::Thawing | Slot::Moving | Slot::Incoming(_) => {
                    unreachable!("filtered above")
                }
            }
            let children = self.state().children.remove(&id);
            for c in children.into_iter().flatten() {
                work.push((c, DiscardReason::ParentGone(id)));
            }
            self.changed.notify_waiters();
        }
    }
}
