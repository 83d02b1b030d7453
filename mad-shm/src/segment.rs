//! Per-process shared-memory segments in `/dev/shm`.
//!
//! Each process of a channel creates one segment (`O_CREAT|O_EXCL`, mode 0600) holding its
//! doorbell and one incoming ring per peer:
//!
//! ```text
//! 0      magic "MADSHM01" (u64) | version u32 | ranks u32 | ring capacity u64 | pid u32
//! 64     proof of the session secret (32 bytes, HMAC over the segment name)
//! 128    doorbell: u32 futex word every writer bumps when this process sleeps
//! 256    doorbell sleepers (u32)
//! 4096   ring of rank 0: header block (4096) + data (capacity)
//! ...    ring of rank 1, ...
//! ```
//!
//! The name is `mad-shm-<pid>-<channel hash>-<rank>-<random>`; the pid lets a later open
//! sweep segments whose creator died before unlinking them.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use mad_core::{Error, Result};

use crate::ring::{layout, Region, RingView};
use crate::sys;

/// Directory of POSIX shared memory.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every segment this driver creates.
pub const PREFIX: &str = "mad-shm-";
const MAGIC: u64 = u64::from_le_bytes(*b"MADSHM01");
const VERSION: u32 = 2;
const OFF_PROOF: usize = 64;
/// Length of the secret proof stored in the header.
pub const PROOF_LEN: usize = 32;
const OFF_BELL: usize = 128;
const OFF_BELL_SLEEPERS: usize = 256;
const HEADER: usize = 4096;

/// Size of a segment for `n` ranks and rings of `cap` bytes.
pub fn segment_size(n: usize, cap: usize) -> Option<usize> {
    n.checked_mul(layout::HDR.checked_add(cap)?)?
        .checked_add(HEADER)
}

/// Offset of ring `i`.
fn ring_base(i: usize, cap: usize) -> usize {
    HEADER + i * (layout::HDR + cap)
}

/// One mapped segment.
pub struct Segment {
    region: Region,
    path: PathBuf,
    owner_unlink_pending: bool,
    n: usize,
    cap: usize,
}

