//! Fuzzing stand-ins for [`suite.rs`](self): compiled in its place only under
//! `cfg(fuzzing)`, which cargo-fuzz sets and no normal build does (a test in
//! `tests/no_fuzzing_mode.rs` checks a normal build seals real AES-GCM).
//!
//! NOT CRYPTOGRAPHY. Each primitive keeps the shape and every check of the
//! real one, so the code around it is exercised as it is in production, but
//! costs a few nanoseconds per byte instead of microseconds per handshake:
//!
//! - the record AEAD XORs the plaintext with a key byte and appends a 16-byte
//!   keyed checksum over key, nonce and ciphertext: tampering, truncation, a
//!   wrong key and a replayed or reordered record (wrong nonce) still fail;
//! - the Noise handshakes run snow's real state machine (same patterns, same
//!   message shapes and lengths, same PSK and prologue binding) with a resolver
//!   whose DH is lane-wise multiplication mod 2^64 (commutative, so both sides
//!   agree; distinct keys give distinct results, so pinned-key mismatches,
//!   unauthorized keys and wrong resume secrets are still detected), whose hash
//!   is a cheap mixing function and whose cipher is the checksum AEAD above;
//! - ephemeral keys come from a process-wide counter, so every handshake's
//!   ephemeral differs and replay detection still works.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use snow::params::{CipherChoice, DHChoice, HashChoice, NoiseParams};
use snow::resolvers::CryptoResolver;
use snow::types::{Cipher, Dh, Hash, Random};

/// `true`: this build uses the cheap fuzzing stand-ins.
pub(crate) const FUZZING: bool = true;

const TAG_LEN: usize = 16;

