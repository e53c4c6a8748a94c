//! A server's admission limits at run time: who holds how many sessions, and
//! a log throttle so that an attacker cannot turn refusals into a log storm.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use roam_proto::PublicKey;
use tokio::sync::Semaphore;

/// Live usage of a server's limits, shared between the server and whoever
/// wants to report it (e.g. a status command).
///
/// Create one, keep a clone, and put it in [`crate::ServerConfig::stats`]
/// before calling [`crate::serve`]; [`ServerStats::usage`] then reads the
/// running server's counts. A fresh one reads all zeros.
#[derive(Clone, Default)]
pub struct ServerStats {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ServerStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerStats")
            .field("usage", &self.usage())
            .finish()
    }
}

#[derive(Default)]
struct Shared {
    counts: Mutex<Counts>,
    /// The connection semaphore of the running server and its size.
    connections: Mutex<Option<(Arc<Semaphore>, usize)>>,
}

/// Session counts, kept under one lock so that a check and its increment
/// cannot race.
#[derive(Default)]
struct Counts {
    sessions: usize,
    per_ip: HashMap<IpAddr, usize>,
    per_key: HashMap<PublicKey, usize>,
    /// Connections beyond the cap currently being answered "busy".
    busy_answering: usize,
    /// Refusals since the server started, by reason ([`ServerUsage::refused`]).
    refused: std::collections::BTreeMap<&'static str, u64>,
}

impl Counts {
    fn refuse(&mut self, why: &'static str) {
        *self.refused.entry(why).or_default() += 1;
    }
}

/// A snapshot of a server's usage (see [`ServerStats::usage`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerUsage {
    /// TCP connections being handled (each holds one of `max_connections`).
    pub connections: usize,
    /// Connections beyond the cap being answered "busy" right now.
    pub busy_answering: usize,
    /// Sessions held, handshaking and suspended ones included.
    pub sessions: usize,
    /// The source address holding the most sessions, and how many.
    pub top_ip: Option<(IpAddr, usize)>,
    /// The client key holding the most sessions, and how many.
    pub top_key: Option<(PublicKey, usize)>,
    /// Connections and sessions refused since the server started, by
    /// reason: `connections` (over `max_connections`, answered busy),
    /// `connections_dropped` (over that too, closed at once), `sessions`
    /// (`max_sessions`), `per_ip`, `per_key`, `unauthorized` (a key not in
    /// the authorized keys).
    pub refused: std::collections::BTreeMap<&'static str, u64>,
}

/// Why a new session was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// At `max_sessions`.
    Sessions(usize),
    /// At `max_sessions_per_ip` for the source address.
    PerIp(usize),
}

impl ServerStats {
    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.shared.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current usage.
    pub fn usage(&self) -> ServerUsage {
        let connections = self
            .shared
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, |(sem, max)| max.saturating_sub(sem.available_permits()));
        let c = self.counts();
        ServerUsage {
            connections,
            busy_answering: c.busy_answering,
            sessions: c.sessions,
            top_ip: c
                .per_ip
                .iter()
                .max_by_key(|(ip, n)| (**n, std::cmp::Reverse(**ip)))
                .map(|(ip, n)| (*ip, *n)),
            top_key: c
                .per_key
                .iter()
                .max_by_key(|(k, n)| (**n, std::cmp::Reverse(**k)))
                .map(|(k, n)| (*k, *n)),
            refused: c.refused.clone(),
        }
    }

    /// The server's connection semaphore, so that [`Self::usage`] can count it.
    pub(crate) fn set_connection_limit(&self, sem: Arc<Semaphore>, max: usize) {
        *self
            .shared
            .connections
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((sem, max));
    }

    /// Takes a session slot for a new session from `ip`, unless that would
    /// pass `max_sessions` or `max_per_ip` (checked before any cryptography).
    pub(crate) fn admit(
        &self,
        ip: Option<IpAddr>,
        max_sessions: usize,
        max_per_ip: usize,
    ) -> Result<SessionSlot, Refusal> {
        let mut c = self.counts();
        if c.sessions >= max_sessions {
            c.refuse("sessions");
            return Err(Refusal::Sessions(max_sessions));
        }
        if let Some(ip) = ip {
            let n = c.per_ip.entry(ip).or_insert(0);
            if *n >= max_per_ip {
                c.refuse("per_ip");
                return Err(Refusal::PerIp(max_per_ip));
            }
            *n += 1;
        }
        c.sessions += 1;
        Ok(SessionSlot {
            stats: self.clone(),
            ip,
            key: None,
        })
    }

    /// A slot for a session that was admitted elsewhere (a restored
    /// continuation): counted, never refused.
    pub(crate) fn slot_unchecked(&self) -> SessionSlot {
        self.counts().sessions += 1;
        SessionSlot {
            stats: self.clone(),
            ip: None,
            key: None,
        }
    }

    /// Counts one connection being answered "busy" if fewer than `max` are;
    /// the guard uncounts it.
    pub(crate) fn busy_slot(&self, max: usize) -> Option<BusySlot> {
        let mut c = self.counts();
        if c.busy_answering >= max {
            c.refuse("connections_dropped");
            return None;
        }
        c.refuse("connections");
        c.busy_answering += 1;
        Some(BusySlot {
            stats: self.clone(),
        })
    }
}

