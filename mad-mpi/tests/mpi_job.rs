//! The MPI job test: run under an MPI launcher, for example
//!
//! ```text
//! mpiexec.mpich -n 4 target-mpich/debug/deps/mpi_job-*
//! mpirun.openmpi --allow-run-as-root --oversubscribe -n 4 target-openmpi/debug/deps/mpi_job-*
//! ```
//!
//! Started without a launcher (plain `cargo test`), it checks the "not available" paths:
//! `MpiBootstrap::from_env()` is `None`, and an MPI channel over a 2-rank in-process session
//! fails with `Error::Unavailable` (MPI_COMM_WORLD has one process).
//!
//! With `MAD_MPI_THREAD_LEVEL=funneled` (or `single`) MPI grants less than `SERIALIZED`: the
//! job then checks that the bootstrap works from the main thread only and that MPI channels
//! are refused on every rank with `Error::Unavailable`, and prints "refused as expected".

mod common;

use std::time::Duration;

use common::{pattern, recv, send, Dest, Piece};
use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::driver::{Driver, OpenContext, OpenedChannel};
use mad_core::progress::ProgressPolicy;
use mad_core::{Error, ErrorKind, Result};
use mad_mpi::{MpiBootstrap, MpiDriver};

fn open(d: &MpiDriver, bs: &dyn Bootstrap, name: &str, spec: &str) -> Result<OpenedChannel> {
    let config = ChannelConfig::parse(name, spec)?;
    let table = d.tm_table(&config)?;
    let progress = ProgressPolicy::default();
    d.open(&OpenContext::new(&config, bs, &table, &progress))
}

fn check(cond: bool, what: &str) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::protocol(usize::MAX, format!("check failed: {what}")))
    }
}

fn t_bootstrap(bs: &MpiBootstrap) -> Result<()> {
    let me = bs.rank();
    let v = pattern(me * 37, me as u64);
    let all = bs.allgather("t/varlen", &v)?;
    check(all.len() == bs.size(), "allgather size")?;
    for (r, x) in all.iter().enumerate() {
        check(*x == pattern(r * 37, r as u64), "allgather contents")?;
    }
    let secrets = bs.allgather("t/secret", bs.secret().to_hex().as_bytes())?;
    check(
        secrets.iter().all(|s| *s == secrets[0]),
        "same secret everywhere",
    )?;
    check(
        bs.local_ranks() == (0..bs.size()).collect::<Vec<_>>(),
        "one host: every rank local",
    )?;
    bs.barrier("t/barrier")?;
    Ok(())
}

/// Ping-pong between 0 and 1 over many shapes; other ranks idle.
fn t_pingpong(bs: &MpiBootstrap, ch: &mut OpenedChannel, label: &str) -> Result<()> {
    let me = bs.rank();
    if me > 1 {
        return Ok(());
    }
    let peer = 1 - me;
    let link = ch.links[peer]
        .as_mut()
        .ok_or_else(|| Error::protocol(peer, "no link"))?;
    let sizes = [
        0usize,
        1,
        8,
        100,
        4095,
        4096,
        4097,
        16 << 10,
        64 << 10,
        65537,
        1 << 20,
        4 << 20,
    ];
    for (i, &n) in sizes.iter().enumerate() {
        let hdr = (n as u64).to_le_bytes();
        let data = pattern(n, i as u64);
        let big = n > mad_mpi::driver::EAGER_MAX;
        for round in 0..2 {
            if (me == 0) == (round == 0) {
                let body = if big {
                    Piece::Group(vec![&data])
                } else {
                    Piece::Copy(&data)
                };
                send(link.tx.as_mut(), &[Piece::Copy(&hdr), body])?;
            } else {
                let mut h = [0u8; 8];
                let mut got = vec![0u8; n];
                {
                    let body = if big {
                        Dest::Group(vec![&mut got])
                    } else {
                        Dest::Copy(&mut got)
                    };
                    recv(link.rx.as_mut(), &mut [Dest::Copy(&mut h), body])?;
                }
                check(u64::from_le_bytes(h) == n as u64, "header")?;
                check(got == data, &format!("{label}: payload of {n} B"))?;
            }
        }
    }
    Ok(())
}

