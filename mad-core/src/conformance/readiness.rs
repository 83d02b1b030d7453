//! Driver-level tests of the event-loop contract, one body for every driver they apply to:
//! the readiness descriptor of a send armed with `TxLink::arm_send`, `Incoming::shutdown`
//! (blocked waits of other threads wake up, the peers see a clean close), and a departed
//! peer's descriptor once forgotten. Ranks are threads of the test process over the driver's
//! real transport ([`ThreadBootstrap`]); each driver's `tests/readiness.rs` builds a [`Rig`]
//! and calls the bodies that apply to it.
//!
//! Two families, after how a send blocks:
//!
//! * ring bodies ([`arm_send_on_full_ring_fires_when_the_reader_drains`],
//!   [`shutdown_wakes_blocked_waits_promptly`]): the sender lends TM 0 buffers until the driver
//!   says `Pending` (a ring or a few slots that fill after a few lends, or a socket's copy
//!   buffer once the socket is full), the reader takes TM 0 bytes;
//! * stream bodies ([`arm_send_wakes_when_the_reader_drains`],
//!   [`shutdown_wakes_and_closes_cleanly`], [`shutdown_wakes_a_blocking_gather_receive`]):
//!   one gather piece far larger than the transport's buffers ([`BIG`]) through
//!   [`Rig::stream_tm`], for byte-stream transports (an in-memory driver's gather groups
//!   always fit; a ring driver may have no gather TM).
//!
//! [`departed_peer_then_quiet`] applies to every driver with a readiness descriptor.

use std::fmt;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::bootstrap::{Bootstrap, ThreadBootstrap};
use crate::config::ChannelConfig;
use crate::driver::{
    Armed, Driver, Incoming, LinkPair, NoIncoming, OpenContext, OpenedChannel, RxLink, TxLink,
};
use crate::error::{Error, Result};
use crate::events::wait_readable;
use crate::progress::{ProgressMode, ProgressPolicy};

/// Longest any body waits for one event.
pub const BOUND: Duration = Duration::from_secs(20);

/// Longer than any prompt wake-up, shorter than a wait slice (50 ms): a wait that returns
/// within it was woken, not timed out (ring bodies).
pub const PROMPT: Duration = Duration::from_millis(25);

/// Far more than socket buffers or a soft NIC's queues hold, so a stream body's send stays
/// `Pending` until the peer reads.
pub const BIG: usize = 64 << 20;

type OpenFn = dyn Fn(&dyn Bootstrap, &ProgressPolicy) -> Result<OpenedChannel> + Send + Sync;

/// A driver under test: how one rank opens its channel (on that rank's thread), and what the
/// stream bodies need to know.
pub struct Rig {
    name: String,
    open: Box<OpenFn>,
    stream_tm: u8,
    send_events: usize,
}

impl fmt::Debug for Rig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rig")
            .field("name", &self.name)
            .field("stream_tm", &self.stream_tm)
            .field("send_events", &self.send_events)
            .finish_non_exhaustive()
    }
}

