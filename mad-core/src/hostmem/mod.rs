//! # Host memory: what the intra-host drivers share (feature `hostmem`)
//!
//! mad-shm (rings in `/dev/shm`) and mad-sisci's `local` backend (SCI-style remote-write
//! segments in `/dev/shm`) run different protocols over the same machinery, kept here so
//! that neither driver depends on the other:
//!
//! | item | what |
//! |---|---|
//! | [`SegmentFile`], [`segment_name`], [`map_peers`], [`sweep_stale`], [`creator_pid`] | segment files: `O_CREAT\|O_EXCL`, mode 0600, exchanged and mapped at open, unlinked once every peer has mapped them, stale ones swept by creator pid |
//! | [`Region`] | a bounds-checked window on mapped memory: atomic words, block copies, lends |
//! | [`Bell`] | sleep and wake across processes on a futex word and its sleeper count |
//! | [`PeerWatch`], [`Liveness`], [`DeathCheck`] | peer death by pidfd, at a bounded rate; "reported once" for any-source |
//! | [`index`] | SPSC ring index arithmetic over monotonic offsets, hostile values rejected |
//! | [`rewind`] | an idle ring writer going back to the start of its data area, so that short messages stay in cache: both sides' rules |
//! | [`Endpoint`], [`Readiness`], [`Signal`], [`PeerReadiness`], [`vote`] | readiness descriptors for event loops, built and agreed on at open the same way by both drivers: abstract datagram sockets and peers' pidfds in an epoll set, signalled by writers only while armed ([`ready`]) |
//! | [`sys`] | every unsafe foreign call and raw-memory access of the module (`mmap`, futex, `kill`, `pidfd_open`, `poll`; [`ready`]'s sockets and epoll use nix's safe wrappers) |
//!
//! The core itself uses none of it; a driver crate enables the feature
//! (`mad-core = { ..., features = ["hostmem"] }`).

pub mod bell;
pub mod index;
pub mod ready;
pub mod rewind;
pub mod segment;
pub mod sys;
pub mod watch;

pub use bell::Bell;
pub use ready::{reachable, vote, Endpoint, PeerReadiness, PeerSignals, Readiness, Signal, ARMED};
pub use segment::{
    creator_pid, fnv1a, map_peers, segment_name, sweep_stale, MappedPeer, SegmentFile, SHM_DIR,
};
pub use sys::Region;
pub use watch::{DeathCheck, Liveness, PeerWatch, POLL_CHECK_EVERY, WAIT_SLICE};
