//! The connection handshake: pure encoders and decoders (no I/O, never panic on garbage).
//!
//! ```text
//! acceptor  -> connector  Challenge { acceptor rank, nonce_a }
//! connector -> acceptor   Hello     { rank, fingerprint, nonce_c, proof_c, channel name }
//! acceptor  -> connector  Reply     { status, rank, fingerprint, proof_a }
//! ```
//!
//! `proof_c = secret.proof(b"mad-tcp-connect", nonce_a, nonce_c, context)` and
//! `proof_a = secret.proof(b"mad-tcp-accept", nonce_a, nonce_c, context)`, where
//! [`context`] binds the channel name and both ranks. All integers are little-endian.
//!
//! | message | layout |
//! |---|---|
//! | Challenge (26 B) | `b"MTCP"`, kind 0, version, acceptor rank u32, nonce_a 16 B |
//! | Hello (68 B + name) | `b"MTCP"`, kind 1, version, name length u16, rank u32, fingerprint u64, nonce_c 16 B, proof 32 B, name |
//! | Reply (51 B) | `b"MTCP"`, kind 2, version, status u8, rank u32, fingerprint u64, proof 32 B |

use mad_core::auth::{NONCE_LEN, PROOF_LEN};

/// Magic bytes that start every handshake message.
pub const MAGIC: [u8; 4] = *b"MTCP";
/// Handshake protocol version.
pub const VERSION: u8 = 1;
/// Length of a [`Challenge`].
pub const CHALLENGE_LEN: usize = 26;
/// Length of the fixed part of a [`Hello`] (the channel name follows).
pub const HELLO_FIXED_LEN: usize = 68;
/// Length of a [`Reply`].
pub const REPLY_LEN: usize = 51;
/// Longest channel name accepted in a hello.
pub const MAX_NAME_LEN: usize = 1024;

const KIND_CHALLENGE: u8 = 0;
const KIND_HELLO: u8 = 1;
const KIND_REPLY: u8 = 2;

/// Acceptor's first message: who it is and a fresh nonce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The acceptor's rank.
    pub rank: u32,
    /// Fresh acceptor nonce.
    pub nonce_a: [u8; NONCE_LEN],
}

/// Connector's answer: its identity and proof of the session secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The connector's rank.
    pub rank: u32,
    /// The connector's TM-table fingerprint.
    pub fingerprint: u64,
    /// Fresh connector nonce.
    pub nonce_c: [u8; NONCE_LEN],
    /// `proof(b"mad-tcp-connect", nonce_a, nonce_c, context)`.
    pub proof: [u8; PROOF_LEN],
    /// The channel the connector wants.
    pub channel: String,
}

/// Status carried by a [`Reply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Accepted.
    Ok = 0,
    /// Authenticated, but the TM tables differ: both ends fail the open.
    FingerprintMismatch = 1,
}

/// Acceptor's answer to an authenticated hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// Accepted or not.
    pub status: Status,
    /// The acceptor's rank.
    pub rank: u32,
    /// The acceptor's TM-table fingerprint.
    pub fingerprint: u64,
    /// `proof(b"mad-tcp-accept", nonce_a, nonce_c, context)`.
    pub proof: [u8; PROOF_LEN],
}

/// The context both proofs are bound to: channel name, connector rank, acceptor rank.
pub fn context(channel: &str, connector: u32, acceptor: u32) -> Vec<u8> {
    let mut c = Vec::with_capacity(channel.len() + 8);
    c.extend_from_slice(channel.as_bytes());
    c.extend_from_slice(&connector.to_le_bytes());
    c.extend_from_slice(&acceptor.to_le_bytes());
    c
}

