//! The foreign calls of this driver alone: Cross Memory Attach (`process_vm_readv`) and
//! `prctl(PR_SET_PTRACER)`. The shared-memory machinery it has in common with mad-sisci
//! (mappings, futexes, pidfds, `kill(pid, 0)`) is in [`mad_core::hostmem::sys`].
//!
//! Each function hands back plain values; the rest of the crate is safe Rust apart from
//! [`crate::ring`], which does the pointer arithmetic inside the mapped data areas.

#![allow(unsafe_code)]

use std::io::{self, IoSliceMut};

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
///
/// # Errors
///
/// The `process_vm_readv` error (`EPERM` when the kernel refuses cross-process reads, `ESRCH` when
/// the peer is gone, `EFAULT` for a bad remote range); `UnexpectedEof` when the peer's memory ends
/// short.
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
