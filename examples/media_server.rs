//! A multi-channel server: the paper's Figure 2. One server (rank 0) streams video (large
//! frames) on a fast channel and subtitles (short texts) on a TCP channel to every client
//! (ranks 1..n) at once, from different threads.
//!
//! ```text
//! cargo run --release --example media_server                       # server + 2 clients
//! cargo run --release --example media_server -- --video sisci:local --frame 4m
//! madrun -n 4 target/release/examples/media_server -- --video shm --text tcp
//! ```
//!
//! Every frame carries its number, its length and a checksum (header EXPRESS, pixels CHEAPER);
//! every subtitle its sequence number and its send time. Clients check each frame's integrity
//! and that both streams arrive in order, and report the subtitles' one-way latency twice:
//! alone, then while one server thread per client saturates the video channel. (Send times are
//! the wall clock: on several hosts, synchronise their clocks or read the numbers as offsets.)
//!
//! Threads are placed as a media server places them: with at least two CPUs, every video
//! thread (the server's senders, the clients' receivers) runs on the last CPU and every subtitle
//! thread on the first, so the bulk transfers saturate their channel and their core without
//! taking the core the latency-sensitive stream needs (`madeleine::affinity`). `--no-pin` lets
//! the scheduler place them: on a host with fewer cores than busy threads the subtitles then
//! wait for a core, and the report shows by how much. Each client ends with a verdict line
//! comparing its two phases.
//!
//! Options: `--video NAME|SPEC` (default `shm`), `--text NAME|SPEC` (default `tcp`), `--frame
//! SIZE` (default 1m), `--subs N` (subtitles per phase, default 400), `--interval µs` (between
//! subtitles, default 1000), `--no-pin`, `--quick` (50 subtitles of 200 µs intervals, 256 KiB
//! frames, for CI).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use madeleine::bytemuck::{Pod, Zeroable};
use madeleine::cli::{self, Arg, Cli};
use madeleine::config::parse_size;
use madeleine::{Channel, ChannelConfig, Error, RecvMode, Result, SendMode, Session};

/// Sequence number of the end-of-stream markers.
const END: u64 = u64::MAX;
/// Largest frame a client accepts.
const MAX_FRAME: u64 = 256 << 20;

/// What precedes every frame (EXPRESS: the client sizes and checks the frame with it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[bytemuck(crate = "madeleine::bytemuck")]
struct FrameHeader {
    number: u64,
    len: u64,
    checksum: u64,
}

/// What precedes every subtitle.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[bytemuck(crate = "madeleine::bytemuck")]
struct SubHeader {
    seq: u64,
    sent_ns: u64,
    len: u64,
}

struct Opts {
    video: String,
    text: String,
    frame: usize,
    subs: usize,
    interval: Duration,
    pin: bool,
}

/// Put the calling thread where its stream belongs (see the module documentation); does
/// nothing with `--no-pin` or on a single CPU.
fn place(o: &Opts, video: bool) -> Result<()> {
    let n = madeleine::affinity::cpu_count();
    if o.pin && n >= 2 {
        madeleine::affinity::pin_current_thread(Some(if video { n - 1 } else { 0 }))?;
    }
    Ok(())
}

const CLI: Cli = Cli::new(
    "media_server",
    env!("CARGO_PKG_VERSION"),
    "usage: media_server [options]             (alone: a server and 2 clients on this host)
       madrun -n N media_server [--] [options]

Rank 0 streams video frames on one channel and subtitles on another to every client.

  --video NAME|SPEC  the video channel (default shm)
  --text NAME|SPEC   the subtitle channel (default tcp)
  --frame SIZE       video frame size, 8 bytes to 64m (default 1m)
  --subs N           subtitles per phase (default 400)
  --interval US      microseconds between subtitles (default 1000)
  --no-pin           let the scheduler place the threads
  --quick            50 subtitles 200 us apart, 256 KiB frames (CI)
  -h, --help         this text
  -V, --version      the version

Options take their value as `--opt value` or `--opt=value`.",
);

fn opts() -> Opts {
    let mut o = Opts {
        video: "shm".into(),
        text: "tcp".into(),
        frame: 1 << 20,
        subs: 400,
        interval: Duration::from_micros(1000),
        pin: true,
    };
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Long("video") => o.video = cli::string(p)?,
                Arg::Long("text") => o.text = cli::string(p)?,
                Arg::Long("frame") => {
                    o.frame = cli::value_with(p, "--frame", "a size from 8 to 64m", |v| {
                        parse_size(v).filter(|&n| n >= 8 && n as u64 <= MAX_FRAME)
                    })?
                }
                Arg::Long("subs") => o.subs = cli::positive(p, "--subs")?,
                Arg::Long("interval") => {
                    o.interval = Duration::from_micros(cli::number(p, "--interval")?)
                }
                Arg::Long("no-pin") => o.pin = false,
                Arg::Long("quick") => {
                    o.subs = 50;
                    o.interval = Duration::from_micros(200);
                    o.frame = 256 << 10;
                }
                other => CLI.other(other)?,
            }
        }
        Ok(())
    });
    o
}

