//! The core's message header and checked-mode piece descriptors (`mad_core::wire`): every
//! input decodes to a value or an error, and whatever decodes re-encodes to the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_core::wire::{
    decode_desc, decode_header, encode_desc, encode_header, DESC_LEN, HEADER_LEN,
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
});
