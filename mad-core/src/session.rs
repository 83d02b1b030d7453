//! Sessions: this process's rank, the session size, the bootstrap, the registered drivers and
//! the channels opened through them.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::bootstrap::{Bootstrap, HostIdentity, RankFailure, Scope, SingleBootstrap};
use crate::channel::{Channel, ChannelInner};
use crate::config::ChannelConfig;
use crate::config::Tune;
use crate::driver::{Driver, OpenContext};
use crate::error::{Error, Result};
use crate::progress::ProgressPolicy;
use crate::tune::{self, Plan, Record, ThresholdSource, Tuning};

/// A set of processes that communicate through channels.
///
/// A program started without a launcher is a one-process session. Under `madrun` the session
/// learns its rank, size, secret and bootstrap address from the environment; other
/// bootstraps (MPI) are passed to [`SessionBuilder::bootstrap`].
///
/// `Send + Sync`; cheap to clone.
///
/// A two-rank session exchanging one message (here the ranks are two threads of one process,
/// each with its own session, over the in-process `mem` driver; a real program calls
/// `Session::builder().driver(...).build()` once per process, or `madeleine::session()`):
///
/// ```
/// # use mad_core::{bootstrap::ThreadBootstrap, mem::MemDriver, ChannelConfig, Session};
/// # // Two ranks as two threads of this process, over the in-process `mem` driver.
/// # fn two_ranks(body: impl Fn(Session) -> mad_core::Result<()> + Sync) -> mad_core::Result<()> {
/// #     std::thread::scope(|s| {
/// #         let body = &body;
/// #         let hs: Vec<_> = ThreadBootstrap::group(2)
/// #             .into_iter()
/// #             .map(|b| {
/// #                 s.spawn(move || {
/// #                     body(Session::builder().driver(MemDriver).bootstrap(Box::new(b)).build()?)
/// #                 })
/// #             })
/// #             .collect();
/// #         hs.into_iter().try_for_each(|h| h.join().unwrap())
/// #     })
/// # }
/// # two_ranks(|session| {
/// use mad_core::{ChannelConfig, RecvMode, SendMode};
/// assert_eq!(session.size(), 2);
/// let ch = session.open_channel_with(ChannelConfig::parse("hello", "mem")?)?; // collective
/// if session.rank() == 0 {
///     let mut p = ch.begin_packing(1)?;
///     p.pack_value(&42u64, RecvMode::Express)?;
///     p.end_packing()?;
/// } else {
///     let mut u = ch.begin_unpacking()?;
///     assert_eq!(u.remote(), 0);
///     let v: u64 = u.unpack_value()?;
///     u.end_unpacking()?;
///     assert_eq!(v, 42);
/// }
/// # Ok(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Session {
    inner: Arc<SessionInner>,
}

struct SessionInner {
    bootstrap: Box<dyn Bootstrap>,
    drivers: Vec<Arc<dyn Driver>>,
    /// More ranks on this host than cores: from this process's CPU set at build time, then
    /// from the union of every local rank's CPU set at each channel open.
    oversubscribed: AtomicBool,
    /// Opens attempted per channel name: a retry after a failed open gets fresh bootstrap tags.
    attempts: Mutex<HashMap<String, u32>>,
    /// Every channel opened, for [`Session::close`] (weak: a channel lives while it has handles).
    channels: Mutex<Vec<std::sync::Weak<crate::channel::ChannelInner>>>,
    /// The transit channels of virtual channels ([`crate::vchan`]): their forwarding threads
    /// serve the other ranks while this session lives, even after this rank dropped the
    /// virtual channel; the session's end closes them (which ends the threads).
    transit: Mutex<Vec<std::sync::Weak<crate::channel::ChannelInner>>>,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        let list = std::mem::take(self.transit.get_mut().unwrap_or_else(|p| p.into_inner()));
        for inner in list.iter().filter_map(|w| w.upgrade()) {
            Channel { inner }.close();
        }
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Session(rank {} of {}, bootstrap {}, drivers {:?})",
            self.rank(),
            self.size(),
            self.inner.bootstrap.kind(),
            self.driver_names()
        )
    }
}

/// Builds a [`Session`]: register drivers, optionally choose the bootstrap.
#[derive(Default)]
#[must_use = "a SessionBuilder does nothing until `build` is called"]
pub struct SessionBuilder {
    drivers: Vec<Arc<dyn Driver>>,
    bootstrap: Option<Box<dyn Bootstrap>>,
}

impl std::fmt::Debug for SessionBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let drivers: Vec<&str> = self.drivers.iter().map(|d| d.name()).collect();
        f.debug_struct("SessionBuilder")
            .field("drivers", &drivers)
            .field(
                "bootstrap",
                &self
                    .bootstrap
                    .as_ref()
                    .map(|b| format!("rank {} of {}", b.rank(), b.size())),
            )
            .finish()
    }
}

impl SessionBuilder {
    /// Register a driver; channels whose configuration names it open through it.
    pub fn driver(mut self, d: impl Driver + 'static) -> Self {
        self.drivers.retain(|x| x.name() != d.name());
        self.drivers.push(Arc::new(d));
        self
    }

    /// Use this bootstrap instead of detecting one from the environment.
    pub fn bootstrap(mut self, b: Box<dyn Bootstrap>) -> Self {
        self.bootstrap = Some(b);
        self
    }

