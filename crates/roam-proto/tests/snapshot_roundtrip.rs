//! Round-trip property of session snapshots (`docs/PROTOCOL.md` §13) over
//! random sessions: a seeded loop drives a client/server pair through the
//! sans-IO API (streams opened from both sides, writes, partial delivery of
//! what is in flight, reads of some of it, suspensions and resumes), and at
//! random points snapshots one side or both, live or suspended. Each time:
//!
//! - `restore(snapshot(s))` exports exactly the same bytes again;
//! - the restored session shows the same state through every getter;
//! - the restored session replaces the original (whose transport dies with
//!   it), the pair resumes, and at the end every byte written on every
//!   stream has been read exactly once, in order, followed by end-of-stream.
//!
//! At other random points one side's live transport moves instead (§13.6,
//! relay takeover): the session is exported with its transport state,
//! restored, and the copy adopts the transport and carries on over the same
//! link, bytes in flight included, with no resume.
//!
//! `ROAM_SNAPSHOT_SEED=n` replays one case; the seed is printed on failure.
//! `ROAM_SNAPSHOT_SEEDS_DIR=dir` also writes the sections of a few snapshots
//! (the blob without magic, format byte and digest) there: the seeds of the
//! `continuation` fuzz target.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use roam_proto::{
    parse_hello, ClientConfig, CloseReason, Config, Event, Keypair, Role, ServerConfig,
    ServerTrust, Session, State, StreamError, StreamId, TransportId,
};

/// Cases run without `ROAM_SNAPSHOT_SEED`.
const CASES: u64 = 400;
/// Random steps per case before the final drain.
const STEPS: usize = 150;

/// A small deterministic generator (SplitMix64): the test needs no crate.
struct Rng(u64);

impl Rng {
    /// The next 64 random bits.
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True with probability `p` percent.
    fn chance(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

/// Which side of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Side {
    Client,
    Server,
}

/// One TCP connection between the two sessions: the bytes in flight each way.
struct Link {
    client: TransportId,
    /// The server's transport, once the opening was parsed.
    server: Option<TransportId>,
    c2s: Vec<u8>,
    s2c: Vec<u8>,
}

/// The pair, the network between them, and the applications' view.
struct World {
    /// This case's seed.
    seed: u64,
    rng: Rng,
    now: Instant,
    client: Session,
    server: Option<Session>,
    link: Option<Link>,
    server_cfg: ServerConfig,
    /// Bytes each side wrote on each stream (the oracle).
    written: BTreeMap<(Side, u64), Vec<u8>>,
    /// Bytes each side read on each stream.
    read: BTreeMap<(Side, u64), Vec<u8>>,
    /// Streams each side knows (opened or told of by `StreamOpened`).
    known: BTreeSet<(Side, u64)>,
    /// Streams whose write side a side finished.
    finished: BTreeSet<(Side, u64)>,
    /// Streams on which a side read end-of-stream.
    eof: BTreeSet<(Side, u64)>,
    /// Snapshots taken, and how many of them of a live (Active) session.
    snapshots: usize,
    live: usize,
    /// Live transports moved (`export_transport` / `adopt_transport`), and
    /// attempts refused because the transport was not at rest.
    moved: usize,
    not_moved: usize,
    /// Sessions that closed (a close is a failure unless a test expects it).
    closed: Vec<(Side, CloseReason)>,
}

/// Small windows and buffers, so flow control and refused writes happen.
fn config() -> Config {
    Config {
        stream_window: 8 * 1024,
        session_window: 24 * 1024,
        stream_send_buffer: 16 * 1024,
        session_send_buffer: 48 * 1024,
        max_streams: 16,
        ..Config::default()
    }
}

/// The server's fixed key.
fn server_key() -> Keypair {
    Keypair::from_private([0x5a; 32])
}

/// The client's configuration (fresh each time: `restore_client` takes it by value).
fn client_config() -> ClientConfig {
    ClientConfig {
        keypair: Keypair::from_private([0x17; 32]),
        server_trust: ServerTrust::Pinned(server_key().public()),
        session: config(),
    }
}

impl World {
    /// An established pair for case `seed`.
    fn new(seed: u64) -> Self {
        let mut w = World {
            seed,
            rng: Rng(seed),
            now: Instant::now(),
            client: Session::client(client_config()),
            server: None,
            link: None,
            server_cfg: ServerConfig {
                keypair: server_key(),
                authorized_keys: None,
                addresses: Vec::new(),
                session: config(),
            },
            written: BTreeMap::new(),
            read: BTreeMap::new(),
            known: BTreeSet::new(),
            finished: BTreeSet::new(),
            eof: BTreeSet::new(),
            snapshots: 0,
            live: 0,
            moved: 0,
            not_moved: 0,
            closed: Vec::new(),
        };
        w.dial();
        for _ in 0..50 {
            w.deliver(usize::MAX);
        }
        assert_eq!(w.client.state(), State::Active, "first handshake");
        w
    }

