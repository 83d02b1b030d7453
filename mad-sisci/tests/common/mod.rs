//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::time::Duration;

/// CPU time (user + system) the calling thread has used so far, from
/// `/proc/thread-self/schedstat` (nanoseconds on the CPU), or `/proc/thread-self/stat`
/// (clock ticks of 1/100 s) where scheduler statistics are missing.
pub fn thread_cpu_time() -> Duration {
    if let Ok(s) = std::fs::read_to_string("/proc/thread-self/schedstat") {
        if let Some(ns) = s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
        {
            return Duration::from_nanos(ns);
        }
    }
    let s = std::fs::read_to_string("/proc/thread-self/stat").expect("/proc/thread-self/stat");
    // Fields after the command name (which may contain spaces) start at field 3: utime and
    // stime are fields 14 and 15.
    let rest = &s[s.rfind(')').expect("stat format") + 2..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    Duration::from_millis((f[11] + f[12]) * 10)
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
