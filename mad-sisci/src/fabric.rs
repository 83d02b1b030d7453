//! The seam between the protocol ([`link`](crate::link)) and a backend.
//!
//! The protocol works on two [`Region`]s per connection, whatever the backend: *this process's
//! incoming area* (mapped locally; the peer writes it, this process polls it) and *the peer's
//! incoming area* (mapped remotely; this process writes it, never polls it). Everything else
//! it needs from the memory system is here, in four operations (and an optional fifth):
//!
//! | operation | `local` ([`Local`]) | `dolphin` ([`crate::dolphin::Dolphin`]) |
//! |---|---|---|
//! | **publish** a flag, offset or acknowledgement into the peer's area | Release store | `SCIStoreBarrier`, store, `SCIStoreBarrier` |
//! | **bulk copy** a chunk into the peer's area | block copy (PIO) | copy into a local staging chunk, `SCIStartDmaTransfer` + `SCIWaitForDMAQueue` (PIO copy when DMA is unavailable, and for an unaligned tail) |
//! | **wake** the peer after a publish | futex doorbell in its segment, only if it sleeps | nothing: the peer naps (see below) |
//! | **sleep** until something arrives | futex on this process's own word | check, then sleep [`NAP`](crate::dolphin::NAP), return (the caller polls again) |
//! | **readiness** for event loops (event loops) | the sleeper words' `ARMED` bit, one datagram to the owner's socket ([`mad_core::hostmem::ready`]) | none: no descriptor (the defaults; untested hardware, and no wake-ups to hook it to) |
//!
//! [`Fabric`] names the per-connection types of a backend; [`TxWire`], [`RxWire`] and
//! [`OwnWire`] carry the operations. The link types are generic over the fabric
//! (`SciTx<F>`, `SciRx<F>`, `SciIncoming<F>`), so each backend gets its own monomorphic copy
//! of the protocol with these calls inlined: on `local` the hot paths compile to the same
//! stores and doorbell checks as before the seam existed.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mad_core::hostmem::{Bell, PeerSignals, Readiness, Region};
use mad_core::liveness::Teardown;
use mad_core::Result;

use crate::layout::ctl;
use crate::segment::Segment;

/// A backend: the types one connection's halves and the any-source watcher hold.
pub trait Fabric: Send + Sync + 'static {
    /// What the sending half of one connection holds (exclusively).
    type Tx: TxWire;
    /// What the receiving half of one connection holds (exclusively).
    type Rx: RxWire;
    /// What the any-source watcher holds (this process's own segment).
    type Own: OwnWire;
}

/// The operations of a sending half.
pub trait TxWire: Send + 'static {
    /// Publish `v` in `word`, a flag or offset in the peer's area: every store made before
    /// (data) reaches the peer's memory before `word` does.
    fn publish(&self, word: &AtomicU64, v: u64);
    /// [`publish`](Self::publish) for a 32-bit word (the close flags).
    fn publish32(&self, word: &AtomicU32, v: u32);
    /// Wake the peer's readers if they sleep (after a publish).
    fn wake_reader(&self);
    /// Store `src` at `base + at` of `remote` as part of one bulk block starting at `base`
    /// (block copies until [`finish_block`](Self::finish_block)). `None` if out of bounds.
    fn block_write(&mut self, remote: &Region, base: usize, at: usize, src: &[u8]) -> Option<()>;
    /// The block of `len` bytes at `base` of `remote` is complete: make it land in the peer's
    /// memory (a DMA transfer) before the flag is published. `peer` is for errors.
    ///
    /// # Errors
    ///
    /// [`Error::ConnectionLost`](mad_core::Error::ConnectionLost) for `peer` when the transfer
    /// fails; [`Error::Poisoned`](mad_core::Error::Poisoned) once the connection was torn down.
    fn finish_block(&mut self, peer: usize, remote: &Region, base: usize, len: usize)
        -> Result<()>;
    /// Sleep for at most `t` unless `ready()` holds (a blocked sender waiting for an
    /// acknowledgement in `local`, its own area). Spurious returns are allowed.
    fn sleep(&self, local: &Region, t: Duration, ready: impl FnOnce() -> bool);
    /// Wake the peer's blocked sender (its bell is in `remote`, the area this side writes)
    /// after publishing a close flag. The default does nothing (it notices within its nap).
    fn wake_writer(&self, remote: &Region) {
        let _ = remote;
    }
    /// Mark this side's blocked sender armed on its bell in `local` (`TxLink::arm_send`): the
    /// peer's next acknowledgement signals the channel's readiness descriptor. Fences after.
    /// Returns false when the backend has no descriptor (the default).
    fn arm_send(&self, local: &Region) -> bool {
        let _ = local;
        false
    }
}

