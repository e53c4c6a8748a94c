//! Per-stream state: the send buffer that doubles as the retransmission
//! buffer, the receive buffer, and both flow-control limits.
//!
//! Spec: `docs/PROTOCOL.md` §6 (streams) and §8 (flow control).

use std::collections::VecDeque;

/// Identifies a stream within its session. Bit 0 is the opener's role:
/// 0 = opened by the client, 1 = opened by the server (§6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug)]
// Fuzzing only: the session targets clone an established pair per input.
#[cfg_attr(fuzzing, derive(Clone))]
pub(crate) struct Stream {
    /// Opaque metadata given at open (e.g. relay target); kept for `OPEN` retransmission.
    pub(crate) meta: Vec<u8>,

    // --- send side. `send_buf` holds bytes [send_base, written): the
    // unacknowledged prefix is the retransmission buffer, the rest is unsent.
    pub(crate) send_buf: VecDeque<u8>,
    pub(crate) send_base: u64,
    /// Bytes handed to the transport at least once.
    pub(crate) sent: u64,
    /// The peer's limit for this stream (absolute offset).
    pub(crate) send_max: u64,
    /// Application called `finish`.
    pub(crate) fin_requested: bool,
    /// `DATA_FIN` is in the log.
    pub(crate) fin_sent: bool,
    /// `DATA_FIN` was acknowledged: the peer has every byte.
    pub(crate) fin_acked: bool,
    /// Reliable frames of this stream still in the log (keep state until 0).
    pub(crate) in_log: u32,
    /// A `write` was refused for lack of buffer; tell the app when space frees.
    pub(crate) write_blocked: bool,
    /// Queued in the session's round-robin of streams with something to send.
    pub(crate) queued: bool,
    /// A `write` was refused for lack of room and the stream still holds
    /// unacknowledged bytes: it counts in the session's fair share (§8).
    pub(crate) contending: bool,

    // --- receive side
    pub(crate) recv_buf: VecDeque<u8>,
    /// Total bytes received (= offset of the next expected byte).
    pub(crate) received: u64,
    /// Limit we granted (absolute offset).
    pub(crate) recv_max: u64,
    /// The peer's `DATA_FIN` arrived.
    pub(crate) fin_received: bool,
    /// Application saw end-of-stream.
    pub(crate) eof_delivered: bool,

    /// Reset by either side, with the code; both directions are over.
    pub(crate) reset: Option<u64>,
    /// The application knows of the reset (it reset the stream, or a call
    /// returned `Reset`), so the stream may be forgotten.
    pub(crate) reset_seen: bool,
}

impl Stream {
    pub(crate) fn new(meta: Vec<u8>, send_max: u64, recv_max: u64) -> Self {
        Self {
            meta,
            send_buf: VecDeque::new(),
            send_base: 0,
            sent: 0,
            send_max,
            fin_requested: false,
            fin_sent: false,
            fin_acked: false,
            in_log: 0,
            write_blocked: false,
            queued: false,
            contending: false,
            recv_buf: VecDeque::new(),
            received: 0,
            recv_max,
            fin_received: false,
            eof_delivered: false,
            reset: None,
            reset_seen: false,
        }
    }

    /// Offset one past the last byte written by the application.
    pub(crate) fn written(&self) -> u64 {
        self.send_base + self.send_buf.len() as u64
    }

    /// Whether the round-robin should visit this stream for new data.
    pub(crate) fn wants_send(&self) -> bool {
        self.reset.is_none()
            && (self.sent < self.written() || (self.fin_requested && !self.fin_sent))
    }

    /// Drops acknowledged bytes up to `end` from the retransmission buffer.
    pub(crate) fn ack_to(&mut self, end: u64) {
        if end > self.send_base {
            let n = (end - self.send_base).min(self.send_buf.len() as u64) as usize;
            self.send_buf.drain(..n);
            self.send_base += n as u64;
        }
    }

    /// Copies `len` buffered bytes starting at `offset` onto `out`.
    pub(crate) fn copy_out(&self, offset: u64, len: usize, out: &mut Vec<u8>) {
        let start = (offset - self.send_base) as usize;
        let (a, b) = self.send_buf.as_slices();
        if start < a.len() {
            let a_end = (start + len).min(a.len());
            out.extend_from_slice(&a[start..a_end]);
            out.extend_from_slice(&b[..len - (a_end - start)]);
        } else {
            let s = start - a.len();
            out.extend_from_slice(&b[s..s + len]);
        }
    }

    /// Both directions finished and nothing left to retransmit or read.
    pub(crate) fn is_done(&self) -> bool {
        self.in_log == 0
            && match self.reset {
                Some(_) => self.reset_seen,
                None => self.fin_acked && self.eof_delivered,
            }
    }
}
