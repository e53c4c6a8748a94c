//! The cluster layer's decoders (`crates/roam-continuation/src/cluster/`):
//! the host-to-host and operator messages (`wire::Msg`) and the cluster file
//! (`config::ClusterConfig`).
//!
//! The first byte picks the decoder (even: a message, odd: a cluster file);
//! the rest is its input. Properties: decoding never panics; a decoded
//! message re-encodes to bytes that decode to the same message and
//! re-encode identically; a parsed cluster file's text parses back to the
//! same configuration.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_continuation::cluster::{config, wire};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        wire::fuzz_round_trip(rest);
    } else {
        config::fuzz_round_trip(rest);
    }
});
