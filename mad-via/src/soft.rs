//! The soft provider: a VIA/verbs-like NIC in user space, one per connection end, whose wire
//! is a real socket (TCP, or a Unix socket pair for [`Endpoint::pair`]).
//!
//! The NIC is driven by the calls of the process that owns it (there is no helper thread):
//! every call into a link first flushes queued outgoing frames, then *pumps* incoming ones:
//!
//! * a [`Kind::Small`](crate::wire::Kind) frame lands in one of the pre-posted static receive
//!   slots; a frame arriving with no free slot means the peer ignored flow control and kills
//!   the connection (the soft NIC never overruns);
//! * a medium send lands in the receiver's posted user buffer (registered on the fly) when the
//!   receiver is waiting for it, else it waits in an unexpected queue (bounded: past
//!   [`UNEXPECTED_LIMIT`] bytes the NIC stops reading and TCP back-pressure stops the sender);
//! * an RDMA write is checked against the receiver's advertised regions (key, bounds) before a
//!   single byte lands; a refused write is reported to both sides and poisons the connection;
//! * CTS, credit and error records are handled at once.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use mad_core::driver::{AbortOutcome, LinkPair, RxLink, TmId, TxLink};
use mad_core::{Error, Result};

use crate::reg::{Lease, OwnedSlots, Pd};
use crate::wire::{self, Frame, Header, Kind, FLAG_LAST, HEADER_LEN, MAX_PAYLOAD};

/// TM index of the small (static buffer) module.
pub const TM_SMALL: TmId = 0;
/// TM index of the medium (send/receive, dynamic registration) module.
pub const TM_MEDIUM: TmId = 1;
/// TM index of the large (RDMA-write rendezvous) module.
pub const TM_LARGE: TmId = 2;

/// Unexpected (not yet received) medium/RDMA bytes a connection buffers before it stops reading.
pub const UNEXPECTED_LIMIT: usize = 8 << 20;
/// Queued outgoing bytes past which new data frames wait.
const OUT_LIMIT: usize = 512 << 10;
/// Socket send and receive buffer size asked of the kernel.
const SOCKET_BUFFER: usize = 4 << 20;
/// Longest a `wait` blocks in `poll(2)` before re-checking (another thread may have pumped).
const WAIT_SLICE: Duration = Duration::from_millis(1);

/// Flow-control parameters of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotConfig {
    /// Number of small-TM receive slots (the credits the peer starts with).
    pub slots: usize,
    /// Bytes per slot.
    pub slot_size: usize,
}

impl Default for SlotConfig {
    fn default() -> Self {
        SlotConfig {
            slots: 32,
            slot_size: 8192,
        }
    }
}

/// Counters of one connection end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Small frames sent.
    pub small_frames: u64,
    /// Medium frames sent.
    pub medium_frames: u64,
    /// RDMA write frames sent.
    pub rdma_frames: u64,
    /// Explicit credit records sent.
    pub credit_records: u64,
    /// Times a small send found no credit and returned `Pending`.
    pub credit_stalls: u64,
    /// Credits currently available for sending.
    pub credits: u64,
}

/// The socket under a soft NIC.
#[derive(Debug)]
pub(crate) enum Sock {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Sock {
    fn try_clone(&self) -> std::io::Result<Sock> {
        Ok(match self {
            Sock::Tcp(s) => Sock::Tcp(s.try_clone()?),
            Sock::Unix(s) => Sock::Unix(s.try_clone()?),
        })
    }
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.read(b),
            Sock::Unix(s) => s.read(b),
        }
    }
    fn write_vectored(&mut self, b: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Sock::Tcp(s) => s.write_vectored(b),
            Sock::Unix(s) => s.write_vectored(b),
        }
    }
    fn shutdown(&self, how: std::net::Shutdown) {
        let _ = match self {
            Sock::Tcp(s) => s.shutdown(how),
            Sock::Unix(s) => s.shutdown(how),
        };
    }
    fn set_blocking_timeouts(&self, t: Duration) -> std::io::Result<()> {
        match self {
            Sock::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Sock::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Sock::Tcp(s) => s.as_fd(),
            Sock::Unix(s) => s.as_fd(),
        }
    }
}

/// Wait until `fd` is readable (or writable if `out`), at most `t`.
pub(crate) fn wait_fd(fd: BorrowedFd<'_>, out: bool, t: Duration) -> Result<()> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut flags = PollFlags::POLLIN;
    if out {
        flags |= PollFlags::POLLOUT;
    }
    let mut fds = [PollFd::new(fd, flags)];
    let ms = t.as_millis().clamp(0, 60_000) as u16;
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(Error::io("poll on a via:soft socket", e.into())),
    }
}

/// One item received but not yet consumed.
#[derive(Debug)]
enum Item {
    Small {
        slot: usize,
        off: usize,
        len: usize,
    },
    Medium {
        data: Vec<u8>,
        last: bool,
    },
    Rdma {
        key: u32,
        addr: u64,
        data: Vec<u8>,
        last: bool,
    },
}

impl Item {
    fn what(&self) -> &'static str {
        match self {
            Item::Small { .. } => "small-TM data",
            Item::Medium { .. } => "a medium send",
            Item::Rdma { .. } => "an RDMA write",
        }
    }
}

/// Where the receiving thread wants data to land directly (it holds the borrow).
enum Dest<'a, 'b> {
    /// A posted receive (medium TM): bytes scatter from `cursor`.
    Posted {
        iov: &'a mut [IoSliceMut<'b>],
        cursor: &'a mut usize,
        done: &'a mut bool,
    },
    /// An advertised region (large TM).
    Region {
        buf: &'a mut [u8],
        key: u32,
        base: u64,
        placed: &'a mut usize,
        done: &'a mut bool,
    },
}

/// Socket plus user-space queues.
#[derive(Debug)]
struct Io {
    sock: Sock,
    out: Vec<u8>,
    out_pos: usize,
    inbuf: Box<[u8]>,
    in_start: usize,
    in_end: usize,
    eof: bool,
}

