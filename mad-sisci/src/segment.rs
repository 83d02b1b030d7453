//! The `local` backend's exported segments: one per process in `/dev/shm`, created
//! `O_CREAT|O_EXCL` mode 0600, mapped by every peer, unlinked by its creator once every peer
//! has mapped it (mad-shm's discipline, reusing its mapping and futex helpers).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mad_core::{Error, Result};
use mad_shm::sys as shm_sys;

use crate::layout::{hdr, Geometry, MAGIC, VERSION};
use crate::sys::Mem;

/// Directory of POSIX shared memory.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every segment this driver creates: `mad-sisci-<pid>-...`.
pub const PREFIX: &str = "mad-sisci-";
/// Length of the secret proof in the header.
pub const PROOF_LEN: usize = 32;

/// One mapped segment (this process's, or a peer's).
pub struct Segment {
    mem: Mem,
    path: PathBuf,
    unlink_pending: bool,
    geom: Geometry,
    n: usize,
}

fn geom_words(n: usize, g: &Geometry, pid: u32) -> [u64; 8] {
    [
        VERSION,
        n as u64,
        g.slots as u64,
        g.ring as u64,
        g.chunk as u64,
        g.chunks as u64,
        pid as u64,
        0,
    ]
}

fn map(file: &std::fs::File, path: &Path) -> Result<Mem> {
    let m = shm_sys::Mapping::map(file)
        .map_err(|e| Error::Resource(format!("sisci: mapping {}: {e}", path.display())))?;
    Ok(Mem::from_mapping(Arc::new(m)))
}

impl Segment {
    /// Create this process's segment `name` (fails if it exists) and write its header.
    pub fn create(name: &str, n: usize, geom: Geometry, proof: &[u8; PROOF_LEN]) -> Result<Self> {
        let path = Path::new(SHM_DIR).join(name);
        let size = geom
            .segment_size(n)
            .ok_or_else(|| Error::BadConfig(format!("sisci: {n} areas of {geom:?} overflow")))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(format!("sisci: creating {}", path.display()), e))?;
        let mut seg = Segment {
            mem: Mem::heap(0),
            path,
            unlink_pending: true,
            geom,
            n,
        };
        file.set_len(size as u64).map_err(|e| {
            Error::Resource(format!(
                "sisci: sizing {} to {size} B: {e}",
                seg.path.display()
            ))
        })?;
        seg.mem = map(&file, &seg.path)?;
        let mut h = Vec::with_capacity(80);
        h.extend_from_slice(&MAGIC.to_le_bytes());
        for w in geom_words(n, &geom, std::process::id()) {
            h.extend_from_slice(&w.to_le_bytes());
        }
        seg.mem
            .write(0, &h)
            .and_then(|_| seg.mem.write(hdr::PROOF, proof))
            .ok_or_else(|| Error::Resource("sisci: segment smaller than its header".into()))?;
        Ok(seg)
    }

    /// Map rank `rank`'s segment and check its header (size, magic, geometry, pid, proof).
    pub fn open(
        name: &str,
        rank: usize,
        n: usize,
        geom: Geometry,
        pid: u32,
        check_proof: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Self> {
        if name.contains('/') || !name.starts_with(PREFIX) {
            return Err(Error::protocol(
                rank,
                format!("sisci: bad segment name `{name}`"),
            ));
        }
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                Error::io(
                    format!("sisci: opening rank {rank}'s {}", path.display()),
                    e,
                )
            })?;
        let want = geom.segment_size(n).unwrap_or(usize::MAX) as u64;
        let len = file
            .metadata()
            .map_err(|e| Error::io(format!("sisci: stat {}", path.display()), e))?
            .len();
        if len != want {
            return Err(Error::protocol(
                rank,
                format!("sisci: segment is {len} B, expected {want} B"),
            ));
        }
        let mem = map(&file, &path)?;
        let mut h = [0u8; hdr::PROOF + PROOF_LEN];
        mem.read(0, &mut h)
            .ok_or_else(|| Error::protocol(rank, "sisci: segment too small"))?;
        let word = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&h[8 * i..8 * i + 8]);
            u64::from_le_bytes(a)
        };
        if word(0) != MAGIC {
            return Err(Error::protocol(rank, "sisci: segment header: bad magic"));
        }
        let expect = geom_words(n, &geom, pid);
        if (0..8).any(|i| word(1 + i) != expect[i]) {
            return Err(Error::protocol(
                rank,
                "sisci: segment header disagrees with the published geometry",
            ));
        }
        if !check_proof(&h[hdr::PROOF..hdr::PROOF + PROOF_LEN]) {
            return Err(Error::Auth(format!(
                "sisci: segment of rank {rank} does not prove the session secret"
            )));
        }
        Ok(Segment {
            mem,
            path,
            unlink_pending: false,
            geom,
            n,
        })
    }

    /// Remove the file (mappings stay valid). Idempotent.
    pub fn unlink(&mut self) -> Result<()> {
        if self.unlink_pending {
            self.unlink_pending = false;
            std::fs::remove_file(&self.path)
                .map_err(|e| Error::io(format!("sisci: unlinking {}", self.path.display()), e))?;
        }
        Ok(())
    }

    /// The area rank `r` writes into.
    pub fn area(&self, r: usize) -> Option<Mem> {
        if r >= self.n {
            return None;
        }
        self.mem.sub(self.geom.area_off(r)?, self.geom.area_size()?)
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        self.mem
            .u32_at(off)
            .unwrap_or_else(|| unreachable!("header size checked at map time"))
    }

    /// Ring the doorbell if somebody sleeps on it (after publishing; the SeqCst fence pairs
    /// with the one in [`Segment::sleep`]).
    pub fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.word(hdr::BELL_SLEEPERS).load(Ordering::Relaxed) != 0 {
            self.ring_bell();
        }
    }

    /// Ring the doorbell unconditionally.
    pub fn ring_bell(&self) {
        self.word(hdr::BELL).fetch_add(1, Ordering::SeqCst);
        shm_sys::futex_wake(self.word(hdr::BELL));
    }

    /// Sleep on the doorbell at most `t` unless `ready()` holds once registered as a sleeper.
    pub fn sleep(&self, t: Duration, ready: &mut dyn FnMut() -> bool) {
        self.word(hdr::BELL_SLEEPERS).fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let seen = self.word(hdr::BELL).load(Ordering::SeqCst);
        if !ready() {
            shm_sys::futex_wait(self.word(hdr::BELL), seen, t);
        }
        self.word(hdr::BELL_SLEEPERS).fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.unlink_pending {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The pid in one of our segment names.
pub fn creator_pid(name: &str) -> Option<u32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Remove segments whose creator died before unlinking them. (Minimal copy of
/// `mad_shm::segment::sweep_stale`, which is tied to mad-shm's prefix.)
pub fn sweep_stale() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return 0;
    };
    let mut removed = 0;
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(pid) = creator_pid(name) {
            if !shm_sys::pid_alive(pid) && std::fs::remove_file(e.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}
