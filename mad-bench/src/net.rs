//! What the patterns run over: Madeleine channels (in a given mode pair), drivers without the
//! engine, and the raw baselines (TCP sockets, a shared-memory polled ring and mailbox; memcpy
//! needs no endpoint).

use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::driver::{Bmm, LinkPair, OpenContext, OpenedChannel, RxLink, TmId, TmTable, TxLink};
use mad_core::progress::ProgressPolicy;
use mad_core::{Channel, ChannelConfig, Error, RecvMode, Result, SendMode, Session};

use super::sys::{Shared, RING_HEADER};

/// One endpoint of a benchmark pattern: sends and receives whole messages to and from peers.
///
/// Raw baselines move `max(len, 1)` bytes (a byte stream cannot carry an empty message).
pub trait Net: Send {
    /// Send one message of `msg.len()` bytes.
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()>;
    /// Receive one message of exactly `buf.len()` bytes.
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()>;
    /// Send an RPC: an 8-byte header giving the body length, then the body.
    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()>;
    /// Receive an RPC into `buf`; returns the body length.
    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize>;

    /// A whole ping-pong loop of `warm + iters` round trips, for endpoints that run it
    /// differently from `send`/`recv` in a loop (the async adapter: one runtime entry for the
    /// loop); returns the timed part's seconds. `None`: use `send`/`recv`.
    fn pingpong(
        &mut self,
        peer: usize,
        initiator: bool,
        warm: usize,
        iters: usize,
        s: &[u8],
        r: &mut [u8],
    ) -> Option<Result<f64>> {
        let _ = (peer, initiator, warm, iters, s, r);
        None
    }

    /// One poll for a message from `peer` while none is sent: the cost of looking and finding
    /// nothing. `None`: this endpoint has no such poll (its receives block, or it polls inside
    /// its own runtime).
    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        let _ = peer;
        None
    }
}

/// What [`Net::poll_idle`] returns when it finds a message.
fn found(peer: usize) -> Error {
    Error::protocol(peer, "poll: a message arrived while none was sent")
}

/// The mode pair a Madeleine endpoint packs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One piece, send CHEAPER / receive CHEAPER.
    Cc,
    /// One piece, send SAFER / receive EXPRESS.
    Se,
    /// `k` equal pieces (the last takes the remainder), CHEAPER / CHEAPER.
    Pieces(usize),
}

impl Mode {
    /// Name used in tables and CSV.
    pub fn name(self) -> String {
        match self {
            Mode::Cc => "cheaper/cheaper".into(),
            Mode::Se => "safer/express".into(),
            Mode::Pieces(k) => format!("{k} pieces"),
        }
    }

    /// The mode of a `--modes` item: `cheaper`, `safer`, or a number of pieces (2 or more).
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "cheaper" => Some(Mode::Cc),
            "safer" => Some(Mode::Se),
            k => k.parse().ok().filter(|&k| k >= 2).map(Mode::Pieces),
        }
    }

    /// The smallest message this mode can carry (one byte per piece).
    pub fn min_size(self) -> usize {
        match self {
            Mode::Pieces(k) => k,
            _ => 0,
        }
    }
}

/// A Madeleine channel used in one mode pair.
#[derive(Clone)]
pub struct MadNet {
    ch: Channel,
    mode: Mode,
}

impl MadNet {
    /// Open channel `name` with `spec` (collective).
    pub fn open(session: &Session, name: &str, spec: &str, mode: Mode) -> Result<MadNet> {
        let ch = session.open_channel_with(ChannelConfig::parse(name, spec)?)?;
        Ok(MadNet { ch, mode })
    }

    /// The same channel in another mode pair.
    pub fn with_mode(&self, mode: Mode) -> MadNet {
        MadNet {
            ch: self.ch.clone(),
            mode,
        }
    }
}

/// A message split in `k` equal pieces (the last takes the remainder).
fn pieces(msg: &[u8], k: usize) -> impl Iterator<Item = &[u8]> {
    let step = msg.len() / k;
    (0..k).map(move |i| {
        let end = if i == k - 1 {
            msg.len()
        } else {
            (i + 1) * step
        };
        &msg[i * step..end]
    })
}

/// A receive buffer split as [`pieces`] splits the message.
fn pieces_mut(buf: &mut [u8], k: usize) -> impl Iterator<Item = &mut [u8]> {
    let step = buf.len() / k;
    let mut rest = buf;
    (0..k).map(move |i| {
        let take = if i == k - 1 { rest.len() } else { step };
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(take);
        rest = tail;
        piece
    })
}

