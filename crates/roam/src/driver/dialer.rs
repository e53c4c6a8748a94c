//! The client's side of a driver: re-dial scheduling with capped, jittered
//! backoff, hedged TCP connects, and reacting to network changes and
//! `MOVE_TO`.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rand::Rng;
use roam_proto::State;
use tokio::net::TcpStream;

use crate::transport::{network_peer, Transport, UNIX_PEER};
use tokio::time::Instant;

use super::conn::Conn;
use crate::handle::{SessionEvent, Shared};
use crate::netwatch::NetworkChanges;

type DialFuture =
    Pin<Box<dyn std::future::Future<Output = io::Result<(Transport, SocketAddr)>> + Send>>;

/// What woke a client driver on its dialer's account.
pub(crate) enum DialerWake {
    /// The dial in progress finished.
    Dialed(io::Result<(Transport, SocketAddr)>),
    /// The network changed; `false` once the watcher is gone.
    NetChange(bool),
}

/// Client side: where and when to re-dial.
pub(crate) struct Dialer {
    /// `host:port` of the server (changed by a `MOVE_TO`).
    pub(crate) addr: String,
    /// The few settings a re-dial needs, not the whole
    /// [`crate::ClientConfig`]: this lives as long as the session does
    /// (suspended ones included), and the rest of the configuration (keys,
    /// trust, protocol settings) is already in the session or not needed.
    knobs: Knobs,
    /// Attempts since the last resume; 0 means the next one goes out at once.
    pub(super) attempt: u32,
    redial_at: Option<Instant>,
    /// Dial now even though a transport is up (network change, `MOVE_TO`).
    pub(super) force: bool,
    pub(super) dial: Option<DialFuture>,
    net: Option<NetworkChanges>,
    /// `MOVE_TO`s and `Moved` refusals followed since the last resume: past
    /// [`MAX_FORCED_MOVES`] a move waits out the backoff like any re-dial, so
    /// hosts that point at each other cannot make a client spin.
    pub(super) moves: u32,
    /// The address before the last move, until a resume succeeds: if the
    /// host we were sent to cannot be reached, the session may well still
    /// be where it was (a move that failed), so the next dial goes back.
    pub(super) fallback: Option<String>,
    /// The transport of the resume attempt in flight, until it is lost
    /// (a resume that did not complete there moves the ring on).
    pub(super) resuming: Option<roam_proto::TransportId>,
    /// The rate-based move policy, if configured. Boxed: rarely set, and
    /// inline it would make every session's dialer ~90 bytes larger.
    slowdown: Option<Box<super::slowdown::Slowdown>>,
    /// The address the session was opened at: first in the ring of
    /// addresses a failing re-dial walks ([`Dialer::rotate`]).
    first: String,
}

/// The settings of [`crate::ClientConfig`] a [`Dialer`] uses after it is built.
struct Knobs {
    /// `ClientConfig::backoff_initial`.
    backoff_initial: Duration,
    /// `ClientConfig::backoff_max`.
    backoff_max: Duration,
    /// `ClientConfig::connect_timeout`.
    connect_timeout: Duration,
    /// Idle time before TCP keepalive probes on a new connection: twice the
    /// session's `suspend_after`, as on the first connection.
    keepalive_idle: Duration,
}

/// Moves followed at once between two resumes; later ones wait the backoff.
const MAX_FORCED_MOVES: u32 = 8;

