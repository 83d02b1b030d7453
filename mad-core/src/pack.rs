//! The sending side of the engine: `begin_packing`, `pack`, `end_packing`.
//!
//! For each piece the **switch** ([`TmTable::select`](crate::driver::TmTable::select)) picks a
//! transmission module from (length, send mode, receive mode); when the TM changes, the
//! previous one is flushed (**commit**). The piece then goes through the TM's
//! buffer-management module: copied into driver-lent buffers (`Bmm::Copy`, aggregating and
//! splitting) or referenced in a gather group (`Bmm::Gather`).
//!
//! Madeleine's ordering rules, as implemented here (the receiver computes the same):
//! * a LATER piece received CHEAPER is deferred to the *tail* of the message: it is read and
//!   sent at `end_packing`, after every other piece;
//! * a LATER piece received EXPRESS puts the packer in *hold* mode: it and every later piece
//!   are sent in order at `end_packing` (SAFER pieces are copied aside meanwhile);
//! * a gather group ends when the TM changes, after a SAFER piece, after an EXPRESS piece,
//!   when it is full, and at the end.

use std::cell::Cell;
use std::io::IoSlice;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::channel::{ChannelInner, HalfGuard, TxState};
use crate::driver::{AbortOutcome, Bmm, TmId, MAX_TMS};
use crate::error::{Error, PieceDesc, PieceOrEnd, Result};
use crate::lists::{Family, Later, ListSet, Slices, Spare, SpareSet};
use crate::modes::{RecvMode, SendMode};
use crate::wire;

/// A message under construction, to one peer on one channel.
///
/// `'c` borrows the channel; `'b` borrows every piece packed
/// with [`pack`](Packer::pack) (send CHEAPER) or [`pack_later`](Packer::pack_later) (send
/// LATER): the borrow checker keeps that memory untouched, or mutable only through `Cell`,
/// until [`end_packing`](Packer::end_packing) consumes the packer.
///
/// Dropping a packer before `end_packing` abandons the message: if nothing of it had left,
/// it is discarded and the connection stays usable; otherwise the driver breaks the
/// connection so the peer gets an error instead of half a message, and later sends to that
/// peer on this channel return [`Error::Poisoned`].
///
/// ```compile_fail,E0506
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use mad_core::RecvMode;
/// let mut data = vec![1u8; 16];
/// let mut p = ch.begin_packing(1)?;
/// p.pack(&data, RecvMode::Cheaper)?;   // CHEAPER: borrowed until end_packing
/// data[0] = 2;                         // error: cannot assign to `data` while borrowed
/// p.end_packing()?;
/// # Ok(()) }
/// ```
///
/// SAFER holds no borrow past the call:
///
/// ```
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use mad_core::RecvMode;
/// let mut data = vec![1u8; 16];
/// let mut p = ch.begin_packing(1)?;
/// p.pack_safer(&data, RecvMode::Cheaper)?;
/// data[0] = 2;                         // fine: the value 1 was taken
/// p.end_packing()?;
/// # Ok(()) }
/// ```
///
/// LATER data may change before `end_packing`, but only through its cells, never behind the
/// packer's back with a plain write:
///
/// ```compile_fail,E0506
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use std::cell::Cell;
/// use mad_core::RecvMode;
/// let mut buf = [0u8; 4];
/// let cells = Cell::from_mut(&mut buf[..]).as_slice_of_cells();
/// let mut p = ch.begin_packing(1)?;
/// p.pack_later(cells, RecvMode::Cheaper)?;
/// buf[0] = 42;                         // error: `buf` is borrowed by the cells
/// p.end_packing()?;
/// # Ok(()) }
/// ```
///
/// A message of three pieces in three modes, and the unpacker that takes it apart in the same
/// order (two ranks as two threads over the in-process `mem` driver, as in
/// [`Session`](crate::Session)):
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
/// let ch = session.open_channel_with(ChannelConfig::parse("pieces", "mem")?)?;
/// if session.rank() == 0 {
///     let body = vec![7u8; 10_000];
///     let mut p = ch.begin_packing(1)?;
///     p.pack_value(&(body.len() as u64), RecvMode::Express)?; // needed at once to size the buffer
///     p.pack(&body, RecvMode::Cheaper)?;                      // borrowed until end_packing
///     let mut note = *b"v1";
///     p.pack_safer(&note, RecvMode::Cheaper)?;                // copied now
///     note[1] = b'2';                                         // does not change what is sent
///     p.end_packing()?;
/// } else {
///     let mut u = ch.begin_unpacking()?;
///     let n: u64 = u.unpack_value()?;
///     let mut body = vec![0u8; n as usize];
///     let mut note = [0u8; 2];
///     u.unpack(&mut body, SendMode::Cheaper)?;                // filled by end_unpacking
///     u.unpack(&mut note, SendMode::Safer)?;
///     u.end_unpacking()?;
///     assert!(body.iter().all(|&b| b == 7));
///     assert_eq!(&note, b"v1");
/// }
/// # Ok(())
/// # }).unwrap();
/// ```
///
/// LATER reads the value at `end_packing`; changes go through `Cell`:
///
/// ```
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use std::cell::Cell;
/// use mad_core::RecvMode;
/// let mut buf = [0u8; 4];
/// let cells = Cell::from_mut(&mut buf[..]).as_slice_of_cells();
/// let mut p = ch.begin_packing(1)?;
/// p.pack_later(cells, RecvMode::Cheaper)?;
/// cells[0].set(42);                    // sent as 42
/// p.end_packing()?;
/// # Ok(()) }
/// ```
#[must_use = "dropping a Packer abandons its message (call `end_packing`); if part of it had left, the connection is closed"]
pub struct Packer<'c, 'b> {
    st: PackState<'c>,
    /// The message's lists, lent by the connection at their first use (most messages use
    /// none): one pointer, so a packer moved by value is a few words.
    lists: Option<Box<PackLists<'b>>>,
}

/// A packer's gather group, LATER tail and held pieces (see `lists.rs`).
pub(crate) struct PackLists<'b> {
    group: Vec<IoSlice<'b>>,
    tail: Vec<Later<'b>>,
    held: Vec<Held<'b>>,
}

/// The [`ListSet`] of [`PackLists`].
pub(crate) struct PackListSet;
impl Family for PackListSet {
    type At<'b> = PackLists<'b>;
}
impl ListSet for PackListSet {
    fn empty<'b>() -> PackLists<'b> {
        PackLists {
            group: Vec::new(),
            tail: Vec::new(),
            held: Vec::new(),
        }
    }
    fn clear(set: &mut PackLists<'_>) {
        set.group.clear();
        set.tail.clear();
        set.held.clear();
    }
}

/// The channel, the peer and the counts; never the bytes.
impl std::fmt::Debug for Packer<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packer")
            .field("channel", &self.st.ch.config.name)
            .field("to", &self.st.remote)
            .field("pieces", &self.st.tx.spare.msg.index)
            .field("bytes", &self.st.tx.spare.msg.bytes)
            .field("gathered", &self.group().len())
            .field("later", &self.tail().len())
            .field("checked", &self.st.tx.spare.msg.checked)
            .field("finished", &self.st.tx.spare.msg.done)
            .finish_non_exhaustive()
    }
}

/// The lists a connection's sending direction lends to each message (see `lists.rs`).
#[derive(Default)]
pub(crate) struct TxSpare {
    lists: SpareSet<PackListSet>,
    /// A gather group extended by a SAFER piece that is only borrowed for one call.
    tmp: Spare<Slices>,
    /// The steps of a message ended without blocking ([`Packer::poll_end_packing`]).
    plan: TxPlan,
    /// The current message's counts, deadline and room.
    msg: TxMsg,
    /// TM 0 bytes not lent to the driver yet (see [`Staged`]).
    staged: Staged,
}

/// Bytes of TM 0 kept back from the driver: the message header from `begin_packing`, then
/// the frames and short pieces that follow it, until a piece received EXPRESS (which the
/// receiver may need before anything else this sender does), a piece that does not fit, a
/// switch to another TM, a flush or the end lends them all at once. A short message of
/// CHEAPER pieces is thus one lend of the driver (one copy into its ring or buffer), however
/// many pieces it has. The bytes are the message's first bytes on TM 0, so keeping them back
/// changes nothing on the wire.
pub(crate) struct Staged {
    buf: [u8; STAGE_CAP],
    len: usize,
}

/// [`Staged`]'s room: a one-lend message holds this many bytes (header and frames included).
pub(crate) const STAGE_CAP: usize = 4096;
/// After a piece received EXPRESS, a copy longer than this publishes the message so far
/// first ([`Packer::publish_express`]); shorter ones go with it at the next publication.
pub(crate) const EXPRESS_EARLY: usize = 4096;
/// The longest piece staged: longer ones go to the driver with what is staged ahead of them
/// (copied once, not twice), and a receiver takes only messages of pieces this short whole
/// with their header (`RxStaged`).
pub(crate) const STAGE_PIECE: usize = 2048;

impl Default for Staged {
    fn default() -> Self {
        Staged {
            buf: [0; STAGE_CAP],
            len: 0,
        }
    }
}

impl Staged {
    /// Append `frame ‖ data` if they fit and `data` is at most [`STAGE_PIECE`] bytes.
    #[inline(always)]
    fn try_push(&mut self, frame: Option<&[u8; wire::FRAME_LEN]>, data: &[u8]) -> bool {
        let f = if frame.is_some() { wire::FRAME_LEN } else { 0 };
        let at = self.len;
        if data.len() > STAGE_PIECE || at + f + data.len() > STAGE_CAP {
            return false;
        }
        if let Some(fr) = frame {
            self.buf[at..at + wire::FRAME_LEN].copy_from_slice(fr);
        }
        self.buf[at + f..at + f + data.len()].copy_from_slice(data);
        self.len = at + f + data.len();
        true
    }
}

