//! A session moves between two server hosts at the protocol level
//! (`docs/PROTOCOL.md` §9.3): host A exports it live, host B restores it,
//! the client's resume at A is answered with a `Moved` refusal naming B
//! ([`route_opening`] + [`Hello::redirect`]), the client resumes at B, and
//! every byte written on either side before, during and after the move is
//! read exactly once, in order.

use std::time::{Duration, Instant};

mod common;

use common::{numbered, opening, pair, pump, read_all, server_config};
use roam_proto::{
    route_opening, ClientConfig, Config, Event, Keypair, Opening, ServerTrust, Session, State,
};

#[test]
fn a_resume_at_the_old_host_is_redirected_and_nothing_is_lost() {
    let service_key = Keypair::generate().unwrap();
    let cfg = server_config(&service_key);
    let mut now = Instant::now();

    // A new session at host A.
    let (mut client, ct, mut a, at) = pair(&cfg, &service_key, now);
    let id = client.id().unwrap();

    // Traffic both ways, partly unacknowledged when the snapshot is taken.
    let cs = client.open_stream(b"move-me").unwrap();
    client.write(cs, &numbered(0, 1000)).unwrap();
    pump(now, &mut client, ct, &mut a, at);
    while let Some(ev) = a.poll_event() {
        let _ = ev;
    }
    assert_eq!(read_all(&mut a, cs), numbered(0, 1000));
    a.write(cs, &numbered(0, 500)).unwrap();
    client.write(cs, &numbered(1000, 1500)).unwrap();
    // A seals its bytes but they never reach the client; the client's are in flight.
    let mut lost = Vec::new();
    while a.poll_transmit(now, &mut lost).is_some() {}
    let mut in_flight = Vec::new();
    while client.poll_transmit(now, &mut in_flight).is_some() {}

    // Host A hands the live session to host B and forgets it.
    let blob = a.export(now).unwrap();
    drop(a);
    let mut b = Session::restore_server(&cfg, now, &blob, Duration::ZERO).unwrap();

    // The client loses its transport and resumes at A, which no longer holds it.
    now += Duration::from_millis(5);
    client.handle_transport_closed(now, ct);
    let ct = client.connect(now, None).unwrap();
    let bytes = opening(now, &mut client);
    let Opening::Resume {
        id: named, hello, ..
    } = route_opening(&bytes)
    else {
        panic!("expected a resume");
    };
    assert_eq!(named, id);
    let reply = hello.redirect("host-b.example:7447").unwrap();
    let err = client.handle_input(now, ct, &reply).unwrap_err();
    assert_eq!(err, roam_proto::Error::Moved("host-b.example:7447".into()));
    let mut asked = None;
    while let Some(ev) = client.poll_event() {
        if let Event::MoveRequested { addr } = ev {
            asked = Some(addr);
        }
    }
    assert_eq!(asked.as_deref(), Some("host-b.example:7447"));
    assert_eq!(
        client.state(),
        State::Suspended,
        "a redirect costs only the transport"
    );

    // The client resumes at B; everything unacknowledged is replayed.
    let ct = client.connect(now, None).unwrap();
    let bytes = opening(now, &mut client);
    let Opening::Resume { hello, used, .. } = route_opening(&bytes) else {
        panic!("expected a resume");
    };
    let bt = b.accept_resume(now, &hello, None).unwrap();
    b.handle_input(now, bt, &bytes[used..]).unwrap();
    pump(now, &mut client, ct, &mut b, bt);
    assert_eq!(client.state(), State::Active);
    assert_eq!(b.state(), State::Active);
    b.write(cs, &numbered(500, 800)).unwrap();
    client.write(cs, &numbered(1500, 2000)).unwrap();
    client.finish_stream(cs).unwrap();
    b.finish_stream(cs).unwrap();
    pump(now, &mut client, ct, &mut b, bt);
    assert_eq!(read_all(&mut b, cs), numbered(1000, 2000));
    assert_eq!(read_all(&mut client, cs), numbered(0, 800));
}

