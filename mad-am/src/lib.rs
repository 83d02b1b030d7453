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
//! * **Pool handlers** ([`Endpoint::register_pool`]) run in a worker pool ("handle in a new
//!   thread", SCALE): the polling thread receives the arguments into a buffer and queues the
//!   call. When `workers + queue` calls are waiting, the poller runs the next one itself and
//!   receives nothing meanwhile (back-pressure on the senders).
//! * **Replies and errors.** A reply carries the handler's bytes or its error. An unknown
//!   handler, a handler that returns `Err`, and a handler that panics give the caller
//!   [`CallError::UnknownHandler`], [`CallError::Handler`] and [`CallError::Panicked`]; the
//!   server goes on serving.
//! * **Progress** (pCoR). One thread at a time holds the *poller role*: it receives every
//!   message (replies go to the threads waiting for them, requests to their handlers) and
//!   sends the inline handlers' replies. A thread waiting in [`Endpoint::call`] takes the role
//!   when nobody holds it; the others sleep (parked, each woken alone by its own reply, or
//!   when the role is handed on). A waiting caller first spins a while (spins, then yields)
//!   when no more calls wait than the machine has cores, so a reply that comes soon needs no
//!   wake-up; with more callers it sleeps at once (spinners would only delay the threads
//!   that have work). A small request (up to 16 KiB) whose connection another thread is
//!   using goes to the poller's outbox instead of waiting for it. A server with no calling
//!   thread runs [`Endpoint::serve`] or [`Endpoint::spawn_progress`]. Idle, the poller sleeps
//!   on the channel's readiness descriptor, so idling costs no CPU; the event descriptor that
//!   wakes it for queued requests is written only while it sleeps.
//! * **Nothing waits in the network.** Every message is sent and received with the engine's
//!   non-blocking calls (`defer`, `poll_end_packing`, `poll_end_unpacking`), and a thread
//!   whose message cannot move yet polls for the process (or pauses, if another thread
//!   does). So two processes sending each other large messages from every thread never
//!   deadlock waiting for each other to receive, whatever the drivers' buffer sizes.
//! * **Departed peers.** A peer that dies or closes fails the calls waiting for it: through
//!   the error the channel reports, and, for a clean close between messages (which an
//!   any-source receive reports to nobody), through a look at the peers that owe replies
//!   after every quiet slice ([`Config::slice`]).
//!
//! Wire format: every message starts with a 40-byte header packed EXPRESS (kind, flags,
//! status, handler id, token, body length, fragment offset and length, magic); a body of that
//! many bytes follows, packed CHEAPER (SAFER when the poller sends it; nothing when empty).
//! The receiver of a body in fragments acknowledges each fragment but the last (a message of
//! kind "acknowledgement": the bytes received so far). Both sides of a channel must use this layer for every
//! message on it: anything else finishes that peer's connection.
//!
//! * **No head-of-line blocking.** A body longer than [`Config::fragment`] (128 KiB) travels
//!   in several messages that the receiver reassembles (straight into the reassembly buffer),
//!   and between two fragments the sender steps aside for threads waiting for the same
//!   connection (and sends the small requests queued meanwhile): a small call waits for one
//!   fragment, not for a 16 MiB body. A thread sending a body in fragments stays at most
//!   [`Config::window`] (2) fragments ahead of the receiver's acknowledgements, so what sits
//!   in front of a small call in the drivers' and the kernel's buffers (megabytes, for a TCP
//!   socket) is bounded too; a peer that leaves fails the waiting sender. An inline handler
//!   that keeps a buffer takes a reassembled body with [`Request::recv_into_vec`] (handed
//!   over, no copy on the polling thread; the handler's old buffer is reused for the next
//!   reassembly, so a large body costs no allocation either). A thread that polls from
//!   inside its own send keeps driving that send at every wait, so two processes whose
//!   threads all send to each other never wait on each other.
//! * **Async callers.** [`Endpoint::call_async`] returns a future resolved by the reply: the
//!   request goes to the poller (woken through an eventfd if it sleeps), which sends it
//!   without blocking; the future never polls itself, so it never blocks its executor.
//!   [`Endpoint::block_on`] runs such futures on the calling thread, which holds the poller
//!   role meanwhile: a reply wakes its future with a flag, so one thread keeps many calls in
//!   flight with no thread hand-off per reply (`rpc-bench`'s `loop` client).
//!
//! Limits (this version): one body per message (several arrays go in one body); replies sent
//! by a poller, and async requests, are copied once so they outlive the handler or the
//! caller's borrow; a process that receives requests (or awaits async calls) must keep some
//! thread polling (a blocking caller, [`Endpoint::serve`] or [`Endpoint::spawn_progress`]);
//! inline handlers cannot call ([`CallError::Reentrant`]); a pool handler that calls another
//! process while the pool is full waits for a poller that may be running a call itself;
//! fragmented bodies reach inline handlers reassembled (one copy more than a body in one
//! message with [`Request::recv_into`]; none with [`Request::recv_vec`] or
//! [`Request::recv_into_vec`]); bodies in fragments sent by the poller (inline handlers'
//! replies, async requests) do not wait for acknowledgements (the drivers' buffers bound what
//! goes ahead of a small call), nor do those a pool handler sends when the poller runs it.

use std::collections::HashMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use mad_core::{Channel, Error, Packer, RecvMode, SendMode, Unpacker};
use nix::sys::eventfd::{EfdFlags, EventFd};

/// What a handler returns: the reply's bytes, or an error text the caller receives as
/// [`CallError::Handler`].
pub type Reply = std::result::Result<Vec<u8>, String>;

type InlineFn = dyn Fn(Request<'_, '_>) -> Reply + Send + Sync;
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
    /// A call from an inline handler (which runs on the thread that polls, so the reply could
    /// never be received): register the handler with [`Endpoint::register_pool`] to call.
    #[error("an inline handler cannot make calls (it blocks the poller); use a pool handler")]
    Reentrant,
}

/// Settings of an [`Endpoint`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// Worker threads of the pool (started when the first pool handler is registered).
    pub workers: usize,
    /// Calls queued for the pool beyond those running; past it the poller runs calls itself.
    pub queue: usize,
    /// Largest body this endpoint receives into a buffer of its own (pool arguments, replies);
    /// a larger one is a protocol violation and finishes that peer's connection.
    pub max_body: u64,
    /// How long a call waits for its reply; `None`: as long as the peer lives.
    pub call_timeout: Option<Duration>,
    /// How long one poll waits for traffic before the poller looks at the peers that owe
    /// replies (a peer that closed cleanly fails its callers within about this long).
    pub slice: Duration,
    /// Bodies longer than this go in several messages of at most this many bytes, so a
    /// small call to the same peer waits for one fragment, not for the whole body (no
    /// head-of-line blocking behind large messages); 0: never split.
    pub fragment: usize,
    /// Fragments of one body a thread sends ahead of the receiver's acknowledgements (the
    /// receiver acknowledges each fragment once it is in the reassembly buffer): at most this
    /// many fragments of a large body sit in the drivers' and the kernel's buffers in front of
    /// a small call to the same peer. 0: no acknowledgements awaited (the drivers' buffers
    /// bound it).
    pub window: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers: 2,
            queue: 64,
            max_body: 1 << 30,
            call_timeout: None,
            slice: Duration::from_millis(50),
            fragment: 128 << 10,
            window: 2,
        }
    }
}

impl Config {
    /// Pool size and queue length.
    #[must_use]
    pub fn pool(mut self, workers: usize, queue: usize) -> Self {
        self.workers = workers.max(1);
        self.queue = queue;
        self
    }
    /// [`Config::call_timeout`].
    #[must_use]
    pub fn call_timeout(mut self, t: Option<Duration>) -> Self {
        self.call_timeout = t;
        self
    }
    /// [`Config::max_body`].
    #[must_use]
    pub fn max_body(mut self, n: u64) -> Self {
        self.max_body = n;
        self
    }
    /// [`Config::window`] (0: send every fragment without waiting).
    #[must_use]
    pub fn window(mut self, n: usize) -> Self {
        self.window = n;
        self
    }
    /// [`Config::fragment`] (clamped to 4 GiB − 1; 0: never split).
    #[must_use]
    pub fn fragment(mut self, n: usize) -> Self {
        self.fragment = n.min(u32::MAX as usize);
        self
    }
}

const HDR: usize = 40;
const KIND_REQUEST: u8 = 1;
const KIND_REPLY: u8 = 2;
/// The receiver of a fragmented body tells its sender how many bytes are in (`offset`) of the
/// body `(id = its kind, token)`: the sender keeps at most [`Config::window`] fragments ahead.
const KIND_ACK: u8 = 3;
const FLAG_ONE_WAY: u8 = 1;
/// The message carries `[offset, offset + piece)` of a body of `len` bytes sent in several
/// messages (see [`Config::fragment`]).
const FLAG_FRAG: u8 = 2;
/// The body was packed SAFER (messages the poller sends: their bytes are copied so they
/// outlive the handler), else CHEAPER: the receiver unpacks it in the same mode, which checked
/// channels verify.
const FLAG_SAFER: u8 = 4;
const ST_OK: u16 = 0;
const ST_UNKNOWN: u16 = 1;
const ST_ERROR: u16 = 2;
const ST_PANIC: u16 = 3;
const MAGIC: u32 = 0x4d41_4d31; // "MAM1"
/// A blocking call's arguments up to this size go to the outbox (copied) when another thread
/// sends on the connection, instead of waiting for it.
const QUEUE_BELOW: usize = 16 << 10;
/// How many pauses ([`Backoff`]: spins, then yields) a waiting caller makes before it sleeps
/// until its reply or the poller role comes (only when no more calls wait than there are
/// cores).
const SPINS: u32 = 200;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    kind: u8,
    flags: u8,
    status: u16,
    id: u32,
    token: u64,
    /// The whole body's length.
    len: u64,
    /// Where this message's bytes go in the body (fragments; 0 otherwise).
    offset: u64,
    /// How many bytes of the body this message carries (fragments; 0 otherwise).
    piece: u32,
}

