//! Memory registration: the protection domain, its bounded LRU registration cache, the table of
//! regions advertised for RDMA writes, and the pool of pre-registered buffers lent to users.
//!
//! # What "registered" means on the soft backend
//!
//! Registering a range pins it with `mlock(2)` (what M-VIA's kernel agent did for VIA memory
//! handles) and gives it a key; deregistering unpins it. That is the soft provider's real
//! registration cost, measured by the Figure 4 sweep, not an emulated delay. If the process may
//! not lock memory (`RLIMIT_MEMLOCK`), registration still succeeds, unpinned, and
//! [`RegStats::pin_failures`] counts it.
//!
//! # Why cache entries cannot outlive their memory in a harmful way
//!
//! * Memory the library owns ([`RegisteredBuffer`], small-TM slots) is registered once and
//!   deregistered exactly when the library frees it: those entries never go stale.
//! * User memory is cached by address range (bounded, least recently used). The library cannot
//!   see the user free memory, so an entry may describe memory that was freed and reused. On the
//!   soft backend that is harmless: the soft NIC never writes through a cached address (RDMA
//!   writes land through the borrow the core holds for the duration of the receive call, and a
//!   key is only *advertised* for that duration), so a stale entry costs at most a stale
//!   `mlock` until it is evicted. On the verbs backend a stale memory region would let the HCA
//!   DMA into freed pages, so that backend must register user memory for the call only (cache
//!   disabled: `regcache=0`), caching only library-owned buffers; see NOTES.md.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use mad_core::{Error, Result};

use crate::sys;

/// Default number of user registrations kept by the cache.
pub const DEFAULT_CACHE_ENTRIES: usize = 64;
/// Most bytes of user memory the cache keeps registered.
pub const CACHE_MAX_BYTES: usize = 256 << 20;
/// Pre-registered buffers kept for reuse after release.
const POOL_KEEP: usize = 16;

/// Counters of the registration layer (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegStats {
    /// Registrations performed (pin + key), including library-owned memory.
    pub registrations: u64,
    /// Deregistrations performed.
    pub deregistrations: u64,
    /// Lookups satisfied by the user-memory cache.
    pub cache_hits: u64,
    /// Lookups satisfied by library-owned pre-registered memory (no registration at all).
    pub owned_hits: u64,
    /// Cache entries evicted (least recently used first).
    pub evictions: u64,
    /// Registrations that could not pin (`mlock` refused); the range is registered unpinned.
    pub pin_failures: u64,
    /// RDMA writes refused (bad key, out of bounds).
    pub refused_writes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryKind {
    /// User memory kept by the LRU cache.
    Cached,
    /// User memory registered for one call (cache disabled).
    Temp,
    /// Memory the library owns.
    Owned,
}

#[derive(Debug)]
struct Entry {
    key: u32,
    addr: usize,
    len: usize,
    pinned: bool,
    kind: EntryKind,
    last_use: u64,
    refs: u32,
}

#[derive(Debug, Clone, Copy)]
struct Exposed {
    addr: u64,
    len: u64,
}

#[derive(Debug, Default)]
struct State {
    entries: Vec<Entry>,
    exposed: HashMap<u32, Exposed>,
    tick: u64,
    next_key: u32,
    stats: RegStats,
    pool: Vec<Box<[u8]>>,
}

/// A protection domain: every registration and advertised region of one driver instance.
#[derive(Debug)]
pub struct Pd {
    state: Mutex<State>,
    cache_entries: usize,
}

/// Proof that a range is registered, held while it is in use; give it back with
/// [`Pd::release`].
#[derive(Debug)]
#[must_use]
pub struct Lease {
    key: u32,
}

impl Lease {
    /// The registration's key.
    pub fn key(&self) -> u32 {
        self.key
    }
}

