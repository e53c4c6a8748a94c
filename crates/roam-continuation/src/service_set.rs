//! Service sets over real sockets (issue 15): the tokio layer over
//! `roam-service`'s sans-IO core.
//!
//! Each process of a service set is a [`Member`]: its channel ends (one
//! [`Endpoint`] per channel, used in one direction: a Unix socket, a TCP
//! connection, or a pipe or FIFO) behind one lock,
//! with `write_all`, `read` and `export` (eager: the snapshot copied) or
//! `export_owned` (lazy: the snapshot's buffer taken, the previous one
//! handed back) for the application. A coordinator
//! (the root process, or whoever moves sessions) talks to each member over
//! a control socket ([`Control`]): it freezes every member, has each drain
//! its readers and send its part, checks the whole cut, starts the
//! destination's members from their restarted parts, ends the source's and
//! thaws the destination's. A member that cannot give its part (its log
//! over the cap) answers with the reason; the coordinator thaws the source
//! and the session goes on there.
//!
//! The control protocol: frames of a `u32` big-endian length, a type byte
//! and a body. Member to coordinator: `HELLO`(role name) first, `READY`
//! once its channels are connected, then `ACK`, `PART`(an encoded
//! one-part [`Cut`]) or `REFUSED`(a reason).
//! Coordinator to member: `START`(empty for a fresh start, else its
//! restarted part) first, then `FREEZE`, `CUT`, `THAW`, `END`.
//!
//! ## A set carried in a managed session's continuation
//!
//! A [`SessionSet`] is a set whose root is the process holding a client's
//! managed session (a [`Host`](crate::Host)'s service): the root is a
//! [`Member`] in the host's process, its back-ends are processes reached
//! through their [`Control`]s. When roam asks the session for its
//! continuation (any [`FreezeReason`](crate::FreezeReason), a cluster's
//! move included), the routine calls [`SessionSet::save`] at a quiescent
//! point: the whole set is frozen, every part taken, the cut checked and
//! stored in the session's attribute [`CUT_ATTR`], and the back-ends
//! ended; then it suspends. A save that fails (a back-end refused its
//! part, died or did not answer) thaws the set and calls the move off at
//! once, naming the back-end. A move's destination restarts the set
//! before the move commits, in its
//! [`Service::prepare_move_in`](crate::Service::prepare_move_in)
//! ([`Restored::from_attrs`], the back-ends started from their parts and
//! kept frozen as a [`Staged`]): a back-end that cannot start there
//! refuses the move, and the session stays at its source. After the
//! commit the resume routine [`Staged::start`]s it. A back-end that dies
//! between its staging and its thaw (the start fails, naming it) is
//! started again from the same cut, which the session still carries: it
//! ran nothing since its part was taken. Wherever else the session
//! resumes (the source after an abort, this host after a restart, a
//! staged set that did not start), the resume routine calls
//! [`SessionSet::restore`], starts the back-ends from their restarted
//! parts and [`Restored::start`]s the set.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use roam_service::{ChannelId, Cut, Interval, Limits, Part, Process};
use tokio::net::unix::pipe;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::Notify;

mod control;

use control::{recv, send, ACK, CUT, END, FREEZE, HELLO, PART, READY, REFUSED, START, THAW};
pub use control::{Control, DEFAULT_ANSWER_TIMEOUT};

/// What one end of a channel between two members runs on. Only its
/// direction's half is used: a member reads a channel it reads and writes
/// one it writes.
#[derive(Debug)]
pub enum Endpoint {
    /// A Unix stream socket.
    Unix(UnixStream),
    /// A TCP connection (a back-end on another host).
    Tcp(TcpStream),
    /// The write end of a pipe or FIFO.
    PipeWriter(pipe::Sender),
    /// The read end of a pipe or FIFO.
    PipeReader(pipe::Receiver),
}

impl From<UnixStream> for Endpoint {
    fn from(s: UnixStream) -> Self {
        Endpoint::Unix(s)
    }
}

impl From<TcpStream> for Endpoint {
    fn from(s: TcpStream) -> Self {
        Endpoint::Tcp(s)
    }
}

impl From<pipe::Sender> for Endpoint {
    fn from(s: pipe::Sender) -> Self {
        Endpoint::PipeWriter(s)
    }
}

impl From<pipe::Receiver> for Endpoint {
    fn from(s: pipe::Receiver) -> Self {
        Endpoint::PipeReader(s)
    }
}

fn wrong_way(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{what} on the wrong end of a pipe"),
    )
}

