//! The conformance kit over real processes started by `madrun`, for every driver that runs on
//! this host. The test binary re-executes itself: `kit_child` (ignored in normal runs) is the
//! rank program, selected with `--ignored --exact kit_child`.

use std::process::Command;
use std::time::{Duration, Instant};

use mad_core::conformance::{run_rank, KitOptions};

fn kit_in_processes(n: usize, spec: &str, extra_env: &[(&str, &str)]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_madrun"));
    cmd.args(["-n", &n.to_string(), "--timeout", "240", "--"]);
    kit_under(cmd, "madrun", n, spec, extra_env);
}

/// The kit in `n` processes started by `launcher` (a command line ending where the rank
/// program goes).
fn kit_under(mut cmd: Command, bootstrap: &str, n: usize, spec: &str, extra_env: &[(&str, &str)]) {
    let exe = std::env::current_exe().unwrap();
    let start = Instant::now();
    cmd.arg(&exe)
        .args([
            "--ignored",
            "--exact",
            "kit_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MAD_KIT_SPEC", spec);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kit over `{spec}` with {n} processes failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );
    // Every rank ran every case, in one session of `n` over the expected bootstrap.
    for r in 0..n {
        assert!(
            stdout.contains(&format!("kit: rank {r} of {n} ({bootstrap}) ran ")),
            "rank {r} did not report:\n{stdout}\n{stderr}"
        );
    }
    // No shared-memory segment of any rank is left behind (names start with
    // `mad-<driver>-<creator pid>-`; the ranks print their pids).
    let pids: Vec<String> = stdout
        .lines()
        .filter_map(|l| l.split(" pid ").nth(1)?.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert_eq!(pids.len(), n, "every rank prints its pid:\n{stdout}");
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|f| {
                    pids.iter().any(|p| {
                        f.starts_with(&format!("mad-shm-{p}-"))
                            || f.starts_with(&format!("mad-sisci-{p}-"))
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "`{spec}` x{n}: segments of the ranks left: {left:?}"
    );
    eprintln!(
        "kit over `{spec}` with {n} processes: {:?}",
        start.elapsed()
    );
    assert!(start.elapsed() < Duration::from_secs(240));
}

#[test]
#[ignore = "rank program of the process kit tests (run through madrun)"]
fn kit_child() {
    let spec = std::env::var("MAD_KIT_SPEC").expect("MAD_KIT_SPEC");
    let session = madeleine::session().unwrap();
    let mut opts = KitOptions::new(&spec);
    opts.volume = 100;
    let ran = run_rank(&session, &opts).unwrap_or_else(|e| panic!("rank {}: {e}", session.rank()));
    println!(
        "kit: rank {} of {} ({}) ran {} cases: {} pid {}",
        session.rank(),
        session.size(),
        session.bootstrap().kind(),
        ran.len(),
        ran.join(","),
        std::process::id()
    );
}

#[test]
fn kit_tcp_2_processes() {
    kit_in_processes(2, "tcp", &[]);
}

/// MPICH's `mpiexec` is a PMI-1 process manager: the session's bootstrap is the PMI one (this
/// test binary has no MPI), its collectives through rank 0's bootstrap server, or over PMI
/// itself. `.ci/slurm.sh` runs the kit under Slurm's `srun --mpi=pmi2` too.
#[test]
fn kit_tcp_and_shm_3_processes_under_a_pmi_process_manager() {
    for (spec, collectives) in [("tcp", "server"), ("shm", "pmi")] {
        let mut cmd = Command::new("mpiexec.mpich");
        cmd.args(["-n", "3"]);
        kit_under(cmd, "pmi", 3, spec, &[("MAD_PMI_COLLECTIVES", collectives)]);
    }
}

#[test]
fn kit_tcp_4_processes() {
    kit_in_processes(4, "tcp", &[]);
}

#[test]
fn kit_tcp_2_processes_checked_64mib() {
    kit_in_processes(
        2,
        "tcp,checked=true",
        &[
            ("MAD_KIT_BIG", "1"),
            ("MAD_KIT_CASES", "sizes,random,figure1"),
        ],
    );
}

#[test]
fn kit_shm_2_processes() {
    kit_in_processes(2, "shm", &[]);
}

#[test]
fn kit_shm_4_processes() {
    kit_in_processes(4, "shm", &[]);
}

#[test]
fn kit_shm_8_processes_oversubscribed() {
    // 8 processes on our 2 cores: the adaptive progress policy must back off.
    kit_in_processes(8, "shm", &[]);
}

#[test]
fn kit_via_soft_2_processes() {
    kit_in_processes(2, "via:soft", &[]);
}

#[test]
fn kit_sisci_local_4_processes() {
    kit_in_processes(4, "sisci:local", &[]);
}

#[test]
fn kit_sisci_local_8_processes_oversubscribed() {
    kit_in_processes(8, "sisci:local", &[]);
}
