//! The session state machine under hostile input (`docs/PROTOCOL.md` §3-§10).
//!
//! Two real sessions, a client and a server, talk through an in-memory link.
//! The first input byte picks a mode:
//!
//! - bit 7 clear, *raw*: the pair completes its handshake, then the rest of
//!   the input is fed as raw bytes to the client's transport and (the low seven
//!   bits say where the input splits) to the server's, followed by
//!   `poll_transmit`, `poll_event` and `handle_timeout` at a few instants.
//! - bit 7 set, *script*: the rest is decoded with `arbitrary` into a script of
//!   application calls, timer jumps, reconnects/resumes and link faults (partial
//!   delivery, corruption, loss, injection, resets), starting mid-handshake.
//!   Besides "never panics", it checks that every stream byte is delivered in
//!   order, exactly as written, and that end-of-stream comes only after all of
//!   them and the writer's finish.
//!
//! Nothing may loop forever: every drive loop is bounded, and a session that
//! keeps producing output without new input fails the run.

#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use roam_proto::{
    parse_hello, ClientConfig, Config, Event, Keypair, ServerConfig, ServerTrust, Session, State,
    StreamId, TransportId,
};

/// Identities, built once per process: key derivation dominates setup.
struct Identities {
    client: ClientConfig,
    server: ServerConfig,
}

fn identities() -> &'static Identities {
    static IDS: OnceLock<Identities> = OnceLock::new();
    IDS.get_or_init(|| {
        let server_key = Keypair::from_private([0x5a; 32]);
        Identities {
            client: ClientConfig {
                keypair: Keypair::from_private([0x17; 32]),
                server_trust: ServerTrust::Pinned(server_key.public()),
                session: Config::default(),
            },
            server: ServerConfig {
                keypair: server_key,
                authorized_keys: None,
                addresses: vec!["127.0.0.1:7447".into()],
                session: Config::default(),
            },
        }
    })
}

/// `poll_transmit` calls in a row before a session counts as never going quiet.
/// One call emits at most 256 KiB, and windows cap what is in flight at 16 MiB.
const MAX_TRANSMITS: usize = 256;
/// Link round trips per `pump` before the pair counts as livelocked.
const MAX_PUMP_ROUNDS: usize = 1_000;
/// Script steps per input.
const MAX_STEPS: usize = 2_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
enum Side {
    Client,
    Server,
}

/// Period of the stream byte pattern (a prime, so no framing size divides it).
const PERIOD: usize = 65_521;
/// Largest single `write`.
const MAX_WRITE: usize = 1 << 17;

/// `PERIOD + MAX_WRITE` bytes repeating with period `PERIOD`: stream contents are slices of it.
fn table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let period: Vec<u8> = (0..PERIOD)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        period
            .iter()
            .cycle()
            .take(PERIOD + MAX_WRITE)
            .copied()
            .collect()
    })
}

/// The `len` bytes `writer` writes at `offset` of `stream`: readers check each byte.
fn pattern(writer: Side, stream: u64, offset: u64, len: usize) -> &'static [u8] {
    let base = stream.wrapping_mul(7_919) + (writer as u64) * 104_729 + offset;
    let at = (base % PERIOD as u64) as usize;
    &table()[at..at + len]
}

/// One direction of the in-memory link.
#[derive(Default)]
struct Pipe {
    bytes: Vec<u8>,
    /// The sending end closed: after `bytes` drain, the receiver sees EOF.
    closed: bool,
    /// The receiver was told about the EOF (or closed its own end).
    eof_delivered: bool,
}

/// The current transport: one TCP connection, as far as the sessions can tell.
#[derive(Default)]
struct Link {
    client_tid: Option<TransportId>,
    /// `None` until the server has parsed the client's hello.
    server_tid: Option<TransportId>,
    /// Server side bytes received before the hello was complete.
    hello_buf: Vec<u8>,
    to_server: Pipe,
    to_client: Pipe,
}

/// Per-side bookkeeping for the stream oracle.
#[derive(Default)]
struct Book {
    streams: Vec<StreamId>,
    /// Bytes this side's `write` accepted, by stream.
    written: HashMap<u64, u64>,
    /// This side called `finish_stream` successfully.
    finished: HashMap<u64, bool>,
    /// Bytes this side has read, by stream.
    read: HashMap<u64, u64>,
    closed: bool,
    connected: bool,
}