/// What is wrong with bytes that should be a handshake message (the handshake layer's error;
/// the acceptor logs it and refuses the connection, the connector reports it as
/// `Error::Protocol`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Fewer bytes than the message's head.
    #[error("{what} too short ({got} bytes)")]
    TooShort {
        /// `"challenge"`, `"hello"` or `"reply"`.
        what: &'static str,
        /// Bytes given.
        got: usize,
    },
    /// Not the mad-tcp magic: another protocol.
    #[error("not a mad-tcp {what} (bad magic {got:02x?})")]
    Magic {
        /// The message expected.
        what: &'static str,
        /// The first four bytes.
        got: [u8; 4],
    },
    /// Another kind of message than the one expected at this step.
    #[error("expected a {what}, got message kind {got}")]
    Kind {
        /// The message expected.
        what: &'static str,
        /// The kind byte found.
        got: u8,
    },
    /// A protocol version this side does not speak.
    #[error("{what} version {got} (this side speaks {VERSION})")]
    Version {
        /// The message.
        what: &'static str,
        /// The version byte found.
        got: u8,
    },
    /// The message's length is not what its kind (or its own header) says.
    #[error("{what} is {got} bytes, expected {want}")]
    Length {
        /// The message.
        what: &'static str,
        /// Bytes given.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// A channel name longer than [`MAX_NAME_LEN`] (announced, or given to the encoder).
    #[error("channel name of {0} bytes (at most {MAX_NAME_LEN})")]
    NameTooLong(usize),
    /// A channel name that is not UTF-8.
    #[error("channel name is not UTF-8")]
    NameNotUtf8,
    /// A reply status this side does not know.
    #[error("unknown reply status {0}")]
    Status(u8),
}

fn check_head(b: &[u8], kind: u8, what: &'static str) -> Result<(), HandshakeError> {
    if b.len() < 6 {
        return Err(HandshakeError::TooShort { what, got: b.len() });
    }
    if b[0..4] != MAGIC {
        return Err(HandshakeError::Magic {
            what,
            got: arr(b, 0),
        });
    }
    if b[4] != kind {
        return Err(HandshakeError::Kind { what, got: b[4] });
    }
    if b[5] != VERSION {
        return Err(HandshakeError::Version { what, got: b[5] });
    }
    Ok(())
}

fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(s) = b.get(at..at + N) {
        out.copy_from_slice(s);
    }
    out
}

/// Encode a challenge.
pub fn encode_challenge(c: &Challenge) -> [u8; CHALLENGE_LEN] {
    let mut b = [0u8; CHALLENGE_LEN];
    b[0..4].copy_from_slice(&MAGIC);
    b[4] = KIND_CHALLENGE;
    b[5] = VERSION;
    b[6..10].copy_from_slice(&c.rank.to_le_bytes());
    b[10..26].copy_from_slice(&c.nonce_a);
    b
}

/// Decode a challenge.
///
/// # Errors
///
/// A [`HandshakeError`] saying what is wrong: too short, another protocol's magic, an unexpected
/// kind, another version, a field out of range.
pub fn decode_challenge(b: &[u8]) -> Result<Challenge, HandshakeError> {
    check_head(b, KIND_CHALLENGE, "challenge")?;
    if b.len() != CHALLENGE_LEN {
        return Err(HandshakeError::Length {
            what: "challenge",
            got: b.len(),
            want: CHALLENGE_LEN,
        });
    }
    Ok(Challenge {
        rank: u32::from_le_bytes(arr(b, 6)),
        nonce_a: arr(b, 10),
    })
}

/// Encode a hello (fails only if the channel name is longer than [`MAX_NAME_LEN`]).
///
/// # Errors
///
/// [`HandshakeError`] when the channel name is longer than [`MAX_NAME_LEN`].
pub fn encode_hello(h: &Hello) -> Result<Vec<u8>, HandshakeError> {
    let name = h.channel.as_bytes();
    if name.len() > MAX_NAME_LEN {
        return Err(HandshakeError::NameTooLong(name.len()));
    }
    let mut b = Vec::with_capacity(HELLO_FIXED_LEN + name.len());
    b.extend_from_slice(&MAGIC);
    b.push(KIND_HELLO);
    b.push(VERSION);
    b.extend_from_slice(&(name.len() as u16).to_le_bytes());
    b.extend_from_slice(&h.rank.to_le_bytes());
    b.extend_from_slice(&h.fingerprint.to_le_bytes());
    b.extend_from_slice(&h.nonce_c);
    b.extend_from_slice(&h.proof);
    b.extend_from_slice(name);
    Ok(b)
}

/// Bytes of a message's head (magic, kind, version), checkable before the rest arrives.
pub const HEAD_LEN: usize = 6;

