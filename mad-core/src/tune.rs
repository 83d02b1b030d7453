//! The switch tunes itself: TM thresholds measured at open (`tune=auto`).
//!
//! With `tune=auto` (or `tune=refresh`) in a channel spec, the open measures where the
//! channel's TMs cross over on this machine instead of trusting the driver's built-in
//! thresholds, which come from a sweep on another machine:
//!
//! 1. after the connections are up, rank 0 and one peer (rank 1, or for an intra-host driver
//!    the lowest other rank on rank 0's host) ping-pong one CHEAPER/CHEAPER piece over a
//!    ladder of sizes ([`LADDER`]: 128 B to 8 MiB, powers of two), each TM forced (the TMs
//!    before it given threshold 0, itself no limit) in alternation with the others, batch by
//!    batch, and take the median of each TM's three batches' mean one-way times (batches of
//!    about 0.4 ms, 1 to 256 round trips, each after a quarter of a batch of warm-up, at least
//!    1 to 3 round trips: a batch preempted by another process does not count, a TM that is
//!    sometimes slow in steady state does); a TM that is well behind at two sizes running while a later TM
//!    leads is not measured further. This first pass stops at three quarters of the
//!    channel's `tune_budget_ms` (default [`DEFAULT_BUDGET`]); a calibration cut short by the
//!    budget keeps the built-in choice where it did not measure and is not cached;
//! 2. rank 0 picks, for each size of the ladder, the TM to use, as the cheapest assignment
//!    that keeps the table's order (each TM serves one range of sizes) counting each size's
//!    time relative to the best TM there, with the built-in choice favoured by
//!    [`MARGIN`]; each size where that moves away from the built-in choice is measured again
//!    for both TMs, and the move must win again (the challenger keeps its slower figure, the
//!    built-in choice its faster one; a move not confirmed within the budget is dropped), so
//!    noise does not move a threshold. The thresholds follow (each a size of the ladder, or
//!    half its first rung below it, or unchanged for TMs after the last one chosen; the
//!    built-in thresholds when the choice is the built-in one at every size; the built-in
//!    choice above the sizes measured);
//! 3. rank 0 sends the result to every rank with the open's last collective (its vote), and
//!    every rank applies it, then the channel's `tm.<name>=` overrides, which still win;
//!    rank 0's resulting table fingerprint comes with it and every rank checks its own.
//!
//! The result is cached by rank 0 (a small text file per key under `tune_cache=<dir>`,
//! `MAD_TUNE_CACHE`, `$XDG_CACHE_HOME/madeleine` or `$HOME/.cache/madeleine`), keyed by the
//! host name, the driver, adapter and performance options of the channel, the built-in
//! table, whether the measuring pair shares a host, the build (crate version, size and
//! modification time of the executable) and the kernel release. A later open with the same
//! key takes the cached thresholds, sent in the open's first collective, so the drivers
//! connect with the final table and the open costs a `stat` of the file more (once read by
//! the process). A measuring open hands the drivers the built-in table (tcp sizes its first
//! read from it) and swaps in the tuned one before the channel is returned. A cache that
//! cannot be written or read, or a file that does not parse, is a warning (the open
//! measures), never an error; only rank 0's cache counts, so ranks cannot disagree.
//!
//! [`Channel::tuning`](crate::Channel::tuning) and the selection table (`MAD_PROTO_INFO=1`)
//! say where each threshold comes from (built-in, measured, cached, override), when it was
//! measured, and the measured figures.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::{ChannelConfig, Tune, TuneCache};
use crate::driver::TmTable;
use crate::error::{Error, Result};
use crate::modes::{RecvMode, SendMode};

/// The sizes the calibration measures (bytes): powers of two from 128 B to 8 MiB.
pub const LADDER: [usize; 17] = {
    let mut l = [0; 17];
    let mut i = 0;
    while i < 17 {
        l[i] = 128 << i;
        i += 1;
    }
    l
};

/// The default bound on a calibration (`tune_budget_ms`): its first pass stops measuring
/// larger sizes at three quarters of it, its confirmations at all of it (what was not
/// measured or confirmed keeps the built-in choice, and such a calibration is not cached).
pub const DEFAULT_BUDGET: Duration = Duration::from_millis(900);

/// The built-in choice at a size wins unless another TM is faster there by more than this
/// fraction (noise of the medians on a shared machine).
pub const MARGIN: f64 = 0.04;

/// A TM more than this factor behind the best at two sizes running, while a TM after it in
/// the table leads, is not measured at larger sizes.
const DROP_FACTOR: f64 = 1.5;

/// Largest cache file or tuning record read.
const MAX_RECORD: usize = 64 << 10;

/// The version of the record format and of the choice (part of the cache key).
const FORMAT: &str = "madeleine-tune 1";

/// Where a TM's threshold comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ThresholdSource {
    /// The driver's built-in value.
    BuiltIn,
    /// Measured at this open.
    Measured,
    /// Measured at an earlier open with the same key, from the cache.
    Cached,
    /// A `tm.<name>=` override of the channel spec.
    Override,
}

impl ThresholdSource {
    /// `built-in`, `measured`, `cached` or `override`.
    pub fn as_str(self) -> &'static str {
        match self {
            ThresholdSource::BuiltIn => "built-in",
            ThresholdSource::Measured => "measured",
            ThresholdSource::Cached => "cached",
            ThresholdSource::Override => "override",
        }
    }
}

