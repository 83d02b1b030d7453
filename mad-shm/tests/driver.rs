//! Driver-level tests with threads (same process, real `/dev/shm` mappings).

// Real mappings, futexes and processes: nothing here runs under miri.
#![cfg(not(miri))]

mod common;

use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::PermissionsExt;

use common::*;
use mad_core::driver::{Driver, RxLink, TxLink};
use mad_core::Error;
use mad_shm::ShmDriver;

fn tx(ch: &mut mad_core::driver::OpenedChannel, r: usize) -> &mut dyn TxLink {
    ch.links[r].as_mut().expect("link").tx.as_mut()
}
fn rx(ch: &mut mad_core::driver::OpenedChannel, r: usize) -> &mut dyn RxLink {
    ch.links[r].as_mut().expect("link").rx.as_mut()
}

/// A message with a small copied header and a large gather group, both directions.
fn exchange(cfg: mad_core::ChannelConfig, big: usize) {
    run_threads(2, cfg, move |me, mut ch| {
        let peer = 1 - me;
        let cma_tm = if ch.links[peer].is_some() { 1 } else { 0 };
        let a = pattern(big / 2, me as u8);
        let b = pattern(big - big / 2, 100 + me as u8);
        let hdr = (big as u64).to_le_bytes();
        if me == 0 {
            send_copy(tx(&mut ch, peer), &hdr[..]).unwrap();
            send_group(
                tx(&mut ch, peer),
                cma_tm,
                &[IoSlice::new(&a), IoSlice::new(&b)],
            )
            .unwrap();
            assert!(tx(&mut ch, peer).end_message().unwrap().is_ready());
        }
        if me == 1 {
            let mut h = [0u8; 8];
            recv_copy(rx(&mut ch, peer), &mut h).unwrap();
            assert_eq!(u64::from_le_bytes(h) as usize, big);
            // Receive into a differently split destination.
            let mut out = vec![0u8; big];
            let (x, y) = out.split_at_mut(big / 3);
            recv_group(
                rx(&mut ch, peer),
                cma_tm,
                &mut [IoSliceMut::new(x), IoSliceMut::new(y)],
            )
            .unwrap();
            let mut want = pattern(big / 2, 0);
            want.extend(pattern(big - big / 2, 100));
            assert!(out == want, "gather payload differs");
        }
    });
}

#[test]
fn cma_single_copy_between_threads() {
    exchange(config(&[("cma", "always")]), 3 << 20);
}

/// `cma=auto` (the default): an isolated group of the `cma` TM is streamed through the ring
/// behind its record.
#[test]
fn cma_auto_isolated_group_streams_through_ring() {
    exchange(config(&[("cma", "auto"), ("ring", "65536")]), 1 << 20);
}

/// `cma=auto`: groups sent back to back (CMA from the second on) and after a reply (streamed
/// again), into differently split destinations; every byte arrives in order.
#[test]
fn cma_auto_back_to_back_and_after_a_reply() {
    run_threads(2, config(&[("cma", "auto")]), |me, mut ch| {
        let peer = 1 - me;
        let size = 300 << 10;
        // Built beforehand: the groups of a burst must follow each other within
        // `BACK_TO_BACK` to go through CMA.
        let bodies: Vec<(Vec<u8>, Vec<u8>)> = (0..=100u8)
            .map(|s| {
                (
                    pattern(size / 4, s),
                    pattern(size - size / 4, s.wrapping_add(1)),
                )
            })
            .collect();
        let one = |ch: &mut mad_core::driver::OpenedChannel, seed: u8| {
            let (a, b) = &bodies[seed as usize];
            let t = tx(ch, peer);
            t.begin_message().unwrap();
            send_copy(t, &[seed]).unwrap();
            send_group(t, 1, &[IoSlice::new(a), IoSlice::new(b)]).unwrap();
            assert!(t.end_message().unwrap().is_ready());
        };
        let check = |ch: &mut mad_core::driver::OpenedChannel| {
            let r = rx(ch, peer);
            let mut seed = [0u8; 1];
            recv_copy(r, &mut seed).unwrap();
            let mut out = vec![0u8; size];
            let (x, y) = out.split_at_mut(size / 3);
            recv_group(r, 1, &mut [IoSliceMut::new(x), IoSliceMut::new(y)]).unwrap();
            r.end_message().unwrap();
            let mut want = pattern(size / 4, seed[0]);
            want.extend(pattern(size - size / 4, seed[0].wrapping_add(1)));
            assert!(out == want, "group {} differs", seed[0]);
            seed[0]
        };
        if me == 0 {
            for s in 0..6 {
                one(&mut ch, s);
            }
            assert_eq!(check(&mut ch), 100);
            one(&mut ch, 6);
            one(&mut ch, 7);
        } else {
            for s in 0..6 {
                assert_eq!(check(&mut ch), s);
            }
            one(&mut ch, 100);
            assert_eq!(check(&mut ch), 6);
            assert_eq!(check(&mut ch), 7);
        }
    });
}

