//! The `roam` command's text parsers (`roam_cli::parsers`): config file,
//! authorized keys, known servers, allow rules, durations, `--trickle`
//! rates, control replies,
//! the record a detached named session leaves (`roam pipe --name`) and
//! its journal's slot files,
//! `roam shell`'s stream frames and request, the control frames between
//! the relay and a shell's worker process, and `roam migrate-process`'s
//! stream frames and the page requests of a destination's lazy-pages daemon,
//! and the request and response frames of the remote chunk store (`roam
//! store serve`).
//!
//! The first input byte picks the parser, the rest is its input (as UTF-8,
//! lossily). Properties: no parser panics, and each one that re-encodes what
//! it decoded round-trips: parsing the canonical form gives the same value.
//! (It found `parse_duration` panicking on durations beyond `u64::MAX`
//! seconds, now an error.)

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_cli::parsers;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match which % 8 {
        0 => {
            // The re-encoding is a description, not TOML: parsing is deterministic.
            if let Ok(c) = parsers::config_file(&text) {
                assert_eq!(parsers::config_file(&text), Ok(c));
            }
        }
        1 => {
            if let Ok(keys) = parsers::authorized_keys(&text) {
                let again: String = keys.iter().map(|k| format!("{k}\n")).collect();
                assert_eq!(parsers::authorized_keys(&again), Ok(keys));
            }
        }
        2 => {
            if let Ok(entries) = parsers::known_servers(&text) {
                let again = parsers::format_known_servers(&entries);
                assert_eq!(parsers::known_servers(&again), Ok(entries));
            }
        }
        3 => {
            if let Ok(rule) = parsers::allow_rule(&text) {
                assert_eq!(parsers::allow_rule(&rule), Ok(rule.clone()));
            }
        }
        4 => {
            if let Ok(ms) = parsers::duration(&text) {
                if let Ok(again) = parsers::duration(&format!("{ms}ms")) {
                    assert_eq!(again, ms, "{text:?}");
                }
            }
        }
        5 => {
            // A rate in bytes per second, written back in bits per second.
            if let Ok(Some(bytes)) = parsers::trickle_rate(&text) {
                let again = parsers::trickle_rate(&(bytes * 8).to_string());
                assert_eq!(again, Ok(Some(bytes)), "{text:?}");
            }
        }
        6 => {
            // Bytes, not text. The header's JSON may come in any key order
            // or spacing; its re-encoding is canonical and stable.
            if let Ok(again) = parsers::detached_record(rest) {
                assert_eq!(parsers::detached_record(&again), Ok(again.clone()));
            }
            // The same bytes as a journal slot (its record is the same format).
            if let Ok(Some(again)) = parsers::journal_slot(rest) {
                assert_eq!(parsers::journal_slot(&again), Ok(Some(again.clone())));
            }
        }
        7 => {
            if let Ok(again) = parsers::shell_frames(rest) {
                assert_eq!(parsers::shell_frames(&again), Ok(again.clone()));
            }
            if let Ok(again) = parsers::shell_control(rest) {
                assert_eq!(parsers::shell_control(&again), Ok(again.clone()));
            }
            if let Ok(Some(meta)) = parsers::shell_open(rest) {
                assert_eq!(parsers::shell_open(&meta), Ok(Some(meta.clone())));
            }
            if let Ok((read, again)) = parsers::migrate_frames(rest) {
                assert_eq!(read, again, "a migration frame re-encodes differently");
            }
            if let Ok(round_trips) = parsers::migrate_page_requests(rest) {
                assert!(
                    round_trips.iter().all(|&same| same),
                    "a page request re-encodes differently"
                );
            }
            // The remote store's frames (`roam store serve`): canonical.
            let (request, response) = parsers::store_frames(rest);
            if let Ok(again) = request {
                assert_eq!(again, rest, "a store request re-encodes differently");
            }
            if let Ok(again) = response {
                assert_eq!(again, rest, "a store response re-encodes differently");
            }
        }
        _ => {
            if let Ok(reply) = parsers::control_reply(rest) {
                assert_eq!(parsers::control_reply(&reply), Ok(reply.clone()));
            }
        }
    }
});