impl Header {
    /// The header of a message that carries its whole body of `len` bytes.
    fn whole(kind: u8, flags: u8, status: u16, id: u32, token: u64, len: usize) -> Header {
        Header {
            kind,
            flags,
            status,
            id,
            token,
            len: len as u64,
            offset: 0,
            piece: 0,
        }
    }

    /// The header of fragment `k` (of `piece` bytes) when the body goes in `frag`-byte ones.
    fn fragment(&self, k: usize, frag: usize, piece: usize) -> Header {
        Header {
            flags: self.flags | FLAG_FRAG,
            offset: (k * frag) as u64,
            piece: piece as u32,
            ..*self
        }
    }

    /// The send mode the body was packed with.
    fn body_mode(&self) -> SendMode {
        if self.flags & FLAG_SAFER != 0 {
            SendMode::Safer
        } else {
            SendMode::Cheaper
        }
    }

    fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0] = self.kind;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.status.to_le_bytes());
        b[4..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..36].copy_from_slice(&self.piece.to_le_bytes());
        b[36..40].copy_from_slice(&MAGIC.to_le_bytes());
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
            offset: u64_at(24),
            piece: u32_at(32),
        };
        let frag = h.flags & FLAG_FRAG != 0;
        let known = matches!(h.kind, KIND_REQUEST | KIND_REPLY | KIND_ACK)
            && h.flags & !(FLAG_ONE_WAY | FLAG_FRAG | FLAG_SAFER) == 0
            && h.status <= ST_PANIC
            && if h.kind == KIND_ACK {
                !frag && h.len == 0 && h.piece == 0 && matches!(h.id, 1 | 2)
            } else if frag {
                h.piece > 0
                    && h.offset
                        .checked_add(u64::from(h.piece))
                        .is_some_and(|e| e <= h.len)
            } else {
                h.offset == 0 && h.piece == 0
            }
            && u32_at(36) == MAGIC;
        known.then_some(h)
    }
}

/// A request being handled inline: the message is still open (or, for arguments sent in
/// fragments, reassembled), and the handler receives the arguments where it wants them.
/// Dropped without receiving them, the arguments are read and discarded (the connection stays
/// usable).
pub struct Request<'p, 'c> {
    src: Src<'c>,
    /// How the arguments were packed.
    mode: SendMode,
    poller: &'p mut Poller<'c>,
    from: usize,
    id: u32,
    len: u64,
}

impl std::fmt::Debug for Request<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("from", &self.from)
            .field("id", &self.id)
            .field("len", &self.len)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// Where a request's arguments are.
enum Src<'c> {
    /// Still in the open message.
    Open(Unpacker<'c, 'static>),
    /// Reassembled from fragments.
    Whole(Vec<u8>),
    /// Received.
    Taken,
}

impl Request<'_, '_> {
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
    /// there straight from the driver, unless they came in fragments) and finish the message.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when `buf` is not exactly
    /// [`len`](Self::len) bytes (the arguments are read and dropped first); the channel's errors
    /// while receiving (the peer gone, a protocol violation).
    pub fn recv_into(mut self, buf: &mut [u8]) -> mad_core::Result<()> {
        let src = std::mem::replace(&mut self.src, Src::Taken);
        if buf.len() as u64 != self.len {
            // Read what was sent, so the connection stays in step, then report the misuse.
            if let Src::Open(u) = src {
                self.poller.drain(u, self.len, self.from, self.mode)?;
            }
            return Err(Error::Protocol {
                rank: self.from,
                what: format!(
                    "active message: a buffer of {} B for {} B of arguments",
                    buf.len(),
                    self.len
                ),
            });
        }
        match src {
            Src::Open(u) => self.poller.finish_into(u, buf, self.mode),
            Src::Whole(v) => {
                buf.copy_from_slice(&v);
                Ok(())
            }
            Src::Taken => unreachable!("a request is received once (it is consumed)"),
        }
    }

    /// Receive the arguments into `v`, resized to [`len`](Self::len) bytes: straight from the
    /// driver (CHEAPER), or, for arguments that came in fragments, by handing over the
    /// reassembled buffer (no copy; `v`'s old buffer is kept for the next reassembly). For a
    /// handler that keeps a buffer of its own for large arguments: it never copies a large
    /// body on the polling thread (which would hold up the small calls behind it).
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when the arguments do not fit in memory (they are read and dropped
    /// first); the channel's errors while receiving (the peer gone, a protocol violation).
    pub fn recv_into_vec(mut self, v: &mut Vec<u8>) -> mad_core::Result<()> {
        if let Src::Whole(w) = &mut self.src {
            let old = std::mem::replace(v, std::mem::take(w));
            self.src = Src::Taken;
            if old.capacity() > 0 {
                let mut st = lock(&self.poller.ep.inner.state);
                if old.capacity() > st.spare.capacity() {
                    st.spare = old;
                }
            }
            return Ok(());
        }
        let Ok(len) = usize::try_from(self.len) else {
            return self.recv_into(&mut []);
        };
        if v.try_reserve(len.saturating_sub(v.len())).is_err() {
            return self.recv_into(&mut []);
        }
        v.resize(len, 0);
        self.recv_into(v)
    }

    /// Receive the arguments into a new vector.
    ///
    /// # Errors
    ///
    /// The channel's errors while receiving (the peer gone, a protocol violation).
    pub fn recv_vec(mut self) -> mad_core::Result<Vec<u8>> {
        if let Src::Whole(v) = &mut self.src {
            let v = std::mem::take(v);
            self.src = Src::Taken;
            return Ok(v);
        }
        let len = usize::try_from(self.len).map_err(|_| Error::Protocol {
            rank: self.from,
            what: format!("active message: {} B of arguments", self.len),
        })?;
        let mut v = vec![0u8; len];
        self.recv_into(&mut v)?;
        Ok(v)
    }
}

impl Drop for Request<'_, '_> {
    fn drop(&mut self) {
        if let Src::Open(u) = std::mem::replace(&mut self.src, Src::Taken) {
            let _ = self.poller.drain(u, self.len, self.from, self.mode);
        }
    }
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
    /// `waker`: an async call ([`Endpoint::call_async`]) to wake with the reply.
    Waiting {
        remote: usize,
        waker: Option<Waker>,
        /// The waker unparks a thread blocked in [`Endpoint::call`] (which can take the
        /// poller role), not an async task.
        blocking: bool,
    },
    /// The reply's status and body, or why there is none.
    Done(Result<(u16, Vec<u8>), CallError>),
}

/// A message to send that waits for its connection (another local thread sends to that peer).
struct Out {
    to: usize,
    hdr: [u8; HDR],
    body: Vec<u8>,
    /// Set once the message has started (or was dropped, its peer gone): a blocking caller
    /// whose request was queued waits for it before it sleeps.
    started: Option<Arc<AtomicBool>>,
}

/// The hasher of the call table and the handler table: only this process inserts into them
/// (its own tokens, its registered ids; what peers send is only looked up), so no peer can aim
/// at one bucket, and one multiply spreads the keys (SipHash, the default, costs more than the
/// rest of a lookup).
#[derive(Default)]
struct TokenHasher(u64);

impl std::hash::Hasher for TokenHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
}

type Tokens = std::hash::BuildHasherDefault<TokenHasher>;

struct State {
    /// A thread holds the poller role.
    polling: bool,
    calls: HashMap<u64, Slot, Tokens>,
    /// Replies a poller could not start before it gave the role up, and async requests.
    outbox: Vec<Out>,
    /// Bodies arriving in fragments: (sender, kind, token) → what came so far.
    partial: HashMap<(usize, u8, u64), Partial>,
    /// A buffer an inline handler gave back for a reassembled body
    /// ([`Request::recv_into_vec`]): the next reassembly uses it (no allocation, no page
    /// faults).
    spare: Vec<u8>,
    /// Fragmented bodies this process is sending with a window: (peer, kind, token) → bytes
    /// the peer acknowledged, or why it never will.
    credit: HashMap<(usize, u8, u64), Credit>,
}

/// What the receiver of a body sent in fragments acknowledged.
struct Credit {
    acked: Result<u64, Error>,
    /// The sending thread, asleep while another thread polls (it wakes it on an
    /// acknowledgement).
    waiter: Option<std::thread::Thread>,
}

/// A body being reassembled from fragments.
struct Partial {
    /// The header of its first fragment.
    hdr: Header,
    /// May hold bytes of an earlier body (a recycled buffer) beyond `next`.
    buf: Vec<u8>,
    got: u64,
    /// While the fragments come in order: where the next one starts (every byte before it
    /// was written by this body). `None` once one came out of order (the buffer was zeroed
    /// past the bytes written, so no byte of an earlier body can show through a gap).
    next: Option<u64>,
}

struct Job {
    call: Call,
    token: u64,
    reply: bool,
}

