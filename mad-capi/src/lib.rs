//! Madeleine's C API: `libmadeleine_c.so` / `libmadeleine_c.a` and `include/madeleine.h`
//! (generated from this file by cbindgen; `tests/header.rs` fails when it is out of date,
//! `MAD_BLESS=1 cargo test -p mad-capi --test header` rewrites it).
//!
//! The calls mirror the Rust API one to one: a session (the process's, as `madeleine::session`
//! builds it under `madrun`, `mpiexec` or alone), channels opened by name or by spec, a message
//! built piece by piece (`mad_begin_packing`, `mad_pack` with a send and a receive mode,
//! `mad_end_packing`) and taken apart in the same order (`mad_begin_unpacking[_from]`,
//! `mad_try_begin_unpacking`, `mad_unpack`, `mad_end_unpacking`). A message whose layout the
//! receiver knows in advance can also go in one call each way, `mad_send` and `mad_recv`,
//! over an array of `MadPiece`s: the same pieces, modes and wire format, one call instead of
//! three or more (what a short fixed-layout message costs in the C API is mostly its calls).
//!
//! What the borrow checker enforces in Rust is the caller's duty in C:
//! * `MAD_SEND_CHEAPER` memory stays untouched, and `MAD_SEND_LATER` memory stays valid (it is
//!   read at `mad_end_packing`), until `mad_end_packing` returns; `MAD_SEND_SAFER` memory is
//!   free again when `mad_pack` returns.
//! * A `MAD_RECV_CHEAPER` destination is filled when `mad_end_unpacking` returns and must stay
//!   valid until then; a `MAD_RECV_EXPRESS` one when `mad_unpack` returns.
//! * One message at a time per direction and connection, as in Rust; a packer or unpacker
//!   belongs to the thread that uses it (it may move between threads, never be shared).
//!
//! Every call returns a status (`MAD_OK` or an error code, one per `madeleine::Error` kind);
//! `mad_last_error()` gives the message of the calling thread's last error. No Rust panic
//! crosses the boundary: a panic becomes `MAD_E_PANIC`. `mad_end_packing`,
//! `mad_end_unpacking` and the `abandon` calls free their handle whatever the outcome; an
//! abandoned message is handled as a dropped `Packer`/`Unpacker` is in Rust.
#![allow(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use madeleine::{Channel, Error, Packer, RecvMode, SendMode, Session, Unpacker};

/// A session: this process's rank among the processes of the job, and its channels' drivers.
#[derive(Debug)]
pub struct MadSession {
    s: Session,
}

/// An open channel (one protocol, one adapter, a connection to every peer), with the memory
/// of its message handles.
#[derive(Debug)]
pub struct MadChannel {
    ch: Channel,
    /// The memory of the packers to each peer (see [`Slots`]).
    tx: Slots<MadPacker>,
    /// The memory of the unpackers from each peer.
    rx: Slots<MadUnpacker>,
}

impl MadChannel {
    fn new(ch: Channel) -> Self {
        let n = ch.size();
        MadChannel {
            ch,
            tx: Slots::new(n),
            rx: Slots::new(n),
        }
    }
}

/// A message being built: a handle is the channel's slot for messages to its peer.
pub struct MadPacker {
    /// The message (initialised while the handle is live).
    msg: MaybeUninit<Packer<'static, 'static>>,
    /// Whether a message is in the slot (see [`Slots`]).
    live: AtomicBool,
}

/// A message being taken apart: a handle is the channel's slot for messages from its peer.
pub struct MadUnpacker {
    /// As in [`MadPacker`].
    msg: MaybeUninit<Unpacker<'static, 'static>>,
    live: AtomicBool,
}

/// Whether a message is in the slot; the message itself may be uninitialised.
impl std::fmt::Debug for MadPacker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MadPacker")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

/// Whether a message is in the slot; the message itself may be uninitialised.
impl std::fmt::Debug for MadUnpacker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MadUnpacker")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

/// The memory of a message handle.
trait Slot: Sized {
    type Msg;
    fn empty() -> Self;
    fn parts(&mut self) -> (&mut MaybeUninit<Self::Msg>, &AtomicBool);
}

impl Slot for MadPacker {
    type Msg = Packer<'static, 'static>;
    fn empty() -> Self {
        MadPacker {
            msg: MaybeUninit::uninit(),
            live: AtomicBool::new(false),
        }
    }
    fn parts(&mut self) -> (&mut MaybeUninit<Self::Msg>, &AtomicBool) {
        (&mut self.msg, &self.live)
    }
}

impl Slot for MadUnpacker {
    type Msg = Unpacker<'static, 'static>;
    fn empty() -> Self {
        MadUnpacker {
            msg: MaybeUninit::uninit(),
            live: AtomicBool::new(false),
        }
    }
    fn parts(&mut self) -> (&mut MaybeUninit<Self::Msg>, &AtomicBool) {
        (&mut self.msg, &self.live)
    }
}

/// One handle slot per peer, allocated at its first message and reused for every later one:
/// a message costs the C side no allocation, no thread-local and no reference count.
///
/// A message to (or from) a peer holds the channel's sending (receiving) half of that
/// connection until it ends, and the engine gives each half to one message at a time; so
/// while a handle is live, nothing else writes its slot. `live` is set after a message is
/// written to the slot and cleared before it is dropped (the drop gives the half back), for
/// `mad_channel_free` to see whether a handle is still out.
struct Slots<S> {
    slots: Box<[AtomicPtr<S>]>,
}

