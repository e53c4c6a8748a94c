//! Scenario 5: memory per session. A relay process and a client process
//! (agents of this binary, both built on the roam library; see below) hold
//! `n` sessions, each with one open stream that carried an echo. RSS is read from
//! `/proc/PID/status` before the sessions open and once they are in the
//! measured state; the difference over `n` is the cost per session:
//!
//! - `active`: connected, the stream carried a 1 KiB echo and stays open;
//! - `suspended`: the fault proxy between client and relay black-holed,
//!   both sides report every session suspended, nothing unacknowledged;
//! - `suspended_1mb_unacked`: as `suspended`, but each client stream wrote
//!   1,000,000 bytes after the black hole began (held for replay).
//!
//! Each state is measured on fresh processes. A session becomes suspended
//! only after being active, so memory the allocator kept from the active
//! phase still counts in the suspended states: they are upper bounds. Kernel
//! socket buffers are not in RSS. While black-holed, the fault proxy accepts
//! new TCP connections and holds them, so a suspended client also holds
//! its re-dial connection (mid-handshake), as behind a middlebox that
//! accepts but forwards nothing.
//!
//! The relay is `roam-bench agent relay` (`roam::serve` with its caps
//! raised) because `roam serve` accepts at most 1,024 connections and 4,096
//! sessions and has no flag to raise either. It echoes each stream itself,
//! so a session costs the relay one socket: this machine allows 20,000 open
//! files per process and no more (no CAP_SYS_RESOURCE), and 10,000 sessions
//! piped to targets would need 20,000 sockets. One extra row per count
//! pipes the streams to the target with 64 KiB copy buffers, as `roam
//! serve` does, where the limit allows. The client reaches the relay
//! through fault-proxy processes (2,500 sessions each, for the same limit).

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::progress;
use crate::agent::Agent;
use crate::peers::Lab;
use crate::procs::rss_bytes;
use crate::Ctx;

/// Unacknowledged bytes per session in the third state.
pub(crate) const UNACKED_BYTES: usize = 1_000_000;
const STATES: [&str; 3] = ["active", "suspended", "suspended_1mb_unacked"];
/// Longest wait for both sides to report every session suspended.
const SUSPEND_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) sessions: usize,
    pub(crate) state: &'static str,
    /// Where the relay sends each stream's bytes.
    pub(crate) relay_streams: &'static str,
    pub(crate) relay_rss_before: u64,
    pub(crate) relay_rss: u64,
    pub(crate) client_rss_before: u64,
    pub(crate) client_rss: u64,
    pub(crate) relay_bytes_per_session: f64,
    pub(crate) client_bytes_per_session: f64,
    /// Seconds to open all sessions (with their first echo).
    pub(crate) open_seconds: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct Skipped {
    pub(crate) sessions: usize,
    pub(crate) state: &'static str,
    pub(crate) status: &'static str,
    pub(crate) why: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct Memory {
    pub(crate) relay: &'static str,
    pub(crate) client: &'static str,
    pub(crate) rows: Vec<Row>,
    pub(crate) not_measured: Vec<Skipped>,
    pub(crate) caveats: Vec<&'static str>,
}

/// `MemAvailable` from `/proc/meminfo`, bytes.
fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |k| k * 1024)
}