/// Figure 1 of the paper (EXPRESS length, then CHEAPER data) and a multi-piece message mixing
/// TMs: copy, group of 3, copy, group of 1, copy.
fn t_figure1_multipiece(bs: &MpiBootstrap, ch: &mut OpenedChannel, label: &str) -> Result<()> {
    let me = bs.rank();
    if me > 1 {
        return Ok(());
    }
    let peer = 1 - me;
    let link = ch.links[peer]
        .as_mut()
        .ok_or_else(|| Error::protocol(peer, "no link"))?;
    let a = pattern(10, 1);
    let g1 = pattern(70_000, 2);
    let g2 = pattern(20_000, 3);
    let g3 = pattern(300_000, 4);
    let c = pattern(5000, 5);
    let g4 = pattern(2 << 20, 6);
    let e = pattern(3, 7);
    for _ in 0..3 {
        if me == 0 {
            send(
                link.tx.as_mut(),
                &[
                    Piece::Copy(&a),
                    Piece::Group(vec![&g1, &g2, &g3]),
                    Piece::Copy(&c),
                    Piece::Group(vec![&g4]),
                    Piece::Copy(&e),
                ],
            )?;
        } else {
            let (mut ra, mut r1, mut r2, mut r3) = (
                vec![0; 10],
                vec![0; 70_000],
                vec![0; 20_000],
                vec![0; 300_000],
            );
            let (mut rc, mut r4, mut re) = (vec![0; 5000], vec![0; 2 << 20], vec![0; 3]);
            recv(
                link.rx.as_mut(),
                &mut [
                    Dest::Copy(&mut ra),
                    Dest::Group(vec![&mut r1, &mut r2, &mut r3]),
                    Dest::Copy(&mut rc),
                    Dest::Group(vec![&mut r4]),
                    Dest::Copy(&mut re),
                ],
            )?;
            check(
                ra == a && r1 == g1 && r2 == g2 && r3 == g3,
                &format!("{label}: multipiece head"),
            )?;
            check(
                rc == c && r4 == g4 && re == e,
                &format!("{label}: multipiece tail"),
            )?;
        }
    }
    Ok(())
}

/// Every rank but 0 sends `k` messages to 0; rank 0 finds them through `Incoming::poll`.
fn t_any_source(bs: &MpiBootstrap, ch: &mut OpenedChannel) -> Result<()> {
    let me = bs.rank();
    let k = 5;
    if me != 0 {
        let link = ch.links[0]
            .as_mut()
            .ok_or_else(|| Error::protocol(0, "no link"))?;
        for i in 0..k {
            let v = ((me as u64) << 32 | i).to_le_bytes();
            let body = pattern(100 + me, i);
            send(link.tx.as_mut(), &[Piece::Copy(&v), Piece::Copy(&body)])?;
        }
        return Ok(());
    }
    let mut next = vec![0u64; bs.size()];
    let mut left = (bs.size() - 1) * k as usize;
    let start = std::time::Instant::now();
    while left > 0 {
        check(start.elapsed() < common::OP_TIMEOUT, "any-source timed out")?;
        let mut ready = Vec::new();
        ch.incoming.poll(&mut |r| ready.push(r))?;
        if ready.is_empty() {
            ch.incoming.wait(Duration::from_millis(10))?;
            continue;
        }
        for r in ready {
            check(r != 0 && r < bs.size(), "any-source rank")?;
            let link = ch.links[r]
                .as_mut()
                .ok_or_else(|| Error::protocol(r, "no link"))?;
            let mut v = [0u8; 8];
            let mut body = vec![0u8; 100 + r];
            recv(
                link.rx.as_mut(),
                &mut [Dest::Copy(&mut v), Dest::Copy(&mut body)],
            )?;
            let v = u64::from_le_bytes(v);
            check(
                v >> 32 == r as u64 && v & 0xffff_ffff == next[r],
                "per-peer order",
            )?;
            check(body == pattern(100 + r, next[r]), "any-source body")?;
            next[r] += 1;
            left -= 1;
        }
    }
    Ok(())
}

