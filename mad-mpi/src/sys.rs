//! Every foreign MPI call of the crate, wrapped in safe types that clean up on drop.
//!
//! The rest of the crate is safe Rust. Types here:
//!
//! * [`Runtime`]: MPI initialised once per process with `MPI_THREAD_MULTIPLE` requested (or
//!   the level of `MAD_MPI_THREAD_LEVEL`); `MPI_Finalize` runs when the last handle drops.
//!   When less than `MULTIPLE` is granted, every call of this module takes one process-wide
//!   lock ([`guard`]); that is enough under `SERIALIZED` only: under `FUNNELED` and `SINGLE`
//!   only the thread that initialised MPI may call it ([`Runtime::check_thread`]), so the
//!   driver refuses to open channels there and the bootstrap works from that thread alone.
//!   When the application initialised MPI, this crate never finalises it.
//! * [`Comm`]: a communicator (world, or a duplicate/split that is freed on drop), with the
//!   collectives the bootstrap needs and the point-to-point calls of the driver. Only the
//!   communicators this crate creates (duplicates and splits, [`Comm::dup_of_application`])
//!   carry `MPI_ERRORS_RETURN`; `MPI_COMM_WORLD` and the application's communicators are
//!   only ever duplicated, their error handlers left as the application set them.
//! * [`OwnedSend`]: a non-blocking send of a buffer the request owns; dropping one that MPI
//!   still uses leaks the buffer instead of freeing memory MPI may touch.
//! * [`Preposted`]: the eager receive of every peer of a channel (parked at the end of a
//!   message, posted by the next test), tested one by one (`MPI_Test`, by the link, without a
//!   lock) or all at once (`MPI_Testsome`, any-source).
//! * [`GatherOp`]: a non-blocking operation on *user* memory (a group of slices), sent as one
//!   message with an `MPI_Type_create_hindexed` datatype over absolute addresses from
//!   `MPI_BOTTOM`, or as one message per slice. Dropping an unfinished one cancels it and
//!   waits until MPI has released the memory.

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use mad_core::{Error, Result};
use mpi::environment::Threading;
use mpi::ffi;

/// Largest byte count of one MPI block (counts are C `int`s); bigger slices are cut.
pub(crate) const MAX_BLOCK: usize = 1 << 30;

static SERIAL: AtomicBool = AtomicBool::new(false);
static BIG_LOCK: Mutex<()> = Mutex::new(());

/// The process-wide lock every MPI call takes when MPI granted less than `THREAD_MULTIPLE`.
pub(crate) fn guard() -> Option<MutexGuard<'static, ()>> {
    if SERIAL.load(Ordering::Relaxed) {
        Some(BIG_LOCK.lock().unwrap_or_else(|p| p.into_inner()))
    } else {
        None
    }
}

enum RtState {
    Never,
    Live(Weak<Runtime>),
    Finalized,
}

static RT: Mutex<RtState> = Mutex::new(RtState::Never);

/// MPI, initialised for this process. Dropping the last handle finalises MPI (when this crate
/// initialised it).
pub struct Runtime {
    universe: Mutex<Option<mpi::environment::Universe>>,
    requested: Option<Threading>,
    threading: Threading,
    serialised: bool,
    world_rank: usize,
    world_size: usize,
    version: String,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({:?}, {})", self.threading, self.version)
    }
}

impl Runtime {
    /// The threading level MPI granted.
    pub fn threading(&self) -> Threading {
        self.threading
    }
    /// The level this crate asked `MPI_Init_thread` for; `None` when the application had
    /// initialised MPI itself.
    pub fn requested(&self) -> Option<Threading> {
        self.requested
    }
    /// Whether MPI calls are serialised by a lock (less than `MPI_THREAD_MULTIPLE` granted).
    pub fn serialised(&self) -> bool {
        self.serialised
    }
    /// The first line of `MPI_Get_library_version`.
    pub fn version(&self) -> &str {
        &self.version
    }
    /// This process's rank in `MPI_COMM_WORLD` (read once, at initialisation).
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }
    /// The size of `MPI_COMM_WORLD` (read once, at initialisation).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether the calling thread may call MPI: always under `SERIALIZED` and `MULTIPLE`
    /// (with the lock for `SERIALIZED`); under `FUNNELED` and `SINGLE` only the thread that
    /// initialised MPI (`MPI_Is_thread_main`). `Err(Unavailable)` naming the level otherwise.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] naming the thread level when the
    /// calling thread may not call MPI.
    pub fn check_thread(&self, what: &str) -> Result<()> {
        if channel_level_ok(self.threading) {
            return Ok(());
        }
        if is_thread_main() {
            return Ok(());
        }
        Err(unavailable(&format!(
            "{what} on a thread other than the one that initialised MPI, but MPI granted only {}: \
             under that level only the main thread may call MPI",
            level_name(self.threading)
        )))
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let mut st = RT.lock().unwrap_or_else(|p| p.into_inner());
        let uni = self
            .universe
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        *st = if uni.is_some() {
            // Dropping the universe calls MPI_Finalize.
            drop(uni);
            RtState::Finalized
        } else {
            // The application owns MPI: nothing to finalise, and a later bootstrap or channel
            // may use it again (`runtime` checks it is still initialised).
            RtState::Never
        };
    }
}

/// `MPI_Is_thread_main` (MPI must be initialised and not finalised).
fn is_thread_main() -> bool {
    let mut main: c_int = 0;
    // SAFETY: callers hold a live runtime or have just checked MPI is initialised; valid
    // out-pointer. MPI_Is_thread_main may be called from any thread at any level.
    let rc = unsafe { ffi::MPI_Is_thread_main(&mut main) };
    rc == 0 && main != 0
}

/// The standard name of a threading level (`MPI_THREAD_FUNNELED`, ...).
pub fn level_name(t: Threading) -> &'static str {
    match t {
        Threading::Single => "MPI_THREAD_SINGLE",
        Threading::Funneled => "MPI_THREAD_FUNNELED",
        Threading::Serialized => "MPI_THREAD_SERIALIZED",
        Threading::Multiple => "MPI_THREAD_MULTIPLE",
    }
}

/// Whether MPI channels can run at threading level `t`: the engine calls a channel's links
/// from whichever thread packs, unpacks or polls, so the driver needs MPI calls from any
/// thread: `SERIALIZED` (with the process-wide lock) or `MULTIPLE`. A pure decision.
pub fn channel_level_ok(t: Threading) -> bool {
    t >= Threading::Serialized
}