    /// Build the session. Without an explicit bootstrap: the `madrun` one when the
    /// environment has `MAD_BOOTSTRAP`, else a one-process session, except in a process that
    /// an MPI launcher started as one of several ([`crate::launch::mpi_env`]): that is
    /// [`Error::BadConfig`], since each process would run its own one-process session (give
    /// the builder an MPI bootstrap, e.g. `mad_mpi::MpiBootstrap`, or start the job with
    /// `madrun`).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`](crate::Error::BadConfig) when the environment is wrong (a `MAD_*`
    /// variable that does not parse, a process started by an MPI launcher as one of several); the
    /// bootstrap's errors when it cannot reach the others ([`Error::Io`](crate::Error::Io),
    /// [`Error::Auth`](crate::Error::Auth), [`Error::Timeout`](crate::Error::Timeout)).
    pub fn build(self) -> Result<Session> {
        let bootstrap = match self.bootstrap {
            Some(b) => b,
            None => detect_bootstrap()?,
        };
        // A first estimate from this process's own CPU set; channel opens refine it with
        // every local rank's (ranks bound one per core each see a single CPU).
        let local = bootstrap.local_ranks().len().max(1);
        let cores = cpus::allowed()
            .map(|c| c.len())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            });
        Ok(Session {
            inner: Arc::new(SessionInner {
                bootstrap,
                drivers: self.drivers,
                oversubscribed: AtomicBool::new(local > cores),
                attempts: Mutex::new(HashMap::new()),
                channels: Mutex::new(Vec::new()),
                transit: Mutex::new(Vec::new()),
            }),
        })
    }
}

fn detect_bootstrap() -> Result<Box<dyn Bootstrap>> {
    if let Some(b) = crate::launch::MadrunBootstrap::from_env()? {
        return Ok(Box::new(b));
    }
    if let Some(b) = crate::launch::pmi::PmiBootstrap::from_env()? {
        return Ok(Box::new(b));
    }
    refuse_mpi_launch(&|k| std::env::var(k).ok())?;
    Ok(Box::new(SingleBootstrap::new()?))
}

/// `Err(BadConfig)` when a launcher started this process as one of several but gave it no
/// bootstrap this build speaks (no `MAD_BOOTSTRAP`, no `PMI_FD`): a session without one would
/// leave each of them alone, silently. A one-process job is a one-process session.
fn refuse_mpi_launch(env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    match crate::launch::mpi_env::detect(env)? {
        Some(l) if l.size > 1 => Err(Error::BadConfig(format!(
            "this process was started by {} as rank {} of {}, but the session has no \
             bootstrap for it: each of the {} processes would run its own one-process session. \
             Without MPI, a session starts under madrun or a PMI-1 process manager (PMI_FD: \
             srun --mpi=pmi2, MPICH's mpiexec); for PMIx (srun --mpi=pmix, Open MPI's mpirun) \
             use a build with MPI (madeleine's `mpi` feature: cargo build --features mpi, then \
             madeleine::session()) or give SessionBuilder::bootstrap an MPI bootstrap",
            l.kind.describe(),
            l.rank,
            l.size,
            l.size
        ))),
        _ => Ok(()),
    }
}

impl Session {
    /// Start building a session.
    pub fn builder() -> SessionBuilder {
        SessionBuilder::default()
    }

    /// Close every channel this session opened that is still alive ([`Channel::close`]):
    /// every blocked call and pending future on them fails with [`Error::Closed`], and the
    /// peers see this process leave. Channels opened afterwards are not affected.
    pub fn close(&self) {
        let list: Vec<_> = self
            .inner
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|w| w.upgrade())
            .collect();
        tracing::debug!(
            rank = self.rank(),
            channels = list.len(),
            "session closed: closing its channels"
        );
        for inner in list {
            Channel { inner }.close();
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.bootstrap.rank()
    }

    /// Number of processes in the session.
    pub fn size(&self) -> usize {
        self.inner.bootstrap.size()
    }

    /// The session's bootstrap.
    pub fn bootstrap(&self) -> &dyn Bootstrap {
        &*self.inner.bootstrap
    }

    /// Whether this host runs more session processes than it has cores.
    pub fn oversubscribed(&self) -> bool {
        self.inner.oversubscribed.load(Ordering::Relaxed)
    }

