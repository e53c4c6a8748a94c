//! A session moving live between replicas of its server (`docs/PROTOCOL.md`
//! §9.3, §14), in the simulator: three hosts; at random moments the server
//! session moves to another host — half the time with a MOVE_TO first,
//! half the time without (the client finds out by resuming at the old host
//! and being redirected with `Moved`) — interleaved with random transport
//! faults (resets, black holes, client address changes). A verifying
//! workload runs both ways throughout: every byte arrives exactly once, in
//! order. Replay a failure with `ROAM_SIM_SEED=<seed>`; change the number of
//! seeds with `ROAM_SIM_SEEDS` (default 500).

use std::time::Duration;

use rand::Rng;
use roam_proto::State;
use roam_sim::net::{seed_from_env, seeds_from_env, Sim, SimConfig};
use roam_sim::workload::Workload;

/// One seed: returns (moves, faults, verified bytes).
fn run_seed(seed: u64) -> Result<(u64, u64, u64), String> {
    let mut cfg = SimConfig::new(seed);
    cfg.reconnect_after = Duration::from_millis(20);
    cfg.session.suspend_after = Duration::from_millis(1500);
    cfg.session.heartbeat_interval = Duration::from_millis(300);
    let mut sim = Sim::new(cfg);
    sim.add_hosts(2);
    let streams = sim.rng.gen_range(1..20);
    let per_stream = sim.rng.gen_range(1_000..40_000);
    sim.dial();
    let mut w = Workload::start(&mut sim, streams, per_stream);
    w.client.write_chunk = 1500;
    w.server.write_chunk = 1500;
    let mut next = sim.now + Duration::from_millis(sim.rng.gen_range(2..40));
    let (mut faults, mut errors) = (0u64, Vec::new());
    let max_moves = sim.rng.gen_range(3..12);
    let deadline = sim.now + Duration::from_secs(600);
    let done = sim.run_until(deadline, |s| {
        if s.now >= next && s.client.id().is_some() && s.server.is_some() {
            match s.rng.gen_range(0..6) {
                0..=2 if s.moves < max_moves => {
                    let n = s.host_count();
                    let to = (s.holder + s.rng.gen_range(1..n)) % n;
                    let with_move_to = s.rng.gen_bool(0.5);
                    if let Err(e) = s.move_session(to, with_move_to) {
                        errors.push(format!("move to {to}: {e}"));
                    }
                }
                3 => {
                    faults += 1;
                    s.reset_transport();
                }
                4 => {
                    faults += 1;
                    s.blackhole_transport();
                }
                _ => {
                    faults += 1;
                    let addr = format!("192.0.2.{}:{}", 10 + faults % 200, 40000 + faults);
                    s.change_client_addr(addr.parse().expect("addr"));
                }
            }
            next = s.now + Duration::from_millis(s.rng.gen_range(5..120));
        }
        w.pump(s)
    });
    if !errors.is_empty() {
        return Err(format!("moves failed: {errors:?}"));
    }
    if let Some(e) = w.error {
        return Err(format!(
            "{e}; client {:?}, server {:?}, input errors {:?}",
            sim.client.close_reason(),
            sim.server.as_ref().map(|s| s.close_reason().cloned()),
            sim.input_errors
        ));
    }
    if !done {
        return Err(format!(
            "not finished after {:?} simulated ({} moves): client {:?}, holder {}, dialing {}, last client events {:?}",
            sim.elapsed(),
            sim.moves,
            sim.client.state(),
            sim.holder,
            sim.dial_host,
            sim.client_events.iter().rev().take(6).collect::<Vec<_>>()
        ));
    }
    if sim.client.state() == State::Closed {
        return Err("the client's session ended".into());
    }
    Ok((sim.moves, faults, w.verified_bytes()))
}

#[test]
fn random_moves_among_three_replicas_with_faults_every_byte_verified() {
    let first = seed_from_env(5000);
    let count = if std::env::var("ROAM_SIM_SEED").is_ok() {
        1
    } else {
        seeds_from_env(500)
    };
    let (mut moves, mut faults, mut bytes) = (0, 0, 0);
    for seed in first..first + count {
        match run_seed(seed) {
            Ok((m, f, b)) => {
                moves += m;
                faults += f;
                bytes += b;
            }
            Err(e) => panic!("seed {seed} (replay with ROAM_SIM_SEED={seed}): {e}"),
        }
    }
    eprintln!("{count} seeds: {moves} moves, {faults} faults, {bytes} bytes verified");
    assert!(moves >= count, "moves happened ({moves} in {count} seeds)");
}
