//! Multi-process jobs for the drivers' own process tests: start ranks as child processes,
//! wait for them with a bound, and the `/dev/shm`-full job shared by the host-memory drivers
//! (a private mount namespace with a small tmpfs, an all-to-all rank program, the checks of
//! its outcome). Driver crates pass what differs (their segment names, their launch).

use crate::{Channel, ChannelConfig, RecvMode, SendMode, Session};

/// The byte pattern of the all-to-all messages (seeded per sender, receiver and round).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Run this test binary's ignored test `test` in a private mount namespace whose `/dev/shm` is
/// a fresh tmpfs of `size` (e.g. `64m`, Docker's default), with `env` set. `None` (after
/// logging why, `warn`) when this process may not unshare or mount (not root, no `unshare(1)`): the
/// caller skips. Otherwise the child's output, whose status says whether `test` passed.
///
/// # Panics
///
/// When the path of the test binary cannot be found.
pub fn in_small_dev_shm(size: &str, test: &str, env: (&str, &str)) -> Option<std::process::Output> {
    use std::process::Command;
    let probe = Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg("mount -t tmpfs -o size=1m tmpfs /dev/shm")
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            tracing::warn!(
                "SKIPPED: cannot mount a private /dev/shm (unshare -m; needs root): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return None;
        }
        Err(e) => {
            tracing::warn!("SKIPPED: cannot run unshare(1): {e}");
            return None;
        }
    }
    let exe = std::env::current_exe().expect("test binary path");
    let script = format!(
        "mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99; \
         exec \"$0\" --ignored --exact {test} --nocapture --test-threads=1"
    );
    Some(
        Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .arg(exe)
            .env(env.0, env.1)
            .output()
            .expect("running unshare"),
    )
}

/// How a rank of [`wait_job`] ended.
#[derive(Debug)]
pub struct Ended {
    /// Its rank.
    pub rank: usize,
    /// Its pid.
    pub pid: u32,
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal that ended it, if one did (`SIGKILL` for a rank torn down by [`wait_job`]).
    pub signal: Option<i32>,
    /// Whether [`wait_job`] killed it.
    pub torn_down: bool,
    /// Its standard output.
    pub out: String,
}

