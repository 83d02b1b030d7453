//! The driver contract: what a protocol crate implements to become a Madeleine channel.
//!
//! A driver is a byte-moving machine organised in **transmission modules** (TMs). The core
//! (switch + buffer-management modules) decides, for each piece, which TM carries it
//! ([`TmTable::select`], a pure function both sides compute identically) and hands the piece to
//! that TM through one of two generic **buffer-management modules** (BMMs):
//!
//! * [`Bmm::Copy`]: the driver *lends* its own (static, possibly pre-registered) buffer space
//!   through [`TxLink::with_buffer`]; the core copies pieces into it. Consecutive pieces
//!   aggregate into the same buffer; a piece larger than the space lent is split across
//!   buffers. The receiver mirrors this with [`RxLink::with_data`]: the driver lends received
//!   bytes and the core copies them out.
//! * [`Bmm::Gather`]: the core references the user's memory and hands the TM a *group* of
//!   slices in one [`TxLink::send_refs`] call (one `writev`, one MPI message, one RDMA write
//!   per slice, ...). The receiver mirrors it with [`RxLink::recv_refs`] into the user's
//!   destinations (one `readv`, ...).
//!
//! Order: the core calls [`TxLink::commit`] on the previous TM whenever the TM changes, and
//! [`TxLink::end_message`] at `end_packing`; the receiver calls [`RxLink::checkout`] and
//! [`RxLink::end_message`] at the same points. A driver may delay physical transmission
//! (TCP keeps committed copy-buffer bytes and sends them in the same `writev` as the next
//! group), but bytes handed to a TM before a commit must reach the peer before anything handed
//! afterwards, and everything must be out by the time `end_message` returns `Ready`.
//!
//! Group boundaries (both sides compute them, so message-based drivers can post exact scatter
//! lists): a Gather group ends when the TM changes, after a piece sent SAFER (its memory is
//! released when `pack` returns), after a piece received EXPRESS, when it holds
//! [`TmSpec::max_group`] slices, and at the end of the message.
//!
//! Back-pressure is a value, not an error: a method that cannot progress now (ring full, no
//! credit, socket buffer full, nothing received yet) returns `Ok(Poll::Pending)`. The core then
//! applies the channel's progress policy (spin, yield, then [`TxLink::wait`] /
//! [`RxLink::wait`]) and calls the *same* method again with the *same* arguments; the driver
//! keeps its own cursor of partial progress.
//!
//! Every message starts with a short header the core writes through TM 0 (which must be a
//! `Copy` TM accepting every mode), so "a message is ready" means "TM 0 has incoming bytes"
//! ([`RxLink::poll_message`]).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::task::Poll;
use std::time::Duration;

use crate::bootstrap::Bootstrap;
use crate::config::ChannelConfig;
pub use crate::config::{Adapters, DriverOptions};
use crate::error::{Error, Result};
use crate::modes::{ModeSet, RecvMode, SendMode};
use crate::progress::ProgressPolicy;

/// Index of a transmission module in its driver's [`TmTable`].
pub type TmId = u8;

/// Maximum number of TMs a driver may declare.
pub const MAX_TMS: usize = 8;

/// The generic buffer-management module a TM uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bmm {
    /// Copy pieces into driver-lent buffers, aggregating small pieces and splitting big ones.
    Copy,
    /// Reference the user's memory; hand groups of slices to the TM.
    Gather,
}

/// Static description of one transmission module.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TmSpec {
    /// Short name, unique in the table (used in the selection table and in overrides).
    pub name: &'static str,
    /// Which generic BMM serves this TM.
    pub bmm: Bmm,
    /// The largest piece (inclusive) this TM is selected for; `usize::MAX` for no limit.
    pub max_len: usize,
    /// Which (send, receive) mode pairs may use this TM.
    pub modes: ModeSet,
    /// For `Gather` TMs: the most slices in one group (1 = one transfer per piece).
    pub max_group: usize,
    /// One line for the selection table: how the TM moves bytes.
    pub how: &'static str,
}

