//! Scenario 4: failure detection on an idle session and resume time once
//! connectivity returns, against the number of open streams.
//!
//! Per stream count `n`: a library client session reaches `roam serve`
//! through its own fault proxy (`roam_sim::proxy::FaultProxy`) and opens `n`
//! streams to the echo target, each proven with a 1-byte echo. After a
//! short idle period every proxy black-holes at the same moment (nothing
//! flows, connections stay open: a dead Wi-Fi). Detection is the time until
//! the client's `Suspended` event, and until the relay lists the session
//! as suspended (its control socket, as `roam status` reads it). Then the
//! proxies are lifted one at a time; resume time is from the lift to the
//! client's `Resumed` event, then to a 1-byte echo on the last stream, then
//! to a 1-byte echo on every stream.
//!
//! The reference is rocks (Zandy & Miller 2002): resume cost 1.6 + 0.55·n ms.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use roam::{SessionEvent, SessionHandle};
use roam_sim::proxy::FaultProxy;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::broadcast;

use super::progress;
use crate::agent::client_config;
use crate::load::OP_ECHO;
use crate::peers::Lab;
use crate::stats::{linear_fit, median, summary, Summary};
use crate::Ctx;

/// rocks' resume cost: intercept (ms) and per-stream slope (ms).
pub(crate) const PAPER_MS: (f64, f64) = (1.6, 0.55);
/// Idle time before the black hole (several heartbeats pass).
const IDLE: Duration = Duration::from_millis(1500);
/// Wait after every session was seen suspended, before lifting.
const SETTLE: Duration = Duration::from_millis(500);
/// Longest wait for any one event.
const EVENT_TIMEOUT: Duration = Duration::from_secs(40);
/// Control-socket polling period while waiting for the relay to notice.
const POLL: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sample {
    pub(crate) round: usize,
    pub(crate) detect_client_ms: f64,
    /// From the relay's `suspended_for`; `None` if its control socket had no answer.
    pub(crate) detect_relay_ms: Option<f64>,
    pub(crate) resumed_event_ms: f64,
    pub(crate) first_echo_ms: f64,
    pub(crate) all_streams_echo_ms: f64,
    /// Re-dial attempts the client announced while suspended.
    pub(crate) redials: u32,
}

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) streams: usize,
    pub(crate) detect_client_ms: Summary,
    pub(crate) detect_relay_ms: Option<Summary>,
    pub(crate) resumed_event_ms: Summary,
    pub(crate) first_echo_ms: Summary,
    pub(crate) all_streams_echo_ms: Summary,
    /// rocks' 1.6 + 0.55·n ms at this `n`, for comparison.
    pub(crate) paper_model_ms: f64,
    pub(crate) samples: Vec<Sample>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Resume {
    pub(crate) heartbeat_interval_ms: f64,
    pub(crate) suspend_after_ms: f64,
    pub(crate) rounds: usize,
    pub(crate) rows: Vec<Row>,
    /// Least-squares fit of median time-to-first-echo against `n`.
    pub(crate) fit_intercept_ms: f64,
    pub(crate) fit_slope_ms_per_stream: f64,
    pub(crate) paper_slope_ms_per_stream: f64,
    /// The fitted slope is under a tenth of rocks' per-stream cost.
    pub(crate) resume_flat_in_streams: bool,
}

struct Probe {
    n: usize,
    proxy: FaultProxy,
    session: SessionHandle,
    streams: Vec<roam::RoamStream>,
    events: broadcast::Receiver<SessionEvent>,
}

/// Waits for the first event matching `pred`; returns when it arrived and
/// how many `Redialing` events passed meanwhile.
async fn wait_event(
    rx: &mut broadcast::Receiver<SessionEvent>,
    what: &str,
    pred: impl Fn(&SessionEvent) -> bool,
) -> io::Result<(Instant, u32)> {
    let mut redials = 0;
    let r = tokio::time::timeout(EVENT_TIMEOUT, async {
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    if matches!(ev, SessionEvent::Redialing { .. }) {
                        redials += 1;
                    }
                    if pred(&ev) {
                        return Ok(Instant::now());
                    }
                    if let SessionEvent::Closed { reason } = ev {
                        return Err(io::Error::other(format!(
                            "session closed waiting for {what}: {reason:?}"
                        )));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(io::Error::other(format!(
                        "event channel closed waiting for {what}"
                    )))
                }
            }
        }
    })
    .await
    .map_err(|_| io::Error::other(format!("no {what} within {EVENT_TIMEOUT:?}")))??;
    Ok((r, redials))
}

/// One byte out and back on every stream in `streams`.
async fn echo_all(streams: &mut [roam::RoamStream], byte: u8) -> io::Result<()> {
    for s in streams.iter_mut() {
        s.write_all(&[byte]).await?;
    }
    for s in streams.iter_mut() {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await?;
        if b[0] != byte {
            return Err(io::Error::other(format!(
                "echo returned {:#x}, not {byte:#x}",
                b[0]
            )));
        }
    }
    Ok(())
}

