//! Segment files in `/dev/shm`: created `O_CREAT|O_EXCL` with mode 0600, mapped by every local
//! peer, unlinked by the creator once all have mapped it; named
//! `<driver prefix><creator pid>-<channel hash>-<rank>-<random>` so that a later open can sweep
//! the files of creators that died before unlinking them. What is inside (header, proof of the
//! session secret, rings or areas) is the driver's business.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::sys::{self, Mapping};
use super::{PeerWatch, Region};
use crate::bootstrap::Bootstrap;
use crate::{Error, Result};

/// Directory of POSIX shared memory.
pub const SHM_DIR: &str = "/dev/shm";

/// FNV-1a, 64 bits: the channel-name hash in segment names (not a security measure: the
/// segments are authenticated by an HMAC of the session secret in their header).
pub fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A fresh segment name for `rank` of channel `channel`: `<prefix><pid>-<hash>-<rank>-<random>`.
///
/// # Errors
///
/// [`Error::Io`] when the random generator fails.
pub fn segment_name(prefix: &str, channel: &str, rank: usize) -> Result<String> {
    let mut rnd = [0u8; 8];
    crate::auth::fill_random(&mut rnd)?;
    Ok(format!(
        "{prefix}{}-{:08x}-{rank}-{:016x}",
        std::process::id(),
        fnv1a(channel.as_bytes()) as u32,
        u64::from_le_bytes(rnd)
    ))
}

/// The creator pid encoded in a segment name with this `prefix`, if it is one.
pub fn creator_pid(prefix: &str, name: &str) -> Option<u32> {
    name.strip_prefix(prefix)?.split('-').next()?.parse().ok()
}

/// The entries of [`SHM_DIR`] named with `prefix`: (name, creator pid). Empty when the
/// directory cannot be read.
fn segments_named(prefix: &str) -> Vec<(String, u32)> {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let pid = creator_pid(prefix, &name)?;
            Some((name, pid))
        })
        .collect()
}

/// The segments named with `prefix` that one of the processes `pids` created and that still
/// exist: what a test checks to prove a driver cleaned up after itself.
pub fn segments_created_by(prefix: &str, pids: &[u32]) -> Vec<String> {
    segments_named(prefix)
        .into_iter()
        .filter(|(_, pid)| pids.contains(pid))
        .map(|(name, _)| name)
        .collect()
}

/// Remove the segments named with `prefix` whose creator process is gone (left behind by a
/// crash between create and unlink). Only that prefix is swept, never other files. Returns
/// how many were removed; errors are ignored (another process may be sweeping too).
pub fn sweep_stale(prefix: &str) -> usize {
    segments_named(prefix)
        .into_iter()
        .filter(|(name, pid)| {
            !sys::pid_alive(*pid) && std::fs::remove_file(Path::new(SHM_DIR).join(name)).is_ok()
        })
        .count()
}

/// The error of a segment that does not fit in [`SHM_DIR`].
fn no_space(driver: &str, size: usize, host_ranks: usize, advice: &str) -> Error {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let all = (size as u64).saturating_mul(host_ranks.max(1) as u64);
    let free = match sys::fs_space(Path::new(SHM_DIR)) {
        Some((free, total)) => format!(
            "{free} B ({:.1} MiB) free of {total} B ({:.1} MiB)",
            mib(free),
            mib(total)
        ),
        None => "free space unknown".into(),
    };
    Error::Resource(format!(
        "{driver}: {SHM_DIR} is too small: this rank's segment needs {size} B ({:.1} MiB), \
         about {all} B ({:.1} MiB) for the {host_ranks} rank(s) on this host; {free}. Enlarge \
         {SHM_DIR} (Docker: --shm-size=1g; elsewhere: mount -o remount,size=... {SHM_DIR}) or \
         use fewer ranks per host{advice}",
        mib(size as u64),
        mib(all),
    ))
}

/// A local peer as [`map_peers`] returns it.
#[derive(Debug)]
pub struct MappedPeer<I, S> {
    /// What it announced, decoded.
    pub info: I,
    /// Its segment, mapped and checked.
    pub seg: Arc<S>,
    /// Its process, watched from the open on.
    pub watch: Arc<PeerWatch>,
}

/// The exchange every intra-host driver's open starts with: allgather this rank's segment
/// announcement under `tag`, then, for every other rank on this host, `map(rank, bytes)`
/// decodes its announcement, checks it (fingerprints, geometry, the proof of the session
/// secret in its header) and maps its segment, returning the decoded announcement, the
/// segment and the peer's pid, for every rank of `local` (this host's ranks the channel
/// connects: [`OpenContext::local_ranks`](crate::driver::OpenContext::local_ranks)). Returns
/// one entry per rank (`None` for this rank and the ranks not in `local`).
///
/// Each peer's process is watched ([`PeerWatch::open`]) right after its segment is mapped,
/// while it is known alive (it waits for this rank in the driver's next collective): a peer
/// that exits right after the open is then reported dead later instead of making this open
/// fail. The driver must therefore run at least one more collective before returning (the
/// one after which every creator unlinks its file).
///
/// # Errors
///
/// The bootstrap's errors; the first error of `map` ([`Error::Protocol`]
/// for a peer's announcement that does not check out, [`Error::Resource`]
/// or [`Error::Io`] for a segment that cannot be mapped);
/// [`Error::Io`] when a peer's process cannot be watched.
pub fn map_peers<I, S>(
    b: &dyn Bootstrap,
    local: &[usize],
    tag: &str,
    announce: &[u8],
    driver: &str,
    mut map: impl FnMut(usize, &[u8]) -> Result<(I, S, u32)>,
) -> Result<Vec<Option<MappedPeer<I, S>>>> {
    let (me, n) = (b.rank(), b.size());
    let all = b.allgather(tag, announce)?;
    if all.len() != n {
        return Err(Error::protocol(
            me,
            format!("{driver}: allgather returned the wrong number of entries"),
        ));
    }
    let mut peers: Vec<Option<MappedPeer<I, S>>> = (0..n).map(|_| None).collect();
    for &r in local {
        if r == me || r >= n {
            continue;
        }
        let (info, seg, pid) = map(r, &all[r])?;
        let watch = PeerWatch::open(pid).map_err(|_| Error::PeerClosed { rank: r })?;
        peers[r] = Some(MappedPeer {
            info,
            seg: Arc::new(seg),
            watch: Arc::new(watch),
        });
    }
    Ok(peers)
}

