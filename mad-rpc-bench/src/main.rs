//! `rpc-bench`: RPC calls/s and p50 / p99 latency of mad-am (active messages) over shm and tcp
//! against gRPC (tonic) over loopback TCP and a Unix socket, in one run, and the head-of-line
//! measurement (issue 17).
//!
//! Two processes: rank 0 serves (mad-am endpoints with a progress thread, an inline echo
//! handler and a pool echo handler; tonic servers on a tokio multi-thread runtime), rank 1
//! calls. `rpc-bench` alone starts both on this host; `madrun -n 2 rpc-bench` also works.
//! See `--help` and BENCHMARKS.md ("RPC: active messages against gRPC").

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use mad_am::{CallError, Endpoint};
use mad_core::cli::{self, Arg, Cli};
use madeleine::ChannelConfig;

mod grpc;
mod measure;

use measure::{run_point, Rec, Stats, Timing, Window};

const USAGE: &str = "\
rpc-bench: mad-am active messages against gRPC (tonic), and head-of-line blocking

USAGE: rpc-bench [OPTIONS]            (starts its 2 ranks on this host)
       madrun -n 2 rpc-bench [OPTIONS]

Rank 0 serves, rank 1 calls. Every point runs mad-am over shm and tcp (inline and pool echo
handlers; N in flight = N client threads each calling in a loop: the call is blocking; and
`loop`: one client thread keeping N async calls in flight in Endpoint::block_on) and
tonic over loopback TCP and a Unix socket (N in flight = N tokio tasks on one connection),
interleaved. Then head-of-line: the p99 of 8 B calls from one thread while another thread of
the same process streams 16 MiB requests to the same server, against the idle p99; the calls
back to back, then paced (one due every 200 us, latency counted from the time it was due;
calls that fall due while one is held up count as waiting for it). A probe is judged (p99
within 3x idle) only if the stream moved at least half its bytes meanwhile; every judged
probe must be within.

OPTIONS:
    --quick             short points (0.1 s, 0.05 s warm-up; head-of-line 0.3 s)
    --duration SECS     measured window of a point (default 1)
    --warmup SECS       warm-up before each window (default 0.2)
    --sizes LIST        argument sizes, e.g. 8,64k,1m (default 8,64k,1m)
    --inflight LIST     calls in flight, e.g. 1,16,256 (default 1,16,256)
    --hol-size SIZE     request size of the head-of-line stream (default 16m)
    --no-hol            skip the head-of-line measurement
    --shm SPEC          channel spec of the shm runs (default shm)
    --tcp SPEC          channel spec of the tcp runs (default tcp)
    --impls LIST        run only these (default all): shm-inline,shm-loop,shm-pool,
                        tcp-inline,tcp-loop,tcp-pool,tonic-tcp,tonic-uds
    --client-progress   the client's endpoints get a progress thread too (by default its
                        calling threads poll for each other)
    --csv FILE          write every row to FILE
                        (case,transport,impl,args,inflight,calls,calls_per_s,p50_us,p99_us,
                        max_us,fairness: a caller's fewest calls over the mean)
    -h, --help          this text
    -V, --version       the version

Options take their value as `--opt value` or `--opt=value`.
";

/// What `--impls` selects from.
const IMPLS: [&str; 8] = [
    "shm-inline",
    "shm-loop",
    "shm-pool",
    "tcp-inline",
    "tcp-loop",
    "tcp-pool",
    "tonic-tcp",
    "tonic-uds",
];

#[derive(Clone, Debug)]
struct Opts {
    quick: bool,
    timing: Timing,
    hol_window: Duration,
    sizes: Vec<usize>,
    inflight: Vec<usize>,
    hol_size: usize,
    hol: bool,
    shm: String,
    tcp: String,
    csv: Option<PathBuf>,
    impls: Vec<String>,
    client_progress: bool,
}

/// The command line (`--help` prints [`USAGE`]).
const CLI: Cli = Cli::new("rpc-bench", env!("CARGO_PKG_VERSION"), USAGE);

fn secs(flag: &str, v: &str) -> Result<Duration, String> {
    match v.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 3600.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!(
            "{flag}: `{v}` is not a number of seconds in (0, 3600]"
        )),
    }
}

fn size(flag: &str, v: &str) -> Result<usize, String> {
    match madeleine::config::parse_size(v) {
        // tonic's message limit here (grpc::MAX_MESSAGE) less room for the framing.
        Some(n) if n <= grpc::MAX_MESSAGE - 4096 => Ok(n),
        _ => Err(format!(
            "{flag}: `{v}` is not a size below 64m (4096, 64k, 1m)"
        )),
    }
}

fn list(
    flag: &str,
    v: &str,
    f: impl Fn(&str) -> Result<usize, String>,
) -> Result<Vec<usize>, String> {
    let l: Vec<usize> = v
        .split(',')
        .map(|x| f(x.trim()))
        .collect::<Result<_, _>>()?;
    if l.is_empty() {
        return Err(format!("{flag}: an empty list"));
    }
    Ok(l)
}