    /// The session of `side`.
    fn session(&mut self, side: Side) -> &mut Session {
        match side {
            Side::Client => &mut self.client,
            Side::Server => self.server.as_mut().expect("server session"),
        }
    }

    /// The client opens a new transport (a new session or a resume).
    fn dial(&mut self) {
        let client = self.client.connect(self.now, None).expect("connect");
        self.link = Some(Link {
            client,
            server: None,
            c2s: Vec::new(),
            s2c: Vec::new(),
        });
    }

    /// The link dies (a reset both ends see); bytes in flight are lost.
    fn cut(&mut self) {
        if let Some(l) = self.link.take() {
            self.client.handle_transport_closed(self.now, l.client);
            if let (Some(s), Some(t)) = (self.server.as_mut(), l.server) {
                s.handle_transport_closed(self.now, t);
            }
        }
    }

    /// Polls both sessions' output onto the link, then delivers up to `max`
    /// bytes each way, then drains events.
    fn deliver(&mut self, max: usize) {
        let mut out = Vec::new();
        while let Some(t) = self.client.poll_transmit(self.now, &mut out) {
            if let Some(l) = self.link.as_mut().filter(|l| l.client == t) {
                l.c2s.extend_from_slice(&out);
            }
            out.clear();
        }
        if let Some(s) = self.server.as_mut() {
            while let Some(t) = s.poll_transmit(self.now, &mut out) {
                if let Some(l) = self.link.as_mut().filter(|l| l.server == Some(t)) {
                    l.s2c.extend_from_slice(&out);
                }
                out.clear();
            }
        }
        let Some(l) = self.link.as_mut() else {
            self.drain_events();
            return;
        };
        // Client to server: the opening first, parsed by the "endpoint".
        let n = l.c2s.len().min(max);
        if l.server.is_none() {
            if let Some((hello, used)) = parse_hello(&l.c2s).expect("hello") {
                let tid = match self.server.as_mut() {
                    None => {
                        let (s, tid) = Session::accept(&self.server_cfg, self.now, &hello, None)
                            .expect("accept");
                        self.server = Some(s);
                        tid
                    }
                    Some(s) => s.accept_resume(self.now, &hello, None).expect("resume"),
                };
                l.server = Some(tid);
                l.c2s.drain(..used);
            }
        }
        if let (Some(t), Some(s)) = (l.server, self.server.as_mut()) {
            let n = n.min(l.c2s.len());
            let bytes: Vec<u8> = l.c2s.drain(..n).collect();
            s.handle_input(self.now, t, &bytes).expect("server input");
        }
        let n = l.s2c.len().min(max);
        let bytes: Vec<u8> = l.s2c.drain(..n).collect();
        self.client
            .handle_input(self.now, l.client, &bytes)
            .expect("client input");
        self.drain_events();
    }

