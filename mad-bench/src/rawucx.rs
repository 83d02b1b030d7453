//! Raw UCX baselines (feature `bench-ucx`): UCP tag send / receive between the ranks, each
//! endpoint its own UCP context and worker (so the two endpoints of the two-thread patterns
//! never share one), linked against the system's `libucp` / `libucs` (Debian: `libucx-dev`).
//!
//! * `raw-ucx-shm`: `UCX_TLS=posix,sysv,cma,self` (shared-memory rings for small messages,
//!   CMA single copy for large ones), compared with `shm` and `sisci:local`;
//! * `raw-ucx-tcp`: `UCX_TLS=tcp,self` on the loopback device only (`UCX_NET_DEVICES=lo`, as
//!   the raw TCP baselines use 127.0.0.1), compared with `tcp`.
//!
//! The transports are set on the UCP configuration (`ucp_config_modify`) after it was read
//! from the environment, so other `UCX_*` variables still apply. Every operation is blocking
//! the way UCX's own `ucx_perftest` is: post (`ucp_tag_send_nbx` / `ucp_tag_recv_nbx`), then
//! busy-poll `ucp_worker_progress` until the request completes (UCX's default progress mode),
//! yielding the processor every [`SPINS_BEFORE_YIELD`] empty polls like the raw ring, so more
//! polling threads than cores (the two-thread patterns on two cores) still progress. The tag is
//! the sender's rank, matched in full. Empty messages are sent as such (UCX carries them).
//!
//! Opening is collective and agreed: if UCX cannot start on any rank (library too old, no
//! transport, no reachable peer, the wire-up exchange times out), every rank gets
//! [`Error::Unavailable`] with that rank's reason, and `mad-bench` goes on without the baseline.
//!
//! Only the few UCP calls used here are declared, by hand, with the structure layouts of UCX
//! 1.13's `ucp/api/ucp.h` (checked below by size; UCX only appends fields and reads those
//! named in each `field_mask`).

#![allow(unsafe_code)]

use std::ffi::{c_uint, c_void, CStr, CString};
use std::ptr;
use std::time::{Duration, Instant};

use mad_core::{Error, Result, Session};

use super::net::{Net, STALL};

/// The UCP API this file's declarations follow (`UCP_API_MAJOR`, `UCP_API_MINOR` of 1.13).
const API: (c_uint, c_uint) = (1, 13);
/// The oldest library with the `*_nbx` calls used here.
const OLDEST: (c_uint, c_uint) = (1, 10);
/// Empty progress calls between two `sched_yield`s.
pub const SPINS_BEFORE_YIELD: u32 = 4096;
/// How long the wire-up exchange of [`RawUcx::open`] may take.
const WIREUP: Duration = Duration::from_secs(20);
/// How long closing an endpoint may take at drop.
const CLOSE: Duration = Duration::from_secs(2);

#[allow(non_camel_case_types, dead_code)]
mod ffi {
    use std::ffi::{c_char, c_int, c_uint, c_void};

    /// `ucs_status_t` (a C enum: `int`).
    pub type ucs_status_t = c_int;
    pub const UCS_OK: ucs_status_t = 0;
    pub const UCS_INPROGRESS: ucs_status_t = 1;
    pub const UCS_ERR_MESSAGE_TRUNCATED: ucs_status_t = -9;
    /// `UCS_ERR_LAST`: a status pointer at or above `(uintptr_t)UCS_ERR_LAST` is an error.
    pub const UCS_ERR_LAST: ucs_status_t = -100;

    pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
    pub const UCP_PARAM_FIELD_ESTIMATED_NUM_EPS: u64 = 1 << 6;
    pub const UCP_FEATURE_TAG: u64 = 1 << 0;
    pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
    pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
    pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
    pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
    pub const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
    pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
    pub const UCP_OP_ATTR_FIELD_RECV_INFO: u32 = 1 << 7;
    pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

