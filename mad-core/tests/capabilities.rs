//! What the engine does with a driver's `Capabilities`: an intra-node driver refuses to open
//! a channel that would miss ranks on other hosts (unless `local_only`), and a piece that
//! would make a message longer than `max_message` is refused before any of it is sent.
//!
//! Threads of one process; "other hosts" are made up by a bootstrap that wraps
//! `ThreadBootstrap` and reports fewer local ranks. Every wait is bounded.

use std::sync::mpsc;
use std::time::Duration;

use mad_core::auth::Secret;
use mad_core::bootstrap::{Bootstrap, RankFailure, Scope, ThreadBootstrap};
use mad_core::driver::{Capabilities, Driver, OpenContext, OpenedChannel, TmTable};
use mad_core::mem::MemDriver;
use mad_core::{ChannelConfig, Error, ErrorKind, RecvMode, Result, SendMode, Session};

/// Bound on every wait: far above what an open takes.
const LIMIT: Duration = Duration::from_secs(30);

/// A thread bootstrap whose ranks live on hosts: rank `r` is on host `host_of[r]`.
struct Hosts {
    inner: ThreadBootstrap,
    host_of: Vec<usize>,
}

impl Bootstrap for Hosts {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn secret(&self) -> &Secret {
        self.inner.secret()
    }
    fn allgather(&self, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.inner.allgather(tag, value)
    }
    fn kind(&self) -> &'static str {
        "hosts"
    }
    fn scoped_allgather(&self, scope: &Scope, tag: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.inner.scoped_allgather(scope, tag, value)
    }
    fn abandon(&self, scope: &Scope, failure: &RankFailure) -> Result<RankFailure> {
        self.inner.abandon(scope, failure)
    }
    fn local_ranks(&self) -> Vec<usize> {
        let mine = self.host_of[self.rank()];
        (0..self.size())
            .filter(|&r| self.host_of[r] == mine)
            .collect()
    }
}

/// `mem` claiming to cross hosts (for `local_only` on such a driver).
#[derive(Debug)]
struct Wide;

impl Driver for Wide {
    fn name(&self) -> &'static str {
        "wide"
    }
    fn describe(&self) -> String {
        "mem, declared as reaching other hosts".into()
    }
    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        MemDriver.tm_table(config)
    }
    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        MemDriver.capabilities(config).with_intra_node_only(false)
    }
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        MemDriver.open(ctx)
    }
}

/// Open `spec` on one thread per entry of `host_of`; each rank's outcome, by rank.
fn open_all(host_of: &[usize], spec: &str) -> Vec<Result<()>> {
    let n = host_of.len();
    let (tx, rx) = mpsc::channel();
    for b in ThreadBootstrap::group(n) {
        let tx = tx.clone();
        let spec = spec.to_string();
        let host_of = host_of.to_vec();
        std::thread::spawn(move || {
            let rank = b.rank();
            let s = Session::builder()
                .driver(MemDriver)
                .driver(Wide)
                .bootstrap(Box::new(Hosts { inner: b, host_of }))
                .build()
                .unwrap();
            let r = s
                .open_channel_with(ChannelConfig::parse("c", &spec).unwrap())
                .map(drop);
            let _ = tx.send((rank, r));
        });
    }
    let mut out: Vec<Option<Result<()>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (rank, r) = rx
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("{spec}: a rank is still opening after {LIMIT:?}"));
        out[rank] = Some(r);
    }
    out.into_iter().map(Option::unwrap).collect()
}

#[test]
fn an_intra_node_channel_over_several_hosts_fails_to_open_naming_the_ranks_out_of_reach() {
    // Ranks 0 and 1 on one host, rank 2 on another.
    let out = open_all(&[0, 0, 1], "mem");
    for (rank, r) in out.iter().enumerate() {
        let e = r.as_ref().expect_err("the open must fail on every rank");
        let text = e.to_string();
        assert!(
            e.kind() == ErrorKind::Config || e.remote_kind() == Some(ErrorKind::Config),
            "rank {rank}: {e:?}"
        );
        assert!(
            text.contains("channel `c`: driver `mem` reaches only the ranks of its own host"),
            "rank {rank}: {text}"
        );
        assert!(text.contains("local_only=true"), "rank {rank}: {text}");
    }
    // A rank that reports its own failure names what it cannot reach.
    for (rank, r) in out.iter().enumerate() {
        if let Err(Error::BadConfig(m)) = r {
            let away = if rank == 2 {
                "2 peer(s) on other hosts: rank 0 (on "
            } else {
                "1 peer(s) on other hosts: rank 2 (on "
            };
            assert!(m.contains(away), "rank {rank}: {m}");
        }
    }
    assert!(
        out.iter().any(|r| matches!(r, Err(Error::BadConfig(_)))),
        "{out:?}"
    );
}

