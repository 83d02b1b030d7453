//! # mad-via: the Madeleine VIA driver
//!
//! VIA-class networks (VIA, InfiniBand verbs) move bytes in three ways whose relative cost
//! depends on the block size (Madeleine II, section 3), and this driver offers all three as
//! transmission modules:
//!
//! | TM | BMM | how |
//! |---|---|---|
//! | `small` (0) | Copy | message passing through a pool of pre-registered static buffers, credit-based flow control |
//! | `medium` (1) | Gather | message passing from/to the user's buffers, registered on the fly through an LRU registration cache |
//! | `large` (2) | Gather | rendezvous: the receiver registers its destination and sends key and address; the sender RDMA-writes into it and signals completion |
//!
//! The soft thresholds come from Figure 4 on the soft backend (see `NOTES.md`) and depend on
//! the registration cache: with it ([`SMALL_MAX`], [`MEDIUM_MAX`]) registration is mostly a
//! cache hit and send/receive takes every piece above 16 KiB; without it (`regcache=0`:
//! [`UNCACHED_SMALL_MAX`], [`UNCACHED_MEDIUM_MAX`]) static buffers go up to 64 KiB and the
//! rendezvous takes the rest. The verbs ones ([`VERBS_SMALL_MAX`], [`VERBS_MEDIUM_MAX`]) are not
//! measured (no HCA). All can be overridden per channel: `via:soft,tm.small=2k,tm.medium=1m`.
//!
//! Two backends (the channel adapter):
//!
//! * `via:soft` ([`soft`]): a software NIC in user space, like M-VIA over Ethernet. Its queue
//!   pairs are TCP connections (two per pair of ranks: control and data); it enforces what
//!   verbs enforce (registration before use, RDMA writes only into advertised regions with the
//!   right key and within bounds, sends only into posted receives / with a credit).
//! * `via:verbs` (cargo feature `verbs`): real HCAs through `rdma-sys` (**untested**: written
//!   without a device). Without a device (or without the feature) opening such a channel
//!   fails with [`Error::Unavailable`] naming the cause and suggesting `via:soft`.
//!
//! Both run the same protocol code: the transmission modules, credits, rendezvous and
//! registration cache are written once against a verbs-shaped provider interface
//! (`provider.rs`, `proto.rs`), implemented by the soft NIC and by the verbs NIC.
//!
//! Readiness descriptor (event loops): an epoll set, made at first use, of each connection's
//! control socket (verbs: completion channel) and a wake-up socket; a send armed with
//! `arm_send` is signalled by whichever poll of its connection sees it move, or by one-shot
//! registrations of its sockets for room. `Incoming::shutdown` marks every connection closed
//! and sends end of stream on both queue pairs (soft: a clean close for the peer).
//!
//! Users can also borrow pre-registered memory ([`ViaHandle::request_buffer`], pCoR's buffer
//! request/release): data packed from such a buffer travels without registration.
//!
//! ```no_run
//! use mad_via::ViaDriver;
//! let via = ViaDriver::new();
//! let handle = via.handle(); // keep it: registered buffers and counters
//! let mut buf = handle.request_buffer(1 << 20);
//! buf.fill(7);
//! // ... session.driver(via) ... packer.pack(&buf, RecvMode::Cheaper) ...
//! # let _ = buf;
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

use std::sync::Arc;

use mad_core::config::ChannelConfig;
use mad_core::driver::{
    Adapters, Capabilities, Driver, DriverOptions, OpenContext, OpenedChannel, TmSpec, TmTable,
};
use mad_core::{Error, Result};

mod proto;
mod provider;
pub mod reg;
mod setup;
pub mod soft;
mod sys;
pub mod verbs;
pub mod wire;

pub use proto::{ConnStats, SlotConfig, TM_LARGE, TM_MEDIUM, TM_SMALL};
pub use reg::{Pd, RegStats, RegisteredBuffer};
pub use soft::Endpoint;

/// Default largest piece of the `small` TM (static buffers) on `via:soft`, from the Figure 4
/// sweep (static buffers beat registration up to 16 KiB, lose from 32 KiB).
pub const SMALL_MAX: usize = 16 << 10;
/// Default largest piece of the `medium` TM on `via:soft`: unbounded. In the sweep the
/// rendezvous never beat send/receive on the soft provider (it serialises the receiver's
/// registration and the transfer), so the default table sends everything above
/// [`SMALL_MAX`] as medium; `tm.medium=<size>` brings the rendezvous back above that size.
pub const MEDIUM_MAX: usize = usize::MAX;
/// Largest `small` piece on `via:soft` with the registration cache off (`regcache=0`: every
/// dynamic registration is an `mlock`/`munlock` pair per transfer): static buffers beat
/// registration up to 64 KiB in the Figure 4 runs of 2026-11-28 (by 16–25 % at 64 KiB).
pub const UNCACHED_SMALL_MAX: usize = 64 << 10;
/// Largest `medium` piece on `via:soft` with the registration cache off: none above
/// [`UNCACHED_SMALL_MAX`]; the rendezvous takes every larger piece (Figure 4, 2026-11-28:
/// 0.6–0.8 of the best forced method from 128 KiB to 2 MiB, 1.02–1.06 at 4–8 MiB).
pub const UNCACHED_MEDIUM_MAX: usize = UNCACHED_SMALL_MAX;
/// Default largest `small` piece on `via:verbs`: **not measured** (no HCA here).
pub const VERBS_SMALL_MAX: usize = 32 << 10;
/// Default largest `medium` piece on `via:verbs`: **not measured**. Above it the zero-copy
/// rendezvous, which also avoids a medium send arriving before its receive is posted (an
/// RNR retry on an RC QP).
pub const VERBS_MEDIUM_MAX: usize = 4 << 20;

