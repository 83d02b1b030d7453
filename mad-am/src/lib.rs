//! # mad-am: active messages over a Madeleine channel
//!
//! Handlers are registered by id on an [`Endpoint`] (a channel and its dispatcher). A caller
//! sends a request (a header packed EXPRESS, then the argument bytes packed CHEAPER) and gets
//! the handler's reply; one-way messages ([`Endpoint::send`]) get none.
//!
//! * **Inline handlers** ([`Endpoint::register_inline`]) run on the thread that polls, with
//!   the message still open: the handler reads [`Request::len`] and receives the arguments
//!   into memory it chooses ([`Request::recv_into`]), so a large CHEAPER argument lands there
//!   with no intermediate copy. No thread hand-off (NCS's bypass path): for short handlers.
//! * **Pool handlers** ([`Endpoint::register_pool`]) run in a bounded worker pool ("handle in
//!   a new thread", SCALE): the polling thread receives the arguments into a buffer, queues
//!   the call and goes on polling; when the queue is full it waits for a free place, which
//!   holds back the senders (back-pressure through the transport).
//! * **Replies and errors.** A reply carries the handler's bytes or its error. An unknown
//!   handler, a handler that returns `Err`, and a handler that panics give the caller
//!   [`CallError::UnknownHandler`], [`CallError::Handler`] and [`CallError::Panicked`]; the
//!   server goes on serving.
//! * **Progress** (pCoR): a thread waiting in [`Endpoint::call`] polls the channel itself
//!   when no other thread does, and hands every reply to the thread waiting for it (and
//!   every request to its handler); the others sleep on a condition variable. A server with
//!   no calling thread runs [`Endpoint::serve`] or [`Endpoint::spawn_progress`]. An idle
//!   poller sleeps in the driver (the channel's progress policy), so idling costs no CPU.
//! * **Departed peers.** A peer that dies or closes fails the calls waiting for it: through
//!   the error the channel reports, and, for a clean close between messages (which the
//!   channel reports to nobody), through a check of the peers that owe replies after every
//!   poll slice without traffic ([`Config::slice`]).
//!
//! Wire format: every message starts with a 32-byte header packed EXPRESS (kind, flags,
//! status, handler id, token, body length); a body of that many bytes follows, packed
//! CHEAPER (nothing when empty). Both sides of a channel must use this layer for every
//! message on it.
//!
//! Limits (this version): one body per message (several arrays go in one body); inline
//! handlers send their reply on the polling thread, so a long reply there waits for the
//! caller to receive it (use a pool handler for large replies to peers that may be busy
//! sending to this one); no async API yet (a future resolved by the reply).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mad_core::{Channel, Error, RecvMode, SendMode, Unpacker};

/// What a handler returns: the reply's bytes, or an error text the caller receives as
/// [`CallError::Handler`].
pub type Reply = std::result::Result<Vec<u8>, String>;

type InlineFn = dyn Fn(Request<'_>) -> Reply + Send + Sync;
type PoolFn = dyn Fn(Call) -> Reply + Send + Sync;

#[derive(Clone)]
enum Handler {
    Inline(Arc<InlineFn>),
    Pool(Arc<PoolFn>),
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The channel failed (the peer died or closed, the connection broke, the channel was
    /// closed, a bad rank, ...).
    #[error(transparent)]
    Transport(#[from] Error),
    /// The peer has no handler with this id.
    #[error("rank {rank} has no handler {id}")]
    UnknownHandler {
        /// The peer.
        rank: usize,
        /// The handler id asked for.
        id: u32,
    },
    /// The handler returned an error.
    #[error("handler {id} on rank {rank} failed: {message}")]
    Handler {
        /// The peer.
        rank: usize,
        /// The handler id.
        id: u32,
        /// The handler's error text.
        message: String,
    },
    /// The handler panicked (the peer goes on serving).
    #[error("handler {id} on rank {rank} panicked: {message}")]
    Panicked {
        /// The peer.
        rank: usize,
        /// The handler id.
        id: u32,
        /// The panic's message.
        message: String,
    },
    /// No reply within [`Config::call_timeout`] (a late reply is dropped).
    #[error("no reply from rank {rank} within {after:?}")]
    Timeout {
        /// The peer.
        rank: usize,
        /// The bound.
        after: Duration,
    },
    /// The endpoint was shut down ([`Endpoint::shutdown`]) before the reply came.
    #[error("the endpoint was shut down")]
    Shutdown,
}

/// Settings of an [`Endpoint`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Worker threads of the pool (started when the first pool handler is registered).
    pub workers: usize,
    /// Calls queued for the pool beyond those running; a full queue holds the poller back.
    pub queue: usize,
    /// Largest body this endpoint receives into a buffer of its own (pool arguments, replies);
    /// a larger one is a protocol violation and finishes that peer's connection.
    pub max_body: u64,
    /// How long a call waits for its reply; `None`: as long as the peer lives.
    pub call_timeout: Option<Duration>,
    /// How long one poll waits for traffic before the poller looks at the peers that owe
    /// replies (a peer that closed cleanly fails its callers within about this long).
    pub slice: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers: 2,
            queue: 64,
            max_body: 1 << 30,
            call_timeout: None,
            slice: Duration::from_millis(50),
        }
    }
}

