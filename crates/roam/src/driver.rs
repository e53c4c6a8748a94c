//! The per-session driver task: owns the TCP connections, moves bytes between
//! them and the sans-IO session, runs its timers, dispatches its events and,
//! on a client, re-dials after a suspension.
//!
//! One loop iteration follows the order `roam_proto::Session` documents:
//! inputs (`handle_input` / `handle_transport_closed` / `handle_timeout`), then
//! `poll_transmit` into the named connection's buffer, then `poll_event`, then
//! wait for the next socket readiness, application call, timer, dial result or
//! network change. More records are polled only once the previous ones were
//! (almost) written, so a slow transport pushes back into the session's
//! bounded send buffers instead of into memory here.

use std::future::{pending, poll_fn};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rand::Rng;
use roam_proto::{Event, Hello, Role, SessionId, State, TransportId};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};
use tokio::time::{sleep_until, Instant};

use crate::handle::{Inner, SessionEvent, SessionHandle, Shared};
use crate::netwatch::NetworkChanges;
use crate::server::Registry;

/// Bytes read from a socket at a time.
const READ_CHUNK: usize = 64 * 1024;
/// Ask the session for more records only while less than this is unwritten.
const WRITE_LOW_WATER: usize = 64 * 1024;
/// While output waits for the socket, how often the timers are looked at.
/// The deadlines that are overdue then (ACK, heartbeat) can only be met by
/// sending, which waits for writability; without this floor the driver slept
/// until an instant already past and spun.
const BACKED_UP_TICK: Duration = Duration::from_millis(50);
/// How long a closed transport may take to flush its last bytes.
const RETIRE_LINGER: Duration = Duration::from_secs(1);
/// How long a session whose handles were all dropped may take to close gracefully.
const ABANDON_LINGER: Duration = Duration::from_secs(10);

/// One TCP connection carrying (or about to carry) the session.
pub(crate) struct Conn {
    tid: TransportId,
    sock: TcpStream,
    peer: SocketAddr,
    rbuf: Box<[u8]>,
    /// Records polled from the session, written from `pos` on.
    out: Vec<u8>,
    pos: usize,
    /// Set when the session is done with this transport: flush, then drop by then.
    retire_by: Option<Instant>,
    /// Server: holds a slot of the connection cap for as long as the socket lives.
    _permit: Option<OwnedSemaphorePermit>,
}

impl Conn {
    pub(crate) fn new(
        tid: TransportId,
        sock: TcpStream,
        peer: SocketAddr,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Self {
            tid,
            sock,
            peer,
            rbuf: vec![0u8; READ_CHUNK].into_boxed_slice(),
            out: Vec::new(),
            pos: 0,
            retire_by: None,
            _permit: permit,
        }
    }

    fn unwritten(&self) -> usize {
        self.out.len() - self.pos
    }
}

/// What woke the driver.
enum Io {
    Read(usize, usize),
    Eof(usize),
    Failed(usize, io::Error),
    Wrote,
}

/// Polls every connection: writes pending output, then checks for input.
fn poll_conns(conns: &mut [Conn], cx: &mut Context<'_>) -> Poll<Io> {
    let mut wrote = false;
    for (i, c) in conns.iter_mut().enumerate() {
        while c.pos < c.out.len() {
            match Pin::new(&mut c.sock).poll_write(cx, &c.out[c.pos..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Io::Failed(i, io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => {
                    c.pos += n;
                    wrote = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Io::Failed(i, e)),
                Poll::Pending => break,
            }
        }
        if c.pos == c.out.len() && c.pos > 0 {
            c.out.clear();
            c.pos = 0;
        }
        if c.retire_by.is_none() {
            let mut rb = ReadBuf::new(&mut c.rbuf);
            match Pin::new(&mut c.sock).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    return Poll::Ready(if n == 0 { Io::Eof(i) } else { Io::Read(i, n) });
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Io::Failed(i, e)),
                Poll::Pending => {}
            }
        }
    }
    if wrote {
        Poll::Ready(Io::Wrote)
    } else {
        Poll::Pending
    }
}

