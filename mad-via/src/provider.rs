//! The provider interface: what the VIA protocol ([`crate::proto`]) needs from a NIC.
//!
//! It is the verbs model, cut down to what the three transmission modules use:
//!
//! * a [`Device`] (one per channel: a protection domain) registers memory and returns memory
//!   regions with a local and a remote key;
//! * a [`Nic`] (one per connection end) owns two reliable-connected queue pairs ([`Qp::Ctrl`]
//!   and [`Qp::Data`]), one completion queue, and the connection's library-owned registered
//!   memory (the *arena*: the static receive and send buffers of the small TM, and the credit
//!   word the peer RDMA-writes);
//! * work requests are posted (`post_recv`, `post_send`, `post_write`, with or without
//!   immediate data) and complete later, reported by `poll` as [`Wc`]s; a waiting thread
//!   polls the descriptors the NIC names (`wait_fds`, `prepare_wait`).
//!
//! Two implementations: [`crate::soft::SoftNic`] (a software NIC over two sockets) and, with
//! the `verbs` feature, `sys::verbs::VerbsNic` (ibverbs). The protocol is written once against
//! this trait.
//!
//! # Memory
//!
//! Outgoing data is described by [`Src`]: a static send buffer of the arena, or user memory
//! as borrowed slices with the local key of their registration. Incoming data lands in
//! [`Dst`]: a static receive buffer, or user memory described by address, length and local
//! key ([`RecvSge`]), like a verbs scatter list.
//!
//! A hardware NIC writes posted user memory by DMA whenever the data arrives, so the protocol
//! keeps that memory alive and untouched until the work request completes or the connection
//! is torn down (the verbs rule; see `sys::verbs` for how the verbs provider upholds it on
//! abort and drop). The soft NIC is software: it only writes user memory the caller *lends*
//! it for the duration of one `poll` (the `lent` slices, which are the receive call's borrow
//! of the user's buffers). Data for a posted receive whose memory is not lent waits in the
//! socket, exactly as an early send waits for its receive on verbs (receiver not ready: the
//! sender retries); so the soft provider needs no `unsafe`.

use std::io::IoSliceMut;
use std::os::fd::BorrowedFd;
use std::task::Poll;

use mad_core::{Error, Result};

/// The two queue pairs of a connection.
///
/// * `Ctrl`: sends land in the pre-posted static receive buffers, under credit flow control
///   (small-TM data and rendezvous CTS records), and the peer RDMA-writes the credit word.
///   A send arriving with no posted receive is a protocol violation (verbs: RNR retry count
///   0; the soft NIC fails the connection).
/// * `Data`: medium sends land in receives the receiver posts on its user buffers, and
///   rendezvous RDMA writes land in the region it advertised (the last write carries an
///   immediate that consumes one posted zero-length receive). A send arriving before its
///   receive is posted waits (verbs: RNR retry; soft: the bytes stay in the socket). Nothing
///   else travels on this QP, so a waiting send never holds up credits or CTS records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Qp {
    /// Static buffers, credits, CTS.
    Ctrl = 0,
    /// User memory: medium sends, rendezvous writes.
    Data = 1,
}

/// One outgoing slice of registered user memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sge<'a> {
    /// The bytes.
    pub buf: &'a [u8],
    /// Local key of the registration covering them.
    pub lkey: u32,
}

/// Where the bytes of a send or RDMA write come from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Src<'a> {
    /// The first `len` bytes of static send buffer `slot` of the arena.
    Slot {
        /// Send buffer index.
        slot: usize,
        /// Bytes.
        len: usize,
    },
    /// Registered user memory (a gather list).
    User(&'a [Sge<'a>]),
}

/// One scatter element of a posted receive in user memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecvSge {
    /// Address.
    pub addr: usize,
    /// Length.
    pub len: usize,
    /// Local key of the registration covering it.
    pub lkey: u32,
}

/// Where a posted receive lands.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dst<'a> {
    /// Static receive buffer `slot` of the arena.
    Slot(usize),
    /// User memory (a scatter list; empty for a receive that only takes an immediate).
    User(&'a [RecvSge]),
}

/// Target of an RDMA write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Remote {
    /// Remote address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// What completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WcKind {
    /// A send (its source may be reused).
    Send,
    /// An RDMA write (its source may be reused; the data is at the peer).
    Write,
    /// A receive: `len` bytes landed; `imm` if the sender attached immediate data.
    Recv {
        /// Bytes received.
        len: usize,
        /// Immediate data.
        imm: Option<u32>,
    },
}

/// A work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wc {
    /// Queue pair.
    pub qp: Qp,
    /// The work request's id, as posted.
    pub wr_id: u64,
    /// What completed.
    pub kind: WcKind,
}

/// The completion side of one connection end, the same for every provider: completions
/// learnt before the protocol asked for them (the soft NIC's sends complete when posted;
/// verbs finds some while arming its notifications), handed over first by the next
/// [`take`](Completions::take), and the connection's first fatal failure, after which every
/// call reports it ([`Error::Poisoned`]) and nothing more completes.
#[derive(Debug, Default)]
pub(crate) struct Completions {
    early: Vec<Wc>,
    failed: Option<String>,
}

