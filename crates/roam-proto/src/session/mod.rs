//! The session state machine (sans-IO).
//!
//! Spec: `docs/PROTOCOL.md` §4-§10. A [`Session`] owns the streams, the
//! reliable-frame log and the flow-control state, and at most one active
//! transport (plus, on a server, one resume candidate). It never touches a
//! socket or a clock: the caller passes `now` and bytes in, and polls bytes,
//! timers and events out.
//!
//! # Driving a session
//! After creating it (client: [`Session::client`] then [`Session::connect`];
//! server: [`Session::accept`]), loop:
//! 1. feed received bytes with [`Session::handle_input`], EOF/reset with
//!    [`Session::handle_transport_closed`], expired timers with [`Session::handle_timeout`];
//! 2. call [`Session::poll_transmit`] until it returns `None`, writing each
//!    buffer to the transport it names;
//! 3. drain [`Session::poll_event`];
//! 4. sleep until [`Session::poll_timeout`] or new input.
//!
//! Application calls (`open_stream`, `write`, `read`, `finish`, `reset`,
//! `close`) may happen at any point; follow them with step 2.

pub mod envelope;
mod export;
mod live;
// Hooks for the session fuzz targets; like `suite_fuzzing.rs`, only under cargo-fuzz.
#[cfg(fuzzing)]
mod fuzzing;
mod recv;
#[cfg(test)]
mod regressions;
mod send;
mod transport;
mod tuning;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{ClientConfig, Config, ServerConfig, ServerTrust};
use crate::error::{code, StreamError};
use crate::event::{CloseReason, Event, SuspendReason, TransportId};
use crate::frame::MAX_META_LEN;
use crate::handshake::{self, Hello, Params};
use crate::keys::{Keypair, PublicKey, SessionId};
use crate::stream::{Stream, StreamId};
use crate::Error;
use tuning::Tuning;

pub use export::{ExportError, RestoreError};
use transport::{Phase, Transport};

/// What [`Session::read_with`] did with a stream's received bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lent<E> {
    /// Bytes were lent and this is the borrower's answer: with `Ok(n)`, `n`
    /// of them now count as read.
    Lent(Result<usize, E>),
    /// End of stream: every byte was read and the peer finished.
    End,
    /// Nothing to read yet: wait for `StreamReadable`.
    Nothing,
}

/// The oldest bytes of a non-empty receive buffer, as one contiguous piece
/// (never empty).
fn front(buf: &VecDeque<u8>) -> &[u8] {
    match buf.as_slices() {
        (a, _) if !a.is_empty() => a,
        (_, b) => b,
    }
}

/// Which end of the session this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Dials, and re-dials to resume.
    Client,
    /// Accepts, and waits to be resumed.
    Server,
}

/// Where the session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// First handshake in progress.
    Handshaking,
    /// A transport is up.
    Active,
    /// No transport; resumable until the resume timeout.
    Suspended,
    /// `close` was called; waiting for the peer to acknowledge.
    Closing,
    /// Over. See the `Closed` event for why.
    Closed,
}

/// One stream's progress as its application sees it
/// ([`Session::stream_progress`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamProgress {
    /// Bytes the application wrote (accepted by the session).
    pub written: u64,
    /// Bytes the application read (taken with `read`).
    pub read: u64,
    /// The application finished its direction (`finish_stream`).
    pub finished: bool,
    /// The peer finished its direction (end-of-stream received; it may
    /// not have been read yet).
    pub peer_finished: bool,
}

/// Counters for status displays and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Stream payload bytes sent for the first time.
    pub bytes_sent: u64,
    /// Stream payload bytes received (duplicates excluded).
    pub bytes_received: u64,
    /// Stream payload bytes retransmitted after resumes.
    pub bytes_replayed: u64,
    /// Reliable frames retransmitted after resumes.
    pub frames_replayed: u64,
    /// Transports this session has used.
    pub transports: u64,
    /// Successful resumes.
    pub resumes: u64,
    /// Latest measured round-trip time.
    pub rtt: Option<Duration>,
}

/// One entry of the reliable-frame log: what to (re)send, not a copy of the
/// bytes — stream payload stays in the stream's send buffer (§7.1).
/// What only the handshake that creates a session reads: the client's key
/// and how it trusts the server, the server's authorized keys and the
/// addresses it announces. Boxed and dropped when that handshake completes
/// (a resume never reads them), so a session keeps 8 bytes for it instead of
/// ~130 for the rest of its life, suspended sessions included.
#[derive(Clone)]
struct Setup {
    /// Client: its static key.
    keypair: Option<Keypair>,
    /// Client: how the server's key is checked.
    trust: Option<ServerTrust>,
    /// Server: the client keys admitted (`None`: any).
    authorized: Option<Arc<Vec<PublicKey>>>,
    /// Server: the addresses sent to the client once the session is open.
    announce: Vec<String>,
}

#[derive(Debug, Clone)]
enum Entry {
    Open(u64),
    Data {
        stream: u64,
        offset: u64,
        len: u32,
        fin: bool,
    },
    Reset {
        stream: u64,
        code: u64,
    },
    MaxStreamData {
        stream: u64,
        max: u64,
    },
    MaxData(u64),
    MaxStreams(u64),
    Close {
        code: u64,
        reason: Vec<u8>,
    },
    Addresses(Vec<String>),
    MoveTo(String),
    MoveAsk(String),
}

impl Entry {
    fn stream(&self) -> Option<u64> {
        match self {
            Entry::Open(s)
            | Entry::Data { stream: s, .. }
            | Entry::Reset { stream: s, .. }
            | Entry::MaxStreamData { stream: s, .. } => Some(*s),
            _ => None,
        }
    }
}

