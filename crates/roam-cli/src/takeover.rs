//! Relay takeover: a running `roam serve` hands everything it holds to a new
//! `roam serve --takeover` process over a Unix socket (descriptors with
//! `SCM_RIGHTS`), then exits. Nothing is closed on the way: the listening
//! socket and every target connection move as descriptors, and each session
//! moves as its continuation (`docs/PROTOCOL.md` §13) with the bytes its
//! relay pumps had read and not yet written, and with its client connection
//! when that is at rest (§13.6: the socket, its transport state and the
//! records not yet written): the new process continues the same connection
//! and the client sees a pause, no resume. A client connection caught
//! mid-handshake is dropped instead; that client resumes within a round trip
//! or two.
//!
//! The wire, one Unix stream connection (`docs/ARCHITECTURE.md`, "Relay
//! takeover"): *records* are a little-endian `u32` length and a JSON body;
//! raw bytes follow a record that announces their lengths; a batch of
//! descriptors is one byte `F` sent with `SCM_RIGHTS`, announced by the
//! record before it.
//!
//! 1. new → old: `Hello { magic, format, version }`.
//! 2. old → new: `Answer` (refused: the old relay goes on serving).
//! 3. old → new: `Listeners`, then their descriptors.
//! 4. old → new, per session: `SessionHeader`, the blob, every stream's
//!    pending bytes and (format 3) the client connection's state and unsent
//!    bytes, then the target descriptors and the client connection's.
//! 5. old → new: `Shells` (format 2: the shells of `--shell`, with their
//!    terminal images), then their pty descriptors.
//! 6. old → new: `End`; new → old: `Taken` once it accepts on the listener
//!    and holds every session. The old relay exits; without `Taken` it puts
//!    the sessions back into its own service and goes on.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

use crate::pump::HalfState;

/// The version of this handover's state format. A relay refuses a takeover
/// by a process that speaks another one (and goes on serving).
pub(crate) const STATE_FORMAT: u32 = 3;
/// First field of the hello, so a stray connection is told apart.
const MAGIC: &str = "roam-takeover";
/// Largest record body accepted (a session header names lengths, never bytes).
const MAX_RECORD: usize = 16 << 20;
/// Largest raw section accepted (a session's blob or one pending buffer).
const MAX_RAW: u64 = 1 << 30;
/// Streams one handed-over session may have (a relay's per-session target
/// cap is far lower).
const MAX_STREAMS: usize = 1 << 16;
/// Descriptors per `SCM_RIGHTS` batch (the kernel takes at most 253).
const FDS_PER_BATCH: usize = 200;

/// The new process introduces itself.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// [`MAGIC`].
    pub(crate) magic: String,
    /// Its [`STATE_FORMAT`].
    pub(crate) format: u32,
    /// Its roam version, for the log.
    pub(crate) version: String,
}

/// The old relay's answer to a [`Hello`].
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Answer {
    /// Whether the handover follows.
    pub(crate) ok: bool,
    /// The old relay's state format.
    pub(crate) format: u32,
    /// The old relay's roam version.
    pub(crate) version: String,
    /// Why not, when refused.
    pub(crate) error: Option<String>,
}

/// What precedes the listening descriptors.
#[derive(Debug, Serialize, Deserialize)]
struct Listeners {
    /// The address clients connect to (for the log and `roam status`).
    listen: String,
    /// Whether a metrics listener follows the relay's listener.
    metrics: bool,
}

/// One stream of a handed-over session, as it travels.
#[derive(Debug, Serialize, Deserialize)]
struct StreamHeader {
    id: u64,
    target: String,
    /// Whether a target descriptor comes for it (no: it was still dialing,
    /// the new relay dials again).
    fd: bool,
    up: HalfHeader,
    down: HalfHeader,
}

/// A [`HalfState`] without its bytes (they follow raw).
#[derive(Debug, Serialize, Deserialize)]
struct HalfHeader {
    pending: u64,
    eof: bool,
    done: bool,
    total: u64,
}

/// What precedes a session's raw bytes and descriptors.
#[derive(Debug, Serialize, Deserialize)]
struct SessionHeader {
    id: String,
    blob: u64,
    unaccepted: Vec<u64>,
    orphans: Vec<u64>,
    streams: Vec<StreamHeader>,
    /// The client connection, when it moves too.
    live: Option<LiveHeader>,
}

/// A session's client connection: its peer, and the lengths of its
/// transport state and unsent bytes (raw, after the streams' pending
/// bytes); its descriptor comes last in the session's batch.
#[derive(Debug, Serialize, Deserialize)]
struct LiveHeader {
    peer: String,
    state: u64,
    unsent: u64,
}

/// One shell of a handover, without its image (raw) and pty (descriptor).
#[derive(Debug, Serialize, Deserialize)]
struct ShellHeader {
    user: String,
    name: String,
    pid: u32,
    rows: u16,
    cols: u16,
    image: u64,
}

/// What precedes the shells' images and ptys.
#[derive(Debug, Serialize, Deserialize)]
struct Shells {
    shells: Vec<ShellHeader>,
}

