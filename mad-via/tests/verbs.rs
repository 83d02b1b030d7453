//! The `via:verbs` backend on a host without RDMA (or a build without the `verbs` feature):
//! opening a channel fails with `Unavailable`, naming the cause and suggesting `via:soft`.

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::config::ChannelConfig;
use mad_core::driver::{Driver, OpenContext};
use mad_core::progress::ProgressPolicy;
use mad_core::{Error, Session};
use mad_via::ViaDriver;

fn check(e: &Error) {
    match e {
        Error::Unavailable { driver, reason, .. } => {
            assert_eq!(driver, "via:verbs");
            assert!(reason.contains("via:soft"), "{reason}");
            let named = if cfg!(feature = "verbs") {
                reason.contains("no RDMA device") && reason.contains("errno")
            } else {
                reason.contains("`verbs` cargo feature")
            };
            assert!(named, "the reason names the cause: {reason}");
        }
        other => panic!("expected Unavailable, got {other}"),
    }
}

#[test]
fn probe_reports_unavailable() {
    eprintln!("{}", mad_via::verbs::probe().unwrap_err());
    check(&mad_via::verbs::probe().unwrap_err());
}

#[test]
fn driver_open_reports_unavailable() {
    let d = ViaDriver::new();
    let config = ChannelConfig::parse("v", "via:verbs").unwrap();
    let table = d.tm_table(&config).unwrap();
    let b = ThreadBootstrap::group(1).pop().unwrap();
    let progress = ProgressPolicy::default();
    let ctx = OpenContext::new(&config, &b, &table, &progress);
    match d.open(&ctx) {
        Err(e) => check(&e),
        Ok(_) => panic!("via:verbs opened on a host without RDMA"),
    }
}

#[test]
fn session_open_reports_unavailable_and_soft_still_works() {
    let session = Session::builder()
        .driver(ViaDriver::new())
        .bootstrap(Box::new(ThreadBootstrap::group(1).pop().unwrap()))
        .build()
        .unwrap();
    let e = session
        .open_channel_with(ChannelConfig::parse("v", "via:verbs").unwrap())
        .unwrap_err();
    check(&e);
    let bad = session
        .open_channel_with(ChannelConfig::parse("w", "via:myrinet").unwrap())
        .unwrap_err();
    assert!(matches!(bad, Error::BadConfig(_)), "{bad}");
    session
        .open_channel_with(ChannelConfig::parse("s", "via:soft").unwrap())
        .unwrap();
}
