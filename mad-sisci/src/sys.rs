//! The foreign calls of this driver alone: [`SisciLib`], Dolphin's `libsisci.so`, loaded with
//! `dlopen` at run time, its entry points declared by hand (signatures below, from Dolphin's
//! public SISCI API reference).
//!
//! The memory the protocol works on is a [`Region`](mad_core::hostmem::Region) (mad-core's
//! `hostmem`, shared with mad-shm): a bounds-checked window with atomic words and block
//! copies, the PIO stores of SCI. On `local` it covers a `/dev/shm` mapping; on `dolphin` it
//! would cover what `SCIMapRemoteSegment` / `SCIMapLocalSegment` return.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_uint, c_void, CStr, CString};

// ---------------------------------------------------------------------------------------------
// Dolphin SISCI, loaded at run time.
// ---------------------------------------------------------------------------------------------

/// `sci_error_t` (an enum in `sisci_error.h`; `SCI_ERR_OK` is 0).
pub type SciError = c_uint;
/// `SCI_ERR_OK`.
pub const SCI_ERR_OK: SciError = 0;
/// Opaque descriptor types (`sci_desc_t`, `sci_local_segment_t`, `sci_remote_segment_t`,
/// `sci_map_t`, `sci_sequence_t`, `sci_dma_queue_t`): pointers to library structures.
pub type SciHandle = *mut c_void;

/// `void SCIInitialize(unsigned int flags, sci_error_t *error)`.
pub type FnInitialize = unsafe extern "C" fn(c_uint, *mut SciError);
/// `void SCITerminate(void)`.
pub type FnTerminate = unsafe extern "C" fn();
/// `void SCIOpen(sci_desc_t *sd, unsigned int flags, sci_error_t *error)`.
pub type FnOpen = unsafe extern "C" fn(*mut SciHandle, c_uint, *mut SciError);
/// `void SCIClose(sci_desc_t sd, unsigned int flags, sci_error_t *error)`.
pub type FnClose = unsafe extern "C" fn(SciHandle, c_uint, *mut SciError);
/// `void SCIGetLocalNodeId(unsigned int adapterNo, unsigned int *nodeId, unsigned int flags,
/// sci_error_t *error)`.
pub type FnGetLocalNodeId = unsafe extern "C" fn(c_uint, *mut c_uint, c_uint, *mut SciError);
/// `void SCICreateSegment(sci_desc_t sd, sci_local_segment_t *segment, unsigned int segmentId,
/// size_t size, sci_cb_local_segment_t callback, void *callbackArg, unsigned int flags,
/// sci_error_t *error)`.
pub type FnCreateSegment = unsafe extern "C" fn(
    SciHandle,
    *mut SciHandle,
    c_uint,
    usize,
    *mut c_void,
    *mut c_void,
    c_uint,
    *mut SciError,
);
/// `void SCIPrepareSegment(sci_local_segment_t segment, unsigned int localAdapterNo,
/// unsigned int flags, sci_error_t *error)`; `SCISetSegmentAvailable` has the same shape.
pub type FnSegmentAdapterOp = unsafe extern "C" fn(SciHandle, c_uint, c_uint, *mut SciError);
/// `void SCIConnectSegment(sci_desc_t sd, sci_remote_segment_t *segment, unsigned int nodeId,
/// unsigned int segmentId, unsigned int localAdapterNo, sci_cb_remote_segment_t callback,
/// void *callbackArg, unsigned int timeout, unsigned int flags, sci_error_t *error)`.
pub type FnConnectSegment = unsafe extern "C" fn(
    SciHandle,
    *mut SciHandle,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut c_void,
    c_uint,
    c_uint,
    *mut SciError,
);
/// `volatile void *SCIMapRemoteSegment(sci_remote_segment_t segment, sci_map_t *map,
/// size_t offset, size_t size, void *addr, unsigned int flags, sci_error_t *error)`;
/// `SCIMapLocalSegment` has the same shape with a local segment.
pub type FnMapSegment = unsafe extern "C" fn(
    SciHandle,
    *mut SciHandle,
    usize,
    usize,
    *mut c_void,
    c_uint,
    *mut SciError,
) -> *mut c_void;
/// `void SCIStoreBarrier(sci_sequence_t sequence, unsigned int flags)`.
pub type FnStoreBarrier = unsafe extern "C" fn(SciHandle, c_uint);
/// `void SCICreateDMAQueue(sci_desc_t sd, sci_dma_queue_t *dq, unsigned int localAdapterNo,
/// unsigned int maxEntries, unsigned int flags, sci_error_t *error)`.
pub type FnCreateDmaQueue =
    unsafe extern "C" fn(SciHandle, *mut SciHandle, c_uint, c_uint, c_uint, *mut SciError);
/// `void SCIStartDmaTransfer(sci_dma_queue_t dq, sci_local_segment_t localSegment,
/// sci_remote_segment_t remoteSegment, size_t localOffset, size_t size, size_t remoteOffset,
/// sci_cb_dma_t callback, void *callbackArg, unsigned int flags, sci_error_t *error)`.
pub type FnStartDmaTransfer = unsafe extern "C" fn(
    SciHandle,
    SciHandle,
    SciHandle,
    usize,
    usize,
    usize,
    *mut c_void,
    *mut c_void,
    c_uint,
    *mut SciError,
);
/// `sci_dma_queue_state_t SCIWaitForDMAQueue(sci_dma_queue_t dq, unsigned int timeout,
/// unsigned int flags, sci_error_t *error)`.
pub type FnWaitForDmaQueue =
    unsafe extern "C" fn(SciHandle, c_uint, c_uint, *mut SciError) -> c_uint;

