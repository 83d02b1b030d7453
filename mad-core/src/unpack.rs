//! The receiving side of the engine: `begin_unpacking`, `unpack`, `end_unpacking`.
//!
//! Symmetric to [`pack`](crate::pack): the switch runs on each unpack and selects the same
//! sequence of TMs as the sender; **checkout** (dual of commit) flushes the previous TM when
//! it changes. CHEAPER destinations of gather TMs are collected and filled in one scatter
//! receive at checkout; EXPRESS data is in place before `unpack_express` returns.

use std::io::IoSliceMut;
use std::task::Poll;
use std::time::Instant;

use crate::channel::{ChannelInner, HalfGuard, RxState};
use crate::driver::{Bmm, TmId, MAX_TMS};
use crate::error::{Error, PieceDesc, PieceOrEnd, Result};
use crate::lists::{MutSlices, Spare};
use crate::modes::{RecvMode, SendMode};
use crate::rxplan::{frame_mismatch, Framed, RawMut, RxOp, RxPlan};
use crate::wire;

/// A message being received from one peer on one channel.
///
/// `'c` borrows the channel; `'b` borrows every destination given to
/// [`unpack`](Unpacker::unpack) (receive CHEAPER): those buffers are filled at the latest by
/// [`end_unpacking`](Unpacker::end_unpacking), and the borrow checker forbids reading them
/// before:
///
/// ```compile_fail,E0502
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use mad_core::SendMode;
/// let mut buf = vec![0u8; 16];
/// let mut u = ch.begin_unpacking()?;
/// u.unpack(&mut buf, SendMode::Cheaper)?;   // CHEAPER: filled by end_unpacking
/// println!("{}", buf[0]);                   // error: `buf` is still mutably borrowed
/// u.end_unpacking()?;
/// # Ok(()) }
/// ```
///
/// EXPRESS data can be used at once (here, to size the next destination: the paper's Figure 1):
///
/// ```
/// # fn f(ch: &mad_core::Channel) -> mad_core::Result<()> {
/// use mad_core::SendMode;
/// let mut u = ch.begin_unpacking()?;
/// let n: u64 = u.unpack_value()?;      // EXPRESS
/// let mut array = vec![0u8; n as usize];
/// u.unpack(&mut array, SendMode::Cheaper)?;              // CHEAPER
/// u.end_unpacking()?;
/// assert_eq!(array.len() as u64, n);
/// # Ok(()) }
/// ```
///
/// Run for real (two ranks as two threads over the in-process `mem` driver, as in
/// [`Session`](crate::Session)), in checked mode, where every piece carries its description
/// and a receiver that asks for something else is told so ([`ErrorKind::Mismatch`](crate::ErrorKind::Mismatch)):
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
/// use mad_core::{ChannelConfig, ErrorKind, RecvMode, SendMode};
/// let ch = session.open_channel_with(ChannelConfig::parse("checked", "mem,checked=true")?)?;
/// if session.rank() == 0 {
///     let mut p = ch.begin_packing(1)?;
///     p.pack_slice(&[1u32, 2, 3], RecvMode::Cheaper)?;
///     p.pack_value(&7u32, RecvMode::Express)?;
///     p.end_packing()?;
/// } else {
///     let mut u = ch.begin_unpacking()?;
///     let mut v = [0u32; 3];
///     u.unpack_slice(&mut v, SendMode::Cheaper)?;
///     let e = u.unpack_value::<u64>().unwrap_err(); // 8 bytes asked, 4 sent
///     assert_eq!(e.kind(), ErrorKind::Mismatch);
/// }
/// # Ok(())
/// # }).unwrap();
/// ```
///
/// Dropping an unpacker before `end_unpacking`, or an error while unpacking, leaves the rest
/// of the message in the stream: the connection's receiving side is closed and later receives
/// from that peer on this channel return [`Error::Poisoned`].
#[must_use = "dropping an Unpacker before `end_unpacking` leaves the rest of its message unread and closes the connection from that peer"]
pub struct Unpacker<'c, 'b> {
    st: UnpackState<'c>,
    group: Vec<IoSliceMut<'b>>,
    tail: Vec<IoSliceMut<'b>>,
}

/// The state of a forwarded message read directly ([`Unpacker::fwd`]).
struct FwdIn<'c> {
    /// The origin.
    origin: usize,
    /// The transit connection's neighbour (the last gateway).
    via: usize,
    /// Fragments come in the pieces' send modes (from the origin itself), else SAFER.
    from_origin: bool,
    /// Pieces unpacked so far.
    index: u32,
    f: &'c crate::vchan::Forwarder,
    /// Keeps the connection's forwarding thread away until the message ends.
    _claim: crate::vchan::DoorGuard<'c>,
}

/// The channel, the peer and the counts; never the bytes.
impl std::fmt::Debug for Unpacker<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unpacker")
            .field("channel", &self.st.ch.config.name)
            .field("from", &self.st.remote)
            .field("pieces", &self.st.msg_ref().map_or(0, |m| m.index))
            .field(
                "bytes",
                &self.st.rx.as_deref().map_or(0, |rx| rx.spare.msg.bytes),
            )
            .field("gathered", &self.group.len())
            .field("later", &self.tail.len())
            .field("checked", &self.st.msg_ref().is_some_and(|m| m.checked))
            .field("deferred", &self.st.msg_ref().is_some_and(|m| m.recording))
            .field("finished", &self.st.done)
            .finish_non_exhaustive()
    }
}

/// The lists a connection's receiving direction lends to each message (see `lists.rs`).
#[derive(Default)]
pub(crate) struct RxSpare {
    group: Spare<MutSlices>,
    /// A gather group ended by an EXPRESS piece that is only borrowed for one call.
    tmp: Spare<MutSlices>,
    tail: Spare<MutSlices>,
    /// The steps of a deferred message ([`Unpacker::defer`]).
    pub(crate) plan: RxPlan,
    /// A message header read in part by a non-blocking start (the rest had not arrived):
    /// its bytes and how many, for whichever receiver takes the connection next.
    hdr: [u8; wire::HEADER_LEN],
    hdr_fill: usize,
    /// The current message's counts, deadline and pending EXPRESS buffer.
    msg: RxMsg,
    /// The rest of a short message, taken with its header (see [`RxStaged`]).
    staged: RxStaged,
}

/// The rest of a short message (frames and pieces of TM 0 up to its end frame, see
/// [`wire::short_message`]), taken from the driver's lend together with the header when it
/// was all there: the message's unpacks then read it from here, so a short message costs the
/// driver one lend however many pieces it has. Never more than the current message: nothing
/// of the next one is taken, so readiness and any-source receives see the connection as
/// they would without it.
pub(crate) struct RxStaged {
    buf: [u8; crate::pack::STAGE_CAP],
    at: usize,
    len: usize,
}

impl Default for RxStaged {
    fn default() -> Self {
        RxStaged {
            buf: [0; crate::pack::STAGE_CAP],
            at: 0,
            len: 0,
        }
    }
}

impl RxStaged {
    /// Lend what is staged to `take` if this read is of TM 0 (which carries all of it) and
    /// something is left; `false` when the read goes to the driver.
    #[inline(always)]
    fn serve(&mut self, tm: TmId, take: &mut dyn FnMut(&[u8]) -> usize) -> bool {
        if self.at < self.len && tm == 0 {
            let n = take(&self.buf[self.at..self.len]);
            self.at += n.min(self.len - self.at);
            return true;
        }
        false
    }
}

impl RxState {
    /// [`RxLink::with_data`](crate::driver::RxLink::with_data), served from the staged rest of
    /// a short message first.
    #[inline(always)]
    pub(crate) fn lend(
        &mut self,
        tm: TmId,
        want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        if self.spare.staged.serve(tm, take) {
            return Ok(Poll::Ready(()));
        }
        self.link.with_data(tm, want, take)
    }

