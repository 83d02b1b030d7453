//! How opening a channel scales with the number of ranks on one host: the time to open it and
//! the shared memory each process creates and maps (issue 16's scale report; `bench/scale.sh`
//! runs it for 2, 8, 32 and 64 ranks over shm and sisci:local).
//!
//! `madrun -n 8 target/release/examples/open_scale -- shm` opens a channel of that spec on
//! every rank after a barrier, then rank 0 prints one CSV line:
//! `spec,ranks,open_ms_max,open_ms_median,created_kib,mapped_kib` where the times are each
//! rank's own (barrier to open returned, then a second barrier) and the sizes are the
//! largest over the ranks: the segment this process created in `/dev/shm`, and every
//! `/dev/shm` mapping it holds (its own and its peers').

use std::time::Instant;

use madeleine::cli::{Arg, Cli, ValueExt};

const CLI: Cli = Cli::new(
    "open_scale",
    env!("CARGO_PKG_VERSION"),
    "usage: madrun -n N open_scale [--] [SPEC]

Opens a channel of SPEC (default shm) on every rank after a barrier; rank 0 prints
`spec,ranks,open_ms_max,open_ms_median,created_kib,mapped_kib`.

  -h, --help     this text
  -V, --version  the version",
);

fn main() {
    let spec = CLI.parse(|p| {
        let mut spec = None;
        while let Some(arg) = p.next()? {
            match arg {
                Arg::Value(v) if spec.is_none() => spec = Some(v.string()?),
                other => CLI.other(other)?,
            }
        }
        Ok(spec.unwrap_or_else(|| "shm".into()))
    });
    if let Err(e) = run(&spec) {
        eprintln!("open_scale: {e}");
        std::process::exit(1);
    }
}

/// (created, mapped) bytes of `/dev/shm` mappings of this process whose file name starts
/// with `mad-`: the segment files are unlinked once every rank mapped them, so `maps` names
/// them `... (deleted)`; this process created the one whose name holds its pid.
fn shm_mappings() -> (u64, u64) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let me = format!("-{}-", std::process::id());
    let (mut created, mut mapped) = (0u64, 0u64);
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(path)) = (f.next(), f.nth(4)) else {
            continue;
        };
        if !path.starts_with("/dev/shm/mad-") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        mapped += b - a;
        if path.contains(&me) {
            created += b - a;
        }
    }
    (created, mapped)
}

fn run(spec: &str) -> madeleine::Result<()> {
    let session = madeleine::session()?;
    let b = session.bootstrap();
    b.barrier("open_scale/start")?;
    let t0 = Instant::now();
    let ch = session.open_channel_with(madeleine::ChannelConfig::parse("scale", spec)?)?;
    let open = t0.elapsed();
    let (created, mapped) = shm_mappings();
    let mine = format!("{} {} {}", open.as_nanos(), created, mapped);
    let all = b.allgather("open_scale/report", mine.as_bytes())?;
    drop(ch);
    if session.rank() == 0 {
        let mut opens = Vec::new();
        let (mut cmax, mut mmax) = (0u64, 0u64);
        for v in &all {
            let s = String::from_utf8_lossy(v);
            let n: Vec<u64> = s.split(' ').filter_map(|x| x.parse().ok()).collect();
            if let [ns, c, m] = n[..] {
                opens.push(ns as f64 / 1e6);
                cmax = cmax.max(c);
                mmax = mmax.max(m);
            }
        }
        opens.sort_by(f64::total_cmp);
        let max = opens.last().copied().unwrap_or(f64::NAN);
        let median = opens.get(opens.len() / 2).copied().unwrap_or(f64::NAN);
        println!(
            "{spec},{},{max:.2},{median:.2},{},{}",
            session.size(),
            cmax / 1024,
            mmax / 1024
        );
    }
    Ok(())
}
