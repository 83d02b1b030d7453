//! `tune=auto` (issue 21) per driver: a one-piece ping-pong with each TM forced alone (`tm.`
//! overrides), the built-in table and the thresholds measured at open; then what tuning costs
//! at open.
//!
//! ```text
//! cargo bench --bench tune                 # shm,cma=auto; via:soft,regcache=0; tcp
//! TUNE_SPECS='shm' TUNE_REPS=5 cargo bench --bench tune
//! ```
//!
//! Two ranks are two threads of this process. Per spec:
//!
//! * the variants `fixed:<tm>` (the TMs before it `tm.<name>=0`, itself `tm.<tm>=max`),
//!   `built-in` (`tune=off`), `tuned` (`tune=refresh` in the first round, measured at that
//!   open; `tune=auto` from its cache afterwards) and `twin` (the built-in spec again: the noise
//!   floor) run `TUNE_REPS` rounds; each round opens every channel afresh (a channel can settle
//!   into one of several steady states at a size), gives each one round trip of every size from
//!   128 B to 8 MiB (the history the calibration gives the tuned channel: the kernel grows a TCP
//!   socket's buffers after large transfers), then at each size runs one batch per variant
//!   (one-way µs of `TUNE_BUDGET_MS` of round trips) in a shuffled order, all on one buffer;
//!   the ratio of a variant to the best fixed TM is the median over the rounds of the ratio
//!   within the round (best = the fixed TM with the lowest median), and a size counts as met
//!   within 5 %. `TUNE_ADAPTIVE_EXTRA=<options>` goes to the three variants that are not
//!   forced (a threshold forced wrong must show);
//! * calibration: the `tuned` channel's own figure (`Channel::tuning().calibration`, rank 0)
//!   for `TUNE_OPENS` opens with `tune=refresh`, median and maximum;
//! * open cost: `TUNE_OPENS` opens with `tune=off` and as many with `tune=auto` from the cache
//!   (written by the first), alternated; median wall time of `open_channel_with` on rank 0.
//!
//! The tuning cache goes to a scratch directory (`tune_cache=`), not the user's.

use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::config::{ChannelConfig, TuneCache};
use mad_core::tune::ThresholdSource;
use mad_core::{Channel, RecvMode, SendMode, Session};

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

fn session(b: ThreadBootstrap) -> Session {
    Session::builder()
        .driver(mad_tcp::TcpDriver::new())
        .driver(mad_shm::ShmDriver::new())
        .driver(mad_via::ViaDriver::new())
        .bootstrap(Box::new(b))
        .build()
        .expect("session")
}

fn round(ch: &Channel, me: usize, buf: &mut [u8]) {
    if me == 0 {
        let mut p = ch.begin_packing(1).expect("pack");
        p.pack(buf, RecvMode::Cheaper).expect("pack");
        p.end_packing().expect("end");
        let mut u = ch.begin_unpacking_from(1).expect("unpack");
        u.unpack(buf, SendMode::Cheaper).expect("unpack");
        u.end_unpacking().expect("end");
    } else {
        let mut u = ch.begin_unpacking_from(0).expect("unpack");
        u.unpack(buf, SendMode::Cheaper).expect("unpack");
        u.end_unpacking().expect("end");
        let mut p = ch.begin_packing(0).expect("pack");
        p.pack(buf, RecvMode::Cheaper).expect("pack");
        p.end_packing().expect("end");
    }
}

/// One-way µs of `buf` on `ch` for about `budget` (rank 0 decides the count).
fn time(ch: &Channel, me: usize, buf: &mut [u8], budget: Duration) -> f64 {
    for _ in 0..2 {
        round(ch, me, buf);
    }
    let n = if me == 0 {
        let t = Instant::now();
        round(ch, me, buf);
        let per = t.elapsed().max(Duration::from_micros(1));
        let n = (budget.as_nanos() / per.as_nanos()).clamp(5, 20_000) as u64;
        let mut p = ch.begin_packing(1).expect("pack");
        p.pack_value(&n, RecvMode::Express).expect("pack");
        p.end_packing().expect("end");
        n
    } else {
        round(ch, me, buf);
        let mut u = ch.begin_unpacking_from(0).expect("unpack");
        let n: u64 = u.unpack_value().expect("n");
        u.end_unpacking().expect("end");
        n
    };
    for _ in 0..n / 5 {
        round(ch, me, buf);
    }
    let t = Instant::now();
    for _ in 0..n {
        round(ch, me, buf);
    }
    t.elapsed().as_secs_f64() * 1e6 / (2.0 * n as f64)
}

