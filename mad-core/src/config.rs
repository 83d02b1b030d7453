//! Channel configuration: by name, in code, from the environment, or from a small file.
//!
//! A channel spec is `driver[:adapter][,key=value]...`, for example `tcp`,
//! `tcp:127.0.0.1,progress=poll`, `shm`, `via:soft`, `sisci:local,checked=true`,
//! `tcp,tm.small=2048` (threshold override of the TM named `small`).
//!
//! Lookup order for `Session::open_channel(name)`:
//! 1. the environment variable `MAD_CHANNEL_<NAME>` (name upper-cased, `-` and `.` as `_`);
//! 2. the file named by `MAD_CONFIG`, lines `name = spec` (`#` starts a comment);
//! 3. the built-in `default` channel, which is `tcp` (loopback).
//!
//! `MAD_CHECKED=1` turns checked mode on for every channel, including channels configured in
//! code (`MAD_CHECKED=0` only sets the default of channels opened by name);
//! `MAD_PROGRESS=poll|block|adaptive` and `MAD_TIMEOUT_MS=<ms>` set the progress policy and
//! operation timeout of every channel opened by name whose spec does not say otherwise.
//!
//! Everything is checked strictly, and nothing malformed is ignored: the core keys
//! ([`CORE_KEYS`]) are accepted by every driver; each driver declares its adapters and option
//! keys ([`DriverOptions`], returned by [`Driver::accepted_options`](crate::driver::Driver::accepted_options)),
//! which the session checks ([`ChannelConfig::check_against`]) before the driver sees the
//! configuration; numeric options are range-checked ([`ChannelConfig::option_in`],
//! [`ChannelConfig::option_size_in`]) before any system call. A spec with an empty key or
//! value, or a key given twice, a variable that is not UTF-8, a `MAD_CONFIG` that is not a
//! regular file of at most [`MAX_CONFIG_FILE`] bytes, or a channel defined twice in it, is
//! [`Error::BadConfig`].

use std::collections::BTreeMap;
use std::fmt::Display;
use std::io::Read;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::progress::{ProgressMode, ProgressPolicy};

/// The keys every channel accepts, whatever its driver (`tm.<name>` stands for any TM name).
pub const CORE_KEYS: &[&str] = &[
    "checked",
    "progress",
    "timeout_ms",
    "local_only",
    "tm.<name>",
    "tune",
    "tune_cache",
    "tune_budget_ms",
    "ranks",
];

/// The largest `timeout_ms` (and `MAD_TIMEOUT_MS`): one year. 0 means no timeout.
pub const MAX_TIMEOUT_MS: u64 = 365 * 24 * 3600 * 1000;

