//! One MPI job, three drivers: the `MpiBootstrap` bootstraps a session that opens a TCP, a
//! shared-memory and an MPI channel, and runs the core conformance kit over each.
//!
//! ```text
//! MPICC=mpicc.mpich CARGO_TARGET_DIR=target-mpich cargo build -p mad-mpi --example mixed_job
//! mpiexec.mpich -n 2 target-mpich/debug/examples/mixed_job
//! ```
//!
//! `MAD_KIT_CASES` restricts the cases (every case but `peer_closes` by default: a dead peer
//! ends an MPI job).

use mad_core::conformance::{case_names, run_rank, KitOptions};
use mad_core::{Result, Session};
use mad_mpi::{MpiBootstrap, MpiDriver};

fn run() -> Result<()> {
    let Some(bs) = MpiBootstrap::from_env()? else {
        println!("mixed_job: start me with mpiexec/mpirun");
        return Ok(());
    };
    let session = Session::builder()
        .driver(mad_tcp::TcpDriver::new())
        .driver(mad_shm::ShmDriver::new())
        .driver(MpiDriver::new())
        .bootstrap(Box::new(bs))
        .build()?;
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
        let ran = run_rank(&session, &opts)?;
        if session.rank() == 0 {
            println!(
                "mixed_job: `{spec}` over the MPI bootstrap: {} cases passed",
                ran.len()
            );
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("mixed_job failed: {e}");
        std::process::exit(1);
    }
}
