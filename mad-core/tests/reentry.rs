//! A thread that asks again for a direction of a connection it already holds (a second
//! `begin_packing` to the same peer while its first `Packer` is alive, or a second
//! `begin_unpacking_from` the same peer) gets `Error::InUse` at once instead of waiting for
//! itself forever; the first message is unaffected. Any-source reception skips the peer the
//! thread is already unpacking from and serves the others.

use std::time::Duration;

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::mem::MemDriver;
use mad_core::{Error, RecvMode, Session};

#[test]
fn a_thread_holding_a_direction_gets_in_use_not_a_deadlock() {
    let boots = ThreadBootstrap::group(3);
    std::thread::scope(|s| {
        for b in boots {
            s.spawn(move || {
                let rank = b.rank();
                let session = Session::builder()
                    .driver(MemDriver)
                    .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("re", "mem,timeout_ms=20000").unwrap())
                    .unwrap();
                match rank {
                    0 => {
                        // Sending: a second packer to rank 1 while the first is alive.
                        let mut p = ch.begin_packing(1).unwrap();
                        p.pack_value(&1u32, RecvMode::Express).unwrap();
                        let e = ch.begin_packing(1).map(|_| ()).unwrap_err();
                        assert!(
                            matches!(
                                e,
                                Error::InUse {
                                    rank: 1,
                                    direction: "message to"
                                }
                            ),
                            "{e}"
                        );
                        // Another peer is fine meanwhile.
                        let mut q = ch.begin_packing(2).unwrap();
                        q.pack_value(&2u32, RecvMode::Express).unwrap();
                        q.end_packing().unwrap();
                        p.end_packing().unwrap();
                        // And the connection is intact afterwards.
                        let mut p = ch.begin_packing(1).unwrap();
                        p.pack_value(&3u32, RecvMode::Express).unwrap();
                        p.end_packing().unwrap();
                    }
                    1 => {
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        let e = ch.begin_unpacking_from(0).map(|_| ()).unwrap_err();
                        assert!(
                            matches!(
                                e,
                                Error::InUse {
                                    rank: 0,
                                    direction: "message from"
                                }
                            ),
                            "{e}"
                        );
                        assert_eq!(u.unpack_value::<u32>().unwrap(), 1);
                        // Any source while holding rank 0's message: rank 0's next message is
                        // not ours to take yet; rank 2's is.
                        let mut v = ch.begin_unpacking().unwrap();
                        assert_eq!(v.remote(), 2);
                        assert_eq!(v.unpack_value::<u32>().unwrap(), 20);
                        v.end_unpacking().unwrap();
                        u.end_unpacking().unwrap();
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        assert_eq!(u.unpack_value::<u32>().unwrap(), 3);
                        u.end_unpacking().unwrap();
                    }
                    _ => {
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        assert_eq!(u.unpack_value::<u32>().unwrap(), 2);
                        u.end_unpacking().unwrap();
                        // Let rank 1 start on rank 0's messages first.
                        std::thread::sleep(Duration::from_millis(100));
                        let mut p = ch.begin_packing(1).unwrap();
                        p.pack_value(&20u32, RecvMode::Express).unwrap();
                        p.end_packing().unwrap();
                    }
                }
            });
        }
    });
}
