//! The manifest (ISR's "keyring"): what one version of one environment is
//! made of, its wire format, and its sealing (docs/STORE.md, "Manifest").
//!
//! Two layers: [`Manifest::encode`]/[`Manifest::decode`] are the plaintext
//! body (canonical: whatever decodes re-encodes to the same bytes), and
//! [`seal_manifest`]/[`open_manifest`] wrap it in an authenticated,
//! encrypted envelope bound to the environment's name and version.

use std::collections::HashSet;
use std::fmt;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};

use crate::chunk::{ChunkRef, UserSecret, CHUNK_SIZE};

/// The plaintext body's magic ("roam-store keyring").
pub const BODY_MAGIC: [u8; 4] = *b"RSKR";
/// The plaintext body format this code reads and writes.
pub const BODY_FORMAT: u8 = 1;
/// The sealed envelope's magic ("roam-store manifest").
pub const SEALED_MAGIC: [u8; 4] = *b"RSMF";
/// The sealed envelope format this code reads and writes.
pub const SEALED_FORMAT: u8 = 1;

/// Most images in one manifest (a VM has a disk, a memory image and a few
/// more; 4,096 is far beyond any real use).
pub const MAX_IMAGES: u32 = 4096;
/// Longest image: 16 TiB (2^44 bytes), i.e. at most 2^27 chunks.
pub const MAX_IMAGE_LEN: u64 = 1 << 44;
/// Longest sealed manifest a reader accepts: 256 MiB, i.e. about 4 million
/// chunks (512 GiB of images).
pub const MAX_MANIFEST_LEN: u64 = 256 << 20;
/// Longest environment name, bytes.
pub const MAX_ENV_LEN: usize = 128;
/// Longest image name, bytes.
pub const MAX_IMAGE_NAME_LEN: usize = 255;

/// Bytes per chunk entry on the wire: hash then id.
const CHUNK_ENTRY_LEN: usize = 64;
/// Length of the key-check value in the sealed header.
pub(crate) const KEY_CHECK_LEN: usize = 16;
/// AES-GCM nonce length.
const NONCE_LEN: usize = 12;
/// AES-GCM tag length.
const TAG_LEN: usize = 16;

/// Label of the manifest key: HMAC-SHA256(secret, label).
const MANIFEST_KEY_LABEL: &[u8] = b"roam-store manifest key";
/// Label of the key-check value: HMAC-SHA256(secret, label), first 16 bytes.
const KEY_CHECK_LABEL: &[u8] = b"roam-store key check";

/// One image of an environment (a disk, a memory file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageEntry {
    /// Its name, unique in the manifest (UTF-8, 1-255 bytes, no NUL).
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// Its chunks in order: `ceil(len / CHUNK_SIZE)` of them.
    pub chunks: Vec<ChunkRef>,
}

impl ImageEntry {
    /// The plaintext length of chunk `index` (the last may be short), or
    /// `None` past the end.
    pub fn chunk_len(&self, index: u64) -> Option<usize> {
        let start = index.checked_mul(CHUNK_SIZE as u64)?;
        if start >= self.len {
            return None;
        }
        // At most CHUNK_SIZE, so the cast cannot truncate.
        Some((self.len - start).min(CHUNK_SIZE as u64) as usize)
    }
}

/// The chunk count of an image of `len` bytes.
pub fn chunk_count(len: u64) -> u64 {
    len.div_ceil(CHUNK_SIZE as u64)
}

/// One version of one named environment: its images and their chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// The environment's name ([`valid_env_name`]).
    pub env: String,
    /// The version number; each suspend writes a new one.
    pub version: u64,
    /// The images, in the order they were suspended.
    pub images: Vec<ImageEntry>,
}

impl Manifest {
    /// The image called `name`.
    pub fn image(&self, name: &str) -> Option<&ImageEntry> {
        self.images.iter().find(|i| i.name == name)
    }

    /// Every chunk the manifest references (with repeats).
    pub fn chunks(&self) -> impl Iterator<Item = &ChunkRef> {
        self.images.iter().flat_map(|i| i.chunks.iter())
    }