/// Parse a threading level (`MAD_MPI_THREAD_LEVEL`): `single`, `funneled`, `serialized`
/// (or `serialised`), `multiple`, case-insensitive, with or without the `MPI_THREAD_` prefix.
pub fn parse_level(s: &str) -> Result<Threading> {
    let l = s.trim().to_ascii_lowercase();
    let l = l.strip_prefix("mpi_thread_").unwrap_or(&l);
    match l {
        "single" => Ok(Threading::Single),
        "funneled" | "funnelled" => Ok(Threading::Funneled),
        "serialized" | "serialised" => Ok(Threading::Serialized),
        "multiple" => Ok(Threading::Multiple),
        _ => Err(Error::BadConfig(format!(
            "MAD_MPI_THREAD_LEVEL={s}: expected single, funneled, serialized or multiple"
        ))),
    }
}

/// A level code `MPI_Query_thread` returned; an unknown code counts as the most restrictive.
fn level_from_raw(v: c_int) -> Threading {
    [
        Threading::Multiple,
        Threading::Serialized,
        Threading::Funneled,
        Threading::Single,
    ]
    .into_iter()
    .find(|&t| threading_raw(t) == v)
    .unwrap_or(Threading::Single)
}

/// The process's MPI runtime: initialises MPI on first use, asking `MPI_Init_thread` for
/// `MPI_THREAD_MULTIPLE` (or `MAD_MPI_THREAD_LEVEL`: a lower level, to run the paths of MPIs
/// that grant less; `Err(BadConfig)` if it does not parse).
pub fn runtime() -> Result<Arc<Runtime>> {
    let mut st = RT.lock().unwrap_or_else(|p| p.into_inner());
    match &*st {
        RtState::Live(w) => {
            return w
                .upgrade()
                .ok_or_else(|| unavailable("MPI is being finalised"));
        }
        RtState::Finalized => {
            return Err(unavailable(
                "MPI was already finalised in this process and cannot be initialised again",
            ))
        }
        RtState::Never => {}
    }
    if mpi::environment::is_finalized() {
        return Err(unavailable(
            "MPI was already finalised in this process (by the application?) and cannot be \
             initialised again",
        ));
    }
    let (universe, requested, threading) = if mpi::environment::is_initialized() {
        // Someone else (the application, through rsmpi) initialised MPI: use it, never
        // finalise it.
        let mut provided: c_int = 0;
        // SAFETY: MPI is initialised; `provided` is a valid out-pointer.
        unsafe { ffi::MPI_Query_thread(&mut provided) };
        let t = level_from_raw(provided);
        if !channel_level_ok(t) && !is_thread_main() {
            return Err(unavailable(&format!(
                "the application initialised MPI with {} and this thread is not the one that \
                 did: it may not call MPI",
                level_name(t)
            )));
        }
        (None, None, t)
    } else {
        let want = match std::env::var("MAD_MPI_THREAD_LEVEL") {
            Ok(v) => parse_level(&v)?,
            Err(_) => Threading::Multiple,
        };
        match mpi::initialize_with_threading(want) {
            Some((u, t)) => (Some(u), Some(want), t),
            None => return Err(unavailable("MPI_Init_thread failed")),
        }
    };
    // `MAD_MPI_SERIALISE=1` forces the lock even with THREAD_MULTIPLE (tests the path MPIs
    // that grant less take); read once, at initialisation.
    let serialised = threading != Threading::Multiple
        || std::env::var("MAD_MPI_SERIALISE").is_ok_and(|v| v == "1");
    SERIAL.store(serialised, Ordering::Relaxed);
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    {
        let _g = guard();
        // SAFETY: MPI is initialised; COMM_WORLD is a predefined handle; valid out-pointers.
        // Its error handler is left alone: the communicators this crate communicates on are
        // duplicates, which get MPI_ERRORS_RETURN (`Comm::wrap`).
        unsafe {
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
        }
    }
    let rt = Arc::new(Runtime {
        universe: Mutex::new(universe),
        requested,
        threading,
        serialised,
        world_rank: rank.max(0) as usize,
        world_size: size.max(0) as usize,
        version: library_version(),
    });
    *st = RtState::Live(Arc::downgrade(&rt));
    Ok(rt)
}

/// The process's MPI runtime when the application initialised MPI itself (see
/// [`Comm::dup_of_application`]): `Err(Unavailable)` when MPI is not initialised (this
/// function never initialises it) or already finalised; the handle of this crate when it
/// initialised MPI itself.
pub fn application_runtime() -> Result<Arc<Runtime>> {
    if !mpi::environment::is_initialized() {
        return Err(unavailable(
            "MPI is not initialised: an application that hands its communicator to mad-mpi \
             must call MPI_Init or MPI_Init_thread first (or let mad-mpi initialise MPI: \
             MpiBootstrap::new, MpiDriver::new)",
        ));
    }
    runtime()
}

/// Whether `MPI_Finalize` has been called (`MPI_Finalized` may be called at any time).
fn finalized() -> bool {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called before MPI_Init and after MPI_Finalize; valid
    // out-pointer.
    let rc = unsafe { ffi::MPI_Finalized(&mut flag) };
    rc == 0 && flag != 0
}

fn threading_raw(t: Threading) -> c_int {
    // SAFETY: reading link-time constants exported by the rsmpi shim.
    unsafe {
        match t {
            Threading::Single => ffi::RSMPI_THREAD_SINGLE,
            Threading::Funneled => ffi::RSMPI_THREAD_FUNNELED,
            Threading::Serialized => ffi::RSMPI_THREAD_SERIALIZED,
            Threading::Multiple => ffi::RSMPI_THREAD_MULTIPLE,
        }
    }
}

fn library_version() -> String {
    let mut buf = vec![0u8; 8192];
    let mut len: c_int = 0;
    let _g = guard();
    // SAFETY: MPI_MAX_LIBRARY_VERSION_STRING is at most 8192 in both MPICH and Open MPI;
    // `buf` is that large and `len` is a valid out-pointer.
    let rc = unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    if rc != 0 {
        return "unknown MPI".into();
    }
    buf.truncate(len.clamp(0, 8192) as usize);
    // Open MPI counts the terminating NUL in `len`: cut at the first NUL.
    if let Some(nul) = buf.iter().position(|&b| b == 0) {
        buf.truncate(nul);
    }
    String::from_utf8_lossy(&buf)
        .lines()
        .next()
        .unwrap_or("unknown MPI")
        .trim()
        .to_string()
}

fn unavailable(reason: &str) -> Error {
    Error::unavailable("mpi", reason)
}

