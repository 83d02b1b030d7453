//! Madeleine II's Figure 4 on `via:soft`: one-way time of a one-piece message ping-pong for
//! each transfer method forced alone (threshold overrides) and for the adaptive choice.
//!
//! ```text
//! cargo bench -p mad-via --bench figure4            # full sweep, markdown table on stdout
//! FIG4_REPS=1 FIG4_BUDGET_MS=10 cargo bench -p mad-via --bench figure4   # quick
//! FIG4_CSV=fig4.csv cargo bench -p mad-via --bench figure4   # also every batch to a CSV file
//! FIG4_ADAPTIVE_EXTRA=,tm.small=max cargo bench -p mad-via --bench figure4   # a wrong table
//! ```
//!
//! The variants run in alternation: `FIG4_REPS` (default 15) rounds, each on channels opened
//! afresh, in which every variant runs one short batch (`FIG4_BUDGET_MS` of round trips,
//! default 20) at each size, in a shuffled order. A cell is the median of its variant's batches; the ratio of an adaptive
//! variant to the best fixed method (the fixed variant with the lowest median) is the median
//! over the rounds of the ratio of the two batches of the same round, so the machine's drift
//! between rounds (minutes apart on a busy VM) cancels out, and two variants on the same path
//! come out at 1 whatever the drift. A wrong choice of method still shows: it is slower in
//! every round. `FIG4_ADAPTIVE_EXTRA=<options>` appends options to the two adaptive variants
//! without the registration cache (for example a threshold forced wrong, to see the verdict
//! fail); `FIG4_EXTRA` appends to every variant.
//!
//! `FIG4_CSV=<file>` writes one line per variant, size and round
//! (`variant,spec,size,rep,one_way_us`) for `bench/run.sh`, which reports the median and spread
//! and the same paired ratios. `FIG4_ORDER=rotate` and `FIG4_SHARED_BUFFER=1` bring back the
//! old schedule (rotated fixed order) and the old buffer (one for every variant), to
//! reproduce the bias they caused (see `NOTES.md`).
//!
//! Two ranks are two threads of this process with their own sessions and soft NICs, talking
//! over TCP loopback. Variants (all with the registration cache *off*, so every dynamic
//! registration pays `mlock`/`munlock`, like the paper's per-message registration):
//!
//! * `copy`: `tm.small=max`: static pre-registered buffers only;
//! * `register`: `tm.small=0,tm.medium=max`: send/receive with on-the-fly registration only;
//! * `rdma`: `tm.small=0,tm.medium=0`: rendezvous RDMA write only;
//! * `adaptive`: the default table;
//! * `adaptive+cache`: the default table with the registration cache on (same buffer reused);
//! * `adaptive+tune`: `tune=auto`: the thresholds measured at open on this machine (or taken
//!   from the tuning cache of an earlier run or round), registration cache off;
//! * `twin`: the `adaptive` spec again: how far apart two channels of one spec come out (the
//!   noise floor of the verdict).

use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::config::ChannelConfig;
use mad_core::{RecvMode, SendMode, Session};
use mad_via::ViaDriver;

const SIZES: &[usize] = &[
    8,
    512,
    2 << 10,
    4 << 10,
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
    8 << 20,
];

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// One round trip of `buf` on `ch` (rank 0 starts).
fn round(ch: &mad_core::Channel, me: usize, buf: &mut [u8]) {
    if me == 0 {
        let mut p = ch.begin_packing(1).expect("pack");
        p.pack(buf, RecvMode::Cheaper).expect("pack");
        p.end_packing().expect("end");
        let mut u = ch.begin_unpacking().expect("unpack");
        u.unpack(buf, SendMode::Cheaper).expect("unpack");
        u.end_unpacking().expect("end");
    } else {
        let mut u = ch.begin_unpacking().expect("unpack");
        u.unpack(buf, SendMode::Cheaper).expect("unpack");
        u.end_unpacking().expect("end");
        let mut p = ch.begin_packing(0).expect("pack");
        p.pack(buf, RecvMode::Cheaper).expect("pack");
        p.end_packing().expect("end");
    }
}

/// The order of the variants in repetition `rep` at size index `k`: a pseudo-random
/// permutation (the same on both ranks), so no variant always runs right after the same other
/// one. Rotating a fixed order, as this benchmark used to, keeps every variant's neighbours
/// fixed: whatever one variant leaves behind always lands on the same next variant.
fn order(n: usize, rep: usize, k: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((rep as u64) << 32) ^ (k as u64);
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    if std::env::var("FIG4_ORDER").as_deref() == Ok("rotate") {
        // The old schedule, kept to reproduce the old bias.
        return (0..n).map(|i| (i + rep) % n).collect();
    }
    v
}

