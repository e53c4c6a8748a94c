//! The application's side of one session: [`ManagedSession`] (attribute
//! store, handlers, freeze requests, `suspend`), the [`Continuation`] it
//! returns, and the [`Resumed`] context its resume routine gets.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use roam::{RoamStream, SessionHandle, SessionId, SuspendReason};
use tokio::sync::watch;

use crate::attrs::{AttrError, AttrStore, MAX_NAME_LEN};
use crate::error::{Error, SuspendError};
use crate::host::HostInner;
use crate::service::{Generation, Service};

/// Why roam asks a session's application for its continuation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FreezeReason {
    /// The session was suspended and its service generates eagerly.
    Suspended,
    /// Lazy generation: the session has been suspended longer than allowed.
    SuspendedTooLong,
    /// The session it depends on was suspended.
    ParentSuspended,
    /// [`Host::freeze`](crate::Host::freeze) asked for it.
    Requested,
    /// The host is shutting down and keeps its sessions for the next process.
    Shutdown,
    /// The session is moving to another host of the cluster
    /// ([`Host::move_session`](crate::Host::move_session)): the
    /// continuation goes to that host, and the client is told to resume
    /// there as the session is exported.
    Move,
}

pub(crate) type SuspendedHandler = Arc<dyn Fn(SuspendReason) + Send + Sync>;
pub(crate) type ResumedHandler = Arc<dyn Fn(Duration) + Send + Sync>;

/// Per-session state the host and the application share while the session
/// is live (has a roam driver).
pub(crate) struct Live {
    pub(crate) id: SessionId,
    pub(crate) service: Arc<Service>,
    pub(crate) st: Mutex<LiveState>,
    /// `Some` while roam wants a continuation.
    pub(crate) freeze: watch::Sender<Option<FreezeReason>>,
    /// Since when it is live on this host (for load shedding by age).
    pub(crate) since: Instant,
}

pub(crate) struct LiveState {
    pub(crate) attrs: AttrStore,
    pub(crate) requires: BTreeMap<String, String>,
    pub(crate) parent: Option<SessionId>,
    pub(crate) expiry: Option<Duration>,
    pub(crate) generation: Option<Generation>,
    /// Since when the session has been without a transport (monotonic, wall).
    pub(crate) suspended: Option<(Instant, SystemTime)>,
    pub(crate) on_suspended: Vec<SuspendedHandler>,
    pub(crate) on_resumed: Vec<ResumedHandler>,
    /// The host's handle: lets it close the session (cascades, expiry).
    /// Dropped when the application drops its [`ManagedSession`], so an
    /// abandoned session closes as a plain roam session would.
    pub(crate) handle: Option<SessionHandle>,
    /// `suspend` has started: no second one, no abandonment close.
    pub(crate) suspending: bool,
    /// Ownership revision in the cluster (0 until the session first moved).
    pub(crate) revision: u64,
    /// A move in progress waits here for the session's continuation.
    /// The application's answer: the continuation, or why it declined
    /// ([`ManagedSession::decline_freeze`]).
    pub(crate) moving:
        Option<tokio::sync::oneshot::Sender<Result<crate::cluster::Handover, String>>>,
    /// Where the client is sent (MOVE_TO) when the application answers a
    /// move's freeze: not before, or a client already gone would stop the
    /// credit an application blocked in a write waits for.
    pub(crate) move_to: Option<String>,
}

