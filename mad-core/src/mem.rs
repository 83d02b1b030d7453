//! `mem`: an in-process driver between the threads of one process.
//!
//! It exists for three reasons: unit-testing the engine without a network (it is *strict*:
//! it checks that the receiver's copy buffers and gather groups have exactly the shape the
//! sender produced, so any asymmetry in the switch, the BMMs or commit/checkout is reported as
//! an error instead of being hidden by a byte stream); measuring the engine's own overhead;
//! and serving as the smallest complete example of the driver contract. Use it with
//! [`ThreadBootstrap`](crate::bootstrap::ThreadBootstrap).
//!
//! Spec: `mem[,buf=<bytes>][,frames=<n>][,copy_max=<bytes>][,max_message=<bytes>]` (`frames`
//! ≤ 8: the frame pool is allocated at open, so nothing is allocated afterwards;
//! `max_message` declares a bound on a message's payload in the driver's
//! [`Capabilities`], which the engine enforces: a test knob for drivers that have one). TMs: `copy` (Bmm::Copy, buffers
//! of `buf` bytes, default 4096) up to `copy_max` (default 1024), then `gather` (Bmm::Gather,
//! groups of up to 8 slices). Each direction holds at most `frames` frames (default 64): a
//! sender that finds it full gets `Poll::Pending` (back-pressure).
//!
//! Readiness descriptor: an eventfd per rank, written by a pusher (or a closing peer, a wake,
//! a reader freeing room for an armed send) only while the rank is armed; the armed flag lives
//! under the doorbell's lock, which every push takes anyway.

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::Poll;
use std::time::Duration;

use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::channel::lock;
use crate::config::ChannelConfig;
use crate::driver::{
    AbortOutcome, Adapters, Armed, Capabilities, Driver, DriverOptions, Incoming, LinkPair,
    OpenContext, OpenedChannel, RxLink, TmId, TmSpec, TmTable, TxLink,
};
use crate::error::{Error, Result};
use crate::liveness::{ProbeGate, Teardown};

/// Initial capacity of a frame buffer: frames are recycled, so after a warm-up the driver does
/// not allocate for messages whose groups fit (the engine's no-allocation test relies on it).
const FRAME_CAPACITY: usize = 64 << 10;

enum Frame {
    Buf {
        tm: TmId,
        data: Vec<u8>,
    },
    Group {
        tm: TmId,
        data: Vec<u8>,
        lens: Vec<usize>,
    },
}

struct PipeState {
    frames: VecDeque<Frame>,
    free: Vec<Vec<u8>>,
    free_lens: Vec<Vec<usize>>,
    closed: bool,
    /// The writer armed its readiness descriptor on this full pipe (`arm_send`): the reader
    /// signals it when it takes a frame.
    tx_armed: bool,
}

struct Pipe {
    st: Mutex<PipeState>,
    cv: Condvar,
    max_frames: usize,
    /// The reader's doorbell.
    doorbell: Arc<Doorbell>,
    /// The writer's doorbell (its readiness descriptor, for an armed send).
    writer_bell: Arc<Doorbell>,
}

#[derive(Default)]
struct BellState {
    /// Bumped by every push, close and wake.
    n: u64,
    /// The readiness descriptor is armed: the next ring writes the eventfd.
    armed: bool,
    /// A wake or an armed send's progress since the last arm: the next arm says busy.
    pending: bool,
    /// The channel was shut down.
    shut: bool,
}

/// A rank's doorbell: pushes, closes and wakes ring it; its readiness descriptor is `efd`.
struct Doorbell {
    st: Mutex<BellState>,
    cv: Condvar,
    efd: Option<EventFd>,
}

impl Default for Doorbell {
    fn default() -> Self {
        Doorbell {
            st: Mutex::default(),
            cv: Condvar::new(),
            efd: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).ok(),
        }
    }
}

impl Doorbell {
    /// A push or close: wake the waiters, and the descriptor if armed.
    fn ring(&self) {
        let mut st = lock(&self.st);
        st.n += 1;
        if st.armed {
            st.armed = false;
            self.signal();
        }
        drop(st);
        self.cv.notify_all();
    }

    /// A wake or an armed send's progress: [`ring`](Self::ring), the next arm says busy, and
    /// the descriptor is written whether armed or not (a send armed after the last arm must
    /// not be lost by it).
    fn poke(&self, send: bool) {
        let mut st = lock(&self.st);
        st.n += 1;
        st.pending = true;
        if st.armed || send {
            st.armed = false;
            self.signal();
        }
        drop(st);
        self.cv.notify_all();
    }

