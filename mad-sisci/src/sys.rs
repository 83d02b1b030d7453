//! The foreign calls of this driver alone: Dolphin's SISCI library, loaded at run time
//! (`dlopen` through `libloading`), its entry points declared by hand (prototypes on the type aliases below, from
//! Dolphin's public SISCI API reference: `sisci_api.h`, `sisci_types.h`, `sisci_error.h`),
//! wrapped in safe types that release what they hold on drop:
//!
//! | type | acquires | releases (drop) |
//! |---|---|---|
//! | [`Sisci`] | `dlopen`, symbols, `SCIInitialize` (once per process, counted) | `SCITerminate`, `dlclose` with the last user |
//! | [`Desc`] | `SCIOpen` | `SCIClose` |
//! | [`LocalSegment`] | `SCICreateSegment`, `SCIPrepareSegment`, `SCIMapLocalSegment`, then [`set_available`](LocalSegment::set_available) | `SCISetSegmentUnavailable`, `SCIUnmapSegment`, `SCIRemoveSegment` |
//! | [`RemoteSegment`] | `SCIConnectSegment`, `SCIMapRemoteSegment`, `SCICreateMapSequence` | `SCIRemoveSequence`, `SCIUnmapSegment`, `SCIDisconnectSegment` |
//! | [`DmaQueue`] | `SCICreateDMAQueue` | `SCIRemoveDMAQueue` |
//!
//! Each holds an `Arc` of what it was made from (segment → descriptor → library), and every
//! [`RemoteSegment`] holds this process's [`LocalSegment`], so the release order is the reverse
//! of the acquisition order whatever order the owners drop in: connections to peers are
//! closed before this process's segment is removed. That matters because SISCI refuses
//! (`SCI_ERR_BUSY`) to remove a segment that peers are still connected to: if every rank
//! removed its own segment first, each would wait for the others. A release that still
//! answers `SCI_ERR_BUSY` (a peer that has not closed the channel yet) is finished by a
//! background thread that retries every 10 ms, with the remaining steps in order and the
//! descriptor held until they are done: a drop never blocks on a peer, and
//! nothing is closed under a live object.
//! The mapped memory is handed to the protocol as a [`Region`] whose keep-alive is the segment
//! itself. Every SISCI error code becomes a [`SciError`], converted to the crate's typed
//! errors in one place ([`SciError::to_error`]).
//!
//! **Untested against a real library**: no SISCI library or adapter exists on the machines
//! this was written on (see `NOTES.md`). The tests load a small stand-in library built from
//! `tests/fake_sisci.c` (our reading of the same reference), so the call sequence runs, but
//! nothing here has met Dolphin's implementation.

#![allow(unsafe_code)]

use std::ffi::{c_uint, c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use mad_core::hostmem::Region;
use mad_core::Error;

// ---------------------------------------------------------------------------------------------
// Prototypes.
// ---------------------------------------------------------------------------------------------

/// `sci_error_t` (an enum in `sisci_error.h`; `SCI_ERR_OK` is 0).
pub type SciErrorCode = c_uint;
/// `SCI_ERR_OK`.
pub const SCI_ERR_OK: SciErrorCode = 0;
/// Opaque descriptor types (`sci_desc_t`, `sci_local_segment_t`, `sci_remote_segment_t`,
/// `sci_map_t`, `sci_sequence_t`, `sci_dma_queue_t`): pointers to library structures.
pub type SciHandle = *mut c_void;
/// `SCI_INFINITE_TIMEOUT`.
pub const SCI_INFINITE_TIMEOUT: c_uint = 0xFFFF_FFFF;

/// `void SCIInitialize(unsigned int flags, sci_error_t *error)`.
pub type FnInitialize = unsafe extern "C" fn(c_uint, *mut SciErrorCode);
/// `void SCITerminate(void)`.
pub type FnTerminate = unsafe extern "C" fn();
/// `void SCIOpen(sci_desc_t *sd, unsigned int flags, sci_error_t *error)`.
pub type FnOpen = unsafe extern "C" fn(*mut SciHandle, c_uint, *mut SciErrorCode);
/// `void F(h, unsigned int flags, sci_error_t *error)` for `SCIClose(sci_desc_t)`,
/// `SCIRemoveSegment(sci_local_segment_t)`, `SCIUnmapSegment(sci_map_t)`,
/// `SCIDisconnectSegment(sci_remote_segment_t)`, `SCIRemoveSequence(sci_sequence_t)`,
/// `SCIRemoveDMAQueue(sci_dma_queue_t)`.
pub type FnRelease = unsafe extern "C" fn(SciHandle, c_uint, *mut SciErrorCode);
/// `void SCIGetLocalNodeId(unsigned int adapterNo, unsigned int *nodeId, unsigned int flags,
/// sci_error_t *error)`.
pub type FnGetLocalNodeId = unsafe extern "C" fn(c_uint, *mut c_uint, c_uint, *mut SciErrorCode);
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
    *mut SciErrorCode,
);
/// `void F(sci_local_segment_t segment, unsigned int localAdapterNo, unsigned int flags,
/// sci_error_t *error)` for `SCIPrepareSegment`, `SCISetSegmentAvailable`,
/// `SCISetSegmentUnavailable`.
pub type FnSegmentAdapterOp = unsafe extern "C" fn(SciHandle, c_uint, c_uint, *mut SciErrorCode);
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
    *mut SciErrorCode,
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
    *mut SciErrorCode,
) -> *mut c_void;
/// `void SCICreateMapSequence(sci_map_t map, sci_sequence_t *sequence, unsigned int flags,
/// sci_error_t *error)`.
pub type FnCreateMapSequence =
    unsafe extern "C" fn(SciHandle, *mut SciHandle, c_uint, *mut SciErrorCode);
/// `void SCIStoreBarrier(sci_sequence_t sequence, unsigned int flags)`.
pub type FnStoreBarrier = unsafe extern "C" fn(SciHandle, c_uint);
/// `sci_segment_cb_reason_t SCIWaitForRemoteSegmentEvent(sci_remote_segment_t segment,
/// sci_error_t *status, unsigned int timeout, unsigned int flags, sci_error_t *error)`.
pub type FnWaitForRemoteSegmentEvent =
    unsafe extern "C" fn(SciHandle, *mut SciErrorCode, c_uint, c_uint, *mut SciErrorCode) -> c_uint;
