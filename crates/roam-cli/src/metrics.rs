//! `roam serve --metrics ADDR`: the relay's figures for Prometheus.
//!
//! `GET /metrics` on `ADDR` answers in the OpenMetrics text format (which
//! Prometheus scrapes natively), encoded by the Prometheus project's own Rust
//! client, `prometheus-client`. The figures are read at each scrape from the
//! same places `roam status` reads (the control registry's sessions, the
//! relay's caps), so the two always agree:
//!
//! - `roam_sessions{state}`: sessions held now, by state.
//! - `roam_sessions_opened_total`, `roam_sessions_closed_total{reason}`.
//! - `roam_bytes_sent_total`, `roam_bytes_received_total`: stream bytes
//!   of all sessions, ended ones included.
//! - `roam_bytes_replayed_total`, `roam_resumes_total`: what resumes cost.
//! - `roam_streams`: streams open now.
//! - `roam_target_connections`, `roam_target_connections_opened_total`.
//! - `roam_streams_refused_total{reason}`: `bad_target`, `not_allowed`,
//!   `target_limit`, `unreachable`.
//! - `roam_refused_total{reason}`: connections and sessions refused,
//!   `connections` (answered busy), `connections_dropped`, `sessions`,
//!   `per_ip`, `per_key`, `unauthorized`.
//! - `roam_limit{limit}`, `roam_limit_used{limit}`: each cap and its use.
//! - `roam_shells{state}`: shells attached or parked (`--shell`).
//! - `roam_handoffs_total{direction,connection}`: sessions moved by relay
//!   takeovers — `out` (handed to a new relay), `in` with `connection`
//!   `moved` (the client's connection came along) or `resume` (the client
//!   resumes); `roam_handoff_stop_seconds`: how long each session taken
//!   over was stopped, from the old relay stopping it to this one running it.
//!
//! The endpoint is plain HTTP without authentication, like every Prometheus
//! exporter: bind it to loopback or a private address.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry as PromRegistry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::control::Registry;
use crate::limits::TargetCaps;

/// Longest request head read (bytes).
const MAX_HEAD: usize = 8 * 1024;
/// How long a scraper may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// One label set: `[(name, value)]`.
type Labels = Vec<(String, String)>;

fn label(name: &str, value: &str) -> Labels {
    vec![(name.to_string(), value.to_string())]
}

/// Upper bounds of `roam_handoff_stop_seconds`'s buckets.
const STOP_BUCKETS: [f64; 10] = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0];

/// Sessions moved by relay takeovers, as this relay saw them.
#[derive(Debug, Default)]
pub(crate) struct Handoffs {
    /// Handed to a new relay.
    pub(crate) out: AtomicU64,
    /// Taken over with the client's connection.
    pub(crate) moved_in: AtomicU64,
    /// Taken over without it (the client resumes).
    pub(crate) resume_in: AtomicU64,
    /// Per session taken over and running here: how long it was stopped (µs).
    pub(crate) stops_us: Mutex<Vec<u64>>,
}

impl Handoffs {
    /// The stops so far (µs), sorted.
    pub(crate) fn stops(&self) -> Vec<u64> {
        let mut v = self
            .stops_us
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        v.sort_unstable();
        v
    }
}

/// Where the figures come from.
#[derive(Clone)]
pub(crate) struct Sources {
    pub(crate) sessions: Registry,
    pub(crate) targets: Arc<TargetCaps>,
    /// The relay's admission counts (refused connections and sessions).
    pub(crate) server: roam::ServerStats,
    /// Relay takeovers.
    pub(crate) handoffs: Arc<Handoffs>,
}

