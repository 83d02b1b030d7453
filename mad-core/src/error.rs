//! Errors of the core layer.
//!
//! One `non_exhaustive` enum for everything a Madeleine call can report. Native codes (errno,
//! verbs, MPI, SISCI) are converted by each driver in one place into these variants; the
//! original code travels in the message or the `source`.

use std::fmt;
use std::io;
use std::sync::Arc;

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
    /// A driver, a library or a device is not available on this host
    /// ([`Error::unavailable`], [`Error::unavailable_because`]).
    #[error("driver `{driver}` unavailable: {reason}")]
    Unavailable {
        /// Driver name (`via:verbs`, `sisci:dolphin`, ...).
        driver: String,
        /// Why, and what to use instead.
        reason: String,
        /// The failure behind it, when there is one (a library's error code, a failed load):
        /// [`std::error::Error::source`] of this error.
        #[source]
        source: Option<Cause>,
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
        /// Why the connection was poisoned (the earlier failure, as recorded):
        /// [`std::error::Error::source`] of this error.
        #[source]
        cause: Cause,
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
    /// A piece would make its message longer than the channel's driver carries in one
    /// message ([`Capabilities::max_message`](crate::driver::Capabilities::max_message)). The
    /// piece was refused before any of it was sent; the message stays open (end it, or drop
    /// the packer to abandon it) and the connection usable.
    #[error(
        "channel `{channel}`: a message of {len} B to rank {rank} is longer than driver \
         `{driver}` carries in one message ({max} B); the piece was refused, nothing of it was sent"
    )]
    MessageTooLarge {
        /// The channel's name.
        channel: String,
        /// The driver's name.
        driver: String,
        /// The peer's rank.
        rank: usize,
        /// The message's payload length had the piece been packed.
        len: u64,
        /// The driver's bound on a message's payload.
        max: u64,
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

/// The cause of an [`Error::Poisoned`] or an [`Error::Unavailable`]: an earlier failure,
/// shared (cheap to clone) because one cause may poison many later calls.
///
/// Its `Display` is the failure's; [`std::error::Error::source`] goes on down the failure's own
/// chain; [`Cause::get_ref`] gives the failure itself (to downcast, e.g. to
/// [`std::io::Error`]). A cause that was only recorded as text is a message.
///
/// ```
/// use mad_core::error::Cause;
/// let c = Cause::from("the peer closed the connection");
/// assert_eq!(c.to_string(), "the peer closed the connection");
/// let io = Cause::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
/// let e = io.get_ref().downcast_ref::<std::io::Error>().unwrap();
/// assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
/// ```
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// The cause `e`.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Cause(Arc::new(e))
    }

    /// A cause known only as a message.
    pub fn msg(text: impl Into<String>) -> Self {
        let e: Box<dyn std::error::Error + Send + Sync> = text.into().into();
        Cause(Arc::from(e))
    }

    /// The failure itself.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl From<String> for Cause {
    fn from(text: String) -> Self {
        Cause::msg(text)
    }
}

impl From<&str> for Cause {
    fn from(text: &str) -> Self {
        Cause::msg(text)
    }
}

impl From<Error> for Cause {
    fn from(e: Error) -> Self {
        Cause::new(e)
    }
}

impl From<io::Error> for Cause {
    fn from(e: io::Error) -> Self {
        Cause::new(e)
    }
}

