//! # mad-sisci: the Madeleine SCI driver (`sisci`)
//!
//! SCI is not message passing: a process *exports* memory segments, its peers *map* them, and
//! data moves by processor stores into remote memory (PIO) or by DMA. This driver runs the
//! Madeleine II SISCI protocol over two backends:
//!
//! * `sisci:local` (default): each process exports one segment in `/dev/shm` and maps its
//!   peers' segments ([`segment`]); stores into a peer's mapping stand for SCI remote stores,
//!   Release fences for `SCIStoreBarrier`. Runs and is tested on any Linux host.
//! * `sisci:dolphin` ([`dolphin`]): Dolphin's SISCI library, loaded with `dlopen` at run time
//!   ([`sys`]): segments created, exported, connected and mapped through SISCI, store barriers
//!   on every publication, DMA for the large blocks. Without the library or an adapter,
//!   opening a channel fails with [`Error::Unavailable`] naming the cause and suggesting
//!   `sisci:local`. **Untested against hardware**: it has only run against a stand-in
//!   library in the tests (see `NOTES.md`).
//!
//! Both backends run the same protocol code: the link halves are generic over a [`fabric`]
//! (the seam: publish, bulk copy, wake, sleep), monomorphised per backend.
//!
//! **Write remote, read local** ([`layout`]): a sender stores data, flags and its write offset
//! into the receiver's segment and reads acknowledgements from its own; the receiver reads its
//! own segment and stores acknowledgements into the sender's. No control word is polled by both
//! sides (in mad-shm, both ends poll the ring's head and tail in one shared place).
//!
//! Transmission modules ([`link`]):
//!
//! | TM | BMM | pieces | how |
//! |---|---|---|---|
//! | 0 `short` | copy | ≤ [`DEFAULT_SHORT_MAX`] | records in 64-byte slots: a flag word, then the bytes across as many slots as they need (a short message is one record: its flag shares the first line with its first 56 bytes); the reader polls the flag |
//! | 1 `ring` | copy | ≤ [`DEFAULT_RING_MAX`] | a byte ring (64 KiB) with a remote write offset and a remote acknowledgement |
//! | 2 `dma` | gather | larger | block copies into a large receive area, pipelined in chunks with their own flags |
//!
//! Readiness descriptor (event loops): on `local`, an epoll set of two abstract-namespace
//! datagram sockets named after the segment and the peers' pidfds, signalled by a writer only
//! while armed (a bit in the doorbell's and the sender bells' sleeper words, see
//! [`mad_core::hostmem::ready`]); none when some rank cannot reach the others' sockets. On
//! `dolphin`, none: there are no remote wake-ups to hook it to, and no hardware here to test.
//!
//! Options (`sisci:local,slots=64,ring=65536,chunk=262144,chunks=4,dma=on`, `sisci:dolphin,lib=/opt/DIS/lib64/libsisci.so,adapter_no=0`).

#![deny(unsafe_code)]

pub mod dolphin;
pub mod fabric;
pub mod layout;
pub mod link;
pub mod segment;
pub mod sys;

use std::sync::Arc;

use mad_core::config::ChannelConfig;
use mad_core::driver::{
    Adapters, Capabilities, Driver, DriverOptions, LinkPair, OpenContext, OpenedChannel, TmSpec,
    TmTable,
};
use mad_core::{Error, Result};

use fabric::{Local, LocalOwn, LocalRx, LocalShut, LocalTx};
use layout::Geometry;
use link::{Ends, RxShared, SciIncoming, SciRx, SciTx, Watched};
use mad_core::hostmem::{self, MappedPeer};
use mad_core::liveness::Teardown;
use segment::Segment;

