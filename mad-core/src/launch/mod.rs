//! The `madrun` launcher's bootstrap: the client every rank uses, and the server `madrun` runs.
//!
//! `madrun -n N program` starts a bootstrap server, creates a random session secret and starts
//! N processes with these environment variables:
//!
//! | variable                 | meaning                                                   |
//! |--------------------------|-----------------------------------------------------------|
//! | `MAD_RANK`               | this process's rank, `0..MAD_SIZE`                        |
//! | `MAD_SIZE`               | number of processes                                       |
//! | `MAD_BOOTSTRAP`          | `ip:port` of the bootstrap server                         |
//! | `MAD_SECRET`             | the session secret, 64 hex digits                         |
//! | `MAD_LOCAL_SIZE`         | processes on this host (all of them: one-host launcher)   |
//! | `MAD_JOB`                | random job identifier (hex), for naming shared resources  |
//! | `MAD_BOOTSTRAP_TIMEOUT_MS` | optional: connect and handshake timeout (default 10 s)  |
//!
//! [`MadrunBootstrap::from_env`] reads them, connects, proves knowledge of the secret
//! (HMAC challenge-response, see [`crate::auth`]) and checks the server's counter-proof, so a
//! rank only ever talks to its own launcher. The protocol is described in [`wire`]; the
//! server's logic is the sans-I/O [`server::Coordinator`].
//!
//! ```no_run
//! use mad_core::bootstrap::Bootstrap;
//! use mad_core::launch::MadrunBootstrap;
//! # fn main() -> mad_core::Result<()> {
//! // `None` when the program was not started by madrun.
//! if let Some(b) = MadrunBootstrap::from_env()? {
//!     let me = format!("endpoint of rank {}", b.rank());
//!     let all = b.allgather("endpoints", me.as_bytes())?; // one value per rank, in rank order
//!     assert_eq!(all.len(), b.size());
//! }
//! # Ok(()) }
//! ```

pub mod mpi_env;
pub mod pmi;
pub mod server;
pub mod wire;

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::{self, Secret};
use crate::bootstrap::{Bootstrap, RankFailure, Scope};
use crate::error::{Error, Result};
use wire::{Frame, FrameReader};

/// Default bound on connecting and authenticating to the bootstrap server.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on the launcher's answer to an abort (it answers at once unless it is stuck).
const ABORT_REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// The names of the environment variables `madrun` sets.
pub mod vars {
    /// Rank of this process.
    pub const RANK: &str = "MAD_RANK";
    /// Number of processes.
    pub const SIZE: &str = "MAD_SIZE";
    /// `ip:port` of the bootstrap server.
    pub const BOOTSTRAP: &str = "MAD_BOOTSTRAP";
    /// Session secret (hex).
    pub const SECRET: &str = "MAD_SECRET";
    /// Processes on this host.
    pub const LOCAL_SIZE: &str = "MAD_LOCAL_SIZE";
    /// Job identifier.
    pub const JOB: &str = "MAD_JOB";
    /// Connect/handshake timeout in milliseconds.
    pub const TIMEOUT_MS: &str = "MAD_BOOTSTRAP_TIMEOUT_MS";
}

/// Whether this process was started by `madrun` (`MAD_BOOTSTRAP` is set).
pub fn env_present() -> bool {
    std::env::var_os(vars::BOOTSTRAP).is_some()
}

/// The launcher settings of one rank, parsed from the environment (or anything else that maps
/// variable names to values).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MadrunEnv {
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub size: usize,
    /// The bootstrap server.
    pub addr: SocketAddr,
    /// The session secret.
    pub secret: Secret,
    /// Processes on this host, if given.
    pub local_size: Option<usize>,
    /// The job identifier, if given.
    pub job: Option<String>,
    /// Connect and handshake timeout.
    pub connect_timeout: Duration,
}

