//! Bootstrap: how the processes of a session find each other.
//!
//! A bootstrap gives this process its rank and the session size, the session secret, and a
//! collective `allgather` that channels use at open time to exchange endpoint information
//! (listen addresses, segment names, queue-pair numbers). Implementations: the in-process
//! [`ThreadBootstrap`](crate::bootstrap::ThreadBootstrap) for tests, the `madrun` client
//! (`crate::launch`), and the MPI bootstrap in `mad-mpi`.

use crate::auth::Secret;
use crate::error::Result;

/// The services a session needs from whatever started its processes.
pub trait Bootstrap: Send + Sync {
    /// This process's rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// Number of processes in the session.
    fn size(&self) -> usize;
    /// The per-session secret every connection must prove it knows.
    fn secret(&self) -> &Secret;
    /// Collective: every rank calls it with the same `tag`; returns every rank's `value`,
    /// indexed by rank. Calls with different tags may not be interleaved differently on
    /// different ranks (they are matched by tag, but each rank must issue them in the same
    /// order).
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Collective: returns when every rank has entered it.
    fn barrier(&self, tag: &str) -> Result<()> {
        self.allgather(tag, &[]).map(|_| ())
    }
    /// A short name for diagnostics ("single", "threads", "madrun", "mpi").
    fn kind(&self) -> &'static str;
    /// Ranks that run on the same host as this one (including this rank), if known.
    /// Used by intra-node drivers. Default: every rank (one-host session).
    fn local_ranks(&self) -> Vec<usize> {
        (0..self.size()).collect()
    }
}