/// Two channels never see each other's traffic: send on A then B, receive B then A.
fn t_isolation(bs: &MpiBootstrap, a: &mut OpenedChannel, b: &mut OpenedChannel) -> Result<()> {
    let me = bs.rank();
    if me > 1 {
        return Ok(());
    }
    let peer = 1 - me;
    let x = pattern(64, 11);
    let y = pattern(100_000, 12);
    if me == 0 {
        send(
            a.links[peer]
                .as_mut()
                .ok_or_else(|| Error::protocol(peer, "no link"))?
                .tx
                .as_mut(),
            &[Piece::Copy(&x)],
        )?;
        send(
            b.links[peer]
                .as_mut()
                .ok_or_else(|| Error::protocol(peer, "no link"))?
                .tx
                .as_mut(),
            &[Piece::Copy(&[1]), Piece::Group(vec![&y])],
        )?;
    } else {
        let (mut ry, mut one) = (vec![0u8; 100_000], [0u8; 1]);
        recv(
            b.links[peer]
                .as_mut()
                .ok_or_else(|| Error::protocol(peer, "no link"))?
                .rx
                .as_mut(),
            &mut [Dest::Copy(&mut one), Dest::Group(vec![&mut ry])],
        )?;
        let mut rx_ = vec![0u8; 64];
        recv(
            a.links[peer]
                .as_mut()
                .ok_or_else(|| Error::protocol(peer, "no link"))?
                .rx
                .as_mut(),
            &mut [Dest::Copy(&mut rx_)],
        )?;
        check(ry == y && one == [1] && rx_ == x, "channel isolation")?;
    }
    Ok(())
}

/// A receiver whose unpack sequence differs from the pack sequence gets a protocol error.
fn t_mismatch(bs: &MpiBootstrap, ch: &mut OpenedChannel) -> Result<()> {
    let me = bs.rank();
    if me > 1 {
        return Ok(());
    }
    let peer = 1 - me;
    let link = ch.links[peer]
        .as_mut()
        .ok_or_else(|| Error::protocol(peer, "no link"))?;
    let x = pattern(200, 13);
    if me == 0 {
        send(link.tx.as_mut(), &[Piece::Copy(&x)])?;
    } else {
        let mut small = vec![0u8; 100];
        let r = recv(link.rx.as_mut(), &mut [Dest::Copy(&mut small)]);
        check(
            matches!(r, Err(Error::Protocol { .. })),
            "short unpack is reported",
        )?;
        check(
            matches!(link.rx.poll_message(), Err(Error::Poisoned { .. })),
            "then the link is poisoned",
        )?;
    }
    Ok(())
}

