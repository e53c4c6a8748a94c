//! One transport of a session: its handshake phase, record keys and buffers,
//! and the input path from raw bytes to frames (§3, §4).

use std::net::SocketAddr;
use std::time::Instant;

use super::{Role, Session, State, SuspendReason};
use crate::config::ServerTrust;
use crate::event::{CloseReason, Event, TransportId};
use crate::frame::{for_each_frame, Frame};
use crate::handshake::{ClientNewSent, ClientResumeSent, Established, ServerNewSent};
use crate::record::next_record;
use crate::Error;

pub(super) enum Phase {
    // Boxed: Noise handshake states are large and short-lived.
    ClientNew(Box<ClientNewSent>),
    ClientResume(Box<ClientResumeSent>),
    ServerNew(Box<ServerNewSent>),
    Open(Box<Established>),
    /// Transient while a phase is being advanced.
    Taken,
}

pub(super) struct Transport {
    pub(super) id: TransportId,
    pub(super) peer: Option<SocketAddr>,
    pub(super) phase: Phase,
    /// Received bytes not yet consumed (records are decrypted in place here).
    pub(super) inbuf: Vec<u8>,
    /// Handshake bytes waiting for `poll_transmit`.
    pub(super) out: Vec<u8>,
    pub(super) started: Instant,
    pub(super) last_recv: Instant,
    pub(super) last_send: Instant,
    /// Records may be sent (keys ready and, on a server resume, the client's SYNC seen).
    pub(super) may_send: bool,
    pub(super) sync_sent: bool,
    pub(super) sync_received: bool,
    /// Server: `SESSION_INFO` still to send on this (first) transport.
    pub(super) info_due: bool,
    /// Server: a resume candidate that has not yet proven it is live.
    pub(super) pending_resume: bool,
    /// Server: a resume transport; emit `Resumed` once the client's SYNC arrives.
    pub(super) is_resume: bool,
    /// Flush `out` (and a final record if due), then report it closed.
    pub(super) retire: bool,
}

impl Transport {
    pub(super) fn new(
        id: TransportId,
        now: Instant,
        peer: Option<SocketAddr>,
        phase: Phase,
    ) -> Self {
        Self {
            id,
            peer,
            phase,
            inbuf: Vec::new(),
            out: Vec::new(),
            started: now,
            last_recv: now,
            last_send: now,
            may_send: false,
            sync_sent: false,
            sync_received: false,
            info_due: false,
            pending_resume: false,
            is_resume: false,
            retire: false,
        }
    }

    pub(super) fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open(_))
    }
}

impl Session {
    /// Bytes received on transport `id`. An `Err` means that transport is dead
    /// (the session suspends or, for fatal errors, closes; events say which);
    /// the caller closes it. Bytes for an unknown or retired transport are ignored.
    pub fn handle_input(
        &mut self,
        now: Instant,
        id: TransportId,
        data: &[u8],
    ) -> Result<(), Error> {
        self.input(now, id, |s, t| {
            t.inbuf.extend_from_slice(data);
            s.advance(now, t)
        })
    }

    /// As [`Session::handle_input`], for a caller whose buffer the session
    /// may overwrite: the records that lie whole in `data` are decrypted
    /// where they lie instead of being copied into the transport's input
    /// buffer first. Only the bytes that finish a record begun in an
    /// earlier call, and a record that `data` ends in the middle of, are
    /// buffered; so a transport whose records arrive whole keeps no input
    /// buffer at all, and a bulk transfer read in large chunks copies only
    /// the records that straddle two reads. Same results as
    /// `handle_input` for the same bytes, however they are split.
    pub fn handle_input_in_place(
        &mut self,
        now: Instant,
        id: TransportId,
        data: &mut [u8],
    ) -> Result<(), Error> {
        self.input(now, id, |s, t| s.advance_in_place(now, t, data))
    }