impl TmSpec {
    /// A copy TM for pieces up to `max_len` bytes, any mode.
    pub const fn copy(name: &'static str, max_len: usize, how: &'static str) -> Self {
        TmSpec {
            name,
            bmm: Bmm::Copy,
            max_len,
            modes: ModeSet::ANY,
            max_group: 1,
            how,
        }
    }
    /// A gather TM for pieces up to `max_len` bytes, any mode, `max_group` slices per group.
    pub const fn gather(
        name: &'static str,
        max_len: usize,
        max_group: usize,
        how: &'static str,
    ) -> Self {
        TmSpec {
            name,
            bmm: Bmm::Gather,
            max_len,
            modes: ModeSet::ANY,
            max_group,
            how,
        }
    }
    /// Restrict the modes this TM accepts.
    #[must_use]
    pub const fn with_modes(mut self, modes: ModeSet) -> Self {
        self.modes = modes;
        self
    }
}

/// A driver's transmission modules, in selection order.
///
/// [`select`](TmTable::select) returns the first TM whose `max_len` is at least the piece
/// length and that accepts the piece's modes. TM 0 must be a `Copy` TM accepting every mode:
/// the core sends message headers and checked-mode descriptors through it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TmTable {
    tms: smallvec::SmallVec<[TmSpec; 4]>,
    bmms: [Bmm; MAX_TMS],
    max_group: [usize; MAX_TMS],
    /// TM 0's `max_len`: TM 0 accepts every mode, so it is chosen for every piece up to this
    /// length ([`first_tm_max`](TmTable::first_tm_max)).
    first_max: usize,
}

impl TmTable {
    /// Build and validate a table.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] for an empty or oversized table, a TM 0 that
    /// is not a Copy TM accepting every mode, two TMs of one name, a gather TM with `max_group` 0,
    /// or a pair of modes no TM accepts.
    pub fn new(tms: impl IntoIterator<Item = TmSpec>) -> Result<Self> {
        let tms: smallvec::SmallVec<[TmSpec; 4]> = tms.into_iter().collect();
        let t = TmTable {
            bmms: [Bmm::Copy; MAX_TMS],
            max_group: [1; MAX_TMS],
            first_max: 0,
            tms,
        };
        t.validated()
    }

    fn validated(mut self) -> Result<Self> {
        if self.tms.is_empty() || self.tms.len() > MAX_TMS {
            return Err(Error::BadConfig(format!(
                "a driver declares 1 to {MAX_TMS} TMs, not {}",
                self.tms.len()
            )));
        }
        let first = &self.tms[0];
        if first.bmm != Bmm::Copy || first.modes != ModeSet::ANY {
            return Err(Error::BadConfig(format!(
                "TM 0 (`{}`) must be a Copy TM accepting every mode: headers travel through it",
                first.name
            )));
        }
        for (i, tm) in self.tms.iter().enumerate() {
            if self.tms[..i].iter().any(|o| o.name == tm.name) {
                return Err(Error::BadConfig(format!("two TMs are named `{}`", tm.name)));
            }
            if tm.bmm == Bmm::Gather && tm.max_group == 0 {
                return Err(Error::BadConfig(format!(
                    "TM `{}`: max_group must be at least 1",
                    tm.name
                )));
            }
        }
        for s in SendMode::ALL {
            for r in RecvMode::ALL {
                let covered = self
                    .tms
                    .iter()
                    .any(|tm| tm.max_len == usize::MAX && tm.modes.accepts(s, r));
                if !covered {
                    return Err(Error::BadConfig(format!(
                        "no TM takes pieces of every length for send {s:?} / receive {r:?}"
                    )));
                }
            }
        }
        for (i, tm) in self.tms.iter().enumerate() {
            self.bmms[i] = tm.bmm;
            self.max_group[i] = tm.max_group.max(1);
        }
        self.first_max = self.tms[0].max_len;
        Ok(self)
    }

    /// The switch decision: which TM carries a piece of `len` bytes with these modes.
    ///
    /// A pure function of its arguments and the table, so both ends agree without a header.
    #[inline]
    pub fn select(&self, len: usize, s: SendMode, r: RecvMode) -> TmId {
        for (i, tm) in self.tms.iter().enumerate() {
            if len <= tm.max_len && tm.modes.accepts(s, r) {
                return i as TmId;
            }
        }
        // Unreachable for a validated table (every mode pair has an unbounded TM); stay total.
        (self.tms.len() - 1) as TmId
    }

    /// The longest piece TM 0 takes: [`select`](Self::select) returns 0 for every piece up
    /// to this length, whatever its modes (TM 0 accepts every mode).
    #[inline]
    pub fn first_tm_max(&self) -> usize {
        self.first_max
    }

    /// The BMM of TM `id`.
    #[inline]
    pub fn bmm(&self, id: TmId) -> Bmm {
        self.bmms[id as usize]
    }