/// Aborts: a sender that abandons a message before anything left gets `Discarded` and the
/// connection stays usable; a receiver asked for a gather group while its eager receive is
/// posted reports a protocol error, and abandoning cancels the posted receive (which never
/// completes) at once and poisons the link.
fn t_abort(bs: &MpiBootstrap, ch: &mut OpenedChannel) -> Result<()> {
    use mad_core::driver::AbortOutcome;
    use std::io::IoSliceMut;
    let me = bs.rank();
    if me > 1 {
        return Ok(());
    }
    let peer = 1 - me;
    let link = ch.links[peer]
        .as_mut()
        .ok_or_else(|| Error::protocol(peer, "no link"))?;
    if me == 0 {
        link.tx.begin_message()?;
        let _ = link.tx.with_buffer(0, 8, &mut |b: &mut [u8]| {
            b[..8].copy_from_slice(&[9; 8]);
            8
        })?;
        check(
            link.tx.abort_message() == AbortOutcome::Discarded,
            "nothing sent: discarded",
        )?;
        // The connection is intact: a header-only message goes through.
        send(link.tx.as_mut(), &[Piece::Copy(&[1, 2, 3])])?;
    } else {
        let mut h = [0u8; 3];
        recv(link.rx.as_mut(), &mut [Dest::Copy(&mut h)])?;
        check(h == [1, 2, 3], "message after a discarded one")?;
        // The eager receive for the next message is posted (it never completes: rank 0 sends
        // nothing more); a gather group here is refused.
        let mut dst = vec![0u8; 100_000];
        let mut iov = [IoSliceMut::new(&mut dst)];
        check(
            matches!(link.rx.recv_refs(1, &mut iov), Err(Error::Protocol { .. })),
            "gather group while an eager receive is posted is a protocol error",
        )?;
        let t = std::time::Instant::now();
        link.rx.abort_message();
        check(
            t.elapsed() < Duration::from_secs(5),
            "abort returns promptly",
        )?;
        check(
            matches!(link.rx.poll_message(), Err(Error::Poisoned { .. })),
            "poisoned after abort",
        )?;
    }
    Ok(())
}

fn not_available() -> Result<()> {
    check(MpiBootstrap::from_env()?.is_none(), "no launcher detected")?;
    let group = ThreadBootstrap::group(2);
    let d = MpiDriver::new();
    match open(&d, &group[0], "m", "mpi") {
        Err(Error::Unavailable { reason, .. }) => {
            println!("mpi_job: not under an MPI launcher; 2-rank thread session refused as expected: {reason}");
            Ok(())
        }
        Err(e) => Err(e),
        Ok(_) => Err(Error::protocol(
            0,
            "an MPI channel opened over a session MPI does not span",
        )),
    }
}

/// MPI granted FUNNELED or SINGLE: the bootstrap works from the main thread, not from
/// another one, and every MPI channel is refused on every rank (driver and session paths).
fn thread_level_too_low(bs: MpiBootstrap) -> Result<()> {
    let me = bs.rank();
    t_bootstrap(&bs)?;
    let other = std::thread::scope(|s| s.spawn(|| bs.barrier("t/other-thread")).join());
    check(
        matches!(other, Ok(Err(Error::Unavailable { .. }))),
        "a bootstrap collective from another thread is refused",
    )?;
    let d = MpiDriver::new();
    let reason = match open(&d, &bs, "mpi", "mpi") {
        Err(Error::Unavailable { reason, .. }) => reason,
        Err(e) => return Err(e),
        Ok(_) => {
            return Err(Error::protocol(
                me,
                "an MPI channel opened although MPI granted less than THREAD_SERIALIZED",
            ))
        }
    };
    check(
        reason.contains(mad_mpi::level_name(bs.threading())),
        "the refusal names the level",
    )?;
    bs.barrier("t/refused")?;
    // The same through a session (what applications see).
    let session = mad_core::Session::builder()
        .driver(MpiDriver::new())
        .bootstrap(Box::new(bs))
        .build()?;
    check(
        // Every rank refuses; a rank may learn it first from another's abandoned open (the
        // kind is carried).
        match session.open_channel_with(ChannelConfig::parse("s", "mpi")?) {
            Err(e) => {
                e.kind() == ErrorKind::Unavailable
                    || e.remote_kind() == Some(ErrorKind::Unavailable)
            }
            Ok(_) => false,
        },
        "session: MPI channel refused",
    )?;
    session.bootstrap().barrier("t/refused2")?;
    if me == 0 {
        println!("mpi_job: MPI channel refused as expected on every rank: {reason}");
    }
    Ok(())
}

