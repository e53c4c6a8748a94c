//! Scenario 6: many sessions at once. `n` clients are connected first; then
//! every client asks the target for a download (16 KiB writes, without
//! end) at the same moment. After a warm-up that fills every buffer along
//! the paths, each client counts the bytes it receives during one common
//! window. Per-client throughput is its count over the window; aggregate is
//! the sum over the window. Counting at the receiver inside one window
//! measures delivery, not how much each sender could park in socket and
//! session buffers (about 2 MB per TCP connection here).
//!
//! What one "session" is differs by peer and is reported as `unit`:
//! a TCP connection (direct; socat, which forks per connection; socat2,
//! two chained socats, two hops like `roam forward`), a channel
//! of one ssh connection (`ssh -L`), a stream of one roam session
//! (`roam forward`), or a roam session of its own (`roam-sessions`: library
//! sessions to `roam serve`, one stream each).
//!
//! Beside each round the kernel's TCP counters (`/proc/net/netstat`,
//! `/proc/net/snmp`, as `nstat` reads them) are recorded as deltas from
//! before the clients connect to the end of the window: memory pressure,
//! drops, time-outs and retransmits say whether a low number came from the
//! peer or from the kernel running out of socket memory. They are
//! system-wide (this network namespace), so other work on the machine adds
//! to them.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{progress, RatioRow};
use crate::agent::client_config;
use crate::load::{self, Conn};
use crate::peers::{order, Dial, Lab, Peer, DIRECT, ROAM_FORWARD, SOCAT, SOCAT2, SSH};
use crate::procs::{net_counters, tree_cpu_seconds};
use crate::stats::{jain, median, quantile_sorted, ratio, sorted};
use crate::Ctx;

/// Write size of the target for every client (bytes).
const BLOCK: usize = 16 * 1024;
/// The kernel counters recorded beside each round (`Group:Name` of
/// `/proc/net/netstat` and `/proc/net/snmp`, as `nstat` names them).
pub(crate) const NET_COUNTERS: &[&str] = &[
    "TcpExt:TCPMemoryPressures",
    "TcpExt:TCPMemoryPressuresChrono",
    "TcpExt:TCPAbortOnMemory",
    "TcpExt:PruneCalled",
    "TcpExt:RcvPruned",
    "TcpExt:TCPBacklogDrop",
    "TcpExt:TCPRcvQDrop",
    "TcpExt:TCPZeroWindowDrop",
    "TcpExt:TCPOFODrop",
    "TcpExt:ListenOverflows",
    "TcpExt:ListenDrops",
    "TcpExt:TCPTimeouts",
    "Tcp:RetransSegs",
];

/// Deltas of [`NET_COUNTERS`] between two snapshots (counters missing on
/// this kernel are left out).
pub(crate) fn counter_deltas(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    NET_COUNTERS
        .iter()
        .filter_map(|k| {
            let (a, b) = (after.get(*k)?, before.get(*k)?);
            Some((k.to_string(), a.saturating_sub(*b)))
        })
        .collect()
}

/// Connections being set up at once.
const CONNECT_CONCURRENCY: usize = 32;
const ROAM_SESSIONS: &str = "roam-sessions";

#[derive(Debug, Serialize)]
pub(crate) struct Round {
    pub(crate) aggregate_mbps: f64,
    pub(crate) min_mbps: f64,
    pub(crate) median_mbps: f64,
    pub(crate) max_mbps: f64,
    pub(crate) jain_index: f64,
    pub(crate) connect_seconds: f64,
    /// Bytes received per client inside the window: min, median, max.
    pub(crate) bytes_min: u64,
    pub(crate) bytes_median: u64,
    pub(crate) bytes_max: u64,
    /// Clients that received nothing inside the window.
    pub(crate) starved: usize,
    /// Kernel TCP counters, increase from before connecting to the end of
    /// the window (see [`NET_COUNTERS`]).
    pub(crate) net_counters: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) peer: &'static str,
    pub(crate) unit: &'static str,
    pub(crate) clients: usize,
    /// Medians over rounds.
    pub(crate) aggregate_mbps: f64,
    pub(crate) min_mbps: f64,
    pub(crate) median_mbps: f64,
    pub(crate) max_mbps: f64,
    pub(crate) jain_index: f64,
    /// Median over rounds of the clients that received nothing.
    pub(crate) starved: f64,
    /// Kernel TCP counters summed over the rounds.
    pub(crate) net_counters: BTreeMap<String, u64>,
    pub(crate) rounds: Vec<Round>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Many {
    pub(crate) clients: usize,
    pub(crate) direction: &'static str,
    pub(crate) warmup_seconds: f64,
    pub(crate) window_seconds: f64,
    pub(crate) block_bytes: usize,
    pub(crate) rows: Vec<Row>,
    /// Aggregate throughput ratios (higher is better for roam).
    pub(crate) ratios: Vec<RatioRow>,
}

enum How {
    Peer(Peer),
    Sessions,
}

struct Case {
    name: &'static str,
    unit: &'static str,
    how: How,
}