/// Wait for every rank of a job; once one has failed, give the others `grace` to end (as
/// madrun does), then kill them. Bounded by `bound` in all.
///
/// # Panics
///
/// When a rank cannot be waited for or killed.
pub fn wait_job(
    kids: Vec<(usize, std::process::Child)>,
    grace: std::time::Duration,
    bound: std::time::Duration,
) -> Vec<Ended> {
    use std::os::unix::process::ExitStatusExt;
    use std::time::Instant;
    let end = Instant::now() + bound;
    let mut kill_at: Option<Instant> = None;
    let mut live: Vec<(usize, std::process::Child)> = kids;
    let mut done = Vec::new();
    while !live.is_empty() {
        let mut i = 0;
        while i < live.len() {
            let st = live[i].1.try_wait().expect("try_wait");
            let late = Instant::now() > end || kill_at.is_some_and(|t| Instant::now() > t);
            if st.is_none() && !late {
                i += 1;
                continue;
            }
            let (rank, mut c) = live.swap_remove(i);
            let torn_down = st.is_none();
            let st = match st {
                Some(st) => st,
                None => {
                    let _ = c.kill();
                    c.wait().expect("wait")
                }
            };
            if !st.success() && kill_at.is_none() {
                kill_at = Some(Instant::now() + grace);
            }
            let mut out = String::new();
            if let Some(mut o) = c.stdout.take() {
                let _ = std::io::Read::read_to_string(&mut o, &mut out);
            }
            done.push(Ended {
                rank,
                pid: c.id(),
                code: st.code(),
                signal: st.signal(),
                torn_down,
                out,
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    done.sort_by_key(|e| e.rank);
    done
}

/// The checks of a job run on a `/dev/shm` too small for it: no rank died of `SIGBUS`, at least
/// one failed its open with `Resource` naming `/dev/shm` and the bytes needed, and none of those
/// left a segment behind (`segments_of`). Every other rank either finished (`done_line`),
/// failed its open too, or was torn down / failed after a failing rank.
///
/// # Panics
///
/// When a check fails (a test helper: the panic is the test's failure).
pub fn check_no_space_job(
    ended: &[Ended],
    done_line: &str,
    segments_of: impl Fn(&[u32]) -> Vec<String>,
) {
    const SIGBUS: i32 = 7;
    let summary: Vec<String> = ended
        .iter()
        .map(|e| {
            format!(
                "rank {} (pid {}): code {:?} signal {:?}{}: {}",
                e.rank,
                e.pid,
                e.code,
                e.signal,
                if e.torn_down { " (torn down)" } else { "" },
                e.out.lines().last().unwrap_or("")
            )
        })
        .collect();
    let summary = summary.join("\n");
    tracing::info!("dev/shm-full job:\n{summary}");
    assert!(
        ended.iter().all(|e| e.signal != Some(SIGBUS)),
        "a rank died of SIGBUS:\n{summary}"
    );
    let no_space: Vec<&Ended> = ended
        .iter()
        .filter(|e| e.out.contains("Resource("))
        .collect();
    assert!(
        !no_space.is_empty(),
        "no rank failed its open with Resource:\n{summary}"
    );
    for e in &no_space {
        for want in [
            "Resource(",
            "/dev/shm is too small",
            " free of ",
            "needs ",
            "--shm-size",
        ] {
            assert!(
                e.out.contains(want),
                "rank {}: no `{want}` in its error:\n{}",
                e.rank,
                e.out
            );
        }
    }
    // Every rank whose open returned an error (Resource, or the job's failure reported by
    // the bootstrap) removed its segment.
    let pids: Vec<u32> = ended
        .iter()
        .filter(|e| e.out.contains("OPENFAIL"))
        .map(|e| e.pid)
        .collect();
    let left = segments_of(&pids);
    assert!(
        left.is_empty(),
        "ranks whose open failed left segments: {left:?}"
    );
    for e in ended {
        assert!(
            e.out.contains(done_line)
                || e.out.contains("OPENFAIL")
                || e.torn_down
                || e.code != Some(0),
            "rank {}: neither finished nor failed:\n{summary}",
            e.rank
        );
    }
}

/// The rank program of the `/dev/shm`-full tests: open (printing `OPENFAIL` with the error and
/// exiting 3 if that fails), then `rounds` rounds of `size`-byte messages from every rank to
/// every other, each checked.
///
/// # Panics
///
/// When a message differs from what was sent, or a receive fails after the open (a test helper: the
/// panic is the test's failure).
pub fn all_to_all(session: &Session, spec: &str, size: usize, rounds: usize) {
    let (me, n) = (session.rank(), session.size());
    let ch = match session.open_channel_with(ChannelConfig::parse("full", spec).unwrap()) {
        Ok(ch) => ch,
        Err(e) => {
            println!("OPENFAIL rank {me} pid {}: {e:?} ({e})", std::process::id());
            std::process::exit(3);
        }
    };
    for round in 0..rounds {
        std::thread::scope(|s| {
            // Sends in a thread of their own, so that no rank waits for room while its peers
            // wait for it.
            s.spawn(|| {
                for k in 1..n {
                    let to = (me + k) % n;
                    let body = pattern(size, (me * 7 + to + round) as u8);
                    let mut p = ch.begin_packing(to).unwrap();
                    p.pack(&body, RecvMode::Cheaper).unwrap();
                    p.end_packing().unwrap();
                }
            });
            receive_all(&ch, me, n, size, round);
        });
    }
    println!("all-to-all: rank {me} done");
}

fn receive_all(ch: &Channel, me: usize, n: usize, size: usize, round: usize) {
    {
        for k in 1..n {
            let from = (me + n - k) % n;
            let mut got = vec![0u8; size];
            let mut u = ch.begin_unpacking_from(from).unwrap();
            u.unpack(&mut got, SendMode::Cheaper).unwrap();
            u.end_unpacking().unwrap();
            assert!(
                got == pattern(size, (from * 7 + me + round) as u8),
                "rank {me}: message from {from} altered"
            );
        }
    }
}

/// Message size and rounds of a `/dev/shm`-full job's role `all-to-all:<size>:<rounds>`.
pub fn all_to_all_role(role: &str) -> Option<(usize, usize)> {
    let mut it = role.strip_prefix("all-to-all:")?.split(':');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}
