//! The benchmark patterns, shaped like the OSU micro-benchmarks. Each runs on both ranks of a
//! pair (the `initiator` is the lower rank) and returns its figure on the initiator.

use std::time::Instant;

use mad_core::{Error, Result};

use super::net::Net;

/// Messages per window in the bandwidth patterns (OSU's default).
pub const WINDOW: usize = 64;

/// Warm-up and measured iteration counts of one measurement.
#[derive(Clone, Copy, Debug)]
pub struct Counts {
    /// Iterations run before the clock starts.
    pub warm: usize,
    /// Iterations timed.
    pub iters: usize,
}

/// Run `step` `c.warm + c.iters` times; the seconds the last `c.iters` took.
fn timed(c: Counts, mut step: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..c.warm {
        step()?;
    }
    let t0 = Instant::now();
    for _ in 0..c.iters {
        step()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Blocking ping-pong: returns the one-way latency in microseconds (round trip / 2). The
/// initiator checks that the echoed bytes are the ones it sent.
pub fn latency(
    net: &mut dyn Net,
    peer: usize,
    initiator: bool,
    n: usize,
    c: Counts,
    sbuf: &[u8],
    rbuf: &mut [u8],
) -> Result<f64> {
    let (s, r) = (&sbuf[..n], &mut rbuf[..n]);
    let us = match net.pingpong(peer, initiator, c.warm, c.iters, s, r) {
        Some(t) => t? / c.iters as f64 / 2.0 * 1e6,
        None => latency_nocheck(net, peer, initiator, n, c, s, r)?,
    };
    if initiator && r != s {
        return Err(Error::protocol(
            peer,
            format!("latency: the echoed {n}-byte message differs from the one sent"),
        ));
    }
    Ok(us)
}

/// RPC: an EXPRESS header giving the size of a CHEAPER body, answered by an empty RPC.
/// Returns the round-trip time in microseconds.
pub fn rpc(
    net: &mut dyn Net,
    peer: usize,
    initiator: bool,
    n: usize,
    c: Counts,
    sbuf: &[u8],
    rbuf: &mut [u8],
) -> Result<f64> {
    let t = timed(c, || {
        if initiator {
            net.send_rpc(peer, &sbuf[..n])?;
            let got = net.recv_rpc(peer, rbuf)?;
            if got != 0 {
                return Err(Error::protocol(peer, "rpc: reply has a body"));
            }
        } else {
            let got = net.recv_rpc(peer, rbuf)?;
            if got != n {
                return Err(Error::protocol(
                    peer,
                    format!("rpc: body of {got} bytes, expected {n}"),
                ));
            }
            net.send_rpc(peer, &[])?;
        }
        Ok(())
    })?;
    Ok(t / c.iters as f64 * 1e6)
}

/// One side of a streaming window: the sender sends `WINDOW` messages then waits for a 1-byte
/// acknowledgement, `c.warm + c.iters` times. Returns the bytes moved per second (sender) or
/// the receiver's elapsed time after warm-up, in seconds, as `(MB/s, seconds)`.
pub fn window(
    net: &mut dyn Net,
    peer: usize,
    sender: bool,
    n: usize,
    c: Counts,
    sbuf: &[u8],
    rbuf: &mut [u8],
) -> Result<(f64, f64)> {
    let mut ack = [0u8; 1];
    let t = timed(c, || {
        if sender {
            for _ in 0..WINDOW {
                net.send(peer, &sbuf[..n])?;
            }
            net.recv(peer, &mut ack)?;
        } else {
            for _ in 0..WINDOW {
                net.recv(peer, &mut rbuf[..n])?;
            }
            net.send(peer, &ack)?;
        }
        Ok(())
    })?;
    let bytes = (n * WINDOW * c.iters) as f64;
    Ok((bytes / t / 1e6, t))
}

/// Bandwidth (`osu_bw`): MB/s on the initiator.
pub fn bw(
    net: &mut dyn Net,
    peer: usize,
    initiator: bool,
    n: usize,
    c: Counts,
    sbuf: &[u8],
    rbuf: &mut [u8],
) -> Result<f64> {
    Ok(window(net, peer, initiator, n, c, sbuf, rbuf)?.0)
}

/// Bidirectional bandwidth (`osu_bibw`) with two threads per side: `a` carries the
/// initiator's data (and its acknowledgements), `b` the other side's. Total MB/s on the
/// initiator (both directions' bytes over the longer thread's time).
pub fn bibw(
    a: &mut dyn Net,
    b: &mut dyn Net,
    peer: usize,
    initiator: bool,
    n: usize,
    c: Counts,
    bufs: [(&[u8], &mut [u8]); 2],
) -> Result<f64> {
    let [(s0, r0), (s1, r1)] = bufs;
    let (ra, rb) = std::thread::scope(|sc| {
        let ha = sc.spawn(|| window(a, peer, initiator, n, c, s0, r0));
        let rb = window(b, peer, !initiator, n, c, s1, r1);
        let ra = ha
            .join()
            .map_err(|_| Error::BadConfig("bibw: a thread panicked".into()));
        (ra, rb)
    });
    let (ta, tb) = (ra??.1, rb?.1);
    Ok(2.0 * (n * WINDOW * c.iters) as f64 / ta.max(tb) / 1e6)
}

/// Multi-threaded latency (`osu_latency_mt`): two threads per side ping-pong at once, `a` and
/// `b` being each thread's endpoint (the same channel for Madeleine). Mean one-way µs.
pub fn latency_mt(
    a: &mut dyn Net,
    b: &mut dyn Net,
    peer: usize,
    initiator: bool,
    n: usize,
    c: Counts,
    bufs: [(&[u8], &mut [u8]); 2],
) -> Result<f64> {
    let [(s0, r0), (s1, r1)] = bufs;
    let (ra, rb) = std::thread::scope(|sc| {
        let ha = sc.spawn(|| latency_nocheck(a, peer, initiator, n, c, s0, r0));
        let rb = latency_nocheck(b, peer, initiator, n, c, s1, r1);
        let ra = ha
            .join()
            .map_err(|_| Error::BadConfig("latency_mt: a thread panicked".into()));
        (ra, rb)
    });
    Ok((ra?? + rb?) / 2.0)
}

/// Ping-pong without comparing the echoed bytes ([`latency`] compares them; in `latency_mt`
/// replies may be served to the other thread of the side): one-way µs.
fn latency_nocheck(
    net: &mut dyn Net,
    peer: usize,
    initiator: bool,
    n: usize,
    c: Counts,
    sbuf: &[u8],
    rbuf: &mut [u8],
) -> Result<f64> {
    let t = timed(c, || {
        if initiator {
            net.send(peer, &sbuf[..n])?;
            net.recv(peer, &mut rbuf[..n])
        } else {
            net.recv(peer, &mut rbuf[..n])?;
            net.send(peer, &rbuf[..n])
        }
    })?;
    Ok(t / c.iters as f64 / 2.0 * 1e6)
}

/// Messages per burst in [`cpu`].
pub const BURST: usize = 32;

/// Which side [`cpu`] times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The sender's `BURST` sends, without waiting for the receiver.
    Send,
    /// The receiver's `BURST` receives of messages that were all sent before it starts.
    Recv,
}

/// Processor time per message of one side alone (`cpu_send`, `cpu_recv`): each iteration, one
/// side sends a burst of [`BURST`] messages of `n` bytes, the other receives them. `Send`: the
/// initiator sends and times its sends, the peer receives, then both meet at `sync`. `Recv`:
/// the peer sends, both meet at `sync` (every message has left), then the initiator times its
/// receives. Microseconds per message on the initiator (a burst must fit the transport's
/// buffers, or the sends wait for the receiver).
#[allow(clippy::too_many_arguments)]
pub fn cpu(
    net: &mut dyn Net,
    peer: usize,
    initiator: bool,
    side: Side,
    n: usize,
    c: Counts,
    sbuf: &[u8],
    rbuf: &mut [u8],
    sync: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    let mut secs = 0.0;
    for i in 0..c.warm + c.iters {
        if side == Side::Recv {
            if !initiator {
                for _ in 0..BURST {
                    net.send(peer, &sbuf[..n])?;
                }
            }
            sync()?;
        }
        let t0 = Instant::now();
        match (side, initiator) {
            (Side::Send, true) => {
                for _ in 0..BURST {
                    net.send(peer, &sbuf[..n])?;
                }
            }
            (Side::Send, false) | (Side::Recv, true) => {
                for _ in 0..BURST {
                    net.recv(peer, &mut rbuf[..n])?;
                }
            }
            (Side::Recv, false) => {}
        }
        if i >= c.warm {
            secs += t0.elapsed().as_secs_f64();
        }
        if side == Side::Send {
            sync()?;
        }
    }
    Ok(secs / (c.iters * BURST) as f64 * 1e6)
}

/// The processor time of one poll that finds nothing (`poll`): the initiator polls its peer
/// `c.warm + c.iters` times while the peer sends nothing, then both meet at `sync`.
/// Microseconds per poll on the initiator; `None` on the peer and for an endpoint without such
/// a poll ([`Net::poll_idle`]).
pub fn poll(
    net: &mut dyn Net,
    peer: usize,
    initiator: bool,
    c: Counts,
    sync: &mut dyn FnMut() -> Result<()>,
) -> Result<Option<f64>> {
    let v = if initiator && net.poll_idle(peer).transpose()?.is_some() {
        let t = timed(c, || net.poll_idle(peer).unwrap_or(Ok(())))?;
        Some(t / c.iters as f64 * 1e6)
    } else {
        None
    };
    sync()?;
    Ok(v)
}

/// memcpy of `n` bytes: microseconds per copy.
pub fn memcpy(n: usize, c: Counts, sbuf: &[u8], rbuf: &mut [u8]) -> f64 {
    let t = timed(c, || {
        rbuf[..n].copy_from_slice(std::hint::black_box(&sbuf[..n]));
        std::hint::black_box(&mut rbuf[..n]);
        Ok(())
    });
    t.unwrap_or(f64::NAN) / c.iters as f64 * 1e6
}
