//! Real channels restricted to some ranks (`ranks=`) and virtual channels over several real
//! channels (`virtual:...`, `mad_core::vchan`): routes, any-source over every part, close,
//! clear errors, and the conformance kit over a virtual channel whose peers are reached through
//! different real channels. Ranks are threads of this process over real sockets and shared
//! memory.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::conformance::{run_threads, KitOptions};
use mad_core::vchan::Route;
use mad_core::{ChannelConfig, Error, RecvMode, Session};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Run `body` on `n` ranks (threads), each with a session of every default driver.
fn ranks<F>(n: usize, body: F)
where
    F: Fn(Session) -> mad_core::Result<()> + Sync,
{
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    std::thread::scope(|s| {
        let body = &body;
        let hs: Vec<_> = ThreadBootstrap::group(n)
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let session = madeleine::builder().bootstrap(Box::new(b)).build()?;
                    body(session)
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            h.join()
                .unwrap_or_else(|_| panic!("rank {r} panicked"))
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    });
}

/// `e` is a configuration error (this rank's, or another's that failed first) saying `what`.
fn bad_config(e: &Error, what: &str) {
    use mad_core::ErrorKind::{Config, RemoteFailure};
    let remote_config = e.kind() == RemoteFailure && e.to_string().contains("bad configuration");
    assert!(e.kind() == Config || remote_config, "{e}");
    assert!(e.to_string().contains(what), "{e}");
}

fn open(s: &Session, name: &str, spec: &str) -> mad_core::Result<mad_core::Channel> {
    s.open_channel_with(ChannelConfig::parse(name, spec)?)
}

#[test]
fn ranks_restrict_a_real_channel() {
    ranks(3, |s| {
        let me = s.rank();
        for spec in ["tcp,ranks=0-1", "shm,ranks=0-1", "sisci:local,ranks=0:1"] {
            let ch = open(&s, "r", spec)?;
            let want: &[usize] = match me {
                0 => &[1],
                1 => &[0],
                _ => &[],
            };
            assert_eq!(ch.peers(), want, "{spec}: peers of rank {me}");
            if me < 2 {
                // The rank outside the set: a clear error, before anything is sent.
                match ch.begin_packing(2) {
                    Err(Error::BadConfig(m)) => assert!(m.contains("rank 2"), "{m}"),
                    other => panic!("{spec}: send to rank 2 gave {other:?}"),
                }
                if me == 0 {
                    let mut p = ch.begin_packing(1)?;
                    p.pack_value(&7u64, RecvMode::Express)?;
                    p.end_packing()?;
                } else {
                    let mut u = ch.begin_unpacking()?;
                    assert_eq!((u.remote(), u.unpack_value::<u64>()?), (0, 7));
                    u.end_unpacking()?;
                }
            } else {
                assert!(ch.begin_packing(0).is_err());
            }
            s.bootstrap().barrier(&format!("r/{spec}"))?;
        }
        // A rank beyond the session is refused at open, on every rank.
        match open(&s, "r2", "tcp,ranks=0-3") {
            Err(e) => bad_config(&e, "ranks=0-3"),
            Ok(_) => panic!("ranks=0-3 over 3 ranks opened"),
        }
        Ok(())
    });
}