type DialFuture =
    Pin<Box<dyn std::future::Future<Output = io::Result<(TcpStream, SocketAddr)>> + Send>>;

/// Client side: where and when to re-dial.
pub(crate) struct Dialer {
    /// `host:port` of the server (changed by a `MOVE_TO`).
    pub(crate) addr: String,
    pub(crate) config: crate::ClientConfig,
    /// Attempts since the last resume; 0 means the next one goes out at once.
    attempt: u32,
    redial_at: Option<Instant>,
    /// Dial now even though a transport is up (network change, `MOVE_TO`).
    force: bool,
    dial: Option<DialFuture>,
    net: Option<NetworkChanges>,
}

impl Dialer {
    pub(crate) fn new(addr: String, config: crate::ClientConfig) -> Self {
        let net = if config.watch_network {
            NetworkChanges::subscribe()
        } else {
            None
        };
        Self {
            addr,
            config,
            attempt: 0,
            redial_at: None,
            force: false,
            dial: None,
            net,
        }
    }

    /// Delay before attempt number `self.attempt`: none for the first, then
    /// `initial · 2^(n-1)` capped at `max`, with jitter in `[d/2, d]` so a
    /// crowd of clients does not re-dial in lockstep.
    fn backoff(&self) -> Duration {
        if self.attempt == 0 {
            return Duration::ZERO;
        }
        let exp = (self.attempt - 1).min(16);
        let d = self
            .config
            .backoff_initial
            .saturating_mul(1 << exp)
            .min(self.config.backoff_max);
        let half = d / 2;
        half + rand::thread_rng().gen_range(Duration::ZERO..=d - half)
    }

    fn start_dial(&mut self) {
        let addr = self.addr.clone();
        let timeout = self.config.connect_timeout;
        self.dial = Some(Box::pin(async move {
            match tokio::time::timeout(timeout, dial(&addr)).await {
                Ok(r) => r,
                Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
            }
        }));
    }
}

/// After this long without an answer, a second SYN goes out beside the first.
/// Right after a link comes back the first SYN is often lost, and the
/// kernel's own retry waits a whole second (its initial RTO).
const HEDGE_AFTER: Duration = Duration::from_millis(200);

/// Connects to `a`, starting a second attempt if the first is slow; the first
/// to succeed wins (the other is dropped), an error ends only its own attempt.
async fn connect_hedged(a: SocketAddr) -> io::Result<TcpStream> {
    let first = TcpStream::connect(a);
    tokio::pin!(first);
    tokio::select! {
        r = &mut first => return r,
        _ = tokio::time::sleep(HEDGE_AFTER) => {}
    }
    let second = TcpStream::connect(a);
    tokio::pin!(second);
    tokio::select! {
        r = &mut first => match r {
            Ok(s) => Ok(s),
            Err(_) => second.await,
        },
        r = &mut second => match r {
            Ok(s) => Ok(s),
            Err(_) => first.await,
        },
    }
}

/// Resolves `addr` and connects to the first address that answers.
pub(crate) async fn dial(addr: &str) -> io::Result<(TcpStream, SocketAddr)> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        match connect_hedged(a).await {
            Ok(s) => return Ok((s, a)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "name resolved to no addresses")
    }))
}

/// The local address the kernel would use now to reach `peer` (a UDP
/// `connect` picks a route without sending anything).
fn route_source(peer: SocketAddr) -> Option<std::net::IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        ([0u16; 8], 0).into()
    };
    let s = std::net::UdpSocket::bind(any).ok()?;
    s.connect(peer).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

/// A resume transport handed from the accept loop to the session it names.
pub(crate) struct Handoff {
    pub(crate) sock: TcpStream,
    pub(crate) hello: Hello,
    /// Bytes read after the hello.
    pub(crate) rest: Vec<u8>,
    pub(crate) peer: SocketAddr,
    pub(crate) permit: OwnedSemaphorePermit,
}

/// Throttles warnings about clients refused after their handshake (unknown
/// key, too many sessions for the key): one line per 10 s, with a count.
static REFUSALS: crate::limits::SharedThrottle =
    crate::limits::SharedThrottle::new(Duration::from_secs(10));

