//! The mad-core conformance kit over uds: 2 and 3 ranks (threads of this process, real Unix
//! sockets), with the default adaptive progress and with `progress=block`, plus setup errors.

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::conformance::{run_threads, KitOptions};
use mad_core::{ChannelConfig, Error, ErrorKind, Result, Session};
use mad_uds::UdsDriver;

fn build(b: Box<dyn Bootstrap>) -> Result<Session> {
    Session::builder()
        .driver(UdsDriver::new())
        .bootstrap(b)
        .build()
}

#[test]
fn kit_2_ranks() {
    let ran = run_threads(2, KitOptions::new("uds"), build).unwrap();
    assert_eq!(ran.len(), mad_core::conformance::case_names().len());
}

#[test]
fn kit_3_ranks() {
    run_threads(3, KitOptions::new("uds"), build).unwrap();
}

#[test]
fn kit_3_ranks_block_small_buffers() {
    // 64-byte copy buffers: every copy piece is split; blocking progress through poll(2).
    run_threads(3, KitOptions::new("uds,progress=block,buf=64"), build).unwrap();
}

#[test]
fn kit_2_ranks_poll_low_threshold() {
    // Every piece above 16 bytes goes through the gather TM.
    run_threads(2, KitOptions::new("uds,progress=poll,tm.copy=16"), build).unwrap();
}

/// Every rank opens `spec` (one per rank); returns each rank's outcome.
fn open_each(specs: &[&str]) -> Vec<Result<()>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(specs.len())
            .into_iter()
            .zip(specs)
            .map(|(b, spec)| {
                s.spawn(move || -> Result<()> {
                    let session = build(Box::new(b))?;
                    session.open_channel_with(ChannelConfig::parse("c", spec)?)?;
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn different_thresholds_are_refused() {
    let r = open_each(&["uds", "uds,tm.copy=100"]);
    assert!(
        // The rank that finds the mismatch refuses with BadConfig; the others learn it from
        // the open's vote, with the kind carried.
        r.iter()
            .all(|r| matches!(r, Err(e) if e.kind() == ErrorKind::Config
            || e.remote_kind() == Some(ErrorKind::Config))),
        "{r:?}"
    );
}

#[test]
fn bad_options_are_config_errors() {
    for spec in ["uds:eth0", "uds,buf=1", "uds,buf=lots"] {
        let r = open_each(&[spec]);
        assert!(
            matches!(r[0], Err(Error::BadConfig(_))),
            "{spec}: {:?}",
            r[0]
        );
    }
}

#[test]
fn kit_6_ranks_through_incoming() {
    // Five peers, more than `direct_poll_limit`: any-source reception goes through the
    // `poll(2)` watcher and its wake-up pipe.
    let mut o = KitOptions::new("uds");
    o.cases = Some(vec![
        "any_source".into(),
        "threads".into(),
        "in_flight".into(),
        "peer_closes".into(),
    ]);
    o.volume = 40;
    let ran = run_threads(6, o, build).unwrap();
    assert_eq!(ran.len(), 4, "{ran:?}");
}
