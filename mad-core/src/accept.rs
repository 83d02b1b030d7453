//! The hardened acceptor drivers share at channel open: accept the connections a rank expects
//! until each has arrived, refusing strangers without giving up; and its connector side over
//! TCP ([`dial`]: retry until the peer listens, then bound the handshake by the deadline).
//!
//! [`accept_all`] polls a non-blocking listener until a deadline. Every accepted connection
//! gets a detached handshake thread running the driver's own handshake (a silent stranger
//! only holds its own thread until the handshake's timeout), which answers with
//! [`Accepted`]: a peer under a key the driver expects (a rank, or a rank and a queue pair), a
//! refusal (logged as a `warn` event naming the address and the reason, under the driver's
//! own target through [`refusal_log!`](crate::refusal_log), and accepting goes on), or a fatal
//! error (the open fails). A second connection for a key already taken is
//! refused. The open fails at the deadline naming the ranks that never connected, when the
//! stop flag is raised (another part of the open failed), and when the process runs out of
//! descriptors or threads.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The connector's side of a channel open over TCP: dial `addr` until it answers or
/// `deadline` passes (the peer's listener may not be up yet: a refused or interrupted
/// connect is retried every 10 ms), then bound the socket's reads and writes by the deadline
/// ([`set_timeouts`]) for the handshake that follows.
///
/// # Errors
///
/// The connect's error other than a refusal; [`io::ErrorKind::TimedOut`] at the deadline.
pub fn dial(addr: std::net::SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let st = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "setup timeout: no answer before the open's deadline",
            ));
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(st) => break st,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
                ) =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    };
    set_timeouts(&st, deadline, Duration::MAX)?;
    Ok(st)
}

/// Bound a set-up socket's reads and writes by what is left until `deadline`, at most `cap`
/// (and at least 1 ms: a zero timeout would mean none).
///
/// # Errors
///
/// The `setsockopt` error.
pub fn set_timeouts(st: &TcpStream, deadline: Instant, cap: Duration) -> io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .min(cap)
        .max(Duration::from_millis(1));
    st.set_read_timeout(Some(left))?;
    st.set_write_timeout(Some(left))
}

/// A listening socket [`accept_all`] can drive.
pub trait Listener: AsFd {
    /// The accepted connections.
    type Stream: Send + 'static;
    /// Switch the listener's non-blocking mode.
    ///
    /// # Errors
    ///
    /// The `fcntl` error.
    fn set_nonblocking(&self, on: bool) -> io::Result<()>;
    /// Accept one connection, with the peer's address as text (for the log).
    ///
    /// # Errors
    ///
    /// The `accept` error (`WouldBlock` when no connection is waiting).
    fn accept_one(&self) -> io::Result<(Self::Stream, String)>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        TcpListener::set_nonblocking(self, on)
    }
    fn accept_one(&self) -> io::Result<(TcpStream, String)> {
        self.accept().map(|(s, a)| (s, a.to_string()))
    }
}

impl Listener for UnixListener {
    type Stream = UnixStream;
    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        UnixListener::set_nonblocking(self, on)
    }
    fn accept_one(&self) -> io::Result<(UnixStream, String)> {
        self.accept().map(|(s, a)| {
            let addr = a
                .as_pathname()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "a local socket".into());
            (s, addr)
        })
    }
}

/// What a connection a driver expects is known by: a rank, or more (a rank and a queue pair).
pub trait PeerKey: Copy + Eq + Send + 'static {
    /// The rank at the other end.
    fn rank(&self) -> usize;
    /// How a refusal names it ("rank 3", "rank 3 queue pair 1").
    fn describe(&self) -> String {
        format!("rank {}", self.rank())
    }
}

impl PeerKey for usize {
    fn rank(&self) -> usize {
        *self
    }
}

/// The outcome of one accepted connection's handshake.
#[derive(Debug)]
pub enum Accepted<K, S> {
    /// A peer that proved itself, under the key it connected for.
    Peer(K, S),
    /// A stranger, or a peer that broke the handshake: (its address, why). Logged; accepting
    /// goes on.
    Refused(String, String),
    /// The open must fail (a peer with another configuration, no randomness).
    Fatal(Error),
}

/// How a refusal is logged: (channel, this rank, the stranger's address, why). Made by
/// [`refusal_log!`](crate::refusal_log) in the driver, so the event has the driver's target
/// (`MAD_LOG=mad_tcp=warn` shows it).
pub type RefusalLog = fn(&str, usize, &str, &str);