    pub enum ucp_config {}
    pub enum ucp_context {}
    pub enum ucp_worker {}
    pub enum ucp_ep {}
    pub enum ucp_address {}

    /// `ucp_params_t` (80 bytes in 1.13).
    #[repr(C)]
    pub struct ucp_params_t {
        pub field_mask: u64,
        pub features: u64,
        pub request_size: usize,
        pub request_init: Option<unsafe extern "C" fn(*mut c_void)>,
        pub request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
        pub tag_sender_mask: u64,
        pub mt_workers_shared: c_int,
        pub estimated_num_eps: usize,
        pub estimated_num_ppn: usize,
        pub name: *const c_char,
    }

    /// `ucp_worker_params_t` (200 bytes in 1.13): `field_mask`, `thread_mode`, then fields this
    /// file never names (zeroed, and not in the mask).
    #[repr(C)]
    pub struct ucp_worker_params_t {
        pub field_mask: u64,
        pub thread_mode: c_int,
        pub _pad: u32,
        pub _rest: [u64; 23],
    }

    /// `ucp_ep_params_t` (104 bytes in 1.13): `field_mask`, `address`, `err_mode`, then fields
    /// this file never names.
    #[repr(C)]
    pub struct ucp_ep_params_t {
        pub field_mask: u64,
        pub address: *const ucp_address,
        pub err_mode: c_int,
        pub _pad: u32,
        pub _rest: [u64; 10],
    }

    /// `ucp_request_param_t` (72 bytes in 1.13); `cb` and `recv_info` are unions of pointers.
    #[repr(C)]
    pub struct ucp_request_param_t {
        pub op_attr_mask: u32,
        pub flags: u32,
        pub request: *mut c_void,
        pub cb: *const c_void,
        pub datatype: u64,
        pub user_data: *mut c_void,
        pub reply_buffer: *mut c_void,
        pub memory_type: c_int,
        pub _pad: u32,
        pub recv_info: *mut ucp_tag_recv_info_t,
        pub memh: *mut c_void,
    }

    /// `ucp_tag_recv_info_t`.
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    pub struct ucp_tag_recv_info_t {
        pub sender_tag: u64,
        pub length: usize,
    }

    const _: () = assert!(std::mem::size_of::<ucp_params_t>() == 80);
    const _: () = assert!(std::mem::size_of::<ucp_worker_params_t>() == 200);
    const _: () = assert!(std::mem::size_of::<ucp_ep_params_t>() == 104);
    const _: () = assert!(std::mem::size_of::<ucp_request_param_t>() == 72);
    const _: () = assert!(std::mem::size_of::<ucp_tag_recv_info_t>() == 16);