/// A mapped segment file: this process's own (created, removed on drop until
/// [`unlink`](Self::unlink)ed) or a peer's (opened).
#[derive(Debug)]
pub struct SegmentFile {
    region: Region,
    path: PathBuf,
    unlink_pending: bool,
}

fn map(file: &File, path: &Path, driver: &str) -> Result<Region> {
    let m = Mapping::map(file)
        .map_err(|e| Error::Resource(format!("{driver}: mapping {}: {e}", path.display())))?;
    Ok(Region::from_mapping(Arc::new(m)))
}

impl SegmentFile {
    /// Create `name` in [`SHM_DIR`] (fails if it exists), mode 0600, `size` bytes of zeros
    /// whose pages are allocated now, and map it. `driver` prefixes error messages.
    ///
    /// The space is reserved at creation ([`sys::reserve`]): a sparse file would be mapped
    /// fine and fail later, as a `SIGBUS` at the first store into a page the file system can
    /// no longer supply (a full `/dev/shm`: Docker's default is 64 MiB). Without the space the
    /// call fails with [`Error::Resource`] naming the directory, the bytes needed (`size`, and
    /// `host_ranks` × `size` for every rank of this host), the bytes free, and `advice` (what
    /// else to shrink, e.g. a driver option); nothing is left behind.
    ///
    /// # Errors
    ///
    /// [`Error::Resource`] when `/dev/shm` has no room for `size` bytes
    /// (the message says how much is free, for `host_ranks` ranks, with `advice`);
    /// [`Error::Io`] when the file cannot be created (it exists, permissions).
    pub fn create(
        name: &str,
        size: usize,
        driver: &str,
        host_ranks: usize,
        advice: &str,
    ) -> Result<Self> {
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(format!("{driver}: creating {}", path.display()), e))?;
        let mut seg = SegmentFile {
            region: Region::heap(0),
            path,
            unlink_pending: true,
        };
        // Dropping `seg` on an error removes the file.
        sys::reserve(&file, size as u64).map_err(|e| match e.kind() {
            std::io::ErrorKind::StorageFull | std::io::ErrorKind::FileTooLarge => {
                no_space(driver, size, host_ranks, advice)
            }
            _ => Error::io(
                format!("{driver}: reserving {size} B for {}", seg.path.display()),
                e,
            ),
        })?;
        file.set_len(size as u64).map_err(|e| {
            Error::Resource(format!(
                "{driver}: sizing {} to {size} B: {e}",
                seg.path.display()
            ))
        })?;
        seg.region = map(&file, &seg.path, driver)?;
        Ok(seg)
    }

    /// Map rank `rank`'s segment `name`, which must carry `prefix` and be exactly `size`
    /// bytes long (`Protocol` errors otherwise: the name and size come from the peer).
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when `name` does not carry `prefix` or the file
    /// is not `size` bytes; [`Error::Io`] or
    /// [`Error::Resource`] when it cannot be opened or mapped.
    pub fn open(name: &str, prefix: &str, rank: usize, size: usize, driver: &str) -> Result<Self> {
        if name.contains('/') || !name.starts_with(prefix) {
            return Err(Error::protocol(
                rank,
                format!("{driver}: bad segment name `{name}`"),
            ));
        }
        let path = Path::new(SHM_DIR).join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                Error::io(
                    format!("{driver}: opening rank {rank}'s {}", path.display()),
                    e,
                )
            })?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(format!("{driver}: stat {}", path.display()), e))?
            .len();
        if len != size as u64 {
            return Err(Error::protocol(
                rank,
                format!("{driver}: segment is {len} B, expected {size} B"),
            ));
        }
        Ok(SegmentFile {
            region: map(&file, &path, driver)?,
            path,
            unlink_pending: false,
        })
    }

    /// The mapped memory.
    #[inline]
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Remove the file of a created segment (the mappings stay valid). Idempotent; nothing
    /// for an opened one.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the file cannot be removed (other than already gone).
    pub fn unlink(&mut self) -> Result<()> {
        if self.unlink_pending {
            self.unlink_pending = false;
            std::fs::remove_file(&self.path)
                .map_err(|e| Error::io(format!("unlinking {}", self.path.display()), e))?;
        }
        Ok(())
    }
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        if self.unlink_pending {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