impl Io {
    fn out_pending(&self) -> usize {
        self.out.len() - self.out_pos
    }

    fn lost(rank: usize, e: std::io::Error) -> Error {
        match e.kind() {
            std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::UnexpectedEof => Error::PeerClosed { rank },
            _ => Error::ConnectionLost { rank, source: e },
        }
    }

    /// Write queued bytes without blocking.
    fn flush(&mut self, rank: usize) -> Result<()> {
        while self.out_pos < self.out.len() {
            match self
                .sock
                .write_vectored(&[IoSlice::new(&self.out[self.out_pos..])])
            {
                Ok(0) => return Err(Error::PeerClosed { rank }),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Self::lost(rank, e)),
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        }
        Ok(())
    }

    /// Send one frame (header + payload parts) after everything queued; what the socket does
    /// not take now is copied into the queue, so the caller's memory is free on return.
    fn write_frame(&mut self, rank: usize, h: &Header, parts: &[&[u8]]) -> Result<()> {
        let hb = h.encode();
        self.flush(rank)?;
        let mut done = 0usize;
        if self.out_pending() == 0 {
            let mut iov: smallvec_like::Iov<'_> = smallvec_like::Iov::new();
            iov.push(&hb);
            for p in parts {
                iov.push(p);
            }
            loop {
                match self.sock.write_vectored(iov.as_slices()) {
                    Ok(0) => return Err(Error::PeerClosed { rank }),
                    Ok(n) => done = n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Self::lost(rank, e)),
                }
                break;
            }
        }
        // Queue whatever was not written.
        let mut skip = done;
        for p in std::iter::once(&hb[..]).chain(parts.iter().copied()) {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            self.out.extend_from_slice(&p[skip..]);
            skip = 0;
        }
        Ok(())
    }
}

/// How long a closed connection keeps draining its socket so the peer reads everything.
const LINGER: Duration = Duration::from_secs(10);

/// Orderly close, off the caller's thread: send what is still queued, send end-of-stream, then
/// read and discard until the peer closes too (or [`LINGER`] passes). Closing a TCP socket
/// with unread input makes the kernel send a reset, which would destroy data the peer has not
/// read yet; draining first avoids that.
fn linger(sock: Sock, out: Vec<u8>) {
    let deadline = std::time::Instant::now() + LINGER;
    let slice = Duration::from_millis(100);
    if sock.set_blocking_timeouts(slice).is_err() {
        return;
    }
    let mut sock = sock;
    let mut at = 0;
    while at < out.len() && std::time::Instant::now() < deadline {
        match sock.write_vectored(&[IoSlice::new(&out[at..])]) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    sock.shutdown(std::net::Shutdown::Write);
    let mut sink = vec![0u8; 64 << 10];
    while std::time::Instant::now() < deadline {
        match sock.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
}

/// A tiny fixed-capacity list of `IoSlice`s (frames have a header and at most a few parts).
mod smallvec_like {
    use std::io::IoSlice;
    pub struct Iov<'a> {
        v: Vec<IoSlice<'a>>,
    }
    impl<'a> Iov<'a> {
        pub fn new() -> Self {
            Iov {
                v: Vec::with_capacity(8),
            }
        }
        pub fn push(&mut self, b: &'a [u8]) {
            if !b.is_empty() {
                self.v.push(IoSlice::new(b));
            }
        }
        pub fn as_slices(&self) -> &[IoSlice<'a>] {
            &self.v
        }
    }
}

/// One end of a soft-NIC connection (queue pair + its share of the protection domain).
#[derive(Debug)]
pub(crate) struct Conn {
    rank: usize,
    io: Io,
    pd: Arc<Pd>,
    queue: VecDeque<Item>,
    queued_bytes: usize,
    failed: Option<String>,
    credits: usize,
    to_return: usize,
    credit_threshold: usize,
    tx_slot: OwnedSlots,
    tx_fill: usize,
    rx_slots: OwnedSlots,
    rx_free: Vec<usize>,
    cts: VecDeque<(u32, u64, u64)>,
    msg_started: bool,
    /// Receive-side pump: leave a medium send in the input buffer (the receive that will post
    /// its destination is coming) instead of copying it to the unexpected queue.
    hold: bool,
    stats: ConnStats,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.io.eof && self.io.out_pending() == 0 {
            return;
        }
        let out = self.io.out.get(self.io.out_pos..).unwrap_or(&[]).to_vec();
        if let Ok(s) = self.io.sock.try_clone() {
            let _ = std::thread::Builder::new()
                .name("mad-via-linger".into())
                .spawn(move || linger(s, out));
        }
    }
}

impl Conn {
    pub(crate) fn new(rank: usize, sock: Sock, pd: &Arc<Pd>, cfg: SlotConfig) -> Result<Conn> {
        match &sock {
            Sock::Tcp(s) => {
                s.set_nonblocking(true)
                    .and_then(|_| s.set_nodelay(true))
                    .map_err(|e| Error::io("configuring a via:soft socket", e))?;
            }
            Sock::Unix(s) => s
                .set_nonblocking(true)
                .map_err(|e| Error::io("configuring a via:soft socket", e))?,
        }
        // A NIC-sized socket buffer: with the default (16 KiB initial send buffer on Linux)
        // every message above that size costs extra wake-ups of both ends before it is out.
        {
            use nix::sys::socket::{setsockopt, sockopt};
            let fd = sock.fd();
            let _ = setsockopt(&fd, sockopt::SndBuf, &SOCKET_BUFFER);
            let _ = setsockopt(&fd, sockopt::RcvBuf, &SOCKET_BUFFER);
        }
        let slots = cfg.slots.max(1);
        Ok(Conn {
            rank,
            io: Io {
                sock,
                out: Vec::new(),
                out_pos: 0,
                inbuf: vec![0u8; 2 * (MAX_PAYLOAD + HEADER_LEN)].into_boxed_slice(),
                in_start: 0,
                in_end: 0,
                eof: false,
            },
            pd: pd.clone(),
            queue: VecDeque::new(),
            queued_bytes: 0,
            failed: None,
            credits: slots,
            to_return: 0,
            credit_threshold: slots.div_ceil(2),
            tx_slot: OwnedSlots::new(pd, 1, cfg.slot_size),
            tx_fill: 0,
            rx_slots: OwnedSlots::new(pd, slots, cfg.slot_size),
            rx_free: (0..slots).rev().collect(),
            cts: VecDeque::new(),
            msg_started: false,
            hold: false,
            stats: ConnStats::default(),
        })
    }