    /// Names of the registered drivers.
    pub fn driver_names(&self) -> Vec<&'static str> {
        self.inner.drivers.iter().map(|d| d.name()).collect()
    }

    /// Open the channel called `name`, configured by the environment, the `MAD_CONFIG` file or
    /// the built-in default (see [`config`](crate::config)). Collective: every rank opens the
    /// same channels in the same order.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`](crate::Error::BadConfig) for a wrong specification (syntax, unknown
    /// driver, adapter or option, thresholds that differ between ranks);
    /// [`Error::Unavailable`](crate::Error::Unavailable) when the driver cannot run here; the
    /// driver's own setup errors ([`Error::Io`](crate::Error::Io),
    /// [`Error::Resource`](crate::Error::Resource), [`Error::Auth`](crate::Error::Auth), ...);
    /// [`Error::RemoteFailure`](crate::Error::RemoteFailure) when another rank's part failed, and
    /// [`Error::CollectiveTimeout`](crate::Error::CollectiveTimeout) when a rank did not arrive in
    /// time. Every rank's open fails when one fails.
    pub fn open_channel(&self, name: &str) -> Result<Channel> {
        self.open_channel_with(ChannelConfig::lookup(name)?)
    }

    /// Open a channel from an explicit configuration. Collective.
    ///
    /// `MAD_CHECKED=1` in the environment (`madrun --checked`) turns checked mode on here too:
    /// it is a debugging switch for every channel (each message says whether it is checked, so
    /// ranks that differ still understand each other). `MAD_PROGRESS` and `MAD_TIMEOUT_MS` are
    /// defaults for channels opened by name only; a configuration given in code is kept.
    ///
    /// The open is bounded and agreed: a rank whose open fails tells the others, whose opens
    /// then fail with [`Error::RemoteFailure`] naming it and carrying its error; an open that
    /// has not completed everywhere within `open_timeout_ms` (option of the channel spec, else
    /// `MAD_OPEN_TIMEOUT_MS`, else [`DEFAULT_OPEN_TIMEOUT`](crate::DEFAULT_OPEN_TIMEOUT) or 100 ms per rank if more) fails
    /// with [`Error::CollectiveTimeout`] naming the ranks that did not arrive where the
    /// bootstrap knows them. The open ends with a vote (one allgather) so that it succeeds on
    /// every rank or on none. The deadline bounds the bootstrap's collectives; the drivers'
    /// own connection set-up keeps its own bounds (tcp: `connect_timeout_ms`).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`](crate::Error::BadConfig) for a wrong specification (syntax, unknown
    /// driver, adapter or option, thresholds that differ between ranks);
    /// [`Error::Unavailable`](crate::Error::Unavailable) when the driver cannot run here; the
    /// driver's own setup errors ([`Error::Io`](crate::Error::Io),
    /// [`Error::Resource`](crate::Error::Resource), [`Error::Auth`](crate::Error::Auth), ...);
    /// [`Error::RemoteFailure`](crate::Error::RemoteFailure) when another rank's part failed, and
    /// [`Error::CollectiveTimeout`](crate::Error::CollectiveTimeout) when a rank did not arrive in
    /// time. Every rank's open fails when one fails.
    pub fn open_channel_with(&self, mut config: ChannelConfig) -> Result<Channel> {
        let b = &*self.inner.bootstrap;
        let timeout = open_timeout(&mut config, b.size());
        let attempt = {
            let mut a = self
                .inner
                .attempts
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let n = a.entry(config.name.clone()).or_insert(0);
            let k = *n;
            *n = n.saturating_add(1);
            k
        };
        let scope = OpenScope::new(
            b,
            &config.name,
            attempt,
            *timeout.as_ref().unwrap_or(&DEFAULT_OPEN_TIMEOUT),
        );
        let span = tracing::info_span!(
            "channel_open",
            channel = %config.name,
            driver = %config.driver,
            rank = b.rank(),
            size = b.size(),
        );
        let _entered = span.enter();
        let started = std::time::Instant::now();
        let opened = timeout.and_then(|_| self.open_in(config, &scope));
        match opened {
            Ok(ch) => {
                tracing::debug!(
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    peers = ch.inner.peers.len(),
                    "channel opened"
                );
                Ok(ch)
            }
            Err(e) => {
                let e = scope.fail(e);
                // Returned to the caller, who reports it: a debug event only, not a second report.
                tracing::debug!(error = %e, "channel open failed");
                Err(e)
            }
        }
    }

    /// The selection table a channel of `config` would use (as [`Channel::selection_table`]
    /// prints it), computed without opening anything: the driver's TM table for `config` with
    /// its threshold overrides, the spec's progress mode. Not collective. What only an open
    /// learns (the driver's notes, such as whether CMA is permitted between the ranks, and
    /// whether the host is oversubscribed) is not in it.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`](crate::Error::BadConfig) when no driver of the session has the
    /// configuration's name, or its thresholds or options are wrong for the driver.
    pub fn selection_table_for(&self, config: &ChannelConfig) -> Result<String> {
        let mut config = config.clone();
        open_timeout(&mut config, self.size())?;
        if crate::config::env_forces_checked()? {
            config.checked = true;
        }
        let (_, _, table) = self.driver_table(&config)?;
        let why = (config.tune != Tune::Off)
            .then(|| "not opened: an open measures or takes the cache".to_string());
        let tuning = Tuning::untuned(&config, &table, why);
        let progress = ProgressPolicy {
            mode: config.progress,
            oversubscribed: false,
            op_timeout: config.op_timeout,
        };
        Ok(crate::channel::format_selection_table(
            &config,
            &table,
            &progress,
            &[],
            &tuning,
        ))
    }

    /// The driver `config` names, its built-in TM table for `config`, and that table with
    /// `config`'s threshold overrides.
    fn driver_table(
        &self,
        config: &ChannelConfig,
    ) -> Result<(&dyn Driver, crate::driver::TmTable, crate::driver::TmTable)> {
        let inner = &*self.inner;
        let driver = inner
            .drivers
            .iter()
            .find(|d| d.name() == config.driver)
            .ok_or_else(|| {
                let list: Vec<String> = inner
                    .drivers
                    .iter()
                    .map(|d| format!("{} ({})", d.name(), d.describe()))
                    .collect();
                Error::BadConfig(format!(
                    "channel `{}`: unknown driver `{}`; available: {}",
                    config.name,
                    config.driver,
                    if list.is_empty() {
                        "none registered".to_string()
                    } else {
                        list.join(", ")
                    }
                ))
            })?;
        config.check_against(&driver.accepted_options(config))?;
        let builtin = driver.tm_table(config)?;
        let table = with_overrides(config, &builtin)?;
        Ok((&**driver, builtin, table))
    }

    /// Rank 0's plan for the thresholds of a channel of `config` (see [`crate::tune`]), and
    /// where to cache a measurement.
    fn tune_plan(
        config: &ChannelConfig,
        builtin: &crate::driver::TmTable,
        partner: Option<usize>,
        local_ranks: &[usize],
    ) -> (Plan, Option<(std::path::PathBuf, String)>, Option<Record>) {
        let tunable = tune::tunable(builtin);
        let why = if config.tune == Tune::Off {
            return (Plan::Keep(None), None, None);
        } else if tunable.len() < 2 {
            "a single TM takes the pieces measured: nothing to tune"
        } else if tunable
            .iter()
            .all(|&i| config.thresholds.contains_key(builtin.tms()[i].name))
        {
            "every threshold is overridden"
        } else if partner.is_none() {
            "no other rank to measure with"
        } else {
            ""
        };
        let Some(partner) = partner.filter(|_| why.is_empty()) else {
            return (Plan::Keep(Some(why.to_string())), None, None);
        };
        let cache = tune::cache_dir(config).map(|dir| {
            let key = tune::cache_key(config, builtin, local_ranks.contains(&partner));
            (dir, key)
        });
        if config.tune == Tune::Auto {
            if let Some((dir, key)) = &cache {
                if let Some(r) = tune::load(dir, key, builtin) {
                    // The others get the thresholds; the figures stay here.
                    let brief = Record {
                        figures: Vec::new(),
                        ..r.clone()
                    };
                    return (Plan::Cached(brief), None, Some(r));
                }
            }
        }
        (Plan::Measure(partner), cache, None)
    }

    /// Remember `ch` for [`Session::close`].
    fn register(&self, ch: &Channel) {
        let mut list = self
            .inner
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&ch.inner));
    }

    /// Open a virtual channel ([`crate::vchan`]): its parts in order, then the routes from
    /// every rank's reach.
    fn open_virtual(&self, config: ChannelConfig, scope: &OpenScope<'_>) -> Result<Channel> {
        let name = config.name.clone();
        if config.parts.is_empty() {
            return Err(Error::BadConfig(format!(
                "virtual channel `{name}` has no real channel: `virtual:shm+tcp`"
            )));
        }
        if config.ranks.is_some() || !config.thresholds.is_empty() || config.local_only {
            return Err(Error::BadConfig(format!(
                "virtual channel `{name}`: ranks=, local_only= and tm.<name>= apply to one of \
                 its real channels: set them on that part"
            )));
        }
        let b: &dyn Bootstrap = scope;
        let mut parts = Vec::with_capacity(config.parts.len());
        for (i, p) in config.parts.iter().enumerate() {
            if p.is_virtual() {
                return Err(Error::BadConfig(format!(
                    "virtual channel `{name}`: part {i} is itself virtual"
                )));
            }
            let mut p = p.clone();
            p.name = format!("{name}.{i}");
            parts.push(self.open_channel_with(p)?);
        }
        let mine = parts
            .iter()
            .map(|p| {
                p.peers()
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect::<Vec<_>>()
            .join(";");
        let all = b.allgather(&scope.tag("reach"), mine.as_bytes())?;
        let mut reach = Vec::with_capacity(all.len());
        for (r, text) in all.iter().enumerate() {
            let bad = || Error::protocol(r, format!("virtual channel `{name}`: malformed reach"));
            let text = std::str::from_utf8(text).map_err(|_| bad())?;
            let lists: Vec<Vec<usize>> = text
                .split(';')
                .map(|l| {
                    l.split(',')
                        .filter(|x| !x.is_empty())
                        .map(|x| x.parse::<usize>().map_err(|_| bad()))
                        .collect::<Result<Vec<usize>>>()
                })
                .collect::<Result<_>>()?;
            if lists.len() != parts.len() {
                return Err(bad());
            }
            reach.push(lists);
        }
        // Some pair needs a gateway: every rank opens the transit copies of the parts, in
        // order (every rank sees the same reach, so every rank opens them).
        let mut transit = Vec::new();
        if crate::vchan::needs_gateways(&reach) {
            for (i, p) in config.parts.iter().enumerate() {
                let t = self.open_channel_with(crate::vchan::transit_config(p, &name, i))?;
                self.inner
                    .transit
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Arc::downgrade(&t.inner));
                transit.push(t);
            }
        }
        let virt = crate::vchan::assemble(&name, b.rank(), b.size(), parts, transit, &reach)?;
        let first = &virt.parts[0].inner;
        let mut inner = ChannelInner::new(
            config,
            b.rank(),
            b.size(),
            first.table.clone(),
            first.caps.clone(),
            first.progress,
            (0..b.size()).map(|_| None).collect(),
            Box::new(crate::driver::NoIncoming),
            Vec::new(),
            first.tuning.clone(),
        );
        inner.peers = virt
            .routes
            .iter()
            .enumerate()
            .filter(|(_, r)| !matches!(r, crate::vchan::Route::Me))
            .map(|(r, _)| r)
            .collect();
        inner.virt = Some(Box::new(virt));
        let ch = Channel {
            inner: Arc::new(inner),
        };
        self.register(&ch);
        Ok(ch)
    }

    fn open_in(&self, mut config: ChannelConfig, scope: &OpenScope<'_>) -> Result<Channel> {
        if config.is_virtual() {
            return self.open_virtual(config, scope);
        }
        if crate::config::env_forces_checked()? {
            config.checked = true;
        }
        let inner = &*self.inner;
        let (driver, builtin, table) = self.driver_table(&config)?;
        let caps = driver.capabilities(&config);
        let b: &dyn Bootstrap = scope;
        if let Some(set) = &config.ranks {
            if set.max() >= b.size() {
                return Err(Error::BadConfig(format!(
                    "channel `{}`: ranks={set} names rank {}, but the session has {} ranks",
                    config.name,
                    set.max(),
                    b.size()
                )));
            }
        }
        let joins = |a: usize, z: usize| {
            config
                .ranks
                .as_ref()
                .is_none_or(|s| s.contains(a) && s.contains(z))
        };
        let local_ranks = b.local_ranks();
        let partner = tune::partner(b.rank(), b.size(), &local_ranks, caps.intra_node_only)
            .filter(|&p| joins(0, p));
        // Rank 0 decides whether the thresholds are measured, cached or built-in; its plan
        // rides on the first exchange, after the CPU set.
        let (plan, cache, cached) = if b.rank() == 0 {
            Self::tune_plan(&config, &builtin, partner, &local_ranks)
        } else {
            (Plan::Keep(None), None, None)
        };
        // Every rank must agree on the driver and the switch table, or the switch decisions
        // would differ and data would be misread. The same exchange carries each rank's CPU set
        // (after a newline), from which the host's core count is known exactly, and its host
        // (after another), which an intra-node driver must share.
        let mine = format!(
            "{}|{}|{:016x}{}",
            config.driver,
            config.adapter.as_deref().unwrap_or(""),
            table.fingerprint(),
            if config.tune == Tune::Off {
                String::new()
            } else {
                format!("|tune={}", config.tune.as_str())
            }
        );
        let cpu_list = cpus::allowed()
            .map(|c| cpus::format(&c))
            .unwrap_or_default();
        let host = crate::bootstrap::host_identity();
        let all = b.allgather(
            &scope.tag("core"),
            format!("{mine}\n{cpu_list}\n{host}\n{}", plan.to_text()).as_bytes(),
        )?;
        let mut host_cpus = BTreeSet::new();
        let mut hosts = Vec::with_capacity(all.len());
        let mut plan = None;
        for (r, theirs) in all.iter().enumerate() {
            let theirs = String::from_utf8_lossy(theirs);
            // The plan goes last: a cached one spans several lines.
            let mut lines = theirs.splitn(4, '\n');
            let conf = lines.next().unwrap_or("");
            let list = lines.next().unwrap_or("");
            hosts.push(HostIdentity::parse(lines.next().unwrap_or("")));
            let their_plan = lines.next().unwrap_or("");
            if conf != mine {
                return Err(Error::BadConfig(format!(
                    "channel `{}`: rank {r} opened it as `{conf}` but rank {} as `{mine}` (driver|adapter|TM table \
                     fingerprint[|tune]); every rank must use the same configuration",
                    config.name,
                    b.rank()
                )));
            }
            if r == 0 {
                plan = Some(Plan::parse(their_plan).ok_or_else(|| {
                    Error::protocol(
                        0,
                        format!("channel `{}`: malformed tuning plan", config.name),
                    )
                })?);
            }
            if local_ranks.contains(&r) {
                host_cpus.extend(cpus::parse(list).unwrap_or_default());
            }
        }
        if caps.intra_node_only {
            check_reach(&config, b.rank(), &local_ranks, &hosts)?;
        } else if config.local_only {
            return Err(Error::BadConfig(format!(
                "channel `{}`: local_only=true is for drivers that reach only their own host; \
                 driver `{}` reaches other hosts: remove the option",
                config.name, config.driver
            )));
        }
        let plan = plan.unwrap_or(Plan::Keep(None));
        let local = local_ranks.len().max(1);
        if !host_cpus.is_empty() {
            let cores = host_cpus.len();
            inner.oversubscribed.store(local > cores, Ordering::Relaxed);
            crate::progress::note_host_share(local, cores);
        }
        // A cached measurement: the drivers connect with the final table.
        let (table, tuning) = match &plan {
            Plan::Keep(why) => {
                let t = Tuning::untuned(&config, &table, why.clone());
                (table, t)
            }
            Plan::Measure(_) => {
                let t = Tuning::untuned(&config, &table, None);
                (table, t)
            }
            Plan::Cached(r) => {
                let t = with_overrides(&config, &r.apply(&builtin)?)?;
                let full = cached.as_ref().unwrap_or(r);
                let info = tune::tuned_info(&config, &t, full, ThresholdSource::Cached);
                (t, info)
            }
        };
        let progress = ProgressPolicy {
            mode: config.progress,
            oversubscribed: inner.oversubscribed.load(Ordering::Relaxed),
            op_timeout: config.op_timeout,
        };
        let ctx = OpenContext::new(&config, b, &table, &progress);
        let opened = {
            let _handshake = tracing::debug_span!("driver_open").entered();
            driver.open(&ctx)?
        };
        for n in &opened.notes {
            tracing::debug!(note = %n, "driver note");
        }
        // `ranks=`: a driver that connected more than the set (it may ignore
        // `OpenContext::reaches`) loses those connections here, on both ends alike.
        let mut opened = opened;
        let me = b.rank();
        for (r, l) in opened.links.iter_mut().enumerate() {
            if l.is_some() && !joins(me, r) {
                *l = None;
                opened.incoming.forget(r);
            }
        }
        if opened.links.len() != b.size() {
            return Err(Error::protocol(
                b.rank(),
                format!(
                    "driver `{}` returned {} links for a session of {}",
                    driver.name(),
                    opened.links.len(),
                    b.size()
                ),
            ));
        }
        let mut ch = Channel {
            inner: Arc::new(ChannelInner::new(
                config,
                b.rank(),
                b.size(),
                table,
                caps,
                progress,
                opened.links,
                opened.incoming,
                opened.notes,
                tuning,
            )),
        };
        // Measure between rank 0 and its partner; rank 0's vote carries the result.
        let mut vote = vec![1u8];
        if let Plan::Measure(p) = plan {
            let _calibrate = tracing::debug_span!("tune", partner = p).entered();
            if b.rank() == 0 {
                let budget = ch.inner.config.tune_budget;
                let r = tune::lead(&mut ch, p, &builtin, budget)?;
                let fp = with_overrides(&ch.inner.config, &r.apply(&builtin)?)?.fingerprint();
                vote.extend_from_slice(format!("{fp:016x}\n{}", r.to_text()).as_bytes());
            } else if b.rank() == p {
                tune::follow(&mut ch, 0, &builtin)?;
            }
        }
        // The vote: every rank's driver open succeeded, or the ranks whose did not have
        // abandoned the scope (or, under MPI, contribute their failure to this collective).
        let votes = b.allgather(&scope.tag("open-ok"), &vote)?;
        let name = &ch.inner.config.name;
        if let Some(r) = votes
            .iter()
            .enumerate()
            .position(|(r, v)| v.first() != Some(&1) || (r != 0 && v.len() != 1))
        {
            return Err(Error::protocol(
                r,
                format!("channel `{name}`: rank {r} sent a malformed open vote"),
            ));
        }
        if matches!(plan, Plan::Measure(_)) {
            let bad = || Error::protocol(0, format!("channel `{name}`: malformed tuning result"));
            let text = std::str::from_utf8(&votes[0][1..]).map_err(|_| bad())?;
            let (fp, rec) = text.split_once('\n').ok_or_else(bad)?;
            let r = Record::parse(rec).ok_or_else(bad)?;
            let t = with_overrides(&ch.inner.config, &r.apply(&builtin)?)?;
            if format!("{:016x}", t.fingerprint()) != fp {
                return Err(Error::BadConfig(format!(
                    "channel `{name}`: the tuned TM table of rank {} differs from rank 0's",
                    b.rank()
                )));
            }
            if let Some((dir, key)) = cache.as_ref().filter(|_| r.complete) {
                tune::store(dir, key, &r);
            }
            let info = tune::tuned_info(&ch.inner.config, &t, &r, ThresholdSource::Measured);
            let inner = Arc::get_mut(&mut ch.inner).ok_or_else(|| {
                Error::BadConfig("tune: the channel is shared before its open ended".into())
            })?;
            inner.table = t;
            inner.tuning = info;
            inner.reset_counters();
        }
        self.register(&ch);
        if std::env::var("MAD_PROTO_INFO")
            .map(|v| v == "1")
            .unwrap_or(false)
            && b.rank() == 0
        {
            eprint!("{}", ch.selection_table());
        }
        Ok(ch)
    }
}