    #[link(name = "ucp")]
    extern "C" {
        pub fn ucp_get_version(major: *mut c_uint, minor: *mut c_uint, release: *mut c_uint);
        pub fn ucp_config_read(
            env_prefix: *const c_char,
            filename: *const c_char,
            config_p: *mut *mut ucp_config,
        ) -> ucs_status_t;
        pub fn ucp_config_modify(
            config: *mut ucp_config,
            name: *const c_char,
            value: *const c_char,
        ) -> ucs_status_t;
        pub fn ucp_config_release(config: *mut ucp_config);
        pub fn ucp_init_version(
            api_major_version: c_uint,
            api_minor_version: c_uint,
            params: *const ucp_params_t,
            config: *const ucp_config,
            context_p: *mut *mut ucp_context,
        ) -> ucs_status_t;
        pub fn ucp_cleanup(context: *mut ucp_context);
        pub fn ucp_worker_create(
            context: *mut ucp_context,
            params: *const ucp_worker_params_t,
            worker_p: *mut *mut ucp_worker,
        ) -> ucs_status_t;
        pub fn ucp_worker_destroy(worker: *mut ucp_worker);
        pub fn ucp_worker_get_address(
            worker: *mut ucp_worker,
            address_p: *mut *mut ucp_address,
            address_length_p: *mut usize,
        ) -> ucs_status_t;
        pub fn ucp_worker_release_address(worker: *mut ucp_worker, address: *mut ucp_address);
        pub fn ucp_worker_progress(worker: *mut ucp_worker) -> c_uint;
        pub fn ucp_ep_create(
            worker: *mut ucp_worker,
            params: *const ucp_ep_params_t,
            ep_p: *mut *mut ucp_ep,
        ) -> ucs_status_t;
        pub fn ucp_ep_close_nbx(ep: *mut ucp_ep, param: *const ucp_request_param_t) -> *mut c_void;
        pub fn ucp_tag_send_nbx(
            ep: *mut ucp_ep,
            buffer: *const c_void,
            count: usize,
            tag: u64,
            param: *const ucp_request_param_t,
        ) -> *mut c_void;
        pub fn ucp_tag_recv_nbx(
            worker: *mut ucp_worker,
            buffer: *mut c_void,
            count: usize,
            tag: u64,
            tag_mask: u64,
            param: *const ucp_request_param_t,
        ) -> *mut c_void;
        pub fn ucp_tag_recv_request_test(
            request: *mut c_void,
            info: *mut ucp_tag_recv_info_t,
        ) -> ucs_status_t;
        pub fn ucp_request_check_status(request: *mut c_void) -> ucs_status_t;
        pub fn ucp_request_free(request: *mut c_void);
    }

    #[link(name = "ucs")]
    extern "C" {
        pub fn ucs_status_string(status: ucs_status_t) -> *const c_char;
    }

    impl ucp_request_param_t {
        /// No attribute: contiguous bytes, no callback, requests allocated by UCP.
        pub fn empty() -> Self {
            ucp_request_param_t {
                op_attr_mask: 0,
                flags: 0,
                request: std::ptr::null_mut(),
                cb: std::ptr::null(),
                datatype: 0,
                user_data: std::ptr::null_mut(),
                reply_buffer: std::ptr::null_mut(),
                memory_type: 0,
                _pad: 0,
                recv_info: std::ptr::null_mut(),
                memh: std::ptr::null_mut(),
            }
        }
    }
}

use ffi::*;

/// Which UCX transports a baseline uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `posix,sysv,cma,self`.
    Shm,
    /// `tcp,self` on `lo`.
    Tcp,
}

impl Transport {
    /// The baseline's name.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "raw-ucx-shm",
            Transport::Tcp => "raw-ucx-tcp",
        }
    }

    /// UCP configuration entries (names without the `UCX_` prefix).
    fn config(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Transport::Shm => &[("TLS", "posix,sysv,cma,self")],
            Transport::Tcp => &[("TLS", "tcp,self"), ("NET_DEVICES", "lo")],
        }
    }
}