async fn wait_suspended(agent: &mut Agent, n: usize, who: &str) -> io::Result<()> {
    let deadline = Instant::now() + SUSPEND_TIMEOUT;
    loop {
        let (_, s, _) = agent.states().await?;
        if s >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::other(format!(
                "{who}: only {s} of {n} sessions suspended after {SUSPEND_TIMEOUT:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sessions behind one fault-proxy process: its client side, upstream side
/// and held re-dials stay under a 20,000-descriptor limit.
const SESSIONS_PER_PROXY: usize = 2500;

async fn measure(
    ctx: &Ctx,
    lab: &Lab,
    n: usize,
    state: &'static str,
    piped: bool,
) -> io::Result<Row> {
    let log = ctx.env.log("agents");
    let me = &ctx.env.me;
    let mut relay = if piped {
        Agent::spawn(me, &["relay"], &log)?
    } else {
        Agent::spawn(me, &["relay", "--echo"], &log)?
    };
    let relay_addr = relay.addr().await?.to_string();
    let mut proxies = Vec::new();
    for _ in 0..n.div_ceil(SESSIONS_PER_PROXY) {
        let mut p = Agent::spawn(me, &["proxy", "--upstream", &relay_addr], &log)?;
        let a = p.addr().await?;
        proxies.push((p, a));
    }
    let relays: Vec<String> = proxies.iter().map(|p| p.1.to_string()).collect();
    let mut client = Agent::spawn(
        me,
        &[
            "mem-client",
            "--relay",
            &relays.join(","),
            "--target",
            &lab.targets.addr.to_string(),
        ],
        &log,
    )?;
    let hello = client.line(Duration::from_secs(20)).await?;
    if hello != "started" {
        return Err(io::Error::other(format!("client agent said {hello:?}")));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let relay_before = rss_bytes(relay.pid())?;
    let client_before = rss_bytes(client.pid())?;
    let t = Instant::now();
    client
        .cmd(&format!("open {n}"), Duration::from_secs(600))
        .await?;
    let open_seconds = t.elapsed().as_secs_f64();
    if state != "active" {
        for (p, _) in &mut proxies {
            p.cmd("blackhole on", Duration::from_secs(10)).await?;
        }
        if state == "suspended_1mb_unacked" {
            client
                .cmd(&format!("write {UNACKED_BYTES}"), Duration::from_secs(300))
                .await?;
        }
        wait_suspended(&mut client, n, "client").await?;
        wait_suspended(&mut relay, n, "relay").await?;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let relay_rss = rss_bytes(relay.pid())?;
    let client_rss = rss_bytes(client.pid())?;
    let per = |after: u64, before: u64| (after as f64 - before as f64) / n as f64;
    Ok(Row {
        sessions: n,
        state,
        relay_streams: if piped {
            "piped to the target"
        } else {
            "echoed inside the relay"
        },
        relay_rss_before: relay_before,
        relay_rss,
        client_rss_before: client_before,
        client_rss,
        relay_bytes_per_session: per(relay_rss, relay_before),
        client_bytes_per_session: per(client_rss, client_before),
        open_seconds,
    })
    // The agents are killed as they drop.
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Memory> {
    let mut rows = Vec::new();
    let mut not_measured = Vec::new();
    let limit = ctx.nofile;
    for &n in &ctx.plan.mem_counts {
        let mut cases: Vec<(&'static str, bool)> = STATES.iter().map(|s| (*s, false)).collect();
        cases.push(("active", true));
        for (state, piped) in cases {
            if piped && 2 * n as u64 + 200 > limit {
                not_measured.push(Skipped {
                    sessions: n,
                    state: "active, piped to the target",
                    status: "not_measured",
                    why: format!(
                        "the relay would need two sockets per session, over this machine's limit of {limit} open files per process (no CAP_SYS_RESOURCE to raise it)"
                    ),
                });
                continue;
            }
            if state == "suspended_1mb_unacked" {
                // The client holds n MB; leave room for everything else.
                let need = (n * UNACKED_BYTES) as u64 * 2 + (2 << 30);
                let avail = mem_available();
                if avail < need {
                    not_measured.push(Skipped {
                        sessions: n,
                        state,
                        status: "not_measured",
                        why: format!(
                            "needs ~{} MB free for the client's unacknowledged data, {} MB available",
                            need / 1_000_000,
                            avail / 1_000_000
                        ),
                    });
                    continue;
                }
            }
            let row = measure(&ctx, &lab, n, state, piped)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("{n} sessions, {state}: {e}")))?;
            progress(&format!(
                "memory {n} sessions {state} ({}): relay {:.1} KiB/session, client {:.1} KiB/session",
                row.relay_streams,
                row.relay_bytes_per_session / 1024.0,
                row.client_bytes_per_session / 1024.0
            ));
            rows.push(row);
        }
    }
    Ok(Memory {
        relay: "roam-bench agent relay: roam::serve with raised caps; streams echoed inside the relay (2 KiB buffer), or piped to the target with 64 KiB copy buffers as roam serve does",
        client: "roam-bench agent mem-client: roam::connect sessions, one stream each",
        rows,
        not_measured,
        caveats: vec![
            "RSS only: kernel socket buffers are not counted.",
            "Suspended sessions were active first; memory the allocator kept from then counts, so suspended figures are upper bounds.",
            "While black-holed the fault proxy accepts and holds new TCP connections, so a suspended client also holds its re-dial connection mid-handshake.",
        ],
    })
}
