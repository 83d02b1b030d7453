//! Start a small job on this host from inside a program (what `madrun -n N` does, without the
//! output prefixing and signal forwarding), so examples run with a bare `cargo run`.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::launch::server::BootstrapServer;
use mad_core::{Error, Result};

/// Whether this process already belongs to a launched session (madrun or an MPI launcher).
pub fn in_session() -> bool {
    const VARS: [&str; 5] = [
        "MAD_BOOTSTRAP",
        "PMI_RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMIX_RANK",
        "SLURM_PROCID",
    ];
    VARS.iter().any(|v| std::env::var_os(v).is_some())
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