impl<S: Slot> Slots<S> {
    fn new(n: usize) -> Self {
        Slots {
            slots: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    /// The slot of peer `rank` (a rank of the channel: the engine checked it).
    #[inline]
    fn get(&self, rank: usize) -> *mut S {
        let a = &self.slots[rank];
        let p = a.load(Ordering::Acquire);
        if p.is_null() {
            self.first(a)
        } else {
            p
        }
    }

    #[cold]
    fn first(&self, a: &AtomicPtr<S>) -> *mut S {
        let b = Box::into_raw(Box::new(S::empty()));
        match a.compare_exchange(std::ptr::null_mut(), b, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => b,
            Err(cur) => {
                // SAFETY: `b` is ours, never shared.
                drop(unsafe { Box::from_raw(b) });
                cur
            }
        }
    }

    /// Move the message at `m` into the slot of peer `rank` (one copy, straight from where
    /// the engine returned it) and return the handle.
    ///
    /// # Safety
    /// `m` points to a message that holds the half of the connection to `rank` that this slot
    /// serves; the caller forgets it (it is moved, not dropped).
    #[inline(always)]
    unsafe fn put(&self, rank: usize, m: *const S::Msg) -> *mut S {
        let p = self.get(rank);
        // SAFETY: the slot is allocated and, the message holding the connection's half, ours
        // alone (the type's docs); its previous message, if any, was dropped.
        let (msg, live) = unsafe { (*p).parts() };
        // SAFETY: `m` is a valid message, moved (the caller forgets it); the slot is not it.
        unsafe { std::ptr::copy_nonoverlapping(m, msg.as_mut_ptr(), 1) };
        live.store(true, Ordering::Relaxed);
        p
    }

    /// Whether a handle of this channel is still out.
    fn any_live(&self) -> bool {
        self.slots.iter().any(|a| {
            let p = a.load(Ordering::Acquire);
            // SAFETY: a non-null slot lives as long as `self`.
            !p.is_null() && unsafe { (*p).parts().1.load(Ordering::Relaxed) }
        })
    }
}

impl<S> Drop for Slots<S> {
    fn drop(&mut self) {
        for a in self.slots.iter() {
            let p = a.load(Ordering::Acquire);
            if !p.is_null() {
                // SAFETY: allocated by `first`, freed once; its message is not live
                // (`mad_channel_free` keeps a channel whose handles are out).
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

impl<S> std::fmt::Debug for Slots<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots")
            .field("peers", &self.slots.len())
            .finish()
    }
}

/// End the message of a live handle where it lives with `end` (which leaves it only to be
/// dropped), then drop it: the slot is free for the peer's next message.
///
/// # Safety
/// `p` is a live handle, given back once.
#[inline]
unsafe fn end_in_place<S: Slot>(
    p: *mut S,
    end: impl FnOnce(&mut S::Msg) -> madeleine::Result<()>,
) -> madeleine::Result<()> {
    // SAFETY: the caller's contract: a live handle, ours alone.
    let (msg, live) = unsafe { (*p).parts() };
    // SAFETY: a live handle's message is initialised.
    let r = end(unsafe { msg.assume_init_mut() });
    live.store(false, Ordering::Relaxed);
    // SAFETY: initialised, and dropped once (the slot's `MaybeUninit` never drops it again).
    // The drop gives the connection's half back: the slot may be reused from then on.
    unsafe { msg.assume_init_drop() };
    r
}

/// Take the message out of a live handle (its slot is free for the next message once the
/// message is dropped).
///
/// # Safety
/// `p` is a live handle, given back once.
unsafe fn release<S: Slot>(p: *mut S) -> S::Msg {
    // SAFETY: the caller's contract: a live handle, ours alone.
    let (msg, live) = unsafe { (*p).parts() };
    live.store(false, Ordering::Relaxed);
    // SAFETY: a live handle's message is initialised; it is read once.
    unsafe { msg.assume_init_read() }
}

/// Success.
pub const MAD_OK: c_int = 0;
/// `mad_try_begin_unpacking*`: no message yet (not an error; nothing was consumed).
pub const MAD_AGAIN: c_int = 1;
/// The peer closed the connection.
pub const MAD_E_PEER_CLOSED: c_int = -1;
/// The connection to the peer was lost (reset, died, timed out).
pub const MAD_E_CONNECTION_LOST: c_int = -2;
/// Checked mode: the pieces unpacked differ from those packed.
pub const MAD_E_UNPACK_MISMATCH: c_int = -3;
/// A driver cannot run here (no device, no library).
pub const MAD_E_UNAVAILABLE: c_int = -4;
/// A configuration or an argument is wrong (also: a null handle or pointer, a bad mode).
pub const MAD_E_BAD_CONFIG: c_int = -5;
/// The peer broke the protocol.
pub const MAD_E_PROTOCOL: c_int = -6;
/// The connection cannot be used after an earlier failure.
pub const MAD_E_POISONED: c_int = -7;
/// A rank outside the session, or this process's own.
pub const MAD_E_BAD_RANK: c_int = -8;
/// This thread already has a message open in that direction with that peer.
pub const MAD_E_IN_USE: c_int = -9;
/// A deadline or timeout passed.
pub const MAD_E_TIMEOUT: c_int = -10;
/// The channel was closed.
pub const MAD_E_CLOSED: c_int = -11;
/// The job's secret did not match (a stranger, or another job).
pub const MAD_E_AUTH: c_int = -12;
/// A resource is exhausted (memory, shared memory, descriptors).
pub const MAD_E_RESOURCE: c_int = -13;
/// A system call failed.
pub const MAD_E_IO: c_int = -14;
/// Another rank failed a collective step (an open).
pub const MAD_E_REMOTE_FAILURE: c_int = -15;
/// A collective step did not complete in time on every rank.
pub const MAD_E_COLLECTIVE_TIMEOUT: c_int = -16;
/// A bug: a panic inside the library (the message says where).
pub const MAD_E_PANIC: c_int = -17;

/// `mad_pack`'s send mode: the memory may be reused as soon as `mad_pack` returns.
pub const MAD_SEND_SAFER: c_int = 0;
/// `mad_pack`'s send mode: the memory is read at `mad_end_packing`.
pub const MAD_SEND_LATER: c_int = 1;
/// `mad_pack`'s send mode: the memory stays untouched until `mad_end_packing` returns.
pub const MAD_SEND_CHEAPER: c_int = 2;
/// Receive mode: the piece is there when `mad_unpack` returns.
pub const MAD_RECV_EXPRESS: c_int = 0;
/// Receive mode: the piece is there after `mad_end_unpacking`.
pub const MAD_RECV_CHEAPER: c_int = 1;

/// A channel's counters (`mad_channel_stats`).
#[repr(C)]
#[derive(Debug)]
pub struct MadStats {
    /// Messages sent (completed `mad_end_packing`).
    pub messages_sent: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Messages received (completed `mad_end_unpacking`).
    pub messages_received: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

fn code(e: &Error) -> c_int {
    match e {
        Error::PeerClosed { .. } => MAD_E_PEER_CLOSED,
        Error::ConnectionLost { .. } => MAD_E_CONNECTION_LOST,
        Error::UnpackMismatch { .. } => MAD_E_UNPACK_MISMATCH,
        Error::Unavailable { .. } => MAD_E_UNAVAILABLE,
        Error::BadConfig(_) => MAD_E_BAD_CONFIG,
        Error::Protocol { .. } => MAD_E_PROTOCOL,
        Error::Poisoned { .. } => MAD_E_POISONED,
        Error::BadRank { .. } => MAD_E_BAD_RANK,
        Error::InUse { .. } => MAD_E_IN_USE,
        Error::Timeout(_) => MAD_E_TIMEOUT,
        Error::Closed { .. } => MAD_E_CLOSED,
        Error::Auth(_) => MAD_E_AUTH,
        Error::Resource(_) => MAD_E_RESOURCE,
        Error::Io { .. } => MAD_E_IO,
        Error::RemoteFailure { .. } => MAD_E_REMOTE_FAILURE,
        Error::CollectiveTimeout { .. } => MAD_E_COLLECTIVE_TIMEOUT,
        // The caller's message is too long for the channel: an argument that is wrong.
        Error::MessageTooLarge { .. } => MAD_E_BAD_CONFIG,
        _ => MAD_E_IO,
    }
}

#[cold]
#[inline(never)]
fn fail(e: Error) -> c_int {
    let c = code(&e);
    set_last(e.to_string());
    c
}

#[cold]
#[inline(never)]
fn bad(what: &str) -> c_int {
    set_last(format!("bad argument: {what}"));
    MAD_E_BAD_CONFIG
}

/// Run `f`, turning a panic into `MAD_E_PANIC` (never unwinding into C).
#[inline(always)]
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(c) => c,
        Err(p) => panicked(p),
    }
}

#[cold]
#[inline(never)]
fn panicked(p: Box<dyn std::any::Any + Send>) -> c_int {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    set_last(format!("madeleine bug: {what}"));
    MAD_E_PANIC
}

fn send_mode(m: c_int) -> Option<SendMode> {
    match m {
        MAD_SEND_SAFER => Some(SendMode::Safer),
        MAD_SEND_LATER => Some(SendMode::Later),
        MAD_SEND_CHEAPER => Some(SendMode::Cheaper),
        _ => None,
    }
}

fn recv_mode(m: c_int) -> Option<RecvMode> {
    match m {
        MAD_RECV_EXPRESS => Some(RecvMode::Express),
        MAD_RECV_CHEAPER => Some(RecvMode::Cheaper),
        _ => None,
    }
}

/// Pack a SAFER or CHEAPER piece with its modes known at compile time in each arm, as a Rust
/// caller's are: the engine's per-mode paths are inlined and specialised instead of taking
/// the mode as a value (most of what a C call cost beyond a Rust one; LATER is packed apart).
#[inline(always)]
fn pack_bytes<'b>(
    p: &mut Packer<'_, 'b>,
    bytes: &'b [u8],
    s: SendMode,
    r: RecvMode,
) -> madeleine::Result<()> {
    use RecvMode::{Cheaper as RC, Express as RE};
    match (s, r) {
        (SendMode::Cheaper, RC) => p.pack(bytes, RC),
        (SendMode::Cheaper, RE) => p.pack(bytes, RE),
        (_, RC) => p.pack_safer(bytes, RC),
        (_, RE) => p.pack_safer(bytes, RE),
    }
}

/// Unpack a piece with its modes known at compile time in each arm (see [`pack_bytes`]).
#[inline(always)]
fn unpack_bytes<'b>(
    u: &mut Unpacker<'_, 'b>,
    dst: &'b mut [u8],
    s: SendMode,
    r: RecvMode,
) -> madeleine::Result<()> {
    use SendMode::{Cheaper as SC, Later as SL, Safer as SS};
    match (r, s) {
        (RecvMode::Cheaper, SC) => u.unpack(dst, SC),
        (RecvMode::Cheaper, SS) => u.unpack(dst, SS),
        (RecvMode::Cheaper, SL) => u.unpack(dst, SL),
        (RecvMode::Express, SC) => u.unpack_express(dst, SC),
        (RecvMode::Express, SS) => u.unpack_express(dst, SS),
        (RecvMode::Express, SL) => u.unpack_express(dst, SL),
    }
}

/// # Safety
/// `s` is null or a valid, NUL-terminated string.
unsafe fn str_arg<'a>(s: *const c_char, what: &str) -> Result<&'a str, c_int> {
    if s.is_null() {
        return Err(bad(&format!("{what} is NULL")));
    }
    // SAFETY: the caller passes a NUL-terminated string (checked non-null above).
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| bad(&format!("{what} is not UTF-8")))
}

