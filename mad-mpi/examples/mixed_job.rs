//! One MPI job, three drivers: the `MpiBootstrap` bootstraps a session that opens a TCP, a
//! shared-memory and an MPI channel, and runs the core conformance kit over each.
//!
//! ```text
//! MPICC=mpicc.mpich CARGO_TARGET_DIR=target-mpich cargo build -p mad-mpi --example mixed_job
//! mpiexec.mpich -n 2 target-mpich/debug/examples/mixed_job
//! ```
//!
//! `MAD_KIT_CASES` restricts the cases (every case but `peer_closes` by default: a dead peer
//! ends an MPI job). The job fails (exit status 1) when it was not started by an MPI launcher,
//! when it has fewer than 2 ranks, and when a channel ran fewer cases than were selected; rank 0
//! prints one line per channel, `mixed_job: `<spec>` over the MPI bootstrap: N cases passed`,
//! which `.ci/mpi.sh` checks.

use mad_core::cli::Cli;
use mad_core::conformance::{case_names, run_rank, KitOptions};
use mad_core::{Error, Result, Session};
use mad_mpi::{MpiBootstrap, MpiDriver};

fn run() -> Result<()> {
    let Some(bs) = MpiBootstrap::from_env()? else {
        return Err(Error::BadConfig(
            "no MPI launcher detected: start me with mpiexec/mpirun/srun and at least 2 ranks \
             (e.g. mpiexec.mpich -n 2 mixed_job)"
                .into(),
        ));
    };
    let session = Session::builder()
        .driver(mad_tcp::TcpDriver::new())
        .driver(mad_shm::ShmDriver::new())
        .driver(MpiDriver::new())
        .bootstrap(Box::new(bs))
        .build()?;
    if session.size() < 2 {
        return Err(Error::BadConfig(format!(
            "the MPI job has {} rank: the kit needs at least 2 (mpiexec -n 2 or more)",
            session.size()
        )));
    }
    for spec in ["tcp", "shm", "mpi"] {
        let mut opts = KitOptions::new(spec);
        if opts.cases.is_none() {
            opts.cases = Some(
                case_names()
                    .into_iter()
                    .filter(|n| *n != "peer_closes")
                    .map(String::from)
                    .collect(),
            );
        }
        let selected = opts.cases.as_ref().map_or(0, Vec::len);
        let ran = run_rank(&session, &opts)?;
        if ran.is_empty() || ran.len() != selected {
            return Err(Error::BadConfig(format!(
                "`{spec}`: {} of {selected} selected kit cases ran (MAD_KIT_CASES names an \
                 unknown case?)",
                ran.len()
            )));
        }
        if session.rank() == 0 {
            println!(
                "mixed_job: `{spec}` over the MPI bootstrap: {} cases passed",
                ran.len()
            );
        }
    }
    Ok(())
}

/// The command line: `--help` and `--version` only.
const CLI: Cli = Cli::new(
    "mixed_job",
    env!("CARGO_PKG_VERSION"),
    "usage: mpiexec -n N mixed_job        (N >= 2)

One MPI job, three drivers: the conformance kit over a tcp, a shm and an mpi channel of a
session bootstrapped by MPI. MAD_KIT_CASES restricts the cases.

  -h, --help     this text
  -V, --version  the version",
);

fn main() {
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            CLI.other(arg)?;
        }
        Ok(())
    });
    if let Err(e) = run() {
        eprintln!("mixed_job failed: {e}");
        std::process::exit(1);
    }
}
