//! Client and server settings: the protocol's identity and knobs plus what the
//! async layer adds (re-dial backoff, connection caps).

use std::time::Duration;

/// How a client connects and re-dials.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Identity, server trust and session knobs for the protocol.
    pub proto: roam_proto::ClientConfig,
    /// First re-dial delay after a failed attempt (default 100 ms). The first
    /// attempt after losing a transport goes out at once.
    pub backoff_initial: Duration,
    /// Longest delay between re-dial attempts (default 5 s).
    pub backoff_max: Duration,
    /// Give up on one TCP connection attempt after this long (default 10 s).
    pub connect_timeout: Duration,
    /// Re-dial at once when Linux reports a link or address change (default true).
    pub watch_network: bool,
    /// Ask the server to move the session to another host of its cluster
    /// when the inbound rate drops (default off; see [`MovePolicy`]).
    pub move_when_slow: Option<MovePolicy>,
}

/// The client's rate-based move policy (Service Continuations §7.1.3): the
/// inbound data rate is estimated over windows of `window`; when a window's
/// rate is `drop` (a fraction) or more below the best window rate seen from
/// the current server, the client asks to be moved (`MOVE_ASK`,
/// `docs/PROTOCOL.md` §9.4), then waits five windows before asking again.
/// Meant for sessions that receive a steady stream (a download, a feed): an
/// application that simply stops sending also lowers the rate.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct MovePolicy {
    /// The estimation window (default 1 s).
    pub window: Duration,
    /// The drop that triggers a request (default 0.25: 25 %).
    pub drop: f64,
    /// Rates are judged only once the best reached this many bytes per
    /// second (default 64 KiB/s).
    pub min_rate: u64,
}

impl Default for MovePolicy {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(1),
            drop: 0.25,
            min_rate: 64 << 10,
        }
    }
}

impl ClientConfig {
    /// Defaults around the given protocol configuration.
    pub fn new(proto: roam_proto::ClientConfig) -> Self {
        Self {
            proto,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            watch_network: true,
            move_when_slow: None,
        }
    }
}

/// How a server admits connections.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Identity, authorized keys and session knobs for the protocol.
    pub proto: roam_proto::ServerConfig,
    /// TCP connections handled at once (default 1,024). Each holds a file
    /// descriptor until its session moves to another one or ends.
    pub max_connections: usize,
    /// Connections accepted beyond `max_connections` only to be answered
    /// "busy" (refusal status 5) at once instead of hanging in the listen
    /// backlog (default 64). Past this many, a connection is closed without
    /// an answer, so that answering cannot itself exhaust file descriptors.
    pub busy_overflow: usize,
    /// Sessions held at once, suspended ones included (default 4,096); new
    /// sessions beyond it are refused as busy.
    pub max_sessions: usize,
    /// Sessions one source IP address may hold (default 128), counted from
    /// the address that opened them and checked before any cryptography;
    /// further new sessions from it are refused as busy. Generous enough for
    /// a NATed office; small enough that one host cannot fill `max_sessions`.
    pub max_sessions_per_ip: usize,
    /// Sessions one client static key may hold (default 128), checked as soon
    /// as the handshake reveals the key; a session beyond it is closed at once
    /// with [`roam_proto::code::SERVER_BUSY`] and a reason naming the limit.
    pub max_sessions_per_key: usize,
    /// Drop a connection whose opening has not arrived after this long (default 10 s).
    pub hello_timeout: Duration,
    /// On shutdown, wait this long for sessions to close gracefully (default 2 s).
    pub shutdown_grace: Duration,
    /// Where the running server publishes its usage of these limits; keep a
    /// clone to read it (default: a fresh, private one). Clones of this
    /// config share it: give each server it runs its own.
    pub stats: crate::ServerStats,
    /// While this reads `true` the server accepts no connection: new ones
    /// wait in the listen backlog, those already accepted and every session
    /// go on. A relay handing its sessions to a new process closes the gate
    /// first, so no resume lands on a session it is taking out (default:
    /// none, always open).
    pub accept_paused: Option<tokio::sync::watch::Receiver<bool>>,
    /// Sessions handed to this server with their live connections (a relay
    /// takeover): the server installs each as it arrives, from its start
    /// until it stops (default: none). See [`crate::adoption_queue`].
    pub adoptions: Option<crate::Adoptions>,
}

impl ServerConfig {
    /// Defaults around the given protocol configuration.
    pub fn new(proto: roam_proto::ServerConfig) -> Self {
        Self {
            proto,
            max_connections: 1024,
            busy_overflow: 64,
            max_sessions: 4096,
            max_sessions_per_ip: 128,
            max_sessions_per_key: 128,
            hello_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(2),
            stats: crate::ServerStats::default(),
            accept_paused: None,
            adoptions: None,
        }
    }
}
