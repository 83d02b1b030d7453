//! The `madrun` bootstrap server: a sans-I/O [`Coordinator`] and a threaded TCP front end.
//!
//! The coordinator holds the whole protocol (authentication, one connection per rank,
//! allgather matching by tag, failure propagation when a rank leaves) and does no I/O: events
//! go in through methods, [`Action`]s come out, nonces are passed in. [`BootstrapServer`] is a
//! thin loop around it: one accept thread, one reader thread per connection, every write done
//! under the coordinator's lock.

use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::wire::{Frame, FrameReader, MAX_FRAME};
use crate::auth::{self, Secret, NONCE_LEN};
use crate::error::{Error, Result};

/// Identifies one accepted connection.
pub type ConnId = u64;

/// What the coordinator asks its I/O layer to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write this frame to the connection.
    Send(ConnId, Frame),
    /// Write this frame to each of these connections (encoded once).
    Broadcast(Vec<ConnId>, Frame),
    /// Close the connection (after the frames queued before this action).
    Close(ConnId),
    /// Print this diagnostic line on the launcher's stderr.
    Log(String),
}

#[derive(Debug)]
enum Conn {
    AwaitHello {
        peer: SocketAddr,
        nonce: [u8; NONCE_LEN],
    },
    Ready {
        rank: usize,
    },
}

#[derive(Debug)]
struct Gather {
    values: Vec<Option<Vec<u8>>>,
    have: usize,
}

/// The first failure reported for an abandoned scope.
#[derive(Clone, Debug)]
struct Abandoned {
    rank: u32,
    kind: String,
    message: String,
    missing: Vec<u32>,
}

impl Abandoned {
    fn frame(&self, tag: &str) -> Frame {
        Frame::Aborted {
            tag: tag.to_string(),
            rank: self.rank,
            kind: self.kind.clone(),
            message: self.message.clone(),
            missing: self.missing.clone(),
        }
    }
}

/// Most scopes a job may abandon (each is a failed channel open).
pub const MAX_ABANDONED: usize = 4096;

/// The protocol state of one job's bootstrap server.
#[derive(Debug)]
pub struct Coordinator {
    size: usize,
    secret: Secret,
    conns: HashMap<ConnId, Conn>,
    rank_conn: Vec<Option<ConnId>>,
    connected_once: Vec<bool>,
    gone: Option<usize>,
    gathers: HashMap<String, Gather>,
    /// Abandoned scopes (tag prefixes) and their first failure.
    abandoned: Vec<(String, Abandoned)>,
}

impl Coordinator {
    /// A coordinator for a job of `size` ranks sharing `secret`.
    pub fn new(size: usize, secret: Secret) -> Self {
        Coordinator {
            size,
            secret,
            conns: HashMap::new(),
            rank_conn: vec![None; size],
            connected_once: vec![false; size],
            gone: None,
            gathers: HashMap::new(),
            abandoned: Vec::new(),
        }
    }

    fn abandoned_for(&self, tag: &str) -> Option<&Abandoned> {
        self.abandoned
            .iter()
            .find(|(p, _)| tag.starts_with(p.as_str()))
            .map(|(_, a)| a)
    }

    /// The first rank whose bootstrap connection closed, if any.
    pub fn departed(&self) -> Option<usize> {
        self.gone
    }

    /// Whether connection `c` has authenticated as a rank.
    pub fn is_authenticated(&self, c: ConnId) -> bool {
        matches!(self.conns.get(&c), Some(Conn::Ready { .. }))
    }

    /// A connection was accepted from `peer`; `nonce` is a fresh random challenge.
    pub fn accepted(&mut self, c: ConnId, peer: SocketAddr, nonce: [u8; NONCE_LEN]) -> Vec<Action> {
        self.conns.insert(c, Conn::AwaitHello { peer, nonce });
        vec![Action::Send(c, Frame::Challenge { nonce })]
    }