    /// Takes both sessions' events: learns of peer streams, notes closes,
    /// and fails on resets (nobody resets here).
    fn drain_events(&mut self) {
        for side in [Side::Client, Side::Server] {
            if side == Side::Server && self.server.is_none() {
                continue;
            }
            while let Some(e) = self.session(side).poll_event() {
                match e {
                    Event::StreamOpened { stream } => {
                        self.known.insert((side, stream.0));
                    }
                    Event::Closed { reason } => self.closed.push((side, reason)),
                    Event::StreamReset { stream, code } => {
                        panic!("{side:?}: stream {stream} reset ({code})")
                    }
                    _ => {}
                }
            }
        }
    }

    /// Moves time on a little and runs the timers.
    fn tick(&mut self) {
        self.now += Duration::from_millis(self.rng.below(30));
        self.client.handle_timeout(self.now);
        if let Some(s) = self.server.as_mut() {
            s.handle_timeout(self.now);
        }
    }

    /// Writes a random amount on a random known stream of `side`.
    fn write(&mut self, side: Side) {
        let Some(id) = self.pick(side, |w, k| !w.finished.contains(&k)) else {
            return;
        };
        let len = self.rng.below(6000) as usize;
        let start = self.written.get(&(side, id)).map_or(0, Vec::len);
        let data: Vec<u8> = (0..len)
            .map(|i| (start + i) as u8 ^ (id as u8).wrapping_mul(31) ^ side as u8)
            .collect();
        match self.session(side).write(StreamId(id), &data) {
            Ok(n) => self
                .written
                .entry((side, id))
                .or_default()
                .extend_from_slice(&data[..n]),
            Err(e) => panic!("{side:?} write on {id}: {e:?}"),
        }
    }

    /// Reads up to a random amount from a random known stream of `side`.
    fn read(&mut self, side: Side, max: usize) {
        let Some(id) = self.pick(side, |w, k| !w.eof.contains(&k)) else {
            return;
        };
        self.read_stream(side, id, max);
    }

    /// Reads up to `max` bytes of stream `id` on `side` into the record.
    fn read_stream(&mut self, side: Side, id: u64, max: usize) {
        let mut buf = vec![0u8; max.max(1)];
        match self.session(side).read(StreamId(id), &mut buf) {
            Ok(Some(0)) => {
                self.eof.insert((side, id));
            }
            Ok(Some(n)) => self
                .read
                .entry((side, id))
                .or_default()
                .extend_from_slice(&buf[..n]),
            Ok(None) => {}
            // Both directions done: the session forgot the stream.
            Err(StreamError::UnknownStream) => assert!(self.eof.contains(&(side, id))),
            Err(e) => panic!("{side:?} read on {id}: {e:?}"),
        }
    }

    /// A random stream known to `side` that passes `ok`.
    fn pick(&mut self, side: Side, ok: impl Fn(&World, (Side, u64)) -> bool) -> Option<u64> {
        let ids: Vec<u64> = self
            .known
            .iter()
            .filter(|k| k.0 == side && ok(self, **k))
            .map(|k| k.1)
            .collect();
        (!ids.is_empty()).then(|| ids[self.rng.below(ids.len() as u64) as usize])
    }

    /// `side` opens a stream (unless at its stream limit).
    fn open(&mut self, side: Side) {
        match self.session(side).open_stream(b"meta") {
            Ok(id) => {
                self.known.insert((side, id.0));
            }
            Err(StreamError::TooManyStreams) => {}
            Err(e) => panic!("{side:?} open: {e:?}"),
        }
    }

    /// `side` finishes a random stream it writes on.
    fn finish(&mut self, side: Side) {
        if let Some(id) = self.pick(side, |w, k| !w.finished.contains(&k)) {
            self.session(side)
                .finish_stream(StreamId(id))
                .expect("finish");
            self.finished.insert((side, id));
        }
    }

