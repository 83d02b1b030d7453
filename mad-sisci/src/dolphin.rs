//! The `dolphin` backend: the same protocol ([`link`](crate::link)) over Dolphin's SISCI
//! library. **Untested against hardware** (see `NOTES.md`): it builds everywhere (the library
//! is loaded at run time), its no-library paths and its pure parts are tested, and the whole
//! open / data path / close sequence runs against a stand-in library in the tests, but it has
//! never met a real `libsisci.so` or adapter.
//!
//! # Open (collective)
//!
//! 1. Load the library and initialize it ([`Sisci`]), `SCIOpen`, `SCIGetLocalNodeId(adapter)`.
//! 2. Create this rank's incoming segment: `SCICreateSegment` with the id [`segment_id`]
//!    (channel name and rank; on `SCI_ERR_SEGMENTID_USED` the next of [`ID_ATTEMPTS`]
//!    candidates), `SCIPrepareSegment`, `SCIMapLocalSegment`; zero it, write the header
//!    (geometry and the proof of the session secret, as on `local`), then
//!    `SCISetSegmentAvailable`. Layout: the `local` layout (header, one area per rank) followed
//!    by one staging chunk per peer, the source of the DMA transfers ([`segment_size`]).
//! 3. Publish a [`Record`] (node id, segment id, adapter number, size, TM/geometry
//!    fingerprint) through the bootstrap allgather.
//! 4. For every peer: check its record, `SCIConnectSegment` (bounded by
//!    [`CONNECT_TIMEOUT_MS`]), `SCIMapRemoteSegment`, `SCICreateMapSequence`, and verify its
//!    header through the mapping (the only remote reads of the backend). Then a second
//!    allgather: everyone is connected before anyone sends.
//! 5. One `SCICreateDMAQueue` per sending half (none if the library lacks the DMA calls or the
//!    queue cannot be created: the `dma` TM then copies by PIO).
//!
//! # Data path ([`Dolphin`], the [`Fabric`])
//!
//! * Every publication into the peer's area (slot and chunk flags, the ring offset,
//!   acknowledgements, close flags) is `SCIStoreBarrier`, the store, `SCIStoreBarrier`: the
//!   first orders the data (PIO stores through a write-combining mapping) before the flag,
//!   the second pushes the flag out instead of leaving it in a write-combining buffer.
//! * Short slots and the ring are written by PIO (stores into the remote mapping) exactly as
//!   on `local`.
//! * A `dma` chunk is copied into this rank's staging chunk for that peer (local memory), then
//!   sent by `SCIStartDmaTransfer` + `SCIWaitForDMAQueue` (its 64-byte-aligned part, if at
//!   least [`DMA_MIN`] bytes), the rest by PIO from the staging copy; then the flag. A DMA
//!   error that is not about the peer (unsupported, alignment, ...) switches that connection
//!   to PIO for good; a peer-class error fails the link.
//! * Wake-ups: none. Interrupts (`SCITriggerInterrupt`) are not used: a waiting thread checks
//!   its condition and sleeps at most [`NAP`], then the core polls again. A blocked receiver
//!   therefore sees new data up to `NAP` late, and costs about 1/`NAP` wake-ups per second.
//! * Peer death: [`RemoteSegment::gone`] (`SCIWaitForRemoteSegmentEvent` with timeout 0:
//!   `SCI_CB_DISCONNECT` / `SCI_CB_LOST`, or a peer-class error) is the probe of the peer's
//!   [`PeerWatch`], checked at the same bounded rate as the pidfd on `local`, and the SISCI
//!   poll itself runs at most every 10 ms per peer
//!   ([`EVENT_POLL_EVERY`](crate::sys::EVENT_POLL_EVERY)). Bound: `PeerClosed` within one
//!   wait slice (50 ms) plus 10 ms after SISCI reports the event; how fast SISCI reports a
//!   dead process or node is the driver's business (untested). Orderly close is the
//!   protocol's `W_CLOSED` / `R_CLOSED`.
//!
//! # Close
//!
//! Dropping the channel releases in reverse order through the `Arc` chain: the halves publish
//! their close flags, then each [`RemoteSegment`] (sequence, unmap, disconnect), the DMA
//! queues, the [`LocalSegment`] (unavailable, unmap, remove), the descriptor (`SCIClose`)
//! and, with the last user in the process, `SCITerminate` and `dlclose`. The local segment
//! is removed only after every connection of this process to its peers is closed (each
//! [`RemoteSegment`] holds it); removal while peers are still connected (they close later)
//! answers `SCI_ERR_BUSY` and is finished by a background thread (see [`crate::sys`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mad_core::driver::{LinkPair, OpenContext, OpenedChannel};
use mad_core::hostmem::{fnv1a, PeerWatch, Region, WAIT_SLICE};
use mad_core::{Error, Result};

