//! What a journal (a copy of a client session that must outlive its
//! process, `roam::SessionHandle::set_journal`) relies on: `peer_exposure`
//! grows exactly when `poll_transmit` gives the peer something new, a copy
//! exported after the transmit resumes with every byte once, and a copy
//! exported before it cannot be resumed (so the copy must be written before
//! the bytes leave); `peek` shows bytes without taking them.

mod common;

use std::time::{Duration, Instant};

use common::{numbered, opening, pair, pump, read_all, server_config};
use roam_proto::{
    route_opening, ClientConfig, Config, Keypair, Opening, ServerTrust, Session, State, StreamId,
    TransportId,
};

/// A client restored from `blob` (for the server `key`) resumes at `server`
/// over a new transport; returns it, its transport, the server's, and
/// whether the resume completed (both sides active).
fn resume_copy(
    now: Instant,
    key: &Keypair,
    blob: &[u8],
    server: &mut Session,
) -> (Session, TransportId, TransportId, bool) {
    let mut c = Session::restore_client(
        ClientConfig {
            keypair: Keypair::generate().unwrap(),
            server_trust: ServerTrust::Pinned(key.public()),
            session: Config::default(),
        },
        now,
        blob,
        Duration::ZERO,
    )
    .unwrap();
    let ct = c.connect(now, None).unwrap();
    let bytes = opening(now, &mut c);
    let Opening::Resume { hello, used, .. } = route_opening(&bytes) else {
        panic!("expected a resume");
    };
    let st = server.accept_resume(now, &hello, None).unwrap();
    let _ = server.handle_input(now, st, &bytes[used..]);
    // Moves bytes until quiet or until either side gives up on them.
    for _ in 0..100 {
        let mut out = Vec::new();
        while server.poll_transmit(now, &mut out).is_some() {}
        let mut back = Vec::new();
        if !out.is_empty() && c.handle_input(now, ct, &out).is_ok() {
            while c.poll_transmit(now, &mut back).is_some() {}
        }
        if back.is_empty() || server.handle_input(now, st, &back).is_err() {
            break;
        }
    }
    let ok = c.state() == State::Active && server.state() == State::Active;
    (c, ct, st, ok)
}

#[test]
fn a_copy_taken_after_the_transmit_resumes_and_one_taken_before_does_not() {
    let key = Keypair::generate().unwrap();
    let cfg = server_config(&key);
    let now = Instant::now();
    let (mut client, ct, mut server, st) = pair(&cfg, &key, now);
    let cs = client.open_stream(b"journal").unwrap();
    client.write(cs, &numbered(0, 1000)).unwrap();
    pump(now, &mut client, ct, &mut server, st);
    assert_eq!(read_all(&mut server, cs), numbered(0, 1000));
    let settled = client.peer_exposure();

    // Written but not transmitted: nothing new for the peer yet.
    client.write(cs, &numbered(1000, 2000)).unwrap();
    assert_eq!(client.peer_exposure(), settled);
    let before = client.export(now).unwrap();
    let mut wire = Vec::new();
    while client.poll_transmit(now, &mut wire).is_some() {}
    assert!(
        client.peer_exposure().0 > settled.0,
        "the transmit exposed new frames"
    );
    let after = client.export(now).unwrap();
    // The bytes reach the server; then the client process dies.
    server.handle_input(now, st, &wire).unwrap();
    drop(client);
    server.handle_transport_closed(now, st);

    // The copy from before the transmit is behind what the server holds.
    let (stale, _, _, ok) = resume_copy(now, &key, &before, &mut server);
    assert!(!ok, "a copy older than the bytes sent must not resume");
    assert_eq!(stale.state(), State::Closed, "the stale copy gives up");
    assert_ne!(
        server.state(),
        State::Closed,
        "a stale copy does not end the session"
    );

    // The copy from after it resumes: every byte once, and the session goes on.
    let (mut client, ct, st, ok) = resume_copy(now, &key, &after, &mut server);
    assert!(ok, "the up-to-date copy resumes");
    client.write(cs, &numbered(2000, 2500)).unwrap();
    pump(now, &mut client, ct, &mut server, st);
    assert_eq!(read_all(&mut server, cs), numbered(1000, 2500));
}