impl Pd {
    /// A protection domain whose cache keeps `cache_entries` user registrations (0: register
    /// user memory for each call).
    pub fn new(cache_entries: usize) -> Arc<Pd> {
        Arc::new(Pd {
            state: Mutex::new(State {
                next_key: 0x5a00_0001,
                ..Default::default()
            }),
            cache_entries,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the table inconsistent in a way that
        // matters for memory safety; keep going with the inner value.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters.
    pub fn stats(&self) -> RegStats {
        self.lock().stats
    }

    /// Make sure `[addr, addr + len)` is registered and return a lease on it: a hit in the
    /// library-owned buffers or in the cache costs nothing; a miss registers (pins) the range.
    pub fn acquire(&self, addr: usize, len: usize) -> Lease {
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        let end = addr.saturating_add(len);
        if let Some(i) = st.entries.iter().position(|e| {
            e.kind != EntryKind::Temp && e.addr <= addr && end <= e.addr.saturating_add(e.len)
        }) {
            let e = &mut st.entries[i];
            e.refs += 1;
            e.last_use = tick;
            let (key, kind) = (e.key, e.kind);
            if kind == EntryKind::Owned {
                st.stats.owned_hits += 1;
            } else {
                st.stats.cache_hits += 1;
            }
            return Lease { key };
        }
        let kind = if self.cache_entries == 0 {
            EntryKind::Temp
        } else {
            EntryKind::Cached
        };
        let key = Self::register_locked(&mut st, addr, len, kind, tick);
        if let Some(e) = st.entries.iter_mut().find(|e| e.key == key) {
            e.refs = 1;
        }
        self.evict_locked(&mut st);
        Lease { key }
    }

    fn register_locked(st: &mut State, addr: usize, len: usize, kind: EntryKind, tick: u64) -> u32 {
        let pinned = sys::pin(addr, len);
        if !pinned && len > 0 {
            st.stats.pin_failures += 1;
        }
        st.next_key = st.next_key.wrapping_add(0x9e37).max(1);
        let key = st.next_key;
        st.entries.push(Entry {
            key,
            addr,
            len,
            pinned,
            kind,
            last_use: tick,
            refs: 0,
        });
        st.stats.registrations += 1;
        key
    }

    fn deregister_at(st: &mut State, i: usize) {
        let e = st.entries.swap_remove(i);
        if e.pinned {
            sys::unpin(e.addr, e.len);
        }
        st.exposed.retain(|_, x| {
            !(x.addr as usize >= e.addr && (x.addr as usize) < e.addr.saturating_add(e.len.max(1)))
        });
        st.stats.deregistrations += 1;
    }

    fn evict_locked(&self, st: &mut State) {
        loop {
            let (mut n, mut bytes) = (0usize, 0usize);
            for e in st.entries.iter().filter(|e| e.kind == EntryKind::Cached) {
                n += 1;
                bytes = bytes.saturating_add(e.len);
            }
            if n <= self.cache_entries && bytes <= CACHE_MAX_BYTES {
                return;
            }
            let victim = st
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.kind == EntryKind::Cached && e.refs == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(i, _)| i);
            match victim {
                Some(i) => {
                    Self::deregister_at(st, i);
                    st.stats.evictions += 1;
                }
                None => return,
            }
        }
    }

    /// Give a lease back; a per-call registration is deregistered now.
    pub fn release(&self, lease: Lease) {
        let mut st = self.lock();
        if let Some(i) = st.entries.iter().position(|e| e.key == lease.key) {
            let e = &mut st.entries[i];
            e.refs = e.refs.saturating_sub(1);
            if e.kind == EntryKind::Temp && e.refs == 0 {
                Self::deregister_at(&mut st, i);
            }
        }
        self.evict_locked(&mut st);
    }

    /// Whether `[addr, addr + len)` lies in a registered range.
    pub fn is_registered(&self, addr: usize, len: usize) -> bool {
        let end = addr.saturating_add(len);
        self.lock()
            .entries
            .iter()
            .any(|e| e.addr <= addr && end <= e.addr.saturating_add(e.len))
    }

    /// Advertise a registered range for RDMA writes from peers; returns the key they must use.
    /// Fails if the range is not registered (verbs would refuse it too).
    pub fn expose(&self, lease: &Lease, addr: usize, len: usize) -> Result<u32> {
        let mut st = self.lock();
        let end = addr.saturating_add(len);
        let covered = st
            .entries
            .iter()
            .any(|e| e.key == lease.key && e.addr <= addr && end <= e.addr.saturating_add(e.len));
        if !covered {
            return Err(Error::Protocol {
                rank: usize::MAX,
                what: format!("exposing {len} B at {addr:#x}: range is not registered"),
            });
        }
        // Each advertisement gets its own key, so a write can never reach a range advertised
        // earlier under the same registration.
        st.next_key = st.next_key.wrapping_add(0x9e37).max(1);
        let key = st.next_key;
        st.exposed.insert(
            key,
            Exposed {
                addr: addr as u64,
                len: len as u64,
            },
        );
        Ok(key)
    }

    /// Withdraw an advertisement.
    pub fn unexpose(&self, key: u32) {
        self.lock().exposed.remove(&key);
    }

    /// The access check of an RDMA write: `key` must be advertised and `[addr, addr + len)`
    /// inside it. Counts refusals.
    pub fn check_write(&self, key: u32, addr: u64, len: u64) -> std::result::Result<(), String> {
        let mut st = self.lock();
        let r = match st.exposed.get(&key) {
            None => Err(format!(
                "RDMA write of {len} B with key {key:#x}: no region advertised under that key"
            )),
            Some(x) => {
                let ok = addr >= x.addr
                    && addr
                        .checked_add(len)
                        .is_some_and(|e| e <= x.addr.saturating_add(x.len));
                if ok {
                    Ok(())
                } else {
                    Err(format!(
                        "RDMA write of {len} B at {addr:#x} with key {key:#x}: outside the advertised region [{:#x}, +{})",
                        x.addr, x.len
                    ))
                }
            }
        };
        if r.is_err() {
            st.stats.refused_writes += 1;
        }
        r
    }

    /// Register memory the library owns (static slots, user-requested buffers).
    fn register_owned(&self, buf: &[u8]) {
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        Self::register_locked(
            &mut st,
            buf.as_ptr() as usize,
            buf.len(),
            EntryKind::Owned,
            tick,
        );
    }

    fn deregister_owned(&self, buf: &[u8]) {
        let mut st = self.lock();
        let addr = buf.as_ptr() as usize;
        if let Some(i) = st
            .entries
            .iter()
            .position(|e| e.kind == EntryKind::Owned && e.addr == addr)
        {
            Self::deregister_at(&mut st, i);
        }
    }
}

/// A buffer of library-owned, pre-registered memory (pCoR's "buffer request").
///
/// Fill it and pack it (or a prefix of it) like any slice: the medium and large transmission
/// modules find it registered already, so it travels without registration (and, above the
/// small threshold, without copy). Dropping it is pCoR's "release": the memory returns to the
/// driver's pool, still registered, for the next request. A `RegisteredBuffer` can also be the
/// destination of an unpack, which then skips registration on the receiving side.
pub struct RegisteredBuffer {
    mem: Option<Box<[u8]>>,
    len: usize,
    pd: Arc<Pd>,
}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegisteredBuffer({} B)", self.len)
    }
}

