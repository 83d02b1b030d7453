//! Driver-level tests of the event-loop contract (threads of one process, real `/dev/shm`
//! mappings and sockets). The bodies are the kit's (`mad_core::conformance::readiness`).

#![cfg(not(miri))]

mod common;

use common::*;
use mad_core::conformance::readiness::{self, Rig};
use mad_shm::ShmDriver;

/// A 4096-byte ring and no CMA: TM 0 fills after a few lends.
fn rig() -> Rig {
    Rig::new(
        ShmDriver::new(),
        config(&[("cma", "off"), ("ring", "4096")]),
    )
}

#[test]
fn arm_send_on_full_ring_fires_when_the_reader_drains() {
    let _shared = opening();
    readiness::arm_send_on_full_ring_fires_when_the_reader_drains(&rig());
}

#[test]
fn shutdown_wakes_blocked_waits_and_peers_see_a_clean_close() {
    let _shared = opening();
    readiness::shutdown_wakes_blocked_waits_promptly(&rig());
}

#[test]
fn departed_peer_then_quiet() {
    let _shared = opening();
    readiness::departed_peer_then_quiet(&rig(), 3);
}
