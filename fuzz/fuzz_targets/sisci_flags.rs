//! sisci:local control words (`mad_sisci::layout`): flag words and acknowledgement counters
//! are stored by the peer into its exported segment, so any value must decode to Empty,
//! Ready(len within the slot) or Corrupt, never a panic or an out-of-range length.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_sisci::layout::{chunk_fits, decode_flag, encode_flag, in_flight, Flag};

fuzz_target!(|data: &[u8]| {
    if data.len() < 40 {
        return;
    }
    let u = |i: usize| u64::from_le_bytes(data[i * 8..i * 8 + 8].try_into().unwrap());
    let (word, pos, n, max, cap) = (u(0), u(1), u(2), u(3) as usize % (1 << 24), u(4));
    match decode_flag(word, pos, n, max) {
        Flag::Ready(len) => assert!(len > 0 && len <= max),
        Flag::Empty | Flag::Corrupt => {}
    }
    // What we encode for a position decodes as Ready there.
    let len = (word as usize % (1 << 24)).max(1);
    if len <= max {
        assert_eq!(
            decode_flag(encode_flag(pos, n, len), pos, n, max),
            Flag::Ready(len)
        );
    }
    let cap = cap.max(1);
    if let Some(f) = in_flight(pos, word, cap) {
        assert!(f <= cap);
    }
    let _ = chunk_fits(word as usize, pos as usize, max);
});
