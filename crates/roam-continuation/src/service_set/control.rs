//! The control protocol between a service set's coordinator and its
//! members (`docs/SERVICE.md`, "Over real sockets"): the frames, and the
//! coordinator's end of one member's control socket ([`Control`]).
//!
//! A member answers every frame the coordinator sends it, in turn. A
//! coordinator that stops waiting for an answer (its bound passed: the
//! member is stopped, stuck, or its host overloaded) keeps the framing:
//! what it read of a frame stays in its input buffer, what it did not
//! write yet in its output buffer, and the answer is counted as owed. The
//! next wait first reads and drops the owed answers, so a member that
//! comes back answers the next request in step.

use std::io;
use std::time::Duration;

use roam_service::{Cut, Part};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::time::Instant;

use super::cut_error;

/// Member to coordinator, first: its role name.
pub(super) const HELLO: u8 = 1;
/// Coordinator to member, first: a fresh start (empty) or its part.
pub(super) const START: u8 = 2;
/// No byte moves on the member's channels until `THAW`.
pub(super) const FREEZE: u8 = 3;
/// Drain the readers and give the part.
pub(super) const CUT: u8 = 4;
/// Run again.
pub(super) const THAW: u8 = 5;
/// The session moved away: answer, then exit.
pub(super) const END: u8 = 6;
/// Done.
pub(super) const ACK: u8 = 7;
/// The member's part (an encoded one-part cut).
pub(super) const PART: u8 = 8;
/// No part, and why.
pub(super) const REFUSED: u8 = 9;
/// The member's channels are connected.
pub(super) const READY: u8 = 10;
/// Largest control frame (a part holds logs of up to the log cap).
const MAX_FRAME: usize = 256 << 20;
/// The least a read of the control socket asks room for, bytes.
const READ_AHEAD: usize = 4096;

/// How long a [`Control`] waits for a member's answer unless told
/// otherwise ([`Control::set_answer_timeout`]). A [`SessionSet`]'s save
/// has its own, shorter bound ([`DEFAULT_SAVE_TIMEOUT`]).
///
/// [`SessionSet`]: super::SessionSet
/// [`DEFAULT_SAVE_TIMEOUT`]: super::DEFAULT_SAVE_TIMEOUT
pub const DEFAULT_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// The frame type's name, for errors.
fn frame_name(kind: u8) -> &'static str {
    match kind {
        HELLO => "HELLO",
        START => "START",
        FREEZE => "FREEZE",
        CUT => "CUT",
        THAW => "THAW",
        END => "END",
        ACK => "ACK",
        PART => "PART",
        REFUSED => "REFUSED",
        READY => "READY",
        _ => "an unknown frame",
    }
}

/// Appends one frame to `out`.
fn frame(out: &mut Vec<u8>, kind: u8, body: &[u8]) {
    out.extend_from_slice(&(body.len() as u32 + 1).to_be_bytes());
    out.push(kind);
    out.extend_from_slice(body);
}

/// A frame's length field (type byte included), checked.
fn frame_len(header: [u8; 4]) -> io::Result<usize> {
    let len = u32::from_be_bytes(header) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("control frame of {len} bytes"),
        ));
    }
    Ok(len)
}

/// Whether a control socket's error says the member is gone (it exited
/// or was killed).
fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
    )
}

/// Sends one frame (a member's side: it never stops waiting halfway).
pub(super) async fn send(socket: &mut UnixStream, kind: u8, body: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(5 + body.len());
    frame(&mut out, kind, body);
    socket.write_all(&out).await
}

/// Receives one frame (a member's side); `None` when the socket closed
/// between frames.
pub(super) async fn recv(socket: &mut UnixStream) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut header = [0u8; 4];
    match socket.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = frame_len(header)?;
    let mut body = vec![0u8; len];
    socket.read_exact(&mut body).await?;
    let kind = body.remove(0);
    Ok(Some((kind, body)))
}

