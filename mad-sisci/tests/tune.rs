//! `tune=auto` on this driver: two ranks measure the thresholds at open, agree on them, and
//! the channel carries pieces on both sides of every threshold.

use std::time::Duration;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::config::TuneCache;
use mad_core::tune::ThresholdSource;
use mad_core::{ChannelConfig, RecvMode, SendMode, Session};

#[test]
fn tune_auto_measures_agrees_and_carries_every_size() {
    let sizes = [1usize, 100, 3000, 40_000, 300_000, 3 << 20];
    let hs: Vec<_> = ThreadBootstrap::group(2)
        .into_iter()
        .map(|b| {
            std::thread::spawn(move || {
                let s = Session::builder()
                    .driver(mad_sisci::SisciDriver::new())
                    .bootstrap(Box::new(b))
                    .build()
                    .expect("session");
                // A budget a loaded machine cannot exhaust: the test checks the mechanism.
                let cfg =
                    ChannelConfig::parse("tuned", "sisci:local,tune=auto,tune_budget_ms=600000")
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
    let fps: Vec<u64> = hs.into_iter().map(|h| h.join().expect("rank")).collect();
    assert_eq!(fps[0], fps[1], "the ranks' tuned tables differ");
}