/// Ranks an intra-node driver cannot reach from `me`: those the bootstrap does not count
/// among this host's (`local`), and those running another kernel than this rank's (by the
/// boot ids of `hosts`, one per rank; a bootstrap that does not know the hosts counts every
/// rank as local).
fn off_host(me: usize, local: &[usize], hosts: &[HostIdentity]) -> Vec<usize> {
    let mine = hosts.get(me).cloned().unwrap_or_default();
    (0..hosts.len())
        .filter(|&r| r != me && (!local.contains(&r) || mine.other_kernel(&hosts[r])))
        .collect()
}

/// An intra-node channel must reach every rank, unless it was opened `local_only`:
/// `Err(BadConfig)` naming the channel, the driver and the ranks (with their hosts) it cannot
/// reach. At open only: nothing on the message path.
fn check_reach(
    config: &ChannelConfig,
    me: usize,
    local: &[usize],
    hosts: &[HostIdentity],
) -> Result<()> {
    let away = off_host(me, local, hosts);
    if away.is_empty() || config.local_only {
        if !away.is_empty() {
            tracing::debug!(
                unreachable = away.len(),
                "local_only: no connection to the ranks on other hosts"
            );
        }
        return Ok(());
    }
    let name = |r: usize| match hosts.get(r).map(|h| h.name.as_str()) {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => "an unnamed host".to_string(),
    };
    const SHOWN: usize = 8;
    let mut list: Vec<String> = away
        .iter()
        .take(SHOWN)
        .map(|&r| format!("rank {r} (on {})", name(r)))
        .collect();
    if away.len() > SHOWN {
        list.push(format!("and {} more", away.len() - SHOWN));
    }
    Err(Error::BadConfig(format!(
        "channel `{}`: driver `{}` reaches only the ranks of its own host, but rank {me} (on {}) \
         has {} peer(s) on other hosts: {}; use a driver that crosses hosts for this channel (tcp, \
         via, mpi), or set local_only=true to connect the ranks of each host only",
        config.name,
        config.driver,
        name(me),
        away.len(),
        list.join(", ")
    )))
}

