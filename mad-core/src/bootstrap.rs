//! Bootstrap: how the processes of a session find each other.
//!
//! A bootstrap gives this process its rank and the session size, the session secret, and a
//! collective `allgather` that channels use at open time to exchange endpoint information
//! (listen addresses, segment names, queue-pair numbers). Implementations: the in-process
//! [`ThreadBootstrap`] for tests, the `madrun` client
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

/// The bootstrap of a one-process session (a program started without a launcher).
#[derive(Debug)]
pub struct SingleBootstrap {
    secret: Secret,
}

impl SingleBootstrap {
    /// A one-process session with a fresh random secret.
    pub fn new() -> Result<Self> {
        Ok(SingleBootstrap {
            secret: Secret::random()?,
        })
    }
}

impl Bootstrap for SingleBootstrap {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn secret(&self) -> &Secret {
        &self.secret
    }
    fn allgather(&self, _tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![value.to_vec()])
    }
    fn kind(&self) -> &'static str {
        "single"
    }
}

/// An in-process bootstrap: the "processes" of the session are threads of this process.
///
/// Used by tests and by the conformance kit to run real drivers (real sockets, real shared
/// memory) between threads. `ThreadBootstrap::group(n)` returns one handle per rank; move each
/// into its own thread.
#[derive(Clone)]
pub struct ThreadBootstrap {
    rank: usize,
    shared: std::sync::Arc<ThreadShared>,
}

struct ThreadShared {
    size: usize,
    secret: Secret,
    state: std::sync::Mutex<std::collections::HashMap<String, GatherSlot>>,
    cond: std::sync::Condvar,
    timeout: std::time::Duration,
}

#[derive(Default)]
struct GatherSlot {
    values: Vec<Option<Vec<u8>>>,
    taken: usize,
}

impl std::fmt::Debug for ThreadBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ThreadBootstrap(rank {} of {})",
            self.rank, self.shared.size
        )
    }
}

impl ThreadBootstrap {
    /// One handle per rank of an `n`-rank in-process session sharing a fresh secret.
    pub fn group(n: usize) -> Vec<ThreadBootstrap> {
        let secret =
            Secret::random().unwrap_or_else(|_| Secret::from_bytes([7; crate::auth::SECRET_LEN]));
        let shared = std::sync::Arc::new(ThreadShared {
            size: n,
            secret,
            state: Default::default(),
            cond: Default::default(),
            timeout: std::time::Duration::from_secs(60),
        });
        (0..n)
            .map(|rank| ThreadBootstrap {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl Bootstrap for ThreadBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn secret(&self) -> &Secret {
        &self.shared.secret
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let sh = &*self.shared;
        let rank = self.rank;
        let poisoned = move || crate::Error::Protocol {
            rank,
            what: "bootstrap lock poisoned".into(),
        };
        let mut st = sh.state.lock().map_err(|_| poisoned())?;
        {
            let slot = st.entry(tag.to_string()).or_default();
            if slot.values.is_empty() {
                slot.values = vec![None; sh.size];
            }
            if slot.values[self.rank].is_some() {
                return Err(crate::Error::BadConfig(format!(
                    "rank {} entered allgather `{tag}` twice",
                    self.rank
                )));
            }
            slot.values[self.rank] = Some(value.to_vec());
        }
        sh.cond.notify_all();
        let deadline = std::time::Instant::now() + sh.timeout;
        loop {
            let slot = st
                .get_mut(tag)
                .ok_or_else(|| crate::Error::protocol(self.rank, "allgather slot vanished"))?;
            if slot.values.iter().all(Option::is_some) {
                let out: Vec<Vec<u8>> = slot
                    .values
                    .iter()
                    .map(|v| v.clone().unwrap_or_default())
                    .collect();
                slot.taken += 1;
                if slot.taken == sh.size {
                    st.remove(tag);
                }
                return Ok(out);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(crate::Error::Timeout(sh.timeout));
            }
            st = sh
                .cond
                .wait_timeout(st, deadline - now)
                .map_err(|_| poisoned())?
                .0;
        }
    }
    fn kind(&self) -> &'static str {
        "threads"
    }
}