#[test]
fn gather_ring_fallback_streams_through_ring() {
    exchange(config(&[("cma", "ring"), ("ring", "8192")]), 1 << 20);
}

#[test]
fn copy_tm_moves_a_large_stream_through_a_small_ring() {
    run_threads(
        2,
        config(&[("cma", "off"), ("ring", "4096")]),
        |me, mut ch| {
            let data = pattern(1 << 20, 9);
            if me == 0 {
                send_copy(tx(&mut ch, 1), &data).unwrap();
            } else {
                let mut out = vec![0u8; data.len()];
                recv_copy(rx(&mut ch, 0), &mut out).unwrap();
                assert!(out == data);
            }
        },
    );
}

#[test]
fn eight_ranks_all_to_all() {
    let bar = std::sync::Arc::new(std::sync::Barrier::new(8));
    run_threads(8, config(&[]), move |me, mut ch| {
        for r in 0..8 {
            if r != me {
                send_copy(tx(&mut ch, r), &[me as u8, r as u8, 7]).unwrap();
            }
        }
        for r in 0..8 {
            if r != me {
                let mut b = [0u8; 3];
                recv_copy(rx(&mut ch, r), &mut b).unwrap();
                assert_eq!(b, [r as u8, me as u8, 7]);
            }
        }
        // Incoming reports nothing once everything is read (while every rank is still open).
        bar.wait();
        let mut seen = Vec::new();
        ch.incoming.poll(&mut |r| seen.push(r)).unwrap();
        bar.wait();
        assert!(seen.is_empty(), "spurious readiness: {seen:?}");
    });
}

#[test]
fn incoming_doorbell_wakes_a_sleeper() {
    run_threads(2, config(&[]), |me, mut ch| {
        if me == 1 {
            std::thread::sleep(std::time::Duration::from_millis(30));
            send_copy(tx(&mut ch, 0), b"ring!").unwrap();
        } else {
            let t0 = std::time::Instant::now();
            let mut who = None;
            while who.is_none() && t0.elapsed() < BOUND {
                ch.incoming.wait(std::time::Duration::from_secs(1)).unwrap();
                ch.incoming.poll(&mut |r| who = Some(r)).unwrap();
            }
            assert_eq!(who, Some(1));
            let mut b = [0u8; 5];
            recv_copy(rx(&mut ch, 1), &mut b).unwrap();
            assert_eq!(&b, b"ring!");
        }
    });
}

#[test]
fn orderly_close_is_peer_closed_after_draining() {
    run_threads(2, config(&[]), |me, mut ch| {
        if me == 0 {
            send_copy(tx(&mut ch, 1), b"last words").unwrap();
            drop(ch);
        } else {
            let mut b = [0u8; 10];
            recv_copy(rx(&mut ch, 0), &mut b).unwrap();
            assert_eq!(&b, b"last words");
            let r = drive(|| rx(&mut ch, 0).poll_message(), |_| Ok(()));
            assert!(matches!(r, Err(Error::PeerClosed { rank: 0 })), "{r:?}");
        }
    });
}

