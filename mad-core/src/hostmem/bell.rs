//! Sleeping and waking across processes on a futex word in shared memory.
//!
//! A [`Bell`] is two 32-bit words the drivers place in their segments: the futex word and the
//! count of threads asleep on it. A sleeper registers, fences, reads the word, re-checks its
//! condition and sleeps only if it still does not hold; a writer, after publishing, fences and
//! rings only if somebody sleeps. So a busy receiver costs the writer one load, never a
//! syscall, and an idle one burns no CPU; a wake-up cannot be lost (the two SeqCst fences
//! order "publish, read sleepers" against "register, check").
//!
//! The top bit of the sleeper word ([`ARMED`]) is the same handshake for event loops: an
//! owner that [`arm`](Bell::arm)s it sleeps on its readiness descriptor instead of the futex,
//! and the writer that finds the bit set clears it and sends that descriptor a byte
//! ([`notify_with`](Bell::notify_with); see [`ready`](super::ready)). The writer's load is
//! the one it already made.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

use super::ready::{Signal, ARMED};
use super::sys;

/// A futex word and its sleeper count (both in shared memory).
#[derive(Clone, Copy, Debug)]
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
        self.notify_with(None);
    }

    /// [`notify`](Self::notify), and if the owner armed its readiness descriptor, clear the
    /// mark and send `sig` (the owner's socket). The fast path is the same fence and load.
    #[inline]
    pub fn notify_with(self, sig: Option<&Signal>) {
        fence(Ordering::SeqCst);
        let s = self.sleepers.load(Ordering::Relaxed);
        if s != 0 {
            self.notify_slow(s, sig);
        }
    }

    #[cold]
    #[inline(never)]
    fn notify_slow(self, s: u32, sig: Option<&Signal>) {
        if s & !ARMED != 0 {
            self.ring();
        }
        if s & ARMED != 0 {
            self.signal_if_armed(sig);
        }
    }

    /// Ring unconditionally: bump the word, wake every sleeper.
    pub fn ring(self) {
        self.word.fetch_add(1, Ordering::SeqCst);
        sys::futex_wake(self.word);
    }

    /// If the owner armed its readiness descriptor, clear the mark and send `sig` (once per
    /// arm, whoever calls this). Call after a fence that follows the event (as in
    /// [`notify_with`](Self::notify_with)).
    pub fn signal_if_armed(self, sig: Option<&Signal>) {
        let Some(sig) = sig else { return };
        if self.sleepers.load(Ordering::Relaxed) & ARMED != 0
            && self.sleepers.fetch_and(!ARMED, Ordering::SeqCst) & ARMED != 0
        {
            sig.send();
        }
    }

    /// Mark the owner's readiness descriptor armed: the next [`notify_with`](Self::notify_with)
    /// signals it. Fences after, so the caller's following look at its condition pairs with
    /// the notifier's fence (one of the two sees the other).
    #[inline]
    pub fn arm(self) {
        self.sleepers.fetch_or(ARMED, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Whether the owner's readiness descriptor is armed (a hint: a relaxed load, no fence).
    #[inline]
    pub fn armed(self) -> bool {
        self.sleepers.load(Ordering::Relaxed) & ARMED != 0
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
