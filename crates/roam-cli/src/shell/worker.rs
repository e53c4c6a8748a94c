//! An attached shell's per-session process, `roam shell-worker`: Migrate's
//! *complete continuation* (§V-C). While a client is attached, the relay
//! starts one for the shell, from the argv, environment and working
//! directory it recorded when the shell started, and hands it the parked
//! resources: the pty master (as `SCM_RIGHTS` on its control socket) and
//! the terminal's packed image. The worker runs the terminal emulator,
//! reads the pty and writes what is typed; the relay only copies whole
//! client frames between the client's stream and the worker's stdout. When
//! the client goes, the worker sends the terminal image back and exits:
//! a parked shell is its pty and its process again, with no roam process of
//! its own.
//!
//! The worker's stdin is its control socket ([`Ctl`] frames, both ways),
//! its stdout the client's frames (`wire`, both ways), its stderr the
//! relay's log. Every chunk of output the worker reads from the pty goes to
//! the relay as a `Journal` frame *before* the worker uses it, so a worker
//! killed at any point (kill -9, a crash) loses no output: the relay's copy
//! (the image it started from, plus the journal) is the terminal, and a new
//! worker starts from it. What a killed worker loses is typed input it had
//! not written to the pty yet.

use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::host::{
    read_client, redraw, resize, write_out, Client, Pty, Sink, Terminal, IN_LIMIT, OUT_LIMIT,
};
use super::wire::{Attached, Frame, Framing};
use crate::cli::{CliError, CliResult, ShellWorkerArgs};

/// Largest control frame (a start carries the image: 5,000 lines of
/// scrollback redrawn, well under this).
pub(crate) const CTL_MAX: usize = 16 << 20;

/// What a worker is started with besides its pty.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StartHeader {
    /// The shell's name (for the `Attached` frame and the log).
    pub(crate) name: String,
    /// The shell was started for this client.
    pub(crate) new: bool,
    /// Send the scrollback before the screen (a re-attach), or only the
    /// screen (a restarted worker, or after a relay takeover).
    pub(crate) scrollback: bool,
    /// Send only the screen first, without an `Attached` frame: the same
    /// client, whose terminal may miss output (its session was suspended,
    /// or its last worker died with output journaled but not sent).
    #[serde(default)]
    pub(crate) quiet: bool,
    /// The client's window (0 × 0: keep the terminal's).
    pub(crate) rows: u16,
    pub(crate) cols: u16,
    /// The size the image was packed at.
    pub(crate) term_rows: u16,
    pub(crate) term_cols: u16,
}

/// A control frame between the relay and a worker: a kind byte, a payload
/// length (u32, little-endian, at most [`CTL_MAX`]), the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ctl {
    /// 1, relay → worker: header length u32, JSON [`StartHeader`], image
    /// length u32, the image, then the output since the image.
    Start {
        header: StartHeader,
        image: Vec<u8>,
        raw: Vec<u8>,
    },
    /// 2, worker → relay: output read from the pty, sent before it is used.
    Journal(Vec<u8>),
    /// 3, worker → relay: the terminal was resized (rows u16, cols u16).
    Resized { rows: u16, cols: u16 },
    /// 4, worker → relay: the client left; the terminal as the worker
    /// leaves it (rows u16, cols u16, the image).
    Image {
        rows: u16,
        cols: u16,
        image: Vec<u8>,
    },
    /// 5, worker → relay: the pty ended (the shell exited); the client has
    /// had all of its output.
    Closed,
    /// 6, relay → worker: send an `Image` now (the relay's journal has
    /// grown; the image replaces it).
    Checkpoint,
}

