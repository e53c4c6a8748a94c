//! Link and address change notifications from Linux (rtnetlink multicast
//! groups), so a suspended client re-dials the moment the network is back
//! instead of waiting out its backoff.
//!
//! One background thread per process blocks on a `NETLINK_ROUTE` socket
//! subscribed to `RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR`,
//! bumps a counter and wakes every subscriber; every client driver
//! subscribes. Where netlink is unavailable (other systems, restricted
//! sandboxes) this logs once and clients rely on backoff alone.
//!
//! A subscription is polled ([`NetworkChanges::poll_changed`]) rather than
//! awaited through a channel's future: a driver waits on it in every
//! iteration, and a `watch` channel's `changed()` future (~130 bytes) sized
//! every client's driver task into the next 128-byte step of its
//! allocation, suspended sessions included. The subscriber's waker lives in
//! one slot of a process-wide table instead (16 bytes).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};

/// `RTMGRP_LINK`: interfaces going up or down.
const RTMGRP_LINK: u32 = 0x1;
/// `RTMGRP_IPV4_IFADDR`: IPv4 addresses added or removed.
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
/// `RTMGRP_IPV6_IFADDR`: IPv6 addresses added or removed.
const RTMGRP_IPV6_IFADDR: u32 = 0x100;

/// Whether the watcher thread started (tried once, at the first subscribe).
static STARTED: OnceLock<bool> = OnceLock::new();

/// What the watcher thread and every subscription share.
static WATCHER: Watcher = Watcher {
    version: AtomicU64::new(0),
    stopped: AtomicBool::new(false),
    slots: Mutex::new(Slots {
        wakers: Vec::new(),
        free: Vec::new(),
    }),
};

/// The state behind [`WATCHER`].
struct Watcher {
    /// Changes seen so far.
    version: AtomicU64,
    /// The thread stopped: nothing is reported any more.
    stopped: AtomicBool,
    /// The subscriptions' wakers, by slot.
    slots: Mutex<Slots>,
}

/// The wakers of the subscriptions, each in the slot it got at subscribe.
struct Slots {
    /// A waker per slot (`None`: not polled yet, or a free slot).
    wakers: Vec<Option<Waker>>,
    /// Slots given back by dropped subscriptions, reused first.
    free: Vec<usize>,
}

impl Watcher {
    /// The table, even if a holder panicked (wakers stay valid).
    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A subscription starting from the current count.
    fn subscribe(&self) -> NetworkChanges {
        let mut slots = self.slots();
        let slot = match slots.free.pop() {
            Some(slot) => slot,
            None => {
                slots.wakers.push(None);
                slots.wakers.len() - 1
            }
        };
        NetworkChanges {
            seen: self.version.load(Ordering::Acquire),
            slot,
        }
    }

    /// Counts a change (or, with `stop`, the end) and wakes every subscriber.
    fn report(&self, stop: bool) {
        if stop {
            self.stopped.store(true, Ordering::Release);
        } else {
            self.version.fetch_add(1, Ordering::AcqRel);
        }
        for w in self.slots().wakers.iter().flatten() {
            w.wake_by_ref();
        }
    }
}

/// A subscription to the host's network changes.
pub struct NetworkChanges {
    /// The change count this subscription has reported up to.
    seen: u64,
    /// Its slot in the watcher's waker table.
    slot: usize,
}

impl std::fmt::Debug for NetworkChanges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetworkChanges")
            .field("seen", &self.seen)
            .finish_non_exhaustive()
    }
}

impl Clone for NetworkChanges {
    /// A subscription of its own, at the same point.
    fn clone(&self) -> Self {
        let mut other = WATCHER.subscribe();
        other.seen = self.seen;
        other
    }
}

impl Drop for NetworkChanges {
    fn drop(&mut self) {
        let mut slots = WATCHER.slots();
        slots.wakers[self.slot] = None;
        slots.free.push(self.slot);
    }
}

impl NetworkChanges {
    /// Subscribes, starting the process-wide watcher on first use. `None` if
    /// the system offers no netlink socket.
    pub fn subscribe() -> Option<Self> {
        STARTED.get_or_init(start).then(|| WATCHER.subscribe())
    }

    /// Waits for the next change. Returns `false` if the watcher stopped (it
    /// will not report again).
    pub async fn changed(&mut self) -> bool {
        std::future::poll_fn(|cx| self.poll_changed(cx)).await
    }

    /// [`changed`](Self::changed) as a poll: `Ready(true)` once the network
    /// changed since the last `Ready`, `Ready(false)` if the watcher stopped;
    /// otherwise the task in `cx` is woken at the next change.
    pub fn poll_changed(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        if let Some(ready) = self.check() {
            return Poll::Ready(ready);
        }
        {
            let mut slots = WATCHER.slots();
            let slot = &mut slots.wakers[self.slot];
            if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *slot = Some(cx.waker().clone());
            }
        }
        // A change between the check and the registration woke nobody.
        match self.check() {
            Some(ready) => Poll::Ready(ready),
            None => Poll::Pending,
        }
    }

    /// `Some(true)`: a change not reported yet (now reported);
    /// `Some(false)`: the watcher stopped; `None`: nothing new.
    fn check(&mut self) -> Option<bool> {
        let now = WATCHER.version.load(Ordering::Acquire);
        if now != self.seen {
            self.seen = now;
            return Some(true);
        }
        WATCHER.stopped.load(Ordering::Acquire).then_some(false)
    }
}

#[cfg(target_os = "linux")]
fn start() -> bool {
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
            return false;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("roam-netlink".into())
        .spawn(move || {
            let mut failures = 0u32;
            loop {
                match socket.recv_from_full() {
                    Ok(_) => {
                        failures = 0;
                        WATCHER.report(false);
                    }
                    Err(e) => {
                        // ENOBUFS means we missed some messages: still a change.
                        WATCHER.report(false);
                        failures += 1;
                        if failures > 100 {
                            tracing::warn!("network change watcher stopped: {e}");
                            WATCHER.report(true);
                            return;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::info!("network change watcher not started ({e}); re-dialing on backoff only");
        return false;
    }
    true
}

#[cfg(not(target_os = "linux"))]
fn start() -> bool {
    let _ = (RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR);
    tracing::info!("network change notifications are Linux-only; re-dialing on backoff only");
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// What a client driver relies on: a change wakes a subscriber that is
    /// waiting, every subscription reports it exactly once, and a dropped
    /// subscription gives its slot back (its waker does not stay behind).
    #[tokio::test]
    async fn a_change_wakes_each_subscriber_once_and_dropping_frees_the_slot() {
        let mut first = WATCHER.subscribe();
        let mut second = first.clone();
        let second_slot = second.slot;
        assert_ne!(first.slot, second_slot, "a clone has a slot of its own");
        let waiting = tokio::spawn(async move {
            let changed = second.changed().await;
            (changed, second)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "woken without a change");

        WATCHER.report(false);
        let (changed, mut second) = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the change did not wake the waiting subscriber")
            .expect("the waiting task failed");
        assert!(changed);

        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert_eq!(first.poll_changed(&mut cx), Poll::Ready(true));
        assert_eq!(first.poll_changed(&mut cx), Poll::Pending, "reported twice");
        assert_eq!(
            second.poll_changed(&mut cx),
            Poll::Pending,
            "reported twice"
        );

        drop(second);
        let slots = WATCHER.slots();
        assert!(slots.free.contains(&second_slot));
        assert!(slots.wakers[second_slot].is_none());
    }
}