impl Net for MadNet {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        let mut p = self.ch.begin_packing(peer)?;
        match self.mode {
            Mode::Cc => p.pack(msg, RecvMode::Cheaper)?,
            Mode::Se => p.pack_safer(msg, RecvMode::Express)?,
            Mode::Pieces(k) => {
                for piece in pieces(msg, k) {
                    p.pack(piece, RecvMode::Cheaper)?;
                }
            }
        }
        p.end_packing()
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let mut u = self.ch.begin_unpacking_from(peer)?;
        match self.mode {
            Mode::Cc => u.unpack(buf, SendMode::Cheaper)?,
            Mode::Se => u.unpack_express(buf, SendMode::Safer)?,
            Mode::Pieces(k) => {
                for piece in pieces_mut(buf, k) {
                    u.unpack(piece, SendMode::Cheaper)?;
                }
            }
        }
        u.end_unpacking()
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        let mut p = self.ch.begin_packing(peer)?;
        // Nothing waits between the pieces: the size goes out with the body.
        p.flush_at_end();
        p.pack_value(&(body.len() as u64), RecvMode::Express)?;
        p.pack(body, RecvMode::Cheaper)?;
        p.end_packing()
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let mut u = self.ch.begin_unpacking_from(peer)?;
        let n: u64 = u.unpack_value()?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= buf.len())
            .ok_or_else(|| Error::protocol(peer, format!("RPC body of {n} bytes too large")))?;
        u.unpack(&mut buf[..n], SendMode::Cheaper)?;
        u.end_unpacking()?;
        Ok(n)
    }

    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        Some(match self.ch.try_begin_unpacking_from(peer) {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err(found(peer)),
            Err(e) => Err(e),
        })
    }
}

/// A Madeleine channel through the tokio adapter (`mad-tokio`), each call one `block_on` of a
/// current-thread runtime (so the figure includes entering the runtime once per message).
pub struct AsyncNet {
    rt: tokio::runtime::Runtime,
    ch: mad_tokio::AsyncChannel,
    mode: Mode,
}

impl AsyncNet {
    /// Wrap an opened channel.
    pub fn new(net: &MadNet) -> Result<AsyncNet> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::io("tokio runtime", e))?;
        let ch = {
            let _g = rt.enter();
            mad_tokio::AsyncChannel::new(net.ch.clone())?
        };
        Ok(AsyncNet {
            rt,
            ch,
            mode: net.mode,
        })
    }
}

impl Net for AsyncNet {
    fn pingpong(
        &mut self,
        peer: usize,
        initiator: bool,
        warm: usize,
        iters: usize,
        s: &[u8],
        r: &mut [u8],
    ) -> Option<Result<f64>> {
        let ch = &self.ch;
        Some(self.rt.block_on(async {
            let mut t0 = std::time::Instant::now();
            for i in 0..warm + iters {
                if i == warm {
                    t0 = std::time::Instant::now();
                }
                if initiator {
                    let mut p = ch.begin_packing(peer).await?;
                    p.pack(s, RecvMode::Cheaper)?;
                    p.end_packing().await?;
                }
                let mut u = ch.begin_unpacking_from(peer).await?;
                u.unpack(r, SendMode::Cheaper)?;
                u.end_unpacking().await?;
                if !initiator {
                    let mut p = ch.begin_packing(peer).await?;
                    p.pack(r, RecvMode::Cheaper)?;
                    p.end_packing().await?;
                }
            }
            Ok(t0.elapsed().as_secs_f64())
        }))
    }

    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        let (ch, mode) = (&self.ch, self.mode);
        self.rt.block_on(async {
            let mut p = ch.begin_packing(peer).await?;
            match mode {
                Mode::Cc => p.pack(msg, RecvMode::Cheaper)?,
                Mode::Se => p.pack_safer(msg, RecvMode::Express)?,
                Mode::Pieces(k) => {
                    for piece in pieces(msg, k) {
                        p.pack(piece, RecvMode::Cheaper)?;
                    }
                }
            }
            p.end_packing().await
        })
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let (ch, mode) = (&self.ch, self.mode);
        self.rt.block_on(async {
            let mut u = ch.begin_unpacking_from(peer).await?;
            match mode {
                Mode::Cc => u.unpack(buf, SendMode::Cheaper)?,
                Mode::Se => u.unpack_express(buf, SendMode::Safer).await?,
                Mode::Pieces(k) => {
                    for piece in pieces_mut(buf, k) {
                        u.unpack(piece, SendMode::Cheaper)?;
                    }
                }
            }
            u.end_unpacking().await
        })
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        let ch = &self.ch;
        self.rt.block_on(async {
            let mut p = ch.begin_packing(peer).await?;
            p.pack_value(&(body.len() as u64), RecvMode::Express)?;
            p.pack(body, RecvMode::Cheaper)?;
            p.end_packing().await
        })
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let ch = &self.ch;
        self.rt.block_on(async {
            let mut u = ch.begin_unpacking_from(peer).await?;
            let n: u64 = u.unpack_value().await?;
            let n = usize::try_from(n)
                .ok()
                .filter(|&n| n <= buf.len())
                .ok_or_else(|| Error::protocol(peer, format!("RPC body of {n} bytes too large")))?;
            u.unpack(&mut buf[..n], SendMode::Cheaper)?;
            u.end_unpacking().await?;
            Ok(n)
        })
    }
}

