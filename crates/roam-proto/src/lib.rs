//! # roam-proto — the sans-IO core of the roam session protocol
//!
//! roam keeps a set of byte streams alive while the transports under them come
//! and go: a TCP connection may be reset, black-holed for days, or replaced by
//! a new one from another address at either end, and every stream carries on
//! exactly once, in order. This crate is the whole protocol — handshake,
//! encryption, framing, streams, flow control, heartbeats, suspension, resume,
//! close — with no sockets, no clock and no async runtime. The wire format is
//! specified in `docs/PROTOCOL.md`; each module names the sections it implements.
//!
//! Design (after rocks, Zandy & Miller 2002, and the session layer of
//! Sultan et al.'s migratory continuations):
//! - every frame that matters (stream open/data/fin/reset, window updates,
//!   close) is numbered by one session-wide sequence and kept until the peer
//!   acknowledges it, so a resume is "send from the peer's count" — one number
//!   each way however many streams are open (§7);
//! - stream payload lives once, in the stream's send buffer; the log refers to
//!   it by offset, and records are sealed in place (§3);
//! - a new session is a Noise XX handshake (both sides prove static keys); a
//!   resume is a Noise NNpsk0 handshake keyed by a per-session secret, so only
//!   its holder can resume and no recorded resume can be replayed (§4, §12).
//!
//! Non-goals: datagrams, 0-RTT data, multipath use of several transports at once.
//!
//! Entry points: [`Session`] for both roles, [`route_opening`] for a server's
//! incoming transports, [`ClientConfig`]/[`ServerConfig`] for identities.

#![forbid(unsafe_code)]

pub mod codec;
mod config;
pub mod endpoint;
mod error;
mod event;
pub mod frame;
mod handshake;
mod keys;
pub mod record;
mod session;
mod stream;
// The cryptographic primitives. cargo-fuzz builds with `--cfg fuzzing`, and
// only then the cheap stand-ins replace them (see `suite_fuzzing.rs`).
#[cfg_attr(fuzzing, path = "suite_fuzzing.rs")]
mod suite;

pub use config::{ClientConfig, Config, ServerConfig, ServerTrust};
pub use endpoint::{route_opening, Opening};
pub use error::{code, Error, StreamError};
pub use event::{CloseReason, Event, SuspendReason, TransportId};
pub use handshake::{parse_hello, Hello, Params, Status, MAGIC, MAX_MOVED_ADDR, VERSION};
pub use keys::{KeyParseError, Keypair, PublicKey, SessionId};
pub use session::envelope;
pub use session::SEND_BUFFER_GROWTH;
pub use session::{ExportError, Lent, RestoreError, Role, Session, State, Stats, StreamProgress};
pub use stream::StreamId;

/// Whether this build replaced the cryptography with fuzzing stand-ins.
///
/// Always `false` except in a `cfg(fuzzing)` build (cargo-fuzz), where records
/// and handshakes keep every check but use cheap, insecure primitives so the
/// fuzzer reaches the session state machine at once. A build that returns
/// `true` here must never talk to anything real.
pub fn fuzzing_mode() -> bool {
    suite::FUZZING
}

/// Fills `buf` from the operating system's random source.
pub(crate) fn random_bytes(buf: &mut [u8]) -> Result<(), Error> {
    getrandom::fill(buf).map_err(|_| Error::Random)
}
