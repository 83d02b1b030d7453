//! The driver conformance kit: one suite every driver runs, over real threads or processes.
//!
//! A driver crate calls [`run_threads`] from a test (every rank is a thread of the test
//! process, with a [`ThreadBootstrap`]) or [`run_rank`] from a program started under
//! `madrun` / `mpiexec` (every rank a process). Each case opens its own channel from the
//! driver spec, so a case that breaks a connection on purpose does not disturb the next.
//!
//! Cases (each skips itself when the session or the driver cannot run it):
//! `sizes` (0, 1, 7, every TM threshold ±1, 1 MiB; 64 MiB with `big`), `modes` (every send ×
//! receive mode), `later`, `safer_reuse`, `many_pieces`, `unaligned`, `figure1`, `later_express`,
//! `empty`, `random` (seeded replay of 8–15 messages of 8–15 pieces, every other one under `Packer::flush_at_end`),
//! `ping_pong_mix` (round trips of messages from 0 B to 300 KiB in an order that crosses
//! every staging and buffer bound both ways, with bursts between them, over 8 MiB each way:
//! a driver that reuses or skips buffer space between messages when it is idle must never
//! hand out stale or skipped bytes), `in_flight`,
//! `flush` (a sender that waits for its receiver's answer in the middle of a message, after
//! `Packer::flush`), `any_source`, `idle_wait` (an any-source receiver waiting for a late
//! sender, with a third peer closed, sleeps instead of spinning: its thread's CPU time stays
//! under 30 % of the wait; skipped with `progress=poll`), `two_channels`, `threads`,
//! `checked_mismatch`, `peer_closes`
//! (a message abandoned after part of it left; skipped when the driver's capabilities say it
//! cannot detect a dead peer), and the failure rules at sizes beyond every buffer:
//! `receiver_abandons` (a receiver that drops its `Unpacker`, or fails with `UnpackMismatch`,
//! in the middle of a 16 MiB message never strands its sender, and the connection is then
//! refused in both directions on both sides), `sender_abandons` (a `Packer` dropped with
//! nothing sent leaves the connection intact; dropped after part of its message left, flushed
//! or not, it is never delivered as complete), `wrong_unpacks` (unchecked mode: short, long
//! and skipped unpacks of small and large pieces are errors at that message, never a misread
//! or a wait on a sender that waits in turn), `dead_peer_idle` (sends to peers that left while
//! this rank was not waiting fail, and `try_begin_unpacking` says that no peer is left; skipped
//! when the driver cannot detect a dead peer; the three failure cases before it likewise
//! skip what needs a connection torn down under the peer: mpi), and the event-driven engine's:
//! `readiness` (thousands of poll / arm / sleep races on the readiness descriptor without a
//! lost wake-up, an idle armed descriptor that stays quiet, a peer's departure that wakes it;
//! skipped by drivers without a descriptor), `close` (`Channel::close` frees blocked receives
//! and an `end_unpacking` moved to another thread with `Closed`; the peer's calls fail),
//! `deadlines` (per-call deadlines leave an idle connection intact; one that expires in the
//! middle of a message finishes it), `try_from` (`try_begin_unpacking_from` and its spinning
//! form), `polled` (the
//! `random` messages and 16 MiB ones from an event-driven sender: deferred pieces, the end
//! driven by `poll_end_packing` and the readiness descriptor), `abandoned_end` (an end of
//! message abandoned while pending, its memory reused at once: never delivered as complete
//! with the reused bytes), `select` (`events::begin_unpacking_any` over two channels). An
//! unknown name in
//! `MAD_KIT_CASES` is an error, not a kit that runs nothing.

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::{Bootstrap, ThreadBootstrap};
use crate::config::ChannelConfig;
use crate::error::{Error, Result};
use crate::modes::{RecvMode, SendMode};
use crate::{Channel, Session};

pub mod alloc;
pub mod death;
mod events;
pub mod jobs;
pub mod readiness;
pub mod tune;

/// What to run.
#[derive(Clone, Debug)]
pub struct KitOptions {
    /// Driver spec used for every channel (`tcp`, `shm,progress=block`, ...).
    pub spec: String,
    /// Only these cases (all when `None`).
    pub cases: Option<Vec<String>>,
    /// Include the 64 MiB pieces.
    pub big: bool,
    /// Number of messages for `in_flight` and rounds for `threads`.
    pub volume: usize,
}

impl KitOptions {
    /// Defaults for a spec: every case, no 64 MiB pieces, moderate volume. `MAD_KIT_CASES`
    /// (comma-separated) restricts the cases, `MAD_KIT_BIG=1` adds the 64 MiB pieces.
    pub fn new(spec: &str) -> Self {
        KitOptions {
            spec: spec.to_string(),
            cases: std::env::var("MAD_KIT_CASES")
                .ok()
                .map(|v| v.split(',').map(|s| s.trim().to_string()).collect()),
            big: std::env::var("MAD_KIT_BIG")
                .map(|v| v == "1")
                .unwrap_or(false),
            volume: 200,
        }
    }
}

type Case = fn(&Ctx<'_>) -> Result<()>;

/// The list of cases, in the order they run.
const CASES: &[(&str, Case)] = &[
    ("empty", case_empty),
    ("sizes", case_sizes),
    ("modes", case_modes),
    ("later", case_later),
    ("later_express", case_later_express),
    ("safer_reuse", case_safer_reuse),
    ("many_pieces", case_many_pieces),
    ("short", case_short),
    ("unaligned", case_unaligned),
    ("figure1", case_figure1),
    ("random", case_random),
    ("ping_pong_mix", case_ping_pong_mix),
    ("in_flight", case_in_flight),
    ("flush", case_flush),
    ("any_source", case_any_source),
    ("idle_wait", case_idle_wait),
    ("two_channels", case_two_channels),
    ("threads", case_threads),
    ("checked_mismatch", case_checked_mismatch),
    ("peer_closes", case_peer_closes),
    ("receiver_abandons", case_receiver_abandons),
    ("sender_abandons", case_sender_abandons),
    ("wrong_unpacks", case_wrong_unpacks),
    ("dead_peer_idle", case_dead_peer_idle),
    ("readiness", events::case_readiness),
    ("close", events::case_close),
    ("deadlines", events::case_deadlines),
    ("try_from", events::case_try_from),
    ("polled", events::case_polled),
    ("abandoned_end", events::case_abandoned_end),
    ("crossing", events::case_crossing),
    ("select", events::case_select),
];

struct Ctx<'s> {
    session: &'s Session,
    opts: &'s KitOptions,
    case: &'static str,
}

impl Ctx<'_> {
    fn rank(&self) -> usize {
        self.session.rank()
    }
    fn size(&self) -> usize {
        self.session.size()
    }
    fn open(&self, suffix: &str, extra: &str) -> Result<Channel> {
        let name = format!("kit-{}{}", self.case, suffix);
        // The case's options replace the spec's own value of the same key (a key may be
        // given once).
        let key = |kv: &str| kv.split('=').next().unwrap_or("").trim().to_string();
        let extra_keys: Vec<String> = extra
            .split(',')
            .filter(|e| !e.is_empty())
            .map(key)
            .collect();
        let mut parts = crate::config::split_spec(&self.opts.spec, ',').into_iter();
        let mut spec = parts.next().unwrap_or("").to_string();
        for kv in parts.filter(|kv| !extra_keys.contains(&key(kv))) {
            spec.push(',');
            spec.push_str(kv);
        }
        if !extra.is_empty() {
            spec.push(',');
            spec.push_str(extra);
        }
        self.session
            .open_channel_with(ChannelConfig::parse(&name, &spec)?)
    }
    fn barrier(&self, what: &str) -> Result<()> {
        self.session
            .bootstrap()
            .barrier(&format!("kit/{}/{what}", self.case))
    }
}

