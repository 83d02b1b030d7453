//! Kit cases of the event-driven engine: readiness descriptors and their arming protocol.

use std::time::{Duration, Instant};

use super::{fail, Ctx};
use crate::driver::Armed;
use crate::error::Result;
use crate::events::wait_readable;
use crate::modes::RecvMode;

/// Longest sleep on an armed descriptor before the case calls the wake-up lost.
const LOST: Duration = Duration::from_secs(5);

/// The arming protocol over thousands of races, on drivers with a readiness descriptor: rank 1
/// sends a stream of small messages with irregular gaps while rank 0 polls until nothing is
/// ready, arms, and sleeps on the descriptor. An armed descriptor that stays quiet while a
/// message waits is a lost wake-up (the sleep would last for ever in an event loop). Then an
/// idle armed descriptor must stay quiet (a descriptor stuck readable makes every event loop
/// spin), and the peer's departure must make it readable.
pub(super) fn case_readiness(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let has_fd = ch.readiness_fd().is_some();
    c.barrier("open")?;
    if !has_fd {
        return Ok(());
    }
    let n = (c.opts.volume * 10).max(500) as u64;
    match c.rank() {
        0 => {
            let fd = ch.readiness_fd().expect("checked above");
            let (mut got, mut sleeps) = (0u64, 0u64);
            while got < n {
                if let Some(mut u) = ch.try_begin_unpacking()? {
                    let v: u64 = u.unpack_value()?;
                    u.end_unpacking()?;
                    if v != got {
                        return Err(fail(format!("message {v} arrived as number {got}")));
                    }
                    got += 1;
                    continue;
                }
                if ch.arm()? == Armed::Busy {
                    continue;
                }
                sleeps += 1;
                if wait_readable(&[fd], Some(LOST))?.is_empty() {
                    // One more look: a message waiting now was announced to nobody.
                    let waiting = ch.try_begin_unpacking()?.map(|u| {
                        drop(u.end_unpacking());
                    });
                    return Err(fail(format!(
                        "lost wake-up: the armed readiness descriptor stayed quiet for {LOST:?} \
                         after {got} of {n} messages ({sleeps} sleeps){}",
                        if waiting.is_some() {
                            " while a message was waiting"
                        } else {
                            ""
                        }
                    )));
                }
            }
            c.barrier("stream-done")?;
            // Idle: nothing is sent, so the armed descriptor must (almost) never fire.
            let t0 = Instant::now();
            let mut wakeups = 0;
            while t0.elapsed() < Duration::from_millis(300) {
                if ch.try_begin_unpacking()?.is_some() {
                    return Err(fail("a message while the peer sends nothing"));
                }
                if ch.arm()? == Armed::Busy
                    || !wait_readable(&[fd], Some(Duration::from_millis(100)))?.is_empty()
                {
                    wakeups += 1;
                }
                if wakeups > 5 {
                    return Err(fail(
                        "an idle channel's armed readiness descriptor keeps firing (an event \
                         loop sleeping on it would spin)",
                    ));
                }
            }
            c.barrier("idle-done")?;
            if !ch.capabilities().detects_peer_death || c.size() > 2 {
                return Ok(());
            }
            // The peer leaves: an armed sleeper must learn it.
            let t0 = Instant::now();
            loop {
                match ch.try_begin_unpacking() {
                    Err(_) => return Ok(()),
                    Ok(Some(_)) => return Err(fail("a message from a peer that left")),
                    Ok(None) => {}
                }
                if ch.arm()? == Armed::Armed {
                    wait_readable(&[fd], Some(Duration::from_millis(500)))?;
                }
                if t0.elapsed() > LOST {
                    return Err(fail(format!(
                        "the peer left {LOST:?} ago and the armed descriptor never said so"
                    )));
                }
            }
        }
        1 => {
            let mut rng = super::Rng(0x05ee_d0fe);
            for i in 0..n {
                let mut p = ch.begin_packing(0)?;
                p.pack_value(&i, RecvMode::Express)?;
                p.end_packing()?;
                // Irregular gaps: none, a few spins, a yield, a short sleep (the receiver is
                // caught polling, arming and sleeping).
                match rng.below(8) {
                    0..=2 => {}
                    3 | 4 => (0..rng.below(2000)).for_each(|_| std::hint::spin_loop()),
                    5 => std::thread::yield_now(),
                    _ => std::thread::sleep(Duration::from_micros(rng.below(200))),
                }
            }
            c.barrier("stream-done")?;
            c.barrier("idle-done")?;
            drop(ch);
        }
        _ => {
            c.barrier("stream-done")?;
            c.barrier("idle-done")?;
        }
    }
    Ok(())
}

