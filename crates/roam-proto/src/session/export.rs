//! Session snapshots (continuations): the complete protocol state of a
//! session as bytes.
//!
//! Spec: `docs/PROTOCOL.md` §13. A server (or client) can let go of a session
//! entirely — no socket, no task, no buffers — by exporting it, and later, in
//! the same process or a new one, restore it and accept the peer's resume as
//! if nothing happened. A snapshot can be taken of a live session too: the
//! active transport is simply not part of it. The snapshot holds the resume
//! secret, so it must be stored where only its owner can read it.
//!
//! Format: an [`envelope`](super::envelope) with magic `"RMSC"`: one section
//! per part of the session state, declared once in [`PARTS`] below. Each part
//! is a type whose `write` and `read` sit side by side, so a field cannot be
//! written without being read back. A truncated, corrupted, foreign or
//! too-new blob fails with a precise [`RestoreError`] and never yields a
//! session.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use super::envelope::{Envelope, EnvelopeError, EnvelopeWriter, SectionKind};
use super::{Entry, Role, Session, State};
use crate::codec::{put_lp_bytes, put_varint, DecodeError, Reader};
use crate::config::{ClientConfig, ServerConfig};
use crate::handshake::Params;
use crate::keys::{PublicKey, SessionId};
use crate::stream::Stream;

