//! `tune=auto`: thresholds measured at open between two ranks, agreed, cached, overridden.

use std::path::{Path, PathBuf};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::config::{Tune, TuneCache};
use mad_core::mem::MemDriver;
use mad_core::tune::{ThresholdSource, LADDER};
use mad_core::{Channel, ChannelConfig, RecvMode, SendMode, Session};

/// Run `body(session, rank)` on two ranks (threads) and return their results.
fn two_ranks<T: Send>(body: impl Fn(&Session) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let body = &body;
        let hs: Vec<_> = ThreadBootstrap::group(2)
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let session = Session::builder()
                        .driver(MemDriver)
                        .bootstrap(Box::new(b))
                        .build()
                        .expect("session");
                    body(&session)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

fn scratch(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mad-tune-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Open `spec` with its cache in `cache` and a calibration budget a loaded machine cannot
/// exhaust (an incomplete calibration is not cached).
fn open(s: &Session, name: &str, spec: &str, cache: &Path) -> Channel {
    let cfg = ChannelConfig::parse(name, &format!("{spec},tune_budget_ms=600000"))
        .expect("spec")
        .tune_cache(TuneCache::Dir(cache.to_path_buf()));
    s.open_channel_with(cfg).expect("open")
}

/// What a test looks at in an opened channel: (source of `copy`, table fingerprint,
/// `copy`'s threshold, stats empty, the selection table).
fn look(ch: &Channel) -> (Option<ThresholdSource>, u64, usize, bool, String) {
    // The channel works after its calibration.
    let peer = 1 - ch.rank();
    let mut buf = vec![7u8; 100_000];
    if ch.rank() == 0 {
        let mut p = ch.begin_packing(peer).unwrap();
        p.pack(&buf, RecvMode::Cheaper).unwrap();
        p.end_packing().unwrap();
    } else {
        buf.fill(0);
        let mut u = ch.begin_unpacking().unwrap();
        u.unpack(&mut buf, SendMode::Cheaper).unwrap();
        u.end_unpacking().unwrap();
        assert!(buf.iter().all(|&b| b == 7));
    }
    let fresh = {
        let st = ch.stats();
        st.messages_sent + st.messages_received == 1
    };
    (
        ch.tuning().source("copy"),
        ch.tm_table().fingerprint(),
        ch.tm_table().tms()[0].max_len,
        fresh,
        ch.selection_table(),
    )
}

fn on_ladder(v: usize) -> bool {
    v == usize::MAX || v <= LADDER[0] / 2 || LADDER.contains(&v)
}

#[test]
fn measured_agreed_cached_then_corrupt_cache_ignored() {
    let dir = scratch("cache");
    // First open: measured; both ranks hold the same table, on the ladder.
    let r = two_ranks(|s| look(&open(s, "a", "mem,tune=auto", &dir)));
    assert_eq!(r[0].1, r[1].1, "ranks disagree on the tuned table");
    for x in &r {
        assert_eq!(x.0, Some(ThresholdSource::Measured), "{}", x.4);
        assert!(on_ladder(x.2), "threshold {} not on the ladder", x.2);
        assert!(x.3, "calibration traffic left in the stats");
    }
    assert!(r[0].4.contains("measured at this open"), "{}", r[0].4);
    assert!(
        r[0].4.contains("calibration, one-way µs (median)"),
        "{}",
        r[0].4
    );
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("cache dir created")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    // Second open: from the cache, same table, no calibration.
    let c = two_ranks(|s| look(&open(s, "b", "mem,tune=auto", &dir)));
    for x in &c {
        assert_eq!(x.0, Some(ThresholdSource::Cached), "{}", x.4);
        assert_eq!(x.1, r[0].1);
    }
    assert!(c[1].4.contains("from the cache"), "{}", c[1].4);
    // tune=refresh measures even so.
    let f = two_ranks(|s| look(&open(s, "c", "mem,tune=refresh", &dir)));
    assert_eq!(f[0].0, Some(ThresholdSource::Measured));
    // A corrupt file: ignored (a warning), measured again, rewritten.
    std::fs::write(&files[0], "madeleine-tune 1\nkey nope\ngarbage\u{0}").unwrap();
    let g = two_ranks(|s| look(&open(s, "d", "mem,tune=auto", &dir)));
    assert_eq!(g[0].0, Some(ThresholdSource::Measured));
    assert_eq!(g[0].1, g[1].1);
    let text = std::fs::read_to_string(&files[0]).unwrap();
    assert!(text.starts_with("madeleine-tune 1\nkey "), "{text}");
    let h = two_ranks(|s| look(&open(s, "e", "mem,tune=auto", &dir)));
    assert_eq!(h[0].0, Some(ThresholdSource::Cached));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn only_rank_0s_cache_counts_and_overrides_win() {
    let (d0, d1) = (scratch("rank0"), scratch("rank1"));
    // Rank 1 has a cache, rank 0 none: rank 0 measures, and both use its result.
    two_ranks(|s| open(s, "warm", "mem,tune=auto", &d1).rank());
    let r = two_ranks(|s| {
        let dir = if s.rank() == 0 { &d0 } else { &d1 };
        look(&open(s, "mixed", "mem,tune=auto", dir))
    });
    assert_eq!(r[0].0, Some(ThresholdSource::Measured));
    assert_eq!(r[1].0, Some(ThresholdSource::Measured));
    assert_eq!(r[0].1, r[1].1);
    // An override wins over the measurement and the cache.
    for _ in 0..2 {
        let o = two_ranks(|s| look(&open(s, "o", "mem,tune=auto,tm.copy=1234", &d0)));
        for x in &o {
            assert_eq!(x.0, Some(ThresholdSource::Override));
            assert_eq!(x.2, 1234);
        }
    }
    // Every threshold overridden: nothing measured.
    let all = two_ranks(|s| {
        let ch = open(s, "all", "mem,tune=auto,tm.copy=1k,tm.gather=max", &d0);
        ch.tuning().note.clone()
    });
    assert!(all[0].as_deref().unwrap_or("").contains("overridden"));
    // Unwritable cache: a warning, the open measures every time.
    let blocked = scratch("file");
    std::fs::write(&blocked, b"not a directory").unwrap();
    for _ in 0..2 {
        let w = two_ranks(|s| look(&open(s, "w", "mem,tune=auto", &blocked.join("sub"))));
        assert_eq!(w[0].0, Some(ThresholdSource::Measured));
    }
    // tune=off: built-in.
    let off = two_ranks(|s| look(&open(s, "off", "mem", &d0)));
    assert_eq!(off[0].0, Some(ThresholdSource::BuiltIn));
    assert!(off[0].4.contains("built-in (tune=off)"), "{}", off[0].4);
    for d in [d0, d1, blocked] {
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_file(&d);
    }
}

#[test]
fn ranks_that_disagree_on_tune_are_refused() {
    let r = two_ranks(|s| {
        let spec = if s.rank() == 0 {
            "mem,tune=auto"
        } else {
            "mem"
        };
        let cfg = ChannelConfig::parse("x", spec)
            .unwrap()
            .tune_cache(TuneCache::Off);
        s.open_channel_with(cfg).err().map(|e| e.to_string())
    });
    assert!(r.iter().all(Option::is_some), "{r:?}");
}

#[test]
fn tune_options_parse_strictly() {
    let c = ChannelConfig::parse("x", "tcp,tune=auto,tune_cache=/tmp/t").unwrap();
    assert_eq!(c.tune, Tune::Auto);
    assert_eq!(c.tune_cache, TuneCache::Dir("/tmp/t".into()));
    assert_eq!(
        ChannelConfig::parse("x", "tcp,tune=refresh,tune_cache=off")
            .unwrap()
            .tune,
        Tune::Refresh
    );
    assert_eq!(ChannelConfig::parse("x", "tcp").unwrap().tune, Tune::Off);
    assert_eq!(
        ChannelConfig::parse("x", "tcp,tune_budget_ms=250")
            .unwrap()
            .tune_budget
            .as_millis(),
        250
    );
    for bad in [
        "tcp,tune=on",
        "tcp,tune=AUTO",
        "tcp,tune_cache=rel/dir",
        "tcp,tune_budget_ms=0",
        "tcp,tune_budget_ms=1h",
    ] {
        let e = ChannelConfig::parse("x", bad).unwrap_err().to_string();
        assert!(e.contains("tune"), "{bad}: {e}");
    }
    // One rank: nothing to measure with; a single-TM table: nothing to tune.
    let s = Session::builder().driver(MemDriver).build().unwrap();
    let ch = s
        .open_channel_with(
            ChannelConfig::parse("one", "mem,tune=auto")
                .unwrap()
                .tune_cache(TuneCache::Off),
        )
        .unwrap();
    assert!(ch.selection_table().contains("no other rank"));
}
