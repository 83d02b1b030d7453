//! sisci's part of "a `Packer` dropped with nothing visible is discarded": short-slot flags are
//! published lazily (at a commit, the end, an EXPRESS piece or back-pressure), so small CHEAPER
//! pieces copied into slots and then abandoned never reach the peer. The rules every driver
//! shares (teardown both ways, dead peers) are conformance-kit cases (`mad_core::conformance`).

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{Channel, ChannelConfig, RecvMode, SendMode, Session};
use mad_sisci::SisciDriver;

/// Run `body(rank, channel)` on two threads, each with its own session.
fn run2(spec: &str, body: impl Fn(usize, Channel) + Send + Sync + Copy) {
    std::thread::scope(|s| {
        for b in ThreadBootstrap::group(2) {
            let spec = spec.to_string();
            s.spawn(move || {
                let session = Session::builder()
                    .driver(SisciDriver::new())
                    .bootstrap(Box::new(b))
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("t", &spec).unwrap())
                    .unwrap();
                body(session.rank(), ch);
            });
        }
    });
}

/// One message: a u64 EXPRESS then `body` CHEAPER.
fn send(ch: &Channel, to: usize, body: &[u8]) -> mad_core::Result<()> {
    let mut p = ch.begin_packing(to)?;
    p.pack_value(&(body.len() as u64), RecvMode::Express)?;
    p.pack(body, RecvMode::Cheaper)?;
    p.end_packing()
}

/// A `Packer` dropped after small CHEAPER pieces (copied into short slots, nothing published
/// yet) is discarded and the connection stays intact: the next message arrives whole. (The
/// slots were published at each lend, so the drop broke the connection.)
#[test]
fn packer_dropped_before_anything_was_visible_is_discarded() {
    run2("sisci:local", |rank, ch| {
        if rank == 0 {
            {
                let mut p = ch.begin_packing(1).unwrap();
                p.pack(&[1u8; 16], RecvMode::Cheaper).unwrap();
                p.pack(&[2u8; 100], RecvMode::Cheaper).unwrap();
                // Dropped: nothing of it may reach rank 1.
            }
            send(&ch, 1, &[4u8; 200]).unwrap();
        } else {
            let mut u = ch.begin_unpacking_from(0).unwrap();
            let n: u64 = u.unpack_value().unwrap();
            assert_eq!(n, 200);
            let mut body = vec![0u8; 200];
            u.unpack(&mut body, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(body, vec![4u8; 200]);
        }
    });
}
