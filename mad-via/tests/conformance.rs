//! The mad-core conformance kit over `via:soft`: 2 and 4 ranks (threads of this process, real
//! TCP sockets between their soft NICs), with default and small static buffers, and with
//! thresholds that send the kit's pieces through all three TMs.

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::conformance::{run_rank, KitOptions};
use mad_core::Session;
use mad_via::ViaDriver;

fn kit(ranks: usize, spec: &str) {
    let opts = KitOptions::new(spec);
    // Like `run_threads`, but every rank's outcome is reported (the first error of rank 0 is
    // often only the echo of another rank's failure).
    let results: Vec<Result<Vec<&'static str>, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(ranks)
            .into_iter()
            .map(|b| {
                let opts = &opts;
                s.spawn(move || {
                    let session = Session::builder()
                        .driver(ViaDriver::new())
                        .bootstrap(Box::new(b))
                        .build()
                        .map_err(|e| e.to_string())?;
                    run_rank(&session, opts).map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
            .collect()
    });
    let errors: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.as_ref().err().map(|e| format!("rank {r}: {e}")))
        .collect();
    assert!(errors.is_empty(), "{spec} x{ranks}:\n{}", errors.join("\n"));
    if let Some(Ok(cases)) = results.first() {
        eprintln!("{spec} x{ranks}: {} cases passed", cases.len());
    }
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
