//! The PMI bootstrap: a session started by a PMI process manager, with no MPI in the program.
//!
//! Slurm's `srun --mpi=pmi2` and MPICH's Hydra `mpiexec` hand every process a connected socket
//! in `PMI_FD`, with `PMI_RANK` and `PMI_SIZE`, and serve the PMI-1 wire protocol on it (Slurm's
//! `pmi2` plugin answers PMI-1 clients on the same descriptor). [`PmiBootstrap`] is a client of
//! that protocol written in Rust: no PMI library is loaded.
//!
//! - **Wire-up, then our own server.** PMI carries one exchange: rank 0's secret and the
//!   address of a bootstrap server it starts (the one `madrun` runs,
//!   [`super::server::BootstrapServer`], on loopback), and every rank's host. When every rank
//!   is on rank 0's host, all later collectives go through that server as under `madrun`
//!   (a PMI barrier costs about 10 ms in Slurm 22.05's `pmi2` plugin, the server well under
//!   one): the missing ranks of a timeout are named, a rank whose connection closes fails the
//!   pending collectives at once. `MAD_PMI_COLLECTIVES=pmi`, and ranks on several hosts (the
//!   server listens on loopback only), keep every collective on PMI.
//! - **Collectives over PMI** are matched by position, as in the MPI bootstrap: each one puts
//!   this rank's contribution into the job's key-value space under keys numbered by a
//!   per-process sequence (`mad<seq>.<rank>.<chunk>`, hex-encoded and cut to the server's
//!   `vallen_max`), enters the PMI barrier, and reads every other rank's keys. Contributions
//!   are framed by [`crate::bootstrap::positional`]: a rank that entered a different
//!   collective, or abandoned its scope, is reported, not misread. A scoped collective waits
//!   for the barrier until the scope's deadline; PMI cannot cancel a barrier, so after a
//!   timeout the connection is out of step and every later collective fails at once. A
//!   process manager that goes away (the job is killed) is an end of stream: every pending
//!   and later call fails.
//! - **The secret** is drawn by rank 0 and read by the others from the key-value space (which
//!   only the job's processes can read); [`local_ranks`](Bootstrap::local_ranks) comes from an
//!   exchange of host name and kernel boot id.
//! - **One connection per process.** The descriptor is shared by every `PmiBootstrap` of the
//!   process; the last one to drop sends `finalize` (Hydra treats a process that exits without
//!   it as failed). A bootstrap created after that fails with [`Error::Unavailable`].
//!
//! PMIx (`srun --mpi=pmix`, Open MPI's `mpirun`) is not spoken here: such a process has no
//! `PMI_FD`, and a session built without an MPI bootstrap refuses to run in it (see
//! [`super::mpi_env`]).

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::auth::Secret;
use crate::bootstrap::{positional, Bootstrap, RankFailure, Scope};
use crate::error::{Error, Result};

/// The names of the environment variables a PMI process manager sets.
pub mod vars {
    /// The connected socket to the process manager.
    pub const FD: &str = "PMI_FD";
    /// This process's rank.
    pub const RANK: &str = "PMI_RANK";
    /// Number of processes.
    pub const SIZE: &str = "PMI_SIZE";
    /// `pmi`: every collective over PMI, not over the bootstrap server rank 0 starts.
    pub const COLLECTIVES: &str = "MAD_PMI_COLLECTIVES";
}

/// Bound on an answer to a request that needs no other rank (put, get, finalize).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest line accepted from the process manager.
const MAX_LINE: usize = 64 * 1024;

/// What the environment says about a PMI launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PmiEnv {
    /// The descriptor of the connection to the process manager.
    pub fd: RawFd,
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
}

impl PmiEnv {
    /// Parse the variables through `get`. `Ok(None)` when `PMI_FD` is absent.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the variable when `PMI_FD` is there but a variable is missing
    /// or malformed.
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some(fd_s) = get(vars::FD) else {
            return Ok(None);
        };
        let num = |var: &str| -> Result<usize> {
            let v = get(var)
                .ok_or_else(|| Error::BadConfig(format!("{var} is not set but {} is", vars::FD)))?;
            v.trim().parse::<usize>().map_err(|_| {
                Error::BadConfig(format!(
                    "{var}={v:?}: expected a number (set by the PMI process manager)"
                ))
            })
        };
        let fd = fd_s
            .trim()
            .parse::<RawFd>()
            .ok()
            .filter(|&fd| fd >= 0)
            .ok_or_else(|| {
                Error::BadConfig(format!(
                    "{}={fd_s:?}: expected a descriptor number",
                    vars::FD
                ))
            })?;
        let (rank, size) = (num(vars::RANK)?, num(vars::SIZE)?);
        if size == 0 || rank >= size {
            return Err(Error::BadConfig(format!(
                "the PMI process manager says rank {rank} of {size} processes"
            )));
        }
        Ok(Some(PmiEnv { fd, rank, size }))
    }
}