#[test]
fn virtual_channel_routes_any_source_and_close() {
    ranks(3, |s| {
        let me = s.rank();
        let ch = open(&s, "v", "virtual:[shm,ranks=0-1]+tcp")?;
        assert_eq!(ch.parts().len(), 2);
        assert_eq!(ch.parts()[0].config().driver, "shm");
        assert_eq!(ch.route(me), Some(Route::Me));
        let expect = |r: usize| {
            if me.max(r) <= 1 {
                Route::Direct { part: 0 }
            } else {
                Route::Direct { part: 1 }
            }
        };
        for r in (0..3).filter(|&r| r != me) {
            assert_eq!(ch.route(r), Some(expect(r)), "rank {me} to {r}");
        }
        // Rank 0 receives from both others by any-source; the pieces went through shm from 1
        // and tcp from 2.
        const ROUNDS: u64 = 50;
        if me == 0 {
            let mut from = [0u64; 3];
            for _ in 0..2 * ROUNDS {
                let mut u = ch.begin_unpacking()?;
                let r = u.remote();
                let v = u.unpack_value::<u64>()?;
                let mut big = vec![0u8; 300_000];
                u.unpack(&mut big, mad_core::SendMode::Cheaper)?;
                u.end_unpacking()?;
                assert_eq!(v, from[r] * 10 + r as u64, "order from rank {r}");
                assert!(big.iter().all(|&b| b == r as u8));
                from[r] += 1;
            }
            assert_eq!(from, [0, ROUNDS, ROUNDS]);
            let st = ch.stats();
            assert_eq!(st.messages_received, 2 * ROUNDS);
            let shm: u64 = st
                .pieces_received
                .iter()
                .filter(|(n, _)| n.starts_with("shm/"))
                .map(|(_, c)| c)
                .sum();
            let tcp: u64 = st
                .pieces_received
                .iter()
                .filter(|(n, _)| n.starts_with("tcp/"))
                .map(|(_, c)| c)
                .sum();
            assert_eq!((shm, tcp), (2 * ROUNDS, 2 * ROUNDS), "{st:?}");
        } else {
            let big = vec![me as u8; 300_000];
            for i in 0..ROUNDS {
                let mut p = ch.begin_packing(0)?;
                p.pack_value(&(i * 10 + me as u64), RecvMode::Express)?;
                p.pack(&big, RecvMode::Cheaper)?;
                p.end_packing()?;
            }
        }
        s.bootstrap().barrier("v/sent")?;
        // close() frees a receiver blocked on the virtual channel, with Closed.
        if me == 0 {
            std::thread::scope(|t| {
                let h = t.spawn(|| {
                    let t0 = Instant::now();
                    let r = ch.begin_unpacking().map(|_| ());
                    (r, t0.elapsed())
                });
                std::thread::sleep(Duration::from_millis(100));
                ch.close();
                let (r, _) = h.join().expect("receiver thread");
                assert!(matches!(r, Err(Error::Closed { .. })), "{r:?}");
            });
            assert!(ch.parts().iter().all(|p| p.is_closed()));
        }
        // The peers stay until the close is tested (their leaving would end the wait first).
        s.bootstrap().barrier("v/closed")?;
        Ok(())
    });
}

#[test]
fn virtual_channel_refuses_ranks_it_cannot_join() {
    ranks(3, |s| {
        match open(&s, "apart", "virtual:[shm,ranks=0-1]") {
            Err(e) => bad_config(&e, "not joined"),
            Ok(_) => panic!("a virtual channel leaving rank 2 out opened"),
        }
        // Options of one part belong in its brackets.
        match open(&s, "bad", "virtual:shm+tcp,ranks=0-1") {
            Err(e) => bad_config(&e, "inside"),
            Ok(_) => panic!("ranks= on the whole of a virtual channel was taken"),
        }
        Ok(())
    });
}

