//! `sisci:dolphin` against a stand-in SISCI library (`tests/fake_sisci.c`, built here with the
//! system C compiler): the backend's whole call sequence and the protocol over it run, on
//! thread ranks of this process ("one node").
//!
//! This is not a test against Dolphin's library or hardware (there is none here): the stand-in
//! implements the API as this project reads Dolphin's reference, with strict checks (release
//! order, alignment, bounds, leaks: it aborts the process if it is unloaded with anything
//! left), and reports what it saw in a file when it is unloaded.
//!
//! Tests of this binary take one lock: a process uses one SISCI library at a time.

#![cfg(not(miri))]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::{ChannelConfig, Error, RecvMode, SendMode, Session};
use mad_sisci::dolphin::segment_id;
use mad_sisci::SisciDriver;

static ONE_LIBRARY: Mutex<()> = Mutex::new(());

/// Build the stand-in as `libfakesisci-<name>.so` with `defines`; `None` (test skipped, with
/// a message) if there is no C compiler.
fn build(name: &str, defines: &[&str]) -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let out = dir.join(format!("libfakesisci-{name}.so"));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_sisci.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-std=c11", "-D_GNU_SOURCE"])
        .args(["-Wall", "-Wextra", "-Werror"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .arg("-lpthread")
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        Ok(s) => panic!("{cc} failed to build the stand-in SISCI library: {s}"),
        Err(e) => {
            eprintln!("SKIPPED: no C compiler to build the stand-in SISCI library ({cc}: {e})");
            None
        }
    }
}

/// What the stand-in reported, summed over its loads (the library is loaded with the first
/// `sisci:dolphin` channel of the process and unloaded with the last).
#[derive(Debug, Default)]
struct Report {
    unloads: u64,
    dma_transfers: u64,
    barriers: u64,
    collisions: u64,
}

/// Run `body` with the stand-in reporting to a fresh file; return its report, summed over
/// every unload. Each unload means the last SISCI user of the process was gone, with no object
/// left and every `SCIInitialize` paired (the stand-in aborts otherwise).
fn with_report(name: &str, taken: &[u32], body: impl FnOnce()) -> Report {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fakesisci-{name}.report"));
    let _ = std::fs::remove_file(&path);
    let taken: Vec<String> = taken.iter().map(|t| format!("0x{t:x}")).collect();
    // Set before any thread of this test starts; other tests wait on `ONE_LIBRARY`.
    std::env::set_var("FAKE_SISCI_REPORT", &path);
    std::env::set_var("FAKE_SISCI_TAKEN", taken.join(","));
    body();
    // Releases that peers kept busy finish in the background: the last unload comes after.
    // Wait until the report stops growing.
    let mut last = String::new();
    let mut stable = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while stable < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
        let now = std::fs::read_to_string(&path).unwrap_or_default();
        stable = if now == last && !now.is_empty() {
            stable + 1
        } else {
            0
        };
        last = now;
    }
    assert!(
        !last.is_empty(),
        "no report from the stand-in: library never unloaded?"
    );
    let mut r = Report::default();
    for line in last.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.first(), Some(&"clean"), "{last}");
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        r.unloads += 1;
        r.dma_transfers += num(1);
        r.barriers += num(2);
        r.collisions += num(3);
    }
    r
}

fn session(b: ThreadBootstrap) -> mad_core::Result<Session> {
    Session::builder()
        .driver(SisciDriver::new())
        .bootstrap(Box::new(b))
        .build()
}

fn kit(ranks: usize, spec: &str) {
    common::kit_threads(ranks, spec);
}

#[test]
fn kit_2_over_dolphin_with_dma() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("mt", &[]) else { return };
    let r = with_report("mt", &[], || {
        kit(2, &format!("sisci:dolphin,lib={}", lib.display()));
    });
    eprintln!("{r:?}");
    assert!(r.dma_transfers > 0, "the dma TM used SCIStartDmaTransfer");
    assert!(r.barriers > 0, "publications used SCIStoreBarrier");
}

#[test]
fn kit_4_over_dolphin_tiny_geometry_blocking() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("tiny", &[]) else {
        return;
    };
    let r = with_report("tiny", &[], || {
        kit(
            4,
            &format!(
                "sisci:dolphin,lib={},progress=block,slots=2,ring=4096,chunk=4096,chunks=1",
                lib.display()
            ),
        );
    });
    eprintln!("{r:?}");
    assert!(r.dma_transfers > 0);
}

#[test]
fn kit_2_over_dolphin_without_dma_calls_copies_by_pio() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    // `_ST_` symbol names and no DMA calls at all.
    let Some(lib) = build("st-nodma", &["FAKE_ST", "FAKE_NO_DMA"]) else {
        return;
    };
    let r = with_report("st-nodma", &[], || {
        kit(2, &format!("sisci:dolphin,lib={}", lib.display()));
    });
    assert_eq!(r.dma_transfers, 0);
}

/// DMA transfers that fail for a reason that is not the peer: the connection switches to PIO
/// and the kit still passes.
#[test]
fn kit_2_over_dolphin_dma_failing_falls_back_to_pio() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("dmafail", &[]) else {
        return;
    };
    std::env::set_var("FAKE_SISCI_DMA_FAIL", "1");
    let r = with_report("dmafail", &[], || {
        kit(2, &format!("sisci:dolphin,lib={}", lib.display()));
    });
    std::env::remove_var("FAKE_SISCI_DMA_FAIL");
    assert_eq!(r.dma_transfers, 0, "{r:?}");
}

