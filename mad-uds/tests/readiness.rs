//! Driver-level tests of the event-loop contract: the readiness descriptor of a send armed with
//! `TxLink::arm_send`, and `Incoming::shutdown` (clean close, blocked waits wake up).

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::driver::{Armed, Driver, Incoming, LinkPair, NoIncoming, OpenContext, OpenedChannel};
use mad_core::progress::ProgressPolicy;
use mad_core::{ChannelConfig, Error, Result};
use mad_uds::UdsDriver;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

const LIMIT: Duration = Duration::from_secs(20);

/// Far more than Unix socket buffers hold, so a send stays `Pending` until the peer reads.
const BIG: usize = 64 << 20;

fn open_group(n: usize) -> Vec<OpenedChannel> {
    let config = ChannelConfig::parse("ready", "uds").unwrap();
    let handles: Vec<_> = ThreadBootstrap::group(n)
        .into_iter()
        .map(|b| {
            let config = config.clone();
            thread::spawn(move || {
                let table = UdsDriver.tm_table(&config).unwrap();
                let progress = ProgressPolicy::default();
                let ctx = OpenContext::new(&config, &b, &table, &progress);
                UdsDriver.open(&ctx).unwrap()
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
    let fd = inc.readiness_fd().expect("uds has a readiness descriptor");
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
        "uds: the armed send made the descriptor readable {:?} after the reader started",
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

/// `Incoming::shutdown` wakes threads blocked in `RxLink::wait`, `TxLink::wait` and
/// `Incoming::wait` (without touching the links), and the peers see a clean close.
#[test]
fn shutdown_wakes_and_closes_cleanly() {
    let mut chans = open_group(3);
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
        let _ = from1.rx.wait(long);
        (Instant::now(), from1)
    });
    let tx_waiter = thread::spawn(move || {
        let _ = to2.tx.wait(long);
        (Instant::now(), to2)
    });
    let inc2 = inc.clone();
    let any_waiter = thread::spawn(move || {
        let _ = inc2.wait(long);
        Instant::now()
    });
    thread::sleep(Duration::from_millis(300)); // everyone is blocked by now
    let t0 = Instant::now();
    inc.shutdown();
    let (t_rx, mut from1) = rx_waiter.join().unwrap();
    let (t_tx, mut to2) = tx_waiter.join().unwrap();
    let t_any = any_waiter.join().unwrap();
    let took = |t: Instant| t.saturating_duration_since(t0);
    eprintln!(
        "uds: shutdown woke RxLink::wait in {:?}, TxLink::wait in {:?}, Incoming::wait in {:?}",
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
    let fd = inc.readiness_fd().expect("uds has a readiness descriptor");
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
