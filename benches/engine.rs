#![allow(missing_docs)] // criterion_group! generates an undocumented function
//! Criterion micro-benchmarks of the engine without a network.
//!
//! * `select`: the switch decision ([`TmTable::select`]) on a three-TM table.
//! * `pack_null/{1,4,16}`: a message of 1, 4 or 16 eight-byte CHEAPER pieces packed to a
//!   *null* driver defined here (it accepts bytes into a reusable buffer and sends nothing):
//!   the engine's own per-message and per-piece cost. Throughput is in pieces.
//! * `unpack_null/1`: the receive side alone: `begin_unpacking_from`, one 8-byte CHEAPER
//!   unpack and `end_unpacking` of a message the null driver always has ready (what
//!   `pack_null/1` writes, lent whole).
//! * `bmm/aggregate16x64`: 16 pieces of 64 B aggregated by the Copy BMM into one buffer;
//!   `bmm/split64k`: one 64 KiB piece split over 4 KiB buffers of a Copy TM;
//!   `bmm/gather_split`: 20 large pieces through a Gather TM of groups of 8 (three groups).
//! * `mem_roundtrip/{1,4,16}`: pack and unpack of 1, 4, 16 small pieces through the in-process
//!   `mem` driver (both ranks driven by one thread): engine + a strict in-memory driver.
//! * `loop_roundtrip/{1,16}`: a message of 1 or 16 eight-byte pieces (the first received
//!   EXPRESS, the rest CHEAPER) packed and unpacked through a *loopback* driver defined here
//!   (one byte queue per direction, no locks taken twice, nothing waits): the engine's
//!   per-message cost on both sides. `ENGINE_LOOP=N cargo bench --bench engine` runs N such
//!   one-piece round trips without criterion and prints ns per message (for
//!   `valgrind --tool=callgrind`, whose instruction counts do not depend on the machine's load);
//!   `ENGINE_LOOP_CALLS=polled` runs them through the event-driven calls, `=async` through the
//!   tokio adapter (`mad-tokio`, a current-thread runtime); `=pack_null` and `=unpack_null`
//!   run N messages of `pack_null/1` or `unpack_null/1` instead (one side alone).
//!
//! `cargo bench --bench engine -- --quick` (a short run); target: under 30 ns of engine
//! overhead per small CHEAPER piece (`pack_null/16` time / 16).

use std::io::IoSlice;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use criterion::{criterion_group, Criterion, Throughput};
use mad_core::wire;
use madeleine::bootstrap::ThreadBootstrap;
use madeleine::config::{Adapters, DriverOptions};
use madeleine::driver::{
    AbortOutcome, Capabilities, Driver, LinkPair, NoIncoming, OpenContext, OpenedChannel, RxLink,
    TmId, TmSpec, TmTable, TxLink,
};
use madeleine::{Channel, ChannelConfig, RecvMode, Result, SendMode, Session};

/// A driver that accepts every byte into a reusable buffer and never sends anything.
#[derive(Clone, Copy)]
struct NullDriver;

struct NullTx {
    buf: Vec<u8>,
    sunk: usize,
}

impl TxLink for NullTx {
    fn with_buffer(
        &mut self,
        _tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        let n = fill(&mut self.buf);
        self.sunk = self.sunk.wrapping_add(n);
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, _tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.sunk = self
            .sunk
            .wrapping_add(iov.iter().map(|s| s.len()).sum::<usize>());
        Ok(Poll::Ready(()))
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        std::hint::black_box(self.sunk);
        Ok(Poll::Ready(()))
    }

    fn abort_message(&mut self) -> AbortOutcome {
        AbortOutcome::Discarded
    }

    fn wait(&mut self, _timeout: Duration) -> Result<()> {
        Ok(())
    }
}

/// The receiving half of the null driver: the next message is always there, a one-piece
/// 8-byte unchecked message (header, piece frame, 8 bytes, end frame: what `pack_null/1`
/// writes), lent whole, with the sequence number the receiver expects next.
struct NullRx {
    msg: [u8; NULL_MSG_LEN],
    at: usize,
    seq: u32,
}

