//! A channel open that fails on one process must fail on the others, promptly, naming it and
//! carrying its error; an open that a process never joins fails at the open deadline naming
//! it. Real processes under `madrun`, real drivers, a real `EMFILE`.
//!
//! The test re-executes this binary under madrun, and under MPICH's `mpiexec` (a PMI process
//! manager: the session's bootstrap is then the PMI one, no MPI in the program): the test
//! `child_role` does nothing unless `OPEN_FAILURE_CHILD` is set, in which case it plays the
//! role named there. `.ci/slurm.sh` runs the same roles under `srun`.

#![cfg(all(feature = "tcp", feature = "shm", feature = "via"))]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mad_core::{ChannelConfig, Error, Session};

const MADRUN: &str = env!("CARGO_BIN_EXE_madrun");

/// Bound on a rank's open in the children, and on a whole job here (a hang detector, not a
/// speed requirement).
const LIMIT: Duration = Duration::from_secs(20);

/// What starts the ranks.
#[derive(Clone, Copy, Debug)]
enum Launcher {
    Madrun,
    /// MPICH's Hydra `mpiexec`, a PMI-1 server.
    Hydra,
}

/// Run `role` on `n` ranks with `env` added; returns (success, stdout, stderr). Output lines
/// are prefixed with `[rank] ` by both launchers.
fn job_with(
    launcher: Launcher,
    role: &str,
    n: usize,
    env: &[(&str, &str)],
) -> (bool, String, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match launcher {
        Launcher::Madrun => {
            let mut c = Command::new(MADRUN);
            c.args(["-n", &n.to_string(), "--timeout", "40", "--"]);
            c
        }
        Launcher::Hydra => {
            let mut c = Command::new("mpiexec.mpich");
            c.args(["-prepend-rank", "-n", &n.to_string()]);
            c
        }
    };
    let mut child = cmd
        .arg(exe)
        .args(["child_role", "--exact", "--nocapture", "--test-threads=1"])
        .env("OPEN_FAILURE_CHILD", role)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn madrun");
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.success(),
        t_out.join().unwrap(),
        t_err.join().unwrap(),
    )
}

fn emfile_case(spec: &str) {
    emfile_case_under(Launcher::Madrun, spec);
}

fn emfile_case_under(launcher: Launcher, spec: &str) {
    emfile_case_with(launcher, spec, &[]);
}

fn emfile_case_with(launcher: Launcher, spec: &str, env: &[(&str, &str)]) {
    let (ok, out, err) = job_with(launcher, &format!("emfile:{spec}"), 3, env);
    assert!(ok, "{spec}: job failed\nstdout:\n{out}\nstderr:\n{err}");
    for rank in [0, 2] {
        assert!(
            out.contains(&format!("[{rank}] REMOTE-FAILURE-OK")),
            "{spec}: rank {rank}\n{out}\n{err}"
        );
    }
    assert!(out.contains("[1] OWN-FAILURE"), "{out}");
    eprintln!("{out}");
}

#[test]
fn emfile_on_rank_1_fails_rank_0s_tcp_open() {
    emfile_case("tcp");
}

#[test]
fn emfile_on_rank_1_fails_rank_0s_shm_open() {
    emfile_case("shm");
}

#[test]
fn emfile_on_rank_1_fails_rank_0s_via_soft_open() {
    emfile_case("via:soft");
}

/// The PMI bootstrap's abandon, through rank 0's bootstrap server (the default on one host)
/// and over PMI itself, where rank 1's failure reaches the others through the collective
/// they are in.
#[test]
fn under_a_pmi_process_manager_emfile_on_rank_1_fails_rank_0s_tcp_open() {
    emfile_case_under(Launcher::Hydra, "tcp");
    emfile_case_with(Launcher::Hydra, "tcp", &[("MAD_PMI_COLLECTIVES", "pmi")]);
}

#[test]
fn under_a_pmi_process_manager_a_process_that_never_opens_is_named_at_the_open_deadline() {
    absent_case(Launcher::Hydra, &[]);
}

/// Over PMI itself the missing rank cannot be named, nor the barrier cancelled.
#[test]
fn under_a_pmi_process_manager_with_pmi_collectives_a_process_that_never_opens_times_the_open_out()
{
    absent_case(Launcher::Hydra, &[("MAD_PMI_COLLECTIVES", "pmi")]);
}

#[test]
fn a_process_that_never_opens_is_named_at_the_open_deadline() {
    absent_case(Launcher::Madrun, &[]);
}

