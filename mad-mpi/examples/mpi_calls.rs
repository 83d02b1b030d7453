//! Which MPI call pattern should the driver's receive path use? A ping-pong of one small
//! message (16 B: the 8-byte Madeleine header and 8 bytes of payload) between ranks 0 and 1,
//! raw MPI calls through `mpi::ffi` (no Madeleine), the receiver waiting in different styles,
//! measured interleaved in the same job (`MPI_CALLS_RUNS` runs, min / median of one-way µs):
//!
//! * `recv`: blocking `MPI_Recv` (the reference raw ping-pong);
//! * `irecv+test, post at wait`: `MPI_Irecv` when the wait starts, then an `MPI_Test` loop;
//! * `pre-posted, repost before reply`: the next `MPI_Irecv` is posted as soon as a message
//!   completed, before the reply is sent (the first driver's `end_message` repost);
//! * `pre-posted, repost after reply`: the next `MPI_Irecv` is posted right after the reply
//!   left (off the ping-pong's critical path);
//! * `iprobe+recv`, `improbe+mrecv`: probe loops, then receive the probed message.
//!
//! ```text
//! MPICC=mpicc.mpich CARGO_TARGET_DIR=target-mpich cargo build --release -p mad-mpi --example mpi_calls
//! mpiexec.mpich -bind-to core -n 2 target-mpich/release/examples/mpi_calls [bytes]
//! ```

#![allow(unsafe_code)]

use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::time::Instant;

use mad_core::cli::{Arg, Cli, ValueExt};
use mpi::ffi;

/// The command line.
const CLI: Cli = Cli::new(
    "mpi_calls",
    env!("CARGO_PKG_VERSION"),
    "usage: mpiexec -n 2 mpi_calls [BYTES|eager]

Raw MPI receive patterns in a ping-pong of BYTES (default 16); `eager` measures the eager
limits instead. Environment: MPI_CALLS_RUNS, MPI_CALLS_ITERS.

  -h, --help     this text
  -V, --version  the version",
);

/// What the command line asks for.
enum What {
    PingPong(usize),
    Eager,
}

fn what() -> What {
    CLI.parse(|p| {
        let mut w = None;
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Value(v) if w.is_none() => {
                    let v = v.string()?;
                    w =
                        Some(if v == "eager" {
                            What::Eager
                        } else {
                            What::PingPong(v.parse().map_err(|_| {
                                format!("`{v}`: expected a number of bytes or `eager`")
                            })?)
                        });
                }
                other => CLI.other(other)?,
            }
        }
        Ok(w.unwrap_or(What::PingPong(16)))
    })
}

const TAG: c_int = 7;
const BUF: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pat {
    Recv,
    PostAtWait,
    RepostBefore,
    RepostAfter,
    Iprobe,
    Improbe,
    Persistent,
}

const PATS: [Pat; 7] = [
    Pat::Recv,
    Pat::PostAtWait,
    Pat::RepostBefore,
    Pat::RepostAfter,
    Pat::Iprobe,
    Pat::Improbe,
    Pat::Persistent,
];

impl Pat {
    fn name(self) -> &'static str {
        match self {
            Pat::Recv => "MPI_Recv (raw)",
            Pat::PostAtWait => "irecv+test, post at wait",
            Pat::RepostBefore => "pre-posted, repost before reply",
            Pat::RepostAfter => "pre-posted, repost after reply",
            Pat::Iprobe => "iprobe loop + recv",
            Pat::Improbe => "improbe loop + mrecv",
            Pat::Persistent => "persistent, started after reply",
        }
    }
}

fn status() -> ffi::MPI_Status {
    // SAFETY: MPI_Status is a plain C struct of integers; all-zero is a valid value.
    unsafe { MaybeUninit::<ffi::MPI_Status>::zeroed().assume_init() }
}

struct Ep {
    comm: ffi::MPI_Comm,
    peer: c_int,
    byte: ffi::MPI_Datatype,
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    req: ffi::MPI_Request,
    /// The persistent receive (`MPI_Recv_init`) of `Pat::Persistent`, and whether it is started.
    preq: ffi::MPI_Request,
    pactive: bool,
    null: ffi::MPI_Request,
    /// TSC cycles of the successful `MPI_Test` and of `MPI_Get_count`.
    cyc: Vec<(u64, u64)>,
}

