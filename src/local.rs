//! Start a small job on this host from inside a program (what `madrun -n N` does, without the
//! output prefixing and signal forwarding), so examples run with a bare `cargo run`.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::launch::mpi_env;
use mad_core::launch::server::BootstrapServer;
use mad_core::{Error, Result};

/// Whether this process already belongs to a launched session: `madrun` (`MAD_BOOTSTRAP`) or an
/// MPI launcher (see [`mad_core::launch::mpi_env`]; a batch script's bare `SLURM_PROCID` is not one, so
/// `cargo run --example pingpong` inside a Slurm allocation still starts its own ranks).
pub fn in_session() -> bool {
    in_session_env(&|k| std::env::var(k).ok())
}

fn in_session_env(env: &dyn Fn(&str) -> Option<String>) -> bool {
    // Malformed launcher variables count as a launch: the session then reports them.
    env("MAD_BOOTSTRAP").is_some() || !matches!(mpi_env::detect(env), Ok(None))
}

/// If this process is not part of a session, run the current executable (with the same
/// arguments) as `n` ranks on this host and return `Some(exit code)`: the worst of the
/// ranks'. Returns `None` when already inside a session: the caller then does its work.
///
/// When one rank fails, the others are killed after a grace period of 2 s.
///
/// # Errors
///
/// [`Error::Io`](mad_core::Error::Io) when the executable cannot be located, a rank cannot be
/// started, the launcher's server cannot listen or the random generator fails.
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
        Box::new(|m| tracing::warn!(target: "madeleine::local", "{m}")),
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
                        tracing::warn!(
                            target: "madeleine::local",
                            "rank {r} exited with status {code}; stopping the others"
                        );
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
            let launched = mpi_env::detect(&env_of(v)).unwrap().is_some();
            assert_eq!(in_session_env(&env_of(v)), launched, "{v:?}");
        }
        // Malformed launcher variables: not alone; the session reports them.
        assert!(in_session_env(&env_of(&[
            ("PMI_RANK", "x"),
            ("PMI_SIZE", "2")
        ])));
    }
}