/// What the tuning of a channel did ([`Channel::tuning`](crate::Channel::tuning)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Tuning {
    /// The channel's `tune=` setting.
    pub mode: Tune,
    /// For each TM, in table order: its name and where its threshold comes from.
    pub thresholds: Vec<(String, ThresholdSource)>,
    /// When the thresholds in use were measured (now, or the cached measurement's time).
    pub measured_at: Option<SystemTime>,
    /// How long that calibration took.
    pub calibration: Option<Duration>,
    /// The two ranks that measured.
    pub pair: Option<(usize, usize)>,
    /// The TMs measured (the columns of [`figures`](Tuning::figures)).
    pub tms: Vec<String>,
    /// Per ladder size measured: the median one-way time (µs) of each TM, `None` where it was
    /// not measured.
    pub figures: Vec<(usize, Vec<Option<f64>>)>,
    /// Why the built-in thresholds were kept without measuring, if they were.
    pub note: Option<String>,
    /// Whether the calibration covered the whole ladder and confirmed every move within its
    /// time budget (an incomplete one keeps the built-in choice where it did not, and is not
    /// cached).
    pub complete: bool,
}

impl Tuning {
    /// The description of a channel that was not tuned (`why`), given its overrides.
    pub(crate) fn untuned(config: &ChannelConfig, table: &TmTable, why: Option<String>) -> Self {
        Tuning {
            mode: config.tune,
            thresholds: table
                .tms()
                .iter()
                .map(|t| {
                    let src = if config.thresholds.contains_key(t.name) {
                        ThresholdSource::Override
                    } else {
                        ThresholdSource::BuiltIn
                    };
                    (t.name.to_string(), src)
                })
                .collect(),
            measured_at: None,
            calibration: None,
            pair: None,
            tms: Vec::new(),
            figures: Vec::new(),
            note: why,
            complete: true,
        }
    }

    /// The source of the threshold of TM `name`.
    pub fn source(&self, name: &str) -> Option<ThresholdSource> {
        self.thresholds
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| *s)
    }

    /// The lines the selection table shows: a summary, then the figures.
    pub(crate) fn describe(&self, s: &mut String) {
        let head = match (self.mode, &self.note) {
            (Tune::Off, _) => "built-in (tune=off)".to_string(),
            (_, Some(n)) => format!("built-in (tune={}: {n})", self.mode.as_str()),
            (m, None) => {
                let cached = self
                    .thresholds
                    .iter()
                    .any(|(_, s)| *s == ThresholdSource::Cached);
                format!(
                    "tune={}: {} {}{}{}",
                    m.as_str(),
                    if cached {
                        "from the cache, measured"
                    } else {
                        "measured at this open"
                    },
                    self.measured_at.map(utc).unwrap_or_default(),
                    self.pair
                        .map(|(a, b)| format!(" between ranks {a} and {b}"))
                        .unwrap_or_default(),
                    self.calibration
                        .map(|d| format!(" in {} ms", d.as_millis()))
                        .unwrap_or_default()
                ) + if self.complete {
                    ""
                } else {
                    " (time budget out: built-in choice where not measured, not cached)"
                }
            }
        };
        let _ = writeln!(s, "  thresholds: {head}");
        if self.figures.is_empty() {
            return;
        }
        let _ = write!(s, "  calibration, one-way µs (median): {:>6}", "size");
        for n in &self.tms {
            let _ = write!(s, " {n:>9}");
        }
        let _ = writeln!(s);
        for (size, row) in &self.figures {
            let _ = write!(s, "  {:>41}", size);
            for v in row {
                match v {
                    Some(v) => {
                        let _ = write!(s, " {v:>9.1}");
                    }
                    None => {
                        let _ = write!(s, " {:>9}", "-");
                    }
                }
            }
            let _ = writeln!(s);
        }
    }
}

/// `2026-11-27 07:50:12 UTC`.
fn utc(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// One calibration's outcome: what rank 0 sends the others and caches.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Record {
    pub(crate) measured_unix: u64,
    pub(crate) calib_ms: u64,
    pub(crate) pair: (usize, usize),
    /// Whether the whole ladder was measured and every move confirmed within the budgets
    /// (only complete calibrations are cached).
    pub(crate) complete: bool,
    /// The tuned TMs, in table order, with their new thresholds.
    pub(crate) thresholds: Vec<(String, usize)>,
    /// Per ladder size: the median one-way µs of each tuned TM.
    pub(crate) figures: Vec<(usize, Vec<Option<f64>>)>,
}