/// How a raw TCP endpoint waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Non-blocking sockets, spinning on `EAGAIN`.
    Poll,
    /// Blocking reads and writes.
    Block,
}

/// Raw TCP: one `TCP_NODELAY` loopback connection per pair of ranks.
pub struct RawTcp {
    socks: Vec<Option<TcpStream>>,
    wait: Wait,
}

impl RawTcp {
    /// Connect every pair of ranks (collective; `tag` must be unique per endpoint set).
    pub fn open(session: &Session, tag: &str, wait: Wait) -> Result<RawTcp> {
        let b = session.bootstrap();
        let (me, n) = (b.rank(), b.size());
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("raw tcp: bind", e))?;
        let addr = l
            .local_addr()
            .map_err(|e| Error::io("raw tcp: local_addr", e))?;
        let all = b.allgather(&format!("bench/{tag}/addr"), addr.to_string().as_bytes())?;
        let mut socks: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        for (peer, a) in all.iter().enumerate().take(me) {
            let a: SocketAddr = std::str::from_utf8(a)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| Error::protocol(peer, "raw tcp: bad address"))?;
            let mut s =
                TcpStream::connect(a).map_err(|e| Error::io(format!("raw tcp: connect {a}"), e))?;
            s.write_all(&(me as u32).to_le_bytes())
                .map_err(|e| Error::io("raw tcp: hello", e))?;
            socks[peer] = Some(s);
        }
        for _ in me + 1..n {
            let (mut s, _) = l.accept().map_err(|e| Error::io("raw tcp: accept", e))?;
            let mut r = [0u8; 4];
            s.read_exact(&mut r)
                .map_err(|e| Error::io("raw tcp: hello", e))?;
            let peer = u32::from_le_bytes(r) as usize;
            if peer <= me || peer >= n || socks[peer].is_some() {
                return Err(Error::protocol(peer, "raw tcp: unexpected hello"));
            }
            socks[peer] = Some(s);
        }
        for s in socks.iter().flatten() {
            s.set_nodelay(true)
                .map_err(|e| Error::io("raw tcp: nodelay", e))?;
            s.set_nonblocking(wait == Wait::Poll)
                .map_err(|e| Error::io("raw tcp: nonblocking", e))?;
        }
        b.barrier(&format!("bench/{tag}/up"))?;
        Ok(RawTcp { socks, wait })
    }

    fn sock(&mut self, peer: usize) -> Result<&mut TcpStream> {
        self.socks
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::BadConfig(format!("raw tcp: no connection to rank {peer}")))
    }

    /// Write `parts` in order (one `writev` per attempt; at most two parts).
    fn write_all(&mut self, peer: usize, parts: [&[u8]; 2]) -> Result<()> {
        let s = self.sock(peer)?;
        let (mut first, mut second) = (parts[0], parts[1]);
        let mut again = Stall::default();
        while !first.is_empty() || !second.is_empty() {
            let iov = [IoSlice::new(first), IoSlice::new(second)];
            match s.write_vectored(&iov) {
                Ok(0) => return Err(Error::PeerClosed { rank: peer }),
                Ok(k) if k < first.len() => {
                    first = &first[k..];
                    again.progress();
                }
                Ok(k) => {
                    second = &second[k - first.len()..];
                    first = &[];
                    again.progress();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => backoff(&mut again)?,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::ConnectionLost {
                        rank: peer,
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    fn read_exact(&mut self, peer: usize, mut buf: &mut [u8]) -> Result<()> {
        let s = self.sock(peer)?;
        let mut again = Stall::default();
        while !buf.is_empty() {
            match s.read(buf) {
                Ok(0) => return Err(Error::PeerClosed { rank: peer }),
                Ok(k) => {
                    buf = &mut buf[k..];
                    again.progress();
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => backoff(&mut again)?,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::ConnectionLost {
                        rank: peer,
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }

    /// How this endpoint waits.
    pub fn wait(&self) -> Wait {
        self.wait
    }
}

const ONE: [u8; 1] = [0];

/// Busy-poll step: spin, but yield the processor every `EAGAINS_BEFORE_YIELD` failed
/// attempts so that more polling threads than cores (the two-thread patterns on two cores)
/// still progress. Fails after [`STALL`] without progress (a dead or stuck peer).
fn backoff(again: &mut Stall) -> Result<()> {
    again.step(EAGAINS_BEFORE_YIELD)
}

/// How long a raw baseline waits without progress before giving up.
pub const STALL: Duration = Duration::from_secs(60);

/// Failed attempts of one transfer (reset by progress).
#[derive(Default)]
struct Stall {
    n: u32,
    since: Option<Instant>,
}

impl Stall {
    fn step(&mut self, yield_every: u32) -> Result<()> {
        self.n = self.n.wrapping_add(1);
        if self.n % yield_every == 0 {
            std::thread::yield_now();
            let since = *self.since.get_or_insert_with(Instant::now);
            if since.elapsed() > STALL {
                return Err(Error::Timeout(STALL));
            }
        } else {
            std::hint::spin_loop();
        }
        Ok(())
    }

    fn progress(&mut self) {
        self.since = None;
    }
}

/// Failed non-blocking socket calls between two `sched_yield`s in the busy-poll baseline.
const EAGAINS_BEFORE_YIELD: u32 = 64;

impl Net for RawTcp {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        let m = if msg.is_empty() { &ONE[..] } else { msg };
        self.write_all(peer, [m, &[]])
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            let mut one = [0u8; 1];
            return self.read_exact(peer, &mut one);
        }
        self.read_exact(peer, buf)
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        let h = (body.len() as u64).to_le_bytes();
        self.write_all(peer, [&h, body])
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let mut h = [0u8; 8];
        self.read_exact(peer, &mut h)?;
        let n = usize::try_from(u64::from_le_bytes(h))
            .ok()
            .filter(|&n| n <= buf.len())
            .ok_or_else(|| Error::protocol(peer, "raw tcp: RPC body too large"))?;
        self.read_exact(peer, &mut buf[..n])?;
        Ok(n)
    }

    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        if self.wait != Wait::Poll {
            return None;
        }
        let mut one = [0u8; 1];
        Some(self.sock(peer).and_then(|s| match s.peek(&mut one) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(()),
            Ok(0) => Err(Error::PeerClosed { rank: peer }),
            Ok(_) => Err(found(peer)),
            Err(e) => Err(Error::ConnectionLost {
                rank: peer,
                source: e,
            }),
        }))
    }
}

/// Bytes of each raw shared-memory ring.
pub const RING_BYTES: usize = 1 << 20;
/// Spins on an empty or full ring before yielding the processor once.
const SPINS_BEFORE_YIELD: u32 = 4096;

/// Every rank's `/dev/shm` segment, mapped by every rank (collective): rank `r`'s segment holds
/// its incoming slots (a ring or a mailbox), one of `slot` bytes per peer.
fn open_segments(session: &Session, tag: &str, slot: usize) -> Result<Vec<Arc<Shared>>> {
    let b = session.bootstrap();
    let (me, n) = (b.rank(), b.size());
    let len = n * slot;
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/mad-bench-{}-{}-{tag}",
        std::process::id(),
        me
    ));
    let mut own = Shared::create(&path, len)?;
    let all = b.allgather(
        &format!("bench/{tag}/shm"),
        path.to_string_lossy().as_bytes(),
    )?;
    let mut segs = Vec::with_capacity(n);
    for (r, p) in all.iter().enumerate() {
        if r == me {
            segs.push(None);
            continue;
        }
        let p =
            std::str::from_utf8(p).map_err(|_| Error::protocol(r, "raw shm: bad segment name"))?;
        segs.push(Some(Arc::new(Shared::open(std::path::Path::new(p), len)?)));
    }
    b.barrier(&format!("bench/{tag}/mapped"))?;
    own.unlink();
    segs[me] = Some(Arc::new(own));
    segs.into_iter()
        .map(|s| s.ok_or_else(|| Error::BadConfig("raw shm: segment missing".into())))
        .collect()
}

/// Raw shared memory: one polled SPSC ring per ordered pair of ranks, in `/dev/shm`.
///
/// Rank `r`'s segment holds its incoming rings, one per peer; every rank maps every segment.
pub struct RawShm {
    me: usize,
    segs: Vec<Arc<Shared>>,
}

impl RawShm {
    /// Create and map the segments (collective).
    pub fn open(session: &Session, tag: &str) -> Result<RawShm> {
        let segs = open_segments(session, tag, RING_HEADER + RING_BYTES)?;
        Ok(RawShm {
            me: session.rank(),
            segs,
        })
    }

    fn offset(from: usize) -> usize {
        from * (RING_HEADER + RING_BYTES)
    }

    fn write_all(&self, peer: usize, mut src: &[u8]) -> Result<()> {
        let seg = self
            .segs
            .get(peer)
            .ok_or(Error::PeerClosed { rank: peer })?;
        let ring = seg.ring(Self::offset(self.me), RING_BYTES)?;
        let mut spins = Stall::default();
        while !src.is_empty() {
            let k = ring.push(src);
            src = &src[k..];
            if k == 0 {
                spins.step(SPINS_BEFORE_YIELD)?;
            } else {
                spins.progress();
            }
        }
        Ok(())
    }

    fn read_exact(&self, peer: usize, mut dst: &mut [u8]) -> Result<()> {
        let ring = self.segs[self.me].ring(Self::offset(peer), RING_BYTES)?;
        let mut spins = Stall::default();
        while !dst.is_empty() {
            let k = ring.pop(dst);
            dst = &mut dst[k..];
            if k == 0 {
                spins.step(SPINS_BEFORE_YIELD)?;
            } else {
                spins.progress();
            }
        }
        Ok(())
    }
}

impl Net for RawShm {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        self.write_all(peer, if msg.is_empty() { &ONE[..] } else { msg })
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            let mut one = [0u8; 1];
            return self.read_exact(peer, &mut one);
        }
        self.read_exact(peer, buf)
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        self.write_all(peer, &(body.len() as u64).to_le_bytes())?;
        self.write_all(peer, body)
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let mut h = [0u8; 8];
        self.read_exact(peer, &mut h)?;
        let n = usize::try_from(u64::from_le_bytes(h))
            .ok()
            .filter(|&n| n <= buf.len())
            .ok_or_else(|| Error::protocol(peer, "raw shm: RPC body too large"))?;
        self.read_exact(peer, &mut buf[..n])?;
        Ok(n)
    }

    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        let ring = self.segs[self.me].ring(Self::offset(peer), RING_BYTES);
        Some(ring.and_then(|r| {
            if r.is_empty() {
                Ok(())
            } else {
                Err(found(peer))
            }
        }))
    }
}

