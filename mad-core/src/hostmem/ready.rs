//! Readiness descriptors of the intra-host drivers, for event loops (epoll, mio, tokio's
//! `AsyncFd`): the driver side of [`Incoming::arm`](crate::driver::Incoming::arm) and
//! [`TxLink::arm_send`](crate::driver::TxLink::arm_send).
//!
//! Each channel of a process has an [`Endpoint`]: two Unix datagram sockets in the abstract
//! namespace, `\0<name>-r` (receive-side events: a message start, a close, a wake-up) and
//! `\0<name>-s` (progress of a send armed with `arm_send`), where `<name>` is the process's
//! segment name (unique and unguessable: pid, channel hash, rank, 64 random bits), and an epoll
//! descriptor holding both sockets and the pidfd of every local peer (readable once that
//! process exits). The epoll descriptor is the channel's readiness descriptor.
//!
//! The protocol keeps busy traffic free of system calls. The waiting side sets the [`ARMED`]
//! bit of a [`Bell`](super::Bell)'s sleeper word (its doorbell, or the writer bell of a ring
//! it is blocked on), fences, collects its sockets ([`Readiness::collect`]), and then looks at
//! its rings. A writer, after publishing, already fences and loads that word to decide on a
//! futex wake; only when the bit is set does it clear it and send one byte to the owner's
//! socket ([`Signal`], non-blocking: `EAGAIN` means the socket is readable already). So each
//! arm costs the signalling side one datagram at most, and traffic between arms nothing.
//!
//! A datagram on the send socket makes the next [`collect`](Readiness::collect) report an
//! event: an arm that drains it must not swallow the progress of a send armed before it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Once};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr};

use super::PeerWatch;

/// The bit of a bell's sleeper word that says "signal my readiness descriptor" (the count of
/// sleeping threads is in the other bits).
pub const ARMED: u32 = 1 << 31;

/// Epoll key of the receive-event socket.
const KEY_RECV: u64 = u64::MAX;
/// Epoll key of the send-progress socket.
const KEY_SEND: u64 = u64::MAX - 1;

fn to_io(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// A non-blocking datagram socket bound to `\0name`.
fn bind(name: &str) -> io::Result<OwnedFd> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Datagram,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(to_io)?;
    let addr = UnixAddr::new_abstract(name.as_bytes()).map_err(to_io)?;
    socket::bind(fd.as_raw_fd(), &addr).map_err(to_io)?;
    Ok(fd)
}

/// Read every datagram queued on `fd`; returns whether there was one.
fn drain(fd: &OwnedFd) -> bool {
    let mut buf = [0u8; 16];
    let mut any = false;
    loop {
        match socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            Ok(_) => any = true,
            Err(Errno::EINTR) => {}
            Err(_) => return any,
        }
    }
}

/// This process's sockets and epoll descriptor for one channel (see the module documentation).
#[derive(Debug)]
pub struct Endpoint {
    recv: OwnedFd,
    send: OwnedFd,
    epoll: Epoll,
}

impl Endpoint {
    /// Bind `\0<name>-r` and `\0<name>-s` and put them in a new epoll set.
    ///
    /// # Errors
    ///
    /// The socket or epoll call's error (an abstract name already bound, descriptor limits).
    pub fn open(name: &str) -> io::Result<Arc<Self>> {
        let recv = bind(&format!("{name}-r"))?;
        let send = bind(&format!("{name}-s"))?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(to_io)?;
        epoll
            .add(&recv, EpollEvent::new(EpollFlags::EPOLLIN, KEY_RECV))
            .map_err(to_io)?;
        epoll
            .add(&send, EpollEvent::new(EpollFlags::EPOLLIN, KEY_SEND))
            .map_err(to_io)?;
        Ok(Arc::new(Endpoint { recv, send, epoll }))
    }

    /// The signals towards the endpoint of the process whose segment is `name`: its
    /// receive-event socket and its send-progress socket, sent through this endpoint.
    ///
    /// # Errors
    ///
    /// The socket call's error.
    pub fn towards(self: &Arc<Self>, name: &str) -> io::Result<PeerSignals> {
        let addr = |k: &str| UnixAddr::new_abstract(format!("{name}-{k}").as_bytes());
        Ok(PeerSignals {
            recv: Signal {
                ep: self.clone(),
                to: addr("r").map_err(to_io)?,
            },
            send: Signal {
                ep: self.clone(),
                to: addr("s").map_err(to_io)?,
            },
        })
    }
}

/// One byte towards one socket of an [`Endpoint`] (a peer's, or this process's own).
#[derive(Clone, Debug)]
pub struct Signal {
    ep: Arc<Endpoint>,
    to: UnixAddr,
}

impl Signal {
    /// Send it: non-blocking, errors ignored (`EAGAIN`: the socket is readable already; a
    /// socket that is gone belongs to a channel that is gone).
    pub fn send(&self) {
        let _ = self.try_send();
    }

