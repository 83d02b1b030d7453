//! The C API's contract on one process: status codes and messages for bad arguments, no
//! panic across the boundary, handles freed by the calls that consume them. The two-process
//! behaviour (the C examples under madrun over tcp and shm) runs in `.ci/capi.sh`.

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};

use madeleine_c::*;

fn last() -> String {
    // SAFETY: `mad_last_error` returns a valid NUL-terminated string of this thread.
    unsafe { CStr::from_ptr(mad_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn name(status: i32) -> String {
    // SAFETY: `mad_status_name` returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(mad_status_name(status)) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn one_process_session_and_bad_arguments() {
    // SAFETY: every pointer passed below is valid or deliberately NULL (which the API checks).
    unsafe {
        assert_eq!(mad_session_init(null_mut()), MAD_E_BAD_CONFIG);
        assert!(last().contains("NULL"), "{}", last());
        let mut s = null_mut();
        assert_eq!(mad_session_init(&mut s), MAD_OK, "{}", last());
        assert_eq!((mad_session_rank(s), mad_session_size(s)), (0, 1));
        assert_eq!(mad_session_rank(null()), 0);

        let (n, bad) = (CString::new("c").unwrap(), CString::new("warp:9").unwrap());
        let mut ch = null_mut();
        let rc = mad_channel_open_spec(s, n.as_ptr(), bad.as_ptr(), &mut ch);
        assert_eq!(rc, MAD_E_BAD_CONFIG, "{}", name(rc));
        assert!(last().contains("warp"), "{}", last());
        assert!(ch.is_null());
        assert_eq!(
            mad_channel_open(s, null(), &mut ch),
            MAD_E_BAD_CONFIG,
            "a NULL name"
        );

        let mem = CString::new("mem").unwrap();
        let rc = mad_channel_open_spec(s, n.as_ptr(), mem.as_ptr(), &mut ch);
        assert_eq!(rc, MAD_OK, "{}", last());
        // This process's own rank is no peer.
        let mut p = null_mut();
        let rc = mad_begin_packing(ch, 0, &mut p);
        assert_eq!(rc, MAD_E_BAD_RANK, "{}: {}", name(rc), last());
        let rc = mad_begin_packing(ch, 7, &mut p);
        assert_eq!(rc, MAD_E_BAD_RANK, "{}: {}", name(rc), last());
        assert!(p.is_null());
        // NULL handles and modes out of range are refused, not dereferenced.
        assert_eq!(mad_pack(null_mut(), null(), 0, 0, 0), MAD_E_BAD_CONFIG);
        assert_eq!(
            mad_unpack(null_mut(), null_mut(), 0, 0, 0),
            MAD_E_BAD_CONFIG
        );
        assert_eq!(mad_end_packing(null_mut()), MAD_E_BAD_CONFIG);
        assert_eq!(mad_end_unpacking(null_mut()), MAD_E_BAD_CONFIG);
        mad_packer_abandon(null_mut());
        mad_unpacker_abandon(null_mut());
        let mut u = null_mut();
        let rc = mad_try_begin_unpacking(ch, &mut u);
        assert!(rc < 0, "a channel without peers: {}", name(rc));
        assert_eq!(mad_unpacker_remote(null()), usize::MAX);

        let mut st = MadStats {
            messages_sent: 9,
            bytes_sent: 9,
            messages_received: 9,
            bytes_received: 9,
        };
        assert_eq!(mad_channel_stats(ch, &mut st), MAD_OK);
        assert_eq!(st.messages_sent + st.messages_received, 0);
        let need = mad_channel_selection_table(ch, null_mut(), 0);
        let mut buf = vec![0 as std::ffi::c_char; need + 1];
        assert_eq!(
            mad_channel_selection_table(ch, buf.as_mut_ptr(), buf.len()),
            need
        );
        let table = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
        assert_eq!(table.len(), need);
        // Truncated like snprintf: NUL-terminated within the buffer.
        let mut small = [1 as std::ffi::c_char; 4];
        mad_channel_selection_table(ch, small.as_mut_ptr(), small.len());
        assert_eq!(small[3], 0);

        // One-call messages: the same checks.
        let mut byte = 0u8;
        let piece = MadPiece {
            data: (&mut byte as *mut u8).cast(),
            len: 1,
            send: MAD_SEND_SAFER,
            recv: MAD_RECV_EXPRESS,
        };
        let rc = mad_send(ch, 0, &piece, 1);
        assert_eq!(rc, MAD_E_BAD_RANK, "{}: {}", name(rc), last());
        assert_eq!(mad_send(ch, 0, null(), 1), MAD_E_BAD_CONFIG);
        assert_eq!(mad_send(null(), 0, &piece, 1), MAD_E_BAD_CONFIG);
        let bad_mode = MadPiece { send: 9, ..piece };
        assert_eq!(mad_send(ch, 0, &bad_mode, 1), MAD_E_BAD_CONFIG);
        assert!(last().contains("piece 0"), "{}", last());
        let no_data = MadPiece {
            data: null_mut(),
            ..piece
        };
        assert_eq!(mad_recv(ch, 0, &no_data, 1, null_mut()), MAD_E_BAD_CONFIG);
        let rc = mad_recv(ch, 3, &piece, 1, null_mut());
        assert_eq!(rc, MAD_E_BAD_RANK, "{}: {}", name(rc), last());

        mad_channel_close(ch);
        let rc = mad_begin_packing(ch, 0, &mut p);
        assert!(rc == MAD_E_CLOSED || rc == MAD_E_BAD_RANK, "{}", name(rc));
        mad_channel_free(ch);
        mad_channel_free(null_mut());
        mad_session_free(s);
        mad_session_free(null_mut());
    }
}

#[test]
fn every_status_has_a_name() {
    for c in [
        MAD_OK,
        MAD_AGAIN,
        MAD_E_PEER_CLOSED,
        MAD_E_CONNECTION_LOST,
        MAD_E_UNPACK_MISMATCH,
        MAD_E_UNAVAILABLE,
        MAD_E_BAD_CONFIG,
        MAD_E_PROTOCOL,
        MAD_E_POISONED,
        MAD_E_BAD_RANK,
        MAD_E_IN_USE,
        MAD_E_TIMEOUT,
        MAD_E_CLOSED,
        MAD_E_AUTH,
        MAD_E_RESOURCE,
        MAD_E_IO,
        MAD_E_REMOTE_FAILURE,
        MAD_E_COLLECTIVE_TIMEOUT,
        MAD_E_PANIC,
    ] {
        assert!(name(c).starts_with("MAD_"), "{c}");
    }
    assert_eq!(name(12345), "unknown");
}
