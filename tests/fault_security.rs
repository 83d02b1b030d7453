//! Security properties checked from outside the drivers: shm segments are owner-only, and a
//! stranger's connection to the madrun bootstrap of a running job is refused and logged while
//! the job's traffic goes on (real processes under madrun).
//!
//! Elsewhere: tcp listener strangers and adapter binding in `fault_tcp_hostile.rs`; soft-VIA
//! key and bounds checks in `mad-via/tests/hostile_peer.rs` and `mad-via/tests/soft_links.rs`.

#![cfg(all(feature = "tcp", feature = "shm"))]

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::time::Duration;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::{ChannelConfig, RecvMode, SendMode, Session};

#[test]
fn shm_segments_are_owner_only() {
    let bs = ThreadBootstrap::group(2);
    let prefix = format!("mad-shm-{}-", std::process::id());
    let hs: Vec<_> = bs
        .into_iter()
        .map(|b| {
            let prefix = prefix.clone();
            std::thread::spawn(move || {
                let s = Session::builder()
                    .driver(mad_shm::ShmDriver::new())
                    .bootstrap(Box::new(b))
                    .build()
                    .unwrap();
                let ch = s
                    .open_channel_with(ChannelConfig::parse("sec", "shm").unwrap())
                    .unwrap();
                // Both ranks have created and mapped their segments: inspect them.
                s.bootstrap().barrier("opened").unwrap();
                let mut seen = Vec::new();
                if s.rank() == 0 {
                    // The segments are unlinked once mapped: find them through this
                    // process's mappings (`/proc/self/map_files` stats the mapped file).
                    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
                    for l in maps.lines() {
                        let Some(at) = l.find("/dev/shm/") else {
                            continue;
                        };
                        let name = l[at + 9..].to_string();
                        if !name.starts_with(&prefix) {
                            continue;
                        }
                        let range = l.split_whitespace().next().unwrap();
                        let md =
                            std::fs::metadata(format!("/proc/self/map_files/{range}")).unwrap();
                        seen.push((name, md.mode() & 0o777, md.uid()));
                    }
                }
                s.bootstrap().barrier("inspected").unwrap();
                drop(ch);
                seen
            })
        })
        .collect();
    let seen: Vec<_> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    // SAFETY: geteuid has no preconditions and touches no memory.
    let me = unsafe { libc::geteuid() };
    eprintln!("shm segments while the channel is open: {seen:?}");
    assert!(!seen.is_empty(), "no mapped shm segment found");
    for (name, mode, uid) in &seen {
        assert_eq!(*mode & 0o077, 0, "{name} has mode {mode:o}");
        assert_eq!(*uid, me, "{name} owned by {uid}");
    }
}

#[test]
#[ignore = "rank program of stranger_at_the_bootstrap_during_a_job"]
fn bootstrap_stranger_child() {
    let session = madeleine::session().unwrap();
    let ch = session
        .open_channel_with(ChannelConfig::parse("sec", "tcp").unwrap())
        .unwrap();
    if session.rank() == 0 {
        // A stranger (this rank, using no secret) knocks at the launcher mid-job: garbage,
        // then a well-framed hello with a bad proof.
        let addr = std::env::var("MAD_BOOTSTRAP").unwrap();
        let mut st = std::net::TcpStream::connect(&addr).unwrap();
        st.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = st.write_all(b"\xff\xff\xff\x7fGET / HTTP/1.1\r\n\r\n");
        let mut sink = Vec::new();
        let _ = st.read_to_end(&mut sink);
        println!("stranger got {} bytes back then close", sink.len());
    }
    // The job's own traffic is unaffected: a ring of 1 MiB messages and a final allgather.
    let (me, n) = (session.rank(), session.size());
    let data = vec![me as u8; 1 << 20];
    let mut p = ch.begin_packing((me + 1) % n).unwrap();
    p.pack_value(&(me as u64), RecvMode::Express).unwrap();
    p.pack(&data, RecvMode::Cheaper).unwrap();
    p.end_packing().unwrap();
    let mut u = ch.begin_unpacking().unwrap();
    let from: u64 = u.unpack_value().unwrap();
    let mut buf = vec![0u8; 1 << 20];
    u.unpack(&mut buf, SendMode::Cheaper).unwrap();
    u.end_unpacking().unwrap();
    assert_eq!(from as usize, (me + n - 1) % n);
    assert!(buf.iter().all(|b| *b == from as u8));
    session.bootstrap().barrier("sec-end").unwrap();
    println!("JOB-OK rank {me}");
}

#[test]
fn stranger_at_the_bootstrap_during_a_job() {
    let out = Command::new(env!("CARGO_BIN_EXE_madrun"))
        .args(["-n", "3", "--timeout", "60", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "bootstrap_stranger_child",
            "--ignored",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{so}\n{se}");
    for r in 0..3 {
        assert!(so.contains(&format!("JOB-OK rank {r}")), "{so}\n{se}");
    }
    assert!(
        se.contains("madrun: refused bootstrap connection from 127.0.0.1:"),
        "stranger not logged:\n{se}"
    );
    eprintln!("{se}");
}
