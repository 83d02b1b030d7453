//! Every unsafe foreign call and raw-memory access of [`hostmem`](super): shared mappings, the
//! [`Region`] window on them, space reservation (`posix_fallocate`, `statvfs`), futexes,
//! `kill(pid, 0)` and pidfds.
//!
//! Each item hands back safe types (mappings that unmap on drop, owned descriptors,
//! bounds-checked windows) or plain values.

#![allow(unsafe_code)]

use std::any::Any;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

/// Allocate the blocks of `file`'s first `len` bytes now (`posix_fallocate`), extending it to
/// `len`. On tmpfs (`/dev/shm`) this charges the pages to the file system at once: a file
/// that is only `set_len`-sized is sparse, and a page the file system cannot supply later is a
/// `SIGBUS` at the first store into the mapping. `ENOSPC` when the space is not there.
///
/// # Errors
///
/// The `posix_fallocate` error (`ENOSPC` when the file system has no room).
pub fn reserve(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    loop {
        // SAFETY: `file` owns a valid descriptor for the duration of the call; the call
        // takes plain integers and returns an error number (it does not set errno).
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        match r {
            0 => return Ok(()),
            libc::EINTR => continue,
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

/// Space of the file system holding `path`: (bytes available to this process, total bytes),
/// from `statvfs`; `None` if it cannot be asked.
pub fn fs_space(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain old data; all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable `statvfs`, both living
    // across the call.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return None;
    }
    let unit = st.f_frsize as u64;
    Some((
        (st.f_bavail as u64).saturating_mul(unit),
        (st.f_blocks as u64).saturating_mul(unit),
    ))
}

/// A shared, writable mapping of a whole file (unmapped on drop).
#[derive(Debug)]
pub struct Mapping {
    raw: memmap2::MmapRaw,
}

impl Mapping {
    /// Map `file` shared and writable.
    ///
    /// # Errors
    ///
    /// The `mmap` error.
    pub fn map(file: &File) -> io::Result<Self> {
        Ok(Mapping {
            raw: memmap2::MmapRaw::map_raw(file)?,
        })
    }

    /// Base address of the mapping (page-aligned).
    pub fn ptr(&self) -> *mut u8 {
        self.raw.as_mut_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: the mapping is plain memory shared with other processes; every access to it goes
// through atomics or through ranges the drivers' protocols give to exactly one side.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the base pointer and the length.
unsafe impl Sync for Mapping {}

/// A window of `len` bytes on shared memory (a mapping, a part of one, or a heap block in
/// tests), kept alive by `keep`: bounds-checked atomic words, block copies and lends.
///
/// On SCI hardware the same window would be what `SCIMapRemoteSegment` /
/// `SCIMapLocalSegment` return: the stores are the PIO writes of the protocol.
#[derive(Clone)]
pub struct Region {
    ptr: *mut u8,
    len: usize,
    _keep: Arc<dyn Any + Send + Sync>,
}

// SAFETY: the region is memory shared by design; every access goes through atomics or through
// ranges the drivers' protocols hand to exactly one side at a time (a ring run, a slot, a
// chunk).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

/// The address and the length; never the bytes.
impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Region {
    /// The whole of a shared mapping.
    pub fn from_mapping(m: Arc<Mapping>) -> Self {
        Region {
            ptr: m.ptr(),
            len: m.len(),
            _keep: m,
        }
    }

    /// A zeroed heap region of `len` bytes (rounded up to pages), 4096-aligned (tests, miri).
    pub fn heap(len: usize) -> Self {
        #[repr(C, align(4096))]
        struct Page([u8; 4096]);
        let pages: Box<[Page]> = (0..len.div_ceil(4096)).map(|_| Page([0; 4096])).collect();
        let mut pages = std::mem::ManuallyDrop::new(pages);
        let ptr = pages.as_mut_ptr().cast::<u8>();
        struct Keep(*mut Page, usize);
        // SAFETY: `Keep` owns the allocation; it is only freed on drop.
        unsafe impl Send for Keep {}
        // SAFETY: `Keep` exposes nothing.
        unsafe impl Sync for Keep {}
        impl Drop for Keep {
            fn drop(&mut self) {
                // SAFETY: rebuilds the exact boxed slice leaked above (same pointer, length);
                // dropped once, when the last `Region` clone goes.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.0, self.1)) });
            }
        }
        let n = pages.len();
        Region {
            ptr,
            len: n * 4096,
            _keep: Arc::new(Keep(ptr.cast(), n)),
        }
    }

    /// A window on memory mapped by foreign code (for instance what Dolphin's
    /// `SCIMapLocalSegment` / `SCIMapRemoteSegment` return), kept mapped by `keep`: the driver
    /// type that unmaps it when dropped.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as `keep` lives, and
    /// be at least 8-aligned (atomic words are checked against the address, but a misaligned
    /// base would make every word unreachable); every other accessor of that memory (other
    /// processes, adapters) must follow the protocol that gives each range to one side at a
    /// time, as for a shared file mapping.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, keep: Arc<dyn Any + Send + Sync>) -> Self {
        Region {
            ptr,
            len,
            _keep: keep,
        }
    }

    /// The sub-window `[off, off + len)`, if inside this one.
    pub fn sub(&self, off: usize, len: usize) -> Option<Region> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        Some(Region {
            // SAFETY: `off <= self.len`, so the pointer stays inside (or one past) the window.
            ptr: unsafe { self.ptr.add(off) },
            len,
            _keep: self._keep.clone(),
        })
    }

    /// Base address (for code that does its own pointer arithmetic inside the window, such
    /// as mad-shm's ring).
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `u32` word at `off`, if in bounds and aligned.
    #[inline]
    pub fn u32_at(&self, off: usize) -> Option<&AtomicU32> {
        if (self.ptr as usize).wrapping_add(off) % 4 != 0 || off.checked_add(4)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 4-aligned; the memory lives as long as `self` (`_keep`); every
        // access to this word, in any process, is atomic.
        Some(unsafe { &*self.ptr.add(off).cast::<AtomicU32>() })
    }

    /// The `u64` word at `off`, if in bounds and aligned.
    #[inline]
    pub fn u64_at(&self, off: usize) -> Option<&AtomicU64> {
        if (self.ptr as usize).wrapping_add(off) % 8 != 0 || off.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 8-aligned; lives as long as `self`; accessed atomically only.
        Some(unsafe { &*self.ptr.add(off).cast::<AtomicU64>() })
    }

    /// Store `src` at `off` (a header field before the segment is shared, or a PIO write into
    /// a range the protocol gives to this side). `None` if out of bounds.
    #[inline]
    pub fn write(&self, off: usize, src: &[u8]) -> Option<()> {
        if off.checked_add(src.len())? > self.len {
            return None;
        }
        // SAFETY: the destination range is in bounds; the caller's protocol gives it to this
        // side only (a header not yet published, a free slot, ring run or chunk the reader has
        // acknowledged); `src` is local memory that cannot overlap a range owned by the writer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        Some(())
    }

    /// Load `dst.len()` bytes at `off` into `dst`. `None` if out of bounds.
    #[inline]
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Option<()> {
        if off.checked_add(dst.len())? > self.len {
            return None;
        }
        // SAFETY: the source range is in bounds and holds bytes the writer published and will
        // not touch before this side acknowledges them (or a header written before the
        // segment was shared); `dst` is a distinct local buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
        Some(())
    }

    /// Lend `[off, off + len)` for writing to `f`; returns what `f` returns (capped at `len`).
    #[inline]
    pub fn lend_mut(
        &self,
        off: usize,
        len: usize,
        f: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Option<usize> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: in bounds; the range is free space owned by the writer until it publishes a
        // flag or offset covering it, so nothing else in this process aliases it while `f`
        // runs (the peer does not read it before the Release store that follows).
        let s = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) };
        Some(f(s).min(len))
    }

    /// Lend `[off, off + len)` for reading to `f`; returns what `f` returns (capped at `len`).
    #[inline]
    pub fn lend(&self, off: usize, len: usize, f: &mut dyn FnMut(&[u8]) -> usize) -> Option<usize> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: in bounds; the range holds published bytes that the writer leaves alone until
        // this side acknowledges them (after `f` returns).
        let s = unsafe { std::slice::from_raw_parts(self.ptr.add(off).cast_const(), len) };
        Some(f(s).min(len))
    }
}

