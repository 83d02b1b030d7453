//! Madeleine on tokio: the blocking calls of a channel as futures.
//!
//! [`AsyncChannel`] wraps a [`Channel`] and registers its readiness descriptor
//! ([`Channel::readiness_fd`]) with tokio's reactor while a task sleeps on it (a registered
//! descriptor is woken by the kernel at every event: for tcp, every segment that arrives,
//! which busy traffic must not pay for). Every future follows the arming protocol of
//! the descriptor: listen for the channel's other tasks, try the non-blocking call, arm, try
//! again while arming says `Busy` (and tell the listeners: the event may be theirs), and
//! await the descriptor or the other tasks only then, so no wake-up is lost (an event one
//! task's arm takes is announced to every task listening, and one that came before a task
//! listened is seen by its try) and an idle task costs no CPU. Under busy traffic a future
//! first retries for the channel's spin budget (`progress=adaptive`: 50 µs by default), because
//! a kernel wake-up costs far more than a message on shared memory: at most 10 µs on its
//! thread, then yielding to the runtime between tries; `progress=block` goes to the descriptor
//! at once, `progress=poll` never sleeps. A future's first poll only tries the call: a
//! message that is there costs no clock read, no spin or arming state and no allocation
//! (the wait's state is allocated when the first try finds nothing), and
//! [`begin_unpacking_from`](AsyncChannel::begin_unpacking_from) spends its microseconds on the
//! thread polling the connection with its receiving half held
//! ([`Channel::try_begin_unpacking_from_spinning`]), as the blocking call does.
//! A driver without a descriptor (MPI: it progresses only inside MPI calls) is polled with a
//! back-off from 20 µs to 1 ms.
//!
//! Messages are built and taken apart as with the blocking API, in the same order, with the
//! same modes; the difference is where waiting happens:
//!
//! * [`AsyncPacker`]: `pack*` never wait (pieces are deferred to the end, SAFER ones copied
//!   aside); [`end_packing`](AsyncPacker::end_packing) is a future. LATER pieces are over
//!   atomics ([`AsyncPacker::pack_later_atomic`]), so a packer may cross the `.await`s of a
//!   task on a multi-threaded runtime.
//! * [`AsyncUnpacker`]: CHEAPER [`unpack`](AsyncUnpacker::unpack) never waits (it is due at the
//!   end); [`unpack_express`](AsyncUnpacker::unpack_express) and
//!   [`end_unpacking`](AsyncUnpacker::end_unpacking) are futures. Between the EXPRESS header
//!   and the CHEAPER body the task may await anything (a lookup, a permit) and allocate the
//!   body's buffer from what the header said.
//!
//! # Cancellation
//!
//! | future | dropped before it is ready |
//! |---|---|
//! | [`AsyncChannel::begin_unpacking`], [`begin_unpacking_from`](AsyncChannel::begin_unpacking_from) | nothing is consumed: the next message stays for the next call (cancel-safe: use them in `tokio::select!`) |
//! | [`AsyncChannel::begin_packing`] | nothing happened (cancel-safe) |
//! | [`AsyncPacker::end_packing`] | the message is abandoned as a dropped packer is: discarded if nothing of it had left, else the connection is torn down both ways |
//! | [`AsyncUnpacker::unpack_express`], [`end_unpacking`](AsyncUnpacker::end_unpacking) | the message is abandoned: the connection is finished both ways (the peer's calls fail) |
//!
//! [`Channel::close`] (or [`AsyncChannel::close`]) makes every pending future of the channel
//! fail with [`Error::Closed`].
//!
//! ```no_run
//! # async fn f(ch: mad_core::Channel) -> mad_core::Result<()> {
//! use mad_core::{RecvMode, SendMode};
//! let ch = mad_tokio::AsyncChannel::new(ch)?;
//! // Send: a size (EXPRESS) and a body (CHEAPER).
//! let body = vec![7u8; 1 << 20];
//! let mut p = ch.begin_packing(1).await?;
//! p.pack_value(&(body.len() as u64), RecvMode::Express)?;
//! p.pack(&body, RecvMode::Cheaper)?;
//! p.end_packing().await?;
//! // Receive: the size first, then a buffer of that size for the body.
//! let mut u = ch.begin_unpacking().await?;
//! let n: u64 = u.unpack_value().await?;
//! let mut buf = vec![0u8; n as usize];
//! u.unpack(&mut buf, SendMode::Cheaper)?;
//! u.end_unpacking().await?;
//! # Ok(()) }
//! ```

