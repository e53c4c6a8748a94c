//! `roam shell`: a persistent interactive shell through the relay. The
//! client (`client`) runs the user's terminal in raw mode; the relay
//! (`host`, `roam serve --shell`) runs the shell on a pty and keeps it, with
//! its screen and scrollback, while clients come and go. `wire` is the
//! stream's format between them. `worker` is the per-session process
//! (`roam shell-worker`) that runs an attached shell's terminal.

mod account;
pub(crate) mod client;
pub(crate) mod host;
pub(crate) mod wire;
pub(crate) mod worker;
