//! Arbitrary session continuations through `Session::restore_server`
//! (`docs/PROTOCOL.md` §13).
//!
//! The fuzz input is the continuation's *sections* (format 2: `id`,
//! `version`, `length`, body, …); the target adds the magic, format byte and
//! a valid SHA-256, so the fuzzer explores the section framing and every
//! part's decoder behind the checksum rather than the checksum itself.
//! Properties: restoring never panics; a restored session's export is
//! canonical (restoring it and exporting again gives the same bytes); after
//! timers and polling, a session that restores exports again to a blob that
//! restores too. Seeds (`seeds/continuation/`) are real snapshots' sections,
//! written by `ROAM_SNAPSHOT_SEEDS_DIR=… cargo test -p roam-proto --test
//! snapshot_roundtrip`.

#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use roam_proto::{Config, Keypair, ServerConfig, Session};
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

fuzz_target!(|body: &[u8]| {
    let mut blob = b"RMSC\x02".to_vec();
    blob.extend_from_slice(body);
    let digest = Sha256::digest(&blob);
    blob.extend_from_slice(&digest);
    let now = Instant::now();
    // Raw input as a whole blob too (mostly rejected by the checksum).
    let _ = Session::restore_server(config(), now, body, Duration::ZERO);
    if let Ok(mut s) = Session::restore_server(config(), now, &blob, Duration::ZERO) {
        // Round trip: export, restore, export again: the same bytes.
        if let Ok(first) = s.export(now) {
            let back = Session::restore_server(config(), now, &first, Duration::ZERO)
                .expect("an exported continuation restores");
            let second = back.export(now).expect("a restored session exports");
            assert!(first == second, "export(restore(export)) changed the blob");
        }
        // A restored session is usable: timers, polling and export all work.
        s.handle_timeout(now + Duration::from_secs(1));
        let mut out = Vec::new();
        let _ = s.poll_transmit(now, &mut out);
        while s.poll_event().is_some() {}
        if let Ok(again) = s.export(now) {
            Session::restore_server(config(), now, &again, Duration::ZERO)
                .expect("an exported continuation restores");
        }
    }
});
