//! Two clusters that share no network, joined by a gateway (issue: virtual channels): three
//! network namespaces, A and B each joined to G by a veth pair and not to each other. Rank 0
//! lives in A, rank 1 (the gateway) in G with a leg in each, rank 2 in B. Ranks are threads of
//! this process, each moved into its namespace (`setns` is per thread) with the in-memory
//! thread bootstrap, so only the channel's own traffic crosses the namespaces.
//!
//! The virtual channel `virtual:[tcp:vA,ranks=0-1]+[tcp:vB,ranks=1-2]`: rank 0 reaches rank 2
//! only through rank 1. Checked: messages both ways (a 4 MiB piece pipelined through the
//! gateway), then the gateway leaves and the calls of ranks 0 and 2 towards each other fail
//! within a bounded time instead of waiting.
//!
//! Needs root and `ip netns`; skips (passes with a message) otherwise.

#![cfg(feature = "tcp")]

use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use mad_core::bootstrap::ThreadBootstrap;
use mad_core::vchan::Route;
use madeleine::{ChannelConfig, RecvMode, SendMode};

struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A, G, B and the two veth pairs; `None` when this machine cannot make them.
fn clusters() -> Option<Namespaces> {
    let id = std::process::id();
    let (a, g, b) = (
        format!("mvc-a-{id}"),
        format!("mvc-g-{id}"),
        format!("mvc-b-{id}"),
    );
    let ns = Namespaces(vec![a.clone(), g.clone(), b.clone()]);
    for n in &ns.0 {
        if !ip(&["netns", "add", n]) {
            return None;
        }
        ip(&["-n", n, "link", "set", "lo", "up"]);
    }
    let (pa, pga, pgb, pb) = (
        format!("va{id}"),
        format!("vga{id}"),
        format!("vgb{id}"),
        format!("vb{id}"),
    );
    let ok = ip(&["link", "add", &pa, "type", "veth", "peer", "name", &pga])
        && ip(&["link", "add", &pgb, "type", "veth", "peer", "name", &pb])
        && ip(&["link", "set", &pa, "netns", &a])
        && ip(&["link", "set", &pga, "netns", &g])
        && ip(&["link", "set", &pgb, "netns", &g])
        && ip(&["link", "set", &pb, "netns", &b])
        && ip(&["-n", &a, "link", "set", &pa, "name", "vA"])
        && ip(&["-n", &g, "link", "set", &pga, "name", "vA"])
        && ip(&["-n", &g, "link", "set", &pgb, "name", "vB"])
        && ip(&["-n", &b, "link", "set", &pb, "name", "vB"])
        && ip(&["-n", &a, "addr", "add", "10.81.1.1/24", "dev", "vA"])
        && ip(&["-n", &g, "addr", "add", "10.81.1.2/24", "dev", "vA"])
        && ip(&["-n", &g, "addr", "add", "10.81.2.1/24", "dev", "vB"])
        && ip(&["-n", &b, "addr", "add", "10.81.2.2/24", "dev", "vB"])
        && ip(&["-n", &a, "link", "set", "vA", "up"])
        && ip(&["-n", &g, "link", "set", "vA", "up"])
        && ip(&["-n", &g, "link", "set", "vB", "up"])
        && ip(&["-n", &b, "link", "set", "vB", "up"]);
    ok.then_some(ns)
}

/// Move this thread into namespace `name`.
fn enter(name: &str) {
    let f = std::fs::File::open(format!("/var/run/netns/{name}")).expect("namespace file");
    // SAFETY: setns on a valid namespace descriptor; it changes this thread's network
    // namespace only (sockets made afterwards belong to it).
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns({name}): {}", std::io::Error::last_os_error());
}

