//! Connection setup of the soft backend: listen, publish the address (and where each
//! connection's credit word is) through the session bootstrap, connect every pair once per
//! queue pair (two sockets: control and data), and authenticate each socket with the session
//! secret.
//!
//! Rank `i` connects to every rank `j > i` and accepts from every rank below it. Accepting
//! runs on a helper thread while this thread connects, and each accepted socket is
//! authenticated on its own short-lived thread, so a silent stranger delays nobody; a
//! stranger (wrong magic, bad proof, a rank that should not connect here, a duplicate) is
//! refused and logged (a `warn` event of target `mad_via::setup`: `refused connection from
//! ADDR on channel NAME: WHY`; mad-core's acceptor) and the open goes on. The whole setup is bounded by [`SETUP_TIMEOUT`].
//!
//! The handshake ([`Hello`] records) proves both ends know the session secret (HMAC over both
//! nonces, the channel, the two ranks and the queue pair; the secret never crosses the wire)
//! and checks that both ends agree on the TM table fingerprint and the small-TM slot
//! configuration.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mad_core::accept::{self, AcceptFor, Accepted, PeerKey};
use mad_core::auth::Secret;
use mad_core::driver::OpenContext;
use mad_core::{Error, Result};

use crate::proto::SlotConfig;
use crate::provider::Remote;
use crate::soft::{Sock, SoftArena, SoftDevice, SoftNic};
use crate::wire::{Hello, SoftAddr, HELLO_LEN};

/// Bound on the whole setup of a channel.
pub(crate) const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest one accepted socket may take to authenticate.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn context(channel: &str, connector: usize, acceptor: usize, qp: u32) -> Vec<u8> {
    format!("mad-via/{channel}/{connector}->{acceptor}/qp{qp}").into_bytes()
}

/// What both ends of a handshake must agree on, and the secret.
#[derive(Clone)]
struct Params {
    channel: String,
    me: usize,
    size: usize,
    secret: Secret,
    fingerprint: u64,
    cfg: SlotConfig,
}

impl Params {
    fn hello(&self, nonce: [u8; 16], qp: u32) -> Hello {
        Hello {
            rank: self.me as u32,
            size: self.size as u32,
            fingerprint: self.fingerprint,
            slots: self.cfg.slots as u32,
            slot_size: self.cfg.slot_size as u32,
            nonce,
            proof: [0; 32],
            qp,
        }
    }

    /// A real rank with another configuration: fatal (the channel cannot work).
    fn check_peer(&self, theirs: &Hello, who: &str) -> Result<()> {
        if theirs.fingerprint != self.fingerprint {
            return Err(Error::BadConfig(format!(
                "via: {who} uses a different TM table (fingerprint {:#x}, ours {:#x}): check the tm.* thresholds of the channel on every rank",
                theirs.fingerprint, self.fingerprint
            )));
        }
        if theirs.slots as usize != self.cfg.slots
            || theirs.slot_size as usize != self.cfg.slot_size
            || theirs.size as usize != self.size
        {
            return Err(Error::BadConfig(format!(
                "via: {who} has {} slots of {} B in a session of {}, we have {} of {} B in {}",
                theirs.slots,
                theirs.slot_size,
                theirs.size,
                self.cfg.slots,
                self.cfg.slot_size,
                self.size
            )));
        }
        Ok(())
    }
}

fn read_hello(s: &mut TcpStream) -> std::result::Result<Hello, String> {
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b[..8])
        .map_err(|e| format!("reading the handshake: {e}"))?;
    // A stranger speaking another protocol is refused as soon as its first bytes are wrong.
    Hello::check_magic(&b[..8]).map_err(|e| e.to_string())?;
    s.read_exact(&mut b[8..])
        .map_err(|e| format!("reading the handshake: {e}"))?;
    Hello::decode(&b).map_err(|e| e.to_string())
}