/// Raw polled flag: one mailbox per ordered pair of ranks in `/dev/shm` (no ring: a message is
/// one copy into the box, one Release store of a sequence number, one copy out; the sender
/// waits until the receiver took the last one).
pub struct RawFlag {
    me: usize,
    cap: usize,
    segs: Vec<Arc<Shared>>,
}

impl RawFlag {
    /// Create and map the segments for messages of up to `max` bytes (collective).
    pub fn open(session: &Session, tag: &str, max: usize) -> Result<RawFlag> {
        // An RPC carries an 8-byte header; slots stay multiples of the header block.
        let cap = (max + 8).next_multiple_of(RING_HEADER);
        let segs = open_segments(session, tag, RING_HEADER + cap)?;
        Ok(RawFlag {
            me: session.rank(),
            cap,
            segs,
        })
    }

    fn offset(&self, from: usize) -> usize {
        from * (RING_HEADER + self.cap)
    }

    fn post(&self, peer: usize, parts: &[&[u8]]) -> Result<()> {
        let seg = self
            .segs
            .get(peer)
            .ok_or(Error::PeerClosed { rank: peer })?;
        let mb = seg.mailbox(self.offset(self.me), self.cap)?;
        let mut spins = Stall::default();
        while !mb.post(parts) {
            spins.step(SPINS_BEFORE_YIELD)?;
        }
        Ok(())
    }