impl Config {
    /// Pool size and queue length.
    pub fn pool(mut self, workers: usize, queue: usize) -> Self {
        self.workers = workers.max(1);
        self.queue = queue;
        self
    }
    /// [`Config::call_timeout`].
    pub fn call_timeout(mut self, t: Option<Duration>) -> Self {
        self.call_timeout = t;
        self
    }
    /// [`Config::max_body`].
    pub fn max_body(mut self, n: u64) -> Self {
        self.max_body = n;
        self
    }
}

const HDR: usize = 32;
const KIND_REQUEST: u8 = 1;
const KIND_REPLY: u8 = 2;
const FLAG_ONE_WAY: u8 = 1;
const ST_OK: u16 = 0;
const ST_UNKNOWN: u16 = 1;
const ST_ERROR: u16 = 2;
const ST_PANIC: u16 = 3;
const MAGIC: u32 = 0x4d41_4d31; // "MAM1"

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    kind: u8,
    flags: u8,
    status: u16,
    id: u32,
    token: u64,
    len: u64,
}

impl Header {
    fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0] = self.kind;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.status.to_le_bytes());
        b[4..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&MAGIC.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HDR]) -> Option<Header> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let h = Header {
            kind: b[0],
            flags: b[1],
            status: u16::from_le_bytes([b[2], b[3]]),
            id: u32_at(4),
            token: u64_at(8),
            len: u64_at(16),
        };
        let known = matches!(h.kind, KIND_REQUEST | KIND_REPLY)
            && h.flags & !FLAG_ONE_WAY == 0
            && h.status <= ST_PANIC
            && u32_at(24) == MAGIC
            && b[28..].iter().all(|&x| x == 0);
        known.then_some(h)
    }
}

/// A request being handled inline: the message is still open, and the handler receives the
/// arguments where it wants them. Dropped without receiving them, the arguments are read and
/// discarded (the connection stays usable).
pub struct Request<'c> {
    u: Option<Unpacker<'c, 'static>>,
    from: usize,
    id: u32,
    len: u64,
}

impl<'c> Request<'c> {
    /// The calling rank.
    pub fn from(&self) -> usize {
        self.from
    }
    /// The handler id.
    pub fn id(&self) -> u32 {
        self.id
    }
    /// Length of the arguments in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the arguments are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Receive the arguments into `buf` (exactly [`len`](Self::len) bytes; CHEAPER: they land
    /// there straight from the driver) and finish the message.
    pub fn recv_into(mut self, buf: &mut [u8]) -> mad_core::Result<()> {
        let u = self.u.take().expect("request already received");
        let from = self.from;
        finish_into(u, buf, self.len, from)
    }

    /// Receive the arguments into a new vector.
    pub fn recv_vec(self) -> mad_core::Result<Vec<u8>> {
        let len = usize::try_from(self.len).map_err(|_| Error::Protocol {
            rank: self.from,
            what: format!("active message: {} B of arguments", self.len),
        })?;
        let mut v = vec![0u8; len];
        self.recv_into(&mut v)?;
        Ok(v)
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if let Some(u) = self.u.take() {
            let _ = drain(u, self.len, self.from);
        }
    }
}

