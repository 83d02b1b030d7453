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
//! Frames (8 bytes, unchecked mode only, through TM 0): the sender announces each piece's
//! length (and its TM) before the piece, each gather group before the group, and ends every
//! message with an end frame. The receiver reads each frame at the same point and compares it
//! with its own unpack, so a message unpacked with other lengths than it was packed with fails
//! at the first differing piece (never a silent misread, never both sides waiting on each
//! other), and a message whose sender abandoned it is never taken as complete.
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind: `0xf1` = piece, `0xf2` = gather group, `0xf3` = end of message |
//! | 1 | TM index (piece, group; bit 7 of a group's: the end frame follows its piece frames); 0 for end |
//! | 2..8 | piece length (piece), slice count (group; a piece frame per slice follows), piece count (end); 48 bits little-endian |
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
/// Frame length in bytes.
pub const FRAME_LEN: usize = 8;
const MAGIC: [u8; 2] = *b"M2";
const VERSION: u8 = 2;
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
#[inline]
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
///
/// # Errors
///
/// A [`WireError`] saying what is wrong (short buffer, bad magic, version, a field out of range).
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

/// An unchecked-mode frame: what the sender put at this point of TM 0's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A piece of `len` bytes carried by TM `tm` follows (a Copy TM) or is part of the group
    /// just announced (a Gather TM).
    Piece {
        /// Transmission module.
        tm: u8,
        /// Piece length (bytes; compared modulo 2^48).
        len: u64,
    },
    /// A gather group of `count` slices through TM `tm`; `count` piece frames follow, then,
    /// when `end` is set (the message's last group), the end frame.
    Group {
        /// Transmission module.
        tm: u8,
        /// Number of slices.
        count: u64,
        /// The end frame follows the piece frames.
        end: bool,
    },
    /// The message ends here; it had `pieces` pieces.
    End {
        /// Number of pieces in the message (modulo 2^48).
        pieces: u64,
    },
}

const FRAME_VALUE_MASK: u64 = (1 << 48) - 1;
/// Bit of a group frame's TM byte: the end frame follows its piece frames.
const GROUP_END: u8 = 0x80;

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Frame::Piece { tm, len } => write!(f, "a piece of {len} B through TM {tm}"),
            Frame::Group { tm, count, end } => write!(
                f,
                "a group of {count} piece(s) through TM {tm}{}",
                if *end { ", the message's last" } else { "" }
            ),
            Frame::End { pieces } => write!(f, "the end of the message after {pieces} piece(s)"),
        }
    }
}

/// Encode a frame.
#[inline]
pub fn encode_frame(fr: Frame) -> [u8; FRAME_LEN] {
    let (kind, tm, v) = match fr {
        Frame::Piece { tm, len } => (0xf1u8, tm, len),
        Frame::Group { tm, count, end } => (0xf2, tm | if end { GROUP_END } else { 0 }, count),
        Frame::End { pieces } => (0xf3, 0, pieces),
    };
    let v = (v & FRAME_VALUE_MASK).to_le_bytes();
    [kind, tm, v[0], v[1], v[2], v[3], v[4], v[5]]
}

/// Decode a frame, or `None` when the bytes are not one (the stream is out of step).
#[inline]
pub fn decode_frame(b: &[u8; FRAME_LEN]) -> Option<Frame> {
    let v = u64::from_le_bytes([b[2], b[3], b[4], b[5], b[6], b[7], 0, 0]);
    match b[0] {
        0xf1 => Some(Frame::Piece { tm: b[1], len: v }),
        0xf2 => Some(Frame::Group {
            tm: b[1] & !GROUP_END,
            count: v,
            end: b[1] & GROUP_END != 0,
        }),
        0xf3 if b[1] == 0 => Some(Frame::End { pieces: v }),
        _ => None,
    }
}

/// The length of a message's rest after its header when `bytes` starts with all of it and it
/// is at most `cap` bytes long: unchecked-mode piece frames of TM 0, each followed by its
/// bytes (at most `piece` of them), then the end frame (what a short message of copied
/// pieces is). `None` for anything else (another TM, a group, a longer piece, a rest not all
/// there or longer than `cap`, bytes that are not frames): the receiver then reads the
/// message piece by piece.
#[inline]
pub fn short_message(bytes: &[u8], cap: usize, piece: usize) -> Option<usize> {
    let b = &bytes[..bytes.len().min(cap)];
    let mut at = 0usize;
    loop {
        let f = b.get(at..at.checked_add(FRAME_LEN)?)?;
        match (f[0], f[1]) {
            (0xf1, 0) => {
                let len = u64::from_le_bytes([f[2], f[3], f[4], f[5], f[6], f[7], 0, 0]);
                if len > piece as u64 {
                    return None;
                }
                at = at
                    .checked_add(FRAME_LEN)?
                    .checked_add(usize::try_from(len).ok()?)?;
            }
            (0xf3, 0) => return Some(at + FRAME_LEN),
            _ => return None,
        }
    }
}

