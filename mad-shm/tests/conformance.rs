//! The mad-core conformance kit over shm: 2, 4 and 8 ranks (threads of this process, real
//! shared mappings), with the default adaptive progress, `progress=block` and `progress=poll`,
//! and with CMA disabled or replaced by the ring fallback.

// Real mappings, futexes and processes: nothing here runs under miri.
#![cfg(not(miri))]

use mad_core::conformance::{run_threads, KitOptions};
use mad_core::hostmem::segment::segments_created_by;
use mad_core::Session;
use mad_shm::ShmDriver;

/// Tests of this binary run as parallel threads of one process, so "no segment of this process
/// is left" only holds while no other test is between creating and unlinking its segments:
/// kits hold this lock shared, the leftover check holds it exclusively.
static SEGMENTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn kit(ranks: usize, spec: &str) {
    let running = SEGMENTS.read().unwrap_or_else(|e| e.into_inner());
    let ran = run_threads(ranks, KitOptions::new(spec), |b| {
        Session::builder()
            .driver(ShmDriver::new())
            .bootstrap(b)
            .build()
    })
    .unwrap_or_else(|e| panic!("{spec} x{ranks}: conformance failed:\n{e}"));
    eprintln!("{spec} x{ranks}: {} cases passed", ran.len());
    drop(running);
    let _checking = SEGMENTS.write().unwrap_or_else(|e| e.into_inner());
    let left = segments_created_by(mad_shm::segment::PREFIX, &[std::process::id()]);
    assert!(left.is_empty(), "leftover segments: {left:?}");
}

#[test]
fn kit_2_adaptive() {
    kit(2, "shm");
}

#[test]
fn kit_2_block() {
    kit(2, "shm,progress=block");
}

#[test]
fn kit_2_small_ring() {
    kit(2, "shm,ring=8192");
}

#[test]
fn kit_2_cma() {
    kit(2, "shm,cma=always");
}

#[test]
fn kit_2_ring_only() {
    kit(2, "shm,cma=off");
}

#[test]
fn kit_2_cma_ring_fallback() {
    kit(2, "shm,cma=ring");
}

#[test]
fn kit_4_adaptive() {
    kit(4, "shm");
}

#[test]
fn kit_4_block_cma() {
    kit(4, "shm,progress=block,cma=always");
}

#[test]
fn kit_8_adaptive() {
    kit(8, "shm");
}

#[test]
fn kit_8_block() {
    kit(8, "shm,progress=block");
}

#[test]
fn kit_8_poll() {
    kit(8, "shm,progress=poll");
}
