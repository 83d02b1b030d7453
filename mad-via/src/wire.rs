//! The soft NIC's wire format: frames and the connection handshake record.
//!
//! Everything here is a pure function over byte slices: no I/O, no allocation on the decode
//! path, and no panic on any input (the decoders are meant to be fuzzed). A frame is a 24-byte
//! header followed by `len` payload bytes:
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0 | kind | [`Kind`] |
//! | 1 | flags | [`FLAG_LAST`] on the last frame of a medium send or RDMA write |
//! | 2..4 | credits | small-TM credits returned to the peer (piggybacked on every frame) |
//! | 4..8 | len | payload length |
//! | 8..12 | key | memory key (RDMA write, CTS) or error code |
//! | 12..16 | reserved | zero |
//! | 16..24 | addr | remote address (RDMA write, CTS) |
//!
//! All integers are little-endian.

/// Size of a frame header.
pub const HEADER_LEN: usize = 24;
/// Largest payload a frame may carry (medium sends and RDMA writes are cut in frames this size).
pub const MAX_PAYLOAD: usize = 256 * 1024;
/// Largest error message carried by an [`Frame::Error`].
pub const MAX_ERROR_MSG: usize = 1024;
/// Flag: last frame of a medium send / RDMA write (the write "with completion").
pub const FLAG_LAST: u8 = 1;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Small-TM send into a pre-posted static receive buffer (consumes one credit).
    Small = 1,
    /// Medium-TM send into the receiver's posted (registered on the fly) user buffer.
    Medium = 2,
    /// RDMA write into memory the receiver registered and advertised.
    RdmaWrite = 3,
    /// Clear-to-send: the receiver advertises a registered destination (key, address, length).
    Cts = 4,
    /// Explicit credit return (no payload).
    Credit = 5,
    /// The sender of this frame detected an error; the connection is dead.
    Error = 6,
}

/// A decoded frame, borrowing its payload from the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A small send.
    Small {
        /// Piggybacked credits.
        credits: u16,
        /// Payload.
        data: &'a [u8],
    },
    /// A medium send fragment.
    Medium {
        /// Piggybacked credits.
        credits: u16,
        /// Last fragment of the group.
        last: bool,
        /// Payload.
        data: &'a [u8],
    },
    /// An RDMA write fragment.
    RdmaWrite {
        /// Piggybacked credits.
        credits: u16,
        /// Remote key.
        key: u32,
        /// Remote address of the first payload byte.
        addr: u64,
        /// Last fragment: the write is complete.
        last: bool,
        /// Payload.
        data: &'a [u8],
    },
    /// Clear to send.
    Cts {
        /// Piggybacked credits.
        credits: u16,
        /// Key of the advertised region.
        key: u32,
        /// Base address of the region.
        addr: u64,
        /// Length of the region.
        len: u64,
    },
    /// Credit return.
    Credit {
        /// Credits returned.
        credits: u16,
    },
    /// Error report.
    Error {
        /// Piggybacked credits.
        credits: u16,
        /// Error code ([`ERR_ACCESS`], [`ERR_PROTOCOL`]).
        code: u32,
        /// Human-readable cause (lossy UTF-8).
        msg: &'a [u8],
    },
}

/// Error code: remote access error (bad key, out of bounds).
pub const ERR_ACCESS: u32 = 1;
/// Error code: protocol violation.
pub const ERR_PROTOCOL: u32 = 2;

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError(pub String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut x = [0u8; 2];
    x.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(x)
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// A validated frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// Flags.
    pub flags: u8,
    /// Piggybacked credits.
    pub credits: u16,
    /// Payload length.
    pub len: u32,
    /// Key or error code.
    pub key: u32,
    /// Address.
    pub addr: u64,
}

impl Header {
    /// A header with no key/address.
    pub fn new(kind: Kind, flags: u8, credits: u16, len: usize) -> Self {
        Header {
            kind,
            flags,
            credits,
            len: len as u32,
            key: 0,
            addr: 0,
        }
    }

