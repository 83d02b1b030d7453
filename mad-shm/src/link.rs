//! The connection halves: [`ShmTx`] writes into the ring this process owns in the peer's
//! segment, [`ShmRx`] reads the ring the peer owns in this process's segment, and
//! [`ShmIncoming`] watches every incoming ring through the process's doorbell.
//!
//! Readiness (event loops): the doorbell's and each writer bell's sleeper word carry an
//! [`ARMED`] bit; a writer that publishes, closes or frees room and
//! finds it set sends one byte to the owner's socket ([`PeerSignals`]), whose epoll set is the
//! channel's readiness descriptor ([`Readiness`]).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::driver::{AbortOutcome, Armed, Incoming, LinkPair, RxLink, TmId, TxLink};
pub use mad_core::hostmem::PeerWatch;
use mad_core::hostmem::{Bell, DeathCheck, Liveness, PeerSignals, Readiness, ARMED};
use mad_core::liveness::{ProbeGate, Teardown};
use mad_core::{Error, Result};

use crate::ring::{Consumer, Corrupt, Producer, RingView};
use crate::segment::Segment;
use crate::sys::{self, RemoteSlice};

/// Longest single sleep of a blocking wait before the peer's liveness is checked again: the
/// bound on noticing a dead peer while blocked (mad-core's, shared with mad-sisci).
pub use mad_core::hostmem::WAIT_SLICE;
/// Magic word opening a Cross Memory Attach record in the ring.
const CMA_MAGIC: u32 = u32::from_le_bytes(*b"CMA1");
/// Magic word opening a group of the `cma` TM that the sender streams through the ring
/// instead (adaptive choice, [`CmaUse::BackToBack`]): the record head (count 0, total) is
/// followed by the group's bytes.
const STREAM_MAGIC: u32 = u32::from_le_bytes(*b"RNG1");
/// A `cma` group counts as sent back to back (and goes through CMA under
/// [`CmaUse::BackToBack`]) when the previous group to this peer completed less than this long
/// ago and nothing was received from the peer since.
pub const BACK_TO_BACK: Duration = Duration::from_micros(50);
/// Size of a record's fixed part (magic, count, total length).
const REC_HEAD: usize = 16;
/// Lends at least this long are published (and ring the doorbell) at once, so large copies
/// pipeline with the receiver; shorter ones wait for the next commit, end of message,
/// back-pressure or EXPRESS piece.
const NOTIFY_EAGER: usize = 4096;
/// Longest single lend of the ring TM: a piece longer than this is copied in several lends,
/// each published at once (they are longer than [`NOTIFY_EAGER`]), so the receiver copies out
/// while the sender copies in. One lend per piece made a 256 KiB piece cost two full copies
/// end to end (A/B, one-way µs at 128 / 256 KiB: 23–25 / 44–55 in one lend, 11–15 / 18–19 in
/// 32 KiB lends; 16 KiB lends measured the same latency with less bandwidth).
const PIPELINE_LEND: usize = 64 << 10;
/// Most slices in one record.
pub const MAX_RECORD_SLICES: usize = 128;

/// Which groups of the Gather TM (`cma`) go through CMA when the channel may use it
/// ([`GatherPath::Cma`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmaUse {
    /// Every group (`cma=always`).
    Always,
    /// A group sent back to back with the previous one to the same peer (see
    /// [`BACK_TO_BACK`]: a stream of messages, where the single copy of the receiver wins);
    /// any other group (a ping-pong, an isolated message, where the pipelined two-copy ring
    /// wins) is streamed through the ring behind a short `"RNG1"` record (`cma=auto|on`).
    BackToBack,
}

/// How the Gather TM (`cma`) moves bytes on this channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherPath {
    /// Single copy: the sender posts its iovec list, the receiver `process_vm_readv`s it.
    Cma,
    /// CMA was not permitted between every pair of ranks: the slices are streamed through the
    /// ring (two copies), keeping the TM table identical on every rank.
    Ring,
}

/// Whether `tm` is one of the driver's copy TMs: `ring` (0), and `pipe` (the TM after `cma`)
/// in the `cma=auto|on|ring` table.
fn is_copy_tm(tm: TmId, cma_tm: Option<TmId>) -> bool {
    tm == 0 || cma_tm.is_some_and(|c| tm == c + 1)
}

fn corrupt(rank: usize, c: Corrupt) -> Error {
    Error::protocol(
        rank,
        format!("ring offsets impossible (head {}, tail {})", c.head, c.tail),
    )
}

/// The bell a writer sleeps on when the ring is full or a CMA group is not completed: the
/// ring's `tx_seq` futex and its sleeper count.
fn writer_bell(v: &RingView) -> Bell<'_> {
    Bell::new(v.tx_seq(), v.tx_sleeping())
}

/// Wake a writer asleep on the ring's `tx_seq` (after the reader released space or completed a
/// CMA transfer), and signal its readiness descriptor if it armed a send (`sig`: the writer's
/// send-progress socket). The SeqCst fence pairs with the one in [`ShmTx::wait`] and
/// [`ShmTx::arm_send`].
fn notify_writer(v: &RingView, sig: Option<&PeerSignals>) {
    writer_bell(v).notify_with(sig.map(|s| &s.send));
}