impl MadrunEnv {
    /// Parse the variables through `get`. `Ok(None)` when `MAD_BOOTSTRAP` is absent; a
    /// [`Error::BadConfig`] naming the variable when one is missing or malformed.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the variable when one is missing or
    /// malformed.
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some(addr_s) = get(vars::BOOTSTRAP) else {
            return Ok(None);
        };
        let bad = |var: &str, v: &str, why: &str| {
            Error::BadConfig(format!(
                "{var}={v:?}: {why} (set by madrun; was the environment edited?)"
            ))
        };
        let need = |var: &str| {
            get(var).ok_or_else(|| {
                Error::BadConfig(format!("{var} is not set but {} is", vars::BOOTSTRAP))
            })
        };
        let addr = addr_s
            .trim()
            .parse::<SocketAddr>()
            .ok()
            .or_else(|| {
                addr_s
                    .trim()
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
            })
            .ok_or_else(|| bad(vars::BOOTSTRAP, &addr_s, "expected ip:port"))?;
        let size_s = need(vars::SIZE)?;
        let size: usize = size_s
            .trim()
            .parse()
            .map_err(|_| bad(vars::SIZE, &size_s, "expected a number"))?;
        if size == 0 || size > wire::MAX_RANKS {
            return Err(bad(
                vars::SIZE,
                &size_s,
                &format!("must be in 1..={}", wire::MAX_RANKS),
            ));
        }
        let rank_s = need(vars::RANK)?;
        let rank: usize = rank_s
            .trim()
            .parse()
            .map_err(|_| bad(vars::RANK, &rank_s, "expected a number"))?;
        if rank >= size {
            return Err(bad(
                vars::RANK,
                &rank_s,
                &format!("must be below MAD_SIZE={size}"),
            ));
        }
        let secret_s = need(vars::SECRET)?;
        let secret = Secret::from_hex(&secret_s)
            .map_err(|e| Error::BadConfig(format!("{}: {e}", vars::SECRET)))?;
        let local_size = match get(vars::LOCAL_SIZE) {
            None => None,
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n >= 1 && n <= size => Some(n),
                _ => {
                    return Err(bad(
                        vars::LOCAL_SIZE,
                        &v,
                        &format!("expected a number in 1..={size}"),
                    ))
                }
            },
        };
        let job = match get(vars::JOB) {
            None => None,
            Some(v)
                if !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                Some(v)
            }
            Some(v) => return Err(bad(vars::JOB, &v, "expected 1 to 64 hex digits")),
        };
        let connect_timeout = match get(vars::TIMEOUT_MS) {
            None => DEFAULT_CONNECT_TIMEOUT,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => {
                    return Err(bad(
                        vars::TIMEOUT_MS,
                        &v,
                        "expected a positive number of milliseconds",
                    ))
                }
            },
        };
        Ok(Some(MadrunEnv {
            rank,
            size,
            addr,
            secret,
            local_size,
            job,
            connect_timeout,
        }))
    }

    /// Parse the process environment (see [`MadrunEnv::parse`]). A variable that is not valid
    /// Unicode is reported as malformed.
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the variable when one is missing,
    /// malformed or not Unicode.
    pub fn from_process_env() -> Result<Option<Self>> {
        for k in [
            vars::BOOTSTRAP,
            vars::RANK,
            vars::SIZE,
            vars::SECRET,
            vars::LOCAL_SIZE,
            vars::JOB,
            vars::TIMEOUT_MS,
        ] {
            if std::env::var_os(k).is_some_and(|v| v.to_str().is_none()) {
                return Err(Error::BadConfig(format!("{k} is not valid Unicode")));
            }
        }
        Self::parse(|k| std::env::var(k).ok())
    }
}

struct Conn {
    stream: TcpStream,
    reader: FrameReader,
    /// Why the stream can no longer be trusted to be in step with the server, if it cannot.
    broken: Option<String>,
}

/// The bootstrap of a process started by `madrun`.
pub struct MadrunBootstrap {
    env: MadrunEnv,
    conn: Mutex<Conn>,
}

impl std::fmt::Debug for MadrunBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MadrunBootstrap(rank {} of {}, server {})",
            self.env.rank, self.env.size, self.env.addr
        )
    }
}

fn server_error(what: impl Into<String>) -> Error {
    Error::io(
        "madrun bootstrap",
        std::io::Error::new(std::io::ErrorKind::InvalidData, what.into()),
    )
}