impl Endpoint {
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Endpoint::Unix(s) => s.try_read(buf),
            Endpoint::Tcp(s) => s.try_read(buf),
            Endpoint::PipeReader(s) => s.try_read(buf),
            Endpoint::PipeWriter(_) => Err(wrong_way("a read")),
        }
    }

    /// A non-blocking read straight from the descriptor, not through
    /// tokio's readiness, which can lag behind bytes already in the socket
    /// or pipe (the reactor has not yet seen their event, so `try_read`
    /// says `WouldBlock` without reading): a cut's drain must take every
    /// byte the frozen writers sent. `WouldBlock` once it is empty.
    fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::fd::AsFd;
        let fd = match self {
            Endpoint::Unix(s) => s.as_fd(),
            Endpoint::Tcp(s) => s.as_fd(),
            Endpoint::PipeReader(s) => s.as_fd(),
            Endpoint::PipeWriter(_) => return Err(wrong_way("a read")),
        };
        nix::unistd::read(fd, buf).map_err(io::Error::from)
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Endpoint::Unix(s) => s.try_write(buf),
            Endpoint::Tcp(s) => s.try_write(buf),
            Endpoint::PipeWriter(s) => s.try_write(buf),
            Endpoint::PipeReader(_) => Err(wrong_way("a write")),
        }
    }

    async fn readable(&self) -> io::Result<()> {
        match self {
            Endpoint::Unix(s) => s.readable().await,
            Endpoint::Tcp(s) => s.readable().await,
            Endpoint::PipeReader(s) => s.readable().await,
            Endpoint::PipeWriter(_) => Err(wrong_way("a read")),
        }
    }

    async fn writable(&self) -> io::Result<()> {
        match self {
            Endpoint::Unix(s) => s.writable().await,
            Endpoint::Tcp(s) => s.writable().await,
            Endpoint::PipeWriter(s) => s.writable().await,
            Endpoint::PipeReader(_) => Err(wrong_way("a write")),
        }
    }
}

/// One process of a service set.
#[derive(Clone)]
pub struct Member {
    /// The ends, the sockets and the freeze flag, taken only briefly.
    inner: Arc<Mutex<Inner>>,
    /// Woken when the member is thawed.
    thawed: Arc<Notify>,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("frozen", &self.lock().frozen)
            .finish_non_exhaustive()
    }
}

/// A member's state behind its lock.
struct Inner {
    /// The sans-IO ends and the last snapshot.
    process: Process,
    /// The socket or pipe of each channel this process reads.
    readers: BTreeMap<ChannelId, Arc<Endpoint>>,
    /// The socket or pipe of each channel this process writes.
    writers: BTreeMap<ChannelId, Arc<Endpoint>>,
    /// Frozen by the coordinator: no byte moves until thawed.
    frozen: bool,
    /// What a socket read lands in before its reader end takes it: one
    /// buffer for the member's life (sized at its first read), not one
    /// per read.
    scratch: Vec<u8>,
}

/// The most one socket read takes.
const READ_CHUNK: usize = 64 << 10;

