//! Memory registration: the driver-wide pool of library-owned registered buffers ([`Pd`],
//! [`RegisteredBuffer`]) and the per-channel registration cache (`RegCache`), the same code
//! for both providers.
//!
//! # Which registrations may be kept
//!
//! * **Library-owned memory** (a [`RegisteredBuffer`], a connection's static buffers) is
//!   registered when it is created and deregistered exactly when the library frees it, with
//!   every channel's protection domain: those registrations never go stale. A buffer the
//!   user releases goes back to the pool still registered (pCoR's request/release).
//! * **User memory** is the caller's: the library cannot see it being freed. Whether its
//!   registrations may outlive the call is the provider's decision
//!   (`Device::caches_user_memory` in the provider interface):
//!   * soft: yes, in a bounded LRU cache ([`DEFAULT_CACHE_ENTRIES`] entries, at most
//!     [`CACHE_MAX_BYTES`]). A stale entry is harmless there: the soft NIC writes user memory
//!     only through the borrow the receive call holds, never through a cached address, so a
//!     stale entry costs at most a stale `mlock` until it is evicted.
//!   * verbs: no. A registration pins the physical pages and the HCA writes them by DMA, so a
//!     cached registration of memory the user freed (and the allocator handed out again)
//!     would point the NIC at the wrong pages. The cache then registers user memory for the
//!     call and deregisters it when the transfer ends (`regcache=` only sizes the soft cache),
//!     so repeated large transfers on verbs pay registration each time unless they use
//!     [`RegisteredBuffer`]s.
//!
//! # What "registered" means on the soft backend
//!
//! Registering a range pins it with `mlock(2)` (what M-VIA's kernel agent did for VIA memory
//! handles) and gives it a key the soft NIC checks on every use; deregistering unpins it. That
//! is the soft provider's real registration cost, measured by the Figure 4 sweep, not an
//! emulated delay. If the process may not lock memory (`RLIMIT_MEMLOCK`), registration still
//! succeeds, unpinned, and [`RegStats::pin_failures`] counts it.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use mad_core::Result;

use crate::provider::{Device, MemoryRegion};

/// Default number of user registrations kept by a channel's cache.
pub const DEFAULT_CACHE_ENTRIES: usize = 64;
/// Most bytes of user memory a cache keeps registered.
pub const CACHE_MAX_BYTES: usize = 256 << 20;
/// Pre-registered buffers kept for reuse after release.
const POOL_KEEP: usize = 16;

/// Counters of the registration layer (for tests and benchmarks), summed over the channels of
/// one driver.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegStats {
    /// Registrations performed (user memory, library-owned buffers, static buffers).
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
    /// RDMA writes refused by the soft NIC (bad key, out of bounds).
    pub refused_writes: u64,
}

/// Something that keeps registrations of library-owned buffers (a channel's cache).
pub(crate) trait OwnedListener: Send + Sync {
    /// A library-owned buffer was created: register it.
    fn owned_added(&self, addr: usize, len: usize);
    /// A library-owned buffer is about to be freed: deregister it.
    fn owned_removed(&self, addr: usize, len: usize);
}

#[derive(Default)]
struct Owned {
    /// Live library-owned buffers (in use or pooled), `(addr, len)`.
    ranges: Vec<(usize, usize)>,
    listeners: Vec<Weak<dyn OwnedListener>>,
}

/// The driver's registration domain: the pool of library-owned registered buffers, the list
/// of channel caches that must register them, and the counters.
pub struct Pd {
    owned: Mutex<Owned>,
    pool: Mutex<Vec<Box<[u8]>>>,
    stats: Mutex<RegStats>,
    cache_entries: usize,
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pd(cache {} entries)", self.cache_entries)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave a table inconsistent in a way
    // that matters for memory safety; keep going with the inner value.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pd {
    /// A domain whose channel caches keep `cache_entries` user registrations each (0: register
    /// user memory for each call).
    pub fn new(cache_entries: usize) -> Arc<Pd> {
        Arc::new(Pd {
            owned: Mutex::new(Owned::default()),
            pool: Mutex::new(Vec::new()),
            stats: Mutex::new(RegStats::default()),
            cache_entries,
        })
    }

    /// Cache size given to channels that do not set `regcache=`.
    pub fn cache_entries(&self) -> usize {
        self.cache_entries
    }

    /// The counters.
    pub fn stats(&self) -> RegStats {
        *lock(&self.stats)
    }

    pub(crate) fn count(&self, f: impl FnOnce(&mut RegStats)) {
        f(&mut lock(&self.stats));
    }

