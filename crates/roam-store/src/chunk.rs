//! Chunking and convergent encryption (pure code, no IO).
//!
//! An image is cut into [`CHUNK_SIZE`] chunks. Each chunk's key and object
//! name are derived from the SHA-256 of its plaintext *and the user secret*
//! (docs/STORE.md, "Crypto"): one user's identical chunks share an object,
//! two users' never do, and the store learns nothing but sizes.

use std::fmt;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use ring::hmac;
use sha2::{Digest, Sha256};

/// Bytes per chunk (128 KiB, as ISR's); an image's last chunk may be shorter.
pub const CHUNK_SIZE: usize = 128 * 1024;

/// The chunk object format this code writes (the object's first byte).
pub const CHUNK_FORMAT: u8 = 1;

/// Chunk object header: format byte, then how the payload is compressed.
const HEADER_LEN: usize = 2;
/// Compression byte: the payload is the plaintext itself (it did not shrink).
const COMPRESSION_NONE: u8 = 0;
/// Compression byte: the payload is one zstd frame.
const COMPRESSION_ZSTD: u8 = 1;

/// AES-GCM tag length, bytes.
const TAG_LEN: usize = 16;

/// The longest chunk object this code writes: header, a whole chunk stored
/// uncompressed, tag. Readers refuse longer objects before reading them.
pub const MAX_CHUNK_OBJECT_LEN: u64 = (HEADER_LEN + CHUNK_SIZE + TAG_LEN) as u64;

/// zstd level for chunks: level 3 (zstd's default) is fast enough to keep up
/// with a disk, and is deterministic, so a chunk sealed twice gives the same
/// object bytes.
const ZSTD_LEVEL: i32 = 3;

/// Label for chunk keys: key = HMAC-SHA256(secret, label || h).
const CHUNK_KEY_LABEL: &[u8] = b"roam-store chunk key";
/// Label for chunk ids: id = HMAC-SHA256(secret, label || h).
const CHUNK_ID_LABEL: &[u8] = b"roam-store chunk id";
/// Associated data of every chunk AEAD (with the format byte after it).
const CHUNK_AAD_LABEL: &[u8] = b"roam-store chunk";

/// The user's 32-byte secret: every key and object name derives from it.
///
/// Whoever holds it can read every environment of this user; the store never
/// sees it.
#[derive(Clone)]
pub struct UserSecret {
    /// HMAC-SHA256 keyed with the secret; every derivation is one HMAC.
    key: hmac::Key,
}

impl UserSecret {
    /// The secret from its 32 bytes (e.g. read from the user's key file).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        UserSecret {
            key: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
        }
    }

    /// A fresh random secret, with its bytes (store them: they are the only
    /// way back to the data).
    pub fn generate() -> Result<(Self, [u8; 32]), ring::error::Unspecified> {
        use ring::rand::SecureRandom;
        let mut bytes = [0u8; 32];
        ring::rand::SystemRandom::new().fill(&mut bytes)?;
        Ok((Self::from_bytes(bytes), bytes))
    }

    /// HMAC-SHA256(secret, label || data).
    pub(crate) fn derive(&self, label: &[u8], data: &[u8]) -> [u8; 32] {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(label);
        ctx.update(data);
        let tag = ctx.sign();
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }
}

impl fmt::Debug for UserSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UserSecret(..)")
    }
}

/// A chunk as a manifest records it: its plaintext hash and its object id.
///
/// The chunk's key is not stored: it is re-derived from `hash` and the secret.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ChunkRef {
    /// SHA-256 of the chunk's plaintext; checked on every read.
    pub hash: [u8; 32],
    /// HMAC-SHA256(secret, "roam-store chunk id" || hash): the object name.
    pub id: [u8; 32],
}

impl ChunkRef {
    /// The backend object name of this chunk: `chunks/<64 hex digits>`.
    pub fn object_name(&self) -> String {
        object_name(&self.id)
    }

    /// The id as 64 lowercase hex digits.
    pub fn id_hex(&self) -> String {
        hex::encode(self.id)
    }
}

/// The object name of the chunk with id `id`.
pub(crate) fn object_name(id: &[u8; 32]) -> String {
    format!("chunks/{}", hex::encode(id))
}

/// A chunk sealed for storage.
#[derive(Debug)]
pub struct SealedChunk {
    /// What the manifest records.
    pub chunk: ChunkRef,
    /// The object's bytes: format byte, compression byte, then
    /// AES-256-GCM(zstd(plaintext) or plaintext).
    pub object: Vec<u8>,
}

