//! Scenario 8: relay upgrade without loss (`roam serve --takeover`).
//!
//! Per session count `n`: a relay of its own (own state directory and
//! takeover socket) holds `n` library sessions, each with one stream to the
//! echo target proven by a 1 KiB echo. Then, `rounds` times, a new
//! `roam serve --takeover` process is started; the old relay hands over its
//! listener, sessions, target connections and client connections (each
//! client's connection moves with its session, `docs/PROTOCOL.md` §13.6)
//! and exits. Measured per round:
//!
//! - the *stall* each client sees: when the old relay announces the
//!   handover (its log line "handing over", read every millisecond), every
//!   client writes one byte on its stream; the time until the echo is back
//!   is how long a byte written as the handover began waited for service —
//!   the old relay stopping the session, the handover, and the new relay
//!   continuing it (p50, p99, max over all sessions and rounds). Written
//!   before the old relay takes the session out, the byte crosses the
//!   handover on its way back (the echo target answers into a socket that
//!   moves), so it measures the stall either way;
//! - how long each session was *stopped*, from the old relay stopping it
//!   to the new relay running it, as the new relay reports it from the
//!   host's monotonic clock (the old relay stamps each wave; p50, p99 and
//!   max per round). Sessions move in waves while the others keep running,
//!   so a byte written at the announcement may be served before its
//!   session's wave: this is the figure a session's worst moment shows;
//! - sessions whose client had to resume (a `Suspended` event: its
//!   connection did not move) — expected 0;
//! - the old relay's own handover time (it logs "handed N sessions ... in X
//!   ms": from accepting the takeover to the new relay's receipt);
//! - the same burst of 1-byte echoes before any takeover (what the burst
//!   alone costs: at thousands of sessions it loads the machine);
//! - the time from the announcement until every client's byte was back;
//! - after each round, a 1-byte echo on every stream (failures counted: a
//!   target connection reset or a byte lost would fail it).
//!
//! The target: a stall of at most 50 ms at 1,000 sessions.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam::SessionEvent;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::progress;
use crate::agent::{client_config, open_echo_session};
use crate::peers::Lab;
use crate::procs::{free_port, lo, wait_listening, Proc};
use crate::stats::{summary, Summary};
use crate::Ctx;

/// The stall target at 1,000 sessions (ms).
pub(crate) const TARGET_MS: f64 = 50.0;
/// Caps of the scenario's relay: room for 10,000 sessions from one address
/// and key, each with a target connection.
const CAPS: &[&str] = &[
    "--max-connections",
    "16384",
    "--max-sessions",
    "16384",
    "--max-sessions-per-ip",
    "16384",
    "--max-sessions-per-key",
    "16384",
    "--max-targets",
    "16384",
];
/// Longest wait for the handover to begin, and for every echo after it.
const ROUND_TIMEOUT: Duration = Duration::from_secs(60);
/// Sessions opened at once while setting up.
const OPEN_PARALLEL: usize = 64;

/// One session count's figures.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    /// Sessions measured.
    pub(crate) sessions: usize,
    /// Sessions the plan asked for, when this machine's open-file limit
    /// allowed fewer (each session costs the relay two descriptors).
    pub(crate) requested: Option<usize>,
    pub(crate) rounds: usize,
    /// Per session and round: a byte written when the handover was
    /// announced, until its echo was back (ms).
    pub(crate) stall_ms: Summary,
    /// The same burst (every client writes one byte at once) before any
    /// takeover: what the burst alone costs on this machine (ms).
    pub(crate) burst_ms: Summary,
    /// Per round, the new relay's report of how long its sessions were
    /// stopped (ms): p50, p99 and max.
    pub(crate) stopped_p50_ms: Vec<f64>,
    pub(crate) stopped_p99_ms: Vec<f64>,
    pub(crate) stopped_max_ms: Vec<f64>,
    /// Sessions (over all rounds) whose client saw `Suspended`: its
    /// connection did not move and it resumed.
    pub(crate) resumed: usize,
    /// The old relay's handover time per round (ms), from its log.
    pub(crate) handover_ms: Vec<f64>,
    /// Its parts: stopping relays and detaching sessions (ms) ...
    pub(crate) taking_out_ms: Vec<f64>,
    /// ... and sending them until the new relay's receipt (ms).
    pub(crate) sending_ms: Vec<f64>,
    /// Per round: the announcement until every client's byte was back (ms).
    pub(crate) all_served_ms: Vec<f64>,
    /// Streams whose echo failed during or after a round (should be 0).
    pub(crate) echo_failures: usize,
}

