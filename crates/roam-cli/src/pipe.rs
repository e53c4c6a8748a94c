//! `roam pipe`: stdin/stdout as one stream to a target through the relay
//! (an ssh `ProxyCommand`), with a direct-TCP fallback when the host runs no relay.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

use tokio::io::AsyncReadExt;

use crate::cli::{CliError, CliResult, DetachArgs, Fallback, PipeArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay, explain_stream_error, ConnectFailure};
use crate::control::Registry;
use crate::named::{self, Header, NameLock, Record};
use crate::stdio::{Input, StdinReader, StdoutWriter};
use crate::target::{is_loopback_host, join, pipe_target, relay_addr, split_host_port};

/// Copy buffer (bytes).
const COPY_BUF: usize = 64 * 1024;
/// How long to wait for the relay to acknowledge our close on exit.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// `roam pipe`.
pub(crate) async fn run(args: PipeArgs, config: &FileConfig) -> CliResult {
    let (relay_host, relay) = relay_addr(&args.relay)?;
    let (target, target_port) = pipe_target(&args.target)?;
    if let Some(name) = &args.name {
        return run_named(name, &relay, &target, &args, config).await;
    }
    let fallback = if args.no_fallback {
        Fallback::Never
    } else {
        args.fallback
            .or(config.client.fallback)
            .unwrap_or(if config.client.no_fallback {
                Fallback::Never
            } else {
                Fallback::Auto
            })
    };
    let session = match connect_relay(&relay, args.client.key.as_deref(), config).await {
        Ok(s) => s,
        Err(ConnectFailure::Roam(e)) if e.is_no_roam_server() && fallback != Fallback::Never => {
            let state = crate::paths::state_dir(config);
            let known = crate::keys::KnownServers::new(&state);
            if fallback == Fallback::Auto {
                if let Some(pin) = crate::connect::pinned_key(&relay, &known).await? {
                    return Err(CliError(format!(
                        "no roam relay answers at {relay} ({e}), but its key is pinned (as {} in {}): refusing to fall back to an unprotected direct connection. Check that `roam serve` runs there; pass --fallback always to connect directly anyway",
                        pin.entry,
                        known.path().display()
                    )));
                }
            }
            let target_host = split_host_port(&target)?.0;
            let direct = if is_loopback_host(&target_host) {
                join(&relay_host, target_port)
            } else {
                target.clone()
            };
            eprintln!("roam: no roam relay at {relay} ({e}); connecting directly to {direct} without session protection");
            return direct_pipe(&direct).await;
        }
        Err(e) => return Err(e.into_cli()),
    };
    let registry = Registry::default();
    registry.add(format!("pipe {relay} -> {target}"), session.clone());
    let _control = crate::control::start(config, format!("pipe {relay} -> {target}"), registry);
    tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
    let stream = session
        .open_stream(target.as_bytes())
        .map_err(|e| CliError(e.to_string()))?;
    let (rd, wr) = tokio::io::split(stream);
    // A signal (ssh sends SIGHUP to its ProxyCommand on exit) drops the copy:
    // the stream is finished with what was written, and the session closed.
    let outcome = tokio::select! {
        r = shuttle(rd, wr) => Ok(r),
        sig = crate::signals::exit_signal() => Err(sig),
    };
    let closed =
        tokio::time::timeout(CLOSE_WAIT, session.close(roam_proto::code::NO_ERROR, "")).await;
    match outcome {
        Err(sig) => {
            tracing::info!(
                "signal {sig}: session closed ({})",
                if closed.is_ok() {
                    "acknowledged"
                } else {
                    "relay did not answer in time"
                }
            );
            Ok(128 + sig)
        }
        Ok(Ok(())) => Ok(0),
        Ok(Err(e)) => match closed {
            Ok(reason) if crate::notices::is_session_lost(&reason) => {
                crate::notices::notice(&crate::notices::lost_message(&reason, &relay));
                Ok(crate::notices::EXIT_SESSION_LOST)
            }
            _ => Err(CliError(explain_stream_error(&e, &target))),
        },
    }
}