/// What the two halves of a connection (and the channel's shutdown) share to tear it down
/// together: both rings, the peer's doorbell and its sockets.
pub struct Conn {
    torn: Teardown,
    /// Our ring in the peer's segment (we write it).
    out: RingView,
    peer_seg: Arc<Segment>,
    /// The peer's ring in our segment (we read it).
    inr: RingView,
    /// The peer's readiness sockets (`None` when the channel has no readiness descriptor).
    sigs: Option<PeerSignals>,
    /// Messages received from the peer (bumped by [`ShmRx`]'s `end_message`): the sending
    /// half compares it to tell a stream of sends from a ping-pong ([`CmaUse::BackToBack`]).
    rx_msgs: AtomicU64,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("out", &self.out)
            .field("in", &self.inr)
            .field("torn", &self.torn.is_torn())
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Tear the connection down for both ends: the peer's receive sees our writer closed, its
    /// sends our reader closed (both woken now), and our two halves fail from now on.
    fn tear_down(&self, cause: &str) {
        if self.torn.tear(cause) {
            self.out.writer_closed().store(1, Ordering::Release);
            self.peer_seg
                .doorbell()
                .notify_with(self.sigs.as_ref().map(|s| &s.recv));
            self.inr.reader_closed().store(1, Ordering::Release);
            notify_writer(&self.inr, self.sigs.as_ref());
        }
    }

    /// The channel closes ([`Incoming::shutdown`]): the peer sees both our halves closed, as
    /// when a process leaves between messages (its reader is woken only if it waits for this
    /// ring in particular, like [`ShmTx`]'s drop; its writer and any armed descriptor are
    /// signalled); our halves fail from now on; our own sender blocked on this ring is woken
    /// (the receivers sleep on the doorbell, which the caller rings once).
    fn shut(&self) {
        if !self.torn.tear("the channel was closed") {
            return;
        }
        self.out.writer_closed().store(1, Ordering::Release);
        self.inr.reader_closed().store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        let bell = self.peer_seg.doorbell();
        if self.out.rx_waiting().load(Ordering::Relaxed) != 0 {
            bell.ring();
        }
        bell.signal_if_armed(self.sigs.as_ref().map(|s| &s.recv));
        notify_writer(&self.inr, self.sigs.as_ref());
        writer_bell(&self.out).ring();
    }
}

/// Join the two halves of a connection, so that an abandoned message tears the connection
/// down in both directions (see [`TxLink::abort_message`], [`RxLink::abort_message`]). The
/// connection is also returned for the channel's [`ShmIncoming`] (its shutdown closes it).
pub fn connection(mut tx: ShmTx, mut rx: ShmRx) -> (LinkPair, Arc<Conn>) {
    let conn = Arc::new(Conn {
        torn: Teardown::new(),
        out: tx.prod.view().clone(),
        peer_seg: tx.peer_seg.clone(),
        inr: rx.cons.view().clone(),
        sigs: tx.sigs.clone(),
        rx_msgs: AtomicU64::new(0),
    });
    tx.conn = Some(conn.clone());
    rx.conn = Some(conn.clone());
    (
        LinkPair {
            tx: Box::new(tx),
            rx: Box::new(rx),
        },
        conn,
    )
}

/// Whether the connection was torn down or its channel closed (one atomic load).
fn is_torn(conn: &Option<Arc<Conn>>) -> bool {
    conn.as_ref().is_some_and(|c| c.torn.is_torn())
}

enum TxGather {
    Idle,
    /// Record posted; waiting until the receiver's completion counter reaches `target`.
    Waiting {
        target: u64,
        /// Bytes in the group (bounds how long a started copy can take).
        total: u64,
        /// The reader's `cma_progress` when the record was posted: a larger value means the
        /// copy of this group has started.
        progress_at_post: u64,
    },
    /// Ring fallback: streaming slice `slice` from offset `off`.
    Stream {
        slice: usize,
        off: usize,
    },
}

/// The sending half: this process writes into its ring in the peer's segment.
pub struct ShmTx {
    peer: usize,
    prod: Producer,
    peer_seg: Arc<Segment>,
    live: Liveness,
    cma_tm: Option<TmId>,
    path: GatherPath,
    cma_use: CmaUse,
    /// When the last `cma` group to the peer completed, and the peer's received-message count
    /// then ([`CmaUse::BackToBack`]).
    last_group: Option<(Instant, u64)>,
    gather: TxGather,
    cma_posted: u64,
    msg_start: u64,
    need: u64,
    /// The host runs more ranks than cores: never spin in `wait`.
    crowded: bool,
    broken: Option<String>,
    /// Shared with the receiving half once joined by [`connection`].
    conn: Option<Arc<Conn>>,
    /// Rate limit of the peer-gone probe of `begin_message`.
    gate: ProbeGate,
    /// The peer's readiness sockets (`None` when the channel has no readiness descriptor).
    sigs: Option<PeerSignals>,
}