/// `Ok(None)`: `--help`.
fn parse_args(args: &[String]) -> Result<Option<Opts>, String> {
    let mut o = Opts {
        quick: false,
        timing: Timing {
            warmup: Duration::from_millis(200),
            window: Duration::from_secs(1),
        },
        hol_window: Duration::from_secs(2),
        sizes: vec![8, 64 << 10, 1 << 20],
        inflight: vec![1, 16, 256],
        hol_size: 16 << 20,
        hol: true,
        shm: "shm".into(),
        tcp: "tcp".into(),
        csv: None,
        impls: IMPLS.iter().map(|s| s.to_string()).collect(),
        client_progress: false,
    };
    let (mut duration, mut warmup) = (None, None);
    let parsed = cli::parse_from(args, |p| {
        while let Some(arg) = p.next()? {
            let flag = match &arg {
                Arg::Long(l) => format!("--{l}"),
                _ => String::new(),
            };
            let flag = flag.as_str();
            match arg {
                Arg::Short('h') | Arg::Long("help") => return Ok(false),
                Arg::Short('V') | Arg::Long("version") => CLI.version(),
                Arg::Long("quick") => o.quick = true,
                Arg::Long("no-hol") => o.hol = false,
                Arg::Long("client-progress") => o.client_progress = true,
                Arg::Long("duration") => duration = Some(secs(flag, &cli::string(p)?)?),
                Arg::Long("warmup") => warmup = Some(secs(flag, &cli::string(p)?)?),
                Arg::Long("sizes") => o.sizes = list(flag, &cli::string(p)?, |x| size(flag, x))?,
                Arg::Long("inflight") => {
                    o.inflight = list(flag, &cli::string(p)?, |x| match x.parse::<usize>() {
                        Ok(n) if (1..=1024).contains(&n) => Ok(n),
                        _ => Err(format!("{flag}: `{x}` is not a count in 1..=1024")),
                    })?
                }
                Arg::Long("hol-size") => o.hol_size = size(flag, &cli::string(p)?)?.max(1),
                Arg::Long("shm") => o.shm = cli::string(p)?,
                Arg::Long("tcp") => o.tcp = cli::string(p)?,
                Arg::Long("csv") => o.csv = Some(PathBuf::from(p.value()?)),
                Arg::Long("impls") => {
                    let v = cli::string(p)?;
                    o.impls = v.split(',').map(|x| x.trim().to_string()).collect();
                    if let Some(bad) = o.impls.iter().find(|x| !IMPLS.contains(&x.as_str())) {
                        return Err(format!(
                            "--impls: unknown `{bad}` (known: {})",
                            IMPLS.join(",")
                        )
                        .into());
                    }
                }
                other => return Err(other.unexpected()),
            }
        }
        Ok(true)
    });
    match parsed {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    if o.quick {
        o.timing = Timing {
            warmup: Duration::from_millis(50),
            window: Duration::from_millis(100),
        };
        o.hol_window = Duration::from_millis(300);
    }
    if let Some(d) = duration {
        o.timing.window = d;
        o.hol_window = d * 2;
    }
    if let Some(w) = warmup {
        o.timing.warmup = w;
    }
    // Both specs must parse (a bad one is a usage error, before any rank starts).
    ChannelConfig::parse("rpc-shm", &o.shm).map_err(|e| format!("--shm: {e}"))?;
    ChannelConfig::parse("rpc-tcp", &o.tcp).map_err(|e| format!("--tcp: {e}"))?;
    Ok(Some(o))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{USAGE}");
            return;
        }
        Err(e) => CLI.fail(e),
    };
    madeleine::init_logging();
    match madeleine::run_local_if_alone(2) {
        Ok(Some(code)) => std::process::exit(code),
        Ok(None) => {}
        Err(e) => {
            eprintln!("rpc-bench: starting the ranks: {e}");
            std::process::exit(1);
        }
    }
    if let Err(e) = run(&opts) {
        eprintln!("rpc-bench: {e}");
        std::process::exit(1);
    }
}

trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, String>;
}

impl<T, E: std::fmt::Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: &str) -> Result<T, String> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// Handler ids.
const ECHO_INLINE: u32 = 1;
const ECHO_POOL: u32 = 2;
const SINK: u32 = 3;
const STOP: u32 = 4;
const SERVER: usize = 0;

fn register(ep: &Endpoint, stop: std::sync::mpsc::Sender<()>) {
    ep.register_inline(ECHO_INLINE, |req| req.recv_vec().map_err(|e| e.to_string()));
    ep.register_pool(ECHO_POOL, |call| Ok(call.args));
    // The head-of-line stream: received into one buffer the handler keeps (straight from the
    // driver, or the reassembled fragments handed over without a copy), no reply body.
    let buf = Mutex::new(Vec::<u8>::new());
    ep.register_inline(SINK, move |req| {
        let mut b = buf.lock().unwrap_or_else(|e| e.into_inner());
        req.recv_into_vec(&mut b).map_err(|e| e.to_string())?;
        Ok(Vec::new())
    });
    ep.register_inline(STOP, move |_req| {
        let _ = stop.send(());
        Ok(Vec::new())
    });
}

