//! Going back to the start of a ring when it is idle: both sides' rules, free of memory
//! accesses (the drivers load and store the words), so one home serves mad-shm's rings and
//! mad-sisci's ring TM.
//!
//! A byte ring over monotonic offsets walks its whole data area. In a ping-pong of short
//! messages every new line it writes is a miss on both sides (one-way 1 KiB on the raw ring of
//! `mad-bench`: 0.28 µs with 1 MiB, 0.20 µs with 4 KiB). So at a message start, a writer that
//! is in a ping-pong or a call's reply (a message came from its peer since its last one, after
//! a burst of at most [`MAX_BURST`]), at least [`REWIND_AT`] into its lap, whose last message
//! was short ([`JUMP_AFTER`]), and whose reader has consumed everything, continues at the start
//! of the next lap. It stores the
//! offset it left ("rewound at") in a word beside its head before the Release store of the
//! head that covers the message; the reader, after loading the head, reads that word and skips
//! to the next lap when it reaches the offset ([`jump_ahead`]). A stream, which keeps the
//! ring non-empty, still walks all of it. The writer counts the skipped bytes as free at once
//! (the reader never reads them): its view of the reader's offset is [`Rewind::floor`] or more.
//! A try that finds the ring busy puts off the next one, longer each time while it stays busy
//! (a stream), so a stream seldom loads the reader's offset.

use super::index;

/// How far into its lap a writer must be before it goes back to the start (bytes).
pub const REWIND_AT: u64 = 4 << 10;

/// Longest previous message after which the writer goes back. From 16 KiB up, rewriting
/// lines the reader still holds costs more than walking on (one-way 16 KiB 1.3 → 2.3 µs on
/// mad-shm when every message went back); at 8 KiB sisci:local lost 5–10 % and mad-shm's
/// driver gained about as much; at 2–4 KiB both gain (sisci:local one-way 2 KiB 0.57–0.78 →
/// 0.48–0.57 µs, 4 KiB 0.85–1.14 → 0.72–0.83).
pub const JUMP_AFTER: u64 = 6 << 10;

/// Most messages a writer may have sent between two messages from its peer for its next turn
/// to go back: one or two is a ping-pong or a call and its reply; a longer burst is a stream
/// answered now and then (a window and its acknowledgement), which going back would make
/// rewrite the same lines window after window (mad-shm's 2 KiB window bandwidth lost 20 %).
pub const MAX_BURST: u64 = 2;

/// Rings smaller than this never go back (they stay in cache anyway).
pub const MIN_CAP: u64 = 4 * REWIND_AT;

/// Whose turn it is, counted at each message start of a writer: the rule both [`Rewind`] and
/// [`RecordRewind`] go back under (a reply or the next call of a ping-pong).
#[derive(Clone, Copy, Debug, Default)]
struct Turns {
    /// Messages received from the peer, as counted at the last message start.
    received: u64,
    /// Messages started since the last one that followed a message from the peer.
    burst: u64,
}

impl Turns {
    /// At a message start, with `received` messages received from the peer so far: whether a
    /// message came from the peer since the last start, after a burst of at most
    /// [`MAX_BURST`] of this writer's.
    #[inline]
    fn reply(&mut self, received: u64) -> bool {
        let answered = received != self.received;
        self.received = received;
        let burst = self.burst;
        self.burst = if answered { 1 } else { burst.saturating_add(1) };
        answered && burst <= MAX_BURST
    }
}

/// The writer's side: when to go back, and what to publish.
#[derive(Clone, Copy, Debug)]
pub struct Rewind {
    /// The offset the pending (unpublished) jump left.
    from: Option<u64>,
    /// No jump is tried before this offset (after one found the ring busy).
    next_try: u64,
    /// How far the next try is put off when this one finds the ring busy: doubles from
    /// [`REWIND_AT`] up to a quarter of the ring while a stream keeps it busy (each try loads
    /// the reader's offset, a line the reader keeps writing).
    backoff: u64,
    /// Where the current message started.
    msg_start: u64,
    /// Messages from the peer between this writer's.
    turns: Turns,
    /// The writer's view of the reader's offset is at least this (the last jump's target).
    floor: u64,
    /// Jumps published.
    jumps: u64,
}

