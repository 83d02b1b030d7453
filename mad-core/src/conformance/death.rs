//! Peer death across real processes, one shape for every driver that can detect it: the
//! driver's test binary re-executes itself as ranks ([`Launch`]) and this process, rank 0,
//! watches a peer die (killed with `SIGKILL`, or exiting without running a destructor).
//!
//! A driver crate declares its [`Launch`], runs [`rank_role`] from its ignored rank-program
//! test (after its own roles, or before them), and calls the shapes from its tests:
//!
//! * [`killed_sender_mid_message`]: a sender killed in the middle of a message; the
//!   receiver's unpack fails with `PeerClosed` within a bound;
//! * [`sender_blocked_on_killed_receiver`]: a sender blocked on a receiver that never reads
//!   fails with `PeerClosed` within a bound once the receiver is killed;
//! * [`send_to_a_peer_that_died_while_idle_fails`]: the first send to a peer that exited
//!   while this rank was idle fails (none is accepted into a buffer nobody reads);
//! * [`any_source_sleeps_after_a_peer_died`]: an any-source receiver waiting for a late
//!   sender, with another peer dead, sleeps instead of spinning;
//! * [`armed_descriptor_fires_when_a_peer_dies`]: an armed readiness descriptor fires when a
//!   peer dies without closing.
//!
//! Bounds are generous (a loaded 2-core machine): they tell a detection from a hang or a
//! timeout, not a fast detection from a slow one.

use std::process::Child;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use super::jobs::Launch;
use crate::driver::Armed;
use crate::{ChannelConfig, Error, RecvMode, SendMode, Session};

/// Channels these shapes open in this process, against the check that none of its segments
/// is left behind (which holds only while no channel is between creating and unlinking one).
static OPENING: RwLock<()> = RwLock::new(());

/// The byte pattern of the late sender's message.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn open(session: &Session, name: &str, spec: &str) -> crate::Channel {
    session
        .open_channel_with(ChannelConfig::parse(name, spec).expect("the driver spec parses"))
        .unwrap_or_else(|e| panic!("rank {}: opening `{name}` over {spec}: {e}", session.rank()))
}

/// The rank programs of these shapes; `false` when `role` is none of them (the caller's own
/// roles then run):
///
/// * `half-sender`: sends a value and starts an 8 MiB piece nobody reads, then waits to be
///   killed;
/// * `deaf`: opens the channel and never reads;
/// * `late-sender`: sends one 100 000-byte message to rank 0 after 2 s;
/// * `vanish`: exits right after the open, without running a destructor;
/// * `vanish-later`: the same, 300 ms after the open.
///
/// # Panics
///
/// When the channel cannot be opened or a send fails (a test helper: the panic is the
/// rank's failure).
pub fn rank_role(session: &Session, role: &str, spec: &str) -> bool {
    match role {
        "half-sender" => {
            let ch = open(session, "crash", spec);
            let big = vec![7u8; 8 << 20];
            let mut p = ch.begin_packing(0).expect("begin_packing");
            p.pack_value(&42u64, RecvMode::Express).expect("pack");
            let _ = p.pack(&big, RecvMode::Cheaper);
            std::thread::sleep(Duration::from_secs(60));
        }
        "deaf" => {
            let _ch = open(session, "crash", spec);
            std::thread::sleep(Duration::from_secs(60));
        }
        "late-sender" => {
            let ch = open(session, "anysrc", spec);
            std::thread::sleep(Duration::from_millis(2000));
            let body = pattern(100_000, 9);
            let mut p = ch.begin_packing(0).expect("begin_packing");
            p.pack_value(&(body.len() as u64), RecvMode::Express)
                .expect("pack");
            p.pack(&body, RecvMode::Cheaper).expect("pack");
            p.end_packing().expect("end_packing");
        }
        "vanish" => {
            let _ch = open(session, "anysrc", spec);
            // Gone without a destructor (no closed flag, no orderly shutdown).
            std::process::exit(0);
        }
        "vanish-later" => {
            let _ch = open(session, "anysrc", spec);
            // Long enough for rank 0 to arm and sleep; then gone without a destructor.
            std::thread::sleep(Duration::from_millis(300));
            std::process::exit(0);
        }
        _ => return false,
    }
    true
}

/// Kill `child` (`SIGKILL`) after `after`, from another thread; the receiver gets the instant.
fn kill_after(mut child: Child, after: Duration) -> std::sync::mpsc::Receiver<Instant> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let _ = tx.send(Instant::now());
        let _ = child.kill();
        let _ = child.wait();
    });
    rx
}

