//! Peer liveness: a pidfd per peer process, checked at a bounded rate while polling and after
//! every blocking slice, shared by a connection's two halves and the any-source watcher.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sys::PidFd;

/// Longest single sleep of a blocking wait before the peer's liveness is checked again: the
/// bound on noticing a dead peer while blocked.
pub const WAIT_SLICE: Duration = Duration::from_millis(50);
/// How often (at most) a polling loop checks the peer's pidfd.
pub const POLL_CHECK_EVERY: Duration = Duration::from_millis(10);
/// A polling loop looks at the clock every this many `Pending`s.
const POLLS_PER_CLOCK: u32 = 64;

/// What the two halves of a connection and the any-source watcher know about the peer
/// process: whether it is known dead, and whether the receiving half has reported the peer
/// gone, after which the any-source wait stops counting it as ready (a peer that closed or
/// died is reported once; a sticky "ready" would make every later wait return at once).
#[derive(Debug)]
pub struct PeerWatch {
    probe: Probe,
    dead: AtomicBool,
    retired: AtomicBool,
}

/// How a [`PeerWatch`] learns that the peer is gone.
enum Probe {
    /// A pidfd of a process on this host.
    Pid(PidFd),
    /// A driver's own check, for peers that are not processes of this host (mad-sisci's
    /// `dolphin` backend asks the SISCI library about the remote segment).
    Custom(Box<dyn Fn() -> bool + Send + Sync>),
}

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Probe::Pid(p) => f.debug_tuple("Pid").field(p).finish(),
            Probe::Custom(_) => f.write_str("Custom"),
        }
    }
}

impl PeerWatch {
    /// Watch process `pid`. Open it while the peer is known alive (during the channel's open
    /// collectives): a pid that is already gone is an error.
    ///
    /// # Errors
    ///
    /// The process is already gone, or it cannot be watched (see
    /// [`PidFd::open`](super::sys::PidFd::open)).
    pub fn open(pid: u32) -> io::Result<Self> {
        Ok(Self::with_probe(Probe::Pid(PidFd::open(pid)?)))
    }

    /// Watch a peer through `gone`, a driver's non-blocking check that returns true once the
    /// peer is known dead or unreachable for good. It is called at the same bounded rate as
    /// the pidfd poll ([`Liveness`], [`DeathCheck`]), possibly from several threads at once;
    /// after it returned true once it is not called again.
    pub fn custom(gone: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self::with_probe(Probe::Custom(Box::new(gone)))
    }

    fn with_probe(probe: Probe) -> Self {
        PeerWatch {
            probe,
            dead: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        }
    }

    /// Whether the process has exited (a non-blocking pidfd poll unless already known).
    pub fn exited(&self) -> bool {
        if self.known_dead() {
            return true;
        }
        let dead = match &self.probe {
            Probe::Pid(p) => p.exited(),
            Probe::Custom(gone) => gone(),
        };
        if dead {
            self.mark_dead();
        }
        dead
    }

    /// Record that the peer is gone; the first time, log it (`info`, target
    /// `mad_core::hostmem::watch`).
    #[cold]
    fn mark_dead(&self) {
        if !self.dead.swap(true, Ordering::Relaxed) {
            match &self.probe {
                Probe::Pid(p) => tracing::info!(pid = p.pid(), "peer process exited"),
                Probe::Custom(_) => tracing::info!("peer gone (driver probe)"),
            }
        }
    }

    /// The pidfd of the watched process (readable once it has exited), for a readiness
    /// descriptor's epoll set; `None` for a driver's own probe or without pidfd support.
    pub fn pidfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.probe {
            Probe::Pid(p) => p.as_fd(),
            Probe::Custom(_) => None,
        }
    }

    /// Whether the process is already known to have exited (no syscall).
    #[inline]
    pub fn known_dead(&self) -> bool {
        self.dead.load(Ordering::Relaxed)
    }

    /// The receiving half reported the peer gone (or failed and was abandoned): the core will
    /// not poll it again, so the any-source wait must not count it as ready.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Whether [`retire`](Self::retire) was called.
    #[inline]
    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }
}

