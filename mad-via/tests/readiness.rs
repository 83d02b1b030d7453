//! Driver-level tests of the event-loop contract on `via:soft`: the readiness descriptor of a
//! send armed with `TxLink::arm_send`, and `Incoming::shutdown` (clean close, waits end).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::driver::{Armed, Driver, Incoming, LinkPair, NoIncoming, OpenContext, OpenedChannel};
use mad_core::progress::ProgressPolicy;
use mad_core::{ChannelConfig, Error, Result};
use mad_via::{ViaDriver, TM_MEDIUM};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

const LIMIT: Duration = Duration::from_secs(20);

/// Far more than the soft NIC's queue and socket buffers hold, so a medium send stays
/// `Pending` until the receiver posts its receives and reads.
const BIG: usize = 64 << 20;

fn open_group(n: usize) -> Vec<OpenedChannel> {
    let config = ChannelConfig::parse("ready", "via:soft").unwrap();
    let handles: Vec<_> = ThreadBootstrap::group(n)
        .into_iter()
        .map(|b| {
            let config = config.clone();
            thread::spawn(move || {
                let via = ViaDriver::new();
                let table = via.tm_table(&config).unwrap();
                let progress = ProgressPolicy::default();
                let ctx = OpenContext::new(&config, &b, &table, &progress);
                via.open(&ctx).unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn take(ch: &mut OpenedChannel, r: usize) -> LinkPair {
    ch.links[r].take().expect("link to peer")
}

/// Call `f` until it is ready, at most [`LIMIT`].
fn drive<T>(mut f: impl FnMut() -> Result<Poll<T>>) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Poll::Ready(v) = f()? {
            return Ok(v);
        }
        assert!(start.elapsed() < LIMIT, "driver call did not complete");
        thread::yield_now();
    }
}

/// Whether `fd` is readable within `t`.
fn readable(fd: BorrowedFd<'_>, t: Duration) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let ms = PollTimeout::try_from(t.as_millis() as i32).unwrap();
    matches!(poll(&mut fds, ms), Ok(n) if n > 0)
}

#[test]
fn arm_send_wakes_when_the_reader_drains() {
    let mut chans = open_group(2);
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let inc = &chans[0].incoming;
    let fd = inc.readiness_fd().expect("via has a readiness descriptor");
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
            .send_refs(TM_MEDIUM, &[IoSlice::new(&body)])
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
    let t0 = Instant::now();
    let reader = thread::spawn(move || {
        let mut buf = vec![0u8; BIG];
        drive(|| b.rx.recv_refs(TM_MEDIUM, &mut [IoSliceMut::new(&mut buf)])).unwrap();
        assert!(buf.iter().all(|&x| x == 7));
        b
    });
    assert!(
        readable(fd, Duration::from_secs(10)),
        "the readiness descriptor stayed quiet after the receiver drained the sockets"
    );
    eprintln!(
        "via:soft: the armed send made the descriptor readable {:?} after the reader started",
        t0.elapsed()
    );
    drive(|| a.tx.send_refs(TM_MEDIUM, &[IoSlice::new(&body)])).unwrap();
    drive(|| a.tx.end_message()).unwrap();
    let b = reader.join().unwrap();
    // The send's events (one-shot registrations, the moved connection) are reported a few
    // times at most; then the idle descriptor stays quiet.
    let mut busy = 0;
    while inc.arm().unwrap() == Armed::Busy {
        busy += 1;
        assert!(busy <= 3, "arm keeps saying Busy after the send completed");
    }
    assert!(
        !readable(fd, Duration::from_millis(200)),
        "readable while idle after the send completed"
    );
    drop(b);
}

/// `Incoming::shutdown` ends a receive and a send that wait (their links' waits return within
/// a slice and the next call fails: what the engine's progress loop does), and an
/// `Incoming::wait`, without touching the links; the peers see a clean close.
#[test]
fn shutdown_ends_waits_and_closes_cleanly() {
    let mut chans = open_group(3);
    let mut from1 = take(&mut chans[0], 1);
    let mut to2 = take(&mut chans[0], 2);
    let mut at1 = take(&mut chans[1], 0);
    let at2 = take(&mut chans[2], 0);
    let inc: Arc<dyn Incoming> = Arc::from(std::mem::replace(
        &mut chans[0].incoming,
        Box::new(NoIncoming),
    ));
    let long = Duration::from_secs(20);
    let rx_waiter = thread::spawn(move || {
        let e = loop {
            match from1.rx.poll_message() {
                Ok(Poll::Pending) => {
                    let _ = from1.rx.wait(long);
                }
                Ok(Poll::Ready(())) => panic!("a message from an idle peer"),
                Err(e) => break e,
            }
        };
        (Instant::now(), e)
    });
    let tx_waiter = thread::spawn(move || {
        // Rank 2 posts no receive: the medium send fills the queues and waits.
        let body = vec![1u8; BIG];
        to2.tx.begin_message().unwrap();
        let mut waited = false;
        let e = loop {
            match to2.tx.send_refs(TM_MEDIUM, &[IoSlice::new(&body)]) {
                Ok(Poll::Pending) => {
                    waited = true;
                    let _ = to2.tx.wait(long);
                }
                Ok(Poll::Ready(())) => panic!("{BIG} bytes fit in the soft NIC's queues"),
                Err(e) => break e,
            }
        };
        assert!(waited);
        (Instant::now(), e)
    });
    // `Incoming::wait` blocks at most 10 ms at a time: the waiter loops, like the engine.
    let inc2 = inc.clone();
    let closing = Arc::new(AtomicBool::new(false));
    let closing2 = closing.clone();
    let any_waiter = thread::spawn(move || loop {
        let _ = inc2.wait(long);
        if closing2.load(Ordering::Acquire) {
            return Instant::now();
        }
    });
    thread::sleep(Duration::from_millis(300)); // everyone is waiting by now
    let t0 = Instant::now();
    closing.store(true, Ordering::Release);
    inc.shutdown();
    let (t_rx, e_rx) = rx_waiter.join().unwrap();
    let (t_tx, e_tx) = tx_waiter.join().unwrap();
    let t_any = any_waiter.join().unwrap();
    let took = |t: Instant| t.saturating_duration_since(t0);
    eprintln!(
        "via:soft: after shutdown the waiting receive failed in {:?}, the waiting send in {:?}, \
         Incoming::wait returned in {:?}",
        took(t_rx),
        took(t_tx),
        took(t_any)
    );
    for (what, t) in [("receive", t_rx), ("send", t_tx), ("Incoming::wait", t_any)] {
        assert!(
            took(t) < Duration::from_secs(1),
            "{what} ended {:?} after shutdown",
            took(t)
        );
    }
    for e in [e_rx, e_tx] {
        match e {
            Error::Poisoned { cause, .. } => {
                assert!(cause.to_string().contains("closed"), "{cause}")
            }
            other => panic!("after shutdown: {other}"),
        }
    }
    // Rank 1 (between messages) sees a clean close: end of stream, not an error.
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
/// A peer that left makes the descriptor readable; once the core has heard it and forgotten
/// the peer, its hung-up socket no longer keeps the descriptor readable (an event loop would
/// spin).
#[test]
fn departed_peer_then_quiet() {
    let mut chans = open_group(3);
    let mut from2 = take(&mut chans[0], 2);
    let departing = chans.remove(2);
    let inc = &chans[0].incoming;
    let fd = inc.readiness_fd().expect("via has a readiness descriptor");
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
