//! An async RPC service on tokio over a madeleine channel (`mad-tokio`).
//!
//! ```text
//! cargo run --release --example async_rpc                      # server + 2 clients, tcp
//! cargo run --release --example async_rpc -- --channel shm     # the same over shared memory
//! madrun -n 4 target/release/examples/async_rpc -- --inflight 128
//! ```
//!
//! Rank 0 serves, every other rank is a client process. A client keeps `--inflight` calls in
//! flight at once (default 64) from as many tasks on a current-thread runtime, `--calls` calls
//! in all per client (default 20 000; `--quick`: 1 000); a call's request is a header packed
//! EXPRESS (call id, service, body length) and a body packed CHEAPER; one task demultiplexes the
//! replies by call id. The server's two dispatcher tasks (a two-worker runtime) take requests
//! from any client: each unpacks the header, *awaits* a memory permit for the body (a
//! semaphore bounding the bytes held by requests in progress) and the service lookup, then
//! allocates the body's buffer and unpacks the body straight into it: the EXPRESS/CHEAPER split
//! of Madeleine, with an await in between, and no thread blocked anywhere. The handler runs in
//! its own task and replies (header EXPRESS, result CHEAPER). Every reply is checked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mad_tokio::AsyncChannel;
use madeleine::bytemuck::{Pod, Zeroable};
use madeleine::cli::{self, Arg, Cli};
use madeleine::{ChannelConfig, Error, RecvMode, Result, SendMode};
use tokio::sync::{oneshot, Semaphore};

/// Bytes the server lets requests in progress hold at once.
const MEMORY: usize = 8 << 20;
const SVC_ECHO: u32 = 1;
const SVC_SUM: u32 = 2;
const SVC_BYE: u32 = 0;

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[bytemuck(crate = "madeleine::bytemuck")]
struct Header {
    call: u64,
    len: u64,
    service: u32,
    status: u32,
}

struct Opts {
    channel: String,
    calls: u64,
    inflight: usize,
}

const CLI: Cli = Cli::new(
    "async_rpc",
    env!("CARGO_PKG_VERSION"),
    "usage: async_rpc [options]                (alone: a server and 2 clients on this host)
       madrun -n N async_rpc [--] [options]    (N >= 2)

An async RPC service on tokio over a madeleine channel (mad-tokio).

  --channel SPEC   the channel spec (default tcp)
  --calls N        calls per client (default 20000)
  --inflight N     calls in flight per client (default 64)
  --quick          1000 calls (CI)
  -h, --help       this text
  -V, --version    the version

Options take their value as `--opt value` or `--opt=value`.",
);

fn opts() -> Opts {
    let mut o = Opts {
        channel: "tcp".into(),
        calls: 20_000,
        inflight: 64,
    };
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("channel") => o.channel = cli::string(p)?,
                Arg::Long("calls") => o.calls = cli::number(p, "--calls")?,
                Arg::Long("inflight") => {
                    o.inflight = cli::number::<u64>(p, "--inflight")?.max(1) as usize
                }
                Arg::Long("quick") => o.calls = 1_000,
                other => CLI.other(other)?,
            }
        }
        Ok(())
    });
    o
}