use crate::fabric::{Fabric, OwnWire, RxWire, TxWire};
use crate::layout::Geometry;
use crate::link::{Ends, RxShared, SciIncoming, SciRx, SciTx, Watched};
use crate::segment;
use crate::sys::{
    Desc, DmaQueue, DmaWait, LoadError, LocalSegment, RemoteSegment, SciClass, SciError, Sisci,
};
use crate::Options;

/// Longest sleep of a waiting thread before it looks again (no remote wake-ups on Dolphin).
pub const NAP: Duration = Duration::from_micros(200);
/// How long `SCIConnectSegment` may take per peer (its segment is available before the
/// allgather that announces it, so this only bounds a broken fabric).
pub const CONNECT_TIMEOUT_MS: u32 = 10_000;
/// Smallest block sent by DMA; smaller ones (and tails) are PIO copies.
pub const DMA_MIN: usize = 4096;
/// DMA transfers are whole multiples of this (a conservative alignment for offsets and
/// sizes; chunk offsets are page-aligned).
pub const DMA_ALIGN: usize = 64;
/// Segment id candidates tried per rank before giving up.
pub const ID_ATTEMPTS: u32 = 64;
/// Ranks a channel can have (the rank is the low 16 bits of the segment id).
pub const MAX_RANKS: usize = 1 << 16;

/// The SISCI segment id of `rank`'s incoming segment of channel `channel`, candidate number
/// `attempt`: the rank in the low 16 bits, a hash of the channel name plus `attempt` times an
/// odd constant in the high 16 bits. Segment ids are per node, so within a session two ranks
/// never collide (distinct low halves), and the candidates of one rank are all distinct;
/// another job on the same node may hold an id, which `SCI_ERR_SEGMENTID_USED` reports and the
/// next candidate avoids. The id actually used is published, so peers never recompute it.
/// `None` if `rank` or `attempt` is out of range.
pub fn segment_id(channel: &str, rank: usize, attempt: u32) -> Option<u32> {
    if rank >= MAX_RANKS || attempt >= ID_ATTEMPTS {
        return None;
    }
    let h = fnv1a(channel.as_bytes());
    let folded = (h ^ (h >> 32)) as u32;
    let high = (folded ^ (folded >> 16)).wrapping_add(attempt.wrapping_mul(0x9E37)) & 0xFFFF;
    Some(high << 16 | rank as u32)
}

/// Bytes of the staging chunk per peer (0 without the `dma` TM).
pub fn staging_len(geom: &Geometry) -> usize {
    if geom.chunks > 0 {
        geom.chunk
    } else {
        0
    }
}

/// Bytes of a Dolphin segment for `n` ranks: the `local` layout, then `n` staging chunks.
pub fn segment_size(geom: &Geometry, n: usize) -> Option<usize> {
    geom.segment_size(n)?
        .checked_add(staging_len(geom).checked_mul(n)?)
}

/// Offset of the staging chunk used to send to rank `r`.
pub fn staging_off(geom: &Geometry, n: usize, r: usize) -> Option<usize> {
    geom.segment_size(n)?
        .checked_add(staging_len(geom).checked_mul(r)?)
}

/// The part of a `len`-byte block sent by DMA (the rest goes by PIO).
pub fn dma_part(len: usize) -> usize {
    if len >= DMA_MIN {
        len & !(DMA_ALIGN - 1)
    } else {
        0
    }
}

/// Magic opening a [`Record`].
pub const RECORD_MAGIC: [u8; 4] = *b"MSD1";
/// Encoded length of a [`Record`].
pub const RECORD_LEN: usize = 32;

/// What each rank publishes through the bootstrap allgather.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// SISCI node id of the rank's adapter.
    pub node: u32,
    /// Id of its incoming segment.
    pub segment: u32,
    /// Its local adapter number (diagnostics: peers connect through their own).
    pub adapter: u32,
    /// Segment size in bytes.
    pub size: u64,
    /// TM table and geometry fingerprint.
    pub fingerprint: u64,
}