#[test]
fn abort_before_any_byte_is_discarded_after_is_broken() {
    run_threads(2, config(&[]), |me, mut ch| {
        if me == 0 {
            let t = tx(&mut ch, 1);
            t.begin_message().unwrap();
            assert_eq!(t.abort_message(), mad_core::driver::AbortOutcome::Discarded);
            t.begin_message().unwrap();
            send_copy(t, b"good").unwrap();
            // A short lend stays unpublished until commit, end or `publish`: aborting then
            // discards it, and the peer never sees it.
            t.begin_message().unwrap();
            let _ = t.with_buffer(0, 4, &mut |b: &mut [u8]| {
                b[..4].copy_from_slice(b"lost");
                4
            });
            assert_eq!(t.abort_message(), mad_core::driver::AbortOutcome::Discarded);
            // Once published (the engine does so after an EXPRESS piece), the peer may have
            // read it: aborting breaks the link.
            t.begin_message().unwrap();
            let _ = t.with_buffer(0, 4, &mut |b: &mut [u8]| {
                b[..4].copy_from_slice(b"half");
                4
            });
            t.publish().unwrap();
            assert_eq!(t.abort_message(), mad_core::driver::AbortOutcome::Broken);
            assert!(matches!(
                t.begin_message(),
                Err(Error::Poisoned { rank: 1, .. })
            ));
        } else {
            let mut b = [0u8; 4];
            recv_copy(rx(&mut ch, 0), &mut b).unwrap();
            assert_eq!(&b, b"good");
            recv_copy(rx(&mut ch, 0), &mut b).unwrap();
            assert_eq!(&b, b"half");
            let r = recv_copy(rx(&mut ch, 0), &mut b);
            assert!(matches!(r, Err(Error::PeerClosed { rank: 0 })), "{r:?}");
        }
    });
}

#[test]
fn no_leftover_segments_and_mode_0600() {
    run_threads(4, config(&[]), |_, _ch| {});
    let _exclusive = checking();
    assert!(my_segments().is_empty(), "leftovers: {:?}", my_segments());
    // The mode of a segment, checked before it is unlinked.
    let name = format!("mad-shm-{}-test-mode", std::process::id());
    let mut seg = mad_shm::segment::Segment::create(&name, 2, 4096, &[0; 32], 2, "").unwrap();
    let mode = std::fs::metadata(format!("/dev/shm/{name}"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // A second create with the same name fails (O_EXCL).
    assert!(mad_shm::segment::Segment::create(&name, 2, 4096, &[0; 32], 2, "").is_err());
    seg.unlink().unwrap();
    drop(seg);
    assert!(my_segments().is_empty());
}

#[test]
fn stale_segment_of_dead_pid_is_swept() {
    // A pid that cannot exist (above pid_max on Linux).
    let path = "/dev/shm/mad-shm-2147483646-deadbeef-0-0";
    std::fs::write(path, b"stale").unwrap();
    mad_core::hostmem::sweep_stale(mad_shm::segment::PREFIX);
    assert!(!std::path::Path::new(path).exists());
}

#[test]
fn bad_options_are_config_errors() {
    let d = ShmDriver::new();
    for (k, v) in [
        ("ring", "3000"),
        ("ring", "lots"),
        ("cma", "maybe"),
        ("colour", "red"),
    ] {
        // As the session does: the accepted keys first, then the driver's own checks.
        let c = config(&[(k, v)]);
        let r = c
            .check_against(&d.accepted_options(&c))
            .and_then(|_| d.tm_table(&c));
        assert!(matches!(r, Err(Error::BadConfig(_))), "{k}={v}: {r:?}");
    }
    assert_eq!(
        d.tm_table(&config(&[("cma", "off")])).unwrap().tms().len(),
        1
    );
    // The default is `cma=auto`: the ring up to 64 KiB, `cma` up to 1 MiB, `pipe` above.
    let t = d.tm_table(&config(&[])).unwrap();
    assert_eq!(t, d.tm_table(&config(&[("cma", "auto")])).unwrap());
    let names: Vec<_> = t.tms().iter().map(|t| (t.name, t.max_len)).collect();
    assert_eq!(
        names,
        [
            ("ring", mad_shm::DEFAULT_RING_MAX),
            ("cma", mad_shm::DEFAULT_CMA_MAX),
            ("pipe", usize::MAX)
        ]
    );
    assert_eq!(
        d.tm_table(&config(&[("cma", "always")]))
            .unwrap()
            .tms()
            .len(),
        2
    );
}

#[test]
fn mismatched_tables_refuse_to_connect() {
    let shared = opening();
    let bs = mad_core::bootstrap::ThreadBootstrap::group(2);
    let hs: Vec<_> = bs
        .into_iter()
        .map(|b| {
            std::thread::spawn(move || {
                let cfg = if mad_core::bootstrap::Bootstrap::rank(&b) == 0 {
                    config(&[("cma", "auto")])
                } else {
                    config(&[("cma", "off")])
                };
                open_with(&b, &cfg).err()
            })
        })
        .collect();
    for h in hs {
        let e = h.join().unwrap();
        assert!(matches!(e, Some(Error::BadConfig(_))), "{e:?}");
    }
    drop(shared);
    let _exclusive = checking();
    assert!(my_segments().is_empty());
}
