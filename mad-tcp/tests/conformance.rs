//! The core's conformance kit over the tcp driver: 2 and 4 ranks (threads, real sockets), in
//! every progress mode, every case. Kits run one at a time (a static lock) so that poll-mode
//! ranks do not starve each other on a small machine. (The process-based runs are in the root
//! package's `tests/kit_processes.rs`.)

use std::sync::Mutex;

use mad_core::conformance::{run_threads, KitOptions};
use mad_core::Session;
use mad_tcp::TcpDriver;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn kit(ranks: usize, spec: &str, cases: Option<&[&str]>) {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut opts = KitOptions::new(spec);
    if opts.cases.is_none() {
        opts.cases = cases.map(|c| c.iter().map(|s| s.to_string()).collect());
    }
    let ran = run_threads(ranks, opts, |b| {
        Session::builder()
            .driver(TcpDriver::new())
            .bootstrap(b)
            .build()
    })
    .unwrap_or_else(|e| panic!("conformance over `{spec}` with {ranks} ranks: {e}"));
    assert!(!ran.is_empty());
}

#[test]
fn kit_2_ranks_adaptive() {
    kit(2, "tcp,timeout_ms=60000", None);
}

#[test]
fn kit_2_ranks_poll() {
    kit(2, "tcp,progress=poll,timeout_ms=60000", None);
}

#[test]
fn kit_2_ranks_block() {
    kit(2, "tcp,progress=block,timeout_ms=60000", None);
}

#[test]
fn kit_4_ranks_adaptive() {
    kit(4, "tcp,timeout_ms=60000", None);
}

#[test]
fn kit_4_ranks_poll() {
    kit(4, "tcp,progress=poll,timeout_ms=60000", None);
}

#[test]
fn kit_4_ranks_block() {
    kit(4, "tcp,progress=block,timeout_ms=60000", None);
}

/// Checked mode with a tiny copy threshold (most pieces through the gather TM).
#[test]
fn kit_2_ranks_checked_small_threshold() {
    kit(2, "tcp,checked=true,tm.small=64,timeout_ms=60000", None);
}
