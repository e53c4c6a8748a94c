//! The shared harness of the session fuzz targets (`session_state`,
//! `session_input`): a real client and server [`Session`] joined by an
//! in-memory link the fuzzer controls, a script language of application calls,
//! link faults, resumes, time jumps and hostile frames ([`Op`]), and the
//! oracle that checks the protocol's promises after every step
//! ([`World::check`], [`World::apply`]).
//!
//! Built with `cfg(fuzzing)`, roam-proto replaces its cryptography with cheap
//! stand-ins (`crates/roam-proto/src/suite_fuzzing.rs`) that keep every check,
//! and lets a session be copied ([`Session::fuzz_clone`]): the established
//! pair for each [`Preset`] is built once per process and every input starts
//! from a copy of it, so no input pays for a handshake it did not ask for.
//!
//! Invariants, checked after every step on both sides (the per-stream memory
//! bounds every [`FULL_CHECK_EVERY`] steps and at the end):
//! - nothing panics, nothing loops (every drive loop is bounded);
//! - every byte read is the byte written at that offset of that stream, and
//!   end-of-stream comes only after all of them and the writer's finish
//!   (a side that received fuzzer-built frames is exempt: its peer lied);
//! - memory stays within the configured bounds: send buffers within
//!   `SEND_BUFFER_GROWTH` times `session_send_buffer` (its growth while many streams
//!   contend), unread bytes within `stream_window` per stream and
//!   `session_window` in total, peer-opened streams within `max_streams`;
//! - a closed session stays closed: state `Closed` forever, no events but
//!   `TransportClosed` after `Closed`, writes and opens refused.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use roam_proto::frame::Frame;
use roam_proto::{
    route_opening, ClientConfig, Config, Event, Keypair, Opening, ServerConfig, ServerTrust,
    Session, State, StreamId, TransportId,
};

/// Identities, built once per process: key derivation dominates setup.
struct Identities {
    client: ClientConfig,
    server: ServerConfig,
}

/// The limits a script runs under. The first input byte picks one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Preset {
    /// `Config::default()`: 16 MiB windows, as deployed.
    Default,
    /// Small windows and buffers: they bind after a few large writes. (The
    /// defaults' windows make each input move megabytes before they bind.)
    Small,
    /// Tiny limits: every window, buffer and stream limit binds within a few steps.
    Tiny,
}

impl Preset {
    /// The preset a selector byte names (`Small` and `Tiny` twice as often as
    /// `Default`, whose windows rarely bind in a short script).
    pub fn from_byte(b: u8) -> Preset {
        match b % 5 {
            0 => Preset::Default,
            1 | 3 => Preset::Small,
            _ => Preset::Tiny,
        }
    }

    fn config(self) -> Config {
        match self {
            Preset::Default => Config::default(),
            Preset::Small => Config {
                stream_window: 64 << 10,
                session_window: 256 << 10,
                stream_send_buffer: 96 << 10,
                session_send_buffer: 320 << 10,
                max_streams: 64,
                ..Config::default()
            },
            Preset::Tiny => Config {
                stream_window: 1_500,
                session_window: 4_000,
                stream_send_buffer: 2_000,
                session_send_buffer: 5_000,
                max_streams: 16,
                ..Config::default()
            },
        }
    }
}

/// Identities for each preset, built once per process.
fn identities(preset: Preset) -> &'static Identities {
    static IDS: OnceLock<[Identities; 3]> = OnceLock::new();
    let ids = IDS.get_or_init(|| {
        let server_key = Keypair::from_private([0x5a; 32]);
        [Preset::Default, Preset::Small, Preset::Tiny].map(|preset| {
            let session = preset.config();
            Identities {
                client: ClientConfig {
                    keypair: Keypair::from_private([0x17; 32]),
                    server_trust: ServerTrust::Pinned(server_key.public()),
                    session: session.clone(),
                },
                server: ServerConfig {
                    keypair: server_key.clone(),
                    authorized_keys: None,
                    addresses: vec!["127.0.0.1:7447".into()],
                    session,
                },
            }
        })
    });
    &ids[preset as usize]
}