/// Convert an MPI return code into an error (the one place native MPI codes are converted).
/// Inlined: the success test is on every MPI call of the fast paths; the error is built out of
/// line.
#[inline(always)]
pub(crate) fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(mpi_error(rc, what))
    }
}

#[cold]
#[inline(never)]
fn mpi_error(rc: c_int, what: &str) -> Error {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // SAFETY: MPI_MAX_ERROR_STRING is at most 1024 in both MPIs; valid out-pointers.
    let r2 = unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    let msg = if r2 == 0 {
        buf.truncate(len.clamp(0, 1024) as usize);
        String::from_utf8_lossy(&buf).into_owned()
    } else {
        String::new()
    };
    Error::io(
        format!("{what}: MPI error {rc}"),
        std::io::Error::other(msg),
    )
}

fn zero_status() -> ffi::MPI_Status {
    // SAFETY: MPI_Status is a plain C struct of integers; all-zero is a valid value.
    unsafe { MaybeUninit::<ffi::MPI_Status>::zeroed().assume_init() }
}

fn byte() -> ffi::MPI_Datatype {
    // SAFETY: reading a link-time constant exported by the rsmpi shim.
    unsafe { ffi::RSMPI_UINT8_T }
}

fn to_int(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n)
        .map_err(|_| Error::Resource(format!("{what}: {n} does not fit an MPI count")))
}

/// A communicator.
pub struct Comm {
    raw: ffi::MPI_Comm,
    owned: bool,
    _rt: Arc<Runtime>,
}

// SAFETY: an MPI communicator handle is a plain identifier (an int in MPICH, a pointer to a
// library object in Open MPI) that MPI allows any thread to use when THREAD_MULTIPLE is
// granted; otherwise every call in this module takes the process-wide lock (`guard`).
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: MPI calls on a communicator are thread-safe under THREAD_MULTIPLE,
// and serialised by `guard` otherwise.
unsafe impl Sync for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank(), self.size())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // After an application's MPI_Finalize (it dropped us too late) freeing is erroneous:
        // the handle is leaked instead.
        if self.owned && !finalized() {
            let _g = guard();
            // SAFETY: `raw` is a communicator this value created and nobody else frees.
            unsafe { ffi::MPI_Comm_free(&mut self.raw) };
        }
    }
}

impl Comm {
    /// `MPI_COMM_WORLD` (not freed on drop). Only its rank and size are read and it is
    /// duplicated ([`dup`](Self::dup), [`reorder`](Self::reorder)); nothing is sent on it and
    /// its error handler is not changed.
    pub fn world(rt: &Arc<Runtime>) -> Comm {
        Comm {
            // SAFETY: reading a link-time constant exported by the rsmpi shim.
            raw: unsafe { ffi::RSMPI_COMM_WORLD },
            owned: false,
            _rt: rt.clone(),
        }
    }