#[test]
fn kit_2_over_dolphin_bare_names_dma_off() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("bare", &["FAKE_BARE"]) else {
        return;
    };
    let r = with_report("bare", &[], || {
        kit(
            2,
            &format!("sisci:dolphin,lib={},dma=off,ring=8192", lib.display()),
        );
    });
    assert_eq!(r.dma_transfers, 0, "dma=off: no dma TM");
}

/// Segment ids already in use on the node: each rank probes to its next candidate, publishes
/// the id it got, and the channel works.
#[test]
fn used_segment_ids_are_skipped_and_published() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("probe", &[]) else {
        return;
    };
    let name = "probe-chan";
    let taken = [
        segment_id(name, 0, 0).unwrap(),
        segment_id(name, 1, 0).unwrap(),
        segment_id(name, 1, 1).unwrap(),
    ];
    let spec = format!("sisci:dolphin,lib={}", lib.display());
    let r = with_report("probe", &taken, || {
        std::thread::scope(|s| {
            for b in ThreadBootstrap::group(2) {
                let spec = &spec;
                s.spawn(move || {
                    let me = b.rank();
                    let sess = session(b).unwrap();
                    let ch = sess
                        .open_channel_with(ChannelConfig::parse(name, spec).unwrap())
                        .unwrap();
                    let mut buf = vec![0u8; 300_000];
                    if me == 0 {
                        buf.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
                        let mut p = ch.begin_packing(1).unwrap();
                        p.pack(&buf, RecvMode::Cheaper).unwrap();
                        p.end_packing().unwrap();
                    } else {
                        let mut u = ch.begin_unpacking_from(0).unwrap();
                        u.unpack(&mut buf, SendMode::Cheaper).unwrap();
                        u.end_unpacking().unwrap();
                        assert!(buf.iter().enumerate().all(|(i, x)| *x == i as u8));
                    }
                });
            }
        });
    });
    assert_eq!(r.collisions, 3, "{r:?}");
}

/// A wrong adapter number fails the open with `Unavailable` naming the call and the code, and
/// releases everything (the library is unloaded clean).
#[test]
fn wrong_adapter_is_unavailable_and_releases_everything() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("adapter", &[]) else {
        return;
    };
    with_report("adapter", &[], || {
        let b = ThreadBootstrap::group(1).pop().unwrap();
        let sess = session(b).unwrap();
        let spec = format!("sisci:dolphin,lib={},adapter_no=1", lib.display());
        match sess.open_channel_with(ChannelConfig::parse("a", &spec).unwrap()) {
            Err(Error::Unavailable { driver, reason, .. }) => {
                assert_eq!(driver, "sisci:dolphin");
                assert!(reason.contains("SCIGetLocalNodeId"), "{reason}");
                assert!(reason.contains("SCI_ERR_NO_SUCH_ADAPTERNO"), "{reason}");
                assert!(reason.contains("sisci:local"), "{reason}");
            }
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("opened with adapter 1"),
        }
    });
}

/// SISCI reports a peer's connection lost (no close flag was written: the peer is alive as
/// far as the protocol knows, as after a crash): a receiver blocked on it gets a peer failure
/// within the liveness bound, through `PeerWatch::custom` and
/// `SCIWaitForRemoteSegmentEvent`.
#[test]
fn connection_lost_event_fails_a_blocked_receiver_quickly() {
    let _one = ONE_LIBRARY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(lib) = build("lost", &[]) else {
        return;
    };
    let lost = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fakesisci-lost.ids");
    let _ = std::fs::remove_file(&lost);
    std::env::set_var("FAKE_SISCI_LOST_FILE", &lost);
    let name = "death";
    let spec = format!("sisci:dolphin,lib={}", lib.display());
    let reported: Mutex<Option<std::time::Instant>> = Mutex::new(None);
    let done = std::sync::Barrier::new(2);
    with_report("lost", &[], || {
        std::thread::scope(|s| {
            for b in ThreadBootstrap::group(2) {
                let (spec, lost, reported, done) = (&spec, &lost, &reported, &done);
                s.spawn(move || {
                    let me = b.rank();
                    let sess = session(b).unwrap();
                    let ch = sess
                        .open_channel_with(ChannelConfig::parse(name, spec).unwrap())
                        .unwrap();
                    if me == 0 {
                        let e = ch.begin_unpacking_from(1).map(|_| ()).unwrap_err();
                        let at = reported.lock().unwrap().expect("failed before the event");
                        let after = at.elapsed();
                        eprintln!("rank 0: {e} ({after:?} after the event)");
                        assert!(
                            matches!(
                                e,
                                Error::PeerClosed { rank: 1 } | Error::Poisoned { rank: 1, .. }
                            ),
                            "{e:?}"
                        );
                        assert!(after < std::time::Duration::from_millis(500), "{after:?}");
                    } else {
                        std::thread::sleep(std::time::Duration::from_millis(300));
                        let id = segment_id(name, 1, 0).unwrap();
                        *reported.lock().unwrap() = Some(std::time::Instant::now());
                        std::fs::write(lost, format!("{id:x}\n")).unwrap();
                    }
                    // Rank 1 keeps its channel open until rank 0 has seen the failure.
                    done.wait();
                });
            }
        });
    });
    std::env::remove_var("FAKE_SISCI_LOST_FILE");
}
