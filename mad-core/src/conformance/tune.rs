//! `tune=auto` on a driver: two thread ranks measure the thresholds at open, agree on them, and
//! the channel then carries pieces on both sides of every threshold. One body for every driver
//! with more than one TM (each driver's `tests/tune.rs` calls it).

use std::time::Duration;

use crate::bootstrap::{Bootstrap, ThreadBootstrap};
use crate::config::{ChannelConfig, TuneCache};
use crate::modes::{RecvMode, SendMode};
use crate::tune::ThresholdSource;
use crate::SessionBuilder;

/// Open `spec` with `tune=auto` (no cache, a calibration budget no loaded machine exhausts: this
/// checks the mechanism, not the machine) between two thread ranks made by `builder`; check that
/// the thresholds were measured, that the calibration left no message counted, that pieces from
/// 1 B to 3 MiB arrive whole, and that both ranks ended with the same table.
///
/// # Panics
///
/// When any of that fails (a test body).
pub fn measures_agrees_and_carries_every_size(
    builder: impl Fn() -> SessionBuilder + Sync,
    spec: &str,
) {
    let sizes = [1usize, 100, 3000, 40_000, 300_000, 3 << 20];
    let spec = format!("{spec},tune=auto,tune_budget_ms=600000");
    let fps: Vec<u64> = std::thread::scope(|sc| {
        let hs: Vec<_> = ThreadBootstrap::group(2)
            .into_iter()
            .map(|b| {
                let (builder, spec) = (&builder, &spec);
                sc.spawn(move || {
                    let s = builder()
                        .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                        .build()
                        .expect("session");
                    let cfg = ChannelConfig::parse("tuned", spec)
                        .expect("spec")
                        .tune_cache(TuneCache::Off)
                        .op_timeout(Duration::from_secs(60));
                    let ch = s.open_channel_with(cfg).expect("open");
                    let t = ch.tuning();
                    assert!(t.complete, "{}", ch.selection_table());
                    let first = &ch.tm_table().tms()[0];
                    assert_eq!(
                        t.source(first.name),
                        Some(ThresholdSource::Measured),
                        "{}",
                        ch.selection_table()
                    );
                    let st = ch.stats();
                    assert_eq!(st.messages_sent + st.messages_received, 0);
                    let peer = 1 - s.rank();
                    for &n in &sizes {
                        let mut buf = vec![(n % 251) as u8; n];
                        if s.rank() == 0 {
                            let mut p = ch.begin_packing(peer).expect("pack");
                            p.pack(&buf, RecvMode::Cheaper).expect("pack");
                            p.end_packing().expect("end");
                        } else {
                            buf.fill(0);
                            let mut u = ch.begin_unpacking_from(peer).expect("unpack");
                            u.unpack(&mut buf, SendMode::Cheaper).expect("unpack");
                            u.end_unpacking().expect("end");
                            assert!(buf.iter().all(|&x| x == (n % 251) as u8), "{n} B");
                        }
                    }
                    ch.tm_table().fingerprint()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    assert_eq!(fps[0], fps[1], "the ranks' tuned tables differ");
}