/// Cheap keyed digest of `parts` (not cryptographic), `N` ≤ 32 bytes: four
/// independent multiply-rotate lanes over 32-byte blocks, mixed at the end.
fn digest<const N: usize>(key: &[u8], nonce: u64, parts: &[&[u8]]) -> [u8; N] {
    const K: [u64; 4] = [
        0x9e37_79b9_7f4a_7c15,
        0xbf58_476d_1ce4_e5b9,
        0x94d0_49bb_1331_11eb,
        0xff51_afd7_ed55_8ccd,
    ];
    let mut s = [
        0x6a09_e667_f3bc_c908u64,
        0xbb67_ae85_84ca_a73b ^ nonce,
        0x3c6e_f372_fe94_f82b,
        0xa54f_f53a_5f1d_36f1,
    ];
    // Straight-line code over fixed-size arrays: under the fuzzer's
    // instrumentation every loop bound and length check costs a callback.
    let lanes = |s: &mut [u64; 4], b: &[u8; 32], extra: u64| {
        let w = |i: usize| {
            u64::from_le_bytes([
                b[i],
                b[i + 1],
                b[i + 2],
                b[i + 3],
                b[i + 4],
                b[i + 5],
                b[i + 6],
                b[i + 7],
            ])
        };
        s[0] = (s[0] ^ w(0) ^ extra).wrapping_mul(K[0]).rotate_left(29);
        s[1] = (s[1] ^ w(8) ^ extra).wrapping_mul(K[1]).rotate_left(29);
        s[2] = (s[2] ^ w(16) ^ extra).wrapping_mul(K[2]).rotate_left(29);
        s[3] = (s[3] ^ w(24) ^ extra).wrapping_mul(K[3]).rotate_left(29);
    };
    for part in std::iter::once(&key).chain(parts.iter()) {
        let (blocks, rest) = part.as_chunks::<32>();
        for b in blocks {
            lanes(&mut s, b, 0);
        }
        let mut tail = [0u8; 32];
        tail[..rest.len()].copy_from_slice(rest);
        lanes(&mut s, &tail, part.len() as u64);
        // Cross the lanes between parts so parts cannot be swapped.
        s.rotate_left(1);
    }
    let mut out = [0u8; N];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut z = s[i] ^ s[(i + 1) % 4].rotate_left(17) ^ s[(i + 2) % 4].rotate_left(41);
        z = (z ^ (z >> 30)).wrapping_mul(K[1]);
        z = (z ^ (z >> 27)).wrapping_mul(K[2]);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// The byte both stand-in ciphers XOR with (never 0).
fn pad_byte(key: &[u8; 32]) -> u8 {
    key[0] | 1
}

fn xor(key: &[u8; 32], buf: &mut [u8]) {
    let k = pad_byte(key);
    // 64 bytes per iteration as eight words: a byte loop pays the fuzzer's
    // coverage counter (a memory increment) once per 16 bytes vectorized.
    let pad = u64::from_ne_bytes([k; 8]);
    let (blocks, rest) = buf.as_chunks_mut::<64>();
    for b in blocks {
        let (w, _) = b.as_chunks_mut::<8>();
        let x = |w: &mut [u8; 8]| *w = (u64::from_ne_bytes(*w) ^ pad).to_ne_bytes();
        x(&mut w[0]);
        x(&mut w[1]);
        x(&mut w[2]);
        x(&mut w[3]);
        x(&mut w[4]);
        x(&mut w[5]);
        x(&mut w[6]);
        x(&mut w[7]);
    }
    rest.iter_mut().for_each(|b| *b ^= k);
}

fn tag(key: &[u8; 32], nonce: u64, ad: &[u8], ct: &[u8]) -> [u8; TAG_LEN] {
    digest(key, nonce, &[ad, ct])
}

/// A record AEAD keyed for one direction (fuzzing stand-in): the XOR of
/// [`CheapCipher`] and a keyed checksum of its own ([`Lanes`]), fused into
/// one pass over the record (records are most of the bytes a session target
/// moves).
#[derive(Clone)]
pub(crate) struct Aead([u8; 32]);

/// Multipliers of the record checksum's eight lanes (odd, so each lane step
/// is a bijection of the word it takes in).
const LANE_K: [u64; 8] = [
    0x9e37_79b9_7f4a_7c15,
    0xbf58_476d_1ce4_e5b9,
    0x94d0_49bb_1331_11eb,
    0xff51_afd7_ed55_8ccd,
    0xc4ce_b9fe_1a85_ec53,
    0x8764_1d9c_3a0b_f4e7,
    0xd6e8_feb8_6659_fd93,
    0xa076_1d64_78bd_642f,
];

/// Eight multiply-rotate lanes over 64-byte blocks: one coverage counter and
/// eight independent multiplies per block, so the fuzzer's instrumentation
/// and the multiply latency cost little per byte.
struct Lanes([u64; 8]);

impl Lanes {
    fn new(key: &[u8; 32], nonce: u64) -> Self {
        let k = |i: usize| {
            u64::from_le_bytes([
                key[i],
                key[i + 1],
                key[i + 2],
                key[i + 3],
                key[i + 4],
                key[i + 5],
                key[i + 6],
                key[i + 7],
            ])
        };
        Lanes([
            k(0),
            k(8),
            k(16),
            k(24),
            k(0).rotate_left(32) ^ nonce,
            k(8).rotate_left(32) ^ !nonce,
            k(16).rotate_left(32),
            k(24).rotate_left(32),
        ])
    }

    /// Takes in one block of eight words.
    fn block(&mut self, w: &[u64; 8]) {
        let s = &mut self.0;
        s[0] = (s[0] ^ w[0]).wrapping_mul(LANE_K[0]).rotate_left(29);
        s[1] = (s[1] ^ w[1]).wrapping_mul(LANE_K[1]).rotate_left(29);
        s[2] = (s[2] ^ w[2]).wrapping_mul(LANE_K[2]).rotate_left(29);
        s[3] = (s[3] ^ w[3]).wrapping_mul(LANE_K[3]).rotate_left(29);
        s[4] = (s[4] ^ w[4]).wrapping_mul(LANE_K[4]).rotate_left(29);
        s[5] = (s[5] ^ w[5]).wrapping_mul(LANE_K[5]).rotate_left(29);
        s[6] = (s[6] ^ w[6]).wrapping_mul(LANE_K[6]).rotate_left(29);
        s[7] = (s[7] ^ w[7]).wrapping_mul(LANE_K[7]).rotate_left(29);
    }

    /// The 16-byte tag of everything taken in, `len` bytes in all.
    fn finish(mut self, len: usize) -> [u8; TAG_LEN] {
        // The length, so a zero-padded tail and its extension differ.
        self.block(&[len as u64; 8]);
        let s = self.0;
        let mut out = [0u8; TAG_LEN];
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            let mut z = s[i] ^ s[i + 2].rotate_left(17) ^ s[i + 4].rotate_left(41) ^ s[i + 6];
            z = (z ^ (z >> 30)).wrapping_mul(LANE_K[1]);
            z = (z ^ (z >> 27)).wrapping_mul(LANE_K[2]);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes());
        }
        out
    }
}

