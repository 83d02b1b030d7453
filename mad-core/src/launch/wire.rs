//! The `madrun` bootstrap wire format: length-prefixed frames, encoded and decoded without I/O.
//!
//! Every frame is `len: u32 LE` followed by `len` bytes of body; the body starts with a
//! one-byte kind. Integers are little-endian; byte strings are `u32 LE length || bytes`.
//!
//! | kind | frame        | direction       | body after the kind byte                          |
//! |------|--------------|-----------------|---------------------------------------------------|
//! | 1    | `Challenge`  | server → client | magic `MDR1`, server nonce (16)                   |
//! | 2    | `Hello`      | client → server | magic `MDR1`, rank u32, client nonce (16), proof (32) |
//! | 3    | `Welcome`    | server → client | server proof (32)                                 |
//! | 4    | `Allgather`  | client → server | tag (bytes, UTF-8), value (bytes)                 |
//! | 5    | `Gathered`   | server → client | tag, count u32, count × value                     |
//! | 6    | `Failed`     | server → client | has-rank u8, rank u32, message (bytes, UTF-8)     |
//! | 7    | `Abort`      | client → server | scope prefix (bytes, UTF-8), kind, message        |
//! | 8    | `Aborted`    | server → client | tag, rank u32, kind, message, count u32, count × rank u32 |
//!
//! Limits ([`MAX_FRAME`], [`MAX_TAG`], [`MAX_VALUE`], [`MAX_RANKS`], [`MAX_MESSAGE`]) are
//! checked before anything is allocated: every length is validated against the bytes actually
//! present in the (already bounded) frame, so garbage can never cause a large allocation or a
//! panic. [`decode_frame`] is the fuzzing entry point.

use crate::auth::{NONCE_LEN, PROOF_LEN};
use crate::error::{Error, Result};

/// Largest frame body accepted or produced, in bytes (64 MiB).
pub const MAX_FRAME: usize = 64 << 20;
/// Largest allgather tag, in bytes.
pub const MAX_TAG: usize = 256;
/// Largest allgather value contributed by one rank, in bytes (16 MiB).
pub const MAX_VALUE: usize = 16 << 20;
/// Largest session `madrun` accepts.
pub const MAX_RANKS: usize = 4096;
/// Largest error message carried by a [`Frame::Failed`], in bytes.
pub const MAX_MESSAGE: usize = 64 << 10;
/// Largest error kind carried by [`Frame::Abort`] and [`Frame::Aborted`], in bytes.
pub const MAX_KIND: usize = 64;
/// Protocol magic and version carried by the handshake frames.
pub const MAGIC: [u8; 4] = *b"MDR1";
/// The rank reported in [`Error::Protocol`] by [`decode_frame`], which does not know who sent
/// the bytes; callers that know the peer replace it.
pub const UNKNOWN_RANK: usize = usize::MAX;

const K_CHALLENGE: u8 = 1;
const K_HELLO: u8 = 2;
const K_WELCOME: u8 = 3;
const K_ALLGATHER: u8 = 4;
const K_GATHERED: u8 = 5;
const K_FAILED: u8 = 6;
const K_ABORT: u8 = 7;
const K_ABORTED: u8 = 8;