/// The worker pool: its queue and its threads.
struct Pool {
    tx: Sender<Job>,
    workers: Vec<JoinHandle<()>>,
}

struct Inner {
    ch: Channel,
    cfg: Config,
    handlers: RwLock<HashMap<u32, Handler, Tokens>>,
    state: Mutex<State>,
    cv: Condvar,
    next_token: AtomicU64,
    pool: Mutex<Option<Pool>>,
    /// Jobs handed to the pool and not finished.
    queued: AtomicUsize,
    /// Per peer, the threads (and the poller) waiting for the connection another thread sends
    /// on: a sender of fragments steps aside for them between two fragments.
    contenders: Vec<AtomicUsize>,
    /// Async calls put requests in the outbox: the poller takes them at its next step.
    outbox_new: AtomicBool,
    /// Written when a request is queued in the outbox while a poller sleeps, so it wakes up
    /// (`None` if the kernel refused an eventfd: it wakes within 1 ms).
    wake: Option<EventFd>,
    /// Pollers asleep on the channel's descriptor and [`Inner::wake`]: the eventfd is written
    /// only when one is (no system call while the poller runs).
    sleepers: AtomicUsize,
    /// Bumped after every call completed (a reply delivered, calls failed, shutdown): a
    /// poller waiting for its own reply looks at the call table only when it moved.
    completed: AtomicU64,
    /// Threads of [`Endpoint::serve`] waiting on [`Inner::cv`] (notified only when some do).
    cv_waiters: AtomicUsize,
    /// The machine's cores (see [`SPINS`]).
    cores: usize,
    stop: AtomicBool,
}

impl Inner {
    /// A request was put in the outbox: the next poller step takes it; a sleeping poller is
    /// woken.
    fn outbox_posted(&self) {
        self.outbox_new.store(true, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            if let Some(ev) = &self.wake {
                let _ = ev.write(1);
            }
        }
    }

    fn notify_servers(&self) {
        if self.cv_waiters.load(Ordering::SeqCst) > 0 {
            self.cv.notify_all();
        }
    }
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
    CallError::Transport(copy_error(e))
}

/// A copy of a transport error.
fn copy_error(e: &Error) -> Error {
    match e {
        Error::PeerClosed { rank } => Error::PeerClosed { rank: *rank },
        Error::Closed { channel } => Error::Closed {
            channel: channel.clone(),
        },
        Error::Timeout(t) => Error::Timeout(*t),
        other => match error_rank(other) {
            Some(rank) => Error::Poisoned {
                rank,
                cause: other.to_string().into(),
            },
            None => Error::Io {
                context: "active messages".into(),
                source: std::io::Error::other(other.to_string()),
            },
        },
    }
}

/// Registers a body sent in fragments for acknowledgements while it lives.
struct CreditGuard<'a> {
    inner: &'a Inner,
    key: (usize, u8, u64),
}

impl<'a> CreditGuard<'a> {
    fn new(inner: &'a Inner, key: (usize, u8, u64)) -> Self {
        lock(&inner.state).credit.insert(
            key,
            Credit {
                acked: Ok(0),
                waiter: None,
            },
        );
        CreditGuard { inner, key }
    }
}

impl Drop for CreditGuard<'_> {
    fn drop(&mut self) {
        lock(&self.inner.state).credit.remove(&self.key);
    }
}

/// Counts a waiting thread in [`Inner::contenders`] while it lives.
struct Contender<'a>(&'a AtomicUsize);

impl<'a> Contender<'a> {
    fn new(c: &'a AtomicUsize) -> Self {
        c.fetch_add(1, Ordering::AcqRel);
        Contender(c)
    }
}

impl Drop for Contender<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a thread waits for the network without blocking in it: spin, then yield, then sleep on
/// the channel's readiness descriptor for at most a millisecond at a time.
struct Backoff(u32);

impl Backoff {
    fn pause(&mut self, inner: &Inner) {
        self.0 = self.0.saturating_add(1);
        if self.0 < 64 {
            std::hint::spin_loop();
        } else if self.0 < 256 {
            std::thread::yield_now();
        } else {
            idle(inner, Duration::from_millis(1));
        }
    }
}

/// Sleep until the channel may have progressed (its descriptor is readable), a request was
/// queued in the outbox (the endpoint's event descriptor, for the poller only), or `t` passed.
fn idle(inner: &Inner, t: Duration) {
    let ch = &inner.ch;
    let poller = ROLE.with(|r| r.get()) == inner as *const Inner as usize;
    match ch.arm() {
        Ok(mad_core::Armed::Armed) => {
            match (ch.readiness_fd(), &inner.wake) {
                (Some(fd), Some(ev)) if poller => {
                    inner.sleepers.fetch_add(1, Ordering::SeqCst);
                    // Posted before we counted ourselves: no wake-up is coming for it.
                    if !inner.outbox_new.load(Ordering::SeqCst) {
                        let _ = mad_core::events::wait_readable(&[fd, ev.as_fd()], Some(t));
                    }
                    inner.sleepers.fetch_sub(1, Ordering::SeqCst);
                    let _ = ev.read(); // non-blocking: resets it if it was written
                }
                (Some(fd), _) => {
                    let _ = mad_core::events::wait_readable(&[fd], Some(t));
                }
                (None, _) => std::thread::sleep(t.min(Duration::from_micros(200))),
            }
            // The driver may stop watching what only a sleeper needs.
            ch.disarm();
        }
        Ok(_) => std::thread::yield_now(),
        Err(_) => std::thread::sleep(t.min(Duration::from_micros(200))),
    }
}

/// The state of the thread that holds the poller role: the replies it is sending (each a
/// message in progress, driven without blocking) and those waiting for their connection.
/// Every wait of the poller keeps these moving, so it never blocks a peer that waits for it.
pub struct Poller<'c> {
    ep: &'c Endpoint,
    sending: Vec<Packer<'c, 'static>>,
    waiting: Vec<Out>,
    /// The peers this poller is counted for in [`Inner::contenders`]: a message of `waiting`
    /// to them found the connection taken; `counted` of them are.
    contending: Vec<bool>,
    counted: usize,
    scratch: Vec<bool>,
    /// The message in progress of the thread that polls from inside its own send: driven at
    /// every wait of the poller (see [`Endpoint::help_with`]).
    own: Option<&'c mut (dyn FnMut() -> bool + 'c)>,
    /// The call (token, peer) of the blocking caller that holds the role: its reply is kept
    /// in `got` instead of going through the call table (no lock, no wake-up), and ends
    /// [`Endpoint::poll_until`].
    mine: Option<(u64, usize)>,
    got: Option<(u16, Vec<u8>)>,
}

/// The endpoint and how many messages it is moving; never their bytes.
impl std::fmt::Debug for Poller<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Poller")
            .field("endpoint", self.ep)
            .field("sending", &self.sending.len())
            .field("waiting", &self.waiting.len())
            .field("contending", &self.counted)
            .finish_non_exhaustive()
    }
}

