//! A key-value service on active messages ([`madeleine::am`]): the pattern to copy.
//!
//! ```text
//! cargo run --example am_service              # 3 processes on this host: a server, 2 clients
//! madrun -n 3 target/debug/examples/am_service -- --quick
//! ```
//!
//! Rank 0 serves: `put`, `get` and `incr` run inline on the polling thread (short, no thread
//! hand-off; `put` receives its value straight into the buffer it allocates), `scan` runs in
//! the worker pool (longer), `done` is one-way. A progress thread polls for the server; on
//! the clients, the threads waiting for their replies poll for each other. Every other rank
//! runs 4 threads that call at once, checks an unknown handler and a handler error, then
//! tells the server it is done; the server checks the counter and stops.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use madeleine::am::{CallError, Config, Endpoint};
use madeleine::cli::{Arg, Cli};
use madeleine::{Error, Result};

const CLI: Cli = Cli::new(
    "am_service",
    env!("CARGO_PKG_VERSION"),
    "usage: am_service [--quick]        (alone: starts 3 ranks on this host)
       madrun -n N am_service [--] [--quick]     (N >= 2)

A key-value service on active messages: rank 0 serves, every other rank runs 4 calling
threads over the `default` channel.

  --quick        50 calls per client thread instead of 1000 (CI)
  -h, --help     this text
  -V, --version  the version",
);

const PUT: u32 = 1; // key '=' value -> nothing
const GET: u32 = 2; // key -> value, or an error
const INCR: u32 = 3; // nothing -> the counter after the increment (u64 LE)
const SCAN: u32 = 4; // prefix -> "key=len" lines
const DONE: u32 = 5; // one-way: this client has finished
const THREADS: usize = 4;

fn fail(what: impl std::fmt::Display) -> Error {
    Error::Io {
        context: "am_service".into(),
        source: std::io::Error::other(what.to_string()),
    }
}

fn main() {
    madeleine::init_logging();
    if let Err(e) = run() {
        eprintln!("am_service: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let calls = CLI.parse(|p| {
        let mut calls = 1000;
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("quick") => calls = 50,
                other => CLI.other(other)?,
            }
        }
        Ok(calls)
    });
    if let Some(code) = madeleine::run_local_if_alone(3)? {
        std::process::exit(code);
    }
    let session = madeleine::session()?;
    let ep = Endpoint::with_config(
        session.open_channel("default")?,
        Config::default().pool(2, 16),
    );
    if session.rank() == 0 {
        server(&ep, calls)
    } else {
        client(&ep, calls)
    }
}

fn server(ep: &Endpoint, calls: usize) -> Result<()> {
    let store = Arc::new(Mutex::new(BTreeMap::<Vec<u8>, Vec<u8>>::new()));
    let s = store.clone();
    ep.register_inline(PUT, move |req| {
        if req.len() > 1 << 20 {
            return Err(format!("put: {} B, over 1 MiB", req.len()));
        }
        // Memory sized from the header; the body lands there with no copy.
        let mut body = vec![0u8; req.len() as usize];
        req.recv_into(&mut body).map_err(|e| e.to_string())?;
        let eq = body.iter().position(|&b| b == b'=').ok_or("put: no `=`")?;
        let value = body.split_off(eq + 1);
        body.pop();
        s.lock().unwrap().insert(body, value);
        Ok(Vec::new())
    });
    let s = store.clone();
    ep.register_inline(GET, move |req| {
        let key = req.recv_vec().map_err(|e| e.to_string())?;
        let v = s.lock().unwrap().get(&key).cloned();
        v.ok_or_else(|| format!("no key {:?}", String::from_utf8_lossy(&key)))
    });
    let hits = Arc::new(AtomicU64::new(0));
    let h = hits.clone();
    // A handler may ignore its arguments: they are read and dropped for it.
    ep.register_inline(INCR, move |_req| {
        Ok((h.fetch_add(1, Ordering::Relaxed) + 1)
            .to_le_bytes()
            .to_vec())
    });
    let s = store.clone();
    ep.register_pool(SCAN, move |call| {
        let st = s.lock().unwrap();
        let lines = st
            .range(call.args.clone()..)
            .take_while(|(k, _)| k.starts_with(&call.args));
        Ok(lines
            .map(|(k, v)| format!("{}={}\n", String::from_utf8_lossy(k), v.len()))
            .collect::<String>()
            .into_bytes())
    });
    let (tx, rx) = mpsc::channel();
    ep.register_inline(DONE, move |req| {
        let _ = tx.send(req.from());
        Ok(Vec::new())
    });
    let progress = ep.spawn_progress();
    for _ in 1..ep.channel().size() {
        let from = rx.recv_timeout(Duration::from_secs(60)).map_err(fail)?;
        println!("rank 0: rank {from} is done");
    }
    let want = ((ep.channel().size() - 1) * THREADS * calls) as u64;
    if hits.load(Ordering::Relaxed) != want {
        return Err(fail(format!("{hits:?} increments, expected {want}")));
    }
    progress.stop()?;
    println!(
        "rank 0: {want} increments counted, {} keys stored",
        store.lock().unwrap().len()
    );
    Ok(())
}

fn client(ep: &Endpoint, calls: usize) -> Result<()> {
    let rank = ep.channel().rank();
    let call = |id: u32, args: &[u8]| ep.call(0, id, args).map_err(fail);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || -> Result<()> {
                    for i in 0..calls {
                        call(INCR, b"")?;
                        let key = format!("r{rank}-t{t}-{}", i % 10);
                        call(PUT, format!("{key}={i}").as_bytes())?;
                        if call(GET, key.as_bytes())? != i.to_string().as_bytes() {
                            return Err(fail(format!("get {key}: not {i}")));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        threads
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| fail("a caller panicked"))?)
    })?;
    // The pool handler: this rank's keys, 10 per thread.
    let scan = call(SCAN, format!("r{rank}-").as_bytes())?;
    if scan.iter().filter(|&&b| b == b'\n').count() != THREADS * calls.min(10) {
        return Err(fail(format!("scan: {}", String::from_utf8_lossy(&scan))));
    }
    // Errors come back as values; the server goes on serving.
    match ep.call(0, 99, b"") {
        Err(CallError::UnknownHandler { id: 99, .. }) => {}
        r => return Err(fail(format!("unknown handler: {r:?}"))),
    }
    match ep.call(0, GET, b"no such key") {
        Err(CallError::Handler { message, .. }) => println!("rank {rank}: get refused: {message}"),
        r => return Err(fail(format!("missing key: {r:?}"))),
    }
    ep.send(0, DONE, b"").map_err(fail)?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    println!("rank {rank}: {THREADS} threads x {calls} x (incr, put, get) in {ms:.1} ms");
    ep.shutdown();
    Ok(())
}
