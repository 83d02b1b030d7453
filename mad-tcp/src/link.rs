//! The two halves of a connection ([`TcpTx`], [`TcpRx`]) and any-source readiness
//! ([`TcpIncoming`]).
//!
//! Sending: TM 0 (`small`, Copy) bytes are copied into a per-connection static buffer and stay
//! queued (commit is a no-op: the stream keeps order); TM 1 (`large`, Gather) sends the queued
//! bytes *and* the user's slices in one `sendmsg`. Whatever is still queued at the end of the
//! message leaves in one `send`. Receiving: a per-connection buffer absorbs headers and small
//! pieces (the first read of a message is limited to the copy threshold plus a little, so a large
//! body stays in the socket); gather pieces are scattered straight into the user's slices, with
//! the receive buffer appended as the last slice so that bytes of the next message that are
//! already in the socket come along in the same `recvmsg` instead of costing another system
//! call. In block mode, gather sends and receives wait in the kernel (no `MSG_DONTWAIT`,
//! `MSG_WAITALL` on the user's slices only), bounded by the socket timeouts.
//!
//! Event loops ([`Incoming::readiness_fd`]): the descriptor is the channel's
//! [`ReadinessSet`] (a level-triggered epoll set, as uds and via have). A send armed with
//! [`TxLink::arm_send`] adds a one-shot `EPOLLOUT` registration of a duplicate of its socket,
//! which disables itself when it fires.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::driver::{AbortOutcome, Armed, Incoming, RxLink, TmId, TxLink};
use mad_core::events::{ReadinessSet, SEND_TOKEN};
use mad_core::liveness::{ProbeGate, Teardown};
use mad_core::{Error, Result};
use smallvec::SmallVec;

use crate::sys::{self, Interest, IOV_MAX};

/// Map an I/O failure on the connection to `peer` into the core's error.
fn lost(peer: usize, e: io::Error) -> Error {
    Error::ConnectionLost {
        rank: peer,
        source: e,
    }
}

/// The cause of the teardown [`Incoming::shutdown`] records on every connection.
const CLOSED: &str = "the channel was closed";

/// Judges whether the peer of a connection is still reachable; shared by the connection's two
/// halves and the any-source watcher, consulted only when a thread waits (never on the fast
/// path).
///
/// The rule: the peer is unreachable when nothing (data or acknowledgement) has come from it for
/// the channel's liveness bound **while the kernel waits for an answer** (retransmissions of
/// unacknowledged data, or window/keepalive probes), and still so a moment later (a probe may be
/// in flight when we look). A live receiver that is computing instead of reading keeps its
/// window closed but answers the kernel's zero-window probes: it is slow, not dead, and its
/// sender keeps waiting. Idle connections are covered by keepalive (`sys::set_keepalive`).
pub(crate) struct Liveness {
    sock: Arc<TcpStream>,
    peer: usize,
    bound: Duration,
    /// Why the peer was judged unreachable, once it was.
    lost: OnceLock<String>,
    check: Mutex<LiveCheck>,
    /// Set when one half tore the connection down (an abandoned message): both halves fail.
    torn: Teardown,
}

struct LiveCheck {
    /// No look at the kernel before this.
    next: Option<Instant>,
    /// When the peer was first seen silent with an answer outstanding.
    suspect_since: Option<Instant>,
}

impl Liveness {
    pub(crate) fn new(sock: Arc<TcpStream>, peer: usize, bound: Duration) -> Arc<Self> {
        Arc::new(Liveness {
            sock,
            peer,
            bound,
            lost: OnceLock::new(),
            torn: Teardown::new(),
            check: Mutex::new(LiveCheck {
                next: None,
                suspect_since: None,
            }),
        })
    }

    /// How often a waiting thread looks at the kernel's view of the connection.
    fn every(&self) -> Duration {
        (self.bound / 8).clamp(Duration::from_millis(10), Duration::from_millis(250))
    }

    /// How long the verdict must hold before it is final.
    fn confirm(&self) -> Duration {
        (self.bound / 4).min(Duration::from_secs(1))
    }

