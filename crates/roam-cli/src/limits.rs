//! The relay's resource limits: the file-descriptor limit raised at start-up,
//! defaults derived from it, and the caps on target connections.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Target connections one session may hold by default. A real client needs
/// one per ssh connection or forwarded socket; 256 leaves room for a busy
/// `roam forward` while one session can no longer take the relay's fds.
pub(crate) const DEFAULT_TARGETS_PER_SESSION: usize = 256;
/// Ceiling of the derived default for target connections overall. Each
/// relayed stream holds two 64 KiB copy buffers, so 8,192 of them bound that
/// memory at 1 GiB even when the fd limit would allow far more.
const MAX_DEFAULT_TARGETS: usize = 8192;
/// The library's connection cap when the fd limit allows it.
const MAX_DEFAULT_CONNECTIONS: usize = 1024;

/// Raises this process's soft limit on open files to its hard limit (a relay
/// holds two descriptors per relayed stream) and returns the soft limit now
/// in force. Failure only costs head-room: it is logged, not fatal.
pub(crate) fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("cannot read the open-file limit: {e}; assuming 1024");
            return 1024;
        }
    };
    if soft >= hard {
        tracing::info!("open-file limit: {soft} (already the hard limit)");
        return soft;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => {
            tracing::info!("open-file limit raised from {soft} to the hard limit {hard}");
            hard
        }
        Err(e) => {
            tracing::warn!("open-file limit stays at {soft}: cannot raise it to {hard}: {e}");
            soft
        }
    }
}

/// Caps derived from the open-file limit so that the relay never runs out of
/// descriptors: client connections, their busy-answer overflow and target
/// connections together stay below it, with a reserve for everything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FdBudget {
    /// Default for `max_connections`.
    pub(crate) connections: usize,
    /// Default for the busy-answer overflow beyond `max_connections`.
    pub(crate) busy_overflow: usize,
    /// Default for target connections overall.
    pub(crate) targets: usize,
    /// Descriptors kept back for the listener, the runtime (epoll, wake-up
    /// pipe), stdio, the control socket and its clients, key files and DNS.
    pub(crate) reserve: usize,
}

impl FdBudget {
    /// The budget for an open-file limit of `nofile`.
    pub(crate) fn for_limit(nofile: u64) -> Self {
        let nofile = usize::try_from(nofile).unwrap_or(usize::MAX);
        let reserve = (nofile / 8).clamp(16, 64);
        let busy_overflow = (nofile / 16).clamp(1, 64);
        let avail = nofile.saturating_sub(reserve + busy_overflow).max(2);
        // Half for clients, half for their targets, up to the usual cap.
        let connections = (avail / 2).clamp(1, MAX_DEFAULT_CONNECTIONS);
        let targets = avail
            .saturating_sub(connections)
            .clamp(1, MAX_DEFAULT_TARGETS);
        Self {
            connections,
            busy_overflow,
            targets,
            reserve,
        }
    }

    /// Descriptors the given caps could need at most.
    pub(crate) fn needed(&self, connections: usize, targets: usize) -> usize {
        connections
            .saturating_add(self.busy_overflow)
            .saturating_add(targets)
            .saturating_add(self.reserve)
    }
}

/// One line of `roam status`'s limits: a cap and how much of it is used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Limit {
    /// What is capped, e.g. `sessions per IP`.
    pub(crate) name: String,
    /// Current use (for per-holder caps, the biggest holder's).
    pub(crate) used: usize,
    /// The cap.
    pub(crate) max: usize,
    /// For per-holder caps, who holds `used` (an address, a key, a session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) holder: Option<String>,
}

/// Why a target connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TargetRefusal {
    /// The session holds `max` target connections already.
    PerSession(usize),
    /// The relay holds `max` target connections already.
    Total(usize),
}

impl std::fmt::Display for TargetRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetRefusal::PerSession(max) => write!(
                f,
                "the session already holds {max} target connections, the limit per session (--max-targets-per-session)"
            ),
            TargetRefusal::Total(max) => write!(
                f,
                "the relay already holds {max} target connections, its limit (--max-targets)"
            ),
        }
    }
}