/// One-way µs, `[variant][size][round]`, and the selection tables of the first round. Each
/// round opens every variant's channel afresh (the adaptive+tune one from the tuning cache
/// after the first round, as a later open would), gives every channel one round trip of every
/// size (the calibration of `adaptive+tune` does), then for each size runs one batch of every
/// variant in a shuffled order, and closes the channels. Fresh channels each round: a via:soft
/// channel settles into one of several steady states at a size (up to 40 % apart, seen between
/// two channels of the same spec timed in alternation), so one channel per variant for the
/// whole run measured which state each channel fell into, not the method. The variants without
/// the registration cache share one buffer per size (`buf_of`): the cached variant keeps its
/// pages pinned, and `mlock` does not nest. A batch starts with a warm-up of a fifth of the
/// budget (at least 3 round trips).
fn run(
    specs: &[String],
    buf_of: &[usize],
    reps: usize,
    budget: Duration,
) -> (Vec<Vec<Vec<f64>>>, Vec<String>) {
    let boots = ThreadBootstrap::group(2);
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let session = Session::builder()
                        .driver(ViaDriver::new())
                        .bootstrap(Box::new(b))
                        .build()
                        .expect("session");
                    let me = session.rank();
                    let mut out = vec![vec![Vec::new(); SIZES.len()]; specs.len()];
                    let mut tables = Vec::new();
                    for rep in 0..reps {
                        let chans: Vec<_> = specs
                            .iter()
                            .enumerate()
                            .map(|(i, spec)| {
                                let cfg = ChannelConfig::parse(&format!("fig4-{rep}-{i}"), spec)
                                    .expect("spec")
                                    .op_timeout(Duration::from_secs(60));
                                session.open_channel_with(cfg).expect("channel")
                            })
                            .collect();
                        if rep == 0 {
                            tables = chans.iter().map(|c| c.selection_table()).collect();
                        }
                        for ch in &chans {
                            for &size in SIZES {
                                round(ch, me, &mut vec![1u8; size]);
                            }
                        }
                        for (k, &size) in SIZES.iter().enumerate() {
                            let nbufs = buf_of.iter().max().map_or(1, |m| m + 1);
                            let mut bufs: Vec<Vec<u8>> =
                                (0..nbufs).map(|_| vec![1u8; size]).collect();
                            for v in order(chans.len(), rep, k) {
                                let us = batch(&chans[v], me, &mut bufs[buf_of[v]], budget);
                                out[v][k].push(us);
                            }
                        }
                    }
                    (out, tables)
                })
            })
            .collect();
        let mut res: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
        res.swap_remove(0)
    })
}

