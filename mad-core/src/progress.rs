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

use std::task::Poll;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How a channel waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// A channel's progress policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    #[inline]
    pub fn drive<S: ?Sized, T>(
        &self,
        state: &mut S,
        mut attempt: impl FnMut(&mut S) -> Result<Poll<T>>,
        block: impl FnMut(&mut S, Duration) -> Result<()>,
    ) -> Result<T> {
        if let Poll::Ready(v) = attempt(state)? {
            return Ok(v);
        }
        self.drive_slow(state, attempt, block)
    }

    #[cold]
    #[inline(never)]
    fn drive_slow<S: ?Sized, T>(
        &self,
        state: &mut S,
        mut attempt: impl FnMut(&mut S) -> Result<Poll<T>>,
        mut block: impl FnMut(&mut S, Duration) -> Result<()>,
    ) -> Result<T> {
        // Most waits end within a few attempts: read the clock only when it is needed (block
        // mode, or after 32 attempts), not on entry.
        let mut start: Option<Instant> = None;
        let mut deadline: Option<Instant> = None;
        let (spin, yield_for) = match self.mode {
            ProgressMode::Poll => (Duration::MAX, Duration::ZERO),
            ProgressMode::Block => (Duration::ZERO, Duration::ZERO),
            ProgressMode::Adaptive { spin } => {
                if self.oversubscribed {
                    (spin.min(OVERSUBSCRIBED_SPIN), Duration::from_micros(200))
                } else {
                    (spin, Duration::from_micros(20))
                }
            }
        };
        let mut i: u32 = 0;
        loop {
            i = i.wrapping_add(1);
            // Phase 1: spin.
            let now = if i % 32 == 0 || spin.is_zero() {
                Some(Instant::now())
            } else {
                None
            };
            if let Some(now) = now {
                let start = *start.get_or_insert_with(|| {
                    deadline = self.op_timeout.map(|t| now + t);
                    now
                });
                if let Some(d) = deadline {
                    if now >= d {
                        return Err(Error::Timeout(self.op_timeout.unwrap_or_default()));
                    }
                }
                let waited = now - start;
                if waited >= spin {
                    if waited < spin.saturating_add(yield_for) || (self.mode == ProgressMode::Poll)
                    {
                        // Phase 2: give the core to another runnable process.
                        std::thread::yield_now();
                    } else {
                        // Phase 3: block in the driver.
                        let slice = match deadline {
                            Some(d) => d.saturating_duration_since(now).min(BLOCK_SLICE),
                            None => BLOCK_SLICE,
                        };
                        block(state, slice)?;
                    }
                } else if self.mode == ProgressMode::Poll && i % 32768 == 0 {
                    // Busy-polling never blocks, but still lets the driver look at the world
                    // (peer liveness, a channel whose peers are all gone) about once a
                    // millisecond, and gives the core away now and then on a crowded host.
                    block(state, Duration::ZERO)?;
                    if self.oversubscribed {
                        std::thread::yield_now();
                    }
                }
            } else {
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
}