    fn signal(&self) {
        if let Some(e) = &self.efd {
            let _ = e.write(1);
        }
    }
}

impl Pipe {
    /// Close this direction: its writer's pushes and its reader's polls fail (once drained).
    fn close(&self) {
        let mut st = lock(&self.st);
        st.closed = true;
        let armed = std::mem::take(&mut st.tx_armed);
        drop(st);
        self.cv.notify_all();
        self.doorbell.ring();
        if armed {
            self.writer_bell.poke(true);
        }
    }
}

/// Tear a connection down in both directions (an abandoned message): both pipes close, so
/// the peer's sends and receives fail, and both local halves fail from now on.
fn tear_down(torn: &Teardown, out: &Pipe, inbound: &Pipe, cause: &str) {
    torn.tear(cause);
    out.close();
    inbound.close();
}

struct Fabric {
    /// `pipes[src * size + dst]`
    pipes: Vec<Arc<Pipe>>,
    bells: Vec<Arc<Doorbell>>,
}

fn fabrics() -> &'static Mutex<HashMap<String, Arc<Fabric>>> {
    static F: OnceLock<Mutex<HashMap<String, Arc<Fabric>>>> = OnceLock::new();
    F.get_or_init(Default::default)
}

/// The in-process driver (see the module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct MemDriver;

struct Params {
    buf: usize,
    frames: usize,
    copy_max: usize,
    max_message: Option<u64>,
}

fn params(c: &ChannelConfig) -> Result<Params> {
    Ok(Params {
        buf: c.option_in("buf", 1, 64 << 20)?.unwrap_or(4096),
        frames: c.option_in("frames", 1, 1 << 16)?.unwrap_or(64),
        copy_max: c.option_in("copy_max", 0, usize::MAX)?.unwrap_or(1024),
        max_message: c
            .option_size_in("max_message", 0, usize::MAX)?
            .map(|n| n as u64),
    })
}

impl Driver for MemDriver {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn describe(&self) -> String {
        "in-process, threads of one process only (tests)".into()
    }

    fn accepted_options(&self, _config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(
            Adapters::None,
            &["buf", "frames", "copy_max", "max_message"],
        )
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        let p = params(config)?;
        TmTable::new([
            TmSpec::copy("copy", p.copy_max, "copied into fixed-size frames"),
            TmSpec::gather(
                "gather",
                usize::MAX,
                8,
                "one frame per group, shape checked",
            ),
        ])
    }

    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        // A malformed `max_message` fails `tm_table`, which the session calls first.
        let max = params(config).ok().and_then(|p| p.max_message);
        Capabilities::default()
            .with_direct_poll_limit(64)
            .with_detects_peer_death(true)
            .with_intra_node_only(true)
            .with_max_message(max)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let p = params(ctx.config)?;
        let b = ctx.bootstrap;
        let (rank, size) = (b.rank(), b.size());
        // Rank 0 names the fabric; everybody learns the name from the bootstrap.
        let key = format!("{}/{}", ctx.tag("mem"), b.secret().to_hex());
        let names = b.allgather(&ctx.tag("mem-open"), key.as_bytes())?;
        if names.iter().any(|n| n.as_slice() != key.as_bytes()) {
            return Err(Error::BadConfig(
                "mem driver: ranks disagree on the channel (not one process?)".into(),
            ));
        }
        let fabric = {
            let mut f = lock(fabrics());
            f.entry(key.clone())
                .or_insert_with(|| {
                    let bells: Vec<Arc<Doorbell>> =
                        (0..size).map(|_| Arc::new(Doorbell::default())).collect();
                    // Frames in existence never exceed the queue's bound plus the two the
                    // receiver may hold (a copy frame and a group). For a small queue
                    // (`frames` ≤ 8) allocate them all now, so the steady state allocates
                    // nothing whatever the threads' interleaving (the engine's no-allocation
                    // test runs over `mem,frames=8`); larger queues grow on demand.
                    let pool = if p.frames <= 8 { p.frames + 2 } else { 0 };
                    let pipes = (0..size * size)
                        .map(|i| {
                            Arc::new(Pipe {
                                st: Mutex::new(PipeState {
                                    frames: VecDeque::with_capacity(p.frames),
                                    free: (0..pool)
                                        .map(|_| Vec::with_capacity(FRAME_CAPACITY))
                                        .collect(),
                                    free_lens: (0..pool).map(|_| Vec::with_capacity(16)).collect(),
                                    closed: false,
                                    tx_armed: false,
                                }),
                                cv: Condvar::new(),
                                max_frames: p.frames,
                                doorbell: bells[i % size].clone(),
                                writer_bell: bells[i / size].clone(),
                            })
                        })
                        .collect();
                    Arc::new(Fabric { pipes, bells })
                })
                .clone()
        };
        b.barrier(&ctx.tag("mem-ready"))?;
        if rank == 0 {
            lock(fabrics()).remove(&key);
        }
        let links = (0..size)
            .map(|peer| {
                (peer != rank).then(|| {
                    link_pair(
                        peer,
                        &fabric.pipes[rank * size + peer],
                        &fabric.pipes[peer * size + rank],
                        p.buf,
                    )
                })
            })
            .collect();
        let inbound = (0..size)
            .filter(|&s| s != rank)
            .map(|s| (s, fabric.pipes[s * size + rank].clone()))
            .collect();
        let outbound = (0..size)
            .filter(|&d| d != rank)
            .map(|d| fabric.pipes[rank * size + d].clone())
            .collect();
        Ok(OpenedChannel::new(
            links,
            Box::new(MemIncoming {
                inbound,
                outbound,
                forgotten: (0..size).map(|_| AtomicBool::new(false)).collect(),
                bell: fabric.bells[rank].clone(),
            }),
        )
        .with_notes(vec![format!(
            "mem: {} B frames, at most {} frames per direction",
            p.buf, p.frames
        )]))
    }
}