/// Magic of a session snapshot.
const MAGIC: [u8; 4] = *b"RMSC";

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
    /// Written by an older roam in a layout this version no longer reads
    /// (format 1: the positional layout before sections). The session cannot
    /// be resumed; its client must start a new one.
    OldFormat(u8),
    /// Written by an incompatible (newer) version of roam.
    UnsupportedFormat(u8),
    /// The checksum does not match: the blob was truncated or corrupted.
    Corrupted,
    /// The blob is internally inconsistent; the text names the field.
    Invalid(&'static str),
    /// A section this version must understand but does not know (by id):
    /// written by a newer roam.
    UnknownSection(u64),
    /// A required section at a layout version this version does not read.
    UnsupportedSection {
        /// The section's name.
        section: &'static str,
        /// The version found.
        version: u64,
    },
    /// A section every continuation has is missing.
    MissingSection(&'static str),
    /// A server continuation given to a client restore, or the reverse.
    WrongRole,
    /// It already expired while stored.
    Expired,
}

impl fmt::Display for RestoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAContinuation => write!(f, "not a roam session continuation"),
            Self::OldFormat(v) => write!(
                f,
                "continuation was written in format {v} by an older roam (before sectioned snapshots, format {}); this roam cannot restore it: the session is lost and its client must start a new one",
                super::envelope::FORMAT
            ),
            Self::UnsupportedFormat(v) => {
                write!(f, "continuation format {v} is not supported by this roam")
            }
            Self::Corrupted => write!(
                f,
                "continuation is truncated or corrupted (checksum mismatch)"
            ),
            Self::Invalid(what) => write!(f, "continuation is inconsistent: {what}"),
            Self::UnknownSection(id) => write!(
                f,
                "continuation has required section 0x{id:x}, unknown to this roam (written by a newer version)"
            ),
            Self::UnsupportedSection { section, version } => write!(
                f,
                "continuation section `{section}` is at version {version}, not supported by this roam"
            ),
            Self::MissingSection(name) => {
                write!(f, "continuation lacks its `{name}` section")
            }
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

impl From<EnvelopeError> for RestoreError {
    fn from(e: EnvelopeError) -> Self {
        match e {
            EnvelopeError::WrongMagic => Self::NotAContinuation,
            EnvelopeError::OldFormat(v) => Self::OldFormat(v),
            EnvelopeError::UnsupportedFormat(v) => Self::UnsupportedFormat(v),
            EnvelopeError::Corrupted => Self::Corrupted,
            EnvelopeError::Malformed(what) => Self::Invalid(what),
            EnvelopeError::UnknownSection(id) => Self::UnknownSection(id),
            EnvelopeError::UnsupportedVersion { section, version } => {
                Self::UnsupportedSection { section, version }
            }
            EnvelopeError::MissingSection(name) => Self::MissingSection(name),
        }
    }
}

/// What a part's writer needs besides the session.
struct WriteCtx {
    /// The caller's clock, for the suspension time so far.
    now: Instant,
}

/// What a part's reader needs besides the blob.
struct ReadCtx {
    /// The role being restored (a blob of the other role is refused).
    role: Role,
    /// The caller's clock.
    now: Instant,
    /// How long the blob sat in storage; counts towards expiry.
    offline: Duration,
}

/// One part of the session state: its section, and how it is written and
/// read back. Each implementation keeps both directions next to each other.
trait Part {
    /// The section this part is stored in.
    const KIND: SectionKind;
    /// Appends this part's section(s) (none if there is nothing to say).
    fn write(s: &Session, ctx: &WriteCtx, w: &mut EnvelopeWriter);
    /// Reads this part into a session being restored.
    fn read(s: &mut Session, ctx: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError>;
}

/// Declares the parts once: the section table, and writing and reading them
/// all in section order.
macro_rules! parts {
    ($($part:ident),* $(,)?) => {
        /// Every section of a session snapshot, in id order.
        const PARTS: &[SectionKind] = &[$($part::KIND),*];

        /// Writes every part, in section order.
        fn write_parts(s: &Session, ctx: &WriteCtx, w: &mut EnvelopeWriter) {
            $($part::write(s, ctx, w);)*
        }

        /// Reads every part, in section order (so the first problem found is
        /// the first in the blob).
        fn read_parts(
            s: &mut Session,
            ctx: &ReadCtx,
            env: &Envelope<'_>,
        ) -> Result<(), RestoreError> {
            $($part::read(s, ctx, env)?;)*
            Ok(())
        }
    };
}

parts!(Identity, Liveness, Sequence, StreamIds, Flow, Closing, Streams, Statistics);

/// A section of the given id, name and repeatability at version 1.
const fn kind(id: u64, name: &'static str, repeatable: bool) -> SectionKind {
    SectionKind {
        id,
        name,
        version: 1,
        repeatable,
    }
}

/// Reads a section body with `f`, which must consume it whole.
fn body<T>(
    b: &[u8],
    what: &'static str,
    f: impl FnOnce(&mut Reader<'_>) -> Result<T, RestoreError>,
) -> Result<T, RestoreError> {
    let mut r = Reader::new(b);
    let v = f(&mut r)?;
    r.finish().map_err(|_| RestoreError::Invalid(what))?;
    Ok(v)
}

/// Role, session id, resume secret, the peer's proven key and its Params
/// (§4.3): everything a resume handshake needs.
struct Identity;

impl Part for Identity {
    const KIND: SectionKind = kind(0x02, "identity", false);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        // `export` checked these are all known.
        let (Some(id), Some(secret), Some(peer_key), Some(p)) =
            (s.id, s.secret, s.peer_key, s.peer_params)
        else {
            return;
        };
        w.section(&Self::KIND, |o| {
            o.push(match s.role {
                Role::Client => 0,
                Role::Server => 1,
            });
            o.extend_from_slice(&id.0);
            o.extend_from_slice(&secret);
            o.extend_from_slice(&peer_key.0);
            for v in [p.stream_window, p.session_window, p.max_streams] {
                put_varint(o, v);
            }
        });
    }

    fn read(s: &mut Session, ctx: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        body(env.require(&Self::KIND)?, "identity length", |r| {
            let role = match r.u8()? {
                0 => Role::Client,
                1 => Role::Server,
                _ => return Err(RestoreError::Invalid("role")),
            };
            if role != ctx.role {
                return Err(RestoreError::WrongRole);
            }
            s.id = Some(SessionId(r.array()?));
            s.secret = Some(r.array()?);
            s.peer_key = Some(PublicKey(r.array()?));
            s.peer_params = Some(Params {
                stream_window: r.varint()?,
                session_window: r.varint()?,
                max_streams: r.varint()?,
            });
            Ok(())
        })
    }
}

/// Expiry and replay protection: the effective resume timeout, how long the
/// session had been suspended, and the last resume ephemerals (§4.4, §10.3).
struct Liveness;

impl Part for Liveness {
    const KIND: SectionKind = kind(0x04, "liveness", false);

    fn write(s: &Session, ctx: &WriteCtx, w: &mut EnvelopeWriter) {
        w.section(&Self::KIND, |o| {
            put_varint(o, s.resume_timeout.as_millis() as u64);
            let suspended_for = s
                .suspended_since
                .map_or(Duration::ZERO, |t| ctx.now.saturating_duration_since(t));
            put_varint(o, suspended_for.as_millis() as u64);
            let memory = s.replay_memory.as_deref();
            put_varint(o, memory.map_or(0, |m| m.len()) as u64);
            for e in memory.into_iter().flatten() {
                o.extend_from_slice(e);
            }
        });
    }

    fn read(s: &mut Session, ctx: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        body(env.require(&Self::KIND)?, "liveness length", |r| {
            s.resume_timeout = Duration::from_millis(r.varint()?).min(s.resume_timeout);
            let suspended_for = Duration::from_millis(r.varint()?).saturating_add(ctx.offline);
            if suspended_for >= s.resume_timeout {
                return Err(RestoreError::Expired);
            }
            s.suspended_since = Some(ctx.now.checked_sub(suspended_for).unwrap_or(ctx.now));
            let n = r.varint_usize(super::REPLAY_MEMORY, "replay memory")?;
            for _ in 0..n {
                let memory = s.replay_memory.get_or_insert_with(Box::default);
                memory.push_back(r.array()?);
            }
            Ok(())
        })
    }
}

/// The session-wide sequence (§7): the log's base, one past the highest
/// sequence ever sent, the received count, and the log of unacknowledged
/// reliable frames.
struct Sequence;

impl Part for Sequence {
    const KIND: SectionKind = kind(0x06, "sequence", false);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        w.section(&Self::KIND, |o| {
            for v in [s.log_base, s.high_sent, s.recv_seq] {
                put_varint(o, v);
            }
            put_varint(o, s.log.len() as u64);
            for e in &s.log {
                encode_entry(o, e);
            }
        });
    }

    fn read(s: &mut Session, _: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        body(env.require(&Self::KIND)?, "sequence length", |r| {
            s.log_base = r.varint()?;
            s.high_sent = r.varint()?;
            s.recv_seq = r.varint()?;
            let entries = r.varint_usize(r.remaining(), "log length")?;
            for _ in 0..entries {
                s.log.push_back(decode_entry(r)?);
            }
            if s.high_sent < s.log_base || s.high_sent > s.log_base + s.log.len() as u64 {
                return Err(RestoreError::Invalid("log positions"));
            }
            s.send_cursor = s.log_base;
            Ok(())
        })
    }
}

/// Stream numbering and the stream-count credit each way (§6.1, §6.5).
struct StreamIds;

impl Part for StreamIds {
    const KIND: SectionKind = kind(0x08, "stream ids", false);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        w.section(&Self::KIND, |o| {
            for v in [
                s.next_local_stream,
                s.next_peer_stream,
                s.local_streams_opened,
                s.local_stream_limit,
                s.peer_streams_opened,
                s.peer_streams_forgotten,
                s.peer_stream_limit,
            ] {
                put_varint(o, v);
            }
        });
    }

    fn read(s: &mut Session, _: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        body(env.require(&Self::KIND)?, "stream ids length", |r| {
            s.next_local_stream = r.varint()?;
            s.next_peer_stream = r.varint()?;
            s.local_streams_opened = r.varint()?;
            s.local_stream_limit = r.varint()?;
            s.peer_streams_opened = r.varint()?;
            s.peer_streams_forgotten = r.varint()?;
            s.peer_stream_limit = r.varint()?;
            Ok(())
        })
    }
}