/// One batch on `ch`: two round trips, one timed by rank 0 to choose the count for `budget`
/// (sent to rank 1), a fifth of that count of warm-up, then the count timed: one-way µs.
fn batch(ch: &mad_core::Channel, me: usize, buf: &mut [u8], budget: Duration) -> f64 {
    for _ in 0..2 {
        round(ch, me, buf);
    }
    let (warm, n) = if me == 0 {
        let t = Instant::now();
        round(ch, me, buf);
        let per = t.elapsed().max(Duration::from_micros(1));
        let n = (budget.as_nanos() / per.as_nanos()).clamp(5, 20_000) as u64;
        let warm = (n / 5).max(1);
        let mut p = ch.begin_packing(1).expect("pack");
        p.pack_value(&[warm, n], RecvMode::Express).expect("pack");
        p.end_packing().expect("end");
        (warm, n)
    } else {
        round(ch, me, buf);
        let mut u = ch.begin_unpacking().expect("unpack");
        let [warm, n]: [u64; 2] = u.unpack_value().expect("n");
        u.end_unpacking().expect("end");
        (warm, n)
    };
    for _ in 0..warm {
        round(ch, me, buf);
    }
    let t = Instant::now();
    for _ in 0..n {
        round(ch, me, buf);
    }
    t.elapsed().as_secs_f64() * 1e6 / (2.0 * n as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The target of issue 21: an adaptive variant within this factor of the best fixed method.
const WITHIN: f64 = 1.05;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let reps = env_usize("FIG4_REPS", 15).max(1);
    let budget = Duration::from_millis(env_usize("FIG4_BUDGET_MS", 20) as u64);
    let variants: &[(&str, &str, usize)] = &[
        ("copy", "via:soft,regcache=0,tm.small=max", 0),
        (
            "register",
            "via:soft,regcache=0,tm.small=0,tm.medium=max",
            0,
        ),
        ("rdma", "via:soft,regcache=0,tm.small=0,tm.medium=0", 0),
        ("adaptive", "via:soft,regcache=0", 0),
        ("adaptive+cache", "via:soft,regcache=64", 64),
        ("adaptive+tune", "via:soft,regcache=0,tune=auto", 0),
        // The noise floor: the `adaptive` spec again, on channels of its own.
        ("twin", "via:soft,regcache=0", 0),
    ];
    // FIG4_EXTRA=",progress=poll" appends options to every variant's spec.
    let extra = std::env::var("FIG4_EXTRA").unwrap_or_default();
    let wrong = std::env::var("FIG4_ADAPTIVE_EXTRA").unwrap_or_default();
    let specs: Vec<String> = variants
        .iter()
        .map(|v| {
            let w = if matches!(v.0, "adaptive" | "adaptive+tune" | "twin") {
                wrong.as_str()
            } else {
                ""
            };
            format!("{}{w}{extra}", v.1)
        })
        .collect();
    // The variants without the registration cache share one buffer (the same pages, the same
    // placement: a separate buffer per variant moved identical paths apart by up to 30 % in
    // hand runs); the cached one has its own (it keeps its pages pinned, and `mlock` does not
    // nest). `FIG4_OWN_BUFFERS=1`: one buffer per variant; `FIG4_SHARED_BUFFER=1`: one for all.
    let buf_of: Vec<usize> = variants
        .iter()
        .enumerate()
        .map(|(i, v)| {
            if std::env::var("FIG4_SHARED_BUFFER").is_ok() {
                0
            } else if std::env::var("FIG4_OWN_BUFFERS").is_ok() || v.2 != 0 {
                i + 1
            } else {
                0
            }
        })
        .collect();
    let (all, tables) = run(&specs, &buf_of, reps, budget);
    if let Some(path) = std::env::var_os("FIG4_CSV") {
        let mut csv = String::from("variant,spec,size,rep,one_way_us\n");
        for (v, per_size) in all.iter().enumerate() {
            for (k, runs) in per_size.iter().enumerate() {
                for (rep, us) in runs.iter().enumerate() {
                    csv.push_str(&format!(
                        "{},\"{}\",{},{rep},{us:.4}\n",
                        variants[v].0, specs[v], SIZES[k]
                    ));
                }
            }
        }
        std::fs::write(&path, csv).expect("writing FIG4_CSV");
    }
    let med: Vec<Vec<f64>> = all
        .iter()
        .map(|per_size| per_size.iter().map(|r| median(r.clone())).collect())
        .collect();
    println!(
        "one-way time in µs (median of {reps} alternated batches of {} ms), MB/s in parentheses; \
         ratios: median over the rounds of the paired batches' ratio",
        budget.as_millis()
    );
    print!("| size |");
    for (n, _, _) in variants {
        print!(" {n} |");
    }
    println!(" best fixed | adaptive / best | adaptive+tune / best | twin / adaptive |");
    print!("|---:|");
    for _ in variants {
        print!("---:|");
    }
    println!("---|---:|---:|---:|");
    let (mut worst, mut worst_tuned, mut worst_twin) = (0.0f64, 0.0f64, 1.0f64);
    let (mut within, mut within_tuned) = (0, 0);
    for (k, &size) in SIZES.iter().enumerate() {
        let label = if size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else if size >= 1024 {
            format!("{} KiB", size >> 10)
        } else {
            format!("{size} B")
        };
        print!("| {label} |");
        for m in &med {
            print!(" {:.1} ({:.0}) |", m[k], size as f64 / m[k]);
        }
        let bi = (0..3)
            .min_by(|&a, &b| med[a][k].total_cmp(&med[b][k]))
            .unwrap_or(0);
        let paired = |v: usize, w: usize| {
            median(
                all[v][k]
                    .iter()
                    .zip(&all[w][k])
                    .map(|(x, b)| x / b)
                    .collect(),
            )
        };
        let (ratio, tuned, twin) = (paired(3, bi), paired(5, bi), paired(6, 3));
        worst_twin = worst_twin.max(twin.max(1.0 / twin));
        worst = worst.max(ratio);
        worst_tuned = worst_tuned.max(tuned);
        within += usize::from(ratio <= WITHIN);
        within_tuned += usize::from(tuned <= WITHIN);
        println!(
            " {} | {:.3} | {:.3} | {:.3} |",
            variants[bi].0, ratio, tuned, twin
        );
    }
    let n = SIZES.len();
    println!("worst adaptive / best fixed ratio: {worst:.3}");
    println!("worst adaptive+tune / best fixed ratio: {worst_tuned:.3}");
    println!("noise floor: identical specs (twin / adaptive) up to {worst_twin:.3} apart");
    println!(
        "within {WITHIN} of the best fixed method: adaptive {within} of {n} sizes, \
         adaptive+tune {within_tuned} of {n} sizes: {}",
        if within_tuned == n { "met" } else { "NOT MET" }
    );
    println!("\nadaptive+tune's table (rank 0):\n{}", tables[5]);
}
