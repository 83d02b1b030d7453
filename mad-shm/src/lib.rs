//! # mad-shm: the Madeleine shared-memory driver (`shm`)
//!
//! Processes (or threads) on one host talk through single-producer single-consumer byte rings
//! in `/dev/shm`, with a single-copy path for streams of large pieces through Cross Memory
//! Attach (`process_vm_readv`).
//!
//! * **Segments** ([`segment`]): each process creates one segment holding one incoming ring
//!   per peer and a doorbell; names are exchanged with the bootstrap's `allgather`, every peer
//!   maps every segment, and once all have (a second collective) each creator unlinks its file.
//!   No `/dev/shm` entry outlives the channel's opening.
//! * **Rings** ([`ring`]): the SCALE discipline (copy in place, Release-publish the write
//!   offset; Acquire-read, copy out, Release-publish the read offset), lock-free, monotonic
//!   64-bit offsets, head and tail on separate 128-byte blocks.
//! * **Transmission modules** (default `cma=auto`): TM 0 `ring` (copy BMM) up to
//!   [`DEFAULT_RING_MAX`]; TM 1 `cma` (gather BMM) up to [`DEFAULT_CMA_MAX`]: a group sent
//!   back to back with the previous one to the same peer ([`link::CmaUse::BackToBack`]) is
//!   posted as an iovec record in the ring, the receiver reads the sender's memory directly
//!   and bumps a completion counter the sender waits on; any other group is pipelined through
//!   the ring behind a short record; TM 2 `pipe` (copy BMM) above, pipelined through the ring
//!   in 64 KiB lends.
//! * **Waiting**: a shared futex per process (the doorbell) that writers ring only when the
//!   reader has registered as sleeping; a second futex per ring for writers waiting for room.
//! * **Peer death**: a pidfd per peer, checked every few milliseconds while polling and after
//!   every blocking slice ([`link::WAIT_SLICE`]).
//! * **Readiness descriptor** (event loops): an epoll set of two abstract-namespace datagram
//!   sockets named after the segment and the peers' pidfds; writers send it a byte only while
//!   it is armed (a bit in the doorbell's and writer bells' sleeper words, see
//!   [`mad_core::hostmem::ready`]). None when some rank cannot reach the others' sockets
//!   (another network namespace): the ranks vote at open.
//!
//! Options (`shm,ring=262144,cma=auto`): `ring` (bytes per ring, power of two, at least 4096;
//! default [`default_ring`] of the job size), `cma` = `auto` (the default: the three TMs
//! above, CMA where the kernel permits it without relaxing Yama; a stream of 128 KiB–1 MiB
//! messages moves 2–2.6× faster than through the ring, a ping-pong keeps the ring's
//! pipelined latency, see `NOTES.md`), `on` (the same, but allow any same-user tracer for
//! Yama and fail if the kernel forbids CMA), `always` (CMA for every piece above
//! [`DEFAULT_RING_MAX`], allowing the tracer), `off` (no CMA: the ring for every piece, split
//! and pipelined) or `ring` (the `auto` table, its `cma` groups always streamed through the
//! ring: the fallback path, selectable for tests).

#![deny(unsafe_code)]

pub mod link;
pub mod ring;
pub mod segment;
pub mod sys;

use std::sync::{Arc, OnceLock};

use mad_core::config::ChannelConfig;
use mad_core::driver::{
    Adapters, Capabilities, Driver, DriverOptions, LinkPair, OpenContext, OpenedChannel, TmSpec,
    TmTable,
};
use mad_core::hostmem::{self, MappedPeer};
use mad_core::{Error, Result};

use link::{CmaUse, GatherPath, ShmIncoming, ShmRx, ShmTx};
use segment::Segment;

