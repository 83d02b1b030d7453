//! Byte formats: the soft NIC's frames and handshake record, and the protocol's records that
//! travel inside work requests (immediate data, the CTS record, the channel address record).
//!
//! Everything here is a pure function over byte slices: no I/O, no allocation on the decode
//! path, and no panic on any input (the decoders are meant to be fuzzed).
//!
//! # Soft NIC frames
//!
//! Each queue pair of a soft connection is one socket; a work request is one frame: a 24-byte
//! header followed by `len` payload bytes.
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0 | kind | [`Kind`] |
//! | 1 | flags | [`FLAG_IMM`]: `imm` is immediate data |
//! | 2..4 | reserved | zero |
//! | 4..8 | len | payload length |
//! | 8..12 | key | remote key (RDMA write) or error code |
//! | 12..16 | imm | immediate data (with [`FLAG_IMM`]) |
//! | 16..24 | addr | remote address (RDMA write) |
//!
//! All integers are little-endian.

/// Size of a frame header.
pub const HEADER_LEN: usize = 24;
/// Largest payload a frame may carry: the largest send or RDMA write of one soft work
/// request (the protocol cuts larger transfers into requests this size).
pub const MAX_PAYLOAD: usize = 256 * 1024;
/// Largest error message carried by an [`Frame::Error`].
pub const MAX_ERROR_MSG: usize = 1024;
/// Flag: the frame carries immediate data.
pub const FLAG_IMM: u8 = 1;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A send: lands in the receiver's next posted receive of this queue pair.
    Send = 1,
    /// An RDMA write into memory the receiver registered and advertised (with immediate: also
    /// consumes the next posted receive).
    Write = 2,
    /// The sender of this frame detected an error; the connection is dead.
    Error = 3,
}

/// A decoded frame, borrowing its payload from the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A send.
    Send {
        /// Immediate data.
        imm: Option<u32>,
        /// Payload.
        data: &'a [u8],
    },
    /// An RDMA write.
    Write {
        /// Remote key.
        key: u32,
        /// Remote address of the first payload byte.
        addr: u64,
        /// Immediate data.
        imm: Option<u32>,
        /// Payload.
        data: &'a [u8],
    },
    /// Error report.
    Error {
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

/// Why bytes are not a valid record.
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
    /// Payload length.
    pub len: u32,
    /// Key or error code.
    pub key: u32,
    /// Immediate data.
    pub imm: Option<u32>,
    /// Address.
    pub addr: u64,
}

impl Header {
    /// A send header.
    pub fn send(len: usize, imm: Option<u32>) -> Self {
        Header {
            kind: Kind::Send,
            len: len as u32,
            key: 0,
            imm,
            addr: 0,
        }
    }

    /// An RDMA write header.
    pub fn write(len: usize, key: u32, addr: u64, imm: Option<u32>) -> Self {
        Header {
            kind: Kind::Write,
            len: len as u32,
            key,
            imm,
            addr,
        }
    }

    /// Encode.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = self.kind as u8;
        h[1] = if self.imm.is_some() { FLAG_IMM } else { 0 };
        h[4..8].copy_from_slice(&self.len.to_le_bytes());
        h[8..12].copy_from_slice(&self.key.to_le_bytes());
        h[12..16].copy_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        h[16..24].copy_from_slice(&self.addr.to_le_bytes());
        h
    }

    /// Decode and validate a header (the first [`HEADER_LEN`] bytes of `b`).
    ///
    /// `Ok(None)`: not enough bytes yet.
    ///
    /// # Errors
    ///
    /// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
    /// range).
    pub fn decode(b: &[u8]) -> Result<Option<Header>, WireError> {
        if b.len() < HEADER_LEN {
            return Ok(None);
        }
        let kind = match b[0] {
            1 => Kind::Send,
            2 => Kind::Write,
            3 => Kind::Error,
            k => return Err(WireError(format!("unknown frame kind {k}"))),
        };
        let flags = b[1];
        if flags & !FLAG_IMM != 0 {
            return Err(WireError(format!("unknown frame flags {flags:#x}")));
        }
        if u16_at(b, 2) != 0 {
            return Err(WireError("reserved header field is not zero".into()));
        }
        let imm = (flags & FLAG_IMM != 0).then(|| u32_at(b, 12));
        if imm.is_none() && u32_at(b, 12) != 0 {
            return Err(WireError(
                "immediate data without the immediate flag".into(),
            ));
        }
        let h = Header {
            kind,
            len: u32_at(b, 4),
            key: u32_at(b, 8),
            imm,
            addr: u64_at(b, 16),
        };
        let len = h.len as usize;
        let ok = match kind {
            Kind::Send | Kind::Write => len <= MAX_PAYLOAD,
            Kind::Error => len <= MAX_ERROR_MSG,
        };
        if !ok {
            return Err(WireError(format!(
                "{kind:?} frame with bad payload length {len}"
            )));
        }
        match kind {
            Kind::Send if h.key != 0 || h.addr != 0 => {
                return Err(WireError("send frame with a key or an address".into()))
            }
            Kind::Error if imm.is_some() || h.addr != 0 => {
                return Err(WireError(
                    "error frame with immediate data or an address".into(),
                ))
            }
            Kind::Write if h.addr.checked_add(h.len as u64).is_none() => {
                return Err(WireError("RDMA write address range overflows".into()))
            }
            _ => {}
        }
        Ok(Some(h))
    }
}

