//! Job start as a rank sees it: from `main` to a session (the bootstrap), to the default
//! channel (its open is a collective over the bootstrap), and to the first message from rank 0.
//! Every rank prints one line; `.ci/slurm.sh` compares the slowest rank under `srun` and under
//! `madrun`.
//!
//! ```text
//! madrun -n 4 target/release/examples/startup
//! srun --mpi=pmi2 -n 4 target/release/examples/startup
//! ```

use std::time::Instant;

use madeleine::cli::Cli;

const CLI: Cli = Cli::new(
    "startup",
    env!("CARGO_PKG_VERSION"),
    "usage: madrun -n N startup
       srun --mpi=pmi2 -n N startup

Job start as a rank sees it: every rank prints the time from main to its session, to the open
default channel and to the first message from rank 0.

  -h, --help     this text
  -V, --version  the version",
);

fn main() {
    let t0 = Instant::now();
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            CLI.other(arg)?;
        }
        Ok(())
    });
    madeleine::init_logging();
    if let Err(e) = run(t0) {
        eprintln!("startup: {e}");
        std::process::exit(1);
    }
}

fn run(t0: Instant) -> madeleine::Result<()> {
    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;
    let session = madeleine::session()?;
    let t_session = Instant::now();
    let ch = session.open_channel("default")?;
    let t_channel = Instant::now();
    if session.rank() == 0 {
        for peer in 1..session.size() {
            let mut p = ch.begin_packing(peer)?;
            p.pack_value(&1u8, madeleine::RecvMode::Express)?;
            p.end_packing()?;
        }
    } else {
        let mut u = ch.begin_unpacking()?;
        let _: u8 = u.unpack_value()?;
        u.end_unpacking()?;
    }
    let t_first = Instant::now();
    println!(
        "startup: rank {} of {} ({}): session {:.1} ms, channel `{}` {:.1} ms, first message {:.1} ms",
        session.rank(),
        session.size(),
        session.bootstrap().kind(),
        ms(t_session),
        ch.config().driver,
        ms(t_channel),
        ms(t_first)
    );
    Ok(())
}
