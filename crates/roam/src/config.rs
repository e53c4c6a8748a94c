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
        }
    }
}

/// How a server admits connections.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Identity, authorized keys and session knobs for the protocol.
    pub proto: roam_proto::ServerConfig,
    /// TCP connections handled at once (default 1,024); further ones wait in
    /// the listen backlog.
    pub max_connections: usize,
    /// Sessions held at once, suspended ones included (default 4,096); new
    /// sessions beyond it are refused as busy.
    pub max_sessions: usize,
    /// Drop a connection whose opening has not arrived after this long (default 10 s).
    pub hello_timeout: Duration,
    /// On shutdown, wait this long for sessions to close gracefully (default 2 s).
    pub shutdown_grace: Duration,
}

impl ServerConfig {
    /// Defaults around the given protocol configuration.
    pub fn new(proto: roam_proto::ServerConfig) -> Self {
        Self {
            proto,
            max_connections: 1024,
            max_sessions: 4096,
            hello_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(2),
        }
    }
}
