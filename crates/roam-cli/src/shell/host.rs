//! The relay's side of `roam shell` (`roam serve --shell`): shells on
//! pseudo-terminals, kept by name while their clients come and go.
//!
//! A shell request names an account; `account` checks that the client's
//! key may have a shell there and makes the command that starts it as
//! that account (uid, gid and the account's supplementary groups, in its
//! home), with no `unsafe` here.
//!
//! Each shell is one task: it reads the pty into a terminal emulator
//! (`vt100`, with scrollback) all the time, attached or not, and forwards
//! the output to the attached client. A new attach — the same client after
//! a resume never needs one; a new client process, after the old one was
//! killed or detached — takes the shell over: the old stream is reset, and
//! the new client gets the scrollback and the current screen, then live
//! output. When the shell exits, the attached client gets its status.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use roam::RoamStream;
use roam_proto::PublicKey;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;

use super::account::{Account, Login};
use super::wire::{Attached, Decoder, Frame, Open};

/// Lines of scrollback each shell keeps (sent on re-attach).
const SCROLLBACK: usize = 5000;
/// Output held for a client that does not read (suspended, or killed and
/// not yet replaced). Beyond it the held output is dropped and the client,
/// once it reads again, gets the current screen instead: the shell never
/// blocks on a client that is away.
const OUT_LIMIT: usize = 1 << 20;
/// The default `--shell-keys` pattern: `%h` is the home directory, `%u`
/// the user name.
pub(crate) const DEFAULT_KEYS: &str = "%h/.config/roam/authorized_keys";

/// A request to attach a client stream to a shell.
struct Attach {
    stream: RoamStream,
    rows: u16,
    cols: u16,
    new: bool,
    /// Send the scrollback with the screen (not after a relay takeover,
    /// whose client has the scrollback already).
    scrollback: bool,
}

/// What a shell's task is asked.
enum Msg {
    Attach(Attach),
    /// Stop and hand the shell over (a relay takeover).
    Handover(tokio::sync::oneshot::Sender<HandedShell>),
}

/// A shell taken out of its task for a relay takeover: what the next relay
/// needs to go on serving it. The shell process itself goes on running.
#[derive(Debug)]
pub(crate) struct HandedShell {
    pub(crate) user: String,
    pub(crate) name: String,
    pub(crate) pid: u32,
    pub(crate) rows: u16,
    pub(crate) cols: u16,
    /// The terminal state: fed to a fresh emulator it rebuilds scrollback
    /// and screen.
    pub(crate) image: Vec<u8>,
    /// The pty's master.
    pub(crate) pty: std::os::fd::OwnedFd,
    /// The process handle, kept here so a takeover that fails gives the
    /// shell back with it (not sent: the next relay is not its parent).
    pub(crate) child: Option<tokio::process::Child>,
}

/// A running shell as the host's map holds it.
#[derive(Clone)]
struct Entry {
    tx: mpsc::Sender<Msg>,
    pid: u32,
    /// Set by the shell's task while a client is attached.
    attached: Arc<std::sync::atomic::AtomicBool>,
}

/// The shells of one relay, by (user, name).
pub(crate) struct ShellHost {
    keys_pattern: String,
    /// `--shell-program`: run this instead of each account's login shell.
    program: Option<PathBuf>,
    shells: Mutex<HashMap<(String, String), Entry>>,
}

