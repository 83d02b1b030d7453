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
    let ctx = OpenContext {
        config: cfg,
        bootstrap: b,
        table: &table,
        progress: &progress,
    };
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

/// Run this test binary's ignored test `test` in a private mount namespace whose `/dev/shm` is
/// a fresh tmpfs of `size` (e.g. `64m`, Docker's default), with `env` set. `None` (after
/// printing why) when this process may not unshare or mount (not root, no `unshare(1)`): the
/// caller skips. Otherwise the child's output, whose status says whether `test` passed.
pub fn in_small_dev_shm(size: &str, test: &str, env: (&str, &str)) -> Option<std::process::Output> {
    use std::process::Command;
    let probe = Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg("mount -t tmpfs -o size=1m tmpfs /dev/shm")
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "SKIPPED: cannot mount a private /dev/shm (unshare -m; needs root): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return None;
        }
        Err(e) => {
            eprintln!("SKIPPED: cannot run unshare(1): {e}");
            return None;
        }
    }
    let exe = std::env::current_exe().expect("test binary path");
    let script = format!(
        "mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99; \
         exec \"$0\" --ignored --exact {test} --nocapture --test-threads=1"
    );
    Some(
        Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .arg(exe)
            .env(env.0, env.1)
            .output()
            .expect("running unshare"),
    )
}

/// How a rank of [`wait_job`] ended.
#[derive(Debug)]
pub struct Ended {
    /// Its rank.
    pub rank: usize,
    /// Its pid.
    pub pid: u32,
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal that ended it, if one did (`SIGKILL` for a rank torn down by [`wait_job`]).
    pub signal: Option<i32>,
    /// Whether [`wait_job`] killed it.
    pub torn_down: bool,
    /// Its standard output.
    pub out: String,
}

/// Wait for every rank of a job; once one has failed, give the others `grace` to end (as
/// madrun does), then kill them. Bounded by `bound` in all.
pub fn wait_job(
    kids: Vec<(usize, std::process::Child)>,
    grace: std::time::Duration,
    bound: std::time::Duration,
) -> Vec<Ended> {
    use std::os::unix::process::ExitStatusExt;
    use std::time::Instant;
    let end = Instant::now() + bound;
    let mut kill_at: Option<Instant> = None;
    let mut live: Vec<(usize, std::process::Child)> = kids;
    let mut done = Vec::new();
    while !live.is_empty() {
        let mut i = 0;
        while i < live.len() {
            let st = live[i].1.try_wait().expect("try_wait");
            let late = Instant::now() > end || kill_at.is_some_and(|t| Instant::now() > t);
            if st.is_none() && !late {
                i += 1;
                continue;
            }
            let (rank, mut c) = live.swap_remove(i);
            let torn_down = st.is_none();
            let st = match st {
                Some(st) => st,
                None => {
                    let _ = c.kill();
                    c.wait().expect("wait")
                }
            };
            if !st.success() && kill_at.is_none() {
                kill_at = Some(Instant::now() + grace);
            }
            let mut out = String::new();
            if let Some(mut o) = c.stdout.take() {
                let _ = std::io::Read::read_to_string(&mut o, &mut out);
            }
            done.push(Ended {
                rank,
                pid: c.id(),
                code: st.code(),
                signal: st.signal(),
                torn_down,
                out,
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    done.sort_by_key(|e| e.rank);
    done
}

/// The checks of a job run on a `/dev/shm` too small for it: no rank died of `SIGBUS`, at least
/// one failed its open with `Resource` naming `/dev/shm` and the bytes needed, and none of those
/// left a segment behind (`segments_of`). Every other rank either finished (`done_line`),
/// failed its open too, or was torn down / failed after a failing rank.
pub fn check_no_space_job(
    ended: &[Ended],
    done_line: &str,
    segments_of: impl Fn(&[u32]) -> Vec<String>,
) {
    const SIGBUS: i32 = 7;
    let summary: Vec<String> = ended
        .iter()
        .map(|e| {
            format!(
                "rank {} (pid {}): code {:?} signal {:?}{}: {}",
                e.rank,
                e.pid,
                e.code,
                e.signal,
                if e.torn_down { " (torn down)" } else { "" },
                e.out.lines().last().unwrap_or("")
            )
        })
        .collect();
    let summary = summary.join("\n");
    eprintln!("{summary}");
    assert!(
        ended.iter().all(|e| e.signal != Some(SIGBUS)),
        "a rank died of SIGBUS:\n{summary}"
    );
    let no_space: Vec<&Ended> = ended
        .iter()
        .filter(|e| e.out.contains("Resource("))
        .collect();
    assert!(
        !no_space.is_empty(),
        "no rank failed its open with Resource:\n{summary}"
    );
    for e in &no_space {
        for want in [
            "Resource(",
            "/dev/shm is too small",
            " free of ",
            "needs ",
            "--shm-size",
        ] {
            assert!(
                e.out.contains(want),
                "rank {}: no `{want}` in its error:\n{}",
                e.rank,
                e.out
            );
        }
    }
    // Every rank whose open returned an error (Resource, or the job's failure reported by
    // the bootstrap) removed its segment.
    let pids: Vec<u32> = ended
        .iter()
        .filter(|e| e.out.contains("OPENFAIL"))
        .map(|e| e.pid)
        .collect();
    let left = segments_of(&pids);
    assert!(
        left.is_empty(),
        "ranks whose open failed left segments: {left:?}"
    );
    for e in ended {
        assert!(
            e.out.contains(done_line)
                || e.out.contains("OPENFAIL")
                || e.torn_down
                || e.code != Some(0),
            "rank {}: neither finished nor failed:\n{summary}",
            e.rank
        );
    }
}