impl Record {
    pub(crate) fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "measured {} {} {} {} {}",
            self.measured_unix,
            self.calib_ms,
            self.pair.0,
            self.pair.1,
            u8::from(self.complete)
        );
        for (n, v) in &self.thresholds {
            if *v == usize::MAX {
                let _ = writeln!(s, "tm {n} max");
            } else {
                let _ = writeln!(s, "tm {n} {v}");
            }
        }
        for (size, row) in &self.figures {
            let _ = write!(s, "fig {size}");
            for v in row {
                match v {
                    Some(v) => {
                        let _ = write!(s, " {v:.3}");
                    }
                    None => s.push_str(" -"),
                }
            }
            s.push('\n');
        }
        s
    }

    /// Parse [`to_text`](Record::to_text)'s output; `None` for anything else.
    pub(crate) fn parse(text: &str) -> Option<Record> {
        if text.len() > MAX_RECORD {
            return None;
        }
        let mut r = Record {
            measured_unix: 0,
            calib_ms: 0,
            pair: (0, 0),
            complete: false,
            thresholds: Vec::new(),
            figures: Vec::new(),
        };
        let mut measured = false;
        for line in text.lines() {
            let mut w = line.split(' ');
            match w.next()? {
                "measured" => {
                    r.measured_unix = w.next()?.parse().ok()?;
                    r.calib_ms = w.next()?.parse().ok()?;
                    r.pair = (w.next()?.parse().ok()?, w.next()?.parse().ok()?);
                    r.complete = match w.next()? {
                        "1" => true,
                        "0" => false,
                        _ => return None,
                    };
                    measured = true;
                }
                "tm" => {
                    let name = w.next()?;
                    let v = match w.next()? {
                        "max" => usize::MAX,
                        v => v.parse().ok()?,
                    };
                    if name.is_empty() || r.thresholds.len() >= crate::driver::MAX_TMS {
                        return None;
                    }
                    r.thresholds.push((name.to_string(), v));
                }
                "fig" => {
                    let size = w.next()?.parse().ok()?;
                    let mut row = Vec::new();
                    for v in w.by_ref() {
                        row.push(match v {
                            "-" => None,
                            v => Some(v.parse::<f64>().ok().filter(|x| x.is_finite())?),
                        });
                    }
                    if r.figures.len() >= LADDER.len() {
                        return None;
                    }
                    r.figures.push((size, row));
                    continue;
                }
                _ => return None,
            }
            if w.next().is_some() {
                return None;
            }
        }
        let n = r.thresholds.len();
        (measured && n >= 2 && r.figures.iter().all(|(_, row)| row.len() == n)).then_some(r)
    }

    /// The table `builtin` with these thresholds, checked: the tuned TMs must be the table's
    /// tunable TMs, in order, with non-decreasing thresholds.
    pub(crate) fn apply(&self, builtin: &TmTable) -> Result<TmTable> {
        let tunable = tunable(builtin);
        let names: Vec<&str> = tunable.iter().map(|&i| builtin.tms()[i].name).collect();
        let mine: Vec<&str> = self.thresholds.iter().map(|(n, _)| n.as_str()).collect();
        if names != mine {
            return Err(Error::BadConfig(format!(
                "tuning record for TMs {mine:?}, but the table's are {names:?}"
            )));
        }
        if self.thresholds.windows(2).any(|w| w[0].1 > w[1].1) {
            return Err(Error::BadConfig(
                "tuning record with decreasing thresholds".into(),
            ));
        }
        let mut tms = builtin.tms().to_vec();
        for (&i, (_, v)) in tunable.iter().zip(&self.thresholds) {
            tms[i].max_len = *v;
        }
        TmTable::new(tms)
    }
}

/// The TMs the calibration tunes: those that take CHEAPER/CHEAPER pieces, the pieces it
/// measures with.
pub(crate) fn tunable(t: &TmTable) -> Vec<usize> {
    t.tms()
        .iter()
        .enumerate()
        .filter(|(_, tm)| tm.modes.accepts(SendMode::Cheaper, RecvMode::Cheaper))
        .map(|(i, _)| i)
        .collect()
}

/// The table that sends every CHEAPER/CHEAPER piece through TM `tunable[k]`.
pub(crate) fn forced(builtin: &TmTable, tunable: &[usize], k: usize) -> Result<TmTable> {
    let mut tms = builtin.tms().to_vec();
    for &i in &tunable[..k] {
        tms[i].max_len = 0;
    }
    tms[tunable[k]].max_len = usize::MAX;
    TmTable::new(tms)
}

/// The TM (index into `tunable`) for each size of the ladder: the cheapest assignment that
/// keeps the table's order, from the one-way times `t[k][j]` (TM `tunable[k]`, size
/// `LADDER[j]`, `None` if not measured; sizes past `t[k].len()` are not measured), each size
/// counting its time relative to the best TM there, the built-in choice favoured by
/// [`MARGIN`]. Where nothing was measured, the built-in choice. Also returns the built-in
/// choice at each size.
fn assign(
    builtin: &TmTable,
    tunable: &[usize],
    t: &[Vec<Option<f64>>],
) -> (Vec<usize>, Vec<usize>) {
    let kn = tunable.len();
    let m = LADDER.len();
    let builtin_k: Vec<usize> = (0..m)
        .map(|j| {
            let id = builtin.select(LADDER[j], SendMode::Cheaper, RecvMode::Cheaper) as usize;
            tunable.iter().position(|&i| i == id).unwrap_or(kn - 1)
        })
        .collect();
    let at = |k: usize, j: usize| t.get(k).and_then(|r| r.get(j)).copied().flatten();
    let cost: Vec<Vec<f64>> = (0..m)
        .map(|j| {
            let best = (0..kn)
                .filter_map(|k| at(k, j))
                .fold(f64::INFINITY, f64::min);
            (0..kn)
                .map(|k| match at(k, j) {
                    Some(v) if best.is_finite() && best > 0.0 => {
                        let c = v / best;
                        if k == builtin_k[j] {
                            c * (1.0 - MARGIN)
                        } else {
                            c
                        }
                    }
                    // Nothing measured at this size: the built-in choice.
                    _ if !best.is_finite() && k == builtin_k[j] => 0.0,
                    _ => f64::INFINITY,
                })
                .collect()
        })
        .collect();
    // f[j][k]: the least cost of sizes 0..=j with size j on TM k, the TMs non-decreasing.
    let mut f = vec![vec![f64::INFINITY; kn]; m];
    let mut from = vec![vec![0usize; kn]; m];
    f[0].clone_from(&cost[0]);
    for j in 1..m {
        let (mut best, mut arg) = (f64::INFINITY, 0);
        for k in 0..kn {
            if f[j - 1][k] < best {
                best = f[j - 1][k];
                arg = k;
            }
            f[j][k] = cost[j][k] + best;
            from[j][k] = arg;
        }
    }
    let Some(mut k) = (0..kn)
        .filter(|&k| f[m - 1][k].is_finite())
        .min_by(|&a, &b| f[m - 1][a].total_cmp(&f[m - 1][b]))
    else {
        return (builtin_k.clone(), builtin_k);
    };
    let mut pick = vec![0usize; m];
    for j in (0..m).rev() {
        pick[j] = k;
        k = from[j][k];
    }
    (pick, builtin_k)
}

