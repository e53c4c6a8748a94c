//! The server endpoint's routing decision (`docs/PROTOCOL.md` §4.2): what
//! the opening bytes of an incoming transport ask for.
//!
//! Every server — the tokio layer, the simulator, the fuzz harness, the
//! benchmarks — reads a transport's first bytes and must decide: wait for
//! more, start a new session, hand the transport to the session a resume
//! names, or refuse. [`route_opening`] is that decision, once; where a named
//! session lives (here and live, stored, on another host, nowhere) is the
//! caller's directory and is not decided here. [`Hello::refusal`] and
//! [`Hello::redirect`] build the answers.

use crate::handshake::{parse_hello, Hello};
use crate::keys::SessionId;
use crate::Error;

/// Largest opening accepted before the hello parses (bytes). Real ones are
/// under 100; more than this is not a roam client.
pub const MAX_OPENING: usize = 4096;

/// What a transport's opening bytes ask for ([`route_opening`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Opening {
    /// Not a whole hello yet: read more and ask again with all the bytes.
    Incomplete,
    /// A new session. `used` bytes were the hello; the rest belong to the
    /// handshake that follows (feed them to the session's transport).
    New {
        /// The parsed hello, for [`crate::Session::accept`].
        hello: Hello,
        /// Bytes of the buffer the hello took.
        used: usize,
    },
    /// A resume of session `id`: find it, then
    /// [`crate::Session::accept_resume`] — or answer
    /// [`Hello::refusal`] / [`Hello::redirect`].
    Resume {
        /// The session the client names.
        id: SessionId,
        /// The parsed hello.
        hello: Hello,
        /// Bytes of the buffer the hello took.
        used: usize,
    },
    /// Refuse the transport: write `reply` (empty when the peer is not a
    /// roam client at all, §4.2) and close it.
    Refuse {
        /// Why, for the server's log.
        error: Error,
        /// The bytes to answer with, possibly none.
        reply: Vec<u8>,
    },
}

/// Decides what the opening bytes in `buf` (everything received on the
/// transport so far) ask for. A server calls it after each read until the
/// answer is not [`Opening::Incomplete`]. A hello offering no version this
/// server speaks is refused here with status 1; a hello that does not fit in
/// [`MAX_OPENING`] bytes, bad magic or an unknown kind are refused without a
/// reply.
pub fn route_opening(buf: &[u8]) -> Opening {
    if buf.is_empty() {
        return Opening::Incomplete;
    }
    let (hello, used) = match parse_hello(buf) {
        Ok(Some(h)) => h,
        Ok(None) if buf.len() < MAX_OPENING => return Opening::Incomplete,
        Ok(None) => {
            return Opening::Refuse {
                error: Error::ProtocolViolation("opening too long"),
                reply: Vec::new(),
            }
        }
        Err(error) => {
            return Opening::Refuse {
                error,
                reply: Vec::new(),
            }
        }
    };
    if !hello.version_supported() {
        let reply = hello.refusal(&Error::UnsupportedVersion);
        return Opening::Refuse {
            error: Error::UnsupportedVersion,
            reply,
        };
    }
    match hello.resume_session() {
        None => Opening::New { hello, used },
        Some(id) => Opening::Resume { id, hello, used },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClientConfig, Keypair, ServerTrust, Session, Status};
    use std::time::Instant;

    fn client_opening() -> Vec<u8> {
        let mut c = Session::client(ClientConfig {
            keypair: Keypair::generate().unwrap(),
            server_trust: ServerTrust::FirstUse,
            session: crate::Config::default(),
        });
        let now = Instant::now();
        c.connect(now, None).unwrap();
        let mut out = Vec::new();
        while c.poll_transmit(now, &mut out).is_some() {}
        out
    }

    #[test]
    fn every_prefix_of_a_hello_is_incomplete_then_new() {
        let hello = client_opening();
        for n in 0..hello.len() {
            assert!(
                matches!(route_opening(&hello[..n]), Opening::Incomplete),
                "prefix of {n} bytes"
            );
        }
        let mut more = hello.clone();
        more.extend_from_slice(b"next");
        match route_opening(&more) {
            Opening::New { used, .. } => assert_eq!(used, hello.len()),
            other => panic!("expected a new session, got {other:?}"),
        }
    }

    #[test]
    fn not_roam_and_overlong_openings_are_refused_silently() {
        for bad in [&b"SSH-2.0-OpenSSH_9.6\r\n"[..], b"X", b"ROAM\x01\x01\x09"] {
            match route_opening(bad) {
                Opening::Refuse { reply, .. } => assert!(reply.is_empty(), "{bad:?}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        // A handshake message longer than any real one is refused before
        // it has arrived, so no opening can grow to MAX_OPENING.
        let mut long = b"ROAM\x01\x01\x01".to_vec();
        long.extend_from_slice(&2000u16.to_be_bytes());
        match route_opening(&long) {
            Opening::Refuse { error, reply } => {
                assert!(reply.is_empty());
                assert_eq!(
                    error,
                    Error::ProtocolViolation("handshake message too long")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unsupported_version_is_refused_with_status_1() {
        let mut hello = client_opening();
        hello[4] = 7; // min_version
        hello[5] = 9; // max_version
        match route_opening(&hello) {
            Opening::Refuse { error, reply } => {
                assert_eq!(error, Error::UnsupportedVersion);
                assert_eq!(
                    reply,
                    [b'R', b'O', b'A', b'M', 0, Status::UnsupportedVersion as u8]
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
