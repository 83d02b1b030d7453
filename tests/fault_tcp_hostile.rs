//! A hostile or broken peer on a tcp channel: strangers at the listener during setup, and
//! garbage on an authenticated connection.
//!
//! Rank 0 is a real `Session` with the tcp driver; rank 1 is played by hand: it takes part in
//! the bootstrap allgathers (so it learns rank 0's listener address), lets strangers knock
//! first (HTTP request, bad proof, a hello claiming rank 0, a silent connection), then does the
//! real handshake with the session secret and writes whatever the case wants.
//!
//! The stranger test runs in a child process (this test binary re-executed, with
//! `MAD_LOG=mad_tcp=warn` and the tools' subscriber, [`madeleine::init_logging`]) so that rank
//! 0's `tracing` warnings can be checked on its stderr.

#![cfg(feature = "tcp")]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mad_core::auth::{self, Secret};
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::driver::Driver;
use mad_core::error::{PieceDesc, PieceOrEnd};
use mad_core::wire::{encode_desc, encode_frame, encode_header, Frame, Header};
use mad_core::{ChannelConfig, Error, RecvMode, SendMode, Session};
use mad_tcp::handshake::{self, Hello};
use mad_tcp::TcpDriver;

/// Bound on every wait of these tests.
const LIMIT: Duration = Duration::from_secs(20);

/// Play rank 1 of channel `name` up to a connection rank 0 has accepted. `strangers` first.
fn fake_rank1(b: &ThreadBootstrap, name: &str, spec: &str, strangers: bool) -> TcpStream {
    let cfg = ChannelConfig::parse(name, spec).unwrap();
    let fp = TcpDriver::new().tm_table(&cfg).unwrap().fingerprint();
    let core = format!("tcp|{}|{fp:016x}", cfg.adapter.as_deref().unwrap_or(""));
    b.allgather(&format!("chan/{name}/core"), core.as_bytes())
        .unwrap();
    let all = b
        .allgather(&format!("chan/{name}/tcp/addr"), b"127.0.0.1:9")
        .unwrap();
    let addr: SocketAddr = std::str::from_utf8(&all[0]).unwrap().parse().unwrap();
    if strangers {
        knock(addr, name, b.secret());
        // The listener is bound to the configured adapter (127.0.0.1 by default), not to
        // every address: another loopback address on the same port is refused by the kernel.
        let other = SocketAddr::new("127.0.0.2".parse().unwrap(), addr.port());
        let e = TcpStream::connect_timeout(&other, LIMIT).expect_err("listener on 0.0.0.0?");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    }
    let st = handshake_as(addr, name, b.secret(), 1, fp).expect("real handshake accepted");
    vote(b, name);
    st
}

/// The engine's closing collective of an open (every rank's open succeeded).
fn vote(b: &ThreadBootstrap, name: &str) {
    b.allgather(&format!("chan/{name}/open-ok"), &[1]).unwrap();
}

/// Connect and run the connector's side of the handshake; `Err` if rank 0 closed instead of
/// replying.
fn handshake_as(
    addr: SocketAddr,
    name: &str,
    secret: &Secret,
    rank: u32,
    fp: u64,
) -> std::io::Result<TcpStream> {
    let mut st = TcpStream::connect_timeout(&addr, LIMIT)?;
    st.set_read_timeout(Some(LIMIT))?;
    let mut cb = [0u8; handshake::CHALLENGE_LEN];
    st.read_exact(&mut cb)?;
    let ch = handshake::decode_challenge(&cb).unwrap();
    let nonce_c = auth::nonce().unwrap();
    let ctx = handshake::context(name, rank, 0);
    let hello = Hello {
        rank,
        fingerprint: fp,
        nonce_c,
        proof: secret.proof(b"mad-tcp-connect", &ch.nonce_a, &nonce_c, &ctx),
        channel: name.to_string(),
    };
    st.write_all(&handshake::encode_hello(&hello).unwrap())?;
    let mut rb = [0u8; handshake::REPLY_LEN];
    st.read_exact(&mut rb)?;
    let reply = handshake::decode_reply(&rb).unwrap();
    assert!(secret.verify(b"mad-tcp-accept", &ch.nonce_a, &nonce_c, &ctx, &reply.proof));
    Ok(st)
}