    /// Register every live library-owned buffer with `l` and keep it informed from now on.
    pub(crate) fn add_listener(&self, l: Weak<dyn OwnedListener>) {
        let mut o = lock(&self.owned);
        o.listeners.retain(|w| w.strong_count() > 0);
        if let Some(s) = l.upgrade() {
            for &(a, n) in &o.ranges {
                s.owned_added(a, n);
            }
        }
        o.listeners.push(l);
    }

    fn add_owned(&self, b: &[u8]) {
        let (addr, len) = (b.as_ptr() as usize, b.len());
        let mut o = lock(&self.owned);
        o.ranges.push((addr, len));
        o.listeners.retain(|w| w.strong_count() > 0);
        for l in o.listeners.iter().filter_map(|w| w.upgrade()) {
            l.owned_added(addr, len);
        }
    }

    fn remove_owned(&self, b: &[u8]) {
        let (addr, len) = (b.as_ptr() as usize, b.len());
        let mut o = lock(&self.owned);
        o.ranges.retain(|&r| r != (addr, len));
        for l in o.listeners.iter().filter_map(|w| w.upgrade()) {
            l.owned_removed(addr, len);
        }
    }
}

/// Proof that a range is registered, held while it is in use; give it back with
/// [`RegCache::release`].
#[derive(Debug)]
#[must_use]
pub(crate) struct Lease {
    id: u64,
    lkey: u32,
    rkey: u32,
}

impl Lease {
    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// User memory kept by the LRU cache.
    Cached,
    /// User memory registered for one call.
    Temp,
    /// Memory the library owns.
    Owned,
}

struct Entry<M> {
    id: u64,
    addr: usize,
    len: usize,
    kind: Kind,
    last_use: u64,
    refs: u32,
    mr: M,
}

struct CacheState<M> {
    entries: Vec<Entry<M>>,
    tick: u64,
    next_id: u64,
}

/// A channel's registration cache over its provider's protection domain.
pub(crate) struct RegCache<D: Device> {
    device: Arc<D>,
    pd: Arc<Pd>,
    capacity: usize,
    state: Mutex<CacheState<D::Mr>>,
}

impl<D: Device> RegCache<D> {
    /// A cache keeping up to `capacity` user registrations (when the device allows caching),
    /// registered with `pd`'s library-owned buffers.
    pub fn new(device: Arc<D>, pd: &Arc<Pd>, capacity: usize) -> Arc<RegCache<D>> {
        let c = Arc::new(RegCache {
            device,
            pd: pd.clone(),
            capacity,
            state: Mutex::new(CacheState {
                entries: Vec::new(),
                tick: 0,
                next_id: 1,
            }),
        });
        let l: Arc<dyn OwnedListener> = c.clone();
        pd.add_listener(Arc::downgrade(&l));
        c
    }

    fn register(&self, addr: usize, len: usize) -> Result<D::Mr> {
        let mr = self.device.reg_mr(addr, len)?;
        self.pd.count(|s| s.registrations += 1);
        Ok(mr)
    }

