//! Stress: 4 ranks, 2 channels per rank (one tcp in checked mode, one shm), 8 worker threads per
//! rank (per channel: 2 senders, 2 receivers). Twice: the ranks as 4 processes under `madrun`
//! (what the issue asks), and as threads of this process, each with its own `Session` (quick to
//! debug, and what the ThreadSanitizer run uses).
//!
//! Every sender thread sends `N` messages to each of the 3 other ranks, in a shuffled order,
//! with random sizes from 0 to 1 MiB (log-uniform, so small and large TMs are both exercised),
//! a random send mode for the body (CHEAPER, SAFER, LATER with the data written after
//! `pack_later`) and a random receive mode (EXPRESS, CHEAPER). The EXPRESS header carries
//! (sender rank, sender thread, sequence number per (thread, destination), length, modes,
//! checksum). The two receiver threads of a channel take messages from any source
//! (`begin_unpacking`), unpack the body with the modes the header announces (checked mode on the
//! tcp channel reports any difference between the pack and unpack sequences), and check the
//! checksum and that each (sender, thread) sequence arrives in order with no gap. (A first version had each receiver thread insist on one peer at a
//! time with `begin_unpacking_from`: that deadlocks by design once every sender thread of a
//! rank is blocked on a peer that waits for someone else, so it is not a library bug.)
//!
//! Default: `N = 20` (960 messages, ~70 MiB). `MAD_SOAK=1`: `N = 2084` (100 032 messages).
//! `MAD_STRESS_N=k` sets `N` directly.

#![cfg(all(feature = "tcp", feature = "shm"))]

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use std::process::Command;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{Channel, ChannelConfig, Error, RecvMode, SendMode, Session};

const RANKS: usize = 4;
const SENDERS: usize = 2;
const MAX: usize = 1 << 20;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn per_pair() -> u64 {
    if let Some(n) = std::env::var("MAD_STRESS_N")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    if std::env::var_os("MAD_SOAK").is_some() {
        2084
    } else {
        20
    }
}

