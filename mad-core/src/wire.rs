//! The few bytes the core itself puts on the wire: the message header and, in checked mode,
//! piece descriptors. Encoders and decoders are pure functions (fuzzed in `fuzz/`).
//!
//! Header (8 bytes, through TM 0 at `begin_packing`):
//!
//! | bytes | field |
//! |---|---|
//! | 0..2 | magic `b"M2"` |
//! | 2 | version (1) |
//! | 3 | flags: bit 0 = checked mode (descriptors follow each piece) |
//! | 4..8 | message sequence number on this connection, little-endian |
//!
//! Descriptor (16 bytes, checked mode only, through TM 0 before each piece and at the end):
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind: 1 = piece, 2 = end of message |
//! | 1 | send mode |
//! | 2 | receive mode |
//! | 3 | reserved (0) |
//! | 4..8 | piece index (or piece count for "end"), little-endian |
//! | 8..16 | piece length, little-endian |

use crate::error::{PieceDesc, PieceOrEnd};
use crate::modes::{RecvMode, SendMode};

/// What is wrong with bytes that should be a header or a descriptor (the wire layer's error;
/// the engine reports it as [`Error::Protocol`](crate::Error::Protocol) from the peer).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Not the length of the record.
    #[error("{what} is {got} bytes, expected {want}")]
    Length {
        /// `"header"` or `"descriptor"`.
        what: &'static str,
        /// Length given.
        got: usize,
        /// Length of the record.
        want: usize,
    },
    /// The header does not start with the magic bytes.
    #[error(
        "bad message magic {0:02x?} (the previous message was probably unpacked with a different \
         sequence of pieces than it was packed with; enable checked mode to find where)"
    )]
    Magic([u8; 2]),
    /// A protocol version this build does not speak.
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    Version(u8),
    /// Header flags this build does not know.
    #[error("unknown header flags {0:#04x}")]
    Flags(u8),
    /// A descriptor kind other than piece (1) or end of message (2).
    #[error("bad descriptor kind {0}")]
    Kind(u8),
    /// A send or receive mode that does not exist.
    #[error("bad {what} mode {got} in descriptor")]
    Mode {
        /// `"send"` or `"receive"`.
        what: &'static str,
        /// The byte found.
        got: u8,
    },
    /// Reserved bytes not zero, or an end-of-message descriptor with a length.
    #[error("malformed {0} descriptor")]
    Malformed(&'static str),
}

/// Header length in bytes.
pub const HEADER_LEN: usize = 8;
/// Descriptor length in bytes.
pub const DESC_LEN: usize = 16;
const MAGIC: [u8; 2] = *b"M2";
const VERSION: u8 = 1;
const FLAG_CHECKED: u8 = 1;

/// A decoded message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Whether checked-mode descriptors follow.
    pub checked: bool,
    /// Sequence number of the message on its connection.
    pub seq: u32,
}

/// Encode a header.
pub fn encode_header(h: Header) -> [u8; HEADER_LEN] {
    let s = h.seq.to_le_bytes();
    [
        MAGIC[0],
        MAGIC[1],
        VERSION,
        if h.checked { FLAG_CHECKED } else { 0 },
        s[0],
        s[1],
        s[2],
        s[3],
    ]
}

/// Decode a header; the error says what is wrong.
pub fn decode_header(b: &[u8]) -> Result<Header, WireError> {
    if b.len() != HEADER_LEN {
        return Err(WireError::Length {
            what: "header",
            got: b.len(),
            want: HEADER_LEN,
        });
    }
    if b[0..2] != MAGIC {
        return Err(WireError::Magic([b[0], b[1]]));
    }
    if b[2] != VERSION {
        return Err(WireError::Version(b[2]));
    }
    if b[3] & !FLAG_CHECKED != 0 {
        return Err(WireError::Flags(b[3]));
    }
    Ok(Header {
        checked: b[3] & FLAG_CHECKED != 0,
        seq: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    })
}

/// Encode a descriptor.
pub fn encode_desc(d: PieceOrEnd) -> [u8; DESC_LEN] {
    let mut b = [0u8; DESC_LEN];
    match d {
        PieceOrEnd::Piece(p) => {
            b[0] = 1;
            b[1] = p.send as u8;
            b[2] = p.recv as u8;
            b[4..8].copy_from_slice(&p.index.to_le_bytes());
            b[8..16].copy_from_slice(&p.len.to_le_bytes());
        }
        PieceOrEnd::End { pieces } => {
            b[0] = 2;
            b[4..8].copy_from_slice(&pieces.to_le_bytes());
        }
    }
    b
}

/// Decode a descriptor; the error says what is wrong.
pub fn decode_desc(b: &[u8]) -> Result<PieceOrEnd, WireError> {
    if b.len() != DESC_LEN {
        return Err(WireError::Length {
            what: "descriptor",
            got: b.len(),
            want: DESC_LEN,
        });
    }
    let idx = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let mut len = [0u8; 8];
    len.copy_from_slice(&b[8..16]);
    let len = u64::from_le_bytes(len);
    match b[0] {
        1 => {
            let send = SendMode::from_u8(b[1]).ok_or(WireError::Mode {
                what: "send",
                got: b[1],
            })?;
            let recv = RecvMode::from_u8(b[2]).ok_or(WireError::Mode {
                what: "receive",
                got: b[2],
            })?;
            if b[3] != 0 {
                return Err(WireError::Malformed("piece"));
            }
            Ok(PieceOrEnd::Piece(PieceDesc {
                index: idx,
                len,
                send,
                recv,
            }))
        }
        2 => {
            if b[1..4] != [0, 0, 0] || len != 0 {
                return Err(WireError::Malformed("end-of-message"));
            }
            Ok(PieceOrEnd::End { pieces: idx })
        }
        k => Err(WireError::Kind(k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip() {
        for h in [
            Header {
                checked: true,
                seq: 7,
            },
            Header {
                checked: false,
                seq: u32::MAX,
            },
        ] {
            assert_eq!(decode_header(&encode_header(h)).unwrap(), h);
        }
        assert_eq!(
            decode_header(b"XX\x01\x00\0\0\0\0"),
            Err(WireError::Magic(*b"XX"))
        );
        assert_eq!(
            decode_header(b"M2\x09\x00\0\0\0\0"),
            Err(WireError::Version(9))
        );
        assert_eq!(
            decode_header(b"M2\x01\x80\0\0\0\0"),
            Err(WireError::Flags(0x80))
        );
        assert!(matches!(
            decode_header(b"M2"),
            Err(WireError::Length { got: 2, .. })
        ));
        assert!(decode_header(b"XX\x01\x00\0\0\0\0")
            .unwrap_err()
            .to_string()
            .contains("enable checked mode"));
    }

    #[test]
    fn desc_roundtrip() {
        let p = PieceOrEnd::Piece(PieceDesc {
            index: 3,
            len: 1 << 40,
            send: SendMode::Later,
            recv: RecvMode::Express,
        });
        assert_eq!(decode_desc(&encode_desc(p)).unwrap(), p);
        let e = PieceOrEnd::End { pieces: 9 };
        assert_eq!(decode_desc(&encode_desc(e)).unwrap(), e);
        let mut bad = encode_desc(p);
        bad[1] = 9;
        assert!(decode_desc(&bad).is_err());
        bad = encode_desc(p);
        bad[0] = 0;
        assert!(decode_desc(&bad).is_err());
        assert!(decode_desc(&[1; 3]).is_err());
    }
}