fn from_server(e: Error) -> Error {
    match e {
        Error::Protocol { what, .. } => {
            server_error(format!("bad frame from the launcher: {what}"))
        }
        e => e,
    }
}

impl MadrunBootstrap {
    /// Connect to the launcher named by the environment. `Ok(None)` when the process was not
    /// started by `madrun` (`MAD_BOOTSTRAP` unset).
    ///
    /// # Errors
    ///
    /// As [`MadrunEnv::from_process_env`] and [`connect`](Self::connect).
    pub fn from_env() -> Result<Option<Self>> {
        match MadrunEnv::from_process_env()? {
            None => Ok(None),
            Some(env) => Self::connect(env).map(Some),
        }
    }

    /// Connect and authenticate to the server described by `env`.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the launcher cannot be reached;
    /// [`Error::Auth`] when it refuses the secret;
    /// [`Error::Protocol`] for an answer that breaks the launcher protocol;
    /// [`Error::Timeout`] when it does not answer in time.
    pub fn connect(env: MadrunEnv) -> Result<Self> {
        let deadline = Instant::now() + env.connect_timeout;
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&env.addr, left.max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() + Duration::from_millis(50) < deadline
                        && e.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("connecting to the madrun bootstrap server at {}", env.addr),
                        e,
                    ))
                }
            }
        };
        let mut conn = Conn {
            stream,
            reader: FrameReader::with_limit(wire::MAX_MESSAGE + 64),
            broken: None,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let io = |e| Error::io("madrun bootstrap handshake", e);
        conn.stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(io)?;
        conn.stream.set_nodelay(true).map_err(io)?;
        let nonce_a = match conn
            .reader
            .read_frame(&mut conn.stream)
            .map_err(from_server)?
        {
            Some(Frame::Challenge { nonce }) => nonce,
            Some(Frame::Failed { message, .. }) => return Err(Error::Auth(message)),
            Some(_) => return Err(server_error("expected a challenge from the launcher")),
            None => {
                return Err(server_error(
                    "the launcher closed the connection during the handshake",
                ))
            }
        };
        let nonce_c = auth::nonce()?;
        let rank = env.rank as u32;
        let rb = rank.to_le_bytes();
        let proof = env.secret.proof(b"madrun-client", &nonce_a, &nonce_c, &rb);
        wire::write_frame(
            &mut conn.stream,
            &Frame::Hello {
                rank,
                nonce: nonce_c,
                proof,
            },
        )?;
        match conn
            .reader
            .read_frame(&mut conn.stream)
            .map_err(from_server)?
        {
            Some(Frame::Welcome { proof }) => {
                if !env
                    .secret
                    .verify(b"madrun-server", &nonce_a, &nonce_c, &rb, &proof)
                {
                    return Err(Error::Auth(format!(
                        "the bootstrap server at {} does not know the session secret",
                        env.addr
                    )));
                }
            }
            Some(Frame::Failed { message, .. }) => return Err(Error::Auth(message)),
            Some(_) => return Err(server_error("expected WELCOME from the launcher")),
            None => {
                return Err(Error::Auth(
                    "the launcher closed the connection during the handshake".into(),
                ))
            }
        }
        conn.stream.set_read_timeout(None).map_err(io)?;
        conn.reader.set_limit(wire::MAX_FRAME);
        Ok(MadrunBootstrap {
            env,
            conn: Mutex::new(conn),
        })
    }

    /// The job identifier given by the launcher, if any.
    pub fn job(&self) -> Option<&str> {
        self.env.job.as_deref()
    }

    /// The bootstrap server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.env.addr
    }
}

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. }
        if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

fn eof() -> Error {
    Error::io(
        "madrun bootstrap",
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the launcher closed the bootstrap connection (madrun exited?)",
        ),
    )
}

fn failed_error(rank: Option<u32>, message: String) -> Error {
    match rank {
        Some(r) => Error::ConnectionLost {
            rank: r as usize,
            source: std::io::Error::new(std::io::ErrorKind::ConnectionAborted, message),
        },
        None => server_error(message),
    }
}