/// The thresholds chosen from the one-way times `t` (see [`assign`]): the built-in ones when
/// the choice is the built-in one at every size of the ladder; otherwise each TM's largest
/// size of the ladder, half the first rung for a TM before the first one chosen, no limit
/// for the last one chosen, and unchanged for the TMs after it.
pub(crate) fn choose(
    builtin: &TmTable,
    tunable: &[usize],
    t: &[Vec<Option<f64>>],
) -> Vec<(String, usize)> {
    let keep = || -> Vec<(String, usize)> {
        tunable
            .iter()
            .map(|&i| {
                let tm = &builtin.tms()[i];
                (tm.name.to_string(), tm.max_len)
            })
            .collect()
    };
    if tunable.len() < 2 {
        return keep();
    }
    let (pick, builtin_k) = assign(builtin, tunable, t);
    if pick == builtin_k {
        return keep();
    }
    let m = LADDER.len();
    let last = pick[m - 1];
    tunable
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let tm = &builtin.tms()[i];
            let v = if k == last {
                usize::MAX
            } else if k > last {
                tm.max_len
            } else if k < pick[0] {
                tm.max_len.min(LADDER[0] / 2)
            } else {
                (0..m)
                    .filter(|&j| pick[j] <= k)
                    .map(|j| LADDER[j])
                    .max()
                    .unwrap_or(0)
            };
            (tm.name.to_string(), v)
        })
        .collect()
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Batches timed per measurement: the figure is the median of the batches' mean one-way
/// times (a batch preempted by another process does not count; a TM whose rounds are
/// sometimes slow, as the steady state sees them, does).
const BATCHES: u64 = 3;

/// The control message rank 0 sends its partner before each measurement: `[tm + 1, size,
/// rounds]`, or all zero at the end.
type Ctl = [u64; 3];

/// How long either side of the calibration waits for the other's next message.
const PARTNER_WAIT: Duration = Duration::from_secs(60);

/// Swap the channel's table (the channel is not shared yet: the open owns it).
fn set_table(ch: &mut crate::Channel, t: &TmTable) -> Result<()> {
    let inner = std::sync::Arc::get_mut(&mut ch.inner).ok_or_else(|| {
        Error::BadConfig("tune: the channel is shared before its open ended".into())
    })?;
    inner.table = t.clone();
    Ok(())
}