/// Block while `word` holds `expected`, for at most `timeout` (a shared futex: the word may
/// live in a mapping shared with other processes). Spurious returns are possible.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit word for the duration of the call (borrowed);
    // FUTEX_WAIT only reads it; `ts` outlives the call. The result (EAGAIN, ETIMEDOUT, EINTR,
    // or 0) needs no handling: callers re-check their condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wake every thread (of any process) blocked in [`futex_wait`] on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 32-bit word; FUTEX_WAKE does not access memory
    // through the other arguments.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether process `pid` exists (`kill(pid, 0)`: `ESRCH` means gone; `EPERM` means alive).
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: signal 0 performs only the existence and permission checks.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// A process descriptor (`pidfd_open`), readable once the process has exited.
#[derive(Debug)]
pub struct PidFd {
    fd: Option<OwnedFd>,
    pid: u32,
}

impl PidFd {
    /// Open a descriptor on `pid`; falls back to `kill(pid, 0)` checks where pidfds are not
    /// supported.
    ///
    /// # Errors
    ///
    /// The `pidfd_open` error when the process is gone (`ESRCH`), or the fallback `kill(pid, 0)`
    /// error.
    pub fn open(pid: u32) -> io::Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOSYS) {
                return Ok(PidFd { fd: None, pid });
            }
            return Err(e);
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(PidFd { fd: Some(fd), pid })
    }

    /// The watched process's id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Which of `fds` have exited, in one `poll(2)` for all the pidfds (processes watched by
    /// `kill(pid, 0)` are asked one by one): calls `dead(i)` for each index `i` whose process
    /// has exited. An any-source watcher of n peers pays one system call, not n.
    pub fn exited_among(fds: &[&PidFd], dead: &mut dyn FnMut(usize)) {
        let mut polled: smallvec::SmallVec<[libc::pollfd; 32]> = smallvec::SmallVec::new();
        let mut index: smallvec::SmallVec<[usize; 32]> = smallvec::SmallVec::new();
        for (i, p) in fds.iter().enumerate() {
            match &p.fd {
                Some(fd) => {
                    polled.push(libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    index.push(i);
                }
                None if p.exited() => dead(i),
                None => {}
            }
        }
        if polled.is_empty() {
            return;
        }
        // SAFETY: `polled` is a valid array of `polled.len()` pollfds, borrowed mutably for the
        // call; timeout 0.
        let r = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 0) };
        if r <= 0 {
            return;
        }
        for (p, &i) in polled.iter().zip(&index) {
            if p.revents & (libc::POLLIN | libc::POLLHUP) != 0 {
                dead(i);
            }
        }
    }

    /// The descriptor (readable once the process has exited); `None` where pidfds are not
    /// supported.
    pub fn as_fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Whether the process has exited (non-blocking).
    pub fn exited(&self) -> bool {
        match &self.fd {
            None => !pid_alive(self.pid),
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: `p` is one valid pollfd for the duration of the call; timeout 0.
                let r = unsafe { libc::poll(&mut p, 1, 0) };
                r > 0 && p.revents & (libc::POLLIN | libc::POLLHUP) != 0
            }
        }
    }
}