/// Strangers at rank 0's listener: each must be closed without a reply.
fn knock(addr: SocketAddr, name: &str, secret: &Secret) {
    // 1. An HTTP client.
    let mut st = TcpStream::connect_timeout(&addr, LIMIT).unwrap();
    st.set_read_timeout(Some(LIMIT)).unwrap();
    let _ = st.write_all(b"GET / HTTP/1.0\r\n\r\n");
    // Half-close: the acceptor sees end of stream inside the hello. (Without it the acceptor
    // waits for the 68-byte fixed hello until its 10 s handshake limit; see RELIABILITY.md.)
    let _ = st.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    let _ = st.read_to_end(&mut sink);
    assert!(
        sink.len() <= handshake::CHALLENGE_LEN,
        "answered an HTTP client: {sink:?}"
    );
    // 2. Right protocol, wrong secret.
    let wrong = Secret::from_bytes([0x5a; auth::SECRET_LEN]);
    let fp = 0;
    assert!(
        handshake_as(addr, name, &wrong, 1, fp).is_err(),
        "wrong secret accepted"
    );
    // 3. Right secret, but claims to be rank 0 (a lower rank never connects).
    assert!(
        handshake_as(addr, name, secret, 0, fp).is_err(),
        "rank 0 impersonation accepted"
    );
    // 4. A silent connection that is left open while the real rank connects.
    let silent = TcpStream::connect_timeout(&addr, LIMIT).unwrap();
    std::mem::forget(silent);
}

/// Rank 0: open channel `name` and hand back what `body` returns, or the open's error.
fn rank0<T: Send + 'static>(
    b: ThreadBootstrap,
    name: &'static str,
    spec: &'static str,
    body: impl FnOnce(&mad_core::Channel) -> T + Send + 'static,
) -> mpsc::Receiver<Result<T, Error>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = (|| {
            let s = Session::builder()
                .driver(TcpDriver::new())
                .bootstrap(Box::new(b))
                .build()?;
            let ch = s.open_channel_with(ChannelConfig::parse(name, spec)?)?;
            Ok(body(&ch))
        })();
        let _ = tx.send(r);
    });
    rx
}

/// Send `bytes` from the fake rank 1 after the handshake, then let `recv` run on rank 0;
/// returns its result and how long it took after the bytes left.
fn garbage_case(
    name: &'static str,
    spec: &'static str,
    bytes: Vec<u8>,
    close: bool,
    recv: fn(&mad_core::Channel) -> Result<(), Error>,
) -> (Result<(), Error>, Duration) {
    let mut bs = ThreadBootstrap::group(2);
    let b1 = bs.pop().unwrap();
    let b0 = bs.pop().unwrap();
    let rx = rank0(b0, name, spec, recv);
    let mut st = fake_rank1(&b1, name, spec, false);
    let t = Instant::now();
    // The receiver may reset the connection before it read everything (garbage): fine.
    let _ = st.write_all(&bytes);
    if close {
        drop(st);
        let r = rx.recv_timeout(LIMIT).expect("rank 0 hung");
        (r.expect("open"), t.elapsed())
    } else {
        let r = rx.recv_timeout(LIMIT).expect("rank 0 hung");
        drop(st);
        (r.expect("open"), t.elapsed())
    }
}

fn recv_small(ch: &mad_core::Channel) -> Result<(), Error> {
    let mut u = ch.begin_unpacking()?;
    let _: u64 = u.unpack_value()?;
    u.end_unpacking()
}

fn recv_big(ch: &mad_core::Channel) -> Result<(), Error> {
    let mut u = ch.begin_unpacking()?;
    let mut buf = vec![0u8; 1 << 20];
    u.unpack(&mut buf, SendMode::Cheaper)?;
    u.end_unpacking()
}

