//! Every foreign call of the bench tool: the shared-memory mapping of the raw ring and mailbox
//! baselines and CPU pinning. Hands back safe types that clean up on drop.

#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use mad_core::{Error, Result};

/// Bytes reserved before each ring's data for its two indices (each on its own 128-byte block).
pub const RING_HEADER: usize = 256;

/// A file in `/dev/shm` mapped shared, read-write. The creator removes the file on drop.
pub struct Shared {
    map: memmap2::MmapMut,
    base: *mut u8,
    len: usize,
    unlink: Option<PathBuf>,
}

// SAFETY: `base` points into `map`, which lives as long as `Shared` and is never remapped.
// All accesses through `base` go through `Ring`, whose indices are atomics and whose data
// bytes are only touched by the side that owns them under the single-producer/single-consumer
// protocol (the producer writes bytes in [tail+cap.., head) ... only before publishing `head`,
// the consumer reads them only after observing it), so sharing the handle between threads
// adds no data race beyond the one the cross-process protocol already excludes.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`: every access through `&Shared` is an atomic or a protocol-guarded copy.
unsafe impl Sync for Shared {}

impl Shared {
    /// Create (exclusively) and map `path` with `len` zeroed bytes; the file is unlinked on drop.
    pub fn create(path: &Path, len: usize) -> Result<Shared> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        f.set_len(len as u64)
            .map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
        let mut s = Self::map(&f, path, len)?;
        s.unlink = Some(path.to_path_buf());
        Ok(s)
    }

    /// Map an existing file created by a peer with [`Shared::create`].
    pub fn open(path: &Path, len: usize) -> Result<Shared> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let have = f
            .metadata()
            .map_err(|e| Error::io(format!("stat {}", path.display()), e))?
            .len();
        if have < len as u64 {
            return Err(Error::BadConfig(format!(
                "{} has {have} bytes, expected {len}",
                path.display()
            )));
        }
        Self::map(&f, path, len)
    }

    fn map(f: &File, path: &Path, len: usize) -> Result<Shared> {
        // SAFETY: the file is a private /dev/shm file of this benchmark run; it is only
        // modified through this mapping and the peers' mappings, under the ring protocol, and
        // it is never truncated while mapped.
        let mut map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(f) }
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        let base = map.as_mut_ptr();
        Ok(Shared {
            map,
            base,
            len,
            unlink: None,
        })
    }

    /// Remove the file now (peers keep their mappings); later drops do nothing.
    pub fn unlink(&mut self) {
        if let Some(p) = self.unlink.take() {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The three header words (at offsets 0, 8 and 128) and the data area of the `what` at
    /// `offset` (a multiple of 256) with `cap` data bytes.
    fn slot(&self, what: &str, offset: usize, cap: usize) -> Result<([&AtomicU64; 3], *mut u8)> {
        if offset % RING_HEADER != 0
            || offset
                .checked_add(RING_HEADER + cap)
                .is_none_or(|end| end > self.len)
        {
            return Err(Error::BadConfig(format!(
                "{what} at {offset} with {cap} bytes does not fit a {}-byte mapping",
                self.len
            )));
        }
        let _ = &self.map;
        // SAFETY: `offset + RING_HEADER + cap <= len` was checked, so every pointer below
        // stays inside the mapping; the mapping is page-aligned and `offset` a multiple of
        // 256, so the three u64 words are 8-byte aligned. AtomicU64 has the layout of u64 and
        // the header words are only ever accessed atomically.
        unsafe {
            let h = self.base.add(offset);
            Ok((
                [
                    &*(h as *const AtomicU64),
                    &*(h.add(8) as *const AtomicU64),
                    &*(h.add(128) as *const AtomicU64),
                ],
                h.add(RING_HEADER),
            ))
        }
    }

    /// The ring at `offset` (a multiple of 256) with `cap` data bytes (a power of two).
    pub fn ring(&self, offset: usize, cap: usize) -> Result<Ring<'_>> {
        if !cap.is_power_of_two() {
            return Err(Error::BadConfig(format!(
                "a ring of {cap} bytes: not a power of two"
            )));
        }
        let ([head, _, tail], data) = self.slot("ring", offset, cap)?;
        Ok(Ring {
            head,
            tail,
            data,
            cap,
            _m: PhantomData,
        })
    }

    /// The mailbox at `offset` (a multiple of 256) with room for messages of `cap` bytes.
    pub fn mailbox(&self, offset: usize, cap: usize) -> Result<Mailbox<'_>> {
        let ([posted, len, taken], data) = self.slot("mailbox", offset, cap)?;
        Ok(Mailbox {
            posted,
            len,
            taken,
            data,
            cap,
            _m: PhantomData,
        })
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// A single-producer single-consumer byte ring in a [`Shared`] mapping: monotonic 64-bit
/// `head` (bytes written) and `tail` (bytes read); the producer copies then Release-publishes
/// `head`, the consumer Acquire-reads it, copies out, Release-publishes `tail`.
pub struct Ring<'a> {
    head: &'a AtomicU64,
    tail: &'a AtomicU64,
    data: *mut u8,
    cap: usize,
    _m: PhantomData<&'a Shared>,
}

