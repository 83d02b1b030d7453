//! Which MPI launcher started this process: the detection lives in
//! [`mad_core::launch::mpi_env`] (a session built without a bootstrap uses it too, to refuse
//! running as one of several launched processes); re-exported here for this crate's users.

pub use mad_core::launch::mpi_env::{detect, detect_from_env, Launcher, LauncherKind};
