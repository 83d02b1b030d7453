//! Start a small job on this host from inside a program (what `madrun -n N` does, without the
//! output prefixing and signal forwarding), so examples run with a bare `cargo run`.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::launch::server::BootstrapServer;
use mad_core::{Error, Result};

/// Whether this process already belongs to a launched session: `madrun` (`MAD_BOOTSTRAP`) or an
/// MPI launcher (see `detect_mpi_launch`; a batch script's bare `SLURM_PROCID` is not one, so
/// `cargo run --example pingpong` inside a Slurm allocation still starts its own ranks).
pub fn in_session() -> bool {
    in_session_env(&|k| std::env::var(k).ok())
}

fn in_session_env(env: &dyn Fn(&str) -> Option<String>) -> bool {
    // Malformed launcher variables count as a launch: the session then reports them.
    env("MAD_BOOTSTRAP").is_some() || !matches!(detect_mpi_launch(env), Ok(None))
}

/// A process started by an MPI launcher, as its environment variables say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MpiLaunch {
    /// Which launcher, for messages.
    pub launcher: &'static str,
    pub rank: usize,
    pub size: usize,
}

fn num(env: &dyn Fn(&str) -> Option<String>, key: &str) -> Result<Option<usize>> {
    match env(key) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::BadConfig(format!(
                "{key}={v}: the MPI launcher variable is not a number"
            ))
        }),
    }
}

