//! A small RPC runtime: the paper's motivating case (section 2), a remote call whose arguments
//! are arrays of sizes the server learns from the request itself.
//!
//! ```text
//! cargo run --release --example rpc                          # 3 processes: server + 2 clients, tcp
//! cargo run --release --example rpc -- --channel shm         # the same over shared memory
//! madrun -n 5 target/release/examples/rpc -- --clients 2 --threads 4
//! ```
//!
//! Rank 0 is the server, every other rank a client process running `--clients` threads (default
//! 4) that call at once. A request is a [`RequestHeader`] packed EXPRESS (service id, call id,
//! argument sizes) followed by the arguments packed CHEAPER. The server's dispatcher thread
//! unpacks the header, lets the runtime pick the service and a worker thread and the service
//! size-check the arguments and allocate their memory, then unpacks the arguments straight
//! into that memory; the worker runs the service and packs the reply ([`ReplyHeader`]
//! EXPRESS, result CHEAPER). A connection carries one message at a time per direction, so the
//! dispatcher receives whole requests and replies to one client rank serialize on its
//! connection. Each client process demultiplexes replies to its threads by call id.
//!
//! Unknown services, argument lists a service refuses and malformed headers get error replies;
//! the server keeps serving. Options: `--channel NAME|SPEC` (a channel name, or a spec such as
//! `shm` or `tcp,progress=block`; default `default`), `--clients N` (threads per client
//! process), `--threads N` (server worker threads, default 2), `--calls N` (calls per client
//! thread with 8 B arguments, default 2000; a twentieth of it with 1 MiB ones), `--quick`
//! (100 calls, for CI), `--hostile` (the last client finally sends a request whose header lies
//! about its arguments: the server finds at that very message that it holds more pieces than
//! it unpacked, so that client's connection is finished in both directions, its pending call
//! fails at once, and the server keeps serving the others).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use madeleine::bytemuck::{Pod, Zeroable};
use madeleine::{Channel, ChannelConfig, Error, RecvMode, Result, SendMode, Session};

/// Most arguments in one request.
const MAX_ARGS: usize = 4;
/// Largest total argument size the server accepts (the runtime's own limit).
const MAX_TOTAL: u64 = 64 << 20;
/// Header magic ("RPC1").
const MAGIC: u32 = 0x3143_5052;
/// How long a client waits for a reply.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Service ids.
const SVC_BYE: u32 = 0;
const SVC_SUM: u32 = 1;
const SVC_ECHO: u32 = 2;

/// The request header, unpacked EXPRESS by the server.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[bytemuck(crate = "madeleine::bytemuck")]
struct RequestHeader {
    magic: u32,
    service: u32,
    call: u64,
    nargs: u32,
    _pad: u32,
    arg_len: [u64; MAX_ARGS],
}

/// Reply status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
enum Status {
    Ok = 0,
    UnknownService = 1,
    BadArguments = 2,
    Malformed = 3,
    Failed = 4,
}

impl Status {
    fn from_u32(v: u32) -> Option<Self> {
        [
            Status::Ok,
            Status::UnknownService,
            Status::BadArguments,
            Status::Malformed,
            Status::Failed,
        ]
        .into_iter()
        .find(|s| *s as u32 == v)
    }
}

/// The reply header, unpacked EXPRESS by the client (the payload length sizes its buffer).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[bytemuck(crate = "madeleine::bytemuck")]
struct ReplyHeader {
    call: u64,
    status: u32,
    _pad: u32,
    len: u64,
}

/// A service's body: the arguments in, the result (or why it failed) out.
type ServiceFn = fn(&[Vec<u8>]) -> std::result::Result<Vec<u8>, String>;

/// A registered service: how it checks its arguments and what it computes.
struct Service {
    name: &'static str,
    /// Accepted argument counts and largest single argument.
    args: std::ops::RangeInclusive<usize>,
    max_arg: u64,
    run: ServiceFn,
}

impl Service {
    /// The service's look at the header: refuse, or allocate the argument memory.
    fn allocate(&self, h: &RequestHeader) -> std::result::Result<Vec<Vec<u8>>, String> {
        let n = h.nargs as usize;
        if !self.args.contains(&n) {
            return Err(format!(
                "{} takes {:?} arguments, got {n}",
                self.name, self.args
            ));
        }
        let lens = &h.arg_len[..n];
        if let Some(l) = lens.iter().find(|&&l| l > self.max_arg) {
            return Err(format!(
                "{}: argument of {l} B over its {} B limit",
                self.name, self.max_arg
            ));
        }
        Ok(lens.iter().map(|&l| vec![0u8; l as usize]).collect())
    }
}