/// Header, piece frame, 8 bytes, end frame.
const NULL_MSG_LEN: usize = wire::HEADER_LEN + wire::FRAME_LEN + 8 + wire::FRAME_LEN;

impl NullRx {
    fn new() -> Self {
        let mut rx = NullRx {
            msg: [0; NULL_MSG_LEN],
            at: 0,
            seq: 0,
        };
        let f = wire::HEADER_LEN;
        rx.msg[f..f + wire::FRAME_LEN]
            .copy_from_slice(&wire::encode_frame(wire::Frame::Piece { tm: 0, len: 8 }));
        rx.msg[f + wire::FRAME_LEN..f + wire::FRAME_LEN + 8].copy_from_slice(&[9; 8]);
        rx.msg[NULL_MSG_LEN - wire::FRAME_LEN..]
            .copy_from_slice(&wire::encode_frame(wire::Frame::End { pieces: 1 }));
        rx.header();
        rx
    }

    fn header(&mut self) {
        self.msg[..wire::HEADER_LEN].copy_from_slice(&wire::encode_header(wire::Header {
            checked: false,
            seq: self.seq,
        }));
    }
}

impl RxLink for NullRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        Ok(Poll::Ready(()))
    }

    fn with_data(
        &mut self,
        _tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.at += take(&self.msg[self.at..]);
        if self.at == NULL_MSG_LEN {
            self.at = 0;
            self.seq = self.seq.wrapping_add(1);
            self.header();
        }
        Ok(Poll::Ready(()))
    }

    fn recv_refs(&mut self, _tm: TmId, _iov: &mut [std::io::IoSliceMut<'_>]) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        Ok(())
    }
}

impl Driver for NullDriver {
    fn name(&self) -> &'static str {
        "null"
    }

    fn describe(&self) -> String {
        "benchmark sink".into()
    }

    fn accepted_options(&self, _config: &ChannelConfig) -> DriverOptions {
        DriverOptions::new(Adapters::None, &["copy_max", "buf"])
    }

    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        let copy_max = config.option_parsed::<usize>("copy_max")?.unwrap_or(4096);
        TmTable::new([
            TmSpec::copy("copy", copy_max, "into a reusable buffer"),
            TmSpec::gather("gather", usize::MAX, 8, "counted"),
        ])
    }

    fn capabilities(&self, _config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let buf = ctx.config.option_parsed::<usize>("buf")?.unwrap_or(4096);
        let (rank, size) = (ctx.bootstrap.rank(), ctx.bootstrap.size());
        Ok(OpenedChannel::new(
            (0..size)
                .map(|p| {
                    (p != rank).then(|| LinkPair {
                        tx: Box::new(NullTx {
                            buf: vec![0; buf],
                            sunk: 0,
                        }) as Box<dyn TxLink>,
                        rx: Box::new(NullRx::new()) as Box<dyn RxLink>,
                    })
                })
                .collect(),
            Box::new(NoIncoming),
        )
        .with_notes(Vec::new()))
    }
}

/// A loopback driver: each direction is one byte queue shared by the sending half of one rank
/// and the receiving half of the other; nothing ever waits (a receive with no bytes is a bug
/// of the benchmark, reported as `Pending`).
#[derive(Clone, Copy)]
struct LoopDriver;

#[derive(Default)]
struct ByteQueue {
    bytes: Vec<u8>,
    head: usize,
}

type Queues = Arc<Vec<Mutex<ByteQueue>>>;

struct LoopTx {
    q: Queues,
    at: usize,
}

impl TxLink for LoopTx {
    fn with_buffer(
        &mut self,
        _tm: TmId,
        want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        let mut q = self.q[self.at].lock().expect("queue");
        let old = q.bytes.len();
        q.bytes.resize(old + want.max(1), 0);
        let n = fill(&mut q.bytes[old..]);
        q.bytes.truncate(old + n);
        Ok(Poll::Ready(()))
    }

