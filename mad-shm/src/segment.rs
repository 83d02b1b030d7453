//! Per-process shared-memory segments in `/dev/shm`.
//!
//! Each process of a channel creates one segment (`O_CREAT|O_EXCL`, mode 0600: mad-core's
//! [`SegmentFile`]) holding its doorbell and one incoming ring per peer:
//!
//! ```text
//! 0      magic "MADSHM01" (u64) | version u32 | ranks u32 | ring capacity u64 | pid u32
//! 64     proof of the session secret (32 bytes, HMAC over the segment name)
//! 128    doorbell: u32 futex word every writer bumps when this process sleeps
//! 256    doorbell sleepers (u32; top bit: the readiness descriptor is armed)
//! 4096   ring of rank 0: header block (4096) + data (capacity)
//! ...    ring of rank 1, ...
//! ```
//!
//! The name is `mad-shm-<pid>-<channel hash>-<rank>-<random>`; the pid lets a later open
//! sweep segments whose creator died before unlinking them.

use std::sync::atomic::AtomicU32;

use mad_core::hostmem::{self, Bell, SegmentFile};
use mad_core::{Error, Result};

use crate::ring::{layout, RingView};

/// Directory of POSIX shared memory.
pub const SHM_DIR: &str = hostmem::SHM_DIR;
/// Prefix of every segment this driver creates.
pub const PREFIX: &str = "mad-shm-";
const MAGIC: u64 = u64::from_le_bytes(*b"MADSHM01");
const VERSION: u32 = 6;
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
#[derive(Debug)]
pub struct Segment {
    file: SegmentFile,
    n: usize,
    cap: usize,
}

impl Segment {
    /// Create this process's segment `name` (fails if it exists), mode 0600, its space
    /// reserved in `/dev/shm` (`Resource` if it does not fit: `host_ranks` and `advice` go
    /// into the message), and write its header.
    ///
    /// # Errors
    ///
    /// [`Error::Resource`] when `/dev/shm` has no room;
    /// [`Error::Io`] when the file cannot be created or mapped;
    /// [`Error::BadConfig`] when `n` rings of `cap` bytes overflow.
    pub fn create(
        name: &str,
        n: usize,
        cap: usize,
        proof: &[u8; PROOF_LEN],
        host_ranks: usize,
        advice: &str,
    ) -> Result<Self> {
        let size = segment_size(n, cap)
            .ok_or_else(|| Error::BadConfig(format!("shm: {n} rings of {cap} B overflow")))?;
        let file = SegmentFile::create(name, size, "shm", host_ranks, advice)?;
        let mut h = Vec::with_capacity(64);
        h.extend_from_slice(&MAGIC.to_le_bytes());
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(n as u32).to_le_bytes());
        h.extend_from_slice(&(cap as u64).to_le_bytes());
        h.extend_from_slice(&std::process::id().to_le_bytes());
        let r = file.region();
        r.write(0, &h)
            .and_then(|_| r.write(OFF_PROOF, proof))
            .ok_or_else(|| Error::Resource("shm: segment smaller than its header".into()))?;
        Ok(Segment { file, n, cap })
    }

    /// Map a peer's segment and check its header (size, magic, geometry, creator pid, proof).
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when the file or its header does not match
    /// (size, magic, geometry, pid); [`Error::Auth`] when the proof of the
    /// session secret is wrong; [`Error::Io`] when it cannot be opened or
    /// mapped.
    pub fn open(
        name: &str,
        rank: usize,
        n: usize,
        cap: usize,
        pid: u32,
        check_proof: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Self> {
        let want = segment_size(n, cap).unwrap_or(usize::MAX);
        let file = SegmentFile::open(name, PREFIX, rank, want, "shm")?;
        let mut h = [0u8; OFF_PROOF + PROOF_LEN];
        file.region()
            .read(0, &mut h)
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
        Ok(Segment { file, n, cap })
    }

    /// Remove the file (the mappings stay valid). Idempotent.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the file cannot be removed (other than already
    /// gone).
    pub fn unlink(&mut self) -> Result<()> {
        self.file.unlink()
    }

    /// The incoming ring written by rank `from`.
    pub fn ring(&self, from: usize) -> Option<RingView> {
        if from >= self.n {
            return None;
        }
        RingView::new(
            self.file.region().clone(),
            ring_base(from, self.cap),
            self.cap,
        )
    }

    /// The doorbell futex word.
    pub fn bell(&self) -> &AtomicU32 {
        self.file
            .region()
            .u32_at(OFF_BELL)
            .unwrap_or_else(|| unreachable!("segment header checked at map time"))
    }

    /// Number of threads asleep on the doorbell.
    pub fn bell_sleepers(&self) -> &AtomicU32 {
        self.file
            .region()
            .u32_at(OFF_BELL_SLEEPERS)
            .unwrap_or_else(|| unreachable!("segment header checked at map time"))
    }

    /// The doorbell: this process's futex word and its sleeper count. Writers
    /// [`notify`](Bell::notify) it after publishing; readers [`sleep`](Bell::sleep) on it.
    pub fn doorbell(&self) -> Bell<'_> {
        Bell::new(self.bell(), self.bell_sleepers())
    }
}