/// Rate-limited liveness checks of a peer process, for one link half.
#[derive(Debug)]
pub struct Liveness {
    watch: Arc<PeerWatch>,
    polls: u32,
    last: Instant,
}

impl Liveness {
    /// Checks of the peer behind `watch`.
    pub fn new(watch: Arc<PeerWatch>) -> Self {
        Liveness {
            watch,
            polls: 0,
            last: Instant::now(),
        }
    }

    /// Called on every `Pending`: true at once if the peer is already known dead, otherwise a
    /// syscall at most every [`POLL_CHECK_EVERY`].
    #[inline]
    pub fn maybe_dead(&mut self) -> bool {
        if self.watch.known_dead() {
            return true;
        }
        self.polls = self.polls.wrapping_add(1);
        if self.polls % POLLS_PER_CLOCK != 0 {
            return false;
        }
        self.check_if_due()
    }

    #[cold]
    fn check_if_due(&mut self) -> bool {
        let now = Instant::now();
        if now - self.last < POLL_CHECK_EVERY {
            return false;
        }
        self.last = now;
        self.watch.exited()
    }

    /// Check now (after a blocking sleep).
    pub fn dead_now(&mut self) -> bool {
        self.last = Instant::now();
        self.watch.exited()
    }

    /// See [`PeerWatch::retire`].
    pub fn retire(&self) {
        self.watch.retire();
    }
}

/// Rate limiting of the any-source watcher's liveness checks (it is shared by every thread
/// waiting on the channel: the counter and the clock are behind atomics and a `try_lock`).
#[derive(Debug)]
pub struct DeathCheck {
    polls: AtomicU32,
    last: Mutex<Instant>,
}

impl Default for DeathCheck {
    fn default() -> Self {
        DeathCheck {
            polls: AtomicU32::new(0),
            last: Mutex::new(Instant::now()),
        }
    }
}

impl DeathCheck {
    /// Poll the pidfd of every peer of `watches` not yet retired nor known dead, all in one
    /// `poll(2)`: at most every [`POLL_CHECK_EVERY`], looking at the clock every 64th call
    /// from a polling loop and at every call when `force` (after a blocking slice). Skipped
    /// when another thread is checking.
    ///
    /// A forced check is rate-limited too: on a crowded host every orderly close or message
    /// can wake a sleeper, and one poll of n pidfds per wake-up made n processes spend their
    /// time polling each other (400 ranks: 160 000 `poll` calls per round of wake-ups). A
    /// sleeper still checks at least once per [`WAIT_SLICE`], the bound on noticing a death.
    pub fn run<'w>(&self, force: bool, watches: impl IntoIterator<Item = &'w PeerWatch>) {
        if !force && self.polls.fetch_add(1, Ordering::Relaxed) % POLLS_PER_CLOCK != 0 {
            return;
        }
        let Ok(mut last) = self.last.try_lock() else {
            return;
        };
        let now = Instant::now();
        if now - *last < POLL_CHECK_EVERY {
            return;
        }
        *last = now;
        // Inline for up to 32 local peers: the receive path allocates nothing (the drivers'
        // no-allocation test), here neither.
        let mut pids: smallvec::SmallVec<[(&PidFd, &PeerWatch); 32]> = smallvec::SmallVec::new();
        for w in watches {
            if w.retired() || w.known_dead() {
                continue;
            }
            match &w.probe {
                Probe::Pid(p) => pids.push((p, w)),
                Probe::Custom(_) => {
                    w.exited();
                }
            }
        }
        let fds: smallvec::SmallVec<[&PidFd; 32]> = pids.iter().map(|(p, _)| *p).collect();
        PidFd::exited_among(&fds, &mut |i| pids[i].1.mark_dead());
    }
}
