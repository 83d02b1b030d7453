//! Driver-level tests of the event-loop contract: the readiness descriptor of a send armed with
//! `TxLink::arm_send`, and `Incoming::shutdown` (clean close, blocked waits wake up).

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use mad_core::driver::{Armed, Incoming, LinkPair, NoIncoming, OpenedChannel};
use mad_core::{ChannelConfig, Error};

fn cfg(name: &str) -> ChannelConfig {
    ChannelConfig::parse(name, "tcp:127.0.0.1,connect_timeout_ms=10000").unwrap()
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

/// Far more than loopback socket buffers hold, so a send stays `Pending` until the peer reads.
const BIG: usize = 64 << 20;

/// A large send blocked on a reader that does not read: after `Pending`, `arm_send` says
/// `Armed`, the readiness descriptor stays quiet, and becomes readable once the reader drains.
fn arm_send_wakes_when_the_reader_drains(ranks: usize) {
    let mut chans = open_group(ranks, cfg("armsend"));
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let inc = &chans[0].incoming;
    let fd = inc
        .readiness_fd()
        .expect("tcp has a readiness descriptor")
        .as_raw_fd();
    assert_eq!(inc.arm().unwrap(), Armed::Armed, "idle channel");
    let body = vec![7u8; BIG];
    a.tx.begin_message().unwrap();
    // Until the connection is stuck: the send `Pending`, `arm_send` `Armed` and the
    // descriptor quiet. (Right after the first `Pending` the receiving kernel may still take
    // bytes, which is progress: the armed descriptor then fires, and the send goes on.)
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds < 100, "the send never got stuck");
        if a.tx
            .send_refs(1, &[IoSlice::new(&body)])
            .unwrap()
            .is_ready()
        {
            panic!("{BIG} bytes fit in the buffers");
        }
        if a.tx.arm_send().unwrap() == Armed::Armed && !readable(fd, Duration::from_millis(200)) {
            break;
        }
        let _ = inc.arm().unwrap();
    }
    // The reader drains the socket on another thread.
    let t0 = Instant::now();
    let reader = thread::spawn(move || {
        let mut buf = vec![0u8; BIG];
        drive(|| b.rx.recv_refs(1, &mut [IoSliceMut::new(&mut buf)])).unwrap();
        assert!(buf.iter().all(|&x| x == 7));
        b
    });
    assert!(
        readable(fd, Duration::from_secs(10)),
        "the readiness descriptor stayed quiet after the reader drained the socket"
    );
    eprintln!(
        "tcp ({ranks} ranks): the armed send made the descriptor readable {:?} after the \
         reader started",
        t0.elapsed()
    );
    drive(|| a.tx.send_refs(1, &[IoSlice::new(&body)])).unwrap();
    drive(|| a.tx.end_message()).unwrap();
    let b = reader.join().unwrap();
    // The one-shot registration reports the send's event at most once more; the writable
    // socket does not keep the descriptor readable afterwards.
    let mut busy = 0;
    while inc.arm().unwrap() == Armed::Busy {
        busy += 1;
        assert!(busy <= 1, "arm keeps saying Busy after the send completed");
    }
    assert!(
        !readable(fd, Duration::from_millis(200)),
        "readable while idle after the send completed"
    );
    drop(b);
}

#[test]
fn arm_send_few_peers() {
    arm_send_wakes_when_the_reader_drains(2);
}

#[test]
fn arm_send_many_peers_epoll() {
    arm_send_wakes_when_the_reader_drains(6);
}

/// `Incoming::shutdown` wakes threads blocked in `RxLink::wait`, `TxLink::wait` and
/// `Incoming::wait` (without touching the links), and the peers see a clean close.
fn shutdown_wakes_and_closes_cleanly(ranks: usize) {
    let mut chans = open_group(ranks, cfg("shutdown"));
    let mut from1 = take(&mut chans[0], 1);
    let mut to2 = take(&mut chans[0], 2);
    let mut at1 = take(&mut chans[1], 0);
    let at2 = take(&mut chans[2], 0);
    let inc: Arc<dyn Incoming> = Arc::from(std::mem::replace(
        &mut chans[0].incoming,
        Box::new(NoIncoming),
    ));
    // Fill the connection to rank 2 so that its sending half really blocks.
    let body = vec![1u8; BIG];
    to2.tx.begin_message().unwrap();
    while to2
        .tx
        .send_refs(1, &[IoSlice::new(&body)])
        .unwrap()
        .is_ready()
    {}
    let long = Duration::from_secs(20);
    let rx_waiter = thread::spawn(move || {
        let r = from1.rx.wait(long);
        (Instant::now(), r.is_ok(), from1)
    });
    let tx_waiter = thread::spawn(move || {
        let r = to2.tx.wait(long);
        (Instant::now(), r.is_ok(), to2)
    });
    let inc2 = inc.clone();
    let any_waiter = thread::spawn(move || {
        let r = inc2.wait(long);
        (Instant::now(), r.is_ok())
    });
    thread::sleep(Duration::from_millis(300)); // everyone is blocked by now
    let t0 = Instant::now();
    inc.shutdown();
    let (t_rx, _, mut from1) = rx_waiter.join().unwrap();
    let (t_tx, _, mut to2) = tx_waiter.join().unwrap();
    let (t_any, _) = any_waiter.join().unwrap();
    let took = |t: Instant| t.saturating_duration_since(t0);
    eprintln!(
        "tcp ({ranks} ranks): shutdown woke RxLink::wait in {:?}, TxLink::wait in {:?}, \
         Incoming::wait in {:?}",
        took(t_rx),
        took(t_tx),
        took(t_any)
    );
    for (what, t) in [("RxLink", t_rx), ("TxLink", t_tx), ("Incoming", t_any)] {
        assert!(
            took(t) < Duration::from_secs(1),
            "{what}::wait returned {:?} after shutdown",
            took(t)
        );
    }
    // Later calls fail, naming the close.
    match from1.rx.poll_message() {
        Err(Error::Poisoned { cause, .. }) => {
            assert!(cause.to_string().contains("closed"), "{cause}")
        }
        other => panic!("receive after shutdown: {other:?}"),
    }
    assert!(to2.tx.end_message().is_err());
    // Rank 1 (between messages) sees a clean close: end of stream, not a reset.
    let deadline = Instant::now() + LIMIT;
    loop {
        match at1.rx.poll_message() {
            Err(Error::PeerClosed { rank: 0 }) => break,
            Ok(Poll::Pending) if Instant::now() < deadline => {
                let _ = at1.rx.wait(Duration::from_millis(50));
            }
            other => panic!("rank 1 after rank 0's shutdown: {other:?}"),
        }
    }
    drop(at2);
}