    /// The recorded steps of a deferred message, run against the link and what is staged.
    pub(crate) fn run_plan(&mut self, remote: usize) -> Result<Poll<()>> {
        let RxState { link, spare, .. } = self;
        let RxSpare { plan, staged, .. } = spare;
        let mut l = StagedLink {
            link: &mut **link,
            staged,
        };
        plan.run(&mut l, remote)
    }
}

/// A link seen through what [`RxStaged`] holds (for the recorded steps, which take a link).
struct StagedLink<'a> {
    link: &'a mut dyn crate::driver::RxLink,
    staged: &'a mut RxStaged,
}

impl crate::driver::RxLink for StagedLink<'_> {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        self.link.poll_message()
    }
    fn with_data(
        &mut self,
        tm: TmId,
        want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        if self.staged.serve(tm, take) {
            return Ok(Poll::Ready(()));
        }
        self.link.with_data(tm, want, take)
    }
    fn recv_refs(&mut self, tm: TmId, iov: &mut [std::io::IoSliceMut<'_>]) -> Result<Poll<()>> {
        self.link.recv_refs(tm, iov)
    }
    fn checkout(&mut self, tm: TmId) -> Result<()> {
        self.link.checkout(tm)
    }
    fn end_message(&mut self) -> Result<()> {
        self.link.end_message()
    }
    fn abort_message(&mut self) {
        self.link.abort_message()
    }
    fn wait(&mut self, timeout: std::time::Duration) -> Result<()> {
        self.link.wait(timeout)
    }
    fn progress_mark(&self) -> u64 {
        self.link.progress_mark()
    }
}

/// From a lend at the start of a message: the header bytes still missing, then, once the
/// header is whole and unchecked, the rest of the message when it is all in this lend and
/// short ([`wire::short_message`]) into `staged`. Returns the bytes taken.
#[inline]
fn take_start(
    src: &[u8],
    hdr: &mut [u8; wire::HEADER_LEN],
    fill: &mut usize,
    staged: &mut RxStaged,
) -> usize {
    let m = if *fill == 0 && src.len() >= wire::HEADER_LEN {
        // (The common case: a fixed-size copy.)
        hdr.copy_from_slice(&src[..wire::HEADER_LEN]);
        wire::HEADER_LEN
    } else {
        let m = (wire::HEADER_LEN - *fill).min(src.len());
        hdr[*fill..*fill + m].copy_from_slice(&src[..m]);
        m
    };
    *fill += m;
    // (Flags 0: unchecked. A header that is not one fails the message, staged or not.)
    if *fill == wire::HEADER_LEN && hdr[3] == 0 {
        let rest = &src[m..];
        if let Some(n) = wire::short_message(rest, crate::pack::STAGE_CAP, crate::pack::STAGE_PIECE)
        {
            crate::pack::copy_small(&mut staged.buf[..n], &rest[..n]);
            staged.at = 0;
            staged.len = n;
            return m + n;
        }
    }
    m
}

/// What a message counts, waits for and its modes, kept in the connection's receiving half
/// (held by the unpacker) rather than in the `Unpacker`: an unpacker is copied whole by every
/// return and every `.await` that hands it over, so the smaller the cheaper, and a narrow
/// store into it that such a copy reads wide stalls the copy (see `TxMsg`).
#[derive(Default)]
struct RxMsg {
    counts: [u32; MAX_TMS],
    /// Bit `tm` set: `counts[tm]` is not 0.
    used: u8,
    bytes: u64,
    /// Every wait of this message gives up at this instant ([`Unpacker::set_deadline`]).
    deadline: Option<Instant>,
    /// Deferred mode: the EXPRESS buffer of a pending `poll_unpack_express` (the steps
    /// recorded for it write there), as (address, length).
    express: Option<(usize, usize)>,
    /// The TM last read from and not checked out since.
    cur: TmId,
    /// The TM of the pending gather group (meaningful while the group is not empty).
    gtm: TmId,
    checked: bool,
    index: u32,
    /// Unchecked mode: the end frame was already taken, right after the last piece in the
    /// same lend (see `copy_out_framed`).
    ended: bool,
    /// Deferred mode: the unpack code records steps into the connection's plan
    /// ([`Unpacker::defer`]).
    recording: bool,
    /// Deferred mode, before anything was recorded: copies run directly, each driver call
    /// made once, and the first that is pending (or any other step) starts `recording`, so a
    /// deferred message whose data is there costs what a blocking one does.
    trying: bool,
    /// Deferred mode: the end of the message was recorded (`poll_end_unpacking`).
    ending: bool,
}

/// The part of an unpacker that holds the connection; its `Drop` poisons the receiving side
/// if the message was not finished.
struct UnpackState<'c> {
    ch: &'c ChannelInner,
    remote: usize,
    rx: Option<HalfGuard<'c, RxState>>,
    /// Finished (successfully or not): nothing left to abandon.
    done: bool,
    /// A message of a virtual channel from a rank behind gateways, read from the transit
    /// connection this unpacker holds ([`crate::vchan`]): every piece comes as a descriptor
    /// and fragments ([`crate::vchan::fwd`]).
    fwd: Option<Box<FwdIn<'c>>>,
}

/// Wait for the receiving half as the channel's progress policy says, until `deadline`, and
/// fail with [`Error::Closed`] once the channel is closed.
#[inline]
fn drive<T>(
    ch: &ChannelInner,
    deadline: Option<Instant>,
    rx: &mut RxState,
    attempt: impl FnMut(&mut RxState) -> Result<Poll<T>>,
) -> Result<T> {
    ch.progress.drive_until(
        rx,
        attempt,
        |rx, t| {
            ch.check_open()?;
            rx.link.wait(t)
        },
        |rx| rx.link.progress_mark(),
        deadline,
    )
}