#[test]
fn a_redirect_to_an_unusable_address_is_not_sent() {
    let mut c = Session::client(ClientConfig {
        keypair: Keypair::generate().unwrap(),
        server_trust: ServerTrust::FirstUse,
        session: Config::default(),
    });
    let now = Instant::now();
    c.connect(now, None).unwrap();
    let bytes = opening(now, &mut c);
    let Opening::New { hello, .. } = route_opening(&bytes) else {
        panic!("expected a new session");
    };
    assert!(hello.redirect("").is_none());
    assert!(hello
        .redirect(&"x".repeat(roam_proto::MAX_MOVED_ADDR + 1))
        .is_none());
    assert!(hello.redirect("10.0.0.2:7447").is_some());
}

#[test]
fn a_first_connect_redirected_fails_with_the_address() {
    // A new session is never redirected by roam's servers; a client that
    // gets `Moved` on its first transport reports it and has no session.
    let mut c = Session::client(ClientConfig {
        keypair: Keypair::generate().unwrap(),
        server_trust: ServerTrust::FirstUse,
        session: Config::default(),
    });
    let now = Instant::now();
    let ct = c.connect(now, None).unwrap();
    let bytes = opening(now, &mut c);
    let Opening::New { hello, .. } = route_opening(&bytes) else {
        panic!("expected a new session");
    };
    let reply = hello.redirect("10.0.0.2:7447").unwrap();
    // Delivered a byte at a time: every prefix is "need more".
    for i in 0..reply.len() - 1 {
        assert!(
            c.handle_input(now, ct, &reply[i..i + 1]).is_ok(),
            "byte {i}"
        );
    }
    let err = c
        .handle_input(now, ct, &reply[reply.len() - 1..])
        .unwrap_err();
    assert_eq!(err, roam_proto::Error::Moved("10.0.0.2:7447".into()));
    assert_eq!(c.state(), State::Closed);
}

fn asked(s: &mut Session) -> Vec<String> {
    let mut v = Vec::new();
    while let Some(ev) = s.poll_event() {
        if let Event::MoveAsked { host } = ev {
            v.push(host);
        }
    }
    v
}

#[test]
fn a_clients_move_request_reaches_the_server_once_even_across_a_suspension() {
    let service_key = Keypair::generate().unwrap();
    let cfg = server_config(&service_key);
    let now = Instant::now();
    let (mut client, ct, mut s, st) = pair(&cfg, &service_key, now);
    client.ask_move("replica-2".into());
    pump(now, &mut client, ct, &mut s, st);
    assert_eq!(asked(&mut s), vec!["replica-2".to_string()]);

    // Asked while the transport is down: it is reliable, so it arrives
    // after the resume, once.
    let now = now + Duration::from_millis(10);
    client.handle_transport_closed(now, ct);
    s.handle_transport_closed(now, st);
    client.ask_move(String::new());
    let ct = client.connect(now, None).unwrap();
    let bytes = opening(now, &mut client);
    let Opening::Resume { hello, used, .. } = route_opening(&bytes) else {
        panic!("expected a resume");
    };
    let st = s.accept_resume(now, &hello, None).unwrap();
    s.handle_input(now, st, &bytes[used..]).unwrap();
    pump(now, &mut client, ct, &mut s, st);
    assert_eq!(asked(&mut s), vec![String::new()], "empty: any host");
    pump(now, &mut client, ct, &mut s, st);
    assert!(asked(&mut s).is_empty(), "not delivered twice");
}

#[test]
fn only_a_client_asks_to_move() {
    // A server's session never makes a MOVE_ASK...
    let service_key = Keypair::generate().unwrap();
    let cfg = server_config(&service_key);
    let now = Instant::now();
    let (mut client, ct, mut s, st) = pair(&cfg, &service_key, now);
    s.ask_move("x".into());
    pump(now, &mut client, ct, &mut s, st);
    assert!(asked(&mut client).is_empty());
    // ...and the frame is the test vector of §5.2.4.
    let mut f = Vec::new();
    roam_proto::frame::Frame::MoveAsk { host: b"x" }.encode(&mut f);
    assert_eq!(f, [0x09, 0x01, b'x']);
}