fn pmi_error(what: impl Into<String>) -> Error {
    Error::io(
        "PMI bootstrap",
        std::io::Error::new(std::io::ErrorKind::InvalidData, what.into()),
    )
}

/// One PMI-1 answer: `cmd=<name> key=value ...`.
#[derive(Debug)]
struct Reply {
    fields: Vec<(String, String)>,
}

impl Reply {
    fn parse(line: &str) -> Self {
        Reply {
            fields: line
                .split_ascii_whitespace()
                .map(|kv| match kv.split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (kv.to_string(), String::new()),
                })
                .collect(),
        }
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The answer, checked to be `cmd=<expect>` with `rc=0` (or no `rc`).
    fn expect(self, expect: &str) -> Result<Self> {
        match self.get("cmd") {
            Some(c) if c == expect => {}
            other => {
                return Err(pmi_error(format!(
                    "expected `cmd={expect}` from the process manager, got `cmd={}`",
                    other.unwrap_or("")
                )))
            }
        }
        match self.get("rc") {
            None | Some("0") => Ok(self),
            Some(rc) => Err(pmi_error(format!(
                "`{expect}` failed in the process manager: rc={rc}{}",
                self.get("msg")
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default()
            ))),
        }
    }

    fn num(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| pmi_error(format!("the process manager's answer has no `{key}`")))
    }
}

/// The connection to the process manager (one per process).
struct Conn {
    stream: UnixStream,
    buf: Vec<u8>,
    kvsname: String,
    /// Raw bytes per key (values are hex).
    chunk: usize,
    /// Collectives issued so far (numbers the keys).
    seq: u64,
    /// Why the connection is out of step with the process manager, if it is.
    broken: Option<String>,
    /// Whether it is the process's connection (in [`SLOT`]), not one still being opened.
    shared: bool,
}

fn wait_fd(fd: BorrowedFd<'_>, events: nix::poll::PollFlags, deadline: Instant) -> Result<bool> {
    use nix::poll::{poll, PollFd, PollTimeout};
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = u16::try_from(left.as_millis().min(10_000)).unwrap_or(10_000);
        let mut p = [PollFd::new(fd, events)];
        match poll(&mut p, PollTimeout::from(ms)) {
            Ok(0) if left.is_zero() => return Ok(false),
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(Error::io("PMI bootstrap: poll", e.into())),
        }
    }
}

impl Conn {
    fn send(&mut self, line: &str) -> Result<()> {
        debug_assert!(line.ends_with('\n'));
        self.stream
            .write_all(line.as_bytes())
            .map_err(|e| Error::io("PMI bootstrap: write to the process manager", e))
    }