fn is_protocol(e: &Error) -> bool {
    matches!(e, Error::Protocol { rank: 1, .. })
}

#[test]
fn garbage_header_is_a_protocol_error() {
    let (r, t) = garbage_case(
        "g1",
        "tcp",
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        false,
        recv_small,
    );
    let e = r.expect_err("garbage accepted as a message");
    assert!(is_protocol(&e), "{e}");
    assert!(t < Duration::from_secs(5), "{t:?}");
}

#[test]
fn random_bytes_are_a_protocol_error() {
    // xorshift: 1 MiB of noise, no allocation proportional to anything it claims.
    let mut x = 0x9e3779b97f4a7c15u64;
    let bytes: Vec<u8> = (0..1 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let (r, _) = garbage_case("g2", "tcp", bytes, false, recv_big);
    let e = r.expect_err("noise accepted as a message");
    assert!(is_protocol(&e), "{e}");
}

#[test]
fn wrong_version_and_flags_are_protocol_errors() {
    for bad in [b"M2\x09\x00\0\0\0\0", b"M2\x01\xfe\0\0\0\0"] {
        let (r, _) = garbage_case("g3", "tcp", bad.to_vec(), false, recv_small);
        let e = r.expect_err("bad header accepted");
        assert!(is_protocol(&e), "{e}");
    }
}

#[test]
fn huge_length_in_checked_descriptor_is_a_mismatch_not_an_allocation() {
    // A checked-mode message whose first descriptor claims a 2^60-byte piece.
    let mut bytes = encode_header(Header {
        checked: true,
        seq: 0,
    })
    .to_vec();
    bytes.extend_from_slice(&encode_desc(PieceOrEnd::Piece(PieceDesc {
        index: 0,
        len: 1 << 60,
        send: SendMode::Cheaper,
        recv: RecvMode::Cheaper,
    })));
    let (r, t) = garbage_case("g4", "tcp,checked=true", bytes, false, recv_small);
    let e = r.expect_err("lying descriptor accepted");
    assert!(
        matches!(e, Error::UnpackMismatch { rank: 1, .. }) || is_protocol(&e),
        "{e}"
    );
    assert!(t < Duration::from_secs(5), "{t:?}");
}

#[test]
fn truncated_message_then_close_is_an_error_not_a_short_message() {
    // A valid header, 100 of the 1 MiB the receiver expects, then the connection closes.
    let mut bytes = encode_header(Header {
        checked: false,
        seq: 0,
    })
    .to_vec();
    bytes.extend_from_slice(&[0xab; 100]);
    let (r, t) = garbage_case("g5", "tcp", bytes, true, recv_big);
    let e = r.expect_err("truncated message accepted");
    assert!(
        matches!(
            e,
            Error::PeerClosed { rank: 1 } | Error::ConnectionLost { rank: 1, .. }
        ) || is_protocol(&e),
        "{e}"
    );
    assert!(t < Duration::from_secs(5), "{t:?}");
}

/// A well-formed unchecked message of one 8-byte piece, as the engine writes it: header,
/// piece frame, the value, end frame.
fn unchecked_u64_message(v: u64) -> Vec<u8> {
    let mut bytes = encode_header(Header {
        checked: false,
        seq: 0,
    })
    .to_vec();
    bytes.extend_from_slice(&encode_frame(Frame::Piece { tm: 0, len: 8 }));
    bytes.extend_from_slice(&v.to_le_bytes());
    bytes.extend_from_slice(&encode_frame(Frame::End { pieces: 1 }));
    bytes
}

#[test]
fn valid_bytes_from_the_fake_rank_are_received() {
    // The control: the hand-made rank's well-formed message is accepted, so the failures
    // above are caused by the garbage and not by the harness.
    let bytes = unchecked_u64_message(42);
    let (r, _) = garbage_case("g6", "tcp", bytes, false, recv_small);
    r.expect("well-formed message refused");
}

#[test]
#[ignore = "child process of strangers_are_refused_and_logged"]
fn stranger_child() {
    assert!(
        madeleine::init_logging(),
        "a subscriber was already installed"
    );
    let mut bs = ThreadBootstrap::group(2);
    let b1 = bs.pop().unwrap();
    let b0 = bs.pop().unwrap();
    let rx = rank0(b0, "s", "tcp", |ch| {
        let mut u = ch.begin_unpacking()?;
        let v: u64 = u.unpack_value()?;
        u.end_unpacking()?;
        Ok::<u64, Error>(v)
    });
    let mut st = fake_rank1(&b1, "s", "tcp", true);
    let bytes = unchecked_u64_message(4242);
    st.write_all(&bytes).unwrap();
    let v = rx.recv_timeout(LIMIT).expect("rank 0 hung").expect("open");
    assert_eq!(v.expect("message from the real rank 1"), 4242);
    println!("STRANGER-CHILD-OK");
}

#[test]
fn strangers_are_refused_and_logged() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "stranger_child",
            "--ignored",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MAD_LOG", "mad_tcp=warn")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("STRANGER-CHILD-OK"),
        "{so}\n{se}"
    );
    // One `warn` event of target `mad_tcp::setup` per refused stranger, with its fields.
    let refusals = se
        .lines()
        .filter(|l| {
            l.contains(" WARN ")
                && l.contains("mad_tcp::setup")
                && l.contains("refused connection from 127.0.0.1:")
                && l.contains("on channel s: ")
        })
        .count();
    assert!(refusals >= 3, "expected 3 logged refusals:\n{se}");
    // The filter keeps mad_tcp's warnings only (no debug handshake events).
    assert!(
        !se.contains("DEBUG"),
        "MAD_LOG=mad_tcp=warn printed debug events:\n{se}"
    );
    eprintln!("{se}");
}

