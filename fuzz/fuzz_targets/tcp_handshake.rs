//! The tcp driver's connection handshake (`mad_tcp::handshake`): what a connector or a stranger
//! sends to a listener, and what an acceptor answers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use mad_tcp::handshake::{
    decode_challenge, decode_hello, decode_reply, encode_challenge, encode_hello, encode_reply,
    hello_len, HELLO_FIXED_LEN, MAX_NAME_LEN,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = decode_challenge(data) {
        assert_eq!(&encode_challenge(&c)[..], data);
    }
    if let Ok(n) = hello_len(data) {
        assert!((HELLO_FIXED_LEN..=HELLO_FIXED_LEN + MAX_NAME_LEN).contains(&n));
    }
    if let Ok(h) = decode_hello(data) {
        assert_eq!(encode_hello(&h).expect("decoded hello re-encodes"), data);
    }
    if let Ok(r) = decode_reply(data) {
        assert_eq!(&encode_reply(&r)[..], data);
    }
});