impl Completions {
    /// `Err(Poisoned)` for peer `rank` once the connection failed.
    pub(crate) fn check(&self, rank: usize) -> Result<()> {
        match &self.failed {
            Some(cause) => Err(Error::Poisoned {
                rank,
                cause: cause.as_str().into(),
            }),
            None => Ok(()),
        }
    }

    /// Whether the connection failed.
    pub(crate) fn failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Record `cause` as the connection's failure unless one is recorded already; whether it
    /// was the first (the provider then tells the peer, or stops its queue pairs).
    pub(crate) fn fail(&mut self, cause: impl std::fmt::Display) -> bool {
        if self.failed.is_some() {
            return false;
        }
        self.failed = Some(cause.to_string());
        true
    }

    /// A completion learnt early: handed over by the next [`take`](Completions::take).
    pub(crate) fn push(&mut self, wc: Wc) {
        self.early.push(wc);
    }

    /// The list of completions learnt early, to append to without allocating (give it back
    /// with [`restore_early`](Completions::restore_early)).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // (the verbs provider's)
    pub(crate) fn lend_early(&mut self) -> Vec<Wc> {
        std::mem::take(&mut self.early)
    }

    /// Give back what [`lend_early`](Completions::lend_early) lent.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // (the verbs provider's)
    pub(crate) fn restore_early(&mut self, early: Vec<Wc>) {
        self.early = early;
    }

    /// Whether completions learnt early wait to be taken.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // (the verbs provider's)
    pub(crate) fn any_early(&self) -> bool {
        !self.early.is_empty()
    }

    /// The start of every poll: the failure if the connection failed, else the completions
    /// learnt early, appended to `out` in the order they completed.
    pub(crate) fn take(&mut self, rank: usize, out: &mut Vec<Wc>) -> Result<()> {
        self.check(rank)?;
        out.append(&mut self.early);
        Ok(())
    }
}

/// Descriptors a blocked thread polls ([`Nic::wait_fds`]); inline, so that a wait allocates
/// nothing.
pub(crate) type WaitFds<'a> = smallvec::SmallVec<[BorrowedFd<'a>; 4]>;

/// What to poll ([`Nic::prepare_wait`]); inline, so that a wait allocates nothing.
pub(crate) type Interests = smallvec::SmallVec<[Interest; 4]>;

/// What to poll on one of [`Nic::wait_fds`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Interest {
    /// Index into `wait_fds`.
    pub fd: usize,
    /// Wake when readable.
    pub read: bool,
    /// Wake when writable.
    pub write: bool,
}

/// A registered memory region.
pub(crate) trait MemoryRegion: Send + 'static {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key.
    fn rkey(&self) -> u32;
}

/// A protection domain: registers memory for the NICs of one channel.
pub(crate) trait Device: Send + Sync + 'static {
    /// Registration handle; deregisters on drop.
    type Mr: MemoryRegion;

    /// Whether a registration of memory the library does not own may be kept after the call
    /// that needed it (the registration cache). `false` when a stale registration would let
    /// the NIC write into memory the user freed and the allocator reused (verbs pins the
    /// physical pages at registration): the cache then registers such memory for each call.
    fn caches_user_memory(&self) -> bool;

    /// Register `[addr, addr + len)` for local use and remote writes.
    fn reg_mr(&self, addr: usize, len: usize) -> Result<Self::Mr>;
}

