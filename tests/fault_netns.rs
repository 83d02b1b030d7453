//! The rank program of `tests/faults/netns.sh` (TCP across two network namespaces with packet
//! loss, a black hole and resets injected by nftables). Run only through that script: the test
//! here is ignored.
//!
//! Rank 0 sends messages of random sizes (0 to 256 KiB, a sequence number and a checksum in an
//! EXPRESS header) to rank 1, which checks each one and answers with an 8-byte acknowledgement
//! (ping-pong: both directions carry data, so a dead path is noticed by whichever side is
//! sending). `MAD_NETNS_COUNT=k` stops after k messages (0: until an error). Output lines:
//! `NETNS ok msgs=k`, or `NETNS error msgs=k at_ms=<unix ms> err=...` (exit 1), or
//! `NETNS CORRUPT ...` (exit 2).

#![cfg(feature = "tcp")]

use std::time::{SystemTime, UNIX_EPOCH};

use madeleine::{ChannelConfig, Error, RecvMode, SendMode};

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

fn checksum(b: &[u8]) -> u64 {
    b.iter()
        .fold(0xcbf29ce484222325u64 ^ b.len() as u64, |h, x| {
            (h ^ *x as u64).wrapping_mul(0x100000001b3)
        })
}

fn run(ch: &madeleine::Channel, rank: usize, count: u64, msgs: &mut u64) -> Result<(), Error> {
    let mut x = 0x2545f4914f6cdd1du64;
    let mut buf = vec![0u8; 256 << 10];
    while count == 0 || *msgs < count {
        if rank == 0 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % (256 << 10) as u64) as usize;
            for (j, b) in buf[..len].iter_mut().enumerate() {
                *b = (j as u64 ^ x ^ *msgs) as u8;
            }
            let head = [*msgs, len as u64, checksum(&buf[..len])];
            let mut p = ch.begin_packing(1)?;
            p.pack_value(&head, RecvMode::Express)?;
            p.pack(&buf[..len], RecvMode::Cheaper)?;
            p.end_packing()?;
            let mut u = ch.begin_unpacking_from(1)?;
            let ack: u64 = u.unpack_value()?;
            u.end_unpacking()?;
            if ack != *msgs {
                println!("NETNS CORRUPT ack {ack} for message {msgs}");
                std::process::exit(2);
            }
        } else {
            let mut u = ch.begin_unpacking_from(0)?;
            let [seq, len, sum]: [u64; 3] = u.unpack_value()?;
            if len as usize > buf.len() {
                println!("NETNS CORRUPT length {len} in message {msgs}");
                std::process::exit(2);
            }
            u.unpack(&mut buf[..len as usize], SendMode::Cheaper)?;
            u.end_unpacking()?;
            if seq != *msgs || checksum(&buf[..len as usize]) != sum {
                println!("NETNS CORRUPT message {msgs}: seq {seq}, checksum differs or reordered");
                std::process::exit(2);
            }
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&seq, RecvMode::Express)?;
            p.end_packing()?;
        }
        *msgs += 1;
    }
    Ok(())
}

#[test]
#[ignore = "rank program of tests/faults/netns.sh"]
fn netns_child() {
    let spec = std::env::var("MAD_NETNS_SPEC").expect("MAD_NETNS_SPEC");
    let count: u64 = std::env::var("MAD_NETNS_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let session = madeleine::session().unwrap();
    let ch = session
        .open_channel_with(ChannelConfig::parse("netns", &spec).unwrap())
        .unwrap();
    let mut msgs = 0;
    match run(&ch, session.rank(), count, &mut msgs) {
        Ok(()) => {
            println!("NETNS ok msgs={msgs}");
            // Keep the channel open until the peer has read everything.
            session.bootstrap().barrier("netns-end").unwrap();
        }
        Err(e) => {
            println!("NETNS error msgs={msgs} at_ms={} err={e}", unix_ms());
            std::process::exit(1);
        }
    }
}
