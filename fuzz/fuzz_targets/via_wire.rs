//! The soft-VIA decoders (`mad_via::wire`): frames back to back as the soft NIC's reader sees
//! them (payload slices always inside the input), the connection handshake, the control
//! records every provider carries (immediates, CTS of a rendezvous) and the address record a
//! soft rank publishes through the bootstrap. Whatever decodes re-encodes to the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_via::wire::{
    decode_frame, decode_imm, encode_imm, Cts, Frame, Header, Hello, SoftAddr, CTS_LEN,
    HEADER_LEN, MAX_PAYLOAD,
};

fuzz_target!(|data: &[u8]| {
    let _ = Header::decode(data);
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
    if let Ok(c) = Cts::decode(data) {
        assert!(c.addr.checked_add(c.len).is_some());
        let mut b = [0u8; CTS_LEN];
        c.encode_into(&mut b);
        assert_eq!(&b[..], data);
    }
    if let Some(w) = data.get(..4) {
        let imm = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        if let Ok((kind, freed)) = decode_imm(imm) {
            assert_eq!(encode_imm(kind, freed as u32), imm);
        }
    }
    for size in [1usize, 2, 7] {
        if let Ok(a) = SoftAddr::decode(data, size) {
            assert_eq!(a.credit_words.len(), size);
            assert_eq!(a.encode(), data);
        }
    }
    let mut rest = data;
    while let Ok(Some((f, used))) = decode_frame(rest) {
        assert!(used >= HEADER_LEN && used <= rest.len());
        assert!(used - HEADER_LEN <= MAX_PAYLOAD);
        match f {
            Frame::Send { data, .. } | Frame::Write { data, .. } | Frame::Error { msg: data, .. } => {
                assert_eq!(data.len(), used - HEADER_LEN)
            }
        }
        rest = &rest[used..];
    }
});
