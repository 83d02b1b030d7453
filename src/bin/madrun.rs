//! `madrun`: start an N-process Madeleine job on this host.
//!
//! ```text
//! madrun -n N [--timeout SECS] [--grace SECS] [--keep-going] [--no-prefix] [--bind ADDR]
//!        [--channel NAME=SPEC]... [--checked] [--progress MODE] [--] program [args...]
//! ```
//!
//! madrun runs the bootstrap server (`mad_core::launch::server`), starts N children with the
//! `MAD_*` environment (see `mad_core::launch`), prefixes their output with `[rank] `,
//! forwards SIGINT/SIGTERM/SIGHUP to them (a second such signal kills them), and exits with the
//! status of the **first** child that failed (128+S for a child killed by signal S), 0 if none
//! did. "First" is by time of death as the kernel reports it to madrun (a pidfd per child in an
//! epoll set, [`sys::DeathOrder`]): when a rank is killed and its peers then fail because it
//! vanished, the killed rank is the one reported, whatever the rank numbers. When a child
//! fails, the others get SIGTERM, then SIGKILL after `--grace` seconds, unless `--keep-going`
//! (alias `--disable-auto-cleanup`, Hydra's name) is given: then the others keep running (a
//! fault-tolerant program sees the death through its channels) and madrun waits for all of
//! them. `--timeout` bounds the whole job (exit 124). Bad usage exits 2.
//!
//! Children never outlive madrun: they run in their own process group, which madrun kills on
//! the way out, and each has `PR_SET_PDEATHSIG = SIGKILL` in case madrun itself is killed.
//! Children are not reaped until the end, so their zombies keep the process group (and its id)
//! alive while madrun may still signal it.

#![deny(unsafe_code)]

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mad_core::auth::{fill_random, Secret};
use mad_core::cli::lexopt;
use mad_core::config::{env_key, ChannelConfig};
use mad_core::launch::server::BootstrapServer;
use mad_core::launch::{vars, wire::MAX_RANKS};
use mad_core::progress::ProgressPolicy;

const USAGE: &str =
    "usage: madrun -n N [--timeout SECS] [--grace SECS] [--keep-going] [--no-prefix]
              [--bind ADDR] [--channel NAME=SPEC]... [--checked] [--progress MODE]
              [--] program [args...]

  -n, --np N            number of processes (1..=4096)
  --timeout SECS        wall-clock limit for the whole job; on expiry kill all, exit 124
  --grace SECS          after a failure, wait this long between SIGTERM and SIGKILL (default 2)
  --keep-going          when a rank fails, let the others run on (fault-tolerant programs see
                        the death through their channels) and wait for every rank
                        (alias --disable-auto-cleanup)
  --no-prefix           do not prefix output lines with `[rank] `
  --bind ADDR           bootstrap server address (default 127.0.0.1:0)
  --channel NAME=SPEC   define channel NAME (sets MAD_CHANNEL_<NAME>=SPEC), e.g. video=shm
  --checked             checked mode on every channel (MAD_CHECKED=1)
  --progress MODE       progress policy of every channel opened by name: poll, block or
                        adaptive (MAD_PROGRESS)

madrun reports the first rank that failed (by time of death) and exits with its status
(128+N when killed by signal N), 0 when every rank succeeded.

Options take their value as `--opt value` or `--opt=value`. -h, --help prints this text;
-V, --version the version.";

/// Every system call of madrun: through `nix` where it has the call, raw `libc` (with its
/// `unsafe`) for the two it has not (`pidfd_open`, and a `waitid` that reports a death by a
/// real-time signal).
#[allow(unsafe_code)]
mod sys {
    use std::io;
    use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::sync::atomic::{AtomicU64, Ordering};

    use nix::errno::Errno;
    use nix::poll::{PollFd, PollFlags};
    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    use nix::sys::signal::{self, SaFlags, SigAction, SigHandler, SigSet, Signal};
    use nix::unistd::{getppid, Pid};

