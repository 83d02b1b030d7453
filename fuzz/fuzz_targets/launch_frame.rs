//! The madrun bootstrap frame decoder (`mad_core::launch::wire`): a byte stream from a stranger
//! or a broken rank must give frames or errors, never a panic or a huge allocation.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_core::launch::wire::{decode_frame, FrameReader};

fuzz_target!(|data: &[u8]| {
    // Decode frames back to back, as the server's reader does.
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode_frame(rest) {
        assert!(used > 0 && used <= rest.len());
        // A decoded frame re-encodes (lengths already checked) and decodes to itself.
        if let Ok(bytes) = frame.encode() {
            let again = decode_frame(&bytes).expect("re-encoded frame decodes");
            // Every kind (the abort frames' cut kinds and messages included) round-trips.
            assert_eq!(again.map(|(f, _)| f).as_ref(), Some(&frame));
        }
        rest = &rest[used..];
    }
    // The reader with the pre-authentication limit, fed through a cursor.
    let mut r = FrameReader::with_limit(256);
    let mut cur = std::io::Cursor::new(data);
    for _ in 0..16 {
        match r.read_frame(&mut cur) {
            Ok(Some(_)) => continue,
            _ => break,
        }
    }
});
