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
                if ch.arm()? == Armed::Busy {
                    wakeups += 1;
                } else if !wait_readable(&[fd], Some(Duration::from_millis(100)))?.is_empty() {
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
            let mut rng = super::Rng(0x5eed_0f_ee);
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
