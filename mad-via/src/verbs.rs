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

use crate::proto::SlotConfig;
use crate::reg::Pd;

/// What each rank publishes through the bootstrap allgather to connect its queue pairs: LID,
/// GID, initial PSN, and the number of the QP it created for every rank (0 for itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Local identifier of the port (0 on RoCE).
    pub lid: u16,
    /// GID of the port.
    pub gid: [u8; 16],
    /// Initial packet sequence number of this rank's send queues.
    pub psn: u32,
    /// QP number dedicated to each rank.
    pub qpns: Vec<u32>,
}

impl ConnInfo {
    /// Encode (little-endian).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(26 + 4 * self.qpns.len());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&(self.qpns.len() as u32).to_le_bytes());
        for q in &self.qpns {
            v.extend_from_slice(&q.to_le_bytes());
        }
        v
    }

    /// Decode a record for a session of `size` ranks; never panics.
    pub fn decode(b: &[u8], size: usize) -> std::result::Result<ConnInfo, String> {
        let want = 26usize.saturating_add(size.saturating_mul(4));
        if b.len() != want {
            return Err(format!("{} bytes, expected {want}", b.len()));
        }
        let u32_at = |at: usize| {
            let mut x = [0u8; 4];
            x.copy_from_slice(&b[at..at + 4]);
            u32::from_le_bytes(x)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[2..18]);
        if u32_at(22) as usize != size {
            return Err(format!("{} QPs for a session of {size}", u32_at(22)));
        }
        Ok(ConnInfo {
            lid: u16::from_le_bytes([b[0], b[1]]),
            gid,
            psn: u32_at(18),
            qpns: (0..size).map(|i| u32_at(26 + 4 * i)).collect(),
        })
    }
}

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

/// Open a `via:verbs` channel: probe, then build the verbs NICs and run the common protocol
/// over them.
pub(crate) fn open(
    ctx: &OpenContext<'_>,
    pd: &Arc<Pd>,
    cfg: SlotConfig,
    cache_entries: usize,
) -> Result<OpenedChannel> {
    let dev = probe()?;
    #[cfg(feature = "verbs")]
    {
        crate::sys::verbs::open(ctx, &dev, pd, cfg, cache_entries)
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = (ctx, pd, cfg, cache_entries, dev);
        Err(unavailable(
            "unreachable: probe succeeded without the verbs feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_info_roundtrip_and_garbage() {
        let c = ConnInfo {
            lid: 7,
            gid: [3; 16],
            psn: 0xabcdef,
            qpns: vec![0, 11, 12],
        };
        assert_eq!(ConnInfo::decode(&c.encode(), 3).unwrap(), c);
        assert!(ConnInfo::decode(&c.encode(), 4).is_err());
        assert!(ConnInfo::decode(&[], 0).is_err());
        assert!(ConnInfo::decode(&[0xff; 26], 0).is_err());
        assert!(ConnInfo::decode(&[0; 30], usize::MAX).is_err());
    }
}