/// One connection end: two queue pairs, a completion queue, the arena.
pub(crate) trait Nic: Send + 'static {
    /// Largest send or RDMA write one work request may carry.
    fn max_msg(&self) -> usize;

    /// Most work requests the protocol keeps outstanding on the data QP (send queue depth).
    fn data_window(&self) -> usize;

    /// Static receive buffer `slot` (valid after its receive completed, until reposted).
    fn rx_slot(&self, slot: usize) -> &[u8];

    /// Number of static send buffers.
    fn tx_slots(&self) -> usize;

    /// Static send buffer `slot`, to fill before posting it (never while its send is
    /// outstanding).
    fn tx_slot_mut(&mut self, slot: usize) -> &mut [u8];

    /// The credit word the peer RDMA-writes (its cumulative count of freed receive buffers).
    fn credit_word(&self) -> u64;

    /// Fill static send buffer `slot` with the credit value `v` (the source of a credit write).
    fn set_credit_source(&mut self, slot: usize, v: u64) {
        let b = self.tx_slot_mut(slot);
        if let Some(w) = b.get_mut(..8) {
            w.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Where the peer's credit word is.
    fn peer_credit_word(&self) -> Remote;

    /// Post a receive.
    fn post_recv(&mut self, qp: Qp, wr_id: u64, dst: Dst<'_>) -> Result<()>;

    /// Post a send (`to`: `None`) or an RDMA write to `to`, with `imm` (a write's consumes
    /// one posted receive at the peer). `Pending`: the send queue is full (poll, then post
    /// again).
    fn post(
        &mut self,
        qp: Qp,
        wr_id: u64,
        src: Src<'_>,
        to: Option<Remote>,
        imm: Option<u32>,
    ) -> Result<Poll<()>>;

    /// Post a send. `Pending`: the send queue is full (poll, then post again).
    fn post_send(
        &mut self,
        qp: Qp,
        wr_id: u64,
        src: Src<'_>,
        imm: Option<u32>,
    ) -> Result<Poll<()>> {
        self.post(qp, wr_id, src, None, imm)
    }

    /// Post an RDMA write to `to`, with `imm` consuming one posted receive at the peer.
    /// `Pending`: the send queue is full.
    fn post_write(
        &mut self,
        qp: Qp,
        wr_id: u64,
        src: Src<'_>,
        to: Remote,
        imm: Option<u32>,
    ) -> Result<Poll<()>> {
        self.post(qp, wr_id, src, Some(to), imm)
    }

    /// Allow the peer to RDMA-write `[addr, addr + len)` (covered by the registration with
    /// keys `lkey`/`rkey`); returns the key the peer must present. Verbs: the region's rkey;
    /// soft: a fresh key per advertisement.
    fn expose(&mut self, lkey: u32, rkey: u32, addr: usize, len: usize) -> Result<u32>;

    /// Withdraw an advertisement (soft: later writes with that key are refused).
    fn unexpose(&mut self, rkey: u32);

    /// Collect completions into `out`. `lent`: the user memory the caller borrows right now
    /// (the soft NIC lands data only there; a hardware NIC ignores it). `Err`: the connection
    /// failed (completion error, peer report, end of stream in the middle of a transfer).
    fn poll(&mut self, lent: &mut [IoSliceMut<'_>], out: &mut Vec<Wc>) -> Result<()>;

    /// Collect the completions that need no I/O to learn about (the soft NIC's sends, which
    /// complete when posted; a hardware NIC's completion queue), without landing data.
    fn reap(&mut self, out: &mut Vec<Wc>) -> Result<()>;

    /// Whether the peer closed queue pair `qp` cleanly and nothing more will arrive on it (a
    /// message starts on the control QP; the data QP may still deliver a transfer the peer
    /// completed just before closing).
    fn peer_closed(&self, qp: Qp) -> bool;

    /// Descriptors a blocked thread polls for this connection (the same list for the NIC's
    /// whole life: the links keep duplicates so they can wait without holding the
    /// connection's lock).
    fn wait_fds(&self) -> WaitFds<'_>;

    /// Before blocking: arm completion notifications (verbs) and fill `interest` with what to
    /// poll on [`Nic::wait_fds`]. `message_only`: the waiter only cares about control traffic
    /// (the start of a message: any-source waits). `Ok(true)`: a completion is already
    /// waiting, do not block.
    fn prepare_wait(&mut self, message_only: bool, interest: &mut Interests) -> Result<bool>;

    /// Whether posted work still needs the caller's calls to reach the wire (the soft NIC's
    /// user-space send queues; a hardware NIC transmits on its own).
    fn transmit_pending(&self) -> bool;

    /// Break the connection: tell the peer why if possible (soft: an error record; verbs:
    /// the QPs go to the error state and the peer's work requests fail), stop sending and
    /// receiving. No posted user memory is touched afterwards.
    fn fail(&mut self, code: u32, why: &str);

    /// Stop the sending side (a message was abandoned midway): the peer sees the connection
    /// end instead of half a message.
    fn shutdown_send(&mut self);

    /// Stop the receiving side (a received message was abandoned midway).
    fn shutdown_recv(&mut self);

    /// The channel closes (`Incoming::shutdown`): send what is queued if that can be done
    /// without blocking, then tell the peer this side leaves, as a process that exits between
    /// messages does (soft: end of stream on both queue pairs). The default stops the sending
    /// side (verbs: the QPs go to the error state; the peer sees a failure, not a clean close).
    fn close(&mut self) {
        self.shutdown_send();
    }

    /// Bytes posted but still queued in user space on their way to the wire (soft: the
    /// sockets' send queues; a hardware NIC: 0). A change means a blocked send may progress.
    fn backlog(&self) -> usize {
        0
    }

    /// Tear the connection down for both ends (a message was abandoned midway, by this side's
    /// sender after part of it left or by its receiver): the peer's pending and later
    /// operations on the connection must fail, promptly (soft: the sockets are reset; verbs:
    /// the QPs go to the error state). The default stops both sides.
    fn tear_down(&mut self) {
        self.shutdown_send();
        self.shutdown_recv();
    }

    /// Non-blocking: whether the peer has visibly gone (closed or reset its end). Asked at a
    /// bounded rate when a message begins, so that a send to a peer that died while this side
    /// was idle fails instead of vanishing. The default, `false`, is for NICs that cannot tell
    /// without traffic (verbs: a dead peer shows when a send exhausts its retries).
    fn hung_up(&self) -> bool {
        false
    }

    /// Cancel every posted receive and advertisement that points into user memory, so no
    /// later event can write it (called when a receive is abandoned and on drop).
    fn cancel_user_receives(&mut self);
}