impl Rig {
    /// `driver` opening `config` with the table `Driver::tm_table` gives it. Stream bodies send
    /// through TM 1, and a completed armed send makes at most one more arm `Busy`.
    pub fn new<D: Driver + 'static>(driver: D, config: ChannelConfig) -> Self {
        let name = match &config.adapter {
            Some(a) => format!("{}:{a}", driver.name()),
            None => driver.name().to_string(),
        };
        Rig {
            name,
            open: Box::new(move |b, progress| {
                let table = driver.tm_table(&config)?;
                driver.open(&OpenContext::new(&config, b, &table, progress))
            }),
            stream_tm: 1,
            send_events: 1,
        }
    }

    /// The gather TM of the stream bodies' large sends.
    #[must_use]
    pub fn stream_tm(mut self, tm: u8) -> Self {
        self.stream_tm = tm;
        self
    }

    /// How many arms a completed armed send may still make `Busy` (its events, reported once
    /// each, before the idle descriptor stays quiet).
    #[must_use]
    pub fn send_events(mut self, n: usize) -> Self {
        self.send_events = n;
        self
    }

    /// Open the channel on `n` thread-ranks under `progress`; the channels in rank order.
    fn group_with(&self, n: usize, progress: &ProgressPolicy) -> Vec<OpenedChannel> {
        std::thread::scope(|s| {
            let hs: Vec<_> = ThreadBootstrap::group(n)
                .into_iter()
                .map(|b| s.spawn(move || (self.open)(&b, progress)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("open thread panicked"))
                .map(|r| r.unwrap_or_else(|e| panic!("{}: open: {e}", self.name)))
                .collect()
        })
    }

    fn group(&self, n: usize) -> Vec<OpenedChannel> {
        self.group_with(n, &ProgressPolicy::default())
    }

    /// Open the channel on `n` thread-ranks and run `body(rank, channel)` on each rank's thread.
    fn run(&self, n: usize, body: impl Fn(usize, OpenedChannel) + Sync) {
        let progress = ProgressPolicy::default();
        std::thread::scope(|s| {
            let hs: Vec<_> = ThreadBootstrap::group(n)
                .into_iter()
                .map(|b| {
                    let (body, progress) = (&body, &progress);
                    s.spawn(move || {
                        let ch = (self.open)(&b, progress)
                            .unwrap_or_else(|e| panic!("{}: open: {e}", self.name));
                        body(b.rank(), ch)
                    })
                })
                .collect();
            for h in hs {
                h.join().expect("rank thread panicked");
            }
        });
    }
}

/// A barrier whose waits give up (panic) after [`BOUND`]: a rank that failed must not leave
/// the others waiting for ever.
struct Barrier {
    n: usize,
    st: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl Barrier {
    fn new(n: usize) -> Self {
        Barrier {
            n,
            st: Mutex::new((0, 0)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut g = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let round = g.1;
        g.0 += 1;
        if g.0 == self.n {
            *g = (0, round + 1);
            self.cv.notify_all();
            return;
        }
        let (_g, t) = self
            .cv
            .wait_timeout_while(g, BOUND, |s| s.1 == round)
            .unwrap_or_else(|e| e.into_inner());
        assert!(!t.timed_out(), "a rank never reached the barrier");
    }
}

/// Whether `fd` is readable within `t`.
fn readable(fd: BorrowedFd<'_>, t: Duration) -> bool {
    !wait_readable(&[fd], Some(t)).unwrap().is_empty()
}

/// Lend TM 0 until the driver says `Pending`.
fn fill(tx: &mut dyn TxLink) {
    for _ in 0..100_000 {
        let p = tx
            .with_buffer(0, 1 << 20, &mut |b: &mut [u8]| {
                b.fill(7);
                b.len()
            })
            .unwrap();
        if p.is_pending() {
            return;
        }
    }
    panic!("the ring never filled");
}

/// Take TM 0 bytes until the driver says `Pending` or fails; returns how many, and the error.
fn drain(rx: &mut dyn RxLink) -> (usize, Option<Error>) {
    let mut n = 0;
    loop {
        let r = rx.with_data(0, 1 << 20, &mut |b: &[u8]| {
            n += b.len();
            b.len()
        });
        match r {
            Ok(Poll::Ready(())) => {}
            Ok(Poll::Pending) => return (n, None),
            Err(e) => return (n, Some(e)),
        }
    }
}

fn link(ch: &mut OpenedChannel, r: usize) -> &mut LinkPair {
    ch.links[r].as_mut().expect("link")
}

fn take(ch: &mut OpenedChannel, r: usize) -> LinkPair {
    ch.links[r].take().expect("link to peer")
}

/// Call `f` until it is ready, at most [`BOUND`].
fn drive<T>(mut f: impl FnMut() -> Result<Poll<T>>) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Poll::Ready(v) = f()? {
            return Ok(v);
        }
        assert!(start.elapsed() < BOUND, "driver call did not complete");
        std::thread::yield_now();
    }
}

/// An error that names the close (`Poisoned`, its cause saying `closed`).
fn assert_closed(e: &Error, what: &str) {
    match e {
        Error::Poisoned { cause, .. } => {
            assert!(cause.to_string().contains("closed"), "{what}: {cause}")
        }
        other => panic!("{what} after shutdown: {other:?}"),
    }
}

/// Ring body, 2 ranks: the sender fills its ring (TM 0), arms the send and the channel (both
/// `Armed`), its descriptor stays quiet, and becomes readable once the reader drains; the next
/// arm reports it once.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn arm_send_on_full_ring_fires_when_the_reader_drains(rig: &Rig) {
    let bar = Barrier::new(2);
    rig.run(2, |me, mut ch| {
        if me == 0 {
            let OpenedChannel {
                links, incoming, ..
            } = &mut ch;
            let fd = incoming.readiness_fd().expect("a readiness descriptor");
            let tx = links[1].as_mut().expect("link").tx.as_mut();
            fill(tx);
            assert_eq!(
                tx.arm_send().unwrap(),
                Armed::Armed,
                "full ring, reader idle"
            );
            assert_eq!(incoming.arm().unwrap(), Armed::Armed, "nothing incoming");
            assert!(!readable(fd, Duration::from_millis(100)), "armed and idle");
            bar.wait();
            let t0 = Instant::now();
            assert!(
                readable(fd, BOUND),
                "the reader freed room: the descriptor must fire"
            );
            tracing::info!(
                "{}: arm_send: readable {:?} after the reader started",
                rig.name,
                t0.elapsed()
            );
            assert_eq!(incoming.arm().unwrap(), Armed::Busy, "the send's progress");
            let sent = tx
                .with_buffer(0, 1, &mut |b: &mut [u8]| b.len().min(1))
                .unwrap();
            assert!(sent.is_ready(), "room after the drain");
            assert_eq!(incoming.arm().unwrap(), Armed::Armed);
            bar.wait();
        } else {
            bar.wait();
            let (n, e) = drain(link(&mut ch, 0).rx.as_mut());
            assert!(n > 0 && e.is_none(), "{n} B, {e:?}");
            bar.wait();
        }
    });
}

