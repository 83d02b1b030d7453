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
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| {
                    mad_core::hostmem::creator_pid(mad_sisci::segment::PREFIX, n)
                        .map(|p| pids.contains(&p))
                        .unwrap_or(false)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The conformance kit over `spec` on `ranks` thread ranks of this process (panics with every
/// rank's result if any failed).
pub fn kit_threads(ranks: usize, spec: &str) {
    use mad_core::bootstrap::ThreadBootstrap;
    use mad_core::conformance::{run_rank, KitOptions};
    let opts = KitOptions::new(spec);
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(ranks)
            .into_iter()
            .map(|b| {
                let opts = &opts;
                s.spawn(move || {
                    let session = mad_core::Session::builder()
                        .driver(mad_sisci::SisciDriver::new())
                        .bootstrap(Box::new(b))
                        .build()?;
                    run_rank(&session, opts)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    let mut failed = false;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(Ok(cases)) => eprintln!("{spec} x{ranks} rank {r}: {} cases passed", cases.len()),
            Ok(Err(e)) => {
                failed = true;
                eprintln!("{spec} x{ranks} rank {r}: {e}");
            }
            Err(_) => {
                failed = true;
                eprintln!("{spec} x{ranks} rank {r}: panicked");
            }
        }
    }
    assert!(!failed, "{spec} x{ranks}: conformance failed (see above)");
}