    static PENDING: AtomicU64 = AtomicU64::new(0);

    extern "C" fn on_signal(sig: libc::c_int) {
        // Only an atomic read-modify-write: async-signal-safe.
        if (1..64).contains(&sig) {
            PENDING.fetch_or(1 << sig, Ordering::SeqCst);
        }
    }

    /// Install handlers that record `signals` for [`take_signals`].
    pub fn install_handlers(signals: &[i32]) -> io::Result<()> {
        let sa = SigAction::new(
            SigHandler::Handler(on_signal),
            SaFlags::SA_RESTART,
            SigSet::empty(),
        );
        for &sig in signals {
            let sig = Signal::try_from(sig)?;
            // SAFETY: the handler only touches an atomic (async-signal-safe), and the previous
            // action it replaces is not used afterwards.
            unsafe { signal::sigaction(sig, &sa) }?;
        }
        Ok(())
    }

    /// The signals received since the last call.
    pub fn take_signals() -> Vec<i32> {
        let m = PENDING.swap(0, Ordering::SeqCst);
        (1..64).filter(|s| m & (1 << s) != 0).collect()
    }

    /// Make the child started by `cmd` receive SIGKILL when madrun (its spawning thread) dies.
    pub fn die_with_parent(cmd: &mut Command) {
        let parent = Pid::this();
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // system calls (prctl, getppid) and builds an `io::Error` from a raw code, which does
        // not allocate.
        unsafe {
            cmd.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
                    .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
                // madrun died before the prctl: do not run orphaned.
                if getppid() != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }

    /// Raise the soft limit on open files towards `want` (never above the hard limit);
    /// returns the resulting soft limit.
    pub fn raise_fd_limit(want: libc::rlim_t) -> io::Result<libc::rlim_t> {
        let (cur, max) = getrlimit(Resource::RLIMIT_NOFILE)?;
        if cur >= want {
            return Ok(cur);
        }
        let new = want.min(max);
        setrlimit(Resource::RLIMIT_NOFILE, new, max)?;
        Ok(new)
    }

    /// Send `sig` to every process of the process group `pgid`.
    pub fn kill_group(pgid: u32, sig: i32) -> io::Result<()> {
        let Ok(pg) = libc::pid_t::try_from(pgid) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        // Never 0 (our own group) or 1 (`kill(-1)` = every process we may signal).
        if pg <= 1 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        signal::killpg(Pid::from_raw(pg), Signal::try_from(sig)?)?;
        Ok(())
    }

    /// How a child ended.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Exit {
        /// Exited with this status.
        Code(i32),
        /// Killed by this signal.
        Signal(i32),
    }

