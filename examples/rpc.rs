//! A small RPC service on the active-message layer ([`madeleine::am`]): the paper's
//! motivating case (section 2), a remote call whose arguments are arrays of sizes the server
//! learns from the request itself.
//!
//! ```text
//! cargo run --release --example rpc                          # 3 processes: server + 2 clients, tcp
//! cargo run --release --example rpc -- --channel shm         # the same over shared memory
//! madrun -n 5 target/release/examples/rpc -- --clients 2 --threads 4
//! ```
//!
//! Rank 0 is the server: its main thread polls ([`Endpoint::serve`]) until every client has
//! left. Every other rank is a client process whose `--clients` threads (default 4) call at
//! once; a thread waiting for its reply polls for the others, so a client needs no
//! demultiplexer thread. Services: `sum` (inline: it reads the body's length, allocates the
//! memory and receives the body straight into it), `echo` (in a pool of `--threads` workers,
//! default 2), `bye`.
//!
//! An active message carries one body, so several arrays travel as one: a count and the
//! lengths (a little-endian prefix, [`encode`]), then the arrays back to back.
//!
//! Unknown services and argument lists a service refuses get error replies; the server keeps
//! serving. Options: `--channel NAME|SPEC` (a channel name, or a spec such as `shm` or
//! `tcp,progress=block`; default `default`), `--clients N`, `--threads N`, `--calls N` (calls
//! per client thread with 8 B arguments, default 2000; a twentieth of it with 1 MiB ones),
//! `--quick` (100 calls, for CI), `--hostile` (the last client finally sends a message that is
//! not an active message: the server finishes that client's connection, the client's next call
//! fails at once instead of waiting for a reply that cannot come, and the other clients are
//! served after it).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use madeleine::am::{CallError, Config, Endpoint, Reply};
use madeleine::cli::{self, Arg, Cli};
use madeleine::{Channel, ChannelConfig, Error, RecvMode, Result, Session};

const SVC_BYE: u32 = 0;
const SVC_SUM: u32 = 1;
const SVC_ECHO: u32 = 2;
/// Most arrays in one call.
const MAX_ARGS: usize = 4;
/// Largest body `sum` accepts (a larger one is refused before any memory is allocated).
const MAX_BODY: u64 = 64 << 20;

/// One body for several arrays: `n: u32`, `n` lengths (`u64`), the arrays.
fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut b = (args.len() as u32).to_le_bytes().to_vec();
    args.iter()
        .for_each(|a| b.extend_from_slice(&(a.len() as u64).to_le_bytes()));
    args.iter().for_each(|a| b.extend_from_slice(a));
    b
}

/// The arrays of a body, borrowed from it (no copy).
fn decode(body: &[u8]) -> std::result::Result<Vec<&[u8]>, String> {
    let bad = || "malformed argument list".to_string();
    let n = u32::from_le_bytes(body.get(..4).ok_or_else(bad)?.try_into().unwrap()) as usize;
    if n > MAX_ARGS {
        return Err(bad());
    }
    let (mut args, mut at) = (Vec::new(), 4 + 8 * n);
    for i in 0..n {
        let l = body.get(4 + 8 * i..12 + 8 * i).ok_or_else(bad)?;
        let l = usize::try_from(u64::from_le_bytes(l.try_into().unwrap())).map_err(|_| bad())?;
        args.push(
            body.get(at..at.checked_add(l).ok_or_else(bad)?)
                .ok_or_else(bad)?,
        );
        at += l;
    }
    if at != body.len() {
        return Err(bad());
    }
    Ok(args)
}

fn sum(args: &[&[u8]]) -> Vec<u8> {
    let s = args
        .iter()
        .flat_map(|a| a.iter())
        .map(|&b| b as u64)
        .sum::<u64>();
    let n = args.iter().map(|a| a.len() as u64).sum::<u64>();
    [s.to_le_bytes(), n.to_le_bytes()].concat()
}

struct Opts {
    channel: String,
    clients: usize,
    threads: usize,
    calls: usize,
    hostile: bool,
}

const CLI: Cli = Cli::new(
    "rpc",
    env!("CARGO_PKG_VERSION"),
    "usage: rpc [options]                      (alone: starts 3 ranks on this host)
       madrun -n N rpc [--] [options]          (N >= 2: a server and N-1 client processes)

A small RPC service on active messages: rank 0 serves `sum`, `echo` and `bye`.

  --channel NAME|SPEC  a channel name, or a spec such as shm or tcp,progress=block
                       (default `default`)
  --clients N          calling threads per client process (default 4)
  --threads N          worker threads of the server's pool (default 2)
  --calls N            calls per client thread with 8 B arguments (default 2000)
  --quick              100 calls (CI)
  --hostile            the last client finally sends a message that is not an active message
  -h, --help           this text
  -V, --version        the version

Options take their value as `--opt value` or `--opt=value`.",
);

