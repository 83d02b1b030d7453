//! ibverbs through `rdma-sys`: safe owners of the device list, device context, protection
//! domain, completion queue, queue pair and memory region. Each releases its object on drop;
//! children hold an `Rc` on their parent so drop order is always child first.
//!
//! **Untested here**: this host has no RDMA device, so only [`DeviceList::get`]'s failure path
//! runs in the tests.

use std::ffi::CStr;
use std::io;
use std::marker::PhantomData;
use std::rc::Rc;

use rdma_sys as ffi;

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
    pub fn open_first(&self) -> io::Result<Rc<Context>> {
        let d = self
            .device(0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no RDMA device"))?;
        // SAFETY: `d` is a live device of this list; the context stays valid after the list is
        // freed (verbs documents this) and is closed once by `Context::drop`.
        let ctx = unsafe { ffi::ibv_open_device(d) };
        if ctx.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Rc::new(Context { ctx }))
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

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; every child holds an Rc on us, so none is alive.
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
    _ctx: Rc<Context>,
}

impl ProtectionDomain {
    /// `ibv_alloc_pd`.
    pub fn new(ctx: &Rc<Context>) -> io::Result<Rc<ProtectionDomain>> {
        // SAFETY: ctx is live for as long as the returned PD (it holds the Rc).
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Rc::new(ProtectionDomain {
            pd,
            _ctx: ctx.clone(),
        }))
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; QPs and MRs hold an Rc on us, so none is alive.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
        }
    }
}

/// A completion queue.
pub struct CompletionQueue {
    cq: *mut ffi::ibv_cq,
    _ctx: Rc<Context>,
}