    /// The group limit of TM `id`.
    #[inline]
    pub fn max_group(&self, id: TmId) -> usize {
        self.max_group[id as usize]
    }

    /// The TMs, in selection order.
    pub fn tms(&self) -> &[TmSpec] {
        &self.tms
    }

    /// Change the `max_len` threshold of the TM named `name` (configuration override).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] when no TM is called `name`, or the table with
    /// the new threshold is not valid (see [`TmTable::new`]).
    pub fn set_max_len(&mut self, name: &str, max_len: usize) -> Result<()> {
        let known: Vec<&str> = self.tms.iter().map(|t| t.name).collect();
        let tm = self
            .tms
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| {
                Error::BadConfig(format!("no TM named `{name}`; this driver has {known:?}"))
            })?;
        tm.max_len = max_len;
        let t = std::mem::replace(
            self,
            TmTable {
                tms: Default::default(),
                bmms: [Bmm::Copy; MAX_TMS],
                max_group: [1; MAX_TMS],
                first_max: 0,
            },
        );
        *self = t.validated()?;
        Ok(())
    }

    /// A 64-bit fingerprint of the table (names, BMMs, thresholds, modes, group limits).
    ///
    /// Drivers exchange it when connecting: two ends with different tables would disagree on
    /// the switch decisions, so they must refuse to talk ([`Error::BadConfig`]).
    pub fn fingerprint(&self) -> u64 {
        // FNV-1a: stable across builds and platforms, no dependency.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: &[u8]| {
            for &x in b {
                h ^= x as u64;
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        for tm in &self.tms {
            eat(tm.name.as_bytes());
            eat(&[tm.bmm as u8, tm.modes.bits()]);
            eat(&(tm.max_len as u64).to_le_bytes());
            eat(&(tm.max_group as u64).to_le_bytes());
        }
        h
    }
}

/// What a driver can do, as a struct of limits and flags (smoltcp's `DeviceCapabilities`).
///
/// `non_exhaustive`: a driver of another crate starts from [`Capabilities::default`] and
/// changes what differs with the `with_*` methods (or by assigning fields):
///
/// ```
/// use mad_core::driver::Capabilities;
/// let caps = Capabilities::default()
///     .with_direct_poll_limit(64)
///     .with_intra_node_only(true);
/// assert!(caps.detects_peer_death && caps.max_message.is_none());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// With this many peers or fewer, any-source reception polls each connection directly
    /// ([`RxLink::poll_message`]) instead of asking [`Incoming::poll`] first. Drivers whose
    /// per-connection check is a memory read (rings) set it high; socket drivers low.
    pub direct_poll_limit: usize,
    /// Whether the driver can tell a dead peer from a slow one by itself (EOF, process
    /// liveness). Kits skip peer-death tests when false.
    pub detects_peer_death: bool,
    /// Whether this channel only reaches peers on the same host. The engine then refuses to
    /// open it ([`Error::BadConfig`] naming the ranks and hosts out of reach) in a session
    /// with ranks on other hosts: those the bootstrap does not count among this host's
    /// ([`Bootstrap::local_ranks`]) and those running another kernel (boot id, exchanged
    /// at open). A channel configured `local_only` ([`ChannelConfig`]'s field) accepts
    /// that: it connects the ranks of each host only.
    pub intra_node_only: bool,
    /// Largest message the driver can carry, if bounded: the sum of the lengths of a
    /// message's pieces (the engine's own framing, a header and a few bytes per piece, comes
    /// on top: leave room for it). The engine refuses a piece that would exceed it with
    /// [`Error::MessageTooLarge`] before any of it is sent; the message goes on without it.
    pub max_message: Option<u64>,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            direct_poll_limit: 4,
            detects_peer_death: true,
            intra_node_only: false,
            max_message: None,
        }
    }
}

impl Capabilities {
    /// [`Capabilities::direct_poll_limit`].
    #[must_use]
    pub const fn with_direct_poll_limit(mut self, peers: usize) -> Self {
        self.direct_poll_limit = peers;
        self
    }
    /// [`Capabilities::detects_peer_death`].
    #[must_use]
    pub const fn with_detects_peer_death(mut self, on: bool) -> Self {
        self.detects_peer_death = on;
        self
    }
    /// [`Capabilities::intra_node_only`].
    #[must_use]
    pub const fn with_intra_node_only(mut self, on: bool) -> Self {
        self.intra_node_only = on;
        self
    }
    /// [`Capabilities::max_message`].
    #[must_use]
    pub const fn with_max_message(mut self, max: Option<u64>) -> Self {
        self.max_message = max;
        self
    }
}