impl<'c> Poller<'c> {
    fn ch(&self) -> &'c Channel {
        &self.ep.inner.ch
    }

    /// One round over the sends: finished ones are dropped, waiting ones started.
    fn drive_sends(&mut self) -> bool {
        if self.own.is_none()
            && self.sending.is_empty()
            && self.waiting.is_empty()
            && self.counted == 0
        {
            // The common idle poll: nothing to move.
            return false;
        }
        let own = self.own.as_mut().is_some_and(|f| f());
        let before = self.sending.len() + self.waiting.len();
        self.sending
            .retain_mut(|p| p.poll_end_packing().is_pending());
        let mut i = 0;
        while i < self.waiting.len() {
            let to = self.waiting[i].to;
            match self.ch().try_begin_packing(to) {
                Ok(Some(mut p)) => {
                    let o = self.waiting.swap_remove(i);
                    p.defer();
                    let r = p.pack_safer(&o.hdr, RecvMode::Express).and_then(|()| {
                        if o.body.is_empty() {
                            Ok(())
                        } else {
                            p.pack_safer(&o.body, RecvMode::Cheaper)
                        }
                    });
                    if r.is_ok() && p.poll_end_packing().is_pending() {
                        self.sending.push(p);
                    }
                    if let Some(f) = &o.started {
                        f.store(true, Ordering::Release);
                    }
                }
                // Another thread sends to that peer, or this one does (a thread that polls
                // while its own message to the peer cannot leave): later.
                Ok(None) | Err(Error::InUse { .. }) => i += 1,
                // The peer is gone: a reply has nobody to go to, a request's caller fails.
                Err(e) => {
                    let o = self.waiting.swap_remove(i);
                    if let Some(f) = &o.started {
                        f.store(true, Ordering::Release);
                    }
                    match Header::decode(&o.hdr) {
                        Some(h) if h.kind == KIND_REQUEST && h.flags & FLAG_ONE_WAY == 0 => {
                            self.ep.fail_call(h.token, &e);
                        }
                        _ => {
                            tracing::info!(rank = to, error = %e, "active messages: a reply dropped, its caller is gone");
                        }
                    }
                }
            }
        }
        if !self.waiting.is_empty() || self.counted > 0 {
            self.count_contention();
        }
        own || self.sending.len() + self.waiting.len() != before
    }

    /// Count this poller in [`Inner::contenders`] for exactly the peers its waiting messages
    /// go to.
    fn count_contention(&mut self) {
        if self.contending.is_empty() {
            self.contending.resize(self.ep.inner.ch.size(), false);
        }
        let mut now = std::mem::take(&mut self.scratch);
        now.clear();
        now.resize(self.contending.len(), false);
        for o in &self.waiting {
            now[o.to] = true;
        }
        for (r, (n, was)) in now.iter().zip(self.contending.iter_mut()).enumerate() {
            if *n != *was {
                let c = &self.ep.inner.contenders[r];
                if *n {
                    c.fetch_add(1, Ordering::AcqRel);
                    self.counted += 1;
                } else {
                    c.fetch_sub(1, Ordering::AcqRel);
                    self.counted -= 1;
                }
                *was = *n;
            }
        }
        self.scratch = now;
    }

    /// Queue a message (a reply) and try to start it.
    fn send(&mut self, to: usize, hdr: Header, body: Vec<u8>) {
        let frag = self.ep.inner.cfg.fragment;
        split_into(&mut self.waiting, to, hdr, body, frag);
        self.drive_sends();
    }

    fn reply(&mut self, to: usize, id: u32, token: u64, (status, body): (u16, Vec<u8>)) {
        let hdr = Header::whole(KIND_REPLY, 0, status, id, token, body.len());
        self.send(to, hdr, body);
    }

    /// Finish `u` (deferred) after its CHEAPER unpacks, keeping the sends moving.
    fn end(&mut self, mut u: Unpacker<'c, '_>) -> mad_core::Result<()> {
        let mut b = Backoff(0);
        loop {
            if let Poll::Ready(r) = u.poll_end_unpacking() {
                return r;
            }
            if !self.drive_sends() {
                b.pause(&self.ep.inner);
            }
        }
    }

    /// Receive the body into `buf` (its length checked by the caller) and finish.
    fn finish_into(
        &mut self,
        u: Unpacker<'c, 'static>,
        buf: &mut [u8],
        mode: SendMode,
    ) -> mad_core::Result<()> {
        // The unpacker's destinations may borrow for as little as `buf` lives (it is covariant).
        let mut u: Unpacker<'c, '_> = u;
        if !buf.is_empty() {
            u.unpack(buf, mode)?;
        }
        self.end(u)
    }

    /// Receive and discard a body of `len` bytes.
    fn drain(
        &mut self,
        u: Unpacker<'c, 'static>,
        len: u64,
        from: usize,
        mode: SendMode,
    ) -> mad_core::Result<()> {
        let n = usize::try_from(len)
            .ok()
            .filter(|&n| n as u64 <= self.ep.inner.cfg.max_body)
            .ok_or_else(|| Error::Protocol {
                rank: from,
                what: format!("active message of {len} B, above this endpoint's max_body"),
            })?;
        let mut scratch = vec![0u8; n];
        self.finish_into(u, &mut scratch, mode)
    }

    /// A body of `len` bytes into a new vector, within [`Config::max_body`]; a larger one
    /// finishes the connection (dropping the unpacker).
    fn recv_body(
        &mut self,
        u: Unpacker<'c, 'static>,
        from: usize,
        len: u64,
        mode: SendMode,
    ) -> mad_core::Result<Vec<u8>> {
        if len > self.ep.inner.cfg.max_body {
            return Err(Error::Protocol {
                rank: from,
                what: format!(
                    "active message of {len} B, above this endpoint's max_body ({} B)",
                    self.ep.inner.cfg.max_body
                ),
            });
        }
        let mut v = vec![0u8; len as usize];
        self.finish_into(u, &mut v, mode)?;
        Ok(v)
    }

    /// One round: the sends, then at most one message received and handled. Whether
    /// anything moved. An error about one peer fails the calls waiting for it; an error after
    /// which the channel can serve nobody (closed, every peer gone) is returned.
    fn step(&mut self) -> mad_core::Result<bool> {
        // A load first: the swap (a locked instruction) only when something was posted.
        if self.ep.inner.outbox_new.load(Ordering::Acquire)
            && self.ep.inner.outbox_new.swap(false, Ordering::AcqRel)
        {
            let mut st = lock(&self.ep.inner.state);
            self.waiting.append(&mut st.outbox);
        }
        let moved = self.drive_sends();
        match self.ch().try_begin_unpacking() {
            Ok(Some(u)) => {
                self.handle(u);
                Ok(true)
            }
            Ok(None) => Ok(moved),
            Err(e) => {
                let rank = error_rank(&e);
                self.ep.fail_calls(rank, &e);
                if rank.is_none() || self.all_peers_gone() {
                    Err(e)
                } else {
                    Ok(true)
                }
            }
        }
    }

    fn handle(&mut self, mut u: Unpacker<'c, 'static>) {
        let from = u.remote();
        u.defer();
        // On this frame until the header is in (a pending unpack keeps to one buffer).
        let mut hdr = [0u8; HDR];
        let mut b = Backoff(0);
        let got = loop {
            match u.poll_unpack_express(&mut hdr[..], SendMode::Safer) {
                Poll::Ready(r) => break r,
                Poll::Pending => {
                    if !self.drive_sends() {
                        b.pause(&self.ep.inner);
                    }
                }
            }
        };
        if let Err(e) = got {
            return self.ep.fail_calls(Some(from), &e);
        }
        let Some(h) = Header::decode(&hdr) else {
            // Not one of ours: the stream cannot be followed. Dropping the unpacker finishes
            // this peer's connection both ways; its callers fail.
            drop(u);
            tracing::warn!(
                rank = from,
                "active messages: a message without a valid header; the connection is finished"
            );
            let e = Error::Protocol {
                rank: from,
                what: "active messages: a message without a valid header".into(),
            };
            return self.ep.fail_calls(Some(from), &e);
        };
        if h.kind == KIND_ACK {
            if let Err(e) = self.finish_into(u, &mut [], h.body_mode()) {
                return self.ep.fail_calls(Some(from), &e);
            }
            return self.ep.acknowledged(from, h);
        }
        if h.flags & FLAG_FRAG != 0 {
            return self.fragment(u, from, h);
        }
        self.dispatch(Src::Open(u), from, h);
    }

    /// One fragment of a body sent in several messages: into its reassembly buffer, and the
    /// message is handled once the last byte is in.
    fn fragment(&mut self, u: Unpacker<'c, 'static>, from: usize, h: Header) {
        let inner = &self.ep.inner;
        let key = (from, h.kind, h.token);
        let bad = |what: String| Error::Protocol { rank: from, what };
        if h.len > inner.cfg.max_body {
            drop(u);
            let e = bad(format!(
                "active message of {} B, above this endpoint's max_body ({} B)",
                h.len, inner.cfg.max_body
            ));
            return self.ep.fail_calls(Some(from), &e);
        }
        let mut part = {
            let mut st = lock(&inner.state);
            match st.partial.remove(&key) {
                Some(p) => p,
                None => {
                    // A recycled buffer, or one reserved, not written: a fragment zeroes at most
                    // its own range before it lands (no long stall on a large body's first
                    // fragment).
                    let mut buf = std::mem::take(&mut st.spare);
                    buf.truncate(h.len as usize);
                    buf.reserve_exact(h.len as usize - buf.len());
                    Partial {
                        hdr: h,
                        buf,
                        got: 0,
                        next: Some(0),
                    }
                }
            }
        };
        let (a, n) = (h.offset as usize, h.piece as usize);
        if part.hdr.len != h.len || part.got + n as u64 > h.len {
            drop(u);
            let e = bad("active messages: fragments that do not add up".into());
            return self.ep.fail_calls(Some(from), &e);
        }
        if part.next != Some(a as u64) {
            if let Some(next) = part.next.take() {
                // Out of order: no byte of an earlier body may stay where none lands.
                let next = next as usize;
                let end = part.buf.len();
                if end > next {
                    part.buf[next..end].fill(0);
                }
                part.buf.resize(h.len as usize, 0);
            }
        } else {
            part.next = Some((a + n) as u64);
        }
        if part.buf.len() < a + n {
            part.buf.resize(a + n, 0);
        }
        if let Err(e) = self.finish_into(u, &mut part.buf[a..a + n], h.body_mode()) {
            return self.ep.fail_calls(Some(from), &e);
        }
        part.got += n as u64;
        if part.got < h.len {
            let got = part.got;
            lock(&inner.state).partial.insert(key, part);
            // The sender may wait for it before it sends more (see `Config::window`).
            let ack = Header {
                kind: KIND_ACK,
                flags: 0,
                status: ST_OK,
                id: u32::from(h.kind),
                token: h.token,
                len: 0,
                offset: got,
                piece: 0,
            };
            self.send(from, ack, Vec::new());
            return;
        }
        let mut hdr = part.hdr;
        hdr.flags &= !FLAG_FRAG;
        // Every byte came (`got`), the body's last fragment among them: the buffer is `len`
        // bytes long.
        debug_assert_eq!(part.buf.len() as u64, h.len);
        self.dispatch(Src::Whole(part.buf), from, hdr);
    }

    /// A message whose header was read: a reply to its caller, a request to its handler.
    fn dispatch(&mut self, src: Src<'c>, from: usize, h: Header) {
        if h.kind == KIND_REPLY {
            let body = match src {
                Src::Open(u) => self.recv_body(u, from, h.len, h.body_mode()),
                Src::Whole(v) => Ok(v),
                Src::Taken => unreachable!("a message is dispatched with its body"),
            };
            return match body {
                // The reply this thread waits for, itself.
                Ok(b) if self.mine == Some((h.token, from)) => self.got = Some((h.status, b)),
                body => self.ep.deliver(from, h, body),
            };
        }
        let reply = h.flags & FLAG_ONE_WAY == 0;
        match self.ep.handler(h.id) {
            None => {
                if let Src::Open(u) = src {
                    if let Err(e) = self.drain(u, h.len, from, h.body_mode()) {
                        return self.ep.fail_calls(Some(from), &e);
                    }
                }
                if reply {
                    self.reply(from, h.id, h.token, (ST_UNKNOWN, Vec::new()));
                }
            }
            Some(Handler::Inline(f)) => {
                let req = Request {
                    src,
                    mode: h.body_mode(),
                    poller: self,
                    from,
                    id: h.id,
                    len: h.len,
                };
                // A handler that panics drops its request, which reads the rest.
                let r = catch_unwind(AssertUnwindSafe(|| f(req)));
                if reply {
                    self.reply(from, h.id, h.token, reply_parts(r));
                }
            }
            Some(Handler::Pool(_)) => {
                let args = match src {
                    Src::Open(u) => match self.recv_body(u, from, h.len, h.body_mode()) {
                        Ok(v) => v,
                        Err(e) => return self.ep.fail_calls(Some(from), &e),
                    },
                    Src::Whole(v) => v,
                    Src::Taken => unreachable!("a message is dispatched with its body"),
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
                let inner = &self.ep.inner;
                let full =
                    inner.queued.load(Ordering::Acquire) >= inner.cfg.queue + inner.cfg.workers;
                let tx = lock(&inner.pool).as_ref().map(|p| p.tx.clone());
                match tx {
                    Some(tx) if !full => {
                        inner.queued.fetch_add(1, Ordering::AcqRel);
                        if let Err(back) = tx.send(job) {
                            inner.queued.fetch_sub(1, Ordering::AcqRel);
                            self.run_here(back.0);
                        }
                    }
                    // The pool is full: the poller runs the call itself, and receives nothing
                    // meanwhile (back-pressure), but never waits for the network.
                    _ => self.run_here(job),
                }
            }
        }
    }

    fn run_here(&mut self, job: Job) {
        let (from, id, token, reply) = (job.call.from, job.call.id, job.token, job.reply);
        let r = self.ep.run_pool(job.call);
        if reply {
            self.reply(from, id, token, reply_parts(r));
        }
    }

    /// Whether `r` is still there (a message found meanwhile is handled).
    fn check_peer(&mut self, r: usize) {
        match self.ch().try_begin_unpacking_from(r) {
            Ok(Some(u)) => self.handle(u),
            Ok(None) => {}
            Err(e) => self.ep.fail_calls(Some(r), &e),
        }
    }

    /// After a quiet slice: every peer that owes a reply is asked whether it is still there
    /// (a clean close between messages is reported to nobody by an any-source receive).
    fn check_owing_peers(&mut self) {
        let owing: Vec<usize> = {
            let st = lock(&self.ep.inner.state);
            let mut v: Vec<usize> = st
                .calls
                .values()
                .filter_map(|s| match s {
                    Slot::Waiting { remote, .. } => Some(*remote),
                    Slot::Done(_) => None,
                })
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        for r in owing {
            match self.ch().try_begin_unpacking_from(r) {
                Ok(Some(u)) => self.handle(u),
                Ok(None) => {}
                Err(e) => self.ep.fail_calls(Some(r), &e),
            }
        }
    }

    /// After an error about one peer: whether every peer is gone (an any-source receive then
    /// fails at once, forever). A message found meanwhile is handled.
    fn all_peers_gone(&mut self) -> bool {
        let mut gone = true;
        for &r in self.ch().peers() {
            match self.ch().try_begin_unpacking_from(r) {
                Ok(Some(u)) => {
                    self.handle(u);
                    gone = false;
                }
                Ok(None) => gone = false,
                Err(e) => self.ep.fail_calls(Some(r), &e),
            }
        }
        gone
    }

    /// Give the role up: the messages in progress are finished first (receiving meanwhile, so
    /// a peer that waits for this process is served), those not started go to the endpoint's
    /// outbox for the next poller (in `Drop`, which also runs if a handler's panic unwinds
    /// through the poller).
    fn release(mut self) {
        let mut b = Backoff(0);
        while !self.sending.is_empty() {
            let moved = self.drive_sends();
            let got = matches!(self.step(), Ok(true));
            if !moved && !got {
                b.pause(&self.ep.inner);
            }
        }
    }
}

impl Drop for Poller<'_> {
    fn drop(&mut self) {
        ROLE.with(|r| r.set(0));
        for (r, c) in self.contending.iter().enumerate() {
            if *c {
                self.ep.inner.contenders[r].fetch_sub(1, Ordering::AcqRel);
            }
        }
        let mut st = lock(&self.ep.inner.state);
        st.outbox.append(&mut self.waiting);
        st.polling = false;
        // Hand the role on: wake one blocked caller (it takes it), and `serve` threads.
        let next = st.calls.values().find_map(|s| match s {
            Slot::Waiting {
                waker: Some(w),
                blocking: true,
                ..
            } => Some(w.clone()),
            _ => None,
        });
        drop(st);
        if let Some(w) = next {
            w.wake();
        }
        self.ep.inner.notify_servers();
    }
}