/// One message of the bootstrap protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Sent by the server on accept: the nonce the client must bind its proof to.
    Challenge {
        /// The server's fresh nonce.
        nonce: [u8; NONCE_LEN],
    },
    /// The client's answer: who it is and its proof of knowing the session secret.
    Hello {
        /// The rank the client claims.
        rank: u32,
        /// The client's own fresh nonce.
        nonce: [u8; NONCE_LEN],
        /// `secret.proof(b"madrun-client", server_nonce, client_nonce, rank LE)`.
        proof: [u8; PROOF_LEN],
    },
    /// The server's proof that it knows the secret too: the client now trusts it.
    Welcome {
        /// `secret.proof(b"madrun-server", server_nonce, client_nonce, rank LE)`.
        proof: [u8; PROOF_LEN],
    },
    /// A rank's contribution to the collective named `tag`.
    Allgather {
        /// The collective's name (at most [`MAX_TAG`] bytes).
        tag: String,
        /// This rank's value (at most [`MAX_VALUE`] bytes).
        value: Vec<u8>,
    },
    /// The result of a completed collective: every rank's value, in rank order.
    Gathered {
        /// The collective's name.
        tag: String,
        /// One value per rank.
        values: Vec<Vec<u8>>,
    },
    /// The server refuses a request or reports that the job can no longer make progress.
    Failed {
        /// The rank whose departure caused the failure, if any.
        rank: Option<u32>,
        /// Human-readable explanation.
        message: String,
    },
    /// This rank abandons the collectives whose tags start with `scope` (its part of a channel
    /// open failed, or it timed out waiting): the server fails every pending and later
    /// collective of the scope and answers with an [`Frame::Aborted`] whose tag is `scope`.
    Abort {
        /// The scope's tag prefix (at most [`MAX_TAG`] bytes, not empty).
        scope: String,
        /// The error's kind (`Resource`, `CollectiveTimeout`, ...; at most [`MAX_KIND`] bytes).
        kind: String,
        /// The error's text (cut to [`MAX_MESSAGE`] bytes).
        message: String,
    },
    /// The answer to an allgather of an abandoned scope (tag: the allgather's), and to an
    /// [`Frame::Abort`] (tag: the scope): the scope's first failure.
    Aborted {
        /// The allgather's tag, or the scope of the abort being answered.
        tag: String,
        /// The rank that abandoned the scope first.
        rank: u32,
        /// Its error's kind.
        kind: String,
        /// Its error's text.
        message: String,
        /// The ranks that had not contributed to the scope's pending collectives when it was
        /// abandoned (what a timeout is waiting for).
        missing: Vec<u32>,
    },
}

/// `message` cut to at most `max` bytes at a character boundary.
fn cut(message: &str, max: usize) -> &[u8] {
    let mut end = message.len().min(max);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message.as_bytes()[..end]
}

impl Frame {
    /// Encode this frame (header included), checking every limit.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when a field exceeds the protocol's limits (rank
    /// count, tag or value length).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut b = vec![0u8; 4];
        match self {
            Frame::Challenge { nonce } => {
                b.push(K_CHALLENGE);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(nonce);
            }
            Frame::Hello { rank, nonce, proof } => {
                b.push(K_HELLO);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&rank.to_le_bytes());
                b.extend_from_slice(nonce);
                b.extend_from_slice(proof);
            }
            Frame::Welcome { proof } => {
                b.push(K_WELCOME);
                b.extend_from_slice(proof);
            }
            Frame::Allgather { tag, value } => {
                check_tag(tag)?;
                check_len("allgather value", value.len(), MAX_VALUE)?;
                b.push(K_ALLGATHER);
                put_bytes(&mut b, tag.as_bytes());
                put_bytes(&mut b, value);
            }
            Frame::Gathered { tag, values } => {
                check_tag(tag)?;
                check_len("allgather result count", values.len(), MAX_RANKS)?;
                let total: usize = values.iter().map(|v| v.len() + 4).sum();
                check_len("allgather result", total, MAX_FRAME)?;
                b.push(K_GATHERED);
                put_bytes(&mut b, tag.as_bytes());
                b.extend_from_slice(&(values.len() as u32).to_le_bytes());
                for v in values {
                    check_len("allgather value", v.len(), MAX_VALUE)?;
                    put_bytes(&mut b, v);
                }
            }
            Frame::Failed { rank, message } => {
                b.push(K_FAILED);
                b.push(u8::from(rank.is_some()));
                b.extend_from_slice(&rank.unwrap_or(0).to_le_bytes());
                // Over-long messages are cut at a character boundary rather than refused.
                put_bytes(&mut b, cut(message, MAX_MESSAGE));
            }
            Frame::Abort {
                scope,
                kind,
                message,
            } => {
                check_tag(scope)?;
                if scope.is_empty() {
                    return Err(bad("empty abort scope"));
                }
                b.push(K_ABORT);
                put_bytes(&mut b, scope.as_bytes());
                put_bytes(&mut b, cut(kind, MAX_KIND));
                put_bytes(&mut b, cut(message, MAX_MESSAGE));
            }
            Frame::Aborted {
                tag,
                rank,
                kind,
                message,
                missing,
            } => {
                check_tag(tag)?;
                check_len("missing rank count", missing.len(), MAX_RANKS)?;
                b.push(K_ABORTED);
                put_bytes(&mut b, tag.as_bytes());
                b.extend_from_slice(&rank.to_le_bytes());
                put_bytes(&mut b, cut(kind, MAX_KIND));
                put_bytes(&mut b, cut(message, MAX_MESSAGE));
                b.extend_from_slice(&(missing.len() as u32).to_le_bytes());
                for r in missing {
                    b.extend_from_slice(&r.to_le_bytes());
                }
            }
        }
        let body = b.len() - 4;
        check_len("frame", body, MAX_FRAME)?;
        b[..4].copy_from_slice(&(body as u32).to_le_bytes());
        Ok(b)
    }
}