    /// The next line, or `None` at `deadline`.
    fn line(&mut self, deadline: Instant) -> Result<Option<String>> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let rest = self.buf.split_off(i + 1);
                let mut line = std::mem::replace(&mut self.buf, rest);
                line.pop();
                return String::from_utf8(line)
                    .map(Some)
                    .map_err(|_| pmi_error("the process manager sent a line that is not UTF-8"));
            }
            if self.buf.len() > MAX_LINE {
                return Err(pmi_error(format!(
                    "the process manager sent a line longer than {MAX_LINE} bytes"
                )));
            }
            if !wait_fd(self.stream.as_fd(), nix::poll::PollFlags::POLLIN, deadline)? {
                return Ok(None);
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(Error::io(
                        "PMI bootstrap",
                        std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the process manager closed the connection (the job is ending)",
                        ),
                    ))
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("PMI bootstrap: read from the process manager", e)),
            }
        }
    }

    /// Send `line` and read the answer `cmd=<expect>`, within [`REPLY_TIMEOUT`].
    fn request(&mut self, line: &str, expect: &str) -> Result<Reply> {
        self.send(line)?;
        match self.line(Instant::now() + REPLY_TIMEOUT)? {
            Some(l) => Reply::parse(&l).expect(expect),
            None => {
                self.broken = Some(format!("no answer to `{expect}`"));
                Err(Error::Timeout(REPLY_TIMEOUT))
            }
        }
    }

    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        let line = format!("cmd=put kvsname={} key={key} value={value}\n", self.kvsname);
        self.request(&line, "put_result").map(|_| ())
    }

    fn get(&mut self, key: &str) -> Result<String> {
        let line = format!("cmd=get kvsname={} key={key}\n", self.kvsname);
        let r = self.request(&line, "get_result")?;
        r.get("value")
            .map(str::to_string)
            .ok_or_else(|| pmi_error(format!("no value for key `{key}`")))
    }

    /// The barrier, or `false` at `deadline` (the connection is then out of step).
    fn barrier(&mut self, deadline: Option<Instant>) -> Result<bool> {
        self.send("cmd=barrier_in\n")?;
        let until = deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 30));
        match self.line(until)? {
            Some(l) => Reply::parse(&l).expect("barrier_out").map(|_| true),
            None => {
                self.broken = Some("a barrier timed out (PMI cannot cancel it)".into());
                Ok(false)
            }
        }
    }

    /// Every rank's `value` (indexed by rank), or `None` at `deadline`.
    fn exchange(
        &mut self,
        rank: usize,
        size: usize,
        value: &[u8],
        deadline: Option<Instant>,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        if let Some(why) = &self.broken {
            return Err(Error::io(
                "PMI bootstrap",
                std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    format!("unusable after an earlier failure: {why}"),
                ),
            ));
        }
        self.seq += 1;
        let seq = self.seq;
        let hex = hex_encode(value);
        let pieces: Vec<&str> = if hex.is_empty() {
            vec![""]
        } else {
            hex.as_bytes()
                .chunks(self.chunk * 2)
                .map(|c| std::str::from_utf8(c).unwrap_or_default())
                .collect()
        };
        let t0 = Instant::now();
        for (i, p) in pieces.iter().enumerate() {
            // The first key says how many there are (and is never empty).
            let v = if i == 0 {
                format!("{}:{p}", pieces.len())
            } else {
                (*p).to_string()
            };
            self.put(&format!("mad{seq}.{rank}.{i}"), &v)?;
        }
        let t1 = Instant::now();
        if !self.barrier(deadline)? {
            return Ok(None);
        }
        let t2 = Instant::now();
        let mut all = Vec::with_capacity(size);
        for r in 0..size {
            if r == rank {
                all.push(value.to_vec());
                continue;
            }
            let first = self.get(&format!("mad{seq}.{r}.0"))?;
            let (n, head) = first
                .split_once(':')
                .and_then(|(n, h)| Some((n.parse::<usize>().ok()?, h)))
                .ok_or_else(|| pmi_error(format!("rank {r}'s value `mad{seq}` is malformed")))?;
            let mut hex = head.to_string();
            for i in 1..n {
                hex.push_str(&self.get(&format!("mad{seq}.{r}.{i}"))?);
            }
            all.push(
                hex_decode(&hex)
                    .ok_or_else(|| pmi_error(format!("rank {r}'s value `mad{seq}` is not hex")))?,
            );
        }
        tracing::trace!(
            target: "mad_core::pmi",
            seq,
            bytes = value.len(),
            put_us = (t1 - t0).as_micros() as u64,
            barrier_us = (t2 - t1).as_micros() as u64,
            get_us = t2.elapsed().as_micros() as u64,
            "PMI collective"
        );
        Ok(Some(all))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.shared {
            *SLOT.lock().unwrap_or_else(|p| p.into_inner()) = Slot::Finalised;
        }
        if let Err(e) = self.finalize() {
            tracing::warn!(target: "mad_core::pmi", error = %e, "PMI finalize failed");
        }
    }
}

