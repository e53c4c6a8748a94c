//! Transport openings: the cleartext preamble and the two Noise handshakes.
//!
//! Spec: `docs/PROTOCOL.md` §4. A new session runs `Noise_XX_25519_AESGCM_SHA256`
//! (both sides prove a static key); a resume runs `Noise_NNpsk0_25519_AESGCM_SHA256`
//! keyed by the session's resume secret, so every transport gets fresh keys and
//! a recorded resume cannot be replayed. Each phase is its own type, consumed
//! by value to produce the next.

use crate::codec::{put_varint, Reader};
use crate::keys::{Keypair, PublicKey, SessionId};
use crate::record::RecordCipher;
use crate::Error;

/// `ROAM` — first bytes of every roam transport in both directions.
pub const MAGIC: [u8; 4] = *b"ROAM";
/// Protocol versions this implementation speaks (§11).
pub const VERSION: u8 = 1;
/// Largest handshake message accepted (bytes). Noise XX messages here are < 200.
pub(crate) const MAX_HANDSHAKE_MSG: usize = 1024;

const PATTERN_NEW: &str = "Noise_XX_25519_AESGCM_SHA256";
const PATTERN_RESUME: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";

const KIND_NEW: u8 = 1;
const KIND_RESUME: u8 = 2;

/// Status byte of the server's reply (§4.2). Non-zero values end the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// Handshake continues.
    Ok = 0,
    /// No common protocol version.
    UnsupportedVersion = 1,
    /// The resume names a session the server does not hold (never existed, expired or closed).
    UnknownSession = 2,
    /// The resume did not prove the session's secret.
    ResumeRejected = 3,
    /// This resume message was seen before (a replay).
    Replay = 4,
    /// The server is at its session limit; try later.
    Busy = 5,
    /// The session lives on another host of the same service: an address
    /// (`u16` length, UTF-8 `host:port`) follows; resume there (§9.3).
    Moved = 6,
}

/// Longest address a `Moved` refusal carries (bytes), as for MOVE_TO.
pub const MAX_MOVED_ADDR: usize = 1024;

impl Status {
    fn error(code: u8) -> Error {
        match code {
            1 => Error::UnsupportedVersion,
            2 => Error::UnknownSession,
            3 => Error::ResumeRejected,
            4 => Error::ReplayedResume,
            5 => Error::ServerBusy,
            other => Error::PeerRefused(other),
        }
    }
}

/// Smallest `max_streams` a peer may announce; also the limit assumed before
/// the peer's [`Params`] arrive (§6.5).
pub(crate) const MIN_MAX_STREAMS: u64 = 16;

/// Flow-control and stream limits a side announces in its handshake (§8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Bytes the sender may have in flight on one stream before a `MAX_STREAM_DATA`.
    pub stream_window: u64,
    /// Bytes the sender may have in flight on the whole session before a `MAX_DATA`.
    pub session_window: u64,
    /// Streams the peer may have open towards us at once.
    pub max_streams: u64,
}

