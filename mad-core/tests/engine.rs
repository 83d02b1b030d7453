//! Unit tests of the engine's sending side (switch, BMMs, commit, LATER/SAFER/EXPRESS rules)
//! against a recording driver: every call the engine makes to the driver is logged and
//! compared with what the Madeleine rules require. The receiving side's symmetry is checked
//! by the strict `mem` driver in `kit_mem.rs`.

use std::cell::Cell;
use std::io::{IoSlice, IoSliceMut};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use mad_core::bootstrap::{Bootstrap, ThreadBootstrap};
use mad_core::config::ChannelConfig;
use mad_core::driver::*;
use mad_core::modes::ModeSet;
use mad_core::{Error, RecvMode, Result, SendMode, Session};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Ev {
    /// Bytes copied into a lent buffer of a TM.
    Copy(TmId, Vec<u8>),
    /// A gather group: TM and the slices' contents.
    Refs(TmId, Vec<Vec<u8>>),
    Commit(TmId),
    /// `TxLink::publish`: what was handed over must become visible now.
    Publish,
    End,
}

type Log = Arc<Mutex<Vec<Ev>>>;

struct RecTx {
    log: Log,
    buf_size: usize,
    used: usize,
}

impl TxLink for RecTx {
    fn with_buffer(
        &mut self,
        tm: TmId,
        _want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        if self.used == self.buf_size {
            self.used = 0; // "transmit" the full buffer
        }
        let mut b = vec![0u8; self.buf_size - self.used];
        let n = fill(&mut b);
        self.used += n;
        self.log.lock().unwrap().push(Ev::Copy(tm, b[..n].to_vec()));
        Ok(Poll::Ready(()))
    }
    fn send_refs(&mut self, tm: TmId, iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        self.log
            .lock()
            .unwrap()
            .push(Ev::Refs(tm, iov.iter().map(|s| s.to_vec()).collect()));
        Ok(Poll::Ready(()))
    }
    fn commit(&mut self, tm: TmId) -> Result<Poll<()>> {
        self.used = 0;
        self.log.lock().unwrap().push(Ev::Commit(tm));
        Ok(Poll::Ready(()))
    }
    fn end_message(&mut self) -> Result<Poll<()>> {
        self.used = 0;
        self.log.lock().unwrap().push(Ev::End);
        Ok(Poll::Ready(()))
    }
    fn publish(&mut self) -> Result<()> {
        self.log.lock().unwrap().push(Ev::Publish);
        Ok(())
    }
    fn abort_message(&mut self) -> AbortOutcome {
        AbortOutcome::Discarded
    }
    fn wait(&mut self, _t: Duration) -> Result<()> {
        Ok(())
    }
}

struct NoRx;
impl RxLink for NoRx {
    fn poll_message(&mut self) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }
    fn with_data(
        &mut self,
        _: TmId,
        _: usize,
        _: &mut dyn FnMut(&[u8]) -> usize,
    ) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }
    fn recv_refs(&mut self, _: TmId, _: &mut [IoSliceMut<'_>]) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }
    fn wait(&mut self, t: Duration) -> Result<()> {
        std::thread::sleep(t.min(Duration::from_millis(1)));
        Ok(())
    }
}

/// TMs: 0 `small` copy ≤ 64 B, 1 `big` gather (groups of 4).
struct RecDriver {
    log: Log,
    buf_size: usize,
}

impl Driver for RecDriver {
    fn name(&self) -> &'static str {
        "rec"
    }
    fn describe(&self) -> String {
        "recording test driver".into()
    }
    fn tm_table(&self, _c: &ChannelConfig) -> Result<TmTable> {
        TmTable::new([
            TmSpec::copy("small", 64, "copy"),
            TmSpec::gather("big", usize::MAX, 4, "gather"),
        ])
    }
    fn capabilities(&self, _c: &ChannelConfig) -> Capabilities {
        Capabilities::default()
    }
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let me = ctx.bootstrap.rank();
        let links = (0..ctx.bootstrap.size())
            .map(|p| {
                (p != me).then(|| LinkPair {
                    tx: Box::new(RecTx {
                        log: self.log.clone(),
                        buf_size: self.buf_size,
                        used: 0,
                    }) as Box<dyn TxLink>,
                    rx: Box::new(NoRx) as Box<dyn RxLink>,
                })
            })
            .collect();
        Ok(OpenedChannel::new(links, Box::new(NoIncoming)).with_notes(vec![]))
    }
}