/// `builtin` with the threshold overrides of `config` (`tm.<name>=`).
fn with_overrides(
    config: &ChannelConfig,
    builtin: &crate::driver::TmTable,
) -> Result<crate::driver::TmTable> {
    let mut table = builtin.clone();
    for (tm, max) in &config.thresholds {
        table.set_max_len(tm, *max).map_err(|e| {
            Error::BadConfig(format!(
                "channel `{}`: threshold override: {e}",
                config.name
            ))
        })?;
    }
    Ok(table)
}

/// Bound on a channel open when neither `open_timeout_ms` nor `MAD_OPEN_TIMEOUT_MS` is set
/// (raised to 100 ms per rank for sessions of more than 600 ranks).
pub const DEFAULT_OPEN_TIMEOUT: Duration = Duration::from_secs(60);

/// The channel option that bounds an open (removed from the options the driver sees).
const OPEN_TIMEOUT_OPTION: &str = "open_timeout_ms";

/// The open deadline of `config` (see [`Session::open_channel_with`]).
fn open_timeout(config: &mut ChannelConfig, size: usize) -> Result<Duration> {
    let ms = |what: &str, v: &str| -> Result<Duration> {
        match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
            _ => Err(Error::BadConfig(format!(
                "channel `{}`: {what}={v}: expected a positive number of milliseconds",
                config.name
            ))),
        }
    };
    if let Some(v) = config.options.remove(OPEN_TIMEOUT_OPTION) {
        return ms(OPEN_TIMEOUT_OPTION, &v);
    }
    if let Ok(v) = std::env::var("MAD_OPEN_TIMEOUT_MS") {
        return ms("MAD_OPEN_TIMEOUT_MS", &v);
    }
    Ok(DEFAULT_OPEN_TIMEOUT.max(Duration::from_millis(100).saturating_mul(size as u32)))
}