/// Decode one frame from the start of `b`.
///
/// `Ok(None)`: the frame is not complete yet. `Ok(Some((frame, used)))`: `used` bytes form the
/// frame. Never panics, whatever `b` holds.
///
/// # Errors
///
/// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
/// range).
pub fn decode_frame(b: &[u8]) -> Result<Option<(Frame<'_>, usize)>, WireError> {
    let Some(h) = Header::decode(b)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + h.len as usize;
    if b.len() < total {
        return Ok(None);
    }
    let data = &b[HEADER_LEN..total];
    let f = match h.kind {
        Kind::Send => Frame::Send { imm: h.imm, data },
        Kind::Write => Frame::Write {
            key: h.key,
            addr: h.addr,
            imm: h.imm,
            data,
        },
        Kind::Error => Frame::Error {
            code: h.key,
            msg: data,
        },
    };
    Ok(Some((f, total)))
}

/// Encode an error report (the message is truncated to [`MAX_ERROR_MSG`] bytes).
pub fn encode_error(out: &mut Vec<u8>, code: u32, msg: &str) {
    let m = &msg.as_bytes()[..msg.len().min(MAX_ERROR_MSG)];
    let h = Header {
        kind: Kind::Error,
        len: m.len() as u32,
        key: code,
        imm: None,
        addr: 0,
    };
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(m);
}

/// Magic that opens every soft handshake record.
pub const HELLO_MAGIC: [u8; 8] = *b"MADVIA02";
/// Length of a handshake record.
pub const HELLO_LEN: usize = 8 + 4 + 4 + 8 + 4 + 4 + 16 + 32 + 4 + 4;

/// The soft connection handshake record (both directions use the same layout), one per
/// socket (queue pair).
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
    /// Queue pair this socket carries (0 control, 1 data).
    pub qp: u32,
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
        b[80..84].copy_from_slice(&self.qp.to_le_bytes());
        b
    }

    /// Check the magic (the first 8 bytes): a stranger speaking another protocol is refused
    /// as soon as they arrive.
    ///
    /// # Errors
    ///
    /// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
    /// range).
    pub fn check_magic(b: &[u8]) -> Result<(), WireError> {
        if b.len() < 8 || b[0..8] != HELLO_MAGIC {
            return Err(WireError(format!(
                "handshake does not start with MADVIA02 (got {:?})",
                String::from_utf8_lossy(&b[..b.len().min(8)])
            )));
        }
        Ok(())
    }

    /// Decode; never panics.
    ///
    /// # Errors
    ///
    /// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
    /// range).
    pub fn decode(b: &[u8]) -> Result<Hello, WireError> {
        if b.len() != HELLO_LEN {
            return Err(WireError(format!(
                "handshake record of {} bytes, expected {HELLO_LEN}",
                b.len()
            )));
        }
        Self::check_magic(b)?;
        if u32_at(b, 84) != 0 {
            return Err(WireError("reserved handshake field is not zero".into()));
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
            qp: u32_at(b, 80),
        })
    }
}