impl Conn {
    /// Say goodbye (Hydra treats a process that exits without it as failed). On a connection
    /// out of step (a barrier that timed out is still pending) answers to earlier requests
    /// are skipped, for at most a second.
    fn finalize(&mut self) -> Result<()> {
        self.send("cmd=finalize\n")?;
        let bound = if self.broken.is_some() {
            Duration::from_secs(1)
        } else {
            REPLY_TIMEOUT
        };
        let deadline = Instant::now() + bound;
        loop {
            match self.line(deadline)? {
                None => return Err(Error::Timeout(bound)),
                Some(l) => {
                    let r = Reply::parse(&l);
                    if r.get("cmd") == Some("finalize_ack") || self.broken.is_none() {
                        return r.expect("finalize_ack").map(drop);
                    }
                }
            }
        }
    }
}

fn hex_encode(b: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(D[(x >> 4) as usize] as char);
        s.push(D[(x & 15) as usize] as char);
    }
    s
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The process's connection: shared by its bootstraps, finalised when the last one drops.
enum Slot {
    Never,
    Open(Weak<Mutex<Conn>>),
    Finalised,
}

static SLOT: Mutex<Slot> = Mutex::new(Slot::Never);

/// The bootstrap of a process started by a PMI process manager (`srun --mpi=pmi2`, MPICH's
/// `mpiexec`).
pub struct PmiBootstrap {
    rank: usize,
    size: usize,
    secret: Secret,
    local: Vec<usize>,
    conn: Arc<Mutex<Conn>>,
    /// The collectives after wire-up: `None` over PMI.
    hosted: Option<Hosted>,
}

/// Collectives through the bootstrap server rank 0 runs.
struct Hosted {
    client: super::MadrunBootstrap,
    /// Rank 0's server (dropped after its client).
    _server: Option<super::server::BootstrapServer>,
}

impl std::fmt::Debug for PmiBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PmiBootstrap")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_ranks", &self.local)
            .field(
                "collectives",
                &if self.hosted.is_some() {
                    "server"
                } else {
                    "pmi"
                },
            )
            .finish_non_exhaustive()
    }
}

impl PmiBootstrap {
    /// Connect to the process manager named by the environment. `Ok(None)` when the process
    /// was not started by one (`PMI_FD` unset).
    ///
    /// # Errors
    ///
    /// As [`PmiEnv::parse`] and [`connect`](Self::connect).
    pub fn from_env() -> Result<Option<Self>> {
        match PmiEnv::parse(|k| std::env::var(k).ok())? {
            None => Ok(None),
            Some(env) => Self::connect(env).map(Some),
        }
    }

