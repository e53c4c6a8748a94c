//! # roam-service — a session's continuation across a service's processes
//!
//! A real service is rarely one process: a front-end talks to back-ends
//! over pipes, Unix sockets and TCP. Moving one client's session to another
//! server means moving a *consistent cut* of all of them. This crate is the
//! sans-IO core of *service continuations* (Sultan, Bohra, Iftode, "Service
//! Continuations: An Operating System Mechanism for Dynamic Migration of
//! Internet Service Sessions", §3-§6), in today's form: no sockets, no
//! clock, no tokio. A tokio layer feeds it bytes and sends what it says.
//!
//! | Paper (§3.3) | Here |
//! |---|---|
//! | `associate(cont, ch_set)` | a [`WriteEnd`] or [`ReadEnd`] per channel the process uses, gathered in its [`Process`] |
//! | `export_state(cont, snap)` | [`Process::export`]: the snapshot and every channel's position, atomically |
//! | `export_state` with an NDI flag | [`Interval::Nondeterministic`]: output held back until the next export |
//! | `import_state(cont)` | [`Process::snapshot`] of a process restarted by [`Cut::resume`] |
//! | the OS's channel logs | a reader's log of what it read since its last export ([`ReadEnd`]); a writer's unsent bytes ([`WriteEnd`]) |
//! | the SC itself | [`Cut`]: every process's [`Part`], encoded with [`Cut::encode`] / [`Cut::decode`] (`docs/SERVICE.md`) |
//!
//! ## Design
//! - **Channels are unidirectional byte streams** with a [`WriteEnd`] in one
//!   process and a [`ReadEnd`] in another; a socket is two channels.
//!   Positions count bytes from the channel's start.
//! - **A process exports** its snapshot (opaque bytes) and, at the same
//!   instant, each channel's position: a writer's `lsw` (the first byte it
//!   will write after the snapshot), a reader's `lsr` (the first byte it will
//!   read). A reader then forgets what it read before `lsr`: the log holds
//!   only what was read since the last export, plus what was received and
//!   not read yet.
//! - **At a move** ([`Cut::resume`]), each channel restarts at
//!   `resume = max(lsr, lsw)`. If the reader was behind (`lsr < lsw`), the
//!   bytes `[lsr, lsw)` the writer will not write again come from the
//!   reader's log (or from the writer's unsent bytes) and are read again; if
//!   the reader was ahead (`lsr > lsw`), the writer's replay of
//!   `[lsw, lsr)` is discarded (*write discard*). Every byte after `resume`
//!   is written again by the writer's replay from its snapshot, so it is
//!   not carried.
//! - **Nondeterministic intervals** (§4): after an export that announces
//!   one, the writer's output is held back until its next export, because a
//!   replay from the snapshot might write different bytes. What was held
//!   becomes safe at that export: it lies before the new `lsw`.
//! - **Bounds.** A reader's log and a writer's held and unsent bytes have
//!   caps ([`Limits`]). A log over its cap does not stop the process; it
//!   makes the cut fail with [`Error::LogOverflow`] until the next export
//!   trims it, so a move is refused rather than state corrupted.
//! - **A cut is checked whole** before anything restarts: every channel must
//!   have both ends in the cut, and the reader must have taken in every byte
//!   the writer sent up to `resume` ([`Error::Undrained`]). The tokio layer
//!   freezes the processes, drains each channel into its reader, then cuts.
//!
//! Non-goals: asynchronous signals (the paper's §5.1 limit), channels with
//! one end outside the service set (a database connection is reconnected
//! by its process, which learns its transaction's fate from the database),
//! and the client's connection, which the roam session protocol carries.

#![forbid(unsafe_code)]

mod channel;
mod codec;
mod cut;
mod error;

pub use channel::{ChannelId, Interval, Limits, ReadEnd, ReaderState, WriteEnd, WriterState};
pub use cut::{Cut, Part, Process};
pub use error::Error;