    /// Snapshots `side`, checks the round trip, and replaces the session by
    /// its restoration after a random time offline (its transport dies).
    fn snapshot(&mut self, side: Side) {
        let now = self.now;
        let original = match side {
            Side::Client => &self.client,
            Side::Server => self.server.as_ref().expect("server session"),
        };
        let blob = original.export(now).expect("export");
        let again = restore(side, now, &blob, Duration::ZERO, &self.server_cfg);
        assert!(
            again.export(now).expect("re-export") == blob,
            "{side:?}: export(restore(export(s))) differs"
        );
        same_state(original, &again, &self.known, side);
        if let Ok(dir) = std::env::var("ROAM_SNAPSHOT_SEEDS_DIR") {
            // Server snapshots only (the fuzz target restores a server) of
            // at most 4 KB, from the first cases.
            if side == Side::Server && blob.len() <= 4096 && self.seed < 8 {
                let path = format!("{dir}/snapshot-{}-{}", self.seed, self.snapshots);
                std::fs::write(path, &blob[5..blob.len() - 32]).expect("write seed");
            }
        }
        self.snapshots += 1;
        self.live += usize::from(original.state() == State::Active);
        self.cut();
        let offline = Duration::from_millis(self.rng.below(10_000));
        self.now += offline;
        let restored = restore(side, self.now, &blob, offline, &self.server_cfg);
        assert_eq!(restored.state(), again.state());
        match side {
            Side::Client => self.client = restored,
            Side::Server => self.server = Some(restored),
        }
    }

    /// Moves `side`'s live transport to a restored copy of the session, as
    /// a relay takeover does: the link (bytes in flight included) is kept,
    /// the peer sees nothing, and the copy replaces the original.
    fn move_live(&mut self, side: Side) {
        let now = self.now;
        let original = match side {
            Side::Client => &self.client,
            Side::Server => match self.server.as_ref() {
                Some(s) => s,
                None => return,
            },
        };
        let Some(state) = original.export_transport() else {
            self.not_moved += 1;
            return;
        };
        let blob = original.export(now).expect("export");
        if let Ok(dir) = std::env::var("ROAM_LIVE_SEEDS_DIR") {
            // Server moves of small sessions from the first cases: the
            // continuation's sections (u16 length first), then the
            // transport state's (the `live_transport` fuzz target).
            let (c, l) = (&blob[5..blob.len() - 32], &state[5..state.len() - 32]);
            if side == Side::Server && c.len() <= 16_384 && self.seed < 64 {
                let mut seed = (c.len() as u16).to_le_bytes().to_vec();
                seed.extend_from_slice(c);
                seed.extend_from_slice(l);
                let path = format!("{dir}/move-{}-{}", self.seed, self.moved);
                std::fs::write(path, seed).expect("write seed");
            }
        }
        let mut copy = restore(side, now, &blob, Duration::ZERO, &self.server_cfg);
        let tid = copy.adopt_transport(now, &state).expect("adopt");
        // A second adoption is refused: the session has its transport.
        assert!(copy.adopt_transport(now, &state).is_err());
        // A damaged transport state is refused with the session unchanged.
        let mut other = restore(side, now, &blob, Duration::ZERO, &self.server_cfg);
        let mut bad = state.clone();
        let i = self.rng.below(bad.len() as u64) as usize;
        bad[i] ^= 0x40;
        assert!(other.adopt_transport(now, &bad).is_err());
        assert_eq!(other.state(), State::Suspended);
        assert_eq!(other.active_transport(), None);
        let l = self.link.as_ref().expect("a live transport has a link");
        match side {
            Side::Client => assert_eq!(tid, l.client),
            Side::Server => assert_eq!(Some(tid), l.server),
        }
        assert_eq!(copy.state(), State::Active);
        assert_eq!(copy.active_transport(), Some(tid));
        assert!(
            copy.poll_event().is_none(),
            "a moved transport emits no event"
        );
        self.moved += 1;
        match side {
            Side::Client => self.client = copy,
            Side::Server => self.server = Some(copy),
        }
    }

