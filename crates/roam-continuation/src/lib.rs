//! # roam-continuation — let go of a disconnected client, pick it up again
//!
//! A roam server keeps a suspended session resumable, but by default it
//! keeps it *in memory*: a driver task, the session's buffers, and whatever
//! the application holds for it. This crate lets a server let go of a
//! disconnected session entirely — no task, no socket, no buffers — and pick
//! it up again, exactly where it was, when the client comes back, even if
//! the server process was restarted in between. It follows *session
//! continuations* (Snoeren et al., "Suspending and Resuming Network
//! Applications Using Session Continuations"), in today's form:
//!
//! | Paper (Table I) | Here |
//! |---|---|
//! | `store`, `retrieve`, `store_size` | [`ManagedSession::store`], [`retrieve`](ManagedSession::retrieve), [`store_size`](ManagedSession::store_size), [`remove`](ManagedSession::remove) |
//! | `export` | [`ManagedSession::export`]: sent to the peer on each resume on a `roam/attrs` stream ([`attrs`]) |
//! | `register_handler` | [`ManagedSession::on_suspended`], [`on_resumed`](ManagedSession::on_resumed) |
//! | `register_attach_handler` | [`Service::on_attach`] |
//! | `freeze` | [`ManagedSession::freeze_requested`], [`Host::freeze`] |
//! | `return_cont` | [`ManagedSession::suspend`] with a [`Continuation`] (routine by name, streams by name) |
//! | `register_compat_vector`, `compat_store` | [`Service::property`], [`ManagedSession::require`] |
//! | expiration, garbage collection | [`Service::expiry`], [`ManagedSession::set_expiry`], [`Service::on_discard`] |
//! | session dependencies | [`ManagedSession::depend_on`] |
//!
//! ## Design
//! - **Internal continuations.** When roam wants a session's continuation
//!   ([`FreezeReason`]), the application's task for that session answers at
//!   its next quiescent point with [`ManagedSession::suspend`]: the
//!   attributes it stored, the name of the routine to resume with, and the
//!   streams to carry over. The task then ends. When the client resumes, the
//!   host restores the session and spawns the service's routine with a
//!   [`Resumed`] context (the session, its attributes, its streams).
//! - **Eager or lazy** ([`Generation`]): ask at the moment the transport is
//!   lost, or let the application run through the disconnection and ask
//!   only after a threshold or when resources must be reclaimed.
//! - **Resource continuations.** `suspend` takes the session out of its roam
//!   driver (`roam::SessionHandle::detach`): the socket and the driver task
//!   are gone; the session's protocol state (keys, offsets, unacknowledged
//!   and unread data, `docs/PROTOCOL.md` §13) and the attributes become one
//!   record. It is written at once, zstd-compressed, and kept in memory
//!   only for `offload_after` (fast same-process resumes), then only on disk.
//! - **Persistence.** Records live in an embedded redb database under the
//!   state directory ([`store`]): one durable write transaction per change,
//!   group-committed, file mode 0600 (records hold resume secrets). A
//!   process that exits or crashes after a session was suspended is
//!   restarted on the same state directory and resumes it
//!   ([`HostBuilder::open`] loads what the store holds).
//! - **Routing.** The host serves with `roam::serve_with_restore`: a resume
//!   naming a session that roam does not hold asks the host, which restores
//!   the continuation (checking integrity, expiry and compatibility) and
//!   installs it. A continuation is deleted before its session moves on:
//!   it is valid only as the latest state of its session.
//! - **Garbage collection.** One collector task per host discards expired
//!   continuations (per-service default, per-session override, capped by the
//!   protocol's resume timeout) and calls [`Service::on_discard`]. Nothing is
//!   left behind when a client never returns.
//! - **Dependencies.** A session may depend on another: when the parent is
//!   suspended the child is asked for its continuation; when the parent is
//!   discarded or closes, the child goes too.
//! - **Compatibility vectors.** A continuation records the properties it
//!   needs (always the service's `version`); a host whose service lacks or
//!   differs in one refuses the resume ([`Incompatible`] names the property,
//!   the required and the found value) and keeps the continuation until it
//!   expires; the client is told "busy, retry later".
//! - **Corruption** of a stored entry (checksums on meta and body, zstd
//!   frame checksum, and the protocol blob's own SHA-256) is reported, the
//!   entry moved to a quarantine table, and never resumed.
//!
//! - **Clusters** ([`cluster`]): hosts of one service move live sessions
//!   between them mid-stream (`docs/PROTOCOL.md` §14): compatibility check,
//!   attribute pre-copy, `MOVE_TO`, the application's continuation, a delta
//!   transfer over Noise IK between host keys listed in a cluster file,
//!   commit or abort. [`Host::move_session`], [`Host::drain`],
//!   [`Host::shed`] (load shedding), [`Host::serve_peers`] (the cluster
//!   port, also for `roam cluster`).
//!
//! Non-goals: complete continuations (restarting an application process per
//! session) and client-side continuations (a client that restarts). The client side needs
//! nothing from this crate except, optionally, [`read_attrs`].
//!
//! ## Example
//! See [`Host`] for a server; `examples/` has two complete ones with
//! clients: `bench_server` (numbered updates, the paper's benchmark) and
//! `stream_server` (an Icecast-like broadcast whose listeners' positions are
//! their continuations).

#![forbid(unsafe_code)]

pub mod attrs;
pub mod cluster;
mod compat;
mod error;
mod host;
pub mod record;
mod service;
pub mod service_set;
mod session;
pub mod store;

pub use attrs::{read_attrs, AttrError, ReadAttrsError, ATTRS_META};
pub use cluster::config::ClusterConfig;
pub use cluster::{ClusterIdentity, DrainReport, MoveError, MoveReport, ShedPolicy};
pub use error::{DiscardReason, Error, Incompatible, SuspendError};
pub use host::{CorruptEntry, Discarded, Host, HostBuilder, HostConfig, HostStats, OpenReport};
pub use service::{Generation, Service, DEFAULT_EXPIRY};
pub use session::{Continuation, FreezeReason, ManagedSession, Resumed, SuspendReport};
pub use store::{Store, StoreError};