/// The peer and the counts; never the bytes.
impl std::fmt::Debug for ShmTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTx")
            .field("peer", &self.peer)
            .field("ring", &self.prod)
            .field("cma_tm", &self.cma_tm)
            .field("cma_posted", &self.cma_posted)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl ShmTx {
    /// The sending half towards `peer`, writing `ring` (inside `peer_seg`).
    pub fn new(
        peer: usize,
        ring: RingView,
        peer_seg: Arc<Segment>,
        watch: Arc<PeerWatch>,
        cma_tm: Option<TmId>,
        path: GatherPath,
        crowded: bool,
    ) -> Self {
        let prod = Producer::new(ring);
        let cma_posted = prod.view().cma_done().load(Ordering::Acquire);
        ShmTx {
            peer,
            msg_start: prod.published(),
            prod,
            peer_seg,
            live: Liveness::new(watch),
            cma_tm,
            path,
            cma_use: CmaUse::Always,
            last_group: None,
            gather: TxGather::Idle,
            cma_posted,
            need: 1,
            crowded,
            broken: None,
            conn: None,
            gate: ProbeGate::new(),
            sigs: None,
        }
    }

    /// Signal the peer's readiness sockets `sigs` when it armed its descriptor (the channel
    /// has one). Call before [`connection`].
    #[must_use]
    pub fn with_signals(mut self, sigs: Option<PeerSignals>) -> Self {
        self.sigs = sigs;
        self
    }

    /// Which `cma` groups go through CMA (default [`CmaUse::Always`]).
    #[must_use]
    pub fn with_cma_use(mut self, cma_use: CmaUse) -> Self {
        self.cma_use = cma_use;
        self
    }

    /// Messages received from the peer so far (0 before [`connection`]).
    fn rx_msgs(&self) -> u64 {
        self.conn
            .as_ref()
            .map_or(0, |c| c.rx_msgs.load(Ordering::Relaxed))
    }

    /// Whether the `cma` group about to be sent follows the previous one back to back.
    fn back_to_back(&self) -> bool {
        self.last_group
            .is_some_and(|(t, n)| n == self.rx_msgs() && t.elapsed() < BACK_TO_BACK)
    }

    /// Publish and ring the peer's doorbell if it sleeps, or signal its descriptor if armed
    /// (one SeqCst fence + one load).
    fn publish_now(&mut self) {
        if self.prod.publish() {
            self.peer_seg
                .doorbell()
                .notify_with(self.sigs.as_ref().map(|s| &s.recv));
        }
    }

    fn check_usable(&self) -> Result<()> {
        if let Some(c) = &self.broken {
            return Err(Error::Poisoned {
                rank: self.peer,
                cause: c.as_str().into(),
            });
        }
        match &self.conn {
            Some(c) => c.torn.check(self.peer),
            None => Ok(()),
        }
    }

    /// Called when the ring has no room: publish what is pending and check the peer.
    fn pending(&mut self, need: u64) -> Result<Poll<()>> {
        self.need = need;
        self.publish_now();
        if self.peer_gone() && !self.satisfied() {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        Ok(Poll::Pending)
    }

    /// Whether the reader closed its side or its process is (known or found) dead.
    fn peer_gone(&mut self) -> bool {
        self.prod.view().reader_closed().load(Ordering::Acquire) != 0 || self.live.maybe_dead()
    }

    /// Whether what this half waits for has happened (the CMA group it posted is completed,
    /// or the ring has room for `need`), reading the shared words afresh. Called once the peer
    /// is seen closed or dead, before reporting it: the reader may have completed the transfer
    /// (or drained the ring) and exited between this half's last look at the word and its
    /// look at the peer, and a delivered message must not be reported as lost. The closed flag
    /// is loaded with Acquire after the reader's Release stores of `cma_done` / `tail`, and a
    /// pidfd says "exited" only after every store of the process, so the re-read sees them.
    fn satisfied(&mut self) -> bool {
        fence(Ordering::SeqCst);
        match self.gather {
            TxGather::Waiting { target, .. } => {
                self.prod.view().cma_done().load(Ordering::Acquire) >= target
            }
            _ => self
                .prod
                .free(self.need)
                .map(|f| f >= self.need)
                .unwrap_or(false),
        }
    }

    fn send_cma(&mut self, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        if let TxGather::Idle = self.gather {
            if iov.len() > MAX_RECORD_SLICES {
                return Err(Error::protocol(
                    self.peer,
                    format!("group of {} slices exceeds {MAX_RECORD_SLICES}", iov.len()),
                ));
            }
            let total: u64 = iov.iter().map(|s| s.len() as u64).sum();
            let mut rec = Vec::with_capacity(REC_HEAD + 16 * iov.len());
            rec.extend_from_slice(&CMA_MAGIC.to_le_bytes());
            rec.extend_from_slice(&(iov.len() as u32).to_le_bytes());
            rec.extend_from_slice(&total.to_le_bytes());
            for s in iov {
                rec.extend_from_slice(&(s.as_ptr() as usize as u64).to_le_bytes());
                rec.extend_from_slice(&(s.len() as u64).to_le_bytes());
            }
            if !self
                .prod
                .write_all(&rec)
                .map_err(|c| corrupt(self.peer, c))?
            {
                return self.pending(rec.len() as u64);
            }
            let progress_at_post = self.prod.view().cma_progress().load(Ordering::Relaxed);
            self.publish_now();
            self.cma_posted += 1;
            self.gather = TxGather::Waiting {
                target: self.cma_posted,
                total,
                progress_at_post,
            };
        }
        if let TxGather::Waiting { target, .. } = self.gather {
            if self.prod.view().cma_done().load(Ordering::Acquire) >= target {
                self.gather = TxGather::Idle;
                return Ok(Poll::Ready(()));
            }
            self.need = 0;
            if self.peer_gone() {
                // The reader may have completed the group and exited since the load above.
                if self.satisfied() {
                    self.gather = TxGather::Idle;
                    return Ok(Poll::Ready(()));
                }
                return Err(Error::PeerClosed { rank: self.peer });
            }
        }
        Ok(Poll::Pending)
    }

    fn send_stream(&mut self, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        let (mut slice, mut off) = match self.gather {
            TxGather::Stream { slice, off } => (slice, off),
            _ => (0, 0),
        };
        while slice < iov.len() {
            let src = &iov[slice][off..];
            if src.is_empty() {
                slice += 1;
                off = 0;
                continue;
            }
            let n = self
                .prod
                .lend(src.len().min(PIPELINE_LEND), &mut |b: &mut [u8]| {
                    let k = b.len().min(src.len());
                    b[..k].copy_from_slice(&src[..k]);
                    k
                })
                .map_err(|c| corrupt(self.peer, c))?;
            let Some(n) = n else {
                self.gather = TxGather::Stream { slice, off };
                return self.pending(1);
            };
            off += n;
            self.publish_now();
        }
        self.gather = TxGather::Idle;
        self.publish_now();
        Ok(Poll::Ready(()))
    }
}

impl TxLink for ShmTx {
    fn begin_message(&mut self) -> Result<()> {
        self.check_usable()?;
        // A reader that closed, or a peer process that died, while we were idle: the ring
        // may have room for thousands of messages nobody will read. The reader's flag (a line
        // written once) every time; the pidfd poll at most once per clock tick.
        if self.prod.view().reader_closed().load(Ordering::Acquire) != 0
            || (self.gate.due() && self.live.dead_now())
        {
            self.broken = Some("the peer closed the connection or exited".into());
            return Err(Error::PeerClosed { rank: self.peer });
        }
        self.msg_start = self.prod.published();
        self.prod.rewind_if_idle(self.rx_msgs());
        Ok(())
    }

    fn with_buffer(
        &mut self,
        tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.check_usable()?;
        if !is_copy_tm(tm, self.cma_tm) {
            return Err(Error::protocol(
                self.peer,
                format!("shm: TM {tm} is not a copy TM"),
            ));
        }
        let lent = self
            .prod
            .lend(PIPELINE_LEND, fill)
            .map_err(|c| corrupt(self.peer, c))?;
        if lent.is_none() {
            return self.pending(1);
        }
        // A long lend is published at once, so the receiver copies out while the sender
        // copies in the rest of a large piece. Short lends stay unpublished until the next
        // commit, end of message, back-pressure or EXPRESS piece (`publish`): a short message
        // then reaches the receiver with one store of the head and one doorbell check, and the
        // receiver does not start on a header whose pieces are still being written.
        if lent.unwrap_or(0) >= NOTIFY_EAGER {
            self.publish_now();
        }
        Ok(Poll::Ready(()))
    }

    fn publish(&mut self) -> Result<()> {
        self.publish_now();
        Ok(())
    }

    fn progress_mark(&self) -> u64 {
        // Moves when the receiver starts copying a posted CMA group.
        self.prod.view().cma_progress().load(Ordering::Relaxed)
    }

    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.check_usable()?;
        if Some(tm) != self.cma_tm {
            return Err(Error::protocol(
                self.peer,
                format!("shm: TM {tm} is not a gather TM"),
            ));
        }
        let done = match (self.path, &self.gather) {
            (GatherPath::Ring, _) => self.send_stream(iov)?,
            (GatherPath::Cma, TxGather::Stream { .. }) => self.send_stream(iov)?,
            (GatherPath::Cma, TxGather::Waiting { .. }) => self.send_cma(iov)?,
            (GatherPath::Cma, TxGather::Idle) => {
                if self.cma_use == CmaUse::Always || self.back_to_back() {
                    self.send_cma(iov)?
                } else {
                    // Announce a streamed group; nothing is written when the ring has no room
                    // for the record (the choice is made again on the next call).
                    let total: u64 = iov.iter().map(|s| s.len() as u64).sum();
                    let mut rec = [0u8; REC_HEAD];
                    rec[..4].copy_from_slice(&STREAM_MAGIC.to_le_bytes());
                    rec[8..].copy_from_slice(&total.to_le_bytes());
                    if !self
                        .prod
                        .write_all(&rec)
                        .map_err(|c| corrupt(self.peer, c))?
                    {
                        return self.pending(REC_HEAD as u64);
                    }
                    self.gather = TxGather::Stream { slice: 0, off: 0 };
                    self.send_stream(iov)?
                }
            }
        };
        if done.is_ready() {
            self.last_group = Some((Instant::now(), self.rx_msgs()));
        }
        Ok(done)
    }

    fn commit(&mut self, _tm: TmId) -> Result<Poll<()>> {
        self.publish_now();
        Ok(Poll::Ready(()))
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        self.check_usable()?;
        self.publish_now();
        Ok(Poll::Ready(()))
    }

    fn abort_message(&mut self) -> AbortOutcome {
        let idle = matches!(self.gather, TxGather::Idle);
        if idle && self.prod.published() == self.msg_start {
            self.prod.discard_unpublished();
            return AbortOutcome::Discarded;
        }
        // Part of the message is visible to the peer (or it may be reading our memory through
        // CMA): close the sending side so the peer sees an error, not half a message.
        self.gather = TxGather::Idle;
        let cause = "a message was abandoned midway";
        self.broken = Some(cause.into());
        self.prod.view().writer_closed().store(1, Ordering::Release);
        // The caller gets the message's memory back when this returns and may reuse it at
        // once: order the flag before any such write, for a reader copying that memory
        // through CMA right now (it checks the flag after its copy: `recv_cma`).
        std::sync::atomic::fence(Ordering::SeqCst);
        self.peer_seg
            .doorbell()
            .notify_with(self.sigs.as_ref().map(|s| &s.recv));
        // Both directions: the peer's sends to us fail too, and our receiving half.
        if let Some(c) = &self.conn {
            c.tear_down(cause);
        }
        AbortOutcome::Broken
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let v = self.prod.view().clone();
        if let TxGather::Waiting {
            target,
            total,
            progress_at_post,
        } = self.gather
        {
            if !self.crowded && v.cma_progress().load(Ordering::Relaxed) != progress_at_post {
                // The receiver is copying this group right now: the completion is at most one
                // copy away, and a sleep would add a wake-up (tens of µs here) to it. Yield
                // until it comes, for no longer than the copy can take at 2 GB/s.
                let bound = Duration::from_nanos(total / 2).max(Duration::from_micros(50));
                let until = Instant::now() + timeout.min(bound);
                while v.cma_done().load(Ordering::Acquire) < target
                    && Instant::now() < until
                    && !is_torn(&self.conn)
                {
                    std::thread::yield_now();
                }
                return Ok(());
            }
        }
        let (gather, prod, need, conn) = (&self.gather, &mut self.prod, self.need, &self.conn);
        writer_bell(&v).sleep(timeout.min(WAIT_SLICE), || {
            let room = match gather {
                TxGather::Waiting { target, .. } => v.cma_done().load(Ordering::Acquire) >= *target,
                _ => prod.free(need).map(|f| f >= need).unwrap_or(true),
            };
            room || v.reader_closed().load(Ordering::Acquire) != 0 || is_torn(conn)
        });
        // Dead, but perhaps only after completing what this half waits for: the next attempt
        // then succeeds (or reports the peer gone).
        if self.live.dead_now() && !self.satisfied() {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        Ok(())
    }

    /// Mark the writer bell armed (the reader signals our send-progress socket when it frees
    /// room or completes a CMA group), then look: room, a completion, a closed reader, a dead
    /// peer or a torn connection is `Busy`.
    fn arm_send(&mut self) -> Result<Armed> {
        if self.sigs.is_none() || self.broken.is_some() || is_torn(&self.conn) {
            return Ok(Armed::Busy);
        }
        let v = self.prod.view().clone();
        writer_bell(&v).arm();
        if self.satisfied()
            || v.reader_closed().load(Ordering::Acquire) != 0
            || is_torn(&self.conn)
            || self.live.dead_now()
        {
            return Ok(Armed::Busy);
        }
        Ok(Armed::Armed)
    }
}

impl Drop for ShmTx {
    /// Orderly close: publish what is left, set the writer-closed flag, and ring the peer's
    /// doorbell only if new bytes were published or a thread of the peer waits for this ring
    /// in particular (`rx_waiting`). Any-source sleepers are not woken for a close: they see
    /// it at their next look (a message from anyone, or the end of their wait slice,
    /// [`WAIT_SLICE`]). Ringing for every close woke every sleeper of the host each time a
    /// rank exited: with n ranks leaving one by one, n² wake-ups, each scanning n peers
    /// (400 ranks of `hello` on 2 cores: ~400 runnable processes for tens of seconds).
    fn drop(&mut self) {
        // A torn connection (or closed channel) gets nothing more: the peer saw it closed.
        let news = !is_torn(&self.conn) && self.prod.publish();
        let v = self.prod.view();
        v.writer_closed().store(1, Ordering::Release);
        // Pairs with the fence of the reader registering in `ShmRx::wait` (its increment of
        // `rx_waiting`, fence, then its look at the flag): either it sees the flag or this
        // side sees it waiting.
        fence(Ordering::SeqCst);
        let bell = self.peer_seg.doorbell();
        if news || v.rx_waiting().load(Ordering::Relaxed) != 0 {
            bell.ring();
        }
        // An event loop armed on the peer's descriptor hears of the close.
        bell.signal_if_armed(self.sigs.as_ref().map(|s| &s.recv));
    }
}

/// The receiving half: this process reads the peer's ring in its own segment.
pub struct ShmRx {
    peer: usize,
    peer_pid: u32,
    cons: Consumer,
    own: Arc<Segment>,
    live: Liveness,
    cma_tm: Option<TmId>,
    path: GatherPath,
    stream: Option<(usize, usize)>,
    broken: Option<String>,
    /// Shared with the sending half once joined by [`connection`].
    conn: Option<Arc<Conn>>,
    /// Read position at the last wake-up of a writer waiting for room (see `consumed`).
    notified: u64,
    /// The peer's readiness sockets (`None` when the channel has no readiness descriptor).
    sigs: Option<PeerSignals>,
}

/// The peer and the counts; never the bytes.
impl std::fmt::Debug for ShmRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRx")
            .field("peer", &self.peer)
            .field("peer_pid", &self.peer_pid)
            .field("ring", &self.cons)
            .field("cma_tm", &self.cma_tm)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl ShmRx {
    /// The receiving half from `peer` (process `peer_pid`), reading `ring` inside `own`.
    pub fn new(
        peer: usize,
        peer_pid: u32,
        ring: RingView,
        own: Arc<Segment>,
        watch: Arc<PeerWatch>,
        cma_tm: Option<TmId>,
        path: GatherPath,
    ) -> Self {
        ShmRx {
            peer,
            peer_pid,
            cons: Consumer::new(ring),
            own,
            live: Liveness::new(watch),
            cma_tm,
            path,
            stream: None,
            broken: None,
            conn: None,
            notified: 0,
            sigs: None,
        }
    }

    /// Signal the peer's readiness sockets `sigs` when it armed a send on this ring (the
    /// channel has a readiness descriptor). Call before [`connection`].
    #[must_use]
    pub fn with_signals(mut self, sigs: Option<PeerSignals>) -> Self {
        self.sigs = sigs;
        self
    }

    fn check_usable(&self) -> Result<()> {
        if let Some(c) = &self.broken {
            return Err(Error::Poisoned {
                rank: self.peer,
                cause: c.as_str().into(),
            });
        }
        match &self.conn {
            Some(c) if c.torn.is_torn() => {
                // Reported once: the any-source wait stops counting this peer.
                self.live.retire();
                Err(c.torn.error(self.peer))
            }
            _ => Ok(()),
        }
    }

    fn avail(&mut self, need: u64) -> Result<u64> {
        self.cons.available(need).map_err(|c| corrupt(self.peer, c))
    }

    /// Nothing to read: is the writer gone for good (closed flag or dead process, and the
    /// ring still empty once that is known)?
    fn pending(&mut self, need: u64) -> Result<Poll<()>> {
        // The writer may be asleep waiting for the room this side released.
        self.wake_writer();
        let closed = self.cons.view().writer_closed().load(Ordering::Acquire) != 0;
        if closed || self.live.maybe_dead() {
            // Re-read `head` after learning that the writer is gone: what it published
            // before closing or dying is delivered first.
            fence(Ordering::SeqCst);
            if self.avail(need)? < need {
                return Err(self.gone());
            }
        }
        Ok(Poll::Pending)
    }

    /// The writer is gone for good: report it (once: the any-source wait stops counting
    /// this peer as ready).
    fn gone(&mut self) -> Error {
        self.live.retire();
        Error::PeerClosed { rank: self.peer }
    }

    /// Bytes were taken from the ring: publish the read position (one store; a spinning
    /// writer sees it at once). Waking a writer asleep for room costs a SeqCst fence, so it is
    /// done once per message (`end_message`, `checkout`), before this side waits, and every
    /// quarter ring in a long stream, not after every lend: a short message is three lends
    /// (header, piece, end frame), and a fence each was a third of its one-way latency. A
    /// sleeping writer that misses a release sees it at the end of its wait slice at worst.
    ///
    /// A writer that armed its readiness descriptor on this ring (event loops) is signalled at
    /// once: the relaxed load of its bell is a hint that costs no fence (the line is not
    /// written on the fast path); a miss is caught by the next fenced wake-up.
    fn consumed(&mut self) {
        self.cons.release();
        let v = self.cons.view();
        if self.cons.position() - self.notified >= v.cap() / 4
            || v.tx_sleeping().load(Ordering::Relaxed) & ARMED != 0
        {
            self.wake_writer();
        }
    }

    /// Wake a writer asleep for room, if anything was released since the last time.
    fn wake_writer(&mut self) {
        if self.cons.position() != self.notified {
            self.notified = self.cons.position();
            notify_writer(self.cons.view(), self.sigs.as_ref());
        }
    }

    /// A CMA record whose fixed part `head` was peeked (by `recv_refs`).
    fn recv_cma(&mut self, iov: &mut [IoSliceMut<'_>], head: [u8; REC_HEAD]) -> Result<Poll<()>> {
        let word = |o: usize| u32::from_le_bytes([head[o], head[o + 1], head[o + 2], head[o + 3]]);
        let count = word(4) as usize;
        let total = u64::from_le_bytes([
            head[8], head[9], head[10], head[11], head[12], head[13], head[14], head[15],
        ]);
        if word(0) != CMA_MAGIC || count > MAX_RECORD_SLICES {
            return Err(Error::protocol(self.peer, "shm: expected a CMA record"));
        }
        let mut rec = vec![0u8; REC_HEAD + 16 * count];
        if !self
            .cons
            .peek(&mut rec)
            .map_err(|c| corrupt(self.peer, c))?
        {
            return self.pending(rec.len() as u64);
        }
        let remote: Vec<RemoteSlice> = rec[REC_HEAD..]
            .chunks_exact(16)
            .map(|c| {
                let mut a = [0u8; 8];
                let mut l = [0u8; 8];
                a.copy_from_slice(&c[..8]);
                l.copy_from_slice(&c[8..]);
                RemoteSlice {
                    addr: u64::from_le_bytes(a),
                    len: u64::from_le_bytes(l),
                }
            })
            .collect();
        let rsum = remote
            .iter()
            .try_fold(0u64, |s, r| s.checked_add(r.len))
            .unwrap_or(u64::MAX);
        let lsum: u64 = iov.iter().map(|s| s.len() as u64).sum();
        if rsum != total || lsum != total {
            return Err(Error::protocol(
                self.peer,
                format!("shm: CMA group of {total} B (slices sum to {rsum}) but {lsum} B expected"),
            ));
        }
        // Tell the sender, which waits for the completion, that the copy is under way: its
        // adaptive wait starts its spin budget again instead of going to sleep now. (The copy
        // is one call: `process_vm_readv` costs about 20 µs per call here whatever the size,
        // so reporting progress chunk by chunk would cost more than the sleep it saves.)
        self.cons
            .view()
            .cma_progress()
            .fetch_add(total.max(1), Ordering::Relaxed);
        if let Err(e) = sys::cma_read(self.peer_pid, iov, &remote) {
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => self.gone(),
                Some(libc::EFAULT) => Error::protocol(
                    self.peer,
                    "shm: CMA record points outside the sender's memory",
                ),
                _ => Error::io(format!("shm: process_vm_readv from rank {}", self.peer), e),
            });
        }
        // A sender that abandoned the message meanwhile (a dropped packer, a cancelled future,
        // a closed channel) had its memory back as soon as it set its closed flag, and may
        // have written it while we copied: such a copy is not delivered (the kit's
        // `abandoned_end`). A copy that ended before the flag was set is whole.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.cons.view().writer_closed().load(Ordering::Relaxed) != 0 {
            return Err(Error::ConnectionLost {
                rank: self.peer,
                source: std::io::Error::other(
                    "shm: the sender abandoned the message while its memory was being read",
                ),
            });
        }
        self.cons.skip(rec.len() as u64);
        self.cons.release();
        self.cons.view().cma_done().fetch_add(1, Ordering::Release);
        notify_writer(self.cons.view(), self.sigs.as_ref());
        Ok(Poll::Ready(()))
    }

    fn recv_stream(&mut self, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        let (mut slice, mut off) = self.stream.unwrap_or((0, 0));
        let mut got_any = false;
        while slice < iov.len() {
            let dst = &mut iov[slice][off..];
            if dst.is_empty() {
                slice += 1;
                off = 0;
                continue;
            }
            let n = self
                .cons
                .take(&mut |b: &[u8]| {
                    let k = b.len().min(dst.len());
                    dst[..k].copy_from_slice(&b[..k]);
                    k
                })
                .map_err(|c| corrupt(self.peer, c))?;
            let Some(n) = n else {
                self.stream = Some((slice, off));
                if got_any {
                    self.consumed();
                }
                return self.pending(1);
            };
            got_any = true;
            off += n;
        }
        self.stream = None;
        self.consumed();
        Ok(Poll::Ready(()))
    }
}

