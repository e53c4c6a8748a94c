//! Trickle leases: what a running environment has written back to the store
//! ahead of its next suspend (docs/STORE.md, "Trickle leases").
//!
//! A resumed VM's dirty disk chunks are uploaded while it runs (ISR's
//! trickle write-back) as ordinary chunk objects, sealed exactly as a
//! suspend seals them, but no manifest references them until the next
//! suspend writes its version. A [`Lease`] names them, so that a
//! [`crate::Store::gc`] running meanwhile keeps them: it lists the chunk
//! ids a run has written back (or is about to: an id is leased before its
//! upload starts) and the time until which the run vouches for them. The
//! run writes a new lease (the next `seq`) when it adds ids and at least
//! every few minutes, then deletes the one before; a lease whose time has
//! passed (its run crashed) protects nothing and gc deletes it.
//!
//! Sealed like a manifest (AES-256-GCM under a key derived from the
//! user's secret, random nonce, the object's name in the associated data):
//! the store sees that a lease exists and its size, not which chunks it
//! names.

use std::fmt;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};

use crate::chunk::UserSecret;
use crate::manifest::{key_check, valid_env_name, KEY_CHECK_LEN};

/// The sealed lease's magic ("roam-store lease").
pub const LEASE_MAGIC: [u8; 4] = *b"RSLS";
/// The sealed lease format this code reads and writes.
pub const LEASE_FORMAT: u8 = 1;
/// Most chunk ids one lease may name (2^22: 512 GiB of 128 KiB chunks).
pub const MAX_LEASE_CHUNKS: u32 = 1 << 22;
/// Longest sealed lease a reader accepts (the ids and a small header).
pub const MAX_LEASE_LEN: u64 = 32 * MAX_LEASE_CHUNKS as u64 + 1024;
/// Length of a run id (hex digits).
pub const RUN_ID_LEN: usize = 32;

/// Label of the lease key: HMAC-SHA256(secret, label).
const LEASE_KEY_LABEL: &[u8] = b"roam-store lease key";
/// AES-GCM nonce length.
const NONCE_LEN: usize = 12;
/// AES-GCM tag length.
const TAG_LEN: usize = 16;

/// One run's claim on the chunks it wrote back (module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The environment the run resumed.
    pub env: String,
    /// The run: [`RUN_ID_LEN`] lowercase hex digits, random per run.
    pub run: String,
    /// The lease's number in its run; each new lease of the run has the
    /// next one.
    pub seq: u64,
    /// Until when (milliseconds since the Unix epoch) the run vouches for
    /// these chunks; after that the lease is stale.
    pub expires_unix_ms: u64,
    /// The chunk ids (object names `chunks/<hex>`) written back.
    pub chunks: Vec<[u8; 32]>,
}

impl Lease {
    /// This lease's object name: `leases/<env>/<run>.<seq>`.
    pub fn object_name(&self) -> String {
        lease_object_name(&self.env, &self.run, self.seq)
    }

    /// Whether the lease still protects its chunks at `now_unix_ms`.
    pub fn is_live(&self, now_unix_ms: u64) -> bool {
        now_unix_ms < self.expires_unix_ms
    }
}

/// The object name of lease `seq` of `run` of `env`.
pub fn lease_object_name(env: &str, run: &str, seq: u64) -> String {
    format!("leases/{env}/{run}.{seq}")
}

/// A fresh random run id ([`RUN_ID_LEN`] hex digits).
pub fn new_run_id() -> Result<String, LeaseError> {
    use ring::rand::SecureRandom;
    let mut b = [0u8; RUN_ID_LEN / 2];
    ring::rand::SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| LeaseError::Random)?;
    Ok(hex::encode(b))
}

