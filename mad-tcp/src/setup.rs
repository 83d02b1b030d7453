//! Channel setup: listen, publish the address, connect to every peer, authenticate.
//!
//! Connections are set up *eagerly* at open, all-to-all: each rank connects to every lower
//! rank and accepts from every higher one, then closes its listener. Eager because any-source
//! reception needs every connection in the epoll set before the first `begin_unpacking`;
//! 64 processes means 63 sockets each, far below the descriptor limit (raised soft → hard when
//! needed). Accepting runs on a helper thread while this thread connects, and each accepted
//! connection is authenticated on its own short-lived thread, so a silent stranger delays
//! nobody. The whole setup is bounded by `connect_timeout_ms`.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mad_core::accept::{self, AcceptFor, Accepted};
use mad_core::auth::{self, Secret};
use mad_core::{Error, Result};

use crate::handshake::{self, Challenge, Hello, Reply, Status};

/// Longest a single accepted connection may take to authenticate.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What setup needs to know.
pub(crate) struct SetupParams<'a> {
    pub channel: &'a str,
    pub me: usize,
    pub size: usize,
    pub secret: &'a Secret,
    pub fingerprint: u64,
    pub connect_timeout: Duration,
    /// The ranks this rank connects to (`OpenContext::reaches`), indexed by rank.
    pub reach: Vec<bool>,
}

/// A listening socket bound on the adapter address, port chosen by the kernel.
pub(crate) fn listen(ip: IpAddr) -> Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| Error::io(format!("tcp: cannot listen on {ip}"), e))
}

/// Parse the addresses every rank published (`-`: a rank outside the channel's `ranks=`).
pub(crate) fn parse_addrs(all: &[Vec<u8>]) -> Result<Vec<Option<SocketAddr>>> {
    all.iter()
        .enumerate()
        .map(|(r, b)| {
            if b.as_slice() == b"-" {
                return Ok(None);
            }
            std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok())
                .ok_or_else(|| {
                    Error::protocol(
                        r,
                        format!(
                            "published tcp address {:?} is not ip:port",
                            String::from_utf8_lossy(b)
                        ),
                    )
                })
                .map(Some)
        })
        .collect()
}

/// Connect to every lower rank and accept every higher one. Returns one stream per rank
/// (`None` for this rank), still blocking, handshakes done.
pub(crate) fn connect_all(
    p: &SetupParams<'_>,
    listener: TcpListener,
    addrs: &[Option<SocketAddr>],
) -> Result<Vec<Option<TcpStream>>> {
    let deadline = Instant::now() + p.connect_timeout;
    let stop = AtomicBool::new(false);
    let span =
        tracing::debug_span!("tcp_handshakes", channel = %p.channel, rank = p.me, size = p.size);
    let _entered = span.enter();
    // The accepting thread logs to the caller's subscriber, inside the same span.
    let dispatch = tracing::dispatcher::get_default(Clone::clone);
    let (accepted, connected) = std::thread::scope(|s| {
        let acc = s.spawn(|| {
            tracing::dispatcher::with_default(&dispatch, || {
                span.in_scope(|| accept_all(p, &listener, deadline, &stop))
            })
        });
        let mut out: Vec<Option<TcpStream>> = Vec::with_capacity(p.me);
        let mut err = None;
        for (r, addr) in addrs.iter().enumerate().take(p.me) {
            let Some(addr) = addr.filter(|_| p.reach[r]) else {
                out.push(None);
                continue;
            };
            match connect_one(p, r, addr, deadline) {
                Ok(st) => {
                    tracing::debug!(peer = r, %addr, "connected and authenticated");
                    out.push(Some(st))
                }
                Err(e) => {
                    tracing::warn!(peer = r, %addr, error = %e, "connecting to a peer failed");
                    err = Some(e);
                    stop.store(true, Ordering::Relaxed);
                    break;
                }
            }
        }
        let acc = acc
            .join()
            .unwrap_or_else(|_| Err(Error::protocol(p.me, "tcp accepting thread panicked")));
        (
            acc,
            match err {
                Some(e) => Err(e),
                None => Ok(out),
            },
        )
    });
    let mut streams = connected?;
    let accepted = accepted?;
    streams.push(None);
    streams.extend(accepted.into_iter().skip(p.me + 1));
    Ok(streams)
}

