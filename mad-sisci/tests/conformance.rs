//! The mad-core conformance kit over `sisci:local`: 2, 4 and 8 ranks (threads of this
//! process, real shared mappings), adaptive / block / poll progress, with and without the
//! `dma` TM, and with tiny geometries that force wrap-around and back-pressure everywhere.

#![cfg(not(miri))]

use mad_core::conformance::{run_threads, KitOptions};
use mad_core::hostmem::segment::segments_created_by;
use mad_core::Session;
use mad_sisci::SisciDriver;

/// Tests of this binary run as parallel threads of one process, so "no segment of this process
/// is left" only holds while no other test is between creating and unlinking its segments:
/// kits hold this lock shared, the leftover check holds it exclusively.
static SEGMENTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn kit(ranks: usize, spec: &str) {
    let running = SEGMENTS.read().unwrap_or_else(|e| e.into_inner());
    let ran = run_threads(ranks, KitOptions::new(spec), |b| {
        Session::builder()
            .driver(SisciDriver::new())
            .bootstrap(b)
            .build()
    })
    .unwrap_or_else(|e| panic!("{spec} x{ranks}: conformance failed:\n{e}"));
    eprintln!("{spec} x{ranks}: {} cases passed", ran.len());
    drop(running);
    let _checking = SEGMENTS.write().unwrap_or_else(|e| e.into_inner());
    let left = segments_created_by(mad_sisci::segment::PREFIX, &[std::process::id()]);
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