/// Why a lease could not be sealed or opened.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseError {
    /// The object is not a sealed lease (magic) or of a format this code
    /// does not read.
    NotALease,
    /// Sealed with another secret (the key check differs).
    WrongSecret,
    /// The tag does not verify: altered, truncated, or stored under
    /// another name than it was sealed for.
    Authentication,
    /// The opened body is malformed (only a writer with the secret could
    /// produce it): what is wrong.
    Malformed(&'static str),
    /// The lease's fields cannot be written (bad environment name or run
    /// id, too many chunks): API misuse.
    Invalid(&'static str),
    /// A random nonce could not be drawn from the operating system.
    Random,
}

impl fmt::Display for LeaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseError::NotALease => f.write_str("not a roam trickle lease (magic or format)"),
            LeaseError::WrongSecret => f.write_str("sealed with another store secret"),
            LeaseError::Authentication => {
                f.write_str("authentication failed (altered, truncated or renamed)")
            }
            LeaseError::Malformed(what) => write!(f, "malformed lease body: {what}"),
            LeaseError::Invalid(what) => write!(f, "cannot write this lease: {what}"),
            LeaseError::Random => f.write_str("the operating system gave no random nonce"),
        }
    }
}

impl std::error::Error for LeaseError {}

/// Whether `run` is a run id ([`RUN_ID_LEN`] lowercase hex digits).
fn valid_run(run: &str) -> bool {
    run.len() == RUN_ID_LEN && run.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Seals `lease` for storage under [`Lease::object_name`].
pub fn seal_lease(secret: &UserSecret, lease: &Lease) -> Result<Vec<u8>, LeaseError> {
    use ring::rand::SecureRandom;
    if !valid_env_name(&lease.env) {
        return Err(LeaseError::Invalid("environment name"));
    }
    if !valid_run(&lease.run) {
        return Err(LeaseError::Invalid("run id"));
    }
    let count = u32::try_from(lease.chunks.len())
        .ok()
        .filter(|&c| c <= MAX_LEASE_CHUNKS)
        .ok_or(LeaseError::Invalid("too many chunks"))?;
    let mut body = Vec::with_capacity(20 + 32 * lease.chunks.len());
    body.extend_from_slice(&lease.expires_unix_ms.to_be_bytes());
    body.extend_from_slice(&count.to_be_bytes());
    for id in &lease.chunks {
        body.extend_from_slice(id);
    }
    let mut nonce = [0u8; NONCE_LEN];
    ring::rand::SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| LeaseError::Random)?;
    let mut out = Vec::with_capacity(5 + KEY_CHECK_LEN + NONCE_LEN + body.len() + TAG_LEN);
    out.extend_from_slice(&LEASE_MAGIC);
    out.push(LEASE_FORMAT);
    out.extend_from_slice(&key_check(secret));
    out.extend_from_slice(&nonce);
    let aad = associated(&out, &lease.object_name());
    let key = secret.derive(LEASE_KEY_LABEL, &[]);
    let ct = Aes256Gcm::new(&key.into())
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: &body,
                aad: &aad,
            },
        )
        .map_err(|_| LeaseError::Authentication)?;
    out.extend_from_slice(&ct);
    Ok(out)
}

/// The associated data: the sealed header, then the object name.
fn associated(header: &[u8], name: &str) -> Vec<u8> {
    let mut aad = header.to_vec();
    aad.extend_from_slice(name.as_bytes());
    aad
}

/// Opens the sealed lease read from object `name`
/// (`leases/<env>/<run>.<seq>`); a lease stored under another name than it
/// was sealed for fails authentication.
pub fn open_lease(secret: &UserSecret, name: &str, sealed: &[u8]) -> Result<Lease, LeaseError> {
    let (env, run, seq) = parse_name(name).ok_or(LeaseError::Malformed("object name"))?;
    let header_len = 5 + KEY_CHECK_LEN + NONCE_LEN;
    if sealed.len() < header_len + TAG_LEN
        || sealed[..4] != LEASE_MAGIC
        || sealed[4] != LEASE_FORMAT
    {
        return Err(LeaseError::NotALease);
    }
    if sealed[5..5 + KEY_CHECK_LEN] != key_check(secret) {
        return Err(LeaseError::WrongSecret);
    }
    let (header, ct) = sealed.split_at(header_len);
    let nonce = &header[5 + KEY_CHECK_LEN..];
    let key = secret.derive(LEASE_KEY_LABEL, &[]);
    let body = Aes256Gcm::new(&key.into())
        .decrypt(
            Nonce::from_slice(nonce),
            Payload {
                msg: ct,
                aad: &associated(header, name),
            },
        )
        .map_err(|_| LeaseError::Authentication)?;
    let (expires_unix_ms, chunks) = decode_body(&body)?;
    Ok(Lease {
        env: env.to_owned(),
        run: run.to_owned(),
        seq,
        expires_unix_ms,
        chunks,
    })
}

