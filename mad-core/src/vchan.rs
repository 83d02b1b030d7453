//! Virtual channels: one channel over several real channels, each of which may reach only
//! some ranks (Madeleine II's step towards clusters of clusters).
//!
//! A virtual channel is configured like any channel, `virtual:<part>+<part>+...`, each part a
//! real channel's spec, in brackets when it has options of its own:
//! `virtual:[shm,ranks=0-1]+[via:soft,ranks=1-3]+tcp`. The parts open in that order (each a
//! collective open of its own, named `<name>.<i>`); then every rank publishes which ranks each
//! of its parts reaches, and every rank computes the same routes from that:
//!
//! * to a rank some part reaches directly, the first such part in the configured order
//!   ([`Route::Direct`]): [`Channel::begin_packing`](crate::Channel::begin_packing) and
//!   [`begin_unpacking_from`](crate::Channel::begin_unpacking_from) hand out that part's own
//!   [`Packer`](crate::Packer) / [`Unpacker`](crate::Unpacker), so a message costs what it
//!   costs on the real channel (one branch more), with its TM table, its modes and its
//!   ordering per connection;
//! * any-source [`begin_unpacking`](crate::Channel::begin_unpacking) covers every part (a
//!   rotating first look, then the parts' readiness descriptors at once, as
//!   [`events::begin_unpacking_any`](crate::events::begin_unpacking_any) does);
//! * to a rank no part reaches, the shortest path through gateway ranks
//!   ([`Route::Gateway`]); a configuration in which some two ranks are not joined at all
//!   fails to open on every rank with [`Error::BadConfig`] naming them.
//!
//! The virtual channel's readiness descriptor is an epoll set of its parts' descriptors
//! (none when a part has none: MPI); [`Channel::close`](crate::Channel::close) closes every
//! part. [`Channel::parts`](crate::Channel::parts) and [`Channel::route`](crate::Channel::route)
//! show what was built.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};

use crate::driver::{Armed, Incoming};
use crate::error::{Error, Result};
use crate::{Channel, Unpacker};

/// The driver name of a virtual channel's spec (`virtual:shm+tcp`).
pub const DRIVER: &str = "virtual";

/// How a virtual channel reaches one rank ([`Channel::route`](crate::Channel::route)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Route {
    /// This process.
    Me,
    /// Directly, through the real channel `part` (an index into
    /// [`Channel::parts`](crate::Channel::parts)).
    Direct {
        /// The real channel.
        part: usize,
    },
    /// Through gateway ranks: the first is `via`, reached directly through `part`; `hops`
    /// connections in all.
    Gateway {
        /// The real channel to the first gateway.
        part: usize,
        /// The first gateway.
        via: usize,
        /// Connections on the path (2 through one gateway).
        hops: usize,
    },
}

/// What a virtual channel holds besides the core's channel state (`ChannelInner::virt`).
pub(crate) struct Virtual {
    pub(crate) parts: Vec<Channel>,
    pub(crate) routes: Vec<Route>,
    /// An epoll set of the parts' readiness descriptors (when every part has one).
    set: Option<Epoll>,
    /// The part the next any-source look starts with.
    next: AtomicUsize,
}

impl Virtual {
    /// The real channel that reaches `remote` directly, or the error to report.
    #[inline]
    pub(crate) fn direct(&self, remote: usize, me: usize, size: usize) -> Result<&Channel> {
        match self.routes.get(remote) {
            Some(Route::Direct { part }) => Ok(&self.parts[*part]),
            Some(Route::Gateway { via, hops, .. }) => Err(Error::unavailable(
                DRIVER,
                format!(
                    "rank {remote} is reached only through gateway rank {via} ({hops} hops); \
                     forwarding through gateways is not implemented yet"
                ),
            )),
            _ => Err(Error::BadRank {
                rank: remote,
                size,
                me,
            }),
        }
    }

