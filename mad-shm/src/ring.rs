//! The single-producer single-consumer byte ring, in the discipline of the SCALE shared-memory
//! channel.
//!
//! The writer copies bytes in place, then publishes its write offset (`head`) with a Release
//! store; the reader loads `head` with Acquire, copies out, then publishes its read offset
//! (`tail`) with a Release store; the writer only writes where `tail` says there is room.
//! Offsets are monotonic `u64` byte counts (no ABA, no wrap in practice), masked by the
//! power-of-two capacity. `head`, `tail` and the wake-up words live on separate 128-byte blocks
//! (two cache lines, to dodge adjacent-line prefetch), and the data area starts on its own page.
//! There is no lock: the fast path is a copy and one store per side.
//!
//! The pure index arithmetic is [`index`] (mad-core's `hostmem::index`: no memory, no
//! syscalls, tested under miri). The memory is a [`Region`] (mad-core's `hostmem`). This module
//! is the only one besides [`crate::sys`] allowed `unsafe`: it turns offsets into pointers
//! inside the region's data areas.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use mad_core::hostmem::Region;

/// Offsets inside one ring's header block (relative to the ring's start).
pub mod layout {
    /// Writer's published write offset (`u64`).
    pub const HEAD: usize = 0;
    /// Set to 1 by the writer on orderly close (`u32`), same block as `HEAD`.
    pub const WRITER_CLOSED: usize = 8;
    /// Where the writer last jumped to the start of the next lap (`u64`, a write offset;
    /// written before the `HEAD` that covers the jump, same block): the bytes from there to
    /// the lap's end are not data (segment layout version 5).
    pub const REWOUND_AT: usize = 16;
    /// Reader's published read offset (`u64`).
    pub const TAIL: usize = 128;
    /// Set to 1 by the reader on close (`u32`), on a block of its own: the writer reads it at
    /// every message start, and `TAIL`'s block is written at every message (segment layout
    /// version 6).
    pub const READER_CLOSED: usize = 896;
    /// Count of Cross Memory Attach transfers the reader completed (`u64`).
    pub const CMA_DONE: usize = 256;
    /// Futex word the reader bumps to wake a sleeping writer (`u32`).
    pub const TX_SEQ: usize = 384;
    /// Number of writer threads asleep on `TX_SEQ` (`u32`); the top bit says the writer armed
    /// its readiness descriptor (`arm_send`): the reader signals it when it frees room.
    pub const TX_SLEEPING: usize = 512;
    /// Bytes of CMA groups the reader has started copying (`u64`, monotonic): the writer
    /// waiting for a CMA completion sees it move when the copy starts.
    pub const CMA_PROGRESS: usize = 640;
    /// Number of reader threads asleep waiting for this ring in particular (`u32`): a writer
    /// that closes rings the doorbell only for them (segment layout version 3).
    pub const RX_WAITING: usize = 768;
    /// Size of the header block; the data area follows it.
    pub const HDR: usize = 4096;
}

/// The index arithmetic of the ring, free of memory accesses and syscalls (in mad-core, shared
/// with mad-sisci's ring TM; re-exported here).
pub use mad_core::hostmem::index;

/// The rules of going back to the start of the ring when idle (mad-core's
/// `hostmem::rewind`, shared with mad-sisci's ring TM).
pub use mad_core::hostmem::rewind::{self, Rewind, REWIND_AT};

/// The offsets broke the ring invariants: the peer is corrupt or hostile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corrupt {
    /// Head seen.
    pub head: u64,
    /// Tail seen.
    pub tail: u64,
}

/// One ring inside a region: its header block and data area.
#[derive(Clone, Debug)]
pub struct RingView {
    region: Region,
    base: usize,
    cap: u64,
}

