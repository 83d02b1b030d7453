//! Any-source reception when peers leave: a clean close between messages removes the peer from
//! the set; when every peer is gone, `begin_unpacking` fails instead of waiting forever, in
//! every progress mode.

use std::time::{Duration, Instant};

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::mem::MemDriver;
use mad_core::{Error, RecvMode, Session};

fn run(mode: &str) {
    let boots = ThreadBootstrap::group(3);
    std::thread::scope(|s| {
        for b in boots {
            let mode = mode.to_string();
            s.spawn(move || {
                let rank = b.rank();
                let session = Session::builder()
                    .driver(MemDriver)
                    .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(
                        ChannelConfig::parse("leave", &format!("mem,progress={mode}")).unwrap(),
                    )
                    .unwrap();
                match rank {
                    0 => {
                        // Rank 2 leaves at once; rank 1 sends one message, then leaves.
                        let mut u = ch.begin_unpacking().unwrap();
                        assert_eq!(u.remote(), 1);
                        let v: u32 = u.unpack_value().unwrap();
                        assert_eq!(v, 7);
                        u.end_unpacking().unwrap();
                        let t = Instant::now();
                        let e = ch.begin_unpacking().map(|_| ()).unwrap_err();
                        assert!(matches!(e, Error::Poisoned { .. }), "{e}");
                        assert!(
                            t.elapsed() < Duration::from_secs(5),
                            "took {:?}",
                            t.elapsed()
                        );
                    }
                    1 => {
                        std::thread::sleep(Duration::from_millis(50));
                        let mut p = ch.begin_packing(0).unwrap();
                        p.pack_value(&7u32, RecvMode::Express).unwrap();
                        p.end_packing().unwrap();
                        drop(ch);
                    }
                    _ => drop(ch),
                }
            });
        }
    });
}

#[test]
fn all_peers_gone_adaptive() {
    run("adaptive");
}

#[test]
fn all_peers_gone_block() {
    run("block");
}

#[test]
fn all_peers_gone_poll() {
    run("poll");
}
