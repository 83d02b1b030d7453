//! The `mpi` driver: Madeleine channels over MPI point-to-point messages.
//!
//! Each channel owns a communicator (`MPI_Comm_dup` of the world, or of the application's
//! communicator given to [`MpiDriver::from_communicator`], or an `MPI_Comm_split` renumbering
//! when the session's ranks differ from that communicator's), so channels never match each
//! other's messages nor the application's (only these duplicates get `MPI_ERRORS_RETURN`);
//! all data travels with one tag, so MPI's non-overtaking rule keeps the per-peer order the
//! core relies on.
//!
//! Transmission modules:
//!
//! * TM 0 `eager` ([`Bmm::Copy`](mad_core::driver::Bmm::Copy)): the core copies pieces into a driver buffer of
//!   [`EAGER_BUF_MPICH`] / [`EAGER_BUF_OPENMPI`] bytes (the MPI's eager limit); the buffer
//!   leaves as one MPI message when full, at commit and at
//!   the end of the message. The receiver gets it in its pre-posted receive and lends the
//!   bytes to the core.
//! * TM 1 `direct` ([`Bmm::Gather`](mad_core::driver::Bmm::Gather)): a group of user slices leaves as ONE message described by
//!   an `MPI_Type_create_hindexed` datatype over absolute addresses from `MPI_BOTTOM` when
//!   [`use_datatype`] says so, else as one message per slice; the receiver posts the mirror
//!   scatter receive (both ends compute the same groups and the same decision).
//!
//! Everything is non-blocking (`MPI_Isend`/`MPI_Irecv` + `MPI_Test`) except eager messages
//! small enough that the MPI completes a blocking send at once ([`SEND_INLINE_MPICH`],
//! [`SEND_INLINE_OTHER`]), which leave with one `MPI_Send`; an operation MPI has not finished
//! is `Poll::Pending`. Each receiving link keeps one `MPI_Irecv` of its peer's next eager
//! message (posted by the first test after the previous message, off a ping-pong's critical
//! path), so polling is one `MPI_Test` and any-source readiness one `MPI_Testsome` over the
//! channel's eager receives. MPI has no file
//! descriptor to block on and progresses only inside MPI calls, so `wait` keeps testing
//! (yielding the processor between tests) for as long as the transfer in flight can take at a
//! pessimistic bandwidth ([`poll_budget`]: [`WAIT_POLL`] plus its size at [`WAIT_MIN_BW`]), or
//! [`WAIT_POLL`] when none is (waiting for a message to start), then sleeps with an
//! exponential backoff (1 µs doubling to [`WAIT_MAX_NAP`]).

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::config::ChannelConfig;
use mad_core::driver::{
    AbortOutcome, Adapters, Capabilities, Driver, DriverOptions, Incoming, LinkPair, OpenContext,
    OpenedChannel, RxLink, TmId, TmSpec, TmTable, TxLink,
};
use mad_core::{Error, Result};
use mpi::environment::Threading;

use crate::sys::{self, Comm, GatherOp, OwnedSend, Preposted};

/// The one tag data messages use on a channel's communicator.
const DATA_TAG: i32 = 7;

/// Largest piece the `eager` TM takes (bigger pieces go `direct`), from the sweep in NOTES.md.
pub const EAGER_MAX: usize = 4 * 1024;
/// Size of one eager buffer (one MPI message at most this long) under MPICH: 8 KiB, the
/// largest message MPICH 4.0.2 (ch4:ucx) sends eagerly. Aggregated eager data larger than a
/// buffer leaves as several eager messages, which pipeline (the receiver copies one out while
/// the next arrives) instead of one rendezvous: a 64 KiB copied piece took 8.9 µs one-way in
/// 8 KiB messages against 16.1 µs in one (a hand measurement under MPICH).
pub const EAGER_BUF_MPICH: usize = 8 * 1024;
/// The same under Open MPI: 4032 B, below the vader eager limit (4096 B with headers: 4040-B
/// messages go eagerly, 4048-B ones through the CMA rendezvous, 0.9 µs slower one-way here).
pub const EAGER_BUF_OPENMPI: usize = 4032;
/// The same under other MPIs.
pub const EAGER_BUF: usize = 64 * 1024;
/// Eager messages up to this size leave with one blocking `MPI_Send` under MPICH (measured
/// with `mpi_calls eager`: MPICH 4.0.2 ch4:ucx returns from `MPI_Send` of up to 8200 B without
/// the receiver, and waits for it from 12 KiB); larger ones with `MPI_Isend` + `MPI_Test`.
pub const SEND_INLINE_MPICH: usize = 8 * 1024;
/// The same limit under Open MPI and unknown MPIs: Open MPI 4.1.4 (vader) completes an
/// `MPI_Send` at once only up to its inline-send size, 256 B; from 264 B it waits until the
/// receiver's MPI progresses (a receiver computing outside MPI would block our sender).
pub const SEND_INLINE_OTHER: usize = 256;
/// Most slices per `direct` group.
pub const GROUP_MAX: usize = 32;
/// Eager buffers in flight per connection before `with_buffer` reports back-pressure.
const MAX_INFLIGHT: usize = 4;

/// How a gather group travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GatherPolicy {
    /// Measured choice: [`use_datatype`].
    Auto,
    /// Always one hindexed-datatype message per group.
    Datatype,
    /// Always one message per slice.
    Separate,
}