/// What a message counts, its limits and its modes, kept in the connection's sending half
/// (held by the packer) rather than in the `Packer`: a packer is copied whole by every return
/// and every `.await` that hands it over, so the smaller the cheaper, and a narrow store into
/// it that such a copy reads wide stalls the copy (store forwarding).
#[derive(Default)]
struct TxMsg {
    counts: [u32; MAX_TMS],
    /// Bit `tm` set: `counts[tm]` is not 0 (the counters touch only those TMs).
    used: u8,
    bytes: u64,
    /// Every wait of this message gives up at this instant ([`Packer::set_deadline`]).
    deadline: Option<Instant>,
    /// Payload bytes this message may still take: the driver's
    /// [`max_message`](crate::driver::Capabilities::max_message) minus what was packed.
    room: u64,
    /// The TM last handed data and not committed since (the header counts as TM 0 data).
    cur: TmId,
    /// The TM of the pending gather group (meaningful while the group is not empty).
    gtm: TmId,
    holding: bool,
    checked: bool,
    /// Finished (successfully or not): nothing left to abandon.
    done: bool,
    index: u32,
    /// `end_packing`'s code is recording its steps into the connection's plan instead of
    /// running them ([`Packer::poll_end_packing`]).
    recording: bool,
    /// A polled end is running its steps directly, each driver call made once: the first
    /// that is pending switches to `recording` (it and the rest of the end become the plan),
    /// so an end that never waits costs what a blocking one does.
    trying: bool,
    /// The plan of this message's end was recorded.
    planned: bool,
    /// [`Packer::flush_at_end`]: pieces received EXPRESS are not published as they are packed.
    flush_at_end: bool,
    /// Under `flush_at_end`, a piece received EXPRESS was packed and is not published yet:
    /// the driver is asked to publish ([`TxLink::publish`](crate::driver::TxLink::publish))
    /// before a long copy follows, else at the end.
    express_due: bool,
}

/// A memory range a recorded step reads when it runs (see [`TxPlan`]).
#[derive(Clone, Copy)]
struct Raw(*const u8, usize);

// SAFETY: a `Raw` is only read by the thread holding the connection's sending half, while the
// message that recorded it is alive (`TxPlan`'s invariant); it is only an address meanwhile.
#[allow(unsafe_code)]
unsafe impl Send for Raw {}

impl Raw {
    const EMPTY: Raw = Raw(std::ptr::null(), 0);

    fn of(s: &[u8]) -> Raw {
        Raw(s.as_ptr(), s.len())
    }

    /// # Safety
    /// The range must still be alive and unchanged (`TxPlan`'s invariant).
    #[allow(unsafe_code)]
    unsafe fn get<'a>(self) -> &'a [u8] {
        if self.1 == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees the range recorded from a live slice still is one.
        unsafe { std::slice::from_raw_parts(self.0, self.1) }
    }
}

/// One step of a recorded end of message.
#[derive(Clone, Copy)]
enum TxOp {
    /// Copy `head` (a range of the plan's stage: header, frames) then `piece` into lends of `tm`.
    Copy {
        tm: TmId,
        head: (usize, usize),
        piece: Raw,
    },
    /// `TxLink::commit(tm)`.
    Commit(TmId),
    /// `TxLink::send_refs(tm, slices[a..b])`.
    Refs { tm: TmId, a: usize, b: usize },
    /// `TxLink::end_message()`.
    End,
}

/// The rest of a message, as steps, for an end that must not block
/// ([`Packer::poll_end_packing`]). `end_packing`'s own code records it, so the bytes on the
/// wire are the same as a blocking end's; each step is one driver call that the driver
/// resumes ("call again with the same arguments"), and `pos`/`off` say where the plan is.
///
/// Invariant behind every `Raw`: it points into memory that outlives the plan untouched: the
/// user's pieces (borrowed by the packer for `'b`), the SAFER copies in the packer's `held`
/// list (kept until the plan is over), the LATER snapshot in `later` (its capacity reserved
/// before the first byte, so it never moves), and never into `stage` (which may grow).
#[derive(Default)]
pub(crate) struct TxPlan {
    ops: Vec<TxOp>,
    stage: Vec<u8>,
    later: Vec<u8>,
    slices: Vec<Raw>,
    pos: usize,
    off: usize,
}

impl TxPlan {
    fn clear(&mut self) {
        self.ops.clear();
        self.stage.clear();
        self.later.clear();
        self.slices.clear();
        self.pos = 0;
        self.off = 0;
    }

