//! Connection setup: listen, publish, connect, authenticate.
//!
//! 1. Every rank binds a listener in a fresh private directory and allgathers
//!    `(nonce, path)`.
//! 2. It connects to every lower local rank and sends a hello: its rank, the TM table
//!    fingerprint, its own nonce and a proof (HMAC of the session secret over both nonces and
//!    the channel) that it belongs to the session.
//! 3. It accepts every higher local rank, checks the hello and answers with its fingerprint and
//!    its own proof.
//! 4. It reads the answers of the lower ranks.
//!
//! Every step only waits for bytes already sent by a previous step, so the order cannot
//! deadlock; every wait is bounded by [`SETUP_TIMEOUT`].

use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use mad_core::accept::{self, AcceptFor, Accepted};
use mad_core::auth::{self, NONCE_LEN, PROOF_LEN};
use mad_core::driver::OpenContext;
use mad_core::{Error, Result};

/// Longest wait for a peer during setup.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
const MAGIC: u32 = 0x5344_554d; // "MUDS"
const HELLO: usize = 4 + 4 + 8 + NONCE_LEN + PROOF_LEN;
const ANSWER: usize = 4 + 4 + 8 + PROOF_LEN;

/// A private directory holding this rank's listening socket, removed on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn create() -> Result<Self> {
        let mut r = [0u8; 6];
        auth::fill_random(&mut r)?;
        let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
        let p = std::env::temp_dir().join(format!("mad-uds-{}-{hex}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&p)
            .map_err(|e| Error::io(format!("uds: creating {}", p.display()), e))?;
        Ok(PrivateDir(p))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn io(what: &str, peer: usize, e: std::io::Error) -> Error {
    Error::io(format!("uds setup with rank {peer}: {what}"), e)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// What both proofs are bound to: the channel (its tag `ctx.tag("uds")`) and the
/// (connector, acceptor) ranks.
fn context(tag: &str, connector: usize, acceptor: usize) -> Vec<u8> {
    format!("{tag}/{connector}->{acceptor}").into_bytes()
}

/// Connect this rank to every other local rank: one stream per peer, indexed by rank.
pub fn connect_all(ctx: &OpenContext<'_>) -> Result<Vec<Option<UnixStream>>> {
    let b = ctx.bootstrap;
    let (me, size) = (b.rank(), b.size());
    let local = ctx.local_ranks();
    let fp = ctx.table.fingerprint();
    let secret = b.secret();
    let tag = ctx.tag("uds");

    // 1. Listen and publish.
    let dir = PrivateDir::create()?;
    let path = dir.0.join("s");
    let listener = UnixListener::bind(&path).map_err(|e| io("bind", me, e))?;
    let my_nonce = auth::nonce()?;
    let mut mine = my_nonce.to_vec();
    mine.extend_from_slice(path.as_os_str().as_encoded_bytes());
    let all = b.allgather(&ctx.tag("uds-paths"), &mine)?;
    let mut streams: Vec<Option<UnixStream>> = (0..size).map(|_| None).collect();
    let deadline = Instant::now() + SETUP_TIMEOUT;

    // 2. Connect to lower ranks and say hello.
    for peer in local.iter().copied().filter(|&p| p < me) {
        let info = all
            .get(peer)
            .filter(|v| v.len() > NONCE_LEN)
            .ok_or_else(|| {
                Error::protocol(peer, "uds: malformed endpoint in the bootstrap exchange")
            })?;
        let (their_nonce, their_path) = info.split_at(NONCE_LEN);
        let their_path = PathBuf::from(String::from_utf8_lossy(their_path).into_owned());
        let mut s = UnixStream::connect(&their_path).map_err(|e| io("connect", peer, e))?;
        s.set_read_timeout(Some(SETUP_TIMEOUT))
            .map_err(|e| io("timeout", peer, e))?;
        let mut h = Vec::with_capacity(HELLO);
        h.extend_from_slice(&MAGIC.to_le_bytes());
        h.extend_from_slice(&(me as u32).to_le_bytes());
        h.extend_from_slice(&fp.to_le_bytes());
        h.extend_from_slice(&my_nonce);
        h.extend_from_slice(&secret.proof(
            b"uds-hello",
            their_nonce,
            &my_nonce,
            &context(&tag, me, peer),
        ));
        s.write_all(&h).map_err(|e| io("hello", peer, e))?;
        streams[peer] = Some(s);
    }

    // 3. Accept higher ranks (mad-core's hardened acceptor: a connection that fails the
    // handshake is refused and logged, and accepting goes on).
    let expected: Vec<usize> = local
        .iter()
        .copied()
        .filter(|&p| p > me && p < size)
        .collect();
    let hs = {
        let (secret, tag) = (secret.clone(), tag.clone());
        move |mut s: UnixStream, addr: String| -> Accepted<usize, UnixStream> {
            let refused = |why: String| Accepted::Refused(addr.clone(), why);
            if let Err(e) = s
                .set_nonblocking(false)
                .and_then(|()| s.set_read_timeout(Some(SETUP_TIMEOUT)))
            {
                return refused(format!("cannot configure the socket: {e}"));
            }
            let mut h = [0u8; HELLO];
            if let Err(e) = s.read_exact(&mut h) {
                return refused(format!("reading a hello: {e}"));
            }
            let peer = u32_at(&h, 4) as usize;
            if u32_at(&h, 0) != MAGIC || peer <= me || peer >= size {
                return refused(format!("a bad hello (rank {peer})"));
            }
            let their_nonce = &h[16..16 + NONCE_LEN];
            let cx = context(&tag, peer, me);
            if !secret.verify(
                b"uds-hello",
                &my_nonce,
                their_nonce,
                &cx,
                &h[16 + NONCE_LEN..],
            ) {
                return refused("a hello without the session secret".into());
            }
            let mut a = Vec::with_capacity(ANSWER);
            a.extend_from_slice(&MAGIC.to_le_bytes());
            a.extend_from_slice(&(me as u32).to_le_bytes());
            a.extend_from_slice(&fp.to_le_bytes());
            a.extend_from_slice(&secret.proof(b"uds-answer", &my_nonce, their_nonce, &cx));
            if let Err(e) = s.write_all(&a) {
                return refused(format!("sending the answer: {e}"));
            }
            match check_fingerprint(peer, fp, u64_at(&h, 8)) {
                Ok(()) => Accepted::Peer(peer, s),
                Err(e) => Accepted::Fatal(e),
            }
        }
    };
    let what = AcceptFor {
        driver: "uds",
        channel: &ctx.config.name,
        me,
        deadline,
        timeout: SETUP_TIMEOUT,
        log: mad_core::refusal_log!(),
    };
    let got = accept::accept_all(&what, &listener, &AtomicBool::new(false), &expected, hs)?;
    for (peer, s) in expected.into_iter().zip(got) {
        streams[peer] = Some(s);
    }
    drop(listener);
    drop(dir); // the socket file is no longer needed: connections outlive it

    // 4. Read the lower ranks' answers.
    for peer in local.iter().copied().filter(|&p| p < me) {
        let s = streams[peer]
            .as_mut()
            .ok_or_else(|| Error::protocol(peer, "uds: lost stream"))?;
        let mut a = [0u8; ANSWER];
        s.read_exact(&mut a)
            .map_err(|e| io("reading the answer", peer, e))?;
        let their_nonce = &all[peer][..NONCE_LEN];
        if u32_at(&a, 0) != MAGIC
            || u32_at(&a, 4) as usize != peer
            || !secret.verify(
                b"uds-answer",
                their_nonce,
                &my_nonce,
                &context(&tag, me, peer),
                &a[16..],
            )
        {
            return Err(Error::protocol(peer, "uds: bad answer"));
        }
        check_fingerprint(peer, fp, u64_at(&a, 8))?;
    }
    for s in streams.iter().flatten() {
        s.set_read_timeout(None)
            .and_then(|()| s.set_nonblocking(true))
            .map_err(|e| io("nonblocking", me, e))?;
    }
    Ok(streams)
}

fn check_fingerprint(peer: usize, mine: u64, theirs: u64) -> Result<()> {
    if mine == theirs {
        Ok(())
    } else {
        Err(Error::BadConfig(format!(
            "uds: rank {peer} uses a different TM table (fingerprint {theirs:016x}, ours \
             {mine:016x}): same thresholds on every rank"
        )))
    }
}