impl GatherPolicy {
    fn parse(v: Option<&str>) -> Result<Self> {
        match v {
            None | Some("auto") => Ok(GatherPolicy::Auto),
            Some("datatype") | Some("hindexed") => Ok(GatherPolicy::Datatype),
            Some("separate") => Ok(GatherPolicy::Separate),
            Some(o) => Err(Error::BadConfig(format!(
                "mpi: gather={o}: expected auto, datatype or separate"
            ))),
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
}

/// The MPI implementation family, from `MPI_Get_library_version` (the same on every rank of a
/// job, so both ends of a connection agree on decisions that depend on it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MpiFamily {
    /// MPICH and derivatives.
    Mpich,
    /// Open MPI.
    OpenMpi,
    /// Anything else.
    Other,
}

impl MpiFamily {
    /// Classify a library version string.
    pub fn from_version(v: &str) -> Self {
        if v.contains("Open MPI") {
            MpiFamily::OpenMpi
        } else if v.contains("MPICH") {
            MpiFamily::Mpich
        } else {
            MpiFamily::Other
        }
    }
}

/// Smallest average slice for which Open MPI gets a group as one hindexed message.
pub const DATATYPE_MIN_SLICE: usize = 4 * 1024;
/// Largest average slice for which Open MPI gets a group as one hindexed message.
pub const DATATYPE_MAX_SLICE: usize = 16 * 1024;

/// The gather decision, a pure function both ends compute: send a group of `slices` slices
/// totalling `total` bytes as one hindexed-datatype message (else one message per slice)?
///
/// From the sweep in NOTES.md: with MPICH 4.0.2 (ch4:ucx) separate sends were as fast or
/// faster at every point measured, so `Auto` never uses a datatype there. With Open MPI 4.1.4
/// one datatype message won for groups of medium slices (4–16 KiB on average), lost for tiny
/// slices (per-message cost is already low, the datatype engine's setup is not) and lost
/// heavily for large slices (the datatype path packs through bounce buffers instead of a
/// single CMA copy).
pub fn use_datatype(policy: GatherPolicy, family: MpiFamily, slices: usize, total: usize) -> bool {
    if slices < 2 {
        return false;
    }
    match policy {
        GatherPolicy::Datatype => true,
        GatherPolicy::Separate => false,
        GatherPolicy::Auto => {
            let avg = total / slices;
            family == MpiFamily::OpenMpi && (DATATYPE_MIN_SLICE..=DATATYPE_MAX_SLICE).contains(&avg)
        }
    }
}

/// The wire code of a threading level in the channel descriptor (0 = SINGLE .. 3 = MULTIPLE).
fn level_code(t: Threading) -> u8 {
    match t {
        Threading::Single => 0,
        Threading::Funneled => 1,
        Threading::Serialized => 2,
        Threading::Multiple => 3,
    }
}

fn level_of_code(c: u8) -> Threading {
    match c {
        3 => Threading::Multiple,
        2 => Threading::Serialized,
        1 => Threading::Funneled,
        _ => Threading::Single,
    }
}

/// Why the channel cannot open, given every rank's level code (`None` for a malformed
/// descriptor, reported later), or `None` when every rank has at least
/// `MPI_THREAD_SERIALIZED`. A pure decision, the same on every rank.
///
/// The engine calls a channel's links from whichever thread packs, unpacks or waits (and the
/// any-source poll from any of them); a lock makes those calls one at a time, which is what
/// `SERIALIZED` asks, but under `FUNNELED` (and `SINGLE`) MPI may only be called by the thread
/// that initialised it, which no lock can ensure.
pub fn thread_level_refusal(levels: impl Iterator<Item = Option<u8>>) -> Option<String> {
    let (rank, t) = levels
        .enumerate()
        .filter_map(|(r, c)| c.map(|c| (r, level_of_code(c))))
        .find(|&(_, t)| !sys::channel_level_ok(t))?;
    Some(format!(
        "MPI granted {} on rank {rank}: only the thread that initialised MPI may call it, but \
         a channel's connections are driven from whichever thread packs, unpacks or polls; the \
         mpi driver needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (ask for it: \
         MAD_MPI_THREAD_LEVEL unset or `multiple`, or the application's MPI_Init_thread). The \
         bootstrap still works from the main thread, and so do channels of other drivers",
        sys::level_name(t)
    ))
}

/// The selection table's line on the threading level.
fn thread_note(granted: Threading, requested: Option<Threading>, serialised: bool) -> String {
    let asked = match requested {
        Some(r) => format!("requested {}", sys::level_name(r)),
        None => "MPI initialised by the application".into(),
    };
    let how = if !serialised {
        "MPI calls run concurrently"
    } else if granted == Threading::Multiple {
        "every MPI call serialised by one process-wide lock (forced by MAD_MPI_SERIALISE=1)"
    } else {
        "every MPI call serialised by one process-wide lock"
    };
    format!(
        "thread level: {} granted ({asked}): {how}",
        sys::level_name(granted)
    )
}

/// The MPI driver.
#[derive(Debug, Default)]
pub struct MpiDriver {
    /// The application's communicator (our duplicate of it), or `None` for `MPI_COMM_WORLD`.
    base: Option<Base>,
}

/// The duplicate of the communicator given to [`MpiDriver::from_communicator`], with its rank
/// and size (read at construction: `open` may make no MPI call before its thread checks).
struct Base {
    comm: Comm,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for Base {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Base(rank {} of {})", self.rank, self.size)
    }
}

impl MpiDriver {
    /// A new driver over `MPI_COMM_WORLD` (MPI is initialised lazily, at the first channel, if
    /// the bootstrap has not done it).
    pub fn new() -> Self {
        MpiDriver { base: None }
    }