/// `void SCICreateDMAQueue(sci_desc_t sd, sci_dma_queue_t *dq, unsigned int localAdapterNo,
/// unsigned int maxEntries, unsigned int flags, sci_error_t *error)`.
pub type FnCreateDmaQueue =
    unsafe extern "C" fn(SciHandle, *mut SciHandle, c_uint, c_uint, c_uint, *mut SciErrorCode);
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
    *mut SciErrorCode,
);
/// `sci_dma_queue_state_t SCIWaitForDMAQueue(sci_dma_queue_t dq, unsigned int timeout,
/// unsigned int flags, sci_error_t *error)`.
pub type FnWaitForDmaQueue =
    unsafe extern "C" fn(SciHandle, c_uint, c_uint, *mut SciErrorCode) -> c_uint;

/// `sci_segment_cb_reason_t`: `SCI_CB_DISCONNECT` (the exporter removed the segment or went
/// away).
pub const SCI_CB_DISCONNECT: c_uint = 2;
/// `SCI_CB_NOT_OPERATIONAL` (the link is down, possibly for a while).
pub const SCI_CB_NOT_OPERATIONAL: c_uint = 3;
/// `SCI_CB_LOST` (the connection is gone for good).
pub const SCI_CB_LOST: c_uint = 5;
/// `sci_dma_queue_state_t`: `SCI_DMAQUEUE_IDLE`.
pub const SCI_DMAQUEUE_IDLE: c_uint = 0;
/// `SCI_DMAQUEUE_DONE`.
pub const SCI_DMAQUEUE_DONE: c_uint = 3;

/// Prefixes under which `sisci_api.h` exports its functions: the header renames every call
/// (`#define SCIOpen _SISCI_EXPANDE_FUNCTION_NAME(SCIOpen)`) to `_SISCI_PUBLIC_FUNC_MT_` when
/// built with `_REENTRANT` and `_SISCI_PUBLIC_FUNC_ST_` otherwise. The first family that has
/// `SCIInitialize` is used for every symbol; the bare names are the last resort.
pub const SYMBOL_FAMILIES: &[&str] = &["_SISCI_PUBLIC_FUNC_MT_", "_SISCI_PUBLIC_FUNC_ST_", ""];

/// The calls every SISCI library must have (in the order of the private `Api` table).
pub const REQUIRED: &[&str] = &[
    "SCIInitialize",
    "SCITerminate",
    "SCIOpen",
    "SCIClose",
    "SCIGetLocalNodeId",
    "SCICreateSegment",
    "SCIPrepareSegment",
    "SCISetSegmentAvailable",
    "SCISetSegmentUnavailable",
    "SCIRemoveSegment",
    "SCIMapLocalSegment",
    "SCIMapRemoteSegment",
    "SCIUnmapSegment",
    "SCIConnectSegment",
    "SCIDisconnectSegment",
    "SCIWaitForRemoteSegmentEvent",
    "SCICreateMapSequence",
    "SCIRemoveSequence",
    "SCIStoreBarrier",
];

/// The DMA calls: without them the `dma` TM copies by PIO.
pub const DMA_CALLS: &[&str] = &[
    "SCICreateDMAQueue",
    "SCIRemoveDMAQueue",
    "SCIStartDmaTransfer",
    "SCIWaitForDMAQueue",
];

// ---------------------------------------------------------------------------------------------
// Error codes: the one place where SISCI codes become typed errors.
// ---------------------------------------------------------------------------------------------

/// Bit 30, set in every SISCI error code of `sisci_error.h` (`SCI_ERR_MASK`); codes are
/// compared without it, so a library that leaves it out is read the same way.
pub const SCI_ERR_MASK: u32 = 0x4000_0000;

/// What a SISCI error means to this driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SciClass {
    /// No usable SISCI here (driver, adapter, library version).
    NoDevice,
    /// Out of segments, mappings, memory or ids.
    Resource,
    /// The peer or the path to it is gone (or never existed).
    Peer,
    /// Busy: retry later.
    Busy,
    /// Timed out.
    Timeout,
    /// A parameter the library refused (geometry, alignment, flags).
    Invalid,
    /// A code this driver does not know.
    Unknown,
}

/// Known `sci_error_t` values (without [`SCI_ERR_MASK`]), their names and classes, from
/// `sisci_error.h`.
pub const SCI_ERRORS: &[(u32, &str, SciClass)] = &[
    (0x900, "SCI_ERR_BUSY", SciClass::Busy),
    (0x901, "SCI_ERR_FLAG_NOT_IMPLEMENTED", SciClass::NoDevice),
    (0x902, "SCI_ERR_ILLEGAL_FLAG", SciClass::Invalid),
    (0x904, "SCI_ERR_NOSPC", SciClass::Resource),
    (0x905, "SCI_ERR_API_NOSPC", SciClass::Resource),
    (0x906, "SCI_ERR_HW_NOSPC", SciClass::Resource),
    (0x907, "SCI_ERR_NOT_IMPLEMENTED", SciClass::NoDevice),
    (0x908, "SCI_ERR_ILLEGAL_ADAPTERNO", SciClass::NoDevice),
    (0x909, "SCI_ERR_NO_SUCH_ADAPTERNO", SciClass::NoDevice),
    (0x90A, "SCI_ERR_TIMEOUT", SciClass::Timeout),
    (0x90B, "SCI_ERR_OUT_OF_RANGE", SciClass::Invalid),
    (0x90C, "SCI_ERR_NO_SUCH_SEGMENT", SciClass::Peer),
    (0x90D, "SCI_ERR_ILLEGAL_NODEID", SciClass::Peer),
    (0x90E, "SCI_ERR_CONNECTION_REFUSED", SciClass::Peer),
    (0x90F, "SCI_ERR_SEGMENT_NOT_CONNECTED", SciClass::Peer),
    (0x910, "SCI_ERR_SIZE_ALIGNMENT", SciClass::Invalid),
    (0x911, "SCI_ERR_OFFSET_ALIGNMENT", SciClass::Invalid),
    (0x912, "SCI_ERR_ILLEGAL_PARAMETER", SciClass::Invalid),
    (0x913, "SCI_ERR_MAX_ENTRIES", SciClass::Resource),
    (0x914, "SCI_ERR_SEGMENT_NOT_PREPARED", SciClass::Invalid),
    (0x915, "SCI_ERR_ILLEGAL_ADDRESS", SciClass::Invalid),
    (0x916, "SCI_ERR_ILLEGAL_OPERATION", SciClass::Invalid),
    (0x917, "SCI_ERR_ILLEGAL_QUERY", SciClass::Invalid),
    (0x918, "SCI_ERR_SEGMENTID_USED", SciClass::Resource),
    (0x919, "SCI_ERR_SYSTEM", SciClass::Resource),
    (0x91A, "SCI_ERR_CANCELLED", SciClass::Peer),
    (0x91B, "SCI_ERR_NOT_CONNECTED", SciClass::Peer),
    (0x91C, "SCI_ERR_NOT_AVAILABLE", SciClass::NoDevice),
    (0x91D, "SCI_ERR_INCONSISTENT_VERSIONS", SciClass::NoDevice),
    (0x91E, "SCI_ERR_COND_INT_RACE_PROBLEM", SciClass::Unknown),
    (0x91F, "SCI_ERR_OVERFLOW", SciClass::Resource),
    (0x920, "SCI_ERR_NOT_INITIALIZED", SciClass::NoDevice),
    (0x921, "SCI_ERR_ACCESS", SciClass::Invalid),
    (0xA00, "SCI_ERR_NO_SUCH_NODEID", SciClass::Peer),
    (0xA02, "SCI_ERR_NODE_NOT_RESPONDING", SciClass::Peer),
    (0xA04, "SCI_ERR_NO_REMOTE_LINK_ACCESS", SciClass::Peer),
    (0xA05, "SCI_ERR_NO_LINK_ACCESS", SciClass::Peer),
    (0xA06, "SCI_ERR_TRANSFER_FAILED", SciClass::Peer),
];

