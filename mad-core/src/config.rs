//! Channel configuration: by name, in code, from the environment, or from a small file.
//!
//! A channel spec is `driver[:adapter][,key=value]...`, for example `tcp`,
//! `tcp:127.0.0.1,progress=poll`, `shm`, `via:soft`, `sisci:local,checked=true`,
//! `tcp,tm.small=2048` (threshold override of the TM named `small`).
//!
//! Lookup order for `Session::open_channel(name)`:
//! 1. the environment variable `MAD_CHANNEL_<NAME>` (name upper-cased, `-` and `.` as `_`);
//! 2. the file named by `MAD_CONFIG`, lines `name = spec` (`#` starts a comment);
//! 3. the built-in `default` channel, which is `tcp` (loopback).
//!
//! `MAD_CHECKED=1` turns checked mode on for every channel, including channels configured in
//! code (`MAD_CHECKED=0` only sets the default of channels opened by name);
//! `MAD_PROGRESS=poll|block|adaptive` and `MAD_TIMEOUT_MS=<ms>` set the progress policy and
//! operation timeout of every channel opened by name whose spec does not say otherwise.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::progress::{ProgressMode, ProgressPolicy};

/// The configuration of one channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelConfig {
    /// The channel's name (what `open_channel` was called with).
    pub name: String,
    /// The driver (`tcp`, `shm`, `mpi`, `via`, `sisci`).
    pub driver: String,
    /// The adapter or backend (`127.0.0.1`, `soft`, `local`, ...); driver-defined.
    pub adapter: Option<String>,
    /// Checked mode: every piece carries a descriptor and mismatches are reported.
    pub checked: bool,
    /// Progress mode (the session fills `oversubscribed`).
    pub progress: ProgressMode,
    /// Operation timeout (dead or black-holed peers).
    pub op_timeout: Option<Duration>,
    /// TM threshold overrides: TM name → new `max_len`.
    pub thresholds: BTreeMap<String, usize>,
    /// Other driver-specific options.
    pub options: BTreeMap<String, String>,
}

impl ChannelConfig {
    /// A channel named `name` over `driver`, with defaults for everything else.
    pub fn new(name: impl Into<String>, driver: impl Into<String>) -> Self {
        ChannelConfig {
            name: name.into(),
            driver: driver.into(),
            adapter: None,
            checked: false,
            progress: ProgressPolicy::default().mode,
            op_timeout: None,
            thresholds: BTreeMap::new(),
            options: BTreeMap::new(),
        }
    }

    /// Set the adapter.
    pub fn adapter(mut self, adapter: impl Into<String>) -> Self {
        self.adapter = Some(adapter.into());
        self
    }

    /// Turn checked mode on or off.
    pub fn checked(mut self, on: bool) -> Self {
        self.checked = on;
        self
    }

    /// Set the progress mode.
    pub fn progress(mut self, mode: ProgressMode) -> Self {
        self.progress = mode;
        self
    }

