//! Applying received frames (§5-§10): acknowledgements, the SYNC that starts
//! each transport, duplicate suppression by sequence, and stream frames.

use std::time::Instant;

use super::transport::Transport;
use super::{Entry, Role, Session, State};
use crate::event::{CloseReason, Event};
use crate::frame::Frame;
use crate::stream::{Stream, StreamId};
use crate::Error;

/// Bytes of received stream data after which an `ACK` is sent without delay.
const ACK_EAGER_BYTES: u64 = 128 * 1024;

impl Session {
    pub(super) fn on_frame(
        &mut self,
        now: Instant,
        t: &mut Transport,
        f: Frame<'_>,
    ) -> Result<(), Error> {
        if self.state == State::Closed {
            return Ok(()); // frames after a CLOSE in the same record
        }
        match f {
            Frame::Ping { token } => self.pong_due = Some(token),
            Frame::Pong { token } => {
                if let Some((tok, at)) = self.ping_outstanding {
                    if tok == token {
                        self.stats.rtt = Some(now.saturating_duration_since(at));
                        self.ping_outstanding = None;
                    }
                }
            }
            Frame::Ack { received } => {
                if !t.sync_received {
                    return Err(Error::ProtocolViolation("ACK before SYNC"));
                }
                self.on_ack(received, false)?;
            }
            Frame::Sync { received, next } => {
                if t.sync_received {
                    return Err(Error::ProtocolViolation("second SYNC on a transport"));
                }
                if next > self.recv_seq {
                    return Err(Error::ProtocolViolation("SYNC skips reliable frames"));
                }
                // Checked before anything changes: a stale resume (a client
                // restored from an old copy of its continuation, which lost
                // frames the session already acknowledged) is refused on its
                // own transport and leaves the session as it was.
                self.on_ack(received, true)?;
                t.sync_received = true;
                // The resume proved itself: its transport takes over (§7.3).
                t.pending_resume = false;
                self.in_cursor = next;
                if self.role == Role::Server && t.is_resume {
                    // Retransmit from where the client stands (§7.3).
                    self.send_cursor = received;
                    t.may_send = true;
                    self.emit_resumed(now, t.peer);
                }
            }
            Frame::SessionInfo {
                session_id,
                resume_secret,
                resume_timeout_secs,
            } => {
                if self.role != Role::Client || self.secret.is_some() {
                    return Err(Error::ProtocolViolation("unexpected SESSION_INFO"));
                }
                self.id = Some(crate::keys::SessionId(session_id));
                self.secret = Some(resume_secret);
                let server_timeout = std::time::Duration::from_secs(resume_timeout_secs);
                self.resume_timeout = self.resume_timeout.min(server_timeout);
                if self.state == State::Handshaking {
                    self.state = State::Active;
                }
                if let Some(peer_key) = self.peer_key {
                    self.events.push_back(Event::Connected {
                        session_id: crate::keys::SessionId(session_id),
                        peer_key,
                    });
                }
            }
            Frame::Close { .. } if !t.sync_received && self.role == Role::Server && t.is_resume => {
                // A resuming client that gives up before its SYNC (it found
                // its own state behind the session's: a stale copy of a
                // continuation) speaks for that copy only; the session may
                // be live on another transport. Refuse the transport.
                return Err(Error::ProtocolViolation("CLOSE before SYNC on a resume"));
            }
            Frame::Close { code, reason } if !t.sync_received => {
                // A refusal before the session started (e.g. unauthorized client key).
                let reason = match code {
                    crate::error::code::UNAUTHORIZED => CloseReason::Error(Error::Unauthorized),
                    _ => CloseReason::Peer {
                        code,
                        reason: String::from_utf8_lossy(reason).into_owned(),
                    },
                };
                self.finish(reason);
            }
            reliable => {
                if !t.sync_received {
                    return Err(Error::ProtocolViolation("reliable frame before SYNC"));
                }
                let seq = self.in_cursor;
                self.in_cursor += 1;
                if seq < self.recv_seq && !matches!(reliable, Frame::Close { .. }) {
                    return Ok(()); // already applied before a resume
                }
                self.recv_seq += 1;
                if self.ack_deadline.is_none() {
                    self.ack_deadline = Some(now + self.config.ack_delay());
                }
                self.apply(reliable)?;
            }
        }
        Ok(())
    }

