//! # roam — sessions that survive Wi-Fi drops, sleep and address changes (tokio layer)
//!
//! This crate drives the sans-IO [`roam_proto::Session`] over real TCP
//! connections. It is the async half of the rocks design (Zandy & Miller,
//! 2002): when a connection dies, the session suspends instead of failing; the
//! client re-dials (capped exponential backoff with jitter, and at once when
//! Linux reports a link or address change) and the session resumes, replaying
//! exactly the bytes the peer had not acknowledged. Applications see ordinary
//! byte streams ([`RoamStream`] implements `AsyncRead + AsyncWrite`).
//!
//! ## Design
//! - **One driver task per session** owns the session's TCP connections (the
//!   active one and, on a server, a resume candidate). It feeds received bytes
//!   to `handle_input`, writes what `poll_transmit` yields, dispatches
//!   `poll_event`, and sleeps until `poll_timeout`. Time is
//!   `tokio::time::Instant`, so paused-clock tests work.
//! - **Handles share the session** through one `Arc<Mutex<..>>`: a stream's
//!   `poll_write` copies straight into the session's send buffer and pokes the
//!   driver through a `Notify`; `poll_read` copies out of the receive buffer.
//!   The mutex is never held across an `.await`.
//! - **Backpressure** comes from the protocol: the driver asks for more
//!   records only once the previous ones were written to the socket, so
//!   unsent data stays in the session's bounded buffers and `poll_write`
//!   waits for `StreamWritable`.
//! - **Server**: [`serve`] takes an already-bound listener and a shutdown
//!   future. A semaphore caps concurrent connections (one over it is answered
//!   "busy" at once, within a small overflow); each connection's opening is
//!   routed by [`roam_proto::route_opening`] to a new session or, for a
//!   resume, to the driver that owns the named session; a session not live
//!   here is looked up in a [`Directory`] (a stored continuation, another
//!   host of the service, or nowhere). Sessions are
//!   capped overall, per source address and per client key
//!   ([`ServerConfig`]); [`ServerStats`] reports their use.
//!
//! Non-goals: running several transports of one session at once, UDP, and
//! anything but Linux for network-change notifications (elsewhere the client
//! relies on backoff alone).
//!
//! ## Example
//! ```no_run
//! # async fn demo() -> Result<(), roam::Error> {
//! use tokio::io::AsyncWriteExt;
//! let keypair = roam_proto::Keypair::generate()?;
//! let config = roam::ClientConfig::new(roam_proto::ClientConfig {
//!     keypair,
//!     server_trust: roam_proto::ServerTrust::FirstUse,
//!     session: Default::default(),
//! });
//! let session = roam::connect("relay.example:7447", config).await?;
//! let mut stream = session.open_stream(b"127.0.0.1:22")?;
//! stream.write_all(b"hello").await?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod client;
mod config;
mod detach;
mod driver;
mod error;
mod handle;
mod journal;
mod limits;
mod netwatch;
mod server;
mod sockopt;
mod stream;
mod tcpmem;
mod transport;

pub use client::{connect, connect_over, resume, resume_journaled};
pub use config::{ClientConfig, MovePolicy, ServerConfig};
pub use detach::{
    adoption_queue, Adopter, Adoption, Adoptions, Detached, Directory, LiveTransport, Locating,
    Location, LookupResult, OnInstalled, Restored,
};
pub use error::Error;
pub use handle::{SessionEvent, SessionHandle, SessionStats};
pub use journal::{JournalEntry, JournalWriter};
pub use limits::{LogThrottle, ServerStats, ServerUsage};
pub use netwatch::NetworkChanges;
pub use server::{serve, serve_with_directory, serve_with_restore};
pub use stream::{LendTarget, RoamStream};
pub use transport::{Listener, Transport, UNIX_PEER};

/// Re-exported so applications need not depend on `roam-proto` for common types.
pub use roam_proto::{CloseReason, Keypair, PublicKey, SessionId, State, StreamId, SuspendReason};
