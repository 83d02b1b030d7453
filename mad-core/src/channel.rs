//! Channels and connections.
//!
//! A [`Channel`] is bound to one driver and one adapter. It holds one *connection* per peer
//! (a [`LinkPair`](crate::driver::LinkPair): a sending and a receiving half, each behind its own
//! mutex, so a connection carries one message at a time in each direction while different
//! connections work in parallel). Order is guaranteed per connection, never across channels.

use std::cell::Cell;
use std::cell::UnsafeCell;
use std::fmt::Write as _;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::config::ChannelConfig;
use crate::driver::{Armed, Bmm, Capabilities, Incoming, RxLink, TmTable, TxLink, MAX_TMS};
use crate::error::{Error, Result};
use crate::modes::{RecvMode, SendMode};
use crate::pack::Packer;
use crate::progress::ProgressPolicy;
use crate::unpack::Unpacker;

pub(crate) struct TxState {
    pub(crate) link: Box<dyn TxLink>,
    pub(crate) seq: u32,
    pub(crate) broken: Option<String>,
    /// The lists a `Packer` borrows for its message (see `lists.rs`).
    pub(crate) spare: crate::pack::TxSpare,
    /// What the link was last told by [`TxLink::set_nonblocking`].
    pub(crate) nonblocking: bool,
}

impl TxState {
    /// Tell the link whether its caller may wait (only when that changes).
    #[inline]
    pub(crate) fn set_nonblocking(&mut self, on: bool) {
        if self.nonblocking != on {
            self.nonblocking = on;
            self.link.set_nonblocking(on);
        }
    }
}

pub(crate) struct RxState {
    pub(crate) link: Box<dyn RxLink>,
    pub(crate) seq: u32,
    pub(crate) broken: Option<String>,
    /// Whether the failure in `broken` was already reported by an any-source receive.
    pub(crate) reported: bool,
    /// The lists an `Unpacker` borrows for its message (see `lists.rs`).
    pub(crate) spare: crate::unpack::RxSpare,
    /// What the link was last told by [`RxLink::set_nonblocking`].
    pub(crate) nonblocking: bool,
}

impl RxState {
    /// Tell the link whether its caller may wait (only when that changes).
    #[inline]
    pub(crate) fn set_nonblocking(&mut self, on: bool) {
        if self.nonblocking != on {
            self.nonblocking = on;
            self.link.set_nonblocking(on);
        }
    }
}

/// A number for the calling thread, never 0 (cheaper than `thread::current().id()`).
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TOKEN: Cell<u64> = const { Cell::new(0) });
    TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// One direction of a connection: its state behind the engine's own lock, and which thread
/// holds it, so a thread that asks again for a direction it already holds gets
/// [`Error::InUse`] instead of waiting for itself forever.
///
/// Not a `std::sync::Mutex`: its guard is `Send` (a message, and the direction it holds, may
/// move to another thread, as a future does between the polls of a multi-threaded runtime),
/// and an event-driven caller waits for it with a [`Waker`] instead of a blocked thread
/// ([`Half::poll_lock`]). Uncontended, taking and releasing it is one compare-and-swap and one
/// swap, as a mutex's.
pub(crate) struct Half<T> {
    /// 0 free, 1 held, 2 held with waiters (threads or wakers) to wake on release.
    state: AtomicU32,
    /// The holder's [`thread_token`], 0 when free. Only the holder writes its own token (after
    /// locking) and clears it (before unlocking), so a thread that reads its own token is the
    /// holder (or started the message that holds it, on another thread now); nothing else is
    /// inferred from this word.
    owner: AtomicU64,
    /// Waiters of the slow path: blocked threads (the condition variable) and wakers.
    queue: Mutex<Vec<Waker>>,
    cv: Condvar,
    data: UnsafeCell<T>,
}

// SAFETY: `Half` is a lock: `data` is only reached through a `HalfGuard`, and the `state`
// protocol (acquire on taking, release on giving back) lets one guard exist at a time, so
// sharing a `Half` between threads only ever moves `T` between them (hence `T: Send`).
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for Half<T> {}

/// A held direction of a connection; releasing it (on drop) wakes its waiters.
pub(crate) struct HalfGuard<'a, T> {
    half: &'a Half<T>,
}

impl<T> Deref for HalfGuard<'_, T> {
    type Target = T;
    #[inline]
    #[allow(unsafe_code)]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `Half`), so nobody writes `data` meanwhile.
        unsafe { &*self.half.data.get() }
    }
}

impl<T> DerefMut for HalfGuard<'_, T> {
    #[inline]
    #[allow(unsafe_code)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this borrow unique.
        unsafe { &mut *self.half.data.get() }
    }
}

impl<T> Drop for HalfGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        let h = self.half;
        h.owner.store(0, Ordering::Relaxed);
        if h.state.swap(0, Ordering::Release) == 2 {
            h.wake_all();
        }
    }
}

impl<T> Half<T> {
    fn new(t: T) -> Self {
        Half {
            state: AtomicU32::new(0),
            owner: AtomicU64::new(0),
            queue: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            data: UnsafeCell::new(t),
        }
    }