/// The relay's view: for each `n`, seconds since the relay suspended a
/// session with `n` streams, if it did.
async fn relay_suspended(lab: &Lab, counts: &[usize]) -> Option<Vec<Option<f64>>> {
    let v = crate::procs::control_status(&lab.serve.control_socket(), Duration::from_secs(2))
        .await
        .ok()?;
    let sessions = v.get("sessions")?.as_array()?;
    Some(
        counts
            .iter()
            .map(|&n| {
                sessions
                    .iter()
                    .filter(|s| s.get("streams").and_then(|x| x.as_u64()) == Some(n as u64))
                    .filter(|s| {
                        s.get("state")
                            .and_then(|x| x.as_str())
                            .is_some_and(|st| st.eq_ignore_ascii_case("suspended"))
                    })
                    .find_map(|s| s.get("suspended_for_secs").and_then(|x| x.as_f64()))
            })
            .collect(),
    )
}

async fn open_probe(ctx: &Ctx, lab: &Lab, n: usize) -> io::Result<Probe> {
    let proxy = FaultProxy::start(lab.serve.addr).await?;
    let session = roam::connect(&proxy.addr().to_string(), client_config(&ctx.keypair))
        .await
        .map_err(|e| io::Error::other(format!("session through the fault proxy: {e}")))?;
    let mut probe = Probe {
        n,
        proxy,
        events: session.events(),
        session,
        streams: Vec::with_capacity(n),
    };
    match open_streams(lab, &mut probe).await {
        Ok(()) => Ok(probe),
        Err(e) => {
            close_probe(probe).await;
            Err(e)
        }
    }
}

async fn open_streams(lab: &Lab, p: &mut Probe) -> io::Result<()> {
    let n = p.n;
    let target = lab.targets.addr.to_string();
    for _ in 0..n {
        let mut s = p.session.open_stream(target.as_bytes()).map_err(|e| {
            io::Error::other(format!("opening stream {} of {n}: {e}", p.streams.len()))
        })?;
        s.write_all(&[OP_ECHO]).await?;
        p.streams.push(s);
    }
    tokio::time::timeout(Duration::from_secs(120), echo_all(&mut p.streams, 1))
        .await
        .map_err(|_| io::Error::other(format!("{n} streams: first echo timed out")))?
        .map_err(|e| io::Error::new(e.kind(), format!("{n} streams: first echo: {e}")))
}

/// Closes a probe's session through its proxy (lifted first), then drops
/// the proxy. Dropping the proxy first would cut the session without its
/// close: the relay would keep it suspended, with every stream's target
/// connection open, for its resume timeout (days), and the scenarios after
/// this one would run against those leftovers (descriptors, target caps).
async fn close_probe(p: Probe) {
    p.proxy.blackhole(false);
    drop(p.streams);
    if tokio::time::timeout(Duration::from_secs(10), p.session.close(0, ""))
        .await
        .is_err()
    {
        progress(&format!(
            "resume: the session with {} streams did not close within 10 s",
            p.n
        ));
    }
    drop(p.proxy);
}

/// One round; whatever happens, every probe's session is closed before its
/// proxy goes (see [`close_probe`]).
async fn one_round(ctx: &Ctx, lab: &Lab, round: usize) -> io::Result<Vec<Sample>> {
    let mut probes = Vec::new();
    let r = measure(ctx, lab, round, &mut probes).await;
    for p in probes {
        close_probe(p).await;
    }
    r
}