fn cut_error(e: roam_service::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Member {
    /// A member at its first start (no snapshot).
    pub fn fresh(limits: Limits) -> Self {
        Self::from_process(Process::new(limits), false)
    }

    /// A member restarted from its part of a moved cut; it stays frozen
    /// until the coordinator thaws it.
    pub fn restarted(part: &[u8], limits: Limits) -> io::Result<Self> {
        let cut = Cut::decode(part).map_err(cut_error)?;
        let [part] = &cut.parts[..] else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a restarted member's cut must hold exactly one part",
            ));
        };
        let process = Process::restarted(part, limits).map_err(cut_error)?;
        Ok(Self::from_process(process, true))
    }

    fn from_process(process: Process, frozen: bool) -> Self {
        Member {
            inner: Arc::new(Mutex::new(Inner {
                process,
                readers: BTreeMap::new(),
                writers: BTreeMap::new(),
                frozen,
                scratch: Vec::new(),
            })),
            thawed: Arc::new(Notify::new()),
        }
    }

    /// Lets a frozen member run (the root's own thaw; others are thawed
    /// over their control socket).
    fn thaw(&self) {
        self.lock().frozen = false;
        self.thawed.notify_waiters();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `import_state`: the snapshot to resume from, `None` on a fresh start.
    pub fn snapshot(&self) -> Option<Vec<u8>> {
        self.lock().process.snapshot().map(<[u8]>::to_vec)
    }

    /// The interval the process is in.
    pub fn interval(&self) -> Interval {
        self.lock().process.interval()
    }

    /// `associate`: this process writes channel `id` over `socket` (a
    /// Unix socket, a TCP connection or a pipe's write end).
    pub fn add_writer(&self, id: ChannelId, socket: impl Into<Endpoint>) -> io::Result<()> {
        let mut inner = self.lock();
        if inner.process.writer(id).is_err() {
            inner.process.associate_writer(id).map_err(cut_error)?;
        }
        inner.writers.insert(id, Arc::new(socket.into()));
        Ok(())
    }

    /// `associate`: this process reads channel `id` from `socket` (a Unix
    /// socket, a TCP connection or a pipe's read end).
    pub fn add_reader(&self, id: ChannelId, socket: impl Into<Endpoint>) -> io::Result<()> {
        let mut inner = self.lock();
        if inner.process.reader(id).is_err() {
            inner.process.associate_reader(id).map_err(cut_error)?;
        }
        inner.readers.insert(id, Arc::new(socket.into()));
        Ok(())
    }

    /// Waits while the member is frozen. A process calls it before every
    /// effect outside the set's channels (a database statement, a file
    /// write): a frozen process must not act, because its destination may
    /// already be running from its part. A restarted member is frozen
    /// until the coordinator thaws it, so this is also how its first
    /// effect waits for the source to have ended.
    pub async fn running(&self) {
        loop {
            let notified = self.thawed.notified();
            if !self.lock().frozen {
                return;
            }
            notified.await;
        }
    }

    /// Writes all of `data` on channel `id` and sends what may go out (in
    /// a nondeterministic interval it is held until the next export).
    pub async fn write_all(&self, id: ChannelId, data: &[u8]) -> io::Result<()> {
        let mut rest = data;
        loop {
            self.running().await;
            let socket = {
                let mut inner = self.lock();
                if inner.frozen {
                    continue;
                }
                let socket = inner
                    .writers
                    .get(&id)
                    .cloned()
                    .ok_or_else(|| io::Error::other(format!("no socket for channel {id}")))?;
                let end = inner.process.writer(id).map_err(cut_error)?;
                let n = end.write(rest).map_err(cut_error)?;
                rest = &rest[n..];
                while !end.pending().is_empty() {
                    match socket.try_write(end.pending()) {
                        Ok(k) => end.sent(k).map_err(cut_error)?,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e),
                    }
                }
                if rest.is_empty() && end.pending().is_empty() {
                    return Ok(());
                }
                socket
            };
            socket.writable().await?;
        }
    }

    /// Reads from channel `id` into `buf`; 0 at the end of the channel.
    pub async fn read(&self, id: ChannelId, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.running().await;
            let socket = {
                let mut inner = self.lock();
                if inner.frozen {
                    continue;
                }
                let Inner {
                    process,
                    readers,
                    scratch,
                    ..
                } = &mut *inner;
                let socket = readers
                    .get(&id)
                    .cloned()
                    .ok_or_else(|| io::Error::other(format!("no socket for channel {id}")))?;
                let end = process.reader(id).map_err(cut_error)?;
                if !end.unread().is_empty() {
                    return Ok(end.read(buf));
                }
                scratch.resize(READ_CHUNK, 0);
                match socket.try_read(scratch) {
                    Ok(0) => return Ok(0),
                    Ok(n) => {
                        end.receive(&scratch[..n]);
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                socket
            };
            socket.readable().await?;
        }
    }

    /// `export_state`: the snapshot and every channel's position at once;
    /// `next` is the interval entered. Output released by the export is
    /// sent before this returns.
    /// A frozen member's export waits for the thaw (a process does not
    /// change its part once frozen).
    pub async fn export(&self, snapshot: &[u8], next: Interval) -> io::Result<()> {
        let ids: Vec<ChannelId> = loop {
            self.running().await;
            let mut inner = self.lock();
            if inner.frozen {
                continue;
            }
            inner.process.export(snapshot, next);
            break inner.writers.keys().copied().collect();
        };
        self.flush_writers(ids).await
    }

    /// `export_state`, lazy (the paper's §6): takes `snapshot`'s buffer
    /// without copying it and hands back the previous snapshot's buffer
    /// (`None` at the first export), so a process alternates two buffers
    /// and an export costs no copy of its state whatever its size; the
    /// snapshot is copied only when a cut is taken. Otherwise as
    /// [`Member::export`]: every channel's position at once, released
    /// output sent before this returns, a frozen member's export waits for
    /// the thaw.
    pub async fn export_owned(
        &self,
        snapshot: Vec<u8>,
        next: Interval,
    ) -> io::Result<Option<Vec<u8>>> {
        let mut snapshot = Some(snapshot);
        let (previous, ids): (Option<Vec<u8>>, Vec<ChannelId>) = loop {
            self.running().await;
            let mut inner = self.lock();
            if inner.frozen {
                continue;
            }
            let Some(snap) = snapshot.take() else {
                return Err(io::Error::other("export_owned lost its snapshot"));
            };
            let previous = inner.process.export_owned(snap, next);
            break (previous, inner.writers.keys().copied().collect());
        };
        self.flush_writers(ids).await?;
        Ok(previous)
    }

    /// Sends what an export released on each of `ids`.
    async fn flush_writers(&self, ids: Vec<ChannelId>) -> io::Result<()> {
        for id in ids {
            self.write_all(id, &[]).await?;
        }
        Ok(())
    }

    /// Drains every reader socket into its end (the writers are frozen, so
    /// whatever they sent is in the sockets), then gives this process's part.
    fn cut(&self) -> Result<Vec<u8>, String> {
        let mut inner = self.lock();
        let Inner {
            process,
            readers,
            scratch,
            ..
        } = &mut *inner;
        scratch.resize(READ_CHUNK, 0);
        for (id, socket) in readers.iter() {
            let end = process.reader(*id).map_err(|e| e.to_string())?;
            loop {
                match socket.read_now(scratch) {
                    Ok(0) => break,
                    Ok(n) => end.receive(&scratch[..n]),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(format!("draining channel {id}: {e}")),
                }
            }
        }
        let part = process.part().map_err(|e| e.to_string())?;
        Ok(Cut { parts: vec![part] }.encode())
    }

    /// Tells the coordinator this member's channels are connected.
    pub async fn ready(&self, control: &mut UnixStream) -> io::Result<()> {
        send(control, READY, &[]).await
    }

    /// Answers the coordinator on `control` until it says `END` (the
    /// process's session moved away: the caller exits) or closes it.
    pub async fn serve_control(&self, mut control: UnixStream) -> io::Result<()> {
        loop {
            let Some((kind, _)) = recv(&mut control).await? else {
                return Ok(());
            };
            match kind {
                FREEZE => {
                    self.lock().frozen = true;
                    send(&mut control, ACK, &[]).await?;
                }
                CUT => match self.cut() {
                    Ok(part) => send(&mut control, PART, &part).await?,
                    Err(why) => send(&mut control, REFUSED, why.as_bytes()).await?,
                },
                THAW => {
                    self.thaw();
                    send(&mut control, ACK, &[]).await?;
                }
                END => {
                    send(&mut control, ACK, &[]).await?;
                    return Ok(());
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected control frame {other}"),
                    ))
                }
            }
        }
    }
}

