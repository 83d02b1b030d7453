//! The paper's Figure 1: an EXPRESS size followed by a CHEAPER array of that size.
//!
//! `cargo run --example hello` starts two processes on this host by itself;
//! `madrun -n 4 target/debug/examples/hello` runs it with four. Every rank but 0 receives an
//! array of a size it learns from the message itself.

use madeleine::cli::Cli;
use madeleine::{RecvMode, SendMode};

const CLI: Cli = Cli::new(
    "hello",
    env!("CARGO_PKG_VERSION"),
    "usage: hello                  (alone: starts 2 ranks on this host)
       madrun -n N hello

The paper's Figure 1: rank 0 sends every other rank an EXPRESS size, then a CHEAPER array of
that size. The channel is `default` (MAD_CHANNEL_DEFAULT, e.g. shm or tcp).

  -h, --help     this text
  -V, --version  the version",
);

fn main() {
    CLI.parse(|p| {
        while let Some(arg) = p.next()? {
            CLI.other(arg)?;
        }
        Ok(())
    });
    madeleine::init_logging();
    if let Err(e) = run() {
        eprintln!("hello: {e}");
        std::process::exit(1);
    }
}

fn run() -> madeleine::Result<()> {
    if let Some(code) = madeleine::run_local_if_alone(2)? {
        std::process::exit(code);
    }
    let session = madeleine::session()?;
    let ch = session.open_channel("default")?;
    if session.rank() == 0 {
        for peer in 1..session.size() {
            let array: Vec<u8> = (0..1000 * peer).map(|i| (i % 251) as u8).collect();
            let mut p = ch.begin_packing(peer)?;
            p.pack_value(&(array.len() as u64), RecvMode::Express)?; // needed before the next unpack
            p.pack(&array, RecvMode::Cheaper)?; // may be deferred, batched, zero-copy
            p.end_packing()?;
        }
        println!(
            "rank 0: sent {} arrays over `{}`",
            session.size() - 1,
            ch.config().driver
        );
    } else {
        let mut u = ch.begin_unpacking()?;
        let n: u64 = u.unpack_value()?; // EXPRESS: usable right now
        let mut array = vec![0u8; n as usize]; // allocated from what we just received
        u.unpack(&mut array, SendMode::Cheaper)?; // CHEAPER: filled by end_unpacking
        u.end_unpacking()?;
        let ok = array.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8);
        println!(
            "rank {}: received {n} bytes from rank {}, {}",
            session.rank(),
            0,
            if ok { "intact" } else { "CORRUPT" }
        );
        if !ok {
            return Err(madeleine::Error::Protocol {
                rank: 0,
                what: "array corrupted".into(),
            });
        }
    }
    Ok(())
}