/// One round trip of `buf` with `peer` (the leader sends first); a peer silent until
/// `deadline` is an error.
fn round(
    ch: &crate::Channel,
    peer: usize,
    leader: bool,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<()> {
    if leader {
        let mut p = ch.begin_packing(peer)?;
        p.pack(buf, RecvMode::Cheaper)?;
        p.end_packing()?;
        let mut u = ch.begin_unpacking_from_until(peer, deadline)?;
        u.unpack(buf, SendMode::Cheaper)?;
        u.end_unpacking()
    } else {
        let mut u = ch.begin_unpacking_from_until(peer, deadline)?;
        u.unpack(buf, SendMode::Cheaper)?;
        u.end_unpacking()?;
        let mut p = ch.begin_packing(peer)?;
        p.pack(buf, RecvMode::Cheaper)?;
        p.end_packing()
    }
}

/// Round trips per timed batch, from an estimate of the one-way µs: enough for about
/// [`BATCH_US`] (at most [`MAX_ROUNDS`], at least 1). Batches of a few round trips of a
/// microsecond each measured the first round trips after a table switch, not the steady state:
/// on shm the ring came out 2–3× slower than in a long ping-pong at 2–8 KiB, and CMA won there.
fn rounds_for(one_way_us: f64) -> u64 {
    let r = (BATCH_US / (2.0 * one_way_us.max(0.01))).ceil();
    (r as u64).clamp(1, MAX_ROUNDS)
}

/// How long a timed batch of the calibration lasts, about (µs).
const BATCH_US: f64 = 400.0;

/// Most round trips of a timed batch.
const MAX_ROUNDS: u64 = 256;

/// Warm-up round trips before the batches of a measurement: a quarter of a batch, and at least
/// 3 below 64 KiB (1 above).
fn warm_for(size: usize, rounds: u64) -> u64 {
    (rounds / 4).max(if size < 64 << 10 { 3 } else { 1 })
}

/// The order of the timed batches of one alternated measurement of the TMs `ks`: [`BATCHES`]
/// rounds, each with one batch of every TM, the order rotated from round to round (and by
/// `shift`), so that every TM meets the machine's load of the moment as the others do.
fn schedule(ks: &[usize], shift: usize) -> Vec<usize> {
    let n = ks.len();
    (0..BATCHES as usize)
        .flat_map(|b| (0..n).map(move |i| ks[(i + b + shift) % n]))
        .collect()
}

/// Rank 0's half of an alternated measurement of the TMs `ks` at `buf.len()`: for each batch
/// of the [`schedule`], tell the partner, force the TM (`tables[k]`), warm-up round trips
/// ([`warm_for`]), then one timed batch of `rounds` round trips; per TM of `ks`, in order, the
/// median of its batches' mean one-way µs. (Measuring one TM's batches back to back, as the
/// calibration did, let a burst of load on the shared machine land on one TM only.)
fn measure(
    ch: &mut crate::Channel,
    peer: usize,
    tables: &[TmTable],
    ks: &[usize],
    shift: usize,
    buf: &mut [u8],
    rounds: u64,
) -> Result<Vec<f64>> {
    let warm = warm_for(buf.len(), rounds);
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
    for k in schedule(ks, shift) {
        let mut p = ch.begin_packing(peer)?;
        let ctl: Ctl = [k as u64 + 1, buf.len() as u64, rounds + warm];
        p.pack_value(&ctl, RecvMode::Express)?;
        p.end_packing()?;
        set_table(ch, &tables[k])?;
        let deadline = Instant::now() + PARTNER_WAIT;
        for _ in 0..warm {
            round(ch, peer, true, buf, deadline)?;
        }
        let t0 = Instant::now();
        for _ in 0..rounds {
            round(ch, peer, true, buf, deadline)?;
        }
        let i = ks.iter().position(|&x| x == k).unwrap_or(0);
        times[i].push(t0.elapsed().as_secs_f64() * 1e6 / (2 * rounds) as f64);
    }
    Ok(times.iter_mut().map(|v| median(v)).collect())
}

/// Rank 0's side of the calibration with `peer`: the record of the thresholds chosen.
/// The channel's table is `builtin` again when it returns.
///
/// A first pass measures every TM at each size of the ladder (until three quarters of
/// `budget`); where its choice differs from the built-in one, a second measurement of both
/// TMs must confirm it: the challenger keeps the slower of its two figures, the built-in
/// choice the faster (until `budget`; a move left unconfirmed is dropped).
pub(crate) fn lead(
    ch: &mut crate::Channel,
    peer: usize,
    builtin: &TmTable,
    budget: Duration,
) -> Result<Record> {
    let started = Instant::now();
    let tunable = tunable(builtin);
    let kn = tunable.len();
    let tables: Vec<TmTable> = (0..kn)
        .map(|k| forced(builtin, &tunable, k))
        .collect::<Result<_>>()?;
    let mut buf = vec![1u8; LADDER[LADDER.len() - 1]];
    let mut t: Vec<Vec<Option<f64>>> = vec![Vec::new(); kn];
    let mut complete = true;
    let run = (|| -> Result<()> {
        let mut behind = vec![0u32; kn];
        let mut dropped = vec![false; kn];
        for (j, &size) in LADDER.iter().enumerate() {
            if started.elapsed() >= budget / 4 * 3 {
                complete = false;
                break;
            }
            for row in &mut t {
                row.push(None);
            }
            let prev = (0..kn)
                .filter_map(|x| t[x].get(j.wrapping_sub(1)).copied().flatten())
                .fold(f64::INFINITY, f64::min);
            // Fewer round trips where one takes long (estimated from the previous size).
            let rounds = if prev.is_finite() {
                rounds_for(prev)
            } else {
                5
            };
            // Every TM still measured, in alternation (the order rotated from size to size).
            let ks: Vec<usize> = (0..kn).filter(|&k| !dropped[k]).collect();
            let vs = measure(ch, peer, &tables, &ks, j, &mut buf[..size], rounds)?;
            for (&k, v) in ks.iter().zip(vs) {
                t[k][j] = Some(v);
            }
            let best = (0..kn)
                .filter_map(|k| t[k][j].map(|v| (k, v)))
                .min_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((bk, bv)) = best {
                for k in 0..bk {
                    match t[k][j] {
                        Some(v) if v > bv * DROP_FACTOR => {
                            behind[k] += 1;
                            if behind[k] >= 2 {
                                dropped[k] = true;
                            }
                        }
                        _ => behind[k] = 0,
                    }
                }
            }
        }
        let (pick, builtin_k) = assign(builtin, &tunable, &t);
        for j in 0..t[0].len() {
            let (c, b) = (pick[j], builtin_k[j]);
            if c == b {
                continue;
            }
            if started.elapsed() >= budget {
                t[c][j] = None;
                complete = false;
                continue;
            }
            // (The built-in choice may not have been measured here: dropped as too slow.)
            let rounds = t[c][j].map_or(5, rounds_for);
            let size = LADDER[j];
            let vs = measure(ch, peer, &tables, &[c, b], j, &mut buf[..size], rounds)?;
            for (k, v) in [c, b].into_iter().zip(vs) {
                let old = t[k][j].unwrap_or(v);
                t[k][j] = Some(if k == c { old.max(v) } else { old.min(v) });
            }
        }
        let mut p = ch.begin_packing(peer)?;
        p.pack_value(&[0u64; 3], RecvMode::Express)?;
        p.end_packing()
    })();
    set_table(ch, builtin)?;
    run?;
    let thresholds = choose(builtin, &tunable, &t);
    let m = t.first().map_or(0, Vec::len);
    let figures = (0..m)
        .map(|j| (LADDER[j], (0..kn).map(|k| t[k][j]).collect()))
        .collect();
    let calib = started.elapsed();
    tracing::debug!(
        peer,
        calib_ms = calib.as_millis() as u64,
        complete,
        ?thresholds,
        "tune: calibrated"
    );
    Ok(Record {
        measured_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        calib_ms: calib.as_millis() as u64,
        pair: (ch.rank(), peer),
        complete,
        thresholds,
        figures,
    })
}

/// The partner's side: echo what rank 0 asks for until it says stop.
pub(crate) fn follow(ch: &mut crate::Channel, leader: usize, builtin: &TmTable) -> Result<()> {
    let tunable = tunable(builtin);
    let tables: Vec<TmTable> = (0..tunable.len())
        .map(|k| forced(builtin, &tunable, k))
        .collect::<Result<_>>()?;
    let mut buf = Vec::new();
    let run = (|| -> Result<()> {
        loop {
            let mut u = ch.begin_unpacking_from_until(leader, Instant::now() + PARTNER_WAIT)?;
            let [tm, size, rounds]: Ctl = u.unpack_value()?;
            u.end_unpacking()?;
            if tm == 0 {
                return Ok(());
            }
            let k = (tm - 1) as usize;
            let size = size as usize;
            if k >= tables.len()
                || size > LADDER[LADDER.len() - 1]
                || rounds > MAX_ROUNDS + warm_for(0, MAX_ROUNDS)
            {
                return Err(Error::protocol(
                    leader,
                    format!("tune: bad calibration request {tm}/{size}/{rounds}"),
                ));
            }
            if buf.len() < size {
                buf.resize(size, 1u8);
            }
            set_table(ch, &tables[k])?;
            let deadline = Instant::now() + PARTNER_WAIT;
            for _ in 0..rounds {
                round(ch, leader, false, &mut buf[..size], deadline)?;
            }
        }
    })();
    set_table(ch, builtin)?;
    run
}

/// The rank that measures with rank 0, as rank `me` knows it (`None`: not this rank's
/// business, or nobody). For an intra-host driver, the lowest other rank on rank 0's host.
pub(crate) fn partner(
    me: usize,
    size: usize,
    local_ranks: &[usize],
    intra_node_only: bool,
) -> Option<usize> {
    if size < 2 {
        return None;
    }
    if !intra_node_only {
        return Some(1);
    }
    if me != 0 && !local_ranks.contains(&0) {
        return None;
    }
    local_ranks.iter().copied().filter(|&r| r != 0).min()
}

/// The cache key of a channel: what the thresholds depend on.
pub(crate) fn cache_key(config: &ChannelConfig, builtin: &TmTable, pair_local: bool) -> String {
    let opts: Vec<String> = config
        .options
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    format!(
        "{FORMAT}|{}|driver={}:{}|options={}|progress={:?}|checked={}|table={:016x}|pair={}",
        machine(),
        config.driver,
        config.adapter.as_deref().unwrap_or(""),
        opts.join(";"),
        config.progress,
        config.checked,
        builtin.fingerprint(),
        if pair_local { "local" } else { "remote" }
    )
}

/// `host=...|kernel=...|build=...` of this process (read once: the host name, the kernel
/// release, the crate version with the executable's size and modification time).
fn machine() -> &'static str {
    static MACHINE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MACHINE.get_or_init(|| {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        let exe = std::fs::metadata("/proc/self/exe")
            .or_else(|_| std::env::current_exe().and_then(std::fs::metadata))
            .ok();
        let build = exe.map_or_else(String::new, |m| {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            format!("{}+{mtime}", m.len())
        });
        format!(
            "host={}|kernel={}|build={}+{build}",
            read("/proc/sys/kernel/hostname"),
            read("/proc/sys/kernel/osrelease"),
            env!("CARGO_PKG_VERSION"),
        )
    })
}