/// Session-wide flow control (§8): our send limit and use, our receive
/// limit, what arrived and what the application consumed.
struct Flow;

impl Part for Flow {
    const KIND: SectionKind = kind(0x0a, "flow control", false);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        w.section(&Self::KIND, |o| {
            for v in [
                s.conn_send_max,
                s.conn_sent,
                s.conn_recv_max,
                s.conn_received,
                s.conn_consumed,
            ] {
                put_varint(o, v);
            }
        });
    }

    fn read(s: &mut Session, _: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        body(env.require(&Self::KIND)?, "flow control length", |r| {
            s.conn_send_max = r.varint()?;
            s.conn_sent = r.varint()?;
            s.conn_recv_max = r.varint()?;
            s.conn_received = r.varint()?;
            s.conn_consumed = r.varint()?;
            Ok(())
        })
    }
}

/// Present only for a Closing session (§10.1): whether a `close()` is still
/// waiting to log its CLOSE, and its code and reason.
struct Closing;

impl Part for Closing {
    const KIND: SectionKind = kind(0x0c, "closing", false);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        if s.state != State::Closing {
            return;
        }
        w.section(&Self::KIND, |o| match s.close_requested.as_deref() {
            Some((code, reason)) => {
                o.push(1);
                put_varint(o, *code);
                put_lp_bytes(o, reason);
            }
            None => o.push(0),
        });
    }

    fn read(s: &mut Session, _: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        let Some(b) = env.get(&Self::KIND) else {
            s.state = State::Suspended;
            return Ok(());
        };
        body(b, "closing length", |r| {
            s.close_requested = match r.u8()? {
                0 => None,
                1 => Some(Box::new((
                    r.varint()?,
                    r.lp_bytes(crate::frame::MAX_TEXT_LEN, "close reason")?
                        .to_vec(),
                ))),
                _ => return Err(RestoreError::Invalid("close flag")),
            };
            s.state = State::Closing;
            Ok(())
        })
    }
}