fn run(o: &Opts) -> Result<(), String> {
    let s = madeleine::session().ctx("session")?;
    if s.size() != 2 {
        return Err(format!(
            "needs exactly 2 ranks (rank 0 serves, rank 1 calls), not {}",
            s.size()
        ));
    }
    let rank = s.rank();
    // Rank 0 starts the gRPC servers first and tells rank 1 where they are.
    let server_rt = if rank == SERVER {
        Some(
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("grpc-server")
                .build()
                .ctx("the gRPC server's runtime")?,
        )
    } else {
        None
    };
    let servers = match &server_rt {
        Some(rt) => {
            let uds = std::env::temp_dir().join(format!("rpc-bench-{}.sock", std::process::id()));
            Some(grpc::Servers::start(rt, uds).ctx("starting the gRPC servers")?)
        }
        None => None,
    };
    let info = servers
        .as_ref()
        .map(|g| format!("{}\n{}", g.tcp, g.uds.display()))
        .unwrap_or_default();
    let all = s
        .bootstrap()
        .allgather("rpc-bench/grpc", info.as_bytes())
        .ctx("exchanging the gRPC addresses")?;
    let info = String::from_utf8_lossy(&all[SERVER]).into_owned();
    let (tcp_addr, uds_path) = info.split_once('\n').ok_or("rank 0 sent no gRPC address")?;
    let tcp_addr: std::net::SocketAddr = tcp_addr.parse().ctx("rank 0's gRPC address")?;
    let uds_path = PathBuf::from(uds_path);

    let shm = s
        .open_channel_with(ChannelConfig::parse("rpc-shm", &o.shm).ctx("--shm")?)
        .ctx("opening the shm channel")?;
    let tcp = s
        .open_channel_with(ChannelConfig::parse("rpc-tcp", &o.tcp).ctx("--tcp")?)
        .ctx("opening the tcp channel")?;
    // The raw `rpc` pattern of mad-bench, on channels of their own (a channel mad-am uses
    // carries only its messages): the reference of the layer's cost.
    let raw = [
        s.open_channel_with(ChannelConfig::parse("rpc-shm-raw", &o.shm).ctx("--shm")?)
            .ctx("opening the raw shm channel")?,
        s.open_channel_with(ChannelConfig::parse("rpc-tcp-raw", &o.tcp).ctx("--tcp")?)
            .ctx("opening the raw tcp channel")?,
    ];
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    let eps = [Endpoint::new(shm), Endpoint::new(tcp)];
    for ep in &eps {
        register(ep, stop_tx.clone());
    }
    s.bootstrap()
        .barrier("rpc-bench/ready")
        .ctx("waiting for both ranks")?;

    if rank == SERVER {
        let progress: Vec<_> = eps.iter().map(Endpoint::spawn_progress).collect();
        let raw_done = std::thread::scope(|sc| {
            let hs: Vec<_> = raw
                .iter()
                .map(|ch| sc.spawn(move || raw_server(ch)))
                .collect();
            // Until the client says stop (it always does, even when it failed); the raw
            // servers end at the client's last message on their channel, or when it leaves.
            let _ = stop_rx.recv();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a raw server panicked".into()))
                })
                .collect::<Result<Vec<()>, String>>()
        });
        drop(progress);
        if let Err(e) = raw_done {
            eprintln!("rpc-bench: the raw rpc server: {e}");
        }
        if let Some(g) = &servers {
            g.cleanup();
        }
        s.bootstrap()
            .barrier("rpc-bench/done")
            .ctx("the final barrier")?;
        drop(server_rt);
        return Ok(());
    }

    let progress: Vec<_> = if o.client_progress {
        eps.iter().map(Endpoint::spawn_progress).collect()
    } else {
        Vec::new()
    };
    let r = client(o, &eps, &raw, tcp_addr, &uds_path);
    for ch in &raw {
        let _ = raw_send(ch, RAW_STOP, &[]);
    }
    // Stop the server whatever happened (over shm, else tcp).
    let stopped = eps.iter().any(|ep| ep.send(SERVER, STOP, &[]).is_ok());
    if stopped {
        let _ = s.bootstrap().barrier("rpc-bench/done");
    }
    drop(progress);
    r
}

/// The header that ends a raw rpc server.
const RAW_STOP: u64 = u64::MAX;

/// One message of mad-bench's `rpc` pattern: an 8-byte size header EXPRESS, then the body
/// CHEAPER, sent as a whole (`flush_at_end`).
fn raw_send(ch: &madeleine::Channel, size: u64, body: &[u8]) -> madeleine::Result<()> {
    let to = 1 - ch.rank();
    let mut p = ch.begin_packing(to)?;
    p.flush_at_end();
    p.pack_value(&size, madeleine::RecvMode::Express)?;
    p.pack(body, madeleine::RecvMode::Cheaper)?;
    p.end_packing()
}

/// Receive one `rpc` message into `buf`; its size header.
fn raw_recv(ch: &madeleine::Channel, buf: &mut [u8]) -> madeleine::Result<u64> {
    let from = 1 - ch.rank();
    let mut u = ch.begin_unpacking_from(from)?;
    let n: u64 = u.unpack_value()?;
    let len = if n == RAW_STOP { 0 } else { n as usize };
    if len > buf.len() {
        return Err(madeleine::Error::protocol(
            from,
            format!("rpc body of {n} B"),
        ));
    }
    u.unpack(&mut buf[..len], madeleine::SendMode::Cheaper)?;
    u.end_unpacking()?;
    Ok(n)
}

/// The server of the raw `rpc` pattern: an empty reply to every request (as mad-bench's).
fn raw_server(ch: &madeleine::Channel) -> Result<(), String> {
    let mut buf = vec![0u8; 4096];
    loop {
        match raw_recv(ch, &mut buf) {
            Ok(RAW_STOP) => return Ok(()),
            Ok(_) => raw_send(ch, 0, &[]).map_err(|e| format!("raw rpc reply: {e}"))?,
            // The client left without its last message (it failed): nothing more to serve.
            Err(_) if ch.is_closed() => return Ok(()),
            Err(e) => return Err(format!("raw rpc request: {e}")),
        }
    }
}

/// Rounds of [`layer_cost`], each timing [`LAYER_CALLS`] round trips of each.
const LAYER_ROUNDS: usize = 7;
const LAYER_CALLS: usize = 20_000;

/// The layer's cost: the round trip of an 8 B call to an inline handler with an empty reply
/// (mad-am's `SINK`), against mad-bench's raw `rpc` pattern (8 B body, empty reply) on a
/// channel of the same spec, 1 in flight, rounds alternated; medians in µs (raw, mad-am).
fn layer_cost(ep: &Endpoint, raw: &madeleine::Channel, quick: bool) -> Result<(f64, f64), String> {
    let (rounds, calls) = if quick {
        (2, 500)
    } else {
        (LAYER_ROUNDS, LAYER_CALLS)
    };
    let body = [0x5au8; 8];
    let mut got = [0u8; 16];
    let (mut raw_us, mut am_us) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t0 = Instant::now();
        for _ in 0..calls {
            raw_send(raw, body.len() as u64, &body).map_err(|e| format!("raw rpc: {e}"))?;
            if raw_recv(raw, &mut got).map_err(|e| format!("raw rpc: {e}"))? != 0 {
                return Err("raw rpc: a reply with a body".into());
            }
        }
        raw_us.push(t0.elapsed().as_secs_f64() * 1e6 / calls as f64);
        let t0 = Instant::now();
        for _ in 0..calls {
            let r = ep.call(SERVER, SINK, &body).map_err(call_error)?;
            if !r.is_empty() {
                return Err("mad-am: a reply with a body".into());
            }
        }
        am_us.push(t0.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(&mut raw_us), median(&mut am_us)))
}

/// What a point calls.
#[derive(Clone)]
enum Target {
    Am {
        ep: Endpoint,
        id: u32,
    },
    /// N calls in flight from one thread: `call_async` futures driven by
    /// [`Endpoint::block_on`], which polls for the endpoint meanwhile.
    AmLoop {
        ep: Endpoint,
        id: u32,
    },
    Grpc {
        c: grpc::Client,
    },
}