    #[inline]
    fn held(&self, me: u64) -> HalfGuard<'_, T> {
        self.owner.store(me, Ordering::Relaxed);
        HalfGuard { half: self }
    }

    #[inline]
    fn try_take(&self) -> bool {
        self.state
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    #[cold]
    fn wake_all(&self) {
        self.wake_all_locked(lock(&self.queue));
    }

    /// Take this direction, waiting while another thread holds it, at most until `deadline`
    /// and while `stop()` says nothing; `Ok(None)` when the calling thread holds it already.
    #[inline]
    pub(crate) fn lock_until(
        &self,
        deadline: Option<Instant>,
        stop: &dyn Fn() -> Result<()>,
    ) -> Result<Option<HalfGuard<'_, T>>> {
        let me = thread_token();
        if self.try_take() {
            return Ok(Some(self.held(me)));
        }
        if self.owner.load(Ordering::Relaxed) == me {
            return Ok(None);
        }
        self.lock_slow(me, deadline, stop).map(Some)
    }

    #[cold]
    fn lock_slow(
        &self,
        me: u64,
        deadline: Option<Instant>,
        stop: &dyn Fn() -> Result<()>,
    ) -> Result<HalfGuard<'_, T>> {
        let mut q = lock(&self.queue);
        loop {
            // Announce a waiter, and take the lock if it was free meanwhile (2 is then merely
            // a spurious wake-up at release).
            if self.state.swap(2, Ordering::Acquire) == 0 {
                drop(q);
                return Ok(self.held(me));
            }
            stop()?;
            let slice = Duration::from_millis(50);
            let t = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Timeout(Duration::ZERO));
                    }
                    (d - now).min(slice)
                }
                None => slice,
            };
            q = self
                .cv
                .wait_timeout(q, t)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Take this direction if it is free: `Err(true)` when the calling thread holds it,
    /// `Err(false)` when another one does.
    #[inline]
    pub(crate) fn try_lock(&self) -> std::result::Result<HalfGuard<'_, T>, bool> {
        let me = thread_token();
        if self.try_take() {
            Ok(self.held(me))
        } else {
            Err(self.owner.load(Ordering::Relaxed) == me)
        }
    }

    /// Take this direction, or register `cx`'s waker to be woken when it is released.
    pub(crate) fn poll_lock(&self, cx: &mut Context<'_>) -> Poll<HalfGuard<'_, T>> {
        let me = thread_token();
        if self.try_take() {
            return Poll::Ready(self.held(me));
        }
        let mut q = lock(&self.queue);
        if self.state.swap(2, Ordering::Acquire) == 0 {
            drop(q);
            return Poll::Ready(self.held(me));
        }
        if !q.iter().any(|w| w.will_wake(cx.waker())) {
            q.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Wake every waiter without releasing (a closing channel: they find out and fail).
    pub(crate) fn notify(&self) {
        self.wake_all_locked(lock(&self.queue));
    }

    fn wake_all_locked(&self, mut q: MutexGuard<'_, Vec<Waker>>) {
        let wakers = std::mem::take(&mut *q);
        drop(q);
        self.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }
}

/// Why a connection can no longer be used, in either direction (see [`Conn::fail`]).
pub(crate) struct ConnFailure {
    /// The peer is gone (closed, died, reset): calls towards it report [`Error::PeerClosed`].
    gone: bool,
    /// What happened, for [`Error::Poisoned`].
    cause: String,
}

pub(crate) struct Conn {
    pub(crate) tx: Half<TxState>,
    pub(crate) rx: Half<RxState>,
    /// Set once, by whichever half learns first that the connection is finished: the
    /// connection is the unit of failure, so the other half refuses new messages too.
    pub(crate) failed: std::sync::OnceLock<ConnFailure>,
    /// Any-source hint: this connection may have a message.
    pub(crate) hint: AtomicBool,
    /// Counters of the sending direction (written by the holder of `tx` only).
    pub(crate) sent: LinkCounters,
    /// Counters of the receiving direction (written by the holder of `rx` only).
    pub(crate) received: LinkCounters,
}

/// One direction's counters, updated once per message. Only the thread holding that
/// direction's lock writes them, so an update is a load and a store (no locked
/// read-modify-write on the message path); [`Channel::stats`] reads them without locking.
impl Conn {
    /// Record that this connection is finished (the first cause wins). `gone`: the peer
    /// closed, died or reset the connection; otherwise a local or protocol failure broke it.
    ///
    /// The first cause is logged (target `mad_core::channel`): `info` when the peer is gone
    /// (it closed, died or reset the connection), `warn` when the connection was poisoned.
    #[cold]
    pub(crate) fn fail(
        &self,
        ch: &ChannelInner,
        rank: usize,
        gone: bool,
        cause: impl Into<String>,
    ) {
        // Before the failure is visible anywhere (see `ChannelInner::all_broken`).
        ch.any_failed.store(true, Ordering::Release);
        let set = self.failed.set(ConnFailure {
            gone,
            cause: cause.into(),
        });
        if let (Ok(()), Some(ConnFailure { cause, .. })) = (set, self.failed.get()) {
            if gone {
                tracing::info!(
                    channel = %ch.config.name,
                    rank = ch.rank,
                    peer = rank,
                    %cause,
                    "connection finished: the peer is gone"
                );
            } else {
                tracing::warn!(
                    channel = %ch.config.name,
                    rank = ch.rank,
                    peer = rank,
                    %cause,
                    "connection poisoned"
                );
            }
        }
    }

    /// `Ok` while the connection may carry new messages; otherwise the error every new call
    /// towards this peer gets.
    #[inline]
    pub(crate) fn usable(&self, rank: usize) -> Result<()> {
        match self.failed.get() {
            None => Ok(()),
            Some(f) if f.gone => Err(Error::PeerClosed { rank }),
            Some(f) => Err(Error::Poisoned {
                rank,
                cause: f.cause.clone().into(),
            }),
        }
    }
}

/// Whether an error means the peer itself is gone (for [`Conn::fail`]).
pub(crate) fn peer_gone(e: &Error) -> bool {
    matches!(e, Error::PeerClosed { .. } | Error::ConnectionLost { .. })
}

#[derive(Default)]
pub(crate) struct LinkCounters {
    msgs: AtomicU64,
    bytes: AtomicU64,
    pieces: [AtomicU64; MAX_TMS],
}

impl LinkCounters {
    /// Count one message of `bytes` payload bytes and `pieces[tm]` pieces per TM. The caller
    /// holds the direction's lock.
    /// `used`: bit `tm` is set when `pieces[tm]` is not 0 (only those are touched).
    #[inline]
    pub(crate) fn add(&self, bytes: u64, pieces: &[u32; MAX_TMS], used: u8) {
        #[inline(always)]
        fn bump(c: &AtomicU64, n: u64) {
            c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        }
        bump(&self.msgs, 1);
        bump(&self.bytes, bytes);
        let mut m = used;
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            bump(&self.pieces[i], pieces[i] as u64);
            m &= m - 1;
        }
    }
}

/// A snapshot of a channel's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChannelStats {
    /// Messages sent (completed `end_packing`).
    pub messages_sent: u64,
    /// Payload bytes sent (pieces only, no headers).
    pub bytes_sent: u64,
    /// Messages received (completed `end_unpacking`).
    pub messages_received: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Pieces sent through each TM, indexed like the TM table.
    pub pieces_sent: Vec<(String, u64)>,
    /// Pieces received through each TM.
    pub pieces_received: Vec<(String, u64)>,
}

pub(crate) struct ChannelInner {
    pub(crate) config: ChannelConfig,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) table: TmTable,
    pub(crate) caps: Capabilities,
    pub(crate) progress: ProgressPolicy,
    pub(crate) conns: Vec<Option<Conn>>,
    pub(crate) peers: Vec<usize>,
    pub(crate) incoming: Box<dyn Incoming>,
    pub(crate) notes: Vec<String>,
    /// Where the table's thresholds come from (`tune=`).
    pub(crate) tuning: crate::tune::Tuning,
    rr: AtomicUsize,
    waiters: AtomicUsize,
    /// An event loop armed the readiness descriptor since the last release signalled it: the
    /// next connection released signals it (and clears this).
    pub(crate) armed: AtomicBool,
    /// A polled send found that it may progress while arming its wait ([`TxLink::arm_send`]
    /// said `Busy`): the next [`Channel::arm`] says `Busy` too. The descriptor is rung as well,
    /// but an arm drains it first, so without this an event loop that arms the channel after
    /// that send's poll would sleep with the send ready to go on.
    ///
    /// [`TxLink::arm_send`]: crate::driver::TxLink::arm_send
    pub(crate) kicked: AtomicBool,
    /// [`Channel::close`] was called.
    pub(crate) closed: AtomicBool,
    /// Some connection of this channel failed ([`Conn::fail`]): until then no peer can be
    /// gone, and [`ChannelInner::all_broken`] (asked by every empty any-source poll) answers
    /// without looking at the connections.
    any_failed: AtomicBool,
    released: Mutex<u64>,
    released_cv: Condvar,
    /// A virtual channel's parts and routes (`None` for a real channel).
    pub(crate) virt: Option<Box<crate::vchan::Virtual>>,
    /// Called with the peer's rank when this side breaks a connection in the middle of a
    /// received message (dropped, mismatched or timed-out `Unpacker`), after the driver
    /// tore the connection down: a virtual channel's relay tells the origin behind gateways.
    pub(crate) on_break: std::sync::OnceLock<Box<dyn Fn(usize) + Send + Sync>>,
}