/// Shells one handover may carry.
const MAX_SHELLS: usize = 1 << 16;

/// The last record of a handover, and the new relay's receipt.
#[derive(Debug, Serialize, Deserialize)]
enum Tail {
    /// A wave of sessions sent: their count, and when the old relay began
    /// stopping them ([`monotonic_ns`]; both relays run on one host).
    Wave { sessions: usize, stopped_ns: u64 },
    /// The new relay's receipt for a wave: they are its sessions now.
    WaveTaken { sessions: usize },
    /// All sent (the sum of the waves).
    End { sessions: usize },
    /// The new relay serves everything now.
    Taken { sessions: usize },
}

/// One stream of a relay session taken out of its pumps.
#[derive(Debug)]
pub(crate) struct HandedStream {
    /// The stream's id in its session.
    pub(crate) id: u64,
    /// Its target, as the client named it (`host:port`).
    pub(crate) target: String,
    /// The target connection; `None` while it was still being dialed.
    pub(crate) tcp: Option<OwnedFd>,
    /// Stream to target: bytes read from the stream not yet written.
    pub(crate) up: HalfState,
    /// Target to stream: bytes read from the target not yet written.
    pub(crate) down: HalfState,
}

/// One relay session taken out: its continuation and its streams' sockets.
#[derive(Debug)]
pub(crate) struct HandedSession {
    /// The session's id.
    pub(crate) id: roam::SessionId,
    /// The continuation (`roam::Detached`): holds the resume secret.
    pub(crate) detached: roam::Detached,
    /// Streams that had a relay.
    pub(crate) streams: Vec<HandedStream>,
    /// The client connection, when it moves with the session.
    pub(crate) live: Option<roam::LiveTransport>,
    /// When the old relay began stopping it ([`monotonic_ns`]), once its
    /// wave arrived.
    pub(crate) stopped_ns: Option<u64>,
}

/// This host's monotonic clock in nanoseconds (`CLOCK_MONOTONIC`): the same
/// in every process, so the relays of a takeover can time a session's stop
/// across both.
pub(crate) fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

/// Everything a relay hands over.
#[derive(Debug)]
pub(crate) struct Handover {
    /// The address the listener is bound to.
    pub(crate) listen: String,
    /// The relay's listening socket.
    pub(crate) listener: OwnedFd,
    /// The metrics listener, if the relay serves metrics.
    pub(crate) metrics: Option<OwnedFd>,
    /// The sessions.
    pub(crate) sessions: Vec<HandedSession>,
    /// The shells (`--shell`).
    pub(crate) shells: Vec<crate::shell::host::HandedShell>,
}

/// Writes one record.
pub(crate) fn write_record<T: Serialize, W: Write>(sock: &mut W, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    sock.write_all(&(body.len() as u32).to_le_bytes())?;
    sock.write_all(&body)
}

/// Reads one record.
pub(crate) fn read_record<T: for<'de> Deserialize<'de>, R: Read>(sock: &mut R) -> io::Result<T> {
    let mut len = [0u8; 4];
    sock.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_RECORD {
        return Err(invalid(format!(
            "record of {len} bytes (at most {MAX_RECORD})"
        )));
    }
    let mut body = vec![0u8; len];
    sock.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| invalid(format!("malformed record: {e}")))
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn read_raw<R: Read>(sock: &mut R, len: u64) -> io::Result<Vec<u8>> {
    if len > MAX_RAW {
        return Err(invalid(format!("raw section of {len} bytes")));
    }
    let mut v = vec![0u8; len as usize];
    sock.read_exact(&mut v)?;
    Ok(v)
}

/// Bytes a [`Sending`] gathers before it writes them without a batch.
const SEND_BUFFER: usize = 256 * 1024;
/// Bytes a [`Receiving`] reads at a time.
const RECV_BUFFER: usize = 256 * 1024;

/// The old relay's end of a handover: bytes are gathered and go out with
/// the next descriptor batch, in one `sendmsg` (or alone once
/// [`SEND_BUFFER`] is full), instead of a system call per field. The bytes
/// on the socket are the same.
struct Sending<'a> {
    sock: &'a UnixStream,
    buf: Vec<u8>,
}

impl Sending<'_> {
    fn new(sock: &UnixStream) -> Sending<'_> {
        Sending {
            sock,
            buf: Vec::with_capacity(SEND_BUFFER),
        }
    }
}

impl Write for Sending<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= SEND_BUFFER {
            self.flush()?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut sock = self.sock;
        sock.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
}