/// A [`RefusalLog`] whose `warn` events have the calling module's target.
#[macro_export]
macro_rules! refusal_log {
    () => {
        |channel: &str, rank: usize, from: &str, why: &str| {
            $crate::__tracing::warn!(
                channel = %channel,
                rank,
                from,
                reason = why,
                "refused connection from {from} on channel {channel}: {why}"
            )
        }
    };
}

/// What an open's acceptor is for, for its messages and its threads' names.
#[derive(Clone, Copy, Debug)]
pub struct AcceptFor<'a> {
    /// The driver's name (`tcp`, `via:soft`).
    pub driver: &'a str,
    /// The channel.
    pub channel: &'a str,
    /// This rank.
    pub me: usize,
    /// When accepting gives up.
    pub deadline: Instant,
    /// The bound the deadline came from (reported on timeout).
    pub timeout: Duration,
    /// How refusals are logged ([`refusal_log!`](crate::refusal_log)).
    pub log: RefusalLog,
}

/// Longest single wait on the listener (the stop flag is looked at in between).
const SLICE: Duration = Duration::from_millis(50);

/// Accept a connection for every key of `expected` through `listener`, each authenticated by
/// `handshake` on a thread of its own. Returns the streams in the order of `expected`.
///
/// # Errors
///
/// [`Error::Io`] (`TimedOut`) when the deadline passes before every expected peer
/// has connected, or when the listener fails; [`Error::Protocol`] when
/// `stop` is raised (the setup was cancelled); the first fatal error of `handshake`. Strangers and
/// duplicates are refused and logged, not returned.
pub fn accept_all<L, K, H>(
    what: &AcceptFor<'_>,
    listener: &L,
    stop: &AtomicBool,
    expected: &[K],
    handshake: H,
) -> Result<Vec<L::Stream>>
where
    L: Listener,
    K: PeerKey,
    H: Fn(L::Stream, String) -> Accepted<K, L::Stream> + Clone + Send + 'static,
{
    let mut got: Vec<Option<L::Stream>> = expected.iter().map(|_| None).collect();
    let mut missing = expected.len();
    if missing == 0 {
        return Ok(Vec::new());
    }
    let d = what.driver;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(format!("{d}: making the listener non-blocking"), e))?;
    let (tx, rx) = mpsc::channel::<(String, Accepted<K, L::Stream>)>();
    let refuse = |addr: &str, why: &str| (what.log)(what.channel, what.me, addr, why);
    loop {
        while let Ok((addr, a)) = rx.try_recv() {
            match a {
                Accepted::Peer(k, s) => match expected.iter().position(|e| *e == k) {
                    None => refuse(&addr, &format!("{} was not expected here", k.describe())),
                    Some(i) if got[i].is_some() => {
                        refuse(&addr, &format!("{} is already connected", k.describe()))
                    }
                    Some(i) => {
                        tracing::debug!(peer = k.rank(), key = %k.describe(), "accepted and authenticated");
                        got[i] = Some(s);
                        missing -= 1;
                    }
                },
                Accepted::Refused(addr, why) => refuse(&addr, &why),
                Accepted::Fatal(e) => return Err(e),
            }
        }
        if missing == 0 {
            return Ok(got.into_iter().flatten().collect());
        }
        if stop.load(Ordering::Relaxed) {
            return Err(Error::protocol(what.me, format!("{d} setup cancelled")));
        }
        let now = Instant::now();
        if now >= what.deadline {
            let mut ranks: Vec<usize> = expected
                .iter()
                .zip(&got)
                .filter(|(_, g)| g.is_none())
                .map(|(k, _)| k.rank())
                .collect();
            ranks.dedup();
            return Err(Error::io(
                format!(
                    "{d} channel `{}`: rank {} got no connection from ranks {ranks:?} within {:?}",
                    what.channel, what.me, what.timeout
                ),
                io::Error::new(io::ErrorKind::TimedOut, "setup timeout"),
            ));
        }
        let left = SLICE.min(what.deadline - now);
        let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
        let mut fds = [nix::poll::PollFd::new(
            listener.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms));
        loop {
            match listener.accept_one() {
                Ok((s, addr)) => {
                    let (tx, hs) = (tx.clone(), handshake.clone());
                    // Detached: a silent stranger only holds its own thread, until its timeout.
                    let spawned = std::thread::Builder::new()
                        .name(format!(
                            "mad-{}-handshake",
                            d.split(':').next().unwrap_or(d)
                        ))
                        .spawn(move || {
                            let a = hs(s, addr.clone());
                            let _ = tx.send((addr, a));
                        });
                    if let Err(e) = spawned {
                        return Err(Error::Resource(format!(
                            "{d}: cannot spawn a handshake thread: {e}"
                        )));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                    return Err(Error::Resource(format!("{d}: accepting connections: {e}")));
                }
                // ECONNABORTED and friends: that connection is gone, keep accepting.
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Peers write their rank as one byte; a zero byte is a stranger; 9 is fatal.
    fn handshake(mut s: UnixStream, addr: String) -> Accepted<usize, UnixStream> {
        let mut b = [0u8; 1];
        match s.read_exact(&mut b) {
            Err(e) => Accepted::Refused(addr, e.to_string()),
            Ok(()) if b[0] == 0 => Accepted::Refused(addr, "a stranger".into()),
            Ok(()) if b[0] == 9 => Accepted::Fatal(Error::BadConfig("fatal".into())),
            Ok(()) => Accepted::Peer(b[0] as usize, s),
        }
    }

    fn setup(timeout: Duration) -> (tempdir::Dir, UnixListener, AcceptFor<'static>) {
        let d = tempdir::Dir::new();
        let l = UnixListener::bind(d.0.join("s")).unwrap();
        let w = AcceptFor {
            driver: "test",
            channel: "c",
            me: 0,
            deadline: Instant::now() + timeout,
            timeout,
            log: crate::refusal_log!(),
        };
        (d, l, w)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let p = std::env::temp_dir().join(format!("mad-accept-{}-{n}", std::process::id()));
                let _ = std::fs::remove_dir_all(&p);
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn connect(d: &tempdir::Dir, byte: u8) -> UnixStream {
        let mut s = UnixStream::connect(d.0.join("s")).unwrap();
        s.write_all(&[byte]).unwrap();
        s
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn strangers_and_duplicates_are_refused_and_accepting_goes_on() {
        let (d, l, w) = setup(Duration::from_secs(10));
        // A stranger, a silent one, a rank twice, a rank not expected, then the two expected.
        let _a = connect(&d, 0);
        let _silent = UnixStream::connect(d.0.join("s")).unwrap();
        let _b = connect(&d, 2);
        std::thread::sleep(Duration::from_millis(100));
        let _c = connect(&d, 2);
        let _e = connect(&d, 5);
        let _f = connect(&d, 1);
        let got = accept_all(&w, &l, &AtomicBool::new(false), &[1usize, 2], handshake).unwrap();
        assert_eq!(got.len(), 2);
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets and poll(2): not under Miri")]
    fn the_deadline_names_the_missing_ranks_and_fatal_errors_end_it() {
        let (d, l, w) = setup(Duration::from_millis(300));
        let _f = connect(&d, 1);
        let e = accept_all(&w, &l, &AtomicBool::new(false), &[1usize, 3], handshake).unwrap_err();
        assert!(e.to_string().contains("ranks [3]"), "{e}");
        let (d, l, w) = setup(Duration::from_secs(10));
        let _f = connect(&d, 9);
        let e = accept_all(&w, &l, &AtomicBool::new(false), &[1usize], handshake).unwrap_err();
        assert!(matches!(e, Error::BadConfig(_)), "{e}");
        let stop = AtomicBool::new(true);
        let e = accept_all(&w, &l, &stop, &[1usize], handshake).unwrap_err();
        assert!(e.to_string().contains("cancelled"), "{e}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "real sockets: not under Miri")]
    fn dial_waits_for_a_late_listener_and_gives_up_at_the_deadline() {
        // A port nobody listens on (yet): bound, its address noted, closed.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = dial(addr, Instant::now() + Duration::from_millis(100)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        // The listener comes up after the first refusals.
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let l = TcpListener::bind(addr).unwrap();
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"x").unwrap();
        });
        let mut st = dial(addr, Instant::now() + Duration::from_secs(20)).unwrap();
        let t = st.read_timeout().unwrap().expect("bounded by the deadline");
        assert!(t <= Duration::from_secs(20), "{t:?}");
        let mut b = [0u8; 1];
        st.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
        late.join().unwrap();
    }
}