    /// The peer holds our reliable frames below `received`: drop them from the log.
    pub(super) fn on_ack(&mut self, received: u64, resync: bool) -> Result<(), Error> {
        if received > self.high_sent {
            return Err(Error::ProtocolViolation("acknowledges frames never sent"));
        }
        if received < self.log_base {
            if resync {
                return Err(Error::ProtocolViolation("peer lost acknowledged frames"));
            }
            return Ok(()); // stale
        }
        // Writers are looked at once per acknowledgement, not once per
        // acknowledged frame: with 1,000 blocked streams a walk of the
        // waiters per DATA frame took 18 % of a relay's CPU.
        let mut freed = false;
        while self.log_base < received {
            let Some(e) = self.log.pop_front() else { break };
            self.log_base += 1;
            freed |= self.on_acked(e);
        }
        // An acknowledged `CLOSE` in the same ACK may have ended the
        // session: nothing but `TransportClosed` follows `Closed`.
        if freed && self.state != State::Closed {
            self.wake_writers();
        }
        self.send_cursor = self.send_cursor.max(self.log_base);
        self.high_sent = self.high_sent.max(self.log_base);
        Ok(())
    }

    /// Drops an acknowledged entry; returns whether send-buffer room was freed.
    fn on_acked(&mut self, e: Entry) -> bool {
        let stream = e.stream();
        match e {
            Entry::Data {
                stream,
                offset,
                len,
                fin,
            } => {
                let mut freed = false;
                if let Some(s) = self.streams.get_mut(&stream) {
                    let before = s.send_buf.len();
                    s.ack_to(offset + u64::from(len));
                    freed = before > s.send_buf.len();
                    self.send_buffered -= (before - s.send_buf.len()) as u64;
                    if s.send_buf.is_empty() && std::mem::take(&mut s.contending) {
                        self.contenders = self.contenders.saturating_sub(1);
                    }
                    if fin && s.reset.is_none() {
                        s.fin_acked = true;
                        self.events.push_back(Event::StreamSendComplete {
                            stream: StreamId(stream),
                        });
                    }
                }
                self.entry_done(stream);
                return freed;
            }
            Entry::Close { code, .. } if self.state == State::Closing => {
                self.mark_closing_done(code)
            }
            _ => {}
        }
        if let Some(id) = stream {
            self.entry_done(id);
        }
        false
    }

    /// One fewer log entry names stream `id`; forgets the stream if done.
    fn entry_done(&mut self, id: u64) {
        if let Some(s) = self.streams.get_mut(&id) {
            s.in_log = s.in_log.saturating_sub(1);
        }
        self.maybe_forget(id);
    }