fn services() -> HashMap<u32, Service> {
    let mut m = HashMap::new();
    m.insert(
        SVC_SUM,
        Service {
            name: "sum",
            args: 1..=MAX_ARGS,
            max_arg: 16 << 20,
            run: |args| {
                let mut s = 0u64;
                let mut n = 0u64;
                for a in args {
                    s = a.iter().fold(s, |s, &b| s.wrapping_add(b as u64));
                    n += a.len() as u64;
                }
                let mut out = s.to_le_bytes().to_vec();
                out.extend_from_slice(&n.to_le_bytes());
                Ok(out)
            },
        },
    );
    m.insert(
        SVC_ECHO,
        Service {
            name: "echo",
            args: 1..=1,
            max_arg: 16 << 20,
            run: |args| Ok(args[0].clone()),
        },
    );
    m
}

struct Opts {
    channel: String,
    clients: usize,
    threads: usize,
    calls: usize,
    hostile: bool,
}

fn opts() -> Result<Opts> {
    let mut o = Opts {
        channel: "default".into(),
        clients: 4,
        threads: 2,
        calls: 2000,
        hostile: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |what: &str| {
            args.next()
                .ok_or_else(|| Error::BadConfig(format!("{a} needs {what}")))
        };
        let mut num = |what: &str| -> Result<usize> {
            let v = val(what)?;
            v.parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Error::BadConfig(format!("{a} {v}: not a positive number")))
        };
        match a.as_str() {
            "--" => {}
            "--channel" => o.channel = val("a channel name or spec")?,
            "--clients" => o.clients = num("a number of threads")?,
            "--threads" => o.threads = num("a number of threads")?,
            "--calls" => o.calls = num("a number of calls")?,
            "--quick" => o.calls = 100,
            "--hostile" => o.hostile = true,
            _ => {
                return Err(Error::BadConfig(format!(
                    "unknown option `{a}` (see the example's documentation)"
                )))
            }
        }
    }
    Ok(o)
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
    let o = opts()?;
    if let Some(code) = madeleine::run_local_if_alone(3)? {
        std::process::exit(code);
    }
    let session = madeleine::session()?;
    if session.size() < 2 {
        return Err(Error::BadConfig("rpc needs a server and a client".into()));
    }
    let ch = open(&session, &o.channel)?;
    if session.rank() == 0 {
        server(&ch, &o)
    } else {
        client(&ch, &o)
    }
}

// ---------------------------------------------------------------------------------------------
// Server

/// A request fully received by the dispatcher, handed to a worker.
struct Job {
    client: usize,
    call: u64,
    service: u32,
    args: Vec<Vec<u8>>,
}

fn reply(ch: &Channel, to: usize, call: u64, status: Status, payload: &[u8]) -> Result<()> {
    let h = ReplyHeader {
        call,
        status: status as u32,
        _pad: 0,
        len: payload.len() as u64,
    };
    let mut p = ch.begin_packing(to)?;
    p.pack_value(&h, RecvMode::Express)?;
    if !payload.is_empty() {
        p.pack(payload, RecvMode::Cheaper)?;
    }
    p.end_packing()
}

/// What the dispatcher made of one incoming message.
enum Received {
    Job(Job),
    Bye { client: usize, call: u64 },
    Refused,
}