use std::future::{poll_fn, Future};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::AtomicU8;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use mad_core::progress::ProgressMode;
use mad_core::{Channel, Error, RecvMode, Result, SendMode, SendPacker, Unpacker};
use tokio::io::unix::AsyncFd;

/// The channel's descriptor as tokio sees it (the channel owns and closes it).
struct ReadyFd(RawFd);

impl AsRawFd for ReadyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

struct Inner {
    // Declared first: deregistered from the reactor before the channel (which owns the
    // descriptor) can go.
    reg: std::sync::Mutex<Registration>,
    /// The channel's readiness descriptor (`None`: the driver has none).
    fd: Option<RawFd>,
    ch: Channel,
    spin: Option<Duration>,
    /// Rung by a task whose arm said `Busy`: the tasks asleep on this channel try again.
    busy: tokio::sync::Notify,
}

/// The descriptor's registration with the reactor, held only while a task sleeps on it: a
/// registered descriptor is woken by the kernel at every event (for tcp, every segment that
/// arrives), which busy traffic, whose futures never sleep, must not pay for.
#[derive(Default)]
struct Registration {
    afd: Option<Arc<AsyncFd<ReadyFd>>>,
    sleepers: usize,
}

/// A task asleep on the descriptor; the last one to leave deregisters it.
struct Sleeper<'a> {
    inner: &'a Inner,
    afd: Option<Arc<AsyncFd<ReadyFd>>>,
}

impl Drop for Sleeper<'_> {
    fn drop(&mut self) {
        let mut r = self.inner.reg.lock().unwrap_or_else(|p| p.into_inner());
        // Under the lock: a registration is gone before another can be made.
        drop(self.afd.take());
        r.sleepers -= 1;
        if r.sleepers == 0 {
            r.afd = None;
        }
    }
}

/// Register `fd` (the channel's readiness descriptor) with the current runtime's reactor.
///
/// # Safety
/// `fd` stays open and unchanged while the registration lives.
unsafe fn register(fd: RawFd) -> Result<AsyncFd<ReadyFd>> {
    // SAFETY: the caller's contract.
    unsafe { AsyncFd::register_with_interest(ReadyFd(fd), tokio::io::Interest::READABLE) }.map_err(
        |e| {
            Error::io(
                "registering the channel's readiness descriptor with tokio",
                e.into_parts().1,
            )
        },
    )
}

impl Inner {
    /// Join the tasks asleep on the descriptor, registering it if this is the first.
    fn sleeper(&self, fd: RawFd) -> Result<Sleeper<'_>> {
        let mut r = self.reg.lock().unwrap_or_else(|p| p.into_inner());
        let afd = match &r.afd {
            Some(a) => a.clone(),
            None => {
                // SAFETY: the descriptor belongs to the channel, which `Inner` holds; every
                // registration is dropped by a `Sleeper` (borrowing `Inner`) or with `Inner`
                // (its `reg` field goes before its `ch`).
                let a = Arc::new(unsafe { register(fd) }?);
                r.afd = Some(a.clone());
                a
            }
        };
        r.sleepers += 1;
        Ok(Sleeper {
            inner: self,
            afd: Some(afd),
        })
    }
}

/// A [`Channel`] whose waits are futures. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct AsyncChannel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AsyncChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Async{:?}", self.inner.ch)
    }
}

/// Disarms the channel when dropped (after a sleep that an `Armed` arm began).
struct Disarm<'a>(&'a Channel);

impl Drop for Disarm<'_> {
    fn drop(&mut self) {
        self.0.disarm();
    }
}

/// Longest a future retries on its thread before it yields to the runtime (the first part of
/// the spin budget).
const SPIN_IN_PLACE: Duration = Duration::from_micros(10);

/// Longest back-off between two polls of a driver without a readiness descriptor.
const MAX_BACKOFF: Duration = Duration::from_millis(1);

