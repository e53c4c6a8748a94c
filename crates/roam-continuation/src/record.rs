//! The stored form of a continuation: a small uncompressed *meta* entry (what
//! garbage collection, dependency cascades and start-up need) and a
//! zstd-compressed *body* (attributes, routine, streams and the protocol
//! blob). Both are written in one redb transaction ([`crate::store`]).
//!
//! ## Meta (format 1)
//! | Field | Type |
//! |---|---|
//! | magic | `52 4d 43 4d` ("RMCM") |
//! | format | u8 = 1 |
//! | service | lp-bytes ≤ 255, UTF-8 |
//! | parent | u8 (0 none, 1 then `[16]` session id) |
//! | suspended at, frozen at, deadline | 3 × varint, Unix milliseconds |
//! | body length | varint, bytes once decompressed |
//! | body digest | `[32]`, SHA-256 of the stored (compressed) body |
//! | digest | `[32]`, SHA-256 of every byte before it |
//!
//! ## Body (format 1, before compression)
//! | Field | Type |
//! |---|---|
//! | magic | `52 4d 43 42` ("RMCB") |
//! | format | u8 = 1 |
//! | routine | lp-bytes ≤ 255 |
//! | attributes | varint count ≤ 1,024, then (name lp-bytes, value lp-bytes, exported u8) |
//! | requirements | varint count ≤ 256, then (name, value) lp-bytes ≤ 1,024 |
//! | streams | varint count ≤ 256, then (name lp-bytes ≤ 255, id varint) |
//! | unaccepted, orphans | 2 × (varint count, then ids as varints) |
//! | expiry | varint milliseconds + 1, or 0 for the service default |
//! | protocol blob | lp-bytes (`docs/PROTOCOL.md` §13, self-checking) |
//!
//! The zstd frame carries its own content checksum. A record that fails any
//! check is reported as corrupt and never restored.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use roam_proto::codec::{put_lp_bytes, put_varint, DecodeError, Reader};
use roam_proto::{SessionId, StreamId};
use sha2::{Digest, Sha256};

use crate::attrs::{AttrStore, MAX_ATTRS, MAX_NAME_LEN};

const META_MAGIC: &[u8; 4] = b"RMCM";
const BODY_MAGIC: &[u8; 4] = b"RMCB";
const FORMAT: u8 = 1;
const DIGEST_LEN: usize = 32;
/// Largest body accepted when decompressing (bytes): bounds what a corrupted
/// length field can make us allocate.
const MAX_BODY: u64 = 1 << 30;
/// zstd level: fast, and continuations are mostly small.
const ZSTD_LEVEL: i32 = 3;
const MAX_REQUIREMENTS: usize = 256;
const MAX_STREAMS: usize = 256;
const MAX_VALUE_TEXT: usize = 1024;

/// What garbage collection and start-up need, without the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Meta {
    pub(crate) service: String,
    pub(crate) parent: Option<SessionId>,
    pub(crate) suspended_at: SystemTime,
    pub(crate) frozen_at: SystemTime,
    pub(crate) deadline: SystemTime,
    pub(crate) body_len: u64,
    pub(crate) body_digest: [u8; DIGEST_LEN],
}

/// The application's continuation plus the session's protocol state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Body {
    pub(crate) routine: String,
    pub(crate) attrs: AttrStore,
    pub(crate) requires: BTreeMap<String, String>,
    pub(crate) streams: BTreeMap<String, StreamId>,
    pub(crate) unaccepted: Vec<StreamId>,
    pub(crate) orphans: Vec<StreamId>,
    pub(crate) expiry: Option<Duration>,
    pub(crate) blob: Vec<u8>,
}

/// Why a stored entry was refused; the text names the check that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Corrupt(pub(crate) &'static str);

