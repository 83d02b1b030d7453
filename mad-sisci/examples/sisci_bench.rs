//! Cross-process ping-pong through the Madeleine engine: `sisci:local` beside `shm` and a raw
//! polled-flag buffer (written here, no protocol: one store-copy into the peer's memory, one
//! flag, one copy out), in the same run; plus the threshold sweeps of `NOTES.md`.
//!
//! ```text
//! CARGO_TARGET_DIR=target-sisci cargo run --release -p mad-sisci --example sisci_bench [-- compare|compare-poll|sweep|sweep-poll|short|all]
//! ```
//!
//! The program re-executes itself as rank 1 (joined through mad-core's bootstrap server).
//! Output: `what size one-way-µs MB/s`, min and median of several runs, variants of one
//! comparison interleaved run by run.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::cli::{Arg, Cli, ValueExt};

/// The command line.
const CLI: Cli = Cli::new(
    "sisci_bench",
    env!("CARGO_PKG_VERSION"),
    "usage: sisci_bench [compare|compare-poll|sweep|sweep-poll|short|all]

Cross-process ping-pong through the engine: sisci:local beside shm and a raw polled-flag
buffer, and the threshold sweeps (re-executes itself as rank 1). Default: all.

  -h, --help     this text
  -V, --version  the version",
);
/// The modes of the first argument.
const MODES: [&str; 6] = [
    "compare",
    "compare-poll",
    "sweep",
    "sweep-poll",
    "short",
    "all",
];
use mad_core::bootstrap::Bootstrap;
use mad_core::hostmem::sys::Mapping;
use mad_core::hostmem::Region;
use mad_core::launch::server::BootstrapServer;
use mad_core::launch::{vars, MadrunBootstrap, MadrunEnv};
use mad_core::{Channel, ChannelConfig, RecvMode, SendMode, Session};
use mad_shm::ShmDriver;
use mad_sisci::SisciDriver;

const RUNS: usize = 5;

fn iters(size: usize) -> usize {
    (40_000_000 / (size + 1500)).clamp(10, 4000)
}

