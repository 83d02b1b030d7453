//! Pinning threads to CPUs, for programs that place their communication threads: a media
//! server that keeps its latency-sensitive thread off the cores its bulk transfers saturate,
//! a benchmark that pins each rank (`mad-bench`).
//!
//! CPUs are numbered by their index in the set this process may run on when first asked
//! (`sched_getaffinity` of the process before any pinning), so `pin_current_thread(Some(0))`
//! means "the first CPU I may use", whatever its system number.

#![allow(unsafe_code)]

use std::sync::OnceLock;

use mad_core::{Error, Result};

/// The CPUs this process could run on when first asked (system numbers, before any pinning).
///
/// # Errors
///
/// [`Error::Io`] when `sched_getaffinity` fails.
pub fn allowed_cpus() -> Result<&'static [usize]> {
    static CPUS: OnceLock<Vec<usize>> = OnceLock::new();
    if let Some(v) = CPUS.get() {
        return Ok(v);
    }
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a writable cpu_set_t of the size passed.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(Error::io(
            "sched_getaffinity",
            std::io::Error::last_os_error(),
        ));
    }
    let v: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE, the size of the bit array.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    Ok(CPUS.get_or_init(|| v))
}

/// Number of CPUs this process may use (before any pinning); 1 if that cannot be read.
pub fn cpu_count() -> usize {
    allowed_cpus().map_or(1, |v| v.len().max(1))
}

/// Pin the calling thread (and the threads it creates afterwards) to the `cpu`-th allowed CPU
/// (modulo their number), or back to every allowed CPU with `None`.
///
/// # Errors
///
/// [`Error::Io`] when the allowed CPUs cannot be read or `sched_setaffinity`
/// fails.
pub fn pin_current_thread(cpu: Option<usize>) -> Result<()> {
    let cpus = allowed_cpus()?;
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for (i, &c) in cpus.iter().enumerate() {
        if cpu.is_none_or(|want| want % cpus.len() == i) {
            // SAFETY: `c` came from CPU_ISSET over 0..CPU_SETSIZE, so it is in range.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(Error::io(
            format!("sched_setaffinity({cpu:?})"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_and_unpin() {
        let n = cpu_count();
        assert!(n >= 1);
        std::thread::spawn(move || {
            pin_current_thread(Some(n - 1)).unwrap();
            pin_current_thread(Some(n + 3)).unwrap(); // modulo
            pin_current_thread(None).unwrap();
        })
        .join()
        .unwrap();
    }
}