struct Impl {
    /// The `--impls` name.
    id: &'static str,
    transport: &'static str,
    name: &'static str,
    target: Target,
}

struct Row {
    case: &'static str,
    transport: &'static str,
    name: &'static str,
    args: usize,
    inflight: usize,
    st: Stats,
}

fn call_error(e: CallError) -> String {
    format!("mad-am call: {e}")
}

/// The rank-1 side: every point, interleaved, then head-of-line; the tables and the CSV.
fn client(
    o: &Opts,
    eps: &[Endpoint; 2],
    raw: &[madeleine::Channel; 2],
    tcp_addr: std::net::SocketAddr,
    uds_path: &std::path::Path,
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("grpc-client")
        .build()
        .ctx("the gRPC client's runtime")?;
    let gtcp = rt.block_on(grpc::Client::tcp(tcp_addr))?;
    let guds = rt.block_on(grpc::Client::uds(uds_path))?;
    let am = |ep: &Endpoint, id| Target::Am { ep: ep.clone(), id };
    let impls = [
        Impl {
            id: "shm-inline",
            transport: "shm",
            name: "mad-am inline",
            target: am(&eps[0], ECHO_INLINE),
        },
        Impl {
            id: "shm-loop",
            transport: "shm",
            name: "mad-am loop",
            target: Target::AmLoop {
                ep: eps[0].clone(),
                id: ECHO_INLINE,
            },
        },
        Impl {
            id: "shm-pool",
            transport: "shm",
            name: "mad-am pool",
            target: am(&eps[0], ECHO_POOL),
        },
        Impl {
            id: "tcp-inline",
            transport: "tcp",
            name: "mad-am inline",
            target: am(&eps[1], ECHO_INLINE),
        },
        Impl {
            id: "tcp-loop",
            transport: "tcp",
            name: "mad-am loop",
            target: Target::AmLoop {
                ep: eps[1].clone(),
                id: ECHO_INLINE,
            },
        },
        Impl {
            id: "tcp-pool",
            transport: "tcp",
            name: "mad-am pool",
            target: am(&eps[1], ECHO_POOL),
        },
        Impl {
            id: "tonic-tcp",
            transport: "tcp",
            name: "tonic",
            target: Target::Grpc { c: gtcp },
        },
        Impl {
            id: "tonic-uds",
            transport: "uds",
            name: "tonic",
            target: Target::Grpc { c: guds },
        },
    ];
    let impls: Vec<Impl> = impls
        .into_iter()
        .filter(|i| o.impls.iter().any(|x| x == i.id))
        .collect();
    let t0 = Instant::now();
    let mut rows = Vec::new();
    for &args in &o.sizes {
        for &inflight in &o.inflight {
            for i in &impls {
                let st = point(&rt, &i.target, args, inflight, o.timing).map_err(|e| {
                    format!(
                        "{} {}, {args} B, {inflight} in flight: {e}",
                        i.transport, i.name
                    )
                })?;
                eprintln!(
                    "rpc-bench: {:>3} {:<13} {:>8} B x{:<3}: {:>9.0} calls/s, p50 {:>9.1} us, p99 {:>9.1} us, max {:>9.0} us ({} calls, fairness {:.2})",
                    i.transport, i.name, args, inflight, st.rate, st.p50, st.p99, st.max, st.calls,
                    st.fairness
                );
                rows.push(Row {
                    case: "sweep",
                    transport: i.transport,
                    name: i.name,
                    args,
                    inflight,
                    st,
                });
            }
        }
    }
    // The layer's cost, on the transports whose inline handler was selected.
    let mut layer = Vec::new();
    for (k, transport) in ["shm", "tcp"].into_iter().enumerate() {
        if !o.impls.iter().any(|x| *x == format!("{transport}-inline")) {
            continue;
        }
        let (r, a) = layer_cost(&eps[k], &raw[k], o.quick)
            .map_err(|e| format!("{transport}: the layer's cost: {e}"))?;
        eprintln!(
            "rpc-bench: layer {transport}: raw rpc {r:.2} us, mad-am inline {a:.2} us ({:.2}x)",
            a / r
        );
        for (name, us) in [("raw rpc", r), ("mad-am inline", a)] {
            rows.push(Row {
                case: "layer",
                transport,
                name,
                args: 8,
                inflight: 1,
                st: Stats {
                    calls: if o.quick {
                        1000
                    } else {
                        LAYER_ROUNDS * LAYER_CALLS
                    },
                    rate: 1e6 / us,
                    p50: us,
                    p99: f64::NAN,
                    max: f64::NAN,
                    window: None,
                    fairness: 1.0,
                },
            });
        }
        layer.push((transport, r, a));
    }
    let mut hol = Vec::new();
    if o.hol {
        // The inline handlers (the short-handler path) and tonic for reference.
        for i in impls
            .iter()
            .filter(|i| i.name != "mad-am pool" && i.name != "mad-am loop")
        {
            let h = head_of_line(&rt, &i.target, o)
                .map_err(|e| format!("head-of-line, {} {}: {e}", i.transport, i.name))?;
            eprintln!(
                "rpc-bench: head-of-line {:>3} {:<13}: idle p99 {:.1} us, with the {} B stream p99 {:.1} us ({:.1}x); stream {:.0} MB/s alone, {:.0} MB/s meanwhile",
                i.transport,
                i.name,
                h.idle.p99,
                o.hol_size,
                h.loaded.p99,
                h.loaded.p99 / h.idle.p99,
                h.alone.rate * o.hol_size as f64 / 1e6,
                h.during.rate * o.hol_size as f64 / 1e6,
            );
            for (case, args, st) in [
                ("hol-idle", 8, h.idle),
                ("hol-loaded", 8, h.loaded),
                ("hol-paced-idle", 8, h.paced_idle),
                ("hol-paced-loaded", 8, h.paced_loaded),
                ("hol-stream-alone", o.hol_size, h.alone),
                ("hol-stream-during", o.hol_size, h.during),
                ("hol-stream-during-paced", o.hol_size, h.during_paced),
            ] {
                rows.push(Row {
                    case,
                    transport: i.transport,
                    name: i.name,
                    args,
                    inflight: 1,
                    st,
                });
            }
            hol.push((i.transport, i.name, h));
        }
    }
    drop(impls);
    rt.shutdown_timeout(Duration::from_secs(1));
    if let Some(path) = &o.csv {
        write_csv(path, &rows).ctx(&format!("writing {}", path.display()))?;
    }
    let mut out = std::io::stdout().lock();
    report(&mut out, o, &rows, &layer, &hol, t0.elapsed()).ctx("writing the report")?;
    Ok(())
}

