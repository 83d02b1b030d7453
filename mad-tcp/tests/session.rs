//! Session-level tests: the Madeleine API (`Session`, `Channel`, `Packer`, `Unpacker`) over
//! the tcp driver, ranks as threads with real sockets.

use std::thread;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{Channel, ChannelConfig, Error, RecvMode, SendMode, Session};
use mad_tcp::TcpDriver;

/// Run `body(rank, channel)` on `n` threads, each with its own session and a channel `name`.
fn run<F>(n: usize, spec: &str, body: F)
where
    F: Fn(usize, Channel) + Send + Sync + Clone + 'static,
{
    let hs: Vec<_> = ThreadBootstrap::group(n)
        .into_iter()
        .map(|b| {
            let body = body.clone();
            let spec = spec.to_string();
            thread::spawn(move || {
                let s = Session::builder()
                    .driver(TcpDriver::new())
                    .bootstrap(Box::new(b))
                    .build()
                    .unwrap();
                let ch = s
                    .open_channel_with(ChannelConfig::parse("t", &spec).unwrap())
                    .unwrap();
                body(s.rank(), ch);
            })
        })
        .collect();
    for h in hs {
        h.join().expect("a rank failed");
    }
}

#[test]
fn figure_1_express_size_then_cheaper_array() {
    for progress in ["poll", "block", "adaptive"] {
        run(
            2,
            &format!("tcp,progress={progress},timeout_ms=30000"),
            |rank, ch| {
                for size in [0usize, 1, 100, 5000, 1 << 20] {
                    if rank == 0 {
                        let array: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
                        let mut p = ch.begin_packing(1).unwrap();
                        p.pack_value(&(size as u64), RecvMode::Express).unwrap();
                        p.pack(&array, RecvMode::Cheaper).unwrap();
                        p.end_packing().unwrap();
                    } else {
                        let mut u = ch.begin_unpacking().unwrap();
                        let n: u64 = u.unpack_value().unwrap();
                        let mut array = vec![0u8; n as usize];
                        u.unpack(&mut array, SendMode::Cheaper).unwrap();
                        u.end_unpacking().unwrap();
                        assert_eq!(n as usize, size);
                        assert!(array.iter().enumerate().all(|(i, &b)| b == (i % 253) as u8));
                    }
                }
            },
        );
    }
}

#[test]
fn pieces_of_64_mib() {
    run(2, "tcp,timeout_ms=60000", |rank, ch| {
        let n = 64 << 20;
        if rank == 0 {
            let a: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            let b: Vec<u8> = (0..n).map(|i| (i % 241) as u8).collect();
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&a, RecvMode::Cheaper).unwrap();
            p.pack_value(&7u32, RecvMode::Cheaper).unwrap();
            p.pack(&b, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        } else {
            let mut a = vec![0u8; n];
            let mut b = vec![0u8; n];
            let mut u = ch.begin_unpacking().unwrap();
            u.unpack(&mut a, SendMode::Cheaper).unwrap();
            let seven: u32 = u.unpack_value().unwrap();
            u.unpack(&mut b, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(seven, 7);
            assert!(a.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 241) as u8));
        }
    });
}

