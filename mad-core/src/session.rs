//! Sessions: this process's rank, the session size, the bootstrap, the registered drivers and
//! the channels opened through them.

use std::sync::Arc;

use crate::bootstrap::{Bootstrap, SingleBootstrap};
use crate::channel::{Channel, ChannelInner};
use crate::config::ChannelConfig;
use crate::driver::{Driver, OpenContext};
use crate::error::{Error, Result};
use crate::progress::ProgressPolicy;

/// A set of processes that communicate through channels.
///
/// A program started without a launcher is a one-process session. Under `madrun` the session
/// learns its rank, size, secret and bootstrap address from the environment; other
/// bootstraps (MPI) are passed to [`SessionBuilder::bootstrap`].
///
/// `Send + Sync`; cheap to clone.
#[derive(Clone)]
pub struct Session {
    inner: Arc<SessionInner>,
}

struct SessionInner {
    bootstrap: Box<dyn Bootstrap>,
    drivers: Vec<Arc<dyn Driver>>,
    oversubscribed: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Session(rank {} of {}, bootstrap {}, drivers {:?})",
            self.rank(),
            self.size(),
            self.inner.bootstrap.kind(),
            self.driver_names()
        )
    }
}

/// Builds a [`Session`]: register drivers, optionally choose the bootstrap.
#[derive(Default)]
pub struct SessionBuilder {
    drivers: Vec<Arc<dyn Driver>>,
    bootstrap: Option<Box<dyn Bootstrap>>,
}

impl SessionBuilder {
    /// Register a driver; channels whose configuration names it open through it.
    pub fn driver(mut self, d: impl Driver + 'static) -> Self {
        self.drivers.retain(|x| x.name() != d.name());
        self.drivers.push(Arc::new(d));
        self
    }

    /// Use this bootstrap instead of detecting one from the environment.
    pub fn bootstrap(mut self, b: Box<dyn Bootstrap>) -> Self {
        self.bootstrap = Some(b);
        self
    }

    /// Build the session. Without an explicit bootstrap: the `madrun` one when the
    /// environment has `MAD_BOOTSTRAP`, else a one-process session.
    pub fn build(self) -> Result<Session> {
        let bootstrap = match self.bootstrap {
            Some(b) => b,
            None => detect_bootstrap()?,
        };
        let local = bootstrap.local_ranks().len().max(1);
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        crate::progress::note_host_share(local, cores);
        Ok(Session {
            inner: Arc::new(SessionInner {
                bootstrap,
                drivers: self.drivers,
                oversubscribed: local > cores,
            }),
        })
    }
}

fn detect_bootstrap() -> Result<Box<dyn Bootstrap>> {
    if let Some(b) = crate::launch::MadrunBootstrap::from_env()? {
        return Ok(Box::new(b));
    }
    Ok(Box::new(SingleBootstrap::new()?))
}

impl Session {
    /// Start building a session.
    pub fn builder() -> SessionBuilder {
        SessionBuilder::default()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.bootstrap.rank()
    }

    /// Number of processes in the session.
    pub fn size(&self) -> usize {
        self.inner.bootstrap.size()
    }

    /// The session's bootstrap.
    pub fn bootstrap(&self) -> &dyn Bootstrap {
        &*self.inner.bootstrap
    }

    /// Whether this host runs more session processes than it has cores.
    pub fn oversubscribed(&self) -> bool {
        self.inner.oversubscribed
    }

    /// Names of the registered drivers.
    pub fn driver_names(&self) -> Vec<&'static str> {
        self.inner.drivers.iter().map(|d| d.name()).collect()
    }

    /// Open the channel called `name`, configured by the environment, the `MAD_CONFIG` file or
    /// the built-in default (see [`config`](crate::config)). Collective: every rank opens the
    /// same channels in the same order.
    pub fn open_channel(&self, name: &str) -> Result<Channel> {
        self.open_channel_with(ChannelConfig::lookup(name)?)
    }

    /// Open a channel from an explicit configuration. Collective.
    pub fn open_channel_with(&self, config: ChannelConfig) -> Result<Channel> {
        let inner = &*self.inner;
        let driver = inner
            .drivers
            .iter()
            .find(|d| d.name() == config.driver)
            .ok_or_else(|| {
                let list: Vec<String> = inner
                    .drivers
                    .iter()
                    .map(|d| format!("{} ({})", d.name(), d.describe()))
                    .collect();
                Error::BadConfig(format!(
                    "channel `{}`: unknown driver `{}`; available: {}",
                    config.name,
                    config.driver,
                    if list.is_empty() {
                        "none registered".to_string()
                    } else {
                        list.join(", ")
                    }
                ))
            })?;
        let mut table = driver.tm_table(&config)?;
        for (tm, max) in &config.thresholds {
            table.set_max_len(tm, *max).map_err(|e| {
                Error::BadConfig(format!(
                    "channel `{}`: threshold override: {e}",
                    config.name
                ))
            })?;
        }
        let caps = driver.capabilities(&config);
        let progress = ProgressPolicy {
            mode: config.progress,
            oversubscribed: inner.oversubscribed,
            op_timeout: config.op_timeout,
        };
        let b = &*inner.bootstrap;
        // Every rank must agree on the driver and the switch table, or the switch decisions
        // would differ and data would be misread.
        let mine = format!(
            "{}|{}|{:016x}",
            config.driver,
            config.adapter.as_deref().unwrap_or(""),
            table.fingerprint()
        );
        let all = b.allgather(&format!("chan/{}/core", config.name), mine.as_bytes())?;
        for (r, theirs) in all.iter().enumerate() {
            if theirs.as_slice() != mine.as_bytes() {
                return Err(Error::BadConfig(format!(
                    "channel `{}`: rank {r} opened it as `{}` but rank {} as `{mine}` (driver|adapter|TM table \
                     fingerprint); every rank must use the same configuration",
                    config.name,
                    String::from_utf8_lossy(theirs),
                    b.rank()
                )));
            }
        }
        let ctx = OpenContext {
            config: &config,
            bootstrap: b,
            table: &table,
            progress: &progress,
        };
        let opened = driver.open(&ctx)?;
        if opened.links.len() != b.size() {
            return Err(Error::protocol(
                b.rank(),
                format!(
                    "driver `{}` returned {} links for a session of {}",
                    driver.name(),
                    opened.links.len(),
                    b.size()
                ),
            ));
        }
        let ch = ChannelInner::new(
            config,
            b.rank(),
            b.size(),
            table,
            caps,
            progress,
            opened.links,
            opened.incoming,
            opened.notes,
        );
        let ch = Channel {
            inner: Arc::new(ch),
        };
        if std::env::var("MAD_PROTO_INFO")
            .map(|v| v == "1")
            .unwrap_or(false)
            && b.rank() == 0
        {
            eprint!("{}", ch.selection_table());
        }
        Ok(ch)
    }
}