/// How many recent resume ephemerals a server remembers to name replays (§12).
const REPLAY_MEMORY: usize = 64;
/// The smallest send-buffer share a stream is held to when many streams
/// write at once (bytes); see `Session::stream_send_cap`.
const MIN_STREAM_SHARE: u64 = 16 * 1024;
/// The share the session's send buffer grows to give each writing stream
/// when many write at once (bytes); see `Session::session_send_limit`.
const GROWN_STREAM_SHARE: u64 = 64 * 1024;
/// How many times `Config::session_send_buffer` the session's send buffer
/// may grow to when many streams write at once (so a session never holds
/// more than `session_send_buffer * SEND_BUFFER_GROWTH` bytes to send).
pub const SEND_BUFFER_GROWTH: u64 = 4;

/// A roam session: one end of a set of reliable streams that outlive transports.
pub struct Session {
    role: Role,
    /// The configuration it was made with, compact ([`Tuning`]).
    config: Tuning,
    state: State,
    /// Set when closed; kept so later calls can report it. Boxed: 8 bytes
    /// instead of 72 for the whole life of a session that is not closed.
    close_reason: Option<Box<CloseReason>>,

    // identity
    /// What only the new-session handshake reads; dropped when it completes.
    setup: Option<Box<Setup>>,
    id: Option<SessionId>,
    secret: Option<[u8; 32]>,
    peer_key: Option<PublicKey>,
    peer_params: Option<Params>,
    /// Effective resume timeout (the smaller of ours and the server's).
    resume_timeout: Duration,

    // transports
    next_transport: u64,
    // Boxed (as is `pending`): a suspended session has neither, and keeps
    // 8 bytes for each instead of 160.
    active: Option<Box<Transport>>,
    /// Server only: a resume whose client has not yet proven freshness.
    pending: Option<Box<Transport>>,
    peer_addr: Option<SocketAddr>,
    suspended_since: Option<Instant>,
    /// Client: when the first of an unbroken run of cleartext resume refusals
    /// arrived (cleared by a successful resume); see `Config::refusal_grace`.
    refused_since: Option<Instant>,
    /// Server: the ephemeral keys of the last resumes, refused if replayed.
    /// Boxed and made at the first resume: 8 bytes instead of 32 in every
    /// session that never served one (every client's).
    #[allow(clippy::box_collection)] // the point: 8 bytes inline, not 32
    replay_memory: Option<Box<VecDeque<[u8; 32]>>>,

    // reliable log (§7): entry i has sequence log_base + i
    log: VecDeque<Entry>,
    log_base: u64,
    /// Next sequence to transmit on the active transport.
    send_cursor: u64,
    /// One past the highest sequence ever transmitted (for replay accounting).
    high_sent: u64,
    /// A reliable frame went into the record being built.
    high_sent_changed: bool,
    /// Reliable frames received and applied.
    recv_seq: u64,
    /// Sequence of the next reliable frame arriving on this transport.
    in_cursor: u64,
    /// Last `received` value we sent in an `ACK`/`SYNC`.
    ack_sent: u64,
    ack_deadline: Option<Instant>,
    /// Enough unacknowledged data arrived that an `ACK` goes out without delay.
    ack_now: bool,
    unacked_bytes: u64,

    // streams (§6)
    // Ordered so that every iteration (and so a simulation) is deterministic.
    // Boxed: a B-tree leaf holds 11 values, so with inline streams (160 B
    // each) a session's first stream cost a 1.9 KiB node, suspended or not;
    // boxed, the node is about 200 B and each stream its own size.
    streams: BTreeMap<u64, Box<Stream>>,
    next_local_stream: u64,
    next_peer_stream: u64,
    /// Streams we opened, ever, and how many the peer allows in total (§6.5).
    local_streams_opened: u64,
    local_stream_limit: u64,
    /// Streams the peer opened, ever; how many of them we forgot; our grant.
    peer_streams_opened: u64,
    peer_streams_forgotten: u64,
    peer_stream_limit: u64,
    send_queue: VecDeque<u64>,
    /// Streams whose last `write` was refused for lack of buffer space.
    write_waiters: Vec<u64>,
    /// Streams marked `contending`: refused a write and still holding data.
    contenders: u64,

    // session flow control (§8)
    conn_send_max: u64,
    conn_sent: u64,
    conn_recv_max: u64,
    conn_received: u64,
    conn_consumed: u64,
    send_buffered: u64,

    // liveness
    ping_token: u64,
    ping_outstanding: Option<(u64, Instant)>,
    pong_due: Option<u64>,

    /// A `CLOSE` code to put in the final record after a local error.
    final_close: Option<u64>,
    /// `close` was called: the `CLOSE` to log once all stream data is logged.
    /// Boxed: 8 bytes instead of 32 in every session never closed this way.
    close_requested: Option<Box<(u64, Vec<u8>)>>,

    events: VecDeque<Event>,
    stats: Stats,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("role", &self.role)
            .field("state", &self.state)
            .field("id", &self.id)
            .field("streams", &self.streams.len())
            .field("log", &self.log.len())
            .finish_non_exhaustive()
    }
}