fn peer_closed(e: &Error) -> bool {
    matches!(e, Error::PeerClosed { rank: 1 })
}

/// Rank 1 (`half-sender`) is killed in the middle of a message whose first piece rank 0 (this
/// process) has received: the rest of the message fails with `PeerClosed` within
/// the launch's `death_bound`.
///
/// # Panics
///
/// When a check fails (a test helper: the panic is the test's failure).
pub fn killed_sender_mid_message(launch: &Launch, spec: &str) {
    let _opening = OPENING.read().unwrap_or_else(|e| e.into_inner());
    let (mut kids, session) = launch.job_with_me(&["half-sender"], spec);
    let ch = open(&session, "crash", spec);
    let mut u = ch.begin_unpacking().expect("begin_unpacking");
    let v: u64 = u.unpack_value().expect("the first piece arrives");
    assert_eq!(v, 42);
    // The sender is now blocked on full buffers (or holds the piece until end_packing):
    // kill it, then read what is there and wait for the rest.
    let (_, child) = kids.remove(0);
    let at = kill_after(child, Duration::from_millis(200))
        .recv()
        .expect("the killer thread");
    let mut big = vec![0u8; 8 << 20];
    let r = u
        .unpack(&mut big, SendMode::Cheaper)
        .and_then(|_| u.end_unpacking());
    let noticed = Instant::now();
    let e = r.expect_err("the rest of the message cannot come");
    assert!(peer_closed(&e), "{spec}: {e:?}");
    let lag = noticed.saturating_duration_since(at);
    assert!(lag < launch.death_bound, "{spec}: noticed after {lag:?}");
    tracing::info!("{spec}: dead sender noticed after {lag:?}");
}

/// Rank 0 (this process) sends 16 MiB to rank 1 (`deaf`), which never reads and is killed
/// after 200 ms: the send fails with `PeerClosed` within the launch's `death_bound` instead of hanging,
/// and none of this process's segments is left behind.
///
/// # Panics
///
/// When a check fails (a test helper: the panic is the test's failure).
pub fn sender_blocked_on_killed_receiver(launch: &Launch, spec: &str) {
    let opening = OPENING.read().unwrap_or_else(|e| e.into_inner());
    let (mut kids, session) = launch.job_with_me(&["deaf"], spec);
    let ch = open(&session, "crash", spec);
    let (_, child) = kids.remove(0);
    let killed = kill_after(child, Duration::from_millis(200));
    let big = vec![1u8; 16 << 20];
    let r = ch.begin_packing(1).and_then(|mut p| {
        p.pack(&big, RecvMode::Cheaper)?;
        p.end_packing()
    });
    let noticed = Instant::now();
    let e = r.expect_err("nobody reads: the send must fail, not hang");
    assert!(peer_closed(&e), "{spec}: {e:?}");
    let lag = noticed.saturating_duration_since(killed.recv().expect("the killer thread"));
    assert!(lag < launch.death_bound, "{spec}: noticed after {lag:?}");
    tracing::info!("{spec}: dead receiver noticed after {lag:?}");
    drop(ch);
    drop(session);
    drop(opening);
    let _checking = OPENING.write().unwrap_or_else(|e| e.into_inner());
    let left = (launch.leftovers)(&[std::process::id()]);
    assert!(
        left.is_empty(),
        "{spec}: segments of this process left behind: {left:?}"
    );
}

/// Rank 1 (`vanish`) exits right after the open without closing anything; rank 0 (this
/// process) waits 2 s, then sends small messages: the first must fail with `PeerClosed` (a
/// send accepted into a buffer nobody will read is a lost message), and a receive from the
/// dead peer fails too, within the launch's `death_bound`.
///
/// # Panics
///
/// When a check fails (a test helper: the panic is the test's failure).
pub fn send_to_a_peer_that_died_while_idle_fails(launch: &Launch, spec: &str) {
    let _opening = OPENING.read().unwrap_or_else(|e| e.into_inner());
    let (mut kids, session) = launch.job_with_me(&["vanish"], spec);
    let ch = open(&session, "anysrc", spec);
    let (_, vanished) = kids.remove(0);
    let (ok, out) = launch.wait(vanished);
    assert!(ok, "{spec}: rank 1 failed: {out}");
    std::thread::sleep(Duration::from_secs(2));
    let body = [5u8; 40];
    let mut sent = 0usize;
    let err = loop {
        let r = ch.begin_packing(1).and_then(|mut p| {
            p.pack(&body, RecvMode::Cheaper)?;
            p.end_packing()
        });
        match r {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 100_000, "{spec}: sends to a dead peer never fail");
    };
    assert_eq!(
        sent, 0,
        "{spec}: {sent} sends to a dead peer returned Ok before: {err}"
    );
    assert!(peer_closed(&err), "{spec}: {err:?}");
    let t0 = Instant::now();
    assert!(ch.begin_unpacking_from(1).is_err());
    assert!(
        t0.elapsed() < launch.death_bound,
        "{spec}: {:?}",
        t0.elapsed()
    );
}

