//! The TTCP-like two-process stream (issue 15; the paper's §7.1.2): a
//! back-end producer process (`ttcp_producer`) writes a patterned byte
//! stream over one Unix socket to the front-end, the service set's root
//! inside a host's managed session (`ttcp_frontend`, or a test's host),
//! which forwards it to the client (`ttcp_client`) over the roam session.
//! The set travels in the session's continuation (`SessionSet`), so a
//! cluster that moves the session moves the producer with it.
//!
//! - **The pattern**: byte `p` of the stream is byte `p % 8` (little end
//!   first) of [`mix`]`(p / 8)`, so every byte is checkable on its own and
//!   a byte lost, repeated or out of place shows at once ([`fill`],
//!   [`first_mismatch`]).
//! - **The request**: the client opens one stream whose meta is
//!   `ttcp bytes=N` ([`meta`]); the front-end keeps `N` in the session's
//!   attribute `total` and starts the producer with it.
//! - **Exports**: the producer exports its position after every
//!   [`CHUNK`] bytes (the paper's 8 KB), its snapshot padded to
//!   `STATE_BYTES`, eagerly ([`Member::export`], a copy of the snapshot per
//!   export), lazily ([`Member::export_owned`], two alternating buffers,
//!   no copy) or never (the paper's Fig. 10: each restart replays the
//!   stream from byte 0, discarded up to what the front-end has). The
//!   root exports its forwarded position after each forward, so its
//!   state always equals its last export and it saves between two
//!   forwards: its snapshot padded to its own `STATE_BYTES` (8 by
//!   default; the paper puts the large state in this first process),
//!   eagerly or lazily as the producer's ([`Front::with_root`]), never
//!   `never` (a root restarted from no export would forward the stream
//!   again).

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam::RoamStream;
use roam_continuation::service_set::{
    check_move_in, Control, Member, Restored, SessionSet, Staged,
};
use roam_continuation::{Continuation, Host, ManagedSession, Service};
use roam_service::{ChannelId, Interval, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio::process::{Child, Command};

/// The stream's one channel of the set: producer to front-end.
pub const DATA: ChannelId = ChannelId(1);
/// Bytes the producer writes between two exports (the paper exports
/// after every 8 KB sent).
pub const CHUNK: usize = 8 << 10;
/// The service's name (and the client stream's meta prefix).
pub const SERVICE: &str = "ttcp";
/// The producer's role in the set.
pub const ROLE: &str = "producer";
/// How long the front-end waits for a producer to join, connect and be
/// ready (seconds).
const START_LIMIT_S: u64 = 10;

/// splitmix64's finaliser: 8 stream bytes per input word.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Byte `p` of the stream.
pub fn byte_at(p: u64) -> u8 {
    mix(p >> 3).to_le_bytes()[(p & 7) as usize]
}

/// Fills `buf` with the stream from position `at`.
pub fn fill(at: u64, buf: &mut [u8]) {
    let mut p = at;
    let mut i = 0;
    while i < buf.len() {
        let word = mix(p >> 3).to_le_bytes();
        let off = (p & 7) as usize;
        let k = (8 - off).min(buf.len() - i);
        buf[i..i + k].copy_from_slice(&word[off..off + k]);
        i += k;
        p += k as u64;
    }
}

/// The first byte of `got` (the stream from position `at`) that is not
/// the pattern's: `(position, got, due)`. `scratch` is reused.
pub fn first_mismatch(at: u64, got: &[u8], scratch: &mut Vec<u8>) -> Option<(u64, u8, u8)> {
    scratch.resize(got.len(), 0);
    fill(at, scratch);
    if got == &scratch[..] {
        return None;
    }
    let i = got.iter().zip(scratch.iter()).position(|(a, b)| a != b)?;
    Some((at + i as u64, got[i], scratch[i]))
}

/// How the producer exports its snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Export {
    /// `Member::export`: the snapshot copied at every export.
    Eager,
    /// `Member::export_owned`: two alternating buffers, no copy.
    Lazy,
    /// No export at all: a restart replays the stream from byte 0.
    Never,
}

impl Export {
    /// `eager`, `lazy` or `never`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "eager" => Some(Export::Eager),
            "lazy" => Some(Export::Lazy),
            "never" => Some(Export::Never),
            _ => None,
        }
    }

    /// The word [`Export::parse`] takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Export::Eager => "eager",
            Export::Lazy => "lazy",
            Export::Never => "never",
        }
    }
}

/// The client stream's meta asking for `total` bytes.
pub fn meta(total: u64) -> String {
    format!("{SERVICE} bytes={total}")
}