impl Session {
    fn new(role: Role, config: Config) -> Self {
        // Enforce exactly what we announce (§8): windows of at least one byte.
        let resume_timeout = config.resume_timeout;
        let config = Tuning::new(&config);
        let peer_stream_limit = config.params().max_streams;
        let conn_recv_max = config.session_window;
        Self {
            role,
            config,
            state: State::Handshaking,
            close_reason: None,
            setup: None,
            id: None,
            secret: None,
            peer_key: None,
            peer_params: None,
            resume_timeout,
            next_transport: 0,
            active: None,
            pending: None,
            peer_addr: None,
            suspended_since: None,
            refused_since: None,
            replay_memory: None,
            log: VecDeque::new(),
            log_base: 0,
            send_cursor: 0,
            high_sent: 0,
            high_sent_changed: false,
            recv_seq: 0,
            in_cursor: 0,
            ack_sent: 0,
            ack_deadline: None,
            ack_now: false,
            unacked_bytes: 0,
            streams: BTreeMap::new(),
            next_local_stream: match role {
                Role::Client => 0,
                Role::Server => 1,
            },
            next_peer_stream: match role {
                Role::Client => 1,
                Role::Server => 0,
            },
            local_streams_opened: 0,
            local_stream_limit: handshake::MIN_MAX_STREAMS,
            peer_streams_opened: 0,
            peer_streams_forgotten: 0,
            peer_stream_limit,
            send_queue: VecDeque::new(),
            write_waiters: Vec::new(),
            contenders: 0,
            conn_send_max: 0,
            conn_sent: 0,
            conn_recv_max,
            conn_received: 0,
            conn_consumed: 0,
            send_buffered: 0,
            ping_token: 0,
            ping_outstanding: None,
            pong_due: None,
            final_close: None,
            close_requested: None,
            events: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    /// A client session, not yet connected: call [`Session::connect`] with a
    /// fresh transport (and again, after a suspension, to resume).
    pub fn client(config: ClientConfig) -> Self {
        let mut s = Self::new(Role::Client, config.session);
        s.setup = Some(Box::new(Setup {
            keypair: Some(config.keypair),
            trust: Some(config.server_trust),
            authorized: None,
            announce: Vec::new(),
        }));
        s
    }

    /// A server session for a new-session [`Hello`] (see [`crate::parse_hello`]).
    /// The reply is ready from `poll_transmit` on the returned transport.
    pub fn accept(
        config: &ServerConfig,
        now: Instant,
        hello: &Hello,
        peer: Option<SocketAddr>,
    ) -> Result<(Self, TransportId), Error> {
        if hello.resume_session().is_some() {
            return Err(Error::ProtocolViolation("resume hello given to accept"));
        }
        if !hello.version_supported() {
            return Err(Error::UnsupportedVersion);
        }
        let mut s = Self::new(Role::Server, config.session.clone());
        s.setup = Some(Box::new(Setup {
            keypair: None,
            trust: None,
            authorized: config.authorized_keys.clone(),
            announce: config.addresses.clone(),
        }));
        s.id = Some(SessionId::random()?);
        let mut secret = [0u8; 32];
        crate::random_bytes(&mut secret)?;
        s.secret = Some(secret);
        let mut out = Vec::new();
        let hs = handshake::server_new(hello, &config.keypair, &s.config.params(), &mut out)?;
        let id = s.new_transport(now, peer, Phase::ServerNew(Box::new(hs)));
        if let Some(t) = s.active.as_mut() {
            t.out = out;
        }
        s.peer_addr = peer;
        Ok((s, id))
    }

    /// Client: start a transport to the server (a new session the first time, a
    /// resume afterwards). Any current transport is abandoned. The opening bytes
    /// are ready from `poll_transmit`.
    pub fn connect(
        &mut self,
        now: Instant,
        peer: Option<SocketAddr>,
    ) -> Result<TransportId, Error> {
        if self.role != Role::Client {
            return Err(Error::ProtocolViolation(
                "connect called on a server session",
            ));
        }
        if let Some(reason) = &self.close_reason {
            return Err(match &**reason {
                CloseReason::Error(e) => e.clone(),
                _ => Error::ProtocolViolation("session is closed"),
            });
        }
        if let Some(old) = self.active.take() {
            self.events.push_back(Event::TransportClosed {
                transport: old.id,
                error: None,
            });
            if old.is_open() && self.secret.is_some() {
                self.enter_suspended(now, SuspendReason::Reconnecting);
            }
        }
        let mut out = Vec::new();
        let phase = match (&self.id, &self.secret) {
            (Some(id), Some(secret)) => {
                Phase::ClientResume(Box::new(handshake::client_resume(id, secret, &mut out)?))
            }
            _ => {
                let kp = self
                    .setup
                    .as_ref()
                    .and_then(|setup| setup.keypair.as_ref())
                    .ok_or(Error::HandshakeFailed)?;
                Phase::ClientNew(Box::new(handshake::client_new(kp, &mut out)?))
            }
        };
        let id = self.new_transport(now, peer, phase);
        if let Some(t) = self.active.as_mut() {
            t.out = out;
        }
        Ok(id)
    }

    /// Server: a resume [`Hello`] named this session. On success the reply is
    /// ready from `poll_transmit` on the returned transport, which takes over
    /// once the client proves it is live. On error the session is unchanged;
    /// answer with `hello.reject(err.refusal_status(), ..)` and close.
    pub fn accept_resume(
        &mut self,
        now: Instant,
        hello: &Hello,
        peer: Option<SocketAddr>,
    ) -> Result<TransportId, Error> {
        if self.role != Role::Server || hello.resume_session() != self.id {
            return Err(Error::UnknownSession);
        }
        if matches!(self.state, State::Closed) {
            return Err(Error::UnknownSession);
        }
        if !hello.version_supported() {
            return Err(Error::UnsupportedVersion);
        }
        let secret = self.secret.ok_or(Error::UnknownSession)?;
        let eph = hello.ephemeral().ok_or(Error::ResumeRejected)?;
        if self
            .replay_memory
            .as_ref()
            .is_some_and(|m| m.contains(&eph))
        {
            return Err(Error::ReplayedResume);
        }
        let mut out = Vec::new();
        let keys = handshake::server_resume(hello, &secret, self.recv_seq, &mut out)?;
        let memory = self.replay_memory.get_or_insert_with(Box::default);
        if memory.len() == REPLAY_MEMORY {
            memory.pop_front();
        }
        memory.push_back(eph);
        self.next_transport += 1;
        let id = TransportId(self.next_transport);
        let mut t = Transport::new(id, now, peer, Phase::Open(Box::new(keys)));
        t.out = out;
        t.pending_resume = true;
        t.is_resume = true;
        self.stats.transports += 1;
        if let Some(old) = self.pending.replace(Box::new(t)) {
            self.events.push_back(Event::TransportClosed {
                transport: old.id,
                error: Some(Error::ProtocolViolation("superseded by a newer resume")),
            });
        }
        Ok(id)
    }

    fn new_transport(
        &mut self,
        now: Instant,
        peer: Option<SocketAddr>,
        phase: Phase,
    ) -> TransportId {
        self.next_transport += 1;
        let id = TransportId(self.next_transport);
        self.active = Some(Box::new(Transport::new(id, now, peer, phase)));
        self.stats.transports += 1;
        id
    }

    // ------------------------------------------------------------ getters

    /// Client or server.
    pub fn role(&self) -> Role {
        self.role
    }
    /// Current state.
    pub fn state(&self) -> State {
        self.state
    }
    /// Why the session closed, once it has.
    pub fn close_reason(&self) -> Option<&CloseReason> {
        self.close_reason.as_deref()
    }
    /// The session id, once known (server: from accept; client: once connected).
    pub fn id(&self) -> Option<SessionId> {
        self.id
    }
    /// The peer's proven static key, once the handshake is done.
    pub fn peer_key(&self) -> Option<PublicKey> {
        self.peer_key
    }
    /// The peer's address on the latest transport, as given by the caller.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }
    /// Counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
    /// When the session lost its transport, if it has none now.
    pub fn suspended_since(&self) -> Option<Instant> {
        self.suspended_since
    }
    /// The transport currently carrying the session, if any.
    pub fn active_transport(&self) -> Option<TransportId> {
        self.active.as_ref().map(|t| t.id)
    }
    /// Streams currently known (open in at least one direction).
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }
    /// The ids of the streams currently known, in id order.
    pub fn stream_ids(&self) -> Vec<StreamId> {
        self.streams.keys().map(|&i| StreamId(i)).collect()
    }
    /// Reliable frames sent but not yet acknowledged.
    pub fn unacked_frames(&self) -> usize {
        self.log.len()
    }
    /// Bytes held in send buffers (unsent plus unacknowledged).
    pub fn send_buffered(&self) -> u64 {
        self.send_buffered
    }
    /// A stream's metadata as given by its opener.
    pub fn stream_meta(&self, id: StreamId) -> Option<&[u8]> {
        self.streams.get(&id.0).map(|s| s.meta.as_slice())
    }
    /// Bytes ready to read on a stream.
    pub fn readable_len(&self, id: StreamId) -> usize {
        self.streams.get(&id.0).map_or(0, |s| s.recv_buf.len())
    }
    /// What the peer may have seen of this session: one past the highest
    /// reliable frame ever transmitted, and the last received count sent in
    /// an ACK or SYNC. A copy of the session that must survive its process
    /// being killed (a journal) has to be exported again, before the bytes
    /// leave, whenever `poll_transmit` grows either: a copy older than what
    /// the peer saw cannot be resumed (§13.2).
    pub fn peer_exposure(&self) -> (u64, u64) {
        (self.high_sent, self.ack_sent)
    }
    /// How far a stream has come, as its application sees it; `None` for a
    /// stream the session does not know (never opened, or complete and
    /// forgotten).
    pub fn stream_progress(&self, id: StreamId) -> Option<StreamProgress> {
        self.streams.get(&id.0).map(|s| StreamProgress {
            written: s.written(),
            read: s.received - s.recv_buf.len() as u64,
            finished: s.fin_requested,
            peer_finished: s.fin_received,
        })
    }

    // ------------------------------------------------------------ polling

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        let ev = self.events.pop_front();
        if ev.is_none() && self.active.is_none() && self.events.capacity() > 0 {
            // Drained while without a transport (suspended, or over): the
            // queue's slots (88 B each) need not wait for the next event.
            self.events = VecDeque::new();
        }
        ev
    }

