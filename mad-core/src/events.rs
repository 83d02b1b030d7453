//! Event-loop support: waiting on readiness descriptors.
//!
//! A channel's readiness descriptor ([`Channel::readiness_fd`](crate::Channel::readiness_fd))
//! and its arming protocol are the driver contract's ([`Incoming::arm`](crate::driver::Incoming::arm));
//! this module holds what blocking callers build on them: waiting on descriptors, and waiting
//! for the first message on any of several channels ([`begin_unpacking_any`]).

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use crate::error::{Error, Result};
use crate::progress::ProgressMode;
use crate::{Channel, Unpacker};

/// Wait until one of `fds` is readable (or hung up), or `timeout` passes; `None` waits
/// without a limit. Returns the indices of the readable descriptors (empty on timeout).
/// Interrupted waits (`EINTR`) return empty, as a timeout would: callers loop anyway.
///
/// # Errors
///
/// [`Error::Io`] when `poll(2)` fails (other than `EINTR`).
pub fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> Result<Vec<usize>> {
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
        .collect();
    let t = match timeout {
        None => PollTimeout::NONE,
        Some(d) => {
            // Round up: a 100 µs wait must not become a 0 ms busy poll.
            let ms = d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
        }
    };
    match nix::poll::poll(&mut pfds, t) {
        Ok(0) | Err(nix::errno::Errno::EINTR) => Ok(Vec::new()),
        Ok(_) => Ok(pfds
            .iter()
            .enumerate()
            .filter(|(_, p)| p.revents().is_some_and(|r| !r.is_empty()))
            .map(|(i, _)| i)
            .collect()),
        Err(e) => Err(Error::io("poll on readiness descriptors", e.into())),
    }
}

/// The first message on any of several channels: the blocking counterpart of a
/// `tokio::select!` over the async adapter's `begin_unpacking` futures. Returns the index of
/// the channel in `channels` and the message's [`Unpacker`]; fails with
/// [`Error::Timeout`] at `deadline` (nothing consumed).
///
/// An error of one connection (it failed, its peer died) or of one channel (it was closed) is
/// returned as `begin_unpacking` on that channel would return it. A channel none of whose
/// peers can send any more is different: it is left out while another channel may still
/// deliver (peers often close a channel right after their last message on another one), and
/// its error is returned once every channel is in that state.
///
/// It polls every channel for the channels' spin budget, then arms their readiness
/// descriptors (looking again while one says `Busy`) and sleeps on all of them at once
/// (`poll(2)`); a channel without a descriptor (MPI) is polled every millisecond at most.
///
/// # Errors
///
/// [`Error::Timeout`] at `deadline`;
/// [`Error::BadConfig`] for an empty `channels`; otherwise the first error
/// of a channel's [`begin_unpacking`](crate::Channel::begin_unpacking) (a failed connection, every
/// peer of a channel gone, a closed channel).
pub fn begin_unpacking_any<'c, 'b>(
    channels: &[&'c Channel],
    deadline: Option<Instant>,
) -> Result<(usize, Unpacker<'c, 'b>)> {
    if channels.is_empty() {
        return Err(Error::BadConfig(
            "begin_unpacking_any needs at least one channel".into(),
        ));
    }
    let spin = channels
        .iter()
        .map(|c| match c.config().progress {
            ProgressMode::Poll => Duration::MAX,
            ProgressMode::Block => Duration::ZERO,
            ProgressMode::Adaptive { spin } => spin,
        })
        .min()
        .unwrap_or_default();
    let mut any = Any {
        channels,
        gone: vec![false; channels.len()],
        first_gone: None,
    };
    let t0 = Instant::now();
    let mut backoff = Duration::from_micros(20);
    loop {
        if let Some(r) = any.try_all()? {
            return Ok(r);
        }
        let now = Instant::now();
        if let Some(d) = deadline {
            if now >= d {
                return Err(Error::Timeout(now - t0));
            }
        }
        if now - t0 < spin {
            // Past the first microseconds, give the core away between looks, as the progress
            // policy does (busy-polling threads share two cores with their peers here).
            if now - t0 > crate::progress::POLL_YIELD_AFTER {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        // Arm every descriptor after a look that found nothing; `Busy` anywhere: look again.
        let mut busy = false;
        for c in any.live() {
            busy |= c.arm()? == crate::driver::Armed::Busy;
        }
        if busy {
            continue;
        }
        let all_fds = any.live().all(|c| c.readiness_fd().is_some());
        let fds: Vec<BorrowedFd<'_>> = any.live().filter_map(|c| c.readiness_fd()).collect();
        let mut timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if !all_fds {
            timeout = Some(timeout.map_or(backoff, |t| t.min(backoff)));
            backoff = (backoff * 2).min(Duration::from_millis(1));
        }
        if fds.is_empty() {
            std::thread::sleep(timeout.unwrap_or(backoff));
        } else {
            wait_readable(&fds, timeout)?;
        }
    }
}

/// The state of one [`begin_unpacking_any`]: which channels can no longer deliver.
struct Any<'a, 'c> {
    channels: &'a [&'c Channel],
    /// Every peer of this channel is gone (closed or failed, and every error reported).
    gone: Vec<bool>,
    /// The error of the first channel found in that state.
    first_gone: Option<Error>,
}

impl<'c> Any<'_, 'c> {
    /// The channels that may still deliver a message.
    fn live(&self) -> impl Iterator<Item = &'c Channel> + '_ {
        self.channels
            .iter()
            .zip(&self.gone)
            .filter(|(_, &g)| !g)
            .map(|(c, _)| *c)
    }

    /// One non-blocking look at every channel that may still deliver.
    fn try_all<'b>(&mut self) -> Result<Option<(usize, Unpacker<'c, 'b>)>> {
        for (i, c) in self.channels.iter().enumerate() {
            if self.gone[i] {
                continue;
            }
            match c.try_begin_unpacking() {
                Ok(Some(u)) => return Ok(Some((i, u))),
                Ok(None) => {}
                Err(e) if !c.is_closed() && c.inner.all_broken() => {
                    self.gone[i] = true;
                    self.first_gone.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        if self.gone.iter().all(|&g| g) {
            if let Some(e) = self.first_gone.take() {
                return Err(e);
            }
        }
        Ok(None)
    }
}