/// XORs `buf` with the key's pad and checksums it in the same pass: the
/// checksum is over the ciphertext, which is `buf` after the XOR when
/// `sealing` and before it when opening.
fn xor_and_tag(key: &[u8; 32], nonce: u64, buf: &mut [u8], sealing: bool) -> [u8; TAG_LEN] {
    let k = pad_byte(key);
    let pad = u64::from_ne_bytes([k; 8]);
    let mut lanes = Lanes::new(key, nonce);
    let len = buf.len();
    let (blocks, rest) = buf.as_chunks_mut::<64>();
    for b in blocks {
        let mut w = [0u64; 8];
        let (words, _) = b.as_chunks_mut::<8>();
        for (i, word) in words.iter_mut().enumerate() {
            let v = u64::from_le_bytes(*word);
            let x = v ^ pad;
            *word = x.to_le_bytes();
            w[i] = if sealing { x } else { v };
        }
        lanes.block(&w);
    }
    let mut tail = [0u8; 64];
    for (t, b) in tail.iter_mut().zip(rest.iter_mut()) {
        let v = *b;
        *b ^= k;
        *t = if sealing { *b } else { v };
    }
    let (words, _) = tail.as_chunks::<8>();
    let mut w = [0u64; 8];
    for (i, word) in words.iter().enumerate() {
        w[i] = u64::from_le_bytes(*word);
    }
    lanes.block(&w);
    lanes.finish(len)
}

impl Aead {
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        Self(*key)
    }

    pub(crate) fn seal(&self, n: u64, buf: &mut [u8]) -> Result<[u8; 16], ()> {
        Ok(xor_and_tag(&self.0, n, buf, true))
    }

    pub(crate) fn open(&self, n: u64, buf: &mut [u8], t: &[u8]) -> Result<(), ()> {
        if t != xor_and_tag(&self.0, n, buf, false) {
            // Undo the XOR: a failed open leaves the ciphertext as it was.
            xor(&self.0, buf);
            return Err(());
        }
        Ok(())
    }
}

/// A Noise builder for `pattern` with the cheap resolver. The parsed
/// parameters are kept per pattern (there are two), so a handshake does not
/// re-parse its pattern string.
pub(crate) fn noise(pattern: &str) -> Result<snow::Builder<'static>, snow::Error> {
    static PARSED: Mutex<Vec<(String, NoiseParams)>> = Mutex::new(Vec::new());
    let mut parsed = PARSED.lock().unwrap_or_else(|e| e.into_inner());
    let params = match parsed.iter().find(|(p, _)| p == pattern) {
        Some((_, params)) => params.clone(),
        None => {
            let params: NoiseParams = pattern.parse()?;
            parsed.push((pattern.to_owned(), params.clone()));
            params
        }
    };
    Ok(snow::Builder::with_resolver(
        params,
        Box::new(CheapResolver),
    ))
}