/// Open a 2-rank channel over the recording driver and run `f` on rank 0's channel; returns
/// the events after the message header.
fn record(
    spec: &str,
    buf_size: usize,
    f: impl FnOnce(&mad_core::Channel) -> Result<()> + Send,
) -> Vec<Ev> {
    strip_header(record_raw(spec, buf_size, f))
}

/// Like [`record`], header included.
fn record_raw(
    spec: &str,
    buf_size: usize,
    f: impl FnOnce(&mad_core::Channel) -> Result<()> + Send,
) -> Vec<Ev> {
    let log: Log = Arc::default();
    let boots = ThreadBootstrap::group(2);
    let spec = spec.to_string();
    std::thread::scope(|s| {
        let mut hs = Vec::new();
        let mut f = Some(f);
        for b in boots {
            let log = log.clone();
            let spec = spec.clone();
            let f = if b.rank() == 0 { f.take() } else { None };
            hs.push(s.spawn(move || {
                let session = Session::builder()
                    .driver(RecDriver { log, buf_size })
                    .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("t", &spec).unwrap())
                    .unwrap();
                if let Some(f) = f {
                    f(&ch).unwrap();
                }
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
    });
    let ev = log.lock().unwrap().clone();
    ev
}

/// Drop the 8-byte message header from the events: it travels in the first copy into TM 0,
/// alone or followed by the first piece's bytes.
fn strip_header(mut ev: Vec<Ev>) -> Vec<Ev> {
    let at = ev
        .iter()
        .position(|e| matches!(e, Ev::Copy(0, _)))
        .unwrap_or_else(|| panic!("no TM 0 copy carries the message header: {ev:?}"));
    match &mut ev[at] {
        Ev::Copy(0, h) if h.len() >= 8 && &h[..2] == b"M2" => {
            if h.len() == 8 {
                ev.remove(at);
            } else {
                h.drain(..8);
            }
        }
        _ => panic!("the first TM 0 copy is not the message header: {ev:?}"),
    }
    ev
}

/// The unchecked-mode frame announcing a piece of `len` bytes through TM `tm`.
fn fp(tm: u8, len: u64) -> Vec<u8> {
    mad_core::wire::encode_frame(mad_core::wire::Frame::Piece { tm, len }).to_vec()
}

/// The frame announcing a gather group of `count` slices through TM `tm`.
fn fg(tm: u8, count: u64) -> Vec<u8> {
    mad_core::wire::encode_frame(mad_core::wire::Frame::Group {
        tm,
        count,
        end: false,
    })
    .to_vec()
}

/// The frame announcing a message's last gather group (the end frame follows its pieces').
fn fg_end(tm: u8, count: u64) -> Vec<u8> {
    mad_core::wire::encode_frame(mad_core::wire::Frame::Group {
        tm,
        count,
        end: true,
    })
    .to_vec()
}

/// The end frame of a message of `pieces` pieces.
fn fe(pieces: u64) -> Vec<u8> {
    mad_core::wire::encode_frame(mad_core::wire::Frame::End { pieces }).to_vec()
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

#[test]
fn switch_is_a_pure_table_lookup() {
    let t = TmTable::new([
        TmSpec::copy("small", 64, "copy"),
        TmSpec::gather("big", usize::MAX, 4, "gather").with_modes(ModeSet::ANY),
    ])
    .unwrap();
    for s in SendMode::ALL {
        for r in RecvMode::ALL {
            assert_eq!(t.select(0, s, r), 0);
            assert_eq!(t.select(64, s, r), 0);
            assert_eq!(t.select(65, s, r), 1);
            assert_eq!(t.select(usize::MAX, s, r), 1);
        }
    }
    // A TM restricted to some modes is skipped for the others.
    let t2 = TmTable::new([
        TmSpec::copy("small", 64, "copy"),
        TmSpec::gather("rdv", usize::MAX, 1, "r").with_modes(ModeSet::CHEAPER_CHEAPER),
        TmSpec::copy("rest", usize::MAX, "c"),
    ])
    .unwrap();
    assert_eq!(t2.select(1000, SendMode::Cheaper, RecvMode::Cheaper), 1);
    assert_eq!(t2.select(1000, SendMode::Safer, RecvMode::Express), 2);
    assert_ne!(t.fingerprint(), t2.fingerprint());
}

#[test]
fn tables_are_validated() {
    // TM 0 must be a copy TM accepting every mode.
    assert!(TmTable::new([TmSpec::gather("g", usize::MAX, 4, "")]).is_err());
    // Every mode pair needs an unbounded TM.
    assert!(TmTable::new([TmSpec::copy("a", 10, "")]).is_err());
    assert!(TmTable::new([
        TmSpec::copy("a", 10, ""),
        TmSpec::gather("g", usize::MAX, 4, "").with_modes(ModeSet::CHEAPER_CHEAPER)
    ])
    .is_err());
    // Duplicate names.
    assert!(TmTable::new([TmSpec::copy("a", 10, ""), TmSpec::copy("a", usize::MAX, "")]).is_err());
    // Overrides re-validate and change the fingerprint.
    let mut t = TmTable::new([
        TmSpec::copy("small", 64, ""),
        TmSpec::gather("big", usize::MAX, 4, ""),
    ])
    .unwrap();
    let f = t.fingerprint();
    t.set_max_len("small", 128).unwrap();
    assert_eq!(t.select(100, SendMode::Cheaper, RecvMode::Cheaper), 0);
    assert_ne!(t.fingerprint(), f);
    assert!(matches!(t.set_max_len("nope", 1), Err(Error::BadConfig(_))));
    assert!(
        t.set_max_len("big", 5).is_err(),
        "the last TM must stay unbounded"
    );
}

#[test]
fn small_pieces_aggregate_into_one_buffer_and_one_flush() {
    let data: Vec<[u8; 4]> = (0..16u8).map(|i| [i; 4]).collect();
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        for d in &data {
            p.pack(d, RecvMode::Cheaper)?;
        }
        p.end_packing()
    });
    // The 16 frames and pieces and the end frame in one lend of TM 0 (staged until the end),
    // no gather send, one commit, one end.
    let mut all = Vec::new();
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d, &[i as u8; 4]);
        all.extend_from_slice(&fp(0, 4));
        all.extend_from_slice(d);
    }
    all.extend_from_slice(&fe(16));
    assert_eq!(ev, [Ev::Copy(0, all), Ev::Commit(0), Ev::End]);
}

