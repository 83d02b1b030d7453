//! The `mad-bench` binary: its command line (`--opt=value` like `--opt value`, a bad value names
//! its option), and a real run of two ranks it starts itself whose CSV `mad-bench report` reads.
//! (The umbrella package's `tests/cli.rs` checks `--help`, `--version` and an unknown option of
//! every program of the workspace, this one included.)

use std::path::Path;
use std::process::{Command, Output};

const BENCH: &str = env!("CARGO_BIN_EXE_mad-bench");

fn run(args: &[&str]) -> Output {
    Command::new(BENCH)
        .args(args)
        // Not part of a session: run alone, mad-bench starts its own ranks.
        .env_remove("MAD_BOOTSTRAP")
        .env_remove("MAD_RANK")
        .output()
        .unwrap_or_else(|e| panic!("running {BENCH}: {e}"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn values_inline_or_apart() {
    for args in [
        &["--max=64k", "--help"][..],
        &["--max", "64k", "--help"],
        &["run", "--quick", "--runs=2", "--time=0.5", "--help"],
        &["report", "--out=/nonexistent", "--help"],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", text(&o.stderr));
    }
    for (args, opt) in [
        (&["--max=64q"][..], "--max 64q"),
        (&["--max"], "--max"),
        (&["--runs=0"], "--runs 0"),
        (&["--quick=1"], "--quick"),
        (&["--modes=1"], "--modes 1"),
    ] {
        let o = run(args);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(opt), "{args:?}: {err}");
    }
}

/// Two ranks started by mad-bench itself, tiny counts; the CSV it appends is what `report`
/// reads.
#[test]
fn a_quick_run_alone_and_its_report() {
    let dir = std::env::temp_dir().join(format!("mad-bench-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let csv = dir.join("pair.csv");
    let o = run(&[
        "--quick",
        "--div=10000",
        "--no-pin",
        "--bench=latency,bw",
        "--channels=shm,timeout_ms=60000",
        "--baselines=raw-shm,memcpy",
        "--max=4k",
        &format!("--csv={}", csv.display()),
    ]);
    let out = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}\n{}", text(&o.stderr));
    let rows = std::fs::read_to_string(&csv).expect("the CSV");
    for imp in ["shm,timeout_ms=60000", "raw-shm", "memcpy"] {
        assert!(
            rows.lines()
                .any(|l| l.starts_with("latency,") && l.contains(imp)),
            "no latency row of {imp}:\n{rows}"
        );
    }
    assert!(rows.lines().any(|l| l.starts_with("bw,")), "{rows}");
    let out_dir = dir.join("report");
    let o = run(&[
        "report",
        "--out",
        out_dir.to_str().expect("utf-8 path"),
        csv.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let md = std::fs::read_to_string(Path::new(&out_dir).join("results.md")).expect("results.md");
    assert!(md.contains("raw-shm"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
}