/// Receive a body of `len` bytes into `buf` and finish the message.
fn finish_into(
    u: Unpacker<'_, 'static>,
    buf: &mut [u8],
    len: u64,
    from: usize,
) -> mad_core::Result<()> {
    if buf.len() as u64 != len {
        // Read what was sent, so the connection stays in step, then report the misuse.
        drain(u, len, from)?;
        return Err(Error::Protocol {
            rank: from,
            what: format!(
                "active message: a buffer of {} B for {len} B of arguments",
                buf.len()
            ),
        });
    }
    // The unpacker's destinations may borrow for as little as `buf` lives (it is covariant).
    let mut u: Unpacker<'_, '_> = u;
    if len > 0 {
        u.unpack(buf, SendMode::Cheaper)?;
    }
    u.end_unpacking()
}

/// Receive and discard a body of `len` bytes (in 1 MiB pieces would break the piece
/// sequence: the body is one piece, so it is received whole, into a scratch buffer).
fn drain(u: Unpacker<'_, 'static>, len: u64, from: usize) -> mad_core::Result<()> {
    let n = usize::try_from(len).map_err(|_| Error::Protocol {
        rank: from,
        what: format!("active message: {len} B body"),
    })?;
    let mut scratch = vec![0u8; n];
    let mut u: Unpacker<'_, '_> = u;
    if n > 0 {
        u.unpack(&mut scratch, SendMode::Cheaper)?;
    }
    u.end_unpacking()
}

/// A request handed to a pool handler, its arguments received.
#[derive(Debug)]
pub struct Call {
    /// The calling rank.
    pub from: usize,
    /// The handler id.
    pub id: u32,
    /// The arguments.
    pub args: Vec<u8>,
}

enum Slot {
    Waiting {
        remote: usize,
    },
    /// The reply's status and body, or why there is none.
    Done(Result<(u16, Vec<u8>), CallError>),
}

struct State {
    /// A thread is polling the channel.
    polling: bool,
    calls: HashMap<u64, Slot>,
}

struct Job {
    call: Call,
    token: u64,
    reply: bool,
}

struct Inner {
    ch: Channel,
    cfg: Config,
    handlers: RwLock<HashMap<u32, Handler>>,
    state: Mutex<State>,
    cv: Condvar,
    next_token: AtomicU64,
    pool: Mutex<Option<(SyncSender<Job>, Vec<JoinHandle<()>>)>>,
    stop: AtomicBool,
}

/// A channel with an active-message dispatcher. Cheap to clone (shared); every clone serves
/// the same handlers.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("channel", &self.inner.ch.config().name)
            .field("rank", &self.inner.ch.rank())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// The rank an error is about, when it is about one connection.
fn error_rank(e: &Error) -> Option<usize> {
    match e {
        Error::PeerClosed { rank }
        | Error::ConnectionLost { rank, .. }
        | Error::UnpackMismatch { rank, .. }
        | Error::Protocol { rank, .. }
        | Error::Poisoned { rank, .. } => Some(*rank),
        _ => None,
    }
}

/// A copy of a transport error for each caller it fails.
fn transport(e: &Error) -> CallError {
    CallError::Transport(match e {
        Error::PeerClosed { rank } => Error::PeerClosed { rank: *rank },
        Error::Closed { channel } => Error::Closed {
            channel: channel.clone(),
        },
        Error::Timeout(t) => Error::Timeout(*t),
        other => match error_rank(other) {
            Some(rank) => Error::Poisoned {
                rank,
                cause: other.to_string(),
            },
            None => Error::Io {
                context: "active messages".into(),
                source: std::io::Error::other(other.to_string()),
            },
        },
    })
}

impl Endpoint {
    /// An endpoint over `ch` with the default [`Config`].
    pub fn new(ch: Channel) -> Endpoint {
        Endpoint::with_config(ch, Config::default())
    }