/// A failed SISCI call: which one, and the `sci_error_t` it returned (or, for calls that
/// report through a state value, the code this driver assigns: see [`SciError::dma_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SciError {
    /// The SISCI function (`"SCIConnectSegment"`).
    pub call: &'static str,
    /// The raw code.
    pub code: u32,
}

/// Code reported for a DMA queue that ended in a state other than done (aborted or error):
/// `SCI_ERR_TRANSFER_FAILED`.
const DMA_FAILED: u32 = 0xA06 | SCI_ERR_MASK;

impl SciError {
    /// `call` returned `code`.
    pub fn new(call: &'static str, code: u32) -> Self {
        SciError { call, code }
    }

    /// `SCIWaitForDMAQueue` said OK but left the queue aborted or in error.
    pub fn dma_failed() -> Self {
        SciError::new("SCIWaitForDMAQueue", DMA_FAILED)
    }

    fn entry(&self) -> Option<&'static (u32, &'static str, SciClass)> {
        if self.code & !(SCI_ERR_MASK | 0xFFF) != 0 {
            return None;
        }
        let base = self.code & 0xFFF;
        SCI_ERRORS.iter().find(|(c, _, _)| *c == base)
    }

    /// The `SCI_ERR_...` name, if the code is one of `sisci_error.h`.
    pub fn name(&self) -> Option<&'static str> {
        self.entry().map(|e| e.1)
    }

    /// What the code means to this driver.
    pub fn class(&self) -> SciClass {
        self.entry().map(|e| e.2).unwrap_or(SciClass::Unknown)
    }

    /// Whether the code is `SCI_ERR_SEGMENTID_USED` (another segment of this node has the id).
    pub fn is_id_used(&self) -> bool {
        self.code & 0xFFF == 0x918 && self.entry().is_some()
    }

    /// Whether the code is `SCI_ERR_TIMEOUT`.
    pub fn is_timeout(&self) -> bool {
        self.class() == SciClass::Timeout
    }

    /// Whether the code is `SCI_ERR_BUSY`.
    pub fn is_busy(&self) -> bool {
        self.class() == SciClass::Busy
    }

    /// The crate's error for this failure; `peer` is the rank concerned, if any.
    ///
    /// | class | with a peer | without |
    /// |---|---|---|
    /// | `Peer`, `Timeout`, `Unknown` | `ConnectionLost { rank }` | `Unavailable` |
    /// | `NoDevice` | `Unavailable` | `Unavailable` |
    /// | `Resource`, `Busy` | `Resource` | `Resource` |
    /// | `Invalid` | `BadConfig` | `BadConfig` |
    ///
    /// Every `Unavailable` reason suggests `sisci:local`.
    pub fn to_error(&self, peer: Option<usize>) -> Error {
        let text = self.to_string();
        let unavailable = |text: String| {
            Error::unavailable_because(
                "sisci:dolphin",
                format!("{text}; use sisci:local on one host"),
                mad_core::error::Cause::new(*self),
            )
        };
        match (self.class(), peer) {
            (SciClass::Peer | SciClass::Unknown, Some(rank)) => Error::ConnectionLost {
                rank,
                source: std::io::Error::other(text),
            },
            (SciClass::Timeout, Some(rank)) => Error::ConnectionLost {
                rank,
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, text),
            },
            (SciClass::Peer | SciClass::Unknown | SciClass::Timeout | SciClass::NoDevice, _) => {
                unavailable(text)
            }
            (SciClass::Resource | SciClass::Busy, _) => {
                Error::Resource(format!("sisci:dolphin: {text}"))
            }
            (SciClass::Invalid, _) => Error::BadConfig(format!(
                "sisci:dolphin: {text} (the geometry or adapter options do not suit this \
                 library or adapter)"
            )),
        }
    }
}

impl std::fmt::Display for SciError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{} failed: {n} (0x{:x})", self.call, self.code),
            None => write!(
                f,
                "{} failed: unknown sci_error 0x{:x}",
                self.call, self.code
            ),
        }
    }
}

impl std::error::Error for SciError {}

fn check(call: &'static str, code: SciErrorCode) -> Result<(), SciError> {
    if code == SCI_ERR_OK {
        Ok(())
    } else {
        Err(SciError::new(call, code))
    }
}

// ---------------------------------------------------------------------------------------------
// The library: dlopen and symbols (libloading), SCIInitialize / SCITerminate.
// ---------------------------------------------------------------------------------------------

/// The resolved entry points (plain function pointers: copyable, valid while the library is
/// loaded, which [`Sisci`] guarantees).
#[derive(Clone, Copy)]
struct Api {
    initialize: FnInitialize,
    terminate: FnTerminate,
    open: FnOpen,
    close: FnRelease,
    local_node_id: FnGetLocalNodeId,
    create_segment: FnCreateSegment,
    prepare_segment: FnSegmentAdapterOp,
    set_available: FnSegmentAdapterOp,
    set_unavailable: FnSegmentAdapterOp,
    remove_segment: FnRelease,
    map_local: FnMapSegment,
    map_remote: FnMapSegment,
    unmap: FnRelease,
    connect: FnConnectSegment,
    disconnect: FnRelease,
    remote_event: FnWaitForRemoteSegmentEvent,
    create_sequence: FnCreateMapSequence,
    remove_sequence: FnRelease,
    store_barrier: FnStoreBarrier,
    dma: Option<DmaApi>,
}

#[derive(Clone, Copy)]
struct DmaApi {
    create: FnCreateDmaQueue,
    remove: FnRelease,
    start: FnStartDmaTransfer,
    wait: FnWaitForDmaQueue,
}

