//! Errors, by family: the peer misbehaved, the peer is incompatible or refused
//! us, the application misused the API, the local system failed.
//!
//! Spec: `docs/PROTOCOL.md` §10 (error codes) and §4.2 (refusal statuses).

use std::fmt;

use crate::codec::DecodeError;
use crate::keys::PublicKey;

/// A session- or transport-level failure.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    // --- the peer misbehaved (or an attacker is on the path)
    /// A frame or handshake message was malformed.
    Decode(DecodeError),
    /// A record failed authentication: corrupted, injected, reordered or replayed bytes.
    Decrypt,
    /// The Noise handshake failed (bad message or keys).
    HandshakeFailed,
    /// The peer broke a protocol rule; the text names which.
    ProtocolViolation(&'static str),
    /// The peer sent more than the window we granted.
    FlowControl,

    // --- the peer is not compatible, or refused us
    /// The peer does not speak roam (e.g. an SSH server answered): fall back or give up.
    NotRoam,
    /// No protocol version in common.
    UnsupportedVersion,
    /// The server's static key is not the pinned one. Someone may be intercepting
    /// the connection, or the server's key was changed: check before trusting it.
    ServerKeyMismatch {
        /// The key pinned for this server.
        expected: PublicKey,
        /// The key the server proved it holds.
        actual: PublicKey,
    },
    /// The server does not accept our client key (not in its authorized keys).
    Unauthorized,
    /// The server holds no session with that id: it expired, was closed, or never existed.
    UnknownSession,
    /// A resume did not prove knowledge of the session's secret.
    ResumeRejected,
    /// A resume message was a copy of an earlier one.
    ReplayedResume,
    /// The server refused: at its session limit.
    ServerBusy,
    /// The peer refused with a status this version does not know.
    PeerRefused(u8),
    /// The session lives on another host of its service now: resume at this
    /// address (`host:port`, a `Moved` refusal, §9.3). Costs the transport,
    /// never the session.
    Moved(String),

    // --- lifetime
    /// The session stayed suspended longer than its resume timeout.
    Expired,

    // --- local
    /// The operating system's random source failed.
    Random,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Decode(e) => write!(f, "peer sent a malformed message: {e}"),
            Self::Decrypt => write!(f, "record failed authentication (corrupted or injected data)"),
            Self::HandshakeFailed => write!(f, "secure handshake failed"),
            Self::ProtocolViolation(what) => write!(f, "peer violated the protocol: {what}"),
            Self::FlowControl => write!(f, "peer exceeded its flow-control window"),
            Self::NotRoam => write!(f, "peer does not speak the roam protocol"),
            Self::UnsupportedVersion => write!(f, "no common roam protocol version"),
            Self::ServerKeyMismatch { expected, actual } => write!(
                f,
                "server key changed: pinned {expected}, server proved {actual}; someone may be \
                 intercepting the connection — if the server was re-keyed, update the known-servers file"
            ),
            Self::Unauthorized => write!(f, "server refused our client key (not in its authorized keys)"),
            Self::UnknownSession => {
                write!(f, "server does not know this session (expired, closed or restarted)")
            }
            Self::ResumeRejected => write!(f, "resume refused: wrong session secret"),
            Self::ReplayedResume => write!(f, "resume refused: replayed resume message"),
            Self::ServerBusy => write!(f, "server is at its session limit; try again later"),
            Self::PeerRefused(code) => write!(f, "peer refused the transport (status {code})"),
            Self::Moved(addr) => write!(f, "the session moved to {addr}; resuming there"),
            Self::Expired => write!(f, "session expired: suspended longer than its resume timeout"),
            Self::Random => write!(f, "the system random source failed"),
        }
    }
}

impl std::error::Error for Error {}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        Self::Decode(e)
    }
}

/// Misuse of a stream by the application, or a stream that can no longer be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamError {
    /// No such stream (never opened, or already fully closed and forgotten).
    UnknownStream,
    /// Writing after `finish`.
    Finished,
    /// The stream was reset; the code says by whom/why (§6.4).
    Reset(u64),
    /// The session is closed.
    SessionClosed,
    /// Too many open streams (the peer's limit, §6.5).
    TooManyStreams,
    /// Metadata longer than [`crate::frame::MAX_META_LEN`].
    MetaTooLong,
}

impl fmt::Display for StreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownStream => write!(f, "unknown stream"),
            Self::Finished => write!(f, "stream already finished for writing"),
            Self::Reset(code) => write!(f, "stream reset (code {code})"),
            Self::SessionClosed => write!(f, "session closed"),
            Self::TooManyStreams => write!(f, "too many open streams"),
            Self::MetaTooLong => write!(f, "stream metadata too long"),
        }
    }
}

impl std::error::Error for StreamError {}

impl From<StreamError> for std::io::Error {
    fn from(e: StreamError) -> Self {
        use std::io::ErrorKind;
        let kind = match e {
            StreamError::Reset(_) => ErrorKind::ConnectionReset,
            StreamError::Finished | StreamError::SessionClosed => ErrorKind::BrokenPipe,
            StreamError::UnknownStream | StreamError::MetaTooLong => ErrorKind::InvalidInput,
            StreamError::TooManyStreams => ErrorKind::WouldBlock,
        };
        std::io::Error::new(kind, e)
    }
}

/// Codes carried by `CLOSE` and `RESET` frames (§10). An open set: unknown
/// values from a newer peer are kept as numbers.
pub mod code {
    /// Normal close or reset, no error.
    pub const NO_ERROR: u64 = 0;
    /// The peer's key is not authorized.
    pub const UNAUTHORIZED: u64 = 1;
    /// A protocol rule was broken.
    pub const PROTOCOL_VIOLATION: u64 = 2;
    /// A flow-control window was exceeded.
    pub const FLOW_CONTROL: u64 = 3;
    /// The sender's internal failure.
    pub const INTERNAL: u64 = 4;
    /// Refused: too many streams.
    pub const STREAM_REFUSED: u64 = 5;
    /// The server is at one of its limits (e.g. sessions per client key);
    /// the reason says which. Try again later.
    pub const SERVER_BUSY: u64 = 6;
    /// First code free for applications; roam's relay uses a few (see the CLI docs).
    pub const APPLICATION_BASE: u64 = 0x100;
}