impl RxLink for ShmRx {
    fn checkout(&mut self, _tm: TmId) -> Result<()> {
        self.wake_writer();
        Ok(())
    }

    fn end_message(&mut self) -> Result<()> {
        self.wake_writer();
        if let Some(c) = &self.conn {
            // Only the receiving half writes it: a load and a store, no locked add.
            let n = c.rx_msgs.load(Ordering::Relaxed);
            c.rx_msgs.store(n.wrapping_add(1), Ordering::Relaxed);
        }
        Ok(())
    }

    fn poll_message(&mut self) -> Result<Poll<()>> {
        self.check_usable()?;
        if self.avail(1)? > 0 {
            return Ok(Poll::Ready(()));
        }
        self.pending(1)
    }

    fn with_data(
        &mut self,
        tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.check_usable()?;
        if !is_copy_tm(tm, self.cma_tm) {
            return Err(Error::protocol(
                self.peer,
                format!("shm: TM {tm} is not a copy TM"),
            ));
        }
        let n = self.cons.take(take).map_err(|c| corrupt(self.peer, c))?;
        if n.is_none() {
            return self.pending(1);
        }
        self.consumed();
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        self.check_usable()?;
        if Some(tm) != self.cma_tm {
            return Err(Error::protocol(
                self.peer,
                format!("shm: TM {tm} is not a gather TM"),
            ));
        }
        if self.path == GatherPath::Ring || self.stream.is_some() {
            return self.recv_stream(iov);
        }
        let mut head = [0u8; REC_HEAD];
        if !self
            .cons
            .peek(&mut head)
            .map_err(|c| corrupt(self.peer, c))?
        {
            return self.pending(REC_HEAD as u64);
        }
        if head[..4] != STREAM_MAGIC.to_le_bytes() {
            return self.recv_cma(iov, head);
        }
        let mut t = [0u8; 8];
        t.copy_from_slice(&head[8..]);
        let total = u64::from_le_bytes(t);
        let lsum: u64 = iov.iter().map(|s| s.len() as u64).sum();
        if head[4..8] != [0; 4] || total != lsum {
            return Err(Error::protocol(
                self.peer,
                format!("shm: streamed group of {total} B but {lsum} B expected"),
            ));
        }
        self.cons.skip(REC_HEAD as u64);
        self.stream = Some((0, 0));
        self.recv_stream(iov)
    }

