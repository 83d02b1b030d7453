//! No heap allocation on the pack/unpack path for messages of up to 16 pieces, over the real
//! drivers (the engine's own test over `mem` is `mad-core/tests/alloc.rs`, whose body this
//! file includes): tcp, shm, via:soft and sisci:local, each in a 2-rank session of threads
//! with real sockets or shared memory, after a warm-up.

#[path = "../mad-core/tests/alloc.rs"]
#[allow(dead_code)]
mod common;

fn check(spec: &str) {
    for (rank, n) in common::count_allocations(madeleine::builder, spec) {
        assert_eq!(
            n, 0,
            "{spec}: rank {rank} allocated {n} times in 200 rounds of 16-piece messages"
        );
    }
}

#[test]
fn tcp_does_not_allocate() {
    check("tcp");
}

#[test]
fn shm_does_not_allocate() {
    check("shm");
}

#[test]
fn via_soft_does_not_allocate() {
    check("via:soft");
}

#[test]
fn sisci_local_does_not_allocate() {
    check("sisci:local");
}