/// Dial rank `r` and run the connector side of the handshake.
fn connect_one(
    p: &SetupParams<'_>,
    r: usize,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<TcpStream> {
    let ctx_err = |e: io::Error| {
        Error::io(
            format!(
                "tcp channel `{}`: connecting to rank {r} at {addr}",
                p.channel
            ),
            e,
        )
    };
    let st = accept::dial(addr, deadline).map_err(ctx_err)?;
    let mut stream = &st;
    let mut cb = [0u8; handshake::CHALLENGE_LEN];
    stream.read_exact(&mut cb).map_err(ctx_err)?;
    let ch = handshake::decode_challenge(&cb).map_err(|w| Error::protocol(r, w.to_string()))?;
    if ch.rank as usize != r {
        return Err(Error::protocol(
            r,
            format!("{addr} answers as rank {}, expected {r}", ch.rank),
        ));
    }
    let nonce_c = auth::nonce()?;
    let context = handshake::context(p.channel, p.me as u32, r as u32);
    let hello = Hello {
        rank: p.me as u32,
        fingerprint: p.fingerprint,
        nonce_c,
        proof: p
            .secret
            .proof(b"mad-tcp-connect", &ch.nonce_a, &nonce_c, &context),
        channel: p.channel.to_string(),
    };
    let hb = handshake::encode_hello(&hello).map_err(|e| Error::BadConfig(e.to_string()))?;
    stream.write_all(&hb).map_err(ctx_err)?;
    let mut rb = [0u8; handshake::REPLY_LEN];
    if let Err(e) = stream.read_exact(&mut rb) {
        return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Auth(format!(
                "rank {r} at {addr} refused our connection on channel `{}` (different session secret?)",
                p.channel
            ))
        } else {
            ctx_err(e)
        });
    }
    let reply: Reply =
        handshake::decode_reply(&rb).map_err(|w| Error::protocol(r, w.to_string()))?;
    if reply.rank as usize != r
        || !p.secret.verify(
            b"mad-tcp-accept",
            &ch.nonce_a,
            &nonce_c,
            &context,
            &reply.proof,
        )
    {
        return Err(Error::Auth(format!(
            "the process at {addr} did not prove the session secret for rank {r} on channel `{}`",
            p.channel
        )));
    }
    if reply.status == Status::FingerprintMismatch || reply.fingerprint != p.fingerprint {
        return Err(mismatch(p, r, reply.fingerprint));
    }
    Ok(st)
}

fn mismatch(p: &SetupParams<'_>, r: usize, theirs: u64) -> Error {
    Error::BadConfig(format!(
        "tcp channel `{}`: rank {r} uses a different TM table (fingerprint {theirs:016x}, ours {:016x}); \
         every rank must use the same thresholds",
        p.channel, p.fingerprint
    ))
}

/// Owned copies of what an acceptor-side handshake thread needs.
#[derive(Clone)]
struct AcceptCtx {
    channel: String,
    me: usize,
    size: usize,
    secret: Secret,
    fingerprint: u64,
    deadline: Instant,
}