/// Ring body, 3 ranks: rank 0 shuts its channel down while three of its threads wait: a
/// receive from rank 2 (in `RxLink::wait`), the any-source `Incoming::wait`, and a send to
/// rank 1 blocked on a full ring (`TxLink::wait`). Each must return within [`PROMPT`] and fail
/// afterwards; ranks 1 and 2 see a clean close (their receive from 0 is `PeerClosed` once
/// drained, their next message to 0 too), and rank 2's armed descriptor fires.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn shutdown_wakes_blocked_waits_promptly(rig: &Rig) {
    let bar = Barrier::new(3);
    let times = Mutex::new(Vec::new());
    rig.run(3, |me, ch| ring_shutdown_rank(rig, me, ch, &bar, &times));
    assert_eq!(times.lock().unwrap().len(), 3);
}

fn ring_shutdown_rank(
    rig: &Rig,
    me: usize,
    mut ch: OpenedChannel,
    bar: &Barrier,
    times: &Mutex<Vec<Duration>>,
) {
    match me {
        0 => {
            fill(link(&mut ch, 1).tx.as_mut());
            bar.wait();
            let OpenedChannel {
                mut links,
                incoming,
                ..
            } = ch;
            // Both halves stay: dropping one closes it, which the peers would see.
            let mut l1 = links[1].take().expect("link");
            let mut l2 = links[2].take().expect("link");
            let to1 = l1.tx.as_mut();
            let from2 = l2.rx.as_mut();
            let shut = AtomicBool::new(false);
            let t_shut = Mutex::new(Instant::now());
            let since = || {
                assert!(shut.load(Ordering::SeqCst), "returned before the shutdown");
                t_shut.lock().unwrap().elapsed()
            };
            // A wait that never notices (the loop goes on after its slices) gives up after two
            // seconds, so that the test fails instead of hanging.
            let given_up = || shut.load(Ordering::SeqCst) && since() > Duration::from_secs(2);
            std::thread::scope(|s| {
                let rx = s.spawn(|| loop {
                    match from2.poll_message() {
                        Ok(Poll::Pending) => from2.wait(Duration::from_secs(10)).unwrap(),
                        Ok(Poll::Ready(())) => panic!("rank 2 sent nothing"),
                        Err(e) => return (since(), e),
                    }
                    if given_up() {
                        return (since(), Error::Timeout(since()));
                    }
                });
                let any = s.spawn(|| loop {
                    incoming.wait(Duration::from_secs(10)).unwrap();
                    if shut.load(Ordering::SeqCst) {
                        return since();
                    }
                });
                let tx = s.spawn(|| loop {
                    match to1.with_buffer(0, 64, &mut |b: &mut [u8]| b.len().min(64)) {
                        Ok(Poll::Pending) => {
                            if let Err(e) = to1.wait(Duration::from_secs(10)) {
                                return (since(), e);
                            }
                        }
                        Ok(Poll::Ready(())) => {}
                        Err(e) => return (since(), e),
                    }
                    if given_up() {
                        return (since(), Error::Timeout(since()));
                    }
                });
                std::thread::sleep(Duration::from_millis(150));
                *t_shut.lock().unwrap() = Instant::now();
                shut.store(true, Ordering::SeqCst);
                incoming.shutdown();
                let (t_rx, e_rx) = rx.join().unwrap();
                let t_any = any.join().unwrap();
                let (t_tx, e_tx) = tx.join().unwrap();
                tracing::info!(
                    "{}: shutdown: RxLink::wait returned after {t_rx:?} ({e_rx}), \
                     Incoming::wait after {t_any:?}, TxLink::wait after {t_tx:?} ({e_tx})",
                    rig.name
                );
                times.lock().unwrap().extend([t_rx, t_any, t_tx]);
                for t in [t_rx, t_any, t_tx] {
                    assert!(t < PROMPT, "a wait took {t:?} to notice the shutdown");
                }
            });
            bar.wait();
            drop((l1, l2, links));
        }
        1 => {
            bar.wait();
            bar.wait();
            let l = link(&mut ch, 0);
            let (n, e) = drain(l.rx.as_mut());
            assert!(n > 0, "what rank 0 published is delivered");
            assert!(
                matches!(e, Some(Error::PeerClosed { rank: 0 })),
                "then a clean close: {e:?}"
            );
            let r = l.rx.poll_message();
            assert!(
                matches!(r, Err(Error::PeerClosed { rank: 0 })),
                "receive from 0 after its close: {r:?}"
            );
            let r = l.tx.begin_message();
            assert!(
                matches!(r, Err(Error::PeerClosed { rank: 0 })),
                "next message from 0 after its close: {r:?}"
            );
        }
        _ => {
            let OpenedChannel {
                links, incoming, ..
            } = &mut ch;
            let fd = incoming.readiness_fd().expect("a readiness descriptor");
            assert_eq!(incoming.arm().unwrap(), Armed::Armed);
            bar.wait();
            assert!(
                !readable(fd, Duration::from_millis(50)),
                "quiet until rank 0 closes"
            );
            let t0 = Instant::now();
            assert!(
                readable(fd, BOUND),
                "rank 0's close must wake an armed peer"
            );
            tracing::info!(
                "{}: shutdown: the armed peer's descriptor fired {:?} after a 50 ms quiet check \
                 (rank 0 closes 150 ms after the barrier)",
                rig.name,
                t0.elapsed()
            );
            bar.wait();
            let l = links[0].as_mut().expect("link");
            let r = l.rx.poll_message();
            assert!(
                matches!(r, Err(Error::PeerClosed { rank: 0 })),
                "receive from 0 after its close: {r:?}"
            );
            let r = l.tx.begin_message();
            assert!(
                matches!(r, Err(Error::PeerClosed { rank: 0 })),
                "next message from 0 after its close: {r:?}"
            );
        }
    }
}