/// The links to `peer`: sending into `out`, receiving from `inbound`, frames of `buf` bytes.
fn link_pair(peer: usize, out: &Arc<Pipe>, inbound: &Arc<Pipe>, buf: usize) -> LinkPair {
    let torn = Arc::new(Teardown::new());
    LinkPair {
        tx: Box::new(MemTx {
            peer,
            pipe: out.clone(),
            back: inbound.clone(),
            torn: torn.clone(),
            gate: ProbeGate::new(),
            buf: vec![0; buf],
            used: 0,
            tm: 0,
            msg: 0,
            pushed: false,
        }),
        rx: Box::new(MemRx {
            pipe: inbound.clone(),
            back: out.clone(),
            torn,
            cur: None,
            off: 0,
            peer,
        }),
    }
}

/// An in-process relay for a virtual channel's forwarder ([`crate::vchan`]): the links
/// between this rank (`me`) and one endpoint per rank of `origins`, each endpoint standing in
/// for that rank. Returns this rank's links and incoming (a channel whose peers are
/// `origins`), and each origin's (a channel whose one peer is `me`). Frames are `buf` bytes,
/// at most `frames` per direction (back-pressure).
pub(crate) fn relay(
    me: usize,
    size: usize,
    origins: &[usize],
    frames: usize,
    buf: usize,
) -> (OpenedChannel, Vec<(usize, OpenedChannel)>) {
    let bells: Vec<Arc<Doorbell>> = (0..size).map(|_| Arc::new(Doorbell::default())).collect();
    let pipe = |from: usize, to: usize| {
        Arc::new(Pipe {
            st: Mutex::new(PipeState {
                frames: VecDeque::with_capacity(frames),
                free: Vec::new(),
                free_lens: Vec::new(),
                closed: false,
                tx_armed: false,
            }),
            cv: Condvar::new(),
            max_frames: frames,
            doorbell: bells[to].clone(),
            writer_bell: bells[from].clone(),
        })
    };
    let pair =
        |peer: usize, out: &Arc<Pipe>, inbound: &Arc<Pipe>| link_pair(peer, out, inbound, buf);
    let mut mine: Vec<Option<LinkPair>> = (0..size).map(|_| None).collect();
    let (mut inbound, mut outbound, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
    for &o in origins {
        let (to_me, from_me) = (pipe(o, me), pipe(me, o));
        mine[o] = Some(pair(o, &from_me, &to_me));
        inbound.push((o, to_me.clone()));
        outbound.push(from_me.clone());
        let mut links: Vec<Option<LinkPair>> = (0..size).map(|_| None).collect();
        links[me] = Some(pair(me, &to_me, &from_me));
        let incoming = MemIncoming {
            inbound: vec![(me, from_me)],
            outbound: vec![to_me],
            forgotten: (0..size).map(|_| AtomicBool::new(false)).collect(),
            bell: bells[o].clone(),
        };
        theirs.push((o, OpenedChannel::new(links, Box::new(incoming))));
    }
    let incoming = MemIncoming {
        inbound,
        outbound,
        forgotten: (0..size).map(|_| AtomicBool::new(false)).collect(),
        bell: bells[me].clone(),
    };
    (OpenedChannel::new(mine, Box::new(incoming)), theirs)
}

struct MemTx {
    peer: usize,
    pipe: Arc<Pipe>,
    /// The other direction (closed with this one when the connection is torn down).
    back: Arc<Pipe>,
    /// Shared with the receiving half.
    torn: Arc<Teardown>,
    /// Rate limit of the peer-gone check of `begin_message`.
    gate: ProbeGate,
    buf: Vec<u8>,
    used: usize,
    tm: TmId,
    msg: u64,
    pushed: bool,
}

impl MemTx {
    /// Push the current copy buffer as a frame; `Pending` if the pipe is full.
    fn push_buf(&mut self) -> Result<Poll<()>> {
        if self.used == 0 {
            return Ok(Poll::Ready(()));
        }
        let mut st = lock(&self.pipe.st);
        if st.closed {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        if st.frames.len() >= self.pipe.max_frames {
            return Ok(Poll::Pending);
        }
        let mut data = st
            .free
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(FRAME_CAPACITY));
        data.clear();
        data.extend_from_slice(&self.buf[..self.used]);
        st.frames.push_back(Frame::Buf { tm: self.tm, data });
        drop(st);
        self.used = 0;
        self.pushed = true;
        self.pipe.cv.notify_all();
        self.pipe.doorbell.ring();
        Ok(Poll::Ready(()))
    }
}

impl TxLink for MemTx {
    fn begin_message(&mut self) -> Result<()> {
        self.torn.check(self.peer)?;
        // A peer that went away while we were idle (its receiving half closed the pipe).
        if self.gate.due() && lock(&self.pipe.st).closed {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        self.msg += 1;
        self.pushed = false;
        Ok(())
    }

    fn with_buffer(
        &mut self,
        tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        if ((tm != self.tm && self.used > 0) || self.used == self.buf.len())
            && self.push_buf()?.is_pending()
        {
            return Ok(Poll::Pending);
        }
        self.tm = tm;
        let n = fill(&mut self.buf[self.used..]);
        self.used += n.min(self.buf.len() - self.used);
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        // Order: a copy buffer still open goes first.
        if self.push_buf()?.is_pending() {
            return Ok(Poll::Pending);
        }
        let mut st = lock(&self.pipe.st);
        if st.closed {
            return Err(Error::PeerClosed { rank: self.peer });
        }
        if st.frames.len() >= self.pipe.max_frames {
            return Ok(Poll::Pending);
        }
        let mut data = st
            .free
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(FRAME_CAPACITY));
        let mut lens = st.free_lens.pop().unwrap_or_else(|| Vec::with_capacity(16));
        data.clear();
        lens.clear();
        for s in iov {
            data.extend_from_slice(s);
            lens.push(s.len());
        }
        st.frames.push_back(Frame::Group { tm, data, lens });
        drop(st);
        self.pushed = true;
        self.pipe.cv.notify_all();
        self.pipe.doorbell.ring();
        Ok(Poll::Ready(()))
    }

    fn commit(&mut self, _tm: TmId) -> Result<Poll<()>> {
        self.push_buf()
    }

    fn flush(&mut self) -> Result<Poll<()>> {
        self.push_buf()
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        self.push_buf()
    }

    fn abort_message(&mut self) -> AbortOutcome {
        self.used = 0;
        if self.pushed {
            tear_down(
                &self.torn,
                &self.pipe,
                &self.back,
                "a message was abandoned after part of it was sent",
            );
            AbortOutcome::Broken
        } else {
            AbortOutcome::Discarded
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let st = lock(&self.pipe.st);
        if st.frames.len() >= self.pipe.max_frames && !st.closed {
            let _ = self.pipe.cv.wait_timeout(st, timeout);
        }
        Ok(())
    }

    /// Under the pipe's lock: room or a closed pipe is `Busy`; otherwise the reader's next
    /// pop (or a close) writes this rank's eventfd.
    fn arm_send(&mut self) -> Result<Armed> {
        if self.pipe.writer_bell.efd.is_none() {
            return Ok(Armed::Busy);
        }
        let mut st = lock(&self.pipe.st);
        if st.closed || st.frames.len() < self.pipe.max_frames {
            return Ok(Armed::Busy);
        }
        st.tx_armed = true;
        Ok(Armed::Armed)
    }
}

impl Drop for MemTx {
    fn drop(&mut self) {
        self.pipe.close();
    }
}

struct MemRx {
    pipe: Arc<Pipe>,
    /// The other direction (closed with this one when the connection is torn down).
    back: Arc<Pipe>,
    /// Shared with the sending half.
    torn: Arc<Teardown>,
    cur: Option<(TmId, Vec<u8>)>,
    off: usize,
    peer: usize,
}

impl MemRx {
    fn recycle(&mut self) {
        if let Some((_, data)) = self.cur.take() {
            lock(&self.pipe.st).free.push(data);
        }
        self.off = 0;
    }

    fn pop(&mut self) -> Result<Option<Frame>> {
        let mut st = lock(&self.pipe.st);
        match st.frames.pop_front() {
            Some(f) => {
                let armed = std::mem::take(&mut st.tx_armed);
                drop(st);
                self.pipe.cv.notify_all();
                if armed {
                    self.pipe.writer_bell.poke(true);
                }
                Ok(Some(f))
            }
            None if st.closed => Err(Error::PeerClosed { rank: self.peer }),
            None => Ok(None),
        }
    }
}

impl RxLink for MemRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        self.torn.check(self.peer)?;
        if let Some((_, d)) = &self.cur {
            if self.off < d.len() {
                return Ok(Poll::Ready(()));
            }
        }
        let st = lock(&self.pipe.st);
        if !st.frames.is_empty() {
            Ok(Poll::Ready(()))
        } else if st.closed {
            Err(Error::PeerClosed { rank: self.peer })
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
        let exhausted = match &self.cur {
            Some((_, d)) => self.off >= d.len(),
            None => true,
        };
        if exhausted {
            self.recycle();
            match self.pop()? {
                None => return Ok(Poll::Pending),
                Some(Frame::Buf { tm: ftm, data }) => {
                    if ftm != tm {
                        return Err(Error::protocol(
                            self.peer,
                            format!(
                                "mem: receiver reads copy TM {tm} but the sender filled TM {ftm}"
                            ),
                        ));
                    }
                    self.cur = Some((ftm, data));
                }
                Some(Frame::Group { tm: ftm, lens, .. }) => {
                    return Err(Error::protocol(
                        self.peer,
                        format!("mem: receiver reads copy TM {tm} but the sender sent a TM {ftm} group {lens:?}"),
                    ));
                }
            }
        }
        let Some((ftm, d)) = &self.cur else {
            return Ok(Poll::Pending);
        };
        if *ftm != tm {
            return Err(Error::protocol(
                self.peer,
                format!("mem: copy TM {tm} read inside a TM {ftm} buffer"),
            ));
        }
        let n = take(&d[self.off..]);
        self.off += n;
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        if let Some((_, d)) = &self.cur {
            if self.off < d.len() {
                return Err(Error::protocol(
                    self.peer,
                    format!(
                        "mem: gather receive while {} bytes of a copy buffer are unread",
                        d.len() - self.off
                    ),
                ));
            }
        }
        self.recycle();
        match self.pop()? {
            None => Ok(Poll::Pending),
            Some(Frame::Group { tm: ftm, data, lens }) => {
                let same = lens.len() == iov.len() && lens.iter().zip(iov.iter()).all(|(a, b)| *a == b.len());
                if ftm != tm || !same {
                    let mine: Vec<usize> = iov.iter().map(|s| s.len()).collect();
                    return Err(Error::protocol(
                        self.peer,
                        format!("mem: sender's group TM {ftm} {lens:?} differs from receiver's TM {tm} {mine:?}"),
                    ));
                }
                let mut off = 0;
                for s in iov.iter_mut() {
                    let n = s.len();
                    s.copy_from_slice(&data[off..off + n]);
                    off += n;
                }
                let mut st = lock(&self.pipe.st);
                st.free.push(data);
                st.free_lens.push(lens);
                Ok(Poll::Ready(()))
            }
            Some(Frame::Buf { tm: ftm, data, .. }) => Err(Error::protocol(
                self.peer,
                format!("mem: receiver expects a TM {tm} group but the sender sent a {} B TM {ftm} buffer", data.len()),
            )),
        }
    }

    fn checkout(&mut self, tm: TmId) -> Result<()> {
        if let Some((ftm, d)) = &self.cur {
            if *ftm == tm && self.off < d.len() {
                return Err(Error::protocol(
                    self.peer,
                    format!(
                        "mem: checkout of TM {tm} with {} bytes unread (sender/receiver disagree)",
                        d.len() - self.off
                    ),
                ));
            }
        }
        Ok(())
    }

    fn end_message(&mut self) -> Result<()> {
        if let Some((_, d)) = &self.cur {
            if self.off < d.len() {
                return Err(Error::protocol(
                    self.peer,
                    "mem: end of message with unread bytes",
                ));
            }
        }
        self.recycle();
        Ok(())
    }

    fn abort_message(&mut self) {
        self.recycle();
        tear_down(
            &self.torn,
            &self.back,
            &self.pipe,
            "a message was abandoned midway by the receiver; the stream is out of step",
        );
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let st = lock(&self.pipe.st);
        if st.frames.is_empty() && !st.closed {
            let _ = self.pipe.cv.wait_timeout(st, timeout);
        }
        Ok(())
    }
}

impl Drop for MemRx {
    fn drop(&mut self) {
        // Nobody reads this direction any more: the peer's sends fail instead of queueing.
        self.pipe.close();
    }
}

struct MemIncoming {
    inbound: Vec<(usize, Arc<Pipe>)>,
    outbound: Vec<Arc<Pipe>>,
    /// Peers the core stopped watching ([`Incoming::forget`]): a closed pipe of theirs no
    /// longer makes an arm busy.
    forgotten: Vec<AtomicBool>,
    bell: Arc<Doorbell>,
}

impl Incoming for MemIncoming {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        for (r, p) in &self.inbound {
            let st = lock(&p.st);
            if !st.frames.is_empty() || st.closed {
                ready(*r);
            }
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        // Check under the doorbell lock so a frame pushed after the core's last poll is not
        // missed (pushers ring the bell after releasing their pipe lock).
        let g = lock(&self.bell.st);
        if g.shut
            || self
                .inbound
                .iter()
                .any(|(_, p)| !lock(&p.st).frames.is_empty())
        {
            return Ok(());
        }
        let seen = g.n;
        let _ = self
            .bell
            .cv
            .wait_timeout_while(g, timeout, |st| st.n == seen && !st.shut);
        Ok(())
    }

    fn wake(&self) {
        self.bell.poke(false);
    }

    fn forget(&self, rank: usize) {
        if let Some(f) = self.forgotten.get(rank) {
            f.store(true, Ordering::Relaxed);
        }
    }

    fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.bell.efd.as_ref().map(|e| e.as_fd())
    }

    /// Under the doorbell lock: set the armed flag, drain the eventfd, take a pending wake;
    /// then look at the pipes (a pusher rings the doorbell after its push, so one of the two
    /// sees the other).
    fn arm(&self) -> Result<Armed> {
        let Some(efd) = &self.bell.efd else {
            return Ok(Armed::Busy);
        };
        {
            let mut st = lock(&self.bell.st);
            if st.shut {
                return Ok(Armed::Busy);
            }
            st.armed = true;
            let _ = efd.read();
            if std::mem::take(&mut st.pending) {
                return Ok(Armed::Busy);
            }
        }
        let ready = self.inbound.iter().any(|(r, p)| {
            let st = lock(&p.st);
            !st.frames.is_empty() || (st.closed && !self.forgotten[*r].load(Ordering::Relaxed))
        });
        Ok(if ready { Armed::Busy } else { Armed::Armed })
    }

    /// Close every pipe of this rank, both directions: the peers see a clean close (their
    /// sends fail, their receives once drained), blocked link waits wake on the pipes'
    /// condition variables, `wait` on the doorbell's.
    fn shutdown(&self) {
        lock(&self.bell.st).shut = true;
        for p in self
            .outbound
            .iter()
            .chain(self.inbound.iter().map(|(_, p)| p))
        {
            p.close();
        }
        self.bell.poke(false);
    }
}