fn rank_failure(rank: u32, kind: String, message: String, missing: Vec<u32>) -> RankFailure {
    RankFailure {
        rank: rank as usize,
        kind,
        message,
        missing: missing.into_iter().map(|r| r as usize).collect(),
    }
}

impl MadrunBootstrap {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Conn>> {
        let guard = self.conn.lock().map_err(|_| Error::Poisoned {
            rank: self.env.rank,
            cause: "a thread panicked inside a bootstrap allgather".into(),
        })?;
        if let Some(why) = &guard.broken {
            return Err(Error::io(
                "madrun bootstrap",
                std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    format!("connection unusable after an earlier failure: {why}"),
                ),
            ));
        }
        Ok(guard)
    }

    fn gather(&self, scope: Option<&Scope>, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        if tag.len() > wire::MAX_TAG {
            return Err(Error::BadConfig(format!(
                "allgather tag of {} bytes exceeds {}",
                tag.len(),
                wire::MAX_TAG
            )));
        }
        if value.len() > wire::MAX_VALUE {
            return Err(Error::BadConfig(format!(
                "allgather value of {} bytes exceeds {}",
                value.len(),
                wire::MAX_VALUE
            )));
        }
        let mut guard = self.lock()?;
        let conn = &mut *guard;
        let req = Frame::Allgather {
            tag: tag.to_string(),
            value: value.to_vec(),
        };
        wire::write_frame(&mut conn.stream, &req)?;
        let io = |e| Error::io("madrun bootstrap: setting the read timeout", e);
        if let Some(s) = scope {
            let left = s.deadline.saturating_duration_since(Instant::now());
            conn.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(io)?;
        }
        let got = conn
            .reader
            .read_frame(&mut conn.stream)
            .map_err(from_server);
        let (what, timeout) = match scope {
            Some(s) => (s.what.clone(), s.timeout),
            None => (format!("allgather `{tag}`"), Duration::ZERO),
        };
        let got = match (got, scope) {
            (Err(e), Some(s)) if is_timeout(&e) => {
                // Nobody failed, somebody is late: abandon the scope, which fails it for
                // everybody, and learn from the server who never arrived.
                let message = format!("rank {} waited {:?} in `{tag}`", self.env.rank, s.timeout);
                let Ok((pending, first)) =
                    self.abort_locked(conn, s, RankFailure::TIMEOUT, &message)
                else {
                    return Err(s.timeout_error(Vec::new()));
                };
                return Err(match pending {
                    Some(Frame::Failed { rank, message }) => failed_error(rank, message),
                    _ => first.to_error_for(&what, timeout),
                });
            }
            (got, _) => got,
        };
        if scope.is_some() {
            conn.stream.set_read_timeout(None).map_err(io)?;
        }
        match got? {
            Some(Frame::Gathered { tag: t, values }) if t == tag => {
                if values.len() != self.env.size {
                    return Err(server_error(format!(
                        "allgather `{tag}` returned {} values for {} ranks",
                        values.len(),
                        self.env.size
                    )));
                }
                Ok(values)
            }
            Some(Frame::Aborted {
                tag: t,
                rank,
                kind,
                message,
                missing,
            }) if t == tag => {
                Err(rank_failure(rank, kind, message, missing).to_error_for(&what, timeout))
            }
            Some(Frame::Gathered { tag: t, .. } | Frame::Aborted { tag: t, .. }) => {
                Err(server_error(format!(
                    "asked for allgather `{tag}`, the launcher answered `{t}`"
                )))
            }
            Some(Frame::Failed { rank, message }) => Err(failed_error(rank, message)),
            Some(_) => Err(server_error("unexpected frame during allgather")),
            None => Err(eof()),
        }
    }

    /// Send an abort of `scope` and read until the server answers it. Returns the answer to
    /// the allgather that was pending on this connection, if one arrived meanwhile, and the
    /// scope's first failure. A connection that does not answer is marked broken.
    fn abort_locked(
        &self,
        conn: &mut Conn,
        scope: &Scope,
        kind: &str,
        message: &str,
    ) -> Result<(Option<Frame>, RankFailure)> {
        let r = (|| {
            wire::write_frame(
                &mut conn.stream,
                &Frame::Abort {
                    scope: scope.prefix.clone(),
                    kind: kind.to_string(),
                    message: message.to_string(),
                },
            )?;
            conn.stream
                .set_read_timeout(Some(ABORT_REPLY_TIMEOUT))
                .map_err(|e| Error::io("madrun bootstrap: setting the read timeout", e))?;
            let mut pending = None;
            loop {
                match conn
                    .reader
                    .read_frame(&mut conn.stream)
                    .map_err(from_server)?
                {
                    Some(Frame::Aborted {
                        tag,
                        rank,
                        kind,
                        message,
                        missing,
                    }) if tag == scope.prefix => {
                        return Ok((pending, rank_failure(rank, kind, message, missing)))
                    }
                    Some(
                        f @ (Frame::Gathered { .. } | Frame::Aborted { .. } | Frame::Failed { .. }),
                    ) if pending.is_none() => pending = Some(f),
                    Some(_) => return Err(server_error("unexpected frame while aborting")),
                    None => return Err(eof()),
                }
            }
        })();
        match &r {
            Ok(_) => {
                conn.stream
                    .set_read_timeout(None)
                    .map_err(|e| Error::io("madrun bootstrap: setting the read timeout", e))?;
            }
            Err(e) => conn.broken = Some(format!("aborting `{}`: {e}", scope.prefix)),
        }
        r
    }
}