impl AsyncChannel {
    /// Wrap `ch`; its readiness descriptor is registered with the current tokio runtime (call
    /// this inside one, with I/O enabled; a channel without a descriptor needs timers too).
    /// One `AsyncChannel` per channel: clone it to share.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the descriptor cannot be registered with the runtime
    /// (not called inside a tokio runtime with I/O enabled);
    /// [`Error::BadConfig`] for a channel without a descriptor on a
    /// runtime without timers.
    pub fn new(ch: Channel) -> Result<AsyncChannel> {
        let fd = match ch.readiness_fd() {
            Some(fd) => {
                let fd = fd.as_raw_fd();
                // Registered only while a task sleeps; once now, so that a runtime without
                // I/O is refused here rather than at the first wait.
                // SAFETY: the channel (owned by the caller, then by `Inner`) keeps the
                // descriptor open; the registration is dropped at once.
                drop(unsafe { register(fd) }?);
                Some(fd)
            }
            None => {
                // Without a descriptor, waits are timed back-offs: the runtime needs timers.
                let timers = std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO)));
                if timers.is_err() {
                    return Err(Error::BadConfig(format!(
                        "channel `{}` has no readiness descriptor, so its futures poll with \
                         timed back-offs: build the tokio runtime with timers (enable_time)",
                        ch.config().name
                    )));
                }
                None
            }
        };
        let spin = match ch.config().progress {
            ProgressMode::Poll => None,
            ProgressMode::Block => Some(Duration::ZERO),
            ProgressMode::Adaptive { spin } => Some(spin),
            // A mode of a later core: no spin, as for `Block`.
            _ => Some(Duration::ZERO),
        };
        Ok(AsyncChannel {
            inner: Arc::new(Inner {
                reg: Default::default(),
                fd,
                ch,
                spin,
                busy: tokio::sync::Notify::new(),
            }),
        })
    }

    /// The channel (for its rank, peers, stats, and blocking calls outside the runtime).
    pub fn channel(&self) -> &Channel {
        &self.inner.ch
    }

    /// [`Channel::close`]: every pending future of this channel fails with [`Error::Closed`].
    pub fn close(&self) {
        self.inner.ch.close()
    }

    /// Drive `f` (a non-blocking call that was just tried and found pending, by
    /// [`FirstTry`]) to completion: retry for the spin budget, yielding to the runtime, then
    /// arm the descriptor, try once more, and sleep on it. The first microseconds are spent
    /// on the thread by `in_place` (given `f` and how long; [`spin_calls`]: `f` in a loop).
    async fn wait<T, F, G>(&self, mut f: F, in_place: G) -> Result<T>
    where
        F: FnMut() -> Poll<Result<T>>,
        G: FnOnce(&mut F, Duration) -> Poll<Result<T>>,
    {
        let inner = &*self.inner;
        let start = Instant::now();
        // A ping-pong's answer takes a few microseconds at most under busy traffic: try
        // without giving the thread away first (a yield to tokio costs an `epoll_wait` of the
        // reactor), for at most `SPIN_IN_PLACE`.
        let spin = inner.spin.map_or(SPIN_IN_PLACE, |s| s.min(SPIN_IN_PLACE));
        if !spin.is_zero() {
            if let Poll::Ready(r) = in_place(&mut f, spin) {
                return r;
            }
        }
        let mut backoff = Duration::from_micros(20);
        loop {
            let spinning = match inner.spin {
                None => true,
                Some(s) => start.elapsed() < s,
            };
            if spinning {
                tokio::task::yield_now().await;
                if let Poll::Ready(r) = f() {
                    return r;
                }
                continue;
            }
            // Listen for the other tasks of this channel before arming: arming drains the
            // descriptor, so an event one task drains may be another's.
            let others = inner.busy.notified();
            tokio::pin!(others);
            others.as_mut().enable();
            // Then try once more: what happened between the last try and listening may have
            // been taken by another task's arm (its `Busy`, and the notice to the listeners,
            // came before this task listened), leaving nothing for this task's arm to see.
            // Listening first, then trying, then arming leaves no such gap (a send waiting for
            // credits of via:soft slept until its operation timeout that way, about one run
            // in a hundred of the kit's in-flight case under load).
            if let Poll::Ready(r) = f() {
                return r;
            }
            // Arm after a try that found nothing: `Busy` says something may have become ready
            // meanwhile (or the try made progress the descriptor cannot show), so try again,
            // and so do the other tasks waiting on this channel (the event may be theirs);
            // after `Armed`, anything that happens makes the descriptor readable.
            if inner.ch.arm()? == mad_core::Armed::Busy {
                inner.busy.notify_waiters();
                tokio::task::yield_now().await;
                if let Poll::Ready(r) = f() {
                    return r;
                }
                continue;
            }
            // Armed: disarmed when this sleep ends, or when the future is dropped during it
            // (the driver may stop watching what only sleepers need: tcp's sockets leave its
            // epoll set, which costs a kernel callback per segment while they are in).
            let _disarm = Disarm(&inner.ch);
            match inner.fd {
                Some(fd) => {
                    let sleeper = inner.sleeper(fd)?;
                    let afd = sleeper.afd.as_deref().expect("set until dropped");
                    tokio::select! {
                        ready = afd.readable() => {
                            let mut ready = ready.map_err(|e| {
                                Error::io("awaiting the channel's readiness descriptor", e)
                            })?;
                            ready.clear_ready();
                        }
                        () = &mut others => {}
                    }
                }
                None => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
            if let Poll::Ready(r) = f() {
                return r;
            }
        }
    }

    /// Start a message to `remote`: waits (without blocking the thread) while another task or
    /// thread sends to `remote` on this channel. Cancel-safe.
    ///
    /// # Errors
    ///
    /// As [`Channel::begin_packing`](mad_core::Channel::begin_packing):
    /// [`Error::BadRank`], [`Error::InUse`],
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable, [`Error::Closed`] once the
    /// channel is closed.
    pub fn begin_packing<'b>(
        &self,
        remote: usize,
    ) -> impl Future<Output = Result<AsyncPacker<'_, 'b>>> + use<'_, 'b> {
        // A lock with wakers: nothing to spin or arm, so no `FirstTry`.
        poll_fn(move |cx| {
            self.inner
                .ch
                .poll_begin_packing(remote, cx)
                .map(|r| self.packer(r?))
        })
    }

    #[inline]
    fn packer<'c, 'b>(&'c self, p: mad_core::Packer<'c, 'b>) -> Result<AsyncPacker<'c, 'b>> {
        let mut p = p.into_send()?;
        p.defer();
        Ok(AsyncPacker { p, ch: self })
    }

    /// A try's result as a poll, the unpacker made in place.
    #[inline]
    fn ready_unpacker<'c, 'b>(
        &'c self,
        r: Result<Option<Unpacker<'c, 'b>>>,
    ) -> Poll<Result<AsyncUnpacker<'c, 'b>>> {
        match r {
            Ok(Some(u)) => Poll::Ready(Ok(self.unpacker(u))),
            Ok(None) => Poll::Pending,
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    #[inline]
    fn unpacker<'c, 'b>(&'c self, mut u: Unpacker<'c, 'b>) -> AsyncUnpacker<'c, 'b> {
        u.defer();
        AsyncUnpacker { u, ch: self }
    }

    /// The next message from any peer. Cancel-safe: dropped before it is ready, it consumes
    /// nothing. Fails with [`Error::Poisoned`] once no peer is left, [`Error::Closed`] once the
    /// channel is closed.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`] once no peer is left; the failure of one
    /// connection is reported by one call; [`Error::Closed`] once the
    /// channel is closed.
    pub fn begin_unpacking<'b>(
        &self,
    ) -> impl Future<Output = Result<AsyncUnpacker<'_, 'b>>> + use<'_, 'b> {
        FirstTry::new(
            self,
            |ch: &mut &AsyncChannel| {
                let ch = *ch;
                ch.ready_unpacker(ch.inner.ch.try_begin_unpacking())
            },
            |ch: &AsyncChannel| async move {
                let u = ch
                    .wait(|| ready_some(ch.inner.ch.try_begin_unpacking()), spin_calls)
                    .await?;
                Ok(ch.unpacker(u))
            },
        )
    }

    /// The next message from `remote`. Cancel-safe.
    ///
    /// # Errors
    ///
    /// As [`Channel::begin_unpacking_from`](mad_core::Channel::begin_unpacking_from):
    /// [`Error::BadRank`],
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable, [`Error::Closed`] once the
    /// channel is closed.
    pub fn begin_unpacking_from<'b>(
        &self,
        remote: usize,
    ) -> impl Future<Output = Result<AsyncUnpacker<'_, 'b>>> + use<'_, 'b> {
        FirstTry::new(
            self,
            move |ch: &mut &AsyncChannel| {
                let ch = *ch;
                ch.ready_unpacker(ch.inner.ch.try_begin_unpacking_from(remote))
            },
            move |ch: &AsyncChannel| async move {
                // Spinning on the connection itself, its receiving half held.
                let u = ch
                    .wait(
                        || ready_some(ch.inner.ch.try_begin_unpacking_from(remote)),
                        |_, spin| {
                            ready_some(ch.inner.ch.try_begin_unpacking_from_spinning(remote, spin))
                        },
                    )
                    .await?;
                Ok(ch.unpacker(u))
            },
        )
    }
}

