//! The soft provider: a verbs-like NIC in user space, one per connection end, whose queue
//! pairs are real sockets (TCP between the ranks of a session, Unix socket pairs for
//! [`Endpoint::pair`]): one socket for the control QP, one for the data QP.
//!
//! The NIC is driven by the calls of the process that owns it (there is no helper thread):
//! `poll` flushes queued outgoing frames, then processes incoming ones, enforcing what verbs
//! enforce:
//!
//! * memory must be registered before use: every user scatter/gather element of a posted
//!   work request is checked against the channel's registrations (key and bounds);
//! * a send needs a posted receive: on the control QP a send with no posted receive means the
//!   peer ignored its credits and kills the connection; on the data QP it waits in the socket
//!   until the receive is posted (verbs: receiver-not-ready, the sender retries), without
//!   holding up the control QP;
//! * an RDMA write lands only in a region the receiver advertised, within its bounds and with
//!   its key (each advertisement gets a fresh key); anything else is refused before a single
//!   byte lands, reported to both sides, and kills the connection.
//!
//! Data lands in user memory only through the borrow the caller lends to `poll` (see
//! the provider interface, `provider.rs`): the soft NIC needs no `unsafe`.

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::driver::LinkPair;
use mad_core::{Error, Result};

use crate::proto::{self, Conn, ConnStats, Shared, SlotConfig};
pub use crate::proto::{TM_LARGE, TM_MEDIUM, TM_SMALL};
use crate::provider::{
    Completions, Device, Dst, Interest, Interests, MemoryRegion, Nic, Qp, RecvSge, Remote, Src,
    WaitFds, Wc, WcKind,
};
use crate::reg::{Pd, RegCache};
use crate::sys;
use crate::wire::{self, Frame, Header, Kind, HEADER_LEN, MAX_ERROR_MSG, MAX_PAYLOAD};

/// Queued outgoing bytes (per queue pair) past which new work requests wait.
const OUT_LIMIT: usize = 512 << 10;
/// Socket send and receive buffer size asked of the kernel.
const SOCKET_BUFFER: usize = 4 << 20;
/// Least input buffer of the control queue pair.
const CTRL_INBUF: usize = 256 << 10;
/// Static send buffers per connection (the soft NIC copies at post time, so a few suffice).
const TX_SLOTS: usize = 4;
/// How long a closed connection keeps draining its sockets so the peer reads everything.
const LINGER: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Protection domain

#[derive(Debug)]
struct Keys {
    next: u32,
    /// Registered ranges by key.
    regions: HashMap<u32, (usize, usize)>,
}

impl Keys {
    fn fresh(&mut self) -> u32 {
        loop {
            self.next = self.next.wrapping_add(0x9e37);
            if self.next != 0 && !self.regions.contains_key(&self.next) {
                return self.next;
            }
        }
    }
}

/// The soft protection domain of one channel: the table of registered ranges and their keys.
#[derive(Debug)]
pub struct SoftDevice {
    keys: Arc<Mutex<Keys>>,
    pd: Arc<Pd>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SoftDevice {
    /// A protection domain counting into `pd`.
    pub(crate) fn new(pd: &Arc<Pd>) -> Arc<SoftDevice> {
        Arc::new(SoftDevice {
            keys: Arc::new(Mutex::new(Keys {
                next: 0x5a00_0001,
                regions: HashMap::new(),
            })),
            pd: pd.clone(),
        })
    }

    /// Whether `lkey` names a registration covering `[addr, addr + len)`.
    fn covers(&self, lkey: u32, addr: usize, len: usize) -> bool {
        len == 0
            || lock(&self.keys)
                .regions
                .get(&lkey)
                .is_some_and(|&(a, n)| a <= addr && addr.saturating_add(len) <= a.saturating_add(n))
    }

    fn fresh_key(&self) -> u32 {
        lock(&self.keys).fresh()
    }
}

/// A soft registration: a pinned range and its key; unpinned and forgotten on drop.
#[derive(Debug)]
pub struct SoftMr {
    key: u32,
    addr: usize,
    len: usize,
    pinned: bool,
    keys: Arc<Mutex<Keys>>,
}

impl MemoryRegion for SoftMr {
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        lock(&self.keys).regions.remove(&self.key);
        if self.pinned {
            sys::unpin(self.addr, self.len);
        }
    }
}

impl Device for SoftDevice {
    type Mr = SoftMr;

    fn caches_user_memory(&self) -> bool {
        // The soft NIC writes user memory only through a borrow lent to `poll`, never through
        // a registered address: a stale registration cannot make it write freed memory.
        true
    }