/// Why the library could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// `dlopen` or `dlsym` failed: the text says which and why.
    Load(String),
    /// `SCIInitialize` failed.
    Init(SciError),
    /// Another SISCI library is already in use in this process.
    OtherLibrary {
        /// The one in use.
        loaded: String,
    },
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Load(t) => f.write_str(t),
            LoadError::Init(e) => write!(f, "{e}"),
            LoadError::OtherLibrary { loaded } => write!(
                f,
                "this process already uses the SISCI library {loaded}; one library per process"
            ),
        }
    }
}

/// `prefix + name` in `lib`, copied out as a `T`; the loader's error text if absent.
///
/// # Safety
///
/// `T` must be the function-pointer type of that symbol's C prototype, and the pointer must
/// not be called after `lib` is unloaded.
unsafe fn sym<T: Copy>(lib: &Library, prefix: &str, name: &str) -> Result<T, String> {
    // SAFETY: the caller's contract: `T` is the symbol's type. The value is copied out of the
    // `Symbol`, whose borrow of `lib` ends here; the caller keeps `lib` loaded while it uses it.
    unsafe { lib.get::<T>(format!("{prefix}{name}").as_bytes()) }
        .map(|s| *s)
        .map_err(|e| e.to_string())
}

/// Resolve every symbol of [`REQUIRED`] (and [`DMA_CALLS`] if all are there) in `lib`.
fn resolve(lib: &Library, path: &str) -> Result<(Api, &'static str), String> {
    let mut last = String::new();
    let family = SYMBOL_FAMILIES
        .iter()
        .copied()
        .find(|f| {
            // SAFETY: only looked up, never called here; `FnInitialize` is SCIInitialize's
            // type.
            let found = unsafe { sym::<FnInitialize>(lib, f, REQUIRED[0]) };
            found.map_err(|e| last = e).is_ok()
        })
        .ok_or_else(|| {
            let tried: Vec<String> = SYMBOL_FAMILIES
                .iter()
                .map(|f| format!("{f}{}", REQUIRED[0]))
                .collect();
            format!(
                "{path}: missing symbol {} (looked for {}): {last}",
                REQUIRED[0],
                tried.join(", "),
            )
        })?;
    /// The symbol `REQUIRED[i]` (as `family` + name), or why not.
    ///
    /// # Safety
    ///
    /// As [`sym`].
    unsafe fn req<T: Copy>(lib: &Library, path: &str, family: &str, i: usize) -> Result<T, String> {
        let name = REQUIRED[i];
        // SAFETY: the caller's contract.
        unsafe { sym(lib, family, name) }
            .map_err(|e| format!("{path}: missing symbol {name} (as {family}{name}): {e}"))
    }
    // SAFETY: each symbol is read as the function-pointer type of its C prototype, documented
    // on the type alias (Dolphin's SISCI API reference), in the order of `REQUIRED` /
    // `DMA_CALLS`; the library stays loaded while any copy of the table is used (`Sisci` counts
    // its users and unloads it after the last).
    let api = unsafe {
        let dma = (|| {
            Some(DmaApi {
                create: sym::<FnCreateDmaQueue>(lib, family, DMA_CALLS[0]).ok()?,
                remove: sym::<FnRelease>(lib, family, DMA_CALLS[1]).ok()?,
                start: sym::<FnStartDmaTransfer>(lib, family, DMA_CALLS[2]).ok()?,
                wait: sym::<FnWaitForDmaQueue>(lib, family, DMA_CALLS[3]).ok()?,
            })
        })();
        Api {
            initialize: req::<FnInitialize>(lib, path, family, 0)?,
            terminate: req::<FnTerminate>(lib, path, family, 1)?,
            open: req::<FnOpen>(lib, path, family, 2)?,
            close: req::<FnRelease>(lib, path, family, 3)?,
            local_node_id: req::<FnGetLocalNodeId>(lib, path, family, 4)?,
            create_segment: req::<FnCreateSegment>(lib, path, family, 5)?,
            prepare_segment: req::<FnSegmentAdapterOp>(lib, path, family, 6)?,
            set_available: req::<FnSegmentAdapterOp>(lib, path, family, 7)?,
            set_unavailable: req::<FnSegmentAdapterOp>(lib, path, family, 8)?,
            remove_segment: req::<FnRelease>(lib, path, family, 9)?,
            map_local: req::<FnMapSegment>(lib, path, family, 10)?,
            map_remote: req::<FnMapSegment>(lib, path, family, 11)?,
            unmap: req::<FnRelease>(lib, path, family, 12)?,
            connect: req::<FnConnectSegment>(lib, path, family, 13)?,
            disconnect: req::<FnRelease>(lib, path, family, 14)?,
            remote_event: req::<FnWaitForRemoteSegmentEvent>(lib, path, family, 15)?,
            create_sequence: req::<FnCreateMapSequence>(lib, path, family, 16)?,
            remove_sequence: req::<FnRelease>(lib, path, family, 17)?,
            store_barrier: req::<FnStoreBarrier>(lib, path, family, 18)?,
            dma,
        }
    };
    Ok((api, family))
}

/// The library as loaded in this process: one per process, initialized once, terminated
/// and unloaded when its last [`Sisci`] goes (so that two channels never terminate the
/// library under each other, whether or not SISCI counts `SCIInitialize` calls).
struct Loaded {
    path: String,
    lib: Library,
    api: Api,
    family: &'static str,
    users: usize,
}

static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

/// One user of the initialized SISCI library (see the module table).
pub struct Sisci {
    api: Api,
    family: &'static str,
    path: String,
}

impl Sisci {
    /// The library `path` (a name for the dynamic loader or a path), loaded, resolved and
    /// initialized if this process does not use it yet.
    ///
    /// # Errors
    ///
    /// [`LoadError::Load`] when the library cannot be loaded or a symbol resolved;
    /// [`LoadError::Init`] when `SCIInitialize` fails; [`LoadError::OtherLibrary`] when this
    /// process already uses another one.
    pub fn get(path: &str) -> Result<Sisci, LoadError> {
        let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = g.as_mut() {
            if l.path != path {
                return Err(LoadError::OtherLibrary {
                    loaded: l.path.clone(),
                });
            }
            l.users += 1;
            return Ok(Sisci {
                api: l.api,
                family: l.family,
                path: l.path.clone(),
            });
        }
        // The loader's own refusal of a NUL would name no library.
        CString::new(path)
            .map_err(|_| LoadError::Load(format!("library name {path:?} contains NUL")))?;
        // SAFETY: RTLD_NOW resolves everything now. Loading runs the library's constructors:
        // that is what asking for `sisci:dolphin` means.
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| LoadError::Load(e.to_string()))?;
        // On an early return `lib` is dropped (dlclose): no pointer from it is kept.
        let (api, family) = resolve(&lib, path).map_err(LoadError::Load)?;
        let mut err = SCI_ERR_OK;
        // SAFETY: prototype as declared; `err` is a valid out-pointer.
        unsafe { (api.initialize)(0, &mut err) };
        if let Err(e) = check("SCIInitialize", err) {
            return Err(LoadError::Init(e));
        }
        *g = Some(Loaded {
            path: path.to_string(),
            lib,
            api,
            family,
            users: 1,
        });
        Ok(Sisci {
            api,
            family,
            path: path.to_string(),
        })
    }

    /// The prefix the library's symbols were found under (see [`SYMBOL_FAMILIES`]).
    pub fn family(&self) -> &'static str {
        self.family
    }

    /// The library's name or path as given.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether the library has the DMA calls.
    pub fn has_dma(&self) -> bool {
        self.api.dma.is_some()
    }
}