    fn refuse(&mut self, c: ConnId, peer: SocketAddr, why: &str) -> Vec<Action> {
        self.conns.remove(&c);
        vec![
            Action::Log(format!(
                "madrun: refused bootstrap connection from {peer}: {why}"
            )),
            Action::Send(
                c,
                Frame::Failed {
                    rank: None,
                    message: format!("refused: {why}"),
                },
            ),
            Action::Close(c),
        ]
    }

    fn fail_rank_conn(&mut self, c: ConnId, rank: usize, why: String) -> Vec<Action> {
        // The connection stays registered until the I/O layer reports it closed, which then
        // counts as the rank leaving the job.
        vec![
            Action::Log(format!("madrun: protocol error from rank {rank}: {why}")),
            Action::Send(
                c,
                Frame::Failed {
                    rank: None,
                    message: why,
                },
            ),
            Action::Close(c),
        ]
    }

    /// A whole frame arrived on connection `c`.
    pub fn received(&mut self, c: ConnId, frame: Frame) -> Vec<Action> {
        match self.conns.get(&c) {
            None => vec![],
            Some(&Conn::AwaitHello { peer, nonce }) => self.hello(c, peer, nonce, frame),
            Some(&Conn::Ready { rank }) => match frame {
                Frame::Allgather { tag, value } => self.allgather(c, rank, tag, value),
                Frame::Abort {
                    scope,
                    kind,
                    message,
                } => self.abort(c, rank, scope, kind, message),
                other => self.fail_rank_conn(c, rank, format!("unexpected {} frame", kind(&other))),
            },
        }
    }

    fn hello(
        &mut self,
        c: ConnId,
        peer: SocketAddr,
        nonce_a: [u8; NONCE_LEN],
        f: Frame,
    ) -> Vec<Action> {
        let Frame::Hello { rank, nonce, proof } = f else {
            return self.refuse(c, peer, &format!("expected HELLO, got {}", kind(&f)));
        };
        let r = rank as usize;
        if r >= self.size {
            return self.refuse(
                c,
                peer,
                &format!("rank {rank} is outside the job (size {})", self.size),
            );
        }
        let rb = rank.to_le_bytes();
        if !self
            .secret
            .verify(b"madrun-client", &nonce_a, &nonce, &rb, &proof)
        {
            return self.refuse(
                c,
                peer,
                &format!("bad proof for rank {rank} (wrong session secret)"),
            );
        }
        if self.connected_once[r] {
            return self.refuse(c, peer, &format!("rank {rank} already connected once"));
        }
        self.connected_once[r] = true;
        self.rank_conn[r] = Some(c);
        self.conns.insert(c, Conn::Ready { rank: r });
        let proof = self.secret.proof(b"madrun-server", &nonce_a, &nonce, &rb);
        vec![Action::Send(c, Frame::Welcome { proof })]
    }

    fn departed_failure(&self, dead: usize, tag: &str) -> Frame {
        Frame::Failed {
            rank: Some(dead as u32),
            message: format!(
                "rank {dead} left the job (its bootstrap connection closed) before allgather `{tag}` completed"
            ),
        }
    }

    /// Rank `rank` abandons the collectives under `scope`: record the scope's first failure,
    /// fail its pending collectives for every rank that contributed, answer the abort.
    fn abort(
        &mut self,
        c: ConnId,
        rank: usize,
        scope: String,
        kind: String,
        message: String,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        let first = match self.abandoned_for(&scope) {
            Some(a) => a.clone(),
            None => {
                if self.abandoned.len() >= MAX_ABANDONED {
                    return self.fail_rank_conn(
                        c,
                        rank,
                        format!("more than {MAX_ABANDONED} abandoned collectives"),
                    );
                }
                // Who the scope's pending collectives are waiting for (what a timeout names).
                let mut missing: Vec<u32> = self
                    .gathers
                    .iter()
                    .filter(|(t, _)| t.starts_with(&scope))
                    .flat_map(|(_, g)| {
                        g.values
                            .iter()
                            .enumerate()
                            .filter(|(_, v)| v.is_none())
                            .map(|(r, _)| r as u32)
                    })
                    .collect();
                missing.sort_unstable();
                missing.dedup();
                let a = Abandoned {
                    rank: rank as u32,
                    kind,
                    message,
                    missing,
                };
                out.push(Action::Log(format!(
                    "madrun: rank {rank} abandoned the collectives `{scope}*`: {}",
                    a.message
                )));
                self.abandoned.push((scope.clone(), a.clone()));
                a
            }
        };
        let pending: Vec<String> = self
            .gathers
            .keys()
            .filter(|t| t.starts_with(&scope))
            .cloned()
            .collect();
        for tag in pending {
            let Some(g) = self.gathers.remove(&tag) else {
                continue;
            };
            let to: Vec<ConnId> = g
                .values
                .iter()
                .zip(&self.rank_conn)
                .filter_map(|(v, rc)| v.as_ref().and(*rc))
                .collect();
            if !to.is_empty() {
                out.push(Action::Broadcast(to, first.frame(&tag)));
            }
        }
        out.push(Action::Send(c, first.frame(&scope)));
        out
    }