/// The byte count a client stream's meta asks for.
pub fn parse_meta(meta: &[u8]) -> Option<u64> {
    std::str::from_utf8(meta)
        .ok()?
        .strip_prefix(SERVICE)?
        .trim()
        .strip_prefix("bytes=")?
        .parse()
        .ok()
}

/// Parses a byte count with an optional binary suffix (`K`, `M`, `G`).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let (num, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    num.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// The channel limits of every member (the defaults).
pub fn limits() -> Limits {
    Limits::default()
}

/// One host's front-end: how it starts producers, and what it measured.
pub struct Front {
    /// The producer program.
    pub producer: PathBuf,
    /// Where each set incarnation's sockets go (one directory each).
    pub work: PathBuf,
    /// How the producers started here export.
    pub export: Export,
    /// Bytes of each producer snapshot (its position, padded).
    pub state_bytes: usize,
    /// How the root (this front-end's member of each set) exports its
    /// forwarded position: [`Export::Eager`] or [`Export::Lazy`].
    pub root_export: Export,
    /// Bytes of each root snapshot (its forwarded position, padded; at
    /// least 8).
    pub root_state_bytes: usize,
    /// Bytes forwarded to clients from here.
    pub forwarded: AtomicU64,
    /// Sets started here (fresh or restored).
    pub starts: AtomicUsize,
    /// Sets restarted here from a cut (staged at a move's check, or in
    /// the resume routine).
    pub restored: AtomicUsize,
    /// Sets staged at a move's check that the resume routine ran.
    pub staged_runs: AtomicUsize,
    /// Every producer process started here.
    pub pids: Mutex<Vec<u32>>,
    /// Size of each cut saved here (bytes).
    pub cuts: Mutex<Vec<usize>>,
    /// How long each save here took (from the freeze request).
    pub saves: Mutex<Vec<Duration>>,
    /// The root's forwarded position at each save here: what its last
    /// export must hold.
    pub saved_at: Mutex<Vec<u64>>,
    /// The forwarded position in the root's imported snapshot at each
    /// restart here from a cut: one per save, equal to it, when the
    /// root's export keeps its state.
    pub resumed_at: Mutex<Vec<u64>>,
}

impl Front {
    /// A front-end starting `producer`s with sockets under `work`.
    pub fn new(producer: PathBuf, work: PathBuf, export: Export, state_bytes: usize) -> Self {
        Front {
            producer,
            work,
            export,
            state_bytes,
            root_export: Export::Eager,
            root_state_bytes: 8,
            forwarded: AtomicU64::new(0),
            starts: AtomicUsize::new(0),
            restored: AtomicUsize::new(0),
            staged_runs: AtomicUsize::new(0),
            pids: Mutex::new(Vec::new()),
            cuts: Mutex::new(Vec::new()),
            saves: Mutex::new(Vec::new()),
            saved_at: Mutex::new(Vec::new()),
            resumed_at: Mutex::new(Vec::new()),
        }
    }