/// Reproduction (fails today, see RELIABILITY.md finding 1): a stranger that sends a short
/// non-hello (`GET / HTTP/1.0`, 18 bytes) and keeps the connection open is refused only when
/// the acceptor's 10 s handshake read times out, and the log says `reading hello: Resource
/// temporarily unavailable` instead of naming the bad magic visible after 4 bytes. Expected:
/// closed within 3 s, as soon as the 6-byte head is known to be wrong.
#[test]
fn short_non_hello_is_refused_at_once() {
    let mut bs = ThreadBootstrap::group(2);
    let b1 = bs.pop().unwrap();
    let b0 = bs.pop().unwrap();
    let rx = rank0(b0, "short", "tcp", |_ch| ());
    let cfg = ChannelConfig::parse("short", "tcp").unwrap();
    let fp = TcpDriver::new().tm_table(&cfg).unwrap().fingerprint();
    b1.allgather("chan/short/core", format!("tcp||{fp:016x}").as_bytes())
        .unwrap();
    let all = b1.allgather("chan/short/tcp/addr", b"127.0.0.1:9").unwrap();
    let addr: SocketAddr = std::str::from_utf8(&all[0]).unwrap().parse().unwrap();
    let mut st = TcpStream::connect_timeout(&addr, LIMIT).unwrap();
    st.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    st.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let t = Instant::now();
    let mut sink = Vec::new();
    let r = st.read_to_end(&mut sink);
    // Let rank 0's open finish whatever happened.
    let _real = handshake_as(addr, "short", b1.secret(), 1, fp).unwrap();
    vote(&b1, "short");
    rx.recv_timeout(LIMIT).expect("rank 0 hung").expect("open");
    // Closed at once: end of stream, or a reset (the acceptor closed with the rest of the
    // stranger's bytes unread). A timeout means it was still connected.
    let closed = match &r {
        Ok(_) => true,
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
        ),
    };
    assert!(
        closed,
        "stranger still connected {:?} after its bad head ({r:?})",
        t.elapsed()
    );
    eprintln!("short stranger closed {:?} after its bad head", t.elapsed());
}