/// Why a chunk object did not open. Each means the object is not the chunk
/// the manifest names (tampered, swapped, truncated, or written by a newer
/// roam); data is never returned in these cases.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChunkFault {
    /// Shorter than the header and a tag.
    TooShort {
        /// The object's length, bytes.
        len: usize,
    },
    /// Longer than any chunk object this code writes.
    TooLong {
        /// The object's length as far as read, bytes.
        len: u64,
    },
    /// The format byte is not one this code reads.
    UnknownFormat(u8),
    /// The compression byte is not one this code reads.
    UnknownCompression(u8),
    /// The AEAD tag does not verify under this chunk's key: altered bytes,
    /// or another chunk's object under this name.
    Authentication,
    /// The authenticated payload is not a zstd frame of at most
    /// [`CHUNK_SIZE`] bytes (only a bug in the writer could cause this).
    Decompression,
    /// The plaintext's length is not the one the manifest implies.
    Length {
        /// Bytes the manifest implies.
        expected: usize,
        /// Bytes the object held.
        actual: usize,
    },
    /// The plaintext's SHA-256 is not the manifest's.
    Hash,
}

impl fmt::Display for ChunkFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChunkFault::TooShort { len } => write!(f, "object is only {len} bytes"),
            ChunkFault::TooLong { len } => write!(
                f,
                "object is {len} bytes, at most {MAX_CHUNK_OBJECT_LEN} expected"
            ),
            ChunkFault::UnknownFormat(v) => write!(f, "unknown chunk format {v}"),
            ChunkFault::UnknownCompression(v) => write!(f, "unknown chunk compression {v}"),
            ChunkFault::Authentication => {
                f.write_str("authentication failed (object altered or not this chunk)")
            }
            ChunkFault::Decompression => f.write_str("payload does not decompress"),
            ChunkFault::Length { expected, actual } => {
                write!(f, "plaintext is {actual} bytes, manifest says {expected}")
            }
            ChunkFault::Hash => f.write_str("plaintext SHA-256 differs from the manifest's"),
        }
    }
}

/// The chunk's AEAD key.
fn chunk_key(secret: &UserSecret, hash: &[u8; 32]) -> [u8; 32] {
    secret.derive(CHUNK_KEY_LABEL, hash)
}

/// The AEAD's associated data for a chunk with this header.
fn chunk_aad(header: &[u8]) -> Vec<u8> {
    let mut aad = CHUNK_AAD_LABEL.to_vec();
    aad.extend_from_slice(header);
    aad
}

/// The [`ChunkRef`] of `plaintext` for this user (no sealing).
pub fn chunk_ref(secret: &UserSecret, plaintext: &[u8]) -> ChunkRef {
    let hash: [u8; 32] = Sha256::digest(plaintext).into();
    ChunkRef {
        hash,
        id: secret.derive(CHUNK_ID_LABEL, &hash),
    }
}

/// Compresses and seals one chunk (at most [`CHUNK_SIZE`] bytes; longer
/// input is sealed too, but [`open_chunk`] refuses it).
pub fn seal_chunk(secret: &UserSecret, plaintext: &[u8]) -> SealedChunk {
    let chunk = chunk_ref(secret, plaintext);
    let key = chunk_key(secret, &chunk.hash);
    // Stored as is when zstd does not shrink it (random or already
    // compressed data), which also saves the decompression on every read.
    let (compression, payload) = match zstd::bulk::compress(plaintext, ZSTD_LEVEL) {
        Ok(c) if c.len() < plaintext.len() => (COMPRESSION_ZSTD, c),
        _ => (COMPRESSION_NONE, plaintext.to_vec()),
    };
    let header = [CHUNK_FORMAT, compression];
    // A fixed zero nonce is safe here: the key is derived from the
    // plaintext's hash, so each key seals exactly one plaintext (convergent
    // encryption), and sealing it again gives the same bytes.
    let cipher = Aes256Gcm::new(&key.into());
    let mut object = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
    object.extend_from_slice(&header);
    // AES-GCM encryption fails only for inputs over 64 GiB; such an object
    // would be header-only and fail to open as too short.
    if let Ok(ct) = cipher.encrypt(
        Nonce::from_slice(&[0u8; 12]),
        Payload {
            msg: &payload,
            aad: &chunk_aad(&header),
        },
    ) {
        object.extend_from_slice(&ct);
    }
    SealedChunk { chunk, object }
}

