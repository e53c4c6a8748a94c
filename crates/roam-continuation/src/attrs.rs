//! The per-session attribute/value store (the paper's `store`, `retrieve`,
//! `store_size`, `export`) and the `roam/attrs` stream that carries exported
//! attributes to the peer on a resume.
//!
//! ## `roam/attrs` wire format
//! After a resume of a session that has exported attributes, the server opens
//! one stream whose metadata is [`ATTRS_META`] (`roam/attrs`), writes one
//! message and finishes the stream:
//!
//! | Field | Type |
//! |---|---|
//! | magic | `52 4d 41 54` ("RMAT") |
//! | version | u8 = 1 |
//! | count | varint ≤ 1,024 |
//! | count × name | lp-bytes ≤ 255, UTF-8 |
//! | then its value | lp-bytes |
//!
//! Varints and lp-bytes are those of `docs/PROTOCOL.md` §2. Names are in
//! increasing order. The whole message is at most [`MAX_EXPORTED_BYTES`] plus
//! framing. A client reads it with [`read_attrs`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use roam_proto::codec::{put_lp_bytes, put_varint, Reader};
use tokio::io::AsyncReadExt;

/// Metadata of the stream that carries exported attributes.
pub const ATTRS_META: &[u8] = b"roam/attrs";
/// Longest attribute name, bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Most attributes in one session's store.
pub const MAX_ATTRS: usize = 1024;
/// Most bytes of exported values sent on one resume ("small amounts of
/// state", as the paper puts it): 64 KiB.
pub const MAX_EXPORTED_BYTES: usize = 64 * 1024;

const MAGIC: &[u8; 4] = b"RMAT";
const VERSION: u8 = 1;

/// Why an attribute operation was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttrError {
    /// The name is empty or longer than [`MAX_NAME_LEN`] bytes.
    BadName(String),
    /// The store already holds [`MAX_ATTRS`] attributes.
    TooMany,
    /// Exporting it would send more than [`MAX_EXPORTED_BYTES`] on a resume.
    ExportTooLarge {
        /// Bytes that would be exported.
        bytes: usize,
    },
    /// `export` named an attribute that is not stored.
    NotStored(String),
}

impl fmt::Display for AttrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadName(n) => write!(
                f,
                "attribute name {n:?} must be 1 to {MAX_NAME_LEN} bytes"
            ),
            Self::TooMany => write!(f, "a session holds at most {MAX_ATTRS} attributes"),
            Self::ExportTooLarge { bytes } => write!(
                f,
                "exported attributes would be {bytes} bytes; at most {MAX_EXPORTED_BYTES} go to the peer"
            ),
            Self::NotStored(n) => write!(f, "cannot export {n:?}: no such attribute"),
        }
    }
}

impl std::error::Error for AttrError {}

/// One session's attributes. Values are opaque bytes; names are UTF-8.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AttrStore {
    pub(crate) values: BTreeMap<String, Vec<u8>>,
    /// Names sent to the peer on every resume while they stay stored.
    pub(crate) exported: BTreeSet<String>,
}

fn check_name(name: &str) -> Result<(), AttrError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(AttrError::BadName(name.to_string()));
    }
    Ok(())
}

impl AttrStore {
    pub(crate) fn store(&mut self, name: &str, value: &[u8]) -> Result<(), AttrError> {
        check_name(name)?;
        if !self.values.contains_key(name) && self.values.len() >= MAX_ATTRS {
            return Err(AttrError::TooMany);
        }
        if self.exported.contains(name) {
            let bytes =
                self.exported_bytes() - self.values.get(name).map_or(0, Vec::len) + value.len();
            if bytes > MAX_EXPORTED_BYTES {
                return Err(AttrError::ExportTooLarge { bytes });
            }
        }
        self.values.insert(name.to_string(), value.to_vec());
        Ok(())
    }

    pub(crate) fn remove(&mut self, name: &str) -> Option<Vec<u8>> {
        self.exported.remove(name);
        self.values.remove(name)
    }

    pub(crate) fn export(&mut self, name: &str) -> Result<(), AttrError> {
        let Some(v) = self.values.get(name) else {
            return Err(AttrError::NotStored(name.to_string()));
        };
        if !self.exported.contains(name) {
            let bytes = self.exported_bytes() + v.len();
            if bytes > MAX_EXPORTED_BYTES {
                return Err(AttrError::ExportTooLarge { bytes });
            }
            self.exported.insert(name.to_string());
        }
        Ok(())
    }