impl Live {
    pub(crate) fn new(
        id: SessionId,
        service: Arc<Service>,
        attrs: AttrStore,
        handle: SessionHandle,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            service,
            st: Mutex::new(LiveState {
                attrs,
                requires: BTreeMap::new(),
                parent: None,
                expiry: None,
                generation: None,
                suspended: None,
                on_suspended: Vec::new(),
                on_resumed: Vec::new(),
                handle: Some(handle),
                suspending: false,
                revision: 0,
                moving: None,
                move_to: None,
            }),
            freeze: watch::Sender::new(None),
            since: Instant::now(),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, LiveState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the application for a continuation (first reason wins).
    pub(crate) fn request_freeze(&self, reason: FreezeReason) {
        self.freeze.send_if_modified(|r| {
            if r.is_none() {
                *r = Some(reason);
                true
            } else {
                false
            }
        });
    }

    /// Withdraws a move's freeze request (the move failed before the
    /// application answered).
    pub(crate) fn withdraw_move(&self) {
        {
            let mut st = self.lock();
            st.moving = None;
            st.move_to = None;
        }
        self.freeze.send_if_modified(|r| {
            if matches!(r, Some(FreezeReason::Move)) {
                *r = None;
                true
            } else {
                false
            }
        });
    }

    /// Withdraws a request that only concerned the lost transport.
    pub(crate) fn withdraw_freeze(&self) {
        self.freeze.send_if_modified(|r| {
            if matches!(
                r,
                Some(FreezeReason::Suspended | FreezeReason::SuspendedTooLong)
            ) {
                *r = None;
                true
            } else {
                false
            }
        });
    }

    pub(crate) fn generation(&self) -> Generation {
        self.lock().generation.unwrap_or(self.service.generation)
    }

    pub(crate) fn expiry(&self) -> Duration {
        self.lock().expiry.unwrap_or(self.service.expiry)
    }
}

/// What an application returns to suspend a session (the paper's internal
/// continuation): the resume routine to run, by name, and the streams to
/// carry over, by name. The session's attributes go with it.
///
/// ```no_run
/// # async fn demo(session: roam_continuation::ManagedSession, stream: roam::RoamStream) {
/// use roam_continuation::Continuation;
/// session.store("next", 42u64.to_le_bytes()).unwrap();
/// let cont = Continuation::new("updates").stream("updates", stream);
/// session.suspend(cont).await.unwrap();
/// # }
/// ```
#[derive(Debug)]
pub struct Continuation {
    pub(crate) routine: String,
    pub(crate) streams: Vec<(String, RoamStream)>,
}

impl Continuation {
    /// A continuation that resumes with the service's routine `routine`.
    pub fn new(routine: impl Into<String>) -> Self {
        Self {
            routine: routine.into(),
            streams: Vec::new(),
        }
    }

    /// Carries `stream` over under `name`: the resume routine gets it back
    /// with [`Resumed::take_stream`], at the same offsets in both directions.
    /// The handle is dropped only after the session was exported, so the
    /// drop does not finish the stream.
    pub fn stream(mut self, name: impl Into<String>, stream: RoamStream) -> Self {
        self.streams.push((name.into(), stream));
        self
    }
}

/// What [`ManagedSession::suspend`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SuspendReport {
    /// The session.
    pub id: SessionId,
    /// Size of the protocol continuation (PROTOCOL.md §13), bytes.
    pub protocol_bytes: usize,
    /// Size of the whole record before compression, bytes.
    pub raw_bytes: usize,
    /// Size as stored (meta entry plus zstd-compressed body), bytes.
    pub stored_bytes: usize,
    /// Whether it reached the disk. If not (the store failed; see the log),
    /// it is kept in memory only and lost if this process ends.
    pub persisted: bool,
}

/// The context a resume routine gets.
#[derive(Debug)]
pub struct Resumed {
    /// The restored session, with its attributes.
    pub session: ManagedSession,
    /// The routine the continuation named.
    pub routine: String,
    /// How long the session had been suspended when it was restored.
    pub suspended_for: Duration,
    pub(crate) streams: BTreeMap<String, RoamStream>,
    /// What the service's `prepare_move_in` started for this session when
    /// it moved in, if it is still kept.
    pub(crate) prepared: Option<crate::service::Prepared>,
}

impl Resumed {
    /// Takes what the service's
    /// [`prepare_move_in`](crate::Service::prepare_move_in) started for
    /// this session when it moved to this host, if it is of type `T` and
    /// still kept (`None` at any other resume, or once it was dropped:
    /// start afresh from the attributes then).
    pub fn take_prepared<T: 'static>(&mut self) -> Option<T> {
        let p = self.prepared.take()?;
        match p.0.downcast::<T>() {
            Ok(v) => Some(*v),
            Err(other) => {
                self.prepared = Some(crate::service::Prepared(other));
                None
            }
        }
    }

    /// Takes the stream the continuation carried over under `name`.
    pub fn take_stream(&mut self, name: &str) -> Option<RoamStream> {
        self.streams.remove(name)
    }

    /// Names of the streams carried over and not yet taken.
    pub fn stream_names(&self) -> impl Iterator<Item = &str> {
        self.streams.keys().map(String::as_str)
    }
}

/// One session under the host's management. Owned by the application's task
/// for that session; dropping it (without [`suspend`](Self::suspend)) lets
/// the session close once its streams are dropped too, as a plain roam
/// session would.
///
/// The methods follow the paper's Table I: [`store`](Self::store),
/// [`retrieve`](Self::retrieve), [`store_size`](Self::store_size),
/// [`export`](Self::export), handlers ([`on_suspended`](Self::on_suspended),
/// [`on_resumed`](Self::on_resumed)), [`require`](Self::require)
/// (`compat_store`), and [`suspend`](Self::suspend) (`return_cont`) in answer
/// to [`freeze_requested`](Self::freeze_requested) (`freeze`).
pub struct ManagedSession {
    pub(crate) live: Arc<Live>,
    pub(crate) host: Arc<HostInner>,
    pub(crate) handle: SessionHandle,
    pub(crate) freeze_rx: watch::Receiver<Option<FreezeReason>>,
    /// Set once `suspend` took over: the drop must not release the session.
    consumed: bool,
}

