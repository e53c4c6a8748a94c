//! The cryptographic primitives: AES-256-GCM (`ring`) for records, snow's default
//! resolver (X25519, AES-GCM, SHA-256) for the Noise handshakes, X25519 for
//! public keys.
//!
//! This is the one module that fuzzing swaps out: under `cfg(fuzzing)` (set by
//! cargo-fuzz, never by a normal build) `lib.rs` compiles `suite_fuzzing.rs`
//! in its place, which has the same items with cheap deterministic stand-ins.
//! Everything around the primitives (nonce counters, tag checks, the Noise
//! state machine, key pinning, authorization, replay memory) is the same code
//! in both builds.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

/// `false`: this build uses real cryptography.
pub(crate) const FUZZING: bool = false;

/// A record AEAD keyed for one direction: `ring`'s AES-256-GCM (AES-NI and
/// carry-less multiplication where the CPU has them). Measured on this
/// project's 2-core machines: ~4,000 MB/s sealing 64 KiB records against
/// ~700 MB/s for the RustCrypto `aes-gcm` crate used before, and within
/// ~15 % of `aws-lc-rs` at 64 KiB (equal at 100 B) without a C library to
/// build: `ring` is already compiled into the tree for `snow`.
pub(crate) struct Aead(LessSafeKey);

impl Aead {
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        // A 32-byte key is always valid for AES-256-GCM.
        let unbound = UnboundKey::new(&AES_256_GCM, key).unwrap_or_else(|_| unreachable!());
        Self(LessSafeKey::new(unbound))
    }

    /// Encrypts `buf` in place under nonce `n` (Noise form: 32 zero bits ||
    /// 64-bit big-endian counter, empty associated data); returns the tag.
    pub(crate) fn seal(&self, n: u64, buf: &mut [u8]) -> Result<[u8; 16], ()> {
        let tag = self
            .0
            .seal_in_place_separate_tag(nonce(n), Aad::empty(), buf)
            .map_err(|_| ())?;
        let mut out = [0u8; 16];
        out.copy_from_slice(tag.as_ref());
        Ok(out)
    }

    /// Decrypts `buf` in place if `tag` authenticates it under nonce `n`.
    pub(crate) fn open(&self, n: u64, buf: &mut [u8], tag: &[u8]) -> Result<(), ()> {
        let tag: [u8; 16] = tag.try_into().map_err(|_| ())?;
        self.0
            .open_in_place_separate_tag(nonce(n), Aad::empty(), tag.into(), buf, 0..)
            .map(|_| ())
            .map_err(|_| ())
    }
}

fn nonce(n: u64) -> Nonce {
    let mut b = [0u8; 12];
    b[4..].copy_from_slice(&n.to_be_bytes());
    Nonce::assume_unique_for_key(b)
}

/// A Noise builder for `pattern` with the default (real) resolver.
pub(crate) fn noise(pattern: &str) -> Result<snow::Builder<'static>, snow::Error> {
    Ok(snow::Builder::new(pattern.parse()?))
}

/// A fresh X25519 private key for one handshake's ephemeral key, from the
/// operating system's random source.
pub(crate) fn ephemeral() -> Result<[u8; 32], crate::Error> {
    let mut k = [0u8; 32];
    crate::random_bytes(&mut k)?;
    Ok(k)
}

/// The X25519 public key of `private`.
pub(crate) fn public_key(private: [u8; 32]) -> [u8; 32] {
    curve25519_dalek::MontgomeryPoint::mul_base_clamped(private).to_bytes()
}