#[test]
fn a_short_message_is_one_lend_header_included() {
    let piece = [3u8; 5];
    let ev = record_raw("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&piece, RecvMode::Cheaper)?;
        p.end_packing()
    });
    // Header, frame, piece and end frame in one lend, then the commit and the end.
    assert_eq!(ev.len(), 3, "{ev:?}");
    match &ev[0] {
        Ev::Copy(0, b) => {
            assert_eq!(b.len(), 29);
            assert_eq!(&b[..2], b"M2");
            assert_eq!(&b[8..16], &fp(0, 5)[..]);
            assert_eq!(&b[16..21], &piece);
            assert_eq!(&b[21..], &fe(1)[..]);
        }
        e => panic!("first event {e:?}"),
    }
    assert_eq!(ev[1..], [Ev::Commit(0), Ev::End]);
}

#[test]
fn header_and_pieces_split_across_tiny_lends() {
    // A driver lending 3 bytes at a time (a ring about to wrap): the header itself is split.
    let piece: Vec<u8> = (100..111).collect();
    let ev = record_raw("rec", 3, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&piece, RecvMode::Cheaper)?;
        p.end_packing()
    });
    let mut bytes = Vec::new();
    for e in &ev {
        if let Ev::Copy(0, b) = e {
            assert!(!b.is_empty() && b.len() <= 3, "{ev:?}");
            bytes.extend_from_slice(b);
        }
    }
    assert_eq!(bytes.len(), 8 + 8 + piece.len() + 8);
    assert_eq!(&bytes[..2], b"M2");
    assert_eq!(&bytes[8..16], &fp(0, 11)[..]);
    assert_eq!(&bytes[16..27], &piece[..]);
    assert_eq!(&bytes[27..], &fe(1)[..]);
}

