//! # mad-tcp: the Madeleine II driver over TCP sockets
//!
//! One TCP connection per peer per channel, set up eagerly and authenticated when the channel
//! opens (`setup.rs`, [`handshake`]). Two transmission modules:
//!
//! | TM | BMM | pieces | how |
//! |---|---|---|---|
//! | 0 `small` | Copy | ≤ [`DEFAULT_SMALL_MAX`] B | copied into a per-connection 64 KiB buffer, which leaves with the next `sendmsg` |
//! | 1 `large` | Gather | larger | the user's slices, after the queued small bytes, in one `sendmsg`; scattered into place with `recvmsg` |
//!
//! so a message of small pieces leaves in one system call, and a message of small pieces plus
//! a large body too (when the socket takes it all).
//!
//! Channel spec: `tcp[:ADDRESS|INTERFACE][,connect_timeout_ms=30000][,liveness_ms=10000]
//! [,buffer=64k][,tm.small=N]`. The adapter is the local address to listen on (default
//! `127.0.0.1`) or an interface name (`eth0`), resolved with `getifaddrs`.
//!
//! Failures: end of stream is [`Error::PeerClosed`]; a reset, a peer found unreachable (nothing
//! heard from it for `liveness_ms` while the kernel waits for an acknowledgement, or failed
//! keepalive probes on an idle connection) or any other socket error is
//! [`Error::ConnectionLost`]. A live peer that is slow to read (a long compute phase with the
//! window closed) is not a dead one: its sender keeps waiting (see `link::Liveness`).
//!
//! Readiness descriptor (`Incoming::readiness_fd`, for event loops): the channel's
//! level-triggered epoll set of its sockets and wake-up eventfd (made at first use when the
//! channel has few peers, so blocking programs never pay for it); a send armed with
//! `TxLink::arm_send` adds a one-shot `EPOLLOUT` registration. `Incoming::shutdown` shuts
//! every socket down both ways: the peers see a clean close (FIN), local waits wake up.
//!
//! ```no_run
//! # fn main() -> mad_core::Result<()> {
//! use mad_core::{ChannelConfig, RecvMode, Session};
//! let session = Session::builder().driver(mad_tcp::TcpDriver::new()).build()?;
//! let ch = session.open_channel_with(ChannelConfig::parse("data", "tcp:127.0.0.1,progress=poll")?)?;
//! if session.size() > 1 && session.rank() == 0 {
//!     let body = vec![0u8; 1 << 20];
//!     let mut p = ch.begin_packing(1)?;
//!     p.pack_value(&(body.len() as u64), RecvMode::Express)?; // small: copy TM
//!     p.pack(&body, RecvMode::Cheaper)?; // large: gather TM, same sendmsg
//!     p.end_packing()?;
//! }
//! # Ok(()) }
//! ```

#![deny(unsafe_code)]

pub mod handshake;
pub mod link;
mod setup;
pub mod sys;

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use mad_core::driver::{
    Adapters, Capabilities, Driver, DriverOptions, LinkPair, OpenContext, OpenedChannel, TmSpec,
    TmTable,
};
use mad_core::progress::ProgressMode;
use mad_core::{ChannelConfig, Error, Result};

pub use link::{TcpIncoming, TcpRx, TcpTx};

/// Default largest piece sent through the `small` (copy) TM; chosen by the sweep in NOTES.md.
pub const DEFAULT_SMALL_MAX: usize = 8192;
/// Default size of each per-connection static buffer (send and receive).
pub const DEFAULT_BUFFER: usize = 64 * 1024;
/// Default bound on channel setup.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default liveness bound: how long a peer may stay silent while the kernel waits for its
/// acknowledgement before it is declared unreachable (and the keepalive horizon).
pub const DEFAULT_LIVENESS: Duration = Duration::from_secs(10);
/// Largest `liveness_ms` and `connect_timeout_ms`: one day. The keepalive idle time derived
/// from the liveness bound (a third of it) must stay under the kernel's limit of 32 767 s
/// (`TCP_KEEPIDLE`), and deadlines must not overflow.
pub const MAX_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// The option keys of a tcp channel.
pub const OPTION_KEYS: &[&str] = &["connect_timeout_ms", "liveness_ms", "buffer"];
/// Longest a blocking send or receive (block mode) stays in the kernel before the engine gets
/// control back to check deadlines and liveness.
const BLOCKING_SLICE: Duration = Duration::from_millis(200);
/// Bytes a message's first read takes beyond the copy threshold (header, descriptors).
const FIRST_READ_SLACK: usize = 512;
/// Smallest first read of a message.
const MIN_FIRST_READ: usize = 4096;
/// Most slices in one gather group (one slice of the `iovec` array goes to the queued bytes).
pub const MAX_GROUP: usize = sys::IOV_MAX - 1;

