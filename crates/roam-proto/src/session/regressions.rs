//! Regression tests for bugs the session fuzz targets found
//! (`fuzz/fuzz_targets/session_state.rs`), and for one a cluster test found
//! (a resume that dies half-way). They reach into the session's fields to
//! play the hostile peer the fuzzer played.

use std::time::Instant;

use super::{Session, State};
use crate::config::{ClientConfig, Config, ServerConfig, ServerTrust};
use crate::event::{Event, TransportId};
use crate::handshake::parse_hello;
use crate::keys::Keypair;

struct Pair {
    now: Instant,
    client: Session,
    server: Option<Session>,
    ctid: TransportId,
    stid: Option<TransportId>,
    server_cfg: ServerConfig,
}

impl Pair {
    fn new() -> Self {
        let server_key = Keypair::from_private([0x5a; 32]);
        let now = Instant::now();
        let mut client = Session::client(ClientConfig {
            keypair: Keypair::from_private([0x17; 32]),
            server_trust: ServerTrust::Pinned(server_key.public()),
            session: Config::default(),
        });
        let ctid = client.connect(now, None).unwrap();
        let mut p = Pair {
            now,
            client,
            server: None,
            ctid,
            stid: None,
            server_cfg: ServerConfig {
                keypair: server_key,
                authorized_keys: None,
                addresses: Vec::new(),
                session: Config::default(),
            },
        };
        p.hello();
        p.pump();
        assert_eq!(p.client.state(), State::Active);
        p
    }

    /// The server reads the client's opening (new session or resume).
    fn hello(&mut self) {
        let mut out = Vec::new();
        while self.client.poll_transmit(self.now, &mut out).is_some() {}
        let (hello, used) = parse_hello(&out).unwrap().unwrap();
        let stid = match self.server.as_mut() {
            None => {
                let (s, tid) = Session::accept(&self.server_cfg, self.now, &hello, None).unwrap();
                self.server = Some(s);
                tid
            }
            Some(s) => s.accept_resume(self.now, &hello, None).unwrap(),
        };
        self.stid = Some(stid);
        let server = self.server.as_mut().unwrap();
        server.handle_input(self.now, stid, &out[used..]).unwrap();
    }

    fn pump(&mut self) {
        for _ in 0..100 {
            let mut moved = false;
            let mut out = Vec::new();
            let server = self.server.as_mut().unwrap();
            while server.poll_transmit(self.now, &mut out).is_some() {}
            if !out.is_empty() {
                moved = true;
                let _ = self.client.handle_input(self.now, self.ctid, &out);
            }
            out.clear();
            while self.client.poll_transmit(self.now, &mut out).is_some() {}
            if !out.is_empty() {
                moved = true;
                let _ = server.handle_input(self.now, self.stid.unwrap(), &out);
            }
            if !moved {
                return;
            }
        }
        panic!("never quiet");
    }
}

/// A resuming client whose SYNC acknowledges the server's `CLOSE` (which it
/// never received) made the server emit `Resumed` after `Closed`, breaking
/// the rule that nothing but `TransportClosed` follows `Closed`.
#[test]
fn resume_that_acknowledges_close_emits_no_resumed_after_closed() {
    let mut p = Pair::new();
    let server = p.server.as_mut().unwrap();
    while server.poll_event().is_some() {}
    server.close(7, "bye");
    // The CLOSE goes out on the old transport and is lost with it.
    let mut lost = Vec::new();
    while server.poll_transmit(p.now, &mut lost).is_some() {}
    assert_eq!(server.state(), State::Closing);
    // The client claims it got the CLOSE: its SYNC acknowledges it.
    p.client.recv_seq += 1;
    p.ctid = p.client.connect(p.now, None).unwrap();
    p.hello();
    p.pump();
    let server = p.server.as_mut().unwrap();
    assert_eq!(server.state(), State::Closed);
    let events: Vec<Event> = std::iter::from_fn(|| server.poll_event()).collect();
    let closed = events
        .iter()
        .position(|e| matches!(e, Event::Closed { .. }))
        .expect("the server closed");
    assert!(
        events[closed..]
            .iter()
            .skip(1)
            .all(|e| matches!(e, Event::TransportClosed { .. })),
        "events after Closed: {events:?}"
    );
}