    /// Encode.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = self.kind as u8;
        h[1] = self.flags;
        h[2..4].copy_from_slice(&self.credits.to_le_bytes());
        h[4..8].copy_from_slice(&self.len.to_le_bytes());
        h[8..12].copy_from_slice(&self.key.to_le_bytes());
        h[16..24].copy_from_slice(&self.addr.to_le_bytes());
        h
    }

    /// Decode and validate a header (the first [`HEADER_LEN`] bytes of `b`).
    ///
    /// `Ok(None)`: not enough bytes yet.
    pub fn decode(b: &[u8]) -> Result<Option<Header>, WireError> {
        if b.len() < HEADER_LEN {
            return Ok(None);
        }
        let kind = match b[0] {
            1 => Kind::Small,
            2 => Kind::Medium,
            3 => Kind::RdmaWrite,
            4 => Kind::Cts,
            5 => Kind::Credit,
            6 => Kind::Error,
            k => return Err(WireError(format!("unknown frame kind {k}"))),
        };
        let flags = b[1];
        if flags & !FLAG_LAST != 0 {
            return Err(WireError(format!("unknown frame flags {flags:#x}")));
        }
        if u32_at(b, 12) != 0 {
            return Err(WireError("reserved header field is not zero".into()));
        }
        let h = Header {
            kind,
            flags,
            credits: u16_at(b, 2),
            len: u32_at(b, 4),
            key: u32_at(b, 8),
            addr: u64_at(b, 16),
        };
        let len = h.len as usize;
        let ok = match kind {
            Kind::Small | Kind::Medium | Kind::RdmaWrite => len <= MAX_PAYLOAD,
            Kind::Cts => len == 8,
            Kind::Credit => len == 0,
            Kind::Error => len <= MAX_ERROR_MSG,
        };
        if !ok {
            return Err(WireError(format!(
                "{kind:?} frame with bad payload length {len}"
            )));
        }
        if flags != 0 && !matches!(kind, Kind::Medium | Kind::RdmaWrite) {
            return Err(WireError(format!("{kind:?} frame with flags {flags:#x}")));
        }
        if kind == Kind::RdmaWrite && h.addr.checked_add(h.len as u64).is_none() {
            return Err(WireError("RDMA write address range overflows".into()));
        }
        Ok(Some(h))
    }
}

/// Decode one frame from the start of `b`.
///
/// `Ok(None)`: the frame is not complete yet. `Ok(Some((frame, used)))`: `used` bytes form the
/// frame. Never panics, whatever `b` holds.
pub fn decode_frame(b: &[u8]) -> Result<Option<(Frame<'_>, usize)>, WireError> {
    let Some(h) = Header::decode(b)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + h.len as usize;
    if b.len() < total {
        return Ok(None);
    }
    let data = &b[HEADER_LEN..total];
    let last = h.flags & FLAG_LAST != 0;
    let f = match h.kind {
        Kind::Small => Frame::Small {
            credits: h.credits,
            data,
        },
        Kind::Medium => Frame::Medium {
            credits: h.credits,
            last,
            data,
        },
        Kind::RdmaWrite => Frame::RdmaWrite {
            credits: h.credits,
            key: h.key,
            addr: h.addr,
            last,
            data,
        },
        Kind::Cts => {
            let len = u64_at(data, 0);
            if h.addr.checked_add(len).is_none() {
                return Err(WireError("CTS region overflows the address space".into()));
            }
            Frame::Cts {
                credits: h.credits,
                key: h.key,
                addr: h.addr,
                len,
            }
        }
        Kind::Credit => Frame::Credit { credits: h.credits },
        Kind::Error => Frame::Error {
            credits: h.credits,
            code: h.key,
            msg: data,
        },
    };
    Ok(Some((f, total)))
}

/// Encode a control frame (CTS, credit, error) into `out`.
pub fn encode_cts(out: &mut Vec<u8>, credits: u16, key: u32, addr: u64, len: u64) {
    let mut h = Header::new(Kind::Cts, 0, credits, 8);
    h.key = key;
    h.addr = addr;
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(&len.to_le_bytes());
}

/// Encode an explicit credit return.
pub fn encode_credit(out: &mut Vec<u8>, credits: u16) {
    out.extend_from_slice(&Header::new(Kind::Credit, 0, credits, 0).encode());
}

/// Encode an error report (the message is truncated to [`MAX_ERROR_MSG`] bytes).
pub fn encode_error(out: &mut Vec<u8>, credits: u16, code: u32, msg: &str) {
    let m = &msg.as_bytes()[..msg.len().min(MAX_ERROR_MSG)];
    let mut h = Header::new(Kind::Error, 0, credits, m.len());
    h.key = code;
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(m);
}

/// Magic that opens every handshake record.
pub const HELLO_MAGIC: [u8; 8] = *b"MADVIA01";
/// Length of a handshake record.
pub const HELLO_LEN: usize = 8 + 4 + 4 + 8 + 4 + 4 + 16 + 32;

