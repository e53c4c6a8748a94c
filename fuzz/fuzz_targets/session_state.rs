//! The session state machine from an established pair (`docs/PROTOCOL.md` §5-§10).
//!
//! The first input byte picks the limits ([`Preset`]: deployed defaults, small
//! or tiny windows, buffers and stream limits, so flow control and stream
//! credit bind at once); the rest is decoded with `arbitrary` into at most
//! `MAX_STEPS` steps ([`roam_fuzz::Op`]): application calls on either side,
//! link faults (partial delivery, corruption, loss, injection, resets),
//! transport kills, resumes, time jumps, and frames the fuzzer builds, sealed
//! with the sending session's real transport keys so the receiver takes them
//! through its real record path (a hostile peer that holds the keys). Every
//! input starts from a copy of an established pair; the invariants checked
//! after each step are listed in `fuzz/src/lib.rs`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_fuzz::{run_script, Preset, World};

/// Script steps per input. Long enough for several resumes with traffic in
/// flight; short enough that libFuzzer's per-input cost stays small.
const MAX_STEPS: usize = 128;

fuzz_target!(|data: &[u8]| {
    let Some((&preset, rest)) = data.split_first() else {
        return;
    };
    run_script(
        World::established(Preset::from_byte(preset)),
        rest,
        MAX_STEPS,
    );
});
