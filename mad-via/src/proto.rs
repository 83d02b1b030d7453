//! The VIA protocol: the paper's three transmission modules, written once over the
//! [`provider`](crate::provider) interface and run unchanged by the soft and the verbs NICs.
//!
//! # Small TM: static buffers and credits
//!
//! Each connection end posts `slots` static receive buffers on the control QP at connection
//! time; the peer starts with that many credits. Every control send (small-TM data, a CTS
//! record) consumes one. Credits come back two ways:
//!
//! * **piggybacked**: every control send carries, in its immediate data, the low 16 bits of
//!   the sender's cumulative count of receive buffers it freed (reposted) for the peer;
//! * **explicitly**: when a receiver owes at least half its buffers, or when the peer may have
//!   no credit left at all (then it could not even send a CTS), it RDMA-writes the full
//!   32-bit count into the peer's *credit word* (registered memory the peer advertised at
//!   connection time). A write needs no receive buffer and no credit, so credit returns can
//!   never deadlock.
//!
//! Data needs two credits, a CTS one: the last credit is kept for the rendezvous, so a
//! receiver whose peer has filled its buffers with unread data can still ask for the large
//! piece that peer is blocked sending. A sender without credit returns `Pending` and waits; it
//! never overruns the receiver (the soft NIC kills a connection whose peer tries).
//!
//! # Medium TM: user memory registered on the fly
//!
//! Both ends register the group's slices (through the registration cache), the receiver posts
//! receives on them and the sender posts sends from them, on the data QP, cut into work
//! requests of the provider's `max_msg` (both ends compute the same cut). A send that arrives
//! before its receive is posted waits at the receiving NIC (receiver not ready) without
//! holding up the control QP.
//!
//! # Large TM: rendezvous
//!
//! The receiver registers its destination, advertises it, posts a zero-length receive on the
//! data QP and sends a CTS (key, address, length) on the control QP; the sender RDMA-writes the
//! data into it, the last write carrying an immediate that consumes the posted receive: the
//! completion signal.
//!
//! # Event loops
//!
//! The readiness descriptor ([`Incoming::readiness_fd`]) is an epoll set ([`Events`]) of each
//! connection's first wait descriptor (soft: the control socket; verbs: the completion
//! channel) and of a wake-up socket, made at first use. A send armed with
//! [`TxLink::arm_send`] records the connection's [`Progress`]; whoever next finds it changed
//! under the connection's lock (any thread's poll of the NIC) signals the set, and the
//! sending link's own descriptors are registered one-shot for room in the NIC's queues.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use mad_core::driver::{
    AbortOutcome, Armed, Incoming, LinkPair, OpenedChannel, RxLink, TmId, TxLink,
};
use mad_core::events::{ReadinessSet, SEND_TOKEN};
use mad_core::{Error, Result};

use crate::provider::{
    Device, Dst, Interest, Interests, Nic, Qp, RecvSge, Remote, Sge, Src, WaitFds, Wc, WcKind,
};
use crate::reg::{Lease, RegCache};
use crate::wire::{self, Cts};

/// TM index of the small (static buffer) module.
pub const TM_SMALL: TmId = 0;
/// TM index of the medium (send/receive, dynamic registration) module.
pub const TM_MEDIUM: TmId = 1;
/// TM index of the large (RDMA-write rendezvous) module.
pub const TM_LARGE: TmId = 2;

/// Longest a link's `wait` blocks before re-checking (another thread may have progressed).
const WAIT_SLICE: Duration = Duration::from_millis(1);

/// Flow-control parameters of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotConfig {
    /// Number of small-TM receive buffers (the credits the peer starts with; at least 2).
    pub slots: usize,
    /// Bytes per buffer.
    pub slot_size: usize,
}

impl Default for SlotConfig {
    fn default() -> Self {
        SlotConfig {
            slots: 32,
            slot_size: 8192,
        }
    }
}

/// Counters of one connection end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnStats {
    /// Small-TM sends (static buffers).
    pub small_frames: u64,
    /// Medium-TM sends (work requests on user memory).
    pub medium_frames: u64,
    /// Rendezvous RDMA writes.
    pub rdma_frames: u64,
    /// Explicit credit returns (RDMA writes of the credit word).
    pub credit_records: u64,
    /// Times a control send found no credit and returned `Pending`.
    pub credit_stalls: u64,
    /// Credits currently available for sending.
    pub credits: u64,
}

/// A connection shared by its two links.
pub(crate) type Shared<N> = Arc<Mutex<Conn<N>>>;

pub(crate) fn lock<N: Nic>(c: &Shared<N>) -> MutexGuard<'_, Conn<N>> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// Protocol state of one connection end over its NIC.
pub(crate) struct Conn<N: Nic> {
    pub(crate) rank: usize,
    pub(crate) nic: N,
    failed: Option<String>,
    /// The first fatal error was the peer's clean close or death: every later call reports
    /// [`Error::PeerClosed`] again, as the other drivers do, not [`Error::Poisoned`].
    peer_gone: bool,
    slots: u32,
    slot_size: usize,
    /// Control sends posted (each takes one of the peer's receive buffers).
    sent: u32,
    /// The peer's cumulative count of freed buffers, as last heard.
    seen: u32,
    /// Our receive buffers freed (reposted) for the peer, cumulative.
    freed: u32,
    /// The last `freed` value the peer was told.
    told: u32,
    /// Explicit return when this many are owed.
    threshold: u32,
    /// Control sends received from the peer, cumulative.
    received: u32,
    tx_free: Vec<usize>,
    /// Static send buffer being filled: (buffer, bytes).
    tx_cur: Option<(usize, usize)>,
    /// Received small-TM data: (buffer, offset, length).
    rx_queue: VecDeque<(usize, usize, usize)>,
    cts: VecDeque<Cts>,
    /// Sends and writes completed on the data QP.
    data_tx_done: u64,
    /// Receives completed on the data QP: (wr id, length, immediate).
    data_rx: VecDeque<(u64, usize, Option<u32>)>,
    next_wr: u64,
    msg_started: bool,
    stats: ConnStats,
    wcs: Vec<Wc>,
    /// A send armed by an event loop ([`TxLink::arm_send`]) waits for the connection to move
    /// from this state; whoever sees it move signals `events`.
    tx_armed: Option<Progress>,
    /// The connection's state at the last `Incoming::arm`: a change since says that a call
    /// moved data into user space (where the descriptor cannot show it), so the next arm is
    /// `Busy` and the event loop tries again before it sleeps.
    armed_at: Option<Progress>,
    /// The channel's readiness set (none for raw endpoints).
    events: Option<Arc<Events>>,
}

/// What a blocked send may be waiting for, compared before and after: credits, control
/// receives (a CTS), send completions, free static buffers, room in the NIC's queues, the
/// connection's end. A change means the send may progress (false positives are fine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Progress {
    seen: u32,
    received: u32,
    data_tx_done: u64,
    cts: usize,
    tx_free: usize,
    backlog: usize,
    failed: bool,
    closed: bool,
}

fn chunks(total: usize, max: usize) -> usize {
    if total == 0 {
        1
    } else {
        total.div_ceil(max.max(1))
    }
}

fn chunk_len(total: usize, max: usize, k: usize) -> usize {
    total.saturating_sub(k * max).min(max)
}

