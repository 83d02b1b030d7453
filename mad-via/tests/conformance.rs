//! The mad-core conformance kit over `via:soft`: 2 and 4 ranks (threads of this process, real
//! TCP sockets between their soft NICs), with default and small static buffers, and with
//! thresholds that send the kit's pieces through all three TMs.

use mad_core::conformance::{run_threads, KitOptions};
use mad_core::Session;
use mad_via::ViaDriver;

/// The kit on `ranks` threads; a failure names every failed rank (the first error of rank 0 is
/// often only the echo of another rank's failure).
fn kit(ranks: usize, spec: &str) {
    let ran = run_threads(ranks, KitOptions::new(spec), |b| {
        Session::builder()
            .driver(ViaDriver::new())
            .bootstrap(b)
            .build()
    })
    .unwrap_or_else(|e| panic!("{spec} x{ranks}:\n{e}"));
    eprintln!("{spec} x{ranks}: {} cases passed", ran.len());
}

#[test]
fn kit_2_soft() {
    kit(2, "via:soft");
}

#[test]
fn kit_2_soft_few_credits() {
    // Two 256 B static buffers: every message runs out of credits and waits for returns.
    kit(2, "via:soft,slots=2,slot_size=256,progress=block");
}

#[test]
fn kit_4_soft() {
    kit(4, "via:soft");
}

#[test]
fn kit_2_soft_all_three_tms() {
    // Small thresholds, so the kit's pieces travel through every TM, the rendezvous included
    // (the default soft table never picks it: NOTES.md, Figure 4).
    kit(2, "via:soft,tm.small=1k,tm.medium=8k");
}