impl Drop for Sisci {
    fn drop(&mut self) {
        let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        let last = match g.as_mut() {
            Some(l) => {
                l.users -= 1;
                l.users == 0
            }
            None => false,
        };
        if last {
            if let Some(l) = g.take() {
                // SAFETY: pairs with the successful SCIInitialize of `get`; every descriptor,
                // segment and queue was released before (each holds a `Sisci`).
                unsafe { (l.api.terminate)() };
                // dlclose, once; no pointer from the library is used again (every `Sisci`
                // copy of the table is gone).
                drop(l.lib);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Descriptor.
// ---------------------------------------------------------------------------------------------

/// An open virtual device (`SCIOpen`); closed on drop.
pub struct Desc {
    sisci: Sisci,
    sd: SciHandle,
}

// SAFETY: a SISCI descriptor may be used from any thread (Dolphin documents the API as
// thread-safe; the `_MT_` symbol family is preferred); this type only passes it to calls.
unsafe impl Send for Desc {}
// SAFETY: as above.
unsafe impl Sync for Desc {}

impl Desc {
    /// `SCIOpen`.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn open(sisci: Sisci) -> Result<Arc<Desc>, SciError> {
        let mut sd: SciHandle = std::ptr::null_mut();
        let mut err = SCI_ERR_OK;
        // SAFETY: valid out-pointers; the library is initialized (`sisci`).
        unsafe { (sisci.api.open)(&mut sd, 0, &mut err) };
        check("SCIOpen", err)?;
        Ok(Arc::new(Desc { sisci, sd }))
    }

    /// `SCIGetLocalNodeId(adapter)`.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn local_node_id(&self, adapter: u32) -> Result<u32, SciError> {
        let mut node: c_uint = 0;
        let mut err = SCI_ERR_OK;
        // SAFETY: valid out-pointers; the library is initialized.
        unsafe { (self.sisci.api.local_node_id)(adapter, &mut node, 0, &mut err) };
        check("SCIGetLocalNodeId", err)?;
        Ok(node)
    }

    /// The library this descriptor was opened with.
    pub fn sisci(&self) -> &Sisci {
        &self.sisci
    }

    fn api(&self) -> &Api {
        &self.sisci.api
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        let mut err = SCI_ERR_OK;
        // SAFETY: `sd` was opened by `open` and is closed once; every object made from it
        // holds an `Arc<Desc>`, so none is left.
        unsafe { (self.api().close)(self.sd, 0, &mut err) };
    }
}

/// One release call of a drop sequence: `call(h, 0, &err)`.
#[derive(Clone, Copy)]
struct Step {
    call: FnRelease,
    h: SciHandle,
}

/// The steps of a release that SISCI answered `SCI_ERR_BUSY`, and what must outlive them.
struct Leftover {
    steps: Vec<Step>,
    _keep: Box<dyn std::any::Any + Send>,
}

// SAFETY: the handles are only passed to SISCI release calls, on the reaper thread, after
// their owner is gone (see `release`).
unsafe impl Send for Leftover {}

/// How often a busy release is retried.
pub const REAP_EVERY: Duration = Duration::from_millis(10);

/// Run `steps` in order, each until it stops answering `SCI_ERR_BUSY`; the first busy one
/// and the rest are handed, with `keep` (the descriptor, and anything else that must be
/// released after them), to a background thread that retries every [`REAP_EVERY`]. Without
/// a thread (spawn failure) they are left to the SISCI driver's cleanup at process exit, and
/// `keep` is leaked so that nothing is closed under them.
///
/// # Safety
///
/// Each step's `call` must be the SISCI call that releases handles of its `h`'s kind; each
/// `h` must be live and not used again by the caller; the steps must be in a valid release
/// order.
unsafe fn release(steps: &[Step], keep: Box<dyn std::any::Any + Send>) {
    for (i, st) in steps.iter().enumerate() {
        let mut err = SCI_ERR_OK;
        // SAFETY: the caller's contract: a live handle of the kind `call` takes, released in
        // order.
        unsafe { (st.call)(st.h, 0, &mut err) };
        if SciError::new("", err).is_busy() {
            let left = Leftover {
                steps: steps[i..].to_vec(),
                _keep: keep,
            };
            // Shared with the thread, so that a failed spawn (which drops the closure) does
            // not drop the leftover: it is then leaked, and nothing is closed under it.
            let slot = Arc::new(Mutex::new(Some(left)));
            let theirs = slot.clone();
            let spawned = std::thread::Builder::new()
                .name("sisci-release".into())
                .spawn(move || {
                    let taken = theirs.lock().map(|mut g| g.take()).unwrap_or(None);
                    let Some(left) = taken else { return };
                    for st in &left.steps {
                        loop {
                            let mut err = SCI_ERR_OK;
                            // SAFETY: as above; a BUSY answer leaves the handle live, so the
                            // call may be repeated.
                            unsafe { (st.call)(st.h, 0, &mut err) };
                            if !SciError::new("", err).is_busy() {
                                break;
                            }
                            std::thread::sleep(REAP_EVERY);
                        }
                    }
                });
            if spawned.is_err() {
                if let Some(left) = slot.lock().ok().and_then(|mut g| g.take()) {
                    std::mem::forget(left);
                }
            }
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Local segment.
// ---------------------------------------------------------------------------------------------

/// This process's exported segment: created, prepared on the adapter and mapped locally;
/// connectable by peers once [`set_available`](Self::set_available).
pub struct LocalSegment {
    desc: Arc<Desc>,
    seg: SciHandle,
    map: SciHandle,
    ptr: *mut u8,
    len: usize,
    id: u32,
    adapter: u32,
    available: AtomicBool,
}

// SAFETY: see `Desc`; the mapped memory is accessed only through `Region`s under the
// protocol's one-side-at-a-time discipline.
unsafe impl Send for LocalSegment {}
// SAFETY: as above; `set_available` is the only call made through `&self` that changes
// library state, and it is atomic-flagged.
unsafe impl Sync for LocalSegment {}

impl LocalSegment {
    /// `SCICreateSegment(id, size)`, `SCIPrepareSegment(adapter)`, `SCIMapLocalSegment`.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn create(
        desc: &Arc<Desc>,
        id: u32,
        size: usize,
        adapter: u32,
    ) -> Result<LocalSegment, SciError> {
        let api = *desc.api();
        let mut seg: SciHandle = std::ptr::null_mut();
        let mut err = SCI_ERR_OK;
        // SAFETY: valid out-pointers; no callback (null function and argument).
        unsafe {
            (api.create_segment)(
                desc.sd,
                &mut seg,
                id,
                size,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut err,
            )
        };
        check("SCICreateSegment", err)?;
        let remove = |seg| {
            let mut e2 = SCI_ERR_OK;
            // SAFETY: `seg` was created above, is not mapped and is removed once.
            unsafe { (api.remove_segment)(seg, 0, &mut e2) };
        };
        // SAFETY: `seg` is a live local segment; valid out-pointer.
        unsafe { (api.prepare_segment)(seg, adapter, 0, &mut err) };
        if let Err(e) = check("SCIPrepareSegment", err) {
            remove(seg);
            return Err(e);
        }
        let mut map: SciHandle = std::ptr::null_mut();
        // SAFETY: `seg` is live and prepared; offset 0 and `size` are its bounds; no address
        // hint (null); valid out-pointers.
        let p =
            unsafe { (api.map_local)(seg, &mut map, 0, size, std::ptr::null_mut(), 0, &mut err) };
        if let Err(e) = check("SCIMapLocalSegment", err) {
            remove(seg);
            return Err(e);
        }
        let s = LocalSegment {
            desc: desc.clone(),
            seg,
            map,
            ptr: p.cast::<u8>(),
            len: size,
            id,
            adapter,
            available: AtomicBool::new(false),
        };
        if s.ptr.is_null() || s.ptr as usize % 64 != 0 {
            // Dropping `s` unmaps and removes.
            return Err(SciError::new("SCIMapLocalSegment", 0x915 | SCI_ERR_MASK));
        }
        Ok(s)
    }

    /// `SCISetSegmentAvailable(adapter)`: peers may connect from now on.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn set_available(&self) -> Result<(), SciError> {
        let mut err = SCI_ERR_OK;
        // SAFETY: `seg` is live and prepared on `adapter`.
        unsafe { (self.desc.api().set_available)(self.seg, self.adapter, 0, &mut err) };
        check("SCISetSegmentAvailable", err)?;
        self.available.store(true, Ordering::Release);
        Ok(())
    }

    /// The segment id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The whole mapped segment as a [`Region`] that keeps it alive.
    pub fn region(self: &Arc<Self>) -> Region {
        // SAFETY: `ptr` is the local mapping of `len` bytes returned by SCIMapLocalSegment,
        // 64-aligned (checked in `create`), valid until `SCIUnmapSegment` in `drop`, which
        // cannot run while the `Arc` in the region's keep-alive exists. Peers write it under
        // the protocol's discipline, as for a shared file.
        unsafe { Region::from_raw(self.ptr, self.len, self.clone()) }
    }
}

impl Drop for LocalSegment {
    fn drop(&mut self) {
        let api = *self.desc.api();
        let mut err = SCI_ERR_OK;
        if self.available.load(Ordering::Acquire) {
            // SAFETY: `seg` is live and was made available on `adapter`.
            unsafe { (api.set_unavailable)(self.seg, self.adapter, 0, &mut err) };
        }
        let steps = [
            Step {
                call: api.unmap,
                h: self.map,
            },
            Step {
                call: api.remove_segment,
                h: self.seg,
            },
        ];
        // SAFETY: `map` is the live local mapping, unmapped once, and no `Region` on it is
        // left (each holds an `Arc` of this segment); then `seg`, unmapped, is removed once.
        // Peers still connected make SISCI answer BUSY until they disconnect: `release`
        // finishes in the background, holding the descriptor.
        unsafe { release(&steps, Box::new(self.desc.clone())) };
    }
}

// ---------------------------------------------------------------------------------------------
// Remote segment.
// ---------------------------------------------------------------------------------------------

/// A peer's segment: connected, mapped remotely, with a map sequence for store barriers.
pub struct RemoteSegment {
    desc: Arc<Desc>,
    /// This process's segment, removed only after this connection is closed.
    own: Option<Arc<LocalSegment>>,
    rseg: SciHandle,
    map: SciHandle,
    seq: SciHandle,
    ptr: *mut u8,
    len: usize,
    lost: AtomicBool,
    /// When the last event poll ran (`None`: never); locked while one runs.
    probing: Mutex<Option<Instant>>,
}

// SAFETY: see `Desc`; concurrent calls on one remote segment are `SCIStoreBarrier` (the MT
// library's barrier is thread-safe) and event polls, which are serialized by `probing`.
unsafe impl Send for RemoteSegment {}
// SAFETY: as above.
unsafe impl Sync for RemoteSegment {}

impl RemoteSegment {
    /// `SCIConnectSegment(node, id, adapter)` within `timeout_ms`, `SCIMapRemoteSegment` of
    /// `size` bytes, `SCICreateMapSequence`. `own` (this process's segment) is kept until
    /// this connection is closed.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn connect(
        desc: &Arc<Desc>,
        own: &Arc<LocalSegment>,
        node: u32,
        id: u32,
        adapter: u32,
        size: usize,
        timeout_ms: u32,
    ) -> Result<RemoteSegment, SciError> {
        let api = *desc.api();
        let mut rseg: SciHandle = std::ptr::null_mut();
        let mut err = SCI_ERR_OK;
        // SAFETY: valid out-pointers; no callback (null function and argument).
        unsafe {
            (api.connect)(
                desc.sd,
                &mut rseg,
                node,
                id,
                adapter,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                timeout_ms,
                0,
                &mut err,
            )
        };
        check("SCIConnectSegment", err)?;
        let disconnect = |rseg| {
            let mut e2 = SCI_ERR_OK;
            // SAFETY: `rseg` was connected above, is not mapped and is disconnected once.
            unsafe { (api.disconnect)(rseg, 0, &mut e2) };
        };
        let mut map: SciHandle = std::ptr::null_mut();
        // SAFETY: `rseg` is connected; offset 0 and `size`: the published segment size (the
        // library refuses a size beyond the segment); no address hint; valid out-pointers.
        let p =
            unsafe { (api.map_remote)(rseg, &mut map, 0, size, std::ptr::null_mut(), 0, &mut err) };
        if let Err(e) = check("SCIMapRemoteSegment", err) {
            disconnect(rseg);
            return Err(e);
        }
        let mut seq: SciHandle = std::ptr::null_mut();
        // SAFETY: `map` is a live remote map; valid out-pointers.
        unsafe { (api.create_sequence)(map, &mut seq, 0, &mut err) };
        if let Err(e) = check("SCICreateMapSequence", err) {
            let mut e2 = SCI_ERR_OK;
            // SAFETY: `map` is live and unmapped once, before its segment is disconnected.
            unsafe { (api.unmap)(map, 0, &mut e2) };
            disconnect(rseg);
            return Err(e);
        }
        let s = RemoteSegment {
            desc: desc.clone(),
            own: Some(own.clone()),
            rseg,
            map,
            seq,
            ptr: p.cast::<u8>(),
            len: size,
            lost: AtomicBool::new(false),
            probing: Mutex::new(None),
        };
        if s.ptr.is_null() || s.ptr as usize % 64 != 0 {
            return Err(SciError::new("SCIMapRemoteSegment", 0x915 | SCI_ERR_MASK));
        }
        Ok(s)
    }

    /// `SCIStoreBarrier`: every store made so far through this mapping has reached the
    /// remote memory.
    #[inline]
    pub fn barrier(&self) {
        // SAFETY: `seq` is the live sequence of this mapping.
        unsafe { (self.desc.api().store_barrier)(self.seq, 0) };
    }

    /// Whether SISCI reported the connection gone: a non-blocking
    /// `SCIWaitForRemoteSegmentEvent` (timeout 0) that answers `SCI_CB_DISCONNECT` or
    /// `SCI_CB_LOST`, or fails with a peer-class error. Sticky. The poll runs at most every
    /// [`EVENT_POLL_EVERY`] (waits on Dolphin return every few hundred microseconds, and each
    /// is followed by a liveness check); concurrent callers skip it while another one runs.
    pub fn gone(&self) -> bool {
        if self.lost.load(Ordering::Relaxed) {
            return true;
        }
        let Ok(mut last) = self.probing.try_lock() else {
            return false;
        };
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < EVENT_POLL_EVERY) {
            return false;
        }
        *last = Some(now);
        let mut status = SCI_ERR_OK;
        let mut err = SCI_ERR_OK;
        // SAFETY: `rseg` is connected; valid out-pointers; timeout 0 returns at once.
        let reason =
            unsafe { (self.desc.api().remote_event)(self.rseg, &mut status, 0, 0, &mut err) };
        if remote_event_means_gone(reason, err) {
            self.lost.store(true, Ordering::Relaxed);
        }
        self.lost.load(Ordering::Relaxed)
    }

    /// The whole mapped segment as a [`Region`] that keeps it connected and mapped.
    pub fn region(self: &Arc<Self>) -> Region {
        // SAFETY: `ptr` is the remote mapping of `len` bytes returned by SCIMapRemoteSegment,
        // 64-aligned (checked in `connect`), valid until `SCIUnmapSegment` in `drop`, which
        // cannot run while the region's keep-alive `Arc` exists. Stores through it are PIO
        // writes into the peer's memory, made under the protocol's discipline.
        unsafe { Region::from_raw(self.ptr, self.len, self.clone()) }
    }
}

/// Least interval between two event polls of one remote segment ([`RemoteSegment::gone`]).
pub const EVENT_POLL_EVERY: Duration = Duration::from_millis(10);

/// Whether an answer of `SCIWaitForRemoteSegmentEvent` (its return value and error code)
/// means the connection is gone for good. Pure (tested).
pub fn remote_event_means_gone(reason: c_uint, err: SciErrorCode) -> bool {
    if err == SCI_ERR_OK {
        return reason == SCI_CB_DISCONNECT || reason == SCI_CB_LOST;
    }
    let e = SciError::new("SCIWaitForRemoteSegmentEvent", err);
    // CANCELLED is a disconnect on this very handle (ours, at drop), not the peer.
    e.class() == SciClass::Peer && e.code & 0xFFF != 0x91A
}

impl Drop for RemoteSegment {
    fn drop(&mut self) {
        let api = *self.desc.api();
        let steps = [
            Step {
                call: api.remove_sequence,
                h: self.seq,
            },
            Step {
                call: api.unmap,
                h: self.map,
            },
            Step {
                call: api.disconnect,
                h: self.rseg,
            },
        ];
        // Released after the steps: this process's segment, then the descriptor.
        let keep = (self.own.take(), self.desc.clone());
        // SAFETY: `seq` is the live sequence of `map`, removed once, before the map; `map` is
        // live, unmapped once, and no `Region` on it is left (each holds an `Arc` of this);
        // then the connection, unmapped, is closed once.
        unsafe { release(&steps, Box::new(keep)) };
    }
}

// ---------------------------------------------------------------------------------------------
// DMA queue.
// ---------------------------------------------------------------------------------------------

/// What [`DmaQueue::wait`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaWait {
    /// The transfer completed.
    Done,
    /// Still running after the timeout.
    Pending,
}

