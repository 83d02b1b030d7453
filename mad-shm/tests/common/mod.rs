//! Helpers shared by the driver-level tests: open a channel on n ranks (threads) and drive
//! link calls with bounded waits; a two-process bootstrap over a Unix socket.

#![allow(dead_code)]

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod sys;

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Mutex;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::driver::{Driver, OpenContext, OpenedChannel, RxLink, TxLink};
use mad_core::progress::ProgressPolicy;
use mad_core::{Error, Result};
use mad_shm::ShmDriver;

/// Longest any test waits for one operation.
pub const BOUND: Duration = Duration::from_secs(20);

pub fn config(opts: &[(&str, &str)]) -> ChannelConfig {
    let mut c = ChannelConfig::new("t", "shm");
    for (k, v) in opts {
        c = c.option(*k, *v);
    }
    c
}

/// Tests of one binary run in parallel threads of one process, and "no leftover segment of this
/// process" can only be checked while no other test is opening a channel: channel-opening
/// tests hold this lock shared, leftover checks hold it exclusively.
pub static SEGMENTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Shared hold on [`SEGMENTS`] (for tests that open channels).
pub fn opening() -> std::sync::RwLockReadGuard<'static, ()> {
    SEGMENTS.read().unwrap_or_else(|e| e.into_inner())
}

/// Exclusive hold on [`SEGMENTS`] (for tests that check for leftovers).
pub fn checking() -> std::sync::RwLockWriteGuard<'static, ()> {
    SEGMENTS.write().unwrap_or_else(|e| e.into_inner())
}

pub fn open_with(b: &dyn Bootstrap, cfg: &ChannelConfig) -> Result<OpenedChannel> {
    let d = ShmDriver::new();
    let table = d.tm_table(cfg)?;
    let progress = ProgressPolicy::default();
    let ctx = OpenContext::new(cfg, b, &table, &progress);
    d.open(&ctx)
}