/// Largest default ring (bytes), used by jobs of 2 or 3 ranks: a large piece streams through
/// the ring in [`link`]'s 64 KiB lends, and a 1 MiB ring keeps 16 of them in flight (the sweep
/// in `NOTES.md`: 4–16 MiB messages 5–15 % faster than with 256 KiB rings, level with
/// sisci:local's 1 MiB of DMA chunks). Larger jobs get smaller rings ([`default_ring`]).
pub const DEFAULT_RING: usize = 1 << 20;
/// Budget of one process's segment that sizes the default ring: every byte of a segment is
/// reserved in `/dev/shm` at open, and a segment holds one ring per rank, so `n` processes
/// with rings of `cap` bytes reserve about `n² × cap`.
pub const SEGMENT_BUDGET: usize = 4 << 20;

/// The ring capacity used when the `ring` option is absent, for a job of `n` ranks: the
/// largest power of two (between 4 KiB and [`DEFAULT_RING`]) that keeps the segment within
/// [`SEGMENT_BUDGET`]: 1 MiB for 2–3 ranks, 512 KiB for 4–7, 256 KiB for 8–15, 128 KiB for
/// 16–31, 4 KiB from 342 ranks on (400 ranks then reserve 400 × 3.2 MiB = 1.3 GB of
/// `/dev/shm`, against 42 GB with 256 KiB rings). Every rank computes the same value (the
/// ring sizes are compared at open).
pub fn default_ring(n: usize) -> usize {
    let per_ring = (SEGMENT_BUDGET / n.max(1)).saturating_sub(ring::layout::HDR);
    let cap = match per_ring.checked_ilog2() {
        Some(b) => 1usize << b,
        None => 0,
    };
    cap.clamp(4096, DEFAULT_RING)
}
/// Largest ring accepted.
pub const MAX_RING: usize = 1 << 30;
/// Largest piece sent through the ring when the `cma` TM is in the table (`cma=auto|on|ring|
/// always`), from the ring/CMA sweep in `NOTES.md`. With `cma=off` the ring takes every piece.
pub const DEFAULT_RING_MAX: usize = 64 * 1024;
/// Largest piece of the `cma` TM under `cma=auto|on|ring`; larger ones go to the `pipe` TM
/// (pipelined through the ring): from 2 MiB up the two-copy ring beats the single copy in
/// streams too (`NOTES.md`, "Large pieces").
pub const DEFAULT_CMA_MAX: usize = 1 << 20;
/// Slices per CMA group.
pub const CMA_MAX_GROUP: usize = 64;

/// The `shm` driver.
#[derive(Debug, Default, Clone)]
pub struct ShmDriver {
    _priv: (),
}

impl ShmDriver {
    /// A new driver instance.
    pub fn new() -> Self {
        ShmDriver { _priv: () }
    }
}

/// What the `cma` option asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CmaWish {
    /// The default: CMA for back-to-back pieces of the `cma` band where permitted.
    Auto,
    /// As `Auto`, but fail where CMA is not permitted.
    On,
    Off,
    /// CMA for every piece above the ring threshold, where permitted.
    Always,
    /// Keep the `cma` TM but stream its pieces through the ring (the fallback taken when the
    /// probe fails on some pair; this value exists to test that path).
    Ring,
}

struct Options {
    /// The `ring` option; [`default_ring`] of the job size when absent.
    ring: Option<usize>,
    cma: CmaWish,
}

fn options(config: &ChannelConfig) -> Result<Options> {
    let ring = config.option_size_in("ring", 4096, MAX_RING)?;
    if let Some(ring) = ring {
        if !ring::index::valid_cap(ring) {
            return Err(Error::BadConfig(format!(
                "shm: ring={ring}: must be a power of two between 4096 and {MAX_RING}"
            )));
        }
    }
    let cma = match config.options.get("cma").map(String::as_str) {
        Some("off") | Some("0") | Some("false") => CmaWish::Off,
        None | Some("auto") => CmaWish::Auto,
        Some("always") => CmaWish::Always,
        Some("on") | Some("1") | Some("true") => CmaWish::On,
        Some("ring") => CmaWish::Ring,
        Some(v) => {
            return Err(Error::BadConfig(format!(
                "shm: cma={v}: use auto, on, always, off or ring"
            )))
        }
    };
    // Unknown keys and adapters: refused by the session (`accepted_options`).
    Ok(Options { ring, cma })
}

