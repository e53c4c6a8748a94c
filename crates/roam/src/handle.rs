//! What the application holds: [`SessionHandle`], its events and stats, and
//! the state it shares with the session's driver task.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Poll, Waker};
use std::time::Duration;

use roam_proto::{
    CloseReason, PublicKey, Role, Session, SessionId, State, StreamId, SuspendReason,
};
use roam_proto::{ExportError, StreamError};
use tokio::sync::{broadcast, oneshot, Notify};

use crate::detach::{Detached, LiveTransport};
use crate::stream::RoamStream;
use crate::Error;

/// Capacity of the application event channel; slow receivers see `Lagged`.
/// Its slots are allocated up front (about 110 bytes each), which is why the
/// channel is created only once someone subscribes ([`Events`]).
const EVENT_CAPACITY: usize = 256;

/// Session life events for the application (see [`SessionHandle::events`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum SessionEvent {
    /// The session is established and both keys are proven.
    Connected {
        /// The session's id on its server.
        session_id: SessionId,
        /// The peer's static key.
        peer_key: PublicKey,
    },
    /// The transport was lost; streams stay open while the session is resumable.
    Suspended {
        /// Why the transport was lost.
        reason: SuspendReason,
    },
    /// Client: a re-dial is scheduled.
    Redialing {
        /// Attempts since the last success (1 is the first).
        attempt: u32,
        /// How long until it goes out.
        delay: Duration,
    },
    /// Server: a resume that reached this side ended before it completed
    /// (its transport closed, or the handshake timed out); the session is
    /// still suspended. A host that restored the session for this resume
    /// can put it away again at once.
    ResumeAbandoned,
    /// A new transport took over; unacknowledged data is being replayed.
    Resumed {
        /// How long the session had no transport.
        suspended_for: Duration,
        /// Stream payload bytes this side retransmits.
        bytes_replayed: u64,
        /// Reliable frames this side retransmits.
        frames_replayed: u64,
    },
    /// Client: the server refused a resume in clear (it does not know the
    /// session, or the resume did not authenticate). Such refusals are
    /// unauthenticated, so the session goes on retrying; it ends with the
    /// error only when refusals persist for `refusal_grace` (PROTOCOL.md §12).
    ResumeRefused {
        /// `UnknownSession` or `ResumeRejected`.
        error: roam_proto::Error,
    },
    /// The peer came back from another address.
    PeerAddressChanged {
        /// Its previous address.
        from: Option<SocketAddr>,
        /// Its address now.
        to: Option<SocketAddr>,
    },
    /// The session is over.
    Closed {
        /// Why.
        reason: CloseReason,
    },
    /// The session was taken out of its driver by
    /// [`SessionHandle::detach`]: it lives on only in the continuation.
    Detached,
    /// Server: the client asks to be moved to another host of the
    /// cluster (`docs/PROTOCOL.md` §9.4); a cluster host does it.
    MoveAsked {
        /// The host's name; empty for "any host you choose".
        host: String,
    },
}

/// A snapshot of a session for status displays.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SessionStats {
    /// The session id, once known.
    pub session_id: Option<SessionId>,
    /// Client or server end.
    pub role: Role,
    /// Where the session is in its life.
    pub state: State,
    /// The peer's address on the latest transport.
    pub peer_addr: Option<SocketAddr>,
    /// The peer's proven static key.
    pub peer_key: Option<PublicKey>,
    /// Latest measured round-trip time.
    pub rtt: Option<Duration>,
    /// Stream payload bytes sent (first transmissions).
    pub bytes_sent: u64,
    /// Stream payload bytes received.
    pub bytes_received: u64,
    /// Stream payload bytes retransmitted after resumes.
    pub bytes_replayed: u64,
    /// Successful resumes.
    pub resumes: u64,
    /// Transports used so far.
    pub transports: u64,
    /// Streams currently open.
    pub streams: usize,
    /// How long the session has been without a transport, if it is suspended.
    pub suspended_for: Option<Duration>,
    /// Times the session's driver woke up and ran its loop: a diagnostic for
    /// wake-up storms (a driver that spins instead of sleeping).
    pub driver_wakeups: u64,
}

/// A [`SessionHandle::detach`] waiting for the driver.
pub(crate) struct DetachRequest {
    /// Take the connection out too ([`SessionHandle::detach_live`]).
    pub(crate) live: bool,
    /// Where the driver answers.
    pub(crate) reply: oneshot::Sender<Result<(Detached, Option<LiveTransport>), ExportError>>,
}

