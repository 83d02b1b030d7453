//! The receiving side's recorded steps, for unpacking without blocking.
//!
//! An [`Unpacker`](crate::Unpacker) in deferred mode ([`Unpacker::defer`](crate::Unpacker::defer))
//! runs the engine's own unpack code in *recording* mode: instead of reading from the driver,
//! each primitive (a copy out of a Copy TM with its frames, a gather group, a checked-mode
//! descriptor, the end frame, the end of the message) appends a step to the connection's
//! [`RxPlan`]. The steps run when the data is needed (an EXPRESS piece, the end of the message),
//! each one a driver call that the driver resumes ("call again with the same arguments"), so a
//! pending step returns `Pending` to an event loop instead of blocking, and the bytes read are
//! those a blocking receiver would read. Where the blocking code reads something that decides
//! what comes next (the sender's gather groups, whether the end frame came with the last piece),
//! the step itself carries that decision and its cursor.

use std::io::IoSliceMut;
use std::task::Poll;

use crate::driver::{RxLink, TmId};
use crate::error::{Error, PieceOrEnd, Result};
use crate::wire::{self, Frame, FRAME_LEN};

/// A destination a recorded step writes when it runs.
#[derive(Clone, Copy)]
pub(crate) struct RawMut(*mut u8, usize);

// SAFETY: a `RawMut` is only written through by the thread holding the connection's receiving
// half, while the message that recorded it is alive (`RxPlan`'s invariant); it is only an
// address meanwhile.
#[allow(unsafe_code)]
unsafe impl Send for RawMut {}

impl RawMut {
    pub(crate) fn of(s: &mut [u8]) -> RawMut {
        RawMut(s.as_mut_ptr(), s.len())
    }

    pub(crate) fn len(self) -> usize {
        self.1
    }