/// A member joins its coordinator: says its role, and gets back its start
/// (a fresh member, or its restarted part, frozen until thawed).
pub async fn join(control: &mut UnixStream, role: &str, limits: Limits) -> io::Result<Member> {
    send(control, HELLO, role.as_bytes()).await?;
    match recv(control).await? {
        Some((START, body)) if body.is_empty() => Ok(Member::fresh(limits)),
        Some((START, body)) => Member::restarted(&body, limits),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the coordinator did not start this member",
        )),
    }
}

/// How [`move_set`] ended.
#[derive(Debug)]
pub enum MoveOutcome {
    /// The destination's members run the set (thawed); the source's were
    /// ended.
    Moved(Vec<Control>),
    /// A member could not give its part, or the cut did not check: the
    /// source's members were thawed and the set goes on there.
    Refused(String),
    /// The destination could not be started (a process died, did not
    /// answer, or the caller's start failed): the source's members were
    /// thawed and the set goes on there.
    DestinationFailed(io::Error),
}

/// Moves a service set: freezes every member of `source` (in the set's
/// order), takes each one's part, checks the whole cut, asks `start` to
/// start the destination's processes from their restarted parts (one per
/// member, same order; `start` returns their controls once each is
/// [`Control::ready`]), then ends the source's members and thaws the
/// destination's. Nothing at the source has changed state since its
/// freeze until the ends, so every failure before them thaws the source
/// and says why. An `Err` is a control socket of the source failing (a
/// source member that died).
pub async fn move_set<F, Fut>(
    source: &mut [Control],
    limits: Limits,
    start: F,
) -> io::Result<MoveOutcome>
where
    F: FnOnce(Vec<Vec<u8>>) -> Fut,
    Fut: std::future::Future<Output = io::Result<Vec<Control>>>,
{
    for c in source.iter_mut() {
        c.freeze().await?;
    }
    let mut parts = Vec::with_capacity(source.len());
    let mut refused = None;
    for c in source.iter_mut() {
        match c.part().await? {
            Ok(part) => parts.push(part),
            Err(why) => refused = refused.or(Some(why)),
        }
    }
    let plan = match refused {
        Some(why) => Err(why),
        None => restart_parts(parts, limits).map_err(|e| e.to_string()),
    };
    let outcome = match plan {
        Err(why) => MoveOutcome::Refused(why),
        Ok(plan) => match start(plan).await {
            Ok(mut destination) => {
                for c in source.iter_mut() {
                    c.end().await?;
                }
                for c in destination.iter_mut() {
                    c.thaw().await?;
                }
                return Ok(MoveOutcome::Moved(destination));
            }
            Err(e) => MoveOutcome::DestinationFailed(e),
        },
    };
    for c in source.iter_mut() {
        c.thaw().await?;
    }
    Ok(outcome)
}