    /// The plaintext body (docs/STORE.md, "Manifest body"); refuses a
    /// manifest [`Manifest::decode`] would refuse.
    pub fn encode(&self) -> Result<Vec<u8>, ManifestError> {
        check_env_name(&self.env)?;
        let count = u32::try_from(self.images.len())
            .ok()
            .filter(|&c| c <= MAX_IMAGES)
            .ok_or(ManifestError::TooManyImages {
                count: self.images.len() as u64,
            })?;
        let mut out = Vec::new();
        out.extend_from_slice(&BODY_MAGIC);
        out.push(BODY_FORMAT);
        out.push(self.env.len() as u8);
        out.extend_from_slice(self.env.as_bytes());
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&count.to_be_bytes());
        let mut names = HashSet::new();
        for (index, image) in self.images.iter().enumerate() {
            check_image_name(index, &image.name)?;
            if !names.insert(image.name.as_str()) {
                return Err(ManifestError::DuplicateImage {
                    name: image.name.clone(),
                });
            }
            if image.len > MAX_IMAGE_LEN {
                return Err(ManifestError::ImageTooLong {
                    index,
                    len: image.len,
                });
            }
            if image.chunks.len() as u64 != chunk_count(image.len) {
                return Err(ManifestError::ChunkCountMismatch {
                    index,
                    expected: chunk_count(image.len),
                    actual: image.chunks.len() as u64,
                });
            }
            out.push(image.name.len() as u8);
            out.extend_from_slice(image.name.as_bytes());
            out.extend_from_slice(&image.len.to_be_bytes());
            for c in &image.chunks {
                out.extend_from_slice(&c.hash);
                out.extend_from_slice(&c.id);
            }
        }
        Ok(out)
    }

    /// Decodes a plaintext body. Every length and count is checked against
    /// its limit and against the bytes left before anything is allocated;
    /// trailing bytes are refused.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        let mut r = Reader { bytes, pos: 0 };
        if r.take(4, "magic")? != BODY_MAGIC {
            return Err(ManifestError::BadMagic);
        }
        let format = r.u8("format")?;
        if format != BODY_FORMAT {
            return Err(ManifestError::UnsupportedFormat(format));
        }
        let env_len = r.u8("environment name length")? as usize;
        let env = r.take(env_len, "environment name")?;
        let env = std::str::from_utf8(env)
            .map_err(|_| ManifestError::BadEnvName)?
            .to_owned();
        check_env_name(&env)?;
        let version = r.u64("version")?;
        let count = r.u32("image count")?;
        if count > MAX_IMAGES {
            return Err(ManifestError::TooManyImages {
                count: u64::from(count),
            });
        }
        // Each image takes at least 10 bytes (name length, one name byte,
        // length): a count the input cannot hold is refused before the Vec.
        if u64::from(count) * 10 > r.remaining() as u64 {
            return Err(ManifestError::Truncated {
                field: "images",
                offset: r.pos,
            });
        }
        let mut images = Vec::with_capacity(count as usize);
        let mut names = HashSet::new();
        for index in 0..count as usize {
            let name_len = r.u8("image name length")? as usize;
            let name = r.take(name_len, "image name")?;
            let name = std::str::from_utf8(name)
                .map_err(|_| ManifestError::BadImageName { index })?
                .to_owned();
            check_image_name(index, &name)?;
            let len = r.u64("image length")?;
            if len > MAX_IMAGE_LEN {
                return Err(ManifestError::ImageTooLong { index, len });
            }
            let n = chunk_count(len);
            if n.saturating_mul(CHUNK_ENTRY_LEN as u64) > r.remaining() as u64 {
                return Err(ManifestError::Truncated {
                    field: "chunks",
                    offset: r.pos,
                });
            }
            let mut chunks = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let hash = r.array32("chunk hash")?;
                let id = r.array32("chunk id")?;
                chunks.push(ChunkRef { hash, id });
            }
            if !names.insert(name.clone()) {
                return Err(ManifestError::DuplicateImage { name });
            }
            images.push(ImageEntry { name, len, chunks });
        }
        if r.remaining() != 0 {
            return Err(ManifestError::TrailingBytes {
                count: r.remaining(),
            });
        }
        Ok(Manifest {
            env,
            version,
            images,
        })
    }
}

/// Whether `name` may name an environment: 1-128 bytes of `A-Z a-z 0-9 . _ -`,
/// not `.` or `..` (it becomes part of object names).
pub fn valid_env_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ENV_LEN
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// [`valid_env_name`] as an error.
fn check_env_name(name: &str) -> Result<(), ManifestError> {
    if valid_env_name(name) {
        Ok(())
    } else {
        Err(ManifestError::BadEnvName)
    }
}