/// A stream the peer finished and then reset read as a clean end-of-stream
/// once the session had closed (its bytes silently discarded), although the
/// same read before the close reports the reset.
#[test]
fn reset_stream_does_not_read_as_clean_end_after_close() {
    use crate::error::StreamError;
    let mut p = Pair::new();
    let id = p.client.open_stream(b"").unwrap();
    assert_eq!(p.client.write(id, &[7; 3000]).unwrap(), 3000);
    p.client.finish_stream(id).unwrap();
    p.pump();
    p.client.reset_stream(id, 49).unwrap();
    p.client.close(1, "bye");
    p.pump();
    let server = p.server.as_mut().unwrap();
    assert_eq!(server.state(), State::Closed);
    let mut buf = [0u8; 4096];
    assert_eq!(server.read(id, &mut buf), Err(StreamError::Reset(49)));
}

/// One ACK that covered a blocked writer's bytes and the `CLOSE` after them
/// closed the session and then woke the writer: `StreamWritable` came after
/// `Closed` (found by `session_input`; the writers were looked at after the
/// whole ACK, by which time the acknowledged `CLOSE` had ended the session).
#[test]
fn ack_of_data_and_close_wakes_no_writer_after_closed() {
    let mut p = Pair::new();
    // The client's stream leaves unread bytes at the server, so the stream
    // outlives the close there.
    let id = p.client.open_stream(b"").unwrap();
    assert_eq!(p.client.write(id, b"unread").unwrap(), 6);
    p.pump();
    let server = p.server.as_mut().unwrap();
    while server.poll_event().is_some() {}
    let big = vec![9u8; 3 << 20];
    let took = server.write(id, &big).unwrap();
    assert!(
        took < big.len(),
        "the write must block ({took} bytes taken)"
    );
    server.close(7, "bye");
    assert_eq!(server.state(), State::Closing);
    p.pump();
    let server = p.server.as_mut().unwrap();
    assert_eq!(server.state(), State::Closed);
    let events: Vec<Event> = std::iter::from_fn(|| server.poll_event()).collect();
    let closed = events
        .iter()
        .position(|e| matches!(e, Event::Closed { .. }))
        .expect("the server closed");
    assert!(
        events[closed + 1..]
            .iter()
            .all(|e| matches!(e, Event::TransportClosed { .. })),
        "events after Closed: {events:?}"
    );
}

/// A client restored from an old copy of its continuation (a stale state
/// file, a second process with the same name) resumed with a `SYNC` that
/// acknowledged less than the server had already freed. Its resume
/// authenticated, so the server treated the violation as the live client's
/// and closed the session: the stale copy killed the session the live client
/// was using. Now the stale transport is refused and the session goes on.
#[test]
fn a_stale_resume_is_refused_without_harming_the_live_session() {
    let mut p = Pair::new();
    let stale = p.client.export(p.now).unwrap();
    // Both ways, so the server frees frames the stale copy never saw
    // acknowledged and the live client acknowledges frames the copy lacks.
    let id = p.client.open_stream(b"").unwrap();
    assert_eq!(p.client.write(id, b"before").unwrap(), 6);
    p.pump();
    let server = p.server.as_mut().unwrap();
    assert_eq!(server.write(id, b"reply").unwrap(), 5);
    p.pump();
    let mut buf = [0u8; 64];
    assert_eq!(p.client.read(id, &mut buf), Ok(Some(5)));
    // Past the ACK delay: both sides acknowledge, and free what they sent.
    p.now += std::time::Duration::from_secs(1);
    p.pump();

    let mut copy = Session::restore_client(
        ClientConfig {
            keypair: Keypair::from_private([0x17; 32]),
            server_trust: ServerTrust::Pinned(p.server_cfg.keypair.public()),
            session: Config::default(),
        },
        p.now,
        &stale,
        std::time::Duration::ZERO,
    )
    .unwrap();
    let ctid = copy.connect(p.now, None).unwrap();
    let mut out = Vec::new();
    while copy.poll_transmit(p.now, &mut out).is_some() {}
    let (hello, used) = parse_hello(&out).unwrap().unwrap();
    let server = p.server.as_mut().unwrap();
    let stid = server.accept_resume(p.now, &hello, None).unwrap();
    server.handle_input(p.now, stid, &out[used..]).unwrap();
    // The server's reply (its own SYNC) goes to the copy, whose answer
    // (its SYNC) reaches the server.
    let mut reply = Vec::new();
    while let Some(t) = server.poll_transmit(p.now, &mut reply) {
        if t != stid {
            reply.clear();
        }
    }
    let _ = copy.handle_input(p.now, ctid, &reply);
    let mut answer = Vec::new();
    while copy.poll_transmit(p.now, &mut answer).is_some() {}
    assert_eq!(copy.state(), State::Closed, "the copy finds itself stale");
    let refused = server.handle_input(p.now, stid, &answer);
    assert!(refused.is_err(), "the stale resume must be refused");
    assert_ne!(server.state(), State::Closed, "the session survives it");

    // The live client carries on, every byte in order.
    assert_eq!(p.client.write(id, b" after").unwrap(), 6);
    p.pump();
    let server = p.server.as_mut().unwrap();
    let mut got = [0u8; 64];
    assert_eq!(server.read(id, &mut got), Ok(Some(12)));
    assert_eq!(&got[..12], b"before after");
    assert_eq!(server.state(), p.client.state());
}