    /// A driver over the communicator `comm` of an application that initialised MPI itself:
    /// its channels are duplicates (or renumberings) of `comm`, whose processes must be the
    /// session's (build the session with [`MpiBootstrap::from_communicator`](crate::MpiBootstrap::from_communicator)
    /// on the same communicator).
    ///
    /// Collective over `comm`: every process of `comm` calls it (the driver keeps one
    /// `MPI_Comm_dup` of `comm`, freed when the driver drops; each channel's communicator is
    /// freed when the channel drops). `MPI_ERRORS_RETURN` is set on these duplicates only;
    /// `comm` and `MPI_COMM_WORLD` keep their error handlers, and MPI is not finalised by this
    /// crate: drop sessions and channels before the application's `MPI_Finalize`.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when MPI is not initialised, already finalised, or initialised
    /// below `MPI_THREAD_SERIALIZED` and called off MPI's main thread; [`Error::BadConfig`] for
    /// `MPI_COMM_NULL` or an intercommunicator; the MPI error of duplicating `comm`.
    pub fn from_communicator<C>(comm: &C) -> Result<Self>
    where
        C: mpi::raw::AsRaw<Raw = mpi::ffi::MPI_Comm> + ?Sized,
    {
        let rt = sys::application_runtime()?;
        rt.check_thread("the MPI driver was created")?;
        let comm = Comm::dup_of_application(&rt, comm.as_raw())?;
        let (rank, size) = (comm.rank(), comm.size());
        Ok(MpiDriver {
            base: Some(Base { comm, rank, size }),
        })
    }
}

/// The TM table of the driver.
///
/// # Errors
///
/// [`Error::BadConfig`] if the built-in table were invalid (never for
/// this one).
pub fn tm_table() -> Result<TmTable> {
    TmTable::new([
        TmSpec::copy(
            "eager",
            EAGER_MAX,
            "copied into an eager buffer (the MPI's eager limit), one MPI message per buffer",
        ),
        TmSpec::gather(
            "direct",
            usize::MAX,
            GROUP_MAX,
            "user memory, one hindexed-datatype MPI message per group (or one per slice)",
        ),
    ])
}

#[derive(Clone, Copy)]
struct Params {
    /// The eager buffer size: the `eager_buf=<bytes>` option, else the family's default
    /// (resolved in `open`, once the family is known).
    eager_buf: usize,
    eager_opt: Option<usize>,
    policy: GatherPolicy,
    family: MpiFamily,
    /// `inline=<bytes>`: eager messages up to this size leave with a blocking `MPI_Send`
    /// (`None`: the family's measured limit, [`SEND_INLINE_MPICH`] / [`SEND_INLINE_OTHER`]).
    inline: Option<usize>,
    /// `post=early`: post the next eager receive at the end of a message (on the critical
    /// path of a ping-pong) instead of at the next test (`post=lazy`, the default).
    post_early: bool,
}

impl Params {
    /// Settle what depends on the MPI family.
    fn with_family(mut self, family: MpiFamily) -> Self {
        self.family = family;
        self.eager_buf = self.eager_opt.unwrap_or(match family {
            MpiFamily::Mpich => EAGER_BUF_MPICH,
            MpiFamily::OpenMpi => EAGER_BUF_OPENMPI,
            MpiFamily::Other => EAGER_BUF,
        });
        self
    }

    /// The largest eager message sent with a blocking `MPI_Send`.
    fn inline_max(&self) -> usize {
        self.inline.unwrap_or(match self.family {
            MpiFamily::Mpich => SEND_INLINE_MPICH,
            _ => SEND_INLINE_OTHER,
        })
    }
}

fn params(config: &ChannelConfig) -> Result<Params> {
    let eager_opt = config.option_in("eager_buf", 64, sys::MAX_BLOCK)?;
    Ok(Params {
        eager_buf: eager_opt.unwrap_or(EAGER_BUF),
        eager_opt,
        policy: GatherPolicy::parse(config.options.get("gather").map(String::as_str))?,
        family: MpiFamily::Other,
        inline: config.option_in("inline", 0, sys::MAX_BLOCK)?,
        post_early: match config.options.get("post").map(String::as_str) {
            None | Some("lazy") => false,
            Some("early") => true,
            Some(o) => {
                return Err(Error::BadConfig(format!(
                    "mpi: post={o}: expected lazy or early"
                )))
            }
        },
    })
}

impl Driver for MpiDriver {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn describe(&self) -> String {
        "mpi: MPI point-to-point over the job's MPI_COMM_WORLD (start the job with mpiexec/mpirun/srun) or an application's communicator; \
         options gather=auto|datatype|separate, eager_buf=<bytes>, inline=<bytes>, post=lazy|early"
            .into()
    }

    fn accepted_options(&self, _config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(Adapters::None, &["gather", "eager_buf", "inline", "post"])
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        params(config)?;
        tm_table()
    }