    fn abort_message(&mut self) {
        let cause = "a message was abandoned midway by the receiver";
        self.broken = Some(cause.into());
        self.live.retire();
        self.cons.view().reader_closed().store(1, Ordering::Release);
        notify_writer(self.cons.view(), self.sigs.as_ref());
        // Both directions: the peer's receive from us fails too, and our sending half.
        if let Some(c) = &self.conn {
            c.tear_down(cause);
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let own = self.own.clone();
        let (cons, conn) = (&mut self.cons, &self.conn);
        // Registered as waiting for this ring in particular (see `ShmTx::drop`): the writer
        // rings for its close. `Bell::sleep` fences before the check.
        let waiting = cons.view().rx_waiting();
        waiting.fetch_add(1, Ordering::SeqCst);
        own.doorbell().sleep(timeout.min(WAIT_SLICE), || {
            !cons.is_empty()
                || cons.view().writer_closed().load(Ordering::Acquire) != 0
                || is_torn(conn)
        });
        cons.view().rx_waiting().fetch_sub(1, Ordering::SeqCst);
        if self.live.dead_now() {
            // Bytes the writer published before it died are still delivered first.
            fence(Ordering::SeqCst);
            if self.avail(1)? == 0 {
                return Err(self.gone());
            }
        }
        Ok(())
    }
}

impl Drop for ShmRx {
    fn drop(&mut self) {
        self.cons.view().reader_closed().store(1, Ordering::Release);
        notify_writer(self.cons.view(), self.sigs.as_ref());
    }
}

/// Any-source readiness: scans the incoming rings; blocks on the process's doorbell.
///
/// A peer counts as ready when its ring has bytes, or when it closed or died and the
/// receiving half has not reported that yet; once reported ([`PeerWatch::retire`]) it is
/// ignored, so a wait with closed peers still sleeps.
///
/// Its readiness descriptor, when the channel has one, is the epoll set of [`Readiness`]; the
/// doorbell's [`ARMED`] bit makes writers signal it.
pub struct ShmIncoming {
    own: Arc<Segment>,
    peers: Vec<(usize, RingView, Arc<PeerWatch>)>,
    deaths: DeathCheck,
    ready: Option<Readiness>,
    conns: Vec<Arc<Conn>>,
    shut: AtomicBool,
}

impl std::fmt::Debug for ShmIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<usize> = self.peers.iter().map(|p| p.0).collect();
        f.debug_struct("ShmIncoming")
            .field("segment", &self.own)
            .field("peers", &peers)
            .field("readiness", &self.ready)
            .field("shut", &self.shut)
            .finish_non_exhaustive()
    }
}