fn bad(what: impl Into<String>) -> Error {
    Error::Protocol {
        rank: UNKNOWN_RANK,
        what: what.into(),
    }
}

fn check_len(what: &str, len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(bad(format!(
            "{what} of {len} bytes exceeds the limit of {max}"
        )));
    }
    Ok(())
}

fn check_tag(tag: &str) -> Result<()> {
    check_len("allgather tag", tag.len(), MAX_TAG)
}

fn put_bytes(b: &mut Vec<u8>, s: &[u8]) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s);
}

/// A cursor over a frame body that never reads past its end.
struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(bad(format!(
                "frame truncated in {what}: need {n} bytes, {} left",
                self.b.len()
            )));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn bytes(&mut self, what: &str, max: usize) -> Result<&'a [u8]> {
        let n = self.u32(what)? as usize;
        check_len(what, n, max)?;
        self.take(n, what)
    }
    fn string(&mut self, what: &str, max: usize) -> Result<String> {
        let b = self.bytes(what, max)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| bad(format!("{what} is not UTF-8")))
    }
    fn magic(&mut self) -> Result<()> {
        if self.array::<4>("magic")? != MAGIC {
            return Err(bad("not a madrun bootstrap peer (bad magic or version)"));
        }
        Ok(())
    }
    fn finish(self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(bad(format!("{} trailing bytes after frame", self.b.len())))
        }
    }
}

