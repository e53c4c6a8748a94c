//! The stored form of a continuation: a small uncompressed *meta* entry (what
//! garbage collection, dependency cascades and start-up need) and a
//! zstd-compressed *body* (attributes, routine, streams and the protocol
//! snapshot). Both are written in one redb transaction ([`crate::store`]).
//!
//! Both are [`roam_proto::envelope`]s — the same sectioned, versioned,
//! SHA-256-checked envelope as the protocol snapshot inside (`docs/PROTOCOL.md`
//! §13): magic, format byte 2, sections (`id`, `version`, `length`, body; odd
//! ids optional), digest. Every section below is at version 1 and required
//! (even id); each one's encoder and decoder sit side by side in this file.
//!
//! ## Meta (magic `52 4d 43 4d`, "RMCM")
//! | Id | Section | Body |
//! |---|---|---|
//! | 0x02 | service | UTF-8, ≤ 255 bytes |
//! | 0x04 | parent | `[16]` session id; absent when there is none |
//! | 0x06 | times | suspended at, frozen at, deadline: 3 × varint, Unix milliseconds |
//! | 0x08 | body | length once decompressed (varint), then `[32]` SHA-256 of the stored (compressed) body |
//! | 0x0b | revision | varint: the session's ownership revision in its cluster (`docs/PROTOCOL.md` §14.4); absent (optional, odd id) for 0 |
//!
//! ## Body (magic `52 4d 43 42`, "RMCB", before compression)
//! | Id | Section | Body |
//! |---|---|---|
//! | 0x02 | routine | UTF-8, ≤ 255 bytes |
//! | 0x04 | attributes | varint count ≤ 1,024, then (name lp-bytes, value lp-bytes, exported u8) |
//! | 0x06 | requirements | varint count ≤ 256, then (name, value) lp-bytes ≤ 1,024 |
//! | 0x08 | streams | varint count ≤ 256, then (name lp-bytes ≤ 255, id varint) |
//! | 0x0a | pending streams | unaccepted, orphans: 2 × (varint count, then ids as varints) |
//! | 0x0c | expiry | varint milliseconds; absent for the service default |
//! | 0x0e | protocol | the session snapshot (`docs/PROTOCOL.md` §13, self-checking) |
//!
//! The zstd frame carries its own content checksum. A record that fails any
//! check is reported as corrupt (the reason names the check, or says it was
//! written by an older roam in format 1) and never restored.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use roam_proto::codec::{put_lp_bytes, put_varint, DecodeError, Reader};
use roam_proto::envelope::{Envelope, EnvelopeError, EnvelopeWriter, SectionKind};
use roam_proto::{SessionId, StreamId};
use sha2::{Digest, Sha256};

use crate::attrs::{AttrStore, MAX_ATTRS, MAX_NAME_LEN};

const META_MAGIC: [u8; 4] = *b"RMCM";
const BODY_MAGIC: [u8; 4] = *b"RMCB";
const DIGEST_LEN: usize = 32;
/// Largest body accepted when decompressing (bytes): bounds what a corrupted
/// length field can make us allocate.
const MAX_BODY: u64 = 1 << 30;
/// zstd level: fast, and continuations are mostly small.
const ZSTD_LEVEL: i32 = 3;
const MAX_REQUIREMENTS: usize = 256;
const MAX_STREAMS: usize = 256;
const MAX_VALUE_TEXT: usize = 1024;

/// A required, non-repeatable section at version 1.
const fn kind(id: u64, name: &'static str) -> SectionKind {
    SectionKind {
        id,
        name,
        version: 1,
        repeatable: false,
    }
}

/// Meta: the service's name.
const SERVICE: SectionKind = kind(0x02, "service");
/// Meta: the parent session, if any.
const PARENT: SectionKind = kind(0x04, "parent");
/// Meta: when suspended and frozen, and when it expires.
const TIMES: SectionKind = kind(0x06, "times");
/// Meta: the stored body's length and digest.
const BODY: SectionKind = kind(0x08, "body");
/// Meta: the ownership revision (odd id: readers that predate it skip it).
const REVISION: SectionKind = kind(0x0b, "revision");
/// Every meta section, in id order.
const META_SECTIONS: &[SectionKind] = &[SERVICE, PARENT, TIMES, BODY, REVISION];

