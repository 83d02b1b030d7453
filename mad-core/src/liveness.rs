//! What every driver shares about the life of a connection: "the connection is the unit of
//! failure".
//!
//! * [`ProbeGate`]: the one rate limiter of the drivers' peer-liveness probes on the message
//!   path. [`TxLink::begin_message`](crate::driver::TxLink::begin_message) and
//!   [`RxLink::poll_message`](crate::driver::RxLink::poll_message) ask it whether a probe is due
//!   (a read of the coarse monotonic clock, a few nanoseconds) and ask the kernel about the
//!   peer (a zero-timeout `poll(2)` of a socket, a pidfd) at most once per clock tick, so a
//!   survivor that sends to a peer that died while it was idle gets an error on its first send
//!   instead of the message vanishing.
//! * [`Teardown`]: the flag the two halves of a connection share once one of them has torn the
//!   connection down (a receive abandoned midway, a message abandoned after part of it left):
//!   from then on both halves fail with [`Error::Poisoned`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::error::Error;

/// Milliseconds of `CLOCK_MONOTONIC_COARSE` (the kernel's tick-granular clock: a vDSO read
/// without the TSC, a few nanoseconds). Falls back to 0 if the clock cannot be read, which
/// makes every gate due at most once.
#[inline]
fn coarse_ms() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC_COARSE) {
        Ok(t) => (t.tv_sec() as u64)
            .wrapping_mul(1000)
            .wrapping_add(t.tv_nsec() as u64 / 1_000_000),
        // No coarse clock (an old kernel, a sandbox, Miri): the ordinary monotonic one, so the
        // probes keep coming rather than stopping for good.
        Err(_) => {
            static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
            EPOCH
                .get_or_init(std::time::Instant::now)
                .elapsed()
                .as_millis() as u64
        }
    }
}

/// Rate limiter of a link half's liveness probes: [`due`](Self::due) is true at most once per
/// [`ProbeGate::EVERY`] (rounded to the coarse clock's tick, 1–4 ms), and always on the first
/// call after a quiet spell, so a probe costs nothing measurable on the message path.
#[derive(Debug, Default, Clone)]
pub struct ProbeGate {
    /// Coarse milliseconds before which no probe is due.
    next: u64,
}

impl ProbeGate {
    /// Least interval between two probes of one gate.
    pub const EVERY: Duration = Duration::from_millis(1);

    /// A gate whose first [`due`](Self::due) is true.
    pub const fn new() -> Self {
        ProbeGate { next: 0 }
    }

    /// Whether a probe is due now (and if so, the next one is not before [`Self::EVERY`]).
    #[inline]
    pub fn due(&mut self) -> bool {
        let now = coarse_ms();
        if now < self.next {
            return false;
        }
        self.next = now + Self::EVERY.as_millis() as u64;
        true
    }
}

/// The torn-down state of one connection, shared by its two halves (and by a driver's
/// any-source watcher if it wants to know).
///
/// A driver tears a connection down when its receiving half abandons a message
/// ([`RxLink::abort_message`](crate::driver::RxLink::abort_message)) or its sending half
/// abandons one after part of it left
/// ([`AbortOutcome::Broken`](crate::driver::AbortOutcome::Broken)): it makes the peer's
/// operations fail (its own mechanism: a reset socket, closed flags in shared memory) and
/// records the cause here, after which both local halves return [`Error::Poisoned`].
#[derive(Debug, Default)]
pub struct Teardown {
    torn: AtomicBool,
    cause: OnceLock<String>,
}

impl Teardown {
    /// An intact connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record the teardown; true for the first caller (who then does the driver's part).
    /// The first teardown is logged (`debug`, target `mad_core::liveness`): the core logs the
    /// failure that caused it with the channel and the peer.
    #[cold]
    pub fn tear(&self, cause: &str) -> bool {
        let first = self.cause.set(cause.to_string()).is_ok();
        self.torn.store(true, Ordering::Release);
        if first {
            tracing::debug!(%cause, "connection torn down");
        }
        first
    }

    /// Whether the connection was torn down (one atomic load).
    #[inline]
    pub fn is_torn(&self) -> bool {
        self.torn.load(Ordering::Acquire)
    }

    /// `Err(Poisoned)` once the connection was torn down.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`] once the connection was torn down, with the
    /// first cause.
    #[inline]
    pub fn check(&self, rank: usize) -> crate::Result<()> {
        if self.is_torn() {
            return Err(self.error(rank));
        }
        Ok(())
    }

    /// The error a half returns on a torn connection.
    #[cold]
    pub fn error(&self, rank: usize) -> Error {
        Error::Poisoned {
            rank,
            cause: self.cause.get().map_or_else(
                || "the connection was torn down".into(),
                |c| c.as_str().into(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri runs a burst of 1000 calls over many clock ticks; the gate's arithmetic is the same"
    )]
    fn gate_is_due_first_then_rate_limited() {
        let mut g = ProbeGate::new();
        assert!(g.due());
        // Within one coarse tick at most one more.
        let n = (0..1000).filter(|_| g.due()).count();
        assert!(n <= 5, "{n} probes in a burst");
        std::thread::sleep(Duration::from_millis(20));
        assert!(g.due());
    }

    #[test]
    fn teardown_poisons() {
        let t = Teardown::new();
        assert!(t.check(3).is_ok());
        assert!(t.tear("why"));
        assert!(!t.tear("again"));
        match t.check(3) {
            Err(Error::Poisoned { rank: 3, cause }) => assert_eq!(cause.to_string(), "why"),
            r => panic!("{r:?}"),
        }
    }
}