    /// An endpoint over `ch`.
    pub fn with_config(ch: Channel, cfg: Config) -> Endpoint {
        Endpoint {
            inner: Arc::new(Inner {
                ch,
                cfg,
                handlers: RwLock::new(HashMap::new()),
                state: Mutex::new(State {
                    polling: false,
                    calls: HashMap::new(),
                }),
                cv: Condvar::new(),
                next_token: AtomicU64::new(1),
                pool: Mutex::new(None),
                stop: AtomicBool::new(false),
            }),
        }
    }

    /// The channel.
    pub fn channel(&self) -> &Channel {
        &self.inner.ch
    }

    /// Register (or replace) handler `id`, run inline on the polling thread.
    pub fn register_inline(
        &self,
        id: u32,
        f: impl Fn(Request<'_>) -> Reply + Send + Sync + 'static,
    ) {
        let mut h = self
            .inner
            .handlers
            .write()
            .unwrap_or_else(|e| e.into_inner());
        h.insert(id, Handler::Inline(Arc::new(f)));
    }

    /// Register (or replace) handler `id`, run in the worker pool (started now if needed).
    pub fn register_pool(&self, id: u32, f: impl Fn(Call) -> Reply + Send + Sync + 'static) {
        self.start_pool();
        let mut h = self
            .inner
            .handlers
            .write()
            .unwrap_or_else(|e| e.into_inner());
        h.insert(id, Handler::Pool(Arc::new(f)));
    }

    fn start_pool(&self) {
        let mut pool = lock(&self.inner.pool);
        if pool.is_some() {
            return;
        }
        let (tx, rx) = sync_channel::<Job>(self.inner.cfg.queue);
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..self.inner.cfg.workers.max(1))
            .map(|i| {
                let rx = rx.clone();
                // The workers hold the endpoint weakly: dropping the last handle ends them.
                let weak = Arc::downgrade(&self.inner);
                std::thread::Builder::new()
                    .name(format!("mad-am-worker-{i}"))
                    .spawn(move || loop {
                        let job = lock(&rx).recv();
                        let Ok(job) = job else { return };
                        let Some(inner) = weak.upgrade() else { return };
                        Endpoint { inner }.run_pool_job(job);
                    })
                    .expect("spawning an active-message worker")
            })
            .collect();
        *pool = Some((tx, workers));
    }

    fn run_pool_job(&self, job: Job) {
        let (from, id) = (job.call.from, job.call.id);
        let f = match self.handler(id) {
            Some(Handler::Pool(f)) => f,
            _ => return, // replaced meanwhile by an inline one: the call was queued for this
        };
        let r = catch_unwind(AssertUnwindSafe(|| f(job.call)));
        if job.reply {
            let _ = self.send_reply(from, id, job.token, r);
        }
    }

    fn handler(&self, id: u32) -> Option<Handler> {
        let h = self
            .inner
            .handlers
            .read()
            .unwrap_or_else(|e| e.into_inner());
        h.get(&id).cloned()
    }