    fn take(&self, peer: usize, parts: &mut [&mut [u8]]) -> Result<usize> {
        let mb = self.segs[self.me].mailbox(self.offset(peer), self.cap)?;
        let mut spins = Stall::default();
        loop {
            if let Some(n) = mb.take(parts) {
                return Ok(n);
            }
            spins.step(SPINS_BEFORE_YIELD)?;
        }
    }
}

impl Net for RawFlag {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        self.post(peer, &[msg])
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let want = buf.len();
        let n = self.take(peer, &mut [buf])?;
        if n != want {
            return Err(Error::protocol(
                peer,
                format!("raw flag: message of {n} bytes, expected {want}"),
            ));
        }
        Ok(())
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        self.post(peer, &[&(body.len() as u64).to_le_bytes(), body])
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let mut h = [0u8; 8];
        let cap = buf.len();
        let n = self.take(peer, &mut [&mut h, buf])?;
        usize::try_from(u64::from_le_bytes(h))
            .ok()
            .filter(|&b| b <= cap && b + 8 == n)
            .ok_or_else(|| Error::protocol(peer, "raw flag: bad RPC header"))
    }

    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        let mb = self.segs[self.me].mailbox(self.offset(peer), self.cap);
        Some(mb.and_then(|m| m.take(&mut []).map_or(Ok(()), |_| Err(found(peer)))))
    }
}

