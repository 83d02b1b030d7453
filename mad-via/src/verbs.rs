//! The `via:verbs` backend: real HCAs through ibverbs (cargo feature `verbs`).
//!
//! Opening a channel probes the device list first. On a host without RDMA (this project's
//! machines: `ibv_get_device_list` returns NULL with errno ENOSYS) or in a build without the
//! feature, the open fails with [`Error::Unavailable`] naming the cause and suggesting
//! `via:soft`. Nothing panics.
//!
//! With a device, the open creates one protection domain, then per peer a completion queue
//! (with a completion channel for blocking waits), a control and a data RC queue pair and a
//! registered arena (static buffers, credit word); it exchanges [`ConnInfo`] (LID, GID, PSN,
//! QP numbers and credit words) through the session bootstrap's allgather, moves every QP to
//! RTS and runs the same protocol as `via:soft` over the verbs NICs. **That path is untested**:
//! no HCA here, no rxe/siw module in this kernel; see NOTES.md.

use std::sync::Arc;

use mad_core::driver::{OpenContext, OpenedChannel};
use mad_core::{Error, Result};

use crate::proto::SlotConfig;
use crate::reg::Pd;

/// What a rank publishes about its connection to one peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerQps {
    /// Number of the control QP dedicated to that peer.
    pub ctrl_qpn: u32,
    /// Number of the data QP dedicated to that peer.
    pub data_qpn: u32,
    /// Address of the credit word that peer RDMA-writes.
    pub credit_addr: u64,
    /// Remote key of the credit word.
    pub credit_rkey: u32,
}

/// What each rank publishes through the bootstrap allgather to connect its queue pairs: LID,
/// GID, initial PSN, and per rank (zeros for itself) its QP numbers and credit word.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Local identifier of the port (0 on RoCE).
    pub lid: u16,
    /// GID of the port.
    pub gid: [u8; 16],
    /// Initial packet sequence number of this rank's send queues.
    pub psn: u32,
    /// Per rank.
    pub peers: Vec<PeerQps>,
}

const PEER_LEN: usize = 20;

impl ConnInfo {
    /// Encode (little-endian).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(26 + PEER_LEN * self.peers.len());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&(self.peers.len() as u32).to_le_bytes());
        for p in &self.peers {
            v.extend_from_slice(&p.ctrl_qpn.to_le_bytes());
            v.extend_from_slice(&p.data_qpn.to_le_bytes());
            v.extend_from_slice(&p.credit_addr.to_le_bytes());
            v.extend_from_slice(&p.credit_rkey.to_le_bytes());
        }
        v
    }

    /// Decode a record for a session of `size` ranks; never panics.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong with the record.
    pub fn decode(b: &[u8], size: usize) -> std::result::Result<ConnInfo, String> {
        let want = size
            .checked_mul(PEER_LEN)
            .and_then(|x| x.checked_add(26))
            .ok_or("session too large")?;
        if b.len() != want {
            return Err(format!("{} bytes, expected {want}", b.len()));
        }
        let u32_at = |at: usize| {
            let mut x = [0u8; 4];
            x.copy_from_slice(&b[at..at + 4]);
            u32::from_le_bytes(x)
        };
        let u64_at = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[2..18]);
        if u32_at(22) as usize != size {
            return Err(format!("{} peers for a session of {size}", u32_at(22)));
        }
        Ok(ConnInfo {
            lid: u16::from_le_bytes([b[0], b[1]]),
            gid,
            psn: u32_at(18),
            peers: (0..size)
                .map(|i| {
                    let at = 26 + PEER_LEN * i;
                    PeerQps {
                        ctrl_qpn: u32_at(at),
                        data_qpn: u32_at(at + 4),
                        credit_addr: u64_at(at + 8),
                        credit_rkey: u32_at(at + 16),
                    }
                })
                .collect(),
        })
    }
}

/// The `Unavailable` error of this backend.
pub fn unavailable(reason: impl Into<String>) -> Error {
    Error::unavailable(
        "via:verbs",
        format!(
            "{}; use via:soft (the software provider) instead",
            reason.into()
        ),
    )
}

/// Check that an RDMA device can be used; `Ok(name)` of the first device.
///
/// # Errors
///
/// [`Error::Unavailable`] naming the cause (no `verbs` feature, no
/// library, no device) and suggesting `via:soft`.
#[cfg(not(feature = "verbs"))]
pub fn probe() -> Result<String> {
    Err(unavailable(
        "mad-via was built without the `verbs` cargo feature (no ibverbs support compiled in)",
    ))
}

/// Check that an RDMA device can be used; `Ok(name)` of the first device.
///
/// # Errors
///
/// [`Error::Unavailable`] naming the cause (the device list cannot be read, no device, the
/// first one cannot be opened) and suggesting `via:soft`.
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
    let dev = probe().inspect_err(|e| {
        tracing::warn!(channel = %ctx.config.name, error = %e, "via:verbs: no usable RDMA device");
    })?;
    tracing::debug!(channel = %ctx.config.name, device = %dev, "via:verbs: RDMA device");
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
            peers: vec![
                PeerQps::default(),
                PeerQps {
                    ctrl_qpn: 11,
                    data_qpn: 12,
                    credit_addr: 0x7f00_0000_1000,
                    credit_rkey: 0x55,
                },
                PeerQps {
                    ctrl_qpn: 13,
                    data_qpn: 14,
                    credit_addr: 8,
                    credit_rkey: 9,
                },
            ],
        };
        assert_eq!(ConnInfo::decode(&c.encode(), 3).unwrap(), c);
        assert!(ConnInfo::decode(&c.encode(), 4).is_err());
        assert!(ConnInfo::decode(&[], 0).is_err());
        assert!(ConnInfo::decode(&[0xff; 26], 0).is_err());
        assert!(ConnInfo::decode(&[0; 30], usize::MAX).is_err());
    }
}