    /// Whether child `pid` has ended, without reaping it (its zombie stays, keeping its process
    /// group alive).
    ///
    /// Raw `waitid`: nix's `waitid` cannot report a child killed by a real-time signal (its
    /// `Signal` has no such values and the call fails with EINVAL), which madrun reports as
    /// 128+N like any other.
    pub fn peek_exit(pid: u32) -> io::Result<Option<Exit>> {
        // SAFETY: siginfo_t is plain data; all-zero means "no child reported".
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid, exclusively borrowed siginfo_t for the call.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(e);
        }
        // SAFETY: waitid succeeded, so `info` is either all-zero (nothing to report) or a
        // SIGCHLD siginfo whose pid and status fields are the ones these accessors read.
        let (who, status) = unsafe { (info.si_pid(), info.si_status()) };
        if who == 0 {
            return Ok(None);
        }
        Ok(match info.si_code {
            libc::CLD_EXITED => Some(Exit::Code(status)),
            libc::CLD_KILLED | libc::CLD_DUMPED => Some(Exit::Signal(status)),
            _ => None,
        })
    }

    /// The children's deaths in the order the kernel reported them: one pidfd per child
    /// (`pidfd_open`, readable once the process has exited) in an epoll set. epoll queues
    /// ready descriptors in the order they became ready, so when several children died since
    /// the last look (a rank killed, then the ranks that failed because it vanished), the one
    /// that died first comes first, whatever the rank numbers.
    pub struct DeathOrder {
        ep: Epoll,
        pidfds: Vec<OwnedFd>,
    }

    impl DeathOrder {
        /// An empty set; `Err` where epoll is unavailable.
        pub fn new() -> io::Result<Self> {
            Ok(DeathOrder {
                ep: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?,
                pidfds: Vec::new(),
            })
        }

        /// Report the death of child `pid` as `tag` (once). `Err` where pidfds are unsupported
        /// (Linux < 5.3): the caller then looks for that child's death itself.
        pub fn watch(&mut self, pid: u32, tag: u64) -> io::Result<()> {
            let Ok(pid) = libc::pid_t::try_from(pid) else {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            };
            // nix has no pidfd_open.
            // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor (close-on-
            // exec) or -1.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is a fresh descriptor owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
            self.ep.add(
                &fd,
                EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLONESHOT, tag),
            )?;
            self.pidfds.push(fd);
            Ok(())
        }

        /// Wait up to `timeout_ms` for deaths; the tags of the children that died, first death
        /// first (each reported once).
        pub fn wait(&self, timeout_ms: u16) -> io::Result<Vec<u64>> {
            let mut evs = [EpollEvent::empty(); 64];
            match self.ep.wait(&mut evs, timeout_ms) {
                Ok(n) => Ok(evs[..n].iter().map(EpollEvent::data).collect()),
                Err(Errno::EINTR) => Ok(Vec::new()),
                Err(e) => Err(e.into()),
            }
        }
    }

    /// Wait up to `timeout_ms` for any of `fds` to be readable (or hung up); returns, for each,
    /// whether it is.
    pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout_ms: u16) -> io::Result<Vec<bool>> {
        let mut p: Vec<PollFd<'_>> = fds
            .iter()
            .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        match nix::poll::poll(&mut p, timeout_ms) {
            Ok(_) => Ok(p
                .iter()
                .map(|x| x.revents() != Some(PollFlags::empty()))
                .collect()),
            Err(Errno::EINTR) => Ok(vec![false; fds.len()]),
            Err(e) => Err(e.into()),
        }
    }
}

use sys::Exit;

fn signal_name(sig: i32) -> String {
    const NAMES: [&str; 32] = [
        "0",
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    match usize::try_from(sig).ok().and_then(|i| NAMES.get(i)) {
        Some(n) if sig > 0 => (*n).to_string(),
        _ => format!("signal {sig}"),
    }
}

fn exit_code(e: Exit) -> i32 {
    match e {
        Exit::Code(c) => c,
        Exit::Signal(s) => 128 + s,
    }
}

/// The parsed command line.
#[derive(Debug)]
struct Opts {
    n: usize,
    timeout: Option<Duration>,
    grace: Duration,
    keep_going: bool,
    prefix: bool,
    bind: SocketAddr,
    channels: Vec<(String, String)>,
    checked: bool,
    progress: Option<String>,
    program: OsString,
    args: Vec<OsString>,
}

fn parse_secs(opt: &str, v: &str, allow_zero: bool) -> Result<Duration, String> {
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && (s > 0.0 || (allow_zero && s == 0.0)) && s < 1e9 => {
            Ok(Duration::from_secs_f64(s))
        }
        _ => Err(format!("{opt} {v}: expected a number of seconds")),
    }
}

/// What the command line asks for.
enum Parsed {
    Run(Opts),
    Help,
    Version,
}

