//! Bootstrap: how the processes of a session find each other.
//!
//! A bootstrap gives this process its rank and the session size, the session secret, and a
//! collective `allgather` that channels use at open time to exchange endpoint information
//! (listen addresses, segment names, queue-pair numbers). Implementations: the in-process
//! [`ThreadBootstrap`] for tests, the `madrun` client
//! (`crate::launch`), and the MPI bootstrap in `mad-mpi`.

use std::time::{Duration, Instant};

use crate::auth::Secret;
use crate::error::{Error, Result};

/// A set of collectives that succeed or fail together: one channel open.
///
/// Every tag of the scope starts with [`prefix`](Scope::prefix). A rank whose own part fails
/// [`abandon`](Bootstrap::abandon)s the scope: every pending and later collective of the scope
/// then fails on the other ranks with [`Error::RemoteFailure`] naming it; a collective that
/// reaches the [`deadline`](Scope::deadline) fails with [`Error::CollectiveTimeout`] naming the
/// ranks that had not arrived (where the bootstrap knows them), and abandons the scope for
/// everybody.
#[derive(Clone, Debug)]
pub struct Scope {
    /// Every tag of the scope starts with this prefix (no other scope's prefix starts with it).
    pub prefix: String,
    /// What the scope does, for error messages (`channel `x`: open`).
    pub what: String,
    /// When its collectives give up.
    pub deadline: Instant,
    /// The bound the deadline came from (reported by timeouts).
    pub timeout: Duration,
}

impl Scope {
    /// A scope of collectives under `prefix` that must complete within `timeout` from now.
    pub fn new(prefix: impl Into<String>, what: impl Into<String>, timeout: Duration) -> Self {
        let now = Instant::now();
        Scope {
            prefix: prefix.into(),
            what: what.into(),
            deadline: now
                .checked_add(timeout)
                .unwrap_or(now + Duration::from_secs(1 << 30)),
            timeout,
        }
    }

    /// Whether `tag` belongs to this scope.
    pub fn contains(&self, tag: &str) -> bool {
        tag.starts_with(&self.prefix)
    }

    /// The timeout error of this scope.
    pub fn timeout_error(&self, mut missing: Vec<usize>) -> Error {
        missing.sort_unstable();
        missing.dedup();
        Error::CollectiveTimeout {
            what: self.what.clone(),
            after: self.timeout,
            missing,
        }
    }
}

/// Why a rank abandoned a [`Scope`], as the other ranks learn it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank whose own part failed.
    pub rank: usize,
    /// Its error's kind ([`Error::kind_name`]).
    pub kind: String,
    /// Its error's text.
    pub message: String,
    /// For a timeout ([`RankFailure::TIMEOUT`]): the ranks that had not arrived, where known.
    pub missing: Vec<usize>,
}

impl RankFailure {
    /// The kind of a failure that is a scope's deadline passing.
    pub const TIMEOUT: &'static str = "CollectiveTimeout";

    /// The failure of `rank` with error `e`.
    pub fn from_error(rank: usize, e: &Error) -> Self {
        RankFailure {
            rank,
            kind: e.kind_name().to_string(),
            message: e.to_string(),
            missing: match e {
                Error::CollectiveTimeout { missing, .. } => missing.clone(),
                _ => Vec::new(),
            },
        }
    }

    /// The error the other ranks of `scope` report: [`Error::CollectiveTimeout`] for a
    /// timeout (the cause is a missing rank, not the rank that noticed), otherwise
    /// [`Error::RemoteFailure`].
    pub fn to_error(&self, scope: &Scope) -> Error {
        self.to_error_for(&scope.what, scope.timeout)
    }