impl From<DecodeError> for Corrupt {
    fn from(_: DecodeError) -> Self {
        Corrupt("field encoding")
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) fn from_unix_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

impl Meta {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut o = Vec::with_capacity(128);
        o.extend_from_slice(META_MAGIC);
        o.push(FORMAT);
        put_lp_bytes(&mut o, self.service.as_bytes());
        match self.parent {
            Some(p) => {
                o.push(1);
                o.extend_from_slice(&p.0);
            }
            None => o.push(0),
        }
        for t in [self.suspended_at, self.frozen_at, self.deadline] {
            put_varint(&mut o, unix_ms(t));
        }
        put_varint(&mut o, self.body_len);
        o.extend_from_slice(&self.body_digest);
        let d = Sha256::digest(&o);
        o.extend_from_slice(&d);
        o
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, Corrupt> {
        if b.len() < 5 + DIGEST_LEN {
            return Err(Corrupt("meta truncated"));
        }
        if &b[..4] != META_MAGIC {
            return Err(Corrupt("meta magic"));
        }
        if b[4] != FORMAT {
            return Err(Corrupt("meta format version"));
        }
        let (body, digest) = b.split_at(b.len() - DIGEST_LEN);
        if Sha256::digest(body).as_slice() != digest {
            return Err(Corrupt("meta checksum"));
        }
        let mut r = Reader::new(&body[5..]);
        let service = text(r.lp_bytes(MAX_NAME_LEN, "service")?)?;
        let parent = match r.u8()? {
            0 => None,
            1 => Some(SessionId(r.array()?)),
            _ => return Err(Corrupt("meta parent flag")),
        };
        let suspended_at = from_unix_ms(r.varint()?);
        let frozen_at = from_unix_ms(r.varint()?);
        let deadline = from_unix_ms(r.varint()?);
        let body_len = r.varint()?;
        let body_digest = r.array()?;
        r.finish()?;
        Ok(Self {
            service,
            parent,
            suspended_at,
            frozen_at,
            deadline,
            body_len,
            body_digest,
        })
    }
}

fn text(b: &[u8]) -> Result<String, Corrupt> {
    std::str::from_utf8(b)
        .map(str::to_string)
        .map_err(|_| Corrupt("text is not UTF-8"))
}

fn put_ids(o: &mut Vec<u8>, ids: &[StreamId]) {
    put_varint(o, ids.len() as u64);
    for id in ids {
        put_varint(o, id.0);
    }
}

fn ids(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<StreamId>, Corrupt> {
    let n = r.varint_usize(1 << 20, field)?;
    (0..n).map(|_| Ok(StreamId(r.varint()?))).collect()
}

impl Body {
    /// The uncompressed encoding.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let attr_bytes: usize = self.attrs.values.values().map(Vec::len).sum();
        let mut o = Vec::with_capacity(64 + attr_bytes + self.blob.len());
        o.extend_from_slice(BODY_MAGIC);
        o.push(FORMAT);
        put_lp_bytes(&mut o, self.routine.as_bytes());
        put_varint(&mut o, self.attrs.values.len() as u64);
        for (n, v) in &self.attrs.values {
            put_lp_bytes(&mut o, n.as_bytes());
            put_lp_bytes(&mut o, v);
            o.push(u8::from(self.attrs.exported.contains(n)));
        }
        put_varint(&mut o, self.requires.len() as u64);
        for (n, v) in &self.requires {
            put_lp_bytes(&mut o, n.as_bytes());
            put_lp_bytes(&mut o, v.as_bytes());
        }
        put_varint(&mut o, self.streams.len() as u64);
        for (n, id) in &self.streams {
            put_lp_bytes(&mut o, n.as_bytes());
            put_varint(&mut o, id.0);
        }
        put_ids(&mut o, &self.unaccepted);
        put_ids(&mut o, &self.orphans);
        put_varint(
            &mut o,
            self.expiry.map_or(0, |d| {
                u64::try_from(d.as_millis())
                    .unwrap_or(u64::MAX - 1)
                    .saturating_add(1)
            }),
        );
        put_lp_bytes(&mut o, &self.blob);
        o
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, Corrupt> {
        if b.len() < 5 || &b[..4] != BODY_MAGIC {
            return Err(Corrupt("body magic"));
        }
        if b[4] != FORMAT {
            return Err(Corrupt("body format version"));
        }
        let mut r = Reader::new(&b[5..]);
        let routine = text(r.lp_bytes(MAX_NAME_LEN, "routine")?)?;
        let mut attrs = AttrStore::default();
        for _ in 0..r.varint_usize(MAX_ATTRS, "attributes")? {
            let n = text(r.lp_bytes(MAX_NAME_LEN, "attribute name")?)?;
            let v = r.lp_bytes(usize::MAX, "attribute value")?.to_vec();
            match r.u8()? {
                0 => {}
                1 => {
                    attrs.exported.insert(n.clone());
                }
                _ => return Err(Corrupt("attribute export flag")),
            }
            attrs.values.insert(n, v);
        }
        let mut requires = BTreeMap::new();
        for _ in 0..r.varint_usize(MAX_REQUIREMENTS, "requirements")? {
            let n = text(r.lp_bytes(MAX_VALUE_TEXT, "requirement")?)?;
            let v = text(r.lp_bytes(MAX_VALUE_TEXT, "requirement value")?)?;
            requires.insert(n, v);
        }
        let mut streams = BTreeMap::new();
        for _ in 0..r.varint_usize(MAX_STREAMS, "streams")? {
            let n = text(r.lp_bytes(MAX_NAME_LEN, "stream name")?)?;
            streams.insert(n, StreamId(r.varint()?));
        }
        let unaccepted = ids(&mut r, "unaccepted streams")?;
        let orphans = ids(&mut r, "orphan streams")?;
        let expiry = match r.varint()? {
            0 => None,
            ms => Some(Duration::from_millis(ms - 1)),
        };
        let blob = r.lp_bytes(usize::MAX, "protocol blob")?.to_vec();
        r.finish()?;
        Ok(Self {
            routine,
            attrs,
            requires,
            streams,
            unaccepted,
            orphans,
            expiry,
            blob,
        })
    }
}

/// Compresses an encoded body; returns the stored bytes and their digest.
pub(crate) fn seal_body(raw: &[u8]) -> (Vec<u8>, [u8; DIGEST_LEN]) {
    let mut enc = zstd::bulk::Compressor::new(ZSTD_LEVEL).expect("zstd level is valid");
    // Content checksums catch corruption inside the frame; the digest in
    // the meta entry catches everything else, including a swapped body.
    let _ = enc.include_checksum(true);
    let stored = enc
        .compress(raw)
        .expect("compressing into a growable buffer cannot fail");
    let digest = Sha256::digest(&stored).into();
    (stored, digest)
}

/// Checks a stored body against its meta entry, decompresses and decodes it.
pub(crate) fn open_body(meta: &Meta, stored: &[u8]) -> Result<Body, Corrupt> {
    if Sha256::digest(stored).as_slice() != meta.body_digest {
        return Err(Corrupt("body checksum (truncated or corrupted)"));
    }
    if meta.body_len > MAX_BODY {
        return Err(Corrupt("body length"));
    }
    let raw = zstd::bulk::decompress(stored, meta.body_len as usize)
        .map_err(|_| Corrupt("zstd frame"))?;
    if raw.len() as u64 != meta.body_len {
        return Err(Corrupt("body length"));
    }
    Body::decode(&raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Meta, Body) {
        let mut attrs = AttrStore::default();
        attrs.store("next", &42u64.to_le_bytes()).unwrap();
        attrs.store("name", b"radio").unwrap();
        attrs.export("next").unwrap();
        let body = Body {
            routine: "updates".into(),
            attrs,
            requires: [("version".to_string(), "1".to_string())].into(),
            streams: [("updates".to_string(), StreamId(1))].into(),
            unaccepted: vec![StreamId(4)],
            orphans: vec![StreamId(2), StreamId(6)],
            expiry: Some(Duration::from_secs(30)),
            blob: b"RMSC pretend protocol blob".repeat(20),
        };
        let raw = body.encode();
        let (_, digest) = seal_body(&raw);
        let now = from_unix_ms(unix_ms(SystemTime::now()));
        let meta = Meta {
            service: "bench".into(),
            parent: Some(SessionId([7; 16])),
            suspended_at: now,
            frozen_at: now,
            deadline: now + Duration::from_secs(30),
            body_len: raw.len() as u64,
            body_digest: digest,
        };
        (meta, body)
    }

    #[test]
    fn round_trip() {
        let (meta, body) = sample();
        let (stored, _) = seal_body(&body.encode());
        let m = Meta::decode(&meta.encode()).unwrap();
        assert_eq!(m, meta);
        assert_eq!(open_body(&m, &stored).unwrap(), body);
        assert!(stored.len() < body.encode().len(), "compression helps");
    }

    #[test]
    fn every_truncation_and_flip_is_caught() {
        let (meta, body) = sample();
        let (stored, _) = seal_body(&body.encode());
        let m = meta.encode();
        for cut in 0..m.len() {
            assert!(Meta::decode(&m[..cut]).is_err());
        }
        for i in 0..m.len() {
            let mut b = m.clone();
            b[i] ^= 0x01;
            assert!(Meta::decode(&b).is_err(), "meta flip at {i}");
        }
        for cut in 0..stored.len() {
            assert!(open_body(&meta, &stored[..cut]).is_err());
        }
        for i in 0..stored.len() {
            let mut b = stored.clone();
            b[i] ^= 0x20;
            assert!(open_body(&meta, &b).is_err(), "body flip at {i}");
        }
    }
}