/// One section per stream still held, in increasing id order (§6, §8): its
/// offsets and limits, its unacknowledged and unsent bytes, its unread bytes,
/// and its flags.
struct Streams;

/// Stream flag bits, bit 0 upwards, as the `Streams` section stores them.
const STREAM_FLAGS: u32 = 9;

impl Part for Streams {
    const KIND: SectionKind = kind(0x0e, "stream", true);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        for (id, st) in &s.streams {
            w.section(&Self::KIND, |o| {
                put_varint(o, *id);
                put_lp_bytes(o, &st.meta);
                put_varint(o, st.send_base);
                put_deque(o, &st.send_buf);
                for v in [
                    st.sent,
                    st.send_max,
                    u64::from(st.in_log),
                    st.received,
                    st.recv_max,
                    st.reset.unwrap_or(0),
                ] {
                    put_varint(o, v);
                }
                put_deque(o, &st.recv_buf);
                let flags = [
                    st.fin_requested,
                    st.fin_sent,
                    st.fin_acked,
                    st.write_blocked,
                    st.fin_received,
                    st.eof_delivered,
                    st.reset.is_some(),
                    st.reset_seen,
                    st.contending,
                ];
                let bits = flags
                    .iter()
                    .enumerate()
                    .fold(0u64, |b, (i, f)| b | (u64::from(*f) << i));
                put_varint(o, bits);
            });
        }
    }

    fn read(s: &mut Session, _: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        let mut last = None;
        for b in env.all(&Self::KIND) {
            let (id, st) = body(b, "stream length", read_stream)?;
            if last.is_some_and(|l| l >= id) {
                return Err(RestoreError::Invalid("stream order"));
            }
            last = Some(id);
            s.send_buffered += st.send_buf.len() as u64;
            if st.write_blocked {
                s.write_waiters.push(id);
            }
            if st.contending {
                s.contenders += 1;
            }
            s.streams.insert(id, Box::new(st));
        }
        // Every log entry must point at state we hold.
        for e in &s.log {
            if let Entry::Data {
                stream,
                offset,
                len,
                ..
            } = e
            {
                let ok = s.streams.get(stream).is_some_and(|st| {
                    *offset >= st.send_base && offset + u64::from(*len) <= st.written()
                });
                if !ok {
                    return Err(RestoreError::Invalid(
                        "log entry refers to missing stream data",
                    ));
                }
            }
        }
        let ids: Vec<u64> = s.streams.keys().copied().collect();
        for id in ids {
            s.enqueue(id);
        }
        Ok(())
    }
}

/// Reads one stream section's body (the inverse of `Streams::write`).
fn read_stream(r: &mut Reader<'_>) -> Result<(u64, Stream), RestoreError> {
    let id = r.varint()?;
    let meta = r
        .lp_bytes(crate::frame::MAX_META_LEN, "stream metadata")?
        .to_vec();
    let mut st = Stream::new(meta, 0, 0);
    st.send_base = r.varint()?;
    st.send_buf = r
        .lp_bytes(r.remaining(), "send buffer")?
        .iter()
        .copied()
        .collect();
    st.sent = r.varint()?;
    st.send_max = r.varint()?;
    st.in_log =
        u32::try_from(r.varint()?).map_err(|_| RestoreError::Invalid("stream log count"))?;
    st.received = r.varint()?;
    st.recv_max = r.varint()?;
    let reset_code = r.varint()?;
    st.recv_buf = r
        .lp_bytes(r.remaining(), "receive buffer")?
        .iter()
        .copied()
        .collect();
    let flags = r.varint()?;
    if flags >> STREAM_FLAGS != 0 {
        return Err(RestoreError::Invalid("stream flags"));
    }
    let bit = |i: u32| flags & (1 << i) != 0;
    st.fin_requested = bit(0);
    st.fin_sent = bit(1);
    st.fin_acked = bit(2);
    st.write_blocked = bit(3);
    st.fin_received = bit(4);
    st.eof_delivered = bit(5);
    st.reset = bit(6).then_some(reset_code);
    if st.reset.is_none() && reset_code != 0 {
        return Err(RestoreError::Invalid("reset code without reset"));
    }
    st.reset_seen = bit(7);
    st.contending = bit(8);
    if st.sent < st.send_base || st.sent > st.written() {
        return Err(RestoreError::Invalid("stream send offsets"));
    }
    Ok((id, st))
}