async fn connect_all(
    ctx: &Ctx,
    lab: &Lab,
    how: &How,
    n: usize,
) -> io::Result<(Vec<Conn>, Vec<roam::SessionHandle>)> {
    let sem = Arc::new(tokio::sync::Semaphore::new(CONNECT_CONCURRENCY));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let permit = sem
            .clone()
            .acquire_owned()
            .await
            .map_err(io::Error::other)?;
        let relay = lab.serve.addr.to_string();
        let target = lab.targets.addr.to_string();
        let config = client_config(&ctx.keypair);
        let peer = match how {
            How::Peer(p) => Some(p.clone()),
            How::Sessions => None,
        };
        set.spawn(async move {
            let _permit = permit;
            tokio::time::timeout(Duration::from_secs(60), async move {
                match peer {
                    Some(p) => Ok((p.connect(false).await?, None)),
                    None => {
                        let s = roam::connect(&relay, config)
                            .await
                            .map_err(io::Error::other)?;
                        let st = s.open_stream(target.as_bytes()).map_err(io::Error::other)?;
                        let c: Conn = Box::new(st);
                        Ok::<_, io::Error>((c, Some(s)))
                    }
                }
            })
            .await
            .unwrap_or_else(|_| Err(io::Error::other("connect timed out")))
        });
    }
    let mut conns = Vec::with_capacity(n);
    let mut sessions = Vec::new();
    while let Some(r) = set.join_next().await {
        let (c, s) = r.map_err(io::Error::other)??;
        conns.push(c);
        sessions.extend(s);
    }
    Ok((conns, sessions))
}

async fn one(ctx: &Ctx, lab: &Lab, case: &Case) -> io::Result<Round> {
    let n = ctx.plan.many_clients;
    let warmup = Duration::from_secs_f64(ctx.plan.many_warmup_seconds);
    let window = Duration::from_secs_f64(ctx.plan.many_seconds);
    let net0 = net_counters();
    let t = Instant::now();
    let (conns, sessions) = connect_all(ctx, lab, &case.how, n).await?;
    let connect_seconds = t.elapsed().as_secs_f64();
    let start = Instant::now() + Duration::from_millis(200);
    let from = start + warmup;
    let end = from + window;
    let mut set = tokio::task::JoinSet::new();
    for mut c in conns {
        set.spawn(async move {
            tokio::time::sleep_until(start.into()).await;
            let r = tokio::time::timeout_at(
                (end + Duration::from_secs(30)).into(),
                load::download_window(&mut c, BLOCK, from, end),
            )
            .await
            .unwrap_or_else(|_| Err(io::Error::other("download timed out")));
            // Close after every client finished: early closes would free
            // capacity for the others while they still measure.
            (r, c)
        });
    }
    let mut counts = Vec::with_capacity(n);
    let mut keep = Vec::with_capacity(n);
    let mut failed = None;
    while let Some(j) = set.join_next().await {
        let (r, c) = j.map_err(io::Error::other)?;
        keep.push(c);
        match r {
            Ok(b) => counts.push(b),
            Err(e) => failed = Some(e),
        }
    }
    let net = counter_deltas(&net0, &net_counters());
    drop(keep);
    let mut closing = tokio::task::JoinSet::new();
    for s in sessions {
        closing.spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(3), s.close(0, "")).await;
        });
    }
    while closing.join_next().await.is_some() {}
    if let Some(e) = failed {
        return Err(io::Error::new(
            e.kind(),
            format!("{} of {n} clients via {}: {e}", n - counts.len(), case.name),
        ));
    }
    let secs = window.as_secs_f64();
    let per: Vec<f64> = counts.iter().map(|&b| b as f64 / secs / 1e6).collect();
    let total: u64 = counts.iter().sum();
    let s = sorted(&per);
    let b = sorted(&counts.iter().map(|&x| x as f64).collect::<Vec<_>>());
    Ok(Round {
        aggregate_mbps: total as f64 / secs / 1e6,
        min_mbps: quantile_sorted(&s, 0.0),
        median_mbps: quantile_sorted(&s, 0.5),
        max_mbps: quantile_sorted(&s, 1.0),
        jain_index: jain(&per),
        connect_seconds,
        bytes_min: quantile_sorted(&b, 0.0) as u64,
        bytes_median: quantile_sorted(&b, 0.5) as u64,
        bytes_max: quantile_sorted(&b, 1.0) as u64,
        starved: counts.iter().filter(|&&c| c == 0).count(),
        net_counters: net,
    })
}

/// CPU a peer's processes may still use, per [`SETTLE_STEP`], and count as idle.
const SETTLE_IDLE: f64 = 0.02;
/// How often [`settle`] looks at the peer's processes.
const SETTLE_STEP: Duration = Duration::from_millis(200);
/// Longest [`settle`] waits.
const SETTLE_MAX: Duration = Duration::from_secs(20);