/// What happened to a message whose `Packer` was dropped before `end_packing`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortOutcome {
    /// Nothing of the message had become visible to the peer (bytes still queued in the
    /// driver, lends not yet published): it was discarded and the connection is intact.
    Discarded,
    /// Part of the message had become visible to the peer; the driver tore the connection
    /// down in both directions (see [`TxLink::abort_message`]) and it is unusable from now on.
    Broken,
}

/// Direction for [`TxLink::wait`] / [`RxLink::wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Waiting to send (room in a ring, credit, socket buffer space).
    Send,
    /// Waiting to receive.
    Recv,
}

/// What arming a readiness descriptor found ([`Incoming::arm`], [`TxLink::arm_send`]), after
/// UCX's `ucp_worker_arm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Armed {
    /// Something may be ready already: poll again instead of sleeping on the descriptor.
    Busy,
    /// Nothing is ready, and the next event makes the readiness descriptor readable: the
    /// caller may sleep on it without losing a wake-up.
    Armed,
}

/// The sending half of one point-to-point connection.
///
/// The core serialises access: one message at a time per connection and direction, one thread
/// at a time in these methods. Methods returning `Poll::Pending` are called again with the same
/// arguments after the progress policy has waited.
pub trait TxLink: Send {
    /// Prepare for a new message. Called once by `begin_packing`.
    ///
    /// Fails with [`Error::PeerClosed`] (or [`Error::ConnectionLost`]) when the peer is known
    /// to be gone, and with [`Error::Poisoned`] once the connection was torn down. A driver
    /// that can tell checks, at a bounded rate, whether the peer went away while this side
    /// was idle (a zero-timeout poll of its socket for a hang-up, its pidfd, a closed flag):
    /// otherwise a send to a dead peer can succeed into a kernel or ring buffer and vanish.
    /// The rate limit is [`ProbeGate`](crate::liveness::ProbeGate) (at most one probe per
    /// clock tick, so the fast path pays one coarse clock read).
    ///
    /// # Errors
    ///
    /// As described above.
    fn begin_message(&mut self) -> Result<()> {
        Ok(())
    }

    /// Copy BMM: lend buffer space of TM `tm` to `fill`, which writes a prefix of it and
    /// returns how many bytes it wrote. The driver lends at least one byte, or returns
    /// `Pending` (no space: ring full, no credit). A driver may transmit a buffer as soon as it
    /// is full. `want` is how many bytes the core has left to copy for the current piece (a
    /// hint: lending less is fine).
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn with_buffer(
        &mut self,
        tm: TmId,
        want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>>;

    /// Gather BMM: transmit `iov` (user memory) in order after everything handed over before.
    /// Return `Ready` only once the driver no longer needs the memory.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>>;

    /// Commit: TM `tm` is about to stop being used (the next piece goes to another TM).
    /// Anything it holds must go before anything handed to another TM afterwards.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn commit(&mut self, tm: TmId) -> Result<Poll<()>> {
        let _ = tm;
        Ok(Poll::Ready(()))
    }

    /// From now until `set_nonblocking(false)`, the engine's calls come from a caller that
    /// must not wait in the driver ([`Packer::poll_end_packing`](crate::Packer::poll_end_packing)
    /// and an event loop's sends): a driver that otherwise waits in the kernel for its
    /// transfers to complete (tcp under `progress=block`) returns `Pending` instead. The
    /// engine calls it only when the setting changes; a new message starts blocking-allowed.
    /// Drivers that never wait in these calls ignore it (the default).
    fn set_nonblocking(&mut self, on: bool) {
        let _ = on;
    }

    /// End of message: everything handed over must be transmitted before `Ready`.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn end_message(&mut self) -> Result<Poll<()>>;

