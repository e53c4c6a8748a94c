//! Arbitrary bytes as a client's opening (`docs/PROTOCOL.md` §4.2).
//!
//! `route_opening` (the server endpoint's routing decision) must never panic
//! and never claim more bytes than it was given; a refusal's reply is empty or
//! a 6-byte refusal; a resume's `Moved` reply carries the address.
//! A new-session hello is answered by a real server session (`Session::accept`),
//! which is then fed the rest of the input as the client's next message and
//! driven through `poll_transmit`, `poll_event` and `handle_timeout`.

#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use roam_proto::{route_opening, Config, Keypair, Opening, ServerConfig, Session, Status};

/// Built once per process: key derivation is the slow part of setting up.
fn server_config() -> &'static ServerConfig {
    static CONFIG: OnceLock<ServerConfig> = OnceLock::new();
    CONFIG.get_or_init(|| ServerConfig {
        keypair: Keypair::from_private([0x5a; 32]),
        authorized_keys: None,
        addresses: vec!["127.0.0.1:7447".into()],
        session: Config::default(),
    })
}

/// Drains output and events; bounded so a session that never goes quiet is a finding.
fn drain(session: &mut Session, now: Instant) {
    let mut out = Vec::new();
    for _ in 0..64 {
        out.clear();
        if session.poll_transmit(now, &mut out).is_none() {
            break;
        }
    }
    while session.poll_event().is_some() {}
}

fuzz_target!(|data: &[u8]| {
    let (hello, used) = match route_opening(data) {
        Opening::New { hello, used } => (hello, used),
        Opening::Resume { hello, used, .. } => {
            assert!(used <= data.len());
            let moved = hello.redirect("10.0.0.2:7447").expect("a usable address");
            assert_eq!(&moved[..6], b"ROAM\x00\x06");
            assert_eq!(&moved[8..], b"10.0.0.2:7447");
            return;
        }
        Opening::Refuse { reply, .. } => {
            assert!(
                reply.is_empty() || reply.len() == 6,
                "refusal of {} bytes",
                reply.len()
            );
            return;
        }
        _ => return,
    };
    assert!(
        used <= data.len(),
        "route_opening used {used} of {} bytes",
        data.len()
    );

    let mut refusal = Vec::new();
    hello.reject(Status::UnsupportedVersion, &mut refusal);
    assert_eq!(refusal.len(), 6);

    let now = Instant::now();
    let Ok((mut session, transport)) = Session::accept(server_config(), now, &hello, None) else {
        return;
    };
    assert!(hello.resume_session().is_none() && hello.version_supported());
    drain(&mut session, now);
    let _ = session.handle_input(now, transport, &data[used..]);
    drain(&mut session, now);
    for secs in [1, 11, 3 * 24 * 3600 + 1] {
        let later = now + Duration::from_secs(secs);
        session.handle_timeout(later);
        drain(&mut session, later);
    }
});