struct World {
    now: Instant,
    client: Session,
    server: Option<Session>,
    link: Link,
    books: [Book; 2],
    scratch: Vec<u8>,
}

impl World {
    fn new() -> Self {
        let now = Instant::now();
        let mut client = Session::client(identities().client.clone());
        let tid = client.connect(now, None).expect("first connect");
        let mut w = World {
            now,
            client,
            server: None,
            link: Link {
                client_tid: Some(tid),
                ..Link::default()
            },
            books: Default::default(),
            scratch: Vec::new(),
        };
        w.settle();
        w
    }

    fn book(&mut self, side: Side) -> &mut Book {
        &mut self.books[side as usize]
    }

    /// Polls both sessions' output onto the link and handles their events.
    fn settle(&mut self) {
        let now = self.now;
        for _ in 0..MAX_TRANSMITS {
            self.scratch.clear();
            let Some(tid) = self.client.poll_transmit(now, &mut self.scratch) else {
                break;
            };
            assert!(
                !self.scratch.is_empty(),
                "poll_transmit named a transport but wrote nothing"
            );
            if self.link.client_tid == Some(tid) && !self.link.to_server.closed {
                self.link.to_server.bytes.extend_from_slice(&self.scratch);
            }
        }
        assert!(
            self.client.poll_transmit(now, &mut self.scratch).is_none(),
            "client never quiet"
        );
        if let Some(server) = self.server.as_mut() {
            for _ in 0..MAX_TRANSMITS {
                self.scratch.clear();
                let Some(tid) = server.poll_transmit(now, &mut self.scratch) else {
                    break;
                };
                assert!(
                    !self.scratch.is_empty(),
                    "poll_transmit named a transport but wrote nothing"
                );
                if self.link.server_tid == Some(tid) && !self.link.to_client.closed {
                    self.link.to_client.bytes.extend_from_slice(&self.scratch);
                }
            }
            assert!(
                server.poll_transmit(now, &mut self.scratch).is_none(),
                "server never quiet"
            );
        }
        self.drain_events(Side::Client);
        self.drain_events(Side::Server);
    }

    fn drain_events(&mut self, side: Side) {
        loop {
            let event = match side {
                Side::Client => self.client.poll_event(),
                Side::Server => match self.server.as_mut() {
                    Some(s) => s.poll_event(),
                    None => None,
                },
            };
            let Some(event) = event else { break };
            if trace() {
                eprintln!("{side:?} event: {event:?}");
            }
            if self.book(side).closed {
                // `Event::Closed`: "no further events follow except `TransportClosed`".
                assert!(
                    matches!(event, Event::TransportClosed { .. }),
                    "{side:?}: event after Closed: {event:?}"
                );
            }
            match event {
                Event::Connected { .. } => self.book(side).connected = true,
                Event::StreamOpened { stream } => self.book(side).streams.push(stream),
                Event::TransportClosed { transport, .. } => self.close_end(side, transport),
                Event::Closed { .. } => self.book(side).closed = true,
                _ => {}
            }
        }
        let state = match side {
            Side::Client => Some(self.client.state()),
            Side::Server => self.server.as_ref().map(Session::state),
        };
        if let Some(state) = state {
            assert_eq!(
                state == State::Closed,
                self.book(side).closed,
                "{side:?}: state {state:?} disagrees with the events"
            );
        }
    }

    /// `side` closes its socket of transport `tid`, if that is the link's.
    fn close_end(&mut self, side: Side, tid: TransportId) {
        let link = &mut self.link;
        let (mine, out, inbound) = match side {
            Side::Client => (link.client_tid, &mut link.to_server, &mut link.to_client),
            Side::Server => (link.server_tid, &mut link.to_client, &mut link.to_server),
        };
        if mine == Some(tid) {
            out.closed = true;
            inbound.eof_delivered = true;
            inbound.bytes.clear();
        }
    }

    /// Delivers up to `max` queued bytes (all if `max` is 0) to `to`; an empty
    /// pipe whose sender closed delivers EOF. Returns whether anything happened.
    fn deliver(&mut self, to: Side, max: usize) -> bool {
        // Application calls since the last step may have left output to poll.
        self.settle();
        let pipe = match to {
            Side::Client => &mut self.link.to_client,
            Side::Server => &mut self.link.to_server,
        };
        if pipe.eof_delivered {
            return false;
        }
        if pipe.bytes.is_empty() {
            if !pipe.closed {
                return false;
            }
            pipe.eof_delivered = true;
            self.eof(to);
            self.settle();
            return true;
        }
        let n = if max == 0 {
            pipe.bytes.len()
        } else {
            max.min(pipe.bytes.len())
        };
        let chunk: Vec<u8> = pipe.bytes.drain(..n).collect();
        self.input(to, &chunk);
        self.settle();
        true
    }