fn absent_case(launcher: Launcher, env: &[(&str, &str)]) {
    let (ok, out, err) = job_with(launcher, "absent", 3, env);
    assert!(ok, "stdout:\n{out}\nstderr:\n{err}");
    for rank in [0, 1] {
        assert!(
            out.contains(&format!("[{rank}] TIMEOUT-OK")),
            "rank {rank}\n{out}\n{err}"
        );
    }
    eprintln!("{out}");
}

/// Lower this process's open-file limit (soft and hard, so no driver can raise it again) to
/// the lowest free descriptor number: the next descriptor it creates fails with `EMFILE`.
fn exhaust_descriptors() {
    let lowest_free = (0..65536)
        // SAFETY: fcntl(F_GETFD) only queries the descriptor table.
        .find(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1)
        .unwrap();
    let lim = libc::rlimit {
        rlim_cur: lowest_free as libc::rlim_t,
        rlim_max: lowest_free as libc::rlim_t,
    };
    // SAFETY: a valid rlimit structure.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

fn session() -> Session {
    Session::builder()
        .driver(mad_tcp::TcpDriver::new())
        .driver(mad_shm::ShmDriver::new())
        .driver(mad_via::ViaDriver::new())
        .build()
        .expect("session under madrun")
}

fn emfile_role(spec: &str) -> Result<(), String> {
    let s = session();
    let me = s.rank();
    let cfg = ChannelConfig::parse("ex", spec).map_err(|e| e.to_string())?;
    if me == 1 {
        exhaust_descriptors();
        let r = s.open_channel_with(cfg);
        match r {
            Err(e) => println!("\nOWN-FAILURE {e}"),
            Ok(_) => return Err("rank 1 opened despite EMFILE".into()),
        }
    } else {
        let t = Instant::now();
        let r = s.open_channel_with(cfg);
        let took = t.elapsed();
        match r {
            Err(Error::RemoteFailure {
                rank: 1,
                ref message,
                ..
            }) if message.contains("os error 24") || message.contains("Too many open files") => {
                if took > LIMIT {
                    return Err(format!("failed only after {took:?}"));
                }
                println!(
                    "\nREMOTE-FAILURE-OK after {took:?}: {}",
                    r.err().map(|e| e.to_string()).unwrap_or_default()
                )
            }
            Err(e) => return Err(format!("unexpected error after {took:?}: {e:?}")),
            Ok(_) => return Err("opened although rank 1 failed".into()),
        }
    }
    // Stay alive until every rank has reported (a rank that exits early ends the job).
    s.bootstrap()
        .barrier("test/done")
        .map_err(|e| e.to_string())
}

fn absent_role() -> Result<(), String> {
    let s = session();
    // Collectives over PMI cannot name the missing rank, nor cancel the barrier the others
    // timed out in: they leave after the timeout, and the absent rank stays until they have.
    let pmi = s.bootstrap().kind() == "pmi"
        && std::env::var("MAD_PMI_COLLECTIVES").as_deref() == Ok("pmi");
    if pmi && s.rank() == 2 {
        std::thread::sleep(Duration::from_secs(4));
        return Ok(());
    }
    if s.rank() != 2 {
        let cfg =
            ChannelConfig::parse("late", "tcp,open_timeout_ms=1500").map_err(|e| e.to_string())?;
        let t = Instant::now();
        match s.open_channel_with(cfg) {
            Err(e @ Error::CollectiveTimeout { .. }) => {
                let Error::CollectiveTimeout { ref missing, .. } = e else {
                    unreachable!()
                };
                let named = if pmi {
                    missing.is_empty()
                } else {
                    missing == &vec![2]
                };
                if !named || t.elapsed() > LIMIT {
                    return Err(format!("{e} after {:?}", t.elapsed()));
                }
                println!("\nTIMEOUT-OK after {:?}: {e}", t.elapsed());
            }
            other => return Err(format!("{:?}", other.map(drop))),
        }
        if pmi {
            // Every later collective fails at once, saying why.
            return match s.bootstrap().barrier("test/after") {
                Err(e) if e.to_string().contains("unusable after an earlier failure") => Ok(()),
                other => Err(format!("a collective after the timeout: {other:?}")),
            };
        }
    }
    s.bootstrap()
        .barrier("test/done")
        .map_err(|e| e.to_string())
}

#[test]
fn child_role() {
    let Ok(role) = std::env::var("OPEN_FAILURE_CHILD") else {
        return;
    };
    let r = match role.split_once(':') {
        Some(("emfile", spec)) => emfile_role(spec),
        _ if role == "absent" => absent_role(),
        _ => Err(format!("unknown role {role}")),
    };
    if let Err(e) = r {
        println!("\nROLE-FAILED {e}");
        std::process::exit(1);
    }
}