/// `poll_transmit` calls in a row before a session counts as never going quiet.
/// One call emits at most 256 KiB, and windows cap what is in flight at 16 MiB.
const MAX_TRANSMITS: usize = 256;
/// Link round trips per `pump` before the pair counts as livelocked.
const MAX_PUMP_ROUNDS: usize = 1_000;
/// Steps between full (per-stream) invariant checks.
pub const FULL_CHECK_EVERY: usize = 8;

/// One end of the pair.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Side {
    Client,
    Server,
}

/// Period of the stream byte pattern (a prime, so no framing size divides it).
const PERIOD: usize = 65_521;
/// Largest single `write`.
const MAX_WRITE: usize = 1 << 15;
/// Longest slice [`pattern`] gives (a write, a read's check, a built frame).
const MAX_SLICE: usize = 1 << 17;

/// `PERIOD + MAX_SLICE` bytes repeating with period `PERIOD`: stream contents are slices of it.
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
        // Periodic: byte i is byte i % PERIOD, so any slice is the pattern.
        period
            .iter()
            .cycle()
            .take(PERIOD + MAX_SLICE)
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
#[derive(Default, Clone)]
struct Pipe {
    bytes: Vec<u8>,
    /// The sending end closed: after `bytes` drain, the receiver sees EOF.
    closed: bool,
    /// The receiver was told about the EOF (or closed its own end).
    eof_delivered: bool,
}

/// The current transport: one TCP connection, as far as the sessions can tell.
#[derive(Default, Clone)]
struct Link {
    client_tid: Option<TransportId>,
    /// `None` until the server has parsed the client's hello.
    server_tid: Option<TransportId>,
    /// Server side bytes received before the hello was complete.
    hello_buf: Vec<u8>,
    to_server: Pipe,
    to_client: Pipe,
}

impl Link {
    /// A fresh link for the client's transport `tid`, its pipes emptied
    /// into the allocations given (a previous link's), so they are not
    /// grown again.
    fn reusing(tid: TransportId, mut to_server: Vec<u8>, mut to_client: Vec<u8>) -> Link {
        to_server.clear();
        to_client.clear();
        let mut link = Link {
            client_tid: Some(tid),
            ..Link::default()
        };
        link.to_server.bytes = to_server;
        link.to_client.bytes = to_client;
        link
    }
}

/// Per-side bookkeeping for the stream oracle.
#[derive(Default, Clone)]
pub struct Book {
    streams: Vec<StreamId>,
    /// Bytes this side's `write` accepted, by stream.
    written: HashMap<u64, u64>,
    /// This side called `finish_stream` successfully.
    finished: HashMap<u64, bool>,
    /// Bytes this side has read, by stream.
    read: HashMap<u64, u64>,
    /// This side received frames built by the fuzzer: its streams' contents
    /// are whatever the "peer" said, so the content oracle is off.
    tainted: bool,
    /// Streams this side's application opened.
    opened: u64,
    closed: bool,
    connected: bool,
}

/// A client and a server session joined by an in-memory link, with the
/// oracle's bookkeeping.
pub struct World {
    ids: &'static Identities,
    now: Instant,
    client: Session,
    server: Option<Session>,
    link: Link,
    /// The oracle's bookkeeping, `[client, server]`.
    pub books: [Book; 2],
    /// Reused buffer for bytes being delivered.
    chunk: Vec<u8>,
    /// Reused buffer for stream reads.
    readbuf: Vec<u8>,
    /// Inputs delivered so far: every other one goes through
    /// `handle_input_in_place` (records opened where they were read), the
    /// rest through `handle_input`, so both paths, and a record begun on
    /// one and finished on the other, are fuzzed.
    inputs: u32,
}

thread_local! {
    /// The established pair of each preset, built on first use; inputs start
    /// from copies of it (libFuzzer runs inputs on one thread).
    static ESTABLISHED: RefCell<[Option<World>; 3]> = const { RefCell::new([None, None, None]) };
}

/// Buffers a finished input's world leaves for the next one, so an input does
/// not start by growing (and, for large ones, page-faulting in)
/// the same buffers again.
#[derive(Default)]
struct Spare {
    to_server: Vec<u8>,
    to_client: Vec<u8>,
    chunk: Vec<u8>,
    readbuf: Vec<u8>,
}

