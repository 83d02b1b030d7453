//! Peer death at every stage, on every driver that runs on this host, with real processes under
//! `madrun`.
//!
//! Each case runs `madrun -n 2` on this test binary (the ignored test `fault_child` is the rank
//! program). Rank 1 is the victim: at the chosen stage it writes the time to a file and
//! SIGKILLs itself (from its main thread, or from a second thread while the main thread is
//! inside a large transfer). Rank 0 is the survivor: it ignores the SIGTERM madrun sends to the
//! group when a rank dies, runs until a Madeleine call returns an error, and prints one `FAULT`
//! line with the call that failed, the error, and the time from the victim's death to the
//! error. Every message the survivor completes is checked byte for byte (whole or error, never
//! garbage). A watchdog thread makes a hung survivor exit 3 after 30 s.
//!
//! Stages:
//! - `idle`: the survivor is blocked in `begin_unpacking`; the victim dies before sending.
//! - `mid`: the victim dies after packing two of four 1 MiB pieces (no `end_packing`).
//! - `large`: the victim sends 64 MiB single pieces in a loop (tcp: direct writes, shm: the pipelined ring,
//!   via: RDMA-write rendezvous) and dies 150 ms in, normally in the middle of a transfer.
//! - `recv_dead`: the victim is the receiver; the survivor sends 1 MiB messages until a
//!   call fails.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use madeleine::{ChannelConfig, RecvMode, SendMode};

const MADRUN: &str = env!("CARGO_BIN_EXE_madrun");
/// Largest accepted time from the victim's death to the survivor's error, per driver.
const BOUND_MS: u128 = 5_000;
const LARGE: usize = 64 << 20;

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn death_file() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("MAD_FAULT_DIR").expect("MAD_FAULT_DIR")).join("death")
}

/// Record the time of death and SIGKILL this process.
fn die() -> ! {
    std::fs::write(death_file(), now_ns().to_string()).expect("write death time");
    // SAFETY: kill(2) on our own pid with SIGKILL; no memory is shared with the call.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    unreachable!("SIGKILL did not kill");
}

static CALL_START: std::sync::Mutex<u128> = std::sync::Mutex::new(0);

/// Note the start of a Madeleine call (the bound is measured from the later of the victim's
/// death and the start of the call that fails, so the survivor's own checking time is not
/// counted).
fn mark() {
    *CALL_START.lock().unwrap() = now_ns();
}

fn ms_since_death() -> String {
    let start = *CALL_START.lock().unwrap();
    match std::fs::read_to_string(death_file()) {
        Ok(s) => match s.trim().parse::<u128>() {
            Ok(t) => format!("{}", now_ns().saturating_sub(t.max(start)) / 1_000_000),
            Err(_) => "?".into(),
        },
        Err(_) => "nodeath".into(),
    }
}

fn pattern(i: u64, j: usize) -> u8 {
    ((i as usize).wrapping_mul(31).wrapping_add(j) % 251) as u8
}

fn fill(buf: &mut [u8], i: u64) {
    for (j, b) in buf.iter_mut().enumerate() {
        *b = pattern(i, j);
    }
}

fn report(stage: &str, spec: &str, call: &str, msgs: u64, e: &madeleine::Error) -> ! {
    println!(
        "FAULT stage={stage} spec={spec} call={call} msgs={msgs} after_ms={} err={e}",
        ms_since_death()
    );
    std::process::exit(0);
}

fn survivor(stage: &str, spec: &str, ch: &madeleine::Channel) {
    let mut msgs = 0u64;
    let (mut expected, mut expected_for) = (Vec::new(), u64::MAX);
    match stage {
        "idle" | "mid" | "large" => loop {
            mark();
            let mut u = match ch.begin_unpacking() {
                Ok(u) => u,
                Err(e) => report(stage, spec, "begin_unpacking", msgs, &e),
            };
            let (i, len) = match u.unpack_value::<[u64; 2]>() {
                Ok([i, len]) => (i, len as usize),
                Err(e) => report(stage, spec, "unpack_value", msgs, &e),
            };
            let pieces = if stage == "mid" { 4 } else { 1 };
            let mut bufs: Vec<Vec<u8>> = (0..pieces).map(|_| vec![0u8; len]).collect();
            mark();
            for (k, b) in bufs.iter_mut().enumerate() {
                if let Err(e) = u.unpack(b, SendMode::Cheaper) {
                    report(stage, spec, &format!("unpack piece {k}"), msgs, &e);
                }
            }
            if let Err(e) = u.end_unpacking() {
                report(stage, spec, "end_unpacking", msgs, &e);
            }
            let want = if stage == "large" { 0 } else { i };
            if expected.len() != len || expected_for != want {
                expected = vec![0u8; len];
                fill(&mut expected, want);
                expected_for = want;
            }
            for b in &bufs {
                if i != msgs || *b != expected {
                    println!("CORRUPT stage={stage} spec={spec} message {i}");
                    std::process::exit(2);
                }
            }
            msgs += 1;
        },
        "recv_dead" => {
            let mut data = vec![0u8; 1 << 20];
            fill(&mut data, 7);
            loop {
                mark();
                let r = (|| {
                    let mut p = ch.begin_packing(1)?;
                    p.pack_value(&msgs, RecvMode::Express)?;
                    p.pack(&data, RecvMode::Cheaper)?;
                    p.end_packing()
                })();
                if let Err(e) = r {
                    report(stage, spec, "packing", msgs, &e);
                }
                msgs += 1;
            }
        }
        _ => panic!("unknown stage {stage}"),
    }
}

