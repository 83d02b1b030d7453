//! Every binary and example answers `--help` and `--version` (exit 0, on stdout), takes
//! `--opt=value` like `--opt value`, and refuses an unknown option with a message naming it
//! (exit 2): the one parser of `mad_core::cli`.
//!
//! The binaries of this package come from `CARGO_BIN_EXE_*`. `mad-bench` (package mad-bench),
//! `rpc-bench` (package mad-rpc-bench) and the examples of every crate but mad-mpi (which needs
//! an MPI; `.ci/mpi.sh` runs its examples) are looked up in this target directory, where `cargo
//! test --workspace` builds them before running any test; run that (or `cargo build --workspace
//! --exclude mad-mpi --examples --bins`) before `cargo test --test cli` alone. mad-bench's own
//! options are checked by its tests (`mad-bench/tests/cli.rs`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `target/<profile>/` of this test binary (`target/<profile>/deps/cli-*`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// The examples of every crate of the workspace but mad-mpi, from the source tree.
fn example_names() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs = vec![root.join("examples")];
    for e in std::fs::read_dir(root).expect("workspace root").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("mad-") && name != "mad-mpi" && e.path().join("examples").is_dir() {
            dirs.push(e.path().join("examples"));
        }
    }
    let mut names = Vec::new();
    for d in dirs {
        for f in std::fs::read_dir(&d).expect("examples dir").flatten() {
            let p = f.path();
            if p.extension().is_some_and(|x| x == "rs") {
                names.push(p.file_stem().unwrap().to_string_lossy().into_owned());
            }
        }
    }
    names.sort();
    assert!(names.len() >= 8, "too few examples found: {names:?}");
    names
}

/// (name, path) of every program to check.
fn programs() -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> = vec![
        ("madrun".into(), env!("CARGO_BIN_EXE_madrun").into()),
        ("mad-info".into(), env!("CARGO_BIN_EXE_mad-info").into()),
    ];
    let dir = profile_dir();
    let mut missing = Vec::new();
    for name in ["mad-bench", "rpc-bench"] {
        let p = dir.join(name);
        if p.is_file() {
            v.push((name.into(), p));
        } else {
            missing.push(p);
        }
    }
    for name in example_names() {
        let p = dir.join("examples").join(&name);
        if p.is_file() {
            v.push((name, p));
        } else {
            missing.push(p);
        }
    }
    assert!(
        missing.is_empty(),
        "not built: {missing:?}\n(run `cargo build --workspace --exclude mad-mpi --examples \
         --bins` first, or the whole `cargo test --workspace --exclude mad-mpi`)"
    );
    v
}

fn run(exe: &Path, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        // Not part of a session: a program that got past its options would start ranks.
        .env_remove("MAD_BOOTSTRAP")
        .env_remove("MAD_RANK")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_program_answers_help_and_version() {
    for (name, exe) in programs() {
        for flag in ["--help", "-h"] {
            let o = run(&exe, &[flag]);
            let out = text(&o.stdout);
            assert_eq!(
                o.status.code(),
                Some(0),
                "{name} {flag}: {}",
                text(&o.stderr)
            );
            assert!(out.lines().count() >= 3, "{name} {flag}: {out:?}");
            assert!(out.contains("--help"), "{name} {flag} lists --help: {out}");
            assert!(
                out.contains("--version"),
                "{name} {flag} lists --version: {out}"
            );
        }
        for flag in ["--version", "-V"] {
            let o = run(&exe, &[flag]);
            assert_eq!(
                o.status.code(),
                Some(0),
                "{name} {flag}: {}",
                text(&o.stderr)
            );
            assert_eq!(
                text(&o.stdout).trim(),
                format!("{name} {VERSION}"),
                "{name} {flag}"
            );
        }
    }
}

#[test]
fn every_program_refuses_an_unknown_option() {
    for (name, exe) in programs() {
        let o = run(&exe, &["--no-such-option"]);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert!(
            err.starts_with(&format!("{name}: ")),
            "{name} names itself: {err}"
        );
        assert!(err.contains("--no-such-option"), "{name}: {err}");
        assert!(err.contains("--help"), "{name} points to --help: {err}");
        assert!(o.stdout.is_empty(), "{name}: {}", text(&o.stdout));
    }
}

/// `--opt=value` and `--opt value` alike; a bad value names its option.
#[test]
fn values_inline_or_apart() {
    let madrun = Path::new(env!("CARGO_BIN_EXE_madrun"));
    let o = run(madrun, &["--timeout=5", "-n=1", "--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let info = Path::new(env!("CARGO_BIN_EXE_mad-info"));
    for args in [&["--channel=mem"][..], &["--channel", "mem"]] {
        let o = run(info, args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", text(&o.stderr));
        assert!(text(&o.stdout).contains("channel `info`"), "{args:?}");
    }
    let pingpong = profile_dir().join("examples/pingpong");
    if pingpong.is_file() {
        let o = run(&pingpong, &["--max=64k", "--iters=3", "--", "--help"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        let o = run(&pingpong, &["--iters=lots"]);
        assert_eq!(o.status.code(), Some(2));
        assert!(text(&o.stderr).contains("--iters lots"));
    }
}