    fn apply(&mut self, f: Frame<'_>) -> Result<(), Error> {
        match f {
            Frame::Open { stream, meta } => {
                if self.is_local_stream(stream) || stream < self.next_peer_stream {
                    return Err(Error::ProtocolViolation(
                        "OPEN with a stream id out of sequence",
                    ));
                }
                if self.peer_streams_opened >= self.peer_stream_limit {
                    return Err(Error::ProtocolViolation("peer exceeded its stream limit"));
                }
                self.next_peer_stream = stream + 2;
                self.peer_streams_opened += 1;
                let p = self.peer_params_or_default();
                self.streams.insert(
                    stream,
                    Box::new(Stream::new(
                        meta.to_vec(),
                        p.stream_window,
                        self.config.stream_window,
                    )),
                );
                self.events.push_back(Event::StreamOpened {
                    stream: StreamId(stream),
                });
            }
            Frame::Data {
                stream,
                offset,
                fin,
                data,
            } => self.on_data(stream, offset, fin, data)?,
            Frame::Reset { stream, code } => {
                self.check_known(stream)?;
                let Some(s) = self.streams.get_mut(&stream) else {
                    return Ok(());
                };
                if s.reset.is_some() {
                    return Ok(());
                }
                s.reset = Some(code);
                let unsent = s.written() - s.sent;
                let keep = (s.sent - s.send_base) as usize;
                s.send_buf.truncate(keep);
                let released = s.recv_buf.len() as u64;
                s.recv_buf = Default::default();
                self.send_buffered -= unsent;
                self.stop_contending(stream);
                self.consume(released);
                self.events.push_back(Event::StreamReset {
                    stream: StreamId(stream),
                    code,
                });
                self.maybe_forget(stream);
            }
            Frame::MaxStreamData { stream, max } => {
                self.check_known(stream)?;
                if let Some(s) = self.streams.get_mut(&stream) {
                    s.send_max = s.send_max.max(max);
                }
                self.enqueue(stream);
            }
            Frame::MaxData { max } => self.conn_send_max = self.conn_send_max.max(max),
            Frame::MaxStreams { max } => self.local_stream_limit = self.local_stream_limit.max(max),
            Frame::Close { code, reason } => {
                let reason = String::from_utf8_lossy(reason).into_owned();
                self.finish(CloseReason::Peer { code, reason });
            }
            Frame::Addresses { .. } | Frame::MoveTo { .. } if self.role == Role::Server => {
                return Err(Error::ProtocolViolation(
                    "ADDRESSES/MOVE_TO sent by a client",
                ));
            }
            Frame::Addresses { addrs } => {
                let addrs = addrs
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                self.events.push_back(Event::AddressesUpdated { addrs });
            }
            Frame::MoveTo { addr } => {
                let addr = String::from_utf8_lossy(addr).into_owned();
                self.events.push_back(Event::MoveRequested { addr });
            }
            Frame::MoveAsk { .. } if self.role == Role::Client => {
                return Err(Error::ProtocolViolation("MOVE_ASK sent by a server"));
            }
            Frame::MoveAsk { host } => {
                let host = String::from_utf8_lossy(host).into_owned();
                self.events.push_back(Event::MoveAsked { host });
            }
            Frame::Ping { .. }
            | Frame::Pong { .. }
            | Frame::Ack { .. }
            | Frame::Sync { .. }
            | Frame::SessionInfo { .. } => {}
        }
        Ok(())
    }

    /// Frames may name streams that were closed and forgotten, never ones not yet opened.
    fn check_known(&self, stream: u64) -> Result<(), Error> {
        let next = if self.is_local_stream(stream) {
            self.next_local_stream
        } else {
            self.next_peer_stream
        };
        if stream >= next {
            return Err(Error::ProtocolViolation("frame for a stream never opened"));
        }
        Ok(())
    }

    fn on_data(&mut self, stream: u64, offset: u64, fin: bool, data: &[u8]) -> Result<(), Error> {
        self.check_known(stream)?;
        let len = data.len() as u64;
        if self.conn_received + len > self.conn_recv_max {
            return Err(Error::FlowControl);
        }
        self.conn_received += len;
        let Some(s) = self.streams.get_mut(&stream) else {
            self.consume(len); // stream already gone: drop, but keep session credit flowing
            return Ok(());
        };
        if s.reset.is_some() {
            self.consume(len);
            return Ok(());
        }
        if offset != s.received || s.fin_received {
            return Err(Error::ProtocolViolation("stream data out of order"));
        }
        if offset + len > s.recv_max {
            return Err(Error::FlowControl);
        }
        let was_empty = s.recv_buf.is_empty();
        s.recv_buf.extend(data);
        s.received += len;
        self.stats.bytes_received += len;
        self.unacked_bytes += len;
        if self.unacked_bytes >= ACK_EAGER_BYTES {
            self.ack_now = true;
        }
        if fin {
            s.fin_received = true;
        }
        if (was_empty && len > 0) || fin {
            self.events.push_back(Event::StreamReadable {
                stream: StreamId(stream),
            });
        }
        if fin {
            self.events.push_back(Event::StreamFinished {
                stream: StreamId(stream),
            });
        }
        Ok(())
    }
}
