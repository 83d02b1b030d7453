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

#[cfg(feature = "verbs")]
pub mod verbs;
