//! Which MPI launcher started this process, read from environment variables (a pure function).
//!
//! | launcher | variables read |
//! |---|---|
//! | Open MPI `mpirun` (ORTE/PRRTE) | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` |
//! | MPICH Hydra `mpiexec` | `PMI_RANK`, `PMI_SIZE` (with `HYDI_CONTROL_FD` or `PMI_FD`, and no Slurm step) |
//! | Slurm `srun` | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`/`SLURM_NTASKS`, with `PMI_*` or `PMIX_*` set by the MPI plugin |
//!
//! Open MPI's own variables win (they are authoritative even inside a Slurm allocation); then
//! `PMI_RANK`/`PMI_SIZE` (Hydra, or `srun --mpi=pmi2`), then Slurm with PMIx (`srun
//! --mpi=pmix`, which sets `PMIX_RANK` but not `PMI_SIZE`) or with no MPI plugin at all (a job
//! step: `SLURM_STEP_ID`). A bare `SLURM_PROCID` without any PMI variable or step is a batch
//! script, not a parallel launch, and is not detected.
//!
//! In `mad-core` because two places need it: `mad-mpi`'s bootstrap (which reads the job from
//! MPI itself and checks it against the launcher's), and a session built without a bootstrap,
//! which refuses to run as one of several processes an MPI launcher started (each would
//! otherwise run its own one-process session, silently).

use crate::{Error, Result};

/// The launcher family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LauncherKind {
    /// Open MPI's `mpirun`/`mpiexec`.
    OpenMpi,
    /// MPICH's Hydra `mpiexec`.
    Hydra,
    /// Slurm's `srun`.
    Slurm,
}

impl LauncherKind {
    /// The launcher's name, for messages ("MPICH's mpiexec (Hydra)").
    pub fn describe(self) -> &'static str {
        match self {
            LauncherKind::OpenMpi => "Open MPI's mpirun",
            LauncherKind::Hydra => "MPICH's mpiexec (Hydra)",
            LauncherKind::Slurm => "Slurm's srun",
        }
    }
}

/// What the launcher says about this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launcher {
    /// Which launcher.
    pub kind: LauncherKind,
    /// This process's rank, as the launcher numbers it.
    pub rank: usize,
    /// The job size the launcher started.
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

fn has(env: &dyn Fn(&str) -> Option<String>, key: &str) -> bool {
    env(key).is_some()
}

/// Detect the launcher from `env` (a lookup such as `|k| std::env::var(k).ok()`).
///
/// `Ok(None)`: no MPI launcher. `Err(BadConfig)`: the variables are there but malformed
/// (non-numeric, rank outside the size, size zero).
///
/// # Errors
///
/// [`Error::BadConfig`] when the variables are there but malformed
/// (non-numeric, rank outside the size, size zero).
pub fn detect(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launcher>> {
    let found = if let (Some(rank), Some(size)) = (
        num(env, "OMPI_COMM_WORLD_RANK")?,
        num(env, "OMPI_COMM_WORLD_SIZE")?,
    ) {
        Some(Launcher {
            kind: LauncherKind::OpenMpi,
            rank,
            size,
        })
    } else if let (Some(rank), Some(size)) = (num(env, "PMI_RANK")?, num(env, "PMI_SIZE")?) {
        let hydra = has(env, "HYDI_CONTROL_FD") || !has(env, "SLURM_STEP_ID");
        Some(Launcher {
            kind: if hydra {
                LauncherKind::Hydra
            } else {
                LauncherKind::Slurm
            },
            rank,
            size,
        })
    } else if let Some(rank) = num(env, "SLURM_PROCID")? {
        // A job step started by srun, with or without an MPI plugin (PMI variables).
        let pmi = [
            "PMIX_RANK",
            "PMI_FD",
            "PMI_RANK",
            "PMI_JOBID",
            "SLURM_STEP_ID",
        ]
        .iter()
        .any(|k| has(env, k));
        let size = match num(env, "SLURM_STEP_NUM_TASKS")? {
            Some(s) => Some(s),
            None => num(env, "SLURM_NTASKS")?,
        };
        match (pmi, size) {
            (true, Some(size)) => Some(Launcher {
                kind: LauncherKind::Slurm,
                rank,
                size,
            }),
            _ => None,
        }
    } else {
        None
    };
    if let Some(l) = found {
        if l.size == 0 || l.rank >= l.size {
            return Err(Error::BadConfig(format!(
                "{} says rank {} of {} processes",
                l.kind.describe(),
                l.rank,
                l.size
            )));
        }
    }
    Ok(found)
}

/// [`detect`] over this process's environment.
///
/// # Errors
///
/// As [`detect`].
pub fn detect_from_env() -> Result<Option<Launcher>> {
    detect(&|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn run(vars: &[(&str, &str)]) -> Result<Option<Launcher>> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect(&move |k| m.get(k).cloned())
    }

    fn l(kind: LauncherKind, rank: usize, size: usize) -> Option<Launcher> {
        Some(Launcher { kind, rank, size })
    }

    #[test]
    fn nothing() {
        assert_eq!(run(&[]).unwrap(), None);
        assert_eq!(run(&[("HOME", "/root")]).unwrap(), None);
    }

    #[test]
    fn hydra() {
        // What `mpiexec.mpich -n 2` sets (observed on Debian 12, MPICH 4.0.2).
        let env = [
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("PMI_FD", "8"),
            ("HYDI_CONTROL_FD", "7"),
            ("MPI_LOCALNRANKS", "2"),
        ];
        assert_eq!(run(&env).unwrap(), l(LauncherKind::Hydra, 1, 2));
    }

    #[test]
    fn open_mpi() {
        // What `mpirun.openmpi -n 4` sets (Open MPI 4.1.4), PMIx variables included.
        let env = [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("PMIX_RANK", "3"),
            ("PMIX_NAMESPACE", "1136525313"),
        ];
        assert_eq!(run(&env).unwrap(), l(LauncherKind::OpenMpi, 3, 4));
        // Open MPI inside a Slurm allocation: its own variables win.
        let env = [
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
        ];
        assert_eq!(run(&env).unwrap(), l(LauncherKind::OpenMpi, 5, 8));
    }

    #[test]
    fn slurm() {
        // srun --mpi=pmi2
        let env = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_ID", "0"),
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("PMI_FD", "5"),
        ];
        assert_eq!(run(&env).unwrap(), l(LauncherKind::Slurm, 2, 4));
        // srun --mpi=pmix: no PMI_SIZE, the step size comes from Slurm.
        let env = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "3"),
            ("SLURM_STEP_ID", "0"),
            ("PMIX_RANK", "1"),
        ];
        assert_eq!(run(&env).unwrap(), l(LauncherKind::Slurm, 1, 3));
        // srun with no MPI plugin (what Slurm 22.05 sets): a parallel launch all the same.
        let env = [
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
        ];
        assert_eq!(run(&env).unwrap(), l(LauncherKind::Slurm, 1, 2));
        // A batch script (no PMI at all, no step) is not an MPI launch.
        let env = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")];
        assert_eq!(run(&env).unwrap(), None);
    }

    #[test]
    fn malformed() {
        assert!(matches!(
            run(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")]),
            Err(Error::BadConfig(_))
        ));
        assert!(matches!(
            run(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")]),
            Err(Error::BadConfig(_))
        ));
        assert!(matches!(
            run(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "0")]),
            Err(Error::BadConfig(_))
        ));
        // Only half of a pair: not a launch.
        assert_eq!(run(&[("PMI_RANK", "0")]).unwrap(), None);
    }
}