/// Default largest piece of the `short` TM (from the sweep in `NOTES.md`): a message of pieces
/// up to 32 KiB is one record (the `ring` TM, with its offset line and a second TM for the
/// header, was 1.4–2.5× slower from 4 KiB on). Smaller when the slots are few: at most half
/// the slot array (`slots=2`: 64 B).
pub const DEFAULT_SHORT_MAX: usize = 32 * 1024;
/// Default largest piece of the `ring` TM (from the sweep in `NOTES.md`).
pub const DEFAULT_RING_MAX: usize = 32 * 1024;
/// Default short slots per connection (64 KiB: two records of the longest short piece).
pub const DEFAULT_SLOTS: usize = 1024;
/// Default ring bytes per connection.
pub const DEFAULT_RING: usize = 64 * 1024;
/// Default DMA chunk size.
pub const DEFAULT_CHUNK: usize = 64 * 1024;
/// Default DMA chunks per connection.
pub const DEFAULT_CHUNKS: usize = 16;
/// Slices per DMA group.
pub const DMA_MAX_GROUP: usize = 64;
/// Default library name for `sisci:dolphin`.
pub const DEFAULT_LIB: &str = "libsisci.so";

/// Which backend a configuration selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// Shared memory between processes of this host.
    Local,
    /// Dolphin SISCI hardware.
    Dolphin,
}

/// Parsed options of a `sisci` channel.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// Backend.
    pub backend: Backend,
    /// Segment geometry.
    pub geom: Geometry,
    /// Library to `dlopen` for `dolphin`.
    pub lib: String,
    /// Local adapter number for `dolphin`.
    pub adapter_no: u32,
}

/// Parse a configuration's adapter and options.
///
/// # Errors
///
/// [`Error::BadConfig`] for an unknown adapter, or an option that does
/// not parse or is out of range.
pub fn options(config: &ChannelConfig) -> Result<Options> {
    let backend = match config.adapter.as_deref() {
        None | Some("local") => Backend::Local,
        Some("dolphin") => Backend::Dolphin,
        Some(a) => {
            return Err(Error::BadConfig(format!(
                "sisci: unknown backend `{a}` (use sisci:local or sisci:dolphin)"
            )))
        }
    };
    // Unknown keys (and `lib`, `adapter_no` on local): refused by the session
    // (`accepted_options`).
    let dma = match config.options.get("dma").map(String::as_str) {
        None | Some("on") | Some("1") | Some("true") => true,
        Some("off") | Some("0") | Some("false") => false,
        Some(v) => return Err(Error::BadConfig(format!("sisci: dma={v}: use on or off"))),
    };
    if !dma && config.options.contains_key("chunks") {
        return Err(Error::BadConfig(format!(
            "channel `{}`: sisci chunks= has no meaning with dma=off",
            config.name
        )));
    }
    let geom = Geometry {
        slots: config
            .option_in("slots", 2, 65536)?
            .unwrap_or(DEFAULT_SLOTS),
        ring: config
            .option_size_in("ring", 4096, 1 << 30)?
            .unwrap_or(DEFAULT_RING),
        chunk: config
            .option_size_in("chunk", 4096, 1 << 26)?
            .unwrap_or(DEFAULT_CHUNK),
        chunks: if dma {
            config
                .option_in("chunks", 1, 1024)?
                .unwrap_or(DEFAULT_CHUNKS)
        } else {
            0
        },
    };
    if !geom.valid() || (dma && geom.chunks == 0) {
        return Err(Error::BadConfig(format!(
            "sisci: bad geometry {geom:?}: slots a power of two in 2..=65536, ring a power of two \
             of at least 4096, chunk a multiple of 4096 up to 64 MiB, chunks 1..=1024"
        )));
    }
    Ok(Options {
        backend,
        geom,
        lib: config
            .options
            .get("lib")
            .cloned()
            .unwrap_or_else(|| DEFAULT_LIB.to_string()),
        adapter_no: config.option_in("adapter_no", 0, u32::MAX)?.unwrap_or(0),
    })
}

/// Budget of one process's segment that scales the default geometry down in large jobs: a
/// segment holds one area per rank, and every byte is reserved at open.
pub const SEGMENT_BUDGET: usize = 16 << 20;