    fn reg_mr(&self, addr: usize, len: usize) -> Result<SoftMr> {
        let pinned = sys::pin(addr, len);
        if !pinned && len > 0 {
            self.pd.count(|s| s.pin_failures += 1);
        }
        let mut k = lock(&self.keys);
        let key = k.fresh();
        k.regions.insert(key, (addr, len));
        Ok(SoftMr {
            key,
            addr,
            len,
            pinned,
            keys: self.keys.clone(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Sockets

/// The socket under a soft queue pair.
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
    fn configure(&self) -> Result<()> {
        let r = match self {
            Sock::Tcp(s) => s.set_nonblocking(true).and_then(|_| s.set_nodelay(true)),
            Sock::Unix(s) => s.set_nonblocking(true),
        };
        r.map_err(|e| Error::io("configuring a via:soft socket", e))?;
        // A NIC-sized socket buffer: with the default (16 KiB initial send buffer on Linux)
        // every message above that size costs extra wake-ups of both ends before it is out.
        use nix::sys::socket::{setsockopt, sockopt};
        let fd = self.fd();
        let _ = setsockopt(&fd, sockopt::SndBuf, &SOCKET_BUFFER);
        let _ = setsockopt(&fd, sockopt::RcvBuf, &SOCKET_BUFFER);
        Ok(())
    }
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Sock::Tcp(s) => s.as_fd(),
            Sock::Unix(s) => s.as_fd(),
        }
    }
}

fn lost(rank: usize, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::UnexpectedEof => Error::PeerClosed { rank },
        _ => Error::ConnectionLost { rank, source: e },
    }
}

/// One queue pair's socket with its user-space queues.
#[derive(Debug)]
struct Wire {
    sock: Sock,
    out: Vec<u8>,
    out_pos: usize,
    inbuf: Box<[u8]>,
    in_start: usize,
    in_end: usize,
    eof: bool,
}

impl Wire {
    fn new(sock: Sock, inbuf: usize) -> Result<Wire> {
        sock.configure()?;
        Ok(Wire {
            sock,
            // The most a connection queues (`OUT_LIMIT`, plus one frame past it): reserved now,
            // so a backlog under load does not allocate on the message path.
            out: Vec::with_capacity(OUT_LIMIT + wire::HEADER_LEN + wire::MAX_PAYLOAD),
            out_pos: 0,
            inbuf: vec![0u8; inbuf].into_boxed_slice(),
            in_start: 0,
            in_end: 0,
            eof: false,
        })
    }

    fn out_pending(&self) -> usize {
        self.out.len() - self.out_pos
    }

