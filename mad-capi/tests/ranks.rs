//! The C API with three ranks, each a separate process (the test starts the bootstrap server
//! `madrun` runs and re-executes its own binary as the ranks), over tcp and shm: handles of
//! messages to and from several peers open at once on several threads, any-source receives,
//! receives through the readiness descriptor (arm, `poll(2)`, disarm), a second message to a
//! peer refused while the first is open, no heap allocation per message
//! once a peer's handle slots exist (piece by piece and one call), and a channel freed while a
//! message is still open (its handle stays valid and fails cleanly).

use std::ffi::{c_void, CStr, CString};
use std::ptr::null_mut;

use mad_core::conformance::alloc::{allocs, Counting};
use mad_core::conformance::jobs::Launch;
use madeleine_c::*;

const RANKS: usize = 3;
const MESSAGES: usize = 300;

#[global_allocator]
static A: Counting = Counting;

/// Ranks 0 and 1 ping-pong 8-byte messages (an EXPRESS header and a CHEAPER body) through the C
/// API, piece by piece then with `mad_send`/`mad_recv`, and return this thread's allocations
/// over the rounds after the first ten.
fn ping_pong_allocations(ch: Ch, me: usize) -> u64 {
    let peer = 1 - me;
    let mut head = [me as u64; 1];
    let mut body = [7u8; 8];
    let mut before = 0;
    for round in 0..210 {
        if round == 10 {
            before = allocs();
        }
        let one_call = round % 2 == 1;
        for turn in 0..2 {
            if (turn == 0) == (me == 0) {
                // SAFETY: valid channel and buffers, alive until the end of the message.
                unsafe {
                    if one_call {
                        let pieces = [
                            MadPiece {
                                data: head.as_mut_ptr().cast(),
                                len: 8,
                                send: MAD_SEND_SAFER,
                                recv: MAD_RECV_EXPRESS,
                            },
                            MadPiece {
                                data: body.as_mut_ptr().cast(),
                                len: 8,
                                send: MAD_SEND_CHEAPER,
                                recv: MAD_RECV_CHEAPER,
                            },
                        ];
                        ok(mad_send(ch.0, peer, pieces.as_ptr(), 2));
                    } else {
                        let mut p = null_mut();
                        ok(mad_begin_packing(ch.0, peer, &mut p));
                        ok(mad_pack(
                            p,
                            head.as_ptr().cast(),
                            8,
                            MAD_SEND_SAFER,
                            MAD_RECV_EXPRESS,
                        ));
                        ok(mad_pack(
                            p,
                            body.as_ptr().cast(),
                            8,
                            MAD_SEND_CHEAPER,
                            MAD_RECV_CHEAPER,
                        ));
                        ok(mad_end_packing(p));
                    }
                }
            } else {
                // SAFETY: as above.
                unsafe {
                    if one_call {
                        let pieces = [
                            MadPiece {
                                data: head.as_mut_ptr().cast(),
                                len: 8,
                                send: MAD_SEND_SAFER,
                                recv: MAD_RECV_EXPRESS,
                            },
                            MadPiece {
                                data: body.as_mut_ptr().cast(),
                                len: 8,
                                send: MAD_SEND_CHEAPER,
                                recv: MAD_RECV_CHEAPER,
                            },
                        ];
                        ok(mad_recv(ch.0, peer, pieces.as_ptr(), 2, null_mut()));
                    } else {
                        let mut u = null_mut();
                        ok(mad_begin_unpacking_from(ch.0, peer, &mut u));
                        ok(mad_unpack(
                            u,
                            head.as_mut_ptr().cast(),
                            8,
                            MAD_SEND_SAFER,
                            MAD_RECV_EXPRESS,
                        ));
                        ok(mad_unpack(
                            u,
                            body.as_mut_ptr().cast(),
                            8,
                            MAD_SEND_CHEAPER,
                            MAD_RECV_CHEAPER,
                        ));
                        ok(mad_end_unpacking(u));
                    }
                }
                assert_eq!(head[0], peer as u64);
                head[0] = me as u64;
            }
        }
    }
    allocs() - before
}