    /// The bookkeeping around one input of transport `id`: finds it, lets
    /// `feed` hand it the bytes, and files it back by the outcome.
    fn input(
        &mut self,
        now: Instant,
        id: TransportId,
        feed: impl FnOnce(&mut Self, &mut Transport) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let from_pending = self.pending.as_ref().is_some_and(|p| p.id == id);
        let slot = if from_pending {
            self.pending.take()
        } else if self.active.as_ref().is_some_and(|a| a.id == id) {
            self.active.take()
        } else {
            None
        };
        let Some(mut t) = slot else { return Ok(()) };
        if t.retire {
            self.active = Some(t);
            return Ok(());
        }
        let was_pending = t.pending_resume;
        t.last_recv = now;
        let result = feed(self, &mut t);
        if result.is_ok() && self.state == State::Closed && !t.retire {
            // The session ended while this transport was detached (CLOSE sent
            // or received): flush a last ACK, then report it closed.
            t.retire = true;
            t.pending_resume = false;
        }
        match result {
            Ok(()) => {
                if was_pending && !t.pending_resume {
                    // The client proved it is live: this transport takes over.
                    if let Some(old) = self.active.take() {
                        self.events.push_back(Event::TransportClosed {
                            transport: old.id,
                            error: None,
                        });
                    }
                    self.active = Some(t);
                } else if t.pending_resume {
                    self.pending = Some(t);
                } else {
                    self.active = Some(t);
                }
                Ok(())
            }
            Err(e) => {
                self.fail_transport(now, t, was_pending, e.clone());
                Err(e)
            }
        }
    }

    fn fail_transport(&mut self, now: Instant, t: Box<Transport>, was_pending: bool, e: Error) {
        if let (Error::Moved(addr), Role::Client, Some(_)) = (&e, self.role, self.secret) {
            // A `Moved` refusal (§9.3): the session lives at `addr` now.
            self.events
                .push_back(Event::MoveRequested { addr: addr.clone() });
        }
        let fatal = self.is_fatal(&e, &t) && !self.within_refusal_grace(now, &e);
        if fatal {
            if let Some(old) = self.active.replace(t) {
                self.events.push_back(Event::TransportClosed {
                    transport: old.id,
                    error: None,
                });
            }
            self.finish(CloseReason::Error(e));
        } else if was_pending {
            self.events.push_back(Event::TransportClosed {
                transport: t.id,
                error: Some(e),
            });
        } else {
            self.active = Some(t);
            self.lose_active(now, SuspendReason::TransportError(e));
        }
    }

    /// Errors that end the session, not just the transport (§10.2).
    fn is_fatal(&self, e: &Error, t: &Transport) -> bool {
        if self.role == Role::Client && self.secret.is_none() {
            return true; // first connect: nothing to preserve
        }
        match e {
            Error::ServerKeyMismatch { .. }
            | Error::Unauthorized
            | Error::UnknownSession
            | Error::ResumeRejected
            | Error::Expired => self.role == Role::Client,
            // Violations inside authenticated records come from the peer itself.
            Error::ProtocolViolation(_) | Error::FlowControl | Error::Decode(_) => {
                t.is_open() && !t.pending_resume
            }
            _ => false,
        }
    }

    /// Client: a cleartext resume refusal that arrived within
    /// `Config::refusal_grace` of the first in its run costs a retry, not the
    /// session (§12: refusals are unauthenticated, so they may be forged).
    fn within_refusal_grace(&mut self, now: Instant, e: &Error) -> bool {
        if self.role != Role::Client
            || self.secret.is_none()
            || !matches!(e, Error::UnknownSession | Error::ResumeRejected)
        {
            return false;
        }
        let since = *self.refused_since.get_or_insert(now);
        now.saturating_duration_since(since) < self.config.refusal_grace()
    }

    /// Bytes of input buffer allocated for this session's transports: room
    /// kept for records that arrived in pieces. 0 while every record came
    /// whole through [`Session::handle_input_in_place`] (the handshake's
    /// buffer is given back once the transport is open).
    pub fn input_buffer_capacity(&self) -> usize {
        [&self.active, &self.pending]
            .into_iter()
            .flatten()
            .map(|t| t.inbuf.capacity())
            .sum()
    }

