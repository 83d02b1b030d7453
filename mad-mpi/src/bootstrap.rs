//! The MPI bootstrap: a session whose processes were started by `mpiexec`/`mpirun`/`srun`.
//!
//! Rank and size come from `MPI_COMM_WORLD`, or from the communicator an application that
//! initialised MPI itself hands to [`MpiBootstrap::from_communicator`];
//! [`allgather`](Bootstrap::allgather) is an `MPI_Allgather` of the lengths followed by an
//! `MPI_Allgatherv` of the bytes on a private duplicate of that communicator (which alone gets
//! `MPI_ERRORS_RETURN`); the secret is drawn by rank 0 and broadcast;
//! [`local_ranks`](Bootstrap::local_ranks) comes from
//! `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`. Every channel of the session (TCP, shm, MPI,
//! ...) can use it, so one `mpiexec` job can mix drivers.
//!
//! Channel opens ([`Bootstrap::scoped_allgather`]) use `MPI_Iallgather`/`MPI_Iallgatherv`
//! tested until the open's deadline. A rank whose open fails takes part in the collective its
//! peers are in (matched by position) with an abort marker instead of its value, so they fail
//! there naming it, and every rank has issued the same number of collectives. MPI cannot
//! cancel a collective and does not say who is missing: at the deadline the open fails with
//! `Error::CollectiveTimeout` without names, and the bootstrap refuses every later collective
//! (the pending one still expects this rank).
//!
//! When MPI granted less than `MPI_THREAD_SERIALIZED` (`FUNNELED`, `SINGLE`), only the thread
//! that initialised MPI may call it: the bootstrap's collectives then fail with
//! `Error::Unavailable` on any other thread (before any MPI call), and MPI channels are refused
//! (see [`crate::driver`]); TCP and shared-memory channels opened from the main thread work.

use std::sync::{Arc, Mutex};

use mad_core::auth::{Secret, SECRET_LEN};
use mad_core::bootstrap::{positional, Bootstrap, RankFailure, Scope};
use mad_core::{Error, Result};

use crate::launcher::{self, Launcher};
use crate::sys::{self, Comm, Runtime};

/// A bootstrap over MPI.
pub struct MpiBootstrap {
    rt: Arc<Runtime>,
    comm: Comm,
    rank: usize,
    size: usize,
    secret: Secret,
    local: Vec<usize>,
    launcher: Option<Launcher>,
    // Collectives on one communicator must not overlap: one at a time. Holds why the
    // communicator is unusable, once a bounded collective timed out (it cannot be cancelled).
    lock: Mutex<Option<String>>,
}

impl std::fmt::Debug for MpiBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiBootstrap(rank {} of {}, {:?}, {})",
            self.rank,
            self.size,
            self.launcher.map(|l| l.kind),
            self.rt.version()
        )
    }
}

impl MpiBootstrap {
    /// The bootstrap of a process started by an MPI launcher, or `Ok(None)` when no launcher
    /// is detected (see [`crate::launcher`] for the rules).
    ///
    /// Fails with [`Error::BadConfig`] when the launcher's job size differs from
    /// `MPI_COMM_WORLD`'s: the binary was started by the launcher of another MPI
    /// implementation and would run as separate one-process jobs.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] when the launcher's job size differs from
    /// `MPI_COMM_WORLD`'s; as [`new`](Self::new).
    pub fn from_env() -> Result<Option<Self>> {
        match launcher::detect_from_env()? {
            None => Ok(None),
            Some(l) => Self::init(Some(l)).map(Some),
        }
    }

    /// Initialise MPI (if needed) and build the bootstrap whatever the environment says (a
    /// process started without a launcher is a one-process MPI job, a "singleton").
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when MPI cannot be initialised or was
    /// already finalised; the MPI errors of duplicating the communicator or of the first exchange
    /// (the secret).
    pub fn new() -> Result<Self> {
        Self::init(launcher::detect_from_env()?)
    }

    /// The bootstrap of an application that initialised MPI itself (`MPI_Init` or
    /// `MPI_Init_thread`), over its communicator `comm` (any intracommunicator: a split, a
    /// renumbering, `MPI_COMM_WORLD`): session rank and size are `comm`'s.
    ///
    /// Collective over `comm`: every process of `comm` calls it. The bootstrap works on its own
    /// duplicates of `comm` (`MPI_Comm_dup`, freed when it drops) and sets `MPI_ERRORS_RETURN`
    /// on them only; `comm` and `MPI_COMM_WORLD` are left as they are. MPI is never finalised
    /// by this crate here: drop the bootstrap and every session or channel built on it before
    /// the application's `MPI_Finalize`.
    ///
    /// `comm` is anything that gives a raw `MPI_Comm` through rsmpi's (`unsafe`) `AsRaw`
    /// trait, such as an rsmpi `SimpleCommunicator` (the crate is re-exported as
    /// [`crate::mpi`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when MPI is not initialised or already finalised;
    /// [`Error::BadConfig`] for `MPI_COMM_NULL` or an intercommunicator; the MPI errors of
    /// duplicating `comm` or of the first exchange.
    pub fn from_communicator<C>(comm: &C) -> Result<Self>
    where
        C: mpi::raw::AsRaw<Raw = mpi::ffi::MPI_Comm> + ?Sized,
    {
        let rt = sys::application_runtime()?;
        rt.check_thread("the MPI bootstrap was created")?;
        let comm = Comm::dup_of_application(&rt, comm.as_raw())?;
        Self::build(rt, comm, None)
    }

