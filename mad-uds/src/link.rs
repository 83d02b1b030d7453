//! The links: one non-blocking stream per peer, a copy buffer per direction, `poll(2)` waits.
//!
//! Event loops: the readiness descriptor is an epoll set of the watcher's duplicates of the
//! streams and of the wake-up pipe, made when first asked for (blocking programs never pay
//! for it). A send armed with `arm_send` registers its own descriptor, one-shot, for room.

use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use mad_core::driver::{
    AbortOutcome, Armed, Incoming, LinkPair, OpenedChannel, RxLink, TmId, TxLink,
};
use mad_core::events::{ReadinessSet, SEND_TOKEN};
use mad_core::liveness::{ProbeGate, Teardown};
use mad_core::{Error, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use smallvec::SmallVec;

use crate::MAX_GROUP;

/// Build the channel from connected streams.
pub fn open(streams: Vec<Option<UnixStream>>, buf: usize) -> Result<OpenedChannel> {
    let dup = |s: &UnixStream| s.try_clone().map_err(|e| Error::io("uds: dup", e));
    let mut watched = Vec::new();
    let mut in_set = Vec::new();
    for (peer, s) in streams.iter().enumerate() {
        if let Some(s) = s {
            watched.push(Watched {
                s: dup(s)?,
                torn: Arc::new(Teardown::new()),
            });
            in_set.push((peer, vec![OwnedFd::from(dup(s)?)]));
        }
    }
    let watch = Arc::new(Watch {
        watched,
        ready: ReadinessSet::new("uds", in_set)?,
    });
    let mut links = Vec::with_capacity(streams.len());
    let mut torn = watch.watched.iter().map(|w| w.torn.clone());
    for (peer, s) in streams.into_iter().enumerate() {
        let Some(s) = s else {
            links.push(None);
            continue;
        };
        let torn = torn.next().expect("one watched entry per stream");
        let tx = Tx {
            torn: torn.clone(),
            gate: ProbeGate::new(),
            peer,
            s: dup(&s)?,
            buf: vec![0; buf],
            len: 0,
            off: 0,
            done: 0,
            wrote: false,
            watch: watch.clone(),
            armed_once: false,
        };
        let rx = Rx {
            torn,
            peer,
            s,
            buf: vec![0; buf],
            start: 0,
            end: 0,
            done: 0,
        };
        links.push(Some(LinkPair {
            tx: Box::new(tx),
            rx: Box::new(rx),
        }));
    }
    Ok(OpenedChannel::new(links, Box::new(Incomings(watch)))
        .with_notes(vec![format!("uds: {buf} B copy buffers, poll(2) progress")]))
}

fn lost(peer: usize, e: std::io::Error) -> Error {
    match e.kind() {
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => Error::PeerClosed { rank: peer },
        _ => Error::ConnectionLost {
            rank: peer,
            source: e,
        },
    }
}

/// Tear the connection down for both ends: `shutdown(SHUT_RDWR)` of a Unix stream socket
/// also shuts the peer's socket (its sends fail with `EPIPE` at once, blocked ones included,
/// and its receives see end of stream after what was already queued).
fn tear_down(s: &UnixStream, torn: &Teardown, cause: &str) {
    if torn.tear(cause) {
        let _ = s.shutdown(Shutdown::Both);
    }
}

/// Zero-timeout `poll(2)`: did the peer close (`POLLRDHUP`/`POLLHUP`) or fail (`POLLERR`)?
/// Our protocol never half-closes a live connection: a hang-up means the peer is gone.
fn hung_up(fd: BorrowedFd<'_>) -> bool {
    // Only `POLLRDHUP` is asked for; `POLLHUP` and `POLLERR` come unasked: any event is a
    // hang-up. (`PollFd::revents` cannot be used: nix maps unknown bits such as `POLLRDHUP`
    // to `None`.)
    let mut fds = [PollFd::new(
        fd,
        PollFlags::from_bits_retain(nix::libc::POLLRDHUP),
    )];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// Block in `poll(2)` until `fd` has `ev` (or an error/hang-up) or `timeout` passes.
fn wait_fd(fd: BorrowedFd<'_>, ev: PollFlags, timeout: Duration) -> Result<()> {
    let mut fds = [PollFd::new(fd, ev)];
    match poll(&mut fds, ms(timeout)) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(Error::io("uds: poll", e.into())),
    }
}

fn ms(t: Duration) -> PollTimeout {
    PollTimeout::from(t.as_micros().div_ceil(1000).min(u16::MAX as u128) as u16)
}

struct Tx {
    /// Shared with the receiving half: set when either tore the connection down.
    torn: Arc<Teardown>,
    /// Rate limit of the peer-gone probe of `begin_message`.
    gate: ProbeGate,
    peer: usize,
    s: UnixStream,
    /// Copy buffer: `buf[off..len]` is filled but not yet written.
    buf: Vec<u8>,
    len: usize,
    off: usize,
    /// Bytes of the current gather group already written (partial progress across `Pending`).
    done: usize,
    /// Whether any byte of the current message has left.
    wrote: bool,
    /// The channel's watcher, whose epoll set `arm_send` registers this descriptor in.
    watch: Arc<Watch>,
    /// This descriptor was added to the set (later armings re-enable it).
    armed_once: bool,
}

impl Tx {
    /// Write the pending copy bytes, then `iov` from `self.done` on, in one `writev` when
    /// possible. `Ready` once everything is out.
    fn push(&mut self, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.torn.check(self.peer)?;
        loop {
            let mut v: SmallVec<[IoSlice<'_>; MAX_GROUP + 1]> = SmallVec::new();
            if self.off < self.len {
                v.push(IoSlice::new(&self.buf[self.off..self.len]));
            }
            let mut skip = self.done;
            for s in iov {
                if skip >= s.len() {
                    skip -= s.len();
                } else {
                    v.push(IoSlice::new(&s[skip..]));
                    skip = 0;
                }
            }
            if v.is_empty() {
                self.off = 0;
                self.len = 0;
                self.done = 0;
                return Ok(Poll::Ready(()));
            }
            match self.s.write_vectored(&v) {
                Ok(0) => return Err(ended(&self.torn, self.peer)),
                Ok(mut n) => {
                    self.wrote = true;
                    let from_buf = n.min(self.len - self.off);
                    self.off += from_buf;
                    n -= from_buf;
                    self.done += n;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Poll::Pending),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
        }
    }
}

/// End of stream on the socket: the peer closed, unless this side's own close shut the socket
/// under a call that had already checked (then the close's error, as for any later call).
fn ended(torn: &Teardown, peer: usize) -> Error {
    if torn.is_torn() {
        torn.error(peer)
    } else {
        Error::PeerClosed { rank: peer }
    }
}

impl TxLink for Tx {
    fn begin_message(&mut self) -> Result<()> {
        self.torn.check(self.peer)?;
        // A peer gone while we were idle: asked at most once per clock tick.
        if self.gate.due() && hung_up(self.s.as_fd()) {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        self.wrote = false;
        Ok(())
    }

    fn with_buffer(
        &mut self,
        _tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        if self.len == self.buf.len() && self.push(&[])?.is_pending() {
            return Ok(Poll::Pending);
        }
        let n = fill(&mut self.buf[self.len..]);
        self.len += n.min(self.buf.len() - self.len);
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, _tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.push(iov)
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        self.push(&[])
    }

    fn flush(&mut self) -> Result<Poll<()>> {
        self.push(&[])
    }

    fn abort_message(&mut self) -> AbortOutcome {
        self.off = 0;
        self.len = 0;
        self.done = 0;
        if self.wrote {
            // The peer's receive fails instead of waiting for the rest; its sends fail too.
            tear_down(
                &self.s,
                &self.torn,
                "a message was abandoned after part of it was sent",
            );
            AbortOutcome::Broken
        } else {
            AbortOutcome::Discarded
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        wait_fd(self.s.as_fd(), PollFlags::POLLOUT, timeout)
    }

    fn arm_send(&mut self) -> Result<Armed> {
        if self.torn.is_torn() {
            return Ok(Armed::Busy);
        }
        // One-shot: the registration disables itself when it fires, so a socket with room
        // does not keep the set readable. This descriptor is ours alone (the watcher
        // registers its own duplicate for input).
        self.watch.ready.register_once(
            self.s.as_fd(),
            true,
            false,
            SEND_TOKEN | self.peer as u64,
            self.armed_once,
        )?;
        self.armed_once = true;
        // Armed first, then look: room that came meanwhile has fired the registration too.
        let mut fds = [PollFd::new(self.s.as_fd(), PollFlags::POLLOUT)];
        Ok(match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => Armed::Armed,
            _ => Armed::Busy,
        })
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        // The registration belongs to the socket, which other descriptors keep open.
        if self.armed_once {
            self.watch.ready.unregister(self.s.as_fd());
        }
        // The receive half and the readiness watcher hold duplicates of the descriptor: say
        // goodbye explicitly so the peer sees end-of-file now.
        let _ = self.s.shutdown(Shutdown::Write);
    }
}

struct Rx {
    /// Shared with the sending half.
    torn: Arc<Teardown>,
    peer: usize,
    s: UnixStream,
    /// Read-ahead buffer: `buf[start..end]` is received and not yet consumed.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes of the current gather group already in place.
    done: usize,
}

impl Rx {
    /// Read what is available into the buffer; `false` if nothing was.
    fn fill(&mut self) -> Result<bool> {
        self.torn.check(self.peer)?;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        loop {
            match self.s.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(ended(&self.torn, self.peer)),
                Ok(n) => {
                    self.end += n;
                    return Ok(true);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
        }
    }
}

impl RxLink for Rx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        if self.start < self.end || self.fill()? {
            Ok(Poll::Ready(()))
        } else {
            Ok(Poll::Pending)
        }
    }

    fn with_data(
        &mut self,
        _tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        if self.start == self.end && !self.fill()? {
            return Ok(Poll::Pending);
        }
        let n = take(&self.buf[self.start..self.end]);
        self.start += n.min(self.end - self.start);
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, _tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        self.torn.check(self.peer)?;
        let total: usize = iov.iter().map(|s| s.len()).sum();
        loop {
            // Bytes read ahead into the buffer go first, then `readv` straight into place.
            let mut skip = self.done;
            let mut v: SmallVec<[IoSliceMut<'_>; MAX_GROUP]> = SmallVec::new();
            for s in iov.iter_mut() {
                if skip >= s.len() {
                    skip -= s.len();
                } else {
                    v.push(IoSliceMut::new(&mut s[skip..]));
                    skip = 0;
                }
            }
            if v.is_empty() {
                self.done = 0;
                return Ok(Poll::Ready(()));
            }
            if self.start < self.end {
                let dst = &mut v[0];
                let n = dst.len().min(self.end - self.start);
                dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                self.done += n;
                continue;
            }
            match self.s.read_vectored(&mut v) {
                Ok(0) => return Err(ended(&self.torn, self.peer)),
                Ok(n) => self.done += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Poll::Pending),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.peer, e)),
            }
            debug_assert!(self.done <= total);
        }
    }

    fn abort_message(&mut self) {
        self.start = 0;
        self.end = 0;
        self.done = 0;
        // The rest of the message is in the stream: close the connection both ways, so the
        // sender's blocked and later sends fail (`SHUT_RD` alone told it nothing).
        tear_down(
            &self.s,
            &self.torn,
            "a message was abandoned midway by the receiver; the stream is out of step",
        );
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        wait_fd(self.s.as_fd(), PollFlags::POLLIN, timeout)
    }
}

/// Any-source readiness: the channel's [`ReadinessSet`] (`poll(2)` over every peer's descriptor
/// and the wake-up socket; the epoll set of the same for event loops).
struct Watch {
    watched: Vec<Watched>,
    ready: ReadinessSet,
}

struct Watched {
    /// A duplicate of the connection's stream.
    s: UnixStream,
    /// Shared with the connection's halves.
    torn: Arc<Teardown>,
}

/// The channel's [`Incoming`] (the watcher is shared with the sending halves).
struct Incomings(Arc<Watch>);

impl Incoming for Incomings {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        self.0.ready.poll_peers(Duration::ZERO, ready).map(drop)
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        if self.0.ready.poll_peers(timeout, &mut |_| {})? {
            // Woken: consume the wake-ups (only waiters do, so `poll` cannot steal one).
            self.0.ready.drain_wake();
        }
        Ok(())
    }

    fn wake(&self) {
        self.0.ready.wake();
    }

    fn forget(&self, rank: usize) {
        self.0.ready.forget(rank);
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.0.ready.readiness_fd()
    }

    fn arm(&self) -> Result<Armed> {
        let ready = &self.0.ready;
        ready.make()?;
        // Clear, then look: the set is level-triggered, so looking consumes nothing but the
        // one-shot events of armed sends (which make this arm `Busy`); whatever happens after
        // the drain makes the set readable again.
        ready.drain_wake();
        Ok(if ready.any_ready()? {
            Armed::Busy
        } else {
            Armed::Armed
        })
    }

    fn shutdown(&self) {
        for w in &self.0.watched {
            // Both halves fail from now on; shutting a Unix stream both ways closes the peer's
            // end too (it reads what was sent, then end of stream: a clean close) and wakes
            // every local thread polling the socket.
            w.torn.tear("the channel was closed");
            let _ = w.s.shutdown(Shutdown::Both);
        }
        self.wake();
    }
}