/// A driver's links driven directly, without the engine (no `Channel`, no packer): what the
/// driver alone costs (`--drivers`, rows named `driver:SPEC`). A message whose body the driver's TM table sends through TM 0 (its copy
/// TM) is just the body (one byte for an empty one); otherwise an 8-byte header through TM 0,
/// a commit, then the body through its TM (copy or gather). An RPC is always header then body.
/// Busy-polls, whatever the channel's `progress=`.
pub struct DriverNet {
    opened: OpenedChannel,
    table: TmTable,
}

impl DriverNet {
    /// Open `spec`'s driver directly among the session's ranks (collective; `name` must be
    /// unique per endpoint).
    pub fn open(session: &Session, name: &str, spec: &str) -> Result<DriverNet> {
        let config = ChannelConfig::parse(name, spec)?;
        let driver = madeleine::drivers()
            .into_iter()
            .find(|d| d.name() == config.driver)
            .ok_or_else(|| {
                Error::BadConfig(format!(
                    "mad-bench: --drivers {spec}: no driver `{}` in this build",
                    config.driver
                ))
            })?;
        config.check_against(&driver.accepted_options(&config))?;
        let mut table = driver.tm_table(&config)?;
        for (tm, max) in &config.thresholds {
            table.set_max_len(tm, *max)?;
        }
        let mut progress = ProgressPolicy::default();
        progress.mode = config.progress;
        progress.op_timeout = config.op_timeout;
        let opened = driver.open(&OpenContext::new(
            &config,
            session.bootstrap(),
            &table,
            &progress,
        ))?;
        Ok(DriverNet { opened, table })
    }

    /// The table and the link to `peer`.
    fn parts(&mut self, peer: usize) -> Result<(&TmTable, &mut LinkPair)> {
        let link = self
            .opened
            .links
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::BadConfig(format!("driver: no link to rank {peer}")))?;
        Ok((&self.table, link))
    }

    /// Send `head` through TM 0 then `body` through the TM the table gives its length (the
    /// engine's choice for a CHEAPER piece); commit, end.
    fn send_parts(&mut self, peer: usize, head: &[u8], body: &[u8]) -> Result<()> {
        let (table, link) = self.parts(peer)?;
        let tm = table.select(body.len(), SendMode::Cheaper, RecvMode::Cheaper);
        let tx = &mut *link.tx;
        tx.begin_message()?;
        lend(tx, 0, &[head])?;
        if tm != 0 {
            spin(|| tx.commit(0))?;
        }
        if table.bmm(tm) == Bmm::Gather {
            spin(|| tx.send_refs(tm, &[IoSlice::new(body)]))?;
        } else {
            lend(tx, tm, &[body])?;
        }
        spin(|| tx.commit(tm))?;
        spin(|| tx.end_message())
    }

    /// Receive what [`send_parts`](Self::send_parts) sent: `head` first, then a body of
    /// `body_len(head)` bytes into `buf` (its length, checked by `body_len`).
    fn recv_parts(
        &mut self,
        peer: usize,
        head: &mut [u8],
        buf: &mut [u8],
        body_len: impl FnOnce(&[u8]) -> Result<usize>,
    ) -> Result<usize> {
        let (table, link) = self.parts(peer)?;
        let rx = &mut *link.rx;
        spin(|| rx.poll_message())?;
        take(rx, 0, &mut [&mut *head])?;
        let n = body_len(head)?;
        let body = &mut buf[..n];
        let tm = table.select(n, SendMode::Cheaper, RecvMode::Cheaper);
        if tm != 0 {
            rx.checkout(0)?;
        }
        if table.bmm(tm) == Bmm::Gather {
            spin(|| rx.recv_refs(tm, &mut [IoSliceMut::new(body)]))?;
        } else {
            take(rx, tm, &mut [body])?;
        }
        rx.checkout(tm)?;
        rx.end_message()?;
        Ok(n)
    }
}

