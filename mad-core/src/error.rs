//! Errors of the core layer.
//!
//! One `non_exhaustive` enum for everything a Madeleine call can report. Native codes (errno,
//! verbs, MPI, SISCI) are converted by each driver in one place into these variants; the
//! original code travels in the message or the `source`.

use std::fmt;
use std::io;

/// Result type of every fallible Madeleine call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a piece descriptor says in checked mode: the piece index, its length and its modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceDesc {
    /// Position of the piece in its message (0-based).
    pub index: u32,
    /// Length in bytes.
    pub len: u64,
    /// Send mode.
    pub send: crate::SendMode,
    /// Receive mode.
    pub recv: crate::RecvMode,
}

impl fmt::Display for PieceDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "piece #{} ({} B, send {:?}, recv {:?})",
            self.index, self.len, self.send, self.recv
        )
    }
}

/// One side of an unpack mismatch: either a piece or the end of the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceOrEnd {
    /// A piece.
    Piece(PieceDesc),
    /// The end of the message, after this many pieces.
    End {
        /// Number of pieces in the message.
        pieces: u32,
    },
}

impl fmt::Display for PieceOrEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PieceOrEnd::Piece(p) => p.fmt(f),
            PieceOrEnd::End { pieces } => write!(f, "end of message after {pieces} pieces"),
        }
    }
}

/// Everything that can go wrong in Madeleine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer closed its end (orderly shutdown or process exit) while a call needed it.
    #[error("peer rank {rank} closed the connection")]
    PeerClosed {
        /// The peer's rank.
        rank: usize,
    },
    /// The connection to a peer broke (reset, timeout, I/O failure).
    #[error("connection to rank {rank} lost: {source}")]
    ConnectionLost {
        /// The peer's rank.
        rank: usize,
        /// The underlying failure.
        #[source]
        source: io::Error,
    },
    /// Checked mode: the receiver's unpack sequence differs from the sender's pack sequence.
    #[error(
        "unpack mismatch from rank {rank}: sender packed {sent}, receiver asked for {expected}"
    )]
    UnpackMismatch {
        /// The sender's rank.
        rank: usize,
        /// What the sender packed at this position.
        sent: PieceOrEnd,
        /// What the receiver asked for at this position.
        expected: PieceOrEnd,
    },
    /// A driver, a library or a device is not available on this host.
    #[error("driver `{driver}` unavailable: {reason}")]
    Unavailable {
        /// Driver name (`via:verbs`, `sisci:dolphin`, ...).
        driver: String,
        /// Why, and what to use instead.
        reason: String,
    },
    /// A configuration value (channel spec, threshold, environment variable) is wrong.
    #[error("bad configuration: {0}")]
    BadConfig(String),
    /// A peer sent bytes that do not follow the protocol.
    #[error("protocol violation from rank {rank}: {what}")]
    Protocol {
        /// The peer's rank (or this rank for local misuse detected late).
        rank: usize,
        /// What was wrong.
        what: String,
    },
    /// An earlier failure left this connection unusable; the cause is repeated here.
    #[error("connection to rank {rank} unusable after an earlier failure: {cause}")]
    Poisoned {
        /// The peer's rank.
        rank: usize,
        /// Why the connection was poisoned.
        cause: String,
    },
    /// A rank outside the session, or this process's own rank.
    #[error("bad rank {rank}: session has {size} processes and this is rank {me}")]
    BadRank {
        /// The rank asked for.
        rank: usize,
        /// Session size.
        size: usize,
        /// This process's rank.
        me: usize,
    },
    /// This thread already has a message open in that direction with that peer on this channel
    /// (a connection carries one message at a time in each direction): waiting would wait for
    /// itself. Finish (`end_packing` / `end_unpacking`) or drop the first one.
    #[error("this thread already has an open {direction} rank {rank} on this channel; finish it first (one message at a time per direction)")]
    InUse {
        /// The peer's rank.
        rank: usize,
        /// `"message to"` or `"message from"`.
        direction: &'static str,
    },
    /// A call did not complete within the configured operation timeout.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The channel was closed ([`Channel::close`](crate::Channel::close)) by this process,
    /// before or during the call.
    #[error("channel `{channel}` is closed")]
    Closed {
        /// The channel's name.
        channel: String,
    },
    /// A connection attempt failed authentication (wrong or missing session secret).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// A local resource limit (memory, file descriptors, segments) was hit.
    #[error("resource exhausted: {0}")]
    Resource(String),
    /// Any other I/O failure, with context.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying failure.
        #[source]
        source: io::Error,
    },
    /// A collective operation (a channel open) failed on another rank, which told the others:
    /// this rank's part is abandoned. `kind` and `message` are that rank's error
    /// ([`Error::kind_name`] and its text).
    #[error("{what} failed on rank {rank}: {message}")]
    RemoteFailure {
        /// What failed (`channel `x`: open`).
        what: String,
        /// The rank whose own part failed first.
        rank: usize,
        /// Its error's kind ([`Error::kind_name`] on that rank: `Resource`, `Io`, ...).
        kind: String,
        /// Its error's text.
        message: String,
    },
    /// A collective operation (a channel open) did not complete within its deadline.
    #[error("{what} timed out after {after:?}{}", waiting_for(.missing))]
    CollectiveTimeout {
        /// What timed out (`channel `x`: open`).
        what: String,
        /// The bound that expired.
        after: std::time::Duration,
        /// The ranks that had not arrived, where the bootstrap knows (empty otherwise).
        missing: Vec<usize>,
    },
}

fn waiting_for(missing: &[usize]) -> String {
    match missing {
        [] => String::new(),
        [r] => format!(" waiting for rank {r}"),
        rs => {
            let list: Vec<String> = rs.iter().take(16).map(|r| r.to_string()).collect();
            let more = if rs.len() > 16 {
                format!(" and {} more", rs.len() - 16)
            } else {
                String::new()
            };
            format!(" waiting for ranks {}{more}", list.join(", "))
        }
    }
}

impl Error {
    /// Wrap an I/O error with context.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Build a protocol violation.
    pub fn protocol(rank: usize, what: impl Into<String>) -> Self {
        Error::Protocol {
            rank,
            what: what.into(),
        }
    }

    /// Whether this error means the connection to the peer is gone (as opposed to misuse).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            Error::PeerClosed { .. }
                | Error::ConnectionLost { .. }
                | Error::Timeout(_)
                | Error::RemoteFailure { .. }
                | Error::CollectiveTimeout { .. }
        )
    }

    /// The variant's name (`Resource`, `Io`, ...): how another rank learns what kind of error
    /// ended this rank's part of a collective ([`Error::RemoteFailure::kind`]).
    pub fn kind_name(&self) -> &'static str {
        match self {
            Error::PeerClosed { .. } => "PeerClosed",
            Error::ConnectionLost { .. } => "ConnectionLost",
            Error::UnpackMismatch { .. } => "UnpackMismatch",
            Error::Unavailable { .. } => "Unavailable",
            Error::BadConfig(_) => "BadConfig",
            Error::Protocol { .. } => "Protocol",
            Error::Poisoned { .. } => "Poisoned",
            Error::BadRank { .. } => "BadRank",
            Error::InUse { .. } => "InUse",
            Error::Timeout(_) => "Timeout",
            Error::Closed { .. } => "Closed",
            Error::Auth(_) => "Auth",
            Error::Resource(_) => "Resource",
            Error::Io { .. } => "Io",
            Error::RemoteFailure { .. } => "RemoteFailure",
            Error::CollectiveTimeout { .. } => "CollectiveTimeout",
        }
    }
}
