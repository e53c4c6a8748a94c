//! Byte-level encoding shared by every message: QUIC-style variable-length
//! integers, length-prefixed byte strings, and one short-read error.
//!
//! Spec: `docs/PROTOCOL.md` §2 (Encoding conventions).

use std::fmt;

/// Largest value a varint can carry (2^62 - 1).
pub const VARINT_MAX: u64 = (1 << 62) - 1;

/// Why a byte sequence could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended in the middle of a field.
    UnexpectedEnd,
    /// A frame type code that this version does not define.
    UnknownFrameType(u64),
    /// A field holds a value outside its allowed range; the string names the field.
    InvalidValue(&'static str),
    /// Bytes were left after the last field of a message that must be consumed whole.
    TrailingBytes(usize),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnexpectedEnd => write!(f, "message truncated"),
            Self::UnknownFrameType(t) => write!(f, "unknown frame type 0x{t:x}"),
            Self::InvalidValue(field) => write!(f, "invalid value in field `{field}`"),
            Self::TrailingBytes(n) => write!(f, "{n} unexpected trailing bytes"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// A cursor over received bytes. Every read either consumes exactly the field or
/// returns [`DecodeError::UnexpectedEnd`] without consuming anything useful.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`, positioned at its start.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// How many bytes have been consumed.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Fails with [`DecodeError::TrailingBytes`] unless everything was consumed.
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.bytes(1)?[0])
    }

    /// A fixed-size array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    /// A big-endian u16.
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    /// `n` raw bytes, borrowed from the input.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::UnexpectedEnd);
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// A variable-length integer (RFC 9000 §16 layout).
    pub fn varint(&mut self) -> Result<u64, DecodeError> {
        let first = *self.buf.get(self.pos).ok_or(DecodeError::UnexpectedEnd)?;
        let len = 1usize << (first >> 6);
        let raw = self.bytes(len)?;
        let mut v = u64::from(raw[0] & 0x3f);
        for b in &raw[1..] {
            v = (v << 8) | u64::from(*b);
        }
        Ok(v)
    }

    /// A varint that must fit `usize` and be at most `max`.
    pub fn varint_usize(&mut self, max: usize, field: &'static str) -> Result<usize, DecodeError> {
        let v = self.varint()?;
        usize::try_from(v)
            .ok()
            .filter(|v| *v <= max)
            .ok_or(DecodeError::InvalidValue(field))
    }

    /// A varint-length-prefixed byte string of at most `max` bytes.
    pub fn lp_bytes(&mut self, max: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        let n = self.varint_usize(max, field)?;
        self.bytes(n)
    }
}

/// Number of bytes [`put_varint`] writes for `v`.
pub fn varint_len(v: u64) -> usize {
    match v {
        0..=63 => 1,
        64..=16_383 => 2,
        16_384..=1_073_741_823 => 4,
        _ => 8,
    }
}

/// Appends `v` as a varint. Values above [`VARINT_MAX`] are a caller bug and are
/// clamped in release builds (they never occur: offsets and counters stay far below).
pub fn put_varint(out: &mut Vec<u8>, v: u64) {
    debug_assert!(v <= VARINT_MAX, "varint out of range");
    let v = v.min(VARINT_MAX);
    match varint_len(v) {
        1 => out.push(v as u8),
        2 => out.extend_from_slice(&(v as u16 | 0x4000).to_be_bytes()),
        4 => out.extend_from_slice(&(v as u32 | 0x8000_0000).to_be_bytes()),
        _ => out.extend_from_slice(&(v | 0xc000_0000_0000_0000).to_be_bytes()),
    }
}

/// Appends a varint length prefix followed by `bytes`.
pub fn put_lp_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn varint_boundaries_use_expected_sizes() {
        for (v, len) in [
            (0u64, 1usize),
            (63, 1),
            (64, 2),
            (16_383, 2),
            (16_384, 4),
            (1_073_741_823, 4),
            (1_073_741_824, 8),
            (VARINT_MAX, 8),
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out.len(), len, "value {v}");
            let mut r = Reader::new(&out);
            assert_eq!(r.varint().unwrap(), v);
            r.finish().unwrap();
        }
    }

    #[test]
    fn truncated_varint_is_short_read() {
        let mut out = Vec::new();
        put_varint(&mut out, 1_000_000);
        for cut in 0..out.len() {
            assert_eq!(
                Reader::new(&out[..cut]).varint(),
                Err(DecodeError::UnexpectedEnd)
            );
        }
    }

    proptest! {
        #[test]
        fn varint_round_trips(v in 0..=VARINT_MAX) {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            prop_assert_eq!(out.len(), varint_len(v));
            let mut r = Reader::new(&out);
            prop_assert_eq!(r.varint().unwrap(), v);
            prop_assert!(r.finish().is_ok());
        }
    }
}