/// One point of one implementation.
fn point(
    rt: &tokio::runtime::Runtime,
    t: &Target,
    args: usize,
    inflight: usize,
    timing: Timing,
) -> Result<Stats, String> {
    let min_calls = (2 * inflight as u64).max(20);
    match t {
        Target::Am { ep, id } => run_point(timing, min_calls, |w| {
            let hs: Vec<_> = (0..inflight)
                .map(|_| {
                    let (ep, w, id) = (ep.clone(), w.clone(), *id);
                    std::thread::spawn(move || am_caller(&ep, id, args, &w))
                })
                .collect();
            move || join_threads(hs)
        }),
        Target::AmLoop { ep, id } => run_point(timing, min_calls, |w| {
            let (ep, id) = (ep.clone(), *id);
            let h = std::thread::spawn(move || am_loop(&ep, id, args, inflight, &w));
            move || join_threads(vec![h])
        }),
        Target::Grpc { c } => run_point(timing, min_calls, |w| {
            let data = Bytes::from(vec![0x5a; args]);
            let hs: Vec<_> = (0..inflight)
                .map(|_| {
                    let (mut c, w, data) = (c.clone(), w.clone(), data.clone());
                    rt.spawn(async move {
                        let mut rec = Vec::new();
                        while !w.stopped() {
                            let t0 = Instant::now();
                            if let Err(e) = c.echo(data.clone()).await {
                                w.fail();
                                return Err(e);
                            }
                            w.record(t0, Instant::now(), &mut rec);
                        }
                        Ok(rec)
                    })
                })
                .collect();
            move || {
                rt.block_on(async {
                    let mut all = Vec::with_capacity(hs.len());
                    for h in hs {
                        all.push(h.await.map_err(|e| format!("a gRPC task: {e}"))??);
                    }
                    Ok(all)
                })
            }
        }),
    }
}

/// The head-of-line probe's period: one 8 B call due every 200 µs.
const PROBE_EVERY: Duration = Duration::from_micros(200);

/// The head-of-line probe: one thread makes an 8 B call every [`PROBE_EVERY`], and each
/// call's latency counts from the time it was due. A call that fell due while the previous one
/// was held up is not made late (no backlog): it counts as waiting until that call completed.
/// So every sample stands for one period of time, and a call held up behind a large message
/// counts for every period it lasted (no coordinated omission).
fn probe(rt: &tokio::runtime::Runtime, t: &Target, timing: Timing) -> Result<Stats, String> {
    run_point(timing, 20, |w| {
        let h = match t {
            Target::Am { ep, id } | Target::AmLoop { ep, id } => {
                let (ep, id) = (ep.clone(), *id);
                std::thread::spawn(move || {
                    probe_loop(&w, || {
                        ep.call(SERVER, id, &[0x5a; 8])
                            .map(|r| r.len())
                            .map_err(call_error)
                    })
                })
            }
            Target::Grpc { c } => {
                let (c, h) = (c.clone(), rt.handle().clone());
                std::thread::spawn(move || {
                    probe_loop(&w, || {
                        let mut c = c.clone();
                        h.block_on(c.echo(Bytes::from_static(&[0x5a; 8])))
                            .map(|()| 8)
                    })
                })
            }
        };
        move || {
            Ok(vec![h
                .join()
                .map_err(|_| "the probe panicked".to_string())??])
        }
    })
}

fn probe_loop(
    w: &Window,
    mut call: impl FnMut() -> Result<usize, String>,
) -> Result<Vec<Rec>, String> {
    let mut rec = Vec::new();
    let mut next = Instant::now();
    while !w.stopped() {
        // Sleep until just before the call is due, then yield until it is.
        loop {
            let now = Instant::now();
            if now >= next {
                break;
            }
            let left = next - now;
            if left > Duration::from_micros(150) {
                std::thread::sleep(left - Duration::from_micros(100));
            } else {
                std::thread::yield_now();
            }
        }
        let due = next;
        match call() {
            Ok(8) => {}
            Ok(n) => {
                w.fail();
                return Err(format!("echo: {n} B back for 8 B"));
            }
            Err(e) => {
                w.fail();
                return Err(e);
            }
        }
        let done = Instant::now();
        w.record(due, done, &mut rec);
        // The calls that fell due meanwhile would have waited until now.
        next = due + PROBE_EVERY;
        while next < done {
            w.record(next, done, &mut rec);
            next += PROBE_EVERY;
        }
    }
    Ok(rec)
}

fn am_caller(ep: &Endpoint, id: u32, args: usize, w: &Window) -> Result<Vec<Rec>, String> {
    let a = vec![0x5au8; args];
    let mut rec = Vec::new();
    while !w.stopped() {
        let t0 = Instant::now();
        let r = match ep.call(SERVER, id, &a) {
            Ok(r) => r,
            Err(e) => {
                w.fail();
                return Err(call_error(e));
            }
        };
        let t1 = Instant::now();
        if r.len() != args {
            w.fail();
            return Err(format!("echo: {} B back for {args} B", r.len()));
        }
        w.record(t0, t1, &mut rec);
    }
    Ok(rec)
}