/// What to store before publishing the head (see [`Rewind::publish`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publish {
    /// Publish the head as usual.
    Head,
    /// Store this offset in the "rewound at" word, then publish the head.
    JumpThenHead(u64),
    /// Nothing written after the jump yet: do not publish (a reader would see an empty lap).
    Hold,
}

impl Rewind {
    /// A writer at offset `head` (a fresh ring or a reopened one).
    pub fn new(head: u64) -> Self {
        Rewind {
            from: None,
            next_try: 0,
            backoff: REWIND_AT,
            msg_start: head,
            turns: Turns::default(),
            floor: 0,
            jumps: 0,
        }
    }

    /// At every message start, with the write offset `head` (everything before it published
    /// when `settled`) and `received`, the number of messages received from the peer so far:
    /// the offset to continue from, if the writer goes back now. Only when a message came from
    /// the peer since the last start (a reply, or the next call of a ping-pong), never in the
    /// middle of a stream, where going back makes the writer rewrite the lines its reader is
    /// still reading (mad-shm's 2 KiB window bandwidth lost 17 % that way). `tail` loads the
    /// reader's offset; it is called at most once per [`REWIND_AT`] bytes written.
    #[inline]
    pub fn at_message_start(
        &mut self,
        head: u64,
        settled: bool,
        received: u64,
        cap: u64,
        tail: impl FnOnce() -> u64,
    ) -> Option<u64> {
        let last = head.saturating_sub(self.msg_start);
        self.msg_start = head;
        let reply = self.turns.reply(received);
        if cap < MIN_CAP
            || !settled
            || !reply
            || self.from.is_some()
            || head & (cap - 1) < REWIND_AT
            || head < self.next_try
            || last > JUMP_AFTER
        {
            return None;
        }
        match index::next_lap(head, cap) {
            Some(to) if tail() == head => {
                self.from = Some(head);
                self.msg_start = to;
                self.floor = to;
                self.backoff = REWIND_AT;
                Some(to)
            }
            _ => {
                self.next_try = head.saturating_add(self.backoff);
                self.backoff = (self.backoff * 2).min(cap / 4).max(REWIND_AT);
                None
            }
        }
    }

    /// Before publishing the write offset `head`.
    #[inline]
    pub fn publish(&mut self, head: u64, cap: u64) -> Publish {
        match self.from {
            None => Publish::Head,
            Some(from) if index::next_lap(from, cap) == Some(head) => Publish::Hold,
            Some(from) => {
                self.from = None;
                self.jumps += 1;
                Publish::JumpThenHead(from)
            }
        }
    }

    /// The unpublished bytes were dropped (the writer is back at its published offset): the
    /// pending jump, if any, is forgotten.
    pub fn discard(&mut self, published: u64) {
        if self.from.take().is_some() {
            self.floor = published.min(self.floor);
            self.msg_start = published;
        }
    }

    /// The reader's offset as the writer may count it: `loaded` (from shared memory), or the
    /// last jump's target while the reader has not followed it.
    #[inline]
    pub fn floor(&self, loaded: u64) -> u64 {
        loaded.max(self.floor)
    }

    /// Jumps published so far.
    pub fn jumps(&self) -> u64 {
        self.jumps
    }
}

/// The same rules for a writer that tells its reader in the flag of a message's last record
/// (mad-sisci's short records: a flag word, then the bytes, in an array of slots): the jump is
/// decided at the end of a message, before that flag is published, and the reader continues
/// at the next lap once it has read the record. Positions and the capacity are in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordRewind {
    /// Where the current message started.
    msg_start: u64,
    /// Messages from the peer between this writer's.
    turns: Turns,
    /// The current message is a reply or the next call of a ping-pong ([`Turns::reply`]).
    reply: bool,
}