/// Why a [`Record`] did not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordError {
    /// Not [`RECORD_LEN`] bytes.
    Length(usize),
    /// Does not start with [`RECORD_MAGIC`].
    Magic,
}

impl std::fmt::Display for RecordError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordError::Length(l) => write!(f, "{l} bytes, expected {RECORD_LEN}"),
            RecordError::Magic => f.write_str("bad magic (not a sisci:dolphin announcement)"),
        }
    }
}

impl Record {
    /// Little-endian: magic, node, segment, adapter (u32 each), size, fingerprint (u64).
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..4].copy_from_slice(&RECORD_MAGIC);
        b[4..8].copy_from_slice(&self.node.to_le_bytes());
        b[8..12].copy_from_slice(&self.segment.to_le_bytes());
        b[12..16].copy_from_slice(&self.adapter.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.fingerprint.to_le_bytes());
        b
    }

    /// Decode bytes a peer published. Total: any input gives a record or an error.
    ///
    /// # Errors
    ///
    /// A [`RecordError`] saying what is wrong with the bytes.
    pub fn decode(b: &[u8]) -> std::result::Result<Record, RecordError> {
        let b: &[u8; RECORD_LEN] = b.try_into().map_err(|_| RecordError::Length(b.len()))?;
        if b[0..4] != RECORD_MAGIC {
            return Err(RecordError::Magic);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Ok(Record {
            node: u32_at(4),
            segment: u32_at(8),
            adapter: u32_at(12),
            size: u64_at(16),
            fingerprint: u64_at(24),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The fabric.
// ---------------------------------------------------------------------------------------------

/// The `dolphin` backend's [`Fabric`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Dolphin;

impl Fabric for Dolphin {
    type Tx = DolphinTx;
    type Rx = DolphinRx;
    type Own = Nap;
}

/// Check, then sleep at most [`NAP`].
#[inline]
fn nap(t: Duration, ready: impl FnOnce() -> bool) {
    if !ready() {
        std::thread::sleep(t.min(NAP));
    }
}

/// `SCIStoreBarrier`, Release store, `SCIStoreBarrier`.
#[inline]
fn publish(peer: &RemoteSegment, store: impl FnOnce()) {
    peer.barrier();
    store();
    peer.barrier();
}

/// Sending half on `dolphin`.
pub struct DolphinTx {
    peer: Arc<RemoteSegment>,
    own: Arc<LocalSegment>,
    dma: Option<DmaQueue>,
    staging: Region,
    stage_off: usize,
    area_off: usize,
}

impl std::fmt::Debug for DolphinTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DolphinTx")
            .field("peer", &self.peer)
            .field("own", &self.own)
            .field("dma", &self.dma.is_some())
            .finish_non_exhaustive()
    }
}

enum DmaOutcome {
    Done,
    PeerGone,
    Failed(SciError),
}

/// One DMA transfer of `len` bytes from `src_off` of `own` to `dst_off` of `peer`, waited for
/// in slices, watching the peer between them.
fn transfer(
    dq: &mut DmaQueue,
    own: &LocalSegment,
    src_off: usize,
    peer: &RemoteSegment,
    dst_off: usize,
    len: usize,
) -> DmaOutcome {
    if let Err(e) = dq.start(own, src_off, peer, dst_off, len) {
        return DmaOutcome::Failed(e);
    }
    loop {
        match dq.wait(WAIT_SLICE) {
            Ok(DmaWait::Done) => return DmaOutcome::Done,
            Ok(DmaWait::Pending) => {
                if peer.gone() {
                    return DmaOutcome::PeerGone;
                }
            }
            Err(e) => return DmaOutcome::Failed(e),
        }
    }
}

impl DolphinTx {
    /// PIO copy of `[from, to)` of the staging chunk to `base + from` of `remote`.
    fn pio_from_staging(&self, remote: &Region, base: usize, from: usize, to: usize) -> Option<()> {
        if to <= from {
            return Some(());
        }
        let mut ok = false;
        self.staging.lend(from, to - from, &mut |s: &[u8]| {
            ok = base
                .checked_add(from)
                .and_then(|at| remote.write(at, s))
                .is_some();
            s.len()
        })?;
        ok.then_some(())
    }
}

impl TxWire for DolphinTx {
    #[inline]
    fn publish(&self, word: &AtomicU64, v: u64) {
        publish(&self.peer, || word.store(v, Ordering::Release));
    }

    #[inline]
    fn publish32(&self, word: &AtomicU32, v: u32) {
        publish(&self.peer, || word.store(v, Ordering::Release));
    }

    #[inline]
    fn wake_reader(&self) {}

    fn block_write(&mut self, remote: &Region, base: usize, at: usize, src: &[u8]) -> Option<()> {
        if self.dma.is_some() {
            self.staging.write(at, src)
        } else {
            remote.write(base.checked_add(at)?, src)
        }
    }

    fn finish_block(
        &mut self,
        peer: usize,
        remote: &Region,
        base: usize,
        len: usize,
    ) -> Result<()> {
        let Some(dq) = self.dma.as_mut() else {
            return Ok(());
        };
        let oob = || Error::protocol(peer, "sisci:dolphin: block outside the area");
        let mut sent = dma_part(len);
        if sent > 0 {
            let remote_off = self.area_off.checked_add(base).ok_or_else(oob)?;
            match transfer(dq, &self.own, self.stage_off, &self.peer, remote_off, sent) {
                DmaOutcome::Done => {}
                DmaOutcome::PeerGone => return Err(Error::PeerClosed { rank: peer }),
                DmaOutcome::Failed(e)
                    if matches!(e.class(), SciClass::Peer | SciClass::Timeout) =>
                {
                    return Err(e.to_error(Some(peer)));
                }
                DmaOutcome::Failed(e) => {
                    // Not about the peer (unsupported mode, alignment...): PIO from now on.
                    tracing::warn!(
                        peer,
                        error = %e,
                        "DMA transfer failed: falling back to PIO on this connection"
                    );
                    self.dma = None;
                    sent = 0;
                }
            }
        }
        self.pio_from_staging(remote, base, sent, len)
            .ok_or_else(oob)
    }

    #[inline]
    fn sleep(&self, _local: &Region, t: Duration, ready: impl FnOnce() -> bool) {
        nap(t, ready);
    }
}

/// Receiving half on `dolphin`.
#[derive(Debug)]
pub struct DolphinRx {
    peer: Arc<RemoteSegment>,
}

impl RxWire for DolphinRx {
    #[inline]
    fn publish(&self, word: &AtomicU64, v: u64) {
        publish(&self.peer, || word.store(v, Ordering::Release));
    }

    #[inline]
    fn publish32(&self, word: &AtomicU32, v: u32) {
        publish(&self.peer, || word.store(v, Ordering::Release));
    }

    #[inline]
    fn wake_writer(&self, _remote: &Region) {}

    #[inline]
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool) {
        nap(t, ready);
    }
}

/// The any-source watcher's wire on `dolphin`: naps, nothing to wake.
#[derive(Debug, Clone, Copy, Default)]
pub struct Nap;

impl OwnWire for Nap {
    #[inline]
    fn sleep(&self, t: Duration, ready: impl FnOnce() -> bool) {
        nap(t, ready);
    }

    fn wake(&self) {}
}

// ---------------------------------------------------------------------------------------------
// Open.
// ---------------------------------------------------------------------------------------------

impl std::error::Error for LoadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LoadError::Init(e) => Some(e),
            _ => None,
        }
    }
}