/// The operations of a receiving half.
pub trait RxWire: Send + 'static {
    /// Publish `v` in `word`, an acknowledgement or flag in the peer's area.
    fn publish(&self, word: &AtomicU64, v: u64);
    /// [`publish`](Self::publish) for a 32-bit word (the close flags).
    fn publish32(&self, word: &AtomicU32, v: u32);
    /// Wake the peer's sender if it sleeps on an acknowledgement; `remote` is the area in the
    /// peer's segment this side writes.
    fn wake_writer(&self, remote: &Region);
    /// Sleep for at most `t` unless `ready()` holds. Spurious returns are allowed.
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool);
}

/// The operations of the any-source watcher.
pub trait OwnWire: Send + Sync + 'static {
    /// Sleep for at most `t` unless `ready()` holds. Spurious returns are allowed.
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool);
    /// Wake the threads of this process sleeping in [`sleep`](Self::sleep).
    fn wake(&self);
    /// The channel's readiness descriptor and its bookkeeping; `None` (the default): the
    /// backend has none.
    fn readiness(&self) -> Option<&Readiness> {
        None
    }
    /// Mark this process's doorbell armed: writers then signal the readiness descriptor.
    /// Fences after.
    fn arm(&self) {}
}

/// The bell a blocked sender sleeps on, in the control block of `m` (its own segment's area
/// for the sender; the peer's, written remotely, for the receiver that wakes it).
#[inline]
pub(crate) fn writer_bell(m: &Region) -> Option<Bell<'_>> {
    Some(Bell::new(m.u32_at(ctl::TX_SEQ)?, m.u32_at(ctl::TX_SLEEP)?))
}

/// The `local` backend: segments in `/dev/shm` ([`Segment`]), futex doorbells.
#[derive(Debug, Clone, Copy, Default)]
pub struct Local;

impl Fabric for Local {
    type Tx = LocalTx;
    type Rx = LocalRx;
    type Own = LocalOwn;
}

/// Sending half on `local`: the peer's segment (its doorbell) and its readiness sockets.
#[derive(Debug)]
pub struct LocalTx {
    peer: Arc<Segment>,
    sigs: Option<PeerSignals>,
}

impl LocalTx {
    /// Sending towards the owner of `peer`.
    pub fn new(peer: Arc<Segment>) -> Self {
        LocalTx { peer, sigs: None }
    }

    /// Signal the peer's readiness sockets `sigs` when it armed its descriptor.
    #[must_use]
    pub fn with_signals(mut self, sigs: Option<PeerSignals>) -> Self {
        self.sigs = sigs;
        self
    }
}

impl TxWire for LocalTx {
    #[inline]
    fn publish(&self, word: &AtomicU64, v: u64) {
        // Coherent memory: the Release store is the store barrier.
        word.store(v, Ordering::Release);
    }

    #[inline]
    fn publish32(&self, word: &AtomicU32, v: u32) {
        word.store(v, Ordering::Release);
    }

    #[inline]
    fn wake_reader(&self) {
        self.peer
            .doorbell()
            .notify_with(self.sigs.as_ref().map(|s| &s.recv));
    }

    #[inline]
    fn block_write(&mut self, remote: &Region, base: usize, at: usize, src: &[u8]) -> Option<()> {
        remote.write(base.checked_add(at)?, src)
    }

    #[inline]
    fn finish_block(&mut self, _: usize, _: &Region, _: usize, _: usize) -> Result<()> {
        Ok(())
    }

    #[inline]
    fn sleep(&self, local: &Region, t: Duration, ready: impl FnOnce() -> bool) {
        match writer_bell(local) {
            Some(bell) => bell.sleep(t, ready),
            None => {
                if !ready() {
                    std::thread::sleep(t);
                }
            }
        }
    }

    fn wake_writer(&self, remote: &Region) {
        if let Some(bell) = writer_bell(remote) {
            bell.notify_with(self.sigs.as_ref().map(|s| &s.send));
        }
    }

