//! Sleeping and waking across processes on a futex word in shared memory.
//!
//! A [`Bell`] is two 32-bit words the drivers place in their segments: the futex word and the
//! count of threads asleep on it. A sleeper registers, fences, reads the word, re-checks its
//! condition and sleeps only if it still does not hold; a writer, after publishing, fences and
//! rings only if somebody sleeps. So a busy receiver costs the writer one load, never a
//! syscall, and an idle one burns no CPU; a wake-up cannot be lost (the two SeqCst fences
//! order "publish, read sleepers" against "register, check").

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

use super::sys;

/// A futex word and its sleeper count (both in shared memory).
#[derive(Clone, Copy)]
pub struct Bell<'a> {
    word: &'a AtomicU32,
    sleepers: &'a AtomicU32,
}

impl<'a> Bell<'a> {
    /// The bell made of `word` (the futex) and `sleepers` (threads asleep on it).
    #[inline]
    pub fn new(word: &'a AtomicU32, sleepers: &'a AtomicU32) -> Self {
        Bell { word, sleepers }
    }

    /// The futex word.
    #[inline]
    pub fn word(self) -> &'a AtomicU32 {
        self.word
    }

    /// Ring if somebody sleeps. Call after publishing (the SeqCst fence pairs with the one in
    /// [`sleep`](Self::sleep)).
    #[inline]
    pub fn notify(self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.ring();
        }
    }

    /// Ring unconditionally: bump the word, wake every sleeper.
    pub fn ring(self) {
        self.word.fetch_add(1, Ordering::SeqCst);
        sys::futex_wake(self.word);
    }

    /// Sleep for at most `t` unless `ready()` holds once this thread is registered as a
    /// sleeper (so a writer publishing concurrently either is seen by `ready` or sees the
    /// sleeper and rings). Spurious returns are possible.
    #[inline]
    pub fn sleep(self, t: Duration, ready: impl FnOnce() -> bool) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let seen = self.word.load(Ordering::SeqCst);
        if !ready() {
            sys::futex_wait(self.word, seen, t);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}
