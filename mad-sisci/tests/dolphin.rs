//! The `dolphin` backend where no SISCI library or adapter exists (this host): opening a
//! channel fails with `Unavailable`, naming the cause and suggesting `sisci:local`.
//!
//! On a machine with a Dolphin adapter, `MAD_SISCI_DOLPHIN=<libsisci.so path>` makes
//! `kit_over_a_real_sisci_library` run the conformance kit over it (skipped otherwise).

#![cfg(not(miri))]

mod common;

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::driver::Driver;
use mad_core::{ChannelConfig, Error, Session};
use mad_sisci::SisciDriver;

fn session() -> Session {
    let b = ThreadBootstrap::group(1).pop().unwrap();
    Session::builder()
        .driver(SisciDriver::new())
        .bootstrap(Box::new(b))
        .build()
        .unwrap()
}

fn open_err(spec: &str) -> Error {
    let s = session();
    match s.open_channel_with(ChannelConfig::parse("d", spec).unwrap()) {
        Ok(_) => panic!("{spec}: opened without a SISCI library"),
        Err(e) => e,
    }
}

fn unavailable_reason(e: Error) -> String {
    match e {
        Error::Unavailable { driver, reason, .. } => {
            assert_eq!(driver, "sisci:dolphin");
            assert!(reason.contains("sisci:local"), "no suggestion: {reason}");
            reason
        }
        e => panic!("expected Unavailable, got {e:?}"),
    }
}

#[test]
fn no_library_is_unavailable_with_dlopen_text() {
    let r = unavailable_reason(open_err("sisci:dolphin"));
    // The dlopen error text names the library.
    assert!(r.contains("libsisci.so"), "{r}");
    eprintln!("{r}");
}

#[test]
fn library_path_option_is_used() {
    let r = unavailable_reason(open_err("sisci:dolphin,lib=/nonexistent/dir/libsisci.so.7"));
    assert!(r.contains("/nonexistent/dir/libsisci.so.7"), "{r}");
}

#[test]
fn library_without_sisci_symbols_is_unavailable() {
    // libc loads fine but exports none of the SISCI entry points.
    let r = unavailable_reason(open_err("sisci:dolphin,lib=libc.so.6"));
    assert!(r.contains("missing symbol SCIInitialize"), "{r}");
}

#[test]
fn dolphin_table_matches_local_and_bad_backends_are_rejected() {
    let d = SisciDriver::new();
    let local = d
        .tm_table(&ChannelConfig::parse("x", "sisci:local").unwrap())
        .unwrap();
    let dolphin = d
        .tm_table(&ChannelConfig::parse("x", "sisci:dolphin").unwrap())
        .unwrap();
    assert_eq!(local, dolphin, "one protocol, two backends");
    assert!(
        !d.capabilities(&ChannelConfig::parse("x", "sisci:dolphin").unwrap())
            .intra_node_only
    );
    for bad in [
        "sisci:ether",
        "sisci:local,ring=1000",
        "sisci:local,slots=3",
        "sisci:local,chunk=100",
        "sisci:local,dma=maybe",
        "sisci:local,colour=blue",
    ] {
        // As the session does: the accepted adapters and keys first, then the driver's checks.
        let c = ChannelConfig::parse("x", bad).unwrap();
        let e = c
            .check_against(&d.accepted_options(&c))
            .and_then(|_| d.tm_table(&c));
        assert!(matches!(e, Err(Error::BadConfig(_))), "{bad}: {e:?}");
    }
}

/// The kit over a real SISCI library, on thread ranks of this process (all segments on this
/// node, connected through the adapter): run by hand where Dolphin's software and an adapter
/// exist, `MAD_SISCI_DOLPHIN=/opt/DIS/lib64/libsisci.so cargo test -p mad-sisci --test dolphin
/// -- --nocapture`. Never run by the authors (no adapter): the first run is the first test.
#[test]
fn kit_over_a_real_sisci_library() {
    let Ok(lib) = std::env::var("MAD_SISCI_DOLPHIN") else {
        eprintln!("skipped: set MAD_SISCI_DOLPHIN to a libsisci.so to run the kit over it");
        return;
    };
    let adapter = std::env::var("MAD_SISCI_ADAPTER").unwrap_or_else(|_| "0".into());
    let base = format!("sisci:dolphin,lib={lib},adapter_no={adapter}");
    common::kit_threads(2, &base);
    common::kit_threads(2, &format!("{base},slots=2,ring=4096,chunk=4096,chunks=1"));
    common::kit_threads(4, &format!("{base},progress=block"));
    common::kit_threads(2, &format!("{base},dma=off"));
}
