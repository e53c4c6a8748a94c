//! Static keys, session ids and their text forms.
//!
//! Spec: `docs/PROTOCOL.md` §4.1 (identities). Keys are X25519; a server always
//! has one, a client has one too (generated per run when it has no file), and a
//! public key is shown as 64 lowercase hex characters.

use std::fmt;
use std::str::FromStr;

/// An X25519 public key identifying a server or a client.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; 32]);

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl FromStr for PublicKey {
    type Err = KeyParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_hex::<32>(s.trim()).map(Self)
    }
}

/// A text key or id was not the expected number of hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyParseError {
    /// How many bytes the text should have encoded.
    pub expected_bytes: usize,
}

impl fmt::Display for KeyParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expected {} hex digits", self.expected_bytes * 2)
    }
}

impl std::error::Error for KeyParseError {}

/// A static key pair. The private half never leaves this struct except through
/// [`Keypair::private_bytes`], for saving it to a key file.
#[derive(Clone)]
pub struct Keypair {
    private: [u8; 32],
    public: PublicKey,
}

impl fmt::Debug for Keypair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Keypair {{ public: {}, private: <redacted> }}",
            self.public
        )
    }
}

impl Keypair {
    /// A fresh key pair from the operating system's random source.
    pub fn generate() -> Result<Self, crate::Error> {
        let mut private = [0u8; 32];
        crate::random_bytes(&mut private)?;
        Ok(Self::from_private(private))
    }

    /// The key pair whose private half is `private` (the public half is derived).
    pub fn from_private(private: [u8; 32]) -> Self {
        let public = PublicKey(crate::suite::public_key(private));
        Self { private, public }
    }

    /// The public half.
    pub fn public(&self) -> PublicKey {
        self.public
    }

    /// The private half, for writing a key file. Keep it secret.
    pub fn private_bytes(&self) -> [u8; 32] {
        self.private
    }
}

/// Names a session on its server. Not secret: it travels in clear in a resume
/// preamble (§4.4); the resume secret is what proves ownership.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub [u8; 16]);

impl SessionId {
    /// A random id.
    pub fn random() -> Result<Self, crate::Error> {
        let mut b = [0u8; 16];
        crate::random_bytes(&mut b)?;
        Ok(Self(b))
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({self})")
    }
}

impl FromStr for SessionId {
    type Err = KeyParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_hex::<16>(s.trim()).map(Self)
    }
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for b in bytes {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

fn parse_hex<const N: usize>(s: &str) -> Result<[u8; N], KeyParseError> {
    let err = KeyParseError { expected_bytes: N };
    if s.len() != N * 2 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(err);
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[i * 2..i * 2 + 2], 16).map_err(|_| err.clone())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_key_text_round_trips_and_rejects_garbage() {
        let kp = Keypair::generate().unwrap();
        let text = kp.public().to_string();
        assert_eq!(text.len(), 64);
        assert_eq!(text.parse::<PublicKey>().unwrap(), kp.public());
        assert!("abc".parse::<PublicKey>().is_err());
        assert!("zz".repeat(32).parse::<PublicKey>().is_err());
        assert!(format!("+{}", &text[1..]).parse::<PublicKey>().is_err());
    }

    #[test]
    fn public_half_is_derived_from_private() {
        let kp = Keypair::generate().unwrap();
        assert_eq!(
            Keypair::from_private(kp.private_bytes()).public(),
            kp.public()
        );
        assert!(!format!("{kp:?}").contains(&hex::encode(kp.private_bytes())));
    }
}