/// The future of every wait but `begin_packing`'s: its first poll tries the operation once
/// and returns at once when it is ready (no clock read, no spin, arming or readiness state:
/// busy traffic pays nothing more); only an operation found pending moves into the channel's
/// wait ([`AsyncChannel::wait`]), boxed. So the future is the size of its operation (an
/// `.await` copies its future whole, often more than once), not of the wait's state.
struct FirstTry<O, A, M, S> {
    step: Step<O, S>,
    /// The operation, tried without waiting.
    attempt: A,
    /// Makes the wait, which owns the operation from then on.
    slow: Option<M>,
}

enum Step<O, S> {
    Try(O),
    Wait(Pin<Box<S>>),
    Done,
}

impl<O, T, A, M, S> FirstTry<O, A, M, S>
where
    A: FnMut(&mut O) -> Poll<Result<T>>,
    M: FnOnce(O) -> S,
    S: Future<Output = Result<T>>,
{
    #[inline]
    fn new(op: O, attempt: A, slow: M) -> Self {
        FirstTry {
            step: Step::Try(op),
            attempt,
            slow: Some(slow),
        }
    }
}

impl<O, T, A, M, S> Future for FirstTry<O, A, M, S>
where
    O: Unpin,
    A: FnMut(&mut O) -> Poll<Result<T>> + Unpin,
    M: FnOnce(O) -> S + Unpin,
    S: Future<Output = Result<T>>,
{
    type Output = Result<T>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        if let Step::Try(op) = &mut this.step {
            if let Poll::Ready(r) = (this.attempt)(op) {
                this.step = Step::Done;
                return Poll::Ready(r);
            }
            let Step::Try(op) = std::mem::replace(&mut this.step, Step::Done) else {
                unreachable!("matched above")
            };
            let slow = this.slow.take().expect("made once");
            this.step = Step::Wait(Box::pin(slow(op)));
        }
        match &mut this.step {
            Step::Wait(s) => {
                let r = s.as_mut().poll(cx);
                if r.is_ready() {
                    this.step = Step::Done;
                }
                r
            }
            _ => panic!("a madeleine future polled after it completed"),
        }
    }
}

