//! Test support for roam.
//!
//! - [`net`]: a seeded, deterministic network simulator that drives two
//!   sans-IO sessions under simulated time through delay, transport kills,
//!   black holes, partitions and address changes.
//! - [`proxy`]: a loopback TCP fault proxy for tests over real sockets.
//! - [`ports`]: free loopback ports for the processes a test starts.
//! - [`echo`]: a real echo server in a namespace and a client that checks
//!   every byte through it (for tests that move processes).

pub mod echo;
pub mod net;
pub mod netns;
pub mod ports;
pub mod proxy;
pub mod sshd;
pub mod workload;
