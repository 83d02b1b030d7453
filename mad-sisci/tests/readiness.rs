//! Driver-level tests of the event-loop contract: `TxLink::arm_send` on a full ring, and
//! `Incoming::shutdown` waking blocked waits of other threads while the peers see a clean
//! close (`sisci:local`: threads of one process, real `/dev/shm` mappings and sockets).

#![cfg(not(miri))]

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::driver::{Armed, Driver, OpenContext, OpenedChannel, RxLink, TxLink};
use mad_core::events::wait_readable;
use mad_core::progress::ProgressPolicy;
use mad_core::Error;
use mad_sisci::SisciDriver;

/// Longest any test waits for one event.
const BOUND: Duration = Duration::from_secs(20);

/// `sisci:local` with two short slots and no `dma` TM: TM 0 fills after two lends.
fn config() -> ChannelConfig {
    ChannelConfig::new("t", "sisci")
        .adapter("local")
        .option("slots", "2")
        .option("ring", "4096")
        .option("dma", "off")
}

/// Open the channel on `n` thread-ranks and run `body(rank, channel)` on each.
fn run_threads<F>(n: usize, body: F)
where
    F: Fn(usize, OpenedChannel) + Send + Sync + Clone + 'static,
{
    let hs: Vec<_> = ThreadBootstrap::group(n)
        .into_iter()
        .map(|b| {
            let body = body.clone();
            std::thread::spawn(move || {
                let cfg = config();
                let d = SisciDriver::new();
                let table = d.tm_table(&cfg).expect("table");
                let progress = ProgressPolicy::default();
                let ctx = OpenContext::new(&cfg, &b, &table, &progress);
                let ch = d.open(&ctx).expect("open");
                body(b.rank(), ch)
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank thread panicked");
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

/// Longer than any prompt wake-up, shorter than a wait slice (50 ms): a wait that returns
/// within it was woken, not timed out.
const PROMPT: Duration = Duration::from_millis(25);

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

fn link(ch: &mut OpenedChannel, r: usize) -> &mut mad_core::driver::LinkPair {
    ch.links[r].as_mut().expect("link")
}

/// The sender fills its ring, arms the send and the channel (both `Armed`), its descriptor
/// stays quiet, and becomes readable once the reader drains; the next arm reports it once.
fn arm_send_body(me: usize, mut ch: OpenedChannel, bar: &Barrier) {
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
            "full slots, reader idle"
        );
        assert_eq!(incoming.arm().unwrap(), Armed::Armed, "nothing incoming");
        assert!(!readable(fd, Duration::from_millis(100)), "armed and idle");
        bar.wait();
        let t0 = Instant::now();
        assert!(
            readable(fd, BOUND),
            "the reader freed room: the descriptor must fire"
        );
        eprintln!(
            "arm_send: readable {:?} after the reader started",
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
}

#[test]
fn arm_send_on_full_slots_fires_when_the_reader_drains() {
    let bar = std::sync::Arc::new(Barrier::new(2));
    run_threads(2, move |me, ch| arm_send_body(me, ch, &bar));
}

/// Rank 0 shuts its channel down while three of its threads wait: a receive from rank 2 (in
/// `RxLink::wait`), the any-source `Incoming::wait`, and a send to rank 1 blocked on a full
/// ring (`TxLink::wait`). Each must return within [`PROMPT`] and fail afterwards; ranks 1
/// and 2 see a clean close (their receive from 0 is `PeerClosed` once drained, their next
/// message to 0 too), and rank 2's armed descriptor fires.
fn shutdown_body(me: usize, mut ch: OpenedChannel, bar: &Barrier, times: &Mutex<Vec<Duration>>) {
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
                eprintln!(
                    "shutdown: RxLink::wait returned after {t_rx:?} ({e_rx}), Incoming::wait \
                     after {t_any:?}, TxLink::wait after {t_tx:?} ({e_tx})"
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
            assert!(matches!(
                l.rx.poll_message(),
                Err(Error::PeerClosed { rank: 0 })
            ));
            assert!(matches!(
                l.tx.begin_message(),
                Err(Error::PeerClosed { rank: 0 })
            ));
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
            eprintln!(
                "shutdown: the armed peer's descriptor fired {:?} after a 50 ms quiet check (rank 0 closes 150 ms after the barrier)",
                t0.elapsed()
            );
            bar.wait();
            let l = links[0].as_mut().expect("link");
            assert!(matches!(
                l.rx.poll_message(),
                Err(Error::PeerClosed { rank: 0 })
            ));
            assert!(matches!(
                l.tx.begin_message(),
                Err(Error::PeerClosed { rank: 0 })
            ));
        }
    }
}

#[test]
fn shutdown_wakes_blocked_waits_and_peers_see_a_clean_close() {
    let bar = std::sync::Arc::new(Barrier::new(3));
    let times = std::sync::Arc::new(Mutex::new(Vec::new()));
    let t = times.clone();
    run_threads(3, move |me, ch| shutdown_body(me, ch, &bar, &t));
    assert_eq!(times.lock().unwrap().len(), 3);
}