/// Counters for status displays (`Stats`). Optional: a reader that does not
/// know it loses only statistics; absent, they restart from zero.
struct Statistics;

impl Part for Statistics {
    const KIND: SectionKind = kind(0x11, "statistics", false);

    fn write(s: &Session, _: &WriteCtx, w: &mut EnvelopeWriter) {
        w.section(&Self::KIND, |o| {
            for v in [
                s.stats.bytes_sent,
                s.stats.bytes_received,
                s.stats.bytes_replayed,
                s.stats.frames_replayed,
                s.stats.transports,
                s.stats.resumes,
            ] {
                put_varint(o, v);
            }
        });
    }

    fn read(s: &mut Session, _: &ReadCtx, env: &Envelope<'_>) -> Result<(), RestoreError> {
        let Some(b) = env.get(&Self::KIND) else {
            return Ok(());
        };
        body(b, "statistics length", |r| {
            s.stats.bytes_sent = r.varint()?;
            s.stats.bytes_received = r.varint()?;
            s.stats.bytes_replayed = r.varint()?;
            s.stats.frames_replayed = r.varint()?;
            s.stats.transports = r.varint()?;
            s.stats.resumes = r.varint()?;
            Ok(())
        })
    }
}

/// Appends a byte queue as lp-bytes.
fn put_deque(out: &mut Vec<u8>, d: &VecDeque<u8>) {
    let (a, b) = d.as_slices();
    put_varint(out, (a.len() + b.len()) as u64);
    out.extend_from_slice(a);
    out.extend_from_slice(b);
}

impl Session {
    /// Takes a snapshot of the session's complete protocol state — keys and
    /// resume secret, sequence and log, flow control, every stream with its
    /// unacknowledged and unread data — as a self-checking blob (§13). Works
    /// on a live session as well as a suspended one: the active transport
    /// (and a resume candidate) are not part of it, so the restored session
    /// starts suspended and waits for (server) or makes (client) a resume.
    /// The session itself is left as it was; whoever restores the snapshot
    /// must be its only user from then on (drop this one).
    pub fn export(&self, now: Instant) -> Result<Vec<u8>, ExportError> {
        match self.state {
            State::Handshaking => return Err(ExportError::NotEstablished),
            State::Closed => return Err(ExportError::Closed),
            _ => {}
        }
        if self.id.is_none()
            || self.secret.is_none()
            || self.peer_key.is_none()
            || self.peer_params.is_none()
        {
            return Err(ExportError::NotEstablished);
        }
        let mut w = EnvelopeWriter::new(MAGIC, 256 + self.send_buffered as usize);
        write_parts(self, &WriteCtx { now }, &mut w);
        Ok(w.finish())
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
        // No setup: a restored session only ever resumes.
        let mut s = Self::new(Role::Server, config.session.clone());
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
        // A restored session only ever resumes: its setup is never read.
        s.setup = None;
        s.restore_into(Role::Client, now, blob, offline)?;
        Ok(s)
    }

    /// Opens the envelope and reads every part into this fresh session.
    fn restore_into(
        &mut self,
        role: Role,
        now: Instant,
        blob: &[u8],
        offline: Duration,
    ) -> Result<(), RestoreError> {
        let env = Envelope::open(MAGIC, blob, PARTS)?;
        read_parts(self, &ReadCtx { role, now, offline }, &env)
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
        Entry::MoveAsk(host) => {
            o.push(10);
            put_lp_bytes(o, host.as_bytes());
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
        10 => Entry::MoveAsk(text(r)?),
        _ => return Err(RestoreError::Invalid("log entry kind")),
    })
}