/// Callback receiving each new server session once its handshake completes.
pub(crate) type OnSession = Arc<dyn Fn(SessionHandle) + Send + Sync>;

/// Server side: resumes arriving for this session, and shutdown.
pub(crate) struct ServerSide {
    pub(crate) id: SessionId,
    pub(crate) handoffs: mpsc::Receiver<Handoff>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) on_session: OnSession,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) shutdown_grace: Duration,
    /// Dropped when the driver ends: the server waits for all of these.
    pub(crate) _running: mpsc::Sender<()>,
    /// This session's place in the server's per-IP and per-key counts;
    /// released when the driver ends.
    pub(crate) slot: crate::limits::SessionSlot,
    /// Sessions one client key may hold (`ServerConfig::max_sessions_per_key`).
    pub(crate) max_sessions_per_key: usize,
}

pub(crate) enum Kind {
    Client(Box<Dialer>),
    Server(ServerSide),
}

enum Wake {
    Io(Io),
    Notified,
    Timer,
    Dialed(io::Result<(TcpStream, SocketAddr)>),
    NetChange(bool),
    Handoff(Option<Handoff>),
    Shutdown,
}

/// Drives one session until it is over. Spawn it: it does nothing unless polled.
#[must_use = "a session driver does nothing unless spawned"]
pub(crate) struct Driver {
    inner: Arc<Inner>,
    conns: Vec<Conn>,
    kind: Kind,
    scratch: Vec<u8>,
    /// Give up waiting for a graceful close at this time.
    give_up_at: Option<Instant>,
    shutting_down: bool,
    handoffs_open: bool,
    /// Announced `Closed` to the application already.
    closed_sent: bool,
    /// Taken out by `SessionHandle::detach`: already out of the routing map.
    detached: bool,
}

impl Driver {
    pub(crate) fn new(inner: Arc<Inner>, conn: Conn, kind: Kind) -> Self {
        Self {
            inner,
            conns: vec![conn],
            kind,
            scratch: Vec::new(),
            give_up_at: None,
            shutting_down: false,
            handoffs_open: true,
            closed_sent: false,
            detached: false,
        }
    }

    /// A driver for a restored session that has no connection yet (its
    /// resume arrives as a handoff).
    pub(crate) fn restored(inner: Arc<Inner>, kind: Kind) -> Self {
        Self {
            inner,
            conns: Vec::new(),
            kind,
            scratch: Vec::new(),
            give_up_at: None,
            shutting_down: false,
            handoffs_open: true,
            closed_sent: false,
            detached: false,
        }
    }

    /// Exports the session for `SessionHandle::detach` and shuts this driver
    /// down without closing the session: connections dropped, out of the
    /// routing map (before the caller learns the result, so a resume that
    /// arrives meanwhile goes to the caller's lookup, not to this driver).
    fn detach(
        &mut self,
        sh: &mut Shared,
        now: std::time::Instant,
    ) -> Result<crate::Detached, roam_proto::ExportError> {
        if sh.closed.is_some() {
            return Err(roam_proto::ExportError::Closed);
        }
        let blob = sh.session.export(now)?;
        let detached = crate::Detached {
            blob,
            unaccepted: sh.incoming.drain(..).collect(),
            orphans: sh.orphans.iter().copied().collect(),
        };
        sh.closed = Some(roam_proto::CloseReason::Local {
            code: roam_proto::code::NO_ERROR,
        });
        sh.wake_all();
        self.closed_sent = true;
        self.detached = true;
        self.conns.clear();
        if let Kind::Server(s) = &self.kind {
            s.registry.remove(&s.id);
        }
        tracing::debug!("session {} detached", id_text(sh));
        let _ = self.inner.events.send(SessionEvent::Detached);
        Ok(detached)
    }

    /// Feeds bytes that arrived with the hello (server) before the loop starts.
    pub(crate) fn initial_input(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let now = Instant::now().into_std();
        let tid = self.conns[0].tid;
        let inner = self.inner.clone();
        let mut sh = inner.lock();
        if let Err(e) = sh.session.handle_input(now, tid, data) {
            tracing::debug!("transport {tid:?}: {e}");
        }
    }

