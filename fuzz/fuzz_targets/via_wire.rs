//! The soft-VIA frame and handshake-record decoders (`mad_via::wire`): frames back to back as
//! the soft NIC's reader sees them; payload slices always inside the input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_via::wire::{decode_frame, Frame, Header, Hello, HEADER_LEN, MAX_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    let _ = Header::decode(data);
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
    let mut rest = data;
    while let Ok(Some((f, used))) = decode_frame(rest) {
        assert!(used >= HEADER_LEN && used <= rest.len());
        assert!(used - HEADER_LEN <= MAX_PAYLOAD);
        match f {
            Frame::Small { data, .. }
            | Frame::Medium { data, .. }
            | Frame::RdmaWrite { data, .. }
            | Frame::Error { msg: data, .. } => assert_eq!(data.len(), used - HEADER_LEN),
            Frame::Cts { addr, len, .. } => assert!(addr.checked_add(len).is_some()),
            Frame::Credit { .. } => {}
        }
        rest = &rest[used..];
    }
});