    fn allgather(&mut self, c: ConnId, rank: usize, tag: String, value: Vec<u8>) -> Vec<Action> {
        if let Some(a) = self.abandoned_for(&tag) {
            return vec![Action::Send(c, a.frame(&tag))];
        }
        if let Some(dead) = self.gone {
            return vec![Action::Send(c, self.departed_failure(dead, &tag))];
        }
        let size = self.size;
        let g = self.gathers.entry(tag.clone()).or_insert_with(|| Gather {
            values: vec![None; size],
            have: 0,
        });
        if g.values[rank].is_some() {
            return self.fail_rank_conn(
                c,
                rank,
                format!("rank {rank} entered allgather `{tag}` twice"),
            );
        }
        g.values[rank] = Some(value);
        g.have += 1;
        if g.have < size {
            return vec![];
        }
        let Some(g) = self.gathers.remove(&tag) else {
            return vec![];
        };
        let values: Vec<Vec<u8>> = g
            .values
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect();
        let total: usize = values.iter().map(|v| v.len() + 4).sum::<usize>() + tag.len() + 16;
        let reply = if total > MAX_FRAME {
            Frame::Failed {
                rank: None,
                message: format!(
                    "allgather `{tag}`: the {total}-byte result exceeds the {MAX_FRAME}-byte frame limit"
                ),
            }
        } else {
            Frame::Gathered { tag, values }
        };
        let to = self.rank_conn.iter().flatten().copied().collect();
        vec![Action::Broadcast(to, reply)]
    }

    /// Bytes on connection `c` could not be decoded (or the handshake timed out).
    pub fn malformed(&mut self, c: ConnId, what: &str) -> Vec<Action> {
        match self.conns.get(&c) {
            None => vec![],
            Some(&Conn::AwaitHello { peer, .. }) => self.refuse(c, peer, what),
            Some(&Conn::Ready { rank }) => self.fail_rank_conn(c, rank, what.to_string()),
        }
    }

    /// Connection `c` is closed. If it belonged to a rank, every pending allgather fails with
    /// an error naming that rank, and so will every later one.
    pub fn closed(&mut self, c: ConnId) -> Vec<Action> {
        let Some(Conn::Ready { rank }) = self.conns.remove(&c) else {
            return vec![];
        };
        self.rank_conn[rank] = None;
        if self.gone.is_none() {
            self.gone = Some(rank);
        }
        let mut out = Vec::new();
        for (tag, g) in std::mem::take(&mut self.gathers) {
            let to: Vec<ConnId> = g
                .values
                .iter()
                .zip(&self.rank_conn)
                .filter_map(|(v, rc)| v.as_ref().and(*rc))
                .collect();
            if !to.is_empty() {
                out.push(Action::Broadcast(to, self.departed_failure(rank, &tag)));
            }
        }
        out
    }
}

