//! Active messages over every driver that runs in one process (mem, tcp, uds, shm,
//! sisci:local, via:soft), ranks as threads: inline and pool handlers called from several
//! threads of every rank at once with arguments up to 3 MiB (beyond every driver's buffers),
//! calling threads that poll for each other (no progress thread until a rank's own calls are
//! done), error replies (unknown handler, handler error, handler panic) after which the
//! server goes on, an inline handler that ignores its arguments, one-way messages, a pool of
//! one worker with a queue of one (back-pressure), a peer that closes while a call waits for
//! it, and a peer that sends something that is not an active message.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mad_am::{CallError, Config, Endpoint};
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::mem::MemDriver;
use mad_core::{ChannelConfig, Error, RecvMode, Result, Session};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const SPECS: &[&str] = &[
    "mem",
    "tcp",
    "uds",
    "shm",
    "sisci:local",
    "via:soft",
    "tcp,progress=block",
    "shm,checked=true",
    "mem,checked=true",
];

fn session(b: Box<dyn Bootstrap>) -> Result<Session> {
    Session::builder()
        .driver(MemDriver)
        .driver(mad_tcp::TcpDriver::new())
        .driver(mad_uds::UdsDriver::new())
        .driver(mad_shm::ShmDriver::new())
        .driver(mad_sisci::SisciDriver::new())
        .driver(mad_via::ViaDriver::new())
        .bootstrap(b)
        .build()
}

fn fail(what: impl Into<String>) -> Error {
    Error::Io {
        context: "active-message test".into(),
        source: std::io::Error::other(what.into()),
    }
}

/// Run `body(rank, session)` on `ranks` threads.
fn run(ranks: usize, body: impl Fn(usize, Session) -> Result<()> + Sync) {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let boots = ThreadBootstrap::group(ranks);
    let body = &body;
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, b)| s.spawn(move || body(rank, session(Box::new(b))?)))
            .collect();
        hs.into_iter()
            .enumerate()
            .filter_map(|(r, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("rank {r}: {e}")),
                Err(_) => Some(format!("rank {r} panicked")),
            })
            .collect()
    });
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8) ^ (i as u8).wrapping_mul(31)
        })
        .collect()
}

const ECHO: u32 = 1;
const REVERSE: u32 = 2;
const FAILS: u32 = 3;
const PANICS: u32 = 4;
const IGNORES: u32 = 5;
const COUNT: u32 = 6;
const CLOSES: u32 = 7;
const REENTERS: u32 = 8;

fn register(ep: &Endpoint, counter: Arc<AtomicUsize>) {
    ep.register_inline(ECHO, |req| req.recv_vec().map_err(|e| e.to_string()));
    ep.register_pool(REVERSE, |mut call| {
        call.args.reverse();
        Ok(call.args)
    });
    ep.register_inline(FAILS, |req| Err(format!("refused {} B", req.len())));
    ep.register_pool(PANICS, |_| panic!("boom"));
    ep.register_inline(IGNORES, |_req| Ok(b"ignored".to_vec()));
    let me = ep.clone();
    ep.register_inline(REENTERS, move |req| {
        let from = req.from();
        drop(req);
        match me.call(from, ECHO, b"x") {
            Err(CallError::Reentrant) => Ok(b"refused".to_vec()),
            other => Err(format!("a call from an inline handler: {other:?}")),
        }
    });
    ep.register_inline(COUNT, move |req| {
        let v = req.recv_vec().map_err(|e| e.to_string())?;
        counter.fetch_add(v.len(), Ordering::SeqCst);
        Ok(Vec::new())
    });
}

const THREADS: usize = 3;
const CALLS: usize = 12;
const ONE_WAY: usize = 10;

fn size_of_call(seed: u64) -> usize {
    match seed % 6 {
        0 => 0,
        1 => 8,
        2 => 700,
        3 => 40_000,
        4 => 300_000,
        _ => 3 << 20,
    }
}