/// The expiry and chunk ids of an opened lease body (expiry as 8 bytes
/// big-endian, the chunk count as 4, then the 32-byte ids).
fn decode_body(body: &[u8]) -> Result<(u64, Vec<[u8; 32]>), LeaseError> {
    let (Some(expires), Some(count)) = (body.get(..8), body.get(8..12)) else {
        return Err(LeaseError::Malformed("shorter than its header"));
    };
    let expires_unix_ms = u64::from_be_bytes(expires.try_into().unwrap_or_default());
    let count = u32::from_be_bytes(count.try_into().unwrap_or_default());
    let ids = &body[12..];
    if count > MAX_LEASE_CHUNKS || ids.len() != 32 * count as usize {
        return Err(LeaseError::Malformed("chunk count and length differ"));
    }
    let chunks = ids
        .chunks_exact(32)
        .map(|c| {
            let mut id = [0u8; 32];
            id.copy_from_slice(c);
            id
        })
        .collect();
    Ok((expires_unix_ms, chunks))
}

/// The lease body decoder and the object-name parser, bare, for the
/// `store_lease` fuzz target (they are otherwise reached only after
/// authentication); only under `cfg(fuzzing)`.
#[cfg(fuzzing)]
pub fn fuzz_decode(body: &[u8], name: &str) -> (Result<(u64, Vec<[u8; 32]>), LeaseError>, bool) {
    (decode_body(body), parse_name(name).is_some())
}

/// `(env, run, seq)` of a lease object name.
fn parse_name(name: &str) -> Option<(&str, &str, u64)> {
    let rest = name.strip_prefix("leases/")?;
    let (env, file) = rest.split_once('/')?;
    let (run, seq) = file.split_once('.')?;
    (valid_env_name(env) && valid_run(run)).then_some(())?;
    Some((env, run, seq.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Lease {
        Lease {
            env: "lab".into(),
            run: "0123456789abcdef0123456789abcdef".into(),
            seq: 3,
            expires_unix_ms: 1_000_000,
            chunks: vec![[1; 32], [2; 32]],
        }
    }

    #[test]
    fn a_lease_opens_only_with_its_secret_and_name() {
        let s = UserSecret::from_bytes([9; 32]);
        let lease = sample();
        let sealed = seal_lease(&s, &lease).unwrap();
        let name = lease.object_name();
        assert_eq!(name, "leases/lab/0123456789abcdef0123456789abcdef.3");
        assert_eq!(open_lease(&s, &name, &sealed).unwrap(), lease);
        let other = UserSecret::from_bytes([8; 32]);
        assert_eq!(
            open_lease(&other, &name, &sealed),
            Err(LeaseError::WrongSecret)
        );
        let renamed = lease_object_name("lab", &lease.run, 4);
        assert_eq!(
            open_lease(&s, &renamed, &sealed),
            Err(LeaseError::Authentication)
        );
        let mut bad = sealed.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(open_lease(&s, &name, &bad), Err(LeaseError::Authentication));
        assert_eq!(
            open_lease(&s, &name, &sealed[..10]),
            Err(LeaseError::NotALease)
        );
        assert!(lease.is_live(999_999) && !lease.is_live(1_000_000));
    }

    #[test]
    fn bad_fields_are_refused_not_sealed() {
        let s = UserSecret::from_bytes([9; 32]);
        let mut l = sample();
        l.run = "short".into();
        assert_eq!(seal_lease(&s, &l), Err(LeaseError::Invalid("run id")));
        let mut l = sample();
        l.env = "a/b".into();
        assert!(seal_lease(&s, &l).is_err());
        assert_eq!(
            open_lease(&s, "leases/lab/x.1", b""),
            Err(LeaseError::Malformed("object name"))
        );
    }
}