/// Every environment variable a crate of this project reads, with its meaning (`mad-info`
/// prints this table). `<NAME>` stands for a channel name in upper case, `-` and `.` as `_`
/// ([`env_key`]). The last group is read by benchmarks, test kits and examples only.
pub const ENV_VARS: &[(&str, &str)] = &[
    // Channels (mad-core, `config` and `session`).
    ("MAD_CHANNEL_<NAME>", "spec of channel <NAME> opened by name (`MAD_CHANNEL_DEFAULT=shm`, `tcp:10.0.0.1,tm.small=4096`)"),
    ("MAD_CONFIG", "path of a file of `name = spec` lines, read when MAD_CHANNEL_<NAME> is not set"),
    ("MAD_CHECKED", "1: checked mode on every channel (also those configured in code); 0: default of channels opened by name"),
    ("MAD_PROGRESS", "poll|block|adaptive: progress mode of channels opened by name whose spec says none"),
    ("MAD_TIMEOUT_MS", "operation timeout (ms, 0 = none) of channels opened by name whose spec says none"),
    ("MAD_OPEN_TIMEOUT_MS", "bound on a channel open (ms) when the spec has no open_timeout_ms (default 60 s)"),
    ("MAD_PROTO_INFO", "1: rank 0 prints each channel's selection table on stderr when it opens"),
    ("MAD_TUNE_CACHE", "directory of the `tune=auto` threshold cache (`off`: no cache) when the spec has no tune_cache"),
    ("XDG_CACHE_HOME", "`tune=auto`: the threshold cache is $XDG_CACHE_HOME/madeleine"),
    ("HOME", "`tune=auto`: the threshold cache is $HOME/.cache/madeleine when XDG_CACHE_HOME is not set"),
    // Sessions started by madrun (set by madrun, read by mad-core's launch module).
    ("MAD_BOOTSTRAP", "ip:port of madrun's bootstrap server (its presence means: started by madrun)"),
    ("MAD_RANK", "this process's rank (set by madrun)"),
    ("MAD_SIZE", "number of processes of the job (set by madrun)"),
    ("MAD_SECRET", "the job's session secret, hex (set by madrun)"),
    ("MAD_LOCAL_SIZE", "processes of the job on this host (set by madrun)"),
    ("MAD_JOB", "job identifier (set by madrun)"),
    ("MAD_BOOTSTRAP_TIMEOUT_MS", "connect/handshake timeout towards the bootstrap server (ms)"),
    // PMI-1 process managers (srun --mpi=pmi2, MPICH's mpiexec): the PMI bootstrap.
    ("PMI_FD", "PMI-1 process manager: the connected socket (its presence means: the PMI bootstrap)"),
    ("MAD_PMI_COLLECTIVES", "server (default) | pmi: the PMI bootstrap's collectives through rank 0's bootstrap server or over PMI"),
    // MPI launchers, detected so that a build without MPI refuses to run as a rank of one.
    ("OMPI_COMM_WORLD_RANK", "Open MPI launcher: rank (with OMPI_COMM_WORLD_SIZE)"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI launcher: job size"),
    ("PMI_RANK", "MPICH Hydra or Slurm PMI: rank (with PMI_SIZE; the PMI bootstrap's rank)"),
    ("PMI_SIZE", "MPICH Hydra or Slurm PMI: job size (the PMI bootstrap's size)"),
    ("HYDI_CONTROL_FD", "MPICH Hydra's marker (tells Hydra from Slurm)"),
    ("SLURM_PROCID", "Slurm: rank (a launcher only in a job step or with PMI_*/PMIX_RANK set)"),
    ("SLURM_STEP_ID", "Slurm: job step (tells Slurm from Hydra)"),
    ("SLURM_STEP_NUM_TASKS", "Slurm: step size"),
    ("SLURM_NTASKS", "Slurm: job size when SLURM_STEP_NUM_TASKS is not set"),
    ("PMIX_RANK", "PMIx: marks srun as an MPI launcher"),
    ("PMI_FD", "PMI: marks srun as an MPI launcher"),
    ("PMI_JOBID", "PMI: marks srun as an MPI launcher"),
    // mad-mpi.
    ("MAD_MPI_THREAD_LEVEL", "MPI threading level to request: single|funneled|serialized|multiple (default multiple)"),
    ("MAD_MPI_SERIALISE", "1: every MPI call under one process-wide lock even when MULTIPLE is granted"),
    // The tools and examples (the madeleine package).
    ("MAD_LOG", "tracing filter of the tools and examples (env-filter syntax: `mad_core=debug,mad_tcp=info`; default warn)"),
    ("RUST_LOG", "the same filter, when MAD_LOG is not set"),
    ("PATH", "madrun: where a program named without a `/` is looked for"),
    // Benchmarks, test kits, examples.
    ("MAD_KIT_CASES", "conformance kit: comma-separated cases to run"),
    ("MAD_KIT_BIG", "conformance kit: 1 adds the 64 MiB pieces"),
    ("ENGINE_LOOP", "benches/engine.rs: run N one-piece round trips without criterion (for callgrind)"),
    ("ENGINE_LOOP_CALLS", "benches/engine.rs with ENGINE_LOOP: which calls the round trips use (blocking, polled or async)"),
    ("FIG4_ORDER", "mad-via figure4 bench: `rotate` brings back the old rotated fixed order of the variants"),
    ("FIG4_SHARED_BUFFER", "mad-via figure4 bench: set: one buffer shared by every variant (the old, biased schedule)"),
    ("FIG4_REPS", "mad-via figure4 bench: repetitions per size"),
    ("FIG4_BUDGET_MS", "mad-via figure4 bench: time budget per point (ms)"),
    ("FIG4_EXTRA", "mad-via figure4 bench: options appended to every variant's spec (`,progress=poll`)"),
    ("FIG4_CSV", "mad-via figure4 bench: CSV output path"),
    ("FIG4_ADAPTIVE_EXTRA", "mad-via figure4 bench: options appended to the adaptive variants only (`,tm.small=max`: a wrong table the verdict must catch)"),
    ("FIG4_OWN_BUFFERS", "mad-via figure4 bench: set: one buffer per variant"),
    ("TUNE_SPECS", "benches/tune.rs: `;`-separated channel specs (default `shm,cma=auto;via:soft,regcache=0;tcp`)"),
    ("TUNE_REPS", "benches/tune.rs: repetitions per size"),
    ("TUNE_BUDGET_MS", "benches/tune.rs: time budget per point (ms)"),
    ("TUNE_ADAPTIVE_EXTRA", "benches/tune.rs: options appended to the tuned and built-in variants (a wrong table the verdict must catch)"),
    ("VCHAN_ROUNDS", "benches/vchan.rs: rounds of the virtual-channel comparison (default 7)"),
    ("VCHAN_ONLY", "benches/vchan.rs: run only the variants whose name contains this text"),
    ("VCHAN_PHASE", "benches/vchan.rs: `lat` or `bw`, only that phase (default both)"),
    ("TUNE_OPENS", "benches/tune.rs: opens timed per kind (calibration, untuned, cached)"),
    ("MPI_CALLS_RUNS", "mad-mpi mpi_calls example: runs"),
    ("MPI_CALLS_ITERS", "mad-mpi mpi_calls example: iterations per run"),
    ("MPI_CALLS_MT", "mad-mpi mpi_calls example: 1 requests MPI_THREAD_MULTIPLE"),
];

/// The largest `MAD_CONFIG` file read, in bytes.
pub const MAX_CONFIG_FILE: u64 = 1 << 20;

/// Which adapters (the part after `driver:`) a driver accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Adapters {
    /// None: `driver:anything` is refused.
    None,
    /// One of these names (or none, meaning the driver's default).
    OneOf(&'static [&'static str]),
    /// Any text, which the driver validates itself (an address, an interface); the string
    /// describes what is expected.
    Free(&'static str),
}

/// What a driver accepts in a channel spec besides the [`CORE_KEYS`]: its adapters and the
/// keys of its options. Checked by the session ([`ChannelConfig::check_against`]) before the
/// driver sees the configuration, so an unknown or misspelt key never goes unnoticed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverOptions {
    /// The adapters accepted.
    pub adapters: Adapters,
    /// The option keys accepted (besides the core keys).
    pub keys: &'static [&'static str],
}

impl DriverOptions {
    /// These adapters and these option keys.
    pub const fn new(adapters: Adapters, keys: &'static [&'static str]) -> Self {
        DriverOptions { adapters, keys }
    }

    /// No adapter and no option of its own.
    pub const NONE: DriverOptions = DriverOptions {
        adapters: Adapters::None,
        keys: &[],
    };
}