impl Params {
    fn encode(&self, out: &mut Vec<u8>) {
        put_varint(out, self.stream_window);
        put_varint(out, self.session_window);
        put_varint(out, self.max_streams);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, Error> {
        let p = Self {
            stream_window: r.varint()?,
            session_window: r.varint()?,
            max_streams: r.varint()?,
        };
        if p.stream_window == 0 || p.session_window == 0 {
            return Err(Error::ProtocolViolation("zero flow-control window"));
        }
        if p.max_streams < MIN_MAX_STREAMS {
            return Err(Error::ProtocolViolation("max_streams below the minimum"));
        }
        Ok(p)
    }
}

/// Keys of an established transport.
// Fuzzing only: the session targets clone an established pair per input.
#[cfg_attr(fuzzing, derive(Clone))]
pub(crate) struct Established {
    pub(crate) tx: RecordCipher,
    pub(crate) rx: RecordCipher,
}

fn noise_err(_: snow::Error) -> Error {
    Error::HandshakeFailed
}

fn established(mut hs: snow::HandshakeState) -> Established {
    let (k1, k2) = hs.dangerously_get_raw_split();
    let (tx, rx) = if hs.is_initiator() {
        (k1, k2)
    } else {
        (k2, k1)
    };
    Established {
        tx: RecordCipher::new(&tx),
        rx: RecordCipher::new(&rx),
    }
}

fn put_msg(out: &mut Vec<u8>, msg: &[u8]) {
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
}

/// Reads the address of a `Moved` refusal (§9.3); `None` if incomplete.
fn take_addr(buf: &[u8]) -> Result<Option<String>, Error> {
    if buf.len() < 2 {
        return Ok(None);
    }
    let len = usize::from(u16::from_be_bytes([buf[0], buf[1]]));
    if len == 0 || len > MAX_MOVED_ADDR {
        return Err(Error::ProtocolViolation("moved address empty or too long"));
    }
    let Some(addr) = buf.get(2..2 + len) else {
        return Ok(None);
    };
    String::from_utf8(addr.to_vec())
        .map(Some)
        .map_err(|_| Error::ProtocolViolation("moved address is not UTF-8"))
}

/// Reads a `u16`-length-prefixed handshake message from `buf`; `None` if incomplete.
fn take_msg(buf: &[u8]) -> Result<Option<(&[u8], usize)>, Error> {
    if buf.len() < 2 {
        return Ok(None);
    }
    let len = usize::from(u16::from_be_bytes([buf[0], buf[1]]));
    if len > MAX_HANDSHAKE_MSG {
        return Err(Error::ProtocolViolation("handshake message too long"));
    }
    Ok((buf.len() >= 2 + len).then(|| (&buf[2..2 + len], 2 + len)))
}

fn preamble(kind: u8, session: Option<&SessionId>) -> Vec<u8> {
    let mut p = Vec::with_capacity(23);
    p.extend_from_slice(&MAGIC);
    p.extend_from_slice(&[VERSION, VERSION, kind]);
    if let Some(id) = session {
        p.extend_from_slice(&id.0);
    }
    p
}

// ---------------------------------------------------------------- client side

/// Client: preamble and XX message 1 sent, waiting for the server's reply.
pub(crate) struct ClientNewSent {
    hs: snow::HandshakeState,
}

/// Client: resume preamble and NNpsk0 message 1 sent.
///
/// It keeps what rebuilds the handshake when the reply comes (the session,
/// its secret and this attempt's ephemeral key: 80 bytes), not snow's
/// handshake state (~1.5 KiB in a dozen allocations). A client whose server
/// is out of reach behind something that accepts connections but answers
/// nothing holds one of these for every suspended session, for most of the
/// time it re-dials. The rebuild redoes message 1 with the same ephemeral
/// key (one more X25519 base multiplication per resume); the ephemeral key
/// is fresh for every attempt and still serves exactly one handshake.
pub(crate) struct ClientResumeSent {
    session: SessionId,
    secret: [u8; 32],
    ephemeral: [u8; 32],
}

/// Starts a new-session handshake; appends the opening bytes to `out`.
pub(crate) fn client_new(keypair: &Keypair, out: &mut Vec<u8>) -> Result<ClientNewSent, Error> {
    let pre = preamble(KIND_NEW, None);
    let private = keypair.private_bytes();
    let mut hs = crate::suite::noise(PATTERN_NEW)
        .map_err(noise_err)?
        .local_private_key(&private)
        .and_then(|b| b.prologue(&pre))
        .and_then(|b| b.build_initiator())
        .map_err(noise_err)?;
    let mut msg = [0u8; MAX_HANDSHAKE_MSG];
    let n = hs.write_message(&[], &mut msg).map_err(noise_err)?;
    out.extend_from_slice(&pre);
    put_msg(out, &msg[..n]);
    Ok(ClientNewSent { hs })
}

/// Starts a resume of `session`; appends the opening bytes to `out`.
pub(crate) fn client_resume(
    session: &SessionId,
    secret: &[u8; 32],
    out: &mut Vec<u8>,
) -> Result<ClientResumeSent, Error> {
    let sent = ClientResumeSent {
        session: *session,
        secret: *secret,
        ephemeral: crate::suite::ephemeral()?,
    };
    let mut msg = [0u8; MAX_HANDSHAKE_MSG];
    let (_, pre, n) = sent.write_first(&mut msg)?;
    out.extend_from_slice(&pre);
    put_msg(out, &msg[..n]);
    Ok(sent)
}

impl ClientResumeSent {
    /// The initiator's handshake state after message 1 (written to `msg`,
    /// `n` bytes), with the preamble it is bound to. Deterministic for one
    /// `ClientResumeSent`: the same message every time.
    fn write_first(
        &self,
        msg: &mut [u8; MAX_HANDSHAKE_MSG],
    ) -> Result<(snow::HandshakeState, Vec<u8>, usize), Error> {
        let pre = preamble(KIND_RESUME, Some(&self.session));
        // The ephemeral key is set rather than drawn by snow so that the
        // reply can be read by a state rebuilt from these 80 bytes
        // (snow names the setter for its test vectors; used here for one
        // handshake per fresh key, it is what snow would have drawn).
        let mut hs = crate::suite::noise(PATTERN_RESUME)
            .map_err(noise_err)?
            .psk(0, &self.secret)
            .and_then(|b| b.prologue(&pre))
            .map(|b| b.fixed_ephemeral_key_for_testing_only(&self.ephemeral))
            .and_then(|b| b.build_initiator())
            .map_err(noise_err)?;
        let n = hs.write_message(&[], msg).map_err(noise_err)?;
        Ok((hs, pre, n))
    }
}

/// Parses the server's reply header and handshake message from `buf`.
/// `Ok(None)`: incomplete. On success returns the message and bytes consumed.
fn server_reply(buf: &[u8]) -> Result<Option<(&[u8], usize)>, Error> {
    let n = buf.len().min(4);
    if buf[..n] != MAGIC[..n] {
        return Err(Error::NotRoam);
    }
    if buf.len() < 6 {
        return Ok(None);
    }
    if buf[5] == Status::Moved as u8 {
        return match take_addr(&buf[6..])? {
            Some(addr) => Err(Error::Moved(addr)),
            None => Ok(None),
        };
    }
    if buf[5] != Status::Ok as u8 {
        return Err(Status::error(buf[5]));
    }
    if buf[4] != VERSION {
        return Err(Error::UnsupportedVersion);
    }
    Ok(take_msg(&buf[6..])?.map(|(m, used)| (m, used + 6)))
}

/// What the client learned from a completed new-session handshake.
pub(crate) struct ClientNewDone {
    pub(crate) keys: Established,
    pub(crate) server_key: PublicKey,
    pub(crate) server_params: Params,
    pub(crate) consumed: usize,
}

impl ClientNewSent {
    /// Consumes the server's reply from `buf` (if complete) and appends message 3.
    /// Returns `Err(self)` inside `Ok` when more bytes are needed.
    pub(crate) fn read_reply(
        mut self,
        buf: &[u8],
        params: &Params,
        out: &mut Vec<u8>,
    ) -> Result<Result<ClientNewDone, Self>, Error> {
        let Some((msg, consumed)) = server_reply(buf)? else {
            return Ok(Err(self));
        };
        let mut payload = [0u8; MAX_HANDSHAKE_MSG];
        let n = self.hs.read_message(msg, &mut payload).map_err(noise_err)?;
        let mut r = Reader::new(&payload[..n]);
        if r.u8()? != VERSION {
            return Err(Error::UnsupportedVersion);
        }
        let server_params = Params::decode(&mut r)?;
        r.finish()?;
        let server_key = remote_static(&self.hs)?;
        let mut mine = Vec::new();
        params.encode(&mut mine);
        let mut msg3 = [0u8; MAX_HANDSHAKE_MSG];
        let n = self.hs.write_message(&mine, &mut msg3).map_err(noise_err)?;
        put_msg(out, &msg3[..n]);
        Ok(Ok(ClientNewDone {
            keys: established(self.hs),
            server_key,
            server_params,
            consumed,
        }))
    }
}

impl ClientResumeSent {
    /// Consumes the server's resume reply; returns the keys, the count of our
    /// reliable frames the server holds, and bytes consumed.
    pub(crate) fn read_reply(
        self,
        buf: &[u8],
    ) -> Result<Result<(Established, u64, usize), Self>, Error> {
        let Some((msg, consumed)) = server_reply(buf)? else {
            return Ok(Err(self));
        };
        let mut payload = [0u8; MAX_HANDSHAKE_MSG];
        let (mut hs, _, _) = self.write_first(&mut payload)?;
        let n = hs.read_message(msg, &mut payload).map_err(noise_err)?;
        let mut r = Reader::new(&payload[..n]);
        if r.u8()? != VERSION {
            return Err(Error::UnsupportedVersion);
        }
        let received = r.varint()?;
        r.finish()?;
        Ok(Ok((established(hs), received, consumed)))
    }
}

fn remote_static(hs: &snow::HandshakeState) -> Result<PublicKey, Error> {
    let rs = hs.get_remote_static().ok_or(Error::HandshakeFailed)?;
    Ok(PublicKey(
        rs.try_into().map_err(|_| Error::HandshakeFailed)?,
    ))
}

// ---------------------------------------------------------------- server side

/// The client's opening, parsed by [`parse_hello`].
#[derive(Debug, Clone)]
pub struct Hello {
    preamble: Vec<u8>,
    msg1: Vec<u8>,
    session: Option<SessionId>,
    version_ok: bool,
}

impl Hello {
    /// The session a resume names, or `None` for a new session.
    pub fn resume_session(&self) -> Option<SessionId> {
        self.session
    }