    /// The MPI runtime this communicator belongs to.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self._rt
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        let mut r: c_int = 0;
        let _g = guard();
        // SAFETY: valid communicator and out-pointer.
        unsafe { ffi::MPI_Comm_rank(self.raw, &mut r) };
        r.max(0) as usize
    }

    /// Number of processes.
    pub fn size(&self) -> usize {
        let mut r: c_int = 0;
        let _g = guard();
        // SAFETY: valid communicator and out-pointer.
        unsafe { ffi::MPI_Comm_size(self.raw, &mut r) };
        r.max(0) as usize
    }

    /// A duplicate of an application's communicator `raw` (collective over it: every process
    /// of `raw` must call this), with `MPI_ERRORS_RETURN`; `raw` itself is not changed.
    ///
    /// `Err(BadConfig)` for `MPI_COMM_NULL` and for an intercommunicator. MPI gives no way to
    /// check that any other value is a communicator: the caller's type vouches for it
    /// (`AsRaw` is an `unsafe` trait).
    pub fn dup_of_application(rt: &Arc<Runtime>, raw: ffi::MPI_Comm) -> Result<Comm> {
        // SAFETY: reading a link-time constant exported by the rsmpi shim.
        if raw == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::BadConfig(
                "mad-mpi was given MPI_COMM_NULL: pass a communicator this process belongs to"
                    .into(),
            ));
        }
        let mut inter: c_int = 0;
        {
            let _g = guard();
            // SAFETY: `raw` is a communicator handle (the caller's `AsRaw` vouches for it);
            // valid out-pointer.
            let rc = unsafe { ffi::MPI_Comm_test_inter(raw, &mut inter) };
            check(rc, "MPI_Comm_test_inter")?;
        }
        if inter != 0 {
            return Err(Error::BadConfig(
                "mad-mpi was given an intercommunicator: pass an intracommunicator".into(),
            ));
        }
        let app = Comm {
            raw,
            owned: false,
            _rt: rt.clone(),
        };
        app.dup()
    }

    /// A communicator this crate created: freed on drop, and its errors returned as codes
    /// (`MPI_ERRORS_RETURN`) instead of the handler it inherited from its parent.
    fn wrap(&self, raw: ffi::MPI_Comm) -> Result<Comm> {
        let c = Comm {
            raw,
            owned: true,
            _rt: self._rt.clone(),
        };
        let rc = {
            let _g = guard();
            // SAFETY: `raw` is a communicator MPI just created for us; ERRORS_RETURN is a
            // predefined handle.
            unsafe { ffi::MPI_Comm_set_errhandler(c.raw, ffi::RSMPI_ERRORS_RETURN) }
        };
        check(rc, "MPI_Comm_set_errhandler")?;
        Ok(c)
    }

    /// Collective: `MPI_Comm_dup` (same ranks, separate matching context).
    pub fn dup(&self) -> Result<Comm> {
        // SAFETY: reading a link-time constant exported by the rsmpi shim.
        let mut out = unsafe { ffi::RSMPI_COMM_NULL };
        let rc = {
            let _g = guard();
            // SAFETY: valid communicator and out-pointer.
            unsafe { ffi::MPI_Comm_dup(self.raw, &mut out) }
        };
        check(rc, "MPI_Comm_dup")?;
        self.wrap(out)
    }

    /// Collective: `MPI_Comm_split(color 0, key)`: a new context whose ranks follow `key`.
    pub fn reorder(&self, key: usize) -> Result<Comm> {
        // SAFETY: reading a link-time constant exported by the rsmpi shim.
        let mut out = unsafe { ffi::RSMPI_COMM_NULL };
        let key = to_int(key, "rank")?;
        let rc = {
            let _g = guard();
            // SAFETY: valid communicator and out-pointer.
            unsafe { ffi::MPI_Comm_split(self.raw, 0, key, &mut out) }
        };
        check(rc, "MPI_Comm_split")?;
        self.wrap(out)
    }

    /// Collective: `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`: the processes on this host.
    pub fn split_shared(&self) -> Result<Comm> {
        // SAFETY: reading link-time constants exported by the rsmpi shim.
        let (mut out, ty, info) = unsafe {
            (
                ffi::RSMPI_COMM_NULL,
                ffi::RSMPI_COMM_TYPE_SHARED,
                ffi::RSMPI_INFO_NULL,
            )
        };
        let key = to_int(self.rank(), "rank")?;
        let rc = {
            let _g = guard();
            // SAFETY: valid communicator, constants and out-pointer.
            unsafe { ffi::MPI_Comm_split_type(self.raw, ty, key, info, &mut out) }
        };
        check(rc, "MPI_Comm_split_type")?;
        self.wrap(out)
    }

    /// Collective: `MPI_Barrier`.
    pub fn barrier(&self) -> Result<()> {
        let _g = guard();
        // SAFETY: valid communicator.
        check(unsafe { ffi::MPI_Barrier(self.raw) }, "MPI_Barrier")
    }

    /// Collective: `MPI_Bcast` of `buf` from `root` (every rank passes a buffer of the same
    /// length).
    pub fn bcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let n = to_int(buf.len(), "broadcast")?;
        let root = to_int(root, "root")?;
        let _g = guard();
        // SAFETY: `buf` is valid for `n` bytes for the duration of the blocking call.
        check(
            unsafe { ffi::MPI_Bcast(buf.as_mut_ptr().cast(), n, byte(), root, self.raw) },
            "MPI_Bcast",
        )
    }

    /// Collective: every rank's `value` (any lengths): `MPI_Allgather` of the lengths, then
    /// `MPI_Allgatherv` of the bytes.
    pub fn allgather(&self, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let size = self.size();
        let mine = to_int(value.len(), "allgather value")?;
        let mut lens: Vec<c_int> = vec![0; size];
        {
            let _g = guard();
            check(
                // SAFETY: sends one int from `mine`, receives `size` ints into `lens` (length
                // `size`); blocking call.
                unsafe {
                    ffi::MPI_Allgather(
                        (&mine as *const c_int).cast(),
                        1,
                        int_type(),
                        lens.as_mut_ptr().cast(),
                        1,
                        int_type(),
                        self.raw,
                    )
                },
                "MPI_Allgather",
            )?;
        }
        let mut displs: Vec<c_int> = Vec::with_capacity(size);
        let mut total: usize = 0;
        for &l in &lens {
            if l < 0 {
                return Err(Error::protocol(0, "negative allgather length"));
            }
            displs.push(to_int(total, "allgather total")?);
            total += l as usize;
        }
        to_int(total, "allgather total")?;
        let mut all = vec![0u8; total];
        {
            let _g = guard();
            check(
                // SAFETY: `value` is valid for `mine` bytes; `all` holds sum(lens) bytes laid out
                // by `displs`; blocking call.
                unsafe {
                    ffi::MPI_Allgatherv(
                        value.as_ptr().cast(),
                        mine,
                        byte(),
                        all.as_mut_ptr().cast(),
                        lens.as_ptr(),
                        displs.as_ptr(),
                        byte(),
                        self.raw,
                    )
                },
                "MPI_Allgatherv",
            )?;
        }
        Ok(lens
            .iter()
            .zip(&displs)
            .map(|(&l, &d)| all[d as usize..d as usize + l as usize].to_vec())
            .collect())
    }

    /// [`allgather`](Self::allgather) bounded by `deadline`: `MPI_Iallgather` of the lengths
    /// and `MPI_Iallgatherv` of the bytes, each tested until complete or the deadline.
    /// `Ok(None)` at the deadline: an MPI collective cannot be cancelled, so the pending one
    /// keeps its buffers (leaked: MPI may still write them) and this communicator must not be
    /// used for collectives again.
    pub fn allgather_until(
        &self,
        value: &[u8],
        deadline: std::time::Instant,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let size = self.size();
        let mine: Box<c_int> = Box::new(to_int(value.len(), "allgather value")?);
        let mut lens: Vec<c_int> = vec![0; size];
        let mut req = request_null();
        {
            let _g = guard();
            check(
                // SAFETY: sends one int from `mine`, receives `size` ints into `lens` (length
                // `size`); both stay allocated until the request completes, or forever.
                unsafe {
                    ffi::MPI_Iallgather(
                        (&*mine as *const c_int).cast(),
                        1,
                        int_type(),
                        lens.as_mut_ptr().cast(),
                        1,
                        int_type(),
                        self.raw,
                        &mut req,
                    )
                },
                "MPI_Iallgather",
            )?;
        }
        if !test_until(&mut req, deadline, "MPI_Iallgather")? {
            std::mem::forget(mine);
            std::mem::forget(lens);
            return Ok(None);
        }
        let mut displs: Vec<c_int> = Vec::with_capacity(size);
        let mut total: usize = 0;
        for &l in &lens {
            if l < 0 {
                return Err(Error::protocol(0, "negative allgather length"));
            }
            displs.push(to_int(total, "allgather total")?);
            total += l as usize;
        }
        to_int(total, "allgather total")?;
        let send: Vec<u8> = value.to_vec();
        let mut all = vec![0u8; total];
        let mut req = request_null();
        {
            let _g = guard();
            check(
                // SAFETY: `send` is valid for `mine` bytes; `all` holds sum(lens) bytes laid
                // out by `displs`; all four stay allocated until the request completes, or
                // forever.
                unsafe {
                    ffi::MPI_Iallgatherv(
                        send.as_ptr().cast(),
                        *mine,
                        byte(),
                        all.as_mut_ptr().cast(),
                        lens.as_ptr(),
                        displs.as_ptr(),
                        byte(),
                        self.raw,
                        &mut req,
                    )
                },
                "MPI_Iallgatherv",
            )?;
        }
        if !test_until(&mut req, deadline, "MPI_Iallgatherv")? {
            std::mem::forget((send, all, lens, displs));
            return Ok(None);
        }
        Ok(Some(
            lens.iter()
                .zip(&displs)
                .map(|(&l, &d)| all[d as usize..d as usize + l as usize].to_vec())
                .collect(),
        ))
    }

    /// Blocking `MPI_Send` of a small message. Only for messages the MPI sends eagerly (the
    /// driver's per-family limits): the call returns once the bytes are copied out, without
    /// waiting for the receiver (unless the receiver's queue is full).
    pub fn send_small(&self, buf: &[u8], dest: usize, tag: i32) -> Result<()> {
        let n = to_int(buf.len(), "eager message")?;
        let dest = to_int(dest, "rank")?;
        let _g = guard();
        // SAFETY: `buf` is valid for `n` bytes for the duration of the blocking call.
        let rc = unsafe { ffi::MPI_Send(buf.as_ptr().cast(), n, byte(), dest, tag, self.raw) };
        check(rc, "MPI_Send")
    }

    /// Start sending `buf[..len]` (owned) to `dest`.
    pub fn isend_owned(
        &self,
        buf: Vec<u8>,
        len: usize,
        dest: usize,
        tag: i32,
    ) -> Result<OwnedSend> {
        let n = to_int(len.min(buf.len()), "eager message")?;
        let dest = to_int(dest, "rank")?;
        let mut req = request_null();
        {
            let _g = guard();
            check(
                // SAFETY: `buf` lives in the returned OwnedSend until MPI reports completion (or is
                // leaked if dropped before), and a Vec's heap storage does not move when the Vec
                // is moved.
                unsafe {
                    ffi::MPI_Isend(
                        buf.as_ptr().cast(),
                        n,
                        byte(),
                        dest,
                        tag,
                        self.raw,
                        &mut req,
                    )
                },
                "MPI_Isend",
            )?;
        }
        Ok(OwnedSend {
            req,
            buf: Some(buf),
        })
    }

    /// Start a gather send of `iov` to `dest`: one message with an hindexed datatype when
    /// `as_datatype`, else one message per slice (slices over [`MAX_BLOCK`] are cut).
    ///
    /// The memory of `iov` must stay valid and unchanged until the returned [`GatherOp`] has
    /// completed or been dropped: the driver contract guarantees it (the core calls
    /// `send_refs` again with the same slices until it returns `Ready`, and drops the
    /// operation through `abort_message` before releasing the memory).
    pub fn gather_send(
        &self,
        iov: &[IoSlice<'_>],
        dest: usize,
        tag: i32,
        as_datatype: bool,
    ) -> Result<GatherOp> {
        let parts: Vec<(usize, usize)> =
            iov.iter().map(|s| (s.as_ptr() as usize, s.len())).collect();
        self.gather_start(&parts, dest, tag, as_datatype, true)
    }

    /// Start a scatter receive into `iov` from `source`, mirroring [`gather_send`](Self::gather_send).
    ///
    /// Same memory rule as `gather_send`, for `recv_refs`.
    pub fn scatter_recv(
        &self,
        iov: &mut [IoSliceMut<'_>],
        source: usize,
        tag: i32,
        as_datatype: bool,
    ) -> Result<GatherOp> {
        let parts: Vec<(usize, usize)> = iov
            .iter_mut()
            .map(|s| (s.as_mut_ptr() as usize, s.len()))
            .collect();
        self.gather_start(&parts, source, tag, as_datatype, false)
    }

    fn gather_start(
        &self,
        parts: &[(usize, usize)],
        peer: usize,
        tag: i32,
        as_datatype: bool,
        send: bool,
    ) -> Result<GatherOp> {
        let peer_i = to_int(peer, "rank")?;
        // Cut every slice into blocks of at most MAX_BLOCK bytes (C int counts).
        let mut blocks: Vec<(usize, usize)> = Vec::with_capacity(parts.len());
        for &(addr, len) in parts {
            let mut off = 0;
            while off < len {
                let n = (len - off).min(MAX_BLOCK);
                blocks.push((addr + off, n));
                off += n;
            }
        }
        let mut op = GatherOp {
            reqs: Vec::new(),
            send,
            bytes: blocks.iter().map(|b| b.1).sum(),
        };
        let total_ok = blocks.iter().map(|b| b.1).sum::<usize>() <= MAX_BLOCK;
        if as_datatype && blocks.len() > 1 && total_ok {
            let lens: Vec<c_int> = blocks.iter().map(|b| b.1 as c_int).collect();
            let displs: Vec<ffi::MPI_Aint> = blocks.iter().map(|b| b.0 as ffi::MPI_Aint).collect();
            // SAFETY: reading a link-time constant exported by the rsmpi shim.
            let mut ty = unsafe { ffi::RSMPI_DATATYPE_NULL };
            let _g = guard();
            check(
                // SAFETY: `lens` and `displs` hold `blocks.len()` entries; out-pointer valid.
                unsafe {
                    ffi::MPI_Type_create_hindexed(
                        lens.len() as c_int,
                        lens.as_ptr(),
                        displs.as_ptr(),
                        byte(),
                        &mut ty,
                    )
                },
                "MPI_Type_create_hindexed",
            )?;
            // SAFETY: `ty` was just created.
            let rc = unsafe { ffi::MPI_Type_commit(&mut ty) };
            if let Err(e) = check(rc, "MPI_Type_commit") {
                // SAFETY: `ty` was created above and is not used afterwards.
                unsafe { ffi::MPI_Type_free(&mut ty) };
                return Err(e);
            }
            let mut req = request_null();
            // SAFETY: the datatype addresses user memory absolutely from MPI_BOTTOM (a null
            // pointer in both MPICH and Open MPI); the caller keeps that memory valid until
            // the operation completes or is dropped (see `gather_send`).
            let rc = unsafe {
                if send {
                    ffi::MPI_Isend(std::ptr::null(), 1, ty, peer_i, tag, self.raw, &mut req)
                } else {
                    ffi::MPI_Irecv(std::ptr::null_mut(), 1, ty, peer_i, tag, self.raw, &mut req)
                }
            };
            // Freeing a datatype only marks it: pending operations keep using it.
            // SAFETY: `ty` is ours and not used afterwards.
            unsafe { ffi::MPI_Type_free(&mut ty) };
            check(
                rc,
                if send {
                    "MPI_Isend(hindexed)"
                } else {
                    "MPI_Irecv(hindexed)"
                },
            )?;
            op.reqs.push(req);
            return Ok(op);
        }
        let _g = guard();
        for &(addr, len) in &blocks {
            let mut req = request_null();
            // SAFETY: `addr..addr+len` is caller memory kept valid until completion or drop
            // (see `gather_send`); len <= MAX_BLOCK fits a C int.
            let rc = unsafe {
                if send {
                    ffi::MPI_Isend(
                        addr as *const c_void,
                        len as c_int,
                        byte(),
                        peer_i,
                        tag,
                        self.raw,
                        &mut req,
                    )
                } else {
                    ffi::MPI_Irecv(
                        addr as *mut c_void,
                        len as c_int,
                        byte(),
                        peer_i,
                        tag,
                        self.raw,
                        &mut req,
                    )
                }
            };
            // On failure, `op` drops and cancels/waits the requests already started.
            check(rc, if send { "MPI_Isend" } else { "MPI_Irecv" })?;
            op.reqs.push(req);
        }
        Ok(op)
    }
}

fn int_type() -> ffi::MPI_Datatype {
    // SAFETY: reading a link-time constant exported by the rsmpi shim.
    unsafe { ffi::RSMPI_INT32_T }
}

fn request_null() -> ffi::MPI_Request {
    // SAFETY: reading a link-time constant exported by the rsmpi shim.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn count_of(st: &ffi::MPI_Status) -> Result<usize> {
    let mut n: c_int = 0;
    check(
        // SAFETY: `st` was filled by MPI; out-pointer valid. MPI_Get_count is a local query.
        unsafe { ffi::MPI_Get_count(st, byte(), &mut n) },
        "MPI_Get_count",
    )?;
    if n < 0 {
        return Err(Error::protocol(
            st.MPI_SOURCE.max(0) as usize,
            "message size is undefined",
        ));
    }
    Ok(n as usize)
}

/// Test one request; `Ok(true)` once complete (the handle is then `REQUEST_NULL`).
fn test(req: &mut ffi::MPI_Request, what: &str) -> Result<bool> {
    if *req == request_null() {
        return Ok(true);
    }
    let mut flag: c_int = 0;
    let mut st = zero_status();
    let _g = guard();
    // SAFETY: `req` is an active request of ours; out-pointers valid.
    check(unsafe { ffi::MPI_Test(req, &mut flag, &mut st) }, what)?;
    Ok(flag != 0)
}

/// Test `req` until it completes (`Ok(true)`) or `deadline` passes (`Ok(false)`, the request
/// still active), sleeping between tests (50 µs doubling to 1 ms: set-up collectives, not a
/// data path).
fn test_until(
    req: &mut ffi::MPI_Request,
    deadline: std::time::Instant,
    what: &str,
) -> Result<bool> {
    let mut nap = std::time::Duration::from_micros(50);
    loop {
        if test(req, what)? {
            return Ok(true);
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = (nap * 2).min(std::time::Duration::from_millis(1));
    }
}

/// Cancel and wait: afterwards MPI no longer touches the request's memory.
fn cancel_and_wait(req: &mut ffi::MPI_Request) {
    if *req == request_null() || finalized() {
        return;
    }
    let _g = guard();
    // SAFETY: `req` is an active request of ours. MPI_Wait after MPI_Cancel returns once the
    // operation is either cancelled or complete; either way MPI is done with its buffer.
    unsafe {
        ffi::MPI_Cancel(req);
        ffi::MPI_Wait(req, ffi::RSMPI_STATUS_IGNORE);
    }
}

/// Slot states of [`Preposted`]. `EMPTY` and `DONE` belong to the slot's link (only the link,
/// which the core serialises, touches the slot then); `IDLE` and `POSTED` may be claimed by the
/// link or by an any-source poller, with one compare-and-swap to `CLAIMED`, which gives the
/// claimer the slot's request and buffer until it stores the next state.
const EMPTY: u8 = 0;
/// The link parked its buffer; the receive is not posted yet.
const IDLE: u8 = 1;
/// The receive is posted into the slot's buffer.
const POSTED: u8 = 2;
/// Someone works on the slot (posting, testing, cancelling).
const CLAIMED: u8 = 3;
/// The receive completed (seen by an any-source poller); the link has not taken it yet.
const DONE: u8 = 4;

/// `count` of a `DONE` slot whose size MPI could not give.
const BAD_COUNT: usize = usize::MAX;

/// One peer's eager receive. Aligned to a cache line: links of different peers poll their
/// slots from different threads.
#[repr(align(64))]
struct Slot {
    state: AtomicU8,
    /// Only touched by whoever owns the slot (see the states).
    req: UnsafeCell<ffi::MPI_Request>,
    buf: UnsafeCell<Option<Vec<u8>>>,
    count: UnsafeCell<usize>,
}

/// Scratch arrays of an any-source scan.
struct Scan {
    peers: Vec<usize>,
    reqs: Vec<ffi::MPI_Request>,
    idx: Vec<c_int>,
    st: Vec<ffi::MPI_Status>,
}

/// The eager receives of one channel, one slot per peer.
///
/// Each receiving link keeps one receive of its peer's next eager message: the buffer is
/// parked in the slot at the end of a message ([`park`](Self::park), no MPI call) and posted
/// (`MPI_Irecv`) by the next test of the slot ([`take`](Self::take) from the link, or an
/// any-source [`poll_any`](Self::poll_any)), so the post is off the ping-pong's critical path
/// (between "the reply left" and "the next message is awaited") while a message still lands
/// in place when it arrives after the first test. "Is a message there?" is then one
/// `MPI_Test`. A posted receive is invisible to `MPI_Iprobe`, so any-source readiness tests
/// the slots with `MPI_Testsome`.
///
/// No lock on the link's path: a slot's state is an atomic; the link and an any-source poller
/// claim a posted slot with one compare-and-swap, so two threads never test one request (MPI
/// forbids it) and a link polls its slot with one atomic read-modify-write and one store per
/// test (the first version took a channel-wide mutex: two read-modify-writes, a fifth of the
/// polling loop's samples in a profile).
pub struct Preposted {
    comm: ffi::MPI_Comm,
    tag: c_int,
    slots: Box<[Slot]>,
    scan: Mutex<Scan>,
}

// SAFETY: the communicator handle is a plain identifier usable from any thread (see `Comm`);
// each slot's cells are only touched by the thread that owns the slot through its atomic
// state (see the state constants), the scan scratch is behind a mutex.
unsafe impl Send for Preposted {}
// SAFETY: as for `Send`.
unsafe impl Sync for Preposted {}

impl std::fmt::Debug for Preposted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Preposted")
    }
}

