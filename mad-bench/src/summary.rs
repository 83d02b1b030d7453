//! The report of a `bench/run.sh` run (`bench/results/results.md`; its targets table is also
//! spliced into `BENCHMARKS.md`): the table of the issues' targets (met /
//! not met), the side-by-side comparisons they ask for (shm against both MPIs and the raw ring,
//! the MPI channel against raw MPI, sisci:local beside shm, Figure 4 of the paper, the RPC
//! example), the engine micro-benchmarks and every suite's tables and plots, all computed from
//! the files one `bench/run.sh` run wrote.
//!
//! Inputs (all optional but the CSV files):
//!
//! * mad-bench CSV files; the file stem names the suite: `pair` (`madrun -n 2`), `mr`
//!   (`madrun -n 4`), `mpich` and `openmpi` (the MPI jobs), `ucx` (`madrun -n 2` of a
//!   `--features bench-ucx` build: shm, sisci:local and tcp beside the raw UCX baselines);
//! * `--status FILE`: one line per step of the run, `step<TAB>state<TAB>seconds<TAB>detail`,
//!   `state` being `ran`, `not-run` or `failed` (why a figure is missing);
//! * `--engine FILE`: criterion's stdout for `benches/engine.rs`;
//! * `--fig4 FILE`: `mad-via/benches/figure4.rs`'s `FIG4_CSV` output;
//! * `--rpc-example FILE`: the stdout of `examples/rpc.rs` runs, each run introduced by a line
//!   `== rpc channel=<spec> run=<n>`.

use std::fmt::Write as _;

use mad_core::{Error, Result};

use super::report::{self, num, Row};

/// The two MPIs, by suite name.
pub const MPIS: [(&str, &str); 2] = [("mpich", "MPICH"), ("openmpi", "Open MPI")];

const MIB: usize = 1 << 20;

/// The channels held against UCX on the same transport (issue 16), in the `ucx` suite:
/// (channel, UCX baseline, the non-UCX raw baseline shown beside them).
pub const UCX_PAIRS: [(&str, &str, &str); 3] = [
    ("shm", "raw-ucx-shm", "raw-shm"),
    ("sisci:local", "raw-ucx-shm", "raw-shm"),
    ("tcp", "raw-ucx-tcp", "raw-tcp-poll"),
];

/// The rows of one CSV file.
pub struct Suite {
    /// File stem: `pair`, `mr`, `mpich`, `openmpi`, ...
    pub name: String,
    /// Its rows.
    pub rows: Vec<Row>,
}

/// One step of the run, from the status file.
#[derive(Clone, Debug)]
pub struct Step {
    /// Step name (`pair`, `mr`, `mpich`, `openmpi`, `figure4`, `rpc-example`, `engine`).
    pub name: String,
    /// `ran`, `not-run` or `failed`.
    pub state: String,
    /// Seconds it took.
    pub secs: String,
    /// What ran, or why not.
    pub detail: String,
}

/// One criterion benchmark: name and its interval, in nanoseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Crit {
    /// `pack_null/16`, ...
    pub name: String,
    /// Lower bound of the interval.
    pub lo: f64,
    /// Point estimate.
    pub mid: f64,
    /// Upper bound.
    pub hi: f64,
}

/// One Figure 4 measurement.
#[derive(Clone, Debug)]
pub struct Fig4 {
    /// `copy`, `register`, `rdma`, `adaptive`, `adaptive+cache`.
    pub variant: String,
    /// Message size.
    pub size: usize,
    /// Repetition (the variants of one repetition ran back to back).
    pub rep: usize,
    /// One-way µs.
    pub us: f64,
}

/// One line of the RPC example's output (one client process, one argument size, one run).
#[derive(Clone, Debug, PartialEq)]
pub struct RpcLine {
    /// The `--channel` given.
    pub channel: String,
    /// Run number.
    pub run: usize,
    /// Argument size.
    pub size: usize,
    /// Calls per second of this client process.
    pub calls_per_s: f64,
    /// Median call latency, µs.
    pub median_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
}

/// Everything one run produced.
pub struct Inputs {
    /// The CSV files.
    pub suites: Vec<Suite>,
    /// The run's steps.
    pub steps: Vec<Step>,
    /// Criterion results (`None`: not run).
    pub engine: Option<Vec<Crit>>,
    /// Figure 4 samples (`None`: not run).
    pub fig4: Option<Vec<Fig4>>,
    /// RPC example lines (`None`: not run).
    pub rpc: Option<Vec<RpcLine>>,
    /// Where the plots go (as written in the Markdown links).
    pub out: std::path::PathBuf,
}

/// A plot to write: file name and SVG text.
pub type Plot = (String, String);

// ---------------------------------------------------------------------------------------------
// Parsing

fn to_ns(v: &str, unit: &str) -> Option<f64> {
    let v: f64 = v.parse().ok()?;
    let k = match unit {
        "ps" => 1e-3,
        "ns" => 1.0,
        "µs" | "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return None,
    };
    Some(v * k)
}

/// Criterion's `name time: [lo unit mid unit hi unit]` lines (the name may be on the line
/// before, when it is long).
pub fn parse_criterion(text: &str) -> Vec<Crit> {
    let mut out = Vec::new();
    let mut prev = String::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(at) = t.find("time:") {
            let name = if at == 0 {
                prev.clone()
            } else {
                t.split_whitespace().next().unwrap_or("").to_string()
            };
            let inner = t
                .get(at..)
                .and_then(|s| s.split_once('['))
                .and_then(|(_, s)| s.split_once(']'))
                .map(|(s, _)| s);
            let w: Vec<&str> = inner
                .map(|s| s.split_whitespace().collect())
                .unwrap_or_default();
            if w.len() == 6 && !t.contains('%') {
                if let (Some(lo), Some(mid), Some(hi)) =
                    (to_ns(w[0], w[1]), to_ns(w[2], w[3]), to_ns(w[4], w[5]))
                {
                    out.push(Crit { name, lo, mid, hi });
                }
            }
            continue;
        }
        const SKIP: [&str; 6] = [
            "thrpt",
            "change",
            "Found",
            "Benchmarking",
            "Warning",
            "Running",
        ];
        if !t.is_empty() && !SKIP.iter().any(|s| t.starts_with(s)) {
            prev = t.split_whitespace().next().unwrap_or("").to_string();
        }
    }
    out
}

/// `figure4.rs`'s CSV (`variant,spec,size,rep,one_way_us`; the spec is quoted).
pub fn parse_fig4(text: &str) -> Result<Vec<Fig4>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let bad = || Error::BadConfig(format!("figure 4 CSV line {}: `{line}`", i + 1));
        let (variant, rest) = line.split_once(',').ok_or_else(bad)?;
        // Skip the quoted spec: the last three fields are plain.
        let f: Vec<&str> = rest.rsplitn(4, ',').collect();
        if f.len() != 4 {
            return Err(bad());
        }
        out.push(Fig4 {
            variant: variant.to_string(),
            size: f[2].parse().map_err(|_| bad())?,
            rep: f[1].parse().map_err(|_| bad())?,
            us: f[0].parse().map_err(|_| bad())?,
        });
    }
    Ok(out)
}

/// The RPC example's client lines, e.g.
/// `rank 1 (4 threads, `tcp`):       8 B args:    39008 calls/s, latency median     94.0 µs,
/// p99    310.9 µs (8000 calls)`, under `== rpc channel=<spec> run=<n>` markers.
pub fn parse_rpc_example(text: &str) -> Vec<RpcLine> {
    let mut out = Vec::new();
    let (mut channel, mut run) = (String::new(), 0);
    for line in text.lines() {
        if let Some(m) = line.strip_prefix("== rpc ") {
            for kv in m.split_whitespace() {
                match kv.split_once('=') {
                    Some(("channel", v)) => channel = v.to_string(),
                    Some(("run", v)) => run = v.parse().unwrap_or(0),
                    _ => {}
                }
            }
            continue;
        }
        let Some((head, tail)) = line.split_once(" B args:") else {
            continue;
        };
        let after = |s: &str, key: &str| -> Option<f64> {
            let i = s.find(key)? + key.len();
            s[i..].split_whitespace().next()?.parse().ok()
        };
        let size = head.split_whitespace().last().and_then(|s| s.parse().ok());
        let calls = tail.split_whitespace().next().and_then(|s| s.parse().ok());
        if let (Some(size), Some(calls_per_s), Some(median_us), Some(p99_us)) =
            (size, calls, after(tail, "median"), after(tail, "p99"))
        {
            out.push(RpcLine {
                channel: channel.clone(),
                run,
                size,
                calls_per_s,
                median_us,
                p99_us,
            });
        }
    }
    out
}

