//! Driver-level tests of the event-loop contract (`sisci:local`: threads of one process, real
//! `/dev/shm` mappings and sockets). The bodies are the kit's
//! (`mad_core::conformance::readiness`).

#![cfg(not(miri))]

use mad_core::config::ChannelConfig;
use mad_core::conformance::readiness::{self, Rig};
use mad_sisci::SisciDriver;

/// `sisci:local` with two short slots and no `dma` TM: TM 0 fills after two lends.
fn rig() -> Rig {
    Rig::new(
        SisciDriver::new(),
        ChannelConfig::new("t", "sisci")
            .adapter("local")
            .option("slots", "2")
            .option("ring", "4096")
            .option("dma", "off"),
    )
}

#[test]
fn arm_send_on_full_slots_fires_when_the_reader_drains() {
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
