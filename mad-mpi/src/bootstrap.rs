//! The MPI bootstrap: a session whose processes were started by `mpiexec`/`mpirun`/`srun`.
//!
//! Rank and size come from `MPI_COMM_WORLD`; [`allgather`](Bootstrap::allgather) is an
//! `MPI_Allgather` of the lengths followed by an `MPI_Allgatherv` of the bytes on a private
//! duplicate of the world communicator; the secret is drawn by rank 0 and broadcast;
//! [`local_ranks`](Bootstrap::local_ranks) comes from
//! `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`. Every channel of the session (TCP, shm, MPI,
//! ...) can use it, so one `mpiexec` job can mix drivers.
//!
//! When MPI granted less than `MPI_THREAD_SERIALIZED` (`FUNNELED`, `SINGLE`), only the thread
//! that initialised MPI may call it: the bootstrap's collectives then fail with
//! `Error::Unavailable` on any other thread (before any MPI call), and MPI channels are refused
//! (see [`crate::driver`]); TCP and shared-memory channels opened from the main thread work.

use std::sync::{Arc, Mutex};

use mad_core::auth::{Secret, SECRET_LEN};
use mad_core::bootstrap::Bootstrap;
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
    // Collectives on one communicator must not overlap: one at a time.
    lock: Mutex<()>,
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
    pub fn from_env() -> Result<Option<Self>> {
        match launcher::detect_from_env()? {
            None => Ok(None),
            Some(l) => Self::init(Some(l)).map(Some),
        }
    }

    /// Initialise MPI (if needed) and build the bootstrap whatever the environment says (a
    /// process started without a launcher is a one-process MPI job, a "singleton").
    pub fn new() -> Result<Self> {
        Self::init(launcher::detect_from_env()?)
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
            lock: Mutex::new(()),
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

fn tag_hash(tag: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in tag.as_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
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
        self.rt
            .check_thread(&format!("bootstrap collective `{tag}` was called"))?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // Prefix the tag's hash so ranks that issue collectives in different orders get an
        // error instead of each other's values.
        let mut v = Vec::with_capacity(8 + value.len());
        v.extend_from_slice(&tag_hash(tag).to_le_bytes());
        v.extend_from_slice(value);
        let all = self.comm.allgather(&v)?;
        let want = tag_hash(tag).to_le_bytes();
        all.into_iter()
            .enumerate()
            .map(|(r, b)| {
                if b.len() < 8 || b[..8] != want {
                    Err(Error::protocol(
                        r,
                        format!("rank {r} entered a different bootstrap collective than `{tag}`"),
                    ))
                } else {
                    Ok(b[8..].to_vec())
                }
            })
            .collect()
    }
    fn barrier(&self, tag: &str) -> Result<()> {
        self.rt
            .check_thread(&format!("bootstrap barrier `{tag}` was called"))?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.comm.barrier()
    }
    fn kind(&self) -> &'static str {
        "mpi"
    }
    fn local_ranks(&self) -> Vec<usize> {
        self.local.clone()
    }
}