    fn eof(&mut self, to: Side) {
        let now = self.now;
        match to {
            Side::Client => {
                if let Some(tid) = self.link.client_tid {
                    self.client.handle_transport_closed(now, tid);
                }
            }
            Side::Server => {
                if let (Some(s), Some(tid)) = (self.server.as_mut(), self.link.server_tid) {
                    s.handle_transport_closed(now, tid);
                }
            }
        }
    }

    /// Raw bytes arriving at `to`'s end of the link.
    fn input(&mut self, to: Side, data: &[u8]) {
        let now = self.now;
        let failed = match to {
            Side::Client => {
                let Some(tid) = self.link.client_tid else {
                    return;
                };
                self.client.handle_input(now, tid, data).is_err()
            }
            Side::Server => match self.link.server_tid {
                Some(tid) => match self.server.as_mut() {
                    Some(s) => s.handle_input(now, tid, data).is_err(),
                    None => return,
                },
                None => self.server_hello(data),
            },
        };
        if failed {
            // The caller closes a transport whose input failed, after writing
            // what the session still has for it.
            self.settle();
            let tid = match to {
                Side::Client => self.link.client_tid,
                Side::Server => self.link.server_tid,
            };
            if let Some(tid) = tid {
                self.close_end(to, tid);
            }
        }
    }

    /// A server endpoint reading the first bytes of a transport. Returns
    /// whether the transport failed.
    fn server_hello(&mut self, data: &[u8]) -> bool {
        let now = self.now;
        self.link.hello_buf.extend_from_slice(data);
        let (hello, used) = match parse_hello(&self.link.hello_buf) {
            Ok(Some(h)) => h,
            Ok(None) => return false,
            Err(_) => {
                self.refuse();
                return false;
            }
        };
        assert!(used <= self.link.hello_buf.len());
        let rest = self.link.hello_buf.split_off(used);
        let result = match (hello.resume_session(), self.server.as_mut()) {
            (None, None) => {
                Session::accept(&identities().server, now, &hello, None).map(|(s, tid)| {
                    self.server = Some(s);
                    tid
                })
            }
            (Some(_), Some(s)) => s.accept_resume(now, &hello, None),
            (None, Some(_)) => Err(roam_proto::Error::ProtocolViolation("second new session")),
            (Some(_), None) => Err(roam_proto::Error::UnknownSession),
        };
        match result {
            Ok(tid) => {
                self.link.server_tid = Some(tid);
                let s = self.server.as_mut().expect("server exists after accept");
                s.handle_input(now, tid, &rest).is_err()
            }
            Err(e) => {
                let mut out = Vec::new();
                hello.reject(e.refusal_status(), &mut out);
                self.link.to_client.bytes.extend_from_slice(&out);
                self.refuse();
                false
            }
        }
    }

    /// The server endpoint drops a transport it will not serve.
    fn refuse(&mut self) {
        self.link.to_client.closed = true;
        self.link.to_server.eof_delivered = true;
        self.link.to_server.bytes.clear();
    }

    /// Delivers everything both ways until nothing moves.
    fn pump(&mut self) {
        for _ in 0..MAX_PUMP_ROUNDS {
            let a = self.deliver(Side::Server, 0);
            let b = self.deliver(Side::Client, 0);
            if !a && !b {
                return;
            }
        }
        panic!("link never went quiet after {MAX_PUMP_ROUNDS} rounds");
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        let now = self.now;
        self.client.handle_timeout(now);
        if let Some(s) = self.server.as_mut() {
            s.handle_timeout(now);
        }
        self.settle();
    }

    fn session(&mut self, side: Side) -> Option<&mut Session> {
        match side {
            Side::Client => Some(&mut self.client),
            Side::Server => self.server.as_mut(),
        }
    }

    fn pick_stream(&self, side: Side, sel: u8) -> StreamId {
        let streams = &self.books[side as usize].streams;
        if streams.is_empty() || sel >= 250 {
            StreamId(u64::from(sel))
        } else {
            streams[usize::from(sel) % streams.len()]
        }
    }

