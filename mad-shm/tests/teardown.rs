//! "The connection is the unit of failure": an abandoned receive or send tears the connection
//! down in both directions, visibly for the peer, and a send to a peer that died while we were
//! idle fails instead of vanishing. Ranks are threads with their own sessions (here the peer closes;
//! a peer process that dies: `processes.rs`).

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{Channel, ChannelConfig, RecvMode, SendMode, Session};
use mad_shm::ShmDriver;

/// Bound of every wait of these tests: past it, the call is taken as hung.
const HANG: Duration = Duration::from_secs(20);

/// Run `body(rank, channel, barrier)` on two threads, each with its own session.
fn run2<F>(spec: &str, body: F)
where
    F: Fn(usize, Channel, &Barrier) + Send + Sync + Clone + 'static,
{
    let bar = Arc::new(Barrier::new(2));
    let hs: Vec<_> = ThreadBootstrap::group(2)
        .into_iter()
        .map(|b| {
            let (body, spec, bar) = (body.clone(), spec.to_string(), bar.clone());
            thread::spawn(move || {
                let s = Session::builder()
                    .driver(ShmDriver::new())
                    .bootstrap(Box::new(b))
                    .build()
                    .unwrap();
                let ch = s
                    .open_channel_with(ChannelConfig::parse("t", &spec).unwrap())
                    .unwrap();
                body(s.rank(), ch, &bar);
            })
        })
        .collect();
    for h in hs {
        h.join().expect("a rank failed");
    }
}

/// Run `f` on a helper thread; `None` if it has not returned within [`HANG`].
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(HANG).ok()
}

/// One message: a u64 EXPRESS then `len` bytes CHEAPER.
fn send(ch: &Channel, to: usize, body: &[u8]) -> mad_core::Result<()> {
    let mut p = ch.begin_packing(to)?;
    p.pack_value(&(body.len() as u64), RecvMode::Express)?;
    p.pack(body, RecvMode::Cheaper)?;
    p.end_packing()
}

/// The receiver unpacks the u64 of a 16 MiB message and drops its `Unpacker`, and stays
/// alive. The sender, blocked in `end_packing` with the kernel buffers full, must fail
/// promptly (tcp waited for room forever), and
/// its next 1 MiB message must fail too (it returned `Ok` and was lost). Every progress mode:
/// in `block` the sender waits inside the kernel.
#[test]
fn receiver_abort_fails_the_blocked_sender_and_its_next_send() {
    for progress in ["adaptive", "block", "poll"] {
        run2(&format!("shm,progress={progress}"), move |rank, ch, bar| {
            let ch = Arc::new(ch);
            if rank == 0 {
                let c = ch.clone();
                let t0 = Instant::now();
                let r = bounded(move || send(&c, 1, &vec![7u8; 16 << 20]));
                let r = r.unwrap_or_else(|| {
                    panic!("{progress}: end_packing still blocked after {HANG:?}")
                });
                assert!(r.is_err(), "{progress}: the 16 MiB message was 'sent'");
                eprintln!("{progress}: sender failed after {:?}: {r:?}", t0.elapsed());
                let c = ch.clone();
                let r2 = bounded(move || send(&c, 1, &vec![8u8; 1 << 20])).unwrap();
                assert!(r2.is_err(), "{progress}: the next 1 MiB send returned Ok");
                // This side's receive half is closed too.
                let c = ch.clone();
                let r3 = bounded(move || c.begin_unpacking_from(1).map(drop)).unwrap();
                assert!(r3.is_err(), "{progress}: receive on a torn connection");
                bar.wait();
            } else {
                {
                    let mut u = ch.begin_unpacking_from(0).unwrap();
                    let n: u64 = u.unpack_value().unwrap();
                    assert_eq!(n, 16 << 20);
                    // Dropped here, midway.
                }
                // Alive, not reading, until the sender is done.
                bar.wait();
                // Our own halves are torn down too.
                assert!(send(&ch, 0, &[1, 2, 3]).is_err());
            }
        });
    }
}

/// The sender abandons a message after its header left; the receiver, blocked in the middle
/// of it, gets an error, and its sends on that connection fail too .
#[test]
fn sender_abort_fails_the_blocked_receiver_and_its_sends() {
    run2("shm", |rank, ch, bar| {
        if rank == 0 {
            let big = vec![3u8; 16 << 20];
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_value(&(big.len() as u64), RecvMode::Express)
                .unwrap();
            p.flush().unwrap();
            bar.wait(); // the receiver has the header
            thread::sleep(Duration::from_millis(100));
            drop(p);
            // This side's receive half is closed too.
            let r = ch.begin_unpacking_from(1).map(drop);
            assert!(r.is_err(), "receive on a torn connection");
            bar.wait();
        } else {
            let mut u = ch.begin_unpacking_from(0).unwrap();
            let n: u64 = u.unpack_value().unwrap();
            bar.wait();
            let mut big = vec![0u8; n as usize];
            let t0 = Instant::now();
            let r = u.unpack(&mut big, SendMode::Cheaper);
            let r = r.and_then(|()| u.end_unpacking());
            assert!(r.is_err(), "half a message delivered");
            assert!(t0.elapsed() < HANG);
            let mut failed = false;
            for _ in 0..3 {
                if send(&ch, 0, &vec![1u8; 1 << 20]).is_err() {
                    failed = true;
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
            assert!(
                failed,
                "sends to a peer that tore the connection down kept succeeding"
            );
            bar.wait();
        }
    });
}

/// A peer whose channel is gone (closed, or its process died) while we were idle: after 2 s
/// the very first send fails (it returned `Ok` and the message was lost), and an any-source
/// receive learns that the peer is gone.
#[test]
fn send_to_a_peer_gone_while_idle_fails() {
    run2("shm", |rank, ch, bar| {
        if rank == 1 {
            drop(ch);
            bar.wait();
            return;
        }
        bar.wait();
        thread::sleep(Duration::from_secs(2));
        let r = send(&ch, 1, &[9u8; 1024]);
        assert!(r.is_err(), "first send to a gone peer returned Ok");
        // An any-source receive learns it too (the engine reports "every peer closed").
        let ch = Arc::new(ch);
        let r = bounded(move || ch.begin_unpacking().map(drop));
        let r = r.expect("begin_unpacking never reported the peer gone");
        assert!(r.is_err(), "a message from a gone peer");
    });
}