/// Builds the hashers of [`Shared`]'s maps keyed by stream: SipHash under one
/// random key drawn once per process. Unlike `RandomState`, which carries its
/// key in every map (16 bytes each), it has no size, and the 64 bytes it
/// saves in every session count in a suspended one. The key stays secret, so
/// a peer choosing its stream ids still cannot aim at collisions.
#[derive(Clone, Copy, Default)]
pub(crate) struct StreamHasher;

impl std::hash::BuildHasher for StreamHasher {
    type Hasher = std::collections::hash_map::DefaultHasher;

    fn build_hasher(&self) -> Self::Hasher {
        static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
            std::sync::OnceLock::new();
        KEY.get_or_init(Default::default).build_hasher()
    }
}

/// A map keyed by stream, with [`StreamHasher`].
pub(crate) type StreamMap<V> = HashMap<StreamId, V, StreamHasher>;

/// A set of streams, with [`StreamHasher`].
pub(crate) type StreamSet = HashSet<StreamId, StreamHasher>;

/// State shared by the driver and the application handles, behind one mutex.
pub(crate) struct Shared {
    pub(crate) session: Session,
    pub(crate) read_wakers: StreamMap<Waker>,
    /// Tasks waiting for send-buffer room (woken together: the protocol only
    /// reports writability per stream, but room is also shared session-wide).
    pub(crate) write_wakers: StreamMap<Waker>,
    /// Tasks waiting for the session to end (and `connect`, for it to connect).
    pub(crate) closed_wakers: Vec<Waker>,
    /// Set when the session is over. Boxed: 8 bytes instead of 72 in every
    /// session that is not over (suspended ones included).
    pub(crate) closed: Option<Box<CloseReason>>,
    /// What few sessions use, or use only for a while ([`Rare`]).
    pub(crate) rare: Option<Box<Rare>>,
    /// The first handshake completed.
    pub(crate) connected: bool,
    /// Every application handle was dropped: close and let the driver finish.
    pub(crate) abandoned: bool,
    /// The application asked for an immediate re-dial.
    pub(crate) redial_requested: bool,
    /// Iterations of the driver loop so far ([`SessionStats::driver_wakeups`]).
    pub(crate) driver_wakeups: u64,
    /// Taken out by [`SessionHandle::detach`]: the continuation owns every
    /// byte now, so stream reads and writes fail (a read would deliver bytes
    /// the continuation delivers again; a write would go nowhere).
    pub(crate) detached: bool,
}

/// The parts of [`Shared`] that most sessions never use, or use only for a
/// moment, in one box made on first use and dropped once it is empty again
/// ([`Shared::tidy`]). A session without them (a suspended client's above
/// all) keeps 8 bytes for them instead of 176, and its whole state
/// ([`Inner`]) fits the allocator's 1,024-byte class instead of the
/// 1,280-byte one, whose slabs the buffers of active sessions fragment.
#[derive(Default)]
pub(crate) struct Rare {
    /// Peer-opened streams not yet taken by `accept_stream`.
    pub(crate) incoming: VecDeque<StreamId>,
    /// Tasks waiting in `accept_stream`.
    pub(crate) accept_wakers: Vec<Waker>,
    /// Streams whose handle was dropped before end-of-stream: the driver reads
    /// and discards their data so flow-control credit keeps flowing.
    pub(crate) orphans: StreamSet,
    /// Addresses the server announced (client side).
    pub(crate) addresses: Vec<String>,
    /// Codes of streams the peer reset. The protocol forgets a reset stream
    /// at once, so later reads would only say "unknown stream"; this keeps
    /// the code until the stream's handle is dropped.
    pub(crate) resets: StreamMap<u64>,
    /// [`SessionHandle::detach`] is waiting for the driver to export and stop.
    pub(crate) detach: Option<DetachRequest>,
    /// The session's journal ([`SessionHandle::set_journal`]), kept by the
    /// driver after each transmit.
    pub(crate) journal: Option<crate::journal::Journal>,
}

impl Rare {
    /// Holds nothing: the box can go.
    fn is_empty(&self) -> bool {
        self.incoming.is_empty()
            && self.accept_wakers.is_empty()
            && self.orphans.is_empty()
            && self.addresses.is_empty()
            && self.resets.is_empty()
            && self.detach.is_none()
            && self.journal.is_none()
    }
}

