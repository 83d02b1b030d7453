//! Every foreign call of the driver: shared mappings, futexes, Cross Memory Attach, pidfds,
//! `prctl` and `kill(pid, 0)`.
//!
//! Each function hands back safe types (owned descriptors, mappings that unmap on drop) or plain
//! values; the rest of the crate is safe Rust apart from [`crate::ring`], which does the pointer
//! arithmetic inside the mapped data areas.

#![allow(unsafe_code)]

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// A shared, writable mapping of a whole file (unmapped on drop).
pub struct Mapping {
    raw: memmap2::MmapRaw,
}

impl Mapping {
    /// Map `file` shared and writable.
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

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: the mapping is plain memory shared with other processes; every access to it goes
// through atomics or through ranges the ring protocol gives to exactly one side.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the base pointer and the length.
unsafe impl Sync for Mapping {}

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

/// One remote slice of a Cross Memory Attach transfer: an address in the peer process and a
/// length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Most iovecs per `process_vm_readv` call (Linux `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Copy the peer's `remote` slices (in process `pid`) into `local`, in order, with
/// `process_vm_readv`, looping on partial transfers and on `IOV_MAX`.
///
/// The caller checks that both lists have the same total length. A zero-byte transfer that
/// should have moved bytes is reported as `UnexpectedEof` (remote memory unmapped midway).
pub fn cma_read(pid: u32, local: &mut [IoSliceMut<'_>], remote: &[RemoteSlice]) -> io::Result<()> {
    let mut li = 0usize; // current local slice
    let mut lo = 0usize; // offset inside it
    let mut ri = 0usize;
    let mut ro = 0u64;
    loop {
        while li < local.len() && lo == local[li].len() {
            li += 1;
            lo = 0;
        }
        while ri < remote.len() && ro == remote[ri].len {
            ri += 1;
            ro = 0;
        }
        if li == local.len() || ri == remote.len() {
            return Ok(());
        }
        let mut liov: Vec<libc::iovec> = Vec::with_capacity((local.len() - li).min(IOV_MAX));
        for (k, s) in local[li..].iter_mut().enumerate().take(IOV_MAX) {
            let skip = if k == 0 { lo } else { 0 };
            // `skip <= s.len()` by the loop invariant; the pointer stays inside the slice.
            let rest = &mut s[skip..];
            liov.push(libc::iovec {
                iov_base: rest.as_mut_ptr().cast(),
                iov_len: rest.len(),
            });
        }
        let mut riov: Vec<libc::iovec> = Vec::with_capacity((remote.len() - ri).min(IOV_MAX));
        for (k, s) in remote[ri..].iter().enumerate().take(IOV_MAX) {
            let skip = if k == 0 { ro } else { 0 };
            riov.push(libc::iovec {
                iov_base: s.addr.wrapping_add(skip) as usize as *mut libc::c_void,
                iov_len: (s.len - skip) as usize,
            });
        }
        // SAFETY: every local iovec points into a distinct `IoSliceMut` we hold exclusively
        // for the duration of the call, within its bounds; the remote iovecs are only
        // dereferenced by the kernel in the other process's address space (a bad address there
        // yields EFAULT, never a write into our memory outside `local`).
        let n = unsafe {
            libc::process_vm_readv(
                pid as libc::pid_t,
                liov.as_ptr(),
                liov.len() as libc::c_ulong,
                riov.as_ptr(),
                riov.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let n = n as usize;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv moved no bytes",
            ));
        }
        let mut left = n;
        while left > 0 && li < local.len() {
            let step = (local[li].len() - lo).min(left);
            lo += step;
            left -= step;
            if lo == local[li].len() {
                li += 1;
                lo = 0;
            }
        }
        let mut left = n as u64;
        while left > 0 && ri < remote.len() {
            let step = (remote[ri].len - ro).min(left);
            ro += step;
            left -= step;
            if ro == remote[ri].len {
                ri += 1;
                ro = 0;
            }
        }
    }
}

/// Whether this process may read its own memory with `process_vm_readv` (the syscall exists
/// and no seccomp filter forbids it).
pub fn cma_self_check() -> bool {
    let src = [0x5au8; 8];
    let mut dst = [0u8; 8];
    let mut l = [IoSliceMut::new(&mut dst)];
    let r = [RemoteSlice {
        addr: src.as_ptr() as usize as u64,
        len: src.len() as u64,
    }];
    cma_read(std::process::id(), &mut l, &r).is_ok() && dst == src
}

/// Allow any process of this user to attach (`PR_SET_PTRACER_ANY`), which Yama's
/// `ptrace_scope = 1` requires for Cross Memory Attach between siblings. Errors (no Yama:
/// `EINVAL`) are ignored: they mean there is nothing to relax.
pub fn allow_ptracer_any() {
    // SAFETY: PR_SET_PTRACER takes an integer argument and touches no memory.
    unsafe {
        libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0);
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