    /// The root exports as `export` (eager by default), its snapshot
    /// padded to `state_bytes` (at least 8; 8 by default). Refuses
    /// [`Export::Never`]: the root's export is what keeps it from
    /// forwarding again, after a restart, what the client already has.
    pub fn with_root(mut self, export: Export, state_bytes: usize) -> Result<Self, &'static str> {
        if export == Export::Never {
            return Err("the root exports eagerly or lazily, never `never`");
        }
        self.root_export = export;
        self.root_state_bytes = state_bytes.max(8);
        Ok(self)
    }

    /// Starts a producer of `total` bytes and joins it to `root`: fresh
    /// (`parts` `None`), or from its part of a restored cut (then it stays
    /// frozen until thawed). A producer that fails to start is reaped
    /// before the error returns.
    async fn launch(
        &self,
        root: &Member,
        total: u64,
        parts: Option<&[Vec<u8>]>,
    ) -> io::Result<(Vec<Control>, Child)> {
        let n = self.starts.fetch_add(1, Ordering::SeqCst);
        let dir = self.work.join(n.to_string());
        std::fs::create_dir_all(&dir)?;
        let control = UnixListener::bind(dir.join("control.sock"))?;
        let data = UnixListener::bind(dir.join("data.sock"))?;
        let mut child = Command::new(&self.producer)
            .arg(dir.join("control.sock"))
            .arg(&dir)
            .arg(total.to_string())
            .arg(self.export.as_str())
            .arg(self.state_bytes.to_string())
            .kill_on_drop(true)
            .spawn()?;
        if let Some(pid) = child.id() {
            self.pids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(pid);
        }
        let limit = Duration::from_secs(START_LIMIT_S);
        let joined = async {
            let (socket, _) = tokio::time::timeout(limit, control.accept())
                .await
                .map_err(|_| io::Error::other("the producer never joined"))??;
            let part = parts.and_then(|p| p.first().cloned());
            let mut ctl = Control::accept(socket, |_| part).await?;
            tokio::select! {
                r = ctl.ready() => r?,
                s = child.wait() => {
                    return Err(io::Error::other(format!(
                        "the producer exited before it was ready: {}",
                        s?
                    )));
                }
            }
            let (sock, _) = tokio::time::timeout(limit, data.accept())
                .await
                .map_err(|_| io::Error::other("the producer never connected"))??;
            root.add_reader(DATA, sock)?;
            Ok::<_, io::Error>(vec![ctl])
        }
        .await;
        match joined {
            Ok(controls) => Ok((controls, child)),
            Err(e) => {
                let _ = child.start_kill();
                let _ = tokio::time::timeout(limit, child.wait()).await;
                Err(e)
            }
        }
    }

    /// Starts the producer and joins it to `root`: fresh, or from its part
    /// of a restored cut. Returns the set (running) and the child.
    async fn start_set(
        &self,
        root: Member,
        total: u64,
        restored: Option<Restored>,
    ) -> io::Result<(SessionSet, Child)> {
        let parts = restored.as_ref().map(|r| r.parts.clone());
        let (controls, child) = self.launch(&root, total, parts.as_deref()).await?;
        let set = match restored {
            None => SessionSet::new(root, controls, limits()),
            Some(r) => {
                self.restored.fetch_add(1, Ordering::SeqCst);
                r.start(controls).await?
            }
        };
        Ok((set, child))
    }

    /// In the resume routine: the set restarted from the session's cut
    /// (taken out of it) with a producer of `total` bytes started from its
    /// part.
    async fn restore_set(
        &self,
        session: &ManagedSession,
        total: u64,
    ) -> io::Result<(SessionSet, Child)> {
        let restored = SessionSet::restore(session, limits())?
            .ok_or_else(|| io::Error::other("the continuation carries no cut"))?;
        let root = restored.root.clone();
        self.start_set(root, total, Some(restored)).await
    }

    /// At a move's destination, before the commit: the producer started
    /// from its part of the moving session's cut, frozen, kept with the
    /// restarted root for the resume routine.
    async fn stage(&self, restored: Restored, total: u64) -> io::Result<Staged<Child>> {
        let parts = restored.parts.clone();
        let (controls, child) = self.launch(&restored.root, total, Some(&parts)).await?;
        self.restored.fetch_add(1, Ordering::SeqCst);
        Staged::new(restored, controls, child)
    }
}

/// The `total` attribute of a session (what its client asked for).
fn total_of(attrs: &BTreeMap<String, Vec<u8>>) -> Result<u64, String> {
    attrs
        .get("total")
        .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
        .map(u64::from_be_bytes)
        .ok_or_else(|| "the session has no total".to_string())
}

/// `m`'s data, even if a holder panicked (the counters stay usable).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The root's export of its forwarded position `pos` in `state`, padded
/// to [`Front::root_state_bytes`]: eagerly (`Member::export`, `state`
/// copied) or lazily (`Member::export_owned`: `state` becomes the
/// snapshot and the previous snapshot's buffer the next `state`).
async fn export_root(
    front: &Front,
    root: &Member,
    pos: u64,
    state: &mut Vec<u8>,
) -> io::Result<()> {
    state[..8].copy_from_slice(&pos.to_be_bytes());
    match front.root_export {
        Export::Eager => root.export(state, Interval::Deterministic).await,
        // `with_root` refuses `Never`; were it set, it would be lazy.
        Export::Lazy | Export::Never => {
            let snapshot = std::mem::take(state);
            let spare = root.export_owned(snapshot, Interval::Deterministic).await?;
            // The first spare is `None` (a fresh root) or the imported
            // snapshot, whatever its size.
            *state = spare.unwrap_or_default();
            state.resize(front.root_state_bytes, 0);
            Ok(())
        }
    }
}

