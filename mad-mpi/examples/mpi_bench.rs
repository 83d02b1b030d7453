//! MPI channel benchmark: the `mpi` Madeleine channel against raw rsmpi in the same job.
//!
//! ```text
//! MPICC=mpicc.mpich CARGO_TARGET_DIR=target-mpich cargo build --release -p mad-mpi --example mpi_bench
//! mpiexec.mpich -bind-to core -n 2 target-mpich/release/examples/mpi_bench [MODE]
//! ```
//!
//! Modes: `all` (lat + drv + rpc + sweep), `lat` (8 B latency and 4 MiB ping-pong bandwidth),
//! `drv` (the driver's links alone, test mini-engine, against raw MPI; `MPI_BENCH_ONLY=raw|drv|chan`
//! runs one kind only, `MPI_BENCH_ONLY_ITERS` round trips, for `perf`/`valgrind`), `rpc`,
//! `sweep` (the TM thresholds), `cmp` (channel specs side by side: `MPI_BENCH_SPECS`,
//! `MPI_BENCH_SIZES`, `MPI_BENCH_PIECES`), `cpu` (processor time per message, each side alone),
//! `phases` (TSC cycles per phase of the echo side), `costs` (one idle poll).
//!
//! Every figure is a one-way time (half a round trip) or a one-way bandwidth from a ping-pong
//! between ranks 0 and 1; each measurement runs 5 times (`MPI_BENCH_RUNS`), raw MPI and channel interleaved, and
//! prints min / median. Raw MPI uses blocking `MPI_Send`/`MPI_Recv` on `MPI_COMM_WORLD`.

use std::time::Instant;

use mad_core::cli::{Arg, Cli, ValueExt};

/// The command line.
const CLI: Cli = Cli::new(
    "mpi_bench",
    env!("CARGO_PKG_VERSION"),
    "usage: mpiexec -n 2 mpi_bench [all|lat|bw|drv|rpc|sweep|cmp|cpu|phases|costs]

The mpi channel against raw rsmpi in the same job (default mode: all). Environment:
MPI_BENCH_RUNS, MPI_BENCH_ONLY, MPI_BENCH_ONLY_ITERS, MPI_BENCH_SPECS, MPI_BENCH_SIZES,
MPI_BENCH_PIECES.

  -h, --help     this text
  -V, --version  the version",
);
/// The modes of the first argument.
const MODES: [&str; 10] = [
    "all", "lat", "bw", "drv", "rpc", "sweep", "cmp", "cpu", "phases", "costs",
];

#[path = "../tests/common/mod.rs"]
mod common;

use mad_core::{Channel, ChannelConfig, RecvMode, Result, SendMode, Session};
use mad_mpi::{MpiBootstrap, MpiDriver};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

/// Runs per measurement (`MPI_BENCH_RUNS`, default 5).
fn runs() -> usize {
    std::env::var("MPI_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
        .max(1)
}

fn iters_for(bytes: usize) -> usize {
    (256_000_000 / bytes.max(1)).clamp(20, 20_000)
}

/// Time `iters` round trips (0 sends first); returns the one-way time in µs.
fn pingpong(
    world: &SimpleCommunicator,
    me: usize,
    iters: usize,
    send: &mut dyn FnMut() -> Result<()>,
    recv: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    let round = |n: usize,
                 send: &mut dyn FnMut() -> Result<()>,
                 recv: &mut dyn FnMut() -> Result<()>|
     -> Result<()> {
        for _ in 0..n {
            if me == 0 {
                send()?;
                recv()?;
            } else {
                recv()?;
                send()?;
            }
        }
        Ok(())
    };
    world.barrier();
    round((iters / 10).max(2), send, recv)?;
    world.barrier();
    let t = Instant::now();
    round(iters, send, recv)?;
    Ok(t.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64))
}

fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[0], v[v.len() / 2])
}

struct Bench<'a> {
    world: SimpleCommunicator,
    me: usize,
    peer: usize,
    session: &'a Session,
}