/// Store `v` in `*out` (boxed) and return `MAD_OK`.
///
/// # Safety
/// `out` is a valid pointer (checked non-null by the caller).
unsafe fn put<T>(out: *mut *mut T, v: T) -> c_int {
    // SAFETY: the caller checked `out` and it points to writable storage for a pointer.
    unsafe { *out = Box::into_raw(Box::new(v)) };
    MAD_OK
}

/// The message of the calling thread's last error (empty if none). Valid until the thread's
/// next failing call.
#[no_mangle]
pub extern "C" fn mad_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// The name of a status code (`"MAD_E_TIMEOUT"`), or `"unknown"`.
#[no_mangle]
pub extern "C" fn mad_status_name(status: c_int) -> *const c_char {
    let s: &'static CStr = match status {
        MAD_OK => c"MAD_OK",
        MAD_AGAIN => c"MAD_AGAIN",
        MAD_E_PEER_CLOSED => c"MAD_E_PEER_CLOSED",
        MAD_E_CONNECTION_LOST => c"MAD_E_CONNECTION_LOST",
        MAD_E_UNPACK_MISMATCH => c"MAD_E_UNPACK_MISMATCH",
        MAD_E_UNAVAILABLE => c"MAD_E_UNAVAILABLE",
        MAD_E_BAD_CONFIG => c"MAD_E_BAD_CONFIG",
        MAD_E_PROTOCOL => c"MAD_E_PROTOCOL",
        MAD_E_POISONED => c"MAD_E_POISONED",
        MAD_E_BAD_RANK => c"MAD_E_BAD_RANK",
        MAD_E_IN_USE => c"MAD_E_IN_USE",
        MAD_E_TIMEOUT => c"MAD_E_TIMEOUT",
        MAD_E_CLOSED => c"MAD_E_CLOSED",
        MAD_E_AUTH => c"MAD_E_AUTH",
        MAD_E_RESOURCE => c"MAD_E_RESOURCE",
        MAD_E_IO => c"MAD_E_IO",
        MAD_E_REMOTE_FAILURE => c"MAD_E_REMOTE_FAILURE",
        MAD_E_COLLECTIVE_TIMEOUT => c"MAD_E_COLLECTIVE_TIMEOUT",
        MAD_E_PANIC => c"MAD_E_PANIC",
        _ => c"unknown",
    };
    s.as_ptr()
}

