//! Two- and three-rank sessions over `via:soft` through the mad-core API, one TM at a time.

use std::time::Duration;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::config::ChannelConfig;
use mad_core::{RecvMode, SendMode, Session};
use mad_via::ViaDriver;

fn with_sessions(n: usize, spec: &str, f: impl Fn(Session, mad_core::Channel) + Send + Sync) {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(n)
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let session = Session::builder()
                        .driver(ViaDriver::new())
                        .bootstrap(Box::new(b))
                        .build()
                        .unwrap();
                    let cfg = ChannelConfig::parse("t", spec)
                        .unwrap()
                        .op_timeout(Duration::from_secs(20));
                    let ch = session.open_channel_with(cfg).unwrap();
                    f(session, ch)
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

fn every_tm(spec: &str, lens: &'static [usize]) {
    with_sessions(2, spec, |s, ch| {
        for &len in lens {
            let data: Vec<u8> = (0..len).map(|i| (i % 239) as u8).collect();
            if s.rank() == 0 {
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_value(&(len as u64), RecvMode::Express).unwrap();
                p.pack(&data, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            } else {
                let mut u = ch.begin_unpacking().unwrap();
                let n: u64 = u.unpack_value().unwrap();
                assert_eq!(n as usize, len);
                let mut buf = vec![0u8; len];
                u.unpack(&mut buf, SendMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert!(buf == data, "{len} B");
            }
        }
    });
}

#[test]
fn every_tm_through_the_core() {
    // The default soft table: small up to SMALL_MAX, medium above (each threshold ±1).
    const S: usize = mad_via::SMALL_MAX;
    every_tm("via:soft", &[0, 1, 100, S, S + 1, 256 << 10, 3 << 20]);
    // With a medium limit the rendezvous takes over above it.
    every_tm(
        "via:soft,tm.medium=1m",
        &[S, S + 1, 1 << 20, (1 << 20) + 1, 3 << 20],
    );
}

#[test]
fn registered_buffers_travel_without_registration() {
    let f = |b: ThreadBootstrap| {
        let via = ViaDriver::new();
        let handle = via.handle();
        let session = Session::builder()
            .driver(via)
            .bootstrap(Box::new(b))
            .build()
            .unwrap();
        let cfg = ChannelConfig::parse("r", "via:soft")
            .unwrap()
            .op_timeout(Duration::from_secs(20));
        let ch = session.open_channel_with(cfg).unwrap();
        let len = mad_via::SMALL_MAX * 2; // a medium piece
        let mut buf = handle.request_buffer(len);
        let before = handle.stats();
        for round in 0..3u8 {
            if session.rank() == 0 {
                buf.fill(round);
                let mut p = ch.begin_packing(1).unwrap();
                p.pack(&buf, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            } else {
                let mut u = ch.begin_unpacking().unwrap();
                u.unpack(&mut buf, SendMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert!(buf.iter().all(|&x| x == round));
            }
        }
        let after = handle.stats();
        assert_eq!(after.registrations, before.registrations, "no registration");
        assert_eq!(after.owned_hits - before.owned_hits, 3);
        drop(buf); // release: back to the pool, still registered
        let again = handle.request_buffer(len);
        assert_eq!(handle.stats().registrations, after.registrations);
        drop(again);
    };
    let f = &f;
    std::thread::scope(|s| {
        for b in ThreadBootstrap::group(2) {
            s.spawn(move || f(b));
        }
    });
}