impl Bench<'_> {
    fn open(&self, name: &str, spec: &str) -> Result<Channel> {
        self.session
            .open_channel_with(ChannelConfig::parse(name, spec)?)
    }

    fn raw_pp(&self, n: usize) -> Result<f64> {
        self.raw_pp_n(n, iters_for(n))
    }

    fn raw_pp_n(&self, n: usize, iters: usize) -> Result<f64> {
        let buf = vec![1u8; n];
        let mut rbuf = vec![0u8; n];
        let p = self.world.process_at_rank(self.peer as i32);
        pingpong(
            &self.world,
            self.me,
            iters,
            &mut || {
                p.send(&buf[..]);
                Ok(())
            },
            &mut || {
                p.receive_into(&mut rbuf[..]);
                Ok(())
            },
        )
    }

    /// Raw MPI with the receiver in non-blocking style (`MPI_Irecv` + `MPI_Test` loop), the
    /// style a driver that must not block uses.
    fn raw_pp_nb(&self, n: usize) -> Result<f64> {
        let buf = vec![1u8; n];
        let mut rbuf = vec![0u8; n];
        let p = self.world.process_at_rank(self.peer as i32);
        pingpong(
            &self.world,
            self.me,
            iters_for(n),
            &mut || {
                p.send(&buf[..]);
                Ok(())
            },
            &mut || {
                mpi::request::scope(|sc| {
                    let mut req = p.immediate_receive_into(sc, &mut rbuf[..]);
                    loop {
                        match req.test() {
                            Ok(_) => break,
                            Err(r) => req = r,
                        }
                    }
                });
                Ok(())
            },
        )
    }

    /// Raw MPI ping-pong in the channel's protocol: an 8-byte message, then the body (the
    /// receiver posts the body's receive once the first message is in).
    fn raw_pp_two(&self, n: usize) -> Result<f64> {
        let buf = vec![1u8; n];
        let mut rbuf = vec![0u8; n];
        let p = self.world.process_at_rank(self.peer as i32);
        pingpong(
            &self.world,
            self.me,
            iters_for(n),
            &mut || {
                p.send(&(n as u64));
                p.send(&buf[..]);
                Ok(())
            },
            &mut || {
                let (len, _) = p.receive::<u64>();
                p.receive_into(&mut rbuf[..len as usize]);
                Ok(())
            },
        )
    }

    fn chan_pp(&self, ch: &Channel, n: usize) -> Result<f64> {
        let buf = vec![1u8; n];
        let mut rbuf = vec![0u8; n];
        let peer = self.peer;
        pingpong(
            &self.world,
            self.me,
            iters_for(n),
            &mut || {
                let mut pk = ch.begin_packing(peer)?;
                pk.pack(&buf, RecvMode::Cheaper)?;
                pk.end_packing()
            },
            &mut || {
                let mut u = ch.begin_unpacking_from(peer)?;
                u.unpack(&mut rbuf, SendMode::Cheaper)?;
                u.end_unpacking()
            },
        )
    }

    /// Raw RPC, one packed message: header and body copied into one buffer; the receiver
    /// matches it with MPI_Mprobe, reads its size and receives it.
    fn raw_rpc_packed(&self, n: usize) -> Result<f64> {
        let body = vec![2u8; n];
        let mut sbuf = vec![0u8; 8 + n];
        let mut rbuf = vec![0u8; 8 + n];
        let p = self.world.process_at_rank(self.peer as i32);
        pingpong(
            &self.world,
            self.me,
            iters_for(n),
            &mut || {
                sbuf[..8].copy_from_slice(&(n as u64).to_le_bytes());
                sbuf[8..].copy_from_slice(&body);
                p.send(&sbuf[..]);
                Ok(())
            },
            &mut || {
                let (msg, st) = p.matched_probe();
                let c = st.count(u8::equivalent_datatype()) as usize;
                msg.matched_receive_into(&mut rbuf[..c]);
                let len = u64::from_le_bytes(rbuf[..8].try_into().unwrap_or_default());
                assert_eq!(len as usize, c - 8);
                Ok(())
            },
        )
    }

    /// Raw RPC, two messages: the header, then the body of the size it announces.
    fn raw_rpc_two(&self, n: usize) -> Result<f64> {
        let body = vec![2u8; n];
        let mut rbuf = vec![0u8; n];
        let p = self.world.process_at_rank(self.peer as i32);
        pingpong(
            &self.world,
            self.me,
            iters_for(n),
            &mut || {
                p.send(&(n as u64));
                p.send(&body[..]);
                Ok(())
            },
            &mut || {
                let (len, _) = p.receive::<u64>();
                p.receive_into(&mut rbuf[..len as usize]);
                Ok(())
            },
        )
    }

    /// Channel RPC: 8-byte EXPRESS header, CHEAPER body.
    fn chan_rpc(&self, ch: &Channel, n: usize) -> Result<f64> {
        let body = vec![2u8; n];
        let mut rbuf = vec![0u8; n];
        let peer = self.peer;
        pingpong(
            &self.world,
            self.me,
            iters_for(n),
            &mut || {
                let mut pk = ch.begin_packing(peer)?;
                pk.pack_value(&(n as u64), RecvMode::Express)?;
                pk.pack(&body, RecvMode::Cheaper)?;
                pk.end_packing()
            },
            &mut || {
                let mut u = ch.begin_unpacking_from(peer)?;
                let len: u64 = u.unpack_value()?;
                u.unpack(&mut rbuf[..len as usize], SendMode::Cheaper)?;
                u.end_unpacking()
            },
        )
    }

    /// A message of `k` CHEAPER slices of `s` bytes each.
    fn chan_group(&self, ch: &Channel, k: usize, s: usize) -> Result<f64> {
        let slices: Vec<Vec<u8>> = (0..k).map(|i| vec![i as u8; s]).collect();
        let mut rs: Vec<Vec<u8>> = (0..k).map(|_| vec![0u8; s]).collect();
        let peer = self.peer;
        pingpong(
            &self.world,
            self.me,
            iters_for(k * s),
            &mut || {
                let mut pk = ch.begin_packing(peer)?;
                for sl in &slices {
                    pk.pack(sl, RecvMode::Cheaper)?;
                }
                pk.end_packing()
            },
            &mut || {
                let mut u = ch.begin_unpacking_from(peer)?;
                for r in rs.iter_mut() {
                    u.unpack(r, SendMode::Cheaper)?;
                }
                u.end_unpacking()
            },
        )
    }

    /// The driver alone (links driven by the test mini-engine, no core): 8 B ping-pong.
    fn drv_lat(&self) -> Result<()> {
        use mad_core::driver::{Driver, OpenContext};
        let d = MpiDriver::new();
        let spec = std::env::var("MPI_BENCH_SPEC").unwrap_or_else(|_| "mpi".into());
        let config = ChannelConfig::parse("drv", &spec)?;
        let table = d.tm_table(&config)?;
        let progress = mad_core::progress::ProgressPolicy::default();
        let mut ch = d.open(&OpenContext::new(
            &config,
            self.session.bootstrap(),
            &table,
            &progress,
        ))?;
        let link = ch.links[self.peer]
            .as_mut()
            .ok_or_else(|| mad_core::Error::protocol(self.peer, "no link"))?;
        let link = std::cell::RefCell::new(link);
        let buf = [1u8; 8];
        let mut rbuf = [0u8; 8];
        if let Ok(only) = std::env::var("MPI_BENCH_ONLY") {
            // For `perf`/`valgrind`: one kind of ping-pong only, 200 000 round trips
            // (`MPI_BENCH_ONLY_ITERS`).
            let iters = std::env::var("MPI_BENCH_ONLY_ITERS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(200_000);
            let t = match only.as_str() {
                "raw" => self.raw_pp_n(8, iters)?,
                "chan" => {
                    let ch = self.open("only", "mpi")?;
                    let mut rb = [0u8; 8];
                    let peer = self.peer;
                    pingpong(
                        &self.world,
                        self.me,
                        iters,
                        &mut || {
                            let mut pk = ch.begin_packing(peer)?;
                            pk.pack(&buf, RecvMode::Cheaper)?;
                            pk.end_packing()
                        },
                        &mut || {
                            let mut u = ch.begin_unpacking_from(peer)?;
                            u.unpack(&mut rb, SendMode::Cheaper)?;
                            u.end_unpacking()
                        },
                    )?
                }
                _ => pingpong(
                    &self.world,
                    self.me,
                    iters,
                    &mut || {
                        common::send(link.borrow_mut().tx.as_mut(), &[common::Piece::Copy(&buf)])
                    },
                    &mut || {
                        common::recv(
                            link.borrow_mut().rx.as_mut(),
                            &mut [common::Dest::Copy(&mut rbuf)],
                        )
                    },
                )?,
            };
            self.say(format!("{only}: {t:.3} us"));
            return Ok(());
        }
        let (mut raw, mut drv, mut nb) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs() {
            raw.push(self.raw_pp(8)?);
            nb.push(self.raw_pp_nb(8)?);
            drv.push(pingpong(
                &self.world,
                self.me,
                iters_for(8),
                &mut || common::send(link.borrow_mut().tx.as_mut(), &[common::Piece::Copy(&buf)]),
                &mut || {
                    common::recv(
                        link.borrow_mut().rx.as_mut(),
                        &mut [common::Dest::Copy(&mut rbuf)],
                    )
                },
            )?);
        }
        let big = vec![3u8; 4 << 20];
        let mut rbig = vec![0u8; 4 << 20];
        let (mut rawb, mut drvb) = (Vec::new(), Vec::new());
        for _ in 0..runs() {
            rawb.push(self.raw_pp(4 << 20)?);
            drvb.push(pingpong(
                &self.world,
                self.me,
                iters_for(4 << 20),
                &mut || {
                    common::send(
                        link.borrow_mut().tx.as_mut(),
                        &[common::Piece::Copy(&buf), common::Piece::Group(vec![&big])],
                    )
                },
                &mut || {
                    common::recv(
                        link.borrow_mut().rx.as_mut(),
                        &mut [
                            common::Dest::Copy(&mut rbuf),
                            common::Dest::Group(vec![&mut rbig]),
                        ],
                    )
                },
            )?);
        }
        let gb = |us: f64| (4 << 20) as f64 / us / 1e3;
        let (a, b) = (stats(&mut rawb), stats(&mut drvb));
        self.say(format!(
            "driver only, 4 MiB (8 B copy + 4 MiB group): raw MPI {:.2} / {:.2} GB/s, driver links {:.2} / {:.2} GB/s, ratio (median) {:.3}",
            gb(a.0), gb(a.1), gb(b.0), gb(b.1), gb(b.1) / gb(a.1)
        ));
        let (rmin, rmed) = stats(&mut raw);
        let (cmin, cmed) = stats(&mut drv);
        let (nmin, nmed) = stats(&mut nb);
        self.say(format!(
            "driver only, latency 8 B: raw MPI {rmin:.3} / {rmed:.3} us, raw MPI_Irecv+MPI_Test {nmin:.3} / {nmed:.3} us, driver links {cmin:.3} / {cmed:.3} us, ratio to raw (median) {:.2}x",
            cmed / rmed
        ));
        Ok(())
    }

    /// Where the time of the echo side goes, per message (8 B ping-pong, rank 1 answers): the
    /// time from "the message is seen" to "the reply has left", split in phases, in TSC cycles
    /// (median over the round trips, so preemptions do not count). Raw MPI: `MPI_Test`
    /// success → `MPI_Send` returned. Driver links: `poll_message` ready → rest of the receive
    /// (with_data, checkout, end_message) → the send (begin, with_buffer, end_message). Channel:
    /// `begin_unpacking_from` returned (header read) → unpack + end_unpacking → begin_packing +
    /// pack + end_packing.
    #[cfg(target_arch = "x86_64")]
    fn phases(&self) -> Result<()> {
        use mad_core::driver::{Driver, OpenContext};
        // SAFETY: RDTSC has no memory effects; every x86_64 CPU has it.
        let tsc = || unsafe { std::arch::x86_64::_rdtsc() };
        let iters = 100_000usize;
        let med = |v: &mut Vec<u64>| -> u64 {
            v.sort_unstable();
            v.get(v.len() / 2).copied().unwrap_or(0)
        };
        let d = MpiDriver::new();
        let config = ChannelConfig::parse("phases", "mpi")?;
        let table = d.tm_table(&config)?;
        let progress = mad_core::progress::ProgressPolicy::default();
        let mut opened = d.open(&OpenContext::new(
            &config,
            self.session.bootstrap(),
            &table,
            &progress,
        ))?;
        let link = opened.links[self.peer]
            .as_mut()
            .ok_or_else(|| mad_core::Error::protocol(self.peer, "no link"))?;
        let ch = self.open("phases-chan", "mpi")?;
        let p = self.world.process_at_rank(self.peer as i32);
        let buf = [1u8; 8];
        let mut rbuf = [0u8; 8];
        let peer = self.peer;
        for round in 0..3 {
            // raw
            let (mut a, mut b) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
            let mut z = Vec::with_capacity(iters);
            self.world.barrier();
            for _ in 0..iters {
                if self.me == 0 {
                    p.send(&buf[..]);
                    p.receive_into(&mut rbuf[..]);
                } else {
                    let (t0, t1) = mpi::request::scope(|sc| {
                        let mut req = p.immediate_receive_into(sc, &mut rbuf[..]);
                        loop {
                            let t0 = tsc();
                            match req.test() {
                                Ok(_) => break (t0, tsc()),
                                Err(r) => req = r,
                            }
                        }
                    });
                    let t2 = tsc();
                    p.send(&buf[..]);
                    let t3 = tsc();
                    z.push(t1 - t0);
                    a.push(t2 - t1);
                    b.push(t3 - t2);
                }
            }
            let raw = (med(&mut z), med(&mut a), med(&mut b));
            // driver links
            let (mut a, mut b) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
            let mut z = Vec::with_capacity(iters);
            self.world.barrier();
            for _ in 0..iters {
                if self.me == 0 {
                    common::send(link.tx.as_mut(), &[common::Piece::Copy(&buf)])?;
                    common::recv(link.rx.as_mut(), &mut [common::Dest::Copy(&mut rbuf)])?;
                } else {
                    let mut t0 = tsc();
                    while link.rx.poll_message()?.is_pending() {
                        t0 = tsc();
                    }
                    let t1 = tsc();
                    z.push(t1 - t0);
                    common::recv(link.rx.as_mut(), &mut [common::Dest::Copy(&mut rbuf)])?;
                    let t2 = tsc();
                    common::send(link.tx.as_mut(), &[common::Piece::Copy(&buf)])?;
                    let t3 = tsc();
                    a.push(t2 - t1);
                    b.push(t3 - t2);
                }
            }
            let drv = (med(&mut z), med(&mut a), med(&mut b));
            // channel
            let (mut a, mut b) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
            self.world.barrier();
            for _ in 0..iters {
                if self.me == 0 {
                    let mut pk = ch.begin_packing(peer)?;
                    pk.pack(&buf, RecvMode::Cheaper)?;
                    pk.end_packing()?;
                    let mut u = ch.begin_unpacking_from(peer)?;
                    u.unpack(&mut rbuf, SendMode::Cheaper)?;
                    u.end_unpacking()?;
                } else {
                    let mut u = ch.begin_unpacking_from(peer)?;
                    let t1 = tsc();
                    u.unpack(&mut rbuf, SendMode::Cheaper)?;
                    u.end_unpacking()?;
                    let t2 = tsc();
                    let mut pk = ch.begin_packing(peer)?;
                    pk.pack(&buf, RecvMode::Cheaper)?;
                    pk.end_packing()?;
                    let t3 = tsc();
                    a.push(t2 - t1);
                    b.push(t3 - t2);
                }
            }
            let chan = (med(&mut a), med(&mut b));
            if self.me == 1 {
                println!(
                    "phases round {round}, TSC cycles (median of {iters}): raw: successful test {} + after {} + send {}; driver links: successful poll {} + rest of recv {} + send {}; channel: unpack+end {} + pack+send {}",
                    raw.0, raw.1, raw.2, drv.0, drv.1, drv.2, chan.0, chan.1
                );
            }
        }
        self.world.barrier();
        Ok(())
    }

    /// Processor time per 8-byte message, sender and receiver apart, without waiting for the
    /// other side: rank 0 times a burst of `W` sends (eager: they do not wait for the
    /// receiver), then, after a barrier (every message has arrived), rank 1 times the `W`
    /// receives. Median over rounds of the time per message, in ns. Raw MPI (`MPI_Send`,
    /// `MPI_Recv`), the driver links (test mini-engine) and the channel, interleaved.
    fn cpu(&self) -> Result<()> {
        use mad_core::driver::{Driver, OpenContext};
        const W: usize = 32;
        let rounds = 2000usize;
        let d = MpiDriver::new();
        let config = ChannelConfig::parse("cpu", "mpi")?;
        let table = d.tm_table(&config)?;
        let progress = mad_core::progress::ProgressPolicy::default();
        let mut opened = d.open(&OpenContext::new(
            &config,
            self.session.bootstrap(),
            &table,
            &progress,
        ))?;
        let link = opened.links[self.peer]
            .as_mut()
            .ok_or_else(|| mad_core::Error::protocol(self.peer, "no link"))?;
        let ch = self.open("cpu-chan", "mpi")?;
        let p = self.world.process_at_rank(self.peer as i32);
        let buf = [1u8; 8];
        let mut rbuf = [0u8; 8];
        let peer = self.peer;
        let names = ["raw MPI", "driver links", "mpi channel"];
        let mut send_ns: Vec<Vec<f64>> = vec![Vec::new(); 3];
        let mut recv_ns: Vec<Vec<f64>> = vec![Vec::new(); 3];
        // For profiles: `MPI_BENCH_CPU_ONLY=0|1|2` runs one of the three only.
        let only: Option<usize> = std::env::var("MPI_BENCH_CPU_ONLY")
            .ok()
            .and_then(|v| v.parse().ok());
        for _ in 0..rounds {
            for (k, (sv, rv)) in send_ns.iter_mut().zip(recv_ns.iter_mut()).enumerate() {
                if only.is_some_and(|o| o != k) {
                    continue;
                }
                self.world.barrier();
                if self.me == 0 {
                    let t = Instant::now();
                    for _ in 0..W {
                        match k {
                            0 => p.send(&buf[..]),
                            1 => common::send(link.tx.as_mut(), &[common::Piece::Copy(&buf)])?,
                            _ => {
                                let mut pk = ch.begin_packing(peer)?;
                                pk.pack(&buf, RecvMode::Cheaper)?;
                                pk.end_packing()?;
                            }
                        }
                    }
                    sv.push(t.elapsed().as_nanos() as f64 / W as f64);
                }
                self.world.barrier();
                if self.me == 1 {
                    let t = Instant::now();
                    for _ in 0..W {
                        match k {
                            0 => {
                                p.receive_into(&mut rbuf[..]);
                            }
                            1 => common::recv(
                                link.rx.as_mut(),
                                &mut [common::Dest::Copy(&mut rbuf)],
                            )?,
                            _ => {
                                let mut u = ch.begin_unpacking_from(peer)?;
                                u.unpack(&mut rbuf, SendMode::Cheaper)?;
                                u.end_unpacking()?;
                            }
                        }
                    }
                    rv.push(t.elapsed().as_nanos() as f64 / W as f64);
                }
            }
        }
        // Rank 1 sends its receive figures to rank 0, which prints.
        let mut mine: Vec<f64> = recv_ns
            .iter_mut()
            .map(|v| {
                v.sort_by(|a, b| a.total_cmp(b));
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            })
            .collect();
        if self.me == 1 {
            p.send(&mine[..]);
        } else {
            p.receive_into(&mut mine[..]);
            println!("processor time per 8 B message, ns (median of {rounds} bursts of {W}; receiver: every message already arrived):");
            for (k, name) in names.iter().enumerate() {
                let v = &mut send_ns[k];
                v.sort_by(|a, b| a.total_cmp(b));
                if let Some(&m) = v.get(v.len() / 2) {
                    println!("  {name:<13} send {m:>6.1}  receive {:>6.1}", mine[k]);
                }
            }
        }
        self.world.barrier();
        Ok(())
    }

    /// Cost of one "nothing arrived" poll: driver `poll_message` vs raw `MPI_Test`.
    fn costs(&self) -> Result<()> {
        use mad_core::driver::{Driver, OpenContext};
        let d = MpiDriver::new();
        let config = ChannelConfig::parse("costs", "mpi")?;
        let table = d.tm_table(&config)?;
        let progress = mad_core::progress::ProgressPolicy::default();
        let mut ch = d.open(&OpenContext::new(
            &config,
            self.session.bootstrap(),
            &table,
            &progress,
        ))?;
        let n = 1_000_000;
        if self.me == 0 {
            let link = ch.links[self.peer]
                .as_mut()
                .ok_or_else(|| mad_core::Error::protocol(self.peer, "no link"))?;
            let t = Instant::now();
            for _ in 0..n {
                let _ = link.rx.poll_message()?;
            }
            let drv = t.elapsed().as_nanos() as f64 / n as f64;
            let mut rbuf = [0u8; 8];
            let p = self.world.process_at_rank(self.peer as i32);
            let t = Instant::now();
            mpi::request::scope(|sc| {
                let mut req = Some(p.immediate_receive_into_with_tag(sc, &mut rbuf[..], 999));
                for _ in 0..n {
                    if let Some(r) = req.take() {
                        match r.test() {
                            Ok(_) => break,
                            Err(r) => req = Some(r),
                        }
                    }
                }
                if let Some(r) = req {
                    r.cancel();
                    let _ = r.wait();
                }
            });
            let raw = t.elapsed().as_nanos() as f64 / n as f64;
            let t = Instant::now();
            for _ in 0..n {
                let _ = self.world.any_process().immediate_probe();
            }
            let probe = t.elapsed().as_nanos() as f64 / n as f64;
            let t = Instant::now();
            for _ in 0..n {
                ch.incoming.poll(&mut |_| {})?;
            }
            let any = t.elapsed().as_nanos() as f64 / n as f64;
            self.say(format!("idle poll cost: driver poll_message {drv:.0} ns, raw MPI_Test {raw:.0} ns, MPI_Iprobe(ANY) {probe:.0} ns, incoming.poll (Testsome) {any:.0} ns"));
        }
        self.world.barrier();
        Ok(())
    }

    fn say(&self, line: String) {
        if self.me == 0 {
            println!("{line}");
        }
    }

    fn lat_bw(&self) -> Result<()> {
        let ch = self.open("bench", "mpi")?;
        for (what, n) in [("latency 8 B", 8usize), ("bandwidth 4 MiB", 4 << 20)] {
            let (mut raw, mut chan) = (Vec::new(), Vec::new());
            for _ in 0..runs() {
                raw.push(self.raw_pp(n)?);
                chan.push(self.chan_pp(&ch, n)?);
            }
            let (rmin, rmed) = stats(&mut raw);
            let (cmin, cmed) = stats(&mut chan);
            if n == 8 {
                self.say(format!(
                    "{what}: raw MPI {rmin:.3} / {rmed:.3} us, mpi channel {cmin:.3} / {cmed:.3} us, ratio (median) {:.2}x (min) {:.2}x",
                    cmed / rmed,
                    cmin / rmin
                ));
            } else {
                let gb = |us: f64| n as f64 / us / 1e3;
                self.say(format!(
                    "{what}: raw MPI {:.2} / {:.2} GB/s, mpi channel {:.2} / {:.2} GB/s, ratio (median) {:.3} (best) {:.3}",
                    gb(rmin),
                    gb(rmed),
                    gb(cmin),
                    gb(cmed),
                    gb(cmed) / gb(rmed),
                    gb(cmin) / gb(rmin)
                ));
            }
        }
        Ok(())
    }

    /// Channel specs side by side, raw MPI beside, one-way µs (ping-pong of one CHEAPER
    /// piece): `MPI_BENCH_SPECS` (`;`-separated, default `mpi,inline=0;mpi,inline=65536`:
    /// `MPI_Isend` + `MPI_Test` against a blocking `MPI_Send` for eager messages) and
    /// `MPI_BENCH_SIZES` (`,`-separated bytes, default 8,256,1024,2048,4096). A spec
    /// `drv:<spec>` measures the driver's links alone (the test mini-engine, one copy piece),
    /// `drvg:<spec>` the same with an 8-byte copy piece and the body as a gather group.
    /// `MPI_BENCH_PIECES=k` splits each channel message into k CHEAPER pieces.
    fn cmp(&self) -> Result<()> {
        let specs = std::env::var("MPI_BENCH_SPECS")
            .unwrap_or_else(|_| "mpi,inline=0;mpi,inline=65536".into());
        // `MPI_BENCH_PIECES=k`: the channels send each message as k CHEAPER pieces of n/k.
        let pieces: usize = std::env::var("MPI_BENCH_PIECES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
            .max(1);
        let sizes: Vec<usize> = std::env::var("MPI_BENCH_SIZES")
            .unwrap_or_else(|_| "8,256,1024,2048,4096".into())
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect();
        let chans: Vec<(String, Channel)> = specs
            .split(';')
            .filter(|sp| !sp.starts_with("drv:") && !sp.starts_with("drvg:"))
            .enumerate()
            .map(|(i, sp)| Ok((sp.to_string(), self.open(&format!("cmp-{i}"), sp)?)))
            .collect::<Result<_>>()?;
        // `drv:<spec>` entries: the driver's links alone (test mini-engine), one copy piece.
        let mut drvs = Vec::new();
        for (sp, group) in specs.split(';').filter_map(|sp| {
            sp.strip_prefix("drv:")
                .map(|s| (s, false))
                .or_else(|| sp.strip_prefix("drvg:").map(|s| (s, true)))
        }) {
            use mad_core::driver::{Driver, OpenContext};
            let d = MpiDriver::new();
            let config = ChannelConfig::parse("cmp-drv", sp)?;
            let table = d.tm_table(&config)?;
            let progress = mad_core::progress::ProgressPolicy::default();
            let opened = d.open(&OpenContext::new(
                &config,
                self.session.bootstrap(),
                &table,
                &progress,
            ))?;
            drvs.push((
                format!("{}:{sp}", if group { "drvg" } else { "drv" }),
                opened,
                group,
            ));
        }
        self.say("one-way us, min / median:".into());
        for n in sizes {
            let mut raw = Vec::new();
            let mut per: Vec<Vec<f64>> = vec![Vec::new(); chans.len() + drvs.len()];
            let sb = vec![1u8; n];
            let mut rb = vec![0u8; n];
            let mut nb = Vec::new();
            let mut two = Vec::new();
            for _ in 0..runs() {
                raw.push(self.raw_pp(n)?);
                nb.push(self.raw_pp_nb(n)?);
                two.push(self.raw_pp_two(n)?);
                for (k, (_, ch)) in chans.iter().enumerate() {
                    per[k].push(if pieces > 1 {
                        self.chan_group(ch, pieces, n / pieces)?
                    } else {
                        self.chan_pp(ch, n)?
                    });
                }
                for (k, (_, opened, group)) in drvs.iter_mut().enumerate() {
                    let group = *group;
                    let link = opened.links[self.peer]
                        .as_mut()
                        .ok_or_else(|| mad_core::Error::protocol(self.peer, "no link"))?;
                    let link = std::cell::RefCell::new(link);
                    let hdr = [7u8; 8];
                    let mut rhdr = [0u8; 8];
                    per[chans.len() + k].push(pingpong(
                        &self.world,
                        self.me,
                        iters_for(n),
                        &mut || {
                            let mut l = link.borrow_mut();
                            if group {
                                common::send(
                                    l.tx.as_mut(),
                                    &[common::Piece::Copy(&hdr), common::Piece::Group(vec![&sb])],
                                )
                            } else {
                                common::send(l.tx.as_mut(), &[common::Piece::Copy(&sb)])
                            }
                        },
                        &mut || {
                            let mut l = link.borrow_mut();
                            if group {
                                common::recv(
                                    l.rx.as_mut(),
                                    &mut [
                                        common::Dest::Copy(&mut rhdr),
                                        common::Dest::Group(vec![&mut rb]),
                                    ],
                                )
                            } else {
                                common::recv(l.rx.as_mut(), &mut [common::Dest::Copy(&mut rb)])
                            }
                        },
                    )?);
                }
            }
            let r = stats(&mut raw);
            let b = stats(&mut nb);
            let t = stats(&mut two);
            let mut line = format!(
                "  {n:>7} B: raw MPI {:.3} / {:.3} us, raw MPI_Irecv+MPI_Test {:.3} / {:.3} us, raw header+body {:.3} / {:.3} us",
                r.0, r.1, b.0, b.1, t.0, t.1
            );
            let names = chans.iter().map(|c| &c.0).chain(drvs.iter().map(|d| &d.0));
            for (k, sp) in names.enumerate() {
                let c = stats(&mut per[k]);
                line.push_str(&format!(", {sp} {:.3} / {:.3} us", c.0, c.1));
            }
            self.say(line);
        }
        Ok(())
    }

    fn rpc(&self) -> Result<()> {
        let ch = self.open("bench-rpc", "mpi")?;
        self.say("RPC (8 B EXPRESS header + CHEAPER body), one-way us, min / median:".into());
        self.say(format!(
            "{:>9} {:>17} {:>17} {:>17}",
            "body", "MPI packed", "MPI 2 messages", "mpi channel"
        ));
        for n in [
            1usize << 10,
            4 << 10,
            16 << 10,
            64 << 10,
            256 << 10,
            1 << 20,
        ] {
            let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..runs() {
                a.push(self.raw_rpc_packed(n)?);
                b.push(self.raw_rpc_two(n)?);
                c.push(self.chan_rpc(&ch, n)?);
            }
            let (a, b, c) = (stats(&mut a), stats(&mut b), stats(&mut c));
            self.say(format!(
                "{:>9} {:>8.2} / {:>6.2} {:>8.2} / {:>6.2} {:>8.2} / {:>6.2}",
                n, a.0, a.1, b.0, b.1, c.0, c.1
            ));
        }
        Ok(())
    }

    fn sweep(&self) -> Result<()> {
        self.say("sweep 1: one piece of n bytes, eager (copy) vs direct (zero-copy), one-way us min / median".into());
        let copy = self.open("sweep-copy", "mpi,tm.eager=max")?;
        let direct = self.open("sweep-direct", "mpi,tm.eager=0")?;
        for n in [
            512usize,
            1 << 10,
            2 << 10,
            4 << 10,
            8 << 10,
            16 << 10,
            32 << 10,
            64 << 10,
            128 << 10,
        ] {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for _ in 0..runs() {
                a.push(self.chan_pp(&copy, n)?);
                b.push(self.chan_pp(&direct, n)?);
            }
            let (a, b) = (stats(&mut a), stats(&mut b));
            self.say(format!(
                "  {n:>7} B: eager {:.2} / {:.2}, direct {:.2} / {:.2}",
                a.0, a.1, b.0, b.1
            ));
        }
        self.say("sweep 2: group of k slices of s bytes (all direct), hindexed datatype vs separate sends".into());
        let dt = self.open("sweep-dt", "mpi,tm.eager=0,gather=datatype")?;
        let sep = self.open("sweep-sep", "mpi,tm.eager=0,gather=separate")?;
        for k in [2usize, 8] {
            for s in [
                64usize,
                1 << 10,
                4 << 10,
                8 << 10,
                16 << 10,
                32 << 10,
                64 << 10,
                256 << 10,
            ] {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                for _ in 0..runs() {
                    a.push(self.chan_group(&dt, k, s)?);
                    b.push(self.chan_group(&sep, k, s)?);
                }
                let (a, b) = (stats(&mut a), stats(&mut b));
                self.say(format!(
                    "  k={k} s={s:>7} B (total {:>8}): datatype {:.2} / {:.2}, separate {:.2} / {:.2}",
                    k * s,
                    a.0,
                    a.1,
                    b.0,
                    b.1
                ));
            }
        }
        Ok(())
    }
}

fn run() -> Result<()> {
    let Some(bs) = MpiBootstrap::from_env()? else {
        println!("mpi_bench: start me with mpiexec/mpirun -n 2");
        return Ok(());
    };
    let me = mad_core::bootstrap::Bootstrap::rank(&bs);
    let size = mad_core::bootstrap::Bootstrap::size(&bs);
    if size != 2 {
        return Err(mad_core::Error::BadConfig(
            "mpi_bench runs on exactly 2 ranks".into(),
        ));
    }
    if me == 0 {
        println!("mpi_bench: {}", bs.library());
    }
    let session = Session::builder()
        .driver(MpiDriver::new())
        .bootstrap(Box::new(bs))
        .build()?;
    let b = Bench {
        world: SimpleCommunicator::world(),
        me,
        peer: 1 - me,
        session: &session,
    };
    let what = mode();
    if what == "all" || what == "lat" || what == "bw" {
        b.lat_bw()?;
    }
    if what == "costs" {
        b.costs()?;
    }
    if what == "cmp" {
        b.cmp()?;
    }
    if what == "cpu" {
        b.cpu()?;
    }
    #[cfg(target_arch = "x86_64")]
    if what == "phases" {
        b.phases()?;
    }
    if what == "all" || what == "drv" {
        b.drv_lat()?;
    }
    if what == "all" || what == "rpc" {
        b.rpc()?;
    }
    if what == "all" || what == "sweep" {
        b.sweep()?;
    }
    Ok(())
}

/// The mode of the command line (`all` without one).
fn mode() -> String {
    CLI.parse(|p| {
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
    })
}

fn main() {
    // --help, --version and a bad mode before MPI starts.
    mode();
    if let Err(e) = run() {
        eprintln!("mpi_bench failed: {e}");
        std::process::exit(1);
    }
}