/// `shm`, `tcp,progress=block`, `sisci:local`: a spec; anything else: a configured channel.
fn open(session: &Session, name: &str, what: &str) -> Result<Channel> {
    let driver = what.split([',', ':']).next().unwrap_or("");
    if what.contains([',', ':']) || session.driver_names().contains(&driver) {
        session.open_channel_with(ChannelConfig::parse(name, what)?)
    } else {
        session.open_channel(what)
    }
}

fn checksum(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        h = (h ^ u64::from_le_bytes(a))
            .wrapping_mul(0x0100_0000_01b3)
            .rotate_left(7);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn main() {
    madeleine::init_logging();
    if let Err(e) = run() {
        eprintln!("media_server: {e}");
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
            "media_server needs a server and a client".into(),
        ));
    }
    place(&o, false)?; // this thread carries the subtitles
    let video = open(&session, "video", &o.video)?;
    let text = open(&session, "text", &o.text)?;
    if session.rank() == 0 {
        let cpus = madeleine::affinity::cpu_count();
        println!(
            "server: video on `{}`, subtitles on `{}`, {} clients, {} B frames, {}",
            video.config().driver,
            text.config().driver,
            session.size() - 1,
            o.frame,
            if o.pin && cpus >= 2 {
                format!(
                    "video threads on CPU {}, subtitle threads on CPU 0",
                    cpus - 1
                )
            } else {
                "threads placed by the scheduler".to_string()
            }
        );
        for with_video in [false, true] {
            // Every client is listening before the phase starts (latency, not start-up time).
            session
                .bootstrap()
                .barrier(&format!("media/{with_video}"))?;
            serve_phase(&video, &text, &o, with_video)?;
        }
        Ok(())
    } else {
        let mut phases = Vec::new();
        for with_video in [false, true] {
            session
                .bootstrap()
                .barrier(&format!("media/{with_video}"))?;
            phases.push(watch_phase(&video, &text, with_video, &o)?);
        }
        for (line, _) in &phases {
            println!("rank {}: {line}", session.rank());
        }
        let (alone, loaded) = (phases[0].1, phases[1].1);
        println!(
            "rank {}: verdict: subtitle median {loaded:.1} µs with the video running vs {alone:.1} µs alone (×{:.2}; {})",
            session.rank(),
            loaded / alone.max(1e-9),
            if o.pin && madeleine::affinity::cpu_count() >= 2 {
                "threads pinned apart"
            } else {
                "threads not pinned: they share the cores"
            }
        );
        Ok(())
    }
}

