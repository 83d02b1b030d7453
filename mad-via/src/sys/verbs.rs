//! ibverbs through `rdma-sys`: safe owners of the device list, device context, protection
//! domain, completion channel, completion queue, queue pair and memory region (each releases
//! its object on drop; children hold an `Arc` on their parent so drop order is always child
//! first), and the verbs provider built on them ([`VerbsDevice`], [`VerbsNic`]).
//!
//! **Untested**: this host has no RDMA device (`ibv_get_device_list` fails with ENOSYS, no
//! rxe/siw module), so only [`DeviceList::get`]'s failure path runs in the tests. Everything
//! below it is written against the verbs specification and the `rdma-sys` bindings, compiled
//! and linted, never executed.
//!
//! # The memory rule
//!
//! An HCA reads and writes registered memory by DMA, outside the borrow checker. The provider
//! relies on these invariants, which the protocol (`proto.rs`) and the registration cache
//! (`reg.rs`) uphold:
//!
//! 1. memory named by a posted work request (user scatter/gather lists) stays allocated and
//!    is not otherwise accessed until the request completes or the queue pair was moved to
//!    the error state and drained ([`VerbsNic::cancel_user_receives`], [`VerbsNic::fail`]):
//!    gather sends and receives return `Ready` only after their completions, and abandoned
//!    or dropped links cancel before they release registrations;
//! 2. a registration of user memory lives only for the call that needed it
//!    ([`VerbsDevice`] says `caches_user_memory() == false`, so the cache deregisters user
//!    memory when the transfer ends); library-owned buffers are deregistered before they are
//!    freed;
//! 3. a static receive buffer is read only after its receive completed and before it is
//!    reposted (the borrow of [`Nic::rx_slot`](crate::provider::Nic::rx_slot) ends before
//!    `post_recv` can take `&mut self`); a static send buffer is written only while no send
//!    from it is outstanding (the protocol's free list).
//!
//! One hole remains, as in every zero-copy receive into borrowed memory: a receive whose
//! `Unpacker` is leaked with `std::mem::forget` is never cancelled, so its memory could be
//! freed while the HCA may still write it.

use std::ffi::CStr;
use std::io::{self, IoSliceMut};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::driver::{OpenContext, OpenedChannel};
use mad_core::{Error, Result};
use rdma_sys as ffi;

use crate::proto::{self, SlotConfig};
use crate::provider::{
    Completions, Device, Dst, Interest, Interests, MemoryRegion as _, Nic, Qp, Remote, Src,
    WaitFds, Wc, WcKind,
};
use crate::reg::{Pd, RegCache};
use crate::verbs::{unavailable, ConnInfo, PeerQps};

/// Largest send or RDMA write of one work request (transfers are cut in pieces this size).
const MAX_MSG: usize = 1 << 20;
/// Outstanding work requests per direction on the data QP.
const DATA_WINDOW: usize = 16;
/// Static send buffers per connection.
const TX_SLOTS: usize = 16;
/// Scatter/gather elements per work request (the medium TM groups up to 16 slices).
const MAX_SGE: usize = 16;
/// How long a cancel waits for the flushed work requests to complete.
const DRAIN: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// Safe owners

/// The list of RDMA devices.
pub struct DeviceList {
    list: *mut *mut ffi::ibv_device,
    n: usize,
}