/// The front-end's loop for one session: what the producer writes goes to
/// the client; at a freeze request (between two forwards) the set's cut
/// goes into the continuation and the session suspends.
async fn serve(
    front: Arc<Front>,
    session: ManagedSession,
    mut stream: RoamStream,
    mut set: SessionSet,
    mut child: Child,
) {
    let imported = set.root().snapshot();
    let mut pos = imported
        .as_ref()
        .and_then(|s| <[u8; 8]>::try_from(s.get(..8)?).ok())
        .map_or(0, u64::from_be_bytes);
    if imported.is_some() {
        lock(&front.resumed_at).push(pos);
    }
    // The eager export's state, or the lazy export's spare buffer (the
    // other one is the exported snapshot), as the producer's.
    let mut state = vec![0u8; front.root_state_bytes];
    let mut buf = vec![0u8; 64 << 10];
    let mut probe = [0u8; 64];
    loop {
        tokio::select! {
            biased;
            _ = session.freeze_requested() => {
                let asked = Instant::now();
                match set.save(&session).await {
                    Ok(saved) => {
                        lock(&front.saves).push(asked.elapsed());
                        lock(&front.cuts).push(saved.bytes);
                        lock(&front.saved_at).push(pos);
                        if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
                            eprintln!("ttcp: the producer did not end; killing it");
                            let _ = child.kill().await;
                        }
                        let cont = Continuation::new("forward").stream("main", stream);
                        let _ = session.suspend(cont).await;
                        return;
                    }
                    Err(failed) => {
                        eprintln!("ttcp: save failed, the set goes on here: {}", failed.error);
                        set = failed.set;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            r = set.root().read(DATA, &mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        // The producer is gone: its state since its last
                        // export went with it (docs/SERVICE.md, "A
                        // back-end that dies"); the session ends.
                        eprintln!("ttcp: the producer is gone ({r:?}); the session ends");
                        session.decline_freeze("the producer is gone".to_string());
                        let _ = child.kill().await;
                        return;
                    }
                    Ok(n) => n,
                };
                if stream.write_all(&buf[..n]).await.is_err() {
                    let _ = child.kill().await;
                    return;
                }
                pos += n as u64;
                front.forwarded.fetch_add(n as u64, Ordering::Relaxed);
                if export_root(&front, set.root(), pos, &mut state).await.is_err() {
                    let _ = child.kill().await;
                    return;
                }
            }
            r = stream.read(&mut probe) => {
                if matches!(r, Ok(0) | Err(_)) {
                    // The client is done: so is the set.
                    let _ = child.kill().await;
                    return;
                }
            }
        }
    }
}

/// The front-end service: its checks of an incoming move and its resume
/// routine (`forward`).
pub fn service(front: Arc<Front>) -> Service {
    let check = front.clone();
    let prepare = front.clone();
    Service::new(SERVICE)
        .version("1")
        .on_move_in(move |attrs| {
            check_move_in(attrs, limits(), "producer", &check.producer)?;
            total_of(attrs).map(drop)
        })
        .prepare_move_in(move |attrs| {
            let restored = Restored::from_attrs(attrs, limits());
            let total = total_of(attrs);
            let front = prepare.clone();
            async move {
                let Some(restored) = restored.map_err(|e| e.to_string())? else {
                    return Ok(None);
                };
                let staged = front
                    .stage(restored, total?)
                    .await
                    .map_err(|e| format!("starting the producer: {e}"))?;
                Ok(Some(staged))
            }
        })
        .routine("forward", move |mut r| {
            let front = front.clone();
            async move {
                let Some(stream) = r.take_stream("main") else {
                    return;
                };
                let total = r
                    .session
                    .retrieve("total")
                    .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                    .map_or(0, u64::from_be_bytes);
                let started = match r.take_prepared::<Staged<Child>>() {
                    // Moved in: the producer started before the commit.
                    Some(staged) => {
                        front.staged_runs.fetch_add(1, Ordering::SeqCst);
                        match staged.start(&r.session).await {
                            Ok(started) => Ok(started),
                            // The producer died before its thaw: it ran
                            // nothing since its part was taken, and the
                            // session still carries the cut.
                            Err(e) => {
                                eprintln!(
                                    "ttcp: the staged set did not start ({e}); starting it again from the session's cut"
                                );
                                front.restore_set(&r.session, total).await
                            }
                        }
                    }
                    None => front.restore_set(&r.session, total).await,
                };
                match started {
                    Ok((set, child)) => serve(front, r.session, stream, set, child).await,
                    Err(e) => eprintln!("ttcp: cannot restart the set: {e}"),
                }
            }
        })
}

/// A new session on `host`: adopt it, take the client's stream and
/// request, start a fresh producer and serve.
pub fn on_session(front: Arc<Front>, host: &Host, handle: roam::SessionHandle) {
    let Ok(session) = host.adopt(SERVICE, handle) else {
        return;
    };
    tokio::spawn(async move {
        let (stream, meta) = tokio::select! {
            r = session.handle().accept_stream() => match r {
                Ok(x) => x,
                Err(_) => return,
            },
            _ = session.freeze_requested() => return,
        };
        let Some(total) = parse_meta(&meta) else {
            eprintln!("ttcp: a stream whose meta is not a request");
            return;
        };
        if session.store("total", total.to_be_bytes()).is_err() {
            return;
        }
        let root = Member::fresh(limits());
        match front.start_set(root, total, None).await {
            Ok((set, child)) => serve(front, session, stream, set, child).await,
            Err(e) => eprintln!("ttcp: cannot start the producer: {e}"),
        }
    });
}
