//! Fuzzing-only hooks, compiled only under `cfg(fuzzing)` (cargo-fuzz).
//!
//! The session fuzz targets play a hostile peer that holds the transport keys:
//! they seal arbitrary frames into records with a session's own send keys, so
//! the other session receives them through its real record path.

use super::transport::{Phase, Transport};
use super::Session;
use crate::event::TransportId;
use crate::record::{RecordCipher, MAX_PLAINTEXT};

impl Session {
    /// Fuzzing only: seals `plaintext` (frames) as one record on the active
    /// transport with this session's send keys, as if this session had sent
    /// it, and appends it to `out`. The session's own state is not otherwise
    /// touched. `None` if there is no open transport or the plaintext is too big.
    #[doc(hidden)]
    pub fn fuzz_seal_record(&mut self, plaintext: &[u8], out: &mut Vec<u8>) -> Option<TransportId> {
        if plaintext.len() > MAX_PLAINTEXT {
            return None;
        }
        let t = self.active.as_mut()?;
        let Phase::Open(keys) = &mut t.phase else {
            return None;
        };
        let start = RecordCipher::begin(out);
        out.extend_from_slice(plaintext);
        if keys.tx.seal(out, start).is_err() {
            out.truncate(start);
            return None;
        }
        Some(t.id)
    }

    /// Fuzzing only: one past the highest reliable-frame sequence this session
    /// has sent, so a target playing its peer can acknowledge near it (§7).
    #[doc(hidden)]
    pub fn fuzz_high_sent(&self) -> u64 {
        self.high_sent
    }

    /// Fuzzing only: every stream this session holds, with its unread bytes,
    /// in one pass over the stream table (a target's memory-bound check).
    #[doc(hidden)]
    pub fn fuzz_unread(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.streams.iter().map(|(&id, s)| (id, s.recv_buf.len()))
    }

    /// Fuzzing only: an exact copy of this session, so a target can set up an
    /// established pair once and start every input from a copy of it instead
    /// of running a handshake per input. `None` while a transport is still
    /// handshaking (Noise handshake states cannot be copied). Every field is
    /// listed, so a field added to `Session` breaks the fuzz build until it is
    /// copied here too.
    #[doc(hidden)]
    pub fn fuzz_clone(&self) -> Option<Session> {
        Some(Session {
            role: self.role.clone(),
            config: self.config.clone(),
            state: self.state.clone(),
            close_reason: self.close_reason.clone(),
            setup: self.setup.clone(),
            id: self.id.clone(),
            secret: self.secret.clone(),
            peer_key: self.peer_key.clone(),
            peer_params: self.peer_params.clone(),
            resume_timeout: self.resume_timeout.clone(),
            next_transport: self.next_transport.clone(),
            active: match &self.active {
                Some(t) => Some(Box::new(t.fuzz_clone()?)),
                None => None,
            },
            pending: match &self.pending {
                Some(t) => Some(Box::new(t.fuzz_clone()?)),
                None => None,
            },
            peer_addr: self.peer_addr.clone(),
            suspended_since: self.suspended_since.clone(),
            refused_since: self.refused_since.clone(),
            replay_memory: self.replay_memory.clone(),
            log: self.log.clone(),
            log_base: self.log_base.clone(),
            send_cursor: self.send_cursor.clone(),
            high_sent: self.high_sent.clone(),
            high_sent_changed: self.high_sent_changed.clone(),
            recv_seq: self.recv_seq.clone(),
            in_cursor: self.in_cursor.clone(),
            ack_sent: self.ack_sent.clone(),
            ack_deadline: self.ack_deadline.clone(),
            ack_now: self.ack_now.clone(),
            unacked_bytes: self.unacked_bytes.clone(),
            streams: self.streams.clone(),
            next_local_stream: self.next_local_stream.clone(),
            next_peer_stream: self.next_peer_stream.clone(),
            local_streams_opened: self.local_streams_opened.clone(),
            local_stream_limit: self.local_stream_limit.clone(),
            peer_streams_opened: self.peer_streams_opened.clone(),
            peer_streams_forgotten: self.peer_streams_forgotten.clone(),
            peer_stream_limit: self.peer_stream_limit.clone(),
            send_queue: self.send_queue.clone(),
            write_waiters: self.write_waiters.clone(),
            contenders: self.contenders.clone(),
            conn_send_max: self.conn_send_max.clone(),
            conn_sent: self.conn_sent.clone(),
            conn_recv_max: self.conn_recv_max.clone(),
            conn_received: self.conn_received.clone(),
            conn_consumed: self.conn_consumed.clone(),
            send_buffered: self.send_buffered.clone(),
            ping_token: self.ping_token.clone(),
            ping_outstanding: self.ping_outstanding.clone(),
            pong_due: self.pong_due.clone(),
            final_close: self.final_close.clone(),
            close_requested: self.close_requested.clone(),
            events: self.events.clone(),
            stats: self.stats.clone(),
        })
    }
}

impl Transport {
    /// Fuzzing only: a copy of an open transport (or one between phases);
    /// `None` while it is handshaking.
    fn fuzz_clone(&self) -> Option<Transport> {
        let phase = match &self.phase {
            Phase::Open(keys) => Phase::Open(keys.clone()),
            Phase::Taken => Phase::Taken,
            Phase::ClientNew(_) | Phase::ClientResume(_) | Phase::ServerNew(_) => return None,
        };
        Some(Transport {
            id: self.id,
            peer: self.peer,
            phase,
            inbuf: self.inbuf.clone(),
            out: self.out.clone(),
            started: self.started,
            last_recv: self.last_recv,
            last_send: self.last_send,
            may_send: self.may_send,
            sync_sent: self.sync_sent,
            sync_received: self.sync_received,
            info_due: self.info_due,
            pending_resume: self.pending_resume,
            is_resume: self.is_resume,
            retire: self.retire,
        })
    }
}
