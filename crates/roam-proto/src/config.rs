//! Session configuration with the defaults the spec recommends (§8, §9).

use std::sync::Arc;
use std::time::Duration;

use crate::handshake::Params;
use crate::keys::{Keypair, PublicKey};

/// Knobs shared by both roles. Defaults follow `docs/PROTOCOL.md`.
#[derive(Debug, Clone)]
pub struct Config {
    /// Send a `PING` after this long without sending anything (default 1 s).
    pub heartbeat_interval: Duration,
    /// Declare the transport dead after this long without receiving anything
    /// (default 5 s): the session becomes suspended.
    pub suspend_after: Duration,
    /// Keep a suspended session resumable this long (default 3 days, as rocks).
    pub resume_timeout: Duration,
    /// Keep a suspended session that has no open stream only this long
    /// (default `None`: as long as [`Config::resume_timeout`]). Such a
    /// session holds nothing its peer could lose, so a server can reclaim it
    /// quickly; one with an open stream still lives for `resume_timeout`.
    /// Local only: it is not announced to the peer (PROTOCOL.md §10.3).
    pub idle_resume_timeout: Option<Duration>,
    /// Give up on a transport whose handshake has not finished after this long (default 10 s).
    pub handshake_timeout: Duration,
    /// Receive window per stream, bytes (default 1 MiB).
    pub stream_window: u64,
    /// Receive window for the whole session, bytes (default 16 MiB). Bounds the
    /// received-but-unread bytes held for the application.
    pub session_window: u64,
    /// Send buffer per stream, bytes (default 1 MiB): `write` accepts no more
    /// unacknowledged bytes than this.
    pub stream_send_buffer: u64,
    /// Send buffer for the whole session, bytes (default 16 MiB). While more
    /// streams are refused room at once than it holds 64 KiB shares for
    /// (256 at the default size) it grows, up to
    /// [`SEND_BUFFER_GROWTH`](crate::SEND_BUFFER_GROWTH) (4) times this, so that
    /// each keeps a 64 KiB share (fewer, larger frames).
    pub session_send_buffer: u64,
    /// Streams the peer may have open towards us (default 65,536; at least 16).
    pub max_streams: u64,
    /// Delay before a standalone `ACK` when no other frame carries it (default 2 ms).
    pub ack_delay: Duration,
    /// Client: how long resume refusals sent in clear (`UnknownSession`,
    /// `ResumeRejected`) must persist before they end the session (default
    /// 10 s). They are unauthenticated, so one forged refusal on the path costs
    /// a retry instead of the session (§12); a server that really lost the
    /// session keeps refusing and the session ends after this grace. Zero ends
    /// it at the first refusal.
    pub refusal_grace: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(1),
            suspend_after: Duration::from_secs(5),
            resume_timeout: Duration::from_secs(3 * 24 * 3600),
            idle_resume_timeout: None,
            handshake_timeout: Duration::from_secs(10),
            stream_window: 1 << 20,
            session_window: 16 << 20,
            stream_send_buffer: 1 << 20,
            session_send_buffer: 16 << 20,
            max_streams: 65_536,
            ack_delay: Duration::from_millis(2),
            refusal_grace: Duration::from_secs(10),
        }
    }
}

impl Config {
    pub(crate) fn params(&self) -> Params {
        Params {
            stream_window: self.stream_window.max(1),
            session_window: self.session_window.max(1),
            max_streams: self.max_streams.max(crate::handshake::MIN_MAX_STREAMS),
        }
    }
}

/// How the client decides to trust the server's static key.
#[derive(Debug, Clone)]
pub enum ServerTrust {
    /// Accept only this key (known-servers entry).
    Pinned(PublicKey),
    /// Accept any key; the application records it (trust on first use) from
    /// [`crate::Event::Connected`].
    FirstUse,
}

/// A client's identity and trust decisions.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Our static key. Use a fresh one per run if the user has none.
    pub keypair: Keypair,
    /// Which server key to accept.
    pub server_trust: ServerTrust,
    /// Session knobs.
    pub session: Config,
}

/// A server's identity and admission policy.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The server's static key; clients pin it.
    pub keypair: Keypair,
    /// Client keys allowed to connect; `None` accepts any client key.
    pub authorized_keys: Option<Arc<Vec<PublicKey>>>,
    /// Addresses the server announces to new clients (§9.1).
    pub addresses: Vec<String>,
    /// Session knobs.
    pub session: Config,
}
