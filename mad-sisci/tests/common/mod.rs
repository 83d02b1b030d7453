//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::time::Duration;

/// CPU time the calling thread has used so far (the conformance kit's clock).
pub fn thread_cpu_time() -> Duration {
    mad_core::conformance::thread_cpu_time().expect("the thread's CPU clock")
}

/// Deterministic test pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Names of the `/dev/shm` entries of this driver whose creator is one of `pids`.
pub fn segments_of(pids: &[u32]) -> Vec<String> {
    mad_core::hostmem::segment::segments_created_by(mad_sisci::segment::PREFIX, pids)
}

/// The conformance kit over `spec` on `ranks` thread ranks of this process (panics with every
/// failed rank's error).
pub fn kit_threads(ranks: usize, spec: &str) {
    let ran = mad_core::conformance::run_threads(
        ranks,
        mad_core::conformance::KitOptions::new(spec),
        |b| {
            mad_core::Session::builder()
                .driver(mad_sisci::SisciDriver::new())
                .bootstrap(b)
                .build()
        },
    )
    .unwrap_or_else(|e| panic!("{spec} x{ranks}: conformance failed:\n{e}"));
    eprintln!("{spec} x{ranks}: {} cases passed", ran.len());
}