impl std::fmt::Debug for ManagedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedSession")
            .field("id", &self.live.id)
            .field("service", &self.live.service.name)
            .finish_non_exhaustive()
    }
}

impl Drop for ManagedSession {
    fn drop(&mut self) {
        if !self.consumed {
            let mut st = self.live.lock();
            if !st.suspending {
                st.handle = None;
                // A move waiting for this session's continuation will not
                // get it: called off now, not at its freeze timeout.
                if let Some(tx) = st.moving.take() {
                    let _ = tx.send(Err(
                        "the application dropped the session without suspending it".into(),
                    ));
                }
            }
        }
    }
}

impl ManagedSession {
    pub(crate) fn new(live: Arc<Live>, host: Arc<HostInner>, handle: SessionHandle) -> Self {
        let freeze_rx = live.freeze.subscribe();
        Self {
            live,
            host,
            handle,
            freeze_rx,
            consumed: false,
        }
    }

    /// The session id.
    pub fn id(&self) -> SessionId {
        self.live.id
    }

    /// The roam session: streams, events, stats.
    pub fn handle(&self) -> &SessionHandle {
        &self.handle
    }

    /// The name of the service the session belongs to.
    pub fn service(&self) -> &str {
        &self.live.service.name
    }

    /// Stores `value` under `name`, replacing any earlier value. Attributes
    /// are part of the continuation and survive a suspension and a restart.
    pub fn store(&self, name: &str, value: impl AsRef<[u8]>) -> Result<(), AttrError> {
        self.live.lock().attrs.store(name, value.as_ref())
    }

    /// The value stored under `name`.
    pub fn retrieve(&self, name: &str) -> Option<Vec<u8>> {
        self.live.lock().attrs.values.get(name).cloned()
    }

    /// The size of the value stored under `name`, bytes.
    pub fn store_size(&self, name: &str) -> Option<usize> {
        self.live.lock().attrs.values.get(name).map(Vec::len)
    }

    /// Removes the attribute `name` (and its export mark); returns its value.
    pub fn remove(&self, name: &str) -> Option<Vec<u8>> {
        self.live.lock().attrs.remove(name)
    }

    /// Names of the stored attributes.
    pub fn attr_names(&self) -> Vec<String> {
        self.live.lock().attrs.values.keys().cloned().collect()
    }

    /// Sends the stored attribute `name` to the peer on every resume while
    /// it stays stored, on a stream with metadata `roam/attrs` (format in
    /// [`crate::attrs`]; a client reads it with [`crate::read_attrs`]).
    pub fn export(&self, name: &str) -> Result<(), AttrError> {
        self.live.lock().attrs.export(name)
    }

    /// Stops sending `name` on resumes.
    pub fn unexport(&self, name: &str) {
        self.live.lock().attrs.exported.remove(name);
    }

    /// Records that the session's continuation needs the service's property
    /// `name` to equal `value` wherever it resumes (the paper's
    /// `compat_store`). The service's `version` property, if registered, is
    /// always required.
    pub fn require(&self, name: impl Into<String>, value: impl Into<String>) {
        self.live.lock().requires.insert(name.into(), value.into());
    }

    /// Overrides the service's expiry for this session.
    pub fn set_expiry(&self, d: Duration) {
        self.live.lock().expiry = Some(d);
    }

    /// Overrides the service's generation policy for this session.
    pub fn set_generation(&self, g: Generation) {
        self.live.lock().generation = Some(g);
    }

    /// Makes this session depend on `parent` (another session of this host,
    /// live or suspended): when the parent is suspended this session is
    /// asked for its continuation too, and when the parent is discarded or
    /// closes, this session is discarded or closed with it.
    pub fn depend_on(&self, parent: SessionId) -> Result<(), Error> {
        self.host.add_dependency(&self.live, parent)
    }

    /// Calls `f` (on the host's task for this session; keep it short) each
    /// time the session loses its transport.
    pub fn on_suspended(&self, f: impl Fn(SuspendReason) + Send + Sync + 'static) {
        self.live.lock().on_suspended.push(Arc::new(f));
    }

    /// Calls `f` with the suspension's length each time the session resumes
    /// while live (a session restored from its continuation runs its resume
    /// routine instead).
    pub fn on_resumed(&self, f: impl Fn(Duration) + Send + Sync + 'static) {
        self.live.lock().on_resumed.push(Arc::new(f));
    }

    /// Whether the session is without a transport now.
    pub fn is_suspended(&self) -> bool {
        self.live.lock().suspended.is_some()
    }