    /// The message is abandoned midway (its `Packer` was dropped, or a call failed).
    ///
    /// If nothing of it had become visible to the peer, discard it and return
    /// [`AbortOutcome::Discarded`]: the connection stays intact. Otherwise the connection is
    /// the unit of failure: tear it down **in both directions** and return
    /// [`AbortOutcome::Broken`]. The peer's pending and later operations on this connection
    /// (a receive waiting for the rest of the message, its sends, its receives) must fail
    /// within a bounded time, and this side's later operations on both halves fail too
    /// ([`Error::Poisoned`]; [`Teardown`](crate::liveness::Teardown) is the shared flag).
    /// A socket driver resets the connection (`connect(AF_UNSPEC)` on TCP: a shutdown of the
    /// writing side alone lets the peer's sends succeed and vanish); a shared-memory driver
    /// sets both closed flags and wakes both sides.
    fn abort_message(&mut self) -> AbortOutcome;

    /// Block until sending may progress, or `timeout` passes. Spurious returns are fine.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)). A timeout is not an error:
    /// return `Ok`.
    fn wait(&mut self, timeout: Duration) -> Result<()>;

    /// A counter that changes whenever this link moves data (e.g. bytes the kernel accepted).
    /// While a long wait keeps moving data, the adaptive progress policy keeps spinning
    /// instead of blocking (see [`ProgressPolicy::drive_marked`](crate::progress::ProgressPolicy::drive_marked)).
    /// The default, a constant, gives no hint: the wait blocks after its spin budget.
    fn progress_mark(&self) -> u64 {
        0
    }

    /// A hint, after each piece received EXPRESS (under
    /// [`Packer::flush_at_end`](crate::Packer::flush_at_end): before a copy of more than
    /// 4 KiB that follows one): the receiver needs that piece to issue its next unpacks, so
    /// a driver that can make it visible cheaply (a ring that keeps short lends unpublished
    /// to move a short message with one publication) does it now. Drivers for
    /// which that costs a system call keep the default, which does nothing: the engine's
    /// guarantee is that EXPRESS data is available when the receiver's `unpack` returns, and
    /// the sender's bytes reach the receiver at the latest at `end_packing` (or at
    /// [`flush`](Self::flush), when the user asks).
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn publish(&mut self) -> Result<()> {
        Ok(())
    }

    /// `Packer::flush`: everything handed over so far (lends, sent groups) must reach the peer
    /// without further calls before this returns `Ready` (`Pending` is back-pressure, as
    /// anywhere). Later lends may start a new buffer. Used when a sender waits for its
    /// receiver in the middle of a message. The default calls [`publish`](Self::publish) and is
    /// right only for drivers whose buffered bytes always leave on their own; a driver that
    /// keeps lends in its own memory until a commit or the end (a socket's send buffer, an
    /// eager buffer) sends them here.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn flush(&mut self) -> Result<Poll<()>> {
        self.publish().map(|()| Poll::Ready(()))
    }

    /// Event-loop form of [`wait`](Self::wait), called after a send method returned
    /// `Pending` by a caller that will sleep on the channel's
    /// [`Incoming::readiness_fd`] instead of blocking here. Return [`Armed::Busy`] when the
    /// send may progress now (room, credit, a writable socket, a peer gone); otherwise arrange
    /// that its next progress makes the channel's readiness descriptor readable, and return
    /// [`Armed::Armed`]. The arrangement must be race-free: progress that happens between the
    /// check and the caller's sleep still makes the descriptor readable (set the "armed" flag
    /// first, then check). The default says `Busy`, which is right for drivers without a
    /// descriptor (the caller polls with back-off).
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] for what breaks the protocol. The core then
    /// abandons the message ([`abort_message`](TxLink::abort_message)).
    fn arm_send(&mut self) -> Result<Armed> {
        Ok(Armed::Busy)
    }
}

/// The receiving half of one point-to-point connection.
pub trait RxLink: Send {
    /// Non-blocking: is the start of a message (TM 0 data) available? `Err` if the peer is gone
    /// (closed, reset, dead) and nothing it sent is left to read, or once the connection was
    /// torn down. A driver that cannot learn of a dead peer from the call itself (a ring
    /// that stays empty) checks at a bounded rate on the `Pending` path, so that an
    /// any-source `try_begin_unpacking` loop learns that its peers are gone.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] when the peer's bytes break the protocol.
    fn poll_message(&mut self) -> Result<Poll<()>>;

