//! Madeleine II's Figure 4 on `via:soft`: one-way time of a one-piece message ping-pong for
//! each transfer method forced alone (threshold overrides) and for the adaptive choice.
//!
//! ```text
//! cargo bench -p mad-via --bench figure4            # full sweep, markdown table on stdout
//! FIG4_REPS=1 FIG4_BUDGET_MS=10 cargo bench -p mad-via --bench figure4   # quick
//! FIG4_CSV=fig4.csv cargo bench -p mad-via --bench figure4   # also every run to a CSV file
//! ```
//!
//! `FIG4_CSV=<file>` writes one line per variant, size and repetition
//! (`variant,spec,size,rep,one_way_us`) for `bench/run.sh`, which reports the median and spread;
//! the table on stdout is unchanged. `FIG4_ORDER=rotate` and `FIG4_SHARED_BUFFER=1` bring back
//! the old schedule (rotated fixed order) and the old buffer (one for every variant), to
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
//!   from the tuning cache of an earlier run), registration cache off.

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

/// One-way µs, `[variant][size][rep]`. Every variant is a channel of the same two sessions;
/// for each size and repetition the variants run back to back (in a shuffled order), so they
/// share the machine's noise. Each variant has its own buffer (allocated and touched before
/// anything is timed at that size): with one shared buffer, the cached variant kept the
/// pages pinned while the uncached ones pinned and unpinned the same pages (`mlock` does not
/// nest), so one variant's registration state leaked into the next one's timing. Each run
/// starts with a warm-up of a fifth of the budget (at least 3 rounds), and before any run every
/// channel carries one round trip of every size (the calibration of `adaptive+tune` does).
fn run(specs: &[String], reps: usize, budget: Duration) -> (Vec<Vec<Vec<f64>>>, Vec<String>) {
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
                    let chans: Vec<_> = specs
                        .iter()
                        .enumerate()
                        .map(|(i, spec)| {
                            let cfg = ChannelConfig::parse(&format!("fig4-{i}"), spec)
                                .expect("spec")
                                .op_timeout(Duration::from_secs(60));
                            session.open_channel_with(cfg).expect("channel")
                        })
                        .collect();
                    let tables: Vec<String> = chans.iter().map(|c| c.selection_table()).collect();
                    // Every channel first carries one round trip of every size, as the
                    // calibration of `adaptive+tune` did: the same history (the soft NIC's TCP
                    // socket buffers grown by the kernel) for every variant.
                    for ch in &chans {
                        for &size in SIZES {
                            round(ch, me, &mut vec![1u8; size]);
                        }
                    }
                    let mut out = vec![vec![Vec::new(); SIZES.len()]; specs.len()];
                    for (k, &size) in SIZES.iter().enumerate() {
                        let shared = std::env::var("FIG4_SHARED_BUFFER").is_ok();
                        let mut bufs: Vec<Vec<u8>> = (0..if shared { 1 } else { chans.len() })
                            .map(|_| vec![1u8; size])
                            .collect();
                        for rep in 0..reps {
                            for v in order(chans.len(), rep, k) {
                                let ch = &chans[v];
                                let buf = &mut bufs[if shared { 0 } else { v }];
                                for _ in 0..2 {
                                    round(ch, me, buf);
                                }
                                // Rank 0 times one round and tells rank 1 the warm-up and
                                // timed round counts.
                                let (warm, n) = if me == 0 {
                                    let t = Instant::now();
                                    round(ch, me, buf);
                                    let per = t.elapsed().max(Duration::from_micros(1));
                                    let n = (budget.as_nanos() / per.as_nanos()).clamp(5, 20_000)
                                        as u64;
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
                                out[v][k].push(t.elapsed().as_secs_f64() * 1e6 / (2.0 * n as f64));
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

fn min(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let reps = env_usize("FIG4_REPS", 3).max(1);
    let budget = Duration::from_millis(env_usize("FIG4_BUDGET_MS", 60) as u64);
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
    ];
    // FIG4_EXTRA=",progress=poll" appends options to every variant's spec.
    let extra = std::env::var("FIG4_EXTRA").unwrap_or_default();
    let specs: Vec<String> = variants.iter().map(|v| format!("{}{extra}", v.1)).collect();
    let (all, tables) = run(&specs, reps, budget);
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
        .map(|per_size| per_size.iter().map(|r| min(r.clone())).collect())
        .collect();
    println!(
        "one-way time in µs (minimum of {reps} runs), {} ms per run; MB/s in parentheses",
        budget.as_millis()
    );
    print!("| size |");
    for (n, _, _) in variants {
        print!(" {n} |");
    }
    println!(" best fixed | adaptive / best | adaptive+tune / best |");
    print!("|---:|");
    for _ in variants {
        print!("---:|");
    }
    println!("---|---:|---:|");
    let mut worst: f64 = 0.0;
    let mut worst_tuned: f64 = 0.0;
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
        let (bi, best) = (0..3)
            .map(|i| (i, med[i][k]))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, f64::NAN));
        let ratio = med[3][k] / best;
        let tuned = med[5][k] / best;
        worst = worst.max(ratio);
        worst_tuned = worst_tuned.max(tuned);
        println!(" {} | {:.3} | {:.3} |", variants[bi].0, ratio, tuned);
    }
    println!("worst adaptive / best fixed ratio: {worst:.3}");
    println!("worst adaptive+tune / best fixed ratio: {worst_tuned:.3}");
    println!("\nadaptive+tune's table (rank 0):\n{}", tables[5]);
}
