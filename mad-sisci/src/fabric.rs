//! The seam between the protocol ([`link`](crate::link)) and a backend.
//!
//! The protocol works on two [`Region`]s per connection, whatever the backend: *this process's
//! incoming area* (mapped locally; the peer writes it, this process polls it) and *the peer's
//! incoming area* (mapped remotely; this process writes it, never polls it). Everything else
//! it needs from the memory system is here, in four operations:
//!
//! | operation | `local` ([`Local`]) | `dolphin` ([`crate::dolphin::Dolphin`]) |
//! |---|---|---|
//! | **publish** a flag, offset or acknowledgement into the peer's area | Release store | `SCIStoreBarrier`, store, `SCIStoreBarrier` |
//! | **bulk copy** a chunk into the peer's area | block copy (PIO) | copy into a local staging chunk, `SCIStartDmaTransfer` + `SCIWaitForDMAQueue` (PIO copy when DMA is unavailable, and for an unaligned tail) |
//! | **wake** the peer after a publish | futex doorbell in its segment, only if it sleeps | nothing: the peer naps (see below) |
//! | **sleep** until something arrives | futex on this process's own word | check, then sleep [`NAP`](crate::dolphin::NAP), return (the caller polls again) |
//!
//! [`Fabric`] names the per-connection types of a backend; [`TxWire`], [`RxWire`] and
//! [`OwnWire`] carry the operations. The link types are generic over the fabric
//! (`SciTx<F>`, `SciRx<F>`, `SciIncoming<F>`), so each backend gets its own monomorphic copy
//! of the protocol with these calls inlined: on `local` the hot paths compile to the same
//! stores and doorbell checks as before the seam existed.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mad_core::hostmem::{Bell, Region};
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
    fn finish_block(&mut self, peer: usize, remote: &Region, base: usize, len: usize)
        -> Result<()>;
    /// Sleep for at most `t` unless `ready()` holds (a blocked sender waiting for an
    /// acknowledgement in `local`, its own area). Spurious returns are allowed.
    fn sleep(&self, local: &Region, t: Duration, ready: impl FnOnce() -> bool);
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
    type Own = Arc<Segment>;
}

/// Sending half on `local`: the peer's segment (its doorbell).
pub struct LocalTx {
    peer: Arc<Segment>,
}

impl LocalTx {
    /// Sending towards the owner of `peer`.
    pub fn new(peer: Arc<Segment>) -> Self {
        LocalTx { peer }
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
        self.peer.doorbell().notify();
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
}

/// Receiving half on `local`: this process's segment (its doorbell).
pub struct LocalRx {
    own: Arc<Segment>,
}

impl LocalRx {
    /// Receiving into `own`.
    pub fn new(own: Arc<Segment>) -> Self {
        LocalRx { own }
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

    /// A remote read of the peer's sleeper count, then a futex wake on its word.
    #[inline]
    fn wake_writer(&self, remote: &Region) {
        if let Some(bell) = writer_bell(remote) {
            bell.notify();
        }
    }

    #[inline]
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool) {
        self.own.doorbell().sleep(t, ready);
    }
}

impl OwnWire for Arc<Segment> {
    #[inline]
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool) {
        self.doorbell().sleep(t, ready);
    }

    fn wake(&self) {
        self.doorbell().ring();
    }
}