impl RingView {
    /// The ring at `base` with capacity `cap`, if it fits in the region and starts on a page.
    pub fn new(region: Region, base: usize, cap: usize) -> Option<Self> {
        if !index::valid_cap(cap) || (region.as_ptr() as usize).wrapping_add(base) % 4096 != 0 {
            return None;
        }
        let end = base.checked_add(layout::HDR)?.checked_add(cap)?;
        (end <= region.len()).then_some(RingView {
            region,
            base,
            cap: cap as u64,
        })
    }

    fn u64w(&self, off: usize) -> &AtomicU64 {
        // In bounds and aligned: checked by `new` (header block < HDR <= region length).
        self.region
            .u64_at(self.base + off)
            .unwrap_or_else(|| unreachable!("ring header checked at construction"))
    }

    fn u32w(&self, off: usize) -> &AtomicU32 {
        self.region
            .u32_at(self.base + off)
            .unwrap_or_else(|| unreachable!("ring header checked at construction"))
    }

    /// Capacity in bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }
    /// Published write offset.
    pub fn head(&self) -> &AtomicU64 {
        self.u64w(layout::HEAD)
    }
    /// Published read offset.
    pub fn tail(&self) -> &AtomicU64 {
        self.u64w(layout::TAIL)
    }
    /// The writer's last jump to a new lap (see [`layout::REWOUND_AT`]).
    pub fn rewound_at(&self) -> &AtomicU64 {
        self.u64w(layout::REWOUND_AT)
    }
    /// Writer-closed flag.
    pub fn writer_closed(&self) -> &AtomicU32 {
        self.u32w(layout::WRITER_CLOSED)
    }
    /// Reader-closed flag.
    pub fn reader_closed(&self) -> &AtomicU32 {
        self.u32w(layout::READER_CLOSED)
    }
    /// CMA completion counter.
    pub fn cma_done(&self) -> &AtomicU64 {
        self.u64w(layout::CMA_DONE)
    }
    /// Bytes of CMA groups whose copy has started.
    pub fn cma_progress(&self) -> &AtomicU64 {
        self.u64w(layout::CMA_PROGRESS)
    }
    /// Reader threads asleep waiting for this ring alone.
    pub fn rx_waiting(&self) -> &AtomicU32 {
        self.u32w(layout::RX_WAITING)
    }
    /// Futex word waking the writer.
    pub fn tx_seq(&self) -> &AtomicU32 {
        self.u32w(layout::TX_SEQ)
    }
    /// Writers asleep on `tx_seq`.
    pub fn tx_sleeping(&self) -> &AtomicU32 {
        self.u32w(layout::TX_SLEEPING)
    }

    /// Hint that data byte `off` (< cap) will be read soon (a prefetch: no access, no effect
    /// on the memory model).
    #[inline]
    fn prefetch(&self, off: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.data(off);
            // SAFETY: `_mm_prefetch` is an SSE instruction (baseline on x86_64); a prefetch
            // never faults and does not access memory in the sense of the memory model.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = off;
    }

    /// Pointer to data byte `off` (< cap).
    fn data(&self, off: usize) -> *mut u8 {
        debug_assert!(off < self.cap as usize);
        // SAFETY: `base + HDR + off` is inside the region (`new` checked `base + HDR + cap`).
        unsafe { self.region.as_ptr().add(self.base + layout::HDR + off) }
    }
}

/// The writing end of a ring.
#[derive(Debug)]
pub struct Producer {
    v: RingView,
    head: u64,
    published: u64,
    tail_cache: u64,
    /// Going back to the start when idle.
    rewind: Rewind,
}

impl Producer {
    /// The writer of `v`, continuing from its published state.
    pub fn new(v: RingView) -> Self {
        let head = v.head().load(Ordering::Acquire);
        let tail = v.tail().load(Ordering::Acquire);
        Producer {
            v,
            head,
            published: head,
            tail_cache: tail,
            rewind: Rewind::new(head),
        }
    }

