//! Driver-level tests of the event-loop contract over Unix stream sockets between threads. The
//! bodies are the kit's (`mad_core::conformance::readiness`).

use mad_core::conformance::readiness::{self, Rig};
use mad_core::ChannelConfig;
use mad_uds::UdsDriver;

fn rig() -> Rig {
    Rig::new(UdsDriver, ChannelConfig::parse("ready", "uds").unwrap())
}

#[test]
fn arm_send_wakes_when_the_reader_drains() {
    readiness::arm_send_wakes_when_the_reader_drains(&rig(), 2);
}

#[test]
fn shutdown_wakes_and_closes_cleanly() {
    readiness::shutdown_wakes_and_closes_cleanly(&rig(), 3);
}

#[test]
fn shutdown_wakes_a_blocking_gather_receive() {
    readiness::shutdown_wakes_a_blocking_gather_receive(&rig());
}

#[test]
fn departed_peer_then_quiet() {
    readiness::departed_peer_then_quiet(&rig(), 3);
}

/// The ring bodies too: TM 0 (copy) lends until the socket is full.
#[test]
fn arm_send_on_full_copy_tm_fires_when_the_reader_drains() {
    readiness::arm_send_on_full_ring_fires_when_the_reader_drains(&rig());
}

#[test]
fn shutdown_wakes_blocked_waits_promptly() {
    readiness::shutdown_wakes_blocked_waits_promptly(&rig());
}