/// The status file: `step<TAB>state<TAB>seconds<TAB>detail` lines.
pub fn parse_status(text: &str) -> Vec<Step> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut f = l.splitn(4, '\t');
            let mut next = || f.next().unwrap_or("").trim().to_string();
            Step {
                name: next(),
                state: next(),
                secs: next(),
                detail: next(),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Looking figures up

impl Inputs {
    fn suite(&self, name: &str) -> Option<&[Row]> {
        self.suites
            .iter()
            .find(|s| s.name == name)
            .map(|s| &s.rows[..])
    }

    /// Why a step's figures are missing.
    fn why_missing(&self, step: &str) -> String {
        match self.steps.iter().find(|s| s.name == step) {
            Some(s) if s.state == "ran" => format!("{step}: ran, but produced no such figure"),
            Some(s) if !s.detail.is_empty() => format!("{step}: {}", s.detail),
            Some(s) => format!("{step}: {}", s.state),
            None => format!("{step}: no results in this run"),
        }
    }

    /// The MPI suites present: (suite, label, rows).
    fn mpis(&self) -> Vec<(&'static str, &'static str, &[Row])> {
        MPIS.iter()
            .filter_map(|&(n, l)| self.suite(n).map(|r| (n, l, r)))
            .collect()
    }
}

/// The row of `imp` (a channel in CHEAPER/CHEAPER, or a baseline) for `bench` at `size`.
fn get<'a>(rows: &'a [Row], bench: &str, imp: &str, size: usize) -> Option<&'a Row> {
    rows.iter().find(|r| {
        r.bench == bench
            && r.imp == imp
            && r.size == size
            && (r.mode == "cheaper/cheaper" || r.mode == "-")
            && r.median.is_finite()
            && r.median > 0.0
    })
}

/// Madeleine's cost over the baseline's (time ratio; inverse throughput ratio).
fn cost(m: &Row, base: &Row) -> f64 {
    if m.lower_is_better() {
        m.median / base.median
    } else {
        base.median / m.median
    }
}

/// `imp` against `base`, both in `rows`, at `size`.
fn ratio(rows: &[Row], bench: &str, imp: &str, base: &str, size: usize) -> Option<f64> {
    Some(cost(
        get(rows, bench, imp, size)?,
        get(rows, bench, base, size)?,
    ))
}

fn sizes_of(rows: &[Row], bench: &str, imp: &str) -> Vec<usize> {
    let mut v: Vec<usize> = rows
        .iter()
        .filter(|r| r.bench == bench && r.imp == imp)
        .map(|r| r.size)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

fn unit_of(bench: &str) -> &'static str {
    if bench == "bw" || bench == "bibw" || bench == "mbw_mr" {
        "MB/s"
    } else {
        "µs"
    }
}

fn fig(r: Option<&Row>) -> String {
    r.map_or("-".into(), |r| num(r.median))
}

/// `8 B`, `4 KiB`, `1 MiB`.
fn bytes(n: usize) -> String {
    if n >= MIB && n % MIB == 0 {
        format!("{} MiB", n / MIB)
    } else if n >= 1024 && n % 1024 == 0 {
        format!("{} KiB", n / 1024)
    } else {
        format!("{n} B")
    }
}

fn x(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("×{v:.2}"))
}

// ---------------------------------------------------------------------------------------------
// Targets

/// A target's outcome.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Within the limit.
    Met,
    /// Outside the limit.
    NotMet,
    /// Figures reported, no threshold set by the issue.
    Reported,
    /// Some of the figures it needs are missing (why); `Some(met)` = verdict on what ran.
    Incomplete(Option<bool>, String),
}

impl Verdict {
    fn of(ratio: f64, limit: f64) -> Verdict {
        if ratio <= limit {
            Verdict::Met
        } else {
            Verdict::NotMet
        }
    }

    fn text(&self) -> String {
        match self {
            Verdict::Met => "**met**".into(),
            Verdict::NotMet => "**not met**".into(),
            Verdict::Reported => "reported (no threshold)".into(),
            Verdict::Incomplete(None, why) => format!("not run ({why})"),
            Verdict::Incomplete(Some(m), why) => format!(
                "incomplete: {} on what ran ({why})",
                if *m { "met" } else { "not met" }
            ),
        }
    }
}

/// One row of the targets table.
#[derive(Clone, Debug)]
pub struct Target {
    /// The issue it comes from.
    pub issue: &'static str,
    /// What is compared with what.
    pub what: String,
    /// The figures it rests on.
    pub measured: String,
    /// Madeleine's cost over the baseline's (or the absolute figure compared with the limit).
    pub ratio: String,
    /// The limit.
    pub limit: String,
    /// Outcome.
    pub verdict: Verdict,
}

/// A target comparing a Madeleine row with its baseline row (`pair`), or "not run" with
/// `missing()` as the reason when either figure is absent. `limit` is the printed limit and
/// the cost ratio it allows.
fn versus(
    issue: &'static str,
    what: String,
    (limit, lim): (String, f64),
    bench: &str,
    pair: Option<(&Row, &Row)>,
    missing: impl FnOnce() -> String,
) -> Target {
    match pair {
        Some((m, b)) => {
            let r = cost(m, b);
            Target {
                issue,
                what,
                measured: format!("{} vs {} {}", num(m.median), num(b.median), unit_of(bench)),
                ratio: format!("{r:.3}"),
                limit,
                verdict: Verdict::of(r, lim),
            }
        }
        None => not_run(issue, what, limit, missing()),
    }
}

fn not_run(issue: &'static str, what: String, limit: String, why: String) -> Target {
    Target {
        issue,
        what,
        measured: "-".into(),
        ratio: "-".into(),
        limit,
        verdict: Verdict::Incomplete(None, why),
    }
}

/// Cost-ratio limit of a bandwidth target "at least `k` × the baseline".
fn bw_limit(k: f64) -> (f64, String) {
    (1.0 / k, format!("≤ {:.3} (≥ {k}× the baseline)", 1.0 / k))
}

/// Every target of the issues, from the run's figures.
pub fn targets(inp: &Inputs) -> Vec<Target> {
    let mut t = Vec::new();
    engine_target(inp, &mut t);
    tcp_targets(inp, &mut t);
    shm_targets(inp, &mut t);
    shm_large_targets(inp, &mut t);
    mpi_targets(inp, &mut t);
    ucx_targets(inp, &mut t);
    fig4_target(inp, &mut t);
    t
}