/// The TCP driver (`tcp`).
#[derive(Debug, Default, Clone)]
pub struct TcpDriver {
    _private: (),
}

impl TcpDriver {
    /// A TCP driver.
    pub fn new() -> Self {
        TcpDriver { _private: () }
    }
}

/// The options of a tcp channel, parsed from its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpOptions {
    /// Local address to listen on.
    pub ip: IpAddr,
    /// Bound on the whole setup.
    pub connect_timeout: Duration,
    /// Liveness bound (see [`DEFAULT_LIVENESS`]).
    pub liveness: Duration,
    /// Size of each static buffer.
    pub buffer: usize,
}

impl TcpOptions {
    /// Parse the options of `config` (adapter, `connect_timeout_ms`, `liveness_ms`, `buffer`).
    ///
    /// # Errors
    ///
    /// [`Error::BadConfig`] naming the option when a value does not
    /// parse or is out of range; as [`resolve_adapter`] for the adapter.
    pub fn from_config(config: &ChannelConfig) -> Result<Self> {
        // Every range is checked before the adapter is resolved (a system call).
        let (connect_timeout, liveness, buffer) = Self::numbers(config)?;
        let ip = resolve_adapter(config.adapter.as_deref())?;
        Ok(TcpOptions {
            ip,
            connect_timeout,
            liveness,
            buffer,
        })
    }

    /// The numeric options, range-checked: (`connect_timeout_ms`, `liveness_ms`, `buffer`).
    fn numbers(config: &ChannelConfig) -> Result<(Duration, Duration, usize)> {
        let ms = |key: &str, def: Duration| -> Result<Duration> {
            Ok(config
                .option_in::<u64>(key, 1, MAX_TIMEOUT_MS)?
                .map(Duration::from_millis)
                .unwrap_or(def))
        };
        let connect_timeout = ms("connect_timeout_ms", DEFAULT_CONNECT_TIMEOUT)?;
        let liveness = ms("liveness_ms", DEFAULT_LIVENESS)?;
        let buffer = config
            .option_size_in("buffer", 256, 64 << 20)?
            .unwrap_or(DEFAULT_BUFFER);
        Ok((connect_timeout, liveness, buffer))
    }
}

/// Resolve an adapter: an IP address, an interface name, or the default `127.0.0.1`.
///
/// # Errors
///
/// [`Error::BadConfig`] when the adapter is neither an address nor the
/// name of an interface with an address; [`Error::Io`] when the interfaces
/// cannot be listed.
pub fn resolve_adapter(adapter: Option<&str>) -> Result<IpAddr> {
    let a = match adapter {
        None => return Ok(IpAddr::from([127, 0, 0, 1])),
        Some(a) => a.trim(),
    };
    if let Ok(ip) = a.parse::<IpAddr>() {
        return Ok(ip);
    }
    if a == "localhost" {
        return Ok(IpAddr::from([127, 0, 0, 1]));
    }
    let addrs = sys::interface_addrs(a)
        .map_err(|e| Error::io(format!("tcp: listing the addresses of interface `{a}`"), e))?;
    addrs.into_iter().next().ok_or_else(|| {
        Error::BadConfig(format!(
            "tcp adapter `{a}` is neither an IP address nor an interface with an address"
        ))
    })
}

/// The driver's TM table with the given `small` threshold.
///
/// # Errors
///
/// [`Error::BadConfig`] when `small_max` does not give a valid table
/// (see [`TmTable::new`](mad_core::driver::TmTable::new)).
pub fn tm_table(small_max: usize) -> Result<TmTable> {
    TmTable::new([
        TmSpec::copy(
            "small",
            small_max,
            "copied into a per-connection buffer; leaves with the next sendmsg",
        ),
        TmSpec::gather(
            "large",
            usize::MAX,
            MAX_GROUP,
            "user slices after the queued bytes in one sendmsg; recvmsg into place",
        ),
    ])
}

impl Driver for TcpDriver {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn describe(&self) -> String {
        "tcp: adapter = a local IP address or an interface name (default 127.0.0.1)".into()
    }

    fn accepted_options(&self, _config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(
            Adapters::Free("a local IP address or an interface name"),
            OPTION_KEYS,
        )
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        // Called before the ranks exchange anything: a bad option fails here, on every rank.
        TcpOptions::numbers(config)?;
        tm_table(DEFAULT_SMALL_MAX)
    }