fn kind(f: &Frame) -> &'static str {
    match f {
        Frame::Challenge { .. } => "CHALLENGE",
        Frame::Hello { .. } => "HELLO",
        Frame::Welcome { .. } => "WELCOME",
        Frame::Allgather { .. } => "ALLGATHER",
        Frame::Gathered { .. } => "GATHERED",
        Frame::Failed { .. } => "FAILED",
        Frame::Abort { .. } => "ABORT",
        Frame::Aborted { .. } => "ABORTED",
    }
}

/// How long a new connection may take to authenticate before it is refused.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest frame accepted from a connection that has not authenticated yet.
pub const HANDSHAKE_FRAME_LIMIT: usize = 256;
/// Bound on a single write to a client (a rank that stops reading cannot stall the job forever).
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

type LogFn = dyn Fn(&str) + Send + Sync;

struct Inner {
    coord: Coordinator,
    streams: HashMap<ConnId, TcpStream>,
}

struct Shared {
    inner: Mutex<Inner>,
    log: Box<LogFn>,
    stop: AtomicBool,
    next: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that
        // matters more than losing the job, so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, inner: &mut Inner, to: &[ConnId], f: &Frame) {
        let bytes = match f.encode() {
            Ok(b) => Some(b),
            Err(e) => {
                (self.log)(&format!("madrun: cannot encode a bootstrap frame: {e}"));
                None
            }
        };
        for c in to {
            let Some(s) = inner.streams.get_mut(c) else {
                continue;
            };
            let ok = bytes
                .as_ref()
                .is_some_and(|b| s.write_all(b).and_then(|()| s.flush()).is_ok());
            if !ok {
                // The reader thread sees the shutdown and reports the close.
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    fn run(&self, inner: &mut Inner, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Log(s) => (self.log)(&s),
                Action::Send(c, f) => self.send(inner, &[c], &f),
                Action::Broadcast(to, f) => self.send(inner, &to, &f),
                Action::Close(c) => {
                    if let Some(s) = inner.streams.get(&c) {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                }
            }
        }
    }
}

/// A running bootstrap server. Dropping it stops accepting and closes every connection.
pub struct BootstrapServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for BootstrapServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BootstrapServer({})", self.addr)
    }
}

impl BootstrapServer {
    /// Listen on `bind` and serve a job of `size` ranks sharing `secret`. `log` receives one
    /// line per diagnostic (refused connections, protocol errors).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when `bind` cannot be listened on or the accept thread
    /// cannot be started.
    pub fn start(
        bind: SocketAddr,
        size: usize,
        secret: Secret,
        log: Box<dyn Fn(&str) + Send + Sync>,
    ) -> Result<Self> {
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::io(format!("binding the bootstrap server to {bind}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("bootstrap server address", e))?;
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                coord: Coordinator::new(size, secret),
                streams: HashMap::new(),
            }),
            log,
            stop: AtomicBool::new(false),
            next: AtomicU64::new(0),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("madrun-accept".into())
            .stack_size(256 << 10)
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| Error::io("starting the bootstrap accept thread", e))?;
        Ok(BootstrapServer { addr, shared })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address clients should connect to: the listening address, with an unspecified IP
    /// (`0.0.0.0`, `::`) replaced by loopback.
    pub fn advertised_addr(&self) -> SocketAddr {
        let mut a = self.addr;
        if a.ip().is_unspecified() {
            a.set_ip(if a.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            });
        }
        a
    }

    /// The first rank whose bootstrap connection closed, if any.
    pub fn departed(&self) -> Option<usize> {
        self.shared.lock().coord.departed()
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept thread so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.advertised_addr(), Duration::from_millis(200));
        let inner = self.shared.lock();
        for s in inner.streams.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                (sh.log)(&format!("madrun: bootstrap accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let id = sh.next.fetch_add(1, Ordering::Relaxed);
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("madrun-conn-{id}"))
            .stack_size(256 << 10)
            .spawn(move || serve(id, stream, peer, sh2));
        if let Err(e) = spawned {
            (sh.log)(&format!(
                "madrun: refused bootstrap connection from {peer}: no thread: {e}"
            ));
        }
    }
}