    /// Whether the client offered a version this server speaks. If not, answer
    /// with [`Hello::reject`] and [`Status::UnsupportedVersion`].
    pub fn version_supported(&self) -> bool {
        self.version_ok
    }

    /// Appends a refusal with `status` to `out`; the caller then closes the transport.
    pub fn reject(&self, status: Status, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[0, status as u8]);
    }

    /// The refusal that tells the client why its transport is refused
    /// (the status of [`Error::refusal_status`]); write it, then close.
    pub fn refusal(&self, error: &Error) -> Vec<u8> {
        let mut out = Vec::with_capacity(6);
        self.reject(error.refusal_status(), &mut out);
        out
    }

    /// The `Moved` refusal (§9.3): the session this resume names lives at
    /// `addr` (`host:port` of another host of the service); the client
    /// resumes there at once. Write it, then close. `None` if `addr` is
    /// empty or longer than [`MAX_MOVED_ADDR`].
    pub fn redirect(&self, addr: &str) -> Option<Vec<u8>> {
        if addr.is_empty() || addr.len() > MAX_MOVED_ADDR {
            return None;
        }
        let mut out = Vec::with_capacity(8 + addr.len());
        self.reject(Status::Moved, &mut out);
        out.extend_from_slice(&(addr.len() as u16).to_be_bytes());
        out.extend_from_slice(addr.as_bytes());
        Some(out)
    }