    /// Make sure `[addr, addr + len)` is registered and lease it: a hit in library-owned
    /// memory or in the cache costs nothing; a miss registers the range.
    pub fn acquire(&self, addr: usize, len: usize) -> Result<Lease> {
        if len == 0 {
            return Ok(Lease {
                id: 0,
                lkey: 0,
                rkey: 0,
            });
        }
        let mut st = lock(&self.state);
        st.tick += 1;
        let tick = st.tick;
        let end = addr.saturating_add(len);
        if let Some(e) = st
            .entries
            .iter_mut()
            .find(|e| e.kind != Kind::Temp && e.addr <= addr && end <= e.addr.saturating_add(e.len))
        {
            e.refs += 1;
            e.last_use = tick;
            let lease = Lease {
                id: e.id,
                lkey: e.mr.lkey(),
                rkey: e.mr.rkey(),
            };
            let owned = e.kind == Kind::Owned;
            drop(st);
            self.pd.count(|s| {
                if owned {
                    s.owned_hits += 1
                } else {
                    s.cache_hits += 1
                }
            });
            return Ok(lease);
        }
        let kind = if self.device.caches_user_memory() && self.capacity > 0 {
            Kind::Cached
        } else {
            Kind::Temp
        };
        let mr = self.register(addr, len)?;
        let id = st.next_id;
        st.next_id += 1;
        let lease = Lease {
            id,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        st.entries.push(Entry {
            id,
            addr,
            len,
            kind,
            last_use: tick,
            refs: 1,
            mr,
        });
        let gone = self.evict(&mut st);
        drop(st);
        self.dropped(gone);
        Ok(lease)
    }

    /// Keys of a registration covering `[addr, addr + len)`, without registering.
    pub fn lookup(&self, addr: usize, len: usize) -> Option<(u32, u32)> {
        let end = addr.saturating_add(len);
        lock(&self.state)
            .entries
            .iter()
            .find(|e| e.addr <= addr && end <= e.addr.saturating_add(e.len))
            .map(|e| (e.mr.lkey(), e.mr.rkey()))
    }

    /// Give a lease back; a per-call registration is deregistered now.
    pub fn release(&self, lease: Lease) {
        if lease.id == 0 {
            return;
        }
        let mut st = lock(&self.state);
        let mut gone = Vec::new();
        if let Some(i) = st.entries.iter().position(|e| e.id == lease.id) {
            let e = &mut st.entries[i];
            e.refs = e.refs.saturating_sub(1);
            if e.kind == Kind::Temp && e.refs == 0 {
                gone.push(st.entries.swap_remove(i).mr);
            }
        }
        gone.extend(self.evict(&mut st));
        drop(st);
        self.dropped(gone);
    }

    /// Remove least recently used idle cache entries beyond the bounds; returns them (their
    /// drop deregisters, done outside the lock).
    fn evict(&self, st: &mut CacheState<D::Mr>) -> Vec<D::Mr> {
        let mut gone = Vec::new();
        loop {
            let (mut n, mut bytes) = (0usize, 0usize);
            for e in st.entries.iter().filter(|e| e.kind == Kind::Cached) {
                n += 1;
                bytes = bytes.saturating_add(e.len);
            }
            if n <= self.capacity && bytes <= CACHE_MAX_BYTES {
                break;
            }
            let victim = st
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.kind == Kind::Cached && e.refs == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(i, _)| i);
            match victim {
                Some(i) => {
                    gone.push(st.entries.swap_remove(i).mr);
                    self.pd.count(|s| s.evictions += 1);
                }
                None => break,
            }
        }
        gone
    }

    fn dropped(&self, gone: Vec<D::Mr>) {
        let n = gone.len() as u64;
        drop(gone);
        if n > 0 {
            self.pd.count(|s| s.deregistrations += n);
        }
    }
}

impl<D: Device> OwnedListener for RegCache<D> {
    fn owned_added(&self, addr: usize, len: usize) {
        // A buffer that cannot be registered is simply looked up (and registered per call)
        // like user memory.
        if let Ok(mr) = self.register(addr, len) {
            let mut st = lock(&self.state);
            let id = st.next_id;
            st.next_id += 1;
            st.entries.push(Entry {
                id,
                addr,
                len,
                kind: Kind::Owned,
                last_use: 0,
                refs: 0,
                mr,
            });
        }
    }

    fn owned_removed(&self, addr: usize, len: usize) {
        let mut st = lock(&self.state);
        let mut gone = Vec::new();
        while let Some(i) = st
            .entries
            .iter()
            .position(|e| e.kind == Kind::Owned && e.addr == addr && e.len == len)
        {
            gone.push(st.entries.swap_remove(i).mr);
        }
        // Cached user registrations inside the freed range are stale now too.
        let end = addr.saturating_add(len);
        while let Some(i) = st.entries.iter().position(|e| {
            e.kind == Kind::Cached
                && e.refs == 0
                && e.addr < end
                && addr < e.addr.saturating_add(e.len)
        }) {
            gone.push(st.entries.swap_remove(i).mr);
        }
        drop(st);
        self.dropped(gone);
    }
}

