//! A counting global allocator for tests that prove a path allocates nothing: install it in the
//! test binary (`#[global_allocator] static A: Counting = Counting;`) and read [`allocs`] before
//! and after the path, on the thread that runs it.
#![allow(unsafe_code)] // a `GlobalAlloc`: forwarding calls to the system allocator

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Forwards to the system allocator and counts the calling thread's allocations and
/// reallocations.
#[derive(Debug)]
pub struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call forwards to the system allocator unchanged; the counter is a const-init
// thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

/// The allocations (and reallocations) of the calling thread so far, under [`Counting`].
pub fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}