/// The session bootstrap as a channel open sees it: every collective is part of the open's
/// [`Scope`] (bounded by its deadline, failed by another rank's abandon), and tags of a retry
/// of the same channel name are distinct from the failed attempt's.
struct OpenScope<'a> {
    inner: &'a dyn Bootstrap,
    scope: Scope,
    /// What the drivers' tags start with (`OpenContext::tag`).
    raw_prefix: String,
    /// One of the scope's collectives failed: every rank that can learn of it knows already.
    collective_failed: AtomicBool,
}

impl<'a> OpenScope<'a> {
    fn new(inner: &'a dyn Bootstrap, name: &str, attempt: u32, timeout: Duration) -> Self {
        // `/` and `%` escaped so that no channel's prefix is a prefix of another's; the first
        // attempt keeps the plain `chan/NAME/` tags.
        let esc = name.replace('%', "%25").replace('/', "%2F");
        let prefix = if attempt == 0 {
            format!("chan/{esc}/")
        } else {
            format!("chan#{attempt}/{esc}/")
        };
        OpenScope {
            inner,
            scope: Scope::new(prefix, format!("channel `{name}`: open"), timeout),
            raw_prefix: format!("chan/{name}/"),
            collective_failed: AtomicBool::new(false),
        }
    }

    /// The scope's tag for `what`.
    fn tag(&self, what: &str) -> String {
        format!("{}{what}", self.scope.prefix)
    }