impl Shared {
    pub(crate) fn new(session: Session) -> Self {
        Self {
            session,
            read_wakers: StreamMap::default(),
            write_wakers: StreamMap::default(),
            closed_wakers: Vec::new(),
            closed: None,
            rare: None,
            connected: false,
            abandoned: false,
            redial_requested: false,
            driver_wakeups: 0,
            detached: false,
        }
    }

    /// The seldom-used parts, made on first use.
    pub(crate) fn rare(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    /// The seldom-used parts if there are any (made by nothing).
    pub(crate) fn rare_if_any(&mut self) -> Option<&mut Rare> {
        self.rare.as_deref_mut()
    }

    /// Drops the seldom-used parts once they hold nothing (the driver calls
    /// it at every turn).
    pub(crate) fn tidy(&mut self) {
        if self.rare.as_ref().is_some_and(|r| r.is_empty()) {
            self.rare = None;
        }
    }

    /// Addresses the server announced (client side).
    pub(crate) fn addresses(&self) -> &[String] {
        self.rare.as_ref().map_or(&[], |r| &r.addresses)
    }

    /// Whether the stream's handle was dropped before its end.
    pub(crate) fn is_orphan(&self, id: StreamId) -> bool {
        self.rare.as_ref().is_some_and(|r| r.orphans.contains(&id))
    }

    /// Forgets an orphaned stream; says whether it was one.
    pub(crate) fn unorphan(&mut self, id: StreamId) -> bool {
        self.rare_if_any().is_some_and(|r| r.orphans.remove(&id))
    }

    /// The code the peer reset the stream with, if it did.
    pub(crate) fn reset_code(&self, id: StreamId) -> Option<u64> {
        self.rare.as_ref().and_then(|r| r.resets.get(&id).copied())
    }

    pub(crate) fn wake_writers(&mut self) {
        for (_, w) in self.write_wakers.drain() {
            w.wake();
        }
    }

    pub(crate) fn wake_all(&mut self) {
        self.wake_writers();
        for (_, w) in self.read_wakers.drain() {
            w.wake();
        }
        if let Some(r) = self.rare_if_any() {
            for w in r.accept_wakers.drain(..) {
                w.wake();
            }
        }
        for w in self.closed_wakers.drain(..) {
            w.wake();
        }
    }
}

/// The session's event channel, created by its first subscriber: most
/// server sessions never have one, and an unused channel would cost its
/// slots for the session's whole life (suspended ones included).
#[derive(Default)]
pub(crate) struct Events(OnceLock<broadcast::Sender<SessionEvent>>);

impl Events {
    /// Tells the subscribers, if there are any.
    pub(crate) fn send(&self, ev: SessionEvent) {
        if let Some(tx) = self.0.get() {
            let _ = tx.send(ev);
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<SessionEvent> {
        self.0
            .get_or_init(|| broadcast::channel(EVENT_CAPACITY).0)
            .subscribe()
    }
}

/// The session state plus the means to wake its driver and tell the application.
pub(crate) struct Inner {
    pub(crate) shared: Mutex<Shared>,
    /// Wakes the driver after an application call that may have output.
    pub(crate) notify: Notify,
    pub(crate) events: Events,
}

impl Inner {
    pub(crate) fn new(session: Session) -> Arc<Self> {
        Arc::new(Self {
            shared: Mutex::new(Shared::new(session)),
            notify: Notify::new(),
            events: Events::default(),
        })
    }

    /// Locks the shared state. A panic while holding the lock leaves the
    /// session state possibly inconsistent, but reporting that through every
    /// handle is worse than carrying on, so poisoning is ignored.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stats(&self) -> SessionStats {
        let sh = self.lock();
        let s = &sh.session;
        let st = s.stats();
        let now = tokio::time::Instant::now().into_std();
        SessionStats {
            session_id: s.id(),
            role: s.role(),
            state: s.state(),
            peer_addr: s.peer_addr(),
            peer_key: s.peer_key(),
            rtt: st.rtt,
            bytes_sent: st.bytes_sent,
            bytes_received: st.bytes_received,
            bytes_replayed: st.bytes_replayed,
            resumes: st.resumes,
            transports: st.transports,
            streams: s.stream_count(),
            suspended_for: s
                .suspended_since()
                .map(|t| now.saturating_duration_since(t)),
            driver_wakeups: sh.driver_wakeups,
        }
    }
}

/// Closes the session once the last application handle (session handle or
/// stream) is gone.
pub(crate) struct Guard(pub(crate) Arc<Inner>);

impl Drop for Guard {
    fn drop(&mut self) {
        let mut sh = self.0.lock();
        sh.abandoned = true;
        sh.session.close(roam_proto::code::NO_ERROR, "");
        drop(sh);
        self.0.notify.notify_one();
    }
}

/// A live roam session. Cheap to clone; the session closes gracefully when the
/// last handle and the last of its streams are dropped.
#[derive(Clone)]
pub struct SessionHandle {
    guard: Arc<Guard>,
}

impl std::fmt::Debug for SessionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHandle")
            .field("id", &self.guard.0.lock().session.id())
            .finish()
    }
}