    pub(crate) async fn run(mut self) {
        loop {
            let now = Instant::now();
            let (deadline, done, new_session) = self.step(now);
            if let (Some(handle), Kind::Server(s)) = (new_session, &self.kind) {
                (s.on_session)(handle);
            }
            if done {
                break;
            }
            let wake = self.wait(deadline).await;
            self.on_wake(wake);
        }
        self.exit();
    }

    /// Timers, transmit, events, re-dial scheduling. Returns the next deadline,
    /// whether the driver is finished, and a new server session to announce.
    fn step(&mut self, now: Instant) -> (Option<Instant>, bool, Option<SessionHandle>) {
        let std_now = now.into_std();
        let inner = self.inner.clone();
        let mut sh = inner.lock();
        sh.driver_wakeups += 1;
        if let Some(reply) = sh.detach.take() {
            let result = self.detach(&mut sh, std_now);
            let done = result.is_ok();
            let _ = reply.send(result);
            if done {
                return (None, true, None);
            }
        }
        if sh.session.poll_timeout().is_some_and(|t| t <= std_now) {
            // Input that arrived while this task was busy or descheduled
            // counts as life: take it before the silence timer can fire.
            self.drain_ready_input(&mut sh, std_now);
            sh.session.handle_timeout(std_now);
        }
        if sh.abandoned && self.give_up_at.is_none() {
            self.give_up_at = Some(now + ABANDON_LINGER);
        }
        // A server session whose first handshake failed can never be resumed
        // (the client never learned its secret): end it instead of keeping it
        // for the whole resume timeout.
        if sh.session.role() == Role::Server
            && sh.session.state() == State::Handshaking
            && sh.session.active_transport().is_none()
        {
            sh.session
                .close(roam_proto::code::NO_ERROR, "handshake not completed");
        }
        let backed_up = self.transmit(&mut sh, std_now);
        let mut new_session = None;
        while let Some(ev) = sh.session.poll_event() {
            if let Some(h) = self.on_event(&mut sh, ev, now) {
                new_session = Some(h);
            }
        }

        if let Kind::Client(d) = &mut self.kind {
            let need = sh.closed.is_none()
                && sh.session.active_transport().is_none()
                && sh.session.state() != State::Handshaking;
            if std::mem::take(&mut sh.redial_requested) && need {
                d.attempt = 0;
                d.dial = None;
                d.redial_at = None;
                d.force = true;
            }
            if need && !d.force && d.dial.is_none() && d.redial_at.is_none() {
                let delay = d.backoff();
                d.attempt += 1;
                d.redial_at = Some(now + delay);
                if delay > Duration::ZERO {
                    tracing::debug!("re-dialing {} in {delay:?} (attempt {})", d.addr, d.attempt);
                }
                let _ = inner.events.send(SessionEvent::Redialing {
                    attempt: d.attempt,
                    delay,
                });
            }
            if !need {
                d.redial_at = None;
            }
            if sh.closed.is_some() {
                d.dial = None;
                d.force = false;
            } else if d.dial.is_none() && (d.force || d.redial_at.is_some_and(|t| t <= now)) {
                d.force = false;
                d.redial_at = None;
                d.start_dial();
            }
        }

        if sh.closed.is_some() {
            for c in &mut self.conns {
                c.retire_by.get_or_insert(now + RETIRE_LINGER);
            }
        }
        self.conns
            .retain(|c| !c.retire_by.is_some_and(|t| c.unwritten() == 0 || t <= now));

        let give_up = self.give_up_at.is_some_and(|t| t <= now);
        let done = (sh.closed.is_some() && self.conns.is_empty()) || give_up;

        let mut deadline = sh.session.poll_timeout().map(Instant::from_std);
        if backed_up {
            // Overdue send deadlines wait for writability (a socket wake-up),
            // not for the timer.
            deadline = deadline.map(|t| t.max(now + BACKED_UP_TICK));
        }
        let mut at = |t: Instant| deadline = Some(deadline.map_or(t, |d| d.min(t)));
        for c in &self.conns {
            if let Some(t) = c.retire_by {
                at(t);
            }
        }
        if let Some(t) = self.give_up_at {
            at(t);
        }
        if let Kind::Client(d) = &self.kind {
            if let Some(t) = d.redial_at {
                at(t);
            }
        }
        (deadline, done, new_session)
    }