    fn send_refs(&mut self, _tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        let mut q = self.q[self.at].lock().expect("queue");
        for s in iov {
            q.bytes.extend_from_slice(s);
        }
        Ok(Poll::Ready(()))
    }

    fn end_message(&mut self) -> Result<Poll<()>> {
        Ok(Poll::Ready(()))
    }

    fn abort_message(&mut self) -> AbortOutcome {
        AbortOutcome::Discarded
    }

    fn wait(&mut self, _timeout: Duration) -> Result<()> {
        Ok(())
    }
}

struct LoopRx {
    q: Queues,
    at: usize,
}

impl LoopRx {
    fn take(&mut self, mut f: impl FnMut(&[u8]) -> usize) -> Result<Poll<()>> {
        let mut q = self.q[self.at].lock().expect("queue");
        if q.head == q.bytes.len() {
            return Ok(Poll::Pending);
        }
        let h = q.head;
        let n = f(&q.bytes[h..]);
        q.head += n;
        if q.head == q.bytes.len() {
            q.head = 0;
            q.bytes.clear();
        }
        Ok(Poll::Ready(()))
    }
}

impl RxLink for LoopRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        let q = self.q[self.at].lock().expect("queue");
        Ok(if q.head < q.bytes.len() {
            Poll::Ready(())
        } else {
            Poll::Pending
        })
    }

    fn with_data(
        &mut self,
        _tm: TmId,
        _want: usize,
        take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        self.take(take)
    }

    fn recv_refs(&mut self, _tm: TmId, iov: &mut [std::io::IoSliceMut<'_>]) -> Result<Poll<()>> {
        for d in iov.iter_mut() {
            let mut off = 0;
            while off < d.len() {
                if self
                    .take(|b| {
                        let n = b.len().min(d.len() - off);
                        d[off..off + n].copy_from_slice(&b[..n]);
                        off += n;
                        n
                    })?
                    .is_pending()
                {
                    return Ok(Poll::Pending);
                }
            }
        }
        Ok(Poll::Ready(()))
    }

    fn wait(&mut self, _timeout: Duration) -> Result<()> {
        Ok(())
    }
}

impl Driver for LoopDriver {
    fn name(&self) -> &'static str {
        "loop"
    }

    fn describe(&self) -> String {
        "benchmark loopback".into()
    }

    fn tm_table(&self, _config: &ChannelConfig) -> Result<TmTable> {
        TmTable::new([
            TmSpec::copy("copy", 4096, "appended to the peer's byte queue"),
            TmSpec::gather("gather", usize::MAX, 8, "appended to the peer's byte queue"),
        ])
    }

    fn capabilities(&self, _config: &ChannelConfig) -> Capabilities {
        Capabilities::default()
    }

    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        // One set of queues per channel name, shared by the two ranks of this process.
        static QUEUES: Mutex<Option<Queues>> = Mutex::new(None);
        let (rank, size) = (ctx.bootstrap.rank(), ctx.bootstrap.size());
        assert_eq!(size, 2, "the loopback driver joins two ranks");
        // Rank 0 makes the queues and publishes them before the barrier; rank 1 takes them after.
        let mine: Option<Queues> = (rank == 0).then(|| {
            let q: Queues = Arc::new((0..2).map(|_| Mutex::default()).collect());
            *QUEUES.lock().expect("queues") = Some(q.clone());
            q
        });
        ctx.bootstrap.barrier(&ctx.tag("queues"))?;
        let q = match mine {
            Some(q) => q,
            None => QUEUES
                .lock()
                .expect("queues")
                .take()
                .expect("rank 0 published the queues"),
        };
        // Queue d carries rank d's messages to the other rank.
        Ok(OpenedChannel::new(
            (0..size)
                .map(|p| {
                    (p != rank).then(|| LinkPair {
                        tx: Box::new(LoopTx {
                            q: q.clone(),
                            at: rank,
                        }) as Box<dyn TxLink>,
                        rx: Box::new(LoopRx {
                            q: q.clone(),
                            at: p,
                        }) as Box<dyn RxLink>,
                    })
                })
                .collect(),
            Box::new(NoIncoming),
        )
        .with_notes(Vec::new()))
    }
}