/// UCX's text for a status.
fn status_text(st: ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any status value and returns a pointer to a static
    // NUL-terminated string (or "unknown error" text), never null.
    let p = unsafe { ucs_status_string(st) };
    if p.is_null() {
        return format!("UCX status {st}");
    }
    // SAFETY: non-null, NUL-terminated and static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Whether a `ucs_status_ptr_t` is an error code (`UCS_PTR_IS_ERR`).
fn ptr_is_err(p: *mut c_void) -> bool {
    p as usize >= UCS_ERR_LAST as isize as usize
}

/// One UCP context and its worker (single-threaded), destroyed in that order's reverse.
struct Worker {
    context: *mut ucp_context,
    worker: *mut ucp_worker,
}

impl Worker {
    /// Read the configuration from the environment, set `t`'s transports, create the context
    /// (tag feature) and a single-threaded worker; returns the worker and its address.
    fn new(t: Transport) -> std::result::Result<(Worker, Vec<u8>), String> {
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        unsafe { ucp_get_version(&mut major, &mut minor, &mut release) };
        if (major, minor) < OLDEST || major != API.0 {
            return Err(format!(
                "UCX {major}.{minor}.{release} is not supported (1.{}+ with API 1.x needed)",
                OLDEST.1
            ));
        }
        let mut config: *mut ucp_config = ptr::null_mut();
        // SAFETY: null prefix and file name mean "UCX_" and no file; `config` is an out-pointer.
        let st = unsafe { ucp_config_read(ptr::null(), ptr::null(), &mut config) };
        if st != UCS_OK || config.is_null() {
            return Err(format!("ucp_config_read: {}", status_text(st)));
        }
        let mut res = Ok(());
        for (k, v) in t.config() {
            let (ck, cv) = (
                CString::new(*k).expect("static name"),
                CString::new(*v).expect("static value"),
            );
            // SAFETY: `config` came from ucp_config_read and is not released yet; both strings
            // are NUL-terminated and outlive the call (UCX copies the value).
            let st = unsafe { ucp_config_modify(config, ck.as_ptr(), cv.as_ptr()) };
            if st != UCS_OK {
                res = Err(format!("ucp_config_modify {k}={v}: {}", status_text(st)));
                break;
            }
        }
        let mut context: *mut ucp_context = ptr::null_mut();
        if res.is_ok() {
            let params = ucp_params_t {
                field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS,
                features: UCP_FEATURE_TAG,
                request_size: 0,
                request_init: None,
                request_cleanup: None,
                tag_sender_mask: 0,
                mt_workers_shared: 0,
                estimated_num_eps: 1,
                estimated_num_ppn: 0,
                name: ptr::null(),
            };
            // SAFETY: `params` follows the 1.13 layout (size checked) with only the fields of
            // its mask meaningful; `config` is valid; `context` is an out-pointer.
            let st = unsafe { ucp_init_version(API.0, API.1, &params, config, &mut context) };
            if st != UCS_OK || context.is_null() {
                res = Err(format!("ucp_init: {}", status_text(st)));
            }
        }
        // SAFETY: `config` is valid and no longer used (the context copied what it needed).
        unsafe { ucp_config_release(config) };
        res?;
        let wp = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: UCS_THREAD_MODE_SINGLE,
            _pad: 0,
            _rest: [0; 23],
        };
        let mut worker: *mut ucp_worker = ptr::null_mut();
        // SAFETY: `context` is a live context, `wp` follows the 1.13 layout; out-pointer.
        let st = unsafe { ucp_worker_create(context, &wp, &mut worker) };
        if st != UCS_OK || worker.is_null() {
            // SAFETY: the context is live and has no worker.
            unsafe { ucp_cleanup(context) };
            return Err(format!("ucp_worker_create: {}", status_text(st)));
        }
        let w = Worker { context, worker };
        let (mut addr, mut len): (*mut ucp_address, usize) = (ptr::null_mut(), 0);
        // SAFETY: live worker; two out-pointers.
        let st = unsafe { ucp_worker_get_address(w.worker, &mut addr, &mut len) };
        if st != UCS_OK || addr.is_null() {
            return Err(format!("ucp_worker_get_address: {}", status_text(st)));
        }
        // SAFETY: UCX returned `len` readable bytes at `addr`, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker, released once.
        unsafe { ucp_worker_release_address(w.worker, addr) };
        Ok((w, bytes))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: both handles are live and owned by this value; the worker (and the endpoints
        // UCX still holds on it) goes before its context.
        unsafe {
            ucp_worker_destroy(self.worker);
            ucp_cleanup(self.context);
        }
    }
}

/// A raw UCX endpoint set: one worker, one UCP endpoint per peer.
pub struct RawUcx {
    name: &'static str,
    me: usize,
    /// `None` once leaked (see [`RawUcx::broken`]).
    w: Option<Worker>,
    /// Per rank; null for this rank.
    eps: Vec<*mut ucp_ep>,
    /// An operation timed out with a request still pending: UCX may still own a buffer of a
    /// returned call, so this worker is never progressed nor destroyed again (leaked: it only
    /// touches user buffers from inside `ucp_worker_progress`, which is no longer called).
    broken: Option<String>,
}

// SAFETY: the worker is created in single-thread mode and every use of it (and of its
// endpoints) goes through `&mut self`, so one thread at a time calls into it; moving that use
// to another thread between calls is what UCS_THREAD_MODE_SINGLE allows (no thread-local state
// in a UCP worker, no callback registered here).
unsafe impl Send for RawUcx {}

/// What a pending operation is, for its error messages and completion test.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    Recv,
}