/// The OpenMetrics text of the relay's figures now.
pub(crate) fn render(src: &Sources) -> String {
    let mut reg = PromRegistry::default();
    let (live, totals) = src.sessions.figures();
    let gauge = |reg: &mut PromRegistry, name: &str, help: &str, v: i64| {
        let g = Gauge::<i64>::default();
        g.set(v);
        reg.register(name, help, g);
    };
    let counter = |reg: &mut PromRegistry, name: &str, help: &str, v: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        reg.register(name, help, c);
    };

    let by_state = Family::<Labels, Gauge>::default();
    for s in &live {
        by_state
            .get_or_create(&label("state", &format!("{:?}", s.state).to_lowercase()))
            .inc();
    }
    by_state
        .get_or_create(&label("state", "parked"))
        .set(src.sessions.parked_count() as i64);
    reg.register(
        "roam_sessions",
        "Sessions held now, by state (parked: suspended and kept as a continuation)",
        by_state,
    );
    counter(
        &mut reg,
        "roam_sessions_opened",
        "Sessions accepted since start",
        totals.opened,
    );
    let closed = Family::<Labels, Counter>::default();
    for (reason, n) in &totals.closed {
        closed.get_or_create(&label("reason", reason)).inc_by(*n);
    }
    reg.register(
        "roam_sessions_closed",
        "Sessions ended, by how: local, peer, peer_error, expired, error",
        closed,
    );
    let sum = |f: fn(&roam::SessionStats) -> u64| live.iter().map(f).sum::<u64>();
    counter(
        &mut reg,
        "roam_bytes_sent",
        "Stream bytes sent to clients, ended sessions included",
        totals.bytes_sent + sum(|s| s.bytes_sent),
    );
    counter(
        &mut reg,
        "roam_bytes_received",
        "Stream bytes received from clients, ended sessions included",
        totals.bytes_received + sum(|s| s.bytes_received),
    );
    counter(
        &mut reg,
        "roam_bytes_replayed",
        "Stream bytes sent again after resumes",
        totals.bytes_replayed + sum(|s| s.bytes_replayed),
    );
    counter(
        &mut reg,
        "roam_resumes",
        "Sessions resumed on a new transport",
        totals.resumes + sum(|s| s.resumes),
    );
    gauge(
        &mut reg,
        "roam_streams",
        "Streams open now",
        live.iter().map(|s| s.streams as i64).sum(),
    );
    let (refused, opened) = src.targets.tallies();
    gauge(
        &mut reg,
        "roam_target_connections",
        "Target connections held now",
        src.targets.held() as i64,
    );
    counter(
        &mut reg,
        "roam_target_connections_opened",
        "Target connections made since start",
        opened,
    );
    let refusals = Family::<Labels, Counter>::default();
    for (reason, n) in &refused {
        refusals.get_or_create(&label("reason", reason)).inc_by(*n);
    }
    reg.register(
        "roam_streams_refused",
        "Streams refused: bad_target, not_allowed, target_limit, unreachable",
        refusals,
    );
    let refused_sessions = Family::<Labels, Counter>::default();
    for (reason, n) in &src.server.usage().refused {
        refused_sessions
            .get_or_create(&label("reason", reason))
            .inc_by(*n);
    }
    reg.register(
        "roam_refused",
        "Connections and sessions refused: connections (answered busy), connections_dropped, sessions, per_ip, per_key, unauthorized",
        refused_sessions,
    );
    let caps = Family::<Labels, Gauge>::default();
    let used = Family::<Labels, Gauge>::default();
    for l in src.sessions.limits() {
        caps.get_or_create(&label("limit", &l.name))
            .set(l.max as i64);
        used.get_or_create(&label("limit", &l.name))
            .set(l.used as i64);
    }
    reg.register("roam_limit", "Each cap of the relay", caps);
    reg.register("roam_limit_used", "Each cap's use now", used);
    let shells = Family::<Labels, Gauge>::default();
    let all = src.sessions.shells();
    for (state, attached) in [("attached", true), ("parked", false)] {
        shells
            .get_or_create(&label("state", state))
            .set(all.iter().filter(|s| s.attached == attached).count() as i64);
    }
    reg.register(
        "roam_shells",
        "Shells (roam serve --shell): with a client attached, or parked",
        shells,
    );
    let handoffs = Family::<Labels, Counter>::default();
    let h = &src.handoffs;
    for (labels, n) in [
        (label("direction", "out"), &h.out),
        (
            vec![
                ("direction".to_string(), "in".to_string()),
                ("connection".to_string(), "moved".to_string()),
            ],
            &h.moved_in,
        ),
        (
            vec![
                ("direction".to_string(), "in".to_string()),
                ("connection".to_string(), "resume".to_string()),
            ],
            &h.resume_in,
        ),
    ] {
        handoffs
            .get_or_create(&labels)
            .inc_by(n.load(Ordering::Relaxed));
    }
    reg.register(
        "roam_handoffs",
        "Sessions moved by relay takeovers: out (to a new relay), in with the client's connection moved or waiting for its resume",
        handoffs,
    );
    let stops = Histogram::new(STOP_BUCKETS);
    for us in h.stops() {
        stops.observe(us as f64 / 1e6);
    }
    reg.register(
        "roam_handoff_stop_seconds",
        "Sessions taken over: how long each was stopped, from the old relay stopping it to this one running it",
        stops,
    );

    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}