/// How long a closed channel may keep a blocked call before the kit calls it stuck (the
/// target is 10 ms; the kit prints what it measured).
const CLOSE_BOUND: Duration = Duration::from_secs(1);

/// A call that `close` had to end: `Error::Closed` within [`CLOSE_BOUND`] of the close.
fn closed_in_time(r: Result<()>, closed_at: Instant, what: &str) -> Result<Duration> {
    let took = closed_at.elapsed();
    match r {
        Err(crate::Error::Closed { .. }) if took <= CLOSE_BOUND => Ok(took),
        Err(crate::Error::Closed { .. }) => Err(fail(format!(
            "{what}: freed {took:?} after close (bound {CLOSE_BOUND:?})"
        ))),
        Ok(()) => Err(fail(format!("{what}: returned Ok on a closed channel"))),
        Err(e) => Err(fail(format!("{what}: {e} instead of Closed"))),
    }
}

/// `Channel::close` frees every thread blocked on the channel (an any-source receive, a
/// receive from one peer, a message in the middle of its `end_unpacking`, on a thread other
/// than the one that began it: an `Unpacker` is `Send`) with `Error::Closed`, later calls
/// fail the same way, `Session::close` does the same for every channel it opened, and the peer sees this rank leave: its receives fail, and a sender
/// caught in the middle of a 16 MiB message fails instead of waiting (drivers that can finish
/// a connection under a peer).
pub(super) fn case_close(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "timeout_ms=20000")?;
    let mid = c.open("-mid", "timeout_ms=20000")?;
    c.barrier("open")?;
    const BODY: usize = 16 << 20;
    match c.rank() {
        0 => {
            // A message whose sender stops after its header, received on another thread.
            let mut u = mid.begin_unpacking_from(1)?;
            let n: u64 = u.unpack_value()?;
            let mut body = vec![0u8; n as usize];
            let body = &mut body;
            let (waits, mid_wait) = std::thread::scope(|s| {
                let any = s.spawn(|| ch.begin_unpacking().map(drop));
                let from = s.spawn(|| ch.begin_unpacking_from(1).map(drop));
                let body = s.spawn(move || {
                    u.unpack(body, crate::SendMode::Cheaper)?;
                    u.end_unpacking()
                });
                std::thread::sleep(Duration::from_millis(200));
                let t0 = Instant::now();
                ch.close();
                mid.close();
                let any = any.join().map_err(|_| fail("a receiver panicked"))?;
                let from = from.join().map_err(|_| fail("a receiver panicked"))?;
                let body = body.join().map_err(|_| fail("a receiver panicked"))?;
                Ok::<_, crate::Error>((
                    [
                        closed_in_time(any, t0, "begin_unpacking")?,
                        closed_in_time(from, t0, "begin_unpacking_from")?,
                    ],
                    closed_in_time(body, t0, "end_unpacking in the middle of a message")?,
                ))
            })?;
            tracing::info!(
                "kit close [{}]: blocked calls freed in {:?} (any source), {:?} (from one \
                 peer), {:?} (end_unpacking)",
                ch.config().driver,
                waits[0],
                waits[1],
                mid_wait
            );
            // Session::close closes what the session opened.
            let third = c.open("-session", "timeout_ms=20000")?;
            let blocked = std::thread::scope(|s| {
                let h = s.spawn(|| third.begin_unpacking_from(1).map(drop));
                std::thread::sleep(Duration::from_millis(50));
                let t0 = Instant::now();
                c.session.close();
                let r = h.join().map_err(|_| fail("a receiver panicked"))?;
                closed_in_time(r, t0, "begin_unpacking_from after Session::close")
            })?;
            tracing::info!("kit close: Session::close freed a blocked receive in {blocked:?}");
            for (r, what) in [
                (ch.begin_packing(1).map(drop), "begin_packing after close"),
                (
                    ch.try_begin_unpacking().map(drop),
                    "try_begin_unpacking after close",
                ),
                (
                    ch.try_begin_unpacking_from(1).map(drop),
                    "try_begin_unpacking_from after close",
                ),
            ] {
                closed_in_time(r, Instant::now(), what)?;
            }
            c.barrier("closed")?;
        }
        1 => {
            let body = vec![7u8; BODY];
            let mut p = mid.begin_packing(0)?;
            p.pack_value(&(BODY as u64), RecvMode::Express)?;
            p.flush()?;
            let third = c.open("-session", "timeout_ms=20000")?;
            c.barrier("closed")?;
            drop(third);
            if super::tears_down(&ch) {
                let sent = p
                    .pack(&body, RecvMode::Cheaper)
                    .and_then(|()| p.end_packing());
                super::failed_promptly(sent, "a 16 MiB send to a rank that closed the channel")?;
                super::failed_promptly(
                    ch.begin_unpacking_from(0).map(drop),
                    "a receive from a rank that closed the channel",
                )?;
            } else {
                drop(p);
            }
        }
        _ => {
            let _third = c.open("-session", "timeout_ms=20000")?;
            c.barrier("closed")?
        }
    }
    Ok(())
}

