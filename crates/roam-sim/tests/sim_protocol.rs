//! Protocol behaviour under simulation: flow control, half-close, close,
//! authentication and resume attacks, address changes.

use std::sync::Arc;
use std::time::Duration;

use roam_proto::{
    ClientConfig, CloseReason, Config, Error, Event, Keypair, ServerConfig, ServerTrust, State,
    StreamId,
};
use roam_sim::net::{seed_from_env, Sim, SimConfig};
use roam_sim::workload::{pattern, Workload};

fn connected(seed: u64) -> Sim {
    let mut sim = Sim::new(SimConfig::new(seed));
    sim.dial();
    let t = sim.now + Duration::from_secs(10);
    assert!(sim.run_until(t, |s| s.client.state() == State::Active
        && s.server.is_some()));
    sim
}

fn closed_with(events: &[Event]) -> Option<CloseReason> {
    events.iter().find_map(|e| match e {
        Event::Closed { reason } => Some(reason.clone()),
        _ => None,
    })
}

#[test]
fn stalled_stream_does_not_block_the_others() {
    let seed = seed_from_env(11);
    let mut cfg = SimConfig::new(seed);
    cfg.session = Config {
        stream_window: 64 * 1024,
        session_window: 512 * 1024,
        ..Config::default()
    };
    let mut sim = Sim::new(cfg);
    sim.dial();
    let mut w = Workload::start(&mut sim, 6, 2_000_000);
    let stalled = *w.client.streams.keys().next().expect("a stream");
    // The server's application never reads the first stream.
    w.server.stalled.push(stalled);
    let t = sim.now + Duration::from_secs(120);
    let others_done = sim.run_until(t, |s| {
        w.pump(s);
        w.server
            .streams
            .iter()
            .filter(|(id, _)| **id != stalled)
            .count()
            == 5
            && w.server
                .streams
                .iter()
                .filter(|(id, _)| **id != stalled)
                .all(|(_, (_, rx))| rx.eof)
    });
    assert!(w.error.is_none(), "seed {seed}: {:?}", w.error);
    assert!(
        others_done,
        "seed {seed}: other streams were blocked by the stalled one"
    );
    // The stalled stream holds at most its window at the receiver.
    let server = sim.server.as_ref().expect("server");
    let buffered = server.readable_len(StreamId(stalled));
    assert!(
        buffered > 0 && buffered <= 64 * 1024,
        "stalled stream buffered {buffered}"
    );
    // Once the reader wakes up, the stalled stream completes too.
    w.server.stalled.clear();
    let t = sim.now + Duration::from_secs(120);
    assert!(
        sim.run_until(t, |s| w.pump(s)),
        "seed {seed}: stalled stream never finished"
    );
    assert!(w.error.is_none(), "{:?}", w.error);
}

#[test]
fn half_close_in_both_directions() {
    let seed = seed_from_env(12);
    let mut sim = connected(seed);
    let id = sim.client.open_stream(b"half").expect("open");
    assert_eq!(sim.client.write(id, b"request").expect("write"), 7);
    sim.client.finish_stream(id).expect("finish");
    sim.run_for(Duration::from_millis(200));
    let server = sim.server.as_mut().expect("server");
    let mut buf = [0u8; 64];
    assert_eq!(server.read(id, &mut buf), Ok(Some(7)));
    assert_eq!(&buf[..7], b"request");
    assert_eq!(server.read(id, &mut buf), Ok(Some(0)), "server sees EOF");
    // The server keeps sending after the client's half-close.
    for i in 0..5u8 {
        assert_eq!(server.write(id, &[i; 1000]).expect("write"), 1000);
    }
    server.finish_stream(id).expect("finish");
    sim.run_for(Duration::from_millis(200));
    let mut got = Vec::new();
    loop {
        match sim.client.read(id, &mut buf).expect("read") {
            Some(0) => break,
            Some(n) => got.extend_from_slice(&buf[..n]),
            None => panic!("client did not get the server's FIN"),
        }
    }
    assert_eq!(got.len(), 5000);
    assert!(got
        .chunks(1000)
        .enumerate()
        .all(|(i, c)| c.iter().all(|b| *b == i as u8)));
    assert!(sim
        .server_events
        .iter()
        .any(|e| matches!(e, Event::StreamFinished { stream } if *stream == id)));
    let complete = |evs: &[Event]| {
        evs.iter()
            .any(|e| matches!(e, Event::StreamSendComplete { stream } if *stream == id))
    };
    assert!(complete(&sim.client_events) && complete(&sim.server_events));
    // Both directions are over: the stream is forgotten on both sides.
    assert_eq!(sim.client.stream_count(), 0);
    assert_eq!(sim.server.as_ref().map(|s| s.stream_count()), Some(0));
    assert_eq!(
        sim.client.write(id, b"x"),
        Err(roam_proto::StreamError::UnknownStream)
    );
}

