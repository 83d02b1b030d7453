//! Strangers at a `via:soft` listener during channel setup: each is refused and logged, none
//! stalls or fails the open, and the real connection carries traffic afterwards.
//!
//! Rank 1 accepts rank 0's two sockets. A bootstrap wrapper leaks rank 1's published address
//! to the test and holds rank 0 back for a moment, so three strangers reach rank 1's listener
//! first: one that stays silent, one speaking HTTP, one sending a well-formed handshake
//! record with a bad proof, and one that resets the connection at once. The case runs in a child process (this test binary re-executed)
//! whose global `tracing` subscriber prints every event on stderr ([`StderrLog`]; the driver
//! crates do not depend on tracing-subscriber), so that rank 1's warnings can be checked.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::{ChannelConfig, RecvMode, SendMode, Session};
use mad_via::wire::{Hello, SoftAddr, HELLO_LEN};
use mad_via::ViaDriver;

/// A minimal `tracing` subscriber: one line per event on stderr, `LEVEL target: fields`.
struct StderrLog;

impl tracing::Subscriber for StderrLog {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        struct Line(String);
        impl tracing::field::Visit for Line {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                use std::fmt::Write as _;
                let _ = write!(self.0, " {}={v:?}", f.name());
            }
        }
        let mut line = Line(String::new());
        event.record(&mut line);
        let m = event.metadata();
        eprintln!("{} {}:{}", m.level(), m.target(), line.0);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

const LIMIT: Duration = Duration::from_secs(20);

/// A bootstrap that reports the soft address allgather to the test and may delay its rank.
struct Spy {
    inner: ThreadBootstrap,
    leak: Option<mpsc::Sender<Vec<Vec<u8>>>>,
    delay: Duration,
}

impl Bootstrap for Spy {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn secret(&self) -> &Secret {
        self.inner.secret()
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> mad_core::Result<Vec<Vec<u8>>> {
        let all = self.inner.allgather(tag, value)?;
        if tag.ends_with("soft-addr") {
            if let Some(l) = &self.leak {
                let _ = l.send(all.clone());
            }
            std::thread::sleep(self.delay);
        }
        Ok(all)
    }
    fn kind(&self) -> &'static str {
        "spy"
    }
}

fn knock(addr: SocketAddr) -> Vec<TcpStream> {
    let mut keep = Vec::new();
    // A silent stranger: connects and says nothing.
    keep.push(TcpStream::connect_timeout(&addr, LIMIT).unwrap());
    // A stranger speaking another protocol.
    let mut http = TcpStream::connect_timeout(&addr, LIMIT).unwrap();
    http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    keep.push(http);
    // A stranger with a well-formed record claiming rank 0, without the secret.
    let mut forger = TcpStream::connect_timeout(&addr, LIMIT).unwrap();
    forger.set_read_timeout(Some(LIMIT)).unwrap();
    let mut theirs = [0u8; HELLO_LEN];
    forger.read_exact(&mut theirs).unwrap();
    let theirs = Hello::decode(&theirs).unwrap();
    let fake = Hello {
        rank: 0,
        nonce: [7; 16],
        proof: [9; 32],
        qp: 0,
        ..theirs
    };
    forger.write_all(&fake.encode()).unwrap();
    keep.push(forger);
    // A stranger that resets the connection at once (close with a zero linger time).
    let rst = TcpStream::connect_timeout(&addr, LIMIT).unwrap();
    nix::sys::socket::setsockopt(
        &rst,
        nix::sys::socket::sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    )
    .unwrap();
    drop(rst);
    keep
}

#[test]
#[ignore = "child process of strangers_are_refused_logged_and_do_not_stall_the_open"]
fn stranger_child() {
    tracing::subscriber::set_global_default(StderrLog).expect("no subscriber yet");
    let mut bs = ThreadBootstrap::group(2);
    let b1 = bs.pop().unwrap();
    let b0 = bs.pop().unwrap();
    let (leak_tx, leak_rx) = mpsc::channel();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let r0 = s.spawn(move || {
            let spy = Spy {
                inner: b0,
                leak: None,
                delay: Duration::from_millis(500),
            };
            let session = Session::builder()
                .driver(ViaDriver::new())
                .bootstrap(Box::new(spy))
                .build()
                .unwrap();
            let ch = session
                .open_channel_with(
                    ChannelConfig::parse("s", "via:soft")
                        .unwrap()
                        .op_timeout(LIMIT),
                )
                .unwrap();
            let body = vec![3u8; 100_000];
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_value(&4242u64, RecvMode::Express).unwrap();
            p.pack(&body, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
        });
        let r1 = s.spawn(move || {
            let spy = Spy {
                inner: b1,
                leak: Some(leak_tx),
                delay: Duration::ZERO,
            };
            let session = Session::builder()
                .driver(ViaDriver::new())
                .bootstrap(Box::new(spy))
                .build()
                .unwrap();
            let ch = session
                .open_channel_with(
                    ChannelConfig::parse("s", "via:soft")
                        .unwrap()
                        .op_timeout(LIMIT),
                )
                .unwrap();
            let opened = t0.elapsed();
            let mut u = ch.begin_unpacking().unwrap();
            let v: u64 = u.unpack_value().unwrap();
            let mut body = vec![0u8; 100_000];
            u.unpack(&mut body, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert_eq!(v, 4242);
            assert!(body.iter().all(|&b| b == 3));
            opened
        });
        let all = leak_rx
            .recv_timeout(LIMIT)
            .expect("rank 1 published its address");
        let a = SoftAddr::decode(&all[1], 2).unwrap();
        let _strangers = knock(a.sock.parse().unwrap());
        r0.join().expect("rank 0");
        let opened = r1.join().expect("rank 1");
        // The silent stranger holds only its own handshake thread (10 s): the open is not
        // delayed by it.
        assert!(opened < Duration::from_secs(5), "open took {opened:?}");
    });
    println!("STRANGER-CHILD-OK");
}

#[test]
fn strangers_are_refused_logged_and_do_not_stall_the_open() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "stranger_child",
            "--ignored",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("STRANGER-CHILD-OK"),
        "{so}\n{se}"
    );
    let refusals: Vec<&str> = se
        .lines()
        .filter(|l| {
            l.starts_with("WARN mad_via::setup:")
                && l.contains("refused connection from 127.0.0.1:")
        })
        .collect();
    assert!(
        refusals.iter().any(|l| l.contains("MADVIA02")),
        "the HTTP stranger is refused for its magic:\n{se}"
    );
    assert!(
        refusals.iter().any(|l| l.contains("bad proof")),
        "the forger is refused for its proof:\n{se}"
    );
    eprintln!("{se}");
}