fn load_error(o: &Options, e: LoadError) -> Error {
    let reason = match &e {
        LoadError::Load(t) => {
            format!("cannot load the SISCI library ({t}); use sisci:local on one host")
        }
        e => format!("{}: {e}; use sisci:local on one host", o.lib),
    };
    Error::unavailable_because("sisci:dolphin", reason, mad_core::error::Cause::new(e))
}

/// `e.to_error(peer)`, with the library named in an `Unavailable` reason.
fn sci_error(o: &Options, e: SciError, peer: Option<usize>) -> Error {
    match e.to_error(peer) {
        Error::Unavailable {
            driver,
            reason,
            source,
        } => Error::Unavailable {
            driver,
            reason: format!("{}: {reason}", o.lib),
            source,
        },
        other => other,
    }
}

/// The name the segment proof is bound to.
fn proof_name(node: u32, segment: u32) -> String {
    format!("sisci-dolphin:{node}:{segment:08x}")
}

/// Create this rank's segment, probing ids on `SCI_ERR_SEGMENTID_USED`.
fn create_own(
    o: &Options,
    desc: &Arc<Desc>,
    channel: &str,
    me: usize,
    size: usize,
) -> Result<LocalSegment> {
    for attempt in 0..ID_ATTEMPTS {
        let id = segment_id(channel, me, attempt).ok_or_else(|| {
            Error::BadConfig(format!(
                "sisci:dolphin: at most {MAX_RANKS} ranks per channel"
            ))
        })?;
        match LocalSegment::create(desc, id, size, o.adapter_no) {
            Ok(s) => return Ok(s),
            Err(e) if e.is_id_used() => continue,
            Err(e) => return Err(sci_error(o, e, None)),
        }
    }
    Err(Error::Resource(format!(
        "sisci:dolphin: {ID_ATTEMPTS} segment ids for channel `{channel}` rank {me} are all in \
         use on this node"
    )))
}