/// Cache files this process has read or written, by path: their size and modification time
/// then, and the record. A later open whose file has not changed takes the record from here
/// (one `stat` instead of a read and a parse).
type Memo = std::collections::HashMap<PathBuf, ((u64, Option<SystemTime>), String, Record)>;

fn memo() -> std::sync::MutexGuard<'static, Memo> {
    static MEMO: std::sync::OnceLock<std::sync::Mutex<Memo>> = std::sync::OnceLock::new();
    MEMO.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn stamp(m: &std::fs::Metadata) -> (u64, Option<SystemTime>) {
    (m.len(), m.modified().ok())
}

/// The cache directory of a channel, if any.
pub(crate) fn cache_dir(config: &ChannelConfig) -> Option<PathBuf> {
    let nonempty = |v: std::ffi::OsString| (!v.is_empty()).then(|| PathBuf::from(v));
    match &config.tune_cache {
        TuneCache::Off => None,
        TuneCache::Dir(d) => Some(d.clone()),
        TuneCache::Default => {
            if let Some(v) = std::env::var_os("MAD_TUNE_CACHE") {
                return if v == "off" { None } else { nonempty(v) };
            }
            if let Some(x) = std::env::var_os("XDG_CACHE_HOME").and_then(nonempty) {
                return Some(x.join("madeleine"));
            }
            std::env::var_os("HOME")
                .and_then(nonempty)
                .map(|h| h.join(".cache").join("madeleine"))
        }
    }
}

fn fnv(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in s.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cache file of `key` in `dir`.
pub(crate) fn cache_file(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("tune-{:016x}.txt", fnv(key)))
}