/// A DMA queue of one entry on the local adapter (one per sending half, never shared).
pub struct DmaQueue {
    /// Keeps the descriptor (and the library) open while the queue lives.
    _desc: Arc<Desc>,
    dq: SciHandle,
    api: DmaApi,
}

// SAFETY: see `Desc`; the queue is used by one sending half at a time (`&mut self`).
unsafe impl Send for DmaQueue {}

impl DmaQueue {
    /// `SCICreateDMAQueue(adapter, 1)`; `Ok(None)` if the library has no DMA calls.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn create(desc: &Arc<Desc>, adapter: u32) -> Result<Option<DmaQueue>, SciError> {
        let Some(api) = desc.api().dma else {
            return Ok(None);
        };
        let mut dq: SciHandle = std::ptr::null_mut();
        let mut err = SCI_ERR_OK;
        // SAFETY: valid out-pointers; the descriptor is open.
        unsafe { (api.create)(desc.sd, &mut dq, adapter, 1, 0, &mut err) };
        check("SCICreateDMAQueue", err)?;
        Ok(Some(DmaQueue {
            _desc: desc.clone(),
            dq,
            api,
        }))
    }

    /// `SCIStartDmaTransfer`: `len` bytes from `src_off` of `src` to `dst_off` of `dst`.
    /// Returns `SCI_ERR_OUT_OF_RANGE` without calling the library if a range is outside its
    /// segment.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn start(
        &mut self,
        src: &LocalSegment,
        src_off: usize,
        dst: &RemoteSegment,
        dst_off: usize,
        len: usize,
    ) -> Result<(), SciError> {
        let inside =
            |off: usize, seg_len: usize| off.checked_add(len).is_some_and(|e| e <= seg_len);
        if !inside(src_off, src.len) || !inside(dst_off, dst.len) {
            return Err(SciError::new("SCIStartDmaTransfer", 0x90B | SCI_ERR_MASK));
        }
        let mut err = SCI_ERR_OK;
        // SAFETY: the queue, the local segment (prepared on the adapter) and the connected
        // remote segment are live; both ranges are inside their segments (checked above); no
        // callback. The source range is the sender's staging chunk, which it does not touch
        // until `wait` says done.
        unsafe {
            (self.api.start)(
                self.dq,
                src.seg,
                dst.rseg,
                src_off,
                len,
                dst_off,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut err,
            )
        };
        check("SCIStartDmaTransfer", err)
    }

    /// `SCIWaitForDMAQueue` for at most `timeout`.
    ///
    /// # Errors
    ///
    /// The library's [`SciError`] (its code, and the call that returned it).
    pub fn wait(&mut self, timeout: Duration) -> Result<DmaWait, SciError> {
        let ms = timeout
            .as_millis()
            .clamp(1, u128::from(SCI_INFINITE_TIMEOUT - 1)) as c_uint;
        let mut err = SCI_ERR_OK;
        // SAFETY: live queue; valid out-pointer.
        let state = unsafe { (self.api.wait)(self.dq, ms, 0, &mut err) };
        let e = SciError::new("SCIWaitForDMAQueue", err);
        if err != SCI_ERR_OK {
            return if e.is_timeout() {
                Ok(DmaWait::Pending)
            } else {
                Err(e)
            };
        }
        match state {
            SCI_DMAQUEUE_DONE | SCI_DMAQUEUE_IDLE => Ok(DmaWait::Done),
            _ => Err(SciError::dma_failed()),
        }
    }
}