/// Stream body, `ranks` ranks (more than 4 for a driver whose any-source waits then use its
/// epoll set): a [`BIG`] send blocked on a reader that does not read: after `Pending`,
/// `arm_send` says `Armed`, the readiness descriptor stays quiet, and becomes readable once the
/// reader drains; the send then completes, its events make at most [`Rig::send_events`] arms
/// `Busy`, and the idle descriptor stays quiet.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn arm_send_wakes_when_the_reader_drains(rig: &Rig, ranks: usize) {
    let tm = rig.stream_tm;
    let mut chans = rig.group(ranks);
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let inc = &chans[0].incoming;
    let fd = inc.readiness_fd().expect("a readiness descriptor");
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
            .send_refs(tm, &[IoSlice::new(&body)])
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
    // The reader drains the connection on another thread.
    let t0 = Instant::now();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; BIG];
        drive(|| b.rx.recv_refs(tm, &mut [IoSliceMut::new(&mut buf)])).unwrap();
        assert!(buf.iter().all(|&x| x == 7));
        b
    });
    assert!(
        readable(fd, Duration::from_secs(10)),
        "the readiness descriptor stayed quiet after the reader drained the connection"
    );
    tracing::info!(
        "{} ({ranks} ranks): the armed send made the descriptor readable {:?} after the \
         reader started",
        rig.name,
        t0.elapsed()
    );
    drive(|| a.tx.send_refs(tm, &[IoSlice::new(&body)])).unwrap();
    drive(|| a.tx.end_message()).unwrap();
    let b = reader.join().unwrap();
    // The one-shot registrations report the send's events a bounded number of times; the
    // writable connection does not keep the descriptor readable afterwards.
    let mut busy = 0;
    while inc.arm().unwrap() == Armed::Busy {
        busy += 1;
        assert!(
            busy <= rig.send_events,
            "arm keeps saying Busy after the send completed"
        );
    }
    assert!(
        !readable(fd, Duration::from_millis(200)),
        "readable while idle after the send completed"
    );
    drop(b);
}