thread_local! {
    static SPARE: RefCell<Spare> = RefCell::new(Spare::default());
}

impl Drop for World {
    fn drop(&mut self) {
        let spare = Spare {
            to_server: std::mem::take(&mut self.link.to_server.bytes),
            to_client: std::mem::take(&mut self.link.to_client.bytes),
            chunk: std::mem::take(&mut self.chunk),
            readbuf: std::mem::take(&mut self.readbuf),
        };
        // `try_with`: a world dropped during thread teardown gives nothing back.
        let _ = SPARE.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut() {
                *s = spare;
            }
        });
    }
}

/// The allocator of every fuzz target: the session scripts make many small,
/// short-lived allocations (frames, records, events, the oracle's
/// bookkeeping), and jemalloc serves them faster than glibc's malloc, which
/// was ~9-18 % of a session target's time (fuzz/README.md, "Rates", third
/// pass). It also keeps large buffers mapped between inputs, the job a
/// `mallopt` tuning of glibc did before. Memory bounds are the oracle's job
/// (its own checks), not the allocator's.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

impl World {
    /// A client and server with a completed handshake under `preset`: a copy
    /// of a pair built once per process (a handshake's outcome does not depend
    /// on the input, so running one per input would only cost time).
    pub fn established(preset: Preset) -> Self {
        ESTABLISHED.with(|cache| {
            let mut cache = cache.borrow_mut();
            let slot = &mut cache[preset as usize];
            if slot.is_none() {
                let mut w = Self::handshaking(preset);
                w.pump();
                assert!(
                    w.books[0].connected && w.books[1].connected,
                    "handshake did not complete"
                );
                *slot = Some(w);
            }
            slot.as_ref().expect("just built").copy()
        })
    }

    /// An exact copy (sessions included) of an established world. Its link
    /// and scratch buffers reuse the allocations the previous input's world
    /// gave back ([`SPARE`]): contents equal, capacity already grown.
    fn copy(&self) -> Self {
        let copy = |s: &Session| s.fuzz_clone().expect("an established session copies");
        let mut spare = SPARE.with(|spare| std::mem::take(&mut *spare.borrow_mut()));
        let mut link = self.link.clone();
        for (pipe, buf) in [
            (&mut link.to_server, &mut spare.to_server),
            (&mut link.to_client, &mut spare.to_client),
        ] {
            buf.clear();
            buf.extend_from_slice(&pipe.bytes);
            pipe.bytes = std::mem::take(buf);
        }
        World {
            ids: self.ids,
            now: self.now,
            client: copy(&self.client),
            server: self.server.as_ref().map(copy),
            link,
            books: self.books.clone(),
            chunk: spare.chunk,
            readbuf: spare.readbuf,
            inputs: self.inputs,
        }
    }

    /// A client that has just sent its opening hello; no server yet.
    pub fn handshaking(preset: Preset) -> Self {
        let ids = identities(preset);
        let now = Instant::now();
        let mut client = Session::client(ids.client.clone());
        let tid = client.connect(now, None).expect("first connect");
        // The previous input's buffers, emptied: a script grows them again
        // otherwise (and zeroes the read buffer) on every input.
        let mut spare = SPARE.with(|spare| std::mem::take(&mut *spare.borrow_mut()));
        spare.chunk.clear();
        let mut w = World {
            ids,
            now,
            client,
            server: None,
            link: Link::reusing(tid, spare.to_server, spare.to_client),
            books: Default::default(),
            chunk: spare.chunk,
            readbuf: spare.readbuf,
            inputs: 0,
        };
        w.settle();
        w
    }

    fn book(&mut self, side: Side) -> &mut Book {
        &mut self.books[side as usize]
    }