/// The record cached for `key` in `dir` that gives a valid table from `builtin`; `None`
/// (with a warning for a file that is there but wrong) otherwise.
pub(crate) fn load(dir: &Path, key: &str, builtin: &TmTable) -> Option<Record> {
    use std::io::Read as _;
    let path = cache_file(dir, key);
    // Unchanged since this process read it: one stat.
    if let Ok(m) = std::fs::metadata(&path) {
        if let Some((was, k, r)) = memo().get(&path) {
            if *was == stamp(&m) && k == key {
                return Some(r.clone());
            }
        }
    }
    let f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "tune: cache unreadable; measuring");
            return None;
        }
    };
    let stamped = f.metadata().ok().map(|m| stamp(&m));
    let mut text = String::new();
    let read = f.take(MAX_RECORD as u64 + 1).read_to_string(&mut text);
    let parsed = read.ok().and_then(|_| {
        let rest = text.strip_prefix(FORMAT)?.strip_prefix('\n')?;
        let (k, body) = rest.split_once('\n')?;
        (k.strip_prefix("key ")? == key).then_some(())?;
        let r = Record::parse(body)?;
        r.apply(builtin).ok().map(|_| r)
    });
    match (&parsed, stamped) {
        (None, _) => {
            memo().remove(&path);
            tracing::warn!(path = %path.display(), "tune: cache file not valid for this channel; ignored, measuring");
        }
        (Some(r), Some(st)) => {
            memo().insert(path, (st, key.to_string(), r.clone()));
        }
        (Some(_), None) => {}
    }
    parsed
}

/// Write `r` for `key` into `dir` (atomically: a temporary file renamed); a failure is a
/// warning.
pub(crate) fn store(dir: &Path, key: &str, r: &Record) {
    use std::os::unix::fs::DirBuilderExt as _;
    let path = cache_file(dir, key);
    let tmp = dir.join(format!(
        ".tune-{:016x}.{}.tmp",
        fnv(key),
        std::process::id()
    ));
    let res = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .and_then(|()| std::fs::write(&tmp, format!("{FORMAT}\nkey {key}\n{}", r.to_text())))
        .and_then(|()| std::fs::rename(&tmp, &path));
    match res {
        Ok(()) => tracing::debug!(path = %path.display(), "tune: cached"),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %path.display(), error = %e, "tune: cannot write the cache; the next open measures again");
        }
    }
}

/// What rank 0 tells the others in the open's first collective.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Plan {
    /// Built-in thresholds (tune=off, or nothing to tune: the reason).
    Keep(Option<String>),
    /// Measure now, between rank 0 and this rank.
    Measure(usize),
    /// Use this cached record.
    Cached(Record),
}

impl Plan {
    pub(crate) fn to_text(&self) -> String {
        match self {
            Plan::Keep(None) => "keep".into(),
            Plan::Keep(Some(why)) => format!("keep {}", why.replace('\n', " ")),
            Plan::Measure(p) => format!("measure {p}"),
            Plan::Cached(r) => format!("cached\n{}", r.to_text()),
        }
    }

    pub(crate) fn parse(text: &str) -> Option<Plan> {
        if text.len() > MAX_RECORD {
            return None;
        }
        if text == "keep" {
            return Some(Plan::Keep(None));
        }
        if let Some(why) = text.strip_prefix("keep ") {
            return Some(Plan::Keep(Some(why.to_string())));
        }
        if let Some(p) = text.strip_prefix("measure ") {
            return p.parse().ok().map(Plan::Measure);
        }
        Record::parse(text.strip_prefix("cached\n")?).map(Plan::Cached)
    }
}