/// Largest chunk of a rendezvous: a larger piece is registered and advertised in chunks of
/// this size, so the sender writes the first while both ends register the next ones.
const RDV_CHUNK: usize = 1 << 20;

/// Length of the next chunk a rendezvous receiver advertises when `left` bytes are not
/// advertised yet.
fn rdv_chunk(left: usize) -> usize {
    left.min(RDV_CHUNK)
}

/// The parts of bytes `[from, from + len)` of a list of buffers of lengths `lens`, each as
/// (buffer index, offset in it, length): what a gather or scatter list of one chunk holds.
fn window(
    lens: impl Iterator<Item = usize>,
    from: usize,
    len: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let (mut skip, mut left) = (from, len);
    lens.enumerate()
        .map_while(move |(i, n)| {
            if left == 0 {
                return None;
            }
            if skip >= n {
                skip -= n;
                return Some(None);
            }
            let take = (n - skip).min(left);
            let part = (i, skip, take);
            left -= take;
            skip = 0;
            Some(Some(part))
        })
        .flatten()
}

/// Gather or scatter list of one chunk: inline up to 4 parts (no allocation per chunk).
type Sges<T> = smallvec::SmallVec<[T; 4]>;

/// The gather list of `[from, from + len)` of `iov`.
fn gather<'a>(iov: &'a [IoSlice<'_>], lkeys: &[u32], from: usize, len: usize) -> Sges<Sge<'a>> {
    let n = iov.len().min(lkeys.len());
    window(iov[..n].iter().map(|s| s.len()), from, len)
        .map(|(i, off, take)| Sge {
            buf: &iov[i][off..off + take],
            lkey: lkeys[i],
        })
        .collect()
}

/// The scatter list of `[from, from + len)` of `iov`.
fn scatter(iov: &[IoSliceMut<'_>], lkeys: &[u32], from: usize, len: usize) -> Sges<RecvSge> {
    let n = iov.len().min(lkeys.len());
    window(iov[..n].iter().map(|s| s.len()), from, len)
        .map(|(i, off, take)| RecvSge {
            addr: iov[i].as_ptr() as usize + off,
            len: take,
            lkey: lkeys[i],
        })
        .collect()
}

impl<N: Nic> Conn<N> {
    /// A connection over `nic`: posts the static receive buffers.
    pub(crate) fn shared(mut nic: N, rank: usize, cfg: SlotConfig) -> Result<Shared<N>> {
        if cfg.slots < 2 {
            return Err(Error::BadConfig(format!(
                "via: {} static buffers: at least 2 are needed (one is kept for rendezvous requests)",
                cfg.slots
            )));
        }
        for i in 0..cfg.slots {
            nic.post_recv(Qp::Ctrl, i as u64, Dst::Slot(i))?;
        }
        let slots = cfg.slots as u32;
        let tx = nic.tx_slots();
        let mut c = Conn {
            rank,
            nic,
            failed: None,
            peer_gone: false,
            slots,
            slot_size: cfg.slot_size,
            sent: 0,
            seen: 0,
            freed: 0,
            told: 0,
            threshold: slots.div_ceil(2),
            received: 0,
            tx_free: (0..tx).rev().collect(),
            tx_cur: None,
            // Sized for what a connection can hold (a completion or record per static buffer,
            // both ways), so they do not grow on the message path.
            rx_queue: VecDeque::with_capacity(cfg.slots),
            cts: VecDeque::with_capacity(cfg.slots),
            data_tx_done: 0,
            data_rx: VecDeque::with_capacity(cfg.slots),
            next_wr: 1,
            msg_started: false,
            stats: ConnStats::default(),
            wcs: Vec::with_capacity(2 * cfg.slots + tx + 8),
            tx_armed: None,
            armed_at: None,
            events: None,
        };
        // The state the first arm compares with: a call that moved data before it says Busy.
        c.armed_at = Some(c.progress());
        Ok(Arc::new(Mutex::new(c)))
    }

    fn progress(&self) -> Progress {
        Progress {
            seen: self.seen,
            received: self.received,
            data_tx_done: self.data_tx_done,
            cts: self.cts.len(),
            tx_free: self.tx_free.len(),
            backlog: self.nic.backlog(),
            failed: self.failed.is_some(),
            closed: self.nic.peer_closed(Qp::Ctrl),
        }
    }

    /// After the connection may have moved: tell an event loop whose send waits for it.
    #[inline]
    fn moved(&mut self) {
        if let Some(p) = self.tx_armed {
            self.signal_if_moved(p);
        }
    }

    #[cold]
    fn signal_if_moved(&mut self, armed: Progress) {
        if self.progress() != armed {
            self.tx_armed = None;
            if let Some(ev) = &self.events {
                ev.send_progressed();
            }
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        match &self.failed {
            Some(_) if self.peer_gone => Err(Error::PeerClosed { rank: self.rank }),
            Some(cause) => Err(Error::Poisoned {
                rank: self.rank,
                cause: cause.as_str().into(),
            }),
            None => Ok(()),
        }
    }

    /// Record the first fatal error; tell the peer about protocol errors found here.
    pub(crate) fn guard<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if self.failed.is_none() {
                self.failed = Some(e.to_string());
                self.peer_gone = matches!(e, Error::PeerClosed { .. });
                if matches!(e, Error::Protocol { .. }) {
                    self.nic.fail(wire::ERR_PROTOCOL, &e.to_string());
                }
                self.moved();
            }
        }
        r
    }

    pub(crate) fn stats(&self) -> ConnStats {
        ConnStats {
            credits: self.credits() as u64,
            ..self.stats
        }
    }

    fn proto(&self, what: impl Into<String>) -> Error {
        Error::protocol(self.rank, what)
    }

    fn wr(&mut self) -> u64 {
        self.next_wr += 1;
        self.next_wr
    }

    fn credits(&self) -> u32 {
        self.slots.saturating_sub(self.sent.wrapping_sub(self.seen))
    }

    /// The peer says it has freed `new` buffers in all; ignore stale values.
    fn advance_seen(&mut self, new: u32) -> Result<()> {
        if (new.wrapping_sub(self.seen) as i32) <= 0 {
            return Ok(());
        }
        if (self.sent.wrapping_sub(new) as i32) < 0 {
            return Err(self.proto(format!(
                "peer returned credits for more than its {} buffers",
                self.slots
            )));
        }
        self.seen = new;
        Ok(())
    }

    /// Act on the completions known without I/O (send buffers and windows free up).
    fn reap(&mut self) -> Result<()> {
        let r = self.reap_inner();
        self.moved();
        r
    }

    fn reap_inner(&mut self) -> Result<()> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut r = self.nic.reap(&mut wcs);
        if r.is_ok() {
            for wc in wcs.drain(..) {
                r = self.on_wc(wc);
                if r.is_err() {
                    break;
                }
            }
        }
        wcs.clear();
        self.wcs = wcs;
        self.guard(r)
    }

    /// Collect completions (lending `lent` to a NIC that needs it to land data) and act on
    /// them; return credits if due.
    pub(crate) fn poll_nic(&mut self, lent: &mut [IoSliceMut<'_>]) -> Result<()> {
        let r = self.poll_nic_inner(lent);
        self.moved();
        r
    }

    fn poll_nic_inner(&mut self, lent: &mut [IoSliceMut<'_>]) -> Result<()> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut r = self.nic.poll(lent, &mut wcs);
        if r.is_ok() {
            for wc in wcs.drain(..) {
                r = self.on_wc(wc);
                if r.is_err() {
                    break;
                }
            }
        }
        wcs.clear();
        self.wcs = wcs;
        self.guard(r)?;
        let w = self.nic.credit_word() as u32;
        let r = self.advance_seen(w).and_then(|_| self.return_credits());
        self.guard(r)
    }

    fn on_wc(&mut self, wc: Wc) -> Result<()> {
        match (wc.qp, wc.kind) {
            (Qp::Ctrl, WcKind::Send | WcKind::Write) => self.tx_free.push(wc.wr_id as usize),
            (Qp::Ctrl, WcKind::Recv { len, imm }) => {
                let slot = wc.wr_id as usize;
                self.received = self.received.wrapping_add(1);
                let Some(imm) = imm else {
                    return Err(self.proto("control send without immediate data"));
                };
                let (kind, freed) = wire::decode_imm(imm).map_err(|e| self.proto(e.to_string()))?;
                let delta = freed.wrapping_sub(self.seen as u16) as i16;
                if delta > 0 {
                    self.advance_seen(self.seen.wrapping_add(delta as u32))?;
                }
                match kind {
                    wire::REC_DATA => self.rx_queue.push_back((slot, 0, len)),
                    wire::REC_CTS => {
                        let b = self.nic.rx_slot(slot);
                        let cts = Cts::decode(b.get(..len).unwrap_or(&[]))
                            .map_err(|e| self.proto(e.to_string()))?;
                        self.cts.push_back(cts);
                        self.repost(slot)?;
                    }
                    k => return Err(self.proto(format!("unknown control record kind {k}"))),
                }
            }
            (Qp::Data, WcKind::Send | WcKind::Write) => self.data_tx_done += 1,
            (Qp::Data, WcKind::Recv { len, imm }) => self.data_rx.push_back((wc.wr_id, len, imm)),
        }
        Ok(())
    }

    fn repost(&mut self, slot: usize) -> Result<()> {
        self.nic.post_recv(Qp::Ctrl, slot as u64, Dst::Slot(slot))?;
        self.freed = self.freed.wrapping_add(1);
        Ok(())
    }

    /// RDMA-write the credit count when half the buffers are owed, or when the peer may have
    /// no credit left at all (every buffer it sent is still unreturned, so it cannot even send
    /// a CTS: the buffer of a CTS it sent must come back before our application reads the
    /// data queued before it).
    fn return_credits(&mut self) -> Result<()> {
        let owed = self.freed.wrapping_sub(self.told);
        let peer_may_have = self
            .slots
            .saturating_sub(self.received.wrapping_sub(self.told));
        if owed == 0 || (owed < self.threshold && peer_may_have > 0) {
            return Ok(());
        }
        let to = self.nic.peer_credit_word();
        if to.rkey == 0 && to.addr == 0 {
            return Ok(()); // peer without a credit word (raw test endpoints): piggyback only
        }
        if self.tx_free.is_empty() {
            // Earlier credit writes may have completed without anyone reaping them.
            self.reap()?;
        }
        let Some(slot) = self.tx_free.pop() else {
            return Ok(()); // retried at the next poll, when a send buffer completes
        };
        let v = self.freed;
        self.nic.set_credit_source(slot, v as u64);
        match self
            .nic
            .post_write(Qp::Ctrl, slot as u64, Src::Slot { slot, len: 8 }, to, None)?
        {
            Poll::Ready(()) => {
                self.told = v;
                self.stats.credit_records += 1;
            }
            Poll::Pending => self.tx_free.push(slot),
        }
        Ok(())
    }

    // ---- small TM ----

    /// Transmit the current static buffer if it holds bytes. `false`: no credit (or no room).
    fn send_slot(&mut self) -> Result<bool> {
        let Some((slot, fill)) = self.tx_cur else {
            return Ok(true);
        };
        if fill == 0 {
            return Ok(true);
        }
        if self.credits() < 2 {
            self.poll_nic(&mut [])?;
            if self.credits() < 2 {
                self.stats.credit_stalls += 1;
                return Ok(false);
            }
        }
        let imm = wire::encode_imm(wire::REC_DATA, self.freed);
        match self.nic.post_send(
            Qp::Ctrl,
            slot as u64,
            Src::Slot { slot, len: fill },
            Some(imm),
        )? {
            Poll::Pending => Ok(false),
            Poll::Ready(()) => {
                self.sent = self.sent.wrapping_add(1);
                self.told = self.freed;
                self.tx_cur = None;
                self.stats.small_frames += 1;
                self.msg_started = true;
                Ok(true)
            }
        }
    }

    fn with_buffer(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> usize) -> Result<Poll<()>> {
        if matches!(self.tx_cur, Some((_, f)) if f == self.slot_size) && !self.send_slot()? {
            return Ok(Poll::Pending);
        }
        if self.tx_cur.is_none() {
            if self.tx_free.is_empty() {
                self.reap()?;
            }
            if self.tx_free.is_empty() {
                self.poll_nic(&mut [])?;
            }
            match self.tx_free.pop() {
                Some(s) => self.tx_cur = Some((s, 0)),
                None => return Ok(Poll::Pending),
            }
        }
        let Some((slot, at)) = self.tx_cur else {
            return Ok(Poll::Pending);
        };
        let size = self.slot_size;
        let n = match self.nic.tx_slot_mut(slot).get_mut(at..size) {
            Some(b) => {
                let room = b.len();
                fill(b).min(room)
            }
            None => 0,
        };
        self.tx_cur = Some((slot, at + n));
        if at + n == size {
            // Ship full buffers at once: pipelines the copy of the next one.
            self.send_slot()?;
        }
        Ok(Poll::Ready(()))
    }

    fn poll_message(&mut self) -> Result<Poll<()>> {
        if self.rx_queue.is_empty() {
            self.poll_nic(&mut [])?;
        }
        if !self.rx_queue.is_empty() {
            Ok(Poll::Ready(()))
        } else if self.nic.peer_closed(Qp::Ctrl) {
            Err(Error::PeerClosed { rank: self.rank })
        } else {
            Ok(Poll::Pending)
        }
    }

    fn with_data(&mut self, take: &mut dyn FnMut(&[u8]) -> usize) -> Result<Poll<()>> {
        if self.rx_queue.is_empty() {
            self.poll_nic(&mut [])?;
        }
        let Some(&(slot, off, len)) = self.rx_queue.front() else {
            if self.nic.peer_closed(Qp::Ctrl) {
                return Err(Error::PeerClosed { rank: self.rank });
            }
            return Ok(Poll::Pending);
        };
        let data = self.nic.rx_slot(slot).get(off..off + len).unwrap_or(&[]);
        let n = take(data).min(len);
        if n == len {
            self.rx_queue.pop_front();
            self.repost(slot)?;
            self.return_credits()?;
        } else if let Some(front) = self.rx_queue.front_mut() {
            *front = (slot, off + n, len - n);
        }
        Ok(Poll::Ready(()))
    }

    // ---- rendezvous control ----

    /// Send a CTS record. `false`: no credit or send buffer yet.
    fn send_cts(&mut self, cts: Cts) -> Result<bool> {
        if self.credits() < 1 || self.tx_free.is_empty() {
            self.poll_nic(&mut [])?;
            if self.credits() < 1 || self.tx_free.is_empty() {
                self.stats.credit_stalls += 1;
                return Ok(false);
            }
        }
        let Some(slot) = self.tx_free.pop() else {
            return Ok(false);
        };
        let n = match self.nic.tx_slot_mut(slot).get_mut(..wire::CTS_LEN) {
            Some(b) => cts.encode_into(b),
            None => return Err(self.proto("static buffers too small for a CTS record")),
        };
        let imm = wire::encode_imm(wire::REC_CTS, self.freed);
        match self
            .nic
            .post_send(Qp::Ctrl, slot as u64, Src::Slot { slot, len: n }, Some(imm))?
        {
            Poll::Pending => {
                self.tx_free.push(slot);
                Ok(false)
            }
            Poll::Ready(()) => {
                self.sent = self.sent.wrapping_add(1);
                self.told = self.freed;
                Ok(true)
            }
        }
    }

    // ---- gather TMs, send side ----

    /// Post the medium group's sends within the window; `Ready` once all completed.
    fn send_group(&mut self, iov: &[IoSlice<'_>], st: &mut TxGather) -> Result<Poll<()>> {
        let max = self.nic.max_msg();
        let win = self.nic.data_window().max(1) as u64;
        let n = chunks(st.total, max) as u64;
        loop {
            let mut full = false;
            while st.posted < n && st.posted - (self.data_tx_done - st.base) < win {
                let k = st.posted as usize;
                let (off, len) = (k * max, chunk_len(st.total, max, k));
                let sges = gather(iov, &st.lkeys, off, len);
                let wr = self.wr();
                let r = self.nic.post_send(Qp::Data, wr, Src::User(&sges), None)?;
                if r.is_pending() {
                    full = true;
                    break;
                }
                st.posted += 1;
                self.msg_started = true;
                self.stats.medium_frames += 1;
            }
            self.reap()?;
            let done = self.data_tx_done - st.base;
            if st.posted == n && done >= n {
                return Ok(Poll::Ready(()));
            }
            self.poll_nic(&mut [])?;
            if self.data_tx_done - st.base == done
                && (full || st.posted == n || st.posted - done >= win)
            {
                return Ok(Poll::Pending);
            }
        }
    }

    /// Rendezvous, sender side, with the connection's lock: write each chunk the receiver
    /// advertises (one CTS per chunk, in order, covering the piece), the last write with the
    /// completion immediate. `Ready(None)`: all written and completed; `Ready(Some((offset,
    /// len)))`: a new chunk, whose source the caller registers (unlocked) into `st.chunk_lkey`.
    fn send_large(
        &mut self,
        iov: &[IoSlice<'_>],
        st: &mut TxGather,
    ) -> Result<Poll<Option<(usize, usize)>>> {
        if iov.len() > 1 {
            return Err(self.proto("the large TM takes one slice per group"));
        }
        let max = self.nic.max_msg().max(1);
        let win = self.nic.data_window().max(1) as u64;
        loop {
            let mut full = false;
            while !st.last_posted && st.posted - (self.data_tx_done - st.base) < win {
                let (start, c) = match st.chunk {
                    Some((s, c)) if st.sent < s.saturating_add(c.len as usize) => (s, c),
                    _ => {
                        let Some(c) = self.cts.pop_front() else {
                            break;
                        };
                        let left = st.total - st.sent;
                        if c.len > left as u64 || (c.len == 0 && left != 0) {
                            return Err(self.proto(format!(
                                "the receiver advertised {} B at offset {} of a {} B rendezvous",
                                c.len, st.sent, st.total
                            )));
                        }
                        st.chunk = Some((st.sent, c));
                        // The first chunk's source was registered while the CTS came.
                        st.chunk_lkey = match st.first {
                            Some((n, lkey)) if st.sent == 0 && c.len <= n as u64 => Some(lkey),
                            _ => return Ok(Poll::Ready(Some((st.sent, c.len as usize)))),
                        };
                        (st.sent, c)
                    }
                };
                let Some(lkey) = st.chunk_lkey else {
                    return Ok(Poll::Ready(Some((start, c.len as usize))));
                };
                let at_chunk = st.sent - start;
                let len = (c.len as usize - at_chunk).min(max);
                let sges = gather(iov, &[lkey], st.sent, len);
                let last = st.sent + len == st.total;
                let at = Remote {
                    addr: c.addr.wrapping_add(at_chunk as u64),
                    rkey: c.key,
                };
                let imm = last.then_some(wire::IMM_WRITE_DONE);
                let wr = self.wr();
                if self
                    .nic
                    .post_write(Qp::Data, wr, Src::User(&sges), at, imm)?
                    .is_pending()
                {
                    full = true;
                    break;
                }
                st.posted += 1;
                st.sent += len;
                st.last_posted = last;
                self.msg_started = true;
                self.stats.rdma_frames += 1;
            }
            self.reap()?;
            let done = self.data_tx_done - st.base;
            if st.last_posted && done >= st.posted {
                return Ok(Poll::Ready(None));
            }
            let waiting_cts = self.cts.is_empty();
            self.poll_nic(&mut [])?;
            if self.data_tx_done - st.base == done && (!waiting_cts || self.cts.is_empty()) {
                let blocked = full || st.last_posted || st.posted - done >= win;
                if !blocked && self.nic.peer_closed(Qp::Ctrl) {
                    return Err(Error::PeerClosed { rank: self.rank });
                }
                return Ok(Poll::Pending);
            }
        }
    }

    // ---- gather TMs, receive side ----

    fn recv_medium(&mut self, iov: &mut [IoSliceMut<'_>], st: &mut RxGather) -> Result<Poll<()>> {
        let max = self.nic.max_msg();
        let win = self.nic.data_window().max(1);
        let n = chunks(st.total, max);
        loop {
            while st.posted < n && st.posted - st.received < win {
                let k = st.posted;
                let sges = scatter(iov, &st.lkeys, k * max, chunk_len(st.total, max, k));
                let wr = self.wr();
                self.nic.post_recv(Qp::Data, wr, Dst::User(&sges))?;
                st.posted += 1;
            }
            while let Some((_, len, imm)) = self.data_rx.pop_front() {
                let want = chunk_len(st.total, max, st.received);
                if st.received >= n || len != want || imm.is_some() {
                    return Err(self.proto(format!(
                        "medium send of {len} B for a posted receive of {want} B (group of {} B)",
                        st.total
                    )));
                }
                st.received += 1;
            }
            if st.received == n {
                return Ok(Poll::Ready(()));
            }
            self.poll_nic(iov)?;
            if self.data_rx.is_empty() {
                if self.nic.peer_closed(Qp::Data) {
                    return Err(Error::PeerClosed { rank: self.rank });
                }
                return Ok(Poll::Pending);
            }
        }
    }

    /// Rendezvous, receiver side, with the connection's lock: send the CTS of the chunk just
    /// exposed, land what the sender wrote, and say what next: `Ready(true)` the piece is
    /// complete, `Ready(false)` expose the next chunk (the caller registers it unlocked).
    fn recv_large(&mut self, iov: &mut [IoSliceMut<'_>], st: &mut RxGather) -> Result<Poll<bool>> {
        if let Some(cts) = st.next {
            if self.send_cts(cts)? {
                st.next = None;
                st.advertised += cts.len as usize;
            }
        }
        loop {
            if let Some((_, _, imm)) = self.data_rx.pop_front() {
                if imm != Some(wire::IMM_WRITE_DONE) {
                    return Err(self.proto(format!(
                        "expected the end of an RDMA write, got a receive with immediate {imm:?}"
                    )));
                }
                if st.next.is_some() || st.advertised < st.total {
                    return Err(self.proto(format!(
                        "rendezvous signalled complete with {} of {} B advertised",
                        st.advertised, st.total
                    )));
                }
                return Ok(Poll::Ready(true));
            }
            self.poll_nic(iov)?;
            if st.next.is_none() && st.advertised < st.total && self.data_rx.is_empty() {
                return Ok(Poll::Ready(false));
            }
            if self.data_rx.is_empty() {
                if self.nic.peer_closed(Qp::Data) {
                    return Err(Error::PeerClosed { rank: self.rank });
                }
                return Ok(Poll::Pending);
            }
        }
    }

    /// A data-QP receive completion (raw endpoints).
    pub(crate) fn take_data_recv(&mut self) -> Option<(u64, usize, Option<u32>)> {
        self.data_rx.pop_front()
    }

    fn ready_for_rx(&self) -> bool {
        !self.rx_queue.is_empty() || self.failed.is_some() || self.nic.peer_closed(Qp::Ctrl)
    }
}

/// Progress of a gather send across `Pending` returns.
#[derive(Debug, Default)]
struct TxGather {
    active: bool,
    total: usize,
    posted: u64,
    base: u64,
    /// Bytes posted (large TM).
    sent: usize,
    /// The advertised chunk being written: (offset in the piece, its CTS) (large TM).
    chunk: Option<(usize, Cts)>,
    /// The local key of that chunk's source, once registered (large TM).
    chunk_lkey: Option<u32>,
    /// The source of the first chunk, registered before its CTS came: (length, local key)
    /// (large TM).
    first: Option<(usize, u32)>,
    /// The write with the completion immediate is posted (large TM).
    last_posted: bool,
    leases: Vec<Lease>,
    lkeys: Vec<u32>,
}

/// Progress of a gather receive across `Pending` returns.
#[derive(Debug, Default)]
struct RxGather {
    active: bool,
    total: usize,
    posted: usize,
    received: usize,
    /// Keys of the chunks advertised so far (large TM).
    exposed: Vec<u32>,
    /// Bytes advertised (CTS sent) (large TM).
    advertised: usize,
    /// The CTS of the chunk exposed last, not sent yet (large TM).
    next: Option<Cts>,
    leases: Vec<Lease>,
    lkeys: Vec<u32>,
}

fn acquire_all<D: Device>(
    cache: &RegCache<D>,
    slices: impl Iterator<Item = (usize, usize)>,
) -> Result<Vec<Lease>> {
    let mut leases = Vec::new();
    for (a, n) in slices {
        match cache.acquire(a, n) {
            Ok(l) => leases.push(l),
            Err(e) => {
                for l in leases {
                    cache.release(l);
                }
                return Err(e);
            }
        }
    }
    Ok(leases)
}

/// Sending half of a VIA connection.
pub(crate) struct ViaTx<D: Device, N: Nic> {
    conn: Shared<N>,
    /// Rate limit of the peer-gone probe of `begin_message`.
    gate: mad_core::liveness::ProbeGate,
    cache: Arc<RegCache<D>>,
    st: TxGather,
    fds: Vec<OwnedFd>,
    /// The channel's readiness set, for `arm_send` (none for raw endpoints).
    events: Option<Arc<Events>>,
    /// The connection's state at the last `Pending` return, for `arm_send`.
    pending_at: Option<Progress>,
    /// Which of `fds` were added to the set (later armings re-enable them).
    in_set: Vec<bool>,
}

/// Receiving half of a VIA connection.
pub(crate) struct ViaRx<D: Device, N: Nic> {
    conn: Shared<N>,
    cache: Arc<RegCache<D>>,
    st: RxGather,
    fds: Vec<OwnedFd>,
}

fn dup_fds<N: Nic>(conn: &Shared<N>) -> Result<Vec<OwnedFd>> {
    let c = lock(conn);
    c.nic
        .wait_fds()
        .into_iter()
        .map(|f| {
            f.try_clone_to_owned()
                .map_err(|e| Error::io("duplicating a via descriptor", e))
        })
        .collect()
}

/// The link pair over a connection; `events`: the channel's readiness set.
pub(crate) fn links<D: Device, N: Nic>(
    conn: &Shared<N>,
    cache: &Arc<RegCache<D>>,
    events: Option<&Arc<Events>>,
) -> Result<LinkPair> {
    let fds = dup_fds(conn)?;
    Ok(LinkPair {
        tx: Box::new(ViaTx {
            conn: conn.clone(),
            gate: mad_core::liveness::ProbeGate::new(),
            cache: cache.clone(),
            st: TxGather::default(),
            in_set: vec![false; fds.len()],
            fds,
            events: events.cloned(),
            pending_at: None,
        }),
        rx: Box::new(ViaRx {
            conn: conn.clone(),
            cache: cache.clone(),
            st: RxGather::default(),
            fds: dup_fds(conn)?,
        }),
    })
}

/// Wait until one of `fds` is ready as `interest` says, at most `t`.
pub(crate) fn wait_fds(fds: &[BorrowedFd<'_>], interest: &[Interest], t: Duration) -> Result<()> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut set: smallvec::SmallVec<[PollFd<'_>; 16]> = smallvec::SmallVec::new();
    for i in interest {
        let Some(fd) = fds.get(i.fd) else { continue };
        let mut f = PollFlags::empty();
        if i.read {
            f |= PollFlags::POLLIN;
        }
        if i.write {
            f |= PollFlags::POLLOUT;
        }
        if !f.is_empty() {
            set.push(PollFd::new(*fd, f));
        }
    }
    let ms = t.as_millis().clamp(0, 60_000) as u16;
    if set.is_empty() {
        std::thread::sleep(t.min(WAIT_SLICE));
        return Ok(());
    }
    match poll(&mut set[..], PollTimeout::from(ms)) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(Error::io("poll on a via descriptor", e.into())),
    }
}

/// Block a link until its connection may progress: arm under the lock, wait outside it.
fn wait_link<N: Nic>(
    conn: &Shared<N>,
    fds: &[OwnedFd],
    message_only: bool,
    ready: impl Fn(&Conn<N>) -> bool,
    timeout: Duration,
) -> Result<()> {
    let mut interest = Interests::new();
    {
        let mut c = lock(conn);
        if ready(&c) {
            return Ok(());
        }
        if c.nic.prepare_wait(message_only, &mut interest)? {
            return Ok(());
        }
    }
    let b: WaitFds<'_> = fds.iter().map(|f| f.as_fd()).collect();
    wait_fds(&b, &interest, timeout.min(WAIT_SLICE))
}

/// Block until the connection may have progressed (raw endpoints).
pub(crate) fn wait_conn<N: Nic>(conn: &Shared<N>, message_only: bool, t: Duration) -> Result<()> {
    let fds = dup_fds(conn)?;
    wait_link(conn, &fds, message_only, |c| c.failed.is_some(), t)
}

impl<D: Device, N: Nic> ViaTx<D, N> {
    fn finish(&mut self) {
        for l in self.st.leases.drain(..) {
            self.cache.release(l);
        }
        self.st = TxGather::default();
    }
}

impl<D: Device, N: Nic> ViaTx<D, N> {
    /// Rendezvous, sender side: the source is registered chunk by chunk as the receiver
    /// advertises its destination ([`rdv_chunk`]), outside the connection's lock.
    fn send_large(&mut self, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        let base = iov.first().map_or(0, |s| s.as_ptr() as usize);
        if !self.st.active {
            let mut c = lock(&self.conn);
            c.check()?;
            if iov.len() > 1 {
                let e = c.proto("the large TM takes one slice per group");
                return c.guard(Err(e));
            }
            self.st.total = iov.iter().map(|s| s.len()).sum();
            self.st.active = true;
            self.st.base = c.data_tx_done;
            drop(c);
            // Register what the first CTS will most likely advertise while it comes.
            let len = rdv_chunk(self.st.total);
            let lease = self.cache.acquire(base, len)?;
            self.st.first = Some((len, lease.lkey()));
            self.st.leases.push(lease);
        }
        loop {
            let mut c = lock(&self.conn);
            c.check()?;
            let r = c.send_large(iov, &mut self.st);
            match c.guard(r)? {
                Poll::Pending => {
                    self.pending_at = Some(c.progress());
                    return Ok(Poll::Pending);
                }
                Poll::Ready(None) => {
                    drop(c);
                    self.finish();
                    return Ok(Poll::Ready(()));
                }
                Poll::Ready(Some((at, len))) => {
                    drop(c);
                    let lease = self.cache.acquire(base + at, len)?;
                    self.st.chunk_lkey = Some(lease.lkey());
                    self.st.leases.push(lease);
                }
            }
        }
    }
}

impl<D: Device, N: Nic> Drop for ViaTx<D, N> {
    fn drop(&mut self) {
        // The registrations belong to the sockets, which other descriptors keep open.
        if let Some(e) = &self.events {
            for (fd, _) in self.fds.iter().zip(&self.in_set).filter(|(_, r)| **r) {
                e.ready.unregister(fd.as_fd());
            }
        }
        if self.st.active {
            // Work requests may still read the user's memory: break the connection (the NIC
            // stops touching it) before the registrations go.
            lock(&self.conn).nic.fail(
                wire::ERR_PROTOCOL,
                "sending link dropped in the middle of a transfer",
            );
        }
        self.finish();
    }
}

impl<D: Device, N: Nic> TxLink for ViaTx<D, N> {
    fn begin_message(&mut self) -> Result<()> {
        let mut c = lock(&self.conn);
        c.check()?;
        // A peer gone while we were idle: asked at most once per clock tick.
        if self.gate.due() && c.nic.hung_up() {
            c.failed
                .get_or_insert_with(|| "the peer closed the connection".to_string());
            return Err(Error::PeerClosed { rank: c.rank });
        }
        c.msg_started = false;
        Ok(())
    }

    fn with_buffer(
        &mut self,
        tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if tm != TM_SMALL {
            return Err(c.proto(format!("TM {tm} is not a copy TM")));
        }
        let r = c.with_buffer(fill);
        let r = c.guard(r)?;
        if r.is_pending() {
            self.pending_at = Some(c.progress());
        }
        Ok(r)
    }

    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        if tm == TM_LARGE {
            return self.send_large(iov);
        }
        if !self.st.active {
            lock(&self.conn).check()?;
            let leases = acquire_all(
                &self.cache,
                iov.iter().map(|s| (s.as_ptr() as usize, s.len())),
            )?;
            self.st.lkeys = leases.iter().map(|l| l.lkey()).collect();
            self.st.leases = leases;
            self.st.total = iov.iter().map(|s| s.len()).sum();
            self.st.active = true;
            self.st.base = lock(&self.conn).data_tx_done;
        }
        let mut c = lock(&self.conn);
        c.check()?;
        let r = match tm {
            TM_MEDIUM => c.send_group(iov, &mut self.st),
            _ => Err(c.proto(format!("TM {tm} is not a gather TM"))),
        };
        let r = c.guard(r)?;
        if r.is_pending() {
            self.pending_at = Some(c.progress());
        }
        drop(c);
        if r.is_ready() {
            self.finish();
        }
        Ok(r)
    }

    fn commit(&mut self, tm: TmId) -> Result<Poll<()>> {
        if tm != TM_SMALL {
            return Ok(Poll::Ready(()));
        }
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.send_slot();
        Ok(if c.guard(r)? {
            Poll::Ready(())
        } else {
            self.pending_at = Some(c.progress());
            Poll::Pending
        })
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.send_slot();
        if !c.guard(r)? {
            self.pending_at = Some(c.progress());
            return Ok(Poll::Pending);
        }
        // Flushes the soft NIC's queues and hears about errors the peer reported.
        c.poll_nic(&mut [])?;
        Ok(if c.nic.transmit_pending() {
            self.pending_at = Some(c.progress());
            Poll::Pending
        } else {
            Poll::Ready(())
        })
    }

    fn flush(&mut self) -> Result<Poll<()>> {
        // `Packer::flush`: the partly filled static buffer must leave even if it has to wait
        // for a credit (`publish` only tries), and the NIC's queues drain: what `end_message`
        // does, without ending anything. (Falling back on `publish` returned `Ready` with the
        // buffer still here when no credit was left: the kit's `flush` case hung with two
        // static buffers.)
        self.end_message()
    }

    fn publish(&mut self) -> Result<()> {
        // The receiver needs the EXPRESS piece now: send the partly filled static buffer.
        // Without this, a sender blocked in a rendezvous on another connection (waiting for a
        // CTS the receiver will only send after reading this message) never lets it go: the
        // kit's `two_channels` case with the large TM hung this way.
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.send_slot();
        c.guard(r).map(|_| ())
    }

    fn abort_message(&mut self) -> AbortOutcome {
        let mut c = lock(&self.conn);
        let in_flight = self.st.active && self.st.posted > c.data_tx_done - self.st.base;
        if !c.msg_started && !c.nic.transmit_pending() && !in_flight {
            if let Some((slot, _)) = c.tx_cur.take() {
                c.tx_free.push(slot);
            }
            drop(c);
            self.finish();
            return AbortOutcome::Discarded;
        }
        if let Some((slot, _)) = c.tx_cur.take() {
            c.tx_free.push(slot);
        }
        c.failed
            .get_or_insert_with(|| "a message was abandoned midway".to_string());
        if in_flight {
            c.nic
                .fail(wire::ERR_PROTOCOL, "a message was abandoned midway");
        }
        // Part of the message left: the connection goes down both ways, so the peer's
        // receive fails instead of waiting for the rest, and its sends fail too.
        c.nic.tear_down();
        drop(c);
        self.finish();
        AbortOutcome::Broken
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        wait_link(
            &self.conn,
            &self.fds,
            false,
            |c| !c.cts.is_empty() || c.failed.is_some(),
            timeout,
        )
    }

    fn arm_send(&mut self) -> Result<Armed> {
        let Some(events) = &self.events else {
            return Ok(Armed::Busy);
        };
        events.ready.make()?;
        let mut c = lock(&self.conn);
        if c.failed.is_some() {
            return Ok(Armed::Busy); // the send call reports it
        }
        let before = self.pending_at.take().unwrap_or_else(|| c.progress());
        // Hear what came (credits, a CTS, completions) and push the NIC's queues, as the send
        // would: anything that moved since the `Pending` return means it may progress now.
        if c.poll_nic(&mut []).is_err() {
            return Ok(Armed::Busy);
        }
        let now = c.progress();
        if now != before {
            return Ok(Armed::Busy);
        }
        let mut interest = Interests::new();
        if c.nic.prepare_wait(false, &mut interest)? {
            return Ok(Armed::Busy);
        }
        // Armed under the connection's lock: every later poll of the NIC compares.
        c.tx_armed = Some(now);
        // What only the wire can bring: room in the NIC's queues, data-QP input. The first
        // descriptor's input (control traffic: credits, CTS) is in the channel's set already.
        for i in &interest {
            let read = i.read && i.fd != 0;
            let Some(fd) = self.fds.get(i.fd) else {
                continue;
            };
            if !i.write && !read {
                continue;
            }
            events
                .ready
                .register_once(fd.as_fd(), i.write, read, SEND_TOKEN, self.in_set[i.fd])?;
            self.in_set[i.fd] = true;
        }
        Ok(Armed::Armed)
    }
}

impl<D: Device, N: Nic> ViaRx<D, N> {
    fn finish(&mut self) {
        if !self.st.exposed.is_empty() {
            let mut c = lock(&self.conn);
            for key in self.st.exposed.drain(..) {
                c.nic.unexpose(key);
            }
        }
        for l in self.st.leases.drain(..) {
            self.cache.release(l);
        }
        self.st = RxGather::default();
    }

    /// Cancel what points into the user's memory, then let the registrations go.
    fn cancel(&mut self) {
        if self.st.active {
            lock(&self.conn).nic.cancel_user_receives();
        }
        self.finish();
    }
}

impl<D: Device, N: Nic> ViaRx<D, N> {
    /// Rendezvous, receiver side: register and advertise the destination chunk by chunk
    /// ([`rdv_chunk`]), so the sender writes the first chunks while the next are registered.
    fn recv_large(&mut self, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        if iov.len() != 1 {
            let mut c = lock(&self.conn);
            let e = c.proto("the large TM takes one slice per group");
            return c.guard(Err(e));
        }
        let base = iov[0].as_ptr() as usize;
        if !self.st.active {
            lock(&self.conn).check()?;
            self.st.total = iov[0].len();
            self.st.active = true;
        }
        loop {
            let first = self.st.exposed.is_empty();
            if self.st.next.is_none() && (first || self.st.advertised < self.st.total) {
                let at = self.st.advertised;
                let len = rdv_chunk(self.st.total - at);
                // Registration (`mlock` on soft) outside the connection's lock.
                let lease = self.cache.acquire(base + at, len)?;
                let keys = (lease.lkey(), lease.rkey());
                self.st.leases.push(lease);
                let mut c = lock(&self.conn);
                c.check()?;
                let r = c.nic.expose(keys.0, keys.1, base + at, len);
                let key = c.guard(r)?;
                self.st.exposed.push(key);
                if first {
                    // The receive the last write's immediate consumes, before the first CTS.
                    let wr = c.wr();
                    let r = c.nic.post_recv(Qp::Data, wr, Dst::User(&[]));
                    c.guard(r)?;
                }
                self.st.next = Some(Cts {
                    key,
                    addr: (base + at) as u64,
                    len: len as u64,
                });
            }
            let mut c = lock(&self.conn);
            c.check()?;
            let r = c.recv_large(iov, &mut self.st);
            match c.guard(r)? {
                Poll::Pending => return Ok(Poll::Pending),
                Poll::Ready(false) => continue,
                Poll::Ready(true) => {
                    drop(c);
                    self.finish();
                    return Ok(Poll::Ready(()));
                }
            }
        }
    }
}

impl<D: Device, N: Nic> Drop for ViaRx<D, N> {
    fn drop(&mut self) {
        self.cancel();
    }
}

impl<D: Device, N: Nic> RxLink for ViaRx<D, N> {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.poll_message();
        c.guard(r)
    }

    fn with_data(
        &mut self,
        tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if tm != TM_SMALL {
            return Err(c.proto(format!("TM {tm} is not a copy TM")));
        }
        let r = c.with_data(take);
        c.guard(r)
    }

    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        if tm == TM_LARGE {
            return self.recv_large(iov);
        }
        if !self.st.active {
            lock(&self.conn).check()?;
            let leases = acquire_all(
                &self.cache,
                iov.iter().map(|s| (s.as_ptr() as usize, s.len())),
            )?;
            self.st.lkeys = leases.iter().map(|l| l.lkey()).collect();
            self.st.leases = leases;
            self.st.total = iov.iter().map(|s| s.len()).sum();
            self.st.active = true;
        }
        let mut c = lock(&self.conn);
        c.check()?;
        let r = match tm {
            TM_MEDIUM => c.recv_medium(iov, &mut self.st),
            _ => Err(c.proto(format!("TM {tm} is not a gather TM"))),
        };
        let r = c.guard(r)?;
        drop(c);
        if r.is_ready() {
            self.finish();
        }
        Ok(r)
    }

    fn abort_message(&mut self) {
        self.cancel();
        let mut c = lock(&self.conn);
        c.failed
            .get_or_insert_with(|| "a received message was abandoned midway".to_string());
        // The rest of the message is in the stream: the connection goes down both ways, so
        // the sender's blocked and later sends fail (a read shutdown told it nothing).
        c.nic.tear_down();
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let gather = self.st.active;
        wait_link(
            &self.conn,
            &self.fds,
            false,
            |c| (!gather && c.ready_for_rx()) || c.failed.is_some(),
            timeout,
        )
    }
}

/// The channel's readiness descriptor: a [`ReadinessSet`] of each connection's wait
/// descriptors (level-triggered input) and of the wake-up socket, plus the one-shot
/// registrations of armed sends. Shared by [`ViaIncoming`], the sending links and the
/// connections (which signal it when an armed send's connection moves).
pub(crate) struct Events {
    ready: ReadinessSet,
    /// An armed send's connection moved: the next `arm` says `Busy`.
    send_ready: AtomicBool,
}

impl Events {
    fn new<N: Nic>(conns: &[(usize, Shared<N>)]) -> Result<Arc<Events>> {
        // Input on any of a connection's descriptors may be what a pending receive waits for
        // (a rendezvous's data arrives on the data queue pair).
        let mut peers = Vec::with_capacity(conns.len());
        for (rank, c) in conns {
            peers.push((*rank, dup_fds(c)?));
        }
        Ok(Arc::new(Events {
            ready: ReadinessSet::new("via", peers)?,
            send_ready: AtomicBool::new(false),
        }))
    }

    fn wake(&self) {
        self.ready.wake();
    }

    /// An armed send's connection moved.
    fn send_progressed(&self) {
        self.send_ready.store(true, Ordering::Release);
        self.wake();
    }
}

/// Any-source readiness over the connections of a channel.
pub(crate) struct ViaIncoming<N: Nic> {
    conns: Vec<(usize, Shared<N>, Vec<OwnedFd>)>,
    events: Arc<Events>,
}

impl<N: Nic> ViaIncoming<N> {
    fn new(conns: Vec<(usize, Shared<N>)>, events: Arc<Events>) -> Result<ViaIncoming<N>> {
        let mut v = Vec::with_capacity(conns.len());
        for (r, c) in conns {
            let fds = dup_fds(&c)?;
            v.push((r, c, fds));
        }
        Ok(ViaIncoming { conns: v, events })
    }
}

impl<N: Nic> Incoming for ViaIncoming<N> {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        for (r, c, _) in &self.conns {
            match c.try_lock() {
                Ok(mut c) => {
                    if c.failed.is_none() && c.rx_queue.is_empty() {
                        // Also keeps queued control traffic (credits, CTS) moving while idle.
                        let _ = c.poll_nic(&mut []);
                    }
                    if c.ready_for_rx() {
                        ready(*r);
                    }
                }
                Err(_) => ready(*r),
            }
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        // Inline up to 8 connections: an any-source wait allocates nothing in small jobs.
        let mut fds: smallvec::SmallVec<[BorrowedFd<'_>; 17]> = smallvec::SmallVec::new();
        let mut interest: smallvec::SmallVec<[Interest; 17]> = smallvec::SmallVec::new();
        let mut one = Interests::new();
        for (_, c, cfds) in &self.conns {
            match c.try_lock() {
                Ok(mut c) => {
                    if !c.rx_queue.is_empty() {
                        return Ok(());
                    }
                    // Connections that failed or ended were reported by `poll`; leave them out
                    // (an ended socket is always readable and would turn this wait into a spin).
                    if c.failed.is_some() || c.nic.peer_closed(Qp::Ctrl) {
                        continue;
                    }
                    if c.nic.prepare_wait(true, &mut one)? {
                        return Ok(());
                    }
                }
                Err(_) => {
                    one.clear();
                    one.push(Interest {
                        fd: 0,
                        read: true,
                        write: false,
                    });
                }
            }
            let base = fds.len();
            fds.extend(cfds.iter().map(|f| f.as_fd()));
            interest.extend(one.iter().map(|i| Interest {
                fd: base + i.fd,
                ..*i
            }));
        }
        fds.push(self.events.ready.wake_fd());
        interest.push(Interest {
            fd: fds.len() - 1,
            read: true,
            write: false,
        });
        wait_fds(&fds, &interest, timeout.min(Duration::from_millis(10)))?;
        self.events.ready.drain_wake();
        Ok(())
    }

    fn wake(&self) {
        self.events.wake();
    }

    fn forget(&self, rank: usize) {
        self.events.ready.forget(rank);
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.events.ready.readiness_fd()
    }

    fn arm(&self) -> Result<Armed> {
        let ev = &self.events;
        ev.ready.make()?;
        // Clear first; whatever happens afterwards makes the set readable again.
        ev.ready.drain_wake();
        let mut busy = ev.send_ready.swap(false, Ordering::AcqRel);
        let mut one = Interests::new();
        // The set's peers are the connections, in the same order.
        for (i, (_, c, _)) in self.conns.iter().enumerate() {
            if ev.ready.is_forgotten(i) {
                continue;
            }
            let mut c = lock(c);
            // What is already here (in user space, where the set cannot see it): a message, or
            // a failure or an end the core has not heard of yet.
            if c.ready_for_rx() {
                busy = true;
                continue;
            }
            // Progress since the last arm (a rendezvous's data or its end taken in by a call
            // that still returned `Pending`): the caller tries again first.
            let now = c.progress();
            if c.armed_at.replace(now) != Some(now) {
                busy = true;
            }
            // Verbs: request the completion event; a completion already there says so.
            if c.nic.prepare_wait(true, &mut one)? {
                busy = true;
            }
        }
        if !busy {
            // Level-triggered: looking consumes nothing but armed sends' one-shot events.
            busy = ev.ready.any_ready()?;
        }
        Ok(if busy { Armed::Busy } else { Armed::Armed })
    }

    fn shutdown(&self) {
        for (_, c, _) in &self.conns {
            // The connection's lock is only held for the duration of a non-blocking call.
            let mut c = lock(c);
            if c.failed.is_none() {
                c.failed = Some(CLOSED.to_string());
            }
            // End of stream towards the peer (a clean close); the links' waits return within
            // their 1 ms slice and then find the connection failed.
            c.nic.close();
            c.moved();
        }
        self.wake();
    }
}

/// The cause later calls report after [`Incoming::shutdown`].
const CLOSED: &str = "the channel was closed";

/// Assemble an opened channel from one NIC per reachable rank.
pub(crate) fn open_channel<D: Device, N: Nic>(
    nics: Vec<Option<N>>,
    cache: &Arc<RegCache<D>>,
    cfg: SlotConfig,
    notes: Vec<String>,
) -> Result<OpenedChannel> {
    let mut conns = Vec::with_capacity(nics.len());
    for (r, nic) in nics.into_iter().enumerate() {
        conns.push(match nic {
            Some(nic) => Some((r, Conn::shared(nic, r, cfg)?)),
            None => None,
        });
    }
    let all: Vec<(usize, Shared<N>)> = conns.iter().flatten().cloned().collect();
    let events = Events::new(&all)?;
    let mut links = Vec::with_capacity(conns.len());
    for c in &conns {
        links.push(match c {
            Some((_, conn)) => {
                lock(conn).events = Some(events.clone());
                Some(self::links(conn, cache, Some(&events))?)
            }
            None => None,
        });
    }
    Ok(OpenedChannel::new(links, Box::new(ViaIncoming::new(all, events)?)).with_notes(notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunking_is_the_same_on_both_sides() {
        assert_eq!(chunks(0, 10), 1);
        assert_eq!(chunk_len(0, 10, 0), 0);
        assert_eq!(chunks(25, 10), 3);
        assert_eq!(
            (0..3).map(|k| chunk_len(25, 10, k)).collect::<Vec<_>>(),
            vec![10, 10, 5]
        );
        let a = [1u8; 7];
        let b = [2u8; 9];
        let iov = [IoSlice::new(&a), IoSlice::new(&b)];
        let g = gather(&iov, &[11, 22], 5, 6);
        assert_eq!(
            g.iter().map(|s| (s.buf.len(), s.lkey)).collect::<Vec<_>>(),
            vec![(2, 11), (4, 22)]
        );
        let (mut x, mut y) = ([0u8; 7], [0u8; 9]);
        let (px, py) = (x.as_ptr() as usize, y.as_ptr() as usize);
        let iov = [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)];
        let s = scatter(&iov, &[11, 22], 5, 6);
        assert_eq!(
            s.to_vec(),
            vec![
                RecvSge {
                    addr: px + 5,
                    len: 2,
                    lkey: 11
                },
                RecvSge {
                    addr: py,
                    len: 4,
                    lkey: 22
                }
            ]
        );
    }
}
