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

#[test]
fn every_tm_through_the_core() {
    with_sessions(2, "via:soft", |s, ch| {
        for len in [
            0usize,
            1,
            100,
            16 << 10,
            (16 << 10) + 1,
            256 << 10,
            (256 << 10) + 1,
            3 << 20,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i % 239) as u8).collect();
            if s.rank() == 0 {
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_value(&(len as u64), RecvMode::Express).unwrap();
                p.pack(&data, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            } else {
                let mut u = ch.begin_unpacking().unwrap();
                let n: u64 = u.unpack_value(SendMode::Cheaper).unwrap();
                assert_eq!(n as usize, len);
                let mut buf = vec![0u8; len];
                u.unpack(&mut buf, SendMode::Cheaper).unwrap();
                u.end_unpacking().unwrap();
                assert!(buf == data, "{len} B");
            }
        }
    });
}