/// What a soft rank publishes through the session bootstrap: its listening address and,
/// for every rank, where that rank's connection keeps the credit word it may RDMA-write
/// (address and key), like the verbs backend's `ConnInfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftAddr {
    /// `ip:port` of the listener.
    pub sock: String,
    /// Per rank: (address, key) of the credit word of this rank's connection to it.
    pub credit_words: Vec<(u64, u32)>,
}

impl SoftAddr {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let s = self.sock.as_bytes();
        let mut v = Vec::with_capacity(6 + s.len() + 12 * self.credit_words.len());
        v.extend_from_slice(&(s.len() as u16).to_le_bytes());
        v.extend_from_slice(s);
        v.extend_from_slice(&(self.credit_words.len() as u32).to_le_bytes());
        for (a, k) in &self.credit_words {
            v.extend_from_slice(&a.to_le_bytes());
            v.extend_from_slice(&k.to_le_bytes());
        }
        v
    }

    /// Decode a record for a session of `size` ranks; never panics.
    ///
    /// # Errors
    ///
    /// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
    /// range).
    pub fn decode(b: &[u8], size: usize) -> Result<SoftAddr, WireError> {
        let bad = |w: &str| WireError(format!("soft address record: {w}"));
        if b.len() < 2 {
            return Err(bad("truncated"));
        }
        let n = u16_at(b, 0) as usize;
        let rest = &b[2..];
        if rest.len() < n + 4 {
            return Err(bad("truncated"));
        }
        let sock = std::str::from_utf8(&rest[..n])
            .map_err(|_| bad("address is not UTF-8"))?
            .to_string();
        let rest = &rest[n..];
        let count = u32_at(rest, 0) as usize;
        if count != size {
            return Err(bad(&format!("{count} ranks in a session of {size}")));
        }
        let rest = &rest[4..];
        if Some(rest.len()) != count.checked_mul(12) {
            return Err(bad("wrong length"));
        }
        let credit_words = rest
            .chunks_exact(12)
            .map(|c| (u64_at(c, 0), u32_at(c, 8)))
            .collect();
        Ok(SoftAddr { sock, credit_words })
    }
}

// ---- protocol records (the same on every provider) ----

/// Immediate data of a control-QP send: the record kind and the low 16 bits of the sender's
/// cumulative count of freed receive buffers (piggybacked credits).
pub fn encode_imm(kind: u8, freed: u32) -> u32 {
    (kind as u32) << 24 | (freed & 0xffff)
}

/// Split control-QP immediate data into (kind, freed low 16 bits); `Err` on unknown bits.
///
/// # Errors
///
/// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
/// range).
pub fn decode_imm(imm: u32) -> Result<(u8, u16), WireError> {
    if imm & 0x00ff_0000 != 0 {
        return Err(WireError(format!(
            "immediate {imm:#x} has reserved bits set"
        )));
    }
    Ok(((imm >> 24) as u8, imm as u16))
}

/// Control record kind: small-TM data.
pub const REC_DATA: u8 = 1;
/// Control record kind: clear to send (the rendezvous receiver's region).
pub const REC_CTS: u8 = 2;
/// Immediate of the last RDMA write of a rendezvous (the completion signal).
pub const IMM_WRITE_DONE: u32 = 0x4649_4e00;

/// Length of a CTS record.
pub const CTS_LEN: usize = 20;

/// A rendezvous receiver's advertisement: write `len` bytes at `addr` with `key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cts {
    /// Remote key.
    pub key: u32,
    /// Base address.
    pub addr: u64,
    /// Length.
    pub len: u64,
}

impl Cts {
    /// Encode into `b` (at least [`CTS_LEN`] bytes); returns the length.
    pub fn encode_into(&self, b: &mut [u8]) -> usize {
        b[0..4].copy_from_slice(&self.key.to_le_bytes());
        b[4..12].copy_from_slice(&self.addr.to_le_bytes());
        b[12..20].copy_from_slice(&self.len.to_le_bytes());
        CTS_LEN
    }