/// Open the channel on `n` thread-ranks and run `body(rank, channel)` on each.
pub fn run_threads<F>(n: usize, cfg: ChannelConfig, body: F)
where
    F: Fn(usize, OpenedChannel) + Send + Sync + Clone + 'static,
{
    let _shared = opening();
    let hs: Vec<_> = ThreadBootstrap::group(n)
        .into_iter()
        .map(|b| {
            let cfg = cfg.clone();
            let body = body.clone();
            std::thread::spawn(move || {
                let ch = open_with(&b, &cfg).expect("open");
                body(b.rank(), ch)
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank thread panicked");
    }
}

/// Retry `f` until ready, waiting through `wait` between attempts; fails after [`BOUND`].
pub fn drive<T>(
    mut f: impl FnMut() -> Result<Poll<T>>,
    mut wait: impl FnMut(Duration) -> Result<()>,
) -> Result<T> {
    let end = Instant::now() + BOUND;
    let mut spins = 0u32;
    loop {
        if let Poll::Ready(v) = f()? {
            return Ok(v);
        }
        if Instant::now() > end {
            return Err(Error::Timeout(BOUND));
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            wait(Duration::from_millis(20))?;
        }
    }
}

/// Send `bytes` through the copy TM (0) and end the message.
pub fn send_copy(tx: &mut dyn TxLink, bytes: &[u8]) -> Result<()> {
    let mut off = 0;
    let end = Instant::now() + BOUND;
    while off < bytes.len() {
        let p = tx.with_buffer(0, bytes.len() - off, &mut |b: &mut [u8]| {
            let k = b.len().min(bytes.len() - off);
            b[..k].copy_from_slice(&bytes[off..off + k]);
            off += k;
            k
        })?;
        if p.is_pending() {
            if Instant::now() > end {
                return Err(Error::Timeout(BOUND));
            }
            tx.wait(Duration::from_millis(20))?;
        }
    }
    drive(|| tx.end_message(), |_| Ok(()))
}

/// Receive exactly `out.len()` bytes through the copy TM (0).
pub fn recv_copy(rx: &mut dyn RxLink, out: &mut [u8]) -> Result<()> {
    let mut off = 0;
    let end = Instant::now() + BOUND;
    while off < out.len() {
        let len = out.len();
        let p = rx.with_data(0, len - off, &mut |b: &[u8]| {
            let k = b.len().min(len - off);
            out[off..off + k].copy_from_slice(&b[..k]);
            off += k;
            k
        })?;
        if p.is_pending() {
            if Instant::now() > end {
                return Err(Error::Timeout(BOUND));
            }
            rx.wait(Duration::from_millis(20))?;
        }
    }
    Ok(())
}

/// Send a gather group through TM `tm`.
pub fn send_group(tx: &mut dyn TxLink, tm: u8, iov: &[IoSlice<'_>]) -> Result<()> {
    let end = Instant::now() + BOUND;
    loop {
        if tx.send_refs(tm, iov)?.is_ready() {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(Error::Timeout(BOUND));
        }
        tx.wait(Duration::from_millis(20))?;
    }
}

/// Receive a gather group through TM `tm`.
pub fn recv_group(rx: &mut dyn RxLink, tm: u8, iov: &mut [IoSliceMut<'_>]) -> Result<()> {
    let end = Instant::now() + BOUND;
    loop {
        if rx.recv_refs(tm, iov)?.is_ready() {
            return Ok(());
        }
        if Instant::now() > end {
            return Err(Error::Timeout(BOUND));
        }
        rx.wait(Duration::from_millis(20))?;
    }
}

/// Deterministic test pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// CPU time the calling thread has used so far (the conformance kit's clock).
pub fn thread_cpu_time() -> Duration {
    mad_core::conformance::thread_cpu_time().expect("the thread's CPU clock")
}

/// Entries of /dev/shm created by this process.
pub fn my_segments() -> Vec<String> {
    segments_of(&[std::process::id()])
}

/// Entries of /dev/shm created by any of the processes `pids` (segment names start with
/// `mad-shm-<creator pid>-`).
pub fn segments_of(pids: &[u32]) -> Vec<String> {
    mad_core::hostmem::segment::segments_created_by(mad_shm::segment::PREFIX, pids)
}

/// A two-process bootstrap over a Unix stream (rank 0 listens, rank 1 connects).
pub struct PairBootstrap {
    rank: usize,
    secret: Secret,
    sock: Mutex<UnixStream>,
}

impl PairBootstrap {
    /// Rank 0: listen on `path`, accept one peer.
    pub fn accept(l: &UnixListener, secret: Secret) -> std::io::Result<Self> {
        let (s, _) = l.accept()?;
        s.set_read_timeout(Some(BOUND))?;
        Ok(PairBootstrap {
            rank: 0,
            secret,
            sock: Mutex::new(s),
        })
    }
    /// Rank 1: connect to `path`.
    pub fn connect(path: &str, secret: Secret) -> std::io::Result<Self> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(BOUND))?;
        Ok(PairBootstrap {
            rank: 1,
            secret,
            sock: Mutex::new(s),
        })
    }
}

impl Bootstrap for PairBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        2
    }
    fn secret(&self) -> &Secret {
        &self.secret
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let io = |e| Error::io("pair bootstrap", e);
        let mut s = self
            .sock
            .lock()
            .map_err(|_| Error::protocol(self.rank, "lock"))?;
        let mut msg = Vec::new();
        for part in [tag.as_bytes(), value] {
            msg.extend_from_slice(&(part.len() as u32).to_le_bytes());
            msg.extend_from_slice(part);
        }
        s.write_all(&msg).map_err(io)?;
        let mut parts = Vec::new();
        for _ in 0..2 {
            let mut l = [0u8; 4];
            s.read_exact(&mut l).map_err(io)?;
            let mut v = vec![0u8; u32::from_le_bytes(l) as usize];
            s.read_exact(&mut v).map_err(io)?;
            parts.push(v);
        }
        if parts[0] != tag.as_bytes() {
            return Err(Error::protocol(
                1 - self.rank,
                "pair bootstrap: tag mismatch",
            ));
        }
        let other = parts.pop().unwrap_or_default();
        Ok(if self.rank == 0 {
            vec![value.to_vec(), other]
        } else {
            vec![other, value.to_vec()]
        })
    }
    fn kind(&self) -> &'static str {
        "pair"
    }
}