/// Rank 2 (`vanish`) dies right after the open; rank 0 (this process) then waits in an
/// any-source `begin_unpacking` for rank 1 (`late-sender`, 2 s later). The wait must sleep:
/// its thread's CPU time stays under 30 % of the wait (a dead peer that kept the driver's
/// `Incoming::wait` returning at once would spin).
///
/// # Panics
///
/// When a check fails (a test helper: the panic is the test's failure).
pub fn any_source_sleeps_after_a_peer_died(launch: &Launch, spec: &str) {
    let _opening = OPENING.read().unwrap_or_else(|e| e.into_inner());
    let (mut kids, session) = launch.job_with_me(&["late-sender", "vanish"], spec);
    let ch = open(&session, "anysrc", spec);
    let vanished = kids.pop().expect("rank 2");
    let (ok, out) = launch.wait(vanished.1);
    assert!(ok, "{spec}: rank 2 failed: {out}");
    let cpu0 = super::thread_cpu_time().expect("the thread's CPU clock");
    let t0 = Instant::now();
    let mut u = ch.begin_unpacking().expect("begin_unpacking");
    let wall = t0.elapsed();
    let cpu = super::thread_cpu_time().expect("the thread's CPU clock") - cpu0;
    assert_eq!(u.remote(), 1);
    let n: u64 = u.unpack_value().expect("unpack");
    let mut body = vec![0u8; n as usize];
    u.unpack(&mut body, SendMode::Cheaper).expect("unpack");
    u.end_unpacking().expect("end_unpacking");
    assert!(body == pattern(100_000, 9), "{spec}: message altered");
    tracing::info!("{spec}: any-source wait of {wall:?} with a dead peer used {cpu:?} of CPU");
    assert!(
        wall >= Duration::from_millis(500),
        "{spec}: wait too short ({wall:?})"
    );
    assert!(
        cpu.as_secs_f64() < 0.3 * wall.as_secs_f64(),
        "{spec}: the any-source receiver spun: {cpu:?} of CPU over a {wall:?} wait"
    );
    launch.finish(kids, spec);
}

/// Rank 1 (`vanish-later`) dies 300 ms after the open without closing anything: rank 0 (this
/// process), armed and asleep on its readiness descriptor, must be woken, and its next poll
/// reports that no peer is left.
///
/// # Panics
///
/// When the channel has no readiness descriptor, or a check fails (a test helper: the panic
/// is the test's failure).
pub fn armed_descriptor_fires_when_a_peer_dies(launch: &Launch, spec: &str) {
    let _opening = OPENING.read().unwrap_or_else(|e| e.into_inner());
    let (kids, session) = launch.job_with_me(&["vanish-later"], spec);
    let ch = open(&session, "anysrc", spec);
    let fd = ch
        .readiness_fd()
        .unwrap_or_else(|| panic!("{spec}: no readiness descriptor"));
    let t0 = Instant::now();
    let mut sleeps = 0;
    let err = loop {
        match ch.try_begin_unpacking() {
            Err(e) => break e,
            Ok(Some(_)) => panic!("{spec}: rank 1 sent nothing"),
            Ok(None) => {}
        }
        if ch.arm().expect("arm") == Armed::Armed {
            sleeps += 1;
            let woke = crate::events::wait_readable(&[fd], Some(Duration::from_secs(5)));
            assert!(
                !woke.expect("wait_readable").is_empty(),
                "{spec}: rank 1 died and the armed descriptor stayed quiet ({:?} in)",
                t0.elapsed()
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{spec}: never reported"
        );
    };
    let wall = t0.elapsed();
    tracing::info!("{spec}: death reported after {wall:?} ({sleeps} sleep(s)): {err}");
    assert!((1..=3).contains(&sleeps), "{spec}: {sleeps} sleeps");
    launch.finish(kids, spec);
}