/// The geometry a job of `n` ranks uses: `g` as configured, with the sizes the user did not
/// set (`set`) halved until a segment fits [`SEGMENT_BUDGET`]: first the number of DMA chunks
/// (down to 4), then their size (down to 16 KiB), then the short slots (down to 64), then the
/// ring (down to 4 KiB), then the chunk again (down to 4 KiB). Up to 14 ranks the defaults
/// stay (1.2 MiB per peer); 64 ranks get four 16 KiB chunks (196 KiB per peer, 12 MiB per
/// process instead of 75 MiB); past 512 ranks even the smallest areas (28 KiB) exceed the
/// budget. Every rank computes the same geometry (it is compared at open).
pub fn fit_geometry(mut g: Geometry, n: usize, set: Given) -> Geometry {
    let fits = |g: &Geometry| g.segment_size(n).is_some_and(|s| s <= SEGMENT_BUDGET);
    let shrink_chunk = !set.chunk && g.chunks > 0;
    while !set.chunks && g.chunks > 0 && !fits(&g) && halve(&mut g.chunks, 4) {}
    while shrink_chunk && !fits(&g) && halve(&mut g.chunk, 16 << 10) {}
    while !set.slots && !fits(&g) && halve(&mut g.slots, 64) {}
    while !set.ring && !fits(&g) && halve(&mut g.ring, 4096) {}
    while shrink_chunk && !fits(&g) && halve(&mut g.chunk, 4096) {}
    g
}

/// The sizes of a geometry the user set (kept by [`fit_geometry`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Given {
    /// `slots=` was given.
    pub slots: bool,
    /// `ring=` was given.
    pub ring: bool,
    /// `chunk=` was given.
    pub chunk: bool,
    /// `chunks=` was given.
    pub chunks: bool,
}

impl Given {
    /// Every size given (none is changed).
    pub const ALL: Given = Given {
        slots: true,
        ring: true,
        chunk: true,
        chunks: true,
    };
}

/// Halve `v` if the result stays at least `min`; whether it did.
fn halve(v: &mut usize, min: usize) -> bool {
    if *v / 2 >= min {
        *v /= 2;
        true
    } else {
        false
    }
}

/// The `sisci` driver.
#[derive(Debug, Default, Clone)]
pub struct SisciDriver {
    _priv: (),
}

impl SisciDriver {
    /// A new driver instance.
    pub fn new() -> Self {
        SisciDriver { _priv: () }
    }
}

struct PeerInfo {
    pid: u32,
    fingerprint: u64,
    name: String,
}

impl PeerInfo {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(12 + self.name.len());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.fingerprint.to_le_bytes());
        v.extend_from_slice(self.name.as_bytes());
        v
    }

    fn decode(rank: usize, b: &[u8]) -> Result<Self> {
        if b.len() < 12 || b.len() > 12 + 255 {
            return Err(Error::protocol(
                rank,
                "sisci: malformed segment announcement",
            ));
        }
        let mut f = [0u8; 8];
        f.copy_from_slice(&b[4..12]);
        Ok(PeerInfo {
            pid: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            fingerprint: u64::from_le_bytes(f),
            name: std::str::from_utf8(&b[12..])
                .map_err(|_| Error::protocol(rank, "sisci: segment name is not UTF-8"))?
                .to_string(),
        })
    }
}