/// Checks a whole cut (the parts in the service set's order) and gives
/// each process's restarted part, encoded for [`Control::accept`].
pub fn restart_parts(
    parts: Vec<Part>,
    limits: Limits,
) -> Result<Vec<Vec<u8>>, roam_service::Error> {
    let processes = Cut { parts }.resume(limits)?;
    processes
        .iter()
        .map(|p| {
            Ok(Cut {
                parts: vec![p.part()?],
            }
            .encode())
        })
        .collect()
}

/// The session attribute that carries a [`SessionSet`]'s cut in the
/// session's continuation (an encoded [`Cut`], the root's part first).
pub const CUT_ATTR: &str = "roam/service-cut";

/// A service set owned by a managed session's routine: the root (this
/// process, holding the client's session) and the back-ends' controls, in
/// the set's order. See the module documentation.
///
/// ```no_run
/// # async fn demo(
/// #     session: roam_continuation::ManagedSession,
/// #     set: roam_continuation::service_set::SessionSet,
/// # ) {
/// use roam_continuation::Continuation;
/// // ... serve requests with `set.root()` until roam asks:
/// session.freeze_requested().await;
/// match set.save(&session).await {
///     Ok(saved) => {
///         let _ = saved.bytes; // the cut's size
///         let _ = session.suspend(Continuation::new("front")).await;
///     }
///     Err(failed) => {
///         // Thawed: go on serving with `failed.set`.
///         # let _ = failed;
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct SessionSet {
    root: Member,
    backends: Vec<Control>,
    limits: Limits,
    /// How long a save waits for the back-ends' answers (all of them, from
    /// the freeze to the last part).
    save_timeout: Duration,
}

/// How long [`SessionSet::save`] waits, by default, for every back-end to
/// freeze and give its part: well under a move's freeze timeout (10 s), so
/// a back-end that is stopped, stuck or on an overloaded host calls the
/// move off within it, naming the back-end, and the session goes on at its
/// source. Set with [`SessionSet::with_save_timeout`].
pub const DEFAULT_SAVE_TIMEOUT: Duration = Duration::from_secs(2);

/// What [`SessionSet::save`] stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Saved {
    /// Size of the encoded cut stored in [`CUT_ATTR`], bytes.
    pub bytes: usize,
    /// Parts in it (the root's and one per back-end).
    pub parts: usize,
}

/// Why [`SessionSet::save`] stored nothing. Every member it reached was
/// thawed: the set goes on serving here with `set`. An `Err` from a
/// back-end's control socket (it died) leaves `set` as it is.
#[derive(Debug)]
#[non_exhaustive]
pub struct SaveFailed {
    /// The set, running.
    pub set: SessionSet,
    /// What went wrong.
    pub error: io::Error,
}

impl SessionSet {
    /// A running set: `root` is this process's member (its channels to
    /// the back-ends associated), `backends` the back-ends' controls, each
    /// [`ready`](Control::ready) and running, in the set's order.
    pub fn new(root: Member, backends: Vec<Control>, limits: Limits) -> Self {
        SessionSet {
            root,
            backends,
            limits,
            save_timeout: DEFAULT_SAVE_TIMEOUT,
        }
    }

