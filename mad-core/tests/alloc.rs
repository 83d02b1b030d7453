//! No heap allocation on the pack/unpack path for messages of up to 16 pieces.
//!
//! A counting global allocator (per thread) watches the sending and the receiving thread of a
//! `mem` channel while they exchange 16-piece messages (copied small pieces, gathered large
//! ones, EXPRESS and CHEAPER receives, SAFER and CHEAPER sends) after a warm-up.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::mem::MemDriver;
use mad_core::{RecvMode, SendMode, Session};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call forwards to the system allocator unchanged; the counter is a const-init
// thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(|c| c.get())
}

const PIECES: usize = 16;
const LENS: [usize; PIECES] = [
    8, 1, 16, 100, 2000, 4, 64, 512, 3000, 8, 8, 8, 9000, 7, 0, 33,
];

#[test]
fn sixteen_piece_messages_do_not_allocate() {
    let boots = ThreadBootstrap::group(2);
    let counts: Vec<(u64, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let rank = b.rank();
                    let session = Session::builder()
                        .driver(MemDriver)
                        .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                        .build()
                        .unwrap();
                    let ch = session
                        .open_channel_with(ChannelConfig::parse("alloc", "mem").unwrap())
                        .unwrap();
                    let data: Vec<Vec<u8>> = LENS.iter().map(|&n| vec![n as u8; n]).collect();
                    let mut bufs: Vec<Vec<u8>> = LENS.iter().map(|&n| vec![0u8; n]).collect();
                    // Lockstep (a 16-piece message each way per round), so the driver's frame pool
                    // reaches its steady size during the warm-up and the count is deterministic.
                    let mut one_round = |count: bool| -> u64 {
                        let before = allocs();
                        for turn in 0..2 {
                            if rank == turn {
                                let mut p = ch.begin_packing(1 - rank).unwrap();
                                for (i, d) in data.iter().enumerate() {
                                    match i % 3 {
                                        0 => p.pack_safer(d, RecvMode::Express).unwrap(),
                                        1 => p.pack(d, RecvMode::Cheaper).unwrap(),
                                        _ => p.pack(d, RecvMode::Express).unwrap(),
                                    }
                                }
                                p.end_packing().unwrap();
                            } else {
                                let mut u = ch.begin_unpacking().unwrap();
                                for (i, b) in bufs.iter_mut().enumerate() {
                                    match i % 3 {
                                        0 => u.unpack_express(b, SendMode::Safer).unwrap(),
                                        1 => u.unpack(b, SendMode::Cheaper).unwrap(),
                                        _ => u.unpack_express(b, SendMode::Cheaper).unwrap(),
                                    }
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
                    (rank as u64, total)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, n) in counts {
        assert_eq!(
            n, 0,
            "rank {rank} allocated {n} times in 200 sixteen-piece messages"
        );
    }
}