    fn arm_send(&self, local: &Region) -> bool {
        match (&self.sigs, writer_bell(local)) {
            (Some(_), Some(bell)) => {
                bell.arm();
                true
            }
            _ => false,
        }
    }
}

/// Receiving half on `local`: this process's segment (its doorbell), and the peer's readiness
/// sockets (for its armed sends).
#[derive(Debug)]
pub struct LocalRx {
    own: Arc<Segment>,
    sigs: Option<PeerSignals>,
}

impl LocalRx {
    /// Receiving into `own`.
    pub fn new(own: Arc<Segment>) -> Self {
        LocalRx { own, sigs: None }
    }

    /// Signal the peer's readiness sockets `sigs` when it armed a send.
    #[must_use]
    pub fn with_signals(mut self, sigs: Option<PeerSignals>) -> Self {
        self.sigs = sigs;
        self
    }
}

impl RxWire for LocalRx {
    #[inline]
    fn publish(&self, word: &AtomicU64, v: u64) {
        word.store(v, Ordering::Release);
    }

    #[inline]
    fn publish32(&self, word: &AtomicU32, v: u32) {
        word.store(v, Ordering::Release);
    }

    /// A remote read of the peer's sleeper count, then a futex wake on its word (or a
    /// datagram to its readiness descriptor if it armed a send).
    #[inline]
    fn wake_writer(&self, remote: &Region) {
        if let Some(bell) = writer_bell(remote) {
            bell.notify_with(self.sigs.as_ref().map(|s| &s.send));
        }
    }

    #[inline]
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool) {
        self.own.doorbell().sleep(t, ready);
    }
}

/// The any-source watcher on `local`: this process's segment (its doorbell) and the channel's
/// readiness descriptor, if it has one.
#[derive(Debug)]
pub struct LocalOwn {
    seg: Arc<Segment>,
    ready: Option<Readiness>,
}

impl LocalOwn {
    /// Watching `seg`'s doorbell, with the readiness descriptor `ready`.
    pub fn new(seg: Arc<Segment>, ready: Option<Readiness>) -> Self {
        LocalOwn { seg, ready }
    }
}

impl OwnWire for LocalOwn {
    #[inline]
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool) {
        self.seg.doorbell().sleep(t, ready);
    }

    fn wake(&self) {
        let bell = self.seg.doorbell();
        bell.ring();
        if let Some(r) = &self.ready {
            r.wake(bell);
        }
    }

    fn readiness(&self) -> Option<&Readiness> {
        self.ready.as_ref()
    }

    fn arm(&self) {
        self.seg.doorbell().arm();
    }
}

/// What the channel's shutdown does to one connection on `local`
/// ([`Incoming::shutdown`](mad_core::driver::Incoming::shutdown)): plain stores into the
/// peer's area, its bells in shared memory.
#[derive(Debug)]
pub struct LocalShut {
    torn: Arc<Teardown>,
    /// The area of the peer's segment this side writes.
    remote: Region,
    /// The area of this segment the peer writes (our sender's bell).
    local: Region,
    peer: Arc<Segment>,
    sigs: Option<PeerSignals>,
}

impl LocalShut {
    /// The connection whose halves share `torn`, between the areas `local` and `remote`,
    /// towards the owner of `peer` (its sockets `sigs`).
    pub fn new(
        torn: Arc<Teardown>,
        local: Region,
        remote: Region,
        peer: Arc<Segment>,
        sigs: Option<PeerSignals>,
    ) -> Self {
        LocalShut {
            torn,
            remote,
            local,
            peer,
            sigs,
        }
    }

    /// Close: the peer sees our writer and our reader closed, as when a process leaves
    /// between messages (its receivers, its blocked sender and its armed descriptor are
    /// woken); our halves fail from now on and our blocked sender is woken (our receivers
    /// sleep on the doorbell, which the caller rings).
    pub fn shut(&self) {
        if !self.torn.tear("the channel was closed") {
            return;
        }
        for off in [ctl::W_CLOSED, ctl::R_CLOSED] {
            if let Some(w) = self.remote.u32_at(off) {
                w.store(1, Ordering::Release);
            }
        }
        self.peer
            .doorbell()
            .notify_with(self.sigs.as_ref().map(|s| &s.recv));
        if let Some(bell) = writer_bell(&self.remote) {
            bell.notify_with(self.sigs.as_ref().map(|s| &s.send));
        }
        if let Some(bell) = writer_bell(&self.local) {
            bell.ring();
        }
    }
}