/// Receive one request: header EXPRESS, checks, allocation by the service, arguments CHEAPER.
fn receive(ch: &Channel, services: &HashMap<u32, Service>) -> Result<Received> {
    let mut u = ch.begin_unpacking()?;
    let client = u.remote();
    let h: RequestHeader = u.unpack_value()?;
    let refuse = |u: madeleine::Unpacker<'_, '_>, status: Status, why: String| {
        // The arguments the header announces cannot be trusted or are not wanted: the message
        // must end here. A well-formed sender sent nothing more (see `Client::call_raw`); if it
        // did, end_unpacking reports it, that client's connection is finished (both ways: the
        // error reply cannot reach it), and the dispatcher drops it.
        let r = u.end_unpacking();
        eprintln!("rpc server: call {} from rank {client}: {why}", h.call);
        if let Err(e) = reply(ch, client, h.call, status, why.as_bytes()) {
            eprintln!("rpc server: error reply to rank {client}: {e}");
        }
        r.map(|()| Received::Refused)
    };
    if h.magic != MAGIC || h.nargs as usize > MAX_ARGS {
        return refuse(u, Status::Malformed, "malformed request header".into());
    }
    let lens = &h.arg_len[..h.nargs as usize];
    if lens
        .iter()
        .try_fold(0u64, |s, &l| s.checked_add(l))
        .map_or(true, |t| t > MAX_TOTAL)
    {
        return refuse(
            u,
            Status::Malformed,
            format!("arguments over {MAX_TOTAL} B"),
        );
    }
    if h.service == SVC_BYE {
        u.end_unpacking()?;
        return Ok(Received::Bye {
            client,
            call: h.call,
        });
    }
    // The header was well-formed: the arguments are in the message. A service that refuses
    // them still has them unpacked (into scratch memory) so the connection stays in step.
    let (mut args, refusal) = match services.get(&h.service) {
        None => (
            None,
            Some((Status::UnknownService, format!("no service {}", h.service))),
        ),
        Some(s) => match s.allocate(&h) {
            Ok(a) => (Some(a), None),
            Err(why) => (None, Some((Status::BadArguments, why))),
        },
    };
    let mut scratch: Vec<Vec<u8>>;
    let dst = match &mut args {
        Some(a) => a,
        None => {
            scratch = lens.iter().map(|&l| vec![0u8; l as usize]).collect();
            &mut scratch
        }
    };
    for a in dst.iter_mut() {
        u.unpack(a, SendMode::Cheaper)?; // straight into the service's memory
    }
    u.end_unpacking()?;
    match (args, refusal) {
        (Some(args), None) => Ok(Received::Job(Job {
            client,
            call: h.call,
            service: h.service,
            args,
        })),
        (_, Some((status, why))) => {
            eprintln!("rpc server: call {} from rank {client}: {why}", h.call);
            reply(ch, client, h.call, status, why.as_bytes())?;
            Ok(Received::Refused)
        }
        (None, None) => Ok(Received::Refused),
    }
}

/// The client an error is about, if it is about one.
fn failed_rank(e: &Error) -> Option<usize> {
    match e {
        Error::PeerClosed { rank }
        | Error::ConnectionLost { rank, .. }
        | Error::Protocol { rank, .. }
        | Error::UnpackMismatch { rank, .. } => Some(*rank),
        _ => None,
    }
}

fn server(ch: &Channel, o: &Opts) -> Result<()> {
    let services = Arc::new(services());
    let clients = ch.size() - 1;
    let served = AtomicU64::new(0);
    let mut refused = 0u64;
    let start = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let mut workers = Vec::new();
        let mut queues = Vec::new();
        for _ in 0..o.threads {
            let (tx, rx) = mpsc::channel::<Job>();
            queues.push(tx);
            let services = services.clone();
            let served = &served;
            workers.push(s.spawn(move || -> Result<()> {
                for job in rx {
                    let svc = &services[&job.service];
                    let (status, out) = match (svc.run)(&job.args) {
                        Ok(out) => (Status::Ok, out),
                        Err(why) => (Status::Failed, why.into_bytes()),
                    };
                    // A client that went away must not stop the server.
                    match reply(ch, job.client, job.call, status, &out) {
                        Ok(()) => {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => eprintln!("rpc server: reply to rank {}: {e}", job.client),
                    }
                }
                Ok(())
            }));
        }
        // Clients that said goodbye or whose connection failed.
        let mut done = std::collections::HashSet::new();
        let mut next = 0usize;
        while done.len() < clients {
            match receive(ch, &services) {
                Ok(Received::Job(job)) => {
                    // Round-robin over the workers; a client's calls may run in parallel.
                    next = (next + 1) % queues.len();
                    queues[next]
                        .send(job)
                        .map_err(|_| Error::BadConfig("a worker thread stopped".into()))?;
                }
                Ok(Received::Bye { client, call }) => {
                    done.insert(client);
                    if let Err(e) = reply(ch, client, call, Status::Ok, &[]) {
                        eprintln!("rpc server: goodbye to rank {client}: {e}");
                    }
                }
                Ok(Received::Refused) => refused += 1,
                // From an any-source receive: no client is left.
                Err(Error::Poisoned { .. }) => break,
                // One client's failure (it died, or sent bytes that do not follow the
                // protocol): its connection is closed, the others keep being served.
                Err(e) => match failed_rank(&e) {
                    Some(r) => {
                        eprintln!("rpc server: dropping rank {r}: {e}");
                        done.insert(r);
                    }
                    None => return Err(e),
                },
            }
        }
        drop(queues);
        for w in workers {
            w.join()
                .map_err(|_| Error::BadConfig("a worker thread panicked".into()))??;
        }
        Ok(())
    })?;
    let t = start.elapsed().as_secs_f64();
    println!(
        "rank 0 (server, {} workers, `{}`): {} calls served, {} refused, {:.1} s",
        o.threads,
        ch.config().driver,
        served.load(Ordering::Relaxed),
        refused,
        t
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Client

/// A reply delivered to the calling thread.
struct Reply {
    status: Status,
    data: Vec<u8>,
}

/// The client side of the runtime: call ids, and a thread that hands replies to their callers.
struct Client<'c> {
    ch: &'c Channel,
    next: AtomicU64,
    pending: Mutex<HashMap<u64, mpsc::Sender<Reply>>>,
}