    fn write(&mut self, side: Side, sel: u8, len: usize) {
        let id = self.pick_stream(side, sel);
        let start = self.books[side as usize]
            .written
            .get(&id.0)
            .copied()
            .unwrap_or(0);
        let data = pattern(side, id.0, start, len.min(MAX_WRITE));
        let Some(s) = self.session(side) else { return };
        if let Ok(n) = s.write(id, data) {
            assert!(n <= len);
            *self.book(side).written.entry(id.0).or_default() += n as u64;
        }
    }

    fn read(&mut self, side: Side, sel: u8, len: usize) {
        let id = self.pick_stream(side, sel);
        let mut buf = vec![0u8; len];
        let Some(s) = self.session(side) else { return };
        let Ok(Some(n)) = s.read(id, &mut buf) else {
            return;
        };
        let writer = match side {
            Side::Client => Side::Server,
            Side::Server => Side::Client,
        };
        let pos = self.books[side as usize]
            .read
            .get(&id.0)
            .copied()
            .unwrap_or(0);
        let written = self.books[writer as usize]
            .written
            .get(&id.0)
            .copied()
            .unwrap_or(0);
        let finished = self.books[writer as usize]
            .finished
            .get(&id.0)
            .copied()
            .unwrap_or(false);
        if n == 0 && len > 0 {
            assert!(
                finished && pos == written,
                "{side:?} stream {id}: end-of-stream after {pos} of {written} bytes (finished: {finished})"
            );
            return;
        }
        assert!(n <= len);
        assert!(
            pos + n as u64 <= written,
            "{side:?} stream {id}: read past what was written"
        );
        if buf[..n] != *pattern(writer, id.0, pos, n) {
            let expected = pattern(writer, id.0, pos, n);
            let at = (0..n).find(|&i| buf[i] != expected[i]).unwrap_or(0);
            panic!("{side:?} stream {id}: wrong byte at {}", pos + at as u64);
        }
        *self.book(side).read.entry(id.0).or_default() += n as u64;
    }

    /// Client: abandon the current transport and dial again (resume).
    fn reconnect(&mut self, tell_server: bool) {
        let now = self.now;
        if tell_server {
            if let (Some(s), Some(tid)) = (self.server.as_mut(), self.link.server_tid) {
                s.handle_transport_closed(now, tid);
            }
        }
        if let Ok(tid) = self.client.connect(now, None) {
            self.link = Link {
                client_tid: Some(tid),
                ..Link::default()
            };
        }
        self.settle();
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Open { side, meta_len } => {
                let meta = vec![b'm'; usize::from(meta_len) * 5];
                if let Some(Ok(id)) = self.session(side.into()).map(|s| s.open_stream(&meta)) {
                    self.book(side.into()).streams.push(id);
                }
            }
            Op::Write {
                side,
                stream,
                len,
                shift,
            } => {
                self.write(side.into(), stream, (usize::from(len) << 1) >> (shift % 8));
            }
            Op::Read { side, stream, len } => self.read(side.into(), stream, usize::from(len)),
            Op::Finish { side, stream } => {
                let id = self.pick_stream(side.into(), stream);
                if let Some(Ok(())) = self.session(side.into()).map(|s| s.finish_stream(id)) {
                    self.book(side.into()).finished.insert(id.0, true);
                }
            }
            Op::Reset { side, stream, code } => {
                let id = self.pick_stream(side.into(), stream);
                if let Some(s) = self.session(side.into()) {
                    let _ = s.reset_stream(id, u64::from(code));
                }
            }
            Op::Close { side, code } => {
                if let Some(s) = self.session(side.into()) {
                    s.close(u64::from(code), "fuzz");
                }
            }
            Op::Announce { addrs } => {
                if let Some(s) = self.server.as_mut() {
                    s.set_addresses(
                        (0..addrs % 20)
                            .map(|i| format!("10.0.0.{i}:7447"))
                            .collect(),
                    );
                }
            }
            Op::MoveTo => {
                if let Some(s) = self.server.as_mut() {
                    s.move_to("10.0.0.9:7447".into());
                }
            }
            Op::Deliver { to, max } => {
                self.deliver(to.into(), usize::from(max));
            }
            Op::Pump => self.pump(),
            Op::Corrupt { to, at, xor } => {
                let pipe = self.pipe(to.into());
                if !pipe.bytes.is_empty() {
                    let i = usize::from(at) % pipe.bytes.len();
                    pipe.bytes[i] ^= xor.max(1);
                }
            }
            Op::Lose { to, n } => {
                let pipe = self.pipe(to.into());
                let n = usize::from(n).min(pipe.bytes.len());
                pipe.bytes.drain(..n);
            }
            Op::Inject { to, bytes } => self.pipe(to.into()).bytes.extend_from_slice(&bytes),
            Op::CloseTransport { side } => {
                let side: Side = side.into();
                let tid = match side {
                    Side::Client => self.link.client_tid,
                    Side::Server => self.link.server_tid,
                };
                if let Some(tid) = tid {
                    let now = self.now;
                    if let Some(s) = self.session(side) {
                        s.handle_transport_closed(now, tid);
                    }
                    self.close_end(side, tid);
                    self.settle();
                }
            }
            Op::Reconnect { tell_server } => self.reconnect(tell_server),
            Op::AdvanceMs(ms) => self.advance(Duration::from_millis(u64::from(ms))),
            Op::AdvanceSecs(secs) => {
                self.advance(Duration::from_secs(u64::from(secs % (4 * 86_400))))
            }
            Op::AdvanceToTimer { side } => {
                let now = self.now;
                let at = self.session(side.into()).and_then(|s| s.poll_timeout());
                if let Some(at) = at {
                    self.advance(at.saturating_duration_since(now));
                }
            }
        }
    }

    /// The link towards `to`, with everything the sessions have to send on it.
    fn pipe(&mut self, to: Side) -> &mut Pipe {
        self.settle();
        match to {
            Side::Client => &mut self.link.to_client,
            Side::Server => &mut self.link.to_server,
        }
    }
}