/// Wakes a thread blocked in [`Endpoint::call`].
struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Wakes the future of [`Endpoint::block_on`]: a flag that its loop reads, and, for a wake
/// from another thread, an unpark and the endpoint's event descriptor (the loop may sleep
/// as the poller).
struct LoopWaker {
    woken: AtomicBool,
    thread: std::thread::Thread,
    inner: std::sync::Weak<Inner>,
}

impl std::task::Wake for LoopWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if self.woken.swap(true, Ordering::AcqRel) {
            return;
        }
        if std::thread::current().id() == self.thread.id() {
            return;
        }
        self.thread.unpark();
        if let Some(inner) = self.inner.upgrade() {
            if inner.sleepers.load(Ordering::SeqCst) > 0 {
                if let Some(ev) = &inner.wake {
                    let _ = ev.write(1);
                }
            }
        }
    }
}

thread_local! {
    /// The endpoint (its address) whose poller role this thread holds, or 0.
    static ROLE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Append to `out` the messages that carry `body` under `hdr`: one, or fragments of at most
/// `frag` bytes.
fn split_into(out: &mut Vec<Out>, to: usize, mut hdr: Header, body: Vec<u8>, frag: usize) {
    // The poller packs these SAFER (see `Poller::drive_sends`).
    hdr.flags |= FLAG_SAFER;
    if frag == 0 || body.len() <= frag {
        out.push(Out {
            to,
            hdr: hdr.encode(),
            body,
            started: None,
        });
        return;
    }
    out.extend(body.chunks(frag).enumerate().map(|(k, c)| Out {
        to,
        hdr: hdr.fragment(k, frag, c.len()).encode(),
        body: c.to_vec(),
        started: None,
    }));
}

/// What a caller gets from a reply's status and body.
fn outcome(st: u16, body: Vec<u8>, remote: usize, id: u32) -> Result<Vec<u8>, CallError> {
    let text = || String::from_utf8_lossy(&body).into_owned();
    match st {
        ST_OK => Ok(body),
        ST_UNKNOWN => Err(CallError::UnknownHandler { rank: remote, id }),
        ST_PANIC => Err(CallError::Panicked {
            rank: remote,
            id,
            message: text(),
        }),
        _ => Err(CallError::Handler {
            rank: remote,
            id,
            message: text(),
        }),
    }
}

/// The future of [`Endpoint::call_async`].
#[must_use = "a call's reply is only received when its future is awaited"]
pub struct CallFuture {
    ep: Endpoint,
    token: u64,
    remote: usize,
    id: u32,
    early: Option<CallError>,
}

impl std::fmt::Debug for CallFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallFuture")
            .field("remote", &self.remote)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Future for CallFuture {
    type Output = Result<Vec<u8>, CallError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(e) = this.early.take() {
            return Poll::Ready(Err(e));
        }
        let inner = &this.ep.inner;
        let mut st = lock(&inner.state);
        match st.calls.get_mut(&this.token) {
            Some(Slot::Waiting { waker, .. }) => {
                if inner.stop.load(Ordering::Acquire) {
                    st.calls.remove(&this.token);
                    return Poll::Ready(Err(CallError::Shutdown));
                }
                match waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
            Some(Slot::Done(_)) => {
                let Some(Slot::Done(r)) = st.calls.remove(&this.token) else {
                    unreachable!("checked above")
                };
                drop(st);
                Poll::Ready(r.and_then(|(s, body)| outcome(s, body, this.remote, this.id)))
            }
            // Taken already (polled after it was ready).
            None => Poll::Ready(Err(CallError::Shutdown)),
        }
    }
}

impl Drop for CallFuture {
    fn drop(&mut self) {
        lock(&self.ep.inner.state).calls.remove(&self.token);
    }
}

fn reply_parts(r: std::thread::Result<Reply>) -> (u16, Vec<u8>) {
    match r {
        Ok(Ok(v)) => (ST_OK, v),
        Ok(Err(m)) => (ST_ERROR, m.into_bytes()),
        Err(p) => {
            let text = panic_text(&*p);
            tracing::warn!(panic = %text, "active messages: a handler panicked; its caller gets the error");
            (ST_PANIC, text.into_bytes())
        }
    }
}

impl Endpoint {
    /// An endpoint over `ch` with the default [`Config`].
    pub fn new(ch: Channel) -> Endpoint {
        Endpoint::with_config(ch, Config::default())
    }

    /// An endpoint over `ch`.
    pub fn with_config(ch: Channel, cfg: Config) -> Endpoint {
        let n = ch.size();
        Endpoint {
            inner: Arc::new(Inner {
                ch,
                cfg,
                handlers: RwLock::new(HashMap::default()),
                state: Mutex::new(State {
                    polling: false,
                    calls: HashMap::default(),
                    outbox: Vec::new(),
                    partial: HashMap::new(),
                    spare: Vec::new(),
                    credit: HashMap::new(),
                }),
                cv: Condvar::new(),
                next_token: AtomicU64::new(1),
                pool: Mutex::new(None),
                queued: AtomicUsize::new(0),
                contenders: (0..n).map(|_| AtomicUsize::new(0)).collect(),
                outbox_new: AtomicBool::new(false),
                wake: EventFd::from_value_and_flags(
                    0,
                    EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
                )
                .ok(),
                sleepers: AtomicUsize::new(0),
                completed: AtomicU64::new(0),
                cv_waiters: AtomicUsize::new(0),
                cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
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
        f: impl Fn(Request<'_, '_>) -> Reply + Send + Sync + 'static,
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
        let (tx, rx) = channel::<Job>();
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
                        let ep = Endpoint { inner };
                        ep.run_pool_job(job);
                        ep.inner.queued.fetch_sub(1, Ordering::AcqRel);
                    })
                    .expect("spawning an active-message worker")
            })
            .collect();
        *pool = Some(Pool { tx, workers });
    }

    /// Run a pool handler's call (on a worker, or on the poller when the pool is full).
    fn run_pool(&self, call: Call) -> std::thread::Result<Reply> {
        let id = call.id;
        match self.handler(id) {
            Some(Handler::Pool(f)) => catch_unwind(AssertUnwindSafe(|| f(call))),
            _ => Ok(Err(format!("handler {id} was replaced"))),
        }
    }

    fn run_pool_job(&self, job: Job) {
        let (from, id) = (job.call.from, job.call.id);
        let r = self.run_pool(job.call);
        if job.reply {
            let (status, body) = reply_parts(r);
            let _ = self.send_helping(from, KIND_REPLY, 0, status, id, job.token, &body);
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
    /// helps: while it waits (for its request to leave, then for the reply) it polls the
    /// channel if no other thread does.
    ///
    /// # Errors
    ///
    /// [`CallError::Transport`] when the channel fails (the peer gone, a bad rank, the channel
    /// closed); [`CallError::UnknownHandler`], [`CallError::Handler`] or [`CallError::Panicked`]
    /// for what happened on the peer; [`CallError::Timeout`] after [`Config::call_timeout`];
    /// [`CallError::Shutdown`] when the endpoint is shut down first; [`CallError::Reentrant`] from
    /// an inline handler.
    pub fn call(&self, remote: usize, id: u32, args: &[u8]) -> Result<Vec<u8>, CallError> {
        if self.inner.stop.load(Ordering::Acquire) {
            return Err(CallError::Shutdown);
        }
        if ROLE.with(|r| r.get()) == self.key() {
            // An inline handler (this thread polls for the endpoint, up the stack): its reply
            // could only come through the poller it is blocking.
            return Err(CallError::Reentrant);
        }
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.state).calls.insert(
            token,
            Slot::Waiting {
                remote,
                waker: None,
                blocking: false,
            },
        );
        let frag = self.inner.cfg.fragment;
        let sent = if args.len() <= QUEUE_BELOW && (frag == 0 || args.len() <= frag) {
            self.send_or_queue(remote, id, token, args)
        } else {
            self.send_helping(remote, KIND_REQUEST, 0, ST_OK, id, token, args)
                .map(|()| None)
        };
        let queued = match sent {
            Ok(q) => q,
            Err(e) => {
                lock(&self.inner.state).calls.remove(&token);
                return Err(e.into());
            }
        };
        let (st, body) = self.wait_reply(token, remote, queued)?;
        outcome(st, body, remote, id)
    }

    /// [`call`](Self::call) as a future, for async code: the request (its arguments copied)
    /// goes to the thread that polls for the endpoint, which sends it without blocking and
    /// wakes the future with the reply. Some thread must poll: a progress thread
    /// ([`spawn_progress`](Self::spawn_progress)) or blocking callers; a future never polls
    /// itself, so it never blocks its executor. Dropped before the reply, the call is
    /// forgotten (a late reply is dropped); the request may still reach the peer.
    pub fn call_async(&self, remote: usize, id: u32, args: &[u8]) -> CallFuture {
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        let hdr = Header::whole(KIND_REQUEST, 0, ST_OK, id, token, args.len());
        let early = if self.inner.stop.load(Ordering::Acquire) {
            Some(CallError::Shutdown)
        } else if remote >= self.inner.ch.size() || remote == self.inner.ch.rank() {
            Some(CallError::Transport(Error::BadRank {
                rank: remote,
                size: self.inner.ch.size(),
                me: self.inner.ch.rank(),
            }))
        } else {
            let mut st = lock(&self.inner.state);
            st.calls.insert(
                token,
                Slot::Waiting {
                    remote,
                    waker: None,
                    blocking: false,
                },
            );
            let frag = self.inner.cfg.fragment;
            split_into(&mut st.outbox, remote, hdr, args.to_vec(), frag);
            drop(st);
            self.inner.outbox_posted();
            None
        };
        CallFuture {
            ep: self.clone(),
            token,
            remote,
            id,
            early,
        }
    }

    /// Send a one-way active message (no reply; an unknown handler or a failing one on the
    /// peer goes unnoticed).
    ///
    /// # Errors
    ///
    /// [`CallError::Transport`] when the channel fails; [`CallError::Shutdown`] when the endpoint
    /// is shut down; [`CallError::Reentrant`] from an inline handler.
    pub fn send(&self, remote: usize, id: u32, args: &[u8]) -> Result<(), CallError> {
        // A token of its own: the receiver tells the fragments of one message from another's.
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        self.send_helping(remote, KIND_REQUEST, FLAG_ONE_WAY, ST_OK, id, token, args)?;
        Ok(())
    }

    /// Send one message without blocking in the network: while the connection is taken or
    /// the message cannot leave, this thread polls for the process if nobody else does (a
    /// peer may be waiting for this process to receive before it can take our message).
    #[allow(clippy::too_many_arguments)]
    fn send_helping(
        &self,
        remote: usize,
        kind: u8,
        flags: u8,
        status: u16,
        id: u32,
        token: u64,
        body: &[u8],
    ) -> mad_core::Result<()> {
        let h = Header::whole(kind, flags, status, id, token, body.len());
        let frag = self.inner.cfg.fragment;
        if frag == 0 || body.len() <= frag {
            return self.send_one(remote, &h.encode(), body);
        }
        let window = self.inner.cfg.window;
        let key = (remote, kind, token);
        let _credit = (window > 0).then(|| CreditGuard::new(&self.inner, key));
        for (k, c) in body.chunks(frag).enumerate() {
            if window > 0 && k >= window {
                // At most `window` fragments ahead of what the peer has received.
                self.wait_credit(key, ((k + 1 - window) * frag) as u64)?;
            }
            if k > 0 {
                // Between two fragments the connection is free: let the threads waiting for
                // it (a small call behind this large one) take it first, and send the small
                // requests queued in the outbox (as the poller, if nobody else polls).
                let t0 = Instant::now();
                let mut b = Backoff(0);
                while t0.elapsed() < Duration::from_millis(1) {
                    if !lock(&self.inner.state).outbox.is_empty() {
                        self.help(&mut b);
                    } else if self.inner.contenders[remote].load(Ordering::Acquire) > 0 {
                        std::thread::yield_now();
                    } else {
                        break;
                    }
                }
            }
            self.send_one(remote, &h.fragment(k, frag, c.len()).encode(), c)?;
        }
        Ok(())
    }

    /// A small request: sent now if the connection is free, else copied into the outbox for
    /// the poller (which may be the caller itself, once it waits for the reply), so a caller
    /// never spins for a connection another thread sends on.
    fn send_or_queue(
        &self,
        remote: usize,
        id: u32,
        token: u64,
        args: &[u8],
    ) -> mad_core::Result<Option<Arc<AtomicBool>>> {
        let mut h = Header::whole(KIND_REQUEST, 0, ST_OK, id, token, args.len());
        match self.inner.ch.try_begin_packing(remote)? {
            Some(p) => self.send_begun(p, &h.encode(), args).map(|()| None),
            None => {
                // The poller packs it SAFER (see `Poller::drive_sends`).
                h.flags |= FLAG_SAFER;
                let started = Arc::new(AtomicBool::new(false));
                let o = Out {
                    to: remote,
                    hdr: h.encode(),
                    body: args.to_vec(),
                    started: Some(started.clone()),
                };
                lock(&self.inner.state).outbox.push(o);
                self.inner.outbox_posted();
                Ok(Some(started))
            }
        }
    }

    /// One message: `hdr` EXPRESS, then `body` CHEAPER.
    fn send_one(&self, remote: usize, hdr: &[u8; HDR], body: &[u8]) -> mad_core::Result<()> {
        let ch = &self.inner.ch;
        let mut b = Backoff(0);
        let p = match ch.try_begin_packing(remote)? {
            Some(p) => p,
            None => {
                let _c = Contender::new(&self.inner.contenders[remote]);
                loop {
                    if let Some(p) = ch.try_begin_packing(remote)? {
                        break p;
                    }
                    self.help(&mut b);
                }
            }
        };
        self.send_begun(p, hdr, body)
    }

    /// Send one message on a connection taken already.
    fn send_begun<'b>(
        &self,
        mut p: Packer<'_, 'b>,
        hdr: &[u8; HDR],
        body: &'b [u8],
    ) -> mad_core::Result<()> {
        p.defer();
        p.pack_safer(hdr, RecvMode::Express)?;
        if !body.is_empty() {
            p.pack(body, RecvMode::Cheaper)?;
        }
        let mut b = Backoff(0);
        let mut done: Option<mad_core::Result<()>> = None;
        loop {
            if let Some(r) = done.take() {
                return r;
            }
            if let Poll::Ready(r) = p.poll_end_packing() {
                return r;
            }
            // While this thread polls for the process, every wait of the poller also drives
            // this message: a peer may be waiting for it before it sends what the poller
            // waits for.
            let mut own = || {
                if done.is_some() {
                    return false;
                }
                match p.poll_end_packing() {
                    Poll::Ready(r) => {
                        done = Some(r);
                        true
                    }
                    Poll::Pending => false,
                }
            };
            self.help_with(&mut b, Some(&mut own));
        }
    }

    /// Make progress for the process once if no thread holds the poller role, else pause.
    fn help(&self, b: &mut Backoff) {
        self.help_with(b, None)
    }

    /// [`help`](Self::help) by a thread whose own message is in progress: `own` drives it
    /// (whether it moved), and the poller calls it at each of its waits.
    fn help_with<'h>(&'h self, b: &mut Backoff, own: Option<&'h mut (dyn FnMut() -> bool + 'h)>) {
        match self.take_role_with(own) {
            Some(mut poller) => {
                let moved = matches!(poller.step(), Ok(true));
                poller.release();
                if moved {
                    b.0 = 0;
                } else {
                    b.pause(&self.inner);
                }
            }
            None => b.pause(&self.inner),
        }
    }

    /// This endpoint's identity for [`ROLE`].
    fn key(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// The poller role, if free, with the replies the last poller left.
    fn take_role(&self) -> Option<Poller<'_>> {
        self.take_role_with(None)
    }

    /// [`take_role`](Self::take_role) with the taker's own message in progress (see
    /// [`help_with`](Self::help_with)).
    fn take_role_with<'h>(
        &'h self,
        own: Option<&'h mut (dyn FnMut() -> bool + 'h)>,
    ) -> Option<Poller<'h>> {
        let mut st = lock(&self.inner.state);
        if st.polling {
            return None;
        }
        st.polling = true;
        ROLE.with(|r| r.set(self.key()));
        let waiting = std::mem::take(&mut st.outbox);
        Some(Poller {
            ep: self,
            sending: Vec::new(),
            waiting,
            // Sized at the first contention (most roles never contend).
            contending: Vec::new(),
            counted: 0,
            scratch: Vec::new(),
            own,
            mine: None,
            got: None,
        })
    }

    /// Wait for the reply `token`, polling when nobody else does.
    /// `queued`: the request waits in the outbox until this flag is set (while it does, a
    /// sleeping caller looks every millisecond).
    fn wait_reply(
        &self,
        token: u64,
        remote: usize,
        mut queued: Option<Arc<AtomicBool>>,
    ) -> Result<(u16, Vec<u8>), CallError> {
        let inner = &*self.inner;
        let deadline = inner.cfg.call_timeout.map(|t| Instant::now() + t);
        // A queued request is seen by a sender of fragments to the same peer (it sends the
        // outbox between two fragments) and, once a poller holds it, counted by that poller
        // in `contenders`.
        let mut b = Backoff(0);
        loop {
            if queued.as_ref().is_some_and(|f| f.load(Ordering::Acquire)) {
                queued = None;
            }
            {
                let mut st = lock(&inner.state);
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
                if st.polling && b.0 < SPINS && st.calls.len() <= inner.cores {
                    // No more calls waiting than cores: this thread stays on the CPU a while
                    // (spins, then yields), so a reply that comes soon, or the role, needs no
                    // wake-up. With more callers than cores, spinners would only delay the
                    // threads that have work: it sleeps at once.
                    drop(st);
                    b.pause(inner);
                    continue;
                }
                if st.polling {
                    // Sleep until this call's reply (or the role) comes: only this thread is
                    // woken for it, not every waiting caller.
                    if let Some(Slot::Waiting {
                        waker, blocking, ..
                    }) = st.calls.get_mut(&token)
                    {
                        if waker.is_none() {
                            *waker =
                                Some(Waker::from(Arc::new(ThreadWaker(std::thread::current()))));
                            *blocking = true;
                        }
                    }
                    drop(st);
                    // Woken by its reply or when the role is handed on; a request still
                    // queued is looked at every millisecond.
                    let nap = if queued.is_some() {
                        inner.cfg.slice.min(Duration::from_millis(1))
                    } else {
                        inner.cfg.slice
                    };
                    std::thread::park_timeout(nap);
                    continue;
                }
            }
            let Some(mut poller) = self.take_role() else {
                continue;
            };
            poller.mine = Some((token, remote));
            // The call table is locked only after some call completed (the reply to this
            // call, received by this thread, ends the poll without it).
            let mut seen = None;
            let r = self.poll_until(&mut poller, deadline, |ep| {
                let now = ep.inner.completed.load(Ordering::Acquire);
                seen.replace(now) != Some(now) && ep.is_done(token)
            });
            // From here (`release` still receives), the reply goes through the call table.
            poller.mine = None;
            if let Some(got) = poller.got.take() {
                lock(&inner.state).calls.remove(&token);
                poller.release();
                return Ok(got);
            }
            poller.release();
            if let Err(e) = r {
                lock(&inner.state).calls.remove(&token);
                return Err(transport(&e));
            }
        }
    }

    fn is_done(&self, token: u64) -> bool {
        matches!(
            lock(&self.inner.state).calls.get(&token),
            Some(Slot::Done(_)) | None
        )
    }

    /// Drive `poller` until `done`, `deadline`, shutdown, or an error about no peer in
    /// particular. Idle, it sleeps on the readiness descriptor; after each quiet slice it
    /// looks at the peers that owe replies.
    fn poll_until(
        &self,
        poller: &mut Poller<'_>,
        deadline: Option<Instant>,
        mut done: impl FnMut(&Endpoint) -> bool,
    ) -> mad_core::Result<()> {
        let inner = &*self.inner;
        let mut b = Backoff(0);
        // The clock is read when nothing moved (every 8th such step), and every 32 steps that
        // did (a busy poller makes no system call for it).
        let mut quiet_since: Option<Instant> = None;
        let mut busy = 0u32;
        loop {
            if poller.got.is_some() || done(self) || inner.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            match poller.step() {
                Ok(true) => {
                    b.0 = 0;
                    quiet_since = None;
                    busy = busy.wrapping_add(1);
                    if busy % 32 == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(());
                    }
                }
                Ok(false) => {
                    // While spinning, the clock every 8th idle step (each a pause of its own):
                    // a tight loop notices the next message sooner.
                    if b.0 % 8 == 0 {
                        let now = Instant::now();
                        if deadline.is_some_and(|d| now >= d) {
                            return Ok(());
                        }
                        let q = *quiet_since.get_or_insert(now);
                        if now.duration_since(q) >= inner.cfg.slice {
                            poller.check_owing_peers();
                            quiet_since = Some(now);
                        }
                    }
                    b.pause(inner);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Fail the calls waiting for `rank` (every call when `None`).
    fn fail_calls(&self, rank: Option<usize>, e: &Error) {
        let mut st = lock(&self.inner.state);
        // The bodies sent to it in fragments will not be acknowledged.
        for ((r, ..), c) in st.credit.iter_mut() {
            if rank.is_none_or(|x| x == *r) && c.acked.is_ok() {
                c.acked = Err(copy_error(e));
                if let Some(t) = c.waiter.take() {
                    t.unpark();
                }
            }
        }
        // What that peer sent in part will not be completed.
        st.partial.retain(|k, _| rank.is_some_and(|r| r != k.0));
        let mut any = false;
        for s in st.calls.values_mut() {
            if let Slot::Waiting { remote, waker, .. } = s {
                if rank.is_none_or(|r| r == *remote) {
                    if let Some(w) = waker.take() {
                        w.wake();
                    }
                    *s = Slot::Done(Err(transport(e)));
                    any = true;
                }
            }
        }
        if any {
            self.inner.completed.fetch_add(1, Ordering::AcqRel);
            self.inner.notify_servers();
        }
    }

    /// An acknowledgement of a body this process sends in fragments.
    fn acknowledged(&self, from: usize, h: Header) {
        let mut st = lock(&self.inner.state);
        if let Some(c) = st.credit.get_mut(&(from, h.id as u8, h.token)) {
            if let Ok(a) = &mut c.acked {
                *a = (*a).max(h.offset);
            }
            if let Some(t) = c.waiter.take() {
                t.unpark();
            }
        }
    }

    /// Wait until `remote` acknowledged `need` bytes of the body `key`, polling when nobody
    /// else does, else asleep until the poller passes an acknowledgement on. A peer that
    /// closed cleanly is noticed after a quiet slice.
    fn wait_credit(&self, key: (usize, u8, u64), need: u64) -> mad_core::Result<()> {
        if ROLE.with(|r| r.get()) == self.key() {
            // This thread polls for the endpoint up the stack (a pool handler the poller runs
            // itself sends): nobody else would receive the acknowledgements. The drivers'
            // buffers bound what goes ahead, as without a window.
            return Ok(());
        }
        let inner = &*self.inner;
        let mut b = Backoff(0);
        let mut since = Instant::now();
        let mut seen = 0;
        loop {
            {
                let mut st = lock(&inner.state);
                match st.credit.get_mut(&key) {
                    Some(Credit { acked: Ok(a), .. }) if *a >= need => return Ok(()),
                    Some(Credit { acked: Err(e), .. }) => return Err(copy_error(e)),
                    Some(c) => {
                        if let Ok(a) = c.acked {
                            if a > seen {
                                seen = a;
                                b.0 = 0;
                            }
                        }
                        c.waiter = Some(std::thread::current());
                    }
                    None => return Ok(()),
                }
            }
            match self.take_role() {
                Some(mut poller) => {
                    let moved = matches!(poller.step(), Ok(true));
                    if since.elapsed() >= inner.cfg.slice {
                        poller.check_peer(key.0);
                        since = Instant::now();
                    }
                    poller.release();
                    if moved {
                        b.0 = 0;
                        since = Instant::now();
                    } else {
                        b.pause(inner);
                    }
                }
                // Another thread polls: it passes the acknowledgement on. A while, this
                // thread stays on the CPU (no wake-up needed), then it sleeps.
                None if b.0 < SPINS => b.pause(inner),
                None => std::thread::park_timeout(Duration::from_millis(1)),
            }
        }
    }

    /// Fail the call `token` (its request could not be sent).
    fn fail_call(&self, token: u64, e: &Error) {
        let mut st = lock(&self.inner.state);
        if let Some(s @ Slot::Waiting { .. }) = st.calls.get_mut(&token) {
            let Slot::Waiting { waker, .. } = std::mem::replace(s, Slot::Done(Err(transport(e))))
            else {
                unreachable!("matched above")
            };
            drop(st);
            self.inner.completed.fetch_add(1, Ordering::AcqRel);
            if let Some(w) = waker {
                w.wake();
            }
        }
    }

    /// A reply: to the thread waiting for its token.
    fn deliver(&self, from: usize, h: Header, body: mad_core::Result<Vec<u8>>) {
        let mut st = lock(&self.inner.state);
        let ours =
            matches!(st.calls.get(&h.token), Some(Slot::Waiting { remote, .. }) if *remote == from);
        match body {
            Ok(b) if ours => {
                let old = st.calls.insert(h.token, Slot::Done(Ok((h.status, b))));
                drop(st);
                self.inner.completed.fetch_add(1, Ordering::AcqRel);
                if let Some(Slot::Waiting { waker: Some(w), .. }) = old {
                    w.wake();
                }
            }
            Ok(_) => {} // a caller that gave up (timeout): dropped
            Err(e) => {
                drop(st);
                self.fail_calls(Some(from), &e);
            }
        }
    }

    /// Run `fut` to completion on this thread, which polls for the endpoint meanwhile: an
    /// event loop for async callers with no thread hand-off. Calls made with
    /// [`call_async`](Self::call_async) inside `fut` are sent by this thread, and their
    /// replies, received by this thread, wake `fut` with a flag (no system call): many calls
    /// in flight from one thread cost no context switch per reply. While it holds the poller
    /// role this thread also serves the endpoint's handlers and the other threads' calls, as
    /// a blocking caller does; when another thread holds it (a progress thread), this thread
    /// sleeps until `fut` is woken. Idle, it sleeps on the channel's descriptor.
    ///
    /// `fut` must not make blocking calls of this endpoint ([`call`](Self::call) returns
    /// [`CallError::Reentrant`] there, as in an inline handler). A transport error about no
    /// peer in particular (the channel closed) fails every pending call, so `fut` sees it.
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        let flag = Arc::new(LoopWaker {
            woken: AtomicBool::new(true),
            thread: std::thread::current(),
            inner: Arc::downgrade(&self.inner),
        });
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(fut);
        let mut out = None;
        loop {
            // Polled whenever woken, with the role held if this thread has it (no hand-off).
            let mut run = |_: &Endpoint| {
                if flag.woken.swap(false, Ordering::AcqRel) {
                    if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                        out = Some(v);
                    }
                }
                out.is_some() || flag.woken.load(Ordering::Acquire)
            };
            if run(self) {
                match out.take() {
                    Some(v) => return v,
                    None => continue,
                }
            }
            let Some(mut poller) = self.take_role() else {
                // Another thread polls: it completes our calls and wakes us.
                std::thread::park_timeout(self.inner.cfg.slice);
                continue;
            };
            let r = self.poll_until(&mut poller, None, &mut run);
            poller.release();
            if let Some(v) = out.take() {
                return v;
            }
            if r.is_err() || self.inner.stop.load(Ordering::Acquire) {
                // The pending calls failed (their futures wake); no busy loop while `fut`
                // waits for something else.
                std::thread::park_timeout(self.inner.cfg.slice.min(Duration::from_millis(1)));
            }
        }
    }

    /// Poll once: handle at most one message, waiting up to `timeout` for one if no other
    /// thread polls. Returns whether anything moved. An error about one peer fails the calls
    /// waiting for it; an error about no peer in particular (the channel closed, no peer
    /// left) is returned.
    ///
    /// # Errors
    ///
    /// An error about no peer in particular: [`Error::Closed`] once the
    /// channel is closed, [`Error::Poisoned`] once no peer is left.
    pub fn progress(&self, timeout: Duration) -> mad_core::Result<bool> {
        let Some(mut poller) = self.take_role() else {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            return Ok(false);
        };
        let deadline = Instant::now() + timeout;
        let mut r = Ok(false);
        let mut b = Backoff(0);
        while Instant::now() < deadline {
            r = poller.step();
            if !matches!(r, Ok(false)) {
                break;
            }
            b.pause(&self.inner);
        }
        poller.release();
        r
    }

    /// Serve until [`shutdown`](Self::shutdown), or until every peer has left (both `Ok`):
    /// for a process whose threads never call. Fails when the channel can serve nobody any
    /// more for another reason ([`Error::Closed`], ...).
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] once the channel is closed, or another error that
    /// leaves the channel serving nobody.
    pub fn serve(&self) -> mad_core::Result<()> {
        let inner = &*self.inner;
        while !inner.stop.load(Ordering::Acquire) {
            let Some(mut poller) = self.take_role() else {
                inner.cv_waiters.fetch_add(1, Ordering::SeqCst);
                let st = lock(&inner.state);
                let _ = inner.cv.wait_timeout(st, inner.cfg.slice);
                inner.cv_waiters.fetch_sub(1, Ordering::SeqCst);
                continue;
            };
            let slice_end = Some(Instant::now() + inner.cfg.slice);
            let r = self.poll_until(&mut poller, slice_end, |_| false);
            poller.release();
            match r {
                Err(e) if error_rank(&e).is_none() => return Err(e),
                // Every peer has left.
                Err(_) => return Ok(()),
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// A thread that runs [`serve`](Self::serve) until the returned handle is dropped or
    /// [`shutdown`](Self::shutdown) is called.
    ///
    /// # Panics
    ///
    /// When the operating system cannot start a thread.
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
        self.inner.completed.fetch_add(1, Ordering::AcqRel);
        self.inner.cv.notify_all();
        // Async calls learn it when polled: wake them.
        let wakers: Vec<Waker> = lock(&self.inner.state)
            .calls
            .values_mut()
            .filter_map(|s| match s {
                Slot::Waiting { waker, .. } => waker.take(),
                Slot::Done(_) => None,
            })
            .collect();
        wakers.into_iter().for_each(Waker::wake);
        let pool = lock(&self.inner.pool).take();
        if let Some(Pool { tx, workers }) = pool {
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
#[must_use = "dropping the handle shuts the endpoint down at once"]
pub struct ProgressThread {
    ep: Endpoint,
    t: Option<JoinHandle<mad_core::Result<()>>>,
}

impl ProgressThread {
    /// Shut the endpoint down and return what ended the thread.
    ///
    /// # Errors
    ///
    /// The error that ended the serving thread, as [`Endpoint::serve`] returns it;
    /// [`Error::Io`] naming the panic when the thread panicked.
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
            offset: 0,
            piece: 0,
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

    #[test]
    fn acknowledgement_headers() {
        let ack = Header {
            kind: KIND_ACK,
            flags: FLAG_SAFER,
            status: ST_OK,
            id: u32::from(KIND_REQUEST),
            token: 9,
            len: 0,
            offset: 1 << 33,
            piece: 0,
        };
        assert_eq!(Header::decode(&ack.encode()), Some(ack));
        let bad = |f: fn(&mut Header)| {
            let mut h = ack;
            f(&mut h);
            Header::decode(&h.encode())
        };
        assert_eq!(
            bad(|h| h.len = 1),
            None,
            "an acknowledgement carries no body"
        );
        assert_eq!(
            bad(|h| h.id = 3),
            None,
            "it acknowledges a request or a reply"
        );
        assert_eq!(
            bad(|h| h.flags |= FLAG_FRAG),
            None,
            "it is never fragmented"
        );
        assert_eq!(bad(|h| h.piece = 1), None);
    }
}
