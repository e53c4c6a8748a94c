//! The relay's side of `roam shell` (`roam serve --shell`): shells on
//! pseudo-terminals, kept by name while their clients come and go.
//!
//! A shell request names an account; `account` checks that the client's
//! key may have a shell there and makes the command that starts it as
//! that account (uid, gid and the account's supplementary groups, in its
//! home), with no `unsafe` here.
//!
//! Each shell is one task here, and, while a client is attached, one
//! per-session process (`worker`, Migrate's complete continuation): the
//! worker runs the terminal emulator (`vt100`, with scrollback), reads the
//! pty and writes what is typed; this task copies whole client frames
//! between the client's stream and the worker, and keeps the worker's
//! journal of output. While no client is attached there is no worker: the
//! task holds the parked resources (the pty master, the shell process, the
//! packed terminal) and reads the pty into the packed terminal itself. A
//! new attach — the same client after a resume never needs one; a new
//! client process, after the old one was killed or detached — takes the
//! shell over: the old stream is reset, and the new client gets the
//! scrollback and the current screen, then live output. A worker that dies
//! while its client is attached (kill -9, a crash) is replaced at once from
//! the journal, and the client gets the current screen. When the shell
//! exits, the attached client gets its status.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use roam::RoamStream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::sync::mpsc;

use super::account::{self, Account, Login};
use super::wire::{Attached, Decoder, Frame, Open};
use super::worker::{self, Ctl, CtlDecoder, StartHeader};

/// Lines of scrollback each shell keeps (sent on re-attach).
const SCROLLBACK: usize = 5000;
/// Output held for a client that does not read (suspended, or killed and
/// not yet replaced). Beyond it the held output is dropped and the client,
/// once it reads again, gets the current screen instead: the shell never
/// blocks on a client that is away.
pub(super) const OUT_LIMIT: usize = 1 << 20;
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
    /// The client's session, watched while attached: a suspended client
    /// gets no worker ([`Dormant`]).
    session: Option<SessionWatch>,
    /// Send only the screen, without an `Attached` frame (the same client
    /// back after its session resumed).
    quiet: bool,
}

/// A client's session and its events.
struct SessionWatch {
    session: roam::SessionHandle,
    events: tokio::sync::broadcast::Receiver<roam::SessionEvent>,
}

impl SessionWatch {
    fn new(session: roam::SessionHandle) -> Self {
        let events = session.events();
        SessionWatch { session, events }
    }

    /// The next change that matters: `true` the session was suspended,
    /// `false` it resumed; never if it is over (its stream says so).
    async fn change(&mut self) -> bool {
        loop {
            match self.events.recv().await {
                Ok(roam::SessionEvent::Suspended { .. }) => return true,
                Ok(roam::SessionEvent::Resumed { .. }) => return false,
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    match self.session.stats().state {
                        roam::State::Suspended => return true,
                        roam::State::Active => return false,
                        _ => {}
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    std::future::pending::<()>().await
                }
            }
        }
    }
}

async fn session_change(watch: Option<&mut SessionWatch>) -> bool {
    match watch {
        Some(w) => w.change().await,
        None => std::future::pending().await,
    }
}

/// An attached client whose session is suspended: its stream waits here,
/// with no worker, until the session resumes (the client then gets the
/// screen from a new worker) or another client attaches.
struct Dormant {
    stream: RoamStream,
    watch: SessionWatch,
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
    /// Kept up to date by the shell's task.
    now: Arc<Now>,
}

