//! The relay-takeover stream (`roam serve --takeover`, `crates/roam-cli/src/
//! takeover.rs`): listener record, session headers with their raw blobs and
//! pending bytes, descriptor batches (one `F` byte each here, with stand-in
//! descriptors), and the tail. Properties: decoding never panics or
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
