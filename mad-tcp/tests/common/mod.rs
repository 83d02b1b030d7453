//! Helpers shared by the mad-tcp integration tests: open channels over real sockets between
//! threads, and drive `Poll`-returning driver calls with a bounded deadline.

#![allow(dead_code)]

use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use mad_core::auth::Secret;
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::driver::{Driver, OpenContext, OpenedChannel, TmTable};
use mad_core::progress::ProgressPolicy;
use mad_core::{ChannelConfig, Result};
use mad_tcp::TcpDriver;

/// Every wait in the tests is bounded by this.
pub const LIMIT: Duration = Duration::from_secs(20);

/// A hook run after an allgather, with every rank's value.
pub type Hook = Box<dyn Fn(&[Vec<u8>]) + Send + Sync>;

/// A bootstrap that can lie about its secret and run a hook after the address exchange.
pub struct Wrapped {
    pub inner: ThreadBootstrap,
    pub secret: Option<Secret>,
    pub after_gather: Option<Hook>,
}

impl Bootstrap for Wrapped {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn secret(&self) -> &Secret {
        self.secret.as_ref().unwrap_or_else(|| self.inner.secret())
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let all = self.inner.allgather(tag, value)?;
        if let Some(h) = &self.after_gather {
            h(&all);
        }
        Ok(all)
    }
    fn kind(&self) -> &'static str {
        "wrapped-threads"
    }
}

/// Open one channel per bootstrap, each on its own thread; results in rank order.
pub fn open_with(
    boots: Vec<Box<dyn Bootstrap>>,
    config: ChannelConfig,
    tables: Vec<TmTable>,
) -> Vec<Result<OpenedChannel>> {
    open_with_policy(boots, config, tables, ProgressPolicy::default())
}

/// [`open_with`] under a given progress policy.
pub fn open_with_policy(
    boots: Vec<Box<dyn Bootstrap>>,
    config: ChannelConfig,
    tables: Vec<TmTable>,
    progress: ProgressPolicy,
) -> Vec<Result<OpenedChannel>> {
    let handles: Vec<_> = boots
        .into_iter()
        .zip(tables)
        .map(|(b, table)| {
            let config = config.clone();
            thread::spawn(move || {
                let ctx = OpenContext::new(&config, &*b, &table, &progress);
                TcpDriver::new().open(&ctx)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("open thread panicked"))
        .collect()
}

/// Open an `n`-rank channel with the default table.
pub fn open_group(n: usize, config: ChannelConfig) -> Vec<OpenedChannel> {
    let boots: Vec<Box<dyn Bootstrap>> = ThreadBootstrap::group(n)
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn Bootstrap>)
        .collect();
    let tables = (0..n)
        .map(|_| mad_tcp::tm_table(mad_tcp::DEFAULT_SMALL_MAX).unwrap())
        .collect();
    open_with(boots, config, tables)
        .into_iter()
        .map(|r| r.expect("open failed"))
        .collect()
}

/// Call `f` until it is ready, at most [`LIMIT`].
pub fn drive<T>(mut f: impl FnMut() -> Result<Poll<T>>) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Poll::Ready(v) = f()? {
            return Ok(v);
        }
        assert!(
            start.elapsed() < LIMIT,
            "driver call did not complete within {LIMIT:?}"
        );
        thread::yield_now();
    }
}
