//! Misuse of the pack/unpack API, each with a defined and tested outcome, on tcp and shm
//! (two ranks as threads of this process, real sockets and real shared memory).
//!
//! | misuse | checked mode | unchecked mode |
//! |---|---|---|
//! | unpack sequence differs (size) | `UnpackMismatch` at the piece | undetectable inside the message; the next message's header is misread → `Protocol` (bad magic) |
//! | unpack smaller than sent | `UnpackMismatch` | next `begin_unpacking` → `Protocol` |
//! | unpack larger than sent, nothing follows | `UnpackMismatch` | waits for bytes; with `timeout_ms` → `Timeout` |
//! | `end_unpacking` before all pieces | `UnpackMismatch` (end vs piece) | next `begin_unpacking` → `Protocol` |
//! | `Packer` dropped midway | the peer never sees a partial message as whole: next message intact, or an error | same |

#![cfg(all(feature = "tcp", feature = "shm"))]

use std::sync::mpsc;
use std::time::Duration;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{Channel, ChannelConfig, Error, RecvMode, SendMode, Session};

const LIMIT: Duration = Duration::from_secs(30);
const SPECS: [&str; 2] = ["tcp", "shm"];

/// Run `f0` on rank 0 and `f1` on rank 1 of a fresh 2-rank session with channel `spec`;
/// both sessions stay open until both bodies have returned.
fn pair<A: Send + 'static, B: Send + 'static>(
    spec: &str,
    f0: fn(&Channel) -> A,
    f1: fn(&Channel) -> B,
) -> (A, B) {
    let bs = ThreadBootstrap::group(2);
    let (t0, r0) = mpsc::channel();
    let (t1, r1) = mpsc::channel();
    for b in bs {
        let spec = spec.to_string();
        let (t0, t1) = (t0.clone(), t1.clone());
        std::thread::spawn(move || {
            let s = Session::builder()
                .driver(mad_tcp::TcpDriver::new())
                .driver(mad_shm::ShmDriver::new())
                .bootstrap(Box::new(b))
                .build()
                .unwrap();
            let ch = s
                .open_channel_with(ChannelConfig::parse("misuse", &spec).unwrap())
                .unwrap();
            if s.rank() == 0 {
                let _ = t0.send(f0(&ch));
            } else {
                let _ = t1.send(f1(&ch));
            }
            let _ = s.bootstrap().barrier("misuse-end");
        });
    }
    let a = r0.recv_timeout(LIMIT).expect("rank 0 hung");
    let b = r1.recv_timeout(LIMIT).expect("rank 1 hung");
    (a, b)
}

fn send_u64_and(ch: &Channel, data: &[u8]) -> Result<(), Error> {
    let mut p = ch.begin_packing(1)?;
    p.pack_value(&(data.len() as u64), RecvMode::Express)?;
    p.pack(data, RecvMode::Cheaper)?;
    p.end_packing()
}

fn send_100_then_8(ch: &Channel) -> Result<(), Error> {
    send_u64_and(ch, &[0x11; 100])?;
    send_u64_and(ch, &[0x22; 8])
}

/// Unpack the length, then `n` bytes (whatever the length says), then the next message.
fn recv_n_then_next(ch: &Channel, n: usize) -> (Result<(), Error>, Result<(), Error>) {
    let first = (|| {
        let mut u = ch.begin_unpacking()?;
        let _: u64 = u.unpack_value()?;
        let mut buf = vec![0u8; n];
        u.unpack(&mut buf, SendMode::Cheaper)?;
        u.end_unpacking()
    })();
    let second = (|| {
        let mut u = ch.begin_unpacking()?;
        let len: u64 = u.unpack_value()?;
        let mut buf = vec![0u8; 8];
        u.unpack(&mut buf, SendMode::Cheaper)?;
        u.end_unpacking()?;
        if len != 8 || buf != [0x22; 8] {
            return Err(Error::Protocol {
                rank: 1,
                what: "second message garbled".into(),
            });
        }
        Ok(())
    })();
    (first, second)
}

fn mismatch(e: &Error) -> bool {
    matches!(e, Error::UnpackMismatch { rank: 0, .. })
}

#[test]
fn checked_smaller_and_larger_unpacks_are_mismatches() {
    for spec in SPECS {
        let spec_c = format!("{spec},checked=true");
        let (_, (first, _)) = pair(&spec_c, send_100_then_8, |ch| recv_n_then_next(ch, 50));
        let e = first.expect_err("smaller unpack accepted");
        assert!(mismatch(&e), "{spec}: {e}");
        let (_, (first, _)) = pair(&spec_c, send_100_then_8, |ch| recv_n_then_next(ch, 200));
        let e = first.expect_err("larger unpack accepted");
        assert!(mismatch(&e), "{spec}: {e}");
    }
}

#[test]
fn checked_mode_difference_is_a_mismatch() {
    for spec in SPECS {
        let (_, r) = pair(
            &format!("{spec},checked=true"),
            |ch| send_u64_and(ch, &[1; 100]),
            |ch| {
                let mut u = ch.begin_unpacking()?;
                let _: u64 = u.unpack_value()?;
                let mut buf = [0u8; 100];
                u.unpack(&mut buf, SendMode::Later)?; // sender used Cheaper
                u.end_unpacking()
            },
        );
        let e = r.expect_err("mode mismatch accepted");
        assert!(mismatch(&e), "{spec}: {e}");
    }
}