impl CompletionQueue {
    /// `ibv_create_cq` with `depth` entries, no channel.
    pub fn new(ctx: &Rc<Context>, depth: i32) -> io::Result<Rc<CompletionQueue>> {
        // SAFETY: ctx is live; NULL context/channel are allowed.
        let cq = unsafe {
            ffi::ibv_create_cq(
                ctx.ctx,
                depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(Rc::new(CompletionQueue {
            cq,
            _ctx: ctx.clone(),
        }))
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq; QPs using it hold an Rc, so none is alive.
        unsafe {
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

/// Where a queue pair connects to.
#[derive(Clone, Copy, Debug)]
pub struct Remote {
    /// Remote QP number.
    pub qpn: u32,
    /// Remote initial packet sequence number.
    pub psn: u32,
    /// Remote LID.
    pub lid: u16,
    /// Remote GID (used when `lid` is 0, i.e. RoCE).
    pub gid: [u8; 16],
}

/// A reliable-connection queue pair.
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    _pd: Rc<ProtectionDomain>,
    _cq: Rc<CompletionQueue>,
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        let e = io::Error::from_raw_os_error(rc.abs());
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

impl QueuePair {
    /// `ibv_create_qp` (RC), then move it to INIT on `port` with remote write allowed.
    pub fn new(
        pd: &Rc<ProtectionDomain>,
        cq: &Rc<CompletionQueue>,
        port: u8,
    ) -> io::Result<QueuePair> {
        // SAFETY: an all-zero init attr is valid (null pointers, zero caps) before we fill it.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = 128;
        init.cap.max_recv_wr = 128;
        init.cap.max_send_sge = 16;
        init.cap.max_recv_sge = 16;
        // SAFETY: pd and cq are live (held by the returned QP); init is a valid pointer.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(io::Error::last_os_error());
        }
        let q = QueuePair {
            qp,
            _pd: pd.clone(),
            _cq: cq.clone(),
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

    /// INIT → RTR → RTS towards `r`, sending from `my_psn`.
    pub fn connect(&self, port: u8, r: &Remote, my_psn: u32) -> io::Result<()> {
        // SAFETY: all-zero ibv_qp_attr is a valid value.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ffi::ibv_mtu::IBV_MTU_1024;
        a.dest_qp_num = r.qpn;
        a.rq_psn = r.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
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
        a.rnr_retry = 7;
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
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp and destroyed only here.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
        }
    }
}

/// Registered memory; borrows the buffer for as long as the HCA may access it.
pub struct MemoryRegion<'a> {
    mr: *mut ffi::ibv_mr,
    _pd: Rc<ProtectionDomain>,
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> MemoryRegion<'a> {
    /// `ibv_reg_mr` with local and remote write access.
    pub fn new(pd: &Rc<ProtectionDomain>, buf: &'a mut [u8]) -> io::Result<MemoryRegion<'a>> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        // SAFETY: pd is live; the buffer is exclusively borrowed for 'a, which bounds the MR's
        // life, so the HCA never writes into memory that was freed or is aliased in Rust.
        let mr =
            unsafe { ffi::ibv_reg_mr(pd.pd, buf.as_mut_ptr().cast(), buf.len(), access.0 as i32) };
        if mr.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(MemoryRegion {
            mr,
            _pd: pd.clone(),
            _buf: PhantomData,
        })
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: mr is live; lkey is a plain field.
        unsafe { (*self.mr).lkey }
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: mr is live; rkey is a plain field.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for MemoryRegion<'_> {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr and deregistered only here.
        unsafe {
            ffi::ibv_dereg_mr(self.mr);
        }
    }
}

/// Create the verbs resources of a channel and connect one RC queue pair per peer through the
/// bootstrap (see `crate::verbs::ConnInfo`). Resources are released on return: the data path
/// is not implemented yet.
pub fn setup(ctx: &mad_core::driver::OpenContext<'_>, dev: &str) -> mad_core::Result<()> {
    use crate::verbs::{unavailable, ConnInfo};
    let b = ctx.bootstrap;
    let (me, n) = (b.rank(), b.size());
    let err = |what: &str, e: io::Error| unavailable(format!("device `{dev}`: {what}: {e}"));
    let list = DeviceList::get().map_err(|e| err("ibv_get_device_list", e))?;
    let dctx = list.open_first().map_err(|e| err("ibv_open_device", e))?;
    let pd = ProtectionDomain::new(&dctx).map_err(|e| err("ibv_alloc_pd", e))?;
    let cq = CompletionQueue::new(&dctx, 1024).map_err(|e| err("ibv_create_cq", e))?;
    let port = 1u8;
    let info = dctx.port_info(port).map_err(|e| err("ibv_query_port", e))?;
    // The small TM's static receive buffers: library-owned memory, registered once (the only
    // memory the verbs backend would keep registered across calls).
    let mut slots = vec![0u8; 32 * 8192];
    let slots_mr = MemoryRegion::new(&pd, &mut slots).map_err(|e| err("ibv_reg_mr", e))?;
    let _ = (slots_mr.lkey(), slots_mr.rkey());
    let mut qps = Vec::with_capacity(n);
    let mut psn_seed = [0u8; 4];
    mad_core::auth::fill_random(&mut psn_seed)?;
    let psn = u32::from_le_bytes(psn_seed) & 0x00ff_ffff;
    for j in 0..n {
        qps.push(if j == me {
            None
        } else {
            Some(QueuePair::new(&pd, &cq, port).map_err(|e| err("ibv_create_qp", e))?)
        });
    }
    let mine = ConnInfo {
        lid: info.lid,
        gid: info.gid,
        psn,
        qpns: qps
            .iter()
            .map(|q| q.as_ref().map_or(0, |q| q.qpn()))
            .collect(),
    };
    let all = b.allgather(&ctx.tag("verbs-qp"), &mine.encode())?;
    for (j, raw) in all.iter().enumerate() {
        let Some(qp) = &qps[j] else { continue };
        let theirs = ConnInfo::decode(raw, n)
            .map_err(|e| mad_core::Error::protocol(j, format!("verbs connection info: {e}")))?;
        let r = Remote {
            qpn: theirs.qpns[me],
            psn: theirs.psn,
            lid: theirs.lid,
            gid: theirs.gid,
        };
        qp.connect(port, &r, psn)
            .map_err(|e| err(&format!("connecting to rank {j}"), e))?;
    }
    Ok(())
}

/// Open a `via:verbs` channel (the data path is not written yet: connects, then reports
/// `Unavailable`).
pub fn open(
    ctx: &mad_core::driver::OpenContext<'_>,
    dev: &str,
    pd: &std::sync::Arc<crate::reg::Pd>,
    cfg: crate::proto::SlotConfig,
    cache_entries: usize,
) -> mad_core::Result<mad_core::driver::OpenedChannel> {
    let _ = (pd, cfg, cache_entries);
    setup(ctx, dev)?;
    Err(crate::verbs::unavailable(format!(
        "device `{dev}` found and queue pairs connected, but the verbs data path is not implemented in this version"
    )))
}
