//! A channel open that fails on one rank of an MPI job fails on the others, naming it and
//! carrying its error (the MPI bootstrap's abort marker). Run under an MPI launcher:
//!
//! ```text
//! mpiexec.mpich -n 3 target/debug/deps/mpi_open_failure-*
//! ```
//!
//! Without a launcher it does nothing. The driver under test wraps the in-process `mem`
//! driver (its open only needs the bootstrap's collectives; its links are not used here): it
//! runs two collectives of its own, then `mem`'s open, and fails on rank 1 at a chosen step.

use mad_core::driver::{Capabilities, Driver, OpenContext, OpenedChannel, TmTable};
use mad_core::mem::MemDriver;
use mad_core::{ChannelConfig, Error, Result, Session};
use mad_mpi::MpiBootstrap;

struct Flaky;

impl Driver for Flaky {
    fn name(&self) -> &'static str {
        "flaky"
    }
    fn describe(&self) -> String {
        "flaky: mem failing on rank 1".into()
    }
    fn tm_table(&self, config: &ChannelConfig) -> Result<TmTable> {
        MemDriver.tm_table(config)
    }
    fn capabilities(&self, config: &ChannelConfig) -> Capabilities {
        MemDriver.capabilities(config)
    }
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let b = ctx.bootstrap;
        let step = ctx.config.name.as_str();
        let fail = |s: &str| {
            if b.rank() == 1 && step == s {
                Err(Error::Resource(format!("injected EMFILE at {s}")))
            } else {
                Ok(())
            }
        };
        fail("start")?;
        b.allgather(&ctx.tag("one"), b"1")?;
        fail("between")?;
        b.barrier(&ctx.tag("two"))?;
        let opened = MemDriver.open(ctx)?;
        fail("after")?;
        Ok(opened)
    }
}

fn main() {
    let b = match MpiBootstrap::from_env() {
        Ok(Some(b)) => b,
        Ok(None) => {
            println!("mpi_open_failure: not under an MPI launcher, nothing to do");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let s = Session::builder()
        .driver(Flaky)
        .bootstrap(Box::new(b))
        .build()
        .unwrap();
    assert!(s.size() >= 2, "run with at least 2 ranks");
    let me = s.rank();
    for step in ["start", "between", "after"] {
        let t = std::time::Instant::now();
        let r = s.open_channel_with(ChannelConfig::parse(step, "flaky").unwrap());
        match (me, r) {
            (1, Err(e)) => assert!(e.to_string().contains("injected"), "{e}"),
            (
                _,
                Err(Error::RemoteFailure {
                    rank: 1, message, ..
                }),
            ) if message.contains("injected EMFILE") => {}
            (_, other) => panic!("rank {me}, {step}: {:?}", other.map(drop)),
        }
        println!("rank {me}: {step}: failed as expected in {:?}", t.elapsed());
        // The job's collectives are still in step after each failed open.
        s.bootstrap().barrier(&format!("after-{step}")).unwrap();
    }
    // And a channel opens afterwards.
    s.open_channel_with(ChannelConfig::parse("fine", "flaky").unwrap())
        .unwrap();
    println!("rank {me}: MPI-OPEN-FAILURE-OK");
}