/// Copies stdin → `wr` and `rd` → stdout. Each direction ends on its own: the
/// remote finishing its side (half-close) does not stop the upload, and stdin
/// reaching its end only finishes ours. Done when both are done, or when the
/// remote side fails (reset).
///
/// An upload that fails after the remote finished is an error like any
/// other (a lost session, a dead connection: the input was not delivered),
/// except a reset of the stream or connection: the remote chose to stop
/// reading once it was done, as a TCP peer closing with input unread does,
/// and `socat` or `nc` end with success there too. That one is said on
/// standard error, so no input goes missing without a word.
async fn shuttle<R, W>(rd: R, mut wr: W) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let up = async move {
        let mut stdin = BufReader::with_capacity(COPY_BUF, tokio::io::stdin());
        let r = tokio::io::copy_buf(&mut stdin, &mut wr).await;
        let _ = wr.shutdown().await;
        r
    };
    let down = async move {
        let mut rd = BufReader::with_capacity(COPY_BUF, rd);
        let mut stdout = tokio::io::stdout();
        tokio::io::copy_buf(&mut rd, &mut stdout).await?;
        stdout.flush().await
    };
    tokio::pin!(up);
    tokio::pin!(down);
    tokio::select! {
        r = &mut down => {
            r?;
            // Tell our reader the remote is done, as a TCP half-close would:
            // fd 1 now points at /dev/null, so the pipe's reader sees EOF.
            release_stdout();
            // The remote finished sending; keep uploading until stdin ends or
            // the remote refuses more.
            match up.await {
                Ok(_) => Ok(()),
                Err(e) if refused_by_remote(&e) => {
                    tracing::warn!(
                        "the remote end stopped reading after it finished sending ({e}): \
                         the rest of standard input was not delivered"
                    );
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        r = &mut up => {
            if let Err(e) = r {
                tracing::debug!("stdin: {e}");
            }
            down.await
        }
    }
}

/// Whether `e`, from writing to the remote, says the remote refused more
/// input (a roam stream reset, or a TCP connection reset or closed), rather
/// than that the path to it failed.
fn refused_by_remote(e: &std::io::Error) -> bool {
    let reset = e
        .get_ref()
        .and_then(|i| i.downcast_ref::<roam_proto::StreamError>())
        .is_some_and(|se| matches!(se, roam_proto::StreamError::Reset(_)));
    reset
        || matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        )
}

/// Replaces standard output by `/dev/null`, closing our end of the pipe or
/// socket the caller reads.
fn release_stdout() {
    match std::fs::OpenOptions::new().write(true).open("/dev/null") {
        Ok(null) => {
            if let Err(e) = nix::unistd::dup2_stdout(&null) {
                tracing::debug!("closing stdout: {e}");
            }
        }
        Err(e) => tracing::debug!("opening /dev/null: {e}"),
    }
}

async fn direct_pipe(addr: &str) -> CliResult {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| CliError(format!("direct connection to {addr} failed too: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let (rd, wr) = tcp.into_split();
    shuttle(rd, wr)
        .await
        .map_err(|e| CliError(format!("connection to {addr}: {e}")))?;
    Ok(0)
}

/// `roam pipe --name NAME`: re-attaches the session saved under `name`, or
/// opens a new one; a signal detaches it (saved for the next process)
/// instead of closing it.
async fn run_named(
    name: &str,
    relay: &str,
    target: &str,
    args: &PipeArgs,
    config: &FileConfig,
) -> CliResult {
    named::check_name(name).map_err(CliError)?;
    let dir = named::dir(config);
    let mut lock = NameLock::take(&dir, name).map_err(CliError)?;
    let label = format!("pipe {name}: {relay} -> {target}");
    let mut link = match named::load(&dir, name).map_err(CliError)? {
        Some(record) => {
            if record.header.relay != relay || record.header.target != target {
                return Err(CliError(format!(
                    "session {name:?} goes to {} through relay {}, not to {target} through {relay}: give those, or choose another name",
                    record.header.target, record.header.relay
                )));
            }
            match reattach(name, record, args, config).await? {
                Ok(link) => {
                    // The record is stale from the first byte on: it must
                    // not be resumed again (a stale copy is refused anyway).
                    named::remove(&dir, name);
                    link
                }
                Err(code) => {
                    named::remove(&dir, name);
                    lock.mark("ended");
                    return Ok(code);
                }
            }
        }
        None => {
            let session = connect_relay(relay, args.client.key.as_deref(), config)
                .await
                .map_err(ConnectFailure::into_cli)?;
            let stream = session
                .open_stream(target.as_bytes())
                .map_err(|e| CliError(e.to_string()))?;
            Link::new(session, stream)
        }
    };
    let registry = Registry::default();
    registry.add(label.clone(), link.session.clone());
    let _control = crate::control::start(config, label, registry);
    tokio::spawn(crate::notices::watch(
        link.session.clone(),
        relay.to_string(),
    ));
    let ended = link.run().await;
    lock.mark(if matches!(ended, Ended::Signal(_)) {
        "detached"
    } else {
        "ended"
    });
    match ended {
        Ended::Done => {
            let _ = tokio::time::timeout(
                CLOSE_WAIT,
                link.session.close(roam_proto::code::NO_ERROR, ""),
            )
            .await;
            Ok(0)
        }
        Ended::Signal(sig) => {
            let record = link.detach(name, relay, target, sig).await?;
            let path = named::save(&dir, &record).map_err(|e| {
                CliError(format!(
                    "session {name:?} was detached but its state could not be saved ({e}): it is lost"
                ))
            })?;
            eprintln!(
                "roam: session {name:?} detached (saved in {}); re-attach with `roam pipe --name {name} {relay} {target}`",
                path.display()
            );
            Ok(0)
        }
        Ended::Failed(e) => {
            let closed = std::time::Duration::from_millis(200);
            match tokio::time::timeout(closed, link.session.closed()).await {
                Ok(reason) if crate::notices::is_session_lost(&reason) => {
                    crate::notices::notice(&crate::notices::lost_message(&reason, relay));
                    Ok(crate::notices::EXIT_SESSION_LOST)
                }
                _ => Err(CliError(e)),
            }
        }
    }
}

/// Restores a saved session and resumes it at its relay. `Ok(Err(code))`:
/// the session is lost (the message is printed), exit with `code`.
async fn reattach(
    name: &str,
    record: Record,
    args: &PipeArgs,
    config: &FileConfig,
) -> Result<Result<Link, i32>, CliError> {
    let h = &record.header;
    let proto = crate::connect::client_proto(args.client.key.as_deref(), config, None)?;
    let offline = std::time::Duration::from_secs(named::unix_now().saturating_sub(h.detached_at));
    let detached = roam::Detached::new(
        record.continuation,
        h.unaccepted
            .iter()
            .map(|&i| roam_proto::StreamId(i))
            .collect(),
        h.orphans.iter().map(|&i| roam_proto::StreamId(i)).collect(),
    );
    eprintln!(
        "roam: re-attaching session {name:?} (detached {} ago) at {}...",
        crate::control::human_secs(offline.as_secs_f64()),
        h.relay
    );
    let session =
        match roam::resume(&h.relay, roam::ClientConfig::new(proto), detached, offline).await {
            Ok(s) => s,
            Err(e) => {
                crate::notices::notice(&format!(
                    "session {name:?} (detached {} ago) cannot be re-attached and is lost: {e}",
                    crate::control::human_secs(offline.as_secs_f64())
                ));
                return Ok(Err(crate::notices::EXIT_SESSION_LOST));
            }
        };
    let stream = session
        .stream(roam_proto::StreamId(h.stream))
        .map_err(|e| {
            CliError(format!(
                "session {name:?} re-attached without its stream: {e}"
            ))
        })?;
    let mut link = Link::new(session, stream);
    link.upload = record.upload;
    link.stdin_done = h.stdin_done;
    link.finished = h.finished;
    link.download = record.download;
    link.remote_done = h.stdout_done;
    eprintln!(
        "roam: session {name:?} re-attached after {}",
        crate::control::human_secs(offline.as_secs_f64())
    );
    Ok(Ok(link))
}

/// How a named pipe's copying ended.
enum Ended {
    /// Both directions finished.
    Done,
    /// A detach signal arrived (its number).
    Signal(i32),
    /// The stream or stdout failed (the message).
    Failed(String),
}

/// What one turn of [`Link::run`]'s wait produced.
enum Step {
    Signal(i32),
    Input(Option<Input>),
    Wrote(std::io::Result<usize>),
    Read(std::io::Result<usize>),
    Printed(Result<(), ()>),
}

/// A named session's stream and its copies to and from stdin and stdout,
/// with every byte in between accounted for, so that a detach can save it.
struct Link {
    session: roam::SessionHandle,
    id: roam_proto::StreamId,
    rd: tokio::io::ReadHalf<roam::RoamStream>,
    wr: tokio::io::WriteHalf<roam::RoamStream>,
    /// Bytes from stdin (or from the previous client's record) not yet
    /// accepted by the stream.
    upload: Vec<u8>,
    /// Stdin has ended (the stream's upload is finished once `upload` is sent).
    stdin_done: bool,
    /// The stream is finished on our side.
    finished: bool,
    /// Bytes from the stream not yet queued for stdout.
    download: Vec<u8>,
    /// The remote finished sending.
    remote_done: bool,
    reader: Option<StdinReader>,
    writer: Option<StdoutWriter>,
}

impl Link {
    fn new(session: roam::SessionHandle, stream: roam::RoamStream) -> Self {
        let id = stream.id();
        let (rd, wr) = tokio::io::split(stream);
        Self {
            session,
            id,
            rd,
            wr,
            upload: Vec::new(),
            stdin_done: false,
            finished: false,
            download: Vec::new(),
            remote_done: false,
            reader: None,
            writer: None,
        }
    }

    /// Copies until both directions are done, a signal asks to detach, or
    /// something fails. Every wait is cancel-safe: a signal finds each byte
    /// in `upload`, `download`, the stream or the stdio threads.
    async fn run(&mut self) -> Ended {
        if !self.stdin_done {
            self.reader = Some(StdinReader::start());
        }
        self.writer = Some(StdoutWriter::start());
        let mut buf = vec![0u8; COPY_BUF];
        let signal = crate::signals::detach_signal();
        tokio::pin!(signal);
        loop {
            if self.upload.is_empty() && self.stdin_done && !self.finished {
                if let Err(e) = self.wr.shutdown().await {
                    return Ended::Failed(explain_stream_error(&e, "the target"));
                }
                self.finished = true;
            }
            if self.remote_done && self.download.is_empty() {
                if let Some(w) = self.writer.take() {
                    // Everything is printed: give stdout's reader its end,
                    // as a TCP half-close would.
                    if let Err(e) = w.finish().await {
                        return Ended::Failed(e);
                    }
                    release_stdout();
                }
                if self.finished {
                    return Ended::Done;
                }
            }
            let reading = !self.stdin_done && self.upload.is_empty();
            let downloading = !self.remote_done && self.download.is_empty();
            let step = tokio::select! {
                sig = &mut signal => Step::Signal(sig),
                input = recv_input(self.reader.as_mut()), if reading => Step::Input(input),
                r = self.wr.write(&self.upload), if !self.upload.is_empty() => Step::Wrote(r),
                r = self.rd.read(&mut buf), if downloading => Step::Read(r),
                r = print(self.writer.as_ref(), &self.download), if !self.download.is_empty() => Step::Printed(r),
            };
            match step {
                Step::Signal(sig) => return Ended::Signal(sig),
                Step::Input(Some(Input::Data(d))) => self.upload = d,
                Step::Input(Some(Input::Eof) | None) => self.stdin_done = true,
                Step::Wrote(Ok(n)) => {
                    self.upload.drain(..n);
                }
                Step::Wrote(Err(e)) | Step::Read(Err(e)) => {
                    return Ended::Failed(explain_stream_error(&e, "the target"))
                }
                Step::Read(Ok(0)) => self.remote_done = true,
                Step::Read(Ok(n)) => self.download.extend_from_slice(&buf[..n]),
                Step::Printed(Ok(())) => self.download.clear(),
                Step::Printed(Err(())) => {
                    let e = match self.writer.take() {
                        Some(w) => w.finish().await.err(),
                        None => None,
                    };
                    return Ended::Failed(e.unwrap_or_else(|| "stdout failed".into()));
                }
            }
        }
    }

    /// Stops the copies and takes the session out as a continuation, with
    /// every byte the copies held: the record for the next client.
    async fn detach(
        mut self,
        name: &str,
        relay: &str,
        target: &str,
        sig: i32,
    ) -> Result<Record, CliError> {
        if let Some(r) = self.reader.take() {
            let (rest, eof) = r.stop().await;
            self.upload.extend_from_slice(&rest);
            self.stdin_done |= eof;
        }
        if let Some(w) = self.writer.take() {
            // Queued for stdout but not written: printed first next time.
            let mut unprinted = w.stop().await;
            unprinted.extend_from_slice(&self.download);
            self.download = unprinted;
        }
        tracing::info!(
            "detaching: {} upload bytes and {} download bytes held outside the session",
            self.upload.len(),
            self.download.len()
        );
        let detached = self.session.detach().await.map_err(|e| {
            CliError(format!(
                "signal {sig}: session {name:?} could not be detached ({e}); it is lost"
            ))
        })?;
        Ok(Record {
            header: Header {
                name: name.to_string(),
                relay: relay.to_string(),
                target: target.to_string(),
                stream: self.id.0,
                detached_at: named::unix_now(),
                pid: std::process::id(),
                stdin_done: self.stdin_done,
                finished: self.finished,
                stdout_done: self.remote_done,
                unaccepted: detached.unaccepted.iter().map(|s| s.0).collect(),
                orphans: detached.orphans.iter().map(|s| s.0).collect(),
            },
            continuation: detached.blob,
            upload: self.upload,
            download: self.download,
        })
    }
}

/// The stdin thread's next chunk (never, without a thread).
async fn recv_input(reader: Option<&mut StdinReader>) -> Option<Input> {
    match reader {
        Some(r) => r.rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Queues `data` for stdout.
async fn print(writer: Option<&StdoutWriter>, data: &[u8]) -> Result<(), ()> {
    match writer {
        Some(w) => w.write(data.to_vec()).await,
        None => Err(()),
    }
}

/// `roam detach NAME`: asks the process attached to a named session to
/// detach it, and waits until its record is written.
pub(crate) async fn detach(args: DetachArgs, config: &FileConfig) -> CliResult {
    named::check_name(&args.name).map_err(CliError)?;
    let dir = named::dir(config);
    let Some(pid) = named::attached_pid(&dir, &args.name) else {
        return Err(CliError(match named::load(&dir, &args.name) {
            Ok(Some(_)) => format!("session {:?} is already detached", args.name),
            _ => format!(
                "no process is attached to a session named {:?} (`roam status` lists sessions)",
                args.name
            ),
        }));
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGUSR1,
    )
    .map_err(|e| CliError(format!("signalling pid {pid}: {e}")))?;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        if named::attached_pid(&dir, &args.name).is_none() {
            return match named::load(&dir, &args.name) {
                Ok(Some(_)) => {
                    println!("session {:?} detached", args.name);
                    Ok(0)
                }
                _ => Err(CliError(format!(
                    "pid {pid} let go of session {:?} without saving it (see its messages)",
                    args.name
                ))),
            };
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Err(CliError(format!(
        "pid {pid} did not detach session {:?} within 10 s",
        args.name
    )))
}