fn victim(stage: &str, ch: &madeleine::Channel) {
    match stage {
        "idle" => {
            std::thread::sleep(Duration::from_millis(300));
            die();
        }
        "mid" => {
            let mut data = vec![0u8; 1 << 20];
            fill(&mut data, 0);
            let mut p = ch.begin_packing(0).unwrap();
            p.pack_value(&[0u64, data.len() as u64], RecvMode::Express)
                .unwrap();
            p.pack(&data, RecvMode::Cheaper).unwrap();
            p.pack(&data, RecvMode::Cheaper).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            die();
        }
        "large" => {
            // One pattern for every message (filling 64 MiB in a debug build takes longer
            // than the transfer); the survivor checks the message index for order.
            let mut data = vec![0u8; LARGE];
            fill(&mut data, 0);
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(150));
                die();
            });
            for i in 0u64.. {
                let mut p = ch.begin_packing(0).unwrap();
                p.pack_value(&[i, data.len() as u64], RecvMode::Express)
                    .unwrap();
                p.pack(&data, RecvMode::Cheaper).unwrap();
                p.end_packing().unwrap();
            }
        }
        "recv_dead" => {
            let mut u = ch.begin_unpacking().unwrap();
            let _: u64 = u.unpack_value().unwrap();
            let mut buf = vec![0u8; 1 << 20];
            u.unpack(&mut buf, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            die();
        }
        _ => panic!("unknown stage {stage}"),
    }
}

/// A session (joining madrun) with every driver this build has, sisci included.
fn session() -> madeleine::Session {
    #[allow(unused_mut)]
    let mut b = madeleine::Session::builder();
    #[cfg(feature = "tcp")]
    {
        b = b.driver(madeleine::mad_tcp::TcpDriver::new());
    }
    #[cfg(feature = "shm")]
    {
        b = b.driver(madeleine::mad_shm::ShmDriver::new());
    }
    #[cfg(feature = "via")]
    {
        b = b.driver(madeleine::mad_via::ViaDriver::new());
    }
    #[cfg(feature = "sisci")]
    {
        b = b.driver(madeleine::mad_sisci::SisciDriver::new());
    }
    b.build().unwrap()
}

#[test]
#[ignore = "rank program of the peer-death tests (run through madrun)"]
fn fault_child() {
    let stage = std::env::var("MAD_FAULT_STAGE").expect("MAD_FAULT_STAGE");
    let spec = std::env::var("MAD_FAULT_SPEC").expect("MAD_FAULT_SPEC");
    let session = session();
    let ch = session
        .open_channel_with(ChannelConfig::parse("fault", &spec).unwrap())
        .unwrap();
    if session.rank() == 0 {
        // madrun SIGTERMs the group when the victim dies: stay alive to see our own error.
        // SAFETY: installing SIG_IGN for SIGTERM; no handler code runs.
        unsafe {
            libc::signal(libc::SIGTERM, libc::SIG_IGN);
        }
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(30));
            println!("HANG: no error 30 s after start");
            std::process::exit(3);
        });
        survivor(&stage, &spec, &ch);
    } else {
        victim(&stage, &ch);
    }
}

/// Run one case; returns the survivor's `after_ms`.
fn case(spec: &str, stage: &str) -> u128 {
    let dir = std::env::temp_dir().join(format!(
        "mad-fault-{}-{}-{}",
        std::process::id(),
        spec.replace([':', ','], "_"),
        stage
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let start = Instant::now();
    let mut child = Command::new(MADRUN)
        .args(["-n", "2", "--timeout", "60", "--grace", "20", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "fault_child",
            "--ignored",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MAD_FAULT_STAGE", stage)
        .env("MAD_FAULT_SPEC", spec)
        .env("MAD_FAULT_DIR", &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (t_out.join().unwrap(), t_err.join().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let ctx = format!("{spec}/{stage}: status {status:?}\nstdout:\n{out}\nstderr:\n{err}");
    // madrun names the dead rank and the signal, and exits 128 + SIGKILL.
    assert!(
        err.contains("rank 1") && err.contains("SIGKILL"),
        "madrun did not report rank 1's death: {ctx}"
    );
    assert_eq!(status.code(), Some(137), "{ctx}");
    let line = out
        .lines()
        .filter(|l| l.starts_with("[0] "))
        .find_map(|l| l.find("FAULT stage=").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("survivor did not report an error: {ctx}"));
    assert!(!out.contains("CORRUPT"), "{ctx}");
    let after: u128 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("after_ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no after_ms: {ctx}"));
    assert!(after <= BOUND_MS, "error {after} ms after the death: {ctx}");
    eprintln!("{line}");
    after
}

macro_rules! death_cases {
    ($($name:ident: $spec:expr, $stage:expr;)*) => {$(
        #[test]
        fn $name() {
            case($spec, $stage);
        }
    )*};
}

#[cfg(feature = "sisci")]
death_cases! {
    sisci_local_idle: "sisci:local", "idle";
    sisci_local_mid: "sisci:local", "mid";
    sisci_local_large: "sisci:local", "large";
    sisci_local_recv_dead: "sisci:local", "recv_dead";
}

death_cases! {
    tcp_idle: "tcp", "idle";
    tcp_mid: "tcp", "mid";
    tcp_large: "tcp", "large";
    tcp_recv_dead: "tcp", "recv_dead";
    shm_idle: "shm", "idle";
    shm_mid: "shm", "mid";
    shm_large: "shm", "large";
    shm_cma_large: "shm,cma=always", "large";
    shm_cma_recv_dead: "shm,cma=always", "recv_dead";
    shm_recv_dead: "shm", "recv_dead";
    via_soft_idle: "via:soft", "idle";
    via_soft_mid: "via:soft", "mid";
    via_soft_large: "via:soft", "large";
    via_soft_recv_dead: "via:soft", "recv_dead";
}