/// One phase on the server: a subtitle thread for everybody and, with video, one frame thread
/// per client.
fn serve_phase(video: &Channel, text: &Channel, o: &Opts, with_video: bool) -> Result<()> {
    let clients: Vec<usize> = (1..text.size()).collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| -> Result<()> {
        let mut senders = Vec::new();
        if with_video {
            for &c in &clients {
                let stop = &stop;
                senders.push(s.spawn(move || {
                    place(o, true)?;
                    send_video(video, c, o.frame, stop)
                }));
            }
        }
        let subs = (|| -> Result<()> {
            let body_of = |i: u64| format!("[{:>5}] subtitle {i}: the quick brown fox", i);
            let next = Instant::now();
            for i in 0..o.subs as u64 {
                let body = body_of(i);
                for &c in &clients {
                    let h = SubHeader {
                        seq: i,
                        sent_ns: now_ns(),
                        len: body.len() as u64,
                    };
                    let mut p = text.begin_packing(c)?;
                    p.pack_value(&h, RecvMode::Express)?;
                    p.pack(body.as_bytes(), RecvMode::Cheaper)?;
                    p.end_packing()?;
                }
                let due = next + o.interval * (i as u32 + 1);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
            }
            for &c in &clients {
                let mut p = text.begin_packing(c)?;
                p.pack_value(
                    &SubHeader {
                        seq: END,
                        sent_ns: 0,
                        len: 0,
                    },
                    RecvMode::Express,
                )?;
                p.end_packing()?;
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let mut frames = 0;
        for h in senders {
            frames += h
                .join()
                .map_err(|_| Error::BadConfig("a video thread panicked".into()))??;
        }
        subs?;
        if with_video {
            println!("server: {frames} frames sent during {} subtitles", o.subs);
        }
        Ok(())
    })
}

/// Send frames to `client` until `stop`, then the end marker; returns the number of frames.
fn send_video(video: &Channel, client: usize, size: usize, stop: &AtomicBool) -> Result<u64> {
    let mut frame: Vec<u8> = (0..size).map(|i| (i * 31 + client) as u8).collect();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        frame[..8].copy_from_slice(&n.to_le_bytes()); // every frame differs
        let h = FrameHeader {
            number: n,
            len: size as u64,
            checksum: checksum(&frame),
        };
        let mut p = video.begin_packing(client)?;
        p.pack_value(&h, RecvMode::Express)?;
        p.pack(&frame, RecvMode::Cheaper)?;
        p.end_packing()?;
        n += 1;
    }
    let mut p = video.begin_packing(client)?;
    p.pack_value(
        &FrameHeader {
            number: END,
            len: 0,
            checksum: 0,
        },
        RecvMode::Express,
    )?;
    p.end_packing()?;
    Ok(n)
}

/// One phase on a client: a subtitle thread and, with video, a frame thread. Returns the
/// report line and the subtitles' median latency (µs).
fn watch_phase(
    video: &Channel,
    text: &Channel,
    with_video: bool,
    o: &Opts,
) -> Result<(String, f64)> {
    std::thread::scope(|s| -> Result<(String, f64)> {
        let frames = with_video.then(|| {
            s.spawn(|| {
                place(o, true)?;
                receive_video(video)
            })
        });
        let mut lat = Vec::new();
        let subs = (|| -> Result<()> {
            let mut expect = 0u64;
            loop {
                let mut u = text.begin_unpacking_from(0)?;
                let h: SubHeader = u.unpack_value()?;
                if h.seq == END {
                    return u.end_unpacking();
                }
                if h.len > 4096 {
                    return Err(Error::protocol(0, format!("subtitle of {} B", h.len)));
                }
                let mut body = vec![0u8; h.len as usize];
                u.unpack(&mut body, SendMode::Cheaper)?;
                u.end_unpacking()?;
                lat.push(now_ns().saturating_sub(h.sent_ns));
                if h.seq != expect {
                    return Err(Error::protocol(
                        0,
                        format!("subtitle {} after {}", h.seq, expect),
                    ));
                }
                let want = format!("subtitle {}:", h.seq);
                if !String::from_utf8_lossy(&body).contains(&want) {
                    return Err(Error::protocol(0, format!("subtitle {} garbled", h.seq)));
                }
                expect += 1;
            }
        })();
        let video_report = match frames {
            Some(h) => Some(
                h.join()
                    .map_err(|_| Error::BadConfig("the video thread panicked".into()))??,
            ),
            None => None,
        };
        subs?;
        lat.sort_unstable();
        let pct = |p: f64| {
            lat.get(((lat.len().max(1) - 1) as f64 * p) as usize)
                .map_or(0.0, |&n| n as f64 / 1e3)
        };
        let mut line = format!(
            "subtitles on `{}` {:<13}: {} in order, latency median {:>8.1} µs, p99 {:>8.1} µs",
            text.config().driver,
            if with_video { "+ video" } else { "alone" },
            lat.len(),
            pct(0.5),
            pct(0.99)
        );
        if let Some((n, bytes, secs)) = video_report {
            line += &format!(
                "; video on `{}`: {n} frames intact and in order, {:.0} MB/s",
                video.config().driver,
                bytes as f64 / secs.max(1e-9) / 1e6
            );
        }
        Ok((line, pct(0.5)))
    })
}

/// Receive frames until the end marker, checking each; returns (frames, bytes, seconds).
fn receive_video(video: &Channel) -> Result<(u64, u64, f64)> {
    let mut expect = 0u64;
    let mut bytes = 0u64;
    let mut frame = Vec::new();
    let t0 = Instant::now();
    loop {
        let mut u = video.begin_unpacking_from(0)?;
        let h: FrameHeader = u.unpack_value()?;
        if h.number == END {
            u.end_unpacking()?;
            return Ok((expect, bytes, t0.elapsed().as_secs_f64()));
        }
        if h.len > MAX_FRAME {
            return Err(Error::protocol(0, format!("frame of {} B", h.len)));
        }
        frame.resize(h.len as usize, 0);
        u.unpack(&mut frame, SendMode::Cheaper)?;
        u.end_unpacking()?;
        if h.number != expect {
            return Err(Error::protocol(
                0,
                format!("frame {} after {}", h.number, expect),
            ));
        }
        if checksum(&frame) != h.checksum {
            return Err(Error::protocol(0, format!("frame {} corrupted", h.number)));
        }
        expect += 1;
        bytes += h.len;
    }
}