    fn try_send(&self) -> Result<(), Errno> {
        loop {
            match socket::sendto(
                self.ep.send.as_raw_fd(),
                &[1],
                &self.to,
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            ) {
                Err(Errno::EINTR) => continue,
                r => return r.map(drop),
            }
        }
    }
}

/// Whether the sockets of `peers` exist and can be reached from here (at open: a peer may
/// live in another network namespace, where abstract names do not reach). One `connect` of a
/// scratch socket to each peer's receive-event socket (its send-progress socket is bound at
/// the same time, in the same namespace): nothing is sent, no peer is woken.
pub fn reachable<'a>(peers: impl IntoIterator<Item = &'a PeerSignals>) -> bool {
    let Ok(probe) = socket::socket(
        AddressFamily::Unix,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    peers
        .into_iter()
        .all(|p| socket::connect(probe.as_raw_fd(), &p.recv.to).is_ok())
}

/// A channel's readiness as its open builds it, the same for every intra-host driver: the
/// signals towards every mapped peer and, when this rank has an endpoint and every peer's
/// sockets can be reached from here, its [`Readiness`]. Every rank of the host must have one,
/// or nobody arms and nobody signals: the open votes ([`PeerReadiness::ready`] is this rank's
/// vote) and then [`settle`](PeerReadiness::settle)s.
#[derive(Debug)]
pub struct PeerReadiness {
    /// Signals towards each peer, indexed by rank (`None`: this rank, another host's, or no
    /// readiness).
    pub sigs: Vec<Option<PeerSignals>>,
    /// The any-source side, if every peer can be signalled.
    pub readiness: Option<Readiness>,
}

impl PeerReadiness {
    /// Signals towards every peer of `peers` (indexed by rank; `endpoint_of` gives the
    /// segment name a peer announced), through `ep` (this rank's endpoint, bound as `name`;
    /// `None` when it could not be opened). A peer that cannot be reached leaves the channel
    /// without a readiness descriptor, never fails the open.
    pub fn connect<I, S>(
        ep: Option<&Arc<Endpoint>>,
        name: &str,
        peers: &[Option<super::MappedPeer<I, S>>],
        endpoint_of: impl Fn(&I) -> &str,
    ) -> Self {
        let mut sigs: Vec<Option<PeerSignals>> = (0..peers.len()).map(|_| None).collect();
        let mut readiness = None;
        if let Some(ep) = ep {
            let mut ok = true;
            for (r, p) in peers.iter().enumerate() {
                if let Some(p) = p {
                    match ep.towards(endpoint_of(&p.info)) {
                        Ok(s) => sigs[r] = Some(s),
                        Err(_) => ok = false,
                    }
                }
            }
            ok = ok && reachable(sigs.iter().flatten());
            let watches = peers
                .iter()
                .enumerate()
                .filter_map(|(r, p)| Some((r, p.as_ref()?.watch.clone())));
            readiness = ok
                .then(|| Readiness::new(ep.clone(), name, watches).ok())
                .flatten();
        }
        PeerReadiness { sigs, readiness }
    }

    /// This rank's vote: whether it has a readiness descriptor.
    pub fn ready(&self) -> bool {
        self.readiness.is_some()
    }

    /// After the vote: unless every rank of the host has a descriptor (`all_ready`), drop
    /// this one's and every signal.
    pub fn settle(&mut self, all_ready: bool) {
        if !all_ready {
            self.sigs.iter_mut().for_each(|s| *s = None);
            self.readiness = None;
        }
    }
}

/// Whether every rank of `local` set `bit` in the first byte of its entry of `votes` (an
/// allgather of one-byte votes; a missing or empty entry votes no).
pub fn vote(votes: &[Vec<u8>], local: &[usize], bit: u8) -> bool {
    local.iter().all(|&r| {
        votes
            .get(r)
            .and_then(|v| v.first())
            .is_some_and(|v| v & bit != 0)
    })
}

/// The two signals towards one peer: its receive-event socket (a writer rang its doorbell,
/// closed, or tore the connection down) and its send-progress socket (its reader freed room).
#[derive(Clone, Debug)]
pub struct PeerSignals {
    /// Towards the peer's receive-event socket.
    pub recv: Signal,
    /// Towards the peer's send-progress socket.
    pub send: Signal,
}

struct Watched {
    rank: usize,
    watch: Arc<PeerWatch>,
    /// Its pidfd is in the epoll set.
    registered: AtomicBool,
    /// [`Readiness::forget`] was called.
    forgotten: AtomicBool,
}

impl Watched {
    /// The core no longer watches it: its pidfd leaves the set (a dead peer's stays readable).
    fn gone(&self) -> bool {
        self.watch.retired() || self.forgotten.load(Ordering::Relaxed)
    }
}

/// The any-source side of a channel's readiness: its [`Endpoint`], the peers' pidfds in the
/// epoll set, and the pending-wake flag.
///
/// The pidfds join the set at the first arm: a program that never arms (the blocking API)
/// pays nothing per peer at open.
pub struct Readiness {
    ep: Arc<Endpoint>,
    me: Signal,
    peers: Vec<Watched>,
    woken: AtomicBool,
    registration: Once,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<usize> = self.peers.iter().map(|w| w.rank).collect();
        f.debug_struct("Readiness")
            .field("endpoint", &self.ep)
            .field("peers", &peers)
            .field("woken", &self.woken)
            .finish_non_exhaustive()
    }
}

