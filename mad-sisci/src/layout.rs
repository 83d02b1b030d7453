//! Segment geometry and the control-word codecs: pure functions, no memory, no syscalls.
//!
//! Every process exports one segment: a 4 KiB header, then one *area* per peer rank holding
//! what that peer writes remotely into this process:
//!
//! ```text
//! area + 0      control block (4 KiB), one 64-byte line per word:
//!   HEAD        ring write offset            written by the peer (sender to us)
//!   W_CLOSED    peer stopped sending to us   written by the peer
//!   SHORT_ACK   our slots the peer consumed  written by the peer (receiver of our data)
//!   RING_ACK    our ring bytes it consumed   written by the peer
//!   DMA_ACK     our chunks it consumed       written by the peer
//!   R_CLOSED    peer stopped receiving       written by the peer
//!   TX_SEQ      futex the peer bumps to wake our blocked sender
//!   TX_SLEEP    our senders asleep on TX_SEQ (written by us, read by the peer to decide a wake;
//!               top bit: our sender armed its readiness descriptor, the peer signals it)
//! area + SLOTS  short slots: `slots` × 64 B; a record = flag word (8 B) in its first slot,
//!               then its bytes across as many slots as they need (never past the last)
//! area + RING   ring data, `ring` bytes (power of two)
//! area + FLAGS  one 64-byte flag line per DMA chunk
//! area + DMA    `chunks` × `chunk` bytes
//! ```
//!
//! Each word is written by exactly one side and read by the other: a sender publishes data
//! offsets into the *receiver's* segment and reads acknowledgements from *its own*; a
//! receiver reads data and offsets from its own segment and writes acknowledgements into the
//! sender's. No location is polled by both sides.

use mad_core::hostmem::index;

/// Size of one short slot (one cache line).
pub const SLOT: usize = 64;
/// Data bytes per short slot (after the 8-byte flag word).
pub const SLOT_DATA: usize = SLOT - 8;
/// Segment header size.
pub const HEADER: usize = 4096;
/// Control block size.
pub const CTL: usize = 4096;

/// Offsets of the control words inside an area.
pub mod ctl {
    /// Ring write offset (u64).
    pub const HEAD: usize = 0;
    /// Where the writer last went back to the start of the ring (u64, a write offset; stored
    /// before the `HEAD` that covers it, same line: mad-core's `hostmem::rewind`).
    pub const REWOUND_AT: usize = 8;
    /// Writer closed (u32).
    pub const W_CLOSED: usize = 64;
    /// Slots consumed (u64).
    pub const SHORT_ACK: usize = 128;
    /// Ring bytes consumed (u64).
    pub const RING_ACK: usize = 192;
    /// DMA chunks consumed (u64).
    pub const DMA_ACK: usize = 256;
    /// Reader closed (u32).
    pub const R_CLOSED: usize = 320;
    /// Futex waking a blocked sender (u32).
    pub const TX_SEQ: usize = 384;
    /// Number of blocked senders (u32).
    pub const TX_SLEEP: usize = 448;
}

/// Segment header offsets.
pub mod hdr {
    /// Magic (u64).
    pub const MAGIC: usize = 0;
    /// Geometry words start here (8 × u64: version, ranks, slots, ring, chunk, chunks, pid, 0).
    pub const GEOM: usize = 8;
    /// Secret proof (32 bytes).
    pub const PROOF: usize = 80;
    /// Doorbell futex word (u32).
    pub const BELL: usize = 128;
    /// Doorbell sleepers (u32; top bit: the readiness descriptor is armed).
    pub const BELL_SLEEPERS: usize = 192;
}

/// Magic opening every segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"MADSCI01");
/// Layout version.
pub const VERSION: u64 = 4;

fn round_page(x: usize) -> Option<usize> {
    x.checked_add(4095).map(|v| v & !4095)
}

