//! Multi-process jobs for the drivers' own process tests: start ranks as child processes
//! ([`Launch`]), wait for them with a bound, and the `/dev/shm`-full job shared by the
//! host-memory drivers (a private mount namespace with a small tmpfs, an all-to-all rank
//! program, the checks of its outcome). Driver crates pass what differs (their segment names,
//! their launch).

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::auth::Secret;
use crate::bootstrap::Bootstrap;
use crate::launch::server::BootstrapServer;
use crate::launch::{vars, MadrunBootstrap, MadrunEnv};
use crate::{Channel, ChannelConfig, RecvMode, SendMode, Session};

/// How a driver's process tests start ranks: the test binary re-executed, running its ignored
/// test `rank_test` with the role and the driver spec in two environment variables, every rank
/// joined through a madrun bootstrap server in the test process.
///
/// ```no_run
/// use mad_core::conformance::jobs::Launch;
/// use mad_core::{bootstrap::Bootstrap, mem::MemDriver, Result, Session};
///
/// fn session(b: Box<dyn Bootstrap>) -> Result<Session> {
///     Session::builder().driver(MemDriver).bootstrap(b).build()
/// }
/// const LAUNCH: Launch = Launch::new("rank_program", "MY_TEST_ROLE", "MY_TEST_SPEC", session);
///
/// #[test]
/// #[ignore = "rank program of the process tests"]
/// fn rank_program() {
///     let Some((role, spec)) = LAUNCH.role() else { return };
///     let session = LAUNCH.child_session();
///     assert!(mad_core::conformance::death::rank_role(&session, &role, &spec));
/// }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    /// The ignored test of the driver's test binary that runs a rank's program.
    pub rank_test: &'static str,
    /// The variable that passes the role to a rank.
    pub role_var: &'static str,
    /// The variable that passes the driver spec to a rank.
    pub spec_var: &'static str,
    /// A session of this driver over `b`.
    pub session: fn(Box<dyn Bootstrap>) -> crate::Result<Session>,
    /// Entries the driver leaves in `/dev/shm` (or elsewhere) created by any of these pids:
    /// checked empty once the ranks are gone. Default: none.
    pub leftovers: fn(&[u32]) -> Vec<String>,
    /// Bound on a rank's run.
    pub child_bound: Duration,
    /// Bound on noticing a dead peer while blocked on it (the peer-death shapes).
    pub death_bound: Duration,
}

fn no_leftovers(_: &[u32]) -> Vec<String> {
    Vec::new()
}

impl Launch {
    /// A launch with 240 s per rank, 5 s to notice a dead peer, and no leftover check.
    pub const fn new(
        rank_test: &'static str,
        role_var: &'static str,
        spec_var: &'static str,
        session: fn(Box<dyn Bootstrap>) -> crate::Result<Session>,
    ) -> Self {
        Launch {
            rank_test,
            role_var,
            spec_var,
            session,
            leftovers: no_leftovers,
            child_bound: Duration::from_secs(240),
            death_bound: Duration::from_secs(5),
        }
    }

    /// Check what the driver leaves behind (see [`Launch::leftovers`]).
    #[must_use]
    pub const fn with_leftovers(mut self, f: fn(&[u32]) -> Vec<String>) -> Self {
        self.leftovers = f;
        self
    }

    /// Another bound on noticing a dead peer (see [`Launch::death_bound`]).
    #[must_use]
    pub const fn with_death_bound(mut self, d: Duration) -> Self {
        self.death_bound = d;
        self
    }

    /// In a rank started by this launch: its role and spec. `None` in a test run that is not
    /// one (the rank-program test then returns at once).
    pub fn role(&self) -> Option<(String, String)> {
        let role = std::env::var(self.role_var).ok()?;
        Some((role, std::env::var(self.spec_var).unwrap_or_default()))
    }

    /// In a rank started by this launch: its session.
    ///
    /// # Panics
    ///
    /// When the madrun variables are missing or the session cannot be built.
    pub fn child_session(&self) -> Session {
        let b = MadrunBootstrap::from_env()
            .expect("madrun bootstrap")
            .expect("started as a rank (madrun variables)");
        (self.session)(Box::new(b)).expect("the rank's session")
    }

    fn env_of(addr: &str, secret: &Secret, rank: usize, size: usize) -> HashMap<String, String> {
        HashMap::from([
            (vars::RANK.to_string(), rank.to_string()),
            (vars::SIZE.to_string(), size.to_string()),
            (vars::BOOTSTRAP.to_string(), addr.to_string()),
            (vars::SECRET.to_string(), secret.to_hex()),
            (vars::LOCAL_SIZE.to_string(), size.to_string()),
        ])
    }