/// Decode one frame from the start of `buf`.
///
/// Returns `Ok(None)` when `buf` does not yet hold a whole frame (read more and call again),
/// `Ok(Some((frame, consumed)))` on success, and an [`Error::Protocol`] (with rank
/// [`UNKNOWN_RANK`]) for anything malformed: oversized length, unknown kind, bad lengths,
/// non-UTF-8 text, trailing bytes. An oversized length is reported as soon as the 4-byte header
/// is present, so a reader never buffers more than [`MAX_FRAME`] + 4 bytes.
///
/// # Errors
///
/// [`Error::Protocol`] with rank [`UNKNOWN_RANK`] for malformed input.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>> {
    let Some(header) = buf.get(..4) else {
        return Ok(None);
    };
    let mut h = [0u8; 4];
    h.copy_from_slice(header);
    let len = u32::from_le_bytes(h) as usize;
    if len == 0 {
        return Err(bad("empty frame"));
    }
    check_len("frame", len, MAX_FRAME)?;
    let Some(body) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    let mut c = Cursor { b: body };
    let frame = match c.u8("kind")? {
        K_CHALLENGE => {
            c.magic()?;
            Frame::Challenge {
                nonce: c.array("nonce")?,
            }
        }
        K_HELLO => {
            c.magic()?;
            Frame::Hello {
                rank: c.u32("rank")?,
                nonce: c.array("nonce")?,
                proof: c.array("proof")?,
            }
        }
        K_WELCOME => Frame::Welcome {
            proof: c.array("proof")?,
        },
        K_ALLGATHER => Frame::Allgather {
            tag: c.string("allgather tag", MAX_TAG)?,
            value: c.bytes("allgather value", MAX_VALUE)?.to_vec(),
        },
        K_GATHERED => {
            let tag = c.string("allgather tag", MAX_TAG)?;
            let n = c.u32("value count")? as usize;
            check_len("allgather result count", n, MAX_RANKS)?;
            // Every value needs at least its 4-byte length: bound the count by the bytes left
            // before reserving anything.
            if n > c.b.len() / 4 {
                return Err(bad(format!(
                    "allgather result claims {n} values in {} bytes",
                    c.b.len()
                )));
            }
            let mut values = Vec::with_capacity(n);
            for _ in 0..n {
                values.push(c.bytes("allgather value", MAX_VALUE)?.to_vec());
            }
            Frame::Gathered { tag, values }
        }
        K_FAILED => {
            let has = c.u8("rank flag")?;
            let rank = c.u32("rank")?;
            let rank = match has {
                0 => None,
                1 => Some(rank),
                x => return Err(bad(format!("bad rank flag {x}"))),
            };
            Frame::Failed {
                rank,
                message: c.string("error message", MAX_MESSAGE)?,
            }
        }
        K_ABORT => {
            let scope = c.string("abort scope", MAX_TAG)?;
            if scope.is_empty() {
                return Err(bad("empty abort scope"));
            }
            Frame::Abort {
                scope,
                kind: c.string("error kind", MAX_KIND)?,
                message: c.string("error message", MAX_MESSAGE)?,
            }
        }
        K_ABORTED => {
            let tag = c.string("allgather tag", MAX_TAG)?;
            let rank = c.u32("rank")?;
            let kind = c.string("error kind", MAX_KIND)?;
            let message = c.string("error message", MAX_MESSAGE)?;
            let n = c.u32("missing rank count")? as usize;
            check_len("missing rank count", n, MAX_RANKS)?;
            if n > c.b.len() / 4 {
                return Err(bad(format!(
                    "abort claims {n} missing ranks in {} bytes",
                    c.b.len()
                )));
            }
            let mut missing = Vec::with_capacity(n);
            for _ in 0..n {
                missing.push(c.u32("missing rank")?);
            }
            Frame::Aborted {
                tag,
                rank,
                kind,
                message,
                missing,
            }
        }
        k => return Err(bad(format!("unknown frame kind {k}"))),
    };
    c.finish()?;
    Ok(Some((frame, 4 + len)))
}

/// Accumulates bytes from a stream and yields whole frames.
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    limit: usize,
}

impl Default for FrameReader {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameReader {
    /// An empty reader accepting frames up to [`MAX_FRAME`].
    pub fn new() -> Self {
        Self::with_limit(MAX_FRAME)
    }

    /// An empty reader refusing frames longer than `limit` (at most [`MAX_FRAME`]) as soon as
    /// their header arrives: used before a peer has authenticated, so that a stranger cannot
    /// make the reader buffer a large frame.
    pub fn with_limit(limit: usize) -> Self {
        FrameReader {
            buf: Vec::new(),
            limit: limit.min(MAX_FRAME),
        }
    }

    /// Change the frame-size limit (at most [`MAX_FRAME`]).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.min(MAX_FRAME);
    }