impl Preposted {
    /// Slots for `n` peers of `comm` (which must outlive this set: the driver keeps both in
    /// the same `Arc`-shared channel state, this set dropped first), receiving with `tag`.
    pub fn new(comm: &Comm, n: usize, tag: i32) -> Self {
        Preposted {
            comm: comm.raw,
            tag,
            slots: (0..n)
                .map(|_| Slot {
                    state: AtomicU8::new(EMPTY),
                    req: UnsafeCell::new(request_null()),
                    buf: UnsafeCell::new(None),
                    count: UnsafeCell::new(0),
                })
                .collect(),
            scan: Mutex::new(Scan {
                peers: Vec::with_capacity(n),
                reqs: Vec::with_capacity(n),
                idx: vec![0; n],
                st: (0..n).map(|_| zero_status()).collect(),
            }),
        }
    }

    /// Park `buf` in the slot of `peer` (the link's next eager receive, at most `buf.len()`
    /// bytes): posted by the next test. With `post_now`, posted at once (a link's first
    /// receive, so a message arriving before the first test lands in place).
    ///
    /// Only the slot's link calls this, while the slot is `EMPTY` (it holds the buffer).
    pub fn park(&self, peer: usize, buf: Vec<u8>, post_now: bool) -> Result<()> {
        let Some(slot) = self.slots.get(peer) else {
            return Err(Error::protocol(peer, "eager receive for an unknown peer"));
        };
        if slot.state.load(Ordering::Acquire) != EMPTY {
            return Err(Error::protocol(peer, "eager receive posted twice"));
        }
        // SAFETY: EMPTY slots belong to their link, which is the caller (the core serialises
        // a link's calls); pollers only touch IDLE and POSTED slots.
        unsafe { *slot.buf.get() = Some(buf) };
        if post_now {
            // SAFETY: as above, the slot is still ours (EMPTY).
            if let Err(e) = unsafe { self.post(peer, slot) } {
                // SAFETY: as above.
                unsafe { *slot.buf.get() = None };
                return Err(e);
            }
            slot.state.store(POSTED, Ordering::Release);
        } else {
            slot.state.store(IDLE, Ordering::Release);
        }
        Ok(())
    }