/// A failed check of the kit (not a driver error: its message starts with `conformance kit`).
fn fail(what: impl Into<String>) -> Error {
    Error::Io {
        context: "conformance kit".into(),
        source: std::io::Error::other(what.into()),
    }
}

/// A deterministic byte for position `i` of a piece identified by `tag`.
#[inline]
fn pat(tag: u64, i: usize) -> u8 {
    let x =
        tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
    (x >> 56) as u8 ^ (i as u8)
}

fn fill(tag: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pat(tag, i);
    }
}

fn check(tag: u64, buf: &[u8], what: &str) -> Result<()> {
    for (i, b) in buf.iter().enumerate() {
        if *b != pat(tag, i) {
            return Err(fail(format!(
                "{what}: byte {i} of {} is {b:#04x}, expected {:#04x}",
                buf.len(),
                pat(tag, i)
            )));
        }
    }
    Ok(())
}

/// splitmix64: small, seedable, identical on both sides.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn send_piece<'b>(
    p: &mut crate::Packer<'_, 'b>,
    data: &'b [u8],
    s: SendMode,
    r: RecvMode,
    later: Option<&'b [Cell<u8>]>,
) -> Result<()> {
    match s {
        SendMode::Cheaper => p.pack(data, r),
        SendMode::Safer => p.pack_safer(data, r),
        SendMode::Later => p.pack_later(later.ok_or_else(|| fail("LATER needs cells"))?, r),
    }
}

/// One message of one piece of `len` bytes with modes (s, r), from `from` to `to`, checked.
fn one_piece(
    ch: &Channel,
    from: usize,
    to: usize,
    len: usize,
    s: SendMode,
    r: RecvMode,
    tag: u64,
) -> Result<()> {
    let me = ch.rank();
    if me == from {
        let mut data = vec![0u8; len];
        fill(tag, &mut data);
        let mut later_buf = data.clone();
        let cells = Cell::from_mut(&mut later_buf[..]).as_slice_of_cells();
        let mut p = ch.begin_packing(to)?;
        send_piece(&mut p, &data, s, r, Some(cells))?;
        p.end_packing()?;
    } else if me == to {
        let mut buf = vec![0xAAu8; len];
        let mut u = ch.begin_unpacking_from(from)?;
        match r {
            RecvMode::Express => {
                u.unpack_express(&mut buf, s)?;
                u.end_unpacking()?;
            }
            RecvMode::Cheaper => {
                u.unpack(&mut buf, s)?;
                u.end_unpacking()?;
            }
        }
        check(tag, &buf, &format!("{len} B piece, {s:?}/{r:?}"))?;
    }
    Ok(())
}

fn case_empty(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    for _ in 0..3 {
        if c.rank() == 0 {
            ch.begin_packing(1)?.end_packing()?;
        } else if c.rank() == 1 {
            let u = ch.begin_unpacking()?;
            if u.remote() != 0 {
                return Err(fail("empty message from the wrong rank"));
            }
            u.end_unpacking()?;
        }
    }
    Ok(())
}

fn interesting_sizes(ch: &Channel, big: bool) -> Vec<usize> {
    let mut v = vec![0, 1, 7, 8, 100, 4096, 65536 + 3, 1 << 20];
    // A virtual channel's pieces take the TMs of the part that reaches the peer.
    let tables: Vec<&crate::driver::TmTable> = if ch.parts().is_empty() {
        vec![ch.tm_table()]
    } else {
        ch.parts().iter().map(|p| p.tm_table()).collect()
    };
    for tm in tables.iter().flat_map(|t| t.tms()) {
        if tm.max_len != usize::MAX && tm.max_len < (256 << 20) {
            v.extend([tm.max_len.saturating_sub(1), tm.max_len, tm.max_len + 1]);
        }
    }
    if big {
        v.push(64 << 20);
    }
    v.sort_unstable();
    v.dedup();
    v
}

fn case_sizes(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    for (i, len) in interesting_sizes(&ch, c.opts.big).into_iter().enumerate() {
        one_piece(
            &ch,
            0,
            1,
            len,
            SendMode::Cheaper,
            RecvMode::Cheaper,
            i as u64,
        )?;
        one_piece(
            &ch,
            1,
            0,
            len,
            SendMode::Safer,
            RecvMode::Express,
            1000 + i as u64,
        )?;
    }
    Ok(())
}

fn case_modes(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let sizes = interesting_sizes(&ch, false);
    let mut tag = 0;
    for s in SendMode::ALL {
        for r in RecvMode::ALL {
            for &len in &sizes {
                tag += 1;
                one_piece(&ch, 0, 1, len, s, r, tag)?;
            }
        }
    }
    Ok(())
}

fn case_later(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    for len in [4usize, 5000, 300_000] {
        if c.rank() == 0 {
            let mut buf = vec![1u8; len];
            let head = [9u8; 3];
            {
                let cells = Cell::from_mut(&mut buf[..]).as_slice_of_cells();
                let mut p = ch.begin_packing(1)?;
                p.pack_later(cells, RecvMode::Cheaper)?;
                p.pack(&head, RecvMode::Express)?;
                // Changes made between pack and end_packing are sent.
                for (i, cell) in cells.iter().enumerate() {
                    cell.set(pat(len as u64, i));
                }
                p.end_packing()?;
            }
        } else if c.rank() == 1 {
            let mut buf = vec![0u8; len];
            let mut head = [0u8; 3];
            let mut u = ch.begin_unpacking()?;
            u.unpack(&mut buf, SendMode::Later)?;
            u.unpack_express(&mut head, SendMode::Cheaper)?;
            if head != [9; 3] {
                return Err(fail("piece after a LATER piece corrupted"));
            }
            u.end_unpacking()?;
            check(len as u64, &buf, "LATER piece (changed after pack)")?;
        }
    }
    Ok(())
}

fn case_later_express(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    for len in [8usize, 70_000] {
        if c.rank() == 0 {
            let mut size = [0u8; 8];
            let body: Vec<u8> = (0..len).map(|i| pat(5, i)).collect();
            let mut safer = vec![3u8; 100];
            let cells = Cell::from_mut(&mut size[..]).as_slice_of_cells();
            let mut p = ch.begin_packing(1)?;
            p.pack_later(cells, RecvMode::Express)?;
            p.pack(&body, RecvMode::Cheaper)?;
            p.pack_safer(&safer, RecvMode::Express)?;
            safer.fill(0); // SAFER in hold mode: the value at pack time is sent
            for (i, c) in (len as u64).to_le_bytes().iter().enumerate() {
                cells[i].set(*c);
            }
            p.end_packing()?;
        } else if c.rank() == 1 {
            let mut size = [0u8; 8];
            let mut u = ch.begin_unpacking()?;
            u.unpack_express(&mut size, SendMode::Later)?;
            let n = u64::from_le_bytes(size) as usize;
            if n != len {
                return Err(fail(format!("LATER+EXPRESS size: got {n}, expected {len}")));
            }
            let mut body = vec![0u8; n];
            let mut safer = vec![0u8; 100];
            u.unpack(&mut body, SendMode::Cheaper)?;
            u.unpack_express(&mut safer, SendMode::Safer)?;
            if safer != vec![3u8; 100] {
                return Err(fail(
                    "SAFER piece packed in hold mode was not the value at pack time",
                ));
            }
            u.end_unpacking()?;
            check(5, &body, "body after LATER+EXPRESS")?;
        }
    }
    Ok(())
}

