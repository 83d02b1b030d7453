//! Session secret and the challenge-response every connection uses to prove membership.
//!
//! The secret never crosses the wire: the acceptor sends a random nonce, the connector answers
//! with `HMAC-SHA256(secret, label || nonce_a || nonce_c || context)`, and the acceptor answers
//! back with the mirror MAC, so both ends prove knowledge of the secret. A replayed answer is
//! useless because the acceptor's nonce is fresh for every connection.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// Length of a secret, in bytes.
pub const SECRET_LEN: usize = 32;
/// Length of a nonce, in bytes.
pub const NONCE_LEN: usize = 16;
/// Length of a proof (an HMAC-SHA256 tag), in bytes.
pub const PROOF_LEN: usize = 32;

/// A per-session secret shared by every process of the session.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; SECRET_LEN]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A fresh random secret (from the operating system's generator).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the operating system's random generator fails.
    pub fn random() -> Result<Self> {
        let mut b = [0u8; SECRET_LEN];
        fill_random(&mut b)?;
        Ok(Secret(b))
    }

    /// Build from raw bytes.
    pub fn from_bytes(b: [u8; SECRET_LEN]) -> Self {
        Secret(b)
    }

    /// Parse the hexadecimal form used in the `MAD_SECRET` environment variable.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] when `s` is not the hexadecimal form of a
    /// secret of the right length.
    pub fn from_hex(s: &str) -> Result<Self> {
        let s = s.trim();
        if s.len() != SECRET_LEN * 2 {
            return Err(Error::BadConfig(format!(
                "session secret must be {} hex digits, got {}",
                SECRET_LEN * 2,
                s.len()
            )));
        }
        let mut b = [0u8; SECRET_LEN];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|_| Error::BadConfig("session secret is not hexadecimal".into()))?;
        }
        Ok(Secret(b))
    }

    /// The hexadecimal form.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The MAC proving knowledge of the secret for this exchange.
    ///
    /// `label` distinguishes the two directions (and protocols), `context` binds the proof to
    /// what the connection is for (channel name, ranks).
    ///
    /// # Panics
    ///
    /// Never: HMAC takes a key of any length.
    pub fn proof(
        &self,
        label: &[u8],
        nonce_a: &[u8],
        nonce_c: &[u8],
        context: &[u8],
    ) -> [u8; PROOF_LEN] {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for part in [label, nonce_a, nonce_c, context] {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }

    /// Check a proof in constant time.
    ///
    /// # Panics
    ///
    /// Never: HMAC takes a key of any length.
    pub fn verify(
        &self,
        label: &[u8],
        nonce_a: &[u8],
        nonce_c: &[u8],
        context: &[u8],
        proof: &[u8],
    ) -> bool {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for part in [label, nonce_a, nonce_c, context] {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac.verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce.
///
/// # Errors
///
/// [`Error::Io`] when the operating system's random generator fails.
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut b = [0u8; NONCE_LEN];
    fill_random(&mut b)?;
    Ok(b)
}

/// Fill `buf` from the operating system's random generator.
///
/// # Errors
///
/// [`Error::Io`] when the operating system's random generator fails.
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    let mut f =
        std::fs::File::open("/dev/urandom").map_err(|e| Error::io("opening /dev/urandom", e))?;
    f.read_exact(buf)
        .map_err(|e| Error::io("reading /dev/urandom", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proof_roundtrip_and_rejection() {
        let s = Secret::random().unwrap();
        let other = Secret::random().unwrap();
        let (a, c) = (nonce().unwrap(), nonce().unwrap());
        let p = s.proof(b"conn", &a, &c, b"chan");
        assert!(s.verify(b"conn", &a, &c, b"chan", &p));
        assert!(!other.verify(b"conn", &a, &c, b"chan", &p));
        assert!(!s.verify(b"acc", &a, &c, b"chan", &p));
        assert!(!s.verify(b"conn", &c, &a, b"chan", &p));
        assert!(!s.verify(b"conn", &a, &c, b"chan", &p[..31]));
    }

    #[test]
    fn hex_roundtrip_and_errors() {
        let s = Secret::random().unwrap();
        assert_eq!(Secret::from_hex(&s.to_hex()).unwrap(), s);
        assert!(Secret::from_hex("abc").is_err());
        assert!(Secret::from_hex(&"zz".repeat(32)).is_err());
    }
}