impl Ring<'_> {
    /// Producer side: copy as much of `src` as fits; returns the number of bytes written.
    pub fn push(&self, src: &[u8]) -> usize {
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        let used = head.wrapping_sub(tail) as usize;
        let n = src.len().min(self.cap.saturating_sub(used));
        if n == 0 {
            return 0;
        }
        let at = (head as usize) & (self.cap - 1);
        let first = n.min(self.cap - at);
        // SAFETY: `at + first <= cap` and `n - first <= cap`, so both copies stay inside the
        // ring's data area; the bytes [head, head + n) are free (the consumer has released
        // them: `used + n <= cap`) and the consumer reads them only after the Release store.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, n - first);
        }
        self.head.store(head + n as u64, Ordering::Release);
        n
    }

    /// Consumer side: nothing to read.
    pub fn is_empty(&self) -> bool {
        self.head.load(Ordering::Acquire) == self.tail.load(Ordering::Relaxed)
    }

    /// Consumer side: copy up to `dst.len()` available bytes; returns the number read.
    pub fn pop(&self, dst: &mut [u8]) -> usize {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        let avail = head.wrapping_sub(tail) as usize;
        let n = dst.len().min(avail).min(self.cap);
        if n == 0 {
            return 0;
        }
        let at = (tail as usize) & (self.cap - 1);
        let first = n.min(self.cap - at);
        // SAFETY: bounds as in `push`; the bytes [tail, tail + n) were published by the
        // producer's Release store of `head`, observed by the Acquire load above, and the
        // producer does not overwrite them before our Release store of `tail`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, dst.as_mut_ptr().add(first), n - first);
        }
        self.tail.store(tail + n as u64, Ordering::Release);
        n
    }
}

/// A one-message mailbox in a [`Shared`] mapping: no ring, the whole message in one copy. The
/// sender waits until `taken` equals `posted` (the last message was read), copies the message in,
/// stores its length and Release-increments `posted`; the receiver Acquire-polls `posted`, copies
/// the message out and Release-stores `taken`.
pub struct Mailbox<'a> {
    posted: &'a AtomicU64,
    len: &'a AtomicU64,
    taken: &'a AtomicU64,
    data: *mut u8,
    cap: usize,
    _m: PhantomData<&'a Shared>,
}

impl Mailbox<'_> {
    /// Sender side: post the message made of `parts` (at most the box's bytes in all) if the
    /// last message was taken; false if it was not (try again).
    pub fn post(&self, parts: &[&[u8]]) -> bool {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        assert!(total <= self.cap, "mailbox: message larger than the box");
        let posted = self.posted.load(Ordering::Relaxed);
        if self.taken.load(Ordering::Acquire) != posted {
            return false;
        }
        let mut at = 0;
        for p in parts {
            // SAFETY: `at + p.len() <= total <= cap`, so the copy stays in the data area; the
            // receiver took the last message (observed above) and reads the area only after
            // the Release store below.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), self.data.add(at), p.len()) };
            at += p.len();
        }
        self.len.store(total as u64, Ordering::Relaxed);
        self.posted.store(posted + 1, Ordering::Release);
        true
    }

    /// Receiver side: take the posted message, if there is one, into `parts` in order, and
    /// return its length (`None`: nothing posted). Bytes beyond the parts are dropped.
    pub fn take(&self, parts: &mut [&mut [u8]]) -> Option<usize> {
        let taken = self.taken.load(Ordering::Relaxed);
        if self.posted.load(Ordering::Acquire) == taken {
            return None;
        }
        let n = (self.len.load(Ordering::Relaxed) as usize).min(self.cap);
        let mut at = 0;
        for p in parts.iter_mut() {
            let k = p.len().min(n - at);
            // SAFETY: `at + k <= n <= cap`: the copy stays in the data area, which the sender
            // published with the Release store observed above and does not write again before
            // our `taken` store.
            unsafe { std::ptr::copy_nonoverlapping(self.data.add(at), p.as_mut_ptr(), k) };
            at += k;
        }
        self.taken.store(taken + 1, Ordering::Release);
        Some(n)
    }
}

/// Number of CPUs this process may use (before any pinning).
pub fn cpu_count() -> usize {
    madeleine::affinity::cpu_count()
}

/// Pin the calling thread to the `cpu`-th allowed CPU, or back to all with `None`.
pub fn pin(cpu: Option<usize>) -> Result<()> {
    madeleine::affinity::pin_current_thread(cpu)
}