/// Check the head of a hello (its first [`HEAD_LEN`] bytes): a stranger speaking another
/// protocol is refused as soon as these bytes are in, not at the handshake timeout.
///
/// # Errors
///
/// A [`HandshakeError`] saying what is wrong: too short, another protocol's magic, an unexpected
/// kind, another version, a field out of range.
pub fn check_hello_head(head: &[u8]) -> Result<(), HandshakeError> {
    check_head(head, KIND_HELLO, "hello")
}

/// From the fixed part of a hello, the total length of the hello (fixed part + name).
///
/// # Errors
///
/// A [`HandshakeError`] saying what is wrong: too short, another protocol's magic, an unexpected
/// kind, another version, a field out of range.
pub fn hello_len(fixed: &[u8]) -> Result<usize, HandshakeError> {
    check_head(fixed, KIND_HELLO, "hello")?;
    if fixed.len() < HELLO_FIXED_LEN {
        return Err(HandshakeError::TooShort {
            what: "hello",
            got: fixed.len(),
        });
    }
    let n = u16::from_le_bytes(arr(fixed, 6)) as usize;
    if n > MAX_NAME_LEN {
        return Err(HandshakeError::NameTooLong(n));
    }
    Ok(HELLO_FIXED_LEN + n)
}

/// Decode a complete hello.
///
/// # Errors
///
/// A [`HandshakeError`] saying what is wrong: too short, another protocol's magic, an unexpected
/// kind, another version, a field out of range.
pub fn decode_hello(b: &[u8]) -> Result<Hello, HandshakeError> {
    let total = hello_len(b)?;
    if b.len() != total {
        return Err(HandshakeError::Length {
            what: "hello",
            got: b.len(),
            want: total,
        });
    }
    let channel = std::str::from_utf8(&b[HELLO_FIXED_LEN..])
        .map_err(|_| HandshakeError::NameNotUtf8)?
        .to_string();
    Ok(Hello {
        rank: u32::from_le_bytes(arr(b, 8)),
        fingerprint: u64::from_le_bytes(arr(b, 12)),
        nonce_c: arr(b, 20),
        proof: arr(b, 36),
        channel,
    })
}

/// Encode a reply.
pub fn encode_reply(r: &Reply) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    b[0..4].copy_from_slice(&MAGIC);
    b[4] = KIND_REPLY;
    b[5] = VERSION;
    b[6] = r.status as u8;
    b[7..11].copy_from_slice(&r.rank.to_le_bytes());
    b[11..19].copy_from_slice(&r.fingerprint.to_le_bytes());
    b[19..51].copy_from_slice(&r.proof);
    b
}

