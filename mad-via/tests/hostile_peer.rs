//! A hostile or broken peer writing raw bytes into a soft NIC: every case ends in a typed
//! error on the receiving side, never a panic, a hang or a write outside registered memory.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::Error;
use mad_via::wire::{self, Header, Kind, HEADER_LEN};
use mad_via::{Endpoint, Pd, SlotConfig};

fn victim() -> (Endpoint, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    let pd = Pd::new(4);
    let cfg = SlotConfig {
        slots: 2,
        slot_size: 128,
    };
    (Endpoint::over_unix(a, 7, &pd, cfg).unwrap(), b)
}

fn error_after(bytes: &[u8]) -> Error {
    let (ep, mut raw) = victim();
    raw.write_all(bytes).unwrap(); // `raw` stays open until the error is seen
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

fn small(len: usize) -> Vec<u8> {
    let mut v = Header::new(Kind::Small, 0, 0, len).encode().to_vec();
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
        let (ep, mut raw) = victim();
        raw.write_all(&junk).unwrap();
        drop(raw);
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
    let h = Header::new(Kind::Medium, 0, 0, 0);
    let mut b = h.encode();
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = error_after(&b);
    assert!(e.to_string().contains("bad payload length"), "{e}");
}

#[test]
fn small_send_without_credit_is_refused() {
    // Two slots: the third small frame has no posted receive.
    let mut b = Vec::new();
    for _ in 0..3 {
        b.extend_from_slice(&small(16));
    }
    let e = error_after(&b);
    assert!(e.to_string().contains("no posted receive"), "{e}");
}

#[test]
fn small_send_larger_than_a_slot_is_refused() {
    let e = error_after(&small(129));
    assert!(e.to_string().contains("slot"), "{e}");
}

#[test]
fn inflated_credits_are_refused() {
    let mut b = Vec::new();
    wire::encode_credit(&mut b, 1000);
    let e = error_after(&b);
    assert!(e.to_string().contains("credits"), "{e}");
}

#[test]
fn rdma_write_to_a_guessed_key_is_refused() {
    let mut h = Header::new(Kind::RdmaWrite, wire::FLAG_LAST, 0, 8);
    h.key = 0x5a00_0001;
    h.addr = 0x1000;
    let mut b = h.encode().to_vec();
    b.extend_from_slice(&[1; 8]);
    let e = error_after(&b);
    assert!(e.to_string().contains("refused"), "{e}");
}

#[test]
fn truncated_frame_then_close_is_an_error() {
    let (ep, mut raw) = victim();
    raw.write_all(&small(64)[..40]).unwrap();
    drop(raw);
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
