//! The cryptographic primitives: AES-256-GCM for records, snow's default
//! resolver (X25519, AES-GCM, SHA-256) for the Noise handshakes, X25519 for
//! public keys.
//!
//! This is the one module that fuzzing swaps out: under `cfg(fuzzing)` (set by
//! cargo-fuzz, never by a normal build) `lib.rs` compiles `suite_fuzzing.rs`
//! in its place, which has the same items with cheap deterministic stand-ins.
//! Everything around the primitives (nonce counters, tag checks, the Noise
//! state machine, key pinning, authorization, replay memory) is the same code
//! in both builds.

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, KeyInit};

/// `false`: this build uses real cryptography.
pub(crate) const FUZZING: bool = false;

/// A record AEAD keyed for one direction.
pub(crate) struct Aead(Aes256Gcm);

impl Aead {
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        Self(Aes256Gcm::new(key.into()))
    }

    /// Encrypts `buf` in place under nonce `n` (Noise form: 32 zero bits ||
    /// 64-bit big-endian counter, empty associated data); returns the tag.
    pub(crate) fn seal(&self, n: u64, buf: &mut [u8]) -> Result<[u8; 16], ()> {
        let tag = self
            .0
            .encrypt_in_place_detached(&nonce(n), &[], buf)
            .map_err(|_| ())?;
        Ok(tag.into())
    }

    /// Decrypts `buf` in place if `tag` authenticates it under nonce `n`.
    pub(crate) fn open(&self, n: u64, buf: &mut [u8], tag: &[u8]) -> Result<(), ()> {
        if tag.len() != 16 {
            return Err(());
        }
        self.0
            .decrypt_in_place_detached(&nonce(n), &[], buf, aes_gcm::Tag::from_slice(tag))
            .map_err(|_| ())
    }
}

fn nonce(n: u64) -> aes_gcm::Nonce<aes_gcm::aead::consts::U12> {
    let mut b = [0u8; 12];
    b[4..].copy_from_slice(&n.to_be_bytes());
    b.into()
}

/// A Noise builder for `pattern` with the default (real) resolver.
pub(crate) fn noise(pattern: &str) -> Result<snow::Builder<'static>, snow::Error> {
    Ok(snow::Builder::new(pattern.parse()?))
}

/// The X25519 public key of `private`.
pub(crate) fn public_key(private: [u8; 32]) -> [u8; 32] {
    curve25519_dalek::MontgomeryPoint::mul_base_clamped(private).to_bytes()
}