/// Connect to rank `j` for queue pair `qp` and run the connector's side of the handshake.
fn connect_one(
    p: &Params,
    j: usize,
    target: SocketAddr,
    qp: u32,
    deadline: Instant,
) -> Result<TcpStream> {
    let who = format!("rank {j}");
    let ctx_err = |e: std::io::Error| {
        Error::io(
            format!(
                "via:soft channel `{}`: connecting to {who} at {target}",
                p.channel
            ),
            e,
        )
    };
    let mut s = accept::dial(target, deadline).map_err(ctx_err)?;
    let ha = read_hello(&mut s).map_err(|w| {
        Error::Auth(format!(
            "via:soft channel `{}`: {who} at {target}: {w}",
            p.channel
        ))
    })?;
    if ha.rank as usize != j {
        return Err(Error::Auth(format!(
            "connected to {who} at {target} but the peer says it is rank {}",
            ha.rank
        )));
    }
    p.check_peer(&ha, &who)?;
    let nonce_c = mad_core::auth::nonce()?;
    let cx = context(&p.channel, p.me, j, qp);
    let mut hc = p.hello(nonce_c, qp);
    hc.proof = p.secret.proof(b"mad-via/connect", &ha.nonce, &nonce_c, &cx);
    s.write_all(&hc.encode()).map_err(ctx_err)?;
    let hack = read_hello(&mut s).map_err(|w| {
        Error::Auth(format!(
            "{who} at {target} refused our connection on channel `{}` (different session secret?): {w}",
            p.channel
        ))
    })?;
    if hack.nonce != ha.nonce
        || hack.qp != qp
        || !p
            .secret
            .verify(b"mad-via/accept", &ha.nonce, &nonce_c, &cx, &hack.proof)
    {
        return Err(Error::Auth(format!(
            "{who} at {target} did not prove it knows the session secret"
        )));
    }
    s.set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
        .map_err(ctx_err)?;
    Ok(s)
}

/// What an accepted socket is for: a rank's queue pair.
#[derive(Clone, Copy, PartialEq, Eq)]
struct QpKey {
    rank: usize,
    qp: u32,
}

impl PeerKey for QpKey {
    fn rank(&self) -> usize {
        self.rank
    }
    fn describe(&self) -> String {
        format!("rank {} queue pair {}", self.rank, self.qp)
    }
}

/// Acceptor side of the handshake for one incoming socket.
fn accept_one(
    p: &Params,
    mut s: TcpStream,
    a: String,
    deadline: Instant,
) -> Accepted<QpKey, TcpStream> {
    let refused = |why: String| Accepted::Refused(a.clone(), why);
    if let Err(e) = s
        .set_nonblocking(false)
        .and_then(|_| accept::set_timeouts(&s, deadline, HANDSHAKE_TIMEOUT))
    {
        return refused(format!("cannot configure the socket: {e}"));
    }
    let nonce_a = match mad_core::auth::nonce() {
        Ok(n) => n,
        Err(e) => return Accepted::Fatal(e),
    };
    let ha = p.hello(nonce_a, 0);
    if let Err(e) = s.write_all(&ha.encode()) {
        return refused(format!("sending the handshake: {e}"));
    }
    let hc = match read_hello(&mut s) {
        Ok(h) => h,
        Err(w) => return refused(w),
    };
    let j = hc.rank as usize;
    if j >= p.me {
        return refused(format!(
            "rank {j} should not connect to rank {} (session of {})",
            p.me, p.size
        ));
    }
    if hc.qp > 1 {
        return refused(format!("unknown queue pair {}", hc.qp));
    }
    let cx = context(&p.channel, j, p.me, hc.qp);
    if !p
        .secret
        .verify(b"mad-via/connect", &nonce_a, &hc.nonce, &cx, &hc.proof)
    {
        return refused("bad proof (wrong session secret or channel)".into());
    }
    if let Err(e) = p.check_peer(&hc, &format!("rank {j}")) {
        return Accepted::Fatal(e);
    }
    let mut ack = p.hello(nonce_a, hc.qp);
    ack.proof = p.secret.proof(b"mad-via/accept", &nonce_a, &hc.nonce, &cx);
    if let Err(e) = s.write_all(&ack.encode()) {
        return refused(format!("sending the handshake: {e}"));
    }
    if let Err(e) = s
        .set_read_timeout(None)
        .and_then(|_| s.set_write_timeout(None))
    {
        return refused(format!("cannot configure the socket: {e}"));
    }
    Accepted::Peer(QpKey { rank: j, qp: hc.qp }, s)
}

type Pairs = Vec<[Option<TcpStream>; 2]>;