#[test]
fn big_safer_piece_in_a_copy_tm_is_split_across_buffers() {
    let big: Vec<u8> = (0..10_000).map(|i| i as u8).collect();
    // Raise the copy TM's threshold so a 10 000-byte SAFER piece goes through 4096-byte buffers.
    let ev = record("rec,tm.small=max,tm.big=max", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack_safer(&big, RecvMode::Cheaper)?;
        p.end_packing()
    });
    let copies: Vec<&Vec<u8>> = ev
        .iter()
        .filter_map(|e| {
            if let Ev::Copy(0, b) = e {
                Some(b)
            } else {
                None
            }
        })
        .collect();
    // The header took 8 bytes of the first buffer (shown without it: frame and data); the end
    // frame follows.
    assert_eq!(
        copies.iter().map(|b| b.len()).collect::<Vec<_>>(),
        vec![4088, 4096, 1824, 8]
    );
    assert_eq!(
        copies.into_iter().flatten().copied().collect::<Vec<u8>>(),
        cat(&[&fp(0, 10_000), &big, &fe(1)])
    );
}

#[test]
fn tm_change_commits_the_previous_tm_and_groups_gather() {
    let (a, b, c, d) = ([1u8; 8], vec![2u8; 100], vec![3u8; 200], [4u8; 8]);
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&a, RecvMode::Cheaper)?;
        p.pack(&b, RecvMode::Cheaper)?;
        p.pack(&c, RecvMode::Cheaper)?;
        p.pack(&d, RecvMode::Cheaper)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            // The short piece waits (staged) for the group's frames: one group, flushed
            // when the TM changes back, announced by its frames.
            Ev::Copy(
                0,
                cat(&[&fp(0, 8), &a, &fg(1, 2), &fp(1, 100), &fp(1, 200)])
            ),
            Ev::Commit(0),
            Ev::Refs(1, vec![b.clone(), c.clone()]),
            Ev::Commit(1),
            Ev::Copy(0, cat(&[&fp(0, 8), &d, &fe(4)])),
            Ev::Commit(0),
            Ev::End,
        ]
    );
}

#[test]
fn gather_groups_end_after_express_safer_and_when_full() {
    let big: Vec<Vec<u8>> = (0..7u8).map(|i| vec![i; 100]).collect();
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&big[0], RecvMode::Cheaper)?;
        p.pack(&big[1], RecvMode::Express)?; // ends the group
        p.pack_safer(&big[2], RecvMode::Cheaper)?; // sent alone, at once
        for b in &big[3..7] {
            p.pack(b, RecvMode::Cheaper)?; // 4 = max_group: flushed when full
        }
        p.end_packing()
    });
    let groups: Vec<usize> = ev
        .iter()
        .filter_map(|e| {
            if let Ev::Refs(1, g) = e {
                Some(g.len())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(groups, vec![2, 1, 4], "{ev:?}");
}

#[test]
fn later_reads_the_value_at_end_packing_and_travels_last() {
    let mut v = [0u8; 4];
    let head = [9u8; 2];
    let ev = record("rec", 4096, |ch| {
        let cells = Cell::from_mut(&mut v[..]).as_slice_of_cells();
        let mut p = ch.begin_packing(1)?;
        p.pack_later(cells, RecvMode::Cheaper)?;
        p.pack(&head, RecvMode::Express)?;
        cells[0].set(7);
        cells[3].set(8);
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fp(0, 2), &[9, 9]])),
            Ev::Publish,
            Ev::Copy(0, cat(&[&fp(0, 4), &[7, 0, 0, 8], &fe(2)])),
            Ev::Commit(0),
            Ev::End
        ]
    );
}

