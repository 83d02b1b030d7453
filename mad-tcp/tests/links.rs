//! Driver-level tests: the tcp links used directly through the driver contract, with real
//! sockets between threads (no engine involved).

mod common;

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use mad_core::auth::Secret;
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::driver::{AbortOutcome, LinkPair, RxLink, TxLink};
use mad_core::{ChannelConfig, Error};
use mad_tcp::handshake;

fn cfg(name: &str) -> ChannelConfig {
    ChannelConfig::parse(name, "tcp:127.0.0.1,connect_timeout_ms=10000").unwrap()
}

/// A tiny message format for these tests: an 8-byte length through TM 0, then the body
/// through TM 0 (copy) if small, else TM 1 (gather).
fn send_msg(tx: &mut dyn TxLink, body: &[u8]) {
    tx.begin_message().unwrap();
    copy_in(tx, &(body.len() as u64).to_le_bytes());
    if body.len() <= mad_tcp::DEFAULT_SMALL_MAX {
        copy_in(tx, body);
        drive(|| tx.commit(0)).unwrap();
    } else {
        drive(|| tx.commit(0)).unwrap();
        drive(|| tx.send_refs(1, &[IoSlice::new(body)])).unwrap();
    }
    drive(|| tx.end_message()).unwrap();
}

fn copy_in(tx: &mut dyn TxLink, mut data: &[u8]) {
    while !data.is_empty() {
        let mut n = 0;
        drive(|| {
            tx.with_buffer(0, data.len(), &mut |b| {
                n = b.len().min(data.len());
                b[..n].copy_from_slice(&data[..n]);
                n
            })
        })
        .unwrap();
        data = &data[n..];
    }
}

fn copy_out(rx: &mut dyn RxLink, out: &mut [u8]) -> mad_core::Result<()> {
    let mut done = 0;
    while done < out.len() {
        drive(|| {
            rx.with_data(0, out.len() - done, &mut |b| {
                let n = b.len().min(out.len() - done);
                out[done..done + n].copy_from_slice(&b[..n]);
                done += n;
                n
            })
        })?;
    }
    Ok(())
}