    /// At every message start, with `received` the messages received from the peer so far:
    /// continue at the start of the next lap (published with the message's first bytes) when
    /// [`Rewind::at_message_start`] says so (a reply or ping-pong, far enough into the lap,
    /// after a short message, the reader done with everything).
    pub fn rewind_if_idle(&mut self, received: u64) {
        let (v, tail_cache) = (&self.v, &mut self.tail_cache);
        let settled = self.head == self.published;
        if let Some(to) = self
            .rewind
            .at_message_start(self.head, settled, received, v.cap, || {
                *tail_cache = v.tail().load(Ordering::Acquire).max(*tail_cache);
                *tail_cache
            })
        {
            self.head = to;
            // The reader never reads the bytes jumped over: the whole ring is free.
            self.tail_cache = self.rewind.floor(self.tail_cache);
        }
    }

    /// The ring.
    pub fn view(&self) -> &RingView {
        &self.v
    }

    /// Local write offset (including unpublished bytes).
    pub fn position(&self) -> u64 {
        self.head
    }

    /// Bytes written but not yet published.
    pub fn unpublished(&self) -> u64 {
        self.head - self.published
    }

    /// Free bytes, refreshing the reader's offset from shared memory when the cached one says
    /// the ring is fuller than `need`.
    ///
    /// # Errors
    ///
    /// [`Corrupt`] when the shared offsets break the ring's invariants (a corrupt or hostile peer).
    pub fn free(&mut self, need: u64) -> Result<u64, Corrupt> {
        let cap = self.v.cap;
        let bad = |h, t| Corrupt { head: h, tail: t };
        let mut u =
            index::used(self.head, self.tail_cache, cap).ok_or(bad(self.head, self.tail_cache))?;
        if cap - u < need {
            // After a jump our cached offset is ahead of the reader's until it follows.
            self.tail_cache = self.rewind.floor(self.v.tail().load(Ordering::Acquire));
            u = index::used(self.head, self.tail_cache, cap)
                .ok_or(bad(self.head, self.tail_cache))?;
        }
        Ok(cap - u)
    }

    /// Lend the contiguous free run (at most `max` bytes, `max > 0`) to `fill`, which returns
    /// how many bytes it wrote. Returns that count, or `None` when the ring is full (`fill`
    /// not called).
    ///
    /// # Errors
    ///
    /// [`Corrupt`] when the shared offsets break the ring's invariants (a corrupt or hostile peer).
    pub fn lend(
        &mut self,
        max: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Option<usize>, Corrupt> {
        self.free(1)?;
        let (pos, run) =
            index::free_run(self.head, self.tail_cache, self.v.cap).ok_or(Corrupt {
                head: self.head,
                tail: self.tail_cache,
            })?;
        let run = run.min(max);
        if run == 0 {
            return Ok(None);
        }
        // SAFETY: `[pos, pos + run)` lies in the data area (`free_run` keeps it below `cap`)
        // and is free space: the reader has released it (tail) and will not read it before we
        // publish a head covering it, so this side has exclusive access while the slice lives.
        let buf = unsafe { std::slice::from_raw_parts_mut(self.v.data(pos), run) };
        let n = fill(buf).min(run);
        self.head += n as u64;
        Ok(Some(n))
    }

    /// Write all of `bytes` (wrapping around the end) if there is room for all of them;
    /// returns whether it did.
    ///
    /// # Errors
    ///
    /// [`Corrupt`] when the shared offsets break the ring's invariants (a corrupt or hostile peer).
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<bool, Corrupt> {
        if self.free(bytes.len() as u64)? < bytes.len() as u64 {
            return Ok(false);
        }
        let ((o1, l1), (o2, l2)) = index::split(self.head, bytes.len(), self.v.cap);
        // SAFETY: both runs are inside the data area (`split` bounds them by `cap`) and free
        // (checked above), hence owned by the writer until published; `bytes` is a distinct
        // local buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.v.data(o1), l1);
            if l2 > 0 {
                std::ptr::copy_nonoverlapping(bytes.as_ptr().add(l1), self.v.data(o2), l2);
            }
        }
        self.head += bytes.len() as u64;
        Ok(true)
    }