/// `false` is the client, `true` the server.
#[derive(Arbitrary, Debug, Clone, Copy)]
struct Who(bool);

impl From<Who> for Side {
    fn from(w: Who) -> Side {
        if w.0 {
            Side::Server
        } else {
            Side::Client
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Open {
        side: Who,
        meta_len: u8,
    },
    Write {
        side: Who,
        stream: u8,
        len: u16,
        shift: u8,
    },
    Read {
        side: Who,
        stream: u8,
        len: u16,
    },
    Finish {
        side: Who,
        stream: u8,
    },
    Reset {
        side: Who,
        stream: u8,
        code: u8,
    },
    Close {
        side: Who,
        code: u8,
    },
    Announce {
        addrs: u8,
    },
    MoveTo,
    Deliver {
        to: Who,
        max: u16,
    },
    Pump,
    Corrupt {
        to: Who,
        at: u16,
        xor: u8,
    },
    Lose {
        to: Who,
        n: u16,
    },
    Inject {
        to: Who,
        bytes: Vec<u8>,
    },
    CloseTransport {
        side: Who,
    },
    Reconnect {
        tell_server: bool,
    },
    AdvanceMs(u16),
    AdvanceSecs(u32),
    AdvanceToTimer {
        side: Who,
    },
}

/// `ROAM_FUZZ_TRACE=1` prints each script step, for triaging a crash.
fn trace() -> bool {
    static TRACE: OnceLock<bool> = OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("ROAM_FUZZ_TRACE").is_some())
}

/// Raw mode: an established pair, then hostile bytes on its transports.
fn raw(split: u8, data: &[u8]) {
    let mut w = World::new();
    w.pump();
    assert!(
        w.books[0].connected && w.books[1].connected,
        "handshake did not complete"
    );
    let at = data.len() * usize::from(split) / 0x7f;
    let (to_server, to_client) = data.split_at(at);
    w.input(Side::Client, to_client);
    w.settle();
    if !to_server.is_empty() {
        w.input(Side::Server, to_server);
        w.settle();
    }
    for ms in [0, 3, 1_500, 6_000, 10_000] {
        w.advance(Duration::from_millis(ms));
    }
    w.advance(Duration::from_secs(3 * 86_400));
}

fn script(data: &[u8]) {
    let mut w = World::new();
    let mut u = Unstructured::new(data);
    for _ in 0..MAX_STEPS {
        if u.is_empty() {
            break;
        }
        let Ok(op) = Op::arbitrary(&mut u) else { break };
        if trace() {
            eprintln!("op: {op:?}");
        }
        w.apply(op);
    }
    w.pump();
    w.advance(Duration::from_millis(10));
    w.pump();
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 0x80 == 0 {
        raw(mode & 0x7f, rest);
    } else {
        script(rest);
    }
});
