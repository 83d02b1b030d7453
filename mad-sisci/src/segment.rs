//! The `local` backend's exported segments: one per process in `/dev/shm`, created
//! `O_CREAT|O_EXCL` mode 0600, mapped by every peer, unlinked by its creator once every peer
//! has mapped it (mad-core's [`SegmentFile`], the discipline mad-shm follows too). The header
//! ([`write_header`], [`check_header`]) is the same on `dolphin`, written into a SISCI
//! segment.

use std::sync::atomic::AtomicU32;

use mad_core::hostmem::{self, Bell, Region, SegmentFile};
use mad_core::{Error, Result};

use crate::layout::{hdr, Geometry, MAGIC, VERSION};

/// Directory of POSIX shared memory.
pub const SHM_DIR: &str = hostmem::SHM_DIR;
/// Prefix of every segment this driver creates: `mad-sisci-<pid>-...`.
pub const PREFIX: &str = "mad-sisci-";
/// Length of the secret proof in the header.
pub const PROOF_LEN: usize = 32;

/// One mapped segment (this process's, or a peer's).
#[derive(Debug)]
pub struct Segment {
    file: SegmentFile,
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

/// Write a segment header into `r` (any backend): magic, geometry of `n` areas, `pid` (the
/// creator's on `local`, 0 on `dolphin`) and the proof of the session secret.
///
/// # Errors
///
/// [`Error::Resource`] when the region is smaller than the header.
pub fn write_header(
    r: &Region,
    n: usize,
    geom: &Geometry,
    pid: u32,
    proof: &[u8; PROOF_LEN],
) -> Result<()> {
    let mut h = Vec::with_capacity(80);
    h.extend_from_slice(&MAGIC.to_le_bytes());
    for w in geom_words(n, geom, pid) {
        h.extend_from_slice(&w.to_le_bytes());
    }
    r.write(0, &h)
        .and_then(|_| r.write(hdr::PROOF, proof))
        .ok_or_else(|| Error::Resource("sisci: segment smaller than its header".into()))
}

/// Check the header of rank `rank`'s segment in `r` (any backend): magic, geometry of `n`
/// areas, `pid`, and the proof (`check_proof`). Errors are `Protocol` or `Auth`.
///
/// # Errors
///
/// [`Error::Protocol`] when the magic, the geometry or the pid differ;
/// [`Error::Auth`] when the proof of the session secret is wrong.
pub fn check_header(
    r: &Region,
    rank: usize,
    n: usize,
    geom: &Geometry,
    pid: u32,
    check_proof: &dyn Fn(&[u8]) -> bool,
) -> Result<()> {
    let mut h = [0u8; hdr::PROOF + PROOF_LEN];
    r.read(0, &mut h)
        .ok_or_else(|| Error::protocol(rank, "sisci: segment too small"))?;
    let word = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&h[8 * i..8 * i + 8]);
        u64::from_le_bytes(a)
    };
    if word(0) != MAGIC {
        return Err(Error::protocol(rank, "sisci: segment header: bad magic"));
    }
    let expect = geom_words(n, geom, pid);
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
    Ok(())
}

impl Segment {
    /// Create this process's segment `name` (fails if it exists), its space reserved in
    /// `/dev/shm` (`Resource` if it does not fit: `host_ranks` and `advice` go into the
    /// message), and write its header.
    ///
    /// # Errors
    ///
    /// [`Error::Resource`] when `/dev/shm` has no room;
    /// [`Error::Io`] when the file cannot be created or mapped;
    /// [`Error::BadConfig`] when the geometry overflows.
    pub fn create(
        name: &str,
        n: usize,
        geom: Geometry,
        proof: &[u8; PROOF_LEN],
        host_ranks: usize,
        advice: &str,
    ) -> Result<Self> {
        let size = geom
            .segment_size(n)
            .ok_or_else(|| Error::BadConfig(format!("sisci: {n} areas of {geom:?} overflow")))?;
        let file = SegmentFile::create(name, size, "sisci", host_ranks, advice)?;
        write_header(file.region(), n, &geom, std::process::id(), proof)?;
        Ok(Segment { file, geom, n })
    }

    /// Map rank `rank`'s segment and check its header (size, magic, geometry, pid, proof).
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when the file or its header does not match;
    /// [`Error::Auth`] for a wrong proof; [`Error::Io`]
    /// when it cannot be opened or mapped.
    pub fn open(
        name: &str,
        rank: usize,
        n: usize,
        geom: Geometry,
        pid: u32,
        check_proof: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Self> {
        let want = geom.segment_size(n).unwrap_or(usize::MAX);
        let file = SegmentFile::open(name, PREFIX, rank, want, "sisci")?;
        check_header(file.region(), rank, n, &geom, pid, check_proof)?;
        Ok(Segment { file, geom, n })
    }

    /// Remove the file (mappings stay valid). Idempotent.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the file cannot be removed (other than already
    /// gone).
    pub fn unlink(&mut self) -> Result<()> {
        self.file.unlink()
    }

    /// The area rank `r` writes into.
    pub fn area(&self, r: usize) -> Option<Region> {
        if r >= self.n {
            return None;
        }
        self.file
            .region()
            .sub(self.geom.area_off(r)?, self.geom.area_size()?)
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        self.file
            .region()
            .u32_at(off)
            .unwrap_or_else(|| unreachable!("header size checked at map time"))
    }

    /// The doorbell: this process's futex word and its sleeper count. Writers
    /// [`notify`](Bell::notify) it after publishing; readers [`sleep`](Bell::sleep) on it.
    pub fn doorbell(&self) -> Bell<'_> {
        Bell::new(self.word(hdr::BELL), self.word(hdr::BELL_SLEEPERS))
    }
}