    fn spawn(&self, role: &str, spec: &str, env: &HashMap<String, String>) -> Child {
        Command::new(std::env::current_exe().expect("test binary path"))
            .args([
                "--ignored",
                "--exact",
                self.rank_test,
                "--nocapture",
                "--test-threads=1",
            ])
            .envs(env)
            .env(self.role_var, role)
            .env(self.spec_var, spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning a rank")
    }

    /// Start a job of `roles.len()` ranks over `spec`: rank `r` runs `roles[r]` in a child
    /// process, except rank 0 when `roles[0]` is `None` (this process: its session is
    /// returned). The bootstrap server serves until this process exits.
    ///
    /// # Panics
    ///
    /// When the server, a child or this process's session cannot be started.
    pub fn job(
        &self,
        roles: &[Option<&str>],
        spec: &str,
    ) -> (Vec<(usize, Child)>, Option<Session>) {
        let n = roles.len();
        let secret = Secret::random().expect("a secret");
        let server = BootstrapServer::start(
            "127.0.0.1:0".parse().expect("an address"),
            n,
            secret.clone(),
            Box::new(|l| tracing::info!("{l}")),
        )
        .expect("the bootstrap server");
        let addr = server.advertised_addr().to_string();
        let kids: Vec<(usize, Child)> = roles
            .iter()
            .enumerate()
            .filter_map(|(r, role)| {
                role.map(|role| {
                    (
                        r,
                        self.spawn(role, spec, &Self::env_of(&addr, &secret, r, n)),
                    )
                })
            })
            .collect();
        let me = roles[0].is_none().then(|| {
            let env0 = Self::env_of(&addr, &secret, 0, n);
            let env = MadrunEnv::parse(|k| env0.get(k).cloned())
                .expect("rank 0's variables")
                .expect("rank 0's variables");
            let b = MadrunBootstrap::connect(env).expect("rank 0's bootstrap");
            (self.session)(Box::new(b)).expect("rank 0's session")
        });
        std::mem::forget(server); // serves until the test process exits
        (kids, me)
    }

    /// [`job`](Self::job) with this process as rank 0 and children of `roles` as ranks 1, 2...
    ///
    /// # Panics
    ///
    /// As [`job`](Self::job).
    pub fn job_with_me(&self, roles: &[&str], spec: &str) -> (Vec<(usize, Child)>, Session) {
        let mut all = vec![None];
        all.extend(roles.iter().map(|r| Some(*r)));
        let (kids, me) = self.job(&all, spec);
        (kids, me.expect("rank 0 is this process"))
    }

    /// Wait for a rank, at most [`child_bound`](Launch::child_bound) (then kill it): whether
    /// it succeeded, and its standard output (`timed out` when killed).
    ///
    /// # Panics
    ///
    /// When the child cannot be waited for.
    pub fn wait(&self, mut c: Child) -> (bool, String) {
        let end = Instant::now() + self.child_bound;
        loop {
            if let Some(st) = c.try_wait().expect("try_wait") {
                let mut out = String::new();
                if let Some(mut o) = c.stdout.take() {
                    let _ = std::io::Read::read_to_string(&mut o, &mut out);
                }
                return (st.success(), out);
            }
            if Instant::now() > end {
                let _ = c.kill();
                let _ = c.wait();
                return (false, "timed out".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait for every rank; returns their outputs, asserting that each succeeded and that
    /// none left anything behind ([`leftovers`](Launch::leftovers)).
    ///
    /// # Panics
    ///
    /// When a rank failed or left something behind (a test helper: the panic is the test's
    /// failure).
    pub fn finish(&self, kids: Vec<(usize, Child)>, what: &str) -> Vec<String> {
        let pids: Vec<u32> = kids.iter().map(|(_, c)| c.id()).collect();
        let outs = kids
            .into_iter()
            .map(|(r, c)| {
                let (ok, out) = self.wait(c);
                assert!(ok, "{what}: rank {r} failed:\n{out}");
                out
            })
            .collect();
        let left = (self.leftovers)(&pids);
        assert!(
            left.is_empty(),
            "{what}: the ranks {pids:?} left {left:?} behind"
        );
        outs
    }

    /// The conformance kit over `spec` on `n` child processes (their rank program runs
    /// [`run_rank`](super::run_rank) for the role `kit`, printing `kit: rank R ran`); then
    /// nothing left behind.
    ///
    /// # Panics
    ///
    /// When a rank failed (a test helper: the panic is the test's failure).
    pub fn kit_processes(&self, n: usize, spec: &str) {
        let (kids, _) = self.job(&vec![Some("kit"); n], spec);
        let outs = self.finish(kids, &format!("{spec} x{n} processes"));
        for (r, out) in outs.iter().enumerate() {
            assert!(out.contains(&format!("kit: rank {r} ran ")), "{out}");
        }
    }
}

/// The rank program of [`Launch::kit_processes`]: the kit over `spec`, 100 messages of
/// volume, then a line `kit: rank R ran N cases`.
///
/// # Panics
///
/// When the kit fails (a test helper: the panic is the rank's failure).
pub fn kit_role(session: &Session, spec: &str) {
    let mut opts = super::KitOptions::new(spec);
    opts.volume = 100;
    let ran =
        super::run_rank(session, &opts).unwrap_or_else(|e| panic!("rank {}: {e}", session.rank()));
    println!("kit: rank {} ran {} cases", session.rank(), ran.len());
}

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
