//! Side-by-side: raw TCP ping-pong / streaming versus Madeleine over the tcp driver, in the
//! same progress mode, in one run (two threads, real loopback sockets).
//!
//! ```text
//! cargo run --release -p mad-tcp --example tcp_vs_raw -- [--mode poll|block] [--reps 5]
//!           [--iters 20000] [--sweep]
//! ```
//!
//! `poll`: raw side uses non-blocking `recv`/`send` in a busy loop, Madeleine `progress=poll`.
//! `block`: raw side uses blocking reads/writes, Madeleine `progress=block`.
//! `--sweep` also times one-piece ping-pongs of 256 B..64 KiB with every piece through the
//! copy TM (`tm.small=max`) and through the gather TM (`tm.small=0`): the threshold sweep.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Instant;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::cli::{self, Arg, Cli};

const CLI: Cli = Cli::new(
    "tcp_vs_raw",
    env!("CARGO_PKG_VERSION"),
    "usage: tcp_vs_raw [--mode poll|block] [--reps N] [--iters N] [--sweep] [--only WHAT]
       madrun -n 2 tcp_vs_raw --proc [--mode M] [--reps N]

Raw TCP ping-pong / streaming against Madeleine over the tcp driver, same progress mode.

  --mode poll|block  busy-polling or blocking on both sides (default poll)
  --reps N           repetitions, best kept (default 5)
  --iters N          round trips per repetition (default 20000)
  --sweep            also the copy/gather threshold sweep (256 B..64 KiB)
  --only WHAT        run only the measurement named WHAT
  --proc             across two processes (under madrun -n 2)
  -h, --help         this text
  -V, --version      the version",
);
use mad_core::{Channel, ChannelConfig, RecvMode, SendMode, Session};
use mad_tcp::TcpDriver;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Poll,
    Block,
}

struct Args {
    mode: Mode,
    reps: usize,
    iters: usize,
    sweep: bool,
    /// `raw`, `mad` or both (empty): for profiling one side.
    only: String,
    /// Cross-process run under madrun.
    proc: bool,
}

fn args() -> Args {
    let mut a = Args {
        mode: Mode::Poll,
        reps: 5,
        iters: 20_000,
        sweep: false,
        only: String::new(),
        proc: false,
    };
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("mode") => {
                    a.mode = cli::value_with(p, "--mode", "poll or block", |v| match v {
                        "poll" => Some(Mode::Poll),
                        "block" => Some(Mode::Block),
                        _ => None,
                    })?
                }
                Arg::Long("reps") => a.reps = cli::positive(p, "--reps")?,
                Arg::Long("iters") => a.iters = cli::positive(p, "--iters")?,
                Arg::Long("sweep") => a.sweep = true,
                Arg::Long("proc") => a.proc = true,
                Arg::Long("only") => a.only = cli::string(p)?,
                other => CLI.other(other)?,
            }
        }
        Ok(())
    });
    a
}

// ---------- raw TCP ----------

fn raw_pair(mode: Mode) -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    for s in [&a, &b] {
        s.set_nodelay(true).unwrap();
        s.set_nonblocking(mode == Mode::Poll).unwrap();
    }
    (a, b)
}

fn read_full(s: &mut TcpStream, mut buf: &mut [u8]) {
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => panic!("raw peer closed"),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => panic!("raw read: {e}"),
        }
    }
}

fn write_full(s: &mut TcpStream, mut buf: &[u8]) {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => panic!("raw write: {e}"),
        }
    }
}