/// Every mode pair, sizes from 0 to beyond a fragment, 0 -> 1 through gateway rank 2, order
/// kept, both any-source and from-rank, and the answer back the other way.
#[test]
fn gateway_forwards_every_mode_in_order() {
    use mad_core::SendMode;
    use std::cell::Cell;
    ranks(3, |s| {
        let me = s.rank();
        let ch = open(&s, "g", "virtual:[shm,ranks=0:2]+[tcp,ranks=1-2]")?;
        assert_eq!(ch.peers().len(), 2);
        match me {
            0 => assert_eq!(
                ch.route(1),
                Some(Route::Gateway {
                    part: 0,
                    via: 2,
                    hops: 2
                })
            ),
            1 => assert_eq!(
                ch.route(0),
                Some(Route::Gateway {
                    part: 1,
                    via: 2,
                    hops: 2
                })
            ),
            _ => assert_eq!(ch.route(0), Some(Route::Direct { part: 0 })),
        }
        let sizes = [0usize, 1, 4095, 300_000, (3 << 20) + 4097];
        let modes = [
            (SendMode::Cheaper, RecvMode::Cheaper),
            (SendMode::Cheaper, RecvMode::Express),
            (SendMode::Safer, RecvMode::Cheaper),
            (SendMode::Safer, RecvMode::Express),
            (SendMode::Later, RecvMode::Cheaper),
            (SendMode::Later, RecvMode::Express),
        ];
        let fill =
            |n: usize, k: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + k * 13) as u8).collect() };
        for (round, &(sm, rm)) in modes.iter().enumerate() {
            if me == 0 {
                let mut p = ch.begin_packing(1)?;
                assert_eq!(p.remote(), 1);
                p.pack_value(&(round as u64), RecvMode::Express)?;
                let datas: Vec<Vec<u8>> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| fill(n, k + round))
                    .collect();
                let mut laters: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
                let cells: Vec<&[Cell<u8>]> = laters
                    .iter_mut()
                    .map(|v| Cell::from_mut(&mut v[..]).as_slice_of_cells())
                    .collect();
                for (k, d) in datas.iter().enumerate() {
                    match sm {
                        SendMode::Cheaper => p.pack(d, rm)?,
                        SendMode::Safer => p.pack_safer(d, rm)?,
                        SendMode::Later => p.pack_later(cells[k], rm)?,
                    }
                }
                // LATER values are the ones at end_packing.
                for (k, c) in cells.iter().enumerate() {
                    for (i, b) in datas[k].iter().enumerate() {
                        c[i].set(*b);
                    }
                }
                p.end_packing()?;
            } else if me == 1 {
                let mut u = if round % 2 == 0 {
                    ch.begin_unpacking()?
                } else {
                    ch.begin_unpacking_from(0)?
                };
                assert_eq!(u.remote(), 0);
                assert_eq!(u.unpack_value::<u64>()?, round as u64);
                let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xEEu8; n]).collect();
                let mut it = bufs.iter_mut();
                for _ in 0..sizes.len() {
                    let b = it.next().expect("a buffer per size");
                    match rm {
                        RecvMode::Express => u.unpack_express(b, sm)?,
                        RecvMode::Cheaper => u.unpack(b, sm)?,
                    }
                }
                u.end_unpacking()?;
                for (k, b) in bufs.iter().enumerate() {
                    assert!(
                        *b == fill(sizes[k], k + round),
                        "round {round}: piece {k} ({} B) differs",
                        sizes[k]
                    );
                }
                // The answer goes back through the gateway too.
                let mut p = ch.begin_packing(0)?;
                p.pack_value(&(round as u64 + 100), RecvMode::Express)?;
                p.end_packing()?;
            }
            if me == 0 {
                let mut u = ch.begin_unpacking_from(1)?;
                assert_eq!(u.unpack_value::<u64>()?, round as u64 + 100);
                u.end_unpacking()?;
            }
        }
        // 0 -> 1 and 2 -> 1 at once: rank 1 gets both by any-source, each in order.
        s.bootstrap().barrier("g/rounds")?;
        const N: u64 = 40;
        if me != 1 {
            for i in 0..N {
                let mut p = ch.begin_packing(1)?;
                p.pack_value(&(i * 10 + me as u64), RecvMode::Express)?;
                p.end_packing()?;
            }
        } else {
            let mut next = [0u64; 3];
            for _ in 0..2 * N {
                let mut u = ch.begin_unpacking()?;
                let r = u.remote();
                assert_eq!(u.unpack_value::<u64>()?, next[r] * 10 + r as u64);
                u.end_unpacking()?;
                next[r] += 1;
            }
        }
        s.bootstrap().barrier("g/done")?;
        Ok(())
    });
}