/// Waits until the processes of `peer` and the target are idle (under 10 %
/// of a core), at most [`SETTLE_MAX`]: after its clients are gone a relay
/// may go on working through what it buffered (the ssh-L round left sshd at
/// 100 % of a core for seconds, with 1 GB of channel data, and the next
/// peer measured on one core). Returns whether they went idle and the
/// seconds waited.
async fn settle(lab: &Lab, peer: &str) -> (bool, f64) {
    let mut roots = lab.cpu_roots(if peer == ROAM_SESSIONS {
        crate::peers::ROAM_SESSION
    } else {
        peer
    });
    roots.push(lab.targets.pid());
    let t = Instant::now();
    let mut before = tree_cpu_seconds(&roots);
    while t.elapsed() < SETTLE_MAX {
        tokio::time::sleep(SETTLE_STEP).await;
        let now = tree_cpu_seconds(&roots);
        if now - before < SETTLE_IDLE {
            return (true, t.elapsed().as_secs_f64());
        }
        before = now;
    }
    (false, t.elapsed().as_secs_f64())
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Many> {
    let tcp = |name, addr| {
        How::Peer(Peer {
            name,
            dial: Dial::Tcp(addr),
        })
    };
    let cases: Vec<Case> = vec![
        Case {
            name: DIRECT,
            unit: "TCP connection",
            how: tcp(DIRECT, lab.targets.addr),
        },
        Case {
            name: SOCAT,
            unit: "TCP connection (socat forks per connection)",
            how: tcp(SOCAT, lab.socat.addr),
        },
        // Two hops, as `roam forward` (client side, relay): the like-for-like
        // peer of roam-forward, as in the throughput scenario.
        Case {
            name: SOCAT2,
            unit: "TCP connection through two chained socats (each forks per connection)",
            how: tcp(SOCAT2, lab.socat2.a.addr),
        },
        Case {
            name: SSH,
            unit: "channel of one ssh connection",
            how: tcp(SSH, lab.ssh.addr),
        },
        Case {
            name: ROAM_FORWARD,
            unit: "stream of one roam session",
            how: tcp(ROAM_FORWARD, lab.forward.addr),
        },
        Case {
            name: ROAM_SESSIONS,
            unit: "roam session (library client, one stream each)",
            how: How::Sessions,
        },
    ];
    let cases: Vec<Case> = cases.into_iter().filter(|c| ctx.wants(c.name)).collect();
    let mut rounds: Vec<Vec<Round>> = cases.iter().map(|_| Vec::new()).collect();
    for round in 0..ctx.plan.many_rounds {
        for i in order(cases.len(), round) {
            let r = one(&ctx, &lab, &cases[i]).await?;
            progress(&format!(
                "many round {}/{}: {} x {}: aggregate {:.1} MB/s, per client min {:.3} / median {:.3} / max {:.3} MB/s, {} starved; connect {:.1} s",
                round + 1,
                ctx.plan.many_rounds,
                ctx.plan.many_clients,
                cases[i].name,
                r.aggregate_mbps,
                r.min_mbps,
                r.median_mbps,
                r.max_mbps,
                r.starved,
                r.connect_seconds,
            ));
            rounds[i].push(r);
            lab.check_alive()?;
            // Let sockets of the previous peer close, and its processes
            // finish the work it left, before the next one starts.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (quiet, waited) = settle(&lab, cases[i].name).await;
            if !quiet {
                progress(&format!(
                    "many: {} still busy {:.1} s after its round (the next peer shares the CPU with it)",
                    cases[i].name, waited
                ));
            }
        }
    }
    let rows: Vec<Row> = cases
        .iter()
        .zip(rounds)
        .map(|(c, rs)| {
            let m = |f: fn(&Round) -> f64| median(&rs.iter().map(f).collect::<Vec<_>>());
            Row {
                peer: c.name,
                unit: c.unit,
                clients: ctx.plan.many_clients,
                aggregate_mbps: m(|r| r.aggregate_mbps),
                min_mbps: m(|r| r.min_mbps),
                median_mbps: m(|r| r.median_mbps),
                max_mbps: m(|r| r.max_mbps),
                jain_index: m(|r| r.jain_index),
                starved: m(|r| r.starved as f64),
                net_counters: rs.iter().fold(BTreeMap::new(), |mut acc, r| {
                    for (k, v) in &r.net_counters {
                        *acc.entry(k.clone()).or_insert(0) += v;
                    }
                    acc
                }),
                rounds: rs,
            }
        })
        .collect();
    let agg = |name: &str| {
        rows.iter()
            .find(|r| r.peer == name)
            .map_or(f64::NAN, |r| r.aggregate_mbps)
    };
    let mut ratios = Vec::new();
    for r in [ROAM_SESSIONS, ROAM_FORWARD] {
        for o in [DIRECT, SOCAT, SOCAT2, SSH] {
            ratios.push(RatioRow {
                case: "aggregate".into(),
                roam: r.into(),
                versus: o.into(),
                ratio: ratio(agg(r), agg(o)),
            });
        }
    }
    Ok(Many {
        clients: ctx.plan.many_clients,
        direction: "download (target -> client)",
        warmup_seconds: ctx.plan.many_warmup_seconds,
        window_seconds: ctx.plan.many_seconds,
        block_bytes: BLOCK,
        rows,
        ratios,
    })
}