/// A wait's first microseconds for most operations: `f` in a loop, for at most `spin`.
fn spin_calls<T>(f: &mut impl FnMut() -> Poll<Result<T>>, spin: Duration) -> Poll<Result<T>> {
    let start = Instant::now();
    let mut i = 0u32;
    loop {
        std::hint::spin_loop();
        if let Poll::Ready(r) = f() {
            return Poll::Ready(r);
        }
        i += 1;
        if i % 64 == 0 && start.elapsed() >= spin {
            return Poll::Pending;
        }
    }
}

fn ready_some<T>(r: Result<Option<T>>) -> Poll<Result<T>> {
    match r {
        Ok(Some(x)) => Poll::Ready(Ok(x)),
        Ok(None) => Poll::Pending,
        Err(e) => Poll::Ready(Err(e)),
    }
}

/// A message being built; `pack*` never wait, [`end_packing`](Self::end_packing) is a future.
/// `Send`: it may cross `.await`s on a multi-threaded runtime.
#[must_use = "dropping an AsyncPacker abandons its message (await `end_packing`); if part of it had left, the connection is closed"]
pub struct AsyncPacker<'c, 'b> {
    p: SendPacker<'c, 'b>,
    ch: &'c AsyncChannel,
}

impl std::fmt::Debug for AsyncPacker<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AsyncPacker").field(&self.p).finish()
    }
}