/// Open the channel `spec` on a two-rank in-process session; returns both ranks' channels.
fn pair(spec: &str) -> (Channel, Channel) {
    let spec = Arc::new(spec.to_string());
    let handles: Vec<_> = ThreadBootstrap::group(2)
        .into_iter()
        .map(|b| {
            let spec = spec.clone();
            std::thread::spawn(move || {
                let s = Session::builder()
                    .driver(NullDriver)
                    .driver(LoopDriver)
                    .driver(madeleine::mem::MemDriver)
                    .bootstrap(Box::new(b))
                    .build()
                    .expect("session");
                s.open_channel_with(ChannelConfig::parse("bench", &spec).expect("spec"))
                    .expect("open")
            })
        })
        .collect();
    let mut chans = handles.into_iter().map(|h| h.join().expect("open thread"));
    let a = chans.next().expect("rank 0");
    let b = chans.next().expect("rank 1");
    (a, b)
}

fn select(c: &mut Criterion) {
    let t = TmTable::new([
        TmSpec::copy("small", 8192, "copy"),
        TmSpec::gather("medium", 1 << 20, 16, "gather"),
        TmSpec::gather("large", usize::MAX, 1, "rendezvous"),
    ])
    .expect("table");
    let lens = [8usize, 4096, 8193, 65536, 2 << 20];
    c.bench_function("select", |bch| {
        let mut i = 0;
        bch.iter(|| {
            i = (i + 1) % lens.len();
            t.select(
                std::hint::black_box(lens[i]),
                SendMode::Cheaper,
                RecvMode::Cheaper,
            )
        })
    });
}

fn pack_null(c: &mut Criterion) {
    let (ch, _peer) = pair("null");
    let data = [7u8; 8 * 16];
    let mut g = c.benchmark_group("pack_null");
    for k in [1usize, 4, 16] {
        g.throughput(Throughput::Elements(k as u64));
        g.bench_function(k.to_string(), |bch| {
            bch.iter(|| {
                let mut p = ch.begin_packing(1).expect("begin");
                for piece in data.chunks(8).take(k) {
                    p.pack(piece, RecvMode::Cheaper).expect("pack");
                }
                p.end_packing().expect("end");
            })
        });
    }
    g.finish();
}

/// One message of one 8-byte CHEAPER piece to the null driver: the send side alone.
#[inline(never)]
fn pack_once(ch: &Channel, data: &[u8]) {
    let mut p = ch.begin_packing(1).expect("begin");
    p.pack(&data[..8], RecvMode::Cheaper).expect("pack");
    p.end_packing().expect("end");
}

/// One message of one 8-byte CHEAPER piece from the null driver (always ready): the receive
/// side alone.
#[inline(never)]
fn unpack_once(ch: &Channel, out: &mut [u8]) {
    let mut u = ch.begin_unpacking_from(1).expect("begin unpack");
    u.unpack(&mut out[..8], SendMode::Cheaper).expect("unpack");
    u.end_unpacking().expect("end unpack");
}

fn unpack_null(c: &mut Criterion) {
    let (ch, _peer) = pair("null");
    let mut out = [0u8; 8];
    let mut g = c.benchmark_group("unpack_null");
    g.throughput(Throughput::Elements(1));
    g.bench_function("1", |bch| bch.iter(|| unpack_once(&ch, &mut out)));
    g.finish();
    assert_eq!(out, [9; 8], "the null driver's piece");
}

