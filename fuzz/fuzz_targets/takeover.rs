//! The relay-takeover stream (`roam serve --takeover`, `crates/roam-cli/src/
//! takeover.rs`): listener record, waves of session headers with their raw
//! blobs, pending bytes and client connection states, each wave closed by
//! its record, descriptor batches (one `F` byte each here, with stand-in
//! descriptors), the shells and the end. Properties: decoding never panics or
//! allocates beyond the checked limits, and whatever decodes re-encodes to a
//! stream that decodes to the same handover.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_cli::parsers;

fuzz_target!(|data: &[u8]| {
    // Malformed input is an error value; only a broken round trip fails.
    if let Err(e) = parsers::takeover(data) {
        panic!("{e}");
    }
});
