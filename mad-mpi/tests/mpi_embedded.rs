//! An MPI application that embeds Madeleine: the test program owns MPI. Run under a launcher:
//!
//! ```text
//! mpiexec.mpich -n 2 target-mpich/debug/deps/mpi_embedded-*
//! mpirun.openmpi --allow-run-as-root --oversubscribe -n 4 target-openmpi/debug/deps/mpi_embedded-*
//! ```
//!
//! The program calls `MPI_Init_thread` itself, runs collectives of its own on `MPI_COMM_WORLD`
//! and on a communicator it split (ranks reversed, and two halves from 4 ranks on, so session
//! ranks differ from world ranks), builds a session and an MPI channel over that communicator
//! (`MpiBootstrap::from_communicator`, `MpiDriver::from_communicator`), exchanges a message
//! with an EXPRESS piece and a CHEAPER piece larger than any eager threshold both ways, drops
//! them, checks that `MPI_COMM_WORLD` and its own communicator still have
//! `MPI_ERRORS_ARE_FATAL` and still work, that MPI is not finalised, and finalises MPI itself.
//! Rank 0 prints `mpi_embedded: all checks passed on N ranks`, which `.ci/mpi.sh` checks.
//!
//! Started without a launcher (plain `cargo test`), it checks only that both constructors
//! fail with `Error::Unavailable` while MPI is not initialised, and does not initialise MPI.

use std::ffi::c_int;

use mad_core::{Error, ErrorKind, RecvMode, Result, SendMode, Session};
use mad_mpi::mpi::ffi;
use mad_mpi::mpi::raw::AsRaw;
use mad_mpi::{MpiBootstrap, MpiDriver};

/// The application's own communicator handle.
struct AppComm(ffi::MPI_Comm);

// SAFETY: the handle is a communicator of this process (or MPI_COMM_NULL, which the
// constructors under test must refuse), valid while the value is used.
unsafe impl AsRaw for AppComm {
    type Raw = ffi::MPI_Comm;
    fn as_raw(&self) -> ffi::MPI_Comm {
        self.0
    }
}

fn check(cond: bool, what: &str) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::protocol(usize::MAX, format!("check failed: {what}")))
    }
}

fn mpi_ok(rc: c_int, what: &str) -> Result<()> {
    check(rc == 0, &format!("{what} returned {rc}"))
}