fn tsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: RDTSC has no memory effects.
    unsafe {
        std::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

impl Ep {
    fn send(&mut self, n: usize) {
        // SAFETY: `sbuf` holds at least `n` bytes; blocking call.
        unsafe {
            ffi::MPI_Send(
                self.sbuf.as_ptr().cast(),
                n as c_int,
                self.byte,
                self.peer,
                TAG,
                self.comm,
            )
        };
    }

    fn post(&mut self) {
        if self.req == self.null {
            // SAFETY: `rbuf` lives in `self` and is not touched until the request completes.
            unsafe {
                ffi::MPI_Irecv(
                    self.rbuf.as_mut_ptr().cast(),
                    BUF as c_int,
                    self.byte,
                    self.peer,
                    TAG,
                    self.comm,
                    &mut self.req,
                )
            };
        }
    }

    fn start(&mut self) {
        if self.preq == self.null {
            // SAFETY: `rbuf` lives in `self` and is not touched while the request is active;
            // the request is freed in `pingpong` once inactive.
            unsafe {
                ffi::MPI_Recv_init(
                    self.rbuf.as_mut_ptr().cast(),
                    BUF as c_int,
                    self.byte,
                    self.peer,
                    TAG,
                    self.comm,
                    &mut self.preq,
                )
            };
        }
        if !self.pactive {
            // SAFETY: an inactive persistent request of ours.
            unsafe { ffi::MPI_Start(&mut self.preq) };
            self.pactive = true;
        }
    }

    fn test_persistent(&mut self) {
        let mut flag: c_int = 0;
        let mut st = status();
        let mut t0 = tsc();
        while flag == 0 {
            t0 = tsc();
            // SAFETY: an active persistent request of ours; valid out-pointers.
            unsafe { ffi::MPI_Test(&mut self.preq, &mut flag, &mut st) };
        }
        self.pactive = false;
        let t1 = tsc();
        let mut c: c_int = 0;
        // SAFETY: `st` was filled by MPI.
        unsafe { ffi::MPI_Get_count(&st, self.byte, &mut c) };
        std::hint::black_box(c);
        let t2 = tsc();
        self.cyc.push((t1 - t0, t2 - t1));
    }

    fn test_loop(&mut self) {
        let mut flag: c_int = 0;
        let mut st = status();
        let mut t0 = tsc();
        while flag == 0 {
            t0 = tsc();
            // SAFETY: an active request of ours; valid out-pointers.
            unsafe { ffi::MPI_Test(&mut self.req, &mut flag, &mut st) };
        }
        let t1 = tsc();
        let mut c: c_int = 0;
        // SAFETY: `st` was filled by MPI.
        unsafe { ffi::MPI_Get_count(&st, self.byte, &mut c) };
        std::hint::black_box(c);
        let t2 = tsc();
        self.cyc.push((t1 - t0, t2 - t1));
    }

    fn recv(&mut self, pat: Pat) {
        let mut st = status();
        match pat {
            Pat::Recv => {
                // SAFETY: `rbuf` holds BUF bytes; blocking call.
                unsafe {
                    ffi::MPI_Recv(
                        self.rbuf.as_mut_ptr().cast(),
                        BUF as c_int,
                        self.byte,
                        self.peer,
                        TAG,
                        self.comm,
                        &mut st,
                    )
                };
            }
            Pat::PostAtWait => {
                self.post();
                self.test_loop();
            }
            Pat::RepostBefore => {
                self.post();
                self.test_loop();
                self.post();
            }
            Pat::RepostAfter => {
                self.post();
                self.test_loop();
            }
            Pat::Persistent => {
                self.start();
                self.test_persistent();
            }
            Pat::Iprobe => {
                let mut flag: c_int = 0;
                while flag == 0 {
                    // SAFETY: valid communicator and out-pointers.
                    unsafe { ffi::MPI_Iprobe(self.peer, TAG, self.comm, &mut flag, &mut st) };
                }
                let mut c: c_int = 0;
                // SAFETY: `st` was filled by MPI.
                unsafe { ffi::MPI_Get_count(&st, self.byte, &mut c) };
                // SAFETY: `rbuf` holds BUF >= c bytes; blocking call of a probed message.
                unsafe {
                    ffi::MPI_Recv(
                        self.rbuf.as_mut_ptr().cast(),
                        c,
                        self.byte,
                        self.peer,
                        TAG,
                        self.comm,
                        &mut st,
                    )
                };
            }
            Pat::Improbe => {
                let mut flag: c_int = 0;
                // SAFETY: reading a link-time constant.
                let mut msg = unsafe { ffi::RSMPI_MESSAGE_NULL };
                while flag == 0 {
                    // SAFETY: valid communicator and out-pointers.
                    unsafe {
                        ffi::MPI_Improbe(self.peer, TAG, self.comm, &mut flag, &mut msg, &mut st)
                    };
                }
                let mut c: c_int = 0;
                // SAFETY: `st` was filled by MPI.
                unsafe { ffi::MPI_Get_count(&st, self.byte, &mut c) };
                // SAFETY: `rbuf` holds BUF >= c bytes; `msg` is the matched message.
                unsafe {
                    ffi::MPI_Mrecv(
                        self.rbuf.as_mut_ptr().cast(),
                        c,
                        self.byte,
                        &mut msg,
                        &mut st,
                    )
                };
            }
        }
    }

    /// After the reply left.
    fn after_send(&mut self, pat: Pat) {
        if pat == Pat::RepostAfter {
            self.post();
        }
        if pat == Pat::Persistent {
            self.start();
        }
    }

    fn pingpong(&mut self, me: c_int, pat: Pat, n: usize, iters: usize) -> f64 {
        let round = |ep: &mut Ep, k: usize| {
            for _ in 0..k {
                if me == 0 {
                    ep.send(n);
                    ep.after_send(pat);
                    ep.recv(pat);
                } else {
                    ep.recv(pat);
                    ep.send(n);
                    ep.after_send(pat);
                }
            }
        };
        // SAFETY: valid communicator.
        unsafe { ffi::MPI_Barrier(self.comm) };
        round(self, iters / 10);
        // SAFETY: valid communicator.
        unsafe { ffi::MPI_Barrier(self.comm) };
        let t = Instant::now();
        round(self, iters);
        let us = t.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64);
        // Drain a receive left posted by the pre-posted patterns (cancel it).
        if self.req != self.null {
            // SAFETY: an active request of ours.
            unsafe {
                ffi::MPI_Cancel(&mut self.req);
                ffi::MPI_Wait(&mut self.req, ffi::RSMPI_STATUS_IGNORE);
            }
        }
        if self.preq != self.null {
            if self.pactive {
                // SAFETY: an active persistent request of ours.
                unsafe {
                    ffi::MPI_Cancel(&mut self.preq);
                    ffi::MPI_Wait(&mut self.preq, ffi::RSMPI_STATUS_IGNORE);
                }
                self.pactive = false;
            }
            // SAFETY: an inactive persistent request of ours, freed once.
            unsafe { ffi::MPI_Request_free(&mut self.preq) };
        }
        us
    }
}