    fn exported_bytes(&self) -> usize {
        self.exported
            .iter()
            .filter_map(|n| self.values.get(n))
            .map(Vec::len)
            .sum()
    }

    /// The `roam/attrs` message for the exported attributes, if any.
    pub(crate) fn exported_message(&self) -> Option<Vec<u8>> {
        let pairs: Vec<(&String, &Vec<u8>)> = self
            .exported
            .iter()
            .filter_map(|n| self.values.get(n).map(|v| (n, v)))
            .collect();
        if pairs.is_empty() {
            return None;
        }
        let mut out = Vec::with_capacity(16 + self.exported_bytes());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        put_varint(&mut out, pairs.len() as u64);
        for (n, v) in pairs {
            put_lp_bytes(&mut out, n.as_bytes());
            put_lp_bytes(&mut out, v);
        }
        Some(out)
    }
}

/// Why a `roam/attrs` message could not be read.
#[derive(Debug)]
#[non_exhaustive]
pub enum ReadAttrsError {
    /// The stream failed.
    Io(std::io::Error),
    /// The bytes are not a `roam/attrs` message of a known version.
    Malformed(&'static str),
}

impl fmt::Display for ReadAttrsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "reading exported attributes: {e}"),
            Self::Malformed(what) => write!(f, "malformed roam/attrs message: {what}"),
        }
    }
}

impl std::error::Error for ReadAttrsError {}

/// Parses a `roam/attrs` message (see the [module docs](self)).
pub fn decode_attrs(msg: &[u8]) -> Result<BTreeMap<String, Vec<u8>>, ReadAttrsError> {
    let bad = ReadAttrsError::Malformed;
    if msg.len() < 5 || &msg[..4] != MAGIC {
        return Err(bad("magic"));
    }
    if msg[4] != VERSION {
        return Err(bad("version"));
    }
    let mut r = Reader::new(&msg[5..]);
    let n = r
        .varint_usize(MAX_ATTRS, "count")
        .map_err(|_| bad("count"))?;
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let name = r.lp_bytes(MAX_NAME_LEN, "name").map_err(|_| bad("name"))?;
        let name = std::str::from_utf8(name).map_err(|_| bad("name is not UTF-8"))?;
        let value = r
            .lp_bytes(MAX_EXPORTED_BYTES, "value")
            .map_err(|_| bad("value"))?;
        out.insert(name.to_string(), value.to_vec());
    }
    r.finish().map_err(|_| bad("trailing bytes"))?;
    Ok(out)
}

/// Client side: reads the exported attributes from a stream whose metadata
/// was [`ATTRS_META`] (accept it with `SessionHandle::accept_stream`).
pub async fn read_attrs<R: tokio::io::AsyncRead + Unpin>(
    stream: &mut R,
) -> Result<BTreeMap<String, Vec<u8>>, ReadAttrsError> {
    let mut buf = Vec::new();
    let limit = (MAX_EXPORTED_BYTES + MAX_ATTRS * (MAX_NAME_LEN + 8) + 16) as u64;
    stream
        .take(limit + 1)
        .read_to_end(&mut buf)
        .await
        .map_err(ReadAttrsError::Io)?;
    if buf.len() as u64 > limit {
        return Err(ReadAttrsError::Malformed("too long"));
    }
    decode_attrs(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_export_round_trip_and_limits() {
        let mut s = AttrStore::default();
        s.store("pos", &7u64.to_le_bytes()).unwrap();
        s.store("mount", b"/radio").unwrap();
        assert_eq!(s.exported_message(), None);
        s.export("pos").unwrap();
        assert_eq!(s.export("nope"), Err(AttrError::NotStored("nope".into())));
        let m = decode_attrs(&s.exported_message().unwrap()).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m["pos"], 7u64.to_le_bytes());
        assert!(matches!(s.store("", b"x"), Err(AttrError::BadName(_))));
        assert!(matches!(
            s.store("pos", &vec![0; MAX_EXPORTED_BYTES + 1]),
            Err(AttrError::ExportTooLarge { .. })
        ));
        assert_eq!(s.remove("pos"), Some(7u64.to_le_bytes().to_vec()));
        assert!(s.exported.is_empty());
    }

    #[test]
    fn malformed_messages_are_refused() {
        let mut s = AttrStore::default();
        s.store("a", b"1").unwrap();
        s.export("a").unwrap();
        let m = s.exported_message().unwrap();
        for cut in 0..m.len() {
            assert!(decode_attrs(&m[..cut]).is_err(), "cut {cut}");
        }
        let mut long = m.clone();
        long.push(0);
        assert!(decode_attrs(&long).is_err());
    }
}