    /// Bounds a [`save`](Self::save): every back-end must freeze and give
    /// its part within `bound` of the save's start
    /// ([`DEFAULT_SAVE_TIMEOUT`] unless set), or the save fails, naming
    /// the back-end it waited for, and calls the move off. Keep it under
    /// the move's freeze timeout, and above the time a loaded back-end
    /// takes to send a part whose logs are near their cap.
    pub fn with_save_timeout(mut self, bound: Duration) -> Self {
        self.save_timeout = bound;
        self
    }

    /// The bound on a [`save`](Self::save).
    pub fn save_timeout(&self) -> Duration {
        self.save_timeout
    }

    /// The root's member: its `write_all`, `read` and `export` serve the
    /// client's requests.
    pub fn root(&self) -> &Member {
        &self.root
    }

    /// Freezes the whole set, takes every part (the root's first), checks
    /// that the cut restarts, stores it in `session`'s attribute
    /// [`CUT_ATTR`] and ends every back-end (each answers `END` and
    /// exits). Call it at a quiescent point of the root (no request
    /// between its write to a back-end and the reply's read), then
    /// [`suspend`](crate::ManagedSession::suspend): the cut is now the
    /// set's only state, restarted by [`restore`](Self::restore) wherever
    /// the session resumes. A part refused (a log over its cap), a
    /// back-end that died or did not freeze and give its part within the
    /// save's bound ([`with_save_timeout`](Self::with_save_timeout), 2 s
    /// by default), a cut that does not check or an attribute that cannot
    /// be stored fails the save: if a move asked for the freeze, it is
    /// called off at once with the error, which names the back-end
    /// ([`decline_freeze`](crate::ManagedSession::decline_freeze)); then
    /// the set is thawed and returned. A back-end that did not answer is
    /// sent its thaw without a wait: once it runs again it answers the
    /// frames it missed and serves on (the next save drops those answers).
    pub async fn save(mut self, session: &crate::ManagedSession) -> Result<Saved, SaveFailed> {
        let stored = match self.take_cut().await {
            Ok(cut) => session
                .store(CUT_ATTR, &cut)
                .map(|()| cut.len())
                .map_err(io::Error::other),
            Err(e) => Err(e),
        };
        let bytes = match stored {
            Ok(bytes) => bytes,
            Err(error) => {
                // Called off first: the thaw below may wait for members.
                session.decline_freeze(format!("service set: {error}"));
                return Err(self.thaw_after(error).await);
            }
        };
        let saved = Saved {
            bytes,
            parts: 1 + self.backends.len(),
        };
        let (deadline, bound) = self.deadline();
        for c in &mut self.backends {
            // Its part is in the cut: a back-end that died or does not
            // answer has nothing left to lose. One that answers later ends
            // then, or when its control socket closes with this set.
            if let Err(e) = c.ack_by(control::END, deadline, bound).await {
                tracing::warn!("back-end {} did not answer END: {e}", c.role);
            }
        }
        Ok(saved)
    }

    /// The deadline of a save's wait starting now, and its bound.
    fn deadline(&self) -> (tokio::time::Instant, Duration) {
        (
            tokio::time::Instant::now() + self.save_timeout,
            self.save_timeout,
        )
    }

    async fn take_cut(&mut self) -> io::Result<Vec<u8>> {
        // Every error names the back-end it came from.
        let named = |c: &Control, what: &str, e: io::Error| {
            io::Error::new(e.kind(), format!("back-end {} {what}: {e}", c.role))
        };
        let (deadline, bound) = self.deadline();
        self.root.lock().frozen = true;
        for c in &mut self.backends {
            c.ack_by(control::FREEZE, deadline, bound)
                .await
                .map_err(|e| named(c, "did not freeze", e))?;
        }
        let root = self.root.cut().map_err(io::Error::other)?;
        let mut parts = Cut::decode(&root).map_err(cut_error)?.parts;
        for c in &mut self.backends {
            let answer = c.part_by(deadline, bound).await;
            match answer.map_err(|e| named(c, "gave no part", e))? {
                Ok(part) => parts.push(part),
                Err(why) => {
                    return Err(io::Error::other(format!(
                        "back-end {} refused its part: {why}",
                        c.role
                    )))
                }
            }
        }
        let cut = Cut { parts };
        cut.resume(self.limits).map_err(cut_error)?;
        Ok(cut.encode())
    }

    /// Thaws every member after a failed save. A back-end that still owes
    /// an answer (stopped or stuck) is sent `THAW` without a wait: it
    /// answers the frames before it, then runs again.
    async fn thaw_after(mut self, error: io::Error) -> SaveFailed {
        let (deadline, bound) = self.deadline();
        for c in &mut self.backends {
            let thawed = if c.owes_answers() {
                c.post_by(control::THAW, deadline).await
            } else {
                c.ack_by(control::THAW, deadline, bound).await
            };
            if let Err(e) = thawed {
                tracing::warn!("back-end {} was not thawed: {e}", c.role);
            }
        }
        self.root.thaw();
        SaveFailed { set: self, error }
    }