/// A stand-in ephemeral key: distinct per call (splitmix64 of a counter),
/// no syscall.
pub(crate) fn ephemeral() -> Result<[u8; 32], crate::Error> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut k = [0u8; 32];
    CounterRng(NEXT.fetch_add(1, Ordering::Relaxed) << 20)
        .try_fill_bytes(&mut k)
        .map_err(|_| crate::Error::Random)?;
    Ok(k)
}

/// The stand-in public key of `private`: lane-wise `(private | 1) * G mod 2^64`.
pub(crate) fn public_key(private: [u8; 32]) -> [u8; 32] {
    const G: [u8; 32] = [0x9b; 32];
    mul(&private, &G)
}

fn mul(a: &[u8; 32], b: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for i in 0..4 {
        let r = i * 8..i * 8 + 8;
        let x = u64::from_le_bytes(a[r.clone()].try_into().unwrap_or_default()) | 1;
        let y = u64::from_le_bytes(b[r.clone()].try_into().unwrap_or_default()) | 1;
        out[r].copy_from_slice(&x.wrapping_mul(y).to_le_bytes());
    }
    out
}

struct CheapResolver;

impl CryptoResolver for CheapResolver {
    fn resolve_rng(&self) -> Option<Box<dyn Random>> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Some(Box::new(CounterRng(
            NEXT.fetch_add(1, Ordering::Relaxed) << 20,
        )))
    }
    fn resolve_dh(&self, _: &DHChoice) -> Option<Box<dyn Dh>> {
        Some(Box::new(CheapDh {
            private: [0; 32],
            public: [0; 32],
        }))
    }
    fn resolve_hash(&self, _: &HashChoice) -> Option<Box<dyn Hash>> {
        Some(Box::new(CheapHash(Vec::with_capacity(256))))
    }
    fn resolve_cipher(&self, _: &CipherChoice) -> Option<Box<dyn Cipher>> {
        Some(Box::new(CheapCipher([0; 32])))
    }
}

/// splitmix64 from a per-instance seed: distinct ephemerals, no syscalls.
struct CounterRng(u64);

impl Random for CounterRng {
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), snow::Error> {
        for chunk in dest.chunks_mut(8) {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
        Ok(())
    }
}

struct CheapDh {
    private: [u8; 32],
    public: [u8; 32],
}

impl Dh for CheapDh {
    fn name(&self) -> &'static str {
        "25519"
    }
    fn pub_len(&self) -> usize {
        32
    }
    fn priv_len(&self) -> usize {
        32
    }
    fn set(&mut self, privkey: &[u8]) {
        self.private.copy_from_slice(&privkey[..32]);
        self.public = public_key(self.private);
    }
    fn generate(&mut self, rng: &mut dyn Random) -> Result<(), snow::Error> {
        let mut private = [0u8; 32];
        rng.try_fill_bytes(&mut private)?;
        self.set(&private);
        Ok(())
    }
    fn pubkey(&self) -> &[u8] {
        &self.public
    }
    fn privkey(&self) -> &[u8] {
        &self.private
    }
    fn dh(&self, pubkey: &[u8], out: &mut [u8]) -> Result<(), snow::Error> {
        if pubkey.len() < 32 || out.len() < 32 {
            return Err(snow::Error::Dh);
        }
        out[..32].copy_from_slice(&mul(&self.private, pubkey));
        Ok(())
    }
}

/// Buffers its input and digests it at the end ("SHA256" shape: 32-byte output).
struct CheapHash(Vec<u8>);