fn order(n: usize, rep: usize, k: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((rep as u64) << 32) ^ (k as u64);
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

struct Out {
    names: Vec<String>,
    /// `[variant][size][rep]` one-way µs.
    us: Vec<Vec<Vec<f64>>>,
    tuned_table: String,
    calib_ms: Vec<f64>,
    open_off_ms: Vec<f64>,
    open_cached_ms: Vec<f64>,
    cached_ok: bool,
}

fn bench(spec: &str, tag: usize, reps: usize, budget: Duration, opens: usize) -> Out {
    let dir = std::env::temp_dir().join(format!("mad-tune-bench-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |name: &str, s: &str| {
        ChannelConfig::parse(name, s)
            .expect("spec")
            .op_timeout(Duration::from_secs(60))
            .tune_cache(TuneCache::Dir(dir.clone()))
    };
    let boots = ThreadBootstrap::group(2);
    let mut res: Vec<Out> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .map(|b| {
                let cfg = &cfg;
                s.spawn(move || {
                    let session = session(b);
                    let me = session.rank();
                    let probe = session
                        .open_channel_with(cfg(&format!("t{tag}-probe"), spec))
                        .expect("channel");
                    let tms: Vec<String> = probe
                        .tm_table()
                        .tms()
                        .iter()
                        .map(|t| t.name.to_string())
                        .collect();
                    drop(probe);
                    let mut names = Vec::new();
                    let mut specs = Vec::new();
                    for (k, tm) in tms.iter().enumerate() {
                        let mut sp = spec.to_string();
                        for before in &tms[..k] {
                            sp.push_str(&format!(",tm.{before}=0"));
                        }
                        sp.push_str(&format!(",tm.{tm}=max"));
                        names.push(format!("fixed:{tm}"));
                        specs.push(sp);
                    }
                    // `TUNE_ADAPTIVE_EXTRA` (for example a threshold forced wrong) goes to the
                    // three variants that are not forced.
                    let wrong = std::env::var("TUNE_ADAPTIVE_EXTRA").unwrap_or_default();
                    names.push("built-in".into());
                    specs.push(format!("{spec}{wrong}"));
                    names.push("tuned".into());
                    specs.push(format!("{spec}{wrong},tune=refresh"));
                    // The noise floor: the built-in spec again, on channels of its own.
                    names.push("twin".into());
                    specs.push(format!("{spec}{wrong}"));
                    let tuned_at = names.len() - 2;
                    let mut us = vec![vec![Vec::new(); SIZES.len()]; specs.len()];
                    let mut tuned_table = String::new();
                    let mut calib_ms = Vec::new();
                    for rep in 0..reps {
                        // Fresh channels every round (a channel can settle into one of several
                        // steady states at a size); the tuned one measures in the first round,
                        // then opens from the cache of that measurement, as a later open would.
                        let chans: Vec<Channel> = specs
                            .iter()
                            .enumerate()
                            .map(|(i, sp)| {
                                let sp = if i == tuned_at && rep > 0 {
                                    sp.replace("tune=refresh", "tune=auto")
                                } else {
                                    sp.clone()
                                };
                                session
                                    .open_channel_with(cfg(&format!("t{tag}-v{i}-{rep}"), &sp))
                                    .expect("channel")
                            })
                            .collect();
                        // Every channel first carries one round trip of every size up to 8
                        // MiB, as the tuned one's calibration did: the same history (socket
                        // buffers grown by the kernel, registrations) for every variant.
                        let mut warm = vec![1u8; 8 << 20];
                        for ch in &chans {
                            let mut n = 128;
                            while n <= warm.len() {
                                round(ch, me, &mut warm[..n]);
                                n *= 2;
                            }
                        }
                        drop(warm);
                        if rep == 0 {
                            let tuned = &chans[tuned_at];
                            tuned_table = tuned.selection_table();
                            calib_ms
                                .extend(tuned.tuning().calibration.map(|d| d.as_secs_f64() * 1e3));
                        }
                        for (k, &size) in SIZES.iter().enumerate() {
                            // One buffer for every variant: the same pages and placement.
                            let mut buf = vec![1u8; size];
                            for v in order(chans.len(), rep, k) {
                                us[v][k].push(time(&chans[v], me, &mut buf, budget));
                            }
                        }
                    }
                    // Opens: calibration time, then untuned vs cached, alternated.
                    for i in 1..opens {
                        let ch = session
                            .open_channel_with(cfg(
                                &format!("t{tag}-r{i}"),
                                &format!("{spec},tune=refresh"),
                            ))
                            .expect("channel");
                        if let Some(d) = ch.tuning().calibration {
                            calib_ms.push(d.as_secs_f64() * 1e3);
                        }
                    }
                    let (mut off, mut cached, mut cached_ok) = (Vec::new(), Vec::new(), true);
                    for i in 0..opens {
                        for auto in [i % 2 == 0, i % 2 != 0] {
                            let (name, sp) = if auto {
                                (format!("t{tag}-a{i}"), format!("{spec},tune=auto"))
                            } else {
                                (format!("t{tag}-o{i}"), spec.to_string())
                            };
                            let t = Instant::now();
                            let ch = session.open_channel_with(cfg(&name, &sp)).expect("channel");
                            let ms = t.elapsed().as_secs_f64() * 1e3;
                            if auto {
                                cached_ok &= ch
                                    .tuning()
                                    .thresholds
                                    .iter()
                                    .all(|(_, s)| *s != ThresholdSource::Measured);
                                cached.push(ms);
                            } else {
                                off.push(ms);
                            }
                        }
                    }
                    Out {
                        names,
                        us,
                        tuned_table,
                        calib_ms,
                        open_off_ms: off,
                        open_cached_ms: cached,
                        cached_ok,
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    res.swap_remove(0)
}

fn label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else if size >= 1024 {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let specs = std::env::var("TUNE_SPECS")
        .unwrap_or_else(|_| "shm,cma=auto;via:soft,regcache=0;tcp".into());
    let reps = env_usize("TUNE_REPS", 3).max(1);
    let budget = Duration::from_millis(env_usize("TUNE_BUDGET_MS", 40) as u64);
    let opens = env_usize("TUNE_OPENS", 10).max(2);
    for (tag, spec) in specs
        .split(';')
        .filter(|s| !s.trim().is_empty())
        .enumerate()
    {
        let o = bench(spec.trim(), tag, reps, budget, opens);
        let nf = o.names.len() - 3;
        println!(
            "\n## `{spec}`: one-way µs, median of {reps} alternated batches of {} ms (fresh channels every round)\n",
            budget.as_millis()
        );
        print!("| size |");
        for n in &o.names {
            print!(" {n} |");
        }
        println!(" best fixed | built-in / best | tuned / best | twin / built-in |");
        println!("|---:|{}---|---:|---:|---:|", "---:|".repeat(o.names.len()));
        let (mut worst_b, mut worst_t) = ((0.0f64, 0), (0.0f64, 0));
        let (mut within_b, mut within_t, mut floor) = (0, 0, 1.0f64);
        for (k, &size) in SIZES.iter().enumerate() {
            let med: Vec<f64> = o.us.iter().map(|v| median(v[k].clone())).collect();
            let best = (0..nf)
                .min_by(|&a, &b| med[a].total_cmp(&med[b]))
                .unwrap_or(0);
            let ratio = |v: usize, w: usize| {
                median((0..reps).map(|r| o.us[v][k][r] / o.us[w][k][r]).collect())
            };
            let (rb, rt, twin) = (ratio(nf, best), ratio(nf + 1, best), ratio(nf + 2, nf));
            within_b += usize::from(rb <= 1.05);
            within_t += usize::from(rt <= 1.05);
            floor = floor.max(twin.max(1.0 / twin));
            if rb > worst_b.0 {
                worst_b = (rb, size);
            }
            if rt > worst_t.0 {
                worst_t = (rt, size);
            }
            print!("| {} |", label(size));
            for m in &med {
                print!(" {m:.1} |");
            }
            println!(" {} | {rb:.3} | {rt:.3} | {twin:.3} |", o.names[best]);
        }
        println!(
            "\nworst built-in / best: {:.3} at {}; worst tuned / best: {:.3} at {}",
            worst_b.0,
            label(worst_b.1),
            worst_t.0,
            label(worst_t.1)
        );
        println!(
            "within 5 % of the best fixed TM: built-in {within_b} of {n} sizes, tuned {within_t} of {n} \
             sizes; noise floor (twin / built-in) up to {floor:.3}",
            n = SIZES.len()
        );
        let cal = median(o.calib_ms.clone());
        let cal_max = o.calib_ms.iter().copied().fold(0.0, f64::max);
        let (off, cached) = (
            median(o.open_off_ms.clone()),
            median(o.open_cached_ms.clone()),
        );
        println!(
            "calibration: median {cal:.0} ms, max {cal_max:.0} ms over {} opens; open: tune=off {off:.2} ms, \
             tune=auto cached {cached:.2} ms (median of {} each): ratio {:.3}{}",
            o.calib_ms.len(),
            o.open_off_ms.len(),
            cached / off,
            if o.cached_ok { "" } else { " (SOME CACHED OPENS MEASURED)" }
        );
        println!("\ntuned table (rank 0):\n```\n{}```", o.tuned_table);
    }
}