fn recv_msg(rx: &mut dyn RxLink) -> mad_core::Result<Vec<u8>> {
    drive(|| rx.poll_message())?;
    let mut len = [0u8; 8];
    copy_out(rx, &mut len)?;
    let len = u64::from_le_bytes(len) as usize;
    let mut body = vec![0u8; len];
    if len <= mad_tcp::DEFAULT_SMALL_MAX {
        copy_out(rx, &mut body)?;
    } else {
        drive(|| rx.recv_refs(1, &mut [IoSliceMut::new(&mut body)]))?;
    }
    rx.end_message()?;
    Ok(body)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn take(ch: &mut mad_core::driver::OpenedChannel, r: usize) -> LinkPair {
    ch.links[r].take().expect("link to peer")
}

#[test]
fn ping_pong_all_sizes() {
    let mut chans = open_group(2, cfg("pingpong"));
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let sizes = [
        0usize,
        1,
        8,
        4095,
        4096,
        4097,
        4600,
        8191,
        8192,
        8193,
        8800,
        65535,
        65536,
        65537,
        1 << 20,
        8 << 20,
    ];
    let t = thread::spawn(move || {
        for &n in &sizes {
            let m = recv_msg(&mut *b.rx).unwrap();
            assert_eq!(m.len(), n);
            send_msg(&mut *b.tx, &m);
        }
    });
    for &n in &sizes {
        let m = pattern(n, n as u8);
        send_msg(&mut *a.tx, &m);
        assert_eq!(recv_msg(&mut *a.rx).unwrap(), m, "size {n}");
    }
    t.join().unwrap();
}

#[test]
fn many_small_pieces_one_message() {
    // 30 000 pieces of 7 bytes: crosses the 64 KiB buffer several times.
    let mut chans = open_group(2, cfg("pieces"));
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let t = thread::spawn(move || {
        drive(|| b.rx.poll_message()).unwrap();
        for i in 0..30_000u32 {
            let mut p = [0u8; 7];
            copy_out(&mut *b.rx, &mut p).unwrap();
            assert_eq!(&p[..4], &i.to_le_bytes());
        }
    });
    a.tx.begin_message().unwrap();
    for i in 0..30_000u32 {
        let mut p = [0xabu8; 7];
        p[..4].copy_from_slice(&i.to_le_bytes());
        copy_in(&mut *a.tx, &p);
    }
    drive(|| a.tx.end_message()).unwrap();
    t.join().unwrap();
}

#[test]
fn gather_group_of_many_slices_and_huge_piece() {
    let mut chans = open_group(2, cfg("gather"));
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let parts: Vec<Vec<u8>> = (0..1500).map(|i| pattern(100 + i % 50, i as u8)).collect();
    let big = pattern(64 << 20, 3);
    let expect = parts.clone();
    let big2 = big.clone();
    let t = thread::spawn(move || {
        drive(|| b.rx.poll_message()).unwrap();
        let mut hdr = [0u8; 3];
        copy_out(&mut *b.rx, &mut hdr).unwrap();
        assert_eq!(&hdr, b"hdr");
        let mut got: Vec<Vec<u8>> = expect.iter().map(|p| vec![0u8; p.len()]).collect();
        {
            let mut iov: Vec<IoSliceMut<'_>> = got.iter_mut().map(|g| IoSliceMut::new(g)).collect();
            drive(|| b.rx.recv_refs(1, &mut iov)).unwrap();
        }
        assert_eq!(got, expect);
        let mut big = vec![0u8; 64 << 20];
        drive(|| b.rx.recv_refs(1, &mut [IoSliceMut::new(&mut big)])).unwrap();
        assert!(big == big2, "64 MiB piece corrupted");
    });
    a.tx.begin_message().unwrap();
    copy_in(&mut *a.tx, b"hdr");
    // 1500 slices exceed IOV_MAX: the driver must loop.
    let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    drive(|| a.tx.send_refs(1, &iov)).unwrap();
    drive(|| a.tx.send_refs(1, &[IoSlice::new(&big)])).unwrap();
    drive(|| a.tx.end_message()).unwrap();
    t.join().unwrap();
}

#[test]
fn abort_before_anything_left_is_discarded() {
    let mut chans = open_group(2, cfg("abort1"));
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    a.tx.begin_message().unwrap();
    copy_in(&mut *a.tx, b"never sent");
    assert_eq!(a.tx.abort_message(), AbortOutcome::Discarded);
    send_msg(&mut *a.tx, b"second");
    assert_eq!(recv_msg(&mut *b.rx).unwrap(), b"second");
}

#[test]
fn abort_midway_tears_the_connection_down_for_the_peer() {
    let mut chans = open_group(2, cfg("abort2"));
    let mut b = take(&mut chans[1], 0);
    let mut a = take(&mut chans[0], 1);
    let big = pattern(32 << 20, 1);
    a.tx.begin_message().unwrap();
    copy_in(&mut *a.tx, &(big.len() as u64).to_le_bytes());
    // Nobody reads yet: the socket fills and send_refs is Pending with part of it gone.
    let mut pending = false;
    for _ in 0..100 {
        if a.tx
            .send_refs(1, &[IoSlice::new(&big)])
            .unwrap()
            .is_pending()
        {
            pending = true;
            break;
        }
    }
    assert!(pending, "32 MiB fit in the socket buffers?");
    assert_eq!(a.tx.abort_message(), AbortOutcome::Broken);
    assert!(matches!(a.tx.begin_message(), Err(Error::Poisoned { .. })));
    // The connection was reset: the peer's receive fails (end of stream or reset, depending
    // on whether the FIN got out), and so do its sends and this side's receive half.
    let r = recv_msg(&mut *b.rx);
    assert!(
        matches!(
            r,
            Err(Error::PeerClosed { rank: 0 } | Error::ConnectionLost { rank: 0, .. })
        ),
        "{r:?}"
    );
    b.tx.begin_message().ok();
    assert!(copy_in_try(&mut *b.tx, &pattern(1 << 20, 2)).is_err());
    assert!(matches!(
        a.rx.poll_message(),
        Err(Error::Poisoned { rank: 1, .. })
    ));
}

#[test]
fn peer_closing_leaves_other_connections_working() {
    let mut chans = open_group(3, cfg("close"));
    let c2 = chans.pop().unwrap();
    let mut c1 = chans.pop().unwrap();
    let mut c0 = chans.pop().unwrap();
    drop(c2); // rank 2 goes away
    let mut to2 = take(&mut c0, 2);
    let r = drive(|| to2.rx.poll_message());
    assert!(matches!(r, Err(Error::PeerClosed { rank: 2 })), "{r:?}");
    // Sending to the dead peer fails in bounded time (EPIPE/ECONNRESET) or is absorbed;
    // it never hangs and never raises SIGPIPE.
    let big = pattern(1 << 20, 0);
    let mut failed = false;
    for _ in 0..50 {
        to2.tx.begin_message().ok();
        copy_in_try(&mut *to2.tx, &big).map_or_else(|_| failed = true, |_| ());
        if failed {
            break;
        }
        thread::sleep(Duration::from_millis(2));
    }
    assert!(failed, "writes to a closed peer kept succeeding");
    // Ranks 0 and 1 still talk.
    let mut a = take(&mut c0, 1);
    let mut b = take(&mut c1, 0);
    send_msg(&mut *a.tx, b"still here");
    assert_eq!(recv_msg(&mut *b.rx).unwrap(), b"still here");
}

fn copy_in_try(tx: &mut dyn TxLink, body: &[u8]) -> mad_core::Result<()> {
    let start = Instant::now();
    loop {
        match tx.send_refs(1, &[IoSlice::new(body)])? {
            Poll::Ready(()) => return Ok(()),
            Poll::Pending if start.elapsed() > Duration::from_secs(5) => return Ok(()),
            Poll::Pending => thread::yield_now(),
        }
    }
}

#[test]
fn any_source_through_incoming() {
    let n = 4;
    let mut chans = open_group(n, cfg("anysrc"));
    let mut senders = Vec::new();
    for (r, ch) in chans.iter_mut().enumerate().skip(1) {
        let mut l = take(ch, 0);
        senders.push(thread::spawn(move || {
            for k in 0..20u8 {
                send_msg(&mut *l.tx, &[r as u8, k]);
            }
            l // keep the connection open until the receiver is done
        }));
    }
    let mut c0 = chans.swap_remove(0);
    let mut links: Vec<Option<LinkPair>> = std::mem::take(&mut c0.links);
    let mut next = vec![0u8; n];
    let mut got = 0;
    let start = Instant::now();
    while got < 20 * (n - 1) {
        assert!(start.elapsed() < LIMIT);
        c0.incoming.wait(Duration::from_millis(100)).unwrap();
        let mut ready = Vec::new();
        c0.incoming.poll(&mut |r| ready.push(r)).unwrap();
        for r in ready {
            let l = links[r].as_mut().unwrap();
            while l.rx.poll_message().unwrap().is_ready() {
                let m = recv_msg(&mut *l.rx).unwrap();
                assert_eq!(m, [r as u8, next[r]]);
                next[r] += 1;
                got += 1;
            }
        }
    }
    for s in senders {
        drop(s.join().unwrap());
    }
    // Wake-ups: wake() ends a wait early.
    let t0 = Instant::now();
    c0.incoming.wake();
    c0.incoming.wait(Duration::from_secs(5)).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(4));
}