    /// Decode; never panics.
    ///
    /// # Errors
    ///
    /// A [`WireError`] saying what is wrong (short input, bad magic, unknown kind, a field out of
    /// range).
    pub fn decode(b: &[u8]) -> Result<Cts, WireError> {
        if b.len() != CTS_LEN {
            return Err(WireError(format!("CTS record of {} bytes", b.len())));
        }
        let c = Cts {
            key: u32_at(b, 0),
            addr: u64_at(b, 4),
            len: u64_at(b, 12),
        };
        if c.addr.checked_add(c.len).is_none() {
            return Err(WireError("CTS region overflows the address space".into()));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_frames() {
        let mut out = Vec::new();
        out.extend_from_slice(&Header::send(3, Some(encode_imm(REC_DATA, 9))).encode());
        out.extend_from_slice(b"xyz");
        encode_error(&mut out, ERR_ACCESS, "bad key");
        out.extend_from_slice(&Header::write(3, 5, 0x2000, Some(IMM_WRITE_DONE)).encode());
        out.extend_from_slice(b"abc");
        out.extend_from_slice(&Header::send(0, None).encode());
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
                Frame::Send {
                    imm: Some(encode_imm(REC_DATA, 9)),
                    data: b"xyz"
                },
                Frame::Error {
                    code: ERR_ACCESS,
                    msg: b"bad key"
                },
                Frame::Write {
                    key: 5,
                    addr: 0x2000,
                    imm: Some(IMM_WRITE_DONE),
                    data: b"abc"
                },
                Frame::Send {
                    imm: None,
                    data: b""
                },
            ]
        );
    }

    #[test]
    fn partial_and_garbage() {
        let mut out = Header::write(3, 1, 2, None).encode().to_vec();
        out.extend_from_slice(b"abc");
        for cut in 0..out.len() {
            assert_eq!(decode_frame(&out[..cut]).unwrap(), None);
        }
        assert!(decode_frame(&[0u8; 24]).is_err());
        let bad = Header::send(MAX_PAYLOAD + 1, None).encode();
        assert!(decode_frame(&bad).is_err());
        let mut bad = Header::send(0, None).encode();
        bad[12] = 1; // immediate without the flag
        assert!(decode_frame(&bad).is_err());
        assert!(decode_frame(&Header::write(10, 0, u64::MAX - 3, None).encode()).is_err());
        let mut e = Vec::new();
        encode_error(&mut e, 1, "x");
        e[1] = FLAG_IMM;
        assert!(decode_frame(&e).is_err());
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "too long under Miri; the fuzz target covers it natively"
    )]
    fn pseudo_random_garbage_never_panics() {
        // A small deterministic fuzz loop (xorshift); the real fuzzing uses the same entry points.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut buf = [0u8; 128];
        for _ in 0..20_000 {
            for b in buf.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            buf[0] %= 5;
            buf[1] &= 1;
            buf[2..4].fill(0);
            let n = (x as usize) % buf.len();
            let _ = decode_frame(&buf[..n]);
            let _ = Hello::decode(&buf[..n]);
            let _ = Hello::decode(&buf[..HELLO_LEN]);
            let _ = SoftAddr::decode(&buf[..n], (x as usize >> 8) % 4);
            let _ = Cts::decode(&buf[..n.min(CTS_LEN)]);
            let _ = decode_imm(x as u32);
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
            qp: 1,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(Hello::decode(&[0; HELLO_LEN]).is_err());
        assert!(Hello::decode(&[0; 3]).is_err());
        assert!(Hello::check_magic(b"GET / HTTP/1.0").is_err());
        assert!(Hello::check_magic(&h.encode()).is_ok());
    }

    #[test]
    fn records_roundtrip() {
        let a = SoftAddr {
            sock: "127.0.0.1:4000".into(),
            credit_words: vec![(0, 0), (0x7f00_1000, 77)],
        };
        assert_eq!(SoftAddr::decode(&a.encode(), 2).unwrap(), a);
        assert!(SoftAddr::decode(&a.encode(), 3).is_err());
        assert!(SoftAddr::decode(&a.encode()[..10], 2).is_err());
        let c = Cts {
            key: 1,
            addr: 2,
            len: 3,
        };
        let mut b = [0u8; CTS_LEN];
        c.encode_into(&mut b);
        assert_eq!(Cts::decode(&b).unwrap(), c);
        assert_eq!(
            decode_imm(encode_imm(REC_CTS, 0x1_2345)).unwrap(),
            (REC_CTS, 0x2345)
        );
        assert!(decode_imm(0x0001_0000).is_err());
    }
}
