//! A chunk store reached through a roam session: `roam store serve` (the
//! server, in front of a directory or an S3 bucket) and [`RemoteBackend`]
//! (the client's third [`ChunkBackend`], `--store roam://HOST:PORT`).
//!
//! Design: each backend operation is one stream of the client's session,
//! opened with the metadata [`STREAM_META`]: the client writes one
//! [`Request`] frame and finishes its direction, the server answers with one
//! [`Response`] frame and finishes its own. Concurrent operations (a
//! restore's fetch window) are concurrent streams; the roam session under
//! them resumes after a network drop and retransmits what was lost, so an
//! operation in flight completes once the network is back. Every operation
//! is bounded by the client's timeout (`--store-timeout`): a store server
//! unreachable for longer is an error naming it, not a hang.
//!
//! Security: the session is Noise-authenticated both ways: the client pins
//! the server's key (first use, then `known_servers`, as for `roam pipe`)
//! and the server admits only the client keys in its `--authorized-keys`
//! file (or any, with `--any-client`). The server only relays the opaque
//! objects [`roam_store::Store`] sealed on the client: it never sees the
//! user's secret or a byte of plaintext.
//!
//! The frames are specified in `docs/STORE-REMOTE.md`.
//!
//! Non-goals: pipelining several operations on one stream (streams are
//! cheap), partial reads of an object, and a server that is itself a client
//! of another store server.

use std::sync::Arc;
use std::time::Duration;

use roam_store::{check_name, BackendError, ChunkBackend, MAX_CHUNK_OBJECT_LEN, MAX_MANIFEST_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::cli::{CliError, CliResult, StoreServeArgs};
use crate::config::FileConfig;

/// The metadata a store stream opens with (the protocol and its version).
pub(crate) const STREAM_META: &[u8] = b"roam-store/1";

/// `roam store serve`'s default listening address.
pub(crate) const DEFAULT_LISTEN: &str = "0.0.0.0:7449";

/// The client's default bound on one operation, connecting included.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Operations one session may have in progress on the server; further
/// streams wait for a slot.
const MAX_REQUESTS_PER_SESSION: usize = 64;

/// How long the server waits for a whole request to arrive (a client whose
/// session is suspended may take this long to send it), seconds.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(600);

/// A server's suspended session with no open stream is dropped after this
/// long: a client that exited without closing its session (killed, or its
/// network gone at the end) costs nothing for longer.
const IDLE_SESSION_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a client waits at the end of a command for the server to
/// acknowledge the close of its session (one round trip when connected).
const CLOSE_WAIT: Duration = Duration::from_secs(3);

/// Longest object a request may carry: a sealed manifest, the largest kind.
const MAX_OBJECT_LEN: u64 = if MAX_MANIFEST_LEN > MAX_CHUNK_OBJECT_LEN {
    MAX_MANIFEST_LEN
} else {
    MAX_CHUNK_OBJECT_LEN
};

/// Bytes of a frame around its object or names (op, lengths, counts).
const FRAME_OVERHEAD: u64 = 1024;

/// Longest list response, bytes: some 900,000 names (over 100 GiB of
/// chunks). A longer listing is refused, never read without bound.
pub(crate) const MAX_LIST_BYTES: u64 = 64 << 20;

/// Longest message of an error response, bytes.
const MAX_MESSAGE_LEN: usize = 1024;

/// The request op codes (docs/STORE-REMOTE.md §Requests).
mod op {
    /// Store the object unless one of that name exists.
    pub(super) const PUT_IF_ABSENT: u8 = 1;
    /// The object's bytes, up to a maximum length.
    pub(super) const GET: u8 = 2;
    /// Whether the object exists.
    pub(super) const EXISTS: u8 = 3;
    /// The names under a prefix.
    pub(super) const LIST: u8 = 4;
    /// Delete the object.
    pub(super) const DELETE: u8 = 5;
}

/// The response status codes (docs/STORE-REMOTE.md §Responses).
mod status {
    /// A yes/no answer (put, exists, delete).
    pub(super) const BOOL: u8 = 0x00;
    /// An object's bytes (get).
    pub(super) const BYTES: u8 = 0x01;
    /// A list of names (list).
    pub(super) const NAMES: u8 = 0x02;
    /// No object of that name.
    pub(super) const NOT_FOUND: u8 = 0x40;
    /// The object is longer than the request allowed.
    pub(super) const TOO_LARGE: u8 = 0x41;
    /// The name or prefix breaks the naming rules.
    pub(super) const INVALID_NAME: u8 = 0x42;
    /// The server's store failed (disk, S3): its message.
    pub(super) const FAILED: u8 = 0x43;
    /// The request was not a well-formed frame.
    pub(super) const BAD_REQUEST: u8 = 0x44;
}

/// One backend operation, as the client sends it (docs/STORE-REMOTE.md
/// §Requests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// [`ChunkBackend::put_if_absent`].
    PutIfAbsent {
        /// The object's name.
        name: String,
        /// Its (sealed) bytes.
        bytes: Vec<u8>,
    },
    /// [`ChunkBackend::get`].
    Get {
        /// The object's name.
        name: String,
        /// The longest object the client accepts.
        max_len: u64,
    },
    /// [`ChunkBackend::exists`].
    Exists {
        /// The object's name.
        name: String,
    },
    /// [`ChunkBackend::list`].
    List {
        /// The prefix (empty, or a name and `/`).
        prefix: String,
    },
    /// [`ChunkBackend::delete`].
    Delete {
        /// The object's name.
        name: String,
    },
}

