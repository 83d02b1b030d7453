//! Cross-process ping-pong: the shm driver (driver level, polled) against a raw polled-flag
//! ring written here, plus the ring/CMA threshold sweep.
//!
//! ```text
//! cargo run --release -p mad-shm --example shm_pingpong
//! ```
//!
//! The program re-executes itself as rank 1 (a second process); both ranks busy-poll.
//! Output: one line per measurement, `what size one-way-latency bandwidth`, min and median of
//! three runs.

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
use mad_core::driver::{OpenedChannel, RxLink, TxLink};

const CHILD_ENV: &str = "MAD_SHM_BENCH_CHILD";
const SECRET_ENV: &str = "MAD_SHM_BENCH_SECRET";
const RUNS: usize = 3;

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

fn report(b: &dyn Bootstrap, what: &str, size: usize, mut f: impl FnMut() -> f64) {
    let mut t: Vec<f64> = (0..RUNS)
        .map(|_| {
            b.barrier("run").unwrap();
            f()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    if b.rank() == 0 {
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

fn main() {
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
    const MIB4: usize = 4 << 20;
    let mut raw = raw_open(&b, MIB4);
    report(&b, "raw polled flag", 8, || raw.pingpong(me, 8));
    report(&b, "raw polled flag", MIB4, || raw.pingpong(me, MIB4));

    let mut ch = open_with(&b, &common::config(&[])).unwrap();
    report(&b, "shm ring (TM 0)", 8, || {
        driver_pingpong(&mut ch, me, 8, false)
    });
    report(&b, "shm cma (TM 1)", MIB4, || {
        driver_pingpong(&mut ch, me, MIB4, true)
    });
    if me == 0 {
        println!(
            "# threshold sweep: ring copy vs cma, default ring {} B",
            mad_shm::DEFAULT_RING
        );
    }
    for s in [
        1 << 10,
        4 << 10,
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
        1 << 20,
    ] {
        report(&b, "  sweep ring", s, || {
            driver_pingpong(&mut ch, me, s, false)
        });
        report(&b, "  sweep cma", s, || {
            driver_pingpong(&mut ch, me, s, true)
        });
    }
    drop(ch);
    if me == 0 {
        println!("# cma=off: 4 MiB through the ring, by ring size");
    }
    for ring in ["65536", "262144", "1048576"] {
        let mut ch = open_with(&b, &common::config(&[("cma", "off"), ("ring", ring)])).unwrap();
        report(&b, &format!("  ring={ring}"), MIB4, || {
            driver_pingpong(&mut ch, me, MIB4, false)
        });
    }
    b.barrier("done").unwrap();
    if let Some(mut c) = _child {
        c.wait().unwrap();
    }
}