/// Start this process's session: under `madrun`, `mpiexec` (with MPI built in) or alone (a
/// session of one). Logging follows `MAD_LOG` / `RUST_LOG` (to standard error).
///
/// # Safety
/// `out` is a valid pointer to a `MadSession *`.
#[no_mangle]
pub unsafe extern "C" fn mad_session_init(out: *mut *mut MadSession) -> c_int {
    guard(|| {
        if out.is_null() {
            return bad("out is NULL");
        }
        madeleine::init_logging();
        match madeleine::session() {
            // SAFETY: `out` checked above.
            Ok(s) => unsafe { put(out, MadSession { s }) },
            Err(e) => fail(e),
        }
    })
}

/// End the session (its channels stay usable until they are freed). NULL is ignored.
///
/// # Safety
/// `s` is NULL or a session from `mad_session_init`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mad_session_free(s: *mut MadSession) {
    if !s.is_null() {
        // SAFETY: the caller gives back a pointer from `Box::into_raw`, once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(s) })));
    }
}

/// This process's rank in the session.
///
/// # Safety
/// `s` is a valid session.
#[no_mangle]
pub unsafe extern "C" fn mad_session_rank(s: *const MadSession) -> usize {
    // SAFETY: the caller passes a valid session (or NULL, answered with 0).
    unsafe { s.as_ref() }.map_or(0, |s| s.s.rank())
}

/// The number of processes of the session.
///
/// # Safety
/// `s` is a valid session.
#[no_mangle]
pub unsafe extern "C" fn mad_session_size(s: *const MadSession) -> usize {
    // SAFETY: as in `mad_session_rank`.
    unsafe { s.as_ref() }.map_or(0, |s| s.s.size())
}

/// Open the channel `name`, configured by `MAD_CHANNEL_<NAME>`, `MAD_CONFIG` or the default.
/// Collective: every rank opens the same channels in the same order.
///
/// # Safety
/// `s` is a valid session, `name` a NUL-terminated string, `out` a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_open(
    s: *mut MadSession,
    name: *const c_char,
    out: *mut *mut MadChannel,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid session or NULL.
        let (Some(s), false) = (unsafe { s.as_ref() }, out.is_null()) else {
            return bad("session or out is NULL");
        };
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let name = match unsafe { str_arg(name, "name") } {
            Ok(n) => n,
            Err(c) => return c,
        };
        match s.s.open_channel(name) {
            // SAFETY: `out` checked above.
            Ok(ch) => unsafe { put(out, MadChannel::new(ch)) },
            Err(e) => fail(e),
        }
    })
}