/// The configuration of one channel.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChannelConfig {
    /// The channel's name (what `open_channel` was called with).
    pub name: String,
    /// The driver (`tcp`, `shm`, `mpi`, `via`, `sisci`).
    pub driver: String,
    /// The adapter or backend (`127.0.0.1`, `soft`, `local`, ...); driver-defined.
    pub adapter: Option<String>,
    /// Checked mode: every piece carries a descriptor and mismatches are reported.
    pub checked: bool,
    /// Progress mode (the session fills `oversubscribed`).
    pub progress: ProgressMode,
    /// Operation timeout (dead or black-holed peers).
    pub op_timeout: Option<Duration>,
    /// TM threshold overrides: TM name → new `max_len`.
    pub thresholds: BTreeMap<String, usize>,
    /// Other driver-specific options.
    pub options: BTreeMap<String, String>,
    /// For a driver that reaches only its own host
    /// ([`Capabilities::intra_node_only`](crate::driver::Capabilities::intra_node_only)): open
    /// the channel even when the session has ranks on other hosts, connecting the ranks of
    /// each host only (a message to another host's rank fails with [`Error::BadConfig`]).
    /// Without it such an open fails. Spec key `local_only=true`.
    pub local_only: bool,
    /// Threshold tuning at open (`tune=off|auto|refresh`, see [`crate::tune`]).
    pub tune: Tune,
    /// Where `tune=auto` caches its measurements (`tune_cache=<dir>|off`).
    pub tune_cache: TuneCache,
    /// Bound on the calibration of `tune=auto` (`tune_budget_ms=`, default
    /// [`crate::tune::DEFAULT_BUDGET`]).
    pub tune_budget: Duration,
    /// The ranks this channel joins (`ranks=0-2:5`): the driver connects these ranks among
    /// themselves only, a rank outside the set opens a channel with no peer, and a message to
    /// a rank the channel does not reach fails with [`Error::BadConfig`]. `None`: every rank.
    pub ranks: Option<RankSet>,
    /// The real channels of a virtual channel (driver `virtual`, see [`crate::vchan`]), in
    /// order of preference; empty for a real channel.
    pub parts: Vec<ChannelConfig>,
}

/// A set of ranks, written as ranges separated by `:` (`0-2:5:7-9`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RankSet(Vec<(usize, usize)>);

impl RankSet {
    /// Parse `0-2:5:7-9` (inclusive ranges and single ranks, separated by `:`).
    pub fn parse(v: &str) -> Option<RankSet> {
        let mut out = Vec::new();
        for item in v.split(':') {
            let item = item.trim();
            let (a, b) = match item.split_once('-') {
                Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
                None => {
                    let r = item.parse().ok()?;
                    (r, r)
                }
            };
            if a > b {
                return None;
            }
            out.push((a, b));
        }
        (!out.is_empty()).then_some(RankSet(out))
    }

    /// The set of exactly these ranks.
    pub fn of(ranks: impl IntoIterator<Item = usize>) -> RankSet {
        RankSet(ranks.into_iter().map(|r| (r, r)).collect())
    }

    /// Whether `rank` is in the set.
    pub fn contains(&self, rank: usize) -> bool {
        self.0.iter().any(|&(a, b)| (a..=b).contains(&rank))
    }

    /// The largest rank named.
    pub fn max(&self) -> usize {
        self.0.iter().map(|&(_, b)| b).max().unwrap_or(0)
    }
}

impl Display for RankSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, &(a, b)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            if a == b {
                write!(f, "{a}")?;
            } else {
                write!(f, "{a}-{b}")?;
            }
        }
        Ok(())
    }
}

/// Split `s` at every `sep` outside square brackets (the parts of a virtual channel's spec,
/// `virtual:[shm,ranks=0-1]+tcp`, hold commas of their own).
pub fn split_spec(s: &str, sep: char) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            c if c == sep && depth == 0 => {
                out.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// The core keys a virtual channel's spec hands down to every part that does not set them.
const HANDED_DOWN: &[&str] = &[
    "checked",
    "progress",
    "timeout_ms",
    "tune",
    "tune_cache",
    "tune_budget_ms",
    "open_timeout_ms",
];

/// Whether a channel measures its TM thresholds when it opens (`tune=...`, see
/// [`crate::tune`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tune {
    /// `tune=off` (the default): the driver's built-in thresholds.
    #[default]
    Off,
    /// `tune=auto`: the thresholds cached for this host, driver, configuration, build and
    /// kernel, else measured between two ranks at open (then cached).
    Auto,
    /// `tune=refresh`: measured at open even when cached, and the cache rewritten.
    Refresh,
}

impl Tune {
    /// The spelling in a channel spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Tune::Off => "off",
            Tune::Auto => "auto",
            Tune::Refresh => "refresh",
        }
    }
}

/// Where `tune=auto` keeps its measurements (`tune_cache=<dir>|off`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TuneCache {
    /// `MAD_TUNE_CACHE`, else `$XDG_CACHE_HOME/madeleine`, else `$HOME/.cache/madeleine`.
    #[default]
    Default,
    /// No cache: every open measures.
    Off,
    /// This directory.
    Dir(std::path::PathBuf),
}

impl ChannelConfig {
    /// A channel named `name` over `driver`, with defaults for everything else.
    pub fn new(name: impl Into<String>, driver: impl Into<String>) -> Self {
        ChannelConfig {
            name: name.into(),
            driver: driver.into(),
            adapter: None,
            checked: false,
            progress: ProgressPolicy::default().mode,
            op_timeout: None,
            thresholds: BTreeMap::new(),
            options: BTreeMap::new(),
            local_only: false,
            tune: Tune::Off,
            tune_cache: TuneCache::Default,
            tune_budget: crate::tune::DEFAULT_BUDGET,
            ranks: None,
            parts: Vec::new(),
        }
    }

    /// Join only `ranks` (`ranks=`, see the field of that name).
    #[must_use]
    pub fn ranks(mut self, ranks: RankSet) -> Self {
        self.ranks = Some(ranks);
        self
    }

    /// A virtual channel named `name` over `parts`, in order of preference (see
    /// [`crate::vchan`]).
    pub fn virtual_over(name: impl Into<String>, parts: Vec<ChannelConfig>) -> Self {
        let mut c = ChannelConfig::new(name, crate::vchan::DRIVER);
        c.adapter = Some(
            parts
                .iter()
                .map(|p| format!("[{}]", p.driver))
                .collect::<Vec<_>>()
                .join("+"),
        );
        c.parts = parts;
        c
    }

