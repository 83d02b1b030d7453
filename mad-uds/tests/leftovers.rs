//! No socket file or directory is left behind once channels are open. In a test binary of its
//! own: the check looks at this process's temporary directories, which parallel tests opening
//! channels in the same process would otherwise create and remove under its feet.

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::{ChannelConfig, Result, Session};
use mad_uds::UdsDriver;

fn build(b: Box<dyn Bootstrap>) -> Result<Session> {
    Session::builder()
        .driver(UdsDriver::new())
        .bootstrap(b)
        .build()
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
fn no_socket_files_left() {
    let before = leftovers();
    open_each(&["uds", "uds", "uds"])
        .into_iter()
        .for_each(|r| r.unwrap());
    assert_eq!(leftovers(), before);
}

fn leftovers() -> Vec<String> {
    let me = format!("mad-uds-{}-", std::process::id());
    let mut v: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&me))
        .collect();
    v.sort();
    v
}