/// Open a `sisci:dolphin` channel (collective; see the module documentation).
///
/// # Errors
///
/// [`Error::Unavailable`] when the SISCI library or the adapter
/// cannot be used (with the library's error as source);
/// [`Error::BadConfig`] for options the backend refuses; the library's
/// errors while connecting, converted by [`SciError::to_error`](crate::sys::SciError::to_error);
/// the bootstrap's errors.
pub fn open(ctx: &OpenContext<'_>, o: &Options) -> Result<OpenedChannel> {
    let b = ctx.bootstrap;
    let (me, n) = (b.rank(), b.size());
    let g = o.geom;
    if n > MAX_RANKS {
        return Err(Error::BadConfig(format!(
            "sisci:dolphin: at most {MAX_RANKS} ranks per channel"
        )));
    }
    let overflow = || Error::BadConfig(format!("sisci: {n} areas of {g:?} overflow"));
    let size = segment_size(&g, n).ok_or_else(overflow)?;
    let area = g.area_size().ok_or_else(overflow)?;

    let sisci = Sisci::get(&o.lib).map_err(|e| {
        tracing::warn!(library = %o.lib, error = %e, "cannot use the SISCI library");
        load_error(o, e)
    })?;
    let (family, has_dma_calls) = (sisci.family(), sisci.has_dma());
    tracing::debug!(library = %o.lib, family, has_dma_calls, "SISCI library loaded");
    if !has_dma_calls {
        tracing::info!(library = %o.lib, "the SISCI library has no DMA calls: PIO only");
    }
    let desc = Desc::open(sisci).map_err(|e| sci_error(o, e, None))?;
    let node = desc
        .local_node_id(o.adapter_no)
        .map_err(|e| sci_error(o, e, None))?;

    let own = Arc::new(create_own(o, &desc, &ctx.config.name, me, size)?);
    let own_region = own.region();
    let zeros = vec![0u8; 64 * 1024];
    let mut at = 0;
    while at < size {
        let k = zeros.len().min(size - at);
        own_region.write(at, &zeros[..k]).ok_or_else(|| {
            Error::Resource("sisci:dolphin: mapping shorter than the segment".into())
        })?;
        at += k;
    }
    let tag = ctx.tag("sci-segs");
    let secret = b.secret();
    let proof = secret.proof(
        b"mad-sisci segment",
        proof_name(node, own.id()).as_bytes(),
        &[],
        tag.as_bytes(),
    );
    segment::write_header(&own_region, n, &g, 0, &proof)?;
    own.set_available().map_err(|e| sci_error(o, e, None))?;

    let fingerprint = ctx.table.fingerprint() ^ fnv1a(format!("{g:?}").as_bytes());
    let rec = Record {
        node,
        segment: own.id(),
        adapter: o.adapter_no,
        size: size as u64,
        fingerprint,
    };
    let all = b.allgather(&tag, &rec.encode())?;
    if all.len() != n {
        return Err(Error::protocol(
            me,
            "sisci:dolphin: allgather returned the wrong number of entries",
        ));
    }
    let mut peers: Vec<Option<(Arc<RemoteSegment>, Region)>> = (0..n).map(|_| None).collect();
    for (r, bytes) in all.iter().enumerate() {
        if r == me {
            continue;
        }
        let pr = Record::decode(bytes)
            .map_err(|e| Error::protocol(r, format!("sisci:dolphin: segment announcement: {e}")))?;
        if pr.fingerprint != fingerprint {
            return Err(Error::BadConfig(format!(
                "sisci: rank {r} has a different TM table or geometry (options or thresholds differ)"
            )));
        }
        if pr.size != size as u64 {
            return Err(Error::protocol(
                r,
                format!("sisci:dolphin: segment of {} B, expected {size} B", pr.size),
            ));
        }
        let rs = RemoteSegment::connect(
            &desc,
            &own,
            pr.node,
            pr.segment,
            o.adapter_no,
            size,
            CONNECT_TIMEOUT_MS,
        )
        .map_err(|e| sci_error(o, e, Some(r)))?;
        let rs = Arc::new(rs);
        let region = rs.region();
        let name = proof_name(pr.node, pr.segment);
        segment::check_header(&region, r, n, &g, 0, &|p| {
            secret.verify(
                b"mad-sisci segment",
                name.as_bytes(),
                &[],
                tag.as_bytes(),
                p,
            )
        })?;
        peers[r] = Some((rs, region));
    }
    // Everyone is connected to everyone before anything is sent.
    b.allgather(&ctx.tag("sci-mapped"), &[1])?;

    let area_off = |r: usize| g.area_off(r).ok_or_else(overflow);
    let mut links: Vec<Option<LinkPair>> = (0..n).map(|_| None).collect();
    let mut watched = Vec::new();
    let mut dma_note: Option<String> =
        (!has_dma_calls && g.chunks > 0).then(|| "the library has no DMA calls".to_string());
    let mut with_dma = 0;
    for (r, p) in peers.into_iter().enumerate() {
        let Some((rs, region)) = p else { continue };
        let (Some(l), Some(rm)) = (
            own_region.sub(area_off(r)?, area),
            region.sub(area_off(me)?, area),
        ) else {
            return Err(Error::protocol(r, "sisci:dolphin: segment lacks an area"));
        };
        let ends = Ends::new(l.clone(), rm, g)
            .ok_or_else(|| Error::protocol(r, "sisci:dolphin: area too small"))?;
        let stage_off = staging_off(&g, n, r).ok_or_else(overflow)?;
        let staging = own_region
            .sub(stage_off, staging_len(&g))
            .ok_or_else(overflow)?;
        let dma = if g.chunks > 0 {
            match DmaQueue::create(&desc, o.adapter_no) {
                Ok(q) => q,
                Err(e) => {
                    tracing::info!(
                        channel = %ctx.config.name,
                        peer = r,
                        error = %e,
                        "no DMA queue: `dma` chunks to this peer are copied by PIO"
                    );
                    dma_note = Some(e.to_string());
                    None
                }
            }
        } else {
            None
        };
        with_dma += usize::from(dma.is_some());
        let probe = rs.clone();
        let watch = Arc::new(PeerWatch::custom(move || probe.gone()));
        let shared = Arc::new(RxShared::default());
        watched.push(Watched {
            rank: r,
            local: l,
            shared: shared.clone(),
            watch: watch.clone(),
            shut: None,
        });
        let tx = DolphinTx {
            peer: rs.clone(),
            own: own.clone(),
            dma,
            staging,
            stage_off,
            area_off: area_off(me)?,
        };
        links[r] = Some(crate::link::connection(
            SciTx::<Dolphin>::new(r, ends.clone(), tx, watch.clone()),
            SciRx::<Dolphin>::new(r, ends, DolphinRx { peer: rs }, watch, shared),
            Arc::default(),
        ));
    }
    let bulk = match (g.chunks, &dma_note) {
        (0, _) => "no dma TM".to_string(),
        (_, None) => format!("dma chunks by SCIStartDmaTransfer ({with_dma} queue(s))"),
        (_, Some(why)) => {
            format!("dma chunks by DMA on {with_dma} connection(s), PIO on the others ({why})")
        }
    };
    let notes = vec![format!(
        "sisci:dolphin (UNTESTED backend: never run against Dolphin hardware): {} (symbols \
         {family}*), node {node}, adapter {}, segment 0x{:08x} of {size} B; {} slots x 64 B, \
         {} B ring, {} x {} B per peer; {bulk}; waits nap {} us (no interrupts); {} peer(s)",
        o.lib,
        o.adapter_no,
        own.id(),
        g.slots,
        g.ring,
        g.chunks,
        g.chunk,
        NAP.as_micros(),
        watched.len()
    )];
    Ok(OpenedChannel::new(
        links,
        Box::new(SciIncoming::<Dolphin>::new(Nap, g, watched)),
    )
    .with_notes(notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_ids_are_distinct_per_rank_and_per_attempt() {
        for ch in [
            "",
            "data",
            "ctrl",
            "a-much-longer-channel-name/with/slashes",
        ] {
            let mut seen = std::collections::HashSet::new();
            for rank in [0usize, 1, 2, 7, 255, 256, 65535] {
                for attempt in 0..ID_ATTEMPTS {
                    let id = segment_id(ch, rank, attempt).unwrap();
                    assert_eq!(id & 0xFFFF, rank as u32, "rank in the low half");
                    assert!(
                        seen.insert(id),
                        "{ch} rank {rank} attempt {attempt}: {id:x} reused"
                    );
                }
            }
            assert_eq!(segment_id(ch, 65536, 0), None);
            assert_eq!(segment_id(ch, usize::MAX, 0), None);
            assert_eq!(segment_id(ch, 0, ID_ATTEMPTS), None);
            // Deterministic: every rank computes the same ids (not that it needs to: they
            // are published).
            assert_eq!(segment_id(ch, 3, 5), segment_id(ch, 3, 5));
        }
        assert_ne!(segment_id("data", 0, 0), segment_id("ctrl", 0, 0));
    }

    fn rec() -> Record {
        Record {
            node: 4,
            segment: 0xABCD_0001,
            adapter: 0,
            size: 5 << 20,
            fingerprint: 0x0123_4567_89AB_CDEF,
        }
    }

    #[test]
    fn records_round_trip() {
        let r = rec();
        assert_eq!(Record::decode(&r.encode()), Ok(r));
        let extreme = Record {
            node: u32::MAX,
            segment: u32::MAX,
            adapter: u32::MAX,
            size: u64::MAX,
            fingerprint: u64::MAX,
        };
        assert_eq!(Record::decode(&extreme.encode()), Ok(extreme));
    }

    #[test]
    fn record_decoding_is_total_over_prefixes_extensions_and_corruptions() {
        let good = rec().encode();
        // Every strict prefix and every extension is a length error.
        for k in 0..RECORD_LEN {
            assert_eq!(Record::decode(&good[..k]), Err(RecordError::Length(k)));
        }
        let mut long = good.to_vec();
        long.push(0);
        assert_eq!(
            Record::decode(&long),
            Err(RecordError::Length(RECORD_LEN + 1))
        );
        // Every single-bit corruption: in the magic an error, elsewhere a different record
        // (the checks after decoding -- fingerprint, size, the header proof -- catch those).
        for i in 0..RECORD_LEN {
            for bit in 0..8 {
                let mut b = good;
                b[i] ^= 1 << bit;
                match Record::decode(&b) {
                    Err(RecordError::Magic) => assert!(i < 4),
                    Ok(r) => {
                        assert!(i >= 4);
                        assert_ne!(r, rec());
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        // Random inputs of random lengths: never a panic; only well-formed ones decode.
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..50_000 {
            let len = (next() % 48) as usize;
            let mut v: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if len >= 4 && next() % 2 == 0 {
                v[..4].copy_from_slice(&RECORD_MAGIC);
            }
            match Record::decode(&v) {
                Ok(r) => {
                    assert_eq!(len, RECORD_LEN);
                    assert_eq!(&v[..4], &RECORD_MAGIC);
                    assert_eq!(r.encode().to_vec(), v, "decode is injective");
                }
                Err(RecordError::Length(l)) => assert_eq!(l, len),
                Err(RecordError::Magic) => assert_ne!(&v[..4], &RECORD_MAGIC),
            }
        }
    }

    #[test]
    fn layout_and_dma_split() {
        let g = Geometry {
            slots: 64,
            ring: 65536,
            chunk: 262144,
            chunks: 4,
        };
        let n = 4;
        let base = g.segment_size(n).unwrap();
        assert_eq!(segment_size(&g, n), Some(base + 4 * 262144));
        assert_eq!(staging_off(&g, n, 0), Some(base));
        assert_eq!(staging_off(&g, n, 3), Some(base + 3 * 262144));
        let no_dma = Geometry { chunks: 0, ..g };
        assert_eq!(segment_size(&no_dma, n), no_dma.segment_size(n));
        assert_eq!(segment_size(&g, usize::MAX), None);
        assert_eq!(dma_part(0), 0);
        assert_eq!(dma_part(DMA_MIN - 1), 0);
        assert_eq!(dma_part(DMA_MIN), DMA_MIN);
        assert_eq!(dma_part(1_000_003), 1_000_003 & !63);
        assert_eq!(dma_part(262144), 262144);
    }
}