    /// This rank's open failed with `e`: unless a collective already spread the failure,
    /// tell the other ranks. Returns the error to report: `e`, or the failure of the rank
    /// that failed first when another did (with `e` appended).
    fn fail(&self, e: Error) -> Error {
        if self.collective_failed.load(Ordering::Relaxed) {
            return e;
        }
        let me = self.inner.rank();
        match self
            .inner
            .abandon(&self.scope, &RankFailure::from_error(me, &e))
        {
            Ok(first) if first.rank != me => match first.to_error(&self.scope) {
                Error::RemoteFailure {
                    what,
                    rank,
                    kind,
                    message,
                } => Error::RemoteFailure {
                    what,
                    rank,
                    kind,
                    message: format!("{message} (then rank {me} failed too: {e})"),
                },
                other => other,
            },
            _ => e,
        }
    }
}

impl Bootstrap for OpenScope<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn secret(&self) -> &crate::auth::Secret {
        self.inner.secret()
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let tag = if self.scope.contains(tag) {
            tag.to_string()
        } else {
            self.tag(tag.strip_prefix(&self.raw_prefix).unwrap_or(tag))
        };
        let r = self.inner.scoped_allgather(&self.scope, &tag, value);
        if r.is_err() {
            self.collective_failed.store(true, Ordering::Relaxed);
        }
        r
    }
    fn barrier(&self, tag: &str) -> Result<()> {
        // An allgather, not the bootstrap's barrier: every collective of the scope must be
        // one the bootstrap can fail (and, under MPI, match against a failing rank's).
        self.allgather(tag, &[]).map(|_| ())
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn local_ranks(&self) -> Vec<usize> {
        self.inner.local_ranks()
    }
}

/// The CPUs a process may run on, as Linux lists them (`0-3,8`).
mod cpus {
    use std::collections::BTreeSet;