/// One-way latency (µs) of `iters` ping-pongs of `size` bytes.
fn raw_pingpong(mode: Mode, size: usize, iters: usize) -> f64 {
    let (mut a, mut b) = raw_pair(mode);
    let t = thread::spawn(move || {
        let mut buf = vec![0u8; size];
        for _ in 0..iters + 100 {
            read_full(&mut b, &mut buf);
            write_full(&mut b, &buf);
        }
    });
    let mut buf = vec![1u8; size];
    let mut start = Instant::now();
    for i in 0..iters + 100 {
        if i == 100 {
            start = Instant::now();
        }
        write_full(&mut a, &buf);
        read_full(&mut a, &mut buf);
    }
    let el = start.elapsed();
    t.join().unwrap();
    el.as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

/// Streaming bandwidth (GB/s) of `count` blocks of `size` bytes, then a 1-byte ack.
fn raw_stream(mode: Mode, size: usize, count: usize) -> f64 {
    let (mut a, mut b) = raw_pair(mode);
    let t = thread::spawn(move || {
        let mut buf = vec![0u8; size];
        for _ in 0..count + 2 {
            read_full(&mut b, &mut buf);
        }
        write_full(&mut b, &[1]);
    });
    let buf = vec![1u8; size];
    write_full(&mut a, &buf);
    write_full(&mut a, &buf);
    let start = Instant::now();
    for _ in 0..count {
        write_full(&mut a, &buf);
    }
    read_full(&mut a, &mut [0u8; 1]);
    let el = start.elapsed();
    t.join().unwrap();
    (size * count) as f64 / el.as_secs_f64() / 1e9
}

// ---------- processes under madrun ----------

/// Cross-process variant: `madrun -n 2 tcp_vs_raw --proc [--mode M] [--reps R]`. Raw TCP
/// endpoints are exchanged through the bootstrap; rank 0 times and prints.
fn proc_main(a: &Args) {
    let b = mad_core::launch::MadrunBootstrap::from_env()
        .expect("madrun bootstrap")
        .expect("--proc needs madrun (MAD_BOOTSTRAP unset)");
    let s = Session::builder()
        .driver(TcpDriver::new())
        .bootstrap(Box::new(b))
        .build()
        .unwrap();
    let me = s.rank();
    let ch = s
        .open_channel_with(ChannelConfig::parse("bench", &spec(a.mode, "")).unwrap())
        .unwrap();
    // Raw connection: rank 0 listens, rank 1 connects.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let all = s
        .bootstrap()
        .allgather("raw-addr", l.local_addr().unwrap().to_string().as_bytes())
        .unwrap();
    let mut raw = if me == 0 {
        l.accept().unwrap().0
    } else {
        TcpStream::connect(std::str::from_utf8(&all[0]).unwrap()).unwrap()
    };
    drop(l);
    raw.set_nodelay(true).unwrap();
    raw.set_nonblocking(a.mode == Mode::Poll).unwrap();
    let lat_iters = if a.mode == Mode::Poll {
        a.iters
    } else {
        a.iters / 4
    };
    let (mut rl, mut ml, mut rb, mut mb) = (vec![], vec![], vec![], vec![]);
    for _ in 0..a.reps {
        s.bootstrap().barrier("r").unwrap();
        rl.push(proc_raw_pingpong(&mut raw, me, 8, lat_iters));
        s.bootstrap().barrier("m").unwrap();
        ml.push(proc_mad_pingpong(&ch, me, 8, lat_iters));
        s.bootstrap().barrier("rb").unwrap();
        rb.push(proc_raw_stream(&mut raw, me, 4 << 20, 256));
        s.bootstrap().barrier("mb").unwrap();
        mb.push(proc_mad_stream(&ch, me, 4 << 20, 256));
    }
    if me == 0 {
        report(a, "processes under madrun", &rl, &ml, &[], &rb, &mb);
    }
    s.bootstrap().barrier("end").unwrap();
}

fn proc_raw_pingpong(s: &mut TcpStream, me: usize, size: usize, iters: usize) -> f64 {
    let mut buf = vec![1u8; size];
    let mut start = Instant::now();
    for i in 0..iters + 100 {
        if i == 100 {
            start = Instant::now();
        }
        if me == 0 {
            write_full(s, &buf);
            read_full(s, &mut buf);
        } else {
            read_full(s, &mut buf);
            write_full(s, &buf);
        }
    }
    start.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

fn proc_raw_stream(s: &mut TcpStream, me: usize, size: usize, count: usize) -> f64 {
    let mut buf = vec![1u8; size];
    let start = Instant::now();
    if me == 0 {
        for _ in 0..count {
            write_full(s, &buf);
        }
        read_full(s, &mut [0u8; 1]);
    } else {
        for _ in 0..count {
            read_full(s, &mut buf);
        }
        write_full(s, &[1]);
    }
    (size * count) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn proc_mad_pingpong(ch: &Channel, me: usize, size: usize, iters: usize) -> f64 {
    let mut buf = vec![1u8; size];
    let mut start = Instant::now();
    for i in 0..iters + 100 {
        if i == 100 {
            start = Instant::now();
        }
        if me == 0 {
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&buf, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
        let mut u = ch.begin_unpacking().unwrap();
        u.unpack(&mut buf, SendMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
        if me == 1 {
            let mut p = ch.begin_packing(0).unwrap();
            p.pack(&buf, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
    }
    start.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

fn proc_mad_stream(ch: &Channel, me: usize, size: usize, count: usize) -> f64 {
    let mut buf = vec![1u8; size];
    let start = Instant::now();
    if me == 0 {
        for _ in 0..count {
            let mut p = ch.begin_packing(1).unwrap();
            p.pack(&buf, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
        let mut ack = [0u8; 1];
        let mut u = ch.begin_unpacking().unwrap();
        u.unpack(&mut ack, SendMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
    } else {
        for _ in 0..count {
            let mut u = ch.begin_unpacking().unwrap();
            u.unpack(&mut buf, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
        }
        let mut p = ch.begin_packing(0).unwrap();
        p.pack(&[1u8], RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
    }
    (size * count) as f64 / start.elapsed().as_secs_f64() / 1e9
}

// ---------- the driver alone (no engine) ----------

/// One-way latency (µs) of 8-byte messages through the driver contract directly: what the
/// driver costs without the pack/unpack engine (busy-polls in both modes).
fn driver_pingpong(iters: usize) -> f64 {
    use mad_core::bootstrap::Bootstrap;
    use mad_core::driver::{Driver, OpenContext, RxLink, TxLink};
    use mad_core::progress::ProgressPolicy;
    use std::task::Poll;
    let mut boots = ThreadBootstrap::group(2);
    let b1 = boots.pop().unwrap();
    let b0 = boots.pop().unwrap();
    let open = |b: ThreadBootstrap| {
        let config = ChannelConfig::parse("drv", "tcp").unwrap();
        let table = mad_tcp::tm_table(mad_tcp::DEFAULT_SMALL_MAX).unwrap();
        let progress = ProgressPolicy::default();
        let ctx = OpenContext::new(&config, &b as &dyn Bootstrap, &table, &progress);
        let mut ch = TcpDriver::new().open(&ctx).unwrap();
        ch.links[1 - b.rank()].take().unwrap()
    };
    let t1 = thread::spawn(move || open(b1));
    let mut l0 = open(b0);
    let mut l1 = t1.join().unwrap();
    fn send(tx: &mut dyn TxLink, v: &[u8; 8]) {
        tx.begin_message().unwrap();
        while tx
            .with_buffer(0, 8, &mut |b| {
                b[..8].copy_from_slice(v);
                8
            })
            .unwrap()
            .is_pending()
        {}
        while tx.end_message().unwrap().is_pending() {}
    }
    fn recv(rx: &mut dyn RxLink, v: &mut [u8; 8]) {
        while rx.poll_message().unwrap().is_pending() {
            std::hint::spin_loop();
        }
        let mut got = 0;
        while got < 8 {
            let r = rx.with_data(0, 8 - got, &mut |b| {
                let n = b.len().min(8 - got);
                v[got..got + n].copy_from_slice(&b[..n]);
                got += n;
                n
            });
            if let Ok(Poll::Pending) = r {
                std::hint::spin_loop();
            }
        }
        rx.end_message().unwrap();
    }
    let t = thread::spawn(move || {
        let mut v = [0u8; 8];
        for _ in 0..iters + 100 {
            recv(&mut *l1.rx, &mut v);
            send(&mut *l1.tx, &v);
        }
        l1
    });
    let mut v = [1u8; 8];
    let mut start = Instant::now();
    for i in 0..iters + 100 {
        if i == 100 {
            start = Instant::now();
        }
        send(&mut *l0.tx, &v);
        recv(&mut *l0.rx, &mut v);
    }
    let el = start.elapsed();
    drop(t.join().unwrap());
    el.as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

// ---------- Madeleine over tcp ----------

fn mad_pair(spec: &str) -> (Channel, Channel, Session, Session) {
    let mut boots = ThreadBootstrap::group(2);
    let b1 = boots.pop().unwrap();
    let b0 = boots.pop().unwrap();
    let spec1 = spec.to_string();
    let t = thread::spawn(move || {
        let s = Session::builder()
            .driver(TcpDriver::new())
            .bootstrap(Box::new(b1))
            .build()
            .unwrap();
        let ch = s
            .open_channel_with(ChannelConfig::parse("bench", &spec1).unwrap())
            .unwrap();
        (ch, s)
    });
    let s0 = Session::builder()
        .driver(TcpDriver::new())
        .bootstrap(Box::new(b0))
        .build()
        .unwrap();
    let c0 = s0
        .open_channel_with(ChannelConfig::parse("bench", spec).unwrap())
        .unwrap();
    let (c1, s1) = t.join().unwrap();
    (c0, c1, s0, s1)
}

fn spec(mode: Mode, extra: &str) -> String {
    let m = if mode == Mode::Poll { "poll" } else { "block" };
    format!("tcp,progress={m}{extra}")
}

fn mad_pingpong(mode: Mode, extra: &str, size: usize, iters: usize) -> f64 {
    let (c0, c1, _s0, _s1) = mad_pair(&spec(mode, extra));
    let go = Arc::new(Barrier::new(2));
    let go2 = go.clone();
    let t = thread::spawn(move || {
        let mut buf = vec![0u8; size];
        go2.wait();
        for _ in 0..iters + 100 {
            let mut u = c1.begin_unpacking().unwrap();
            u.unpack(&mut buf, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            let mut p = c1.begin_packing(0).unwrap();
            p.pack(&buf, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        }
        c1
    });
    let mut buf = vec![1u8; size];
    go.wait();
    let mut start = Instant::now();
    for i in 0..iters + 100 {
        if i == 100 {
            start = Instant::now();
        }
        let mut p = c0.begin_packing(1).unwrap();
        p.pack(&buf, RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
        let mut u = c0.begin_unpacking().unwrap();
        u.unpack(&mut buf, SendMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
    }
    let el = start.elapsed();
    drop(t.join().unwrap());
    el.as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

fn mad_stream(mode: Mode, size: usize, count: usize) -> f64 {
    let (c0, c1, _s0, _s1) = mad_pair(&spec(mode, ""));
    let t = thread::spawn(move || {
        let mut buf = vec![0u8; size];
        for _ in 0..count + 2 {
            let mut u = c1.begin_unpacking().unwrap();
            u.unpack(&mut buf, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
        }
        let mut p = c1.begin_packing(0).unwrap();
        p.pack(&[1u8], RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
        c1
    });
    let buf = vec![1u8; size];
    let send = |c: &Channel| {
        let mut p = c.begin_packing(1).unwrap();
        p.pack(&buf, RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
    };
    send(&c0);
    send(&c0);
    let start = Instant::now();
    for _ in 0..count {
        send(&c0);
    }
    let mut ack = [0u8; 1];
    let mut u = c0.begin_unpacking().unwrap();
    u.unpack(&mut ack, SendMode::Cheaper).unwrap();
    u.end_unpacking().unwrap();
    let el = start.elapsed();
    drop(t.join().unwrap());
    (size * count) as f64 / el.as_secs_f64() / 1e9
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[0], v[v.len() / 2])
}

fn report(a: &Args, how: &str, rl: &[f64], ml: &[f64], dl: &[f64], rb: &[f64], mb: &[f64]) {
    let count = 256;
    let lat_iters = if a.mode == Mode::Poll {
        a.iters
    } else {
        a.iters / 4
    };
    let mname = if a.mode == Mode::Poll {
        "poll"
    } else {
        "block"
    };
    println!("{how}:");
    let (rl_min, rl_med) = stats(rl.to_vec());
    let (ml_min, ml_med) = stats(ml.to_vec());
    let (rb_max, rb_med) = stats(rb.iter().map(|x| -x).collect());
    let (mb_max, mb_med) = stats(mb.iter().map(|x| -x).collect());
    // Ratio per pair (same repetition), then the median of the ratios.
    let (_, lat_ratio) = stats(ml.iter().zip(rl).map(|(m, r)| m / r).collect());
    let (_, bw_ratio) = stats(mb.iter().zip(rb).map(|(m, r)| m / r).collect());
    println!("mode {mname}, {} reps, {lat_iters} ping-pongs per latency run, {count} x 4 MiB per bandwidth run", a.reps);
    println!("| what | raw tcp best / median | madeleine tcp best / median | ratio of bests | median of paired ratios |");
    println!("|---|---|---|---|---|");
    println!("| 8 B one-way latency (µs) | {rl_min:.2} / {rl_med:.2} | {ml_min:.2} / {ml_med:.2} | {:.3} | {lat_ratio:.3} |", ml_min / rl_min);
    if !dl.is_empty() {
        let (dl_min, dl_med) = stats(dl.to_vec());
        let (_, dr) = stats(dl.iter().zip(rl).map(|(d, r)| d / r).collect());
        println!(
            "| 8 B one-way, driver alone, no engine (µs) | {rl_min:.2} / {rl_med:.2} | {dl_min:.2} / {dl_med:.2} | {:.3} | {dr:.3} |",
            dl_min / rl_min
        );
    }
    println!(
        "| 4 MiB bandwidth (GB/s) | {:.2} / {:.2} | {:.2} / {:.2} | {:.3} | {bw_ratio:.3} |",
        -rb_max,
        -rb_med,
        -mb_max,
        -mb_med,
        mb_max / rb_max
    );
}

fn main() {
    let a = args();
    if a.proc {
        proc_main(&a);
        return;
    }
    let lat_iters = if a.mode == Mode::Poll {
        a.iters
    } else {
        a.iters / 4
    };
    let (mut rl, mut ml, mut rb, mut mb) = (vec![], vec![], vec![], vec![]);
    let mut dl = vec![];
    let mb_size = 4 << 20;
    let count = 256; // 1 GiB per bandwidth run
    if !a.only.is_empty() {
        for _ in 0..a.reps {
            match a.only.as_str() {
                "raw" => println!(
                    "raw 8 B one-way: {:.2} µs",
                    raw_pingpong(a.mode, 8, lat_iters)
                ),
                "mad" => println!(
                    "mad 8 B one-way: {:.2} µs",
                    mad_pingpong(a.mode, "", 8, lat_iters)
                ),
                "driver" => println!("driver 8 B one-way: {:.2} µs", driver_pingpong(lat_iters)),
                "raw-bw" => println!("raw 4 MiB: {:.2} GB/s", raw_stream(a.mode, 4 << 20, 256)),
                _ => println!("mad 4 MiB: {:.2} GB/s", mad_stream(a.mode, 4 << 20, 256)),
            }
        }
        return;
    }
    for _ in 0..a.reps {
        // Interleave raw and Madeleine so drift and neighbours hit both alike.
        // Alternate which side runs first.
        if rl.len() % 2 == 0 {
            rl.push(raw_pingpong(a.mode, 8, lat_iters));
            ml.push(mad_pingpong(a.mode, "", 8, lat_iters));
            rb.push(raw_stream(a.mode, mb_size, count));
            mb.push(mad_stream(a.mode, mb_size, count));
        } else {
            ml.push(mad_pingpong(a.mode, "", 8, lat_iters));
            rl.push(raw_pingpong(a.mode, 8, lat_iters));
            mb.push(mad_stream(a.mode, mb_size, count));
            rb.push(raw_stream(a.mode, mb_size, count));
        }
        if a.mode == Mode::Poll {
            dl.push(driver_pingpong(lat_iters));
        }
    }
    report(&a, "threads", &rl, &ml, &dl, &rb, &mb);
    if a.sweep {
        println!();
        println!(
            "threshold sweep, one piece per message, one-way µs, min / median of {} runs",
            a.reps
        );
        println!("| size | raw tcp | copy TM (tm.small=max) | gather TM (tm.small=0) |");
        println!("|---|---|---|---|");
        for size in [256usize, 1024, 2048, 4096, 8192, 16384, 32768, 65536] {
            let it = (lat_iters / 2).max(1000);
            let mut r = vec![];
            let mut c = vec![];
            let mut g = vec![];
            for _ in 0..a.reps {
                r.push(raw_pingpong(a.mode, size, it));
                c.push(mad_pingpong(a.mode, ",tm.small=max", size, it));
                g.push(mad_pingpong(a.mode, ",tm.small=0", size, it));
            }
            let (r, c, g) = (stats(r), stats(c), stats(g));
            println!(
                "| {size} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |",
                r.0, r.1, c.0, c.1, g.0, g.1
            );
        }
    }
}
