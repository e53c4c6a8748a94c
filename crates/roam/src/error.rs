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
    /// A continuation could not be restored (not a client continuation,
    /// written by an incompatible roam, corrupted).
    Restore(roam_proto::RestoreError),
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

/// What a `CLOSE` code of the protocol's own means (PROTOCOL §10), for
/// messages; `None` for application codes and unknown ones.
fn close_code_meaning(code: u64) -> Option<&'static str> {
    use roam_proto::code;
    Some(match code {
        code::NO_ERROR => return None,
        code::UNAUTHORIZED => "this client's key is not authorized there",
        code::PROTOCOL_VIOLATION => "protocol violation",
        code::FLOW_CONTROL => "flow-control violation",
        code::INTERNAL => "internal error at the peer",
        code::STREAM_REFUSED => "too many streams",
        code::SERVER_BUSY => "the server is at one of its limits, try again later",
        _ => return None,
    })
}

/// Describes how a session ended, for messages.
pub(crate) fn describe_close(reason: &CloseReason) -> String {
    match reason {
        CloseReason::Local { code } => format!("session closed locally (code {code})"),
        CloseReason::Peer { code, reason } => {
            let what = match close_code_meaning(*code) {
                Some(m) => format!("peer closed the session: {m} (code {code})"),
                None => format!("peer closed the session (code {code})"),
            };
            if reason.is_empty() {
                what
            } else {
                format!("{what}: {reason}")
            }
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
            Error::Restore(e) => write!(f, "cannot restore the session: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Unreachable { source, .. } | Error::Io(source) => Some(source),
            Error::Protocol(e) => Some(e),
            Error::Stream(e) => Some(e),
            Error::Restore(e) => Some(e),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal reads as what it is, with the peer's reason; a plain or an
    /// application close keeps its number.
    #[test]
    fn close_messages_name_the_protocols_codes() {
        let busy = describe_close(&CloseReason::Peer {
            code: roam_proto::code::SERVER_BUSY,
            reason: "server busy: this client key already holds 2 sessions".into(),
        });
        assert_eq!(
            busy,
            "peer closed the session: the server is at one of its limits, try again later \
             (code 6): server busy: this client key already holds 2 sessions"
        );
        let bare = describe_close(&CloseReason::Peer {
            code: roam_proto::code::SERVER_BUSY,
            reason: String::new(),
        });
        assert!(bare.contains("at one of its limits") && bare.ends_with("(code 6)"));
        let app = describe_close(&CloseReason::Peer {
            code: 0x104,
            reason: String::new(),
        });
        assert_eq!(app, "peer closed the session (code 260)");
        let normal = describe_close(&CloseReason::Peer {
            code: 0,
            reason: "bye".into(),
        });
        assert_eq!(normal, "peer closed the session (code 0): bye");
    }
}
