//! Errors of the async layer. Protocol failures keep their `roam_proto::Error`
//! (whose `Display` says what happened and what to do).

use std::fmt;
use std::io;

use roam_proto::{CloseReason, StreamError};

/// Why a connect, a stream operation or a session failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The server could not be reached (name lookup or TCP connect failed).
    Unreachable {
        /// The address we dialed.
        addr: String,
        /// The operating system's error.
        source: io::Error,
    },
    /// The protocol failed or the peer refused: handshake, key mismatch,
    /// unauthorized key, not a roam server, unknown session, expiry.
    Protocol(roam_proto::Error),
    /// The session closed (by us, by the peer, or by an error).
    Closed(CloseReason),
    /// A stream operation failed.
    Stream(StreamError),
    /// Local I/O failed.
    Io(io::Error),
}

impl Error {
    /// The peer at the address does not run a roam server (it refused the TCP
    /// connection or answered in another protocol): a caller may fall back to
    /// plain TCP.
    pub fn is_no_roam_server(&self) -> bool {
        match self {
            Error::Unreachable { source, .. } => source.kind() == io::ErrorKind::ConnectionRefused,
            Error::Protocol(roam_proto::Error::NotRoam) => true,
            Error::Closed(CloseReason::Error(roam_proto::Error::NotRoam)) => true,
            _ => false,
        }
    }

    /// The protocol error behind this one, if any.
    pub fn protocol(&self) -> Option<&roam_proto::Error> {
        match self {
            Error::Protocol(e) | Error::Closed(CloseReason::Error(e)) => Some(e),
            _ => None,
        }
    }
}

/// Describes how a session ended, for messages.
pub(crate) fn describe_close(reason: &CloseReason) -> String {
    match reason {
        CloseReason::Local { code } => format!("session closed locally (code {code})"),
        CloseReason::Peer { code, reason } if reason.is_empty() => {
            format!("peer closed the session (code {code})")
        }
        CloseReason::Peer { code, reason } => {
            format!("peer closed the session (code {code}): {reason}")
        }
        CloseReason::Error(e) => e.to_string(),
        other => format!("session closed: {other:?}"),
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unreachable { addr, source } => write!(
                f,
                "cannot reach {addr}: {source}; check the host and port, and that `roam serve` runs there"
            ),
            Error::Protocol(e) => write!(f, "{e}"),
            Error::Closed(reason) => f.write_str(&describe_close(reason)),
            Error::Stream(e) => write!(f, "{e}"),
            Error::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Unreachable { source, .. } | Error::Io(source) => Some(source),
            Error::Protocol(e) => Some(e),
            Error::Stream(e) => Some(e),
            Error::Closed(_) => None,
        }
    }
}

impl From<roam_proto::Error> for Error {
    fn from(e: roam_proto::Error) -> Self {
        Error::Protocol(e)
    }
}

impl From<StreamError> for Error {
    fn from(e: StreamError) -> Self {
        Error::Stream(e)
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Io(e) => e,
            Error::Stream(e) => e.into(),
            Error::Unreachable { source, .. } => io::Error::new(source.kind(), source),
            other => io::Error::new(io::ErrorKind::ConnectionAborted, other),
        }
    }
}