#[test]
fn later_express_holds_the_rest_of_the_message_until_end_packing() {
    let mut size = [0u8; 8];
    let body = vec![5u8; 500];
    let mut scratch = vec![6u8; 10];
    let ev = record("rec", 4096, move |ch| {
        let cells = Cell::from_mut(&mut size[..]).as_slice_of_cells();
        let mut p = ch.begin_packing(1)?;
        p.pack_later(cells, RecvMode::Express)?;
        p.pack(&body, RecvMode::Cheaper)?;
        p.pack_safer(&scratch, RecvMode::Cheaper)?;
        scratch.fill(0); // SAFER: the value at pack time is what leaves
        cells[0].set(42);
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(
                0,
                cat(&[
                    &fp(0, 8),
                    &[42, 0, 0, 0, 0, 0, 0, 0],
                    &fg(1, 1),
                    &fp(1, 500)
                ])
            ),
            Ev::Commit(0),
            Ev::Refs(1, vec![vec![5u8; 500]]),
            Ev::Commit(1),
            Ev::Copy(0, cat(&[&fp(0, 10), &[6u8; 10], &fe(3)])),
            Ev::Commit(0),
            Ev::End,
        ]
    );
}

#[test]
fn express_pieces_are_published_before_end_packing() {
    // The Figure 1 pattern: an EXPRESS size, then a CHEAPER array. The size must become
    // visible to the receiver when `pack` returns (it needs it to issue the next unpack, and
    // may wait for it before anything else this sender does): what is staged goes to the
    // driver with it, published. CHEAPER pieces and the end need no separate publication.
    let body = vec![5u8; 500];
    let n = (body.len() as u64).to_le_bytes();
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack_safer(&n, RecvMode::Express)?;
        p.pack(&body, RecvMode::Cheaper)?;
        p.pack(&[1u8; 4], RecvMode::Cheaper)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fp(0, 8), &n])),
            Ev::Publish,
            Ev::Copy(0, cat(&[&fg(1, 1), &fp(1, 500)])),
            Ev::Commit(0),
            Ev::Refs(1, vec![body.clone()]),
            Ev::Commit(1),
            Ev::Copy(0, cat(&[&fp(0, 4), &[1u8; 4], &fe(3)])),
            Ev::Commit(0),
            Ev::End,
        ]
    );
    // An EXPRESS piece through the gather TM is sent (flushed) at once, then published.
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&body, RecvMode::Express)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fg(1, 1), &fp(1, 500)])),
            Ev::Commit(0),
            Ev::Refs(1, vec![body.clone()]),
            Ev::Publish,
            Ev::Commit(1),
            Ev::Copy(0, fe(1)),
            Ev::Commit(0),
            Ev::End,
        ]
    );
}

#[test]
fn under_flush_at_end_express_pieces_go_out_with_the_next_publication() {
    // The Figure 1 pattern again, from a sender that promised not to wait before the end:
    // the size goes out with what follows (here the switch to the gather TM commits it), not
    // in a publication of its own (one cache-line round trip more per message on shm).
    let body = vec![5u8; 500];
    let n = (body.len() as u64).to_le_bytes();
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.flush_at_end();
        p.pack_safer(&n, RecvMode::Express)?;
        p.pack(&body, RecvMode::Cheaper)?;
        p.pack(&[1u8; 4], RecvMode::Cheaper)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fp(0, 8), &n, &fg(1, 1), &fp(1, 500)])),
            Ev::Commit(0),
            Ev::Refs(1, vec![body.clone()]),
            Ev::Commit(1),
            Ev::Copy(0, cat(&[&fp(0, 4), &[1u8; 4], &fe(3)])),
            Ev::Commit(0),
            Ev::End,
        ]
    );
    // A short EXPRESS piece at the end of the message: one lend, published by the end.
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.flush_at_end();
        p.pack(&[1u8; 4], RecvMode::Cheaper)?;
        p.pack_safer(&n, RecvMode::Express)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fp(0, 4), &[1u8; 4], &fp(0, 8), &n, &fe(2)])),
            Ev::Commit(0),
            Ev::End,
        ]
    );
}