    /// The readiness descriptor: the epoll set of the parts' descriptors.
    pub(crate) fn readiness_fd(&self) -> Option<BorrowedFd<'_>> {
        self.set.as_ref().map(|s| s.0.as_fd())
    }

    /// Arm every part; `Busy` when one is.
    pub(crate) fn arm(&self) -> Result<Armed> {
        let mut busy = false;
        for p in &self.parts {
            busy |= p.arm()? == Armed::Busy;
        }
        Ok(if busy { Armed::Busy } else { Armed::Armed })
    }

    /// One non-blocking look at every part, starting with a rotating one so that a busy part
    /// does not starve the others.
    pub(crate) fn try_any<'c, 'b>(&'c self) -> Result<Option<Unpacker<'c, 'b>>> {
        let n = self.parts.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let mut gone = 0;
        let mut first_err = None;
        for k in 0..n {
            let p = &self.parts[(first + k) % n];
            match p.try_begin_unpacking() {
                Ok(Some(u)) => return Ok(Some(u)),
                Ok(None) => {}
                // A part none of whose peers is left is not an error of the whole while
                // another part may still deliver.
                Err(e) if !p.is_closed() && p.inner.all_broken() => {
                    gone += 1;
                    first_err.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        match first_err {
            Some(e) if gone == n => Err(e),
            _ => Ok(None),
        }
    }

    /// Any-source receive over every part, until `deadline`.
    pub(crate) fn begin_any<'c, 'b>(
        &'c self,
        deadline: Option<Instant>,
    ) -> Result<Unpacker<'c, 'b>> {
        if let Some(u) = self.try_any()? {
            return Ok(u);
        }
        let refs: smallvec::SmallVec<[&Channel; 4]> = self.parts.iter().collect();
        crate::events::begin_unpacking_any(&refs, deadline).map(|(_, u)| u)
    }
}

/// Routes from `me` given, for every rank, the ranks each of its parts reaches
/// (`reach[rank][part]`). Every rank computes the same graph, so every rank refuses a
/// configuration that leaves two ranks apart.
pub(crate) fn routes(name: &str, me: usize, reach: &[Vec<Vec<usize>>]) -> Result<Vec<Route>> {
    let size = reach.len();
    for (a, parts) in reach.iter().enumerate() {
        for (i, peers) in parts.iter().enumerate() {
            for &b in peers {
                let back = reach
                    .get(b)
                    .and_then(|p| p.get(i))
                    .is_some_and(|l| l.contains(&a));
                if b >= size || !back {
                    return Err(Error::protocol(
                        a,
                        format!(
                            "virtual channel `{name}`: part {i} of rank {a} reaches rank {b}, \
                             but not the other way round"
                        ),
                    ));
                }
            }
        }
    }
    let adjacent = |a: usize| -> Vec<usize> {
        let mut v: Vec<usize> = reach[a].iter().flatten().copied().collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    // Breadth-first from every rank: the whole graph must be connected (every rank then
    // agrees), and from `me` the first hop of a shortest path (the lowest-ranked one).
    let bfs = |from: usize| -> Vec<Option<(usize, usize)>> {
        // (distance, first hop)
        let mut seen: Vec<Option<(usize, usize)>> = vec![None; size];
        seen[from] = Some((0, from));
        let mut queue = std::collections::VecDeque::from([from]);
        while let Some(a) = queue.pop_front() {
            let (d, hop) = seen[a].unwrap_or((0, from));
            for b in adjacent(a) {
                if seen[b].is_none() {
                    seen[b] = Some((d + 1, if a == from { b } else { hop }));
                    queue.push_back(b);
                }
            }
        }
        seen
    };
    let from0 = bfs(0);
    if let Some(far) = from0.iter().position(|s| s.is_none()) {
        return Err(Error::BadConfig(format!(
            "virtual channel `{name}`: ranks 0 and {far} are not joined by any of its real \
             channels, even through gateways; add a real channel that reaches rank {far} \
             (e.g. `+tcp`) or widen a part's `ranks=`"
        )));
    }
    let mine = bfs(me);
    Ok((0..size)
        .map(|r| {
            if r == me {
                return Route::Me;
            }
            if let Some(part) = reach[me].iter().position(|l| l.contains(&r)) {
                return Route::Direct { part };
            }
            let (hops, via) = mine[r].unwrap_or((0, r));
            let part = reach[me].iter().position(|l| l.contains(&via)).unwrap_or(0);
            Route::Gateway { part, via, hops }
        })
        .collect())
}

/// The parts' epoll set (when every part has a descriptor).
pub(crate) fn readiness_set(parts: &[Channel]) -> Result<Option<Epoll>> {
    let fds: Option<Vec<BorrowedFd<'_>>> = parts.iter().map(|p| p.readiness_fd()).collect();
    let Some(fds) = fds else { return Ok(None) };
    let err = |e: nix::Error| Error::io("virtual channel: epoll set", std::io::Error::from(e));
    let set = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(err)?;
    for (i, fd) in fds.into_iter().enumerate() {
        set.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, i as u64))
            .map_err(err)?;
    }
    Ok(Some(set))
}

impl Virtual {
    pub(crate) fn new(parts: Vec<Channel>, routes: Vec<Route>) -> Result<Virtual> {
        let set = readiness_set(&parts)?;
        Ok(Virtual {
            parts,
            routes,
            set,
            next: AtomicUsize::new(0),
        })
    }
}

/// The core's `Incoming` of a virtual channel: it has no connection of its own (its parts
/// do); the core asks the parts instead.
pub(crate) struct NoIncoming;

impl Incoming for NoIncoming {
    fn poll(&self, _ready: &mut dyn FnMut(usize)) -> Result<()> {
        Ok(())
    }
    fn wait(&self, timeout: Duration) -> Result<()> {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        Ok(())
    }
    fn wake(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ChannelConfig, RankSet};

    /// `reach[rank][part]` from, per part, the set of ranks it joins (all pairs inside).
    fn reach(size: usize, parts: &[&[usize]]) -> Vec<Vec<Vec<usize>>> {
        (0..size)
            .map(|r| {
                parts
                    .iter()
                    .map(|set| {
                        if set.contains(&r) {
                            set.iter().copied().filter(|&x| x != r).collect()
                        } else {
                            Vec::new()
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn first_part_that_reaches_wins() {
        let r = reach(3, &[&[0, 1], &[0, 1, 2]]);
        let from0 = routes("v", 0, &r).unwrap();
        assert_eq!(
            from0,
            vec![
                Route::Me,
                Route::Direct { part: 0 },
                Route::Direct { part: 1 }
            ]
        );
    }

    #[test]
    fn gateways_on_the_shortest_path() {
        // 0-1-2 on part 0, 2-3-4 on part 1: rank 0 reaches 4 through 1 then 2.
        let r = reach(5, &[&[0, 1, 2], &[2, 3, 4]]);
        let from0 = routes("v", 0, &r).unwrap();
        assert_eq!(from0[2], Route::Direct { part: 0 });
        assert_eq!(
            from0[3],
            Route::Gateway {
                part: 0,
                via: 2,
                hops: 2
            }
        );
        assert_eq!(
            from0[4],
            Route::Gateway {
                part: 0,
                via: 2,
                hops: 2
            }
        );
        let from4 = routes("v", 4, &r).unwrap();
        assert_eq!(
            from4[0],
            Route::Gateway {
                part: 1,
                via: 2,
                hops: 2
            }
        );
        // A chain: 0-1 | 1-2 | 2-3.
        let r = reach(4, &[&[0, 1], &[1, 2], &[2, 3]]);
        assert_eq!(
            routes("v", 0, &r).unwrap()[3],
            Route::Gateway {
                part: 0,
                via: 1,
                hops: 3
            }
        );
    }

    #[test]
    fn apart_or_one_sided_is_refused() {
        let r = reach(3, &[&[0, 1]]);
        for me in 0..3 {
            let e = routes("v", me, &r).unwrap_err();
            assert!(e.to_string().contains("ranks 0 and 2"), "{e}");
        }
        let mut r = reach(2, &[&[0, 1]]);
        r[1][0].clear();
        assert!(matches!(routes("v", 0, &r), Err(Error::Protocol { .. })));
    }

    #[test]
    fn specs() {
        let c = ChannelConfig::parse(
            "v",
            "virtual:[shm,ranks=0-1:4,progress=poll]+via:soft+tcp,progress=block,checked=1",
        )
        .unwrap();
        assert!(c.is_virtual());
        let drivers: Vec<&str> = c.parts.iter().map(|p| p.driver.as_str()).collect();
        assert_eq!(drivers, ["shm", "via", "tcp"]);
        assert_eq!(c.parts[0].name, "v.0");
        assert_eq!(c.parts[0].ranks, RankSet::parse("0-1:4"));
        assert!(c.parts[0].ranks.as_ref().unwrap().contains(4));
        assert!(!c.parts[0].ranks.as_ref().unwrap().contains(2));
        // A part's own setting wins; the whole's goes to the others.
        assert_eq!(c.parts[0].progress, crate::progress::ProgressMode::Poll);
        assert_eq!(c.parts[1].progress, crate::progress::ProgressMode::Block);
        assert!(c.parts.iter().all(|p| p.checked));
        assert_eq!(c.parts[1].adapter.as_deref(), Some("soft"));
        for bad in [
            "virtual:",
            "virtual:[shm,ranks=0-1",
            "virtual:shm+tcp,ranks=0-1",
            "virtual:shm+tcp,tm.small=4k",
            "virtual:[virtual:shm]",
            "tcp,ranks=2-1",
            "tcp,ranks=a",
        ] {
            assert!(
                matches!(ChannelConfig::parse("v", bad), Err(Error::BadConfig(_))),
                "{bad} parsed"
            );
        }
        assert_eq!(RankSet::parse("0-2:5").unwrap().to_string(), "0-2:5");
    }
}