/// Stream body, `ranks` ranks (at least 3): `Incoming::shutdown` on rank 0 ends a receive from
/// rank 1 and a [`BIG`] send to rank 2 (which reads nothing, started before the waiters) that
/// wait, and an
/// `Incoming::wait`, without touching the links: each waiter loops like the engine's progress
/// loop (a wait may return at the end of a slice) and must be done within 1 s. The receive and
/// the send then fail naming the close, the message's end fails too, and rank 1 (between
/// messages) sees a clean close: end of stream, not a reset.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn shutdown_wakes_and_closes_cleanly(rig: &Rig, ranks: usize) {
    let tm = rig.stream_tm;
    let mut chans = rig.group(ranks);
    let mut from1 = take(&mut chans[0], 1);
    let mut to2 = take(&mut chans[0], 2);
    let mut at1 = take(&mut chans[1], 0);
    let at2 = take(&mut chans[2], 0);
    let inc: Arc<dyn Incoming> = Arc::from(std::mem::replace(
        &mut chans[0].incoming,
        Box::new(NoIncoming),
    ));
    // Rank 2 reads nothing: the send fills the connection (before the waiters start, so that
    // the shutdown cannot come first).
    let body = vec![1u8; BIG];
    to2.tx.begin_message().unwrap();
    assert!(
        to2.tx
            .send_refs(tm, &[IoSlice::new(&body)])
            .unwrap()
            .is_pending(),
        "{BIG} bytes fit in the buffers"
    );
    let long = BOUND;
    let rx_waiter = std::thread::spawn(move || {
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
    let tx_waiter = std::thread::spawn(move || {
        let e = loop {
            let _ = to2.tx.wait(long);
            match to2.tx.send_refs(tm, &[IoSlice::new(&body)]) {
                Ok(Poll::Pending) => {}
                Ok(Poll::Ready(())) => panic!("a send to a peer that reads nothing completed"),
                Err(e) => break e,
            }
        };
        (Instant::now(), e, to2)
    });
    let inc2 = inc.clone();
    let closing = Arc::new(AtomicBool::new(false));
    let closing2 = closing.clone();
    let any_waiter = std::thread::spawn(move || loop {
        let _ = inc2.wait(long);
        if closing2.load(Ordering::Acquire) {
            return Instant::now();
        }
    });
    std::thread::sleep(Duration::from_millis(300)); // everyone is waiting by now
    let t0 = Instant::now();
    closing.store(true, Ordering::Release);
    inc.shutdown();
    let (t_rx, e_rx) = rx_waiter.join().unwrap();
    let (t_tx, e_tx, mut to2) = tx_waiter.join().unwrap();
    let t_any = any_waiter.join().unwrap();
    let took = |t: Instant| t.saturating_duration_since(t0);
    tracing::info!(
        "{} ({ranks} ranks): after shutdown the waiting receive failed in {:?}, the waiting \
         send in {:?}, Incoming::wait returned in {:?}",
        rig.name,
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
    assert_closed(&e_rx, "receive");
    assert_closed(&e_tx, "send");
    assert!(to2.tx.end_message().is_err());
    let deadline = Instant::now() + BOUND;
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

/// Stream body, 2 ranks in block mode: a receive waiting for the rest of a gather piece (half
/// of it sent, then silence; a socket driver waits in the kernel) is ended by
/// `Incoming::shutdown` within 1 s, naming the close.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn shutdown_wakes_a_blocking_gather_receive(rig: &Rig) {
    let tm = rig.stream_tm;
    let policy = ProgressPolicy {
        mode: ProgressMode::Block,
        ..ProgressPolicy::default()
    };
    let mut chans = rig.group_with(2, &policy);
    let mut c1 = chans.pop().expect("rank 1");
    let mut c0 = chans.pop().expect("rank 0");
    let mut a = take(&mut c0, 1);
    let mut b = take(&mut c1, 0);
    // Half of a gather piece, then silence: the receiver waits for the rest. (The half may not
    // fit in the transport's buffers: it is sent while the receiver reads.)
    let sender = std::thread::spawn(move || {
        let half = vec![3u8; 256 << 10];
        a.tx.begin_message().unwrap();
        drive(|| a.tx.send_refs(tm, &[IoSlice::new(&half)])).unwrap();
        drive(|| a.tx.end_message()).unwrap();
        a
    });
    let receiver = std::thread::spawn(move || {
        let mut body = vec![0u8; 1 << 20];
        let mut iov = [IoSliceMut::new(&mut body)];
        let e = loop {
            match b.rx.recv_refs(tm, &mut iov) {
                Ok(Poll::Pending) => {}
                Ok(Poll::Ready(())) => panic!("half a piece reported complete"),
                Err(e) => break e,
            }
        };
        (Instant::now(), e)
    });
    let a = sender.join().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    c1.incoming.shutdown();
    let (t, e) = receiver.join().unwrap();
    let took = t.saturating_duration_since(t0);
    tracing::info!(
        "{} (block mode): shutdown ended a blocking gather receive in {took:?}",
        rig.name
    );
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert_closed(&e, "receive");
    drop(a);
}

/// Both families, `ranks` ranks (at least 3): a peer that left makes the armed descriptor
/// readable; once the core has heard it (`PeerClosed`) and forgotten the peer, the ended
/// connection no longer keeps the descriptor readable (an event loop would spin) nor arm
/// `Busy`.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn departed_peer_then_quiet(rig: &Rig, ranks: usize) {
    let mut chans = rig.group(ranks);
    let mut from2 = take(&mut chans[0], 2);
    let departing = chans.remove(2);
    let inc = &chans[0].incoming;
    let fd = inc.readiness_fd().expect("a readiness descriptor");
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
