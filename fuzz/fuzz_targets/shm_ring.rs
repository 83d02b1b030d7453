//! The shm ring's control words (`mad_shm::ring::index`): head and tail are written by the
//! peer process into shared memory, so any pair of values must give a run inside the data area
//! or `None`, never an out-of-bounds offset, an overflow or a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_shm::ring::index::{data_run, free_run, split, used, valid_cap};

fuzz_target!(|data: &[u8]| {
    if data.len() < 17 {
        return;
    }
    let head = u64::from_le_bytes(data[0..8].try_into().unwrap());
    let tail = u64::from_le_bytes(data[8..16].try_into().unwrap());
    // Capacities the driver accepts: powers of two from 4 KiB (valid_cap is checked at setup).
    let cap = 1u64 << (12 + (data[16] % 40));
    assert!(valid_cap(cap as usize));
    if let Some(u) = used(head, tail, cap) {
        assert!(u <= cap);
    }
    if let Some((off, len)) = free_run(head, tail, cap) {
        assert!((off as u64) < cap && off as u64 + len as u64 <= cap);
    }
    if let Some((off, len)) = data_run(head, tail, cap) {
        assert!((off as u64) < cap && off as u64 + len as u64 <= cap);
        let ((a, al), (b, bl)) = split(tail, len, cap);
        assert!(a as u64 + al as u64 <= cap && b as u64 + bl as u64 <= cap);
        assert_eq!(al + bl, len);
    }
});