#[test]
fn two_clusters_through_a_gateway() {
    // SAFETY: geteuid has no preconditions.
    let is_root = unsafe { libc::geteuid() } == 0;
    if !is_root {
        eprintln!("virtual_netns: SKIPPED: not root");
        return;
    }
    let Some(ns) = clusters() else {
        eprintln!("virtual_netns: SKIPPED: cannot make network namespaces and veth pairs here");
        return;
    };
    let spec = "virtual:[tcp:vA,ranks=0-1,liveness_ms=2000]+[tcp:vB,ranks=1-2,liveness_ms=2000],\
                timeout_ms=30000"
        .to_string();
    let names = ns.0.clone();
    std::thread::scope(|s| {
        let hs: Vec<_> = ThreadBootstrap::group(3)
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                let (names, spec) = (&names, &spec);
                s.spawn(move || -> mad_core::Result<()> {
                    enter(&names[rank]);
                    let session = madeleine::builder().bootstrap(Box::new(b)).build()?;
                    let ch = session.open_channel_with(ChannelConfig::parse("clusters", spec)?)?;
                    let far = 2 - rank;
                    if rank != 1 {
                        assert_eq!(ch.route(far), Some(Route::Gateway { part: rank / 2, via: 1, hops: 2 }));
                    }
                    let big: Vec<u8> = (0..4 << 20).map(|i: usize| (i % 253) as u8).collect();
                    for round in 0..4u64 {
                        if rank == 0 {
                            let mut p = ch.begin_packing(2)?;
                            p.pack_value(&round, RecvMode::Express)?;
                            p.pack(&big, RecvMode::Cheaper)?;
                            p.end_packing()?;
                            let mut u = ch.begin_unpacking_from(2)?;
                            assert_eq!(u.unpack_value::<u64>()?, round + 1000);
                            u.end_unpacking()?;
                        } else if rank == 2 {
                            let mut u = ch.begin_unpacking()?;
                            assert_eq!(u.remote(), 0);
                            assert_eq!(u.unpack_value::<u64>()?, round);
                            let mut got = vec![0u8; 4 << 20];
                            u.unpack(&mut got, SendMode::Cheaper)?;
                            u.end_unpacking()?;
                            assert!(got == big, "round {round}: the 4 MiB piece differs");
                            let mut p = ch.begin_packing(0)?;
                            p.pack_value(&(round + 1000), RecvMode::Express)?;
                            p.end_packing()?;
                        }
                    }
                    session.bootstrap().barrier("clusters/traffic")?;
                    // The gateway leaves: ranks 0 and 2 find out within a bounded time.
                    if rank == 1 {
                        session.close();
                        session.bootstrap().barrier("clusters/left")?;
                        return Ok(());
                    }
                    let t0 = Instant::now();
                    let r = if rank == 0 {
                        // Sends until one fails (the first may still be taken by the way out).
                        let mut r = Ok(());
                        for _ in 0..100 {
                            r = ch.begin_packing(2).and_then(|mut p| {
                                p.pack(&big, RecvMode::Cheaper)?;
                                p.end_packing()
                            });
                            if r.is_err() {
                                break;
                            }
                        }
                        r
                    } else {
                        // Receives until one fails (messages already on the way may arrive).
                        let mut r = Ok(());
                        let mut got = vec![0u8; 4 << 20];
                        for _ in 0..100 {
                            r = ch.begin_unpacking_from(0).and_then(|mut u| {
                                u.unpack_express(&mut got, SendMode::Cheaper)?;
                                u.end_unpacking()
                            });
                            if r.is_err() {
                                break;
                            }
                        }
                        r
                    };
                    let took = t0.elapsed();
                    assert!(r.is_err(), "rank {rank}: calls towards rank {far} still succeed after the gateway left");
                    assert!(took < Duration::from_secs(20), "rank {rank}: the failure took {took:?}");
                    session.bootstrap().barrier("clusters/left")?;
                    Ok(())
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            h.join()
                .unwrap_or_else(|_| panic!("rank {r} panicked"))
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
    });
    drop(ns);
}
