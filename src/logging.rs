//! The one place where the tools and examples install a `tracing` subscriber.
//!
//! The library crates (mad-core and the drivers) only *emit* `tracing` events and spans; an
//! application chooses where they go. The binaries of this package (`madrun`, `mad-info`),
//! `mad-bench` and the examples call [`init_logging`], which prints them on stderr filtered
//! by `MAD_LOG` (or `RUST_LOG` when `MAD_LOG` is not set), in `tracing-subscriber`'s
//! env-filter syntax: `MAD_LOG=mad_core=debug,mad_tcp=info madrun -n 2 ./app`. Without
//! either variable, warnings and errors are printed (`warn`); `MAD_LOG=off` prints nothing.

use tracing_subscriber::EnvFilter;

/// The filter used when neither `MAD_LOG` nor `RUST_LOG` is set.
pub const DEFAULT_FILTER: &str = "warn";

/// Install a subscriber printing `tracing` events to stderr, filtered by `MAD_LOG` (else
/// `RUST_LOG`, else [`DEFAULT_FILTER`]). Returns false (and changes nothing) when a global
/// subscriber is already installed. A filter that does not parse is replaced by
/// [`DEFAULT_FILTER`] and reported as a warning.
pub fn init_logging() -> bool {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let (spec, source) = match (var("MAD_LOG"), var("RUST_LOG")) {
        (Some(v), _) => (Some(v), "MAD_LOG"),
        (None, Some(v)) => (Some(v), "RUST_LOG"),
        (None, None) => (None, ""),
    };
    let mut bad = None;
    let filter = match spec.as_deref().map(EnvFilter::try_new) {
        Some(Ok(f)) => f,
        Some(Err(e)) => {
            bad = Some(e.to_string());
            EnvFilter::new(DEFAULT_FILTER)
        }
        None => EnvFilter::new(DEFAULT_FILTER),
    };
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init()
        .is_ok();
    if let (true, Some(e)) = (installed, bad) {
        tracing::warn!(
            "{source}={}: not a filter ({e}); using `{DEFAULT_FILTER}`",
            spec.unwrap_or_default()
        );
    }
    installed
}