/// Decrements a count in a map, removing the entry at zero so the map only
/// holds current holders.
fn release<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, k: &K) {
    if let Some(n) = map.get_mut(k) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(k);
        }
    }
}

/// One session's place in the counts; released when dropped (the session's
/// driver ends).
pub(crate) struct SessionSlot {
    stats: ServerStats,
    ip: Option<IpAddr>,
    key: Option<PublicKey>,
}

impl SessionSlot {
    /// Counts the session's refusal because its key is not authorized.
    pub(crate) fn note_unauthorized(&self) {
        self.stats.counts().refuse("unauthorized");
    }

    /// Records the client's static key once the handshake revealed it, unless
    /// the key already holds `max_per_key` sessions (then returns that count).
    pub(crate) fn set_key(&mut self, key: PublicKey, max_per_key: usize) -> Result<(), usize> {
        if self.key.is_some() {
            return Ok(());
        }
        let mut c = self.stats.counts();
        let n = c.per_key.entry(key).or_insert(0);
        if *n >= max_per_key {
            let held = *n;
            if held == 0 {
                c.per_key.remove(&key);
            }
            c.refuse("per_key");
            return Err(held);
        }
        *n += 1;
        drop(c);
        self.key = Some(key);
        Ok(())
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        let mut c = self.stats.counts();
        c.sessions = c.sessions.saturating_sub(1);
        if let Some(ip) = self.ip {
            release(&mut c.per_ip, &ip);
        }
        if let Some(k) = self.key {
            release(&mut c.per_key, &k);
        }
    }
}

/// A connection being answered "busy"; uncounted when dropped.
pub(crate) struct BusySlot {
    stats: ServerStats,
}

impl Drop for BusySlot {
    fn drop(&mut self) {
        let mut c = self.stats.counts();
        c.busy_answering = c.busy_answering.saturating_sub(1);
    }
}

/// Lets a repeated log line through at most once per interval and counts
/// what it held back, so that a flood (accept errors, refusals) costs one
/// line per interval instead of one per event.
#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogThrottle {
    /// A throttle letting one line through per `every`.
    pub const fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// Whether to log now. `Some(n)`: log, and say that `n` similar events
    /// were not logged since the last line. `None`: stay quiet (counted).
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// A shared [`LogThrottle`] usable from many tasks.
#[derive(Debug)]
pub(crate) struct SharedThrottle(Mutex<LogThrottle>);

impl SharedThrottle {
    /// One line per `every`.
    pub(crate) const fn new(every: Duration) -> Self {
        Self(Mutex::new(LogThrottle::new(every)))
    }

    /// See [`LogThrottle::allow`].
    pub(crate) fn allow(&self) -> Option<u64> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allow(Instant::now())
    }
}

/// " (N similar not logged)" when `n` > 0, for appending to a throttled line.
pub(crate) fn suppressed_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} similar events in the last interval not logged)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_lets_one_line_per_interval_and_counts_the_rest() {
        let mut t = LogThrottle::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(t.allow(t0), Some(0));
        for i in 1..=5 {
            assert_eq!(t.allow(t0 + Duration::from_secs(i)), None);
        }
        assert_eq!(t.allow(t0 + Duration::from_secs(10)), Some(5));
        assert_eq!(t.allow(t0 + Duration::from_secs(11)), None);
    }

    #[test]
    fn slots_count_and_release_per_ip_and_per_key() {
        let stats = ServerStats::default();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let a = stats.admit(Some(ip), 10, 2).unwrap();
        let mut b = stats.admit(Some(ip), 10, 2).unwrap();
        assert_eq!(stats.admit(Some(ip), 10, 2).err(), Some(Refusal::PerIp(2)));
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        let mut c = stats.admit(Some(other), 3, 2).unwrap();
        assert_eq!(
            stats.admit(Some(other), 3, 2).err(),
            Some(Refusal::Sessions(3))
        );
        let key = roam_proto::Keypair::generate().unwrap().public();
        b.set_key(key, 1).unwrap();
        assert_eq!(c.set_key(key, 1), Err(1));
        let u = stats.usage();
        assert_eq!((u.sessions, u.top_ip), (3, Some((ip, 2))));
        assert_eq!(u.top_key, Some((key, 1)));
        drop((a, b, c));
        // Every slot released; the refusals stay counted, one per cap.
        let u = stats.usage();
        let refused: Vec<(&str, u64)> = u.refused.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(refused, [("per_ip", 1), ("per_key", 1), ("sessions", 1)]);
        assert_eq!(
            u,
            ServerUsage {
                refused: u.refused.clone(),
                ..ServerUsage::default()
            }
        );
    }
}
