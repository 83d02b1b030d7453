//! Real processes: the test binary re-executes itself as ranks, joined through mad-core's
//! madrun bootstrap server (started in the test process).
//!
//! * the conformance kit over 2 and 3 processes, then no segment of any child left in
//!   `/dev/shm`;
//! * peer death, in the shapes every driver shares (`mad_core::conformance::death`): a
//!   sender killed mid-message, a sender blocked on a killed receiver, a send to a peer that
//!   died while idle, an any-source receiver whose peer died without closing (no destructor
//!   ran) sleeping while it waits for another peer, an armed readiness descriptor woken by a
//!   peer's death (its pidfd);
//! * Cross Memory Attach forbidden by a seccomp filter installed in each child before its
//!   channel opens: the selection table names the ring fallback and messages of several MiB
//!   arrive intact;
//! * short-lived receivers: rank 0 sends 100 KiB (through CMA, then the ring) to each of 23 ranks, which
//!   check it and exit at once; no delivered message may be reported lost to the sender.

// Real mappings, futexes and processes: nothing here runs under miri.
#![cfg(not(miri))]
#![deny(unsafe_code)]

mod common;

use std::time::Duration;

use mad_core::bootstrap::Bootstrap;
use mad_core::conformance::death;
use mad_core::conformance::jobs::{self, Launch};
use mad_core::{RecvMode, Result, SendMode, Session};
use mad_shm::ShmDriver;

fn session(b: Box<dyn Bootstrap>) -> Result<Session> {
    Session::builder()
        .driver(ShmDriver::new())
        .bootstrap(b)
        .build()
}

/// Ranks are this test binary's `rank_program`; none may leave a segment in `/dev/shm`.
const LAUNCH: Launch = Launch::new(
    "rank_program",
    "MAD_SHM_TEST_ROLE",
    "MAD_SHM_TEST_SPEC",
    session,
)
.with_leftovers(common::segments_of);

fn open(session: &Session, spec: &str) -> mad_core::Channel {
    session
        .open_channel_with(mad_core::ChannelConfig::parse("procs", spec).unwrap())
        .unwrap()
}

/// Sizes of the big-message exchange (several MiB, not multiples of the ring).
const BIG: [usize; 3] = [3 << 20, (5 << 20) + 4093, 1 << 20];

