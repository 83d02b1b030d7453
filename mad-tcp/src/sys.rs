//! Every foreign call of the driver: socket options, `sendmsg`/`recvmsg`, `poll`, epoll,
//! eventfd, `getifaddrs` and `RLIMIT_NOFILE`.
//!
//! Each function hands back safe values (`io::Result`, owned descriptors that close on drop).
//! `EINTR` is retried here, so callers never see it.

#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};
use std::net::IpAddr;
use std::os::fd::RawFd;
use std::time::Duration;

/// Largest number of `iovec`s one `sendmsg`/`recvmsg` takes on Linux (`IOV_MAX`).
pub const IOV_MAX: usize = 1024;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `&v` points to a live c_int for the duration of the call and its size is passed;
    // the kernel validates `fd`, `level` and `name` and reports errors through errno.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    cvt(r).map(|_| ())
}

/// Run a byte-moving syscall: `Ok(Some(n))` on success, `Ok(None)` when it would block,
/// retrying `EINTR`.
#[inline(always)]
fn io_op(mut f: impl FnMut() -> isize) -> io::Result<Option<usize>> {
    loop {
        let r = f();
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        // SAFETY: `__errno_location` returns this thread's errno slot, always valid to read.
        let errno = unsafe { *libc::__errno_location() };
        match errno {
            libc::EAGAIN => return Ok(None),
            libc::EINTR => continue,
            _ => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

/// Keepalive probing for a connected socket, scaled to the liveness bound `horizon`: probes
/// after a third of it idle, then every sixth (whole seconds, at least 1 s), three of them, so
/// the kernel fails an idle connection to a vanished host with `ETIMEDOUT` within about
/// `5/6 · horizon` (4 s at least). `TCP_USER_TIMEOUT` is explicitly left off: with it, Linux
/// (≥ 5.11) also aborts a connection whose peer keeps its window closed for that long, i.e. a
/// live receiver that is busy computing instead of reading. Connections with unanswered
/// traffic are judged by the driver instead ([`tcp_state`], `link.rs`).
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn set_keepalive(fd: RawFd, horizon: Duration) -> io::Result<()> {
    let secs = horizon.as_secs().min(i32::MAX as u64) as libc::c_int;
    let idle = (secs / 3).max(1);
    let intvl = (secs / 6).max(1);
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle)?;
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, intvl)?;
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)?;
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 0)
}

/// What the kernel knows of a connection's peer (`TCP_INFO`), for liveness decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpState {
    /// Time since anything (data or acknowledgement) last came from the peer.
    pub silent: Duration,
    /// The kernel is waiting for an answer that has not come: a retransmission of
    /// unacknowledged data with no acknowledgement since it left, or zero-window / keepalive
    /// probes. A peer that answers (even with a closed window: a live receiver that does not
    /// read, whose sender then retransmits into the closed window with backed-off timers)
    /// clears this.
    pub unanswered: bool,
    /// The connection is closed or closing (`TCP_CLOSE`, `TCP_TIME_WAIT`, ...), not established.
    pub established: bool,
    /// `tcpi_retransmits`, `tcpi_probes`, `tcpi_backoff`, `tcpi_unacked`, `tcpi_rto` (µs):
    /// for messages.
    pub raw: [u32; 5],
}

/// `TCP_ESTABLISHED` of `<netinet/tcp.h>` (the `tcpi_state` of a connection in data transfer).
const TCP_ESTABLISHED: u8 = 1;