impl DeviceList {
    /// `ibv_get_device_list`; the OS error when it returns NULL (ENOSYS without RDMA support).
    pub fn get() -> io::Result<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned list is owned by `DeviceList` and
        // freed exactly once in its drop.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(DeviceList {
            list,
            n: n.max(0) as usize,
        })
    }

    fn device(&self, i: usize) -> Option<*mut ffi::ibv_device> {
        if i >= self.n {
            return None;
        }
        // SAFETY: the list holds `n` valid entries (then a NULL); `i < n`.
        let d = unsafe { *self.list.add(i) };
        (!d.is_null()).then_some(d)
    }

    /// The name of the first device.
    pub fn first_name(&self) -> Option<String> {
        let d = self.device(0)?;
        // SAFETY: `d` is a live device of this list; the name is a NUL-terminated string owned
        // by the device, copied out before the list can be freed.
        let p = unsafe { ffi::ibv_get_device_name(d) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated, valid while the list lives (we copy it now).
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// Open the first device.
    pub fn open_first(&self) -> io::Result<Arc<Context>> {
        let d = self
            .device(0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no RDMA device"))?;
        // SAFETY: `d` is a live device of this list; the context stays valid after the list is
        // freed (verbs documents this) and is closed once by `Context::drop`.
        let ctx = unsafe { ffi::ibv_open_device(d) };
        if ctx.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(Context { ctx }))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from ibv_get_device_list and is freed only here.
        unsafe { ffi::ibv_free_device_list(self.list) }
    }
}

/// An open device.
pub struct Context {
    ctx: *mut ffi::ibv_context,
}

// SAFETY: libibverbs objects may be used from any thread (the verbs API is thread safe); the
// pointer is only dereferenced by library calls.
unsafe impl Send for Context {}
// SAFETY: as above; no method takes `&mut`.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; every child holds an Arc on us, so none is alive.
        unsafe {
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// Port information used to address a peer.
#[derive(Clone, Copy, Debug)]
pub struct PortInfo {
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// GID at index 0.
    pub gid: [u8; 16],
}

impl Context {
    /// LID and GID of `port`.
    pub fn port_info(&self, port: u8) -> io::Result<PortInfo> {
        // SAFETY: an all-zero ibv_port_attr is a valid value (plain integers).
        let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is live; attr is a valid out-pointer of the right type.
        let rc = unsafe { ffi::___ibv_query_port(self.ctx, port, &mut attr) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: ctx is live; gid is a valid out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.ctx, port, 0, &mut gid) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: every bit pattern is a valid `[u8; 16]`.
        let raw = unsafe { gid.raw };
        Ok(PortInfo {
            lid: attr.lid,
            gid: raw,
        })
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    pd: *mut ffi::ibv_pd,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see `Context`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// `ibv_alloc_pd`.
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<ProtectionDomain>> {
        // SAFETY: ctx is live for as long as the returned PD (it holds the Arc).
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(ProtectionDomain {
            pd,
            _ctx: ctx.clone(),
        }))
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; QPs and MRs hold an Arc on us, so none is alive.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
        }
    }
}

/// A completion channel: the descriptor a thread blocks on for completion events.
pub struct CompChannel {
    ch: *mut ffi::ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`.
unsafe impl Send for CompChannel {}
// SAFETY: see `Context`.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// `ibv_create_comp_channel`, its descriptor made non-blocking.
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<CompChannel>> {
        // SAFETY: ctx is live for as long as the channel (it holds the Arc).
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.ctx) };
        if ch.is_null() {
            return Err(io::Error::last_os_error());
        }
        let c = CompChannel {
            ch,
            _ctx: ctx.clone(),
        };
        let fd = c.fd();
        // SAFETY: `fd` is the channel's open descriptor, valid while `c` lives; F_GETFL and
        // F_SETFL only change its flags.
        let rc = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(c))
    }

    fn fd(&self) -> RawFd {
        // SAFETY: ch is live; fd is a plain field set at creation.
        unsafe { (*self.ch).fd }
    }

    /// The descriptor, borrowed.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor stays open until the channel is destroyed in our drop, which
        // cannot happen while `&self` is borrowed.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_comp_channel; the CQs using it hold an Arc on us.
        unsafe {
            ffi::ibv_destroy_comp_channel(self.ch);
        }
    }
}

/// A completion queue bound to a completion channel.
pub struct CompletionQueue {
    cq: *mut ffi::ibv_cq,
    /// Events taken from the channel and not yet acknowledged.
    unacked: u32,
    _ch: Arc<CompChannel>,
    _ctx: Arc<Context>,
}

// SAFETY: see `Context`; the unacked counter is only touched through `&mut self`.
unsafe impl Send for CompletionQueue {}

impl CompletionQueue {
    /// `ibv_create_cq` with `depth` entries reporting to `ch`.
    pub fn new(ctx: &Arc<Context>, ch: &Arc<CompChannel>, depth: i32) -> io::Result<Self> {
        // SAFETY: ctx and ch are live for as long as the CQ (it holds both Arcs); a NULL
        // cq_context is allowed.
        let cq = unsafe { ffi::ibv_create_cq(ctx.ctx, depth, std::ptr::null_mut(), ch.ch, 0) };
        if cq.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(CompletionQueue {
            cq,
            unacked: 0,
            _ch: ch.clone(),
            _ctx: ctx.clone(),
        })
    }

    /// `ibv_poll_cq` into `wcs`; returns how many entries were filled.
    pub fn poll(&mut self, wcs: &mut [ffi::ibv_wc]) -> io::Result<usize> {
        let n = wcs.len().min(i32::MAX as usize) as i32;
        // SAFETY: cq is live; `wcs` has room for `n` entries, which poll_cq fills.
        let rc = unsafe { ffi::ibv_poll_cq(self.cq, n, wcs.as_mut_ptr()) };
        if rc < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq failed ({rc})")));
        }
        Ok(rc as usize)
    }

    /// Ask for an event on the channel at the next completion (`ibv_req_notify_cq`).
    pub fn arm(&mut self) -> io::Result<()> {
        // SAFETY: cq is live.
        let rc = unsafe { ffi::ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc.abs()));
        }
        Ok(())
    }

    /// Take the events waiting on the (non-blocking) channel and acknowledge them.
    pub fn drain_events(&mut self) {
        loop {
            let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; the out-pointers are valid.
            let rc = unsafe { ffi::ibv_get_cq_event((*self.cq).channel, &mut cq, &mut ctx) };
            if rc != 0 {
                break;
            }
            self.unacked += 1;
        }
        if self.unacked > 0 {
            // SAFETY: cq is live; we acknowledge exactly the events we took.
            unsafe { ffi::ibv_ack_cq_events(self.cq, self.unacked) };
            self.unacked = 0;
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        self.drain_events();
        // SAFETY: created by ibv_create_cq; the QPs using it are fields dropped before us
        // (see `VerbsNic`), and every event was acknowledged above.
        unsafe {
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

/// Where a queue pair connects to.
#[derive(Clone, Copy, Debug)]
pub struct RemoteQp {
    /// Remote QP number.
    pub qpn: u32,
    /// Remote initial packet sequence number.
    pub psn: u32,
    /// Remote LID.
    pub lid: u16,
    /// Remote GID (used when `lid` is 0, i.e. RoCE).
    pub gid: [u8; 16],
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        let e = io::Error::from_raw_os_error(rc.abs());
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

/// A reliable-connection queue pair.
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: see `Context`.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// `ibv_create_qp` (RC) on `cq` with room for `send`/`recv` work requests, then INIT on
    /// `port` with remote write allowed.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &CompletionQueue,
        port: u8,
        send: u32,
        recv: u32,
    ) -> io::Result<QueuePair> {
        // SAFETY: an all-zero init attr is valid (null pointers, zero caps) before we fill it.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = send;
        init.cap.max_recv_wr = recv;
        init.cap.max_send_sge = MAX_SGE as u32;
        init.cap.max_recv_sge = MAX_SGE as u32;
        // SAFETY: pd and cq are live (the NIC drops the QP before the CQ; the QP holds the
        // PD); init is a valid pointer.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(io::Error::last_os_error());
        }
        let q = QueuePair {
            qp,
            _pd: pd.clone(),
        };
        // SAFETY: all-zero ibv_qp_attr is a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = port;
        a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        q.modify(&mut a, mask.0 as i32, "ibv_modify_qp(INIT)")?;
        Ok(q)
    }

    fn modify(&self, a: &mut ffi::ibv_qp_attr, mask: i32, what: &str) -> io::Result<()> {
        // SAFETY: qp is live; `a` is a valid attribute struct for the given mask.
        check(unsafe { ffi::ibv_modify_qp(self.qp, a, mask) }, what)
    }

    /// This QP's number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: qp is live; qp_num is a plain field set at creation.
        unsafe { (*self.qp).qp_num }
    }

    /// INIT → RTR → RTS towards `r`, sending from `my_psn`. `rnr_retry`: 7 retries a send
    /// the receiver is not ready for forever, 0 makes it an error at once.
    pub fn connect(&self, port: u8, r: &RemoteQp, my_psn: u32, rnr_retry: u8) -> io::Result<()> {
        // SAFETY: all-zero ibv_qp_attr is a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ffi::ibv_mtu::IBV_MTU_1024;
        a.dest_qp_num = r.qpn;
        a.rq_psn = r.psn;
        a.max_dest_rd_atomic = 1;
        // A medium send that arrives before its receive is posted is NAKed and retried after
        // this delay: code 1 = 0.01 ms (12 would be 0.64 ms). Not measured.
        a.min_rnr_timer = 1;
        a.ah_attr.dlid = r.lid;
        a.ah_attr.port_num = port;
        if r.lid == 0 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: r.gid };
            a.ah_attr.grh.hop_limit = 1;
        }
        use ffi::ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, mask.0 as i32, "ibv_modify_qp(RTR)")?;
        // SAFETY: as above.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = rnr_retry;
        a.sq_psn = my_psn;
        a.max_rd_atomic = 1;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask.0 as i32, "ibv_modify_qp(RTS)")
    }

    /// Move to the error state: outstanding work requests complete with flush errors and the
    /// HCA stops processing new ones.
    pub fn to_error(&self) -> io::Result<()> {
        // SAFETY: all-zero ibv_qp_attr is a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut a,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
            "ibv_modify_qp(ERR)",
        )
    }

    /// `ibv_post_recv` of one request.
    ///
    /// # Safety
    ///
    /// The memory `sges` name must stay allocated and untouched by the program until the
    /// request completes or the QP was moved to the error state and the request flushed.
    pub unsafe fn post_recv(&self, wr_id: u64, sges: &mut [ffi::ibv_sge]) -> io::Result<()> {
        // SAFETY: an all-zero recv WR is valid (null pointers) before we fill it.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = sges.len() as i32;
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: qp is live; `wr` and `sges` are valid for the call (the library copies the
        // request); the memory they describe is the caller's promise.
        check(
            unsafe { ffi::ibv_post_recv(self.qp, &mut wr, &mut bad) },
            "ibv_post_recv",
        )
    }

    /// `ibv_post_send` of one signaled request: a send, or an RDMA write to `to`, with
    /// immediate data if `imm`.
    ///
    /// # Safety
    ///
    /// The memory `sges` name must stay allocated and unmodified until the request completes
    /// or the QP was moved to the error state and the request flushed.
    pub unsafe fn post_send(
        &self,
        wr_id: u64,
        sges: &mut [ffi::ibv_sge],
        to: Option<Remote>,
        imm: Option<u32>,
    ) -> io::Result<()> {
        // SAFETY: an all-zero send WR is valid (null pointers, zero unions) before we fill it.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = sges.len() as i32;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        use ffi::ibv_wr_opcode as op;
        wr.opcode = match (to, imm) {
            (None, None) => op::IBV_WR_SEND,
            (None, Some(_)) => op::IBV_WR_SEND_WITH_IMM,
            (Some(_), None) => op::IBV_WR_RDMA_WRITE,
            (Some(_), Some(_)) => op::IBV_WR_RDMA_WRITE_WITH_IMM,
        };
        if let Some(i) = imm {
            wr.imm_data_invalidated_rkey_union.imm_data = i.to_be();
        }
        if let Some(r) = to {
            wr.wr.rdma = ffi::rdma_t {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: qp is live; `wr` and `sges` are valid for the call (the library copies the
        // request); the memory they describe is the caller's promise.
        check(
            unsafe { ffi::ibv_post_send(self.qp, &mut wr, &mut bad) },
            "ibv_post_send",
        )
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp and destroyed only here.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
        }
    }
}

/// A registered memory region (an address range, not a borrow: see the module's memory
/// rule).
pub struct MemoryRegion {
    mr: *mut ffi::ibv_mr,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: see `Context`; the fields are read-only after registration.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// `ibv_reg_mr` of `[addr, addr + len)` with local write access, plus remote write if
    /// `remote`.
    ///
    /// # Safety
    ///
    /// The range must stay allocated until the region is dropped (the HCA pins its pages and
    /// may write them by DMA until then).
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: usize,
        len: usize,
        remote: bool,
    ) -> io::Result<MemoryRegion> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: pd is live (held by the region); the range's lifetime is the caller's
        // promise.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr as *mut libc::c_void, len, access.0 as i32) };
        if mr.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(MemoryRegion {
            mr,
            _pd: pd.clone(),
        })
    }
}

impl crate::provider::MemoryRegion for MemoryRegion {
    fn lkey(&self) -> u32 {
        // SAFETY: mr is live; lkey is a plain field.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: mr is live; rkey is a plain field.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr and deregistered only here.
        unsafe {
            ffi::ibv_dereg_mr(self.mr);
        }
    }
}

/// Library-owned memory with a fixed address, 8-byte aligned, freed on drop (after the
/// regions over it: see field order in [`VerbsNic`]).
struct Arena {
    ptr: NonNull<u64>,
    words: usize,
}

// SAFETY: the arena is plain memory owned by one NIC; access goes through `&self`/`&mut self`.
unsafe impl Send for Arena {}

impl Arena {
    fn new(bytes: usize) -> Arena {
        let words = bytes.div_ceil(8).max(1);
        let b: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        // SAFETY: Box::into_raw never returns null.
        let ptr = unsafe { NonNull::new_unchecked(Box::into_raw(b) as *mut u64) };
        Arena { ptr, words }
    }
    fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
    fn len(&self) -> usize {
        self.words * 8
    }
    /// Bytes `[off, off + len)`, read-only.
    ///
    /// The caller guarantees no DMA writes that range while the slice lives (module rule 3).
    fn bytes(&self, off: usize, len: usize) -> &[u8] {
        if !matches!(off.checked_add(len), Some(e) if e <= self.len()) {
            return &[];
        }
        // SAFETY: in bounds (checked); the memory is initialised (zeroed at creation); no
        // write happens through the program while `&self` is borrowed, and rule 3 excludes
        // DMA writes to this range.
        unsafe { std::slice::from_raw_parts((self.addr() + off) as *const u8, len) }
    }
    /// Bytes `[off, off + len)`, writable (rule 3: no DMA reads or writes meanwhile).
    fn bytes_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        if !matches!(off.checked_add(len), Some(e) if e <= self.len()) {
            return &mut [];
        }
        // SAFETY: in bounds (checked) and initialised; `&mut self` excludes other program
        // accesses; rule 3 excludes DMA to this range.
        unsafe { std::slice::from_raw_parts_mut((self.addr() + off) as *mut u8, len) }
    }
    /// The 8-byte word at `off` (aligned), read with a volatile load: the HCA may write it
    /// at any time (the credit word).
    fn volatile_word(&self, off: usize) -> u64 {
        let i = off / 8;
        if i >= self.words {
            return 0;
        }
        // SAFETY: in bounds and aligned (the arena is an array of u64); a volatile load of a
        // plain integer the HCA may write concurrently: any value read is a valid u64.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(i)) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from Box::into_raw of a boxed slice of `words` u64s and is freed
        // only here.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.words,
            ))
        });
    }
}

// ---------------------------------------------------------------------------------------------
// The provider

/// The verbs protection domain of one channel.
pub struct VerbsDevice {
    pd: Arc<ProtectionDomain>,
    ctx: Arc<Context>,
    port: u8,
}

impl Device for VerbsDevice {
    type Mr = MemoryRegion;

    fn caches_user_memory(&self) -> bool {
        // A stale registration would point the HCA at pages the user freed: register user
        // memory for each call (module rule 2).
        false
    }

    fn reg_mr(&self, addr: usize, len: usize) -> Result<MemoryRegion> {
        // SAFETY: module rule 2: the registration cache deregisters user memory when the
        // transfer that needed it ends (this device forbids caching it) and library-owned
        // buffers before they are freed, so the range outlives the region.
        unsafe { MemoryRegion::register(&self.pd, addr, len, true) }
            .map_err(|e| Error::Resource(format!("via:verbs: ibv_reg_mr of {len} B: {e}")))
    }
}

/// A verbs NIC: one connection end. Field order is drop order: queue pairs, then the
/// completion queue and channel, then the regions, then the memory under them.
pub struct VerbsNic {
    qps: [QueuePair; 2],
    cq: CompletionQueue,
    ch: Arc<CompChannel>,
    arena_mr: MemoryRegion,
    credit_mr: MemoryRegion,
    arena: Arena,
    credit: Arena,
    rank: usize,
    slots: usize,
    slot_size: usize,
    peer_credit: Remote,
    /// Posted minus completed work requests: [ctrl send, ctrl recv, data send, data recv].
    outstanding: [u64; 4],
    raw: Vec<ffi::ibv_wc>,
    /// Completions found while arming; the connection's failure.
    cq_state: Completions,
    /// A completion event was requested (`prepare_wait`) and may be waiting on the channel.
    armed: bool,
}

/// Work request ids on the wire carry whether they are receives (an error completion's
/// opcode is undefined, so the kind must be recoverable from the id).
fn wire_id(wr_id: u64, recv: bool) -> u64 {
    wr_id << 1 | recv as u64
}

impl VerbsNic {
    /// Create the QPs (INIT), the completion queue and channel, and the registered arena of
    /// one connection end.
    fn new(dev: &VerbsDevice, rank: usize, cfg: SlotConfig) -> io::Result<VerbsNic> {
        let ch = CompChannel::new(&dev.ctx)?;
        let tx = TX_SLOTS.min(cfg.slots).max(2);
        let depth = 2 * (cfg.slots + tx + 2 * DATA_WINDOW) + 16;
        let cq = CompletionQueue::new(&dev.ctx, &ch, depth as i32)?;
        let qps = [
            QueuePair::new(&dev.pd, &cq, dev.port, tx as u32, cfg.slots as u32)?,
            QueuePair::new(
                &dev.pd,
                &cq,
                dev.port,
                DATA_WINDOW as u32,
                DATA_WINDOW as u32 + 1,
            )?,
        ];
        let arena = Arena::new((cfg.slots + tx) * cfg.slot_size.max(8));
        let credit = Arena::new(8);
        // SAFETY: rule 2: the arenas are fields dropped after the regions over them.
        let arena_mr =
            unsafe { MemoryRegion::register(&dev.pd, arena.addr(), arena.len(), false) }?;
        // SAFETY: as above.
        let credit_mr = unsafe { MemoryRegion::register(&dev.pd, credit.addr(), 8, true) }?;
        Ok(VerbsNic {
            qps,
            cq,
            ch,
            arena_mr,
            credit_mr,
            arena,
            credit,
            rank,
            slots: cfg.slots,
            slot_size: cfg.slot_size.max(8),
            peer_credit: Remote { addr: 0, rkey: 0 },
            outstanding: [0; 4],
            // SAFETY: an all-zero ibv_wc is a valid value (integers and a union of integers).
            raw: (0..32).map(|_| unsafe { std::mem::zeroed() }).collect(),
            cq_state: Completions::default(),
            armed: false,
        })
    }

    fn credit_word_info(&self) -> (u64, u32) {
        (self.credit.addr() as u64, self.credit_mr.rkey())
    }

    fn rx_off(&self, slot: usize) -> usize {
        slot * self.slot_size
    }

    fn tx_off(&self, slot: usize) -> usize {
        (self.slots + slot) * self.slot_size
    }

    fn check(&self) -> Result<()> {
        self.cq_state.check(self.rank)
    }

    fn fatal(&mut self, e: Error) -> Error {
        if self.cq_state.fail(&e) {
            for q in &self.qps {
                let _ = q.to_error();
            }
        }
        e
    }

    fn sges_of(&self, src: Src<'_>) -> Result<Vec<ffi::ibv_sge>> {
        Ok(match src {
            Src::Slot { slot, len } => {
                if len > self.slot_size {
                    return Err(Error::protocol(
                        self.rank,
                        "send larger than a static buffer",
                    ));
                }
                vec![ffi::ibv_sge {
                    addr: (self.arena.addr() + self.tx_off(slot)) as u64,
                    length: len as u32,
                    lkey: self.arena_mr.lkey(),
                }]
            }
            Src::User(sges) => sges
                .iter()
                .filter(|s| !s.buf.is_empty())
                .map(|s| ffi::ibv_sge {
                    addr: s.buf.as_ptr() as u64,
                    length: s.buf.len() as u32,
                    lkey: s.lkey,
                })
                .collect(),
        })
    }

    fn translate(&mut self, wc: &ffi::ibv_wc) -> Result<Option<Wc>> {
        let qp = if wc.qp_num == self.qps[0].qpn() {
            Qp::Ctrl
        } else {
            Qp::Data
        };
        let recv = wc.wr_id & 1 == 1;
        let wr_id = wc.wr_id >> 1;
        let k = 2 * qp as usize + recv as usize;
        self.outstanding[k] = self.outstanding[k].saturating_sub(1);
        if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
            if self.cq_state.failed() {
                return Ok(None); // flushed after a failure we already reported
            }
            // SAFETY: ibv_wc_status_str returns a static NUL-terminated string.
            let what = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(wc.status)) }
                .to_string_lossy()
                .into_owned();
            use ffi::ibv_wc_status as st;
            let e = match wc.status {
                st::IBV_WC_REM_ACCESS_ERR => Error::protocol(
                    self.rank,
                    format!("peer reported remote access error: RDMA write refused ({what})"),
                ),
                st::IBV_WC_RNR_RETRY_EXC_ERR => Error::protocol(
                    self.rank,
                    format!("send found no posted receive at the peer ({what})"),
                ),
                st::IBV_WC_LOC_LEN_ERR | st::IBV_WC_REM_INV_REQ_ERR => Error::protocol(
                    self.rank,
                    format!("message longer than the posted receive ({what})"),
                ),
                _ => Error::ConnectionLost {
                    rank: self.rank,
                    source: io::Error::other(format!("work completion error: {what}")),
                },
            };
            return Err(self.fatal(e));
        }
        // SAFETY: with IBV_WC_WITH_IMM set, the union holds the immediate data.
        let imm = (wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
            .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        use ffi::ibv_wc_opcode as op;
        let kind = match wc.opcode {
            op::IBV_WC_SEND => WcKind::Send,
            op::IBV_WC_RDMA_WRITE => WcKind::Write,
            op::IBV_WC_RECV | op::IBV_WC_RECV_RDMA_WITH_IMM => WcKind::Recv {
                len: wc.byte_len as usize,
                imm,
            },
            other => {
                return Err(self.fatal(Error::protocol(
                    self.rank,
                    format!("unexpected completion opcode {other}"),
                )))
            }
        };
        Ok(Some(Wc { qp, wr_id, kind }))
    }

    fn poll_cq(&mut self, out: &mut Vec<Wc>) -> Result<()> {
        if self.armed {
            self.cq.drain_events();
            self.armed = false;
        }
        loop {
            let mut raw = std::mem::take(&mut self.raw);
            let n = match self.cq.poll(&mut raw) {
                Ok(n) => n,
                Err(e) => {
                    self.raw = raw;
                    return Err(self.fatal(Error::ConnectionLost {
                        rank: self.rank,
                        source: e,
                    }));
                }
            };
            let mut r = Ok(());
            for wc in &raw[..n] {
                match self.translate(wc) {
                    Ok(Some(w)) => out.push(w),
                    Ok(None) => {}
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                }
            }
            let full = n == raw.len();
            self.raw = raw;
            r?;
            if !full {
                return Ok(());
            }
        }
    }

    /// Fail the QPs and wait (bounded) until every outstanding request was flushed, so no
    /// posted memory is touched afterwards.
    fn stop_and_drain(&mut self) {
        for q in &self.qps {
            let _ = q.to_error();
        }
        self.cq_state.fail("connection stopped");
        let deadline = Instant::now() + DRAIN;
        let mut sink = Vec::new();
        while self.outstanding.iter().any(|&n| n > 0) && Instant::now() < deadline {
            sink.clear();
            if self.poll_cq(&mut sink).is_err() {
                break;
            }
            if sink.is_empty() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

impl Drop for VerbsNic {
    fn drop(&mut self) {
        // Flush what is posted before the registrations and memory go (fields drop next).
        if self.outstanding.iter().any(|&n| n > 0) {
            self.stop_and_drain();
        }
    }
}

impl Nic for VerbsNic {
    fn max_msg(&self) -> usize {
        MAX_MSG
    }

    fn data_window(&self) -> usize {
        DATA_WINDOW
    }

    fn rx_slot(&self, slot: usize) -> &[u8] {
        if slot >= self.slots {
            return &[];
        }
        self.arena.bytes(self.rx_off(slot), self.slot_size)
    }

    fn tx_slots(&self) -> usize {
        TX_SLOTS.min(self.slots).max(2)
    }

    fn tx_slot_mut(&mut self, slot: usize) -> &mut [u8] {
        if slot >= self.tx_slots() {
            return &mut [];
        }
        let (off, n) = (self.tx_off(slot), self.slot_size);
        self.arena.bytes_mut(off, n)
    }

    fn credit_word(&self) -> u64 {
        u64::from_le(self.credit.volatile_word(0))
    }

    fn peer_credit_word(&self) -> Remote {
        self.peer_credit
    }

    fn post_recv(&mut self, qp: Qp, wr_id: u64, dst: Dst<'_>) -> Result<()> {
        self.check()?;
        let mut sges: Vec<ffi::ibv_sge> = match dst {
            Dst::Slot(s) if s < self.slots => vec![ffi::ibv_sge {
                addr: (self.arena.addr() + self.rx_off(s)) as u64,
                length: self.slot_size as u32,
                lkey: self.arena_mr.lkey(),
            }],
            Dst::Slot(_) => return Err(Error::protocol(self.rank, "no such static buffer")),
            Dst::User(list) => list
                .iter()
                .filter(|s| s.len > 0)
                .map(|s| ffi::ibv_sge {
                    addr: s.addr as u64,
                    length: s.len as u32,
                    lkey: s.lkey,
                })
                .collect(),
        };
        if sges.len() > MAX_SGE {
            return Err(Error::protocol(self.rank, "too many scatter elements"));
        }
        // SAFETY: module rules 1 and 3: static buffers are arena memory, read by the program
        // only between this receive's completion and its repost; user memory stays alive and
        // untouched until the receive completes or is cancelled (`cancel_user_receives`).
        let r = unsafe { self.qps[qp as usize].post_recv(wire_id(wr_id, true), &mut sges) };
        match r {
            Ok(()) => {
                self.outstanding[2 * qp as usize + 1] += 1;
                Ok(())
            }
            Err(e) => Err(self.fatal(Error::ConnectionLost {
                rank: self.rank,
                source: e,
            })),
        }
    }

    fn post(
        &mut self,
        qp: Qp,
        wr_id: u64,
        src: Src<'_>,
        to: Option<Remote>,
        imm: Option<u32>,
    ) -> Result<Poll<()>> {
        self.check()?;
        let cap = if qp == Qp::Ctrl {
            TX_SLOTS as u64
        } else {
            DATA_WINDOW as u64
        };
        let k = 2 * qp as usize;
        if self.outstanding[k] >= cap {
            return Ok(Poll::Pending);
        }
        let mut sges = self.sges_of(src)?;
        if sges.len() > MAX_SGE {
            return Err(Error::protocol(self.rank, "too many gather elements"));
        }
        // SAFETY: module rule 1: static buffers are arena memory freed after the QPs; user
        // memory is kept alive and unmodified by the protocol until this request completes
        // (gather sends return Ready only after their completions) or the QP is failed.
        let r =
            unsafe { self.qps[qp as usize].post_send(wire_id(wr_id, false), &mut sges, to, imm) };
        match r {
            Ok(()) => {
                self.outstanding[k] += 1;
                Ok(Poll::Ready(()))
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => Ok(Poll::Pending),
            Err(e) => Err(self.fatal(Error::ConnectionLost {
                rank: self.rank,
                source: e,
            })),
        }
    }

    fn expose(&mut self, _lkey: u32, rkey: u32, _addr: usize, _len: usize) -> Result<u32> {
        // The region's own key: it dies with the registration, which the cache drops when
        // the transfer ends (user memory is never cached on verbs).
        Ok(rkey)
    }

    fn unexpose(&mut self, _rkey: u32) {}

    fn poll(&mut self, _lent: &mut [IoSliceMut<'_>], out: &mut Vec<Wc>) -> Result<()> {
        self.cq_state.take(self.rank, out)?;
        self.poll_cq(out)
    }

    fn reap(&mut self, out: &mut Vec<Wc>) -> Result<()> {
        self.poll(&mut [], out)
    }

    fn peer_closed(&self, _qp: Qp) -> bool {
        // Verbs has no orderly close: a peer that goes away shows as completion errors.
        false
    }

    fn wait_fds(&self) -> WaitFds<'_> {
        smallvec::smallvec![self.ch.as_fd()]
    }

    fn prepare_wait(&mut self, _message_only: bool, interest: &mut Interests) -> Result<bool> {
        interest.clear();
        if self.cq_state.failed() {
            return Ok(true);
        }
        if let Err(e) = self.cq.arm() {
            return Err(self.fatal(Error::ConnectionLost {
                rank: self.rank,
                source: e,
            }));
        }
        self.armed = true;
        // A completion that arrived before the request raises no event: look once more.
        let mut got = self.cq_state.lend_early();
        let r = self.poll_cq(&mut got);
        self.cq_state.restore_early(got);
        let ready = self.cq_state.any_early();
        r?;
        interest.push(Interest {
            fd: 0,
            read: true,
            write: false,
        });
        Ok(ready)
    }

    fn transmit_pending(&self) -> bool {
        false
    }

    fn fail(&mut self, _code: u32, why: &str) {
        // No error record on verbs: the QPs go to the error state, the peer's requests fail.
        // Drained, because the caller may release the registrations next.
        let e = Error::protocol(self.rank, why.to_string());
        let _ = self.fatal(e);
        self.stop_and_drain();
    }

    fn shutdown_send(&mut self) {
        self.stop_and_drain();
    }

    fn shutdown_recv(&mut self) {
        self.stop_and_drain();
    }

    fn cancel_user_receives(&mut self) {
        if self.outstanding[3] > 0 || self.outstanding[2] > 0 {
            self.stop_and_drain();
        }
    }
}

/// Open a `via:verbs` channel on device `dev`: one protection domain, then per peer a
/// completion channel and queue, a control and a data RC queue pair and the registered
/// arena; connection information (LID, GID, PSN, QP numbers, credit words) goes through the
/// session bootstrap; the QPs move to RTR/RTS; the common protocol runs over the NICs.
pub fn open(
    ctx: &OpenContext<'_>,
    dev: &str,
    pd: &Arc<Pd>,
    cfg: SlotConfig,
    cache_entries: usize,
) -> Result<OpenedChannel> {
    let b = ctx.bootstrap;
    let (me, n) = (b.rank(), b.size());
    let err = |what: &str, e: io::Error| unavailable(format!("device `{dev}`: {what}: {e}"));
    let list = DeviceList::get().map_err(|e| err("ibv_get_device_list", e))?;
    let dctx = list.open_first().map_err(|e| err("ibv_open_device", e))?;
    let pdom = ProtectionDomain::new(&dctx).map_err(|e| err("ibv_alloc_pd", e))?;
    let port = 1u8;
    let info = dctx.port_info(port).map_err(|e| err("ibv_query_port", e))?;
    let device = Arc::new(VerbsDevice {
        pd: pdom,
        ctx: dctx,
        port,
    });
    let cache = RegCache::new(device.clone(), pd, cache_entries);
    let mut nics: Vec<Option<VerbsNic>> = Vec::with_capacity(n);
    for j in 0..n {
        nics.push(if j == me {
            None
        } else {
            Some(VerbsNic::new(&device, j, cfg).map_err(|e| err("creating a connection", e))?)
        });
    }
    let mut psn_seed = [0u8; 4];
    mad_core::auth::fill_random(&mut psn_seed)?;
    let psn = u32::from_le_bytes(psn_seed) & 0x00ff_ffff;
    let mine = ConnInfo {
        lid: info.lid,
        gid: info.gid,
        psn,
        peers: nics
            .iter()
            .map(|x| match x {
                None => PeerQps::default(),
                Some(nic) => {
                    let (addr, rkey) = nic.credit_word_info();
                    PeerQps {
                        ctrl_qpn: nic.qps[0].qpn(),
                        data_qpn: nic.qps[1].qpn(),
                        credit_addr: addr,
                        credit_rkey: rkey,
                    }
                }
            })
            .collect(),
    };
    let all = b.allgather(&ctx.tag("verbs-qp"), &mine.encode())?;
    for (j, raw) in all.iter().enumerate() {
        let Some(nic) = nics[j].as_mut() else {
            continue;
        };
        let theirs = ConnInfo::decode(raw, n)
            .map_err(|e| Error::protocol(j, format!("verbs connection info: {e}")))?;
        let p = theirs.peers[me];
        let remote = |qpn| RemoteQp {
            qpn,
            psn: theirs.psn,
            lid: theirs.lid,
            gid: theirs.gid,
        };
        // Control QP: a send the peer has no buffer for means it ignored its credits: fail at
        // once (RNR retry 0). Data QP: an early send waits for its receive (retry forever).
        nic.qps[0]
            .connect(port, &remote(p.ctrl_qpn), psn, 0)
            .map_err(|e| err(&format!("connecting to rank {j}"), e))?;
        nic.qps[1]
            .connect(port, &remote(p.data_qpn), psn, 7)
            .map_err(|e| err(&format!("connecting to rank {j}"), e))?;
        nic.peer_credit = Remote {
            addr: p.credit_addr,
            rkey: p.credit_rkey,
        };
    }
    let notes = vec![
        format!(
            "via:verbs on `{dev}` (UNTESTED: written without a device): {} credits x {} B static buffers, RC QPs (control, data)",
            cfg.slots, cfg.slot_size
        ),
        "registration = ibv_reg_mr; user memory registered per call (never cached on verbs), RegisteredBuffers once per channel".into(),
    ];
    let opened = proto::open_channel(nics, &cache, cfg, notes)?;
    // Every rank has posted its static receive buffers (in open_channel) before any rank
    // may send: the control QPs refuse sends without a posted receive.
    b.barrier(&ctx.tag("verbs-ready"))?;
    Ok(opened)
}
