//! Requests to the control socket (`roam_cli::parsers::control_request`):
//! arbitrary bytes as one request.
//!
//! Properties: decoding never panics, and an accepted request's canonical
//! encoding decodes to the same canonical encoding (a round trip).

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_cli::parsers;

fuzz_target!(|data: &[u8]| {
    if let Ok(encoded) = parsers::control_request(data) {
        assert_eq!(
            parsers::control_request(&encoded),
            Ok(encoded.clone()),
            "canonical request does not round-trip"
        );
    }
});