#[test]
fn under_flush_at_end_an_express_piece_is_published_before_a_long_copy() {
    // An EXPRESS size followed by a copy of more than 4 KiB on the same TM: the size is lent
    // and published first, so the receiver works on it while the long copy runs; nothing else
    // is published before the end.
    let body = vec![5u8; 5000];
    let n = (body.len() as u64).to_le_bytes();
    let ev = record("rec,tm.small=65536", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.flush_at_end();
        p.pack_safer(&n, RecvMode::Express)?;
        p.pack(&body, RecvMode::Cheaper)?;
        p.end_packing()
    });
    assert_eq!(ev[0], Ev::Copy(0, cat(&[&fp(0, 8), &n])), "{ev:?}");
    assert_eq!(ev[1], Ev::Publish, "{ev:?}");
    assert_eq!(
        ev.iter().filter(|e| **e == Ev::Publish).count(),
        1,
        "one publication before the end: {ev:?}"
    );
    let copied: Vec<u8> = ev[2..]
        .iter()
        .filter_map(|e| match e {
            Ev::Copy(0, b) => Some(b.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(copied, cat(&[&fp(0, 5000), &body, &fe(2)]));
    assert_eq!(&ev[ev.len() - 2..], &[Ev::Commit(0), Ev::End], "{ev:?}");
}

#[test]
fn a_last_gather_group_carries_the_end_frame() {
    // The end frame travels with the last group's frames, in one lend before the group: the
    // end of the message costs no lend (on sockets no system call) of its own. A flush in the
    // middle of a group sends the group so far; the receiver follows the sender's groups.
    let (a, b) = (vec![2u8; 100], vec![3u8; 200]);
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&a, RecvMode::Cheaper)?;
        p.flush()?;
        p.pack(&b, RecvMode::Cheaper)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fg(1, 1), &fp(1, 100)])),
            Ev::Commit(0),
            Ev::Refs(1, vec![a.clone()]),
            Ev::Publish, // the flush (the recording driver's default `flush`)
            Ev::Commit(1),
            Ev::Copy(0, cat(&[&fg_end(1, 1), &fp(1, 200), &fe(2)])),
            Ev::Commit(0),
            Ev::Refs(1, vec![b.clone()]),
            Ev::Commit(1),
            Ev::End,
        ]
    );
}

#[test]
fn zero_piece_and_zero_length_messages() {
    let ev = record("rec", 4096, |ch| {
        ch.begin_packing(1)?.end_packing()?;
        Ok(())
    });
    assert_eq!(ev, vec![Ev::Copy(0, fe(0)), Ev::Commit(0), Ev::End]);
    let ev = record("rec", 4096, |ch| {
        let mut p = ch.begin_packing(1)?;
        p.pack(&[], RecvMode::Express)?;
        p.end_packing()
    });
    assert_eq!(
        ev,
        vec![
            Ev::Copy(0, cat(&[&fp(0, 0), &fe(1)])),
            Ev::Commit(0),
            Ev::End
        ]
    );
}

#[test]
fn bad_ranks_and_unknown_drivers_are_clear_errors() {
    let boots = ThreadBootstrap::group(1);
    let session = Session::builder()
        .driver(RecDriver {
            log: Arc::default(),
            buf_size: 64,
        })
        .bootstrap(Box::new(boots.into_iter().next().unwrap()))
        .build()
        .unwrap();
    let e = session
        .open_channel_with(ChannelConfig::parse("x", "carrier-pigeon").unwrap())
        .unwrap_err();
    assert!(
        e.to_string().contains("unknown driver `carrier-pigeon`") && e.to_string().contains("rec"),
        "{e}"
    );
    let ch = session
        .open_channel_with(ChannelConfig::parse("x", "rec").unwrap())
        .unwrap();
    assert!(matches!(ch.begin_packing(0), Err(Error::BadRank { .. })));
    assert!(matches!(ch.begin_packing(5), Err(Error::BadRank { .. })));
    let e = session
        .open_channel_with(ChannelConfig::parse("y", "rec,tm.nope=5").unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("no TM named `nope`"), "{e}");
}

/// A send link whose end is pending and whose `arm_send` finds that the send may go on
/// (`Busy`): the progress came between the end's `Pending` and the arm.
struct KickTx;