fn serve(id: ConnId, stream: TcpStream, peer: SocketAddr, sh: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let mut rd = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            (sh.log)(&format!(
                "madrun: refused bootstrap connection from {peer}: {e}"
            ));
            return;
        }
    };
    {
        let mut inner = sh.lock();
        let actions = match auth::nonce() {
            Ok(n) => {
                inner.streams.insert(id, stream);
                inner.coord.accepted(id, peer, n)
            }
            Err(e) => vec![Action::Log(format!(
                "madrun: refused bootstrap connection from {peer}: {e}"
            ))],
        };
        sh.run(&mut inner, actions);
        if !inner.streams.contains_key(&id) {
            return;
        }
    }
    let mut reader = FrameReader::with_limit(HANDSHAKE_FRAME_LIMIT);
    let mut authenticated = false;
    let deadline = std::time::Instant::now() + HANDSHAKE_TIMEOUT;
    loop {
        if !authenticated {
            // One deadline for the whole handshake, however slowly the bytes trickle in.
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let _ = rd.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        }
        let got = reader.read_frame(&mut rd);
        let mut inner = sh.lock();
        let actions = match got {
            Ok(Some(f)) => inner.coord.received(id, f),
            Ok(None) => break,
            Err(Error::Protocol { what, .. }) => inner.coord.malformed(id, &what),
            Err(e) => {
                if inner.coord.is_authenticated(id) {
                    break; // reset or shutdown: the rank is gone
                }
                inner.coord.malformed(id, &format!("no valid HELLO ({e})"))
            }
        };
        // Once the coordinator closes this connection, read nothing more from it.
        let closing = actions
            .iter()
            .any(|a| matches!(a, Action::Close(c) if *c == id));
        sh.run(&mut inner, actions);
        if closing {
            break;
        }
        if !authenticated && inner.coord.is_authenticated(id) {
            authenticated = true;
            reader.set_limit(MAX_FRAME);
            let _ = rd.set_read_timeout(None);
        }
    }
    let mut inner = sh.lock();
    let actions = inner.coord.closed(id);
    inner.streams.remove(&id);
    sh.run(&mut inner, actions);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> SocketAddr {
        "127.0.0.1:5".parse().unwrap()
    }

    fn hello(s: &Secret, na: [u8; 16], rank: u32) -> Frame {
        let nc = [9u8; 16];
        Frame::Hello {
            rank,
            nonce: nc,
            proof: s.proof(b"madrun-client", &na, &nc, &rank.to_le_bytes()),
        }
    }

    #[test]
    fn coordinator_gathers_in_rank_order_and_refuses_strangers() {
        let s = Secret::random().unwrap();
        let mut co = Coordinator::new(2, s.clone());
        co.accepted(1, peer(), [1; 16]);
        co.accepted(2, peer(), [2; 16]);
        co.accepted(3, peer(), [3; 16]);
        assert!(matches!(
            co.received(2, hello(&s, [2; 16], 1))[0],
            Action::Send(2, Frame::Welcome { .. })
        ));
        let bad = Secret::random().unwrap();
        let a = co.received(3, hello(&bad, [3; 16], 0));
        assert!(
            matches!(&a[0], Action::Log(l) if l.contains("refused") && l.contains("127.0.0.1:5"))
        );
        assert!(co.received(1, hello(&s, [1; 16], 0)).len() == 1);
        // Duplicate rank.
        co.accepted(4, peer(), [4; 16]);
        assert!(
            matches!(&co.received(4, hello(&s, [4; 16], 0))[0], Action::Log(l) if l.contains("already"))
        );
        let ag = |t: &str, v: &[u8]| Frame::Allgather {
            tag: t.into(),
            value: v.to_vec(),
        };
        assert!(co.received(2, ag("x", b"one")).is_empty());
        let out = co.received(1, ag("x", b"zero"));
        let [Action::Broadcast(to, Frame::Gathered { values, .. })] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(to.len(), 2);
        assert_eq!(values, &vec![b"zero".to_vec(), b"one".to_vec()]);
        // A rank leaves: the pending gather fails naming it, and so do later ones.
        assert!(co.received(1, ag("y", b"")).is_empty());
        let out = co.closed(2);
        assert!(matches!(
            &out[..],
            [Action::Broadcast(to, Frame::Failed { rank: Some(1), .. })] if to == &vec![1]
        ));
        assert!(matches!(
            &co.received(1, ag("z", b""))[..],
            [Action::Send(1, Frame::Failed { rank: Some(1), .. })]
        ));
        assert_eq!(co.departed(), Some(1));
    }

    #[test]
    fn an_abandoned_scope_fails_its_pending_and_later_collectives() {
        let s = Secret::random().unwrap();
        let mut co = Coordinator::new(3, s.clone());
        for (c, r) in [(10, 0u32), (11, 1), (12, 2)] {
            co.accepted(c, peer(), [c as u8; 16]);
            co.received(c, hello(&s, [c as u8; 16], r));
        }
        let ag = |t: &str| Frame::Allgather {
            tag: t.into(),
            value: vec![],
        };
        // Ranks 0 and 2 wait in the open's first collective; rank 1's open fails.
        assert!(co.received(10, ag("chan/x/core")).is_empty());
        assert!(co.received(12, ag("chan/x/core")).is_empty());
        // Another channel's collective is not affected.
        assert!(co.received(10, ag("chan/xy/core")).is_empty());
        let out = co.received(
            11,
            Frame::Abort {
                scope: "chan/x/".into(),
                kind: "Resource".into(),
                message: "EMFILE".into(),
            },
        );
        assert!(matches!(&out[0], Action::Log(l) if l.contains("rank 1") && l.contains("EMFILE")));
        let Action::Broadcast(
            to,
            Frame::Aborted {
                tag,
                rank: 1,
                kind,
                missing,
                ..
            },
        ) = &out[1]
        else {
            panic!("{out:?}")
        };
        assert_eq!(
            (to, tag.as_str(), kind.as_str()),
            (&vec![10, 12], "chan/x/core", "Resource")
        );
        assert_eq!(missing, &vec![1]);
        assert!(
            matches!(&out[2], Action::Send(11, Frame::Aborted { tag, .. }) if tag == "chan/x/")
        );
        assert_eq!(out.len(), 3);
        // Later collectives of the scope fail at once; a second abort gets the first failure.
        assert!(matches!(
            &co.received(12, ag("chan/x/tcp/addr"))[..],
            [Action::Send(12, Frame::Aborted { rank: 1, .. })]
        ));
        assert!(matches!(
            &co.received(10, Frame::Abort { scope: "chan/x/".into(), kind: "Io".into(), message: "late".into() })[..],
            [Action::Send(10, Frame::Aborted { rank: 1, message, .. })] if message == "EMFILE"
        ));
        // The other channel completes.
        co.received(11, ag("chan/xy/core"));
        assert!(matches!(
            &co.received(12, ag("chan/xy/core"))[..],
            [Action::Broadcast(_, Frame::Gathered { .. })]
        ));
    }

    #[test]
    fn a_timeout_abort_names_the_ranks_that_never_arrived() {
        let s = Secret::random().unwrap();
        let mut co = Coordinator::new(4, s.clone());
        for (c, r) in [(1, 0u32), (2, 1), (3, 2)] {
            co.accepted(c, peer(), [c as u8; 16]);
            co.received(c, hello(&s, [c as u8; 16], r));
        }
        let ag = Frame::Allgather {
            tag: "chan/t/core".into(),
            value: vec![],
        };
        co.received(1, ag.clone());
        co.received(2, ag);
        // Rank 3 never connected, rank 2 never entered the open: rank 0 times out.
        let out = co.received(
            1,
            Frame::Abort {
                scope: "chan/t/".into(),
                kind: "CollectiveTimeout".into(),
                message: "rank 0 timed out".into(),
            },
        );
        let Action::Broadcast(to, Frame::Aborted { missing, .. }) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!((to, missing), (&vec![1, 2], &vec![2, 3]));
    }
}
