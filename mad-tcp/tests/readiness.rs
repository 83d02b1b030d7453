//! Driver-level tests of the event-loop contract: the readiness descriptor of a send armed with
//! `TxLink::arm_send`, `Incoming::shutdown` (clean close, blocked waits wake up), a departed
//! peer, with few peers (`poll(2)`) and many (the any-source waits use the epoll set). The
//! shared bodies are the kit's (`mad_core::conformance::readiness`); the epoll set's
//! membership is tcp's own.

mod common;

use std::io::IoSlice;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use common::*;
use mad_core::conformance::readiness::{self, Rig};
use mad_core::driver::{Armed, LinkPair, OpenedChannel};
use mad_core::ChannelConfig;
use mad_tcp::TcpDriver;

fn cfg(name: &str) -> ChannelConfig {
    ChannelConfig::parse(name, "tcp:127.0.0.1,connect_timeout_ms=10000").unwrap()
}

fn rig(name: &str) -> Rig {
    Rig::new(TcpDriver::new(), cfg(name))
}

fn take(ch: &mut OpenedChannel, r: usize) -> LinkPair {
    ch.links[r].take().expect("link to peer")
}

/// Whether `fd` is readable within `t`.
fn readable(fd: RawFd, t: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, t.as_millis() as libc::c_int) };
    r > 0
}

#[test]
fn arm_send_few_peers() {
    readiness::arm_send_wakes_when_the_reader_drains(&rig("armsend"), 2);
}

#[test]
fn arm_send_many_peers_epoll() {
    readiness::arm_send_wakes_when_the_reader_drains(&rig("armsend"), 6);
}

#[test]
fn shutdown_few_peers() {
    readiness::shutdown_wakes_and_closes_cleanly(&rig("shutdown"), 3);
}

#[test]
fn shutdown_many_peers_epoll() {
    readiness::shutdown_wakes_and_closes_cleanly(&rig("shutdown"), 6);
}

#[test]
fn shutdown_wakes_a_blocking_gather_receive() {
    readiness::shutdown_wakes_a_blocking_gather_receive(&rig("blockclose"));
}

#[test]
fn departed_peer_few_peers() {
    readiness::departed_peer_then_quiet(&rig("departed"), 3);
}

#[test]
fn departed_peer_many_peers_epoll() {
    readiness::departed_peer_then_quiet(&rig("departed"), 6);
}

/// Descriptors in the epoll set `fd`, as the kernel lists them (the `tfd:` lines of its
/// fdinfo).
fn watched(fd: RawFd) -> usize {
    std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .expect("fdinfo of the readiness descriptor")
        .lines()
        .filter(|l| l.starts_with("tfd:"))
        .count()
}

/// The peers' sockets are in the readiness descriptor's set only between an `Armed` arm and
/// its disarm (a watched socket costs the kernel a callback per incoming segment), counted by
/// the kernel, with nested arms; an armed descriptor fires for a message. With more than 4
/// peers the any-source waits use the set, which then holds them for good (`pinned`).
fn sockets_watched_only_while_armed(ranks: usize, pinned: bool) {
    let mut chans = open_group(ranks, cfg("disarm"));
    let mut b = take(&mut chans[1], 0);
    let _a = take(&mut chans[0], 1);
    let inc = &chans[0].incoming;
    let fd = inc
        .readiness_fd()
        .expect("tcp has a readiness descriptor")
        .as_raw_fd();
    // The wake-up socket, and the peers' sockets when they are in.
    let (out, all) = (if pinned { ranks } else { 1 }, ranks);
    assert_eq!(watched(fd), out, "before any arm");
    assert_eq!(inc.arm().unwrap(), Armed::Armed, "idle channel");
    assert_eq!(watched(fd), all, "armed: every peer's socket is watched");
    // Two arms (two event loops), one disarm: still watched.
    assert_eq!(inc.arm().unwrap(), Armed::Armed, "idle channel");
    inc.disarm();
    assert_eq!(watched(fd), all, "one arm is left");
    // A message wakes the armed descriptor.
    let body = vec![5u8; 64 << 10];
    b.tx.begin_message().unwrap();
    drive(|| b.tx.send_refs(1, &[IoSlice::new(&body)])).unwrap();
    drive(|| b.tx.end_message()).unwrap();
    assert!(
        readable(fd, Duration::from_secs(5)),
        "an armed descriptor stayed quiet"
    );
    inc.disarm();
    assert_eq!(watched(fd), out, "every arm was disarmed");
    // An arm that finds the message there says `Busy` and leaves nothing to disarm.
    assert_eq!(inc.arm().unwrap(), Armed::Busy, "the message is there");
    assert_eq!(watched(fd), out, "a busy arm took the sockets out again");
}

#[test]
fn sockets_watched_only_while_armed_few_peers() {
    sockets_watched_only_while_armed(3, false);
}

#[test]
fn sockets_watched_for_good_many_peers_epoll() {
    sockets_watched_only_while_armed(6, true);
}

/// The ring bodies too: TM 0 (copy) lends until the socket is full.
#[test]
fn arm_send_on_full_copy_tm_fires_when_the_reader_drains() {
    readiness::arm_send_on_full_ring_fires_when_the_reader_drains(&rig("ring"));
}

#[test]
fn shutdown_wakes_blocked_waits_promptly() {
    readiness::shutdown_wakes_blocked_waits_promptly(&rig("ring"));
}
