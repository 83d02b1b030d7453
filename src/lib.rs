#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]

pub mod affinity;
mod local;
pub mod logging;
pub use local::{in_session, run_local_if_alone};
pub use logging::init_logging;

/// Active messages and RPC over a channel: the [`mad_am`] crate.
pub use mad_am as am;
/// The command-line parser of the tools and examples (`--help`, `--version`, `--opt=value`):
/// [`mad_core::cli`].
pub use mad_core::cli;

// What a program uses: a deliberate list, not `mad_core::*`. The engine's internals (the wire
// format, the madrun launcher, the intra-host shared-memory machinery, peer liveness) are not
// re-exported; the tools of this package and drivers of other crates use `mad_core` itself.
/// `Pod` / `Zeroable` for [`Packer::pack_value`] and [`Unpacker::unpack_value`] of your own
/// types (the version the engine uses).
pub use mad_core::bytemuck;
pub use mad_core::error::{Cause, ErrorKind};
/// The modules of the engine a program may name: the session secret ([`auth`]), bootstraps
/// ([`bootstrap`]: one-process, threads, madrun's), channel configuration ([`config`]), the
/// driver contract ([`driver`]: capabilities, or a driver of your own), errors ([`error`]),
/// event-loop support ([`events`]), the in-process driver ([`mem`]), modes ([`modes`]),
/// progress policies ([`progress`]).
pub use mad_core::{auth, bootstrap, config, driver, error, events, mem, modes, progress};
pub use mad_core::{
    Armed, Channel, ChannelConfig, ChannelStats, Error, Packer, RecvMode, Result, SendMode,
    SendPacker, Session, SessionBuilder, Unpacker, DEFAULT_OPEN_TIMEOUT,
};
#[cfg(feature = "mpi")]
pub use mad_mpi;
#[cfg(feature = "shm")]
pub use mad_shm;
#[cfg(feature = "sisci")]
pub use mad_sisci;
#[cfg(feature = "tcp")]
pub use mad_tcp;
#[cfg(feature = "uds")]
pub use mad_uds;
#[cfg(feature = "via")]
pub use mad_via;

/// Every driver of this build, new instances: `mem` always; `tcp`, `shm`, `via`, `sisci`,
/// `uds`, `mpi` as enabled by features. [`builder`] registers them; a tool that drives a
/// driver's links itself (`mad-bench --drivers`) picks one by [`Driver::name`](driver::Driver::name).
pub fn drivers() -> Vec<Box<dyn driver::Driver>> {
    #[allow(unused_mut)]
    let mut v: Vec<Box<dyn driver::Driver>> = vec![Box::new(mad_core::mem::MemDriver)];
    #[cfg(feature = "tcp")]
    v.push(Box::new(mad_tcp::TcpDriver::new()));
    #[cfg(feature = "shm")]
    v.push(Box::new(mad_shm::ShmDriver::new()));
    #[cfg(feature = "via")]
    v.push(Box::new(mad_via::ViaDriver::new()));
    #[cfg(feature = "sisci")]
    v.push(Box::new(mad_sisci::SisciDriver::new()));
    #[cfg(feature = "uds")]
    v.push(Box::new(mad_uds::UdsDriver::new()));
    #[cfg(feature = "mpi")]
    v.push(Box::new(mad_mpi::MpiDriver::new()));
    v
}

/// A session builder with every driver of this build registered ([`drivers`]).
pub fn builder() -> SessionBuilder {
    drivers()
        .into_iter()
        .fold(Session::builder(), |b, d| b.driver(Boxed(d)))
}

/// A boxed driver registered as a driver.
struct Boxed(Box<dyn driver::Driver>);

impl driver::Driver for Boxed {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn accepted_options(&self, config: &ChannelConfig) -> config::DriverOptions {
        self.0.accepted_options(config)
    }
    fn tm_table(&self, config: &ChannelConfig) -> Result<driver::TmTable> {
        self.0.tm_table(config)
    }
    fn capabilities(&self, config: &ChannelConfig) -> driver::Capabilities {
        self.0.capabilities(config)
    }
    fn open(&self, ctx: &driver::OpenContext<'_>) -> Result<driver::OpenedChannel> {
        self.0.open(ctx)
    }
}

/// Build the session of this process with every driver of this build: under `mpiexec` /
/// `mpirun` / `srun` (with the `mpi` feature) the MPI bootstrap, under `madrun` the madrun
/// bootstrap, otherwise a one-process session.
///
/// A build without the `mpi` feature started by an MPI launcher with more than one process
/// fails with [`Error::BadConfig`] naming the launcher (each process would otherwise run its
/// own one-process session).
///
/// # Errors
///
/// [`Error::BadConfig`] when the environment is wrong, including a
/// build without the `mpi` feature started by an MPI launcher with more than one process; the
/// bootstrap's errors when it cannot reach the other ranks (see [`SessionBuilder::build`]).
pub fn session() -> Result<Session> {
    #[cfg(feature = "mpi")]
    {
        if let Some(b) = mad_mpi::MpiBootstrap::from_env()? {
            return builder().bootstrap(Box::new(b)).build();
        }
    }
    // Without the `mpi` feature, a process an MPI launcher started as one of several is
    // refused by the build (`SessionBuilder::build`), not left alone.
    builder().build()
}