    /// Polls both sessions' output onto the link and handles their events.
    pub fn settle(&mut self) {
        let now = self.now;
        let link = &mut self.link;
        transmit(&mut self.client, now, link.client_tid, &mut link.to_server);
        if let Some(server) = self.server.as_mut() {
            transmit(server, now, link.server_tid, &mut link.to_client);
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
        self.deliver_settled(to, max)
    }

    /// [`World::deliver`] without the leading [`World::settle`], for callers
    /// that have just settled and changed nothing since (`pump`): a second
    /// settle would only find nothing to transmit and no events.
    fn deliver_settled(&mut self, to: Side, max: usize) -> bool {
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
        // The delivered bytes leave the pipe before the session sees them
        // (what it sends back in reply lands behind the undelivered rest).
        // All of them: the pipe's buffer itself, swapped for the spare one.
        // Part: the rest moves to the spare buffer, which becomes the pipe,
        // so the delivered prefix is read where it lies (one copy, of the
        // rest, instead of copying the prefix out and shifting the rest).
        let mut chunk = std::mem::take(&mut self.chunk);
        chunk.clear();
        if n < pipe.bytes.len() {
            chunk.extend_from_slice(&pipe.bytes[n..]);
            pipe.bytes.truncate(n);
        }
        std::mem::swap(&mut chunk, &mut pipe.bytes);
        self.input(to, &chunk);
        chunk.clear();
        self.chunk = chunk;
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
    pub fn input(&mut self, to: Side, data: &[u8]) {
        let now = self.now;
        self.inputs = self.inputs.wrapping_add(1);
        let in_place = self.inputs % 2 == 0;
        let feed = |s: &mut Session, tid| {
            if in_place {
                s.handle_input_in_place(now, tid, &mut data.to_vec())
            } else {
                s.handle_input(now, tid, data)
            }
        };
        let failed = match to {
            Side::Client => {
                let Some(tid) = self.link.client_tid else {
                    return;
                };
                feed(&mut self.client, tid).is_err()
            }
            Side::Server => match self.link.server_tid {
                Some(tid) => match self.server.as_mut() {
                    Some(s) => feed(s, tid).is_err(),
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
        // The endpoint's routing decision, as every server makes it.
        let (hello, used) = match route_opening(&self.link.hello_buf) {
            Opening::Incomplete => return false,
            Opening::New { hello, used } | Opening::Resume { hello, used, .. } => (hello, used),
            Opening::Refuse { reply, .. } => {
                self.link.to_client.bytes.extend_from_slice(&reply);
                self.refuse();
                return false;
            }
            _ => unreachable!("route_opening's answers are all handled"),
        };
        assert!(used <= self.link.hello_buf.len());
        let rest = self.link.hello_buf.split_off(used);
        let result = match (hello.resume_session(), self.server.as_mut()) {
            (None, None) => Session::accept(&self.ids.server, now, &hello, None).map(|(s, tid)| {
                self.server = Some(s);
                tid
            }),
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
                let out = hello.refusal(&e);
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
    pub fn pump(&mut self) {
        // Settled once here; after that every delivery ends settled (or did
        // nothing after its caller's settle), so none needs a leading one.
        self.settle();
        for _ in 0..MAX_PUMP_ROUNDS {
            let a = self.deliver_settled(Side::Server, 0);
            let b = self.deliver_settled(Side::Client, 0);
            if !a && !b {
                return;
            }
        }
        panic!("link never went quiet after {MAX_PUMP_ROUNDS} rounds");
    }

    pub fn advance(&mut self, by: Duration) {
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
        let mut buf = std::mem::take(&mut self.readbuf);
        // Grown once, never shrunk or re-zeroed: `read` writes what it returns.
        if buf.len() < len {
            buf.resize(len, 0);
        }
        // Odd lengths read through `read_with` (bytes lent, up to `len`
        // taken), even ones through `read`, so the two interleave.
        let lend = len % 2 == 1;
        let result = match self.session(side) {
            Some(s) if lend => match s.read_with(id, |lent: &[u8]| {
                let n = lent.len().min(len);
                buf[..n].copy_from_slice(&lent[..n]);
                Ok::<usize, ()>(n)
            }) {
                Ok(roam_proto::Lent::Lent(Ok(n))) => Ok(Some(n)),
                Ok(roam_proto::Lent::End) => Ok(Some(0)),
                Ok(roam_proto::Lent::Nothing | roam_proto::Lent::Lent(Err(()))) => Ok(None),
                Err(e) => Err(e),
            },
            Some(s) => s.read(id, &mut buf[..len]),
            None => Ok(None),
        };
        let Ok(Some(n)) = result else {
            self.readbuf = buf;
            return;
        };
        self.check_read(side, id, &buf[..n], len);
        self.readbuf = buf;
    }

    /// The oracle for `n` bytes `side` read from stream `id` (asked for `len`).
    fn check_read(&mut self, side: Side, id: StreamId, buf: &[u8], len: usize) {
        let n = buf.len();
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
        if self.books[side as usize].tainted {
            return;
        }
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
            self.link = Link::reusing(
                tid,
                std::mem::take(&mut self.link.to_server.bytes),
                std::mem::take(&mut self.link.to_client.bytes),
            );
        }
        self.settle();
    }

    pub fn apply(&mut self, op: Op) {
        match op {
            Op::Open { side, meta_len } => {
                const META: &[u8] = &[b'm'; 255 * 5];
                let meta = &META[..usize::from(meta_len) * 5];
                if let Some(Ok(id)) = self.session(side.into()).map(|s| s.open_stream(meta)) {
                    self.book(side.into()).opened += 1;
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
            Op::AskMove { named } => {
                let host = if named { "h1" } else { "" };
                self.client.ask_move(host.into());
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
            Op::Frames { from, frames } => self.inject_frames(from.into(), &frames),
            Op::AdvanceToTimer { side } => {
                let now = self.now;
                let at = self.session(side.into()).and_then(|s| s.poll_timeout());
                if let Some(at) = at {
                    self.advance(at.saturating_duration_since(now));
                }
            }
        }
    }

    /// `from` seals fuzzer-built frames into one record on its transport.
    fn inject_frames(&mut self, from: Side, frames: &[FuzzFrame]) {
        self.settle();
        const TEXT: &[u8] = &[b'r'; 255];
        let addrs: Vec<&[u8]> = vec![&b"10.1.2.3:7447"[..]; 40];
        let to = match from {
            Side::Client => Side::Server,
            Side::Server => Side::Client,
        };
        // What an honest `from` would say: `Num::Near` counts from these.
        let high_sent = |w: &Self, side: Side| {
            match side {
                Side::Client => Some(&w.client),
                Side::Server => w.server.as_ref(),
            }
            .map_or(0, Session::fuzz_high_sent)
        };
        let (their_seq, our_seq) = (high_sent(self, to), high_sent(self, from));
        let written = |w: &Self, side: Side, stream: u64| {
            w.books[side as usize]
                .written
                .get(&stream)
                .copied()
                .unwrap_or(0)
        };
        let mut plain = Vec::new();
        for f in frames.iter().take(16) {
            let frame = match *f {
                FuzzFrame::Ping(t) => Frame::Ping { token: t.get(0) },
                FuzzFrame::Pong(t) => Frame::Pong { token: t.get(0) },
                FuzzFrame::Ack(r) => Frame::Ack {
                    received: r.get(their_seq),
                },
                FuzzFrame::Sync { received, next } => Frame::Sync {
                    received: received.get(their_seq),
                    next: next.get(our_seq),
                },
                FuzzFrame::SessionInfo { timeout_secs } => Frame::SessionInfo {
                    session_id: [3; 16],
                    resume_secret: [4; 32],
                    resume_timeout_secs: timeout_secs.get(0),
                },
                FuzzFrame::Close { code, reason_len } => Frame::Close {
                    code: code.get(0),
                    reason: &TEXT[..usize::from(reason_len)],
                },
                FuzzFrame::Addresses(n) => Frame::Addresses {
                    addrs: addrs[..usize::from(n) % addrs.len()].to_vec(),
                },
                FuzzFrame::MoveTo => Frame::MoveTo {
                    addr: b"10.9.9.9:7447",
                },
                FuzzFrame::MoveAsk { host_len } => Frame::MoveAsk {
                    host: &TEXT[..usize::from(host_len)],
                },
                FuzzFrame::Open { stream, meta_len } => Frame::Open {
                    stream: self.pick_stream(from, stream).0,
                    meta: &TEXT[..usize::from(meta_len)],
                },
                FuzzFrame::Data {
                    stream,
                    offset,
                    fin,
                    len,
                } => {
                    let stream = self.pick_stream(from, stream).0;
                    let offset = offset.get(written(self, from, stream));
                    let len = usize::from(len) % 20_000;
                    Frame::Data {
                        stream,
                        offset,
                        fin,
                        data: pattern(from, stream, offset, len),
                    }
                }
                FuzzFrame::Reset { stream, code } => Frame::Reset {
                    stream: self.pick_stream(from, stream).0,
                    code: code.get(0),
                },
                FuzzFrame::MaxStreamData { stream, max } => {
                    let stream = self.pick_stream(from, stream).0;
                    Frame::MaxStreamData {
                        stream,
                        max: max.get(written(self, to, stream)),
                    }
                }
                FuzzFrame::MaxData(m) => {
                    let total = self.books[to as usize].written.values().sum();
                    Frame::MaxData { max: m.get(total) }
                }
                FuzzFrame::MaxStreams(m) => Frame::MaxStreams {
                    max: m.get(self.books[to as usize].opened),
                },
            };
            frame.encode(&mut plain);
        }
        let mut record = Vec::new();
        let Some(tid) = self
            .session(from)
            .and_then(|s| s.fuzz_seal_record(&plain, &mut record))
        else {
            return;
        };
        let (mine, pipe, to) = match from {
            Side::Client => (self.link.client_tid, &mut self.link.to_server, Side::Server),
            Side::Server => (self.link.server_tid, &mut self.link.to_client, Side::Client),
        };
        if mine == Some(tid) && !pipe.closed {
            pipe.bytes.extend_from_slice(&record);
            self.book(to).tainted = true;
        }
    }

    /// The invariants that hold after every step, on both sides. `full` adds
    /// the per-stream scan (proportional to the streams held, so it runs
    /// every `FULL_CHECK_EVERY` steps and at the end, not after each step).
    pub fn check(&mut self, full: bool) {
        let now = self.now;
        let cfg = &self.ids.client.session;
        for side in [Side::Client, Side::Server] {
            let book = &mut self.books[side as usize];
            let s = match side {
                Side::Client => &mut self.client,
                Side::Server => match self.server.as_mut() {
                    Some(s) => s,
                    None => continue,
                },
            };
            if book.closed {
                assert_eq!(
                    s.state(),
                    State::Closed,
                    "{side:?}: a closed session reopened"
                );
                assert!(s.open_stream(b"").is_err(), "{side:?}: open after close");
                if let Some(&id) = book.streams.first() {
                    assert!(s.write(id, b"x").is_err(), "{side:?}: write after close");
                }
                if side == Side::Client {
                    assert!(s.connect(now, None).is_err(), "connect after close");
                }
            }
            // The send buffer may grow to SEND_BUFFER_GROWTH times its configured size
            // while many streams contend (`Session::session_send_limit`),
            // never past that.
            assert!(
                s.send_buffered()
                    <= cfg
                        .session_send_buffer
                        .saturating_mul(roam_proto::SEND_BUFFER_GROWTH),
                "{side:?}: {} bytes buffered for sending, limit {} x {}",
                s.send_buffered(),
                roam_proto::SEND_BUFFER_GROWTH,
                cfg.session_send_buffer
            );
            if !full {
                continue;
            }
            let mut unread = 0u64;
            // Every stream the session holds (forgotten ones hold nothing),
            // in one pass over its stream table rather than a lookup per
            // stream the oracle knows of.
            for (id, n) in s.fuzz_unread() {
                let n = n as u64;
                assert!(
                    n <= cfg.stream_window,
                    "{side:?} stream {id}: {n} unread bytes, window {}",
                    cfg.stream_window
                );
                unread += n;
            }
            assert!(
                unread <= cfg.session_window,
                "{side:?}: {unread} unread bytes, session window {}",
                cfg.session_window
            );
            // The peer may hold at most `max_streams` open towards us; the
            // rest are streams our application opened.
            assert!(
                s.stream_count() as u64 <= cfg.max_streams + book.opened,
                "{side:?}: {} streams, max_streams {}, {} opened locally",
                s.stream_count(),
                cfg.max_streams,
                book.opened
            );
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

/// Calls `s.poll_transmit` until it has nothing more (`MAX_TRANSMITS`
/// records' worth at most: a session that never goes quiet without new input
/// fails the run), putting what it sends on transport `tid` into `pipe`.
fn transmit(s: &mut Session, now: Instant, tid: Option<TransportId>, pipe: &mut Pipe) {
    for _ in 0..=MAX_TRANSMITS {
        // Written straight onto the link (no copy through a scratch buffer),
        // and taken back off if it was for another transport.
        let before = pipe.bytes.len();
        let Some(sent_on) = s.poll_transmit(now, &mut pipe.bytes) else {
            assert_eq!(
                pipe.bytes.len(),
                before,
                "poll_transmit wrote for no transport"
            );
            return;
        };
        assert!(
            pipe.bytes.len() > before,
            "poll_transmit named a transport but wrote nothing"
        );
        if tid != Some(sent_on) || pipe.closed {
            pipe.bytes.truncate(before);
        }
    }
    panic!("{:?} never quiet after {MAX_TRANSMITS} transmits", s.role());
}

/// `false` is the client, `true` the server.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Who(bool);

impl From<Who> for Side {
    fn from(w: Who) -> Side {
        if w.0 {
            Side::Server
        } else {
            Side::Client
        }
    }
}

/// One script step.
#[derive(Arbitrary, Debug)]
pub enum Op {
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
    /// Frames built by the fuzzer, sealed with `from`'s keys (at most 16).
    Frames {
        from: Who,
        frames: Vec<FuzzFrame>,
    },
    /// The client asks to be moved (MOVE_ASK, §9.4): to a named host, or
    /// to any.
    AskMove {
        named: bool,
    },
}

/// A number: usually small or near the value an honest peer would send,
/// sometimes anything. (Near values reach the exact-offset and exact-sequence
/// branches without the fuzzer having to guess them.)
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Num {
    Small(u8),
    Near(i8),
    Medium(u32),
    Any(u64),
}

impl Num {
    /// The value, `Near` counting from `base` (what an honest peer would say).
    fn get(self, base: u64) -> u64 {
        match self {
            Num::Small(x) => u64::from(x),
            Num::Near(d) => base.saturating_add_signed(i64::from(d)),
            Num::Medium(x) => u64::from(x),
            Num::Any(x) => x,
        }
        .min(roam_proto::codec::VARINT_MAX)
    }
}

/// One frame a hostile peer sends (§5); stream selectors pick known streams.
#[derive(Arbitrary, Debug)]
pub enum FuzzFrame {
    Ping(Num),
    Pong(Num),
    Ack(Num),
    Sync {
        received: Num,
        next: Num,
    },
    SessionInfo {
        timeout_secs: Num,
    },
    Close {
        code: Num,
        reason_len: u8,
    },
    Addresses(u8),
    MoveTo,
    Open {
        stream: u8,
        meta_len: u8,
    },
    Data {
        stream: u8,
        offset: Num,
        fin: bool,
        len: u16,
    },
    Reset {
        stream: u8,
        code: Num,
    },
    MaxStreamData {
        stream: u8,
        max: Num,
    },
    MaxData(Num),
    MaxStreams(Num),
    MoveAsk {
        host_len: u8,
    },
}

/// `ROAM_FUZZ_TRACE=1` prints each script step, for triaging a crash.
pub fn trace() -> bool {
    static TRACE: OnceLock<bool> = OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("ROAM_FUZZ_TRACE").is_some())
}

/// Runs a script decoded from `data` (at most `max_steps` steps) on `w`,
/// checking the invariants after each step, then lets the pair settle (all
/// bytes delivered, a timer tick) and checks them again.
pub fn run_script(mut w: World, data: &[u8], max_steps: usize) {
    w.check(true);
    let mut u = Unstructured::new(data);
    for step in 1..=max_steps {
        if u.is_empty() {
            break;
        }
        let Ok(op) = Op::arbitrary(&mut u) else { break };
        if trace() {
            eprintln!("op: {op:?}");
        }
        w.apply(op);
        w.check(step % FULL_CHECK_EVERY == 0);
    }
    w.check(true);
    w.pump();
    w.check(true);
    w.advance(Duration::from_millis(10));
    w.pump();
    w.check(true);
}