    /// `MPI_Irecv` into the slot's buffer.
    ///
    /// # Safety
    /// The caller owns the slot (claimed it, or it is EMPTY and the caller is its link), and
    /// the slot holds a buffer and no active request.
    unsafe fn post(&self, peer: usize, slot: &Slot) -> Result<()> {
        // SAFETY: the caller owns the slot's cells (function contract).
        let (buf, req) = unsafe { (&mut *slot.buf.get(), &mut *slot.req.get()) };
        let Some(b) = buf.as_mut() else {
            return Err(Error::protocol(peer, "eager receive without a buffer"));
        };
        let n = to_int(b.len(), "eager buffer")?;
        let src = to_int(peer, "rank")?;
        let _g = guard();
        // SAFETY: the buffer stays in the slot (its heap storage does not move) until the
        // request completes or is cancelled and waited for (`cancel`, `drop`).
        let rc = unsafe {
            ffi::MPI_Irecv(
                b.as_mut_ptr().cast(),
                n,
                byte(),
                src,
                self.tag,
                self.comm,
                req,
            )
        };
        check(rc, "MPI_Irecv(eager)")
    }

    /// The link's poll: the completed receive of `peer` (its buffer and byte count), posting
    /// the parked buffer first if needed; `None` while nothing has arrived (or while an
    /// any-source poller holds the slot for a moment).
    ///
    /// Inlined fast path (a posted slot: one compare-and-swap, one `MPI_Test`, one store);
    /// the other states go through [`take_other`](Self::take_other).
    #[inline]
    pub fn take(&self, peer: usize) -> Result<Option<(Vec<u8>, usize)>> {
        let Some(slot) = self.slots.get(peer) else {
            return Ok(None);
        };
        if slot
            .state
            .compare_exchange(POSTED, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return self.take_other(peer, slot);
        }
        self.test_claimed(peer, slot)
    }

