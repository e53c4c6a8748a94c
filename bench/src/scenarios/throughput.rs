//! Scenario 1: bulk throughput in each direction for each write block size.
//! One connection per sample; the client (upload) or the target (download)
//! writes `block`-sized writes for a fixed time; throughput counts every
//! byte confirmed by the other end, drain included.
//!
//! Each sample also records the CPU time the peer's own processes used
//! (utime + stime from `/proc/PID/stat` before and after; see
//! [`crate::peers::Lab::cpu_roots`]), so CPU seconds per GB moved sit beside
//! the speed. `roam-session` runs inside this process, whose threads also
//! run the load generator: its share is this process's CPU per byte minus
//! the same for `direct` in the same cell (the load generator alone).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::{progress, ratio_rows, RatioRow, ROAM_PEERS};
use crate::load;
use crate::peers::Lab;
use crate::peers::{order, DIRECT, ROAM_SESSION, SOCAT, SOCAT2, SSH};
use crate::procs::{self_cpu_seconds, tree_cpu_seconds};
use crate::stats::median;
use crate::Ctx;

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) direction: &'static str,
    pub(crate) block_bytes: usize,
    pub(crate) peer: &'static str,
    /// One value per round, MB/s (10^6 bytes per second).
    pub(crate) samples_mbps: Vec<f64>,
    pub(crate) median_mbps: f64,
    /// Bytes moved per sample.
    pub(crate) samples_bytes: Vec<u64>,
    /// CPU seconds of the peer's own processes per sample.
    pub(crate) samples_peer_cpu_seconds: Vec<f64>,
    /// CPU seconds of the harness process (load generator, and for
    /// `roam-session` the session) per sample.
    pub(crate) samples_harness_cpu_seconds: Vec<f64>,
    /// CPU seconds of the peer per 10^9 bytes moved, over all samples (for
    /// `roam-session`, its share of the harness included; 0 for `direct`).
    pub(crate) cpu_seconds_per_gb: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct Throughput {
    pub(crate) seconds_per_sample: f64,
    pub(crate) rounds: usize,
    pub(crate) client_tcp_nodelay: bool,
    pub(crate) rows: Vec<Row>,
    /// roam peer median / other peer median (higher is better for roam).
    pub(crate) ratios: Vec<RatioRow>,
    /// roam peer CPU s/GB / other peer's (lower is better for roam).
    pub(crate) cpu_ratios: Vec<RatioRow>,
    /// What the CPU columns count, per peer.
    pub(crate) cpu_counted: Vec<(&'static str, &'static str)>,
}

/// What `cpu_seconds_per_gb` counts for each peer.
pub(crate) const CPU_COUNTED: &[(&str, &str)] = &[
    (DIRECT, "nothing: only the load generator and the target touch the bytes, the same for every peer (0 by definition)"),
    (SOCAT, "the socat listener and the child it forks for the connection"),
    (SOCAT2, "both socat listeners and their per-connection children"),
    (SSH, "the ssh -L client and the private sshd with every process it forked (the session's privilege-separated processes)"),
    ("roam-forward", "roam forward and roam serve"),
    ("roam-pipe", "the roam pipe process of the sample (start-up and handshake included) and roam serve"),
    ("roam-pipe-named", "as roam-pipe (the named process writes its journal, in the page cache)"),
    (ROAM_SESSION, "roam serve, plus the harness process's CPU per byte minus that of direct in the same cell (the library session's share)"),
];

