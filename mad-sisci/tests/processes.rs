//! Real processes: the test binary re-executes itself as ranks, joined through mad-core's
//! madrun bootstrap server (started in the test process). The conformance kit over 2 and 4
//! processes (then no segment of any child left in `/dev/shm`); peer death, in the shapes
//! every driver shares (`mad_core::conformance::death`): a rank killed with SIGKILL in the
//! middle of a message, or while its peer is blocked sending to it; a send to a peer that
//! died while idle; an any-source receiver whose peer died keeps sleeping while it waits for
//! another one; an armed readiness descriptor fires when a peer dies without closing (its
//! pidfd); and a `/dev/shm` too small for the job.

#![cfg(not(miri))]

mod common;

use std::process::Child;
use std::time::Duration;

use mad_core::bootstrap::Bootstrap;
use mad_core::conformance::death;
use mad_core::conformance::jobs::{self, Launch};
use mad_core::{Result, Session};
use mad_sisci::SisciDriver;

fn session(b: Box<dyn Bootstrap>) -> Result<Session> {
    Session::builder()
        .driver(SisciDriver::new())
        .bootstrap(b)
        .build()
}

/// Ranks are this test binary's `rank_program`; none may leave a segment in `/dev/shm`. The
/// bound on noticing a dead peer while blocked is the one NOTES.md states (one 50 ms wait
/// slice, plus scheduling slack on a loaded 2-core machine).
const LAUNCH: Launch = Launch::new(
    "rank_program",
    "MAD_SISCI_TEST_ROLE",
    "MAD_SISCI_TEST_SPEC",
    session,
)
.with_leftovers(common::segments_of)
.with_death_bound(Duration::from_millis(500));

#[test]
#[ignore = "rank program of the process tests"]
fn rank_program() {
    let Some((role, spec)) = LAUNCH.role() else {
        return;
    };
    let session = LAUNCH.child_session();
    if death::rank_role(&session, &role, &spec) {
        return;
    }
    match role.as_str() {
        "kit" => jobs::kit_role(&session, &spec),
        r if r.starts_with("all-to-all:") => {
            let (size, rounds) = jobs::all_to_all_role(r).expect("all-to-all:<size>:<rounds>");
            jobs::all_to_all(&session, &spec, size, rounds);
        }
        r => panic!("unknown role {r}"),
    }
}

#[test]
fn kit_2_processes() {
    LAUNCH.kit_processes(2, "sisci:local");
}

#[test]
fn kit_4_processes_small_geometry() {
    LAUNCH.kit_processes(4, "sisci:local,slots=8,ring=8192,chunks=2,chunk=8192");
}

#[test]
fn killed_sender_mid_message_gives_peer_closed() {
    for spec in ["sisci:local", "sisci:local,dma=off"] {
        death::killed_sender_mid_message(&LAUNCH, spec);
    }
}

/// Also: the child's segment went with it (its file was unlinked at open), and none of this
/// process's is left.
#[test]
fn sender_blocked_on_killed_receiver_gives_peer_closed() {
    for spec in ["sisci:local", "sisci:local,dma=off"] {
        death::sender_blocked_on_killed_receiver(&LAUNCH, spec);
    }
}

/// A peer that dies without closing (no flag, no signal: only its pidfd, in rank 0's epoll
/// set) wakes an armed readiness descriptor.
#[test]
fn armed_descriptor_fires_when_a_peer_dies() {
    death::armed_descriptor_fires_when_a_peer_dies(&LAUNCH, "sisci:local");
}

/// The first send to a peer that died while idle fails: before `begin_message` probed the
/// peer, 64 sends in a row returned `Ok` (as many as there are short slots) and were lost.
#[test]
fn send_to_a_peer_that_died_while_idle_fails() {
    death::send_to_a_peer_that_died_while_idle_fails(&LAUNCH, "sisci:local");
}

/// Before the fix, a dead peer kept `SciIncoming::wait` returning at once for the rest of the
/// channel's life: the any-source receiver spun.
#[test]
fn any_source_sleeps_after_a_peer_died() {
    for spec in ["sisci:local", "sisci:local,progress=block"] {
        death::any_source_sleeps_after_a_peer_died(&LAUNCH, spec);
    }
}

/// Set in the process that runs [`full_dev_shm_job`] inside its private mount namespace.
const IN_NS: &str = "MAD_SISCI_TEST_SMALL_DEV_SHM";

/// 16 ranks exchanging 4 MiB messages all-to-all over `sisci:local` on a 64 MiB `/dev/shm`
/// (Docker's default): the segments need 16 × 16 areas of about 1.1 MiB. Before the fix they
/// were sparse, the open succeeded and ranks died of `SIGBUS` once the areas' pages could no
/// longer be supplied; now the space is reserved at open and the ranks that do not fit fail
/// their open with `Resource` naming `/dev/shm`. Runs in a private mount namespace (root;
/// skipped otherwise).
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
    const RANKS: usize = 16;
    let (kids, _): (Vec<(usize, Child)>, _) =
        LAUNCH.job(&[Some("all-to-all:4194304:2"); RANKS], "sisci:local");
    let ended = jobs::wait_job(kids, Duration::from_secs(10), LAUNCH.child_bound);
    jobs::check_no_space_job(&ended, "all-to-all: rank", common::segments_of);
    println!("full-dev-shm: checked");
}