/// Per-call deadlines: a receive with nothing to receive gives up at its deadline with
/// `Timeout`, and the connection is intact (the next message arrives whole); a sender waiting
/// for a connection another thread holds gives up too; a deadline that expires in the middle
/// of a message from a stalled sender fails it, and the connection is finished both ways.
pub(super) fn case_deadlines(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "timeout_ms=20000")?;
    c.barrier("open")?;
    const WAIT: Duration = Duration::from_millis(100);
    let timed_out = |r: Result<()>, t0: Instant, what: &str| -> Result<()> {
        let took = t0.elapsed();
        match r {
            Err(crate::Error::Timeout(_)) if took >= WAIT && took < WAIT + CLOSE_BOUND => Ok(()),
            Err(crate::Error::Timeout(_)) => Err(fail(format!(
                "{what}: timed out after {took:?}, the deadline was {WAIT:?}"
            ))),
            Ok(()) => Err(fail(format!("{what}: returned Ok with nothing sent"))),
            Err(e) => Err(fail(format!("{what}: {e} instead of Timeout"))),
        }
    };
    match c.rank() {
        0 => {
            let t0 = Instant::now();
            timed_out(
                ch.begin_unpacking_until(t0 + WAIT).map(drop),
                t0,
                "begin_unpacking_until",
            )?;
            let t0 = Instant::now();
            timed_out(
                ch.begin_unpacking_from_until(1, t0 + WAIT).map(drop),
                t0,
                "begin_unpacking_from_until",
            )?;
            // A connection held by another thread (a packer that sends nothing: discarded).
            let ch = &ch;
            std::thread::scope(|s| -> Result<()> {
                let (held_tx, held_rx) = std::sync::mpsc::channel();
                let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
                let holder = s.spawn(move || -> Result<()> {
                    let p = ch.begin_packing(1)?;
                    let _ = held_tx.send(());
                    let _ = go_rx.recv();
                    drop(p);
                    Ok(())
                });
                let _ = held_rx.recv();
                let t0 = Instant::now();
                let r = ch.begin_packing_until(1, t0 + WAIT).map(drop);
                let _ = go_tx.send(());
                holder.join().map_err(|_| fail("the holder panicked"))??;
                timed_out(r, t0, "begin_packing_until on a held connection")
            })?;
            c.barrier("timed-out")?;
            super::recv_sized(ch, 1, 41)?;
            super::send_sized(ch, 1, 42, 4096)?;
            c.barrier("intact")?;
            if !super::tears_down(ch) {
                return Ok(());
            }
            let mut u = ch.begin_unpacking_from(1)?;
            let n: u64 = u.unpack_value()?;
            let mut body = vec![0u8; n as usize];
            u.set_deadline(Some(Instant::now() + WAIT));
            let t0 = Instant::now();
            let r = u
                .unpack(&mut body, crate::SendMode::Cheaper)
                .and_then(|()| u.end_unpacking());
            timed_out(r, t0, "end_unpacking past its deadline")?;
            c.barrier("stalled")?;
            super::connection_refused_both_ways(c, ch, "deadline")?;
        }
        1 => {
            c.barrier("timed-out")?;
            super::send_sized(&ch, 0, 41, 100_000)?;
            super::recv_sized(&ch, 0, 42)?;
            c.barrier("intact")?;
            if !super::tears_down(&ch) {
                return Ok(());
            }
            let body = vec![3u8; 16 << 20];
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&(body.len() as u64), RecvMode::Express)?;
            p.flush()?;
            c.barrier("stalled")?;
            super::failed_promptly(
                p.pack(&body, RecvMode::Cheaper)
                    .and_then(|()| p.end_packing()),
                "a send whose receiver gave up at its deadline",
            )?;
            super::connection_refused_both_ways(c, &ch, "deadline")?;
        }
        _ => {
            c.barrier("timed-out")?;
            c.barrier("intact")?;
            if super::tears_down(&ch) {
                c.barrier("stalled")?;
                super::connection_refused_both_ways(c, &ch, "deadline")?;
            }
        }
    }
    Ok(())
}