#[test]
fn seventeen_ranks_any_source_to_rank_0() {
    let n = 17;
    run(n, "tcp,progress=block,timeout_ms=30000", move |rank, ch| {
        if rank == 0 {
            let mut next = vec![0u32; n];
            for _ in 0..3 * (n - 1) {
                let mut u = ch.begin_unpacking().unwrap();
                let from = u.remote();
                let k: u32 = u.unpack_value().unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(k, next[from]);
                next[from] += 1;
            }
            // Tell everyone we are done so nobody drops its channel early.
            for r in 1..n {
                let mut p = ch.begin_packing(r).unwrap();
                p.pack_value(&0u8, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            }
        } else {
            for k in 0..3u32 {
                let mut p = ch.begin_packing(0).unwrap();
                p.pack_value(&k, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            }
            let mut u = ch.begin_unpacking_from(0).unwrap();
            let _: u8 = u.unpack_value().unwrap();
            u.end_unpacking().unwrap();
        }
    });
}

#[test]
fn peer_gone_midway_is_reported_and_others_keep_working() {
    // Rank 2 starts a message to rank 0 and drops the channel midway (the packer is
    // abandoned after part of a large piece left). Rank 0 must see an error for rank 2, never
    // a half message, and must keep talking to rank 1.
    run(3, "tcp,timeout_ms=30000", |rank, ch| match rank {
        2 => {
            let big = vec![5u8; 32 << 20];
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_value(&1u64, RecvMode::Express).unwrap();
            // Abandon the message without `end_packing`: whatever part of it left, rank 0
            // must not receive it as a whole message.
            p.pack(&big, RecvMode::Cheaper).unwrap();
            drop(p);
            drop(ch);
        }
        0 => {
            thread::sleep(Duration::from_millis(300));
            let t0 = Instant::now();
            let r = (|| -> mad_core::Result<()> {
                let mut u = ch.begin_unpacking_from(2)?;
                let _: u64 = u.unpack_value()?;
                let mut big = vec![0u8; 32 << 20];
                u.unpack(&mut big, SendMode::Cheaper)?;
                u.end_unpacking()
            })();
            match r {
                Err(e) => assert!(
                    e.is_peer_failure() || matches!(e, Error::Poisoned { .. }),
                    "unexpected error kind: {e}"
                ),
                Ok(()) => panic!("a message abandoned midway was delivered as whole"),
            }
            assert!(t0.elapsed() < Duration::from_secs(20));
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_value(&42u32, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            let mut u = ch.begin_unpacking_from(1).unwrap();
            let v: u32 = u.unpack_value().unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(v, 43);
        }
        _ => {
            let mut u = ch.begin_unpacking_from(0).unwrap();
            let v: u32 = u.unpack_value().unwrap();
            u.end_unpacking().unwrap();
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_value(&(v + 1), RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
    });
}

/// A live receiver that does not read for longer than the liveness bound (a compute phase)
/// while its sender is blocked on a full window must not be taken for a dead one: the sender
/// waits, and the message arrives whole when the receiver comes back. (With `TCP_USER_TIMEOUT`
/// the kernel aborted such a connection after the bound: `ConnectionLost`, `ETIMEDOUT`.)
#[test]
fn slow_reader_is_not_a_dead_peer() {
    for progress in ["adaptive", "block", "poll"] {
        run(
            2,
            &format!("tcp,liveness_ms=1000,progress={progress},timeout_ms=60000"),
            move |rank, ch| {
                let n = 32 << 20;
                if rank == 0 {
                    let a: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
                    let mut p = ch.begin_packing(1).unwrap();
                    p.pack(&a, RecvMode::Cheaper).unwrap();
                    p.end_packing().expect("a slow reader is not a dead peer");
                } else {
                    // Compute for three liveness bounds before reading anything (six in adaptive
                    // mode: the sender's retransmissions into the closed window back off to
                    // 1.6 and 3.2 s apart, longer than the bound, each one answered).
                    let ms = if progress == "adaptive" { 6000 } else { 3000 };
                    thread::sleep(Duration::from_millis(ms));
                    let mut a = vec![0u8; n];
                    let mut u = ch.begin_unpacking().unwrap();
                    u.unpack(&mut a, SendMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(a.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
                }
            },
        );
    }
}

/// Signals interrupting blocked system calls (`EINTR`: a handler installed without
/// `SA_RESTART`, as a profiler or an application's own timer would) are retried, never turned
/// into errors or short messages: both ranks' threads get `SIGUSR1` every 50 µs while they
/// exchange 16 MiB messages, in every progress mode.
#[test]
fn interrupted_system_calls_are_retried() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    static DELIVERED: AtomicU64 = AtomicU64::new(0);
    extern "C" fn on_usr1(_: libc::c_int) {
        DELIVERED.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: `sigaction` is plain data, all-zero is a valid value that we fill in; the handler
    // only touches an atomic (async-signal-safe); no SA_RESTART, so blocked calls fail with EINTR.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = 0;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    for progress in ["block", "adaptive", "poll"] {
        let threads: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let done = Arc::new(AtomicBool::new(false));
        let stopped = Arc::new(AtomicBool::new(false));
        let killer = {
            let (threads, done, stopped) = (threads.clone(), done.clone(), stopped.clone());
            thread::spawn(move || {
                while !done.load(Ordering::Acquire) {
                    for t in threads.iter() {
                        let id = t.load(Ordering::Relaxed);
                        if id != 0 {
                            // SAFETY: the id is a live thread's `pthread_self()`, recorded
                            // before it started and cleared (under `done`) before it ends.
                            unsafe { libc::pthread_kill(id as libc::pthread_t, libc::SIGUSR1) };
                        }
                    }
                    thread::sleep(Duration::from_micros(50));
                }
                stopped.store(true, Ordering::Release);
            })
        };
        let before = DELIVERED.load(Ordering::Relaxed);
        let th = threads.clone();
        let fin = done.clone();
        let quiet = stopped.clone();
        run(
            2,
            &format!("tcp,progress={progress},timeout_ms=60000"),
            move |rank, ch| {
                // SAFETY: pthread_self has no preconditions.
                th[rank].store(unsafe { libc::pthread_self() } as u64, Ordering::Relaxed);
                let n = 16 << 20;
                let a: Vec<u8> = (0..n).map(|i| (i % 253) as u8).collect();
                let mut b = vec![0u8; n];
                for round in 0..2 {
                    if rank == round % 2 {
                        let mut p = ch.begin_packing(1 - rank).unwrap();
                        p.pack_value(&(round as u32), RecvMode::Express).unwrap();
                        p.pack(&a, RecvMode::Cheaper).unwrap();
                        p.end_packing().unwrap();
                    } else {
                        let mut u = ch.begin_unpacking().unwrap();
                        assert_eq!(u.unpack_value::<u32>().unwrap(), round as u32);
                        u.unpack(&mut b, SendMode::Cheaper).unwrap();
                        u.end_unpacking().unwrap();
                        assert!(b == a, "{progress}: message {round} arrived damaged");
                        b.fill(0);
                    }
                }
                // The signalling stops before either thread ends (a joined thread's id must not
                // be signalled).
                fin.store(true, Ordering::Release);
                while !quiet.load(Ordering::Acquire) {
                    thread::yield_now();
                }
                th[rank].store(0, Ordering::Relaxed);
            },
        );
        done.store(true, Ordering::Relaxed);
        killer.join().unwrap();
        let got = DELIVERED.load(Ordering::Relaxed) - before;
        assert!(
            got > 20,
            "{progress}: only {got} signals reached the ranks' threads"
        );
        eprintln!("{progress}: {got} signals delivered during the exchange");
    }
}