fn opts() -> Opts {
    let mut o = Opts {
        channel: "default".into(),
        clients: 4,
        threads: 2,
        calls: 2000,
        hostile: false,
    };
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("channel") => o.channel = cli::string(p)?,
                Arg::Long("clients") => o.clients = cli::positive(p, "--clients")?,
                Arg::Long("threads") => o.threads = cli::positive(p, "--threads")?,
                Arg::Long("calls") => o.calls = cli::positive(p, "--calls")?,
                Arg::Long("quick") => o.calls = 100,
                Arg::Long("hostile") => o.hostile = true,
                other => CLI.other(other)?,
            }
        }
        Ok(())
    });
    o
}

/// `--channel shm` opens a channel with that spec; `--channel video` the configured channel.
fn open(session: &Session, what: &str) -> Result<Channel> {
    let driver = what.split([',', ':']).next().unwrap_or("");
    if what.contains([',', ':']) || session.driver_names().contains(&driver) {
        session.open_channel_with(ChannelConfig::parse("rpc", what)?)
    } else {
        session.open_channel(what)
    }
}

fn main() {
    madeleine::init_logging();
    if let Err(e) = run() {
        eprintln!("rpc: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let o = opts();
    if let Some(code) = madeleine::run_local_if_alone(3)? {
        std::process::exit(code);
    }
    let session = madeleine::session()?;
    if session.size() < 2 {
        return Err(Error::BadConfig("rpc needs a server and a client".into()));
    }
    let ch = open(&session, &o.channel)?;
    if session.rank() == 0 {
        server(&session, ch, &o)
    } else {
        client(&session, ch, &o)
    }
}

fn fail(what: impl Into<String>) -> Error {
    Error::Io {
        context: "rpc example".into(),
        source: std::io::Error::other(what.into()),
    }
}

/// Count a handler's outcome; its error text goes back to the caller.
fn count(served: &AtomicU64, refused: &AtomicU64, r: Reply) -> Reply {
    let c = if r.is_ok() { served } else { refused };
    c.fetch_add(1, Ordering::Relaxed);
    r
}

fn server(session: &Session, ch: Channel, o: &Opts) -> Result<()> {
    let ep = Endpoint::with_config(ch, Config::default().pool(o.threads, 64));
    let (served, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let bye = Arc::new(Mutex::new(HashSet::new()));
    let (s, f) = (served.clone(), refused.clone());
    ep.register_inline(SVC_SUM, move |req| {
        if req.len() > MAX_BODY {
            return count(&s, &f, Err(format!("sum: {} B of arguments", req.len())));
        }
        // The service's memory, sized from the header; the arrays land there (CHEAPER).
        let mut body = vec![0u8; req.len() as usize];
        req.recv_into(&mut body).map_err(|e| e.to_string())?;
        count(&s, &f, decode(&body).map(|a| sum(&a)))
    });
    let (s, f) = (served.clone(), refused.clone());
    ep.register_pool(SVC_ECHO, move |call| {
        let r = decode(&call.args).and_then(|a| match a[..] {
            [one] => Ok(one.to_vec()),
            _ => Err(format!("echo takes 1 argument, got {}", a.len())),
        });
        count(&s, &f, r)
    });
    let b = bye.clone();
    ep.register_inline(SVC_BYE, move |req| {
        b.lock().unwrap().insert(req.from());
        Ok(Vec::new())
    });
    let start = Instant::now();
    std::thread::scope(|sc| -> Result<()> {
        // With --hostile, meet the clients once the hostile one was dropped (see `client`).
        let meet = o
            .hostile
            .then(|| sc.spawn(|| session.bootstrap().barrier("rpc/hostile")));
        ep.serve()?; // until every client has left
        meet.map_or(Ok(()), |h| {
            h.join().map_err(|_| fail("barrier thread panicked"))?
        })
    })?;
    let (n, bye) = (ep.channel().size(), bye.lock().unwrap().clone());
    let want: HashSet<usize> = (1..n).filter(|&r| !(o.hostile && r == n - 1)).collect();
    if bye != want {
        return Err(fail(format!("goodbyes from {bye:?}, expected {want:?}")));
    }
    println!(
        "rank 0 (server, {} workers, `{}`): {} calls served, {} refused, {:.1} s",
        o.threads,
        ep.channel().config().driver,
        served.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Error replies and the echo service, checked by every client (again after `--hostile`).
fn check_errors(ep: &Endpoint) -> Result<()> {
    let refused = |r: std::result::Result<Vec<u8>, CallError>, text: &str, what: &str| match r {
        Err(CallError::Handler { message, .. }) if message.contains(text) => Ok(()),
        r => Err(fail(format!("{what}: {r:?}"))),
    };
    match ep.call(0, 99, &encode(&[b"x"])) {
        Err(CallError::UnknownHandler { id: 99, .. }) => {}
        r => return Err(fail(format!("unknown service: {r:?}"))),
    }
    let two = ep.call(0, SVC_ECHO, &encode(&[b"a", b"b"]));
    refused(two, "takes 1 argument", "echo with two arguments")?;
    let mut lying = encode(&[b"abc"]);
    lying[..4].copy_from_slice(&1000u32.to_le_bytes());
    refused(ep.call(0, SVC_SUM, &lying), "malformed", "1000 arguments")?;
    lying[..4].copy_from_slice(&1u32.to_le_bytes());
    lying[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
    refused(ep.call(0, SVC_SUM, &lying), "malformed", "huge argument")?;
    let msg: Vec<u8> = (0..3000u32).map(|i| (i % 253) as u8).collect();
    match ep.call(0, SVC_ECHO, &encode(&[&msg])) {
        Ok(v) if v == msg => Ok(()),
        r => Err(fail(format!("echo: {r:?}"))),
    }
}

/// One client thread's run of `calls` calls of `sum` with a `size`-byte argument.
fn bench_thread(ep: &Endpoint, t: usize, size: usize, calls: usize) -> Result<Vec<Duration>> {
    let arg: Vec<u8> = (0..size).map(|i| (i * 7 + t) as u8).collect();
    let body = encode(&[&arg]);
    let want = sum(&[&arg]);
    let mut lat = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t0 = Instant::now();
        let r = ep
            .call(0, SVC_SUM, &body)
            .map_err(|e| fail(e.to_string()))?;
        lat.push(t0.elapsed());
        if r != want {
            return Err(fail(format!("sum: {r:?}, expected {want:?}")));
        }
    }
    Ok(lat)
}

fn client(session: &Session, ch: Channel, o: &Opts) -> Result<()> {
    let cfg = Config::default().call_timeout(Some(Duration::from_secs(60)));
    let ep = Endpoint::with_config(ch, cfg);
    let (rank, driver) = (ep.channel().rank(), ep.channel().config().driver.clone());
    check_errors(&ep)?;
    let mut lines = Vec::new();
    for (size, calls) in [(8usize, o.calls), (1 << 20, (o.calls / 20).max(5))] {
        let barrier = Barrier::new(o.clients);
        let t0 = Instant::now();
        let mut lat = std::thread::scope(|s| -> Result<Vec<Duration>> {
            let hs: Vec<_> = (0..o.clients)
                .map(|t| {
                    let (ep, barrier) = (&ep, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        bench_thread(ep, t, size, calls)
                    })
                })
                .collect();
            let mut lat = Vec::new();
            for h in hs {
                lat.extend(h.join().map_err(|_| fail("a client thread panicked"))??);
            }
            Ok(lat)
        })?;
        let wall = t0.elapsed().as_secs_f64();
        lat.sort();
        let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
        lines.push(format!(
            "rank {rank} ({} threads, `{driver}`): {size:>7} B args: {:>8.0} calls/s, latency median {:>8.1} µs, p99 {:>8.1} µs ({} calls)",
            o.clients,
            lat.len() as f64 / wall,
            pct(0.5),
            pct(0.99),
            lat.len()
        ));
    }
    if o.hostile && rank == ep.channel().size() - 1 {
        // Not an active message (no valid header): the server finishes this connection.
        let mut p = ep.channel().begin_packing(0)?;
        p.pack(&[0xAAu8; 32], RecvMode::Express)?;
        p.end_packing()?;
        // A call after it can never be answered: it fails at once, not after 60 s.
        let t0 = Instant::now();
        match ep.call(0, SVC_ECHO, &encode(&[b"after"])) {
            Err(e @ CallError::Transport(_)) if t0.elapsed() < Duration::from_secs(10) => {
                lines.push(format!(
                    "rank {rank}: hostile request refused, connection closed by the server ({e})"
                ));
            }
            r => return Err(fail(format!("call after the hostile message: {r:?}"))),
        }
        session.bootstrap().barrier("rpc/hostile")?;
    } else {
        if o.hostile {
            // The hostile client has been dropped: the server still serves this one.
            session.bootstrap().barrier("rpc/hostile")?;
            check_errors(&ep)?;
        }
        ep.call(0, SVC_BYE, &[]).map_err(|e| fail(e.to_string()))?;
    }
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