fn run() -> Result<()> {
    let Some(bs) = MpiBootstrap::from_env()? else {
        return not_available();
    };
    if bs.threading() < mad_mpi::Threading::Serialized {
        return thread_level_too_low(bs);
    }
    let me = bs.rank();
    if me == 0 {
        println!(
            "mpi_job: {} ranks, {}, {:?} granted, THREAD_MULTIPLE without lock: {}",
            bs.size(),
            bs.library(),
            bs.threading(),
            bs.thread_multiple()
        );
    }
    t_bootstrap(&bs)?;
    let d = MpiDriver::new();
    let mut ch = open(&d, &bs, "mpi", "mpi")?;
    if me == 0 {
        for n in &ch.notes {
            println!("mpi_job: note: {n}");
        }
    }
    t_pingpong(&bs, &mut ch, "auto")?;
    t_figure1_multipiece(&bs, &mut ch, "auto")?;
    t_any_source(&bs, &mut ch)?;
    // The other paths: hindexed groups; tiny eager buffers (many eager messages per
    // Madeleine message); eager receives posted at end of message and every eager message
    // non-blocking; every eager message through a blocking MPI_Send.
    for spec in [
        "mpi,gather=datatype",
        "mpi,gather=separate,eager_buf=1000",
        "mpi,post=early,inline=0",
        "mpi,eager_buf=256,inline=65536",
    ] {
        let mut c2 = open(&d, &bs, "mpi2", spec)?;
        t_pingpong(&bs, &mut c2, spec)?;
        t_figure1_multipiece(&bs, &mut c2, spec)?;
        t_any_source(&bs, &mut c2)?;
    }
    let mut other = open(&d, &bs, "other", "mpi")?;
    t_isolation(&bs, &mut ch, &mut other)?;
    // Mismatched channel specs are refused on every rank.
    let bad = open(
        &d,
        &bs,
        "bad",
        if me == 0 {
            "mpi,gather=separate"
        } else {
            "mpi"
        },
    );
    check(
        matches!(bad, Err(Error::BadConfig(_))),
        "different specs refused",
    )?;
    let mut mm = open(&d, &bs, "mismatch", "mpi")?;
    t_mismatch(&bs, &mut mm)?;
    let mut ab = open(&d, &bs, "abort", "mpi")?;
    t_abort(&bs, &mut ab)?;
    bs.barrier("t/abort")?;
    drop(ab);
    bs.barrier("t/end")?;
    drop((mm, other, ch));
    conformance(me)?;
    t_tune(&bs)?;
    if me == 0 {
        println!("mpi_job: all checks passed on {} ranks", bs.size());
    }
    Ok(())
}

/// The core's conformance kit over an MPI channel, in a `Session` built on a second
/// `MpiBootstrap` (MPI itself is initialised once and shared).
fn conformance(me: usize) -> Result<()> {
    use mad_core::conformance::{case_names, run_rank, KitOptions};
    let session = mad_core::Session::builder()
        .driver(MpiDriver::new())
        .bootstrap(Box::new(MpiBootstrap::new()?))
        .build()?;
    let spec = std::env::var("MAD_MPI_KIT_SPEC").unwrap_or_else(|_| "mpi".into());
    let mut opts = KitOptions::new(&spec);
    if opts.cases.is_none() {
        // MPI does not report a dead peer (capabilities().detects_peer_death is false).
        // Every case but `peer_closes`: MPI does not report a dead peer
        // (`capabilities().detects_peer_death` is false). `MAD_KIT_CASES` overrides the list.
        opts.cases = Some(
            case_names()
                .into_iter()
                .filter(|n| *n != "peer_closes")
                .map(String::from)
                .collect(),
        );
    }
    let ran = run_rank(&session, &opts)?;
    if me == 0 {
        println!(
            "mpi_job: conformance kit over `{spec}`: {} cases passed: {}",
            ran.len(),
            ran.join(" ")
        );
    }
    Ok(())
}