#[test]
fn finish_while_suspended_completes_after_resume() {
    let seed = seed_from_env(13);
    let mut sim = connected(seed);
    let id = sim.client.open_stream(b"late").expect("open");
    sim.run_for(Duration::from_millis(100));
    sim.partition();
    sim.run_for(Duration::from_secs(10));
    assert_eq!(sim.client.state(), State::Suspended);
    sim.client
        .write(id, b"written while suspended")
        .expect("write");
    sim.client.finish_stream(id).expect("finish");
    sim.run_for(Duration::from_secs(30));
    let done = |s: &Sim| {
        s.client_events
            .iter()
            .any(|e| matches!(e, Event::StreamSendComplete { .. }))
    };
    assert!(
        !done(&sim),
        "finish cannot complete while the peer is unreachable"
    );
    sim.heal();
    let t = sim.now + Duration::from_secs(30);
    assert!(
        sim.run_until(t, |s| done(s)),
        "seed {seed}: finish never completed after resume"
    );
    let mut buf = [0u8; 64];
    let server = sim.server.as_mut().expect("server");
    assert_eq!(server.read(id, &mut buf), Ok(Some(23)));
    assert_eq!(&buf[..23], b"written while suspended");
}

#[test]
fn graceful_close_delivers_everything_then_ends_both_sides() {
    let seed = seed_from_env(14);
    let mut sim = connected(seed);
    let id = sim.client.open_stream(b"bye").expect("open");
    let data: Vec<u8> = (0..200_000u64).map(|i| pattern(9, i)).collect();
    let mut off = 0;
    while off < data.len() {
        let n = sim.client.write(id, &data[off..]).expect("write");
        off += n;
        if n == 0 {
            sim.run_for(Duration::from_millis(50));
        }
    }
    sim.client
        .close(roam_proto::code::NO_ERROR, "done for today");
    assert_eq!(sim.client.state(), State::Closing);
    assert!(
        sim.client.write(id, b"more").is_err(),
        "no writes after close"
    );
    let mut got = Vec::new();
    let t = sim.now + Duration::from_secs(30);
    sim.run_until(t, |s| {
        if let Some(server) = s.server.as_mut() {
            let mut buf = [0u8; 65536];
            while let Ok(Some(n)) = server.read(id, &mut buf) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
        }
        s.client.state() == State::Closed
    });
    assert_eq!(sim.client.state(), State::Closed);
    assert_eq!(
        closed_with(&sim.client_events),
        Some(CloseReason::Local { code: 0 })
    );
    assert_eq!(
        closed_with(&sim.server_events),
        Some(CloseReason::Peer {
            code: 0,
            reason: "done for today".into()
        })
    );
    assert_eq!(
        got.len(),
        data.len(),
        "all data written before close arrived"
    );
    assert!(got == data);
    // Both sides let go of their transport (reported, or closed by the peer first).
    sim.run_for(Duration::from_millis(500));
    assert_eq!(sim.client.active_transport(), None);
    assert_eq!(sim.server.as_ref().and_then(|s| s.active_transport()), None);
    assert!(sim
        .server_events
        .iter()
        .any(|e| matches!(e, Event::TransportClosed { .. })));
    assert!(
        sim.client.poll_timeout().is_none()
            && sim.server.as_ref().and_then(|s| s.poll_timeout()).is_none()
    );
}

#[test]
fn wrong_pinned_server_key_is_refused() {
    let seed = seed_from_env(15);
    let server_kp = Keypair::generate().expect("keygen");
    let impostor_pin = Keypair::generate().expect("keygen").public();
    let client = ClientConfig {
        keypair: Keypair::generate().expect("keygen"),
        server_trust: ServerTrust::Pinned(impostor_pin),
        session: Config::default(),
    };
    let server = ServerConfig {
        keypair: server_kp.clone(),
        authorized_keys: None,
        addresses: vec![],
        session: Config::default(),
    };
    let mut sim = Sim::with_configs(SimConfig::new(seed), client, server);
    sim.dial();
    sim.run_for(Duration::from_secs(5));
    assert_eq!(sim.client.state(), State::Closed);
    assert_eq!(
        sim.client.close_reason(),
        Some(&CloseReason::Error(Error::ServerKeyMismatch {
            expected: impostor_pin,
            actual: server_kp.public()
        }))
    );
    let msg = Error::ServerKeyMismatch {
        expected: impostor_pin,
        actual: server_kp.public(),
    }
    .to_string();
    assert!(
        msg.contains("known-servers"),
        "error tells the user what to do: {msg}"
    );
}

