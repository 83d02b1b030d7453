//! Virtual channels (`mad_core::vchan`), against the real channels they use, in one run:
//!
//! * a virtual channel whose peer it reaches directly (`virtual:shm+tcp` to a peer of shm,
//!   `virtual:tcp+shm` to a peer of tcp) against that real channel (`shm`, `tcp`);
//! * forwarding: ranks 0 and 1 of `virtual:[shm,ranks=0:2]+[tcp,ranks=1-2]` share no part,
//!   so their messages go through gateway rank 2 (shm, then tcp), against `shm` and `tcp`
//!   between ranks 0 and 1 directly.
//!
//! Three ranks, threads of this process (the thread bootstrap; the channels are real shared
//! memory and sockets), rank 2 idle except for its forwarding threads. Each round measures
//! every variant once, in turn (8 B one-way latency: ping-pong; 4 MiB bandwidth: a stream
//! of messages then a 1-byte answer); the figures are medians over the rounds.
//!
//! Twins of `shm` and `tcp`, measured last, give the run's noise floor.
//!
//! `cargo bench --bench vchan` (`VCHAN_ROUNDS`, default 7; `VCHAN_ONLY=<text>` measures only the
//! variants whose name contains it, `VCHAN_PHASE=lat|bw` only latency or bandwidth, for
//! profiling).

use std::time::Instant;

use mad_core::bootstrap::ThreadBootstrap;
use madeleine::{Channel, ChannelConfig, RecvMode, SendMode, Session};

const SMALL: usize = 8;
const BIG: usize = 4 << 20;
const PINGS: usize = 4000;
const STREAM: usize = 24;

const VARIANTS: &[(&str, &str)] = &[
    ("shm", "shm"),
    ("virtual:shm+tcp (direct)", "virtual:shm+tcp"),
    ("tcp", "tcp"),
    ("virtual:tcp+shm (direct)", "virtual:tcp+shm"),
    (
        "gateway: shm then tcp",
        "virtual:[shm,ranks=0:2]+[tcp,ranks=1-2]",
    ),
    // The same real channels once more, measured last: the noise floor of this run.
    ("shm (twin)", "shm"),
    ("tcp (twin)", "tcp"),
];

/// One-way latency of `len`-byte messages between ranks 0 and 1, in µs.
fn pingpong(ch: &Channel, me: usize, len: usize, n: usize) -> madeleine::Result<f64> {
    let buf = vec![7u8; len];
    let mut got = vec![0u8; len];
    let peer = 1 - me;
    let t0 = Instant::now();
    for _ in 0..n {
        if me == 0 {
            let mut p = ch.begin_packing(peer)?;
            p.pack(&buf, RecvMode::Cheaper)?;
            p.end_packing()?;
            let mut u = ch.begin_unpacking_from(peer)?;
            u.unpack(&mut got, SendMode::Cheaper)?;
            u.end_unpacking()?;
        } else {
            let mut u = ch.begin_unpacking_from(peer)?;
            u.unpack(&mut got, SendMode::Cheaper)?;
            u.end_unpacking()?;
            let mut p = ch.begin_packing(peer)?;
            p.pack(&buf, RecvMode::Cheaper)?;
            p.end_packing()?;
        }
    }
    Ok(t0.elapsed().as_secs_f64() * 1e6 / (2 * n) as f64)
}