    /// Publish everything written (Release store of the head). Returns whether anything new
    /// was published.
    pub fn publish(&mut self) -> bool {
        if self.head == self.published {
            return false;
        }
        match self.rewind.publish(self.head, self.v.cap) {
            rewind::Publish::Head => {}
            rewind::Publish::Hold => return false,
            rewind::Publish::JumpThenHead(from) => {
                self.v.rewound_at().store(from, Ordering::Relaxed);
            }
        }
        self.v.head().store(self.head, Ordering::Release);
        self.published = self.head;
        true
    }

    /// Forget unpublished bytes (abort of a message nothing of which was published).
    pub fn discard_unpublished(&mut self) {
        self.head = self.published;
        self.rewind.discard(self.published);
        self.tail_cache = self.tail_cache.min(self.published);
    }

    /// How many jumps to a new lap were published (see [`rewind_if_idle`](Self::rewind_if_idle)).
    pub fn jumps(&self) -> u64 {
        self.rewind.jumps()
    }

    /// Offset published last.
    pub fn published(&self) -> u64 {
        self.published
    }
}

/// The reading end of a ring.
#[derive(Debug)]
pub struct Consumer {
    v: RingView,
    tail: u64,
    head_cache: u64,
    /// The writer jumped from here (ahead of `tail`) to the start of the next lap: data ends
    /// there for now.
    jump_at: Option<u64>,
    /// The start of the lap the writer last jumped to.
    jumped_lap: u64,
}

impl Consumer {
    /// The reader of `v`, continuing from its published state.
    pub fn new(v: RingView) -> Self {
        let tail = v.tail().load(Ordering::Acquire);
        Consumer {
            v,
            tail,
            head_cache: tail,
            jump_at: None,
            jumped_lap: 0,
        }
    }

    /// End of the readable data: the head, or the writer's jump to a new lap before it.
    #[inline]
    fn limit(&self) -> u64 {
        self.jump_at.unwrap_or(self.head_cache)
    }

    /// After a fresh load of the head: learn of a jump of the writer's in `[tail, head)` (it is
    /// followed by [`available`](Self::available) when the reader reaches it).
    fn see_jump(&mut self) -> Result<(), Corrupt> {
        // Ordered after the Acquire load of the head, which the writer stores after this.
        let at = self.v.rewound_at().load(Ordering::Relaxed);
        match rewind::jump_ahead(at, self.tail, self.head_cache, self.v.cap) {
            Ok(None) => {}
            Ok(Some((at, _))) => self.jump_at = Some(at),
            Err(()) => {
                return Err(Corrupt {
                    head: self.head_cache,
                    tail: self.tail,
                })
            }
        }
        Ok(())
    }

    /// At the writer's jump: continue at the start of the next lap.
    #[inline]
    fn follow_jump(&mut self) -> Result<(), Corrupt> {
        if self.jump_at == Some(self.tail) {
            self.tail = index::next_lap(self.tail, self.v.cap).ok_or(Corrupt {
                head: self.head_cache,
                tail: self.tail,
            })?;
            self.jumped_lap = self.tail;
            self.jump_at = None;
        }
        Ok(())
    }

    /// The ring.
    pub fn view(&self) -> &RingView {
        &self.v
    }