    fn advance(&mut self, now: Instant, t: &mut Transport) -> Result<(), Error> {
        let was_open = t.is_open();
        let mut pos = 0;
        loop {
            match std::mem::replace(&mut t.phase, Phase::Taken) {
                Phase::ClientNew(hs) => {
                    let params = self.config.params();
                    match hs.read_reply(&t.inbuf[pos..], &params, &mut t.out)? {
                        Err(hs) => {
                            t.phase = Phase::ClientNew(Box::new(hs));
                            break;
                        }
                        Ok(done) => {
                            pos += done.consumed;
                            // The new session is made: what set it up goes.
                            let setup = self.setup.take();
                            if let Some(ServerTrust::Pinned(expected)) =
                                setup.as_ref().and_then(|setup| setup.trust.as_ref())
                            {
                                if *expected != done.server_key {
                                    return Err(Error::ServerKeyMismatch {
                                        expected: *expected,
                                        actual: done.server_key,
                                    });
                                }
                            }
                            self.peer_key = Some(done.server_key);
                            self.set_peer_params(done.server_params);
                            t.phase = Phase::Open(Box::new(done.keys));
                            t.may_send = true;
                            self.peer_addr = t.peer;
                        }
                    }
                }
                Phase::ClientResume(hs) => match hs.read_reply(&t.inbuf[pos..])? {
                    Err(hs) => {
                        t.phase = Phase::ClientResume(Box::new(hs));
                        break;
                    }
                    Ok((keys, server_received, used)) => {
                        pos += used;
                        t.phase = Phase::Open(Box::new(keys));
                        t.may_send = true;
                        self.on_ack(server_received, true)?;
                        self.send_cursor = server_received;
                        self.emit_resumed(now, t.peer);
                    }
                },
                Phase::ServerNew(hs) => match hs.read_msg3(&t.inbuf[pos..])? {
                    Err(hs) => {
                        t.phase = Phase::ServerNew(Box::new(hs));
                        break;
                    }
                    Ok((keys, client_key, params, used)) => {
                        pos += used;
                        t.phase = Phase::Open(Box::new(keys));
                        self.peer_key = Some(client_key);
                        self.set_peer_params(params);
                        // The new session is made: what set it up goes.
                        let setup = self.setup.take();
                        let allowed = setup
                            .as_ref()
                            .and_then(|setup| setup.authorized.as_ref())
                            .is_none_or(|keys| keys.contains(&client_key));
                        t.may_send = true;
                        if !allowed {
                            self.refuse_unauthorized(t)?;
                            return Ok(());
                        }
                        t.info_due = true;
                        self.state = State::Active;
                        if let Some(addrs) = setup
                            .map(|setup| setup.announce)
                            .filter(|addrs| !addrs.is_empty())
                        {
                            self.set_addresses(addrs);
                        }
                        if let (Some(session_id), Some(peer_key)) = (self.id, self.peer_key) {
                            self.events.push_back(Event::Connected {
                                session_id,
                                peer_key,
                            });
                        }
                    }
                },
                Phase::Open(mut keys) => {
                    let r = self.read_records(now, t, &mut keys, &mut pos);
                    t.phase = Phase::Open(keys);
                    r?;
                    break;
                }
                Phase::Taken => return Err(Error::ProtocolViolation("transport in invalid phase")),
            }
        }
        t.inbuf.drain(..pos);
        if !was_open && t.is_open() && t.inbuf.is_empty() {
            // The handshake's bytes are done with: records that come whole
            // need no buffer (`handle_input_in_place`).
            t.inbuf = Vec::new();
        }
        Ok(())
    }

    /// [`Session::handle_input_in_place`]'s input: once the transport is
    /// open and holds no partial record, the whole records of `data` are
    /// opened in `data`; anything else goes through the input buffer.
    fn advance_in_place(
        &mut self,
        now: Instant,
        t: &mut Transport,
        mut data: &mut [u8],
    ) -> Result<(), Error> {
        loop {
            if !t.is_open() || self.state == State::Closed {
                // The handshake (or what follows a close): the usual way.
                t.inbuf.extend_from_slice(data);
                return self.advance(now, t);
            }
            if t.inbuf.is_empty() {
                break;
            }
            // A record begun in an earlier read: give it only what it
            // lacks (its length first, if even that is cut), then open it.
            let missing = match next_record(&t.inbuf, 0) {
                Some(_) => 0,
                None if t.inbuf.len() < 2 => 2 - t.inbuf.len(),
                None => {
                    2 + usize::from(u16::from_be_bytes([t.inbuf[0], t.inbuf[1]])) - t.inbuf.len()
                }
            };
            if missing == 0 {
                // Not expected (whole records are opened as they come),
                // but if one is waiting, keep the order: buffer everything.
                t.inbuf.extend_from_slice(data);
                return self.advance(now, t);
            }
            let take = missing.min(data.len());
            let (head, rest) = std::mem::take(&mut data).split_at_mut(take);
            t.inbuf.extend_from_slice(head);
            data = rest;
            self.advance(now, t)?;
            if data.is_empty() {
                return Ok(());
            }
        }
        let phase = std::mem::replace(&mut t.phase, Phase::Taken);
        let Phase::Open(mut keys) = phase else {
            t.phase = phase;
            t.inbuf.extend_from_slice(data);
            return self.advance(now, t);
        };
        let mut pos = 0;
        let r = self.open_records(now, t, &mut keys, data, &mut pos);
        t.phase = Phase::Open(keys);
        r?;
        // The record `data` ends inside of (or, after a close, the rest).
        t.inbuf.extend_from_slice(&data[pos..]);
        Ok(())
    }