    /// Copy BMM: lend received bytes of TM `tm` to `take`, which copies a prefix out and
    /// returns how many bytes it consumed. `want` is how many the core still needs for the
    /// current piece (a hint: lending more is fine, the rest stays for the next call). Returns
    /// `Pending` when nothing has arrived yet.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] when the peer's bytes break the protocol.
    fn with_data(
        &mut self,
        tm: TmId,
        want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>>;

    /// Gather BMM: receive the group the sender handed to `send_refs`, scattering it into
    /// `iov`. `Ready` once every byte is in place.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] when the peer's bytes break the protocol.
    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>>;

    /// Mirror of [`TxLink::set_nonblocking`]: from now until `set_nonblocking(false)`, the
    /// receive calls come from a caller that must not wait in the driver (a deferred
    /// [`Unpacker`](crate::Unpacker): `poll_unpack_express`, `poll_end_unpacking`, an event
    /// loop), so a driver that otherwise waits in the kernel for a whole group returns
    /// `Pending` instead. Ignored by default.
    fn set_nonblocking(&mut self, on: bool) {
        let _ = on;
    }

    /// Checkout: TM `tm` is no longer used for now (mirror of [`TxLink::commit`]). A driver
    /// with message-sized buffers checks the current buffer was consumed entirely.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] when the peer's bytes break the protocol.
    fn checkout(&mut self, tm: TmId) -> Result<()> {
        let _ = tm;
        Ok(())
    }

    /// End of message: release per-message resources.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] when the peer's bytes break the protocol.
    fn end_message(&mut self) -> Result<()> {
        Ok(())
    }

    /// The message is abandoned midway (its `Unpacker` was dropped or failed): the rest of it
    /// is still on its way, the stream is out of step, and the connection is torn down **in
    /// both directions**, as in [`TxLink::abort_message`]: the peer's blocked and later sends
    /// (a large `end_packing` waiting for room included) and its receives fail within a
    /// bounded time, and both halves of this side fail from now on. Closing only this side's
    /// reading (`shutdown(SHUT_RD)`) is not enough: it tells the peer nothing.
    fn abort_message(&mut self) {}

    /// Block until receiving may progress, or `timeout` passes. Spurious returns are fine.
    ///
    /// # Errors
    ///
    /// The connection's failure: [`Error::PeerClosed`] or
    /// [`Error::ConnectionLost`] when the peer is gone,
    /// [`Error::Poisoned`] once the connection was torn down,
    /// [`Error::Protocol`] when the peer's bytes break the protocol. A
    /// timeout is not an error: return `Ok`.
    fn wait(&mut self, timeout: Duration) -> Result<()>;

    /// Mirror of [`TxLink::progress_mark`]: changes whenever this link receives data.
    fn progress_mark(&self) -> u64 {
        0
    }
}

/// Any-source readiness across all connections of a channel (epoll for sockets, a doorbell for
/// rings).
pub trait Incoming: Send + Sync {
    /// Non-blocking: call `ready(rank)` for peers that may have a message (or an error) to
    /// report. False positives are fine; the core confirms with [`RxLink::poll_message`].
    ///
    /// # Errors
    ///
    /// A failure of the driver's any-source machinery ([`Error::Io`]); a failed
    /// connection is reported by its [`RxLink`] instead.
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()>;

    /// Block until some peer may be ready, [`wake`](Incoming::wake) is called, or `timeout`
    /// passes.
    ///
    /// # Errors
    ///
    /// As [`poll`](Incoming::poll); a timeout is not an error.
    fn wait(&self, timeout: Duration) -> Result<()>;

    /// Wake threads blocked in [`wait`](Incoming::wait) (the core calls it when a connection
    /// with more buffered data is released by another thread).
    fn wake(&self);

    /// The core will not receive from `rank` on this channel any more: its connection
    /// failed or closed, and the failure was reported (or the close taken as the peer
    /// leaving). Stop watching it, so that a descriptor or flag that stays readable after a
    /// hang-up does not keep [`wait`](Incoming::wait) returning at once (an any-source
    /// receiver would spin). Called once per peer; the default does nothing, which is right
    /// for drivers whose readiness of a closed peer is not sticky.
    fn forget(&self, rank: usize) {
        let _ = rank;
    }