#[test]
fn local_only_opens_an_intra_node_channel_over_several_hosts() {
    for r in open_all(&[0, 0, 1], "mem,local_only=true") {
        r.unwrap();
    }
    // On one host the option changes nothing.
    for r in open_all(&[0, 0], "mem,local_only=true") {
        r.unwrap();
    }
}

#[test]
fn local_only_is_refused_for_a_driver_that_crosses_hosts() {
    for r in open_all(&[0, 1], "wide,local_only=true") {
        let e = r.expect_err("local_only on a driver that crosses hosts");
        assert!(
            e.to_string()
                .contains("local_only=true is for drivers that reach only their own host"),
            "{e}"
        );
    }
    for r in open_all(&[0, 1], "wide") {
        r.unwrap();
    }
}

/// Rank 0 sends to rank 1 over `spec` (whose driver carries at most 100 B per message):
/// refused pieces leave the message and the connection usable.
fn bounded(spec: &str) {
    let boots = ThreadBootstrap::group(2);
    std::thread::scope(|s| {
        for b in boots {
            s.spawn(move || {
                let rank = b.rank();
                let session = Session::builder()
                    .driver(MemDriver)
                    .bootstrap(Box::new(b))
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("bounded", spec).unwrap())
                    .unwrap();
                assert_eq!(ch.capabilities().max_message, Some(100), "{spec}");
                if rank == 0 {
                    let big = [7u8; 101];
                    let mut lb = [1u8; 50];
                    let later = std::cell::Cell::from_mut(&mut lb[..]).as_slice_of_cells();
                    // 1. 60 B, then 50 B more: refused, the message goes on with 40 B.
                    let mut p = ch.begin_packing(1).unwrap();
                    p.pack_safer(&big[..60], RecvMode::Express).unwrap();
                    let e = p.pack(&big[..50], RecvMode::Cheaper).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::TooLarge, "{spec}: {e}");
                    match &e {
                        Error::MessageTooLarge {
                            channel,
                            driver,
                            rank: 1,
                            len: 110,
                            max: 100,
                        } => assert!(channel == "bounded" && driver == "mem"),
                        other => panic!("{spec}: {other:?}"),
                    }
                    assert!(
                        e.to_string().contains(
                            "a message of 110 B to rank 1 is longer than driver `mem` carries \
                             in one message (100 B)"
                        ),
                        "{e}"
                    );
                    assert!(matches!(
                        p.pack_later(later, RecvMode::Cheaper),
                        Err(Error::MessageTooLarge { len: 110, .. })
                    ));
                    p.pack(&big[..40], RecvMode::Cheaper).unwrap();
                    p.end_packing().unwrap();
                    // 2. A first piece too large: refused before anything left, so dropping
                    // the packer leaves the connection intact.
                    let mut p = ch.begin_packing(1).unwrap();
                    assert!(matches!(
                        p.pack(&big, RecvMode::Express),
                        Err(Error::MessageTooLarge { len: 101, .. })
                    ));
                    drop(p);
                    // 3. Exactly the bound.
                    let mut p = ch.begin_packing(1).unwrap();
                    p.pack(&big[..100], RecvMode::Cheaper).unwrap();
                    p.end_packing().unwrap();
                } else {
                    let mut u = ch.begin_unpacking_from(0).unwrap();
                    let mut a = [0u8; 60];
                    let mut b = [0u8; 40];
                    u.unpack_express(&mut a, SendMode::Safer).unwrap();
                    u.unpack(&mut b, SendMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(a.iter().chain(&b).all(|&x| x == 7));
                    let mut u = ch.begin_unpacking_from(0).unwrap();
                    let mut c = [0u8; 100];
                    u.unpack(&mut c, SendMode::Cheaper).unwrap();
                    u.end_unpacking().unwrap();
                    assert!(c.iter().all(|&x| x == 7));
                }
            });
        }
    });
}

#[test]
fn a_piece_beyond_max_message_is_refused_and_the_message_and_connection_go_on() {
    bounded("mem,max_message=100");
    bounded("mem,max_message=100,checked=true");
}
