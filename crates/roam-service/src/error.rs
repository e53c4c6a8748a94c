//! What can go wrong, kept apart by kind: a cut that cannot be resumed
//! (a refused move), a local limit, API misuse, and malformed input.

use std::fmt;

use crate::ChannelId;

/// Why a service-continuation operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A reader read more than its log may hold since its last export: a
    /// move now would need bytes that were not kept. The process goes on;
    /// its next export trims the log and makes moves possible again.
    LogOverflow {
        /// The channel whose log is over its cap.
        channel: ChannelId,
        /// Bytes the move would have to carry.
        logged: u64,
        /// The cap ([`crate::Limits::log_bytes`]).
        cap: usize,
    },
    /// A writer in a nondeterministic interval wrote more than may be held
    /// back until its next export: the process must export first.
    HoldFull {
        /// The channel written to.
        channel: ChannelId,
        /// The cap ([`crate::Limits::hold_bytes`]).
        cap: usize,
    },
    /// The process associated the same channel end twice.
    DuplicateChannel {
        /// The channel.
        channel: ChannelId,
    },
    /// The process has no end of this channel.
    UnknownChannel {
        /// The channel.
        channel: ChannelId,
    },
    /// Two parts of a cut hold the same end of a channel.
    DuplicateEnd {
        /// The channel.
        channel: ChannelId,
        /// `"writer"` or `"reader"`.
        end: &'static str,
    },
    /// A channel's other end is in no part of the cut.
    MissingEnd {
        /// The channel.
        channel: ChannelId,
        /// The end that is missing: `"writer"` or `"reader"`.
        end: &'static str,
    },
    /// The reader had not taken in bytes its writer had already sent: the
    /// cut was taken before the channel was drained, and those bytes would
    /// be lost.
    Undrained {
        /// The channel.
        channel: ChannelId,
        /// Bytes sent but neither read nor carried.
        missing: u64,
    },
    /// The two ends' positions cannot belong to one execution (the reader
    /// is past what the writer ever sent).
    Inconsistent {
        /// The channel.
        channel: ChannelId,
        /// What disagrees.
        why: &'static str,
    },
    /// The caller broke the API's contract (e.g. reported more bytes sent
    /// than were pending).
    Misuse(&'static str),
    /// An encoded cut ends before a field it announced.
    Truncated {
        /// Byte offset of the missing field.
        offset: usize,
        /// The field.
        what: &'static str,
    },
    /// An encoded cut is malformed.
    Malformed {
        /// Byte offset where decoding stopped.
        offset: usize,
        /// What was wrong there.
        what: &'static str,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::LogOverflow { channel, logged, cap } => write!(
                f,
                "channel {channel}: the reader's log holds {logged} bytes read since its last export, over its cap of {cap}; \
                 the session cannot move until that process exports again"
            ),
            Error::HoldFull { channel, cap } => write!(
                f,
                "channel {channel}: {cap} bytes are already held back in a nondeterministic interval; export before writing more"
            ),
            Error::DuplicateChannel { channel } => {
                write!(f, "channel {channel} is already associated with this process")
            }
            Error::UnknownChannel { channel } => {
                write!(f, "channel {channel} is not associated with this process")
            }
            Error::DuplicateEnd { channel, end } => {
                write!(f, "channel {channel}: two parts of the cut hold its {end}")
            }
            Error::MissingEnd { channel, end } => write!(
                f,
                "channel {channel}: its {end} is in no part of the cut (both ends of a channel must be in the service set)"
            ),
            Error::Undrained { channel, missing } => write!(
                f,
                "channel {channel}: {missing} bytes sent by the writer were not taken in by the reader when the cut was taken; \
                 drain every channel after freezing the processes"
            ),
            Error::Inconsistent { channel, why } => {
                write!(f, "channel {channel}: inconsistent cut: {why}")
            }
            Error::Misuse(what) => write!(f, "misuse of the service-continuation API: {what}"),
            Error::Truncated { offset, what } => {
                write!(f, "service continuation truncated at byte {offset}: {what} is missing")
            }
            Error::Malformed { offset, what } => {
                write!(f, "malformed service continuation at byte {offset}: {what}")
            }
        }
    }
}

impl std::error::Error for Error {}