impl Segment {
    /// Create this process's segment `name` (fails if it exists), mode 0600, and write its
    /// header.
    pub fn create(name: &str, n: usize, cap: usize, proof: &[u8; PROOF_LEN]) -> Result<Self> {
        let path = Path::new(SHM_DIR).join(name);
        let size = segment_size(n, cap)
            .ok_or_else(|| Error::BadConfig(format!("shm: {n} rings of {cap} B overflow")))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(format!("shm: creating {}", path.display()), e))?;
        let mut seg = Segment {
            region: Region::heap(0),
            path,
            owner_unlink_pending: true,
            n,
            cap,
        };
        file.set_len(size as u64).map_err(|e| {
            Error::Resource(format!(
                "shm: sizing {} to {size} B: {e}",
                seg.path.display()
            ))
        })?;
        seg.region = map(&file, &seg.path)?;
        let mut h = Vec::with_capacity(64);
        h.extend_from_slice(&MAGIC.to_le_bytes());
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(n as u32).to_le_bytes());
        h.extend_from_slice(&(cap as u64).to_le_bytes());
        h.extend_from_slice(&std::process::id().to_le_bytes());
        let ok = seg
            .region
            .write_bytes(0, &h)
            .and_then(|_| seg.region.write_bytes(OFF_PROOF, proof));
        ok.ok_or_else(|| Error::Resource("shm: segment smaller than its header".into()))?;
        Ok(seg)
    }

    /// Map a peer's segment and check its header (size, magic, geometry, creator pid, proof).
    pub fn open(
        name: &str,
        rank: usize,
        n: usize,
        cap: usize,
        pid: u32,
        check_proof: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Self> {
        if name.contains('/') || !name.starts_with(PREFIX) {
            return Err(Error::protocol(rank, format!("bad segment name `{name}`")));
        }
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(format!("shm: opening rank {rank}'s {}", path.display()), e))?;
        let want = segment_size(n, cap).unwrap_or(usize::MAX);
        let len = file
            .metadata()
            .map_err(|e| Error::io(format!("shm: stat {}", path.display()), e))?
            .len();
        if len != want as u64 {
            return Err(Error::protocol(
                rank,
                format!("segment is {len} B, expected {want} B"),
            ));
        }
        let region = map(&file, &path)?;
        let h = region
            .read_bytes(0, OFF_PROOF + PROOF_LEN)
            .ok_or_else(|| Error::protocol(rank, "segment too small"))?;
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap_or([0; 4]));
        if u64_at(0) != MAGIC || u32_at(8) != VERSION {
            return Err(Error::protocol(
                rank,
                "segment header: bad magic or version",
            ));
        }
        if u32_at(12) as usize != n || u64_at(16) as usize != cap || u32_at(24) != pid {
            return Err(Error::protocol(
                rank,
                "segment header disagrees with the published geometry",
            ));
        }
        if !check_proof(&h[OFF_PROOF..OFF_PROOF + PROOF_LEN]) {
            return Err(Error::Auth(format!(
                "shm: segment of rank {rank} does not prove the session secret"
            )));
        }
        Ok(Segment {
            region,
            path,
            owner_unlink_pending: false,
            n,
            cap,
        })
    }

    /// Remove the file (the mappings stay valid). Idempotent.
    pub fn unlink(&mut self) -> Result<()> {
        if self.owner_unlink_pending {
            self.owner_unlink_pending = false;
            std::fs::remove_file(&self.path)
                .map_err(|e| Error::io(format!("shm: unlinking {}", self.path.display()), e))?;
        }
        Ok(())
    }

    /// The incoming ring written by rank `from`.
    pub fn ring(&self, from: usize) -> Option<RingView> {
        if from >= self.n {
            return None;
        }
        RingView::new(self.region.clone(), ring_base(from, self.cap), self.cap)
    }

    /// The doorbell futex word.
    pub fn bell(&self) -> &AtomicU32 {
        self.region
            .u32_at(OFF_BELL)
            .unwrap_or_else(|| unreachable!("segment header checked at map time"))
    }

    /// Number of threads asleep on the doorbell.
    pub fn bell_sleepers(&self) -> &AtomicU32 {
        self.region
            .u32_at(OFF_BELL_SLEEPERS)
            .unwrap_or_else(|| unreachable!("segment header checked at map time"))
    }

    /// Ring the doorbell if somebody sleeps on it. Call after publishing (the SeqCst fence
    /// pairs with the one in [`Segment::sleep`]).
    pub fn notify(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.bell_sleepers().load(Ordering::Relaxed) != 0 {
            self.bell().fetch_add(1, Ordering::SeqCst);
            sys::futex_wake(self.bell());
        }
    }

    /// Ring the doorbell unconditionally.
    pub fn ring_bell(&self) {
        self.bell().fetch_add(1, Ordering::SeqCst);
        sys::futex_wake(self.bell());
    }

    /// Sleep on the doorbell for at most `t` unless `ready()` holds once this thread is
    /// registered as a sleeper (so a writer publishing concurrently either is seen by `ready`
    /// or sees the sleeper and wakes it).
    pub fn sleep(&self, t: std::time::Duration, ready: &mut dyn FnMut() -> bool) {
        self.bell_sleepers().fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let seen = self.bell().load(Ordering::SeqCst);
        if !ready() {
            sys::futex_wait(self.bell(), seen, t);
        }
        self.bell_sleepers().fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner_unlink_pending {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn map(file: &File, path: &Path) -> Result<Region> {
    let m = sys::Mapping::map(file)
        .map_err(|e| Error::Resource(format!("shm: mapping {}: {e}", path.display())))?;
    Ok(Region::from_mapping(Arc::new(m)))
}

/// The pid encoded in a segment name, if it is one of ours.
pub fn creator_pid(name: &str) -> Option<u32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Remove segments of this driver whose creator process is gone (left behind by a crash
/// between create and unlink). Returns how many were removed. Errors are ignored: another
/// process may be sweeping at the same time.
pub fn sweep_stale() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return 0;
    };
    let mut removed = 0;
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(pid) = creator_pid(name) {
            if !sys::pid_alive(pid) && std::fs::remove_file(e.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}
