//! Cross-process ping-pong: the shm driver (driver level, polled) against a raw polled-flag
//! ring written here, plus the ring/CMA threshold sweep.
//!
//! ```text
//! cargo run --release -p mad-shm --example shm_pingpong
//! ```
//!
//! The program re-executes itself as rank 1 (a second process); both ranks busy-poll.
//! Output: one line per measurement, `what size one-way-latency bandwidth`, min and median of
//! seven runs, variants of one comparison interleaved run by run.

#![allow(unsafe_code)]

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;

use std::io::{IoSlice, IoSliceMut};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use common::{open_with, PairBootstrap};
use mad_core::auth::Secret;
use mad_core::bootstrap::Bootstrap;
use mad_core::cli::Cli;
use mad_core::driver::{OpenedChannel, RxLink, TxLink};

/// The command line: `--help` and `--version` only.
const CLI: Cli = Cli::new(
    "shm_pingpong",
    env!("CARGO_PKG_VERSION"),
    "usage: shm_pingpong

Cross-process ping-pong: the shm driver against a raw polled-flag ring, and the ring/CMA
threshold sweep (re-executes itself as rank 1).

  -h, --help     this text
  -V, --version  the version",
);

const CHILD_ENV: &str = "MAD_SHM_BENCH_CHILD";
const SECRET_ENV: &str = "MAD_SHM_BENCH_SECRET";
const RUNS: usize = 7;

fn iters(size: usize) -> usize {
    (200_000_000 / (size + 2000)).clamp(20, 20_000)
}

/// Spin until `f` is ready.
fn spin<T>(mut f: impl FnMut() -> mad_core::Result<std::task::Poll<T>>) -> T {
    loop {
        if let std::task::Poll::Ready(v) = f().expect("driver error") {
            return v;
        }
        std::hint::spin_loop();
    }
}

fn send(tx: &mut dyn TxLink, data: &[u8], cma: bool) {
    tx.begin_message().unwrap();
    let mut hdr = &(data.len() as u64).to_le_bytes()[..];
    let copy_part: &[u8] = if cma { &[] } else { data };
    let mut body = copy_part;
    while !hdr.is_empty() || !body.is_empty() {
        spin(|| {
            tx.with_buffer(0, hdr.len() + body.len(), &mut |b: &mut [u8]| {
                let mut w = 0;
                let k = hdr.len().min(b.len());
                b[..k].copy_from_slice(&hdr[..k]);
                hdr = &hdr[k..];
                w += k;
                let k2 = body.len().min(b.len() - w);
                b[w..w + k2].copy_from_slice(&body[..k2]);
                body = &body[k2..];
                w + k2
            })
        });
    }
    if cma {
        spin(|| tx.commit(0));
        spin(|| tx.send_refs(1, &[IoSlice::new(data)]));
    }
    spin(|| tx.end_message());
}

fn recv(rx: &mut dyn RxLink, out: &mut [u8], cma: bool) {
    let mut hdr = [0u8; 8];
    let mut h = 0;
    let mut o = 0;
    let want = if cma { 0 } else { out.len() };
    while h < 8 || o < want {
        spin(|| {
            rx.with_data(0, 8 - h + want - o, &mut |b: &[u8]| {
                let mut r = 0;
                let k = (8 - h).min(b.len());
                hdr[h..h + k].copy_from_slice(&b[..k]);
                h += k;
                r += k;
                let k2 = (want - o).min(b.len() - r);
                out[o..o + k2].copy_from_slice(&b[r..r + k2]);
                o += k2;
                r + k2
            })
        });
    }
    assert_eq!(u64::from_le_bytes(hdr) as usize, out.len());
    if cma {
        spin(|| rx.recv_refs(1, &mut [IoSliceMut::new(out)]));
    }
    let _ = rx.end_message();
}

/// One ping-pong series over the driver; returns the one-way time in seconds.
fn driver_pingpong(ch: &mut OpenedChannel, me: usize, size: usize, cma: bool) -> f64 {
    let peer = 1 - me;
    let link = ch.links[peer].as_mut().unwrap();
    let mut buf = vec![me as u8; size];
    let n = iters(size);
    let t0 = Instant::now();
    for _ in 0..n {
        if me == 0 {
            send(link.tx.as_mut(), &buf, cma);
            recv(link.rx.as_mut(), &mut buf, cma);
        } else {
            recv(link.rx.as_mut(), &mut buf, cma);
            send(link.tx.as_mut(), &buf, cma);
        }
    }
    t0.elapsed().as_secs_f64() / (2 * n) as f64
}

