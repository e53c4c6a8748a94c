//! Helpers shared by the integration tests: a client/server pair of
//! sessions wired back to back, and numbered test data.

#![allow(dead_code)]

use std::time::Instant;

use roam_proto::{
    route_opening, ClientConfig, Config, Keypair, Opening, ServerConfig, ServerTrust, Session,
    State, StreamId, TransportId,
};

/// A server configuration for `key`, defaults otherwise.
pub(crate) fn server_config(key: &Keypair) -> ServerConfig {
    ServerConfig {
        keypair: key.clone(),
        authorized_keys: None,
        addresses: Vec::new(),
        session: Config::default(),
    }
}

/// Moves everything the two sides have to send, until quiet.
pub(crate) fn pump(
    now: Instant,
    c: &mut Session,
    ct: TransportId,
    s: &mut Session,
    st: TransportId,
) {
    for _ in 0..1000 {
        let mut moved = false;
        let mut out = Vec::new();
        while s.poll_transmit(now, &mut out).is_some() {}
        if !out.is_empty() {
            moved = true;
            c.handle_input(now, ct, &out).expect("client input");
        }
        out.clear();
        while c.poll_transmit(now, &mut out).is_some() {}
        if !out.is_empty() {
            moved = true;
            s.handle_input(now, st, &out).expect("server input");
        }
        if !moved {
            return;
        }
    }
    panic!("the pair never went quiet");
}

/// The client's opening bytes on transport `t`.
pub(crate) fn opening(now: Instant, c: &mut Session) -> Vec<u8> {
    let mut out = Vec::new();
    while c.poll_transmit(now, &mut out).is_some() {}
    out
}

/// Reads everything readable on `id`.
pub(crate) fn read_all(s: &mut Session, id: StreamId) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(Some(n)) = s.read(id, &mut buf) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    got
}

pub(crate) fn numbered(from: u32, to: u32) -> Vec<u8> {
    (from..to).flat_map(|i| i.to_be_bytes()).collect()
}

/// Opens a session between a fresh client and a server on `cfg`.
pub(crate) fn pair(
    cfg: &ServerConfig,
    service_key: &Keypair,
    now: Instant,
) -> (Session, TransportId, Session, TransportId) {
    let mut client = Session::client(ClientConfig {
        keypair: Keypair::generate().unwrap(),
        server_trust: ServerTrust::Pinned(service_key.public()),
        session: Config::default(),
    });
    let ct = client.connect(now, None).unwrap();
    let bytes = opening(now, &mut client);
    let Opening::New { hello, used } = route_opening(&bytes) else {
        panic!("expected a new session");
    };
    let (mut s, st) = Session::accept(cfg, now, &hello, None).unwrap();
    s.handle_input(now, st, &bytes[used..]).unwrap();
    pump(now, &mut client, ct, &mut s, st);
    assert_eq!(client.state(), State::Active);
    (client, ct, s, st)
}
