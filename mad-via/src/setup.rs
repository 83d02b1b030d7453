//! Connection setup of the soft backend: listen, exchange addresses through the session
//! bootstrap, connect every pair once, and authenticate with the session secret.
//!
//! Rank `i` connects to every rank `j > i` and accepts from every rank below it. The handshake
//! ([`Hello`] records) proves both ends know the session secret (HMAC over both nonces, the
//! channel and the two ranks; the secret never crosses the wire) and checks that both ends
//! agree on the TM table fingerprint and the small-TM slot configuration.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mad_core::driver::OpenContext;
use mad_core::{Error, Result};

use crate::reg::Pd;
use crate::soft::{Conn, Endpoint, SlotConfig, Sock};
use crate::wire::{Hello, HELLO_LEN};

const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

fn context(channel: &str, connector: usize, acceptor: usize) -> Vec<u8> {
    format!("mad-via/{channel}/{connector}->{acceptor}").into_bytes()
}

fn read_hello(s: &mut TcpStream, who: &str) -> Result<Hello> {
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b)
        .map_err(|e| Error::io(format!("via:soft handshake with {who}"), e))?;
    Hello::decode(&b).map_err(|e| Error::Auth(format!("handshake with {who}: {e}")))
}

fn check_peer(mine: &Hello, theirs: &Hello, who: &str) -> Result<()> {
    if theirs.fingerprint != mine.fingerprint {
        return Err(Error::BadConfig(format!(
            "via: {who} uses a different TM table (fingerprint {:#x}, ours {:#x}): check the tm.* thresholds of the channel on every rank",
            theirs.fingerprint, mine.fingerprint
        )));
    }
    if theirs.slots != mine.slots || theirs.slot_size != mine.slot_size || theirs.size != mine.size
    {
        return Err(Error::BadConfig(format!(
            "via: {who} has {} slots of {} B in a session of {}, we have {} of {} B in {}",
            theirs.slots, theirs.slot_size, theirs.size, mine.slots, mine.slot_size, mine.size
        )));
    }
    Ok(())
}

/// Open every connection of a `via:soft` channel.
pub(crate) fn open_soft(
    ctx: &OpenContext<'_>,
    pd: &Arc<Pd>,
    cfg: SlotConfig,
) -> Result<Vec<Option<Endpoint>>> {
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
    let all = b.allgather(&ctx.tag("soft-addr"), addr.to_string().as_bytes())?;
    let secret = b.secret();
    let mine = |nonce: [u8; 16]| Hello {
        rank: me as u32,
        size: n as u32,
        fingerprint: ctx.table.fingerprint(),
        slots: cfg.slots as u32,
        slot_size: cfg.slot_size as u32,
        nonce,
        proof: [0; 32],
    };
    let mut eps: Vec<Option<Endpoint>> = (0..n).map(|_| None).collect();

    // Connect upward.
    for (j, raw) in all.iter().enumerate().skip(me + 1) {
        let who = format!("rank {j}");
        let text = String::from_utf8_lossy(raw).to_string();
        let target = text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::protocol(j, format!("bad via:soft address `{text}`")))?;
        let mut s = TcpStream::connect_timeout(&target, SETUP_TIMEOUT)
            .map_err(|e| Error::io(format!("via:soft: connecting to {who} at {target}"), e))?;
        s.set_read_timeout(Some(SETUP_TIMEOUT))
            .map_err(|e| Error::io("via:soft: socket option", e))?;
        let ha = read_hello(&mut s, &who)?;
        let nonce_c = mad_core::auth::nonce()?;
        let mut hc = mine(nonce_c);
        check_peer(&hc, &ha, &who)?;
        if ha.rank as usize != j {
            return Err(Error::Auth(format!(
                "connected to {who} but the peer says it is rank {}",
                ha.rank
            )));
        }
        let cx = context(&ctx.config.name, me, j);
        hc.proof = secret.proof(b"mad-via/connect", &ha.nonce, &nonce_c, &cx);
        s.write_all(&hc.encode())
            .map_err(|e| Error::io(format!("via:soft handshake with {who}"), e))?;
        let hack = read_hello(&mut s, &who)?;
        if hack.nonce != ha.nonce
            || !secret.verify(b"mad-via/accept", &ha.nonce, &nonce_c, &cx, &hack.proof)
        {
            return Err(Error::Auth(format!(
                "{who} did not prove it knows the session secret"
            )));
        }
        eps[j] = Some(Endpoint::from_conn(Conn::new(j, Sock::Tcp(s), pd, cfg)?));
    }

    // Accept from below.
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("via:soft: listener", e))?;
    let deadline = Instant::now() + SETUP_TIMEOUT;
    let mut missing = me;
    while missing > 0 {
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout(SETUP_TIMEOUT));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(Error::io("via:soft: accept", e)),
        };
        s.set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(Some(SETUP_TIMEOUT)))
            .map_err(|e| Error::io("via:soft: socket option", e))?;
        let nonce_a = mad_core::auth::nonce()?;
        let ha = mine(nonce_a);
        s.write_all(&ha.encode())
            .map_err(|e| Error::io("via:soft handshake", e))?;
        let hc = match read_hello(&mut s, "a connecting rank") {
            Ok(h) => h,
            // A stranger (or a peer that refused our table): drop it and keep accepting.
            Err(_) => continue,
        };
        let j = hc.rank as usize;
        let cx = context(&ctx.config.name, j, me);
        if j >= me
            || eps[j].is_some()
            || !secret.verify(b"mad-via/connect", &nonce_a, &hc.nonce, &cx, &hc.proof)
        {
            continue;
        }
        check_peer(&ha, &hc, &format!("rank {j}"))?;
        let mut ack = mine(nonce_a);
        ack.proof = secret.proof(b"mad-via/accept", &nonce_a, &hc.nonce, &cx);
        s.write_all(&ack.encode())
            .map_err(|e| Error::io(format!("via:soft handshake with rank {j}"), e))?;
        s.set_read_timeout(None)
            .map_err(|e| Error::io("via:soft: socket option", e))?;
        eps[j] = Some(Endpoint::from_conn(Conn::new(j, Sock::Tcp(s), pd, cfg)?));
        missing -= 1;
    }
    Ok(eps)
}
