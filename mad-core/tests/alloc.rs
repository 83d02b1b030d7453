//! No heap allocation on the pack/unpack path for messages of up to 16 pieces.
//!
//! A counting global allocator (per thread) watches the sending and the receiving thread of a
//! `mem` channel while they exchange 16-piece messages (copied small pieces, gathered large
//! ones, EXPRESS and CHEAPER receives, SAFER, CHEAPER and LATER sends) after a warm-up. The
//! same body runs over the real drivers in the workspace's `tests/alloc_drivers.rs`. (A LATER
//! piece received EXPRESS holds the rest of its message until `end_packing`, copying SAFER
//! pieces aside: that rare mode allocates.)

use std::cell::Cell;

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::conformance::alloc::{allocs, Counting};
use mad_core::mem::MemDriver;
use mad_core::{RecvMode, SendMode, Session};

#[global_allocator]
static A: Counting = Counting;

const PIECES: usize = 16;
const LENS: [usize; PIECES] = [
    8, 1, 16, 100, 2000, 4, 64, 512, 3000, 8, 8, 8, 9000, 7, 0, 33,
];

/// Exchange, after a warm-up, 200 rounds of two 16-piece messages each way over `spec` (every
/// send and receive mode: SAFER/EXPRESS, CHEAPER/CHEAPER, CHEAPER/EXPRESS, LATER/CHEAPER; then
/// a message of 16 LATER/CHEAPER pieces) and return each rank's allocation count. Shared with
/// the workspace's test over the real drivers (`tests/alloc_drivers.rs`).
///
/// # Panics
///
/// When a session cannot be built, a channel opened or a message exchanged (a test helper).
pub fn count_allocations(
    builder: impl Fn() -> mad_core::SessionBuilder + Sync,
    spec: &str,
) -> Vec<(usize, u64)> {
    let boots = ThreadBootstrap::group(2);
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .map(|b| {
                let builder = &builder;
                s.spawn(move || {
                    let rank = b.rank();
                    let session = builder()
                        .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                        .build()
                        .unwrap();
                    let ch = session
                        .open_channel_with(ChannelConfig::parse("alloc", spec).unwrap())
                        .unwrap();
                    let data: Vec<Vec<u8>> = LENS.iter().map(|&n| vec![n as u8; n]).collect();
                    let mut later_bufs = data.clone();
                    let later: Vec<&[Cell<u8>]> = later_bufs
                        .iter_mut()
                        .map(|v| Cell::from_mut(&mut v[..]).as_slice_of_cells())
                        .collect();
                    let mut bufs: Vec<Vec<u8>> = LENS.iter().map(|&n| vec![0u8; n]).collect();
                    // Lockstep (two messages each way per round), so the driver's buffers and
                    // free lists reach their steady size during the warm-up.
                    let mut one_round = |count: bool| -> u64 {
                        let before = allocs();
                        for turn in 0..2 {
                            if rank == turn {
                                let mut p = ch.begin_packing(1 - rank).unwrap();
                                for (i, d) in data.iter().enumerate() {
                                    match i % 4 {
                                        0 => p.pack_safer(d, RecvMode::Express).unwrap(),
                                        1 => p.pack(d, RecvMode::Cheaper).unwrap(),
                                        2 => p.pack(d, RecvMode::Express).unwrap(),
                                        _ => p.pack_later(later[i], RecvMode::Cheaper).unwrap(),
                                    }
                                }
                                p.end_packing().unwrap();
                                let mut p = ch.begin_packing(1 - rank).unwrap();
                                for c in &later {
                                    p.pack_later(c, RecvMode::Cheaper).unwrap();
                                }
                                p.end_packing().unwrap();
                            } else {
                                let mut u = ch.begin_unpacking().unwrap();
                                for (i, b) in bufs.iter_mut().enumerate() {
                                    match i % 4 {
                                        0 => u.unpack_express(b, SendMode::Safer).unwrap(),
                                        1 => u.unpack(b, SendMode::Cheaper).unwrap(),
                                        2 => u.unpack_express(b, SendMode::Cheaper).unwrap(),
                                        _ => u.unpack(b, SendMode::Later).unwrap(),
                                    }
                                }
                                u.end_unpacking().unwrap();
                                let mut u = ch.begin_unpacking().unwrap();
                                for b in bufs.iter_mut() {
                                    u.unpack(b, SendMode::Later).unwrap();
                                }
                                u.end_unpacking().unwrap();
                            }
                        }
                        if count {
                            allocs() - before
                        } else {
                            0
                        }
                    };
                    for _ in 0..50 {
                        one_round(false); // warm-up: buffers and free lists reach their size
                    }
                    let mut total = 0;
                    for _ in 0..200 {
                        total += one_round(true);
                    }
                    for (b, &n) in bufs.iter().zip(&LENS) {
                        assert_eq!(b, &vec![n as u8; n]);
                    }
                    (rank, total)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[allow(dead_code)] // the workspace's driver test includes this file without this test
#[test]
fn sixteen_piece_messages_do_not_allocate() {
    // `frames=8`: the driver allocates its frame pool at open (a pool grown on demand could
    // allocate one more frame under an unusual interleaving of the two threads).
    for (rank, n) in count_allocations(|| Session::builder().driver(MemDriver), "mem,frames=8") {
        assert_eq!(
            n, 0,
            "rank {rank} allocated {n} times in 200 rounds of 16-piece messages"
        );
    }
}
