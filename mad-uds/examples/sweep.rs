//! The threshold sweep behind the `copy` TM limit: ping-pong one piece of each size between
//! two ranks (threads of this process, real sockets) with every piece forced through the copy
//! TM, then through the gather TM; the crossover is the threshold.
//!
//! `cargo run --release -p mad-uds --example sweep [-- --quick] [--progress poll|block|adaptive]`

use std::time::Instant;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::cli::{self, Arg, Cli};
use mad_core::{ChannelConfig, RecvMode, Result, SendMode, Session};
use mad_uds::UdsDriver;

/// One-way time in µs for messages of `pieces` pieces of `n` bytes over a channel with `spec`,
/// best of 3 runs.
fn pingpong(spec: &str, sizes: &[usize], pieces: usize, iters: usize) -> Result<Vec<f64>> {
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(2)
            .into_iter()
            .map(|b| {
                s.spawn(move || -> Result<Vec<f64>> {
                    let session = Session::builder()
                        .driver(UdsDriver::new())
                        .bootstrap(Box::new(b))
                        .build()?;
                    let ch = session.open_channel_with(ChannelConfig::parse("sweep", spec)?)?;
                    let me = session.rank();
                    let max = sizes.iter().copied().max().unwrap_or(0) * pieces;
                    let buf = vec![5u8; max];
                    let mut rbuf = vec![0u8; max];
                    let mut res = Vec::new();
                    for &n in sizes {
                        let mut best = f64::MAX;
                        for _ in 0..3 {
                            let t0 = Instant::now();
                            for _ in 0..iters {
                                if me == 0 {
                                    let mut p = ch.begin_packing(1)?;
                                    for c in buf[..n * pieces].chunks(n.max(1)) {
                                        p.pack(c, RecvMode::Cheaper)?;
                                    }
                                    p.end_packing()?;
                                    let mut u = ch.begin_unpacking_from(1)?;
                                    for c in rbuf[..n * pieces].chunks_mut(n.max(1)) {
                                        u.unpack(c, SendMode::Cheaper)?;
                                    }
                                    u.end_unpacking()?;
                                } else {
                                    let mut u = ch.begin_unpacking_from(0)?;
                                    for c in rbuf[..n * pieces].chunks_mut(n.max(1)) {
                                        u.unpack(c, SendMode::Cheaper)?;
                                    }
                                    u.end_unpacking()?;
                                    let mut p = ch.begin_packing(0)?;
                                    for c in buf[..n * pieces].chunks(n.max(1)) {
                                        p.pack(c, RecvMode::Cheaper)?;
                                    }
                                    p.end_packing()?;
                                }
                            }
                            best = best.min(t0.elapsed().as_secs_f64() / iters as f64 / 2.0);
                        }
                        res.push(best * 1e6);
                    }
                    Ok(res)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect::<Vec<_>>()
    });
    out.into_iter().next().expect("two ranks")
}

const CLI: Cli = Cli::new(
    "sweep",
    env!("CARGO_PKG_VERSION"),
    "usage: sweep [--quick] [--progress poll|block|adaptive]

The copy/gather threshold sweep of the uds driver (two ranks as threads of this process).

  --quick          50 iterations per size instead of 300
  --progress MODE  progress policy of the channel (default block: on a shared host, spinning
                   ranks starve each other)
  -h, --help       this text
  -V, --version    the version",
);

fn main() -> Result<()> {
    let (quick, progress) = CLI.parse(|p| {
        let (mut quick, mut progress) = (false, "block".to_string());
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("quick") => quick = true,
                Arg::Long("progress") => progress = cli::string(p)?,
                other => CLI.other(other)?,
            }
        }
        Ok((quick, progress))
    });
    let iters = if quick { 50 } else { 300 };
    let extra = format!(",progress={progress}");
    for (pieces, sizes) in [
        (1, (8..=20).map(|p| 1usize << p).collect::<Vec<_>>()), // 256 B .. 1 MiB
        (16, (6..=16).map(|p| 1usize << p).collect()),          // 16 x (64 B .. 64 KiB)
    ] {
        // Interleaved (copy, gather, copy, gather), best of both rounds: load changes.
        let mut copy = vec![f64::MAX; sizes.len()];
        let mut gather = vec![f64::MAX; sizes.len()];
        for _ in 0..2 {
            let c = pingpong(
                &format!("uds,tm.copy=1073741824,buf=1048576{extra}"),
                &sizes,
                pieces,
                iters,
            )?;
            let g = pingpong(&format!("uds,tm.copy=0{extra}"), &sizes, pieces, iters)?;
            for i in 0..sizes.len() {
                copy[i] = copy[i].min(c[i]);
                gather[i] = gather[i].min(g[i]);
            }
        }
        println!("{pieces} piece(s) per message");
        println!(
            "{:>10} {:>12} {:>12}",
            "piece (B)", "copy (µs)", "gather (µs)"
        );
        for (i, n) in sizes.iter().enumerate() {
            println!("{n:>10} {:>12.2} {:>12.2}", copy[i], gather[i]);
        }
    }
    Ok(())
}
