//! # mad-mpi: Madeleine channels over MPI, and the MPI bootstrap
//!
//! Two things live here:
//!
//! * [`MpiDriver`], the `mpi` driver: a channel is a private MPI communicator; small pieces
//!   are aggregated in an eager buffer sent as one message, large ones travel from the user's
//!   memory as one message per group described by an hindexed datatype (as Madeleine III did
//!   over MPI). See [`driver`] for the transmission modules and thresholds.
//! * [`MpiBootstrap`], a [`Bootstrap`](mad_core::bootstrap::Bootstrap) for processes started
//!   by `mpiexec`/`mpirun`/`srun`: rank and size from `MPI_COMM_WORLD`, collectives over MPI,
//!   so one MPI job can open TCP, shared-memory and MPI channels side by side.
//!
//! ```no_run
//! # fn main() -> mad_core::Result<()> {
//! use mad_mpi::{MpiBootstrap, MpiDriver};
//! match MpiBootstrap::from_env()? {
//!     None => println!("not started by an MPI launcher"),
//!     Some(b) => println!("rank {} of {} ({})", mad_core::bootstrap::Bootstrap::rank(&b),
//!                         mad_core::bootstrap::Bootstrap::size(&b), b.library()),
//! }
//! let _driver = MpiDriver::new();
//! # Ok(()) }
//! ```
//!
//! All foreign calls are in the private `sys` module; the rest of the crate is safe Rust.
//! Unless the application did, MPI is initialised once per process with `MPI_THREAD_MULTIPLE`
//! requested (by the bootstrap or lazily by the driver; `MAD_MPI_THREAD_LEVEL` asks for less)
//! and finalised when the last bootstrap, driver channel or communicator is dropped; it cannot
//! be initialised again in the same process afterwards. Under `MPI_THREAD_SERIALIZED` every MPI call takes one lock; under
//! `FUNNELED` or `SINGLE` MPI channels are refused (`Error::Unavailable`) and the bootstrap
//! works from the thread that initialised MPI only.
//!
//! Inside an MPI application (it called `MPI_Init`/`MPI_Init_thread` itself),
//! [`MpiBootstrap::from_communicator`] and [`MpiDriver::from_communicator`] build a session
//! and its MPI channels over a communicator the application gives: they work on duplicates of
//! it (`MPI_Comm_dup`) and set `MPI_ERRORS_RETURN` on those duplicates only, never on
//! `MPI_COMM_WORLD` or the application's communicators; this crate never finalises MPI it did
//! not initialise, so drop every session, channel, bootstrap and driver before the
//! application's `MPI_Finalize`. Errors of MPI calls tied to no communicator (datatype
//! creation) go to the handler the application set on `MPI_COMM_WORLD`/`MPI_COMM_SELF`.

#![deny(unsafe_code)]

pub mod bootstrap;
pub mod driver;
pub mod launcher;
mod sys;

pub use bootstrap::MpiBootstrap;
pub use driver::{GatherPolicy, MpiDriver, MpiFamily};
pub use launcher::{Launcher, LauncherKind};
/// The rsmpi crate this one is built on: its `raw::AsRaw` gives the raw communicator that
/// [`MpiBootstrap::from_communicator`] and [`MpiDriver::from_communicator`] take.
pub use mpi;
/// MPI threading levels (rsmpi's), as granted by `MPI_Init_thread`.
pub use mpi::environment::Threading;
pub use sys::{level_name, Runtime};