    /// Run steps until one is pending (`Ok(Pending)`) or all are done.
    #[allow(unsafe_code)]
    fn run(&mut self, link: &mut dyn crate::driver::TxLink, rank: usize) -> Result<Poll<()>> {
        while self.pos < self.ops.len() {
            let r = match self.ops[self.pos] {
                TxOp::Copy { tm, head, piece } => {
                    let head = &self.stage[head.0..head.0 + head.1];
                    // SAFETY: `TxPlan`'s invariant.
                    let data = unsafe { piece.get() };
                    let total = head.len() + data.len();
                    loop {
                        let off = self.off;
                        if off == total {
                            break Poll::Ready(());
                        }
                        let mut wrote = 0usize;
                        let r = link.with_buffer(tm, total - off, &mut |buf: &mut [u8]| {
                            wrote = fill_parts(buf, &[head, data], off);
                            wrote
                        })?;
                        if r.is_pending() {
                            break Poll::Pending;
                        }
                        if wrote == 0 {
                            return Err(Error::protocol(
                                rank,
                                "driver lent an empty buffer (driver bug)",
                            ));
                        }
                        self.off += wrote;
                    }
                }
                TxOp::Commit(tm) => link.commit(tm)?,
                TxOp::Refs { tm, a, b } => {
                    let mut iov: smallvec::SmallVec<[IoSlice<'_>; 8]> = Default::default();
                    for r in &self.slices[a..b] {
                        // SAFETY: `TxPlan`'s invariant.
                        iov.push(IoSlice::new(unsafe { r.get() }));
                    }
                    link.send_refs(tm, &iov)?
                }
                TxOp::End => link.end_message()?,
            };
            if r.is_pending() {
                return Ok(Poll::Pending);
            }
            self.pos += 1;
            self.off = 0;
        }
        Ok(Poll::Ready(()))
    }
}

/// `dst.copy_from_slice(src)` (same lengths) for the short copies of a short message's path
/// (its staged bytes, an 8-byte piece): 8 to 64 bytes as two overlapping fixed-size copies,
/// inline, instead of a call to `memcpy`.
#[inline(always)]
pub(crate) fn copy_small(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    let dst = &mut dst[..n];
    if (32..=64).contains(&n) {
        dst[..32].copy_from_slice(&src[..32]);
        dst[n - 32..].copy_from_slice(&src[n - 32..]);
    } else if (16..32).contains(&n) {
        dst[..16].copy_from_slice(&src[..16]);
        dst[n - 16..].copy_from_slice(&src[n - 16..]);
    } else if (8..16).contains(&n) {
        dst[..8].copy_from_slice(&src[..8]);
        dst[n - 8..].copy_from_slice(&src[n - 8..]);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Copy bytes `off..` of the concatenation of `parts` into `buf`; returns how many.
#[inline]
fn fill_parts(buf: &mut [u8], parts: &[&[u8]], mut off: usize) -> usize {
    let mut n = 0;
    for p in parts {
        if off >= p.len() {
            off -= p.len();
            continue;
        }
        let m = (p.len() - off).min(buf.len() - n);
        buf[n..n + m].copy_from_slice(&p[off..off + m]);
        n += m;
        off = 0;
        if n == buf.len() {
            break;
        }
    }
    n
}

pub(crate) enum Held<'b> {
    Cheaper(&'b [u8], RecvMode),
    Safer(Vec<u8>, RecvMode),
    Later(Later<'b>, RecvMode),
    Desc([u8; wire::DESC_LEN]),
}

/// The part of a packer that holds the connection; its `Drop` abandons an unfinished message.
struct PackState<'c> {
    ch: &'c ChannelInner,
    remote: usize,
    tx: HalfGuard<'c, TxState>,
    /// A message of a virtual channel to a rank behind gateways ([`crate::vchan`]): every
    /// piece goes as a descriptor and fragments ([`crate::vchan::fwd`]) to the first gateway.
    fwd: Option<Box<Forwarding<'c>>>,
}

/// The state of a forwarded message ([`PackState::fwd`]).
struct Forwarding<'c> {
    /// The final destination.
    dest: usize,
    /// Set when the destination broke the pair's connection: the message then fails at
    /// its end, though the gateway took it (the destination dropped it).
    broken: &'c std::sync::atomic::AtomicBool,
    /// The envelope, until it goes ahead of the first piece, flush or end (a packer dropped
    /// before leaves nothing behind).
    envelope: Option<[u8; crate::vchan::fwd::ENVELOPE_LEN]>,
    /// The end descriptor was packed.
    ended: bool,
}

/// A piece of a forwarded message, in its send mode.
enum FwdPiece<'a, 'b> {
    Cheaper(&'b [u8]),
    Safer(&'a [u8]),
    Later(Later<'b>),
}

/// View LATER data as bytes for the duration of `end_packing`.
#[allow(unsafe_code)]
mod later {
    use std::cell::Cell;

    /// # Safety
    /// Nobody may write through any `Cell` aliasing `c` while the returned slice is alive. The
    /// engine only calls this inside `end_packing`, which runs no user code; `Cell` is `!Sync`,
    /// so no other thread can hold a reference to these cells.
    pub(super) unsafe fn bytes(c: &[Cell<u8>]) -> &[u8] {
        // SAFETY: `Cell<u8>` has the same layout as `u8` (it is `repr(transparent)`), the
        // pointer and length come from a valid slice, and the caller guarantees no writes
        // happen while the shared byte view is alive.
        unsafe { std::slice::from_raw_parts(c.as_ptr() as *const u8, c.len()) }
    }
}

impl PackState<'_> {
    /// A step of a polled end is pending: fail if the channel closed or the deadline passed,
    /// else arm the readiness descriptor for this send (rung at once when it may progress).
    fn pending(&mut self) -> Result<()> {
        self.ch.check_open()?;
        if let Some(d) = self.tx.spare.msg.deadline {
            if Instant::now() >= d {
                return Err(Error::Timeout(Duration::ZERO));
            }
        }
        if self.tx.link.arm_send()? == crate::driver::Armed::Busy {
            self.ch
                .kicked
                .store(true, std::sync::atomic::Ordering::Release);
            self.ch.incoming.wake();
        }
        Ok(())
    }

    /// Wait for the sending half as the channel's progress policy says, until this message's
    /// deadline, and fail with [`Error::Closed`] once the channel is closed.
    #[inline(always)]
    fn drive<T>(&mut self, attempt: impl FnMut(&mut TxState) -> Result<Poll<T>>) -> Result<T> {
        let ch = self.ch;
        let deadline = self.tx.spare.msg.deadline;
        ch.progress.drive_until(
            &mut *self.tx,
            attempt,
            |tx, t| {
                ch.check_open()?;
                tx.link.wait(t)
            },
            |tx| tx.link.progress_mark(),
            deadline,
        )
    }

    /// While `trying`: make one driver call; `false` when it is pending, and the end is now
    /// recording (the caller records that call, the first step of the plan).
    #[inline]
    fn try_once(&mut self, attempt: impl FnOnce(&mut TxState) -> Result<Poll<()>>) -> Result<bool> {
        match attempt(&mut self.tx)? {
            Poll::Ready(()) => Ok(true),
            Poll::Pending => {
                self.start_recording();
                Ok(false)
            }
        }
    }

    #[cold]
    fn start_recording(&mut self) {
        debug_assert!(self.tx.spare.plan.ops.is_empty());
        self.tx.spare.msg.trying = false;
        self.tx.spare.msg.recording = true;
    }

    #[inline(always)]
    fn commit(&mut self) -> Result<()> {
        let cur = self.tx.spare.msg.cur;
        if self.tx.spare.msg.trying && self.try_once(|tx| tx.link.commit(cur))? {
            return Ok(());
        }
        if self.tx.spare.msg.recording {
            self.tx.spare.plan.ops.push(TxOp::Commit(cur));
            return Ok(());
        }
        self.drive(|tx| tx.link.commit(cur))
    }

    /// The end of every message: what is staged, the commit of the current TM, the end.
    #[inline(always)]
    fn end_tail(&mut self) -> Result<()> {
        self.lend_staged()?;
        self.commit()?;
        if self.tx.spare.msg.trying && self.try_once(|tx| tx.link.end_message())? {
            return Ok(());
        }
        if self.tx.spare.msg.recording {
            self.tx.spare.plan.ops.push(TxOp::End);
            return Ok(());
        }
        self.drive(|tx| tx.link.end_message())
    }

    fn flush_link(&mut self) -> Result<()> {
        self.drive(|tx| tx.link.flush())
    }

    /// Gather BMM: hand `group` to TM `tm`, announced in unchecked mode by a group frame and
    /// a piece frame per slice through TM 0 (committed before the group, so a receiver that
    /// expected something else finds out before it waits for the group).
    ///
    /// `end`: this is the message's last group (sent by `end_packing`), and the end frame goes
    /// with the group's frames, so the end of a message whose last piece is gathered costs no
    /// lend (and on sockets no system call) of its own.
    fn send_group(&mut self, tm: TmId, group: &[IoSlice<'_>], end: Option<u64>) -> Result<()> {
        if !self.tx.spare.msg.checked {
            self.ensure(0)?;
            const BATCH: usize = 16;
            let mut buf = [0u8; wire::FRAME_LEN * (BATCH + 1)];
            let frames = std::iter::once(wire::Frame::Group {
                tm,
                count: group.len() as u64,
                end: end.is_some(),
            })
            .chain(group.iter().map(|s| wire::Frame::Piece {
                tm,
                len: s.len() as u64,
            }))
            .chain(end.map(|pieces| wire::Frame::End { pieces }));
            let mut k = 0;
            for f in frames {
                if k == BATCH + 1 {
                    self.copy_in_local(0, &buf)?;
                    k = 0;
                }
                buf[k * wire::FRAME_LEN..(k + 1) * wire::FRAME_LEN]
                    .copy_from_slice(&wire::encode_frame(f));
                k += 1;
            }
            self.copy_in_local(0, &buf[..k * wire::FRAME_LEN])?;
        }
        self.ensure(tm)?;
        self.lend_staged()?;
        if self.tx.spare.msg.trying && self.try_once(|tx| tx.link.send_refs(tm, group))? {
            return Ok(());
        }
        if self.tx.spare.msg.recording {
            let plan = &mut self.tx.spare.plan;
            let a = plan.slices.len();
            plan.slices.extend(group.iter().map(|s| Raw::of(s)));
            let b = plan.slices.len();
            plan.ops.push(TxOp::Refs { tm, a, b });
            return Ok(());
        }
        self.drive(|tx| tx.link.send_refs(tm, group))
    }

    /// Copy BMM: copy `data` into buffers lent by TM `tm`, preceded by the pending message
    /// header when `tm` is TM 0. Splits across as many lends as the driver makes.
    #[inline]
    fn copy_in(&mut self, tm: TmId, data: &[u8]) -> Result<()> {
        self.copy_in_framed(tm, None, data)
    }

    /// [`copy_in`](Self::copy_in) of bytes that live only for this call (frames, descriptors):
    /// a recorded end stages them in its plan.
    #[inline]
    fn copy_in_local(&mut self, tm: TmId, data: &[u8]) -> Result<()> {
        if self.tx.spare.msg.recording {
            return self.record_copy(tm, None, data, true);
        }
        self.copy_direct(tm, None, data, true)
    }

    /// Recording mode: the copy becomes a step of the plan. `local`: `data` dies with the
    /// call, so it is staged; otherwise it is a piece's memory, which outlives the plan (the
    /// user's, borrowed for `'b`; a SAFER copy in `held`; a LATER snapshot in the plan).
    /// On TM 0, what [`Staged`] kept back goes first.
    #[cold]
    fn record_copy(
        &mut self,
        tm: TmId,
        frame: Option<&[u8; wire::FRAME_LEN]>,
        data: &[u8],
        local: bool,
    ) -> Result<()> {
        let fr: &[u8] = frame.map_or(&[], |f| &f[..]);
        self.push_copy(tm, fr, data, local);
        Ok(())
    }

    /// A plan step copying `staged ‖ frame ‖ data` (the TM 0 bytes kept back, when `tm` is 0,
    /// and `frame` staged in the plan; `data` too when `local`).
    #[cold]
    fn push_copy(&mut self, tm: TmId, frame: &[u8], data: &[u8], local: bool) {
        let TxSpare { plan, staged, .. } = &mut self.tx.spare;
        let h0 = plan.stage.len();
        if tm == 0 {
            plan.stage.extend_from_slice(&staged.buf[..staged.len]);
            staged.len = 0;
        }
        plan.stage.extend_from_slice(frame);
        let mut piece = Raw::EMPTY;
        if local {
            plan.stage.extend_from_slice(data);
        } else {
            piece = Raw::of(data);
        }
        let head = (h0, plan.stage.len() - h0);
        if head.1 + piece.1 > 0 {
            plan.ops.push(TxOp::Copy { tm, head, piece });
        }
    }

    /// [`copy_in`](Self::copy_in) with an unchecked-mode frame before `data` (TM 0 only), so
    /// header, frame and a short piece are one lend.
    #[inline]
    fn copy_in_framed(
        &mut self,
        tm: TmId,
        frame: Option<&[u8; wire::FRAME_LEN]>,
        data: &[u8],
    ) -> Result<()> {
        if self.tx.spare.msg.recording {
            return self.record_copy(tm, frame, data, false);
        }
        self.copy_direct(tm, frame, data, false)
    }

    /// The copy of [`copy_in_framed`](Self::copy_in_framed), made now: kept back in
    /// [`Staged`] when it is short and on TM 0, else lent to the driver after what was kept
    /// back. `local`: `data` dies with the call (staged if a trying end records the rest).
    #[inline]
    fn copy_direct(
        &mut self,
        tm: TmId,
        frame: Option<&[u8; wire::FRAME_LEN]>,
        data: &[u8],
        local: bool,
    ) -> Result<()> {
        if tm == 0 && self.tx.spare.staged.try_push(frame, data) {
            return Ok(());
        }
        if self.tx.spare.msg.express_due && data.len() > EXPRESS_EARLY {
            // The receiver may start on the EXPRESS piece while this long copy runs.
            self.tx.spare.msg.express_due = false;
            self.lend_staged()?;
            self.tx.link.publish()?;
        }
        self.lend_out(tm, frame, data, local, 0)
    }

    /// Lend `staged ‖ frame ‖ data` to TM `tm` (what is staged only when `tm` is 0), as many
    /// lends as the driver makes.
    ///
    /// `from`: bytes of that concatenation lent already (a first lend made by the caller).
    #[inline(never)]
    fn lend_out(
        &mut self,
        tm: TmId,
        frame: Option<&[u8; wire::FRAME_LEN]>,
        data: &[u8],
        local: bool,
        from: usize,
    ) -> Result<()> {
        debug_assert!(tm == 0 || self.tx.spare.staged.len == 0);
        let fr: &[u8] = frame.map_or(&[], |f| &f[..]);
        let staged = if tm == 0 { self.tx.spare.staged.len } else { 0 };
        let total = staged + fr.len() + data.len();
        let mut off = from;
        while off < total {
            let lend = |tx: &mut TxState| -> Result<Poll<usize>> {
                let TxState { link, spare, .. } = tx;
                let parts = [&spare.staged.buf[..staged], fr, data];
                let mut wrote = 0usize;
                let r = link.with_buffer(tm, total - off, &mut |buf: &mut [u8]| {
                    wrote = fill_parts(buf, &parts, off);
                    wrote
                })?;
                Ok(r.map(|()| wrote))
            };
            let n = if self.tx.spare.msg.trying {
                match lend(&mut self.tx)? {
                    Poll::Ready(n) => n,
                    Poll::Pending => {
                        // The rest of this copy is the plan's first step, resumed at `off`.
                        self.start_recording();
                        self.push_copy(tm, fr, data, local);
                        self.tx.spare.plan.off = off;
                        return Ok(());
                    }
                }
            } else {
                self.drive(lend)?
            };
            if n == 0 {
                return Err(Error::protocol(
                    self.ch.rank,
                    "driver lent an empty buffer (driver bug)",
                ));
            }
            off += n;
        }
        if tm == 0 {
            self.tx.spare.staged.len = 0;
        }
        Ok(())
    }

    /// Lend what [`Staged`] kept back (the header, frames, short pieces) now: before leaving
    /// TM 0, before a gather group, at a flush and at the end.
    #[inline]
    fn lend_staged(&mut self) -> Result<()> {
        let n = self.tx.spare.staged.len;
        if n == 0 {
            return Ok(());
        }
        if self.tx.spare.msg.recording {
            return self.record_copy(0, None, &[], true);
        }
        // Usually one lend takes it all; otherwise the general loop goes on from there.
        let TxState { link, spare, .. } = &mut *self.tx;
        let src = &spare.staged.buf[..n];
        let mut wrote = 0usize;
        let r = link.with_buffer(0, n, &mut |buf: &mut [u8]| {
            let m = n.min(buf.len());
            copy_small(&mut buf[..m], &src[..m]);
            wrote = m;
            m
        })?;
        if r.is_pending() {
            if self.tx.spare.msg.trying {
                // This lend is the plan's first step.
                self.start_recording();
                self.push_copy(0, &[], &[], true);
                return Ok(());
            }
            return self.lend_out(0, None, &[], true, 0);
        }
        if wrote == n {
            spare.staged.len = 0;
            return Ok(());
        }
        self.lend_out(0, None, &[], true, wrote)
    }
    /// Make `tm` the TM in use: when it changes, the header goes out if still pending and the
    /// previous TM is committed (the receiver checks out at the same points).
    #[inline]
    fn ensure(&mut self, tm: TmId) -> Result<()> {
        if tm != self.tx.spare.msg.cur {
            self.lend_staged()?;
            self.commit()?;
            self.tx.spare.msg.cur = tm;
        }
        Ok(())
    }

    /// Abandon the message after an error or a drop.
    /// `peer`: the failure came from the peer (it closed, died or reset the connection); the
    /// receiving half then goes on delivering what the peer sent before, until it finds out
    /// itself. Otherwise (the message was abandoned, a local error) a broken connection is
    /// finished in both directions.
    fn fail(&mut self, why: &str, peer: bool) {
        self.tx.spare.msg.done = true;
        if let AbortOutcome::Broken = self.tx.link.abort_message() {
            self.tx.broken = Some(why.to_string());
            if !peer {
                if let Some(Some(c)) = self.ch.conns.get(self.remote) {
                    c.fail(self.ch, self.remote, false, why);
                }
            }
        }
    }
}

impl Drop for PackState<'_> {
    fn drop(&mut self) {
        if !self.tx.spare.msg.done {
            self.fail(
                "a Packer was dropped after part of its message had left; the connection was closed",
                false,
            );
        }
    }
}

impl<'c, 'b> Packer<'c, 'b> {
    #[inline]
    pub(crate) fn start(
        ch: &'c ChannelInner,
        remote: usize,
        deadline: Option<Instant>,
    ) -> Result<Packer<'c, 'b>> {
        if let Some(v) = &ch.virt {
            // A peer some part reaches: that part's own message (its `check_open` covers a
            // closed virtual channel, whose close closes its parts).
            if let Some(p) = v.direct(remote) {
                return Self::start(&p.inner, remote, deadline);
            }
            return Self::start_forwarded(ch, v, remote, deadline);
        }
        let conn = ch.conn(remote)?;
        ch.check_open()?;
        let tx = conn
            .tx
            .lock_until(deadline, &|| ch.check_open())?
            .ok_or_else(|| Error::InUse {
                rank: remote,
                direction: "message to",
            })?;
        Self::started(ch, conn, remote, tx, deadline)
    }

    /// A message of a virtual channel to a rank behind gateways (or an error for a rank it
    /// does not have).
    #[cold]
    fn start_forwarded(
        ch: &'c ChannelInner,
        v: &'c crate::vchan::Virtual,
        remote: usize,
        deadline: Option<Instant>,
    ) -> Result<Packer<'c, 'b>> {
        ch.check_open()?;
        match v.out(remote)? {
            crate::vchan::Out::Direct(p) => Self::start(&p.inner, remote, deadline),
            crate::vchan::Out::Forward {
                transit,
                next,
                envelope,
                broken,
            } => Self::start(&transit.inner, next, deadline)?.forwarded(remote, &envelope, broken),
        }
    }

    /// A message on the sending half `tx` of `conn` (the connection to `remote`), taken by
    /// the caller.
    #[inline]
    pub(crate) fn started(
        ch: &'c ChannelInner,
        conn: &'c crate::channel::Conn,
        remote: usize,
        tx: HalfGuard<'c, TxState>,
        deadline: Option<Instant>,
    ) -> Result<Packer<'c, 'b>> {
        Self::started_on(ch, conn, remote, tx, deadline).map_err(|e| ch.closed_or(e))
    }

    #[inline]
    fn started_on(
        ch: &'c ChannelInner,
        conn: &'c crate::channel::Conn,
        remote: usize,
        mut tx: HalfGuard<'c, TxState>,
        deadline: Option<Instant>,
    ) -> Result<Packer<'c, 'b>> {
        if tx.broken.is_some() || conn.failed.get().is_some() {
            return Err(Self::refused(&tx, conn, remote));
        }
        // A message starts blocking-allowed (an event loop's end says otherwise).
        tx.set_nonblocking(false);
        if let Err(e) = tx.link.begin_message() {
            tx.broken = Some(format!("begin_message failed: {e}"));
            return Err(e);
        }
        let header = wire::encode_header(wire::Header {
            checked: ch.config.checked,
            seq: tx.seq,
        });
        let spare = &mut tx.spare;
        spare.staged.buf[..wire::HEADER_LEN].copy_from_slice(&header);
        spare.staged.len = wire::HEADER_LEN;
        // Field by field, in place: a `TxMsg` built aside and copied in makes the copy's wide
        // loads wait for the narrow stores that built it (a store-forwarding stall).
        let msg = &mut spare.msg;
        msg.counts.fill(0);
        msg.used = 0;
        msg.bytes = 0;
        msg.deadline = deadline;
        msg.room = ch.caps.max_message.unwrap_or(u64::MAX);
        msg.cur = 0;
        msg.gtm = 0;
        msg.holding = false;
        msg.checked = ch.config.checked;
        msg.done = false;
        msg.index = 0;
        msg.recording = false;
        msg.trying = false;
        msg.planned = false;
        msg.flush_at_end = false;
        msg.express_due = false;
        // The connection's lists are lent at their first use (most messages use none).
        Ok(Packer {
            st: PackState {
                ch,
                remote,
                tx,
                fwd: None,
            },
            lists: None,
        })
    }

    /// Why a new message cannot start on this connection (see `started_on`).
    #[cold]
    #[inline(never)]
    fn refused(tx: &TxState, conn: &crate::channel::Conn, remote: usize) -> Error {
        if let Some(cause) = &tx.broken {
            return Error::Poisoned {
                rank: remote,
                cause: cause.as_str().into(),
            };
        }
        match conn.usable(remote) {
            Err(e) => e,
            Ok(()) => Error::protocol(remote, "connection refused without a cause (bug)"),
        }
    }

    /// Give the lists back to the connection for its next message (emptied).
    #[inline]
    fn recycle(&mut self) {
        if let Some(l) = self.lists.take() {
            self.st.tx.spare.lists.restore(l);
        }
    }

    /// The pending gather group.
    #[inline(always)]
    fn group(&self) -> &[IoSlice<'b>] {
        self.lists.as_deref().map_or(&[], |l| &l.group)
    }

    /// The LATER pieces deferred to the tail.
    #[inline(always)]
    fn tail(&self) -> &[Later<'b>] {
        self.lists.as_deref().map_or(&[], |l| &l.tail)
    }

    /// The pieces held until the end.
    #[inline(always)]
    fn held(&self) -> &[Held<'b>] {
        self.lists.as_deref().map_or(&[], |l| &l.held)
    }

    /// The message's lists, lent by the connection at their first use.
    #[inline]
    fn lists_mut(&mut self) -> &mut PackLists<'b> {
        self.st.tx.spare.lists.lend_into(&mut self.lists)
    }

    /// Empty the gather group (sent).
    #[inline]
    fn clear_group(&mut self) {
        if let Some(l) = self.lists.as_deref_mut() {
            l.group.clear();
        }
    }

    /// Count a piece of `len` bytes against the driver's bound on a message
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)): refused, with
    /// nothing sent and the message still open, when it would exceed it.
    #[inline]
    fn admit(&mut self, len: usize) -> Result<()> {
        self.alive()?;
        let len = len as u64;
        let room = &mut self.st.tx.spare.msg.room;
        if len > *room {
            return Err(self.too_large(len));
        }
        *room -= len;
        Ok(())
    }

    #[cold]
    fn too_large(&self, len: u64) -> Error {
        let ch = self.st.ch;
        let max = ch.caps.max_message.unwrap_or(u64::MAX);
        Error::MessageTooLarge {
            channel: ch.config.name.clone(),
            driver: ch.config.driver.clone(),
            rank: self.st.remote,
            len: (max - self.st.tx.spare.msg.room).saturating_add(len),
            max,
        }
    }

    #[inline]
    fn alive(&self) -> Result<()> {
        if self.st.tx.spare.msg.done {
            Err(Error::Protocol {
                rank: self.st.remote,
                what: "this Packer already failed; its message was abandoned".into(),
            })
        } else {
            Ok(())
        }
    }

    /// The success path is one test, inlined into every caller (bindings that pass modes as
    /// values included); failures go through [`Self::failed`].
    #[inline(always)]
    fn check(&mut self, r: Result<()>) -> Result<()> {
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(self.failed(e)),
        }
    }

