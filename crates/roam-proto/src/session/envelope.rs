//! The sectioned envelope every stored roam state is written in: session
//! snapshots (continuations, `docs/PROTOCOL.md` §13) and
//! `roam-continuation`'s records alike.
//!
//! ```text
//! magic [4] | format u8 = 2 | section* | SHA-256 [32] of every byte before it
//! section  = id varint | version varint | length varint | body [length]
//! ```
//!
//! Each kind of blob declares its sections once, as [`SectionKind`]s; each
//! section's encoder and decoder live side by side in the code that owns that
//! part of the state. The envelope itself only frames, orders and checks:
//!
//! - Sections appear in increasing id order; only a kind declared
//!   `repeatable` may appear several times in a row (e.g. one per stream).
//!   With section bodies canonical, the whole blob is canonical.
//! - Bit 0 of the id says whether a reader may ignore the section: an
//!   *optional* section (odd id) that a reader does not know, or knows at
//!   another version, is skipped; a *required* one (even id) is refused with
//!   an error naming it. "Required" means "must be understood"; whether a
//!   section must be present is up to the blob's own rules.
//! - Format byte 1 is the layout before sections existed (one positional
//!   field list); it is recognised and refused as such ([`EnvelopeError::OldFormat`]).

use std::fmt;

use sha2::{Digest, Sha256};

use crate::codec::{put_varint, Reader};

/// The envelope's format byte (1 was the positional layout before it).
pub const FORMAT: u8 = 2;
/// The format byte of the layout this envelope replaced.
pub const OLD_FORMAT: u8 = 1;
/// Length of the trailing SHA-256 digest (bytes).
pub const DIGEST_LEN: usize = 32;
/// Magic and format byte before the first section (bytes).
const HEADER_LEN: usize = 5;

/// One declared section type of a blob kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionKind {
    /// Its id; bit 0 set means optional (a reader that does not know it skips it).
    pub id: u64,
    /// Its name, for errors and documentation.
    pub name: &'static str,
    /// The body layout version this code writes and reads.
    pub version: u64,
    /// Whether it may appear several times (consecutively).
    pub repeatable: bool,
}

impl SectionKind {
    /// Whether a reader that does not understand this section may skip it.
    pub const fn optional(&self) -> bool {
        self.id & 1 == 1
    }
}

/// Why an envelope could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The blob does not start with the expected magic: not this kind of blob.
    WrongMagic,
    /// Written in the positional format that preceded sections (format 1).
    OldFormat(u8),
    /// A format byte this version does not know (written by a newer roam?).
    UnsupportedFormat(u8),
    /// Too short to hold a digest, or the digest does not match: truncated or corrupted.
    Corrupted,
    /// The section framing is broken; the text says how.
    Malformed(&'static str),
    /// A required section this version does not know (by id).
    UnknownSection(u64),
    /// A required section at a layout version this version does not read.
    UnsupportedVersion {
        /// The section's name.
        section: &'static str,
        /// The version found.
        version: u64,
    },
    /// A section that must be present is not.
    MissingSection(&'static str),
}

impl fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WrongMagic => write!(f, "wrong magic"),
            Self::OldFormat(v) => write!(
                f,
                "written in format {v}, the positional layout of roam 0.1 before sectioned state (format {FORMAT}); this version no longer reads it"
            ),
            Self::UnsupportedFormat(v) => write!(
                f,
                "format {v} is not supported (this version reads format {FORMAT})"
            ),
            Self::Corrupted => write!(f, "truncated or corrupted (checksum mismatch)"),
            Self::Malformed(what) => write!(f, "malformed sections: {what}"),
            Self::UnknownSection(id) => write!(
                f,
                "unknown required section 0x{id:x} (written by a newer roam?)"
            ),
            Self::UnsupportedVersion { section, version } => write!(
                f,
                "section `{section}` is at version {version}, which this version does not read"
            ),
            Self::MissingSection(name) => write!(f, "required section `{name}` is missing"),
        }
    }
}

impl std::error::Error for EnvelopeError {}

/// Writes an envelope: the header, then sections in id order, then the digest.
#[derive(Debug)]
pub struct EnvelopeWriter {
    /// The blob so far.
    out: Vec<u8>,
    /// A section's body while it is encoded (its length comes first).
    scratch: Vec<u8>,
    /// Id of the last section written, to check the order in debug builds.
    last: Option<u64>,
}

impl EnvelopeWriter {
    /// Starts a blob of the kind `magic` names, with room for `capacity` bytes.
    pub fn new(magic: [u8; 4], capacity: usize) -> Self {
        let mut out = Vec::with_capacity(capacity + HEADER_LEN + DIGEST_LEN + 16);
        out.extend_from_slice(&magic);
        out.push(FORMAT);
        Self {
            out,
            scratch: Vec::new(),
            last: None,
        }
    }

