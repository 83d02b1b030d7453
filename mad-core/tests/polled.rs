//! Deferred messages over the strict in-process driver, small enough for Miri: an event-driven
//! sender (`defer`, `poll_end_packing`, LATER over cells and over atomics, a `SendPacker`) and
//! an event-driven receiver (`defer`, `poll_unpack_express`, `poll_end_unpacking`), with
//! copies split over tiny buffers, gather groups and back-pressure, in checked mode and not.
//! Miri runs it (`.ci/extra-sanitizers.sh`): the plans keep raw pointers to pieces.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::Poll;

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::mem::MemDriver;
use mad_core::{ChannelConfig, RecvMode, SendMode, Session};

fn pat(tag: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| tag ^ (i as u8).wrapping_mul(7)).collect()
}

fn spin<T>(mut f: impl FnMut() -> Poll<mad_core::Result<T>>) -> T {
    loop {
        if let Poll::Ready(r) = f() {
            return r.expect("polled call");
        }
        std::thread::yield_now();
    }
}

fn run(spec: &str) {
    let boots = ThreadBootstrap::group(2);
    std::thread::scope(|s| {
        for b in boots {
            let spec = spec.to_string();
            s.spawn(move || {
                let rank = b.rank();
                let session = Session::builder()
                    .driver(MemDriver)
                    .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("p", &spec).unwrap())
                    .unwrap();
                let (a, big, c) = (pat(1, 5), pat(2, 700), pat(3, 40));
                if rank == 0 {
                    // A packer with cells stays on its thread.
                    let mut later = [0u8; 9];
                    let cells = Cell::from_mut(&mut later[..]).as_slice_of_cells();
                    let mut p = ch.try_begin_packing(1).unwrap().unwrap();
                    p.defer();
                    p.pack_safer(&a, RecvMode::Express).unwrap();
                    p.pack_later(cells, RecvMode::Cheaper).unwrap();
                    p.pack(&big, RecvMode::Cheaper).unwrap();
                    p.pack(&c, RecvMode::Express).unwrap();
                    for (i, x) in cells.iter().enumerate() {
                        x.set(i as u8 + 100);
                    }
                    spin(|| p.poll_end_packing());
                    drop(p);
                    // A SendPacker with LATER over atomics, ended on another thread.
                    let atoms: Vec<AtomicU8> = (0..300).map(|_| AtomicU8::new(0)).collect();
                    let mut p = ch.begin_packing(1).unwrap().into_send().unwrap();
                    p.defer();
                    p.pack_later_atomic(&atoms, RecvMode::Express).unwrap();
                    p.pack(&big, RecvMode::Cheaper).unwrap();
                    for (i, x) in atoms.iter().enumerate() {
                        x.store(i as u8, Ordering::Relaxed);
                    }
                    std::thread::scope(|s| {
                        s.spawn(move || spin(|| p.poll_end_packing()));
                    });
                } else {
                    let (mut ga, mut gbig, mut gc, mut gl) =
                        (vec![0; 5], vec![0; 700], vec![0; 40], vec![0; 9]);
                    let mut u = spin(|| match ch.try_begin_unpacking() {
                        Ok(Some(u)) => Poll::Ready(Ok(u)),
                        Ok(None) => Poll::Pending,
                        Err(e) => Poll::Ready(Err(e)),
                    });
                    u.defer();
                    spin(|| u.poll_unpack_express(&mut ga, SendMode::Safer));
                    assert_eq!(ga, a);
                    u.unpack(&mut gl, SendMode::Later).unwrap();
                    u.unpack(&mut gbig, SendMode::Cheaper).unwrap();
                    spin(|| u.poll_unpack_express(&mut gc, SendMode::Cheaper));
                    assert_eq!(gc, c);
                    spin(|| u.poll_end_unpacking());
                    drop(u);
                    assert_eq!(gbig, big);
                    assert_eq!(gl, (100..109).collect::<Vec<u8>>());
                    // The second message, received by the blocking calls.
                    let mut gat = vec![0u8; 300];
                    let mut u = ch.begin_unpacking_from(0).unwrap();
                    u.unpack_express(&mut gat, SendMode::Later).unwrap();
                    u.unpack(&mut gbig, SendMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert_eq!(gat, (0..300).map(|i| i as u8).collect::<Vec<u8>>());
                    assert_eq!(gbig, big);
                }
            });
        }
    });
}

#[test]
fn deferred_messages_unchecked() {
    run("mem,buf=64,frames=2,copy_max=300");
}

#[test]
fn deferred_messages_checked() {
    run("mem,buf=64,frames=2,copy_max=300,checked=true");
}