    /// Readable bytes, refreshing the writer's offset when the cached one shows fewer than
    /// `need`.
    ///
    /// # Errors
    ///
    /// [`Corrupt`] when the shared offsets break the ring's invariants (a corrupt or hostile peer).
    pub fn available(&mut self, need: u64) -> Result<u64, Corrupt> {
        let cap = self.v.cap;
        let bad = |h, t| Corrupt { head: h, tail: t };
        self.follow_jump()?;
        let mut a =
            index::used(self.limit(), self.tail, cap).ok_or(bad(self.limit(), self.tail))?;
        if a < need {
            // Ask for the cache line the next bytes will land in while loading `head`: when a
            // short message arrives, the writer has just written both lines, and the two
            // transfers then overlap instead of following each other. Past `REWIND_AT` an idle
            // writer starts its next message at the start of the data area instead.
            let at = self.tail & (cap - 1);
            self.v.prefetch(at as usize);
            // A short message with its header often spills into the next line.
            self.v.prefetch(((at + 64) & (cap - 1)) as usize);
            if self.tail < self.jumped_lap + cap && at >= REWIND_AT && self.jump_at.is_none() {
                // The writer came to this lap by a jump (a ping-pong): its next message may
                // start at the lap's beginning too. (Not in a stream, which wraps instead.)
                self.v.prefetch(0);
            }
            self.head_cache = self.v.head().load(Ordering::Acquire);
            if self.jump_at.is_none() {
                self.see_jump()?;
                self.follow_jump()?;
            }
            a = index::used(self.limit(), self.tail, cap).ok_or(bad(self.limit(), self.tail))?;
        }
        Ok(a)
    }

    /// Lend the contiguous readable run to `take`, which returns how many bytes it consumed;
    /// the tail is advanced locally (see [`release`](Self::release)). `None` when nothing is
    /// readable (`take` not called).
    ///
    /// # Errors
    ///
    /// [`Corrupt`] when the shared offsets break the ring's invariants (a corrupt or hostile peer).
    pub fn take(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> Result<Option<usize>, Corrupt> {
        self.available(1)?;
        let (pos, run) = index::data_run(self.limit(), self.tail, self.v.cap).ok_or(Corrupt {
            head: self.head_cache,
            tail: self.tail,
        })?;
        if run == 0 {
            return Ok(None);
        }
        // SAFETY: `[pos, pos + run)` is inside the data area and holds published bytes: the
        // writer wrote them before its Release store of head (our Acquire load) and will not
        // overwrite them before we publish a tail past them.
        let buf = unsafe { std::slice::from_raw_parts(self.v.data(pos).cast_const(), run) };
        let n = take(buf).min(run);
        self.tail += n as u64;
        Ok(Some(n))
    }

    /// Copy `out.len()` bytes from the read position without consuming them, if available.
    ///
    /// # Errors
    ///
    /// [`Corrupt`] when the shared offsets break the ring's invariants (a corrupt or hostile peer).
    pub fn peek(&mut self, out: &mut [u8]) -> Result<bool, Corrupt> {
        if self.available(out.len() as u64)? < out.len() as u64 {
            return Ok(false);
        }
        let ((o1, l1), (o2, l2)) = index::split(self.tail, out.len(), self.v.cap);
        // SAFETY: both runs are inside the data area and hold published, unreleased bytes
        // (checked above); `out` is a distinct local buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(self.v.data(o1).cast_const(), out.as_mut_ptr(), l1);
            if l2 > 0 {
                std::ptr::copy_nonoverlapping(
                    self.v.data(o2).cast_const(),
                    out.as_mut_ptr().add(l1),
                    l2,
                );
            }
        }
        Ok(true)
    }

    /// Consume `n` bytes (the caller checked they are available).
    pub fn skip(&mut self, n: u64) {
        self.tail += n;
    }

    /// Publish the read offset (Release store): the space is the writer's again.
    pub fn release(&mut self) {
        self.v.tail().store(self.tail, Ordering::Release);
    }

    /// The read position (bytes consumed since the ring was made).
    pub fn position(&self) -> u64 {
        self.tail
    }