/// `inflight` calls at a time from this one thread, each answered call replaced by the
/// next: `call_async` futures in a `FuturesUnordered`, run by [`Endpoint::block_on`] (this
/// thread polls for the endpoint: no hand-off per reply).
fn am_loop(
    ep: &Endpoint,
    id: u32,
    args: usize,
    inflight: usize,
    w: &Window,
) -> Result<Vec<Rec>, String> {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let a = vec![0x5au8; args];
    let call = || {
        let t0 = Instant::now();
        let f = ep.call_async(SERVER, id, &a);
        async move { (t0, f.await) }
    };
    ep.block_on(async {
        let mut calls: FuturesUnordered<_> = (0..inflight).map(|_| call()).collect();
        let mut rec = Vec::new();
        while let Some((t0, r)) = calls.next().await {
            let t1 = Instant::now();
            match r {
                Ok(r) if r.len() == args => w.record(t0, t1, &mut rec),
                Ok(r) => {
                    w.fail();
                    return Err(format!("echo: {} B back for {args} B", r.len()));
                }
                Err(e) => {
                    w.fail();
                    return Err(call_error(e));
                }
            }
            if w.stopped() {
                break;
            }
            calls.push(call());
        }
        Ok(rec)
    })
}

fn join_threads<T>(hs: Vec<std::thread::JoinHandle<Result<T, String>>>) -> Result<Vec<T>, String> {
    let mut all = Vec::with_capacity(hs.len());
    let mut err = None;
    for h in hs {
        match h.join() {
            Ok(Ok(v)) => all.push(v),
            Ok(Err(e)) => err = err.or(Some(e)),
            Err(_) => err = err.or(Some("a calling thread panicked".to_string())),
        }
    }
    err.map_or(Ok(all), Err)
}

struct Hol {
    /// Back-to-back 8 B calls (closed loop), alone and with the stream.
    idle: Stats,
    loaded: Stats,
    /// Paced 8 B calls ([`probe`]), alone and with the stream.
    paced_idle: Stats,
    paced_loaded: Stats,
    /// The stream's calls alone (before the probe), in a window as long as the probe's.
    alone: Stats,
    /// The stream's calls inside the back-to-back probe's window, and inside the paced one's.
    during: Stats,
    during_paced: Stats,
}

/// A probe's verdict: its p99 with the stream within 3× its idle p99, judged only when the
/// stream moved at least half as many bytes meanwhile as alone (otherwise the figure says
/// nothing about head-of-line blocking: the stream was starved, as a back-to-back caller
/// starves it of CPU on 2 cores).
fn hol_verdict(ratio: f64, during: &Stats, alone: &Stats) -> Option<bool> {
    (during.rate >= 0.5 * alone.rate).then_some(ratio <= 3.0)
}

/// The stream's calls (completion time, latency in ns) that completed inside `[from, to]`.
fn stream_stats(recs: &[(Instant, u64)], from: Instant, to: Instant) -> Stats {
    let mut lat: Vec<u64> = recs
        .iter()
        .filter(|&&(at, _)| at >= from && at <= to)
        .map(|&(_, l)| l)
        .collect();
    lat.sort_unstable();
    Stats {
        calls: lat.len(),
        rate: lat.len() as f64 / to.saturating_duration_since(from).as_secs_f64().max(1e-9),
        p50: measure::percentile(&lat, 0.5),
        p99: measure::percentile(&lat, 0.99),
        max: measure::percentile(&lat, 1.0),
        window: Some((from, to)),
        fairness: 1.0,
    }
}

/// The idle p99 of 8 B calls from one thread; then another thread streams `hol_size`
/// requests to the sink of the same server over the same connection, alone for one window
/// (its rate alone), then with the 8 B calls again (the loaded p99, and the stream's rate
/// meanwhile).
fn head_of_line(rt: &tokio::runtime::Runtime, t: &Target, o: &Opts) -> Result<Hol, String> {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let timing = Timing {
        warmup: o.timing.warmup,
        window: o.hol_window,
    };
    let idle = point(rt, t, 8, 1, timing)?;
    let paced_idle = probe(rt, t, timing)?;
    let big = o.hol_size;
    let started = Arc::new(std::sync::Barrier::new(2));
    let stop = Arc::new(AtomicBool::new(false));
    type Recs = Result<Vec<(Instant, u64)>, String>;
    // The stream runs until `stop`; its first call completed before anything is measured.
    let streamer: Box<dyn FnOnce() -> Recs> = match t {
        Target::Am { ep, .. } | Target::AmLoop { ep, .. } => {
            let (ep, started, stop) = (ep.clone(), started.clone(), stop.clone());
            let h = std::thread::spawn(move || {
                let a = vec![0xa5u8; big];
                let mut recs = Vec::new();
                let mut r = Ok(());
                while !stop.load(Relaxed) {
                    let t0 = Instant::now();
                    if let Err(e) = ep.call(SERVER, SINK, &a) {
                        r = Err(call_error(e));
                        break;
                    }
                    let t1 = Instant::now();
                    recs.push((t1, (t1 - t0).as_nanos() as u64));
                    if recs.len() == 1 {
                        started.wait();
                    }
                }
                if recs.is_empty() {
                    started.wait();
                }
                r.map(|()| recs)
            });
            Box::new(move || {
                h.join()
                    .map_err(|_| "the streaming thread panicked".to_string())?
            })
        }
        Target::Grpc { c } => {
            let (mut c, started, stop) = (c.clone(), started.clone(), stop.clone());
            let h = rt.spawn(async move {
                let data = Bytes::from(vec![0xa5u8; big]);
                let mut recs = Vec::new();
                let mut r = Ok(());
                while !stop.load(Relaxed) {
                    let t0 = Instant::now();
                    if let Err(e) = c.sink(data.clone()).await {
                        r = Err(e);
                        break;
                    }
                    let t1 = Instant::now();
                    recs.push((t1, (t1 - t0).as_nanos() as u64));
                    if recs.len() == 1 {
                        let b = started.clone();
                        tokio::task::spawn_blocking(move || b.wait());
                    }
                }
                if recs.is_empty() {
                    let b = started.clone();
                    tokio::task::spawn_blocking(move || b.wait());
                }
                r.map(|()| recs)
            });
            Box::new(move || {
                rt.block_on(h)
                    .map_err(|e| format!("the streaming task: {e}"))?
            })
        }
    };
    started.wait();
    let alone_from = Instant::now();
    std::thread::sleep(o.hol_window);
    let alone_to = Instant::now();
    let loaded = point(rt, t, 8, 1, timing).and_then(|l| Ok((l, probe(rt, t, timing)?)));
    stop.store(true, Relaxed);
    let recs = streamer()?;
    let (loaded, paced_loaded) = loaded?;
    let alone = stream_stats(&recs, alone_from, alone_to);
    let window = |st: &Stats| st.window.unwrap_or((alone_to, Instant::now()));
    let (from, to) = window(&loaded);
    let during = stream_stats(&recs, from, to);
    let (from, to) = window(&paced_loaded);
    let during_paced = stream_stats(&recs, from, to);
    Ok(Hol {
        idle,
        loaded,
        paced_idle,
        paced_loaded,
        alone,
        during,
        during_paced,
    })
}