#[test]
fn an_acknowledgement_is_exposure_too() {
    let key = Keypair::generate().unwrap();
    let cfg = server_config(&key);
    let now = Instant::now();
    let (mut client, ct, mut server, st) = pair(&cfg, &key, now);
    let cs = client.open_stream(b"journal").unwrap();
    client.write(cs, b"hello").unwrap();
    pump(now, &mut client, ct, &mut server, st);
    let _ = read_all(&mut server, cs);
    server.write(cs, &numbered(0, 1000)).unwrap();
    let mut wire = Vec::new();
    while server.poll_transmit(now, &mut wire).is_some() {}
    // A copy taken before the bytes arrived; they are applied, and the
    // acknowledgement (not the arrival) is what the journal answers to.
    let before = client.export(now).unwrap();
    let settled = client.peer_exposure();
    client.handle_input(now, ct, &wire).unwrap();
    assert_eq!(
        client.peer_exposure(),
        settled,
        "arrival alone exposes nothing"
    );
    let later = now + Duration::from_secs(1);
    let mut ack = Vec::new();
    while client.poll_transmit(later, &mut ack).is_some() {}
    assert!(
        client.peer_exposure().1 > settled.1,
        "the acknowledgement is exposure"
    );
    let after = client.export(later).unwrap();
    server.handle_input(later, st, &ack).unwrap();
    drop(client);
    server.handle_transport_closed(later, st);

    let (stale, _, _, ok) = resume_copy(later, &key, &before, &mut server);
    assert!(
        !ok,
        "a copy that never acknowledged what the server dropped must not resume"
    );
    drop(stale);
    let (mut client, _, _, ok) = resume_copy(later, &key, &after, &mut server);
    assert!(ok, "the up-to-date copy resumes");
    assert_eq!(
        read_all(&mut client, cs),
        numbered(0, 1000),
        "every byte once"
    );
}

#[test]
fn peek_shows_bytes_without_taking_them() {
    let key = Keypair::generate().unwrap();
    let cfg = server_config(&key);
    let now = Instant::now();
    let (mut client, ct, mut server, st) = pair(&cfg, &key, now);
    let cs = client.open_stream(b"peek").unwrap();
    pump(now, &mut client, ct, &mut server, st);
    let mut buf = [0u8; 4];
    assert_eq!(client.peek(cs, 0, &mut buf), Ok(None), "nothing yet");
    server.write(cs, b"hello world").unwrap();
    server.finish_stream(cs).unwrap();
    pump(now, &mut client, ct, &mut server, st);
    for _ in 0..2 {
        assert_eq!(client.peek(cs, 0, &mut buf), Ok(Some(4)));
        assert_eq!(&buf, b"hell");
        assert_eq!(client.readable_len(cs), 11, "peek took nothing");
    }
    assert_eq!(client.peek(cs, 6, &mut buf), Ok(Some(4)), "looking ahead");
    assert_eq!(&buf, b"worl");
    assert_eq!(client.peek(cs, 10, &mut buf), Ok(Some(1)));
    assert_eq!(
        client.peek(cs, 11, &mut buf),
        Ok(Some(0)),
        "nothing past the end, which came"
    );
    let before = client.stream_progress(cs).unwrap();
    assert_eq!(before.read, 0);
    assert!(before.peer_finished);
    assert_eq!(read_all(&mut client, cs), b"hello world");
    assert_eq!(client.stream_progress(cs).map(|p| p.read), Some(11));
    assert_eq!(client.peek(cs, 0, &mut buf), Ok(Some(0)), "end of stream");
    assert_eq!(
        client.peek(StreamId(999), 0, &mut buf),
        Err(roam_proto::StreamError::UnknownStream)
    );
}