impl RecordRewind {
    /// At every message start, at write position `pos`, with `received` messages received
    /// from the peer so far.
    #[inline]
    pub fn at_message_start(&mut self, pos: u64, received: u64) {
        self.msg_start = pos;
        self.reply = self.turns.reply(received);
    }

    /// At the end of the current message, before the flag of its last record is published,
    /// the write position `pos` after it: whether the writer goes back (the flag says so and
    /// the next record starts at the next lap). As [`Rewind::at_message_start`]: a reply or
    /// the next call of a ping-pong after a burst of at most [`MAX_BURST`], at least
    /// [`REWIND_AT`] into the lap, a message of at most [`JUMP_AFTER`], an array of at least
    /// [`MIN_CAP`]; and the reader has read everything before this message and before this
    /// lap (`read` loads its position; called only when the rest holds), so the writer's
    /// position after the jump is at most `cap` ahead of it.
    #[inline]
    pub fn at_message_end(&self, pos: u64, cap: u64, read: impl FnOnce() -> u64) -> bool {
        cap >= MIN_CAP
            && self.reply
            && pos % cap >= REWIND_AT
            && pos.saturating_sub(self.msg_start) <= JUMP_AFTER
            && read() >= self.msg_start.max(pos - pos % cap)
    }
}

/// The reader's side: with its offset `tail`, a freshly loaded `head` and the "rewound at"
/// word `at` (loaded after the head), `Ok(Some((at, to)))` when the writer jumped from `at`
/// (at or ahead of `tail`, before `head`) to `to`: data ends at `at` and resumes at `to`.
/// `Ok(None)`: no jump ahead (none, or one followed already).
///
/// # Errors
///
/// `Err(())` for a jump past the head, which no honest writer publishes (the caller reports
/// its peer as corrupt or hostile).
#[inline]
#[allow(clippy::result_unit_err)]
pub fn jump_ahead(at: u64, tail: u64, head: u64, cap: u64) -> Result<Option<(u64, u64)>, ()> {
    if at < tail || at >= head || at & (cap - 1) == 0 {
        return Ok(None);
    }
    match index::next_lap(at, cap) {
        Some(to) if to <= head => Ok(Some((at, to))),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: u64 = 1 << 16;

    #[test]
    fn records_go_back_in_a_ping_pong_only() {
        let mut r = RecordRewind::default();
        // A call, its reply, the next call: each of the writer's messages follows one of the
        // peer's, so once far enough into the lap the writer goes back after it.
        r.at_message_start(0, 0);
        assert!(
            !r.at_message_end(64, CAP, || 0),
            "the first message answers nothing"
        );
        r.at_message_start(64, 1);
        assert!(!r.at_message_end(128, CAP, || 64), "too early in the lap");
        r.at_message_start(5000, 2);
        assert!(r.at_message_end(5064, CAP, || 5000));
        assert!(
            !r.at_message_end(5064, CAP, || 4999),
            "the reader is behind"
        );
        assert!(
            !r.at_message_end(5000 + JUMP_AFTER + 1, CAP, || 5000),
            "a long message"
        );
        assert!(
            !r.at_message_end(5064, MIN_CAP - 1, || panic!("not loaded")),
            "a small array"
        );
        // A message that began in the lap before: the reader must be past this lap's start.
        r.at_message_start(CAP - 100, 3);
        assert!(!r.at_message_end(CAP + 5000, CAP, || CAP - 100));
        assert!(r.at_message_end(CAP + 5000, CAP, || CAP));
        // A stream: no message from the peer in between.
        r.at_message_start(2 * CAP + 6000, 3);
        assert!(!r.at_message_end(2 * CAP + 6064, CAP, || panic!("not loaded")));
        r.at_message_start(2 * CAP + 7000, 3);
        r.at_message_start(2 * CAP + 8000, 3);
        // Answered after a burst of three: a window and its acknowledgement, no jump.
        r.at_message_start(2 * CAP + 9000, 4);
        assert!(!r.at_message_end(2 * CAP + 9064, CAP, || panic!("not loaded")));
        // The next exchange is a ping-pong again.
        r.at_message_start(2 * CAP + 10000, 5);
        assert!(r.at_message_end(2 * CAP + 10064, CAP, || 2 * CAP + 10000));
    }

    #[test]
    fn goes_back_only_when_idle_after_a_short_message() {
        let mut r = Rewind::new(0);
        // Too early in the lap.
        assert_eq!(r.at_message_start(100, true, 1, CAP, || 100), None);
        // Far enough, idle, the last message short: back to the next lap.
        assert_eq!(r.at_message_start(5000, true, 2, CAP, || 5000), Some(CAP));
        assert_eq!(r.floor(5000), CAP);
        assert_eq!(
            r.publish(CAP, CAP),
            Publish::Hold,
            "nothing after the jump yet"
        );
        assert_eq!(r.publish(CAP + 10, CAP), Publish::JumpThenHead(5000));
        assert_eq!(r.publish(CAP + 20, CAP), Publish::Head);
        assert_eq!(r.jumps(), 1);
        // The reader busy: no jump, and none tried for REWIND_AT bytes.
        let h = CAP + 5000;
        assert_eq!(r.at_message_start(h, true, 3, CAP, || h - 1), None);
        assert_eq!(
            r.at_message_start(h + 10, true, 4, CAP, || panic!("not loaded")),
            None
        );
        // Busy again, later: the next try is put off twice as far.
        let h3 = h + REWIND_AT;
        assert_eq!(r.at_message_start(h3, true, 5, CAP, || h3 - 1), None);
        assert_eq!(
            r.at_message_start(h3 + REWIND_AT, true, 6, CAP, || panic!("not loaded")),
            None
        );
        // A long last message: no jump.
        let h2 = h + REWIND_AT + 20_000;
        assert_eq!(r.at_message_start(h2, true, 7, CAP, || h2), None);
        // Unpublished bytes: no jump.
        assert_eq!(
            r.at_message_start(h2 + 100, false, 8, CAP, || h2 + 100),
            None
        );
        // A message from the peer after a burst of ten of ours (a window and its
        // acknowledgement): no jump, even when idle.
        let mut w = Rewind::new(0);
        for k in 0..10 {
            assert_eq!(w.at_message_start(100 + k, true, 1, CAP, || 100 + k), None);
        }
        assert_eq!(
            w.at_message_start(5000, true, 2, CAP, || panic!("not loaded")),
            None
        );
        // No message from the peer since the last start (a stream): no jump, even when idle.
        let mut q = Rewind::new(0);
        assert_eq!(
            q.at_message_start(5000, true, 0, CAP, || panic!("not loaded")),
            None
        );
        // A small ring never jumps.
        let mut s = Rewind::new(0);
        assert_eq!(s.at_message_start(9000, true, 9, 8192, || 9000), None);
    }

    #[test]
    fn a_discarded_jump_is_forgotten() {
        let mut r = Rewind::new(0);
        assert_eq!(r.at_message_start(5000, true, 10, CAP, || 5000), Some(CAP));
        r.discard(5000);
        assert_eq!(r.floor(5000), 5000);
        assert_eq!(r.publish(5010, CAP), Publish::Head);
    }

    #[test]
    fn the_reader_sees_jumps_ahead_and_rejects_impossible_ones() {
        // Followed already, none yet, on a lap boundary: nothing.
        assert_eq!(jump_ahead(100, 200, 300, CAP), Ok(None));
        assert_eq!(jump_ahead(300, 200, 300, CAP), Ok(None));
        assert_eq!(jump_ahead(CAP, 200, 2 * CAP, CAP), Ok(None));
        // At the reader's offset, or ahead of it.
        assert_eq!(jump_ahead(5000, 5000, CAP + 8, CAP), Ok(Some((5000, CAP))));
        assert_eq!(jump_ahead(5000, 4000, CAP + 8, CAP), Ok(Some((5000, CAP))));
        // Past the head.
        assert_eq!(jump_ahead(5000, 4000, 6000, CAP), Err(()));
        assert_eq!(jump_ahead(u64::MAX - 1, 0, u64::MAX, CAP), Err(()));
    }
}