impl Ctl {
    /// Appends the frame's bytes to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; 5]);
        let kind = match self {
            Ctl::Start { header, image, raw } => {
                let h = serde_json::to_vec(header).expect("a header always serializes");
                out.extend_from_slice(&(h.len() as u32).to_le_bytes());
                out.extend_from_slice(&h);
                out.extend_from_slice(&(image.len() as u32).to_le_bytes());
                out.extend_from_slice(image);
                out.extend_from_slice(raw);
                1
            }
            Ctl::Journal(b) => {
                out.extend_from_slice(b);
                2
            }
            Ctl::Resized { rows, cols } => {
                out.extend_from_slice(&rows.to_le_bytes());
                out.extend_from_slice(&cols.to_le_bytes());
                3
            }
            Ctl::Image { rows, cols, image } => {
                out.extend_from_slice(&rows.to_le_bytes());
                out.extend_from_slice(&cols.to_le_bytes());
                out.extend_from_slice(image);
                4
            }
            Ctl::Closed => 5,
            Ctl::Checkpoint => 6,
        };
        let len = (out.len() - start - 5) as u32;
        out[start] = kind;
        out[start + 1..start + 5].copy_from_slice(&len.to_le_bytes());
    }
}

/// Splits the control socket's bytes into [`Ctl`] frames.
#[derive(Debug, Default)]
pub(crate) struct CtlDecoder {
    frames: Framing,
}

impl CtlDecoder {
    /// Adds received bytes.
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.frames.push(data);
    }

    /// The next complete frame, `None` if more bytes are needed, or why the
    /// bytes are not a control frame.
    pub(crate) fn next(&mut self) -> Result<Option<Ctl>, String> {
        let Some((kind, p)) = self.frames.take(CTL_MAX, "control frame")? else {
            return Ok(None);
        };
        let len = p.len();
        let size = |p: &[u8]| {
            (
                u16::from_le_bytes([p[0], p[1]]),
                u16::from_le_bytes([p[2], p[3]]),
            )
        };
        Ok(Some(match kind {
            1 => {
                let mut r = p.as_slice();
                let mut take = |n: usize, what: &str| {
                    if r.len() < n {
                        return Err(format!("start frame: {what} cut short"));
                    }
                    let (a, b) = r.split_at(n);
                    r = b;
                    Ok(a)
                };
                let hlen = u32::from_le_bytes(take(4, "header length")?.try_into().expect("4"));
                let header: StartHeader = serde_json::from_slice(take(hlen as usize, "header")?)
                    .map_err(|e| format!("start frame: {e}"))?;
                let ilen = u32::from_le_bytes(take(4, "image length")?.try_into().expect("4"));
                let image = take(ilen as usize, "image")?.to_vec();
                Ctl::Start {
                    header,
                    image,
                    raw: r.to_vec(),
                }
            }
            2 => Ctl::Journal(p),
            3 if len == 4 => {
                let (rows, cols) = size(&p);
                Ctl::Resized { rows, cols }
            }
            4 if len >= 4 => {
                let (rows, cols) = size(&p);
                Ctl::Image {
                    rows,
                    cols,
                    image: p[4..].to_vec(),
                }
            }
            5 if len == 0 => Ctl::Closed,
            6 if len == 0 => Ctl::Checkpoint,
            k => return Err(format!("unknown control frame kind {k} of {len} bytes")),
        }))
    }
}

/// Decodes every control frame in `bytes` and re-encodes them (for the fuzz
/// target): the re-encoding must decode to the same frames.
pub(crate) fn reencode(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut d = CtlDecoder::default();
    d.push(bytes);
    let mut out = Vec::new();
    while let Some(f) = d.next()? {
        f.encode(&mut out);
    }
    Ok(out)
}

/// The relay's side: sends the pty master to a worker about to start, as one
/// `P` byte carrying it (blocking: the socket is new and empty).
pub(crate) fn send_pty(
    sock: &std::os::unix::net::UnixStream,
    pty: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds = [pty];
    if !cmsg.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("the pty does not fit its message"));
    }
    let n = sendmsg(
        sock,
        &[std::io::IoSlice::new(b"P")],
        &mut cmsg,
        SendFlags::empty(),
    )?;
    if n != 1 {
        return Err(std::io::ErrorKind::WriteZero.into());
    }
    Ok(())
}