    #[cold]
    #[inline(never)]
    fn failed(&mut self, e: Error) -> Error {
        let e = self.st.ch.closed_or(e);
        if !self.st.tx.spare.msg.done {
            self.st
                .fail(&format!("pack failed: {e}"), crate::channel::peer_gone(&e));
        }
        e
    }

    /// Send the pending gather group (announced by its frames in unchecked mode).
    #[inline(always)]
    fn flush_group(&mut self) -> Result<()> {
        if self.group().is_empty() {
            return Ok(());
        }
        self.send_pending_group()
    }

    #[inline(never)]
    fn send_pending_group(&mut self) -> Result<()> {
        let tm = self.st.tx.spare.msg.gtm;
        let group = self.lists.as_deref().map_or(&[][..], |l| &l.group);
        self.st.send_group(tm, group, None)?;
        self.clear_group();
        Ok(())
    }

    /// The common case of a short piece, in one place: unchecked, nothing held or gathered,
    /// TM 0 current and chosen by the switch (the piece is no longer than TM 0 takes),
    /// room in [`Staged`]: its frame and bytes are
    /// staged (what the general path below does for it, minus its tests). `false`, with
    /// nothing changed, for anything else.
    #[inline(always)]
    fn stage_short(&mut self, data: &[u8]) -> bool {
        let st = &mut self.st;
        if data.len() > STAGE_PIECE
            || st.tx.spare.msg.checked
            // Deferred: a piece may be staged (that never waits) while none is held before
            // it; it leaves with the end, as held ones do.
            || (st.tx.spare.msg.holding && self.lists.as_deref().is_some_and(|l| !l.held.is_empty()))
            || st.tx.spare.msg.done
            || st.tx.spare.msg.recording
            || st.tx.spare.msg.cur != 0
            || st.fwd.is_some()
            || self.lists.as_deref().is_some_and(|l| !l.group.is_empty())
            || data.len() > st.ch.table.first_tm_max()
        {
            return false;
        }
        let len = data.len() as u64;
        let TxSpare { msg, staged, .. } = &mut st.tx.spare;
        if len > msg.room {
            return false;
        }
        let f = wire::encode_frame(wire::Frame::Piece { tm: 0, len });
        if !staged.try_push(Some(&f), data) {
            return false;
        }
        msg.room -= len;
        msg.counts[0] += 1;
        msg.used |= 1;
        msg.bytes += len;
        st.tx.spare.msg.index = st.tx.spare.msg.index.wrapping_add(1);
        true
    }