impl RegisteredBuffer {
    /// Request a registered buffer of `len` bytes (zero-filled when newly allocated; a reused
    /// buffer keeps its previous contents).
    pub fn request(pd: &Arc<Pd>, len: usize) -> RegisteredBuffer {
        let cap = len.max(64).next_power_of_two();
        let reused = {
            let mut st = pd.lock();
            st.pool
                .iter()
                .position(|b| b.len() == cap)
                .map(|i| st.pool.swap_remove(i))
        };
        let mem = reused.unwrap_or_else(|| {
            let b = vec![0u8; cap].into_boxed_slice();
            pd.register_owned(&b);
            b
        });
        RegisteredBuffer {
            mem: Some(mem),
            len,
            pd: pd.clone(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for RegisteredBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mem {
            Some(m) => &m[..self.len],
            None => &[],
        }
    }
}

impl std::ops::DerefMut for RegisteredBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Some(m) => &mut m[..self.len],
            None => &mut [],
        }
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            let mut st = self.pd.lock();
            if st.pool.len() < POOL_KEEP {
                st.pool.push(m);
                return;
            }
            drop(st);
            self.pd.deregister_owned(&m);
        }
    }
}

/// Static buffers owned by one connection (small-TM slots): registered on creation,
/// deregistered on drop.
#[derive(Debug)]
pub struct OwnedSlots {
    slots: Vec<Box<[u8]>>,
    pd: Arc<Pd>,
}