fn case_safer_reuse(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let sizes = [16usize, 3000, 200_000, 2 << 20];
    if c.rank() == 0 {
        let mut p = ch.begin_packing(1)?;
        let mut scratch = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            scratch.resize(len, 0);
            fill(i as u64, &mut scratch);
            p.pack_safer(&scratch, RecvMode::Cheaper)?;
            scratch.fill(0xEE); // reuse at once
        }
        p.end_packing()?;
    } else if c.rank() == 1 {
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let mut u = ch.begin_unpacking()?;
        for b in bufs.iter_mut() {
            u.unpack(b, SendMode::Safer)?;
        }
        u.end_unpacking()?;
        for (i, b) in bufs.iter().enumerate() {
            check(i as u64, b, "SAFER piece reused after pack")?;
        }
    }
    Ok(())
}

fn case_many_pieces(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let lens: Vec<usize> = (0..300)
        .map(|i| [1usize, 8, 33, 0, 500, 4100, 70_000][i % 7])
        .collect();
    if c.rank() == 0 {
        let data: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| pat(i as u64, j)).collect())
            .collect();
        let mut p = ch.begin_packing(1)?;
        for d in &data {
            p.pack(d, RecvMode::Cheaper)?;
        }
        p.end_packing()?;
    } else if c.rank() == 1 {
        let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
        let mut u = ch.begin_unpacking()?;
        for b in bufs.iter_mut() {
            u.unpack(b, SendMode::Cheaper)?;
        }
        u.end_unpacking()?;
        for (i, b) in bufs.iter().enumerate() {
            check(i as u64, b, "one of 300 pieces")?;
        }
    }
    Ok(())
}

/// Short messages, which the sender lends to the driver at once and the receiver takes whole
/// with their header when all of it is there (`Staged` in `pack.rs`, `RxStaged` in
/// `unpack.rs`): lengths on both sides of the staging bounds (`STAGE_PIECE` for a piece,
/// `STAGE_CAP` for a message with its header and frames, and the bounds these had before),
/// pieces received EXPRESS and CHEAPER, many messages
/// queued back to back (a receiver's lend then holds the next message too, which must stay
/// for the next `begin_unpacking`). (`wrong_unpacks` unpacks short messages wrongly.)
fn case_short(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    use crate::pack::{STAGE_CAP as CAP, STAGE_PIECE as PIECE};
    let mut lens = vec![
        0, 1, 7, 8, 100, 127, 128, 129, 200, 440, 480, 488, 496, 504, 1000,
    ];
    lens.extend([PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 8]);
    // One piece whose message (header, frame, piece, end frame: 8 + 8 + n + 8 bytes) is just
    // within, at, or just beyond the cap.
    lens.extend((CAP - 40..=CAP - 16).step_by(8));
    let mut shapes: Vec<Vec<usize>> = Vec::new();
    for &n in &lens {
        shapes.push(vec![n]);
        shapes.push(vec![8, n]);
        shapes.push(vec![n, n, n]);
    }
    // 8 + 16 k + 8 bytes on the wire: around the old cap of 512 B and around `CAP`.
    let k0 = (CAP - 16) / 16;
    for k in [29usize, 30, 31, 32, 40, k0 - 1, k0, k0 + 1] {
        shapes.push(vec![8; k]);
    }
    let mode = |j: usize| {
        if j % 2 == 0 {
            RecvMode::Express
        } else {
            RecvMode::Cheaper
        }
    };
    let tag = |i: usize, j: usize| (i * 1024 + j) as u64;
    for round in 0..3 {
        if c.rank() == 0 {
            // Every message sent before the receiver starts (round 0 and 2), or interleaved.
            for (i, shape) in shapes.iter().enumerate() {
                let data: Vec<Vec<u8>> = shape
                    .iter()
                    .enumerate()
                    .map(|(j, &n)| (0..n).map(|b| pat(tag(i, j), b)).collect())
                    .collect();
                let mut p = ch.begin_packing(1)?;
                for (j, d) in data.iter().enumerate() {
                    p.pack(d, mode(j))?;
                }
                p.end_packing()?;
            }
        } else if c.rank() == 1 {
            if round == 1 {
                std::thread::sleep(Duration::from_millis(50));
            }
            for (i, shape) in shapes.iter().enumerate() {
                let mut bufs: Vec<Vec<u8>> = shape.iter().map(|&n| vec![0u8; n]).collect();
                let mut u = ch.begin_unpacking_from(0)?;
                for (j, b) in bufs.iter_mut().enumerate() {
                    match mode(j) {
                        RecvMode::Express => u.unpack_express(b, SendMode::Cheaper)?,
                        RecvMode::Cheaper => u.unpack(b, SendMode::Cheaper)?,
                    }
                }
                u.end_unpacking()?;
                for (j, b) in bufs.iter().enumerate() {
                    check(tag(i, j), b, &format!("short message {shape:?}, piece {j}"))?;
                }
            }
        }
    }
    Ok(())
}

fn case_unaligned(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    for (k, &len) in [13usize, 4097, 100_003].iter().enumerate() {
        if c.rank() == 0 {
            let mut raw = vec![0u8; len + 8];
            fill(k as u64, &mut raw[3..3 + len]);
            let mut p = ch.begin_packing(1)?;
            p.pack(&raw[3..3 + len], RecvMode::Cheaper)?;
            p.pack(&raw[1..2], RecvMode::Express)?;
            p.end_packing()?;
        } else if c.rank() == 1 {
            let mut raw = vec![0u8; len + 8];
            let mut one = [0u8; 1];
            let mut u = ch.begin_unpacking()?;
            u.unpack(&mut raw[5..5 + len], SendMode::Cheaper)?;
            u.unpack_express(&mut one, SendMode::Cheaper)?;
            u.end_unpacking()?;
            check(k as u64, &raw[5..5 + len], "unaligned piece")?;
        }
    }
    Ok(())
}

fn case_figure1(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    for (k, &len) in [0usize, 10, 5000, 1 << 20].iter().enumerate() {
        if c.rank() == 0 {
            let array: Vec<u8> = (0..len).map(|i| pat(k as u64, i)).collect();
            let mut p = ch.begin_packing(1)?;
            p.pack_value(&(len as u32), RecvMode::Express)?;
            p.pack(&array, RecvMode::Cheaper)?;
            p.end_packing()?;
        } else if c.rank() == 1 {
            let mut u = ch.begin_unpacking()?;
            let n: u32 = u.unpack_value()?;
            let mut array = vec![0u8; n as usize];
            u.unpack(&mut array, SendMode::Cheaper)?;
            u.end_unpacking()?;
            check(k as u64, &array, "Figure 1 array")?;
        }
    }
    Ok(())
}

fn random_msg(seed: u64) -> Vec<(usize, SendMode, RecvMode)> {
    let mut rng = Rng(seed);
    let n = 8 + rng.below(8) as usize;
    (0..n)
        .map(|_| {
            let len = match rng.below(4) {
                0 => rng.below(16) as usize,
                1 => rng.below(2048) as usize,
                2 => rng.below(100_000) as usize,
                _ => rng.below(600_000) as usize,
            };
            let s = SendMode::ALL[rng.below(3) as usize];
            let r = RecvMode::ALL[rng.below(2) as usize];
            (len, s, r)
        })
        .collect()
}