#[test]
fn unauthorized_client_key_is_refused() {
    let seed = seed_from_env(16);
    let server_kp = Keypair::generate().expect("keygen");
    let allowed = Keypair::generate().expect("keygen").public();
    let client = ClientConfig {
        keypair: Keypair::generate().expect("keygen"),
        server_trust: ServerTrust::Pinned(server_kp.public()),
        session: Config::default(),
    };
    let server = ServerConfig {
        keypair: server_kp,
        authorized_keys: Some(Arc::new(vec![allowed])),
        addresses: vec![],
        session: Config::default(),
    };
    let mut sim = Sim::with_configs(SimConfig::new(seed), client, server);
    sim.dial();
    sim.run_for(Duration::from_secs(5));
    assert_eq!(
        sim.client.close_reason(),
        Some(&CloseReason::Error(Error::Unauthorized))
    );
    assert_eq!(
        sim.server.as_ref().and_then(|s| s.close_reason().cloned()),
        Some(CloseReason::Error(Error::Unauthorized))
    );
}

#[test]
fn authorized_client_key_is_accepted() {
    let seed = seed_from_env(17);
    let server_kp = Keypair::generate().expect("keygen");
    let client_kp = Keypair::generate().expect("keygen");
    let client = ClientConfig {
        keypair: client_kp.clone(),
        server_trust: ServerTrust::FirstUse,
        session: Config::default(),
    };
    let server = ServerConfig {
        keypair: server_kp.clone(),
        authorized_keys: Some(Arc::new(vec![client_kp.public()])),
        addresses: vec!["203.0.113.7:7447".into()],
        session: Config::default(),
    };
    let mut sim = Sim::with_configs(SimConfig::new(seed), client, server);
    sim.dial();
    sim.run_for(Duration::from_secs(2));
    assert_eq!(sim.client.state(), State::Active);
    assert_eq!(
        sim.client.peer_key(),
        Some(server_kp.public()),
        "TOFU learns the server key"
    );
    assert_eq!(
        sim.server.as_ref().and_then(|s| s.peer_key()),
        Some(client_kp.public())
    );
    assert!(sim
        .client_events
        .iter()
        .any(|e| matches!(e, Event::AddressesUpdated { addrs } if addrs == &["203.0.113.7:7447"])));
}

#[test]
fn forged_session_id_is_refused_and_session_unharmed() {
    let seed = seed_from_env(18);
    let mut sim = connected(seed);
    let mut w = Workload::start(&mut sim, 4, 100_000);
    // An attacker sends a resume naming a session id the server does not hold.
    let mut forged = b"ROAM\x01\x01\x02".to_vec();
    forged.extend_from_slice(&[0xab; 16]);
    forged.extend_from_slice(&48u16.to_be_bytes());
    forged.extend_from_slice(&[7; 48]);
    sim.inject_connection(forged);
    // And one naming the real session but without its secret.
    let mut wrong_secret = b"ROAM\x01\x01\x02".to_vec();
    wrong_secret.extend_from_slice(&sim.client.id().expect("id").0);
    wrong_secret.extend_from_slice(&48u16.to_be_bytes());
    wrong_secret.extend_from_slice(&[7; 48]);
    sim.inject_connection(wrong_secret);
    let t = sim.now + Duration::from_secs(30);
    assert!(
        sim.run_until(t, |s| w.pump(s)),
        "seed {seed}: transfer disturbed"
    );
    assert!(w.error.is_none(), "{:?}", w.error);
    assert_eq!(
        sim.endpoint_errors,
        vec![Error::UnknownSession, Error::ResumeRejected]
    );
    assert_eq!(sim.server.as_ref().map(|s| s.state()), Some(State::Active));
}