impl Dialer {
    pub(crate) fn new(addr: String, config: crate::ClientConfig) -> Self {
        let net = if config.watch_network {
            NetworkChanges::subscribe()
        } else {
            None
        };
        Self {
            first: addr.clone(),
            resuming: None,
            slowdown: config
                .move_when_slow
                .map(|p| Box::new(super::slowdown::Slowdown::new(p, Instant::now()))),
            addr,
            knobs: Knobs {
                backoff_initial: config.backoff_initial,
                backoff_max: config.backoff_max,
                connect_timeout: config.connect_timeout,
                keepalive_idle: config.proto.session.suspend_after * 2,
            },
            attempt: 0,
            redial_at: None,
            force: false,
            dial: None,
            net,
            moves: 0,
            fallback: None,
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
            .knobs
            .backoff_initial
            .saturating_mul(1 << exp)
            .min(self.knobs.backoff_max);
        let half = d / 2;
        half + rand::thread_rng().gen_range(Duration::ZERO..=d - half)
    }

    fn start_dial(&mut self) {
        let addr = self.addr.clone();
        let timeout = self.knobs.connect_timeout;
        self.dial = Some(Box::pin(async move {
            match tokio::time::timeout(timeout, dial(&addr)).await {
                Ok(r) => r,
                Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")),
            }
        }));
    }

    /// Decides whether to dial now or when; returns the time of a scheduled
    /// re-dial for the driver's deadline. Called once per loop iteration,
    /// after the session's events.
    pub(super) fn schedule(
        &mut self,
        sh: &mut Shared,
        events: &crate::handle::Events,
        now: Instant,
    ) -> Option<Instant> {
        let need = sh.closed.is_none()
            && sh.session.active_transport().is_none()
            && sh.session.state() != State::Handshaking;
        if std::mem::take(&mut sh.redial_requested) && need {
            self.attempt = 0;
            self.dial = None;
            self.redial_at = None;
            self.force = true;
        }
        if need && !self.force && self.dial.is_none() && self.redial_at.is_none() {
            let delay = self.backoff();
            self.attempt += 1;
            self.redial_at = Some(now + delay);
            if delay > Duration::ZERO {
                tracing::debug!(
                    "re-dialing {} in {delay:?} (attempt {})",
                    self.addr,
                    self.attempt
                );
            }
            events.send(SessionEvent::Redialing {
                attempt: self.attempt,
                delay,
            });
        }
        if !need {
            self.redial_at = None;
        }
        let mut window_end = None;
        if let Some(s) = &mut self.slowdown {
            let received = sh.session.stats().bytes_received;
            let connected = sh.session.active_transport().is_some();
            let (ask, end) = s.check(now, received, connected);
            if ask && sh.closed.is_none() {
                sh.session.ask_move(String::new());
            }
            window_end = Some(end);
        }
        if sh.closed.is_some() {
            self.dial = None;
            self.force = false;
        } else if self.dial.is_none() && (self.force || self.redial_at.is_some_and(|t| t <= now)) {
            self.force = false;
            self.redial_at = None;
            self.start_dial();
        }
        match (self.redial_at, window_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Polls the dial in progress and the network changes: what woke the
    /// driver on the dialer's account, if anything. A poll, not a future of
    /// its own, so the driver task holds no state for it.
    pub(super) fn poll_wake(&mut self, cx: &mut Context<'_>) -> Poll<DialerWake> {
        if let Some(Poll::Ready(r)) = self.dial.as_mut().map(|f| f.as_mut().poll(cx)) {
            return Poll::Ready(DialerWake::Dialed(r));
        }
        if let Some(Poll::Ready(alive)) = self.net.as_mut().map(|n| n.poll_changed(cx)) {
            return Poll::Ready(DialerWake::NetChange(alive));
        }
        Poll::Pending
    }

    /// A dial finished: on success, starts a resume on the new connection.
    pub(super) fn on_dialed(
        &mut self,
        sh: &mut Shared,
        result: io::Result<(Transport, SocketAddr)>,
        now: std::time::Instant,
    ) -> Option<Conn> {
        self.dial = None;
        match result {
            Ok((sock, peer)) => {
                crate::sockopt::configure(&sock, self.knobs.keepalive_idle);
                match sh.session.connect(now, network_peer(peer)) {
                    Ok(tid) => {
                        tracing::debug!("dialed {peer}, resuming on transport {tid:?}");
                        self.resuming = Some(tid);
                        return Some(Conn::new(tid, sock, peer, None));
                    }
                    Err(e) => tracing::debug!("not resuming: {e}"),
                }
            }
            Err(e) => {
                tracing::debug!("re-dial to {} failed: {e}", self.addr);
                if let Some(back) = self.fallback.take() {
                    tracing::info!(
                        "{} (where the server sent us) is unreachable: {e}; trying {back} again",
                        self.addr
                    );
                    self.addr = back;
                    self.force = true;
                } else {
                    self.rotate(sh.addresses(), "is unreachable");
                }
            }
        }
        None
    }

    /// The network changed (`alive`: the watcher still works): re-dial at
    /// once if suspended, or move if the route to the server now leaves from
    /// another local address.
    pub(super) fn on_net_change(&mut self, sh: &Shared, conns: &[Conn], alive: bool) {
        if !alive {
            self.net = None;
            return;
        }
        match sh.session.active_transport() {
            None if sh.closed.is_none() && sh.session.state() != State::Handshaking => {
                tracing::info!("network changed: re-dialing {} now", self.addr);
                self.attempt = 0;
                self.dial = None;
                self.redial_at = None;
                self.force = true;
            }
            Some(tid) => {
                // Move only if the kernel would now reach the server from
                // another address: the old path is likely gone.
                if let Some((c, tcp)) = conns
                    .iter()
                    .find(|c| c.tid == tid)
                    .and_then(|c| Some((c, c.sock.tcp()?)))
                {
                    let local = tcp.local_addr().ok().map(|a| a.ip());
                    let now_src = route_source(c.peer);
                    if now_src.is_some() && local != now_src && self.dial.is_none() {
                        tracing::info!(
                            "network changed: route to {} now leaves from {now_src:?}; moving",
                            c.peer
                        );
                        self.force = true;
                    }
                }
            }
            None => {}
        }
    }

    /// The current address failed (`why`): the next re-dial goes to the
    /// next of the addresses the server announced (§9.1), in turn, the
    /// first address included, so a client whose host died finds the
    /// replica that holds its session, and one whose host comes back finds
    /// that. It still waits the backoff: a dead cluster is not hammered.
    pub(super) fn rotate(&mut self, announced: &[String], why: &str) {
        if announced.is_empty() {
            return;
        }
        let mut ring: Vec<&String> = Vec::with_capacity(announced.len() + 1);
        ring.push(&self.first);
        for a in announced {
            if !ring.contains(&a) {
                ring.push(a);
            }
        }
        if ring.len() < 2 {
            return;
        }
        let next = match ring.iter().position(|a| **a == self.addr) {
            Some(i) => ring[(i + 1) % ring.len()].clone(),
            None => ring[0].clone(),
        };
        tracing::info!("{} {why}; next re-dial goes to {next}", self.addr);
        self.addr = next;
    }

    /// The server asked us to resume at `addr`.
    pub(super) fn move_to(&mut self, addr: String) {
        if addr == self.addr {
            // Already there (a MOVE_TO replayed by the host it named).
            tracing::debug!("server asked us to move to {addr}, where we are");
            return;
        }
        self.fallback = Some(std::mem::replace(&mut self.addr, addr));
        self.moves += 1;
        if let Some(s) = &mut self.slowdown {
            // Rates from the next server are judged on their own.
            s.restart();
        }
        if self.moves <= MAX_FORCED_MOVES {
            tracing::info!("server asked us to move to {}", self.addr);
            self.dial = None;
            self.force = true;
        } else {
            tracing::warn!(
                "server asked us to move to {} ({} moves without a resume); waiting the backoff",
                self.addr,
                self.moves
            );
        }
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

/// Prefix of a server address that names a Unix-domain socket's path
/// (`unix:/run/roam.sock`) instead of `host:port`.
pub(crate) const UNIX_PREFIX: &str = "unix:";

/// Connects to `addr`: `unix:PATH` to that Unix-domain socket, otherwise
/// resolves `host:port` and connects to the first address that answers.
pub(crate) async fn dial(addr: &str) -> io::Result<(Transport, SocketAddr)> {
    if let Some(path) = addr.strip_prefix(UNIX_PREFIX) {
        let s = tokio::net::UnixStream::connect(path).await?;
        return Ok((s.into(), UNIX_PEER));
    }
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        match connect_hedged(a).await {
            Ok(s) => return Ok((s.into(), a)),
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