#[test]
fn shutdown_few_peers() {
    shutdown_wakes_and_closes_cleanly(3);
}

#[test]
fn shutdown_many_peers_epoll() {
    shutdown_wakes_and_closes_cleanly(6);
}

/// Block mode: a gather receive waiting in the kernel (`MSG_WAITALL`, in 200 ms slices) is
/// woken by `Incoming::shutdown` and fails, naming the close.
#[test]
fn shutdown_wakes_a_blocking_gather_receive() {
    use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
    use mad_core::progress::{ProgressMode, ProgressPolicy};
    let boots: Vec<Box<dyn Bootstrap>> = ThreadBootstrap::group(2)
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn Bootstrap>)
        .collect();
    let tables = (0..2)
        .map(|_| mad_tcp::tm_table(mad_tcp::DEFAULT_SMALL_MAX).unwrap())
        .collect();
    let mut policy = ProgressPolicy::default();
    policy.mode = ProgressMode::Block;
    let mut res = open_with_policy(boots, cfg("blockclose"), tables, policy);
    let mut c1 = res.pop().unwrap().unwrap();
    let mut c0 = res.pop().unwrap().unwrap();
    let mut a = take(&mut c0, 1);
    let mut b = take(&mut c1, 0);
    // Half of a gather piece, then silence: the receiver waits in the kernel for the rest.
    let half = vec![3u8; 256 << 10];
    a.tx.begin_message().unwrap();
    drive(|| a.tx.send_refs(1, &[IoSlice::new(&half)])).unwrap();
    drive(|| a.tx.end_message()).unwrap();
    let receiver = thread::spawn(move || {
        let mut body = vec![0u8; 1 << 20];
        let mut iov = [IoSliceMut::new(&mut body)];
        let e = loop {
            match b.rx.recv_refs(1, &mut iov) {
                Ok(Poll::Pending) => {}
                Ok(Poll::Ready(())) => panic!("half a piece reported complete"),
                Err(e) => break e,
            }
        };
        (Instant::now(), e)
    });
    thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    c1.incoming.shutdown();
    let (t, e) = receiver.join().unwrap();
    let took = t.saturating_duration_since(t0);
    eprintln!("tcp (block mode): shutdown ended a blocking gather receive in {took:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    match e {
        Error::Poisoned { cause, .. } => assert!(cause.to_string().contains("closed"), "{cause}"),
        other => panic!("after shutdown: {other}"),
    }
    drop(a);
}

/// A peer that left makes the descriptor readable; once the core has heard it and forgotten
/// the peer, its hung-up socket no longer keeps the descriptor readable (an event loop would
/// spin).
fn departed_peer_then_quiet(ranks: usize) {
    let mut chans = open_group(ranks, cfg("departed"));
    let mut from2 = take(&mut chans[0], 2);
    let departing = chans.remove(2);
    let inc = &chans[0].incoming;
    let fd = inc
        .readiness_fd()
        .expect("tcp has a readiness descriptor")
        .as_raw_fd();
    assert_eq!(inc.arm().unwrap(), Armed::Armed, "idle channel");
    drop(departing);
    assert!(
        readable(fd, Duration::from_secs(5)),
        "the departure left the descriptor quiet"
    );
    match from2.rx.poll_message() {
        Err(Error::PeerClosed { rank: 2 }) => {}
        other => panic!("from the departed peer: {other:?}"),
    }
    inc.forget(2);
    assert_eq!(
        inc.arm().unwrap(),
        Armed::Armed,
        "a forgotten peer keeps arm busy"
    );
    assert!(
        !readable(fd, Duration::from_millis(300)),
        "a forgotten peer keeps the descriptor readable"
    );
}

#[test]
fn departed_peer_few_peers() {
    departed_peer_then_quiet(3);
}

#[test]
fn departed_peer_many_peers_epoll() {
    departed_peer_then_quiet(6);
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