    fn unreachable(cause: &str) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, cause.to_string())
    }

    /// `Err` once the peer is judged unreachable (the socket is then shut down, so every other
    /// waiter on it wakes up and fails too). Cheap when called often: the kernel is asked at
    /// most every [`every`](Self::every).
    pub(crate) fn check(&self) -> io::Result<()> {
        if let Some(cause) = self.lost.get() {
            return Err(Self::unreachable(cause));
        }
        let Ok(mut st) = self.check.try_lock() else {
            return Ok(()); // another thread is looking right now
        };
        let now = Instant::now();
        if st.next.is_some_and(|t| now < t) {
            return Ok(());
        }
        st.next = Some(now + self.every());
        let Ok(k) = sys::tcp_state(self.sock.as_raw_fd()) else {
            return Ok(()); // the next send or receive reports what is wrong with the socket
        };
        if !(k.established && k.unanswered && k.silent >= self.bound) {
            st.suspect_since = None;
            return Ok(());
        }
        let since = *st.suspect_since.get_or_insert(now);
        if now.duration_since(since) < self.confirm() {
            return Ok(());
        }
        let cause = self.lost.get_or_init(|| {
            let [retrans, probes, backoff, unacked, rto] = k.raw;
            format!(
                "rank {} unreachable: nothing received for {} ms while the kernel waited for \
                 an acknowledgement (liveness bound {} ms; retransmissions {retrans}, probes \
                 {probes}, backoff {backoff}, unacknowledged segments {unacked}, rto {} ms)",
                self.peer,
                k.silent.as_millis(),
                self.bound.as_millis(),
                rto / 1000
            )
        });
        let _ = self.sock.shutdown(Shutdown::Both);
        Err(Self::unreachable(cause))
    }

    /// Tear the connection down in both directions (an abandoned message left the stream out
    /// of step): reset it, so the peer's blocked and later sends and receives fail at once,
    /// and make both local halves fail from now on.
    fn tear_down(&self, cause: &str) {
        if self.torn.tear(cause) {
            sys::reset(self.sock.as_raw_fd());
        }
    }

    /// `e`, or the liveness verdict when there is one (a socket we shut down ourselves fails
    /// with `EPIPE` or end of stream, which would hide the real cause).
    fn explain(&self, e: io::Error) -> io::Error {
        match self.lost.get() {
            Some(cause) => Self::unreachable(cause),
            None => e,
        }
    }
}

/// The sending half of a connection.
pub struct TcpTx {
    /// Keeps `fd` open.
    _sock: Arc<TcpStream>,
    fd: RawFd,
    peer: usize,
    buf: Box<[u8]>,
    /// First queued byte not yet sent.
    head: usize,
    /// End of the queued bytes.
    tail: usize,
    /// Bytes of the current `send_refs` group already sent (cursor across `Pending`).
    refs_done: usize,
    /// Some byte of the current message has left.
    started: bool,
    /// Block mode: gather sends wait in the kernel until everything is queued (not while
    /// the caller must not wait: [`TxLink::set_nonblocking`]).
    bulk_blocking: bool,
    /// The channel is in block mode.
    block_mode: bool,
    /// Bytes the kernel accepted so far (the progress mark).
    moved: u64,
    live: Arc<Liveness>,
    broken: Option<String>,
    /// Rate limit of the peer-gone probe in `begin_message`.
    gate: ProbeGate,
    events: Arc<ReadinessSet>,
    /// A duplicate of the socket for the one-shot `EPOLLOUT` registration of
    /// [`arm_send`](TxLink::arm_send) (the socket itself is registered for input), made at
    /// the first arming; `true` once registered.
    send_fd: Option<(TcpStream, bool)>,
}