    fn capabilities(&self, _config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
            // Up to 2 peers, any-source reception polls each link (one compare-and-swap and one
            // MPI_Test of its posted eager receive); beyond, one MPI_Testsome over every slot
            // (`Preposted::poll_any`). Kept from the probe-based first version, not re-measured.
            .with_direct_poll_limit(2)
            // MPI aborts the job (or hangs) on a dead peer; it does not report it.
            .with_detects_peer_death(false)
            .with_intra_node_only(false)
            .with_max_message(None)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let bs = ctx.bootstrap;
        let rt = match &self.base {
            Some(b) => b.comm.runtime().clone(),
            None => sys::runtime()?,
        };
        let (base_rank, base_size, base_name) = match &self.base {
            Some(b) => (
                b.rank,
                b.size,
                "the communicator given to MpiDriver::from_communicator",
            ),
            None => (rt.world_rank(), rt.world_size(), "MPI_COMM_WORLD"),
        };
        let family = MpiFamily::from_version(rt.version());
        tracing::debug!(
            channel = %ctx.config.name,
            ?family,
            library = rt.version(),
            "MPI family detected"
        );
        let p = params(ctx.config)?.with_family(family);
        // Rank and size were read when MPI was initialised: no MPI call before the checks
        // below, which a thread other than MPI's main one may not make under FUNNELED.
        if base_size != bs.size() {
            return Err(Error::unavailable(
                "mpi",
                format!(
                    "the session has {} processes but {base_name} has {base_size}: start the job \
                     with the MPI launcher (mpiexec/mpirun/srun) of the MPI this binary was built \
                     for, or, inside an MPI application, build the driver and the bootstrap from \
                     the same communicator (from_communicator)",
                    bs.size(),
                ),
            ));
        }
        let me = bs.rank();
        // Descriptor: rank in the driver's communicator (world or the application's), granted threading level, then what must be equal on
        // every rank (TM table, eager buffer, gather policy). The level is exchanged so that
        // every rank refuses the channel when one cannot run it (instead of that rank failing
        // alone while the others wait in the next collective).
        let mut mine = Vec::with_capacity(26);
        mine.extend_from_slice(&(base_rank as u64).to_le_bytes());
        mine.push(level_code(rt.threading()));
        mine.extend_from_slice(&ctx.table.fingerprint().to_le_bytes());
        mine.extend_from_slice(&(p.eager_buf as u64).to_le_bytes());
        mine.push(p.policy.code());
        let all = bs.allgather(&ctx.tag("mpi-open"), &mine)?;
        if let Some(reason) = thread_level_refusal(all.iter().map(|v| v.get(8).copied())) {
            return Err(Error::unavailable("mpi", reason));
        }
        let mut seen = vec![false; all.len()];
        let mut identity = true;
        for (r, v) in all.iter().enumerate() {
            if v.len() != mine.len() {
                return Err(Error::protocol(r, "malformed mpi channel descriptor"));
            }
            let wr = u64::from_le_bytes(v[0..8].try_into().unwrap_or_default()) as usize;
            if wr >= seen.len() || seen[wr] {
                return Err(Error::BadConfig(format!(
                    "channel `{}`: session ranks do not map one-to-one onto MPI ranks",
                    ctx.config.name
                )));
            }
            seen[wr] = true;
            identity &= wr == r;
            if v[9..] != mine[9..] {
                return Err(Error::BadConfig(format!(
                    "channel `{}`: rank {r} has a different mpi TM table, eager_buf or gather \
                     policy than rank {me}; every rank must use the same channel spec",
                    ctx.config.name
                )));
            }
        }
        // Only duplicated: nothing travels on the world or the application's communicator.
        let world;
        let parent = match &self.base {
            Some(b) => &b.comm,
            None => {
                world = Comm::world(&rt);
                &world
            }
        };
        let comm = if identity {
            parent.dup()?
        } else {
            parent.reorder(me)?
        };
        let ch = Arc::new(ChanShared {
            pre: Preposted::new(&comm, bs.size(), DATA_TAG),
            comm,
        });
        let mut links = Vec::with_capacity(bs.size());
        for peer in 0..bs.size() {
            if peer == me {
                links.push(None);
                continue;
            }
            links.push(Some(LinkPair {
                tx: Box::new(MpiTx::new(ch.clone(), peer, p)),
                rx: Box::new(MpiRx::new(ch.clone(), peer, p)?),
            }));
        }
        let notes = vec![
            format!("MPI library: {}", rt.version()),
            thread_note(rt.threading(), rt.requested(), rt.serialised()),
            format!(
                "communicator: {}; eager buffer {} B, blocking MPI_Send up to {} B; gather policy {:?} ({})",
                match (identity, self.base.is_some()) {
                    (true, false) => "MPI_Comm_dup of MPI_COMM_WORLD",
                    (true, true) => "MPI_Comm_dup of the application's communicator",
                    (false, false) => "MPI_Comm_split of MPI_COMM_WORLD renumbered to session ranks",
                    (false, true) => "MPI_Comm_split of the application's communicator renumbered to session ranks",
                },
                p.eager_buf,
                p.inline_max(),
                p.policy,
                match (p.policy, p.family) {
                    (GatherPolicy::Auto, MpiFamily::OpenMpi) => "Open MPI: one hindexed message for groups of 4-16 KiB slices, else one message per slice",
                    (GatherPolicy::Auto, _) => "one message per slice",
                    (GatherPolicy::Datatype, _) => "one hindexed message per group",
                    (GatherPolicy::Separate, _) => "one message per slice",
                }
            ),
        ];
        Ok(OpenedChannel::new(
            links,
            Box::new(MpiIncoming {
                ch,
                woken: AtomicBool::new(false),
            }),
        )
        .with_notes(notes))
    }
}

/// How long `wait` keeps calling into MPI (yielding the processor between calls) before it
/// starts sleeping, when no large transfer is in flight (waiting for a message to start, or
/// for eager sends): MPI progresses only inside MPI calls, and a wait that sleeps at once
/// adds a nap to every short wait.
pub const WAIT_POLL: Duration = Duration::from_micros(500);
/// The pessimistic bandwidth (bytes per second) that bounds how long a wait keeps polling for a
/// gather send or scatter receive in flight: 1 GB/s, a tenth of what both MPIs move here
/// (9–13 GB/s), so a transfer slowed by a busy machine still completes while polled.
pub const WAIT_MIN_BW: u64 = 1_000_000_000;
/// Longest single sleep of the backoff phase.
pub const WAIT_MAX_NAP: Duration = Duration::from_micros(100);

/// How long waits keep polling (yielding between tests) for a transfer of `bytes` in flight,
/// counted from the first wait for it: [`WAIT_POLL`] plus the time `bytes` take at
/// [`WAIT_MIN_BW`] (16 MiB: 17.3 ms). A pure function.
///
/// MPI moves a rendezvous transfer (the receiver's copy, the completion the sender waits for)
/// only inside MPI calls: a side that sleeps stalls it. With a fixed 500 µs (tuned for 4 MiB,
/// ~400 µs at 10 GB/s) the waits of an 8 MiB or 16 MiB transfer went to sleep mid-transfer.
/// Bounded by the size, so a wait for a peer that does not take part (computing, not yet in
/// its receive) still backs off after that time.
pub fn poll_budget(bytes: usize) -> Duration {
    let ns = (bytes as u128 * 1_000_000_000 / WAIT_MIN_BW as u128).min(u64::MAX as u128) as u64;
    WAIT_POLL.saturating_add(Duration::from_nanos(ns))
}

/// A gather send or scatter receive in flight, and when a wait first waited for it.
struct Transfer {
    op: GatherOp,
    waited_since: Option<Instant>,
}

impl Transfer {
    fn new(op: GatherOp) -> Self {
        Transfer {
            op,
            waited_since: None,
        }
    }

