//! Driver-level tests of the event-loop contract on `via:soft` (threads of one process, the
//! soft NIC's sockets). The bodies are the kit's (`mad_core::conformance::readiness`); the
//! stream bodies send through the medium TM, which waits for the receiver's posted receives.

use mad_core::conformance::readiness::{self, Rig};
use mad_core::ChannelConfig;
use mad_via::{ViaDriver, TM_MEDIUM};

/// The send's events (one-shot registrations, the moved connection) may make a few arms `Busy`.
fn rig() -> Rig {
    Rig::new(
        ViaDriver::new(),
        ChannelConfig::parse("ready", "via:soft").unwrap(),
    )
    .stream_tm(TM_MEDIUM)
    .send_events(3)
}

#[test]
fn arm_send_wakes_when_the_reader_drains() {
    readiness::arm_send_wakes_when_the_reader_drains(&rig(), 2);
}

#[test]
fn shutdown_ends_waits_and_closes_cleanly() {
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

/// The ring body's shutdown. (The ring `arm_send` body does not apply: via's `Incoming::arm`
/// says `Busy` once after the fill, progress since the last arm, which the stream body allows.)
#[test]
fn shutdown_wakes_blocked_waits_promptly() {
    readiness::shutdown_wakes_blocked_waits_promptly(&rig());
}
