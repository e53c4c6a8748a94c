//! Link and address change notifications from Linux (rtnetlink multicast
//! groups), so a suspended client re-dials the moment the network is back
//! instead of waiting out its backoff.
//!
//! One background thread per process blocks on a `NETLINK_ROUTE` socket
//! subscribed to `RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR` and
//! bumps a counter in a `watch` channel; every client driver subscribes. Where
//! netlink is unavailable (other systems, restricted sandboxes) this logs once
//! and clients rely on backoff alone.

use std::sync::OnceLock;

use tokio::sync::watch;

/// `RTMGRP_LINK`: interfaces going up or down.
const RTMGRP_LINK: u32 = 0x1;
/// `RTMGRP_IPV4_IFADDR`: IPv4 addresses added or removed.
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
/// `RTMGRP_IPV6_IFADDR`: IPv6 addresses added or removed.
const RTMGRP_IPV6_IFADDR: u32 = 0x100;

static WATCHER: OnceLock<Option<watch::Sender<u64>>> = OnceLock::new();

/// A subscription to the host's network changes.
#[derive(Debug, Clone)]
pub struct NetworkChanges {
    rx: watch::Receiver<u64>,
}

impl NetworkChanges {
    /// Subscribes, starting the process-wide watcher on first use. `None` if
    /// the system offers no netlink socket.
    pub fn subscribe() -> Option<Self> {
        let tx = WATCHER.get_or_init(start).as_ref()?;
        Some(Self { rx: tx.subscribe() })
    }

    /// Waits for the next change. Returns `false` if the watcher stopped (it
    /// will not report again).
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }
}

#[cfg(target_os = "linux")]
fn start() -> Option<watch::Sender<u64>> {
    use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

    let groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR;
    let socket = Socket::new(NETLINK_ROUTE).and_then(|mut s| {
        s.bind(&SocketAddr::new(0, groups))?;
        Ok(s)
    });
    let socket = match socket {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(
                "network change notifications unavailable ({e}); re-dialing on backoff only"
            );
            return None;
        }
    };
    let (tx, _) = watch::channel(0u64);
    let sender = tx.clone();
    let spawned = std::thread::Builder::new()
        .name("roam-netlink".into())
        .spawn(move || {
            let mut failures = 0u32;
            loop {
                match socket.recv_from_full() {
                    Ok(_) => {
                        failures = 0;
                        sender.send_modify(|n| *n += 1);
                    }
                    Err(e) => {
                        // ENOBUFS means we missed some messages: still a change.
                        sender.send_modify(|n| *n += 1);
                        failures += 1;
                        if failures > 100 {
                            tracing::warn!("network change watcher stopped: {e}");
                            return;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::info!("network change watcher not started ({e}); re-dialing on backoff only");
        return None;
    }
    Some(tx)
}

#[cfg(not(target_os = "linux"))]
fn start() -> Option<watch::Sender<u64>> {
    let _ = (RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR);
    tracing::info!("network change notifications are Linux-only; re-dialing on backoff only");
    None
}