/// A stable classification of an [`Error`] ([`Error::kind`]): what a caller decides on (retry,
/// give up on a peer, fix the configuration), without matching variants' fields or messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The peer is gone: it closed its end or the connection broke
    /// ([`Error::PeerClosed`], [`Error::ConnectionLost`]).
    PeerGone,
    /// An earlier failure left the connection unusable ([`Error::Poisoned`]).
    Poisoned,
    /// A call or a collective did not complete in time ([`Error::Timeout`],
    /// [`Error::CollectiveTimeout`]).
    Timeout,
    /// Another rank's part of a collective failed ([`Error::RemoteFailure`]).
    RemoteFailure,
    /// The channel was closed by this process ([`Error::Closed`]).
    Closed,
    /// A driver, a library or a device is missing here ([`Error::Unavailable`]).
    Unavailable,
    /// A configuration value is wrong ([`Error::BadConfig`]).
    Config,
    /// A peer broke the protocol ([`Error::Protocol`]).
    Protocol,
    /// Checked mode: the unpack sequence differs from the pack sequence
    /// ([`Error::UnpackMismatch`]).
    Mismatch,
    /// A rank outside the session, or this process's own ([`Error::BadRank`]).
    BadRank,
    /// This thread already has a message open with that peer in that direction
    /// ([`Error::InUse`]).
    InUse,
    /// Authentication failed ([`Error::Auth`]).
    Auth,
    /// A local resource limit was hit ([`Error::Resource`]).
    Resource,
    /// Another I/O failure ([`Error::Io`]).
    Io,
    /// A message longer than the driver carries ([`Error::MessageTooLarge`]).
    TooLarge,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::PeerGone => "peer gone",
            ErrorKind::Poisoned => "connection poisoned",
            ErrorKind::Timeout => "timed out",
            ErrorKind::RemoteFailure => "failed on another rank",
            ErrorKind::Closed => "channel closed",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Config => "bad configuration",
            ErrorKind::Protocol => "protocol violation",
            ErrorKind::Mismatch => "unpack mismatch",
            ErrorKind::BadRank => "bad rank",
            ErrorKind::InUse => "in use",
            ErrorKind::Auth => "authentication failed",
            ErrorKind::Resource => "resource exhausted",
            ErrorKind::Io => "I/O error",
            ErrorKind::TooLarge => "message too large",
        })
    }
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

    /// A driver unavailable here, for `reason` (why, and what to use instead).
    pub fn unavailable(driver: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Unavailable {
            driver: driver.into(),
            reason: reason.into(),
            source: None,
        }
    }

    /// A driver unavailable here, for `reason`, because of `cause` (its
    /// [`source`](std::error::Error::source)).
    pub fn unavailable_because(
        driver: impl Into<String>,
        reason: impl Into<String>,
        cause: impl Into<Cause>,
    ) -> Self {
        Error::Unavailable {
            driver: driver.into(),
            reason: reason.into(),
            source: Some(cause.into()),
        }
    }

    /// A connection to `rank` unusable because of the earlier failure `cause`.
    pub fn poisoned(rank: usize, cause: impl Into<Cause>) -> Self {
        Error::Poisoned {
            rank,
            cause: cause.into(),
        }
    }

    /// The stable classification of this error.
    ///
    /// ```
    /// use mad_core::{Error, ErrorKind};
    /// let e = Error::PeerClosed { rank: 1 };
    /// assert_eq!(e.kind(), ErrorKind::PeerGone);
    /// assert_eq!(Error::BadConfig("x".into()).kind(), ErrorKind::Config);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::PeerClosed { .. } | Error::ConnectionLost { .. } => ErrorKind::PeerGone,
            Error::UnpackMismatch { .. } => ErrorKind::Mismatch,
            Error::Unavailable { .. } => ErrorKind::Unavailable,
            Error::BadConfig(_) => ErrorKind::Config,
            Error::Protocol { .. } => ErrorKind::Protocol,
            Error::Poisoned { .. } => ErrorKind::Poisoned,
            Error::BadRank { .. } => ErrorKind::BadRank,
            Error::InUse { .. } => ErrorKind::InUse,
            Error::Timeout(_) | Error::CollectiveTimeout { .. } => ErrorKind::Timeout,
            Error::Closed { .. } => ErrorKind::Closed,
            Error::Auth(_) => ErrorKind::Auth,
            Error::Resource(_) => ErrorKind::Resource,
            Error::Io { .. } => ErrorKind::Io,
            Error::RemoteFailure { .. } => ErrorKind::RemoteFailure,
            Error::MessageTooLarge { .. } => ErrorKind::TooLarge,
        }
    }

    /// For an [`Error::RemoteFailure`]: the kind of the error that ended the other rank's part
    /// (`None` for any other error, or a kind this version does not know).
    ///
    /// ```
    /// use mad_core::{Error, ErrorKind};
    /// let e = Error::RemoteFailure {
    ///     what: "channel `x`: open".into(),
    ///     rank: 2,
    ///     kind: "Unavailable".into(),
    ///     message: "driver `mpi` unavailable: ...".into(),
    /// };
    /// assert_eq!(e.kind(), ErrorKind::RemoteFailure);
    /// assert_eq!(e.remote_kind(), Some(ErrorKind::Unavailable));
    /// ```
    pub fn remote_kind(&self) -> Option<ErrorKind> {
        let Error::RemoteFailure { kind, .. } = self else {
            return None;
        };
        Some(match kind.as_str() {
            "PeerClosed" | "ConnectionLost" => ErrorKind::PeerGone,
            "UnpackMismatch" => ErrorKind::Mismatch,
            "Unavailable" => ErrorKind::Unavailable,
            "BadConfig" => ErrorKind::Config,
            "Protocol" => ErrorKind::Protocol,
            "Poisoned" => ErrorKind::Poisoned,
            "BadRank" => ErrorKind::BadRank,
            "InUse" => ErrorKind::InUse,
            "Timeout" | "CollectiveTimeout" => ErrorKind::Timeout,
            "Closed" => ErrorKind::Closed,
            "Auth" => ErrorKind::Auth,
            "Resource" => ErrorKind::Resource,
            "Io" => ErrorKind::Io,
            "RemoteFailure" => ErrorKind::RemoteFailure,
            "MessageTooLarge" => ErrorKind::TooLarge,
            _ => return None,
        })
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
            Error::MessageTooLarge { .. } => "MessageTooLarge",
        }
    }
}
