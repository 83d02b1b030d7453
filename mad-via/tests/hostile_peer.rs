//! A hostile or broken peer writing raw frames into a soft NIC: every case ends in a typed
//! error on the receiving side, never a panic, a hang or a write outside registered memory.

use std::io::{IoSlice, Write};
use std::os::unix::net::UnixStream;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::Error;
use mad_via::wire::{self, Header, HEADER_LEN};
use mad_via::{Endpoint, Pd, SlotConfig};

/// The victim endpoint and the raw other ends of its control and data sockets.
fn victim() -> (Endpoint, UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    let (c, d) = UnixStream::pair().unwrap();
    let pd = Pd::new(4);
    let cfg = SlotConfig {
        slots: 2,
        slot_size: 128,
    };
    (Endpoint::over_unix(a, c, 7, &pd, cfg).unwrap(), b, d)
}

fn error_after(ctrl: &[u8], data: &[u8]) -> Error {
    let (ep, mut raw_c, mut raw_d) = victim();
    // The raw ends stay open until the error is seen.
    raw_c.write_all(ctrl).unwrap();
    raw_d.write_all(data).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Err(e) = ep.progress() {
            // Later calls keep failing (poisoned), without panicking.
            assert!(ep.progress().is_err());
            return e;
        }
        assert!(Instant::now() < deadline, "garbage accepted silently");
        ep.wait(Duration::from_millis(5)).unwrap();
    }
}

fn small(len: usize, imm: u32) -> Vec<u8> {
    let mut v = Header::send(len, Some(imm)).encode().to_vec();
    v.resize(HEADER_LEN + len, 0xab);
    v
}

#[test]
fn garbage_bytes() {
    let mut x: u64 = 12345;
    for _ in 0..50 {
        let junk: Vec<u8> = (0..64)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let (ep, mut raw, raw_d) = victim();
        raw.write_all(&junk).unwrap();
        drop((raw, raw_d));
        // A protocol error, or end of stream reported as `PeerClosed`; never a panic.
        let mut l = ep.links().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if ep.progress().is_err() || l.rx.poll_message().is_err() {
                break;
            }
            assert!(Instant::now() < deadline, "junk accepted: {junk:?}");
            l.rx.wait(Duration::from_millis(2)).unwrap();
        }
    }
}

#[test]
fn oversized_frame_is_refused_before_allocation() {
    let mut b = Header::send(0, None).encode();
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = error_after(&b, &[]);
    assert!(e.to_string().contains("bad payload length"), "{e}");
    // On the data queue pair too.
    let e = error_after(&[], &b);
    assert!(e.to_string().contains("bad payload length"), "{e}");
}

#[test]
fn small_send_without_credit_is_refused() {
    // Two receive buffers: the third small send has no posted receive.
    let mut b = Vec::new();
    for _ in 0..3 {
        b.extend_from_slice(&small(16, wire::encode_imm(wire::REC_DATA, 0)));
    }
    let e = error_after(&b, &[]);
    assert!(e.to_string().contains("no posted receive"), "{e}");
}

#[test]
fn small_send_larger_than_a_slot_is_refused() {
    let e = error_after(&small(129, wire::encode_imm(wire::REC_DATA, 0)), &[]);
    assert!(e.to_string().contains("slot"), "{e}");
    // Larger than the control queue pair's whole input buffer: refused from the header.
    let e = error_after(&small(100_000, 0)[..HEADER_LEN], &[]);
    assert!(e.to_string().contains("slot"), "{e}");
}

#[test]
fn inflated_credits_are_refused() {
    // A record returning 1000 credits to a victim that sent nothing.
    let e = error_after(&small(8, wire::encode_imm(wire::REC_DATA, 1000)), &[]);
    assert!(e.to_string().contains("credits"), "{e}");
}

#[test]
fn bad_control_records_are_refused() {
    let e = error_after(&small(8, wire::encode_imm(9, 0)), &[]);
    assert!(e.to_string().contains("record kind"), "{e}");
    let mut no_imm = Header::send(8, None).encode().to_vec();
    no_imm.resize(HEADER_LEN + 8, 0);
    let e = error_after(&no_imm, &[]);
    assert!(e.to_string().contains("immediate"), "{e}");
    let e = error_after(&small(7, wire::encode_imm(wire::REC_CTS, 0)), &[]);
    assert!(e.to_string().contains("CTS"), "{e}");
}

#[test]
fn rdma_write_to_a_guessed_key_is_refused() {
    let mut h = Header::write(8, 0x5a00_0001, 0x1000, Some(wire::IMM_WRITE_DONE))
        .encode()
        .to_vec();
    h.extend_from_slice(&[1; 8]);
    for (c, d) in [(&h[..], &[][..]), (&[][..], &h[..])] {
        let e = error_after(c, d);
        assert!(e.to_string().contains("refused"), "{e}");
    }
}

#[test]
fn truncated_frame_then_close_is_an_error() {
    let (ep, mut raw, raw_d) = victim();
    raw.write_all(&small(64, 0)[..40]).unwrap();
    drop((raw, raw_d));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut l = ep.links().unwrap();
    loop {
        match l.rx.poll_message() {
            Err(e) => {
                assert!(e.to_string().contains("middle of a frame"), "{e}");
                break;
            }
            Ok(Poll::Ready(())) => panic!("half a frame delivered"),
            Ok(Poll::Pending) => {}
        }
        assert!(Instant::now() < deadline);
        l.rx.wait(Duration::from_millis(2)).unwrap();
    }
}

#[test]
fn a_cts_that_does_not_fit_the_piece_is_refused() {
    // A rendezvous sender of 100 B gets a CTS for 1000 B, or for 0 B (which would never cover
    // the piece): a protocol error, nothing written.
    for len in [1000u64, 0] {
        let (ep, mut raw_c, _raw_d) = victim();
        let mut cts = [0u8; wire::CTS_LEN];
        wire::Cts {
            key: 0x5a00_0001,
            addr: 0x1000,
            len,
        }
        .encode_into(&mut cts);
        let mut frame = Header::send(cts.len(), Some(wire::encode_imm(wire::REC_CTS, 0)))
            .encode()
            .to_vec();
        frame.extend_from_slice(&cts);
        raw_c.write_all(&frame).unwrap();
        let mut l = ep.links().unwrap();
        let data = [7u8; 100];
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match l.tx.send_refs(mad_via::TM_LARGE, &[IoSlice::new(&data)]) {
                Err(e) => {
                    assert!(e.to_string().contains("advertised"), "{e}");
                    break;
                }
                Ok(Poll::Ready(())) => panic!("a CTS of {len} B accepted for 100 B"),
                Ok(Poll::Pending) => {}
            }
            assert!(Instant::now() < deadline, "CTS of {len} B: no error");
            l.tx.wait(Duration::from_millis(2)).unwrap();
        }
    }
}