    /// Until when a wait starting `now` keeps polling: the transfer's [`poll_budget`] from the
    /// first wait, and at least [`WAIT_POLL`] from `now`.
    fn poll_until(&mut self, now: Instant) -> Instant {
        let since = *self.waited_since.get_or_insert(now);
        (since + poll_budget(self.op.bytes())).max(now + WAIT_POLL)
    }
}

/// Wait until `ready()` or `timeout` (from `start`): poll (yielding the processor between
/// tests) until `poll_until`, then sleep with an exponential backoff from 1 µs to
/// [`WAIT_MAX_NAP`], testing after each sleep.
fn backoff_wait(
    start: Instant,
    timeout: Duration,
    poll_until: Instant,
    mut ready: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let poll_end = poll_until.min(start + timeout);
    let mut i: u32 = 0;
    loop {
        if ready()? {
            return Ok(());
        }
        i = i.wrapping_add(1);
        if i % 16 == 0 {
            if Instant::now() >= poll_end {
                break;
            }
            std::thread::yield_now();
        }
    }
    let mut nap = Duration::from_micros(1);
    loop {
        let spent = start.elapsed();
        if spent >= timeout {
            return Ok(());
        }
        std::thread::sleep(nap.min(timeout - spent));
        if ready()? {
            return Ok(());
        }
        nap = (nap * 2).min(WAIT_MAX_NAP);
    }
}

fn lost(rank: usize, e: Error) -> Error {
    match e {
        Error::Io { context, source } => Error::ConnectionLost {
            rank,
            source: std::io::Error::new(source.kind(), format!("{context}: {source}")),
        },
        o => o,
    }
}

/// The sending half of an MPI connection.
struct MpiTx {
    peer: usize,
    p: Params,
    /// `p.inline_max()`, computed once.
    inline_max: usize,
    /// The eager buffer being filled, and how much of it is filled.
    cur: Option<Vec<u8>>,
    fill: usize,
    free: Vec<Vec<u8>>,
    inflight: VecDeque<OwnedSend>,
    gather: Option<Transfer>,
    sent_any: bool,
    broken: Option<String>,
    /// Last field: dropped after the requests above, so MPI is still alive for them.
    ch: Arc<ChanShared>,
}

impl MpiTx {
    fn new(ch: Arc<ChanShared>, peer: usize, p: Params) -> Self {
        MpiTx {
            ch,
            peer,
            p,
            inline_max: p.inline_max(),
            cur: None,
            fill: 0,
            free: Vec::new(),
            inflight: VecDeque::new(),
            gather: None,
            sent_any: false,
            broken: None,
        }
    }

    fn usable(&self) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(c) => Err(Error::Poisoned {
                rank: self.peer,
                cause: c.as_str().into(),
            }),
        }
    }

    /// Hand the filled part of the eager buffer to MPI.
    fn flush(&mut self) -> Result<()> {
        if self.fill == 0 {
            return Ok(());
        }
        if self.fill <= self.inline_max && self.inflight.is_empty() {
            if let Some(buf) = self.cur.as_ref() {
                self.ch
                    .comm
                    .send_small(&buf[..self.fill], self.peer, DATA_TAG)
                    .map_err(|e| lost(self.peer, e))?;
                self.sent_any = true;
                self.fill = 0;
                return Ok(());
            }
        }
        if let Some(buf) = self.cur.take() {
            let s = self
                .ch
                .comm
                .isend_owned(buf, self.fill, self.peer, DATA_TAG)
                .map_err(|e| lost(self.peer, e))?;
            self.inflight.push_back(s);
            self.sent_any = true;
        }
        self.fill = 0;
        Ok(())
    }

    /// Reap completed eager sends (in order); true when none is left.
    fn reap(&mut self) -> Result<bool> {
        while let Some(front) = self.inflight.front_mut() {
            match front.test().map_err(|e| lost(self.peer, e))? {
                Some(buf) => {
                    self.inflight.pop_front();
                    if self.free.len() < MAX_INFLIGHT {
                        self.free.push(buf);
                    }
                }
                None => return Ok(false),
            }
        }
        Ok(true)
    }
}