/// The scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct Takeover {
    pub(crate) rows: Vec<Row>,
    pub(crate) target_ms: f64,
    /// At 1,000 sessions, both the p99 stall and every round's p99 stop
    /// within the target (None if that count was not run).
    pub(crate) target_met_at_1000: Option<bool>,
}

/// A relay process of this scenario.
struct Relay {
    proc: Proc,
    log: PathBuf,
}

fn start_relay(
    ctx: &Ctx,
    state: &Path,
    port: u16,
    target: &str,
    round: usize,
    takeover: bool,
) -> io::Result<Relay> {
    let log = ctx.env.log(&format!(
        "takeover-relay-{}-{round}",
        state.file_name().and_then(|n| n.to_str()).unwrap_or("x")
    ));
    let mut cmd = ctx.env.roam_cmd(state);
    cmd.arg("-v")
        .arg("serve")
        .arg("--listen")
        .arg(lo(port).to_string())
        .arg("--key")
        .arg(state.join("server.key"))
        .arg("--allow")
        .arg(target)
        .arg("--takeover-socket")
        .arg(state.join("takeover.sock"))
        .args(CAPS);
    if takeover {
        cmd.arg("--takeover");
    }
    let proc = Proc::spawn("roam serve (takeover scenario)", &mut cmd, Some(&log))?;
    Ok(Relay { proc, log })
}

/// The old relay's "handed N sessions to the new relay in X ms (Y ms
/// taking them out, Z ms sending)" figures: `(X, Y, Z)`.
fn handover_ms(log: &Path) -> Option<(f64, f64, f64)> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().find(|l| l.contains("to the new relay in "))?;
    let rest = line.split("to the new relay in ").nth(1)?;
    let total = rest.split_whitespace().next()?.parse().ok()?;
    let out = rest
        .split('(')
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let send = rest
        .split(", ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((total, out, send))
}

/// Waits (bounded) until `proc` exits.
async fn wait_exit(proc: &Proc, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if proc.check_alive().is_err() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The new relay's "each was stopped for p50 X ms, p99 Y ms, max Z ms"
/// figures, once it logged them (waits up to 10 s).
async fn stopped_ms(log: &Path) -> Option<(f64, f64, f64)> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("each was stopped for")) {
            let rest = line.split("each was stopped for ").nth(1)?;
            let mut v = rest
                .split(", ")
                .filter_map(|p| p.split_whitespace().nth(1)?.parse::<f64>().ok());
            return Some((v.next()?, v.next()?, v.next()?));
        }
        if Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the relay's log announces a handover yet.
fn handing_over(log: &Path) -> bool {
    std::fs::read_to_string(log).is_ok_and(|t| t.contains("handing over to a new relay"))
}

/// Every stream writes byte `b` at once and waits for its echo; the
/// streams come back in their order, each with its round trip (ms) or why
/// it failed.
async fn burst(
    streams: Vec<roam::RoamStream>,
    b: u8,
) -> io::Result<Vec<(roam::RoamStream, Result<f64, String>)>> {
    let mut probes = tokio::task::JoinSet::new();
    for (i, mut stream) in streams.into_iter().enumerate() {
        probes.spawn(async move {
            let r = probe(&mut stream, b).await;
            (i, stream, r)
        });
    }
    let mut back = Vec::new();
    while let Some(j) = probes.join_next().await {
        back.push(j.map_err(io::Error::other)?);
    }
    back.sort_by_key(|(i, _, _)| *i);
    Ok(back.into_iter().map(|(_, s, r)| (s, r)).collect())
}