impl ShmIncoming {
    /// Watch `peers` (rank, incoming ring, process) through `own`'s doorbell.
    pub fn new(own: Arc<Segment>, peers: Vec<(usize, RingView, Arc<PeerWatch>)>) -> Self {
        ShmIncoming {
            own,
            peers,
            deaths: DeathCheck::default(),
            ready: None,
            conns: Vec::new(),
            shut: AtomicBool::new(false),
        }
    }

    /// The channel's readiness descriptor (`None`: the channel has none).
    #[must_use]
    pub fn with_readiness(mut self, ready: Option<Readiness>) -> Self {
        self.ready = ready;
        self
    }

    /// The connections [`shutdown`](Incoming::shutdown) closes.
    #[must_use]
    pub fn with_connections(mut self, conns: Vec<Arc<Conn>>) -> Self {
        self.conns = conns;
        self
    }

    fn check_deaths(&self, force: bool) {
        self.deaths
            .run(force, self.peers.iter().map(|(_, _, w)| &**w));
    }

    fn ready(v: &RingView, w: &PeerWatch) -> bool {
        !w.retired()
            && (v.head().load(Ordering::Acquire) != v.tail().load(Ordering::Relaxed)
                || v.writer_closed().load(Ordering::Relaxed) != 0
                || w.known_dead())
    }

