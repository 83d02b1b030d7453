//! Raw MPI baselines (feature `bench-mpi`): blocking `MPI_Send` / `MPI_Recv` on
//! `MPI_COMM_WORLD` through rsmpi, in a process whose MPI the session's `MpiBootstrap` started.
//!
//! Two RPC idioms of pure MPI, the two ways an MPI programmer sends "a header saying how big the
//! body is, then the body":
//!
//! * `raw-mpi` ([`RpcIdiom::TwoMessages`]): the header (8 bytes) and the body as two messages;
//!   the receiver receives the header, then the body of the size it read straight into its
//!   buffer.
//! * `raw-mpi-packed` ([`RpcIdiom::Packed`]): the sender copies header and body into one buffer
//!   and sends one message; the receiver learns its size with `MPI_Mprobe` + `MPI_Get_count`,
//!   receives it whole with `MPI_Mrecv` into a buffer of that size (reused) and uses the body
//!   where it landed, after the header (no copy out).
//!
//! `raw-mpi-test` is `raw-mpi` whose receives are `MPI_Irecv` completed by `MPI_Test` in a loop
//! ([`RecvWait::Test`]): the non-blocking style a driver that must not block uses.
//!
//! Each endpoint uses its own tag on the world communicator, so two endpoints (the two
//! connections of the two-thread patterns) never take each other's messages. mad-mpi's
//! bootstrap and channels use duplicates of the world communicator: no interference.
//! (rsmpi's world handle is a constant; holding no communicator keeps the endpoint `Send` with
//! Open MPI, whose handles are pointers.)

use std::sync::atomic::{AtomicI32, Ordering};

use mad_core::{Error, Result};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::net::Net;

/// How an RPC travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RpcIdiom {
    /// Header then body, two messages.
    TwoMessages,
    /// Header and body copied into one message, received with matched probe + get count.
    Packed,
}

/// How a raw MPI endpoint receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvWait {
    /// Blocking `MPI_Recv`.
    Blocking,
    /// `MPI_Irecv`, then `MPI_Test` in a loop: the style of a driver that must not block
    /// (`raw-mpi-test`).
    Test,
}

/// Next endpoint tag (every rank opens its endpoints in the same order, so tags agree).
static NEXT_TAG: AtomicI32 = AtomicI32::new(0x5100);

/// Raw MPI point-to-point on the world communicator, one tag per endpoint.
pub struct RawMpi {
    tag: i32,
    idiom: RpcIdiom,
    wait: RecvWait,
    /// The packed idiom's send and receive buffers (grown once, reused).
    stage_out: Vec<u8>,
    stage_in: Vec<u8>,
}

impl RawMpi {
    /// Needs MPI initialised (the session was built under `mpiexec` with the MPI bootstrap).
    pub fn open(idiom: RpcIdiom, wait: RecvWait) -> Result<RawMpi> {
        if !mpi::environment::is_initialized() {
            return Err(Error::unavailable(
                "raw-mpi",
                "MPI is not initialised: start mad-bench with mpiexec",
            ));
        }
        Ok(RawMpi {
            tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed),
            idiom,
            wait,
            stage_out: Vec::new(),
            stage_in: Vec::new(),
        })
    }
}

fn world() -> SimpleCommunicator {
    SimpleCommunicator::world()
}

impl RawMpi {
    /// Receive into `buf` from `peer` on this endpoint's tag, as `self.wait` says; the count.
    fn receive(&self, peer: usize, buf: &mut [u8]) -> usize {
        let w = world();
        let p = w.process_at_rank(peer as i32);
        let st = match self.wait {
            RecvWait::Blocking => p.receive_into_with_tag(buf, self.tag),
            RecvWait::Test => mpi::request::scope(|sc| {
                let mut req = p.immediate_receive_into_with_tag(sc, buf, self.tag);
                loop {
                    match req.test() {
                        Ok(st) => break st,
                        Err(r) => req = r,
                    }
                }
            }),
        };
        usize::try_from(st.count(u8::equivalent_datatype())).unwrap_or(usize::MAX)
    }
}

impl Net for RawMpi {
    fn poll_idle(&mut self, peer: usize) -> Option<Result<()>> {
        let w = world();
        let probe = w
            .process_at_rank(peer as i32)
            .immediate_probe_with_tag(self.tag);
        Some(match probe {
            None => Ok(()),
            Some(_) => Err(Error::protocol(
                peer,
                "poll: a message arrived while none was sent",
            )),
        })
    }

    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        world()
            .process_at_rank(peer as i32)
            .send_with_tag(msg, self.tag);
        Ok(())
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        if self.receive(peer, buf) != buf.len() {
            return Err(Error::protocol(peer, "raw mpi: message of the wrong size"));
        }
        Ok(())
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        let w = world();
        let p = w.process_at_rank(peer as i32);
        let h = (body.len() as u64).to_le_bytes();
        match self.idiom {
            RpcIdiom::TwoMessages => {
                p.send_with_tag(&h[..], self.tag);
                p.send_with_tag(body, self.tag);
            }
            RpcIdiom::Packed => {
                self.stage_out.clear();
                self.stage_out.extend_from_slice(&h);
                self.stage_out.extend_from_slice(body);
                p.send_with_tag(&self.stage_out[..], self.tag);
            }
        }
        Ok(())
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let w = world();
        let p = w.process_at_rank(peer as i32);
        let too_large = || Error::protocol(peer, "raw mpi: RPC body too large");
        match self.idiom {
            RpcIdiom::TwoMessages => {
                let mut h = [0u8; 8];
                if self.receive(peer, &mut h) != 8 {
                    return Err(Error::protocol(peer, "raw mpi: bad RPC header"));
                }
                let n = usize::try_from(u64::from_le_bytes(h))
                    .ok()
                    .filter(|&n| n <= buf.len())
                    .ok_or_else(too_large)?;
                self.receive(peer, &mut buf[..n]);
                Ok(n)
            }
            RpcIdiom::Packed => {
                let (msg, st) = p.matched_probe_with_tag(self.tag);
                let count = usize::try_from(st.count(u8::equivalent_datatype()))
                    .ok()
                    .filter(|&c| c >= 8 && c - 8 <= buf.len());
                // A matched message must be received even when it is refused.
                let Some(count) = count else {
                    let mut sink = vec![0u8; st.count(u8::equivalent_datatype()).max(0) as usize];
                    msg.matched_receive_into(&mut sink[..]);
                    return Err(too_large());
                };
                if self.stage_in.len() < count {
                    self.stage_in.resize(count, 0);
                }
                msg.matched_receive_into(&mut self.stage_in[..count]);
                let mut h = [0u8; 8];
                h.copy_from_slice(&self.stage_in[..8]);
                let n = usize::try_from(u64::from_le_bytes(h))
                    .ok()
                    .filter(|&n| n == count - 8)
                    .ok_or_else(|| Error::protocol(peer, "raw mpi: RPC header and size differ"))?;
                // The body is used where it landed (`stage_in[8..]`), as an MPI program would.
                Ok(n)
            }
        }
    }
}