impl TxLink for MpiTx {
    fn begin_message(&mut self) -> Result<()> {
        self.usable()?;
        self.sent_any = false;
        Ok(())
    }

    fn with_buffer(
        &mut self,
        tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.usable()?;
        if tm != 0 {
            return Err(Error::protocol(
                self.peer,
                format!("mpi: TM {tm} is not a copy TM"),
            ));
        }
        if self.cur.is_none() {
            let buf = match self.free.pop() {
                Some(b) => b,
                None => {
                    if self.inflight.len() >= MAX_INFLIGHT {
                        self.reap()?;
                        match self.free.pop() {
                            Some(b) => b,
                            None => return Ok(Poll::Pending),
                        }
                    } else {
                        vec![0u8; self.p.eager_buf]
                    }
                }
            };
            self.cur = Some(buf);
            self.fill = 0;
        }
        let cap = self.p.eager_buf;
        if let Some(buf) = self.cur.as_mut() {
            let n = fill(&mut buf[self.fill..cap]);
            self.fill += n.min(cap - self.fill);
        }
        if self.fill == cap {
            self.flush()?;
        }
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.usable()?;
        if tm != 1 {
            return Err(Error::protocol(
                self.peer,
                format!("mpi: TM {tm} is not a gather TM"),
            ));
        }
        if self.gather.is_none() {
            // Copy data handed over before goes first (the core commits before switching
            // TMs; this keeps the order even if it did not).
            self.flush()?;
            let total: usize = iov.iter().map(|s| s.len()).sum();
            let dt = use_datatype(self.p.policy, self.p.family, iov.len(), total);
            let op = self
                .ch
                .comm
                .gather_send(iov, self.peer, DATA_TAG, dt)
                .map_err(|e| lost(self.peer, e))?;
            self.sent_any = true;
            self.gather = Some(Transfer::new(op));
        }
        let done = match self.gather.as_mut() {
            Some(t) => t.op.test().map_err(|e| lost(self.peer, e))?,
            None => true,
        };
        if done {
            self.gather = None;
            // Opportunistic: let finished eager sends go back to the free list.
            self.reap()?;
            Ok(Poll::Ready(()))
        } else {
            Ok(Poll::Pending)
        }
    }

    fn commit(&mut self, tm: TmId) -> Result<Poll<()>> {
        self.usable()?;
        if tm == 0 {
            self.flush()?;
        }
        Ok(Poll::Ready(()))
    }

    fn flush(&mut self) -> Result<Poll<()>> {
        // `Packer::flush`: the eager buffer leaves now as its own MPI message (the receiver
        // takes a message's eager data from as many messages as it comes in).
        self.usable()?;
        MpiTx::flush(self)?;
        Ok(Poll::Ready(()))
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        self.usable()?;
        self.flush()?;
        if let Some(t) = self.gather.as_mut() {
            if !t.op.test().map_err(|e| lost(self.peer, e))? {
                return Ok(Poll::Pending);
            }
            self.gather = None;
        }
        if self.reap()? {
            Ok(Poll::Ready(()))
        } else {
            Ok(Poll::Pending)
        }
    }

    fn abort_message(&mut self) -> AbortOutcome {
        // An unfinished gather operation is cancelled and waited for here, before the core
        // releases the user's memory.
        self.gather = None;
        if self.sent_any {
            self.broken = Some("a message was abandoned after part of it had been sent".into());
            self.cur = None;
            self.fill = 0;
            AbortOutcome::Broken
        } else {
            self.fill = 0;
            AbortOutcome::Discarded
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let now = Instant::now();
        let poll_until = match self.gather.as_mut() {
            Some(t) => t.poll_until(now),
            None => now + WAIT_POLL,
        };
        backoff_wait(now, timeout, poll_until, || {
            if let Some(t) = self.gather.as_mut() {
                return t.op.test().map_err(|e| lost(self.peer, e));
            }
            self.reap()
        })
    }
}

/// The receiving half of an MPI connection.
struct MpiRx {
    peer: usize,
    /// The eager buffer in hand (None while parked in `ch.pre`) and its unread window.
    buf: Option<Vec<u8>>,
    len: usize,
    pos: usize,
    /// Whether our eager buffer is in `ch.pre` (a receive from this peer posted, or to be
    /// posted by the next test).
    parked: bool,
    gather: Option<Transfer>,
    p: Params,
    broken: Option<String>,
    /// Last field: dropped after the requests above, so MPI is still alive for them.
    ch: Arc<ChanShared>,
}

impl MpiRx {
    fn new(ch: Arc<ChanShared>, peer: usize, p: Params) -> Result<Self> {
        // Every message starts with eager data: the first receive is posted now, so the
        // first message lands in place even if it arrives before the first poll.
        ch.pre.park(peer, vec![0u8; p.eager_buf], true)?;
        Ok(MpiRx {
            ch,
            peer,
            buf: None,
            len: 0,
            pos: 0,
            parked: true,
            gather: None,
            p,
            broken: None,
        })
    }