fn last() -> String {
    // SAFETY: `mad_last_error` returns a valid NUL-terminated string of this thread.
    unsafe { CStr::from_ptr(mad_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(rc: i32) {
    assert_eq!(rc, MAD_OK, "status {rc}: {}", last());
}

/// Handles may cross threads as raw pointers do in C.
#[derive(Clone, Copy)]
struct Ch(*mut MadChannel);
// SAFETY: a channel is shared by threads in C; its calls are thread-safe.
unsafe impl Send for Ch {}
// SAFETY: as above.
unsafe impl Sync for Ch {}

fn open(s: *mut MadSession, name: &str, spec: &str) -> Ch {
    let (n, sp) = (CString::new(name).unwrap(), CString::new(spec).unwrap());
    let mut ch = null_mut();
    // SAFETY: valid session, strings and out pointer.
    ok(unsafe { mad_channel_open_spec(s, n.as_ptr(), sp.as_ptr(), &mut ch) });
    Ch(ch)
}

/// A message of a 16-byte EXPRESS header (sender, sequence number) and a CHEAPER body whose
/// length the sequence number gives (beyond any ring or buffer every 50th message).
fn send(ch: Ch, to: usize, me: usize, seq: usize) {
    let len = if seq % 50 == 49 {
        3 << 20
    } else {
        seq * 7 % 4096
    };
    let head = [me as u64, seq as u64];
    let body: Vec<u8> = (0..len).map(|i| (i + seq + me) as u8).collect();
    let mut p = null_mut();
    // SAFETY: valid channel and pointers; `body` lives until `mad_end_packing`.
    unsafe {
        ok(mad_begin_packing(ch.0, to, &mut p));
        ok(mad_pack(
            p,
            head.as_ptr().cast(),
            16,
            MAD_SEND_SAFER,
            MAD_RECV_EXPRESS,
        ));
        ok(mad_pack(
            p,
            body.as_ptr().cast(),
            len,
            MAD_SEND_CHEAPER,
            MAD_RECV_CHEAPER,
        ));
        ok(mad_end_packing(p));
    }
}

/// Receive one message of [`send`] (from `from`, or from any peer) and check it; returns its
/// sender and sequence number.
fn recv(ch: Ch, from: Option<usize>) -> (usize, usize) {
    let mut u = null_mut();
    // SAFETY: valid channel and pointer.
    unsafe {
        match from {
            Some(r) => ok(mad_begin_unpacking_from(ch.0, r, &mut u)),
            None => ok(mad_begin_unpacking(ch.0, &mut u)),
        }
    }
    read_message(u, from)
}

/// [`recv`] from any peer as an event loop does it: try, arm the readiness descriptor
/// (`MAD_AGAIN`: try again), sleep on it with `poll(2)`, disarm; a descriptor quiet for 10 s
/// while a message is due is a lost wake-up. Returns the message and the number of sleeps.
fn recv_polled(ch: Ch) -> ((usize, usize), usize) {
    // SAFETY: a valid channel.
    let fd = unsafe { mad_channel_readiness_fd(ch.0) };
    let mut sleeps = 0;
    loop {
        let mut u = null_mut();
        // SAFETY: valid channel and pointer.
        match unsafe { mad_try_begin_unpacking(ch.0, &mut u) } {
            MAD_AGAIN => {}
            rc => {
                ok(rc);
                return (read_message(u, None), sleeps);
            }
        }
        // SAFETY: a valid channel.
        if fd < 0 || unsafe { mad_channel_arm(ch.0) } == MAD_AGAIN {
            continue;
        }
        sleeps += 1;
        // SAFETY: the channel's descriptor, open while the channel is.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let woke = mad_core::events::wait_readable(&[fd], Some(std::time::Duration::from_secs(10)))
            .expect("poll");
        // SAFETY: a valid channel.
        ok(unsafe { mad_channel_disarm(ch.0) });
        assert!(
            !woke.is_empty(),
            "lost wake-up: the armed descriptor stayed quiet for 10 s"
        );
    }
}

/// The pieces of a message of [`send`] whose unpacking began: check them and end it.
fn read_message(u: *mut MadUnpacker, from: Option<usize>) -> (usize, usize) {
    let mut head = [0u64; 2];
    // SAFETY: a valid unpacker and pointers; `body` lives until `mad_end_unpacking`.
    unsafe {
        let remote = mad_unpacker_remote(u);
        if let Some(r) = from {
            assert_eq!(remote, r);
        }
        ok(mad_unpack(
            u,
            head.as_mut_ptr().cast(),
            16,
            MAD_SEND_SAFER,
            MAD_RECV_EXPRESS,
        ));
        let (sender, seq) = (head[0] as usize, head[1] as usize);
        assert_eq!(sender, remote, "header names its sender");
        let len = if seq % 50 == 49 {
            3 << 20
        } else {
            seq * 7 % 4096
        };
        let mut body = vec![0u8; len];
        ok(mad_unpack(
            u,
            body.as_mut_ptr().cast::<c_void>(),
            len,
            MAD_SEND_CHEAPER,
            MAD_RECV_CHEAPER,
        ));
        ok(mad_end_unpacking(u));
        assert!(
            body.iter()
                .enumerate()
                .all(|(i, b)| *b == (i + seq + sender) as u8),
            "message {seq} from {sender}: body corrupted"
        );
        (sender, seq)
    }
}

fn rank(spec: &str) {
    let mut s = null_mut();
    // SAFETY: a valid out pointer.
    ok(unsafe { mad_session_init(&mut s) });
    // SAFETY: a valid session.
    let me = unsafe { mad_session_rank(s) };
    let ch = open(s, "c", spec);
    if me == 0 {
        // One thread per peer, each with its messages to and from that peer open while the
        // other thread's are: each handle is the channel's slot for that peer.
        std::thread::scope(|sc| {
            for peer in 1..RANKS {
                sc.spawn(move || {
                    for seq in 0..MESSAGES {
                        send(ch, peer, 0, seq);
                        assert_eq!(recv(ch, Some(peer)), (peer, seq));
                    }
                });
            }
        });
        // Any-source: both peers send at once, each in order.
        let mut next = [0usize; RANKS];
        for _ in 0..2 * MESSAGES {
            let (from, seq) = recv(ch, None);
            assert_eq!(seq, next[from], "order from rank {from}");
            next[from] += 1;
        }
        // The same as an event loop: arm, poll(2), disarm. The peers send when told to, with
        // pauses, so that this loop finds nothing at times and sleeps.
        for peer in 1..RANKS {
            send(ch, peer, 0, 0);
        }
        // (The peers' numbers go on: their next messages may have come in the loop above.)
        let mut sleeps = 0;
        for _ in 0..2 * MESSAGES {
            let ((from, seq), n) = recv_polled(ch);
            assert_eq!(seq, next[from], "order from rank {from} (polled)");
            next[from] += 1;
            sleeps += n;
        }
        // SAFETY: a valid channel.
        if unsafe { mad_channel_readiness_fd(ch.0) } >= 0 {
            assert!(sleeps > 0, "the event loop never slept on the descriptor");
        }
        // SAFETY: NULL is refused, not dereferenced.
        let rc = unsafe { mad_channel_disarm(std::ptr::null()) };
        assert_eq!(rc, MAD_E_BAD_CONFIG);
        // A second message to a peer while this thread's first is open is refused, and the
        // first goes on.
        let (mut p, mut q) = (null_mut(), null_mut());
        let x = 7u64;
        // SAFETY: valid channel and pointers.
        unsafe {
            ok(mad_begin_packing(ch.0, 1, &mut p));
            assert_eq!(
                mad_begin_packing(ch.0, 1, &mut q),
                MAD_E_IN_USE,
                "{}",
                last()
            );
            ok(mad_pack(
                p,
                (&x as *const u64).cast(),
                8,
                MAD_SEND_SAFER,
                MAD_RECV_EXPRESS,
            ));
            ok(mad_end_packing(p));
        }
    } else {
        for seq in 0..MESSAGES {
            assert_eq!(recv(ch, Some(0)), (0, seq));
            send(ch, 0, me, seq);
        }
        for seq in 0..MESSAGES {
            send(ch, 0, me, seq);
        }
        // For rank 0's event loop, when it is ready, with pauses so that it sleeps.
        assert_eq!(recv(ch, Some(0)), (0, 0));
        for seq in MESSAGES..2 * MESSAGES {
            if seq % 100 == 0 {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            send(ch, 0, me, seq);
        }
        if me == 1 {
            let mut u = null_mut();
            let mut x = 0u64;
            // SAFETY: valid channel and pointers.
            unsafe {
                ok(mad_begin_unpacking_from(ch.0, 0, &mut u));
                ok(mad_unpack(
                    u,
                    (&mut x as *mut u64).cast(),
                    8,
                    MAD_SEND_SAFER,
                    MAD_RECV_EXPRESS,
                ));
                ok(mad_end_unpacking(u));
            }
            assert_eq!(x, 7);
        }
    }
    // No allocation per message once the peer's slots exist.
    if me < 2 {
        let n = ping_pong_allocations(ch, me);
        assert_eq!(
            n, 0,
            "rank {me}: {n} allocations over 400 messages of the C API"
        );
    }
    // A channel freed while this rank's message on it is open: the handle stays valid, and
    // ending it fails with a status, not a crash.
    let late = open(s, "late", spec);
    if me == 0 {
        let mut p = null_mut();
        let body = vec![1u8; 1 << 20];
        // SAFETY: valid channel and pointers; the handle is used after the free on purpose
        // (the API keeps a channel whose handles are out).
        unsafe {
            ok(mad_begin_packing(late.0, 1, &mut p));
            ok(mad_pack(
                p,
                body.as_ptr().cast(),
                body.len(),
                MAD_SEND_CHEAPER,
                MAD_RECV_CHEAPER,
            ));
            mad_channel_free(late.0);
            let rc = mad_end_packing(p);
            assert!(rc < 0, "ending a message of a freed channel: status {rc}");
        }
    } else {
        // Rank 1 sees the close: at the start of the message, or (when part of it had left
        // before the free) at its end; never the whole message.
        if me == 1 {
            let mut u = null_mut();
            let mut body = vec![0u8; 1 << 20];
            // SAFETY: valid channel and pointers.
            let rc = unsafe {
                match mad_begin_unpacking_from(late.0, 0, &mut u) {
                    MAD_OK => {
                        let rc = mad_unpack(
                            u,
                            body.as_mut_ptr().cast(),
                            body.len(),
                            MAD_SEND_CHEAPER,
                            MAD_RECV_CHEAPER,
                        );
                        if rc == MAD_OK {
                            mad_end_unpacking(u)
                        } else {
                            mad_unpacker_abandon(u);
                            rc
                        }
                    }
                    rc => rc,
                }
            };
            assert!(
                rc < 0,
                "a message ended after its channel was freed: status {rc}"
            );
        }
        // SAFETY: a valid channel, freed once.
        unsafe { mad_channel_free(late.0) };
    }
    // SAFETY: valid handles, freed once.
    unsafe {
        mad_channel_free(ch.0);
        mad_session_free(s);
    }
}

/// The ranks are children running `rank_program` (the C API builds each one's session from the
/// `madrun` variables the launch sets); the parent only starts and waits for them.
const LAUNCH: Launch = Launch::new(
    "rank_program",
    "MAD_CAPI_TEST_ROLE",
    "MAD_CAPI_TEST_SPEC",
    |b| mad_core::Session::builder().bootstrap(b).build(),
);

#[test]
#[ignore = "rank program of the process tests"]
fn rank_program() {
    if let Some((_, spec)) = LAUNCH.role() {
        rank(&spec);
        println!("rank done");
    }
}

fn job(spec: &str) {
    let (kids, _) = LAUNCH.job(&[Some("c"); RANKS], spec);
    for out in LAUNCH.finish(kids, &format!("C API, {RANKS} ranks over {spec}")) {
        assert!(out.contains("rank done"), "{out}");
    }
}

#[test]
fn three_ranks_tcp() {
    job("tcp");
}

#[test]
fn three_ranks_shm() {
    job("shm");
}