/// `try_begin_unpacking_from`: `None` while nothing came, every message in order once they
/// come, `None` for another thread while one thread holds that peer's message, `InUse` for
/// the thread that holds it. `try_begin_unpacking_from_spinning`: `None` after its spin when
/// nothing came, a message that comes during the spin, `Closed` when the channel closes
/// during the spin.
pub(super) fn case_try_from(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    c.barrier("open")?;
    const N: u64 = 20;
    match c.rank() {
        0 => {
            if ch.try_begin_unpacking_from(1)?.is_some() {
                return Err(fail("a message before the peer sent any"));
            }
            c.barrier("quiet")?;
            let t0 = Instant::now();
            let mut got = 0;
            while got < N {
                match ch.try_begin_unpacking_from(1)? {
                    Some(mut u) => {
                        let v: u64 = u.unpack_value()?;
                        if v != got {
                            return Err(fail(format!("message {v} arrived as number {got}")));
                        }
                        if got == 0 {
                            // Held by this thread: InUse here, None on another thread.
                            match ch.try_begin_unpacking_from(1) {
                                Err(crate::Error::InUse { .. }) => {}
                                r => {
                                    return Err(fail(format!(
                                        "try_begin_unpacking_from by the thread holding the \
                                         peer's message: {:?} instead of InUse",
                                        r.map(|o| o.is_some())
                                    )))
                                }
                            }
                            let other = std::thread::scope(|s| {
                                s.spawn(|| ch.try_begin_unpacking_from(1).map(|o| o.is_some()))
                                    .join()
                            })
                            .map_err(|_| fail("a thread panicked"))??;
                            if other {
                                return Err(fail(
                                    "another thread got a message from a peer whose message \
                                     this thread holds",
                                ));
                            }
                        }
                        u.end_unpacking()?;
                        got += 1;
                    }
                    None if t0.elapsed() > LOST => {
                        return Err(fail(format!(
                            "try_begin_unpacking_from said None for {LOST:?} with {} of {N} \
                             messages received",
                            got
                        )))
                    }
                    None => std::thread::yield_now(),
                }
            }
            // The spinning form: `None` once its spin is over with nothing sent; each message
            // the peer sends a little after the call began (a plain try would say `None`).
            if ch
                .try_begin_unpacking_from_spinning(1, Duration::from_millis(2))?
                .is_some()
            {
                return Err(fail("a message the peer did not send (spinning)"));
            }
            c.barrier("spin")?;
            for i in N..2 * N {
                match ch.try_begin_unpacking_from_spinning(1, LOST)? {
                    Some(mut u) => {
                        let v: u64 = u.unpack_value()?;
                        if v != i {
                            return Err(fail(format!("message {v} arrived as number {i}")));
                        }
                        u.end_unpacking()?;
                    }
                    None => {
                        return Err(fail(format!(
                            "try_begin_unpacking_from_spinning said None after {LOST:?} \
                             waiting for message {i}"
                        )))
                    }
                }
            }
            // A close ends the spin: `Closed`, not `None` once the spin is over.
            let r = std::thread::scope(|s| {
                let h = s.spawn(|| ch.try_begin_unpacking_from_spinning(1, 4 * LOST));
                std::thread::sleep(Duration::from_millis(20));
                ch.close();
                h.join()
            })
            .map_err(|_| fail("a thread panicked"))?;
            match r {
                Err(crate::Error::Closed { .. }) => {}
                r => {
                    return Err(fail(format!(
                        "try_begin_unpacking_from_spinning on a channel closed meanwhile: \
                         {:?} instead of Closed",
                        r.map(|o| o.is_some())
                    )))
                }
            }
            c.barrier("closed")?;
        }
        1 => {
            c.barrier("quiet")?;
            for i in 0..N {
                let mut p = ch.begin_packing(0)?;
                p.pack_value(&i, RecvMode::Express)?;
                p.end_packing()?;
            }
            c.barrier("spin")?;
            for i in N..2 * N {
                std::thread::sleep(Duration::from_millis(1));
                let mut p = ch.begin_packing(0)?;
                p.pack_value(&i, RecvMode::Express)?;
                p.end_packing()?;
            }
            c.barrier("closed")?;
        }
        _ => {
            c.barrier("quiet")?;
            c.barrier("spin")?;
            c.barrier("closed")?;
        }
    }
    Ok(())
}