impl Hash for CheapHash {
    fn name(&self) -> &'static str {
        "SHA256"
    }
    fn block_len(&self) -> usize {
        64
    }
    fn hash_len(&self) -> usize {
        32
    }
    fn reset(&mut self) {
        self.0.clear();
    }
    fn input(&mut self, data: &[u8]) {
        self.0.extend_from_slice(data);
    }
    fn result(&mut self, out: &mut [u8]) {
        let d: [u8; 32] = digest(b"hash", 0, &[&self.0]);
        out[..32].copy_from_slice(&d);
    }
    // HMAC and HKDF as one keyed digest each (the defaults hash padded blocks).
    fn hmac(&mut self, key: &[u8], data: &[u8], out: &mut [u8]) {
        let d: [u8; 32] = digest(key, 1, &[data]);
        out[..32].copy_from_slice(&d);
    }
    fn hkdf(
        &mut self,
        chaining_key: &[u8],
        input_key_material: &[u8],
        outputs: usize,
        out1: &mut [u8],
        out2: &mut [u8],
        out3: &mut [u8],
    ) {
        // One keyed digest of both inputs, then each output a cheap distinct
        // mix of it (a full digest per output cost a handshake ~2 % of a
        // session target's time): the outputs still depend on every input
        // byte and differ from each other.
        let temp: [u8; 32] = digest(chaining_key, 2, &[input_key_material]);
        for (i, out) in [out1, out2, out3].into_iter().enumerate().take(outputs) {
            out[..32].copy_from_slice(&expand(&temp, i as u64 + 1));
        }
    }
}