/// A communication channel: one protocol, one adapter, connections to every reachable peer.
///
/// Cheap to clone (an `Arc`); `Send + Sync`, so threads share it.
///
/// A ping-pong between two ranks (see [`Session`](crate::Session) for the session; here two
/// threads over the in-process `mem` driver):
///
/// ```
/// # use mad_core::{bootstrap::ThreadBootstrap, mem::MemDriver, ChannelConfig, Session};
/// # // Two ranks as two threads of this process, over the in-process `mem` driver.
/// # fn two_ranks(body: impl Fn(Session) -> mad_core::Result<()> + Sync) -> mad_core::Result<()> {
/// #     std::thread::scope(|s| {
/// #         let body = &body;
/// #         let hs: Vec<_> = ThreadBootstrap::group(2)
/// #             .into_iter()
/// #             .map(|b| {
/// #                 s.spawn(move || {
/// #                     body(Session::builder().driver(MemDriver).bootstrap(Box::new(b)).build()?)
/// #                 })
/// #             })
/// #             .collect();
/// #         hs.into_iter().try_for_each(|h| h.join().unwrap())
/// #     })
/// # }
/// # two_ranks(|session| {
/// use mad_core::{ChannelConfig, RecvMode, SendMode};
/// let ch = session.open_channel_with(ChannelConfig::parse("pingpong", "mem")?)?;
/// let peer = 1 - session.rank();
/// if session.rank() == 0 {
///     // Rank 1 sends only once it has received: a non-blocking receive finds nothing yet.
///     assert!(ch.try_begin_unpacking()?.is_none());
/// }
/// for round in 0..3u32 {
///     if (session.rank() == 0) == (round % 2 == 0) {
///         let mut p = ch.begin_packing(peer)?;
///         p.pack_value(&round, RecvMode::Express)?;
///         p.end_packing()?;
///     } else {
///         let mut u = ch.begin_unpacking_from(peer)?;
///         assert_eq!(u.unpack_value::<u32>()?, round);
///         u.end_unpacking()?;
///     }
/// }
/// let stats = ch.stats();
/// assert_eq!(stats.messages_sent + stats.messages_received, 3);
/// # Ok(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Channel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Channel({} = {}{}, rank {} of {})",
            self.inner.config.name,
            self.inner.config.driver,
            self.inner
                .config
                .adapter
                .as_deref()
                .map(|a| format!(":{a}"))
                .unwrap_or_default(),
            self.inner.rank,
            self.inner.size
        )
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a connection lock leaves the connection in an unknown state; the
    // `broken` field is set by the drop paths of Packer/Unpacker, so taking the data is safe.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ChannelInner {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        config: ChannelConfig,
        rank: usize,
        size: usize,
        table: TmTable,
        caps: Capabilities,
        progress: ProgressPolicy,
        links: Vec<Option<crate::driver::LinkPair>>,
        incoming: Box<dyn Incoming>,
        notes: Vec<String>,
        tuning: crate::tune::Tuning,
    ) -> Self {
        let mut peers = Vec::new();
        let conns = links
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                l.map(|l| {
                    peers.push(r);
                    Conn {
                        tx: Half::new(TxState {
                            link: l.tx,
                            seq: 0,
                            broken: None,
                            spare: Default::default(),
                            nonblocking: false,
                        }),
                        rx: Half::new(RxState {
                            link: l.rx,
                            seq: 0,
                            broken: None,
                            reported: false,
                            spare: Default::default(),
                            nonblocking: false,
                        }),
                        hint: AtomicBool::new(false),
                        failed: std::sync::OnceLock::new(),
                        sent: LinkCounters::default(),
                        received: LinkCounters::default(),
                    }
                })
            })
            .collect();
        ChannelInner {
            config,
            rank,
            size,
            table,
            caps,
            progress,
            conns,
            peers,
            incoming,
            notes,
            tuning,
            rr: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            armed: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            any_failed: AtomicBool::new(false),
            released: Mutex::new(0),
            released_cv: Condvar::new(),
            virt: None,
            on_break: std::sync::OnceLock::new(),
        }
    }

    /// Zero the message counters (after the open's calibration traffic).
    pub(crate) fn reset_counters(&self) {
        for c in self.conns.iter().flatten() {
            for l in [&c.sent, &c.received] {
                l.msgs.store(0, Ordering::Relaxed);
                l.bytes.store(0, Ordering::Relaxed);
                for p in &l.pieces {
                    p.store(0, Ordering::Relaxed);
                }
            }
        }
    }

    /// `Err(Closed)` once [`Channel::close`] was called.
    #[inline]
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(self.closed_error())
        } else {
            Ok(())
        }
    }

    /// `e`, or [`Error::Closed`] when the channel was closed: a call that failed because
    /// `close` shut the driver's connections down reports the close, not its consequence.
    #[inline]
    pub(crate) fn closed_or(&self, e: Error) -> Error {
        if self.closed.load(Ordering::Acquire) {
            self.closed_error()
        } else {
            e
        }
    }

    #[cold]
    pub(crate) fn closed_error(&self) -> Error {
        Error::Closed {
            channel: self.config.name.clone(),
        }
    }

    #[inline]
    pub(crate) fn conn(&self, remote: usize) -> Result<&Conn> {
        match self.conns.get(remote) {
            Some(Some(c)) => Ok(c),
            _ => Err(self.no_conn(remote)),
        }
    }

    /// Why there is no connection to `remote`.
    #[cold]
    #[inline(never)]
    fn no_conn(&self, remote: usize) -> Error {
        match self.conns.get(remote) {
            Some(None) if remote != self.rank => Error::BadConfig(format!(
                "channel `{}` ({}) has no connection to rank {remote} (e.g. an intra-node driver and a remote rank)",
                self.config.name, self.config.driver
            )),
            _ => Error::BadRank { rank: remote, size: self.size, me: self.rank },
        }
    }

    /// The error a new message to or from `remote` would meet on this channel because an
    /// earlier one broke the connection (a half busy with a message counts as intact).
    pub(crate) fn refuses(&self, remote: usize) -> Option<Error> {
        let c = match self.conns.get(remote) {
            Some(Some(c)) => c,
            _ => return None,
        };
        if let Err(e) = c.usable(remote) {
            return Some(e);
        }
        let poisoned = |cause: &str| Error::Poisoned {
            rank: remote,
            cause: cause.into(),
        };
        if let Ok(tx) = c.tx.try_lock() {
            if let Some(cause) = &tx.broken {
                return Some(poisoned(cause));
            }
        }
        if let Ok(rx) = c.rx.try_lock() {
            if let Some(cause) = &rx.broken {
                return Some(poisoned(cause));
            }
        }
        None
    }

    /// Called when an Unpacker releases a connection: wake any-source waiters.
    pub(crate) fn released(&self, remote: usize) {
        if let Some(Some(c)) = self.conns.get(remote) {
            c.hint.store(true, Ordering::Release);
        }
        // Once per arm: the event loop that armed wakes, tries, and arms again before it
        // sleeps (a flag left set would cost a wake-up per message for ever after).
        if self.armed.load(Ordering::Relaxed) && self.armed.swap(false, Ordering::AcqRel) {
            self.incoming.wake();
        }
        if self.waiters.load(Ordering::Acquire) > 0 {
            *lock(&self.released) += 1;
            self.released_cv.notify_all();
            self.incoming.wake();
        }
    }

    /// Try to start receiving from `remote` without waiting.
    fn try_peer(&self, remote: usize, busy: &mut bool) -> Result<Option<HalfGuard<'_, RxState>>> {
        let Some(Some(conn)) = self.conns.get(remote) else {
            return Ok(None);
        };
        let mut rx = match conn.rx.try_lock() {
            Ok(g) => g,
            // This thread is unpacking a message from that peer: its next one is not ours to
            // wait for (nobody else may take it either while we hold the connection).
            Err(true) => return Ok(None),
            Err(false) => {
                *busy = true;
                return Ok(None);
            }
        };
        if rx.broken.is_none() {
            if let Err(e) = conn.usable(remote) {
                // The sending half (or a thread before) found the connection finished.
                rx.broken = Some(e.to_string());
                rx.link.abort_message();
                if matches!(e, Error::PeerClosed { .. }) {
                    rx.reported = true;
                    self.incoming.forget(remote);
                    return Ok(None);
                }
            }
        }
        if let Some(cause) = rx.broken.clone() {
            if rx.reported {
                return Ok(None);
            }
            rx.reported = true;
            self.incoming.forget(remote);
            return Err(Error::Poisoned {
                rank: remote,
                cause: cause.into(),
            });
        }
        match rx.link.poll_message() {
            Ok(Poll::Pending) => Ok(None),
            Ok(Poll::Ready(())) => Ok(Some(rx)),
            Err(e) => {
                rx.broken = Some(e.to_string());
                rx.reported = true;
                rx.link.abort_message();
                conn.fail(self, remote, peer_gone(&e), e.to_string());
                self.incoming.forget(remote);
                // A peer that closed cleanly between two messages simply leaves the any-source
                // set (clients come and go); anything else is reported once.
                if matches!(e, Error::PeerClosed { .. }) {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
        }
    }

    pub(crate) fn all_broken(&self) -> bool {
        if let Some(v) = &self.virt {
            return v.all_broken();
        }
        // A peer counts as gone only once its connection failed (a receiving half is broken
        // only after `Conn::fail`), which sets this first. A channel with no peers at all (a
        // virtual channel's part that reaches no other rank) has nobody to wait for: gone.
        if !self.any_failed.load(Ordering::Acquire) && !self.peers.is_empty() {
            return false;
        }
        self.peers.iter().all(|&p| match &self.conns[p] {
            Some(c) => match c.rx.try_lock() {
                Ok(g) => (g.broken.is_some() && g.reported) || c.failed.get().is_some(),
                Err(_) => false,
            },
            None => true,
        })
    }

    /// The error of an any-source receive on a channel none of whose peers can send any more.
    fn all_gone(&self) -> Error {
        Error::Poisoned {
            rank: self.peers[0],
            cause: "every peer of this channel has closed its connection or failed".into(),
        }
    }

    /// Find a peer with a message; returns its rank and its locked receiving half (a small value:
    /// the unpacker is built once, after the wait).
    fn try_any(&self, busy: &mut bool) -> Result<Poll<(usize, HalfGuard<'_, RxState>)>> {
        *busy = false;
        let n = self.peers.len();
        if n == 0 {
            return Err(Error::BadConfig(format!(
                "channel `{}` has no peers to receive from (session of {} process)",
                self.config.name, self.size
            )));
        }
        // The first look rotates over the peers (none to rotate with one peer: no locked
        // instruction on an empty poll's path).
        let start = if n == 1 {
            0
        } else {
            self.rr.fetch_add(1, Ordering::Relaxed)
        };
        if n <= self.caps.direct_poll_limit {
            for i in 0..n {
                let p = self.peers[(start + i) % n];
                if let Some(rx) = self.try_peer(p, busy)? {
                    return Ok(Poll::Ready((p, rx)));
                }
            }
        } else {
            let conns = &self.conns;
            self.incoming.poll(&mut |r| {
                if let Some(Some(c)) = conns.get(r) {
                    c.hint.store(true, Ordering::Relaxed);
                }
            })?;
            for i in 0..n {
                let p = self.peers[(start + i) % n];
                let Some(c) = &self.conns[p] else { continue };
                if c.hint.swap(false, Ordering::AcqRel) {
                    match self.try_peer(p, busy) {
                        Ok(Some(rx)) => return Ok(Poll::Ready((p, rx))),
                        Ok(None) => {
                            if *busy {
                                // Keep the hint for whoever can take it later.
                                c.hint.store(true, Ordering::Relaxed);
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Ok(Poll::Pending)
    }

    /// Wait for any-source readiness (called by the progress policy once spinning is over). It
    /// is also where a channel whose peers are all gone is noticed, off the polling fast path.
    fn block_any(&self, busy: bool, t: Duration) -> Result<()> {
        self.check_open()?;
        if !busy && self.all_broken() {
            return Err(self.all_gone());
        }
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let r = if busy {
            // A message is ready on a connection another thread is unpacking: wait for it to be
            // released rather than spinning on a readiness that is not ours.
            let g = lock(&self.released);
            let _ = self
                .released_cv
                .wait_timeout(g, t.min(Duration::from_millis(2)));
            Ok(())
        } else {
            self.incoming.wait(t)
        };
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        r
    }
}

impl Channel {
    /// Start a message to `remote`. Blocks while another thread sends to the same peer on this
    /// channel (a connection carries one message at a time in each direction).
    ///
    /// # Errors
    ///
    /// [`Error::BadRank`](crate::Error::BadRank) when `remote` is not another rank of the session;
    /// [`Error::InUse`](crate::Error::InUse) when this thread already has a message open to
    /// `remote` on this channel; [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Closed`](crate::Error::Closed) once the channel
    /// is closed; [`Error::Timeout`](crate::Error::Timeout) when the channel's operation timeout
    /// passes while the connection is busy.
    #[inline]
    pub fn begin_packing<'b>(&self, remote: usize) -> Result<Packer<'_, 'b>> {
        Packer::start(&self.inner, remote, None)
    }

    /// [`begin_packing`](Self::begin_packing) with a deadline: waiting for the connection
    /// gives up at `deadline` with [`Error::Timeout`], and the deadline stays on the message
    /// ([`Packer::set_deadline`]).
    ///
    /// # Errors
    ///
    /// [`Error::BadRank`](crate::Error::BadRank) when `remote` is not another rank of the session;
    /// [`Error::InUse`](crate::Error::InUse) when this thread already has a message open to
    /// `remote` on this channel; [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Closed`](crate::Error::Closed) once the channel
    /// is closed; [`Error::Timeout`](crate::Error::Timeout) at `deadline`.
    pub fn begin_packing_until<'b>(
        &self,
        remote: usize,
        deadline: Instant,
    ) -> Result<Packer<'_, 'b>> {
        Packer::start(&self.inner, remote, Some(deadline))
    }

    /// Non-blocking [`begin_packing`](Self::begin_packing): `None` while another thread (or
    /// task) sends a message to `remote` on this channel.
    ///
    /// # Errors
    ///
    /// [`Error::BadRank`](crate::Error::BadRank) when `remote` is not another rank of the session;
    /// [`Error::InUse`](crate::Error::InUse) when this thread already has a message open to
    /// `remote` on this channel; [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Closed`](crate::Error::Closed) once the channel
    /// is closed.
    pub fn try_begin_packing<'b>(&self, remote: usize) -> Result<Option<Packer<'_, 'b>>> {
        let inner = &*self.inner;
        if let Some(v) = &inner.virt {
            inner.check_open()?;
            return match v.out(remote)? {
                crate::vchan::Out::Direct(p) => p.try_begin_packing(remote),
                crate::vchan::Out::Forward {
                    transit,
                    next,
                    envelope,
                    broken,
                } => match transit.try_begin_packing(next)? {
                    Some(p) => p.forwarded(remote, &envelope, broken).map(Some),
                    None => Ok(None),
                },
            };
        }
        let conn = inner.conn(remote)?;
        inner.check_open()?;
        match conn.tx.try_lock() {
            Ok(tx) => Packer::started(inner, conn, remote, tx, None).map(Some),
            Err(true) => Err(Error::InUse {
                rank: remote,
                direction: "message to",
            }),
            Err(false) => Ok(None),
        }
    }

    /// [`begin_packing`](Self::begin_packing) for event loops and futures: `Pending` while
    /// another thread or task sends to `remote` on this channel, with `cx`'s waker woken when
    /// the connection is released (or the channel closed).
    pub fn poll_begin_packing<'b>(
        &self,
        remote: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Packer<'_, 'b>>> {
        let inner = &*self.inner;
        if let Some(v) = &inner.virt {
            if let Err(e) = inner.check_open() {
                return Poll::Ready(Err(e));
            }
            return match v.out(remote) {
                Ok(crate::vchan::Out::Direct(p)) => p.poll_begin_packing(remote, cx),
                Ok(crate::vchan::Out::Forward {
                    transit,
                    next,
                    envelope,
                    broken,
                }) => match transit.poll_begin_packing(next, cx) {
                    Poll::Ready(Ok(p)) => Poll::Ready(p.forwarded(remote, &envelope, broken)),
                    other => other,
                },
                Err(e) => Poll::Ready(Err(e)),
            };
        }
        let conn = match inner
            .conn(remote)
            .and_then(|c| inner.check_open().map(|()| c))
        {
            Ok(c) => c,
            Err(e) => return Poll::Ready(Err(e)),
        };
        match conn.tx.poll_lock(cx) {
            Poll::Ready(tx) => Poll::Ready(Packer::started(inner, conn, remote, tx, None)),
            // A close between the check and the registration wakes the registered waker.
            Poll::Pending => match inner.check_open() {
                Err(e) => Poll::Ready(Err(e)),
                Ok(()) => Poll::Pending,
            },
        }
    }

    /// Start receiving the next message from any peer; [`Unpacker::remote`] says which.
    ///
    /// Several threads may wait here at once: each gets a different whole message. A peer
    /// that closes its connection cleanly between two messages just leaves the set of peers
    /// (clients come and go); a connection that fails otherwise (reset, protocol violation,
    /// closed in the middle of a message) is reported by one call ([`Error::ConnectionLost`],
    /// [`Error::Protocol`], ...), and later calls keep serving the other peers. When no peer
    /// is left, the call fails with [`Error::Poisoned`]; when the channel is closed, with
    /// [`Error::Closed`].
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`](crate::Error::Poisoned) once every peer of the channel is gone; the
    /// failure of one connection ([`Error::ConnectionLost`](crate::Error::ConnectionLost),
    /// [`Error::Protocol`](crate::Error::Protocol), ...) is reported by one call;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed;
    /// [`Error::Timeout`](crate::Error::Timeout) when the operation timeout passes.
    pub fn begin_unpacking<'b>(&self) -> Result<Unpacker<'_, 'b>> {
        self.begin_any(None)
    }

    /// [`begin_unpacking`](Self::begin_unpacking) that gives up at `deadline` with
    /// [`Error::Timeout`] (nothing is consumed then); the deadline stays on the message
    /// ([`Unpacker::set_deadline`]).
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`](crate::Error::Poisoned) once every peer of the channel is gone; the
    /// failure of one connection ([`Error::ConnectionLost`](crate::Error::ConnectionLost),
    /// [`Error::Protocol`](crate::Error::Protocol), ...) is reported by one call;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed;
    /// [`Error::Timeout`](crate::Error::Timeout) at `deadline`.
    pub fn begin_unpacking_until<'b>(&self, deadline: Instant) -> Result<Unpacker<'_, 'b>> {
        self.begin_any(Some(deadline))
    }

    fn begin_any<'b>(&self, deadline: Option<Instant>) -> Result<Unpacker<'_, 'b>> {
        let inner = &*self.inner;
        inner.check_open()?;
        if let Some(v) = &inner.virt {
            let deadline =
                deadline.or_else(|| inner.progress.op_timeout.map(|t| Instant::now() + t));
            return v.begin_any(deadline);
        }
        let mut busy = false;
        let (remote, rx) = inner
            .progress
            .drive_until(
                &mut busy,
                |busy| inner.try_any(busy),
                |busy, t| inner.block_any(*busy, t),
                |_| 0,
                deadline,
            )
            .map_err(|e| inner.closed_or(e))?;
        Unpacker::start(inner, remote, rx, deadline).map_err(|e| inner.closed_or(e))
    }

    /// Non-blocking: start receiving a message if one is ready (Madeleine's `message_ready`).
    /// `None` also when a message has begun to arrive but its header is not whole yet.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`](crate::Error::Poisoned) once every peer of the channel is gone; the
    /// failure of one connection ([`Error::ConnectionLost`](crate::Error::ConnectionLost),
    /// [`Error::Protocol`](crate::Error::Protocol), ...) is reported by one call;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed.
    pub fn try_begin_unpacking<'b>(&self) -> Result<Option<Unpacker<'_, 'b>>> {
        self.try_any_start().map_err(|e| self.inner.closed_or(e))
    }

    fn try_any_start<'b>(&self) -> Result<Option<Unpacker<'_, 'b>>> {
        self.inner.check_open()?;
        if let Some(v) = &self.inner.virt {
            return v.try_any();
        }
        let mut busy = false;
        match self.inner.try_any(&mut busy)? {
            Poll::Ready((remote, rx)) => Unpacker::try_start(&self.inner, remote, rx),
            // Like `begin_unpacking`: no message can ever come, so say so instead of `None`.
            Poll::Pending if !busy && self.inner.all_broken() => Err(self.inner.all_gone()),
            Poll::Pending => Ok(None),
        }
    }

    /// Start receiving the next message from `remote`.
    ///
    /// # Errors
    ///
    /// [`Error::BadRank`](crate::Error::BadRank) when `remote` is not another rank;
    /// [`Error::InUse`](crate::Error::InUse) when this thread already receives from `remote` on
    /// this channel; [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Closed`](crate::Error::Closed) once the channel
    /// is closed; [`Error::Timeout`](crate::Error::Timeout) when the operation timeout passes.
    #[inline]
    pub fn begin_unpacking_from<'b>(&self, remote: usize) -> Result<Unpacker<'_, 'b>> {
        self.begin_from(remote, None)
    }

    /// [`begin_unpacking_from`](Self::begin_unpacking_from) that gives up at `deadline` with
    /// [`Error::Timeout`] (nothing is consumed then); the deadline stays on the message.
    ///
    /// # Errors
    ///
    /// [`Error::BadRank`](crate::Error::BadRank) when `remote` is not another rank;
    /// [`Error::InUse`](crate::Error::InUse) when this thread already receives from `remote` on
    /// this channel; [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Closed`](crate::Error::Closed) once the channel
    /// is closed; [`Error::Timeout`](crate::Error::Timeout) at `deadline`.
    pub fn begin_unpacking_from_until<'b>(
        &self,
        remote: usize,
        deadline: Instant,
    ) -> Result<Unpacker<'_, 'b>> {
        self.begin_from(remote, Some(deadline))
    }

    /// Non-blocking: start receiving the next message from `remote` if it has begun to
    /// arrive; `None` when nothing is there yet or another thread is receiving from `remote`.
    /// Fails as [`begin_unpacking_from`](Self::begin_unpacking_from) does when the
    /// connection is finished.
    ///
    /// # Errors
    ///
    /// [`Error::BadRank`](crate::Error::BadRank) when `remote` is not another rank;
    /// [`Error::InUse`](crate::Error::InUse) when this thread already receives from `remote` on
    /// this channel; [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Closed`](crate::Error::Closed) once the channel
    /// is closed.
    pub fn try_begin_unpacking_from<'b>(&self, remote: usize) -> Result<Option<Unpacker<'_, 'b>>> {
        self.try_from_start(remote, Duration::ZERO)
            .map_err(|e| self.inner.closed_or(e))
    }

    /// [`try_begin_unpacking_from`](Self::try_begin_unpacking_from) that keeps looking for
    /// up to `spin` on this thread: for an event loop that would spin anyway before it sleeps
    /// (the tokio adapter's first microseconds of a wait). It holds the receiving half while
    /// it polls the connection, as the blocking call does, instead of taking and releasing it
    /// at every try, so a message is seen sooner and at less cost. `None` when nothing began
    /// to arrive within `spin` (or another thread is receiving from `remote`).
    ///
    /// # Errors
    ///
    /// As [`try_begin_unpacking_from`](Self::try_begin_unpacking_from).
    pub fn try_begin_unpacking_from_spinning<'b>(
        &self,
        remote: usize,
        spin: Duration,
    ) -> Result<Option<Unpacker<'_, 'b>>> {
        self.try_from_start(remote, spin)
            .map_err(|e| self.inner.closed_or(e))
    }

    fn try_from_start<'b>(
        &self,
        remote: usize,
        spin: Duration,
    ) -> Result<Option<Unpacker<'_, 'b>>> {
        let inner = &*self.inner;
        if let Some(v) = &inner.virt {
            inner.check_open()?;
            return v
                .inbound(remote)?
                .try_begin_unpacking_from_spinning(remote, spin);
        }
        let conn = inner.conn(remote)?;
        inner.check_open()?;
        let mut rx = match conn.rx.try_lock() {
            Ok(g) => g,
            Err(true) => {
                return Err(Error::InUse {
                    rank: remote,
                    direction: "message from",
                })
            }
            Err(false) => return Ok(None),
        };
        Self::usable_rx(conn, &mut rx, remote)?;
        let mut start = None;
        let mut i = 0u32;
        loop {
            match rx.link.poll_message() {
                Ok(Poll::Pending) if spin.is_zero() => return Ok(None),
                Ok(Poll::Pending) => {
                    let t0 = *start.get_or_insert_with(Instant::now);
                    i = i.wrapping_add(1);
                    if i % 64 == 0 {
                        inner.check_open()?;
                        if t0.elapsed() >= spin {
                            return Ok(None);
                        }
                    }
                    std::hint::spin_loop();
                }
                Ok(Poll::Ready(())) => return Unpacker::try_start(inner, remote, rx),
                Err(e) => return Err(Self::rx_failed(inner, remote, conn, &mut rx, e)),
            }
        }
    }

    /// `Err` when the receiving half `rx` of `conn` can carry no new message.
    #[inline(always)]
    pub(crate) fn usable_rx(conn: &Conn, rx: &mut RxState, remote: usize) -> Result<()> {
        if rx.broken.is_none() && conn.failed.get().is_none() {
            return Ok(());
        }
        Self::unusable_rx(conn, rx, remote)
    }

    #[cold]
    #[inline(never)]
    fn unusable_rx(conn: &Conn, rx: &mut RxState, remote: usize) -> Result<()> {
        if let Some(cause) = &rx.broken {
            return Err(Error::Poisoned {
                rank: remote,
                cause: cause.as_str().into(),
            });
        }
        if let Err(e) = conn.usable(remote) {
            rx.broken = Some(e.to_string());
            rx.link.abort_message();
            return Err(e);
        }
        Ok(())
    }

    #[cold]
    pub(crate) fn rx_failed(
        inner: &ChannelInner,
        remote: usize,
        conn: &Conn,
        rx: &mut RxState,
        e: Error,
    ) -> Error {
        rx.broken = Some(e.to_string());
        rx.link.abort_message();
        conn.fail(inner, remote, peer_gone(&e), e.to_string());
        e
    }

    fn begin_from<'b>(&self, remote: usize, deadline: Option<Instant>) -> Result<Unpacker<'_, 'b>> {
        let inner = &*self.inner;
        if let Some(v) = &inner.virt {
            if let Some(p) = v.direct(remote) {
                return p.begin_from(remote, deadline);
            }
            inner.check_open()?;
            if deadline.is_none() {
                if let Some(u) = v.begin_behind(inner, remote)? {
                    return Ok(u);
                }
            }
            return v.inbound(remote)?.begin_from(remote, deadline);
        }
        let conn = inner.conn(remote)?;
        inner.check_open()?;
        let mut rx = conn
            .rx
            .lock_until(deadline, &|| inner.check_open())?
            .ok_or_else(|| Error::InUse {
                rank: remote,
                direction: "message from",
            })?;
        Self::usable_rx(conn, &mut rx, remote)?;
        let r = inner.progress.drive_until(
            &mut *rx,
            |rx| rx.link.poll_message(),
            |rx, t| {
                inner.check_open()?;
                rx.link.wait(t)
            },
            |_| 0,
            deadline,
        );
        match r {
            Ok(()) => Unpacker::start(inner, remote, rx, deadline).map_err(|e| inner.closed_or(e)),
            // Nothing of a message was consumed: the connection is intact.
            Err(e @ (Error::Timeout(_) | Error::Closed { .. })) => Err(e),
            Err(e) => Err(inner.closed_or(Self::rx_failed(inner, remote, conn, &mut rx, e))),
        }
    }

    /// Close the channel: every thread blocked in a call on it, and every later call, fails
    /// with [`Error::Closed`]; the driver closes the connections cleanly, so the peers see
    /// this process leave (as between messages: [`Error::PeerClosed`] on their calls towards
    /// it, and it leaves their any-source set). Messages in progress on this side are
    /// abandoned. Returns at once; idempotent. Dropping every handle of a channel also closes
    /// its connections, but does not wake threads blocked on it (they hold handles).
    pub fn close(&self) {
        let inner = &*self.inner;
        if inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::debug!(
            channel = %inner.config.name,
            driver = %inner.config.driver,
            rank = inner.rank,
            "channel closed"
        );
        if let Some(v) = &inner.virt {
            v.close();
        }
        inner.incoming.shutdown();
        inner.incoming.wake();
        {
            let _g = lock(&inner.released);
            inner.released_cv.notify_all();
        }
        for c in inner.conns.iter().flatten() {
            c.tx.notify();
            c.rx.notify();
        }
    }

    /// Whether `a` and `b` are handles of the same channel.
    pub fn ptr_eq(a: &Channel, b: &Channel) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// The channel's readiness descriptor, for an event loop (epoll, mio, tokio's `AsyncFd`),
    /// or `None` when the driver has none (MPI: poll with back-off instead).
    ///
    /// The protocol follows UCX's `ucp_worker_get_efd` / `ucp_worker_arm`: try everything that
    /// waits ([`try_begin_unpacking`](Self::try_begin_unpacking),
    /// [`Packer::poll_end_packing`], ...); when nothing is ready, [`arm`](Self::arm); on
    /// [`Armed::Busy`] try again (something may have become ready meanwhile, or a try made
    /// progress inside the driver that the descriptor cannot show), on [`Armed::Armed`] sleep
    /// until the descriptor is readable, then try again. No wake-up is lost: an event after
    /// the arm makes the descriptor readable, and `arm` reports one that came before it
    /// (a send armed by `poll_end_packing` that progressed included). It becomes readable on a message start or a hang-up on any
    /// connection, a connection released by another thread with a message waiting, progress
    /// of a send armed by the non-blocking send calls, and [`close`](Self::close). It may stay
    /// readable until the next `arm` (level-triggered), and false positives are possible:
    /// readable means "poll now", not "a message is there".
    ///
    /// ```no_run
    /// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
    /// use mad_core::driver::Armed;
    /// use std::os::fd::AsRawFd;
    /// let fd = ch.readiness_fd().expect("this driver has a descriptor").as_raw_fd();
    /// loop {
    ///     if let Some(u) = ch.try_begin_unpacking()? {
    ///         u.end_unpacking()?;
    ///         continue;
    ///     }
    ///     if ch.arm()? == Armed::Armed {
    ///         let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    ///         // SAFETY: one valid pollfd.
    ///         unsafe { libc::poll(&mut p, 1, -1) };
    ///     }
    /// }
    /// # }
    /// ```
    pub fn readiness_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.inner.virt {
            Some(v) => v.readiness_fd(),
            None => self.inner.incoming.readiness_fd(),
        }
    }

    /// Arm the readiness descriptor: see [`readiness_fd`](Self::readiness_fd). Returns
    /// [`Armed::Busy`] when something may be ready already (and always on a closed channel,
    /// so its waiters find out), [`Armed::Armed`] when the caller may sleep.
    ///
    /// # Errors
    ///
    /// The driver's error when arming its descriptor fails ([`Error::Io`](crate::Error::Io)).
    pub fn arm(&self) -> Result<Armed> {
        let inner = &*self.inner;
        inner.armed.store(true, Ordering::SeqCst);
        if inner.closed.load(Ordering::SeqCst) || inner.kicked.swap(false, Ordering::AcqRel) {
            return Ok(Armed::Busy);
        }
        if let Some(v) = &inner.virt {
            return v.arm();
        }
        if inner.incoming.arm()? == Armed::Busy {
            return Ok(Armed::Busy);
        }
        // A message the driver read already (into its own buffer, for a connection another
        // thread held meanwhile) leaves nothing on the descriptor: look at the free
        // connections. A release after this look rings the descriptor (`armed` is set).
        for &p in &inner.peers {
            let Some(c) = &inner.conns[p] else { continue };
            if let Ok(mut rx) = c.rx.try_lock() {
                if rx.broken.is_none() && c.failed.get().is_none() {
                    if let Ok(Poll::Ready(())) | Err(_) = rx.link.poll_message() {
                        inner.incoming.disarm();
                        return Ok(Armed::Busy);
                    }
                }
            }
        }
        Ok(Armed::Armed)
    }

    /// After an [`arm`](Self::arm) that said [`Armed::Armed`], once the caller woke up (or
    /// gave up waiting) and polls again: the driver may stop watching what only a sleeper
    /// needs (tcp takes its sockets out of its epoll set, where every incoming segment costs
    /// the kernel a callback). Each `Armed` should be disarmed once; a caller that never
    /// disarms only leaves the driver watching. The tokio adapter does it.
    pub fn disarm(&self) {
        let inner = &*self.inner;
        match &inner.virt {
            Some(v) => v.disarm(),
            None => inner.incoming.disarm(),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of processes in the session.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Ranks this channel can reach.
    pub fn peers(&self) -> &[usize] {
        &self.inner.peers
    }

    /// The channel's configuration.
    pub fn config(&self) -> &ChannelConfig {
        &self.inner.config
    }

    /// The real channels of a virtual channel, in order of preference (see [`crate::vchan`]);
    /// empty for a real channel.
    pub fn parts(&self) -> &[Channel] {
        self.inner.virt.as_ref().map_or(&[], |v| &v.parts)
    }

    /// How this channel reaches `rank`: `None` for a rank outside the session or one a real
    /// channel does not reach; [`Route::Direct`](crate::vchan::Route::Direct) through itself
    /// (`part` 0) for a real channel's peers.
    pub fn route(&self, rank: usize) -> Option<crate::vchan::Route> {
        use crate::vchan::Route;
        match &self.inner.virt {
            Some(v) => v.routes.get(rank).copied(),
            None if rank == self.inner.rank => Some(Route::Me),
            None => matches!(self.inner.conns.get(rank), Some(Some(_)))
                .then_some(Route::Direct { part: 0 }),
        }
    }

    /// The channel's TM table (after threshold overrides); a virtual channel's is its first
    /// part's (each part has its own: [`parts`](Self::parts)).
    pub fn tm_table(&self) -> &TmTable {
        &self.inner.table
    }

    /// Where the TM table's thresholds come from: built-in, measured at this open or cached
    /// (`tune=auto`, see [`crate::tune`]), or `tm.<name>=` overrides; with the calibration's
    /// figures.
    pub fn tuning(&self) -> &crate::tune::Tuning {
        &self.inner.tuning
    }

    /// The driver's capabilities.
    pub fn capabilities(&self) -> &Capabilities {
        &self.inner.caps
    }

    /// A snapshot of the channel's counters (summed over its connections).
    pub fn stats(&self) -> ChannelStats {
        if let Some(v) = &self.inner.virt {
            let mut st = ChannelStats::default();
            for p in &v.parts {
                let s = p.stats();
                let driver = &p.inner.config.driver;
                st.messages_sent += s.messages_sent;
                st.bytes_sent += s.bytes_sent;
                st.messages_received += s.messages_received;
                st.bytes_received += s.bytes_received;
                let named = |l: Vec<(String, u64)>| {
                    l.into_iter()
                        .map(move |(n, c)| (format!("{driver}/{n}"), c))
                };
                st.pieces_sent.extend(named(s.pieces_sent));
                st.pieces_received.extend(named(s.pieces_received));
            }
            return st;
        }
        let tms = self.inner.table.tms();
        let (mut sent, mut received) = ([0u64; MAX_TMS], [0u64; MAX_TMS]);
        let mut st = ChannelStats::default();
        for c in self.inner.conns.iter().flatten() {
            st.messages_sent += c.sent.msgs.load(Ordering::Relaxed);
            st.bytes_sent += c.sent.bytes.load(Ordering::Relaxed);
            st.messages_received += c.received.msgs.load(Ordering::Relaxed);
            st.bytes_received += c.received.bytes.load(Ordering::Relaxed);
            for i in 0..MAX_TMS {
                sent[i] += c.sent.pieces[i].load(Ordering::Relaxed);
                received[i] += c.received.pieces[i].load(Ordering::Relaxed);
            }
        }
        let named = |v: &[u64; MAX_TMS]| {
            tms.iter()
                .enumerate()
                .map(|(i, t)| (t.name.to_string(), v[i]))
                .collect()
        };
        st.pieces_sent = named(&sent);
        st.pieces_received = named(&received);
        st
    }

    /// A printable selection table: which TM and BMM serve which sizes and modes (as
    /// `UCX_PROTO_INFO` does for UCX). Printed at open when `MAD_PROTO_INFO=1`.
    pub fn selection_table(&self) -> String {
        match &self.inner.virt {
            Some(v) => {
                let mut out = format!(
                    "virtual channel `{}`: rank {} of {}; routes: {}\n",
                    self.inner.config.name,
                    self.inner.rank,
                    self.inner.size,
                    v.routes
                        .iter()
                        .enumerate()
                        .map(|(r, route)| format!("{r}={route:?}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                );
                for p in &v.parts {
                    out.push_str(&selection_table(&p.inner));
                }
                out
            }
            None => selection_table(&self.inner),
        }
    }
}

pub(crate) fn selection_table(ch: &ChannelInner) -> String {
    format_selection_table(&ch.config, &ch.table, &ch.progress, &ch.notes, &ch.tuning)
}

/// The text of [`Channel::selection_table`] for a channel of `config` whose switch uses
/// `table`, waits by `progress`, whose driver said `notes` at open and whose thresholds come
/// from `tuning`.
pub(crate) fn format_selection_table(
    config: &ChannelConfig,
    t: &TmTable,
    progress: &ProgressPolicy,
    notes: &[String],
    tuning: &crate::tune::Tuning,
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "channel `{}`: driver {}{}, progress {:?}{}, checked mode {}",
        config.name,
        config.driver,
        config
            .adapter
            .as_deref()
            .map(|a| format!(":{a}"))
            .unwrap_or_default(),
        progress.mode,
        if progress.oversubscribed {
            " (oversubscribed host: short spin)"
        } else {
            ""
        },
        if config.checked { "on" } else { "off" }
    );
    tuning.describe(&mut s);
    let _ = writeln!(
        s,
        "  {:<3} {:<10} {:<7} {:>12} {:<8} {:<9} how",
        "tm", "name", "bmm", "max len", "group", "from"
    );
    for (i, tm) in t.tms().iter().enumerate() {
        let max = if tm.max_len == usize::MAX {
            "∞".to_string()
        } else {
            tm.max_len.to_string()
        };
        let grp = if tm.bmm == Bmm::Gather {
            tm.max_group.to_string()
        } else {
            "-".into()
        };
        let from = tuning
            .source(tm.name)
            .unwrap_or(crate::tune::ThresholdSource::BuiltIn);
        let _ = writeln!(
            s,
            "  {:<3} {:<10} {:<7} {:>12} {:<8} {:<9} {}",
            i,
            tm.name,
            format!("{:?}", tm.bmm),
            max,
            grp,
            from.as_str(),
            tm.how
        );
    }
    let sizes: [usize; 10] = [
        0,
        8,
        64,
        512,
        4 << 10,
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        64 << 20,
    ];
    let _ = write!(s, "  {:<17}", "send/recv \\ size");
    for n in sizes {
        let _ = write!(s, " {:>6}", human(n));
    }
    let _ = writeln!(s);
    for sm in SendMode::ALL {
        for rm in RecvMode::ALL {
            let _ = write!(s, "  {:<17}", format!("{sm:?}/{rm:?}"));
            for n in sizes {
                let _ = write!(s, " {:>6}", t.tms()[t.select(n, sm, rm) as usize].name);
            }
            let _ = writeln!(s);
        }
    }
    for n in notes {
        let _ = writeln!(s, "  note: {n}");
    }
    s
}

fn human(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}