/// FNV-1a over 8-byte words (fast enough in a debug build), plus the length.
fn checksum(b: &[u8]) -> u64 {
    let mut h = 0xcbf29ce484222325u64 ^ b.len() as u64;
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        h = (h ^ u64::from_le_bytes(c.try_into().unwrap())).wrapping_mul(0x100000001b3);
    }
    for x in chunks.remainder() {
        h = (h ^ *x as u64).wrapping_mul(0x100000001b3);
    }
    h
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut r = Rng(seed | 1);
    for c in buf.chunks_mut(8) {
        let v = r.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// Header: rank, thread, seq, len, send mode (0 cheaper, 1 safer, 2 later), recv mode
/// (0 express, 1 cheaper), checksum.
type Head = [u64; 7];

fn sender(ch: &Channel, which: u64, me: usize, thread: usize, n: u64) -> Result<u64, Error> {
    let mut rng =
        Rng(0x9e3779b97f4a7c15 ^ ((me as u64) << 32) ^ ((which + 1) << 16) ^ thread as u64);
    let peers: Vec<usize> = (0..RANKS).filter(|&r| r != me).collect();
    let mut order: Vec<usize> = peers
        .iter()
        .flat_map(|&p| std::iter::repeat_n(p, n as usize))
        .collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut seq = [0u64; RANKS];
    let mut bytes = 0u64;
    let mut buf = vec![0u8; MAX];
    for dest in order {
        // Log-uniform size in 0..=1 MiB.
        let len = match rng.below(21) {
            0 => 0,
            k => ((1u64 << (k - 1)) + rng.below(1 << (k - 1))).min(MAX as u64) as usize,
        };
        let smode = rng.below(3);
        let rmode = rng.below(2);
        let r = if rmode == 0 {
            RecvMode::Express
        } else {
            RecvMode::Cheaper
        };
        let seed = rng.next();
        let data = &mut buf[..len];
        fill(data, seed);
        let head: Head = [
            me as u64,
            thread as u64,
            seq[dest],
            len as u64,
            smode,
            rmode,
            checksum(data),
        ];
        let mut p = ch.begin_packing(dest)?;
        p.pack_value(&head, RecvMode::Express)?;
        match smode {
            0 => {
                p.pack(data, r)?;
                p.end_packing()?;
            }
            1 => {
                p.pack_safer(data, r)?;
                p.end_packing()?;
            }
            _ => {
                // LATER: pack first, write the final content afterwards.
                let want = data.to_vec();
                data.fill(0xee);
                let cells = Cell::from_mut(data).as_slice_of_cells();
                p.pack_later(cells, r)?;
                for (c, v) in cells.iter().zip(&want) {
                    c.set(*v);
                }
                p.end_packing()?;
            }
        }
        seq[dest] += 1;
        bytes += len as u64;
    }
    Ok(bytes)
}

/// What the receiver threads of one channel share: messages still to be received, and the
/// next sequence number expected from each (sender rank, sender thread).
struct RecvShared {
    remaining: AtomicI64,
    next: Mutex<[[u64; SENDERS]; RANKS]>,
}

fn receiver(ch: &Channel, sh: &RecvShared) -> Result<u64, Error> {
    let mut buf = vec![0u8; MAX];
    let mut got = 0;
    // Reserve a message before waiting for one: exactly `remaining` messages will arrive, so
    // no thread waits for a message that never comes.
    while sh.remaining.fetch_sub(1, Ordering::SeqCst) > 0 {
        let mut u = ch.begin_unpacking()?;
        let peer = u.remote();
        let h: Head = u.unpack_value()?;
        let [rank, thread, seq, len, smode, rmode, sum] = h;
        let bad = |what: String| Error::Protocol {
            rank: peer,
            what: format!("stress: {what} (header {h:?})"),
        };
        if rank as usize != peer || thread as usize >= SENDERS || len as usize > MAX || rmode > 1 {
            return Err(bad("impossible header".into()));
        }
        {
            // Checked while this message is open: the next one from the same connection
            // cannot start before `end_unpacking`.
            let mut next = sh.next.lock().unwrap();
            let want = &mut next[peer][thread as usize];
            if seq != *want {
                return Err(bad(format!("out of order: expected seq {want}")));
            }
            *want += 1;
        }
        let s = match smode {
            0 => SendMode::Cheaper,
            1 => SendMode::Safer,
            _ => SendMode::Later,
        };
        let data = &mut buf[..len as usize];
        if rmode == 0 {
            u.unpack_express(data, s)?;
        } else {
            u.unpack(data, s)?;
        }
        u.end_unpacking()?;
        if checksum(data) != sum {
            return Err(bad("checksum mismatch".into()));
        }
        got += 1;
    }
    Ok(got)
}

fn rank_main(s: &Session, n: u64) -> Result<(u64, u64), Error> {
    let me = s.rank();
    let tcp = s.open_channel_with(ChannelConfig::parse("stress-tcp", "tcp,checked=true")?)?;
    let shm = s.open_channel_with(ChannelConfig::parse("stress-shm", "shm")?)?;
    let shared = [(); 2].map(|_| RecvShared {
        remaining: AtomicI64::new(((RANKS - 1) * SENDERS) as i64 * n as i64),
        next: Mutex::new([[0; SENDERS]; RANKS]),
    });
    let res: Result<(u64, u64), Error> = std::thread::scope(|sc| {
        let mut hs = Vec::new();
        for (which, (ch, sh)) in [(&tcp, &shared[0]), (&shm, &shared[1])]
            .into_iter()
            .enumerate()
        {
            for t in 0..SENDERS {
                hs.push((true, sc.spawn(move || sender(ch, which as u64, me, t, n))));
                hs.push((false, sc.spawn(move || receiver(ch, sh))));
            }
        }
        let (mut bytes, mut msgs) = (0, 0);
        let mut first_err = None;
        for (is_sender, h) in hs {
            match h.join().expect("worker panicked") {
                Ok(v) if is_sender => bytes += v,
                Ok(v) => msgs += v,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok((bytes, msgs)),
        }
    });
    // Keep every channel open until every rank is done.
    s.bootstrap().barrier("stress-end")?;
    res
}

fn expected_messages_per_rank(n: u64) -> u64 {
    (2 * SENDERS * (RANKS - 1)) as u64 * n
}

fn report(what: &str, msgs: u64, bytes: u64, t: Duration) {
    eprintln!(
        "stress ({what}): {msgs} messages, {:.1} MiB, {:.2?} ({:.0} msg/s, {:.1} MiB/s)",
        bytes as f64 / (1 << 20) as f64,
        t,
        msgs as f64 / t.as_secs_f64(),
        bytes as f64 / (1 << 20) as f64 / t.as_secs_f64()
    );
}

/// Generous bound for the soak; the default run takes seconds.
fn limit(n: u64) -> Duration {
    Duration::from_secs(if n > 50 { 3600 } else { 180 })
}

#[test]
fn stress_4_ranks_2_channels_8_threads() {
    let n = per_pair();
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    for b in ThreadBootstrap::group(RANKS) {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = Session::builder()
                .driver(mad_tcp::TcpDriver::new())
                .driver(mad_shm::ShmDriver::new())
                .bootstrap(Box::new(b))
                .build()
                .and_then(|s| rank_main(&s, n));
            let _ = tx.send(r);
        });
    }
    let (mut bytes, mut msgs) = (0, 0);
    for _ in 0..RANKS {
        let r = rx
            .recv_timeout(limit(n).saturating_sub(start.elapsed()))
            .expect("a rank hung");
        let (b, m) = r.unwrap_or_else(|e| panic!("stress failed: {e}"));
        bytes += b;
        msgs += m;
    }
    assert_eq!(msgs, RANKS as u64 * expected_messages_per_rank(n));
    report("threads", msgs, bytes, start.elapsed());
}

#[test]
#[ignore = "rank program of `stress_4_processes_2_channels_8_threads` (run through madrun)"]
fn stress_rank_child() {
    let n = per_pair();
    let s = madeleine::session().expect("session");
    assert_eq!(s.size(), RANKS, "run with madrun -n {RANKS}");
    match rank_main(&s, n) {
        Ok((bytes, msgs)) => println!("STRESS rank {} ok msgs={msgs} bytes={bytes}", s.rank()),
        Err(e) => {
            println!("STRESS rank {} failed: {e}", s.rank());
            std::process::exit(1);
        }
    }
}

#[test]
fn stress_4_processes_2_channels_8_threads() {
    let n = per_pair();
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_madrun"))
        .args(["-n", &RANKS.to_string(), "--timeout"])
        .arg(limit(n).as_secs().to_string())
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "stress_rank_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("madrun runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stress job failed ({}):\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let (mut msgs, mut bytes) = (0u64, 0u64);
    for r in 0..RANKS {
        let line = text
            .lines()
            .find_map(|l| {
                l.split_once(&format!("STRESS rank {r} ok "))
                    .map(|(_, t)| t)
            })
            .unwrap_or_else(|| panic!("no result from rank {r}:\n{text}"));
        let field = |k: &str| -> u64 {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(k))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("bad result line `{line}`"))
        };
        assert_eq!(field("msgs="), expected_messages_per_rank(n), "rank {r}");
        msgs += field("msgs=");
        bytes += field("bytes=");
    }
    report("processes", msgs, bytes, start.elapsed());
}