/// Output `n` (≥ 1) of the stand-in HKDF: each word of `prk`, XORed with
/// a fold of all four, mixed with `n` by splitmix64's finaliser, so the
/// outputs of one derivation differ and each word depends on all of `prk`.
fn expand(prk: &[u8; 32], n: u64) -> [u8; 32] {
    let (w, _) = prk.as_chunks::<8>();
    let w = [
        u64::from_le_bytes(w[0]),
        u64::from_le_bytes(w[1]),
        u64::from_le_bytes(w[2]),
        u64::from_le_bytes(w[3]),
    ];
    let mut out = [0u8; 32];
    let (o, _) = out.as_chunks_mut::<8>();
    let fold = w[0] ^ w[1].rotate_left(16) ^ w[2].rotate_left(32) ^ w[3].rotate_left(48);
    let mix = |x: u64| {
        let mut z = x.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    o[0] = mix(w[0] ^ fold).to_le_bytes();
    o[1] = mix(w[1] ^ fold.rotate_left(13)).to_le_bytes();
    o[2] = mix(w[2] ^ fold.rotate_left(29)).to_le_bytes();
    o[3] = mix(w[3] ^ fold.rotate_left(43)).to_le_bytes();
    out
}

struct CheapCipher([u8; 32]);

impl Cipher for CheapCipher {
    fn name(&self) -> &'static str {
        "AESGCM"
    }
    fn set(&mut self, key: &[u8; 32]) {
        self.0 = *key;
    }
    fn encrypt(&self, nonce: u64, ad: &[u8], plaintext: &[u8], out: &mut [u8]) -> usize {
        let n = plaintext.len();
        out[..n].copy_from_slice(plaintext);
        xor(&self.0, &mut out[..n]);
        let t = tag(&self.0, nonce, ad, &out[..n]);
        out[n..n + TAG_LEN].copy_from_slice(&t);
        n + TAG_LEN
    }
    fn decrypt(
        &self,
        nonce: u64,
        ad: &[u8],
        ciphertext: &[u8],
        out: &mut [u8],
    ) -> Result<usize, snow::Error> {
        let n = ciphertext
            .len()
            .checked_sub(TAG_LEN)
            .ok_or(snow::Error::Decrypt)?;
        let (ct, t) = ciphertext.split_at(n);
        if t != tag(&self.0, nonce, ad, ct) {
            return Err(snow::Error::Decrypt);
        }
        out[..n].copy_from_slice(ct);
        xor(&self.0, &mut out[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every check the real AEAD makes still fails here: any flipped bit of
    /// body or tag, truncation, extension, the wrong nonce (replay, reorder),
    /// the wrong key; associated data is bound. Sizes straddle the 64-byte
    /// blocks.
    #[test]
    fn stand_in_aead_keeps_every_check() {
        let key = [0x42; 32];
        let aead = Aead::new(&key);
        for len in [0, 1, 7, 63, 64, 65, 127, 128, 200, 1000] {
            let plain: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let mut buf = plain.clone();
            let tag = aead.seal(9, &mut buf).unwrap();
            if len > 0 {
                assert_ne!(buf, plain, "len {len}: not encrypted");
            }
            let sealed = buf.clone();
            aead.open(9, &mut buf, &tag).unwrap();
            assert_eq!(buf, plain, "len {len}: round trip");
            for i in 0..len {
                for bit in [0x01, 0x80] {
                    let mut bad = sealed.clone();
                    bad[i] ^= bit;
                    assert!(
                        aead.open(9, &mut bad, &tag).is_err(),
                        "len {len}: byte {i} flip"
                    );
                    let mut expect = sealed.clone();
                    expect[i] ^= bit;
                    assert_eq!(bad, expect, "a failed open leaves the ciphertext");
                }
            }
            for i in 0..TAG_LEN {
                let mut t = tag;
                t[i] ^= 4;
                assert!(aead.open(9, &mut sealed.clone(), &t).is_err());
            }
            assert!(
                aead.open(8, &mut sealed.clone(), &tag).is_err(),
                "wrong nonce"
            );
            assert!(
                aead.open(10, &mut sealed.clone(), &tag).is_err(),
                "wrong nonce"
            );
            let other = Aead::new(&[0x43; 32]);
            assert!(
                other.open(9, &mut sealed.clone(), &tag).is_err(),
                "wrong key"
            );
            if len > 0 {
                let mut short = sealed[..len - 1].to_vec();
                assert!(aead.open(9, &mut short, &tag).is_err(), "truncated");
            }
            let mut long = sealed.clone();
            long.push(0);
            assert!(aead.open(9, &mut long, &tag).is_err(), "extended");
            // The Noise cipher: associated data is bound.
            let c = CheapCipher(key);
            let mut out = vec![0; len + TAG_LEN];
            let n = c.encrypt(3, b"ad", &plain, &mut out);
            let mut back = vec![0; len];
            assert_eq!(c.decrypt(3, b"ad", &out[..n], &mut back).unwrap(), len);
            assert_eq!(back, plain);
            assert!(c.decrypt(3, b"ae", &out[..n], &mut back).is_err());
            assert!(c.decrypt(4, b"ad", &out[..n], &mut back).is_err());
        }
    }

    /// The stand-in HKDF keeps what the handshakes rely on: its three outputs
    /// differ from each other, and any change of the chaining key or of the
    /// input key material (a wrong PSK, a different DH result) changes every
    /// output.
    #[test]
    fn stand_in_hkdf_outputs_differ_and_bind_their_inputs() {
        let derive = |ck: &[u8; 32], ikm: &[u8]| {
            let (mut a, mut b, mut c) = ([0u8; 32], [0u8; 32], [0u8; 32]);
            CheapHash(Vec::new()).hkdf(ck, ikm, 3, &mut a, &mut b, &mut c);
            [a, b, c]
        };
        let base = derive(&[7; 32], &[9; 32]);
        assert!(base[0] != base[1] && base[1] != base[2] && base[0] != base[2]);
        for byte in 0..32 {
            for bit in [0x01, 0x80] {
                let mut ck = [7; 32];
                ck[byte] ^= bit;
                let mut ikm = [9; 32];
                ikm[byte] ^= bit;
                for other in [derive(&ck, &[9; 32]), derive(&[7; 32], &ikm)] {
                    for i in 0..3 {
                        assert_ne!(other[i], base[i], "byte {byte} bit {bit:#x} output {i}");
                    }
                }
            }
        }
        assert_ne!(
            derive(&[7; 32], &[])[0],
            derive(&[7; 32], &[0])[0],
            "length bound"
        );
    }
}