/// `tune=auto` under the launcher, over the job's kit spec: rank 0 and rank 1 measure the TMs
/// at open while the other ranks wait in the open's vote; every rank ends with rank 0's table
/// (the fingerprints, gathered, are one) with measured thresholds, no message counted, and
/// pieces on both sides of every threshold arrive whole; a second open of the same spec takes
/// the thresholds from rank 0's cache on every rank, without measuring, and the same table.
fn t_tune(bs: &MpiBootstrap) -> Result<()> {
    use mad_core::modes::{RecvMode, SendMode};
    use mad_core::tune::ThresholdSource;
    let session = mad_core::Session::builder()
        .driver(MpiDriver::new())
        .bootstrap(Box::new(MpiBootstrap::new()?))
        .build()?;
    let (me, size) = (session.rank(), session.size());
    // One cache directory, rank 0's (only rank 0's cache counts), empty at first.
    let mine = std::env::temp_dir().join(format!("mad-mpi-tune-{}", std::process::id()));
    let dirs = bs.allgather("t/tune-dir", mine.to_string_lossy().as_bytes())?;
    let dir = std::path::PathBuf::from(String::from_utf8_lossy(&dirs[0]).into_owned());
    if me == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let kit = std::env::var("MAD_MPI_KIT_SPEC").unwrap_or_else(|_| "mpi".into());
    // A budget no loaded machine exhausts: this checks the mechanism, not the machine.
    let spec = format!(
        "{kit},tune=auto,tune_budget_ms=600000,tune_cache={}",
        dir.display()
    );
    let mut fps = Vec::new();
    for (round, want) in [ThresholdSource::Measured, ThresholdSource::Cached]
        .into_iter()
        .enumerate()
    {
        bs.barrier(&format!("t/tune-{round}"))?;
        let cfg = ChannelConfig::parse(&format!("tuned{round}"), &spec)?
            .op_timeout(Duration::from_secs(120));
        let ch = session.open_channel_with(cfg)?;
        let t = ch.tuning();
        let first = ch.tm_table().tms()[0].name;
        check(
            t.complete && t.source(first) == Some(want),
            &format!(
                "tune=auto open {round}: {want:?} thresholds expected on rank {me}:\n{}",
                ch.selection_table()
            ),
        )?;
        let st = ch.stats();
        check(
            st.messages_sent + st.messages_received == 0,
            "the calibration left messages counted",
        )?;
        for n in [1usize, 100, 3000, 40_000, 300_000, 3 << 20] {
            let v = (n % 251) as u8;
            if me == 0 {
                let buf = vec![v; n];
                for r in 1..size {
                    let mut p = ch.begin_packing(r)?;
                    p.pack(&buf, RecvMode::Cheaper)?;
                    p.end_packing()?;
                }
            } else {
                let mut buf = vec![0u8; n];
                let mut u = ch.begin_unpacking_from(0)?;
                u.unpack(&mut buf, SendMode::Cheaper)?;
                u.end_unpacking()?;
                check(
                    buf.iter().all(|&x| x == v),
                    &format!("tuned channel: {n} B"),
                )?;
            }
        }
        let fp = ch.tm_table().fingerprint();
        let all = bs.allgather(&format!("t/tune-fp-{round}"), &fp.to_le_bytes())?;
        check(
            all.iter().all(|f| f[..] == fp.to_le_bytes()),
            &format!("tune=auto open {round}: the ranks' tables differ"),
        )?;
        fps.push(fp);
        if me == 0 {
            println!(
                "mpi_job: tune=auto over `{kit}`, open {round}: {} thresholds, table {fp:016x} on every rank{}",
                want.as_str(),
                t.calibration
                    .filter(|_| round == 0)
                    .map(|c| format!(" (calibration {} ms)", c.as_millis()))
                    .unwrap_or_default()
            );
        }
        drop(ch);
    }
    check(fps[0] == fps[1], "the cached table is not the measured one")?;
    bs.barrier("t/tune-end")?;
    if me == 0 {
        let _ = std::fs::remove_dir_all(&dir);
        println!("mpi_job: tune=auto measured, agreed and cached on {size} ranks");
    }
    Ok(())
}

fn main() {
    match run() {
        Ok(()) => {}
        Err(e) => {
            eprintln!("mpi_job FAILED: {e}");
            std::process::exit(1);
        }
    }
}
