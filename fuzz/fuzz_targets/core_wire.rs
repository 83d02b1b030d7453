//! The core's message header and checked-mode piece descriptors (`mad_core::wire`): every
//! input decodes to a value or an error, and whatever decodes re-encodes to the same bytes.
//! The short-message scan a receiver runs over a peer's bytes stays inside them.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_core::wire::{
    decode_desc, decode_header, encode_desc, encode_header, short_message, DESC_LEN, HEADER_LEN,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = decode_header(data) {
        assert_eq!(data.len(), HEADER_LEN);
        assert_eq!(&encode_header(h)[..], data);
    }
    if let Ok(d) = decode_desc(data) {
        assert_eq!(data.len(), DESC_LEN);
        assert_eq!(&encode_desc(d)[..], data);
    }
    // Also every window of the input, as a stream reader would see it.
    for w in data.windows(HEADER_LEN).take(64) {
        let _ = decode_header(w);
    }
    for w in data.windows(DESC_LEN).take(64) {
        let _ = decode_desc(w);
    }
    for (cap, piece) in [(512, 128), (data.len(), usize::MAX)] {
        if let Some(n) = short_message(data, cap, piece) {
            assert!(n <= data.len() && n <= cap);
        }
    }
});
