//! The non-blocking receive (`try_begin_unpacking`, Madeleine's `message_ready`), the
//! per-channel counters (`Channel::stats`) and the selection table, over the in-process `mem`
//! driver with ranks as threads.

use std::time::{Duration, Instant};

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::mem::MemDriver;
use mad_core::{Channel, RecvMode, SendMode, Session};

/// Run `body(rank, channel)` on two thread-ranks over `spec`.
fn pair(spec: &str, body: impl Fn(usize, Channel) + Send + Sync + Copy) {
    let boots = ThreadBootstrap::group(2);
    std::thread::scope(|s| {
        for b in boots {
            let spec = spec.to_string();
            s.spawn(move || {
                let rank = b.rank();
                let session = Session::builder()
                    .driver(MemDriver)
                    .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("obs", &spec).unwrap())
                    .unwrap();
                body(rank, ch);
            });
        }
    });
}

#[test]
fn try_begin_unpacking_is_none_until_a_message_is_there() {
    pair("mem", |rank, ch| {
        if rank == 0 {
            // Nothing sent yet: no message, and the call does not wait.
            let t = Instant::now();
            assert!(ch.try_begin_unpacking().unwrap().is_none());
            assert!(t.elapsed() < Duration::from_secs(1));
            // Tell rank 1 to send, then poll until the message is there.
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_value(&1u8, RecvMode::Express).unwrap();
            p.end_packing().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut u = loop {
                if let Some(u) = ch.try_begin_unpacking().unwrap() {
                    break u;
                }
                assert!(Instant::now() < deadline, "the message never became ready");
                std::thread::yield_now();
            };
            assert_eq!(u.remote(), 1);
            let n: u32 = u.unpack_value().unwrap();
            let mut body = vec![0u8; n as usize];
            u.unpack(&mut body, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(body.iter().enumerate().all(|(i, &b)| b == i as u8));
            // The message was consumed whole: nothing is left.
            assert!(ch.try_begin_unpacking().unwrap().is_none());
            // Let rank 1 go (once it has, `try_begin_unpacking` says no peer is left).
            let mut p = ch.begin_packing(1).unwrap();
            p.pack_value(&2u8, RecvMode::Express).unwrap();
            p.end_packing().unwrap();
        } else {
            let mut u = ch.begin_unpacking().unwrap();
            let _: u8 = u.unpack_value().unwrap();
            u.end_unpacking().unwrap();
            let body: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_value(&(body.len() as u32), RecvMode::Express)
                .unwrap();
            p.pack(&body, RecvMode::Cheaper).unwrap();
            p.end_packing().unwrap();
            let mut u = ch.begin_unpacking().unwrap();
            let _: u8 = u.unpack_value().unwrap();
            u.end_unpacking().unwrap();
        }
    });
}

#[test]
fn stats_count_messages_bytes_and_pieces_per_tm() {
    // `tm.copy=100`: pieces of at most 100 B are copied, larger ones gathered.
    pair("mem,tm.copy=100", |rank, ch| {
        let big = vec![7u8; 1000];
        if rank == 0 {
            for _ in 0..3 {
                let mut p = ch.begin_packing(1).unwrap();
                p.pack_value(&5u64, RecvMode::Express).unwrap(); // copy
                p.pack(&big, RecvMode::Cheaper).unwrap(); // gather
                p.pack_safer(&[1, 2, 3], RecvMode::Cheaper).unwrap(); // copy
                p.end_packing().unwrap();
            }
            // A zero-piece message counts as a message.
            ch.begin_packing(1).unwrap().end_packing().unwrap();
            let st = ch.stats();
            assert_eq!(st.messages_sent, 4);
            assert_eq!(st.bytes_sent, 3 * (8 + 1000 + 3));
            assert_eq!(st.messages_received, 0);
            assert_eq!(
                st.pieces_sent,
                vec![("copy".to_string(), 6), ("gather".to_string(), 3)]
            );
        } else {
            let mut buf = vec![0u8; 1000];
            for _ in 0..3 {
                let mut u = ch.begin_unpacking().unwrap();
                let v: u64 = u.unpack_value().unwrap();
                assert_eq!(v, 5);
                u.unpack(&mut buf, SendMode::Cheaper).unwrap();
                let mut small = [0u8; 3];
                u.unpack(&mut small, SendMode::Safer).unwrap();
                u.end_unpacking().unwrap();
                assert_eq!(small, [1, 2, 3]);
            }
            ch.begin_unpacking().unwrap().end_unpacking().unwrap();
            let st = ch.stats();
            assert_eq!(st.messages_received, 4);
            assert_eq!(st.bytes_received, 3 * (8 + 1000 + 3));
            assert_eq!(st.messages_sent, 0);
            assert_eq!(
                st.pieces_received,
                vec![("copy".to_string(), 6), ("gather".to_string(), 3)]
            );
        }
    });
}

#[test]
fn selection_table_shows_tms_thresholds_choices_and_modes() {
    pair("mem,tm.copy=300,checked=true,progress=poll", |_, ch| {
        let t = ch.selection_table();
        assert!(t.contains("channel `obs`: driver mem"), "{t}");
        assert!(
            t.contains("progress Poll") && t.contains("checked mode on"),
            "{t}"
        );
        // Both TMs with their BMM; the overridden threshold is shown.
        let copy_row = t
            .lines()
            .find(|l| l.trim_start().starts_with("0 ") && l.contains("copy"))
            .unwrap_or_else(|| panic!("no row for TM 0: {t}"));
        assert!(
            copy_row.contains("Copy") && copy_row.contains(" 300 "),
            "{copy_row}"
        );
        assert!(t
            .lines()
            .any(|l| l.contains("gather") && l.contains("Gather")));
        // Which TM serves which size: 8 and 64 B are copied, 512 B gathered (CHEAPER/CHEAPER).
        let row = t
            .lines()
            .find(|l| l.trim_start().starts_with("Cheaper/Cheaper"))
            .unwrap_or_else(|| panic!("no Cheaper/Cheaper row: {t}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(&cols[1..5], ["copy", "copy", "copy", "gather"], "{row}");
        assert_eq!(ch.tm_table().tms()[0].max_len, 300);
    });
}
