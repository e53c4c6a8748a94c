//! What a session tells its application (`Session::poll_event`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::keys::{PublicKey, SessionId};
use crate::stream::StreamId;
use crate::Error;

/// Identifies one transport (one TCP connection) of a session. Bytes for a
/// transport are fed and polled with its id; ids are never reused in a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransportId(pub u64);

/// Why a session lost its transport.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SuspendReason {
    /// The transport was closed or reset underneath us (`handle_transport_closed`).
    TransportClosed,
    /// Nothing arrived for `suspend_after`: link down, black hole or peer asleep.
    Silence,
    /// Bytes on the transport failed authentication or parsing; it was dropped.
    TransportError(Error),
    /// The client chose to move to a new transport (address change, `MOVE_TO`).
    Reconnecting,
}

/// How a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// We closed it with this code and the peer acknowledged (or never will).
    Local {
        /// The code we sent.
        code: u64,
    },
    /// The peer closed it.
    Peer {
        /// The peer's code (§10).
        code: u64,
        /// The peer's human-readable reason.
        reason: String,
    },
    /// An error ended it (expiry, a refusal, a protocol violation).
    Error(Error),
}

/// Something the application should know. Drain with `poll_event` after each
/// `handle_*` call.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The session is established and authenticated.
    Connected {
        /// The session's id on its server.
        session_id: SessionId,
        /// The peer's proven static key (client: record it for trust on first use).
        peer_key: PublicKey,
    },
    /// The session lost its transport; it stays resumable until `expires_at`.
    Suspended {
        /// Why.
        reason: SuspendReason,
        /// When it will expire unless resumed.
        expires_at: Instant,
    },
    /// Server: a resume that had reached this side ended before the
    /// client proved it live (its transport closed, or the handshake timed
    /// out), and no transport carries the session: it is still suspended,
    /// as it was before the attempt. An application that made the session
    /// ready for this resume (restored it from a continuation) may put it
    /// away again now rather than wait for the client.
    ResumeAbandoned,
    /// A new transport took over; unacknowledged frames are being replayed.
    Resumed {
        /// How long the session was without a transport.
        suspended_for: Duration,
        /// Reliable frames this side retransmits.
        frames_replayed: u64,
        /// Stream payload bytes among them.
        bytes_replayed: u64,
    },
    /// The peer came back from a different address.
    PeerAddressChanged {
        /// Its address on the previous transport.
        from: Option<SocketAddr>,
        /// Its address now.
        to: Option<SocketAddr>,
    },
    /// The caller should close this transport (after writing what was already polled).
    TransportClosed {
        /// Which one.
        transport: TransportId,
        /// The error that ended it, if any.
        error: Option<Error>,
    },
    /// The peer opened a stream; read its metadata with `stream_meta`.
    StreamOpened {
        /// The new stream.
        stream: StreamId,
    },
    /// New bytes or end-of-stream can be read.
    StreamReadable {
        /// Which stream.
        stream: StreamId,
    },
    /// The peer finished its direction of the stream (FIN received); reading
    /// reaches end-of-stream after the bytes still buffered.
    StreamFinished {
        /// Which stream.
        stream: StreamId,
    },
    /// A write that was refused for lack of buffer can be retried.
    StreamWritable {
        /// Which stream.
        stream: StreamId,
    },
    /// Everything we wrote on the stream, and our finish, reached the peer.
    StreamSendComplete {
        /// Which stream.
        stream: StreamId,
    },
    /// The stream was reset by the peer.
    StreamReset {
        /// Which stream.
        stream: StreamId,
        /// The peer's code.
        code: u64,
    },
    /// The server announced where else it can be reached (§9.1).
    AddressesUpdated {
        /// Addresses as `host:port` text.
        addrs: Vec<String>,
    },
    /// The server asks the client to resume at this address (§9.2).
    MoveRequested {
        /// `host:port`.
        addr: String,
    },
    /// Server: the client asks to be moved to another host (§9.4).
    MoveAsked {
        /// The host's name in the cluster; empty for "any".
        host: String,
    },
    /// The session is over; no further events follow except `TransportClosed`.
    Closed {
        /// Why.
        reason: CloseReason,
    },
}