    /// # Safety
    /// The range must still be alive and lent to this message only (`RxPlan`'s invariant).
    #[allow(unsafe_code)]
    unsafe fn get<'a>(self) -> &'a mut [u8] {
        if self.1 == 0 {
            return &mut [];
        }
        // SAFETY: the caller guarantees that the range recorded from a live `&mut` slice is
        // still alive and not reachable otherwise.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

/// One recorded step.
#[derive(Clone, Copy)]
pub(crate) enum RxOp {
    /// Read `want` (a frame, compared) then fill `dst` from TM `tm`; `end`: `dst` is a whole
    /// piece that may be the message's last, and the end frame (of a message of `end` pieces)
    /// is taken too when it is in the same lend.
    Copy {
        tm: TmId,
        want: Option<Frame>,
        dst: RawMut,
        end: Option<u32>,
        index: u32,
    },
    /// Checked mode: a descriptor through TM 0, compared with `expected`.
    Desc { expected: PieceOrEnd },
    /// Checked mode: one gather group, `slices[a..b]`.
    Refs { tm: TmId, a: usize, b: usize },
    /// Unchecked mode: the sender's gather groups, with their frames, into `slices[a..b]`;
    /// `at_end`: the message's last group (its frames may carry the end frame).
    Group {
        tm: TmId,
        a: usize,
        b: usize,
        at_end: bool,
        index: u32,
    },
    /// Unchecked mode: the end frame in TM `tm`, unless it came already.
    EndFrame { tm: TmId, pieces: u32 },
    /// Check out the last TM and end the message.
    Finish,
}

/// Unchecked-mode frame reading that shares lends with data (the mirror of the sender's
/// framed copies), as the blocking receiver and the recorded steps both do it.
#[derive(Clone, Copy, Default)]
pub(crate) struct Framed {
    /// Frame bytes read so far (`FRAME_LEN` when there is no frame to read).
    pub(crate) fk: usize,
    pub(crate) fb: [u8; FRAME_LEN],
}

/// What one lend gave to [`Framed::take`].
pub(crate) struct Took {
    /// Bytes consumed from the lend.
    pub(crate) used: usize,
    /// Of which data bytes (copied to the destination).
    pub(crate) data: usize,
    /// The frame read differs from the one wanted (nothing after it was consumed).
    pub(crate) bad: bool,
    /// The end frame followed the data in the same lend and was consumed.
    pub(crate) ended: bool,
}

impl Framed {
    /// Consume from `src`: the rest of the frame (compared with `want` once complete), then
    /// data into `rest`, then, if `rest` is full and `end` is given, the end frame when it
    /// is next in `src`.
    #[inline(always)]
    pub(crate) fn take(
        &mut self,
        src: &[u8],
        want: Option<&[u8; FRAME_LEN]>,
        rest: &mut [u8],
        end: Option<&[u8; FRAME_LEN]>,
    ) -> Took {
        let mut t = Took {
            used: 0,
            data: 0,
            bad: false,
            ended: false,
        };
        if self.fk < FRAME_LEN {
            let f = (FRAME_LEN - self.fk).min(src.len());
            self.fb[self.fk..self.fk + f].copy_from_slice(&src[..f]);
            self.fk += f;
            t.used = f;
            if self.fk == FRAME_LEN && want.is_some_and(|w| *w != self.fb) {
                t.bad = true;
                return t;
            }
        }
        if self.fk == FRAME_LEN {
            let m = (src.len() - t.used).min(rest.len());
            rest[..m].copy_from_slice(&src[t.used..t.used + m]);
            t.used += m;
            t.data = m;
            if m == rest.len() {
                if let Some(e) = end {
                    if src.get(t.used..t.used + FRAME_LEN) == Some(&e[..]) {
                        t.used += FRAME_LEN;
                        t.ended = true;
                    }
                }
            }
        }
        t
    }
}

/// The error of a frame that is not the one this side expected.
#[cold]
pub(crate) fn frame_mismatch(
    remote: usize,
    index: u32,
    got: &[u8; FRAME_LEN],
    want: Frame,
) -> Error {
    let want = wire::normalize_frame(want);
    Error::protocol(
        remote,
        format!(
            "unpack does not match the message (unchecked mode): the sender sent {}, \
             this side expected {want} (piece {index} of the message); the connection is \
             closed; enable checked mode (checked=true) to find the piece",
            match wire::decode_frame(got) {
                Some(g) => g.to_string(),
                None => format!("bytes {got:02x?} where a frame belongs"),
            },
        ),
    )
}

/// A connection's recorded receive steps and where they stand.
///
/// Invariant behind every `RawMut`: it is a destination lent to the message for as long as
/// the plan can run: a CHEAPER buffer (borrowed by the unpacker for `'b`), or the EXPRESS
/// buffer of the pending `poll_unpack_express` (the caller passes the same buffer to every
/// call until it is `Ready`, which the unpacker checks before running a step).
#[derive(Default)]
pub(crate) struct RxPlan {
    pub(crate) ops: Vec<RxOp>,
    pub(crate) slices: Vec<RawMut>,
    pos: usize,
    /// The TM the driver was last read from (checked out when the next step uses another).
    pub(crate) cur: TmId,
    /// The end frame was read.
    pub(crate) ended: bool,
    /// Cursor of the current step.
    framed: Framed,
    off: usize,
    raw: [u8; wire::DESC_LEN],
    rk: usize,
    /// Cursor of a `Group` step: slices received, phase, the group announced.
    gdone: usize,
    gphase: u8,
    gcount: usize,
    gend: bool,
    gk: usize,
}

impl RxPlan {
    /// Start a message's plan (nothing recorded, TM 0 current).
    pub(crate) fn reset(&mut self, cur: TmId, ended: bool) {
        self.ops.clear();
        self.slices.clear();
        self.pos = 0;
        self.cur = cur;
        self.ended = ended;
        self.step_done();
    }

    /// The first step (a copy) starts from a copy begun directly: `framed` read so far of its
    /// frame, `off` bytes of its data.
    pub(crate) fn resume_at(&mut self, framed: Framed, off: usize) {
        debug_assert!(self.pos == 0 && self.ops.len() == 1);
        self.framed = framed;
        self.off = off;
    }

    /// Every recorded step ran: forget them (the cursor state of the message stays).
    pub(crate) fn drained(&mut self) {
        self.ops.clear();
        self.slices.clear();
        self.pos = 0;
    }

    fn step_done(&mut self) {
        self.framed = Framed::default();
        self.off = 0;
        self.rk = 0;
        self.gdone = 0;
        self.gphase = 0;
        self.gk = 0;
    }

    fn ensure(&mut self, link: &mut dyn RxLink, tm: TmId) -> Result<()> {
        if tm != self.cur {
            link.checkout(self.cur)?;
            self.cur = tm;
        }
        Ok(())
    }

    /// Read `n` raw bytes of TM `tm` into `self.raw`.
    fn read_raw(&mut self, link: &mut dyn RxLink, tm: TmId, n: usize) -> Result<Poll<()>> {
        while self.rk < n {
            let (raw, rk) = (&mut self.raw, &mut self.rk);
            let r = link.with_data(tm, n - *rk, &mut |src: &[u8]| {
                let m = (n - *rk).min(src.len());
                raw[*rk..*rk + m].copy_from_slice(&src[..m]);
                *rk += m;
                m
            })?;
            if r.is_pending() {
                return Ok(Poll::Pending);
            }
        }
        Ok(Poll::Ready(()))
    }

    /// Read a frame of TM 0 and compare it with `want`.
    fn expect(
        &mut self,
        link: &mut dyn RxLink,
        tm: TmId,
        want: Frame,
        remote: usize,
        index: u32,
    ) -> Result<Poll<()>> {
        if self.read_raw(link, tm, FRAME_LEN)?.is_pending() {
            return Ok(Poll::Pending);
        }
        self.rk = 0;
        let got: [u8; FRAME_LEN] = self.raw[..FRAME_LEN].try_into().expect("a frame");
        if got != wire::encode_frame(want) {
            return Err(frame_mismatch(remote, index, &got, want));
        }
        Ok(Poll::Ready(()))
    }

    /// Run steps until one is pending or all are done.
    #[allow(unsafe_code)]
    pub(crate) fn run(&mut self, link: &mut dyn RxLink, remote: usize) -> Result<Poll<()>> {
        while self.pos < self.ops.len() {
            let r = match self.ops[self.pos] {
                RxOp::Copy {
                    tm,
                    want,
                    dst,
                    end,
                    index,
                } => {
                    self.ensure(link, tm)?;
                    // SAFETY: `RxPlan`'s invariant.
                    let buf = unsafe { dst.get() };
                    let want_b = want.map(wire::encode_frame);
                    let end_b = end.map(|p| wire::encode_frame(Frame::End { pieces: p as u64 }));
                    if want.is_none() && self.framed.fk == 0 && self.off == 0 {
                        self.framed.fk = FRAME_LEN;
                    }
                    loop {
                        if self.framed.fk == FRAME_LEN && self.off == buf.len() {
                            break Poll::Ready(());
                        }
                        let (framed, off) = (&mut self.framed, self.off);
                        let rest = &mut buf[off..];
                        let want_len = FRAME_LEN - framed.fk + rest.len();
                        let mut took = None;
                        let r = link.with_data(tm, want_len, &mut |src: &[u8]| {
                            let t = framed.take(src, want_b.as_ref(), rest, end_b.as_ref());
                            let used = t.used;
                            took = Some(t);
                            used
                        })?;
                        if r.is_pending() {
                            break Poll::Pending;
                        }
                        let t = took.ok_or_else(|| {
                            Error::protocol(remote, "driver lent no received bytes (driver bug)")
                        })?;
                        if t.bad {
                            let want = want.expect("a frame was compared");
                            return Err(frame_mismatch(remote, index, &self.framed.fb, want));
                        }
                        if t.used == 0 {
                            return Err(Error::protocol(
                                remote,
                                "driver lent no received bytes (driver bug)",
                            ));
                        }
                        self.off += t.data;
                        self.ended |= t.ended;
                    }
                }
                RxOp::Desc { expected } => {
                    self.ensure(link, 0)?;
                    match self.read_raw(link, 0, wire::DESC_LEN)? {
                        Poll::Pending => Poll::Pending,
                        Poll::Ready(()) => {
                            let sent = wire::decode_desc(&self.raw)
                                .map_err(|w| Error::protocol(remote, w.to_string()))?;
                            if sent != expected {
                                return Err(Error::UnpackMismatch {
                                    rank: remote,
                                    sent,
                                    expected,
                                });
                            }
                            Poll::Ready(())
                        }
                    }
                }
                RxOp::Refs { tm, a, b } => {
                    self.ensure(link, tm)?;
                    let mut iov: smallvec::SmallVec<[IoSliceMut<'_>; 8]> = Default::default();
                    for r in &self.slices[a..b] {
                        // SAFETY: `RxPlan`'s invariant.
                        iov.push(IoSliceMut::new(unsafe { r.get() }));
                    }
                    link.recv_refs(tm, &mut iov)?
                }
                RxOp::Group {
                    tm,
                    a,
                    b,
                    at_end,
                    index,
                } => self.group(link, remote, tm, a, b, at_end, index)?,
                RxOp::EndFrame { tm, pieces } => {
                    if self.ended {
                        Poll::Ready(())
                    } else {
                        self.ensure(link, tm)?;
                        let end = Frame::End {
                            pieces: pieces as u64,
                        };
                        let r = self.expect(link, tm, end, remote, pieces)?;
                        if r.is_ready() {
                            self.ended = true;
                        }
                        r
                    }
                }
                RxOp::Finish => {
                    let cur = self.cur;
                    link.checkout(cur)?;
                    link.end_message()?;
                    Poll::Ready(())
                }
            };
            if r.is_pending() {
                return Ok(Poll::Pending);
            }
            self.pos += 1;
            self.step_done();
        }
        Ok(Poll::Ready(()))
    }

    /// The unchecked-mode group step: the receiver follows the sender's groups (a flush may
    /// have cut one group of this side in several), checking each group's frames before
    /// receiving it, as the blocking `recv_group` does.
    #[allow(clippy::too_many_arguments, unsafe_code)]
    fn group(
        &mut self,
        link: &mut dyn RxLink,
        remote: usize,
        tm: TmId,
        a: usize,
        b: usize,
        at_end: bool,
        index: u32,
    ) -> Result<Poll<()>> {
        let n = b - a;
        loop {
            if self.gdone == n {
                return Ok(Poll::Ready(()));
            }
            match self.gphase {
                0 => {
                    self.ensure(link, 0)?;
                    if self.read_raw(link, 0, FRAME_LEN)?.is_pending() {
                        return Ok(Poll::Pending);
                    }
                    self.rk = 0;
                    let got: [u8; FRAME_LEN] = self.raw[..FRAME_LEN].try_into().expect("a frame");
                    let rest = (n - self.gdone) as u64;
                    match wire::decode_frame(&got) {
                        Some(Frame::Group { tm: t, count, end })
                            if t == tm
                                && count >= 1
                                && count <= rest
                                && (!end || (at_end && count == rest)) =>
                        {
                            self.gcount = count as usize;
                            self.gend = end;
                            self.gk = 0;
                            self.gphase = 1;
                        }
                        _ => {
                            let want = Frame::Group {
                                tm,
                                count: rest,
                                end: at_end,
                            };
                            return Err(frame_mismatch(remote, index, &got, want));
                        }
                    }
                }
                1 => {
                    while self.gk < self.gcount {
                        let len = self.slices[a + self.gdone + self.gk].len() as u64;
                        let want = Frame::Piece { tm, len };
                        if self.expect(link, 0, want, remote, index)?.is_pending() {
                            return Ok(Poll::Pending);
                        }
                        self.gk += 1;
                    }
                    self.gphase = if self.gend { 2 } else { 3 };
                }
                2 => {
                    let end = Frame::End {
                        pieces: index as u64,
                    };
                    if self.expect(link, 0, end, remote, index)?.is_pending() {
                        return Ok(Poll::Pending);
                    }
                    self.ended = true;
                    self.gphase = 3;
                }
                _ => {
                    self.ensure(link, tm)?;
                    let (s, e) = (a + self.gdone, a + self.gdone + self.gcount);
                    let mut iov: smallvec::SmallVec<[IoSliceMut<'_>; 8]> = Default::default();
                    for r in &self.slices[s..e] {
                        // SAFETY: `RxPlan`'s invariant.
                        iov.push(IoSliceMut::new(unsafe { r.get() }));
                    }
                    if link.recv_refs(tm, &mut iov)?.is_pending() {
                        return Ok(Poll::Pending);
                    }
                    self.gdone += self.gcount;
                    self.gphase = 0;
                    if self.gend {
                        return Ok(Poll::Ready(()));
                    }
                }
            }
        }
    }
}