/// Read `TCP_INFO` of a connected socket.
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn tcp_state(fd: RawFd) -> io::Result<TcpState> {
    // SAFETY: `tcp_info` is plain data (integers); all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a live, exclusively borrowed buffer of `len` bytes; the kernel writes at
    // most `len` bytes and stores the length it wrote in `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    cvt(r)?;
    let silent_ms = info.tcpi_last_data_recv.min(info.tcpi_last_ack_recv);
    // `tcpi_retransmits` stays above 0 for as long as the oldest unacknowledged byte is not
    // acknowledged, which includes a closed window (no acknowledgement can advance); what tells
    // a peer that answers from one that does not is whether anything came back since our last
    // transmission (`tcpi_last_*` are milliseconds since the event).
    let retrans_unanswered =
        info.tcpi_retransmits > 0 && info.tcpi_last_ack_recv >= info.tcpi_last_data_sent;
    // `tcpi_probes` counts the zero-window or keepalive probes sent since the last valid
    // acknowledgement. One unanswered probe proves nothing: a live receiver answers probes
    // (segments below its window) with duplicate acknowledgements rate-limited to one per
    // `net.ipv4.tcp_invalid_ratelimit` (500 ms), so a probe that follows an answered one
    // within 500 ms goes unanswered, and with the early, short backoff steps that leaves a
    // live slow reader silent for over a second with one probe outstanding (seen in CI with a
    // 1 s bound: "probes 1, backoff 2", nothing received for 1308 ms). The probe after it is
    // at least twice as far, past the rate limit, and is answered: two unanswered in a row
    // is a peer that does not answer.
    Ok(TcpState {
        silent: Duration::from_millis(silent_ms as u64),
        unanswered: retrans_unanswered || info.tcpi_probes >= 2,
        established: info.tcpi_state == TCP_ESTABLISHED,
        raw: [
            info.tcpi_retransmits as u32,
            info.tcpi_probes as u32,
            info.tcpi_backoff as u32,
            info.tcpi_unacked,
            info.tcpi_rto,
        ],
    })
}

/// One `sendmsg(MSG_NOSIGNAL | MSG_DONTWAIT)` of `iov` (at most [`IOV_MAX`] entries are used).
/// Returns the number of bytes accepted by the kernel; `Ok(None)` when the buffer is full.
/// With `block`, without `MSG_DONTWAIT`: on a blocking socket the kernel then queues
/// everything before returning (or the send timeout passes: `Ok(None)`).
///
/// # Errors
///
/// The system call's error (`errno`).
#[inline]
pub fn send_vectored(fd: RawFd, iov: &[IoSlice<'_>], block: bool) -> io::Result<Option<usize>> {
    let flags = if block {
        libc::MSG_NOSIGNAL
    } else {
        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT
    };
    if let [one] = iov {
        // SAFETY: `one` is a live, readable slice for this call.
        return io_op(|| unsafe { libc::send(fd, one.as_ptr().cast(), one.len(), flags) });
    }
    let n = iov.len().min(IOV_MAX);
    // SAFETY: an all-zero msghdr is a valid "no address, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is documented to be ABI-compatible with `iovec` on Unix; the kernel only reads
    // through these pointers.
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = n as _;
    // SAFETY: `msg` points to `n` valid iovecs borrowed from `iov` for this call only.
    io_op(|| unsafe { libc::sendmsg(fd, &msg, flags) })
}

/// One `send(MSG_NOSIGNAL | MSG_DONTWAIT)` of `buf` (cheaper in the kernel than a one-slice
/// `sendmsg`: no message header or iovec to import). `Ok(None)`: the buffer is full.
///
/// # Errors
///
/// The system call's error (`errno`).
#[inline]
pub fn send(fd: RawFd, buf: &[u8]) -> io::Result<Option<usize>> {
    let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
    // SAFETY: `buf` is a live, readable slice of `buf.len()` bytes for this call.
    io_op(|| unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) })
}

/// One non-blocking `recv` into `buf`. `Ok(Some(0))` means end of stream, `Ok(None)` that
/// nothing is there yet.
///
/// # Errors
///
/// The system call's error (`errno`).
#[inline]
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    let (p, n) = (buf.as_mut_ptr(), buf.len());
    // SAFETY: `p` is a live, writable region of `n` bytes (borrowed from `buf`) for this call.
    io_op(|| unsafe { libc::recv(fd, p.cast(), n, libc::MSG_DONTWAIT) })
}