async fn measure(
    ctx: &Ctx,
    lab: &Lab,
    round: usize,
    probes: &mut Vec<Probe>,
) -> io::Result<Vec<Sample>> {
    let counts = &ctx.plan.stream_counts;
    for &n in counts {
        probes.push(open_probe(ctx, lab, n).await?);
        progress(&format!("resume round {}: {n} streams open", round + 1));
    }
    tokio::time::sleep(IDLE).await;
    let t0 = Instant::now();
    for p in probes.iter() {
        p.proxy.blackhole(true);
    }
    // The client side: each session's Suspended event, waited for together.
    let mut waits = tokio::task::JoinSet::new();
    for (i, p) in probes.iter().enumerate() {
        let mut rx = p.events.resubscribe();
        waits.spawn(async move {
            let r = wait_event(&mut rx, "Suspended", |e| {
                matches!(e, SessionEvent::Suspended { .. })
            })
            .await;
            (i, r)
        });
    }
    // The relay side, meanwhile, from its control socket.
    let mut relay_detect: Vec<Option<f64>> = vec![None; counts.len()];
    let mut client_detect: Vec<Option<f64>> = vec![None; counts.len()];
    let deadline = t0 + EVENT_TIMEOUT;
    let mut socket_answers = false;
    while Instant::now() < deadline {
        while let Some(j) = waits.try_join_next() {
            let (i, r) = j.map_err(io::Error::other)?;
            let (at, _) = r.map_err(|e| io::Error::other(format!("{} streams: {e}", counts[i])))?;
            client_detect[i] = Some((at - t0).as_secs_f64() * 1000.0);
        }
        if let Some(v) = relay_suspended(lab, counts).await {
            socket_answers = true;
            let now = Instant::now();
            for (i, s) in v.into_iter().enumerate() {
                if let (None, Some(secs)) = (relay_detect[i], s) {
                    let since = now.saturating_duration_since(t0).as_secs_f64() - secs;
                    relay_detect[i] = Some(since * 1000.0);
                }
            }
        }
        let relay_done = !socket_answers || relay_detect.iter().all(Option::is_some);
        if client_detect.iter().all(Option::is_some) && relay_done {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    if client_detect.iter().any(Option::is_none) {
        return Err(io::Error::other(
            "a client session never reported Suspended",
        ));
    }
    tokio::time::sleep(SETTLE).await;
    let mut samples = Vec::new();
    for (i, p) in probes.iter_mut().enumerate() {
        let mut rx = p.session.events();
        let t1 = Instant::now();
        p.proxy.blackhole(false);
        let (resumed, _) = wait_event(&mut rx, "Resumed", |e| {
            matches!(e, SessionEvent::Resumed { .. })
        })
        .await
        .map_err(|e| io::Error::other(format!("{} streams: {e}", p.n)))?;
        let last = p.streams.len() - 1;
        echo_all(&mut p.streams[last..], 2).await?;
        let first_echo = Instant::now();
        tokio::time::timeout(Duration::from_secs(120), echo_all(&mut p.streams, 3))
            .await
            .map_err(|_| {
                io::Error::other(format!("{} streams: echo after resume timed out", p.n))
            })??;
        let all_echo = Instant::now();
        let redials = {
            let mut c = 0;
            while let Ok(ev) = p.events.try_recv() {
                if matches!(ev, SessionEvent::Redialing { .. }) {
                    c += 1;
                }
            }
            c
        };
        let ms = |t: Instant| (t - t1).as_secs_f64() * 1000.0;
        samples.push(Sample {
            round,
            detect_client_ms: client_detect[i].unwrap_or(f64::NAN),
            detect_relay_ms: relay_detect[i],
            resumed_event_ms: ms(resumed),
            first_echo_ms: ms(first_echo),
            all_streams_echo_ms: ms(all_echo),
            redials,
        });
        progress(&format!(
            "resume round {}: {} streams: detected {:.0} ms, resumed {:.1} ms, first echo {:.1} ms",
            round + 1,
            p.n,
            client_detect[i].unwrap_or(f64::NAN),
            ms(resumed),
            ms(first_echo)
        ));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(samples)
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Resume> {
    let plan = &ctx.plan;
    let mut all: Vec<Sample> = Vec::new();
    for round in 0..plan.resume_rounds {
        all.extend(one_round(&ctx, &lab, round).await?);
        lab.check_alive()?;
    }
    let mut rows = Vec::new();
    for (i, &n) in plan.stream_counts.iter().enumerate() {
        let s: Vec<Sample> = all
            .iter()
            .skip(i)
            .step_by(plan.stream_counts.len())
            .cloned()
            .collect();
        let col = |f: fn(&Sample) -> f64| summary(&s.iter().map(f).collect::<Vec<_>>());
        let relay: Vec<f64> = s.iter().filter_map(|x| x.detect_relay_ms).collect();
        rows.push(Row {
            streams: n,
            detect_client_ms: col(|x| x.detect_client_ms),
            detect_relay_ms: (!relay.is_empty()).then(|| summary(&relay)),
            resumed_event_ms: col(|x| x.resumed_event_ms),
            first_echo_ms: col(|x| x.first_echo_ms),
            all_streams_echo_ms: col(|x| x.all_streams_echo_ms),
            paper_model_ms: PAPER_MS.0 + PAPER_MS.1 * n as f64,
            samples: s,
        });
    }
    let pts: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| {
            (
                r.streams as f64,
                median(
                    &r.samples
                        .iter()
                        .map(|s| s.first_echo_ms)
                        .collect::<Vec<_>>(),
                ),
            )
        })
        .collect();
    let (a, b) = linear_fit(&pts);
    let defaults = roam_proto::Config::default();
    Ok(Resume {
        heartbeat_interval_ms: defaults.heartbeat_interval.as_secs_f64() * 1000.0,
        suspend_after_ms: defaults.suspend_after.as_secs_f64() * 1000.0,
        rounds: plan.resume_rounds,
        rows,
        fit_intercept_ms: a,
        fit_slope_ms_per_stream: b,
        paper_slope_ms_per_stream: PAPER_MS.1,
        resume_flat_in_streams: b.is_finite() && b < PAPER_MS.1 / 10.0,
    })
}