fn world() -> ffi::MPI_Comm {
    // SAFETY: reading a link-time constant exported by the rsmpi shim.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

fn rank_size(c: ffi::MPI_Comm) -> Result<(usize, usize)> {
    let (mut r, mut s): (c_int, c_int) = (0, 0);
    // SAFETY: `c` is a valid communicator; valid out-pointers.
    mpi_ok(unsafe { ffi::MPI_Comm_rank(c, &mut r) }, "MPI_Comm_rank")?;
    // SAFETY: as above.
    mpi_ok(unsafe { ffi::MPI_Comm_size(c, &mut s) }, "MPI_Comm_size")?;
    Ok((r as usize, s as usize))
}

/// `MPI_Allreduce(MPI_SUM)` of one `i32` on `c`.
fn allreduce_sum(c: ffi::MPI_Comm, v: i32) -> Result<i32> {
    let mut out: i32 = 0;
    // SAFETY: one i32 in, one out, valid for the blocking call; predefined type and op.
    let rc = unsafe {
        ffi::MPI_Allreduce(
            (&v as *const i32).cast(),
            (&mut out as *mut i32).cast(),
            1,
            ffi::RSMPI_INT32_T,
            ffi::RSMPI_SUM,
            c,
        )
    };
    mpi_ok(rc, "MPI_Allreduce")?;
    Ok(out)
}

/// Whether `c`'s error handler is `MPI_ERRORS_ARE_FATAL` (the handle obtained is freed).
fn errors_are_fatal(c: ffi::MPI_Comm) -> Result<bool> {
    // SAFETY: reading a link-time constant exported by the rsmpi shim (a placeholder, which
    // MPI_Comm_get_errhandler overwrites).
    let mut h = unsafe { ffi::RSMPI_ERRORS_RETURN };
    // SAFETY: valid communicator and out-pointer.
    let rc = unsafe { ffi::MPI_Comm_get_errhandler(c, &mut h) };
    mpi_ok(rc, "MPI_Comm_get_errhandler")?;
    // SAFETY: reading a link-time constant exported by the rsmpi shim.
    let fatal = h == unsafe { ffi::RSMPI_ERRORS_ARE_FATAL };
    // SAFETY: `h` was returned by MPI_Comm_get_errhandler, which the caller must free.
    let rc = unsafe { ffi::MPI_Errhandler_free(&mut h) };
    mpi_ok(rc, "MPI_Errhandler_free")?;
    Ok(fatal)
}

fn is_unavailable<T>(r: &Result<T>) -> bool {
    matches!(r, Err(Error::Unavailable { .. }))
}

fn mpi_initialized() -> bool {
    let mut f: c_int = 0;
    // SAFETY: MPI_Initialized may be called before MPI_Init; valid out-pointer.
    unsafe { ffi::MPI_Initialized(&mut f) };
    f != 0
}

fn mpi_finalized() -> bool {
    let mut f: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time; valid out-pointer.
    unsafe { ffi::MPI_Finalized(&mut f) };
    f != 0
}

/// Before `MPI_Init`: both constructors refuse, and do not initialise MPI.
fn before_init() -> Result<()> {
    check(!mpi_initialized(), "MPI not initialised yet")?;
    let w = AppComm(world());
    check(
        is_unavailable(&MpiBootstrap::from_communicator(&w)),
        "MpiBootstrap::from_communicator before MPI_Init: Unavailable",
    )?;
    check(
        is_unavailable(&MpiDriver::from_communicator(&w)),
        "MpiDriver::from_communicator before MPI_Init: Unavailable",
    )?;
    check(
        !mpi_initialized(),
        "the constructors did not initialise MPI",
    )
}

/// Session rank `r` sends to `r ^ 1`: EXPRESS (its world rank, the CHEAPER length), then
/// CHEAPER bytes; the peer checks them and sends them back the same way.
fn exchange(session: &Session, world_of: &[i32], my_world: i32) -> Result<()> {
    let ch = session.open_channel_with(mad_core::ChannelConfig::parse("embedded", "mpi")?)?;
    let me = session.rank();
    let peer = me ^ 1;
    if peer >= session.size() {
        return Ok(());
    }
    // Larger than every eager threshold of the driver (EAGER_MAX, the eager buffers) and of
    // both MPIs' eager protocols.
    let n = (1usize << 20) + 13;
    let data: Vec<u8> = (0..n).map(|i| (i * 31 + me) as u8).collect();
    let send = |payload: &[u8]| -> Result<()> {
        let mut p = ch.begin_packing(peer)?;
        p.pack_value(&[my_world as u64, payload.len() as u64], RecvMode::Express)?;
        p.pack(payload, RecvMode::Cheaper)?;
        p.end_packing()
    };
    let recv = || -> Result<Vec<u8>> {
        let mut u = ch.begin_unpacking_from(peer)?;
        let [from, len]: [u64; 2] = u.unpack_value()?;
        check(
            from == world_of[peer] as u64,
            "EXPRESS: the sender is the world rank of that session rank",
        )?;
        check(len as usize == n, "EXPRESS: length")?;
        let mut got = vec![0u8; len as usize];
        u.unpack(&mut got, SendMode::Cheaper)?;
        u.end_unpacking()?;
        Ok(got)
    };
    if me % 2 == 0 {
        send(&data)?;
        check(recv()? == data, "CHEAPER echo intact")?;
    } else {
        let got = recv()?;
        let expect: Vec<u8> = (0..n).map(|i| (i * 31 + peer) as u8).collect();
        check(got == expect, "CHEAPER data intact")?;
        send(&got)?;
    }
    drop(ch);
    Ok(())
}

fn run() -> Result<()> {
    if mad_mpi::launcher::detect_from_env()?.is_none() {
        before_init()?;
        println!("mpi_embedded: not under an MPI launcher: constructors refuse before MPI_Init");
        return Ok(());
    }
    before_init()?;
    let mut provided: c_int = 0;
    // SAFETY: called once, before any other MPI call but MPI_Initialized; valid out-pointer.
    let rc = unsafe {
        ffi::MPI_Init_thread(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            ffi::RSMPI_THREAD_MULTIPLE,
            &mut provided,
        )
    };
    mpi_ok(rc, "MPI_Init_thread")?;
    let (wrank, wsize) = rank_size(world())?;
    check(wsize >= 2, "at least 2 ranks")?;
    check(
        errors_are_fatal(world())?,
        "world: ERRORS_ARE_FATAL at start",
    )?;
    // Own MPI traffic before: world and a split of our own (reversed ranks; two halves from
    // 4 ranks on, each half at least 2 ranks).
    let sum = allreduce_sum(world(), wrank as i32)?;
    check(sum as usize == wsize * (wsize - 1) / 2, "world allreduce")?;
    let color = if wsize >= 4 { (wrank % 2) as c_int } else { 0 };
    // SAFETY: reading a link-time constant exported by the rsmpi shim.
    let mut sub = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: valid communicator and out-pointer; collective over the world.
    let rc = unsafe { ffi::MPI_Comm_split(world(), color, (wsize - wrank) as c_int, &mut sub) };
    mpi_ok(rc, "MPI_Comm_split")?;
    let (srank, ssize) = rank_size(sub)?;
    let sub_sum = allreduce_sum(sub, wrank as i32 + 1)?;
    let mut world_of = vec![0i32; ssize];
    let me = wrank as i32;
    // SAFETY: one i32 in, `ssize` out (`world_of` has that many), blocking call.
    let rc = unsafe {
        ffi::MPI_Allgather(
            (&me as *const i32).cast(),
            1,
            ffi::RSMPI_INT32_T,
            world_of.as_mut_ptr().cast(),
            1,
            ffi::RSMPI_INT32_T,
            sub,
        )
    };
    mpi_ok(rc, "MPI_Allgather")?;

    // Bad input is a typed error.
    check(
        matches!(
            MpiBootstrap::from_communicator(&AppComm(
                // SAFETY: reading a link-time constant exported by the rsmpi shim.
                unsafe { ffi::RSMPI_COMM_NULL }
            )),
            Err(Error::BadConfig(_))
        ),
        "MPI_COMM_NULL refused with BadConfig",
    )?;
    check(
        matches!(
            MpiDriver::from_communicator(&AppComm(
                // SAFETY: as above.
                unsafe { ffi::RSMPI_COMM_NULL }
            )),
            Err(Error::BadConfig(_))
        ),
        "MPI_COMM_NULL refused with BadConfig (driver)",
    )?;

    // Madeleine over the application's communicator.
    {
        let app = AppComm(sub);
        let session = Session::builder()
            .driver(MpiDriver::from_communicator(&app)?)
            .bootstrap(Box::new(MpiBootstrap::from_communicator(&app)?))
            .build()?;
        check(
            session.rank() == srank && session.size() == ssize,
            "session rank and size are the communicator's",
        )?;
        check(
            world_of[session.rank()] == wrank as i32,
            "session rank maps back to this world rank",
        )?;
        // Application traffic while the session is up.
        check(
            allreduce_sum(world(), 1)? as usize == wsize,
            "world allreduce during the session",
        )?;
        exchange(&session, &world_of, wrank as i32)?;
        // A second channel, with a bootstrap-free driver check: the world driver refuses a
        // session over a sub-communicator of a smaller size.
        if ssize != wsize {
            let s2 = Session::builder()
                .driver(MpiDriver::new())
                .bootstrap(Box::new(MpiBootstrap::from_communicator(&app)?))
                .build()?;
            let r = s2.open_channel_with(mad_core::ChannelConfig::parse("w", "mpi")?);
            check(
                match r {
                    Err(e) => {
                        e.kind() == ErrorKind::Unavailable
                            || e.remote_kind() == Some(ErrorKind::Unavailable)
                    }
                    Ok(_) => false,
                },
                "a world driver under a sub-communicator session is Unavailable",
            )?;
        }
        if wrank == 0 {
            println!(
                "mpi_embedded: session over the application's communicator: world rank {wrank} \
                 is session rank {} of {}",
                session.rank(),
                session.size()
            );
        }
    }

    // After: our communicators and error handlers are as the application left them.
    check(!mpi_finalized(), "mad-mpi did not finalise MPI")?;
    check(errors_are_fatal(world())?, "world: still ERRORS_ARE_FATAL")?;
    check(
        errors_are_fatal(sub)?,
        "own communicator: still ERRORS_ARE_FATAL",
    )?;
    check(
        allreduce_sum(sub, wrank as i32 + 1)? == sub_sum,
        "own communicator still works",
    )?;
    check(
        allreduce_sum(world(), wrank as i32)? == sum,
        "world still works",
    )?;
    // SAFETY: `sub` is ours, created by MPI_Comm_split above; collective.
    mpi_ok(unsafe { ffi::MPI_Comm_free(&mut sub) }, "MPI_Comm_free")?;
    if wrank == 0 {
        println!("mpi_embedded: all checks passed on {wsize} ranks");
    }
    // SAFETY: every MPI object of ours is freed; called once.
    mpi_ok(unsafe { ffi::MPI_Finalize() }, "MPI_Finalize")?;
    check(
        is_unavailable(&MpiBootstrap::from_communicator(&AppComm(world()))),
        "after MPI_Finalize: Unavailable",
    )
}

fn main() {
    if let Err(e) = run() {
        eprintln!("mpi_embedded FAILED: {e}");
        std::process::exit(1);
    }
}