#[test]
fn sixteen_ranks_all_to_all() {
    let n = 16;
    let chans = open_group(n, cfg("sixteen"));
    let handles: Vec<_> = chans
        .into_iter()
        .enumerate()
        .map(|(me, mut ch)| {
            thread::spawn(move || {
                for r in 0..n {
                    if r != me {
                        let l = ch.links[r].as_mut().unwrap();
                        send_msg(&mut *l.tx, &[me as u8, r as u8]);
                    }
                }
                for r in 0..n {
                    if r != me {
                        let l = ch.links[r].as_mut().unwrap();
                        assert_eq!(recv_msg(&mut *l.rx).unwrap(), [r as u8, me as u8]);
                    }
                }
                ch
            })
        })
        .collect();
    for h in handles {
        drop(h.join().unwrap());
    }
}

fn boxed(bs: Vec<common::Wrapped>) -> Vec<Box<dyn Bootstrap>> {
    bs.into_iter()
        .map(|b| Box::new(b) as Box<dyn Bootstrap>)
        .collect()
}

#[test]
fn strangers_are_refused_and_the_channel_still_opens() {
    let group = ThreadBootstrap::group(2);
    let strangers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = strangers.clone();
    let boots = vec![
        common::Wrapped {
            inner: group[0].clone(),
            secret: None,
            after_gather: Some(Box::new(move |all: &[Vec<u8>]| {
                let addr: std::net::SocketAddr =
                    std::str::from_utf8(&all[0]).unwrap().parse().unwrap();
                // A silent one, a garbage one, and one with a wrong secret.
                let silent = TcpStream::connect(addr).unwrap();
                let mut garbage = TcpStream::connect(addr).unwrap();
                garbage.write_all(&[0x55; 200]).unwrap();
                let liar = thread::spawn(move || wrong_secret_handshake(addr));
                s2.lock().unwrap().push((silent, garbage, liar));
            })),
        },
        common::Wrapped {
            inner: group[1].clone(),
            secret: None,
            after_gather: None,
        },
    ];
    let tables = (0..2).map(|_| mad_tcp::tm_table(4096).unwrap()).collect();
    let t0 = Instant::now();
    let mut res = common::open_with(boxed(boots), cfg("strangers"), tables);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "a silent stranger delayed the open"
    );
    let mut c1 = res.pop().unwrap().unwrap();
    let mut c0 = res.pop().unwrap().unwrap();
    let (_silent, _garbage, liar) = strangers.lock().unwrap().pop().unwrap();
    assert!(
        liar.join().unwrap(),
        "the stranger with a wrong secret was not refused"
    );
    let mut a = take(&mut c1, 0);
    let mut b = take(&mut c0, 1);
    send_msg(&mut *a.tx, b"ok");
    assert_eq!(recv_msg(&mut *b.rx).unwrap(), b"ok");
}