    /// Highest CPU number accepted from a list (a peer's list is parsed too: bounded work).
    const MAX_CPU: u32 = 1 << 16;

    /// This process's allowed CPUs (`Cpus_allowed_list` of `/proc/self/status`).
    pub(super) fn allowed() -> Option<BTreeSet<u32>> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
        parse(line.trim())
    }

    /// Parse `0-3,8,10-11`; `None` if malformed or out of bounds.
    pub(super) fn parse(list: &str) -> Option<BTreeSet<u32>> {
        let mut set = BTreeSet::new();
        for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
                None => {
                    let a = part.parse::<u32>().ok()?;
                    (a, a)
                }
            };
            if a > b || b > MAX_CPU {
                return None;
            }
            set.extend(a..=b);
        }
        Some(set)
    }

    /// The inverse of [`parse`] (one range per run of consecutive CPUs).
    pub(super) fn format(set: &BTreeSet<u32>) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut it = set.iter().copied().peekable();
        while let Some(start) = it.next() {
            let mut end = start;
            while it.peek() == Some(&(end + 1)) {
                end += 1;
                it.next();
            }
            out.push(if start == end {
                start.to_string()
            } else {
                format!("{start}-{end}")
            });
        }
        out.join(",")
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn lists_round_trip_and_bad_ones_are_refused() {
            let s = parse("0-3, 8,10-11").unwrap();
            assert_eq!(
                s.iter().copied().collect::<Vec<_>>(),
                [0, 1, 2, 3, 8, 10, 11]
            );
            assert_eq!(format(&s), "0-3,8,10-11");
            assert_eq!(parse("").unwrap().len(), 0);
            for bad in ["3-1", "x", "0-4294967295", "1-", "-2", "99999999"] {
                assert!(parse(bad).is_none(), "{bad}");
            }
            let mine = allowed().expect("/proc/self/status has Cpus_allowed_list");
            assert!(!mine.is_empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn a_multi_process_mpi_launch_without_an_mpi_bootstrap_is_refused() {
        // What `mpiexec.mpich -n 2` sets.
        let hydra = env_of(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("HYDI_CONTROL_FD", "7"),
        ]);
        match refuse_mpi_launch(&hydra) {
            Err(Error::BadConfig(m)) => {
                assert!(m.contains("MPICH's mpiexec (Hydra) as rank 1 of 2"), "{m}");
                assert!(m.contains("--features mpi") && m.contains("madrun"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        let ompi = env_of(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        assert!(matches!(refuse_mpi_launch(&ompi), Err(Error::BadConfig(_))));
        // srun with no MPI plugin: a job step, no PMI.
        let srun = env_of(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
        ]);
        match refuse_mpi_launch(&srun) {
            Err(Error::BadConfig(m)) => assert!(m.contains("srun --mpi=pmi2"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Malformed launcher variables are reported, not taken for "alone".
        let bad = env_of(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")]);
        assert!(matches!(refuse_mpi_launch(&bad), Err(Error::BadConfig(_))));
    }

    #[test]
    fn ranks_out_of_an_intra_node_drivers_reach_are_those_elsewhere_or_on_another_kernel() {
        let h = |s: &str| HostIdentity::parse(s);
        let hosts = [h("a/k1"), h("a/k1"), h("b/k2"), h("c/k1"), h("")];
        // The bootstrap counts 0, 1, 2 and 4 as local; 2 runs another kernel.
        assert_eq!(off_host(0, &[0, 1, 2, 4], &hosts), [2, 3]);
        // A bootstrap that knows no better (every rank local): only the boot ids tell.
        assert_eq!(off_host(1, &[0, 1, 2, 3, 4], &hosts), [2]);
        assert!(off_host(0, &[0, 1, 3, 4], &[h("a/k"), h("b/k"), h(""), h("x/")]).len() == 1);
        let c = ChannelConfig::new("c", "shm");
        match check_reach(&c, 0, &[0, 1, 2, 4], &hosts) {
            Err(Error::BadConfig(m)) => assert_eq!(
                m,
                "channel `c`: driver `shm` reaches only the ranks of its own host, but rank 0 \
                 (on a) has 2 peer(s) on other hosts: rank 2 (on b), rank 3 (on c); use a \
                 driver that crosses hosts for this channel (tcp, via, mpi), or set \
                 local_only=true to connect the ranks of each host only"
            ),
            other => panic!("{other:?}"),
        }
        assert!(check_reach(&c.clone().local_only(true), 0, &[0], &hosts).is_ok());
        assert!(check_reach(&c, 1, &[0, 1, 2, 3, 4], &vec![h("a/k"); 5]).is_ok());
        let many: Vec<HostIdentity> = (0..20).map(|r| h(&format!("n{r}/k{r}"))).collect();
        match check_reach(&c, 0, &[0], &many) {
            Err(Error::BadConfig(m)) => {
                assert!(m.contains("has 19 peer(s)"), "{m}");
                assert!(m.contains("rank 8 (on n8), and 11 more;"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn alone_a_batch_script_or_a_one_process_job_is_a_one_process_session() {
        assert!(refuse_mpi_launch(&env_of(&[])).is_ok());
        // A batch script inside a Slurm allocation (no PMI): not an MPI launch.
        assert!(
            refuse_mpi_launch(&env_of(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")])).is_ok()
        );
        assert!(refuse_mpi_launch(&env_of(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")])).is_ok());
    }
}