    fn usable(&self) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(c) => Err(Error::Poisoned {
                rank: self.peer,
                cause: c.as_str().into(),
            }),
        }
    }

    /// Give the eager buffer back for the next eager message; no MPI call here: the receive
    /// is posted by the next test (`fill`, or an any-source poll), off the critical path of a
    /// ping-pong (the reply leaves first).
    fn park(&mut self) -> Result<()> {
        if !self.parked {
            let b = self
                .buf
                .take()
                .unwrap_or_else(|| vec![0u8; self.p.eager_buf]);
            self.len = 0;
            self.pos = 0;
            self.ch
                .pre
                .park(self.peer, b, self.p.post_early)
                .map_err(|e| lost(self.peer, e))?;
            self.parked = true;
        }
        Ok(())
    }

    /// Make eager bytes available; Pending when none has arrived yet.
    #[inline]
    fn fill(&mut self) -> Result<Poll<()>> {
        if self.pos < self.len {
            return Ok(Poll::Ready(()));
        }
        if !self.parked {
            self.park()?;
        }
        match self
            .ch
            .pre
            .take(self.peer)
            .map_err(|e| lost(self.peer, e))?
        {
            None => Ok(Poll::Pending),
            Some((b, n)) => {
                self.parked = false;
                self.buf = Some(b);
                self.len = n;
                self.pos = 0;
                if n == 0 {
                    return Err(self.poison("empty eager message".into()));
                }
                Ok(Poll::Ready(()))
            }
        }
    }

    fn poison(&mut self, what: String) -> Error {
        self.broken = Some(what.clone());
        Error::protocol(self.peer, what)
    }
}

impl RxLink for MpiRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        self.usable()?;
        self.fill()
    }

    fn with_data(
        &mut self,
        tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.usable()?;
        if tm != 0 {
            return Err(Error::protocol(
                self.peer,
                format!("mpi: TM {tm} is not a copy TM"),
            ));
        }
        if self.fill()?.is_pending() {
            return Ok(Poll::Pending);
        }
        if let Some(buf) = self.buf.as_ref() {
            let n = take(&buf[self.pos..self.len]);
            self.pos += n.min(self.len - self.pos);
        }
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, tm: TmId, iov: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        self.usable()?;
        if tm != 1 {
            return Err(Error::protocol(
                self.peer,
                format!("mpi: TM {tm} is not a gather TM"),
            ));
        }
        if self.gather.is_none() {
            if self.pos < self.len || self.parked {
                return Err(self.poison(
                    "copy data left unread before a gather group (unpack sequence differs from pack)"
                        .into(),
                ));
            }
            let total: usize = iov.iter().map(|s| s.len()).sum();
            let dt = use_datatype(self.p.policy, self.p.family, iov.len(), total);
            let op = self
                .ch
                .comm
                .scatter_recv(iov, self.peer, DATA_TAG, dt)
                .map_err(|e| lost(self.peer, e))?;
            self.gather = Some(Transfer::new(op));
        }
        let done = match self.gather.as_mut() {
            Some(t) => t.op.test().map_err(|e| lost(self.peer, e))?,
            None => true,
        };
        if done {
            self.gather = None;
            Ok(Poll::Ready(()))
        } else {
            Ok(Poll::Pending)
        }
    }

    fn checkout(&mut self, tm: TmId) -> Result<()> {
        self.usable()?;
        if tm == 0 && self.pos < self.len {
            let left = self.len - self.pos;
            return Err(self.poison(format!(
                "{left} B of copy data left unread at checkout (unpack sequence differs from pack)"
            )));
        }
        Ok(())
    }

    fn end_message(&mut self) -> Result<()> {
        self.checkout(0)?;
        // The buffer goes back for the next message's eager data (posted by the next test).
        self.park()
    }

    fn abort_message(&mut self) {
        // Cancels and waits for an unfinished scatter receive before the user memory goes.
        self.gather = None;
        self.ch.pre.cancel(self.peer);
        self.parked = false;
        self.broken = Some("a message was abandoned midway; the stream is out of step".into());
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        let now = Instant::now();
        let poll_until = match self.gather.as_mut() {
            Some(t) => t.poll_until(now),
            None => now + WAIT_POLL,
        };
        backoff_wait(now, timeout, poll_until, || {
            if let Some(t) = self.gather.as_mut() {
                return t.op.test().map_err(|e| lost(self.peer, e));
            }
            Ok(self.fill()?.is_ready())
        })
    }
}

/// Channel state shared by the links and the any-source readiness. Field order is drop
/// order: the posted receives are cancelled before the communicator is freed.
struct ChanShared {
    pre: Preposted,
    comm: Comm,
}

/// Any-source readiness: `MPI_Testsome` over the posted eager receives of the channel.
struct MpiIncoming {
    ch: Arc<ChanShared>,
    woken: AtomicBool,
}

