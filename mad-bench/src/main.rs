//! `mad-bench`: the cross-process benchmark tool of madeleine-rs (see `BENCHMARKS.md` and
//! `mad-bench --help`).
//!
//! Two processes (under `madrun -n 2`, `mpiexec -n 2`, or started by itself when run alone)
//! run latency, bandwidth, bidirectional bandwidth, multi-threaded latency and RPC over every
//! channel type of this build, beside raw baselines measured in the same run; four or more
//! processes run the message-rate test (`osu_mbw_mr`). `mad-bench report` turns CSV files
//! into Markdown tables and SVG plots.

#![deny(unsafe_code)]

mod net;
mod patterns;
#[cfg(feature = "bench-mpi")]
mod rawmpi;
#[cfg(feature = "bench-ucx")]
mod rawucx;
mod report;
mod summary;
mod sys;

use std::path::PathBuf;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::cli::{self, Arg, Cli};
use mad_core::config::parse_size;
use mad_core::{Error, Result, Session};

use net::{AsyncNet, DriverNet, MadNet, Mode, Net, RawFlag, RawShm, RawTcp, Wait};
use patterns::Counts;
use report::Row;

const USAGE: &str = "\
usage: mad-bench [run] [options]         (under madrun/mpiexec, or alone: starts 2 ranks)
       mad-bench report --out DIR [--status F] [--engine F] [--fig4 F] [--rpc-example F] CSV...
                                         (targets table, comparisons, Markdown tables and SVG
                                         plots of one run: DIR/results.md, DIR/*.svg)

options of run:
  --quick              iteration counts / 100, byte budget / 100, one run, sizes
                       up to 1 MiB (CI smoke test; --max after --quick overrides)
  --div N              divide iteration counts by N
  --runs N             runs per figure (median and min-max reported; default 3)
  --max SIZE           largest message (default 4m)
  --min SIZE           smallest message (default 0 or 1 B, by benchmark)
  --budget SIZE        at most this many bytes per direction per measurement (default 256m)
  --time SECONDS       about this long per measurement (default 0.1): the OSU count
                       is lowered from a calibration run (the count used is in the CSV)
  --bench LIST         latency,bw,bibw,latency_mt,rpc (2 ranks; the default) and
                       cpu_send,cpu_recv (processor time per message of one side, bursts of 32,
                       sizes up to 256 B), poll (processor time of one poll that finds
                       nothing) / mbw_mr (4+ ranks)
  --channels LIST      Madeleine channel specs separated by ';' (default
                       'tcp,progress=poll;tcp,progress=block;tcp;shm;via:soft;sisci:local'
                       [+ ';mpi' with --features mpi]); any driver of the build: also uds,
                       and mem with --threads
  --baselines LIST     raw-tcp-poll,raw-tcp-block,raw-shm,memcpy (the default); raw-flag (a
                       one-message polled mailbox per direction: one copy in, one flag, one copy
                       out); raw-mpi, raw-mpi-packed (RPC only), raw-mpi-test (MPI_Irecv +
                       MPI_Test loop) when built with --features bench-mpi and started by
                       mpiexec; raw-ucx-shm,raw-ucx-tcp (UCP tag API, busy-polling; in the
                       default list) when built with --features bench-ucx
  --drivers LIST       channel specs separated by ';' whose driver runs without the engine
                       (its links through the driver contract, busy-polling; rows
                       `driver:SPEC`; default none)
  --modes LIST         mode pairs: cheaper, safer, and/or a number K >= 2 (the message in K
                       CHEAPER pieces). Default: cheaper,safer,16 on the tcp and shm channels
                       without progress=, cheaper on the others; given: on every channel
  --no-pin             do not pin ranks to cores
  --csv FILE           append the figures to FILE
  -n N                 ranks to start when run alone (default 2)
  --threads            the ranks are threads of this process (-n of them), not processes

Options take their value as `--opt value` or `--opt=value`; a lone `--` is skipped.
  -h, --help           this text
  -V, --version        the version";

struct Opts {
    div: usize,
    runs: usize,
    min: usize,
    max: usize,
    budget: usize,
    time_budget: f64,
    benches: Vec<String>,
    channels: Vec<String>,
    baselines: Vec<String>,
    drivers: Vec<String>,
    modes: Vec<Mode>,
    /// `--modes` was given: its modes apply to every channel.
    modes_given: bool,
    pin: bool,
    threads: bool,
    csv: Option<PathBuf>,
    ranks: usize,
}

/// The command line of `mad-bench` and `mad-bench report`.
const CLI: Cli = Cli::new("mad-bench", env!("CARGO_PKG_VERSION"), USAGE);

/// The options of `mad-bench [run]` (without the program name; a leading `run` and a lone
/// `--` are skipped).
fn parse_opts(args: &[String]) -> std::result::Result<Opts, cli::Error> {
    let mut o = Opts {
        div: 1,
        runs: 3,
        min: 0,
        max: 4 << 20,
        budget: 256 << 20,
        time_budget: 0.1,
        benches: Vec::new(),
        channels: default_channels(),
        baselines: default_baselines(),
        drivers: Vec::new(),
        modes: vec![Mode::Cc, Mode::Se, Mode::Pieces(16)],
        modes_given: false,
        pin: true,
        threads: false,
        csv: None,
        ranks: 2,
    };
    cli::parse_from(args, |p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Value(v) if v == "run" => {}
                Arg::Long("quick") => {
                    o.div = 100;
                    o.budget /= 100;
                    o.time_budget = 0.02;
                    o.runs = 1;
                    o.max = o.max.min(1 << 20);
                }
                Arg::Long("div") => o.div = cli::positive(p, "--div")?,
                Arg::Long("runs") => o.runs = cli::positive(p, "--runs")?,
                Arg::Short('n') => {
                    o.ranks = cli::value_with(p, "-n", "a number of ranks (2 or more)", |v| {
                        v.parse().ok().filter(|&d: &usize| d >= 2)
                    })?
                }
                Arg::Long("max") => o.max = cli::size(p, "--max")?,
                Arg::Long("min") => o.min = cli::size(p, "--min")?,
                Arg::Long("budget") => {
                    o.budget = cli::value_with(p, "--budget", "a size greater than 0", |v| {
                        parse_size(v).filter(|&b| b > 0)
                    })?
                }
                Arg::Long("time") => {
                    o.time_budget = cli::value_with(p, "--time", "a number of seconds", |v| {
                        v.parse().ok().filter(|&t: &f64| t > 0.0 && t.is_finite())
                    })?
                }
                Arg::Long("bench") => o.benches = list(&cli::string(p)?, ','),
                Arg::Long("channels") => o.channels = list(&cli::string(p)?, ';'),
                Arg::Long("baselines") => o.baselines = list(&cli::string(p)?, ','),
                Arg::Long("drivers") => o.drivers = list(&cli::string(p)?, ';'),
                Arg::Long("modes") => {
                    o.modes = cli::value_with(p, "--modes", "cheaper, safer and/or K >= 2", |v| {
                        list(v, ',')
                            .iter()
                            .map(|m| Mode::parse(m))
                            .collect::<Option<Vec<_>>>()
                    })?;
                    if !o.modes.contains(&Mode::Cc) {
                        o.modes.insert(0, Mode::Cc);
                    }
                    o.modes_given = true;
                }
                Arg::Long("threads") => o.threads = true,
                Arg::Long("no-pin") => o.pin = false,
                Arg::Long("csv") => o.csv = Some(PathBuf::from(p.value()?)),
                other => CLI.other(other)?,
            }
        }
        Ok(())
    })?;
    Ok(o)
}

fn list(s: &str, sep: char) -> Vec<String> {
    s.split(sep)
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(String::from)
        .collect()
}

fn default_baselines() -> Vec<String> {
    #[allow(unused_mut)]
    let mut v: Vec<String> = ["raw-tcp-poll", "raw-tcp-block", "raw-shm", "memcpy"]
        .map(String::from)
        .to_vec();
    #[cfg(feature = "bench-ucx")]
    v.extend(["raw-ucx-shm", "raw-ucx-tcp"].map(String::from));
    v
}

fn default_channels() -> Vec<String> {
    #[allow(unused_mut)]
    let mut v: Vec<String> = [
        "tcp,progress=poll",
        "tcp,progress=block",
        "tcp",
        "shm",
        "via:soft",
    ]
    .map(String::from)
    .to_vec();
    #[cfg(feature = "sisci")]
    v.push("sisci:local".into());
    #[cfg(feature = "mpi")]
    v.push("mpi".into());
    v
}

/// The raw baseline a Madeleine channel is compared with.
fn baseline_of(spec: &str) -> &'static str {
    if spec.contains("progress=block") {
        "raw-tcp-block"
    } else if spec.starts_with("mpi") && cfg!(feature = "bench-mpi") {
        "raw-mpi"
    } else if spec.starts_with("shm")
        || spec.starts_with("mpi")
        || spec.starts_with("mem")
        || spec.starts_with("sisci")
    {
        "raw-shm"
    } else {
        "raw-tcp-poll"
    }
}

fn main() {
    madeleine::init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = if args.first().map(String::as_str) == Some("report") {
        let r = parse_report(&args[1..]).unwrap_or_else(|e| CLI.fail(e));
        report_cmd(r)
    } else {
        let o = parse_opts(&args).unwrap_or_else(|e| CLI.fail(e));
        run_cmd(o)
    };
    if let Err(e) = r {
        eprintln!("mad-bench: {e}");
        std::process::exit(1);
    }
}

/// The options of `mad-bench report`.
struct Report {
    out: PathBuf,
    files: Vec<PathBuf>,
    status: Option<PathBuf>,
    engine: Option<PathBuf>,
    fig4: Option<PathBuf>,
    rpc: Option<PathBuf>,
}

fn parse_report(args: &[String]) -> std::result::Result<Report, cli::Error> {
    let mut r = Report {
        out: PathBuf::from("bench/results"),
        files: Vec::new(),
        status: None,
        engine: None,
        fig4: None,
        rpc: None,
    };
    cli::parse_from(args, |p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("out") => r.out = p.value()?.into(),
                Arg::Long("status") => r.status = Some(p.value()?.into()),
                Arg::Long("engine") => r.engine = Some(p.value()?.into()),
                Arg::Long("fig4") => r.fig4 = Some(p.value()?.into()),
                Arg::Long("rpc-example") => r.rpc = Some(p.value()?.into()),
                Arg::Value(f) => r.files.push(f.into()),
                other => CLI.other(other)?,
            }
        }
        Ok(())
    })?;
    Ok(r)
}

fn report_cmd(r: Report) -> Result<()> {
    let Report {
        out,
        files,
        status,
        engine,
        fig4,
        rpc,
    } = r;
    // An optional input that is absent means "not run" (the status file says why).
    let read = |p: &Option<PathBuf>| -> Result<Option<String>> {
        match p {
            Some(p) if p.exists() => std::fs::read_to_string(p)
                .map(Some)
                .map_err(|e| Error::io(format!("reading {}", p.display()), e)),
            _ => Ok(None),
        }
    };
    let mut suites = Vec::new();
    for f in &files {
        let name = f
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        suites.push(summary::Suite {
            name,
            rows: report::read_csv(f)?,
        });
    }
    let inputs = summary::Inputs {
        suites,
        steps: read(&status)?
            .map(|t| summary::parse_status(&t))
            .unwrap_or_default(),
        engine: read(&engine)?
            .map(|t| summary::parse_criterion(&t))
            .filter(|c| !c.is_empty()),
        fig4: read(&fig4)?
            .map(|t| summary::parse_fig4(&t))
            .transpose()?
            .filter(|f| !f.is_empty()),
        rpc: read(&rpc)?
            .map(|t| summary::parse_rpc_example(&t))
            .filter(|l| !l.is_empty()),
        out: out.clone(),
    };
    std::fs::create_dir_all(&out)
        .map_err(|e| Error::io(format!("creating {}", out.display()), e))?;
    let (md, plots) = summary::render(&inputs);
    for (name, svg) in plots {
        let p = out.join(name);
        std::fs::write(&p, svg).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    }
    let p = out.join("results.md");
    std::fs::write(&p, md).map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
    println!("wrote {} and the plots in {}", p.display(), out.display());
    Ok(())
}

fn run_cmd(o: Opts) -> Result<()> {
    if o.threads {
        on_threads(o.ranks, |s| run_rank(s, &o))?;
        return Ok(());
    }
    if let Some(code) = madeleine::run_local_if_alone(o.ranks)? {
        std::process::exit(code);
    }
    run_rank(&madeleine::session()?, &o)
}

/// Run `f` on every rank of an `n`-rank session whose ranks are threads of this process (a
/// thread bootstrap; the channels are as real as between processes); each rank's result, in
/// rank order.
fn on_threads<T: Send>(n: usize, f: impl Fn(&Session) -> Result<T> + Sync) -> Result<Vec<T>> {
    std::thread::scope(|sc| {
        let f = &f;
        let hs: Vec<_> = ThreadBootstrap::group(n)
            .into_iter()
            .map(|b| {
                sc.spawn(move || {
                    let s = madeleine::builder().bootstrap(Box::new(b)).build()?;
                    f(&s)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| Error::BadConfig("mad-bench: a rank thread panicked".into()))?
            })
            .collect()
    })
}

/// One rank's part of `mad-bench run`.
fn run_rank(session: &Session, o: &Opts) -> Result<()> {
    let (me, n) = (session.rank(), session.size());
    let cores = sys::cpu_count();
    let local = session.bootstrap().local_ranks();
    let pin_core = if o.pin && local.len() <= cores {
        local.iter().position(|&r| r == me)
    } else {
        None
    };
    if let Some(c) = pin_core {
        sys::pin(Some(c))?;
    }
    if me == 0 {
        println!(
            "mad-bench: {n} ranks, {cores} cores, pinned: {}, runs {}, iterations / {}, budget {} B, drivers {:?}",
            pin_core.is_some(),
            o.runs,
            o.div,
            o.budget,
            session.driver_names()
        );
    }
    let rows = if n == 2 {
        pair_suite(session, o, pin_core)?
    } else if n >= 4 && n % 2 == 0 {
        mr_suite(session, o)?
    } else {
        return Err(Error::BadConfig(format!(
            "mad-bench runs with 2 ranks (pair suite) or an even number >= 4 (message rate), not {n}"
        )));
    };
    if me == 0 {
        if let Some(p) = &o.csv {
            report::append_csv(p, &rows)?;
            println!("\nappended {} rows to {}", rows.len(), p.display());
        }
    }
    session.bootstrap().barrier("bench/done")?;
    Ok(())
}

/// OSU iteration counts: 10 000 + 100 warm-up up to 8 KiB, 1 000 + 10 above; divided by
/// `div`; capped so a measurement moves at most `budget` bytes per direction.
fn lat_counts(o: &Opts, size: usize) -> Counts {
    let (iters, warm) = if size <= 8192 {
        (10_000, 100)
    } else {
        (1_000, 10)
    };
    let cap = (o.budget / size.max(1)).max(2);
    Counts {
        iters: (iters / o.div).clamp(2, cap.max(2)),
        warm: (warm / o.div).max(1),
    }
}

/// OSU bandwidth loop counts: 100 + 10 windows up to 8 KiB, 20 + 2 above; same scaling.
fn bw_counts(o: &Opts, size: usize) -> Counts {
    let (iters, warm) = if size <= 8192 { (100, 10) } else { (20, 2) };
    let cap = (o.budget / (size.max(1) * patterns::WINDOW)).max(1);
    Counts {
        iters: (iters / o.div).clamp(1, cap.max(1)),
        warm: (warm / o.div).max(1),
    }
}

/// Seconds one timed iteration of `bench` takes, from the figure it reported.
fn secs_per_iter(bench: &str, size: usize, v: f64) -> f64 {
    let bytes = (size.max(1) * patterns::WINDOW) as f64;
    match bench {
        "latency" | "latency_mt" => 2.0 * v * 1e-6,
        "rpc" => v * 1e-6,
        "bibw" => 2.0 * bytes / (v * 1e6),
        _ => bytes / (v * 1e6),
    }
}

/// The figure `bench` reports for one timed iteration of `secs` seconds (inverse of
/// [`secs_per_iter`]).
fn from_secs_per_iter(bench: &str, size: usize, secs: f64) -> f64 {
    let bytes = (size.max(1) * patterns::WINDOW) as f64;
    match bench {
        "latency" | "latency_mt" => secs / 2.0 * 1e6,
        "rpc" => secs * 1e6,
        "bibw" => 2.0 * bytes / (secs * 1e6),
        _ => bytes / (secs * 1e6),
    }
}

/// The iteration count that fits the time budget, between 2 and the OSU count.
fn fit(o: &Opts, secs_per_iter: f64, osu: usize) -> usize {
    if !(secs_per_iter.is_finite() && secs_per_iter > 0.0) {
        return osu;
    }
    ((o.time_budget / secs_per_iter) as usize).clamp(2.min(osu), osu)
}

/// Every rank adopts rank 0's value (one allgather per measurement).
fn agree(session: &Session, seq: usize, mine: usize) -> Result<usize> {
    let all = session
        .bootstrap()
        .allgather(&format!("bench/n/{seq}"), &(mine as u64).to_le_bytes())?;
    all.first()
        .and_then(|v| v.as_slice().try_into().ok())
        .map(|b| u64::from_le_bytes(b) as usize)
        .ok_or_else(|| Error::protocol(0, "bench: bad iteration count"))
}

fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    if min == 0 {
        v.push(0);
    }
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        s *= 2;
    }
    v
}

/// One endpoint of an implementation (`None` for memcpy, which needs no peer).
type Endpoint = Option<Box<dyn Net>>;

/// One implementation under test: two endpoints (for the two-thread patterns).
struct Imp {
    name: String,
    mode: Option<Mode>,
    baseline: Option<&'static str>,
    a: Endpoint,
    b: Endpoint,
    /// The second thread's endpoint in `latency_mt` when it differs from `b` (Madeleine: the
    /// same channel as `a`; raw baselines use their second connection `b`).
    mt: Endpoint,
    /// The only benchmarks this implementation runs (`None`: all).
    only: Option<&'static [&'static str]>,
}

impl Imp {
    fn mode_name(&self) -> String {
        self.mode.map_or("-".into(), Mode::name)
    }
}

fn open_imps(session: &Session, o: &Opts) -> Result<Vec<Imp>> {
    let mut v = Vec::new();
    for (i, spec) in o.channels.iter().enumerate() {
        if let Some(inner) = spec.strip_prefix("async:") {
            // The tokio adapter over the same kind of channel, one mode pair.
            let a = MadNet::open(session, &format!("bench{i}a"), inner, Mode::Cc)?;
            let b = MadNet::open(session, &format!("bench{i}b"), inner, Mode::Cc)?;
            v.push(Imp {
                name: spec.clone(),
                mode: Some(Mode::Cc),
                baseline: Some(baseline_of(inner)),
                a: Some(Box::new(AsyncNet::new(&a)?)),
                b: Some(Box::new(AsyncNet::new(&b)?)),
                mt: None,
                only: Some(&["latency", "bw", "rpc"]),
            });
            continue;
        }
        let a = MadNet::open(session, &format!("bench{i}a"), spec, Mode::Cc)?;
        let b = MadNet::open(session, &format!("bench{i}b"), spec, Mode::Cc)?;
        let base = Some(baseline_of(spec));
        // The other mode pairs on the default-progress tcp and shm channels only (time).
        let head = spec.split(',').next().unwrap_or("");
        let modes =
            if o.modes_given || (head == "tcp" || head == "shm") && !spec.contains("progress=") {
                o.modes.clone()
            } else {
                vec![Mode::Cc]
            };
        for m in modes {
            v.push(Imp {
                name: spec.clone(),
                mode: Some(m),
                baseline: base,
                a: Some(Box::new(a.with_mode(m))),
                b: Some(Box::new(b.with_mode(m))),
                mt: Some(Box::new(a.with_mode(m))),
                only: None,
            });
        }
    }
    for (i, raw) in o.baselines.iter().enumerate() {
        let (a, b): (Endpoint, Endpoint) = match raw.as_str() {
            "raw-tcp-poll" | "raw-tcp-block" => {
                let w = if raw.ends_with("poll") {
                    Wait::Poll
                } else {
                    Wait::Block
                };
                let a = RawTcp::open(session, &format!("raw{i}a"), w)?;
                debug_assert_eq!(a.wait(), w);
                (
                    Some(Box::new(a)),
                    Some(Box::new(RawTcp::open(session, &format!("raw{i}b"), w)?)),
                )
            }
            "raw-shm" => (
                Some(Box::new(RawShm::open(session, &format!("raw{i}a"))?)),
                Some(Box::new(RawShm::open(session, &format!("raw{i}b"))?)),
            ),
            "raw-flag" => (
                Some(Box::new(RawFlag::open(session, &format!("raw{i}a"), o.max)?)),
                Some(Box::new(RawFlag::open(session, &format!("raw{i}b"), o.max)?)),
            ),
            "memcpy" => (None, None),
            #[cfg(feature = "bench-mpi")]
            "raw-mpi" | "raw-mpi-packed" | "raw-mpi-test" => {
                let (idiom, wait) = match raw.as_str() {
                    "raw-mpi" => (rawmpi::RpcIdiom::TwoMessages, rawmpi::RecvWait::Blocking),
                    "raw-mpi-test" => (rawmpi::RpcIdiom::TwoMessages, rawmpi::RecvWait::Test),
                    _ => (rawmpi::RpcIdiom::Packed, rawmpi::RecvWait::Blocking),
                };
                (
                    Some(Box::new(rawmpi::RawMpi::open(idiom, wait)?)),
                    Some(Box::new(rawmpi::RawMpi::open(idiom, wait)?)),
                )
            }
            #[cfg(feature = "bench-ucx")]
            "raw-ucx-shm" | "raw-ucx-tcp" => {
                let t = if raw == "raw-ucx-shm" {
                    rawucx::Transport::Shm
                } else {
                    rawucx::Transport::Tcp
                };
                // Collective and agreed on every rank: a UCX that cannot start here drops the
                // baseline, not the run.
                let opened = rawucx::RawUcx::open(session, &format!("raw{i}a"), t).and_then(|a| {
                    Ok((a, rawucx::RawUcx::open(session, &format!("raw{i}b"), t)?))
                });
                match opened {
                    Ok((a, b)) => (Some(Box::new(a)), Some(Box::new(b))),
                    Err(e @ Error::Unavailable { .. }) => {
                        if session.rank() == 0 {
                            eprintln!("mad-bench: baseline {raw} left out: {e}");
                        }
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            #[cfg(not(feature = "bench-ucx"))]
            "raw-ucx-shm" | "raw-ucx-tcp" => {
                return Err(Error::BadConfig(format!(
                    "mad-bench: baseline `{raw}` needs a build with --features bench-ucx (and libucx-dev)"
                )))
            }
            other => {
                return Err(Error::BadConfig(format!(
                    "mad-bench: unknown baseline `{other}`"
                )))
            }
        };
        v.push(Imp {
            name: raw.clone(),
            mode: None,
            baseline: None,
            a,
            b,
            mt: None,
            only: match raw.as_str() {
                // The packed RPC idiom differs from raw-mpi in RPC only.
                "raw-mpi-packed" => Some(&["rpc"][..]),
                "raw-flag" => Some(&FLAG_BENCHES[..]),
                _ => None,
            },
        });
    }
    for (i, spec) in o.drivers.iter().enumerate() {
        v.push(Imp {
            name: format!("driver:{spec}"),
            mode: None,
            baseline: None,
            a: Some(Box::new(DriverNet::open(
                session,
                &format!("drv{i}a"),
                spec,
            )?)),
            b: Some(Box::new(DriverNet::open(
                session,
                &format!("drv{i}b"),
                spec,
            )?)),
            mt: None,
            only: None,
        });
    }
    Ok(v)
}

fn pattern_wants(bench: &str, imp: &Imp) -> bool {
    if imp.only.is_some_and(|o| !o.contains(&bench)) {
        return false;
    }
    match (bench, imp.mode) {
        ("latency", _) => true,
        ("bw", Some(Mode::Cc) | None) => true,
        (_, Some(Mode::Cc)) => true,
        (_, None) => imp.a.is_some(),
        _ => false,
    }
}

/// The benchmarks of the pair suite run by default.
const PAIR_BENCHES: [&str; 5] = ["latency", "bw", "bibw", "latency_mt", "rpc"];

/// The benchmarks of the pair suite run only on request (`--bench`).
const ON_REQUEST: [&str; 3] = ["cpu_send", "cpu_recv", "poll"];

/// What `raw-flag` runs: a burst waits for each message to be taken, not what the cpu
/// patterns time.
const FLAG_BENCHES: [&str; 6] = ["latency", "bw", "bibw", "latency_mt", "rpc", "poll"];

fn pair_suite(session: &Session, o: &Opts, pin_core: Option<usize>) -> Result<Vec<Row>> {
    let me = session.rank();
    let peer = 1 - me;
    let init = me == 0;
    let mut imps = open_imps(session, o)?;
    let benches: Vec<&str> = if o.benches.is_empty() {
        PAIR_BENCHES.to_vec()
    } else {
        PAIR_BENCHES
            .iter()
            .chain(&ON_REQUEST)
            .copied()
            .filter(|b| o.benches.iter().any(|x| x == b))
            .collect()
    };
    let big = o.max.max(16);
    let s0: Vec<u8> = (0..big).map(|i| (i * 7 + 1) as u8).collect();
    let s1 = s0.clone();
    let mut r0 = vec![0u8; big];
    let mut r1 = vec![0u8; big];
    let mut rows = Vec::new();
    let mut seq = 0usize;
    for bench in benches {
        let started = std::time::Instant::now();
        let threaded = bench == "bibw" || bench == "latency_mt";
        if threaded && pin_core.is_some() {
            sys::pin(None)?;
        }
        let szs = match bench {
            "latency" | "latency_mt" => sizes(o.min, o.max),
            "rpc" => sizes(o.min, o.max.min(1 << 20)),
            // Small messages: a burst of 32 must fit what the transport buffers without the
            // receiver (or cpu_send waits for it, and cpu_recv's sender stalls).
            "cpu_send" | "cpu_recv" => sizes(0, o.max.min(256)),
            // Nothing is sent.
            "poll" => vec![0],
            _ => sizes(o.min.max(1), o.max),
        };
        let mut bench_rows = Vec::new();
        for &size in &szs {
            let c = if bench == "bw" || bench == "bibw" {
                bw_counts(o, size)
            } else {
                lat_counts(o, size)
            };
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); imps.len()];
            let mut used = vec![0usize; imps.len()];
            for _run in 0..o.runs {
                for (k, imp) in imps.iter_mut().enumerate() {
                    if !pattern_wants(bench, imp) || imp.mode.is_some_and(|m| size < m.min_size()) {
                        continue;
                    }
                    let Imp { a, b, mt, .. } = imp;
                    let v = match (a.as_deref_mut(), b.as_deref_mut()) {
                        (None, _) | (_, None) => {
                            // memcpy: this process alone.
                            if !init || !(bench == "latency" || bench == "bw") {
                                continue;
                            }
                            // Copies are counted like ping-pong iterations in both benchmarks
                            // (a window count would time a single copy of a large size).
                            let c = lat_counts(o, size);
                            let cal = Counts {
                                warm: 1,
                                iters: c.warm.clamp(1, c.iters),
                            };
                            let per = patterns::memcpy(size, cal, &s0, &mut r0) * 1e-6;
                            let iters = fit(o, per, c.iters);
                            used[k] = used[k].max(iters);
                            let t = patterns::memcpy(size, Counts { warm: 0, iters }, &s0, &mut r0);
                            if bench == "latency" {
                                t
                            } else {
                                size as f64 / t
                            }
                        }
                        (Some(a), Some(_)) if bench == "poll" => {
                            let mut sync = || {
                                seq += 1;
                                session.bootstrap().barrier(&format!("bench/poll/{seq}"))
                            };
                            // Polls are short: a hundred per ping-pong iteration of the count.
                            let c = Counts {
                                warm: c.warm,
                                iters: c.iters * 100,
                            };
                            match patterns::poll(a, peer, init, c, &mut sync)? {
                                Some(v) => {
                                    used[k] = used[k].max(c.iters);
                                    v
                                }
                                None => continue,
                            }
                        }
                        (Some(a), Some(_)) if bench.starts_with("cpu_") => {
                            // Bursts, not calibrated (a meeting between bursts is most of
                            // their time); every rank computes the same count.
                            let side = if bench == "cpu_send" {
                                patterns::Side::Send
                            } else {
                                patterns::Side::Recv
                            };
                            let bursts = (c.iters / patterns::BURST).max(2);
                            used[k] = used[k].max(bursts);
                            let mut sync = || {
                                seq += 1;
                                session.bootstrap().barrier(&format!("bench/cpu/{seq}"))
                            };
                            let c = Counts {
                                warm: 1,
                                iters: bursts,
                            };
                            patterns::cpu(a, peer, init, side, size, c, &s0, &mut r0, &mut sync)?
                        }
                        (Some(a), Some(b)) => {
                            // latency_mt: Madeleine's two threads share one channel.
                            let b = match mt.as_deref_mut() {
                                Some(m) if bench == "latency_mt" => m,
                                _ => b,
                            };
                            let mut go = |c: Counts| -> Result<f64> {
                                let bufs = [(&s0[..], &mut r0[..]), (&s1[..], &mut r1[..])];
                                match bench {
                                    "latency" => patterns::latency(
                                        a, peer, init, size, c, bufs[0].0, bufs[0].1,
                                    ),
                                    "rpc" => {
                                        patterns::rpc(a, peer, init, size, c, bufs[0].0, bufs[0].1)
                                    }
                                    "bw" => {
                                        patterns::bw(a, peer, init, size, c, bufs[0].0, bufs[0].1)
                                    }
                                    "bibw" => patterns::bibw(a, b, peer, init, size, c, bufs),
                                    _ => patterns::latency_mt(a, b, peer, init, size, c, bufs),
                                }
                            };
                            // Calibrate on the warm-up iterations, then agree on rank 0's count
                            // (no calibration when the count is already tiny).
                            if c.iters <= 2 {
                                used[k] = used[k].max(c.iters);
                                go(c)?
                            } else {
                                let v0 = go(Counts {
                                    warm: 1,
                                    iters: c.warm.clamp(1, c.iters),
                                })?;
                                let per = secs_per_iter(bench, size, v0);
                                seq += 1;
                                let iters = agree(session, seq, fit(o, per, c.iters))?;
                                // Timed in chunks (1/64 of the count, doubling up to 1/16);
                                // between chunks every rank adopts rank 0's verdict on its
                                // elapsed time, so a path whose warm-up was fast and whose
                                // timed iterations are not (raw Open MPI's `latency_mt`
                                // oversubscribed switches between 0.2 µs and 1–3 ms per
                                // one-way message) stops past 4 budgets plus at most one
                                // chunk instead of running the whole OSU count. Two untimed
                                // iterations open each chunk and absorb the skew the
                                // agreement leaves between the ranks.
                                let mut chunk = iters.div_ceil(64);
                                let max_chunk = iters.div_ceil(16);
                                let (mut done, mut secs) = (0usize, 0.0f64);
                                while done < iters {
                                    let n = chunk.min(iters - done);
                                    let v = go(Counts { warm: 2, iters: n })?;
                                    secs += secs_per_iter(bench, size, v) * n as f64;
                                    done += n;
                                    chunk = (chunk * 2).min(max_chunk);
                                    if done < iters {
                                        seq += 1;
                                        let on = usize::from(secs < 4.0 * o.time_budget);
                                        if agree(session, seq, on)? == 0 {
                                            break;
                                        }
                                    }
                                }
                                used[k] = used[k].max(done);
                                from_secs_per_iter(bench, size, secs / done as f64)
                            }
                        }
                    };
                    samples[k].push(v);
                }
            }
            if !init {
                continue;
            }
            let unit = if bench == "bw" || bench == "bibw" {
                "MB/s"
            } else {
                "us"
            };
            bench_rows.extend(rows_at(bench, unit, size, &imps, &samples, &used));
        }
        if threaded {
            if let Some(c) = pin_core {
                sys::pin(Some(c))?;
            }
        }
        if init {
            print!("{}", report::text_table(&group_stable(&bench_rows)));
            println!("({bench}: {:.1} s)", started.elapsed().as_secs_f64());
            rows.extend(bench_rows);
        }
    }
    Ok(rows)
}

/// One row per implementation measured at `size` (the median and min–max of its samples, its
/// baseline's median beside it).
fn rows_at(
    bench: &str,
    unit: &str,
    size: usize,
    imps: &[Imp],
    samples: &[Vec<f64>],
    used: &[usize],
) -> Vec<Row> {
    let medians: Vec<f64> = samples.iter().map(|s| report::stats(s).0).collect();
    let mut rows = Vec::new();
    for (k, imp) in imps.iter().enumerate() {
        if samples[k].is_empty() {
            continue;
        }
        let (median, min, max) = report::stats(&samples[k]);
        let base_median = imp
            .baseline
            .and_then(|b| imps.iter().position(|x| x.name == b))
            .map_or(f64::NAN, |j| medians[j]);
        rows.push(Row {
            bench: bench.into(),
            imp: imp.name.clone(),
            mode: imp.mode_name(),
            size,
            unit: unit.into(),
            median,
            min,
            max,
            runs: samples[k].len(),
            iters: used[k],
            baseline: imp.baseline.unwrap_or("").into(),
            base_median,
        });
    }
    rows
}

/// Rows grouped by implementation (stable), sizes ascending inside each group.
fn group_stable(rows: &[Row]) -> Vec<Row> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in rows {
        let k = (r.imp.clone(), r.mode.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.iter()
        .flat_map(|(i, m)| rows.iter().filter(move |r| &r.imp == i && &r.mode == m))
        .cloned()
        .collect()
}

/// `osu_mbw_mr`: ranks `0..n/2` each stream windows of 64 messages to `r + n/2`, all pairs at
/// once; aggregate MB/s and messages/s.
fn mr_suite(session: &Session, o: &Opts) -> Result<Vec<Row>> {
    let (me, n) = (session.rank(), session.size());
    let half = n / 2;
    let sender = me < half;
    let peer = if sender { me + half } else { me - half };
    let b = session.bootstrap();
    let mut imps = open_imps(session, o)?;
    imps.retain(|i| {
        i.a.is_some() && i.mode.is_none_or(|m| m == Mode::Cc) && pattern_wants("bw", i)
    });
    let max = o.max.min(1 << 20);
    let sbuf: Vec<u8> = (0..max.max(1)).map(|i| i as u8).collect();
    let mut rbuf = vec![0u8; max.max(1)];
    let mut rows = Vec::new();
    let mut seq = 0usize;
    for size in sizes(1, max) {
        let c = bw_counts(o, size);
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); imps.len()];
        let mut used = vec![0usize; imps.len()];
        for _run in 0..o.runs {
            for (k, imp) in imps.iter_mut().enumerate() {
                let Some(a) = imp.a.as_deref_mut() else {
                    continue;
                };
                let mut total = |seq: usize, c: Counts| -> Result<f64> {
                    b.barrier(&format!("bench/mr/{seq}"))?;
                    let (rate, _) = patterns::window(a, peer, sender, size, c, &sbuf, &mut rbuf)?;
                    let mine = if sender { rate } else { 0.0 };
                    let all = b.allgather(&format!("bench/mr/{seq}/r"), &mine.to_le_bytes())?;
                    Ok(all
                        .iter()
                        .filter_map(|v| v.as_slice().try_into().ok().map(f64::from_le_bytes))
                        .sum())
                };
                seq += 1;
                // Calibration: every rank sees the same total, so the counts agree.
                let t0 = total(
                    seq,
                    Counts {
                        warm: 1,
                        iters: c.warm.clamp(1, c.iters),
                    },
                )?;
                let pairs = half as f64;
                let iters = fit(o, secs_per_iter("bw", size, t0 / pairs), c.iters);
                used[k] = used[k].max(iters);
                seq += 1;
                samples[k].push(total(seq, Counts { warm: 0, iters })?);
            }
        }
        if me != 0 {
            continue;
        }
        for mb in rows_at("mbw_mr", "MB/s", size, &imps, &samples, &used) {
            let per = 1e6 / size as f64;
            let mr = Row {
                bench: "msg_rate".into(),
                unit: "msg/s".into(),
                median: mb.median * per,
                min: mb.min * per,
                max: mb.max * per,
                base_median: mb.base_median * per,
                ..mb.clone()
            };
            rows.push(mb);
            rows.push(mr);
        }
    }
    if me == 0 {
        let mut by_bench: Vec<Row> = rows
            .iter()
            .filter(|r| r.bench == "mbw_mr")
            .cloned()
            .collect();
        by_bench.extend(rows.iter().filter(|r| r.bench == "msg_rate").cloned());
        print!("{}", report::text_table(&group_stable(&by_bench)));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(benches: &[&str], max: usize) -> Opts {
        let mut o = parse_opts(&["--quick".to_string()]).expect("opts");
        o.div = 10_000;
        o.max = max;
        o.pin = false;
        o.channels = vec![
            "tcp,timeout_ms=60000".into(),
            "shm,timeout_ms=60000".into(),
            "via:soft,progress=poll,timeout_ms=60000".into(),
        ];
        o.benches = benches.iter().map(|b| b.to_string()).collect();
        o
    }

    #[test]
    fn figures_and_seconds_per_iteration_are_inverse() {
        for bench in ["latency", "latency_mt", "rpc", "bw", "bibw"] {
            for (size, v) in [(0usize, 0.37f64), (8, 12.5), (1 << 20, 9_000.0)] {
                let back = from_secs_per_iter(bench, size, secs_per_iter(bench, size, v));
                assert!(
                    (back - v).abs() <= v * 1e-12,
                    "{bench} {size}: {v} -> {back}"
                );
            }
        }
    }

    /// Rank 0's rows of `f` run on every rank of an `n`-thread session (real sockets and
    /// shared memory); the other ranks report none.
    fn rows_on_threads(n: usize, f: impl Fn(&Session) -> Result<Vec<Row>> + Sync) -> Vec<Row> {
        let mut all = on_threads(n, f).expect("suite");
        assert!(all[1..].iter().all(Vec::is_empty), "only rank 0 reports");
        all.swap_remove(0)
    }

    #[test]
    fn pair_suite_runs_every_pattern_with_tiny_counts() {
        let rows = rows_on_threads(2, |s| {
            pair_suite(
                s,
                &tiny(&["latency", "bw", "bibw", "latency_mt", "rpc"], 4096),
                None,
            )
        });
        for b in ["latency", "bw", "bibw", "latency_mt", "rpc"] {
            assert!(rows.iter().any(|r| r.bench == b), "no {b} rows");
        }
        for r in &rows {
            assert!(r.median.is_finite() && r.median > 0.0, "{r:?}");
            if !r.baseline.is_empty() {
                assert!(r.base_median.is_finite(), "baseline missing: {r:?}");
            }
        }
        // Every Madeleine mode pair and every baseline shows up in the latency table.
        for (imp, mode) in [
            ("shm,timeout_ms=60000", "16 pieces"),
            ("tcp,timeout_ms=60000", "safer/express"),
            ("raw-tcp-block", "-"),
            ("raw-shm", "-"),
            ("memcpy", "-"),
        ] {
            assert!(
                rows.iter()
                    .any(|r| r.bench == "latency" && r.imp == imp && r.mode == mode),
                "no latency row for {imp} [{mode}]"
            );
        }
        // A bench-ucx build runs the UCX baselines by default, in every pattern.
        #[cfg(feature = "bench-ucx")]
        for imp in ["raw-ucx-shm", "raw-ucx-tcp"] {
            for b in ["latency", "bw", "bibw", "latency_mt", "rpc"] {
                assert!(
                    rows.iter().any(|r| r.bench == b && r.imp == imp),
                    "no {b} row for {imp}"
                );
            }
        }
    }

    /// The baselines, benchmarks and modes that are not in the default run: the raw mailbox,
    /// drivers without the engine (through their copy TMs and past them), the processor time
    /// of each side and of an idle poll, K pieces on a channel given with --modes, the uds
    /// driver.
    #[test]
    fn on_request_baselines_benches_and_modes() {
        let rows = rows_on_threads(2, |s| {
            let mut o = tiny(
                &["latency", "bw", "rpc", "cpu_send", "cpu_recv", "poll"],
                4096,
            );
            o.channels = vec!["uds,timeout_ms=60000".into()];
            o.modes = vec![Mode::Cc, Mode::Pieces(4)];
            o.modes_given = true;
            o.baselines = vec!["raw-flag".into()];
            o.drivers = [
                "tcp,tm.small=64",
                "shm",
                "sisci:local,tm.short=8,tm.ring=256",
            ]
            .map(String::from)
            .to_vec();
            pair_suite(s, &o, None)
        });
        let has = |bench: &str, imp: &str, mode: &str| {
            rows.iter()
                .any(|r| r.bench == bench && r.imp == imp && r.mode == mode)
        };
        for imp in [
            "raw-flag",
            "driver:tcp,tm.small=64",
            "driver:shm",
            "driver:sisci:local,tm.short=8,tm.ring=256",
        ] {
            for bench in ["latency", "bw", "rpc"] {
                assert!(has(bench, imp, "-"), "no {bench} row for {imp}");
            }
        }
        assert!(has("latency", "uds,timeout_ms=60000", "4 pieces"));
        for bench in ["cpu_send", "cpu_recv"] {
            assert!(has(bench, "uds,timeout_ms=60000", "cheaper/cheaper"));
            assert!(has(bench, "driver:shm", "-"));
            // The mailbox waits for each message to be taken: not in the burst patterns.
            assert!(!has(bench, "raw-flag", "-"));
            assert!(rows
                .iter()
                .filter(|r| r.bench == bench)
                .all(|r| r.size <= 256));
        }
        for imp in [
            "uds,timeout_ms=60000",
            "raw-flag",
            "driver:shm",
            "driver:tcp,tm.small=64",
        ] {
            assert!(rows
                .iter()
                .any(|r| r.bench == "poll" && r.imp == imp && r.size == 0));
        }
        for r in &rows {
            assert!(r.median.is_finite() && r.median > 0.0, "{r:?}");
        }
    }

    #[test]
    fn message_rate_suite_with_four_ranks() {
        let rows = rows_on_threads(4, |s| mr_suite(s, &tiny(&[], 1024)));
        assert!(rows
            .iter()
            .any(|r| r.bench == "mbw_mr" && r.imp.starts_with("shm")));
        assert!(rows.iter().all(|r| r.median.is_finite() && r.median > 0.0));
    }

    #[test]
    fn options_are_checked() {
        assert!(parse_opts(&["--runs".into(), "0".into()]).is_err());
        assert!(parse_opts(&["--max".into(), "lots".into()]).is_err());
        assert!(parse_opts(&["--bogus".into()]).is_err());
        let o = parse_opts(&["--channels".into(), "tcp,progress=poll;shm".into()]).expect("ok");
        assert_eq!(o.channels, ["tcp,progress=poll", "shm"]);
        assert_eq!(baseline_of("tcp,progress=block"), "raw-tcp-block");
        assert_eq!(baseline_of("shm"), "raw-shm");
        let o = parse_opts(&["--drivers".into(), "tcp,tm.small=64;shm".into()]).expect("ok");
        assert_eq!(o.drivers, ["tcp,tm.small=64", "shm"]);
        let o = parse_opts(&["--modes".into(), "safer,8".into()]).expect("ok");
        assert_eq!(o.modes, [Mode::Cc, Mode::Se, Mode::Pieces(8)]);
        assert!(o.modes_given);
        assert!(parse_opts(&["--modes".into(), "1".into()]).is_err());
    }
}