/// Body: the routine to resume with.
const ROUTINE: SectionKind = kind(0x02, "routine");
/// Body: the application's attributes.
const ATTRIBUTES: SectionKind = kind(0x04, "attributes");
/// Body: the compatibility requirements.
const REQUIREMENTS: SectionKind = kind(0x06, "requirements");
/// Body: the streams carried over, by name.
const STREAMS: SectionKind = kind(0x08, "streams");
/// Body: streams not yet accepted by the application, and orphans.
const PENDING: SectionKind = kind(0x0a, "pending streams");
/// Body: a per-session expiry.
const EXPIRY: SectionKind = kind(0x0c, "expiry");
/// Body: the protocol snapshot.
const PROTOCOL: SectionKind = kind(0x0e, "protocol");
/// Every body section, in id order.
const BODY_SECTIONS: &[SectionKind] = &[
    ROUTINE,
    ATTRIBUTES,
    REQUIREMENTS,
    STREAMS,
    PENDING,
    EXPIRY,
    PROTOCOL,
];

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
    /// Ownership revision: 0 until the session first moves between hosts,
    /// then one more per move (§14.4).
    pub(crate) revision: u64,
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
pub(crate) struct Corrupt(pub(crate) Cow<'static, str>);

impl From<DecodeError> for Corrupt {
    fn from(_: DecodeError) -> Self {
        Corrupt("field encoding".into())
    }
}

impl Corrupt {
    /// A refusal naming the check that failed.
    pub(crate) fn new(what: &'static str) -> Self {
        Corrupt(Cow::Borrowed(what))
    }

    /// An envelope refusal, naming which entry (`meta` or `body`) it was.
    fn envelope(entry: &'static str, e: EnvelopeError) -> Self {
        match e {
            EnvelopeError::WrongMagic => Corrupt(format!("{entry} magic").into()),
            EnvelopeError::Corrupted => Corrupt(format!("{entry} checksum").into()),
            e => Corrupt(format!("{entry} {e}").into()),
        }
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) fn from_unix_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// Decodes a section body with `f`, which must consume it whole.
fn section<T>(
    b: &[u8],
    f: impl FnOnce(&mut Reader<'_>) -> Result<T, Corrupt>,
) -> Result<T, Corrupt> {
    let mut r = Reader::new(b);
    let v = f(&mut r)?;
    r.finish()?;
    Ok(v)
}

/// A required section's body, or a refusal naming it.
fn required<'a>(env: &Envelope<'a>, kind: &SectionKind) -> Result<&'a [u8], Corrupt> {
    env.require(kind)
        .map_err(|e| Corrupt(format!("{e}").into()))
}

impl Meta {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = EnvelopeWriter::new(META_MAGIC, 128);
        w.section(&SERVICE, |o| o.extend_from_slice(self.service.as_bytes()));
        if let Some(p) = self.parent {
            w.section(&PARENT, |o| o.extend_from_slice(&p.0));
        }
        w.section(&TIMES, |o| {
            for t in [self.suspended_at, self.frozen_at, self.deadline] {
                put_varint(o, unix_ms(t));
            }
        });
        w.section(&BODY, |o| {
            put_varint(o, self.body_len);
            o.extend_from_slice(&self.body_digest);
        });
        if self.revision != 0 {
            w.section(&REVISION, |o| put_varint(o, self.revision));
        }
        w.finish()
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, Corrupt> {
        let env = Envelope::open(META_MAGIC, b, META_SECTIONS)
            .map_err(|e| Corrupt::envelope("meta", e))?;
        let service = text(required(&env, &SERVICE)?, MAX_NAME_LEN, "service")?;
        let parent = match env.get(&PARENT) {
            Some(b) => Some(section(b, |r| Ok(SessionId(r.array()?)))?),
            None => None,
        };
        let (suspended_at, frozen_at, deadline) = section(required(&env, &TIMES)?, |r| {
            Ok((
                from_unix_ms(r.varint()?),
                from_unix_ms(r.varint()?),
                from_unix_ms(r.varint()?),
            ))
        })?;
        let (body_len, body_digest) =
            section(required(&env, &BODY)?, |r| Ok((r.varint()?, r.array()?)))?;
        let revision = match env.get(&REVISION) {
            Some(b) => section(b, |r| Ok(r.varint()?))?,
            None => 0,
        };
        if revision == 0 && env.get(&REVISION).is_some() {
            // Canonical: revision 0 is written as an absent section.
            return Err(Corrupt("revision section holding 0".into()));
        }
        Ok(Self {
            revision,
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

/// A whole section body as UTF-8 text of at most `max` bytes.
fn text(b: &[u8], max: usize, what: &'static str) -> Result<String, Corrupt> {
    if b.len() > max {
        return Err(Corrupt::new(what));
    }
    utf8(b)
}

/// Bytes as UTF-8 text.
fn utf8(b: &[u8]) -> Result<String, Corrupt> {
    std::str::from_utf8(b)
        .map(str::to_string)
        .map_err(|_| Corrupt::new("text is not UTF-8"))
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
        let mut w = EnvelopeWriter::new(BODY_MAGIC, 64 + attr_bytes + self.blob.len());
        w.section(&ROUTINE, |o| o.extend_from_slice(self.routine.as_bytes()));
        w.section(&ATTRIBUTES, |o| {
            put_varint(o, self.attrs.values.len() as u64);
            for (n, v) in &self.attrs.values {
                put_lp_bytes(o, n.as_bytes());
                put_lp_bytes(o, v);
                o.push(u8::from(self.attrs.exported.contains(n)));
            }
        });
        w.section(&REQUIREMENTS, |o| {
            put_varint(o, self.requires.len() as u64);
            for (n, v) in &self.requires {
                put_lp_bytes(o, n.as_bytes());
                put_lp_bytes(o, v.as_bytes());
            }
        });
        w.section(&STREAMS, |o| {
            put_varint(o, self.streams.len() as u64);
            for (n, id) in &self.streams {
                put_lp_bytes(o, n.as_bytes());
                put_varint(o, id.0);
            }
        });
        w.section(&PENDING, |o| {
            put_ids(o, &self.unaccepted);
            put_ids(o, &self.orphans);
        });
        if let Some(d) = self.expiry {
            w.section(&EXPIRY, |o| {
                put_varint(
                    o,
                    u64::try_from(d.as_millis()).unwrap_or(roam_proto::codec::VARINT_MAX),
                );
            });
        }
        w.section(&PROTOCOL, |o| o.extend_from_slice(&self.blob));
        w.finish()
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, Corrupt> {
        let env = Envelope::open(BODY_MAGIC, b, BODY_SECTIONS)
            .map_err(|e| Corrupt::envelope("body", e))?;
        let routine = text(required(&env, &ROUTINE)?, MAX_NAME_LEN, "routine")?;
        let attrs = section(required(&env, &ATTRIBUTES)?, |r| {
            let mut attrs = AttrStore::default();
            for _ in 0..r.varint_usize(MAX_ATTRS, "attributes")? {
                let n = utf8(r.lp_bytes(MAX_NAME_LEN, "attribute name")?)?;
                let v = r.lp_bytes(usize::MAX, "attribute value")?.to_vec();
                match r.u8()? {
                    0 => {}
                    1 => {
                        attrs.exported.insert(n.clone());
                    }
                    _ => return Err(Corrupt::new("attribute export flag")),
                }
                attrs.values.insert(n, v);
            }
            Ok(attrs)
        })?;
        let requires = section(required(&env, &REQUIREMENTS)?, |r| {
            let mut requires = BTreeMap::new();
            for _ in 0..r.varint_usize(MAX_REQUIREMENTS, "requirements")? {
                let n = utf8(r.lp_bytes(MAX_VALUE_TEXT, "requirement")?)?;
                let v = utf8(r.lp_bytes(MAX_VALUE_TEXT, "requirement value")?)?;
                requires.insert(n, v);
            }
            Ok(requires)
        })?;
        let streams = section(required(&env, &STREAMS)?, |r| {
            let mut streams = BTreeMap::new();
            for _ in 0..r.varint_usize(MAX_STREAMS, "streams")? {
                let n = utf8(r.lp_bytes(MAX_NAME_LEN, "stream name")?)?;
                streams.insert(n, StreamId(r.varint()?));
            }
            Ok(streams)
        })?;
        let (unaccepted, orphans) = section(required(&env, &PENDING)?, |r| {
            Ok((ids(r, "unaccepted streams")?, ids(r, "orphan streams")?))
        })?;
        let expiry = match env.get(&EXPIRY) {
            Some(b) => Some(section(b, |r| Ok(Duration::from_millis(r.varint()?)))?),
            None => None,
        };
        let blob = required(&env, &PROTOCOL)?.to_vec();
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
        return Err(Corrupt::new("body checksum (truncated or corrupted)"));
    }
    if meta.body_len > MAX_BODY {
        return Err(Corrupt::new("body length"));
    }
    let raw = zstd::bulk::decompress(stored, meta.body_len as usize)
        .map_err(|_| Corrupt::new("zstd frame"))?;
    if raw.len() as u64 != meta.body_len {
        return Err(Corrupt::new("body length"));
    }
    Body::decode(&raw)
}

/// Fuzzing only (`cfg(fuzzing)`, the `record` fuzz target): `sections`
/// wrapped as a meta record and as a body record (magic, format byte and a
/// valid SHA-256 added, so the fuzzer explores the parts behind the checksum)
/// and, raw, as both. Whatever decodes must be canonical: re-encoded, it
/// decodes to the same value and encodes to the same bytes. Panics otherwise.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn fuzz_round_trip(sections: &[u8]) {
    let wrap = |magic: [u8; 4]| {
        let mut blob = magic.to_vec();
        blob.push(roam_proto::envelope::FORMAT);
        blob.extend_from_slice(sections);
        let digest = Sha256::digest(&blob);
        blob.extend_from_slice(&digest);
        blob
    };
    for blob in [wrap(META_MAGIC), sections.to_vec()] {
        if let Ok(meta) = Meta::decode(&blob) {
            let encoded = meta.encode();
            let again = Meta::decode(&encoded).expect("an encoded meta decodes");
            assert_eq!(again, meta, "meta changed in a round trip");
            assert!(again.encode() == encoded, "meta encoding is not canonical");
        }
    }
    for blob in [wrap(BODY_MAGIC), sections.to_vec()] {
        if let Ok(body) = Body::decode(&blob) {
            let encoded = body.encode();
            let again = Body::decode(&encoded).expect("an encoded body decodes");
            assert_eq!(again, body, "body changed in a round trip");
            assert!(again.encode() == encoded, "body encoding is not canonical");
        }
    }
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
            revision: 3,
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
    fn format_1_records_are_refused_as_such() {
        // A meta entry as roam 0.1 wrote it (magic, format 1, fields, digest).
        let mut old = b"RMCM\x01".to_vec();
        put_lp_bytes(&mut old, b"bench");
        old.extend_from_slice(&[0, 1, 2, 3, 4]);
        old.extend_from_slice(&[9; 32]);
        let d = Sha256::digest(&old);
        old.extend_from_slice(&d);
        let e = Meta::decode(&old).unwrap_err();
        assert!(
            e.0.starts_with("meta written in format 1") && e.0.contains("no longer reads it"),
            "{}",
            e.0
        );
        let mut old_body = b"RMCB\x01".to_vec();
        old_body.extend_from_slice(&[0; 40]);
        let e = Body::decode(&old_body).unwrap_err();
        assert!(e.0.starts_with("body written in format 1"), "{}", e.0);
    }

    #[test]
    fn sections_are_checked_by_name() {
        let (meta, body) = sample();
        // A body without its protocol section names the missing section.
        let mut w = EnvelopeWriter::new(BODY_MAGIC, 0);
        w.section(&ROUTINE, |o| o.extend_from_slice(body.routine.as_bytes()));
        // Empty lists: one zero count each, two for the pending streams.
        for k in [ATTRIBUTES, REQUIREMENTS, STREAMS] {
            w.section(&k, |o| o.push(0));
        }
        w.section(&PENDING, |o| o.extend_from_slice(&[0, 0]));
        let e = Body::decode(&w.finish()).unwrap_err();
        assert_eq!(e.0, "required section `protocol` is missing");
        // Without a parent or an expiry, those sections are simply absent.
        let plain = Meta {
            parent: None,
            ..meta
        };
        assert_eq!(Meta::decode(&plain.encode()).unwrap(), plain);
        let no_expiry = Body {
            expiry: None,
            ..body
        };
        assert_eq!(Body::decode(&no_expiry.encode()).unwrap(), no_expiry);
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
