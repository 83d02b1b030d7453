//! The connection halves. [`SciTx`] stores into the peer's segment (slots, ring, chunks and
//! their flags/offsets) and reads acknowledgements from this process's segment; [`SciRx`]
//! reads data and offsets from this process's segment and stores acknowledgements into the
//! peer's: write remote, read local, as in the SCALE channel protocol.
//!
//! The halves are generic over the backend ([`Fabric`]): every store that publishes into the
//! peer's area, every bulk copy, wake-up and sleep goes through the fabric's wires, so one
//! protocol runs over `local` and `dolphin`, each monomorphised.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use mad_core::driver::{AbortOutcome, Armed, Incoming, LinkPair, RxLink, TmId, TxLink};
use mad_core::hostmem::rewind::{self, Publish, RecordRewind, Rewind};
use mad_core::hostmem::{index, DeathCheck, Liveness, PeerWatch, Readiness, Region};
use mad_core::liveness::{ProbeGate, Teardown};
use mad_core::{Error, Result};

use crate::fabric::{Fabric, LocalShut, OwnWire, RxWire, TxWire};
use crate::layout::{self, ctl, Flag, Geometry, Record, SLOT};

/// Longest blocking sleep before the peer's liveness is checked again: the bound on noticing
/// a dead peer while blocked (mad-core's, shared with mad-shm).
pub use mad_core::hostmem::WAIT_SLICE;

/// TM numbers.
pub const TM_SHORT: TmId = 0;
/// The ring TM.
pub const TM_RING: TmId = 1;
/// The DMA TM.
pub const TM_DMA: TmId = 2;

/// The two areas of one connection: `local` (in this process's segment, written by the peer)
/// and `remote` (in the peer's segment, written by this process).
#[derive(Clone, Debug)]
pub struct Ends {
    /// Area of this process's segment that the peer writes.
    pub local: Region,
    /// Area of the peer's segment that this process writes.
    pub remote: Region,
    /// Geometry of both.
    pub geom: Geometry,
}

impl Ends {
    /// Both areas, if they are large enough for `geom`.
    pub fn new(local: Region, remote: Region, geom: Geometry) -> Option<Self> {
        let need = geom.area_size()?;
        (local.len() >= need && remote.len() >= need).then_some(Ends {
            local,
            remote,
            geom,
        })
    }
}

#[inline]
fn w64(m: &Region, off: usize) -> &AtomicU64 {
    m.u64_at(off)
        .unwrap_or_else(|| unreachable!("area size checked by Ends::new"))
}

#[inline]
fn w32(m: &Region, off: usize) -> &AtomicU32 {
    m.u32_at(off)
        .unwrap_or_else(|| unreachable!("area size checked by Ends::new"))
}

fn slot_flag(g: &Geometry, pos: u64) -> usize {
    g.slots_off() + (pos % g.slots as u64) as usize * SLOT
}

/// The flag of the short record starting at slot `pos` (as read by the receiving half).
fn slot_record(g: &Geometry, local: &Region, pos: u64) -> Record {
    let w = w64(local, slot_flag(g, pos)).load(Ordering::Acquire);
    layout::decode_record(w, pos, g.slots as u64, layout::record_max(g.slots, pos))
}

fn chunk_flag(g: &Geometry, pos: u64) -> usize {
    g.flags_off() + (pos % g.chunks.max(1) as u64) as usize * 64
}

fn chunk_data(g: &Geometry, pos: u64) -> usize {
    g.dma_off() + (pos % g.chunks.max(1) as u64) as usize * g.chunk
}

fn bad_ack(rank: usize, what: &str) -> Error {
    Error::protocol(rank, format!("sisci: impossible {what} acknowledgement"))
}