impl Client<'_> {
    fn call(&self, service: u32, args: &[&[u8]]) -> Result<Reply> {
        let mut h = RequestHeader::zeroed();
        h.magic = MAGIC;
        h.service = service;
        h.nargs = args.len() as u32;
        for (l, a) in h.arg_len.iter_mut().zip(args) {
            *l = a.len() as u64;
        }
        self.call_raw(h, args)
    }

    /// Send `h` followed by `args` as given (the header is not checked: tests malformed ones).
    fn call_raw(&self, mut h: RequestHeader, args: &[&[u8]]) -> Result<Reply> {
        h.call = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.pending
            .lock()
            .map_err(|_| Error::BadConfig("client state poisoned".into()))?
            .insert(h.call, tx);
        let mut p = self.ch.begin_packing(0)?;
        p.pack_value(&h, RecvMode::Express)?; // the server needs it to size what follows
        for a in args.iter().take(MAX_ARGS) {
            p.pack(a, RecvMode::Cheaper)?; // lands in the service's memory
        }
        p.end_packing()?;
        rx.recv_timeout(REPLY_TIMEOUT).map_err(|e| match e {
            // The demultiplexer stopped (the connection to the server failed): fail now.
            mpsc::RecvTimeoutError::Disconnected => Error::PeerClosed { rank: 0 },
            mpsc::RecvTimeoutError::Timeout => Error::Timeout(REPLY_TIMEOUT),
        })
    }

    /// Receive replies until the answer to `bye` arrives; hand each to its caller. If the
    /// connection fails, every pending call fails at once (its reply can no longer come).
    fn demultiplex(&self, bye: u64) -> Result<()> {
        let r = self.receive_replies(bye);
        if r.is_err() {
            if let Ok(mut p) = self.pending.lock() {
                p.clear();
            }
        }
        r
    }

    fn receive_replies(&self, bye: u64) -> Result<()> {
        loop {
            let mut u = self.ch.begin_unpacking_from(0)?;
            let h: ReplyHeader = u.unpack_value()?;
            if h.len > MAX_TOTAL {
                return Err(Error::protocol(0, format!("reply of {} B", h.len)));
            }
            let mut data = vec![0u8; h.len as usize];
            if h.len > 0 {
                u.unpack(&mut data, SendMode::Cheaper)?;
            }
            u.end_unpacking()?;
            if h.call == bye {
                return Ok(());
            }
            let status = Status::from_u32(h.status)
                .ok_or_else(|| Error::protocol(0, format!("reply status {}", h.status)))?;
            let waiter = self
                .pending
                .lock()
                .map_err(|_| Error::BadConfig("client state poisoned".into()))?
                .remove(&h.call)
                .ok_or_else(|| Error::protocol(0, format!("reply to unknown call {}", h.call)))?;
            let _ = waiter.send(Reply { status, data });
        }
    }
}

fn expect(r: &Reply, status: Status, what: &str) -> Result<()> {
    if r.status == status {
        Ok(())
    } else {
        Err(Error::protocol(
            0,
            format!(
                "{what}: expected {status:?}, got {:?} ({})",
                r.status,
                String::from_utf8_lossy(&r.data)
            ),
        ))
    }
}

/// Error replies and the echo service, checked once per client process.
fn check_errors(c: &Client<'_>) -> Result<()> {
    expect(
        &c.call(99, &[b"x"])?,
        Status::UnknownService,
        "unknown service",
    )?;
    expect(
        &c.call(SVC_ECHO, &[b"a", b"b"])?,
        Status::BadArguments,
        "echo with two arguments",
    )?;
    let mut h = RequestHeader::zeroed();
    h.magic = MAGIC;
    h.service = SVC_SUM;
    h.nargs = 1000; // malformed: more than MAX_ARGS
    expect(&c.call_raw(h, &[])?, Status::Malformed, "1000 arguments")?;
    h.nargs = 1;
    h.arg_len[0] = u64::MAX; // malformed: over the runtime's limit
    expect(&c.call_raw(h, &[])?, Status::Malformed, "huge argument")?;
    let msg: Vec<u8> = (0..3000u32).map(|i| (i % 253) as u8).collect();
    let r = c.call(SVC_ECHO, &[&msg])?;
    expect(&r, Status::Ok, "echo")?;
    if r.data != msg {
        return Err(Error::protocol(0, "echo returned different bytes"));
    }
    Ok(())
}