    /// The channel's readiness descriptor, for event loops (epoll, mio, tokio's `AsyncFd`):
    /// it is readable when an event happened since the last [`arm`](Self::arm) returned
    /// [`Armed::Armed`]: a message start or a hang-up on some connection, a peer's death, a
    /// [`wake`](Self::wake), or progress of a send armed with [`TxLink::arm_send`]. The
    /// descriptor is the same for the channel's whole life; it may stay readable until the
    /// next `arm` (level), and false positives are fine. `None` (the default): the driver has
    /// no descriptor (MPI progresses only inside MPI calls), and event-driven callers poll it
    /// with back-off.
    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// Arm the readiness descriptor (`ucp_worker_arm`): clear its readable state, then return
    /// [`Armed::Busy`] if a peer may be ready already (a message start, a hang-up, a pending
    /// wake), so the caller polls instead of sleeping; otherwise [`Armed::Armed`], and the next
    /// event makes the descriptor readable. No wake-up may be lost between this check and the
    /// caller's sleep: set the flag that makes senders signal before looking at the queues.
    /// Senders signal only while the receiver is armed, so traffic between arms costs nothing.
    /// The default (no descriptor) always says `Busy`.
    ///
    /// # Errors
    ///
    /// As [`poll`](Incoming::poll) ([`Error::Io`] when the descriptor cannot be
    /// armed).
    fn arm(&self) -> Result<Armed> {
        Ok(Armed::Busy)
    }

    /// The end of an [`arm`](Self::arm) that said [`Armed::Armed`]: the caller slept on the
    /// descriptor (or gave up waiting) and polls again. A driver whose watching costs traffic
    /// something may stop watching until the next arm (tcp takes its sockets out of its epoll
    /// set: the kernel runs a callback for every segment that arrives on a socket in one).
    /// Arms and disarms pair up, across all the channel's waiters; a caller that never disarms
    /// leaves the driver watching. The default does nothing.
    fn disarm(&self) {}

    /// The channel is closing ([`Channel::close`](crate::Channel::close)): tell every peer
    /// with a clean close (as a process that leaves between messages does), and make every
    /// blocked wait of this channel return promptly: [`wait`](Self::wait),
    /// [`RxLink::wait`], [`TxLink::wait`] on every connection (the core holds the links'
    /// locks meanwhile, so this must work without them). Later calls on the links may fail.
    /// Called once. The default only [`wake`](Self::wake)s: link waits then end at their
    /// time slice, and peers learn of the close when the links are dropped.
    fn shutdown(&self) {
        self.wake();
    }
}

/// An [`Incoming`] that watches nothing: for a channel whose connections are watched
/// elsewhere (a virtual channel asks its parts), and for tests and benchmarks that build a
/// channel from bare links. `wait` sleeps at most 1 ms, so a caller that loops on it never
/// spins.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoIncoming;

impl Incoming for NoIncoming {
    fn poll(&self, _ready: &mut dyn FnMut(usize)) -> Result<()> {
        Ok(())
    }
    fn wait(&self, timeout: Duration) -> Result<()> {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        Ok(())
    }
    fn wake(&self) {}
}

/// The two halves of a connection to one peer.
pub struct LinkPair {
    /// Sending half.
    pub tx: Box<dyn TxLink>,
    /// Receiving half.
    pub rx: Box<dyn RxLink>,
}

impl std::fmt::Debug for LinkPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkPair").finish_non_exhaustive()
    }
}

/// What a driver returns when a channel opens ([`OpenedChannel::new`], then
/// [`with_notes`](OpenedChannel::with_notes)).
#[non_exhaustive]
pub struct OpenedChannel {
    /// One entry per rank; `None` for this process's own rank (and for ranks the driver cannot
    /// reach, e.g. remote hosts for an intra-node driver).
    pub links: Vec<Option<LinkPair>>,
    /// Any-source readiness.
    pub incoming: Box<dyn Incoming>,
    /// Lines for the selection table about the active paths (e.g. "CMA permitted: yes").
    pub notes: Vec<String>,
}

impl OpenedChannel {
    /// The links (one entry per rank, `None` for this rank and unreachable ones) and the
    /// any-source readiness of a channel, without notes.
    pub fn new(links: Vec<Option<LinkPair>>, incoming: Box<dyn Incoming>) -> Self {
        OpenedChannel {
            links,
            incoming,
            notes: Vec::new(),
        }
    }
    /// [`OpenedChannel::notes`].
    #[must_use]
    pub fn with_notes(mut self, notes: Vec<String>) -> Self {
        self.notes = notes;
        self
    }
}

impl std::fmt::Debug for OpenedChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedChannel")
            .field("ranks", &self.links.len())
            .field(
                "connected",
                &self.links.iter().filter(|l| l.is_some()).count(),
            )
            .field("notes", &self.notes)
            .finish_non_exhaustive()
    }
}