/// Whether this process can use `process_vm_readv` at all (checked once).
fn cma_supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(sys::cma_self_check)
}

/// What each rank publishes at open.
struct PeerInfo {
    name: String,
    pid: u32,
    probe_addr: u64,
    probe: [u8; 16],
    fingerprint: u64,
    cap: u64,
}

impl PeerInfo {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64 + self.name.len());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.probe_addr.to_le_bytes());
        v.extend_from_slice(&self.probe);
        v.extend_from_slice(&self.fingerprint.to_le_bytes());
        v.extend_from_slice(&self.cap.to_le_bytes());
        v.extend_from_slice(self.name.as_bytes());
        v
    }

    fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        const FIXED: usize = 4 + 8 + 16 + 8 + 8;
        if b.len() < FIXED || b.len() > FIXED + 255 {
            return Err(Error::protocol(rank, "shm: malformed segment announcement"));
        }
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let mut probe = [0u8; 16];
        probe.copy_from_slice(&b[12..28]);
        let name = std::str::from_utf8(&b[FIXED..])
            .map_err(|_| Error::protocol(rank, "shm: segment name is not UTF-8"))?
            .to_string();
        Ok(PeerInfo {
            pid: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            probe_addr: u64_at(4),
            probe,
            fingerprint: u64_at(28),
            cap: u64_at(36),
            name,
        })
    }
}

impl Driver for ShmDriver {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn describe(&self) -> String {
        "shm: processes on this host, rings in /dev/shm, large pieces pipelined through the ring or, in streams, single-copied with CMA (options ring=<bytes>, cma=auto|on|always|off|ring)"
            .into()
    }

    fn accepted_options(&self, _config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(Adapters::None, &["ring", "cma"])
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        let o = options(config)?;
        // With `auto` the `cma` TM is always in the table, whatever this process's self-check
        // says: every rank must build the same table (its fingerprint is compared at open),
        // and a host where CMA is refused to some ranks only (one under a seccomp profile)
        // must fall back, not fail. The open's probe and vote choose the path.
        let cma = match o.cma {
            CmaWish::Off => false,
            CmaWish::Auto | CmaWish::Always | CmaWish::Ring => true,
            CmaWish::On => {
                if !cma_supported() {
                    return Err(Error::unavailable(
                        "shm",
                        "cma=on but process_vm_readv is not permitted here; use cma=off or auto",
                    ));
                }
                true
            }
        };
        if o.cma == CmaWish::Always {
            TmTable::new([
                TmSpec::copy("ring", DEFAULT_RING_MAX, "copied through the SPSC ring"),
                TmSpec::gather(
                    "cma",
                    usize::MAX,
                    CMA_MAX_GROUP,
                    "single copy: receiver process_vm_readv's the sender's iovecs",
                ),
            ])
        } else if cma {
            TmTable::new([
                TmSpec::copy("ring", DEFAULT_RING_MAX, "copied through the SPSC ring"),
                TmSpec::gather(
                    "cma",
                    DEFAULT_CMA_MAX,
                    CMA_MAX_GROUP,
                    "back to back: receiver process_vm_readv's the sender's iovecs; else pipelined through the ring",
                ),
                TmSpec::copy(
                    "pipe",
                    usize::MAX,
                    "copied through the SPSC ring (split and pipelined)",
                ),
            ])
        } else {
            TmTable::new([TmSpec::copy(
                "ring",
                usize::MAX,
                "copied through the SPSC ring (split and pipelined)",
            )])
        }
    }