    /// At a resume: the set's cut from `session`'s attribute [`CUT_ATTR`]
    /// (taken out of it), checked and restarted; `None` if the session
    /// carries no cut (start the set fresh). Start each back-end from its
    /// part in [`Restored::parts`] (hand it over with
    /// [`Control::accept`]), associate the root's channels, then
    /// [`Restored::start`].
    pub fn restore(
        session: &crate::ManagedSession,
        limits: Limits,
    ) -> io::Result<Option<Restored>> {
        let Some(bytes) = session.retrieve(CUT_ATTR) else {
            return Ok(None);
        };
        let restored = Restored::from_cut(bytes, limits)?;
        session.remove(CUT_ATTR);
        Ok(Some(restored))
    }
}

/// A set restarted from a session's cut, not running yet
/// ([`SessionSet::restore`], or [`Restored::from_attrs`] at a move's
/// destination).
#[derive(Debug)]
#[non_exhaustive]
pub struct Restored {
    /// The root's member, restarted from its part and frozen: associate
    /// its channels (the same ids as before), then [`start`](Self::start).
    /// Its [`snapshot`](Member::snapshot) is the root's last export.
    pub root: Member,
    /// Each back-end's restarted part, in the set's order: the `START`
    /// body to give it ([`Control::accept`]).
    pub parts: Vec<Vec<u8>>,
    limits: Limits,
    /// The encoded cut it was restarted from.
    cut: Vec<u8>,
}

impl Restored {
    /// At a move's destination, before the commit (in a
    /// [`Service::prepare_move_in`](crate::Service::prepare_move_in)): the
    /// set's cut from the moving session's attributes, checked and
    /// restarted; `None` if the session carries none. Unlike
    /// [`SessionSet::restore`] it leaves the attribute in place. Start the
    /// back-ends from [`parts`](Self::parts) (they stay frozen), associate
    /// the root's channels and keep it all as a [`Staged`] for the session's
    /// routine.
    pub fn from_attrs(
        attrs: &BTreeMap<String, Vec<u8>>,
        limits: Limits,
    ) -> io::Result<Option<Restored>> {
        match attrs.get(CUT_ATTR) {
            None => Ok(None),
            Some(bytes) => Self::from_cut(bytes.clone(), limits).map(Some),
        }
    }

    fn from_cut(bytes: Vec<u8>, limits: Limits) -> io::Result<Restored> {
        let cut = Cut::decode(&bytes).map_err(cut_error)?;
        let mut plan = restart_parts(cut.parts, limits).map_err(cut_error)?;
        if plan.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a service set's cut without a root part",
            ));
        }
        let parts = plan.split_off(1);
        let root = Member::restarted(&plan[0], limits)?;
        Ok(Restored {
            root,
            parts,
            limits,
            cut: bytes,
        })
    }

    /// Runs the set: thaws the back-ends (started from [`parts`](Self::parts),
    /// same order, each [`ready`](Control::ready)) and the root. A back-end
    /// that does not thaw (it died, or did not answer) fails the start,
    /// naming it; the root stays frozen and the set is dropped.
    pub async fn start(self, mut backends: Vec<Control>) -> io::Result<SessionSet> {
        if backends.len() != self.parts.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} back-ends for {} parts",
                    backends.len(),
                    self.parts.len()
                ),
            ));
        }
        for c in &mut backends {
            c.thaw().await.map_err(|e| {
                io::Error::new(e.kind(), format!("back-end {} did not thaw: {e}", c.role))
            })?;
        }
        self.root.thaw();
        Ok(SessionSet::new(self.root, backends, self.limits))
    }
}