/// Which MPI launcher started this process, from environment lookups (a pure function). The
/// same rules as `mad_mpi::launcher::detect` (this crate has no `mad-mpi` without the `mpi`
/// feature; a test of the `mpi` build checks the two agree): Open MPI's
/// `OMPI_COMM_WORLD_RANK/SIZE` first, then `PMI_RANK/PMI_SIZE` (Hydra, or `srun --mpi=pmi2`),
/// then Slurm with PMIx (`SLURM_PROCID` + `SLURM_STEP_NUM_TASKS`/`SLURM_NTASKS` + a
/// `PMI_*`/`PMIX_*` variable). A bare `SLURM_PROCID` (a batch script) is not an MPI launch.
/// Malformed values are `Err(BadConfig)`.
pub(crate) fn detect_mpi_launch(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<MpiLaunch>> {
    let l = |launcher, rank, size| {
        Some(MpiLaunch {
            launcher,
            rank,
            size,
        })
    };
    let found = if let (Some(rank), Some(size)) = (
        num(env, "OMPI_COMM_WORLD_RANK")?,
        num(env, "OMPI_COMM_WORLD_SIZE")?,
    ) {
        l("Open MPI's mpirun", rank, size)
    } else if let (Some(rank), Some(size)) = (num(env, "PMI_RANK")?, num(env, "PMI_SIZE")?) {
        if env("HYDI_CONTROL_FD").is_some() || env("SLURM_STEP_ID").is_none() {
            l("MPICH's mpiexec (Hydra)", rank, size)
        } else {
            l("Slurm's srun", rank, size)
        }
    } else if let Some(rank) = num(env, "SLURM_PROCID")? {
        let pmi = ["PMIX_RANK", "PMI_FD", "PMI_RANK", "PMI_JOBID"]
            .iter()
            .any(|k| env(k).is_some());
        let size = match num(env, "SLURM_STEP_NUM_TASKS")? {
            Some(s) => Some(s),
            None => num(env, "SLURM_NTASKS")?,
        };
        match (pmi, size) {
            (true, Some(size)) => l("Slurm's srun", rank, size),
            _ => None,
        }
    } else {
        None
    };
    if let Some(m) = found {
        if m.size == 0 || m.rank >= m.size {
            return Err(Error::BadConfig(format!(
                "{} says rank {} of {} processes",
                m.launcher, m.rank, m.size
            )));
        }
    }
    Ok(found)
}

/// For a build without the `mpi` feature: `Err(BadConfig)` when an MPI launcher started this
/// process as one of several (each would run its own one-process session, silently); `Ok`
/// alone, under `madrun` (`MAD_BOOTSTRAP` wins), or as a one-process MPI job.
#[cfg_attr(feature = "mpi", allow(dead_code))]
pub(crate) fn refuse_mpi_launch(env: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    if env("MAD_BOOTSTRAP").is_some() {
        return Ok(());
    }
    match detect_mpi_launch(env)? {
        Some(m) if m.size > 1 => Err(Error::BadConfig(format!(
            "this process was started by {} as rank {} of {}, but this build of madeleine has no \
             MPI bootstrap: each of the {} processes would run its own one-process session. \
             Build with `--features mpi` (cargo build --features mpi), or start the job with madrun",
            m.launcher, m.rank, m.size, m.size
        ))),
        _ => Ok(()),
    }
}

/// If this process is not part of a session, run the current executable (with the same
/// arguments) as `n` ranks on this host and return `Some(exit code)`: the worst of the
/// ranks'. Returns `None` when already inside a session: the caller then does its work.
///
/// When one rank fails, the others are killed after a grace period of 2 s.
pub fn run_local_if_alone(n: usize) -> Result<Option<i32>> {
    if in_session() {
        return Ok(None);
    }
    let exe =
        std::env::current_exe().map_err(|e| Error::io("locating the current executable", e))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let secret = Secret::random()?;
    let server = BootstrapServer::start(
        "127.0.0.1:0"
            .parse()
            .map_err(|_| Error::BadConfig("bad bind address".into()))?,
        n,
        secret.clone(),
        Box::new(|m| eprintln!("{m}")),
    )?;
    let mut kids: Vec<Child> = Vec::with_capacity(n);
    for r in 0..n {
        let child = Command::new(&exe)
            .args(&args)
            .env("MAD_RANK", r.to_string())
            .env("MAD_SIZE", n.to_string())
            .env("MAD_BOOTSTRAP", server.advertised_addr().to_string())
            .env("MAD_SECRET", secret.to_hex())
            .env("MAD_LOCAL_SIZE", n.to_string())
            .spawn()
            .map_err(|e| Error::io(format!("starting rank {r} ({})", exe.display()), e))?;
        kids.push(child);
    }
    let mut codes: Vec<Option<i32>> = vec![None; n];
    let mut failed_at: Option<Instant> = None;
    loop {
        for (r, k) in kids.iter_mut().enumerate() {
            if codes[r].is_none() {
                if let Ok(Some(st)) = k.try_wait() {
                    let code = st.code().unwrap_or(128 + 9);
                    if code != 0 && failed_at.is_none() {
                        eprintln!("rank {r} exited with status {code}; stopping the others");
                        failed_at = Some(Instant::now());
                    }
                    codes[r] = Some(code);
                }
            }
        }
        if codes.iter().all(Option::is_some) {
            break;
        }
        if let Some(t) = failed_at {
            if t.elapsed() > Duration::from_secs(2) {
                for (r, k) in kids.iter_mut().enumerate() {
                    if codes[r].is_none() {
                        let _ = k.kill();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Some(
        codes.into_iter().map(|c| c.unwrap_or(1)).max().unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    // Recorded environments (MPICH 4.0.2 Hydra, Open MPI 4.1.4; Slurm as documented).
    const HYDRA: &[(&str, &str)] = &[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("PMI_FD", "8"),
        ("HYDI_CONTROL_FD", "7"),
        ("MPI_LOCALNRANKS", "2"),
    ];
    const OMPI: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("PMIX_RANK", "3"),
    ];
    const SRUN_PMIX: &[(&str, &str)] = &[
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_STEP_NUM_TASKS", "3"),
        ("SLURM_STEP_ID", "0"),
        ("PMIX_RANK", "1"),
    ];
    const SRUN_PMI2: &[(&str, &str)] = &[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_STEP_ID", "0"),
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "4"),
    ];
    const BATCH: &[(&str, &str)] = &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")];
    const ALL: &[&[(&str, &str)]] = &[HYDRA, OMPI, SRUN_PMIX, SRUN_PMI2, BATCH, &[]];

    #[test]
    fn detects_launchers() {
        let d = |v| {
            detect_mpi_launch(&env_of(v))
                .unwrap()
                .map(|m| (m.launcher, m.rank, m.size))
        };
        assert_eq!(d(HYDRA), Some(("MPICH's mpiexec (Hydra)", 1, 2)));
        assert_eq!(d(OMPI), Some(("Open MPI's mpirun", 3, 4)));
        assert_eq!(d(SRUN_PMIX), Some(("Slurm's srun", 1, 3)));
        assert_eq!(d(SRUN_PMI2), Some(("Slurm's srun", 2, 4)));
        assert_eq!(d(BATCH), None);
        assert_eq!(d(&[]), None);
        assert!(detect_mpi_launch(&env_of(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")])).is_err());
        assert!(detect_mpi_launch(&env_of(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")])).is_err());
    }

    #[test]
    fn in_session_rules() {
        assert!(in_session_env(&env_of(HYDRA)));
        assert!(in_session_env(&env_of(OMPI)));
        assert!(in_session_env(&env_of(SRUN_PMIX)));
        assert!(in_session_env(&env_of(&[(
            "MAD_BOOTSTRAP",
            "127.0.0.1:5000"
        )])));
        // A batch script inside a Slurm allocation: `cargo run --example` starts its own ranks.
        assert!(!in_session_env(&env_of(BATCH)));
        assert!(!in_session_env(&env_of(&[])));
        for v in ALL {
            let launched = detect_mpi_launch(&env_of(v)).unwrap().is_some();
            assert_eq!(in_session_env(&env_of(v)), launched, "{v:?}");
        }
        // Malformed launcher variables: not alone; the session reports them.
        assert!(in_session_env(&env_of(&[
            ("PMI_RANK", "x"),
            ("PMI_SIZE", "2")
        ])));
    }

    #[test]
    fn mpi_launch_without_the_mpi_feature_is_refused() {
        for v in [HYDRA, OMPI, SRUN_PMIX, SRUN_PMI2] {
            match refuse_mpi_launch(&env_of(v)) {
                Err(Error::BadConfig(m)) => {
                    assert!(m.contains("--features mpi"), "{m}");
                    assert!(m.contains("rank "), "{m}");
                }
                other => panic!("{v:?}: {other:?}"),
            }
        }
        let e = refuse_mpi_launch(&env_of(HYDRA)).unwrap_err().to_string();
        assert!(e.contains("MPICH's mpiexec (Hydra) as rank 1 of 2"), "{e}");
        assert!(refuse_mpi_launch(&env_of(BATCH)).is_ok());
        assert!(refuse_mpi_launch(&env_of(&[])).is_ok());
        // One-process MPI job: a one-process session is what it asked for.
        assert!(refuse_mpi_launch(&env_of(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")])).is_ok());
        // madrun started under an MPI launcher: madrun's bootstrap wins.
        let mut under = HYDRA.to_vec();
        under.push(("MAD_BOOTSTRAP", "127.0.0.1:5000"));
        assert!(refuse_mpi_launch(&env_of(&under)).is_ok());
    }

    /// The copy here and mad-mpi's detection agree (only in an `mpi` build, which has both).
    #[cfg(feature = "mpi")]
    #[test]
    fn agrees_with_mad_mpi() {
        for v in ALL {
            let ours = detect_mpi_launch(&env_of(v))
                .unwrap()
                .map(|m| (m.rank, m.size));
            let theirs = mad_mpi::launcher::detect(&env_of(v))
                .unwrap()
                .map(|l| (l.rank, l.size));
            assert_eq!(ours, theirs, "{v:?}");
        }
    }
}
