#![allow(missing_docs)] // criterion_group! generates an undocumented function
//! Criterion micro-benchmarks of the engine without a network.
//!
//! * `select`: the switch decision ([`TmTable::select`]) on a three-TM table.
//! * `pack_null/{1,4,16}`: a message of 1, 4 or 16 eight-byte CHEAPER pieces packed to a
//!   *null* driver defined here (it accepts bytes into a reusable buffer and sends nothing):
//!   the engine's own per-message and per-piece cost. Throughput is in pieces.
//! * `bmm/aggregate16x64`: 16 pieces of 64 B aggregated by the Copy BMM into one buffer;
//!   `bmm/split64k`: one 64 KiB piece split over 4 KiB buffers of a Copy TM;
//!   `bmm/gather_split`: 20 large pieces through a Gather TM of groups of 8 (three groups).
//! * `mem_roundtrip/{1,4,16}`: pack and unpack of 1, 4, 16 small pieces through the in-process
//!   `mem` driver (both ranks driven by one thread): engine + a strict in-memory driver.
//!
//! `cargo bench --bench engine -- --quick` (a short run); target: under 30 ns of engine
//! overhead per small CHEAPER piece (`pack_null/16` time / 16).

use std::io::IoSlice;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use madeleine::bootstrap::ThreadBootstrap;
use madeleine::driver::{
    AbortOutcome, Capabilities, Driver, Incoming, LinkPair, OpenContext, OpenedChannel, RxLink,
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

struct NullRx;

impl RxLink for NullRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }

    fn with_data(
        &mut self,
        _tm: TmId,
        _want: usize,
        _take: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }

    fn recv_refs(&mut self, _tm: TmId, _iov: &mut [std::io::IoSliceMut<'_>]) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        Ok(())
    }
}

struct NullIncoming;

impl Incoming for NullIncoming {
    fn poll(&self, _ready: &mut dyn FnMut(usize)) -> Result<()> {
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        Ok(())
    }

    fn wake(&self) {}
}

impl Driver for NullDriver {
    fn name(&self) -> &'static str {
        "null"
    }

    fn describe(&self) -> String {
        "benchmark sink".into()
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
        Ok(OpenedChannel {
            links: (0..size)
                .map(|p| {
                    (p != rank).then(|| LinkPair {
                        tx: Box::new(NullTx {
                            buf: vec![0; buf],
                            sunk: 0,
                        }) as Box<dyn TxLink>,
                        rx: Box::new(NullRx) as Box<dyn RxLink>,
                    })
                })
                .collect(),
            incoming: Box::new(NullIncoming),
            notes: Vec::new(),
        })
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

criterion_group!(benches, select, pack_null, bmm, mem_roundtrip);
criterion_main!(benches);