fn write_csv(path: &std::path::Path, rows: &[Row]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        f,
        "case,transport,impl,args,inflight,calls,calls_per_s,p50_us,p99_us,max_us,fairness"
    )?;
    for r in rows {
        writeln!(
            f,
            "{},{},{},{},{},{},{:.1},{:.2},{:.2},{:.0},{:.3}",
            r.case,
            r.transport,
            r.name,
            r.args,
            r.inflight,
            r.st.calls,
            r.st.rate,
            r.st.p50,
            r.st.p99,
            r.st.max,
            r.st.fairness
        )?;
    }
    f.flush()
}

fn human_size(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

fn rate(r: f64) -> String {
    if r >= 1e6 {
        format!("{:.2}M", r / 1e6)
    } else if r >= 1e4 {
        format!("{:.0}k", r / 1e3)
    } else if r >= 1e3 {
        format!("{:.1}k", r / 1e3)
    } else {
        format!("{r:.0}")
    }
}

fn us(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn find<'a>(
    rows: &'a [Row],
    case: &str,
    transport: &str,
    name: &str,
    args: usize,
    inflight: usize,
) -> Option<&'a Row> {
    rows.iter().find(|r| {
        r.case == case
            && r.transport == transport
            && r.name == name
            && r.args == args
            && r.inflight == inflight
    })
}

/// The better tonic transport at a point (more calls/s).
fn tonic_ref(rows: &[Row], args: usize, inflight: usize) -> Option<&Row> {
    ["tcp", "uds"]
        .iter()
        .filter_map(|t| find(rows, "sweep", t, "tonic", args, inflight))
        .max_by(|a, b| a.st.rate.total_cmp(&b.st.rate))
}

/// The mad-am columns (the first [`AM_COLUMNS`]), then tonic's.
const COLUMNS: [(&str, &str); 8] = [
    ("shm", "mad-am inline"),
    ("shm", "mad-am loop"),
    ("shm", "mad-am pool"),
    ("tcp", "mad-am inline"),
    ("tcp", "mad-am loop"),
    ("tcp", "mad-am pool"),
    ("tcp", "tonic"),
    ("uds", "tonic"),
];

const AM_COLUMNS: usize = 6;

/// Targets of issue 17 at 8 B, 16 in flight: (transport, min calls/s ratio, max p99 ratio).
const TARGETS: [(&str, f64, f64); 2] = [("shm", 5.0, 0.2), ("tcp", 1.5, 0.7)];

