//! The mad-core conformance kit over `sisci:local`: 2, 4 and 8 ranks (threads of this
//! process, real shared mappings), adaptive / block / poll progress, with and without the
//! `dma` TM, and with tiny geometries that force wrap-around and back-pressure everywhere.

#![cfg(not(miri))]

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::conformance::{run_rank, KitOptions};
use mad_core::Session;
use mad_sisci::SisciDriver;

/// Tests of this binary run as parallel threads of one process, so "no segment of this process
/// is left" only holds while no other test is between creating and unlinking its segments:
/// kits hold this lock shared, the leftover check holds it exclusively.
static SEGMENTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn kit(ranks: usize, spec: &str) {
    let opts = KitOptions::new(spec);
    let running = SEGMENTS.read().unwrap_or_else(|e| e.into_inner());
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(ranks)
            .into_iter()
            .map(|b| {
                let opts = &opts;
                s.spawn(move || {
                    let session = Session::builder()
                        .driver(SisciDriver::new())
                        .bootstrap(Box::new(b))
                        .build()?;
                    run_rank(&session, opts)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    let mut failed = false;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(Ok(cases)) => eprintln!("{spec} x{ranks} rank {r}: {} cases passed", cases.len()),
            Ok(Err(e)) => {
                failed = true;
                eprintln!("{spec} x{ranks} rank {r}: {e}");
            }
            Err(_) => {
                failed = true;
                eprintln!("{spec} x{ranks} rank {r}: panicked");
            }
        }
    }
    assert!(!failed, "{spec} x{ranks}: conformance failed (see above)");
    drop(running);
    let _checking = SEGMENTS.write().unwrap_or_else(|e| e.into_inner());
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&format!("mad-sisci-{}-", std::process::id())))
        .collect();
    assert!(left.is_empty(), "leftover segments: {left:?}");
}

#[test]
fn kit_2_adaptive() {
    kit(2, "sisci:local");
}

#[test]
fn kit_2_block() {
    kit(2, "sisci:local,progress=block");
}

#[test]
fn kit_2_tiny_geometry() {
    kit(2, "sisci:local,slots=2,ring=4096,chunk=4096,chunks=1");
}

#[test]
fn kit_2_dma_off() {
    kit(2, "sisci:local,dma=off,ring=8192");
}

#[test]
fn kit_4_adaptive() {
    kit(4, "sisci");
}

#[test]
fn kit_4_block_small() {
    kit(4, "sisci:local,progress=block,slots=4,chunks=2");
}

#[test]
fn kit_8_adaptive() {
    kit(8, "sisci:local");
}

#[test]
fn kit_8_block() {
    kit(8, "sisci:local,progress=block");
}

#[test]
fn kit_8_poll() {
    kit(8, "sisci:local,progress=poll");
}