/// The description of a tuned channel: `record` applied (`src`: measured or cached), then
/// the overrides of `config`.
pub(crate) fn tuned_info(
    config: &ChannelConfig,
    table: &TmTable,
    record: &Record,
    src: ThresholdSource,
) -> Tuning {
    let mut info = Tuning::untuned(config, table, None);
    for (name, s) in &mut info.thresholds {
        if *s == ThresholdSource::BuiltIn && record.thresholds.iter().any(|(n, _)| n == name) {
            *s = src;
        }
    }
    info.measured_at = Some(UNIX_EPOCH + Duration::from_secs(record.measured_unix));
    info.calibration = Some(Duration::from_millis(record.calib_ms));
    info.pair = Some(record.pair);
    info.tms = record.thresholds.iter().map(|(n, _)| n.clone()).collect();
    info.figures.clone_from(&record.figures);
    info.complete = record.complete;
    info
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::TmSpec;

    fn table3() -> TmTable {
        TmTable::new([
            TmSpec::copy("small", 16 << 10, "c"),
            TmSpec::gather("medium", usize::MAX, 16, "g"),
            TmSpec::gather("large", usize::MAX, 1, "r"),
        ])
        .unwrap()
    }

    /// One-way times of three TMs at the first `m` ladder sizes whose crossovers are at
    /// `a` (small → medium) and `b` (medium → large) bytes.
    fn curves(m: usize, a: usize, b: usize) -> Vec<Vec<Option<f64>>> {
        let mut t = vec![Vec::new(); 3];
        for &s in &LADDER[..m] {
            let best = s as f64 / 1000.0 + 5.0;
            t[0].push(Some(if s <= a { best } else { best * 2.0 }));
            t[1].push(Some(if s > a && s <= b { best } else { best * 1.5 }));
            t[2].push(Some(if s > b { best } else { best * 1.7 }));
        }
        t
    }

    #[test]
    fn crossovers_land_on_the_ladder_and_the_built_in_wins_ties() {
        let t = table3();
        let tun = tunable(&t);
        // Crossovers where the built-in table has them: the built-in thresholds.
        let same = choose(&t, &tun, &curves(17, 16 << 10, usize::MAX));
        assert_eq!(
            same,
            vec![
                ("small".into(), 16 << 10),
                ("medium".into(), usize::MAX),
                ("large".into(), usize::MAX)
            ]
        );
        // Elsewhere: the sizes of the ladder.
        let moved = choose(&t, &tun, &curves(17, 64 << 10, 1 << 20));
        assert_eq!(
            moved,
            vec![
                ("small".into(), 64 << 10),
                ("medium".into(), 1 << 20),
                ("large".into(), usize::MAX)
            ]
        );
        let tuned = Record {
            measured_unix: 1,
            calib_ms: 2,
            pair: (0, 1),
            complete: true,
            thresholds: moved,
            figures: Vec::new(),
        }
        .apply(&t)
        .unwrap();
        assert_eq!(tuned.tms()[0].max_len, 64 << 10);
        // Equal curves (noise): the built-in choice stays.
        let flat: Vec<Vec<Option<f64>>> = (0..3).map(|_| vec![Some(10.0); 17]).collect();
        assert_eq!(choose(&t, &tun, &flat), same);
        // A 2 % lead of another TM is within the margin.
        let mut near = flat.clone();
        near[1] = vec![Some(9.8); 17];
        assert_eq!(choose(&t, &tun, &near), same);
        // A calibration cut short keeps the built-in choice above the sizes it measured.
        let part: Vec<Vec<Option<f64>>> = curves(17, 2 << 10, usize::MAX)
            .into_iter()
            .map(|r| r[..8].to_vec())
            .collect();
        assert_eq!(
            choose(&t, &tun, &part),
            vec![
                ("small".into(), 2 << 10),
                ("medium".into(), usize::MAX),
                ("large".into(), usize::MAX)
            ]
        );
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let r = Record {
            measured_unix: 1_764_230_000,
            calib_ms: 412,
            pair: (0, 1),
            complete: false,
            thresholds: vec![("small".into(), 4096), ("medium".into(), usize::MAX)],
            figures: vec![
                (128, vec![Some(3.25), None]),
                (256, vec![Some(3.5), Some(9.0)]),
            ],
        };
        assert_eq!(Record::parse(&r.to_text()), Some(r.clone()));
        let plan = Plan::Cached(r.clone());
        assert_eq!(Plan::parse(&plan.to_text()), Some(plan));
        assert_eq!(Plan::parse("measure 3"), Some(Plan::Measure(3)));
        for bad in [
            "",
            "measured 1 2 3",
            "measured 1 2 0 1 1",
            "measured x 2 0 1 1\ntm a 1\ntm b max\n",
            "measured 1 2 0 1 2\ntm a 1\ntm b max\n",
            "measured 1 2 0 1 1\ntm a 1\n",
            "measured 1 2 0 1 1\ntm a 1\ntm b max\nfig 128 1.0\n",
            "measured 1 2 0 1 1\ntm a 1\ntm b max\nfig 128 NaN 1\n",
            "measured 1 2 0 1 1\ntm a 1 2\ntm b max\n",
            "\u{0}\u{1}",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
        // Names that are not the table's, decreasing thresholds: refused when applied.
        let t = table3();
        let mut wrong = r.clone();
        assert!(wrong.apply(&t).is_err());
        wrong.thresholds = vec![
            ("small".into(), 1 << 20),
            ("medium".into(), 4096),
            ("large".into(), usize::MAX),
        ];
        assert!(wrong.apply(&t).is_err());
        assert_eq!(
            utc(UNIX_EPOCH + Duration::from_secs(1_764_230_000)),
            "2025-11-27 07:53:20 UTC"
        );
    }

    #[test]
    fn the_tms_are_measured_in_alternation() {
        let s = schedule(&[0, 2, 5], 1);
        assert_eq!(s.len(), 3 * BATCHES as usize);
        for (b, round) in s.chunks(3).enumerate() {
            let mut r = round.to_vec();
            r.sort_unstable();
            assert_eq!(r, [0, 2, 5], "round {b}: every TM once");
        }
        // The order rotates: no TM always goes first.
        let firsts: std::collections::HashSet<usize> = s.chunks(3).map(|r| r[0]).collect();
        assert_eq!(firsts.len(), 3);
        assert_eq!(schedule(&[4], 0), vec![4; BATCHES as usize]);
    }

    #[test]
    fn batches_last_about_the_same_time_at_every_speed() {
        // A batch is about BATCH_US whatever one round trip costs, within the bounds.
        for one_way in [1.0, 3.0, 17.0, 60.0] {
            let r = rounds_for(one_way);
            let us = r as f64 * 2.0 * one_way;
            assert!(
                (BATCH_US..BATCH_US + 2.0 * one_way).contains(&us),
                "{one_way} µs: {r} round trips"
            );
        }
        assert_eq!(rounds_for(0.0), MAX_ROUNDS);
        assert_eq!(rounds_for(1e6), 1);
        assert_eq!(warm_for(128, 1), 3);
        assert_eq!(warm_for(128, 200), 50);
        assert_eq!(warm_for(1 << 20, 1), 1);
    }

    #[test]
    fn partners() {
        assert_eq!(partner(0, 1, &[0], false), None);
        assert_eq!(partner(3, 4, &[3], false), Some(1));
        assert_eq!(partner(0, 4, &[0, 2, 3], true), Some(2));
        assert_eq!(partner(2, 4, &[0, 2, 3], true), Some(2));
        assert_eq!(partner(1, 4, &[1], true), None);
    }
}