/// The geometry of every area of a channel (the same on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Short slots per area (power of two).
    pub slots: usize,
    /// Ring bytes (power of two, at least 4096).
    pub ring: usize,
    /// Bytes per DMA chunk (multiple of 4096).
    pub chunk: usize,
    /// Chunks per area (0: no DMA TM).
    pub chunks: usize,
}

impl Geometry {
    /// Whether the values are usable.
    pub fn valid(&self) -> bool {
        self.slots.is_power_of_two()
            && (2..=65536).contains(&self.slots)
            && index::valid_cap(self.ring)
            && self.ring <= 1 << 30
            && self.chunks <= 1024
            && (self.chunks == 0
                || (self.chunk % 4096 == 0 && (4096..=1 << 26).contains(&self.chunk)))
            && self.area_size().is_some()
    }
    /// Offset of the slots in an area.
    pub fn slots_off(&self) -> usize {
        CTL
    }
    /// Offset of the ring data.
    pub fn ring_off(&self) -> usize {
        CTL + round_page(self.slots * SLOT).unwrap_or(0)
    }
    /// Offset of the chunk flags.
    pub fn flags_off(&self) -> usize {
        self.ring_off() + self.ring
    }
    /// Offset of the chunk data.
    pub fn dma_off(&self) -> usize {
        self.flags_off() + round_page(self.chunks * 64).unwrap_or(0)
    }
    /// Bytes of one area, if it does not overflow.
    pub fn area_size(&self) -> Option<usize> {
        let s = round_page(self.slots.checked_mul(SLOT)?)?;
        let f = round_page(self.chunks.checked_mul(64)?)?;
        CTL.checked_add(s)?
            .checked_add(self.ring)?
            .checked_add(f)?
            .checked_add(self.chunks.checked_mul(self.chunk)?)
    }
    /// Bytes of a segment for `n` ranks.
    pub fn segment_size(&self, n: usize) -> Option<usize> {
        HEADER.checked_add(self.area_size()?.checked_mul(n)?)
    }
    /// Offset of the area written by rank `r`.
    pub fn area_off(&self, r: usize) -> Option<usize> {
        HEADER.checked_add(self.area_size()?.checked_mul(r)?)
    }
}

/// What a flag word (short slot or DMA chunk) says about position `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
    /// Not written yet for this position (still the previous lap's value).
    Empty,
    /// Written, with this many data bytes.
    Ready(usize),
    /// A value neither this lap nor the previous one could produce: corrupt or hostile peer.
    Corrupt,
}

/// The sequence number stamped on position `pos` of a circular array of `n` entries: the lap
/// number plus one, never 0 (fresh memory is zero).
pub fn lap_seq(pos: u64, n: u64) -> u32 {
    let lap = pos / n.max(1);
    (lap % 0xFFFF_FFFF) as u32 + 1
}

/// The flag word for position `pos` carrying `len` bytes.
pub fn encode_flag(pos: u64, n: u64, len: usize) -> u64 {
    lap_seq(pos, n) as u64 | ((len as u64 & 0xFF_FFFF) << 32)
}

/// Decode the flag word found at position `pos` (mod `n`) of an array whose entries carry at
/// most `max` bytes. Total: never panics, whatever `word` holds.
pub fn decode_flag(word: u64, pos: u64, n: u64, max: usize) -> Flag {
    let n = n.max(1);
    let seq = word as u32;
    let len = (word >> 32) as usize;
    if seq == lap_seq(pos, n) {
        if len == 0 || len > max {
            return Flag::Corrupt;
        }
        return Flag::Ready(len);
    }
    let prev = if pos < n { 0 } else { lap_seq(pos - n, n) };
    if seq == prev {
        Flag::Empty
    } else {
        Flag::Corrupt
    }
}

/// Bit of a record's flag word: the next record starts at the next lap's first slot (the
/// writer went back to the array's start; the slots in between are not records).
pub const RECORD_JUMP: u64 = 1 << 56;