/// The peer, the descriptor and the counts; never the bytes.
impl std::fmt::Debug for TcpTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTx")
            .field("peer", &self.peer)
            .field("fd", &self.fd)
            .field("queued", &(self.tail - self.head))
            .field("moved", &self.moved)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl TcpTx {
    pub(crate) fn new(
        sock: Arc<TcpStream>,
        peer: usize,
        buf_len: usize,
        bulk_blocking: bool,
        live: Arc<Liveness>,
        events: Arc<ReadinessSet>,
    ) -> Self {
        TcpTx {
            events,
            send_fd: None,
            live,
            bulk_blocking,
            block_mode: bulk_blocking,
            fd: sock.as_raw_fd(),
            _sock: sock,
            peer,
            buf: vec![0u8; buf_len].into_boxed_slice(),
            head: 0,
            tail: 0,
            refs_done: 0,
            started: false,
            moved: 0,
            broken: None,
            gate: ProbeGate::new(),
        }
    }

    #[inline]
    fn check(&self) -> Result<()> {
        match &self.broken {
            None => self.live.torn.check(self.peer),
            Some(cause) => Err(Error::Poisoned {
                rank: self.peer,
                cause: cause.as_str().into(),
            }),
        }
    }

    fn fail(&mut self, e: io::Error) -> Error {
        if self.live.torn.is_torn() {
            return self.live.torn.error(self.peer);
        }
        let e = self.live.explain(e);
        self.broken = Some(e.to_string());
        lost(self.peer, e)
    }

    /// Write the queued bytes out; `Ready` once none is left.
    fn write_queued(&mut self) -> Result<Poll<()>> {
        while self.head < self.tail {
            match sys::send(self.fd, &self.buf[self.head..self.tail]) {
                Ok(Some(n)) => {
                    self.started = true;
                    self.moved += n as u64;
                    self.head += n;
                }
                Ok(None) => return Ok(Poll::Pending),
                Err(e) => return Err(self.fail(e)),
            }
        }
        self.head = 0;
        self.tail = 0;
        Ok(Poll::Ready(()))
    }
}

impl TxLink for TcpTx {
    fn set_nonblocking(&mut self, on: bool) {
        self.bulk_blocking = self.block_mode && !on;
    }

    fn begin_message(&mut self) -> Result<()> {
        self.check()?;
        // A peer that died (or closed) while we were idle: its FIN or reset is here, and the
        // message would vanish into its dead socket. Asked at most once per clock tick.
        if self.gate.due() && sys::hung_up(self.fd) {
            self.broken = Some("the peer closed the connection".into());
            return Err(Error::PeerClosed { rank: self.peer });
        }
        self.started = false;
        self.refs_done = 0;
        Ok(())
    }

