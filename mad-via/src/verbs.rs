//! The `via:verbs` backend: real HCAs through ibverbs (cargo feature `verbs`).
//!
//! Opening a channel probes the device list first. On a host without RDMA (this project's
//! machines: `ibv_get_device_list` returns NULL with errno ENOSYS) or in a build without the
//! feature, the open fails with [`Error::Unavailable`] naming the cause and suggesting
//! `via:soft`. Nothing panics.
//!
//! With a device, the open creates one protection domain, completion queue and RC queue pair
//! per peer, exchanges (LID, GID, QP number, PSN) through the session bootstrap's allgather and
//! moves every QP to RTS. **That path is untested** (no HCA here), and the verbs data path of
//! the three TMs is not written yet, so after a successful setup the open still reports
//! `Unavailable`; see NOTES.md.

use std::sync::Arc;

use mad_core::driver::{OpenContext, OpenedChannel};
use mad_core::{Error, Result};

use crate::reg::Pd;

/// The `Unavailable` error of this backend.
pub fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        driver: "via:verbs".into(),
        reason: format!(
            "{}; use via:soft (the software provider) instead",
            reason.into()
        ),
    }
}

/// Check that an RDMA device can be used; `Ok(name)` of the first device.
#[cfg(not(feature = "verbs"))]
pub fn probe() -> Result<String> {
    Err(unavailable(
        "mad-via was built without the `verbs` cargo feature (no ibverbs support compiled in)",
    ))
}

/// Check that an RDMA device can be used; `Ok(name)` of the first device.
#[cfg(feature = "verbs")]
pub fn probe() -> Result<String> {
    let list = crate::sys::verbs::DeviceList::get().map_err(|e| {
        unavailable(format!(
            "no RDMA device: ibv_get_device_list failed with errno {} ({e})",
            e.raw_os_error().unwrap_or(0)
        ))
    })?;
    list.first_name()
        .ok_or_else(|| unavailable("no RDMA device: ibv_get_device_list returned an empty list"))
}

/// Open a `via:verbs` channel.
pub(crate) fn open(ctx: &OpenContext<'_>, pd: &Arc<Pd>) -> Result<OpenedChannel> {
    let _ = pd;
    let dev = probe()?;
    #[cfg(feature = "verbs")]
    {
        crate::sys::verbs::setup(ctx, &dev)?;
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = ctx;
    }
    Err(unavailable(format!(
        "device `{dev}` found and queue pairs connected, but the verbs data path is not implemented in this version"
    )))
}
