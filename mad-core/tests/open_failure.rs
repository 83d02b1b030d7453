//! A channel open that fails on one rank must fail on the others, promptly and naming it
//! (threads of one process, `ThreadBootstrap`; the same over `madrun` processes and real
//! drivers is in the workspace's `tests/open_failure.rs`).
//!
//! The driver under test wraps the in-process `mem` driver: it runs two bootstrap collectives
//! of its own, then `mem`'s open (two more), and on the chosen rank fails at the chosen step.
//! Every wait is bounded: a hang is a failure after `LIMIT`, not a stuck test.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::driver::{Capabilities, Driver, OpenContext, OpenedChannel, TmTable};
use mad_core::mem::MemDriver;
use mad_core::{ChannelConfig, Error, Result, Session};

/// Bound on every wait: far above what an open takes, far below the bootstrap's own 60 s.
const LIMIT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Before any collective of the driver (the engine's fingerprint exchange is done).
    Start,
    /// Between the driver's first and second collective.
    Between,
    /// After the driver's last collective: its open "succeeded" and then failed.
    AfterLast,
}

struct Flaky {
    fail_rank: usize,
    at: Step,
}

fn injected() -> Error {
    Error::Resource("flaky: socket: Too many open files (os error 24), injected".into())
}

impl Driver for Flaky {
    fn name(&self) -> &'static str {
        "flaky"
    }
    fn describe(&self) -> String {
        "flaky: mem, failing on one rank".into()
    }
    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        MemDriver.tm_table(config)
    }
    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        MemDriver.capabilities(config)
    }
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let b = ctx.bootstrap;
        let fails = |s: Step| b.rank() == self.fail_rank && self.at == s;
        if fails(Step::Start) {
            return Err(injected());
        }
        b.allgather(&ctx.tag("one"), b"1")?;
        if fails(Step::Between) {
            return Err(injected());
        }
        b.allgather(&ctx.tag("two"), b"2")?;
        let opened = MemDriver.open(ctx)?;
        if fails(Step::AfterLast) {
            return Err(injected());
        }
        Ok(opened)
    }
}

/// Open channel `name` over `flaky` on `n` thread ranks; returns each rank's outcome and how
/// long it took, or panics if a rank is still inside its open after `LIMIT`.
fn open_all(n: usize, name: &str, spec: &str, at: Step) -> Vec<(Result<()>, Duration)> {
    let (tx, rx) = mpsc::channel();
    for b in ThreadBootstrap::group(n) {
        let tx = tx.clone();
        let (name, spec) = (name.to_string(), spec.to_string());
        std::thread::spawn(move || {
            let s = Session::builder()
                .driver(Flaky { fail_rank: 1, at })
                .bootstrap(Box::new(b))
                .build()
                .unwrap();
            let t = Instant::now();
            let r = s
                .open_channel_with(ChannelConfig::parse(&name, &spec).unwrap())
                .map(drop);
            let _ = tx.send((s.rank(), r, t.elapsed()));
        });
    }
    let mut out: Vec<Option<(Result<()>, Duration)>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (rank, r, took) = rx
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("{at:?}: a rank is still opening after {LIMIT:?}: hang"));
        out[rank] = Some((r, took));
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// Rank 1 reports its own error; every other rank reports rank 1's, by rank and text.
fn check(at: Step, out: &[(Result<()>, Duration)]) {
    for (rank, (r, took)) in out.iter().enumerate() {
        let e = r.as_ref().expect_err("the open must fail everywhere");
        let text = e.to_string();
        assert!(*took < LIMIT, "{at:?}: rank {rank} took {took:?}");
        if rank == 1 {
            assert!(text.contains("injected"), "{at:?}: rank 1: {text}");
            continue;
        }
        assert!(
            text.contains("channel `c`: open failed on rank 1") && text.contains("injected"),
            "{at:?}: rank {rank}: {text}"
        );
        match e {
            Error::RemoteFailure {
                rank: 1,
                kind,
                message,
                ..
            } => {
                assert_eq!(kind, "Resource");
                assert!(message.contains("Too many open files"), "{message}");
            }
            other => panic!("{at:?}: rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_failing_before_its_first_collective_fails_the_others() {
    check(Step::Start, &open_all(3, "c", "flaky", Step::Start));
}

#[test]
fn a_rank_failing_between_collectives_fails_the_others() {
    check(Step::Between, &open_all(3, "c", "flaky", Step::Between));
}

#[test]
fn a_rank_failing_after_the_last_collective_fails_the_others() {
    // The engine's closing vote is what the other ranks wait in.
    check(Step::AfterLast, &open_all(3, "c", "flaky", Step::AfterLast));
}

/// `mem`, failing the first open on rank 1 only.
struct FailOnce(AtomicBool);

impl Driver for FailOnce {
    fn name(&self) -> &'static str {
        "fail-once"
    }
    fn describe(&self) -> String {
        "fail-once: mem whose first open fails on rank 1".into()
    }
    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        MemDriver.tm_table(config)
    }
    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        MemDriver.capabilities(config)
    }
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        if ctx.bootstrap.rank() == 1 && !self.0.swap(true, Ordering::Relaxed) {
            return Err(injected());
        }
        MemDriver.open(ctx)
    }
}

#[test]
fn a_retry_after_a_failed_open_uses_fresh_collectives() {
    // The same channel opened twice in each rank: the first attempt fails (rank 1), the
    // second succeeds everywhere: the failed attempt's abandoned collectives do not leak
    // into it.
    let (tx, rx) = mpsc::channel();
    for b in ThreadBootstrap::group(2) {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let s = Session::builder()
                .driver(FailOnce(AtomicBool::new(false)))
                .bootstrap(Box::new(b))
                .build()
                .unwrap();
            let cfg = || ChannelConfig::parse("r", "fail-once").unwrap();
            let first = s.open_channel_with(cfg()).map(drop);
            let second = s.open_channel_with(cfg()).map(drop);
            let _ = tx.send((s.rank(), first, second));
        });
    }
    for _ in 0..2 {
        let (rank, first, second) = rx.recv_timeout(LIMIT).expect("hang");
        assert!(first.is_err(), "rank {rank}: first attempt {first:?}");
        second.unwrap_or_else(|e| panic!("rank {rank}: retry: {e}"));
    }
}

#[test]
fn a_rank_that_never_opens_is_named_at_the_deadline() {
    let (tx, rx) = mpsc::channel();
    let mut bs = ThreadBootstrap::group(3);
    // Rank 2 never opens the channel (it stays alive, busy elsewhere).
    let _late = bs.pop().unwrap();
    for b in bs {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let s = Session::builder()
                .driver(MemDriver)
                .bootstrap(Box::new(b))
                .build()
                .unwrap();
            let r =
                s.open_channel_with(ChannelConfig::parse("d", "mem,open_timeout_ms=500").unwrap());
            let _ = tx.send((s.rank(), r.map(drop)));
        });
    }
    for _ in 0..2 {
        let (rank, r) = rx
            .recv_timeout(LIMIT)
            .expect("the open deadline did not fire");
        let e = r.expect_err("open without rank 2");
        assert!(
            e.to_string().contains("waiting for rank 2"),
            "rank {rank}: {e}"
        );
        match e {
            Error::CollectiveTimeout { missing, after, .. } => {
                assert_eq!(missing, vec![2]);
                assert_eq!(after, Duration::from_millis(500));
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}
