//! Scenario 5: memory per session. A relay process and a client process
//! (agents of this binary, both built on the roam library; see below) hold
//! `n` sessions, each with one open stream that carried an echo. RSS is read from
//! `/proc/PID/status` before the sessions open and once they are in the
//! measured state; the difference over `n` is the cost per session:
//!
//! - `active`: connected, the stream carried a 1 KiB echo and stays open;
//! - `suspended`: the fault proxy between client and relay black-holed,
//!   both sides report every session suspended, nothing unacknowledged;
//!   `roam serve` then parks each (its default `--park-after`, 10 s: the
//!   session becomes its continuation with its target connection, and its
//!   tasks and buffers are freed), and is measured once all are parked and
//!   3 s have passed for its allocator to give the pages back;
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
//! The relay is a real `roam serve` (caps raised with its flags: sessions
//! per address and per key, connections, targets), each stream piped to the
//! target as in production. A piped session costs it two sockets (client and
//! target), and this machine allows 20,000 open files per process and no
//! more (no CAP_SYS_RESOURCE), so `roam serve` holds at most 9,000 active
//! sessions. Suspended sessions beyond that are opened in waves, one fault
//! proxy's 2,500 at a time, each wave parked (its client socket gone) before
//! the next opens ([`staged`]). At 10,000 sessions every state is also
//! measured with `roam-bench agent relay --echo`: `roam::serve` echoing each
//! stream inside the relay, one socket per session, parking nothing; the
//! report names the relay of every row. The client reaches the relay
//! through fault-proxy processes (2,500 sessions each, for the same limit).

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::progress;
use crate::agent::Agent;
use crate::peers::Lab;
use crate::procs::{control_status, free_port, lo, rss_bytes, wait_listening, Proc};
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
    /// Which relay process: `roam serve` or the library relay agent.
    pub(crate) relay: &'static str,
    /// Where the relay sends each stream's bytes.
    pub(crate) relay_streams: &'static str,
    pub(crate) relay_rss_before: u64,
    pub(crate) relay_rss: u64,
    pub(crate) client_rss_before: u64,
    pub(crate) client_rss: u64,
    pub(crate) relay_bytes_per_session: f64,
    pub(crate) client_bytes_per_session: f64,
    /// The client's jemalloc counters per session (bytes, after minus
    /// before, over the sessions): `allocated` is what its live
    /// allocations hold, `active` the pages they sit in, `resident` the
    /// allocator's resident pages. RSS above `resident` is outside the
    /// allocator (stacks, the binary); `active` above `allocated` is
    /// partly used pages.
    pub(crate) client_heap_per_session: HeapPerSession,
    /// Seconds to open all sessions (with their first echo).
    pub(crate) open_seconds: f64,
}

/// jemalloc's counters of a client agent, per session (bytes).
#[derive(Debug, Serialize)]
pub(crate) struct HeapPerSession {
    pub(crate) allocated: f64,
    pub(crate) active: f64,
    pub(crate) resident: f64,
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

/// The relay under measurement.
enum Relay {
    /// A real `roam serve`, streams piped to the target.
    Serve {
        proc: Proc,
        control: std::path::PathBuf,
    },
    /// `roam-bench agent relay --echo`.
    Echo(Box<Agent>),
}

/// The relay names in the report.
pub(crate) const SERVE: &str = "roam serve";
pub(crate) const ECHO: &str = "roam-bench agent relay --echo";

impl Relay {
    fn pid(&self) -> u32 {
        match self {
            Relay::Serve { proc, .. } => proc.pid(),
            Relay::Echo(a) => a.pid(),
        }
    }