/// Open channel `name` with an explicit spec (`"tcp"`, `"shm,ring=4m"`, ...). Collective.
///
/// # Safety
/// As `mad_channel_open`; `spec` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_open_spec(
    s: *mut MadSession,
    name: *const c_char,
    spec: *const c_char,
    out: *mut *mut MadChannel,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid session or NULL.
        let (Some(s), false) = (unsafe { s.as_ref() }, out.is_null()) else {
            return bad("session or out is NULL");
        };
        // SAFETY: NUL-terminated strings or NULL.
        let (name, spec) = match unsafe { (str_arg(name, "name"), str_arg(spec, "spec")) } {
            (Ok(n), Ok(s)) => (n, s),
            (Err(c), _) | (_, Err(c)) => return c,
        };
        let r = madeleine::ChannelConfig::parse(name, spec).and_then(|c| s.s.open_channel_with(c));
        match r {
            // SAFETY: `out` checked above.
            Ok(ch) => unsafe { put(out, MadChannel::new(ch)) },
            Err(e) => fail(e),
        }
    })
}

/// Close the channel: every thread blocked on it, and every later call, gets `MAD_E_CLOSED`;
/// the peers see a clean close. The handle stays valid until `mad_channel_free`.
///
/// # Safety
/// `ch` is a valid channel.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_close(ch: *const MadChannel) {
    // SAFETY: the caller passes a valid channel or NULL.
    if let Some(c) = unsafe { ch.as_ref() } {
        let _ = catch_unwind(AssertUnwindSafe(|| c.ch.close()));
    }
}

/// Close the channel (as `mad_channel_close`: messages still open on it fail with
/// `MAD_E_CLOSED`, the peers see a clean close) and free the handle. A channel freed while
/// some of its message handles are still out keeps its memory for the rest of the process, so
/// that those handles stay valid until ended or abandoned. NULL is ignored.
///
/// # Safety
/// `ch` is NULL or a channel from `mad_channel_open*`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_free(ch: *mut MadChannel) {
    if !ch.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: a pointer from `Box::into_raw`, given back once.
            let c = unsafe { Box::from_raw(ch) };
            c.ch.close();
            if c.tx.any_live() || c.rx.any_live() {
                // Messages are still open: their handles live in this channel and stay valid
                // (their calls fail with `MAD_E_CLOSED`, their ends free nothing), so its
                // memory is kept for the rest of the process.
                Box::leak(c);
            }
        }));
    }
}

/// The channel's readiness descriptor for an event loop (readable when a message may be
/// ready or a blocked send may progress; see the Rust `Channel::readiness_fd`), or -1 when the
/// driver has none (MPI).
///
/// # Safety
/// `ch` is a valid channel.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_readiness_fd(ch: *const MadChannel) -> c_int {
    use std::os::fd::AsRawFd;
    // SAFETY: the caller passes a valid channel or NULL.
    unsafe { ch.as_ref() }
        .and_then(|c| c.ch.readiness_fd().map(|fd| fd.as_raw_fd()))
        .unwrap_or(-1)
}

/// Arm the readiness descriptor before sleeping on it (`poll(2)`): `MAD_OK` when the caller
/// may sleep (anything that happens from now on makes the descriptor readable), `MAD_AGAIN`
/// when something may be ready already (try again first, then arm again). Without arming, a
/// driver need not signal the descriptor (busy traffic then pays nothing for it). After the
/// sleep, [`mad_channel_disarm`].
///
/// # Safety
/// `ch` is a valid channel.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_arm(ch: *const MadChannel) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let Some(c) = (unsafe { ch.as_ref() }) else {
            return bad("channel is NULL");
        };
        match c.ch.arm() {
            Ok(madeleine::Armed::Armed) => MAD_OK,
            Ok(madeleine::Armed::Busy) => MAD_AGAIN,
            Err(e) => fail(e),
        }
    })
}

/// After a [`mad_channel_arm`] that returned `MAD_OK`, once the caller woke up (or gave up
/// waiting) and polls again: the driver may stop watching what only a sleeper needs (tcp takes
/// its sockets out of its epoll set, where every incoming segment costs the kernel work). Pair
/// each `MAD_OK` arm with one disarm; a caller that never disarms is correct but keeps the
/// driver watching. Returns `MAD_OK`, or `MAD_E_BAD_CONFIG` for a NULL channel.
///
/// # Safety
/// `ch` is a valid channel.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_disarm(ch: *const MadChannel) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let Some(c) = (unsafe { ch.as_ref() }) else {
            return bad("channel is NULL");
        };
        c.ch.disarm();
        MAD_OK
    })
}

/// Copy the channel's counters into `*out`.
///
/// # Safety
/// `ch` is a valid channel, `out` a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_stats(ch: *const MadChannel, out: *mut MadStats) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let (Some(c), false) = (unsafe { ch.as_ref() }, out.is_null()) else {
            return bad("channel or out is NULL");
        };
        let st = c.ch.stats();
        // SAFETY: `out` checked above.
        unsafe {
            *out = MadStats {
                messages_sent: st.messages_sent,
                bytes_sent: st.bytes_sent,
                messages_received: st.messages_received,
                bytes_received: st.bytes_received,
            }
        };
        MAD_OK
    })
}

/// The channel's selection table (which TM and BMM each piece size and mode takes), as text:
/// copied into `buf` (at most `len` bytes with the final NUL, like `snprintf`); returns the
/// length of the whole text without the NUL.
///
/// # Safety
/// `ch` is a valid channel; `buf` is NULL or `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn mad_channel_selection_table(
    ch: *const MadChannel,
    buf: *mut c_char,
    len: usize,
) -> usize {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let Some(c) = (unsafe { ch.as_ref() }) else {
            return 0;
        };
        let t = c.ch.selection_table();
        if !buf.is_null() && len > 0 {
            let n = t.len().min(len - 1);
            // SAFETY: `buf` has `len` writable bytes (caller), and `n + 1 <= len`.
            unsafe {
                std::ptr::copy_nonoverlapping(t.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        t.len()
    }));
    r.unwrap_or(0)
}

