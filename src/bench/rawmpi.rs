//! Raw MPI baseline (feature `bench-mpi`): blocking `MPI_Send` / `MPI_Recv` on
//! `MPI_COMM_WORLD` through rsmpi, in a process whose MPI the session's `MpiBootstrap` started.

use mad_core::{Error, Result};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::net::Net;

/// Raw MPI point-to-point on the world communicator.
pub struct RawMpi {
    world: SimpleCommunicator,
}

impl RawMpi {
    /// Needs MPI initialised (the session was built under `mpiexec` with the MPI bootstrap).
    pub fn open() -> Result<RawMpi> {
        if !mpi::environment::is_initialized() {
            return Err(Error::Unavailable {
                driver: "raw-mpi".into(),
                reason: "MPI is not initialised: start mad-bench with mpiexec".into(),
            });
        }
        Ok(RawMpi {
            world: SimpleCommunicator::world(),
        })
    }
}

impl Net for RawMpi {
    fn send(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        self.world.process_at_rank(peer as i32).send(msg);
        Ok(())
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        let st = self.world.process_at_rank(peer as i32).receive_into(buf);
        if st.count(u8::equivalent_datatype()) as usize != buf.len() {
            return Err(Error::protocol(peer, "raw mpi: message of the wrong size"));
        }
        Ok(())
    }

    fn send_rpc(&mut self, peer: usize, body: &[u8]) -> Result<()> {
        let p = self.world.process_at_rank(peer as i32);
        p.send(&(body.len() as u64));
        p.send(body);
        Ok(())
    }

    fn recv_rpc(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize> {
        let p = self.world.process_at_rank(peer as i32);
        let (n, _) = p.receive::<u64>();
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= buf.len())
            .ok_or_else(|| Error::protocol(peer, "raw mpi: RPC body too large"))?;
        p.receive_into(&mut buf[..n]);
        Ok(n)
    }
}
