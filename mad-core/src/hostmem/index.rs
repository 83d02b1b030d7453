//! Index arithmetic of single-producer single-consumer byte rings over monotonic `u64`
//! offsets (a write offset `head`, a read offset `tail`, a power-of-two capacity): free of
//! memory accesses and syscalls, so it is tested under miri and fuzzed (`fuzz/`, target
//! `shm_ring`). Both offsets may come from a corrupt or hostile peer: every function that
//! takes them returns `None` on values no honest peer could publish.
//!
//! mad-shm's rings and mad-sisci's ring TM use it; the same check bounds sisci's slot and
//! chunk acknowledgements.

/// Bytes in the ring, or `None` if the offsets are impossible (a corrupt or hostile peer):
/// `tail` ahead of `head`, or more than `cap` bytes in flight.
#[inline]
pub fn used(head: u64, tail: u64, cap: u64) -> Option<u64> {
    let u = head.checked_sub(tail)?;
    (u <= cap).then_some(u)
}

/// The contiguous free run at the write position: `(offset in data area, length)`.
#[inline]
pub fn free_run(head: u64, tail: u64, cap: u64) -> Option<(usize, usize)> {
    let free = cap - used(head, tail, cap)?;
    let pos = head & (cap - 1);
    Some((pos as usize, free.min(cap - pos) as usize))
}

/// The contiguous readable run at the read position: `(offset in data area, length)`.
#[inline]
pub fn data_run(head: u64, tail: u64, cap: u64) -> Option<(usize, usize)> {
    let avail = used(head, tail, cap)?;
    let pos = tail & (cap - 1);
    Some((pos as usize, avail.min(cap - pos) as usize))
}

/// Split `len` bytes starting at ring offset `at` into the (at most two) runs of the data
/// area they occupy: `((off, len), (off, len))`, the second possibly empty.
#[inline]
pub fn split(at: u64, len: usize, cap: u64) -> ((usize, usize), (usize, usize)) {
    let pos = (at & (cap - 1)) as usize;
    let first = len.min(cap as usize - pos);
    ((pos, first), (0, len - first))
}

/// Where a writer that jumps from `at` to the start of the ring's next lap resumes: `at`
/// rounded up to a multiple of `cap` (`at` itself on a lap boundary); `None` on overflow.
/// A writer does it, at a message boundary with the ring empty, to keep short messages in the
/// first bytes of the data area, which stay in both processors' caches; the reader learns the
/// jump from the position the writer publishes beside its head.
#[inline]
pub fn next_lap(at: u64, cap: u64) -> Option<u64> {
    at.checked_add(cap - 1).map(|x| x & !(cap - 1))
}

/// Whether `cap` is a usable ring capacity (a power of two, at least 4 KiB).
pub fn valid_cap(cap: usize) -> bool {
    cap.is_power_of_two() && cap >= 4096
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_index_arithmetic() {
        let cap = 4096;
        assert_eq!(used(10, 4, cap), Some(6));
        assert_eq!(used(4, 10, cap), None);
        assert_eq!(used(5000, 0, cap), None);
        assert_eq!(free_run(0, 0, cap), Some((0, 4096)));
        assert_eq!(free_run(4000, 100, cap), Some((4000, 96)));
        assert_eq!(free_run(4196, 4000, cap), Some((100, 3900)));
        assert_eq!(data_run(4196, 4000, cap), Some((4000, 96)));
        assert_eq!(data_run(u64::MAX - 5, u64::MAX - 10, cap), Some((4085, 5)));
        assert_eq!(split(4090, 10, cap), ((4090, 6), (0, 4)));
        assert_eq!(split(4090, 6, cap), ((4090, 6), (0, 0)));
        assert_eq!(next_lap(4096, cap), Some(4096));
        assert_eq!(next_lap(4097, cap), Some(8192));
        assert_eq!(next_lap(0, cap), Some(0));
        assert_eq!(next_lap(u64::MAX - 5, cap), None);
        assert!(valid_cap(4096));
        assert!(!valid_cap(3000));
        assert!(!valid_cap(2048));
    }
}