    /// Sessions the relay holds `what`: "suspended" (its state), or
    /// "parked" (`roam serve`'s `parked` flag; the library relay parks none).
    /// `roam serve` is asked through its control socket, as `roam status`.
    async fn count(&mut self, what: &str) -> io::Result<usize> {
        let control = match self {
            Relay::Echo(a) if what == "suspended" => return Ok(a.states().await?.1),
            Relay::Echo(_) => return Ok(0),
            Relay::Serve { control, .. } => control,
        };
        let v = control_status(control, Duration::from_secs(20)).await?;
        Ok(v.get("sessions").and_then(|s| s.as_array()).map_or(0, |a| {
            a.iter()
                .filter(|s| match what {
                    "parked" => s.get("parked").and_then(|p| p.as_bool()) == Some(true),
                    _ => s
                        .get("state")
                        .and_then(|x| x.as_str())
                        .is_some_and(|st| st.eq_ignore_ascii_case(what)),
                })
                .count()
        }))
    }
}

/// Starts `roam serve` for `n` sessions of one address and key, one piped
/// stream each, with its own state directory.
async fn start_serve(
    ctx: &Ctx,
    lab: &Lab,
    n: usize,
    tag: &str,
) -> io::Result<(Relay, std::net::SocketAddr)> {
    let state = ctx.env.dir.join(format!("mem-serve-{tag}"));
    std::fs::create_dir_all(&state)?;
    let port = free_port()?;
    let cap = (n + 100).to_string();
    let mut cmd = ctx.env.roam_cmd(&state);
    cmd.arg("serve")
        .arg("--listen")
        .arg(lo(port).to_string())
        .arg("--key")
        .arg(state.join("server.key"))
        .arg("--allow")
        .arg(lab.targets.addr.to_string());
    for flag in [
        "--max-connections",
        "--max-sessions",
        "--max-sessions-per-ip",
        "--max-sessions-per-key",
        "--max-targets",
    ] {
        cmd.arg(flag).arg(&cap);
    }
    cmd.args(["--max-targets-per-session", "4"]);
    let proc = Proc::spawn(
        SERVE,
        &mut cmd,
        Some(&ctx.env.log(&format!("mem-serve-{tag}"))),
    )?;
    wait_listening(lo(port), &proc, Duration::from_secs(10)).await?;
    let control = state.join("control").join(format!("{}.sock", proc.pid()));
    Ok((Relay::Serve { proc, control }, lo(port)))
}

/// Longest wait for `roam serve` to park every suspended session (its
/// default --park-after is 10 s).
const PARK_TIMEOUT: Duration = Duration::from_secs(60);
/// After parking, time for the relay's allocator (jemalloc, dirty pages
/// decay over 1 s) to give freed pages back.
const PURGE_WAIT: Duration = Duration::from_secs(3);

/// Waits (at most `limit`) until the relay reports `n` sessions `what`
/// ("suspended" or "parked").
async fn wait_relay(relay: &mut Relay, n: usize, what: &str, limit: Duration) -> io::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let got = relay.count(what).await.unwrap_or(0);
        if got >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::other(format!(
                "relay: only {got} of {n} sessions {what} after {limit:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
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
    serve: bool,
) -> io::Result<Row> {
    let log = ctx.env.log("agents");
    let me = &ctx.env.me;
    let (mut relay, relay_addr) = if serve {
        let (r, addr) = start_serve(ctx, lab, n, &format!("{n}-{state}")).await?;
        (r, addr.to_string())
    } else {
        let mut a = Agent::spawn(me, &["relay", "--echo"], &log)?;
        let addr = a.addr().await?.to_string();
        (Relay::Echo(Box::new(a)), addr)
    };
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
    let heap_before = client.heap().await?;
    let t = Instant::now();
    if staged(n, state, serve, ctx.nofile) {
        // More piped sessions than `roam serve` has descriptors for while
        // active (two sockets each): open them one fault proxy's worth at a
        // time, and black-hole that proxy until the relay has parked them
        // all (a parked session keeps its target connection only). Each
        // wave is active alone, so the relay never holds more than
        // (n - SESSIONS_PER_PROXY) parked plus SESSIONS_PER_PROXY active.
        let mut opened = 0;
        for (k, (p, _)) in proxies.iter_mut().enumerate() {
            let wave = SESSIONS_PER_PROXY.min(n - opened);
            client
                .cmd(&format!("open {wave} via {k}"), Duration::from_secs(600))
                .await?;
            opened += wave;
            p.cmd("blackhole on", Duration::from_secs(10)).await?;
            wait_suspended(&mut client, opened, "client").await?;
            wait_relay(&mut relay, opened, "parked", SUSPEND_TIMEOUT + PARK_TIMEOUT).await?;
        }
        let open_seconds = t.elapsed().as_secs_f64();
        tokio::time::sleep(PURGE_WAIT).await;
        return finish(
            n,
            state,
            if serve { Some(true) } else { None },
            &relay,
            &mut client,
            (relay_before, client_before, heap_before),
            open_seconds,
        )
        .await;
    }
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
        wait_relay(&mut relay, n, "suspended", SUSPEND_TIMEOUT).await?;
        if serve {
            // `roam serve` parks a session suspended for --park-after (its
            // default, 10 s): measured once every session is parked and
            // the allocator had time to give the pages back.
            wait_relay(&mut relay, n, "parked", PARK_TIMEOUT).await?;
            tokio::time::sleep(PURGE_WAIT).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    finish(
        n,
        state,
        serve.then_some(false),
        &relay,
        &mut client,
        (relay_before, client_before, heap_before),
        open_seconds,
    )
    .await
    // The agents are killed as they drop.
}

/// Whether `roam serve` must take `n` sessions in `state` in waves
/// ([`measure`]): suspended ones that, all active at once, would need more
/// descriptors than `nofile`, and that fit when opened one proxy's worth at
/// a time. Sessions with unacknowledged data are not staged.
fn staged(n: usize, state: &str, serve: bool, nofile: u64) -> bool {
    serve
        && state == "suspended"
        && 2 * n as u64 + 400 > nofile
        && (n + SESSIONS_PER_PROXY) as u64 + 400 <= nofile
}

/// The row for `n` sessions, the RSS read now against `before` (relay,
/// client). `serve`: `None` for the library relay, else whether `roam
/// serve`'s sessions were opened in waves.
async fn finish(
    n: usize,
    state: &'static str,
    serve: Option<bool>,
    relay: &Relay,
    client: &mut Agent,
    (relay_before, client_before, heap_before): (u64, u64, (u64, u64, u64)),
    open_seconds: f64,
) -> io::Result<Row> {
    let relay_rss = rss_bytes(relay.pid())?;
    let client_rss = rss_bytes(client.pid())?;
    let heap = client.heap().await?;
    let per = |after: u64, before: u64| (after as f64 - before as f64) / n as f64;
    Ok(Row {
        sessions: n,
        state,
        relay: if serve.is_some() { SERVE } else { ECHO },
        relay_streams: match serve {
            Some(true) => {
                "piped to the target; opened 2,500 at a time, each wave parked before the next"
            }
            Some(false) => "piped to the target",
            None => "echoed inside the relay",
        },
        relay_rss_before: relay_before,
        relay_rss,
        client_rss_before: client_before,
        client_rss,
        relay_bytes_per_session: per(relay_rss, relay_before),
        client_bytes_per_session: per(client_rss, client_before),
        client_heap_per_session: HeapPerSession {
            allocated: per(heap.0, heap_before.0),
            active: per(heap.1, heap_before.1),
            resident: per(heap.2, heap_before.2),
        },
        open_seconds,
    })
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Memory> {
    let mut rows = Vec::new();
    let mut not_measured = Vec::new();
    let limit = ctx.nofile;
    let mut cases: Vec<(usize, &'static str, bool)> = Vec::new();
    for &n in &ctx.plan.mem_serve_counts {
        for s in STATES {
            cases.push((n, s, true));
        }
    }
    for &n in &ctx.plan.mem_counts {
        for s in STATES {
            cases.push((n, s, false));
        }
    }
    for (n, state, serve) in cases {
        if serve && 2 * n as u64 + 400 > limit && !staged(n, state, serve, limit) {
            not_measured.push(Skipped {
                sessions: n,
                state,
                status: "not_measured",
                why: format!(
                    "roam serve needs two sockets per piped session (client and target), over this machine's limit of {limit} open files per process (no CAP_SYS_RESOURCE to raise it)"
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
        let row = measure(&ctx, &lab, n, state, serve)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("{n} sessions, {state}: {e}")))?;
        progress(&format!(
            "memory {n} sessions {state} ({}, {}): relay {:.1} KiB/session, client {:.1} KiB/session",
            row.relay,
            row.relay_streams,
            row.relay_bytes_per_session / 1024.0,
            row.client_bytes_per_session / 1024.0
        ));
        rows.push(row);
    }
    if !ctx.plan.mem_serve_counts.iter().any(|&n| n >= 10_000) {
        not_measured.push(Skipped {
            sessions: 10_000,
            state: "any, through roam serve",
            status: "not_measured",
            why: format!(
                "10,000 sessions piped to real targets need 20,000 sockets in roam serve while active, this machine's hard limit of {limit} open files per process leaves none for anything else; full mode measures 10,000 suspended ones through roam serve (opened in waves) and every state with the echoing library relay, 9,000 through roam serve"
            ),
        });
    }
    Ok(Memory {
        relay: "roam serve (caps raised by flags; each stream piped to the target), or where named roam-bench agent relay --echo (roam::serve with raised caps, each stream echoed inside the relay, one socket per session)",
        client: "roam-bench agent mem-client: roam::connect sessions, one stream each",
        rows,
        not_measured,
        caveats: vec![
            "RSS only: kernel socket buffers are not counted.",
            "Suspended sessions were active first; memory the allocator kept from then counts, so suspended figures are upper bounds.",
            "While black-holed the fault proxy accepts and holds new TCP connections, so a suspended client also holds its re-dial connection mid-handshake.",
            "Client heap (jemalloc's own counters, per session): live is what the client's allocations hold; pages, the pages those allocations sit in (above live: slots freed in pages that still hold something); resident, the allocator's resident memory. The harness's own allocations (a 1 KB echo per session) count too.",
        ],
    })
}