    fn read_records(
        &mut self,
        now: Instant,
        t: &mut Transport,
        keys: &mut Established,
        pos: &mut usize,
    ) -> Result<(), Error> {
        let mut inbuf = std::mem::take(&mut t.inbuf);
        let result = self.open_records(now, t, keys, &mut inbuf, pos);
        t.inbuf = inbuf;
        result
    }

    /// Opens the whole records of `buf` from `*pos` on, in place, and
    /// applies their frames; `*pos` ends after the last one opened.
    fn open_records(
        &mut self,
        now: Instant,
        t: &mut Transport,
        keys: &mut Established,
        inbuf: &mut [u8],
        pos: &mut usize,
    ) -> Result<(), Error> {
        let mut result = Ok(());
        while let Some((b, e)) = next_record(inbuf, *pos) {
            let n = match keys.rx.open(&mut inbuf[b..e]) {
                Ok(n) => n,
                Err(err) => {
                    result = Err(err);
                    break;
                }
            };
            *pos = e;
            let r = for_each_frame(&inbuf[b..b + n], |f| self.on_frame(now, t, f));
            if let Err(err) = r {
                result = Err(err);
                break;
            }
            if self.state == State::Closed {
                break;
            }
        }
        result
    }

    /// Server: the client key is not authorized. Send one `CLOSE` and end.
    fn refuse_unauthorized(&mut self, t: &mut Transport) -> Result<(), Error> {
        if let Phase::Open(keys) = &mut t.phase {
            let start = crate::record::RecordCipher::begin(&mut t.out);
            Frame::Close {
                code: crate::error::code::UNAUTHORIZED,
                reason: b"client key not authorized",
            }
            .encode(&mut t.out);
            keys.tx.seal(&mut t.out, start)?;
        }
        // Keep the transport (it still has the CLOSE to flush) but end the session.
        t.may_send = false;
        t.retire = true;
        self.finish(CloseReason::Error(Error::Unauthorized));
        Ok(())
    }

    pub(super) fn emit_resumed(&mut self, now: Instant, peer: Option<std::net::SocketAddr>) {
        if self.state == State::Closed {
            // The resume's acknowledgement completed our CLOSE (found by
            // fuzzing): nothing but `TransportClosed` follows `Closed`.
            return;
        }
        let since = self.suspended_since.take().unwrap_or(now);
        self.refused_since = None;
        if self.state == State::Suspended {
            self.state = State::Active;
        }
        // What will be replayed: entries between the peer's position and our high-water mark.
        let (mut frames, mut bytes) = (0u64, 0u64);
        let from = self.send_cursor.saturating_sub(self.log_base) as usize;
        let to = self.high_sent.saturating_sub(self.log_base) as usize;
        for e in self
            .log
            .range(from.min(self.log.len())..to.min(self.log.len()))
        {
            frames += 1;
            if let super::Entry::Data { len, .. } = e {
                bytes += u64::from(*len);
            }
        }
        self.stats.resumes += 1;
        self.events.push_back(Event::Resumed {
            suspended_for: now.saturating_duration_since(since),
            frames_replayed: frames,
            bytes_replayed: bytes,
        });
        if peer != self.peer_addr {
            self.events.push_back(Event::PeerAddressChanged {
                from: self.peer_addr,
                to: peer,
            });
            self.peer_addr = peer;
        }
    }
}