/// A set restarted at a move's destination before the commit, by the
/// service's [`prepare_move_in`](crate::Service::prepare_move_in): the
/// root restarted from its part and every back-end started from its own
/// and [`ready`](Control::ready), all frozen, with the caller's `handles`
/// on what it started (e.g. the back-ends' `tokio::process::Child`ren).
/// The session's resume routine gets it back with
/// [`Resumed::take_prepared`](crate::Resumed::take_prepared) and
/// [`start`](Self::start)s it. Dropped instead (the move called off, the
/// session moved on), its control sockets close, which ends the members
/// (their [`Member::serve_control`] returns), and `handles` is dropped: a
/// back-end that failed to start refuses the move before the commit, and
/// no back-end is left behind. `handles` must end the staged back-ends
/// when dropped (e.g. a `Child` spawned with `kill_on_drop`).
///
/// A back-end can also die after its staging, with the move committed:
/// [`start`](Self::start) then fails, naming it, and leaves the session's
/// cut in place. Nothing of that back-end ran since its part was taken
/// (it was frozen), so the routine starts the set again from the same cut,
/// as after a restart: [`SessionSet::restore`], fresh back-ends from
/// [`Restored::parts`], [`Restored::start`].
#[derive(Debug)]
pub struct Staged<T> {
    /// The restarted root and the back-ends' parts.
    restored: Restored,
    /// The back-ends' controls, in the set's order, each ready and frozen.
    backends: Vec<Control>,
    /// The caller's handles on the back-ends.
    handles: T,
}

impl<T> Staged<T> {
    /// Keeps `restored` (its root's channels associated) with `backends`,
    /// started from its [`parts`](Restored::parts) in the same order and
    /// each ready, and the caller's `handles`.
    pub fn new(restored: Restored, backends: Vec<Control>, handles: T) -> io::Result<Self> {
        if backends.len() != restored.parts.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} back-ends for {} parts",
                    backends.len(),
                    restored.parts.len()
                ),
            ));
        }
        Ok(Staged {
            restored,
            backends,
            handles,
        })
    }

    /// In the session's resume routine, after the commit: runs the set
    /// (the back-ends thawed, then the root) and, once it runs, takes the
    /// cut out of `session`'s [`CUT_ATTR`] (it must be the one staged).
    ///
    /// On failure the cut stays in the session and the staged set is
    /// dropped: its root never ran, its control sockets close and
    /// `handles` is dropped, which must end the back-ends. The error names
    /// the back-end that did not thaw (e.g. one killed after its staging).
    /// Start the set again from the same cut with [`SessionSet::restore`]:
    /// a back-end that died between its staging and its thaw ran nothing
    /// since its part was taken. With several back-ends, those thawed
    /// before the failing one ran (the root still frozen) until dropped;
    /// like any back-end restarted from a part, their programs must bear
    /// a second start from the same part (the ledger example truncates
    /// its file to the length its snapshot recorded).
    pub async fn start(self, session: &crate::ManagedSession) -> io::Result<(SessionSet, T)> {
        if session.retrieve(CUT_ATTR).as_deref() != Some(&self.restored.cut[..]) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the session's cut is not the one its back-ends were staged from",
            ));
        }
        let set = self.restored.start(self.backends).await?;
        // Running: the cut is no longer the set's state.
        session.remove(CUT_ATTR);
        Ok((set, self.handles))
    }
}

/// Checks a moving session's service-set cut at the destination, before
/// the move commits: for [`Service::on_move_in`](crate::Service::on_move_in).
/// A session without [`CUT_ATTR`] passes.
pub fn check_cut(attrs: &BTreeMap<String, Vec<u8>>, limits: Limits) -> Result<(), String> {
    let Some(bytes) = attrs.get(CUT_ATTR) else {
        return Ok(());
    };
    let cut = Cut::decode(bytes).map_err(|e| format!("the service set's cut: {e}"))?;
    cut.resume(limits)
        .map(drop)
        .map_err(|e| format!("the service set's cut does not restart: {e}"))
}

/// Checks a session moving in whose [`SessionSet`] this host would restart,
/// at the destination, before the move commits: for
/// [`Service::on_move_in`](crate::Service::on_move_in). Refuses with a
/// reason the move reports when the set's cut does not restart within
/// `limits` ([`check_cut`]; a session without [`CUT_ATTR`] passes it), or
/// when this host has no back-end `program` to start from the cut.
///
/// - `attrs`: the moving session's attributes, as `on_move_in` gets them.
/// - `limits`: the limits the set restarts under here (the ones
///   [`Restored::from_attrs`] will get).
/// - `what`: the back-end's name in the refusal, e.g. `"producer"` for
///   "no producer program at PATH".
/// - `program`: the back-end program the set starts here.
pub fn check_move_in(
    attrs: &BTreeMap<String, Vec<u8>>,
    limits: Limits,
    what: &str,
    program: &std::path::Path,
) -> Result<(), String> {
    check_cut(attrs, limits)?;
    if !program.exists() {
        return Err(format!("no {what} program at {}", program.display()));
    }
    Ok(())
}