/// Which provider a channel uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// The software NIC over TCP.
    Soft,
    /// ibverbs.
    Verbs,
}

impl Backend {
    /// The backend named by a channel's adapter (`soft` when none is given).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] for an adapter other than `soft` and
    /// `verbs`.
    pub fn of(config: &ChannelConfig) -> Result<Backend> {
        match config.adapter.as_deref() {
            None | Some("soft") => Ok(Backend::Soft),
            Some("verbs") => Ok(Backend::Verbs),
            Some(other) => Err(Error::BadConfig(format!(
                "channel `{}`: via has no backend `{other}`: use via:soft or via:verbs",
                config.name
            ))),
        }
    }
}

/// The `via` driver.
#[derive(Debug)]
pub struct ViaDriver {
    pd: Arc<Pd>,
}

/// A handle on the driver's protection domain, kept by the application after the driver is
/// given to the session: registered buffers and registration counters.
#[derive(Clone, Debug)]
pub struct ViaHandle {
    pd: Arc<Pd>,
}

impl ViaHandle {
    /// Request a pre-registered buffer of `len` bytes (pCoR's buffer request). Pack it (or a
    /// prefix) like any slice: it travels without registration; drop it to release it.
    pub fn request_buffer(&self, len: usize) -> RegisteredBuffer {
        RegisteredBuffer::request(&self.pd, len)
    }

    /// Registration counters (registrations, cache hits, refused writes, ...).
    pub fn stats(&self) -> RegStats {
        self.pd.stats()
    }
}

impl Default for ViaDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl ViaDriver {
    /// A driver whose registration cache keeps [`reg::DEFAULT_CACHE_ENTRIES`] user ranges.
    pub fn new() -> Self {
        Self::with_cache_entries(reg::DEFAULT_CACHE_ENTRIES)
    }

    /// A driver whose registration cache keeps `n` user ranges (0: register each transfer and
    /// deregister it afterwards).
    pub fn with_cache_entries(n: usize) -> Self {
        ViaDriver { pd: Pd::new(n) }
    }

    /// A handle on this driver's registered memory and counters.
    pub fn handle(&self) -> ViaHandle {
        ViaHandle {
            pd: self.pd.clone(),
        }
    }

    fn slot_config(config: &ChannelConfig) -> Result<SlotConfig> {
        let d = SlotConfig::default();
        // One credit is kept for rendezvous requests, so at least 2.
        let slots = config.option_in("slots", 2, 4096)?.unwrap_or(d.slots);
        let slot_size = config
            .option_size_in("slot_size", 64, wire::MAX_PAYLOAD)?
            .unwrap_or(d.slot_size);
        Ok(SlotConfig { slots, slot_size })
    }

    /// `regcache=<entries>`: the size of this channel's cache of user registrations.
    fn cache_entries(&self, config: &ChannelConfig) -> Result<usize> {
        Ok(config
            .option_in("regcache", 0, MAX_REGCACHE)?
            .unwrap_or(self.pd.cache_entries()))
    }
}

/// Largest `regcache` (entries of a channel's registration cache).
pub const MAX_REGCACHE: usize = 1 << 20;

/// The TM table of a `via:soft` channel (before `tm.*` overrides): [`default_table`] with the
/// registration cache on, [`uncached_table`] with it off (`regcache=0`).
///
/// # Errors
///
/// As [`default_table`].
pub fn soft_table(cache_entries: usize) -> Result<TmTable> {
    if cache_entries == 0 {
        uncached_table()
    } else {
        default_table()
    }
}