/// `mpi_calls eager`: up to which size does `MPI_Send` return without the receiver? Rank 1
/// posts its receive 2 ms late; a send that takes about that long waited for it (median of 7).
fn eager_limits(ep: &mut Ep, me: c_int) {
    for n in [
        64usize, 128, 200, 232, 240, 248, 256, 264, 512, 1024, 1032, 2048, 4096, 4104, 8192, 8200,
        12288, 16384, 65536,
    ] {
        let mut ts = Vec::new();
        for _ in 0..7 {
            // SAFETY: valid communicator.
            unsafe { ffi::MPI_Barrier(ep.comm) };
            if me == 0 {
                let t = Instant::now();
                ep.send(n);
                ts.push(t.elapsed().as_secs_f64() * 1e6);
            } else {
                std::thread::sleep(std::time::Duration::from_millis(2));
                ep.recv(Pat::Recv);
            }
        }
        if me == 0 {
            ts.sort_by(|a, b| a.total_cmp(b));
            let med = ts[ts.len() / 2];
            println!(
                "  MPI_Send of {n:>6} B with the receive posted 2 ms late: median {med:>8.1} us, max {:>8.1} us ({})",
                ts[ts.len() - 1],
                if med > 1000.0 { "waited" } else { "eager" }
            );
        }
    }
}