/// Every rank calls every other from `THREADS` threads while nothing but those threads polls
/// (rank 0 also has a progress thread from the start); then each rank serves until all are
/// done.
fn calls_case(rank: usize, s: Session, spec: &str) -> Result<()> {
    let ch = s.open_channel_with(ChannelConfig::parse(
        "am",
        &format!("{spec},timeout_ms=60000"),
    )?)?;
    let n = ch.size();
    let ep = Endpoint::with_config(ch, Config::default().pool(1, 1));
    let counter = Arc::new(AtomicUsize::new(0));
    register(&ep, counter.clone());
    s.bootstrap().barrier("am/registered")?;
    let mut progress = (rank == 0).then(|| ep.spawn_progress());
    std::thread::scope(|sc| -> Result<()> {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let ep = &ep;
                sc.spawn(move || -> Result<()> {
                    for i in 0..CALLS {
                        for peer in (0..n).filter(|&p| p != rank) {
                            let seed = (rank * 1_000_000 + t * 10_000 + i * 100 + peer) as u64;
                            let args = pattern(seed, size_of_call(seed));
                            let id = if i % 2 == 0 { ECHO } else { REVERSE };
                            let got = ep
                                .call(peer, id, &args)
                                .map_err(|e| fail(format!("call {id} to {peer}: {e}")))?;
                            let mut want = args;
                            if id == REVERSE {
                                want.reverse();
                            }
                            if got != want {
                                return Err(fail(format!(
                                    "reply of handler {id} from {peer} differs ({} B)",
                                    want.len()
                                )));
                            }
                            if i == 3 && t == 0 {
                                errors_from(ep, peer)?;
                            }
                            if t == 1 && i < ONE_WAY {
                                ep.send(peer, COUNT, &[7u8; 3])
                                    .map_err(|e| fail(e.to_string()))?;
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| fail("caller panicked"))??;
        }
        Ok(())
    })?;
    if progress.is_none() {
        progress = Some(ep.spawn_progress());
    }
    // Every one-way message of every peer arrives (3 bytes each).
    let want = (n - 1) * ONE_WAY * 3;
    let t0 = Instant::now();
    while counter.load(Ordering::SeqCst) < want {
        if t0.elapsed() > Duration::from_secs(30) {
            return Err(fail(format!(
                "{} of {want} one-way bytes arrived",
                counter.load(Ordering::SeqCst)
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    s.bootstrap().barrier("am/done")?;
    if let Some(p) = progress {
        p.stop()?;
    }
    if counter.load(Ordering::SeqCst) != want {
        return Err(fail("more one-way messages than sent"));
    }
    Ok(())
}

/// Error replies, and the server serves on after each.
fn errors_from(ep: &Endpoint, peer: usize) -> Result<()> {
    match ep.call(peer, FAILS, b"abc") {
        Err(CallError::Handler { rank, id, message })
            if rank == peer && id == FAILS && message == "refused 3 B" => {}
        other => return Err(fail(format!("failing handler: {other:?}"))),
    }
    match ep.call(peer, PANICS, &[1; 100]) {
        Err(CallError::Panicked { message, .. }) if message == "boom" => {}
        other => return Err(fail(format!("panicking handler: {other:?}"))),
    }
    match ep.call(peer, 99, &[2; 70_000]) {
        Err(CallError::UnknownHandler { rank, id: 99 }) if rank == peer => {}
        other => return Err(fail(format!("unknown handler: {other:?}"))),
    }
    match ep.call(peer, IGNORES, &[3; 1 << 20]) {
        Ok(v) if v == b"ignored" => {}
        other => {
            return Err(fail(format!(
                "handler that ignores its arguments: {other:?}"
            )))
        }
    }
    let v = ep
        .call(peer, ECHO, b"still serving")
        .map_err(|e| fail(e.to_string()))?;
    if v != b"still serving" {
        return Err(fail("echo after the errors"));
    }
    Ok(())
}

#[test]
fn handlers_replies_and_errors_on_every_driver() {
    for spec in SPECS {
        let t0 = Instant::now();
        run(3, |rank, s| calls_case(rank, s, spec));
        eprintln!("calls over {spec}: {:?}", t0.elapsed());
    }
}

/// A peer that closes its channel while a call waits for it fails the call promptly, and a
/// call to it afterwards fails at once.
#[test]
fn a_peer_that_leaves_fails_the_calls_waiting_for_it() {
    for spec in SPECS {
        run(2, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "left",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::new(ch);
            let ep2 = ep.clone();
            ep.register_inline(CLOSES, move |req| {
                drop(req);
                ep2.channel().close();
                Ok(Vec::new())
            });
            s.bootstrap().barrier("left/registered")?;
            if rank == 0 {
                let t0 = Instant::now();
                match ep.call(1, CLOSES, b"bye") {
                    Err(CallError::Transport(_)) => {}
                    other => {
                        return Err(fail(format!("{spec}: call to a peer that left: {other:?}")))
                    }
                }
                if t0.elapsed() > Duration::from_secs(5) {
                    return Err(fail(format!(
                        "{spec}: the call failed only after {:?}",
                        t0.elapsed()
                    )));
                }
                match ep.call(1, ECHO, b"again") {
                    Err(CallError::Transport(_)) => Ok(()),
                    other => Err(fail(format!("{spec}: second call: {other:?}"))),
                }
            } else {
                // Serves until its handler closed the channel.
                match ep.serve() {
                    Err(Error::Closed { .. }) | Ok(()) => Ok(()),
                    Err(e) => Err(fail(format!("{spec}: serve ended with {e}"))),
                }
            }
        });
    }
}

/// A message that is not an active message (sent with the channel's own API) finishes that
/// peer's connection: its pending call fails, and the endpoint goes on serving the others.
#[test]
fn a_stranger_message_finishes_only_that_connection() {
    for spec in ["tcp", "shm", "mem"] {
        run(3, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "stranger",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::new(ch.clone());
            ep.register_inline(ECHO, |req| req.recv_vec().map_err(|e| e.to_string()));
            s.bootstrap().barrier("stranger/registered")?;
            match rank {
                0 => {
                    let p = ep.spawn_progress();
                    s.bootstrap().barrier("stranger/sent")?;
                    s.bootstrap().barrier("stranger/done")?;
                    p.stop()
                }
                1 => {
                    let mut p = ch.begin_packing(0)?;
                    p.pack(&[0xAAu8; 32], RecvMode::Express)?;
                    p.end_packing()?;
                    s.bootstrap().barrier("stranger/sent")?;
                    s.bootstrap().barrier("stranger/done")
                }
                _ => {
                    s.bootstrap().barrier("stranger/sent")?;
                    // Rank 0 still serves rank 2.
                    let v = ep
                        .call(0, ECHO, &[5u8; 1000])
                        .map_err(|e| fail(e.to_string()))?;
                    s.bootstrap().barrier("stranger/done")?;
                    if v != [5u8; 1000] {
                        return Err(fail("echo from rank 0"));
                    }
                    Ok(())
                }
            }
        });
    }
}

/// Async calls: many futures in flight at once on a tokio runtime, from a client whose only
/// poller is its progress thread; a future dropped before its reply leaves the endpoint
/// usable; shutdown resolves pending futures.
#[test]
fn async_calls_are_futures_resolved_by_the_reply() {
    for spec in ["mem", "tcp", "shm", "sisci:local"] {
        run(2, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "async",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::new(ch);
            ep.register_inline(ECHO, |req| req.recv_vec().map_err(|e| e.to_string()));
            ep.register_pool(REVERSE, |mut call| {
                call.args.reverse();
                Ok(call.args)
            });
            let progress = ep.spawn_progress();
            s.bootstrap().barrier("async/registered")?;
            if rank == 1 {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(|e| Error::io("tokio", e))?;
                rt.block_on(async {
                    let calls: Vec<_> = (0..64u64)
                        .map(|i| {
                            let args = pattern(i, size_of_call(i));
                            let id = if i % 2 == 0 { ECHO } else { REVERSE };
                            let f = ep.call_async(0, id, &args);
                            tokio::spawn(async move {
                                let got = f.await.map_err(|e| fail(e.to_string()))?;
                                let mut want = args;
                                if id == REVERSE {
                                    want.reverse();
                                }
                                if got != want {
                                    return Err(fail(format!("async reply {i} differs")));
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    for c in calls {
                        c.await.map_err(|e| fail(e.to_string()))??;
                    }
                    // Cancelled before its reply: forgotten, and the endpoint goes on.
                    drop(ep.call_async(0, ECHO, &[1u8; 1 << 20]));
                    let v = ep
                        .call_async(0, ECHO, b"after")
                        .await
                        .map_err(|e| fail(e.to_string()))?;
                    if v != b"after" {
                        return Err(fail("echo after a cancelled call"));
                    }
                    match ep.call_async(0, 99, b"").await {
                        Err(CallError::UnknownHandler { id: 99, .. }) => {}
                        other => return Err(fail(format!("unknown handler: {other:?}"))),
                    }
                    match ep.call_async(5, ECHO, b"").await {
                        Err(CallError::Transport(Error::BadRank { .. })) => {}
                        other => return Err(fail(format!("bad rank: {other:?}"))),
                    }
                    Ok::<(), Error>(())
                })?;
            }
            s.bootstrap().barrier("async/done")?;
            progress.stop()
        });
    }
}

/// A future that completes once `flag` is set, woken by whoever sets it through `waker`.
struct Flagged {
    flag: Arc<std::sync::atomic::AtomicBool>,
    waker: Arc<Mutex<Option<std::task::Waker>>>,
}

impl std::future::Future for Flagged {
    type Output = ();
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        *self.waker.lock().unwrap() = Some(cx.waker().clone());
        if self.flag.load(Ordering::SeqCst) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    }
}

const DONE: u32 = 9;

/// `Endpoint::block_on`: each rank keeps 16 async calls in flight to the other from one
/// thread (inline and pool handlers, arguments up to 3 MiB: beyond every driver's buffers),
/// and that same thread serves the other rank's calls meanwhile (no other thread polls);
/// then it serves until the other is done. A blocking call inside is refused; a call to a
/// peer that closes fails the future promptly.
#[test]
fn block_on_runs_many_calls_from_one_thread_on_every_driver() {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    for spec in SPECS {
        run(2, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "loop",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::new(ch);
            register(&ep, Arc::new(AtomicUsize::new(0)));
            let done = Flagged {
                flag: Arc::new(std::sync::atomic::AtomicBool::new(false)),
                waker: Arc::new(Mutex::new(None)),
            };
            let (flag, waker) = (done.flag.clone(), done.waker.clone());
            ep.register_inline(DONE, move |_| {
                flag.store(true, Ordering::SeqCst);
                if let Some(w) = waker.lock().unwrap().take() {
                    w.wake();
                }
                Ok(Vec::new())
            });
            s.bootstrap().barrier("loop/registered")?;
            let peer = 1 - rank;
            let call = |i: u64| {
                let args = pattern(i * 2 + rank as u64, size_of_call(i));
                let id = if i % 3 == 0 { REVERSE } else { ECHO };
                let f = ep.call_async(peer, id, &args);
                async move {
                    let got = f
                        .await
                        .map_err(|e| fail(format!("{spec}: call {i}: {e}")))?;
                    let mut want = args;
                    if id == REVERSE {
                        want.reverse();
                    }
                    if got != want {
                        return Err(fail(format!("{spec}: reply {i} differs")));
                    }
                    Ok::<(), Error>(())
                }
            };
            ep.block_on(async {
                let mut next = 0u64;
                let mut calls = FuturesUnordered::new();
                while next < 16 {
                    calls.push(call(next));
                    next += 1;
                }
                while let Some(r) = calls.next().await {
                    r?;
                    if next < 96 {
                        calls.push(call(next));
                        next += 1;
                    }
                }
                // A blocking call from inside would wait for this very thread.
                match ep.call(peer, ECHO, b"x") {
                    Err(CallError::Reentrant) => {}
                    other => return Err(fail(format!("{spec}: blocking call inside: {other:?}"))),
                }
                ep.call_async(peer, DONE, b"")
                    .await
                    .map_err(|e| fail(format!("{spec}: done: {e}")))?;
                // Serve until the other rank's calls are done too.
                done.await;
                Ok(())
            })?;
            s.bootstrap().barrier("loop/done")?;
            if rank == 1 {
                // The peer closes while this call waits in block_on.
                let t0 = Instant::now();
                match ep.block_on(ep.call_async(0, ECHO, b"bye")) {
                    Err(CallError::Transport(_)) => {}
                    other => return Err(fail(format!("{spec}: call to a closed peer: {other:?}"))),
                }
                if t0.elapsed() > Duration::from_secs(5) {
                    return Err(fail(format!(
                        "{spec}: failed only after {:?}",
                        t0.elapsed()
                    )));
                }
            } else {
                ep.channel().close();
            }
            Ok(())
        });
    }
}

/// No head-of-line blocking behind a large message: while one client thread sends a 256 MiB
/// request (2048 fragments; at least tens of milliseconds on any transport here), another
/// thread's small calls to the same server are handled before the large request has arrived
/// whole. The server's probe handler answers whether the large one has arrived yet; a probe
/// made 5 ms after the large call began must see "not yet" (with the whole body sent as one
/// message it would queue behind it on the connection and see "arrived").
#[test]
fn small_calls_pass_a_large_message_to_the_same_peer() {
    const BIG: u32 = 20;
    const PROBE: u32 = 21;
    for spec in ["mem", "tcp", "shm"] {
        run(2, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "hol",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::new(ch);
            let arrived = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let a = arrived.clone();
            ep.register_pool(BIG, move |call| {
                a.store(true, Ordering::SeqCst);
                Ok(call.args.len().to_le_bytes().to_vec())
            });
            let a = arrived.clone();
            ep.register_inline(PROBE, move |_req| Ok(vec![a.load(Ordering::SeqCst) as u8]));
            let progress = ep.spawn_progress();
            s.bootstrap().barrier("hol/registered")?;
            if rank == 1 {
                let big = vec![7u8; 256 << 20];
                std::thread::scope(|sc| -> Result<()> {
                    let large = sc.spawn(|| ep.call(0, BIG, &big));
                    std::thread::sleep(Duration::from_millis(5));
                    let first = ep.call(0, PROBE, b"").map_err(|e| fail(e.to_string()))?;
                    let n = large.join().map_err(|_| fail("large call panicked"))?;
                    let n = n.map_err(|e| fail(e.to_string()))?;
                    if n != (256usize << 20).to_le_bytes() {
                        return Err(fail("large call's reply"));
                    }
                    if first != [0] {
                        return Err(fail(format!(
                            "{spec}: the small call waited for the whole 256 MiB request"
                        )));
                    }
                    Ok(())
                })?;
            }
            s.bootstrap().barrier("hol/done")?;
            progress.stop()
        });
    }
}

/// Bodies in many small fragments, each sender at most one fragment ahead of the receiver's
/// acknowledgements (`window(1)`), over every driver: requests sent by blocking callers from
/// two threads, replies sent by the pool's worker (acknowledged by the caller's polling
/// thread) and by the poller (an inline handler's reply), async requests (sent by the
/// poller), one-way messages handled in the order they were sent; an inline handler that
/// keeps one buffer and takes the arguments with `Request::recv_into_vec` (the reassembled
/// buffer handed over, its old one recycled for the next reassembly) sees every byte of each
/// body and nothing of an earlier one.
#[test]
fn windowed_fragments_and_handed_over_buffers_on_every_driver() {
    const KEEP: u32 = 30;
    const ADD: u32 = 31;
    const TOTAL: u32 = 32;
    const SIZES: &[usize] = &[0, 1, 999, 1000, 1001, 4096, 70_000, 300_001];
    for spec in SPECS {
        run(2, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "win",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::with_config(ch, Config::default().fragment(1000).window(1));
            let kept = Mutex::new(Vec::<u8>::new());
            ep.register_inline(KEEP, move |req| {
                let mut b = kept.lock().unwrap_or_else(|e| e.into_inner());
                req.recv_into_vec(&mut b).map_err(|e| e.to_string())?;
                Ok(b.clone())
            });
            ep.register_pool(REVERSE, |mut call| {
                call.args.reverse();
                Ok(call.args)
            });
            // One-way bodies: each must arrive after the one sent before it.
            let seen = Arc::new(Mutex::new(Vec::<u8>::new()));
            let sn = seen.clone();
            ep.register_inline(ADD, move |req| {
                let v = req.recv_vec().map_err(|e| e.to_string())?;
                sn.lock().unwrap_or_else(|e| e.into_inner()).push(v[0]);
                Ok(Vec::new())
            });
            let sn = seen.clone();
            ep.register_inline(TOTAL, move |_req| {
                Ok(sn.lock().unwrap_or_else(|e| e.into_inner()).clone())
            });
            let progress = (rank == 0).then(|| ep.spawn_progress());
            s.bootstrap().barrier("win/registered")?;
            if rank == 1 {
                std::thread::scope(|sc| -> Result<()> {
                    let hs: Vec<_> = (0..2u64)
                        .map(|t| {
                            let ep = &ep;
                            sc.spawn(move || -> Result<()> {
                                for (i, &n) in SIZES.iter().enumerate() {
                                    let args = pattern(t * 100 + i as u64, n);
                                    let got = ep
                                        .call(0, KEEP, &args)
                                        .map_err(|e| fail(format!("keep {n} B: {e}")))?;
                                    if got != args {
                                        return Err(fail(format!("{spec}: keep {n} B differs")));
                                    }
                                    let got = ep
                                        .call(0, REVERSE, &args)
                                        .map_err(|e| fail(format!("reverse {n} B: {e}")))?;
                                    let mut want = args;
                                    want.reverse();
                                    if got != want {
                                        return Err(fail(format!("{spec}: reverse {n} B differs")));
                                    }
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    for h in hs {
                        h.join().map_err(|_| fail("caller panicked"))??;
                    }
                    Ok(())
                })?;
                for k in 0..6u8 {
                    let mut body = pattern(u64::from(k), 5000 + 3000 * usize::from(k));
                    body[0] = k;
                    ep.send(0, ADD, &body).map_err(|e| fail(e.to_string()))?;
                }
                let order = ep.call(0, TOTAL, b"").map_err(|e| fail(e.to_string()))?;
                if order != [0, 1, 2, 3, 4, 5] {
                    return Err(fail(format!("{spec}: one-way bodies handled as {order:?}")));
                }
                let asy = ep.spawn_progress();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .map_err(|e| Error::io("tokio", e))?;
                rt.block_on(async {
                    for (i, &n) in SIZES.iter().enumerate() {
                        let args = pattern(500 + i as u64, n);
                        let got = ep
                            .call_async(0, KEEP, &args)
                            .await
                            .map_err(|e| fail(e.to_string()))?;
                        if got != args {
                            return Err(fail(format!("{spec}: async keep {n} B differs")));
                        }
                    }
                    Ok::<(), Error>(())
                })?;
                asy.stop()?;
            }
            s.bootstrap().barrier("win/done")?;
            match progress {
                Some(p) => p.stop(),
                None => Ok(()),
            }
        });
    }
}

/// A sender waiting for the acknowledgements of a body in fragments from a peer that closes
/// its channel without ever receiving it fails (no hang): the peer never polls, and closes
/// once the sender has started.
#[test]
fn a_windowed_sender_fails_when_the_peer_leaves() {
    for spec in ["mem", "tcp", "shm", "uds"] {
        run(2, |rank, s| {
            let ch = s.open_channel_with(ChannelConfig::parse(
                "winleft",
                &format!("{spec},timeout_ms=60000"),
            )?)?;
            let ep = Endpoint::with_config(ch, Config::default().fragment(1000).window(1));
            s.bootstrap().barrier("winleft/open")?;
            if rank == 0 {
                // Never polls: no acknowledgement leaves; then goes away.
                std::thread::sleep(Duration::from_millis(100));
                ep.channel().close();
                Ok(())
            } else {
                match ep.send(0, ECHO, &vec![3u8; 4 << 20]) {
                    Err(CallError::Transport(_)) => Ok(()),
                    other => Err(fail(format!("{spec}: send to a peer that left: {other:?}"))),
                }
            }
        });
    }
}