    /// Whether this is a virtual channel (driver `virtual`).
    pub fn is_virtual(&self) -> bool {
        self.driver == crate::vchan::DRIVER
    }

    /// Set the threshold tuning (`tune=`).
    #[must_use]
    pub fn tune(mut self, t: Tune) -> Self {
        self.tune = t;
        self
    }

    /// Set where the tuning is cached (`tune_cache=`).
    #[must_use]
    pub fn tune_cache(mut self, c: TuneCache) -> Self {
        self.tune_cache = c;
        self
    }

    /// Set the adapter.
    #[must_use]
    pub fn adapter(mut self, adapter: impl Into<String>) -> Self {
        self.adapter = Some(adapter.into());
        self
    }

    /// Turn checked mode on or off.
    #[must_use]
    pub fn checked(mut self, on: bool) -> Self {
        self.checked = on;
        self
    }

    /// Set `local_only` (see the field of that name).
    #[must_use]
    pub fn local_only(mut self, on: bool) -> Self {
        self.local_only = on;
        self
    }

    /// Set the progress mode.
    #[must_use]
    pub fn progress(mut self, mode: ProgressMode) -> Self {
        self.progress = mode;
        self
    }

    /// Set the operation timeout.
    #[must_use]
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = Some(t);
        self
    }

    /// Override the `max_len` threshold of the TM named `tm`.
    #[must_use]
    pub fn threshold(mut self, tm: impl Into<String>, max_len: usize) -> Self {
        self.thresholds.insert(tm.into(), max_len);
        self
    }

    /// Set a driver-specific option.
    #[must_use]
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// A driver-specific option parsed as `T`, with a clear error if it does not parse.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the key and the value when the option
    /// does not parse as `T`.
    pub fn option_parsed<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>> {
        match self.options.get(key) {
            None => Ok(None),
            Some(v) => v.trim().parse().map(Some).map_err(|_| {
                Error::BadConfig(format!(
                    "channel `{}`: option {key}={v} is not valid",
                    self.name
                ))
            }),
        }
    }

    /// A numeric driver option, which must lie in `min..=max` (checked before the driver
    /// makes any system call with it): `BadConfig` naming the key, the value and the range.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the key, the value and the range when
    /// the option does not parse or lies outside `min..=max`.
    pub fn option_in<T>(&self, key: &str, min: T, max: T) -> Result<Option<T>>
    where
        T: FromStr + PartialOrd + Display + Copy,
    {
        let Some(v) = self.options.get(key) else {
            return Ok(None);
        };
        match v.trim().parse::<T>() {
            Ok(n) if n >= min && n <= max => Ok(Some(n)),
            _ => Err(Error::BadConfig(format!(
                "channel `{}`: {key}={v}: expected a whole number from {min} to {max}",
                self.name
            ))),
        }
    }

    /// A size option (`4096`, `64k`, `1m`, see [`parse_size`]), which must lie in
    /// `min..=max` bytes: `BadConfig` naming the key, the value and the range.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the key, the value and the range when
    /// the option is not a size or lies outside `min..=max`.
    pub fn option_size_in(&self, key: &str, min: usize, max: usize) -> Result<Option<usize>> {
        let Some(v) = self.options.get(key) else {
            return Ok(None);
        };
        match parse_size(v) {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(Error::BadConfig(format!(
                "channel `{}`: {key}={v}: expected a size from {} to {} (e.g. 4096, 64k, 1m)",
                self.name,
                show_size(min),
                show_size(max)
            ))),
        }
    }

    /// An option that takes one of `choices`.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the key and listing `choices` when the
    /// option is not one of them.
    pub fn option_choice(
        &self,
        key: &str,
        choices: &[&'static str],
    ) -> Result<Option<&'static str>> {
        let Some(v) = self.options.get(key) else {
            return Ok(None);
        };
        choices
            .iter()
            .find(|c| **c == v.trim())
            .copied()
            .map(Some)
            .ok_or_else(|| {
                Error::BadConfig(format!(
                    "channel `{}`: {key}={v}: expected one of {}",
                    self.name,
                    choices.join(", ")
                ))
            })
    }

    /// Check the adapter and the option keys against what the driver accepts: an adapter
    /// given to a driver that takes none or not among its names, or a key that is neither a
    /// core key nor one of the driver's, is `BadConfig` naming it and listing the valid ones.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the adapter or the key that the driver
    /// does not accept, with the valid ones.
    pub fn check_against(&self, accepted: &DriverOptions) -> Result<()> {
        let name = &self.name;
        let driver = &self.driver;
        match (&self.adapter, accepted.adapters) {
            (None, _) | (Some(_), Adapters::Free(_)) => {}
            (Some(a), Adapters::None) => {
                return Err(Error::BadConfig(format!(
                    "channel `{name}`: driver `{driver}` takes no adapter (got `{driver}:{a}`); use `{driver}`"
                )))
            }
            (Some(a), Adapters::OneOf(list)) => {
                if !list.contains(&a.as_str()) {
                    return Err(Error::BadConfig(format!(
                        "channel `{name}`: driver `{driver}` has no adapter `{a}`; valid: {}",
                        list.join(", ")
                    )));
                }
            }
        }
        for k in self.options.keys() {
            if accepted.keys.contains(&k.as_str()) {
                continue;
            }
            let mut valid: Vec<&str> = accepted.keys.to_vec();
            valid.extend_from_slice(CORE_KEYS);
            let hint = if CORE_KEYS.contains(&k.as_str()) || k.starts_with("tm.") {
                " (a core key: set it with the ChannelConfig field, not as a driver option)"
            } else {
                ""
            };
            return Err(Error::BadConfig(format!(
                "channel `{name}`: unknown option `{k}` for driver `{driver}`{hint}; valid keys: {}",
                valid.join(", ")
            )));
        }
        Ok(())
    }

    /// Parse a spec (`driver[:adapter][,key=value]...`) for the channel `name`.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] when the spec does not parse: an empty driver,
    /// a malformed `key=value`, a core key's value that does not parse (progress mode, timeout,
    /// threshold).
    pub fn parse(name: &str, spec: &str) -> Result<Self> {
        let spec = spec.trim();
        let mut parts = split_spec(spec, ',').into_iter();
        let head = parts.next().unwrap_or("").trim();
        if head.is_empty() {
            return Err(Error::BadConfig(format!(
                "channel `{name}`: empty spec (expected driver[:adapter])"
            )));
        }
        let (driver, adapter) = match head.split_once(':') {
            Some((d, a)) => {
                let a = a.trim();
                if a.is_empty() {
                    return Err(Error::BadConfig(format!(
                        "channel `{name}`: empty adapter after `{}:`; give one or drop the `:`",
                        d.trim()
                    )));
                }
                (d.trim(), Some(a.to_string()))
            }
            None => (head, None),
        };
        if driver.is_empty()
            || !driver
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(Error::BadConfig(format!(
                "channel `{name}`: bad driver name `{driver}`"
            )));
        }
        let mut c = ChannelConfig::new(name, driver);
        c.adapter = adapter;
        let mut seen: Vec<&str> = Vec::new();
        for kv in parts {
            let kv = kv.trim();
            if kv.is_empty() {
                continue;
            }
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                Error::BadConfig(format!("channel `{name}`: `{kv}` is not key=value"))
            })?;
            let (k, v) = (k.trim(), v.trim());
            if k.is_empty() {
                return Err(Error::BadConfig(format!(
                    "channel `{name}`: `{kv}` has no key before `=`"
                )));
            }
            if v.is_empty() {
                return Err(Error::BadConfig(format!(
                    "channel `{name}`: {k}= has an empty value"
                )));
            }
            if seen.contains(&k) {
                return Err(Error::BadConfig(format!(
                    "channel `{name}`: option `{k}` is given twice"
                )));
            }
            seen.push(k);
            c.set(k, v)?;
        }
        if c.is_virtual() {
            c.parse_parts(spec)?;
        }
        Ok(c)
    }

    /// The parts of a virtual channel's spec (`virtual:[shm,ranks=0-1]+tcp,progress=block`):
    /// each part between brackets (or a bare `driver[:adapter]`) is a channel spec of its own,
    /// and the core keys of the whole ([`HANDED_DOWN`]) go to every part that does not set them.
    fn parse_parts(&mut self, spec: &str) -> Result<()> {
        let name = self.name.clone();
        let bad = |what: String| Error::BadConfig(format!("channel `{name}`: {what}"));
        let outer: Vec<(&str, &str)> = split_spec(spec, ',')
            .into_iter()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.trim(), v.trim()))
            .collect();
        if let Some((k, _)) = outer.iter().find(|(k, _)| !HANDED_DOWN.contains(k)) {
            return Err(bad(format!(
                "option `{k}` applies to one real channel of a virtual channel: give it inside                  that part's brackets (`virtual:[shm,{k}=...]+tcp`); the virtual channel itself                  takes {}",
                HANDED_DOWN.join(", ")
            )));
        }
        let list = self.adapter.clone().unwrap_or_default();
        let mut parts = Vec::new();
        for (i, p) in split_spec(&list, '+').into_iter().enumerate() {
            let p = p.trim();
            let inner = match p.strip_prefix('[') {
                Some(rest) => rest
                    .strip_suffix(']')
                    .ok_or_else(|| bad(format!("part `{p}` opens `[` without closing it")))?,
                None => p,
            };
            let own: Vec<&str> = split_spec(inner, ',')
                .into_iter()
                .skip(1)
                .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim()))
                .collect();
            let mut text = inner.to_string();
            for (k, v) in &outer {
                if !own.contains(k) {
                    text.push_str(&format!(",{k}={v}"));
                }
            }
            let part = ChannelConfig::parse(&format!("{name}.{i}"), &text)?;
            if part.is_virtual() {
                return Err(bad(format!(
                    "part `{p}` is itself virtual; list its real channels instead"
                )));
            }
            parts.push(part);
        }
        if parts.is_empty() || list.trim().is_empty() {
            return Err(bad(
                "a virtual channel lists its real channels: `virtual:shm+tcp`".to_string(),
            ));
        }
        self.parts = parts;
        Ok(())
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let bad =
            |what: &str| Error::BadConfig(format!("channel `{}`: {k}={v}: {what}", self.name));
        match k {
            "checked" => self.checked = parse_bool(v).ok_or_else(|| bad("expected true/false"))?,
            "local_only" => {
                self.local_only = parse_bool(v).ok_or_else(|| bad("expected true/false"))?
            }
            "progress" => self.progress = ProgressPolicy::parse_mode(v)?,
            "ranks" => {
                self.ranks =
                    Some(RankSet::parse(v).ok_or_else(|| {
                        bad("expected ranks and ranges separated by `:`, e.g. 0-2:5")
                    })?)
            }
            "tune" => {
                self.tune = match v {
                    "off" => Tune::Off,
                    "auto" => Tune::Auto,
                    "refresh" => Tune::Refresh,
                    _ => return Err(bad("expected off, auto or refresh")),
                }
            }
            "tune_budget_ms" => {
                self.tune_budget = match v.parse::<u64>() {
                    Ok(ms) if (1..=600_000).contains(&ms) => Duration::from_millis(ms),
                    _ => return Err(bad("expected milliseconds from 1 to 600000")),
                }
            }
            "tune_cache" => {
                self.tune_cache = if v == "off" {
                    TuneCache::Off
                } else if v.starts_with('/') {
                    TuneCache::Dir(v.into())
                } else {
                    return Err(bad("expected an absolute directory or off"));
                }
            }
            "timeout_ms" => {
                self.op_timeout = parse_timeout_ms(v).ok_or_else(|| {
                    bad(&format!(
                        "expected milliseconds from 0 (no timeout) to {MAX_TIMEOUT_MS}"
                    ))
                })?
            }
            _ => {
                if let Some(tm) = k.strip_prefix("tm.") {
                    if tm.is_empty() {
                        return Err(bad("expected tm.<TM name>=<size>"));
                    }
                    let n = parse_size(v)
                        .ok_or_else(|| bad("expected a size (e.g. 4096, 64k, 1m, max)"))?;
                    self.thresholds.insert(tm.to_string(), n);
                } else {
                    self.options.insert(k.to_string(), v.to_string());
                }
            }
        }
        Ok(())
    }

    /// Apply the session-wide environment defaults (`MAD_CHECKED`, `MAD_PROGRESS`,
    /// `MAD_TIMEOUT_MS`) where the spec did not set them.
    pub(crate) fn apply_env_defaults(&mut self, spec_keys: &[&str]) -> Result<()> {
        if !spec_keys.contains(&"checked") {
            if let Some(v) = env_var("MAD_CHECKED")? {
                self.checked = parse_bool(&v).ok_or_else(|| {
                    Error::BadConfig(format!("MAD_CHECKED={v}: expected 0/1/true/false"))
                })?;
            }
        }
        if !spec_keys.contains(&"progress") {
            if let Some(v) = env_var("MAD_PROGRESS")? {
                self.progress = ProgressPolicy::parse_mode(&v)
                    .map_err(|e| Error::BadConfig(format!("MAD_PROGRESS={v}: {e}")))?;
            }
        }
        if !spec_keys.contains(&"timeout_ms") {
            if let Some(v) = env_var("MAD_TIMEOUT_MS")? {
                self.op_timeout = parse_timeout_ms(&v).ok_or_else(|| {
                    Error::BadConfig(format!(
                        "MAD_TIMEOUT_MS={v}: expected milliseconds from 0 (no timeout) to {MAX_TIMEOUT_MS}"
                    ))
                })?;
            }
        }
        Ok(())
    }

    /// Resolve a channel by name from the environment, the `MAD_CONFIG` file and the built-in
    /// default, as described in the module documentation.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] when the environment, the `MAD_CONFIG` file or
    /// the spec found for `name` is wrong (unreadable or oversized file, a spec that does not
    /// parse, a variable that is not UTF-8).
    pub fn lookup(name: &str) -> Result<Self> {
        let (spec, origin) = Self::lookup_spec(name)?.ok_or_else(|| {
            Error::BadConfig(format!(
                "unknown channel `{name}`: define it with {}=driver[:adapter] or a line `{name} = driver[:adapter]` in the MAD_CONFIG file",
                env_key(name)
            ))
        })?;
        let keys: Vec<&str> = split_spec(&spec, ',')
            .into_iter()
            .skip(1)
            .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim()))
            .collect();
        // A virtual channel hands the environment's defaults down to its parts.
        let mut full = spec.clone();
        if spec.trim_start().starts_with("virtual:") {
            for (k, var) in [
                ("checked", "MAD_CHECKED"),
                ("progress", "MAD_PROGRESS"),
                ("timeout_ms", "MAD_TIMEOUT_MS"),
            ] {
                if !keys.contains(&k) {
                    if let Some(v) = env_var(var)? {
                        full.push_str(&format!(",{k}={v}"));
                    }
                }
            }
        }
        let mut c = Self::parse(name, &full)
            .map_err(|e| Error::BadConfig(format!("{e} (from {origin})")))?;
        c.apply_env_defaults(&keys)?;
        Ok(c)
    }

    fn lookup_spec(name: &str) -> Result<Option<(String, String)>> {
        let key = env_key(name);
        if let Some(v) = env_var(&key)? {
            return Ok(Some((v, key)));
        }
        if let Some(path) = std::env::var_os("MAD_CONFIG") {
            let path = std::path::PathBuf::from(path);
            let text = read_config_file(&path)?;
            let shown = path.display();
            if let Some((line, spec)) = config_file_entries(&text, &shown.to_string())?
                .into_iter()
                .find(|(_, n, _)| *n == name)
                .map(|(line, _, spec)| (line, spec))
            {
                return Ok(Some((spec.to_string(), format!("{shown}:{line}"))));
            }
        }
        if name == "default" {
            return Ok(Some(("tcp".to_string(), "built-in default".to_string())));
        }
        Ok(None)
    }
}