/// One non-blocking `recvmsg` scattering into `iov` (at most [`IOV_MAX`] entries).
/// `Ok(Some(0))` means end of stream (when `iov` is not empty), `Ok(None)` nothing yet.
/// With `wait_all`, `MSG_WAITALL` instead of `MSG_DONTWAIT`: on a blocking socket the kernel
/// fills every slice before returning (or end of stream, an error, a signal or the receive
/// timeout cuts it short).
///
/// # Errors
///
/// The system call's error (`errno`).
#[inline]
pub fn recv_vectored(
    fd: RawFd,
    iov: &mut [IoSliceMut<'_>],
    wait_all: bool,
) -> io::Result<Option<usize>> {
    let flags = if wait_all {
        libc::MSG_WAITALL
    } else {
        libc::MSG_DONTWAIT
    };
    let n = iov.len().min(IOV_MAX);
    // SAFETY: an all-zero msghdr is a valid "no address, no control data" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSliceMut` is documented to be ABI-compatible with `iovec` on Unix.
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = n as _;
    // SAFETY: `msg` points to `n` valid, writable iovecs borrowed mutably from `iov`.
    io_op(|| unsafe { libc::recvmsg(fd, &mut msg, flags) })
}

/// Abortive disconnect of a connected TCP socket: `connect(fd, AF_UNSPEC)`, which Linux
/// implements as `tcp_disconnect`: the connection is reset (an RST goes to the peer, whose
/// blocked and later sends and receives fail with `ECONNRESET`/`EPIPE`), unsent data is
/// dropped, and the socket is closed for this side's other users of the descriptor too (the
/// other half of the connection; `close` could not do that while it still holds the
/// descriptor). Fails with `EBUSY` while another thread of this process is blocked in a
/// `send`/`recv` on the socket (Linux ≥ 6.6): see [`reset`].
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn disconnect(fd: RawFd) -> io::Result<()> {
    // SAFETY: an all-zero sockaddr with family AF_UNSPEC is a complete address for this call;
    // it lives for the duration of the call and its size is passed.
    let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
    addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: `addr` is valid for reads of `size_of::<sockaddr>()` bytes during the call.
    let r = unsafe {
        libc::connect(
            fd,
            &addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    cvt(r).map(|_| ())
}

/// Tear a connection down for both ends: [`disconnect`]; if another thread of ours is
/// blocked on the socket (`EBUSY`), `shutdown(SHUT_RDWR)` first, which wakes it with an error,
/// and try the reset again for up to 50 ms. Returns whether the reset (the RST the peer
/// needs to learn about it while it sends) was done; otherwise the peer gets at least the
/// FIN of the shutdown.
pub fn reset(fd: RawFd) -> bool {
    match disconnect(fd) {
        Ok(()) => return true,
        Err(e) if e.raw_os_error() != Some(libc::EBUSY) => return false,
        Err(_) => {}
    }
    // SAFETY: plain syscall on a descriptor; errors (already shut down) are ignored.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(1));
        if disconnect(fd).is_ok() {
            return true;
        }
    }
    false
}

/// Zero-timeout `poll(2)`: has the peer closed or reset the connection (`POLLRDHUP`: its FIN
/// arrived; `POLLHUP`/`POLLERR`: reset or closed both ways)? Our protocol never half-closes a
/// healthy connection, so a FIN means the peer is gone. Errors of `poll` itself count as
/// "no" (the next send reports what is wrong).
pub fn hung_up(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `p` is one valid pollfd for the duration of the call; the timeout is zero.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Whether to wait for input or for room to send.
#[derive(Clone, Copy, Debug)]
pub enum Interest {
    /// `POLLIN`.
    Read,
    /// `POLLOUT`.
    Write,
}

/// `poll(2)` on one descriptor; true when it is ready (or in error: the next call reports it).
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn poll_one(fd: RawFd, interest: Interest, timeout: Duration) -> io::Result<bool> {
    let events = match interest {
        Interest::Read => libc::POLLIN,
        Interest::Write => libc::POLLOUT,
    };
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout_ms(timeout);
    // SAFETY: `p` is one valid pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    match r {
        r if r > 0 => Ok(true),
        0 => Ok(false),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

fn timeout_ms(t: Duration) -> libc::c_int {
    // Round up so a 300 µs wait does not become a busy 0 ms poll.
    let us = t.as_micros();
    us.div_ceil(1000).min(i32::MAX as u128) as libc::c_int
}

/// The addresses of the interface named `name` (IPv4 first), from `getifaddrs`.
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn interface_addrs(name: &str) -> io::Result<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; on success the list is freed below.
    cvt(unsafe { libc::getifaddrs(&mut head) })?;
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_name.is_null() || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_name` is a NUL-terminated string owned by the list.
        let n = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        if n.to_bytes() != name.as_bytes() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points to a sockaddr whose family says its type.
        let family = unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int;
        if family == libc::AF_INET {
            // SAFETY: family AF_INET means the sockaddr is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            out.push(IpAddr::from(sin.sin_addr.s_addr.to_ne_bytes()));
        } else if family == libc::AF_INET6 {
            // SAFETY: family AF_INET6 means the sockaddr is a sockaddr_in6.
            let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            out.push(IpAddr::from(sin6.sin6_addr.s6_addr));
        }
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    out.sort_by_key(|a| a.is_ipv6());
    Ok(out)
}

/// Raise the soft `RLIMIT_NOFILE` towards the hard limit so at least `need` descriptors fit.
/// Returns the soft limit in force afterwards.
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn ensure_nofile(need: u64) -> io::Result<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid out-pointer.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) })?;
    if rl.rlim_cur >= need {
        return Ok(rl.rlim_cur);
    }
    rl.rlim_cur = rl.rlim_max;
    // SAFETY: `rl` is a valid rlimit; raising the soft limit up to the hard one is allowed.
    cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rl) })?;
    Ok(rl.rlim_cur)
}

/// Read an integer socket option (used by tests to check what [`set_keepalive`] applied).
///
/// # Errors
///
/// The system call's error (`errno`).
pub fn sockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid out-pointers sized for one c_int.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    #[test]
    fn keepalive_options_are_applied_without_user_timeout() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let fd = s.as_raw_fd();
        setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 1234).unwrap();
        set_keepalive(fd, Duration::from_millis(12_000)).unwrap();
        let get = |level, name| sockopt_int(fd, level, name).unwrap();
        assert_eq!(get(libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 0);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 4);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 2);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
        // Short horizons round up to whole seconds.
        set_keepalive(fd, Duration::from_millis(1500)).unwrap();
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 1);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 1);
    }

    #[test]
    fn tcp_state_of_a_fresh_connection() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        assert_eq!(send(a.as_raw_fd(), b"hi").unwrap(), Some(2));
        assert!(poll_one(b.as_raw_fd(), Interest::Read, Duration::from_secs(5)).unwrap());
        let st = tcp_state(b.as_raw_fd()).unwrap();
        assert!(st.established);
        assert!(!st.unanswered);
        assert!(st.silent < Duration::from_secs(5), "{st:?}");
        drop(a);
        std::thread::sleep(Duration::from_millis(50));
        // The peer's FIN moved the connection to CLOSE_WAIT.
        assert!(!tcp_state(b.as_raw_fd()).unwrap().established);
    }

    #[test]
    fn eintr_free_would_block_and_eof() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(recv(b.as_raw_fd(), &mut buf).unwrap(), None);
        assert_eq!(send(a.as_raw_fd(), b"hi").unwrap(), Some(2));
        assert!(poll_one(b.as_raw_fd(), Interest::Read, Duration::from_secs(5)).unwrap());
        assert_eq!(recv(b.as_raw_fd(), &mut buf).unwrap(), Some(2));
        drop(a);
        assert_eq!(recv(b.as_raw_fd(), &mut buf).unwrap(), Some(0));
        assert!(poll_one(b.as_raw_fd(), Interest::Write, Duration::ZERO).is_ok());
    }

    #[test]
    fn nofile_and_interfaces() {
        assert!(ensure_nofile(64).unwrap() >= 64);
        assert!(interface_addrs("lo")
            .unwrap()
            .contains(&IpAddr::from([127, 0, 0, 1])));
        assert!(interface_addrs("no-such-if0").unwrap().is_empty());
    }
}