fn bmm(c: &mut Criterion) {
    let (ch, _p) = pair("null,copy_max=131072,buf=4096");
    let (gch, _gp) = pair("null,copy_max=64");
    let small = vec![1u8; 64 * 16];
    let big = vec![2u8; 64 << 10];
    let pieces: Vec<Vec<u8>> = (0..20).map(|_| vec![3u8; 16 << 10]).collect();
    let mut g = c.benchmark_group("bmm");
    g.throughput(Throughput::Bytes(small.len() as u64));
    g.bench_function("aggregate16x64", |bch| {
        bch.iter(|| {
            let mut p = ch.begin_packing(1).expect("begin");
            for piece in small.chunks(64) {
                p.pack(piece, RecvMode::Cheaper).expect("pack");
            }
            p.end_packing().expect("end");
        })
    });
    g.throughput(Throughput::Bytes(big.len() as u64));
    g.bench_function("split64k", |bch| {
        bch.iter(|| {
            let mut p = ch.begin_packing(1).expect("begin");
            p.pack(&big, RecvMode::Cheaper).expect("pack");
            p.end_packing().expect("end");
        })
    });
    g.throughput(Throughput::Elements(pieces.len() as u64));
    g.bench_function("gather_split", |bch| {
        bch.iter(|| {
            let mut p = gch.begin_packing(1).expect("begin");
            for piece in &pieces {
                p.pack(piece, RecvMode::Cheaper).expect("pack");
            }
            p.end_packing().expect("end");
        })
    });
    g.finish();
}

fn mem_roundtrip(c: &mut Criterion) {
    let (a, b) = pair("mem");
    let data = [5u8; 8 * 16];
    let mut out = [0u8; 8 * 16];
    let mut g = c.benchmark_group("mem_roundtrip");
    for k in [1usize, 4, 16] {
        g.throughput(Throughput::Elements(k as u64));
        g.bench_function(k.to_string(), |bch| {
            bch.iter(|| {
                let mut p = a.begin_packing(1).expect("begin");
                for piece in data.chunks(8).take(k) {
                    p.pack(piece, RecvMode::Cheaper).expect("pack");
                }
                p.end_packing().expect("end");
                let mut u = b.begin_unpacking_from(0).expect("begin unpack");
                for piece in out.chunks_mut(8).take(k) {
                    u.unpack(piece, SendMode::Cheaper).expect("unpack");
                }
                u.end_unpacking().expect("end unpack");
            })
        });
    }
    g.finish();
}

/// One message of `k` eight-byte pieces from `a` to `b` (the first received EXPRESS).
#[inline(never)]
fn loop_once(a: &Channel, b: &Channel, data: &[u8], out: &mut [u8], k: usize) {
    let mut p = a.begin_packing(1).expect("begin");
    p.pack(&data[..8], RecvMode::Express).expect("pack");
    for piece in data[8..].chunks(8).take(k - 1) {
        p.pack(piece, RecvMode::Cheaper).expect("pack");
    }
    p.end_packing().expect("end");
    let mut u = b.begin_unpacking_from(0).expect("begin unpack");
    let (first, rest) = out.split_at_mut(8);
    u.unpack_express(first, SendMode::Cheaper).expect("unpack");
    for piece in rest.chunks_mut(8).take(k - 1) {
        u.unpack(piece, SendMode::Cheaper).expect("unpack");
    }
    u.end_unpacking().expect("end unpack");
}

fn loop_roundtrip(c: &mut Criterion) {
    let (a, b) = pair("loop");
    let data = [5u8; 8 * 16];
    let mut out = [0u8; 8 * 16];
    let mut g = c.benchmark_group("loop_roundtrip");
    for k in [1usize, 16] {
        g.throughput(Throughput::Elements(k as u64));
        g.bench_function(k.to_string(), |bch| {
            bch.iter(|| loop_once(&a, &b, &data, &mut out, k))
        });
    }
    g.finish();
}