/// A buffer of library-owned, pre-registered memory (pCoR's "buffer request").
///
/// Fill it and pack it (or a prefix of it) like any slice: the medium and large transmission
/// modules find it registered already, so it travels without registration (and, above the
/// small threshold, without copy). Dropping it is pCoR's "release": the memory returns to the
/// driver's pool, still registered, for the next request. A `RegisteredBuffer` can also be the
/// destination of an unpack, which then skips registration on the receiving side.
///
/// It is registered with every channel of the driver (channels opened later register it when
/// they open), and deregistered from all of them before its memory is freed.
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
            let mut pool = lock(&pd.pool);
            pool.iter()
                .position(|b| b.len() == cap)
                .map(|i| pool.swap_remove(i))
        };
        let mem = reused.unwrap_or_else(|| {
            let b = vec![0u8; cap].into_boxed_slice();
            pd.add_owned(&b);
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
            let mut pool = lock(&self.pd.pool);
            if pool.len() < POOL_KEEP {
                pool.push(m);
                return;
            }
            drop(pool);
            // Deregistered everywhere before the memory goes back to the allocator.
            self.pd.remove_owned(&m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A device that counts live registrations.
    struct Counting {
        live: Arc<AtomicU32>,
        cache: bool,
    }
    struct Mr(Arc<AtomicU32>, u32);
    impl MemoryRegion for Mr {
        fn lkey(&self) -> u32 {
            self.1
        }
        fn rkey(&self) -> u32 {
            self.1
        }
    }
    impl Drop for Mr {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    impl Device for Counting {
        type Mr = Mr;
        fn caches_user_memory(&self) -> bool {
            self.cache
        }
        fn reg_mr(&self, _addr: usize, _len: usize) -> Result<Mr> {
            let k = self.live.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(Mr(self.live.clone(), k))
        }
    }

    fn cache(n: usize, caches: bool) -> (Arc<Pd>, Arc<RegCache<Counting>>, Arc<AtomicU32>) {
        let live = Arc::new(AtomicU32::new(0));
        let pd = Pd::new(n);
        let dev = Arc::new(Counting {
            live: live.clone(),
            cache: caches,
        });
        let c = RegCache::new(dev, &pd, n);
        (pd, c, live)
    }

    #[test]
    fn cache_hits_and_lru_eviction() {
        let (pd, c, live) = cache(2, true);
        let bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 4096]).collect();
        let a = |i: usize| bufs[i].as_ptr() as usize;
        let l = c.acquire(a(0), 4096).unwrap();
        c.release(l);
        let l = c.acquire(a(0), 100).unwrap();
        c.release(l);
        assert_eq!(pd.stats().registrations, 1);
        assert_eq!(pd.stats().cache_hits, 1);
        for i in [1, 2] {
            let l = c.acquire(a(i), 4096).unwrap();
            c.release(l);
        }
        assert_eq!(pd.stats().evictions, 1);
        assert!(c.lookup(a(0), 4096).is_none());
        assert!(c.lookup(a(2), 4096).is_some());
        assert_eq!(live.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn per_call_registration_without_cache() {
        let (pd, c, live) = cache(0, true);
        let b = vec![0u8; 512];
        for _ in 0..3 {
            let l = c.acquire(b.as_ptr() as usize, b.len()).unwrap();
            c.release(l);
        }
        let s = pd.stats();
        assert_eq!(
            (s.registrations, s.deregistrations, s.cache_hits),
            (3, 3, 0)
        );
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_device_that_forbids_caching_registers_user_memory_per_call() {
        // The verbs rule: whatever the configured size, user memory is never kept.
        let (pd, c, live) = cache(64, false);
        let b = vec![0u8; 512];
        for _ in 0..3 {
            let l = c.acquire(b.as_ptr() as usize, b.len()).unwrap();
            assert_eq!(live.load(Ordering::SeqCst), 1);
            c.release(l);
            assert_eq!(
                live.load(Ordering::SeqCst),
                0,
                "deregistered after the call"
            );
        }
        assert_eq!(pd.stats().cache_hits, 0);
        // Library-owned memory is still kept (and hit) on such a device.
        let rb = RegisteredBuffer::request(&pd, 100);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        for _ in 0..2 {
            let l = c.acquire(rb.as_ptr() as usize, 100).unwrap();
            c.release(l);
        }
        assert_eq!(pd.stats().owned_hits, 2);
        assert_eq!(live.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn registered_buffers_are_owned_hits_pooled_and_deregistered_before_free() {
        let (pd, c, live) = cache(4, true);
        let mut b = RegisteredBuffer::request(&pd, 1000);
        b[..3].copy_from_slice(b"abc");
        let l = c.acquire(b.as_ptr() as usize, 1000).unwrap();
        c.release(l);
        assert_eq!(pd.stats().owned_hits, 1);
        let regs = pd.stats().registrations;
        drop(b);
        let b2 = RegisteredBuffer::request(&pd, 900);
        assert_eq!(pd.stats().registrations, regs, "pooled buffer reused");
        assert_eq!(b2.len(), 900);
        // A channel opened later registers the existing buffers when it opens.
        let dev = Arc::new(Counting {
            live: live.clone(),
            cache: true,
        });
        let c2 = RegCache::new(dev, &pd, 4);
        assert_eq!(live.load(Ordering::SeqCst), 2);
        // Beyond the pool, a released buffer is deregistered from every cache before it is
        // freed.
        let many: Vec<_> = (0..POOL_KEEP + 1)
            .map(|_| RegisteredBuffer::request(&pd, 64))
            .collect();
        let before = live.load(Ordering::SeqCst);
        drop(many);
        assert_eq!(live.load(Ordering::SeqCst), before - 2);
        drop((c, c2, b2));
    }
}