/// Connect as rank 1 with a wrong secret; true if the acceptor closed without a reply.
fn wrong_secret_handshake(addr: std::net::SocketAddr) -> bool {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut cb = [0u8; handshake::CHALLENGE_LEN];
    s.read_exact(&mut cb).unwrap();
    let ch = handshake::decode_challenge(&cb).unwrap();
    let wrong = Secret::from_bytes([1; 32]);
    let nonce_c = [2u8; 16];
    let ctx = handshake::context("strangers", 1, 0);
    let h = handshake::Hello {
        rank: 1,
        fingerprint: mad_tcp::tm_table(4096).unwrap().fingerprint(),
        nonce_c,
        proof: wrong.proof(b"mad-tcp-connect", &ch.nonce_a, &nonce_c, &ctx),
        channel: "strangers".into(),
    };
    s.write_all(&handshake::encode_hello(&h).unwrap()).unwrap();
    let mut rb = [0u8; handshake::REPLY_LEN];
    s.read_exact(&mut rb).is_err()
}

#[test]
fn wrong_secret_fails_with_auth_and_the_acceptor_times_out_naming_the_rank() {
    let group = ThreadBootstrap::group(2);
    let boots = vec![
        common::Wrapped {
            inner: group[0].clone(),
            secret: None,
            after_gather: None,
        },
        common::Wrapped {
            inner: group[1].clone(),
            secret: Some(Secret::from_bytes([9; 32])),
            after_gather: None,
        },
    ];
    let tables = (0..2).map(|_| mad_tcp::tm_table(4096).unwrap()).collect();
    let c = ChannelConfig::parse("badsecret", "tcp,connect_timeout_ms=1500").unwrap();
    let res = common::open_with(boxed(boots), c, tables);
    let e1 = res[1]
        .as_ref()
        .expect_err("rank 1 opened with a wrong secret");
    assert!(matches!(e1, Error::Auth(_)), "{e1}");
    let e0 = res[0].as_ref().expect_err("rank 0 opened without its peer");
    assert!(e0.to_string().contains("[1]"), "{e0}");
}

#[test]
fn different_tables_are_bad_config_on_both_sides() {
    let boots: Vec<Box<dyn Bootstrap>> = ThreadBootstrap::group(2)
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn Bootstrap>)
        .collect();
    let tables = vec![
        mad_tcp::tm_table(4096).unwrap(),
        mad_tcp::tm_table(8192).unwrap(),
    ];
    let c = ChannelConfig::parse("fp", "tcp,connect_timeout_ms=3000").unwrap();
    for r in common::open_with(boots, c, tables) {
        let e = r.expect_err("mismatched tables opened");
        assert!(matches!(e, Error::BadConfig(_)), "{e}");
    }
}