impl TxLink for KickTx {
    fn with_buffer(
        &mut self,
        _tm: TmId,
        want: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> usize,
    ) -> Result<Poll<()>> {
        let mut b = vec![0u8; want.max(64)];
        fill(&mut b);
        Ok(Poll::Ready(()))
    }
    fn send_refs(&mut self, _tm: TmId, _iov: &[IoSlice<'_>]) -> Result<Poll<()>> {
        Ok(Poll::Ready(()))
    }
    fn commit(&mut self, _tm: TmId) -> Result<Poll<()>> {
        Ok(Poll::Ready(()))
    }
    fn end_message(&mut self) -> Result<Poll<()>> {
        Ok(Poll::Pending)
    }
    fn abort_message(&mut self) -> AbortOutcome {
        AbortOutcome::Discarded
    }
    fn wait(&mut self, _t: Duration) -> Result<()> {
        Ok(())
    }
    fn arm_send(&mut self) -> Result<Armed> {
        Ok(Armed::Busy)
    }
}

/// [`NoIncoming`] whose `arm` says `Armed` (nothing is ever ready) instead of `Busy`.
struct Quiet;

impl Incoming for Quiet {
    fn poll(&self, ready: &mut dyn FnMut(usize)) -> Result<()> {
        NoIncoming.poll(ready)
    }
    fn wait(&self, t: Duration) -> Result<()> {
        NoIncoming.wait(t)
    }
    fn wake(&self) {}
    fn arm(&self) -> Result<Armed> {
        Ok(Armed::Armed)
    }
}

struct KickDriver;

impl Driver for KickDriver {
    fn name(&self) -> &'static str {
        "kick"
    }
    fn describe(&self) -> String {
        "a send whose arm finds it may progress".into()
    }
    fn tm_table(&self, _c: &ChannelConfig) -> Result<TmTable> {
        TmTable::new([TmSpec::copy("small", usize::MAX, "copy")])
    }
    fn capabilities(&self, _c: &ChannelConfig) -> Capabilities {
        Capabilities::default()
    }
    fn open(&self, ctx: &OpenContext<'_>) -> Result<OpenedChannel> {
        let me = ctx.bootstrap.rank();
        let links = (0..ctx.bootstrap.size())
            .map(|p| {
                (p != me).then(|| LinkPair {
                    tx: Box::new(KickTx) as Box<dyn TxLink>,
                    rx: Box::new(NoRx) as Box<dyn RxLink>,
                })
            })
            .collect();
        Ok(OpenedChannel::new(links, Box::new(Quiet)).with_notes(vec![]))
    }
}

/// A polled end whose `arm_send` says `Busy` makes the channel's next `arm` say `Busy`: the
/// descriptor it rang is drained by that arm, so an event loop arming after the poll (the
/// tokio adapter does) would otherwise sleep with the send able to go on.
#[test]
fn a_send_that_may_progress_makes_the_next_channel_arm_busy() {
    let boots = ThreadBootstrap::group(2);
    std::thread::scope(|s| {
        for b in boots {
            s.spawn(move || {
                let rank = b.rank();
                let session = Session::builder()
                    .driver(KickDriver)
                    .bootstrap(Box::new(b) as Box<dyn Bootstrap>)
                    .build()
                    .unwrap();
                let ch = session
                    .open_channel_with(ChannelConfig::parse("k", "kick").unwrap())
                    .unwrap();
                if rank != 0 {
                    return;
                }
                assert_eq!(ch.arm().unwrap(), Armed::Armed, "nothing happened yet");
                let mut p = ch.try_begin_packing(1).unwrap().unwrap();
                p.defer();
                p.pack_safer(&[1u8; 8], RecvMode::Cheaper).unwrap();
                assert!(p.poll_end_packing().is_pending());
                assert_eq!(
                    ch.arm().unwrap(),
                    Armed::Busy,
                    "the send's arm said it may progress"
                );
                assert_eq!(ch.arm().unwrap(), Armed::Armed, "once per kick");
                drop(p);
            });
        }
    });
}