/// Read the `MAD_CONFIG` file: a regular file (checked on the opened descriptor, which is
/// opened non-blocking so that a FIFO cannot block the open) of at most [`MAX_CONFIG_FILE`]
/// bytes, read with a bounded read, in UTF-8.
fn read_config_file(path: &std::path::Path) -> Result<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let shown = path.display();
    let bad = |what: String| Error::BadConfig(format!("MAD_CONFIG={shown}: {what}"));
    // A quick look first (no open at all for a device or a FIFO), then the authoritative
    // check on the descriptor actually read (the path may have changed in between).
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| bad(format!("cannot open: {e}")))?;
    let meta = f.metadata().map_err(|e| bad(format!("cannot stat: {e}")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let too_big = || {
        bad(format!(
            "larger than the {MAX_CONFIG_FILE}-byte limit of a configuration file"
        ))
    };
    if meta.len() > MAX_CONFIG_FILE {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    (&mut f)
        .take(MAX_CONFIG_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read: {e}")))?;
    if bytes.len() as u64 > MAX_CONFIG_FILE {
        return Err(too_big());
    }
    String::from_utf8(bytes).map_err(|e| {
        bad(format!(
            "not UTF-8 (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The `(line number, channel name, spec)` entries of a configuration file's text; `path`
/// names it in errors. Every line is checked, not only the one looked for: a malformed line, an
/// empty name or spec, or a channel defined twice is `BadConfig` (naming both lines).
fn config_file_entries<'a>(text: &'a str, path: &str) -> Result<Vec<(usize, &'a str, &'a str)>> {
    let mut entries: Vec<(usize, &str, &str)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let expected = || {
            Error::BadConfig(format!(
                "{path}:{n}: expected `name = driver[:adapter][,k=v]`"
            ))
        };
        let (name, spec) = line.split_once('=').ok_or_else(expected)?;
        let (name, spec) = (name.trim(), spec.trim());
        if name.is_empty() || spec.is_empty() {
            return Err(expected());
        }
        if let Some((first, _, _)) = entries.iter().find(|(_, m, _)| *m == name) {
            return Err(Error::BadConfig(format!(
                "{path}: channel `{name}` is defined twice, on lines {first} and {n}"
            )));
        }
        entries.push((n, name, spec));
    }
    Ok(entries)
}

/// An environment variable: `None` when unset, `BadConfig` naming it when it is not UTF-8
/// (never silently treated as unset).
///
/// # Errors
///
/// [`Error::BadConfig`] naming the variable when its value is not UTF-8.
pub fn env_var(key: &str) -> Result<Option<String>> {
    match std::env::var(key) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::BadConfig(format!(
            "{key} is not valid UTF-8 ({})",
            v.to_string_lossy()
        ))),
    }
}

fn parse_timeout_ms(v: &str) -> Option<Option<Duration>> {
    match v.trim().parse::<u64>() {
        Ok(0) => Some(None),
        Ok(ms) if ms <= MAX_TIMEOUT_MS => Some(Some(Duration::from_millis(ms))),
        _ => None,
    }
}

fn show_size(n: usize) -> String {
    match n {
        usize::MAX => "max".into(),
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{}g", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}m", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}k", n >> 10),
        n => n.to_string(),
    }
}

/// True when `MAD_CHECKED` asks for checked mode (an error if it is not a boolean).
pub(crate) fn env_forces_checked() -> Result<bool> {
    match env_var("MAD_CHECKED")? {
        None => Ok(false),
        Some(v) => parse_bool(&v)
            .ok_or_else(|| Error::BadConfig(format!("MAD_CHECKED={v}: expected 0/1/true/false"))),
    }
}

/// The environment variable that configures channel `name`.
pub fn env_key(name: &str) -> String {
    let n: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("MAD_CHANNEL_{n}")
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Parse `4096`, `64k`, `1m`, `max`.
pub fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim().to_ascii_lowercase();
    if v == "max" || v == "inf" {
        return Some(usize::MAX);
    }
    let (num, mult) = match v.chars().last()? {
        'k' => (&v[..v.len() - 1], 1usize << 10),
        'm' => (&v[..v.len() - 1], 1 << 20),
        'g' => (&v[..v.len() - 1], 1 << 30),
        _ => (&v[..], 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_specs() {
        let c = ChannelConfig::parse(
            "x",
            "tcp:127.0.0.1,progress=poll,checked=1,tm.small=2k,foo=bar",
        )
        .unwrap();
        assert_eq!(c.driver, "tcp");
        assert_eq!(c.adapter.as_deref(), Some("127.0.0.1"));
        assert_eq!(c.progress, ProgressMode::Poll);
        assert!(c.checked);
        assert_eq!(c.thresholds["small"], 2048);
        assert_eq!(c.options["foo"], "bar");
        assert_eq!(
            ChannelConfig::parse("x", "via:soft")
                .unwrap()
                .adapter
                .as_deref(),
            Some("soft")
        );
        assert!(ChannelConfig::parse("x", "").is_err());
        assert!(ChannelConfig::parse("x", "tcp,oops").is_err());
        assert!(ChannelConfig::parse("x", "tcp,checked=maybe").is_err());
        assert!(ChannelConfig::parse("x", "tcp,tm.small=lots").is_err());
        assert!(ChannelConfig::parse("x", "t c p").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("max"), Some(usize::MAX));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("99999999999999999999g"), None);
    }

    #[test]
    fn env_keys() {
        assert_eq!(env_key("video-1"), "MAD_CHANNEL_VIDEO_1");
    }

    fn bad_config(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::BadConfig(m)) => m,
            other => panic!("expected BadConfig, got {other:?}"),
        }
    }

    #[test]
    fn malformed_specs_are_refused() {
        for (spec, want) in [
            ("tcp,=1", "no key"),
            ("tcp,checked=", "empty value"),
            ("tcp, liveness_ms = ", "empty value"),
            (
                "tcp,liveness_ms=1,liveness_ms=2",
                "`liveness_ms` is given twice",
            ),
            ("tcp,checked=1,checked=0", "`checked` is given twice"),
            ("tcp:", "empty adapter"),
            (":eth0", "bad driver name"),
            ("tcp,tm.=4k", "tm.<TM name>"),
            (
                "tcp,timeout_ms=99999999999999999999",
                "from 0 (no timeout) to",
            ),
            ("tcp,timeout_ms=31536000001", "from 0 (no timeout) to"),
            ("tcp,timeout_ms=-1", "from 0 (no timeout) to"),
        ] {
            let m = bad_config(ChannelConfig::parse("x", spec));
            assert!(m.contains(want), "{spec}: {m}");
        }
        let c = ChannelConfig::parse("x", "tcp,timeout_ms=0,").unwrap();
        assert_eq!(c.op_timeout, None);
        let c = ChannelConfig::parse("x", "tcp,timeout_ms=31536000000").unwrap();
        assert_eq!(c.op_timeout, Some(Duration::from_millis(MAX_TIMEOUT_MS)));
    }

    const TEST_DRIVER: DriverOptions = DriverOptions {
        adapters: Adapters::None,
        keys: &["ring", "cma"],
    };

    #[test]
    fn unknown_keys_and_adapters_are_refused_by_name() {
        let ok = ChannelConfig::parse("x", "shm,ring=4096,checked=1,tm.eager=2k").unwrap();
        ok.check_against(&TEST_DRIVER).unwrap();
        let m = bad_config(
            ChannelConfig::parse("x", "shm,chekced=true")
                .unwrap()
                .check_against(&TEST_DRIVER),
        );
        assert!(m.contains("unknown option `chekced`"), "{m}");
        assert!(
            m.contains("ring, cma, checked, progress, timeout_ms, local_only, tm.<name>"),
            "{m}"
        );
        // A core key put among the driver options (in code) is named as such.
        let m = bad_config(
            ChannelConfig::new("x", "shm")
                .option("checked", "1")
                .check_against(&TEST_DRIVER),
        );
        assert!(m.contains("a core key"), "{m}");
        // Adapters.
        let m = bad_config(
            ChannelConfig::parse("x", "shm:foo")
                .unwrap()
                .check_against(&TEST_DRIVER),
        );
        assert!(
            m.contains("takes no adapter") && m.contains("shm:foo"),
            "{m}"
        );
        let one_of = DriverOptions {
            adapters: Adapters::OneOf(&["soft", "verbs"]),
            keys: &[],
        };
        let m = bad_config(
            ChannelConfig::parse("x", "via:sfot")
                .unwrap()
                .check_against(&one_of),
        );
        assert!(
            m.contains("no adapter `sfot`") && m.contains("soft, verbs"),
            "{m}"
        );
        for spec in ["via", "via:verbs"] {
            let c = ChannelConfig::parse("x", spec).unwrap();
            c.check_against(&one_of).unwrap();
        }
        let free = DriverOptions {
            adapters: Adapters::Free("an address"),
            keys: &[],
        };
        let c = ChannelConfig::parse("x", "tcp:10.0.0.1").unwrap();
        c.check_against(&free).unwrap();
    }

    #[test]
    fn numeric_options_are_range_checked() {
        let c = ChannelConfig::parse("x", "tcp,liveness_ms=98301000,buffer=128m,n=0").unwrap();
        let m = bad_config(c.option_in::<u64>("liveness_ms", 1, 86_400_000));
        assert_eq!(
            m,
            "channel `x`: liveness_ms=98301000: expected a whole number from 1 to 86400000"
        );
        assert!(bad_config(c.option_in::<u64>("n", 1, 10)).contains("n=0"));
        let m = bad_config(c.option_size_in("buffer", 256, 64 << 20));
        assert_eq!(
            m,
            "channel `x`: buffer=128m: expected a size from 256 to 64m (e.g. 4096, 64k, 1m)"
        );
        assert_eq!(c.option_in::<u64>("absent", 1, 2).unwrap(), None);
        let c = ChannelConfig::parse("x", "tcp,a=1k,b=99999999999999999999,c=-1").unwrap();
        assert_eq!(c.option_size_in("a", 1, 1 << 20).unwrap(), Some(1024));
        bad_config(c.option_in::<u64>("b", 0, u64::MAX - 1));
        bad_config(c.option_in::<u32>("b", 0, u32::MAX));
        bad_config(c.option_in::<usize>("c", 0, 10));
        let c = ChannelConfig::parse("x", "shm,cma=maybe").unwrap();
        let m = bad_config(c.option_choice("cma", &["auto", "on"]));
        assert!(m.contains("expected one of auto, on"), "{m}");
    }

    #[test]
    fn non_utf8_variables_are_errors_not_unset() {
        use std::os::unix::ffi::OsStrExt;
        let key = "MAD_CHANNEL_CFGTEST_NON_UTF8";
        std::env::set_var(key, std::ffi::OsStr::from_bytes(b"tcp,checked=\xff"));
        let m = bad_config(ChannelConfig::lookup("cfgtest-non-utf8"));
        assert!(m.contains(key) && m.contains("not valid UTF-8"), "{m}");
        std::env::remove_var(key);
        assert_eq!(env_var(key).unwrap(), None);
    }

    fn temp(tag: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("mad-config-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    #[cfg_attr(miri, ignore = "FIFOs, /dev/zero and files: not under Miri")]
    fn config_files_are_bounded_regular_files() {
        // A device that never ends.
        let m = bad_config(read_config_file(std::path::Path::new("/dev/zero")));
        assert!(
            m.contains("/dev/zero") && m.contains("not a regular file"),
            "{m}"
        );
        // A FIFO nobody writes to: refused at once, never opened for a blocking read.
        let fifo = temp("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let t = std::time::Instant::now();
        let m = bad_config(read_config_file(&fifo));
        assert!(m.contains("not a regular file"), "{m}");
        assert!(t.elapsed() < Duration::from_secs(1));
        let _ = std::fs::remove_file(&fifo);
        // Too large.
        let big = temp("big");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_FILE as usize + 1]).unwrap();
        let m = bad_config(read_config_file(&big));
        assert!(m.contains("1048576-byte limit"), "{m}");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_FILE as usize]).unwrap();
        assert_eq!(
            read_config_file(&big).unwrap().len(),
            MAX_CONFIG_FILE as usize
        );
        // Not UTF-8.
        std::fs::write(&big, b"video = shm\n\xff\n").unwrap();
        let m = bad_config(read_config_file(&big));
        assert!(m.contains("not UTF-8"), "{m}");
        let _ = std::fs::remove_file(&big);
        // Missing.
        let m = bad_config(read_config_file(std::path::Path::new(
            "/nonexistent/mad.conf",
        )));
        assert!(m.contains("/nonexistent/mad.conf"), "{m}");
    }

    #[test]
    fn config_file_lines() {
        let text = "# channels\nvideo = shm # fast\n\ntext = tcp,checked=1\n";
        let e = config_file_entries(text, "f").unwrap();
        assert_eq!(e, vec![(2, "video", "shm"), (4, "text", "tcp,checked=1")]);
        let m = bad_config(config_file_entries("a = shm\nb = tcp\n a = tcp\n", "f"));
        assert_eq!(m, "f: channel `a` is defined twice, on lines 1 and 3");
        for bad in ["= tcp", "video =", "video shm"] {
            let m = bad_config(config_file_entries(&format!("ok = tcp\n{bad}\n"), "f"));
            assert!(m.starts_with("f:2: expected"), "{bad}: {m}");
        }
    }
}
