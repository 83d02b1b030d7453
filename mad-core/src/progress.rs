//! Progress policy: how a thread waits for the network (spin, yield, then block).
//!
//! On our machines waking a process blocked in the kernel costs about 25 µs while a polled
//! one-way TCP message costs about 3 µs, and a shared-memory flag about 0.1 µs. A runtime that
//! only blocks is many times slower than one that polls; one that only polls burns a core and
//! livelocks when there are more processes than cores. The default policy therefore spins for a
//! bounded time (about twice the wake-up cost: the classic competitive bound), then yields the
//! processor a few times, then blocks in the driver's wait. When the session has more local
//! processes than cores, the spin phase shrinks and the yield phase carries the waiting, so
//! eight processes on two cores still make progress.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Threads of this process currently in a long wait (past the first attempt of [`ProgressPolicy::drive`]).
static WAITING: AtomicUsize = AtomicUsize::new(0);
/// How many waiting threads this process may run before the host is crowded: its share of the
/// cores (cores / session ranks on this host, at least 1). Lowered by each channel opened.
static SHARE: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Record that `local` session ranks share `cores` cores on this host (every channel open calls
/// it, with the union of the local ranks' CPU sets). A wait counts as *crowded* when more
/// threads of this process wait than its share of the cores: the policy then yields early
/// instead of spinning a whole time slice away.
pub fn note_host_share(local: usize, cores: usize) {
    let share = (cores / local.max(1)).max(1);
    SHARE.fetch_min(share, Ordering::Relaxed);
}

/// Counts a thread as waiting while alive.
struct Waiting;

impl Waiting {
    fn enter() -> (Waiting, usize) {
        let n = WAITING.fetch_add(1, Ordering::Relaxed) + 1;
        (Waiting, n)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How a channel waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProgressMode {
    /// Busy-poll: never block in the kernel (lowest latency, burns a core).
    Poll,
    /// Block in the kernel at once (lowest CPU, about 25 µs per wake-up here).
    Block,
    /// Spin for `spin`, then yield, then block (the default).
    Adaptive {
        /// How long to spin before yielding and blocking.
        spin: Duration,
    },
}

/// Default spin budget of the adaptive mode.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Spin budget used instead when the host is oversubscribed.
pub const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(5);
/// Longest single block before the loop re-checks deadlines.
const BLOCK_SLICE: Duration = Duration::from_millis(100);
/// Busy-polling yields the processor every 32 attempts once a wait has lasted this long (at
/// once on a crowded host): a ping-pong partner answers well within it, and a thread that
/// shares its core with other pollers lets them run instead of burning its time slice.
pub const POLL_YIELD_AFTER: Duration = Duration::from_micros(20);

/// A channel's progress policy (`non_exhaustive`: start from [`ProgressPolicy::default`] and
/// assign the fields that differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProgressPolicy {
    /// The waiting mode.
    pub mode: ProgressMode,
    /// True when the host runs more session processes than it has cores: spin less, yield more.
    pub oversubscribed: bool,
    /// If set, a call that waits longer than this fails with [`Error::Timeout`].
    pub op_timeout: Option<Duration>,
}

impl Default for ProgressPolicy {
    fn default() -> Self {
        ProgressPolicy {
            mode: ProgressMode::Adaptive { spin: DEFAULT_SPIN },
            oversubscribed: false,
            op_timeout: None,
        }
    }
}

impl ProgressPolicy {
    /// Parse `poll`, `block`, `adaptive` or `adaptive:<spin µs>`.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] for any other text, or a spin that is not a
    /// number of microseconds.
    pub fn parse_mode(s: &str) -> Result<ProgressMode> {
        let s = s.trim();
        match s {
            "poll" | "busy" | "busy-poll" => Ok(ProgressMode::Poll),
            "block" | "blocking" => Ok(ProgressMode::Block),
            "adaptive" => Ok(ProgressMode::Adaptive { spin: DEFAULT_SPIN }),
            _ => {
                if let Some(us) = s.strip_prefix("adaptive:") {
                    let us: u64 = us.parse().map_err(|_| {
                        Error::BadConfig(format!(
                            "progress `{s}`: spin must be a number of microseconds"
                        ))
                    })?;
                    Ok(ProgressMode::Adaptive {
                        spin: Duration::from_micros(us),
                    })
                } else {
                    Err(Error::BadConfig(format!(
                        "unknown progress mode `{s}`: use poll, block, adaptive or adaptive:<µs>"
                    )))
                }
            }
        }
    }

    /// Run `attempt(state)` until it is ready, waiting between attempts as the policy says;
    /// `block(state, t)` blocks in the driver for at most `t`.
    ///
    /// # Errors
    ///
    /// The first error of `attempt` or `block`; [`Error::Timeout`] when the
    /// policy's `op_timeout` passes.
    #[inline]
    pub fn drive<S: ?Sized, T>(
        &self,
        state: &mut S,
        attempt: impl FnMut(&mut S) -> Result<Poll<T>>,
        block: impl FnMut(&mut S, Duration) -> Result<()>,
    ) -> Result<T> {
        self.drive_marked(state, attempt, block, |_| 0)
    }

    /// [`drive`](Self::drive) for a wait that can make progress without being ready (a large
    /// transfer draining through a socket buffer, a peer copying a posted buffer): `mark(state)`
    /// is a counter that changes whenever data moves
    /// ([`TxLink::progress_mark`](crate::driver::TxLink::progress_mark)). While it keeps
    /// changing, the adaptive policy stays in its spin phase instead of yielding and blocking
    /// (a kernel wake-up per socket-buffer refill), except on a crowded host.
    ///
    /// # Errors
    ///
    /// As [`drive`](Self::drive).
    #[inline]
    pub fn drive_marked<S: ?Sized, T>(
        &self,
        state: &mut S,
        attempt: impl FnMut(&mut S) -> Result<Poll<T>>,
        block: impl FnMut(&mut S, Duration) -> Result<()>,
        mark: impl Fn(&S) -> u64,
    ) -> Result<T> {
        self.drive_until(state, attempt, block, mark, None)
    }

    /// [`drive_marked`](Self::drive_marked) that also gives up at `until` (a per-call
    /// deadline, on top of the channel's `op_timeout`) with [`Error::Timeout`] (the time
    /// waited).
    ///
    /// # Errors
    ///
    /// As [`drive`](Self::drive); [`Error::Timeout`] also at `until`.
    #[inline(always)]
    pub fn drive_until<S: ?Sized, T>(
        &self,
        state: &mut S,
        mut attempt: impl FnMut(&mut S) -> Result<Poll<T>>,
        block: impl FnMut(&mut S, Duration) -> Result<()>,
        mark: impl Fn(&S) -> u64,
        until: Option<Instant>,
    ) -> Result<T> {
        if let Poll::Ready(v) = attempt(state)? {
            return Ok(v);
        }
        self.drive_slow(state, attempt, block, mark, until)
    }

    #[cold]
    #[inline(never)]
    fn drive_slow<S: ?Sized, T>(
        &self,
        state: &mut S,
        mut attempt: impl FnMut(&mut S) -> Result<Poll<T>>,
        mut block: impl FnMut(&mut S, Duration) -> Result<()>,
        mark: impl Fn(&S) -> u64,
        until: Option<Instant>,
    ) -> Result<T> {
        // The process-wide count of waiting threads (two atomic read-modify-writes) is taken at
        // the first look at the clock, not on entry: most waits end before it (a ping-pong's
        // reply), and crowding only matters once the spin phase is over.
        let mut waiting: Option<Waiting> = None;
        let mut crowded = self.oversubscribed;
        // Most waits end within a few attempts: read the clock only when it is needed (block
        // mode, or every 32 attempts), not on entry.
        let mut start: Option<Instant> = None;
        let mut deadline: Option<Instant> = None;
        let mut last_mark = mark(state);
        let phases = |crowded: bool| -> (Duration, Duration, Duration) {
            let (spin, yield_for) = match self.mode {
                ProgressMode::Poll => (Duration::MAX, Duration::ZERO),
                ProgressMode::Block => (Duration::ZERO, Duration::ZERO),
                ProgressMode::Adaptive { spin } => {
                    if crowded {
                        (spin.min(OVERSUBSCRIBED_SPIN), Duration::from_micros(200))
                    } else {
                        (spin, Duration::from_micros(20))
                    }
                }
            };
            let poll_yield_after = if crowded {
                Duration::ZERO
            } else {
                POLL_YIELD_AFTER
            };
            (spin, yield_for, poll_yield_after)
        };
        let (mut spin, mut yield_for, mut poll_yield_after) = phases(crowded);
        let mut i: u32 = 0;
        // Once the wait has blocked, a wake-up that finds nothing blocks again after one
        // attempt instead of 32: on a crowded host spurious wake-ups are common, and each
        // attempt of an any-source wait scans every peer.
        let mut blocked = false;
        loop {
            i = i.wrapping_add(1);
            let now = if i % 32 == 0 || spin.is_zero() || blocked {
                Some(Instant::now())
            } else {
                None
            };
            if let Some(now) = now {
                if waiting.is_none() {
                    let (w, waiters) = Waiting::enter();
                    waiting = Some(w);
                    crowded = self.oversubscribed || waiters > SHARE.load(Ordering::Relaxed);
                    (spin, yield_for, poll_yield_after) = phases(crowded);
                }
                let began = *start.get_or_insert_with(|| {
                    deadline = match (self.op_timeout.map(|t| now + t), until) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    now
                });
                if let Some(d) = deadline {
                    if now >= d {
                        return Err(Error::Timeout(match until {
                            Some(u) if u <= d => now - began,
                            _ => self.op_timeout.unwrap_or_default(),
                        }));
                    }
                }
                let m = mark(state);
                let waited = if m != last_mark && !crowded {
                    // Data moved since the last look: the transfer is alive, spin on (not on a
                    // crowded host, where the spinning could take the core of whoever moves
                    // the data).
                    last_mark = m;
                    start = Some(now);
                    // A fresh spin phase: the one-attempt rule is for fruitless wake-ups.
                    blocked = false;
                    Duration::ZERO
                } else {
                    now - began
                };
                if self.mode == ProgressMode::Poll {
                    // Busy-polling never blocks, but lets the driver look at the world (peer
                    // liveness, a channel whose peers are all gone) about once a millisecond,
                    // and past the first microseconds gives the core away every 32 attempts
                    // so more pollers than cores still progress.
                    if i % 32768 == 0 {
                        block(state, Duration::ZERO)?;
                    }
                    if waited >= poll_yield_after {
                        std::thread::yield_now();
                    }
                } else if waited >= spin {
                    if waited < spin.saturating_add(yield_for) {
                        // Phase 2: give the core to another runnable thread.
                        std::thread::yield_now();
                    } else {
                        // Phase 3: block in the driver.
                        let slice = match deadline {
                            Some(d) => d.saturating_duration_since(now).min(BLOCK_SLICE),
                            None => BLOCK_SLICE,
                        };
                        block(state, slice)?;
                        blocked = true;
                    }
                }
            } else {
                // Phase 1: spin.
                std::hint::spin_loop();
            }
            if let Poll::Ready(v) = attempt(state)? {
                return Ok(v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_modes() {
        assert_eq!(
            ProgressPolicy::parse_mode("poll").unwrap(),
            ProgressMode::Poll
        );
        assert_eq!(
            ProgressPolicy::parse_mode("block").unwrap(),
            ProgressMode::Block
        );
        assert_eq!(
            ProgressPolicy::parse_mode("adaptive:7").unwrap(),
            ProgressMode::Adaptive {
                spin: Duration::from_micros(7)
            }
        );
        assert!(ProgressPolicy::parse_mode("fast").is_err());
        assert!(ProgressPolicy::parse_mode("adaptive:x").is_err());
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "timing: Miri is too slow for the spin phase to end before the deadline"
    )]
    fn drive_blocks_after_spinning_and_times_out() {
        let p = ProgressPolicy {
            mode: ProgressMode::Adaptive {
                spin: Duration::from_micros(10),
            },
            oversubscribed: false,
            op_timeout: Some(Duration::from_millis(30)),
        };
        let mut blocks = 0;
        let r: Result<()> = p.drive(
            &mut (),
            |_| Ok(Poll::Pending),
            |_, t| {
                blocks += 1;
                std::thread::sleep(t.min(Duration::from_millis(5)));
                Ok(())
            },
        );
        assert!(matches!(r, Err(Error::Timeout(_))));
        assert!(blocks >= 1);
    }

    #[test]
    fn drive_returns_when_ready() {
        let p = ProgressPolicy {
            mode: ProgressMode::Block,
            ..Default::default()
        };
        let mut n = 0;
        let v: i32 = p
            .drive(
                &mut n,
                |n| {
                    *n += 1;
                    Ok(if *n == 3 {
                        Poll::Ready(42)
                    } else {
                        Poll::Pending
                    })
                },
                |_, _| Ok(()),
            )
            .unwrap();
        assert_eq!(v, 42);
    }

    #[test]
    fn adaptive_keeps_spinning_while_data_moves_then_blocks() {
        let p = ProgressPolicy {
            mode: ProgressMode::Adaptive {
                spin: Duration::from_micros(20),
            },
            ..Default::default()
        };
        // state: (attempts, mark, blocks). The mark moves on every attempt for 3 ms (far
        // longer than the 20 µs spin plus the 20 µs yield phase), then stops.
        let t0 = Instant::now();
        let mut st = (0u64, 0u64, 0u32, None::<Instant>);
        let r: Result<()> = p.drive_marked(
            &mut st,
            |st| {
                st.0 += 1;
                if t0.elapsed() < Duration::from_millis(3) {
                    st.1 += 1;
                    return Ok(Poll::Pending);
                }
                if st.2 > 0 {
                    Ok(Poll::Ready(()))
                } else {
                    Ok(Poll::Pending)
                }
            },
            |st, _| {
                st.2 += 1;
                st.3.get_or_insert_with(Instant::now);
                Ok(())
            },
            |st| st.1,
        );
        r.unwrap();
        let first_block = st.3.expect("blocked once the data stopped moving");
        assert!(
            first_block.duration_since(t0) >= Duration::from_millis(3),
            "blocked after {:?} while data was still moving",
            first_block.duration_since(t0)
        );
    }

    #[test]
    fn poll_mode_never_blocks_with_a_timeout() {
        let p = ProgressPolicy {
            mode: ProgressMode::Poll,
            ..Default::default()
        };
        let t0 = Instant::now();
        let mut long_blocks = 0;
        let r: Result<()> = p.drive(
            &mut (),
            |_| {
                Ok(if t0.elapsed() > Duration::from_millis(50) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                })
            },
            |_, t| {
                if !t.is_zero() {
                    long_blocks += 1;
                }
                Ok(())
            },
        );
        r.unwrap();
        assert_eq!(long_blocks, 0);
    }

    #[test]
    fn waiting_threads_are_counted_and_released() {
        let p = ProgressPolicy {
            mode: ProgressMode::Block,
            ..Default::default()
        };
        let before = WAITING.load(Ordering::Relaxed);
        let mut seen = 0usize;
        let _: Result<()> = p.drive(
            &mut seen,
            |seen| {
                Ok(if *seen > 0 {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                })
            },
            |seen, _| {
                *seen = WAITING.load(Ordering::Relaxed);
                Ok(())
            },
        );
        assert!(seen > before, "a blocked thread counts as waiting");
        // Other tests may wait concurrently: only check the counter did not leak upward
        // by this test's own wait.
        assert!(WAITING.load(Ordering::Relaxed) < seen + 8);
    }
}