/// The connection handshake record (both directions use the same layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Sender's rank.
    pub rank: u32,
    /// Session size as the sender sees it.
    pub size: u32,
    /// TM table fingerprint.
    pub fingerprint: u64,
    /// Number of small-TM receive slots (credits granted to the peer).
    pub slots: u32,
    /// Size of one slot.
    pub slot_size: u32,
    /// Fresh nonce.
    pub nonce: [u8; 16],
    /// HMAC proof (zero in the acceptor's first record).
    pub proof: [u8; 32],
}

impl Hello {
    /// Encode.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC);
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..24].copy_from_slice(&self.fingerprint.to_le_bytes());
        b[24..28].copy_from_slice(&self.slots.to_le_bytes());
        b[28..32].copy_from_slice(&self.slot_size.to_le_bytes());
        b[32..48].copy_from_slice(&self.nonce);
        b[48..80].copy_from_slice(&self.proof);
        b
    }

    /// Decode; never panics.
    pub fn decode(b: &[u8]) -> Result<Hello, WireError> {
        if b.len() != HELLO_LEN {
            return Err(WireError(format!(
                "handshake record of {} bytes, expected {HELLO_LEN}",
                b.len()
            )));
        }
        if b[0..8] != HELLO_MAGIC {
            return Err(WireError("handshake does not start with MADVIA01".into()));
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[32..48]);
        let mut proof = [0u8; 32];
        proof.copy_from_slice(&b[48..80]);
        Ok(Hello {
            rank: u32_at(b, 8),
            size: u32_at(b, 12),
            fingerprint: u64_at(b, 16),
            slots: u32_at(b, 24),
            slot_size: u32_at(b, 28),
            nonce,
            proof,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_frames() {
        let mut out = Vec::new();
        encode_cts(&mut out, 3, 77, 0x1000, 4096);
        encode_credit(&mut out, 9);
        encode_error(&mut out, 0, ERR_ACCESS, "bad key");
        let mut h = Header::new(Kind::RdmaWrite, FLAG_LAST, 1, 3);
        h.key = 5;
        h.addr = 0x2000;
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(b"abc");
        let mut at = 0;
        let mut frames = Vec::new();
        while let Some((f, used)) = decode_frame(&out[at..]).unwrap() {
            frames.push(f);
            at += used;
        }
        assert_eq!(at, out.len());
        assert_eq!(
            frames,
            vec![
                Frame::Cts {
                    credits: 3,
                    key: 77,
                    addr: 0x1000,
                    len: 4096
                },
                Frame::Credit { credits: 9 },
                Frame::Error {
                    credits: 0,
                    code: ERR_ACCESS,
                    msg: b"bad key"
                },
                Frame::RdmaWrite {
                    credits: 1,
                    key: 5,
                    addr: 0x2000,
                    last: true,
                    data: b"abc"
                },
            ]
        );
    }

    #[test]
    fn partial_and_garbage() {
        let mut out = Vec::new();
        encode_cts(&mut out, 0, 1, 2, 3);
        for cut in 0..out.len() {
            assert_eq!(decode_frame(&out[..cut]).unwrap(), None);
        }
        assert!(decode_frame(&[0u8; 24]).is_err());
        let mut bad = Header::new(Kind::Small, 0, 0, MAX_PAYLOAD + 1).encode();
        assert!(decode_frame(&bad).is_err());
        bad = Header::new(Kind::Credit, FLAG_LAST, 0, 0).encode();
        assert!(decode_frame(&bad).is_err());
        let mut h = Header::new(Kind::RdmaWrite, 0, 0, 10);
        h.addr = u64::MAX - 3;
        assert!(decode_frame(&h.encode()).is_err());
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "too long under Miri; the fuzz target covers it natively"
    )]
    fn pseudo_random_garbage_never_panics() {
        // A small deterministic fuzz loop (xorshift); the real fuzzing uses the same entry points.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut buf = [0u8; 96];
        for _ in 0..20_000 {
            for b in buf.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            buf[0] %= 8;
            buf[12..16].fill(0);
            let n = (x as usize) % buf.len();
            let _ = decode_frame(&buf[..n]);
            let _ = Hello::decode(&buf[..n]);
            let _ = Hello::decode(&buf[..HELLO_LEN]);
        }
    }

    #[test]
    fn hello_roundtrip() {
        let h = Hello {
            rank: 3,
            size: 4,
            fingerprint: 0xdead_beef,
            slots: 32,
            slot_size: 8192,
            nonce: [1; 16],
            proof: [2; 32],
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&[0; HELLO_LEN]).is_err());
        assert!(Hello::decode(&[0; 3]).is_err());
    }
}