/// Whether `name` may name an image: 1-255 bytes of UTF-8, no NUL.
pub fn valid_image_name(name: &str) -> bool {
    check_image_name(0, name).is_ok()
}

/// Image names: 1-255 bytes, no NUL.
fn check_image_name(index: usize, name: &str) -> Result<(), ManifestError> {
    if name.is_empty() || name.len() > MAX_IMAGE_NAME_LEN || name.contains('\0') {
        Err(ManifestError::BadImageName { index })
    } else {
        Ok(())
    }
}

/// Why a manifest was refused. Decoding errors name the field and offset;
/// opening errors say whether the secret, the place or the bytes are wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ManifestError {
    /// The input ends inside `field`, which starts at `offset` (or a count
    /// promises more entries than the input holds).
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Its offset in the input.
        offset: usize,
    },
    /// Not a manifest: the magic is wrong.
    BadMagic,
    /// A format this code does not read (written by a newer roam).
    UnsupportedFormat(u8),
    /// The environment name is empty, too long, or has a character outside
    /// `A-Z a-z 0-9 . _ -`.
    BadEnvName,
    /// Image `index`'s name is empty, not UTF-8, or contains NUL.
    BadImageName {
        /// The image's position.
        index: usize,
    },
    /// Two images with one name.
    DuplicateImage {
        /// The repeated name.
        name: String,
    },
    /// More than [`MAX_IMAGES`] images.
    TooManyImages {
        /// The count given.
        count: u64,
    },
    /// An image longer than [`MAX_IMAGE_LEN`].
    ImageTooLong {
        /// The image's position.
        index: usize,
        /// The length given.
        len: u64,
    },
    /// (Encoding only) an image's chunk list does not match its length.
    ChunkCountMismatch {
        /// The image's position.
        index: usize,
        /// Chunks its length implies.
        expected: u64,
        /// Chunks it lists.
        actual: u64,
    },
    /// Bytes after the last image.
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// The sealed manifest was made with another user secret (its key
    /// check differs): use the secret this environment was suspended with.
    WrongSecret,
    /// The sealed manifest belongs to another environment or version than
    /// the one asked for (copied or replayed under this name).
    Misplaced {
        /// The environment it was sealed for.
        sealed_env: String,
        /// The version it was sealed for.
        sealed_version: u64,
    },
    /// The sealed manifest does not authenticate under this secret: its
    /// bytes were altered.
    Authentication,
    /// A random nonce could not be drawn from the operating system.
    Random,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestError::Truncated { field, offset } => {
                write!(f, "manifest truncated in {field} at byte {offset}")
            }
            ManifestError::BadMagic => f.write_str("not a roam-store manifest (bad magic)"),
            ManifestError::UnsupportedFormat(v) => {
                write!(f, "manifest format {v} is not supported by this roam")
            }
            ManifestError::BadEnvName => {
                f.write_str("bad environment name (1-128 bytes of A-Z a-z 0-9 . _ -, not . or ..)")
            }
            ManifestError::BadImageName { index } => {
                write!(f, "image {index}: bad name (1-255 bytes UTF-8, no NUL)")
            }
            ManifestError::DuplicateImage { name } => {
                write!(f, "image {name:?} appears twice")
            }
            ManifestError::TooManyImages { count } => {
                write!(f, "{count} images (at most {MAX_IMAGES})")
            }
            ManifestError::ImageTooLong { index, len } => {
                write!(f, "image {index} is {len} bytes (at most {MAX_IMAGE_LEN})")
            }
            ManifestError::ChunkCountMismatch {
                index,
                expected,
                actual,
            } => write!(
                f,
                "image {index} lists {actual} chunks, its length implies {expected}"
            ),
            ManifestError::TrailingBytes { count } => {
                write!(f, "{count} bytes after the manifest's end")
            }
            ManifestError::WrongSecret => {
                f.write_str("manifest was sealed with another user secret")
            }
            ManifestError::Misplaced {
                sealed_env,
                sealed_version,
            } => write!(
                f,
                "manifest was sealed for environment {sealed_env:?} version {sealed_version}, \
                 not the one asked for (copied or replayed)"
            ),
            ManifestError::Authentication => {
                f.write_str("manifest failed authentication (altered)")
            }
            ManifestError::Random => f.write_str("no randomness from the operating system"),
        }
    }
}