/// A std socket of the pair between relay and worker, driven by tokio.
pub(crate) fn to_tokio(
    s: std::os::unix::net::UnixStream,
) -> std::io::Result<tokio::net::UnixStream> {
    s.set_nonblocking(true)?;
    tokio::net::UnixStream::from_std(s)
}

/// The `Image` frame of `term` as it is now (its scrollback and screen).
fn image_of(term: &mut Terminal) -> Ctl {
    let t = term.live();
    let (rows, cols) = t.screen().size();
    Ctl::Image {
        rows: rows.get(),
        cols: cols.get(),
        image: redraw(t),
    }
}

/// The worker's side of [`send_pty`].
fn recv_pty(sock: &std::os::unix::net::UnixStream) -> Result<OwnedFd, String> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let r = recvmsg(
        sock,
        &mut [IoSliceMut::new(&mut byte)],
        &mut cmsg,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| format!("receiving the pty: {e}"))?;
    let mut pty = None;
    for msg in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = msg {
            pty = pty.or_else(|| fds.next());
        }
    }
    match (r.bytes, byte[0], pty) {
        (1, b'P', Some(fd)) => Ok(fd),
        (0, _, _) => Err("the relay closed the control socket before sending the pty".into()),
        _ => Err("the control socket did not carry a pty".into()),
    }
}

/// `roam shell-worker` (started by the relay, never by hand).
pub(crate) async fn run(args: ShellWorkerArgs) -> CliResult {
    let label = args.shell;
    let dup = |fd: BorrowedFd<'_>, what: &str| {
        fd.try_clone_to_owned()
            .map(std::os::unix::net::UnixStream::from)
            .map_err(|e| CliError(format!("shell worker {label}: {what}: {e}")))
    };
    let ctl = dup(std::io::stdin().as_fd(), "control socket (stdin)")?;
    let out = dup(std::io::stdout().as_fd(), "client socket (stdout)")?;
    let pty = recv_pty(&ctl).map_err(|e| CliError(format!("shell worker {label}: {e}")))?;
    let ctl = to_tokio(ctl).map_err(|e| CliError(format!("shell worker {label}: {e}")))?;
    let out = to_tokio(out).map_err(|e| CliError(format!("shell worker {label}: {e}")))?;
    let pty = Pty::from_master(pty).map_err(|e| CliError(format!("shell worker {label}: {e}")))?;
    let (mut ctl_rd, ctl_wr) = ctl.into_split();
    let mut dec = CtlDecoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    let start = loop {
        match dec.next() {
            Ok(Some(Ctl::Start { header, image, raw })) => break (header, image, raw),
            Ok(Some(other)) => {
                return Err(CliError(format!(
                    "shell worker {label}: expected a start, got {other:?}"
                )))
            }
            Ok(None) => {}
            Err(e) => return Err(CliError(format!("shell worker {label}: {e}"))),
        }
        match ctl_rd.read(&mut buf).await {
            Ok(0) => return Ok(0),
            Ok(n) => dec.push(&buf[..n]),
            Err(e) => return Err(CliError(format!("shell worker {label}: control: {e}"))),
        }
    };
    drop(buf);
    serve(start, pty, out, ctl_rd, ctl_wr, dec)
        .await
        .map_err(|e| CliError(format!("shell worker {label}: {e}")))
}

/// What ended a worker's loop.
enum End {
    /// The client's side ended: send the image back.
    Detached,
    /// The pty ended: the shell exited.
    PtyClosed,
    /// The relay went away.
    RelayGone,
}

/// One turn of the worker's loop.
enum Turn {
    Pty(std::io::Result<()>),
    Wrote(std::io::Result<usize>),
    Read(std::io::Result<usize>),
    Typed(std::io::Result<usize>),
    Ctl(std::io::Result<usize>),
}