/// One-way time in µs of a ping-pong of `size` bytes on `ch`.
fn engine_pingpong(ch: &Channel, me: usize, size: usize, buf: &mut [u8]) -> f64 {
    let n = iters(size);
    let peer = 1 - me;
    let buf = &mut buf[..size];
    let t = Instant::now();
    for _ in 0..n + 1 {
        if me == 0 {
            let mut p = ch.begin_packing(peer).unwrap();
            p.pack(buf, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            let mut u = ch.begin_unpacking_from(peer).unwrap();
            u.unpack(buf, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
        } else {
            let mut u = ch.begin_unpacking_from(peer).unwrap();
            u.unpack(buf, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            let mut p = ch.begin_packing(peer).unwrap();
            p.pack(buf, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
    }
    t.elapsed().as_secs_f64() * 1e6 / (2.0 * (n + 1) as f64)
}

/// The raw reference: each process exports `RAW` bytes + a flag line in `/dev/shm`; a message
/// is a copy into the peer's buffer, a Release store of the flag, an Acquire poll and a copy
/// out on the other side. No ring, no acknowledgement (ping-pong serialises the buffer).
struct Raw {
    own: Region,
    peer: Region,
    seq: u64,
}

const RAW: usize = 8 << 20;

fn raw_open(b: &dyn Bootstrap) -> Raw {
    let me = b.rank();
    let name = format!("/dev/shm/mad-sisci-{}-rawbench-{me}", std::process::id());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&name)
        .unwrap();
    f.set_len((RAW + 4096) as u64).unwrap();
    let own = Region::from_mapping(Arc::new(Mapping::map(&f).unwrap()));
    let all = b.allgather("rawbench", name.as_bytes()).unwrap();
    let pf = OpenOptions::new()
        .read(true)
        .write(true)
        .open(String::from_utf8(all[1 - me].clone()).unwrap())
        .unwrap();
    let peer = Region::from_mapping(Arc::new(Mapping::map(&pf).unwrap()));
    b.allgather("rawbench-mapped", &[]).unwrap();
    std::fs::remove_file(&name).unwrap();
    Raw { own, peer, seq: 0 }
}

impl Raw {
    fn send(&mut self, data: &[u8]) {
        self.seq += 1;
        self.peer.write(4096, data).unwrap();
        self.peer
            .u64_at(0)
            .unwrap()
            .store(self.seq, Ordering::Release);
    }
    fn recv(&mut self, out: &mut [u8]) {
        let f = self.own.u64_at(0).unwrap();
        while f.load(Ordering::Acquire) != self.seq + 1 {
            std::hint::spin_loop();
        }
        self.seq += 1;
        self.own.read(4096, out).unwrap();
    }
    fn pingpong(&mut self, me: usize, size: usize, buf: &mut [u8]) -> f64 {
        let n = iters(size);
        let buf = &mut buf[..size];
        let t = Instant::now();
        for _ in 0..n + 1 {
            if me == 0 {
                self.send(buf);
                self.recv(buf);
            } else {
                self.recv(buf);
                self.send(buf);
            }
        }
        t.elapsed().as_secs_f64() * 1e6 / (2.0 * (n + 1) as f64)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Run every variant once per run, interleaved; print min and median of each.
fn compare(
    b: &dyn Bootstrap,
    label: &str,
    size: usize,
    fs: &mut [(&str, &mut dyn FnMut() -> f64)],
) {
    let mut res: Vec<Vec<f64>> = fs.iter().map(|_| Vec::new()).collect();
    for _ in 0..RUNS {
        for (i, (_, f)) in fs.iter_mut().enumerate() {
            b.allgather("bench-sync", &[]).unwrap();
            res[i].push(f());
        }
    }
    if b.rank() == 0 {
        for (i, (name, _)) in fs.iter().enumerate() {
            let min = res[i].iter().cloned().fold(f64::MAX, f64::min);
            let med = median(&mut res[i]);
            println!(
                "{label:<8} {name:<28} {size:>9} B  one-way {min:>9.3} / {med:>9.3} µs  {:>8.0} / {:>8.0} MB/s",
                size as f64 / min,
                size as f64 / med
            );
        }
    }
}

fn env_of(addr: &str, secret: &Secret, rank: usize) -> HashMap<String, String> {
    HashMap::from([
        (vars::RANK.to_string(), rank.to_string()),
        (vars::SIZE.to_string(), "2".to_string()),
        (vars::BOOTSTRAP.to_string(), addr.to_string()),
        (vars::SECRET.to_string(), secret.to_hex()),
        (vars::LOCAL_SIZE.to_string(), "2".to_string()),
    ])
}

fn main() {
    let what = CLI.parse(|p| {
        let mut what = None;
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Value(v) if what.is_none() => {
                    let v = v.string()?;
                    if !MODES.contains(&v.as_str()) {
                        return Err(
                            format!("unknown mode `{v}` (one of {})", MODES.join(", ")).into()
                        );
                    }
                    what = Some(v);
                }
                other => CLI.other(other)?,
            }
        }
        Ok(what.unwrap_or_else(|| "all".into()))
    });
    let (session, child) = if std::env::var_os(vars::BOOTSTRAP).is_some() {
        let b = MadrunBootstrap::from_env().unwrap().unwrap();
        (
            Session::builder()
                .driver(SisciDriver::new())
                .driver(ShmDriver::new())
                .bootstrap(Box::new(b))
                .build()
                .unwrap(),
            None,
        )
    } else {
        let secret = Secret::random().unwrap();
        let server = BootstrapServer::start(
            "127.0.0.1:0".parse().unwrap(),
            2,
            secret.clone(),
            Box::new(|l| eprintln!("{l}")),
        )
        .unwrap();
        let addr = server.advertised_addr().to_string();
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .envs(env_of(&addr, &secret, 1))
            .spawn()
            .unwrap();
        let e0 = env_of(&addr, &secret, 0);
        let env = MadrunEnv::parse(|k| e0.get(k).cloned()).unwrap().unwrap();
        let b = MadrunBootstrap::connect(env).unwrap();
        std::mem::forget(server);
        (
            Session::builder()
                .driver(SisciDriver::new())
                .driver(ShmDriver::new())
                .bootstrap(Box::new(b))
                .build()
                .unwrap(),
            Some(child),
        )
    };
    let me = session.rank();
    let b = session.bootstrap();
    let open = |name: &str, spec: &str| {
        session
            .open_channel_with(ChannelConfig::parse(name, spec).unwrap())
            .unwrap()
    };
    let mut buf = vec![0x5au8; 8 << 20];

    if what == "short" {
        // Short slots against the ring, both ranks busy-polling (progress=poll): the protocol
        // cost whenever both processes are on a CPU.
        let slots = open("sw-slots-p", "sisci:local,tm.short=4096,progress=poll");
        let ring = open("sw-ring-p", "sisci:local,tm.short=0,progress=poll");
        for size in [8usize, 32, 56, 112, 168, 224, 336, 512, 1024] {
            let mut buf2 = buf.clone();
            compare(
                b,
                "short/poll",
                size,
                &mut [
                    ("slots (tm.short=4096)", &mut || {
                        engine_pingpong(&slots, me, size, &mut buf)
                    }),
                    ("ring (tm.short=0)", &mut || {
                        engine_pingpong(&ring, me, size, &mut buf2)
                    }),
                ],
            );
        }
    }

    if what == "sweep" || what == "sweep-poll" || what == "all" {
        let poll = if what == "sweep-poll" {
            ",progress=poll"
        } else {
            ""
        };
        // Short slots against the ring for small pieces.
        let slots = open("sw-slots", &format!("sisci:local,tm.short=4096{poll}"));
        let ring = open("sw-ring", &format!("sisci:local,tm.short=0{poll}"));
        for size in [8usize, 32, 56, 112, 168, 224, 336, 512, 1024] {
            let mut buf2 = buf.clone();
            compare(
                b,
                "short",
                size,
                &mut [
                    ("slots (tm.short=4096)", &mut || {
                        engine_pingpong(&slots, me, size, &mut buf)
                    }),
                    ("ring (tm.short=0)", &mut || {
                        engine_pingpong(&ring, me, size, &mut buf2)
                    }),
                ],
            );
        }
        drop((slots, ring));
        // Ring against DMA chunks for medium and large pieces.
        let ring = open("sw-ring2", &format!("sisci:local,tm.ring=1000000000{poll}"));
        let dma = open("sw-dma", &format!("sisci:local,tm.ring=112{poll}"));
        for size in [
            1024usize,
            4096,
            8192,
            16384,
            32768,
            65536,
            262144,
            1 << 20,
            4 << 20,
        ] {
            let mut buf2 = buf.clone();
            compare(
                b,
                "ring/dma",
                size,
                &mut [
                    ("ring (tm.ring=inf)", &mut || {
                        engine_pingpong(&ring, me, size, &mut buf)
                    }),
                    ("dma (tm.ring=112)", &mut || {
                        engine_pingpong(&dma, me, size, &mut buf2)
                    }),
                ],
            );
        }
        drop((ring, dma));
        // DMA chunk size.
        let c16 = open(
            "sw-c16",
            &format!("sisci:local,chunk=16384,chunks=32{poll}"),
        );
        let c64 = open("sw-c64", &format!("sisci:local,chunk=65536,chunks=8{poll}"));
        let c256 = open(
            "sw-c256",
            &format!("sisci:local,chunk=262144,chunks=4{poll}"),
        );
        for size in [65536usize, 1 << 20, 4 << 20] {
            let mut buf2 = buf.clone();
            let mut buf3 = buf.clone();
            compare(
                b,
                "chunk",
                size,
                &mut [
                    ("16 KiB x 32", &mut || {
                        engine_pingpong(&c16, me, size, &mut buf)
                    }),
                    ("64 KiB x 8", &mut || {
                        engine_pingpong(&c64, me, size, &mut buf2)
                    }),
                    ("256 KiB x 4", &mut || {
                        engine_pingpong(&c256, me, size, &mut buf3)
                    }),
                ],
            );
        }
    }

    if what == "compare" || what == "compare-poll" || what == "all" {
        // `compare-poll`: both drivers busy-poll (progress=poll), like the raw buffer.
        let poll = if what == "compare-poll" {
            ",progress=poll"
        } else {
            ""
        };
        let sisci = open("cmp-sisci", &format!("sisci:local{poll}"));
        let shm = open("cmp-shm", &format!("shm{poll}"));
        let mut raw = raw_open(b);
        for size in [8usize, 64, 1024, 16384, 65536, 1 << 20, 4 << 20] {
            let mut buf2 = buf.clone();
            let mut buf3 = buf.clone();
            compare(
                b,
                "compare",
                size,
                &mut [
                    ("sisci:local", &mut || {
                        engine_pingpong(&sisci, me, size, &mut buf)
                    }),
                    ("shm", &mut || engine_pingpong(&shm, me, size, &mut buf2)),
                    ("raw flag+copy", &mut || raw.pingpong(me, size, &mut buf3)),
                ],
            );
        }
    }
    b.allgather("bench-done", &[]).unwrap();
    if let Some(mut c) = child {
        let end = Instant::now() + Duration::from_secs(30);
        while c.try_wait().unwrap().is_none() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