impl std::error::Error for ManifestError {}

/// A bounds-checked cursor; every read names its field.
struct Reader<'a> {
    /// The whole input.
    bytes: &'a [u8],
    /// Next byte to read.
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Bytes not read yet.
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes.
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ManifestError> {
        if n > self.remaining() {
            return Err(ManifestError::Truncated {
                field,
                offset: self.pos,
            });
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// One byte.
    fn u8(&mut self, field: &'static str) -> Result<u8, ManifestError> {
        Ok(self.take(1, field)?[0])
    }

    /// A big-endian u32.
    fn u32(&mut self, field: &'static str) -> Result<u32, ManifestError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4, field)?);
        Ok(u32::from_be_bytes(b))
    }

    /// A big-endian u64.
    fn u64(&mut self, field: &'static str) -> Result<u64, ManifestError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8, field)?);
        Ok(u64::from_be_bytes(b))
    }

    /// 32 bytes.
    fn array32(&mut self, field: &'static str) -> Result<[u8; 32], ManifestError> {
        let mut b = [0u8; 32];
        b.copy_from_slice(self.take(32, field)?);
        Ok(b)
    }
}

/// The key-check value of `secret` (sealed manifests and leases carry it,
/// so a wrong secret is told apart from altered bytes).
pub(crate) fn key_check(secret: &UserSecret) -> [u8; KEY_CHECK_LEN] {
    let mut c = [0u8; KEY_CHECK_LEN];
    c.copy_from_slice(&secret.derive(KEY_CHECK_LABEL, &[])[..KEY_CHECK_LEN]);
    c
}

/// The object name of a manifest: `manifests/<env>/<version>`.
pub fn manifest_object_name(env: &str, version: u64) -> String {
    format!("manifests/{env}/{version}")
}

/// The sealed header (also the AEAD's associated data): magic, format, key
/// check, environment name, version, nonce.
fn sealed_header(secret: &UserSecret, env: &str, version: u64, nonce: &[u8; 12]) -> Vec<u8> {
    let mut h = Vec::with_capacity(4 + 1 + KEY_CHECK_LEN + 1 + env.len() + 8 + NONCE_LEN);
    h.extend_from_slice(&SEALED_MAGIC);
    h.push(SEALED_FORMAT);
    h.extend_from_slice(&key_check(secret));
    h.push(env.len() as u8);
    h.extend_from_slice(env.as_bytes());
    h.extend_from_slice(&version.to_be_bytes());
    h.extend_from_slice(nonce);
    h
}

/// Seals a manifest for storage under `manifests/<env>/<version>`: the body
/// encrypted with AES-256-GCM under a key derived from the secret, a random
/// nonce (one key seals many manifests), and the header — which names the
/// environment and version — as associated data.
pub fn seal_manifest(secret: &UserSecret, manifest: &Manifest) -> Result<Vec<u8>, ManifestError> {
    use ring::rand::SecureRandom;
    let body = manifest.encode()?;
    let mut nonce = [0u8; NONCE_LEN];
    ring::rand::SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| ManifestError::Random)?;
    let mut out = sealed_header(secret, &manifest.env, manifest.version, &nonce);
    let key = secret.derive(MANIFEST_KEY_LABEL, &[]);
    let ct = Aes256Gcm::new(&key.into())
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: &body,
                aad: &out,
            },
        )
        .map_err(|_| ManifestError::Authentication)?;
    out.extend_from_slice(&ct);
    Ok(out)
}