/// Parse the arguments (without the program name). Options come first (`--opt value` or
/// `--opt=value`, `-n N` or `-nN`); the first argument that is not an option, or the one after
/// `--`, is the program, and everything after it goes to the program untouched.
fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Parsed, String> {
    use lexopt::prelude::*;
    let mut p = lexopt::Parser::from_args(args);
    let mut n = None;
    let mut o = Opts {
        n: 0,
        timeout: None,
        grace: Duration::from_secs(2),
        keep_going: false,
        prefix: true,
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        channels: Vec::new(),
        checked: false,
        progress: None,
        program: OsString::new(),
        args: Vec::new(),
    };
    let value = |p: &mut lexopt::Parser, name: &str, what: &str| -> Result<String, String> {
        match p.value() {
            Ok(v) => v
                .into_string()
                .map_err(|_| format!("{name}: {what} is not valid Unicode")),
            Err(_) => Err(format!("{name} needs {what}")),
        }
    };
    let mut program = None;
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Short('h') | Long("help") => return Ok(Parsed::Help),
            Short('V') | Long("version") => return Ok(Parsed::Version),
            Short('n') | Long("np") => {
                let v = value(&mut p, "-n", "a process count")?;
                let k: usize = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("-n {v}: expected a number of processes"))?;
                if k == 0 || k > MAX_RANKS {
                    return Err(format!("-n {v}: must be between 1 and {MAX_RANKS}"));
                }
                n = Some(k);
            }
            Long("timeout") => {
                o.timeout = Some(parse_secs(
                    "--timeout",
                    &value(&mut p, "--timeout", "seconds")?,
                    false,
                )?)
            }
            Long("grace") => {
                o.grace = parse_secs("--grace", &value(&mut p, "--grace", "seconds")?, true)?
            }
            Long("no-prefix") => o.prefix = false,
            Long("keep-going") | Long("disable-auto-cleanup") => o.keep_going = true,
            Long("checked") => o.checked = true,
            Long("bind") => {
                let v = value(&mut p, "--bind", "an address")?;
                o.bind = v
                    .parse::<SocketAddr>()
                    .or_else(|_| {
                        v.parse::<std::net::IpAddr>()
                            .map(|ip| SocketAddr::new(ip, 0))
                    })
                    .map_err(|_| format!("--bind {v}: expected ip or ip:port"))?;
            }
            Long("channel") => {
                let v = value(&mut p, "--channel", "NAME=SPEC")?;
                let (cn, spec) = v
                    .split_once('=')
                    .filter(|(cn, _)| !cn.trim().is_empty())
                    .ok_or_else(|| format!("--channel {v}: expected NAME=SPEC, e.g. video=shm"))?;
                ChannelConfig::parse(cn.trim(), spec).map_err(|e| format!("--channel {v}: {e}"))?;
                o.channels
                    .push((cn.trim().to_string(), spec.trim().to_string()));
            }
            Long("progress") => {
                let v = value(&mut p, "--progress", "a mode")?;
                ProgressPolicy::parse_mode(&v).map_err(|e| format!("--progress {v}: {e}"))?;
                o.progress = Some(v);
            }
            Value(v) => {
                program = Some(v);
                break;
            }
            Short(c) => return Err(format!("unknown option `-{c}`")),
            Long(l) => return Err(format!("unknown option `--{l}`")),
        }
    }
    o.n = n.ok_or("missing -n N (number of processes)")?;
    o.program = program.ok_or("missing program to run")?;
    o.args = p.raw_args().map_err(|e| e.to_string())?.collect();
    Ok(Parsed::Run(o))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Find `program` the way `execvp` will, to report "not found" before starting anything.
fn resolve(program: &OsStr) -> Option<PathBuf> {
    let p = Path::new(program);
    if program.as_encoded_bytes().contains(&b'/') {
        return is_executable(p).then(|| p.to_path_buf());
    }
    if program.is_empty() {
        return None;
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(p))
        .find(|c| is_executable(c))
}

/// One child output stream being forwarded.
struct Source {
    rank: usize,
    stderr: bool,
    file: File,
    pending: Vec<u8>,
}

/// Longest line kept waiting for its newline; longer lines are cut into pieces.
const MAX_LINE: usize = 64 << 10;