/// One client thread's run of `calls` calls of `sum` with a `size`-byte argument.
fn bench_thread(c: &Client<'_>, t: usize, size: usize, calls: usize) -> Result<Vec<Duration>> {
    let arg: Vec<u8> = (0..size).map(|i| (i * 7 + t) as u8).collect();
    let want: u64 = arg.iter().map(|&b| b as u64).sum();
    let mut lat = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t0 = Instant::now();
        let r = c.call(SVC_SUM, &[&arg])?;
        lat.push(t0.elapsed());
        expect(&r, Status::Ok, "sum")?;
        let got = r.data.get(..8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        });
        if got != Some(want) {
            return Err(Error::protocol(0, format!("sum: {got:?}, expected {want}")));
        }
    }
    Ok(lat)
}

fn client(ch: &Channel, o: &Opts) -> Result<()> {
    let c = Client {
        ch,
        next: AtomicU64::new(1),
        pending: Mutex::new(HashMap::new()),
    };
    let bye_call = u64::MAX;
    let hostile = o.hostile && ch.rank() == ch.size() - 1;
    // Set when the server closed this client's connection after its lying request.
    let mut dropped = false;
    let phases = [(8usize, o.calls), (1 << 20, (o.calls / 20).max(5))];
    let mut lines = Vec::new();
    std::thread::scope(|s| -> Result<()> {
        let demux = s.spawn(|| c.demultiplex(bye_call));
        let work = (|| -> Result<()> {
            check_errors(&c)?;
            for &(size, calls) in &phases {
                let barrier = Barrier::new(o.clients);
                let t0 = Instant::now();
                let mut lat = Vec::new();
                std::thread::scope(|s| -> Result<()> {
                    let hs: Vec<_> = (0..o.clients)
                        .map(|t| {
                            let (c, barrier) = (&c, &barrier);
                            s.spawn(move || {
                                barrier.wait();
                                bench_thread(c, t, size, calls)
                            })
                        })
                        .collect();
                    for h in hs {
                        lat.extend(
                            h.join().map_err(|_| {
                                Error::BadConfig("a client thread panicked".into())
                            })??,
                        );
                    }
                    Ok(())
                })?;
                let wall = t0.elapsed().as_secs_f64();
                lat.sort();
                let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
                lines.push(format!(
                    "rank {} ({} threads, `{}`): {:>7} B args: {:>8.0} calls/s, latency median {:>8.1} µs, p99 {:>8.1} µs ({} calls)",
                    ch.rank(),
                    o.clients,
                    ch.config().driver,
                    size,
                    lat.len() as f64 / wall,
                    pct(0.5),
                    pct(0.99),
                    lat.len()
                ));
            }
            if hostile {
                let mut h = RequestHeader::zeroed();
                h.magic = MAGIC;
                h.service = SVC_SUM;
                h.nargs = 1000; // a lie: one argument follows
                match c.call_raw(h, &[&[1u8; 100]]) {
                    // The server finished this connection at that message: expected.
                    Err(e) if e.is_peer_failure() || matches!(e, Error::Poisoned { .. }) => {
                        lines.push(format!(
                            "rank {}: hostile request refused, connection closed by the server ({e})",
                            ch.rank()
                        ));
                        dropped = true;
                    }
                    r => expect(&r?, Status::Malformed, "lying header")?,
                }
            }
            Ok(())
        })();
        // Always say goodbye so the server and the demultiplexer stop, even after a failure.
        let mut h = RequestHeader::zeroed();
        h.magic = MAGIC;
        h.service = SVC_BYE;
        h.call = bye_call;
        let bye = (|| {
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&h, RecvMode::Express)?;
            p.end_packing()
        })();
        let d = demux
            .join()
            .map_err(|_| Error::BadConfig("the demultiplexer panicked".into()))?;
        // The server dropped this client after its lying request: the goodbye and the
        // demultiplexer fail, as expected.
        let gone = |e: &Error| e.is_peer_failure() || matches!(e, Error::Poisoned { .. });
        let (bye, d) = if dropped {
            (
                bye.or_else(|e| if gone(&e) { Ok(()) } else { Err(e) }),
                d.or_else(|e| if gone(&e) { Ok(()) } else { Err(e) }),
            )
        } else {
            (bye, d)
        };
        work.and(bye).and(d)
    })?;
    for l in lines {
        println!("{l}");
    }
    Ok(())
}