/// Opens a sealed manifest read from `manifests/<env>/<version>`: checks the
/// key check (else [`ManifestError::WrongSecret`]), that it was sealed for
/// this `env` and `version` (else [`ManifestError::Misplaced`]), the AEAD tag
/// (else [`ManifestError::Authentication`]), then decodes the body, whose
/// own name and version must match too.
pub fn open_manifest(
    secret: &UserSecret,
    env: &str,
    version: u64,
    sealed: &[u8],
) -> Result<Manifest, ManifestError> {
    let mut r = Reader {
        bytes: sealed,
        pos: 0,
    };
    if r.take(4, "sealed magic")? != SEALED_MAGIC {
        return Err(ManifestError::BadMagic);
    }
    let format = r.u8("sealed format")?;
    if format != SEALED_FORMAT {
        return Err(ManifestError::UnsupportedFormat(format));
    }
    let check = r.take(KEY_CHECK_LEN, "key check")?;
    if check != key_check(secret) {
        return Err(ManifestError::WrongSecret);
    }
    let env_len = r.u8("sealed environment name length")? as usize;
    let sealed_env = r.take(env_len, "sealed environment name")?;
    let sealed_version = r.u64("sealed version")?;
    if sealed_env != env.as_bytes() || sealed_version != version {
        return Err(ManifestError::Misplaced {
            sealed_env: String::from_utf8_lossy(sealed_env).into_owned(),
            sealed_version,
        });
    }
    let nonce = r.take(NONCE_LEN, "nonce")?;
    if r.remaining() < TAG_LEN {
        return Err(ManifestError::Truncated {
            field: "sealed body",
            offset: r.pos,
        });
    }
    let (header, ct) = sealed.split_at(r.pos);
    let key = secret.derive(MANIFEST_KEY_LABEL, &[]);
    let body = Aes256Gcm::new(&key.into())
        .decrypt(
            Nonce::from_slice(nonce),
            Payload {
                msg: ct,
                aad: header,
            },
        )
        .map_err(|_| ManifestError::Authentication)?;
    let manifest = Manifest::decode(&body)?;
    if manifest.env != env || manifest.version != version {
        // Only a writer holding the secret could produce this.
        return Err(ManifestError::Misplaced {
            sealed_env: manifest.env,
            sealed_version: manifest.version,
        });
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::chunk_ref;

    fn sample() -> Manifest {
        let s = UserSecret::from_bytes([5; 32]);
        Manifest {
            env: "work-vm".into(),
            version: 7,
            images: vec![
                ImageEntry {
                    name: "disk".into(),
                    len: CHUNK_SIZE as u64 + 1,
                    chunks: vec![chunk_ref(&s, b"a"), chunk_ref(&s, b"b")],
                },
                ImageEntry {
                    name: "memory".into(),
                    len: 0,
                    chunks: vec![],
                },
            ],
        }
    }

    #[test]
    fn body_round_trip_and_every_truncation_refused() {
        let m = sample();
        let bytes = m.encode().unwrap();
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        for cut in 0..bytes.len() {
            assert!(
                matches!(
                    Manifest::decode(&bytes[..cut]),
                    Err(ManifestError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(
            Manifest::decode(&long),
            Err(ManifestError::TrailingBytes { count: 1 })
        );
    }

    #[test]
    fn absurd_counts_refused_before_allocating() {
        let mut b = BODY_MAGIC.to_vec();
        b.push(BODY_FORMAT);
        b.push(1);
        b.push(b'e');
        b.extend_from_slice(&1u64.to_be_bytes());
        let mut many = b.clone();
        many.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            Manifest::decode(&many),
            Err(ManifestError::TooManyImages {
                count: u64::from(u32::MAX)
            })
        );
        b.extend_from_slice(&1u32.to_be_bytes());
        b.push(1);
        b.push(b'd');
        b.extend_from_slice(&MAX_IMAGE_LEN.to_be_bytes());
        assert!(matches!(
            Manifest::decode(&b),
            Err(ManifestError::Truncated {
                field: "chunks",
                ..
            })
        ));
    }

    #[test]
    fn sealed_manifest_is_bound_to_secret_name_and_version() {
        let s = UserSecret::from_bytes([5; 32]);
        let m = sample();
        let sealed = seal_manifest(&s, &m).unwrap();
        assert_eq!(open_manifest(&s, "work-vm", 7, &sealed).unwrap(), m);
        assert_eq!(
            open_manifest(&UserSecret::from_bytes([6; 32]), "work-vm", 7, &sealed),
            Err(ManifestError::WrongSecret)
        );
        assert_eq!(
            open_manifest(&s, "work-vm", 8, &sealed),
            Err(ManifestError::Misplaced {
                sealed_env: "work-vm".into(),
                sealed_version: 7
            })
        );
        let mut bad = sealed.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x80;
        assert_eq!(
            open_manifest(&s, "work-vm", 7, &bad),
            Err(ManifestError::Authentication)
        );
        // The header rewritten to claim version 8: the tag catches it.
        let mut moved = sealed.clone();
        let at = 4 + 1 + KEY_CHECK_LEN + 1 + "work-vm".len() + 7;
        moved[at] = 8;
        assert_eq!(
            open_manifest(&s, "work-vm", 8, &moved),
            Err(ManifestError::Authentication)
        );
    }
}