/// Counts target connections overall and per session against their caps.
#[derive(Debug)]
pub(crate) struct TargetCaps {
    max_total: usize,
    max_per_session: usize,
    counts: Mutex<TargetCounts>,
    /// Throttles the warning about refused targets (an attacker at a cap
    /// would otherwise write one line per stream).
    log: Mutex<roam::LogThrottle>,
    /// Streams refused so far, by reason (for the metrics).
    refused: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    /// Target connections made so far.
    connected: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct TargetCounts {
    total: usize,
    /// Session label (id) → target connections it holds.
    per_session: HashMap<String, usize>,
}

impl TargetCaps {
    /// Caps of `max_total` overall and `max_per_session` per session.
    pub(crate) fn new(max_total: usize, max_per_session: usize) -> Arc<Self> {
        Arc::new(Self {
            max_total,
            max_per_session,
            counts: Mutex::default(),
            log: Mutex::new(roam::LogThrottle::new(Duration::from_secs(10))),
            refused: Mutex::default(),
            connected: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Counts a stream refused for `reason` (a metrics label).
    pub(crate) fn note_refused(&self, reason: &'static str) {
        *self
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason)
            .or_default() += 1;
    }

    /// Counts a target connection made.
    pub(crate) fn note_connected(&self) {
        self.connected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Streams refused so far by reason, and target connections made.
    pub(crate) fn tallies(&self) -> (std::collections::BTreeMap<&'static str, u64>, u64) {
        (
            self.refused
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            self.connected.load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Target connections held now.
    pub(crate) fn held(&self) -> usize {
        self.counts().total
    }

    fn counts(&self) -> MutexGuard<'_, TargetCounts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one target connection for `session`, or says which cap is full.
    pub(crate) fn take(self: &Arc<Self>, session: &str) -> Result<TargetPermit, TargetRefusal> {
        let mut c = self.counts();
        if c.total >= self.max_total {
            return Err(TargetRefusal::Total(self.max_total));
        }
        let n = c.per_session.entry(session.to_string()).or_insert(0);
        if *n >= self.max_per_session {
            return Err(TargetRefusal::PerSession(self.max_per_session));
        }
        *n += 1;
        c.total += 1;
        Ok(TargetPermit {
            caps: self.clone(),
            session: session.to_string(),
        })
    }

    /// Whether a refusal should be logged now, and how many were not since.
    pub(crate) fn log_allowed(&self) -> Option<u64> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allow(std::time::Instant::now())
    }

    /// Usage lines for `roam status`.
    pub(crate) fn limits(&self) -> Vec<Limit> {
        let c = self.counts();
        let top = c
            .per_session
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)));
        vec![
            Limit {
                name: "target connections".to_string(),
                used: c.total,
                max: self.max_total,
                holder: None,
            },
            Limit {
                name: "target connections per session".to_string(),
                used: top.map_or(0, |t| *t.1),
                max: self.max_per_session,
                holder: top.map(|t| t.0.clone()),
            },
        ]
    }
}

/// One target connection's place in the counts, released when dropped.
#[derive(Debug)]
pub(crate) struct TargetPermit {
    caps: Arc<TargetCaps>,
    session: String,
}

impl Drop for TargetPermit {
    fn drop(&mut self) {
        let mut c = self.caps.counts();
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.per_session.get_mut(&self.session) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.per_session.remove(&self.session);
            }
        }
    }
}