    /// `take` of a slot that was not simply POSTED: DONE (an any-source poller saw the
    /// message), IDLE (post first), or claimed by a poller / EMPTY (nothing for now).
    #[inline(never)]
    fn take_other(&self, peer: usize, slot: &Slot) -> Result<Option<(Vec<u8>, usize)>> {
        match slot.state.load(Ordering::Acquire) {
            DONE => {
                // SAFETY: DONE slots belong to their link, the caller.
                let (buf, count) = unsafe { ((*slot.buf.get()).take(), *slot.count.get()) };
                slot.state.store(EMPTY, Ordering::Relaxed);
                Self::taken(peer, buf, count).map(Some)
            }
            IDLE => {
                if slot
                    .state
                    .compare_exchange(IDLE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
                {
                    // A poller claimed it; it will leave it POSTED or DONE.
                    return Ok(None);
                }
                // SAFETY: claimed; an IDLE slot holds a buffer and no active request.
                if let Err(e) = unsafe { self.post(peer, slot) } {
                    slot.state.store(IDLE, Ordering::Release);
                    return Err(e);
                }
                self.test_claimed(peer, slot)
            }
            _ => Ok(None),
        }
    }

    /// `MPI_Test` of a slot we claimed; leaves it POSTED (nothing yet) or EMPTY (taken).
    #[inline]
    fn test_claimed(&self, peer: usize, slot: &Slot) -> Result<Option<(Vec<u8>, usize)>> {
        let mut flag: c_int = 0;
        let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
        let rc = {
            let _g = guard();
            // SAFETY: claimed: the slot's request is ours to test; valid out-pointers.
            unsafe { ffi::MPI_Test(slot.req.get(), &mut flag, status.as_mut_ptr()) }
        };
        if rc != 0 || flag == 0 {
            slot.state.store(POSTED, Ordering::Release);
            check(rc, "MPI_Test(eager)")?;
            return Ok(None);
        }
        // SAFETY: MPI_Test set `flag`, so it filled the status.
        let status = unsafe { status.assume_init() };
        // SAFETY: still claimed; the request completed, so MPI no longer uses the buffer.
        let buf = unsafe { (*slot.buf.get()).take() };
        slot.state.store(EMPTY, Ordering::Release);
        let count = count_of(&status).unwrap_or(BAD_COUNT);
        Self::taken(peer, buf, count).map(Some)
    }

    #[inline]
    fn taken(peer: usize, buf: Option<Vec<u8>>, count: usize) -> Result<(Vec<u8>, usize)> {
        let buf = buf.unwrap_or_default();
        if count == BAD_COUNT || count > buf.len() {
            return Err(Error::protocol(peer, "eager message of undefined size"));
        }
        Ok((buf, count))
    }

    /// Any-source: post the parked receives, test every posted one at once (`MPI_Testsome`),
    /// and call `ready(peer)` for each peer whose receive has completed and not been taken.
    pub fn poll_any(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        let res = match self.scan.try_lock() {
            Ok(mut g) => self.scan_with(&mut g),
            Err(std::sync::TryLockError::Poisoned(p)) => self.scan_with(&mut p.into_inner()),
            // Another thread is scanning: report what is already known.
            Err(std::sync::TryLockError::WouldBlock) => Ok(()),
        };
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.state.load(Ordering::Acquire) == DONE {
                ready(i);
            }
        }
        res
    }

