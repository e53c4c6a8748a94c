//! Many streams of one session writing at once share the session's send
//! buffer fairly (PROTOCOL.md §8): none starves while others hold the buffer.

use std::time::Duration;

use roam_proto::Config;
use roam_sim::net::{seed_from_env, Sim, SimConfig};
use roam_sim::workload::Workload;

/// Jain's fairness index of `xs` (1 = perfectly even).
fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * sq)
}

const STREAMS: usize = 64;

#[test]
fn many_writers_share_the_session_send_buffer() {
    let seed = seed_from_env(31);
    let mut cfg = SimConfig::new(seed);
    cfg.rate = 4_000_000;
    cfg.session = Config {
        session_send_buffer: 1 << 20,
        stream_send_buffer: 256 << 10,
        ..Config::default()
    };
    let mut sim = Sim::new(cfg);
    sim.dial();
    // 64 streams that each want far more than the link carries: without a
    // fair share, four of them could hold the whole 1 MiB session buffer.
    let mut w = Workload::start(&mut sim, STREAMS, 1 << 30);
    let received = |w: &Workload| -> Vec<u64> {
        w.server
            .streams
            .values()
            .map(|(_, rx)| rx.received)
            .collect()
    };
    let t = sim.now + Duration::from_secs(2);
    sim.run_until(t, |s| w.pump(s));
    assert!(w.error.is_none(), "seed {seed}: {:?}", w.error);
    let before = received(&w);
    let t = sim.now + Duration::from_secs(3);
    sim.run_until(t, |s| w.pump(s));
    assert!(w.error.is_none(), "seed {seed}: {:?}", w.error);
    let after = received(&w);
    assert_eq!(
        after.len(),
        STREAMS,
        "seed {seed}: every stream reached the server"
    );
    let got: Vec<f64> = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| (a - b) as f64)
        .collect();
    let starved = got.iter().filter(|&&g| g == 0.0).count();
    let index = jain(&got);
    let total: f64 = got.iter().sum();
    eprintln!(
        "seed {seed}: {:.1} MB in 3 s over {STREAMS} streams, {starved} starved, Jain {index:.3}, min {:.0} B max {:.0} B",
        total / 1e6,
        got.iter().cloned().fold(f64::MAX, f64::min),
        got.iter().cloned().fold(0.0, f64::max),
    );
    assert_eq!(starved, 0, "seed {seed}: streams starved");
    assert!(index >= 0.9, "seed {seed}: Jain index {index:.3}");
}