/// Accept the two sockets of every lower rank (mad-core's hardened acceptor, this driver's
/// handshake).
fn accept_all(
    p: &Params,
    listener: &TcpListener,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Pairs> {
    let expected: Vec<QpKey> = (0..p.me)
        .flat_map(|rank| (0..2).map(move |qp| QpKey { rank, qp }))
        .collect();
    let what = AcceptFor {
        driver: "via:soft",
        channel: &p.channel,
        me: p.me,
        deadline,
        timeout: SETUP_TIMEOUT,
        log: mad_core::refusal_log!(),
    };
    let p2 = p.clone();
    let got = accept::accept_all(&what, listener, stop, &expected, move |s, addr| {
        accept_one(&p2, s, addr, deadline)
    })?;
    let mut pairs: Pairs = (0..p.size).map(|_| [None, None]).collect();
    for (k, s) in expected.iter().zip(got) {
        pairs[k.rank][k.qp as usize] = Some(s);
    }
    Ok(pairs)
}

/// Open every connection of a `via:soft` channel: one soft NIC per reachable rank.
pub(crate) fn open_soft(
    ctx: &OpenContext<'_>,
    dev: &Arc<SoftDevice>,
    cfg: SlotConfig,
) -> Result<Vec<Option<SoftNic>>> {
    let b = ctx.bootstrap;
    let (me, n) = (b.rank(), b.size());
    let host = ctx
        .config
        .options
        .get("host")
        .cloned()
        .unwrap_or_else(|| "127.0.0.1".to_string());
    let listener = TcpListener::bind((host.as_str(), 0))
        .map_err(|e| Error::io(format!("via:soft: listening on {host}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("via:soft: local address", e))?;
    let mut arenas: Vec<Option<SoftArena>> = (0..n)
        .map(|j| (j != me).then(|| SoftArena::new(dev, cfg)))
        .collect();
    let mine = SoftAddr {
        sock: addr.to_string(),
        credit_words: arenas
            .iter()
            .map(|a| a.as_ref().map_or((0, 0), |a| a.credit_word()))
            .collect(),
    };
    let all = b.allgather(&ctx.tag("soft-addr"), &mine.encode())?;
    let mut peers = Vec::with_capacity(n);
    for (j, raw) in all.iter().enumerate() {
        let a = SoftAddr::decode(raw, n).map_err(|e| Error::protocol(j, e.to_string()))?;
        let target = a
            .sock
            .to_socket_addrs()
            .ok()
            .and_then(|mut x| x.next())
            .ok_or_else(|| Error::protocol(j, format!("bad via:soft address `{}`", a.sock)))?;
        peers.push((target, a.credit_words[me]));
    }
    let p = Params {
        channel: ctx.config.name.clone(),
        me,
        size: n,
        secret: b.secret().clone(),
        fingerprint: ctx.table.fingerprint(),
        cfg,
    };
    let deadline = Instant::now() + SETUP_TIMEOUT;
    let stop = AtomicBool::new(false);
    let span =
        tracing::debug_span!("via_soft_handshakes", channel = %p.channel, rank = me, size = n);
    let _entered = span.enter();
    // The accepting thread logs to the caller's subscriber, inside the same span.
    let dispatch = tracing::dispatcher::get_default(Clone::clone);
    let (accepted, connected) = std::thread::scope(|s| {
        let acc = s.spawn(|| {
            tracing::dispatcher::with_default(&dispatch, || {
                span.in_scope(|| accept_all(&p, &listener, deadline, &stop))
            })
        });
        let mut out: Pairs = Vec::new();
        let mut err = None;
        'peers: for (j, (target, _)) in peers.iter().enumerate().skip(me + 1) {
            let mut pair = [None, None];
            for qp in 0..2u32 {
                match connect_one(&p, j, *target, qp, deadline) {
                    Ok(st) => {
                        tracing::debug!(peer = j, qp, "connected and authenticated");
                        pair[qp as usize] = Some(st)
                    }
                    Err(e) => {
                        tracing::warn!(peer = j, qp, error = %e, "connecting to a peer failed");
                        err = Some(e);
                        stop.store(true, Ordering::Relaxed);
                        break 'peers;
                    }
                }
            }
            out.push(pair);
        }
        let acc = acc
            .join()
            .unwrap_or_else(|_| Err(Error::protocol(me, "via:soft accepting thread panicked")));
        (acc, err.map_or(Ok(out), Err))
    });
    let connected = connected?;
    let mut accepted = accepted?;
    let mut nics: Vec<Option<SoftNic>> = (0..n).map(|_| None).collect();
    let socks = accepted
        .iter_mut()
        .take(me)
        .map(std::mem::take)
        .chain(std::iter::once([None, None]))
        .chain(connected);
    for (j, pair) in socks.enumerate() {
        let [Some(ctrl), Some(data)] = pair else {
            continue;
        };
        let Some(arena) = arenas[j].take() else {
            continue;
        };
        let (waddr, wkey) = peers[j].1;
        nics[j] = Some(SoftNic::new(
            j,
            Sock::Tcp(ctrl),
            Sock::Tcp(data),
            dev,
            arena,
            Remote {
                addr: waddr,
                rkey: wkey,
            },
        )?);
    }
    if let Some(j) = (0..n).find(|&j| j != me && nics[j].is_none()) {
        return Err(Error::protocol(
            j,
            "via:soft: connection missing after setup",
        ));
    }
    Ok(nics)
}
