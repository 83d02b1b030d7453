//! Driver-level tests of the event-loop contract over the in-process `mem` driver (`buf=64`,
//! `frames=2`: TM 0 fills after two frames). The bodies are the kit's
//! (`mad_core::conformance::readiness`).

#![cfg(not(miri))]

use mad_core::conformance::readiness::{self, Rig};
use mad_core::mem::MemDriver;
use mad_core::ChannelConfig;

fn rig() -> Rig {
    Rig::new(
        MemDriver,
        ChannelConfig::new("t", "mem")
            .option("buf", "64")
            .option("frames", "2"),
    )
}

#[test]
fn arm_send_on_full_pipe_fires_when_the_reader_drains() {
    readiness::arm_send_on_full_ring_fires_when_the_reader_drains(&rig());
}

#[test]
fn shutdown_wakes_blocked_waits_and_peers_see_a_clean_close() {
    readiness::shutdown_wakes_blocked_waits_promptly(&rig());
}

#[test]
fn departed_peer_then_quiet() {
    readiness::departed_peer_then_quiet(&rig(), 3);
}