    /// After [`stage_short`](Self::stage_short): a piece received EXPRESS is published.
    #[inline(always)]
    fn staged_express(&mut self, r: RecvMode, len: usize) -> Result<()> {
        // Deferred, nothing is published before the end (publishing may wait).
        if r == RecvMode::Express && !self.st.tx.spare.msg.holding {
            let res = self.publish_express(r, len);
            return self.check(res);
        }
        Ok(())
    }

    #[inline]
    fn emit_desc(&mut self, d: &[u8; wire::DESC_LEN]) -> Result<()> {
        self.flush_group()?;
        self.st.ensure(0)?;
        self.st.copy_in_local(0, d)
    }

    #[inline]
    fn account(&mut self, tm: TmId, len: usize) {
        let msg = &mut self.st.tx.spare.msg;
        msg.counts[tm as usize] += 1;
        msg.used |= 1 << tm;
        msg.bytes += len as u64;
    }

    /// A Copy-TM piece: in unchecked mode its frame goes first, through TM 0 (with the piece
    /// itself when TM 0 carries it).
    #[inline(always)]
    fn emit_copy(&mut self, tm: TmId, d: &[u8]) -> Result<()> {
        self.flush_group()?;
        if self.st.tx.spare.msg.checked {
            self.st.ensure(tm)?;
            return self.st.copy_in(tm, d);
        }
        let f = wire::encode_frame(wire::Frame::Piece {
            tm,
            len: d.len() as u64,
        });
        self.st.ensure(0)?;
        if tm == 0 {
            self.st.copy_in_framed(0, Some(&f), d)
        } else {
            self.st.copy_in_local(0, &f)?;
            self.st.ensure(tm)?;
            self.st.copy_in(tm, d)
        }
    }

    #[inline(always)]
    fn emit_ref(&mut self, d: &'b [u8], s: SendMode, r: RecvMode) -> Result<()> {
        let tm = self.st.ch.table.select(d.len(), s, r);
        self.account(tm, d.len());
        match self.st.ch.table.bmm(tm) {
            Bmm::Copy => self.emit_copy(tm, d),
            Bmm::Gather => {
                if !self.group().is_empty() && self.st.tx.spare.msg.gtm != tm {
                    self.flush_group()?;
                }
                self.st.tx.spare.msg.gtm = tm;
                let max = self.st.ch.table.max_group(tm);
                let group = &mut self.lists_mut().group;
                group.push(IoSlice::new(d));
                if r == RecvMode::Express || group.len() >= max {
                    self.flush_group()
                } else {
                    Ok(())
                }
            }
        }
    }

    #[inline]
    fn emit_safer(&mut self, d: &[u8], r: RecvMode) -> Result<()> {
        let tm = self.st.ch.table.select(d.len(), SendMode::Safer, r);
        self.account(tm, d.len());
        match self.st.ch.table.bmm(tm) {
            Bmm::Copy => self.emit_copy(tm, d),
            Bmm::Gather => {
                if !self.group().is_empty() && self.st.tx.spare.msg.gtm != tm {
                    self.flush_group()?;
                }
                // The memory is only ours for this call: send the group now.
                let mut tmp = self.st.tx.spare.tmp.lend();
                tmp.extend_from_slice(self.group());
                tmp.push(IoSlice::new(d));
                let r = self.st.send_group(tm, &tmp, None);
                self.st.tx.spare.tmp.restore(tmp);
                r?;
                self.clear_group();
                Ok(())
            }
        }
    }

    #[inline(always)]
    fn descriptor(&mut self, len: usize, s: SendMode, r: RecvMode) -> Result<()> {
        if self.st.tx.spare.msg.checked {
            let d = wire::encode_desc(PieceOrEnd::Piece(PieceDesc {
                index: self.st.tx.spare.msg.index,
                len: len as u64,
                send: s,
                recv: r,
            }));
            if self.st.tx.spare.msg.holding {
                self.lists_mut().held.push(Held::Desc(d));
            } else {
                self.emit_desc(&d)?;
            }
        }
        self.st.tx.spare.msg.index = self.st.tx.spare.msg.index.wrapping_add(1);
        Ok(())
    }

    #[inline]
    fn pack_cheaper_inner(&mut self, data: &'b [u8], r: RecvMode) -> Result<()> {
        self.alive()?;
        self.descriptor(data.len(), SendMode::Cheaper, r)?;
        if self.st.tx.spare.msg.holding {
            self.lists_mut().held.push(Held::Cheaper(data, r));
            Ok(())
        } else {
            self.emit_ref(data, SendMode::Cheaper, r)?;
            self.publish_express(r, data.len())
        }
    }

    /// After a piece received EXPRESS: the receiver needs it to go on, and may wait for it
    /// before anything else this sender does (a message on another channel included), so
    /// what is staged goes to the driver now and must become visible before `end_packing`
    /// (see [`TxLink::publish`]). Under [`flush_at_end`](Self::flush_at_end) the sender
    /// promised not to wait before the end: the piece goes out with what follows (published
    /// before a copy of more than [`EXPRESS_EARLY`] bytes, else at the end).
    ///
    /// [`TxLink::publish`]: crate::driver::TxLink::publish
    #[inline(always)]
    fn publish_express(&mut self, r: RecvMode, len: usize) -> Result<()> {
        if r == RecvMode::Express && len > 0 {
            if self.st.tx.spare.msg.flush_at_end {
                self.st.tx.spare.msg.express_due = true;
                return Ok(());
            }
            // What is staged (this piece with it) goes to the driver first.
            self.st.lend_staged()?;
            self.st.tx.link.publish()
        } else {
            Ok(())
        }
    }

