//! roam-continuation's stored records (`crates/roam-continuation/src/record.rs`):
//! a continuation's meta record and its body record, both
//! `roam_proto::envelope` blobs, and the `roam/attrs` message.
//!
//! The input is a record's *sections*; `record::fuzz_round_trip` adds the
//! magic, format byte and a valid SHA-256 (so the fuzzer explores the parts
//! behind the checksum) and also tries the raw bytes. Properties: decoding
//! never panics; a decoded meta or body re-encodes to bytes that decode to the
//! same value and re-encode identically (canonical); `decode_attrs` never
//! panics.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_continuation::{attrs, record};

fuzz_target!(|data: &[u8]| {
    record::fuzz_round_trip(data);
    let _ = attrs::decode_attrs(data);
});