/// A suspended server session whose resume dies before the client proves
/// it live stayed suspended without a word: a host that had restored the
/// session from its continuation for that resume kept it out of its store
/// (and the cluster's directory) until its own 15 s wait ran out. Now the
/// session says `ResumeAbandoned`, when the transport closes and when its
/// handshake times out; and only when nothing else carries the session.
#[test]
fn a_resume_that_dies_half_way_is_reported_abandoned() {
    let abandoned = |s: &mut Session| {
        std::iter::from_fn(|| s.poll_event()).any(|e| e == Event::ResumeAbandoned)
    };
    let mut p = Pair::new();
    let old = p.stid.unwrap();
    // The transport dies: the server suspends.
    let server = p.server.as_mut().unwrap();
    server.handle_transport_closed(p.now, old);
    assert_eq!(server.state(), State::Suspended);
    assert!(!abandoned(server), "no resume was under way");
    // A resume reaches the server, and its transport closes before the
    // client's first authenticated record.
    p.ctid = p.client.connect(p.now, None).unwrap();
    p.hello();
    let server = p.server.as_mut().unwrap();
    let pending = p.stid.unwrap();
    assert!(server.active_transport().is_none());
    server.handle_transport_closed(p.now, pending);
    assert!(abandoned(server));
    assert_eq!(server.state(), State::Suspended);
    // Another one times out in its handshake.
    p.ctid = p.client.connect(p.now, None).unwrap();
    p.hello();
    let server = p.server.as_mut().unwrap();
    while server.poll_event().is_some() {}
    server.handle_timeout(p.now + std::time::Duration::from_secs(11));
    assert!(abandoned(server));
    assert_eq!(server.state(), State::Suspended);
    // The next completes: the session goes on.
    p.ctid = p.client.connect(p.now, None).unwrap();
    p.hello();
    p.pump();
    assert_eq!(p.client.state(), State::Active);
    assert_eq!(p.server.as_ref().unwrap().state(), State::Active);
}

/// A resume that dies while the old transport still carries the session
/// (the client re-dialed, the server had not noticed the loss yet) is no
/// news: the session is not suspended.
#[test]
fn a_resume_that_dies_beside_a_live_transport_is_not_reported() {
    let mut p = Pair::new();
    p.ctid = p.client.connect(p.now, None).unwrap();
    p.hello();
    let server = p.server.as_mut().unwrap();
    assert!(server.active_transport().is_some());
    server.handle_transport_closed(p.now, p.stid.unwrap());
    assert!(std::iter::from_fn(|| server.poll_event()).all(|e| e != Event::ResumeAbandoned));
    assert_eq!(server.state(), State::Active);
}