#[test]
fn replayed_resume_is_refused_and_session_unharmed() {
    let seed = seed_from_env(19);
    let mut sim = Sim::new(SimConfig::new(seed));
    sim.record_c2s = true;
    sim.dial();
    let mut w = Workload::start(&mut sim, 4, 300_000);
    let t = sim.now + Duration::from_millis(20);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    sim.reset_transport();
    let t = sim.now + Duration::from_secs(60);
    assert!(
        sim.run_until(t, |s| w.pump(s)),
        "seed {seed}: transfer did not finish"
    );
    assert!(sim
        .client_events
        .iter()
        .any(|e| matches!(e, Event::Resumed { .. })));
    // The attacker captured the whole resume connection and plays it again.
    let capture = sim.recorded.last().cloned().expect("a resume connection");
    assert!(
        capture.starts_with(b"ROAM\x01\x01\x02"),
        "last connection was a resume"
    );
    sim.inject_connection(capture);
    sim.run_for(Duration::from_secs(2));
    assert_eq!(sim.endpoint_errors, vec![Error::ReplayedResume]);
    assert_eq!(sim.server.as_ref().map(|s| s.state()), Some(State::Active));
    assert_eq!(sim.client.state(), State::Active);
    // The session still works afterwards.
    let id = sim.client.open_stream(b"after").expect("open");
    sim.client.write(id, b"ping").expect("write");
    sim.run_for(Duration::from_millis(500));
    let mut buf = [0u8; 8];
    assert_eq!(
        sim.server.as_mut().expect("server").read(id, &mut buf),
        Ok(Some(4))
    );
}

#[test]
fn client_address_change_is_seen_by_the_server() {
    let seed = seed_from_env(20);
    let mut sim = connected(seed);
    let mut w = Workload::start(&mut sim, 8, 400_000);
    let t = sim.now + Duration::from_millis(30);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    let new_addr = "192.0.2.99:50000".parse().expect("addr");
    sim.change_client_addr(new_addr);
    let t = sim.now + Duration::from_secs(60);
    assert!(
        sim.run_until(t, |s| w.pump(s)),
        "seed {seed}: transfer did not finish"
    );
    assert!(w.error.is_none(), "{:?}", w.error);
    assert!(sim
        .server_events
        .iter()
        .any(|e| matches!(e, Event::PeerAddressChanged { to: Some(a), .. } if *a == new_addr)));
    assert_eq!(
        sim.server.as_ref().and_then(|s| s.peer_addr()),
        Some(new_addr)
    );
}

#[test]
fn server_move_request_reaches_the_client() {
    let seed = seed_from_env(21);
    let mut sim = connected(seed);
    sim.server
        .as_mut()
        .expect("server")
        .move_to("198.51.100.2:7447".into());
    sim.run_for(Duration::from_millis(500));
    assert!(sim
        .client_events
        .iter()
        .any(|e| matches!(e, Event::MoveRequested { addr } if addr == "198.51.100.2:7447")));
    // The client moves: drops its transport and resumes on a new one.
    sim.dial();
    let mut w = Workload::start(&mut sim, 2, 50_000);
    let t = sim.now + Duration::from_secs(30);
    assert!(sim.run_until(t, |s| w.pump(s)));
    assert!(sim
        .server_events
        .iter()
        .any(|e| matches!(e, Event::Resumed { .. })));
}

#[test]
fn idle_session_detects_a_black_hole_and_resumes() {
    let seed = seed_from_env(22);
    let mut sim = connected(seed);
    sim.run_for(Duration::from_secs(60));
    assert_eq!(
        sim.client.state(),
        State::Active,
        "heartbeats keep an idle session up"
    );
    assert!(sim.client.stats().rtt.is_some(), "heartbeats measure RTT");
    sim.blackhole_transport();
    let start = sim.now;
    let t = sim.now + Duration::from_secs(30);
    sim.run_until(t, |s| s.client.state() == State::Suspended);
    let detect = sim.now - start;
    assert!(
        detect <= Duration::from_secs(6),
        "suspension detected after {detect:?}"
    );
    let t = sim.now + Duration::from_secs(30);
    assert!(
        sim.run_until(t, |s| s.client.state() == State::Active),
        "resumes by itself"
    );
}

#[test]
fn first_connect_failure_is_a_clear_error() {
    let seed = seed_from_env(23);
    let mut sim = Sim::new(SimConfig::new(seed));
    sim.partition();
    sim.dial();
    sim.run_for(Duration::from_secs(30));
    assert_eq!(
        sim.client.close_reason(),
        Some(&CloseReason::Error(Error::HandshakeFailed))
    );
    assert!(sim.client.poll_timeout().is_none());
}

