//! Session continuations: the complete protocol state of a session as bytes.
//!
//! Spec: `docs/PROTOCOL.md` §13. A server (or client) can let go of a
//! suspended session entirely — no socket, no task, no buffers — by exporting
//! it, and later, in the same process or a new one, restore it and accept the
//! peer's resume as if nothing happened. The export holds the resume secret, so
//! it must be stored where only its owner can read it.
//!
//! Format: `"RMSC"`, a format version byte, the body (varints and
//! length-prefixed bytes, field order as written below), then the SHA-256 of
//! everything before it. A truncated, corrupted or foreign blob fails with a
//! precise [`RestoreError`] and never yields a session.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{Entry, Role, Session, State};
use crate::codec::{put_lp_bytes, put_varint, DecodeError, Reader};
use crate::config::{ClientConfig, ServerConfig};
use crate::handshake::Params;
use crate::keys::{PublicKey, SessionId};
use crate::stream::Stream;

const MAGIC: [u8; 4] = *b"RMSC";
const FORMAT: u8 = 1;
const DIGEST_LEN: usize = 32;

/// Why a continuation could not be exported.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExportError {
    /// The session has not finished its first handshake: there is nothing to resume.
    NotEstablished,
    /// The session is closed.
    Closed,
}

impl fmt::Display for ExportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotEstablished => write!(f, "session not established yet; nothing to export"),
            Self::Closed => write!(f, "session is closed; nothing to export"),
        }
    }
}

impl std::error::Error for ExportError {}

/// Why a continuation could not be restored. The blob must be discarded (or
/// kept for inspection); no session state was created from it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RestoreError {
    /// Not a roam continuation (wrong magic).
    NotAContinuation,
    /// Written by an incompatible version of roam.
    UnsupportedFormat(u8),
    /// The checksum does not match: the blob was truncated or corrupted.
    Corrupted,
    /// The blob is internally inconsistent; the text names the field.
    Invalid(&'static str),
    /// A server continuation given to a client restore, or the reverse.
    WrongRole,
    /// It already expired while stored.
    Expired,
}

impl fmt::Display for RestoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAContinuation => write!(f, "not a roam session continuation"),
            Self::UnsupportedFormat(v) => {
                write!(f, "continuation format {v} is not supported by this roam")
            }
            Self::Corrupted => write!(
                f,
                "continuation is truncated or corrupted (checksum mismatch)"
            ),
            Self::Invalid(what) => write!(f, "continuation is inconsistent: {what}"),
            Self::WrongRole => write!(f, "continuation belongs to the other role (client/server)"),
            Self::Expired => write!(f, "continuation expired while stored"),
        }
    }
}

impl std::error::Error for RestoreError {}

impl From<DecodeError> for RestoreError {
    fn from(_: DecodeError) -> Self {
        RestoreError::Invalid("field encoding")
    }
}

fn put_bool_flags(out: &mut Vec<u8>, flags: &[bool]) {
    let mut b = 0u8;
    for (i, f) in flags.iter().enumerate() {
        b |= u8::from(*f) << i;
    }
    out.push(b);
}

fn put_deque(out: &mut Vec<u8>, d: &VecDeque<u8>) {
    let (a, b) = d.as_slices();
    put_varint(out, (a.len() + b.len()) as u64);
    out.extend_from_slice(a);
    out.extend_from_slice(b);
}