    /// Feeds whatever the sockets hold right now, without waiting.
    fn drain_ready_input(&mut self, sh: &mut Shared, now: std::time::Instant) {
        let mut i = 0;
        while i < self.conns.len() {
            let c = &mut self.conns[i];
            let mut gone = false;
            for _ in 0..16 {
                if c.retire_by.is_some() {
                    break;
                }
                match c.sock.try_read(&mut c.rbuf) {
                    Ok(0) => gone = true,
                    Ok(n) => {
                        if let Err(e) = sh.session.handle_input(now, c.tid, &c.rbuf[..n]) {
                            tracing::debug!("transport {:?} from {}: {e}", c.tid, c.peer);
                        }
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(_) => gone = true,
                }
                break;
            }
            if gone {
                let c = self.conns.remove(i);
                sh.session.handle_transport_closed(now, c.tid);
            } else {
                i += 1;
            }
        }
    }

    /// Moves records from the session into the connections' buffers until
    /// the session has none or a connection is backed up; returns whether
    /// one is (output then waits for the socket to take some).
    fn transmit(&mut self, sh: &mut Shared, now: std::time::Instant) -> bool {
        loop {
            // A retiring (dead or replaced) connection must not hold back the
            // others: its unwritten bytes may never drain.
            if self
                .conns
                .iter()
                .any(|c| c.retire_by.is_none() && c.unwritten() >= WRITE_LOW_WATER)
            {
                return true;
            }
            self.scratch.clear();
            let Some(tid) = sh.session.poll_transmit(now, &mut self.scratch) else {
                return false;
            };
            match self.conns.iter_mut().find(|c| c.tid == tid) {
                Some(c) if c.out.is_empty() => std::mem::swap(&mut c.out, &mut self.scratch),
                Some(c) => c.out.extend_from_slice(&self.scratch),
                None => tracing::trace!("dropping output for unknown transport {tid:?}"),
            }
        }
    }

    /// Handles one session event; returns a handle for a server session that just connected.
    fn on_event(&mut self, sh: &mut Shared, ev: Event, now: Instant) -> Option<SessionHandle> {
        let events = &self.inner.events;
        let role = sh.session.role();
        match ev {
            Event::Connected {
                session_id,
                peer_key,
            } => {
                if let Kind::Server(s) = &mut self.kind {
                    if let Err(held) = s.slot.set_key(peer_key, s.max_sessions_per_key) {
                        let peer = sh.session.peer_addr();
                        if let Some(n) = REFUSALS.allow() {
                            tracing::warn!(
                                "refused new session {session_id} from {} with client key {peer_key}: the key already holds {held} sessions, its limit{}",
                                peer.map_or_else(|| "?".to_string(), |p| p.to_string()),
                                crate::limits::suppressed_note(n)
                            );
                        }
                        sh.session.close(
                            roam_proto::code::SERVER_BUSY,
                            &format!("server busy: this client key already holds {held} sessions, the server's limit; close some or try again later"),
                        );
                        return None;
                    }
                }
                sh.connected = true;
                tracing::debug!("session {session_id} connected, peer key {peer_key}");
                let _ = events.send(SessionEvent::Connected {
                    session_id,
                    peer_key,
                });
                if role == Role::Server {
                    return Some(SessionHandle::new(self.inner.clone()));
                }
            }
            Event::Suspended { reason, .. } => {
                tracing::info!("session {} suspended: {reason:?}", id_text(sh));
                let _ = events.send(SessionEvent::Suspended { reason });
            }
            Event::Resumed {
                suspended_for,
                frames_replayed,
                bytes_replayed,
            } => {
                tracing::info!(
                    "session {} resumed after {suspended_for:?}, replaying {bytes_replayed} bytes",
                    id_text(sh)
                );
                if let Kind::Client(d) = &mut self.kind {
                    d.attempt = 0;
                }
                let _ = events.send(SessionEvent::Resumed {
                    suspended_for,
                    bytes_replayed,
                    frames_replayed,
                });
            }
            Event::PeerAddressChanged { from, to } => {
                tracing::info!(
                    "session {}: peer moved from {from:?} to {to:?}",
                    id_text(sh)
                );
                let _ = events.send(SessionEvent::PeerAddressChanged { from, to });
            }
            Event::TransportClosed { transport, error } => {
                if let Some(e) = error {
                    tracing::debug!("transport {transport:?} closed: {e}");
                    if role == Role::Client
                        && matches!(
                            e,
                            roam_proto::Error::UnknownSession | roam_proto::Error::ResumeRejected
                        )
                    {
                        let _ = events.send(SessionEvent::ResumeRefused { error: e });
                    }
                }
                if let Some(c) = self.conns.iter_mut().find(|c| c.tid == transport) {
                    c.retire_by.get_or_insert(now + RETIRE_LINGER);
                }
            }
            Event::StreamOpened { stream } => {
                sh.incoming.push_back(stream);
                for w in sh.accept_wakers.drain(..) {
                    w.wake();
                }
            }
            Event::StreamReadable { stream } => {
                if sh.orphans.contains(&stream) {
                    let mut scratch = [0u8; 4096];
                    loop {
                        match sh.session.read(stream, &mut scratch) {
                            Ok(Some(n)) if n > 0 => {}
                            Ok(None) => break,
                            _ => {
                                sh.orphans.remove(&stream);
                                break;
                            }
                        }
                    }
                } else if let Some(w) = sh.read_wakers.remove(&stream) {
                    w.wake();
                }
            }
            // Only the stream concerned: waking every writer on each event made
            // a session with 1,000 blocked streams spin (bench scenario 6).
            Event::StreamWritable { stream } | Event::StreamSendComplete { stream } => {
                if let Some(w) = sh.write_wakers.remove(&stream) {
                    w.wake();
                }
            }
            Event::StreamReset { stream, code } => {
                tracing::debug!("stream {stream} reset by peer (code {code})");
                if !sh.orphans.remove(&stream) {
                    sh.resets.insert(stream, code);
                }
                if let Some(w) = sh.read_wakers.remove(&stream) {
                    w.wake();
                }
                if let Some(w) = sh.write_wakers.remove(&stream) {
                    w.wake();
                }
            }
            Event::AddressesUpdated { addrs } => sh.addresses = addrs,
            Event::MoveRequested { addr } => {
                if let Kind::Client(d) = &mut self.kind {
                    tracing::info!("server asked us to move to {addr}");
                    d.addr = addr;
                    d.dial = None;
                    d.force = true;
                }
            }
            Event::Closed { reason } => {
                if role == Role::Server
                    && matches!(
                        reason,
                        roam_proto::CloseReason::Error(roam_proto::Error::Unauthorized)
                    )
                {
                    if let Some(n) = REFUSALS.allow() {
                        tracing::warn!(
                            "refused client {} with key {}: not in the authorized keys{}",
                            sh.session
                                .peer_addr()
                                .map_or_else(|| "?".to_string(), |p| p.to_string()),
                            sh.session
                                .peer_key()
                                .map_or_else(|| "?".to_string(), |k| k.to_string()),
                            crate::limits::suppressed_note(n)
                        );
                    }
                }
                tracing::info!(
                    "session {} closed: {}",
                    id_text(sh),
                    crate::error::describe_close(&reason)
                );
                sh.closed = Some(reason.clone());
                sh.wake_all();
                self.closed_sent = true;
                let _ = events.send(SessionEvent::Closed { reason });
            }
            other => tracing::trace!("unhandled event {other:?}"),
        }
        None
    }

    async fn wait(&mut self, deadline: Option<Instant>) -> Wake {
        let Self {
            inner,
            conns,
            kind,
            shutting_down,
            handoffs_open,
            ..
        } = self;
        let sleep = async move {
            match deadline {
                Some(t) => sleep_until(t).await,
                None => pending().await,
            }
        };
        let io = poll_fn(|cx| poll_conns(conns, cx));
        match kind {
            Kind::Client(d) => {
                let dial = &mut d.dial;
                let net = &mut d.net;
                let dialed = async move {
                    match dial.as_mut() {
                        Some(f) => f.await,
                        None => pending().await,
                    }
                };
                let changed = async move {
                    match net.as_mut() {
                        Some(n) => n.changed().await,
                        None => pending().await,
                    }
                };
                tokio::select! {
                    io = io => Wake::Io(io),
                    _ = inner.notify.notified() => Wake::Notified,
                    _ = sleep => Wake::Timer,
                    r = dialed => Wake::Dialed(r),
                    ok = changed => Wake::NetChange(ok),
                }
            }
            Kind::Server(s) => {
                let shutdown = &mut s.shutdown;
                let watch_shutdown = !*shutting_down;
                tokio::select! {
                    io = io => Wake::Io(io),
                    _ = inner.notify.notified() => Wake::Notified,
                    _ = sleep => Wake::Timer,
                    h = s.handoffs.recv(), if *handoffs_open => Wake::Handoff(h),
                    _ = shutdown.wait_for(|stop| *stop), if watch_shutdown => Wake::Shutdown,
                }
            }
        }
    }

    fn on_wake(&mut self, wake: Wake) {
        let now = Instant::now();
        let std_now = now.into_std();
        let inner = self.inner.clone();
        match wake {
            Wake::Io(Io::Read(i, n)) => {
                let c = &self.conns[i];
                let mut sh = inner.lock();
                if let Err(e) = sh.session.handle_input(std_now, c.tid, &c.rbuf[..n]) {
                    tracing::debug!("transport {:?} from {}: {e}", c.tid, c.peer);
                }
            }
            Wake::Io(Io::Eof(i)) => {
                let c = self.conns.remove(i);
                tracing::debug!("transport {:?} from {}: closed by peer", c.tid, c.peer);
                inner.lock().session.handle_transport_closed(std_now, c.tid);
            }
            Wake::Io(Io::Failed(i, e)) => {
                let c = self.conns.remove(i);
                tracing::debug!("transport {:?} from {}: {e}", c.tid, c.peer);
                inner.lock().session.handle_transport_closed(std_now, c.tid);
            }
            Wake::Io(Io::Wrote) | Wake::Notified | Wake::Timer => {}
            Wake::Dialed(result) => {
                let Kind::Client(d) = &mut self.kind else {
                    return;
                };
                d.dial = None;
                match result {
                    Ok((sock, peer)) => {
                        crate::sockopt::configure(&sock, d.config.proto.session.suspend_after * 2);
                        let mut sh = inner.lock();
                        match sh.session.connect(std_now, Some(peer)) {
                            Ok(tid) => {
                                tracing::debug!("dialed {peer}, resuming on transport {tid:?}");
                                self.conns.push(Conn::new(tid, sock, peer, None));
                            }
                            Err(e) => tracing::debug!("not resuming: {e}"),
                        }
                    }
                    Err(e) => tracing::debug!("re-dial to {} failed: {e}", d.addr),
                }
            }
            Wake::NetChange(alive) => {
                let Kind::Client(d) = &mut self.kind else {
                    return;
                };
                if !alive {
                    d.net = None;
                    return;
                }
                let sh = inner.lock();
                match sh.session.active_transport() {
                    None if sh.closed.is_none() && sh.session.state() != State::Handshaking => {
                        tracing::info!("network changed: re-dialing {} now", d.addr);
                        d.attempt = 0;
                        d.dial = None;
                        d.redial_at = None;
                        d.force = true;
                    }
                    Some(tid) => {
                        // Move only if the kernel would now reach the server from
                        // another address: the old path is likely gone.
                        if let Some(c) = self.conns.iter().find(|c| c.tid == tid) {
                            let local = c.sock.local_addr().ok().map(|a| a.ip());
                            let now_src = route_source(c.peer);
                            if now_src.is_some() && local != now_src && d.dial.is_none() {
                                tracing::info!(
                                    "network changed: route to {} now leaves from {now_src:?}; moving",
                                    c.peer
                                );
                                d.force = true;
                            }
                        }
                    }
                    None => {}
                }
            }
            Wake::Handoff(None) => self.handoffs_open = false,
            Wake::Handoff(Some(h)) => {
                let mut sh = inner.lock();
                match sh.session.accept_resume(std_now, &h.hello, Some(h.peer)) {
                    Ok(tid) => {
                        crate::sockopt::configure(&h.sock, Duration::from_secs(30));
                        let conn = Conn::new(tid, h.sock, h.peer, Some(h.permit));
                        if !h.rest.is_empty() {
                            if let Err(e) = sh.session.handle_input(std_now, tid, &h.rest) {
                                tracing::debug!("resume from {}: {e}", h.peer);
                            }
                        }
                        self.conns.push(conn);
                    }
                    Err(e) => {
                        tracing::info!(
                            "refused resume of session {} from {}: {e}",
                            id_text(&sh),
                            h.peer
                        );
                        tokio::spawn(reject(h.sock, h.hello, e));
                    }
                }
            }
            Wake::Shutdown => {
                self.shutting_down = true;
                let Kind::Server(s) = &self.kind else { return };
                inner
                    .lock()
                    .session
                    .close(roam_proto::code::NO_ERROR, "server shutting down");
                self.give_up_at = Some(now + s.shutdown_grace);
            }
        }
    }

    fn exit(mut self) {
        let mut sh = self.inner.lock();
        if sh.closed.is_none() {
            sh.closed = Some(roam_proto::CloseReason::Local {
                code: roam_proto::code::NO_ERROR,
            });
        }
        sh.wake_all();
        if !self.closed_sent {
            if let Some(reason) = sh.closed.clone() {
                let _ = self.inner.events.send(SessionEvent::Closed { reason });
            }
        }
        drop(sh);
        self.conns.clear();
        if let Kind::Server(s) = &self.kind {
            if !self.detached {
                s.registry.remove(&s.id);
            }
        }
    }
}

fn id_text(sh: &Shared) -> String {
    sh.session
        .id()
        .map_or_else(|| "(new)".to_string(), |id| id.to_string())
}

/// Answers a refused transport with its status and closes it.
pub(crate) async fn reject(mut sock: TcpStream, hello: Hello, err: roam_proto::Error) {
    let mut out = Vec::new();
    hello.reject(err.refusal_status(), &mut out);
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = sock.write_all(&out).await;
        let _ = sock.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dialer() -> Dialer {
        let proto = roam_proto::ClientConfig {
            keypair: roam_proto::Keypair::generate().unwrap(),
            server_trust: roam_proto::ServerTrust::FirstUse,
            session: Default::default(),
        };
        let mut config = crate::ClientConfig::new(proto);
        config.watch_network = false;
        Dialer::new("127.0.0.1:1".into(), config)
    }

    #[test]
    fn backoff_starts_at_once_doubles_and_caps_with_jitter() {
        let mut d = dialer();
        assert_eq!(
            d.backoff(),
            Duration::ZERO,
            "first re-dial goes out at once"
        );
        for attempt in 1..40u32 {
            d.attempt = attempt;
            let full = Duration::from_millis(100)
                .saturating_mul(1 << (attempt - 1).min(16))
                .min(Duration::from_secs(5));
            for _ in 0..20 {
                let b = d.backoff();
                assert!(
                    b >= full / 2 && b <= full,
                    "attempt {attempt}: {b:?} outside [{:?}, {full:?}]",
                    full / 2
                );
            }
        }
    }

    #[test]
    fn route_source_finds_loopback() {
        let src = route_source("127.0.0.1:9".parse().unwrap());
        assert!(src.is_some_and(|ip| ip.is_loopback()));
    }
}