    /// Appends one section whose body `encode` writes. Sections must come in
    /// increasing id order (a repeatable one may repeat).
    pub fn section(&mut self, kind: &SectionKind, encode: impl FnOnce(&mut Vec<u8>)) {
        debug_assert!(
            self.last
                .is_none_or(|l| l < kind.id || (l == kind.id && kind.repeatable)),
            "section {} out of order",
            kind.name
        );
        self.last = Some(kind.id);
        self.scratch.clear();
        encode(&mut self.scratch);
        put_varint(&mut self.out, kind.id);
        put_varint(&mut self.out, kind.version);
        put_varint(&mut self.out, self.scratch.len() as u64);
        self.out.extend_from_slice(&self.scratch);
    }

    /// Appends the digest and returns the blob.
    pub fn finish(mut self) -> Vec<u8> {
        let digest = Sha256::digest(&self.out);
        self.out.extend_from_slice(&digest);
        self.out
    }
}

/// A checked envelope: its sections, each known one at a supported version.
#[derive(Debug)]
pub struct Envelope<'a> {
    /// Known sections in blob order: (id, body). Skipped ones are not kept.
    sections: Vec<(u64, &'a [u8])>,
}

impl<'a> Envelope<'a> {
    /// Checks `blob`'s magic, format, digest and section framing against the
    /// kinds a reader knows, in that order, so the first problem is reported.
    /// Unknown optional sections (and optional ones at another version) are
    /// skipped; unknown required ones are refused.
    pub fn open(
        magic: [u8; 4],
        blob: &'a [u8],
        known: &[SectionKind],
    ) -> Result<Self, EnvelopeError> {
        if blob.len() < magic.len() || blob[..magic.len()] != magic {
            return Err(EnvelopeError::WrongMagic);
        }
        if blob.len() < HEADER_LEN {
            return Err(EnvelopeError::Corrupted);
        }
        match blob[4] {
            FORMAT => {}
            OLD_FORMAT => return Err(EnvelopeError::OldFormat(OLD_FORMAT)),
            v => return Err(EnvelopeError::UnsupportedFormat(v)),
        }
        if blob.len() < HEADER_LEN + DIGEST_LEN {
            return Err(EnvelopeError::Corrupted);
        }
        let (body, digest) = blob.split_at(blob.len() - DIGEST_LEN);
        if Sha256::digest(body).as_slice() != digest {
            return Err(EnvelopeError::Corrupted);
        }
        let mut r = Reader::new(&body[HEADER_LEN..]);
        let bad = |_| EnvelopeError::Malformed("section header");
        let mut sections = Vec::new();
        let mut last: Option<u64> = None;
        while r.remaining() > 0 {
            let id = r.varint().map_err(bad)?;
            let version = r.varint().map_err(bad)?;
            let len = r
                .varint_usize(r.remaining(), "section length")
                .map_err(bad)?;
            let data = r.bytes(len).map_err(bad)?;
            let kind = known.iter().find(|k| k.id == id);
            match last {
                Some(l) if l > id => return Err(EnvelopeError::Malformed("sections out of order")),
                Some(l) if l == id && kind.is_some_and(|k| !k.repeatable) => {
                    return Err(EnvelopeError::Malformed("section repeated"))
                }
                _ => {}
            }
            last = Some(id);
            match kind {
                Some(k) if k.version == version => sections.push((id, data)),
                Some(k) if !k.optional() => {
                    return Err(EnvelopeError::UnsupportedVersion {
                        section: k.name,
                        version,
                    })
                }
                None if id & 1 == 0 => return Err(EnvelopeError::UnknownSection(id)),
                _ => {} // optional and not understood: skipped
            }
        }
        Ok(Self { sections })
    }

