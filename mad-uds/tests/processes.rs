//! The conformance kit over uds with every rank a separate process: the test starts a
//! bootstrap server (what `madrun` runs) and re-executes its own binary as 3 ranks, which join
//! the job through the `MAD_*` environment.

use std::process::Command;
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::conformance::{run_rank, KitOptions};
use mad_core::launch::server::BootstrapServer;
use mad_core::Session;
use mad_uds::UdsDriver;

const RANKS: usize = 3;

#[test]
fn kit_3_processes() {
    if std::env::var_os("MAD_BOOTSTRAP").is_some() {
        // A rank: the session joins the job from the environment.
        let session = Session::builder().driver(UdsDriver::new()).build().unwrap();
        assert_eq!(session.size(), RANKS);
        let ran = run_rank(&session, &KitOptions::new("uds")).unwrap();
        assert_eq!(ran.len(), mad_core::conformance::case_names().len());
        return;
    }
    let secret = Secret::random().unwrap();
    let server = BootstrapServer::start(
        "127.0.0.1:0".parse().unwrap(),
        RANKS,
        secret.clone(),
        Box::new(|m| eprintln!("{m}")),
    )
    .unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut kids: Vec<_> = (0..RANKS)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "kit_3_processes",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("MAD_RANK", r.to_string())
                .env("MAD_SIZE", RANKS.to_string())
                .env("MAD_BOOTSTRAP", server.advertised_addr().to_string())
                .env("MAD_SECRET", secret.to_hex())
                .env("MAD_LOCAL_SIZE", RANKS.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut codes = vec![None; RANKS];
    while codes.iter().any(Option::is_none) {
        for (r, k) in kids.iter_mut().enumerate() {
            if codes[r].is_none() {
                codes[r] = k.try_wait().unwrap().map(|s| s.code());
            }
        }
        if Instant::now() > deadline {
            kids.iter_mut().for_each(|k| drop(k.kill()));
            panic!("ranks still running after 180 s: {codes:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        codes.iter().all(|c| *c == Some(Some(0))),
        "rank exit codes: {codes:?}"
    );
}