/// The raw baseline: a shared page with two polled sequence words and a payload area; the
/// sender copies the payload in, Release-stores its sequence number; the receiver spins on it
/// with Acquire loads and copies the payload out.
struct Raw {
    map: memmap2::MmapMut,
    next: u64,
}

const RAW_DATA: usize = 4096;

impl Raw {
    fn seq(&self, who: usize) -> &AtomicU64 {
        // SAFETY: offsets 0 and 128 are 8-aligned and inside the (page-aligned, >= 4 KiB)
        // mapping, which lives as long as `self`; both processes access these words atomically.
        unsafe { &*self.map.as_ptr().add(who * 128).cast::<AtomicU64>() }
    }

    fn pingpong(&mut self, me: usize, size: usize) -> f64 {
        let mut buf = vec![me as u8; size];
        let n = iters(size);
        let base = self.map.as_mut_ptr();
        let t0 = Instant::now();
        for i in 0..n as u64 {
            for turn in 0..2u64 {
                let sender = turn as usize; // rank 0 pings, rank 1 pongs
                let seq = self.next + 2 * i + turn + 1;
                if sender == me {
                    // SAFETY: the data area [RAW_DATA, RAW_DATA + size) is inside the mapping
                    // and the peer does not touch it until it sees `seq`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(buf.as_ptr(), base.add(RAW_DATA), size)
                    };
                    self.seq(me).store(seq, Ordering::Release);
                } else {
                    while self.seq(1 - me).load(Ordering::Acquire) < seq {
                        std::hint::spin_loop();
                    }
                    // SAFETY: published by the Release store we just observed; the sender
                    // does not write again before our own reply.
                    unsafe {
                        std::ptr::copy_nonoverlapping(base.add(RAW_DATA), buf.as_mut_ptr(), size)
                    };
                }
            }
        }
        self.next += 2 * n as u64;
        t0.elapsed().as_secs_f64() / (2 * n) as f64
    }
}

fn raw_open(b: &dyn Bootstrap, max: usize) -> Raw {
    let path = format!("/dev/shm/mad-bench-raw-{}", b.size());
    let file = if b.rank() == 0 {
        let _ = std::fs::remove_file(&path);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        f.set_len((RAW_DATA + max) as u64).unwrap();
        b.barrier("raw-created").unwrap();
        f
    } else {
        b.barrier("raw-created").unwrap();
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
    };
    // SAFETY: the file is a private benchmark file in /dev/shm shared by exactly these two
    // processes, accessed as described in `Raw`.
    let map = unsafe { memmap2::MmapMut::map_mut(&file).unwrap() };
    b.barrier("raw-mapped").unwrap();
    if b.rank() == 0 {
        let _ = std::fs::remove_file(&path);
    }
    Raw { map, next: 0 }
}

/// Run `fs` alternately (run 1 of each, run 2 of each, ...) so that every variant sees the
/// same background load, then print min / median per variant.
fn compare(b: &dyn Bootstrap, size: usize, fs: &mut [(&str, &mut dyn FnMut() -> f64)]) {
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); fs.len()];
    for _ in 0..RUNS {
        for (i, (_, f)) in fs.iter_mut().enumerate() {
            b.barrier("run").unwrap();
            t[i].push(f());
        }
    }
    if b.rank() != 0 {
        return;
    }
    for (i, (what, _)) in fs.iter().enumerate() {
        let t = &mut t[i];
        t.sort_by(|a, b| a.total_cmp(b));
        let (min, med) = (t[0], t[RUNS / 2]);
        println!(
            "{what:<28} {size:>9} B  one-way {:>9.3} / {:>9.3} us   {:>6.2} / {:>6.2} GB/s",
            min * 1e6,
            med * 1e6,
            size as f64 / min / 1e9,
            size as f64 / med / 1e9
        );
    }
}

/// A boxed measurement.
type Timed<'a> = Box<dyn FnMut() -> f64 + 'a>;