    /// Whether the ring is (as far as the shared head says) empty.
    pub fn is_empty(&mut self) -> bool {
        matches!(self.available(1), Ok(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cap: usize) -> (Producer, Consumer) {
        let r = Region::heap(layout::HDR + cap);
        let v = RingView::new(r, 0, cap).unwrap();
        (Producer::new(v.clone()), Consumer::new(v))
    }

    #[test]
    fn ring_wraps_and_detects_corruption() {
        let (mut p, mut c) = pair(4096);
        let big = vec![7u8; 4000];
        assert!(p.write_all(&big).unwrap());
        assert!(!p.write_all(&big).unwrap(), "no room yet");
        p.publish();
        let mut got = 0;
        while got < 4000 {
            got += c.take(&mut |b: &[u8]| b.len()).unwrap().unwrap_or(0);
        }
        c.release();
        // Now the write wraps.
        let msg: Vec<u8> = (0..200u8).collect();
        assert!(p.write_all(&msg).unwrap());
        p.publish();
        let mut out = vec![0u8; 200];
        assert!(c.peek(&mut out).unwrap());
        assert_eq!(out, msg);
        c.skip(200);
        c.release();
        // A hostile reader publishing a tail past the head is caught.
        p.view().tail().store(1 << 40, Ordering::Release);
        assert!(p.write_all(&[0u8; 4096]).is_err());
    }

    /// Write one framed message (u32 length, the seed, then `len` bytes counting from `seed`) at a message boundary.
    fn put(p: &mut Producer, len: usize, seed: u8) -> bool {
        // As in a ping-pong, a message from the peer before each one: any count that changes
        // from one message to the next will do, such as the write position.
        p.rewind_if_idle(p.position());
        let mut m = (len as u32).to_le_bytes().to_vec();
        m.push(seed);
        m.extend((0..len).map(|i| seed.wrapping_add(i as u8)));
        p.write_all(&m).unwrap()
    }

    /// Read one framed message if it is all there; returns (len, seed).
    fn get(c: &mut Consumer) -> Option<(usize, u8)> {
        let mut h = [0u8; 4];
        if !c.peek(&mut h).unwrap() {
            return None;
        }
        let len = u32::from_le_bytes(h) as usize;
        let mut m = vec![0u8; 5 + len];
        if !c.peek(&mut m).unwrap() {
            return None;
        }
        c.skip(m.len() as u64);
        c.release();
        let seed = m[4];
        for (i, &x) in m[5..].iter().enumerate() {
            assert_eq!(
                x,
                seed.wrapping_add(i as u8),
                "byte {i} of a {len}-byte message"
            );
        }
        Some((len, seed))
    }

    #[test]
    fn idle_writer_jumps_back_to_the_start() {
        // (Smaller under miri, still several laps.)
        let (cap, rounds, stream) = if cfg!(miri) {
            (rewind::MIN_CAP as usize, 40, 10)
        } else {
            (1 << 20, 5000, 200)
        };
        let (mut p, mut c) = pair(cap);
        // Ping-pong: the ring is empty at every message start, so the data stays in the first
        // REWIND_AT bytes (plus one message) of every lap.
        for k in 0..rounds {
            let len = [8, 1000, 4000, 0, 333][k % 5];
            let at = p.position() & (cap as u64 - 1);
            assert!(put(&mut p, len, k as u8));
            p.publish();
            let pos = p.position() & (cap as u64 - 1);
            assert!(at < REWIND_AT + 4100, "message {k} at {at}");
            assert!(pos <= REWIND_AT + 2 * 4100, "message {k} ends at {pos}");
            assert_eq!(get(&mut c), Some((len, k as u8)));
        }
        assert!(p.position() > cap as u64, "the jumps moved through laps");
        // A stream (the reader behind) walks the whole ring: no jump while it is not empty.
        // (Its first message may jump: read it first, as a jump leaves only the bytes before
        // it free until the reader follows.)
        assert!(put(&mut p, 1000, 0));
        p.publish();
        assert_eq!(get(&mut c), Some((1000, 0)));
        let start = p.position();
        assert!(put(&mut p, 1000, 0));
        p.publish();
        for k in 1..stream {
            assert!(put(&mut p, 1000, k as u8));
            p.publish();
        }
        assert_eq!(
            p.position() - start,
            stream as u64 * 1005,
            "no jump while the ring holds data"
        );
        for k in 0..stream {
            assert_eq!(get(&mut c), Some((1000, k as u8)));
        }
        // An aborted message after a jump leaves no trace: the next one is read whole.
        while p.position() & (cap as u64 - 1) < REWIND_AT {
            assert!(put(&mut p, 1000, 1));
            p.publish();
            assert_eq!(get(&mut c), Some((1000, 1)));
        }
        // (The stream's failed tries put off the next one by REWIND_AT.)
        p.rewind = Rewind::new(p.position());
        p.rewind_if_idle(1);
        assert_eq!(p.position() & (cap as u64 - 1), 0, "jumped");
        assert!(!p.publish(), "a jump alone is not published");
        p.discard_unpublished();
        assert_ne!(p.position() & (cap as u64 - 1), 0, "the jump was discarded");
        p.rewind = Rewind::new(p.position());
        assert!(p.write_all(&[0, 0, 0, 0, 0]).unwrap());
        p.publish();
        assert_eq!(get(&mut c), Some((0, 0)));
    }

    #[test]
    fn a_hostile_jump_is_caught() {
        let cap = 1 << 16;
        let (mut p, mut c) = pair(cap);
        assert!(put(&mut p, 100, 1));
        p.publish();
        assert_eq!(get(&mut c), Some((100, 1)));
        // A jump recorded at the reader's position but to beyond the published head.
        p.view().rewound_at().store(105, Ordering::Relaxed);
        p.view().head().store(200, Ordering::Release);
        assert!(c.available(1).is_err(), "a jump past the head is corrupt");
    }

    #[test]
    fn jumps_under_threads() {
        let cap = if cfg!(miri) {
            rewind::MIN_CAP as usize
        } else {
            1 << 16
        };
        let (mut p, mut c) = pair(cap);
        let (n, pause): (usize, usize) = if cfg!(miri) { (30, 2) } else { (200_000, 64) };
        let t = std::thread::spawn(move || {
            for k in 0..n {
                // Bursts and pauses: the ring is sometimes empty at a message start.
                let len = (k * 7919) % 3000;
                while !put(&mut p, len, k as u8) {
                    std::thread::yield_now();
                }
                if k % 3 != 0 {
                    p.publish();
                }
                if k % pause == 0 {
                    // A pause: the reader catches up, and the next message may jump.
                    p.publish();
                    while p.view().tail().load(Ordering::Acquire) < p.position() {
                        std::thread::yield_now();
                    }
                }
            }
            p.publish();
            p
        });
        for k in 0..n {
            loop {
                if let Some((len, seed)) = get(&mut c) {
                    assert_eq!((len, seed), ((k * 7919) % 3000, k as u8), "message {k}");
                    break;
                }
                std::hint::spin_loop();
            }
        }
        let p = t.join().unwrap();
        assert!(p.jumps() > 0, "the writer found the ring empty sometimes");
    }

    #[test]
    fn ring_spsc_threads() {
        let (mut p, mut c) = pair(4096);
        let total: usize = if cfg!(miri) { 20_000 } else { 2_000_000 };
        let t = std::thread::spawn(move || {
            let mut sent = 0usize;
            while sent < total {
                let n = p
                    .lend(total - sent, &mut |b: &mut [u8]| {
                        for (i, x) in b.iter_mut().enumerate() {
                            *x = ((sent + i) % 251) as u8;
                        }
                        b.len()
                    })
                    .unwrap()
                    .unwrap_or(0);
                sent += n;
                p.publish();
                if n == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let mut got = 0usize;
        while got < total {
            let n = c
                .take(&mut |b: &[u8]| {
                    for (i, &x) in b.iter().enumerate() {
                        assert_eq!(x, ((got + i) % 251) as u8);
                    }
                    b.len()
                })
                .unwrap()
                .unwrap_or(0);
            got += n;
            c.release();
            if n == 0 {
                std::thread::yield_now();
            }
        }
        t.join().unwrap();
    }
}