    #[inline]
    fn pack_safer_inner(&mut self, data: &[u8], r: RecvMode) -> Result<()> {
        self.alive()?;
        self.descriptor(data.len(), SendMode::Safer, r)?;
        if self.st.tx.spare.msg.holding {
            self.lists_mut().held.push(Held::Safer(data.to_vec(), r));
            Ok(())
        } else {
            self.emit_safer(data, r)?;
            self.publish_express(r, data.len())
        }
    }

    #[inline]
    fn pack_later_inner(&mut self, data: Later<'b>, r: RecvMode) -> Result<()> {
        self.alive()?;
        self.descriptor(data.len(), SendMode::Later, r)?;
        match r {
            RecvMode::Cheaper => self.lists_mut().tail.push(data),
            RecvMode::Express => {
                self.st.tx.spare.msg.holding = true;
                self.lists_mut().held.push(Held::Later(data, r));
            }
        }
        Ok(())
    }

    /// The bytes of a LATER piece, read now: inside `end_packing`, a view of the cells; in a
    /// recorded end, a snapshot (its steps run across calls, between which user code runs).
    #[allow(unsafe_code)]
    fn later_bytes(&mut self, l: Later<'b>) -> &'b [u8] {
        let view = match l {
            Later::Cells(c) if !self.st.tx.spare.msg.recording => Some(c),
            _ => None,
        };
        if let Some(c) = view {
            // SAFETY: we are inside end_packing, which runs no user code, and `Cell` is
            // `!Sync`: nobody writes these cells while the byte view is alive.
            unsafe { later::bytes(c) }
        } else {
            let later = &mut self.st.tx.spare.plan.later;
            debug_assert!(later.capacity() - later.len() >= l.len());
            let at = later.len();
            match l {
                Later::Cells(c) => later.extend(c.iter().map(Cell::get)),
                Later::Atomics(a) => later.extend(a.iter().map(|x| x.load(Ordering::Relaxed))),
            }
            let snap = Raw::of(&later[at..]);
            // SAFETY: the snapshot's capacity was reserved before its first byte, so it never
            // moves, and it is cleared only once the message is over (after the group and the
            // steps that reference it are gone): it outlives every use of this slice, which
            // ends with the message.
            unsafe { snap.get() }
        }
    }

    #[inline(always)]
    fn finish_inner(&mut self) -> Result<()> {
        self.alive()?;
        if self.held().is_empty()
            && self.tail().is_empty()
            && self.group().is_empty()
            && !self.st.tx.spare.msg.checked
            && !self.st.tx.spare.msg.recording
            && self.st.tx.spare.msg.cur == 0
        {
            // The common end: the end frame right after what is staged, one lend.
            self.st.tx.spare.msg.holding = false;
            let f = wire::encode_frame(wire::Frame::End {
                pieces: self.st.tx.spare.msg.index as u64,
            });
            if self.st.tx.spare.staged.try_push(None, &f) {
                return self.st.end_tail();
            }
        }
        self.finish_general()
    }

    #[inline(never)]
    fn finish_general(&mut self) -> Result<()> {
        let mut held = std::mem::take(&mut self.lists_mut().held);
        self.st.tx.spare.msg.holding = false;
        // LATER values are read now, when the end begins: into a snapshot (whose capacity is
        // reserved first, so it never moves) for atomics, and for cells in a recorded end.
        let rec = self.st.tx.spare.msg.recording;
        let snap = |l: &Later<'_>| match l {
            Later::Cells(_) if !rec => 0,
            _ => l.len(),
        };
        let need: usize = held
            .iter()
            .map(|h| match h {
                Held::Later(l, _) => snap(l),
                _ => 0,
            })
            .chain(self.tail().iter().map(snap))
            .sum();
        if need > 0 {
            let later = &mut self.st.tx.spare.plan.later;
            if !rec {
                later.clear();
            }
            later.reserve_exact(need);
        }
        for h in &held {
            match h {
                Held::Cheaper(d, r) => self.emit_ref(d, SendMode::Cheaper, *r)?,
                Held::Safer(v, r) => self.emit_safer(v, *r)?,
                Held::Later(l, r) => {
                    let bytes = self.later_bytes(*l);
                    self.emit_ref(bytes, SendMode::Later, *r)?
                }
                Held::Desc(d) => self.emit_desc(d)?,
            }
        }
        if !self.st.tx.spare.msg.recording {
            held.clear();
        } // (a recorded end's steps read the SAFER copies: kept until it is over)
        self.lists_mut().held = held; // (kept for the connection's next message)
        if self.st.tx.spare.msg.checked {
            self.emit_desc(&wire::encode_desc(PieceOrEnd::End {
                pieces: self.st.tx.spare.msg.index,
            }))?;
        }
        for i in 0..self.tail().len() {
            let l = self.tail()[i];
            let bytes = self.later_bytes(l);
            self.emit_ref(bytes, SendMode::Later, RecvMode::Cheaper)?;
        }
        if self.st.tx.spare.msg.checked {
            self.flush_group()?;
        } else {
            // The end frame: a receiver takes the message as complete only once it has read
            // it, so a message abandoned after part of it left is never delivered as whole.
            // It travels with the frames of a last gather group, or alone.
            let pieces = self.st.tx.spare.msg.index as u64;
            if self.group().is_empty() {
                // In the Copy TM of the last piece (right after it: no commit, and on TM 0
                // often the same lend at the receiver), else in TM 0.
                let cur = self.st.tx.spare.msg.cur;
                let tm = if self.st.ch.table.bmm(cur) == Bmm::Copy {
                    cur
                } else {
                    self.st.ensure(0)?;
                    0
                };
                self.st
                    .copy_in_local(tm, &wire::encode_frame(wire::Frame::End { pieces }))?;
            } else {
                let tm = self.st.tx.spare.msg.gtm;
                let group = self.lists.as_deref().map_or(&[][..], |l| &l.group);
                self.st.send_group(tm, group, Some(pieces))?;
                self.clear_group();
            }
        }
        self.st.end_tail()
    }

