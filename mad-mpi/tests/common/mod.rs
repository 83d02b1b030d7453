//! A minimal stand-in for the core's pack/unpack engine, driving `TxLink`/`RxLink` directly
//! in the order the core does (copy pieces through TM 0, commit, gather groups through TM 1,
//! end of message), with a bounded wait. Used by the MPI job test.

#![allow(dead_code)]

use std::io::{IoSlice, IoSliceMut};
use std::task::Poll;
use std::time::{Duration, Instant};

use mad_core::driver::{RxLink, TxLink};
use mad_core::{Error, Result};

/// How long any single operation may wait before the test fails.
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Poll `f` until ready (busy for a while, then through `wait`), failing after [`OP_TIMEOUT`].
pub fn drive<S: ?Sized, T>(
    s: &mut S,
    mut f: impl FnMut(&mut S) -> Result<Poll<T>>,
    mut wait: impl FnMut(&mut S, Duration) -> Result<()>,
) -> Result<T> {
    // The clock is read only on the slow path (it costs about 40 ns here).
    if let Poll::Ready(v) = f(s)? {
        return Ok(v);
    }
    let start = Instant::now();
    let mut i: u32 = 0;
    loop {
        if let Poll::Ready(v) = f(s)? {
            return Ok(v);
        }
        i = i.wrapping_add(1);
        if i % 1024 == 0 {
            if start.elapsed() > OP_TIMEOUT {
                return Err(Error::Timeout(OP_TIMEOUT));
            }
            if i > 1 << 16 {
                wait(s, Duration::from_millis(1))?;
            }
        }
    }
}

/// One piece of a message.
pub enum Piece<'a> {
    /// Copied through TM 0.
    Copy(&'a [u8]),
    /// A gather group through TM 1.
    Group(Vec<&'a [u8]>),
}

/// Send one message.
pub fn send(tx: &mut dyn TxLink, pieces: &[Piece<'_>]) -> Result<()> {
    tx.begin_message()?;
    let mut last: Option<u8> = None;
    for p in pieces {
        let tm = match p {
            Piece::Copy(_) => 0,
            Piece::Group(_) => 1,
        };
        if let Some(l) = last {
            if l != tm {
                drive(tx, |t| t.commit(l), |t, d| t.wait(d))?;
            }
        }
        last = Some(tm);
        match p {
            Piece::Copy(data) => {
                let mut off = 0;
                while off < data.len() {
                    drive(
                        tx,
                        |t| {
                            t.with_buffer(0, data.len() - off, &mut |b: &mut [u8]| {
                                let n = b.len().min(data.len() - off);
                                b[..n].copy_from_slice(&data[off..off + n]);
                                off += n;
                                n
                            })
                        },
                        |t, d| t.wait(d),
                    )?;
                }
            }
            Piece::Group(g) => {
                let iov: Vec<IoSlice<'_>> = g.iter().map(|s| IoSlice::new(s)).collect();
                drive(tx, |t| t.send_refs(1, &iov), |t, d| t.wait(d))?;
            }
        }
    }
    drive(tx, |t| t.end_message(), |t, d| t.wait(d))
}

/// Where one received piece goes.
pub enum Dest<'a> {
    /// Copied out of TM 0.
    Copy(&'a mut [u8]),
    /// A scatter group through TM 1.
    Group(Vec<&'a mut [u8]>),
}

/// Receive one message.
pub fn recv(rx: &mut dyn RxLink, dests: &mut [Dest<'_>]) -> Result<()> {
    drive(rx, |r| r.poll_message(), |r, d| r.wait(d))?;
    let mut last: Option<u8> = None;
    for d in dests.iter_mut() {
        let tm = match d {
            Dest::Copy(_) => 0,
            Dest::Group(_) => 1,
        };
        if let Some(l) = last {
            if l != tm {
                rx.checkout(l)?;
            }
        }
        last = Some(tm);
        match d {
            Dest::Copy(buf) => {
                let mut off = 0;
                let len = buf.len();
                while off < len {
                    drive(
                        rx,
                        |r| {
                            r.with_data(0, len - off, &mut |b: &[u8]| {
                                let n = b.len().min(len - off);
                                buf[off..off + n].copy_from_slice(&b[..n]);
                                off += n;
                                n
                            })
                        },
                        |r, d| r.wait(d),
                    )?;
                }
            }
            Dest::Group(g) => {
                let mut iov: Vec<IoSliceMut<'_>> =
                    g.iter_mut().map(|s| IoSliceMut::new(s)).collect();
                drive(rx, |r| r.recv_refs(1, &mut iov), |r, d| r.wait(d))?;
            }
        }
    }
    if let Some(l) = last {
        rx.checkout(l)?;
    }
    rx.end_message()
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
