//! An any-source receiver must sleep, not spin, once a peer has closed: 3 thread-ranks, rank 2
//! closes its channel, rank 0 waits in `begin_unpacking()` while rank 1 sends only after 1.5 s.
//! The waiting thread's CPU time over that wait must stay well below the wall time, and the
//! message from rank 1 must still arrive. (Before the fix, the closed peer's sticky
//! `writer_closed` flag kept `ShmIncoming::wait` returning at once: a survivor burned a core.)
//! The same with a peer that dies without closing (SIGKILL-like: no destructor runs) is in
//! `tests/processes.rs`.

// Real mappings, futexes and processes: nothing here runs under miri.
#![cfg(not(miri))]

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{ChannelConfig, RecvMode, SendMode, Session};
use mad_shm::ShmDriver;

/// How long rank 1 waits before sending.
const LATE: Duration = Duration::from_millis(1500);

fn closed_peer_does_not_make_any_source_spin(spec: &str) {
    let _shared = common::opening();
    let gate = Arc::new(Barrier::new(3));
    let hs: Vec<_> = ThreadBootstrap::group(3)
        .into_iter()
        .map(|b| {
            let gate = gate.clone();
            let spec = spec.to_string();
            std::thread::spawn(move || -> Option<(Duration, Duration)> {
                let session = Session::builder()
                    .driver(ShmDriver::new())
                    .bootstrap(Box::new(b))
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("anysrc", &spec).unwrap())
                    .unwrap();
                match session.rank() {
                    2 => {
                        drop(ch); // orderly close: sets writer_closed on its rings
                        gate.wait();
                        gate.wait();
                        None
                    }
                    1 => {
                        gate.wait();
                        std::thread::sleep(LATE);
                        let body = common::pattern(100_000, 7);
                        let mut p = ch.begin_packing(0).unwrap();
                        p.pack_value(&(body.len() as u64), RecvMode::Express)
                            .unwrap();
                        p.pack(&body, RecvMode::Cheaper).unwrap();
                        p.end_packing().unwrap();
                        gate.wait();
                        None
                    }
                    _ => {
                        gate.wait();
                        let cpu0 = common::thread_cpu_time();
                        let t0 = Instant::now();
                        let mut u = ch.begin_unpacking().unwrap();
                        let wall = t0.elapsed();
                        let cpu = common::thread_cpu_time() - cpu0;
                        assert_eq!(u.remote(), 1);
                        let n: u64 = u.unpack_value().unwrap();
                        let mut body = vec![0u8; n as usize];
                        u.unpack(&mut body, SendMode::Cheaper).unwrap();
                        u.end_unpacking().unwrap();
                        assert_eq!(body, common::pattern(100_000, 7), "message corrupted");
                        gate.wait();
                        Some((cpu, wall))
                    }
                }
            })
        })
        .collect();
    let mut measured = None;
    for h in hs {
        if let Some(m) = h.join().expect("rank thread panicked") {
            measured = Some(m);
        }
    }
    let (cpu, wall) = measured.expect("rank 0 measured its wait");
    eprintln!("{spec}: any-source wait of {wall:?} used {cpu:?} of CPU");
    assert!(wall >= LATE / 2, "{spec}: the wait ended early ({wall:?})");
    assert!(
        cpu.as_secs_f64() < 0.3 * wall.as_secs_f64(),
        "{spec}: the any-source receiver spun: {cpu:?} of CPU over a {wall:?} wait"
    );
}

#[test]
fn any_source_sleeps_after_a_peer_closed_adaptive() {
    closed_peer_does_not_make_any_source_spin("shm");
}

#[test]
fn any_source_sleeps_after_a_peer_closed_block() {
    closed_peer_does_not_make_any_source_spin("shm,progress=block");
}