/// The TM table of `via:soft` with the registration cache off (`regcache=0`, before `tm.*`
/// overrides): static buffers up to [`UNCACHED_SMALL_MAX`], the rendezvous above.
///
/// # Errors
///
/// [`Error::BadConfig`] if the built-in table were invalid (never for
/// this one).
pub fn uncached_table() -> Result<TmTable> {
    TmTable::new([
        TmSpec::copy(
            "small",
            UNCACHED_SMALL_MAX,
            "copy into pre-registered static buffers, credit flow control (<= 64 KiB without the registration cache: Figure 4, NOTES.md)",
        ),
        TmSpec::gather(
            "medium",
            UNCACHED_MEDIUM_MAX,
            16,
            "send/recv of user memory registered for the call (not chosen without the registration cache: Figure 4)",
        ),
        TmSpec::gather(
            "large",
            usize::MAX,
            1,
            "rendezvous: receiver advertises key+address, sender RDMA-writes and signals completion (every piece above 64 KiB without the registration cache)",
        ),
    ])
}

/// The default TM table of `via:soft`, registration cache on (before `tm.*` overrides).
///
/// # Errors
///
/// [`Error::BadConfig`] if the built-in table were invalid (never for
/// this one).
pub fn default_table() -> Result<TmTable> {
    TmTable::new([
        TmSpec::copy(
            "small",
            SMALL_MAX,
            "copy into pre-registered static buffers, credit flow control (<= 16 KiB: Figure 4 sweep, NOTES.md)",
        ),
        TmSpec::gather(
            "medium",
            MEDIUM_MAX,
            16,
            "send/recv of user memory registered on the fly, LRU registration cache (every larger piece on soft: Figure 4 sweep)",
        ),
        TmSpec::gather(
            "large",
            usize::MAX,
            1,
            "rendezvous: receiver advertises key+address, sender RDMA-writes and signals completion (only with tm.medium=<size> on soft)",
        ),
    ])
}

/// The default TM table of `via:verbs` (before `tm.*` overrides): thresholds **not measured**.
///
/// # Errors
///
/// [`Error::BadConfig`] if the built-in table were invalid (never for
/// this one).
pub fn verbs_table() -> Result<TmTable> {
    TmTable::new([
        TmSpec::copy(
            "small",
            VERBS_SMALL_MAX,
            "send from pre-registered static buffers, credit flow control (<= 32 KiB: not measured, no HCA)",
        ),
        TmSpec::gather(
            "medium",
            VERBS_MEDIUM_MAX,
            16,
            "send/recv of user memory registered for the call (<= 4 MiB: not measured, no HCA)",
        ),
        TmSpec::gather(
            "large",
            usize::MAX,
            1,
            "rendezvous: receiver advertises key+address, sender RDMA-writes, the last write with immediate",
        ),
    ])
}

impl Driver for ViaDriver {
    fn name(&self) -> &'static str {
        "via"
    }

    fn describe(&self) -> String {
        format!(
            "via:soft (software NIC over TCP, always available), via:verbs (ibverbs HCAs; {})",
            if cfg!(feature = "verbs") {
                "built in"
            } else {
                "needs the `verbs` cargo feature"
            }
        )
    }

    fn accepted_options(&self, config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(
            Adapters::OneOf(&["soft", "verbs"]),
            match Backend::of(config) {
                // `host`: the address the soft NIC listens on.
                Ok(Backend::Soft) => &["slots", "slot_size", "regcache", "host"],
                _ => &["slots", "slot_size", "regcache"],
            },
        )
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        // Checked before the ranks exchange anything, so every rank fails alike.
        Self::slot_config(config)?;
        let entries = self.cache_entries(config)?;
        match Backend::of(config)? {
            Backend::Soft => soft_table(entries),
            Backend::Verbs => verbs_table(),
        }
    }

    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
            .with_direct_poll_limit(4)
            // Soft: end of stream or reset on the sockets. Verbs has no orderly close: a dead
            // peer shows only when a send exhausts its retries, so a waiting receiver may not
            // notice.
            .with_detects_peer_death(!matches!(Backend::of(config), Ok(Backend::Verbs)))
            .with_intra_node_only(false)
            .with_max_message(None)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let backend = Backend::of(ctx.config)?;
        let cfg = Self::slot_config(ctx.config)?;
        // `regcache=<entries>` sizes this channel's cache of user registrations (soft only:
        // the verbs provider never keeps user registrations, see `reg`).
        let entries = self.cache_entries(ctx.config)?;
        match backend {
            Backend::Verbs => verbs::open(ctx, &self.pd, cfg, entries),
            Backend::Soft => {
                let dev = soft::SoftDevice::new(&self.pd);
                let cache = reg::RegCache::new(dev.clone(), &self.pd, entries);
                let nics = setup::open_soft(ctx, &dev, cfg)?;
                let st = self.pd.stats();
                let notes = vec![
                    format!(
                        "via:soft: {} credits x {} B static buffers per connection, two TCP sockets (control, data QP)",
                        cfg.slots, cfg.slot_size
                    ),
                    format!(
                        "registration = mlock (pin failures so far: {}), LRU cache of {entries} user ranges",
                        st.pin_failures
                    ),
                ];
                proto::open_channel(nics, &cache, cfg, notes)
            }
        }
    }
}