/// Poll `f` until it is ready (busy, yielding now and then; fails after [`STALL`] without
/// progress).
fn spin<T>(mut f: impl FnMut() -> Result<Poll<T>>) -> Result<T> {
    let mut spins = Stall::default();
    loop {
        if let Poll::Ready(v) = f()? {
            return Ok(v);
        }
        spins.step(SPINS_BEFORE_YIELD)?;
    }
}

/// Copy `parts` in order into the lends of TM `tm`.
fn lend(tx: &mut dyn TxLink, tm: TmId, parts: &[&[u8]]) -> Result<()> {
    for part in parts {
        let mut rest = *part;
        while !rest.is_empty() {
            spin(|| {
                tx.with_buffer(tm, rest.len(), &mut |b: &mut [u8]| {
                    let k = b.len().min(rest.len());
                    b[..k].copy_from_slice(&rest[..k]);
                    rest = &rest[k..];
                    k
                })
            })?;
        }
    }
    Ok(())
}

/// Fill `parts` in order from the received data of TM `tm`.
fn take(rx: &mut dyn RxLink, tm: TmId, parts: &mut [&mut [u8]]) -> Result<()> {
    for part in parts.iter_mut() {
        let mut at = 0;
        while at < part.len() {
            spin(|| {
                rx.with_data(tm, part.len() - at, &mut |b: &[u8]| {
                    let k = b.len().min(part.len() - at);
                    part[at..at + k].copy_from_slice(&b[..k]);
                    at += k;
                    k
                })
            })?;
        }
    }
    Ok(())
}

impl Net for DriverNet {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        let (table, _) = self.parts(peer)?;
        if table.select(msg.len(), SendMode::Cheaper, RecvMode::Cheaper) == 0 {
            // Through the copy TM: the body alone (the receiver knows its length).
            let m = if msg.is_empty() { &ONE[..] } else { msg };
            self.send_parts(peer, m, &[])
        } else {
            self.send_parts(peer, &(msg.len() as u64).to_le_bytes(), msg)
        }
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let (table, _) = self.parts(peer)?;
        let want = buf.len();
        if table.select(want, SendMode::Cheaper, RecvMode::Cheaper) == 0 {
            let mut one = [0u8; 1];
            let b = if buf.is_empty() { &mut one[..] } else { buf };
            self.recv_parts(peer, b, &mut [], |_| Ok(0))?;
            return Ok(());
        }
        let mut h = [0u8; 8];
        self.recv_parts(peer, &mut h, buf, |h| {
            (h == (want as u64).to_le_bytes())
                .then_some(want)
                .ok_or_else(|| Error::protocol(peer, "driver: message of the wrong size"))
        })?;
        Ok(())
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        self.send_parts(peer, &(body.len() as u64).to_le_bytes(), body)
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let cap = buf.len();
        let mut h = [0u8; 8];
        self.recv_parts(peer, &mut h, buf, |h| {
            h.try_into()
                .ok()
                .and_then(|h| usize::try_from(u64::from_le_bytes(h)).ok())
                .filter(|&n| n <= cap)
                .ok_or_else(|| Error::protocol(peer, "driver: RPC body too large"))
        })
    }

    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        Some(
            self.parts(peer)
                .and_then(|(_, link)| match link.rx.poll_message()? {
                    Poll::Pending => Ok(()),
                    Poll::Ready(()) => Err(found(peer)),
                }),
        )
    }
}