/// Start a message to rank `remote`.
///
/// # Safety
/// `ch` is a valid channel, `out` a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn mad_begin_packing(
    ch: *const MadChannel,
    remote: usize,
    out: *mut *mut MadPacker,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let (Some(c), false) = (unsafe { ch.as_ref() }, out.is_null()) else {
            return bad("channel or out is NULL");
        };
        let r = c.ch.begin_packing(remote);
        match &r {
            Ok(p) => {
                // The packer borrows the channel's shared state, which outlives it (a channel
                // freed with handles out is kept); the borrowed user memory is the caller's
                // duty (module docs): its lifetimes are erased as it moves to the slot.
                let p: *const Packer<'static, 'static> = std::ptr::from_ref(p).cast();
                // SAFETY: `p` holds the sending half to `remote` and is moved (forgotten
                // below); `out` checked above.
                unsafe { *out = c.tx.put(remote, p) };
                std::mem::forget(r);
                MAD_OK
            }
            Err(_) => r.err().map_or(MAD_OK, fail),
        }
    })
}

/// Pack `len` bytes at `data` with send mode `send` (`MAD_SEND_*`) and receive mode `recv`
/// (`MAD_RECV_*`).
///
/// # Safety
/// `p` is a valid packer; `data` points to `len` readable bytes that stay valid as the send
/// mode says (module docs); for `MAD_SEND_LATER`, nothing writes them during
/// `mad_end_packing`.
#[no_mangle]
pub unsafe extern "C" fn mad_pack(
    p: *mut MadPacker,
    data: *const c_void,
    len: usize,
    send: c_int,
    recv: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid packer or NULL.
        let Some(p) = (unsafe { p.as_mut() }) else {
            return bad("packer is NULL");
        };
        let (Some(s), Some(r)) = (send_mode(send), recv_mode(recv)) else {
            return bad(&format!("send mode {send} or receive mode {recv}"));
        };
        if data.is_null() && len > 0 {
            return bad("data is NULL");
        }
        let bytes: &'static [u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: `data` has `len` readable bytes, valid as the send mode requires
            // (caller's duty, module docs).
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        };
        // SAFETY: a live handle's message is initialised (the caller passes a live packer).
        let p = unsafe { p.msg.assume_init_mut() };
        let r = match s {
            SendMode::Later => {
                // Cells, not bytes: the caller may write them until `mad_end_packing`.
                let cells: &'static [Cell<u8>] = if len == 0 {
                    &[]
                } else {
                    // SAFETY: `Cell<u8>` has the layout of `u8`; `data` has `len` bytes that
                    // stay valid until the end (caller's duty, module docs).
                    unsafe { std::slice::from_raw_parts(data.cast::<Cell<u8>>(), len) }
                };
                p.pack_later(cells, r)
            }
            _ => pack_bytes(p, bytes, s, r),
        };
        match r {
            Ok(()) => MAD_OK,
            Err(e) => fail(e),
        }
    })
}

/// Send the message (LATER pieces are read now). Frees the packer, whatever the outcome.
///
/// # Safety
/// `p` is a packer from `mad_begin_packing`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mad_end_packing(p: *mut MadPacker) -> c_int {
    guard(|| {
        if p.is_null() {
            return bad("packer is NULL");
        }
        // SAFETY: a handle from `mad_begin_packing`, given back once; the packer is only
        // dropped after `end_packing_in_place`.
        let r = unsafe { end_in_place(p, |m| m.end_packing_in_place()) };
        match r {
            Ok(()) => MAD_OK,
            Err(e) => fail(e),
        }
    })
}

/// Abandon a message being built (as dropping a Rust `Packer`: discarded if nothing of it
/// left, else the connection is closed both ways). NULL is ignored.
///
/// # Safety
/// `p` is NULL or a packer from `mad_begin_packing`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mad_packer_abandon(p: *mut MadPacker) {
    if !p.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: a handle from `mad_begin_packing`, given back once.
            drop(unsafe { release(p) })
        }));
    }
}

/// One piece of a message sent with `mad_send` or received with `mad_recv`: `len` bytes at
/// `data` with a send mode (`MAD_SEND_*`) and a receive mode (`MAD_RECV_*`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MadPiece {
    /// The bytes (read by `mad_send`, written by `mad_recv`).
    pub data: *mut c_void,
    /// Their length.
    pub len: usize,
    /// The send mode, `MAD_SEND_*`.
    pub send: c_int,
    /// The receive mode, `MAD_RECV_*`.
    pub recv: c_int,
}

/// `mad_recv`'s `remote` for a message from any peer.
pub const MAD_ANY_SOURCE: usize = usize::MAX;

/// The pieces of a `mad_send` / `mad_recv` call (checked), or a status.
///
/// # Safety
/// `pieces` is NULL with `n == 0`, or points to `n` pieces.
#[inline(always)]
unsafe fn piece_list<'a>(pieces: *const MadPiece, n: usize) -> Result<&'a [MadPiece], c_int> {
    if n == 0 {
        return Ok(&[]);
    }
    if pieces.is_null() {
        return Err(bad("pieces is NULL"));
    }
    // SAFETY: `n` readable pieces (caller's duty).
    let list = unsafe { std::slice::from_raw_parts(pieces, n) };
    let ok = |p: &MadPiece| {
        (!p.data.is_null() || p.len == 0)
            && (MAD_SEND_SAFER..=MAD_SEND_CHEAPER).contains(&p.send)
            && (MAD_RECV_EXPRESS..=MAD_RECV_CHEAPER).contains(&p.recv)
    };
    if list.iter().all(ok) {
        Ok(list)
    } else {
        Err(bad_piece(list))
    }
}

