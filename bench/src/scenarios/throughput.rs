//! Scenario 1: bulk throughput in each direction for each write block size.
//! One connection per sample; the client (upload) or the target (download)
//! writes `block`-sized writes for a fixed time; throughput counts every
//! byte confirmed by the other end, drain included.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::{progress, ratio_rows, RatioRow, ROAM_PEERS};
use crate::load;
use crate::peers::Lab;
use crate::peers::{order, DIRECT, SOCAT, SSH};
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
}

#[derive(Debug, Serialize)]
pub(crate) struct Throughput {
    pub(crate) seconds_per_sample: f64,
    pub(crate) rounds: usize,
    pub(crate) client_tcp_nodelay: bool,
    pub(crate) rows: Vec<Row>,
    /// roam peer median / other peer median (higher is better for roam).
    pub(crate) ratios: Vec<RatioRow>,
}

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
                    let t = tokio::time::timeout(dur + Duration::from_secs(60), async {
                        let mut c = p.connect(false).await?;
                        match dir {
                            "upload" => load::upload(&mut c, block, dur, None).await,
                            _ => load::download(&mut c, block, dur).await,
                        }
                    })
                    .await
                    .map_err(|_| io::Error::other(format!("{what}: timed out")))?
                    .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
                    let row = rows
                        .iter_mut()
                        .find(|r| r.direction == dir && r.block_bytes == block && r.peer == p.name)
                        .expect("row exists");
                    row.samples_mbps.push(t.mbps());
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
    let mut ratios = Vec::new();
    for dir in DIRECTIONS {
        for &block in &plan.blocks {
            let get = |peer: &str| {
                rows.iter()
                    .find(|r| r.direction == dir && r.block_bytes == block && r.peer == peer)
                    .map_or(f64::NAN, |r| r.median_mbps)
            };
            ratios.extend(ratio_rows(
                &format!("{dir} {block} B"),
                ROAM_PEERS,
                &[DIRECT, SOCAT, SSH],
                get,
            ));
        }
    }
    Ok(Throughput {
        seconds_per_sample: plan.tput_seconds,
        rounds: plan.tput_rounds,
        client_tcp_nodelay: false,
        rows,
        ratios,
    })
}