/// The server's answer to one [`Request`] (docs/STORE-REMOTE.md
/// §Responses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    /// Put: whether it wrote; exists: whether there is one; delete:
    /// whether there was one.
    Bool(bool),
    /// Get: the object's bytes.
    Bytes(Vec<u8>),
    /// List: the names, sorted.
    Names(Vec<String>),
    /// No object of that name.
    NotFound,
    /// The object is `len` bytes (as far as known), over the `max` allowed.
    TooLarge {
        /// Its length as far as known.
        len: u64,
        /// The most the request allowed.
        max: u64,
    },
    /// The name or prefix breaks the naming rules.
    InvalidName,
    /// The server's store failed; its description.
    Failed(String),
    /// The request was not a well-formed frame; what was wrong.
    BadRequest(String),
}

/// Why a frame does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The frame ends before a field does.
    Short,
    /// Bytes follow the frame's last field.
    Trailing,
    /// An unknown op or status code.
    UnknownCode(u8),
    /// A name or message is not UTF-8.
    NotUtf8,
    /// A length beyond the protocol's limits.
    TooLong(u64),
    /// A yes/no byte other than 0 or 1.
    BadBool(u8),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Short => f.write_str("the frame is cut short"),
            FrameError::Trailing => f.write_str("bytes follow the frame"),
            FrameError::UnknownCode(c) => write!(f, "unknown code {c:#04x}"),
            FrameError::NotUtf8 => f.write_str("a name or message is not UTF-8"),
            FrameError::TooLong(n) => write!(f, "a length of {n} is beyond the limits"),
            FrameError::BadBool(b) => write!(f, "a yes/no byte of {b:#04x}"),
        }
    }
}

/// Reads a frame's fields front to back.
struct Reader<'a> {
    /// What is left.
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.rest.len() < n {
            return Err(FrameError::Short);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    /// One byte.
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    /// A big-endian u16.
    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    /// A big-endian u32.
    fn u32(&mut self) -> Result<u32, FrameError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A big-endian u64.
    fn u64(&mut self) -> Result<u64, FrameError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
    /// A u16-length-prefixed UTF-8 string of at most `max` bytes.
    fn text(&mut self, max: usize) -> Result<String, FrameError> {
        let len = usize::from(self.u16()?);
        if len > max {
            return Err(FrameError::TooLong(len as u64));
        }
        let b = self.take(len)?;
        String::from_utf8(b.to_vec()).map_err(|_| FrameError::NotUtf8)
    }
    /// A u32-length-prefixed byte string of at most `max` bytes.
    fn bytes(&mut self, max: u64) -> Result<Vec<u8>, FrameError> {
        let len = self.u32()?;
        if u64::from(len) > max {
            return Err(FrameError::TooLong(len.into()));
        }
        Ok(self.take(len as usize)?.to_vec())
    }
    /// A yes/no byte.
    fn bool(&mut self) -> Result<bool, FrameError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(FrameError::BadBool(b)),
        }
    }
    /// Ends the frame: nothing may follow.
    fn end(self) -> Result<(), FrameError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Trailing)
        }
    }
}