impl ShellHost {
    /// Shells whose authorized keys are found by `keys_pattern`.
    pub(crate) fn new(keys_pattern: Option<String>, program: Option<PathBuf>) -> Arc<Self> {
        Arc::new(Self {
            keys_pattern: keys_pattern.unwrap_or_else(|| DEFAULT_KEYS.to_string()),
            program,
            shells: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Entry>> {
        self.shells.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves one shell stream from a client with `key`: attaches it to the
    /// named shell or starts one. A refusal is sent to the client as an
    /// `Error` frame and logged.
    pub(crate) async fn serve(
        self: Arc<Self>,
        stream: RoamStream,
        key: Option<PublicKey>,
        open: Result<Open, String>,
    ) {
        let checked = open.and_then(|open| {
            let key = key.ok_or("the session has no client key")?;
            let account = Account::authorize(&open.user, &key, &self.keys_pattern)?;
            let name = match &open.name {
                Some(n) => {
                    crate::named::check_name(n)?;
                    n.clone()
                }
                None => generated_name(),
            };
            Ok((open, account, name))
        });
        let refused = match checked {
            Err(why) => Some((why, stream)),
            Ok((open, account, name)) => self
                .attach_or_start(stream, account, name, open)
                .await
                .err(),
        };
        if let Some((why, stream)) = refused {
            refuse(stream, why).await;
        }
    }

    async fn attach_or_start(
        self: Arc<Self>,
        stream: RoamStream,
        account: Account,
        name: String,
        open: Open,
    ) -> Result<(), (String, RoamStream)> {
        let slot = (account.name.clone(), name.clone());
        let running = |host: &Self| host.lock().get(&slot).map(|e| e.tx.clone());
        let seen = running(&self);
        let mut req = Attach {
            stream,
            rows: open.rows,
            cols: open.cols,
            new: true,
            scrollback: open.scrollback,
        };
        if let Some(tx) = &seen {
            match attach_to(tx, req).await {
                Ok(()) => {
                    tracing::info!("shell {name} of {}: re-attached", account.name);
                    return Ok(());
                }
                // The shell ended meanwhile: a new one starts under the name.
                Err(back) => req = back,
            }
        }
        let login = match account.login(self.program.as_deref(), &open.term).await {
            Ok(l) => l,
            Err(why) => return Err((why, req.stream)),
        };
        // Another client may have started the shell while the account's
        // home was checked: this one joins it.
        let started =
            running(&self).filter(|tx| !seen.as_ref().is_some_and(|s| s.same_channel(tx)));
        if let Some(tx) = started {
            match attach_to(&tx, req).await {
                Ok(()) => {
                    tracing::info!("shell {name} of {}: attached", account.name);
                    return Ok(());
                }
                Err(back) => req = back,
            }
        }
        let (pty, child) = match spawn_shell(login, req.rows, req.cols) {
            Ok(x) => x,
            Err(why) => return Err((why, req.stream)),
        };
        tracing::info!(
            "shell {name} of {} started (pid {})",
            account.name,
            child.id().unwrap_or(0)
        );
        let shell = Shell {
            user: account.name,
            name,
            pid: child.id().unwrap_or(0),
            pty,
            child: Some(child),
            term: Terminal::new(req.rows, req.cols),
        };
        self.clone().run(shell, Some(req));
        Ok(())
    }

    /// Runs `shell` in a task of its own, registered under its name, with
    /// `first` attached before anything is read from its pty (so a new
    /// shell's client gets all of its output, from the first byte).
    fn run(self: Arc<Self>, shell: Shell, first: Option<Attach>) {
        let slot = (shell.user.clone(), shell.name.clone());
        let (tx, rx) = mpsc::channel(4);
        let attached = Arc::new(std::sync::atomic::AtomicBool::new(false));
        self.lock().insert(
            slot.clone(),
            Entry {
                tx: tx.clone(),
                pid: shell.pid,
                attached: attached.clone(),
            },
        );
        let mine = tx.clone();
        tokio::spawn(async move {
            run_shell(shell, first, rx, attached).await;
            let mut shells = self.lock();
            if shells.get(&slot).is_some_and(|e| e.tx.same_channel(&mine)) {
                shells.remove(&slot);
            }
        });
    }

    /// Every shell, for `roam status` and the metrics.
    pub(crate) fn status(&self) -> Vec<crate::control::ShellStatus> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .map(|((user, name), e)| crate::control::ShellStatus {
                user: user.clone(),
                name: name.clone(),
                pid: e.pid,
                attached: e.attached.load(std::sync::atomic::Ordering::Relaxed),
            })
            .collect();
        v.sort_by(|a, b| (&a.user, &a.name).cmp(&(&b.user, &b.name)));
        v
    }

    /// Takes every shell out of its task for a takeover: attached clients
    /// are told to re-attach (they will, to the next relay) and let go.
    pub(crate) async fn take_all(&self) -> Vec<HandedShell> {
        let senders: Vec<mpsc::Sender<Msg>> = self.lock().drain().map(|(_, e)| e.tx).collect();
        let mut out = Vec::new();
        for tx in senders {
            let (reply, rx) = tokio::sync::oneshot::channel();
            if tx.send(Msg::Handover(reply)).await.is_ok() {
                if let Ok(h) = rx.await {
                    out.push(h);
                }
            }
        }
        out
    }

    /// Serves a shell another relay handed over (or one a failed takeover
    /// gives back). Its clients re-attach by name.
    pub(crate) fn adopt(self: &Arc<Self>, h: HandedShell) -> Result<(), String> {
        let writing = h.pty.try_clone().map_err(|e| format!("pty: {e}"))?;
        let rx = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(h.pty)
            .map_err(|e| format!("pty: {e}"))?;
        let tx = tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(writing)
            .map_err(|e| format!("pty: {e}"))?;
        tracing::info!("shell {} of {} (pid {}) adopted", h.name, h.user, h.pid);
        self.clone().run(
            Shell {
                user: h.user,
                name: h.name,
                pid: h.pid,
                pty: Pty { rx, tx },
                child: h.child,
                term: Terminal::Packed {
                    image: h.image,
                    rows: h.rows,
                    cols: h.cols,
                    raw: Vec::new(),
                },
            },
            None,
        );
        Ok(())
    }
}

/// One shell as its task holds it.
struct Shell {
    user: String,
    name: String,
    pid: u32,
    pty: Pty,
    /// `None` for a shell adopted from another relay: not our child, so its
    /// exit status is not ours to read.
    child: Option<tokio::process::Child>,
    term: Terminal,
}

/// Attaches `req` to the running shell behind `tx`; gives it back (as a
/// new shell's) if that shell has ended.
async fn attach_to(tx: &mpsc::Sender<Msg>, mut req: Attach) -> Result<(), Attach> {
    req.new = false;
    match tx.send(Msg::Attach(req)).await {
        Ok(()) => Ok(()),
        Err(mpsc::error::SendError(Msg::Attach(mut back))) => {
            back.new = true;
            Err(back)
        }
        Err(mpsc::error::SendError(Msg::Handover(_))) => unreachable!("sent an attach"),
    }
}

/// Refuses a shell stream: one `Error` frame saying why, then its end.
pub(crate) async fn refuse(mut stream: RoamStream, why: String) {
    tracing::warn!("shell refused: {why}");
    let mut out = Vec::new();
    Frame::Error(why).encode(&mut out);
    let _ = stream.write_all(&out).await;
    let _ = stream.shutdown().await;
}

/// A name for an unnamed shell: `s-` and 8 hex digits.
fn generated_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "s-{:08x}",
        nanos ^ std::process::id().rotate_left(16) ^ n.wrapping_mul(0x9E37_79B9)
    )
}

/// Opens a pty of `rows` × `cols` and starts `login` on it, its notice
/// (if any) first on the terminal.
fn spawn_shell(login: Login, rows: u16, cols: u16) -> Result<(Pty, tokio::process::Child), String> {
    let Login {
        mut cmd,
        notice,
        shell,
    } = login;
    let pty = open_pty(rows, cols).map_err(|e| format!("opening a pty: {e}"))?;
    let slave = |what| {
        pty.slave
            .try_clone()
            .map_err(|e| format!("pty for the shell's {what}: {e}"))
    };
    if let Some(notice) = notice {
        // Read from the master with the shell's first output: a few bytes
        // fit in the pty's buffer.
        use std::io::Write;
        let mut term = std::fs::File::from(slave("notice")?);
        term.write_all(notice.as_bytes())
            .map_err(|e| format!("pty (notice): {e}"))?;
    }
    cmd.stdin(slave("stdin")?)
        .stdout(slave("stdout")?)
        .stderr(slave("stderr")?);
    let child = cmd.spawn().map_err(|e| {
        let via = cmd.as_std().get_program().to_string_lossy().into_owned();
        format!("starting {} (through {via}): {e}", shell.display())
    })?;
    drop(pty.slave);
    nix::fcntl::fcntl(
        pty.master.as_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .map_err(|e| format!("pty: {e}"))?;
    let writing = pty
        .master
        .try_clone()
        .map_err(|e| format!("pty (writing): {e}"))?;
    // A pty master polls like a pipe: tokio's pipe ends drive it without
    // `unsafe` here (AsyncFd needs an unsafe registration). Two
    // descriptors, as one cannot be registered twice with the reactor.
    let rx = tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(pty.master)
        .map_err(|e| format!("pty: {e}"))?;
    let tx = tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(writing)
        .map_err(|e| format!("pty: {e}"))?;
    Ok((Pty { rx, tx }, child))
}

/// A pty's two ends.
struct PtyPair {
    master: std::os::fd::OwnedFd,
    slave: std::os::fd::OwnedFd,
}

/// Opens a pty of `rows` × `cols` whose descriptors are close-on-exec from
/// the start: a shell must inherit only its own terminal, never the master
/// of another user's shell (`openpty` leaves them inheritable, and a
/// concurrent spawn could catch them before a later `FD_CLOEXEC`). With
/// every master closed when the relay ends, each shell gets its SIGHUP.
fn open_pty(rows: u16, cols: u16) -> std::io::Result<PtyPair> {
    use nix::fcntl::OFlag;
    use std::os::unix::fs::OpenOptionsExt;
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let name = nix::pty::ptsname_r(&master)?;
    // std opens with O_CLOEXEC.
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc_o_noctty())
        .open(&name)?;
    let master = std::os::fd::OwnedFd::from(master);
    let ws = rustix::termios::Winsize {
        ws_row: rows.max(1),
        ws_col: cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(&master, ws)?;
    Ok(PtyPair {
        master,
        slave: slave.into(),
    })
}

/// `O_NOCTTY`: opening the slave must not make it the relay's terminal.
fn libc_o_noctty() -> i32 {
    nix::fcntl::OFlag::O_NOCTTY.bits()
}

/// The relay's end of a shell's pty (the reading end also serves the
/// window-size ioctl).
struct Pty {
    rx: tokio::net::unix::pipe::Receiver,
    tx: tokio::net::unix::pipe::Sender,
}

/// The attached client's reading side.
struct Client {
    rd: ReadHalf<RoamStream>,
    frames: Decoder,
    /// Where reads land (gone with the client).
    buf: Vec<u8>,
}

/// The attached client's writing side.
struct Sink {
    wr: WriteHalf<RoamStream>,
    /// Encoded frames not yet taken by the stream; the first may be partly
    /// taken (up to `pos`).
    out: std::collections::VecDeque<Vec<u8>>,
    pos: usize,
    /// Bytes in `out` (not counting those taken).
    held: usize,
    /// Output was dropped (over [`OUT_LIMIT`]): redraw the screen once
    /// `out` has been taken.
    stale: bool,
}

impl Sink {
    fn push(&mut self, frame: Frame) {
        let mut bytes = Vec::new();
        frame.encode(&mut bytes);
        self.held += bytes.len();
        self.out.push_back(bytes);
    }

    /// Drops every frame not begun (a frame partly taken is finished, so
    /// the stream stays framed).
    fn drop_unsent(&mut self) {
        let keep = usize::from(self.pos > 0);
        while self.out.len() > keep {
            if let Some(f) = self.out.pop_back() {
                self.held -= f.len();
            }
        }
    }

    /// Writes everything held, then ends the stream; at most `limit`.
    async fn flush_and_end(mut self, limit: std::time::Duration) {
        let flush = async {
            while self.held > 0 {
                let n = write_out(Some(&mut self)).await?;
                self.taken(n);
            }
            self.wr.shutdown().await
        };
        let _ = tokio::time::timeout(limit, flush).await;
    }

    /// The stream took `n` bytes.
    fn taken(&mut self, n: usize) {
        self.pos += n;
        self.held -= n;
        if self.out.front().is_some_and(|f| self.pos == f.len()) {
            self.out.pop_front();
            self.pos = 0;
        }
    }
}

/// Typed input held for a shell that does not read it (then the client's
/// stream is not read until it does: back-pressure to the client).
const IN_LIMIT: usize = 64 * 1024;

/// Output a parked shell's packed terminal collects before it is brought
/// up to date (unpacked, fed, packed again).
const RAW_LIMIT: usize = 64 * 1024;

thread_local! {
    /// Where pty reads land (copied on only while a client is attached):
    /// a parked shell holds no read buffer of its own.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; 16 * 1024]);
}

/// A shell's terminal state: a live emulator while a client is attached;
/// packed while parked (the bytes that rebuild it, and the output since),
/// so a parked shell costs the relay a few KB instead of the emulator's
/// cell grids.
enum Terminal {
    Live(Box<vt100::Parser>),
    Packed {
        /// [`redraw`] of the emulator when it was packed: fed to a fresh
        /// emulator of the same size, it rebuilds scrollback and screen.
        image: Vec<u8>,
        rows: u16,
        cols: u16,
        /// Output since.
        raw: Vec<u8>,
    },
}

impl Terminal {
    fn new(rows: u16, cols: u16) -> Self {
        Terminal::Live(Box::new(vt100::Parser::new(nz(rows), nz(cols), SCROLLBACK)))
    }

    /// The live emulator, rebuilt first if packed.
    fn live(&mut self) -> &mut vt100::Parser {
        if let Terminal::Packed {
            image,
            rows,
            cols,
            raw,
        } = self
        {
            let mut t = vt100::Parser::new(nz(*rows), nz(*cols), SCROLLBACK);
            t.process(image);
            t.process(raw);
            *self = Terminal::Live(Box::new(t));
        }
        match self {
            Terminal::Live(t) => t,
            Terminal::Packed { .. } => unreachable!("unpacked above"),
        }
    }

    /// Packs the emulator (nothing if packed already).
    fn pack(&mut self) {
        if let Terminal::Live(t) = self {
            let (rows, cols) = t.screen().size();
            let image = redraw(t);
            *self = Terminal::Packed {
                image,
                rows: rows.get(),
                cols: cols.get(),
                raw: Vec::new(),
            };
        }
    }

    /// Output from the shell.
    fn process(&mut self, bytes: &[u8]) {
        match self {
            Terminal::Live(t) => t.process(bytes),
            Terminal::Packed { raw, .. } => {
                raw.extend_from_slice(bytes);
                if raw.len() > RAW_LIMIT {
                    self.live();
                    self.pack();
                }
            }
        }
    }
}

/// What one turn of a shell's loop produced.
enum Turn {
    Attach(Option<Msg>),
    Pty(std::io::Result<()>),
    Wrote(std::io::Result<usize>),
    Read(std::io::Result<usize>),
    Exited(std::io::Result<Option<std::process::ExitStatus>>),
    Typed(std::io::Result<usize>),
}

/// Runs one shell until it exits or is handed over.
async fn run_shell(
    shell: Shell,
    first: Option<Attach>,
    mut attach: mpsc::Receiver<Msg>,
    attached: Arc<std::sync::atomic::AtomicBool>,
) {
    let Shell {
        user,
        name,
        pid,
        mut pty,
        mut child,
        mut term,
    } = shell;
    let mut client: Option<Client> = None;
    let mut sink: Option<Sink> = None;
    // Typed input the pty has not taken yet.
    let mut typed: Vec<u8> = Vec::new();
    let mut pty_open = true;
    let mut first = first.map(Msg::Attach);
    let status = loop {
        attached.store(sink.is_some(), std::sync::atomic::Ordering::Relaxed);
        let held = sink.as_ref().map_or(0, |c| c.held);
        let typing = !typed.is_empty();
        let turn = if let Some(msg) = first.take() {
            Turn::Attach(Some(msg))
        } else {
            tokio::select! {
            a = attach.recv() => Turn::Attach(a),
            r = pty.rx.readable(), if pty_open => Turn::Pty(r),
            r = write_out(sink.as_mut()), if held > 0 => Turn::Wrote(r),
            // Input the shell has not taken yet holds further input back,
            // never its output: a paste into a busy program cannot
            // deadlock the shell's task.
            r = read_client(client.as_mut()), if typed.len() < IN_LIMIT => Turn::Read(r),
            r = pty.tx.write(&typed), if typing && pty_open => Turn::Typed(r),
            s = wait_child(child.as_mut()), if !pty_open => Turn::Exited(s),
            }
        };
        match turn {
            Turn::Attach(None) => {}
            Turn::Attach(Some(Msg::Handover(reply))) => {
                if let Some(mut s) = sink.take() {
                    // The client re-attaches to the next relay; what it
                    // has not been sent yet it gets as the screen there.
                    s.drop_unsent();
                    s.push(Frame::Reattach);
                    s.flush_and_end(std::time::Duration::from_millis(200)).await;
                }
                drop(client);
                let (rows, cols) = {
                    let t = term.live();
                    let (r, c) = t.screen().size();
                    (r.get(), c.get())
                };
                let image = redraw(term.live());
                let handed = pty.rx.into_nonblocking_fd().map(|fd| HandedShell {
                    user,
                    name: name.clone(),
                    pid,
                    rows,
                    cols,
                    image,
                    pty: fd,
                    child,
                });
                match handed {
                    Ok(h) => {
                        if let Err(h) = reply.send(h) {
                            tracing::warn!(
                                "shell {name}: handover abandoned; the shell loses its pty"
                            );
                            drop(h);
                        }
                    }
                    Err(e) => tracing::warn!("shell {name}: cannot hand over its pty: {e}"),
                }
                return;
            }
            Turn::Attach(Some(Msg::Attach(a))) => {
                if let Some(mut old) = sink.take() {
                    // Taken over by a newer client process.
                    let _ = old.wr.shutdown().await;
                }
                resize(&pty.rx, term.live(), a.rows, a.cols);
                let (rd, wr) = tokio::io::split(a.stream);
                let mut s = Sink {
                    wr,
                    out: std::collections::VecDeque::new(),
                    pos: 0,
                    held: 0,
                    stale: false,
                };
                s.push(Frame::Attached(Attached {
                    name: name.clone(),
                    new: a.new,
                }));
                if !a.new {
                    let t = term.live();
                    let screen = if a.scrollback {
                        redraw(t)
                    } else {
                        t.screen().contents_formatted().into_bytes()
                    };
                    s.push(Frame::Output(screen));
                }
                client = Some(Client {
                    rd,
                    frames: Decoder::default(),
                    buf: vec![0u8; 16 * 1024],
                });
                sink = Some(s);
            }
            Turn::Pty(Err(_)) => pty_open = false,
            Turn::Pty(Ok(())) => {
                let got = SCRATCH.with_borrow_mut(|buf| match pty.rx.try_read(buf) {
                    Ok(0) => None,
                    Ok(n) => {
                        term.process(&buf[..n]);
                        Some(sink.is_some().then(|| buf[..n].to_vec()))
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Some(None),
                    // EIO: every holder of the pty's other end is gone
                    // (the shell exited).
                    Err(_) => None,
                });
                let Some(copy) = got else {
                    pty_open = false;
                    continue;
                };
                if let (Some(c), Some(bytes)) = (sink.as_mut().filter(|c| !c.stale), copy) {
                    c.push(Frame::Output(bytes));
                    if c.held > OUT_LIMIT {
                        tracing::info!(
                            "shell {name}: the client is too far behind; it gets the screen instead"
                        );
                        c.drop_unsent();
                        c.stale = true;
                    }
                }
            }
            Turn::Wrote(Ok(n)) => {
                if let Some(c) = sink.as_mut() {
                    c.taken(n);
                    if c.held == 0 && std::mem::take(&mut c.stale) {
                        let screen = term.live().screen().contents_formatted();
                        c.push(Frame::Output(screen.into_bytes()));
                    }
                }
            }
            Turn::Wrote(Err(_)) | Turn::Read(Err(_)) | Turn::Read(Ok(0)) => {
                tracing::info!("shell {name}: client detached");
                client = None;
                sink = None;
                term.pack();
            }
            Turn::Read(Ok(n)) => {
                let c = client.as_mut().expect("a read needs a client");
                c.frames.push(&c.buf[..n]);
                loop {
                    match c.frames.next() {
                        Ok(Some(Frame::Input(bytes))) => typed.extend_from_slice(&bytes),
                        Ok(Some(Frame::Resize { rows, cols })) => {
                            resize(&pty.rx, term.live(), rows, cols);
                        }
                        Ok(Some(other)) => {
                            tracing::warn!(
                                "shell {name}: unexpected frame from the client: {other:?}"
                            );
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!("shell {name}: {e}; dropping the client");
                            client = None;
                            sink = None;
                            term.pack();
                            break;
                        }
                    }
                }
            }
            Turn::Typed(Ok(n)) => {
                typed.drain(..n);
                if typed.is_empty() {
                    typed = Vec::new(); // a parked shell keeps no buffer
                }
            }
            Turn::Typed(Err(e)) => {
                tracing::debug!("shell {name}: writing the pty: {e}");
                typed.clear();
            }
            Turn::Exited(s) => break s,
        }
    };
    let code = match &status {
        Ok(Some(s)) => s.code().unwrap_or(-1),
        Ok(None) => super::wire::EXIT_UNKNOWN,
        Err(_) => -1,
    };
    let _ = (&user, pid);
    tracing::info!("shell {name} exited ({code})");
    if let Some(mut c) = sink {
        c.push(Frame::Exit(code));
        c.flush_and_end(std::time::Duration::from_secs(5)).await;
    }
}

fn nz(v: u16) -> std::num::NonZeroU16 {
    std::num::NonZeroU16::new(v.max(1)).expect("at least 1")
}

/// Sets the pty's and the emulator's window size.
fn resize(master: impl AsFd, term: &mut vt100::Parser, rows: u16, cols: u16) {
    let ws = rustix::termios::Winsize {
        ws_row: rows.max(1),
        ws_col: cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    if let Err(e) = rustix::termios::tcsetwinsize(master, ws) {
        tracing::debug!("resizing the pty: {e}");
    }
    term.set_size(nz(rows), nz(cols));
}

/// What a client that attaches to a running shell is sent first: the
/// scrollback, pushed into its terminal's own scrollback, then the screen.
fn redraw(term: &mut vt100::Parser) -> Vec<u8> {
    let rows = term.screen().size().0.get();
    let mut out = b"\x1b[m\x1b[H\x1b[2J".to_vec();
    let history = scrollback_lines(term);
    for line in &history {
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !history.is_empty() {
        // Scroll the history off the visible screen before drawing it.
        out.extend(std::iter::repeat_n(
            b'\n',
            usize::from(rows).saturating_sub(1),
        ));
    }
    out.extend_from_slice(term.screen().contents_formatted().as_bytes());
    out
}

/// The scrollback's lines as text, oldest first (trailing blanks trimmed).
fn scrollback_lines(term: &mut vt100::Parser) -> Vec<String> {
    let (rows, cols) = term.screen().size();
    let screen = term.screen_mut();
    screen.set_scrollback(usize::MAX);
    let mut left = screen.scrollback();
    let mut lines = Vec::with_capacity(left);
    while left > 0 {
        screen.set_scrollback(left);
        let take = left.min(usize::from(rows.get()));
        lines.extend(
            screen
                .rows(0, cols.get())
                .take(take)
                .map(|l| l.trim_end().to_string()),
        );
        left -= take;
    }
    screen.set_scrollback(0);
    lines
}

async fn write_out(client: Option<&mut Sink>) -> std::io::Result<usize> {
    match client {
        Some(c) => match c.out.front() {
            Some(f) => c.wr.write(&f[c.pos..]).await,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

async fn read_client(client: Option<&mut Client>) -> std::io::Result<usize> {
    match client {
        Some(c) => c.rd.read(&mut c.buf).await,
        None => std::future::pending().await,
    }
}

/// Waits for our child shell; `None` at once for an adopted one (its end
/// showed as the pty's).
async fn wait_child(
    child: Option<&mut tokio::process::Child>,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    match child {
        Some(c) => c.wait().await.map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of the scrollback, oldest first, then the screen's text.
    fn everything(t: &mut vt100::Parser) -> (Vec<String>, String) {
        (scrollback_lines(t), t.screen().contents())
    }

    /// A parked shell's packed terminal, brought back, shows the same
    /// scrollback and screen as an emulator that was never packed, also
    /// with output that arrived while it was packed (over the raw limit,
    /// so it was re-packed on the way).
    #[test]
    fn a_packed_terminal_comes_back_as_it_would_have_been() {
        let mut plain = vt100::Parser::new(nz(24), nz(80), SCROLLBACK);
        let mut term = Terminal::new(24, 80);
        let mut feed = |bytes: &[u8], term: &mut Terminal| {
            plain.process(bytes);
            term.process(bytes);
        };
        let before: String = (1..=200).map(|i| format!("before-{i}\r\n")).collect();
        feed(before.as_bytes(), &mut term);
        feed(b"\x1b[1mbold prompt$ \x1b[m", &mut term);
        term.pack();
        let Terminal::Packed { image, .. } = &term else {
            panic!("not packed")
        };
        assert!(image.len() < 8 * 1024, "packed to {} bytes", image.len());
        let during: String = (1..=3000)
            .map(|i| format!("while-parked-{i}\r\n"))
            .collect();
        feed(during.as_bytes(), &mut term);
        feed(b"last$ ", &mut term);
        assert!(matches!(term, Terminal::Packed { .. }));
        let back = everything(term.live());
        let want = everything(&mut plain);
        assert_eq!(back.1, want.1, "screen");
        assert_eq!(back.0.len(), want.0.len(), "scrollback length");
        assert_eq!(back.0, want.0, "scrollback lines");
    }
}
