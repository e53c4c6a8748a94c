//! The etcd client's decoders of network input (`crates/roam-etcd`, reached
//! through its `cfg(fuzzing)` module `roam_etcd::fuzzing`).
//!
//! The first byte picks the decoder (its value modulo 3):
//!
//! - 0: the HTTP/1.1 response reader `post` uses. Next byte `n`, then `n % 8`
//!   piece sizes (each byte + 1), then the response's bytes, pushed in pieces
//!   of those sizes in turn, then the end of the connection. Properties: no
//!   panic; the answer is the one pushing everything at once gives; a read
//!   response, written again with a `Content-Length`, chunked (chunks of the
//!   piece sizes) and framed by the close, reads back the same (if within the
//!   size limit, which `cfg(fuzzing)` makes small: 3,000 bytes for a
//!   response, 1,000 for its headers, so inputs reach both).
//! - 1: base64. Properties: no panic; `decode(encode(x)) == x`, padded or
//!   not; whatever decodes re-encodes to text that decodes to the same bytes.
//! - 2: the JSON answer decoders. Next byte picks the HTTP status (mostly
//!   200), the rest is the gateway's body. Properties: no panic; an error is
//!   etcd's error or a decoding error, never anything else, and a non-200
//!   status is always etcd's error; each call's answer that decodes, written
//!   again as the gateway writes it, decodes to the same value.

#![no_main]

use libfuzzer_sys::fuzz_target;
use roam_etcd::fuzzing::{self, Answer, Answers, ResponseReader};
use roam_etcd::Error;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => http(rest),
        1 => base64(rest),
        _ => answers(rest),
    }
});

/// Pushes `bytes` in pieces of `sizes` (each + 1, in turn; all at once if
/// there are none), then ends the connection unless answered.
fn read(bytes: &[u8], sizes: &[u8]) -> Answer {
    let mut reader = ResponseReader::default();
    let mut pieces = sizes.iter().cycle().map(|&s| usize::from(s) + 1);
    let mut rest = bytes;
    while !rest.is_empty() {
        let n = pieces.next().unwrap_or(rest.len()).min(rest.len());
        let (piece, tail) = rest.split_at(n);
        rest = tail;
        match reader.push(piece) {
            Answer::NeedMore => {}
            done => return done,
        }
    }
    reader.finish()
}

fn http(data: &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 8).min(rest.len());
    let (sizes, bytes) = rest.split_at(n);
    let whole = read(bytes, &[]);
    assert_ne!(whole, Answer::NeedMore);
    assert_eq!(read(bytes, sizes), whole, "pieces of {sizes:?}");
    let Answer::Response { status, body } = &whole else {
        return;
    };
    let head = |framing: &str| format!("HTTP/1.1 {status} X\r\n{framing}\r\n").into_bytes();
    // A re-encoding larger than the limit is refused, rightly.
    let fits = |r: &[u8]| r.len() <= fuzzing::MAX_RESPONSE;

    let mut length = head(&format!("Content-Length: {}\r\n", body.len()));
    length.extend_from_slice(body);
    if fits(&length) {
        assert_eq!(read(&length, sizes), whole, "re-encoded with a length");
    }

    let mut chunked = head("Transfer-Encoding: chunked\r\n");
    let mut sizes_cycle = sizes.iter().cycle().map(|&s| usize::from(s) + 1);
    let mut rest = &body[..];
    while !rest.is_empty() {
        let n = sizes_cycle.next().unwrap_or(rest.len()).min(rest.len());
        let (chunk, tail) = rest.split_at(n);
        chunked.extend_from_slice(format!("{n:x}\r\n").as_bytes());
        chunked.extend_from_slice(chunk);
        chunked.extend_from_slice(b"\r\n");
        rest = tail;
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    if fits(&chunked) {
        assert_eq!(read(&chunked, sizes), whole, "re-encoded chunked");
    }

    let mut close = head("");
    close.extend_from_slice(body);
    if fits(&close) {
        assert_eq!(read(&close, sizes), whole, "re-encoded up to the close");
    }
}

fn base64(data: &[u8]) {
    let encoded = fuzzing::b64_encode(data);
    assert_eq!(encoded.len() % 4, 0);
    assert_eq!(fuzzing::b64_decode(&encoded).as_deref(), Ok(data));
    assert_eq!(
        fuzzing::b64_decode(encoded.trim_end_matches('=')).as_deref(),
        Ok(data)
    );
    let text = String::from_utf8_lossy(data);
    if let Ok(bytes) = fuzzing::b64_decode(&text) {
        let again = fuzzing::b64_encode(&bytes);
        assert_eq!(fuzzing::b64_decode(&again), Ok(bytes), "{text:?}");
    }
}

/// Every call's own decoder reports a bad answer as `Error::Decode`.
fn decode_error<T>(r: &Result<T, Error>) {
    if let Err(e) = r {
        assert!(matches!(e, Error::Decode(_)), "{e:?}");
        let _ = e.to_string();
    }
}

/// The answers `body` decodes to, which must not be an error.
fn again(body: &[u8]) -> Answers {
    match fuzzing::decode_answers(200, body) {
        Ok(a) => a,
        Err(e) => panic!(
            "a re-encoded answer does not decode: {e}: {:?}",
            String::from_utf8_lossy(body)
        ),
    }
}

fn answers(data: &[u8]) {
    let Some((&s, body)) = data.split_first() else {
        return;
    };
    let status = [200, 200, 200, 200, 400, 404, 500, 503][usize::from(s & 7)];
    let a = match fuzzing::decode_answers(status, body) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.to_string();
            if status == 200 {
                assert!(
                    matches!(e, Error::Decode(_) | Error::Server { .. }),
                    "{e:?}"
                );
            } else {
                assert!(matches!(e, Error::Server { .. }), "{e:?}");
            }
            return;
        }
    };
    assert_eq!(status, 200, "a non-200 answer decoded");
    decode_error(&a.range);
    decode_error(&a.put);
    decode_error(&a.delete);
    decode_error(&a.txn);
    decode_error(&a.grant);
    decode_error(&a.keep_alive);
    if let Ok(kvs) = &a.range {
        assert_eq!(
            again(&fuzzing::encode_range(kvs)).range.ok().as_ref(),
            Some(kvs)
        );
    }
    if let Ok(revision) = a.put {
        assert_eq!(
            again(&fuzzing::encode_put(revision)).put.ok(),
            Some(revision)
        );
    }
    if let Ok(deleted) = a.delete {
        assert_eq!(
            again(&fuzzing::encode_delete(deleted)).delete.ok(),
            Some(deleted)
        );
    }
    if let Ok(txn) = &a.txn {
        let decoded = again(&fuzzing::encode_txn(txn)).txn;
        assert_eq!(
            decoded.map(|t| format!("{t:?}")).ok(),
            Some(format!("{txn:?}"))
        );
    }
    if let Ok(lease) = &a.grant {
        let decoded = again(&fuzzing::encode_grant(lease)).grant;
        assert_eq!(
            decoded.map(|l| (l.id, l.ttl)).ok(),
            Some((lease.id, lease.ttl))
        );
    }
    if let Ok(ttl) = a.keep_alive {
        assert_eq!(
            again(&fuzzing::encode_keep_alive(ttl)).keep_alive.ok(),
            Some(ttl)
        );
    }
}