    /// One random step.
    fn step(&mut self) {
        // A client re-dials soon after losing its transport, as a driver would.
        if self.link.is_none() && self.rng.chance(25) {
            self.dial();
            return;
        }
        let side = if self.rng.chance(50) {
            Side::Client
        } else {
            Side::Server
        };
        match self.rng.below(100) {
            0..=7 => self.open(side),
            8..=39 => self.write(side),
            40..=59 => {
                let max = self.rng.below(5000) as usize;
                self.read(side, max);
            }
            60..=81 => {
                let max = self.rng.below(4000) as usize + 1;
                self.deliver(max);
            }
            82..=85 => self.finish(side),
            86..=88 => self.cut(),
            89..=91 if self.link.is_none() => self.dial(),
            92..=95 => self.snapshot(side),
            96 => {
                self.snapshot(Side::Client);
                self.snapshot(Side::Server);
            }
            97 | 98 => self.move_live(side),
            _ => self.tick(),
        }
    }

    /// Reconnects, finishes every stream, and moves and reads everything.
    fn drain(&mut self) {
        for _ in 0..2000 {
            // Streams learned of during the drain are finished as they come.
            for k in self.known.clone() {
                if !self.finished.contains(&k) {
                    self.session(k.0)
                        .finish_stream(StreamId(k.1))
                        .expect("finish");
                    self.finished.insert(k);
                }
            }
            if self.link.is_none() {
                self.dial();
            }
            self.deliver(usize::MAX);
            for k in self.known.clone() {
                if !self.eof.contains(&k) {
                    self.read_stream(k.0, k.1, 1 << 16);
                }
            }
            // Peer-opened streams a side never learned of are still known:
            // every stream must reach end-of-stream on both sides.
            // Done when every stream ended on both sides and both sessions
            // forgot it (all acknowledged: nothing held, nothing leaked).
            if self.known.iter().all(|k| self.eof.contains(k))
                && self.known.len() == 2 * self.known.iter().filter(|k| k.0 == Side::Client).count()
                && self.client.stream_count() == 0
                && self.server.as_ref().is_some_and(|s| s.stream_count() == 0)
            {
                return;
            }
            self.now += Duration::from_millis(5);
            self.client.handle_timeout(self.now);
            if let Some(s) = self.server.as_mut() {
                s.handle_timeout(self.now);
            }
        }
        let lens = |m: &BTreeMap<(Side, u64), Vec<u8>>| {
            m.iter().map(|(k, v)| (*k, v.len())).collect::<Vec<_>>()
        };
        panic!(
            "drain did not finish: client {:?}, server {:?}, link {}, known {:?}, eof {:?}, written {:?}, read {:?}",
            self.client,
            self.server,
            self.link.is_some(),
            self.known,
            self.eof,
            lens(&self.written),
            lens(&self.read)
        );
    }

    /// Every byte written on each stream was read exactly once, in order.
    fn check(&self) {
        for &(side, id) in &self.known {
            let peer = match side {
                Side::Client => Side::Server,
                Side::Server => Side::Client,
            };
            let written = self.written.get(&(peer, id)).map_or(&[][..], Vec::as_slice);
            let read = self.read.get(&(side, id)).map_or(&[][..], Vec::as_slice);
            assert!(
                written == read,
                "{side:?} stream {id}: read {} bytes, peer wrote {}",
                read.len(),
                written.len()
            );
        }
    }
}

/// Restores a snapshot as `side`'s session; a refusal fails the test.
fn restore(
    side: Side,
    now: Instant,
    blob: &[u8],
    offline: Duration,
    cfg: &ServerConfig,
) -> Session {
    match side {
        Side::Client => Session::restore_client(client_config(), now, blob, offline),
        Side::Server => Session::restore_server(cfg, now, blob, offline),
    }
    .unwrap_or_else(|e| panic!("{side:?} restore: {e}"))
}

/// The restored session shows what the original showed, except what a
/// snapshot leaves out by design (transport, RTT, state Active).
fn same_state(a: &Session, b: &Session, known: &BTreeSet<(Side, u64)>, side: Side) {
    assert_eq!(a.role(), b.role());
    assert_eq!(
        b.role(),
        match side {
            Side::Client => Role::Client,
            Side::Server => Role::Server,
        }
    );
    assert_eq!(a.id(), b.id());
    assert_eq!(a.peer_key(), b.peer_key());
    assert_eq!(a.stream_count(), b.stream_count());
    assert_eq!(a.unacked_frames(), b.unacked_frames());
    assert_eq!(a.send_buffered(), b.send_buffered());
    let mut sa = a.stats().clone();
    sa.rtt = None;
    assert_eq!(&sa, b.stats());
    assert_eq!(b.active_transport(), None);
    assert!(b.suspended_since().is_some());
    if a.state() == State::Closing {
        assert_eq!(b.state(), State::Closing);
    } else {
        assert_eq!(b.state(), State::Suspended);
    }
    for &(s, id) in known {
        if s == side {
            assert_eq!(a.stream_meta(StreamId(id)), b.stream_meta(StreamId(id)));
            assert_eq!(a.readable_len(StreamId(id)), b.readable_len(StreamId(id)));
        }
    }
}

/// One case: random steps, then the drain and the oracle; returns the
/// snapshots taken, how many were of a live session, and the live
/// transports moved.
fn run(seed: u64) -> (usize, usize, usize) {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        w.step();
        assert!(w.closed.is_empty(), "closed: {:?}", w.closed);
    }
    w.drain();
    w.check();
    assert!(w.closed.is_empty(), "closed: {:?}", w.closed);
    (w.snapshots, w.live, w.moved)
}

