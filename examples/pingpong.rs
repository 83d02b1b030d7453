//! Ping-pong latency and bandwidth over any channel, across a size sweep.
//!
//! ```text
//! cargo run --release --example pingpong                 # two processes, the `default` channel (tcp)
//! MAD_CHANNEL_DEFAULT=shm cargo run --release --example pingpong
//! madrun -n 2 target/release/examples/pingpong -- --channel video --max 4m
//! ```
//!
//! Options: `--channel NAME` (default `default`), `--max SIZE` (largest message, default 4m),
//! `--iters N` (round trips for small sizes, default 10000; fewer for large ones),
//! `--quick` (a few iterations, for CI). One-way latency = round-trip time / 2; bandwidth =
//! size / one-way time.

use std::time::Instant;

use madeleine::cli::{self, Arg, Cli};
use madeleine::{Error, RecvMode, Result, SendMode};

struct Opts {
    channel: String,
    max: usize,
    iters: usize,
}

const CLI: Cli = Cli::new(
    "pingpong",
    env!("CARGO_PKG_VERSION"),
    "usage: pingpong [options]                 (alone: starts 2 ranks on this host)
       madrun -n 2 pingpong [--] [options]

Ping-pong latency and bandwidth over a channel, across a size sweep.

  --channel NAME   the channel (default `default`: MAD_CHANNEL_DEFAULT, else tcp)
  --max SIZE       largest message, e.g. 64k, 4m (default 4m)
  --iters N        round trips for small sizes (default 10000; fewer for large ones)
  --quick          a few iterations (CI)
  -h, --help       this text
  -V, --version    the version

Options take their value as `--opt value` or `--opt=value`.",
);

fn opts() -> Opts {
    let mut o = Opts {
        channel: "default".into(),
        max: 4 << 20,
        iters: 10_000,
    };
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("channel") => o.channel = cli::string(p)?,
                Arg::Long("max") => o.max = cli::size(p, "--max")?,
                Arg::Long("iters") => o.iters = cli::number(p, "--iters")?,
                Arg::Long("quick") => o.iters = 50,
                other => CLI.other(other)?,
            }
        }
        Ok(())
    });
    o
}

fn main() {
    madeleine::init_logging();
    if let Err(e) = run() {
        eprintln!("pingpong: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let o = opts();
    if let Some(code) = madeleine::run_local_if_alone(2)? {
        std::process::exit(code);
    }
    let session = madeleine::session()?;
    let ch = session.open_channel(&o.channel)?;
    let me = session.rank();
    if session.size() < 2 {
        return Err(Error::BadConfig("pingpong needs two processes".into()));
    }
    if me == 0 {
        print!("{}", ch.selection_table());
        println!(
            "{:>10} {:>14} {:>14} {:>8}",
            "size (B)", "one-way (µs)", "bw (MB/s)", "iters"
        );
    }
    let mut sizes = vec![0usize];
    let mut s = 1;
    while s <= o.max {
        sizes.push(s);
        s *= 2;
    }
    let mut buf = vec![0u8; o.max.max(1)];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = i as u8;
    }
    let mut rbuf = vec![0u8; o.max.max(1)];
    for &n in &sizes {
        let iters = if n <= 8192 {
            o.iters
        } else {
            (o.iters / 10).max(10)
        };
        let warm = (iters / 10).max(2);
        let mut t0 = Instant::now();
        for it in 0..warm + iters {
            if it == warm {
                t0 = Instant::now();
            }
            if me == 0 {
                let mut p = ch.begin_packing(1)?;
                p.pack(&buf[..n], RecvMode::Cheaper)?;
                p.end_packing()?;
                let mut u = ch.begin_unpacking_from(1)?;
                u.unpack(&mut rbuf[..n], SendMode::Cheaper)?;
                u.end_unpacking()?;
            } else if me == 1 {
                let mut u = ch.begin_unpacking_from(0)?;
                u.unpack(&mut rbuf[..n], SendMode::Cheaper)?;
                u.end_unpacking()?;
                let mut p = ch.begin_packing(0)?;
                p.pack(&rbuf[..n], RecvMode::Cheaper)?;
                p.end_packing()?;
            }
        }
        if me == 0 {
            let one_way = t0.elapsed().as_secs_f64() / iters as f64 / 2.0;
            if rbuf[..n] != buf[..n] {
                return Err(Error::Protocol {
                    rank: 1,
                    what: format!("echoed {n}-byte message differs"),
                });
            }
            let bw = if n == 0 {
                0.0
            } else {
                n as f64 / one_way / 1e6
            };
            println!(
                "{:>10} {:>14.3} {:>14.1} {:>8}",
                n,
                one_way * 1e6,
                bw,
                iters
            );
        }
    }
    Ok(())
}