    /// Initialise the connection described by `env` (or join the process's open one).
    /// Collective: every rank of the job calls it.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the process's PMI connection was already finalised;
    /// [`Error::Io`] when the process manager cannot be reached or answers out of protocol;
    /// [`Error::Timeout`] when it does not answer in time.
    pub fn connect(env: PmiEnv) -> Result<Self> {
        let conn = {
            let mut slot = SLOT.lock().unwrap_or_else(|p| p.into_inner());
            let open = match &*slot {
                Slot::Open(w) => w.upgrade(),
                Slot::Finalised => None,
                Slot::Never => None,
            };
            match (&*slot, open) {
                (_, Some(c)) => c,
                // Its last bootstrap dropped: finalised, or being finalised.
                (Slot::Open(_) | Slot::Finalised, None) => {
                    return Err(Error::unavailable(
                        "bootstrap:pmi",
                        "the PMI connection of this process was finalised when its last \
                         session ended (a process manager serves one PMI session per process)",
                    ))
                }
                (Slot::Never, None) => {
                    let mut c = init(env)?;
                    c.shared = true;
                    let c = Arc::new(Mutex::new(c));
                    *slot = Slot::Open(Arc::downgrade(&c));
                    c
                }
            }
        };
        let over_pmi = match std::env::var(vars::COLLECTIVES) {
            Err(_) => false,
            Ok(v) if v == "pmi" => true,
            Ok(v) if v == "server" => false,
            Ok(v) => {
                return Err(Error::BadConfig(format!(
                    "{}={v:?}: expected `pmi` or `server`",
                    vars::COLLECTIVES
                )))
            }
        };
        // Rank 0's secret and server address, and every rank's host.
        let mut server = None;
        let mut mine = Vec::new();
        if env.rank == 0 {
            let secret = Secret::random()?;
            if !over_pmi {
                let s = super::server::BootstrapServer::start(
                    std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                    env.size,
                    secret.clone(),
                    Box::new(
                        |line: &str| tracing::warn!(target: "mad_core::pmi", "bootstrap server: {line}"),
                    ),
                )?;
                server = Some(s);
            }
            let addr = server
                .as_ref()
                .map(|s| s.advertised_addr().to_string())
                .unwrap_or_default();
            mine.extend_from_slice(format!("{}\n{addr}\n", secret.to_hex()).as_bytes());
        }
        mine.extend_from_slice(crate::bootstrap::host_identity().as_bytes());
        let all = {
            let mut g = conn.lock().unwrap_or_else(|p| p.into_inner());
            let framed = positional::frame("pmi-init", &mine);
            let all = g
                .exchange(env.rank, env.size, &framed, None)?
                .ok_or(Error::Timeout(Duration::ZERO))?;
            positional::unframe(all, None, "pmi-init")?
        };
        // Rank 0: `secret\naddr\nhost`; the others: `host`.
        let zero = String::from_utf8_lossy(&all[0]).into_owned();
        let mut parts = zero.splitn(3, '\n');
        let (Some(secret), Some(addr), Some(host0)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(pmi_error("rank 0's wire-up value is malformed"));
        };
        let secret = Secret::from_hex(secret)?;
        let host = |r: usize| -> &[u8] {
            if r == 0 {
                host0.as_bytes()
            } else {
                &all[r]
            }
        };
        let local: Vec<usize> = (0..env.size)
            .filter(|&r| host(r) == host(env.rank))
            .collect();
        let one_host = (0..env.size).all(|r| host(r) == host(0));
        let hosted = if addr.is_empty() || !one_host {
            None
        } else {
            let addr = addr
                .parse()
                .map_err(|_| pmi_error(format!("rank 0's server address {addr:?} is malformed")))?;
            let client = super::MadrunBootstrap::connect(super::MadrunEnv {
                rank: env.rank,
                size: env.size,
                addr,
                secret: secret.clone(),
                local_size: Some(local.len()),
                job: None,
                connect_timeout: super::DEFAULT_CONNECT_TIMEOUT,
            })?;
            Some(Hosted {
                client,
                _server: server,
            })
        };
        tracing::debug!(
            target: "mad_core::pmi",
            rank = env.rank,
            size = env.size,
            local = local.len(),
            collectives = if hosted.is_some() { "server" } else { "pmi" },
            "PMI bootstrap ready"
        );
        Ok(PmiBootstrap {
            rank: env.rank,
            size: env.size,
            secret,
            local,
            conn,
            hosted,
        })
    }

    fn gather(&self, scope: Option<&Scope>, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut g = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let framed = positional::frame(tag, value);
        match g.exchange(self.rank, self.size, &framed, scope.map(|s| s.deadline))? {
            // PMI does not say who is missing.
            None => Err(scope.map_or(Error::Timeout(Duration::ZERO), |s| {
                s.timeout_error(Vec::new())
            })),
            Some(all) => positional::unframe(all, scope, tag),
        }
    }
}

/// Open the PMI-1 session on `env.fd`: `init`, `get_maxes`, `get_my_kvsname`.
#[allow(unsafe_code)]
fn init(env: PmiEnv) -> Result<Conn> {
    // SAFETY: `env.fd` is the descriptor the process manager opened for this process
    // (`PMI_FD`); it is only borrowed for the duration of this call, to duplicate it.
    let borrowed = unsafe { BorrowedFd::borrow_raw(env.fd) };
    let ft = nix::sys::stat::fstat(env.fd).map_err(|e| {
        Error::BadConfig(format!("PMI_FD={}: not an open descriptor ({e})", env.fd))
    })?;
    if ft.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(Error::BadConfig(format!(
            "PMI_FD={}: not a socket (the process manager's connection is one)",
            env.fd
        )));
    }
    let fd = borrowed
        .try_clone_to_owned()
        .map_err(|e| Error::io("PMI bootstrap: dup PMI_FD", e))?;
    let mut c = Conn {
        stream: UnixStream::from(fd),
        buf: Vec::new(),
        kvsname: String::new(),
        chunk: 0,
        seq: 0,
        broken: None,
        shared: false,
    };
    c.request(
        "cmd=init pmi_version=1 pmi_subversion=1\n",
        "response_to_init",
    )
    .inspect_err(|_| c.broken = Some("init failed".into()))?;
    let maxes = c.request("cmd=get_maxes\n", "maxes")?;
    let (keylen, vallen) = (maxes.num("keylen_max")?, maxes.num("vallen_max")?);
    if keylen < 32 || vallen < 64 {
        return Err(pmi_error(format!(
            "the process manager's limits are too small: keylen_max={keylen}, vallen_max={vallen}"
        )));
    }
    // Room for the `<count>:` prefix and a terminating NUL on the server side.
    c.chunk = (vallen - 24) / 2;
    let name = c.request("cmd=get_my_kvsname\n", "my_kvsname")?;
    c.kvsname = name
        .get("kvsname")
        .filter(|k| !k.is_empty())
        .ok_or_else(|| pmi_error("the process manager named no key-value space"))?
        .to_string();
    tracing::debug!(
        target: "mad_core::pmi",
        rank = env.rank,
        size = env.size,
        kvs = %c.kvsname,
        vallen,
        "PMI-1 session open"
    );
    Ok(c)
}