/// Sends `fds` in batches of [`FDS_PER_BATCH`], each an `F` byte carrying
/// them, after the bytes gathered so far (in the same `sendmsg`: the kernel
/// attaches the descriptors to its first segment, so they arrive no later
/// than the `F` byte).
fn send_fds(s: &mut Sending<'_>, fds: &[&OwnedFd]) -> io::Result<()> {
    for batch in fds.chunks(FDS_PER_BATCH) {
        let borrowed: Vec<_> = batch.iter().map(|f| f.as_fd()).collect();
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_BATCH))];
        let mut cmsg = SendAncillaryBuffer::new(&mut space);
        if !cmsg.push(SendAncillaryMessage::ScmRights(&borrowed)) {
            return Err(io::Error::other("descriptor batch does not fit its buffer"));
        }
        s.buf.push(b'F');
        let n = sendmsg(
            s.sock,
            &[IoSlice::new(&s.buf)],
            &mut cmsg,
            SendFlags::empty(),
        )?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let mut sock = s.sock;
        sock.write_all(&s.buf[n..])?;
        s.buf.clear();
    }
    Ok(())
}

/// The new relay's end: reads the socket in large `recvmsg`s and keeps the
/// descriptors that arrive, in order, until their batch's `F` byte is read
/// ([`recv_fds`]). A plain `read` would close descriptors it met.
pub(crate) struct Receiving {
    sock: UnixStream,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    fds: std::collections::VecDeque<OwnedFd>,
}

impl Receiving {
    fn new(sock: UnixStream) -> Receiving {
        Receiving {
            sock,
            buf: vec![0u8; RECV_BUFFER],
            pos: 0,
            end: 0,
            fds: std::collections::VecDeque::new(),
        }
    }

    /// One `recvmsg`: bytes into the buffer, descriptors into the queue.
    fn fill(&mut self) -> io::Result<()> {
        // A stream read stops after a segment that carries descriptors, so
        // one read brings at most one batch (≤ 253, the kernel's limit).
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(253))];
        let mut cmsg = RecvAncillaryBuffer::new(&mut space);
        let r = recvmsg(
            &self.sock,
            &mut [IoSliceMut::new(&mut self.buf)],
            &mut cmsg,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            return Err(invalid(
                "descriptors were lost on the way (is the open-file limit too low?)".into(),
            ));
        }
        for msg in cmsg.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                self.fds.extend(fds);
            }
        }
        self.pos = 0;
        self.end = r.bytes;
        Ok(())
    }
}