/// Bandwidth of `n` messages of `len` bytes from rank 0 to rank 1, then a 1-byte answer, in MB/s.
fn stream(ch: &Channel, me: usize, len: usize, n: usize) -> madeleine::Result<f64> {
    let buf = vec![7u8; len];
    let mut got = vec![0u8; len];
    let mut ack = [0u8; 1];
    let t0 = Instant::now();
    if me == 0 {
        for _ in 0..n {
            let mut p = ch.begin_packing(1)?;
            p.pack(&buf, RecvMode::Cheaper)?;
            p.end_packing()?;
        }
        let mut u = ch.begin_unpacking_from(1)?;
        u.unpack_express(&mut ack, SendMode::Safer)?;
        u.end_unpacking()?;
    } else {
        for _ in 0..n {
            let mut u = ch.begin_unpacking_from(0)?;
            u.unpack(&mut got, SendMode::Cheaper)?;
            u.end_unpacking()?;
        }
        let mut p = ch.begin_packing(0)?;
        p.pack_safer(&ack, RecvMode::Express)?;
        p.end_packing()?;
    }
    Ok((len * n) as f64 / t0.elapsed().as_secs_f64() / 1e6)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn rank(session: Session, rounds: usize) -> madeleine::Result<Vec<(Vec<f64>, Vec<f64>)>> {
    let me = session.rank();
    let chans: Vec<Channel> = VARIANTS
        .iter()
        .enumerate()
        .map(|(i, (_, spec))| {
            session.open_channel_with(ChannelConfig::parse(&format!("v{i}"), spec)?)
        })
        .collect::<madeleine::Result<_>>()?;
    let only = std::env::var("VCHAN_ONLY").ok();
    let phase = std::env::var("VCHAN_PHASE").ok();
    let (lat, bw) = (
        phase.as_deref() != Some("bw"),
        phase.as_deref() != Some("lat"),
    );
    let b = session.bootstrap();
    let mut out = vec![(Vec::new(), Vec::new()); VARIANTS.len()];
    for round in 0..rounds {
        for (i, ch) in chans.iter().enumerate() {
            if only.as_deref().is_some_and(|o| !VARIANTS[i].0.contains(o)) {
                out[i] = (vec![f64::NAN], vec![f64::NAN]);
                continue;
            }
            b.barrier(&format!("vchan/{round}/{i}/lat"))?;
            if me < 2 && lat {
                pingpong(ch, me, SMALL, PINGS / 10)?;
                out[i].0.push(pingpong(ch, me, SMALL, PINGS)?);
            }
            b.barrier(&format!("vchan/{round}/{i}/bw"))?;
            if me < 2 && bw {
                out[i].1.push(stream(ch, me, BIG, STREAM)?);
            }
        }
    }
    b.barrier("vchan/end")?;
    Ok(out)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rounds: usize = std::env::var("VCHAN_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(3)
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let session = madeleine::builder().bootstrap(Box::new(b)).build()?;
                    rank(session, rounds)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a rank panicked").expect("a rank failed"))
            .next()
            .expect("rank 0")
    });
    let mut lat: Vec<f64> = Vec::new();
    let mut bw: Vec<f64> = Vec::new();
    for (l, b) in results {
        let m = |v: &[f64]| {
            if v.is_empty() {
                f64::NAN
            } else {
                median(&mut v.to_vec())
            }
        };
        lat.push(m(&l));
        bw.push(m(&b));
    }
    println!("virtual channels, {rounds} rounds, ranks 0 <-> 1 (3 ranks, threads)");
    println!(
        "{:<28} {:>14} {:>16}",
        "variant", "8 B one-way µs", "4 MiB MB/s"
    );
    for (i, (name, _)) in VARIANTS.iter().enumerate() {
        println!("{name:<28} {:>14.3} {:>16.0}", lat[i], bw[i]);
    }
    println!(
        "direct virtual / real: shm latency {:.3}, bandwidth cost {:.3}; tcp latency {:.3}, bandwidth cost {:.3} (target <= 1.05)",
        lat[1] / lat[0],
        bw[0] / bw[1],
        lat[3] / lat[2],
        bw[2] / bw[3]
    );
    println!(
        "noise floor (twin / first): shm latency {:.3}, bandwidth cost {:.3}; tcp latency {:.3}, bandwidth cost {:.3}",
        lat[5] / lat[0],
        bw[0] / bw[5],
        lat[6] / lat[2],
        bw[2] / bw[6]
    );
    println!(
        "gateway: 8 B {:.3} µs vs shm + tcp + 2 µs = {:.3} (target: at most); 4 MiB {:.0} MB/s = {:.2} x the slower network (target >= 0.8)",
        lat[4],
        lat[0] + lat[2] + 2.0,
        bw[4],
        bw[4] / bw[0].min(bw[2])
    );
}