fn main() {
    let what = what();
    let n = match what {
        What::PingPong(n) => n,
        What::Eager => 16,
    };
    let runs: usize = std::env::var("MPI_CALLS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let iters: usize = std::env::var("MPI_CALLS_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    // `MPI_CALLS_MT=1`: MPI_THREAD_MULTIPLE, as the driver asks for.
    let universe = if std::env::var("MPI_CALLS_MT").is_ok_and(|v| v == "1") {
        mpi::initialize_with_threading(mpi::environment::Threading::Multiple).map(|(u, _)| u)
    } else {
        mpi::initialize()
    };
    let Some(_universe) = universe else {
        eprintln!("mpi_calls: MPI_Init failed");
        std::process::exit(1);
    };
    let mut me: c_int = 0;
    let mut size: c_int = 0;
    // SAFETY: reading link-time constants; valid out-pointers.
    let (world, byte, null) = unsafe {
        (
            ffi::RSMPI_COMM_WORLD,
            ffi::RSMPI_UINT8_T,
            ffi::RSMPI_REQUEST_NULL,
        )
    };
    // SAFETY: MPI is initialised; valid out-pointers.
    unsafe {
        ffi::MPI_Comm_rank(world, &mut me);
        ffi::MPI_Comm_size(world, &mut size);
    }
    if size != 2 {
        eprintln!("mpi_calls runs on exactly 2 ranks");
        std::process::exit(1);
    }
    // SAFETY: reading a link-time constant.
    let mut comm = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: collective on the world communicator; valid out-pointer.
    unsafe { ffi::MPI_Comm_dup(world, &mut comm) };
    let mut ep = Ep {
        comm,
        peer: 1 - me,
        byte,
        sbuf: vec![1u8; BUF],
        rbuf: vec![0u8; BUF],
        req: null,
        preq: null,
        pactive: false,
        null,
        cyc: Vec::new(),
    };
    if matches!(what, What::Eager) {
        eager_limits(&mut ep, me);
        // SAFETY: our duplicate, freed once.
        unsafe { ffi::MPI_Comm_free(&mut ep.comm) };
        return;
    }
    let mut cyc: Vec<(Vec<u64>, Vec<u64>)> = vec![(Vec::new(), Vec::new()); PATS.len()];
    let mut res: Vec<Vec<f64>> = vec![Vec::new(); PATS.len()];
    for _ in 0..runs {
        for (i, &p) in PATS.iter().enumerate() {
            ep.cyc.clear();
            res[i].push(ep.pingpong(me, p, n, iters));
            for &(a, b) in &ep.cyc {
                cyc[i].0.push(a);
                cyc[i].1.push(b);
            }
        }
    }
    if me == 0 {
        println!(
            "{n} B ping-pong, one-way us, min / median of {runs} interleaved runs of {iters} round trips"
        );
        for (i, &p) in PATS.iter().enumerate() {
            let v = &mut res[i];
            v.sort_by(|a, b| a.total_cmp(b));
            let (a, b) = &mut cyc[i];
            a.sort_unstable();
            b.sort_unstable();
            let med = |v: &[u64]| v.get(v.len() / 2).copied().unwrap_or(0);
            println!(
                "  {:<34} {:.3} / {:.3}   (TSC cycles, median: successful MPI_Test {}, MPI_Get_count {})",
                p.name(),
                v[0],
                v[v.len() / 2],
                med(a),
                med(b)
            );
        }
    }
    // SAFETY: our duplicate, freed once.
    unsafe { ffi::MPI_Comm_free(&mut ep.comm) };
}
