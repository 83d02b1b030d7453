//! `mad-bench`: Madeleine's cross-process benchmark suite (OSU-style latency, bandwidth,
//! bidirectional bandwidth, multi-threaded latency, message rate, RPC) with raw baselines
//! measured in the same run. See `BENCHMARKS.md` and `mad-bench --help`.

#![deny(unsafe_code)]

#[path = "../bench/mod.rs"]
mod bench;

fn main() {
    madeleine::init_logging();
    bench::main();
}