    fn any_ready(&self) -> bool {
        self.peers.iter().any(|(_, v, w)| Self::ready(v, w))
    }
}

impl Incoming for ShmIncoming {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        self.check_deaths(false);
        for (rank, v, w) in &self.peers {
            if Self::ready(v, w) {
                ready(*rank);
            }
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        self.own.doorbell().sleep(timeout.min(WAIT_SLICE), || {
            self.any_ready() || self.shut.load(Ordering::Acquire)
        });
        self.check_deaths(true);
        Ok(())
    }

    fn wake(&self) {
        let bell = self.own.doorbell();
        bell.ring();
        if let Some(r) = &self.ready {
            r.wake(bell);
        }
    }

    fn forget(&self, rank: usize) {
        if let Some(r) = &self.ready {
            r.forget(rank);
        }
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ready.as_ref().map(Readiness::fd)
    }

    /// Set the doorbell's armed bit (writers then signal), collect the sockets and the
    /// peers' pidfds, then look at the rings.
    fn arm(&self) -> Result<Armed> {
        let Some(r) = &self.ready else {
            return Ok(Armed::Busy);
        };
        if self.shut.load(Ordering::Acquire) {
            return Ok(Armed::Busy);
        }
        self.own.doorbell().arm();
        if r.collect() || self.any_ready() {
            return Ok(Armed::Busy);
        }
        Ok(Armed::Armed)
    }

    fn shutdown(&self) {
        self.shut.store(true, Ordering::Release);
        for c in &self.conns {
            c.shut();
        }
        // Our receivers and any-source waiters sleep on the doorbell; an event loop sleeps on
        // the descriptor.
        self.wake();
    }
}