    /// When `handle_timeout` must next be called.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| t = Some(t.map_or(x, |t| t.min(x)));
        for tr in self.active.iter().chain(self.pending.iter()) {
            if tr.is_open() {
                at(tr.last_recv + self.config.suspend_after());
                if tr.may_send {
                    at(tr.last_send + self.config.heartbeat_interval());
                }
            } else {
                at(tr.started + self.config.handshake_timeout());
            }
            if tr.pending_resume {
                at(tr.started + self.config.handshake_timeout());
            }
        }
        if let Some(d) = self.ack_deadline {
            at(d);
        }
        if let Some(expiry) = self.expires_at() {
            at(expiry);
        }
        t
    }

    /// When a suspended session expires: `resume_timeout` after it lost its
    /// transport, or `idle_resume_timeout` after if it has no open stream
    /// (§4.6). `None` while it has a transport or once closed.
    fn expires_at(&self) -> Option<Instant> {
        let since = self.suspended_since?;
        if self.state == State::Closed {
            return None;
        }
        let timeout = match self.config.idle_resume_timeout() {
            Some(idle) if self.streams.is_empty() => idle.min(self.resume_timeout),
            _ => self.resume_timeout,
        };
        Some(since + timeout)
    }

    /// Processes timers due at `now`. Calling it early is harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.expires_at().is_some_and(|t| now >= t) {
            self.finish(CloseReason::Error(Error::Expired));
            return;
        }
        if let Some(p) = &self.pending {
            if now >= p.started + self.config.handshake_timeout() {
                let id = p.id;
                self.pending = None;
                self.events.push_back(Event::TransportClosed {
                    transport: id,
                    error: Some(Error::HandshakeFailed),
                });
                self.resume_abandoned();
            }
        }
        if let Some(t) = &self.active {
            if t.is_open() && now >= t.last_recv + self.config.suspend_after() {
                self.lose_active(now, SuspendReason::Silence);
            } else if !t.is_open() && now >= t.started + self.config.handshake_timeout() {
                self.lose_active(now, SuspendReason::TransportError(Error::HandshakeFailed));
            }
        }
    }

    /// The caller's transport `id` reached EOF, was reset, or failed to write.
    pub fn handle_transport_closed(&mut self, now: Instant, id: TransportId) {
        if self.pending.as_ref().is_some_and(|p| p.id == id) {
            self.pending = None;
            self.resume_abandoned();
        } else if self.active.as_ref().is_some_and(|t| t.id == id) {
            self.lose_active_quiet(now, SuspendReason::TransportClosed);
        }
    }

    // ------------------------------------------------------------ lifecycle

    /// Gives back the spare capacity of the session's buffers when it
    /// suspends: a server may hold many suspended sessions for days, and
    /// buffers grown by traffic (stream send and receive buffers, the log,
    /// the round-robin queue) would otherwise keep their high-water size.
    /// What they hold stays; they grow again if traffic resumes.
    fn release_spare_memory(&mut self) {
        for s in self.streams.values_mut() {
            s.send_buf.shrink_to_fit();
            s.recv_buf.shrink_to_fit();
        }
        self.log.shrink_to_fit();
        self.send_queue.shrink_to_fit();
        self.write_waiters.shrink_to_fit();
    }

    /// The pending resume is gone: if nothing else carries the session,
    /// say so ([`Event::ResumeAbandoned`]).
    fn resume_abandoned(&mut self) {
        if self.active.is_none() && self.state == State::Suspended {
            self.events.push_back(Event::ResumeAbandoned);
        }
    }

    fn enter_suspended(&mut self, now: Instant, reason: SuspendReason) {
        if self.suspended_since.is_none() {
            self.suspended_since = Some(now);
            self.release_spare_memory();
        }
        if matches!(self.state, State::Active) {
            self.state = State::Suspended;
        }
        let expires_at = self
            .expires_at()
            .unwrap_or_else(|| self.suspended_since.unwrap_or(now) + self.resume_timeout);
        self.events
            .push_back(Event::Suspended { reason, expires_at });
    }

    /// The active transport is gone (and the caller knows): suspend or fail.
    fn lose_active_quiet(&mut self, now: Instant, reason: SuspendReason) {
        let Some(t) = self.active.take() else { return };
        self.ping_outstanding = None;
        self.pong_due = None;
        self.ack_deadline = None;
        self.ack_now = false;
        self.unacked_bytes = 0;
        if self.state == State::Handshaking {
            // No session yet to preserve (first connect, or a server whose
            // client never finished the handshake): it ends here.
            let err = match reason {
                SuspendReason::TransportError(e) => e,
                _ => Error::HandshakeFailed,
            };
            self.finish(CloseReason::Error(err));
            return;
        }
        if matches!(self.state, State::Closed) {
            return;
        }
        if self.suspended_since.is_some() && !t.is_open() {
            // A re-dial that failed while already suspended: nothing new to report.
            return;
        }
        self.enter_suspended(now, reason);
    }

    /// The active transport died on our side: tell the caller to close it.
    fn lose_active(&mut self, now: Instant, reason: SuspendReason) {
        if let Some(t) = &self.active {
            let error = match &reason {
                SuspendReason::TransportError(e) => Some(e.clone()),
                _ => None,
            };
            self.events.push_back(Event::TransportClosed {
                transport: t.id,
                error,
            });
        }
        self.lose_active_quiet(now, reason);
    }

    /// Ends the session for good. An open transport first flushes a last
    /// record (our `ACK`, and a `CLOSE` naming a local error) and is then
    /// reported closed by `poll_transmit`.
    fn finish(&mut self, reason: CloseReason) {
        if self.state == State::Closed {
            return;
        }
        self.state = State::Closed;
        if let Some(p) = self.pending.take() {
            self.events.push_back(Event::TransportClosed {
                transport: p.id,
                error: None,
            });
        }
        self.final_close = match &reason {
            CloseReason::Error(Error::ProtocolViolation(_) | Error::Decode(_)) => {
                Some(code::PROTOCOL_VIOLATION)
            }
            CloseReason::Error(Error::FlowControl) => Some(code::FLOW_CONTROL),
            _ => None,
        };
        match self.active.as_mut() {
            Some(t) if t.is_open() && t.may_send => t.retire = true,
            Some(t) if t.retire => {}
            _ => {
                if let Some(t) = self.active.take() {
                    self.events.push_back(Event::TransportClosed {
                        transport: t.id,
                        error: None,
                    });
                }
            }
        }
        self.close_reason = Some(Box::new(reason.clone()));
        self.events.push_back(Event::Closed { reason });
        // Nothing will be sent again: free every send buffer now. Received
        // bytes stay readable (a graceful close follows the data it ends).
        self.log.clear();
        self.streams
            .retain(|_, s| !s.recv_buf.is_empty() || (s.fin_received && !s.eof_delivered));
        for s in self.streams.values_mut() {
            s.send_buf = Default::default();
            s.contending = false;
        }
        self.send_queue.clear();
        self.send_buffered = 0;
        self.contenders = 0;
    }

    // ------------------------------------------------------------ application commands

    fn check_open(&self) -> Result<(), StreamError> {
        match self.state {
            State::Closed | State::Closing => Err(StreamError::SessionClosed),
            _ => Ok(()),
        }
    }

    /// Opens a stream carrying `meta` (e.g. a relay target). Usable at once:
    /// writes are buffered until a transport carries them.
    pub fn open_stream(&mut self, meta: &[u8]) -> Result<StreamId, StreamError> {
        self.check_open()?;
        if meta.len() > MAX_META_LEN {
            return Err(StreamError::MetaTooLong);
        }
        if self.local_streams_opened >= self.local_stream_limit {
            return Err(StreamError::TooManyStreams);
        }
        let id = self.next_local_stream;
        self.next_local_stream += 2;
        self.local_streams_opened += 1;
        let send_max = self.peer_params.map_or(0, |p| p.stream_window);
        let mut s = Stream::new(meta.to_vec(), send_max, self.config.stream_window);
        s.in_log += 1;
        self.streams.insert(id, Box::new(s));
        self.log.push_back(Entry::Open(id));
        Ok(StreamId(id))
    }

    fn stream_mut(&mut self, id: StreamId) -> Result<&mut Stream, StreamError> {
        if self.state == State::Closed {
            return Err(StreamError::SessionClosed);
        }
        let s = self
            .streams
            .get_mut(&id.0)
            .ok_or(StreamError::UnknownStream)?;
        if let Some(code) = s.reset {
            // The application has now seen the reset; the stream can go.
            s.reset_seen = true;
            self.maybe_forget(id.0);
            return Err(StreamError::Reset(code));
        }
        // Re-borrow: maybe_forget above needed `self`.
        self.streams
            .get_mut(&id.0)
            .map(|s| &mut **s)
            .ok_or(StreamError::UnknownStream)
    }

    /// Send-buffer space was freed: writers that were refused may retry (a
    /// refusal can come from the session-wide limit, not only the stream's).
    /// A writer is told only once a useful amount is free both for it and for
    /// the session (an eighth of the buffer, at most 64 KiB), so a thousand
    /// blocked streams are not all woken for every small acknowledgement.
    fn wake_writers(&mut self) {
        let want = |limit: u64| (limit / 8).clamp(1, 64 * 1024);
        let limit = self.session_send_limit();
        let session_room = limit.saturating_sub(self.send_buffered);
        if session_room < want(limit) || self.write_waiters.is_empty() {
            return;
        }
        let stream_limit = self.stream_send_cap();
        let stream_want = want(stream_limit);
        let mut still = Vec::new();
        for id in std::mem::take(&mut self.write_waiters) {
            let Some(s) = self.streams.get_mut(&id) else {
                continue;
            };
            if !s.write_blocked || s.reset.is_some() {
                continue;
            }
            if stream_limit.saturating_sub(s.send_buf.len() as u64) >= stream_want {
                s.write_blocked = false;
                self.events.push_back(Event::StreamWritable {
                    stream: StreamId(id),
                });
            } else {
                still.push(id);
            }
        }
        self.write_waiters = still;
    }

    /// How many bytes one stream may hold in its send buffer now: a fair
    /// share of the session's send buffer among the streams that hold data
    /// and were refused room (`contenders`), between `MIN_STREAM_SHARE` and the
    /// stream's own `stream_send_buffer`. Without the share, a few dozen
    /// streams could fill the whole session buffer (at 1 MiB each) while
    /// hundreds of others waited for room (§8).
    fn stream_send_cap(&self) -> u64 {
        let writers = self.contenders.max(1);
        let limit = self.config.stream_send_buffer;
        (self.session_send_limit() / writers)
            .max(MIN_STREAM_SHARE.min(limit))
            .min(limit)
    }

    /// How many bytes the whole session may hold in its send buffers now:
    /// `Config::session_send_buffer`, grown while more streams contend than
    /// it holds `GROWN_STREAM_SHARE` shares for (256 at the default size),
    /// so that each keeps `GROWN_STREAM_SHARE` (at most
    /// `SEND_BUFFER_GROWTH` times the configured size). At 1,000 writing
    /// streams a 16 MiB buffer left each 16 KiB, so every frame, socket
    /// write and wake-up moved 16 KiB; at 64 KiB the relay's 1,000-stream
    /// download moved 18-26 % more on the same two cores (bench `many`).
    /// Sessions with a few writers keep the configured size.
    fn session_send_limit(&self) -> u64 {
        let base = self.config.session_send_buffer;
        self.contenders
            .saturating_mul(GROWN_STREAM_SHARE)
            .clamp(base, base.saturating_mul(SEND_BUFFER_GROWTH))
    }

    /// Counts a stream in (`true`) or out of the fair share's contenders.
    fn note_contending(&mut self, now_contending: bool) {
        if now_contending {
            self.contenders += 1;
        } else {
            self.contenders = self.contenders.saturating_sub(1);
        }
    }

    /// A stream stops contending (its data was acknowledged, reset or dropped).
    fn stop_contending(&mut self, id: u64) {
        if let Some(s) = self.streams.get_mut(&id) {
            if std::mem::take(&mut s.contending) {
                self.note_contending(false);
            }
        }
    }

    /// Buffers up to `data.len()` bytes for sending; returns how many were
    /// taken (0 when the buffers are full: wait for `StreamWritable`).
    pub fn write(&mut self, id: StreamId, data: &[u8]) -> Result<usize, StreamError> {
        self.check_open()?;
        let session_room = self.session_send_limit().saturating_sub(self.send_buffered);
        let stream_limit = self.stream_send_cap();
        let s = self.stream_mut(id)?;
        if s.fin_requested {
            return Err(StreamError::Finished);
        }
        let room = stream_limit
            .saturating_sub(s.send_buf.len() as u64)
            .min(session_room);
        let n = (data.len() as u64).min(room) as usize;
        s.send_buf.extend(&data[..n]);
        let refused = n < data.len();
        let contending_changed = s.contending != refused && (refused || !s.send_buf.is_empty());
        if contending_changed {
            s.contending = refused;
        }
        if refused && !s.write_blocked {
            s.write_blocked = true;
            self.write_waiters.push(id.0);
        }
        if contending_changed {
            self.note_contending(refused);
        }
        self.send_buffered += n as u64;
        self.enqueue(id.0);
        Ok(n)
    }

    /// Ends our direction of the stream after the bytes already written.
    /// Completion (`StreamSendComplete`) waits for the peer's acknowledgement,
    /// across any suspension.
    pub fn finish_stream(&mut self, id: StreamId) -> Result<(), StreamError> {
        self.check_open()?;
        let s = self.stream_mut(id)?;
        s.fin_requested = true;
        self.enqueue(id.0);
        Ok(())
    }

    /// Whether our direction of the stream is complete: finished and every
    /// byte of it acknowledged by the peer (`StreamSendComplete` was emitted).
    /// `false` for an unknown stream.
    pub fn stream_send_complete(&self, id: StreamId) -> bool {
        self.streams.get(&id.0).is_some_and(|s| s.fin_acked)
    }

    /// Aborts the stream in both directions; unsent bytes are dropped.
    pub fn reset_stream(&mut self, id: StreamId, code: u64) -> Result<(), StreamError> {
        self.check_open()?;
        let s = self.stream_mut(id)?;
        s.reset = Some(code);
        s.reset_seen = true;
        s.in_log += 1;
        let was_contending = std::mem::take(&mut s.contending);
        let unsent = s.written() - s.sent;
        let keep = (s.sent - s.send_base) as usize;
        s.send_buf.truncate(keep);
        let released = s.recv_buf.len() as u64;
        s.recv_buf = Default::default();
        self.send_buffered -= unsent;
        if was_contending {
            self.note_contending(false);
        }
        self.log.push_back(Entry::Reset { stream: id.0, code });
        self.consume(released);
        Ok(())
    }

    /// Copies received bytes into `buf`. `Ok(Some(0))` (with a non-empty `buf`)
    /// is end-of-stream; `Ok(None)` means nothing yet (wait for `StreamReadable`).
    pub fn read(&mut self, id: StreamId, buf: &mut [u8]) -> Result<Option<usize>, StreamError> {
        if self.state == State::Closed {
            return self.read_after_close(id, buf);
        }
        let window = self.config.stream_window;
        let s = self.stream_mut(id)?;
        if s.recv_buf.is_empty() {
            return Ok(self.reached_end(id).then_some(0));
        }
        let n = buf.len().min(s.recv_buf.len());
        let (a, b) = s.recv_buf.as_slices();
        let na = n.min(a.len());
        buf[..na].copy_from_slice(&a[..na]);
        buf[na..n].copy_from_slice(&b[..n - na]);
        self.taken(id, n, window);
        Ok(Some(n))
    }

    /// Lends received bytes to `f` instead of copying them out: `f` gets the
    /// oldest unread bytes (one contiguous piece, never empty) and answers
    /// how many it took, which then count as read exactly as `read`'s would
    /// (the window is re-granted the same way). A relay writes them straight
    /// into its target's socket this way, without a buffer of its own.
    ///
    /// Answers as `read` does: [`Lent::End`] for end-of-stream,
    /// [`Lent::Nothing`] when nothing arrived yet (wait for
    /// `StreamReadable`; `f` is not called in either case), errors alike.
    /// An `Err` from `f` takes nothing and is handed back in
    /// [`Lent::Lent`]; a count above what was lent is taken as all of it.
    pub fn read_with<E>(
        &mut self,
        id: StreamId,
        f: impl FnOnce(&[u8]) -> Result<usize, E>,
    ) -> Result<Lent<E>, StreamError> {
        if self.state == State::Closed {
            // As `read_after_close`: what arrived before the close, then the
            // stream's end (or `SessionClosed`).
            let Some(s) = self.closed_stream(id)? else {
                return Ok(Lent::End);
            };
            let r = f(front(&s.recv_buf));
            if let Ok(n) = r {
                let n = n.min(front(&s.recv_buf).len());
                s.recv_buf.drain(..n);
                return Ok(Lent::Lent(Ok(n)));
            }
            return Ok(Lent::Lent(r));
        }
        let window = self.config.stream_window;
        let s = self.stream_mut(id)?;
        if s.recv_buf.is_empty() {
            return Ok(if self.reached_end(id) {
                Lent::End
            } else {
                Lent::Nothing
            });
        }
        let lent = front(&s.recv_buf);
        let r = f(lent);
        match r {
            Ok(n) => {
                let n = n.min(lent.len());
                self.taken(id, n, window);
                Ok(Lent::Lent(Ok(n)))
            }
            Err(e) => Ok(Lent::Lent(Err(e))),
        }
    }

    /// Whether the reader of stream `id` (known, open, nothing buffered)
    /// reached its end: the peer finished it. The end is then noted as
    /// delivered, and the stream may be forgotten. `false`: nothing yet.
    fn reached_end(&mut self, id: StreamId) -> bool {
        let Some(s) = self.streams.get_mut(&id.0) else {
            return false;
        };
        if !s.fin_received {
            return false;
        }
        s.eof_delivered = true;
        self.maybe_forget(id.0);
        true
    }

    /// The reader took the `n` oldest received bytes of stream `id` (known,
    /// open, holding at least `n`): drops them, re-grants the stream window
    /// once half of it has been consumed (§8), and releases them from the
    /// session window.
    fn taken(&mut self, id: StreamId, n: usize, window: u64) {
        let Some(s) = self.streams.get_mut(&id.0) else {
            return;
        };
        s.recv_buf.drain(..n);
        let consumed = s.received - s.recv_buf.len() as u64;
        let mut update = None;
        if !s.fin_received && s.recv_max - consumed <= window / 2 {
            s.recv_max = consumed + window;
            s.in_log += 1;
            update = Some(s.recv_max);
        }
        if let Some(max) = update {
            self.log
                .push_back(Entry::MaxStreamData { stream: id.0, max });
        }
        self.consume(n as u64);
    }

    /// Copies received bytes, from the `skip`-th unread one on, into `buf`
    /// without taking them: they stay readable (and counted against the
    /// stream's window) until `read` takes them. Answers as `read` would
    /// for what lies past `skip` (`Ok(Some(0))`: end-of-stream, nothing
    /// past `skip` and the peer finished; `Ok(None)`: nothing yet) but
    /// changes nothing, so an application can take bytes only once it has
    /// put them somewhere safe, and look ahead while earlier ones are on
    /// their way.
    pub fn peek(
        &self,
        id: StreamId,
        skip: usize,
        buf: &mut [u8],
    ) -> Result<Option<usize>, StreamError> {
        let s = match self.streams.get(&id.0) {
            Some(s) => s,
            None if self.state == State::Closed => return Err(StreamError::SessionClosed),
            None => return Err(StreamError::UnknownStream),
        };
        if let Some(code) = s.reset {
            return Err(StreamError::Reset(code));
        }
        let have = s.recv_buf.len().saturating_sub(skip);
        if have == 0 {
            return match (s.fin_received, self.state == State::Closed) {
                (true, _) => Ok(Some(0)),
                (false, true) => Err(StreamError::SessionClosed),
                (false, false) => Ok(None),
            };
        }
        let n = buf.len().min(have);
        for (d, b) in buf[..n].iter_mut().zip(s.recv_buf.range(skip..skip + n)) {
            *d = *b;
        }
        Ok(Some(n))
    }

    /// Reads what arrived before the session closed; then end-of-stream if the
    /// peer had finished the stream, else `SessionClosed`.
    fn read_after_close(
        &mut self,
        id: StreamId,
        buf: &mut [u8],
    ) -> Result<Option<usize>, StreamError> {
        let Some(s) = self.closed_stream(id)? else {
            return Ok(Some(0));
        };
        let n = buf.len().min(s.recv_buf.len());
        for (d, b) in buf.iter_mut().zip(s.recv_buf.drain(..n)) {
            *d = b;
        }
        Ok(Some(n))
    }

    /// A stream of the closed session, to read what arrived before the
    /// close: `Some` while it holds bytes; `None` at its end (the peer had
    /// finished it), when it is forgotten. `SessionClosed` when it is not
    /// known or was cut short by the close, `Reset` when it was reset
    /// (forgotten in both cases).
    fn closed_stream(&mut self, id: StreamId) -> Result<Option<&mut Stream>, StreamError> {
        let Some(s) = self.streams.get(&id.0) else {
            return Err(StreamError::SessionClosed);
        };
        if let Some(code) = s.reset {
            // A reset stream's discarded bytes must not read as a clean end
            // (found by fuzzing): report the reset, as before the close.
            self.streams.remove(&id.0);
            return Err(StreamError::Reset(code));
        }
        if s.recv_buf.is_empty() {
            let fin = s.fin_received;
            self.streams.remove(&id.0);
            return if fin {
                Ok(None)
            } else {
                Err(StreamError::SessionClosed)
            };
        }
        Ok(self.streams.get_mut(&id.0).map(|s| &mut **s))
    }

    /// Closes the session gracefully: everything already written is delivered,
    /// then the peer learns the code. Completes when the peer acknowledges, even
    /// if that needs a resume first.
    pub fn close(&mut self, code: u64, reason: &str) {
        if matches!(self.state, State::Closed | State::Closing) {
            return;
        }
        if self.state == State::Handshaking {
            // Nothing established to close gracefully: abandon the handshake.
            self.finish(CloseReason::Local { code });
            return;
        }
        let mut end = reason.len().min(crate::frame::MAX_TEXT_LEN);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        // The CLOSE enters the log only after every written byte (§10.1).
        self.close_requested = Some(Box::new((code, reason.as_bytes()[..end].to_vec())));
        self.state = State::Closing;
    }

    /// Server: announce the addresses this session's server can be reached at.
    pub fn set_addresses(&mut self, addrs: Vec<String>) {
        if self.role == Role::Server && self.check_open().is_ok() {
            let addrs = addrs
                .into_iter()
                .filter(|a| a.len() <= crate::frame::MAX_TEXT_LEN)
                .take(crate::frame::MAX_ADDRESSES)
                .collect();
            self.log.push_back(Entry::Addresses(addrs));
        }
    }

    /// Server: ask the client to resume at `addr` (e.g. before this host drains).
    pub fn move_to(&mut self, addr: String) {
        if self.role == Role::Server
            && self.check_open().is_ok()
            && addr.len() <= crate::frame::MAX_TEXT_LEN
        {
            self.log.push_back(Entry::MoveTo(addr));
        }
    }

    /// Client: ask the server to move this session to host `host` of its
    /// cluster (empty: any host the server picks), §9.4. The server may
    /// refuse silently; a move that happens arrives as a `MOVE_TO`.
    pub fn ask_move(&mut self, host: String) {
        if self.role == Role::Client
            && self.check_open().is_ok()
            && host.len() <= crate::frame::MAX_TEXT_LEN
        {
            self.log.push_back(Entry::MoveAsk(host));
        }
    }

    fn enqueue(&mut self, id: u64) {
        if let Some(s) = self.streams.get_mut(&id) {
            if !s.queued && s.wants_send() {
                s.queued = true;
                self.send_queue.push_back(id);
            }
        }
    }

    /// The application consumed `n` received bytes: maybe re-grant the session window.
    fn consume(&mut self, n: u64) {
        self.conn_consumed += n;
        let window = self.config.session_window;
        if self.conn_recv_max - self.conn_consumed <= window / 2 {
            self.conn_recv_max = self.conn_consumed + window;
            self.log.push_back(Entry::MaxData(self.conn_recv_max));
        }
    }

    /// Drops a stream's state once nothing about it can happen any more.
    fn maybe_forget(&mut self, id: u64) {
        if self.streams.get(&id).is_some_and(|s| s.is_done()) {
            self.stop_contending(id);
            self.streams.remove(&id);
            if !self.is_local_stream(id) {
                // Grant the peer a new stream for each one forgotten, in batches (§6.5).
                self.peer_streams_forgotten += 1;
                let target = self.peer_streams_forgotten + self.config.params().max_streams;
                if target - self.peer_stream_limit >= (self.config.params().max_streams / 2).max(1)
                {
                    self.peer_stream_limit = target;
                    self.log.push_back(Entry::MaxStreams(target));
                }
            }
        }
    }

    fn is_local_stream(&self, id: u64) -> bool {
        (id & 1 == 0) == (self.role == Role::Client)
    }

    fn peer_params_or_default(&self) -> Params {
        self.peer_params.unwrap_or(Params {
            stream_window: 0,
            session_window: 0,
            max_streams: 0,
        })
    }

    fn set_peer_params(&mut self, p: Params) {
        self.peer_params = Some(p);
        self.local_stream_limit = self.local_stream_limit.max(p.max_streams);
        self.conn_send_max = self.conn_send_max.max(p.session_window);
        let ids: Vec<u64> = self.streams.keys().copied().collect();
        for id in ids {
            if let Some(s) = self.streams.get_mut(&id) {
                s.send_max = s.send_max.max(p.stream_window);
            }
            self.enqueue(id);
        }
    }

    fn mark_closing_done(&mut self, code: u64) {
        self.finish(CloseReason::Local { code });
    }
}

impl Error {
    /// The refusal status a server sends for this error (§4.2).
    pub fn refusal_status(&self) -> handshake::Status {
        match self {
            Error::UnsupportedVersion => handshake::Status::UnsupportedVersion,
            Error::UnknownSession => handshake::Status::UnknownSession,
            Error::ReplayedResume => handshake::Status::Replay,
            Error::ServerBusy => handshake::Status::Busy,
            _ => handshake::Status::ResumeRejected,
        }
    }
}