#[test]
fn adapters() {
    assert_eq!(
        mad_tcp::resolve_adapter(None).unwrap().to_string(),
        "127.0.0.1"
    );
    assert_eq!(
        mad_tcp::resolve_adapter(Some("lo")).unwrap().to_string(),
        "127.0.0.1"
    );
    assert!(matches!(
        mad_tcp::resolve_adapter(Some("no-such-if0")),
        Err(Error::BadConfig(_))
    ));
    let bad = ChannelConfig::parse("x", "tcp,liveness_ms=soon").unwrap();
    assert!(mad_tcp::TcpOptions::from_config(&bad).is_err());
    let bad = ChannelConfig::parse("x", "tcp,buffer=1").unwrap();
    assert!(mad_tcp::TcpOptions::from_config(&bad).is_err());
    let ok = ChannelConfig::parse("x", "tcp:lo,buffer=16k,connect_timeout_ms=5").unwrap();
    let o = mad_tcp::TcpOptions::from_config(&ok).unwrap();
    assert_eq!(o.buffer, 16384);
    assert_eq!(o.connect_timeout, Duration::from_millis(5));
}

#[test]
fn single_rank_channel_opens() {
    let chans = open_group(1, cfg("solo"));
    assert!(chans[0].links.iter().all(Option::is_none));
}

/// 64 ranks in one process: 4032 sockets, descriptor limit raised if needed. Ignored by
/// default (heavy on a 2-core machine); run with `--ignored`.
#[test]
#[ignore]
fn sixty_four_ranks_open() {
    let t0 = Instant::now();
    let chans = open_group(64, cfg("sixtyfour"));
    assert!(chans
        .iter()
        .all(|c| c.links.iter().filter(|l| l.is_some()).count() == 63));
    eprintln!("64-rank all-to-all setup: {:?}", t0.elapsed());
}

#[test]
fn block_mode_gather_receive_is_bounded_by_the_operation_timeout() {
    use mad_core::progress::{ProgressMode, ProgressPolicy};
    let boots: Vec<Box<dyn Bootstrap>> = ThreadBootstrap::group(2)
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn Bootstrap>)
        .collect();
    let tables = (0..2)
        .map(|_| mad_tcp::tm_table(mad_tcp::DEFAULT_SMALL_MAX).unwrap())
        .collect();
    let mut policy = ProgressPolicy::default();
    policy.mode = ProgressMode::Block;
    policy.op_timeout = Some(Duration::from_millis(300));
    let mut res = common::open_with_policy(boots, cfg("blocktimeout"), tables, policy);
    let mut c1 = res.pop().unwrap().unwrap();
    let mut c0 = res.pop().unwrap().unwrap();
    let mut a = take(&mut c0, 1);
    let mut b = take(&mut c1, 0);
    // Half of a 1 MiB gather piece, then silence.
    let half = pattern(512 << 10, 9);
    a.tx.begin_message().unwrap();
    copy_in(&mut *a.tx, b"hdr");
    drive(|| a.tx.send_refs(1, &[IoSlice::new(&half)])).unwrap();
    drive(|| a.tx.end_message()).unwrap();
    drive(|| b.rx.poll_message()).unwrap();
    let mut hdr = [0u8; 3];
    copy_out(&mut *b.rx, &mut hdr).unwrap();
    let mut body = vec![0u8; 1 << 20];
    let t0 = Instant::now();
    let mut iov = [IoSliceMut::new(&mut body)];
    // The blocking receive takes what there is and gives up at the operation timeout.
    assert!(
        b.rx.recv_refs(1, &mut iov).unwrap().is_pending(),
        "half a piece reported complete"
    );
    assert!(b.rx.recv_refs(1, &mut iov).unwrap().is_pending());
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "blocked {:?}",
        t0.elapsed()
    );
    // The rest arrives: the same call completes with the bytes in order.
    drive(|| a.tx.send_refs(1, &[IoSlice::new(&half)])).unwrap();
    drive(|| b.rx.recv_refs(1, &mut iov)).unwrap();
    assert_eq!(&body[..512 << 10], &half[..]);
    assert_eq!(&body[512 << 10..], &half[..]);
}