impl OwnedSlots {
    /// `n` registered slots of `size` bytes.
    pub fn new(pd: &Arc<Pd>, n: usize, size: usize) -> OwnedSlots {
        let slots: Vec<Box<[u8]>> = (0..n).map(|_| vec![0u8; size].into_boxed_slice()).collect();
        for s in &slots {
            pd.register_owned(s);
        }
        OwnedSlots {
            slots,
            pd: pd.clone(),
        }
    }
    /// Slot `i`.
    pub fn get(&self, i: usize) -> &[u8] {
        &self.slots[i]
    }
    /// Slot `i`, writable.
    pub fn get_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.slots[i]
    }
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

impl Drop for OwnedSlots {
    fn drop(&mut self) {
        for s in &self.slots {
            self.pd.deregister_owned(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_hits_and_lru_eviction() {
        let pd = Pd::new(2);
        let bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 4096]).collect();
        let a = |i: usize| bufs[i].as_ptr() as usize;
        let l = pd.acquire(a(0), 4096);
        pd.release(l);
        let l = pd.acquire(a(0), 100);
        pd.release(l);
        assert_eq!(pd.stats().registrations, 1);
        assert_eq!(pd.stats().cache_hits, 1);
        for i in [1, 2] {
            let l = pd.acquire(a(i), 4096);
            pd.release(l);
        }
        assert_eq!(pd.stats().evictions, 1);
        assert!(!pd.is_registered(a(0), 4096));
        assert!(pd.is_registered(a(2), 4096));
    }

    #[test]
    fn per_call_registration_without_cache() {
        let pd = Pd::new(0);
        let b = vec![0u8; 512];
        for _ in 0..3 {
            let l = pd.acquire(b.as_ptr() as usize, b.len());
            pd.release(l);
        }
        let s = pd.stats();
        assert_eq!(
            (s.registrations, s.deregistrations, s.cache_hits),
            (3, 3, 0)
        );
    }

    #[test]
    fn write_checks() {
        let pd = Pd::new(4);
        let b = [0u8; 100];
        let addr = b.as_ptr() as usize;
        let l = pd.acquire(addr, 100);
        let key = pd.expose(&l, addr, 100).unwrap();
        assert!(pd.check_write(key, addr as u64, 100).is_ok());
        assert!(pd.check_write(key, addr as u64 + 1, 100).is_err());
        assert!(pd.check_write(key ^ 1, addr as u64, 1).is_err());
        pd.unexpose(key);
        assert!(pd.check_write(key, addr as u64, 1).is_err());
        assert_eq!(pd.stats().refused_writes, 3);
        pd.release(l);
        let other = [0u8; 10];
        let l2 = pd.acquire(addr, 10);
        assert!(pd.expose(&l2, other.as_ptr() as usize, 10).is_err());
        pd.release(l2);
    }

    #[test]
    fn registered_buffers_are_owned_hits_and_pooled() {
        let pd = Pd::new(4);
        let mut b = RegisteredBuffer::request(&pd, 1000);
        b[..3].copy_from_slice(b"abc");
        let l = pd.acquire(b.as_ptr() as usize, 1000);
        pd.release(l);
        assert_eq!(pd.stats().owned_hits, 1);
        let regs = pd.stats().registrations;
        drop(b);
        let b2 = RegisteredBuffer::request(&pd, 900);
        assert_eq!(pd.stats().registrations, regs, "pooled buffer reused");
        assert_eq!(b2.len(), 900);
    }
}
