//! The session state machine under hostile input (`docs/PROTOCOL.md` §3-§10).
//!
//! Two real sessions, a client and a server, talk through an in-memory link
//! (the harness in `fuzz/src/lib.rs`). The first input byte picks a mode:
//!
//! - bit 7 clear, *raw*: an established pair (deployed limits), then the rest
//!   of the input is fed as raw bytes to the client's transport and (the low
//!   seven bits say where the input splits) to the server's, followed by
//!   `poll_transmit`, `poll_event` and `handle_timeout` at a few instants.
//! - bit 7 set, *script*: the rest is decoded with `arbitrary` into a script
//!   ([`roam_fuzz::Op`]) of application calls, timer jumps, reconnects/resumes,
//!   link faults (partial delivery, corruption, loss, injection, resets) and
//!   hostile frames, starting *mid-handshake* (the client's hello sent, no
//!   server yet), under the limits the low bits pick. The invariants of
//!   `session_state` are checked after every step.
//!
//! Nothing may loop forever: every drive loop is bounded, and a session that
//! keeps producing output without new input fails the run.

#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use roam_fuzz::{run_script, Preset, Side, World};

/// Script steps per input.
const MAX_STEPS: usize = 128;

/// Raw mode: an established pair, then hostile bytes on its transports.
fn raw(split: u8, data: &[u8]) {
    let mut w = World::established(Preset::Default);
    let at = data.len() * usize::from(split) / 0x7f;
    let (to_server, to_client) = data.split_at(at);
    w.input(Side::Client, to_client);
    w.settle();
    if !to_server.is_empty() {
        w.input(Side::Server, to_server);
        w.settle();
    }
    for ms in [0, 3, 1_500, 6_000, 10_000] {
        w.advance(Duration::from_millis(ms));
    }
    w.advance(Duration::from_secs(3 * 86_400));
    w.check(true);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode & 0x80 == 0 {
        raw(mode & 0x7f, rest);
    } else {
        run_script(
            World::handshaking(Preset::from_byte(mode & 0x7f)),
            rest,
            MAX_STEPS,
        );
    }
});