/// Drive a polled call to completion the way an event loop does: try, arm the channel's
/// readiness descriptor (`Busy`: try again), and sleep on the descriptor while the call is
/// pending (yield on drivers without one). A pending call whose descriptor stays quiet for [`LOST`] lost its wake-up.
pub(super) fn drive_polled<T>(
    ch: &crate::Channel,
    what: &str,
    mut f: impl FnMut() -> std::task::Poll<Result<T>>,
) -> Result<T> {
    loop {
        if let std::task::Poll::Ready(r) = f() {
            return r;
        }
        if ch.arm()? == Armed::Busy {
            continue;
        }
        match ch.readiness_fd() {
            Some(fd) => {
                if wait_readable(&[fd], Some(LOST))?.is_empty() {
                    return Err(fail(format!(
                        "lost wake-up: {what} pending, and the armed readiness descriptor \
                         stayed quiet for {LOST:?}"
                    )));
                }
            }
            None => std::thread::yield_now(),
        }
    }
}

/// `Ok(Some(x))` as `Ready(Ok(x))`, `Ok(None)` as `Pending`.
fn ready_some<T>(r: Result<Option<T>>) -> std::task::Poll<Result<T>> {
    match r {
        Ok(Some(x)) => std::task::Poll::Ready(Ok(x)),
        Ok(None) => std::task::Poll::Pending,
        Err(e) => std::task::Poll::Ready(Err(e)),
    }
}

