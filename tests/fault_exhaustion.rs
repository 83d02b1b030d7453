//! Resource exhaustion: a fast sender and a slow receiver (credits, rings and socket buffers
//! run out: the sender must wait, nothing is lost or reordered), and many channels at once
//! (50 tcp channels × 4 ranks in one process: about 1 200 sockets).
//! Ranks are threads with `ThreadBootstrap`; drivers and sockets/segments are real.

#![cfg(all(feature = "tcp", feature = "shm", feature = "via"))]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{Channel, ChannelConfig, Error, RecvMode, SendMode, Session};

const LIMIT: Duration = Duration::from_secs(120);

fn session(b: ThreadBootstrap) -> Session {
    Session::builder()
        .driver(mad_tcp::TcpDriver::new())
        .driver(mad_shm::ShmDriver::new())
        .driver(mad_via::ViaDriver::new())
        .bootstrap(Box::new(b))
        .build()
        .unwrap()
}

fn pattern(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u64 ^ i.wrapping_mul(131)) as u8)
        .collect()
}

const MSGS: u64 = 120;

fn len_of(i: u64) -> usize {
    // 1 B .. 1 MiB, every TM of every driver.
    [1usize, 100, 4096, 65536, 300_000, 1 << 20][i as usize % 6]
}

fn fast_sender(ch: &Channel) -> Result<Duration, Error> {
    let t = Instant::now();
    for i in 0..MSGS {
        let data = pattern(i, len_of(i));
        let mut p = ch.begin_packing(1)?;
        p.pack_value(&i, RecvMode::Express)?;
        p.pack(&data, RecvMode::Cheaper)?;
        // A second small piece after the big one: ordering inside the message.
        p.pack_value(&!i, RecvMode::Express)?;
        p.end_packing()?;
    }
    Ok(t.elapsed())
}

fn slow_receiver(ch: &Channel) -> Result<Duration, Error> {
    let t = Instant::now();
    for i in 0..MSGS {
        // Slow for the first half: everything the sender can queue fills up.
        if i < MSGS / 2 {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut u = ch.begin_unpacking()?;
        let seq: u64 = u.unpack_value()?;
        let mut buf = vec![0u8; len_of(i)];
        u.unpack(&mut buf, SendMode::Cheaper)?;
        let tail: u64 = u.unpack_value()?;
        u.end_unpacking()?;
        if seq != i || tail != !i || buf != pattern(i, len_of(i)) {
            return Err(Error::Protocol {
                rank: 0,
                what: format!("message {i} lost, reordered or corrupted (got seq {seq})"),
            });
        }
    }
    Ok(t.elapsed())
}

#[test]
fn fast_sender_slow_receiver_loses_nothing() {
    for spec in [
        "tcp",
        "shm",
        "via:soft",
        "tcp,checked=true",
        "shm,progress=block",
    ] {
        let (tx, rx) = mpsc::channel();
        for b in ThreadBootstrap::group(2) {
            let tx = tx.clone();
            let spec = spec.to_string();
            std::thread::spawn(move || {
                let s = session(b);
                let ch = s
                    .open_channel_with(ChannelConfig::parse("slow", &spec).unwrap())
                    .unwrap();
                let r = if s.rank() == 0 {
                    fast_sender(&ch)
                } else {
                    slow_receiver(&ch)
                };
                let _ = tx.send((s.rank(), r));
                let _ = s.bootstrap().barrier("slow-end");
            });
        }
        let mut times = [Duration::ZERO; 2];
        for _ in 0..2 {
            let (rank, r) = rx.recv_timeout(LIMIT).expect("a rank hung");
            times[rank] = r.unwrap_or_else(|e| panic!("{spec}: rank {rank}: {e}"));
        }
        eprintln!(
            "slow receiver on {spec}: sender done in {:?}, receiver in {:?}",
            times[0], times[1]
        );
        // The sender was held back by the receiver: it cannot finish much before the
        // receiver's 600 ms of sleeping is mostly over.
        assert!(
            times[0] >= Duration::from_millis(300),
            "{spec}: sender finished in {:?}: was it buffering without bound?",
            times[0]
        );
    }
}

#[test]
fn fifty_tcp_channels_times_four_ranks() {
    const CHANNELS: usize = 50;
    const RANKS: usize = 4;
    let (tx, rx) = mpsc::channel();
    let t = Instant::now();
    for b in ThreadBootstrap::group(RANKS) {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = (|| {
                let s = session(b);
                let me = s.rank();
                let chans: Vec<Channel> = (0..CHANNELS)
                    .map(|c| s.open_channel_with(ChannelConfig::parse(&format!("many{c}"), "tcp")?))
                    .collect::<Result<_, Error>>()?;
                // A ring on every channel: send to the next rank, receive from the previous.
                for (c, ch) in chans.iter().enumerate() {
                    let mut p = ch.begin_packing((me + 1) % RANKS)?;
                    p.pack_value(&((c * 1000 + me) as u64), RecvMode::Express)?;
                    p.end_packing()?;
                }
                for (c, ch) in chans.iter().enumerate() {
                    let mut u = ch.begin_unpacking()?;
                    let v: u64 = u.unpack_value()?;
                    u.end_unpacking()?;
                    let want = (c * 1000 + (me + RANKS - 1) % RANKS) as u64;
                    if v != want {
                        return Err(Error::Protocol {
                            rank: me,
                            what: format!("channel {c}: got {v}, want {want}"),
                        });
                    }
                }
                let fds = std::fs::read_dir("/proc/self/fd")
                    .map(|d| d.count())
                    .unwrap_or(0);
                s.bootstrap().barrier("many-end")?;
                Ok(fds)
            })();
            let _ = tx.send(r);
        });
    }
    let mut fds = 0;
    for _ in 0..RANKS {
        let r = rx.recv_timeout(LIMIT).expect("a rank hung");
        fds = fds.max(r.unwrap_or_else(|e| panic!("{e}")));
    }
    eprintln!(
        "{CHANNELS} tcp channels x {RANKS} ranks: open and one ring each in {:?}, {fds} fds open in the process",
        t.elapsed()
    );
}