/// Appends a u16-length-prefixed string (cut at `u16::MAX` bytes, on a
/// character boundary).
fn put_text(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(usize::from(u16::MAX));
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_be_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// Appends a u32-length-prefixed byte string (callers keep it under the
/// limits, far below `u32::MAX`).
fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

impl Request {
    /// The frame's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Request::PutIfAbsent { name, bytes } => {
                out.push(op::PUT_IF_ABSENT);
                put_text(&mut out, name);
                put_bytes(&mut out, bytes);
            }
            Request::Get { name, max_len } => {
                out.push(op::GET);
                put_text(&mut out, name);
                out.extend_from_slice(&max_len.to_be_bytes());
            }
            Request::Exists { name } => {
                out.push(op::EXISTS);
                put_text(&mut out, name);
            }
            Request::List { prefix } => {
                out.push(op::LIST);
                put_text(&mut out, prefix);
            }
            Request::Delete { name } => {
                out.push(op::DELETE);
                put_text(&mut out, name);
            }
        }
        out
    }

    /// Decodes one whole frame (trailing bytes are an error). Names are
    /// checked for length and UTF-8 only; the backend checks the rest.
    pub(crate) fn decode(frame: &[u8]) -> Result<Request, FrameError> {
        let mut r = Reader { rest: frame };
        let code = r.u8()?;
        let name = r.text(roam_store::MAX_NAME_LEN + 1)?;
        let req = match code {
            op::PUT_IF_ABSENT => Request::PutIfAbsent {
                name,
                bytes: r.bytes(MAX_OBJECT_LEN)?,
            },
            op::GET => Request::Get {
                name,
                max_len: r.u64()?,
            },
            op::EXISTS => Request::Exists { name },
            op::LIST => Request::List { prefix: name },
            op::DELETE => Request::Delete { name },
            c => return Err(FrameError::UnknownCode(c)),
        };
        r.end()?;
        Ok(req)
    }

    /// The op's name, for messages.
    fn op(&self) -> &'static str {
        match self {
            Request::PutIfAbsent { .. } => "put",
            Request::Get { .. } => "get",
            Request::Exists { .. } => "exists",
            Request::List { .. } => "list",
            Request::Delete { .. } => "delete",
        }
    }

    /// The object's name (the prefix, for a listing).
    fn name(&self) -> &str {
        match self {
            Request::PutIfAbsent { name, .. }
            | Request::Get { name, .. }
            | Request::Exists { name }
            | Request::Delete { name } => name,
            Request::List { prefix } => prefix,
        }
    }

    /// The longest response the client reads for this request.
    fn max_response(&self) -> u64 {
        match self {
            Request::Get { max_len, .. } => max_len.saturating_add(FRAME_OVERHEAD),
            Request::List { .. } => MAX_LIST_BYTES,
            _ => FRAME_OVERHEAD + MAX_MESSAGE_LEN as u64,
        }
    }
}