/// What a shell is doing, for `roam status`.
#[derive(Default)]
struct Now {
    /// A client is attached.
    attached: AtomicBool,
    /// The process id of its worker, 0 while there is none.
    worker: AtomicU32,
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
        session: Option<roam::SessionHandle>,
        open: Result<Open, String>,
    ) {
        let key = session.as_ref().and_then(|s| s.peer_key());
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
                .attach_or_start(stream, session, account, name, open)
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
        session: Option<roam::SessionHandle>,
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
            session: session.map(SessionWatch::new),
            quiet: false,
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
        let worker_as = login.worker_as.clone();
        let (pty, child) = match spawn_shell(login, req.rows, req.cols) {
            Ok(x) => x,
            Err(why) => return Err((why, req.stream)),
        };
        tracing::info!(
            "shell {name} of {} started (pid {})",
            account.name,
            child.id().unwrap_or(0)
        );
        let spec = WorkerSpec::record(&account.name, &name, Ok(worker_as));
        let shell = Shell {
            user: account.name,
            name,
            pid: child.id().unwrap_or(0),
            pty,
            child: Some(child),
            term: Terminal::new(req.rows, req.cols),
            spec,
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
        let now = Arc::new(Now::default());
        self.lock().insert(
            slot.clone(),
            Entry {
                tx: tx.clone(),
                pid: shell.pid,
                now: now.clone(),
            },
        );
        let mine = tx.clone();
        tokio::spawn(async move {
            run_shell(shell, first, rx, now).await;
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
                attached: e.now.attached.load(Ordering::Relaxed),
                worker: Some(e.now.worker.load(Ordering::Relaxed)).filter(|&p| p != 0),
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
        let pty = Pty::from_master(h.pty).map_err(|e| format!("pty: {e}"))?;
        tracing::info!("shell {} of {} (pid {}) adopted", h.name, h.user, h.pid);
        self.clone().run(
            Shell {
                spec: WorkerSpec::record(&h.user, &h.name, account::become_user(&h.user)),
                user: h.user,
                name: h.name,
                pid: h.pid,
                pty,
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
    /// How its workers are started.
    spec: WorkerSpec,
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
        worker_as: _,
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
    let pty = Pty::from_master(pty.master).map_err(|e| format!("pty: {e}"))?;
    Ok((pty, child))
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

/// A pty master as the relay or a worker drives it (the reading end also
/// serves the window-size ioctl).
pub(super) struct Pty {
    pub(super) rx: tokio::net::unix::pipe::Receiver,
    pub(super) tx: tokio::net::unix::pipe::Sender,
}

impl Pty {
    /// Drives `master` (non-blocking already: the flag belongs to the
    /// open pty, shared by every copy). A pty master polls like a pipe:
    /// tokio's pipe ends drive it without `unsafe` here (AsyncFd needs an
    /// unsafe registration). Two descriptors, as one cannot be registered
    /// twice with the reactor.
    pub(super) fn from_master(master: OwnedFd) -> std::io::Result<Pty> {
        let writing = master.try_clone()?;
        Ok(Pty {
            rx: tokio::net::unix::pipe::Receiver::from_owned_fd_unchecked(master)?,
            tx: tokio::net::unix::pipe::Sender::from_owned_fd_unchecked(writing)?,
        })
    }
}

/// A client's reading side (the relay's: the client's stream; a worker's:
/// the relay's copy of it).
pub(super) struct Client<R> {
    rd: R,
    pub(super) frames: Decoder,
    /// Where reads land (gone with the client).
    pub(super) buf: Vec<u8>,
}

impl<R> Client<R> {
    pub(super) fn new(rd: R) -> Self {
        Client {
            rd,
            frames: Decoder::default(),
            buf: vec![0u8; 16 * 1024],
        }
    }
}

/// A client's writing side.
pub(super) struct Sink<W> {
    wr: W,
    /// Encoded frames not yet taken by the stream; the first may be partly
    /// taken (up to `pos`).
    out: std::collections::VecDeque<Vec<u8>>,
    pos: usize,
    /// Bytes in `out` (not counting those taken).
    pub(super) held: usize,
    /// Output was dropped (over [`OUT_LIMIT`]): redraw the screen once
    /// `out` has been taken.
    pub(super) stale: bool,
}

impl<W: AsyncWrite + Unpin> Sink<W> {
    pub(super) fn new(wr: W) -> Self {
        Sink {
            wr,
            out: std::collections::VecDeque::new(),
            pos: 0,
            held: 0,
            stale: false,
        }
    }

    pub(super) fn push(&mut self, frame: Frame) {
        let mut bytes = Vec::new();
        frame.encode(&mut bytes);
        self.held += bytes.len();
        self.out.push_back(bytes);
    }

    /// Drops every frame not begun (a frame partly taken is finished, so
    /// the stream stays framed).
    pub(super) fn drop_unsent(&mut self) {
        let keep = usize::from(self.pos > 0);
        while self.out.len() > keep {
            if let Some(f) = self.out.pop_back() {
                self.held -= f.len();
            }
        }
    }

    /// Writes everything held, then ends the stream; at most `limit`.
    pub(super) async fn flush_and_end(mut self, limit: std::time::Duration) {
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
    pub(super) fn taken(&mut self, n: usize) {
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
pub(super) const IN_LIMIT: usize = 64 * 1024;

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
pub(super) enum Terminal {
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
    pub(super) fn live(&mut self) -> &mut vt100::Parser {
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
    pub(super) fn pack(&mut self) {
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
    pub(super) fn process(&mut self, bytes: &[u8]) {
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

/// The recorded start of a shell's per-session process (`roam
/// shell-worker`): every worker the shell gets starts with the same argv,
/// environment and working directory, as the shell's account.
#[derive(Debug, Clone)]
pub(crate) struct WorkerSpec {
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    /// Why no worker can start (the account is gone), if so.
    refused: Option<String>,
}

impl WorkerSpec {
    /// This relay's binary, run as `shell-worker` in `/` behind `run_as`
    /// (the `setpriv` prefix that makes it the account: the terminal
    /// emulator that parses the shell's output never runs as root for
    /// another account), with only `PATH`, `LANG` and `RUST_LOG` (if set)
    /// from the relay's environment.
    fn record(user: &str, name: &str, run_as: Result<Vec<OsString>, String>) -> Self {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("roam"));
        let env = ["PATH", "LANG", "RUST_LOG"]
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect();
        let (mut argv, refused) = match run_as {
            Ok(prefix) => (prefix, None),
            Err(why) => (Vec::new(), Some(why)),
        };
        argv.extend([
            exe.into_os_string(),
            "shell-worker".into(),
            "--shell".into(),
            format!("{user}/{name}").into(),
        ]);
        let program = argv.remove(0);
        WorkerSpec {
            program,
            args: argv,
            env,
            cwd: PathBuf::from("/"),
            refused,
        }
    }
}

/// A shell's worker process as its relay task holds it.
struct Worker {
    proc: tokio::process::Child,
    pid: u32,
    ctl_rd: tokio::net::unix::OwnedReadHalf,
    ctl_wr: tokio::net::unix::OwnedWriteHalf,
    ctl: CtlDecoder,
    ctl_eof: bool,
    /// The client's frames, both ways; `a_wr` is dropped to detach.
    a_rd: tokio::net::unix::OwnedReadHalf,
    a_wr: Option<tokio::net::unix::OwnedWriteHalf>,
    frames: Decoder,
    a_eof: bool,
    /// The worker said the pty ended.
    closed: bool,
    /// A checkpoint was asked for and its image has not come yet.
    checkpointing: bool,
}

/// Journal a worker may send before the relay asks it for a checkpoint
/// (its terminal image, which replaces the image and journal held here).
const CHECKPOINT_AT: usize = 256 * 1024;
/// Worker deaths tolerated within [`RESTART_WINDOW`] while one client is
/// attached; past them the client is told and let go.
const MAX_RESTARTS: u32 = 3;
const RESTART_WINDOW: Duration = Duration::from_secs(10);
/// Client output the relay holds for a client that does not read before
/// it stops reading the worker (which then holds, up to [`OUT_LIMIT`]).
const HOLD: usize = 256 * 1024;

/// Starts a worker for `pty` from `term` (packed first): sends it the pty
/// and the start frame.
async fn start_worker(
    spec: &WorkerSpec,
    pty: &Pty,
    term: &mut Terminal,
    mut header: StartHeader,
) -> Result<Worker, String> {
    use std::os::unix::net::UnixStream;
    use std::process::Stdio;
    let io = |what: &str, e: std::io::Error| format!("starting the shell's worker: {what}: {e}");
    if let Some(why) = &spec.refused {
        return Err(format!("starting the shell's worker: {why}"));
    }
    let (ctl_mine, ctl_theirs) = UnixStream::pair().map_err(|e| io("socket", e))?;
    let (a_mine, a_theirs) = UnixStream::pair().map_err(|e| io("socket", e))?;
    worker::send_pty(&ctl_mine, pty.rx.as_fd()).map_err(|e| io("passing the pty", e))?;
    let mut cmd = tokio::process::Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(&spec.cwd)
        .stdin(Stdio::from(OwnedFd::from(ctl_theirs)))
        .stdout(Stdio::from(OwnedFd::from(a_theirs)))
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let proc = cmd
        .spawn()
        .map_err(|e| io(&spec.program.to_string_lossy(), e))?;
    let pid = proc.id().unwrap_or(0);
    let (ctl_rd, mut ctl_wr) = worker::to_tokio(ctl_mine)
        .map_err(|e| io("socket", e))?
        .into_split();
    let (a_rd, a_wr) = worker::to_tokio(a_mine)
        .map_err(|e| io("socket", e))?
        .into_split();
    term.pack();
    let Terminal::Packed {
        image,
        rows,
        cols,
        raw,
    } = &*term
    else {
        unreachable!("packed above")
    };
    header.term_rows = *rows;
    header.term_cols = *cols;
    let mut start = Vec::with_capacity(image.len() + raw.len() + 256);
    Ctl::Start {
        header,
        image: image.clone(),
        raw: raw.clone(),
    }
    .encode(&mut start);
    ctl_wr
        .write_all(&start)
        .await
        .map_err(|e| io("sending its start", e))?;
    Ok(Worker {
        proc,
        pid,
        ctl_rd,
        ctl_wr,
        ctl: CtlDecoder::default(),
        ctl_eof: false,
        a_rd,
        a_wr: Some(a_wr),
        frames: Decoder::default(),
        a_eof: false,
        closed: false,
        checkpointing: false,
    })
}

impl Worker {
    /// Takes the control frames read so far into `term`; `false` if the
    /// worker sent something it must not (it is then killed).
    fn take_ctl(&mut self, term: &mut Terminal, name: &str) -> bool {
        loop {
            match self.ctl.next() {
                Ok(None) => return true,
                Ok(Some(Ctl::Journal(bytes))) => {
                    if let Terminal::Packed { raw, .. } = term {
                        raw.extend_from_slice(&bytes);
                    } else {
                        term.process(&bytes);
                    }
                }
                Ok(Some(Ctl::Resized { rows, cols })) => {
                    term.live().set_size(nz(rows), nz(cols));
                    term.pack();
                }
                Ok(Some(Ctl::Image { rows, cols, image })) => {
                    self.checkpointing = false;
                    *term = Terminal::Packed {
                        image,
                        rows,
                        cols,
                        raw: Vec::new(),
                    };
                }
                Ok(Some(Ctl::Closed)) => self.closed = true,
                Ok(Some(other)) => {
                    tracing::warn!("shell {name}: its worker sent {other:?}; stopping it");
                    let _ = self.proc.start_kill();
                    return false;
                }
                Err(e) => {
                    tracing::warn!("shell {name}: its worker: {e}; stopping it");
                    let _ = self.proc.start_kill();
                    return false;
                }
            }
        }
    }

    /// Reads the control socket to its end (the worker has exited or is
    /// ending), taking everything into `term`; at most `limit`.
    async fn drain_ctl(&mut self, term: &mut Terminal, name: &str, limit: Duration) {
        let mut buf = vec![0u8; 64 * 1024];
        let drain = async {
            while !self.ctl_eof {
                match self.ctl_rd.read(&mut buf).await {
                    Ok(0) | Err(_) => self.ctl_eof = true,
                    Ok(n) => {
                        self.ctl.push(&buf[..n]);
                        if !self.take_ctl(term, name) {
                            self.ctl_eof = true;
                        }
                    }
                }
            }
        };
        if tokio::time::timeout(limit, drain).await.is_err() {
            tracing::warn!("shell {name}: its worker did not finish in {limit:?}; stopping it");
        }
    }

    /// Detaches the worker: its client input ends, it sends its terminal
    /// image (taken into `term`) and exits; killed if it takes over 2 s.
    async fn stop(mut self, term: &mut Terminal, name: &str) {
        self.a_wr = None;
        self.drain_ctl(term, name, Duration::from_secs(2)).await;
        if tokio::time::timeout(Duration::from_secs(1), self.proc.wait())
            .await
            .is_err()
        {
            let _ = self.proc.start_kill();
            let _ = self.proc.wait().await;
        }
    }
}

/// How an attached client's time ended.
enum Left {
    /// The client went: the shell is parked again.
    Detached,
    /// A relay takeover: the client was told to re-attach.
    Handover(tokio::sync::oneshot::Sender<HandedShell>),
    /// The pty ended; the client waits for the shell's exit status.
    Ended(Sink<WriteHalf<RoamStream>>),
    /// The client's session was suspended: its worker is gone, its stream
    /// waits.
    Dormant(Dormant),
}

/// One turn of an attached shell's loop in the relay.
enum Turn {
    Msg(Option<Msg>),
    Client(std::io::Result<usize>),
    ToWorker(std::io::Result<usize>),
    FromWorker(std::io::Result<usize>),
    Wrote(std::io::Result<usize>),
    Ctl(std::io::Result<usize>),
    Exited(std::io::Result<std::process::ExitStatus>),
    Session(bool),
}

async fn write_worker(
    wr: Option<&mut tokio::net::unix::OwnedWriteHalf>,
    bytes: &[u8],
) -> std::io::Result<usize> {
    match wr {
        Some(w) => w.write(bytes).await,
        None => std::future::pending().await,
    }
}

/// A shell's parked resources while a client is attached: the relay's
/// task runs workers for the client (another if one dies) until the client
/// goes, another client takes over, a takeover asks, or the pty ends.
struct Attending<'a> {
    name: &'a str,
    pty: &'a Pty,
    term: &'a mut Terminal,
    spec: &'a WorkerSpec,
    now: &'a Now,
    msgs: &'a mut mpsc::Receiver<Msg>,
}

impl Attending<'_> {
    async fn run(self, first: Attach) -> Left {
        let name = self.name;
        let mut req = first;
        'client: loop {
            let (rd, wr) = tokio::io::split(req.stream);
            let mut watch = req.session;
            let mut client = Client::new(rd);
            let mut sink = Sink::new(wr);
            let mut header = StartHeader {
                name: name.to_string(),
                new: req.new,
                scrollback: req.scrollback,
                quiet: req.quiet,
                rows: req.rows,
                cols: req.cols,
                term_rows: 0,
                term_cols: 0,
            };
            let mut restarts = 0u32;
            let mut window = tokio::time::Instant::now();
            loop {
                let mut w = match start_worker(self.spec, self.pty, self.term, header.clone()).await
                {
                    Ok(w) => w,
                    Err(why) => {
                        tracing::warn!("shell {name}: {why}");
                        sink.push(Frame::Error(why));
                        sink.flush_and_end(Duration::from_secs(1)).await;
                        return Left::Detached;
                    }
                };
                self.now.worker.store(w.pid, Ordering::Relaxed);
                tracing::debug!("shell {name}: worker {} started", w.pid);
                let mut to_worker: Vec<u8> = Vec::new();
                let mut a_buf = vec![0u8; 16 * 1024];
                let mut c_buf = vec![0u8; 16 * 1024];
                let status = loop {
                    let held = sink.held;
                    let turn = tokio::select! {
                        m = self.msgs.recv() => Turn::Msg(m),
                        r = read_client(Some(&mut client)), if to_worker.len() < IN_LIMIT => Turn::Client(r),
                        r = write_worker(w.a_wr.as_mut(), &to_worker), if !to_worker.is_empty() => Turn::ToWorker(r),
                        r = w.a_rd.read(&mut a_buf), if held < HOLD && !w.a_eof => Turn::FromWorker(r),
                        r = write_out(Some(&mut sink)), if held > 0 => Turn::Wrote(r),
                        r = w.ctl_rd.read(&mut c_buf), if !w.ctl_eof => Turn::Ctl(r),
                        s = w.proc.wait() => Turn::Exited(s),
                        c = session_change(watch.as_mut()) => Turn::Session(c),
                    };
                    match turn {
                        Turn::Msg(None) => {}
                        Turn::Msg(Some(Msg::Attach(a))) => {
                            // Taken over by a newer client process.
                            w.stop(self.term, name).await;
                            let _ = sink.wr.shutdown().await;
                            req = a;
                            continue 'client;
                        }
                        Turn::Msg(Some(Msg::Handover(reply))) => {
                            w.stop(self.term, name).await;
                            // The client re-attaches to the next relay; what
                            // it has not been sent yet it gets as the screen
                            // there.
                            sink.drop_unsent();
                            sink.push(Frame::Reattach);
                            sink.flush_and_end(Duration::from_millis(200)).await;
                            return Left::Handover(reply);
                        }
                        Turn::Client(Ok(0)) | Turn::Client(Err(_)) | Turn::Wrote(Err(_)) => {
                            w.stop(self.term, name).await;
                            return Left::Detached;
                        }
                        Turn::Client(Ok(n)) => {
                            client.frames.push(&client.buf[..n]);
                            loop {
                                match client.frames.next() {
                                    Ok(Some(f @ (Frame::Input(_) | Frame::Resize { .. }))) => {
                                        f.encode(&mut to_worker)
                                    }
                                    Ok(Some(other)) => tracing::warn!(
                                        "shell {name}: unexpected frame from the client: {other:?}"
                                    ),
                                    Ok(None) => break,
                                    Err(e) => {
                                        tracing::warn!("shell {name}: {e}; dropping the client");
                                        w.stop(self.term, name).await;
                                        return Left::Detached;
                                    }
                                }
                            }
                        }
                        Turn::ToWorker(Ok(n)) => {
                            to_worker.drain(..n);
                        }
                        // The worker is going: its exit is the next turn.
                        Turn::ToWorker(Err(_)) => {
                            to_worker.clear();
                            w.a_wr = None;
                        }
                        Turn::FromWorker(Ok(0)) | Turn::FromWorker(Err(_)) => w.a_eof = true,
                        Turn::FromWorker(Ok(n)) => {
                            w.frames.push(&a_buf[..n]);
                            loop {
                                match w.frames.next() {
                                    Ok(Some(f)) => sink.push(f),
                                    Ok(None) => break,
                                    Err(e) => {
                                        tracing::warn!(
                                            "shell {name}: its worker: {e}; stopping it"
                                        );
                                        let _ = w.proc.start_kill();
                                        w.a_eof = true;
                                        break;
                                    }
                                }
                            }
                        }
                        Turn::Wrote(Ok(n)) => sink.taken(n),
                        Turn::Ctl(Ok(0)) | Turn::Ctl(Err(_)) => w.ctl_eof = true,
                        Turn::Ctl(Ok(n)) => {
                            w.ctl.push(&c_buf[..n]);
                            if !w.take_ctl(self.term, name) {
                                w.ctl_eof = true;
                            }
                            let journal = match &*self.term {
                                Terminal::Packed { raw, .. } => raw.len(),
                                Terminal::Live(_) => 0,
                            };
                            if journal > CHECKPOINT_AT && !w.checkpointing && !w.closed {
                                let mut ask = Vec::new();
                                Ctl::Checkpoint.encode(&mut ask);
                                w.checkpointing = w.ctl_wr.write_all(&ask).await.is_ok();
                            }
                        }
                        Turn::Exited(s) => break s,
                        Turn::Session(false) => {}
                        Turn::Session(true) => {
                            // Nobody to show the shell to for now: the
                            // worker goes, the stream waits for the
                            // session to resume.
                            w.stop(self.term, name).await;
                            let Some(watch) = watch else {
                                unreachable!("a session change needs a session")
                            };
                            return Left::Dormant(Dormant {
                                stream: client.rd.unsplit(sink.wr),
                                watch,
                            });
                        }
                    }
                };
                // The worker has exited: what it sent before is still in
                // the sockets.
                w.drain_ctl(self.term, name, Duration::from_secs(1)).await;
                let mut rest = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(1), w.a_rd.read_to_end(&mut rest))
                    .await;
                w.frames.push(&rest);
                while let Ok(Some(f)) = w.frames.next() {
                    sink.push(f);
                }
                self.now.worker.store(0, Ordering::Relaxed);
                if w.closed {
                    return Left::Ended(sink);
                }
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                if window.elapsed() > RESTART_WINDOW {
                    restarts = 0;
                    window = tokio::time::Instant::now();
                }
                restarts += 1;
                if restarts > MAX_RESTARTS {
                    let why = format!(
                        "the shell's worker process keeps failing (last: {status}); the shell goes on: re-attach to try again"
                    );
                    tracing::warn!("shell {name}: {why}");
                    sink.push(Frame::Error(why));
                    sink.flush_and_end(Duration::from_secs(1)).await;
                    return Left::Detached;
                }
                tracing::warn!(
                    "shell {name}: its worker (pid {}) ended while attached ({status}); starting another",
                    w.pid
                );
                // The new worker redraws the client's screen from the
                // journal; the client is not told anything else.
                header.new = false;
                header.scrollback = false;
                header.quiet = true;
                header.rows = 0;
                header.cols = 0;
            }
        }
    }
}

/// Reads the pty of a parked shell into its packed terminal; `false` once
/// the pty has ended.
fn read_parked(pty: &Pty, term: &mut Terminal) -> bool {
    SCRATCH.with_borrow_mut(|buf| match pty.rx.try_read(buf) {
        Ok(0) => false,
        Ok(n) => {
            term.process(&buf[..n]);
            true
        }
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    })
}

/// Hands a shell to `reply` (a relay takeover).
fn hand_over(shell: Shell, reply: tokio::sync::oneshot::Sender<HandedShell>) {
    let Shell {
        user,
        name,
        pid,
        pty,
        child,
        mut term,
        ..
    } = shell;
    let (rows, cols) = {
        let (r, c) = term.live().screen().size();
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
                tracing::warn!("shell {name}: handover abandoned; the shell loses its pty");
                drop(h);
            }
        }
        Err(e) => tracing::warn!("shell {name}: cannot hand over its pty: {e}"),
    }
}

/// Runs one shell until it exits or is handed over.
async fn run_shell(
    mut shell: Shell,
    first: Option<Attach>,
    mut msgs: mpsc::Receiver<Msg>,
    now: Arc<Now>,
) {
    let name = shell.name.clone();
    let mut pty_open = true;
    // A client that waits for the shell's exit status.
    let mut waiting: Option<Sink<WriteHalf<RoamStream>>> = None;
    // A client whose session is suspended.
    let mut dormant: Option<Dormant> = None;
    let mut next = first.map(Msg::Attach);
    let status = loop {
        now.attached.store(waiting.is_some(), Ordering::Relaxed);
        let msg = match next.take() {
            Some(m) => Some(m),
            None => tokio::select! {
                m = msgs.recv() => m,
                r = shell.pty.rx.readable(), if pty_open => {
                    if r.is_err() || !read_parked(&shell.pty, &mut shell.term) {
                        pty_open = false;
                    }
                    continue;
                }
                s = wait_child(shell.child.as_mut()), if !pty_open => break s,
                suspended = session_change(dormant.as_mut().map(|d| &mut d.watch)) => {
                    if let (false, Some(d)) = (suspended, dormant.take()) {
                        // The same client is back: a new worker, the screen.
                        next = Some(Msg::Attach(Attach {
                            stream: d.stream,
                            rows: 0,
                            cols: 0,
                            new: false,
                            scrollback: false,
                            session: Some(d.watch),
                            quiet: true,
                        }));
                    }
                    continue;
                }
            },
        };
        if matches!(msg, Some(Msg::Attach(_))) {
            if let Some(d) = dormant.take() {
                // Another client takes the shell over from a suspended one.
                let mut stream = d.stream;
                let _ = stream.shutdown().await;
            }
        }
        match msg {
            None => {}
            Some(Msg::Handover(reply)) => {
                if let Some(d) = dormant.take() {
                    let (_, wr) = tokio::io::split(d.stream);
                    waiting = Some(Sink::new(wr));
                }
                if let Some(mut s) = waiting.take() {
                    s.drop_unsent();
                    s.push(Frame::Reattach);
                    s.flush_and_end(Duration::from_millis(200)).await;
                }
                hand_over(shell, reply);
                return;
            }
            Some(Msg::Attach(a)) if !pty_open => {
                // The shell has ended: this client gets the last screen
                // and waits for the status with the others.
                if let Some(mut old) = waiting.take() {
                    let _ = old.wr.shutdown().await;
                }
                let (_, wr) = tokio::io::split(a.stream);
                let mut s = Sink::new(wr);
                if !a.quiet {
                    s.push(Frame::Attached(Attached {
                        name: name.clone(),
                        new: a.new,
                    }));
                }
                s.push(Frame::Output(redraw(shell.term.live())));
                waiting = Some(s);
            }
            Some(Msg::Attach(a)) => {
                now.attached.store(true, Ordering::Relaxed);
                let left = Attending {
                    name: &name,
                    pty: &shell.pty,
                    term: &mut shell.term,
                    spec: &shell.spec,
                    now: &now,
                    msgs: &mut msgs,
                }
                .run(a)
                .await;
                now.worker.store(0, Ordering::Relaxed);
                shell.term.pack();
                match left {
                    Left::Detached => tracing::info!("shell {name}: client detached"),
                    Left::Handover(reply) => {
                        hand_over(shell, reply);
                        return;
                    }
                    Left::Ended(sink) => {
                        pty_open = false;
                        waiting = Some(sink);
                    }
                    Left::Dormant(d) => {
                        tracing::info!("shell {name}: its client's session is suspended");
                        dormant = Some(d);
                    }
                }
            }
        }
    };
    let code = match &status {
        Ok(Some(s)) => s.code().unwrap_or(-1),
        Ok(None) => super::wire::EXIT_UNKNOWN,
        Err(_) => -1,
    };
    tracing::info!("shell {name} exited ({code})");
    if let (None, Some(d)) = (&waiting, dormant) {
        // Delivered if its session resumes.
        waiting = Some(Sink::new(tokio::io::split(d.stream).1));
    }
    if let Some(mut c) = waiting {
        c.push(Frame::Exit(code));
        c.flush_and_end(Duration::from_secs(5)).await;
    }
}

pub(super) fn nz(v: u16) -> std::num::NonZeroU16 {
    std::num::NonZeroU16::new(v.max(1)).expect("at least 1")
}

/// Sets the pty's and the emulator's window size.
pub(super) fn resize(master: impl AsFd, term: &mut vt100::Parser, rows: u16, cols: u16) {
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
pub(super) fn redraw(term: &mut vt100::Parser) -> Vec<u8> {
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

pub(super) async fn write_out<W: AsyncWrite + Unpin>(
    client: Option<&mut Sink<W>>,
) -> std::io::Result<usize> {
    match client {
        Some(c) => match c.out.front() {
            Some(f) => c.wr.write(&f[c.pos..]).await,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

pub(super) async fn read_client<R: AsyncRead + Unpin>(
    client: Option<&mut Client<R>>,
) -> std::io::Result<usize> {
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