impl Read for Receiving {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.end {
            self.fill()?;
        }
        let n = out.len().min(self.end - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Takes `count` descriptors sent by [`send_fds`]: per batch, its `F` byte
/// and the descriptors that came with (or before) it.
fn recv_fds(r: &mut Receiving, count: usize) -> io::Result<Vec<OwnedFd>> {
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let want = (count - out.len()).min(FDS_PER_BATCH);
        let mut byte = [0u8; 1];
        r.read_exact(&mut byte)?;
        if byte[0] != b'F' {
            return Err(invalid("expected a descriptor batch".to_string()));
        }
        if r.fds.len() < want {
            return Err(invalid(format!(
                "descriptor batch of {} (expected {want}); is the open-file limit too low?",
                r.fds.len()
            )));
        }
        out.extend(r.fds.drain(..want));
    }
    Ok(out)
}

fn half_header(h: &HalfState) -> HalfHeader {
    HalfHeader {
        pending: h.pending.len() as u64,
        eof: h.eof,
        done: h.done,
        total: h.total,
    }
}

/// Sessions per wave: taken out of their relays together, sent, and
/// committed by the new relay's receipt before the next wave is taken out.
/// The sessions of later waves keep running here meanwhile, so a session's
/// stall is one wave's handover, whatever the relay's size.
pub(crate) const WAVE: usize = 32;
/// Most sessions a wave may hold (a receiver's bound).
const MAX_WAVE: usize = 1 << 16;

/// Old side, first: the listening sockets.
pub(crate) fn send_listeners(
    sock: &UnixStream,
    listen: &str,
    listener: &OwnedFd,
    metrics: Option<&OwnedFd>,
) -> io::Result<()> {
    let mut w = Sending::new(sock);
    write_listeners(&mut w, listen, listener, metrics, send_fds)?;
    w.flush()
}

/// Old side, per wave: sends `sessions` and waits for the new relay's
/// receipt. `Ok`: they are the new relay's now (drop them here), also when
/// the exchange failed but the receipt had arrived ([`committed`]). `Err`:
/// they are still this relay's to serve.
pub(crate) fn send_wave(
    sock: &UnixStream,
    sessions: &[HandedSession],
    stopped_ns: u64,
) -> io::Result<()> {
    let n = sessions.len();
    committed(
        sock,
        |w| {
            for s in sessions {
                write_session(w, s, send_fds)?;
            }
            write_record(
                w,
                &Tail::Wave {
                    sessions: n,
                    stopped_ns,
                },
            )
        },
        |t| matches!(t, Tail::WaveTaken { sessions } if *sessions == n),
    )
}

/// Old side, last: the shells and the end, then the new relay's receipt for
/// all `sessions` (the sum of the waves), as [`send_wave`].
pub(crate) fn send_end(
    sock: &UnixStream,
    shells: &[crate::shell::host::HandedShell],
    sessions: usize,
) -> io::Result<()> {
    committed(
        sock,
        |w| write_end(w, shells, sessions, send_fds),
        |t| matches!(t, Tail::Taken { sessions: n } if *n == sessions),
    )
}

/// Writes what `write` gathers and reads the new relay's receipt, which
/// must be `receipt`. When either fails, shuts the socket (so the new relay
/// can no longer commit: its receipt write fails and it drops what it got),
/// then looks for a receipt written before that among what had arrived: if
/// there is one, the exchange committed after all.
fn committed(
    sock: &UnixStream,
    write: impl FnOnce(&mut Sending<'_>) -> io::Result<()>,
    receipt: impl Fn(&Tail) -> bool,
) -> io::Result<()> {
    let exchange = || {
        let mut w = Sending::new(sock);
        write(&mut w)?;
        w.flush()?;
        let mut r = sock;
        match read_record::<Tail, _>(&mut r)? {
            t if receipt(&t) => Ok(()),
            other => Err(invalid(format!("unexpected receipt {other:?}"))),
        }
    };
    let Err(e) = exchange() else {
        return Ok(());
    };
    let _ = sock.shutdown(std::net::Shutdown::Both);
    let _ = sock.set_nonblocking(true);
    let mut r = sock;
    loop {
        match read_record::<Tail, _>(&mut r) {
            Ok(t) if receipt(&t) => return Ok(()),
            Ok(_) => continue,
            Err(_) => return Err(e),
        }
    }
}

/// Writes `h` to `w` in waves of `wave` sessions (no receipts: for tests
/// and the fuzz target), its descriptors through `send_fds` (which sends one
/// batch after the bytes written so far).
pub(crate) fn encode<W: Write>(
    sock: &mut W,
    h: &Handover,
    wave: usize,
    mut send_fds: impl FnMut(&mut W, &[&OwnedFd]) -> io::Result<()>,
) -> io::Result<()> {
    write_listeners(
        sock,
        &h.listen,
        &h.listener,
        h.metrics.as_ref(),
        &mut send_fds,
    )?;
    for chunk in h.sessions.chunks(wave.max(1)) {
        for s in chunk {
            write_session(sock, s, &mut send_fds)?;
        }
        write_record(
            sock,
            &Tail::Wave {
                sessions: chunk.len(),
                stopped_ns: chunk.first().and_then(|s| s.stopped_ns).unwrap_or(0),
            },
        )?;
    }
    write_end(sock, &h.shells, h.sessions.len(), send_fds)
}

fn write_listeners<W: Write>(
    sock: &mut W,
    listen: &str,
    listener: &OwnedFd,
    metrics: Option<&OwnedFd>,
    mut send_fds: impl FnMut(&mut W, &[&OwnedFd]) -> io::Result<()>,
) -> io::Result<()> {
    write_record(
        sock,
        &Listeners {
            listen: listen.to_string(),
            metrics: metrics.is_some(),
        },
    )?;
    let mut fds = vec![listener];
    fds.extend(metrics);
    send_fds(sock, &fds)
}

fn write_session<W: Write>(
    sock: &mut W,
    s: &HandedSession,
    mut send_fds: impl FnMut(&mut W, &[&OwnedFd]) -> io::Result<()>,
) -> io::Result<()> {
    let header = SessionHeader {
        id: s.id.to_string(),
        blob: s.detached.blob.len() as u64,
        unaccepted: s.detached.unaccepted.iter().map(|i| i.0).collect(),
        orphans: s.detached.orphans.iter().map(|i| i.0).collect(),
        streams: s
            .streams
            .iter()
            .map(|st| StreamHeader {
                id: st.id,
                target: st.target.clone(),
                fd: st.tcp.is_some(),
                up: half_header(&st.up),
                down: half_header(&st.down),
            })
            .collect(),
        live: s.live.as_ref().map(|l| LiveHeader {
            peer: l.peer.to_string(),
            state: l.state.len() as u64,
            unsent: l.unsent.len() as u64,
        }),
    };
    write_record(sock, &header)?;
    sock.write_all(&s.detached.blob)?;
    for st in &s.streams {
        sock.write_all(&st.up.pending)?;
        sock.write_all(&st.down.pending)?;
    }
    if let Some(l) = &s.live {
        sock.write_all(&l.state)?;
        sock.write_all(&l.unsent)?;
    }
    let mut fds: Vec<&OwnedFd> = s.streams.iter().filter_map(|st| st.tcp.as_ref()).collect();
    fds.extend(s.live.as_ref().map(|l| &l.fd));
    if fds.is_empty() {
        Ok(())
    } else {
        send_fds(sock, &fds)
    }
}

fn write_end<W: Write>(
    sock: &mut W,
    shells: &[crate::shell::host::HandedShell],
    sessions: usize,
    mut send_fds: impl FnMut(&mut W, &[&OwnedFd]) -> io::Result<()>,
) -> io::Result<()> {
    write_record(
        sock,
        &Shells {
            shells: shells
                .iter()
                .map(|sh| ShellHeader {
                    user: sh.user.clone(),
                    name: sh.name.clone(),
                    pid: sh.pid,
                    rows: sh.rows,
                    cols: sh.cols,
                    image: sh.image.len() as u64,
                })
                .collect(),
        },
    )?;
    for sh in shells {
        sock.write_all(&sh.image)?;
    }
    let fds: Vec<&OwnedFd> = shells.iter().map(|sh| &sh.pty).collect();
    if !fds.is_empty() {
        send_fds(sock, &fds)?;
    }
    write_record(sock, &Tail::End { sessions })
}

/// Reads a whole handover (listeners, waves, shells, end) from `r`,
/// answering nothing: for tests and the fuzz target.
pub(crate) fn decode<R: Read>(
    sock: &mut R,
    mut recv_fds: impl FnMut(&mut R, usize) -> io::Result<Vec<OwnedFd>>,
) -> io::Result<Handover> {
    let l = decode_listeners(sock, &mut recv_fds)?;
    let mut sessions = Vec::new();
    let (shells, _) = decode_waves(sock, &mut recv_fds, |_, wave| {
        sessions.extend(wave);
        Ok(())
    })?;
    Ok(Handover {
        listen: l.listen,
        listener: l.listener,
        metrics: l.metrics,
        sessions,
        shells,
    })
}

/// The listening sockets a handover begins with.
#[derive(Debug)]
pub(crate) struct Listening {
    /// The address the listener is bound to.
    pub(crate) listen: String,
    /// The relay's listening socket.
    pub(crate) listener: OwnedFd,
    /// The metrics listener, if the relay serves metrics.
    pub(crate) metrics: Option<OwnedFd>,
}

/// New side, after its [`Hello`] was accepted: the listening sockets, and
/// the reader the waves follow on.
pub(crate) fn recv_listeners(sock: UnixStream) -> io::Result<(Listening, Receiving)> {
    let mut r = Receiving::new(sock);
    let l = decode_listeners(&mut r, recv_fds)?;
    Ok((l, r))
}

/// New side: receives the waves, answering each with its receipt before
/// `on_wave` gets its sessions (so a wave whose receipt could not be
/// written is never served here: the old relay keeps it), then the shells
/// and the end. Returns the shells and how many sessions came.
pub(crate) fn recv_waves(
    r: &mut Receiving,
    mut on_wave: impl FnMut(Vec<HandedSession>),
) -> io::Result<(Vec<crate::shell::host::HandedShell>, usize)> {
    let (shells, n) = decode_waves(r, recv_fds, |r: &mut Receiving, wave| {
        let mut w = &r.sock;
        write_record(
            &mut w,
            &Tail::WaveTaken {
                sessions: wave.len(),
            },
        )?;
        on_wave(wave);
        Ok(())
    })?;
    if r.pos != r.end || !r.fds.is_empty() {
        return Err(invalid(format!(
            "{} bytes and {} descriptors after the end of the handover",
            r.end - r.pos,
            r.fds.len()
        )));
    }
    Ok((shells, n))
}

/// Reads the listening sockets from `r`, their descriptors through
/// `recv_fds` (which receives a batch of the given size).
pub(crate) fn decode_listeners<R: Read>(
    sock: &mut R,
    mut recv_fds: impl FnMut(&mut R, usize) -> io::Result<Vec<OwnedFd>>,
) -> io::Result<Listening> {
    let l: Listeners = read_record(sock)?;
    let mut fds = recv_fds(sock, 1 + usize::from(l.metrics))?.into_iter();
    let listener = fds.next().ok_or_else(|| invalid("no listener".into()))?;
    Ok(Listening {
        listen: l.listen,
        listener,
        metrics: fds.next(),
    })
}

/// Reads the waves, shells and end from `r` (after
/// [`decode_listeners`]); each complete wave goes to `on_wave`. Every
/// length and count is checked before it is used; malformed input is an
/// `InvalidData` error. Returns the shells and the sessions' count.
pub(crate) fn decode_waves<R: Read>(
    sock: &mut R,
    mut recv_fds: impl FnMut(&mut R, usize) -> io::Result<Vec<OwnedFd>>,
    mut on_wave: impl FnMut(&mut R, Vec<HandedSession>) -> io::Result<()>,
) -> io::Result<(Vec<crate::shell::host::HandedShell>, usize)> {
    let mut wave: Vec<HandedSession> = Vec::new();
    let mut total = 0usize;
    let mut shells = Vec::new();
    let mut got_shells = false;
    loop {
        // A session header, the shells, a wave's end or the end.
        let mut len = [0u8; 4];
        sock.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_RECORD {
            return Err(invalid(format!("record of {len} bytes")));
        }
        let mut body = vec![0u8; len];
        sock.read_exact(&mut body)?;
        if let Ok(tail) = serde_json::from_slice::<Tail>(&body) {
            match tail {
                Tail::Wave {
                    sessions: n,
                    stopped_ns,
                } if n == wave.len() && n > 0 && !got_shells => {
                    total += n;
                    for s in &mut wave {
                        s.stopped_ns = Some(stopped_ns);
                    }
                    on_wave(sock, std::mem::take(&mut wave))?;
                    continue;
                }
                Tail::End { sessions: n } if n == total && wave.is_empty() && got_shells => {
                    return Ok((shells, total));
                }
                other => return Err(invalid(format!("unexpected record {other:?}"))),
            }
        }
        if let Ok(list) = serde_json::from_slice::<Shells>(&body) {
            if got_shells || !wave.is_empty() || list.shells.len() > MAX_SHELLS {
                return Err(invalid(format!(
                    "a second, early or oversized shells record ({} shells)",
                    list.shells.len()
                )));
            }
            got_shells = true;
            let mut images = Vec::with_capacity(list.shells.len());
            for sh in &list.shells {
                crate::named::check_name(&sh.name).map_err(invalid)?;
                images.push(read_raw(sock, sh.image)?);
            }
            let ptys = if list.shells.is_empty() {
                Vec::new()
            } else {
                recv_fds(sock, list.shells.len())?
            };
            for ((sh, image), pty) in list.shells.into_iter().zip(images).zip(ptys) {
                shells.push(crate::shell::host::HandedShell {
                    user: sh.user,
                    name: sh.name,
                    pid: sh.pid,
                    rows: sh.rows.max(1),
                    cols: sh.cols.max(1),
                    image,
                    pty,
                    child: None,
                });
            }
            continue;
        }
        if got_shells || wave.len() >= MAX_WAVE {
            return Err(invalid(format!(
                "a session after the shells, or a wave of more than {MAX_WAVE}"
            )));
        }
        let header: SessionHeader = serde_json::from_slice(&body)
            .map_err(|e| invalid(format!("malformed session header: {e}")))?;
        if header.streams.len() > MAX_STREAMS {
            return Err(invalid(format!(
                "session with {} streams (at most {MAX_STREAMS})",
                header.streams.len()
            )));
        }
        let id = header
            .id
            .parse::<roam::SessionId>()
            .map_err(|e| invalid(format!("session id {:?}: {e}", header.id)))?;
        let blob = read_raw(sock, header.blob)?;
        let mut streams = Vec::with_capacity(header.streams.len());
        for st in &header.streams {
            let up = read_raw(sock, st.up.pending)?;
            let down = read_raw(sock, st.down.pending)?;
            streams.push(HandedStream {
                id: st.id,
                target: st.target.clone(),
                tcp: None,
                up: HalfState {
                    pending: up,
                    eof: st.up.eof,
                    done: st.up.done,
                    total: st.up.total,
                },
                down: HalfState {
                    pending: down,
                    eof: st.down.eof,
                    done: st.down.done,
                    total: st.down.total,
                },
            });
        }
        let live = match &header.live {
            Some(l) => {
                let peer = l
                    .peer
                    .parse::<std::net::SocketAddr>()
                    .map_err(|e| invalid(format!("client address {:?}: {e}", l.peer)))?;
                Some((peer, read_raw(sock, l.state)?, read_raw(sock, l.unsent)?))
            }
            None => None,
        };
        let with_fd = header.streams.iter().filter(|s| s.fd).count() + usize::from(live.is_some());
        let mut fds = if with_fd == 0 {
            Vec::new().into_iter()
        } else {
            recv_fds(sock, with_fd)?.into_iter()
        };
        for (st, h) in streams.iter_mut().zip(&header.streams) {
            if h.fd {
                st.tcp = fds.next();
            }
        }
        let live = match live {
            Some((peer, state, unsent)) => {
                let fd = fds
                    .next()
                    .ok_or_else(|| invalid("a client connection without its descriptor".into()))?;
                Some(roam::LiveTransport::new(fd, peer, state, unsent))
            }
            None => None,
        };
        wave.push(HandedSession {
            id,
            detached: roam::Detached::new(
                blob,
                header.unaccepted.into_iter().map(roam::StreamId).collect(),
                header.orphans.into_iter().map(roam::StreamId).collect(),
            ),
            streams,
            live,
            stopped_ns: None,
        });
    }
}

/// New side: the receipt that ends the handover.
pub(crate) fn send_taken(r: &Receiving, sessions: usize) -> io::Result<()> {
    let mut w = &r.sock;
    write_record(&mut w, &Tail::Taken { sessions })
}

impl Receiving {
    /// The socket (for its peer's credentials).
    pub(crate) fn sock(&self) -> &UnixStream {
        &self.sock
    }
}

/// New side: introduces itself as reading state `format` (normally
/// [`STATE_FORMAT`]) and reads the answer.
pub(crate) fn hello_with_format(sock: &mut UnixStream, format: u32) -> io::Result<Answer> {
    write_record(
        sock,
        &Hello {
            magic: MAGIC.to_string(),
            format,
            version: env!("CARGO_PKG_VERSION").to_string(),
        },
    )?;
    read_record(sock)
}

/// Old side: reads a hello and answers it; `Ok(Ok(hello))` when the
/// handover should follow, `Ok(Err(why))` when it was refused.
pub(crate) fn answer(sock: &mut UnixStream, format: u32) -> io::Result<Result<Hello, String>> {
    let hello: Hello = read_record(sock)?;
    let refusal = if hello.magic != MAGIC {
        Some(format!("not a roam takeover (magic {:?})", hello.magic))
    } else if hello.format != format {
        Some(format!(
            "state format mismatch: this relay (roam {}) hands over state format {format}, the new process (roam {}) reads format {}; the old relay keeps serving",
            env!("CARGO_PKG_VERSION"),
            hello.version,
            hello.format
        ))
    } else {
        None
    };
    write_record(
        sock,
        &Answer {
            ok: refusal.is_none(),
            format,
            version: env!("CARGO_PKG_VERSION").to_string(),
            error: refusal.clone(),
        },
    )?;
    Ok(match refusal {
        None => Ok(hello),
        Some(r) => Err(r),
    })
}

/// A description of `h` without its descriptors' numbers (which differ
/// between processes): equal for equal handovers.
pub(crate) fn describe(h: &Handover) -> String {
    let mut out = format!("listen {:?} metrics {}\n", h.listen, h.metrics.is_some());
    for s in &h.sessions {
        out += &format!(
            "session {} blob {:?} unaccepted {:?} orphans {:?}\n",
            s.id, s.detached.blob, s.detached.unaccepted, s.detached.orphans
        );
        if let Some(l) = &s.live {
            out += &format!(
                "  client connection {} state {:?} unsent {:?}\n",
                l.peer, l.state, l.unsent
            );
        }
        for st in &s.streams {
            out += &format!(
                "  stream {} {:?} fd {} up {:?} down {:?}\n",
                st.id,
                st.target,
                st.tcp.is_some(),
                st.up,
                st.down
            );
        }
    }
    for sh in &h.shells {
        out += &format!(
            "shell {:?} of {:?} pid {} {}x{} image {:?}\n",
            sh.name, sh.user, sh.pid, sh.rows, sh.cols, sh.image
        );
    }
    out
}

/// The decoder over plain bytes, for the fuzz target and tests: a
/// descriptor batch is one `F` byte here, and the descriptors it carries are
/// stand-ins (`/dev/null`). Decodes, re-encodes and decodes again. `Ok(Ok(d))`:
/// the description `d` of what was decoded; `Ok(Err(e))`: the input is
/// malformed (`e` says how); `Err`: the round trip failed (a bug).
pub(crate) fn decode_bytes(bytes: &[u8]) -> Result<Result<String, String>, String> {
    fn fds_from<R: Read>(r: &mut R, n: usize) -> io::Result<Vec<OwnedFd>> {
        let mut f = [0u8; 1];
        r.read_exact(&mut f)?;
        if f[0] != b'F' {
            return Err(invalid("expected a descriptor batch".to_string()));
        }
        (0..n)
            .map(|_| std::fs::File::open("/dev/null").map(OwnedFd::from))
            .collect()
    }
    let mut r = io::Cursor::new(bytes);
    let h = match decode(&mut r, fds_from) {
        Ok(h) => h,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let first = describe(&h);
    let mut again = Vec::new();
    encode(&mut again, &h, 3, |w, _| w.write_all(b"F")).map_err(|e| format!("re-encoding: {e}"))?;
    let h2 = decode(&mut io::Cursor::new(&again[..]), fds_from)
        .map_err(|e| format!("decoding the re-encoding: {e}"))?;
    let second = describe(&h2);
    if first != second {
        return Err(format!(
            "round trip changed the handover:\n{first}\n{second}"
        ));
    }
    Ok(Ok(first))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(tcp: Vec<OwnedFd>) -> Handover {
        let mut tcp = tcp.into_iter();
        let pty = tcp.next().expect("a pty descriptor first");
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        Handover {
            listen: l.local_addr().unwrap().to_string(),
            listener: OwnedFd::from(l),
            metrics: None,
            sessions: vec![HandedSession {
                id: "000102030405060708090a0b0c0d0e0f".parse().unwrap(),
                detached: roam::Detached::new(
                    vec![7; 3000],
                    vec![roam::StreamId(5)],
                    vec![roam::StreamId(9)],
                ),
                streams: vec![
                    HandedStream {
                        id: 1,
                        target: "127.0.0.1:22".into(),
                        tcp: tcp.next(),
                        up: HalfState {
                            pending: b"pending up".to_vec(),
                            eof: false,
                            done: false,
                            total: 123,
                        },
                        down: HalfState {
                            pending: Vec::new(),
                            eof: true,
                            done: true,
                            total: 456,
                        },
                    },
                    HandedStream {
                        id: 3,
                        target: "127.0.0.1:5432".into(),
                        tcp: None,
                        up: HalfState::default(),
                        down: HalfState::default(),
                    },
                ],
                live: Some(roam::LiveTransport::new(
                    tcp.next().expect("a client connection descriptor last"),
                    "192.0.2.7:40000".parse().unwrap(),
                    b"RMLT state".to_vec(),
                    b"sealed records".to_vec(),
                )),
                stopped_ns: None,
            }],
            shells: vec![crate::shell::host::HandedShell {
                user: "alice".into(),
                name: "work".into(),
                pid: 4242,
                rows: 30,
                cols: 100,
                image: b"\x1b[Hprompt$ ".to_vec(),
                pty,
                child: None,
            }],
        }
    }

    /// Everything arrives over a real Unix socket, the descriptors as
    /// working sockets: the target connection still reaches its peer.
    #[test]
    fn handover_round_trips_over_a_unix_socket_with_live_descriptors() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut server_side, _) = l.accept().unwrap();
        let pty = nix::pty::openpty(None, None).unwrap();
        let client2 = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut client2_peer, _) = l.accept().unwrap();
        let h = sample(vec![
            pty.master,
            OwnedFd::from(client),
            OwnedFd::from(client2),
        ]);
        let expected = describe(&h);
        let (a, b) = UnixStream::pair().unwrap();
        let sender = std::thread::spawn(move || {
            let r = send_listeners(&a, &h.listen, &h.listener, h.metrics.as_ref())
                .and_then(|()| send_wave(&a, &h.sessions, monotonic_ns()))
                .and_then(|()| send_end(&a, &h.shells, h.sessions.len()));
            (h, r)
        });
        let (l, mut r) = recv_listeners(b).unwrap();
        let mut sessions = Vec::new();
        let (shells, n) = recv_waves(&mut r, |w| sessions.extend(w)).unwrap();
        send_taken(&r, n).unwrap();
        let (_h, sent) = sender.join().unwrap();
        sent.unwrap();
        let got = Handover {
            listen: l.listen,
            listener: l.listener,
            metrics: l.metrics,
            sessions,
            shells,
        };
        assert_eq!(describe(&got), expected);
        // The received descriptor is the same connection.
        let fd = got.sessions[0].streams[0]
            .tcp
            .as_ref()
            .unwrap()
            .try_clone()
            .unwrap();
        let mut moved = std::net::TcpStream::from(fd);
        moved.write_all(b"still here").unwrap();
        let mut buf = [0u8; 10];
        server_side.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"still here");
        // So is the client connection.
        let fd = got.sessions[0]
            .live
            .as_ref()
            .unwrap()
            .fd
            .try_clone()
            .unwrap();
        let mut moved = std::net::TcpStream::from(fd);
        moved.write_all(b"same conn!").unwrap();
        client2_peer.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"same conn!");
        // The shell's pty arrives as the same terminal: what its master
        // writes, its slave reads.
        let mut master = std::fs::File::from(got.shells[0].pty.try_clone().unwrap());
        master.write_all(b"typed\n").unwrap();
        let mut slave = std::fs::File::from(pty.slave);
        let mut line = [0u8; 6];
        slave.read_exact(&mut line).unwrap();
        assert_eq!(&line, b"typed\n");
    }

    /// The fuzz target's seeds (`fuzz/seeds/takeover`): a handover with
    /// nothing in it, one with a session, one with a session and a shell,
    /// each of which decodes and round-trips. Written to
    /// `ROAM_TAKEOVER_SEEDS_DIR` when it is set.
    #[test]
    fn seed_handovers_decode_and_round_trip() {
        let null = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let mut with_shell = sample(vec![null(), null(), null()]);
        with_shell.sessions[0].stopped_ns = Some(123_456_789);
        let mut one_session = sample(vec![null(), null(), null()]);
        one_session.shells.clear();
        let mut empty = sample(vec![null(), null(), null()]);
        empty.shells.clear();
        empty.sessions.clear();
        for (name, h) in [
            ("empty", empty),
            ("one_session", one_session),
            ("with_shell", with_shell),
        ] {
            let mut bytes = Vec::new();
            encode(&mut bytes, &h, 1, |w, _| w.write_all(b"F")).unwrap();
            assert_eq!(decode_bytes(&bytes), Ok(Ok(describe(&h))), "{name}");
            if let Some(dir) = std::env::var_os("ROAM_TAKEOVER_SEEDS_DIR") {
                std::fs::write(std::path::Path::new(&dir).join(name), &bytes).unwrap();
            }
        }
    }

    /// The byte-level decoder round-trips an encoding, and refuses
    /// truncations, oversized lengths and garbage with an error.
    #[test]
    fn decoder_round_trips_and_refuses_malformed_input() {
        let null = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let h = sample(vec![null(), null(), null()]);
        let mut bytes = Vec::new();
        encode(&mut bytes, &h, 1, |w, _| w.write_all(b"F")).unwrap();
        assert_eq!(decode_bytes(&bytes), Ok(Ok(describe(&h))));
        for cut in [0, 3, 10, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                matches!(decode_bytes(&bytes[..cut]), Ok(Err(_))),
                "truncated at {cut}"
            );
        }
        let mut huge = bytes.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = decode_bytes(&huge).unwrap().unwrap_err();
        assert!(e.contains("record of"), "{e}");
        assert!(matches!(decode_bytes(b"\x05\x00\x00\x00hello"), Ok(Err(_))));
    }
}