/// The worker's loop: the shell's pty, the client's frames, the journal.
async fn serve(
    (header, image, raw): (StartHeader, Vec<u8>, Vec<u8>),
    mut pty: Pty,
    out: tokio::net::UnixStream,
    mut ctl_rd: tokio::net::unix::OwnedReadHalf,
    mut ctl_wr: tokio::net::unix::OwnedWriteHalf,
    mut dec: CtlDecoder,
) -> Result<i32, String> {
    let name = header.name.clone();
    let mut term = Terminal::Packed {
        image,
        rows: header.term_rows,
        cols: header.term_cols,
        raw,
    };
    let mut ctl_out = Vec::new();
    let keep = header.rows == 0 || header.cols == 0;
    if !keep && (header.rows, header.cols) != (header.term_rows, header.term_cols) {
        resize(&pty.rx, term.live(), header.rows, header.cols);
        Ctl::Resized {
            rows: header.rows,
            cols: header.cols,
        }
        .encode(&mut ctl_out);
        ctl_wr
            .write_all(&ctl_out)
            .await
            .map_err(|e| format!("control: {e}"))?;
    }
    let (rd, wr) = out.into_split();
    let mut sink = Sink::new(wr);
    let mut client = Client::new(rd);
    if !header.quiet {
        sink.push(Frame::Attached(Attached {
            name: name.clone(),
            new: header.new,
        }));
    }
    // A quiet start is the same client back: the screen, which it may not
    // have seen all of, never the scrollback it has.
    if header.quiet || !header.new {
        let t = term.live();
        let screen = if header.scrollback && !header.quiet {
            redraw(t)
        } else {
            t.screen().contents_formatted().into_bytes()
        };
        sink.push(Frame::Output(screen));
    }
    let mut typed: Vec<u8> = Vec::new();
    let mut pty_buf = vec![0u8; 16 * 1024];
    let mut ctl_buf = [0u8; 512];
    let end = loop {
        let held = sink.held;
        let typing = !typed.is_empty();
        let turn = tokio::select! {
            r = pty.rx.readable() => Turn::Pty(r),
            r = write_out(Some(&mut sink)), if held > 0 => Turn::Wrote(r),
            r = read_client(Some(&mut client)), if typed.len() < IN_LIMIT => Turn::Read(r),
            r = pty.tx.write(&typed), if typing => Turn::Typed(r),
            r = ctl_rd.read(&mut ctl_buf) => Turn::Ctl(r),
        };
        match turn {
            Turn::Pty(Err(_)) => break End::PtyClosed,
            Turn::Pty(Ok(())) => {
                let n = match pty.rx.try_read(&mut pty_buf) {
                    Ok(0) => break End::PtyClosed,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    // EIO: the shell and everything it started are gone.
                    Err(_) => break End::PtyClosed,
                };
                let bytes = &pty_buf[..n];
                // Journal first: if this process dies now, the relay has it.
                ctl_out.clear();
                Ctl::Journal(bytes.to_vec()).encode(&mut ctl_out);
                if ctl_wr.write_all(&ctl_out).await.is_err() {
                    break End::RelayGone;
                }
                term.process(bytes);
                if !sink.stale {
                    sink.push(Frame::Output(bytes.to_vec()));
                    if sink.held > OUT_LIMIT {
                        tracing::info!(
                            "shell {name}: the client is too far behind; it gets the screen instead"
                        );
                        sink.drop_unsent();
                        sink.stale = true;
                    }
                }
            }
            Turn::Wrote(Ok(n)) => {
                sink.taken(n);
                if sink.held == 0 && std::mem::take(&mut sink.stale) {
                    let screen = term.live().screen().contents_formatted();
                    sink.push(Frame::Output(screen.into_bytes()));
                }
            }
            Turn::Wrote(Err(_)) | Turn::Read(Err(_)) | Turn::Read(Ok(0)) => break End::Detached,
            Turn::Read(Ok(n)) => {
                client.frames.push(&client.buf[..n]);
                let mut bad = false;
                loop {
                    match client.frames.next() {
                        Ok(Some(Frame::Input(bytes))) => typed.extend_from_slice(&bytes),
                        Ok(Some(Frame::Resize { rows, cols })) => {
                            resize(&pty.rx, term.live(), rows, cols);
                            ctl_out.clear();
                            Ctl::Resized { rows, cols }.encode(&mut ctl_out);
                            if ctl_wr.write_all(&ctl_out).await.is_err() {
                                return Ok(0);
                            }
                        }
                        Ok(Some(other)) => {
                            tracing::warn!(
                                "shell {name}: unexpected frame from the client: {other:?}"
                            );
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!("shell {name}: {e}; dropping the client");
                            bad = true;
                            break;
                        }
                    }
                }
                if bad {
                    break End::Detached;
                }
            }
            Turn::Typed(Ok(n)) => {
                typed.drain(..n);
            }
            Turn::Typed(Err(e)) => {
                tracing::debug!("shell {name}: writing the pty: {e}");
                typed.clear();
            }
            Turn::Ctl(Ok(0)) | Turn::Ctl(Err(_)) => break End::RelayGone,
            Turn::Ctl(Ok(n)) => {
                dec.push(&ctl_buf[..n]);
                loop {
                    match dec.next() {
                        Ok(Some(Ctl::Checkpoint)) => {
                            ctl_out.clear();
                            image_of(&mut term).encode(&mut ctl_out);
                            if ctl_wr.write_all(&ctl_out).await.is_err() {
                                return Ok(0);
                            }
                        }
                        Ok(None) => break,
                        Ok(Some(other)) => {
                            return Err(format!("the relay sent {other:?} after the start"))
                        }
                        Err(e) => return Err(format!("control: {e}")),
                    }
                }
            }
        }
    };
    ctl_out.clear();
    match end {
        End::Detached => image_of(&mut term).encode(&mut ctl_out),
        End::PtyClosed => {
            sink.flush_and_end(std::time::Duration::from_secs(5)).await;
            Ctl::Closed.encode(&mut ctl_out);
        }
        End::RelayGone => return Ok(0),
    }
    let _ = ctl_wr.write_all(&ctl_out).await;
    let _ = ctl_wr.shutdown().await;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_frames_round_trip_in_any_split() {
        let frames = vec![
            Ctl::Start {
                header: StartHeader {
                    name: "work".into(),
                    new: false,
                    scrollback: true,
                    quiet: false,
                    rows: 50,
                    cols: 132,
                    term_rows: 24,
                    term_cols: 80,
                },
                image: b"\x1b[Hhello".to_vec(),
                raw: b"more".to_vec(),
            },
            Ctl::Journal(b"output".to_vec()),
            Ctl::Resized { rows: 3, cols: 4 },
            Ctl::Image {
                rows: 24,
                cols: 80,
                image: b"img".to_vec(),
            },
            Ctl::Closed,
            Ctl::Checkpoint,
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode(&mut bytes);
        }
        for split in 0..bytes.len() {
            let mut d = CtlDecoder::default();
            let mut got = Vec::new();
            for part in [&bytes[..split], &bytes[split..]] {
                d.push(part);
                while let Some(f) = d.next().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(got, frames, "split at {split}");
        }
        assert_eq!(reencode(&bytes).unwrap(), bytes);
    }

    #[test]
    fn bad_control_frames_are_named() {
        let mut d = CtlDecoder::default();
        d.push(&[9, 0, 0, 0, 0]);
        assert!(d
            .next()
            .unwrap_err()
            .contains("unknown control frame kind 9"));
        let mut d = CtlDecoder::default();
        d.push(&[2, 0xff, 0xff, 0xff, 0xff]);
        assert!(d.next().unwrap_err().contains("over the limit"));
        let mut d = CtlDecoder::default();
        d.push(&[1, 6, 0, 0, 0, 200, 0, 0, 0, b'{', b'}']);
        assert!(d.next().unwrap_err().contains("header cut short"));
        let mut d = CtlDecoder::default();
        d.push(&[3, 1, 0, 0, 0, 7]);
        assert!(d.next().unwrap_err().contains("kind 3 of 1 bytes"));
    }
}