impl Response {
    /// The frame's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Response::Bool(b) => {
                out.push(status::BOOL);
                out.push(u8::from(*b));
            }
            Response::Bytes(b) => {
                out.push(status::BYTES);
                put_bytes(&mut out, b);
            }
            Response::Names(names) => {
                out.push(status::NAMES);
                out.extend_from_slice(&(names.len() as u32).to_be_bytes());
                for n in names {
                    put_text(&mut out, n);
                }
            }
            Response::NotFound => out.push(status::NOT_FOUND),
            Response::TooLarge { len, max } => {
                out.push(status::TOO_LARGE);
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(&max.to_be_bytes());
            }
            Response::InvalidName => out.push(status::INVALID_NAME),
            Response::Failed(m) => {
                out.push(status::FAILED);
                put_text(&mut out, &m[..floor_char(m, MAX_MESSAGE_LEN)]);
            }
            Response::BadRequest(m) => {
                out.push(status::BAD_REQUEST);
                put_text(&mut out, &m[..floor_char(m, MAX_MESSAGE_LEN)]);
            }
        }
        out
    }

    /// Decodes one whole frame (trailing bytes are an error).
    pub(crate) fn decode(frame: &[u8]) -> Result<Response, FrameError> {
        let mut r = Reader { rest: frame };
        let resp = match r.u8()? {
            status::BOOL => Response::Bool(r.bool()?),
            status::BYTES => Response::Bytes(r.bytes(u64::from(u32::MAX))?),
            status::NAMES => {
                let count = r.u32()?;
                // Each name takes at least its 2-byte length: a count the
                // frame cannot hold is refused before allocating for it.
                if u64::from(count) * 2 > r.rest.len() as u64 {
                    return Err(FrameError::Short);
                }
                let mut names = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    names.push(r.text(roam_store::MAX_NAME_LEN + 1)?);
                }
                Response::Names(names)
            }
            status::NOT_FOUND => Response::NotFound,
            status::TOO_LARGE => Response::TooLarge {
                len: r.u64()?,
                max: r.u64()?,
            },
            status::INVALID_NAME => Response::InvalidName,
            status::FAILED => Response::Failed(r.text(MAX_MESSAGE_LEN)?),
            status::BAD_REQUEST => Response::BadRequest(r.text(MAX_MESSAGE_LEN)?),
            c => return Err(FrameError::UnknownCode(c)),
        };
        r.end()?;
        Ok(resp)
    }
}

