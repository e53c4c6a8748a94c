//! Standard base64 (RFC 4648, with padding), as etcd's gateway encodes `bytes` fields.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Encodes `input` with the standard alphabet and `=` padding.
pub(crate) fn encode(input: &[u8]) -> String {
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let chars = [(n >> 18) & 63, (n >> 12) & 63, (n >> 6) & 63, n & 63];
        for (i, c) in chars.iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[*c as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn value(c: u8) -> Option<u32> {
    let v = match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' | b'-' => 62,
        b'/' | b'_' => 63,
        _ => return None,
    };
    Some(u32::from(v))
}

/// Decodes standard (or URL-safe) base64, padded or not. The error says what is
/// wrong and where.
pub(crate) fn decode(input: &str) -> Result<Vec<u8>, String> {
    let bytes = input.as_bytes();
    let unpadded = match bytes.iter().position(|&c| c == b'=') {
        Some(p) => {
            if bytes[p..].iter().any(|&c| c != b'=') || bytes.len() % 4 != 0 || bytes.len() - p > 2
            {
                return Err(format!("invalid base64 padding at byte {p}"));
            }
            &bytes[..p]
        }
        None => bytes,
    };
    if unpadded.len() % 4 == 1 {
        return Err(format!(
            "invalid base64 length {} (a lone trailing character)",
            unpadded.len()
        ));
    }
    let mut out = Vec::with_capacity(unpadded.len() / 4 * 3 + 2);
    for (ci, chunk) in unpadded.chunks(4).enumerate() {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            let v = value(c).ok_or_else(|| {
                format!(
                    "invalid base64 character {:?} at byte {}",
                    char::from(c),
                    ci * 4 + i
                )
            })?;
            n |= v << (18 - 6 * i);
        }
        let full = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&full[..chunk.len() - 1]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_length() {
        let data: Vec<u8> = (0..=255u8).rev().collect();
        for len in 0..40 {
            let enc = encode(&data[..len]);
            assert_eq!(enc.len() % 4, 0);
            assert_eq!(decode(&enc).unwrap(), &data[..len]);
            assert_eq!(decode(enc.trim_end_matches('=')).unwrap(), &data[..len]);
        }
        assert_eq!(encode(b"foo"), "Zm9v");
        assert_eq!(encode(b"fo"), "Zm8=");
        assert_eq!(encode(&[0xff, 0x00]), "/wA=");
    }

    #[test]
    fn rejects_bad_input() {
        assert!(decode("Zm9v!").is_err());
        assert!(decode("Z").is_err());
        assert!(decode("Zm=v").is_err());
        assert!(decode("Zm9v====").is_err());
    }
}
