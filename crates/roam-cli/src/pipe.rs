//! `roam pipe`: stdin/stdout as one stream to a target through the relay
//! (an ssh `ProxyCommand`), with a direct-TCP fallback when the host runs no relay.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::cli::{CliError, CliResult, DetachArgs, Fallback, PipeArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay, explain_stream_error, ConnectFailure};
use crate::control::Registry;
use crate::named::{self, Header, NameLock, Record};
use crate::stdio::{Input, StdinReader, StdoutWriter};
use crate::target::{is_loopback_host, join, pipe_target, relay_addr, split_host_port};

/// Copy buffer (bytes).
const COPY_BUF: usize = 64 * 1024;
/// Most bytes a named pipe has peeked from its stream and not yet seen
/// printed (they stay in the session until they are).
const LOOKAHEAD: usize = 4 * COPY_BUF;
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
                if let Some(pin) =
                    crate::connect::pinned_key(&relay, &known, crate::connect::ServerKind::Relay)
                        .await?
                {
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
/// instead of closing it. While attached, the session's record is kept
/// current by its journal, so a client killed outright (`kill -9`, a crash)
/// leaves it re-attachable too.
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
    let journal = Arc::new(std::sync::Mutex::new(
        named::JournalFile::open(&dir, name)
            .map_err(|e| CliError(format!("{}: {e}", dir.display())))?,
    ));
    let label = format!("pipe {name}: {relay} -> {target}");
    let base = Header::new(name, relay, target, None);
    let mut link = match named::load(&dir, name).map_err(CliError)? {
        Some(record) => {
            if let Some(listen) = &record.header.listen {
                return Err(CliError(format!(
                    "session {name:?} is a `roam forward` session (listening on {listen}): re-attach it with `roam forward --name {name} {} {listen} {}`",
                    record.header.relay, record.header.target
                )));
            }
            if record.header.relay != relay || record.header.target != target {
                return Err(CliError(format!(
                    "session {name:?} goes to {} through relay {}, not to {target} through {relay}: give those, or choose another name",
                    record.header.target, record.header.relay
                )));
            }
            match reattach(name, record, base, &dir, journal.clone(), args, config).await? {
                // The journal has already replaced the record: the old one
                // is stale from the first byte on (a stale copy is refused
                // anyway).
                Ok(link) => link,
                Err(code) => {
                    named::remove_all(&dir, name);
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
            // A mark left by an earlier session of this name means nothing now.
            let _ = std::fs::remove_file(named::mark_path(&dir, name));
            let carry = Arc::new(Carry::default());
            session.set_journal(journal_writer(
                dir.clone(),
                journal.clone(),
                Header {
                    stream: stream.id().0,
                    ..base
                },
                carry.clone(),
            ));
            Link::new(session, stream, carry, named::mark_path(&dir, name))
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
            link.session.clear_journal();
            named::remove_all(&dir, name);
            Ok(0)
        }
        Ended::Signal(sig) => {
            let record = link.detach(name, relay, target, sig).await?;
            // The record is exact: the next client needs no mark.
            let _ = std::fs::remove_file(named::mark_path(&dir, name));
            // Opened afresh: if the journal failed and its slots were
            // removed, the record goes to new ones.
            drop(journal);
            let saved = named::JournalFile::open(&dir, name)
                .and_then(|mut f| f.write(&record.encode(), true));
            saved.map_err(|e| {
                CliError(format!(
                    "session {name:?} was detached but its state could not be saved in {} ({e}): it is lost",
                    dir.display()
                ))
            })?;
            eprintln!(
                "roam: session {name:?} detached (saved in {}); re-attach with `roam pipe --name {name} {relay} {target}`",
                dir.display()
            );
            Ok(0)
        }
        Ended::Failed(e) => {
            let closed = std::time::Duration::from_millis(200);
            let reason = tokio::time::timeout(closed, link.session.closed()).await;
            link.session.clear_journal();
            named::remove_all(&dir, name);
            match reason {
                Ok(reason) if crate::notices::is_session_lost(&reason) => {
                    crate::notices::notice(&crate::notices::lost_message(&reason, relay));
                    Ok(crate::notices::EXIT_SESSION_LOST)
                }
                _ => Err(CliError(e)),
            }
        }
    }
}

/// Bytes a re-attached client took over from its record (what the previous
/// client held outside the session), and how many of them are gone: the
/// journal keeps the rest in every copy until they are.
#[derive(Default)]
struct Carry {
    /// Input the previous client had taken from its stdin but not written
    /// to the stream; written first.
    upload: Vec<u8>,
    /// Output the previous client had taken from the stream but not
    /// printed; printed first.
    download: Vec<u8>,
    /// How much of `download` has been printed.
    printed: AtomicUsize,
}

/// The journal of a named pipe: its record, rewritten whole (atomically,
/// mode 0600) before any byte that would make the previous one stale leaves
/// for the relay. Such a record says `journal` and how far input and output
/// had come, so the next client can say where its stdin and stdout go on.
fn journal_writer(
    dir: PathBuf,
    file: Arc<std::sync::Mutex<named::JournalFile>>,
    base: Header,
    carry: Arc<Carry>,
) -> roam::JournalWriter {
    let id = roam_proto::StreamId(base.stream);
    // The stream's write count when the journal started: the carried
    // upload is the first thing written after it.
    let mut start: Option<u64> = None;
    let mut last: Option<roam_proto::StreamProgress> = None;
    let name = base.name.clone();
    named::journal_writer(dir, name, file, move |entry, bytes| {
        // A stream the session forgot is complete both ways: keep its last
        // figures.
        let progress = entry
            .stream_progress(id)
            .or(last)
            .unwrap_or(roam_proto::StreamProgress {
                written: 0,
                read: 0,
                finished: true,
                peer_finished: true,
            });
        last = Some(progress);
        let start = *start.get_or_insert(progress.written);
        let sent = usize::try_from(progress.written - start).unwrap_or(usize::MAX);
        let upload = &carry.upload[sent.min(carry.upload.len())..];
        let printed = carry
            .printed
            .load(Ordering::SeqCst)
            .min(carry.download.len());
        let download = &carry.download[printed..];
        let header = Header {
            detached_at: named::unix_now(),
            stdin_done: progress.finished,
            finished: progress.finished,
            input_taken: Some(progress.written + upload.len() as u64),
            output_printed: Some(progress.read.saturating_sub(download.len() as u64)),
            ..base.clone()
        };
        named::encode_parts(&header, entry.blob, upload, download, bytes);
    })
}

/// Restores a saved session and resumes it at its relay, journaled from
/// the start. `Ok(Err(code))`: the session is lost (the message is
/// printed), exit with `code`.
async fn reattach(
    name: &str,
    record: Record,
    base: Header,
    dir: &std::path::Path,
    file: Arc<std::sync::Mutex<named::JournalFile>>,
    args: &PipeArgs,
    config: &FileConfig,
) -> Result<Result<Link, i32>, CliError> {
    let h = &record.header;
    let proto = crate::connect::client_proto(args.client.key.as_deref(), config, None)?;
    let since = named::unix_now().saturating_sub(h.detached_at);
    // A journal is written only when the session sends something: an idle
    // session's last copy can be old without the session having been
    // suspended. The relay knows whether it expired.
    let offline = std::time::Duration::from_secs(if h.journal { 0 } else { since });
    let detached = h.detached(record.continuation);
    let when = crate::control::human_secs(since as f64);
    if h.journal {
        eprintln!(
            "roam: session {name:?} was not detached: its client (pid {}) was killed or crashed; re-attaching from its journal (last written {when} ago) at {}...",
            h.pid, h.relay
        );
    } else {
        eprintln!(
            "roam: re-attaching session {name:?} (detached {when} ago) at {}...",
            h.relay
        );
    }
    let carry = Arc::new(Carry {
        upload: record.upload,
        download: record.download,
        printed: AtomicUsize::new(0),
    });
    let journal = journal_writer(
        dir.to_path_buf(),
        file,
        Header {
            stream: h.stream,
            ..base
        },
        carry.clone(),
    );
    let session = match roam::resume_journaled(
        &h.relay,
        roam::ClientConfig::new(proto),
        detached,
        offline,
        Some(journal),
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            crate::notices::notice(&format!(
                "session {name:?} (left {when} ago) cannot be re-attached and is lost: {e}"
            ));
            return Ok(Err(crate::notices::EXIT_SESSION_LOST));
        }
    };
    let stream = match session.stream(roam_proto::StreamId(h.stream)) {
        Ok(s) => s,
        Err(_) if h.journal && carry.download.is_empty() => {
            // Complete both ways and forgotten: the killed client had
            // finished; only the session's close was missing.
            eprintln!("roam: session {name:?} had already finished; closing it");
            let _ = tokio::time::timeout(CLOSE_WAIT, session.close(roam_proto::code::NO_ERROR, ""))
                .await;
            session.clear_journal();
            return Ok(Err(0));
        }
        Err(e) => {
            return Err(CliError(format!(
                "session {name:?} re-attached without its stream: {e}"
            )))
        }
    };
    // Where this client's output starts: after what earlier clients
    // printed. A killed client's journal can lag behind its prints; its
    // mark, written after each write to stdout, does not.
    let carried = carry.download.len();
    let base = session
        .stream_progress(roam_proto::StreamId(h.stream))
        .map_or(0, |p| p.read)
        .saturating_sub(carried as u64);
    let marked = if h.journal {
        crate::stdio::Mark::read(&named::mark_path(dir, name))
    } else {
        None
    };
    let start = marked.map_or(base, |m| m.max(base));
    let mut skip = start - base;
    let from_carry = usize::try_from(skip).unwrap_or(usize::MAX).min(carried);
    carry.printed.fetch_add(from_carry, Ordering::SeqCst);
    skip -= from_carry as u64;
    let stdin = if h.stdin_done {
        "its input had ended (this process reads no stdin)".to_string()
    } else {
        match h.input_taken {
            Some(input) => format!(
                "it had taken {input} bytes of input: this process's stdin follows byte {input}"
            ),
            None => "this process's stdin follows what the previous client took".to_string(),
        }
    };
    let caveat = if h.journal {
        " (if the kill fell between a write to stdout and its mark, that write, at most 4 KiB, appears again)"
    } else {
        ""
    };
    eprintln!(
        "roam: session {name:?}: {stdin}; output goes on after byte {start} of the target's output{caveat}"
    );
    let mut link = Link::new(session, stream, carry.clone(), named::mark_path(dir, name));
    link.upload = carry.upload.clone();
    link.stdin_done = h.stdin_done;
    link.finished = h.finished;
    link.download = carry.download[from_carry..].to_vec();
    link.carried = carried - from_carry;
    link.skip = skip;
    link.output_start = start;
    link.remote_done = h.stdout_done;
    eprintln!("roam: session {name:?} re-attached after {when}");
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
    Peeked(Result<usize, roam::Error>),
    Queued(Result<(), ()>),
    Printed(u64),
}

/// A named session's stream and its copies to and from stdin and stdout,
/// with every byte in between accounted for, so that a detach can save it
/// and the journal never counts a byte as printed before it was.
struct Link {
    session: roam::SessionHandle,
    id: roam_proto::StreamId,
    wr: roam::RoamStream,
    /// Bytes from stdin (or from the previous client's record) not yet
    /// accepted by the stream.
    upload: Vec<u8>,
    /// Stdin has ended (the stream's upload is finished once `upload` is sent).
    stdin_done: bool,
    /// The stream is finished on our side.
    finished: bool,
    /// Bytes to queue for stdout: carried over from the record (the first
    /// `carried` of them) or peeked from the stream.
    download: Vec<u8>,
    /// Bytes at the front of `download` that came from the record.
    carried: usize,
    /// Bytes queued for stdout and not yet known to be written, oldest
    /// first: (length, whether they are still in the stream).
    unprinted: std::collections::VecDeque<(usize, bool)>,
    /// The stdout thread's write count already accounted for.
    printed: u64,
    /// The remote finished sending (its end was peeked).
    remote_done: bool,
    /// The end was taken from the stream (once everything before it was).
    eof_taken: bool,
    /// Bytes peeked from the stream and not yet taken (queued for stdout
    /// or in `download`): the next peek looks past them.
    ahead: usize,
    reader: Option<StdinReader>,
    writer: Option<StdoutWriter>,
    /// Shared with the journal: how much of the record's output is printed.
    carry: Arc<Carry>,
    /// Output a killed client had printed beyond its journal's copy: taken
    /// from the stream without printing it again.
    skip: u64,
    /// The output position of the first byte this client prints.
    output_start: u64,
    /// Where the stdout writer marks how far it got.
    mark: PathBuf,
}

impl Link {
    fn new(
        session: roam::SessionHandle,
        stream: roam::RoamStream,
        carry: Arc<Carry>,
        mark: PathBuf,
    ) -> Self {
        let id = stream.id();
        Self {
            session,
            id,
            wr: stream,
            upload: Vec::new(),
            stdin_done: false,
            finished: false,
            download: Vec::new(),
            carried: 0,
            unprinted: Default::default(),
            printed: 0,
            remote_done: false,
            eof_taken: false,
            ahead: 0,
            reader: None,
            writer: None,
            carry,
            skip: 0,
            output_start: 0,
            mark,
        }
    }

    /// Copies until both directions are done, a signal asks to detach, or
    /// something fails. Every wait is cancel-safe: a signal finds each byte
    /// in `upload`, `download`, the stream or the stdio threads.
    ///
    /// Output is peeked, not read: bytes leave the stream (and with it the
    /// journal's copies) only once the stdout thread has written them, so
    /// a client killed at any instant loses none of them.
    async fn run(&mut self) -> Ended {
        if !self.stdin_done {
            self.reader = Some(StdinReader::start());
        }
        let mark = match open_mark(&self.mark) {
            Ok(file) => Some(crate::stdio::Mark {
                file,
                base: self.output_start,
            }),
            Err(e) => {
                crate::notices::notice(&format!(
                    "{}: {e}: if this process is killed, up to a stream window of output may be printed again",
                    self.mark.display()
                ));
                None
            }
        };
        self.writer = Some(StdoutWriter::start(mark));
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
            if self.remote_done && self.download.is_empty() && self.unprinted.is_empty() {
                if !self.eof_taken {
                    // Every byte before the end is out: take the end too.
                    if let Err(e) = self.session.consume(self.id, 0) {
                        return Ended::Failed(format!("the target: {e}"));
                    }
                    self.eof_taken = true;
                }
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
            let peeking = !self.remote_done && self.download.is_empty() && self.ahead < LOOKAHEAD;
            let ahead = self.ahead;
            let id = self.id;
            let written = self.writer.as_ref().map(|w| w.written.clone());
            let step = tokio::select! {
                sig = &mut signal => Step::Signal(sig),
                input = recv_input(self.reader.as_mut()), if reading => Step::Input(input),
                r = self.wr.write(&self.upload), if !self.upload.is_empty() => Step::Wrote(r),
                r = self.session.peek(id, ahead, &mut buf), if peeking => Step::Peeked(r),
                r = print(self.writer.as_ref(), &self.download), if !self.download.is_empty() => Step::Queued(r),
                n = printed_past(written, self.printed), if !self.unprinted.is_empty() => Step::Printed(n),
            };
            match step {
                Step::Signal(sig) => return Ended::Signal(sig),
                Step::Input(Some(Input::Data(d))) => self.upload = d,
                Step::Input(Some(Input::Eof) | None) => self.stdin_done = true,
                Step::Wrote(Ok(n)) => {
                    self.upload.drain(..n);
                }
                Step::Wrote(Err(e)) => {
                    return Ended::Failed(explain_stream_error(&e, "the target"))
                }
                Step::Peeked(Ok(0)) => self.remote_done = true,
                Step::Peeked(Ok(n)) => {
                    let skipped = usize::try_from(self.skip).unwrap_or(usize::MAX).min(n);
                    if skipped > 0 {
                        if let Err(e) = self.session.consume(id, skipped) {
                            return Ended::Failed(format!("the target: {e}"));
                        }
                        self.skip -= skipped as u64;
                    }
                    self.download.extend_from_slice(&buf[skipped..n]);
                    self.ahead += n - skipped;
                }
                Step::Peeked(Err(e)) => return Ended::Failed(format!("the target: {e}")),
                Step::Queued(Ok(())) => {
                    let carried = std::mem::take(&mut self.carried);
                    if carried > 0 {
                        self.unprinted.push_back((carried, false));
                    }
                    if self.download.len() > carried {
                        self.unprinted
                            .push_back((self.download.len() - carried, true));
                    }
                    self.download.clear();
                }
                Step::Queued(Err(())) | Step::Printed(u64::MAX) => {
                    let e = match self.writer.take() {
                        Some(w) => w.finish().await.err(),
                        None => None,
                    };
                    return Ended::Failed(e.unwrap_or_else(|| "stdout failed".into()));
                }
                Step::Printed(total) => {
                    if let Err(e) = self.take_printed(total) {
                        return Ended::Failed(format!("the target: {e}"));
                    }
                }
            }
        }
    }

    /// The stdout thread has written `total` bytes in all: takes those of
    /// them that were peeked out of the stream, and counts those carried
    /// from the record as printed.
    fn take_printed(&mut self, total: u64) -> Result<(), roam::Error> {
        let mut done = usize::try_from(total - self.printed).unwrap_or(usize::MAX);
        self.printed = total;
        while done > 0 {
            let Some((len, in_stream)) = self.unprinted.front_mut() else {
                break;
            };
            let k = done.min(*len);
            if *in_stream {
                self.session.consume(self.id, k)?;
                self.ahead -= k;
            } else {
                self.carry.printed.fetch_add(k, Ordering::SeqCst);
            }
            *len -= k;
            done -= k;
            if *len == 0 {
                self.unprinted.pop_front();
            }
        }
        Ok(())
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
        // Queued for stdout but not written: printed first next time. What
        // the stdout thread did write is taken from the stream (or the
        // carried bytes) first; the rest it hands back is, in order, the
        // rest of what was queued.
        let mut download = Vec::new();
        if let Some(w) = self.writer.take() {
            let counter = w.written.clone();
            let unprinted = w.stop().await;
            let total = *counter.borrow();
            if let Err(e) = self.take_printed(total) {
                tracing::debug!("taking printed bytes: {e}");
            }
            download = unprinted;
        }
        // Peeked and still in the stream (handed back by the thread, or
        // never queued): taken now, since the record holds them.
        if self.ahead > 0 {
            if let Err(e) = self.session.consume(self.id, self.ahead) {
                tracing::debug!("taking unprinted bytes: {e}");
            }
            self.ahead = 0;
        }
        self.unprinted.clear();
        download.extend_from_slice(&self.download);
        self.download = download;
        tracing::info!(
            "detaching: {} upload bytes and {} download bytes held outside the session",
            self.upload.len(),
            self.download.len()
        );
        let progress = self.session.stream_progress(self.id);
        let detached = self.session.detach().await.map_err(|e| {
            CliError(format!(
                "signal {sig}: session {name:?} could not be detached ({e}); it is lost"
            ))
        })?;
        Ok(Record {
            header: Header {
                stream: self.id.0,
                detached_at: named::unix_now(),
                stdin_done: self.stdin_done,
                finished: self.finished,
                stdout_done: self.remote_done,
                unaccepted: detached.unaccepted.iter().map(|s| s.0).collect(),
                orphans: detached.orphans.iter().map(|s| s.0).collect(),
                journal: false,
                input_taken: progress.map(|p| p.written + self.upload.len() as u64),
                output_printed: progress.map(|p| p.read.saturating_sub(self.download.len() as u64)),
                ..Header::new(name, relay, target, None)
            },
            continuation: detached.blob,
            upload: self.upload,
            download: self.download,
        })
    }
}

/// Opens (creates, mode 0600) a named pipe's output mark.
fn open_mark(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
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

/// Waits until the stdout thread has written more than `seen` bytes in all
/// and returns its count; `u64::MAX` if the thread is gone (stdout failed).
async fn printed_past(written: Option<tokio::sync::watch::Receiver<u64>>, seen: u64) -> u64 {
    let Some(mut w) = written else {
        return u64::MAX;
    };
    let waited = w.wait_for(|n| *n > seen).await.map(|n| *n);
    match waited {
        Ok(n) => n,
        Err(_) => {
            // The thread ended: whatever it wrote last still counts.
            let n = *w.borrow();
            if n > seen {
                n
            } else {
                u64::MAX
            }
        }
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
