//! Building outgoing records (§3, §7): SYNC/SESSION_INFO at a transport's
//! start, ACK/PING/PONG, retransmission of the log from the peer's position,
//! then new stream data round-robin within the flow-control windows.

use std::time::Instant;

use super::transport::Phase;
use super::{Entry, Session, State};
use crate::event::{Event, TransportId};
use crate::frame::{data_header_len, encode_data_header, Frame};
use crate::record::{RecordCipher, MAX_PLAINTEXT};
use crate::Error;

/// Bytes one `poll_transmit` call produces at most (several records), so a
/// driver alternates between reading and writing under load.
const TRANSMIT_BUDGET: usize = 256 * 1024;
/// Room left in a record below which no new data chunk is started.
const MIN_CHUNK_ROOM: usize = 64;

impl Session {
    /// Appends bytes for one transport to `out` and returns which, or `None`
    /// when there is nothing to send. Call until `None` after every input,
    /// timeout or application call.
    #[must_use]
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<u8>) -> Option<TransportId> {
        if let Some(p) = self.pending.as_mut() {
            if !p.out.is_empty() {
                out.append(&mut p.out);
                p.last_send = now;
                return Some(p.id);
            }
        }
        let mut t = self.active.take()?;
        let start = out.len();
        out.append(&mut t.out);
        if t.is_open() && t.may_send {
            // The keys leave the transport while records are built (the
            // builder borrows both); `Taken` is never seen meanwhile.
            let mut phase = std::mem::replace(&mut t.phase, Phase::Taken);
            let r = match &mut phase {
                Phase::Open(keys) => self.build_records(now, &mut t, &mut keys.tx, out),
                _ => Ok(()),
            };
            t.phase = phase;
            if let Err(e) = r {
                out.truncate(start);
                self.active = Some(t);
                self.lose_active(now, crate::event::SuspendReason::TransportError(e));
                return None;
            }
        }
        let id = t.id;
        let wrote = out.len() > start;
        if wrote {
            t.last_send = now;
        }
        if t.retire {
            self.events.push_back(Event::TransportClosed {
                transport: id,
                error: None,
            });
        } else {
            self.active = Some(t);
        }
        wrote.then_some(id)
    }

    fn build_records(
        &mut self,
        now: Instant,
        t: &mut super::transport::Transport,
        tx: &mut RecordCipher,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        let budget_end = out.len() + TRANSMIT_BUDGET;
        while out.len() < budget_end {
            let rec = RecordCipher::begin(out);
            let limit = out.len() + MAX_PLAINTEXT;
            let mut substantive = false;

            if self.state == State::Closed {
                if let Some(code) = self.final_close.take() {
                    Frame::Close { code, reason: b"" }.encode(out);
                    substantive = true;
                }
                if self.recv_seq > self.ack_sent {
                    Frame::Ack {
                        received: self.recv_seq,
                    }
                    .encode(out);
                    self.ack_sent = self.recv_seq;
                    substantive = true;
                }
                self.ack_deadline = None;
                self.ack_now = false;
                if substantive {
                    tx.seal(out, rec)?;
                } else {
                    out.truncate(rec);
                }
                break;
            }

            if t.info_due {
                if let (Some(id), Some(secret)) = (self.id, self.secret) {
                    Frame::SessionInfo {
                        session_id: id.0,
                        resume_secret: secret,
                        resume_timeout_secs: self.resume_timeout.as_secs(),
                    }
                    .encode(out);
                }
                t.info_due = false;
                substantive = true;
            }
            if !t.sync_sent {
                Frame::Sync {
                    received: self.recv_seq,
                    next: self.send_cursor,
                }
                .encode(out);
                self.ack_sent = self.recv_seq;
                self.ack_deadline = None;
                self.ack_now = false;
                self.unacked_bytes = 0;
                t.sync_sent = true;
                substantive = true;
            }
            let ack_written = self.recv_seq > self.ack_sent;
            if ack_written {
                Frame::Ack {
                    received: self.recv_seq,
                }
                .encode(out);
            }
            if let Some(token) = self.pong_due.take() {
                Frame::Pong { token }.encode(out);
                substantive = true;
            }
            if now >= t.last_send + self.config.heartbeat_interval() {
                self.ping_token += 1;
                Frame::Ping {
                    token: self.ping_token,
                }
                .encode(out);
                self.ping_outstanding = Some((self.ping_token, now));
                substantive = true;
            }

            let mut full = self.write_log(out, limit) || self.write_new_data(out, limit);
            if !full
                && self.close_requested.is_some()
                && self.streams.values().all(|s| !s.wants_send())
            {
                if let Some((code, reason)) = self.close_requested.take().map(|b| *b) {
                    self.log.push_back(Entry::Close { code, reason });
                    full = self.write_log(out, limit);
                }
            }
            substantive |= self.high_sent_changed;
            self.high_sent_changed = false;

            if !substantive {
                let ack_due = self.ack_now || self.ack_deadline.is_some_and(|d| now >= d);
                if !(ack_written && ack_due) {
                    out.truncate(rec);
                    break;
                }
            }
            if ack_written {
                self.ack_sent = self.recv_seq;
                self.ack_deadline = None;
                self.ack_now = false;
                self.unacked_bytes = 0;
            }
            tx.seal(out, rec)?;
            t.last_send = now;
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// Writes log entries from the send cursor. Returns `true` if the record filled up.
    fn write_log(&mut self, out: &mut Vec<u8>, limit: usize) -> bool {
        while self.send_cursor < self.log_base + self.log.len() as u64 {
            let idx = (self.send_cursor - self.log_base) as usize;
            let mark = out.len();
            let data_len = self.encode_entry(idx, out);
            if out.len() > limit {
                out.truncate(mark);
                return true;
            }
            if self.send_cursor < self.high_sent {
                self.stats.frames_replayed += 1;
                self.stats.bytes_replayed += data_len;
            }
            self.send_cursor += 1;
            self.high_sent = self.high_sent.max(self.send_cursor);
            self.high_sent_changed = true;
        }
        false
    }

    /// Encodes log entry `idx`; returns its stream payload length.
    fn encode_entry(&self, idx: usize, out: &mut Vec<u8>) -> u64 {
        let meta = |id: &u64| self.streams.get(id).map_or(&[][..], |s| s.meta.as_slice());
        match &self.log[idx] {
            Entry::Open(id) => Frame::Open {
                stream: *id,
                meta: meta(id),
            }
            .encode(out),
            Entry::Data {
                stream,
                offset,
                len,
                fin,
            } => {
                encode_data_header(out, *stream, *offset, *len as usize, *fin);
                if let Some(s) = self.streams.get(stream) {
                    s.copy_out(*offset, *len as usize, out);
                }
                return u64::from(*len);
            }
            Entry::Reset { stream, code } => Frame::Reset {
                stream: *stream,
                code: *code,
            }
            .encode(out),
            Entry::MaxStreamData { stream, max } => {
                Frame::MaxStreamData {
                    stream: *stream,
                    max: *max,
                }
                .encode(out);
            }
            Entry::MaxData(max) => Frame::MaxData { max: *max }.encode(out),
            Entry::MaxStreams(max) => Frame::MaxStreams { max: *max }.encode(out),
            Entry::Close { code, reason } => Frame::Close {
                code: *code,
                reason,
            }
            .encode(out),
            Entry::Addresses(addrs) => {
                let addrs = addrs.iter().map(|a| a.as_bytes()).collect();
                Frame::Addresses { addrs }.encode(out);
            }
            Entry::MoveTo(addr) => Frame::MoveTo {
                addr: addr.as_bytes(),
            }
            .encode(out),
            Entry::MoveAsk(host) => Frame::MoveAsk {
                host: host.as_bytes(),
            }
            .encode(out),
        }
        0
    }

    /// Turns buffered stream bytes into new `DATA` entries, round-robin, within
    /// the windows. Returns `true` if the record filled up.
    fn write_new_data(&mut self, out: &mut Vec<u8>, limit: usize) -> bool {
        while let Some(&id) = self.send_queue.front() {
            let room = limit.saturating_sub(out.len());
            if room < MIN_CHUNK_ROOM {
                return true;
            }
            let conn_credit = self.conn_send_max.saturating_sub(self.conn_sent);
            let Some(s) = self.streams.get_mut(&id) else {
                self.send_queue.pop_front();
                continue;
            };
            if !s.wants_send() {
                s.queued = false;
                self.send_queue.pop_front();
                continue;
            }
            let avail = s.written() - s.sent;
            let stream_credit = s.send_max.saturating_sub(s.sent);
            let max_payload = room - data_header_len(id, s.sent, room);
            let len = avail
                .min(stream_credit)
                .min(conn_credit)
                .min(max_payload as u64) as usize;
            let fin = s.fin_requested && s.sent + len as u64 == s.written();
            if len == 0 && !fin {
                if conn_credit == 0 && stream_credit > 0 {
                    return false; // the whole session waits for MAX_DATA
                }
                // This stream waits for MAX_STREAM_DATA; the others go on.
                s.queued = false;
                self.send_queue.pop_front();
                continue;
            }
            let offset = s.sent;
            encode_data_header(out, id, offset, len, fin);
            s.copy_out(offset, len, out);
            s.sent += len as u64;
            s.in_log += 1;
            if fin {
                s.fin_sent = true;
            }
            let again = s.wants_send();
            self.conn_sent += len as u64;
            self.stats.bytes_sent += len as u64;
            self.log.push_back(Entry::Data {
                stream: id,
                offset,
                len: len as u32,
                fin,
            });
            self.send_cursor += 1;
            self.high_sent = self.send_cursor.max(self.high_sent);
            self.high_sent_changed = true;
            self.send_queue.pop_front();
            if again {
                self.send_queue.push_back(id);
            } else if let Some(s) = self.streams.get_mut(&id) {
                s.queued = false;
            }
        }
        false
    }
}
