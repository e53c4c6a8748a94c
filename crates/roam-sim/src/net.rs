//! A seeded, deterministic network simulator for two sans-IO roam sessions.
//!
//! Time is simulated: [`Sim`] keeps its own `now` and jumps straight to the
//! next thing that can happen (a delivery, a session timer, a scheduled
//! reconnect), so a 3-day suspension costs microseconds. The network is a set
//! of simulated TCP connections ([`Conn`]) carrying bytes in order with a
//! per-connection delay and random re-segmentation; faults act on them:
//! reset (both ends learn after the delay), black hole (bytes vanish, nobody is
//! told), partition (new connections fail), address change (the client's
//! next connections come from a new address, the old one is black-holed).
//!
//! Every random choice comes from one seeded RNG; [`seed_from_env`] reads
//! `ROAM_SIM_SEED`, and a failing test prints the seed to replay it.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use roam_proto::{
    route_opening, ClientConfig, Config, Event, Keypair, Opening, ServerConfig, ServerTrust,
    Session, TransportId,
};

/// The seed from `ROAM_SIM_SEED`, or `default`.
pub fn seed_from_env(default: u64) -> u64 {
    std::env::var("ROAM_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Number of seeds from `ROAM_SIM_SEEDS`, or `default`.
pub fn seeds_from_env(default: u64) -> u64 {
    std::env::var("ROAM_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// How the server end of a simulated connection is attached.
#[derive(Debug)]
enum ServerEnd {
    /// Waiting for a complete client hello.
    Hello(Vec<u8>),
    /// Attached to the server session as this transport.
    Attached(TransportId),
    /// Closed by the server side.
    Closed,
}

/// One simulated TCP connection.
#[derive(Debug)]
pub struct Conn {
    client_tid: Option<TransportId>,
    server: ServerEnd,
    c2s: VecDeque<(Instant, Vec<u8>)>,
    s2c: VecDeque<(Instant, Vec<u8>)>,
    /// Bytes vanish in both directions and nobody is told.
    blackholed: bool,
    /// A reset is travelling to each end: (to client at, to server at).
    reset_at: Option<(Option<Instant>, Option<Instant>)>,
    client_addr: SocketAddr,
    delay: Duration,
    /// When each direction's simulated link is next free (c2s, s2c).
    free_at: [Option<Instant>; 2],
    /// Link rate in bytes per second.
    rate: u64,
    /// Which server host (replica) the connection reaches.
    host: usize,
}

/// Knobs of one simulation run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// One-way delay of each new connection is drawn from this range (ms).
    pub delay_ms: (u64, u64),
    /// Client re-dials this long after losing its transport (plus jitter up to the same).
    pub reconnect_after: Duration,
    /// Link rate of each direction, bytes per second.
    pub rate: u64,
    /// Session knobs for both sides.
    pub session: Config,
}

impl SimConfig {
    /// Defaults: 1-30 ms delay, re-dial after 100 ms.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            delay_ms: (1, 30),
            reconnect_after: Duration::from_millis(100),
            rate: 20_000_000,
            session: Config::default(),
        }
    }
}

/// A client session, a server endpoint holding (at most) one server session,
/// and the simulated network between them.
pub struct Sim {
    /// Simulated current time.
    pub now: Instant,
    start: Instant,
    /// The seeded source of every random choice.
    pub rng: StdRng,
    cfg: SimConfig,
    /// The client session.
    pub client: Session,
    /// The server's session, once a new-session hello arrived.
    pub server: Option<Session>,
    server_cfg: ServerConfig,
    conns: Vec<Conn>,
    /// Events the client emitted, in order.
    pub client_events: Vec<Event>,
    /// Events the server session emitted, in order.
    pub server_events: Vec<Event>,
    /// Errors returned by the server endpoint when refusing a hello or resume.
    pub endpoint_errors: Vec<roam_proto::Error>,
    /// Errors returned by `handle_input` on either side (transport failures).
    pub input_errors: Vec<roam_proto::Error>,
    /// New connections fail while set (and existing ones are black-holed by [`Sim::partition`]).
    pub partitioned: bool,
    /// The client re-dials by itself after losing its transport.
    pub auto_reconnect: bool,
    reconnect_at: Option<Instant>,
    client_addr: SocketAddr,
    server_addr: SocketAddr,
    /// Raw bytes of every connection's client-to-server direction, for replay tests.
    pub record_c2s: bool,
    /// Recorded client-to-server bytes, per connection, when `record_c2s` is set.
    pub recorded: Vec<Vec<u8>>,
    /// Replicas of the server (host 0 is `server_addr`; more with
    /// [`Sim::add_hosts`]): the server session lives on `holder`; the
    /// others answer a resume with a `Moved` refusal naming the holder's
    /// address (`docs/PROTOCOL.md` §9.3).
    hosts: Vec<SocketAddr>,
    /// The host holding the server session.
    pub holder: usize,
    /// The host the client dials (follows MOVE_TO and `Moved`).
    pub dial_host: usize,
    /// Moves done with [`Sim::move_session`].
    pub moves: u64,
}

impl Sim {
    /// A fresh pair with new keys; the client pins the server key.
    pub fn new(cfg: SimConfig) -> Self {
        let server_kp = Keypair::generate().expect("keygen");
        let client = ClientConfig {
            keypair: Keypair::generate().expect("keygen"),
            server_trust: ServerTrust::Pinned(server_kp.public()),
            session: cfg.session.clone(),
        };
        let server = ServerConfig {
            keypair: server_kp,
            authorized_keys: None,
            addresses: Vec::new(),
            session: cfg.session.clone(),
        };
        Self::with_configs(cfg, client, server)
    }

    /// A pair with explicit client and server configurations.
    pub fn with_configs(cfg: SimConfig, client: ClientConfig, server: ServerConfig) -> Self {
        let now = Instant::now();
        Self {
            now,
            start: now,
            rng: StdRng::seed_from_u64(cfg.seed),
            cfg,
            client: Session::client(client),
            server: None,
            server_cfg: server,
            conns: Vec::new(),
            client_events: Vec::new(),
            server_events: Vec::new(),
            endpoint_errors: Vec::new(),
            input_errors: Vec::new(),
            partitioned: false,
            auto_reconnect: true,
            reconnect_at: None,
            client_addr: "192.0.2.10:40000".parse().expect("addr"),
            server_addr: "198.51.100.1:7447".parse().expect("addr"),
            record_c2s: false,
            recorded: Vec::new(),
            hosts: vec!["198.51.100.1:7447".parse().expect("addr")],
            holder: 0,
            dial_host: 0,
            moves: 0,
        }
    }

    /// Adds `n` more server hosts (replicas of one service, sharing its
    /// key); the session can then move between them ([`Sim::move_session`]).
    pub fn add_hosts(&mut self, n: usize) {
        for _ in 0..n {
            let i = self.hosts.len();
            self.hosts
                .push(format!("198.51.100.{}:7447", i + 1).parse().expect("addr"));
        }
    }

    /// Number of server hosts.
    pub fn host_count(&self) -> usize {
        self.hosts.len()
    }

    /// Moves the server session, live, to host `to`, as a cluster does
    /// (`docs/PROTOCOL.md` §14.3): with `move_to` the old host first tells
    /// the client `MOVE_TO` (sent on its transport, if it has one, before
    /// the snapshot); the session is exported, every connection the old
    /// host served dies with it, and `to` restores it. From then on the old
    /// host answers resumes with `Moved` naming `to`. Returns the
    /// snapshot's size.
    pub fn move_session(&mut self, to: usize, move_to: bool) -> Result<usize, String> {
        if to >= self.hosts.len() || to == self.holder {
            return Err(format!("no other host {to}"));
        }
        let Some(mut old) = self.server.take() else {
            return Err("no server session".into());
        };
        if move_to {
            old.move_to(self.hosts[to].to_string());
            // What the session still has to say goes out before it is
            // exported (as the tokio driver's detach does).
            let now = self.now;
            let mut out = Vec::new();
            while let Some(tid) = old.poll_transmit(now, &mut out) {
                if let Some(i) = self
                    .conns
                    .iter()
                    .position(|c| matches!(c.server, ServerEnd::Attached(t) if t == tid))
                {
                    let data = std::mem::take(&mut out);
                    self.send(i, data, false);
                } else {
                    out.clear();
                }
            }
        }
        let blob = old.export(self.now).map_err(|e| e.to_string())?;
        drop(old);
        let from = self.holder;
        for c in &mut self.conns {
            if c.host == from && !matches!(c.server, ServerEnd::Closed) {
                c.server = ServerEnd::Closed;
                c.c2s.clear();
                if !c.blackholed {
                    let at = c
                        .s2c
                        .back()
                        .map_or(self.now, |(t, _)| *t)
                        .max(self.now + c.delay);
                    c.reset_at = Some((Some(at), None));
                }
            }
        }
        let restored = Session::restore_server(&self.server_cfg, self.now, &blob, Duration::ZERO)
            .map_err(|e| e.to_string())?;
        self.server = Some(restored);
        self.holder = to;
        self.moves += 1;
        Ok(blob.len())
    }

    /// Simulated time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// The client dials a new transport now (new session or resume).
    pub fn dial(&mut self) {
        self.reconnect_at = None;
        let addr = self
            .hosts
            .get(self.dial_host)
            .copied()
            .unwrap_or(self.server_addr);
        let Ok(tid) = self.client.connect(self.now, Some(addr)) else {
            return;
        };
        let (lo, hi) = self.cfg.delay_ms;
        let delay = Duration::from_millis(self.rng.gen_range(lo..=hi));
        let mut conn = Conn {
            client_tid: Some(tid),
            server: ServerEnd::Hello(Vec::new()),
            c2s: VecDeque::new(),
            s2c: VecDeque::new(),
            blackholed: false,
            reset_at: None,
            client_addr: self.client_addr,
            delay,
            free_at: [None, None],
            rate: self.cfg.rate.max(1),
            host: self.dial_host,
        };
        if self.partitioned {
            // The SYN goes nowhere: the client learns of it after a connect timeout.
            conn.blackholed = true;
        }
        self.conns.push(conn);
        if self.record_c2s {
            self.recorded.push(Vec::new());
        }
    }

    fn live_conn(&mut self) -> Option<&mut Conn> {
        let tid = self.client.active_transport()?;
        self.conns.iter_mut().find(|c| c.client_tid == Some(tid))
    }

    /// Resets the client's current connection: both ends learn after the delay.
    pub fn reset_transport(&mut self) {
        let now = self.now;
        if let Some(c) = self.live_conn() {
            if c.reset_at.is_none() {
                let at = Some(now + c.delay);
                c.reset_at = Some((at, at));
                c.c2s.clear();
                c.s2c.clear();
            }
        }
    }

    /// Silently black-holes the client's current connection.
    pub fn blackhole_transport(&mut self) {
        if let Some(c) = self.live_conn() {
            c.blackholed = true;
        }
    }

    /// Black-holes every connection and makes new ones fail until [`Sim::heal`].
    pub fn partition(&mut self) {
        self.partitioned = true;
        for c in &mut self.conns {
            c.blackholed = true;
        }
    }

    /// Ends a partition (existing black-holed connections stay dead).
    pub fn heal(&mut self) {
        self.partitioned = false;
    }

    /// The client moves to a new address: its current connection is black-holed
    /// (packets to the old address go nowhere) and it re-dials from `addr`.
    pub fn change_client_addr(&mut self, addr: SocketAddr) {
        self.blackhole_transport();
        self.client_addr = addr;
        // Like a netlink address event: the client re-dials at once.
        self.dial();
    }

    /// Moves simulated time forward by `d`, processing everything on the way.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        self.run_until(end, |_| false);
    }

    /// Runs until `done(self)` or until simulated time `deadline`. Returns
    /// whether `done` became true. Bounded: at most 50 million steps.
    pub fn run_until(&mut self, deadline: Instant, mut done: impl FnMut(&mut Sim) -> bool) -> bool {
        for _ in 0..50_000_000u64 {
            self.step();
            if done(self) {
                return true;
            }
            // Whatever the closure did (writes, faults, dials) goes out now.
            self.transmit();
            self.collect_events();
            let next = self.next_wakeup().unwrap_or(deadline).min(deadline);
            if next >= deadline && self.now >= deadline {
                return false;
            }
            if next > self.now {
                self.now = next;
            } else if !self.has_work_now() {
                // Nothing due at `now` any more: advance a hair so timers fire.
                self.now += Duration::from_micros(1);
                if self.now > deadline {
                    return false;
                }
            }
        }
        panic!("simulation did not settle within its step bound");
    }

    fn has_work_now(&self) -> bool {
        self.conns.iter().any(|c| {
            c.c2s.front().is_some_and(|(t, _)| *t <= self.now)
                || c.s2c.front().is_some_and(|(t, _)| *t <= self.now)
        })
    }

    fn next_wakeup(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| t = Some(t.map_or(x, |t: Instant| t.min(x)));
        for c in &self.conns {
            if let Some((x, _)) = c.c2s.front() {
                at(*x);
            }
            if let Some((x, _)) = c.s2c.front() {
                at(*x);
            }
            if let Some((a, b)) = c.reset_at {
                a.into_iter().chain(b).for_each(&mut at);
            }
        }
        if let Some(x) = self.client.poll_timeout() {
            at(x);
        }
        if let Some(x) = self.server.as_ref().and_then(Session::poll_timeout) {
            at(x);
        }
        if let Some(x) = self.reconnect_at {
            at(x);
        }
        t
    }

    /// One pass: timers, deliveries, transmissions, events, reconnects.
    pub fn step(&mut self) {
        let now = self.now;
        self.client.handle_timeout(now);
        if let Some(s) = self.server.as_mut() {
            s.handle_timeout(now);
        }
        // Bytes first: a close travels behind the data sent before it.
        self.deliver_bytes();
        self.deliver_resets();
        self.collect_events();
        if self.auto_reconnect
            && self.client.active_transport().is_none()
            && matches!(
                self.client.state(),
                roam_proto::State::Suspended | roam_proto::State::Closing
            )
        {
            match self.reconnect_at {
                None => {
                    let base = self.cfg.reconnect_after;
                    let jitter = self.rng.gen_range(0..=base.as_micros() as u64);
                    self.reconnect_at = Some(now + base + Duration::from_micros(jitter));
                }
                Some(t) if t <= now => self.dial(),
                Some(_) => {}
            }
        }
        self.transmit();
        self.collect_events();
    }

    fn deliver_resets(&mut self) {
        let now = self.now;
        for i in 0..self.conns.len() {
            let Some((to_client, to_server)) = self.conns[i].reset_at else {
                continue;
            };
            if to_client.is_some_and(|t| t <= now) {
                if let Some(tid) = self.conns[i].client_tid.take() {
                    self.client.handle_transport_closed(now, tid);
                }
                self.conns[i].reset_at = Some((None, to_server));
            }
            if to_server.is_some_and(|t| t <= now) {
                if let ServerEnd::Attached(tid) = self.conns[i].server {
                    if let Some(s) = self.server.as_mut() {
                        s.handle_transport_closed(now, tid);
                    }
                }
                self.conns[i].server = ServerEnd::Closed;
                let c = &mut self.conns[i];
                c.reset_at = Some((c.reset_at.and_then(|r| r.0), None));
            }
        }
    }

    fn deliver_bytes(&mut self) {
        let now = self.now;
        for i in 0..self.conns.len() {
            while self.conns[i].c2s.front().is_some_and(|(t, _)| *t <= now) {
                let Some((_, bytes)) = self.conns[i].c2s.pop_front() else {
                    break;
                };
                self.deliver_to_server(i, &bytes);
            }
            while self.conns[i].s2c.front().is_some_and(|(t, _)| *t <= now) {
                let Some((_, bytes)) = self.conns[i].s2c.pop_front() else {
                    break;
                };
                if let Some(tid) = self.conns[i].client_tid {
                    if let Err(e) = self.client.handle_input(now, tid, &bytes) {
                        self.input_errors.push(e);
                        self.close_from(i, true);
                    }
                }
            }
        }
    }

    fn deliver_to_server(&mut self, i: usize, bytes: &[u8]) {
        let now = self.now;
        let peer = Some(self.conns[i].client_addr);
        match &mut self.conns[i].server {
            ServerEnd::Closed => {}
            ServerEnd::Attached(tid) => {
                let tid = *tid;
                if let Some(s) = self.server.as_mut() {
                    if let Err(e) = s.handle_input(now, tid, bytes) {
                        self.input_errors.push(e);
                        self.close_from(i, false);
                    }
                }
            }
            ServerEnd::Hello(buf) => {
                buf.extend_from_slice(bytes);
                let (hello, used, resume) = match route_opening(buf) {
                    Opening::Incomplete => return,
                    Opening::New { hello, used } => (hello, used, None),
                    Opening::Resume { id, hello, used } => (hello, used, Some(id)),
                    Opening::Refuse { error, reply } => {
                        self.endpoint_errors.push(error);
                        let c = &mut self.conns[i];
                        if !c.blackholed && !reply.is_empty() {
                            let at = now + c.delay;
                            c.s2c.push_back((at, reply));
                        }
                        self.close_from(i, false);
                        return;
                    }
                    _ => unreachable!("route_opening's answers are all handled"),
                };
                let rest = buf[used..].to_vec();
                let host = self.conns[i].host;
                if host != self.holder {
                    // Not here: a resume is sent to the holder, a new
                    // session refused (these replicas hold one session).
                    let (out, e) = match resume {
                        Some(_) => (
                            hello
                                .redirect(&self.hosts[self.holder].to_string())
                                .expect("short address"),
                            roam_proto::Error::Moved(self.hosts[self.holder].to_string()),
                        ),
                        None => (
                            hello.refusal(&roam_proto::Error::ServerBusy),
                            roam_proto::Error::ServerBusy,
                        ),
                    };
                    self.endpoint_errors.push(e);
                    let c = &mut self.conns[i];
                    if !c.blackholed {
                        let at = now + c.delay;
                        c.s2c.push_back((at, out));
                    }
                    self.close_from(i, false);
                    return;
                }
                let result = match resume {
                    None => match Session::accept(&self.server_cfg, now, &hello, peer) {
                        Ok((s, tid)) => {
                            self.server = Some(s);
                            Ok(tid)
                        }
                        Err(e) => Err(e),
                    },
                    Some(id) => match self.server.as_mut() {
                        Some(s) if s.id() == Some(id) => s.accept_resume(now, &hello, peer),
                        _ => Err(roam_proto::Error::UnknownSession),
                    },
                };
                match result {
                    Ok(tid) => {
                        self.conns[i].server = ServerEnd::Attached(tid);
                        if !rest.is_empty() {
                            self.deliver_to_server(i, &rest);
                        }
                    }
                    Err(e) => {
                        let out = hello.refusal(&e);
                        self.endpoint_errors.push(e);
                        let c = &mut self.conns[i];
                        if !c.blackholed {
                            let at = now + c.delay;
                            c.s2c.push_back((at, out));
                        }
                        self.close_from(i, false);
                    }
                }
            }
        }
    }

    /// One side closed connection `i`; the other side learns after the delay
    /// (unless the connection is black-holed).
    fn close_from(&mut self, i: usize, client_side: bool) {
        let c = &mut self.conns[i];
        let at = c
            .s2c
            .back()
            .map_or(self.now, |(t, _)| *t)
            .max(self.now + c.delay);
        if client_side {
            c.client_tid = None;
            if !c.blackholed {
                c.reset_at = Some((None, Some(self.now + c.delay)));
            }
        } else {
            if let ServerEnd::Attached(_) | ServerEnd::Hello(_) = c.server {
                c.server = ServerEnd::Closed;
            }
            if !c.blackholed {
                c.reset_at = Some((Some(at), None));
            }
        }
    }

    fn transmit(&mut self) {
        let now = self.now;
        let mut buf = Vec::new();
        for _ in 0..10_000 {
            buf.clear();
            let Some(tid) = self.client.poll_transmit(now, &mut buf) else {
                break;
            };
            if let Some(i) = self.conns.iter().position(|c| c.client_tid == Some(tid)) {
                if self.record_c2s {
                    self.recorded[i].extend_from_slice(&buf);
                }
                let data = std::mem::take(&mut buf);
                self.send(i, data, true);
            }
        }
        if let Some(s) = self.server.as_mut() {
            for _ in 0..10_000 {
                buf.clear();
                let Some(tid) = s.poll_transmit(now, &mut buf) else {
                    break;
                };
                if let Some(i) = self
                    .conns
                    .iter()
                    .position(|c| matches!(c.server, ServerEnd::Attached(t) if t == tid))
                {
                    let data = std::mem::take(&mut buf);
                    Self::send_on(&mut self.conns[i], &mut self.rng, now, data, false);
                }
            }
        }
    }

    fn send(&mut self, i: usize, data: Vec<u8>, c2s: bool) {
        Self::send_on(&mut self.conns[i], &mut self.rng, self.now, data, c2s);
    }

    /// Queues bytes with the connection's delay, split at random points (TCP
    /// may re-segment, never reorder).
    fn send_on(c: &mut Conn, rng: &mut StdRng, now: Instant, data: Vec<u8>, c2s: bool) {
        if c.blackholed || c.reset_at.is_some() {
            return;
        }
        // Serialisation at the link rate, then propagation delay; order kept.
        let dir = usize::from(!c2s);
        let start = c.free_at[dir].map_or(now, |f| f.max(now));
        let free = start + Duration::from_nanos(data.len() as u64 * 1_000_000_000 / c.rate);
        c.free_at[dir] = Some(free);
        let q = if c2s { &mut c.c2s } else { &mut c.s2c };
        let at = q.back().map_or(now, |(t, _)| *t).max(free + c.delay);
        let mut rest = &data[..];
        while !rest.is_empty() {
            let cut = if rest.len() > 1 && rng.gen_bool(0.3) {
                rng.gen_range(1..rest.len())
            } else {
                rest.len()
            };
            q.push_back((at, rest[..cut].to_vec()));
            rest = &rest[cut..];
        }
    }

    fn collect_events(&mut self) {
        while let Some(e) = self.client.poll_event() {
            if let Event::MoveRequested { addr } = &e {
                // The client follows MOVE_TO and `Moved` at once, as the
                // tokio driver does.
                if let Some(h) = self.hosts.iter().position(|a| a.to_string() == *addr) {
                    if h != self.dial_host {
                        self.dial_host = h;
                        self.dial();
                    }
                }
            }
            if let Event::TransportClosed { transport, .. } = &e {
                if let Some(i) = self
                    .conns
                    .iter()
                    .position(|c| c.client_tid == Some(*transport))
                {
                    self.close_from(i, true);
                }
            }
            self.client_events.push(e);
        }
        if let Some(s) = self.server.as_mut() {
            while let Some(e) = s.poll_event() {
                if let Event::TransportClosed { transport, .. } = &e {
                    let tid = *transport;
                    if let Some(c) = self
                        .conns
                        .iter_mut()
                        .find(|c| matches!(c.server, ServerEnd::Attached(t) if t == tid))
                    {
                        c.server = ServerEnd::Closed;
                        if !c.blackholed {
                            let at = c
                                .s2c
                                .back()
                                .map_or(self.now, |(t, _)| *t)
                                .max(self.now + c.delay);
                            c.reset_at = Some((Some(at), None));
                        }
                    }
                }
                self.server_events.push(e);
            }
        }
        // Forget connections that are dead at both ends (unless recording,
        // which keeps `recorded[i]` aligned with connection `i`).
        if self.record_c2s {
            return;
        }
        self.conns.retain(|c| {
            !(c.client_tid.is_none()
                && matches!(c.server, ServerEnd::Closed)
                && c.c2s.is_empty()
                && c.s2c.is_empty()
                && c.reset_at.is_none_or(|r| r.0.is_none() && r.1.is_none()))
        });
    }

    /// Opens a connection that the client session knows nothing about and
    /// sends `bytes` on it to the server (an attacker replaying a capture).
    pub fn inject_connection(&mut self, bytes: Vec<u8>) {
        let conn = Conn {
            client_tid: None,
            server: ServerEnd::Hello(Vec::new()),
            c2s: VecDeque::from([(self.now, bytes)]),
            s2c: VecDeque::new(),
            blackholed: false,
            reset_at: None,
            client_addr: "203.0.113.66:666".parse().expect("addr"),
            delay: Duration::from_millis(1),
            free_at: [None, None],
            rate: self.cfg.rate.max(1),
            host: self.holder,
        };
        self.conns.push(conn);
        if self.record_c2s {
            self.recorded.push(Vec::new());
        }
    }

    /// The server process "restarts": its session is exported to bytes, every
    /// server-side connection dies with the process, and a fresh session is
    /// restored from the bytes after `offline`. Returns the blob's size.
    pub fn restart_server(&mut self, offline: Duration) -> Result<usize, String> {
        let Some(old) = self.server.take() else {
            return Err("no server session".into());
        };
        let blob = old.export(self.now).map_err(|e| e.to_string())?;
        drop(old);
        for c in &mut self.conns {
            if !matches!(c.server, ServerEnd::Closed) {
                c.server = ServerEnd::Closed;
                c.c2s.clear();
                if !c.blackholed {
                    c.reset_at = Some((Some(self.now + c.delay), None));
                }
            }
        }
        self.now += offline;
        let restored = Session::restore_server(&self.server_cfg, self.now, &blob, offline)
            .map_err(|e| e.to_string())?;
        self.server = Some(restored);
        Ok(blob.len())
    }

    /// The server configuration (for restoring exported sessions in tests).
    pub fn server_config(&self) -> &ServerConfig {
        &self.server_cfg
    }

    /// Number of simulated connections still tracked.
    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }
}