impl Bootstrap for PmiBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn secret(&self) -> &Secret {
        &self.secret
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        match &self.hosted {
            Some(h) => h.client.allgather(tag, value),
            None => self.gather(None, tag, value),
        }
    }
    fn scoped_allgather(&self, scope: &Scope, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        match &self.hosted {
            Some(h) => h.client.scoped_allgather(scope, tag, value),
            None => self.gather(Some(scope), tag, value),
        }
    }
    /// Through the server as under `madrun`. Over PMI, collectives are matched by position:
    /// this rank takes part in the one its peers are in with an abort marker, so they fail
    /// with its error there, bounded by the scope's deadline (at least 5 s from now).
    fn abandon(&self, scope: &Scope, failure: &RankFailure) -> Result<RankFailure> {
        if let Some(h) = &self.hosted {
            return h.client.abandon(scope, failure);
        }
        let mut g = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = scope.deadline.max(Instant::now() + Duration::from_secs(5));
        let all = g.exchange(
            self.rank,
            self.size,
            &positional::abort_frame(failure),
            Some(deadline),
        )?;
        Ok(all
            .and_then(|all| positional::failure_in(&all))
            .unwrap_or_else(|| failure.clone()))
    }
    fn kind(&self) -> &'static str {
        "pmi"
    }
    fn local_ranks(&self) -> Vec<usize> {
        self.local.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<PmiEnv>> {
        let m: HashMap<&str, &str> = vars.iter().copied().collect();
        PmiEnv::parse(|k| m.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn env() {
        assert_eq!(
            parse(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap(),
            None
        );
        assert_eq!(
            parse(&[("PMI_FD", "7"), ("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap(),
            Some(PmiEnv {
                fd: 7,
                rank: 1,
                size: 2
            })
        );
        for bad in [
            &[("PMI_FD", "x"), ("PMI_RANK", "1"), ("PMI_SIZE", "2")][..],
            &[("PMI_FD", "-1"), ("PMI_RANK", "1"), ("PMI_SIZE", "2")],
            &[("PMI_FD", "7"), ("PMI_SIZE", "2")],
            &[("PMI_FD", "7"), ("PMI_RANK", "2"), ("PMI_SIZE", "2")],
            &[("PMI_FD", "7"), ("PMI_RANK", "0"), ("PMI_SIZE", "0")],
        ] {
            assert!(matches!(parse(bad), Err(Error::BadConfig(_))), "{bad:?}");
        }
    }

    #[test]
    fn hex() {
        for v in [&b""[..], b"\x00\xff\x10abc"] {
            assert_eq!(hex_decode(&hex_encode(v)).unwrap(), v);
        }
        assert_eq!(hex_decode("abc"), None);
        assert_eq!(hex_decode("zz"), None);
    }

    #[test]
    fn replies() {
        let r = Reply::parse("cmd=get_result rc=0 msg=success value=00ff");
        assert_eq!(r.get("value"), Some("00ff"));
        assert!(Reply::parse("cmd=get_result rc=0 value=1")
            .expect("get_result")
            .is_ok());
        assert!(Reply::parse("cmd=get_result rc=1")
            .expect("get_result")
            .is_err());
        assert!(Reply::parse("cmd=put_result rc=0")
            .expect("get_result")
            .is_err());
        assert!(Reply::parse("cmd=maxes vallen_max=x")
            .num("vallen_max")
            .is_err());
    }
}