fn oob(rank: usize) -> Error {
    Error::protocol(rank, "sisci: access outside the segment")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blocked {
    Slot,
    Ring,
    Dma,
}

/// Join the two halves of a connection through `torn`, so that an abandoned message (or the
/// channel's shutdown) tears the connection down in both directions (see
/// [`TxLink::abort_message`], [`RxLink::abort_message`]).
pub fn connection<F: Fabric>(mut tx: SciTx<F>, mut rx: SciRx<F>, torn: Arc<Teardown>) -> LinkPair
where
    SciTx<F>: 'static,
    SciRx<F>: 'static,
{
    tx.torn = Some(torn.clone());
    rx.torn = Some(torn);
    let msgs = Arc::new(AtomicU64::new(0));
    tx.rx_msgs = Some(msgs.clone());
    rx.msgs = Some(msgs);
    LinkPair {
        tx: Box::new(tx),
        rx: Box::new(rx),
    }
}

/// Whether the connection was torn down or its channel closed (one atomic load).
#[inline]
fn is_torn(torn: &Option<Arc<Teardown>>) -> bool {
    torn.as_ref().is_some_and(|t| t.is_torn())
}

/// The sending half towards one peer.
pub struct SciTx<F: Fabric> {
    peer: usize,
    e: Ends,
    wire: F::Tx,
    live: Liveness,
    slot_pos: u64,
    slot_ack: u64,
    head: u64,
    ring_ack: u64,
    /// Going back to the start of the ring when it is idle (mad-core's `hostmem::rewind`).
    rewind: Rewind,
    /// The same for the short records (in bytes: slots × 64).
    records: RecordRewind,
    /// Messages received from the peer (counted by the receiving half once joined by
    /// [`connection`]): the ring goes back only in a reply or ping-pong.
    rx_msgs: Option<Arc<AtomicU64>>,
    chunk_pos: u64,
    dma_ack: u64,
    cursor: Option<(usize, usize)>,
    /// Something of the current message was published (is visible to the peer).
    used: bool,
    blocked: Blocked,
    broken: Option<String>,
    /// The short records filled from `unpub_from` on whose flags are not published yet
    /// (first slot, bytes): short lends become visible at a commit, the end, an EXPRESS piece
    /// or back-pressure (as on mad-shm), so a message dropped before any of those is discarded
    /// whole and the connection stays intact.
    unpub: Vec<(u64, usize)>,
    unpub_from: u64,
    /// Shared with the receiving half once joined by [`connection`].
    torn: Option<Arc<Teardown>>,
    /// Rate limit of the peer-gone probe of `begin_message`.
    gate: ProbeGate,
}

/// The peer and the positions; never the bytes.
impl<F: Fabric> std::fmt::Debug for SciTx<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SciTx")
            .field("peer", &self.peer)
            .field("geometry", &self.e.geom)
            .field("slot_pos", &self.slot_pos)
            .field("head", &self.head)
            .field("chunk_pos", &self.chunk_pos)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl<F: Fabric> SciTx<F> {
    /// The sending half towards `peer`.
    pub fn new(peer: usize, e: Ends, wire: F::Tx, watch: Arc<PeerWatch>) -> Self {
        SciTx {
            peer,
            wire,
            live: Liveness::new(watch),
            slot_pos: 0,
            slot_ack: 0,
            head: 0,
            ring_ack: 0,
            rewind: Rewind::new(0),
            records: RecordRewind::default(),
            rx_msgs: None,
            chunk_pos: 0,
            dma_ack: 0,
            cursor: None,
            used: false,
            blocked: Blocked::Slot,
            broken: None,
            unpub: Vec::with_capacity(e.geom.slots),
            unpub_from: 0,
            torn: None,
            gate: ProbeGate::new(),
            e,
        }
    }

    fn check_usable(&self) -> Result<()> {
        match (&self.broken, &self.torn) {
            (Some(c), _) => Err(Error::Poisoned {
                rank: self.peer,
                cause: c.as_str().into(),
            }),
            (None, Some(t)) => t.check(self.peer),
            (None, None) => Ok(()),
        }
    }

    /// Publish the flags of the short slots filled but not yet published, in order, and wake
    /// the reader.
    fn publish_slots(&mut self) {
        self.publish_records(false);
    }

    /// [`publish_slots`](Self::publish_slots); with `jump`, the last record's flag says that
    /// the next one starts at the next lap, and this half continues there.
    fn publish_records(&mut self, jump: bool) {
        let Some(&(last, _)) = self.unpub.last() else {
            return;
        };
        let n = self.e.geom.slots as u64;
        for &(pos, len) in &self.unpub {
            self.wire.publish(
                w64(&self.e.remote, slot_flag(&self.e.geom, pos)),
                layout::encode_record(pos, n, len, jump && pos == last),
            );
        }
        if jump {
            self.slot_pos = layout::next_lap(last, n);
        }
        self.unpub.clear();
        self.unpub_from = self.slot_pos;
        self.used = true;
        self.wire.wake_reader();
    }

    /// Publish the records at a commit or the end of a message. In a ping-pong or a reply,
    /// after a short message, the last one tells the reader to go on at the next lap
    /// (`hostmem::rewind`), so short messages reuse the lines at the start of the array
    /// instead of walking all of it.
    fn publish_committed(&mut self) {
        let (n, local, ack) = (self.e.geom.slots as u64, &self.e.local, &mut self.slot_ack);
        let jump = !self.unpub.is_empty()
            && self
                .records
                .at_message_end(self.slot_pos * SLOT as u64, n * SLOT as u64, || {
                    *ack = w64(local, ctl::SHORT_ACK).load(Ordering::Acquire);
                    *ack * SLOT as u64
                });
        self.publish_records(jump);
    }

    /// Tear the connection down for both ends: the peer's receive sees our writer closed, its
    /// sends our reader closed, and our two halves fail from now on.
    fn tear_down(&mut self, cause: &str) {
        self.broken = Some(cause.into());
        self.wire.publish32(w32(&self.e.remote, ctl::W_CLOSED), 1);
        self.wire.publish32(w32(&self.e.remote, ctl::R_CLOSED), 1);
        self.wire.wake_reader();
        self.wire.wake_writer(&self.e.remote);
        if let Some(t) = &self.torn {
            t.tear(cause);
        }
    }

    fn pending(&mut self, b: Blocked) -> Result<Poll<()>> {
        // Back-pressure: what was lent must become visible, or the peer never frees room.
        self.publish_slots();
        self.blocked = b;
        if (w32(&self.e.local, ctl::R_CLOSED).load(Ordering::Acquire) != 0
            || self.live.maybe_dead())
            && !self.acked_since(b)
        {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        Ok(Poll::Pending)
    }

    /// Whether the acknowledgement this half waits for (`b`) moved past the cached value,
    /// read afresh. Called once the peer is seen closed or dead, before reporting it: the
    /// reader may have freed the slot, ring run or chunk and exited between this half's last
    /// look at the word and its look at the peer; the next attempt then proceeds instead of
    /// failing on a peer that did its part. (The closed flag is loaded with Acquire after the
    /// reader's Release store of the acknowledgement; a dead process's stores are all visible
    /// once its exit is known.)
    fn acked_since(&self, b: Blocked) -> bool {
        fence(Ordering::SeqCst);
        let (off, cached) = self.ack_of(b);
        w64(&self.e.local, off).load(Ordering::Acquire) != cached
    }

    /// The acknowledgement word and our cached value for `b`.
    fn ack_of(&self, b: Blocked) -> (usize, u64) {
        match b {
            Blocked::Slot => (ctl::SHORT_ACK, self.slot_ack),
            Blocked::Ring => (ctl::RING_ACK, self.ring_ack),
            Blocked::Dma => (ctl::DMA_ACK, self.dma_ack),
        }
    }

    /// Free slots from `slot_pos` on, contiguous up to the end of the slot array (a record
    /// never wraps), reading the acknowledgement afresh when the cached one leaves fewer than
    /// `want`.
    fn free_slots(&mut self, want: u64) -> Result<u64> {
        let n = self.e.geom.slots as u64;
        let to_end = n - self.slot_pos % n;
        let f = layout::in_flight(self.slot_pos, self.slot_ack, n)
            .ok_or_else(|| bad_ack(self.peer, "slot"))?;
        if (n - f).min(to_end) >= want {
            return Ok((n - f).min(to_end));
        }
        self.slot_ack = w64(&self.e.local, ctl::SHORT_ACK).load(Ordering::Acquire);
        let f = layout::in_flight(self.slot_pos, self.slot_ack, n)
            .ok_or_else(|| bad_ack(self.peer, "slot"))?;
        Ok((n - f).min(to_end))
    }

    /// A short lend: into the record being filled (not published yet) while it can grow
    /// within the slot array, else a new record. A record is one flag (in its first slot)
    /// and its bytes across consecutive 64-byte slots, so a short message (header, frames,
    /// pieces) is one flag and the lines of its bytes.
    fn send_short(
        &mut self,
        want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        let g = self.e.geom;
        let want = want.max(1);
        // The record being filled ends in slot `slot_pos - 1`: it grows into the next slots
        // unless that is the start of the array (a record never wraps).
        if let Some((start, used)) = self.unpub.last().copied() {
            let held = self.slot_pos - start;
            let room_now = (held as usize * SLOT).saturating_sub(8 + used);
            let more = if room_now >= want || self.slot_pos % g.slots as u64 == 0 {
                0
            } else {
                self.free_slots((8 + used + want).div_ceil(SLOT) as u64 - held)?
            };
            let room = room_now + more as usize * SLOT;
            if room > 0 {
                let n = self
                    .e
                    .remote
                    .lend_mut(slot_flag(&g, start) + 8 + used, room, fill)
                    .ok_or_else(|| oob(self.peer))?;
                let total = used + n;
                if let Some(last) = self.unpub.last_mut() {
                    last.1 = total;
                }
                self.slot_pos = start + (8 + total).div_ceil(SLOT) as u64;
                return Ok(Poll::Ready(()));
            }
        }
        let free = self.free_slots((8 + want).div_ceil(SLOT) as u64)?;
        if free == 0 {
            return self.pending(Blocked::Slot);
        }
        let start = self.slot_pos;
        let n = self
            .e
            .remote
            .lend_mut(slot_flag(&g, start) + 8, free as usize * SLOT - 8, fill)
            .ok_or_else(|| oob(self.peer))?;
        if n > 0 {
            if self.unpub.is_empty() {
                self.unpub_from = start;
            }
            self.unpub.push((start, n));
            self.slot_pos = start + (8 + n).div_ceil(SLOT) as u64;
        }
        Ok(Poll::Ready(()))
    }

    fn send_ring(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<Poll<()>> {
        let cap = self.e.geom.ring as u64;
        // After a jump to a new lap, the bytes jumped over count as read (the reader skips them).
        let mut run = index::free_run(self.head, self.rewind.floor(self.ring_ack), cap)
            .ok_or_else(|| bad_ack(self.peer, "ring"))?;
        if run.1 == 0 {
            self.ring_ack = w64(&self.e.local, ctl::RING_ACK).load(Ordering::Acquire);
            run = index::free_run(self.head, self.rewind.floor(self.ring_ack), cap)
                .ok_or_else(|| bad_ack(self.peer, "ring"))?;
            if run.1 == 0 {
                return self.pending(Blocked::Ring);
            }
        }
        let n = self
            .e
            .remote
            .lend_mut(self.e.geom.ring_off() + run.0, run.1, fill)
            .ok_or_else(|| oob(self.peer))?;
        if n > 0 {
            self.head += n as u64;
            if let Publish::JumpThenHead(from) = self.rewind.publish(self.head, cap) {
                // Ordered before the head by the publish's store barrier.
                w64(&self.e.remote, ctl::REWOUND_AT).store(from, Ordering::Relaxed);
            }
            self.wire.publish(w64(&self.e.remote, ctl::HEAD), self.head);
            self.used = true;
            self.wire.wake_reader();
        }
        Ok(Poll::Ready(()))
    }

    fn send_dma(&mut self, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        let g = self.e.geom;
        let k = g.chunks as u64;
        let (mut slice, mut off) = self.cursor.take().unwrap_or((0, 0));
        loop {
            while slice < iov.len() && off >= iov[slice].len() {
                slice += 1;
                off = 0;
            }
            if slice >= iov.len() {
                return Ok(Poll::Ready(()));
            }
            let f = layout::in_flight(self.chunk_pos, self.dma_ack, k)
                .ok_or_else(|| bad_ack(self.peer, "chunk"))?;
            if f >= k {
                self.dma_ack = w64(&self.e.local, ctl::DMA_ACK).load(Ordering::Acquire);
                let f = layout::in_flight(self.chunk_pos, self.dma_ack, k)
                    .ok_or_else(|| bad_ack(self.peer, "chunk"))?;
                if f >= k {
                    self.cursor = Some((slice, off));
                    return self.pending(Blocked::Dma);
                }
            }
            // One chunk: block copies of consecutive slices (on Dolphin: one DMA transfer).
            let base = chunk_data(&g, self.chunk_pos);
            let mut filled = 0usize;
            while filled < g.chunk && slice < iov.len() {
                let src = &iov[slice][off..];
                let n = src.len().min(g.chunk - filled);
                self.wire
                    .block_write(&self.e.remote, base, filled, &src[..n])
                    .ok_or_else(|| oob(self.peer))?;
                filled += n;
                off += n;
                if off >= iov[slice].len() {
                    slice += 1;
                    off = 0;
                }
            }
            if let Err(e) = self
                .wire
                .finish_block(self.peer, &self.e.remote, base, filled)
            {
                self.broken = Some(e.to_string());
                return Err(e);
            }
            self.wire.publish(
                w64(&self.e.remote, chunk_flag(&g, self.chunk_pos)),
                layout::encode_flag(self.chunk_pos, k, filled),
            );
            self.chunk_pos += 1;
            self.used = true;
            self.wire.wake_reader();
        }
    }
}

impl<F: Fabric> TxLink for SciTx<F> {
    fn begin_message(&mut self) -> Result<()> {
        self.check_usable()?;
        // A reader that closed, or a peer that died, while we were idle: the slots, ring and
        // chunks may take whole messages nobody will read. The close flag is a load of our
        // own area (a line the peer writes once), every time; the peer probe (a pidfd poll, or
        // SISCI on dolphin) at most once per clock tick.
        if w32(&self.e.local, ctl::R_CLOSED).load(Ordering::Acquire) != 0
            || (self.gate.due() && self.live.dead_now())
        {
            self.broken = Some("the peer closed the connection or exited".into());
            return Err(Error::PeerClosed { rank: self.peer });
        }
        self.used = false;
        let received = self
            .rx_msgs
            .as_ref()
            .map_or(0, |m| m.load(Ordering::Relaxed));
        self.records
            .at_message_start(self.slot_pos * SLOT as u64, received);
        // Every ring lend is published at once, so the head is always settled.
        let cap = self.e.geom.ring as u64;
        let (local, ring_ack) = (&self.e.local, &mut self.ring_ack);
        if let Some(to) = self
            .rewind
            .at_message_start(self.head, true, received, cap, || {
                *ring_ack = w64(local, ctl::RING_ACK).load(Ordering::Acquire);
                *ring_ack
            })
        {
            self.head = to;
        }
        Ok(())
    }

    fn with_buffer(
        &mut self,
        tm: TmId,
        want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.check_usable()?;
        match tm {
            TM_SHORT => self.send_short(want, fill),
            TM_RING => self.send_ring(fill),
            _ => Err(Error::protocol(
                self.peer,
                format!("sisci: TM {tm} is not a copy TM"),
            )),
        }
    }

    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.check_usable()?;
        if tm != TM_DMA || self.e.geom.chunks == 0 {
            return Err(Error::protocol(
                self.peer,
                format!("sisci: TM {tm} is not a gather TM"),
            ));
        }
        self.send_dma(iov)
    }

    fn commit(&mut self, _tm: TmId) -> Result<Poll<()>> {
        self.publish_committed();
        Ok(Poll::Ready(()))
    }

    fn publish(&mut self) -> Result<()> {
        self.publish_slots();
        Ok(())
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        self.check_usable()?;
        self.publish_committed();
        Ok(Poll::Ready(()))
    }

    fn abort_message(&mut self) -> AbortOutcome {
        self.cursor = None;
        if !self.used {
            // Nothing visible: the filled slots are taken back (their flags were never
            // written, so the peer sees them empty).
            if !self.unpub.is_empty() {
                self.slot_pos = self.unpub_from;
            }
            self.unpub.clear();
            self.unpub_from = self.slot_pos;
            return AbortOutcome::Discarded;
        }
        self.unpub.clear();
        // Part of the message is visible: the connection goes down both ways, so the peer's
        // receive fails instead of waiting for the rest, and its sends fail too.
        self.tear_down("a message was abandoned midway");
        AbortOutcome::Broken
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let (local, torn) = (&self.e.local, &self.torn);
        let (ack_off, cached) = self.ack_of(self.blocked);
        self.wire.sleep(local, timeout.min(WAIT_SLICE), || {
            w64(local, ack_off).load(Ordering::Acquire) != cached
                || w32(local, ctl::R_CLOSED).load(Ordering::Acquire) != 0
                || is_torn(torn)
        });
        if self.live.dead_now() && !self.acked_since(self.blocked) {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        Ok(())
    }

    /// Mark our bell armed (the reader's next acknowledgement signals the descriptor), then
    /// look: an acknowledgement since the `Pending`, a closed reader, a dead peer or a torn
    /// connection is `Busy`.
    fn arm_send(&mut self) -> Result<Armed> {
        if self.check_usable().is_err() || !self.wire.arm_send(&self.e.local) {
            return Ok(Armed::Busy);
        }
        if self.acked_since(self.blocked)
            || w32(&self.e.local, ctl::R_CLOSED).load(Ordering::Acquire) != 0
            || is_torn(&self.torn)
            || self.live.dead_now()
        {
            return Ok(Armed::Busy);
        }
        Ok(Armed::Armed)
    }
}

impl<F: Fabric> Drop for SciTx<F> {
    fn drop(&mut self) {
        self.wire.publish32(w32(&self.e.remote, ctl::W_CLOSED), 1);
        self.wire.wake_reader();
    }
}

/// Receive position shared with [`SciIncoming`] (which must know which slot to look at).
#[derive(Debug, Default)]
pub struct RxShared {
    /// Next short slot to read.
    pub slot_pos: AtomicU64,
    /// The reader's position in the data ring: `Incoming::arm` says `Busy` while the ring
    /// holds unread data (a pending receive of a large piece waits for it).
    pub ring_tail: AtomicU64,
    /// The reader's next DMA chunk (the same, for the chunks of the DMA path).
    pub chunk_pos: AtomicU64,
}

/// The receiving half from one peer.
pub struct SciRx<F: Fabric> {
    peer: usize,
    e: Ends,
    wire: F::Rx,
    live: Liveness,
    shared: Arc<RxShared>,
    slot_pos: u64,
    slot_off: usize,
    tail: u64,
    chunk_pos: u64,
    cursor: Option<(usize, usize, usize)>,
    broken: Option<String>,
    /// Shared with the sending half once joined by [`connection`].
    torn: Option<Arc<Teardown>>,
    /// Messages received, read by the sending half (see `SciTx::rx_msgs`).
    msgs: Option<Arc<AtomicU64>>,
}

/// The peer and the positions; never the bytes.
impl<F: Fabric> std::fmt::Debug for SciRx<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SciRx")
            .field("peer", &self.peer)
            .field("geometry", &self.e.geom)
            .field("slot_pos", &self.slot_pos)
            .field("tail", &self.tail)
            .field("chunk_pos", &self.chunk_pos)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl<F: Fabric> SciRx<F> {
    /// The receiving half from `peer`.
    pub fn new(
        peer: usize,
        e: Ends,
        wire: F::Rx,
        watch: Arc<PeerWatch>,
        shared: Arc<RxShared>,
    ) -> Self {
        SciRx {
            peer,
            e,
            wire,
            live: Liveness::new(watch),
            shared,
            slot_pos: 0,
            slot_off: 0,
            tail: 0,
            chunk_pos: 0,
            cursor: None,
            broken: None,
            torn: None,
            msgs: None,
        }
    }

    fn check_usable(&self) -> Result<()> {
        match (&self.broken, &self.torn) {
            (Some(c), _) => Err(Error::Poisoned {
                rank: self.peer,
                cause: c.as_str().into(),
            }),
            (None, Some(t)) if t.is_torn() => {
                // Reported once: the any-source wait stops counting this peer.
                self.live.retire();
                Err(t.error(self.peer))
            }
            _ => Ok(()),
        }
    }

    fn slot_state(&self) -> Record {
        slot_record(&self.e.geom, &self.e.local, self.slot_pos)
    }

    fn chunk_state(&self) -> Flag {
        let g = &self.e.geom;
        if g.chunks == 0 {
            return Flag::Empty;
        }
        let w = w64(&self.e.local, chunk_flag(g, self.chunk_pos)).load(Ordering::Acquire);
        layout::decode_flag(w, self.chunk_pos, g.chunks as u64, g.chunk)
    }

    fn has(&self, b: Blocked) -> bool {
        match b {
            Blocked::Slot => self.slot_state() != Record::Empty,
            Blocked::Ring => w64(&self.e.local, ctl::HEAD).load(Ordering::Acquire) != self.tail,
            Blocked::Dma => self.chunk_state() != Flag::Empty,
        }
    }

    fn has_any(&self) -> bool {
        self.has(Blocked::Slot) || self.has(Blocked::Ring) || self.has(Blocked::Dma)
    }

    fn pending(&mut self, b: Blocked) -> Result<Poll<()>> {
        let closed = w32(&self.e.local, ctl::W_CLOSED).load(Ordering::Acquire) != 0;
        if closed || self.live.maybe_dead() {
            // Re-read the flag after learning that the writer is gone: what it published
            // before closing or dying is delivered first.
            fence(Ordering::SeqCst);
            if !self.has(b) {
                return Err(self.gone());
            }
        }
        Ok(Poll::Pending)
    }

    /// The writer is gone for good: report it (once: the any-source wait stops counting
    /// this peer as ready).
    fn gone(&self) -> Error {
        self.live.retire();
        Error::PeerClosed { rank: self.peer }
    }

    fn corrupt(&self, what: &str) -> Error {
        Error::protocol(self.peer, format!("sisci: corrupt {what} flag"))
    }

    /// Wake the peer's sender if it sleeps (on `local` a remote read of its sleeper count,
    /// then a futex wake on its word; on `dolphin` nothing: blocked senders nap).
    #[inline]
    fn notify_writer(&self) {
        self.wire.wake_writer(&self.e.remote);
    }

    fn recv_short(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> Result<Poll<()>> {
        let (len, jump) = match self.slot_state() {
            Record::Empty => return self.pending(Blocked::Slot),
            Record::Corrupt => return Err(self.corrupt("slot")),
            Record::Ready { len, jump } => (len, jump),
        };
        if self.slot_off >= len {
            return Err(self.corrupt("slot"));
        }
        let off = slot_flag(&self.e.geom, self.slot_pos) + 8 + self.slot_off;
        let n = self
            .e
            .local
            .lend(off, len - self.slot_off, take)
            .ok_or_else(|| oob(self.peer))?;
        self.slot_off += n;
        if self.slot_off == len {
            // The slots after the first held bytes, and their first words may look like a
            // flag: stamped with this lap's number, each reads "empty" when the array comes
            // round to it again (as a first slot's flag does). Before the acknowledgement
            // gives them back.
            let g = self.e.geom;
            let n = g.slots as u64;
            let k = (8 + len).div_ceil(SLOT) as u64;
            for q in self.slot_pos + 1..self.slot_pos + k {
                w64(&self.e.local, slot_flag(&g, q))
                    .store(layout::encode_flag(q, n, 0), Ordering::Relaxed);
            }
            // After a record that says so, the writer went on at the next lap: the slots in
            // between keep older lap numbers, which read as empty.
            self.slot_pos = if jump {
                layout::next_lap(self.slot_pos, n)
            } else {
                self.slot_pos + k
            };
            self.slot_off = 0;
            self.shared.slot_pos.store(self.slot_pos, Ordering::Relaxed);
            self.wire
                .publish(w64(&self.e.remote, ctl::SHORT_ACK), self.slot_pos);
            self.notify_writer();
        }
        Ok(Poll::Ready(()))
    }

    fn recv_ring(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> Result<Poll<()>> {
        let cap = self.e.geom.ring as u64;
        let mut head = w64(&self.e.local, ctl::HEAD).load(Ordering::Acquire);
        // A jump of the writer's to the start of the ring (see mad-core's `hostmem::rewind`):
        // followed when reached, data ends there before.
        let at = w64(&self.e.local, ctl::REWOUND_AT).load(Ordering::Relaxed);
        match rewind::jump_ahead(at, self.tail, head, cap) {
            Ok(None) => {}
            Ok(Some((at, to))) if at == self.tail => self.tail = to,
            Ok(Some((at, _))) => head = at,
            Err(()) => return Err(self.corrupt("ring jump")),
        }
        let (pos, run) =
            index::data_run(head, self.tail, cap).ok_or_else(|| self.corrupt("ring offset"))?;
        if run == 0 {
            return self.pending(Blocked::Ring);
        }
        let n = self
            .e
            .local
            .lend(self.e.geom.ring_off() + pos, run, take)
            .ok_or_else(|| oob(self.peer))?;
        if n > 0 {
            self.tail += n as u64;
            self.shared.ring_tail.store(self.tail, Ordering::Relaxed);
            self.wire
                .publish(w64(&self.e.remote, ctl::RING_ACK), self.tail);
            self.notify_writer();
        }
        Ok(Poll::Ready(()))
    }

    fn recv_dma(&mut self, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        let g = self.e.geom;
        let total: usize = iov.iter().map(|s| s.len()).sum();
        let (mut slice, mut off, mut left) = self.cursor.take().unwrap_or((0, 0, total));
        while left > 0 {
            let len = match self.chunk_state() {
                Flag::Empty => {
                    self.cursor = Some((slice, off, left));
                    return self.pending(Blocked::Dma);
                }
                Flag::Corrupt => return Err(self.corrupt("chunk")),
                Flag::Ready(len) => len,
            };
            if !layout::chunk_fits(len, left, g.chunk) {
                return Err(Error::protocol(
                    self.peer,
                    format!("sisci: chunk of {len} B but {left} B left in the group"),
                ));
            }
            let base = chunk_data(&g, self.chunk_pos);
            let mut copied = 0usize;
            while copied < len {
                while slice < iov.len() && off >= iov[slice].len() {
                    slice += 1;
                    off = 0;
                }
                let Some(dst) = iov.get_mut(slice) else {
                    return Err(oob(self.peer));
                };
                let dst = &mut dst[off..];
                let n = dst.len().min(len - copied);
                self.e
                    .local
                    .read(base + copied, &mut dst[..n])
                    .ok_or_else(|| oob(self.peer))?;
                copied += n;
                off += n;
            }
            left -= len;
            self.chunk_pos += 1;
            self.shared
                .chunk_pos
                .store(self.chunk_pos, Ordering::Relaxed);
            self.wire
                .publish(w64(&self.e.remote, ctl::DMA_ACK), self.chunk_pos);
            self.notify_writer();
        }
        Ok(Poll::Ready(()))
    }
}

impl<F: Fabric> RxLink for SciRx<F> {
    fn end_message(&mut self) -> Result<()> {
        // This half alone writes it: a load and a store, no locked read-modify-write.
        if let Some(m) = &self.msgs {
            m.store(m.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        }
        Ok(())
    }

    fn poll_message(&mut self) -> Result<Poll<()>> {
        self.check_usable()?;
        match self.slot_state() {
            Record::Ready { .. } => Ok(Poll::Ready(())),
            Record::Corrupt => Err(self.corrupt("slot")),
            Record::Empty => self.pending(Blocked::Slot),
        }
    }

    fn with_data(
        &mut self,
        tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.check_usable()?;
        match tm {
            TM_SHORT => self.recv_short(take),
            TM_RING => self.recv_ring(take),
            _ => Err(Error::protocol(
                self.peer,
                format!("sisci: TM {tm} is not a copy TM"),
            )),
        }
    }

    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        self.check_usable()?;
        if tm != TM_DMA || self.e.geom.chunks == 0 {
            return Err(Error::protocol(
                self.peer,
                format!("sisci: TM {tm} is not a gather TM"),
            ));
        }
        self.recv_dma(iov)
    }

    fn abort_message(&mut self) {
        self.cursor = None;
        let cause = "a message was abandoned midway by the receiver";
        self.broken = Some(cause.into());
        self.live.retire();
        // Both directions: the peer's sends fail (reader closed) and so does its receive from
        // us (writer closed; its wait notices within one wait slice). Our sending half fails
        // from now on.
        self.wire.publish32(w32(&self.e.remote, ctl::R_CLOSED), 1);
        self.wire.publish32(w32(&self.e.remote, ctl::W_CLOSED), 1);
        self.notify_writer();
        if let Some(t) = &self.torn {
            t.tear(cause);
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let this = &*self;
        this.wire.sleep(timeout.min(WAIT_SLICE), || {
            this.has_any()
                || w32(&this.e.local, ctl::W_CLOSED).load(Ordering::Acquire) != 0
                || is_torn(&this.torn)
        });
        if self.live.dead_now() {
            fence(Ordering::SeqCst);
            if !self.has_any() {
                return Err(self.gone());
            }
        }
        Ok(())
    }
}

impl<F: Fabric> Drop for SciRx<F> {
    fn drop(&mut self) {
        self.wire.publish32(w32(&self.e.remote, ctl::R_CLOSED), 1);
        self.notify_writer();
    }
}

/// One watched peer of [`SciIncoming`].
#[derive(Debug)]
pub struct Watched {
    /// Its rank.
    pub rank: usize,
    /// The area it writes in this process's segment.
    pub local: Region,
    /// The receiver's slot position.
    pub shared: Arc<RxShared>,
    /// Its process, and whether the receiving half has reported it gone.
    pub watch: Arc<PeerWatch>,
    /// How the channel's shutdown closes the connection (`None`: the backend has no such
    /// shutdown; the connection closes when its halves are dropped).
    pub shut: Option<LocalShut>,
}

/// Any-source readiness: looks at the next short slot of every peer; blocks through the
/// fabric (the doorbell on `local`).
///
/// A peer counts as ready when its next slot is written, or when it closed or died and the
/// receiving half has not reported that yet; once reported it is ignored, so a wait with
/// closed peers still sleeps.
///
/// The readiness descriptor is the fabric's ([`OwnWire::readiness`]): on `local` the epoll
/// set of [`Readiness`], signalled by writers that find the doorbell armed.
pub struct SciIncoming<F: Fabric> {
    own: F::Own,
    geom: Geometry,
    peers: Vec<Watched>,
    deaths: DeathCheck,
    shut: AtomicBool,
}

impl<F: Fabric> std::fmt::Debug for SciIncoming<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<usize> = self.peers.iter().map(|w| w.rank).collect();
        f.debug_struct("SciIncoming")
            .field("geometry", &self.geom)
            .field("peers", &peers)
            .field("shut", &self.shut)
            .finish_non_exhaustive()
    }
}

impl<F: Fabric> SciIncoming<F> {
    /// Watch `peers`, sleeping through `own`.
    pub fn new(own: F::Own, geom: Geometry, peers: Vec<Watched>) -> Self {
        SciIncoming {
            own,
            geom,
            peers,
            deaths: DeathCheck::default(),
            shut: AtomicBool::new(false),
        }
    }

    fn any_ready(&self) -> bool {
        (0..self.peers.len()).any(|i| self.ready_at(i))
    }

    fn ready_at(&self, i: usize) -> bool {
        let p = &self.peers[i];
        if p.watch.retired() {
            return false;
        }
        let pos = p.shared.slot_pos.load(Ordering::Relaxed);
        slot_record(&self.geom, &p.local, pos) != Record::Empty
            || w32(&p.local, ctl::W_CLOSED).load(Ordering::Relaxed) != 0
            || p.watch.known_dead()
    }

    /// Unread data in some peer's ring (or its next slot ready, or a close): what a pending
    /// receive in the middle of a message may be waiting for.
    fn any_data(&self) -> bool {
        self.any_ready()
            || self.peers.iter().any(|p| {
                !p.watch.retired()
                    && (w64(&p.local, ctl::HEAD).load(Ordering::Acquire)
                        != p.shared.ring_tail.load(Ordering::Relaxed)
                        || self.chunk_ready(p))
            })
    }

    fn chunk_ready(&self, p: &Watched) -> bool {
        let g = &self.geom;
        if g.chunks == 0 {
            return false;
        }
        let pos = p.shared.chunk_pos.load(Ordering::Relaxed);
        let w = w64(&p.local, chunk_flag(g, pos)).load(Ordering::Acquire);
        layout::decode_flag(w, pos, g.chunks as u64, g.chunk) != Flag::Empty
    }

    fn check_deaths(&self, force: bool) {
        self.deaths.run(force, self.peers.iter().map(|p| &*p.watch));
    }
}

impl<F: Fabric> Incoming for SciIncoming<F> {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        self.check_deaths(false);
        for i in 0..self.peers.len() {
            if self.ready_at(i) {
                ready(self.peers[i].rank);
            }
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        self.own.sleep(timeout.min(WAIT_SLICE), || {
            self.any_ready() || self.shut.load(Ordering::Acquire)
        });
        self.check_deaths(true);
        Ok(())
    }

    fn wake(&self) {
        self.own.wake();
    }

    fn forget(&self, rank: usize) {
        if let Some(r) = self.own.readiness() {
            r.forget(rank);
        }
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.own.readiness().map(Readiness::fd)
    }

    /// Set the doorbell's armed bit (writers then signal), collect the sockets and the
    /// peers' pidfds, then look at every peer's next slot and ring.
    fn arm(&self) -> Result<Armed> {
        let Some(r) = self.own.readiness() else {
            return Ok(Armed::Busy);
        };
        if self.shut.load(Ordering::Acquire) {
            return Ok(Armed::Busy);
        }
        self.own.arm();
        if r.collect() || self.any_data() {
            return Ok(Armed::Busy);
        }
        Ok(Armed::Armed)
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        for p in &self.peers {
            if let Some(s) = &p.shut {
                s.shut();
            }
        }
        // Our receivers and any-source waiters sleep on the doorbell; an event loop sleeps on
        // the descriptor.
        self.own.wake();
    }
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;
    use crate::fabric::{Local, LocalRx, LocalTx};
    use crate::segment::Segment;

    type SciTx = super::SciTx<Local>;
    type SciRx = super::SciRx<Local>;

    const G: Geometry = Geometry {
        slots: 2,
        ring: 4096,
        chunk: 4096,
        chunks: 2,
    };

    /// Two segments of one process (ranks 0 and 1) and the link 0 → 1.
    fn pair(tag: &str) -> (Arc<Segment>, Arc<Segment>, SciTx, SciRx) {
        let pid = std::process::id();
        let seg = |r: usize| {
            let name = format!("{}{pid}-unit{tag}-{r}", crate::segment::PREFIX);
            Arc::new(Segment::create(&name, 2, G, &[0; 32], 2, "").unwrap())
        };
        let (a, b) = (seg(0), seg(1));
        let watch = Arc::new(PeerWatch::open(pid).unwrap());
        let tx_ends = Ends::new(a.area(1).unwrap(), b.area(0).unwrap(), G).unwrap();
        let rx_ends = Ends::new(b.area(0).unwrap(), a.area(1).unwrap(), G).unwrap();
        let tx = SciTx::new(1, tx_ends, LocalTx::new(b.clone()), watch.clone());
        let rx = SciRx::new(0, rx_ends, LocalRx::new(b.clone()), watch, Arc::default());
        (a, b, tx, rx)
    }

    fn put(tx: &mut SciTx, tm: TmId, bytes: &[u8]) -> Result<Poll<()>> {
        tx.with_buffer(tm, bytes.len(), &mut |b: &mut [u8]| {
            let k = b.len().min(bytes.len());
            b[..k].copy_from_slice(&bytes[..k]);
            k
        })
    }

    /// A short lend published at once: one slot each (consecutive unpublished short lends
    /// share a slot).
    fn put_slot(tx: &mut SciTx, bytes: &[u8]) -> Result<Poll<()>> {
        let r = put(tx, TM_SHORT, bytes)?;
        if r.is_ready() {
            tx.publish()?;
        }
        Ok(r)
    }

    fn get(rx: &mut SciRx, tm: TmId) -> Result<Poll<Vec<u8>>> {
        let mut v = Vec::new();
        let p = rx.with_data(tm, usize::MAX, &mut |b: &[u8]| {
            v.extend_from_slice(b);
            b.len()
        })?;
        Ok(p.map(|_| v))
    }

    fn is_protocol(r: &Result<impl std::fmt::Debug>) -> bool {
        matches!(r, Err(Error::Protocol { .. }))
    }

    #[test]
    fn unpublished_short_lends_make_one_record() {
        let (_a, _b, mut tx, mut rx) = pair("share");
        assert!(put(&mut tx, TM_SHORT, b"head").unwrap().is_ready());
        assert!(put(&mut tx, TM_SHORT, b"+end").unwrap().is_ready());
        assert!(put(&mut tx, TM_SHORT, &[7; 60]).unwrap().is_ready());
        tx.publish().unwrap();
        assert!(rx.poll_message().unwrap().is_ready());
        // One flag, 68 bytes across both slots of the array, taken in one lend.
        let mut first = b"head+end".to_vec();
        first.extend_from_slice(&[7; 60]);
        assert_eq!(get(&mut rx, TM_SHORT).unwrap(), Poll::Ready(first));
        assert!(get(&mut rx, TM_SHORT).unwrap().is_pending());
    }

    /// Records of every length the two-slot array takes, lap after lap, lent and read in
    /// whatever pieces the array allows: a record never wraps, and the slots its bytes
    /// covered read as empty when the array comes round to them.
    #[test]
    fn short_records_span_slots_lap_after_lap() {
        let (_a, _b, mut tx, mut rx) = pair("laps");
        for round in 0..60usize {
            let len = 1 + (round * 37) % 200;
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + round) as u8).collect();
            let (mut sent, mut got) = (0, Vec::new());
            while got.len() < len {
                if sent < len {
                    let rest = &bytes[sent..];
                    let mut k = 0;
                    let r = tx
                        .with_buffer(TM_SHORT, rest.len(), &mut |b: &mut [u8]| {
                            k = b.len().min(rest.len());
                            b[..k].copy_from_slice(&rest[..k]);
                            k
                        })
                        .unwrap();
                    if r.is_ready() {
                        sent += k;
                    }
                    tx.publish().unwrap();
                }
                match get(&mut rx, TM_SHORT).unwrap() {
                    Poll::Ready(v) => got.extend_from_slice(&v),
                    Poll::Pending => assert!(sent < len, "round {round}: published bytes unread"),
                }
            }
            assert_eq!(got, bytes, "round {round}");
            assert!(
                get(&mut rx, TM_SHORT).unwrap().is_pending(),
                "round {round}"
            );
        }
    }

    /// A flag claiming more bytes than the slots up to the end of the array hold is refused.
    #[test]
    fn a_short_record_past_the_array_end_is_corrupt() {
        let (_a, b, _tx, mut rx) = pair("past");
        let area = b.area(0).unwrap();
        w64(&area, slot_flag(&G, 0)).store(layout::encode_flag(0, 2, 121), Ordering::Release);
        assert!(is_protocol(&get(&mut rx, TM_SHORT)));
    }

    #[test]
    fn slots_ring_and_chunks_carry_bytes_and_apply_back_pressure() {
        let (_a, _b, mut tx, mut rx) = pair("ok");
        assert!(rx.poll_message().unwrap().is_pending());
        assert!(put_slot(&mut tx, b"hello").unwrap().is_ready());
        assert!(put_slot(&mut tx, &[9; 100]).unwrap().is_ready()); // 56 B lent
        assert!(
            put_slot(&mut tx, b"x").unwrap().is_pending(),
            "2 slots in flight"
        );
        assert!(rx.poll_message().unwrap().is_ready());
        assert_eq!(
            get(&mut rx, TM_SHORT).unwrap(),
            Poll::Ready(b"hello".to_vec())
        );
        assert_eq!(get(&mut rx, TM_SHORT).unwrap(), Poll::Ready(vec![9; 56]));
        assert!(
            put(&mut tx, TM_SHORT, b"x").unwrap().is_ready(),
            "acknowledged"
        );
        // Ring: fill it, then read it back.
        assert!(put(&mut tx, TM_RING, &[3; 5000]).unwrap().is_ready());
        assert!(put(&mut tx, TM_RING, &[3; 10]).unwrap().is_pending());
        assert_eq!(get(&mut rx, TM_RING).unwrap(), Poll::Ready(vec![3; 4096]));
        // DMA: 3 chunks through a 2-chunk area.
        let src: Vec<u8> = (0..3 * 4096 - 5).map(|i| i as u8).collect();
        assert!(tx
            .send_refs(TM_DMA, &[IoSlice::new(&src)])
            .unwrap()
            .is_pending());
        let mut dst = vec![0u8; src.len()];
        let (d1, d2) = dst.split_at_mut(1000);
        let mut iov = [IoSliceMut::new(d1), IoSliceMut::new(d2)];
        assert!(rx.recv_refs(TM_DMA, &mut iov).unwrap().is_pending());
        assert!(tx
            .send_refs(TM_DMA, &[IoSlice::new(&src)])
            .unwrap()
            .is_ready());
        assert!(rx.recv_refs(TM_DMA, &mut iov).unwrap().is_ready());
        assert_eq!(dst, src);
    }

    #[test]
    fn hostile_words_are_protocol_errors_not_panics() {
        let (a, b, mut tx, mut rx) = pair("bad");
        let area_b0 = b.area(0).unwrap();
        let area_a1 = a.area(1).unwrap();
        // A slot flag from two laps ahead.
        w64(&area_b0, slot_flag(&G, 0)).store(layout::encode_flag(4, 2, 8), Ordering::Release);
        assert!(is_protocol(&rx.poll_message()));
        assert!(is_protocol(&get(&mut rx, TM_SHORT)));
        // A ring head beyond the ring.
        w64(&area_b0, ctl::HEAD).store(1 << 40, Ordering::Release);
        assert!(is_protocol(&get(&mut rx, TM_RING)));
        // A chunk longer than what is left of the group.
        w64(&area_b0, chunk_flag(&G, 0)).store(layout::encode_flag(0, 2, 4096), Ordering::Release);
        let mut small = [0u8; 100];
        assert!(is_protocol(
            &rx.recv_refs(TM_DMA, &mut [IoSliceMut::new(&mut small)])
        ));
        // An acknowledgement ahead of what was sent.
        w64(&area_a1, ctl::SHORT_ACK).store(1000, Ordering::Release);
        assert!(put_slot(&mut tx, b"a").unwrap().is_ready());
        assert!(put_slot(&mut tx, b"b").unwrap().is_ready());
        assert!(is_protocol(&put_slot(&mut tx, b"c")));
        // Wrong TM numbers.
        assert!(is_protocol(&put(&mut tx, TM_DMA, b"c")));
        assert!(is_protocol(&tx.send_refs(TM_RING, &[])));
    }

    #[test]
    fn abort_and_close_semantics() {
        let (_a, _b, mut tx, mut rx) = pair("abort");
        tx.begin_message().unwrap();
        assert_eq!(tx.abort_message(), AbortOutcome::Discarded);
        // Short lends stay invisible until published: dropped, they are taken back.
        tx.begin_message().unwrap();
        assert!(put(&mut tx, TM_SHORT, b"never").unwrap().is_ready());
        assert_eq!(tx.abort_message(), AbortOutcome::Discarded);
        assert!(rx.poll_message().unwrap().is_pending());
        tx.begin_message().unwrap();
        assert!(put(&mut tx, TM_SHORT, b"half").unwrap().is_ready());
        tx.publish().unwrap();
        assert_eq!(tx.abort_message(), AbortOutcome::Broken);
        assert!(matches!(
            put(&mut tx, TM_SHORT, b"more"),
            Err(Error::Poisoned { .. })
        ));
        // Published bytes are delivered, then the closed side is reported.
        assert_eq!(
            get(&mut rx, TM_SHORT).unwrap(),
            Poll::Ready(b"half".to_vec())
        );
        assert!(matches!(
            get(&mut rx, TM_SHORT),
            Err(Error::PeerClosed { rank: 0 })
        ));
        // A receiver that goes away makes the sender fail once it must wait.
        let (_a, _b, mut tx, rx) = pair("close");
        drop(rx);
        assert!(put_slot(&mut tx, b"1").unwrap().is_ready());
        assert!(put_slot(&mut tx, b"2").unwrap().is_ready());
        assert!(matches!(
            put_slot(&mut tx, b"3"),
            Err(Error::PeerClosed { rank: 1 })
        ));
    }
}