    /// [`to_error`](Self::to_error) with the scope's description and bound given separately.
    pub fn to_error_for(&self, what: &str, timeout: Duration) -> Error {
        if self.kind == Self::TIMEOUT {
            let mut missing = self.missing.clone();
            missing.sort_unstable();
            missing.dedup();
            Error::CollectiveTimeout {
                what: what.to_string(),
                after: timeout,
                missing,
            }
        } else {
            Error::RemoteFailure {
                what: what.to_string(),
                rank: self.rank,
                kind: self.kind.clone(),
                message: self.message.clone(),
            }
        }
    }
}

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
    ///
    /// # Errors
    ///
    /// The bootstrap's failure to exchange: [`Error::Io`] or
    /// [`Error::PeerClosed`] when a rank or the launcher is gone,
    /// [`Error::Timeout`] or
    /// [`Error::CollectiveTimeout`] when a rank does not arrive,
    /// [`Error::Protocol`] for a malformed exchange.
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Collective: returns when every rank has entered it.
    ///
    /// # Errors
    ///
    /// As [`allgather`](Self::allgather).
    fn barrier(&self, tag: &str) -> Result<()> {
        self.allgather(tag, &[]).map(|_| ())
    }
    /// A short name for diagnostics ("single", "threads", "madrun", "mpi").
    fn kind(&self) -> &'static str;
    /// [`allgather`](Self::allgather) as part of `scope` (whose prefix `tag` starts with):
    /// fails with [`Error::CollectiveTimeout`] at the scope's deadline (and abandons the scope
    /// for the other ranks), and with [`Error::RemoteFailure`] as soon as another rank has
    /// abandoned the scope.
    ///
    /// After this returned an error, the caller must not [`abandon`](Self::abandon) the
    /// scope: the failure is already known to every rank that can learn it (the MPI bootstrap,
    /// whose collectives are matched by position, relies on it). The default ignores the
    /// scope: unbounded, like `allgather`.
    ///
    /// # Errors
    ///
    /// [`Error::CollectiveTimeout`] at the scope's deadline;
    /// [`Error::RemoteFailure`] once another rank abandoned the scope;
    /// otherwise as [`allgather`](Self::allgather).
    fn scoped_allgather(&self, scope: &Scope, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _ = scope;
        self.allgather(tag, value)
    }
    /// This rank's part of `scope` failed outside its collectives (`failure.rank` is this
    /// rank): make every pending and later collective of the scope fail on the other ranks
    /// with `failure`. Returns the failure the scope is known by, which is another rank's when
    /// that one abandoned it first. Called at most once per scope, and never after one of its
    /// collectives failed. The default (a bootstrap that cannot tell the others) does nothing.
    ///
    /// # Errors
    ///
    /// The bootstrap's failure to tell the other ranks, as [`allgather`](Self::allgather).
    fn abandon(&self, scope: &Scope, failure: &RankFailure) -> Result<RankFailure> {
        let _ = scope;
        Ok(failure.clone())
    }
    /// Ranks that run on the same host as this one (including this rank), if known.
    /// Used by intra-node drivers. Default: every rank (one-host session).
    fn local_ranks(&self) -> Vec<usize> {
        (0..self.size()).collect()
    }
}

/// This host as the other ranks should see it: `hostname/boot id` (the kernel's boot id
/// tells two hosts apart even when their names are alike). The PMI bootstrap derives
/// `local_ranks` from it; a channel open exchanges it ([`HostIdentity`]).
pub(crate) fn host_identity() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let (host, boot) = (
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id"),
    );
    format!("{}/{}", host.trim(), boot.trim())
}

/// A [`host_identity`] as another rank sent it: its host name and its kernel's boot id
/// (either empty when unknown).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HostIdentity {
    pub(crate) name: String,
    pub(crate) boot: String,
}

impl HostIdentity {
    pub(crate) fn parse(s: &str) -> Self {
        let (name, boot) = s.trim().rsplit_once('/').unwrap_or((s.trim(), ""));
        HostIdentity {
            name: name.to_string(),
            boot: boot.to_string(),
        }
    }

    /// Whether `other` certainly runs on another kernel (both boot ids known, and different).
    pub(crate) fn other_kernel(&self, other: &HostIdentity) -> bool {
        !self.boot.is_empty() && !other.boot.is_empty() && self.boot != other.boot
    }
}

/// The bootstrap of a one-process session (a program started without a launcher).
#[derive(Debug)]
pub struct SingleBootstrap {
    secret: Secret,
}

impl SingleBootstrap {
    /// A one-process session with a fresh random secret.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the operating system's random generator fails.
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
    state: std::sync::Mutex<ThreadState>,
    cond: std::sync::Condvar,
    timeout: std::time::Duration,
}