/// The coordinator's end of one member's control socket.
#[derive(Debug)]
pub struct Control {
    /// The socket.
    socket: UnixStream,
    /// The role the member named.
    pub role: String,
    /// Bytes read and not yet a whole frame: a wait cut short by its bound
    /// keeps what it read, so the next frame starts where it should.
    input: Vec<u8>,
    /// Frame bytes not written yet, kept for the same reason.
    output: Vec<u8>,
    /// Answers the member owes: one per frame sent whose answer was not
    /// read (its wait timed out), the current request's included while it
    /// waits. Read and dropped, in order, before the next answer.
    owed: usize,
    /// How long [`freeze`](Self::freeze), [`part`](Self::part),
    /// [`thaw`](Self::thaw), [`end`](Self::end) and
    /// [`ready`](Self::ready) wait for the member's answer.
    answer_timeout: Duration,
}

impl Control {
    /// Takes a member's `HELLO` and starts it: `part` is `None` for a fresh
    /// start, else its restarted part (from [`restart_parts`](super::restart_parts)).
    pub async fn accept(
        socket: UnixStream,
        part: impl FnOnce(&str) -> Option<Vec<u8>>,
    ) -> io::Result<Self> {
        let mut control = Control {
            socket,
            role: String::new(),
            input: Vec::new(),
            output: Vec::new(),
            owed: 0,
            answer_timeout: DEFAULT_ANSWER_TIMEOUT,
        };
        let deadline = Instant::now() + control.answer_timeout;
        let hello = tokio::time::timeout_at(deadline, control.next_frame()).await;
        control.role = match hello {
            Ok(Ok(Some((HELLO, body)))) => String::from_utf8_lossy(&body).into_owned(),
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HELLO from the member",
                ))
            }
            _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "expected HELLO")),
        };
        let body = part(&control.role).unwrap_or_default();
        frame(&mut control.output, START, &body);
        match tokio::time::timeout_at(deadline, control.flush()).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("member {} did not take its START", control.role),
                ))
            }
        }
        Ok(control)
    }

    /// How long this control waits for each of the member's answers
    /// ([`DEFAULT_ANSWER_TIMEOUT`] unless set).
    pub fn set_answer_timeout(&mut self, bound: Duration) {
        self.answer_timeout = bound;
    }

    /// Whether the member owes answers to frames whose wait timed out (it
    /// was stopped, stuck or slow): a member that comes back answers them
    /// first, and the next request's wait drops them.
    pub fn owes_answers(&self) -> bool {
        self.owed > 0
    }

    /// The next whole frame, `None` if the member closed the socket
    /// between frames. Cancel-safe: bytes read stay in `input`.
    async fn next_frame(&mut self) -> io::Result<Option<(u8, Vec<u8>)>> {
        loop {
            let want = if self.input.len() >= 4 {
                let len = frame_len(self.input[..4].try_into().expect("four bytes"))?;
                if self.input.len() >= 4 + len {
                    let kind = self.input[4];
                    let body = self.input[5..4 + len].to_vec();
                    self.input.drain(..4 + len);
                    return Ok(Some((kind, body)));
                }
                4 + len - self.input.len()
            } else {
                4 - self.input.len()
            };
            self.input.reserve(want.max(READ_AHEAD));
            if self.socket.read_buf(&mut self.input).await? == 0 {
                if self.input.is_empty() {
                    return Ok(None);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "its control socket closed in the middle of a frame",
                ));
            }
        }
    }

    /// Writes what `output` holds. Cancel-safe: what is not written stays.
    async fn flush(&mut self) -> io::Result<()> {
        while !self.output.is_empty() {
            let n = self.socket.write(&self.output).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            self.output.drain(..n);
        }
        Ok(())
    }

    /// Sends `kind` and waits until `deadline` for its answer, first
    /// dropping the answers owed to earlier frames. `bound` is what the
    /// caller allowed (for the error).
    pub(super) async fn ask_by(
        &mut self,
        kind: u8,
        deadline: Instant,
        bound: Duration,
    ) -> io::Result<(u8, Vec<u8>)> {
        frame(&mut self.output, kind, &[]);
        self.owed += 1;
        let answer = async {
            self.flush().await?;
            loop {
                match self.next_frame().await? {
                    None => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "it closed its control socket",
                        ))
                    }
                    Some(answer) => {
                        self.owed -= 1;
                        if self.owed == 0 {
                            return Ok(answer);
                        }
                    }
                }
            }
        };
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Err(e)) if gone(&e) => Err(io::Error::new(
                e.kind(),
                format!("member {} is gone: {e}", self.role),
            )),
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "member {} did not answer {} within {bound:?}",
                    self.role,
                    frame_name(kind)
                ),
            )),
        }
    }

    /// Sends `kind` without waiting for its answer (owed from now on),
    /// giving up on the write at `deadline`: how a member that did not
    /// answer is thawed, so that it runs again once it answers.
    pub(super) async fn post_by(&mut self, kind: u8, deadline: Instant) -> io::Result<()> {
        frame(&mut self.output, kind, &[]);
        self.owed += 1;
        match tokio::time::timeout_at(deadline, self.flush()).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "could not send {} to member {}: its control socket is full",
                    frame_name(kind),
                    self.role
                ),
            )),
        }
    }

    /// Sends `kind` and expects `ACK` by `deadline`.
    pub(super) async fn ack_by(
        &mut self,
        kind: u8,
        deadline: Instant,
        bound: Duration,
    ) -> io::Result<()> {
        match self.ask_by(kind, deadline, bound).await? {
            (ACK, _) => Ok(()),
            (k, _) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "member {} answered {} instead of ACK",
                    self.role,
                    frame_name(k)
                ),
            )),
        }
    }

    /// The member's part by `deadline`; see [`part`](Self::part).
    pub(super) async fn part_by(
        &mut self,
        deadline: Instant,
        bound: Duration,
    ) -> io::Result<Result<Part, String>> {
        match self.ask_by(CUT, deadline, bound).await? {
            (PART, body) => {
                let cut = Cut::decode(&body).map_err(cut_error)?;
                match <[Part; 1]>::try_from(cut.parts) {
                    Ok([part]) => Ok(Ok(part)),
                    Err(_) => Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a member's part must be a one-part cut",
                    )),
                }
            }
            (REFUSED, why) => Ok(Err(String::from_utf8_lossy(&why).into_owned())),
            (k, _) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "member {} answered {} instead of its part",
                    self.role,
                    frame_name(k)
                ),
            )),
        }
    }

    /// The deadline of a wait starting now, and its bound.
    fn bound(&self) -> (Instant, Duration) {
        (Instant::now() + self.answer_timeout, self.answer_timeout)
    }

    /// Waits for the member's `READY` (its channels are connected).
    pub async fn ready(&mut self) -> io::Result<()> {
        let (deadline, bound) = self.bound();
        match tokio::time::timeout_at(deadline, self.next_frame()).await {
            Ok(Ok(Some((READY, _)))) => Ok(()),
            Ok(Ok(Some((k, _)))) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "member {} sent {} instead of READY",
                    self.role,
                    frame_name(k)
                ),
            )),
            Ok(Ok(None)) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "member {} closed its control socket before it was ready",
                    self.role
                ),
            )),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("member {} was not ready within {bound:?}", self.role),
            )),
        }
    }

    /// Stops the member's channel traffic.
    pub async fn freeze(&mut self) -> io::Result<()> {
        let (deadline, bound) = self.bound();
        self.ack_by(FREEZE, deadline, bound).await
    }

    /// Lets the member run again.
    pub async fn thaw(&mut self) -> io::Result<()> {
        let (deadline, bound) = self.bound();
        self.ack_by(THAW, deadline, bound).await
    }

    /// Tells the member its session moved away (it exits).
    pub async fn end(&mut self) -> io::Result<()> {
        let (deadline, bound) = self.bound();
        self.ack_by(END, deadline, bound).await
    }

    /// The member's part (it drains its readers first). `Ok(Err(reason))`
    /// when it cannot give one, e.g. its log is over the cap.
    pub async fn part(&mut self) -> io::Result<Result<Part, String>> {
        let (deadline, bound) = self.bound();
        self.part_by(deadline, bound).await
    }
}