fn report(
    out: &mut impl Write,
    o: &Opts,
    rows: &[Row],
    layer: &[(&str, f64, f64)],
    hol: &[(&str, &str, Hol)],
    took: Duration,
) -> std::io::Result<()> {
    writeln!(out, "### RPC: calls/s (p50 / p99 µs)")?;
    writeln!(out)?;
    writeln!(
        out,
        "Window {:?} per point after {:?} of warm-up{}; {} s in all. mad-am inline and pool: N in \
         flight = N client threads calling in a loop (blocking calls; {}); mad-am loop: one client \
         thread keeps N `call_async` calls in flight in `Endpoint::block_on` (it polls itself: no \
         hand-off per reply), inline handler; tonic: N tasks on one connection.",
        o.timing.window,
        o.timing.warmup,
        if o.quick {
            " (--quick: smoke figures, do not quote)"
        } else {
            ""
        },
        took.as_secs(),
        if o.client_progress {
            "the client has a progress thread per endpoint"
        } else {
            "they poll for each other, no progress thread on the client"
        }
    )?;
    writeln!(out)?;
    write!(out, "| args | in flight |")?;
    for (t, n) in COLUMNS {
        write!(out, " {t} {n} |")?;
    }
    writeln!(out)?;
    writeln!(out, "|---:|---:|{}", "---:|".repeat(COLUMNS.len()))?;
    for &args in &o.sizes {
        for &inflight in &o.inflight {
            write!(out, "| {} | {inflight} |", human_size(args))?;
            for (t, n) in COLUMNS {
                match find(rows, "sweep", t, n, args, inflight) {
                    Some(r) => write!(
                        out,
                        " {} ({} / {}) |",
                        rate(r.st.rate),
                        us(r.st.p50),
                        us(r.st.p99)
                    )?,
                    None => write!(out, " - |")?,
                }
            }
            writeln!(out)?;
        }
    }
    writeln!(out)?;
    writeln!(
        out,
        "### Against tonic (the better of its TCP and UDS runs at each point)"
    )?;
    writeln!(out)?;
    writeln!(out, "calls/s ratio × / p99 ratio × (mad-am ÷ tonic).")?;
    writeln!(out)?;
    write!(out, "| args | in flight | tonic ref |")?;
    for (t, n) in &COLUMNS[..AM_COLUMNS] {
        write!(out, " {t} {} |", n.trim_start_matches("mad-am "))?;
    }
    writeln!(out)?;
    writeln!(out, "|---:|---:|---|{}", "---:|".repeat(AM_COLUMNS))?;
    for &args in &o.sizes {
        for &inflight in &o.inflight {
            let Some(tr) = tonic_ref(rows, args, inflight) else {
                continue;
            };
            write!(
                out,
                "| {} | {inflight} | {} |",
                human_size(args),
                tr.transport
            )?;
            for (t, n) in &COLUMNS[..AM_COLUMNS] {
                match find(rows, "sweep", t, n, args, inflight) {
                    Some(r) => write!(
                        out,
                        " {:.2} / {:.2} |",
                        r.st.rate / tr.st.rate,
                        r.st.p99 / tr.st.p99
                    )?,
                    None => write!(out, " - |")?,
                }
            }
            writeln!(out)?;
        }
    }
    writeln!(out)?;
    if let Some(tr) = tonic_ref(rows, 8, 16) {
        writeln!(out, "### Targets (issue 17): 8 B, 16 in flight, against tonic over {} ({} calls/s, p99 {} µs)", tr.transport, rate(tr.st.rate), us(tr.st.p99))?;
        writeln!(out)?;
        writeln!(
            out,
            "| mad-am | calls/s | × tonic | target | p99 µs | × tonic | target | verdict |"
        )?;
        writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---|")?;
        for (t, min_rate, max_p99) in TARGETS {
            for n in ["mad-am inline", "mad-am loop", "mad-am pool"] {
                let Some(r) = find(rows, "sweep", t, n, 8, 16) else {
                    continue;
                };
                let (x, y) = (r.st.rate / tr.st.rate, r.st.p99 / tr.st.p99);
                let ok = x >= min_rate && y <= max_p99;
                writeln!(
                    out,
                    "| {t} {} | {} | {x:.2} | ≥ {min_rate} | {} | {y:.2} | ≤ {max_p99} | {} |",
                    n.trim_start_matches("mad-am "),
                    rate(r.st.rate),
                    us(r.st.p99),
                    if ok { "met" } else { "missed" }
                )?;
            }
        }
        writeln!(out)?;
    }
    if !layer.is_empty() {
        writeln!(
            out,
            "### The layer's cost: an inline handler's round trip against the raw `rpc` pattern (issue 17: ≤ 1.2×)"
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "8 B request, empty reply, 1 in flight: mad-am's `call` to an inline handler against \
             mad-bench's `rpc` pattern (size header EXPRESS, body CHEAPER, `flush_at_end`) on a \
             channel of the same spec; {} rounds of {} round trips each, alternated, medians.",
            if o.quick { 2 } else { LAYER_ROUNDS },
            if o.quick { 500 } else { LAYER_CALLS }
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "| transport | raw rpc µs | mad-am inline µs | ratio | verdict |"
        )?;
        writeln!(out, "|---|---:|---:|---:|---|")?;
        for &(t, r, a) in layer {
            let x = a / r;
            writeln!(
                out,
                "| {t} | {r:.2} | {a:.2} | {x:.2} | {} |",
                if x <= 1.2 { "met" } else { "missed" }
            )?;
        }
        writeln!(out)?;
    }
    if !hol.is_empty() {
        writeln!(
            out,
            "### Head-of-line: 8 B calls from one thread while another streams {} requests (same process, same server, same connection)",
            human_size(o.hol_size)
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "| transport | impl | back-to-back: idle p50 / p99 µs | with the stream p50 / p99 µs | p99 ratio | stream MB/s meanwhile | paced: idle p99 µs | with the stream p99 µs | p99 ratio | stream MB/s meanwhile | stream MB/s alone | verdict (≤ 3×) |"
        )?;
        writeln!(
            out,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        )?;
        for (t, n, h) in hol {
            let ratio = h.loaded.p99 / h.idle.p99;
            let paced = h.paced_loaded.p99 / h.paced_idle.p99;
            // Every probe whose stream flowed must be within; at least one must have.
            let judged: Vec<bool> = [
                hol_verdict(ratio, &h.during, &h.alone),
                hol_verdict(paced, &h.during_paced, &h.alone),
            ]
            .into_iter()
            .flatten()
            .collect();
            let within = judged.iter().all(|&ok| ok);
            let which = match judged.len() {
                0 => "",
                1 if hol_verdict(ratio, &h.during, &h.alone).is_some() => {
                    " (back-to-back; the paced probe's stream was starved)"
                }
                1 => " (paced; the back-to-back probe starved the stream)",
                _ => " (both probes)",
            };
            let verdict = if judged.is_empty() {
                "no verdict: the stream was starved".to_string()
            } else if n.starts_with("tonic") {
                format!(
                    "(reference: {}){which}",
                    if within { "within" } else { "over" }
                )
            } else {
                format!("{}{which}", if within { "met" } else { "missed" })
            };
            let mb = |st: &Stats| st.rate * o.hol_size as f64 / 1e6;
            writeln!(
                out,
                "| {t} | {n} | {} / {} | {} / {} | {ratio:.1}× | {:.0} | {} | {} | {paced:.1}× | {:.0} | {:.0} | {verdict} |",
                us(h.idle.p50),
                us(h.idle.p99),
                us(h.loaded.p50),
                us(h.loaded.p99),
                mb(&h.during),
                us(h.paced_idle.p99),
                us(h.paced_loaded.p99),
                mb(&h.during_paced),
                mb(&h.alone),
            )?;
        }
        writeln!(out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options() {
        let o = parse_args(&args(&[
            "--quick",
            "--sizes",
            "8,4k",
            "--inflight=1,2",
            "--csv",
            "x.csv",
        ]))
        .expect("parses")
        .expect("not help");
        assert!(o.quick);
        assert_eq!(o.sizes, [8, 4096]);
        assert_eq!(o.inflight, [1, 2]);
        assert_eq!(o.timing.window, Duration::from_millis(100));
        assert_eq!(o.csv.as_deref(), Some(std::path::Path::new("x.csv")));
        assert!(parse_args(&args(&["--help"])).expect("parses").is_none());
    }

    #[test]
    fn bad_options_are_errors() {
        for bad in [
            &["--sizes"][..],
            &["--sizes", "8,x"],
            &["--inflight", "0"],
            &["--duration", "-1"],
            &["--duration", "nan"],
            &["--frobnicate"],
            &["--shm", ""],
            &["--hol-size", "2g"],
            &["--sizes", "64m"],
            &["--impls", "shm,tcp"],
        ] {
            assert!(parse_args(&args(bad)).is_err(), "{bad:?}");
        }
    }
}
