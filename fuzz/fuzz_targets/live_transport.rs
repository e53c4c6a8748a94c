//! A moved transport's state (`docs/PROTOCOL.md` §13.6) through
//! `Session::adopt_transport`, on a session restored from a continuation.
//!
//! The input is `n` (u16, little-endian), then `n` bytes of a continuation's
//! sections, then a transport state's sections; the target adds both
//! envelopes' magic, format byte and a valid SHA-256, so the fuzzer explores
//! the decoders behind the checksums. Properties: adopting never panics; a
//! refused state leaves the session suspended with no transport; an adopted
//! session is active on that transport, survives input, timers and
//! polling, and its transport state exported again adopts into a fresh
//! restore of the same continuation. Seeds (`seeds/live_transport/`) are
//! real moves, written by `ROAM_LIVE_SEEDS_DIR=… cargo test -p roam-proto
//! --test snapshot_roundtrip`.

#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use roam_proto::{Config, Keypair, ServerConfig, Session, State};
use sha2::{Digest, Sha256};

fn config() -> &'static ServerConfig {
    static CFG: OnceLock<ServerConfig> = OnceLock::new();
    CFG.get_or_init(|| ServerConfig {
        keypair: Keypair::from_private([7; 32]),
        authorized_keys: None,
        addresses: Vec::new(),
        session: Config::default(),
    })
}

/// `magic`, format 2, `sections`, and the digest of all that.
fn envelope(magic: &[u8; 4], sections: &[u8]) -> Vec<u8> {
    let mut blob = magic.to_vec();
    blob.push(2);
    blob.extend_from_slice(sections);
    let digest = Sha256::digest(&blob);
    blob.extend_from_slice(&digest);
    blob
}

fuzz_target!(|data: &[u8]| {
    let Some((n, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let n = usize::from(u16::from_le_bytes(*n)).min(rest.len());
    let (cont, live) = rest.split_at(n);
    let cont = envelope(b"RMSC", cont);
    let live = envelope(b"RMLT", live);
    let now = Instant::now();
    let Ok(mut s) = Session::restore_server(config(), now, &cont, Duration::ZERO) else {
        return;
    };
    // The raw bytes as a whole blob too (mostly refused by the checksum).
    let _ = Session::restore_server(config(), now, &cont, Duration::ZERO)
        .map(|mut t| t.adopt_transport(now, rest));
    let tid = match s.adopt_transport(now, &live) {
        Ok(t) => t,
        Err(_) => {
            assert!(
                s.active_transport().is_none(),
                "a refused state left a transport"
            );
            assert_ne!(
                s.state(),
                State::Active,
                "a refused state made the session active"
            );
            return;
        }
    };
    assert_eq!(s.state(), State::Active);
    assert_eq!(s.active_transport(), Some(tid));
    // Exported again, the state adopts into a fresh restore.
    if let Some(again) = s.export_transport() {
        let mut fresh = Session::restore_server(config(), now, &cont, Duration::ZERO)
            .expect("the continuation restored once");
        fresh
            .adopt_transport(now, &again)
            .expect("an exported transport state adopts");
    }
    // Usable: input (hostile bytes, likely a failed record), timers, output.
    let _ = s.handle_input(now, tid, &rest[..rest.len().min(64)]);
    s.handle_timeout(now + Duration::from_secs(2));
    let mut out = Vec::new();
    for _ in 0..8 {
        out.clear();
        if s.poll_transmit(now, &mut out).is_none() {
            break;
        }
    }
    while s.poll_event().is_some() {}
    let _ = s.export(now);
});
