//! Loopback ports for processes a test starts and must tell their port.
//!
//! The usual probe (bind port 0, read the port, close, hand it to the
//! child) races with every other port-0 bind on the machine: between the
//! close and the child's bind, the kernel may give the same port to another
//! test's listener or to an outgoing connection's source port, and the
//! child fails with "address in use". Ports below the kernel's ephemeral
//! range (`net.ipv4.ip_local_port_range`) are never handed out that way, so
//! a port picked at random there and found free stays free unless another
//! test picks the same one at random.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io;
use std::net::{Ipv4Addr, TcpListener};

/// Lowest port picked: below it live well-known and registered services.
const FLOOR: u16 = 10_000;
/// Random ports tried before falling back to a port-0 probe.
const TRIES: usize = 200;

/// A port on 127.0.0.1 that is free now: picked at random below the
/// ephemeral range (see the module's documentation), or, where that range
/// starts too low to leave room, from a port-0 probe.
pub fn free_loopback_port() -> io::Result<u16> {
    let low = ephemeral_low().unwrap_or(32_768);
    if low > FLOOR + 1_000 {
        let span = u64::from(low - FLOOR);
        let state = RandomState::new();
        for i in 0..TRIES {
            let port = FLOOR + (state.hash_one(i) % span) as u16;
            if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_low() -> Option<u16> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The port is free (a listener binds it) and below the ephemeral range,
    /// and two picks differ (they are random, not the kernel's next one).
    #[test]
    fn a_port_is_free_and_outside_the_ephemeral_range() {
        let low = ephemeral_low().unwrap_or(32_768);
        let ports: Vec<u16> = (0..8).map(|_| free_loopback_port().unwrap()).collect();
        for &p in &ports {
            if low > FLOOR + 1_000 {
                assert!((FLOOR..low).contains(&p), "{p} not in {FLOOR}..{low}");
            }
            let l = TcpListener::bind((Ipv4Addr::LOCALHOST, p)).expect("the port is free");
            drop(l);
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 1, "{ports:?}");
    }
}
