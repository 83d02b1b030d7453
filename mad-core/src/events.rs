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
    let t = timeout.map_or(PollTimeout::NONE, poll_timeout);
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

/// `d` in whole milliseconds, rounded up: a 100 µs wait must not become a 0 ms busy poll.
/// (`epoll_wait` takes the same type.)
fn poll_timeout(d: Duration) -> PollTimeout {
    let ms = d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
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
    begin_any_from(channels, 0, deadline)
}

/// [`begin_unpacking_any`], each look starting with `channels[first]`.
pub(crate) fn begin_any_from<'c, 'b>(
    channels: &[&'c Channel],
    first: usize,
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
    let mut any = Any::new(channels, first);
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
        // Each `Armed` is disarmed when this wait ends (the drivers may stop watching then).
        let mut busy = false;
        let mut armed = Disarmed(Vec::new());
        for c in any.live() {
            match c.arm()? {
                crate::driver::Armed::Armed => armed.0.push(c),
                _ => busy = true,
            }
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

/// Channels armed for one wait, disarmed when it ends.
struct Disarmed<'a>(Vec<&'a Channel>);

impl Drop for Disarmed<'_> {
    fn drop(&mut self) {
        for c in &self.0 {
            c.disarm();
        }
    }
}

/// One non-blocking look at every channel that may deliver, starting with
/// `channels[first]`: the index of the channel and its message, or `None`. The error of a
/// channel every peer of which is gone is returned only when every channel is in that state.
pub(crate) fn try_unpacking_any<'c, 'b>(
    channels: &[&'c Channel],
    first: usize,
) -> Result<Option<(usize, Unpacker<'c, 'b>)>> {
    Any::new(channels, first).try_all()
}

/// The state of one [`begin_unpacking_any`]: which channels can no longer deliver.
struct Any<'a, 'c> {
    channels: &'a [&'c Channel],
    /// The channel each look starts with.
    first: usize,
    /// Every peer of this channel is gone (closed or failed, and every error reported).
    gone: smallvec::SmallVec<[bool; 8]>,
    /// The error of the first channel found in that state.
    first_gone: Option<Error>,
}

impl<'a, 'c> Any<'a, 'c> {
    fn new(channels: &'a [&'c Channel], first: usize) -> Self {
        Any {
            channels,
            first: first % channels.len().max(1),
            gone: smallvec::smallvec![false; channels.len()],
            first_gone: None,
        }
    }

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
        let n = self.channels.len();
        for k in 0..n {
            let i = (self.first + k) % n;
            let c = self.channels[i];
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

/// Token of the wake-up socket in a [`ReadinessSet`]'s epoll set (peers use their rank).
pub const WAKE_TOKEN: u64 = u64::MAX;
/// Tokens of the one-shot send registrations of a [`ReadinessSet`] have this bit set.
pub const SEND_TOKEN: u64 = 1 << 62;

/// Who needs the peers' descriptors in a [`ReadinessSet`]'s epoll set.
#[derive(Default)]
struct Members {
    /// The descriptors are in the set.
    joined: bool,
    /// Arms not yet disarmed ([`ReadinessSet::arm_peers`]).
    armed: usize,
}

struct SetPeer {
    rank: usize,
    /// Duplicates of the descriptors whose input may be what a receive from `rank` waits for.
    fds: Vec<std::os::fd::OwnedFd>,
    /// The core gave up on the peer ([`ReadinessSet::forget`]): out of the set, so that an
    /// ended socket does not keep it readable.
    forgotten: std::sync::atomic::AtomicBool,
}

/// The readiness descriptor of a socket driver's channel, the driver side of
/// [`Incoming::arm`](crate::driver::Incoming::arm) and
/// [`TxLink::arm_send`](crate::driver::TxLink::arm_send): an epoll set, made at first use (a
/// program that never arms pays nothing), of every peer's descriptors (level-triggered input
/// and hang-ups) and of a wake-up socket, plus the one-shot registrations of armed sends.
/// Forgotten peers leave the set; waking it writes the wake-up socket, which waiters drain.
pub struct ReadinessSet {
    driver: &'static str,
    set: std::sync::OnceLock<nix::sys::epoll::Epoll>,
    /// Whether the peers' descriptors are in the set and who needs them there; also orders
    /// the making of the set with taking forgotten peers out of it.
    making: std::sync::Mutex<Members>,
    peers: Vec<SetPeer>,
    wake_rx: std::os::unix::net::UnixStream,
    wake_tx: std::os::unix::net::UnixStream,
    /// A [`wait`](ReadinessSet::wait) consumed the event of an armed send: the next
    /// [`any_ready`](ReadinessSet::any_ready) says so.
    send_ready: std::sync::atomic::AtomicBool,
    /// [`make`](ReadinessSet::make) is done: the peers are in the set for good (written under
    /// `making`; read without the lock on every blocking [`wait`](ReadinessSet::wait)).
    pinned: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ReadinessSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<usize> = self.peers.iter().map(|p| p.rank).collect();
        f.debug_struct("ReadinessSet")
            .field("driver", &self.driver)
            .field("peers", &peers)
            .field("made", &self.set.get().is_some())
            .finish_non_exhaustive()
    }
}

impl ReadinessSet {
    /// A set over `peers` (rank, the descriptors to watch for its input: duplicates the set
    /// owns). `driver` names the driver in errors.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the wake-up socket pair cannot be made.
    pub fn new(
        driver: &'static str,
        peers: impl IntoIterator<Item = (usize, Vec<std::os::fd::OwnedFd>)>,
    ) -> Result<Self> {
        let io = |e| Error::io(format!("{driver}: wake-up socket pair"), e);
        let (wake_rx, wake_tx) = std::os::unix::net::UnixStream::pair().map_err(io)?;
        wake_rx.set_nonblocking(true).map_err(io)?;
        wake_tx.set_nonblocking(true).map_err(io)?;
        Ok(ReadinessSet {
            driver,
            set: std::sync::OnceLock::new(),
            making: std::sync::Mutex::new(Members::default()),
            peers: peers
                .into_iter()
                .map(|(rank, fds)| SetPeer {
                    rank,
                    fds,
                    forgotten: std::sync::atomic::AtomicBool::new(false),
                })
                .collect(),
            wake_rx,
            wake_tx,
            send_ready: std::sync::atomic::AtomicBool::new(false),
            pinned: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn err(&self, what: &str) -> impl Fn(nix::errno::Errno) -> Error + '_ {
        let what = what.to_string();
        move |e| Error::io(format!("{}: {what}", self.driver), e.into())
    }

    /// The epoll set, made now if it was not yet.
    fn set(&self) -> Result<&nix::sys::epoll::Epoll> {
        use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
        if let Some(s) = self.set.get() {
            return Ok(s);
        }
        let _g = self.making.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = self.set.get() {
            return Ok(s);
        }
        let err = self.err("epoll set");
        let set = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(&err)?;
        let input = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        set.add(&self.wake_rx, EpollEvent::new(input, WAKE_TOKEN))
            .map_err(&err)?;
        Ok(self.set.get_or_init(|| set))
    }

    /// The descriptors of the peers not forgotten, with their ranks.
    fn live_fds(&self) -> impl Iterator<Item = (usize, &std::os::fd::OwnedFd)> {
        use std::sync::atomic::Ordering;
        self.peers
            .iter()
            .filter(|p| !p.forgotten.load(Ordering::Acquire))
            .flat_map(|p| p.fds.iter().map(move |fd| (p.rank, fd)))
    }

    /// Put the peers' descriptors into `set` if they are not in it (under `making`).
    fn join(&self, set: &nix::sys::epoll::Epoll, m: &mut Members) -> Result<()> {
        use nix::sys::epoll::{EpollEvent, EpollFlags};
        if m.joined {
            return Ok(());
        }
        let input = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        for (rank, fd) in self.live_fds() {
            set.add(fd, EpollEvent::new(input, rank as u64))
                .map_err(self.err("epoll set"))?;
        }
        m.joined = true;
        Ok(())
    }

    /// Take the peers' descriptors out of the set when nobody needs them there (under
    /// `making`).
    fn part(&self, m: &mut Members) {
        // `pinned` is written under the same lock (`make`).
        if !m.joined || m.armed > 0 || self.pinned.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if let Some(set) = self.set.get() {
            for (_, fd) in self.live_fds() {
                let _ = set.delete(fd);
            }
        }
        m.joined = false;
    }

    /// The readiness descriptor ([`Incoming::readiness_fd`](crate::driver::Incoming::readiness_fd));
    /// `None` when the set cannot be made.
    pub fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.set().ok().map(|s| s.0.as_fd())
    }

    /// Take `rank`'s descriptors out of the set, for good
    /// ([`Incoming::forget`](crate::driver::Incoming::forget)).
    pub fn forget(&self, rank: usize) {
        use std::sync::atomic::Ordering;
        let mine = || self.peers.iter().filter(|p| p.rank == rank);
        if mine().all(|p| p.forgotten.load(Ordering::Acquire)) {
            return; // already out (a connection's halves report its end more than once)
        }
        let g = self.making.lock().unwrap_or_else(|p| p.into_inner());
        for p in mine() {
            if !p.forgotten.swap(true, Ordering::AcqRel) && g.joined {
                if let Some(set) = self.set.get() {
                    for fd in &p.fds {
                        let _ = set.delete(fd);
                    }
                }
            }
        }
    }

    /// Whether the `i`-th peer given to [`new`](Self::new) was forgotten.
    pub fn is_forgotten(&self, i: usize) -> bool {
        self.peers
            .get(i)
            .is_none_or(|p| p.forgotten.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Wake the waiters: a byte on the wake-up socket (which stays readable until drained).
    pub fn wake(&self) {
        use std::io::Write;
        let _ = (&self.wake_tx).write(&[1]);
    }

    /// Consume the wake-ups (after a wait that the wake-up socket ended, and before arming).
    pub fn drain_wake(&self) {
        use std::io::Read;
        let mut sink = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut sink), Ok(n) if n > 0) {}
    }

    /// The wake-up socket's readable end, for a `poll(2)` of the driver's own.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.wake_rx.as_fd()
    }

    /// Register `fd` once (`EPOLLONESHOT`: it disables itself when it fires) for `write`
    /// readiness and, if `read`, input, under `token` ([`SEND_TOKEN`] and whatever the driver
    /// adds). `again`: `fd` was registered before (its registration is changed, not added).
    /// `fd` must be the driver's own descriptor, not one the set watches for input.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the set cannot be made or the registration fails.
    pub fn register_once(
        &self,
        fd: BorrowedFd<'_>,
        write: bool,
        read: bool,
        token: u64,
        again: bool,
    ) -> Result<()> {
        use nix::sys::epoll::{EpollEvent, EpollFlags};
        let set = self.set()?;
        let mut flags = EpollFlags::EPOLLONESHOT;
        if write {
            flags |= EpollFlags::EPOLLOUT;
        }
        if read {
            flags |= EpollFlags::EPOLLIN;
        }
        let mut ev = EpollEvent::new(flags, token);
        let r = if again {
            set.modify(fd, &mut ev)
        } else {
            set.add(fd, ev)
        };
        r.map_err(self.err("arming a send in epoll"))
    }

    /// Take a registration of [`register_once`](Self::register_once) out (the descriptor's
    /// owner goes; the registration belongs to the open file, which other descriptors may keep
    /// open).
    pub fn unregister(&self, fd: BorrowedFd<'_>) {
        if let Some(set) = self.set.get() {
            let _ = set.delete(fd);
        }
    }

    /// Whether the set is readable now (a level-triggered look: it consumes nothing but the
    /// one-shot events of armed sends).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the set cannot be made or `epoll_wait` fails.
    pub fn any_ready(&self) -> Result<bool> {
        use nix::sys::epoll::{EpollEvent, EpollTimeout};
        use std::sync::atomic::Ordering;
        let mut evs = [EpollEvent::empty(); 4];
        let n = self
            .set()?
            .wait(&mut evs, EpollTimeout::ZERO)
            .map_err(self.err("epoll_wait"))?;
        Ok(self.send_ready.swap(false, Ordering::AcqRel) || n > 0)
    }

    /// Wait on the epoll set (made now if it was not yet, with the peers in it for good) up to
    /// `timeout`: `ready(rank)` for each peer with input or a hang-up; armed sends that fired
    /// are noted for the next
    /// [`any_ready`](Self::any_ready). Returns whether the wake-up socket was readable (the
    /// caller drains it if it is a waiter). Interrupted waits return as a timeout would.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the set cannot be made or `epoll_wait` fails.
    pub fn wait(&self, timeout: Duration, ready: &mut dyn FnMut(usize)) -> Result<bool> {
        use nix::sys::epoll::EpollEvent;
        use std::sync::atomic::Ordering;
        let mut evs = [EpollEvent::empty(); 64];
        // A blocking wait on the set keeps the peers in it for good (`make`).
        self.make()?;
        let n = match self.set()?.wait(&mut evs, poll_timeout(timeout)) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => 0,
            Err(e) => return Err(self.err("epoll_wait")(e)),
        };
        let mut woken = false;
        for ev in &evs[..n] {
            match ev.data() {
                WAKE_TOKEN => woken = true,
                t if t & SEND_TOKEN != 0 => self.send_ready.store(true, Ordering::Release),
                t => ready(t as usize),
            }
        }
        Ok(woken)
    }

    /// `poll(2)` over the descriptors of the peers not forgotten and the wake-up socket, up to
    /// `timeout`, without the epoll set (which costs a callback on every incoming segment
    /// once it exists): `ready(rank)` for each peer with input or a hang-up. Returns whether
    /// the wake-up socket was readable (the caller drains it if it is a waiter). Interrupted
    /// waits return as a timeout would.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when `poll(2)` fails.
    pub fn poll_peers(&self, timeout: Duration, ready: &mut dyn FnMut(usize)) -> Result<bool> {
        use nix::poll::{PollFd, PollFlags};
        use std::os::fd::AsFd;
        let mut ranks: smallvec::SmallVec<[usize; 8]> = smallvec::SmallVec::new();
        let mut fds: smallvec::SmallVec<[PollFd<'_>; 8]> = smallvec::SmallVec::new();
        // A forgotten peer's hung-up socket stays readable: polling it would end every wait.
        for (rank, fd) in self.live_fds() {
            ranks.push(rank);
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        fds.push(PollFd::new(self.wake_rx.as_fd(), PollFlags::POLLIN));
        match nix::poll::poll(&mut fds, poll_timeout(timeout)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => return Ok(false),
            Ok(_) => {}
            Err(e) => return Err(self.err("poll")(e)),
        }
        let fired = |p: &PollFd<'_>| p.revents().is_some_and(|r| !r.is_empty());
        for (p, rank) in fds.iter().zip(&ranks) {
            if fired(p) {
                ready(*rank);
            }
        }
        Ok(fds.last().is_some_and(fired))
    }

    /// Make the set now, with the peers' descriptors in it for good (before arming: what
    /// happens afterwards makes it readable; and before [`wait`](Self::wait)).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the set cannot be made.
    pub fn make(&self) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.pinned.load(Ordering::Acquire) {
            return Ok(());
        }
        let set = self.set()?;
        let mut m = self.making.lock().unwrap_or_else(|p| p.into_inner());
        self.join(set, &mut m)?;
        self.pinned.store(true, Ordering::Release);
        Ok(())
    }

    /// An event loop arms: make the set and put the peers' descriptors in it until the
    /// matching [`disarm`](Self::disarm). A set that holds a socket costs the kernel a callback
    /// for every segment that arrives on it, which traffic between sleeps should not pay: the
    /// descriptors stay in only while someone armed and has not disarmed (or for good after
    /// [`make`](Self::make)). Call [`disarm`](Self::disarm) when the arm says `Busy` (the
    /// caller does not sleep) and after the sleep.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the set cannot be made or a descriptor cannot be added.
    pub fn arm_peers(&self) -> Result<()> {
        let set = self.set()?;
        let mut m = self.making.lock().unwrap_or_else(|p| p.into_inner());
        self.join(set, &mut m)?;
        m.armed += 1;
        Ok(())
    }

    /// The end of an [`arm_peers`](Self::arm_peers): the last one takes the peers'
    /// descriptors out of the set (unless it was [`make`](Self::make)d).
    pub fn disarm(&self) {
        let mut m = self.making.lock().unwrap_or_else(|p| p.into_inner());
        m.armed = m.armed.saturating_sub(1);
        self.part(&mut m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::{AsFd, OwnedFd};
    use std::os::unix::net::UnixStream;

    /// A set over two peers (ranks 3 and 5), and the far ends of their sockets.
    fn two_peers() -> (ReadinessSet, UnixStream, UnixStream) {
        let (a, far_a) = UnixStream::pair().unwrap();
        let (b, far_b) = UnixStream::pair().unwrap();
        let set = ReadinessSet::new(
            "test",
            [(3, vec![OwnedFd::from(a)]), (5, vec![OwnedFd::from(b)])],
        )
        .unwrap();
        (set, far_a, far_b)
    }

    fn ready_ranks(set: &ReadinessSet, epoll: bool) -> (Vec<usize>, bool) {
        let mut got = Vec::new();
        let woken = if epoll {
            set.wait(Duration::ZERO, &mut |r| got.push(r)).unwrap()
        } else {
            set.poll_peers(Duration::ZERO, &mut |r| got.push(r))
                .unwrap()
        };
        got.sort_unstable();
        (got, woken)
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and epoll: not under Miri")]
    fn both_waits_report_ranks_wake_ups_and_leave_forgotten_peers_out() {
        for epoll in [false, true] {
            let (set, mut far_a, far_b) = two_peers();
            assert_eq!(ready_ranks(&set, epoll), (vec![], false));
            far_a.write_all(&[1]).unwrap();
            assert_eq!(ready_ranks(&set, epoll), (vec![3], false));
            // A hung-up peer is readable until forgotten.
            drop(far_b);
            assert_eq!(ready_ranks(&set, epoll), (vec![3, 5], false));
            set.forget(5);
            set.forget(5);
            assert!(set.is_forgotten(1) && !set.is_forgotten(0));
            assert_eq!(ready_ranks(&set, epoll), (vec![3], false));
            // Wake-ups are reported, and stay until drained.
            set.wake();
            assert_eq!(ready_ranks(&set, epoll), (vec![3], true));
            assert_eq!(ready_ranks(&set, epoll), (vec![3], true));
            set.drain_wake();
            assert_eq!(ready_ranks(&set, epoll), (vec![3], false));
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and epoll: not under Miri")]
    fn the_peers_are_in_the_set_only_while_armed_or_made() {
        let (set, mut far_a, _far_b) = two_peers();
        far_a.write_all(&[1]).unwrap();
        // The descriptor exists, but nobody armed: the sockets are not watched.
        assert!(set.readiness_fd().is_some());
        assert!(!set.any_ready().unwrap());
        set.arm_peers().unwrap();
        assert!(set.any_ready().unwrap(), "armed: the pending byte shows");
        set.arm_peers().unwrap();
        set.disarm();
        assert!(set.any_ready().unwrap(), "one arm is still open");
        set.disarm();
        assert!(!set.any_ready().unwrap(), "every arm ended: out of the set");
        set.disarm(); // an extra disarm is harmless
        set.make().unwrap();
        set.arm_peers().unwrap();
        set.disarm();
        assert!(set.any_ready().unwrap(), "made: in the set for good");
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and epoll: not under Miri")]
    fn a_send_event_consumed_by_a_wait_makes_the_next_look_ready() {
        let (set, _far_a, _far_b) = two_peers();
        // A writable socket of the driver's own, armed once for room.
        let (mine, _other) = UnixStream::pair().unwrap();
        set.register_once(mine.as_fd(), true, false, SEND_TOKEN | 3, false)
            .unwrap();
        // The wait takes the one-shot event (it is neither a rank nor a wake-up)...
        assert_eq!(ready_ranks(&set, true), (vec![], false));
        // ...and the next look says so, once.
        assert!(set.any_ready().unwrap());
        assert!(!set.any_ready().unwrap());
        set.unregister(mine.as_fd());
    }
}