    /// The client's ephemeral key, which identifies this exact resume message.
    pub(crate) fn ephemeral(&self) -> Option<[u8; 32]> {
        self.msg1.get(..32).and_then(|e| e.try_into().ok())
    }
}

/// Parses a client's opening from the start of `buf`. `Ok(None)`: need more bytes.
/// On success returns the hello and how many bytes it used.
pub fn parse_hello(buf: &[u8]) -> Result<Option<(Hello, usize)>, Error> {
    let n = buf.len().min(4);
    if buf[..n] != MAGIC[..n] {
        return Err(Error::NotRoam);
    }
    if buf.len() < 7 {
        return Ok(None);
    }
    let (min, max, kind) = (buf[4], buf[5], buf[6]);
    let head = match kind {
        KIND_NEW => 7,
        KIND_RESUME => 23,
        _ => return Err(Error::ProtocolViolation("unknown transport kind")),
    };
    if buf.len() < head {
        return Ok(None);
    }
    let Some((msg1, used)) = take_msg(&buf[head..])? else {
        return Ok(None);
    };
    let session = (kind == KIND_RESUME).then(|| {
        let mut id = [0u8; 16];
        id.copy_from_slice(&buf[7..23]);
        SessionId(id)
    });
    let hello = Hello {
        preamble: buf[..head].to_vec(),
        msg1: msg1.to_vec(),
        session,
        version_ok: min <= VERSION && VERSION <= max,
    };
    Ok(Some((hello, head + used)))
}

/// Server: XX message 2 sent, waiting for message 3.
pub(crate) struct ServerNewSent {
    hs: snow::HandshakeState,
}