    fn capabilities(&self, _config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
            .with_direct_poll_limit(4)
            .with_detects_peer_death(true)
            .with_intra_node_only(false)
            .with_max_message(None)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let b = ctx.bootstrap;
        let (me, size) = (b.rank(), b.size());
        let reach: Vec<bool> = (0..size).map(|r| ctx.reaches(r)).collect();
        if !reach.contains(&true) {
            // Outside the channel's `ranks=`: no address (its adapter may not even exist on
            // this host, a rank of another cluster), no connection.
            b.allgather(&ctx.tag("addr"), b"-")?;
            let links = (0..size).map(|_| None).collect();
            return Ok(
                OpenedChannel::new(links, Box::new(TcpIncoming::new(false, Vec::new())?))
                    .with_notes(vec!["tcp: this rank is outside the channel's ranks".into()]),
            );
        }
        let opts = TcpOptions::from_config(ctx.config)?;
        // Two descriptors per peer at worst during setup, plus headroom for the program.
        let _ = sys::ensure_nofile(2 * size as u64 + 64);
        let listener = setup::listen(opts.ip)?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("tcp: reading the listener address", e))?;
        let all = b.allgather(&ctx.tag("addr"), local.to_string().as_bytes())?;
        if all.len() != size {
            return Err(Error::protocol(
                me,
                "bootstrap allgather returned the wrong number of addresses",
            ));
        }
        let addrs = setup::parse_addrs(&all)?;
        let params = setup::SetupParams {
            channel: &ctx.config.name,
            me,
            size,
            secret: b.secret(),
            fingerprint: ctx.table.fingerprint(),
            connect_timeout: opts.connect_timeout,
            reach,
        };
        let streams = setup::connect_all(&params, listener, &addrs)?;
        // A message's first read covers a header, descriptors and small pieces up to the copy
        // threshold; larger (gather) pieces are then read straight into place.
        let small_max = ctx.table.tms().first().map_or(0, |t| t.max_len);
        let first_read = small_max
            .saturating_add(FIRST_READ_SLACK)
            .max(MIN_FIRST_READ);
        let bulk_blocking = ctx.progress.mode == ProgressMode::Block;
        let caps = self.capabilities(ctx.config);
        let mut conns = Vec::with_capacity(size);
        for (r, st) in streams.into_iter().enumerate() {
            let Some(st) = st else {
                continue;
            };
            let cfg = |e| Error::io(format!("tcp: configuring the connection to rank {r}"), e);
            // The socket stays in blocking mode: every non-blocking call passes MSG_DONTWAIT,
            // and in block mode gather sends/receives wait in the kernel, in slices
            // (SO_SNDTIMEO/SO_RCVTIMEO) after which the engine checks its deadline and the
            // driver the peer's liveness.
            let slice = Some(
                ctx.progress
                    .op_timeout
                    .map_or(BLOCKING_SLICE, |t| t.min(BLOCKING_SLICE)),
            );
            st.set_read_timeout(slice).map_err(cfg)?;
            st.set_write_timeout(slice).map_err(cfg)?;
            st.set_nodelay(true).map_err(cfg)?;
            st.set_nonblocking(false).map_err(cfg)?;
            sys::set_keepalive(st.as_raw_fd(), opts.liveness).map_err(cfg)?;
            let sock = Arc::new(st);
            let live = link::Liveness::new(sock.clone(), r, opts.liveness);
            conns.push(link::Watched {
                peer: r,
                sock,
                live,
            });
        }
        let incoming = TcpIncoming::new(conns.len() > caps.direct_poll_limit, conns)?;
        let ready = incoming.ready();
        let mut links: Vec<Option<LinkPair>> = (0..size).map(|_| None).collect();
        for w in incoming.connections() {
            links[w.peer] = Some(LinkPair {
                tx: Box::new(TcpTx::new(
                    w.sock.clone(),
                    w.peer,
                    opts.buffer,
                    bulk_blocking,
                    w.live.clone(),
                    ready.clone(),
                )),
                rx: Box::new(TcpRx::new(
                    w.sock.clone(),
                    w.peer,
                    opts.buffer,
                    first_read,
                    bulk_blocking,
                    ready.clone(),
                    w.live.clone(),
                )),
            });
        }
        let notes = vec![format!(
            "tcp: {} listening for setup, {} connections, {} KiB buffers, liveness bound {} ms",
            local,
            links.iter().filter(|l| l.is_some()).count(),
            opts.buffer / 1024,
            opts.liveness.as_millis()
        )];
        Ok(OpenedChannel::new(links, Box::new(incoming)).with_notes(notes))
    }
}