/// The symbols this driver resolves (all must be present).
pub const SYMBOLS: &[&str] = &[
    "SCIInitialize",
    "SCITerminate",
    "SCIOpen",
    "SCIClose",
    "SCIGetLocalNodeId",
    "SCICreateSegment",
    "SCIPrepareSegment",
    "SCISetSegmentAvailable",
    "SCIConnectSegment",
    "SCIMapRemoteSegment",
    "SCIMapLocalSegment",
    "SCIStoreBarrier",
    "SCICreateDMAQueue",
    "SCIStartDmaTransfer",
    "SCIWaitForDMAQueue",
];

/// A loaded `libsisci.so` (closed with `dlclose` on drop).
pub struct SisciLib {
    handle: *mut c_void,
    initialize: FnInitialize,
    terminate: FnTerminate,
    open: FnOpen,
    close: FnClose,
    local_node_id: FnGetLocalNodeId,
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (dlerror contract).
        unsafe { CStr::from_ptr(p.cast::<c_char>()) }
            .to_string_lossy()
            .into_owned()
    }
}

impl SisciLib {
    /// `dlopen(name)` and resolve every symbol of [`SYMBOLS`]. The error is the `dlerror` text.
    pub fn load(name: &str) -> Result<Self, String> {
        let c = CString::new(name).map_err(|_| format!("library name {name:?} contains NUL"))?;
        // SAFETY: `c` is a valid C string; RTLD_NOW resolves everything now. Loading runs the
        // library's constructors: that is what asking for `sisci:dolphin` means.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dlerror_text());
        }
        let mut lib = SisciLib {
            handle,
            initialize: noop_init,
            terminate: noop_term,
            open: noop_open,
            close: noop_close,
            local_node_id: noop_node,
        };
        let mut syms = Vec::with_capacity(SYMBOLS.len());
        for s in SYMBOLS {
            let cs = CString::new(*s).map_err(|_| "symbol name contains NUL".to_string())?;
            // SAFETY: `handle` is a live dlopen handle; `cs` a valid C string.
            let p = unsafe { libc::dlsym(handle, cs.as_ptr()) };
            if p.is_null() {
                return Err(format!("{name}: missing symbol {s}: {}", dlerror_text()));
            }
            syms.push(p);
        }
        // SAFETY: each pointer was resolved from the symbol whose C prototype is documented on
        // the matching type alias (Dolphin's SISCI API reference); the handle stays open as
        // long as `lib` lives, and `lib` owns it.
        unsafe {
            lib.initialize = std::mem::transmute::<*mut c_void, FnInitialize>(syms[0]);
            lib.terminate = std::mem::transmute::<*mut c_void, FnTerminate>(syms[1]);
            lib.open = std::mem::transmute::<*mut c_void, FnOpen>(syms[2]);
            lib.close = std::mem::transmute::<*mut c_void, FnClose>(syms[3]);
            lib.local_node_id = std::mem::transmute::<*mut c_void, FnGetLocalNodeId>(syms[4]);
        }
        Ok(lib)
    }

    /// `SCIInitialize`, `SCIOpen`, `SCIGetLocalNodeId(adapter)`, `SCIClose`, `SCITerminate`:
    /// whether an adapter answers. Returns its node id or a description of the failing call.
    pub fn probe_adapter(&self, adapter: u32) -> Result<u32, String> {
        let mut err: SciError = SCI_ERR_OK;
        // SAFETY: prototype as declared; `err` is a valid out-pointer.
        unsafe { (self.initialize)(0, &mut err) };
        if err != SCI_ERR_OK {
            return Err(format!("SCIInitialize failed (sci_error 0x{err:x})"));
        }
        let mut sd: SciHandle = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the library is initialized.
        unsafe { (self.open)(&mut sd, 0, &mut err) };
        let res = if err != SCI_ERR_OK {
            Err(format!(
                "SCIOpen failed (sci_error 0x{err:x}): no SISCI driver"
            ))
        } else {
            let mut node: c_uint = 0;
            // SAFETY: valid out-pointers; `sd` is open.
            unsafe { (self.local_node_id)(adapter, &mut node, 0, &mut err) };
            let r = if err != SCI_ERR_OK {
                Err(format!(
                    "SCIGetLocalNodeId(adapter {adapter}) failed (sci_error 0x{err:x}): no adapter"
                ))
            } else {
                Ok(node)
            };
            let mut e2: SciError = SCI_ERR_OK;
            // SAFETY: `sd` was opened above and is closed once.
            unsafe { (self.close)(sd, 0, &mut e2) };
            r
        };
        // SAFETY: pairs with the successful SCIInitialize above.
        unsafe { (self.terminate)() };
        res
    }
}

impl Drop for SisciLib {
    fn drop(&mut self) {
        // SAFETY: `handle` came from dlopen and is closed once; no function pointer from it is
        // used afterwards (they live in `self`).
        unsafe { libc::dlclose(self.handle) };
    }
}

unsafe extern "C" fn noop_init(_: c_uint, e: *mut SciError) {
    // SAFETY: callers pass a valid out-pointer (placeholder until dlsym fills the slot).
    unsafe { *e = 1 };
}
unsafe extern "C" fn noop_term() {}
unsafe extern "C" fn noop_open(_: *mut SciHandle, _: c_uint, e: *mut SciError) {
    // SAFETY: as for `noop_init`.
    unsafe { *e = 1 };
}
unsafe extern "C" fn noop_close(_: SciHandle, _: c_uint, e: *mut SciError) {
    // SAFETY: as for `noop_init`.
    unsafe { *e = 1 };
}
unsafe extern "C" fn noop_node(_: c_uint, _: *mut c_uint, _: c_uint, e: *mut SciError) {
    // SAFETY: as for `noop_init`.
    unsafe { *e = 1 };
}