impl UnpackState<'_> {
    #[inline]
    fn rx(&mut self) -> &mut RxState {
        // The guard is only taken out by `release`, after which the state is never used.
        self.rx
            .as_deref_mut()
            .expect("receive state used after release")
    }

    #[inline]
    fn msg(&mut self) -> &mut RxMsg {
        &mut self.rx().spare.msg
    }

    /// The message's counts and modes while this state holds the connection.
    #[inline]
    fn msg_ref(&self) -> Option<&RxMsg> {
        self.rx.as_deref().map(|rx| &rx.spare.msg)
    }

    /// Mirror of the sender's `ensure`: check out the previous TM when the TM changes.
    #[inline]
    fn ensure(&mut self, tm: TmId) -> Result<()> {
        if tm != self.msg().cur {
            if self.msg().recording {
                // The steps check out when they run.
                self.msg().cur = tm;
                return Ok(());
            }
            let cur = self.msg().cur;
            self.rx().link.checkout(cur)?;
            self.msg().cur = tm;
        }
        Ok(())
    }

    /// Unchecked mode: read the next frame from TM 0 and compare it with what this side
    /// expects there; a difference means the message is being unpacked with other pieces
    /// than it was packed with.
    #[inline]
    fn expect_frame(&mut self, want: wire::Frame) -> Result<()> {
        self.expect_frame_in(0, want)
    }

    /// [`expect_frame`](Self::expect_frame) from TM `tm`'s stream (the end frame travels in
    /// the Copy TM of the message's last piece).
    fn expect_frame_in(&mut self, tm: TmId, want: wire::Frame) -> Result<()> {
        self.copy_out_framed(tm, Some(want), &mut [], false)
    }

    #[cold]
    fn frame_mismatch(&self, got: &[u8; wire::FRAME_LEN], want: wire::Frame) -> Error {
        let index = self.msg_ref().map_or(0, |m| m.index);
        frame_mismatch(self.remote, index, got, want)
    }

    /// Gather BMM: receive a group into `group`. In unchecked mode the sender's group frames
    /// come first, and the receiver follows the sender's groups: a sender may have cut what
    /// this side sees as one group in several (`Packer::flush` sends the group so far), never
    /// the other way, so each sender group announced is received into the next slices, with
    /// its frames checked. `at_end`: this is the message's last group (`end_unpacking`); the
    /// sender's last group carries the end frame. Returns whether the end frame was read.
    fn recv_group(&mut self, tm: TmId, group: &mut [IoSliceMut<'_>], at_end: bool) -> Result<bool> {
        if self.recording_now() {
            let (checked, index) = (self.msg().checked, self.msg().index);
            let plan = &mut self.rx().spare.plan;
            let a = plan.slices.len();
            plan.slices.extend(group.iter_mut().map(|s| RawMut::of(s)));
            let b = plan.slices.len();
            plan.ops.push(if checked {
                RxOp::Refs { tm, a, b }
            } else {
                RxOp::Group {
                    tm,
                    a,
                    b,
                    at_end,
                    index,
                }
            });
            self.msg().cur = tm;
            return Ok(false);
        }
        if self.msg().checked {
            self.ensure(tm)?;
            self.recv_refs(tm, group)?;
            return Ok(false);
        }
        let mut done = 0;
        while done < group.len() {
            self.ensure(0)?;
            let rest = (group.len() - done) as u64;
            let want = wire::Frame::Group {
                tm,
                count: rest,
                end: at_end,
            };
            let mut b = [0u8; wire::FRAME_LEN];
            self.copy_out(0, &mut b)?;
            let (count, end) = match wire::decode_frame(&b) {
                Some(wire::Frame::Group { tm: t, count, end })
                    if t == tm
                        && count >= 1
                        && count <= rest
                        && (!end || (at_end && count == rest)) =>
                {
                    (count as usize, end)
                }
                _ => return Err(self.frame_mismatch(&b, want)),
            };
            for g in &group[done..done + count] {
                self.expect_frame(wire::Frame::Piece {
                    tm,
                    len: g.len() as u64,
                })?;
            }
            if end {
                let pieces = self.msg().index as u64;
                self.expect_frame(wire::Frame::End { pieces })?;
            }
            self.ensure(tm)?;
            self.recv_refs(tm, &mut group[done..done + count])?;
            done += count;
            if end {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn recv_refs(&mut self, tm: TmId, group: &mut [IoSliceMut<'_>]) -> Result<()> {
        let (ch, deadline) = (self.ch, self.msg().deadline);
        drive(ch, deadline, self.rx(), |rx| rx.link.recv_refs(tm, group))
    }

    #[inline]
    fn copy_out(&mut self, tm: TmId, buf: &mut [u8]) -> Result<()> {
        self.copy_out_framed(tm, None, buf, false)
    }

    /// [`copy_out`](Self::copy_out) after reading an unchecked-mode frame and comparing it
    /// with `want`, in the same lends as the data (the mirror of the sender's
    /// `copy_in_framed`): a short piece is one lend. The frame is checked before any data
    /// is taken; a difference means the message is being unpacked with other pieces than it
    /// was packed with.
    ///
    /// `piece`: `buf` is a whole piece of a Copy TM (unchecked mode). It may be the message's
    /// last: the sender then writes the end frame right after it in the same TM, and when it
    /// is in the same lend it is taken now (one lend less per short message; the sender wrote
    /// it only if it had no piece after this one).
    #[inline]
    fn copy_out_framed(
        &mut self,
        tm: TmId,
        want: Option<wire::Frame>,
        buf: &mut [u8],
        piece: bool,
    ) -> Result<()> {
        if self.msg().recording {
            return self.record_copy_out(tm, want, buf, piece);
        }
        self.copy_out_direct(tm, want, buf, piece)
    }

    /// Recording mode: the copy becomes a step of the plan.
    #[cold]
    fn record_copy_out(
        &mut self,
        tm: TmId,
        want: Option<wire::Frame>,
        buf: &mut [u8],
        piece: bool,
    ) -> Result<()> {
        let index = self.msg().index;
        self.rx().spare.plan.ops.push(RxOp::Copy {
            tm,
            want,
            dst: RawMut::of(buf),
            end: piece.then_some(index),
            index,
        });
        self.msg().cur = tm;
        Ok(())
    }

    /// The copy of [`copy_out_framed`](Self::copy_out_framed), made now (waiting as the
    /// progress policy says), or while `trying`, until a driver call is pending: the rest of
    /// the copy is then the first step of the plan, resumed where it stopped.
    #[inline]
    fn copy_out_direct(
        &mut self,
        tm: TmId,
        want: Option<wire::Frame>,
        buf: &mut [u8],
        piece: bool,
    ) -> Result<()> {
        let want_b = want.map(wire::encode_frame);
        let end = piece.then(|| {
            wire::encode_frame(wire::Frame::End {
                pieces: self.msg().index as u64,
            })
        });
        let mut ended = false;
        // Frame bytes still to read (none without a frame), then data.
        let mut framed = Framed {
            fk: if want.is_some() { 0 } else { wire::FRAME_LEN },
            fb: [0; wire::FRAME_LEN],
        };
        let mut bad = false;
        let (ch, deadline, trying) = (self.ch, self.msg().deadline, self.msg().trying);
        let remote = self.remote;
        let rx = self.rx();
        let mut off = 0;
        let mut pending = false;
        let s = &mut rx.spare.staged;
        if tm == 0 && s.at < s.len {
            // The rest of a short message, taken with its header: no driver call, no wait.
            let t = framed.take(&s.buf[s.at..s.len], want_b.as_ref(), buf, end.as_ref());
            s.at += t.used;
            if t.bad {
                let w = want.expect("a frame was expected");
                return Err(self.frame_mismatch(&framed.fb, w));
            }
            ended = t.ended;
            off = t.data;
        }
        while framed.fk < wire::FRAME_LEN || off < buf.len() {
            let rest = &mut buf[off..];
            let want_len = wire::FRAME_LEN - framed.fk + rest.len();
            let mut attempt = |rx: &mut RxState| -> Result<Poll<(usize, usize)>> {
                let (mut took, mut data) = (0usize, 0usize);
                let r = rx.lend(tm, want_len, &mut |src: &[u8]| {
                    let t = framed.take(src, want_b.as_ref(), rest, end.as_ref());
                    bad |= t.bad;
                    ended |= t.ended;
                    took = t.used;
                    data = t.data;
                    t.used
                })?;
                Ok(r.map(|()| (took, data)))
            };
            let (n, d) = if trying {
                match attempt(&mut *rx)? {
                    Poll::Ready(x) => x,
                    Poll::Pending => {
                        pending = true;
                        break;
                    }
                }
            } else {
                drive(ch, deadline, &mut *rx, attempt)?
            };
            if bad {
                let w = want.expect("a frame was expected");
                return Err(self.frame_mismatch(&framed.fb, w));
            }
            if n == 0 {
                return Err(Error::protocol(
                    remote,
                    "driver lent no received bytes (driver bug)",
                ));
            }
            off += d;
        }
        if pending {
            // The rest of this copy is the plan's first step, resumed where it stopped.
            self.start_recording();
            self.record_copy_out(tm, want, buf, piece)?;
            self.rx().spare.plan.resume_at(framed, off);
            return Ok(());
        }
        self.msg().ended |= ended;
        Ok(())
    }

    /// Deferred mode: from now on the unpack code records its steps (the plan starts from the
    /// current TM and end-frame state).
    #[cold]
    fn start_recording(&mut self) {
        let (cur, ended) = (self.msg().cur, self.msg().ended);
        self.rx().spare.plan.reset(cur, ended);
        self.msg().trying = false;
        self.msg().recording = true;
    }

    /// Deferred mode: the steps of any kind but a copy are recorded (a trying unpacker
    /// starts recording first).
    #[inline]
    fn recording_now(&mut self) -> bool {
        if self.msg().trying {
            self.start_recording();
        }
        self.msg().recording
    }

    /// The message header, after what a non-blocking start left in the connection. `block`:
    /// wait for it; otherwise `None` when it has not arrived whole (the part read is kept).
    #[inline]
    fn read_header(&mut self, block: bool) -> Result<Option<[u8; wire::HEADER_LEN]>> {
        let (ch, deadline, remote) = (self.ch, self.msg().deadline, self.remote);
        let rx = self.rx();
        rx.spare.staged.len = 0;
        rx.spare.staged.at = 0;
        let mut attempt = |rx: &mut RxState| -> Result<Poll<usize>> {
            let RxState { link, spare, .. } = rx;
            let (hdr, fill, staged) = (&mut spare.hdr, &mut spare.hdr_fill, &mut spare.staged);
            let mut took = 0;
            let r = link.with_data(0, wire::HEADER_LEN - *fill, &mut |src: &[u8]| {
                took = take_start(src, hdr, fill, staged);
                took
            })?;
            Ok(r.map(|()| took))
        };
        loop {
            let sp = &mut rx.spare;
            if sp.hdr_fill == wire::HEADER_LEN {
                sp.hdr_fill = 0;
                return Ok(Some(sp.hdr));
            }
            let took = if block {
                drive(ch, deadline, rx, &mut attempt)?
            } else {
                match attempt(rx)? {
                    Poll::Ready(n) => n,
                    Poll::Pending => return Ok(None),
                }
            };
            if took == 0 {
                return Err(Error::protocol(
                    remote,
                    "driver lent no received bytes (driver bug)",
                ));
            }
        }
    }

    /// The message cannot be finished: the stream is out of step, so the connection is
    /// finished in both directions (the driver tears it down so the peer learns it too).
    /// `peer`: the failure came from the peer itself (closed, died, reset).
    fn fail(&mut self, why: String, peer: bool) {
        self.done = true;
        if let Some(Some(c)) = self.ch.conns.get(self.remote) {
            c.fail(self.ch, self.remote, peer, why.clone());
        }
        if let Some(rx) = self.rx.as_deref_mut() {
            rx.link.abort_message();
            rx.broken = Some(why);
            rx.reported = true;
        }
        if !peer {
            if let Some(tell) = self.ch.on_break.get() {
                tell(self.remote);
            }
        }
    }

    /// Unlock the connection and tell any-source waiters.
    fn release(&mut self) {
        if self.rx.take().is_some() {
            self.ch.released(self.remote);
        }
    }
}

impl Drop for UnpackState<'_> {
    fn drop(&mut self) {
        if !self.done && self.fwd.is_some() {
            // Dropped in the middle of a forwarded message read directly: the transit
            // connection carries other messages after it, so the rest is read and dropped.
            // (The message's counts and modes move with the connection's receiving half.)
            let mut st = UnpackState {
                ch: self.ch,
                remote: self.remote,
                rx: self.rx.take(),
                done: false,
                fwd: self.fwd.take(),
            };
            if let Some(rx) = st.rx.as_deref_mut() {
                let msg = &mut rx.spare.msg;
                msg.recording = false;
                msg.trying = false;
                msg.ending = false;
            }
            self.done = true;
            let mut u: Unpacker<'_, 'static> = Unpacker {
                st,
                group: Vec::new(),
                tail: Vec::new(),
            };
            u.fwd_abandon(None, false);
            return;
        }
        if !self.done {
            self.fail(
                "an Unpacker was dropped before end_unpacking; the rest of its message was left unread"
                    .into(),
                false,
            );
        }
        self.release();
    }
}

impl<'c, 'b> Unpacker<'c, 'b> {
    #[inline]
    pub(crate) fn start(
        ch: &'c ChannelInner,
        remote: usize,
        rx: HalfGuard<'c, RxState>,
        deadline: Option<Instant>,
    ) -> Result<Unpacker<'c, 'b>> {
        Self::start_with(ch, remote, rx, deadline, true)
            .map(|u| u.expect("a blocking start waits for the whole header"))
    }

    /// Non-blocking start: `None` when the message's header has not arrived whole (the part
    /// read stays with the connection for whoever takes it next).
    pub(crate) fn try_start(
        ch: &'c ChannelInner,
        remote: usize,
        rx: HalfGuard<'c, RxState>,
    ) -> Result<Option<Unpacker<'c, 'b>>> {
        Self::start_with(ch, remote, rx, None, false)
    }

    #[inline]
    fn start_with(
        ch: &'c ChannelInner,
        remote: usize,
        rx: HalfGuard<'c, RxState>,
        deadline: Option<Instant>,
        block: bool,
    ) -> Result<Option<Unpacker<'c, 'b>>> {
        let mut st = UnpackState {
            ch,
            remote,
            rx: Some(rx),
            done: false,
            fwd: None,
        };
        // Field by field, in place (see `Packer::started_on`).
        let msg = st.msg();
        msg.cur = 0;
        msg.gtm = 0;
        msg.checked = false;
        msg.index = 0;
        msg.ended = false;
        msg.recording = false;
        msg.trying = false;
        msg.ending = false;
        msg.counts.fill(0);
        msg.used = 0;
        msg.bytes = 0;
        msg.deadline = deadline;
        msg.express = None;
        // A message starts blocking-allowed (`defer` says otherwise).
        st.rx().set_nonblocking(false);
        let r = st.read_header(block).and_then(|h| {
            let Some(h) = h else { return Ok(None) };
            let expect = st.rx().seq;
            let plain = wire::Header {
                checked: false,
                seq: expect,
            };
            if h == wire::encode_header(plain) {
                // (The common case, tested at once.)
                return Ok(Some(plain));
            }
            let hdr =
                wire::decode_header(&h).map_err(|w| Error::protocol(remote, w.to_string()))?;
            if hdr.seq != expect {
                return Err(Error::protocol(
                    remote,
                    format!(
                        "message sequence number {} where {expect} was expected",
                        hdr.seq
                    ),
                ));
            }
            Ok(Some(hdr))
        });
        match r {
            Ok(Some(hdr)) => {
                st.msg().checked = hdr.checked;
                // The connection's lists are lent at their first use (see `recycle`).
                Ok(Some(Unpacker {
                    st,
                    group: Vec::new(),
                    tail: Vec::new(),
                }))
            }
            Ok(None) => {
                // Nothing failed: the connection keeps the part of the header read.
                st.done = true;
                st.release();
                Ok(None)
            }
            Err(e) => {
                st.fail(
                    format!("bad message start: {e}"),
                    crate::channel::peer_gone(&e),
                );
                Err(e)
            }
        }
    }

    #[inline]
    fn alive(&self) -> Result<()> {
        if self.st.done {
            Err(Error::Protocol {
                rank: self.st.remote,
                what: "this Unpacker already failed; its message was abandoned".into(),
            })
        } else {
            Ok(())
        }
    }

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
        if !self.st.done {
            self.st
                .fail(format!("unpack failed: {e}"), crate::channel::peer_gone(&e));
            self.recycle();
            self.st.release();
        }
        e
    }

    /// The common case of a short piece, in one place: unchecked, nothing gathered, TM 0
    /// current and chosen by the switch (the piece is no longer than TM 0 takes), and its
    /// frame, as expected, and bytes in what was taken with the header ([`RxStaged`]): the
    /// piece is copied from there, and the end frame after it taken when it is next (what
    /// the general path below does for it, minus its tests). `false`, with nothing
    /// changed, for anything else (a frame that differs included: the general path reports
    /// it).
    #[inline(always)]
    fn take_short(&mut self, buf: &mut [u8]) -> bool {
        let st = &mut self.st;
        let len = buf.len();
        if st.done || st.fwd.is_some() || !self.group.is_empty() || len > st.ch.table.first_tm_max()
        {
            return false;
        }
        let Some(rx) = st.rx.as_deref_mut() else {
            return false;
        };
        let RxSpare { msg, staged, .. } = &mut rx.spare;
        if msg.checked || msg.recording || msg.cur != 0 {
            return false;
        }
        let (at, end) = (staged.at, staged.len);
        if end - at < wire::FRAME_LEN + len
            || staged.buf[at..at + wire::FRAME_LEN]
                != wire::encode_frame(wire::Frame::Piece {
                    tm: 0,
                    len: len as u64,
                })
        {
            return false;
        }
        let data = at + wire::FRAME_LEN;
        crate::pack::copy_small(buf, &staged.buf[data..data + len]);
        let mut next = data + len;
        msg.index = msg.index.wrapping_add(1);
        if end - next >= wire::FRAME_LEN
            && staged.buf[next..next + wire::FRAME_LEN]
                == wire::encode_frame(wire::Frame::End {
                    pieces: msg.index as u64,
                })
        {
            next += wire::FRAME_LEN;
            msg.ended = true;
        }
        staged.at = next;
        msg.counts[0] += 1;
        msg.used |= 1;
        msg.bytes += len as u64;
        true
    }

    #[inline(always)]
    fn flush_group(&mut self) -> Result<()> {
        if self.group.is_empty() {
            return Ok(());
        }
        self.recv_pending_group()
    }

    #[inline(never)]
    fn recv_pending_group(&mut self) -> Result<()> {
        let tm = self.st.msg().gtm;
        self.st.recv_group(tm, &mut self.group, false)?;
        self.group.clear();
        Ok(())
    }

    /// A Copy-TM piece: in unchecked mode its frame is read first, from TM 0.
    #[inline]
    fn recv_copy(&mut self, tm: TmId, buf: &mut [u8]) -> Result<()> {
        self.flush_group()?;
        if self.st.msg().checked {
            self.st.ensure(tm)?;
            return self.st.copy_out(tm, buf);
        }
        let f = wire::Frame::Piece {
            tm,
            len: buf.len() as u64,
        };
        self.st.ensure(0)?;
        if tm == 0 {
            self.st.copy_out_framed(0, Some(f), buf, true)
        } else {
            self.st.expect_frame(f)?;
            self.st.ensure(tm)?;
            self.st.copy_out_framed(tm, None, buf, true)
        }
    }

    fn read_desc(&mut self) -> Result<PieceOrEnd> {
        self.flush_group()?;
        self.st.ensure(0)?;
        let mut b = [0u8; wire::DESC_LEN];
        self.st.copy_out(0, &mut b)?;
        wire::decode_desc(&b).map_err(|w| Error::protocol(self.st.remote, w.to_string()))
    }

    #[inline]
    fn descriptor(&mut self, len: usize, s: SendMode, r: RecvMode) -> Result<()> {
        if self.st.msg().checked {
            let expected = PieceOrEnd::Piece(PieceDesc {
                index: self.st.msg().index,
                len: len as u64,
                send: s,
                recv: r,
            });
            self.check_desc(expected)?;
        }
        self.st.msg().index = self.st.msg().index.wrapping_add(1);
        Ok(())
    }

    /// Checked mode: the sender's next descriptor must be `expected`.
    fn check_desc(&mut self, expected: PieceOrEnd) -> Result<()> {
        if self.st.recording_now() {
            self.flush_group()?;
            self.st.ensure(0)?;
            self.st.rx().spare.plan.ops.push(RxOp::Desc { expected });
            return Ok(());
        }
        let sent = self.read_desc()?;
        if sent != expected {
            return Err(Error::UnpackMismatch {
                rank: self.st.remote,
                sent,
                expected,
            });
        }
        Ok(())
    }

    #[inline]
    fn account(&mut self, tm: TmId, len: usize) {
        let msg = self.st.msg();
        msg.counts[tm as usize] += 1;
        msg.used |= 1 << tm;
        msg.bytes += len as u64;
    }

    #[inline]
    fn recv_ref(&mut self, mut buf: IoSliceMut<'b>, s: SendMode) -> Result<()> {
        let tm = self.st.ch.table.select(buf.len(), s, RecvMode::Cheaper);
        self.account(tm, buf.len());
        match self.st.ch.table.bmm(tm) {
            Bmm::Copy => self.recv_copy(tm, &mut buf),
            Bmm::Gather => {
                if !self.group.is_empty() && self.st.msg().gtm != tm {
                    self.flush_group()?;
                }
                self.st.msg().gtm = tm;
                self.st.rx().spare.group.lend_into(&mut self.group);
                self.group.push(buf);
                if s == SendMode::Safer || self.group.len() >= self.st.ch.table.max_group(tm) {
                    self.flush_group()
                } else {
                    Ok(())
                }
            }
        }
    }

    #[inline]
    fn recv_express(&mut self, buf: &mut [u8], s: SendMode) -> Result<()> {
        let tm = self.st.ch.table.select(buf.len(), s, RecvMode::Express);
        self.account(tm, buf.len());
        match self.st.ch.table.bmm(tm) {
            Bmm::Copy => self.recv_copy(tm, buf),
            Bmm::Gather => {
                if !self.group.is_empty() && self.st.msg().gtm != tm {
                    self.flush_group()?;
                }
                // The group ends with this piece (the sender flushed it after an EXPRESS piece).
                let mut tmp = self.st.rx().spare.tmp.lend();
                // Not `append`: `tmp` borrows for this call only, a shorter lifetime than the group's.
                #[allow(clippy::extend_with_drain)]
                tmp.extend(self.group.drain(..));
                tmp.push(IoSliceMut::new(buf));
                let r = self.st.recv_group(tm, &mut tmp, false).map(drop);
                self.st.rx().spare.tmp.restore(tmp);
                r
            }
        }
    }

    fn unpack_inner(&mut self, buf: &'b mut [u8], s: SendMode) -> Result<()> {
        self.alive()?;
        self.descriptor(buf.len(), s, RecvMode::Cheaper)?;
        if s == SendMode::Later {
            self.st.rx().spare.tail.lend_into(&mut self.tail);
            self.tail.push(IoSliceMut::new(buf));
            Ok(())
        } else {
            self.recv_ref(IoSliceMut::new(buf), s)
        }
    }

    fn unpack_express_inner(&mut self, buf: &mut [u8], s: SendMode) -> Result<()> {
        self.alive()?;
        self.descriptor(buf.len(), s, RecvMode::Express)?;
        self.recv_express(buf, s)
    }

    #[inline(always)]
    fn finish_inner(&mut self) -> Result<()> {
        self.alive()?;
        if self.st.msg().ended
            && !self.st.msg().checked
            && !self.st.msg().recording
            && self.tail.is_empty()
            && self.group.is_empty()
        {
            // The common end: the end frame came with the last piece.
            let cur = self.st.msg().cur;
            let rx = self.st.rx();
            rx.link.checkout(cur)?;
            return rx.link.end_message();
        }
        self.finish_general()
    }

    #[inline(never)]
    fn finish_general(&mut self) -> Result<()> {
        // No flush here: the sender's last gather group may continue with tail pieces.
        if self.st.msg().checked {
            let pieces = self.st.msg().index;
            self.check_desc(PieceOrEnd::End { pieces })?;
        }
        if !self.tail.is_empty() {
            let mut tail = std::mem::take(&mut self.tail);
            for b in tail.drain(..) {
                self.recv_ref(b, SendMode::Later)?;
            }
            self.tail = tail; // (kept for the connection's next message)
        }
        if self.st.msg().checked {
            self.flush_group()?;
        } else {
            // Only a message whose end frame arrived is complete (see `pack.rs`); it comes
            // with the frames of a last gather group, or alone.
            let mut ended = false;
            if !self.group.is_empty() {
                let tm = self.st.msg().gtm;
                ended = self.st.recv_group(tm, &mut self.group, true)?;
                self.group.clear();
            }
            if self.st.msg().recording {
                // Whether the end frame came already is known when the steps run.
                let cur = self.st.msg().cur;
                let tm = if self.st.ch.table.bmm(cur) == Bmm::Copy {
                    cur
                } else {
                    0
                };
                let pieces = self.st.msg().index;
                self.st
                    .rx()
                    .spare
                    .plan
                    .ops
                    .push(RxOp::EndFrame { tm, pieces });
            } else if !ended && !self.st.msg().ended {
                // In the Copy TM of the last piece (the sender's is the same: every frame
                // before agreed), else in TM 0.
                let cur = self.st.msg().cur;
                let tm = if self.st.ch.table.bmm(cur) == Bmm::Copy {
                    cur
                } else {
                    self.st.ensure(0)?;
                    0
                };
                let pieces = self.st.msg().index as u64;
                self.st.expect_frame_in(tm, wire::Frame::End { pieces })?;
            }
        }
        if self.st.msg().recording {
            self.st.rx().spare.plan.ops.push(RxOp::Finish);
            return Ok(());
        }
        let cur = self.st.msg().cur;
        let rx = self.st.rx();
        rx.link.checkout(cur)?;
        rx.link.end_message()
    }

    /// Every later wait of this message (unpacks, `end_unpacking`) gives up at `deadline`
    /// with [`Error::Timeout`]; `None` removes the limit. A deadline that expires in the
    /// middle of a message abandons it, as any failed unpack does (the connection is finished
    /// in both directions), so it is a bound on a peer that stalls, not a way to pause.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        if let Some(rx) = self.st.rx.as_deref_mut() {
            rx.spare.msg.deadline = deadline;
        }
    }

    /// The peer this message comes from.
    pub fn remote(&self) -> usize {
        self.st.fwd.as_ref().map_or(self.st.remote, |f| f.origin)
    }

    /// Whether the sender packed this message in checked mode.
    pub fn is_checked(&self) -> bool {
        self.st.msg_ref().is_some_and(|m| m.checked)
    }

    /// Unpack into `buf` in receive mode **CHEAPER**: `buf` is filled at the latest by
    /// `end_unpacking` and stays borrowed until then. `s` is the send mode the sender used.
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`](crate::Error::UnpackMismatch) in
    /// checked mode when the sender packed something else at this position;
    /// [`Error::Protocol`](crate::Error::Protocol) when the peer's bytes break the protocol;
    /// [`Error::Timeout`](crate::Error::Timeout) when the message's deadline or the channel's
    /// operation timeout passes while waiting; [`Error::Closed`](crate::Error::Closed) once the
    /// channel is closed. After an error the rest of the message is abandoned and the connection
    /// from that peer is closed.
    #[inline]
    pub fn unpack(&mut self, buf: &'b mut [u8], s: SendMode) -> Result<()> {
        if s != SendMode::Later && self.take_short(buf) {
            return Ok(());
        }
        self.unpack_general(buf, s)
    }

    /// [`unpack`](Self::unpack) of a piece [`take_short`](Self::take_short) does not take.
    #[inline(never)]
    fn unpack_general(&mut self, buf: &'b mut [u8], s: SendMode) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_piece(buf, s, RecvMode::Cheaper);
        }
        let res = self.unpack_inner(buf, s);
        self.check(res)
    }

    /// Unpack into `buf` in receive mode **EXPRESS**: the data is in `buf` when this returns.
    /// `s` is the send mode the sender used.
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`](crate::Error::UnpackMismatch) in
    /// checked mode when the sender packed something else at this position;
    /// [`Error::Protocol`](crate::Error::Protocol) when the peer's bytes break the protocol;
    /// [`Error::Timeout`](crate::Error::Timeout) when the message's deadline or the channel's
    /// operation timeout passes while waiting; [`Error::Closed`](crate::Error::Closed) once the
    /// channel is closed. After an error the rest of the message is abandoned and the connection
    /// from that peer is closed.
    #[inline]
    pub fn unpack_express(&mut self, buf: &mut [u8], s: SendMode) -> Result<()> {
        if self.take_short(buf) {
            return Ok(());
        }
        self.unpack_express_general(buf, s)
    }

    /// [`unpack_express`](Self::unpack_express) of a piece [`take_short`](Self::take_short)
    /// does not take.
    #[inline(never)]
    fn unpack_express_general(&mut self, buf: &mut [u8], s: SendMode) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_piece(buf, s, RecvMode::Express);
        }
        let mut res = self.unpack_express_inner(buf, s);
        if res.is_ok() && self.st.msg().recording {
            res = self.run_blocking();
        }
        self.check(res)
    }

    /// Unpack a plain value in receive mode EXPRESS (native byte order): the mirror of
    /// [`Packer::pack_value`](crate::Packer::pack_value)`(&v, RecvMode::Express)`, which sends
    /// in mode SAFER, so no send mode is asked for (a value packed otherwise is unpacked with
    /// [`unpack_express`](Self::unpack_express) and its send mode).
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`](crate::Error::UnpackMismatch) in
    /// checked mode when the sender packed something else at this position;
    /// [`Error::Protocol`](crate::Error::Protocol) when the peer's bytes break the protocol;
    /// [`Error::Timeout`](crate::Error::Timeout) when the message's deadline or the channel's
    /// operation timeout passes while waiting; [`Error::Closed`](crate::Error::Closed) once the
    /// channel is closed. After an error the rest of the message is abandoned and the connection
    /// from that peer is closed.
    #[inline]
    pub fn unpack_value<T: bytemuck::Pod>(&mut self) -> Result<T> {
        let mut v = T::zeroed();
        self.unpack_express(bytemuck::bytes_of_mut(&mut v), SendMode::Safer)?;
        Ok(v)
    }

    /// Unpack a slice of plain values in receive mode CHEAPER.
    ///
    /// # Errors
    ///
    /// [`Error::PeerClosed`](crate::Error::PeerClosed),
    /// [`Error::ConnectionLost`](crate::Error::ConnectionLost) or
    /// [`Error::Poisoned`](crate::Error::Poisoned) when the connection to the peer is gone or an
    /// earlier failure left it unusable; [`Error::UnpackMismatch`](crate::Error::UnpackMismatch) in
    /// checked mode when the sender packed something else at this position;
    /// [`Error::Protocol`](crate::Error::Protocol) when the peer's bytes break the protocol;
    /// [`Error::Timeout`](crate::Error::Timeout) when the message's deadline or the channel's
    /// operation timeout passes while waiting; [`Error::Closed`](crate::Error::Closed) once the
    /// channel is closed. After an error the rest of the message is abandoned and the connection
    /// from that peer is closed.
    #[inline]
    pub fn unpack_slice<T: bytemuck::Pod>(&mut self, v: &'b mut [T], s: SendMode) -> Result<()> {
        self.unpack(bytemuck::cast_slice_mut(v), s)
    }

    /// Give the lists back to the connection for its next message (emptied).
    #[inline]
    fn recycle(&mut self) {
        if let Some(rx) = self.st.rx.as_deref_mut() {
            if self.group.capacity() > 0 {
                rx.spare.group.restore(std::mem::take(&mut self.group));
            }
            if self.tail.capacity() > 0 {
                rx.spare.tail.restore(std::mem::take(&mut self.tail));
            }
        }
    }

    /// Finish the message: every CHEAPER destination is filled when this returns.
    ///
    /// A message is complete only once its sender has ended it (`end_packing`): this returns
    /// after the sender's end-of-message mark arrived, so a message its sender abandoned
    /// midway is an error here, never delivered as if whole. A receiver that finishes
    /// messages in another order than their sender (two channels, say) must not wait here
    /// for a message whose sender is itself waiting on this thread.
    ///
    /// # Errors
    ///
    /// The peer failed or abandoned the message; the pieces unpacked do not match the ones
    /// packed (checked mode: [`Error::UnpackMismatch`]; otherwise [`Error::Protocol`]). Either
    /// way the connection is finished in both directions.
    #[inline]
    pub fn end_unpacking(mut self) -> Result<()> {
        self.end_here()
    }

    /// [`end_unpacking`](Self::end_unpacking) without moving the unpacker out of where it
    /// lives: for bindings that keep it in memory of their own (the C API's handles).
    ///
    /// # Safety
    /// Nothing but dropping the unpacker may follow (no other call on it).
    #[doc(hidden)]
    #[allow(unsafe_code)]
    pub unsafe fn end_unpacking_in_place(&mut self) -> Result<()> {
        self.end_here()
    }

    #[inline(always)]
    fn end_here(&mut self) -> Result<()> {
        if self.st.fwd.is_some() {
            return self.fwd_end();
        }
        let mut r = self.finish_inner();
        if r.is_ok() && self.st.msg().recording {
            r = self.run_blocking();
        }
        match r {
            Ok(()) => {
                self.completed();
                Ok(())
            }
            Err(e) => Err(self.end_failed(e)),
        }
    }

    /// The message was received whole: count it, give the lists back, release the connection.
    #[inline]
    fn completed(&mut self) {
        self.recycle();
        let st = &mut self.st;
        st.done = true;
        let (ch, remote) = (st.ch, st.remote);
        let rx = st.rx();
        rx.seq = rx.seq.wrapping_add(1);
        if let Some(Some(c)) = ch.conns.get(remote) {
            let msg = &rx.spare.msg;
            c.received.add(msg.bytes, &msg.counts, msg.used);
        }
        st.release();
    }

    #[cold]
    fn end_failed(&mut self, e: Error) -> Error {
        let e = self.st.ch.closed_or(e);
        self.recycle();
        if !self.st.done {
            self.st.fail(
                format!("end_unpacking failed: {e}"),
                crate::channel::peer_gone(&e),
            );
        }
        self.st.release();
        e
    }

    /// Event-driven use: from now on no unpack waits for the network. CHEAPER unpacks are
    /// received at once when their data is there, else recorded and received later (they are
    /// only due at the end anyway), as is everything after them; EXPRESS pieces are
    /// received by [`poll_unpack_express`](Self::poll_unpack_express) and the end by
    /// [`poll_end_unpacking`](Self::poll_end_unpacking), which return `Pending` instead of
    /// waiting (the blocking `unpack_express` and `end_unpacking` still work, and wait). The
    /// bytes read are the same as a blocking receiver's: the engine's own unpack code records
    /// its steps (module `rxplan`).
    #[inline]
    pub fn defer(&mut self) {
        // A forwarded message read directly is received as the calls come.
        if !self.st.msg().recording && self.st.fwd.is_none() {
            self.st.msg().trying = true;
        }
        if let Some(rx) = self.st.rx.as_deref_mut() {
            rx.set_nonblocking(true);
        }
    }

    /// Every recorded step ran: the unpacker tries its next steps directly again, from the
    /// TM and end-frame state the steps left.
    fn plan_drained(&mut self) {
        let plan = &mut self.st.rx().spare.plan;
        plan.drained();
        let (cur, ended) = (plan.cur, plan.ended);
        let st = &mut self.st;
        st.msg().cur = cur;
        st.msg().ended = ended;
        st.msg().recording = false;
        st.msg().trying = true;
    }

    /// Run the recorded steps, waiting as the progress policy says.
    fn run_blocking(&mut self) -> Result<()> {
        let (ch, deadline, remote) = (self.st.ch, self.st.msg().deadline, self.st.remote);
        let rx = self.st.rx();
        drive(ch, deadline, rx, |rx| rx.run_plan(remote))?;
        self.plan_drained();
        Ok(())
    }

    /// Run the recorded steps until one is pending; fail at the deadline or on a closed channel.
    fn run_polled(&mut self) -> Result<Poll<()>> {
        if !self.st.msg().recording {
            // Every step so far was made directly.
            return Ok(Poll::Ready(()));
        }
        let remote = self.st.remote;
        match self.st.rx().run_plan(remote)? {
            Poll::Ready(()) => {
                self.plan_drained();
                Ok(Poll::Ready(()))
            }
            Poll::Pending => {
                self.st.ch.check_open()?;
                if self.st.msg().deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(Error::Timeout(std::time::Duration::ZERO));
                }
                Ok(Poll::Pending)
            }
        }
    }

    /// [`unpack_express`](Self::unpack_express) without blocking (the unpacker switches to
    /// [deferred mode](Self::defer)): `Ready` once `buf` holds the piece, `Pending` while it
    /// has not arrived (call again, with the same `buf`, when the channel's readiness
    /// descriptor is readable). Every CHEAPER piece unpacked before is received first.
    ///
    /// Abandoning a pending call (calling anything else, or dropping the unpacker) abandons
    /// the message as a failed unpack does: the connection is finished in both directions.
    pub fn poll_unpack_express(&mut self, buf: &mut [u8], s: SendMode) -> Poll<Result<()>> {
        if self.st.fwd.is_some() {
            return Poll::Ready(self.unpack_express(buf, s));
        }
        if let Err(e) = self.alive() {
            return Poll::Ready(Err(e));
        }
        self.defer();
        if self.st.msg().express.is_none() && self.take_short(buf) {
            return Poll::Ready(Ok(()));
        }
        let key = (buf.as_ptr() as usize, buf.len());
        match self.st.msg().express {
            None => {
                let r = self.unpack_express_inner(buf, s);
                if let Err(e) = self.check(r) {
                    return Poll::Ready(Err(e));
                }
                self.st.msg().express = Some(key);
            }
            Some(k) if k != key => {
                let e = Error::protocol(
                    self.st.remote,
                    "poll_unpack_express called with another buffer than the pending one \
                     (an abandoned EXPRESS unpack abandons its message)",
                );
                return Poll::Ready(self.check(Err(e)));
            }
            Some(_) => {}
        }
        match self.run_polled() {
            Ok(Poll::Ready(())) => {
                self.st.msg().express = None;
                Poll::Ready(Ok(()))
            }
            Ok(Poll::Pending) => Poll::Pending,
            Err(e) => Poll::Ready(self.check(Err(e))),
        }
    }

    /// [`end_unpacking`](Self::end_unpacking) without blocking (the unpacker switches to
    /// [deferred mode](Self::defer)): `Ready` once every CHEAPER destination is filled and
    /// the message is over (or failed), `Pending` while data is missing (call again when the
    /// channel's readiness descriptor is readable). After `Ready`, the unpacker is spent.
    ///
    /// Dropping the unpacker while this is pending abandons the message (the connection is
    /// finished in both directions), as dropping it before `end_unpacking` always does.
    pub fn poll_end_unpacking(&mut self) -> Poll<Result<()>> {
        if self.st.fwd.is_some() {
            return Poll::Ready(self.fwd_end());
        }
        if let Err(e) = self.alive() {
            return Poll::Ready(Err(e));
        }
        if self.st.msg().express.is_some() {
            let e = Error::protocol(
                self.st.remote,
                "poll_end_unpacking while an EXPRESS unpack is pending (an abandoned EXPRESS \
                 unpack abandons its message)",
            );
            return Poll::Ready(Err(self.end_failed(e)));
        }
        self.defer();
        if !self.st.msg().ending {
            if let Err(e) = self.finish_inner() {
                return Poll::Ready(Err(self.end_failed(e)));
            }
            self.st.msg().ending = true;
        }
        match self.run_polled() {
            Ok(Poll::Ready(())) => {
                self.completed();
                Poll::Ready(Ok(()))
            }
            Ok(Poll::Pending) => Poll::Pending,
            Err(e) => Poll::Ready(Err(self.end_failed(e))),
        }
    }
}

/// Forwarded messages read directly from a transit connection ([`crate::vchan`]).
impl<'c, 'b> Unpacker<'c, 'b> {
    /// Make this message (on a transit connection, its envelope read) a forwarded one from
    /// `origin`: every unpack from now on reads a descriptor and fragments.
    pub(crate) fn forwarded_from(
        mut self,
        origin: usize,
        via: usize,
        from_origin: bool,
        f: &'c crate::vchan::Forwarder,
        claim: crate::vchan::DoorGuard<'c>,
    ) -> Self {
        self.st.fwd = Some(Box::new(FwdIn {
            origin,
            via,
            from_origin,
            index: 0,
            f,
            _claim: claim,
        }));
        self
    }

    /// The next descriptor that is not a flush (a gateway flushed there; nothing to do).
    fn fwd_desc(&mut self) -> Result<crate::vchan::fwd::Desc> {
        use crate::vchan::fwd;
        loop {
            let mut d = [0u8; fwd::DESC_LEN];
            self.unpack_express_inner(&mut d, SendMode::Safer)?;
            match fwd::decode(&d) {
                Some(fwd::Desc::Flush) => {}
                Some(d) => return Ok(d),
                None => {
                    return Err(Error::protocol(
                        self.st.remote,
                        "malformed forwarding descriptor",
                    ))
                }
            }
        }
    }

    /// Read `buf.len()` bytes of a piece sent in mode `s` (its fragments).
    fn fwd_read(&mut self, buf: &mut [u8], s: SendMode) -> Result<()> {
        let s = if self.st.fwd.as_ref().is_some_and(|f| f.from_origin) {
            s
        } else {
            SendMode::Safer
        };
        for c in buf.chunks_mut(crate::vchan::fwd::FRAGMENT) {
            self.unpack_express_inner(c, s)?;
        }
        Ok(())
    }

    /// The transit connection failed under this message: it is torn down (the core did),
    /// and the ranks behind it are gone for this rank.
    #[cold]
    fn fwd_lost(&mut self, e: Error) -> Error {
        let e = self.failed(e);
        if let Some(f) = self.st.fwd.take() {
            if !self.st.ch.closed.load(std::sync::atomic::Ordering::Acquire) {
                f.f.lost(f.via);
            }
        }
        e
    }

    /// The application does not take this message as sent (a mismatch, or it dropped the
    /// unpacker): read the rest of it from the transit connection and drop it (bounded in
    /// time: past the bound the connection is torn down), then break the pair's connection
    /// both ways, as a direct connection is after an abandoned message. `pending`: the bytes
    /// of a piece announced and not read; `at_end`: its end descriptor was read.
    #[cold]
    fn fwd_abandon(&mut self, pending: Option<(usize, SendMode)>, at_end: bool) {
        let deadline = Instant::now() + crate::vchan::BREAK_WAIT;
        self.set_deadline(Some(deadline));
        let r = (|| -> Result<()> {
            let mut scratch = Vec::new();
            let mut drain = |u: &mut Self, len: usize, s: SendMode| -> Result<()> {
                scratch.resize(len.min(crate::vchan::fwd::FRAGMENT), 0);
                let mut left = len;
                while left > 0 {
                    let n = left.min(scratch.len());
                    u.fwd_read(&mut scratch[..n], s)?;
                    left -= n;
                }
                Ok(())
            };
            if let Some((len, s)) = pending {
                drain(self, len, s)?;
            }
            if !at_end {
                while let crate::vchan::fwd::Desc::Piece { len, s, .. } = self.fwd_desc()? {
                    drain(self, len, s)?;
                }
            }
            self.finish_inner()
        })();
        match r {
            Ok(()) => {
                self.completed();
                if let Some(f) = self.st.fwd.take() {
                    f.f.break_pair(f.origin);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "forwarding: an abandoned message could not be drained");
                let _ = self.fwd_lost(e);
            }
        }
    }

    /// The mismatch error of a piece or end unpacked where the sender put another.
    fn fwd_mismatch(
        &self,
        sent: crate::error::PieceOrEnd,
        expected: crate::error::PieceOrEnd,
    ) -> Error {
        Error::UnpackMismatch {
            rank: self.remote(),
            sent,
            expected,
        }
    }

    /// `unpack` / `unpack_express` of a forwarded message.
    fn fwd_piece(&mut self, buf: &mut [u8], s: SendMode, r: RecvMode) -> Result<()> {
        use crate::vchan::fwd;
        self.alive()?;
        let index = self.st.fwd.as_ref().map_or(0, |f| f.index);
        let desc = match self.fwd_desc() {
            Ok(d) => d,
            Err(e) => return Err(self.fwd_lost(e)),
        };
        let expected = crate::error::PieceOrEnd::Piece(crate::error::PieceDesc {
            index,
            len: buf.len() as u64,
            send: s,
            recv: r,
        });
        match desc {
            fwd::Desc::Piece { len, s: s2, r: r2 } if len == buf.len() && s2 == s && r2 == r => {
                if let Err(e) = self.fwd_read(buf, s) {
                    return Err(self.fwd_lost(e));
                }
                if let Some(f) = self.st.fwd.as_mut() {
                    f.index += 1;
                }
                Ok(())
            }
            fwd::Desc::Piece { len, s: s2, r: r2 } => {
                let sent = crate::error::PieceOrEnd::Piece(crate::error::PieceDesc {
                    index,
                    len: len as u64,
                    send: s2,
                    recv: r2,
                });
                let e = self.fwd_mismatch(sent, expected);
                self.fwd_abandon(Some((len, s2)), false);
                Err(e)
            }
            _ => {
                let e =
                    self.fwd_mismatch(crate::error::PieceOrEnd::End { pieces: index }, expected);
                self.fwd_abandon(None, true);
                Err(e)
            }
        }
    }

    /// `end_unpacking` of a forwarded message.
    fn fwd_end(&mut self) -> Result<()> {
        use crate::vchan::fwd;
        self.alive()?;
        let index = self.st.fwd.as_ref().map_or(0, |f| f.index);
        match self.fwd_desc() {
            Ok(fwd::Desc::Piece { len, s, r }) => {
                let sent = crate::error::PieceOrEnd::Piece(crate::error::PieceDesc {
                    index,
                    len: len as u64,
                    send: s,
                    recv: r,
                });
                let e = self.fwd_mismatch(sent, crate::error::PieceOrEnd::End { pieces: index });
                self.fwd_abandon(Some((len, s)), false);
                Err(e)
            }
            Ok(_) => match self.finish_inner() {
                Ok(()) => {
                    self.completed();
                    self.st.fwd = None;
                    Ok(())
                }
                Err(e) => Err(self.fwd_lost(e)),
            },
            Err(e) => Err(self.fwd_lost(e)),
        }
    }
}

/// An `Unpacker` may move between threads (a future between the polls of a multi-threaded
/// runtime): checked at compile time.
#[allow(dead_code)]
fn unpacker_is_send() {
    fn send<T: Send>() {}
    send::<Unpacker<'static, 'static>>();
}