/// The frame the sender writes for `fr`, as the receiver compares it (values truncated to
/// the 48 bits that travel).
#[inline]
pub fn normalize_frame(fr: Frame) -> Frame {
    match fr {
        Frame::Piece { tm, len } => Frame::Piece {
            tm,
            len: len & FRAME_VALUE_MASK,
        },
        Frame::Group { tm, count, end } => Frame::Group {
            tm,
            count: count & FRAME_VALUE_MASK,
            end,
        },
        Frame::End { pieces } => Frame::End {
            pieces: pieces & FRAME_VALUE_MASK,
        },
    }
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
///
/// # Errors
///
/// A [`WireError`] saying what is wrong (short buffer, unknown tag, a field out of range).
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
            decode_header(b"XX\x02\x00\0\0\0\0"),
            Err(WireError::Magic(*b"XX"))
        );
        assert_eq!(
            decode_header(b"M2\x09\x00\0\0\0\0"),
            Err(WireError::Version(9))
        );
        assert_eq!(
            decode_header(b"M2\x02\x80\0\0\0\0"),
            Err(WireError::Flags(0x80))
        );
        assert!(matches!(
            decode_header(b"M2"),
            Err(WireError::Length { got: 2, .. })
        ));
        assert!(decode_header(b"XX\x02\x00\0\0\0\0")
            .unwrap_err()
            .to_string()
            .contains("enable checked mode"));
    }

    #[test]
    fn frame_roundtrip() {
        for fr in [
            Frame::Piece { tm: 0, len: 0 },
            Frame::Piece {
                tm: 3,
                len: (1 << 48) - 1,
            },
            Frame::Group {
                tm: 1,
                count: 16,
                end: false,
            },
            Frame::Group {
                tm: 2,
                count: 1,
                end: true,
            },
            Frame::End { pieces: 7 },
        ] {
            assert_eq!(decode_frame(&encode_frame(fr)), Some(fr));
        }
        assert_eq!(
            decode_frame(&encode_frame(Frame::Piece {
                tm: 1,
                len: (1 << 48) + 5
            })),
            Some(Frame::Piece { tm: 1, len: 5 })
        );
        assert_eq!(decode_frame(b"M2\x02\x00\0\0\0\0"), None);
        assert_eq!(decode_frame(&[0xf3, 1, 0, 0, 0, 0, 0, 0]), None);
    }

    #[test]
    fn short_message_takes_only_a_whole_short_message_of_tm0_pieces() {
        let piece = |tm, len: usize| {
            encode_frame(Frame::Piece {
                tm,
                len: len as u64,
            })
        };
        let end = encode_frame(Frame::End { pieces: 2 });
        let mut m = Vec::new();
        m.extend_from_slice(&piece(0, 3));
        m.extend_from_slice(b"abc");
        m.extend_from_slice(&piece(0, 0));
        m.extend_from_slice(&end);
        let n = m.len();
        m.extend_from_slice(b"next message");
        assert_eq!(short_message(&m, 512, 128), Some(n));
        assert_eq!(short_message(&m, n, 128), Some(n));
        assert_eq!(short_message(&m, n - 1, 128), None, "longer than the cap");
        assert_eq!(
            short_message(&m, 512, 2),
            None,
            "a piece longer than the bound"
        );
        for cut in 0..n {
            assert_eq!(short_message(&m[..cut], 512, 128), None, "cut at {cut}");
        }
        let mut other_tm = piece(1, 3).to_vec();
        other_tm.extend_from_slice(b"abc");
        other_tm.extend_from_slice(&end);
        assert_eq!(short_message(&other_tm, 512, 128), None);
        let group = encode_frame(Frame::Group {
            tm: 0,
            count: 1,
            end: true,
        });
        assert_eq!(short_message(&group, 512, 128), None);
        let mut huge = piece(0, (1 << 48) - 1).to_vec();
        huge.extend_from_slice(&end);
        assert_eq!(short_message(&huge, usize::MAX, usize::MAX), None);
        assert_eq!(short_message(&[0xf3, 1, 0, 0, 0, 0, 0, 0], 512, 128), None);
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
