//! The record layer: length-prefixed AEAD records on a byte-stream transport.
//!
//! Spec: `docs/PROTOCOL.md` §3. A record is `u16 length || ciphertext || tag`
//! exactly as a Noise transport message (AES-256-GCM, nonce = 32 zero bits ||
//! 64-bit big-endian counter, empty associated data), keyed by the Noise split.
//! Records are sealed and opened in place in the caller's buffer, so a payload
//! byte is copied once from the stream buffer into the record and never again.

use crate::suite::Aead;

/// Bytes of the authentication tag after every ciphertext.
pub const TAG_LEN: usize = 16;
/// Largest ciphertext (plaintext + tag), as in Noise.
pub const MAX_RECORD: usize = 65_535;
/// Largest plaintext a record carries.
pub const MAX_PLAINTEXT: usize = MAX_RECORD - TAG_LEN;
/// Bytes added around each record's plaintext on the wire.
pub const RECORD_OVERHEAD: usize = 2 + TAG_LEN;

/// One direction's cipher with its nonce counter.
// Fuzzing only: the session targets clone an established pair per input.
#[cfg_attr(fuzzing, derive(Clone))]
pub(crate) struct RecordCipher {
    aead: Aead,
    /// The key, kept so a live transport can move to another process
    /// (`Session::export_transport`); never written anywhere else.
    key: [u8; 32],
    nonce: u64,
}

impl RecordCipher {
    pub(crate) fn new(key: &[u8; 32]) -> Self {
        Self::at(key, 0)
    }

    /// The cipher of a moved transport: `key`, next nonce `nonce`.
    pub(crate) fn at(key: &[u8; 32], nonce: u64) -> Self {
        Self {
            aead: Aead::new(key),
            key: *key,
            nonce,
        }
    }

    /// The key and the next nonce, for moving the transport.
    pub(crate) fn state(&self) -> (&[u8; 32], u64) {
        (&self.key, self.nonce)
    }

    fn next_nonce(&mut self) -> Result<u64, crate::Error> {
        // 2^64 - 1 is reserved by Noise; a session rekeys on every resume long before.
        if self.nonce == u64::MAX {
            return Err(crate::Error::ProtocolViolation("record nonce exhausted"));
        }
        self.nonce += 1;
        Ok(self.nonce - 1)
    }

    /// Starts a record at the end of `out`: reserves its length prefix. The
    /// caller appends plaintext, then calls [`RecordCipher::seal`] with the
    /// returned start.
    pub(crate) fn begin(out: &mut Vec<u8>) -> usize {
        let start = out.len();
        out.extend_from_slice(&[0, 0]);
        start
    }

    /// Encrypts in place the plaintext appended since `start`, appends the tag
    /// and fills in the length.
    pub(crate) fn seal(&mut self, out: &mut Vec<u8>, start: usize) -> Result<(), crate::Error> {
        let body = start + 2;
        let len = out.len() - body + TAG_LEN;
        debug_assert!(len <= MAX_RECORD);
        let nonce = self.next_nonce()?;
        let tag = self
            .aead
            .seal(nonce, &mut out[body..])
            .map_err(|_| crate::Error::ProtocolViolation("record too large to seal"))?;
        out.extend_from_slice(&tag);
        out[start..body].copy_from_slice(&(len as u16).to_be_bytes());
        Ok(())
    }

    /// Decrypts one record body (ciphertext || tag) in place; returns the
    /// plaintext length. Any tampering, reordering or replay fails here.
    pub(crate) fn open(&mut self, body: &mut [u8]) -> Result<usize, crate::Error> {
        if body.len() < TAG_LEN {
            return Err(crate::Error::Decrypt);
        }
        let (ct, tag) = body.split_at_mut(body.len() - TAG_LEN);
        // Exhausting the receive counter ends this transport, not the session.
        let nonce = self.next_nonce().map_err(|_| crate::Error::Decrypt)?;
        self.aead
            .open(nonce, ct, tag)
            .map_err(|_| crate::Error::Decrypt)?;
        Ok(ct.len())
    }
}

/// Splits whole records off the front of an input buffer.
///
/// Returns `Some((body_start, body_end))` for the first complete record in
/// `buf[pos..]`, or `None` if more bytes are needed.
pub(crate) fn next_record(buf: &[u8], pos: usize) -> Option<(usize, usize)> {
    let rest = &buf[pos..];
    if rest.len() < 2 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
    (rest.len() >= 2 + len).then_some((pos + 2, pos + 2 + len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_round_trip_and_tamper_detection() {
        let key = [7u8; 32];
        let (mut tx, mut rx) = (RecordCipher::new(&key), RecordCipher::new(&key));
        let mut wire = Vec::new();
        for msg in [&b"hello"[..], &[0xaa; 1000][..]] {
            let s = RecordCipher::begin(&mut wire);
            wire.extend_from_slice(msg);
            tx.seal(&mut wire, s).unwrap();
        }
        let (b, e) = next_record(&wire, 0).unwrap();
        let n = rx.open(&mut wire[b..e]).unwrap();
        assert_eq!(&wire[b..b + n], b"hello");
        let (b2, e2) = next_record(&wire, e).unwrap();
        let mut tampered = wire[b2..e2].to_vec();
        tampered[3] ^= 1;
        assert!(matches!(rx.open(&mut tampered), Err(crate::Error::Decrypt)));
    }

    #[test]
    fn replayed_record_fails_on_nonce() {
        let key = [1u8; 32];
        let (mut tx, mut rx) = (RecordCipher::new(&key), RecordCipher::new(&key));
        let mut wire = Vec::new();
        let s = RecordCipher::begin(&mut wire);
        wire.extend_from_slice(b"once");
        tx.seal(&mut wire, s).unwrap();
        let copy = wire.clone();
        rx.open(&mut wire[2..]).unwrap();
        let mut again = copy[2..].to_vec();
        assert!(matches!(rx.open(&mut again), Err(crate::Error::Decrypt)));
    }
}

/// The record AEAD is real AES-256-GCM in every normal build (the fuzzing
/// stand-in exists only under `cfg(fuzzing)`, see `suite_fuzzing.rs`).
#[cfg(all(test, not(fuzzing)))]
mod real_crypto {
    use super::*;

    #[test]
    fn records_are_aes_256_gcm_known_answer() {
        // McGrew & Viega, "The Galois/Counter Mode of Operation", test case 14:
        // zero key, zero 96-bit IV (= record nonce 0), 16 zero bytes of plaintext.
        let mut tx = RecordCipher::new(&[0; 32]);
        let mut wire = Vec::new();
        let s = RecordCipher::begin(&mut wire);
        wire.extend_from_slice(&[0; 16]);
        tx.seal(&mut wire, s).unwrap();
        assert_eq!(
            hex::encode(&wire[2..]),
            "cea7403d4d606b6e074ec5d3baf39d18d0d1c8a799996bf0265b98b5d48ab919"
        );
        assert!(!crate::fuzzing_mode());
    }
}