/// Accept every higher rank (mad-core's hardened acceptor, this driver's handshake).
fn accept_all(
    p: &SetupParams<'_>,
    listener: &TcpListener,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<Option<TcpStream>>> {
    let ctx = AcceptCtx {
        channel: p.channel.to_string(),
        me: p.me,
        size: p.size,
        secret: p.secret.clone(),
        fingerprint: p.fingerprint,
        deadline,
    };
    let expected: Vec<usize> = (p.me + 1..p.size).filter(|&r| p.reach[r]).collect();
    let what = AcceptFor {
        driver: "tcp",
        channel: p.channel,
        me: p.me,
        deadline,
        timeout: p.connect_timeout,
        log: mad_core::refusal_log!(),
    };
    let got = accept::accept_all(&what, listener, stop, &expected, move |st, addr| {
        accept_one(&ctx, st, addr)
    })?;
    let mut all: Vec<Option<TcpStream>> = (0..p.size).map(|_| None).collect();
    for (r, st) in expected.into_iter().zip(got) {
        all[r] = Some(st);
    }
    Ok(all)
}

/// Acceptor side of the handshake for one incoming connection.
fn accept_one(c: &AcceptCtx, st: TcpStream, a: String) -> Accepted<usize, TcpStream> {
    let refused = |why: String| Accepted::Refused(a.clone(), why);
    if let Err(e) = st
        .set_nonblocking(false)
        .and_then(|_| accept::set_timeouts(&st, c.deadline, HANDSHAKE_TIMEOUT))
    {
        return refused(format!("cannot configure socket: {e}"));
    }
    let nonce_a = match auth::nonce() {
        Ok(n) => n,
        Err(e) => return Accepted::Fatal(e),
    };
    let mut stream = &st;
    let ch = handshake::encode_challenge(&Challenge {
        rank: c.me as u32,
        nonce_a,
    });
    if let Err(e) = stream.write_all(&ch) {
        return refused(format!("sending challenge: {e}"));
    }
    let mut hb = vec![0u8; handshake::HELLO_FIXED_LEN];
    if let Err(e) = stream.read_exact(&mut hb[..handshake::HEAD_LEN]) {
        return refused(format!("reading hello: {e}"));
    }
    if let Err(w) = handshake::check_hello_head(&hb[..handshake::HEAD_LEN]) {
        return refused(w.to_string());
    }
    if let Err(e) = stream.read_exact(&mut hb[handshake::HEAD_LEN..]) {
        return refused(format!("reading hello: {e}"));
    }
    let total = match handshake::hello_len(&hb) {
        Ok(t) => t,
        Err(w) => return refused(w.to_string()),
    };
    hb.resize(total, 0);
    if let Err(e) = stream.read_exact(&mut hb[handshake::HELLO_FIXED_LEN..]) {
        return refused(format!("reading hello: {e}"));
    }
    let h = match handshake::decode_hello(&hb) {
        Ok(h) => h,
        Err(w) => return refused(w.to_string()),
    };
    if h.channel != c.channel {
        return refused(format!("it asked for channel `{}`", h.channel));
    }
    let r = h.rank as usize;
    if r <= c.me || r >= c.size {
        return refused(format!(
            "rank {r} should not connect to rank {} (session of {})",
            c.me, c.size
        ));
    }
    let context = handshake::context(&c.channel, h.rank, c.me as u32);
    if !c
        .secret
        .verify(b"mad-tcp-connect", &nonce_a, &h.nonce_c, &context, &h.proof)
    {
        return refused("bad proof (wrong session secret)".into());
    }
    let status = if h.fingerprint == c.fingerprint {
        Status::Ok
    } else {
        Status::FingerprintMismatch
    };
    let reply = handshake::encode_reply(&Reply {
        status,
        rank: c.me as u32,
        fingerprint: c.fingerprint,
        proof: c
            .secret
            .proof(b"mad-tcp-accept", &nonce_a, &h.nonce_c, &context),
    });
    if let Err(e) = stream.write_all(&reply) {
        return refused(format!("sending reply: {e}"));
    }
    if status == Status::FingerprintMismatch {
        return Accepted::Fatal(Error::BadConfig(format!(
            "tcp channel `{}`: rank {r} uses a different TM table (fingerprint {:016x}, ours {:016x}); \
             every rank must use the same thresholds",
            c.channel, h.fingerprint, c.fingerprint
        )));
    }
    Accepted::Peer(r, st)
}