    fn init(launcher: Option<Launcher>) -> Result<Self> {
        let rt = sys::runtime()?;
        rt.check_thread("the MPI bootstrap was created")?;
        let world = Comm::world(&rt);
        let (rank, size) = (world.rank(), world.size());
        if let Some(l) = launcher {
            if l.size != size || l.rank != rank {
                return Err(Error::BadConfig(format!(
                    "the {:?} launcher started this process as rank {} of {}, but MPI_COMM_WORLD \
                     is rank {rank} of {size} ({}): the binary was probably built against a \
                     different MPI than the launcher's (use mpiexec.mpich for an MPICH build, \
                     mpirun.openmpi for an Open MPI build)",
                    l.kind,
                    l.rank,
                    l.size,
                    rt.version()
                )));
            }
        }
        let comm = world.dup()?;
        Self::build(rt, comm, launcher)
    }

    /// The bootstrap over `comm` (a duplicate this bootstrap owns).
    fn build(rt: Arc<Runtime>, comm: Comm, launcher: Option<Launcher>) -> Result<Self> {
        let (rank, size) = (comm.rank(), comm.size());
        let mut sec = [0u8; SECRET_LEN];
        if rank == 0 {
            mad_core::auth::fill_random(&mut sec)?;
        }
        comm.bcast(&mut sec, 0)?;
        let secret = Secret::from_bytes(sec);
        let local_comm = comm.split_shared()?;
        let mut local: Vec<usize> = local_comm
            .allgather(&(rank as u64).to_le_bytes())?
            .iter()
            .filter_map(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map(|b| u64::from_le_bytes(b) as usize)
            .collect();
        local.sort_unstable();
        drop(local_comm);
        Ok(MpiBootstrap {
            rt,
            comm,
            rank,
            size,
            secret,
            local,
            launcher,
            lock: Mutex::new(None),
        })
    }

    /// The launcher that started this process, if one was detected.
    pub fn launcher(&self) -> Option<Launcher> {
        self.launcher
    }

    /// The MPI library (first line of `MPI_Get_library_version`).
    pub fn library(&self) -> &str {
        self.rt.version()
    }

    /// The threading level MPI granted.
    pub fn threading(&self) -> mpi::environment::Threading {
        self.rt.threading()
    }

    /// Whether MPI calls run concurrently (`MPI_THREAD_MULTIPLE` granted and the lock not
    /// forced by `MAD_MPI_SERIALISE=1`); otherwise they are serialised by one lock.
    pub fn thread_multiple(&self) -> bool {
        !self.rt.serialised()
    }
}

impl MpiBootstrap {
    fn enter(&self, what: &str) -> Result<std::sync::MutexGuard<'_, Option<String>>> {
        self.rt.check_thread(what)?;
        let g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &*g {
            return Err(Error::io(
                "MPI bootstrap",
                std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    format!("unusable after an earlier failure: {why}"),
                ),
            ));
        }
        Ok(g)
    }

    /// Every rank's contribution, or `None` at `deadline` (the communicator is then marked
    /// unusable in `g`).
    fn exchange(
        &self,
        g: &mut Option<String>,
        v: &[u8],
        deadline: Option<std::time::Instant>,
        tag: &str,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        match deadline {
            None => self.comm.allgather(v).map(Some),
            Some(d) => {
                let r = self.comm.allgather_until(v, d)?;
                if r.is_none() {
                    *g = Some(format!(
                        "collective `{tag}` timed out (MPI cannot cancel it)"
                    ));
                }
                Ok(r)
            }
        }
    }

    fn gather(&self, scope: Option<&Scope>, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut g = self.enter(&format!("bootstrap collective `{tag}` was called"))?;
        let v = positional::frame(tag, value);
        let Some(all) = self.exchange(&mut g, &v, scope.map(|s| s.deadline), tag)? else {
            // MPI does not say who is missing.
            return Err(
                scope.map_or(Error::Timeout(std::time::Duration::ZERO), |s| {
                    s.timeout_error(Vec::new())
                }),
            );
        };
        positional::unframe(all, scope, tag)
    }
}

impl Bootstrap for MpiBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn secret(&self) -> &Secret {
        &self.secret
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(None, tag, value)
    }
    fn scoped_allgather(&self, scope: &Scope, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(Some(scope), tag, value)
    }
    /// MPI collectives are matched by position: this rank takes part in the collective its
    /// peers are in (their next one of the scope) with an abort marker instead of a value, so
    /// they fail with its error there. Bounded by the scope's deadline (at least 5 s from now).
    fn abandon(&self, scope: &Scope, failure: &RankFailure) -> Result<RankFailure> {
        let mut g = self.enter(&format!("bootstrap abort of `{}` was called", scope.prefix))?;
        let deadline = scope
            .deadline
            .max(std::time::Instant::now() + std::time::Duration::from_secs(5));
        let all = self.exchange(
            &mut g,
            &positional::abort_frame(failure),
            Some(deadline),
            &scope.prefix,
        )?;
        Ok(all
            .and_then(|all| positional::failure_in(&all))
            .unwrap_or_else(|| failure.clone()))
    }
    fn barrier(&self, tag: &str) -> Result<()> {
        let _g = self.enter(&format!("bootstrap barrier `{tag}` was called"))?;
        self.comm.barrier()
    }
    fn kind(&self) -> &'static str {
        "mpi"
    }
    fn local_ranks(&self) -> Vec<usize> {
        self.local.clone()
    }
}