/// Rank 0 sends every size of [`BIG`] to rank 1, which sends it back; both check the bytes.
fn big_exchange(session: &Session, ch: &mad_core::Channel) {
    for (i, &len) in BIG.iter().enumerate() {
        let seed = i as u8;
        if session.rank() == 0 {
            let out = common::pattern(len, seed);
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_value(&(len as u64), RecvMode::Express).unwrap();
            p.pack(&out, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            let mut u = ch.begin_unpacking_from(1).unwrap();
            let n: u64 = u.unpack_value().unwrap();
            let mut back = vec![0u8; n as usize];
            u.unpack(&mut back, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(back == out, "{len} B came back altered");
        } else {
            let mut u = ch.begin_unpacking_from(0).unwrap();
            let n: u64 = u.unpack_value().unwrap();
            let mut got = vec![0u8; n as usize];
            u.unpack(&mut got, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(got == common::pattern(len, seed), "{len} B arrived altered");
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_value(&n, RecvMode::Express).unwrap();
            p.pack(&got, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
    }
}

/// The rank program (does nothing unless started by [`spawn`]).
#[test]
#[ignore = "rank program of the process tests"]
fn rank_program() {
    let Some((role, spec)) = LAUNCH.role() else {
        return;
    };
    if let Some(block) = role.strip_prefix("no-cma-") {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        {
            use common::sys::{forbid_cma, CmaBlock};
            let block = match block {
                "all" => Some(CmaBlock::All),
                "others" => Some(CmaBlock::OtherProcesses),
                _ => None, // "none": this rank may use CMA, its peer may not
            };
            // Before anything of the driver runs (its CMA self-check is cached).
            if let Some(block) = block {
                forbid_cma(block).expect("installing the seccomp filter");
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let _ = block;
    }
    let session = LAUNCH.child_session();
    let rank = session.rank();
    if death::rank_role(&session, &role, &spec) {
        return;
    }
    match role.as_str() {
        "kit" => jobs::kit_role(&session, &spec),
        "quick-receiver" => {
            let ch = open(&session, &spec);
            let mut u = ch.begin_unpacking_from(0).unwrap();
            let n: u64 = u.unpack_value().unwrap();
            // Let the sender go to sleep on its completion word before the copy (the
            // window of the race: woken by the completion, it looked at the peer first).
            std::thread::sleep(Duration::from_millis(2));
            let mut body = vec![0u8; n as usize];
            u.unpack(&mut body, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(body == quick_body(rank), "rank {rank}: message altered");
            println!("quick-receiver: rank {rank} received intact");
            // Exit at once: odd ranks without closing anything (only the pidfd tells),
            // even ranks through the destructors (reader-closed flag, then exit).
            if rank % 2 == 1 {
                std::process::exit(0);
            }
        }
        r if r.starts_with("all-to-all:") => {
            let (size, rounds) = jobs::all_to_all_role(r).expect("all-to-all:<size>:<rounds>");
            jobs::all_to_all(&session, &spec, size, rounds);
        }
        r if r.starts_with("no-cma-") => {
            let ch = open(&session, &spec);
            let table = ch.selection_table();
            big_exchange(&session, &ch);
            println!("no-cma: rank {rank} exchanged {BIG:?} intact\n{table}");
        }
        r => panic!("unknown role {r}"),
    }
}

#[test]
fn kit_2_processes() {
    LAUNCH.kit_processes(2, "shm");
}

#[test]
fn kit_3_processes_small_ring() {
    LAUNCH.kit_processes(3, "shm,ring=8192");
}

#[test]
fn kit_2_processes_cma() {
    LAUNCH.kit_processes(2, "shm,cma=always");
}

/// An any-source receiver whose peer died (no destructor ran) sleeps while it waits for
/// another peer: before the fix, the dead peer kept `ShmIncoming::wait` returning at once for
/// the rest of the channel's life.
#[test]
fn any_source_sleeps_after_a_peer_died() {
    for spec in ["shm", "shm,progress=block"] {
        death::any_source_sleeps_after_a_peer_died(&LAUNCH, spec);
    }
}

/// A peer that dies without closing (only its pidfd, in rank 0's epoll set, tells) wakes an
/// armed readiness descriptor.
#[test]
fn armed_descriptor_fires_when_a_peer_dies() {
    death::armed_descriptor_fires_when_a_peer_dies(&LAUNCH, "shm");
}

/// The first send to a peer that died while this rank was idle fails: before `begin_message`
/// probed the peer, 16 384 sends in a row returned `Ok` (the ring had room) and were lost.
#[test]
fn send_to_a_peer_that_died_while_idle_fails() {
    death::send_to_a_peer_that_died_while_idle_fails(&LAUNCH, "shm");
}

/// A sender killed in the middle of a message fails the receiver's unpack with `PeerClosed`
/// (ring and CMA).
#[test]
fn killed_sender_mid_message_gives_peer_closed() {
    for spec in ["shm,cma=off", "shm,cma=always"] {
        death::killed_sender_mid_message(&LAUNCH, spec);
    }
}

/// A sender blocked on a receiver that never reads fails with `PeerClosed` once the receiver
/// is killed.
#[test]
fn sender_blocked_on_killed_receiver_gives_peer_closed() {
    for spec in ["shm", "shm,ring=8192"] {
        death::sender_blocked_on_killed_receiver(&LAUNCH, spec);
    }
}

/// Cross Memory Attach refused by seccomp in both ranks (children), installed before their
/// channel opens. `block` says which calls fail; `expect` is the line the selection table must
/// carry.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn cma_forbidden(block: &str, expect: &[&str]) {
    cma_forbidden_in(&[block, block], expect)
}

/// As [`cma_forbidden`], each rank with its own `blocks[r]` (`none`: no filter).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn cma_forbidden_in(blocks: &[&str], expect: &[&str]) {
    let roles: Vec<String> = blocks.iter().map(|b| format!("no-cma-{b}")).collect();
    let role = roles.join("+");
    let (kids, _) = LAUNCH.job(
        &roles.iter().map(|r| Some(r.as_str())).collect::<Vec<_>>(),
        "shm,cma=always",
    );
    let outs = LAUNCH.finish(kids, &role);
    for (r, out) in outs.iter().enumerate() {
        eprintln!("{role}: rank {r}:\n{out}");
        assert!(
            out.contains(&format!("no-cma: rank {r} exchanged")),
            "{role}: rank {r} did not finish:\n{out}"
        );
        for line in expect {
            assert!(
                out.contains(line),
                "{role}: rank {r}: no `{line}` in\n{out}"
            );
        }
    }
}

/// Every `process_vm_readv` fails (even on itself): the driver's self-check sees it, the
/// vote at open fails and the `cma` TM's groups are streamed through the ring.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[test]
fn cma_forbidden_everywhere_streams_through_the_ring() {
    cma_forbidden(
        "all",
        &[
            "CMA not permitted between every pair of ranks",
            "`cma` pieces are streamed through the ring",
        ],
    );
}

/// CMA refused to one rank only (rank 0 under a seccomp profile, rank 1 free): both ranks
/// still build the same table, the vote falls back for everyone, messages arrive intact
/// (before, rank 0 left the `cma` TM out of its table and the open failed with `BadConfig`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[test]
fn cma_forbidden_to_one_rank_falls_back_for_all() {
    cma_forbidden_in(
        &["all", "none"],
        &["`cma` pieces are streamed through the ring"],
    );
}

/// Only reads of another process fail (as under Yama `ptrace_scope`): the self-check passes,
/// the `cma` TM stays in the table, the probe of the peer fails with `EPERM` and the `cma`
/// groups are streamed through the ring.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[test]
fn cma_forbidden_between_processes_streams_through_the_ring() {
    cma_forbidden(
        "others",
        &[
            "cma",
            "CMA not permitted between every pair of ranks",
            "Operation not permitted",
            "`cma` pieces are streamed through the ring",
        ],
    );
}

/// The body rank 0 sends to `rank` in [`delivered_messages_are_not_reported_lost`]: 100 KiB,
/// above the ring threshold of `cma=always` (the `cma` TM: the sender waits for the receiver's
/// completion); with `cma=off` it streams through the ring.
fn quick_body(rank: usize) -> Vec<u8> {
    common::pattern(100 << 10, rank as u8)
}

/// Rank 0 (this process) sends 100 KiB to each of `RANKS - 1` receivers, which check it and
/// exit at once. Every `end_packing` must succeed: each message was delivered. Before the fix
/// the sender read the CMA completion counter, then saw the receiver closed or dead, and
/// reported `PeerClosed` without reading the counter again (13 of 20 runs failed with 50 ranks;
/// this test, 5 rounds of 24 ranks, failed in 6 runs of 6 on the unfixed code).
#[test]
fn delivered_messages_are_not_reported_lost() {
    const RANKS: usize = 24;
    for round in 0..5 {
        // CMA (the path of the original defect) in rounds 0, 2, 4; the ring in 1 and 3.
        let spec = if round % 2 == 0 {
            "shm,cma=always"
        } else {
            "shm,cma=off"
        };
        let mut roles = vec![Some("quick-receiver"); RANKS];
        roles[0] = None;
        let (kids, me) = LAUNCH.job(&roles, spec);
        let session = me.unwrap();
        let ch = open(&session, spec);
        // Four busy threads keep both cores taken, as the other ranks of a crowded host do:
        // the woken sender then waits for a core while the receiver exits.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hogs: Vec<_> = (0..4)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let mut lost = Vec::new();
        for r in 1..RANKS {
            let body = quick_body(r);
            let res = ch.begin_packing(r).and_then(|mut p| {
                p.pack_value(&(body.len() as u64), RecvMode::Express)?;
                p.pack(&body, RecvMode::Cheaper)?;
                p.end_packing()
            });
            if let Err(e) = res {
                lost.push(format!("rank {r}: {e}"));
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for h in hogs {
            let _ = h.join();
        }
        let outs = LAUNCH.finish(kids, "quick receivers");
        for (i, out) in outs.iter().enumerate() {
            let r = i + 1;
            assert!(
                out.contains(&format!("quick-receiver: rank {r} received intact")),
                "round {round}: rank {r} did not receive its message:\n{out}"
            );
        }
        assert!(
            lost.is_empty(),
            "round {round}: delivered messages reported lost by the sender: {lost:?}"
        );
    }
}

/// Set in the process that runs [`full_dev_shm_job`] inside its private mount namespace.
const IN_NS: &str = "MAD_SHM_TEST_SMALL_DEV_SHM";

/// 20 ranks, 10 rounds of 32 KiB all-to-all, 256 KiB rings, on a 64 MiB `/dev/shm` (Docker's
/// default): the segments need 20 × 5.2 MiB. Before the fix they were sparse, the open
/// succeeded and ranks died of `SIGBUS` once the rings' pages could no longer be supplied;
/// now the space is reserved at open and the ranks that do not fit fail their open with
/// `Resource` naming `/dev/shm`. Runs in a private mount namespace (root; skipped otherwise).
#[test]
fn full_dev_shm_is_a_resource_error_not_sigbus() {
    let Some(out) = jobs::in_small_dev_shm("64m", "full_dev_shm_job", (IN_NS, "1")) else {
        return;
    };
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("full-dev-shm: checked"), "{text}");
}

/// The body of [`full_dev_shm_is_a_resource_error_not_sigbus`], inside the namespace.
#[test]
#[ignore = "run by full_dev_shm_is_a_resource_error_not_sigbus in a private mount namespace"]
fn full_dev_shm_job() {
    if std::env::var(IN_NS).is_err() {
        return;
    }
    let spec = "shm,ring=262144";
    let (kids, _) = LAUNCH.job(&[Some("all-to-all:32768:10"); 20], spec);
    let ended = jobs::wait_job(kids, Duration::from_secs(10), LAUNCH.child_bound);
    jobs::check_no_space_job(&ended, "all-to-all: rank", common::segments_of);
    println!("full-dev-shm: checked");
}