    fn capabilities(&self, _config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
            .with_direct_poll_limit(1024)
            .with_detects_peer_death(true)
            .with_intra_node_only(true)
            .with_max_message(None)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let o = options(ctx.config)?;
        let b = ctx.bootstrap;
        let (me, n) = (b.rank(), b.size());
        let local = ctx.local_ranks();
        let cma_tm = ctx
            .table
            .tms()
            .iter()
            .position(|t| t.name == "cma")
            .map(|i| i as u8);

        hostmem::sweep_stale(segment::PREFIX);
        // Only when asked for (`cma=on|always`): the default `auto` uses CMA where the kernel
        // already permits it and never relaxes Yama's ptrace protection (RELIABILITY.md §6).
        if cma_tm.is_some() && matches!(o.cma, CmaWish::On | CmaWish::Always) {
            sys::allow_ptracer_any();
        }

        let pid = std::process::id();
        let name = hostmem::segment_name(segment::PREFIX, &ctx.config.name, me)?;
        let ctx_bytes = ctx.tag("segs");
        let proof = b.secret().proof(
            b"mad-shm segment",
            name.as_bytes(),
            &[],
            ctx_bytes.as_bytes(),
        );
        let ring = o.ring.unwrap_or_else(|| default_ring(n));
        let advice = format!(
            ", or smaller rings (option ring=<bytes>, a power of two of at least 4096; now {ring})"
        );
        let mut own = Segment::create(&name, n, ring, &proof, local.len(), &advice)?;
        // Bound before the announcement, so every peer can reach it once the allgather returns.
        let endpoint = hostmem::Endpoint::open(&name).ok();

        let mut probe = [0u8; 16];
        mad_core::auth::fill_random(&mut probe)?;
        let probe_buf: Box<[u8; 16]> = Box::new(probe);
        let info = PeerInfo {
            name: name.clone(),
            pid,
            probe_addr: probe_buf.as_ptr() as usize as u64,
            probe,
            fingerprint: ctx.table.fingerprint(),
            cap: ring as u64,
        };
        let peers =
            hostmem::map_peers(b, &local, &ctx_bytes, &info.encode(), "shm", |r, bytes| {
                let pi = PeerInfo::decode(r, bytes)?;
                if pi.fingerprint != info.fingerprint {
                    return Err(Error::BadConfig(format!(
                        "shm: rank {r} has a different TM table (options or thresholds differ)"
                    )));
                }
                if pi.cap != info.cap {
                    return Err(Error::BadConfig(format!(
                        "shm: rank {r} uses ring={} but this rank ring={}",
                        pi.cap, info.cap
                    )));
                }
                let check = |p: &[u8]| {
                    b.secret().verify(
                        b"mad-shm segment",
                        pi.name.as_bytes(),
                        &[],
                        ctx_bytes.as_bytes(),
                        p,
                    )
                };
                let seg = Segment::open(&pi.name, r, n, ring, pi.pid, &check)?;
                let pid = pi.pid;
                Ok((pi, seg, pid))
            })?;

        // CMA probe: read every local peer's probe buffer; agree on the result.
        let mut cma_ok = cma_tm.is_some() && o.cma != CmaWish::Ring;
        let mut why = if o.cma == CmaWish::Ring {
            "forced by cma=ring".to_string()
        } else {
            String::new()
        };
        if cma_ok && !cma_supported() {
            cma_ok = false;
            why = format!("process_vm_readv is not permitted in rank {me}");
        }
        if cma_ok {
            for (r, p) in peers.iter().enumerate() {
                let Some(MappedPeer { info: pi, .. }) = p else {
                    continue;
                };
                let mut got = [0u8; 16];
                let remote = [sys::RemoteSlice {
                    addr: pi.probe_addr,
                    len: 16,
                }];
                let res = sys::cma_read(pi.pid, &mut [std::io::IoSliceMut::new(&mut got)], &remote);
                if res.is_err() || got != pi.probe {
                    cma_ok = false;
                    why = match res {
                        Err(e) if o.cma == CmaWish::Auto => format!(
                            "reading rank {r}'s memory failed: {e}; cma=on or always relax Yama's ptrace_scope 1"
                        ),
                        Err(e) => format!("reading rank {r}'s memory failed: {e}"),
                        Ok(()) => format!("reading rank {r}'s memory returned other bytes"),
                    };
                    break;
                }
            }
        }
        // Readiness: this rank's sockets reach every peer's, and the epoll set takes their pidfds.
        let mut ready =
            hostmem::PeerReadiness::connect(endpoint.as_ref(), &name, &peers, |pi: &PeerInfo| {
                &pi.name
            });
        let ready_ok = ready.ready();
        let votes = b.allgather(&ctx.tag("cma"), &[cma_ok as u8 | (ready_ok as u8) << 1])?;
        drop(probe_buf);
        // Every rank has mapped every segment: remove the files.
        own.unlink()?;
        let all_ok = hostmem::vote(&votes, &local, 1);
        ready.settle(hostmem::vote(&votes, &local, 2));
        let hostmem::PeerReadiness {
            mut sigs,
            readiness,
        } = ready;
        let path = if cma_tm.is_some() && all_ok {
            GatherPath::Cma
        } else {
            GatherPath::Ring
        };

        let cma_use = if o.cma == CmaWish::Always {
            CmaUse::Always
        } else {
            CmaUse::BackToBack
        };

        let own = Arc::new(own);
        let mut links: Vec<Option<LinkPair>> = (0..n).map(|_| None).collect();
        let mut watched = Vec::new();
        let mut conns = Vec::new();
        for (r, p) in peers.into_iter().enumerate() {
            let Some(MappedPeer {
                info: pi,
                seg,
                watch,
            }) = p
            else {
                continue;
            };
            let out_ring = seg
                .ring(me)
                .ok_or_else(|| Error::protocol(r, "shm: peer segment lacks our ring"))?;
            let in_ring = own
                .ring(r)
                .ok_or_else(|| Error::protocol(me, "shm: own segment lacks a ring"))?;
            watched.push((r, in_ring.clone(), watch.clone()));
            let (pair, conn) = link::connection(
                ShmTx::new(
                    r,
                    out_ring,
                    seg,
                    watch.clone(),
                    cma_tm,
                    path,
                    ctx.progress.oversubscribed,
                )
                .with_cma_use(cma_use)
                .with_signals(sigs[r].clone()),
                ShmRx::new(r, pi.pid, in_ring, own.clone(), watch, cma_tm, path)
                    .with_signals(sigs[r].take()),
            );
            links[r] = Some(pair);
            conns.push(conn);
        }

        let mut notes = vec![format!(
            "shm: {} B ring per peer, {} local peer(s), segments unlinked after mapping",
            ring,
            watched.len()
        )];
        notes.push(if readiness.is_some() {
            "shm: readiness descriptor: epoll over two abstract datagram sockets and the peers' pidfds".into()
        } else {
            "shm: no readiness descriptor (a rank cannot create or reach the abstract sockets)".into()
        });
        notes.push(match (cma_tm, path) {
            (None, _) => "shm: no CMA (cma=off): large pieces are pipelined through the ring".into(),
            (Some(_), GatherPath::Cma) if cma_use == CmaUse::Always => "shm: CMA permitted (cma=always): pieces above the ring threshold are single-copied with process_vm_readv".into(),
            (Some(_), GatherPath::Cma) => "shm: CMA permitted: `cma` pieces sent back to back are single-copied with process_vm_readv, others pipelined through the ring".into(),
            (Some(_), GatherPath::Ring) => format!(
                "shm: CMA not permitted between every pair of ranks{}: `cma` pieces are streamed through the ring",
                if why.is_empty() { String::new() } else { format!(" (here: {why})") }
            ),
        });
        if readiness.is_none() {
            tracing::info!(
                channel = %ctx.config.name,
                "no readiness descriptor (a rank cannot create or reach the abstract sockets): \
                 event loops poll this channel"
            );
        }
        if let (Some(_), GatherPath::Ring) = (cma_tm, path) {
            tracing::info!(
                channel = %ctx.config.name,
                reason = %why,
                "CMA not permitted between every pair of ranks: `cma` pieces are streamed \
                 through the ring"
            );
        }
        Ok(OpenedChannel::new(
            links,
            Box::new(
                ShmIncoming::new(own, watched)
                    .with_readiness(readiness)
                    .with_connections(conns),
            ),
        )
        .with_notes(notes))
    }
}