impl Driver for SisciDriver {
    fn name(&self) -> &'static str {
        "sisci"
    }

    fn describe(&self) -> String {
        "sisci: SCI-style remote-write segments; backends local (shared memory on this host) \
         and dolphin (libsisci.so, loaded at run time; untested against hardware)"
            .into()
    }

    fn accepted_options(&self, config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(
            Adapters::OneOf(&["local", "dolphin"]),
            match config.adapter.as_deref() {
                Some("dolphin") => &[
                    "slots",
                    "ring",
                    "chunk",
                    "chunks",
                    "dma",
                    "lib",
                    "adapter_no",
                ],
                _ => &["slots", "ring", "chunk", "chunks", "dma"],
            },
        )
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        let o = options(config)?;
        // Pieces the slots hold at least two records of (a few slots: the ring takes the rest).
        let short_max = DEFAULT_SHORT_MAX.min(o.geom.slots * layout::SLOT / 2);
        if o.geom.chunks == 0 {
            return TmTable::new([
                TmSpec::copy(
                    "short",
                    short_max,
                    "records in 64-byte slots, one flag each, the reader polls the flag",
                ),
                TmSpec::copy(
                    "ring",
                    usize::MAX,
                    "remote-write ring, remote offset and acknowledgement",
                ),
            ]);
        }
        TmTable::new([
            TmSpec::copy(
                "short",
                short_max,
                "records in 64-byte slots, one flag each, the reader polls the flag",
            ),
            TmSpec::copy(
                "ring",
                DEFAULT_RING_MAX,
                "remote-write ring, remote offset and acknowledgement",
            ),
            TmSpec::gather(
                "dma",
                usize::MAX,
                DMA_MAX_GROUP,
                "block copies into the peer's receive area, chunks pipelined with their own flags",
            ),
        ])
    }

    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        let dolphin = options(config)
            .map(|o| o.backend == Backend::Dolphin)
            .unwrap_or(false);
        Capabilities::default()
            .with_direct_poll_limit(1024)
            .with_detects_peer_death(true)
            .with_intra_node_only(!dolphin)
            .with_max_message(None)
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let mut o = options(ctx.config)?;
        let given = |k: &str| ctx.config.options.contains_key(k);
        o.geom = fit_geometry(
            o.geom,
            ctx.bootstrap.size(),
            Given {
                slots: given("slots"),
                ring: given("ring"),
                chunk: given("chunk"),
                chunks: given("chunks"),
            },
        );
        if o.backend == Backend::Dolphin {
            return dolphin::open(ctx, &o);
        }
        let b = ctx.bootstrap;
        let (me, n) = (b.rank(), b.size());
        hostmem::sweep_stale(segment::PREFIX);

        let pid = std::process::id();
        let name = hostmem::segment_name(segment::PREFIX, &ctx.config.name, me)?;
        let tag = ctx.tag("segs");
        let proof = b
            .secret()
            .proof(b"mad-sisci segment", name.as_bytes(), &[], tag.as_bytes());
        let g = o.geom;
        let advice = format!(
            ", or a smaller area per peer (options ring, chunk, chunks, slots, or dma=off; now \
             ring={} chunk={} chunks={} slots={}: {} B per peer)",
            g.ring,
            g.chunk,
            g.chunks,
            g.slots,
            g.area_size().unwrap_or(0)
        );
        let mut own = Segment::create(&name, n, o.geom, &proof, ctx.local_ranks().len(), &advice)?;
        // Bound before the announcement, so every peer can reach it once the allgather returns.
        let endpoint = hostmem::Endpoint::open(&name).ok();
        let info = PeerInfo {
            pid,
            fingerprint: ctx.table.fingerprint()
                ^ hostmem::fnv1a(format!("{:?}", o.geom).as_bytes()),
            name: name.clone(),
        };
        let peers = hostmem::map_peers(
            b,
            &ctx.local_ranks(),
            &tag,
            &info.encode(),
            "sisci",
            |r, bytes| {
                let pi = PeerInfo::decode(r, bytes)?;
                if pi.fingerprint != info.fingerprint {
                    return Err(Error::BadConfig(format!(
                    "sisci: rank {r} has a different TM table or geometry (options or thresholds differ)"
                )));
                }
                let check = |p: &[u8]| {
                    b.secret().verify(
                        b"mad-sisci segment",
                        pi.name.as_bytes(),
                        &[],
                        tag.as_bytes(),
                        p,
                    )
                };
                let seg = Segment::open(&pi.name, r, n, o.geom, pi.pid, &check)?;
                Ok((pi.name, seg, pi.pid))
            },
        )?;
        // Readiness: this rank's sockets reach every peer's, and the epoll set takes their pidfds.
        let mut ready = hostmem::PeerReadiness::connect(
            endpoint.as_ref(),
            &name,
            &peers,
            |peer_name: &String| peer_name.as_str(),
        );
        // Everyone has mapped everyone: remove the files. Bit 1: this rank has a readiness
        // descriptor; all must, or nobody arms and nobody signals.
        let votes = b.allgather(&ctx.tag("mapped"), &[1 | (ready.ready() as u8) << 1])?;
        own.unlink()?;
        ready.settle(hostmem::vote(&votes, &ctx.local_ranks(), 2));
        let hostmem::PeerReadiness {
            mut sigs,
            readiness,
        } = ready;

        let own = Arc::new(own);
        let mut links: Vec<Option<LinkPair>> = (0..n).map(|_| None).collect();
        let mut watched = Vec::new();
        for (r, p) in peers.into_iter().enumerate() {
            let Some(MappedPeer { seg, watch, .. }) = p else {
                continue;
            };
            let (Some(l), Some(rm)) = (own.area(r), seg.area(me)) else {
                return Err(Error::protocol(r, "sisci: segment lacks an area"));
            };
            let ends = Ends::new(l.clone(), rm, o.geom)
                .ok_or_else(|| Error::protocol(r, "sisci: area too small"))?;
            let shared = Arc::new(RxShared::default());
            let torn = Arc::new(Teardown::new());
            let sig = sigs[r].take();
            watched.push(Watched {
                rank: r,
                local: l.clone(),
                shared: shared.clone(),
                watch: watch.clone(),
                shut: Some(LocalShut::new(
                    torn.clone(),
                    l,
                    ends.remote.clone(),
                    seg.clone(),
                    sig.clone(),
                )),
            });
            links[r] = Some(link::connection(
                SciTx::<Local>::new(
                    r,
                    ends.clone(),
                    LocalTx::new(seg).with_signals(sig.clone()),
                    watch.clone(),
                ),
                SciRx::<Local>::new(
                    r,
                    ends,
                    LocalRx::new(own.clone()).with_signals(sig),
                    watch,
                    shared,
                ),
                torn,
            ));
        }
        let notes = vec![
            format!(
                "sisci:local: {} slots x 64 B, {} B ring, {} x {} B DMA area per peer; {} local peer(s); \
                 segments unlinked after mapping",
                o.geom.slots,
                o.geom.ring,
                o.geom.chunks,
                o.geom.chunk,
                watched.len()
            ),
            if readiness.is_some() {
                "sisci:local: readiness descriptor: epoll over two abstract datagram sockets and the peers' pidfds".into()
            } else {
                "sisci:local: no readiness descriptor (a rank cannot create or reach the abstract sockets)".into()
            },
        ];
        Ok(OpenedChannel::new(
            links,
            Box::new(SciIncoming::<Local>::new(
                LocalOwn::new(own, readiness),
                o.geom,
                watched,
            )),
        )
        .with_notes(notes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Geometry {
        Geometry {
            slots: DEFAULT_SLOTS,
            ring: DEFAULT_RING,
            chunk: DEFAULT_CHUNK,
            chunks: DEFAULT_CHUNKS,
        }
    }

    #[test]
    fn large_jobs_get_smaller_areas_within_the_budget() {
        let d = defaults();
        for n in [1, 2, 8, 14] {
            assert_eq!(fit_geometry(d, n, Given::default()), d, "{n} ranks");
        }
        let g = fit_geometry(d, 64, Given::default());
        assert_eq!(
            (g.chunk, g.chunks, g.slots, g.ring),
            (16 << 10, 4, DEFAULT_SLOTS, DEFAULT_RING)
        );
        for n in [15, 32, 64, 128, 400] {
            let g = fit_geometry(d, n, Given::default());
            assert!(g.valid(), "{n}: {g:?}");
            assert!(g.segment_size(n).unwrap() <= SEGMENT_BUDGET, "{n}: {g:?}");
        }
        // Past 512 ranks the smallest areas (28 KiB) no longer fit: the smallest it is.
        let g = fit_geometry(d, 1000, Given::default());
        assert_eq!((g.chunk, g.ring, g.slots), (4096, 4096, 64));
        // What the user set stays, even past the budget.
        let g = fit_geometry(d, 64, Given::ALL);
        assert_eq!(g, d);
        let g = fit_geometry(Geometry { chunks: 0, ..d }, 400, Given::default());
        assert_eq!(g.chunk, d.chunk, "no DMA: the chunk is not used");
    }
}