impl RawUcx {
    /// Create this rank's worker, exchange worker addresses through the bootstrap, connect to
    /// every peer and run one empty message each way with each (collective; `tag` unique per
    /// endpoint set). [`Error::Unavailable`] on every rank when any rank could not.
    pub fn open(session: &Session, tag: &str, t: Transport) -> Result<RawUcx> {
        let b = session.bootstrap();
        let (me, n) = (b.rank(), b.size());
        let local = Worker::new(t);
        let mine = match &local {
            Ok((_, addr)) => [&[1u8][..], addr].concat(),
            Err(why) => [&[0u8][..], why.as_bytes()].concat(),
        };
        let all = b.allgather(&format!("bench/{tag}/ucx-addr"), &mine)?;
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v.first() != Some(&1)) {
            return Err(Error::unavailable(
                t.name(),
                format!(
                    "rank {r}: {}",
                    String::from_utf8_lossy(v.get(1..).unwrap_or_default())
                ),
            ));
        }
        let (w, _) = local.map_err(|why| Error::unavailable(t.name(), why))?;
        let mut u = RawUcx {
            name: t.name(),
            me,
            w: Some(w),
            eps: vec![ptr::null_mut(); n],
            broken: None,
        };
        let up = u.connect(&all).and_then(|()| u.wireup());
        let verdict = match &up {
            Ok(()) => vec![1u8],
            Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
        };
        let all = b.allgather(&format!("bench/{tag}/ucx-up"), &verdict)?;
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v.first() != Some(&1)) {
            return Err(Error::unavailable(
                t.name(),
                format!(
                    "rank {r}: {}",
                    String::from_utf8_lossy(v.get(1..).unwrap_or_default())
                ),
            ));
        }
        Ok(u)
    }

    fn worker(&self) -> Result<*mut ucp_worker> {
        match (&self.w, &self.broken) {
            (Some(w), None) => Ok(w.worker),
            (_, why) => Err(Error::BadConfig(format!(
                "{}: unusable after an earlier failure ({})",
                self.name,
                why.as_deref().unwrap_or("no worker")
            ))),
        }
    }

    fn ep(&self, peer: usize) -> Result<*mut ucp_ep> {
        self.eps
            .get(peer)
            .copied()
            .filter(|e| !e.is_null())
            .ok_or_else(|| Error::BadConfig(format!("{}: no endpoint to rank {peer}", self.name)))
    }

    /// Create an endpoint to every peer from its address (`all[r]` = 1 then the address).
    fn connect(&mut self, all: &[Vec<u8>]) -> Result<()> {
        let worker = self.worker()?;
        for (r, a) in all.iter().enumerate() {
            if r == self.me {
                continue;
            }
            let params = ucp_ep_params_t {
                field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                address: a[1..].as_ptr() as *const ucp_address,
                err_mode: UCP_ERR_HANDLING_MODE_NONE,
                _pad: 0,
                _rest: [0; 10],
            };
            let mut ep: *mut ucp_ep = ptr::null_mut();
            // SAFETY: live worker; `params` follows the 1.13 layout and points to the peer's
            // packed worker address (as ucp_worker_get_address produced it), which UCX unpacks
            // during the call; out-pointer.
            let st = unsafe { ucp_ep_create(worker, &params, &mut ep) };
            if st != UCS_OK || ep.is_null() {
                return Err(Error::unavailable(
                    self.name,
                    format!("ucp_ep_create to rank {r}: {}", status_text(st)),
                ));
            }
            self.eps[r] = ep;
        }
        Ok(())
    }

    /// One empty message each way with every peer, lower rank first (connection wire-up).
    fn wireup(&mut self) -> Result<()> {
        for peer in 0..self.eps.len() {
            if peer == self.me {
                continue;
            }
            let mut none = [0u8; 0];
            if self.me < peer {
                self.send_for(peer, &[], WIREUP)?;
                self.recv_for(peer, &mut none, WIREUP)?;
            } else {
                self.recv_for(peer, &mut none, WIREUP)?;
                self.send_for(peer, &[], WIREUP)?;
            }
        }
        Ok(())
    }

    fn send_for(&mut self, peer: usize, msg: &[u8], limit: Duration) -> Result<()> {
        self.worker()?;
        let ep = self.ep(peer)?;
        let param = ucp_request_param_t::empty();
        // SAFETY: live endpoint; `msg` is valid for `msg.len()` bytes and stays borrowed until
        // `finish` returns, which is after the request completed (or after the worker was set
        // aside for good, see `broken`); the tag is this rank's.
        let req = unsafe {
            ucp_tag_send_nbx(
                ep,
                msg.as_ptr() as *const c_void,
                msg.len(),
                self.me as u64,
                &param,
            )
        };
        self.finish(req, peer, Op::Send, limit, None).map(|_| ())
    }

    fn recv_for(&mut self, peer: usize, buf: &mut [u8], limit: Duration) -> Result<usize> {
        let worker = self.worker()?;
        // UCX 1.13 leaves `recv_info` untouched when the receive completes inside the call (a
        // message already there): the sentinel then stands for "the whole buffer", which is
        // all a completed receive can be but shorter (a longer message fails as truncated).
        // Completion through a request reports the length, checked below.
        let mut info = ucp_tag_recv_info_t {
            sender_tag: 0,
            length: usize::MAX,
        };
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
        param.recv_info = &mut info;
        // SAFETY: live worker; `buf` is valid for writes of `buf.len()` bytes and stays
        // borrowed until `finish` returns (request completed, or the worker set aside for
        // good); `info` outlives the call (UCX fills it only on immediate completion). The tag
        // is the sender's rank, matched in full.
        let req = unsafe {
            ucp_tag_recv_nbx(
                worker,
                buf.as_mut_ptr() as *mut c_void,
                buf.len(),
                peer as u64,
                u64::MAX,
                &param,
            )
        };
        let immediate = ucp_tag_recv_info_t {
            length: if info.length == usize::MAX {
                buf.len()
            } else {
                info.length
            },
            ..info
        };
        let got = self.finish(req, peer, Op::Recv, limit, Some(immediate))?;
        if got != buf.len() {
            return Err(Error::protocol(
                peer,
                format!(
                    "{}: message of {got} bytes, expected {}",
                    self.name,
                    buf.len()
                ),
            ));
        }
        Ok(got)
    }

    /// Progress the worker until `req` (what a `*_nbx` call returned) completes; frees it.
    /// Returns the received length for a receive (`immediate`: the info of a receive that
    /// completed in the call).
    fn finish(
        &mut self,
        req: *mut c_void,
        peer: usize,
        op: Op,
        limit: Duration,
        immediate: Option<ucp_tag_recv_info_t>,
    ) -> Result<usize> {
        let what = if op == Op::Send {
            "send to"
        } else {
            "receive from"
        };
        if req.is_null() {
            return Ok(immediate.map_or(0, |i| i.length));
        }
        if ptr_is_err(req) {
            return Err(self.failed(peer, what, req as isize as ucs_status_t));
        }
        let worker = self.worker()?;
        let mut info = ucp_tag_recv_info_t::default();
        let (mut spins, mut since) = (0u32, None::<Instant>);
        loop {
            let st = match op {
                // SAFETY: `req` is a live receive request of this worker (not freed yet).
                Op::Recv => unsafe { ucp_tag_recv_request_test(req, &mut info) },
                // SAFETY: `req` is a live request of this worker (not freed yet).
                Op::Send => unsafe { ucp_request_check_status(req) },
            };
            if st != UCS_INPROGRESS {
                // SAFETY: the request completed; it is released once, here.
                unsafe { ucp_request_free(req) };
                if st != UCS_OK {
                    return Err(self.failed(peer, what, st));
                }
                return Ok(info.length);
            }
            // SAFETY: live worker, used by this thread only (`&mut self`).
            if unsafe { ucp_worker_progress(worker) } != 0 {
                since = None;
                continue;
            }
            spins = spins.wrapping_add(1);
            if spins % SPINS_BEFORE_YIELD == 0 {
                std::thread::yield_now();
                if since.get_or_insert_with(Instant::now).elapsed() > limit {
                    // The request still holds the caller's buffer: set the worker aside for good
                    // rather than free what UCX may still write into.
                    let why = format!("{what} rank {peer} made no progress for {limit:?}");
                    self.broken = Some(why);
                    return Err(Error::Timeout(limit));
                }
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn failed(&self, peer: usize, what: &str, st: ucs_status_t) -> Error {
        if st == UCS_ERR_MESSAGE_TRUNCATED {
            return Error::protocol(
                peer,
                format!(
                    "{}: {what} rank {peer}: message larger than the buffer",
                    self.name
                ),
            );
        }
        Error::ConnectionLost {
            rank: peer,
            source: std::io::Error::other(format!(
                "{}: {what} rank {peer}: {}",
                self.name,
                status_text(st)
            )),
        }
    }
}

impl Drop for RawUcx {
    fn drop(&mut self) {
        if self.broken.is_some() {
            // See `broken`: never progressed nor destroyed again.
            std::mem::forget(self.w.take());
            return;
        }
        let Some(w) = self.w.take() else { return };
        for ep in std::mem::take(&mut self.eps) {
            if ep.is_null() {
                continue;
            }
            // Forced (no flush): no operation of ours is pending, each call waited for its
            // request, and a flush would wait for a peer that may already be gone (the ranks
            // drop their endpoints when each is done, not together).
            let mut param = ucp_request_param_t::empty();
            param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = UCP_EP_CLOSE_FLAG_FORCE;
            // SAFETY: live endpoint of the live worker `w`, closed once; `param` follows the
            // 1.13 layout.
            let req = unsafe { ucp_ep_close_nbx(ep, &param) };
            if req.is_null() || ptr_is_err(req) {
                continue;
            }
            let t0 = Instant::now();
            // SAFETY: `req` is the close request, live until freed below; `w` is live.
            while unsafe { ucp_request_check_status(req) } == UCS_INPROGRESS && t0.elapsed() < CLOSE
            {
                // SAFETY: live worker, this thread only.
                unsafe { ucp_worker_progress(w.worker) };
            }
            // SAFETY: released once; a close still pending is then finished by
            // ucp_worker_destroy (it holds no buffer of ours).
            unsafe { ucp_request_free(req) };
        }
        drop(w);
    }
}

impl Net for RawUcx {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        self.send_for(peer, msg, STALL)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.recv_for(peer, buf, STALL).map(|_| ())
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        self.send_for(peer, &(body.len() as u64).to_le_bytes(), STALL)?;
        self.send_for(peer, body, STALL)
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let mut h = [0u8; 8];
        self.recv_for(peer, &mut h, STALL)?;
        let n = usize::try_from(u64::from_le_bytes(h))
            .ok()
            .filter(|&n| n <= buf.len())
            .ok_or_else(|| Error::protocol(peer, format!("{}: RPC body too large", self.name)))?;
        self.recv_for(peer, &mut buf[..n], STALL)?;
        Ok(n)
    }
}