/// One 1-byte echo on `stream`: its round trip (ms), or why it failed.
async fn probe(stream: &mut roam::RoamStream, b: u8) -> Result<f64, String> {
    let t = Instant::now();
    let r = tokio::time::timeout(ROUND_TIMEOUT, async {
        stream.write_all(&[b]).await?;
        let mut got = [0u8; 1];
        stream.read_exact(&mut got).await?;
        io::Result::Ok(got[0])
    })
    .await;
    match r {
        Ok(Ok(got)) if got == b => Ok(t.elapsed().as_secs_f64() * 1e3),
        Ok(Ok(got)) => Err(format!("echo {got}, not {b}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no echo in {ROUND_TIMEOUT:?}")),
    }
}

async fn one_count(ctx: &Ctx, lab: &Lab, n: usize, rounds: usize) -> io::Result<Row> {
    let state = ctx.env.dir.join(format!("takeover-{n}"));
    std::fs::create_dir_all(&state)?;
    let port = free_port()?;
    let target = lab.targets.addr.to_string();
    let mut relay = start_relay(ctx, &state, port, &target, 0, false)?;
    wait_listening(lo(port), &relay.proc, Duration::from_secs(20)).await?;
    progress(&format!("takeover: opening {n} sessions"));
    let relay_addr = lo(port).to_string();
    let mut opened = Vec::with_capacity(n);
    let mut set = tokio::task::JoinSet::new();
    let mut next = 0;
    while opened.len() < n {
        while set.len() < OPEN_PARALLEL && next < n {
            let (a, t, c) = (
                relay_addr.clone(),
                target.clone(),
                client_config(&ctx.keypair),
            );
            set.spawn(async move { open_echo_session(&a, &t, c).await });
            next += 1;
        }
        match set.join_next().await {
            Some(Ok(Ok(s))) => opened.push(s),
            Some(Ok(Err(e))) => return Err(io::Error::other(format!("opening sessions: {e}"))),
            Some(Err(e)) => return Err(io::Error::other(e)),
            None => break,
        }
    }
    let suspended = Arc::new(Mutex::new(vec![false; n]));
    let mut watchers = Vec::with_capacity(n);
    for (i, (session, _)) in opened.iter().enumerate() {
        let mut rx = session.events();
        let suspended = suspended.clone();
        watchers.push(tokio::spawn(async move {
            loop {
                match rx.recv().await {
                    Ok(SessionEvent::Suspended { .. }) => {
                        suspended.lock().unwrap_or_else(|e| e.into_inner())[i] = true;
                    }
                    Ok(SessionEvent::Closed { .. })
                    | Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    _ => {}
                }
            }
        }));
    }
    // The probe burst alone, without a takeover: every client at once.
    let mut burst_ms = Vec::new();
    {
        let (handles, streams): (Vec<_>, Vec<_>) = std::mem::take(&mut opened).into_iter().unzip();
        let back = burst(streams, 0xaa).await?;
        burst_ms.extend(back.iter().filter_map(|(_, r)| r.as_ref().ok().copied()));
        opened = handles
            .into_iter()
            .zip(back.into_iter().map(|(s, _)| s))
            .collect();
    }
    let mut stalls = Vec::new();
    let mut handovers = Vec::new();
    let mut taking_out = Vec::new();
    let mut sending = Vec::new();
    let mut all_served = Vec::new();
    let mut echo_failures = 0;
    let mut resumed = 0;
    let (mut stopped_p50, mut stopped_p99, mut stopped_max) = (Vec::new(), Vec::new(), Vec::new());
    let result: io::Result<()> = async {
        for round in 1..=rounds {
            let successor = start_relay(ctx, &state, port, &target, round, true)?;
            let end = Instant::now() + ROUND_TIMEOUT;
            while !handing_over(&relay.log) {
                if Instant::now() >= end {
                    return Err(io::Error::other(format!(
                        "round {round}: the old relay did not begin the handover in {ROUND_TIMEOUT:?}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let announced = Instant::now();
            let (handles, streams): (Vec<_>, Vec<_>) =
                std::mem::take(&mut opened).into_iter().unzip();
            let back = burst(streams, round as u8).await?;
            all_served.push(announced.elapsed().as_secs_f64() * 1e3);
            for (i, (_, r)) in back.iter().enumerate() {
                match r {
                    Ok(ms) => stalls.push(*ms),
                    Err(e) => {
                        echo_failures += 1;
                        if echo_failures <= 3 {
                            progress(&format!("takeover: round {round}: session {i}: {e}"));
                        }
                    }
                }
            }
            opened = handles.into_iter().zip(back.into_iter().map(|(s, _)| s)).collect();
            if !wait_exit(&relay.proc, Duration::from_secs(20)).await {
                return Err(io::Error::other(format!("round {round}: the old relay did not exit after the takeover")));
            }
            if let Some((total, out, send)) = handover_ms(&relay.log) {
                handovers.push(total);
                taking_out.push(out);
                sending.push(send);
            }
            relay = successor;
            if let Some((p50, p99, max)) = stopped_ms(&relay.log).await {
                stopped_p50.push(p50);
                stopped_p99.push(p99);
                stopped_max.push(max);
            }
            for (_, stream) in opened.iter_mut() {
                if probe(stream, round as u8 ^ 0xff).await.is_err() {
                    echo_failures += 1;
                }
            }
            for s in suspended.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
                resumed += usize::from(std::mem::take(s));
            }
            progress(&format!(
                "takeover: {n} sessions, round {round}: handover {} ms ({} taking out, {} sending), sessions stopped p99 {} ms (max {}), every client's byte back {} ms after the announcement, stall p99 so far {:.1} ms, {resumed} resumed",
                handovers.last().map_or("?".into(), |v| format!("{v:.0}")),
                taking_out.last().map_or("?".into(), |v| format!("{v:.0}")),
                sending.last().map_or("?".into(), |v| format!("{v:.0}")),
                stopped_p99.last().map_or("?".into(), |v| format!("{v:.1}")),
                stopped_max.last().map_or("?".into(), |v| format!("{v:.1}")),
                all_served.last().map_or("?".into(), |v| format!("{v:.1}")),
                summary(&stalls).p99
            ));
        }
        Ok(())
    }
    .await;
    for (session, stream) in opened {
        drop(stream);
        let _ = tokio::time::timeout(Duration::from_secs(5), session.close(0, "")).await;
    }
    for w in watchers {
        w.abort();
    }
    drop(relay);
    result?;
    Ok(Row {
        sessions: n,
        requested: None,
        rounds,
        stall_ms: summary(&stalls),
        burst_ms: summary(&burst_ms),
        stopped_p50_ms: stopped_p50,
        stopped_p99_ms: stopped_p99,
        stopped_max_ms: stopped_max,
        resumed,
        handover_ms: handovers,
        taking_out_ms: taking_out,
        sending_ms: sending,
        all_served_ms: all_served,
        echo_failures,
    })
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Takeover> {
    let mut rows = Vec::new();
    let mut by_n = BTreeMap::new();
    for &n in &ctx.plan.takeover_sessions {
        lab.check_alive()?;
        // A session costs the relay its client and target connections; its
        // process keeps 400 descriptors for everything else.
        let fits = (ctx.nofile.saturating_sub(400) / 2) as usize;
        let run_n = if n <= fits {
            n
        } else {
            (fits / 1000 * 1000).max(1)
        };
        if run_n < n {
            progress(&format!(
                "takeover: {n} sessions need {} descriptors in the relay, over this machine's open-file limit of {}; measuring {run_n}",
                2 * n + 400,
                ctx.nofile
            ));
        }
        let mut row = one_count(&ctx, &lab, run_n, ctx.plan.takeover_rounds).await?;
        if run_n < n {
            row.requested = Some(n);
        }
        let worst_stop = row.stopped_p99_ms.iter().copied().fold(f64::NAN, f64::max);
        // A round without the new relay's report cannot count as met.
        let stop = if row.stopped_p99_ms.len() == row.rounds {
            worst_stop
        } else {
            f64::INFINITY
        };
        by_n.insert(n, row.stall_ms.p99.max(stop));
        rows.push(row);
    }
    Ok(Takeover {
        rows,
        target_ms: TARGET_MS,
        target_met_at_1000: by_n.get(&1000).map(|p99| *p99 <= TARGET_MS),
    })
}