fn emit(out: &mut Vec<u8>, rank: usize, line: &[u8]) {
    out.extend_from_slice(format!("[{rank}] ").as_bytes());
    out.extend_from_slice(line);
    if line.last() != Some(&b'\n') {
        out.push(b'\n');
    }
}

impl Source {
    /// Move the complete lines of `pending` (all of it at end of stream) to `out`, prefixed.
    /// A line longer than [`MAX_LINE`] bytes is cut into `MAX_LINE`-byte pieces, whatever
    /// the sizes of the reads that brought it, so the output does not depend on timing.
    fn drain_lines(&mut self, out: &mut Vec<u8>, eof: bool) {
        let mut start = 0;
        loop {
            let rest = &self.pending[start..];
            match rest.iter().position(|&b| b == b'\n') {
                Some(i) if i <= MAX_LINE => {
                    emit(out, self.rank, &rest[..=i]);
                    start += i + 1;
                }
                _ if rest.len() > MAX_LINE => {
                    emit(out, self.rank, &rest[..MAX_LINE]);
                    start += MAX_LINE;
                }
                _ => break,
            }
        }
        if eof && start < self.pending.len() {
            emit(out, self.rank, &self.pending[start..]);
            start = self.pending.len();
        }
        self.pending.drain(..start);
    }
}

/// Forward every child's output, prefixed, until every stream is closed.
fn pump(mut sources: Vec<Source>, done: mpsc::Sender<()>) {
    let mut chunk = vec![0u8; 64 << 10];
    let (mut out, mut err) = (Vec::new(), Vec::new());
    while !sources.is_empty() {
        let fds: Vec<_> = sources.iter().map(|s| s.file.as_fd()).collect();
        let ready = match sys::poll_readable(&fds, 500) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("madrun: poll on child output failed: {e}");
                break;
            }
        };
        let mut closed = Vec::new();
        for (i, s) in sources.iter_mut().enumerate() {
            if !ready[i] {
                continue;
            }
            let buf = if s.stderr { &mut err } else { &mut out };
            match s.file.read(&mut chunk) {
                Ok(0) => {
                    s.drain_lines(buf, true);
                    closed.push(i);
                }
                Ok(k) => {
                    s.pending.extend_from_slice(&chunk[..k]);
                    s.drain_lines(buf, false);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {
                    s.drain_lines(buf, true);
                    closed.push(i);
                }
            }
        }
        for i in closed.into_iter().rev() {
            sources.swap_remove(i);
        }
        // Write errors (closed stdout) are ignored: keep draining so children never block.
        if !out.is_empty() {
            let _ = std::io::stdout().lock().write_all(&out);
            let _ = std::io::stdout().flush();
            out.clear();
        }
        if !err.is_empty() {
            let _ = std::io::stderr().lock().write_all(&err);
            err.clear();
        }
    }
    let _ = done.send(());
}

struct Rank {
    child: Child,
    pid: u32,
    exit: Option<Exit>,
    /// Its death is reported by [`sys::DeathOrder`] (else found by scanning).
    watched: bool,
}

/// How long madrun keeps collecting failures after the first one it sees before it names the
/// original one (and, without `--keep-going`, ends the job).
const SETTLE: Duration = Duration::from_millis(200);

/// Which of `failures` (in the order the kernel reported the deaths, at least one) is the
/// original failure. When a rank is killed, the kernel closes its sockets before it reports
/// the death, and under load a peer that finds its connection closed can fail, exit and be
/// reported in between: death order alone would blame that peer. So a rank killed by a signal
/// (other than SIGPIPE, which a vanished peer causes) outranks ranks that exited with a
/// status or died of SIGPIPE; within each class the first death wins.
fn original_failure(failures: &[(usize, Exit)]) -> usize {
    let caused_by_peer = |e: Exit| !matches!(e, Exit::Signal(s) if s != libc::SIGPIPE);
    failures
        .iter()
        .position(|&(_, e)| !caused_by_peer(e))
        .unwrap_or(0)
}