    fn scan_with(&self, sc: &mut Scan) -> Result<()> {
        sc.peers.clear();
        sc.reqs.clear();
        let mut err = None;
        for (i, slot) in self.slots.iter().enumerate() {
            let s = slot.state.load(Ordering::Relaxed);
            if (s != IDLE && s != POSTED)
                || slot
                    .state
                    .compare_exchange(s, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            if s == IDLE {
                // SAFETY: claimed; an IDLE slot holds a buffer and no active request.
                if let Err(e) = unsafe { self.post(i, slot) } {
                    slot.state.store(IDLE, Ordering::Release);
                    err.get_or_insert(e);
                    continue;
                }
            }
            sc.peers.push(i);
            // SAFETY: claimed: the request is ours until we store the next state.
            sc.reqs.push(unsafe { *slot.req.get() });
        }
        let k = sc.peers.len();
        if k == 0 {
            return err.map_or(Ok(()), Err);
        }
        let mut out: c_int = 0;
        let rc = {
            let _g = guard();
            // SAFETY: `reqs` holds `k` active requests we claimed; `idx` and `st` hold at least
            // `k` entries (one per peer).
            unsafe {
                ffi::MPI_Testsome(
                    k as c_int,
                    sc.reqs.as_mut_ptr(),
                    &mut out,
                    sc.idx.as_mut_ptr(),
                    sc.st.as_mut_ptr(),
                )
            }
        };
        let rc = check(rc, "MPI_Testsome");
        let done = if rc.is_ok() && out > 0 {
            (out as usize).min(k)
        } else {
            0
        };
        // Completed requests first: their slots become DONE with the size received.
        for j in 0..done {
            let Ok(pos) = usize::try_from(sc.idx[j]) else {
                continue;
            };
            if pos >= k {
                continue;
            }
            let i = sc.peers[pos];
            let slot = &self.slots[i];
            let count = count_of(&sc.st[j]).unwrap_or(BAD_COUNT);
            // SAFETY: claimed (see above); the request completed and is now REQUEST_NULL.
            unsafe {
                *slot.req.get() = sc.reqs[pos];
                *slot.count.get() = count;
            }
            slot.state.store(DONE, Ordering::Release);
            sc.peers[pos] = usize::MAX;
        }
        // The others go back as they were (Testsome leaves incomplete requests unchanged).
        for &i in &sc.peers {
            if i != usize::MAX {
                self.slots[i].state.store(POSTED, Ordering::Release);
            }
        }
        rc?;
        err.map_or(Ok(()), Err)
    }

    /// Cancel the receive of `peer` (the link is going away or broke); its buffer is dropped
    /// once MPI has released it. Only the slot's link calls this.
    pub fn cancel(&self, peer: usize) {
        let Some(slot) = self.slots.get(peer) else {
            return;
        };
        loop {
            match slot.state.load(Ordering::Acquire) {
                EMPTY => return,
                DONE => break,
                CLAIMED => std::thread::yield_now(),
                s => {
                    if slot
                        .state
                        .compare_exchange(s, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                    {
                        break;
                    }
                }
            }
        }
        // SAFETY: the slot is ours: claimed above, or DONE (which belongs to the link).
        unsafe {
            cancel_and_wait(&mut *slot.req.get());
            *slot.buf.get() = None;
        }
        slot.state.store(EMPTY, Ordering::Release);
    }
}

impl Drop for Preposted {
    fn drop(&mut self) {
        for slot in self.slots.iter_mut() {
            cancel_and_wait(slot.req.get_mut());
        }
    }
}

/// A send of an owned buffer in progress.
#[derive(Debug)]
pub struct OwnedSend {
    req: ffi::MPI_Request,
    buf: Option<Vec<u8>>,
}

// SAFETY: the request handle and the owned buffer may move between threads; MPI allows
// testing a request from any thread (one at a time, which `&mut self` guarantees).
unsafe impl Send for OwnedSend {}

impl OwnedSend {
    /// Whether MPI is done with the buffer; then the buffer is handed back.
    pub fn test(&mut self) -> Result<Option<Vec<u8>>> {
        if test(&mut self.req, "MPI_Test(send)")? {
            Ok(Some(self.buf.take().unwrap_or_default()))
        } else {
            Ok(None)
        }
    }
}

impl Drop for OwnedSend {
    fn drop(&mut self) {
        if self.req != request_null() {
            let _g = guard();
            // SAFETY: the request stays active inside MPI after being freed; its buffer is
            // leaked below so MPI may keep reading it.
            unsafe { ffi::MPI_Request_free(&mut self.req) };
            if let Some(b) = self.buf.take() {
                std::mem::forget(b);
            }
        }
    }
}

/// A gather send or scatter receive on user memory in progress.
#[derive(Debug)]
pub struct GatherOp {
    reqs: Vec<ffi::MPI_Request>,
    send: bool,
    bytes: usize,
}

// SAFETY: request handles may be tested from any thread (one at a time: `&mut self`).
unsafe impl Send for GatherOp {}

impl GatherOp {
    /// How many bytes the operation moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether every request has completed (MPI no longer needs the memory).
    pub fn test(&mut self) -> Result<bool> {
        let what = if self.send {
            "MPI_Test(gather send)"
        } else {
            "MPI_Test(scatter recv)"
        };
        for r in &mut self.reqs {
            if !test(r, what)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Drop for GatherOp {
    fn drop(&mut self) {
        for r in &mut self.reqs {
            cancel_and_wait(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_levels() {
        assert_eq!(parse_level("funneled").unwrap(), Threading::Funneled);
        assert_eq!(
            parse_level("MPI_THREAD_SERIALIZED").unwrap(),
            Threading::Serialized
        );
        assert_eq!(parse_level(" serialised ").unwrap(), Threading::Serialized);
        assert_eq!(parse_level("Multiple").unwrap(), Threading::Multiple);
        assert_eq!(parse_level("single").unwrap(), Threading::Single);
        assert!(matches!(parse_level("many"), Err(Error::BadConfig(_))));
        // A lock serialises calls from any thread; it cannot make them come from one thread.
        assert!(!channel_level_ok(Threading::Single));
        assert!(!channel_level_ok(Threading::Funneled));
        assert!(channel_level_ok(Threading::Serialized));
        assert!(channel_level_ok(Threading::Multiple));
        assert_eq!(level_name(Threading::Funneled), "MPI_THREAD_FUNNELED");
    }
}