fn case_random(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    for checked in [false, true] {
        let ch = c.open(
            if checked { "-checked" } else { "" },
            if checked { "checked=true" } else { "" },
        )?;
        let seed0 = 0x5eed_0000 + checked as u64;
        let msgs = 8 + Rng(seed0).below(8);
        for m in 0..msgs {
            let seed = seed0 * 1000 + m;
            let pieces = random_msg(seed);
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
                let mut p = ch.begin_packing(1)?;
                if m % 2 == 1 {
                    // Every other message: its EXPRESS pieces go out with what follows them
                    // (the sender does not wait before the end).
                    p.flush_at_end();
                }
                for (i, &(_, s, r)) in pieces.iter().enumerate() {
                    send_piece(&mut p, &data[i], s, r, Some(cells[i]))?;
                }
                // LATER pieces get their value now.
                for (i, &(_, s, _)) in pieces.iter().enumerate() {
                    if s == SendMode::Later {
                        for (j, cell) in cells[i].iter().enumerate() {
                            cell.set(data[i][j]);
                        }
                    }
                }
                p.end_packing()?;
            } else if c.rank() == 1 {
                let mut bufs: Vec<Vec<u8>> = pieces.iter().map(|&(n, ..)| vec![0u8; n]).collect();
                let mut u = ch.begin_unpacking()?;
                for (i, (b, &(_, s, r))) in bufs.iter_mut().zip(&pieces).enumerate() {
                    match r {
                        RecvMode::Express => {
                            u.unpack_express(b, s)?;
                            check(
                                seed + i as u64,
                                b,
                                &format!("random msg {m} piece {i} (EXPRESS, at unpack)"),
                            )?;
                        }
                        RecvMode::Cheaper => u.unpack(b, s)?,
                    }
                }
                u.end_unpacking()?;
                for (i, b) in bufs.iter().enumerate() {
                    check(
                        seed + i as u64,
                        b,
                        &format!("random msg {m} piece {i} {:?}", pieces[i]),
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// The send mode of a [`case_ping_pong_mix`] body: SAFER when short (staged with its header),
/// CHEAPER otherwise.
fn mix_mode(len: usize) -> SendMode {
    if len <= 4096 {
        SendMode::Safer
    } else {
        SendMode::Cheaper
    }
}

fn case_ping_pong_mix(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    if c.rank() > 1 {
        return Ok(());
    }
    let peer = 1 - c.rank();
    // Short after short (a ring writer may go back to the start of its buffer), long after
    // short and short after long, sizes around 2, 4, 8 and 64 KiB, empty bodies.
    const SIZES: [usize; 14] = [
        8, 3000, 0, 4100, 9000, 1, 20_000, 2047, 70_000, 5000, 300_000, 16, 4096, 65_536,
    ];
    let mut sent = 0usize;
    let mut round = 0u64;
    while sent < 8 << 20 {
        let len = SIZES[round as usize % SIZES.len()];
        let back = SIZES[(round as usize * 5 + 3) % SIZES.len()];
        let tag = 0x9090_0000 + round * 2;
        let what = format!("ping-pong round {round}");
        if c.rank() == 0 {
            send_sized_as(&ch, peer, tag, len, mix_mode(len))?;
            recv_sized_as(&ch, peer, tag + 1, Some(back), mix_mode(back), &what)?;
        } else {
            recv_sized_as(&ch, peer, tag, Some(len), mix_mode(len), &what)?;
            send_sized_as(&ch, peer, tag + 1, back, mix_mode(back))?;
        }
        sent += len.max(1);
        if round % 50 == 49 {
            // A burst each way in turn: the writer is ahead of its reader for a while.
            for k in 0..24u64 {
                let n = SIZES[(round + k) as usize % SIZES.len()];
                let t = 0x9191_0000 + round * 100 + k;
                if c.rank() == 0 {
                    send_sized_as(&ch, peer, t, n, mix_mode(n))?;
                } else {
                    recv_sized_as(
                        &ch,
                        peer,
                        t,
                        Some(n),
                        mix_mode(n),
                        &format!("burst after round {round}, {k}"),
                    )?;
                }
            }
            for k in 0..24u64 {
                let n = SIZES[(round + 2 * k) as usize % SIZES.len()];
                let t = 0x9292_0000 + round * 100 + k;
                if c.rank() == 1 {
                    send_sized_as(&ch, peer, t, n, mix_mode(n))?;
                } else {
                    recv_sized_as(
                        &ch,
                        peer,
                        t,
                        Some(n),
                        mix_mode(n),
                        &format!("burst back after round {round}, {k}"),
                    )?;
                }
            }
        }
        round += 1;
    }
    Ok(())
}

fn case_in_flight(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let n = c.opts.volume * 5;
    if c.rank() == 0 {
        for i in 0..n as u64 {
            let mut p = ch.begin_packing(1)?;
            p.pack_value(&i, RecvMode::Express)?;
            let body = [(i % 251) as u8; 100];
            p.pack_safer(&body, RecvMode::Cheaper)?;
            p.end_packing()?;
        }
    } else if c.rank() == 1 {
        for i in 0..n as u64 {
            let mut u = ch.begin_unpacking()?;
            let v: u64 = u.unpack_value()?;
            let mut body = [0u8; 100];
            u.unpack(&mut body, SendMode::Safer)?;
            u.end_unpacking()?;
            if v != i || body != [(i % 251) as u8; 100] {
                return Err(fail(format!(
                    "message {i} of {n} out of order or corrupt (got {v})"
                )));
            }
        }
    }
    Ok(())
}

fn case_any_source(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let per = 20u64;
    if c.rank() == 0 {
        let mut next = vec![0u64; c.size()];
        for _ in 0..per * (c.size() as u64 - 1) {
            let mut u = ch.begin_unpacking()?;
            let from = u.remote();
            let (r, i): (u64, u64) = (u.unpack_value()?, u.unpack_value()?);
            let mut body = vec![0u8; 3000];
            u.unpack(&mut body, SendMode::Cheaper)?;
            u.end_unpacking()?;
            if r != from as u64 || i != next[from] {
                return Err(fail(format!(
                    "any-source: from {from} got (rank {r}, #{i}), expected #{}",
                    next[from]
                )));
            }
            check(r * 1000 + i, &body, "any-source body")?;
            next[from] += 1;
        }
    } else {
        for i in 0..per {
            let body: Vec<u8> = (0..3000)
                .map(|j| pat(c.rank() as u64 * 1000 + i, j))
                .collect();
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&(c.rank() as u64), RecvMode::Express)?;
            p.pack_value(&i, RecvMode::Express)?;
            p.pack(&body, RecvMode::Cheaper)?;
            p.end_packing()?;
        }
    }
    c.barrier("done")
}

fn case_two_channels(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let a = c.open("-a", "")?;
    let b = c.open("-b", "")?;
    for i in 0..20u64 {
        if c.rank() == 0 {
            let big: Vec<u8> = (0..200_000).map(|j| pat(i, j)).collect();
            let mut pa = a.begin_packing(1)?;
            pa.pack_value(&i, RecvMode::Express)?;
            let mut pb = b.begin_packing(1)?; // two messages under construction at once
            pb.pack_value(&(i + 100), RecvMode::Express)?;
            pa.pack(&big, RecvMode::Cheaper)?;
            pb.end_packing()?;
            pa.end_packing()?;
        } else if c.rank() == 1 {
            // b's header first (EXPRESS: there at once), then the whole of a, then b's end:
            // `end_unpacking` returns once the sender has ended that message, and this
            // sender ends b only after a's body has gone through a's buffers.
            let mut ub = b.begin_unpacking()?;
            let vb: u64 = ub.unpack_value()?;
            let mut ua = a.begin_unpacking()?;
            let va: u64 = ua.unpack_value()?;
            let mut big = vec![0u8; 200_000];
            ua.unpack(&mut big, SendMode::Cheaper)?;
            ua.end_unpacking()?;
            ub.end_unpacking()?;
            if va != i || vb != i + 100 {
                return Err(fail("channels mixed up"));
            }
            check(i, &big, "two channels")?;
        }
    }
    Ok(())
}

fn case_threads(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    let (rank, size) = (c.rank(), c.size());
    let rounds = (c.opts.volume / 4).max(10) as u64;
    // Every rank: 2 sender threads (each to every other rank) and 2 receiver threads waiting
    // in begin_unpacking on the same channel; each receiver must get whole messages.
    let total_in = 2 * rounds * (size as u64 - 1);
    let got = Arc::new(std::sync::Mutex::new(vec![0u64; size * 2]));
    std::thread::scope(|s| -> Result<()> {
        let mut hs = Vec::new();
        for t in 0..2u64 {
            let ch = &ch;
            hs.push(s.spawn(move || -> Result<()> {
                for i in 0..rounds {
                    for peer in (0..size).filter(|&p| p != rank) {
                        let body: Vec<u8> = (0..1000 + (i as usize % 5) * 7000)
                            .map(|j| pat(i * 10 + t, j))
                            .collect();
                        let mut p = ch.begin_packing(peer)?;
                        p.pack_value(&[t, i, body.len() as u64], RecvMode::Express)?;
                        p.pack(&body, RecvMode::Cheaper)?;
                        p.end_packing()?;
                    }
                }
                Ok(())
            }));
        }
        let remaining = Arc::new(std::sync::atomic::AtomicU64::new(total_in));
        for _ in 0..2 {
            let (ch, got, remaining) = (&ch, got.clone(), remaining.clone());
            hs.push(s.spawn(move || -> Result<()> {
                loop {
                    // Claim one message before waiting, so no thread waits for a message that
                    // will never come.
                    let prev = remaining.fetch_update(
                        std::sync::atomic::Ordering::AcqRel,
                        std::sync::atomic::Ordering::Acquire,
                        |v| v.checked_sub(1),
                    );
                    if prev.is_err() {
                        return Ok(());
                    }
                    let mut u = ch.begin_unpacking()?;
                    let from = u.remote();
                    let [t, i, n]: [u64; 3] = u.unpack_value()?;
                    let mut body = vec![0u8; n as usize];
                    u.unpack(&mut body, SendMode::Cheaper)?;
                    u.end_unpacking()?;
                    check(i * 10 + t, &body, "threads body")?;
                    let mut g = got.lock().map_err(|_| fail("lock"))?;
                    g[from * 2 + t as usize] += 1;
                }
            }));
        }
        for h in hs {
            h.join().map_err(|_| fail("thread panicked"))??;
        }
        Ok(())
    })?;
    let g = got.lock().map_err(|_| fail("lock"))?;
    for from in (0..size).filter(|&p| p != rank) {
        for t in 0..2 {
            if g[from * 2 + t] != rounds {
                return Err(fail(format!(
                    "threads: got {} messages from rank {from} thread {t}, expected {rounds}",
                    g[from * 2 + t]
                )));
            }
        }
    }
    c.barrier("done")
}

fn case_checked_mismatch(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "checked=true")?;
    if c.rank() == 0 {
        let sent = (|| -> Result<()> {
            let mut p = ch.begin_packing(1)?;
            p.pack_safer(&[1u8; 8], RecvMode::Express)?;
            p.pack_safer(&[2u8; 8], RecvMode::Express)?;
            p.end_packing()
        })();
        // The receiver stops reading when it detects the mismatch, and may close its side
        // before this sender is done: a peer failure here is an accepted outcome.
        match sent {
            Ok(()) => {}
            Err(e) if e.is_peer_failure() || matches!(e, Error::Poisoned { .. }) => {}
            Err(e) => return Err(e),
        }
    } else if c.rank() == 1 {
        let mut u = ch.begin_unpacking()?;
        let mut a = [0u8; 8];
        u.unpack_express(&mut a, SendMode::Safer)?;
        let mut b = [0u8; 16];
        match u.unpack_express(&mut b, SendMode::Safer) {
            Err(Error::UnpackMismatch { sent, expected, .. }) => {
                let ok = matches!(sent, crate::error::PieceOrEnd::Piece(p) if p.len == 8 && p.index == 1)
                    && matches!(expected, crate::error::PieceOrEnd::Piece(p) if p.len == 16 && p.index == 1);
                if !ok {
                    return Err(fail(format!(
                        "mismatch reported with wrong descriptors: {sent} vs {expected}"
                    )));
                }
            }
            Err(e) => return Err(fail(format!("expected UnpackMismatch, got {e}"))),
            Ok(()) => {
                return Err(fail(
                    "a 16-byte unpack of an 8-byte piece was accepted in checked mode",
                ))
            }
        }
    }
    c.barrier("done")
}

/// `Packer::flush` makes what was packed so far reach the receiver before `end_packing`: here
/// the sender waits for the receiver's answer to an EXPRESS header before packing the body
/// (a user-level rendezvous inside one message). A driver that keeps flushed bytes back makes
/// both ranks wait: the channel's timeout turns that into a failure of the case.
fn case_flush(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "timeout_ms=30000")?;
    for (k, &len) in [0usize, 100, 100_000].iter().enumerate() {
        let tag = 4000 + k as u64;
        if c.rank() == 0 {
            let body: Vec<u8> = (0..len).map(|i| pat(tag, i)).collect();
            let mut p = ch.begin_packing(1)?;
            p.pack_value(&(len as u64), RecvMode::Express)?;
            p.pack_safer(&[k as u8; 3], RecvMode::Cheaper)?;
            p.flush()?;
            let mut go = ch.begin_unpacking_from(1)?;
            let ack: u64 = go.unpack_value()?;
            go.end_unpacking()?;
            if ack != len as u64 {
                return Err(fail(format!("answer {ack} to a header of {len}")));
            }
            p.pack(&body, RecvMode::Cheaper)?;
            p.flush()?; // a second flush, then the end
            p.end_packing()?;
        } else if c.rank() == 1 {
            let mut u = ch.begin_unpacking_from(0)?;
            let n: u64 = u.unpack_value()?;
            let mut three = [0u8; 3];
            u.unpack(&mut three, SendMode::Safer)?;
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&n, RecvMode::Express)?;
            p.end_packing()?;
            let mut body = vec![0u8; n as usize];
            u.unpack(&mut body, SendMode::Cheaper)?;
            u.end_unpacking()?;
            if three != [k as u8; 3] {
                return Err(fail(format!("small piece {three:?} after a flush")));
            }
            check(tag, &body, "body after a flush")?;
        }
    }
    // A flush in the middle of what the receiver sees as one gather group (two CHEAPER
    // pieces beyond every copy threshold): the sender's group is cut in two, and the
    // receiver follows.
    let (a, b): (Vec<u8>, Vec<u8>) = (
        (0..300_000).map(|i| pat(4100, i)).collect(),
        (0..200_000).map(|i| pat(4101, i)).collect(),
    );
    if c.rank() == 0 {
        let mut p = ch.begin_packing(1)?;
        p.pack(&a, RecvMode::Cheaper)?;
        p.flush()?;
        p.pack(&b, RecvMode::Cheaper)?;
        p.end_packing()?;
    } else if c.rank() == 1 {
        let (mut ga, mut gb) = (vec![0u8; a.len()], vec![0u8; b.len()]);
        let mut u = ch.begin_unpacking_from(0)?;
        u.unpack(&mut ga, SendMode::Cheaper)?;
        u.unpack(&mut gb, SendMode::Cheaper)?;
        u.end_unpacking()?;
        check(4100, &ga, "first piece of a group cut by a flush")?;
        check(4101, &gb, "second piece of a group cut by a flush")?;
    }
    Ok(())
}

fn case_peer_closes(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    if !ch.capabilities().detects_peer_death {
        // The driver says it cannot tell a dead peer from a slow one (MPI): skip.
        return Ok(());
    }
    const HEAD: usize = 64;
    const FIRST: usize = 1 << 20;
    if c.rank() == 1 {
        // Part of the message leaves (flushed), then the packer is dropped: abandoned midway.
        let mut p = ch.begin_packing(0)?;
        p.pack_safer(&[7u8; HEAD], RecvMode::Express)?;
        let first: Vec<u8> = (0..FIRST).map(|i| pat(77, i)).collect();
        p.pack_safer(&first, RecvMode::Express)?;
        p.flush()?;
        drop(p);
        drop(ch); // and the process (here: its channel) goes away
    } else if c.rank() == 0 {
        let start = Instant::now();
        let r = (|| -> Result<()> {
            let mut u = ch.begin_unpacking_from(1)?;
            let mut head = [0u8; HEAD];
            u.unpack_express(&mut head, SendMode::Safer)?;
            if head != [7u8; HEAD] {
                return Err(fail("the start of an abandoned message arrived corrupted"));
            }
            let mut first = vec![0u8; FIRST];
            u.unpack_express(&mut first, SendMode::Safer)?;
            check(77, &first, "first piece of an abandoned message")?;
            let mut rest = vec![0u8; 4 << 20];
            u.unpack_express(&mut rest, SendMode::Safer)?;
            u.end_unpacking()
        })();
        match r {
            Ok(()) => return Err(fail("a message abandoned midway was delivered as complete")),
            Err(e) if e.to_string().starts_with("conformance kit") => return Err(e),
            Err(_) => {}
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(fail("peer failure took more than 30 s to report"));
        }
        // Later receives on that connection report the failure at once.
        if ch.begin_unpacking_from(1).is_ok() {
            return Err(fail(
                "connection still usable after the peer abandoned a message",
            ));
        }
    }
    Ok(())
}

/// How long the failure cases give a call before they call it stranded (the channel's
/// `timeout_ms` turns a hang into `Error::Timeout`, which these cases refuse).
const STRANDED_MS: u64 = 20_000;

/// A call that had to fail did: any error but a timeout (a timeout means it hung).
fn failed_promptly(r: Result<()>, what: &str) -> Result<()> {
    match r {
        Ok(()) => Err(fail(format!("{what}: returned Ok"))),
        Err(Error::Timeout(t)) => Err(fail(format!("{what}: stranded ({t:?} without an answer)"))),
        Err(e) if e.to_string().starts_with("conformance kit") => Err(e),
        Err(_) => Ok(()),
    }
}

/// Whether the driver can finish a connection so that its peer learns it (every driver but
/// mpi, which says so by not detecting peer death: an MPI rank cannot make a peer's pending
/// MPI call fail). The failure cases skip the others.
fn tears_down(ch: &Channel) -> bool {
    ch.capabilities().detects_peer_death
}

/// A whole message of one `len`-byte CHEAPER piece after an EXPRESS length.
fn send_sized(ch: &Channel, to: usize, tag: u64, len: usize) -> Result<()> {
    send_sized_as(ch, to, tag, len, SendMode::Cheaper)
}

/// [`send_sized`] with the body sent in mode `s` (not LATER).
fn send_sized_as(ch: &Channel, to: usize, tag: u64, len: usize, s: SendMode) -> Result<()> {
    let body: Vec<u8> = (0..len).map(|i| pat(tag, i)).collect();
    let mut p = ch.begin_packing(to)?;
    p.pack_value(&(len as u64), RecvMode::Express)?;
    send_piece(&mut p, &body, s, RecvMode::Cheaper, None)?;
    p.end_packing()
}

/// Receive what [`send_sized`] sent and check it.
fn recv_sized(ch: &Channel, from: usize, tag: u64) -> Result<()> {
    recv_sized_as(ch, from, tag, None, SendMode::Cheaper, "message")
}

/// Receive what [`send_sized_as`] sent in mode `s` and check it (and its length, if `want`).
fn recv_sized_as(
    ch: &Channel,
    from: usize,
    tag: u64,
    want: Option<usize>,
    s: SendMode,
    what: &str,
) -> Result<()> {
    let mut u = ch.begin_unpacking_from(from)?;
    let n: u64 = u.unpack_value()?;
    if want.is_some_and(|w| n != w as u64) {
        return Err(fail(format!("{what}: length {n}, expected {want:?}")));
    }
    let mut body = vec![0u8; n as usize];
    u.unpack(&mut body, s)?;
    u.end_unpacking()?;
    check(tag, &body, what)
}

/// After a failure in the middle of a message between ranks 0 and 1, the connection is
/// finished in both directions on both sides: every new message either way fails (at once,
/// or at the latest at its end), and nothing sent on it is delivered. Every rank calls it
/// (the barriers are the session's); ranks other than 0 and 1 only wait.
fn connection_refused_both_ways(c: &Ctx<'_>, ch: &Channel, what: &str) -> Result<()> {
    const LEN: usize = 1 << 20;
    c.barrier(&format!("{what}-refused"))?;
    if c.rank() > 1 {
        return c.barrier(&format!("{what}-refused-done"));
    }
    let peer = 1 - c.rank();
    failed_promptly(
        send_sized(ch, peer, 91, LEN),
        &format!("{what}: a 1 MiB send on the broken connection"),
    )?;
    failed_promptly(
        recv_sized(ch, peer, 91),
        &format!("{what}: a receive on the broken connection"),
    )?;
    c.barrier(&format!("{what}-refused-done"))
}

/// A receiver that gives up in the middle of a message bigger than every buffer (drops its
/// `Unpacker`; or, in checked mode, gets `UnpackMismatch`) and stays alive: the sender's
/// `end_packing` returns (an error, or `Ok` if the transport had taken the whole message)
/// instead of waiting forever, and the connection is then refused both ways.
fn case_receiver_abandons(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    const BIG: usize = 16 << 20;
    for (k, extra) in ["", "checked=true"].iter().enumerate() {
        let opts = format!(
            "timeout_ms={STRANDED_MS}{}{extra}",
            if extra.is_empty() { "" } else { "," }
        );
        let ch = c.open(&format!("-{k}"), &opts)?;
        if !tears_down(&ch) {
            return Ok(());
        }
        let what = if extra.is_empty() {
            "dropped Unpacker"
        } else {
            "UnpackMismatch"
        };
        match c.rank() {
            0 => {
                let body: Vec<u8> = (0..BIG).map(|i| pat(61, i)).collect();
                let r = (|| {
                    let mut p = ch.begin_packing(1)?;
                    p.pack_value(&(BIG as u64), RecvMode::Express)?;
                    p.pack(&body, RecvMode::Cheaper)?;
                    p.end_packing()
                })();
                // Ok only if the transport had taken every byte before the receiver gave up;
                // otherwise an error, and never a wait without end.
                if let Err(Error::Timeout(t)) = r {
                    return Err(fail(format!(
                        "{what}: the sender of a 16 MiB message was stranded ({t:?})"
                    )));
                }
            }
            1 => {
                let mut u = ch.begin_unpacking_from(0)?;
                let n: u64 = u.unpack_value()?;
                if n != BIG as u64 {
                    return Err(fail(format!("header {n}")));
                }
                if extra.is_empty() {
                    drop(u);
                } else {
                    let mut wrong = vec![0u8; BIG / 2];
                    match u.unpack(&mut wrong, SendMode::Cheaper) {
                        Err(Error::UnpackMismatch { .. }) => {}
                        Err(e) => return Err(fail(format!("expected UnpackMismatch, got {e}"))),
                        Ok(()) => {
                            return Err(fail("a 8 MiB unpack of a 16 MiB piece was accepted"))
                        }
                    }
                }
            }
            _ => {}
        }
        connection_refused_both_ways(c, &ch, what)?;
        c.barrier(&format!("receiver-abandons-{k}"))?;
    }
    Ok(())
}

/// A `Packer` dropped before `end_packing`, the sender staying alive: with nothing of the
/// message sent it is discarded and the connection carries the next message; after part of
/// it left (flushed, or published early by the driver) the receiver gets an error, never the
/// message as if complete.
fn case_sender_abandons(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let opts = format!("timeout_ms={STRANDED_MS}");
    // Nothing packed: discarded, the connection intact.
    let ch = c.open("-empty", &opts)?;
    match c.rank() {
        0 => {
            drop(ch.begin_packing(1)?);
            send_sized(&ch, 1, 71, 100)?;
        }
        1 => recv_sized(&ch, 0, 71)
            .map_err(|e| fail(format!("after an empty Packer was dropped: {e}")))?,
        _ => {}
    }
    c.barrier("empty-done")?;
    if !tears_down(&ch) {
        return Ok(());
    }
    // An EXPRESS header and a CHEAPER body of 16 B to 16 MiB, dropped without a flush, then
    // the same after a flush: the receiver must never see that message complete.
    let sizes = [16usize, 1000, 8000, 100_000, 16 << 20];
    for flush in [false, true] {
        for (k, &len) in sizes.iter().enumerate() {
            let ch = c.open(&format!("-{}{k}", if flush { "f" } else { "n" }), &opts)?;
            let tag = 700 + k as u64;
            match c.rank() {
                0 => {
                    let body: Vec<u8> = (0..len).map(|i| pat(tag, i)).collect();
                    let mut p = ch.begin_packing(1)?;
                    p.pack_value(&(len as u64), RecvMode::Express)?;
                    p.pack(&body, RecvMode::Cheaper)?;
                    if flush {
                        p.flush()?;
                    }
                    drop(p);
                    // Then a good message: delivered if the first was discarded whole.
                    let _ = send_sized(&ch, 1, tag + 50, 64);
                }
                1 => {
                    // Ok(true): the abandoned message arrived whole (a failure); Ok(false): it
                    // was discarded and the next one arrived intact; an error: refused.
                    let r = (|| -> Result<bool> {
                        let mut u = ch.begin_unpacking_from(0)?;
                        let n: u64 = u.unpack_value()?;
                        if n == len as u64 {
                            let mut body = vec![0u8; len];
                            u.unpack(&mut body, SendMode::Cheaper)?;
                            u.end_unpacking()?;
                            Ok(true)
                        } else if n == 64 {
                            let mut body = vec![0u8; 64];
                            u.unpack(&mut body, SendMode::Cheaper)?;
                            u.end_unpacking()?;
                            check(tag + 50, &body, "message after a discarded one")?;
                            Ok(false)
                        } else {
                            Err(fail(format!("header {n}: neither message")))
                        }
                    })();
                    match r {
                        Ok(true) => {
                            return Err(fail(format!(
                                "a message of {len} B abandoned{} before end_packing was \
                                 delivered as complete",
                                if flush { " after a flush" } else { "" }
                            )))
                        }
                        Ok(false) if flush => {
                            return Err(fail(format!("a flushed {len} B message vanished")))
                        }
                        Ok(false) => {}
                        Err(e) => failed_promptly(Err(e), "abandoned message")?,
                    }
                }
                _ => {}
            }
            if flush {
                // Everything packed had left: the connection is finished both ways.
                connection_refused_both_ways(c, &ch, &format!("flushed {len} B, dropped"))?;
            }
            c.barrier(&format!("abandon-{flush}-{k}"))?;
        }
    }
    // The receiver is already blocked in the middle of the message (its body announced, 16
    // MiB) when the sender drops the packer: it gets an error, and the connection is finished
    // both ways.
    const BIG: usize = 16 << 20;
    let ch = c.open("-blocked", &opts)?;
    match c.rank() {
        0 => {
            let mut p = ch.begin_packing(1)?;
            p.pack_value(&(BIG as u64), RecvMode::Express)?;
            p.flush()?;
            c.barrier("blocked-header")?;
            std::thread::sleep(Duration::from_millis(100));
            drop(p);
        }
        1 => {
            let mut u = ch.begin_unpacking_from(0)?;
            let n: u64 = u.unpack_value()?;
            c.barrier("blocked-header")?;
            let mut body = vec![0u8; n as usize];
            let r = u.unpack(&mut body, SendMode::Cheaper);
            failed_promptly(
                r.and_then(|()| u.end_unpacking()),
                "a receiver blocked in a message its sender abandoned",
            )?;
        }
        _ => c.barrier("blocked-header")?,
    }
    connection_refused_both_ways(c, &ch, "abandoned under a blocked receiver")
}

/// Unchecked mode: a receiver whose unpacks do not match the message (shorter, longer, or a
/// piece skipped), small pieces and pieces beyond every buffer: an error at that message on
/// the receiver, the sender never stranded (it may finish if everything had left), the
/// connection then refused both ways, and nothing misread.
fn case_wrong_unpacks(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    #[derive(Clone, Copy, Debug)]
    enum Wrong {
        Short,
        Long,
        Skip,
    }
    let plans: [(usize, Wrong); 7] = [
        (100, Wrong::Short),
        (4 << 20, Wrong::Short),
        (100, Wrong::Long),
        (4 << 20, Wrong::Long),
        (20_000, Wrong::Skip),
        (16 << 20, Wrong::Skip),
        (60, Wrong::Skip),
    ];
    for (k, &(len, wrong)) in plans.iter().enumerate() {
        let ch = c.open(&format!("-{k}"), &format!("timeout_ms={STRANDED_MS}"))?;
        if !tears_down(&ch) {
            return Ok(());
        }
        let what = format!("{wrong:?} unpack of a {len} B piece");
        match c.rank() {
            0 => {
                let r = send_sized(&ch, 1, 80 + k as u64, len);
                // The sender may have finished before the receiver noticed; it must not hang.
                if let Err(Error::Timeout(t)) = r {
                    return Err(fail(format!("{what}: the sender was stranded ({t:?})")));
                }
                // A second message behind it must not be taken for part of the first.
                let _ = send_sized(&ch, 1, 90, 32);
            }
            1 => {
                let mut b = vec![
                    0u8;
                    match wrong {
                        Wrong::Short => len / 2,
                        Wrong::Long => len * 2,
                        Wrong::Skip => 0,
                    }
                ];
                let r = (|| -> Result<()> {
                    let mut u = ch.begin_unpacking_from(0)?;
                    let n: u64 = u.unpack_value()?;
                    if n != len as u64 {
                        return Err(fail(format!("header {n}")));
                    }
                    if !matches!(wrong, Wrong::Skip) {
                        u.unpack(&mut b, SendMode::Cheaper)?;
                    }
                    u.end_unpacking()
                })();
                failed_promptly(r, &format!("{what}: the receiver"))?;
            }
            _ => {}
        }
        connection_refused_both_ways(c, &ch, &what)?;
        c.barrier(&format!("wrong-{k}"))?;
    }
    Ok(())
}

/// Peers that leave (close their channel; a process would exit) while this rank is not
/// waiting: a little later, every send to them fails, and `try_begin_unpacking` reports that
/// no peer is left instead of `None` forever. Skipped when the driver cannot detect a dead
/// peer.
fn case_dead_peer_idle(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", &format!("timeout_ms={STRANDED_MS}"))?;
    if !ch.capabilities().detects_peer_death {
        return Ok(());
    }
    // A message each way first, so the connections are known to work.
    if c.rank() == 0 {
        for p in 1..c.size() {
            send_sized(&ch, p, 95, 10)?;
        }
    } else {
        recv_sized(&ch, 0, 95)?;
    }
    c.barrier("dead-ready")?;
    if c.rank() != 0 {
        drop(ch);
        c.barrier("dead-gone")?;
        return Ok(());
    }
    c.barrier("dead-gone")?;
    std::thread::sleep(Duration::from_millis(500));
    const BOUND: Duration = Duration::from_secs(10);
    for p in 1..c.size() {
        // The very first send fails: the peer left while this rank was idle, and a send that
        // returned `Ok` here would be a message lost without a word.
        let r = (|| {
            let mut m = ch.begin_packing(p)?;
            m.pack_safer(&[5u8; 8], RecvMode::Cheaper)?;
            m.end_packing()
        })();
        match r {
            Err(Error::Timeout(t)) => {
                return Err(fail(format!("a send to departed rank {p} hung ({t:?})")))
            }
            Err(_) => {}
            Ok(()) => {
                return Err(fail(format!(
                    "the first send to rank {p}, which left while this rank was idle, \
                     returned Ok"
                )))
            }
        }
        // Once known, every later call towards it fails at once.
        if ch.begin_packing(p).is_ok() {
            return Err(fail(format!(
                "a send to departed rank {p} started after an error"
            )));
        }
    }
    let t0 = Instant::now();
    loop {
        match ch.try_begin_unpacking() {
            Err(_) => break,
            Ok(Some(u)) => {
                return Err(fail(format!(
                    "a message from rank {} nobody sent",
                    u.remote()
                )))
            }
            Ok(None) => {}
        }
        if t0.elapsed() > BOUND {
            return Err(fail(format!(
                "try_begin_unpacking still says `None` {BOUND:?} after every peer left"
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // And a blocking any-source receive says so too (a timeout means it waited for nobody).
    failed_promptly(
        ch.begin_unpacking().map(drop),
        "begin_unpacking after every peer left",
    )
}

/// How long the late sender of `idle_wait` waits before it sends.
const IDLE_LATE: Duration = Duration::from_millis(400);

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`): how the kit, and driver
/// tests of their own, tell a waiting thread that sleeps from one that spins.
///
/// # Errors
///
/// [`Error::Io`] when `clock_gettime` fails.
pub fn thread_cpu_time() -> Result<Duration> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map_err(|e| Error::io("clock_gettime(CLOCK_THREAD_CPUTIME_ID)", e.into()))?;
    Ok(Duration::from(t))
}

/// An any-source receiver whose senders are idle (one late, one closed when the driver can
/// tell a closed peer) must sleep, not spin: the progress policy's spin-then-block, and no
/// closed connection that keeps the wait returning at once. Skipped with `progress=poll`
/// (spinning is what it asks for).
fn case_idle_wait(c: &Ctx<'_>) -> Result<()> {
    if c.size() < 2 {
        return Ok(());
    }
    let ch = c.open("", "")?;
    if ch.config().progress == crate::progress::ProgressMode::Poll {
        return Ok(());
    }
    let closer = c.size() >= 3 && ch.capabilities().detects_peer_death;
    c.barrier("idle-open")?;
    let body: Vec<u8> = (0..65_536).map(|i| pat(31, i)).collect();
    match c.rank() {
        0 => {
            let cpu0 = thread_cpu_time()?;
            let t0 = Instant::now();
            let mut u = ch.begin_unpacking()?;
            let wall = t0.elapsed();
            let cpu = thread_cpu_time()? - cpu0;
            if u.remote() != 1 {
                return Err(fail(format!(
                    "a message from rank {} while only rank 1 sent",
                    u.remote()
                )));
            }
            let n: u64 = u.unpack_value()?;
            let mut got = vec![0u8; n as usize];
            u.unpack(&mut got, SendMode::Cheaper)?;
            u.end_unpacking()?;
            check(31, &got, "the late sender's message")?;
            if wall < IDLE_LATE / 2 {
                return Err(fail(format!(
                    "the any-source wait ended after {wall:?}, before the late sender sent"
                )));
            }
            if cpu.as_secs_f64() > 0.3 * wall.as_secs_f64() {
                return Err(fail(format!(
                    "the any-source receiver spun: {cpu:?} of CPU over a {wall:?} wait \
                     (progress {:?}{})",
                    ch.config().progress,
                    if closer { ", a peer closed" } else { "" }
                )));
            }
        }
        1 => {
            std::thread::sleep(IDLE_LATE);
            let mut p = ch.begin_packing(0)?;
            p.pack_value(&(body.len() as u64), RecvMode::Express)?;
            p.pack(&body, RecvMode::Cheaper)?;
            p.end_packing()?;
        }
        r if closer && r == c.size() - 1 => drop(ch),
        _ => {}
    }
    Ok(())
}

/// Run the kit on this rank of an already built session (every rank calls it).
///
/// # Errors
///
/// The first failed case, naming it and the rank, or the channel's error that stopped it.
pub fn run_rank(session: &Session, opts: &KitOptions) -> Result<Vec<&'static str>> {
    if let Some(only) = &opts.cases {
        let unknown: Vec<&String> = only
            .iter()
            .filter(|c| !CASES.iter().any(|(n, _)| n == c))
            .collect();
        if !unknown.is_empty() {
            return Err(Error::BadConfig(format!(
                "conformance kit: unknown case(s) {unknown:?}; the cases are {:?}",
                case_names()
            )));
        }
    }
    let mut ran = Vec::new();
    for (name, case) in CASES {
        if let Some(only) = &opts.cases {
            if !only.iter().any(|c| c == name) {
                continue;
            }
        }
        let ctx = Ctx {
            session,
            opts,
            case: name,
        };
        ctx.barrier("start")?;
        case(&ctx).map_err(|e| fail(format!("case `{name}` on rank {}: {e}", session.rank())))?;
        ctx.barrier("end")?;
        ran.push(*name);
    }
    Ok(ran)
}

/// Run the kit with `ranks` threads, each with its own session built by `build` from a
/// [`ThreadBootstrap`]. Returns the cases that ran; the first failure is returned as an error
/// naming the case and rank.
///
/// # Errors
///
/// The first failed case, naming it and the rank; the first error of `build`.
pub fn run_threads<F>(ranks: usize, opts: KitOptions, build: F) -> Result<Vec<&'static str>>
where
    F: Fn(Box<dyn Bootstrap>) -> Result<Session> + Send + Sync,
{
    let boots = ThreadBootstrap::group(ranks);
    let build = &build;
    let opts = &opts;
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .map(|b| {
                s.spawn(move || -> Result<Vec<&'static str>> {
                    let session = build(Box::new(b))?;
                    run_rank(&session, opts)
                })
            })
            .collect();
        let mut ran = Vec::new();
        let mut errors = Vec::new();
        for (rank, h) in hs.into_iter().enumerate() {
            match h.join().unwrap_or_else(|_| Err(fail("a rank panicked"))) {
                Ok(v) => ran = v,
                Err(e) => errors.push(format!("rank {rank}: {e}")),
            }
        }
        if errors.is_empty() {
            Ok(ran)
        } else {
            Err(fail(errors.join("\n")))
        }
    })
}

/// The names of every case, in the order they run.
pub fn case_names() -> Vec<&'static str> {
    CASES.iter().map(|(n, _)| *n).collect()
}