/// The property, over `CASES` seeds.
#[test]
fn snapshots_of_random_sessions_round_trip_and_resume_exactly_once() {
    let seeds: Vec<u64> = match std::env::var("ROAM_SNAPSHOT_SEED") {
        Ok(s) => vec![s.parse().expect("ROAM_SNAPSHOT_SEED is a number")],
        Err(_) => (0..CASES).collect(),
    };
    let (mut snapshots, mut live, mut moved) = (0, 0, 0);
    for seed in seeds {
        let r = std::panic::catch_unwind(|| run(seed));
        match r {
            Ok((n, l, m)) => {
                snapshots += n;
                live += l;
                moved += m;
            }
            Err(e) => {
                eprintln!("snapshot round trip failed: ROAM_SNAPSHOT_SEED={seed}");
                std::panic::resume_unwind(e);
            }
        }
    }
    println!(
        "{snapshots} snapshots round-tripped, {live} of them of live sessions; {moved} live transports moved"
    );
    assert!(snapshots > 0 && live > 0);
    if std::env::var("ROAM_SNAPSHOT_SEED").is_err() {
        assert!(moved > 100, "only {moved} live transports moved");
    }
}

/// A snapshot's sections as (id, version, body).
fn sections(blob: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
    let mut r = roam_proto::codec::Reader::new(&blob[5..blob.len() - 32]);
    let mut v = Vec::new();
    while r.remaining() > 0 {
        let id = r.varint().unwrap();
        let version = r.varint().unwrap();
        let body = r.lp_bytes(usize::MAX, "body").unwrap().to_vec();
        v.push((id, version, body));
    }
    v
}

/// A snapshot from sections, with a valid digest.
fn assemble(format: u8, sections: &[(u64, u64, Vec<u8>)]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut o = b"RMSC".to_vec();
    o.push(format);
    for (id, version, body) in sections {
        roam_proto::codec::put_varint(&mut o, *id);
        roam_proto::codec::put_varint(&mut o, *version);
        roam_proto::codec::put_lp_bytes(&mut o, body);
    }
    let d = Sha256::digest(&o);
    o.extend_from_slice(&d);
    o
}