impl Bootstrap for MadrunBootstrap {
    fn rank(&self) -> usize {
        self.env.rank
    }
    fn size(&self) -> usize {
        self.env.size
    }
    fn secret(&self) -> &Secret {
        &self.env.secret
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(None, tag, value)
    }
    fn scoped_allgather(&self, scope: &Scope, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.gather(Some(scope), tag, value)
    }
    fn abandon(&self, scope: &Scope, failure: &RankFailure) -> Result<RankFailure> {
        let mut guard = self.lock()?;
        let (_, first) = self.abort_locked(&mut guard, scope, &failure.kind, &failure.message)?;
        Ok(first)
    }
    fn kind(&self) -> &'static str {
        "madrun"
    }
}

#[cfg(test)]
mod tests {
    use super::server::BootstrapServer;
    use super::*;
    use std::collections::HashMap;
    use std::sync::Arc;

    fn env_of(pairs: &[(&str, &str)]) -> Result<Option<MadrunEnv>> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        MadrunEnv::parse(|k| m.get(k).cloned())
    }

    fn good(secret: &str) -> Vec<(&'static str, String)> {
        vec![
            ("MAD_BOOTSTRAP", "127.0.0.1:4000".into()),
            ("MAD_RANK", "1".into()),
            ("MAD_SIZE", "3".into()),
            ("MAD_SECRET", secret.into()),
            ("MAD_LOCAL_SIZE", "3".into()),
            ("MAD_JOB", "00ff".into()),
        ]
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn env_parsing_accepts_good_and_names_bad_variables() {
        assert_eq!(env_of(&[]).unwrap(), None);
        let hex = Secret::random().unwrap().to_hex();
        let base = good(&hex);
        let as_ref = |v: &[(&'static str, String)]| {
            env_of(&v.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>())
        };
        let e = as_ref(&base).unwrap().unwrap();
        assert_eq!((e.rank, e.size, e.local_size), (1, 3, Some(3)));
        assert_eq!(e.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        let cases: &[(&str, &str)] = &[
            ("MAD_BOOTSTRAP", "nowhere"),
            ("MAD_RANK", "3"),
            ("MAD_RANK", "-1"),
            ("MAD_RANK", ""),
            ("MAD_SIZE", "0"),
            ("MAD_SIZE", "99999"),
            ("MAD_SIZE", "x"),
            ("MAD_SECRET", "abc"),
            ("MAD_SECRET", &"zz".repeat(32)),
            ("MAD_LOCAL_SIZE", "4"),
            ("MAD_JOB", "not hex"),
            ("MAD_BOOTSTRAP_TIMEOUT_MS", "0"),
            ("MAD_BOOTSTRAP_TIMEOUT_MS", "soon"),
        ];
        for (k, v) in cases {
            let mut vars = base.clone();
            vars.retain(|(n, _)| n != k);
            vars.push((k, v.to_string()));
            match as_ref(&vars) {
                Err(Error::BadConfig(m)) => assert!(m.contains(k), "{k}={v}: {m}"),
                other => panic!("{k}={v}: expected BadConfig, got {other:?}"),
            }
        }
        for missing in ["MAD_RANK", "MAD_SIZE", "MAD_SECRET"] {
            let mut vars = base.clone();
            vars.retain(|(n, _)| *n != missing);
            match as_ref(&vars) {
                Err(Error::BadConfig(m)) => assert!(m.contains(missing), "{m}"),
                other => panic!("{missing}: {other:?}"),
            }
        }
    }

    fn env_for(addr: SocketAddr, rank: usize, size: usize, secret: &Secret) -> MadrunEnv {
        MadrunEnv {
            rank,
            size,
            addr,
            secret: secret.clone(),
            local_size: None,
            job: None,
            connect_timeout: Duration::from_secs(5),
        }
    }

    fn server(size: usize, secret: &Secret) -> (BootstrapServer, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l2 = log.clone();
        let s = BootstrapServer::start(
            "127.0.0.1:0".parse().unwrap(),
            size,
            secret.clone(),
            Box::new(move |m| l2.lock().unwrap().push(m.to_string())),
        )
        .unwrap();
        (s, log)
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn allgather_between_threads_through_a_real_server() {
        let secret = Secret::random().unwrap();
        let (srv, log) = server(3, &secret);
        let addr = srv.local_addr();
        // A stranger with the wrong secret is refused and the job goes on.
        let wrong = Secret::random().unwrap();
        assert!(matches!(
            MadrunBootstrap::connect(env_for(addr, 0, 3, &wrong)),
            Err(Error::Auth(_))
        ));
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let s = secret.clone();
                std::thread::spawn(move || {
                    let b = MadrunBootstrap::connect(env_for(addr, r, 3, &s)).unwrap();
                    let a = b.allgather("a", format!("v{r}").as_bytes()).unwrap();
                    b.barrier("b").unwrap();
                    let c = b.allgather("c", &vec![r as u8; 100_000]).unwrap();
                    (a, c)
                })
            })
            .collect();
        for h in handles {
            let (a, c) = h.join().unwrap();
            assert_eq!(a, vec![b"v0".to_vec(), b"v1".to_vec(), b"v2".to_vec()]);
            for (r, v) in c.iter().enumerate() {
                assert_eq!(v, &vec![r as u8; 100_000]);
            }
        }
        assert!(log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("refused bootstrap connection from 127.0.0.1:")));
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn garbage_and_oversized_connections_are_refused_without_harm() {
        use std::io::{Read, Write};
        let secret = Secret::random().unwrap();
        let (srv, log) = server(1, &secret);
        let addr = srv.local_addr();
        for junk in [
            &u32::MAX.to_le_bytes()[..],
            &1000u32.to_le_bytes()[..],
            b"\x05\0\0\0\x63abcd",
            b"GET / HTTP/1.0\r\n\r\n",
        ] {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(junk).unwrap();
            // The server answers (challenge, then refusal) and closes: read to EOF.
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        }
        let b = MadrunBootstrap::connect(env_for(addr, 0, 1, &secret)).unwrap();
        assert_eq!(b.allgather("t", b"v").unwrap(), vec![b"v".to_vec()]);
        let log = log.lock().unwrap();
        assert_eq!(
            log.iter().filter(|l| l.contains("refused")).count(),
            4,
            "{log:?}"
        );
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn a_departed_rank_fails_pending_and_later_allgathers() {
        let secret = Secret::random().unwrap();
        let (srv, _log) = server(3, &secret);
        let addr = srv.local_addr();
        let b0 = MadrunBootstrap::connect(env_for(addr, 0, 3, &secret)).unwrap();
        let b1 = MadrunBootstrap::connect(env_for(addr, 1, 3, &secret)).unwrap();
        let b2 = MadrunBootstrap::connect(env_for(addr, 2, 3, &secret)).unwrap();
        let t = std::thread::spawn(move || b0.allgather("x", b"0").map(|_| ()));
        std::thread::sleep(Duration::from_millis(100));
        drop(b2);
        match t.join().unwrap() {
            Err(Error::ConnectionLost { rank: 2, source }) => {
                assert!(source.to_string().contains("rank 2"))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            b1.allgather("y", b"1"),
            Err(Error::ConnectionLost { rank: 2, .. })
        ));
        // The same rank cannot come back.
        assert!(MadrunBootstrap::connect(env_for(addr, 2, 3, &secret)).is_err());
        assert_eq!(srv.departed(), Some(2));
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn an_abandoned_scope_fails_the_others_naming_the_rank_and_its_error() {
        let secret = Secret::random().unwrap();
        let (srv, log) = server(3, &secret);
        let addr = srv.local_addr();
        let bs: Vec<MadrunBootstrap> = (0..3)
            .map(|r| MadrunBootstrap::connect(env_for(addr, r, 3, &secret)).unwrap())
            .collect();
        let scope = Scope::new("chan/x/", "channel `x`: open", Duration::from_secs(30));
        let mut bs = bs.into_iter();
        let (b0, b1, b2) = (bs.next().unwrap(), bs.next().unwrap(), bs.next().unwrap());
        let s0 = scope.clone();
        let t0 = std::thread::spawn(move || b0.scoped_allgather(&s0, "chan/x/core", b"0"));
        std::thread::sleep(Duration::from_millis(100));
        let e = Error::Resource("shm: Too many open files (os error 24)".into());
        let first = b1.abandon(&scope, &RankFailure::from_error(1, &e)).unwrap();
        assert_eq!((first.rank, first.kind.as_str()), (1, "Resource"));
        let started = Instant::now();
        match t0.join().unwrap() {
            Err(Error::RemoteFailure {
                rank: 1,
                kind,
                message,
                what,
            }) => {
                assert_eq!(kind, "Resource");
                assert!(message.contains("Too many open files"), "{message}");
                assert_eq!(what, "channel `x`: open");
            }
            other => panic!("{other:?}"),
        }
        // A later collective of the scope fails at once; the error reads well.
        let e2 = b2
            .scoped_allgather(&scope, "chan/x/shm/segs", b"2")
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(20));
        assert_eq!(
            e2.to_string(),
            "channel `x`: open failed on rank 1: resource exhausted: shm: Too many open files (os error 24)"
        );
        assert!(log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("rank 1 abandoned")));
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn a_scope_deadline_names_the_rank_that_never_arrived() {
        let secret = Secret::random().unwrap();
        let (srv, _log) = server(3, &secret);
        let addr = srv.local_addr();
        // Rank 2 is connected but never enters the open; ranks 0 and 1 do, with a 300 ms bound.
        let _b2 = MadrunBootstrap::connect(env_for(addr, 2, 3, &secret)).unwrap();
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let s = secret.clone();
                std::thread::spawn(move || {
                    let b = MadrunBootstrap::connect(env_for(addr, r, 3, &s)).unwrap();
                    let scope = Scope::new(
                        "chan/t/",
                        "channel `t`: open",
                        Duration::from_millis(300 + 200 * r as u64),
                    );
                    let t = Instant::now();
                    let e = b.scoped_allgather(&scope, "chan/t/core", b"x").unwrap_err();
                    (e, t.elapsed())
                })
            })
            .collect();
        for h in handles {
            let (e, took) = h.join().unwrap();
            match &e {
                Error::CollectiveTimeout { missing, what, .. } => {
                    assert_eq!(missing, &vec![2], "{e}");
                    assert_eq!(what, "channel `t`: open");
                }
                other => panic!("{other:?}"),
            }
            assert!(e.to_string().contains("waiting for rank 2"), "{e}");
            assert!(took < Duration::from_secs(20), "{took:?}");
        }
    }
}