/// [`loop_once`] through the event-driven calls: deferred packer and unpacker, the end and
/// the EXPRESS piece polled (each ready at the first poll here): the cost of recording the
/// steps and running the plans against the blocking engine's direct calls.
#[inline(never)]
fn polled_once(a: &Channel, b: &Channel, data: &[u8], out: &mut [u8], k: usize) {
    let mut p = a.try_begin_packing(1).expect("begin").expect("free");
    p.defer();
    p.pack(&data[..8], RecvMode::Express).expect("pack");
    for piece in data[8..].chunks(8).take(k - 1) {
        p.pack(piece, RecvMode::Cheaper).expect("pack");
    }
    while p.poll_end_packing().is_pending() {}
    drop(p);
    let mut u = b
        .try_begin_unpacking_from(0)
        .expect("begin")
        .expect("a message");
    u.defer();
    let (first, rest) = out.split_at_mut(8);
    while u.poll_unpack_express(first, SendMode::Cheaper).is_pending() {}
    for piece in rest.chunks_mut(8).take(k - 1) {
        u.unpack(piece, SendMode::Cheaper).expect("unpack");
    }
    while u.poll_end_unpacking().is_pending() {}
}

fn polled_roundtrip(c: &mut Criterion) {
    let (a, b) = pair("loop");
    let data = [5u8; 8 * 16];
    let mut out = [0u8; 8 * 16];
    let mut g = c.benchmark_group("polled_roundtrip");
    for k in [1usize, 16] {
        g.throughput(Throughput::Elements(k as u64));
        g.bench_function(k.to_string(), |bch| {
            bch.iter(|| polled_once(&a, &b, &data, &mut out, k))
        });
    }
    g.finish();
}

/// `n` one-piece messages from `a` to `b` through the tokio adapter, in one entry of a
/// current-thread runtime (each future ready at its first poll here): the adapter's own cost.
fn async_loop(a: Channel, b: Channel, n: u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (a, b) = (
            mad_tokio::AsyncChannel::new(a).expect("adapter"),
            mad_tokio::AsyncChannel::new(b).expect("adapter"),
        );
        let data = [5u8; 8];
        let mut out = [0u8; 8];
        for _ in 0..n {
            let mut p = a.begin_packing(1).await.expect("begin");
            p.pack(&data, RecvMode::Express).expect("pack");
            p.end_packing().await.expect("end");
            let mut u = b.begin_unpacking_from(0).await.expect("begin unpack");
            u.unpack_express(&mut out, SendMode::Cheaper)
                .await
                .expect("unpack");
            u.end_unpacking().await.expect("end unpack");
        }
    });
}

criterion_group!(
    benches,
    select,
    pack_null,
    unpack_null,
    bmm,
    mem_roundtrip,
    loop_roundtrip,
    polled_roundtrip
);

fn main() {
    if let Some(n) = std::env::var("ENGINE_LOOP")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        // A fixed number of one-piece round trips, for callgrind (no criterion, no sampling).
        let how = std::env::var("ENGINE_LOOP_CALLS").unwrap_or_else(|_| "blocking".into());
        if let Some(side) = how.strip_suffix("_null") {
            // One side alone, against the null driver (`pack_null/1`, `unpack_null/1`).
            let (ch, _peer) = pair("null");
            let data = [5u8; 8];
            let mut out = [0u8; 8];
            let t = std::time::Instant::now();
            match side {
                "pack" => (0..n).for_each(|_| pack_once(&ch, &data)),
                "unpack" => (0..n).for_each(|_| unpack_once(&ch, &mut out)),
                other => {
                    panic!("ENGINE_LOOP_CALLS={other}_null: expected pack_null or unpack_null")
                }
            }
            let ns = t.elapsed().as_nanos() as f64 / n as f64;
            println!("engine loop ({how}): {n} one-piece messages, {ns:.1} ns per message");
            return;
        }
        let (a, b) = pair("loop");
        let data = [5u8; 8 * 16];
        let mut out = [0u8; 8 * 16];
        let t = std::time::Instant::now();
        match how.as_str() {
            "blocking" => (0..n).for_each(|_| loop_once(&a, &b, &data, &mut out, 1)),
            "polled" => (0..n).for_each(|_| polled_once(&a, &b, &data, &mut out, 1)),
            "async" => async_loop(a, b, n),
            other => panic!(
                "ENGINE_LOOP_CALLS={other}: expected blocking, polled, async, pack_null or \
                 unpack_null"
            ),
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!(
            "engine loop ({how} calls): {n} one-piece messages, {ns:.1} ns per message \
             (send + receive)"
        );
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