impl SessionHandle {
    pub(crate) fn new(inner: Arc<Inner>) -> Self {
        Self {
            guard: Arc::new(Guard(inner)),
        }
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.guard.0
    }

    /// Opens a stream carrying `meta` (for the roam relay: the target
    /// `host:port`). Usable at once, even while suspended: writes are buffered
    /// until a transport carries them.
    pub fn open_stream(&self, meta: &[u8]) -> Result<RoamStream, Error> {
        let mut sh = self.inner().lock();
        if let Some(reason) = sh.closed.as_deref() {
            return Err(Error::Closed(reason.clone()));
        }
        let id = sh.session.open_stream(meta)?;
        drop(sh);
        self.inner().notify.notify_one();
        Ok(RoamStream::new(self.guard.clone(), id))
    }

    /// Waits for the peer to open a stream; returns it with its metadata.
    pub async fn accept_stream(&self) -> Result<(RoamStream, Vec<u8>), Error> {
        let inner = self.inner().clone();
        let id = poll_fn(|cx| {
            let mut sh = inner.lock();
            if let Some(id) = sh.rare_if_any().and_then(|r| r.incoming.pop_front()) {
                return Poll::Ready(Ok(id));
            }
            if let Some(reason) = sh.closed.as_deref() {
                return Poll::Ready(Err(Error::Closed(reason.clone())));
            }
            let waiting = &mut sh.rare().accept_wakers;
            if !waiting.iter().any(|w| w.will_wake(cx.waker())) {
                waiting.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await?;
        let meta = self
            .inner()
            .lock()
            .session
            .stream_meta(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        Ok((RoamStream::new(self.guard.clone(), id), meta))
    }

    /// Subscribes to session life events (suspend, resume, address change, close).
    pub fn events(&self) -> broadcast::Receiver<SessionEvent> {
        self.inner().events.subscribe()
    }

    /// A snapshot of the session's state and counters.
    pub fn stats(&self) -> SessionStats {
        self.inner().stats()
    }

    /// The session id (known once connected).
    pub fn id(&self) -> Option<SessionId> {
        self.inner().lock().session.id()
    }

    /// The peer's proven static key. A client records it for trust on first use.
    pub fn peer_key(&self) -> Option<PublicKey> {
        self.inner().lock().session.peer_key()
    }

    /// Addresses the server announced for this session (client side).
    pub fn server_addresses(&self) -> Vec<String> {
        self.inner().lock().addresses().to_vec()
    }

    /// Client: if the session is suspended, re-dial at once instead of
    /// waiting out the backoff — for applications that learn the network is
    /// back by other means (a resume-from-sleep hook, a VPN coming up).
    /// Linux link and address changes already do this automatically.
    pub fn redial_now(&self) {
        self.inner().lock().redial_requested = true;
        self.inner().notify.notify_one();
    }

    /// Client: asks the server to move this session to host `host` of its
    /// cluster (its name in the cluster file; empty lets the server choose,
    /// e.g. the least loaded). The request is reliable and survives
    /// suspension; the server may decline (it is not in a cluster, no such
    /// host, the move failed), and a move that happens shows as a short
    /// stall. The same request goes out on its own with
    /// [`ClientConfig::move_when_slow`](crate::ClientConfig::move_when_slow).
    pub fn ask_move(&self, host: &str) {
        self.inner().lock().session.ask_move(host.to_string());
        self.inner().notify.notify_one();
    }

    /// Server: asks the client to resume at `addr` (`host:port`).
    pub fn move_to(&self, addr: String) {
        self.inner().lock().session.move_to(addr);
        self.inner().notify.notify_one();
    }

    /// Closes the session: everything already written is delivered first, then
    /// the peer learns `code`. Waits until the session is over (wrap it in a
    /// timeout: a suspended peer may never acknowledge).
    pub async fn close(&self, code: u64, reason: &str) -> CloseReason {
        self.inner().lock().session.close(code, reason);
        self.inner().notify.notify_one();
        self.closed().await
    }

    /// Waits until the session is over and returns why.
    pub async fn closed(&self) -> CloseReason {
        let inner = self.inner().clone();
        poll_fn(|cx| {
            let mut sh = inner.lock();
            if let Some(reason) = sh.closed.as_deref() {
                return Poll::Ready(reason.clone());
            }
            if !sh.closed_wakers.iter().any(|w| w.will_wake(cx.waker())) {
                sh.closed_wakers.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// Whether the session is over.
    pub fn is_closed(&self) -> bool {
        self.inner().lock().closed.is_some()
    }

    /// Whether the session was taken out of this handle's driver
    /// ([`SessionHandle::detach`]): it is not over, it goes on as its
    /// continuation (so it is also [`closed`](SessionHandle::is_closed) here).
    pub fn is_detached(&self) -> bool {
        self.inner().lock().detached
    }

    /// Takes the session out of its driver as a continuation (PROTOCOL.md
    /// §13): the driver exports the session, drops its connections (the peer
    /// sees its transport end and starts resuming), leaves the server's
    /// routing map and stops. Every handle and stream of the session then
    /// fails as closed, and nothing they do reaches the peer; drop them to
    /// free the session's memory. Works while the session is active or
    /// suspended.
    ///
    /// A server puts the session back with
    /// [`serve_with_restore`](crate::serve_with_restore) when its client
    /// resumes. Errors: `NotEstablished` during the first handshake,
    /// `Closed` once the session is over.
    pub async fn detach(&self) -> Result<Detached, ExportError> {
        self.detach_request(false).await.map(|(d, _)| d)
    }

    /// [`SessionHandle::detach`], keeping the connection: when the active
    /// transport is at rest (established, nothing of its handshake pending)
    /// it comes out too, as a [`LiveTransport`] — the socket, its transport
    /// state and the records not yet written — for another process to
    /// continue with an [`Adoption`](crate::Adoption), and the peer sees no
    /// break, only a pause (`docs/PROTOCOL.md` §13.6). Otherwise the
    /// connection is dropped as by `detach` and the peer resumes. Nothing is
    /// written on the connection after this returns: whoever holds the
    /// [`LiveTransport`] must adopt it or drop it.
    pub async fn detach_live(&self) -> Result<(Detached, Option<LiveTransport>), ExportError> {
        self.detach_request(true).await
    }

    async fn detach_request(
        &self,
        live: bool,
    ) -> Result<(Detached, Option<LiveTransport>), ExportError> {
        let (reply, rx) = oneshot::channel();
        {
            let mut sh = self.inner().lock();
            if sh.closed.is_some() {
                return Err(ExportError::Closed);
            }
            sh.rare().detach = Some(DetachRequest { live, reply });
        }
        self.inner().notify.notify_one();
        rx.await.unwrap_or(Err(ExportError::Closed))
    }

    /// Keeps a journal of the session from now on: a copy of its
    /// continuation handed to `writer` before any byte that would make an
    /// older copy unresumable leaves for the peer (see [`JournalEntry`](crate::JournalEntry)), so that
    /// the latest copy can be restored (`resume`) after this process is
    /// killed. The first copy is written at once. A writer that fails ends
    /// the journal (later copies would be stale): it should remove what it
    /// wrote and say so. Replaces an earlier journal.
    pub fn set_journal(&self, writer: crate::JournalWriter) {
        self.inner().lock().rare().journal = Some(crate::journal::Journal::new(writer));
        self.inner().notify.notify_one();
    }

    /// The ids of the streams the session holds (e.g. after a restore),
    /// in id order.
    pub fn stream_ids(&self) -> Vec<StreamId> {
        self.inner().lock().session.stream_ids()
    }

    /// How far stream `id` has come (bytes written and read by the
    /// application, ends), `None` for a stream the session does not know.
    pub fn stream_progress(&self, id: StreamId) -> Option<roam_proto::StreamProgress> {
        self.inner().lock().session.stream_progress(id)
    }

    /// Stops the journal ([`set_journal`](Self::set_journal)), if any: no
    /// copy is written after this returns.
    pub fn clear_journal(&self) {
        if let Some(r) = self.inner().lock().rare_if_any() {
            r.journal = None;
        }
    }

    /// Copies bytes that arrived on stream `id`, from the `skip`-th unread
    /// one on, into `buf` without taking them (waits until there are
    /// some): they stay in the session, so in its continuation and its
    /// journal, until [`consume`](Self::consume) takes them. `Ok(0)` is
    /// end-of-stream (nothing past `skip`, and the peer finished). Use it,
    /// rather than the stream's `read`, to take bytes only once they are
    /// somewhere safe (written out, say); `skip` looks past bytes already
    /// on their way. Do not read the stream's handle meanwhile.
    pub async fn peek(&self, id: StreamId, skip: usize, buf: &mut [u8]) -> Result<usize, Error> {
        poll_fn(|cx| {
            let mut sh = self.inner().lock();
            if sh.detached {
                return Poll::Ready(Err(Error::Stream(StreamError::SessionClosed)));
            }
            match sh.session.peek(id, skip, buf) {
                Ok(Some(n)) => Poll::Ready(Ok(n)),
                Ok(None) => {
                    sh.read_wakers.insert(id, cx.waker().clone());
                    Poll::Pending
                }
                Err(e) => Poll::Ready(Err(stream_failure(&sh, id, e))),
            }
        })
        .await
    }

    /// Takes the first `n` bytes [`peek`](Self::peek) showed on stream `id`
    /// (their window is granted back to the peer); `n == 0` takes a peeked
    /// end-of-stream.
    pub fn consume(&self, id: StreamId, n: usize) -> Result<(), Error> {
        let inner = self.inner();
        let mut sh = inner.lock();
        if sh.detached {
            return Err(Error::Stream(StreamError::SessionClosed));
        }
        let log_before = sh.session.unacked_frames();
        let mut scratch = [0u8; 4096];
        let mut left = n;
        loop {
            let want = left.clamp(1, scratch.len());
            match sh.session.read(id, &mut scratch[..want]) {
                Ok(Some(k)) if k > 0 && k <= left => left -= k,
                Ok(Some(0)) if left == 0 => break,
                Ok(_) => {
                    return Err(Error::Io(std::io::Error::other(format!(
                        "consume: {left} of {n} bytes were not there to take"
                    ))))
                }
                Err(e) => return Err(stream_failure(&sh, id, e)),
            }
            if left == 0 && n > 0 {
                break;
            }
        }
        // Taking bytes may have queued a window update: let the driver send it.
        let wake = sh.session.unacked_frames() > log_before;
        drop(sh);
        if wake {
            inner.notify.notify_one();
        }
        Ok(())
    }

    /// A handle to a stream the session already holds, e.g. after a restore
    /// (the continuation records stream ids, not handles). Takes the stream
    /// out of the `accept_stream` queue if it was waiting there and stops
    /// discarding its input if its earlier handle was dropped. Keep at most
    /// one handle per stream: two would interleave reads and writes.
    pub fn stream(&self, id: StreamId) -> Result<RoamStream, Error> {
        let mut sh = self.inner().lock();
        if let Some(reason) = sh.closed.as_deref() {
            return Err(Error::Closed(reason.clone()));
        }
        if sh.session.stream_meta(id).is_none() {
            return Err(Error::Stream(StreamError::UnknownStream));
        }
        if let Some(r) = sh.rare_if_any() {
            r.incoming.retain(|s| *s != id);
            r.orphans.remove(&id);
        }
        drop(sh);
        Ok(RoamStream::new(self.guard.clone(), id))
    }
}

/// The error of a stream operation made through the session handle.
fn stream_failure(sh: &Shared, id: StreamId, e: StreamError) -> Error {
    if let (StreamError::UnknownStream, Some(code)) = (e, sh.reset_code(id)) {
        return Error::Stream(StreamError::Reset(code));
    }
    match (sh.closed.as_deref(), e) {
        (Some(reason), StreamError::SessionClosed | StreamError::UnknownStream) => {
            Error::Closed(reason.clone())
        }
        (_, e) => Error::Stream(e),
    }
}
#[cfg(all(test, target_pointer_width = "64"))]
mod tests {
    /// A suspended session's state is one allocation that lives as long as
    /// the session: `Arc<Inner>`, the state plus two counts. Above 1,024
    /// bytes it falls into jemalloc's 1,280-byte class, whose five-page
    /// slabs the same-sized buffers of active sessions leave 60 % used
    /// (bench scenario 5 at 10,000 suspended clients: 4.4 KiB of RSS per
    /// session in that class, 3.7 in this one).
    #[test]
    fn a_session_state_fits_the_1024_byte_class() {
        let arc = std::mem::size_of::<super::Inner>() + 2 * std::mem::size_of::<usize>();
        assert!(arc <= 1024, "Arc<Inner> is {arc} bytes");
    }
}
