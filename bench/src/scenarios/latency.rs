//! Scenario 2: request/response latency. One echo connection per peer and
//! round (TCP_NODELAY on our socket), a short warm-up, then ping-pongs of
//! 1 B and 1 KiB; every round trip is a sample.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::{progress, ratio_rows, RatioRow, ROAM_PEERS};
use crate::load;
use crate::peers::{order, Lab, DIRECT, SOCAT, SOCAT2, SSH};
use crate::stats::{percentiles, summary, Summary};
use crate::Ctx;

/// Message sizes (bytes).
pub(crate) const SIZES: [usize; 2] = [1, 1024];
/// Ping-pongs before the measured ones on each connection.
const WARMUP: usize = 50;

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) size_bytes: usize,
    pub(crate) peer: &'static str,
    /// Round-trip times, microseconds.
    pub(crate) rtt_us: Summary,
    /// The 0th..100th percentiles (µs): the CDF.
    pub(crate) cdf_us: Vec<f64>,
    #[serde(skip)]
    pub(crate) samples_us: Vec<f64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Latency {
    pub(crate) rounds: usize,
    pub(crate) round_trips_per_round: usize,
    pub(crate) warmup_round_trips: usize,
    pub(crate) rows: Vec<Row>,
    /// roam median (or p99) / other peer's (lower is better for roam).
    pub(crate) median_ratios: Vec<RatioRow>,
    pub(crate) p99_ratios: Vec<RatioRow>,
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Latency> {
    let plan = &ctx.plan;
    let peers: Vec<_> = lab
        .stream_peers(&ctx.env)
        .into_iter()
        .filter(|p| ctx.wants(p.name))
        .collect();
    let mut samples: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); peers.len()]; SIZES.len()];
    for round in 0..plan.lat_rounds {
        for (si, &size) in SIZES.iter().enumerate() {
            for i in order(peers.len(), round) {
                let p = &peers[i];
                let what = format!("{size} B ping-pong via {}", p.name);
                let rtts = tokio::time::timeout(Duration::from_secs(120), async {
                    let mut c = p.connect(true).await?;
                    load::start_echo(&mut c).await?;
                    load::ping_pong(&mut c, size, WARMUP, plan.lat_iters).await
                })
                .await
                .map_err(|_| io::Error::other(format!("{what}: timed out")))?
                .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
                samples[si][i].extend(rtts.iter().map(|&ns| ns as f64 / 1000.0));
            }
            lab.check_alive()?;
        }
        progress(&format!(
            "latency round {}/{} done",
            round + 1,
            plan.lat_rounds
        ));
    }
    let mut rows = Vec::new();
    for (si, &size) in SIZES.iter().enumerate() {
        for (i, p) in peers.iter().enumerate() {
            let s = std::mem::take(&mut samples[si][i]);
            rows.push(Row {
                size_bytes: size,
                peer: p.name,
                rtt_us: summary(&s),
                cdf_us: percentiles(&s),
                samples_us: s,
            });
        }
    }
    let mut median_ratios = Vec::new();
    let mut p99_ratios = Vec::new();
    for &size in &SIZES {
        let get = |peer: &str, p99: bool| {
            rows.iter()
                .find(|r| r.size_bytes == size && r.peer == peer)
                .map_or(
                    f64::NAN,
                    |r| if p99 { r.rtt_us.p99 } else { r.rtt_us.median },
                )
        };
        let case = format!("{size} B");
        median_ratios.extend(ratio_rows(
            &case,
            ROAM_PEERS,
            &[DIRECT, SOCAT, SOCAT2, SSH],
            |p| get(p, false),
        ));
        p99_ratios.extend(ratio_rows(
            &case,
            ROAM_PEERS,
            &[DIRECT, SOCAT, SOCAT2, SSH],
            |p| get(p, true),
        ));
    }
    Ok(Latency {
        rounds: plan.lat_rounds,
        round_trips_per_round: plan.lat_iters,
        warmup_round_trips: WARMUP,
        rows,
        median_ratios,
        p99_ratios,
    })
}
