//! 64 processes on one host (32 per core here) over one tcp channel: every rank connects to
//! every other (2016 authenticated connections), rank 0 receives one message from each of the
//! 63 others by any-source reception (epoll past 4 peers), then a token goes once around the
//! ring of all 64 ranks, and every rank sends a 64 KiB message to its right neighbour and
//! checks the one from its left. Run under `madrun -n 64`.

#![cfg(feature = "tcp")]

use std::process::Command;
use std::time::Instant;

use madeleine::{ChannelConfig, RecvMode, SendMode};

const RANKS: usize = 64;

fn pattern(from: usize, i: usize) -> u8 {
    (from * 31 + i * 7) as u8
}

#[test]
#[ignore = "rank program of `sixty_four_processes_on_one_tcp_channel` (run through madrun)"]
fn many_ranks_child() {
    let s = madeleine::session().expect("session");
    let (me, n) = (s.rank(), s.size());
    let ch = s
        .open_channel_with(ChannelConfig::parse("many", "tcp,timeout_ms=120000").unwrap())
        .expect("open");
    // All to rank 0, any source.
    if me == 0 {
        let mut seen = vec![false; n];
        for _ in 1..n {
            let mut u = ch.begin_unpacking().unwrap();
            let from = u.remote();
            let v: u64 = u.unpack_value().unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(v, from as u64 * 1000, "message from rank {from}");
            assert!(!seen[from], "two messages from rank {from}");
            seen[from] = true;
        }
    } else {
        let mut p = ch.begin_packing(0).unwrap();
        p.pack_value(&(me as u64 * 1000), RecvMode::Express)
            .unwrap();
        p.end_packing().unwrap();
    }
    // A token once around the ring.
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    if me == 0 {
        let mut p = ch.begin_packing(right).unwrap();
        p.pack_value(&1u64, RecvMode::Express).unwrap();
        p.end_packing().unwrap();
        let mut u = ch.begin_unpacking_from(left).unwrap();
        let hops: u64 = u.unpack_value().unwrap();
        u.end_unpacking().unwrap();
        assert_eq!(hops, n as u64, "the token's hop count");
    } else {
        let mut u = ch.begin_unpacking_from(left).unwrap();
        let hops: u64 = u.unpack_value().unwrap();
        u.end_unpacking().unwrap();
        let mut p = ch.begin_packing(right).unwrap();
        p.pack_value(&(hops + 1), RecvMode::Express).unwrap();
        p.end_packing().unwrap();
    }
    // Everyone at once: 64 KiB to the right, from the left.
    let out: Vec<u8> = (0..64 << 10).map(|i| pattern(me, i)).collect();
    let mut p = ch.begin_packing(right).unwrap();
    p.pack(&out, RecvMode::Cheaper).unwrap();
    p.end_packing().unwrap();
    let mut inb = vec![0u8; 64 << 10];
    let mut u = ch.begin_unpacking_from(left).unwrap();
    u.unpack(&mut inb, SendMode::Cheaper).unwrap();
    u.end_unpacking().unwrap();
    assert!(inb.iter().enumerate().all(|(i, &b)| b == pattern(left, i)));
    s.bootstrap().barrier("many-end").unwrap();
    println!("MANY rank {me} ok");
}

#[test]
fn sixty_four_processes_on_one_tcp_channel() {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_madrun"))
        .args(["-n", &RANKS.to_string(), "--timeout", "300", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "many_ranks_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("madrun runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "64-rank job failed ({}):\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for r in 0..RANKS {
        assert!(
            text.contains(&format!("MANY rank {r} ok")),
            "no success line from rank {r}:\n{text}"
        );
    }
    eprintln!(
        "64 ranks over tcp: {:.1?} from madrun to the end",
        start.elapsed()
    );
}
