//! Event-loop support: waiting on readiness descriptors.
//!
//! A channel's readiness descriptor ([`Channel::readiness_fd`](crate::Channel::readiness_fd))
//! and its arming protocol are the driver contract's ([`Incoming::arm`](crate::driver::Incoming::arm));
//! this module holds the one blocking helper the core and the kit need on top of them.

use std::os::fd::BorrowedFd;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout};

use crate::error::{Error, Result};

/// Wait until one of `fds` is readable (or hung up), or `timeout` passes; `None` waits
/// without a limit. Returns the indices of the readable descriptors (empty on timeout).
/// Interrupted waits (`EINTR`) return empty, as a timeout would: callers loop anyway.
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