fn engine_target(inp: &Inputs, t: &mut Vec<Target>) {
    let what = "engine overhead per small CHEAPER piece, (`pack_null/16` − `pack_null/1`) / 15"
        .to_string();
    let limit = "< 30 ns".to_string();
    let crit = inp.engine.as_deref().unwrap_or(&[]);
    let find = |n: &str| crit.iter().find(|c| c.name == n);
    match (find("pack_null/1"), find("pack_null/16")) {
        (Some(a), Some(b)) => {
            let per = (b.mid - a.mid) / 15.0;
            t.push(Target {
                issue: "engine",
                what,
                measured: format!(
                    "`pack_null/1` {} ns, `pack_null/16` {} ns",
                    num(a.mid),
                    num(b.mid)
                ),
                ratio: format!("{} ns", num(per)),
                limit,
                verdict: if per < 30.0 {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
            })
        }
        _ => t.push(not_run("engine", what, limit, inp.why_missing("engine"))),
    }
}

fn tcp_targets(inp: &Inputs, t: &mut Vec<Target>) {
    let rows = inp.suite("pair");
    for (bench, size, k, label) in [
        ("latency", 8, None, "8 B one-way latency"),
        ("bw", 4 * MIB, Some(0.97), "4 MiB bandwidth"),
    ] {
        for (chan, base) in [
            ("tcp,progress=poll", "raw-tcp-poll"),
            ("tcp,progress=block", "raw-tcp-block"),
        ] {
            let what = format!("{label}: `{chan}` vs `{base}`");
            let (lim, limit) = match k {
                Some(k) => bw_limit(k),
                None => (1.05, "≤ 1.05".to_string()),
            };
            let Some(rows) = rows else {
                t.push(not_run("mad-tcp", what, limit, inp.why_missing("pair")));
                continue;
            };
            t.push(versus(
                "mad-tcp",
                what,
                (limit, lim),
                bench,
                get(rows, bench, chan, size).zip(get(rows, bench, base, size)),
                || format!("pair suite: no {bench} figure at {}", bytes(size)),
            ));
        }
    }
}

/// shm against the better MPI at one size: for each MPI job, shm's cost over raw MPI's
/// measured side by side in that job; the better MPI is the one against which that ratio is
/// worst. Returns (worst ratio, its MPI, a description of the figures).
fn shm_vs_mpis(inp: &Inputs, bench: &str, size: usize) -> Option<(f64, &'static str, String)> {
    let mut worst: Option<(f64, &'static str)> = None;
    let mut desc = Vec::new();
    for (_, label, rows) in inp.mpis() {
        if let (Some(s), Some(m)) = (
            get(rows, bench, "shm", size),
            get(rows, bench, "raw-mpi", size),
        ) {
            let r = cost(s, m);
            desc.push(format!(
                "{label} job: shm {} vs {} {}",
                num(s.median),
                num(m.median),
                unit_of(bench)
            ));
            if worst.is_none_or(|(w, _)| r > w) {
                worst = Some((r, label));
            }
        }
    }
    worst.map(|(r, l)| (r, l, desc.join("; ")))
}

/// Why one or both MPIs are missing (empty when both ran).
fn mpi_gaps(inp: &Inputs) -> Vec<String> {
    MPIS.iter()
        .filter(|(n, _)| inp.suite(n).is_none())
        .map(|(n, _)| inp.why_missing(n))
        .collect()
}

fn shm_targets(inp: &Inputs, t: &mut Vec<Target>) {
    let gaps = mpi_gaps(inp);
    // Against the better MPI.
    for (bench, size, lim, limit, label) in [
        (
            "latency",
            8,
            0.9,
            "≤ 0.90".to_string(),
            "8 B one-way latency: `shm` vs the better MPI",
        ),
        (
            "bw",
            4 * MIB,
            bw_limit(1.05).0,
            bw_limit(1.05).1,
            "4 MiB bandwidth: `shm` vs the better MPI",
        ),
    ] {
        let what = label.to_string();
        match shm_vs_mpis(inp, bench, size) {
            Some((r, who, desc)) => {
                let v = Verdict::of(r, lim);
                t.push(Target {
                    issue: "mad-shm",
                    what,
                    measured: format!("{desc} (better: {who})"),
                    ratio: format!("{r:.3}"),
                    limit,
                    verdict: if gaps.is_empty() {
                        v
                    } else {
                        Verdict::Incomplete(Some(v == Verdict::Met), gaps.join("; "))
                    },
                })
            }
            None => t.push(not_run(
                "mad-shm",
                what,
                limit,
                if gaps.is_empty() {
                    format!("no shm / raw-mpi {bench} figure at {}", bytes(size))
                } else {
                    gaps.join("; ")
                },
            )),
        }
    }
    // Against the raw ring and memcpy, in the pair suite.
    for (bench, size, base, lim, limit, label) in [
        (
            "latency",
            8,
            "raw-shm",
            2.0,
            "≤ 2.0".to_string(),
            "8 B one-way latency: `shm` vs the raw ring (`raw-shm`)",
        ),
        (
            "bw",
            4 * MIB,
            "memcpy",
            bw_limit(0.8).0,
            bw_limit(0.8).1,
            "4 MiB bandwidth: `shm` vs single-thread `memcpy`",
        ),
    ] {
        let what = label.to_string();
        let Some(rows) = inp.suite("pair") else {
            t.push(not_run("mad-shm", what, limit, inp.why_missing("pair")));
            continue;
        };
        match (get(rows, bench, "shm", size), get(rows, bench, base, size)) {
            (Some(m), Some(b)) => {
                let r = cost(m, b);
                t.push(Target {
                    issue: "mad-shm",
                    what,
                    measured: format!(
                        "{} vs {} {} (pair suite)",
                        num(m.median),
                        num(b.median),
                        unit_of(bench)
                    ),
                    ratio: format!("{r:.3}"),
                    limit,
                    verdict: Verdict::of(r, lim),
                })
            }
            _ => t.push(not_run(
                "mad-shm",
                what,
                limit,
                format!("pair suite: no {bench} figure at {}", bytes(size)),
            )),
        }
    }
    // No size of the sweeps more than 10% slower than the better MPI.
    for (bench, first, label) in [
        (
            "latency",
            0,
            "every size 0 B – 16 MiB, one-way latency: `shm` vs the better MPI",
        ),
        (
            "bw",
            1,
            "every size 1 B – 16 MiB, bandwidth: `shm` vs the better MPI (same rule)",
        ),
    ] {
        let what = label.to_string();
        let limit = "≤ 1.10 at every size".to_string();
        let mut all: Vec<usize> = inp
            .mpis()
            .iter()
            .flat_map(|(_, _, rows)| sizes_of(rows, bench, "shm"))
            .collect();
        all.sort_unstable();
        all.dedup();
        let mut worst: Option<(f64, usize, &str)> = None;
        for &s in &all {
            if let Some((r, who, _)) = shm_vs_mpis(inp, bench, s) {
                if worst.is_none_or(|(w, _, _)| r > w) {
                    worst = Some((r, s, who));
                }
            }
        }
        let Some((r, at, who)) = worst else {
            t.push(not_run(
                "mad-shm",
                what,
                limit,
                if gaps.is_empty() {
                    format!("no shm / raw-mpi {bench} figures")
                } else {
                    gaps.join("; ")
                },
            ));
            continue;
        };
        let over = all
            .iter()
            .filter(|&&s| shm_vs_mpis(inp, bench, s).is_some_and(|(r, _, _)| r > 1.10))
            .count();
        let mut missing = gaps.clone();
        let (lo, hi) = (all.first().copied(), all.last().copied());
        if lo != Some(first) || hi.is_none_or(|h| h < 16 * MIB) {
            missing.push(format!(
                "the sweep covered {} – {} only",
                bytes(lo.unwrap_or(0)),
                bytes(hi.unwrap_or(0))
            ));
        }
        let v = Verdict::of(r, 1.10);
        t.push(Target {
            issue: "mad-shm",
            what,
            measured: format!(
                "{} sizes, {over} above 1.10; worst at {} (vs {who})",
                all.len(),
                bytes(at)
            ),
            ratio: format!("{r:.3}"),
            limit,
            verdict: if missing.is_empty() {
                v
            } else {
                Verdict::Incomplete(Some(v == Verdict::Met), missing.join("; "))
            },
        });
    }
}

/// The worst ratio (our cost over the baseline's) of `chan` against `base` over the sizes
/// `lo ..= hi` that both have, and at which size.
fn worst_in(
    rows: &[Row],
    bench: &str,
    chan: &str,
    base: &str,
    lo: usize,
    hi: usize,
) -> Option<(f64, usize, usize)> {
    let mut worst: Option<(f64, usize)> = None;
    let mut n = 0;
    for s in sizes_of(rows, bench, chan)
        .into_iter()
        .filter(|&s| s >= lo && s <= hi)
    {
        if let (Some(m), Some(b)) = (get(rows, bench, chan, s), get(rows, bench, base, s)) {
            n += 1;
            let r = cost(m, b);
            if worst.is_none_or(|(w, _)| r > w) {
                worst = Some((r, s));
            }
        }
    }
    worst.map(|(r, s)| (r, s, n))
}

/// Issue 16's large-message rows: shm at 1–16 MiB against the better MPI (latency ≤ 0.6×,
/// bandwidth ≥ 1.5×) and against sisci:local in the same run (never more than 10 % slower).
fn shm_large_targets(inp: &Inputs, t: &mut Vec<Target>) {
    let gaps = mpi_gaps(inp);
    for (bench, lim, limit, label) in [
        (
            "latency",
            0.6,
            "≤ 0.60 at every size".to_string(),
            "1–16 MiB one-way latency: `shm` vs the better MPI",
        ),
        (
            "bw",
            bw_limit(1.5).0,
            format!("{} at every size", bw_limit(1.5).1),
            "1–16 MiB bandwidth: `shm` vs the better MPI",
        ),
    ] {
        let what = label.to_string();
        let mut worst: Option<(f64, usize, &str)> = None;
        let mut n = 0;
        for s in (0..=4).map(|k| MIB << k) {
            if let Some((r, who, _)) = shm_vs_mpis(inp, bench, s) {
                n += 1;
                if worst.is_none_or(|(w, _, _)| r > w) {
                    worst = Some((r, s, who));
                }
            }
        }
        match worst {
            Some((r, at, who)) => {
                let v = Verdict::of(r, lim);
                let mut missing = gaps.clone();
                if n < 5 {
                    missing.push(format!("{n} of the 5 sizes 1–16 MiB measured"));
                }
                t.push(Target {
                    issue: "mad-shm",
                    what,
                    measured: format!("{n} sizes; worst at {} (vs {who})", bytes(at)),
                    ratio: format!("{r:.3}"),
                    limit,
                    verdict: if missing.is_empty() {
                        v
                    } else {
                        Verdict::Incomplete(Some(v == Verdict::Met), missing.join("; "))
                    },
                });
            }
            None => t.push(not_run(
                "mad-shm",
                what,
                limit,
                if gaps.is_empty() {
                    format!("no shm / raw-mpi {bench} figures at 1–16 MiB")
                } else {
                    gaps.join("; ")
                },
            )),
        }
    }
    for (bench, label) in [
        (
            "latency",
            "1–16 MiB one-way latency: `shm` vs `sisci:local`",
        ),
        ("bw", "1–16 MiB bandwidth: `shm` vs `sisci:local`"),
    ] {
        let what = label.to_string();
        let limit = "≤ 1.10 at every size".to_string();
        // The UCX step sweeps both up to 16 MiB in one run; the pair suite stops at 4 MiB.
        let Some(rows) = inp.suite("ucx").or_else(|| inp.suite("pair")) else {
            t.push(not_run("mad-shm", what, limit, inp.why_missing("ucx")));
            continue;
        };
        match worst_in(rows, bench, "shm", "sisci:local", MIB, 16 * MIB) {
            Some((r, at, n)) => {
                let v = Verdict::of(r, 1.10);
                t.push(Target {
                    issue: "mad-shm",
                    what,
                    measured: format!("{n} sizes; worst at {}", bytes(at)),
                    ratio: format!("{r:.3}"),
                    limit,
                    verdict: if n >= 5 {
                        v
                    } else {
                        Verdict::Incomplete(
                            Some(v == Verdict::Met),
                            format!("{n} of the 5 sizes 1–16 MiB measured"),
                        )
                    },
                });
            }
            None => t.push(not_run(
                "mad-shm",
                what,
                limit,
                format!("no shm / sisci:local {bench} figures at 1–16 MiB"),
            )),
        }
    }
}

fn mpi_targets(inp: &Inputs, t: &mut Vec<Target>) {
    for &(name, label) in &MPIS {
        let rows = inp.suite(name);
        for (bench, size, lim, limit, what) in [
            (
                "latency",
                8,
                1.10,
                "≤ 1.10".to_string(),
                format!("{label}: 8 B one-way latency, `mpi` vs raw MPI"),
            ),
            (
                "bw",
                4 * MIB,
                bw_limit(0.97).0,
                bw_limit(0.97).1,
                format!("{label}: 4 MiB bandwidth, `mpi` vs raw MPI"),
            ),
        ] {
            let Some(rows) = rows else {
                t.push(not_run("mad-mpi", what, limit, inp.why_missing(name)));
                continue;
            };
            t.push(versus(
                "mad-mpi",
                what,
                (limit, lim),
                bench,
                get(rows, bench, "mpi", size).zip(get(rows, bench, "raw-mpi", size)),
                || format!("{name}: no mpi / raw-mpi {bench} figure at {}", bytes(size)),
            ));
        }
        for size in [8, MIB] {
            let what = format!(
                "{label}: RPC, {} body, `mpi` vs pure MPI (two messages; one packed message + Mprobe)",
                bytes(size)
            );
            let limit = "-".to_string();
            let Some(rows) = rows else {
                t.push(not_run("mad-mpi", what, limit, inp.why_missing(name)));
                continue;
            };
            let m = get(rows, "rpc", "mpi", size);
            let two = ratio(rows, "rpc", "mpi", "raw-mpi", size);
            let packed = ratio(rows, "rpc", "mpi", "raw-mpi-packed", size);
            match (m, two, packed) {
                (Some(m), Some(a), Some(b)) => t.push(Target {
                    issue: "mad-mpi",
                    what,
                    measured: format!(
                        "{} vs {} / {} µs",
                        num(m.median),
                        fig(get(rows, "rpc", "raw-mpi", size)),
                        fig(get(rows, "rpc", "raw-mpi-packed", size))
                    ),
                    ratio: format!("{a:.3} / {b:.3}"),
                    limit,
                    verdict: Verdict::Reported,
                }),
                _ => t.push(not_run(
                    "mad-mpi",
                    what,
                    limit,
                    format!("{name}: no rpc figures at {}", bytes(size)),
                )),
            }
        }
    }
}

/// Issue 16: tcp, shm and sisci:local at every size 0 B – 16 MiB, latency and bandwidth, at
/// most 1.0× UCX on the same transport, from the `ucx` suite (one `madrun -n 2` run).
fn ucx_targets(inp: &Inputs, t: &mut Vec<Target>) {
    let rows = inp.suite("ucx");
    for (chan, base, _) in UCX_PAIRS {
        for (bench, first, label) in [("latency", 0, "one-way latency"), ("bw", 1, "bandwidth")] {
            let what = format!(
                "every size {} – 16 MiB, {label}: `{chan}` vs UCX on the same transport (`{base}`)",
                bytes(first)
            );
            let limit = "≤ 1.00 at every size".to_string();
            let Some(rows) = rows else {
                t.push(not_run("ucx", what, limit, inp.why_missing("ucx")));
                continue;
            };
            let all: Vec<(usize, f64)> = sizes_of(rows, bench, chan)
                .into_iter()
                .filter_map(|s| Some((s, ratio(rows, bench, chan, base, s)?)))
                .collect();
            let Some(&(at, r)) = all.iter().max_by(|a, b| a.1.total_cmp(&b.1)) else {
                t.push(not_run(
                    "ucx",
                    what,
                    limit,
                    format!("ucx suite: no {chan} / {base} {bench} figures"),
                ));
                continue;
            };
            let over = all.iter().filter(|(_, r)| *r > 1.0).count();
            let at_size = |s: usize| match (get(rows, bench, chan, s), get(rows, bench, base, s)) {
                (Some(m), Some(b)) => {
                    format!("{}: {} vs {}", bytes(s), num(m.median), num(b.median))
                }
                _ => format!("{}: -", bytes(s)),
            };
            let (lo, hi) = (all.first().map(|a| a.0), all.last().map(|a| a.0));
            let v = Verdict::of(r, 1.0);
            t.push(Target {
                issue: "ucx",
                what,
                measured: format!(
                    "{}; {} {}; {} sizes, {over} above 1.00; worst at {}",
                    at_size(if bench == "latency" { 8 } else { 4 * MIB }),
                    at_size(if bench == "latency" { 4 * MIB } else { 8 }),
                    unit_of(bench),
                    all.len(),
                    bytes(at)
                ),
                ratio: format!("{r:.3}"),
                limit,
                verdict: if lo != Some(first) || hi.is_none_or(|h| h < 16 * MIB) {
                    Verdict::Incomplete(
                        Some(v == Verdict::Met),
                        format!(
                            "the sweep covered {} – {} only",
                            bytes(lo.unwrap_or(0)),
                            bytes(hi.unwrap_or(0))
                        ),
                    )
                } else {
                    v
                },
            });
        }
    }
}

/// Figure 4 per size: (size, per-variant (median, min, max), best fixed variant, adaptive / best,
/// adaptive+tune / best).
///
/// The best fixed method is the fixed column with the lowest median; the ratio is the median,
/// over repetitions, of adaptive / that method *within the repetition* (the variants of one
/// repetition run back to back, so the machine's drift cancels in each pair).
type Fig4Row = (usize, Vec<(f64, f64, f64)>, usize, f64, f64);

/// The Figure 4 variants, in column order; the first three are the fixed methods.
pub const FIG4_VARIANTS: [&str; 6] = [
    "copy",
    "register",
    "rdma",
    "adaptive",
    "adaptive+cache",
    "adaptive+tune",
];

fn fig4_table(samples: &[Fig4]) -> Vec<Fig4Row> {
    let mut sizes: Vec<usize> = samples.iter().map(|s| s.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
        .into_iter()
        .map(|size| {
            let per: Vec<(f64, f64, f64)> = FIG4_VARIANTS
                .iter()
                .map(|v| {
                    let xs: Vec<f64> = samples
                        .iter()
                        .filter(|s| s.size == size && s.variant == *v)
                        .map(|s| s.us)
                        .collect();
                    report::stats(&xs)
                })
                .collect();
            let best = (0..3)
                .filter(|&i| per[i].0.is_finite())
                .min_by(|&a, &b| per[a].0.total_cmp(&per[b].0))
                .unwrap_or(0);
            let at = |v: &str, rep: usize| {
                samples
                    .iter()
                    .find(|s| s.size == size && s.variant == v && s.rep == rep)
                    .map(|s| s.us)
            };
            let mut reps: Vec<usize> = samples
                .iter()
                .filter(|s| s.size == size)
                .map(|s| s.rep)
                .collect();
            reps.sort_unstable();
            reps.dedup();
            let ratio = |v: usize| {
                let paired: Vec<f64> = reps
                    .iter()
                    .filter_map(|&rep| {
                        Some(at(FIG4_VARIANTS[v], rep)? / at(FIG4_VARIANTS[best], rep)?)
                    })
                    .collect();
                if paired.is_empty() {
                    per[v].0 / per[best].0
                } else {
                    report::stats(&paired).0
                }
            };
            let (ra, rt) = (ratio(3), ratio(5));
            (size, per, best, ra, rt)
        })
        .collect()
}

fn fig4_target(inp: &Inputs, t: &mut Vec<Target>) {
    let what = "Figure 4 on `via:soft`: adaptive vs the best fixed method, every size".to_string();
    let limit = "≤ 1.05 at every size".to_string();
    let table = inp.fig4.as_deref().map(fig4_table).unwrap_or_default();
    let worst = table
        .iter()
        .filter(|r| r.3.is_finite())
        .max_by(|a, b| a.3.total_cmp(&b.3));
    match worst {
        Some((size, _, best, r, _)) => {
            let over = table.iter().filter(|r| r.3 > 1.05 || r.3.is_nan()).count();
            t.push(Target {
                issue: "mad-via",
                what,
                measured: format!(
                    "{} sizes, {over} above 1.05; worst at {} (best fixed: {})",
                    table.len(),
                    bytes(*size),
                    FIG4_VARIANTS[*best]
                ),
                ratio: format!("{r:.3}"),
                limit,
                verdict: Verdict::of(*r, 1.05),
            })
        }
        None => t.push(not_run("mad-via", what, limit, inp.why_missing("figure4"))),
    }
    let tuned = table
        .iter()
        .filter(|r| r.4.is_finite())
        .max_by(|a, b| a.4.total_cmp(&b.4));
    if let Some((size, _, best, _, r)) = tuned {
        let over = table.iter().filter(|r| r.4 > 1.05 || r.4.is_nan()).count();
        t.push(Target {
            issue: "21",
            what: "Figure 4 on `via:soft` with `tune=auto`: adaptive+tune vs the best fixed method, every size".into(),
            measured: format!(
                "{} sizes, {over} above 1.05; worst at {} (best fixed: {})",
                table.len(),
                bytes(*size),
                FIG4_VARIANTS[*best]
            ),
            ratio: format!("{r:.3}"),
            limit: "≤ 1.05 at every size".into(),
            verdict: Verdict::of(*r, 1.05),
        });
    }
}

fn targets_md(ts: &[Target]) -> String {
    let mut s = String::from(
        "| issue | target | measured (medians) | ratio | limit | verdict |\n|---|---|---|---:|---|---|\n",
    );
    for t in ts {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            t.issue,
            t.what,
            t.measured,
            t.ratio,
            t.limit,
            t.verdict.text()
        );
    }
    s
}

// ---------------------------------------------------------------------------------------------
// The comparisons

/// Rows of `imp` in `rows` for `bench`, renamed `name` (mode `-` when `dashed`), for a plot.
fn renamed(rows: &[Row], bench: &str, imp: &str, name: &str, dashed: bool) -> Vec<Row> {
    rows.iter()
        .filter(|r| {
            r.bench == bench && r.imp == imp && (r.mode == "cheaper/cheaper" || r.mode == "-")
        })
        .map(|r| Row {
            imp: name.to_string(),
            // Empty mode: a Madeleine line, solid, labelled by its name alone.
            mode: if dashed { "-".into() } else { String::new() },
            ..r.clone()
        })
        .collect()
}

fn plot(
    inp: &Inputs,
    plots: &mut Vec<Plot>,
    md: &mut String,
    file: &str,
    title: &str,
    rows: &[Row],
) {
    if let Some(svg) = report::svg_plot(title, rows) {
        let _ = writeln!(md, "![{title}]({})\n", inp.out.join(file).display());
        plots.push((file.to_string(), svg));
    }
}

fn shm_mpi_section(inp: &Inputs, md: &mut String, plots: &mut Vec<Plot>) {
    let mpis = inp.mpis();
    let _ = writeln!(
        md,
        "\n### shm against MPICH and Open MPI (issue mad-shm)\n\n\
         Each MPI job runs `mad-bench` with the `shm` and `mpi` channels beside raw MPI \
         (`raw-mpi`), the raw ring (`raw-shm`) and `memcpy`, interleaved run by run. The ratio \
         (×) is shm's cost over raw MPI's *in the same job*; the better MPI at a size is the one \
         against which shm's ratio is worse (the last column)."
    );
    if mpis.is_empty() {
        let _ = writeln!(md, "\nNot run: {}.", mpi_gaps(inp).join("; "));
        return;
    }
    for g in mpi_gaps(inp) {
        let _ = writeln!(md, "\nNot run: {g}.");
    }
    for bench in ["latency", "bw"] {
        let _ = writeln!(md, "\n#### `{bench}`: {}\n", report::describe(bench));
        let mut head = String::from("| size |");
        let mut sep = String::from("|---:|");
        for (_, label, _) in &mpis {
            let _ = write!(head, " shm ({label} job) | raw {label} | ratio |");
            sep.push_str("---:|---:|---:|");
        }
        let _ = write!(
            head,
            " vs the better MPI | raw ring (`raw-shm`, {} job) |",
            mpis[0].1
        );
        sep.push_str("---:|---:|");
        let _ = writeln!(md, "{head}\n{sep}");
        let mut sizes: Vec<usize> = mpis
            .iter()
            .flat_map(|(_, _, rows)| sizes_of(rows, bench, "shm"))
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        for s in sizes {
            let mut line = format!("| {} |", bytes(s));
            for (_, _, rows) in &mpis {
                let _ = write!(
                    line,
                    " {} | {} | {} |",
                    fig(get(rows, bench, "shm", s)),
                    fig(get(rows, bench, "raw-mpi", s)),
                    x(ratio(rows, bench, "shm", "raw-mpi", s))
                );
            }
            let better = shm_vs_mpis(inp, bench, s);
            let _ = writeln!(
                line,
                " {} | {} |",
                better.map_or("-".into(), |(r, who, _)| format!("×{r:.2} ({who})")),
                fig(get(mpis[0].2, bench, "raw-shm", s))
            );
            md.push_str(&line);
        }
        let mut rows = Vec::new();
        for (n, label, r) in &mpis {
            rows.extend(renamed(
                r,
                bench,
                "shm",
                &format!("shm ({label} job)"),
                false,
            ));
            rows.extend(renamed(
                r,
                bench,
                "mpi",
                &format!("mpi channel ({label})"),
                false,
            ));
            rows.extend(renamed(r, bench, "raw-mpi", &format!("raw {label}"), true));
            if *n == mpis[0].0 {
                rows.extend(renamed(r, bench, "raw-shm", "raw ring (raw-shm)", true));
                if bench == "bw" {
                    rows.extend(renamed(r, bench, "memcpy", "memcpy", true));
                }
            }
        }
        md.push('\n');
        plot(
            inp,
            plots,
            md,
            &format!("shm-mpi-{bench}.svg"),
            &format!(
                "shm and the MPI channel vs raw MPI: {}",
                report::describe(bench)
            ),
            &rows,
        );
    }
}

fn mpi_section(inp: &Inputs, md: &mut String) {
    let _ = writeln!(
        md,
        "\n### The MPI channel against raw MPI (issue mad-mpi)\n\n\
         `mpi` = Madeleine's MPI channel, `raw-mpi` = blocking `MPI_Send`/`MPI_Recv` through \
         rsmpi in the same job. RPC: Madeleine packs an EXPRESS 8-byte size header and a CHEAPER \
         body in one message; the pure-MPI idioms are `raw-mpi` (header and body as two \
         messages) and `raw-mpi-packed` (header and body copied into one message, received with \
         `MPI_Mprobe` + `MPI_Get_count` + `MPI_Mrecv`). Ratios = Madeleine's cost / raw MPI's."
    );
    for &(name, label) in &MPIS {
        let Some(rows) = inp.suite(name) else {
            let _ = writeln!(md, "\n#### {label}\n\nNot run: {}.", inp.why_missing(name));
            continue;
        };
        let _ = writeln!(
            md,
            "\n#### {label}\n\n| size | latency `mpi` µs | raw | ratio | bw `mpi` MB/s | raw | ratio | RPC `mpi` µs | two messages | ratio | packed + Mprobe | ratio |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let mut sizes = sizes_of(rows, "latency", "mpi");
        sizes.extend(sizes_of(rows, "bw", "mpi"));
        sizes.sort_unstable();
        sizes.dedup();
        for s in sizes {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                bytes(s),
                fig(get(rows, "latency", "mpi", s)),
                fig(get(rows, "latency", "raw-mpi", s)),
                x(ratio(rows, "latency", "mpi", "raw-mpi", s)),
                fig(get(rows, "bw", "mpi", s)),
                fig(get(rows, "bw", "raw-mpi", s)),
                x(ratio(rows, "bw", "mpi", "raw-mpi", s)),
                fig(get(rows, "rpc", "mpi", s)),
                fig(get(rows, "rpc", "raw-mpi", s)),
                x(ratio(rows, "rpc", "mpi", "raw-mpi", s)),
                fig(get(rows, "rpc", "raw-mpi-packed", s)),
                x(ratio(rows, "rpc", "mpi", "raw-mpi-packed", s)),
            );
        }
    }
}

fn sisci_section(inp: &Inputs, md: &mut String, plots: &mut Vec<Plot>) {
    let _ = writeln!(
        md,
        "\n### sisci:local beside shm and the raw ring (issue mad-sisci)\n\n\
         From the pair suite (same run, interleaved): `sisci:local` (SCI-style remote segments in \
         host shared memory), `shm` and the raw polled ring `raw-shm`. Ratios = cost over \
         `raw-shm`'s."
    );
    let Some(rows) = inp.suite("pair") else {
        let _ = writeln!(md, "\nNot run: {}.", inp.why_missing("pair"));
        return;
    };
    let _ = writeln!(
        md,
        "\n| size | latency sisci:local µs | shm | raw-shm | sisci / raw | shm / raw | bw sisci:local MB/s | shm | raw-shm | sisci / raw | shm / raw |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut sizes = sizes_of(rows, "latency", "sisci:local");
    sizes.extend(sizes_of(rows, "bw", "sisci:local"));
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.is_empty() {
        let _ = writeln!(md, "| (no sisci:local rows in this run) |");
    }
    for s in sizes {
        let mut line = format!("| {} |", bytes(s));
        for b in ["latency", "bw"] {
            let _ = write!(
                line,
                " {} | {} | {} | {} | {} |",
                fig(get(rows, b, "sisci:local", s)),
                fig(get(rows, b, "shm", s)),
                fig(get(rows, b, "raw-shm", s)),
                x(ratio(rows, b, "sisci:local", "raw-shm", s)),
                x(ratio(rows, b, "shm", "raw-shm", s)),
            );
        }
        let _ = writeln!(md, "{line}");
    }
    md.push('\n');
    for b in ["latency", "bw"] {
        let mut pr = renamed(rows, b, "sisci:local", "sisci:local", false);
        pr.extend(renamed(rows, b, "shm", "shm", false));
        pr.extend(renamed(rows, b, "raw-shm", "raw-shm", true));
        plot(
            inp,
            plots,
            md,
            &format!("sisci-{b}.svg"),
            &format!("sisci:local, shm, raw-shm: {}", report::describe(b)),
            &pr,
        );
    }
}

fn ucx_section(inp: &Inputs, md: &mut String, plots: &mut Vec<Plot>) {
    let _ = writeln!(
        md,
        "\n### shm, sisci:local and tcp against UCX (issue 16)\n\n\
         The `ucx` step: one `madrun -n 2` run of a `--features bench-ucx` build, the channels \
         interleaved run by run with UCX's UCP tag API on the same transports (`raw-ucx-shm`: \
         `UCX_TLS=posix,sysv,cma,self`; `raw-ucx-tcp`: `UCX_TLS=tcp,self` on `lo`) and with the raw \
         ring and raw TCP. The UCX baselines busy-poll `ucp_worker_progress` (UCX's default), \
         one blocking tag send or receive at a time, as the other baselines. Ratio (×) = the \
         channel's cost over UCX's on the same transport, **above 1 = slower than UCX**."
    );
    let Some(rows) = inp.suite("ucx") else {
        let _ = writeln!(md, "\nNot run: {}.", inp.why_missing("ucx"));
        return;
    };
    for bench in ["latency", "bw"] {
        let _ = writeln!(md, "\n#### `{bench}`: {}\n", report::describe(bench));
        let mut head = String::from("| size |");
        let mut sep = String::from("|---:|");
        for (chan, base, _) in UCX_PAIRS {
            let _ = write!(head, " `{chan}` | `{base}` | ratio |");
            sep.push_str("---:|---:|---:|");
        }
        head.push_str(" `raw-shm` | `raw-tcp-poll` |");
        sep.push_str("---:|---:|");
        let _ = writeln!(md, "{head}\n{sep}");
        let mut sizes: Vec<usize> = UCX_PAIRS
            .iter()
            .flat_map(|(c, b, _)| {
                let mut v = sizes_of(rows, bench, c);
                v.extend(sizes_of(rows, bench, b));
                v
            })
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        for s in sizes {
            let mut line = format!("| {} |", bytes(s));
            for (chan, base, _) in UCX_PAIRS {
                let _ = write!(
                    line,
                    " {} | {} | {} |",
                    fig(get(rows, bench, chan, s)),
                    fig(get(rows, bench, base, s)),
                    x(ratio(rows, bench, chan, base, s))
                );
            }
            let _ = writeln!(
                line,
                " {} | {} |",
                fig(get(rows, bench, "raw-shm", s)),
                fig(get(rows, bench, "raw-tcp-poll", s))
            );
            md.push_str(&line);
        }
        let mut pr = Vec::new();
        for (chan, _, _) in UCX_PAIRS {
            pr.extend(renamed(rows, bench, chan, chan, false));
        }
        for base in ["raw-ucx-shm", "raw-ucx-tcp", "raw-shm", "raw-tcp-poll"] {
            pr.extend(renamed(rows, bench, base, base, true));
        }
        md.push('\n');
        plot(
            inp,
            plots,
            md,
            &format!("ucx-{bench}.svg"),
            &format!(
                "shm, sisci:local, tcp vs UCX (dashed): {}",
                report::describe(bench)
            ),
            &pr,
        );
    }
}

fn fig4_section(inp: &Inputs, md: &mut String, plots: &mut Vec<Plot>) {
    let _ = writeln!(
        md,
        "\n### Figure 4 of the paper on `via:soft` (issue mad-via)\n\n\
         `mad-via/benches/figure4.rs`: one-piece ping-pong, one-way µs, each transfer method \
         forced alone (`copy` = static pre-registered buffers only, `register` = dynamic \
         registration only, `rdma` = rendezvous RDMA write only; registration cache off) and the \
         adaptive choice (`adaptive`; `adaptive+cache` with the registration cache on; \
         `adaptive+tune` with `tune=auto`, thresholds measured on this machine). Median of \
         the runs (min–max); best fixed = the fixed column with the lowest median; adaptive / \
         best = the median over runs of the ratio within each run (the variants of a run ran \
         back to back)."
    );
    let Some(samples) = inp.fig4.as_deref() else {
        let _ = writeln!(md, "\nNot run: {}.", inp.why_missing("figure4"));
        return;
    };
    let table = fig4_table(samples);
    let runs = samples
        .iter()
        .filter(|s| s.variant == "adaptive" && Some(s.size) == table.first().map(|r| r.0))
        .count();
    let _ = writeln!(
        md,
        "\n{runs} run(s) per cell.\n\n| size | copy | register | rdma | adaptive | adaptive+cache | adaptive+tune | best fixed | adaptive / best | adaptive+tune / best |\n|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"
    );
    for (size, per, best, r, rt) in &table {
        let mut line = format!("| {} |", bytes(*size));
        for (m, lo, hi) in per {
            if runs > 1 {
                let _ = write!(line, " {} ({}–{}) |", num(*m), num(*lo), num(*hi));
            } else {
                let _ = write!(line, " {} |", num(*m));
            }
        }
        let _ = writeln!(line, " {} | {r:.3} | {rt:.3} |", FIG4_VARIANTS[*best]);
        md.push_str(&line);
    }
    if let Some((size, _, _, r, _)) = table
        .iter()
        .filter(|r| r.3.is_finite())
        .max_by(|a, b| a.3.total_cmp(&b.3))
    {
        let _ = writeln!(
            md,
            "\nWorst adaptive / best fixed ratio: **{r:.3}** at {} (target ≤ 1.05).\n",
            bytes(*size)
        );
    }
    let rows: Vec<Row> = table
        .iter()
        .flat_map(|(size, per, _, _, _)| {
            FIG4_VARIANTS
                .iter()
                .zip(per)
                .map(move |(v, (m, lo, hi))| Row {
                    bench: "figure4".into(),
                    imp: (*v).into(),
                    mode: if v.starts_with("adaptive") {
                        String::new()
                    } else {
                        "-".into()
                    },
                    size: *size,
                    unit: "us".into(),
                    median: *m,
                    min: *lo,
                    max: *hi,
                    runs,
                    iters: 0,
                    baseline: String::new(),
                    base_median: f64::NAN,
                })
        })
        .collect();
    plot(
        inp,
        plots,
        md,
        "figure4.svg",
        "Figure 4 on via:soft: one-way µs (fixed methods dashed, adaptive solid)",
        &rows,
    );
}

fn rpc_example_section(inp: &Inputs, md: &mut String) {
    let _ = writeln!(
        md,
        "\n### The RPC example (issue examples)\n\n\
         `examples/rpc.rs` under `madrun -n 2`: a server process (a `mad-am` endpoint polled by \
         its main thread; `sum` runs inline, `echo` in a pool of 2 workers) and one client process whose 4 threads call at once, `sum` of one 8 B argument \
         (2000 calls per thread) then of one 1 MiB argument (100 calls per thread). Median over \
         the runs (min–max)."
    );
    let Some(lines) = inp.rpc.as_deref() else {
        let _ = writeln!(md, "\nNot run: {}.", inp.why_missing("rpc-example"));
        return;
    };
    let _ = writeln!(
        md,
        "\n| channel | argument | calls/s | latency median µs | p99 µs | runs |\n|---|---:|---:|---:|---:|---:|"
    );
    let mut keys: Vec<(String, usize)> = Vec::new();
    for l in lines {
        let k = (l.channel.clone(), l.size);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (ch, size) in keys {
        let sel: Vec<&RpcLine> = lines
            .iter()
            .filter(|l| l.channel == ch && l.size == size)
            .collect();
        let st = |f: fn(&RpcLine) -> f64| {
            let v: Vec<f64> = sel.iter().map(|l| f(l)).collect();
            let (m, lo, hi) = report::stats(&v);
            if v.len() > 1 {
                format!("{} ({}–{})", num(m), num(lo), num(hi))
            } else {
                num(m)
            }
        };
        let _ = writeln!(
            md,
            "| `{ch}` | {} | {} | {} | {} | {} |",
            bytes(size),
            st(|l| l.calls_per_s),
            st(|l| l.median_us),
            st(|l| l.p99_us),
            sel.len()
        );
    }
}

fn engine_section(inp: &Inputs, md: &mut String) {
    let _ = writeln!(
        md,
        "\n### Engine micro-benchmarks (criterion, `benches/engine.rs`)\n"
    );
    let Some(crit) = inp.engine.as_deref() else {
        let _ = writeln!(md, "Not run: {}.", inp.why_missing("engine"));
        return;
    };
    let _ = writeln!(
        md,
        "| benchmark | median time | 95% interval |\n|---|---:|---:|"
    );
    let t = |ns: f64| {
        if ns >= 1e6 {
            format!("{} ms", num(ns / 1e6))
        } else if ns >= 1e3 {
            format!("{} µs", num(ns / 1e3))
        } else {
            format!("{} ns", num(ns))
        }
    };
    for c in crit {
        let _ = writeln!(
            md,
            "| `{}` | {} | {} – {} |",
            c.name,
            t(c.mid),
            t(c.lo),
            t(c.hi)
        );
    }
}

fn suite_title(name: &str) -> String {
    match name {
        "pair" => "Pair suite (`madrun -n 2`)".into(),
        "mr" => "Message rate (`madrun -n 4`)".into(),
        "mpich" => "MPICH job (`mpiexec.mpich -n 2`, `--features bench-mpi`)".into(),
        "openmpi" => "Open MPI job (`mpirun.openmpi -n 2`, `--features bench-mpi`)".into(),
        "ucx" => "UCX job (`madrun -n 2`, `--features bench-ucx`)".into(),
        "mpich-mr" => "MPICH message rate (`mpiexec.mpich -n 4`, `--features bench-mpi`)".into(),
        "openmpi-mr" => {
            "Open MPI message rate (`mpirun.openmpi -n 4`, `--features bench-mpi`)".into()
        }
        other => format!("`{other}`"),
    }
}

fn suites_section(inp: &Inputs, md: &mut String, plots: &mut Vec<Plot>) {
    for s in &inp.suites {
        let _ = writeln!(
            md,
            "\n### {}\n\nPlots (log-log; Madeleine solid, baselines dashed):\n",
            suite_title(&s.name)
        );
        let mut benches: Vec<&str> = Vec::new();
        for r in &s.rows {
            if !benches.contains(&r.bench.as_str()) {
                benches.push(&r.bench);
            }
        }
        benches.sort_by_key(|b| report::bench_rank(b));
        for b in benches {
            if let Some(svg) = report::svg(b, &s.rows) {
                let file = format!("{}-{b}.svg", s.name);
                let _ = writeln!(md, "![{} {b}]({})", s.name, inp.out.join(&file).display());
                plots.push((file, svg));
            }
        }
        md.push_str(&report::markdown(&s.rows));
    }
}

fn steps_md(inp: &Inputs) -> String {
    let mut s = String::new();
    if inp.steps.is_empty() {
        return s;
    }
    s.push_str("\n| step | state | seconds | what |\n|---|---|---:|---|\n");
    for st in &inp.steps {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            st.name,
            if st.state == "ran" {
                st.state.clone()
            } else {
                format!("**{}**", st.state)
            },
            st.secs,
            st.detail.replace('|', "\\|")
        );
    }
    s
}

/// The generated Markdown (everything after the run's header) and the plots to write.
pub fn render(inp: &Inputs) -> (String, Vec<Plot>) {
    let mut md = steps_md(inp);
    let mut plots = Vec::new();
    let _ = writeln!(
        md,
        "\n### Targets\n\n\
         One row per target of the issues, computed from this run's files. Ratio = Madeleine's \
         cost / the baseline's (time over time; the baseline's throughput over Madeleine's), so \
         **above 1 = Madeleine slower**; a bandwidth target \"at least k× the baseline\" is a cost \
         ratio of at most 1/k. Medians of the runs; a figure that could not be measured is \
         \"not run\" with the reason.\n"
    );
    md.push_str(&targets_md(&targets(inp)));
    shm_mpi_section(inp, &mut md, &mut plots);
    mpi_section(inp, &mut md);
    fig4_section(inp, &mut md, &mut plots);
    sisci_section(inp, &mut md, &mut plots);
    ucx_section(inp, &mut md, &mut plots);
    rpc_example_section(inp, &mut md);
    engine_section(inp, &mut md);
    suites_section(inp, &mut md, &mut plots);
    (md, plots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(bench: &str, imp: &str, size: usize, v: f64) -> Row {
        let madeleine = !imp.starts_with("raw") && imp != "memcpy";
        Row {
            bench: bench.into(),
            imp: imp.into(),
            mode: if madeleine {
                "cheaper/cheaper".into()
            } else {
                "-".into()
            },
            size,
            unit: if bench == "bw" { "MB/s" } else { "us" }.into(),
            median: v,
            min: v,
            max: v,
            runs: 3,
            iters: 10,
            baseline: String::new(),
            base_median: f64::NAN,
        }
    }

    fn inputs(suites: Vec<Suite>) -> Inputs {
        Inputs {
            suites,
            steps: vec![Step {
                name: "openmpi".into(),
                state: "not-run".into(),
                secs: "0".into(),
                detail: "mpirun.openmpi not found".into(),
            }],
            engine: None,
            fig4: None,
            rpc: None,
            out: "out".into(),
        }
    }

    fn find<'a>(ts: &'a [Target], what: &str) -> &'a Target {
        ts.iter()
            .find(|t| t.what.contains(what))
            .unwrap_or_else(|| panic!("no target `{what}`"))
    }

    #[test]
    fn shm_against_the_better_mpi_takes_the_worse_ratio() {
        let job = |name: &str, raw: f64| Suite {
            name: name.into(),
            rows: vec![
                row("latency", "shm", 8, 0.30),
                row("latency", "raw-mpi", 8, raw),
                row("latency", "mpi", 8, 0.40),
            ],
        };
        let inp = inputs(vec![job("mpich", 0.40), job("openmpi", 0.32)]);
        let (r, who, _) = shm_vs_mpis(&inp, "latency", 8).expect("ratio");
        assert!((r - 0.30 / 0.32).abs() < 1e-9);
        assert_eq!(who, "Open MPI");
        let ts = targets(&inp);
        let t = find(&ts, "8 B one-way latency: `shm` vs the better MPI");
        assert_eq!(t.verdict, Verdict::NotMet); // 0.9375 > 0.90
        let t = find(&ts, "MPICH: 8 B one-way latency");
        assert_eq!(t.verdict, Verdict::Met);
        let t = find(&ts, "Open MPI: 8 B one-way latency");
        assert_eq!(t.verdict, Verdict::NotMet); // 0.40 / 0.32 = 1.25
    }

    #[test]
    fn a_missing_mpi_makes_the_shm_target_incomplete_with_the_reason() {
        let inp = inputs(vec![Suite {
            name: "mpich".into(),
            rows: vec![
                row("bw", "shm", 4 * MIB, 11_000.0),
                row("bw", "raw-mpi", 4 * MIB, 10_000.0),
            ],
        }]);
        let ts = targets(&inp);
        let t = find(&ts, "4 MiB bandwidth: `shm` vs the better MPI");
        match &t.verdict {
            Verdict::Incomplete(Some(true), why) => assert!(why.contains("mpirun.openmpi")),
            v => panic!("{v:?}"),
        }
        // Nothing from the pair suite: not run, with the reason.
        let t = find(&ts, "`tcp,progress=poll`");
        assert!(matches!(t.verdict, Verdict::Incomplete(None, _)));
    }

    #[test]
    fn bandwidth_targets_use_the_inverse_ratio() {
        let inp = inputs(vec![Suite {
            name: "pair".into(),
            rows: vec![
                row("bw", "tcp,progress=poll", 4 * MIB, 970.0),
                row("bw", "raw-tcp-poll", 4 * MIB, 1000.0),
                row("bw", "tcp,progress=block", 4 * MIB, 960.0),
                row("bw", "raw-tcp-block", 4 * MIB, 1000.0),
                row("bw", "shm", 4 * MIB, 8000.0),
                row("bw", "memcpy", 4 * MIB, 10_000.0),
            ],
        }]);
        let ts = targets(&inp);
        assert_eq!(
            find(&ts, "4 MiB bandwidth: `tcp,progress=poll`").verdict,
            Verdict::Met
        );
        assert_eq!(
            find(&ts, "4 MiB bandwidth: `tcp,progress=block`").verdict,
            Verdict::NotMet
        );
        assert_eq!(find(&ts, "single-thread `memcpy`").verdict, Verdict::Met);
    }

    #[test]
    fn sweep_target_reports_the_worst_size_and_coverage() {
        let mut rows = Vec::new();
        for (i, s) in [0usize, 1, 1 << 24].into_iter().enumerate() {
            rows.push(row("latency", "shm", s, 1.0 + i as f64 * 0.1));
            rows.push(row("latency", "raw-mpi", s, 1.0));
        }
        let job = |n: &str| Suite {
            name: n.into(),
            rows: rows.clone(),
        };
        let ts = targets(&inputs(vec![job("mpich"), job("openmpi")]));
        let t = find(&ts, "every size 0 B – 16 MiB, one-way latency");
        assert_eq!(t.verdict, Verdict::NotMet);
        assert!(t.measured.contains("worst at 16 MiB"), "{}", t.measured);
        assert_eq!(t.ratio, "1.200");
    }

    #[test]
    fn large_shm_rows_take_the_worst_size_against_the_better_mpi_and_sisci() {
        let mpi = |name: &str, lat: f64| {
            let mut rows = Vec::new();
            for k in 0..5 {
                let s = MIB << k;
                rows.push(row("latency", "shm", s, 50.0));
                rows.push(row(
                    "latency",
                    "raw-mpi",
                    s,
                    if k == 2 { lat } else { 200.0 },
                ));
                rows.push(row("bw", "shm", s, 30_000.0));
                rows.push(row("bw", "raw-mpi", s, 10_000.0));
            }
            Suite {
                name: name.into(),
                rows,
            }
        };
        let mut ucx = Vec::new();
        for k in 0..5 {
            let s = MIB << k;
            ucx.push(row("latency", "shm", s, 50.0));
            ucx.push(row(
                "latency",
                "sisci:local",
                s,
                if k == 4 { 40.0 } else { 60.0 },
            ));
            ucx.push(row("bw", "shm", s, 30_000.0));
            ucx.push(row("bw", "sisci:local", s, 29_000.0));
        }
        let mut inp = inputs(vec![
            mpi("mpich", 200.0),
            mpi("openmpi", 70.0),
            Suite {
                name: "ucx".into(),
                rows: ucx,
            },
        ]);
        inp.steps.clear();
        let ts = targets(&inp);
        // 50 / 70 at 4 MiB against Open MPI: over 0.6.
        let t = find(&ts, "1–16 MiB one-way latency: `shm` vs the better MPI");
        assert_eq!(t.verdict, Verdict::NotMet);
        assert!(t.measured.contains("worst at 4 MiB (vs"), "{}", t.measured);
        assert_eq!(
            find(&ts, "1–16 MiB bandwidth: `shm` vs the better MPI").verdict,
            Verdict::Met
        );
        let t = find(&ts, "1–16 MiB one-way latency: `shm` vs `sisci:local`");
        assert_eq!((t.ratio.as_str(), &t.verdict), ("1.250", &Verdict::NotMet));
        assert!(t.measured.contains("worst at 16 MiB"), "{}", t.measured);
        assert_eq!(
            find(&ts, "1–16 MiB bandwidth: `shm` vs `sisci:local`").verdict,
            Verdict::Met
        );
    }

    #[test]
    fn ucx_targets_sweep_every_size_against_the_same_transport() {
        let mut rows = Vec::new();
        for s in [0usize, 8, 4 * MIB, 16 * MIB] {
            rows.push(row("latency", "shm", s, if s == 8 { 1.2 } else { 0.9 }));
            rows.push(row("latency", "raw-ucx-shm", s, 1.0));
            rows.push(row("latency", "tcp", s, 0.5));
            rows.push(row("latency", "raw-ucx-tcp", s, 1.0));
        }
        for s in [1usize, 8, 4 * MIB] {
            rows.push(row("bw", "shm", s, 2000.0));
            rows.push(row("bw", "raw-ucx-shm", s, 1000.0));
        }
        let inp = inputs(vec![Suite {
            name: "ucx".into(),
            rows,
        }]);
        let ts = targets(&inp);
        let t = find(&ts, "one-way latency: `shm` vs UCX");
        assert_eq!(t.verdict, Verdict::NotMet);
        assert_eq!(t.ratio, "1.200");
        assert!(t.measured.contains("worst at 8 B"), "{}", t.measured);
        assert_eq!(
            find(&ts, "one-way latency: `tcp` vs UCX").verdict,
            Verdict::Met
        );
        // Bandwidth is an inverse ratio; the sweep stopped at 4 MiB.
        match &find(&ts, "bandwidth: `shm` vs UCX").verdict {
            Verdict::Incomplete(Some(true), why) => assert!(why.contains("4 MiB"), "{why}"),
            v => panic!("{v:?}"),
        }
        // No sisci:local rows: not run, with the reason.
        assert!(matches!(
            find(&ts, "one-way latency: `sisci:local` vs UCX").verdict,
            Verdict::Incomplete(None, _)
        ));
        let (md, plots) = render(&inp);
        assert!(md.contains("against UCX"));
        assert!(plots.iter().any(|(f, _)| f == "ucx-latency.svg"));
    }

    #[test]
    fn criterion_output_is_parsed_with_long_names_on_their_own_line() {
        let text = "Benchmarking pack_null/1: Warming up for 3.0000 s\n\
pack_null/1             time:   [78.100 ns 79.000 ns 80.200 ns]\n\
                        thrpt:  [12.469 Melem/s 12.658 Melem/s 12.804 Melem/s]\n\
pack_null/16            time:   [271.00 ns 274.00 ns 280.00 ns]\n\
                        change: [-1.0% +0.5% +2.0%] (p = 0.50 > 0.05)\n\
bmm/a_rather_long_benchmark_name\n\
                        time:   [1.5000 µs 1.6000 µs 1.7000 µs]\n";
        let c = parse_criterion(text);
        assert_eq!(c.len(), 3, "{c:?}");
        assert_eq!(c[0].name, "pack_null/1");
        assert_eq!(c[2].name, "bmm/a_rather_long_benchmark_name");
        assert!((c[2].mid - 1600.0).abs() < 1e-6);
        let inp = Inputs {
            engine: Some(c),
            ..inputs(Vec::new())
        };
        let t = targets(&inp);
        let e = find(&t, "engine overhead");
        assert_eq!(e.verdict, Verdict::Met); // (274 - 79) / 15 = 13 ns
        assert_eq!(e.ratio, "13.0 ns");
    }

    #[test]
    fn figure4_and_rpc_example_outputs_are_parsed() {
        let csv = "variant,spec,size,rep,one_way_us\n\
copy,\"via:soft,regcache=0,tm.small=max\",8,0,10.0\n\
register,\"via:soft,regcache=0,tm.small=0,tm.medium=max\",8,0,20.0\n\
rdma,\"via:soft,regcache=0,tm.small=0,tm.medium=0\",8,0,30.0\n\
adaptive,\"via:soft,regcache=0\",8,0,10.4\n\
adaptive+cache,\"via:soft,regcache=64\",8,0,9.0\n\
adaptive+tune,\"via:soft,regcache=0,tune=auto\",8,0,10.6\n";
        let f = parse_fig4(csv).expect("parses");
        assert_eq!(f.len(), 6);
        let inp = Inputs {
            fig4: Some(f),
            ..inputs(Vec::new())
        };
        let t = targets(&inp);
        assert_eq!(find(&t, "Figure 4").verdict, Verdict::Met);
        assert_eq!(find(&t, "Figure 4").ratio, "1.040");
        assert_eq!(find(&t, "tune=auto").ratio, "1.060");
        assert_eq!(find(&t, "tune=auto").verdict, Verdict::NotMet);

        let out = "== rpc channel=tcp run=1\n\
rank 1 (4 threads, `tcp`):       8 B args:    39008 calls/s, latency median     94.0 µs, p99    310.9 µs (8000 calls)\n\
rank 0 (server, 2 workers, `tcp`): 16802 calls served, 8 refused, 0.9 s\n\
rank 1 (4 threads, `tcp`): 1048576 B args:     1292 calls/s, latency median   2686.8 µs, p99   7568.0 µs (400 calls)\n";
        let l = parse_rpc_example(out);
        assert_eq!(l.len(), 2);
        assert_eq!(
            l[1],
            RpcLine {
                channel: "tcp".into(),
                run: 1,
                size: 1 << 20,
                calls_per_s: 1292.0,
                median_us: 2686.8,
                p99_us: 7568.0
            }
        );
    }

    #[test]
    fn render_says_why_things_did_not_run() {
        let (md, plots) = render(&inputs(Vec::new()));
        assert!(md.contains("### Targets"));
        assert!(md.contains("mpirun.openmpi not found"), "{md}");
        assert!(md.contains("not run ("));
        assert!(plots.is_empty());
    }
}