    /// Call handler `id` on `remote` with `args` and wait for its reply. The calling thread
    /// helps: while it waits, it polls the channel if no other thread does.
    pub fn call(&self, remote: usize, id: u32, args: &[u8]) -> Result<Vec<u8>, CallError> {
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.state)
            .calls
            .insert(token, Slot::Waiting { remote });
        if let Err(e) = self.send_msg(remote, KIND_REQUEST, 0, ST_OK, id, token, args) {
            lock(&self.inner.state).calls.remove(&token);
            return Err(e.into());
        }
        let r = self.wait_reply(token, remote);
        r.and_then(|(st, body)| match st {
            ST_OK => Ok(body),
            ST_UNKNOWN => Err(CallError::UnknownHandler { rank: remote, id }),
            ST_PANIC => Err(CallError::Panicked {
                rank: remote,
                id,
                message: String::from_utf8_lossy(&body).into_owned(),
            }),
            _ => Err(CallError::Handler {
                rank: remote,
                id,
                message: String::from_utf8_lossy(&body).into_owned(),
            }),
        })
    }

    /// Send a one-way active message (no reply; an unknown handler or a failing one on the
    /// peer goes unnoticed).
    pub fn send(&self, remote: usize, id: u32, args: &[u8]) -> Result<(), CallError> {
        self.send_msg(remote, KIND_REQUEST, FLAG_ONE_WAY, ST_OK, id, 0, args)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn send_msg(
        &self,
        remote: usize,
        kind: u8,
        flags: u8,
        status: u16,
        id: u32,
        token: u64,
        body: &[u8],
    ) -> mad_core::Result<()> {
        let h = Header {
            kind,
            flags,
            status,
            id,
            token,
            len: body.len() as u64,
        }
        .encode();
        let mut p = self.inner.ch.begin_packing(remote)?;
        p.pack(&h, RecvMode::Express)?;
        if !body.is_empty() {
            p.pack(body, RecvMode::Cheaper)?;
        }
        p.end_packing()
    }

    fn send_reply(
        &self,
        to: usize,
        id: u32,
        token: u64,
        r: std::thread::Result<Reply>,
    ) -> mad_core::Result<()> {
        let (status, body) = match r {
            Ok(Ok(v)) => (ST_OK, v),
            Ok(Err(m)) => (ST_ERROR, m.into_bytes()),
            Err(p) => (ST_PANIC, panic_text(&*p).into_bytes()),
        };
        self.send_msg(to, KIND_REPLY, 0, status, id, token, &body)
    }

    /// Wait for the reply `token`, polling when nobody else does.
    fn wait_reply(&self, token: u64, remote: usize) -> Result<(u16, Vec<u8>), CallError> {
        let inner = &*self.inner;
        let deadline = inner.cfg.call_timeout.map(|t| Instant::now() + t);
        let mut st = lock(&inner.state);
        loop {
            if let Some(Slot::Done(_)) = st.calls.get(&token) {
                let Some(Slot::Done(r)) = st.calls.remove(&token) else {
                    unreachable!("checked above")
                };
                return r;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                st.calls.remove(&token);
                return Err(CallError::Timeout {
                    rank: remote,
                    after: inner.cfg.call_timeout.unwrap_or_default(),
                });
            }
            if inner.stop.load(Ordering::Acquire) {
                st.calls.remove(&token);
                return Err(CallError::Shutdown);
            }
            if !st.polling {
                st.polling = true;
                drop(st);
                let r = self.poll_once(inner.cfg.slice);
                st = lock(&inner.state);
                st.polling = false;
                inner.cv.notify_all();
                if let Err(e) = r {
                    if error_rank(&e).is_none() {
                        // The channel can serve nobody any more.
                        st.calls.remove(&token);
                        return Err(transport(&e));
                    }
                    // About one peer (its callers failed); the others' state is checked.
                    drop(st);
                    self.check_owing_peers();
                    st = lock(&inner.state);
                }
            } else {
                st = inner
                    .cv
                    .wait_timeout(st, inner.cfg.slice)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }

    /// Poll once: handle at most one message, waiting up to `timeout` for one. Returns
    /// whether one was handled. An error about one peer also fails the calls waiting for it;
    /// an error about no peer in particular (the channel closed, no peer left) means the
    /// channel can serve nobody any more.
    pub fn progress(&self, timeout: Duration) -> mad_core::Result<bool> {
        self.poll_once(timeout)
    }

    fn poll_once(&self, timeout: Duration) -> mad_core::Result<bool> {
        let inner = &*self.inner;
        match inner.ch.begin_unpacking_until(Instant::now() + timeout) {
            Ok(u) => {
                self.dispatch(u);
                Ok(true)
            }
            Err(Error::Timeout(_)) => {
                self.check_owing_peers();
                Ok(false)
            }
            Err(e) => {
                self.fail_calls(error_rank(&e), &e);
                Err(e)
            }
        }
    }

    /// After a quiet slice: every peer that owes a reply is asked whether it is still there
    /// (a clean close between messages is reported to nobody by an any-source receive).
    fn check_owing_peers(&self) {
        let owing: Vec<usize> = {
            let st = lock(&self.inner.state);
            let mut v: Vec<usize> = st
                .calls
                .values()
                .filter_map(|s| match s {
                    Slot::Waiting { remote } => Some(*remote),
                    Slot::Done(_) => None,
                })
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        for r in owing {
            match self.inner.ch.try_begin_unpacking_from(r) {
                Ok(Some(u)) => self.dispatch(u),
                Ok(None) => {}
                Err(e) => self.fail_calls(Some(r), &e),
            }
        }
    }

    /// After an error about one peer: whether every peer is gone (an any-source receive then
    /// fails at once, forever). A message found meanwhile is handled.
    fn all_peers_gone(&self) -> bool {
        let mut gone = true;
        for &r in self.inner.ch.peers() {
            match self.inner.ch.try_begin_unpacking_from(r) {
                Ok(Some(u)) => {
                    self.dispatch(u);
                    gone = false;
                }
                Ok(None) => gone = false,
                Err(e) => self.fail_calls(Some(r), &e),
            }
        }
        gone
    }

    /// Fail the calls waiting for `rank` (every call when `None`).
    fn fail_calls(&self, rank: Option<usize>, e: &Error) {
        let mut st = lock(&self.inner.state);
        let mut any = false;
        for s in st.calls.values_mut() {
            if let Slot::Waiting { remote } = s {
                if rank.map_or(true, |r| r == *remote) {
                    *s = Slot::Done(Err(transport(e)));
                    any = true;
                }
            }
        }
        if any {
            self.inner.cv.notify_all();
        }
    }

    fn dispatch(&self, mut u: Unpacker<'_, 'static>) {
        let from = u.remote();
        let h = match u.unpack_value::<[u8; HDR]>() {
            Ok(b) => b,
            Err(e) => return self.fail_calls(Some(from), &e),
        };
        let Some(h) = Header::decode(&h) else {
            // Not one of ours: the stream cannot be followed. Dropping the unpacker finishes
            // this peer's connection both ways; its callers fail.
            drop(u);
            let e = Error::Protocol {
                rank: from,
                what: "active messages: a message without a valid header".into(),
            };
            return self.fail_calls(Some(from), &e);
        };
        if h.kind == KIND_REPLY {
            return self.deliver(u, from, h);
        }
        let reply = h.flags & FLAG_ONE_WAY == 0;
        match self.handler(h.id) {
            None => {
                if let Err(e) = drain(u, h.len, from) {
                    return self.fail_calls(Some(from), &e);
                }
                if reply {
                    let _ = self.send_msg(from, KIND_REPLY, 0, ST_UNKNOWN, h.id, h.token, &[]);
                }
            }
            Some(Handler::Inline(f)) => {
                let req = Request {
                    u: Some(u),
                    from,
                    id: h.id,
                    len: h.len,
                };
                // A handler that panics drops its request, which reads the rest.
                let r = catch_unwind(AssertUnwindSafe(|| f(req)));
                if reply {
                    let _ = self.send_reply(from, h.id, h.token, r);
                }
            }
            Some(Handler::Pool(_)) => {
                let args = match self.recv_body(u, from, h.len) {
                    Ok(v) => v,
                    Err(e) => return self.fail_calls(Some(from), &e),
                };
                let job = Job {
                    call: Call {
                        from,
                        id: h.id,
                        args,
                    },
                    token: h.token,
                    reply,
                };
                let tx = lock(&self.inner.pool).as_ref().map(|(tx, _)| tx.clone());
                if let Some(tx) = tx {
                    // Blocks while the queue is full: back-pressure.
                    let _ = tx.send(job);
                }
            }
        }
    }

    /// A body of `len` bytes into a new vector, within [`Config::max_body`].
    fn recv_body(
        &self,
        u: Unpacker<'_, 'static>,
        from: usize,
        len: u64,
    ) -> mad_core::Result<Vec<u8>> {
        if len > self.inner.cfg.max_body {
            drop(u); // finishes the connection: the stream cannot be followed
            return Err(Error::Protocol {
                rank: from,
                what: format!(
                    "active message of {len} B, above this endpoint's max_body ({} B)",
                    self.inner.cfg.max_body
                ),
            });
        }
        let mut v = vec![0u8; len as usize];
        finish_into(u, &mut v, len, from)?;
        Ok(v)
    }

    /// A reply: to the thread waiting for its token.
    fn deliver(&self, u: Unpacker<'_, 'static>, from: usize, h: Header) {
        let body = self.recv_body(u, from, h.len);
        let mut st = lock(&self.inner.state);
        let ours =
            matches!(st.calls.get(&h.token), Some(Slot::Waiting { remote }) if *remote == from);
        match body {
            Ok(b) if ours => {
                st.calls.insert(h.token, Slot::Done(Ok((h.status, b))));
                self.inner.cv.notify_all();
            }
            Ok(_) => {} // a caller that gave up (timeout): dropped
            Err(e) => {
                drop(st);
                self.fail_calls(Some(from), &e);
            }
        }
    }

    /// Serve until [`shutdown`](Self::shutdown), or until every peer has left (both `Ok`):
    /// for a process whose threads never call. Fails when the channel can serve nobody any
    /// more for another reason ([`Error::Closed`], ...).
    pub fn serve(&self) -> mad_core::Result<()> {
        while !self.inner.stop.load(Ordering::Acquire) {
            let mine = {
                let mut st = lock(&self.inner.state);
                if st.polling {
                    false
                } else {
                    st.polling = true;
                    true
                }
            };
            if !mine {
                let st = lock(&self.inner.state);
                let _ = self.inner.cv.wait_timeout(st, self.inner.cfg.slice);
                continue;
            }
            let r = self.poll_once(self.inner.cfg.slice);
            lock(&self.inner.state).polling = false;
            self.inner.cv.notify_all();
            if let Err(e) = r {
                if error_rank(&e).is_none() {
                    return Err(e);
                }
                if self.all_peers_gone() {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// A thread that runs [`serve`](Self::serve) until the returned handle is dropped or
    /// [`shutdown`](Self::shutdown) is called.
    pub fn spawn_progress(&self) -> ProgressThread {
        let ep = self.clone();
        let t = std::thread::Builder::new()
            .name("mad-am-progress".into())
            .spawn(move || ep.serve())
            .expect("spawning the active-message progress thread");
        ProgressThread {
            ep: self.clone(),
            t: Some(t),
        }
    }

    /// Stop: pending and later calls fail with [`CallError::Shutdown`], [`serve`](Self::serve)
    /// returns within one poll slice, the pool's workers end once their queue is empty. The
    /// channel stays open.
    pub fn shutdown(&self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.cv.notify_all();
        let pool = lock(&self.inner.pool).take();
        if let Some((tx, workers)) = pool {
            drop(tx);
            for w in workers {
                if w.thread().id() != std::thread::current().id() {
                    let _ = w.join();
                }
            }
        }
    }
}

/// The thread of [`Endpoint::spawn_progress`]; dropping it shuts the endpoint down and joins
/// the thread.
#[derive(Debug)]
pub struct ProgressThread {
    ep: Endpoint,
    t: Option<JoinHandle<mad_core::Result<()>>>,
}

impl ProgressThread {
    /// Shut the endpoint down and return what ended the thread.
    pub fn stop(mut self) -> mad_core::Result<()> {
        self.ep.shutdown();
        match self.t.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(p)) => Err(Error::Io {
                context: "active-message progress thread".into(),
                source: std::io::Error::other(panic_text(&*p)),
            }),
            None => Ok(()),
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        if let Some(t) = self.t.take() {
            self.ep.shutdown();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_refusals() {
        let h = Header {
            kind: KIND_REPLY,
            flags: 0,
            status: ST_PANIC,
            id: 7,
            token: u64::MAX,
            len: 1 << 40,
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        let mut b = h.encode();
        b[0] = 9;
        assert_eq!(Header::decode(&b), None, "unknown kind");
        let mut b = h.encode();
        b[24] ^= 1;
        assert_eq!(Header::decode(&b), None, "bad magic");
        let mut b = h.encode();
        b[2] = 200;
        assert_eq!(Header::decode(&b), None, "unknown status");
        assert_eq!(Header::decode(&[0u8; HDR]), None);
    }
}