/// Opens a chunk object: verifies the AEAD tag, decompresses, checks the
/// length (`expected_len`, from the manifest) and the plaintext's SHA-256.
pub fn open_chunk(
    secret: &UserSecret,
    chunk: &ChunkRef,
    expected_len: usize,
    object: &[u8],
) -> Result<Vec<u8>, ChunkFault> {
    if object.len() < HEADER_LEN + TAG_LEN {
        return Err(ChunkFault::TooShort { len: object.len() });
    }
    let (header, sealed) = object.split_at(HEADER_LEN);
    if header[0] != CHUNK_FORMAT {
        return Err(ChunkFault::UnknownFormat(header[0]));
    }
    if header[1] != COMPRESSION_NONE && header[1] != COMPRESSION_ZSTD {
        return Err(ChunkFault::UnknownCompression(header[1]));
    }
    let key = chunk_key(secret, &chunk.hash);
    let cipher = Aes256Gcm::new(&key.into());
    let payload = cipher
        .decrypt(
            Nonce::from_slice(&[0u8; 12]),
            Payload {
                msg: sealed,
                aad: &chunk_aad(header),
            },
        )
        .map_err(|_| ChunkFault::Authentication)?;
    let plaintext = if header[1] == COMPRESSION_ZSTD {
        // The capacity bounds what a hostile frame can make us allocate.
        zstd::bulk::decompress(&payload, CHUNK_SIZE.max(expected_len))
            .map_err(|_| ChunkFault::Decompression)?
    } else {
        payload
    };
    if plaintext.len() != expected_len {
        return Err(ChunkFault::Length {
            expected: expected_len,
            actual: plaintext.len(),
        });
    }
    let hash: [u8; 32] = Sha256::digest(&plaintext).into();
    if hash != chunk.hash {
        return Err(ChunkFault::Hash);
    }
    Ok(plaintext)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(b: u8) -> UserSecret {
        UserSecret::from_bytes([b; 32])
    }

    #[test]
    fn seal_open_round_trip_and_convergence() {
        let data: Vec<u8> = (0..CHUNK_SIZE).map(|i| (i * 7 % 251) as u8).collect();
        let a = seal_chunk(&secret(1), &data);
        let b = seal_chunk(&secret(1), &data);
        assert_eq!(a.chunk, b.chunk);
        assert_eq!(a.object, b.object, "convergent: same user, same bytes");
        let other = seal_chunk(&secret(2), &data);
        assert_eq!(a.chunk.hash, other.chunk.hash);
        assert_ne!(a.chunk.id, other.chunk.id, "users' ids are unlinkable");
        assert_ne!(a.object, other.object);
        let opened = open_chunk(&secret(1), &a.chunk, data.len(), &a.object).unwrap();
        assert_eq!(opened, data);
    }

    #[test]
    fn every_fault_is_named() {
        let s = secret(3);
        let a = seal_chunk(&s, b"hello chunk");
        let b = seal_chunk(&s, b"other chunk");
        assert_eq!(
            open_chunk(&s, &a.chunk, 11, &a.object[..5]),
            Err(ChunkFault::TooShort { len: 5 })
        );
        let mut bad = a.object.clone();
        bad[1] = 7;
        assert_eq!(
            open_chunk(&s, &a.chunk, 11, &bad),
            Err(ChunkFault::UnknownCompression(7))
        );
        let mut bad = a.object.clone();
        bad[1] ^= 1;
        assert_eq!(
            open_chunk(&s, &a.chunk, 11, &bad),
            Err(ChunkFault::Authentication),
            "the header is authenticated"
        );
        let mut bad = a.object.clone();
        bad[0] = 9;
        assert_eq!(
            open_chunk(&s, &a.chunk, 11, &bad),
            Err(ChunkFault::UnknownFormat(9))
        );
        let mut bad = a.object.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(
            open_chunk(&s, &a.chunk, 11, &bad),
            Err(ChunkFault::Authentication)
        );
        assert_eq!(
            open_chunk(&s, &a.chunk, 11, &b.object),
            Err(ChunkFault::Authentication),
            "a swapped object"
        );
        assert_eq!(
            open_chunk(&s, &a.chunk, 12, &a.object),
            Err(ChunkFault::Length {
                expected: 12,
                actual: 11
            })
        );
        assert_eq!(
            open_chunk(&secret(4), &a.chunk, 11, &a.object),
            Err(ChunkFault::Authentication)
        );
    }
}