    /// Read from `r` until one whole frame is available and return it; `Ok(None)` on a clean
    /// end of stream (between frames). I/O errors (including read timeouts) are returned as
    /// [`Error::Io`]; malformed input as [`Error::Protocol`] with rank [`UNKNOWN_RANK`].
    ///
    /// # Errors
    ///
    /// [`Error::Io`] for I/O errors (read timeouts included);
    /// [`Error::Protocol`] with rank [`UNKNOWN_RANK`] for malformed input
    /// or an end of stream inside a frame.
    pub fn read_frame<R: std::io::Read>(&mut self, r: &mut R) -> Result<Option<Frame>> {
        let mut chunk = [0u8; 64 * 1024];
        loop {
            if let Some(h) = self.buf.get(..4) {
                let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
                check_len("frame", len, self.limit)?;
            }
            if let Some((f, used)) = decode_frame(&self.buf)? {
                self.buf.drain(..used);
                return Ok(Some(f));
            }
            let n = match r.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("reading a bootstrap frame", e)),
            };
            if n == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(bad(format!(
                    "connection closed in the middle of a frame ({} bytes pending)",
                    self.buf.len()
                )));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Encode and write one frame.
///
/// # Errors
///
/// As [`Frame::encode`]; [`Error::Io`] when writing fails.
pub fn write_frame<W: std::io::Write>(w: &mut W, f: &Frame) -> Result<()> {
    let b = f.encode()?;
    w.write_all(&b)
        .and_then(|()| w.flush())
        .map_err(|e| Error::io("writing a bootstrap frame", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Challenge { nonce: [1; 16] },
            Frame::Hello {
                rank: 7,
                nonce: [2; 16],
                proof: [3; 32],
            },
            Frame::Welcome { proof: [4; 32] },
            Frame::Allgather {
                tag: "addr".into(),
                value: b"127.0.0.1:9".to_vec(),
            },
            Frame::Allgather {
                tag: String::new(),
                value: vec![],
            },
            Frame::Gathered {
                tag: "addr".into(),
                values: vec![b"a".to_vec(), vec![], vec![0xff; 300]],
            },
            Frame::Failed {
                rank: Some(3),
                message: "rank 3 left".into(),
            },
            Frame::Failed {
                rank: None,
                message: "é".into(),
            },
            Frame::Abort {
                scope: "chan/x/".into(),
                kind: "Resource".into(),
                message: "too many open files".into(),
            },
            Frame::Aborted {
                tag: "chan/x/core".into(),
                rank: 1,
                kind: "CollectiveTimeout".into(),
                message: "rank 0 waited".into(),
                missing: vec![2, 3],
            },
            Frame::Aborted {
                tag: "chan/x/".into(),
                rank: 0,
                kind: String::new(),
                message: String::new(),
                missing: vec![],
            },
        ]
    }

    #[test]
    fn roundtrip_every_kind() {
        for f in samples() {
            let b = f.encode().unwrap();
            assert_eq!(decode_frame(&b).unwrap(), Some((f.clone(), b.len())));
            // Two frames back to back: the first is consumed exactly.
            let mut two = b.clone();
            two.extend_from_slice(&b);
            assert_eq!(decode_frame(&two).unwrap().unwrap().1, b.len());
        }
    }

    #[test]
    fn truncated_input_needs_more() {
        for f in samples() {
            let b = f.encode().unwrap();
            for cut in 0..b.len() {
                assert_eq!(decode_frame(&b[..cut]).unwrap(), None, "{f:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn oversized_is_refused_from_the_header() {
        let mut b = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        assert!(decode_frame(&b).is_err());
        b = u32::MAX.to_le_bytes().to_vec();
        assert!(decode_frame(&b).is_err());
        assert!(decode_frame(&[0, 0, 0, 0]).is_err());
        let big = Frame::Allgather {
            tag: "t".into(),
            value: vec![0; MAX_VALUE + 1],
        };
        assert!(big.encode().is_err());
        let long_tag = Frame::Allgather {
            tag: "x".repeat(MAX_TAG + 1),
            value: vec![],
        };
        assert!(long_tag.encode().is_err());
        // A well-formed header around a tag that is too long.
        let mut body = vec![K_ALLGATHER];
        put_bytes(&mut body, &vec![b'x'; MAX_TAG + 1]);
        put_bytes(&mut body, b"");
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(&body);
        assert!(decode_frame(&f).is_err());
    }

    #[test]
    fn gathered_result_larger_than_a_frame_is_refused() {
        let values = vec![vec![0u8; MAX_VALUE]; 5];
        let f = Frame::Gathered {
            tag: "t".into(),
            values,
        };
        assert!(f.encode().is_err());
    }

    fn frame_of(body: &[u8]) -> Vec<u8> {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body);
        f
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "20 000 inputs: minutes under Miri; the fuzz target covers it natively"
    )]
    fn garbage_is_an_error_not_a_panic() {
        // Unknown kind, bad magic, short fields, trailing bytes, bad UTF-8, lying counts.
        assert!(decode_frame(&frame_of(&[99])).is_err());
        assert!(decode_frame(&frame_of(b"\x01XXXX0123456789abcdef")).is_err());
        assert!(decode_frame(&frame_of(&[K_WELCOME, 1, 2])).is_err());
        let mut w = Frame::Welcome { proof: [0; 32] }.encode().unwrap();
        w.push(0);
        let body_len = (w.len() - 4) as u32;
        w[..4].copy_from_slice(&body_len.to_le_bytes());
        assert!(decode_frame(&w).is_err());
        let mut body = vec![K_ALLGATHER];
        put_bytes(&mut body, &[0xff, 0xfe]);
        put_bytes(&mut body, b"");
        assert!(decode_frame(&frame_of(&body)).is_err());
        let mut body = vec![K_GATHERED];
        put_bytes(&mut body, b"t");
        body.extend_from_slice(&4096u32.to_le_bytes());
        assert!(decode_frame(&frame_of(&body)).is_err());
        let mut body = vec![K_GATHERED];
        put_bytes(&mut body, b"t");
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_frame(&frame_of(&body)).is_err());
        let mut body = vec![K_ALLGATHER];
        put_bytes(&mut body, b"t");
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_frame(&frame_of(&body)).is_err());
        assert!(decode_frame(&frame_of(&[K_FAILED, 2, 0, 0, 0, 0, 0, 0, 0, 0])).is_err());
        // An empty abort scope, an over-long kind, a lying missing-rank count.
        let mut body = vec![K_ABORT];
        put_bytes(&mut body, b"");
        put_bytes(&mut body, b"k");
        put_bytes(&mut body, b"m");
        assert!(decode_frame(&frame_of(&body)).is_err());
        let mut body = vec![K_ABORT];
        put_bytes(&mut body, b"s/");
        put_bytes(&mut body, &[b'k'; MAX_KIND + 1]);
        put_bytes(&mut body, b"m");
        assert!(decode_frame(&frame_of(&body)).is_err());
        let mut body = vec![K_ABORTED];
        put_bytes(&mut body, b"t");
        body.extend_from_slice(&1u32.to_le_bytes());
        put_bytes(&mut body, b"k");
        put_bytes(&mut body, b"m");
        body.extend_from_slice(&4000u32.to_le_bytes());
        assert!(decode_frame(&frame_of(&body)).is_err());
        // Over-long kinds and messages are cut when encoded, never refused.
        let long = Frame::Abort {
            scope: "s/".into(),
            kind: "é".repeat(MAX_KIND),
            message: "x".repeat(MAX_MESSAGE + 10),
        };
        let b = long.encode().unwrap();
        assert!(matches!(
            decode_frame(&b).unwrap(),
            Some((Frame::Abort { kind, message, .. }, _)) if kind.len() == MAX_KIND && message.len() == MAX_MESSAGE
        ));
        // A deterministic pseudo-random sweep: must never panic.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 64) as usize;
            let mut body = vec![(x % 10) as u8];
            let mut y = x;
            for _ in 0..n {
                y = y.wrapping_mul(6364136223846793005).wrapping_add(1);
                body.push((y >> 56) as u8);
            }
            let _ = decode_frame(&frame_of(&body));
            let _ = decode_frame(&body);
        }
    }

    #[test]
    fn reader_yields_frames_and_detects_mid_frame_eof() {
        let mut bytes = Vec::new();
        for f in samples() {
            bytes.extend_from_slice(&f.encode().unwrap());
        }
        let mut r = FrameReader::new();
        let mut src = &bytes[..];
        for f in samples() {
            assert_eq!(r.read_frame(&mut src).unwrap(), Some(f));
        }
        assert_eq!(r.read_frame(&mut src).unwrap(), None);
        let mut r = FrameReader::new();
        let mut src = &bytes[..5];
        assert!(r.read_frame(&mut src).is_err());
        // A small limit refuses a big frame from its header alone.
        let big = Frame::Allgather {
            tag: "t".into(),
            value: vec![0; 1000],
        }
        .encode()
        .unwrap();
        let mut r = FrameReader::with_limit(256);
        let mut src = &big[..4];
        assert!(r.read_frame(&mut src).is_err());
    }
}