/// One ping-pong series through the engine; one-way seconds.
fn engine_pingpong(ch: &mad_core::Channel, me: usize, size: usize) -> f64 {
    use mad_core::{RecvMode, SendMode};
    let peer = 1 - me;
    let mut buf = vec![me as u8; size];
    let n = iters(size);
    let t0 = Instant::now();
    for _ in 0..n {
        for turn in 0..2 {
            if turn == me {
                let mut p = ch.begin_packing(peer).unwrap();
                p.pack(&buf, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            } else {
                let mut u = ch.begin_unpacking_from(peer).unwrap();
                u.unpack(&mut buf, SendMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
            }
        }
    }
    t0.elapsed().as_secs_f64() / (2 * n) as f64
}

/// Pin this process to CPU `cpu` (rank 0 on CPU 0, rank 1 on CPU 1), as in BASELINES.md.
fn pin(cpu: usize) {
    // SAFETY: `set` is a properly initialised cpu_set_t owned by this frame; the call only
    // reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn main() {
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            CLI.other(arg)?;
        }
        Ok(())
    });
    let (b, _child) = match std::env::var(CHILD_ENV) {
        Ok(path) => {
            let secret = Secret::from_hex(&std::env::var(SECRET_ENV).unwrap()).unwrap();
            (PairBootstrap::connect(&path, secret).unwrap(), None)
        }
        Err(_) => {
            let path = format!("/tmp/mad-shm-bench-{}.sock", std::process::id());
            let l = UnixListener::bind(&path).unwrap();
            let secret = Secret::random().unwrap();
            let child = std::process::Command::new(std::env::current_exe().unwrap())
                .env(CHILD_ENV, &path)
                .env(SECRET_ENV, secret.to_hex())
                .spawn()
                .unwrap();
            let b = PairBootstrap::accept(&l, secret).unwrap();
            let _ = std::fs::remove_file(&path);
            (b, Some(child))
        }
    };
    let me = b.rank();
    pin(me);
    const MIB4: usize = 4 << 20;
    let mut raw = raw_open(&b, MIB4);
    let ch = std::cell::RefCell::new(open_with(&b, &common::config(&[("cma", "auto")])).unwrap());
    let mut ch_off =
        open_with(&b, &common::config(&[("cma", "off"), ("ring", "1048576")])).unwrap();
    if me == 0 {
        println!("# raw polled-flag ring vs the driver (TM 0 ring for 8 B, TM 1 cma for 4 MiB)");
    }
    for size in [8, MIB4] {
        let cma = size > mad_shm::DEFAULT_RING_MAX;
        compare(
            &b,
            size,
            &mut [
                ("raw polled flag", &mut || raw.pingpong(me, size)),
                (
                    if cma {
                        "shm driver, cma TM"
                    } else {
                        "shm driver, ring TM"
                    },
                    &mut || driver_pingpong(&mut ch.borrow_mut(), me, size, cma),
                ),
                ("shm driver, cma=off ring=1M", &mut || {
                    driver_pingpong(&mut ch_off, me, size, false)
                }),
            ],
        );
    }
    if me == 0 {
        println!("# threshold sweep: the same size forced through ring (TM 0) and cma (TM 1)");
    }
    for s in [
        4 << 10,
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
        1 << 20,
    ] {
        compare(
            &b,
            s,
            &mut [
                ("  ring", &mut || {
                    driver_pingpong(&mut ch.borrow_mut(), me, s, false)
                }),
                ("  cma", &mut || {
                    driver_pingpong(&mut ch.borrow_mut(), me, s, true)
                }),
            ],
        );
    }
    drop(ch);
    drop(ch_off);
    if me == 0 {
        println!("# cma=off: 4 MiB through the ring, by ring size");
    }
    let mut chs: Vec<(String, OpenedChannel)> = ["65536", "262144", "1048576"]
        .iter()
        .map(|r| {
            (
                format!("  ring={r}"),
                open_with(&b, &common::config(&[("cma", "off"), ("ring", r)])).unwrap(),
            )
        })
        .collect();
    {
        let mut fs: Vec<(&str, Timed<'_>)> = chs
            .iter_mut()
            .map(|(name, ch)| {
                let f: Box<dyn FnMut() -> f64> =
                    Box::new(move || driver_pingpong(ch, me, MIB4, false));
                (name.as_str(), f)
            })
            .collect();
        let mut refs: Vec<(&str, &mut dyn FnMut() -> f64)> = fs
            .iter_mut()
            .map(|(n, f)| (*n, &mut **f as &mut dyn FnMut() -> f64))
            .collect();
        compare(&b, MIB4, &mut refs);
    }
    drop(chs);
    // The full engine (Session / Channel / Packer / Unpacker) over the driver, polling.
    let session = mad_core::Session::builder()
        .driver(mad_shm::ShmDriver::new())
        .bootstrap(Box::new(b))
        .build()
        .unwrap();
    let ch = session
        .open_channel_with(mad_core::ChannelConfig::parse("bench", "shm,progress=poll").unwrap())
        .unwrap();
    let b = session.bootstrap();
    if me == 0 {
        println!("# engine: one piece per message (pack CHEAPER / unpack CHEAPER), progress=poll");
    }
    for s in [8, 1 << 10, 64 << 10, MIB4] {
        compare(
            b,
            s,
            &mut [("engine pack/unpack", &mut || engine_pingpong(&ch, me, s))],
        );
    }
    b.barrier("done").unwrap();
    if let Some(mut c) = _child {
        c.wait().unwrap();
    }
}