/// Serves `GET /metrics` on `listener` until the process ends.
pub(crate) async fn serve(listener: TcpListener, src: Sources) {
    let throttle = std::sync::Mutex::new(roam::LogThrottle::new(Duration::from_secs(10)));
    loop {
        let sock = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                let allowed = throttle
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .allow(std::time::Instant::now());
                if let Some(n) = allowed {
                    tracing::warn!("metrics: accept failed: {e} ({n} more not logged)");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let src = src.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(sock, &src).await {
                tracing::debug!("metrics: {e}");
            }
        });
    }
}

/// Reads one request head and answers it; the connection then closes.
async fn answer(mut sock: TcpStream, src: &Sources) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            if head.len() > MAX_HEAD {
                return Err(std::io::Error::other("request head too long"));
            }
            let n = sock.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::other("closed before a whole request"));
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok(())
    })
    .await;
    let (status, kind, body) = match read {
        Err(_) => return Err(std::io::Error::other("request timed out")),
        Ok(Err(e)) if e.to_string() == "request head too long" => (
            "431 Request Header Fields Too Large",
            "text/plain",
            "request head too long\n".to_string(),
        ),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(())) => route(&head, src),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(reply.as_bytes()).await?;
    sock.shutdown().await
}

/// Status, content type and body for a request head.
fn route(head: &[u8], src: &Sources) -> (&'static str, &'static str, String) {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET", b"/metrics") => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            render(src),
        ),
        (b"GET", b"/") => (
            "200 OK",
            "text/plain; charset=utf-8",
            "roam serve: metrics at /metrics\n".to_string(),
        ),
        (b"GET", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET\n".to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources() -> Sources {
        Sources {
            sessions: Registry::default(),
            targets: TargetCaps::new(10, 5),
            server: roam::ServerStats::default(),
            handoffs: Arc::default(),
        }
    }

    /// The text is OpenMetrics: counters end in `_total`, every family has
    /// its TYPE line, refusals carry their reason, and it ends with `# EOF`.
    #[test]
    fn renders_openmetrics_with_counters_and_reasons() {
        let src = sources();
        src.targets.note_refused("not_allowed");
        src.targets.note_refused("not_allowed");
        src.targets.note_connected();
        let text = render(&src);
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(
            text.contains("# TYPE roam_sessions_opened counter"),
            "{text}"
        );
        assert!(text.contains("roam_sessions_opened_total 0\n"), "{text}");
        assert!(
            text.contains("roam_streams_refused_total{reason=\"not_allowed\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("roam_target_connections_opened_total 1\n"),
            "{text}"
        );
        assert!(text.contains("roam_target_connections 0\n"), "{text}");
    }

    /// Only `GET /metrics` gets the figures; other paths and methods get a
    /// precise status.
    #[test]
    fn routes() {
        let src = sources();
        let r = |h: &[u8]| route(h, &src).0;
        assert_eq!(r(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), "200 OK");
        assert_eq!(r(b"GET /metrics?x=1 HTTP/1.1\r\n\r\n"), "200 OK");
        assert_eq!(r(b"GET /other HTTP/1.1\r\n\r\n"), "404 Not Found");
        assert_eq!(
            r(b"POST /metrics HTTP/1.1\r\n\r\n"),
            "405 Method Not Allowed"
        );
        assert_eq!(r(b"\r\n\r\n"), "405 Method Not Allowed");
    }
}
