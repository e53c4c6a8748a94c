//! Scenario 8: relay upgrade without loss (`roam serve --takeover`).
//!
//! Per session count `n`: a relay of its own (own state directory and
//! takeover socket) holds `n` library sessions, each with one stream to the
//! echo target proven by a 1 KiB echo. Then, `rounds` times, a new
//! `roam serve --takeover` process is started; the old relay hands over its
//! listener, sessions and target connections and exits. Measured per round:
//!
//! - each session's interruption as its client sees it, from its `Suspended`
//!   event (the old relay dropped its transport) to its `Resumed` event on
//!   the new relay (p50, p99, max over all sessions and rounds);
//! - the old relay's own handover time (it logs "handed N sessions ... in X
//!   ms": from accepting the takeover to the new relay's receipt);
//! - the time from starting the new process until every session resumed;
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
/// Longest wait for every session to resume after a takeover.
const RESUME_TIMEOUT: Duration = Duration::from_secs(60);
/// Sessions opened at once while setting up.
const OPEN_PARALLEL: usize = 64;

/// One session count's figures.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) sessions: usize,
    pub(crate) rounds: usize,
    /// Per session and round: `Suspended` to `Resumed` (ms).
    pub(crate) interruption_ms: Summary,
    /// The old relay's handover time per round (ms), from its log.
    pub(crate) handover_ms: Vec<f64>,
    /// Its parts: stopping relays and detaching sessions (ms) ...
    pub(crate) taking_out_ms: Vec<f64>,
    /// ... and sending them until the new relay's receipt (ms).
    pub(crate) sending_ms: Vec<f64>,
    /// Per round: new process started until every session resumed (ms).
    pub(crate) all_resumed_ms: Vec<f64>,
    /// Streams whose echo failed after a round (should be 0).
    pub(crate) echo_failures: usize,
    /// Sessions that had not resumed within the timeout (should be 0).
    pub(crate) not_resumed: usize,
}

/// The scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct Takeover {
    pub(crate) rows: Vec<Row>,
    pub(crate) target_ms: f64,
    /// p99 interruption at 1,000 sessions within the target (None if that
    /// count was not run).
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

/// Per session: when its transport was last lost and when it resumed.
#[derive(Default, Clone, Copy)]
struct Marks {
    suspended: Option<Instant>,
    resumed: Option<Instant>,
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
    let marks: Arc<Mutex<Vec<Marks>>> = Arc::new(Mutex::new(vec![Marks::default(); n]));
    let mut watchers = Vec::with_capacity(n);
    for (i, (session, _)) in opened.iter().enumerate() {
        let mut rx = session.events();
        let marks = marks.clone();
        watchers.push(tokio::spawn(async move {
            loop {
                match rx.recv().await {
                    Ok(SessionEvent::Suspended { .. }) => {
                        marks.lock().unwrap_or_else(|e| e.into_inner())[i].suspended =
                            Some(Instant::now());
                    }
                    Ok(SessionEvent::Resumed { .. }) => {
                        marks.lock().unwrap_or_else(|e| e.into_inner())[i].resumed =
                            Some(Instant::now());
                    }
                    Ok(SessionEvent::Closed { .. })
                    | Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    _ => {}
                }
            }
        }));
    }
    let mut interruptions = Vec::new();
    let mut handovers = Vec::new();
    let mut taking_out = Vec::new();
    let mut sending = Vec::new();
    let mut all_resumed = Vec::new();
    let mut echo_failures = 0;
    let mut not_resumed = 0;
    let result: io::Result<()> = async {
        for round in 1..=rounds {
            for m in marks.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
                *m = Marks::default();
            }
            let started = Instant::now();
            let successor = start_relay(ctx, &state, port, &target, round, true)?;
            let end = started + RESUME_TIMEOUT;
            loop {
                let done = marks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .filter(|m| m.resumed.is_some())
                    .count();
                if done == n {
                    all_resumed.push(started.elapsed().as_secs_f64() * 1e3);
                    break;
                }
                if Instant::now() >= end {
                    not_resumed += n - done;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if !wait_exit(&relay.proc, Duration::from_secs(20)).await {
                return Err(io::Error::other(format!("round {round}: the old relay did not exit after the takeover")));
            }
            if let Some((total, out, send)) = handover_ms(&relay.log) {
                handovers.push(total);
                taking_out.push(out);
                sending.push(send);
            }
            for m in marks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                if let (Some(s), Some(r)) = (m.suspended, m.resumed) {
                    interruptions.push(r.saturating_duration_since(s).as_secs_f64() * 1e3);
                }
            }
            relay = successor;
            for (_, stream) in opened.iter_mut() {
                let ok = tokio::time::timeout(Duration::from_secs(10), async {
                    stream.write_all(&[round as u8]).await?;
                    let mut b = [0u8; 1];
                    stream.read_exact(&mut b).await?;
                    io::Result::Ok(b[0] == round as u8)
                })
                .await;
                if !matches!(ok, Ok(Ok(true))) {
                    echo_failures += 1;
                }
            }
            progress(&format!(
                "takeover: {n} sessions, round {round}: handover {} ms ({} taking out, {} sending), every session resumed after {} ms",
                handovers.last().map_or("?".into(), |v| format!("{v:.0}")),
                taking_out.last().map_or("?".into(), |v| format!("{v:.0}")),
                sending.last().map_or("?".into(), |v| format!("{v:.0}")),
                all_resumed.last().map_or("?".into(), |v| format!("{v:.1}"))
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
        rounds,
        interruption_ms: summary(&interruptions),
        handover_ms: handovers,
        taking_out_ms: taking_out,
        sending_ms: sending,
        all_resumed_ms: all_resumed,
        echo_failures,
        not_resumed,
    })
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Takeover> {
    let mut rows = Vec::new();
    let mut by_n = BTreeMap::new();
    for &n in &ctx.plan.takeover_sessions {
        lab.check_alive()?;
        let row = one_count(&ctx, &lab, n, ctx.plan.takeover_rounds).await?;
        by_n.insert(n, row.interruption_ms.p99);
        rows.push(row);
    }
    Ok(Takeover {
        rows,
        target_ms: TARGET_MS,
        target_met_at_1000: by_n.get(&1000).map(|p99| *p99 <= TARGET_MS),
    })
}