impl Readiness {
    /// Readiness through `ep` (this process's endpoint, bound as `name`), watching the
    /// processes of `peers` (rank, watch): their pidfds join the epoll set at the first arm.
    ///
    /// # Errors
    ///
    /// The epoll or pidfd call's error.
    pub fn new(
        ep: Arc<Endpoint>,
        name: &str,
        peers: impl IntoIterator<Item = (usize, Arc<PeerWatch>)>,
    ) -> io::Result<Self> {
        let me = ep.towards(name)?.recv;
        let peers: Vec<Watched> = peers
            .into_iter()
            .map(|(rank, watch)| Watched {
                rank,
                watch,
                registered: AtomicBool::new(false),
                forgotten: AtomicBool::new(false),
            })
            .collect();
        Ok(Readiness {
            ep,
            me,
            peers,
            woken: AtomicBool::new(false),
            registration: Once::new(),
        })
    }

    /// Put the pidfds of the peers still watched in the epoll set (once). A peer whose pidfd
    /// cannot join (no pidfd support, a full set) is seen dead at the driver's own rate only.
    fn register(&self) {
        for (i, p) in self.peers.iter().enumerate() {
            if p.gone() {
                continue;
            }
            if let Some(fd) = p.watch.pidfd() {
                let ev = EpollEvent::new(EpollFlags::EPOLLIN, i as u64);
                if self.ep.epoll.add(fd, ev).is_ok() {
                    p.registered.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    /// The readiness descriptor (the epoll set).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.ep.epoll.0.as_fd()
    }

    /// Step two of an arm, after the caller set [`ARMED`] on its doorbell: drain the sockets,
    /// drop the pidfds of peers reported gone, and look for events. Returns true when
    /// something happened that the caller's own look at its rings would not show: a wake-up,
    /// progress of an armed send, a peer's exit (that peer is then known dead), an event that
    /// arrived during the collection. One `epoll_wait` with no timeout when nothing happened.
    pub fn collect(&self) -> bool {
        self.registration.call_once(|| self.register());
        let mut busy = self.woken.swap(false, Ordering::SeqCst);
        for p in &self.peers {
            if p.gone() {
                self.unregister(p);
            }
        }
        let mut evs = [EpollEvent::empty(); 16];
        loop {
            let n = match self.ep.epoll.wait(&mut evs, EpollTimeout::ZERO) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(_) => return true,
            };
            for e in &evs[..n] {
                match e.data() {
                    KEY_RECV => {
                        drain(&self.ep.recv);
                    }
                    KEY_SEND => {
                        drain(&self.ep.send);
                        busy = true;
                    }
                    i => {
                        if let Some(p) = self.peers.get(i as usize) {
                            // Marks it dead: the caller's look at its peers reports it.
                            p.watch.exited();
                            if p.gone() {
                                self.unregister(p);
                            }
                        }
                        busy = true;
                    }
                }
            }
            if n < evs.len() {
                return busy;
            }
        }
    }

    fn unregister(&self, p: &Watched) {
        if p.registered.swap(false, Ordering::Relaxed) {
            if let Some(fd) = p.watch.pidfd() {
                let _ = self.ep.epoll.delete(fd);
            }
        }
    }

    /// [`Incoming::forget`](crate::driver::Incoming::forget): stop watching `rank`'s process.
    pub fn forget(&self, rank: usize) {
        if let Some(p) = self.peers.iter().find(|p| p.rank == rank) {
            p.forgotten.store(true, Ordering::Relaxed);
            self.unregister(p);
        }
    }

    /// [`Incoming::wake`](crate::driver::Incoming::wake): the next arm says busy, and an armed
    /// descriptor becomes readable. `bell` is this process's doorbell (whose [`ARMED`] bit
    /// says whether the descriptor is armed).
    pub fn wake(&self, bell: super::Bell<'_>) {
        self.woken.store(true, Ordering::SeqCst);
        // Pairs with the arm's fence: it sees the flag, or this sees its mark.
        fence(Ordering::SeqCst);
        bell.signal_if_armed(Some(&self.me));
    }
}