#[test]
fn peer_reset_is_reported_to_the_reader() {
    let mut sim = connected(seed_from_env(24));
    let id = sim.client.open_stream(b"doomed").expect("open");
    sim.client.write(id, b"some bytes").expect("write");
    sim.run_for(Duration::from_millis(200));
    sim.server
        .as_mut()
        .expect("server")
        .reset_stream(id, 0x101)
        .expect("reset");
    sim.run_for(Duration::from_millis(200));
    assert!(sim
        .client_events
        .iter()
        .any(|e| matches!(e, Event::StreamReset { stream, code: 0x101 } if *stream == id)));
    let mut buf = [0u8; 16];
    assert_eq!(
        sim.client.read(id, &mut buf),
        Err(roam_proto::StreamError::Reset(0x101))
    );
    // Once reported, the stream is gone.
    assert_eq!(
        sim.client.read(id, &mut buf),
        Err(roam_proto::StreamError::UnknownStream)
    );
}

#[test]
fn writer_blocked_by_the_session_buffer_is_woken() {
    let seed = seed_from_env(25);
    let mut cfg = SimConfig::new(seed);
    cfg.session = Config {
        stream_send_buffer: 1 << 20,
        session_send_buffer: 1 << 20,
        ..Config::default()
    };
    let mut sim = Sim::new(cfg);
    sim.dial();
    let t = sim.now + Duration::from_secs(5);
    assert!(sim.run_until(t, |s| s.client.state() == State::Active));
    let a = sim.client.open_stream(b"a").expect("open");
    let b = sim.client.open_stream(b"b").expect("open");
    let big = vec![7u8; 1 << 20];
    assert_eq!(sim.client.write(a, &big).expect("write"), 1 << 20);
    assert_eq!(
        sim.client.write(b, b"x").expect("write"),
        0,
        "session buffer full"
    );
    let t = sim.now + Duration::from_secs(10);
    let woke = sim.run_until(t, |s| {
        s.client_events
            .iter()
            .any(|e| matches!(e, Event::StreamWritable { stream } if *stream == b))
    });
    assert!(woke, "seed {seed}: stream b never became writable");
    assert_eq!(sim.client.write(b, b"x").expect("write"), 1);
}

/// A refusal in clear answers the client's resume (forged on the path, or a
/// server that briefly lost track): the client keeps its session, retries, and
/// resumes with every byte once the genuine server answers again (§12).
#[test]
fn a_cleartext_refusal_costs_a_retry_not_the_session() {
    let seed = seed_from_env(23);
    let mut sim = connected(seed);
    let mut w = Workload::start(&mut sim, 4, 200_000);
    let t = sim.now + Duration::from_millis(30);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    // Whoever answers the next resumes does not know the session.
    let genuine = sim.server.take();
    sim.reset_transport();
    let t = sim.now + Duration::from_secs(3);
    sim.run_until(t, |s| {
        w.pump(s);
        false
    });
    assert!(
        sim.endpoint_errors.contains(&Error::UnknownSession),
        "seed {seed}: the resume was refused"
    );
    assert_eq!(sim.client.state(), State::Suspended, "seed {seed}");
    // The genuine server answers again: the session resumes and finishes.
    sim.server = genuine;
    let t = sim.now + Duration::from_secs(60);
    assert!(
        sim.run_until(t, |s| w.pump(s)),
        "seed {seed}: transfer did not finish after the refusal"
    );
    assert!(w.error.is_none(), "{:?}", w.error);
    assert_eq!(closed_with(&sim.client_events), None);
}

/// A server that really lost the session keeps refusing: the client's session
/// ends with `UnknownSession`, but only once refusals have lasted the grace.
#[test]
fn persistent_refusals_end_the_session_after_the_grace() {
    let seed = seed_from_env(24);
    let mut sim = connected(seed);
    let grace = Config::default().refusal_grace;
    sim.server = None;
    sim.reset_transport();
    let t = sim.now + Duration::from_secs(120);
    assert!(sim.run_until(t, |s| s.client.state() == State::Closed));
    assert_eq!(
        closed_with(&sim.client_events),
        Some(CloseReason::Error(Error::UnknownSession))
    );
    let refusals = sim
        .endpoint_errors
        .iter()
        .filter(|e| **e == Error::UnknownSession)
        .count();
    assert!(refusals >= 2, "seed {seed}: {refusals} refusals");
    assert!(
        sim.elapsed() >= grace,
        "seed {seed}: ended after {:?}, before the {grace:?} grace",
        sim.elapsed()
    );
}