impl Incoming for MpiIncoming {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        self.ch.pre.poll_any(ready)
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        let now = Instant::now();
        backoff_wait(now, timeout, now + WAIT_POLL, || {
            if self.woken.swap(false, Ordering::AcqRel) {
                return Ok(true);
            }
            let mut any = false;
            self.ch.pre.poll_any(&mut |_| any = true)?;
            Ok(any)
        })
    }

    fn wake(&self) {
        self.woken.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mad_core::driver::Bmm;
    use mad_core::{RecvMode, SendMode};

    #[test]
    fn table_is_valid_and_selects() {
        let t = tm_table().unwrap();
        assert_eq!(t.tms().len(), 2);
        assert_eq!(t.bmm(0), Bmm::Copy);
        assert_eq!(t.bmm(1), Bmm::Gather);
        assert_eq!(t.select(8, SendMode::Cheaper, RecvMode::Express), 0);
        assert_eq!(t.select(EAGER_MAX, SendMode::Cheaper, RecvMode::Cheaper), 0);
        assert_eq!(
            t.select(EAGER_MAX + 1, SendMode::Safer, RecvMode::Cheaper),
            1
        );
        assert_eq!(t.max_group(1), GROUP_MAX);
    }

    #[test]
    fn gather_decision() {
        use MpiFamily::*;
        let auto = GatherPolicy::Auto;
        assert!(!use_datatype(auto, OpenMpi, 1, 16 << 10));
        assert!(use_datatype(auto, OpenMpi, 2, 32 << 10));
        assert!(use_datatype(auto, OpenMpi, 8, 8 * (8 << 10)));
        assert!(!use_datatype(auto, OpenMpi, 2, 64 << 10));
        assert!(!use_datatype(auto, OpenMpi, 2, 2 << 10));
        assert!(!use_datatype(auto, OpenMpi, 2, 1 << 20));
        assert!(!use_datatype(auto, Mpich, 2, 32 << 10));
        assert!(!use_datatype(auto, Other, 2, 32 << 10));
        assert!(use_datatype(GatherPolicy::Datatype, Mpich, 3, usize::MAX));
        assert!(!use_datatype(GatherPolicy::Datatype, Mpich, 1, 10));
        assert!(!use_datatype(GatherPolicy::Separate, OpenMpi, 3, 30 << 10));
        assert_eq!(
            MpiFamily::from_version("Open MPI v4.1.4, package: Debian"),
            OpenMpi
        );
        assert_eq!(MpiFamily::from_version("MPICH Version:\t4.0.2"), Mpich);
        assert_eq!(MpiFamily::from_version("Intel(R) MPI"), Other);
    }

    #[test]
    fn thread_level_decision() {
        let codes = |v: &[Threading]| {
            v.iter()
                .map(|&t| Some(level_code(t)))
                .collect::<Vec<_>>()
                .into_iter()
        };
        use Threading::*;
        assert_eq!(thread_level_refusal(codes(&[Multiple, Multiple])), None);
        assert_eq!(thread_level_refusal(codes(&[Serialized, Multiple])), None);
        let r = thread_level_refusal(codes(&[Multiple, Funneled, Single])).unwrap();
        assert!(r.contains("MPI_THREAD_FUNNELED on rank 1"), "{r}");
        let r = thread_level_refusal(codes(&[Single])).unwrap();
        assert!(r.contains("MPI_THREAD_SINGLE on rank 0"), "{r}");
        // A malformed descriptor is reported by the descriptor checks, not here.
        assert_eq!(thread_level_refusal([None, Some(3)].into_iter()), None);
        for t in [Single, Funneled, Serialized, Multiple] {
            assert_eq!(level_of_code(level_code(t)), t);
        }
        assert_eq!(
            thread_note(Multiple, Some(Multiple), false),
            "thread level: MPI_THREAD_MULTIPLE granted (requested MPI_THREAD_MULTIPLE): MPI calls run concurrently"
        );
        assert!(thread_note(Multiple, Some(Multiple), true).contains("MAD_MPI_SERIALISE=1"));
        let n = thread_note(Serialized, None, true);
        assert!(n.contains("MPI_THREAD_SERIALIZED granted (MPI initialised by the application)"));
        assert!(n.contains("lock") && !n.contains("MAD_MPI_SERIALISE"));
    }

    #[test]
    fn wait_poll_budget() {
        assert_eq!(poll_budget(0), WAIT_POLL);
        // 4 MiB: 0.5 + 4.19 ms; 16 MiB: 0.5 + 16.8 ms (1 GB/s: one byte per ns).
        assert_eq!(
            poll_budget(4 << 20),
            WAIT_POLL + Duration::from_nanos(4 << 20)
        );
        assert!(poll_budget(16 << 20) > Duration::from_millis(17));
        assert!(poll_budget(16 << 20) < Duration::from_millis(18));
        assert!(poll_budget(usize::MAX) > Duration::from_secs(1 << 30));
    }

    #[test]
    fn options() {
        let c = ChannelConfig::parse("x", "mpi,gather=separate,eager_buf=4096").unwrap();
        let p = params(&c).unwrap();
        assert_eq!(p.policy, GatherPolicy::Separate);
        assert_eq!(p.eager_buf, 4096);
        assert!(params(&ChannelConfig::parse("x", "mpi,gather=magic").unwrap()).is_err());
        assert!(params(&ChannelConfig::parse("x", "mpi,eager_buf=1").unwrap()).is_err());
        assert!(params(&ChannelConfig::parse("x", "mpi,eager_buf=lots").unwrap()).is_err());
        let p = params(&ChannelConfig::parse("x", "mpi").unwrap()).unwrap();
        let m = p.with_family(MpiFamily::Mpich);
        assert_eq!(
            (m.inline_max(), m.eager_buf),
            (SEND_INLINE_MPICH, EAGER_BUF_MPICH)
        );
        let o = p.with_family(MpiFamily::OpenMpi);
        assert_eq!(
            (o.inline_max(), o.eager_buf),
            (SEND_INLINE_OTHER, EAGER_BUF_OPENMPI)
        );
        let x = p.with_family(MpiFamily::Other);
        assert_eq!(
            (x.inline_max(), x.eager_buf),
            (SEND_INLINE_OTHER, EAGER_BUF)
        );
        let c = ChannelConfig::parse("x", "mpi,eager_buf=4096").unwrap();
        assert_eq!(
            params(&c).unwrap().with_family(MpiFamily::Mpich).eager_buf,
            4096
        );
        assert!(params(&ChannelConfig::parse("x", "mpi,post=eventually").unwrap()).is_err());
        assert!(
            params(&ChannelConfig::parse("x", "mpi,post=early").unwrap())
                .unwrap()
                .post_early
        );
        let p = params(&ChannelConfig::parse("x", "mpi,inline=0").unwrap()).unwrap();
        assert_eq!(p.inline_max(), 0);
        assert!(params(&ChannelConfig::parse("x", "mpi,inline=big").unwrap()).is_err());
    }
}