/// A live snapshot's sections, and every envelope refusal, through the public API.
#[test]
fn live_snapshot_sections_and_refusals_are_precise() {
    let w = World::new(7);
    let server = w.server.as_ref().expect("server");
    assert_eq!(server.state(), State::Active, "a live session");
    let now = w.now;
    let blob = server.export(now).expect("a live session exports");
    let parts = sections(&blob);
    let ids: Vec<u64> = parts.iter().map(|p| p.0).collect();
    assert_eq!(ids, [0x02, 0x04, 0x06, 0x08, 0x0a, 0x11]);
    assert_eq!(assemble(2, &parts), blob);
    let restore = |b: &[u8]| {
        Session::restore_server(&w.server_cfg, now, b, Duration::ZERO)
            .map(|s| s.export(now).unwrap())
    };
    // An unknown optional section (odd id) is skipped; so is a known
    // optional one at a version this roam does not read.
    let mut p = parts.clone();
    p.push((0x13, 1, b"from the future".to_vec()));
    assert_eq!(restore(&assemble(2, &p)).unwrap(), blob);
    let mut p = parts.clone();
    p[5].1 = 2;
    let mut expected = parts.clone();
    expected[5].2 = vec![0; 6]; // statistics restart from zero
    assert_eq!(restore(&assemble(2, &p)).unwrap(), assemble(2, &expected));
    // An unknown required one, or a required one at another version, is
    // refused naming it.
    let mut p = parts.clone();
    p.push((0x12, 1, Vec::new()));
    let e = restore(&assemble(2, &p)).unwrap_err();
    assert_eq!(e, roam_proto::RestoreError::UnknownSection(0x12));
    assert!(e.to_string().contains("0x12"), "{e}");
    let mut p = parts.clone();
    p[0].1 = 2;
    let e = restore(&assemble(2, &p)).unwrap_err();
    assert_eq!(
        e,
        roam_proto::RestoreError::UnsupportedSection {
            section: "identity",
            version: 2
        }
    );
    let mut p = parts.clone();
    p.remove(1);
    assert_eq!(
        restore(&assemble(2, &p)).unwrap_err(),
        roam_proto::RestoreError::MissingSection("liveness")
    );
    let mut p = parts.clone();
    p.swap(1, 2);
    assert_eq!(
        restore(&assemble(2, &p)).unwrap_err(),
        roam_proto::RestoreError::Invalid("sections out of order")
    );
    // A continuation stored by roam 0.1 (format 1) is refused as exactly that.
    let mut old = b"RMSC\x01\x01\x00".to_vec();
    old.extend_from_slice(&[0; 120]);
    let e = restore(&old).unwrap_err();
    assert_eq!(e, roam_proto::RestoreError::OldFormat(1));
    assert!(e.to_string().contains("format 1 by an older roam"), "{e}");
}

/// A Closing session snapshotted mid-data still delivers the data, then the CLOSE.
#[test]
fn closing_session_snapshot_keeps_its_close_after_the_data() {
    let mut w = World::new(11);
    let id = w.client.open_stream(b"last words").expect("open");
    w.known.insert((Side::Client, id.0));
    let data = vec![7u8; 20_000];
    let n = w.client.write(id, &data).expect("write");
    w.written.insert((Side::Client, id.0), data[..n].to_vec());
    w.client.finish_stream(id).expect("finish");
    w.client.close(42, "bye");
    assert_eq!(w.client.state(), State::Closing);
    // Part of the data reaches the server before the snapshot.
    w.deliver(3000);
    w.snapshot(Side::Client);
    assert_eq!(w.client.state(), State::Closing);
    w.dial();
    for _ in 0..200 {
        w.deliver(usize::MAX);
        if w.known.contains(&(Side::Server, id.0)) && !w.eof.contains(&(Side::Server, id.0)) {
            w.read_stream(Side::Server, id.0, 1 << 16);
        }
        w.now += Duration::from_millis(5);
        w.client.handle_timeout(w.now);
    }
    assert_eq!(
        w.read.get(&(Side::Server, id.0)).map(Vec::len),
        Some(n),
        "every byte before the close"
    );
    assert!(w.eof.contains(&(Side::Server, id.0)));
    w.check();
    assert!(
        w.closed.iter().any(|(side, r)| *side == Side::Server
            && matches!(r, CloseReason::Peer { code: 42, reason } if reason == "bye")),
        "{:?}",
        w.closed
    );
}