    fn check(&self) -> Result<()> {
        match &self.failed {
            Some(cause) => Err(Error::Poisoned {
                rank: self.rank,
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Record a fatal error (and tell the peer when it is a local detection).
    fn fail(&mut self, e: Error, report: Option<u32>) -> Error {
        if self.failed.is_none() {
            self.failed = Some(e.to_string());
            if let Some(code) = report {
                let mut out = std::mem::take(&mut self.io.out);
                wire::encode_error(&mut out, 0, code, &e.to_string());
                self.io.out = out;
                let _ = self.io.flush(self.rank);
            }
        }
        e
    }

    fn take_credits(&mut self) -> u16 {
        let n = self.to_return.min(u16::MAX as usize);
        self.to_return -= n;
        n as u16
    }

    fn header(&mut self, kind: Kind, flags: u8, len: usize) -> Header {
        let c = self.take_credits();
        Header::new(kind, flags, c, len)
    }

    fn guard<T>(&mut self, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => {
                let report = matches!(e, Error::Protocol { .. }).then_some(wire::ERR_PROTOCOL);
                Err(self.fail(e, report))
            }
        }
    }

    /// Flush and process incoming frames; land data in `dest` when it is the next thing due.
    fn pump(&mut self, mut dest: Option<&mut Dest<'_, '_>>) -> Result<()> {
        self.io.flush(self.rank)?;
        let mut reads = 0;
        loop {
            // Parse complete frames.
            loop {
                let avail = &self.io.inbuf[self.io.in_start..self.io.in_end];
                let (frame, used) = match wire::decode_frame(avail) {
                    Ok(Some(x)) => x,
                    Ok(None) => break,
                    Err(e) => {
                        return Err(self.fail(
                            Error::protocol(self.rank, format!("bad frame: {e}")),
                            Some(wire::ERR_PROTOCOL),
                        ))
                    }
                };
                if self.hold && dest.is_none() && matches!(frame, Frame::Medium { .. }) {
                    return self.io.flush(self.rank);
                }
                if self.queued_bytes >= UNEXPECTED_LIMIT
                    && matches!(frame, Frame::Medium { .. } | Frame::RdmaWrite { .. })
                    && dest.is_none()
                {
                    // Stop reading: TCP back-pressure holds the sender.
                    return self.io.flush(self.rank);
                }
                // Split the borrow: the frame borrows `inbuf`, handling touches other fields.
                let (start, end) = (self.io.in_start, self.io.in_start + used);
                let inbuf = std::mem::take(&mut self.io.inbuf);
                let r = Self::handle(
                    &mut self.queue,
                    &mut self.queued_bytes,
                    &mut self.credits,
                    &mut self.rx_free,
                    &mut self.rx_slots,
                    &mut self.cts,
                    &self.pd,
                    self.rank,
                    &inbuf[start..end],
                    dest.as_deref_mut(),
                );
                self.io.inbuf = inbuf;
                self.io.in_start = end;
                if let Err((e, report)) = r {
                    return Err(self.fail(e, report));
                }
            }
            if self.io.in_start == self.io.in_end {
                self.io.in_start = 0;
                self.io.in_end = 0;
            } else if self.io.in_end == self.io.inbuf.len() {
                self.io
                    .inbuf
                    .copy_within(self.io.in_start..self.io.in_end, 0);
                self.io.in_end -= self.io.in_start;
                self.io.in_start = 0;
            }
            if self.io.eof || reads >= 64 {
                break;
            }
            if let Some(Dest::Posted { done: true, .. } | Dest::Region { done: true, .. }) =
                dest.as_deref()
            {
                break;
            }
            let end = self.io.in_end;
            match self.io.sock.read(&mut self.io.inbuf[end..]) {
                Ok(0) => {
                    self.io.eof = true;
                    if self.io.in_start != self.io.in_end {
                        return Err(self.fail(
                            Error::protocol(
                                self.rank,
                                "connection closed in the middle of a frame",
                            ),
                            None,
                        ));
                    }
                }
                Ok(n) => {
                    self.io.in_end += n;
                    reads += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let e = Io::lost(self.rank, e);
                    return Err(self.fail(e, None));
                }
            }
        }
        self.io.flush(self.rank)
    }

    #[allow(clippy::too_many_arguments)]
    fn handle(
        queue: &mut VecDeque<Item>,
        queued_bytes: &mut usize,
        credits: &mut usize,
        rx_free: &mut Vec<usize>,
        rx_slots: &mut OwnedSlots,
        cts: &mut VecDeque<(u32, u64, u64)>,
        pd: &Pd,
        rank: usize,
        raw: &[u8],
        dest: Option<&mut Dest<'_, '_>>,
    ) -> std::result::Result<(), (Error, Option<u32>)> {
        let proto = |what: String| (Error::protocol(rank, what), Some(wire::ERR_PROTOCOL));
        let (frame, _) = match wire::decode_frame(raw) {
            Ok(Some(f)) => f,
            _ => return Err(proto("frame vanished".into())),
        };
        let piggy = match frame {
            Frame::Small { credits, .. }
            | Frame::Medium { credits, .. }
            | Frame::RdmaWrite { credits, .. }
            | Frame::Cts { credits, .. }
            | Frame::Credit { credits }
            | Frame::Error { credits, .. } => credits,
        };
        *credits = credits.saturating_add(piggy as usize);
        // Both ends have the same number of slots (checked at connection time).
        if *credits > rx_slots.len() {
            return Err(proto(format!(
                "peer returned credits for more than its {} buffers",
                rx_slots.len()
            )));
        }
        match frame {
            Frame::Small { data, .. } => {
                let Some(slot) = rx_free.pop() else {
                    return Err(proto(
                        "small send with no posted receive buffer (peer ignored its credits)"
                            .into(),
                    ));
                };
                let buf = rx_slots.get_mut(slot);
                if data.len() > buf.len() {
                    return Err(proto(format!(
                        "small send of {} B into a {} B slot",
                        data.len(),
                        buf.len()
                    )));
                }
                buf[..data.len()].copy_from_slice(data);
                queue.push_back(Item::Small {
                    slot,
                    off: 0,
                    len: data.len(),
                });
            }
            Frame::Medium { last, data, .. } => match dest {
                Some(Dest::Posted { iov, cursor, done }) if queue.is_empty() && !**done => {
                    let total: usize = iov.iter().map(|s| s.len()).sum();
                    if **cursor + data.len() > total {
                        return Err(proto(format!(
                            "medium send longer than the posted receive ({} B)",
                            total
                        )));
                    }
                    scatter(iov, **cursor, data);
                    **cursor += data.len();
                    if last {
                        if **cursor != total {
                            return Err(proto(format!(
                                "medium send of {} B for a posted receive of {total} B",
                                **cursor
                            )));
                        }
                        **done = true;
                    }
                }
                _ => {
                    *queued_bytes += data.len();
                    queue.push_back(Item::Medium {
                        data: data.to_vec(),
                        last,
                    });
                }
            },
            Frame::RdmaWrite {
                key,
                addr,
                last,
                data,
                ..
            } => {
                if let Err(why) = pd.check_write(key, addr, data.len() as u64) {
                    return Err((
                        Error::protocol(rank, format!("refused: {why}")),
                        Some(wire::ERR_ACCESS),
                    ));
                }
                match dest {
                    Some(Dest::Region {
                        buf,
                        key: k,
                        base,
                        placed,
                        done,
                    }) if *k == key && !**done => {
                        let off = addr.wrapping_sub(*base) as usize;
                        let Some(dst) = off
                            .checked_add(data.len())
                            .and_then(|end| buf.get_mut(off..end))
                        else {
                            return Err(proto("RDMA write outside the posted region".into()));
                        };
                        dst.copy_from_slice(data);
                        **placed += data.len();
                        if last {
                            **done = true;
                        }
                    }
                    _ => {
                        *queued_bytes += data.len();
                        queue.push_back(Item::Rdma {
                            key,
                            addr,
                            data: data.to_vec(),
                            last,
                        });
                    }
                }
            }
            Frame::Cts { key, addr, len, .. } => cts.push_back((key, addr, len)),
            Frame::Credit { .. } => {}
            Frame::Error { code, msg, .. } => {
                let what = String::from_utf8_lossy(msg);
                let kind = if code == wire::ERR_ACCESS {
                    "remote access error"
                } else {
                    "error"
                };
                return Err((
                    Error::protocol(rank, format!("peer reported {kind}: {what}")),
                    None,
                ));
            }
        }
        Ok(())
    }

    /// Pump on behalf of a receive that waits for small-TM data: a medium send at the head
    /// of the stream stays in the input buffer, to land directly in the posted receive later.
    fn pump_rx(&mut self) -> Result<()> {
        self.hold = true;
        let r = self.pump(None);
        self.hold = false;
        r
    }

    /// A medium send waits in the input buffer while nothing is queued before it.
    fn held_medium(&self) -> bool {
        self.queue.is_empty()
            && matches!(
                Header::decode(&self.io.inbuf[self.io.in_start..self.io.in_end]),
                Ok(Some(h)) if h.kind == Kind::Medium
            )
    }

    // ---- small TM (send side) ----

    /// Transmit the current static buffer if it holds bytes. `false`: no credit or no room.
    fn send_slot(&mut self) -> Result<bool> {
        if self.tx_fill == 0 {
            return Ok(true);
        }
        if self.credits == 0 {
            self.pump(None)?;
            if self.credits == 0 {
                self.stats.credit_stalls += 1;
                return Ok(false);
            }
        }
        if self.io.out_pending() > OUT_LIMIT {
            self.io.flush(self.rank)?;
            if self.io.out_pending() > OUT_LIMIT {
                return Ok(false);
            }
        }
        let h = self.header(Kind::Small, 0, self.tx_fill);
        let n = self.tx_fill;
        self.io
            .write_frame(self.rank, &h, &[&self.tx_slot.get(0)[..n]])?;
        self.credits -= 1;
        self.tx_fill = 0;
        self.stats.small_frames += 1;
        self.msg_started = true;
        Ok(true)
    }

    // ---- gather TMs (send side) ----

    fn room(&mut self) -> Result<bool> {
        if self.io.out_pending() > OUT_LIMIT {
            self.pump(None)?;
        }
        Ok(self.io.out_pending() <= OUT_LIMIT)
    }

    /// Send `iov[cursor..]` as medium frames.
    fn send_medium(&mut self, iov: &[IoSlice<'_>], st: &mut TxGather) -> Result<Poll<()>> {
        while !st.sent_last {
            if !self.room()? {
                return Ok(Poll::Pending);
            }
            let chunk = (st.total - st.cursor).min(MAX_PAYLOAD);
            let last = st.cursor + chunk == st.total;
            let h = self.header(Kind::Medium, if last { FLAG_LAST } else { 0 }, chunk);
            let parts = gather_parts(iov, st.cursor, chunk);
            self.io.write_frame(self.rank, &h, &parts)?;
            self.msg_started = true;
            self.stats.medium_frames += 1;
            st.cursor += chunk;
            st.sent_last = last;
        }
        Ok(Poll::Ready(()))
    }

    /// Rendezvous: wait for the receiver's CTS, then RDMA-write `iov` into it.
    fn send_large(&mut self, iov: &[IoSlice<'_>], st: &mut TxGather) -> Result<Poll<()>> {
        let (key, base) = match st.cts {
            Some(c) => c,
            None => {
                if self.cts.is_empty() {
                    self.pump(None)?;
                }
                match self.cts.pop_front() {
                    Some((k, a, _len)) => {
                        st.cts = Some((k, a));
                        (k, a)
                    }
                    None => return Ok(Poll::Pending),
                }
            }
        };
        while !st.sent_last {
            if !self.room()? {
                return Ok(Poll::Pending);
            }
            let chunk = (st.total - st.cursor).min(MAX_PAYLOAD);
            let last = st.cursor + chunk == st.total;
            let mut h = self.header(Kind::RdmaWrite, if last { FLAG_LAST } else { 0 }, chunk);
            h.key = key;
            h.addr = base.wrapping_add(st.cursor as u64);
            let parts = gather_parts(iov, st.cursor, chunk);
            self.io.write_frame(self.rank, &h, &parts)?;
            self.msg_started = true;
            self.stats.rdma_frames += 1;
            st.cursor += chunk;
            st.sent_last = last;
        }
        Ok(Poll::Ready(()))
    }

    // ---- receive side ----

    /// Release a consumed small slot; return credits explicitly when the peer may run low.
    fn release_slot(&mut self, slot: usize) -> Result<()> {
        self.rx_free.push(slot);
        self.to_return += 1;
        if self.to_return >= self.credit_threshold {
            let c = self.take_credits();
            wire::encode_credit(&mut self.io.out, c);
            self.stats.credit_records += 1;
            self.io.flush(self.rank)?;
        }
        Ok(())
    }

    fn recv_medium(&mut self, iov: &mut [IoSliceMut<'_>], st: &mut RxGather) -> Result<Poll<()>> {
        let total: usize = iov.iter().map(|s| s.len()).sum();
        while !st.done {
            match self.queue.front() {
                Some(Item::Medium { .. }) => {
                    let Some(Item::Medium { data, last }) = self.queue.pop_front() else {
                        break;
                    };
                    self.queued_bytes -= data.len();
                    if st.cursor + data.len() > total || (last && st.cursor + data.len() != total) {
                        return Err(Error::protocol(
                            self.rank,
                            format!("medium send does not match the posted receive of {total} B"),
                        ));
                    }
                    scatter(iov, st.cursor, &data);
                    st.cursor += data.len();
                    st.done = last;
                }
                Some(other) => {
                    return Err(Error::protocol(
                        self.rank,
                        format!("expected a medium send, got {}", other.what()),
                    ))
                }
                None => {
                    let mut d = Dest::Posted {
                        iov,
                        cursor: &mut st.cursor,
                        done: &mut st.done,
                    };
                    self.pump(Some(&mut d))?;
                    if !st.done && self.queue.is_empty() {
                        if self.io.eof {
                            return Err(Error::PeerClosed { rank: self.rank });
                        }
                        return Ok(Poll::Pending);
                    }
                    // Done, or something was queued (pumped while not due): examine it.
                    return self.recv_medium(iov, st);
                }
            }
        }
        Ok(Poll::Ready(()))
    }

    fn recv_large(&mut self, buf: &mut [u8], st: &mut RxGather) -> Result<Poll<()>> {
        let Some((key, base)) = st.exposed else {
            return Err(Error::protocol(self.rank, "large receive without a region"));
        };
        loop {
            if st.done {
                break;
            }
            match self.queue.front() {
                Some(Item::Rdma { key: k, .. }) if *k == key => {
                    let Some(Item::Rdma {
                        addr, data, last, ..
                    }) = self.queue.pop_front()
                    else {
                        break;
                    };
                    self.queued_bytes -= data.len();
                    // Checked against the advertised region when it arrived.
                    let off = addr.wrapping_sub(base) as usize;
                    match buf.get_mut(off..off.saturating_add(data.len())) {
                        Some(dst) => dst.copy_from_slice(&data),
                        None => {
                            return Err(Error::protocol(self.rank, "RDMA write outside the region"))
                        }
                    }
                    st.cursor += data.len();
                    st.done = last;
                }
                Some(other) => {
                    return Err(Error::protocol(
                        self.rank,
                        format!(
                            "expected an RDMA write for key {key:#x}, got {}",
                            other.what()
                        ),
                    ))
                }
                None => {
                    let mut d = Dest::Region {
                        buf: &mut *buf,
                        key,
                        base,
                        placed: &mut st.cursor,
                        done: &mut st.done,
                    };
                    self.pump(Some(&mut d))?;
                    if !st.done && self.queue.is_empty() {
                        if self.io.eof {
                            return Err(Error::PeerClosed { rank: self.rank });
                        }
                        return Ok(Poll::Pending);
                    }
                }
            }
        }
        if st.cursor != buf.len() {
            return Err(Error::protocol(
                self.rank,
                format!(
                    "RDMA write completed after {} of {} advertised bytes",
                    st.cursor,
                    buf.len()
                ),
            ));
        }
        Ok(Poll::Ready(()))
    }
}

fn gather_parts<'a>(iov: &'a [IoSlice<'_>], from: usize, len: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let (mut skip, mut left) = (from, len);
    for s in iov {
        if left == 0 {
            break;
        }
        if skip >= s.len() {
            skip -= s.len();
            continue;
        }
        let take = (s.len() - skip).min(left);
        out.push(&s[skip..skip + take]);
        left -= take;
        skip = 0;
    }
    out
}

fn scatter(iov: &mut [IoSliceMut<'_>], from: usize, mut data: &[u8]) {
    let mut skip = from;
    for s in iov.iter_mut() {
        if data.is_empty() {
            break;
        }
        if skip >= s.len() {
            skip -= s.len();
            continue;
        }
        let take = (s.len() - skip).min(data.len());
        s[skip..skip + take].copy_from_slice(&data[..take]);
        data = &data[take..];
        skip = 0;
    }
}

/// Progress of a gather send across `Pending` returns.
#[derive(Debug, Default)]
struct TxGather {
    active: bool,
    total: usize,
    cursor: usize,
    sent_last: bool,
    cts: Option<(u32, u64)>,
    leases: Vec<Lease>,
}

/// Progress of a gather receive across `Pending` returns.
#[derive(Debug, Default)]
struct RxGather {
    active: bool,
    cursor: usize,
    done: bool,
    exposed: Option<(u32, u64)>,
    leases: Vec<Lease>,
}

type Shared = Arc<Mutex<Conn>>;

fn lock(c: &Shared) -> MutexGuard<'_, Conn> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sending half of a soft connection.
pub struct SoftTx {
    conn: Shared,
    sock: Sock,
    st: TxGather,
    pd: Arc<Pd>,
}

/// Receiving half of a soft connection.
pub struct SoftRx {
    conn: Shared,
    sock: Sock,
    st: RxGather,
    pd: Arc<Pd>,
}

impl SoftTx {
    fn finish(&mut self) {
        for l in self.st.leases.drain(..) {
            self.pd.release(l);
        }
        self.st = TxGather::default();
    }
}

impl Drop for SoftTx {
    fn drop(&mut self) {
        self.finish();
    }
}

impl TxLink for SoftTx {
    fn begin_message(&mut self) -> Result<()> {
        let mut c = lock(&self.conn);
        c.check()?;
        c.msg_started = false;
        Ok(())
    }

    fn with_buffer(
        &mut self,
        tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if tm != TM_SMALL {
            return Err(Error::protocol(c.rank, format!("TM {tm} is not a copy TM")));
        }
        let size = c.tx_slot.get(0).len();
        if c.tx_fill == size {
            let r = c.send_slot();
            if !c.guard(r)? {
                return Ok(Poll::Pending);
            }
        }
        let at = c.tx_fill;
        let n = fill(&mut c.tx_slot.get_mut(0)[at..]).min(size - at);
        c.tx_fill += n;
        if c.tx_fill == size {
            // Ship full buffers at once: pipelines the copy of the next one.
            let r = c.send_slot();
            c.guard(r)?;
        }
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if !self.st.active {
            self.st.active = true;
            self.st.total = iov.iter().map(|s| s.len()).sum();
            for s in iov {
                self.st
                    .leases
                    .push(self.pd.acquire(s.as_ptr() as usize, s.len()));
            }
        }
        let r = match tm {
            TM_MEDIUM => c.send_medium(iov, &mut self.st),
            TM_LARGE => c.send_large(iov, &mut self.st),
            _ => Err(Error::protocol(
                c.rank,
                format!("TM {tm} is not a gather TM"),
            )),
        };
        let r = c.guard(r)?;
        drop(c);
        if r.is_ready() {
            self.finish();
        }
        Ok(r)
    }

    fn commit(&mut self, tm: TmId) -> Result<Poll<()>> {
        if tm != TM_SMALL {
            return Ok(Poll::Ready(()));
        }
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.send_slot();
        Ok(if c.guard(r)? {
            Poll::Ready(())
        } else {
            Poll::Pending
        })
    }

    fn flush(&mut self) -> Result<Poll<()>> {
        // What end_message does: the small slot being filled leaves, and the queue drains.
        self.end_message()
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.send_slot();
        if !c.guard(r)? {
            return Ok(Poll::Pending);
        }
        let r = c.pump(None);
        c.guard(r)?;
        Ok(if c.io.out_pending() == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        })
    }

    fn abort_message(&mut self) -> AbortOutcome {
        self.finish();
        let mut c = lock(&self.conn);
        if !c.msg_started && c.io.out_pending() == 0 {
            c.tx_fill = 0;
            return AbortOutcome::Discarded;
        }
        c.tx_fill = 0;
        c.failed
            .get_or_insert_with(|| "a message was abandoned midway".to_string());
        c.io.sock.shutdown(std::net::Shutdown::Write);
        AbortOutcome::Broken
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let out = {
            let c = lock(&self.conn);
            if !c.cts.is_empty() || c.failed.is_some() {
                return Ok(());
            }
            c.io.out_pending() > 0
        };
        wait_fd(self.sock.fd(), out, timeout.min(WAIT_SLICE))
    }
}

impl SoftRx {
    fn finish(&mut self) {
        if let Some((key, _)) = self.st.exposed.take() {
            self.pd.unexpose(key);
        }
        for l in self.st.leases.drain(..) {
            self.pd.release(l);
        }
        self.st = RxGather::default();
    }
}

impl Drop for SoftRx {
    fn drop(&mut self) {
        self.finish();
    }
}

impl RxLink for SoftRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if c.queue.is_empty() {
            let r = c.pump_rx();
            c.guard(r)?;
        }
        if c.held_medium() {
            let e = Error::protocol(c.rank, "a message starts with a medium send");
            return Err(c.fail(e, Some(wire::ERR_PROTOCOL)));
        }
        if !c.queue.is_empty() {
            Ok(Poll::Ready(()))
        } else if c.io.eof {
            Err(Error::PeerClosed { rank: c.rank })
        } else {
            Ok(Poll::Pending)
        }
    }

    fn with_data(
        &mut self,
        tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if tm != TM_SMALL {
            return Err(Error::protocol(c.rank, format!("TM {tm} is not a copy TM")));
        }
        if c.queue.is_empty() {
            let r = c.pump_rx();
            c.guard(r)?;
            if c.held_medium() {
                let e = Error::protocol(c.rank, "expected small-TM data, got a medium send");
                return Err(c.fail(e, Some(wire::ERR_PROTOCOL)));
            }
        }
        let (slot, off, len) = match c.queue.front() {
            None if c.io.eof => return Err(Error::PeerClosed { rank: c.rank }),
            None => return Ok(Poll::Pending),
            Some(Item::Small { slot, off, len }) => (*slot, *off, *len),
            Some(other) => {
                let e = Error::protocol(
                    c.rank,
                    format!("expected small-TM data, got {}", other.what()),
                );
                return Err(c.fail(e, Some(wire::ERR_PROTOCOL)));
            }
        };
        let n = take(&c.rx_slots.get(slot)[off..off + len]).min(len);
        if n == len {
            c.queue.pop_front();
            let r = c.release_slot(slot);
            c.guard(r)?;
        } else if let Some(Item::Small { off, len, .. }) = c.queue.front_mut() {
            *off += n;
            *len -= n;
        }
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if !self.st.active {
            self.st.active = true;
            // Post the receive: register the destination (through the cache).
            for s in iov.iter() {
                self.st
                    .leases
                    .push(self.pd.acquire(s.as_ptr() as usize, s.len()));
            }
            if tm == TM_LARGE {
                if iov.len() != 1 {
                    return Err(Error::protocol(
                        c.rank,
                        "the large TM takes one slice per group",
                    ));
                }
                let (addr, len) = (iov[0].as_ptr() as usize, iov[0].len());
                let key = match self.st.leases.first() {
                    Some(l) => self.pd.expose(l, addr, len)?,
                    None => return Err(Error::protocol(c.rank, "no registration")),
                };
                self.st.exposed = Some((key, addr as u64));
                let credits = c.take_credits();
                wire::encode_cts(&mut c.io.out, credits, key, addr as u64, len as u64);
                let rank = c.rank;
                let r = c.io.flush(rank);
                c.guard(r)?;
            }
        }
        let r = match tm {
            TM_MEDIUM => c.recv_medium(iov, &mut self.st),
            TM_LARGE => match iov.first_mut() {
                Some(s) => c.recv_large(s, &mut self.st),
                None => Err(Error::protocol(c.rank, "empty large group")),
            },
            _ => Err(Error::protocol(
                c.rank,
                format!("TM {tm} is not a gather TM"),
            )),
        };
        let r = c.guard(r)?;
        drop(c);
        if r.is_ready() {
            self.finish();
        }
        Ok(r)
    }

    fn abort_message(&mut self) {
        self.finish();
        let mut c = lock(&self.conn);
        c.failed
            .get_or_insert_with(|| "a received message was abandoned midway".to_string());
        c.io.sock.shutdown(std::net::Shutdown::Read);
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let out = {
            let c = lock(&self.conn);
            if !c.queue.is_empty() || c.failed.is_some() || c.io.eof {
                return Ok(());
            }
            c.io.out_pending() > 0
        };
        wait_fd(self.sock.fd(), out, timeout.min(WAIT_SLICE))
    }
}

/// A raw soft-NIC endpoint: the connection object under a link pair, with verbs-level
/// operations for tests and tools (advertise a region, post a raw RDMA write, progress).
#[derive(Clone)]
pub struct Endpoint {
    conn: Shared,
    pd: Arc<Pd>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint(peer rank {})", lock(&self.conn).rank)
    }
}

/// A region advertised for RDMA writes by [`Endpoint::advertise`].
#[derive(Debug)]
pub struct Advert {
    /// Key the writer must present.
    pub key: u32,
    /// Base address.
    pub addr: u64,
    /// Length.
    pub len: u64,
    lease: Option<Lease>,
}

impl Endpoint {
    /// Two connected endpoints over a Unix socket pair (peer ranks 1 and 0), each with its own
    /// protection domain.
    pub fn pair(pd_a: &Arc<Pd>, pd_b: &Arc<Pd>, cfg: SlotConfig) -> Result<(Endpoint, Endpoint)> {
        let (a, b) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
        Ok((
            Endpoint::from_conn(Conn::new(1, Sock::Unix(a), pd_a, cfg)?),
            Endpoint::from_conn(Conn::new(0, Sock::Unix(b), pd_b, cfg)?),
        ))
    }

    /// An endpoint over an existing Unix stream whose other end is peer `rank` (tests, tools:
    /// the other end may be anything, e.g. a fault injector writing raw frames).
    pub fn over_unix(
        sock: UnixStream,
        rank: usize,
        pd: &Arc<Pd>,
        cfg: SlotConfig,
    ) -> Result<Endpoint> {
        Ok(Endpoint::from_conn(Conn::new(
            rank,
            Sock::Unix(sock),
            pd,
            cfg,
        )?))
    }

    pub(crate) fn from_conn(c: Conn) -> Endpoint {
        let pd = c.pd.clone();
        Endpoint {
            conn: Arc::new(Mutex::new(c)),
            pd,
        }
    }

    pub(crate) fn sock_clone(&self) -> Result<Sock> {
        lock(&self.conn)
            .io
            .sock
            .try_clone()
            .map_err(|e| Error::io("duplicating a via:soft socket", e))
    }

    /// The link pair over this endpoint (what the driver hands to the core).
    pub fn links(&self) -> Result<LinkPair> {
        Ok(LinkPair {
            tx: Box::new(SoftTx {
                conn: self.conn.clone(),
                sock: self.sock_clone()?,
                st: TxGather::default(),
                pd: self.pd.clone(),
            }),
            rx: Box::new(SoftRx {
                conn: self.conn.clone(),
                sock: self.sock_clone()?,
                st: RxGather::default(),
                pd: self.pd.clone(),
            }),
        })
    }

    /// Counters of this end.
    pub fn stats(&self) -> ConnStats {
        let c = lock(&self.conn);
        ConnStats {
            credits: c.credits as u64,
            ..c.stats
        }
    }

    /// Register `buf` and advertise it for RDMA writes from the peer (the receiver's half of
    /// the rendezvous, without sending the CTS).
    pub fn advertise(&self, buf: &[u8]) -> Result<Advert> {
        let lease = self.pd.acquire(buf.as_ptr() as usize, buf.len());
        let key = self.pd.expose(&lease, buf.as_ptr() as usize, buf.len())?;
        Ok(Advert {
            key,
            addr: buf.as_ptr() as u64,
            len: buf.len() as u64,
            lease: Some(lease),
        })
    }

    /// Withdraw an advertisement and release its registration.
    pub fn withdraw(&self, mut a: Advert) {
        self.pd.unexpose(a.key);
        if let Some(l) = a.lease.take() {
            self.pd.release(l);
        }
    }

    /// Post a raw RDMA write of `data` to the peer's `(key, addr)`, as verbs would: the local
    /// source must be registered; the remote side decides whether the write is allowed.
    pub fn rdma_write(&self, key: u32, addr: u64, data: &[u8]) -> Result<()> {
        let mut c = lock(&self.conn);
        c.check()?;
        if !self.pd.is_registered(data.as_ptr() as usize, data.len()) {
            return Err(Error::protocol(
                c.rank,
                "RDMA write from unregistered local memory (register it first)",
            ));
        }
        let mut h = c.header(Kind::RdmaWrite, FLAG_LAST, data.len());
        h.key = key;
        h.addr = addr;
        let rank = c.rank;
        let r = c.io.write_frame(rank, &h, &[data]);
        c.guard(r)?;
        let r = c.io.flush(rank);
        c.guard(r)
    }

    /// Drive the NIC, landing RDMA writes for `a` into `buf` (which must be the advertised
    /// memory). `Ready(n)` once the writer signalled completion, with `n` bytes placed.
    pub fn receive_writes(&self, a: &Advert, buf: &mut [u8]) -> Result<Poll<usize>> {
        let mut c = lock(&self.conn);
        c.check()?;
        if buf.as_ptr() as u64 != a.addr || buf.len() as u64 != a.len {
            return Err(Error::BadConfig(
                "buffer is not the advertised region".into(),
            ));
        }
        let (mut placed, mut done) = (0usize, false);
        let mut d = Dest::Region {
            buf,
            key: a.key,
            base: a.addr,
            placed: &mut placed,
            done: &mut done,
        };
        let r = c.pump(Some(&mut d));
        c.guard(r)?;
        Ok(if done {
            Poll::Ready(placed)
        } else {
            Poll::Pending
        })
    }

    /// Drive the NIC once (flush, receive); reports errors the peer sent.
    pub fn progress(&self) -> Result<()> {
        let mut c = lock(&self.conn);
        c.check()?;
        let r = c.pump(None);
        c.guard(r)
    }

    /// Block until the socket may be readable, at most `t`.
    pub fn wait(&self, t: Duration) -> Result<()> {
        let s = self.sock_clone()?;
        wait_fd(s.fd(), false, t)
    }

    pub(crate) fn shared(&self) -> Shared {
        self.conn.clone()
    }
}

/// Any-source readiness over the soft connections of a channel.
pub struct SoftIncoming {
    conns: Vec<(usize, Shared, Sock)>,
    wake_rx: UnixStream,
    wake_tx: UnixStream,
}

impl SoftIncoming {
    pub(crate) fn new(eps: Vec<(usize, Endpoint)>) -> Result<SoftIncoming> {
        let (wake_rx, wake_tx) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
        wake_rx
            .set_nonblocking(true)
            .and_then(|_| wake_tx.set_nonblocking(true))
            .map_err(|e| Error::io("socketpair", e))?;
        let mut conns = Vec::new();
        for (r, ep) in eps {
            conns.push((r, ep.shared(), ep.sock_clone()?));
        }
        Ok(SoftIncoming {
            conns,
            wake_rx,
            wake_tx,
        })
    }
}

impl mad_core::driver::Incoming for SoftIncoming {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut maybe = Vec::new();
        for (r, c, _) in &self.conns {
            match c.try_lock() {
                Ok(mut c) => {
                    // Keep queued control records (credits, CTS) moving while idle.
                    let rank = c.rank;
                    let _ = c.io.flush(rank);
                    if !c.queue.is_empty() || c.failed.is_some() || c.io.eof {
                        ready(*r);
                    } else {
                        maybe.push(*r);
                    }
                }
                Err(_) => ready(*r),
            }
        }
        if maybe.is_empty() {
            return Ok(());
        }
        let mut fds: Vec<PollFd<'_>> = self
            .conns
            .iter()
            .filter(|(r, _, _)| maybe.contains(r))
            .map(|(_, _, s)| PollFd::new(s.fd(), PollFlags::POLLIN))
            .collect();
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::io("poll on via:soft sockets", e.into())),
        }
        let hits: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|e| !e.is_empty()))
            .collect();
        for (r, hit) in maybe.iter().zip(hits) {
            if hit {
                ready(*r);
            }
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        // Connections that failed or reached end of stream were reported by `poll`; leave
        // them out (an EOF socket is always readable and would turn this wait into a spin).
        let mut live = Vec::with_capacity(self.conns.len());
        for (r, c, _) in &self.conns {
            match c.try_lock() {
                Ok(c) => {
                    if !c.queue.is_empty() {
                        return Ok(());
                    }
                    if c.failed.is_none() && !c.io.eof {
                        live.push(*r);
                    }
                }
                Err(_) => live.push(*r),
            }
        }
        let mut fds: Vec<PollFd<'_>> = self
            .conns
            .iter()
            .filter(|(r, _, _)| live.contains(r))
            .map(|(_, _, s)| PollFd::new(s.fd(), PollFlags::POLLIN))
            .collect();
        fds.push(PollFd::new(self.wake_rx.as_fd(), PollFlags::POLLIN));
        let ms = timeout.min(Duration::from_millis(10)).as_millis() as u16;
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::io("poll on via:soft sockets", e.into())),
        }
        let mut sink = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut sink), Ok(n) if n > 0) {}
        Ok(())
    }

    fn wake(&self) {
        let _ = (&self.wake_tx).write(&[1]);
    }
}
