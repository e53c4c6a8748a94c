//! `idle_resume_timeout` under simulated time (PROTOCOL.md §10.3): a
//! suspended session with no open stream expires after it, one with an open
//! stream lives until `resume_timeout`, and a resume in time keeps it.

use std::time::Duration;

use roam_proto::{ClientConfig, CloseReason, Error, Keypair, ServerConfig, ServerTrust, State};
use roam_sim::net::{seed_from_env, Sim, SimConfig};

/// The server reclaims empty suspended sessions after this (simulated).
const IDLE: Duration = Duration::from_secs(60);
/// The full resume timeout on both sides (simulated).
const RESUME: Duration = Duration::from_secs(3600);

/// A client and a server whose only difference is the server's idle timeout.
fn sim(seed: u64) -> Sim {
    let mut cfg = SimConfig::new(seed);
    cfg.session.resume_timeout = RESUME;
    let server_kp = Keypair::generate().expect("keygen");
    let client = ClientConfig {
        keypair: Keypair::generate().expect("keygen"),
        server_trust: ServerTrust::Pinned(server_kp.public()),
        session: cfg.session.clone(),
    };
    let mut server_session = cfg.session.clone();
    server_session.idle_resume_timeout = Some(IDLE);
    let server = ServerConfig {
        keypair: server_kp,
        authorized_keys: None,
        addresses: Vec::new(),
        session: server_session,
    };
    let mut sim = Sim::with_configs(cfg, client, server);
    sim.dial();
    let deadline = sim.now + Duration::from_secs(10);
    assert!(
        sim.run_until(deadline, |s| s.server.as_ref().map(|s| s.state())
            == Some(State::Active)
            && s.client.state() == State::Active),
        "handshake did not complete"
    );
    sim
}

fn server_state(sim: &Sim) -> State {
    sim.server
        .as_ref()
        .map(|s| s.state())
        .expect("server session")
}

fn server_expired(sim: &Sim) -> bool {
    matches!(
        sim.server.as_ref().and_then(|s| s.close_reason()),
        Some(CloseReason::Error(Error::Expired))
    )
}

/// Partitions and waits until the server has noticed (suspended).
fn partition_until_suspended(sim: &mut Sim) {
    sim.partition();
    let deadline = sim.now + Duration::from_secs(30);
    assert!(
        sim.run_until(deadline, |s| server_state(s) == State::Suspended),
        "server never suspended: {:?}",
        server_state(sim)
    );
}

#[test]
fn empty_suspended_session_expires_after_idle_timeout() {
    let mut sim = sim(seed_from_env(21));
    partition_until_suspended(&mut sim);
    sim.run_for(IDLE - Duration::from_secs(1));
    assert_eq!(server_state(&sim), State::Suspended, "expired too early");
    sim.run_for(Duration::from_secs(2));
    assert_eq!(server_state(&sim), State::Closed);
    assert!(
        server_expired(&sim),
        "{:?}",
        sim.server.as_ref().map(|s| s.close_reason())
    );
    // The client has no idle timeout: it is still suspended, and learns on
    // its next resume that the session is gone.
    assert_eq!(sim.client.state(), State::Suspended);
}

#[test]
fn suspended_session_with_open_stream_lives_until_resume_timeout() {
    let mut sim = sim(seed_from_env(22));
    let stream = sim.client.open_stream(b"127.0.0.1:22").expect("open");
    sim.client.write(stream, b"hello").expect("write");
    let deadline = sim.now + Duration::from_secs(5);
    assert!(
        sim.run_until(deadline, |s| s
            .server
            .as_ref()
            .is_some_and(|s| s.stream_count() == 1)),
        "stream never reached the server"
    );
    partition_until_suspended(&mut sim);
    sim.run_for(IDLE * 10);
    assert_eq!(
        server_state(&sim),
        State::Suspended,
        "an open stream must keep it"
    );
    sim.run_for(RESUME);
    assert_eq!(server_state(&sim), State::Closed);
    assert!(server_expired(&sim));
}

#[test]
fn resume_before_idle_timeout_keeps_empty_session() {
    let mut sim = sim(seed_from_env(23));
    partition_until_suspended(&mut sim);
    sim.run_for(IDLE / 2);
    sim.heal();
    let deadline = sim.now + Duration::from_secs(20);
    assert!(
        sim.run_until(deadline, |s| server_state(s) == State::Active
            && s.client.state() == State::Active),
        "did not resume: server {:?}, client {:?}",
        server_state(&sim),
        sim.client.state()
    );
    sim.run_for(IDLE * 3);
    assert_eq!(server_state(&sim), State::Active);
    assert_eq!(sim.client.state(), State::Active);
}
