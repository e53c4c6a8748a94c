//! roam-service's cut (`crates/roam-service/src/codec.rs`, docs/SERVICE.md)
//! and the check that turns a cut into restarted processes.
//!
//! The first byte picks the mode. Even: the rest is decoded as an encoded
//! cut; decoding never panics, an accepted cut is canonical (it re-encodes
//! to the same bytes), and resuming it either fails with a precise error or
//! gives processes whose readers re-read exactly `[lsr, max(lsr, lsw))` of
//! each channel. Odd: the rest builds a cut (`arbitrary`: up to 4 parts,
//! channels drawn from a small set so ends pair up, duplicate and miss,
//! positions near each other) and checks the same, plus that it encodes and
//! decodes to itself.

#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use roam_service::{ChannelId, Cut, Interval, Limits, Part, ReaderState, WriterState};

/// Small caps, so the log cap is reached too.
const LIMITS: Limits = Limits {
    log_bytes: 64,
    hold_bytes: 64,
    send_bytes: 64,
};

fn bytes(u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
    let n = u.int_in_range(0..=80)?;
    Ok(u.bytes(n)?.to_vec())
}

fn cut(u: &mut Unstructured<'_>) -> Result<Cut> {
    let mut parts = Vec::new();
    for _ in 0..u.int_in_range(0..=4)? {
        let snapshot = if u.arbitrary()? { Some(bytes(u)?) } else { None };
        let interval = if u.arbitrary()? {
            Interval::Nondeterministic
        } else {
            Interval::Deterministic
        };
        let mut writers = Vec::new();
        for _ in 0..u.int_in_range(0..=3)? {
            let id = ChannelId(u.int_in_range(0..=3)?);
            let sent: u64 = u.int_in_range(0..=200)?;
            let unsent = if u.ratio(1, 3)? { bytes(u)? } else { Vec::new() };
            let lsw = if unsent.is_empty() {
                u.int_in_range(0..=200)?
            } else {
                sent + unsent.len() as u64
            };
            writers.push((id, WriterState { lsw, sent, unsent }));
        }
        let mut readers = Vec::new();
        for _ in 0..u.int_in_range(0..=3)? {
            let id = ChannelId(u.int_in_range(0..=3)?);
            let lsr = u.int_in_range(0..=200)?;
            readers.push((id, ReaderState { lsr, log: bytes(u)? }));
        }
        parts.push(Part {
            snapshot,
            interval,
            writers,
            readers,
        });
    }
    Ok(Cut { parts })
}

/// Resuming never panics; when it works, every reader re-reads exactly up
/// to where its writer restarts, and the snapshots come back.
fn check_resume(cut: &Cut) {
    let Ok(procs) = cut.resume(LIMITS) else {
        return;
    };
    assert_eq!(procs.len(), cut.parts.len());
    for (mut p, part) in procs.into_iter().zip(&cut.parts) {
        assert_eq!(p.snapshot(), part.snapshot.as_deref());
        for (id, r) in &part.readers {
            let lsw = cut
                .parts
                .iter()
                .flat_map(|q| &q.writers)
                .find(|(w, _)| w == id)
                .map(|(_, w)| w.lsw)
                .expect("a resumed cut has every writer");
            let end = p.reader(*id).expect("its reader");
            assert_eq!(end.position(), r.lsr);
            assert_eq!(end.unread().len() as u64, r.lsr.max(lsw) - r.lsr);
        }
        for (id, w) in &part.writers {
            assert_eq!(p.writer(*id).expect("its writer").position(), w.lsw);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        if let Ok(cut) = Cut::decode(rest) {
            assert_eq!(cut.encode(), rest, "an accepted cut is canonical");
            check_resume(&cut);
        }
    } else if let Ok(cut) = cut(&mut Unstructured::new(rest)) {
        assert_eq!(Cut::decode(&cut.encode()).as_ref(), Ok(&cut));
        check_resume(&cut);
    }
});
