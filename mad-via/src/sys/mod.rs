//! Every foreign call of the crate, wrapped in safe functions and types.
//!
//! * `pin` / `unpin`: `mlock(2)` / `munlock(2)`, the soft provider's registration cost.
//! * [`verbs`] (feature `verbs`): ibverbs through `rdma-sys`: device list, context, protection
//!   domain, completion channel and queue, queue pair and memory region, each released on
//!   drop, and the verbs provider (device and NIC) built on them. Untested: no RDMA device
//!   on this project's machines.
#![allow(unsafe_code)]

/// Pin `[addr, addr + len)` in RAM. Returns false if the kernel refused (limit, bad range).
///
/// Takes an address, not a slice: the kernel validates the range and neither call reads nor
/// writes the memory, so any value is safe to pass.
pub fn pin(addr: usize, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    // SAFETY: mlock only changes the residency of the pages covering the range; it does not
    // access their contents, and the kernel checks the range (EINVAL/ENOMEM for bad ones).
    unsafe { libc::mlock(addr as *const libc::c_void, len) == 0 }
}

/// Undo [`pin`]. Errors (range no longer mapped) are ignored: the lock went with the mapping.
pub fn unpin(addr: usize, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: as for `pin`: munlock does not touch page contents and validates the range.
    unsafe {
        libc::munlock(addr as *const libc::c_void, len);
    }
}

/// Tear a connected TCP socket down for both ends: `connect(fd, AF_UNSPEC)`, which Linux
/// implements as `tcp_disconnect` (an RST goes to the peer, whose blocked and later sends and
/// receives fail at once; the socket is closed for every user of the descriptor). While
/// another thread of ours is blocked in a `send`/`recv` on it the kernel refuses (`EBUSY`):
/// then `shutdown(SHUT_RDWR)`, which wakes that thread with an error, and the reset again for
/// up to 50 ms. Returns whether the reset was done (the peer then got at least a FIN).
pub fn reset(fd: std::os::fd::RawFd) -> bool {
    let disconnect = || {
        // SAFETY: an all-zero sockaddr is a plain-data value; with family AF_UNSPEC it is a
        // complete address for this call.
        let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
        addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
        let len = std::mem::size_of::<libc::sockaddr>() as libc::socklen_t;
        // SAFETY: `addr` is valid for reads of `len` bytes during the call; the kernel
        // validates the descriptor.
        if unsafe { libc::connect(fd, &addr, len) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    match disconnect() {
        Ok(()) => return true,
        Err(e) if e.raw_os_error() != Some(libc::EBUSY) => return false,
        Err(_) => {}
    }
    // SAFETY: plain syscall on a descriptor; errors (already shut down) are ignored.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(1));
        if disconnect().is_ok() {
            return true;
        }
    }
    false
}

#[cfg(feature = "verbs")]
pub mod verbs;