/// The error of the first bad piece of `list`.
#[cold]
#[inline(never)]
fn bad_piece(list: &[MadPiece]) -> c_int {
    for (i, p) in list.iter().enumerate() {
        if p.data.is_null() && p.len > 0 {
            return bad(&format!("piece {i}: data is NULL"));
        }
        if send_mode(p.send).is_none() || recv_mode(p.recv).is_none() {
            return bad(&format!(
                "piece {i}: send mode {} or receive mode {}",
                p.send, p.recv
            ));
        }
    }
    bad("pieces")
}

/// The memory of a received piece `p` (checked by [`piece_list`]).
///
/// # Safety
/// `p.data` has `p.len` writable bytes, valid for the call.
unsafe fn piece_bytes<'a>(p: &MadPiece) -> &'a mut [u8] {
    if p.len == 0 {
        &mut []
    } else {
        // SAFETY: checked non-null; valid for the call (caller's duty).
        unsafe { std::slice::from_raw_parts_mut(p.data.cast::<u8>(), p.len) }
    }
}

/// Send a whole message to rank `remote` in one call: its `n` pieces in order, each with its
/// modes, as `mad_begin_packing`, one `mad_pack` per piece and `mad_end_packing` would (every
/// piece is read before this returns, whatever its send mode).
///
/// # Safety
/// `ch` is a valid channel; `pieces` points to `n` pieces whose `data` has `len` readable
/// bytes each (NULL with `n == 0`).
#[no_mangle]
pub unsafe extern "C" fn mad_send(
    ch: *const MadChannel,
    remote: usize,
    pieces: *const MadPiece,
    n: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let Some(c) = (unsafe { ch.as_ref() }) else {
            return bad("channel is NULL");
        };
        // SAFETY: forwarded caller guarantees.
        let list = match unsafe { piece_list(pieces, n) } {
            Ok(l) => l,
            Err(rc) => return rc,
        };
        let r = (|| {
            let mut p = c.ch.begin_packing(remote)?;
            // The whole message is in this call: its EXPRESS pieces go out with the rest.
            p.flush_at_end();
            for piece in list {
                let bytes: &[u8] = if piece.len == 0 {
                    &[]
                } else {
                    // SAFETY: checked non-null; `len` readable bytes, valid for this call
                    // (caller's duty).
                    unsafe { std::slice::from_raw_parts(piece.data.cast::<u8>(), piece.len) }
                };
                let r = recv_mode(piece.recv).unwrap_or(RecvMode::Express);
                match send_mode(piece.send).unwrap_or(SendMode::Safer) {
                    s @ (SendMode::Safer | SendMode::Cheaper) => pack_bytes(&mut p, bytes, s, r)?,
                    SendMode::Later => {
                        // SAFETY: `Cell<u8>` has the layout of `u8`; the bytes stay valid
                        // for this call, in which the message ends (built from the caller's
                        // pointer, as `mad_pack` does).
                        let cells: &[Cell<u8>] = unsafe {
                            std::slice::from_raw_parts(piece.data.cast::<Cell<u8>>(), piece.len)
                        };
                        p.pack_later(cells, r)?
                    }
                }
            }
            p.end_packing()
        })();
        match r {
            Ok(()) => MAD_OK,
            Err(e) => fail(e),
        }
    })
}

/// Receive a whole message in one call: from rank `remote`, or from any peer with
/// `MAD_ANY_SOURCE` (then `*from`, unless NULL, is the sender), its `n` pieces in order into
/// the pieces' memory, each declared with the modes it was packed with. Everything is there
/// when this returns.
///
/// # Safety
/// `ch` is a valid channel; `pieces` points to `n` pieces whose `data` has `len` writable
/// bytes each (NULL with `n == 0`); `from` is NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn mad_recv(
    ch: *const MadChannel,
    remote: usize,
    pieces: *const MadPiece,
    n: usize,
    from: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let Some(c) = (unsafe { ch.as_ref() }) else {
            return bad("channel is NULL");
        };
        // SAFETY: forwarded caller guarantees.
        let list = match unsafe { piece_list(pieces, n) } {
            Ok(l) => l,
            Err(rc) => return rc,
        };
        let r = (|| {
            let mut u = if remote == MAD_ANY_SOURCE {
                c.ch.begin_unpacking()?
            } else {
                c.ch.begin_unpacking_from(remote)?
            };
            if !from.is_null() {
                // SAFETY: checked non-null, valid (caller's duty).
                unsafe { *from = u.remote() };
            }
            for piece in list {
                // SAFETY: `len` writable bytes, valid for this call (caller's duty).
                let dst = unsafe { piece_bytes(piece) };
                let s = send_mode(piece.send).unwrap_or(SendMode::Safer);
                let r = recv_mode(piece.recv).unwrap_or(RecvMode::Express);
                unpack_bytes(&mut u, dst, s, r)?;
            }
            u.end_unpacking()
        })();
        match r {
            Ok(()) => MAD_OK,
            Err(e) => fail(e),
        }
    })
}

