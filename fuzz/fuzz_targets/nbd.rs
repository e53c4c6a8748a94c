//! roam-nbd's server codec (`crates/roam-nbd`, docs/NBD.md).
//!
//! The first byte picks the phase. Even: the rest is the client's side of a
//! handshake, fed to `Handshake::handle` in pieces whose sizes come from
//! the input; it never panics, consumes no more than it was given, and
//! whatever it answers is a well-formed sequence of option replies. Odd:
//! the rest is transmission bytes decoded request by request against a
//! small export; every decoded request re-encodes to the bytes it was
//! read from, and a refusal's simple reply decodes back to its errno and
//! cookie.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_nbd::{
    decode_request, decode_simple_reply, encode_request, encode_simple_reply, Command, Export,
    Handshake, HandshakeEvent, REPLY_MAGIC,
};

fn exports() -> Vec<Export> {
    vec![
        Export {
            name: String::new(),
            size: 1 << 20,
            read_only: false,
        },
        Export {
            name: "disk.img".into(),
            size: 12345,
            read_only: true,
        },
    ]
}

fn handshake(data: &[u8]) {
    let mut greeting = Vec::new();
    let mut hs = Handshake::new(exports(), &mut greeting);
    let mut out = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut rest = data;
    while let Some((&step, tail)) = rest.split_first() {
        let take = usize::from(step).min(tail.len());
        pending.extend_from_slice(&tail[..take]);
        rest = &tail[take..];
        let before = out.len();
        match hs.handle(&pending, &mut out) {
            Ok((n, ev)) => {
                assert!(n <= pending.len());
                pending.drain(..n);
                check_replies(&out[before..]);
                if ev != HandshakeEvent::NeedMore {
                    return;
                }
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        }
    }
}

/// Option replies are magic, option, type, length, data; an
/// EXPORT_NAME answer (size, flags, maybe zeroes) ends the handshake and
/// is not checked here.
fn check_replies(mut out: &[u8]) {
    while out.len() >= 20 && out[..8] == REPLY_MAGIC.to_be_bytes() {
        let len = u32::from_be_bytes(out[16..20].try_into().unwrap()) as usize;
        assert!(
            out.len() >= 20 + len,
            "option reply shorter than its length"
        );
        out = &out[20 + len..];
    }
    // What remains is an EXPORT_NAME answer (10 or 134 bytes) or nothing.
    assert!(out.is_empty() || out.len() == 10 || out.len() == 134);
}

fn transmission(data: &[u8]) {
    let mut buf = data;
    while !buf.is_empty() {
        let d = match decode_request(buf, 1 << 20, buf.len() % 2 == 0) {
            Ok(Some(d)) => d,
            Ok(None) => return,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                return;
            }
        };
        assert!(d.consumed <= buf.len());
        let mut again = Vec::new();
        encode_request(&d.header, d.payload, &mut again);
        assert_eq!(again, buf[..d.consumed], "request does not round trip");
        let (cookie, errno) = match &d.request {
            Ok(r) => {
                if !matches!(r.command, Command::Flush | Command::Disc) {
                    let end = r.offset.checked_add(u64::from(r.len));
                    assert!(end.is_some_and(|e| e <= 1 << 20), "accepted past the end");
                }
                (r.cookie, 0)
            }
            Err(refusal) => {
                assert_ne!(refusal.errno, 0);
                assert!(!refusal.reason.is_empty());
                (refusal.cookie, refusal.errno)
            }
        };
        let mut reply = Vec::new();
        encode_simple_reply(cookie, errno, &[], &mut reply);
        assert_eq!(decode_simple_reply(&reply), Some((errno, cookie)));
        buf = &buf[d.consumed..];
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        handshake(rest);
    } else {
        transmission(rest);
    }
});