    /// Every later wait of this message (back-pressure in `pack`, `flush`, `end_packing`)
    /// gives up at `deadline` with [`Error::Timeout`]; `None` removes the limit. A deadline
    /// that expires after part of the message left abandons it, as a dropped packer does
    /// (the connection is then finished in both directions).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.st.tx.spare.msg.deadline = deadline;
    }

    /// The peer this message goes to.
    pub fn remote(&self) -> usize {
        match &self.st.fwd {
            Some(f) => f.dest,
            None => self.st.remote,
        }
    }

    /// Checked mode for this message as `on` says, whatever the channel's (a relayed message
    /// keeps its origin's): before any piece only.
    pub(crate) fn checked_as(mut self, on: bool) -> Self {
        let tx = &mut *self.st.tx;
        if tx.spare.msg.index == 0 && tx.spare.staged.len == wire::HEADER_LEN {
            tx.spare.msg.checked = on;
            let h = wire::encode_header(wire::Header {
                checked: on,
                seq: tx.seq,
            });
            tx.spare.staged.buf[..wire::HEADER_LEN].copy_from_slice(&h);
        }
        self
    }

    /// Make this message (to the first gateway) a forwarded one to `dest`: its first piece is
    /// `envelope`, and every piece packed from now on goes as a descriptor and fragments
    /// ([`crate::vchan::fwd`]).
    pub(crate) fn forwarded(
        mut self,
        dest: usize,
        envelope: &[u8; crate::vchan::fwd::ENVELOPE_LEN],
        broken: &'c std::sync::atomic::AtomicBool,
    ) -> Result<Self> {
        self.st.fwd = Some(Box::new(Forwarding {
            dest,
            broken,
            envelope: Some(*envelope),
            ended: false,
        }));
        Ok(self)
    }

    /// A forwarded message's envelope, ahead of its first piece, flush or end.
    #[cold]
    fn fwd_envelope(&mut self) -> Result<()> {
        let Some(env) = self.st.fwd.as_mut().and_then(|f| f.envelope.take()) else {
            return Ok(());
        };
        let res = self.pack_safer_inner(&env, RecvMode::Express);
        self.check(res)
    }

    /// A piece of a forwarded message: its descriptor, then its bytes in fragments, each
    /// received EXPRESS by the gateway (which forwards it on) and sent in the piece's mode.
    #[cold]
    #[inline(never)]
    fn fwd_piece(&mut self, piece: FwdPiece<'_, 'b>, r: RecvMode) -> Result<()> {
        use crate::vchan::fwd;
        let (len, s) = match &piece {
            FwdPiece::Cheaper(d) => (d.len(), SendMode::Cheaper),
            FwdPiece::Safer(d) => (d.len(), SendMode::Safer),
            FwdPiece::Later(l) => (l.len(), SendMode::Later),
        };
        self.fwd_envelope()?;
        self.admit(fwd::DESC_LEN)?;
        let res = self.pack_safer_inner(&fwd::piece(len, s, r), RecvMode::Express);
        self.check(res)?;
        let e = RecvMode::Express;
        for at in (0..len).step_by(fwd::FRAGMENT) {
            let end = (at + fwd::FRAGMENT).min(len);
            self.admit(end - at)?;
            let res = match &piece {
                FwdPiece::Cheaper(d) => self.pack_cheaper_inner(&d[at..end], e),
                FwdPiece::Safer(d) => self.pack_safer_inner(&d[at..end], e),
                FwdPiece::Later(Later::Cells(c)) => {
                    self.pack_later_inner(Later::Cells(&c[at..end]), e)
                }
                FwdPiece::Later(Later::Atomics(a)) => {
                    self.pack_later_inner(Later::Atomics(&a[at..end]), e)
                }
            };
            self.check(res)?;
        }
        Ok(())
    }

    /// A forwarded message's end descriptor, once, before its end.
    #[cold]
    fn fwd_end(&mut self) -> Result<()> {
        match &mut self.st.fwd {
            Some(f) if !f.ended => f.ended = true,
            _ => return Ok(()),
        }
        self.fwd_envelope()?;
        let res = self.pack_safer_inner(&crate::vchan::fwd::end(), RecvMode::Express);
        self.check(res)
    }

    /// Pack `data` in send mode **CHEAPER** (the default): the library chooses how to send it;
    /// `data` stays borrowed, untouched, until `end_packing`.
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation), except after
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge): the piece would make the
    /// message longer than the channel's driver carries
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)), so it was
    /// refused before any of it was sent, and the message goes on without it.
    #[inline]
    pub fn pack(&mut self, data: &'b [u8], r: RecvMode) -> Result<()> {
        if self.stage_short(data) {
            return self.staged_express(r, data.len());
        }
        self.pack_general(data, r)
    }

    /// [`pack`](Self::pack) of a piece [`stage_short`](Self::stage_short) does not take.
    #[inline(never)]
    fn pack_general(&mut self, data: &'b [u8], r: RecvMode) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_piece(FwdPiece::Cheaper(data), r);
        }
        self.admit(data.len())?;
        let res = self.pack_cheaper_inner(data, r);
        self.check(res)
    }

    /// Pack `data` in send mode **SAFER**: the caller may change or free `data` as soon as this
    /// returns (it is copied or sent before returning).
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation), except after
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge): the piece would make the
    /// message longer than the channel's driver carries
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)), so it was
    /// refused before any of it was sent, and the message goes on without it.
    #[inline]
    pub fn pack_safer(&mut self, data: &[u8], r: RecvMode) -> Result<()> {
        if self.stage_short(data) {
            return self.staged_express(r, data.len());
        }
        self.pack_safer_general(data, r)
    }

    /// [`pack_safer`](Self::pack_safer) of a piece [`stage_short`](Self::stage_short) does
    /// not take.
    #[inline(never)]
    fn pack_safer_general(&mut self, data: &[u8], r: RecvMode) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_piece(FwdPiece::Safer(data), r);
        }
        self.admit(data.len())?;
        let res = self.pack_safer_inner(data, r);
        self.check(res)
    }

    /// Pack `data` in send mode **LATER**: its value is read at `end_packing`, so changes made
    /// through the cells before then are sent. Get cells from a buffer with
    /// `Cell::from_mut(&mut buf[..]).as_slice_of_cells()`.
    ///
    /// Received CHEAPER, the piece travels at the end of the message; received EXPRESS, it and
    /// every piece after it wait for `end_packing` (EXPRESS data must arrive in order).
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation), except after
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge): the piece would make the
    /// message longer than the channel's driver carries
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)), so it was
    /// refused before any of it was sent, and the message goes on without it.
    #[inline]
    pub fn pack_later(&mut self, data: &'b [Cell<u8>], r: RecvMode) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_piece(FwdPiece::Later(Later::Cells(data)), r);
        }
        self.admit(data.len())?;
        let res = self.pack_later_inner(Later::Cells(data), r);
        self.check(res)
    }

    /// [`pack_later`](Self::pack_later) over atomics: the value is read (with relaxed loads)
    /// when the message ends, and the data may be changed from any thread meanwhile, so a
    /// packer holding such pieces may move between threads ([`into_send`](Self::into_send)).
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation), except after
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge): the piece would make the
    /// message longer than the channel's driver carries
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)), so it was
    /// refused before any of it was sent, and the message goes on without it.
    #[inline]
    pub fn pack_later_atomic(&mut self, data: &'b [AtomicU8], r: RecvMode) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_piece(FwdPiece::Later(Later::Atomics(data)), r);
        }
        self.admit(data.len())?;
        let res = self.pack_later_inner(Later::Atomics(data), r);
        self.check(res)
    }

    /// This packer as one that may move between threads (a future of a multi-threaded
    /// runtime): fails with [`Error::BadConfig`] if a LATER piece over cells was packed
    /// (cells are one thread's; use [`pack_later_atomic`](Self::pack_later_atomic)).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`](crate::Error::BadConfig) when a LATER piece over cells was packed; the
    /// packer is dropped then (its message abandoned).
    #[inline]
    pub fn into_send(self) -> Result<SendPacker<'c, 'b>> {
        let cells = self.tail().iter().any(|l| matches!(l, Later::Cells(_)))
            || self
                .held()
                .iter()
                .any(|h| matches!(h, Held::Later(Later::Cells(_), _)));
        if cells {
            return Err(Error::BadConfig(
                "a packer holding LATER pieces over cells cannot move between threads; pack \
                 them with pack_later_atomic"
                    .into(),
            ));
        }
        Ok(SendPacker(self))
    }

    /// Pack a plain value (an integer, a `#[repr(C)]` struct deriving `bytemuck::NoUninit`)
    /// in send mode SAFER, native byte order.
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation), except after
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge): the piece would make the
    /// message longer than the channel's driver carries
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)), so it was
    /// refused before any of it was sent, and the message goes on without it.
    #[inline]
    pub fn pack_value<T: bytemuck::NoUninit>(&mut self, v: &T, r: RecvMode) -> Result<()> {
        self.pack_safer(bytemuck::bytes_of(v), r)
    }

    /// Pack a slice of plain values in send mode CHEAPER (borrowed until `end_packing`).
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation), except after
    /// [`Error::MessageTooLarge`](crate::Error::MessageTooLarge): the piece would make the
    /// message longer than the channel's driver carries
    /// ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)), so it was
    /// refused before any of it was sent, and the message goes on without it.
    #[inline]
    pub fn pack_slice<T: bytemuck::NoUninit>(&mut self, v: &'b [T], r: RecvMode) -> Result<()> {
        self.pack(bytemuck::cast_slice(v), r)
    }

    /// Send everything packed so far now, without ending the message: the receiver can unpack
    /// it before `end_packing` (pieces packed LATER, and pieces held behind a LATER piece
    /// received EXPRESS, still wait for `end_packing`, where their values are read).
    ///
    /// Madeleine's guarantee is on the receiving side (EXPRESS data is there when `unpack`
    /// returns); the bytes of a message reach the receiver at the latest at `end_packing`,
    /// and a driver may keep short pieces in its own buffer until then (one system call per
    /// short message on TCP). A sender that waits for its receiver in the middle of a message
    /// (an acknowledgement of the header before the body, say) must call this first, or both
    /// wait forever.
    ///
    /// ```no_run
    /// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
    /// use mad_core::{RecvMode, SendMode};
    /// let body = vec![0u8; 1 << 20];
    /// let mut p = ch.begin_packing(1)?;
    /// p.pack_value(&(body.len() as u64), RecvMode::Express)?;
    /// p.flush()?; // the receiver reads the size now, allocates, and says go
    /// let mut go = ch.begin_unpacking_from(1)?;
    /// let _ok: u8 = go.unpack_value()?;
    /// go.end_unpacking()?;
    /// p.pack(&body, RecvMode::Cheaper)?;
    /// p.end_packing()
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation).
    pub fn flush(&mut self) -> Result<()> {
        if self.st.fwd.is_some() {
            self.fwd_envelope()?;
            // Every gateway on the way flushes too.
            let res = self.pack_safer_inner(&crate::vchan::fwd::flush(), RecvMode::Express);
            self.check(res)?;
        }
        let res = self.flush_inner();
        self.check(res)
    }

    fn flush_inner(&mut self) -> Result<()> {
        self.alive()?;
        self.flush_group()?;
        self.st.lend_staged()?;
        self.st.flush_link()
    }

    /// Finish the message: LATER values are read now, everything still buffered is sent, and
    /// when this returns every CHEAPER piece's memory is released.
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::Timeout`](crate::Error::Timeout) when the
    /// message's deadline or the channel's operation timeout passes while waiting;
    /// [`Error::Closed`](crate::Error::Closed) once the channel is closed. After an error the
    /// message is abandoned (see the [`Packer`] documentation).
    #[inline]
    pub fn end_packing(mut self) -> Result<()> {
        self.end_here()
    }

    /// [`end_packing`](Self::end_packing) without moving the packer out of where it lives:
    /// for bindings that keep it in memory of their own (the C API's handles).
    ///
    /// # Safety
    /// Nothing but dropping the packer may follow (no other call on it).
    #[doc(hidden)]
    #[allow(unsafe_code)]
    pub unsafe fn end_packing_in_place(&mut self) -> Result<()> {
        self.end_here()
    }

    #[inline(always)]
    fn end_here(&mut self) -> Result<()> {
        if self.st.fwd.is_some() {
            if let Err(e) = self.fwd_end() {
                return Err(self.end_failed(e));
            }
        }
        let r = self.finish_inner();
        match r {
            Ok(()) => {
                self.completed();
                self.delivered()
            }
            Err(e) => Err(self.end_failed(e)),
        }
    }

    /// The outcome of a message that went out whole: `Ok`, unless it was forwarded to a
    /// rank that broke the pair's connection meanwhile (the destination dropped it).
    #[inline]
    fn delivered(&self) -> Result<()> {
        match &self.st.fwd {
            Some(f) if f.broken.load(std::sync::atomic::Ordering::Acquire) => {
                Err(crate::vchan::broken_pair(f.dest))
            }
            _ => Ok(()),
        }
    }

    /// The message went out whole: count it, give the lists back.
    #[inline]
    fn completed(&mut self) {
        self.recycle();
        let st = &mut self.st;
        st.tx.spare.msg.done = true;
        st.tx.seq = st.tx.seq.wrapping_add(1);
        if let Some(Some(c)) = st.ch.conns.get(st.remote) {
            let msg = &st.tx.spare.msg;
            c.sent.add(msg.bytes, &msg.counts, msg.used);
        }
    }

    #[cold]
    fn end_failed(&mut self, e: Error) -> Error {
        let e = self.st.ch.closed_or(e);
        self.recycle();
        if !self.st.tx.spare.msg.done {
            self.st.fail(
                &format!("end_packing failed: {e}"),
                crate::channel::peer_gone(&e),
            );
        }
        e
    }

    /// A promise: this thread packs the rest of this message and ends it without waiting on
    /// anything in between (no other message's send or receive, no peer, no lock another
    /// message's sender holds). Pieces received EXPRESS then go out with what follows them
    /// instead of being published as they are packed: a short message with an EXPRESS
    /// header reaches the receiver in one publication instead of two (on shm, each costs a
    /// cache-line round trip between the cores: 8 B SAFER/EXPRESS one-way 0.50 -> 0.33 µs).
    /// Before a copy of more than 4 KiB the EXPRESS pieces are still published first, so the
    /// receiver works on them meanwhile. Breaking the promise can deadlock (this thread waits
    /// for a receiver that waits for the EXPRESS piece), as waiting for the receiver in the
    /// middle of a message without [`flush`](Self::flush) always could. The C API's
    /// `mad_send` (a whole message in one call) makes it.
    #[inline]
    pub fn flush_at_end(&mut self) {
        self.st.tx.spare.msg.flush_at_end = true;
    }

    /// Event-driven use: every piece packed from now on waits for the end of the message
    /// (SAFER pieces are copied aside, LATER ones read when the end begins), so `pack`,
    /// `pack_safer` and `pack_later` never wait for the network, and the end is driven by
    /// [`poll_end_packing`](Self::poll_end_packing) without blocking. Pieces packed before
    /// were handed to the driver already.
    #[inline]
    pub fn defer(&mut self) {
        self.st.tx.spare.msg.holding = true;
    }

    /// `end_packing` without blocking: `Ready` once the message is out (or failed), `Pending`
    /// under back-pressure. A `Pending` has armed the channel's readiness descriptor for this
    /// send ([`TxLink::arm_send`]; or made it readable at once when the send may progress
    /// already), so an event loop calls again when [`Channel::readiness_fd`] is readable (or,
    /// on a driver without one, after a short back-off). Blocking and polling calls must not
    /// be mixed on one message; after `Ready`, the packer is spent (drop it).
    ///
    /// Dropping the packer while this is pending abandons the message as a dropped packer
    /// does: discarded if nothing of it had left, the connection torn down otherwise.
    ///
    /// [`TxLink::arm_send`]: crate::driver::TxLink::arm_send
    /// [`Channel::readiness_fd`]: crate::Channel::readiness_fd
    pub fn poll_end_packing(&mut self) -> Poll<Result<()>> {
        if let Err(e) = self.alive() {
            return Poll::Ready(Err(e));
        }
        self.st.tx.set_nonblocking(true);
        if self.st.fwd.is_some() {
            if let Err(e) = self.fwd_end() {
                return Poll::Ready(Err(self.end_failed(e)));
            }
        }
        if !self.st.tx.spare.msg.planned {
            self.st.tx.spare.plan.clear();
            // Steps run directly until one is pending; LATER cells (which user code may write
            // between two polls) are read into the plan from the start.
            let cells = self.tail().iter().any(|l| matches!(l, Later::Cells(_)))
                || self
                    .held()
                    .iter()
                    .any(|h| matches!(h, Held::Later(Later::Cells(_), _)));
            if cells {
                self.st.tx.spare.msg.recording = true;
            } else {
                self.st.tx.spare.msg.trying = true;
            }
            let r = self.finish_inner();
            let recorded = self.st.tx.spare.msg.recording;
            self.st.tx.spare.msg.recording = false;
            self.st.tx.spare.msg.trying = false;
            if let Err(e) = r {
                return Poll::Ready(Err(self.end_failed(e)));
            }
            if !recorded {
                // Every step was made: the message is out.
                self.completed();
                return Poll::Ready(self.delivered());
            }
            self.st.tx.spare.msg.planned = true;
        }
        let st = &mut self.st;
        let rank = st.ch.rank;
        let tx: &mut TxState = &mut st.tx;
        let r = tx.spare.plan.run(&mut *tx.link, rank);
        let r = match r {
            Ok(Poll::Ready(())) => {
                self.st.tx.spare.plan.clear();
                self.completed();
                return Poll::Ready(self.delivered());
            }
            Ok(Poll::Pending) => self.st.pending(),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => Poll::Pending,
            Err(e) => Poll::Ready(Err(self.end_failed(e))),
        }
    }
}

/// A [`Packer`] that may move between threads (across the `.await`s of a task on a
/// multi-threaded runtime): one that holds no LATER piece over cells
/// ([`Packer::into_send`]). It offers the packer's calls but `pack_later` over cells (use
/// [`pack_later_atomic`](Self::pack_later_atomic)).
///
/// A plain `Packer` may hold cells, so it stays on its thread:
///
/// ```compile_fail
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// let p = ch.begin_packing(1)?;
/// std::thread::scope(|s| {
///     s.spawn(move || p.end_packing()); // error: `Cell<u8>` cannot be shared between threads
/// });
/// # Ok(()) }
/// ```
///
/// ```
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use mad_core::RecvMode;
/// use std::sync::atomic::{AtomicU8, Ordering};
/// let later = [AtomicU8::new(0)];
/// let mut p = ch.begin_packing(1)?.into_send()?;
/// p.pack_later_atomic(&later, RecvMode::Cheaper)?;
/// later[0].store(42, Ordering::Relaxed); // sent as 42
/// std::thread::scope(|s| s.spawn(move || p.end_packing()).join().unwrap())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "dropping a SendPacker abandons its message (call `end_packing`); if part of it had left, the connection is closed"]
pub struct SendPacker<'c, 'b>(Packer<'c, 'b>);