/// Answers a new-session hello; appends the reply to `out`.
pub(crate) fn server_new(
    hello: &Hello,
    keypair: &Keypair,
    params: &Params,
    out: &mut Vec<u8>,
) -> Result<ServerNewSent, Error> {
    let private = keypair.private_bytes();
    let mut hs = crate::suite::noise(PATTERN_NEW)
        .map_err(noise_err)?
        .local_private_key(&private)
        .and_then(|b| b.prologue(&hello.preamble))
        .and_then(|b| b.build_responder())
        .map_err(noise_err)?;
    let mut scratch = [0u8; MAX_HANDSHAKE_MSG];
    hs.read_message(&hello.msg1, &mut scratch)
        .map_err(noise_err)?;
    let mut payload = vec![VERSION];
    params.encode(&mut payload);
    let n = hs
        .write_message(&payload, &mut scratch)
        .map_err(noise_err)?;
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, Status::Ok as u8]);
    put_msg(out, &scratch[..n]);
    Ok(ServerNewSent { hs })
}

/// What the server learned from message 3: keys, the client's proven key,
/// its params, and bytes consumed.
pub(crate) type ServerNewDone = (Established, PublicKey, Params, usize);

impl ServerNewSent {
    /// Consumes message 3 from `buf`: the client's static key and params.
    pub(crate) fn read_msg3(mut self, buf: &[u8]) -> Result<Result<ServerNewDone, Self>, Error> {
        let Some((msg, consumed)) = take_msg(buf)? else {
            return Ok(Err(self));
        };
        let mut payload = [0u8; MAX_HANDSHAKE_MSG];
        let n = self.hs.read_message(msg, &mut payload).map_err(noise_err)?;
        let mut r = Reader::new(&payload[..n]);
        let params = Params::decode(&mut r)?;
        r.finish()?;
        let client = remote_static(&self.hs)?;
        Ok(Ok((established(self.hs), client, params, consumed)))
    }
}

/// Answers a resume hello for a session whose secret is `secret`; appends the
/// reply (carrying `received`, our count of the client's reliable frames).
/// Fails with [`Error::ResumeRejected`] if the client does not know the secret.
pub(crate) fn server_resume(
    hello: &Hello,
    secret: &[u8; 32],
    received: u64,
    out: &mut Vec<u8>,
) -> Result<Established, Error> {
    let mut hs = crate::suite::noise(PATTERN_RESUME)
        .map_err(noise_err)?
        .psk(0, secret)
        .and_then(|b| b.prologue(&hello.preamble))
        .and_then(|b| b.build_responder())
        .map_err(noise_err)?;
    let mut scratch = [0u8; MAX_HANDSHAKE_MSG];
    hs.read_message(&hello.msg1, &mut scratch)
        .map_err(|_| Error::ResumeRejected)?;
    let mut payload = vec![VERSION];
    put_varint(&mut payload, received);
    let n = hs
        .write_message(&payload, &mut scratch)
        .map_err(noise_err)?;
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, Status::Ok as u8]);
    put_msg(out, &scratch[..n]);
    Ok(established(hs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resume attempt draws its own ephemeral key, so two attempts of one
    /// session open differently (a recorded opening tells nothing of the
    /// next); and the state rebuilt to read the server's reply is the one
    /// that wrote the opening: rebuilt, it writes the same bytes again.
    #[test]
    fn each_resume_attempt_has_its_own_ephemeral_and_rebuilds_its_opening() {
        let (id, secret) = (SessionId([7; 16]), [9u8; 32]);
        let (mut first, mut second) = (Vec::new(), Vec::new());
        let attempt = client_resume(&id, &secret, &mut first).unwrap();
        client_resume(&id, &secret, &mut second).unwrap();
        assert_ne!(first, second, "two attempts sent the same opening");
        for _ in 0..2 {
            let mut msg = [0u8; MAX_HANDSHAKE_MSG];
            let (_, pre, n) = attempt.write_first(&mut msg).unwrap();
            let mut again = pre;
            put_msg(&mut again, &msg[..n]);
            assert_eq!(again, first, "the rebuilt handshake is not the one sent");
        }
    }
}