/// The destination reads a forwarded message either from the transit connection itself
/// (blocking `begin_unpacking_from`) or from the relay the forwarding thread fills (any-source,
/// non-blocking receives): the two take turns on one stream of messages, with pauses that let
/// the forwarding thread take the connection back, and two receiving threads racing for it;
/// every message arrives once, whole, in order. A receive dropped in the middle of a message
/// read from the transit connection breaks the pair both ways, and the gateway still forwards.
#[test]
fn direct_and_relayed_receives_take_turns() {
    use mad_core::SendMode;
    ranks(3, |s| {
        let me = s.rank();
        let ch = open(&s, "turns", "virtual:[shm,ranks=0:2]+[tcp,ranks=1-2]")?;
        const N: u64 = 300;
        let body = |i: u64| -> Vec<u8> {
            (0..(i as usize * 97) % 5000)
                .map(|k| (k as u64 + i) as u8)
                .collect()
        };
        if me == 0 {
            for i in 0..N {
                let b = body(i);
                let mut p = ch.begin_packing(1)?;
                p.pack_value(&i, RecvMode::Express)?;
                p.pack_value(&(b.len() as u64), RecvMode::Express)?;
                p.pack(&b, RecvMode::Cheaper)?;
                p.end_packing()?;
                if i % 37 == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            // One end mark for each of rank 1's two receiving threads.
            for _ in 0..2 {
                let mut p = ch.begin_packing(1)?;
                p.pack_value(&u64::MAX, RecvMode::Express)?;
                p.end_packing()?;
            }
        } else if me == 1 {
            // One thread: turns of blocking, any-source and non-blocking receives.
            let mut got = 0u64;
            while got < N / 2 {
                let u = match got % 3 {
                    0 => ch.begin_unpacking_from(0)?,
                    1 => ch.begin_unpacking()?,
                    _ => loop {
                        if let Some(u) = ch.try_begin_unpacking_from(0)? {
                            break u;
                        }
                        std::thread::yield_now();
                    },
                };
                let mut u = u;
                let i: u64 = u.unpack_value()?;
                assert_eq!(i, got, "order");
                let n: u64 = u.unpack_value()?;
                let mut b = vec![0u8; n as usize];
                u.unpack(&mut b, SendMode::Cheaper)?;
                u.end_unpacking()?;
                assert_eq!(b, body(i), "message {i}");
                got += 1;
                if got % 25 == 0 {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            // Two threads at once: each message once (the order between threads is theirs).
            let seen = std::sync::Mutex::new(Vec::new());
            std::thread::scope(|t| -> mad_core::Result<()> {
                let hs: Vec<_> = (0..2)
                    .map(|k| {
                        let (ch, seen) = (&ch, &seen);
                        t.spawn(move || -> mad_core::Result<()> {
                            loop {
                                let u = if k == 0 {
                                    ch.begin_unpacking_from(0)?
                                } else {
                                    ch.begin_unpacking()?
                                };
                                let mut u = u;
                                let i: u64 = u.unpack_value()?;
                                if i == u64::MAX {
                                    // Each thread stops at the first end mark it gets.
                                    return u.end_unpacking();
                                }
                                let n: u64 = u.unpack_value()?;
                                let mut b = vec![0u8; n as usize];
                                u.unpack(&mut b, SendMode::Cheaper)?;
                                u.end_unpacking()?;
                                assert_eq!(b, body(i), "message {i}");
                                seen.lock().unwrap().push(i);
                            }
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().expect("a receiving thread panicked")?;
                }
                Ok(())
            })?;
            let mut seen = seen.into_inner().unwrap();
            seen.sort_unstable();
            assert_eq!(seen, (N / 2..N).collect::<Vec<_>>());
        }
        s.bootstrap().barrier("turns/stream")?;
        // A direct receive dropped in the middle of a 1 MiB message: the pair is refused
        // both ways afterwards; rank 2 still reaches both.
        if me == 0 {
            let big = vec![5u8; 1 << 20];
            let mut p = ch.begin_packing(1)?;
            p.pack_value(&7u64, RecvMode::Express)?;
            p.pack(&big, RecvMode::Cheaper)?;
            let _ = p.end_packing();
        } else if me == 1 {
            let mut u = ch.begin_unpacking_from(0)?;
            assert_eq!(u.unpack_value::<u64>()?, 7);
            drop(u);
            let r = ch.begin_packing(0).and_then(|mut p| {
                p.pack_value(&1u64, RecvMode::Express)?;
                p.end_packing()
            });
            assert!(
                r.is_err(),
                "a pair broken by an abandoned receive still sends"
            );
        }
        s.bootstrap().barrier("turns/broken")?;
        if me == 2 {
            for r in [0, 1] {
                let mut p = ch.begin_packing(r)?;
                p.pack_value(&42u64, RecvMode::Express)?;
                p.end_packing()?;
            }
        } else {
            let mut u = ch.begin_unpacking_from(2)?;
            assert_eq!(u.unpack_value::<u64>()?, 42);
            u.end_unpacking()?;
        }
        s.bootstrap().barrier("turns/done")?;
        Ok(())
    });
}

/// A chain of four networks: 0 -sisci:local- 1 -shm- 2 -tcp- 3 -via:soft- 4; rank 0 and
/// rank 4 talk through three gateways, a 5 MiB piece pipelined through them.
#[test]
fn chain_of_four_networks() {
    ranks(5, |s| {
        let me = s.rank();
        let ch = open(
            &s,
            "chain",
            "virtual:[sisci:local,ranks=0-1]+[shm,ranks=1-2]+[tcp,ranks=2-3]+[via:soft,ranks=3-4]",
        )?;
        if me == 0 {
            assert_eq!(
                ch.route(4),
                Some(Route::Gateway {
                    part: 0,
                    via: 1,
                    hops: 4
                })
            );
            let big: Vec<u8> = (0..5 << 20).map(|i: usize| (i % 251) as u8).collect();
            for i in 0..3u64 {
                let mut p = ch.begin_packing(4)?;
                p.pack_value(&i, RecvMode::Express)?;
                p.pack(&big, RecvMode::Cheaper)?;
                p.end_packing()?;
            }
            let mut u = ch.begin_unpacking_from(4)?;
            assert_eq!(u.unpack_value::<u64>()?, 99);
            u.end_unpacking()?;
        } else if me == 4 {
            for i in 0..3u64 {
                let mut u = ch.begin_unpacking()?;
                assert_eq!(u.remote(), 0);
                assert_eq!(u.unpack_value::<u64>()?, i);
                let mut big = vec![0u8; 5 << 20];
                u.unpack(&mut big, mad_core::SendMode::Cheaper)?;
                u.end_unpacking()?;
                assert!(big.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
            }
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&99u64, RecvMode::Express)?;
            p.end_packing()?;
        }
        s.bootstrap().barrier("chain/done")?;
        Ok(())
    });
}

/// The whole kit over `spec` (`MAD_KIT_CASES` picks cases, `MAD_LOG` logs).
fn kit(ranks: usize, spec: &str) {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("MAD_LOG"))
        .try_init();
    let opts = KitOptions::new(spec);
    let ran = run_threads(ranks, opts, |b| madeleine::builder().bootstrap(b).build())
        .unwrap_or_else(|e| panic!("conformance over `{spec}` with {ranks} ranks: {e}"));
    assert!(!ran.is_empty());
}

/// Ranks 0 and 1 through shm, rank 2 through tcp.
#[test]
fn kit_virtual_shm_tcp_3_ranks() {
    kit(3, "virtual:[shm,ranks=0-1]+tcp,timeout_ms=60000");
}

/// Ranks 0 and 1 share no network: every case's traffic between them goes through gateway
/// rank 2 (shm to it, tcp from it), the whole kit included. A receive broken in the middle
/// of a message (`receiver_abandons`, `wrong_unpacks`, `deadlines`) sends a break notice to
/// the origin, which refuses the pair both ways from then on.
#[test]
fn kit_through_a_gateway_3_ranks() {
    kit(
        3,
        "virtual:[shm,ranks=0:2]+[tcp,ranks=1-2],timeout_ms=60000",
    );
}

/// A first part that does not reach the peer: everything through the second (via's soft
/// NIC), block mode handed down to both parts.
#[test]
fn kit_virtual_second_part_2_ranks() {
    kit(
        2,
        "virtual:[sisci:local,ranks=1]+via:soft,progress=block,timeout_ms=60000",
    );
}

/// A virtual channel's readiness descriptor (made at first use, over its parts' and relay's
/// descriptors): armed with nothing pending it stays quiet; a message on a part, or forwarded
/// through a gateway into the relay, makes it readable, and the non-blocking receive then
/// finds the message.
#[test]
fn a_virtual_channel_wakes_an_event_loop() {
    use mad_core::driver::Armed;
    use std::os::fd::AsFd;
    fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> bool {
        let mut p = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut p, nix::poll::PollTimeout::from(ms)).unwrap_or(0) > 0
    }
    ranks(3, |s| {
        let me = s.rank();
        // Rank 0 reaches 1 over shm and 2 over tcp; 1 and 2 share no part (rank 0 forwards).
        let ch = open(&s, "ev", "virtual:[shm,ranks=0-1]+[tcp,ranks=0:2]")?;
        for round in 0..2u64 {
            if me < 2 {
                let fd = ch.readiness_fd().expect("every part has a descriptor");
                // `Busy` may come first (false positives are allowed): try, arm again.
                let mut tries = 0;
                loop {
                    assert!(ch.try_begin_unpacking()?.is_none(), "rank {me}: a message?");
                    if ch.arm()? == Armed::Armed {
                        break;
                    }
                    tries += 1;
                    assert!(
                        tries < 100,
                        "rank {me}: arm keeps saying Busy, nothing pending"
                    );
                }
                assert!(
                    !readable(fd.as_fd(), 20),
                    "rank {me}: readable, nothing sent"
                );
            }
            s.bootstrap().barrier(&format!("ev/{round}/armed"))?;
            if me == 2 {
                // To rank 0 directly (tcp), to rank 1 through rank 0.
                for to in [0usize, 1] {
                    let mut p = ch.begin_packing(to)?;
                    p.pack_value(&round, RecvMode::Express)?;
                    p.end_packing()?;
                }
            } else {
                let fd = ch.readiness_fd().expect("every part has a descriptor");
                let t0 = Instant::now();
                while !readable(fd.as_fd(), 100) {
                    assert!(
                        t0.elapsed() < Duration::from_secs(10),
                        "rank {me}: not woken"
                    );
                }
                let mut u = loop {
                    if let Some(u) = ch.try_begin_unpacking()? {
                        break u;
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(10),
                        "rank {me}: no message"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                };
                assert_eq!((u.remote(), u.unpack_value::<u64>()?), (2, round));
                u.end_unpacking()?;
            }
            s.bootstrap().barrier(&format!("ev/{round}/done"))?;
        }
        Ok(())
    });
}