#[test]
fn checked_end_unpacking_early_is_a_mismatch() {
    for spec in SPECS {
        let (_, r) = pair(
            &format!("{spec},checked=true"),
            |ch| send_u64_and(ch, &[1; 100]),
            |ch| {
                let mut u = ch.begin_unpacking()?;
                let _: u64 = u.unpack_value()?;
                u.end_unpacking()
            },
        );
        let e = r.expect_err("early end accepted");
        assert!(mismatch(&e), "{spec}: {e}");
    }
}

#[test]
fn unchecked_smaller_unpack_fails_at_that_message() {
    for spec in SPECS {
        let (_, (first, second)) = pair(spec, send_100_then_8, |ch| recv_n_then_next(ch, 50));
        // The piece frame announced 100 bytes: the 50-byte unpack fails at once, and the
        // connection is finished (the next receive fails too, never reads leftovers).
        let e = first.expect_err("unchecked smaller unpack accepted");
        assert!(
            matches!(e, Error::Protocol { rank: 0, .. }),
            "{spec}: expected a protocol error, got {e}"
        );
        second.expect_err("a message after a failed one on the same connection");
    }
}

#[test]
fn unchecked_early_end_fails_the_next_message() {
    for spec in SPECS {
        let (_, r) = pair(spec, send_100_then_8, |ch| {
            let mut u = ch.begin_unpacking()?;
            let _: u64 = u.unpack_value()?;
            u.end_unpacking()?;
            let mut u = ch.begin_unpacking()?;
            let _: u64 = u.unpack_value()?;
            u.end_unpacking()
        });
        let e = r.expect_err("unread piece accepted as a message");
        assert!(matches!(e, Error::Protocol { rank: 0, .. }), "{spec}: {e}");
    }
}

#[test]
fn unchecked_larger_unpack_fails_at_once() {
    for spec in SPECS {
        let (_, r) = pair(
            &format!("{spec},timeout_ms=500"),
            |ch| send_u64_and(ch, &[1; 100]),
            |ch| {
                let mut u = ch.begin_unpacking()?;
                let _: u64 = u.unpack_value()?;
                let mut buf = vec![0u8; 200];
                u.unpack(&mut buf, SendMode::Cheaper)?;
                u.end_unpacking()
            },
        );
        let e = r.expect_err("short data returned as whole");
        assert!(matches!(e, Error::Protocol { rank: 0, .. }), "{spec}: {e}");
    }
}

/// Sender of the dropped-packer cases: a message of `[u64 = 1, len × 9]` whose `Packer` is
/// dropped without `end_packing`, then a whole `[u64 = 2, len × 0x22]`.
fn drop_then_send(ch: &Channel, len: usize) -> Result<(), Error> {
    let data = vec![9u8; len];
    {
        let mut p = ch.begin_packing(1)?;
        p.pack_value(&1u64, RecvMode::Express)?;
        p.pack(&data, RecvMode::Cheaper)?;
        // dropped here, without end_packing
    }
    let data = vec![0x22u8; len];
    let mut p = ch.begin_packing(1)?;
    p.pack_value(&2u64, RecvMode::Express)?;
    p.pack(&data, RecvMode::Cheaper)?;
    p.end_packing()
}

fn recv_shape(ch: &Channel, len: usize) -> Result<(u64, Vec<u8>), Error> {
    let mut u = ch.begin_unpacking()?;
    let v: u64 = u.unpack_value()?;
    let mut buf = vec![0u8; len];
    u.unpack(&mut buf, SendMode::Cheaper)?;
    u.end_unpacking()?;
    Ok((v, buf))
}

#[test]
fn dropped_packer_never_delivers_a_mixed_or_truncated_message() {
    for spec in SPECS {
        for checked in [false, true] {
            let spec = format!("{spec},checked={checked}");
            for big in [false, true] {
                let (sent, got) = if big {
                    pair(
                        &spec,
                        |ch| drop_then_send(ch, 4 << 20),
                        |ch| recv_shape(ch, 4 << 20),
                    )
                } else {
                    pair(&spec, |ch| drop_then_send(ch, 16), |ch| recv_shape(ch, 16))
                };
                let summary = match &got {
                    Ok((v, b)) => format!("Ok(message {v}, {} B)", b.len()),
                    Err(e) => format!("Err({e})"),
                };
                eprintln!(
                    "dropped packer on {spec} (big={big}): sender {sent:?}, receiver {summary}"
                );
                match got {
                    Ok((2, buf)) => {
                        assert!(buf.iter().all(|b| *b == 0x22), "{spec} big={big}: mixed");
                        sent.expect("sender's second message");
                    }
                    // The abandoned message, every piece of it packed: neither mode may deliver
                    // it (unchecked mode has no end marker, so drivers must not let a dropped
                    // packer's last pieces reach the peer: tcp never sent them, shm keeps short
                    // CHEAPER lends unpublished until `end_packing`).
                    Ok((1, _)) => panic!("{spec} big={big}: abandoned message accepted"),
                    Ok((v, _)) => panic!("{spec} big={big}: garbage message {v}"),
                    Err(e) => assert!(
                        matches!(
                            e,
                            Error::PeerClosed { .. }
                                | Error::ConnectionLost { .. }
                                | Error::Protocol { .. }
                                | Error::Poisoned { .. }
                                | Error::UnpackMismatch { .. }
                        ),
                        "{spec} big={big}: {e}"
                    ),
                }
            }
        }
    }
}