    /// Set the operation timeout.
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = Some(t);
        self
    }

    /// Override the `max_len` threshold of the TM named `tm`.
    pub fn threshold(mut self, tm: impl Into<String>, max_len: usize) -> Self {
        self.thresholds.insert(tm.into(), max_len);
        self
    }

    /// Set a driver-specific option.
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// A driver-specific option parsed as `T`, with a clear error if it does not parse.
    pub fn option_parsed<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>> {
        match self.options.get(key) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                Error::BadConfig(format!(
                    "channel `{}`: option {key}={v} is not valid",
                    self.name
                ))
            }),
        }
    }

    /// Parse a spec (`driver[:adapter][,key=value]...`) for the channel `name`.
    pub fn parse(name: &str, spec: &str) -> Result<Self> {
        let spec = spec.trim();
        let mut parts = spec.split(',');
        let head = parts.next().unwrap_or("").trim();
        if head.is_empty() {
            return Err(Error::BadConfig(format!(
                "channel `{name}`: empty spec (expected driver[:adapter])"
            )));
        }
        let (driver, adapter) = match head.split_once(':') {
            Some((d, a)) => (
                d.trim(),
                Some(a.trim().to_string()).filter(|a| !a.is_empty()),
            ),
            None => (head, None),
        };
        if !driver
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(Error::BadConfig(format!(
                "channel `{name}`: bad driver name `{driver}`"
            )));
        }
        let mut c = ChannelConfig::new(name, driver);
        c.adapter = adapter;
        for kv in parts {
            let kv = kv.trim();
            if kv.is_empty() {
                continue;
            }
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                Error::BadConfig(format!("channel `{name}`: `{kv}` is not key=value"))
            })?;
            c.set(k.trim(), v.trim())?;
        }
        Ok(c)
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let bad =
            |what: &str| Error::BadConfig(format!("channel `{}`: {k}={v}: {what}", self.name));
        match k {
            "checked" => self.checked = parse_bool(v).ok_or_else(|| bad("expected true/false"))?,
            "progress" => self.progress = ProgressPolicy::parse_mode(v)?,
            "timeout_ms" => {
                let ms: u64 = v.parse().map_err(|_| bad("expected milliseconds"))?;
                self.op_timeout = if ms == 0 {
                    None
                } else {
                    Some(Duration::from_millis(ms))
                };
            }
            _ => {
                if let Some(tm) = k.strip_prefix("tm.") {
                    let n = parse_size(v)
                        .ok_or_else(|| bad("expected a size (e.g. 4096, 64k, 1m, max)"))?;
                    self.thresholds.insert(tm.to_string(), n);
                } else {
                    self.options.insert(k.to_string(), v.to_string());
                }
            }
        }
        Ok(())
    }

    /// Apply the session-wide environment defaults (`MAD_CHECKED`, `MAD_PROGRESS`,
    /// `MAD_TIMEOUT_MS`) where the spec did not set them.
    pub(crate) fn apply_env_defaults(&mut self, spec_keys: &[&str]) -> Result<()> {
        if !spec_keys.contains(&"checked") {
            if let Ok(v) = std::env::var("MAD_CHECKED") {
                self.checked = parse_bool(&v).ok_or_else(|| {
                    Error::BadConfig(format!("MAD_CHECKED={v}: expected 0/1/true/false"))
                })?;
            }
        }
        if !spec_keys.contains(&"progress") {
            if let Ok(v) = std::env::var("MAD_PROGRESS") {
                self.progress = ProgressPolicy::parse_mode(&v)?;
            }
        }
        if !spec_keys.contains(&"timeout_ms") {
            if let Ok(v) = std::env::var("MAD_TIMEOUT_MS") {
                let ms: u64 = v.parse().map_err(|_| {
                    Error::BadConfig(format!("MAD_TIMEOUT_MS={v}: expected milliseconds"))
                })?;
                self.op_timeout = if ms == 0 {
                    None
                } else {
                    Some(Duration::from_millis(ms))
                };
            }
        }
        Ok(())
    }

    /// Resolve a channel by name from the environment, the `MAD_CONFIG` file and the built-in
    /// default, as described in the module documentation.
    pub fn lookup(name: &str) -> Result<Self> {
        let (spec, origin) = Self::lookup_spec(name)?.ok_or_else(|| {
            Error::BadConfig(format!(
                "unknown channel `{name}`: define it with {}=driver[:adapter] or a line `{name} = driver[:adapter]` in the MAD_CONFIG file",
                env_key(name)
            ))
        })?;
        let mut c = Self::parse(name, &spec)
            .map_err(|e| Error::BadConfig(format!("{e} (from {origin})")))?;
        let keys: Vec<&str> = spec
            .split(',')
            .skip(1)
            .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim()))
            .collect();
        c.apply_env_defaults(&keys)?;
        Ok(c)
    }

    fn lookup_spec(name: &str) -> Result<Option<(String, String)>> {
        let key = env_key(name);
        if let Ok(v) = std::env::var(&key) {
            return Ok(Some((v, key)));
        }
        if let Ok(path) = std::env::var("MAD_CONFIG") {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::BadConfig(format!("MAD_CONFIG={path}: cannot read: {e}")))?;
            for (i, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or("").trim();
                if line.is_empty() {
                    continue;
                }
                let (n, spec) = line.split_once('=').ok_or_else(|| {
                    Error::BadConfig(format!(
                        "{path}:{}: expected `name = driver[:adapter][,k=v]`",
                        i + 1
                    ))
                })?;
                if n.trim() == name {
                    return Ok(Some((spec.trim().to_string(), format!("{path}:{}", i + 1))));
                }
            }
        }
        if name == "default" {
            return Ok(Some(("tcp".to_string(), "built-in default".to_string())));
        }
        Ok(None)
    }
}

/// True when `MAD_CHECKED` asks for checked mode (an error if it is not a boolean).
pub(crate) fn env_forces_checked() -> Result<bool> {
    match std::env::var("MAD_CHECKED") {
        Err(_) => Ok(false),
        Ok(v) => parse_bool(&v)
            .ok_or_else(|| Error::BadConfig(format!("MAD_CHECKED={v}: expected 0/1/true/false"))),
    }
}

/// The environment variable that configures channel `name`.
pub fn env_key(name: &str) -> String {
    let n: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("MAD_CHANNEL_{n}")
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Parse `4096`, `64k`, `1m`, `max`.
pub fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim().to_ascii_lowercase();
    if v == "max" || v == "inf" {
        return Some(usize::MAX);
    }
    let (num, mult) = match v.chars().last()? {
        'k' => (&v[..v.len() - 1], 1usize << 10),
        'm' => (&v[..v.len() - 1], 1 << 20),
        'g' => (&v[..v.len() - 1], 1 << 30),
        _ => (&v[..], 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_specs() {
        let c = ChannelConfig::parse(
            "x",
            "tcp:127.0.0.1,progress=poll,checked=1,tm.small=2k,foo=bar",
        )
        .unwrap();
        assert_eq!(c.driver, "tcp");
        assert_eq!(c.adapter.as_deref(), Some("127.0.0.1"));
        assert_eq!(c.progress, ProgressMode::Poll);
        assert!(c.checked);
        assert_eq!(c.thresholds["small"], 2048);
        assert_eq!(c.options["foo"], "bar");
        assert_eq!(
            ChannelConfig::parse("x", "via:soft")
                .unwrap()
                .adapter
                .as_deref(),
            Some("soft")
        );
        assert!(ChannelConfig::parse("x", "").is_err());
        assert!(ChannelConfig::parse("x", "tcp,oops").is_err());
        assert!(ChannelConfig::parse("x", "tcp,checked=maybe").is_err());
        assert!(ChannelConfig::parse("x", "tcp,tm.small=lots").is_err());
        assert!(ChannelConfig::parse("x", "t c p").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("max"), Some(usize::MAX));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("99999999999999999999g"), None);
    }

    #[test]
    fn env_keys() {
        assert_eq!(env_key("video-1"), "MAD_CHANNEL_VIDEO_1");
    }
}