/// How rank `r` ended, for madrun's messages.
fn describe_exit(r: usize, e: Exit) -> String {
    match e {
        Exit::Code(c) => format!("rank {r} exited with status {c}"),
        Exit::Signal(s) => format!("rank {r} killed by signal {} ({s})", signal_name(s)),
    }
}

fn random_hex(n: usize) -> Result<String, mad_core::Error> {
    let mut b = vec![0u8; n];
    fill_random(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn kill_all(pgid: u32, sig: i32) {
    if let Err(e) = sys::kill_group(pgid, sig) {
        if e.raw_os_error() != Some(libc::ESRCH) {
            eprintln!("madrun: cannot send {} to the job: {e}", signal_name(sig));
        }
    }
}

fn main() {
    madeleine::init_logging();
    std::process::exit(run());
}

fn run() -> i32 {
    let opts = match parse_args(std::env::args_os().skip(1)) {
        Ok(Parsed::Run(o)) => o,
        Ok(Parsed::Help) => {
            // Written, not `println!`: `madrun --help | head` must not panic on the closed pipe.
            let _ = writeln!(std::io::stdout().lock(), "{USAGE}");
            return 0;
        }
        Ok(Parsed::Version) => {
            let _ = writeln!(
                std::io::stdout().lock(),
                "madrun {}",
                env!("CARGO_PKG_VERSION")
            );
            return 0;
        }
        Err(msg) => {
            let short = USAGE.split("\n\n").next().unwrap_or(USAGE);
            eprintln!("madrun: {msg}\n{short}\n(madrun --help for details)");
            return 2;
        }
    };
    let Some(program) = resolve(&opts.program) else {
        eprintln!(
            "madrun: program `{}` not found (or not executable)",
            opts.program.to_string_lossy()
        );
        return 2;
    };
    // Per rank: two output pipes plus the bootstrap connection (two descriptors per accepted
    // socket in the server). Children inherit the raised soft limit, which is harmless.
    let want = 6 * opts.n as libc::rlim_t + 64;
    match sys::raise_fd_limit(want) {
        Ok(have) if have < want => eprintln!(
            "madrun: warning: open-file limit {have} may be too low for {} ranks (want {want})",
            opts.n
        ),
        Ok(_) => {}
        Err(e) => eprintln!("madrun: warning: cannot read or raise the open-file limit: {e}"),
    }
    let secret = match Secret::random() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("madrun: cannot create the session secret: {e}");
            return 1;
        }
    };
    let job = match random_hex(8) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("madrun: cannot create a job id: {e}");
            return 1;
        }
    };
    let server = match BootstrapServer::start(
        opts.bind,
        opts.n,
        secret.clone(),
        Box::new(|m| eprintln!("{m}")),
    ) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("madrun: cannot start the bootstrap server: {e}");
            return 1;
        }
    };
    // SIGCHLD is recorded too: it tells the main loop when to look for ended children.
    let handled = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGCHLD];
    if let Err(e) = sys::install_handlers(&handled) {
        eprintln!("madrun: cannot install signal handlers: {e}");
        return 1;
    }

    // The children run in their own process group, which is never the terminal's foreground
    // group: a child reading the terminal would be stopped (SIGTTIN). So rank 0 gets madrun's
    // stdin only when it is a file or a pipe.
    let stdin_to_rank0 = !std::io::stdin().is_terminal();
    let mut ranks: Vec<Rank> = Vec::with_capacity(opts.n);
    let mut sources = Vec::new();
    let mut pgid = 0u32;
    // Without epoll or pidfds (old kernels) deaths are found by scanning the ranks in order,
    // which cannot tell which of two deaths came first.
    let mut deaths = sys::DeathOrder::new().ok();
    for r in 0..opts.n {
        let mut cmd = Command::new(&program);
        cmd.arg0(&opts.program)
            .args(&opts.args)
            .env(vars::RANK, r.to_string())
            .env(vars::SIZE, opts.n.to_string())
            .env(vars::BOOTSTRAP, server.advertised_addr().to_string())
            .env(vars::SECRET, secret.to_hex())
            .env(vars::LOCAL_SIZE, opts.n.to_string())
            .env(vars::JOB, &job)
            .process_group(pgid as i32)
            .stdin(if r == 0 && stdin_to_rank0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        for (name, spec) in &opts.channels {
            cmd.env(env_key(name), spec);
        }
        if opts.checked {
            cmd.env("MAD_CHECKED", "1");
        }
        if let Some(p) = &opts.progress {
            cmd.env("MAD_PROGRESS", p);
        }
        if opts.prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        sys::die_with_parent(&mut cmd);
        match cmd.spawn() {
            Ok(mut child) => {
                let pid = child.id();
                if pgid == 0 {
                    pgid = pid;
                }
                for (stderr, fd) in [
                    (false, child.stdout.take().map(OwnedFd::from)),
                    (true, child.stderr.take().map(OwnedFd::from)),
                ] {
                    if let Some(fd) = fd {
                        sources.push(Source {
                            rank: r,
                            stderr,
                            file: File::from(fd),
                            pending: Vec::new(),
                        });
                    }
                }
                let watched = deaths
                    .as_mut()
                    .is_some_and(|d| d.watch(pid, r as u64).is_ok());
                ranks.push(Rank {
                    child,
                    pid,
                    exit: None,
                    watched,
                });
            }
            Err(e) => {
                eprintln!(
                    "madrun: cannot start rank {r} (`{}`): {e}",
                    opts.program.to_string_lossy()
                );
                if pgid != 0 {
                    kill_all(pgid, libc::SIGKILL);
                }
                for rk in &mut ranks {
                    let _ = rk.child.wait();
                }
                return match e.kind() {
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => 2,
                    _ => 1,
                };
            }
        }
    }
    let (done_tx, done_rx) = mpsc::channel();
    let pump_thread = std::thread::Builder::new()
        .name("madrun-output".into())
        .spawn(move || pump(sources, done_tx));
    if let Err(e) = &pump_thread {
        eprintln!("madrun: cannot start the output thread: {e}");
    }

    let start = Instant::now();
    let deadline = opts.timeout.map(|t| start + t);
    // The first rank that failed, by time of death: its status is madrun's.
    let mut first_failure: Option<(usize, Exit)> = None;
    // Failures seen in the settling window that opened at the first one, in order of death.
    let mut window: Option<(Instant, Vec<(usize, Exit)>)> = None;
    let mut teardown: Option<Instant> = None;
    let mut killed = false;
    let mut timed_out = false;
    let mut signals_seen = 0;
    // Unwatched children are scanned when SIGCHLD says one ended, and every half second
    // regardless.
    let mut last_scan: Option<Instant> = None;
    // Ranks reported dead but whose status is not readable yet, first death first.
    let mut reported: Vec<usize> = Vec::new();
    let mut running = ranks.len();
    let mut first_round = true;
    loop {
        let mut child_ended = false;
        for sig in sys::take_signals() {
            if sig == libc::SIGCHLD {
                child_ended = true;
                continue;
            }
            signals_seen += 1;
            if signals_seen == 1 {
                kill_all(pgid, sig);
            } else if !killed {
                eprintln!("madrun: {} again: killing every rank", signal_name(sig));
                kill_all(pgid, libc::SIGKILL);
                killed = true;
            }
        }
        // Wait for deaths (this is the loop's pause); then, behind them, the unwatched ranks.
        let wait_ms: u16 = if first_round { 0 } else { 10 };
        first_round = false;
        match &deaths {
            Some(d) => match d.wait(wait_ms) {
                Ok(tags) => reported.extend(tags.into_iter().map(|t| t as usize)),
                Err(e) => {
                    eprintln!("madrun: waiting for the ranks failed: {e}; scanning them instead");
                    deaths = None;
                    for rk in &mut ranks {
                        rk.watched = false;
                    }
                }
            },
            None => std::thread::sleep(Duration::from_millis(u64::from(wait_ms))),
        }
        let scan =
            child_ended || last_scan.is_none_or(|t| t.elapsed() >= Duration::from_millis(500));
        if scan {
            last_scan = Some(Instant::now());
            for (r, rk) in ranks.iter().enumerate() {
                if !rk.watched && rk.exit.is_none() && !reported.contains(&r) {
                    reported.push(r);
                }
            }
        }
        let mut still = Vec::new();
        for r in std::mem::take(&mut reported) {
            let Some(rk) = ranks.get_mut(r) else { continue };
            if rk.exit.is_some() {
                continue;
            }
            let e = match sys::peek_exit(rk.pid) {
                Ok(None) => {
                    // A watched rank is reported once: look again until its status shows.
                    if rk.watched {
                        still.push(r);
                    }
                    continue;
                }
                Ok(Some(e)) => e,
                Err(err) => {
                    eprintln!("madrun: cannot wait for rank {r}: {err}");
                    Exit::Code(255)
                }
            };
            rk.exit = Some(e);
            running -= 1;
            if e == Exit::Code(0) {
                continue;
            }
            if teardown.is_some() {
                // Ended by our own teardown (after a failure, or the timeout): not counted.
                continue;
            }
            match (first_failure, &mut window) {
                (None, None) => window = Some((Instant::now(), vec![(r, e)])),
                (None, Some((_, w))) => w.push((r, e)),
                // --keep-going: later failures are reported too, but the first one decides.
                (Some((f, _)), _) => {
                    eprintln!("madrun: {} (after rank {f})", describe_exit(r, e))
                }
            }
        }
        reported = still;
        // The window closes: name the original failure, then the others.
        if let Some((opened, w)) = &window {
            if running == 0 || opened.elapsed() >= SETTLE {
                let i = original_failure(w);
                let (f, e) = w[i];
                eprintln!("madrun: {}", describe_exit(f, e));
                for (j, &(r, e)) in w.iter().enumerate() {
                    if j != i {
                        eprintln!("madrun: {} (after rank {f})", describe_exit(r, e));
                    }
                }
                first_failure = Some((f, e));
                window = None;
                if !opts.keep_going && teardown.is_none() {
                    teardown = Some(Instant::now() + opts.grace);
                    kill_all(pgid, libc::SIGTERM);
                }
            }
        }
        if running == 0 {
            break;
        }
        let now = Instant::now();
        if let Some(d) = deadline {
            if !timed_out && now >= d {
                timed_out = true;
                eprintln!(
                    "madrun: timeout: the job ran longer than {:?}; killing every rank",
                    opts.timeout.unwrap_or_default()
                );
                if teardown.is_none() {
                    teardown = Some(now + opts.grace);
                }
                kill_all(pgid, libc::SIGTERM);
            }
        }
        if let Some(t) = teardown {
            if !killed && now >= t {
                kill_all(pgid, libc::SIGKILL);
                killed = true;
            }
        }
    }
    // Every child has ended but none is reaped yet, so the group still exists: kill whatever
    // the children left behind in it, then reap.
    kill_all(pgid, libc::SIGKILL);
    for rk in &mut ranks {
        let _ = rk.child.wait();
    }
    if pump_thread.is_ok() && done_rx.recv_timeout(Duration::from_secs(2)).is_err() {
        eprintln!("madrun: some rank output was still open 2 s after the job ended; dropped");
    }
    let _ = std::io::stdout().flush();
    drop(server);
    if timed_out {
        124
    } else {
        first_failure.map_or(0, |(_, e)| exit_code(e).clamp(0, 255))
    }
}