impl Drop for DmaQueue {
    fn drop(&mut self) {
        let steps = [Step {
            call: self.api.remove,
            h: self.dq,
        }];
        // SAFETY: live queue, removed once; a transfer still running (after a failure) makes
        // SISCI answer BUSY for a while.
        unsafe { release(&steps, Box::new(self._desc.clone())) };
    }
}

/// The `Debug` impls of this module's handles: names, numbers and sizes, never the memory.
mod debug;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_are_named_and_classified_with_or_without_the_mask() {
        for &(c, name, class) in SCI_ERRORS {
            for code in [c, c | SCI_ERR_MASK] {
                let e = SciError::new("SCIOpen", code);
                assert_eq!(e.name(), Some(name));
                assert_eq!(e.class(), class);
                assert!(e.to_string().contains(name), "{e}");
            }
        }
        let unknown = SciError::new("SCIOpen", 0x1234_5678);
        assert_eq!(unknown.name(), None);
        assert_eq!(unknown.class(), SciClass::Unknown);
        assert!(unknown.to_string().contains("0x12345678"));
        assert_eq!(SciError::new("x", 0x4000_0777).class(), SciClass::Unknown);
        assert!(SciError::new("x", 0x918 | SCI_ERR_MASK).is_id_used());
        assert!(!SciError::new("x", 0x1918).is_id_used());
    }

    #[test]
    fn errors_map_to_typed_errors() {
        let e = |c: u32, p| SciError::new("SCIConnectSegment", c | SCI_ERR_MASK).to_error(p);
        assert!(matches!(
            e(0x90C, Some(3)),
            Error::ConnectionLost { rank: 3, .. }
        ));
        assert!(matches!(
            e(0xA02, Some(1)),
            Error::ConnectionLost { rank: 1, .. }
        ));
        match e(0x90A, Some(2)) {
            Error::ConnectionLost { rank: 2, source } => {
                assert_eq!(source.kind(), std::io::ErrorKind::TimedOut)
            }
            other => panic!("{other:?}"),
        }
        for (code, peer) in [
            (0x909, None),
            (0x909, Some(1)),
            (0x90C, None),
            (0x920, None),
        ] {
            match e(code, peer) {
                Error::Unavailable { driver, reason, .. } => {
                    assert_eq!(driver, "sisci:dolphin");
                    assert!(reason.contains("sisci:local"), "{reason}");
                    assert!(reason.contains("SCIConnectSegment"), "{reason}");
                }
                other => panic!("0x{code:x}: {other:?}"),
            }
        }
        assert!(matches!(e(0x904, Some(1)), Error::Resource(_)));
        assert!(matches!(e(0x918, None), Error::Resource(_)));
        assert!(matches!(e(0x900, None), Error::Resource(_)));
        assert!(matches!(e(0x910, None), Error::BadConfig(_)));
        assert!(matches!(
            SciError::new("x", 0xdead).to_error(Some(4)),
            Error::ConnectionLost { rank: 4, .. }
        ));
        // Every code, known or not, masked or not: no panic, and a peer-free error names
        // the call.
        let mut x: u32 = 0x9E37_79B9;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let err = SciError::new("SCIOpen", x);
            let _ = err.to_error(Some(x as usize % 7));
            assert!(err.to_error(None).to_string().contains("SCIOpen"));
        }
    }

    #[test]
    fn remote_events() {
        assert!(remote_event_means_gone(SCI_CB_DISCONNECT, SCI_ERR_OK));
        assert!(remote_event_means_gone(SCI_CB_LOST, SCI_ERR_OK));
        assert!(!remote_event_means_gone(SCI_CB_NOT_OPERATIONAL, SCI_ERR_OK));
        assert!(!remote_event_means_gone(4, SCI_ERR_OK), "operational");
        assert!(!remote_event_means_gone(0, 0x90A | SCI_ERR_MASK), "timeout");
        assert!(
            !remote_event_means_gone(0, 0x91A | SCI_ERR_MASK),
            "cancelled"
        );
        assert!(
            remote_event_means_gone(0, 0xA02 | SCI_ERR_MASK),
            "not responding"
        );
        assert!(
            !remote_event_means_gone(0, 0x912 | SCI_ERR_MASK),
            "illegal parameter"
        );
    }

    #[test]
    fn missing_library_and_missing_symbols() {
        match Sisci::get("/nonexistent/libsisci.so") {
            Err(LoadError::Load(t)) => assert!(t.contains("/nonexistent/libsisci.so"), "{t}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("loaded a missing library"),
        }
        match Sisci::get("libc.so.6") {
            Err(LoadError::Load(t)) => {
                assert!(t.contains("missing symbol SCIInitialize"), "{t}");
                assert!(t.contains("_SISCI_PUBLIC_FUNC_MT_SCIInitialize"), "{t}");
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("libc is not SISCI"),
        }
        assert!(LOADED.lock().unwrap().is_none(), "nothing stays loaded");
    }
}