impl Session {
    /// Exports the session's complete protocol state — keys, stream offsets,
    /// unacknowledged and unread data — as a self-checking blob (§13). The
    /// session itself is left as it was; drop it to release everything it holds.
    /// An active transport is not part of the export: the restored session
    /// starts suspended and waits for (server) or makes (client) a resume.
    pub fn export(&self, now: Instant) -> Result<Vec<u8>, ExportError> {
        match self.state {
            State::Handshaking => return Err(ExportError::NotEstablished),
            State::Closed => return Err(ExportError::Closed),
            _ => {}
        }
        let (Some(id), Some(secret), Some(peer_key), Some(p)) =
            (self.id, self.secret, self.peer_key, self.peer_params)
        else {
            return Err(ExportError::NotEstablished);
        };
        let mut o = Vec::with_capacity(256 + self.send_buffered as usize);
        o.extend_from_slice(&MAGIC);
        o.push(FORMAT);
        o.push(match self.role {
            Role::Client => 0,
            Role::Server => 1,
        });
        o.push(u8::from(self.state == State::Closing));
        o.extend_from_slice(&id.0);
        o.extend_from_slice(&secret);
        o.extend_from_slice(&peer_key.0);
        for v in [p.stream_window, p.session_window, p.max_streams] {
            put_varint(&mut o, v);
        }
        put_varint(&mut o, self.resume_timeout.as_millis() as u64);
        let suspended_for = self
            .suspended_since
            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s));
        put_varint(&mut o, suspended_for.as_millis() as u64);
        put_varint(&mut o, self.replay_memory.len() as u64);
        for e in &self.replay_memory {
            o.extend_from_slice(e);
        }
        for v in [
            self.log_base,
            self.high_sent,
            self.recv_seq,
            self.next_local_stream,
            self.next_peer_stream,
            self.local_streams_opened,
            self.local_stream_limit,
            self.peer_streams_opened,
            self.peer_streams_forgotten,
            self.peer_stream_limit,
            self.conn_send_max,
            self.conn_sent,
            self.conn_recv_max,
            self.conn_received,
            self.conn_consumed,
            self.stats.bytes_sent,
            self.stats.bytes_received,
            self.stats.bytes_replayed,
            self.stats.frames_replayed,
            self.stats.transports,
            self.stats.resumes,
        ] {
            put_varint(&mut o, v);
        }
        match &self.close_requested {
            Some((code, reason)) => {
                o.push(1);
                put_varint(&mut o, *code);
                put_lp_bytes(&mut o, reason);
            }
            None => o.push(0),
        }
        put_varint(&mut o, self.log.len() as u64);
        for e in &self.log {
            encode_entry(&mut o, e);
        }
        put_varint(&mut o, self.streams.len() as u64);
        for (id, s) in &self.streams {
            put_varint(&mut o, *id);
            put_lp_bytes(&mut o, &s.meta);
            put_varint(&mut o, s.send_base);
            put_deque(&mut o, &s.send_buf);
            for v in [
                s.sent,
                s.send_max,
                u64::from(s.in_log),
                s.received,
                s.recv_max,
                s.reset.unwrap_or(0),
            ] {
                put_varint(&mut o, v);
            }
            put_deque(&mut o, &s.recv_buf);
            put_bool_flags(
                &mut o,
                &[
                    s.fin_requested,
                    s.fin_sent,
                    s.fin_acked,
                    s.write_blocked,
                    s.fin_received,
                    s.eof_delivered,
                    s.reset.is_some(),
                    s.reset_seen,
                ],
            );
        }
        let digest = Sha256::digest(&o);
        o.extend_from_slice(&digest);
        Ok(o)
    }

    /// Restores a server session exported by [`Session::export`]. `offline` is
    /// how long the blob sat in storage (from wall-clock times the caller
    /// recorded); it counts towards the resume timeout. The session starts
    /// suspended; route the client's resume to it with `accept_resume`.
    pub fn restore_server(
        config: &ServerConfig,
        now: Instant,
        blob: &[u8],
        offline: Duration,
    ) -> Result<Self, RestoreError> {
        let mut s = Self::new(Role::Server, config.session.clone());
        s.authorized = config.authorized_keys.clone();
        s.announce = config.addresses.clone();
        s.restore_into(Role::Server, now, blob, offline)?;
        Ok(s)
    }

    /// Restores a client session exported by [`Session::export`]; then call
    /// `connect` to resume it.
    pub fn restore_client(
        config: ClientConfig,
        now: Instant,
        blob: &[u8],
        offline: Duration,
    ) -> Result<Self, RestoreError> {
        let mut s = Self::client(config);
        s.restore_into(Role::Client, now, blob, offline)?;
        Ok(s)
    }

    fn restore_into(
        &mut self,
        role: Role,
        now: Instant,
        blob: &[u8],
        offline: Duration,
    ) -> Result<(), RestoreError> {
        if blob.len() < MAGIC.len() || blob[..4] != MAGIC {
            return Err(RestoreError::NotAContinuation);
        }
        if blob.len() < 5 + DIGEST_LEN {
            return Err(RestoreError::Corrupted);
        }
        if blob[4] != FORMAT {
            return Err(RestoreError::UnsupportedFormat(blob[4]));
        }
        let (body, digest) = blob.split_at(blob.len() - DIGEST_LEN);
        if Sha256::digest(body).as_slice() != digest {
            return Err(RestoreError::Corrupted);
        }
        let mut r = Reader::new(&body[5..]);
        let blob_role = match r.u8()? {
            0 => Role::Client,
            1 => Role::Server,
            _ => return Err(RestoreError::Invalid("role")),
        };
        if blob_role != role {
            return Err(RestoreError::WrongRole);
        }
        let closing = r.u8()? == 1;
        self.id = Some(SessionId(r.array()?));
        self.secret = Some(r.array()?);
        self.peer_key = Some(PublicKey(r.array()?));
        self.peer_params = Some(Params {
            stream_window: r.varint()?,
            session_window: r.varint()?,
            max_streams: r.varint()?,
        });
        self.resume_timeout = Duration::from_millis(r.varint()?).min(self.resume_timeout);
        let suspended_for = Duration::from_millis(r.varint()?) + offline;
        if suspended_for >= self.resume_timeout {
            return Err(RestoreError::Expired);
        }
        self.suspended_since = Some(now.checked_sub(suspended_for).unwrap_or(now));
        let n = r.varint_usize(super::REPLAY_MEMORY, "replay memory")?;
        for _ in 0..n {
            self.replay_memory.push_back(r.array()?);
        }
        let mut v = [0u64; 21];
        for x in &mut v {
            *x = r.varint()?;
        }
        [
            self.log_base,
            self.high_sent,
            self.recv_seq,
            self.next_local_stream,
            self.next_peer_stream,
            self.local_streams_opened,
            self.local_stream_limit,
            self.peer_streams_opened,
            self.peer_streams_forgotten,
            self.peer_stream_limit,
            self.conn_send_max,
            self.conn_sent,
            self.conn_recv_max,
            self.conn_received,
            self.conn_consumed,
            self.stats.bytes_sent,
            self.stats.bytes_received,
            self.stats.bytes_replayed,
            self.stats.frames_replayed,
            self.stats.transports,
            self.stats.resumes,
        ] = v;
        self.close_requested = match r.u8()? {
            0 => None,
            1 => Some((
                r.varint()?,
                r.lp_bytes(crate::frame::MAX_TEXT_LEN, "close reason")?
                    .to_vec(),
            )),
            _ => return Err(RestoreError::Invalid("close flag")),
        };
        let entries = r.varint_usize(r.remaining(), "log length")?;
        for _ in 0..entries {
            self.log.push_back(decode_entry(&mut r)?);
        }
        if self.high_sent < self.log_base || self.high_sent > self.log_base + self.log.len() as u64
        {
            return Err(RestoreError::Invalid("log positions"));
        }
        self.send_cursor = self.log_base;
        let streams = r.varint_usize(r.remaining(), "stream count")?;
        for _ in 0..streams {
            let id = r.varint()?;
            let meta = r
                .lp_bytes(crate::frame::MAX_META_LEN, "stream metadata")?
                .to_vec();
            let mut s = Stream::new(meta, 0, 0);
            s.send_base = r.varint()?;
            s.send_buf = r
                .lp_bytes(r.remaining(), "send buffer")?
                .iter()
                .copied()
                .collect();
            let mut f = [0u64; 6];
            for x in &mut f {
                *x = r.varint()?;
            }
            let reset_code;
            [s.sent, s.send_max, _, s.received, s.recv_max, reset_code] = f;
            s.in_log =
                u32::try_from(f[2]).map_err(|_| RestoreError::Invalid("stream log count"))?;
            s.recv_buf = r
                .lp_bytes(r.remaining(), "receive buffer")?
                .iter()
                .copied()
                .collect();
            let flags = r.u8()?;
            let bit = |i: u8| flags & (1 << i) != 0;
            s.fin_requested = bit(0);
            s.fin_sent = bit(1);
            s.fin_acked = bit(2);
            s.write_blocked = bit(3);
            s.fin_received = bit(4);
            s.eof_delivered = bit(5);
            s.reset = bit(6).then_some(reset_code);
            s.reset_seen = bit(7);
            if s.sent < s.send_base || s.sent > s.written() {
                return Err(RestoreError::Invalid("stream send offsets"));
            }
            self.send_buffered += s.send_buf.len() as u64;
            if s.write_blocked {
                self.write_waiters.push(id);
            }
            self.streams.insert(id, Box::new(s));
        }
        r.finish()
            .map_err(|_| RestoreError::Invalid("trailing bytes"))?;
        // Every log entry must point at state we hold.
        for e in &self.log {
            if let Entry::Data {
                stream,
                offset,
                len,
                ..
            } = e
            {
                let ok = self.streams.get(stream).is_some_and(|s| {
                    *offset >= s.send_base && offset + u64::from(*len) <= s.written()
                });
                if !ok {
                    return Err(RestoreError::Invalid(
                        "log entry refers to missing stream data",
                    ));
                }
            }
        }
        let ids: Vec<u64> = self.streams.keys().copied().collect();
        for id in ids {
            self.enqueue(id);
        }
        self.state = if closing {
            State::Closing
        } else {
            State::Suspended
        };
        Ok(())
    }
}