pub(crate) const DIRECTIONS: [&str; 2] = ["upload", "download"];

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Throughput> {
    let plan = &ctx.plan;
    let peers: Vec<_> = lab
        .stream_peers(&ctx.env)
        .into_iter()
        .filter(|p| ctx.wants(p.name))
        .collect();
    let dur = Duration::from_secs_f64(plan.tput_seconds);
    let mut rows: Vec<Row> = Vec::new();
    for dir in DIRECTIONS {
        for &block in &plan.blocks {
            for p in &peers {
                rows.push(Row {
                    direction: dir,
                    block_bytes: block,
                    peer: p.name,
                    samples_mbps: Vec::new(),
                    median_mbps: f64::NAN,
                    samples_bytes: Vec::new(),
                    samples_peer_cpu_seconds: Vec::new(),
                    samples_harness_cpu_seconds: Vec::new(),
                    cpu_seconds_per_gb: f64::NAN,
                });
            }
        }
    }
    for round in 0..plan.tput_rounds {
        for dir in DIRECTIONS {
            for &block in &plan.blocks {
                for i in order(peers.len(), round) {
                    let p = &peers[i];
                    let what = format!("{dir} {block} B via {}", p.name);
                    let roots = lab.cpu_roots(p.name);
                    let h0 = self_cpu_seconds();
                    let c0 = tree_cpu_seconds(&roots);
                    let (t, own) = tokio::time::timeout(dur + Duration::from_secs(60), async {
                        let (mut c, pid) = p.connect_pid(false).await?;
                        let own: Vec<u32> = pid.into_iter().collect();
                        let own0 = tree_cpu_seconds(&own);
                        let t = match dir {
                            "upload" => load::upload(&mut c, block, dur, None).await,
                            _ => load::download(&mut c, block, dur).await,
                        }?;
                        // Before the connection (and its process) goes.
                        let own1 = tree_cpu_seconds(&own);
                        Ok::<_, io::Error>((t, own1 - own0))
                    })
                    .await
                    .map_err(|_| io::Error::other(format!("{what}: timed out")))?
                    .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
                    let row = rows
                        .iter_mut()
                        .find(|r| r.direction == dir && r.block_bytes == block && r.peer == p.name)
                        .expect("row exists");
                    row.samples_mbps.push(t.mbps());
                    row.samples_bytes.push(t.bytes);
                    row.samples_peer_cpu_seconds
                        .push(tree_cpu_seconds(&roots) - c0 + own);
                    row.samples_harness_cpu_seconds
                        .push(self_cpu_seconds() - h0);
                }
                lab.check_alive()?;
                progress(&format!(
                    "throughput round {}/{} {dir} {block} B done",
                    round + 1,
                    plan.tput_rounds
                ));
            }
        }
    }
    for r in &mut rows {
        r.median_mbps = median(&r.samples_mbps);
    }
    let per_gb = |secs: &[f64], bytes: &[u64]| {
        let b: u64 = bytes.iter().sum();
        if b == 0 {
            f64::NAN
        } else {
            secs.iter().sum::<f64>() / b as f64 * 1e9
        }
    };
    for dir in DIRECTIONS {
        for &block in &plan.blocks {
            let direct_harness = rows
                .iter()
                .find(|r| r.direction == dir && r.block_bytes == block && r.peer == DIRECT)
                .map(|r| per_gb(&r.samples_harness_cpu_seconds, &r.samples_bytes));
            for r in rows
                .iter_mut()
                .filter(|r| r.direction == dir && r.block_bytes == block)
            {
                let mut v = per_gb(&r.samples_peer_cpu_seconds, &r.samples_bytes);
                if r.peer == ROAM_SESSION {
                    let own = per_gb(&r.samples_harness_cpu_seconds, &r.samples_bytes);
                    v += (own - direct_harness.unwrap_or(f64::NAN)).max(0.0);
                }
                r.cpu_seconds_per_gb = v;
            }
        }
    }
    let mut ratios = Vec::new();
    let mut cpu_ratios = Vec::new();
    for dir in DIRECTIONS {
        for &block in &plan.blocks {
            let find = |peer: &str| {
                rows.iter()
                    .find(|r| r.direction == dir && r.block_bytes == block && r.peer == peer)
            };
            ratios.extend(ratio_rows(
                &format!("{dir} {block} B"),
                ROAM_PEERS,
                &[DIRECT, SOCAT, SOCAT2, SSH],
                |p| find(p).map_or(f64::NAN, |r| r.median_mbps),
            ));
            cpu_ratios.extend(ratio_rows(
                &format!("{dir} {block} B"),
                ROAM_PEERS,
                &[SOCAT, SOCAT2, SSH],
                |p| find(p).map_or(f64::NAN, |r| r.cpu_seconds_per_gb),
            ));
        }
    }
    Ok(Throughput {
        seconds_per_sample: plan.tput_seconds,
        rounds: plan.tput_rounds,
        client_tcp_nodelay: false,
        rows,
        ratios,
        cpu_ratios,
        cpu_counted: CPU_COUNTED.to_vec(),
    })
}