    /// The pending freeze request, if any.
    pub fn freeze_pending(&self) -> Option<FreezeReason> {
        *self.freeze_rx.borrow()
    }

    /// Resolves when roam wants this session's continuation: at the
    /// suspension (eager), once it has lasted too long (lazy), or when the
    /// host must reclaim resources. Answer with [`suspend`](Self::suspend)
    /// at the application's next quiescent point. Cancel-safe, so it fits a
    /// `tokio::select!` next to the session's I/O.
    pub async fn freeze_requested(&self) -> FreezeReason {
        let mut rx = self.freeze_rx.clone();
        loop {
            if let Some(r) = *rx.borrow_and_update() {
                return r;
            }
            if rx.changed().await.is_err() {
                // The host is gone; nothing will ever ask.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Declines a move's freeze request: the application cannot give its
    /// continuation now (e.g. a service set's save failed: a back-end
    /// refused its part or died). The move waiting for it is called off at
    /// once (`MoveError::Declined` with `why`, instead of waiting out its
    /// freeze timeout) and the request is withdrawn, so
    /// [`freeze_requested`](Self::freeze_requested) does not fire again for
    /// it; the session goes on here. Returns whether a move was waiting.
    /// Any other freeze request stays pending (roam keeps wanting it).
    pub fn decline_freeze(&self, why: impl Into<String>) -> bool {
        let mover = {
            let mut st = self.live.lock();
            if !matches!(*self.live.freeze.borrow(), Some(FreezeReason::Move)) {
                return false;
            }
            st.move_to = None;
            st.moving.take()
        };
        let Some(tx) = mover else { return false };
        let _ = tx.send(Err(why.into()));
        self.live.withdraw_move();
        true
    }

    /// Runs `work`, a step the session must finish before it can give its
    /// continuation (a request a back-end is still answering, a reply half
    /// written), and returns its output. A move that asks for the
    /// continuation meanwhile waits for it at most `bound`: if `work` has
    /// not finished by then, the move is declined
    /// ([`decline_freeze`](Self::decline_freeze), `MoveError::Declined`
    /// naming `what` and the bound) instead of holding the session frozen
    /// to the move's freeze timeout, and the session goes on here; `work`
    /// runs to its end either way. A later move asks again. Other freeze
    /// reasons cannot be declined: they stay pending and `work` simply
    /// finishes (answer them at the next quiescent point).
    ///
    /// Use it around every await of a session's routine that is not a
    /// quiescent point and may take long (a stuck back-end, a slow
    /// database), e.g. with a service set's save bound.
    pub async fn busy<F: std::future::Future>(
        &self,
        what: &str,
        bound: Duration,
        work: F,
    ) -> F::Output {
        let mut work = std::pin::pin!(work);
        loop {
            let reason = tokio::select! {
                biased;
                out = &mut work => return out,
                r = self.freeze_requested() => r,
            };
            if reason != FreezeReason::Move {
                return work.await;
            }
            match tokio::time::timeout(bound, &mut work).await {
                Ok(out) => return out,
                Err(_) => {
                    if self.decline_freeze(format!(
                        "{what} did not finish within {bound:?} of the move's freeze request"
                    )) {
                        tracing::info!(session = %self.id(), what, ?bound, "move declined: the session is busy");
                    }
                    // The move is withdrawn (or was already): wait again,
                    // for `work` or the next move.
                    if self.freeze_pending() == Some(FreezeReason::Move) {
                        // Declining found no waiting mover (it had just
                        // given up): do not spin on its request.
                        return work.await;
                    }
                }
            }
        }
    }

    /// Suspends the session with `cont` (the paper's `return_cont`): roam
    /// exports the session, drops its socket and task, writes the
    /// continuation (protocol state, attributes, routine, stream ids) to the
    /// store in one transaction and forgets everything else. When the client
    /// resumes — in this process or a later one on the same state directory
    /// — the service's routine runs with the restored session.
    ///
    /// Works whether or not the session is suspended right now: an active
    /// client sees its connection drop and resumes into the continuation.
    pub async fn suspend(mut self, cont: Continuation) -> Result<SuspendReport, SuspendError> {
        let svc = &self.live.service;
        if cont.routine.is_empty()
            || cont.routine.len() > MAX_NAME_LEN
            || !svc.routines.contains_key(&cont.routine)
        {
            return Err(SuspendError::UnknownRoutine {
                service: svc.name.clone(),
                routine: cont.routine,
            });
        }
        {
            let mut st = self.live.lock();
            if st.suspending {
                return Err(SuspendError::AlreadySuspended);
            }
            st.suspending = true;
        }
        self.consumed = true;
        let host = self.host.clone();
        let live = self.live.clone();
        let handle = self.handle.clone();
        drop(self);
        host.suspend(live, handle, cont).await
    }
}