impl<'c, 'b> AsyncPacker<'c, 'b> {
    /// CHEAPER: `data` stays borrowed, untouched, until `end_packing`.
    ///
    /// # Errors
    ///
    /// As [`Packer`](mad_core::Packer)'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`] when the
    /// message's deadline or the operation timeout passes;
    /// [`Error::Closed`] once the channel is closed.
    pub fn pack(&mut self, data: &'b [u8], r: RecvMode) -> Result<()> {
        self.p.pack(data, r)
    }
    /// SAFER: `data` is copied now.
    ///
    /// # Errors
    ///
    /// As [`Packer`](mad_core::Packer)'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`] when the
    /// message's deadline or the operation timeout passes;
    /// [`Error::Closed`] once the channel is closed.
    pub fn pack_safer(&mut self, data: &[u8], r: RecvMode) -> Result<()> {
        self.p.pack_safer(data, r)
    }
    /// A plain value, SAFER.
    ///
    /// # Errors
    ///
    /// As [`Packer`](mad_core::Packer)'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`] when the
    /// message's deadline or the operation timeout passes;
    /// [`Error::Closed`] once the channel is closed.
    pub fn pack_value<T: mad_core::bytemuck::NoUninit>(
        &mut self,
        v: &T,
        r: RecvMode,
    ) -> Result<()> {
        self.p.pack_value(v, r)
    }
    /// A slice of plain values, CHEAPER.
    ///
    /// # Errors
    ///
    /// As [`Packer`](mad_core::Packer)'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`] when the
    /// message's deadline or the operation timeout passes;
    /// [`Error::Closed`] once the channel is closed.
    pub fn pack_slice<T: mad_core::bytemuck::NoUninit>(
        &mut self,
        v: &'b [T],
        r: RecvMode,
    ) -> Result<()> {
        self.p.pack_slice(v, r)
    }
    /// LATER over atomics: the value is read when `end_packing` starts.
    ///
    /// # Errors
    ///
    /// As [`Packer`](mad_core::Packer)'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`] when the
    /// message's deadline or the operation timeout passes;
    /// [`Error::Closed`] once the channel is closed.
    pub fn pack_later_atomic(&mut self, data: &'b [AtomicU8], r: RecvMode) -> Result<()> {
        self.p.pack_later_atomic(data, r)
    }
    /// The peer this message goes to.
    pub fn remote(&self) -> usize {
        self.p.remote()
    }
    /// Every later wait of this message gives up at `deadline` ([`Error::Timeout`]).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.p.set_deadline(deadline)
    }
    /// Send the message. Dropped before it is ready, the message is abandoned: discarded if
    /// nothing of it had left, otherwise the connection is torn down in both directions.
    ///
    /// # Errors
    ///
    /// As [`Packer`](mad_core::Packer)'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`] when the
    /// message's deadline or the operation timeout passes;
    /// [`Error::Closed`] once the channel is closed.
    pub fn end_packing(self) -> impl Future<Output = Result<()>> + use<'c, 'b> {
        FirstTry::new(
            self,
            |me: &mut Self| me.p.poll_end_packing(),
            |mut me: Self| async move {
                let ch = me.ch;
                ch.wait(|| me.p.poll_end_packing(), spin_calls).await
            },
        )
    }
}

/// A message being taken apart; CHEAPER `unpack` never waits, EXPRESS unpacks and the end
/// are futures. `Send`.
#[must_use = "dropping an AsyncUnpacker before `end_unpacking` leaves the rest of its message unread and closes the connection from that peer"]
pub struct AsyncUnpacker<'c, 'b> {
    u: Unpacker<'c, 'b>,
    ch: &'c AsyncChannel,
}

