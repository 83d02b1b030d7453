//! Peer death across real processes: the test binary re-executes itself as a child rank,
//! which is killed with SIGKILL in the middle of a message.

// Real mappings, futexes and processes: nothing here runs under miri.
#![cfg(not(miri))]

mod common;

use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use mad_core::auth::Secret;
use mad_core::driver::{RxLink, TxLink};
use mad_core::Error;

const CHILD_ENV: &str = "MAD_SHM_CRASH_CHILD";
const SECRET_ENV: &str = "MAD_SHM_CRASH_SECRET";
const MODE_ENV: &str = "MAD_SHM_CRASH_MODE";

/// The child role (does nothing unless started by `spawn_child`): open the channel, send half
/// a message, then hang until killed.
#[test]
fn crash_child_role() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let secret = Secret::from_hex(&std::env::var(SECRET_ENV).unwrap()).unwrap();
    let b = PairBootstrap::connect(&path, secret).unwrap();
    let mut ch = open_with(&b, &config(&[("ring", "4096"), ("cma", "always")])).unwrap();
    let link = ch.links[0].as_mut().unwrap();
    let tx: &mut dyn TxLink = link.tx.as_mut();
    tx.begin_message().unwrap();
    let _ = tx.with_buffer(0, 7, &mut |buf: &mut [u8]| {
        buf[..7].copy_from_slice(b"partial");
        7
    });
    let _ = tx.commit(0);
    if std::env::var(MODE_ENV).as_deref() == Ok("cma") {
        // Post a CMA record for a big buffer and hang waiting for completion.
        let big = vec![1u8; 1 << 20];
        let _ = tx.send_refs(1, &[std::io::IoSlice::new(&big)]);
        std::thread::sleep(Duration::from_secs(60));
        drop(big);
    }
    std::thread::sleep(Duration::from_secs(60));
}

fn spawn_child(mode: &str) -> (std::process::Child, mad_core::driver::OpenedChannel) {
    // One socket per call: tests of the same mode may run at once.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = format!(
        "/tmp/mad-shm-crash-{}-{mode}-{call}.sock",
        std::process::id()
    );
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).unwrap();
    let secret = Secret::random().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .env(SECRET_ENV, secret.to_hex())
        .env(MODE_ENV, mode)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let b = PairBootstrap::accept(&l, secret).unwrap();
    let _ = std::fs::remove_file(&path);
    let ch = open_with(&b, &config(&[("ring", "4096"), ("cma", "always")])).unwrap();
    (child, ch)
}

/// Kill `child` after `after` from another thread; returns when it was killed.
fn kill_later(mut child: std::process::Child, after: Duration) -> Arc<Mutex<Option<Instant>>> {
    let at = Arc::new(Mutex::new(None));
    let at2 = at.clone();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        *at2.lock().unwrap() = Some(Instant::now());
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
    });
    at
}

/// Bound stated in NOTES.md for noticing a dead peer while blocked (one wait slice plus
/// scheduling slack on a loaded 2-core machine).
const DEATH_BOUND: Duration = Duration::from_millis(500);

#[test]
fn killed_sender_fails_pending_receive_with_peer_closed() {
    let (child, mut ch) = spawn_child("ring");
    let child_pid = child.id();
    let rx: &mut dyn RxLink = ch.links[1].as_mut().unwrap().rx.as_mut();
    let mut b = [0u8; 7];
    recv_copy(rx, &mut b).unwrap();
    assert_eq!(&b, b"partial");
    let killed = kill_later(child, Duration::from_millis(100));
    // The rest of the message never comes: the receive must fail, not hang.
    let mut rest = [0u8; 16];
    let r = recv_copy(rx, &mut rest);
    let noticed = Instant::now();
    assert!(matches!(r, Err(Error::PeerClosed { rank: 1 })), "{r:?}");
    let lag = noticed - killed.lock().unwrap().expect("killed");
    assert!(lag < DEATH_BOUND, "noticed after {lag:?}");
    // The child unlinked its segment once both sides had mapped it: nothing of it may be
    // left in /dev/shm (names start with `mad-shm-<creator pid>-`).
    let left = segments_of(&[child_pid]);
    assert!(left.is_empty(), "child segment left behind: {left:?}");
}

#[test]
fn killed_cma_sender_fails_gather_receive_with_peer_closed() {
    let (child, mut ch) = spawn_child("cma");
    let rx: &mut dyn RxLink = ch.links[1].as_mut().unwrap().rx.as_mut();
    let mut b = [0u8; 7];
    recv_copy(rx, &mut b).unwrap();
    let _killed = kill_later(child, Duration::from_millis(100));
    std::thread::sleep(Duration::from_millis(300));
    // The record is in the ring, but the memory it names died with the child.
    let mut big = vec![0u8; 1 << 20];
    let r = recv_group(rx, 1, &mut [std::io::IoSliceMut::new(&mut big)]);
    assert!(matches!(r, Err(Error::PeerClosed { rank: 1 })), "{r:?}");
}

#[test]
fn sender_blocked_on_full_ring_of_killed_receiver_fails() {
    let (child, mut ch) = spawn_child("ring");
    let killed = kill_later(child, Duration::from_millis(100));
    let tx: &mut dyn TxLink = ch.links[1].as_mut().unwrap().tx.as_mut();
    // 1 MiB into a 4 KiB ring nobody reads.
    let r = send_copy(tx, &vec![0u8; 1 << 20]);
    let noticed = Instant::now();
    assert!(matches!(r, Err(Error::PeerClosed { rank: 1 })), "{r:?}");
    let lag = noticed - killed.lock().unwrap().expect("killed");
    assert!(lag < DEATH_BOUND, "noticed after {lag:?}");
}
