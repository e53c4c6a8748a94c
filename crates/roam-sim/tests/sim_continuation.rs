//! Session continuations in the simulator: a server exports a session,
//! "restarts", restores it and the client resumes exactly where it was.

use std::time::Duration;

use rand::Rng;
use roam_proto::{RestoreError, Session, State};
use roam_sim::net::{seed_from_env, seeds_from_env, Sim, SimConfig};
use roam_sim::workload::Workload;

#[test]
fn server_restart_between_suspend_and_resume_loses_nothing() {
    let first = seed_from_env(100);
    let count = if std::env::var("ROAM_SIM_SEED").is_ok() {
        1
    } else {
        seeds_from_env(1000) / 10
    };
    for seed in first..first + count {
        let mut sim = Sim::new(SimConfig::new(seed));
        sim.dial();
        let mut w = Workload::start(&mut sim, 20, 60_000);
        let t = sim.now + Duration::from_millis(sim.rng.gen_range(1..40));
        sim.run_until(t, |s| {
            w.pump(s);
            false
        });
        // The server's application state is the workload's (kept in the test);
        // the protocol state goes through export/restore.
        let offline = Duration::from_secs(sim.rng.gen_range(1..3600));
        let size = sim
            .restart_server(offline)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert!(size > 0);
        let t = sim.now + Duration::from_secs(120);
        let done = sim.run_until(t, |s| w.pump(s));
        assert!(w.error.is_none(), "seed {seed}: {:?}", w.error);
        assert!(
            done,
            "seed {seed}: transfer did not finish after the server restart"
        );
        assert_eq!(
            sim.server.as_ref().map(|s| s.state()),
            Some(State::Active),
            "seed {seed}"
        );
    }
}

#[test]
fn idle_continuation_is_small() {
    let mut sim = Sim::new(SimConfig::new(seed_from_env(101)));
    sim.dial();
    let mut w = Workload::start(&mut sim, 1, 10_000);
    let t = sim.now + Duration::from_secs(5);
    assert!(sim.run_until(t, |s| w.pump(s)));
    let blob = sim
        .server
        .as_ref()
        .expect("server")
        .export(sim.now)
        .expect("export");
    println!("idle continuation: {} bytes", blob.len());
    assert!(
        blob.len() < 512,
        "idle continuation is {} bytes",
        blob.len()
    );
}

#[test]
fn corrupted_truncated_or_foreign_continuations_are_refused() {
    let mut sim = Sim::new(SimConfig::new(seed_from_env(102)));
    sim.dial();
    let mut w = Workload::start(&mut sim, 3, 50_000);
    let t = sim.now + Duration::from_millis(15);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    let server = sim.server.as_ref().expect("server");
    let blob = server.export(sim.now).expect("export");
    let cfg = sim.server_config().clone();
    let now = sim.now;
    let restore = |b: &[u8]| Session::restore_server(&cfg, now, b, Duration::ZERO).map(|_| ());
    assert_eq!(restore(&blob), Ok(()));
    // Every truncation and every single-bit flip is caught.
    for cut in 0..blob.len() {
        assert!(
            restore(&blob[..cut]).is_err(),
            "truncation at {cut} accepted"
        );
    }
    for i in (0..blob.len()).step_by(7) {
        let mut b = blob.clone();
        b[i] ^= 0x10;
        let e = restore(&b).expect_err("bit flip accepted");
        assert!(
            matches!(
                e,
                RestoreError::Corrupted
                    | RestoreError::NotAContinuation
                    | RestoreError::UnsupportedFormat(_)
            ),
            "flip at {i}: {e:?}"
        );
    }
    assert_eq!(
        restore(b"not a continuation at all, just text"),
        Err(RestoreError::NotAContinuation)
    );
    // A server blob is not a client session, and a stale one has expired.
    let client_cfg = roam_proto::ClientConfig {
        keypair: roam_proto::Keypair::generate().expect("keygen"),
        server_trust: roam_proto::ServerTrust::FirstUse,
        session: roam_proto::Config::default(),
    };
    assert_eq!(
        Session::restore_client(client_cfg, now, &blob, Duration::ZERO).map(|_| ()),
        Err(RestoreError::WrongRole)
    );
    assert_eq!(
        Session::restore_server(&cfg, now, &blob, Duration::from_secs(4 * 24 * 3600)).map(|_| ()),
        Err(RestoreError::Expired)
    );
}