    /// Write queued bytes without blocking.
    fn flush(&mut self) -> std::io::Result<()> {
        while self.out_pos < self.out.len() {
            match self
                .sock
                .write_vectored(&[IoSlice::new(&self.out[self.out_pos..])])
            {
                Ok(0) => return Err(std::io::ErrorKind::BrokenPipe.into()),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        }
        Ok(())
    }

    /// Send one frame after everything queued; what the socket does not take now is copied
    /// into the queue, so the caller's memory is free on return.
    fn write_frame(&mut self, h: &Header, parts: &[&[u8]]) -> std::io::Result<()> {
        let hb = h.encode();
        self.flush()?;
        let mut done = 0usize;
        if self.out_pending() == 0 {
            // Inline room for a 16-slice group and the header: no allocation per frame.
            let mut iov: smallvec::SmallVec<[IoSlice<'_>; 18]> = smallvec::SmallVec::new();
            iov.push(IoSlice::new(&hb));
            iov.extend(
                parts
                    .iter()
                    .filter(|p| !p.is_empty())
                    .map(|p| IoSlice::new(p)),
            );
            loop {
                match self.sock.write_vectored(&iov) {
                    Ok(0) => return Err(std::io::ErrorKind::BrokenPipe.into()),
                    Ok(n) => done = n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
                break;
            }
        }
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

    /// Read more input: `Ok(Some(drained))` if bytes came (`drained`: fewer than there was
    /// room for, so the socket is very likely empty now: reading again at once would only
    /// cost a system call returning EAGAIN); `Ok(None)`: nothing available now (or end of
    /// stream, see `eof`).
    fn fill(&mut self) -> std::io::Result<Option<bool>> {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.in_end == self.inbuf.len() {
            self.inbuf.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        if self.eof || self.in_end == self.inbuf.len() {
            return Ok(None);
        }
        loop {
            let end = self.in_end;
            let room = self.inbuf.len() - end;
            match self.sock.read(&mut self.inbuf[end..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(None);
                }
                Ok(n) => {
                    self.in_end += n;
                    return Ok(Some(n < room));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Orderly close, off the caller's thread: send what is still queued, send end-of-stream, then
/// read and discard until the peer closes too (or [`LINGER`] passes). Closing a TCP socket
/// with unread input makes the kernel send a reset, which would destroy data the peer has not
/// read yet; draining first avoids that.
fn linger(socks: Vec<(Sock, Vec<u8>)>) {
    let deadline = Instant::now() + LINGER;
    let slice = Duration::from_millis(100);
    let transient = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock
                | std::io::ErrorKind::TimedOut
                | std::io::ErrorKind::Interrupted
        )
    };
    let mut open = Vec::new();
    for (mut sock, out) in socks {
        if sock.set_blocking_timeouts(slice).is_err() {
            continue;
        }
        let mut at = 0;
        while at < out.len() && Instant::now() < deadline {
            match sock.write_vectored(&[IoSlice::new(&out[at..])]) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if transient(&e) => {}
                Err(_) => break,
            }
        }
        sock.shutdown(std::net::Shutdown::Write);
        open.push(sock);
    }
    let mut sink = vec![0u8; 64 << 10];
    for mut sock in open {
        while Instant::now() < deadline {
            match sock.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(_) => break,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The NIC

/// Library-owned registered memory of one connection end, created before the connection so
/// its credit word can be published: static receive buffers, static send buffers, the credit
/// word the peer writes.
#[derive(Debug)]
pub(crate) struct SoftArena {
    rx: Vec<Box<[u8]>>,
    tx: Vec<Box<[u8]>>,
    credit: Box<[u8; 8]>,
    credit_key: u32,
}

impl SoftArena {
    pub(crate) fn new(dev: &SoftDevice, cfg: SlotConfig) -> SoftArena {
        let slots = cfg.slots.max(1);
        SoftArena {
            rx: (0..slots)
                .map(|_| vec![0u8; cfg.slot_size].into_boxed_slice())
                .collect(),
            tx: (0..TX_SLOTS.min(slots).max(2))
                .map(|_| vec![0u8; cfg.slot_size.max(8)].into_boxed_slice())
                .collect(),
            credit: Box::new([0u8; 8]),
            credit_key: dev.fresh_key(),
        }
    }

    /// Where the peer writes credits: (address, key).
    pub(crate) fn credit_word(&self) -> (u64, u32) {
        (self.credit.as_ptr() as u64, self.credit_key)
    }
}

#[derive(Debug)]
enum Posted {
    Slot(usize),
    User(Vec<RecvSge>),
}

#[derive(Debug, Clone, Copy)]
struct Exposed {
    addr: u64,
    len: u64,
    credit: bool,
}

/// Outcome of trying to land the frame at the head of the data queue pair.
enum Landing {
    Done,
    /// Not now: no posted receive, or its memory is not lent by this call.
    NotReady,
}

/// A soft NIC: one connection end.
#[derive(Debug)]
pub struct SoftNic {
    rank: usize,
    dev: Arc<SoftDevice>,
    q: [Wire; 2],
    arena: SoftArena,
    peer_credit: Remote,
    posted: [VecDeque<(u64, Posted)>; 2],
    exposed: HashMap<u32, Exposed>,
    /// Sends complete when posted; the connection's failure.
    cq: Completions,
    /// Also process the data QP when no receive is posted there (raw endpoints' `progress`,
    /// so a refused write is reported at once; normal polls leave unexpected data alone).
    eager: bool,
}

impl Drop for SoftNic {
    fn drop(&mut self) {
        if self.q.iter().all(|w| w.eof && w.out_pending() == 0) {
            return;
        }
        let mut socks = Vec::new();
        for w in &self.q {
            if let Ok(s) = w.sock.try_clone() {
                socks.push((s, w.out.get(w.out_pos..).unwrap_or(&[]).to_vec()));
            }
        }
        let _ = std::thread::Builder::new()
            .name("mad-via-linger".into())
            .spawn(move || linger(socks));
    }
}

fn locate(lent: &[IoSliceMut<'_>], addr: usize, len: usize) -> Option<(usize, usize)> {
    lent.iter().enumerate().find_map(|(i, s)| {
        let base = s.as_ptr() as usize;
        (addr >= base && addr.saturating_add(len) <= base.saturating_add(s.len()))
            .then(|| (i, addr - base))
    })
}

impl SoftNic {
    pub(crate) fn new(
        rank: usize,
        ctrl: Sock,
        data: Sock,
        dev: &Arc<SoftDevice>,
        arena: SoftArena,
        peer_credit: Remote,
    ) -> Result<SoftNic> {
        let slot = arena.rx.first().map_or(0, |s| s.len());
        // Room for many small frames per read: a 16 KiB buffer (two 8 KiB frames) made the
        // static-buffer path pay one read(2) per frame and lose a quarter of its bandwidth.
        let ctrl_in = (2 * (HEADER_LEN + slot.max(MAX_ERROR_MSG))).max(CTRL_INBUF);
        let mut exposed = HashMap::new();
        exposed.insert(
            arena.credit_key,
            Exposed {
                addr: arena.credit.as_ptr() as u64,
                len: 8,
                credit: true,
            },
        );
        Ok(SoftNic {
            rank,
            dev: dev.clone(),
            q: [
                Wire::new(ctrl, ctrl_in)?,
                Wire::new(data, 2 * (HEADER_LEN + MAX_PAYLOAD))?,
            ],
            arena,
            peer_credit,
            posted: [VecDeque::new(), VecDeque::new()],
            exposed,
            cq: Completions::default(),
            eager: false,
        })
    }

    fn check(&self) -> Result<()> {
        self.cq.check(self.rank)
    }

    fn proto(&self, what: impl Into<String>) -> (Error, Option<u32>) {
        (Error::protocol(self.rank, what), Some(wire::ERR_PROTOCOL))
    }

    /// Record a fatal error, telling the peer when it is a local detection.
    fn failure(&mut self, (e, report): (Error, Option<u32>)) -> Error {
        if self.cq.fail(&e) {
            if let Some(code) = report {
                let w = &mut self.q[Qp::Ctrl as usize];
                wire::encode_error(&mut w.out, code, &e.to_string());
                let _ = w.flush();
            }
        }
        e
    }

    fn io(&self, e: std::io::Error) -> (Error, Option<u32>) {
        (lost(self.rank, e), None)
    }

    fn check_sges(&self, sges: impl Iterator<Item = (usize, usize, u32)>) -> Result<()> {
        for (addr, len, lkey) in sges {
            if !self.dev.covers(lkey, addr, len) {
                return Err(Error::protocol(
                    self.rank,
                    format!(
                        "work request on unregistered memory ({len} B at {addr:#x}, key {lkey:#x}): register it first"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_write(&self, key: u32, addr: u64, len: usize) -> std::result::Result<Exposed, String> {
        match self.exposed.get(&key) {
            None => Err(format!(
                "RDMA write of {len} B with key {key:#x}: no region advertised under that key"
            )),
            Some(x) => {
                let ok = addr >= x.addr
                    && addr
                        .checked_add(len as u64)
                        .is_some_and(|e| e <= x.addr.saturating_add(x.len));
                if ok {
                    Ok(*x)
                } else {
                    Err(format!(
                        "RDMA write of {len} B at {addr:#x} with key {key:#x}: outside the advertised region [{:#x}, +{})",
                        x.addr, x.len
                    ))
                }
            }
        }
    }

    fn refuse(&self, why: String) -> (Error, Option<u32>) {
        self.dev.pd.count(|s| s.refused_writes += 1);
        (
            Error::protocol(self.rank, format!("refused: {why}")),
            Some(wire::ERR_ACCESS),
        )
    }

    fn peer_error(&self, code: u32, msg: &[u8]) -> (Error, Option<u32>) {
        let what = String::from_utf8_lossy(msg);
        let kind = if code == wire::ERR_ACCESS {
            "remote access error"
        } else {
            "error"
        };
        (
            Error::protocol(self.rank, format!("peer reported {kind}: {what}")),
            None,
        )
    }

    /// Handle one complete control-QP frame.
    fn on_ctrl(
        &mut self,
        f: Frame<'_>,
        out: &mut Vec<Wc>,
    ) -> std::result::Result<(), (Error, Option<u32>)> {
        match f {
            Frame::Send { imm, data } => {
                let Some((wr_id, p)) = self.posted[0].pop_front() else {
                    return Err(self.proto(
                        "small send with no posted receive buffer (peer ignored its credits)",
                    ));
                };
                let Posted::Slot(slot) = p else {
                    return Err(self.proto("control send into user memory"));
                };
                let cap = self.arena.rx.get(slot).map_or(0, |b| b.len());
                if data.len() > cap {
                    return Err(self.proto(format!(
                        "small send of {} B into a {cap} B slot",
                        data.len()
                    )));
                }
                self.arena.rx[slot][..data.len()].copy_from_slice(data);
                out.push(Wc {
                    qp: Qp::Ctrl,
                    wr_id,
                    kind: WcKind::Recv {
                        len: data.len(),
                        imm,
                    },
                });
            }
            Frame::Write {
                key,
                addr,
                imm,
                data,
            } => {
                let x = self
                    .check_write(key, addr, data.len())
                    .map_err(|w| self.refuse(w))?;
                if !x.credit {
                    return Err(self.proto("RDMA write to user memory on the control queue pair"));
                }
                let off = (addr - x.addr) as usize;
                self.arena.credit[off..off + data.len()].copy_from_slice(data);
                if let Some(imm) = imm {
                    let Some((wr_id, _)) = self.posted[0].pop_front() else {
                        return Err(self.proto("RDMA write with immediate and no posted receive"));
                    };
                    out.push(Wc {
                        qp: Qp::Ctrl,
                        wr_id,
                        kind: WcKind::Recv {
                            len: data.len(),
                            imm: Some(imm),
                        },
                    });
                }
            }
            Frame::Error { code, msg } => return Err(self.peer_error(code, msg)),
        }
        Ok(())
    }

    /// Try to land one complete data-QP frame.
    fn on_data(
        &mut self,
        f: Frame<'_>,
        lent: &mut [IoSliceMut<'_>],
        out: &mut Vec<Wc>,
    ) -> std::result::Result<Landing, (Error, Option<u32>)> {
        match f {
            Frame::Send { imm, data } => {
                let Some((_, p)) = self.posted[1].front() else {
                    return Ok(Landing::NotReady);
                };
                let Posted::User(sges) = p else {
                    return Err(self.proto("data send into a static buffer"));
                };
                let cap: usize = sges.iter().map(|s| s.len).sum();
                if data.len() > cap {
                    return Err(self.proto(format!(
                        "medium send of {} B longer than the posted receive ({cap} B)",
                        data.len()
                    )));
                }
                let mut spots = Vec::with_capacity(sges.len());
                for s in sges.iter().filter(|s| s.len > 0) {
                    match locate(lent, s.addr, s.len) {
                        Some(at) => spots.push((at, s.len)),
                        None => return Ok(Landing::NotReady),
                    }
                }
                let mut rest = data;
                for ((i, off), n) in spots {
                    if rest.is_empty() {
                        break;
                    }
                    let k = n.min(rest.len());
                    lent[i][off..off + k].copy_from_slice(&rest[..k]);
                    rest = &rest[k..];
                }
                if let Some((wr_id, _)) = self.posted[1].pop_front() {
                    out.push(Wc {
                        qp: Qp::Data,
                        wr_id,
                        kind: WcKind::Recv {
                            len: data.len(),
                            imm,
                        },
                    });
                }
            }
            Frame::Write {
                key,
                addr,
                imm,
                data,
            } => {
                let x = self
                    .check_write(key, addr, data.len())
                    .map_err(|w| self.refuse(w))?;
                if imm.is_some() && self.posted[1].is_empty() {
                    return Ok(Landing::NotReady);
                }
                if x.credit {
                    let off = (addr - x.addr) as usize;
                    self.arena.credit[off..off + data.len()].copy_from_slice(data);
                } else if !data.is_empty() {
                    let Some((i, off)) = locate(lent, addr as usize, data.len()) else {
                        return Ok(Landing::NotReady);
                    };
                    lent[i][off..off + data.len()].copy_from_slice(data);
                }
                if let Some(imm) = imm {
                    if let Some((wr_id, _)) = self.posted[1].pop_front() {
                        out.push(Wc {
                            qp: Qp::Data,
                            wr_id,
                            kind: WcKind::Recv {
                                len: data.len(),
                                imm: Some(imm),
                            },
                        });
                    }
                }
            }
            Frame::Error { code, msg } => return Err(self.peer_error(code, msg)),
        }
        Ok(Landing::Done)
    }

    /// Process what arrived on queue pair `q`.
    fn pump(
        &mut self,
        q: usize,
        lent: &mut [IoSliceMut<'_>],
        out: &mut Vec<Wc>,
    ) -> std::result::Result<(), (Error, Option<u32>)> {
        let mut reads = 0;
        let mut drained = false;
        loop {
            loop {
                let w = &self.q[q];
                let avail = &w.inbuf[w.in_start..w.in_end];
                let h = match Header::decode(avail) {
                    Ok(Some(h)) => h,
                    Ok(None) => break,
                    Err(e) => return Err(self.proto(format!("bad frame: {e}"))),
                };
                let total = HEADER_LEN + h.len as usize;
                let slot = self.arena.rx.first().map_or(0, |s| s.len());
                if q == 0 && h.kind == Kind::Send && h.len as usize > slot {
                    // Refused from the header: no need to buffer what cannot fit.
                    return Err(self.proto(format!(
                        "small send of {} B larger than a {slot} B slot",
                        h.len
                    )));
                }
                if total > w.inbuf.len() {
                    return Err(self.proto(format!(
                        "frame of {} B larger than this queue pair accepts",
                        h.len
                    )));
                }
                if avail.len() < total {
                    break;
                }
                // Split the borrow: the frame borrows `inbuf`, handling touches other fields.
                let start = w.in_start;
                let inbuf = std::mem::take(&mut self.q[q].inbuf);
                let r = match wire::decode_frame(&inbuf[start..start + total]) {
                    Ok(Some((f, _))) if q == 0 => self.on_ctrl(f, out).map(|_| Landing::Done),
                    Ok(Some((f, _))) => self.on_data(f, lent, out),
                    _ => Err(self.proto("frame vanished")),
                };
                self.q[q].inbuf = inbuf;
                match r? {
                    Landing::Done => self.q[q].in_start += total,
                    Landing::NotReady => return Ok(()),
                }
            }
            if reads >= 64 || drained {
                break;
            }
            match self.q[q].fill() {
                Ok(Some(d)) => {
                    reads += 1;
                    drained = d;
                }
                Ok(None) => break,
                Err(e) => return Err(self.io(e)),
            }
        }
        let w = &self.q[q];
        if w.eof && w.in_start != w.in_end {
            return Err((
                Error::protocol(self.rank, "connection closed in the middle of a frame"),
                None,
            ));
        }
        Ok(())
    }

    fn poll_inner(
        &mut self,
        lent: &mut [IoSliceMut<'_>],
        out: &mut Vec<Wc>,
    ) -> std::result::Result<(), (Error, Option<u32>)> {
        for q in 0..2 {
            self.q[q].flush().map_err(|e| self.io(e))?;
        }
        self.pump(0, lent, out)?;
        if self.eager
            || !self.posted[1].is_empty()
            || self.exposed.len() > 1
            || self.q[1].in_start != self.q[1].in_end
        {
            self.pump(1, lent, out)?;
        }
        for q in 0..2 {
            self.q[q].flush().map_err(|e| self.io(e))?;
        }
        Ok(())
    }
}

impl Nic for SoftNic {
    fn max_msg(&self) -> usize {
        MAX_PAYLOAD
    }

    fn data_window(&self) -> usize {
        // Each send is copied into the socket (or its queue) when posted.
        64
    }

    fn rx_slot(&self, slot: usize) -> &[u8] {
        self.arena.rx.get(slot).map_or(&[], |b| &b[..])
    }

    fn tx_slot_mut(&mut self, slot: usize) -> &mut [u8] {
        match self.arena.tx.get_mut(slot) {
            Some(b) => &mut b[..],
            None => &mut [],
        }
    }

    fn tx_slots(&self) -> usize {
        self.arena.tx.len()
    }

    fn credit_word(&self) -> u64 {
        u64::from_le_bytes(*self.arena.credit)
    }

    fn peer_credit_word(&self) -> Remote {
        self.peer_credit
    }

    fn post_recv(&mut self, qp: Qp, wr_id: u64, dst: Dst<'_>) -> Result<()> {
        self.check()?;
        let p = match dst {
            Dst::Slot(s) if s < self.arena.rx.len() => Posted::Slot(s),
            Dst::Slot(s) => {
                return Err(Error::protocol(
                    self.rank,
                    format!("receive into static buffer {s}: no such buffer"),
                ))
            }
            Dst::User(sges) => {
                self.check_sges(sges.iter().map(|s| (s.addr, s.len, s.lkey)))?;
                Posted::User(sges.to_vec())
            }
        };
        self.posted[qp as usize].push_back((wr_id, p));
        Ok(())
    }

    fn post(
        &mut self,
        qp: Qp,
        wr_id: u64,
        src: Src<'_>,
        to: Option<Remote>,
        imm: Option<u32>,
    ) -> Result<Poll<()>> {
        self.check()?;
        let q = qp as usize;
        if self.q[q].out_pending() > OUT_LIMIT {
            if let Err(e) = self.q[q].flush() {
                let e = self.io(e);
                return Err(self.failure(e));
            }
            if self.q[q].out_pending() > OUT_LIMIT {
                return Ok(Poll::Pending);
            }
        }
        let mut parts: smallvec::SmallVec<[&[u8]; 17]> = smallvec::SmallVec::new();
        let total = match src {
            Src::Slot { slot, len } => {
                let Some(b) = self.arena.tx.get(slot).and_then(|b| b.get(..len)) else {
                    return Err(Error::protocol(
                        self.rank,
                        format!("send from static buffer {slot} of {len} B: no such buffer"),
                    ));
                };
                parts.push(b);
                len
            }
            Src::User(sges) => {
                self.check_sges(
                    sges.iter()
                        .map(|s| (s.buf.as_ptr() as usize, s.buf.len(), s.lkey)),
                )?;
                parts.extend(sges.iter().map(|s| s.buf));
                sges.iter().map(|s| s.buf.len()).sum()
            }
        };
        if total > MAX_PAYLOAD {
            return Err(Error::protocol(
                self.rank,
                format!("work request of {total} B: the soft NIC carries at most {MAX_PAYLOAD} B"),
            ));
        }
        let (h, kind) = match to {
            None => (Header::send(total, imm), WcKind::Send),
            Some(r) => (Header::write(total, r.rkey, r.addr, imm), WcKind::Write),
        };
        if let Err(e) = self.q[q].write_frame(&h, &parts) {
            drop(parts);
            let e = self.io(e);
            return Err(self.failure(e));
        }
        drop(parts);
        self.cq.push(Wc { qp, wr_id, kind });
        Ok(Poll::Ready(()))
    }

    fn expose(&mut self, lkey: u32, _rkey: u32, addr: usize, len: usize) -> Result<u32> {
        if !self.dev.covers(lkey, addr, len) {
            return Err(Error::protocol(
                self.rank,
                format!("advertising {len} B at {addr:#x}: range is not registered"),
            ));
        }
        // Each advertisement gets its own key, so a write can never reach a range advertised
        // earlier under the same registration.
        let key = self.dev.fresh_key();
        self.exposed.insert(
            key,
            Exposed {
                addr: addr as u64,
                len: len as u64,
                credit: false,
            },
        );
        Ok(key)
    }

    fn unexpose(&mut self, rkey: u32) {
        if rkey != self.arena.credit_key {
            self.exposed.remove(&rkey);
        }
    }

    fn poll(&mut self, lent: &mut [IoSliceMut<'_>], out: &mut Vec<Wc>) -> Result<()> {
        self.cq.take(self.rank, out)?;
        match self.poll_inner(lent, out) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.failure(e)),
        }
    }

    fn reap(&mut self, out: &mut Vec<Wc>) -> Result<()> {
        self.cq.take(self.rank, out)
    }

    fn peer_closed(&self, qp: Qp) -> bool {
        let w = &self.q[qp as usize];
        w.eof && w.in_start == w.in_end
    }

    fn wait_fds(&self) -> WaitFds<'_> {
        smallvec::smallvec![self.q[0].sock.fd(), self.q[1].sock.fd()]
    }

    fn transmit_pending(&self) -> bool {
        self.q.iter().any(|w| w.out_pending() > 0)
    }

    fn prepare_wait(&mut self, message_only: bool, interest: &mut Interests) -> Result<bool> {
        interest.clear();
        let failed = self.cq.failed();
        interest.push(Interest {
            fd: 0,
            read: !failed && !self.q[0].eof,
            write: !message_only && self.q[0].out_pending() > 0,
        });
        if !message_only {
            let expecting = !self.posted[1].is_empty() || self.exposed.len() > 1;
            interest.push(Interest {
                fd: 1,
                read: !failed && !self.q[1].eof && expecting,
                write: self.q[1].out_pending() > 0,
            });
        }
        Ok(false)
    }

    fn fail(&mut self, code: u32, why: &str) {
        let e = Error::protocol(self.rank, why.to_string());
        let _ = self.failure((e, Some(code)));
    }

    fn shutdown_send(&mut self) {
        for w in &self.q {
            w.sock.shutdown(std::net::Shutdown::Write);
        }
    }

    fn shutdown_recv(&mut self) {
        for w in &self.q {
            w.sock.shutdown(std::net::Shutdown::Read);
        }
    }

    fn close(&mut self) {
        for w in &mut self.q {
            let _ = w.flush();
            w.sock.shutdown(std::net::Shutdown::Write);
        }
    }

    fn backlog(&self) -> usize {
        self.q.iter().map(|w| w.out_pending()).sum()
    }

    fn tear_down(&mut self) {
        // Both queue pairs: a TCP socket is reset (the peer's blocked and later sends and
        // receives fail at once; a shutdown would leave its sends waiting for room or
        // vanishing), a Unix socket shut both ways (which shuts the peer's end too).
        for w in &self.q {
            match &w.sock {
                Sock::Tcp(s) => {
                    sys::reset(s.as_raw_fd());
                }
                Sock::Unix(s) => {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
        }
    }

    fn hung_up(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        // Only `POLLRDHUP` is asked for; `POLLHUP` and `POLLERR` come unasked: any event is a
        // hang-up. (`PollFd::revents` cannot be used: nix maps unknown bits such as
        // `POLLRDHUP` to `None`.)
        let rdhup = PollFlags::from_bits_retain(libc::POLLRDHUP);
        self.q.iter().any(|w| {
            let mut fds = [PollFd::new(w.sock.fd(), rdhup)];
            matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
        })
    }

    fn cancel_user_receives(&mut self) {
        self.posted[1].clear();
        self.exposed.retain(|_, x| x.credit);
    }
}

// ---------------------------------------------------------------------------------------------
// Raw endpoints (tests and tools)

/// A raw soft-NIC endpoint: the protocol connection over a soft NIC, with verbs-level
/// operations for tests and tools (advertise a region, post a raw RDMA write, progress).
#[derive(Clone)]
pub struct Endpoint {
    conn: Shared<SoftNic>,
    cache: Arc<RegCache<SoftDevice>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint(peer rank {})", proto::lock(&self.conn).rank)
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
    lease: Option<crate::reg::Lease>,
}

fn unix_pair() -> Result<(UnixStream, UnixStream)> {
    UnixStream::pair().map_err(|e| Error::io("socketpair", e))
}

impl Endpoint {
    /// Two connected endpoints over Unix socket pairs (peer ranks 1 and 0), each with its own
    /// protection domain and registration cache (sized by its [`Pd`]).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the socket pairs cannot be created; as
    /// [`over_unix`](Self::over_unix).
    pub fn pair(pd_a: &Arc<Pd>, pd_b: &Arc<Pd>, cfg: SlotConfig) -> Result<(Endpoint, Endpoint)> {
        let (ca, cb) = unix_pair()?;
        let (da, db) = unix_pair()?;
        let (dev_a, dev_b) = (SoftDevice::new(pd_a), SoftDevice::new(pd_b));
        let (arena_a, arena_b) = (SoftArena::new(&dev_a, cfg), SoftArena::new(&dev_b, cfg));
        let (wa, wb) = (arena_a.credit_word(), arena_b.credit_word());
        let na = SoftNic::new(
            1,
            Sock::Unix(ca),
            Sock::Unix(da),
            &dev_a,
            arena_a,
            Remote {
                addr: wb.0,
                rkey: wb.1,
            },
        )?;
        let nb = SoftNic::new(
            0,
            Sock::Unix(cb),
            Sock::Unix(db),
            &dev_b,
            arena_b,
            Remote {
                addr: wa.0,
                rkey: wa.1,
            },
        )?;
        Ok((
            Endpoint::new(na, 1, dev_a, pd_a, cfg)?,
            Endpoint::new(nb, 0, dev_b, pd_b, cfg)?,
        ))
    }

    /// An endpoint over existing Unix streams (control and data queue pairs) whose other ends
    /// are peer `rank` (tests, tools: the other end may be anything, e.g. a fault injector
    /// writing raw frames). The peer's credit word is unknown: credits are returned by
    /// piggybacking only.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the streams cannot be set up or the endpoint's
    /// buffers registered.
    pub fn over_unix(
        ctrl: UnixStream,
        data: UnixStream,
        rank: usize,
        pd: &Arc<Pd>,
        cfg: SlotConfig,
    ) -> Result<Endpoint> {
        let dev = SoftDevice::new(pd);
        let arena = SoftArena::new(&dev, cfg);
        let nic = SoftNic::new(
            rank,
            Sock::Unix(ctrl),
            Sock::Unix(data),
            &dev,
            arena,
            Remote { addr: 0, rkey: 0 },
        )?;
        Endpoint::new(nic, rank, dev, pd, cfg)
    }

    fn new(
        nic: SoftNic,
        rank: usize,
        dev: Arc<SoftDevice>,
        pd: &Arc<Pd>,
        cfg: SlotConfig,
    ) -> Result<Endpoint> {
        let cache = RegCache::new(dev, pd, pd.cache_entries());
        Ok(Endpoint {
            conn: Conn::shared(nic, rank, cfg)?,
            cache,
        })
    }

    /// The link pair over this endpoint (what the driver hands to the core).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the endpoint's descriptors cannot be duplicated for
    /// the two halves.
    pub fn links(&self) -> Result<LinkPair> {
        proto::links(&self.conn, &self.cache, None)
    }

    /// Counters of this end.
    pub fn stats(&self) -> ConnStats {
        proto::lock(&self.conn).stats()
    }

    /// Register `buf`, advertise it for RDMA writes from the peer and post the receive that
    /// takes the writer's completion (the receiver's half of the rendezvous, without the CTS).
    ///
    /// # Errors
    ///
    /// [`Error::Resource`] when `buf` cannot be registered;
    /// [`Error::ConnectionLost`] or
    /// [`Error::PeerClosed`] when the peer is gone;
    /// [`Error::Protocol`] when it breaks the protocol;
    /// [`Error::Poisoned`] once the connection was torn down.
    pub fn advertise(&self, buf: &[u8]) -> Result<Advert> {
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        let lease = self.cache.acquire(addr, len)?;
        let mut c = proto::lock(&self.conn);
        let key = c.nic.expose(lease.lkey(), lease.rkey(), addr, len)?;
        c.nic.post_recv(Qp::Data, u64::MAX, Dst::User(&[]))?;
        Ok(Advert {
            key,
            addr: addr as u64,
            len: len as u64,
            lease: Some(lease),
        })
    }

    /// Withdraw an advertisement and release its registration.
    pub fn withdraw(&self, mut a: Advert) {
        {
            let mut c = proto::lock(&self.conn);
            c.nic.unexpose(a.key);
            c.nic.cancel_user_receives();
        }
        if let Some(l) = a.lease.take() {
            self.cache.release(l);
        }
    }

    /// Post a raw RDMA write of `data` to the peer's `(key, addr)` with the completion
    /// immediate, as verbs would: the local source must be registered; the remote side
    /// decides whether the write is allowed.
    ///
    /// # Errors
    ///
    /// [`Error::Resource`] when the source is not registered;
    /// [`Error::ConnectionLost`] or
    /// [`Error::PeerClosed`] when the peer is gone;
    /// [`Error::Protocol`] when it breaks the protocol;
    /// [`Error::Poisoned`] once the connection was torn down.
    pub fn rdma_write(&self, key: u32, addr: u64, data: &[u8]) -> Result<()> {
        let mut c = proto::lock(&self.conn);
        c.check()?;
        let Some((lkey, _)) = self.cache.lookup(data.as_ptr() as usize, data.len()) else {
            return Err(Error::protocol(
                c.rank,
                "RDMA write from unregistered local memory (register it first)",
            ));
        };
        let sge = [crate::provider::Sge { buf: data, lkey }];
        let r = c.nic.post_write(
            Qp::Data,
            u64::MAX,
            Src::User(&sge),
            Remote { addr, rkey: key },
            Some(wire::IMM_WRITE_DONE),
        );
        match c.guard(r)? {
            Poll::Ready(()) => Ok(()),
            Poll::Pending => Err(Error::Resource("soft NIC send queue full".into())),
        }
    }

    /// Drive the NIC, landing RDMA writes for `a` into `buf` (which must be the advertised
    /// memory). `Ready(n)` once the writer's completion arrived (`n`: bytes of its last
    /// write).
    ///
    /// # Errors
    ///
    /// [`Error::ConnectionLost`] or
    /// [`Error::PeerClosed`] when the peer is gone;
    /// [`Error::Protocol`] when it breaks the protocol;
    /// [`Error::Poisoned`] once the connection was torn down.
    pub fn receive_writes(&self, a: &Advert, buf: &mut [u8]) -> Result<Poll<usize>> {
        let mut c = proto::lock(&self.conn);
        c.check()?;
        if buf.as_ptr() as u64 != a.addr || buf.len() as u64 != a.len {
            return Err(Error::BadConfig(
                "buffer is not the advertised region".into(),
            ));
        }
        let mut lent = [IoSliceMut::new(buf)];
        c.poll_nic(&mut lent)?;
        Ok(match c.take_data_recv() {
            Some((_, len, _)) => Poll::Ready(len),
            None => Poll::Pending,
        })
    }

    /// Drive the NIC once (flush, receive on both queue pairs); reports errors the peer sent
    /// and refuses bad RDMA writes waiting on the data queue pair.
    ///
    /// # Errors
    ///
    /// [`Error::ConnectionLost`] or
    /// [`Error::PeerClosed`] when the peer is gone;
    /// [`Error::Protocol`] when it breaks the protocol;
    /// [`Error::Poisoned`] once the connection was torn down. Also the
    /// errors the peer reported, and bad RDMA writes.
    pub fn progress(&self) -> Result<()> {
        let mut c = proto::lock(&self.conn);
        c.check()?;
        c.nic.eager = true;
        let r = c.poll_nic(&mut []);
        c.nic.eager = false;
        r
    }

    /// Block until the connection may have progressed, at most `t`.
    ///
    /// # Errors
    ///
    /// [`Error::ConnectionLost`] or
    /// [`Error::PeerClosed`] when the peer is gone;
    /// [`Error::Protocol`] when it breaks the protocol;
    /// [`Error::Poisoned`] once the connection was torn down.
    pub fn wait(&self, t: Duration) -> Result<()> {
        proto::wait_conn(&self.conn, false, t)
    }
}