/// The `random` case's messages (every mode, sizes from 0 to 600 kB, checked mode and not),
/// plus 16 MiB ones, between event-driven ends: a sender that defers its pieces to the end
/// (`Packer::defer`) and drives the end with `poll_end_packing`, a receiver that defers its
/// CHEAPER pieces and polls its EXPRESS ones and its end (`Unpacker::defer`,
/// `poll_unpack_express`, `poll_end_unpacking`), both sleeping on the readiness descriptor.
/// Each message is polled at both ends, at the sender only, or at the receiver only: the
/// bytes on the wire are the same as between blocking ends. The polled sender is a
/// `SendPacker` (LATER over atomics) whose end runs on another thread than its packs.
pub(super) fn case_polled(c: &Ctx<'_>) -> Result<()> {
    use super::{check, pat, random_msg, send_piece, Rng};
    use crate::SendMode;
    use std::cell::Cell;
    use std::sync::atomic::AtomicU8;
    if c.size() < 2 {
        return Ok(());
    }
    for checked in [false, true] {
        let ch = c.open(
            if checked { "-checked" } else { "" },
            if checked { "checked=true" } else { "" },
        )?;
        let seed0 = 0x9011_0000 + checked as u64;
        let msgs = 8 + Rng(seed0).below(8);
        for m in 0..=msgs {
            let seed = seed0 * 1000 + m;
            let mut pieces = random_msg(seed);
            if m == msgs {
                // Beyond every buffer: the end waits for the receiver many times.
                pieces = vec![
                    (8, SendMode::Safer, RecvMode::Express),
                    (16 << 20, SendMode::Cheaper, RecvMode::Cheaper),
                    (1 << 20, SendMode::Later, RecvMode::Cheaper),
                ];
            } else if m + 1 == msgs {
                // Short pieces a deferred packer stages at once, then one it holds, then short
                // ones held behind it: they must keep their order.
                pieces = vec![
                    (8, SendMode::Cheaper, RecvMode::Express),
                    (24, SendMode::Safer, RecvMode::Cheaper),
                    (300 << 10, SendMode::Cheaper, RecvMode::Express),
                    (8, SendMode::Safer, RecvMode::Express),
                    (16, SendMode::Cheaper, RecvMode::Cheaper),
                ];
            }
            // Who polls: both ends, the sender only, the receiver only.
            let (poll_send, poll_recv) =
                [(true, true), (true, false), (false, true)][m as usize % 3];
            if c.rank() == 0 {
                let data: Vec<Vec<u8>> = pieces
                    .iter()
                    .enumerate()
                    .map(|(i, &(n, ..))| (0..n).map(|j| pat(seed + i as u64, j)).collect())
                    .collect();
                let mut later: Vec<Vec<u8>> = pieces.iter().map(|&(n, ..)| vec![0u8; n]).collect();
                let cells: Vec<&[Cell<u8>]> = later
                    .iter_mut()
                    .map(|v| Cell::from_mut(&mut v[..]).as_slice_of_cells())
                    .collect();
                if poll_send {
                    // A packer that may cross threads: LATER over atomics, the end driven on
                    // another thread than the one that packed.
                    let atomics: Vec<Vec<AtomicU8>> = pieces
                        .iter()
                        .map(|&(n, ..)| (0..n).map(|_| AtomicU8::new(0)).collect())
                        .collect();
                    let p = drive_polled(&ch, "try_begin_packing", || {
                        ready_some(ch.try_begin_packing(1))
                    })?;
                    let mut p = p.into_send()?;
                    p.defer();
                    for (i, &(_, s, r)) in pieces.iter().enumerate() {
                        match s {
                            SendMode::Cheaper => p.pack(&data[i], r)?,
                            SendMode::Safer => p.pack_safer(&data[i], r)?,
                            SendMode::Later => p.pack_later_atomic(&atomics[i], r)?,
                        }
                    }
                    for (i, &(_, s, _)) in pieces.iter().enumerate() {
                        if s == SendMode::Later {
                            for (j, a) in atomics[i].iter().enumerate() {
                                a.store(data[i][j], std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    }
                    let ch = &ch;
                    std::thread::scope(|sc| {
                        sc.spawn(move || {
                            drive_polled(ch, "poll_end_packing", || p.poll_end_packing())
                        })
                        .join()
                    })
                    .map_err(|_| fail("the ending thread panicked"))??;
                } else {
                    let mut p = ch.begin_packing(1)?;
                    for (i, &(_, s, r)) in pieces.iter().enumerate() {
                        send_piece(&mut p, &data[i], s, r, Some(cells[i]))?;
                    }
                    for (i, &(_, s, _)) in pieces.iter().enumerate() {
                        if s == SendMode::Later {
                            for (j, cell) in cells[i].iter().enumerate() {
                                cell.set(data[i][j]);
                            }
                        }
                    }
                    p.end_packing()?;
                }
            } else if c.rank() == 1 {
                let mut bufs: Vec<Vec<u8>> = pieces.iter().map(|&(n, ..)| vec![0u8; n]).collect();
                if poll_recv {
                    let mut u = drive_polled(&ch, "try_begin_unpacking", || {
                        ready_some(ch.try_begin_unpacking())
                    })?;
                    u.defer();
                    for (i, (b, &(_, s, r))) in bufs.iter_mut().zip(&pieces).enumerate() {
                        match r {
                            RecvMode::Express => {
                                drive_polled(&ch, "poll_unpack_express", || {
                                    u.poll_unpack_express(b, s)
                                })?;
                                check(
                                    seed + i as u64,
                                    b,
                                    &format!("polled msg {m} piece {i} (EXPRESS, at unpack)"),
                                )?;
                            }
                            RecvMode::Cheaper => u.unpack(b, s)?,
                        }
                    }
                    drive_polled(&ch, "poll_end_unpacking", || u.poll_end_unpacking())?;
                    drop(u);
                } else {
                    let mut u = ch.begin_unpacking()?;
                    for (b, &(_, s, r)) in bufs.iter_mut().zip(&pieces) {
                        match r {
                            RecvMode::Express => u.unpack_express(b, s)?,
                            RecvMode::Cheaper => u.unpack(b, s)?,
                        }
                    }
                    u.end_unpacking()?;
                }
                for (i, b) in bufs.iter().enumerate() {
                    check(
                        seed + i as u64,
                        b,
                        &format!("polled msg {m} piece {i} {:?}", pieces[i]),
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// An end of message abandoned while it is pending (an event-driven sender drops its packer, as
/// a cancelled future does), and the sender then reuses the memory at once: the receiver never
/// takes the message as complete with bytes the sender wrote after abandoning it (a driver
/// that lets the receiver read the sender's memory in place, as CMA does, must not let a read
/// that overlaps the reuse count). 64 MiB, beyond every buffer, the kernel's included.
pub(super) fn case_abandoned_end(c: &Ctx<'_>) -> Result<()> {
    use crate::SendMode;
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "timeout_ms=20000")?;
    c.barrier("open")?;
    if !super::tears_down(&ch) {
        return Ok(());
    }
    const LEN: usize = 64 << 20;
    match c.rank() {
        0 => {
            let mut body = vec![0x11u8; LEN];
            {
                let mut p = ch.begin_packing(1)?.into_send()?;
                p.defer();
                p.pack_value(&(LEN as u64), RecvMode::Express)?;
                p.pack(&body, RecvMode::Cheaper)?;
                // A few polls before the receiver reads. A driver that queues the whole message
                // (mem copies a gather group into one frame) is done here: the message is
                // complete, and the check below still holds.
                let t0 = Instant::now();
                let mut over = false;
                while !over && t0.elapsed() < Duration::from_millis(50) {
                    if let std::task::Poll::Ready(r) = p.poll_end_packing() {
                        r?;
                        over = true;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                c.barrier("reading")?;
                if !over {
                    std::thread::sleep(Duration::from_millis(2));
                    let _ = p.poll_end_packing();
                }
                drop(p);
            }
            // The memory is the sender's again: overwrite it at once.
            body.fill(0x22);
            c.barrier("abandoned")?;
            std::hint::black_box(&body);
        }
        1 => {
            let mut u = ch.begin_unpacking_from(0)?;
            let n: u64 = u.unpack_value()?;
            let mut got = vec![0u8; n as usize];
            c.barrier("reading")?;
            let r = u
                .unpack(&mut got, SendMode::Cheaper)
                .and_then(|()| u.end_unpacking());
            c.barrier("abandoned")?;
            if r.is_ok() {
                if let Some(i) = got.iter().position(|&b| b != 0x11) {
                    return Err(fail(format!(
                        "a message abandoned by its sender was delivered as complete with \
                         byte {i} = {:#x}, written after the abandonment",
                        got[i]
                    )));
                }
            }
        }
        _ => {
            c.barrier("reading")?;
            c.barrier("abandoned")?;
        }
    }
    Ok(())
}

/// `events::begin_unpacking_any` over two channels: a deadline with nothing sent is a
/// timeout; a message on the second is found while the first stays quiet, then one on the
/// first. Then every peer drops the second channel: it is left out, not an error, while the
/// first may still deliver (a timeout, then a message); once the first is gone too, the call
/// fails instead of waiting.
pub(super) fn case_select(c: &Ctx<'_>) -> Result<()> {
    use crate::events::begin_unpacking_any;
    if c.size() < 2 {
        return Ok(());
    }
    let a = c.open("-a", "")?;
    let b = Some(c.open("-b", "")?);
    c.barrier("open")?;
    let gone = super::tears_down(&a);
    let expect = |(i, mut u): (usize, crate::Unpacker<'_, '_>), want: usize, v: u64| {
        let got: u64 = u.unpack_value()?;
        u.end_unpacking()?;
        if (i, got) != (want, v) {
            return Err(fail(format!(
                "begin_unpacking_any: channel {i} value {got}, expected channel {want} value {v}"
            )));
        }
        Ok(())
    };
    let timeout = |r: Result<(usize, crate::Unpacker<'_, '_>)>, what: &str| match r {
        Err(crate::Error::Timeout(_)) => Ok(()),
        Ok((i, _)) => Err(fail(format!(
            "{what}: a message on channel {i} with none sent"
        ))),
        Err(e) => Err(fail(format!("{what}: {e}, expected a timeout"))),
    };
    let send = |ch: &crate::Channel, v: u64| -> Result<()> {
        std::thread::sleep(Duration::from_millis(20));
        let mut p = ch.begin_packing(0)?;
        p.pack_value(&v, RecvMode::Express)?;
        p.end_packing()
    };
    let soon = || Some(Instant::now() + Duration::from_millis(50));
    if c.rank() == 0 {
        let b = b.as_ref().expect("opened above");
        timeout(begin_unpacking_any(&[&a, b], soon()), "nothing sent")?;
        c.barrier("quiet")?;
        expect(begin_unpacking_any(&[&a, b], None)?, 1, 7)?;
        c.barrier("got-b")?;
        expect(begin_unpacking_any(&[&a, b], None)?, 0, 8)?;
        if !gone {
            return Ok(());
        }
        c.barrier("b-gone")?;
        timeout(
            begin_unpacking_any(&[&a, b], soon()),
            "every peer gone from the second channel only",
        )?;
        c.barrier("wait-a")?;
        expect(begin_unpacking_any(&[&a, b], None)?, 0, 9)?;
        c.barrier("a-gone")?;
        let t0 = Instant::now();
        match begin_unpacking_any(&[&a, b], Some(t0 + Duration::from_secs(20))) {
            Err(crate::Error::Timeout(_)) => Err(fail(
                "every peer gone from both channels: begin_unpacking_any waited until its deadline",
            )),
            Err(_) => Ok(()),
            Ok((i, _)) => Err(fail(format!(
                "a message on channel {i} with every peer gone"
            ))),
        }
    } else {
        c.barrier("quiet")?;
        if c.rank() == 1 {
            send(b.as_ref().expect("opened above"), 7)?;
        }
        c.barrier("got-b")?;
        if c.rank() == 1 {
            send(&a, 8)?;
        }
        if !gone {
            return Ok(());
        }
        drop(b);
        c.barrier("b-gone")?;
        c.barrier("wait-a")?;
        if c.rank() == 1 {
            send(&a, 9)?;
        }
        drop(a);
        c.barrier("a-gone")
    }
}

/// Two event loops that send each other a message beyond every buffer at the same time, one
/// thread each: every call is a polling one (`poll_end_packing` of its own message, a
/// deferred receive of the peer's with `poll_unpack_express` and `poll_end_unpacking`), in
/// one loop that sleeps on the readiness descriptor. A polling call must never wait in the
/// driver: if one did (tcp under `progress=block` waited in the kernel for its gather sends
/// and receives), each rank would wait for the other to receive until a socket timeout (half
/// a second each time, on every message). More than one polling call that takes over
/// [`STALL`] fails the case (one is forgiven: a thread can be descheduled that long on a
/// loaded machine; a driver that waits does it on every message).
pub(super) fn case_crossing(c: &Ctx<'_>) -> Result<()> {
    const STALL: Duration = Duration::from_millis(200);
    use super::{check, pat};
    use crate::SendMode;
    use std::task::Poll;
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "timeout_ms=30000")?;
    c.barrier("open")?;
    if c.rank() < 2 {
        let peer = 1 - c.rank();
        const BIG: usize = 16 << 20;
        let stalls = std::cell::Cell::new(0);
        let timed = |what: &str, t0: Instant| -> Result<()> {
            let took = t0.elapsed();
            if took > STALL {
                stalls.set(stalls.get() + 1);
                if stalls.get() > 1 {
                    return Err(fail(format!(
                        "{what} is a polling call but waited {took:?} in the driver (and \
                         another call before it)"
                    )));
                }
            }
            Ok(())
        };
        for m in 0..3u64 {
            let seed = |r: usize| 0xc705_0000 + m * 2 + r as u64;
            let mine = seed(c.rank());
            let data: Vec<u8> = (0..BIG).map(|j| pat(mine, j)).collect();
            let mut got = vec![0u8; BIG];
            let mut hdr = [0u8; 8];
            let head = mine.to_le_bytes();
            let mut into = Some(&mut got[..]);
            let mut p = drive_polled(&ch, "try_begin_packing", || {
                ready_some(ch.try_begin_packing(peer))
            })?;
            p.defer();
            p.pack(&head, RecvMode::Express)?;
            p.pack(&data, RecvMode::Cheaper)?;
            let mut u = None;
            let (mut sent, mut header, mut received) = (false, false, false);
            let start = Instant::now();
            while !(sent && received) {
                let mut moved = false;
                if !sent {
                    let t0 = Instant::now();
                    let r = p.poll_end_packing();
                    timed("poll_end_packing", t0)?;
                    if let Poll::Ready(r) = r {
                        r?;
                        sent = true;
                        moved = true;
                    }
                }
                if u.is_none() && !received {
                    let t0 = Instant::now();
                    let r = ch.try_begin_unpacking_from(peer)?;
                    timed("try_begin_unpacking_from", t0)?;
                    if let Some(mut x) = r {
                        x.defer();
                        u = Some(x);
                        moved = true;
                    }
                }
                if let Some(x) = u.as_mut() {
                    if !header {
                        let t0 = Instant::now();
                        let r = x.poll_unpack_express(&mut hdr, SendMode::Cheaper);
                        timed("poll_unpack_express", t0)?;
                        if let Poll::Ready(r) = r {
                            r?;
                            header = true;
                            moved = true;
                            let into = into.take().expect("the body is unpacked once");
                            x.unpack(into, SendMode::Cheaper)?;
                        }
                    }
                    if header {
                        let t0 = Instant::now();
                        let r = x.poll_end_unpacking();
                        timed("poll_end_unpacking", t0)?;
                        if let Poll::Ready(r) = r {
                            r?;
                            received = true;
                            moved = true;
                            u = None;
                        }
                    }
                }
                if moved {
                    continue;
                }
                if start.elapsed() > Duration::from_secs(60) {
                    return Err(fail(format!(
                        "message {m}: no end after 60 s (sent: {sent}, header: {header}, \
                         received: {received})"
                    )));
                }
                if ch.arm()? == Armed::Busy {
                    continue;
                }
                match ch.readiness_fd() {
                    Some(fd) => {
                        wait_readable(&[fd], Some(Duration::from_millis(100)))?;
                    }
                    None => std::thread::yield_now(),
                }
            }
            drop(p);
            drop(u);
            if u64::from_le_bytes(hdr) != seed(peer) {
                return Err(fail(format!("message {m}: a header of another message")));
            }
            check(seed(peer), &got, &format!("crossing message {m}"))?;
        }
    }
    c.barrier("crossed")?;
    Ok(())
}