impl std::fmt::Debug for AsyncUnpacker<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AsyncUnpacker").field(&self.u).finish()
    }
}

impl<'c, 'b> AsyncUnpacker<'c, 'b> {
    /// The peer this message comes from.
    pub fn remote(&self) -> usize {
        self.u.remote()
    }
    /// CHEAPER: `buf` is filled by `end_unpacking` and stays borrowed until then.
    ///
    /// # Errors
    ///
    /// As [`Unpacker`]'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`]
    /// in checked mode; [`Error::Protocol`] when the peer's bytes break
    /// the protocol; [`Error::Timeout`];
    /// [`Error::Closed`] once the channel is closed.
    pub fn unpack(&mut self, buf: &'b mut [u8], s: SendMode) -> Result<()> {
        self.u.unpack(buf, s)
    }
    /// CHEAPER, a slice of plain values.
    ///
    /// # Errors
    ///
    /// As [`Unpacker`]'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`]
    /// in checked mode; [`Error::Protocol`] when the peer's bytes break
    /// the protocol; [`Error::Timeout`];
    /// [`Error::Closed`] once the channel is closed.
    pub fn unpack_slice<T: mad_core::bytemuck::Pod>(
        &mut self,
        v: &'b mut [T],
        s: SendMode,
    ) -> Result<()> {
        self.u.unpack_slice(v, s)
    }
    /// Every later wait of this message gives up at `deadline` ([`Error::Timeout`]); the
    /// message is then abandoned.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.u.set_deadline(deadline)
    }
    /// EXPRESS: `buf` holds the piece when this is ready. Dropped before it is ready, the
    /// message is abandoned (the connection is finished both ways).
    ///
    /// # Errors
    ///
    /// As [`Unpacker`]'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`]
    /// in checked mode; [`Error::Protocol`] when the peer's bytes break
    /// the protocol; [`Error::Timeout`];
    /// [`Error::Closed`] once the channel is closed.
    pub fn unpack_express<'s, 'x>(
        &'s mut self,
        buf: &'x mut [u8],
        s: SendMode,
    ) -> impl Future<Output = Result<()>> + use<'s, 'x, 'c, 'b> {
        FirstTry::new(
            (self, buf),
            move |(me, buf): &mut (&'s mut Self, &'x mut [u8])| me.u.poll_unpack_express(buf, s),
            move |(me, buf): (&'s mut Self, &'x mut [u8])| async move {
                let ch = me.ch;
                let u = &mut me.u;
                ch.wait(|| u.poll_unpack_express(buf, s), spin_calls).await
            },
        )
    }
    /// A plain value packed with `pack_value(.., RecvMode::Express)`.
    ///
    /// # Errors
    ///
    /// As [`Unpacker`]'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`]
    /// in checked mode; [`Error::Protocol`] when the peer's bytes break
    /// the protocol; [`Error::Timeout`];
    /// [`Error::Closed`] once the channel is closed.
    pub async fn unpack_value<T: mad_core::bytemuck::Pod>(&mut self) -> Result<T> {
        let mut v = T::zeroed();
        self.unpack_express(mad_core::bytemuck::bytes_of_mut(&mut v), SendMode::Safer)
            .await?;
        Ok(v)
    }
    /// Finish the message: every CHEAPER destination is filled when this is ready. Dropped
    /// before it is ready, the message is abandoned (the connection is finished both ways).
    ///
    /// # Errors
    ///
    /// As [`Unpacker`]'s method of the same name:
    /// [`Error::PeerClosed`],
    /// [`Error::ConnectionLost`] or
    /// [`Error::Poisoned`] when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`]
    /// in checked mode; [`Error::Protocol`] when the peer's bytes break
    /// the protocol; [`Error::Timeout`];
    /// [`Error::Closed`] once the channel is closed.
    pub fn end_unpacking(self) -> impl Future<Output = Result<()>> + use<'c, 'b> {
        FirstTry::new(
            self,
            |me: &mut Self| me.u.poll_end_unpacking(),
            |mut me: Self| async move {
                let ch = me.ch;
                ch.wait(|| me.u.poll_end_unpacking(), spin_calls).await
            },
        )
    }
}