/// The library server's caps next to its usage, for `roam status`.
pub(crate) fn server_limits(config: &roam::ServerConfig) -> Vec<Limit> {
    let u = config.stats.usage();
    vec![
        Limit {
            name: "sessions".to_string(),
            used: u.sessions,
            max: config.max_sessions,
            holder: None,
        },
        Limit {
            name: "connections".to_string(),
            used: u.connections,
            max: config.max_connections,
            holder: None,
        },
        Limit {
            name: "busy answers (beyond connections)".to_string(),
            used: u.busy_answering,
            max: config.busy_overflow,
            holder: None,
        },
        Limit {
            name: "sessions per IP".to_string(),
            used: u.top_ip.map_or(0, |t| t.1),
            max: config.max_sessions_per_ip,
            holder: u.top_ip.map(|t| t.0.to_string()),
        },
        Limit {
            name: "sessions per client key".to_string(),
            used: u.top_key.map_or(0, |t| t.1),
            max: config.max_sessions_per_key,
            holder: u.top_key.map(|t| t.0.to_string()),
        },
    ]
}

/// Accept queue asked for on the relay's and `forward`'s listening sockets
/// (the kernel caps it at `net.core.somaxconn`, 4096 on current Linux).
/// std's default of 128 overflows when hundreds of clients reconnect at
/// once (a relay restart, a network coming back): the kernel then answers
/// with SYN cookies and drops handshakes, and clients wait a retransmission
/// timeout.
pub(crate) const LISTEN_BACKLOG: u32 = 4096;

/// Binds `addr` (names resolved, each address tried in turn) and listens
/// with [`LISTEN_BACKLOG`], with `SO_REUSEADDR` as `TcpListener::bind` sets.
pub(crate) async fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        match socket.bind(a).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{addr} resolves to no address"),
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The relay's listening socket holds a burst of reconnects: its queue
    /// is as long as asked (up to `somaxconn`), at least 1,000, and 600
    /// connections made before any is accepted all complete and are then
    /// accepted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn listen_queue_holds_a_burst_of_reconnects() {
        let l = listen("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(LISTEN_BACKLOG);
        let backlog = LISTEN_BACKLOG.min(somaxconn);
        let ss = std::process::Command::new("ss")
            .args(["-ltnH", &format!("sport = :{}", addr.port())])
            .output()
            .expect("ss (iproute2)");
        let text = String::from_utf8_lossy(&ss.stdout);
        let queue: u32 = text
            .split_whitespace()
            .nth(2)
            .and_then(|q| q.parse().ok())
            .unwrap_or_else(|| panic!("ss: {text}"));
        assert_eq!(queue, backlog, "{text}");
        // At least a thousand reconnects wait their turn (std's 128 did not).
        assert!(queue >= 1000.min(somaxconn), "queue {queue}: {text}");
        let n = 600.min(backlog as usize);
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            let c =
                tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
                    .await
                    .expect("connect within 5 s")
                    .unwrap();
            conns.push(c);
        }
        for _ in 0..n {
            tokio::time::timeout(Duration::from_secs(5), l.accept())
                .await
                .expect("queued")
                .unwrap();
        }
    }

    #[test]
    fn budget_fits_the_fd_limit() {
        for nofile in [32u64, 64, 256, 1024, 4096, 65_536, 1 << 20] {
            let b = FdBudget::for_limit(nofile);
            assert!(
                b.needed(b.connections, b.targets) as u64 <= nofile.max(20),
                "{nofile}: {b:?}"
            );
            assert!(b.connections >= 1 && b.targets >= 1, "{nofile}: {b:?}");
        }
        let big = FdBudget::for_limit(1 << 20);
        assert_eq!((big.connections, big.targets), (1024, 8192));
    }

    #[test]
    fn target_caps_count_per_session_and_overall() {
        let caps = TargetCaps::new(3, 2);
        let a1 = caps.take("a").unwrap();
        let _a2 = caps.take("a").unwrap();
        assert_eq!(caps.take("a").err(), Some(TargetRefusal::PerSession(2)));
        let _b1 = caps.take("b").unwrap();
        assert_eq!(caps.take("c").err(), Some(TargetRefusal::Total(3)));
        drop(a1);
        let _c1 = caps.take("c").unwrap();
        let l = caps.limits();
        assert_eq!((l[0].used, l[0].max), (3, 3));
        assert_eq!(l[1].used, 1);
    }
}