/// What a short record's flag word says about slot `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// No record there yet: zero, or a number of an earlier lap (a flag, or a slot a
    /// record's bytes covered, stamped by the reader, or a slot a jump skipped).
    Empty,
    /// A record of `len` bytes; `jump`: the next one starts at the next lap.
    Ready {
        /// Its bytes.
        len: usize,
        /// [`RECORD_JUMP`] was set.
        jump: bool,
    },
    /// A number of a later lap, a length out of bounds or unknown bits: corrupt or hostile.
    Corrupt,
}

/// The flag word of a record of `len` bytes at slot `pos` of `n`, `jump` as [`RECORD_JUMP`].
pub fn encode_record(pos: u64, n: u64, len: usize, jump: bool) -> u64 {
    encode_flag(pos, n, len) | if jump { RECORD_JUMP } else { 0 }
}

/// Decode the flag word found at slot `pos` of `n` whose record may carry at most `max` bytes.
/// Unlike [`decode_flag`], any earlier lap reads as empty (slots a jump skipped keep older
/// numbers). Total: never panics, whatever `word` holds.
pub fn decode_record(word: u64, pos: u64, n: u64, max: usize) -> Record {
    let n = n.max(1);
    let seq = word as u32;
    let cur = lap_seq(pos, n);
    if seq == cur {
        let len = ((word >> 32) & 0xFF_FFFF) as usize;
        if len == 0 || len > max || word >> 57 != 0 {
            return Record::Corrupt;
        }
        return Record::Ready {
            len,
            jump: word & RECORD_JUMP != 0,
        };
    }
    // Numbers run 1..=u32::MAX and wrap: "earlier" is less than half a cycle behind.
    let behind = if seq <= cur {
        cur - seq
    } else {
        cur.wrapping_add(u32::MAX - seq)
    };
    if seq == 0 || behind < u32::MAX / 2 {
        Record::Empty
    } else {
        Record::Corrupt
    }
}

/// The first slot of the lap after the one holding `pos`.
pub fn next_lap(pos: u64, n: u64) -> u64 {
    let n = n.max(1);
    (pos / n + 1) * n
}

/// Most bytes a short record starting at slot `pos` of an array of `slots` may carry: one
/// flag word, then its bytes across the slots up to the end of the array (a record never
/// wraps).
pub fn record_max(slots: usize, pos: u64) -> usize {
    let n = slots.max(1) as u64;
    (n - pos % n) as usize * SLOT - 8
}

/// Entries in flight (`sent - acked`) if the acknowledgement is plausible: not ahead of what
/// was sent and not more than `cap` behind.
pub fn in_flight(sent: u64, acked: u64, cap: u64) -> Option<u64> {
    index::used(sent, acked, cap)
}