/// The largest char boundary of `s` at or below `max`.
fn floor_char(s: &str, max: usize) -> usize {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// Reads `r` to its end; more than `max` bytes is `Err(Some(len))`, an I/O
/// error `Err(None)` with the error.
async fn read_bounded(
    r: &mut (impl AsyncRead + Unpin),
    max: u64,
) -> Result<Vec<u8>, Result<u64, std::io::Error>> {
    let mut buf = Vec::new();
    let n = r
        .take(max.saturating_add(1))
        .read_to_end(&mut buf)
        .await
        .map_err(Err)?;
    if n as u64 > max {
        return Err(Ok(n as u64));
    }
    Ok(buf)
}

/// The client's backend: a store server at `roam://HOST:PORT`, over one
/// roam session (connected on first use, again if it ended).
pub(crate) struct RemoteBackend {
    /// `HOST:PORT`.
    addr: String,
    /// The bound on every operation, connecting included.
    timeout: Duration,
    /// For the client key and the known servers.
    config: FileConfig,
    /// The session, once connected.
    session: tokio::sync::Mutex<Option<roam::SessionHandle>>,
    /// An operation went unanswered for the whole timeout: the server is
    /// not answering, so [`RemoteBackend::close`] does not wait for it.
    unanswered: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for RemoteBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteBackend")
            .field("addr", &self.addr)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RemoteBackend {
    /// A client of the store server at `addr` (`HOST:PORT`); nothing is
    /// sent until the first operation.
    pub(crate) fn new(addr: String, timeout: Duration, config: &FileConfig) -> Self {
        RemoteBackend {
            addr,
            timeout,
            config: config.clone(),
            session: tokio::sync::Mutex::new(None),
            unanswered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The session, connecting (pinning the server's key on first use)
    /// unless one is open.
    async fn session(&self) -> Result<roam::SessionHandle, String> {
        let mut slot = self.session.lock().await;
        if let Some(s) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(s.clone());
        }
        let s = crate::connect::connect_store_server(&self.addr, &self.config)
            .await
            .map_err(|e| e.0)?;
        *slot = Some(s.clone());
        Ok(s)
    }

    /// Ends the session, if one is open, so that the server frees it at
    /// once instead of after [`IDLE_SESSION_TIMEOUT`]: a connected session
    /// is closed and its acknowledgement awaited (at most [`CLOSE_WAIT`]);
    /// a suspended one (the network is gone), or one whose server left an
    /// operation unanswered, is abandoned without waiting. Called once the
    /// command's last operation is done.
    pub(crate) async fn close(&self) {
        let Some(session) = self.session.lock().await.take() else {
            return;
        };
        let unanswered = self.unanswered.load(std::sync::atomic::Ordering::Relaxed);
        if session.stats().state == roam_proto::State::Active && !unanswered {
            let _ = tokio::time::timeout(CLOSE_WAIT, session.close(roam_proto::code::NO_ERROR, ""))
                .await;
        }
    }

    /// Sends `req` on a stream of its own and reads the answer.
    async fn exchange(&self, req: &Request) -> Result<Response, String> {
        let session = self.session().await?;
        let mut stream = session
            .open_stream(STREAM_META)
            .map_err(|e| format!("store server roam://{}: {e}", self.addr))?;
        let io = |e: std::io::Error| format!("store server roam://{}: {e}", self.addr);
        stream.write_all(&req.encode()).await.map_err(io)?;
        stream.shutdown().await.map_err(io)?;
        let frame = read_bounded(&mut stream, req.max_response())
            .await
            .map_err(|e| match e {
                Ok(len) => format!(
                    "store server roam://{} sent an answer of over {len} bytes",
                    self.addr
                ),
                Err(e) => io(e),
            })?;
        Response::decode(&frame).map_err(|e| {
            format!(
                "store server roam://{} sent an unreadable answer: {e}",
                self.addr
            )
        })
    }

    /// Runs `req` within the timeout; `Ok` is the server's answer, which
    /// may itself be an error.
    async fn call(&self, req: Request) -> Result<Response, BackendError> {
        let remote = |message: String| BackendError::Remote {
            op: req.op(),
            name: req.name().to_owned(),
            message,
        };
        let resp = match tokio::time::timeout(self.timeout, self.exchange(&req)).await {
            Ok(r) => r.map_err(remote)?,
            Err(_) => {
                self.unanswered
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                return Err(remote(format!(
                    "the store server roam://{} did not answer within {} s (unreachable, or the \
                     network is down); --store-timeout waits longer",
                    self.addr,
                    self.timeout.as_secs_f64()
                )));
            }
        };
        let name = req.name().to_owned();
        match resp {
            Response::NotFound => Err(BackendError::NotFound { name }),
            Response::TooLarge { len, max } => Err(BackendError::TooLarge { name, len, max }),
            Response::InvalidName => Err(BackendError::InvalidName { name }),
            Response::Failed(m) => Err(remote(format!(
                "the store server roam://{} failed: {m}",
                self.addr
            ))),
            Response::BadRequest(m) => Err(remote(format!(
                "the store server roam://{} refused the request: {m}",
                self.addr
            ))),
            ok => Ok(ok),
        }
    }

    /// An answer of the wrong kind for `req`.
    fn unexpected(&self, op: &'static str, name: &str) -> BackendError {
        BackendError::Remote {
            op,
            name: name.to_owned(),
            message: format!(
                "the store server roam://{} answered with the wrong kind of frame",
                self.addr
            ),
        }
    }

    /// A yes/no operation.
    async fn yes_no(&self, req: Request) -> Result<bool, BackendError> {
        let (op, name) = (req.op(), req.name().to_owned());
        match self.call(req).await? {
            Response::Bool(b) => Ok(b),
            _ => Err(self.unexpected(op, &name)),
        }
    }
}

impl ChunkBackend for RemoteBackend {
    async fn put_if_absent(&self, name: &str, bytes: Vec<u8>) -> Result<bool, BackendError> {
        check_name(name)?;
        self.yes_no(Request::PutIfAbsent {
            name: name.to_owned(),
            bytes,
        })
        .await
    }

    async fn get(&self, name: &str, max_len: u64) -> Result<Vec<u8>, BackendError> {
        check_name(name)?;
        let req = Request::Get {
            name: name.to_owned(),
            max_len,
        };
        match self.call(req).await? {
            Response::Bytes(b) if b.len() as u64 <= max_len => Ok(b),
            Response::Bytes(b) => Err(BackendError::TooLarge {
                name: name.to_owned(),
                len: b.len() as u64,
                max: max_len,
            }),
            _ => Err(self.unexpected("get", name)),
        }
    }

    async fn exists(&self, name: &str) -> Result<bool, BackendError> {
        check_name(name)?;
        self.yes_no(Request::Exists {
            name: name.to_owned(),
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, BackendError> {
        let req = Request::List {
            prefix: prefix.to_owned(),
        };
        match self.call(req).await? {
            Response::Names(names) => {
                // Names this store could not have written are ignored, as
                // the S3 backend ignores foreign keys.
                let mut names: Vec<String> = names
                    .into_iter()
                    .filter(|n| check_name(n).is_ok() && n.starts_with(prefix))
                    .collect();
                names.sort();
                names.dedup();
                Ok(names)
            }
            _ => Err(self.unexpected("list", prefix)),
        }
    }

    async fn delete(&self, name: &str) -> Result<bool, BackendError> {
        check_name(name)?;
        self.yes_no(Request::Delete {
            name: name.to_owned(),
        })
        .await
    }
}

/// A backend error as the answer to send.
fn error_response(e: BackendError) -> Response {
    match e {
        BackendError::NotFound { .. } => Response::NotFound,
        BackendError::TooLarge { len, max, .. } => Response::TooLarge { len, max },
        BackendError::InvalidName { .. } => Response::InvalidName,
        e => Response::Failed(e.to_string()),
    }
}

/// Runs one request against the server's backend.
async fn answer(backend: &impl ChunkBackend, req: Request) -> Response {
    let r = match req {
        Request::PutIfAbsent { name, bytes } => backend
            .put_if_absent(&name, bytes)
            .await
            .map(Response::Bool),
        Request::Get { name, max_len } => backend.get(&name, max_len).await.map(Response::Bytes),
        Request::Exists { name } => backend.exists(&name).await.map(Response::Bool),
        Request::List { prefix } => match backend.list(&prefix).await {
            Ok(names) => {
                let len: u64 = names.iter().map(|n| 2 + n.len() as u64).sum();
                if len + FRAME_OVERHEAD > MAX_LIST_BYTES {
                    Ok(Response::Failed(format!(
                        "{} objects under {prefix:?}: a listing over {MAX_LIST_BYTES} bytes",
                        names.len()
                    )))
                } else {
                    Ok(Response::Names(names))
                }
            }
            Err(e) => Err(e),
        },
        Request::Delete { name } => backend.delete(&name).await.map(Response::Bool),
    };
    r.unwrap_or_else(error_response)
}

/// Serves one stream: one request, one answer.
async fn serve_stream(backend: &impl ChunkBackend, mut stream: roam::RoamStream) {
    let read = tokio::time::timeout(
        REQUEST_READ_TIMEOUT,
        read_bounded(&mut stream, MAX_OBJECT_LEN + FRAME_OVERHEAD),
    )
    .await;
    let resp = match read {
        Err(_) | Ok(Err(Err(_))) => {
            // Too slow, or the stream or session ended: nobody to answer.
            stream.reset(roam_proto::code::NO_ERROR);
            return;
        }
        Ok(Err(Ok(len))) => Response::BadRequest(format!("a request of over {len} bytes")),
        Ok(Ok(frame)) => match Request::decode(&frame) {
            Ok(req) => answer(backend, req).await,
            Err(e) => Response::BadRequest(e.to_string()),
        },
    };
    if stream.write_all(&resp.encode()).await.is_ok() {
        let _ = stream.shutdown().await;
    }
}

/// Serves one session's streams until it ends.
async fn serve_session<B: ChunkBackend + 'static>(backend: Arc<B>, session: roam::SessionHandle) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_REQUESTS_PER_SESSION));
    while let Ok((mut stream, meta)) = session.accept_stream().await {
        if meta != STREAM_META {
            stream.reset(roam_proto::code::NO_ERROR);
            continue;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let backend = backend.clone();
        tokio::spawn(async move {
            serve_stream(&*backend, stream).await;
            drop(permit);
        });
    }
}

/// `roam store serve`.
pub(crate) async fn serve(args: StoreServeArgs, config: &FileConfig) -> CliResult {
    let location = crate::cli::StoreLocationArgs {
        store: args.store,
        s3_endpoint: args.s3_endpoint,
        secret: None,
        store_timeout: None,
    };
    let (backend, desc) = match crate::store::open_backend(&location, config) {
        Ok(b) => b,
        Err(code) => return code,
    };
    let state = crate::paths::state_dir(config);
    let key_path = args.key.unwrap_or_else(|| state.join("server.key"));
    let keypair = crate::keys::load_or_create(&key_path)?;
    let authorized = match &args.authorized_keys {
        Some(p) => Some(Arc::new(crate::keys::read_authorized(p)?)),
        None => None,
    };
    let listen = args.listen.unwrap_or_else(|| DEFAULT_LISTEN.to_string());
    let listener = tokio::net::TcpListener::bind(&listen).await.map_err(|e| {
        CliError(format!(
            "cannot listen on {listen}: {e}; choose another address with --listen"
        ))
    })?;
    let local = listener
        .local_addr()
        .map_or(listen.clone(), |a| a.to_string());
    let public = keypair.public();
    let server = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: authorized.clone(),
        addresses: Vec::new(),
        session: roam_proto::Config {
            idle_resume_timeout: Some(IDLE_SESSION_TIMEOUT),
            ..Default::default()
        },
    });
    eprintln_whole!(
        "roam store serve: listening on {local}; server key {public}; store {desc}; clients: {}",
        authorized
            .as_ref()
            .map_or("any key".to_string(), |k| format!(
                "{} authorized keys",
                k.len()
            )),
    );
    // `roam status` (in this server's state directory) lists the sessions
    // it holds, a client's until that client closes it or it expires.
    let registry = crate::control::Registry::default();
    let _control = crate::control::start(config, format!("store serve {local}"), registry.clone());
    let backend = Arc::new(backend);
    let shutdown = async {
        crate::signals::exit_signal().await;
    };
    roam::serve(listener, server, shutdown, move |session| {
        let peer = session
            .stats()
            .peer_addr
            .map_or_else(|| "?".to_string(), |a| a.to_string());
        registry.add(format!("store client {peer}"), session.clone());
        tokio::spawn(serve_session(backend.clone(), session));
    })
    .await
    .map_err(|e| CliError(format!("store server on {local}: {e}")))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let requests = [
            Request::PutIfAbsent {
                name: "chunks/ab".into(),
                bytes: vec![1, 2, 3],
            },
            Request::Get {
                name: "manifests/e/1".into(),
                max_len: 77,
            },
            Request::Exists { name: "a".into() },
            Request::List { prefix: "".into() },
            Request::Delete { name: "x".into() },
        ];
        for r in requests {
            let bytes = r.encode();
            assert_eq!(Request::decode(&bytes), Ok(r.clone()));
            let mut long = bytes.clone();
            long.push(0);
            assert_eq!(Request::decode(&long), Err(FrameError::Trailing));
            assert_eq!(
                Request::decode(&bytes[..bytes.len() - 1]),
                Err(FrameError::Short)
            );
        }
        let responses = [
            Response::Bool(true),
            Response::Bytes(vec![9; 10]),
            Response::Names(vec!["a".into(), "b/c".into()]),
            Response::NotFound,
            Response::TooLarge { len: 5, max: 4 },
            Response::InvalidName,
            Response::Failed("disk".into()),
            Response::BadRequest("no".into()),
        ];
        for r in responses {
            assert_eq!(Response::decode(&r.encode()), Ok(r.clone()));
        }
        // A test vector: GET "a" max 16.
        assert_eq!(
            Request::Get {
                name: "a".into(),
                max_len: 16
            }
            .encode(),
            [2, 0, 1, b'a', 0, 0, 0, 0, 0, 0, 0, 16]
        );
        assert_eq!(Request::decode(&[9, 0, 0]), Err(FrameError::UnknownCode(9)));
        assert_eq!(Response::decode(&[0, 2]), Err(FrameError::BadBool(2)));
        // A count of names the frame cannot hold.
        assert_eq!(
            Response::decode(&[2, 0xff, 0xff, 0xff, 0xff]),
            Err(FrameError::Short)
        );
    }
}