/// Start a message received from `MadChannel` `c` by `begin` (`Ok(None)`: none yet).
///
/// # Safety
/// `ch` is NULL or a valid channel; `out` NULL or a valid pointer.
#[inline(always)]
unsafe fn begin_recv(
    ch: *const MadChannel,
    out: *mut *mut MadUnpacker,
    begin: impl FnOnce(&Channel) -> madeleine::Result<Option<Unpacker<'_, 'static>>>,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid channel or NULL.
        let (Some(c), false) = (unsafe { ch.as_ref() }, out.is_null()) else {
            return bad("channel or out is NULL");
        };
        let r = begin(&c.ch);
        match &r {
            Ok(Some(u)) => {
                // As in `mad_begin_packing`: the channel outlives the unpacker, the user
                // memory is the caller's duty.
                let from = u.remote();
                let u: *const Unpacker<'static, 'static> = std::ptr::from_ref(u).cast();
                // SAFETY: `u` holds the receiving half from `from` and is moved (forgotten
                // below); `out` checked above.
                unsafe { *out = c.rx.put(from, u) };
                std::mem::forget(r);
                MAD_OK
            }
            Ok(None) => MAD_AGAIN,
            Err(_) => r.err().map_or(MAD_OK, fail),
        }
    })
}

/// Wait for the next message from any peer.
///
/// # Safety
/// `ch` is a valid channel, `out` a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn mad_begin_unpacking(
    ch: *const MadChannel,
    out: *mut *mut MadUnpacker,
) -> c_int {
    // SAFETY: forwarded caller guarantees.
    unsafe { begin_recv(ch, out, |c| c.begin_unpacking().map(Some)) }
}

/// Wait for the next message from rank `remote`.
///
/// # Safety
/// As `mad_begin_unpacking`.
#[no_mangle]
pub unsafe extern "C" fn mad_begin_unpacking_from(
    ch: *const MadChannel,
    remote: usize,
    out: *mut *mut MadUnpacker,
) -> c_int {
    // SAFETY: forwarded caller guarantees.
    unsafe { begin_recv(ch, out, |c| c.begin_unpacking_from(remote).map(Some)) }
}

/// Non-blocking: the next message from any peer if one has begun to arrive, else `MAD_AGAIN`
/// (nothing consumed).
///
/// # Safety
/// As `mad_begin_unpacking`.
#[no_mangle]
pub unsafe extern "C" fn mad_try_begin_unpacking(
    ch: *const MadChannel,
    out: *mut *mut MadUnpacker,
) -> c_int {
    // SAFETY: forwarded caller guarantees.
    unsafe { begin_recv(ch, out, |c| c.try_begin_unpacking()) }
}

/// Non-blocking: the next message from `remote` if it has begun to arrive, else `MAD_AGAIN`.
///
/// # Safety
/// As `mad_begin_unpacking`.
#[no_mangle]
pub unsafe extern "C" fn mad_try_begin_unpacking_from(
    ch: *const MadChannel,
    remote: usize,
    out: *mut *mut MadUnpacker,
) -> c_int {
    // SAFETY: forwarded caller guarantees.
    unsafe { begin_recv(ch, out, |c| c.try_begin_unpacking_from(remote)) }
}

/// The rank the message comes from.
///
/// # Safety
/// `u` is a valid unpacker.
#[no_mangle]
pub unsafe extern "C" fn mad_unpacker_remote(u: *const MadUnpacker) -> usize {
    // SAFETY: the caller passes a valid unpacker or NULL (answered with `SIZE_MAX`).
    // and a live handle's message is initialised.
    unsafe { u.as_ref() }.map_or(usize::MAX, |u| unsafe { u.msg.assume_init_ref() }.remote())
}

/// Unpack the next piece, `len` bytes, into `buf`: `recv` must be the receive mode it was
/// packed with and `send` its send mode. `MAD_RECV_EXPRESS`: there when this returns;
/// `MAD_RECV_CHEAPER`: there after `mad_end_unpacking` (keep `buf` valid until then).
///
/// # Safety
/// `u` is a valid unpacker; `buf` points to `len` writable bytes, valid as the mode says.
#[no_mangle]
pub unsafe extern "C" fn mad_unpack(
    u: *mut MadUnpacker,
    buf: *mut c_void,
    len: usize,
    send: c_int,
    recv: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: the caller passes a valid unpacker or NULL.
        let Some(u) = (unsafe { u.as_mut() }) else {
            return bad("unpacker is NULL");
        };
        let (Some(s), Some(r)) = (send_mode(send), recv_mode(recv)) else {
            return bad(&format!("send mode {send} or receive mode {recv}"));
        };
        if buf.is_null() && len > 0 {
            return bad("buf is NULL");
        }
        let dst: &'static mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: `buf` has `len` writable bytes, valid as the receive mode requires
            // (caller's duty, module docs).
            unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
        };
        // SAFETY: a live handle's message is initialised (the caller passes a live unpacker).
        let u = unsafe { u.msg.assume_init_mut() };
        match unpack_bytes(u, dst, s, r) {
            Ok(()) => MAD_OK,
            Err(e) => fail(e),
        }
    })
}

/// Finish the message: every CHEAPER destination is filled. Frees the unpacker, whatever
/// the outcome.
///
/// # Safety
/// `u` is an unpacker from `mad_begin_unpacking*`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mad_end_unpacking(u: *mut MadUnpacker) -> c_int {
    guard(|| {
        if u.is_null() {
            return bad("unpacker is NULL");
        }
        // SAFETY: a handle from `mad_begin_unpacking*`, given back once; the unpacker is
        // only dropped after `end_unpacking_in_place`.
        let r = unsafe { end_in_place(u, |m| m.end_unpacking_in_place()) };
        match r {
            Ok(()) => MAD_OK,
            Err(e) => fail(e),
        }
    })
}

/// Abandon a message being received (as dropping a Rust `Unpacker`: the connection is closed
/// both ways). NULL is ignored.
///
/// # Safety
/// `u` is NULL or an unpacker from `mad_begin_unpacking*`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mad_unpacker_abandon(u: *mut MadUnpacker) {
    if !u.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: a handle from `mad_begin_unpacking*`, given back once.
            drop(unsafe { release(u) })
        }));
    }
}