/// Check a DMA chunk of `len` bytes against the group: it may not exceed what is left, and
/// only the last chunk of a group may be short. Returns whether it is acceptable.
pub fn chunk_fits(len: usize, left: usize, chunk: usize) -> bool {
    len > 0 && len <= left && (len == chunk || len == left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_round_trip_and_laps() {
        let n = 8;
        for pos in [0u64, 1, 7, 8, 9, 63, 1 << 40] {
            let w = encode_flag(pos, n, 17);
            assert_eq!(decode_flag(w, pos, n, SLOT_DATA), Flag::Ready(17));
            // The same word seen one lap later is "not yet written".
            assert_eq!(decode_flag(w, pos + n, n, SLOT_DATA), Flag::Empty);
            // Two laps later it is impossible.
            assert_eq!(decode_flag(w, pos + 2 * n, n, SLOT_DATA), Flag::Corrupt);
        }
        assert_eq!(decode_flag(0, 3, n, SLOT_DATA), Flag::Empty);
        assert_eq!(decode_flag(0, 11, n, SLOT_DATA), Flag::Corrupt);
        assert_eq!(
            decode_flag(encode_flag(0, n, 57), 0, n, SLOT_DATA),
            Flag::Corrupt
        );
        assert_eq!(decode_flag(1, 0, n, SLOT_DATA), Flag::Corrupt, "len 0");
    }

    #[test]
    fn records_round_trip_earlier_laps_are_empty_later_ones_corrupt() {
        let n = 8;
        for pos in [0u64, 1, 7, 8, 9, 63, 1 << 40] {
            for jump in [false, true] {
                let w = encode_record(pos, n, 40, jump);
                let max = record_max(n as usize, pos);
                assert_eq!(
                    decode_record(w, pos, n, max),
                    Record::Ready { len: 40, jump }
                );
                // Any later lap reads it as empty (skipped slots keep older numbers).
                for laps in 1..4 {
                    assert_eq!(decode_record(w, pos + laps * n, n, max), Record::Empty);
                }
                // A word of a later lap is impossible.
                if pos >= n {
                    assert_eq!(decode_record(w, pos - n, n, max), Record::Corrupt);
                }
            }
        }
        assert_eq!(decode_record(0, 11, n, 100), Record::Empty, "never written");
        let w = encode_record(0, n, 100, false);
        assert_eq!(
            decode_record(w, 0, n, 99),
            Record::Corrupt,
            "longer than the slots"
        );
        assert_eq!(decode_record(1, 0, n, 99), Record::Corrupt, "len 0");
        assert_eq!(
            decode_record(w | 1 << 60, 0, n, 100),
            Record::Corrupt,
            "unknown bit"
        );
        // Lap numbers wrap: the last number is one lap before the first.
        let last = (0xFFFF_FFFEu64) * n; // lap_seq == u32::MAX
        assert_eq!(lap_seq(last, n), u32::MAX);
        let w = encode_record(last, n, 5, false);
        assert_eq!(decode_record(w, last + n, n, 100), Record::Empty);
        assert_eq!(next_lap(0, n), 8);
        assert_eq!(next_lap(7, n), 8);
        assert_eq!(next_lap(8, n), 16);
    }

    #[test]
    fn decoders_are_total() {
        // A cheap deterministic fuzz: no input panics.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let pos = x.rotate_left(17);
            let n = x >> 50;
            let _ = decode_flag(x, pos, n, (x >> 40) as usize);
            let _ = decode_record(x, pos, n, (x >> 40) as usize);
            let _ = next_lap(pos >> 1, n);
            let _ = record_max(n as usize, pos);
            let _ = lap_seq(pos, n);
            let _ = in_flight(x, pos, n);
            let _ = chunk_fits(x as usize, pos as usize, n as usize);
        }
        assert_eq!(
            decode_flag(u64::MAX, u64::MAX, 0, 0),
            Flag::Empty,
            "previous lap"
        );
    }

    #[test]
    fn acks_and_chunks() {
        assert_eq!(in_flight(10, 4, 8), Some(6));
        assert_eq!(in_flight(4, 10, 8), None);
        assert_eq!(in_flight(20, 4, 8), None);
        assert!(chunk_fits(4096, 10000, 4096));
        assert!(chunk_fits(100, 100, 4096));
        assert!(!chunk_fits(100, 200, 4096));
        assert!(!chunk_fits(0, 0, 4096));
        assert!(!chunk_fits(5000, 10000, 4096));
    }

    #[test]
    fn geometry() {
        let g = Geometry {
            slots: 64,
            ring: 65536,
            chunk: 65536,
            chunks: 8,
        };
        assert!(g.valid());
        assert_eq!(g.ring_off(), 8192);
        assert_eq!(g.flags_off(), 8192 + 65536);
        assert_eq!(g.dma_off(), 8192 + 65536 + 4096);
        assert_eq!(g.area_size(), Some(8192 + 65536 + 4096 + 8 * 65536));
        assert!(!Geometry { slots: 3, ..g }.valid());
        assert!(!Geometry { chunk: 100, ..g }.valid());
        assert!(Geometry { chunks: 0, ..g }.valid());
    }
}
