//! One measurement point: callers start, warm up, then every call that completes inside a fixed
//! window is recorded (its latency); calls/s is the completions in the window over its length.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Completion time (ns after the window's start) and latency (ns) of one call.
pub type Rec = (u64, u64);

/// The window shared by the callers of a point.
#[derive(Debug)]
pub struct Window {
    from: Instant,
    stop: AtomicBool,
    failed: AtomicBool,
    count: AtomicU64,
}

impl Window {
    /// Whether the callers should stop.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Record a call that ran from `t0` to `t1` if it completed inside the window.
    pub fn record(&self, t0: Instant, t1: Instant, out: &mut Vec<Rec>) {
        if t1 >= self.from {
            out.push((
                (t1 - self.from).as_nanos() as u64,
                (t1 - t0).as_nanos() as u64,
            ));
            self.count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A caller failed: the point ends now.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What a point measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Calls completed inside the window.
    pub calls: usize,
    /// Calls per second.
    pub rate: f64,
    /// Median latency (µs).
    pub p50: f64,
    /// 99th percentile latency (µs).
    pub p99: f64,
    /// Slowest call (µs).
    pub max: f64,
    /// The window measured (start, end).
    pub window: Option<(Instant, Instant)>,
    /// Fairness between the callers: the fewest calls one caller completed in the window over
    /// the mean (1 = every caller got its share; 0 = one was starved).
    pub fairness: f64,
}

/// How long a point lasts.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Before the window.
    pub warmup: Duration,
    /// The window (extended, up to ten times, until `min_calls` completed).
    pub window: Duration,
}

/// Nearest-rank percentile of sorted nanoseconds, in µs.
pub fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let k = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[k - 1] as f64 / 1e3
}

/// Run one point: `spawn` starts the callers (each records into its own vector and stops when
/// the window says so) and returns how to join them.
pub fn run_point<J>(
    t: Timing,
    min_calls: u64,
    spawn: impl FnOnce(Arc<Window>) -> J,
) -> Result<Stats, String>
where
    J: FnOnce() -> Result<Vec<Vec<Rec>>, String>,
{
    let w = Arc::new(Window {
        from: Instant::now() + t.warmup,
        stop: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        count: AtomicU64::new(0),
    });
    let join = spawn(w.clone());
    let until = w.from + t.window;
    let latest = w.from + t.window * 10;
    loop {
        let now = Instant::now();
        if w.failed.load(Ordering::Relaxed)
            || now >= latest
            || (now >= until && w.count.load(Ordering::Relaxed) >= min_calls)
        {
            break;
        }
        let next = if now < until {
            until
        } else {
            now + Duration::from_millis(5)
        };
        std::thread::sleep(
            next.saturating_duration_since(now)
                .min(Duration::from_millis(20)),
        );
    }
    let end = Instant::now();
    w.stop.store(true, Ordering::Relaxed);
    let recs = join()?;
    let span = end.saturating_duration_since(w.from);
    let end_ns = span.as_nanos() as u64;
    let callers = recs.len().max(1);
    let mut fewest = usize::MAX;
    let mut lat: Vec<u64> = Vec::new();
    for r in recs {
        let before = lat.len();
        lat.extend(
            r.into_iter()
                .filter(|&(at, _)| at <= end_ns)
                .map(|(_, l)| l),
        );
        fewest = fewest.min(lat.len() - before);
    }
    lat.sort_unstable();
    let mean = lat.len() as f64 / callers as f64;
    Ok(Stats {
        calls: lat.len(),
        rate: lat.len() as f64 / span.as_secs_f64().max(1e-9),
        p50: percentile(&lat, 0.50),
        p99: percentile(&lat, 0.99),
        max: percentile(&lat, 1.0),
        window: Some((w.from, end)),
        fairness: if mean > 0.0 {
            fewest as f64 / mean
        } else {
            0.0
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v[..1], 0.99), 1.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn a_point_counts_the_calls_of_its_window() {
        let t = Timing {
            warmup: Duration::from_millis(10),
            window: Duration::from_millis(50),
        };
        let s = run_point(t, 1, |w| {
            let h = std::thread::spawn(move || {
                let mut rec = Vec::new();
                while !w.stopped() {
                    let t0 = Instant::now();
                    std::thread::sleep(Duration::from_millis(1));
                    w.record(t0, Instant::now(), &mut rec);
                }
                rec
            });
            move || Ok(vec![h.join().map_err(|_| "panicked".to_string())?])
        })
        .expect("a point");
        // Each call sleeps at least 1 ms: at most 1000 calls/s (a busy machine may make fewer).
        assert!(s.calls >= 1 && s.rate <= 1001.0, "{s:?}");
        assert!(s.p50 >= 1000.0 && s.p99 >= s.p50, "{s:?}");
    }
}