    #[inline]
    fn with_buffer(
        &mut self,
        _tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.check()?;
        if self.tail == self.buf.len() && self.write_queued()?.is_pending() {
            return Ok(Poll::Pending);
        }
        if self.head == self.tail {
            self.head = 0;
            self.tail = 0;
        }
        let room = &mut self.buf[self.tail..];
        let n = fill(room).min(room.len());
        self.tail += n;
        if self.tail == self.buf.len() {
            // Full: start writing it out now (whatever the socket takes).
            let _ = self.write_queued()?;
        }
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, _tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.check()?;
        let total: usize = iov.iter().map(|s| s.len()).sum();
        loop {
            let queued = self.tail - self.head;
            if queued == 0 && self.refs_done >= total {
                self.refs_done = 0;
                self.head = 0;
                self.tail = 0;
                return Ok(Poll::Ready(()));
            }
            // Inline room for 16 pieces and the queued bytes: no allocation up to 16 pieces.
            let mut v: SmallVec<[IoSlice<'_>; 18]> = SmallVec::new();
            if queued > 0 {
                v.push(IoSlice::new(&self.buf[self.head..self.tail]));
            }
            let mut skip = self.refs_done;
            for s in iov {
                if v.len() == IOV_MAX {
                    break;
                }
                if skip >= s.len() {
                    skip -= s.len();
                    continue;
                }
                v.push(IoSlice::new(&s[skip..]));
                skip = 0;
            }
            let res = sys::send_vectored(self.fd, &v, self.bulk_blocking);
            drop(v);
            match res {
                Ok(Some(n)) => {
                    self.started = true;
                    self.moved += n as u64;
                    let from_buf = n.min(queued);
                    self.head += from_buf;
                    self.refs_done += n - from_buf;
                }
                Ok(None) => return Ok(Poll::Pending),
                Err(e) => return Err(self.fail(e)),
            }
        }
    }

    #[inline]
    fn end_message(&mut self) -> Result<Poll<()>> {
        self.check()?;
        self.write_queued()
    }

    fn flush(&mut self) -> Result<Poll<()>> {
        self.check()?;
        self.write_queued()
    }

    fn abort_message(&mut self) -> AbortOutcome {
        if !self.started && self.broken.is_none() {
            self.head = 0;
            self.tail = 0;
            self.refs_done = 0;
            return AbortOutcome::Discarded;
        }
        // Part of the message is in the stream: reset the connection, so the peer's receive
        // fails instead of waiting for the rest, and its sends fail too.
        let cause = "a message was abandoned after part of it was sent";
        self.live.tear_down(cause);
        self.head = 0;
        self.tail = 0;
        self.refs_done = 0;
        if self.broken.is_none() {
            self.broken = Some(cause.into());
        }
        AbortOutcome::Broken
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        if let Err(e) = self.live.check() {
            return Err(self.fail(e));
        }
        sys::poll_one(self.fd, Interest::Write, timeout)
            .map(|_| ())
            .map_err(|e| self.fail(e))
    }

    fn progress_mark(&self) -> u64 {
        self.moved
    }

    fn arm_send(&mut self) -> Result<Armed> {
        if self.check().is_err() || self.live.check().is_err() {
            return Ok(Armed::Busy); // the send call reports it
        }
        if self.send_fd.is_none() {
            let dup = self
                ._sock
                .try_clone()
                .map_err(|e| Error::io("tcp: duplicating a socket for arm_send", e))?;
            self.send_fd = Some((dup, false));
        }
        let Some((dup, registered)) = &mut self.send_fd else {
            return Ok(Armed::Busy);
        };
        self.events.register_once(
            dup.as_fd(),
            true,
            false,
            SEND_TOKEN | self.peer as u64,
            *registered,
        )?;
        *registered = true;
        // Armed first, then look: room that came meanwhile has fired the registration too.
        match sys::poll_one(self.fd, Interest::Write, Duration::ZERO) {
            Ok(false) => Ok(Armed::Armed),
            _ => Ok(Armed::Busy),
        }
    }
}

impl Drop for TcpTx {
    fn drop(&mut self) {
        // The registration would outlive the duplicate (it belongs to the socket, which the
        // receiving half keeps open).
        if let Some((dup, true)) = &self.send_fd {
            self.events.unregister(dup.as_fd());
        }
    }
}

/// The receiving half of a connection.
pub struct TcpRx {
    /// Keeps `fd` open.
    _sock: Arc<TcpStream>,
    fd: RawFd,
    peer: usize,
    buf: Box<[u8]>,
    /// First unconsumed buffered byte.
    head: usize,
    /// End of buffered bytes.
    tail: usize,
    /// Bytes of the current `recv_refs` group already in place.
    refs_done: usize,
    /// Most bytes `poll_message` reads at the start of a message.
    first_read: usize,
    /// Block mode: gather receives wait in the kernel for the whole group (not while the
    /// caller must not wait: [`RxLink::set_nonblocking`]).
    bulk_blocking: bool,
    /// The channel is in block mode.
    block_mode: bool,
    /// The channel's readiness set, which stops reporting the connection once it is over.
    watch: Arc<ReadinessSet>,
    /// Bytes received so far (the progress mark).
    moved: u64,
    live: Arc<Liveness>,
    broken: Option<String>,
}

/// The peer, the descriptor and the counts; never the bytes.
impl std::fmt::Debug for TcpRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRx")
            .field("peer", &self.peer)
            .field("fd", &self.fd)
            .field("buffered", &(self.tail - self.head))
            .field("moved", &self.moved)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl TcpRx {
    pub(crate) fn new(
        sock: Arc<TcpStream>,
        peer: usize,
        buf_len: usize,
        first_read: usize,
        bulk_blocking: bool,
        watch: Arc<ReadinessSet>,
        live: Arc<Liveness>,
    ) -> Self {
        TcpRx {
            live,
            bulk_blocking,
            block_mode: bulk_blocking,
            fd: sock.as_raw_fd(),
            _sock: sock,
            peer,
            buf: vec![0u8; buf_len].into_boxed_slice(),
            head: 0,
            tail: 0,
            refs_done: 0,
            first_read: first_read.clamp(64, buf_len.max(64)),
            watch,
            moved: 0,
            broken: None,
        }
    }

    /// The connection is over for reading: stop reporting it to any-source receptions (a
    /// hung-up socket stays readable, which would keep the set readable and every waiter
    /// spinning).
    fn deregister(&mut self) {
        self.watch.forget(self.peer);
    }

    #[inline]
    fn check(&mut self) -> Result<()> {
        match &self.broken {
            None if self.live.torn.is_torn() => Err(self.torn()),
            None => Ok(()),
            Some(cause) => Err(Error::Poisoned {
                rank: self.peer,
                cause: cause.as_str().into(),
            }),
        }
    }

    /// The connection was torn down (by this half or the sending one).
    #[cold]
    fn torn(&mut self) -> Error {
        self.deregister();
        let e = self.live.torn.error(self.peer);
        self.broken = Some(e.to_string());
        e
    }

    fn closed(&mut self) -> Error {
        if self.live.torn.is_torn() {
            return self.torn();
        }
        self.deregister();
        match self.live.lost.get() {
            // We shut the socket down ourselves: the peer did not close it.
            Some(_) => self.fail(io::Error::from(io::ErrorKind::UnexpectedEof)),
            None => Error::PeerClosed { rank: self.peer },
        }
    }

    fn fail(&mut self, e: io::Error) -> Error {
        if self.live.torn.is_torn() {
            return self.torn();
        }
        self.deregister();
        let e = self.live.explain(e);
        self.broken = Some(e.to_string());
        lost(self.peer, e)
    }

    /// One non-blocking `recv` of at most `limit` bytes into the (empty) buffer.
    #[inline]
    fn fill(&mut self, limit: usize) -> Result<Poll<()>> {
        self.head = 0;
        self.tail = 0;
        let n = limit.min(self.buf.len());
        match sys::recv(self.fd, &mut self.buf[..n]) {
            Ok(Some(0)) => Err(self.closed()),
            Ok(Some(n)) => {
                self.tail = n;
                Ok(Poll::Ready(()))
            }
            Ok(None) => Ok(Poll::Pending),
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// Copy `src` into `iov`, starting `offset` bytes into the group; returns the bytes copied.
fn scatter(src: &[u8], iov: &mut [IoSliceMut<'_>], offset: usize) -> usize {
    let mut skip = offset;
    let mut done = 0;
    for d in iov.iter_mut() {
        if done == src.len() {
            break;
        }
        if skip >= d.len() {
            skip -= d.len();
            continue;
        }
        let dst = &mut d[skip..];
        skip = 0;
        let n = dst.len().min(src.len() - done);
        dst[..n].copy_from_slice(&src[done..done + n]);
        done += n;
    }
    done
}

impl RxLink for TcpRx {
    fn set_nonblocking(&mut self, on: bool) {
        self.bulk_blocking = self.block_mode && !on;
    }

    #[inline]
    fn poll_message(&mut self) -> Result<Poll<()>> {
        self.check()?;
        if self.head < self.tail {
            return Ok(Poll::Ready(()));
        }
        // The start of a message: read only what small messages need, so that a large gather
        // piece that follows lands straight in user memory instead of being copied out of
        // the buffer.
        self.fill(self.first_read)
    }

    #[inline]
    fn with_data(
        &mut self,
        _tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.check()?;
        if self.head == self.tail && self.fill(usize::MAX)?.is_pending() {
            return Ok(Poll::Pending);
        }
        let avail = self.tail - self.head;
        let n = take(&self.buf[self.head..self.tail]).min(avail);
        self.head += n;
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, _tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        self.check()?;
        let total: usize = iov.iter().map(|s| s.len()).sum();
        loop {
            if self.refs_done >= total {
                self.refs_done = 0;
                return Ok(Poll::Ready(()));
            }
            if self.head < self.tail {
                let n = scatter(&self.buf[self.head..self.tail], iov, self.refs_done);
                self.head += n;
                self.refs_done += n;
                continue;
            }
            // Buffer empty: read straight into the user's remaining slices, then into our
            // buffer (bytes past the group belong to the next message and stay buffered).
            self.head = 0;
            self.tail = 0;
            let remaining = total - self.refs_done;
            let fd = self.fd;
            let res = {
                // Inline room for 16 pieces and the receive buffer.
                let mut v: SmallVec<[IoSliceMut<'_>; 18]> = SmallVec::new();
                let mut skip = self.refs_done;
                for s in iov.iter_mut() {
                    if v.len() == IOV_MAX - 1 {
                        break;
                    }
                    if skip >= s.len() {
                        skip -= s.len();
                        continue;
                    }
                    v.push(IoSliceMut::new(&mut s[skip..]));
                    skip = 0;
                }
                if self.bulk_blocking {
                    // Block mode: wait in the kernel for the whole group, like a blocking
                    // read loop would (the next message stays in the socket).
                    sys::recv_vectored(fd, &mut v, true)
                } else {
                    v.push(IoSliceMut::new(&mut self.buf[..]));
                    sys::recv_vectored(fd, &mut v, false)
                }
            };
            match res {
                Ok(Some(0)) => return Err(self.closed()),
                Ok(Some(n)) => {
                    self.moved += n as u64;
                    let user = n.min(remaining);
                    self.refs_done += user;
                    self.tail = n - user;
                }
                Ok(None) => return Ok(Poll::Pending),
                Err(e) => return Err(self.fail(e)),
            }
        }
    }

    fn abort_message(&mut self) {
        // The rest of the message is still in the stream: reset the connection, so the
        // sender's blocked and later sends fail (a `shutdown(SHUT_RD)` would tell it
        // nothing: it would wait for room forever, or its sends would vanish).
        let cause = "a message was abandoned midway by the receiver; the stream is out of step";
        self.deregister();
        self.live.tear_down(cause);
        self.head = 0;
        self.tail = 0;
        self.refs_done = 0;
        if self.broken.is_none() {
            self.broken = Some(cause.into());
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        if self.head < self.tail || self.broken.is_some() || self.live.torn.is_torn() {
            return Ok(());
        }
        if let Err(e) = self.live.check() {
            return Err(self.fail(e));
        }
        sys::poll_one(self.fd, Interest::Read, timeout)
            .map(|_| ())
            .map_err(|e| self.fail(e))
    }

    fn progress_mark(&self) -> u64 {
        self.moved
    }
}

impl Drop for TcpRx {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// Any-source readiness.
///
/// With few peers (at most the direct-poll limit) the core polls each connection itself and
/// only asks this object to *block*; then a `poll(2)` over the sockets and the wake-up eventfd
/// is used and the sockets are in no epoll set until an event loop asks for the readiness
/// descriptor (an epoll registration costs a callback on every incoming segment, measurable
/// on the 8-byte latency). With more peers, a level-triggered epoll set holds every
/// connection, and is also the readiness descriptor.
pub struct TcpIncoming {
    /// Whether any-source polls and waits use the epoll set (many peers) or `poll(2)`.
    epoll: bool,
    /// Every connection, in the order of the set's peers (for liveness and shutdown).
    list: Vec<Watched>,
    ready: Arc<ReadinessSet>,
}

impl std::fmt::Debug for TcpIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpIncoming")
            .field("epoll", &self.epoll)
            .field("ready", &self.ready)
            .finish_non_exhaustive()
    }
}

/// One connection of the channel, as the any-source watcher sees it.
pub(crate) struct Watched {
    pub(crate) peer: usize,
    pub(crate) sock: Arc<TcpStream>,
    pub(crate) live: Arc<Liveness>,
}

impl TcpIncoming {
    /// Readiness for the channel's connections; `use_epoll` for many peers (the set is then
    /// made now: the any-source waits use it).
    pub(crate) fn new(use_epoll: bool, list: Vec<Watched>) -> Result<Self> {
        let dup = |w: &Watched| {
            w.sock
                .try_clone()
                .map(|s| (w.peer, vec![OwnedFd::from(s)]))
                .map_err(|e| {
                    Error::io(format!("tcp: duplicating the socket of rank {}", w.peer), e)
                })
        };
        let peers = list.iter().map(dup).collect::<Result<Vec<_>>>()?;
        let ready = Arc::new(ReadinessSet::new("tcp", peers)?);
        if use_epoll {
            ready.make()?;
        }
        Ok(TcpIncoming {
            epoll: use_epoll,
            list,
            ready,
        })
    }

    /// The connections, in the order of rank.
    pub(crate) fn connections(&self) -> &[Watched] {
        &self.list
    }

    /// The channel's readiness set, for the connections' halves.
    pub(crate) fn ready(&self) -> Arc<ReadinessSet> {
        self.ready.clone()
    }

    /// Before blocking: judge the liveness of every connection still watched. A peer found
    /// unreachable has its socket shut down, which makes it readable: the core then receives
    /// from it and gets the error.
    fn check_liveness(&self) {
        for (i, w) in self.list.iter().enumerate() {
            if !self.ready.is_forgotten(i) {
                let _ = w.live.check();
            }
        }
    }

    fn any(&self, timeout: Duration, ready: &mut dyn FnMut(usize)) -> Result<()> {
        let woken = if self.epoll {
            self.ready.wait(timeout, ready)?
        } else {
            self.ready.poll_peers(timeout, ready)?
        };
        if woken {
            self.ready.drain_wake();
        }
        Ok(())
    }
}

impl Incoming for TcpIncoming {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        self.any(Duration::ZERO, ready)
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        self.check_liveness();
        self.any(timeout, &mut |_| {})
    }

    fn wake(&self) {
        self.ready.wake();
    }

    fn forget(&self, rank: usize) {
        self.ready.forget(rank);
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ready.readiness_fd()
    }

    fn arm(&self) -> Result<Armed> {
        // The sockets join the set until the matching `disarm` (a set holding a socket costs
        // a kernel callback per incoming segment, which busy traffic should not pay).
        self.ready.arm_peers()?;
        // A peer found unreachable is shut down here, which makes its socket readable.
        self.check_liveness();
        // Clear, then look: the set is level-triggered, so looking consumes nothing but the
        // one-shot events of armed sends (which make this arm `Busy`), and anything that
        // happens after the drain makes the set readable again.
        self.ready.drain_wake();
        let busy = match self.ready.any_ready() {
            Ok(b) => b,
            Err(e) => {
                self.ready.disarm();
                return Err(e);
            }
        };
        Ok(if busy {
            self.ready.disarm();
            Armed::Busy
        } else {
            Armed::Armed
        })
    }

    fn disarm(&self) {
        self.ready.disarm();
    }

    fn shutdown(&self) {
        for w in &self.list {
            // Both halves fail from now on (without a reset: the close is clean), then the
            // shutdown sends the FIN (the peer sees this process leave) and wakes every thread
            // blocked on the socket: `poll` for input or room, a blocking send or receive.
            w.live.torn.tear(CLOSED);
            let _ = w.sock.shutdown(Shutdown::Both);
        }
        self.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_offsets() {
        let mut a = [0u8; 3];
        let mut b = [0u8; 4];
        {
            let mut iov = [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)];
            assert_eq!(scatter(&[1, 2], &mut iov, 0), 2);
            assert_eq!(scatter(&[3, 4, 5, 6, 7, 8], &mut iov, 2), 5);
        }
        assert_eq!(a, [1, 2, 3]);
        assert_eq!(b, [4, 5, 6, 7]);
    }
}