fn encode_entry(o: &mut Vec<u8>, e: &Entry) {
    match e {
        Entry::Open(id) => {
            o.push(0);
            put_varint(o, *id);
        }
        Entry::Data {
            stream,
            offset,
            len,
            fin,
        } => {
            o.push(if *fin { 2 } else { 1 });
            put_varint(o, *stream);
            put_varint(o, *offset);
            put_varint(o, u64::from(*len));
        }
        Entry::Reset { stream, code } => {
            o.push(3);
            put_varint(o, *stream);
            put_varint(o, *code);
        }
        Entry::MaxStreamData { stream, max } => {
            o.push(4);
            put_varint(o, *stream);
            put_varint(o, *max);
        }
        Entry::MaxData(max) => {
            o.push(5);
            put_varint(o, *max);
        }
        Entry::MaxStreams(max) => {
            o.push(6);
            put_varint(o, *max);
        }
        Entry::Close { code, reason } => {
            o.push(7);
            put_varint(o, *code);
            put_lp_bytes(o, reason);
        }
        Entry::Addresses(addrs) => {
            o.push(8);
            put_varint(o, addrs.len() as u64);
            for a in addrs {
                put_lp_bytes(o, a.as_bytes());
            }
        }
        Entry::MoveTo(addr) => {
            o.push(9);
            put_lp_bytes(o, addr.as_bytes());
        }
    }
}