// SAFETY: the one `!Send` thing a `Packer` may hold is a LATER piece over cells
// (`&[Cell<u8>]`); `Packer::into_send` refuses a packer that holds one, and `SendPacker` offers
// no way to pack one. Everything else in a packer is `Send`: the connection's guard, slices of
// `u8`, atomics, owned copies.
#[allow(unsafe_code)]
unsafe impl Send for SendPacker<'_, '_> {}

impl<'c, 'b> SendPacker<'c, 'b> {
    /// See [`Packer::pack`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    #[inline]
    pub fn pack(&mut self, data: &'b [u8], r: RecvMode) -> Result<()> {
        self.0.pack(data, r)
    }
    /// See [`Packer::pack_safer`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    #[inline]
    pub fn pack_safer(&mut self, data: &[u8], r: RecvMode) -> Result<()> {
        self.0.pack_safer(data, r)
    }
    /// See [`Packer::pack_value`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    #[inline]
    pub fn pack_value<T: bytemuck::NoUninit>(&mut self, v: &T, r: RecvMode) -> Result<()> {
        self.0.pack_value(v, r)
    }
    /// See [`Packer::pack_slice`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    #[inline]
    pub fn pack_slice<T: bytemuck::NoUninit>(&mut self, v: &'b [T], r: RecvMode) -> Result<()> {
        self.0.pack_slice(v, r)
    }
    /// See [`Packer::pack_later_atomic`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    #[inline]
    pub fn pack_later_atomic(&mut self, data: &'b [AtomicU8], r: RecvMode) -> Result<()> {
        self.0.pack_later_atomic(data, r)
    }
    /// See [`Packer::defer`].
    #[inline]
    pub fn defer(&mut self) {
        self.0.defer()
    }
    /// See [`Packer::flush_at_end`].
    #[inline]
    pub fn flush_at_end(&mut self) {
        self.0.flush_at_end()
    }
    /// See [`Packer::flush`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    pub fn flush(&mut self) -> Result<()> {
        self.0.flush()
    }
    /// See [`Packer::set_deadline`].
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.0.set_deadline(deadline)
    }
    /// See [`Packer::remote`].
    pub fn remote(&self) -> usize {
        self.0.remote()
    }
    /// See [`Packer::poll_end_packing`].
    #[inline]
    pub fn poll_end_packing(&mut self) -> Poll<Result<()>> {
        self.0.poll_end_packing()
    }
    /// See [`Packer::end_packing`].
    ///
    /// # Errors
    ///
    /// As [`Packer`]'s method of the same name.
    pub fn end_packing(self) -> Result<()> {
        self.0.end_packing()
    }
}

#[cfg(test)]
mod tests {
    /// The handles stay a few words (their per-message state lives in the connection), so
    /// moving one by value costs a few word copies (see `TxMsg`).
    #[test]
    fn handles_are_a_few_words() {
        let w = std::mem::size_of::<usize>();
        assert!(std::mem::size_of::<super::Packer<'_, '_>>() <= 5 * w);
        assert!(std::mem::size_of::<crate::unpack::Unpacker<'_, '_>>() <= 11 * w);
    }
}
