//! Deterministic simulation of transport faults. Replay any failure with
//! `ROAM_SIM_SEED=<seed>`; change the seed count with `ROAM_SIM_SEEDS`.

use std::time::Duration;

use rand::Rng;
use roam_proto::{Event, State};
use roam_sim::net::{seed_from_env, seeds_from_env, Sim, SimConfig};
use roam_sim::workload::Workload;

/// Kinds of fault injected at random.
fn inject_random_fault(sim: &mut Sim, n: u64) {
    match sim.rng.gen_range(0..4) {
        0 | 1 => sim.reset_transport(),
        2 => sim.blackhole_transport(),
        _ => {
            let addr = format!("192.0.2.{}:{}", 10 + n % 200, 40000 + n % 20000);
            sim.change_client_addr(addr.parse().expect("addr"));
        }
    }
}

/// 100 streams, both directions, random kills; every byte verified.
fn run_kill_seed(seed: u64) -> Result<(u64, u64), String> {
    let mut cfg = SimConfig::new(seed);
    cfg.reconnect_after = std::time::Duration::from_millis(20);
    // Detect black holes quickly so a seed's simulated time stays short.
    cfg.session.suspend_after = Duration::from_millis(1500);
    cfg.session.heartbeat_interval = Duration::from_millis(300);
    let mut sim = Sim::new(cfg);
    let per_stream = sim.rng.gen_range(1_000..6_000);
    sim.dial();
    let mut w = Workload::start(&mut sim, 100, per_stream);
    w.client.write_chunk = 1500;
    w.server.write_chunk = 1500;
    let mut next_fault = sim.now + Duration::from_millis(sim.rng.gen_range(2..40));
    let mut faults = 0u64;
    let deadline = sim.now + Duration::from_secs(600);
    let done = sim.run_until(deadline, |s| {
        // A session exists once connected; before that a failed dial is an error
        // for the caller (tested elsewhere), not something to resume.
        if s.now >= next_fault && faults < 40 && s.client.id().is_some() {
            faults += 1;
            inject_random_fault(s, faults);
            next_fault = s.now + Duration::from_millis(s.rng.gen_range(5..80));
        }
        w.pump(s)
    });
    if let Some(e) = w.error {
        return Err(format!(
            "{e}; client {:?}, server {:?}; client errors {:?}",
            sim.client.close_reason(),
            sim.server.as_ref().map(|s| s.close_reason().cloned()),
            sim.input_errors
        ));
    }
    if !done {
        return Err(format!(
            "not finished after {:?} simulated: client {:?} ({:?}), server {:?}, last client events {:?}",
            sim.elapsed(),
            sim.client,
            sim.client.close_reason(),
            sim.server.as_ref().map(|s| (s.state(), s.close_reason().cloned())),
            sim.client_events.iter().rev().take(5).collect::<Vec<_>>()
        ));
    }
    if sim.client.state() == State::Closed {
        return Err(format!("client ended {:?}", sim.client.state()));
    }
    Ok((faults, w.verified_bytes()))
}

#[test]
fn random_transport_kills_100_streams_every_byte_verified() {
    let first = seed_from_env(0);
    let count = if std::env::var("ROAM_SIM_SEED").is_ok() {
        1
    } else {
        seeds_from_env(1000)
    };
    let (mut faults, mut bytes) = (0u64, 0u64);
    for seed in first..first + count {
        match run_kill_seed(seed) {
            Ok((f, b)) => {
                faults += f;
                bytes += b;
            }
            Err(e) => panic!("seed {seed} failed (replay: ROAM_SIM_SEED={seed}): {e}"),
        }
    }
    println!("{count} seeds, {faults} transport faults, {bytes} bytes verified");
    assert!(faults >= 2 * count, "too few faults injected: {faults}");
}

#[test]
fn three_day_suspension_then_resume() {
    let seed = seed_from_env(7);
    let mut sim = Sim::new(SimConfig::new(seed));
    sim.dial();
    let mut w = Workload::start(&mut sim, 10, 200_000);
    // Move some data, then lose the network for just under three days.
    let t = sim.now + Duration::from_millis(50);
    sim.run_until(t, |s| w.pump(s));
    sim.partition();
    let t = sim.now + Duration::from_secs(3 * 24 * 3600 - 120);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    assert_eq!(sim.client.state(), State::Suspended, "seed {seed}");
    assert_eq!(
        sim.server.as_ref().map(|s| s.state()),
        Some(State::Suspended)
    );
    sim.heal();
    let t = sim.now + Duration::from_secs(120);
    let done = sim.run_until(t, |s| w.pump(s));
    assert!(w.error.is_none(), "seed {seed}: {:?}", w.error);
    assert!(
        done,
        "seed {seed}: transfer did not finish after resume: {:?} {:?} {:?} {:?} client events {:?} server events {:?}",
        sim.endpoint_errors.iter().rev().take(3).collect::<Vec<_>>(),
        sim.input_errors.iter().rev().take(3).collect::<Vec<_>>(),
        sim.client,
        sim.server,
        &sim.client_events[sim.client_events.len().saturating_sub(8)..],
        &sim.server_events[sim.server_events.len().saturating_sub(8)..]
    );
    let resumed = sim.client_events.iter().find_map(|e| match e {
        Event::Resumed { suspended_for, .. } => Some(*suspended_for),
        _ => None,
    });
    let d = resumed.expect("client saw Resumed");
    assert!(
        d > Duration::from_secs(3 * 24 * 3600 - 300),
        "suspended for {d:?}"
    );
}

#[test]
fn four_day_suspension_expires_on_both_sides() {
    let seed = seed_from_env(8);
    let mut sim = Sim::new(SimConfig::new(seed));
    sim.dial();
    let mut w = Workload::start(&mut sim, 3, 100_000);
    let t = sim.now + Duration::from_millis(50);
    sim.run_until(t, |s| w.pump(s));
    sim.partition();
    let t = sim.now + Duration::from_secs(4 * 24 * 3600);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    let expired = |evs: &[Event]| {
        evs.iter().any(|e| {
            matches!(
                e,
                Event::Closed {
                    reason: roam_proto::CloseReason::Error(roam_proto::Error::Expired)
                }
            )
        })
    };
    assert_eq!(sim.client.state(), State::Closed);
    assert!(
        expired(&sim.client_events),
        "client: {:?}",
        sim.client.close_reason()
    );
    assert_eq!(sim.server.as_ref().map(|s| s.state()), Some(State::Closed));
    assert!(
        expired(&sim.server_events),
        "server: {:?}",
        sim.server.as_ref().map(|s| s.close_reason())
    );
    // The client stops trying, and its streams report the closed session.
    assert!(sim.client.write(roam_proto::StreamId(0), b"x").is_err());
    assert!(
        sim.client.poll_timeout().is_none(),
        "expired session still wants timers"
    );
}