/// Everything a driver needs to open a channel ([`OpenContext::new`] outside the session, e.g.
/// to open a driver's links directly in a test).
#[non_exhaustive]
pub struct OpenContext<'a> {
    /// The channel configuration (name, driver, adapter, options).
    pub config: &'a ChannelConfig,
    /// The session bootstrap (rank, size, secret, allgather).
    pub bootstrap: &'a dyn Bootstrap,
    /// The TM table (after configuration overrides); its fingerprint must be checked
    /// against each peer's when connecting. A `tune=auto` open that measures
    /// ([`crate::tune`]) installs other thresholds after `open` returns: links may use the
    /// thresholds as hints only, and every TM must carry a piece of any length.
    pub table: &'a TmTable,
    /// The channel's progress policy (drivers use it for their own internal waits).
    pub progress: &'a ProgressPolicy,
}

impl std::fmt::Debug for OpenContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenContext")
            .field("config", self.config)
            .field("rank", &self.bootstrap.rank())
            .field("size", &self.bootstrap.size())
            .field("table", self.table)
            .field("progress", self.progress)
            .finish()
    }
}

impl<'a> OpenContext<'a> {
    /// The context of opening `config` with `table` and `progress` among the processes of
    /// `bootstrap`.
    pub fn new(
        config: &'a ChannelConfig,
        bootstrap: &'a dyn Bootstrap,
        table: &'a TmTable,
        progress: &'a ProgressPolicy,
    ) -> Self {
        OpenContext {
            config,
            bootstrap,
            table,
            progress,
        }
    }

    /// Whether this rank connects to `rank` on this channel: another rank, and both in the
    /// channel's `ranks=` set when it has one ([`ChannelConfig::ranks`]). A driver that
    /// connects other ranks too loses those connections (the session drops them), but
    /// should not try: the network may not reach them.
    pub fn reaches(&self, rank: usize) -> bool {
        let me = self.bootstrap.rank();
        rank != me
            && rank < self.bootstrap.size()
            && self
                .config
                .ranks
                .as_ref()
                .is_none_or(|s| s.contains(me) && s.contains(rank))
    }

    /// The ranks on this host that this rank connects to, and this rank
    /// ([`Bootstrap::local_ranks`] within the channel's `ranks=` set): what an intra-node
    /// driver connects.
    pub fn local_ranks(&self) -> Vec<usize> {
        let me = self.bootstrap.rank();
        self.bootstrap
            .local_ranks()
            .into_iter()
            .filter(|&r| r == me || self.reaches(r))
            .collect()
    }

    /// A tag for bootstrap collectives that is unique to this channel.
    pub fn tag(&self, what: &str) -> String {
        format!("chan/{}/{}/{}", self.config.name, self.config.driver, what)
    }
}

/// A driver: a factory of channels over one protocol.
///
/// Register it with [`SessionBuilder::driver`](crate::SessionBuilder::driver); channels whose
/// configuration names it (`driver = "tcp"`) are opened through it.
pub trait Driver: Send + Sync {
    /// The name used in channel configurations (`tcp`, `shm`, `mpi`, `via`, `sisci`).
    fn name(&self) -> &'static str;

    /// Backends/adapters this driver knows, for error messages ("tcp: any local address").
    fn describe(&self) -> String;

    /// The adapters and option keys this driver accepts for `config` (the keys may depend on
    /// the adapter). The session refuses any other adapter or key with
    /// [`Error::BadConfig`] before calling anything else
    /// ([`ChannelConfig::check_against`]); the core keys (`checked`, `progress`,
    /// `timeout_ms`, `tm.<name>`) are always accepted. The default accepts no adapter and no
    /// option of the driver's own.
    fn accepted_options(&self, config: &ChannelConfig) -> DriverOptions {
        let _ = config;
        DriverOptions::NONE
    }

    /// The driver's TM table for this configuration (before threshold overrides).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] when the configuration's options do not give a
    /// valid table (a threshold out of range).
    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable>;

    /// The driver's capabilities for this configuration.
    fn capabilities(&self, config: &ChannelConfig) -> Capabilities;

    /// Open a channel: collective over the session (every rank calls it for the same channel).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] for options the driver refuses;
    /// [`Error::Unavailable`] when it cannot run here;
    /// [`Error::Io`], [`Error::Resource`],
    /// [`Error::Auth`], [`Error::Protocol`] for what
    /// fails while connecting; the bootstrap's errors. The session makes the other ranks' opens
    /// fail too.
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel>;
}
