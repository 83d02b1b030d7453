//! # mad-uds: a minimal Madeleine driver over Unix domain sockets
//!
//! The worked example of `docs/driver-guide.md`: small enough to read in one sitting, complete
//! enough to pass the conformance kit. Every rank listens on a socket in a private (mode 0700)
//! temporary directory, publishes its path through the bootstrap, and connects to every lower
//! rank on the same host; the socket files are removed as soon as the channel is connected.
//!
//! Spec: `uds[,buf=<bytes>]` (copy buffer per connection, default 64 KiB). TMs:
//!
//! | TM | BMM | pieces | how |
//! |---|---|---|---|
//! | `copy` | Copy | up to 1 KiB | copied into a per-connection buffer, sent with the next write |
//! | `gather` | Gather | larger | one `writev` per group of up to 16 slices, `readv` in place |
//!
//! Progress blocks in `poll(2)`. No `unsafe` anywhere (std sockets, `nix` for `poll`/`pipe2`/
//! epoll).
//!
//! Readiness descriptor (event loops): an epoll set of the streams and the wake-up pipe, made
//! at first use; `arm_send` registers the sending half's descriptor, one-shot, for room.
//! `Incoming::shutdown` shuts every stream down both ways: peers read end of stream (a clean
//! close), local waits wake up.

#![forbid(unsafe_code)]

mod link;
mod setup;

use mad_core::config::ChannelConfig;
use mad_core::driver::{
    Adapters, Capabilities, Driver, DriverOptions, OpenContext, OpenedChannel, TmSpec, TmTable,
};
use mad_core::Result;

/// Default largest piece of the `copy` TM (see NOTES.md for the sweep that chose it).
pub const COPY_MAX: usize = 1 << 10;
/// Default copy buffer per connection and direction.
pub const BUF: usize = 64 << 10;
/// Most slices in one `writev` / `readv` group.
pub const MAX_GROUP: usize = 16;

/// The Unix-domain-socket driver (`uds`).
#[derive(Debug, Default, Clone, Copy)]
pub struct UdsDriver;

impl UdsDriver {
    /// The driver, to register with `SessionBuilder::driver`.
    pub fn new() -> Self {
        UdsDriver
    }
}

fn buf_size(c: &ChannelConfig) -> Result<usize> {
    Ok(c.option_in("buf", 64, 1 << 30)?.unwrap_or(BUF))
}

impl Driver for UdsDriver {
    fn name(&self) -> &'static str {
        "uds"
    }

    fn describe(&self) -> String {
        "uds: Unix domain sockets between processes of one host (no adapter)".into()
    }

    fn accepted_options(&self, _config: &ChannelConfig) -> DriverOptions {
        // No adapter: the session refuses `uds:anything`.
        DriverOptions::new(Adapters::None, &["buf"])
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        buf_size(config)?;
        TmTable::new([
            TmSpec::copy("copy", COPY_MAX, "copied into a socket buffer, one write"),
            TmSpec::gather("gather", usize::MAX, MAX_GROUP, "writev / readv in place"),
        ])
    }

    fn capabilities(&self, _config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
            .with_direct_poll_limit(4)
            .with_detects_peer_death(true)
            .with_intra_node_only(true)
            .with_max_message(None)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let buf = buf_size(ctx.config)?;
        let streams = setup::connect_all(ctx)?;
        link::open(streams, buf)
    }
}