fn main() {
    madeleine::init_logging();
    if let Err(e) = run() {
        eprintln!("async_rpc: {e}");
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
        return Err(Error::BadConfig(
            "async_rpc needs a server and a client".into(),
        ));
    }
    let ch = session.open_channel_with(ChannelConfig::parse("rpc", &o.channel)?)?;
    let rt = if session.rank() == 0 {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
    .map_err(|e| Error::io("tokio runtime", e))?;
    rt.block_on(async {
        let ch = AsyncChannel::new(ch)?;
        if session.rank() == 0 {
            server(ch, session.size() - 1).await
        } else {
            client(ch, &o).await
        }
    })
}

/// The service itself: echo the body, or sum its bytes (an 8-byte result).
fn serve(service: u32, body: &[u8]) -> std::result::Result<Vec<u8>, u32> {
    match service {
        SVC_ECHO => Ok(body.to_vec()),
        SVC_SUM => Ok(body
            .iter()
            .map(|&b| b as u64)
            .sum::<u64>()
            .to_ne_bytes()
            .to_vec()),
        _ => Err(1),
    }
}

async fn server(ch: AsyncChannel, clients: usize) -> Result<()> {
    let permits = Arc::new(Semaphore::new(MEMORY));
    let left = Arc::new(AtomicU64::new(clients as u64));
    let served = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut dispatchers = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let (ch, permits, left, served) =
            (ch.clone(), permits.clone(), left.clone(), served.clone());
        dispatchers.spawn(async move {
            while left.load(Ordering::SeqCst) > 0 {
                let Ok(u) =
                    tokio::time::timeout(Duration::from_millis(100), ch.begin_unpacking()).await
                else {
                    continue;
                };
                let mut u = match u {
                    Ok(u) => u,
                    // The last client said goodbye and left while this task waited.
                    Err(_) if left.load(Ordering::SeqCst) == 0 => break,
                    Err(e) => return Err(e),
                };
                let client = u.remote();
                let h: Header = u.unpack_value().await?;
                if h.service == SVC_BYE {
                    u.end_unpacking().await?;
                    left.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                // Await what the body needs before allocating it: memory, then the service.
                let want = (h.len as usize).clamp(1, MEMORY) as u32;
                let permit = permits
                    .clone()
                    .acquire_many_owned(want)
                    .await
                    .map_err(|_| Error::BadConfig("semaphore closed".into()))?;
                tokio::task::yield_now().await; // (a service lookup would await here)
                let mut body = vec![0u8; h.len as usize];
                u.unpack(&mut body, SendMode::Cheaper)?;
                u.end_unpacking().await?;
                let ch = ch.clone();
                let served = served.clone();
                tokio::spawn(async move {
                    let (status, result) = match serve(h.service, &body) {
                        Ok(r) => (0, r),
                        Err(s) => (s, Vec::new()),
                    };
                    drop(permit);
                    let reply = Header {
                        call: h.call,
                        len: result.len() as u64,
                        service: h.service,
                        status,
                    };
                    let mut p = ch.begin_packing(client).await?;
                    p.pack_value(&reply, RecvMode::Express)?;
                    p.pack(&result, RecvMode::Cheaper)?;
                    p.end_packing().await?;
                    served.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, Error>(())
                });
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(r) = dispatchers.join_next().await {
        r.map_err(|e| Error::io("a dispatcher task", std::io::Error::other(e)))??;
    }
    let n = served.load(Ordering::Relaxed);
    println!(
        "server: {n} calls served in {:.2} s ({:.0} calls/s)",
        t0.elapsed().as_secs_f64(),
        n as f64 / t0.elapsed().as_secs_f64()
    );
    Ok(())
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<(Header, Vec<u8>)>>>>;

async fn client(ch: AsyncChannel, o: &Opts) -> Result<()> {
    let me = ch.channel().rank() as u64;
    let pending: Pending = Arc::default();
    // The demultiplexer: every reply to its caller, by call id.
    let demux = {
        let (ch, pending) = (ch.clone(), pending.clone());
        let calls = o.calls;
        tokio::spawn(async move {
            for _ in 0..calls {
                let mut u = ch.begin_unpacking_from(0).await?;
                let h: Header = u.unpack_value().await?;
                let mut result = vec![0u8; h.len as usize];
                u.unpack(&mut result, SendMode::Cheaper)?;
                u.end_unpacking().await?;
                let tx = pending.lock().expect("pending calls").remove(&h.call);
                match tx {
                    Some(tx) => drop(tx.send((h, result))),
                    None => {
                        return Err(Error::protocol(
                            0,
                            format!("a reply to unknown call {}", h.call),
                        ))
                    }
                }
            }
            Ok::<_, Error>(())
        })
    };
    let next = Arc::new(AtomicU64::new(0));
    let latency_ns = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..o.inflight {
        let (ch, pending, next, latency_ns) = (
            ch.clone(),
            pending.clone(),
            next.clone(),
            latency_ns.clone(),
        );
        let calls = o.calls;
        callers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= calls {
                    return Ok::<_, Error>(());
                }
                let call = me << 48 | i;
                // Mostly small calls, one in 50 with a 64 KiB body.
                let len = if i % 50 == 0 { 64 << 10 } else { 8 };
                let body: Vec<u8> = (0..len).map(|k| (k as u64 ^ i) as u8).collect();
                let service = if i % 2 == 0 { SVC_ECHO } else { SVC_SUM };
                let (tx, rx) = oneshot::channel();
                pending.lock().expect("pending calls").insert(call, tx);
                let t = Instant::now();
                let mut p = ch.begin_packing(0).await?;
                p.pack_value(
                    &Header {
                        call,
                        len: len as u64,
                        service,
                        status: 0,
                    },
                    RecvMode::Express,
                )?;
                p.pack(&body, RecvMode::Cheaper)?;
                p.end_packing().await?;
                let (h, result) = rx
                    .await
                    .map_err(|_| Error::protocol(0, "the demultiplexer stopped"))?;
                latency_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let expect =
                    serve(service, &body).map_err(|_| Error::protocol(0, "bad service"))?;
                if h.status != 0 || result != expect {
                    return Err(Error::protocol(0, format!("wrong reply to call {call}")));
                }
            }
        });
    }
    while let Some(r) = callers.join_next().await {
        r.map_err(|e| Error::io("a caller task", std::io::Error::other(e)))??;
    }
    demux
        .await
        .map_err(|e| Error::io("the demultiplexer task", std::io::Error::other(e)))??;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "client {me}: {} calls, {} in flight, {:.0} calls/s, {:.1} µs per call",
        o.calls,
        o.inflight,
        o.calls as f64 / secs,
        latency_ns.load(Ordering::Relaxed) as f64 / o.calls as f64 / 1e3
    );
    let mut p = ch.begin_packing(0).await?;
    p.pack_value(
        &Header {
            call: u64::MAX,
            len: 0,
            service: SVC_BYE,
            status: 0,
        },
        RecvMode::Express,
    )?;
    p.end_packing().await
}
