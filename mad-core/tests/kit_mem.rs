//! The conformance kit over the in-process `mem` driver: the engine's own end-to-end test.
//! The mem driver is strict (it checks that copy buffers and gather groups have the same shape
//! on both sides), so these runs check the switch, the BMMs and commit/checkout symmetry.

use mad_core::bootstrap::Bootstrap;
use mad_core::conformance::{run_threads, KitOptions};
use mad_core::mem::MemDriver;
use mad_core::{Result, Session};

fn build(b: Box<dyn Bootstrap>) -> Result<Session> {
    Session::builder().driver(MemDriver).bootstrap(b).build()
}

#[test]
fn kit_mem_2_ranks() {
    let ran = run_threads(2, KitOptions::new("mem"), build).unwrap();
    assert_eq!(ran.len(), mad_core::conformance::case_names().len());
}

#[test]
fn kit_mem_4_ranks_small_buffers_and_backpressure() {
    // 64-byte frames and 2 frames per direction: every piece is split, and senders hit
    // back-pressure constantly.
    run_threads(
        4,
        KitOptions::new("mem,buf=64,frames=2,copy_max=300"),
        build,
    )
    .unwrap();
}

#[test]
fn kit_mem_block_and_poll_modes() {
    let mut o = KitOptions::new("mem,progress=block");
    o.cases = Some(vec![
        "figure1".into(),
        "any_source".into(),
        "threads".into(),
    ]);
    run_threads(3, o, build).unwrap();
    let mut o = KitOptions::new("mem,progress=poll");
    o.cases = Some(vec!["random".into(), "in_flight".into()]);
    run_threads(2, o, build).unwrap();
}