fn text(r: &mut Reader<'_>) -> Result<String, RestoreError> {
    let b = r.lp_bytes(crate::frame::MAX_TEXT_LEN, "text")?;
    String::from_utf8(b.to_vec()).map_err(|_| RestoreError::Invalid("text"))
}

fn decode_entry(r: &mut Reader<'_>) -> Result<Entry, RestoreError> {
    Ok(match r.u8()? {
        0 => Entry::Open(r.varint()?),
        t @ (1 | 2) => Entry::Data {
            stream: r.varint()?,
            offset: r.varint()?,
            len: u32::try_from(r.varint()?).map_err(|_| RestoreError::Invalid("data length"))?,
            fin: t == 2,
        },
        3 => Entry::Reset {
            stream: r.varint()?,
            code: r.varint()?,
        },
        4 => Entry::MaxStreamData {
            stream: r.varint()?,
            max: r.varint()?,
        },
        5 => Entry::MaxData(r.varint()?),
        6 => Entry::MaxStreams(r.varint()?),
        7 => Entry::Close {
            code: r.varint()?,
            reason: r
                .lp_bytes(crate::frame::MAX_TEXT_LEN, "close reason")?
                .to_vec(),
        },
        8 => {
            let n = r.varint_usize(crate::frame::MAX_ADDRESSES, "address count")?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(text(r)?);
            }
            Entry::Addresses(v)
        }
        9 => Entry::MoveTo(text(r)?),
        _ => return Err(RestoreError::Invalid("log entry kind")),
    })
}