/// Decode a reply.
///
/// # Errors
///
/// A [`HandshakeError`] saying what is wrong: too short, another protocol's magic, an unexpected
/// kind, another version, a field out of range.
pub fn decode_reply(b: &[u8]) -> Result<Reply, HandshakeError> {
    check_head(b, KIND_REPLY, "reply")?;
    if b.len() != REPLY_LEN {
        return Err(HandshakeError::Length {
            what: "reply",
            got: b.len(),
            want: REPLY_LEN,
        });
    }
    let status = match b[6] {
        0 => Status::Ok,
        1 => Status::FingerprintMismatch,
        s => return Err(HandshakeError::Status(s)),
    };
    Ok(Reply {
        status,
        rank: u32::from_le_bytes(arr(b, 7)),
        fingerprint: u64::from_le_bytes(arr(b, 11)),
        proof: arr(b, 19),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips() {
        let c = Challenge {
            rank: 7,
            nonce_a: [3; NONCE_LEN],
        };
        assert_eq!(decode_challenge(&encode_challenge(&c)).unwrap(), c);
        let h = Hello {
            rank: 9,
            fingerprint: 0xdead_beef_0123_4567,
            nonce_c: [5; NONCE_LEN],
            proof: [6; PROOF_LEN],
            channel: "vidéo".into(),
        };
        let hb = encode_hello(&h).unwrap();
        assert_eq!(hello_len(&hb[..HELLO_FIXED_LEN]).unwrap(), hb.len());
        assert_eq!(decode_hello(&hb).unwrap(), h);
        let r = Reply {
            status: Status::FingerprintMismatch,
            rank: 1,
            fingerprint: 2,
            proof: [9; PROOF_LEN],
        };
        assert_eq!(decode_reply(&encode_reply(&r)).unwrap(), r);
        assert!(encode_hello(&Hello {
            channel: "x".repeat(MAX_NAME_LEN + 1),
            ..h
        })
        .is_err());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        // Every prefix, every single-byte corruption and a pseudo-random stream.
        let h = Hello {
            rank: 1,
            fingerprint: 2,
            nonce_c: [0; 16],
            proof: [0; 32],
            channel: "c".into(),
        };
        let hb = encode_hello(&h).unwrap();
        let cb = encode_challenge(&Challenge {
            rank: 0,
            nonce_a: [1; 16],
        });
        let rb = encode_reply(&Reply {
            status: Status::Ok,
            rank: 0,
            fingerprint: 0,
            proof: [0; 32],
        });
        for msg in [&hb[..], &cb[..], &rb[..]] {
            for n in 0..msg.len() {
                let _ = decode_hello(&msg[..n]);
                let _ = hello_len(&msg[..n]);
                let _ = decode_challenge(&msg[..n]);
                let _ = decode_reply(&msg[..n]);
            }
            for i in 0..msg.len() {
                for v in [0u8, 1, 2, 0x7f, 0xff] {
                    let mut m = msg.to_vec();
                    m[i] = v;
                    let _ = decode_hello(&m);
                    let _ = hello_len(&m);
                    let _ = decode_challenge(&m);
                    let _ = decode_reply(&m);
                }
            }
        }
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..400 {
            let mut m = Vec::with_capacity(len);
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                m.push(x as u8);
            }
            if len > 6 {
                m[..4].copy_from_slice(&MAGIC);
                m[5] = VERSION;
            }
            for k in 0..3 {
                if len > 6 {
                    m[4] = k;
                }
                let _ = decode_hello(&m);
                let _ = hello_len(&m);
                let _ = decode_challenge(&m);
                let _ = decode_reply(&m);
            }
        }
        assert!(decode_hello(&hb[..hb.len() - 1]).is_err());
        assert!(decode_challenge(b"MTCP").is_err());
    }

    #[test]
    fn errors_are_typed() {
        let c = encode_challenge(&Challenge {
            rank: 1,
            nonce_a: [0; NONCE_LEN],
        });
        assert_eq!(
            decode_challenge(&c[..3]),
            Err(HandshakeError::TooShort {
                what: "challenge",
                got: 3
            })
        );
        assert_eq!(
            decode_challenge(b"GET / HTTP/1.1\r\n\r\n\0\0\0\0\0\0\0\0"),
            Err(HandshakeError::Magic {
                what: "challenge",
                got: *b"GET "
            })
        );
        assert_eq!(
            decode_reply(&c),
            Err(HandshakeError::Kind {
                what: "reply",
                got: KIND_CHALLENGE
            })
        );
        let mut v = c;
        v[5] = 99;
        assert_eq!(
            decode_challenge(&v),
            Err(HandshakeError::Version {
                what: "challenge",
                got: 99
            })
        );
        assert!(matches!(
            decode_challenge(&[&c[..], &[0]].concat()),
            Err(HandshakeError::Length {
                what: "challenge",
                ..
            })
        ));
        let long = Hello {
            rank: 1,
            fingerprint: 0,
            nonce_c: [0; NONCE_LEN],
            proof: [0; PROOF_LEN],
            channel: "x".repeat(MAX_NAME_LEN + 1),
        };
        assert_eq!(
            encode_hello(&long),
            Err(HandshakeError::NameTooLong(MAX_NAME_LEN + 1))
        );
        let mut h = encode_hello(&Hello {
            channel: "ok".into(),
            ..long
        })
        .unwrap();
        let n = h.len();
        h[n - 1] = 0xff;
        assert_eq!(decode_hello(&h), Err(HandshakeError::NameNotUtf8));
        let mut r = encode_reply(&Reply {
            status: Status::Ok,
            rank: 0,
            fingerprint: 0,
            proof: [0; PROOF_LEN],
        });
        r[6] = 7;
        assert_eq!(decode_reply(&r), Err(HandshakeError::Status(7)));
    }
}