    /// The body of the one section of `kind`, if present.
    pub fn get(&self, kind: &SectionKind) -> Option<&'a [u8]> {
        self.sections
            .iter()
            .find(|(id, _)| *id == kind.id)
            .map(|(_, b)| *b)
    }

    /// The body of the one section of `kind`, which must be present.
    pub fn require(&self, kind: &SectionKind) -> Result<&'a [u8], EnvelopeError> {
        self.get(kind)
            .ok_or(EnvelopeError::MissingSection(kind.name))
    }

    /// The bodies of every section of `kind`, in blob order.
    pub fn all<'s>(&'s self, kind: &'s SectionKind) -> impl Iterator<Item = &'a [u8]> + 's {
        self.sections
            .iter()
            .filter(move |(id, _)| *id == kind.id)
            .map(|(_, b)| *b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three kinds of section: required, required and repeatable, optional.
    const A: SectionKind = SectionKind {
        id: 2,
        name: "a",
        version: 1,
        repeatable: false,
    };
    const B: SectionKind = SectionKind {
        id: 4,
        name: "b",
        version: 1,
        repeatable: true,
    };
    const C: SectionKind = SectionKind {
        id: 5,
        name: "c",
        version: 1,
        repeatable: false,
    };
    /// The magic of the test blobs.
    const MAGIC: [u8; 4] = *b"TEST";

    /// A blob built by hand from (id, version, body) sections.
    fn blob(sections: &[(u64, u64, &[u8])]) -> Vec<u8> {
        let mut o = MAGIC.to_vec();
        o.push(FORMAT);
        for (id, v, body) in sections {
            put_varint(&mut o, *id);
            put_varint(&mut o, *v);
            crate::codec::put_lp_bytes(&mut o, body);
        }
        let d = Sha256::digest(&o);
        o.extend_from_slice(&d);
        o
    }

    #[test]
    fn writer_and_reader_agree() {
        let mut w = EnvelopeWriter::new(MAGIC, 0);
        w.section(&A, |o| o.push(1));
        w.section(&B, |o| o.push(2));
        w.section(&B, |o| o.push(3));
        w.section(&C, |o| o.push(4));
        let b = w.finish();
        assert_eq!(
            b,
            blob(&[(2, 1, &[1]), (4, 1, &[2]), (4, 1, &[3]), (5, 1, &[4])])
        );
        let e = Envelope::open(MAGIC, &b, &[A, B, C]).unwrap();
        assert_eq!(e.require(&A).unwrap(), &[1]);
        assert_eq!(e.all(&B).collect::<Vec<_>>(), vec![&[2u8][..], &[3u8][..]]);
        assert_eq!(e.get(&C), Some(&[4u8][..]));
    }

    #[test]
    fn unknown_optional_is_skipped_unknown_required_is_named() {
        let b = blob(&[(2, 1, b"x"), (7, 9, b"future"), (9, 1, b"")]);
        let e = Envelope::open(MAGIC, &b, &[A]).unwrap();
        assert_eq!(e.require(&A).unwrap(), b"x");
        assert_eq!(e.get(&C), None);
        let b = blob(&[(2, 1, b"x"), (8, 1, b"future")]);
        assert_eq!(
            Envelope::open(MAGIC, &b, &[A]).unwrap_err(),
            EnvelopeError::UnknownSection(8)
        );
        // A known optional section at another version is skipped too; a
        // required one is refused naming it.
        let b = blob(&[(5, 2, b"v2")]);
        assert_eq!(Envelope::open(MAGIC, &b, &[C]).unwrap().get(&C), None);
        let b = blob(&[(2, 2, b"v2")]);
        assert_eq!(
            Envelope::open(MAGIC, &b, &[A]).unwrap_err(),
            EnvelopeError::UnsupportedVersion {
                section: "a",
                version: 2
            }
        );
        assert_eq!(
            Envelope::open(MAGIC, &blob(&[]), &[A])
                .unwrap()
                .require(&A)
                .unwrap_err(),
            EnvelopeError::MissingSection("a")
        );
    }

    #[test]
    fn framing_errors_are_precise() {
        assert_eq!(
            Envelope::open(MAGIC, b"NOPE", &[]).unwrap_err(),
            EnvelopeError::WrongMagic
        );
        let mut old = blob(&[]);
        old[4] = OLD_FORMAT;
        assert_eq!(
            Envelope::open(MAGIC, &old, &[]).unwrap_err(),
            EnvelopeError::OldFormat(1)
        );
        old[4] = 9;
        assert_eq!(
            Envelope::open(MAGIC, &old, &[]).unwrap_err(),
            EnvelopeError::UnsupportedFormat(9)
        );
        let good = blob(&[(2, 1, b"x")]);
        for cut in 0..good.len() {
            assert!(Envelope::open(MAGIC, &good[..cut], &[A]).is_err());
        }
        let b = blob(&[(4, 1, b""), (2, 1, b"")]);
        assert_eq!(
            Envelope::open(MAGIC, &b, &[A, B]).unwrap_err(),
            EnvelopeError::Malformed("sections out of order")
        );
        let b = blob(&[(2, 1, b""), (2, 1, b"")]);
        assert_eq!(
            Envelope::open(MAGIC, &b, &[A]).unwrap_err(),
            EnvelopeError::Malformed("section repeated")
        );
        let b = blob(&[(2, 1, b"abc")]);
        let mut bad = b[..b.len() - DIGEST_LEN].to_vec();
        bad[7] = 9; // the length now runs past the end
        let d = Sha256::digest(&bad);
        bad.extend_from_slice(&d);
        assert_eq!(
            Envelope::open(MAGIC, &bad, &[A]).unwrap_err(),
            EnvelopeError::Malformed("section header")
        );
    }
}