#[derive(Default)]
struct ThreadState {
    slots: std::collections::HashMap<String, GatherSlot>,
    /// Abandoned scopes: prefix, and the first failure reported for it.
    aborts: Vec<(String, RankFailure)>,
}

impl ThreadState {
    fn aborted(&self, tag: &str) -> Option<&RankFailure> {
        self.aborts
            .iter()
            .find(|(p, _)| tag.starts_with(p.as_str()))
            .map(|(_, f)| f)
    }

    /// Record `f` for `prefix` unless the scope already has a failure; returns the one kept.
    fn abandon(&mut self, prefix: &str, f: &RankFailure) -> RankFailure {
        if let Some(first) = self.aborted(prefix) {
            return first.clone();
        }
        self.aborts.push((prefix.to_string(), f.clone()));
        // The gathers of the scope will never complete: forget them.
        self.slots.retain(|t, _| !t.starts_with(prefix));
        f.clone()
    }
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

impl ThreadBootstrap {
    fn poisoned(&self) -> Error {
        Error::Protocol {
            rank: self.rank,
            what: "bootstrap lock poisoned".into(),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, ThreadState>> {
        self.shared.state.lock().map_err(|_| self.poisoned())
    }

    fn gather(&self, scope: Option<&Scope>, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let sh = &*self.shared;
        let what = || scope.map_or_else(|| format!("allgather `{tag}`"), |s| s.what.clone());
        let failed =
            |f: &RankFailure| f.to_error_for(&what(), scope.map_or(sh.timeout, |s| s.timeout));
        let mut st = self.lock()?;
        if let Some(f) = st.aborted(tag) {
            return Err(failed(f));
        }
        {
            let slot = st.slots.entry(tag.to_string()).or_default();
            if slot.values.is_empty() {
                slot.values = vec![None; sh.size];
            }
            if slot.values[self.rank].is_some() {
                return Err(Error::BadConfig(format!(
                    "rank {} entered allgather `{tag}` twice",
                    self.rank
                )));
            }
            slot.values[self.rank] = Some(value.to_vec());
        }
        sh.cond.notify_all();
        let deadline = match scope {
            Some(s) => s.deadline,
            None => Instant::now() + sh.timeout,
        };
        loop {
            if let Some(f) = st.aborted(tag) {
                return Err(failed(f));
            }
            let slot = st
                .slots
                .get_mut(tag)
                .ok_or_else(|| Error::protocol(self.rank, "allgather slot vanished"))?;
            if slot.values.iter().all(Option::is_some) {
                let out: Vec<Vec<u8>> = slot
                    .values
                    .iter()
                    .map(|v| v.clone().unwrap_or_default())
                    .collect();
                slot.taken += 1;
                if slot.taken == sh.size {
                    st.slots.remove(tag);
                }
                return Ok(out);
            }
            let now = Instant::now();
            if now >= deadline {
                let Some(scope) = scope else {
                    return Err(Error::Timeout(sh.timeout));
                };
                let missing: Vec<usize> =
                    (0..sh.size).filter(|&r| slot.values[r].is_none()).collect();
                let e = scope.timeout_error(missing);
                st.abandon(&scope.prefix, &RankFailure::from_error(self.rank, &e));
                sh.cond.notify_all();
                return Err(e);
            }
            st = sh
                .cond
                .wait_timeout(st, deadline - now)
                .map_err(|_| self.poisoned())?
                .0;
        }
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
        self.gather(None, tag, value)
    }
    fn scoped_allgather(&self, scope: &Scope, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(Some(scope), tag, value)
    }
    fn abandon(&self, scope: &Scope, failure: &RankFailure) -> Result<RankFailure> {
        let first = self.lock()?.abandon(&scope.prefix, failure);
        self.shared.cond.notify_all();
        Ok(first)
    }
    fn kind(&self) -> &'static str {
        "threads"
    }
}

/// Collectives matched by position (the MPI and PMI bootstraps): each rank's contribution is
/// framed with its tag's hash, so ranks that issue collectives in different orders get an
/// error instead of each other's values, or is an abort marker: a rank that abandons a scope
/// takes part in the collective its peers are in with its failure instead of a value.
pub mod positional {
    use super::{RankFailure, Scope};
    use crate::error::{Error, Result};

    fn tag_hash(tag: &str) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in tag.as_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }

    /// First 8 bytes of an abort marker.
    const ABORT_MARK: u64 = 0x6d61_642d_6162_7274; // "mad-abrt"
    /// Longest error text carried by an abort marker.
    const MAX_ABORT_TEXT: usize = 4096;

    /// This rank's contribution `value` to the collective `tag`.
    pub fn frame(tag: &str, value: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + value.len());
        v.extend_from_slice(&tag_hash(tag).to_le_bytes());
        v.extend_from_slice(value);
        v
    }

    /// The contribution of a rank that abandons its scope with `f`.
    pub fn abort_frame(f: &RankFailure) -> Vec<u8> {
        let cut = |s: &str, max: usize| {
            let mut end = s.len().min(max);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s.as_bytes()[..end].to_vec()
        };
        let (kind, msg) = (cut(&f.kind, 64), cut(&f.message, MAX_ABORT_TEXT));
        let mut v = Vec::with_capacity(24 + kind.len() + msg.len());
        v.extend_from_slice(&ABORT_MARK.to_le_bytes());
        v.extend_from_slice(&(kind.len() as u32).to_le_bytes());
        v.extend_from_slice(&kind);
        v.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        v.extend_from_slice(&msg);
        v
    }

    /// The failure in rank `r`'s contribution `b`, if it is an abort marker (a malformed
    /// marker is still a failure of that rank).
    fn decode_abort(r: usize, b: &[u8]) -> Option<RankFailure> {
        if b.get(..8)? != ABORT_MARK.to_le_bytes() {
            return None;
        }
        let mut rest = &b[8..];
        let mut text = || -> Option<String> {
            let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
            let s = rest.get(4..4 + n)?;
            rest = &rest[4 + n..];
            Some(String::from_utf8_lossy(s).into_owned())
        };
        let (kind, message) = match (text(), text()) {
            (Some(k), Some(m)) => (k, m),
            _ => ("Protocol".into(), "malformed abort marker".into()),
        };
        Some(RankFailure {
            rank: r,
            kind,
            message,
            missing: Vec::new(),
        })
    }

    /// The first abort marker among every rank's contribution, if any.
    pub fn failure_in(all: &[Vec<u8>]) -> Option<RankFailure> {
        all.iter().enumerate().find_map(|(r, b)| decode_abort(r, b))
    }

    /// Every rank's value from every rank's contribution to `tag` (of `scope`, if any): the
    /// failure of a rank that abandoned the scope, or [`Error::Protocol`] naming a rank that
    /// entered another collective.
    ///
    /// # Errors
    ///
    /// The failure of a rank that abandoned the scope
    /// ([`Error::RemoteFailure`],
    /// [`Error::CollectiveTimeout`]);
    /// [`Error::Protocol`] naming a rank that entered another collective.
    pub fn unframe(all: Vec<Vec<u8>>, scope: Option<&Scope>, tag: &str) -> Result<Vec<Vec<u8>>> {
        if let Some(f) = failure_in(&all) {
            return Err(match scope {
                Some(s) => f.to_error(s),
                None => f.to_error_for(&format!("allgather `{tag}`"), std::time::Duration::ZERO),
            });
        }
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

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn frames() {
            let all = vec![frame("t", b"a"), frame("t", b"")];
            assert_eq!(
                unframe(all, None, "t").unwrap(),
                vec![b"a".to_vec(), vec![]]
            );
            let mixed = vec![frame("t", b"a"), frame("u", b"b")];
            assert!(matches!(
                unframe(mixed, None, "t"),
                Err(Error::Protocol { rank: 1, .. })
            ));
            let f = RankFailure {
                rank: 1,
                kind: "Io".into(),
                message: "é".repeat(5000),
                missing: vec![],
            };
            let all = vec![frame("t", b"a"), abort_frame(&f)];
            let got = failure_in(&all).unwrap();
            assert_eq!((got.rank, got.kind.as_str()), (1, "Io"));
            assert!(got.message.len() <= MAX_ABORT_TEXT);
            assert!(matches!(
                unframe(all, None, "t"),
                Err(Error::RemoteFailure { rank: 1, .. })
            ));
            let cut = ABORT_MARK.to_le_bytes().to_vec();
            assert_eq!(failure_in(&[cut]).unwrap().kind, "Protocol");
        }
    }
}
