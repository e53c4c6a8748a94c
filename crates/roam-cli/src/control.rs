//! Per-process control sockets and `roam status`.
//!
//! Every `pipe`, `forward` and `serve` process listens on
//! `<state dir>/control/<pid>.sock` (directory mode 0700, so only this user
//! can connect). A client sends one request, a JSON object on one line (at
//! most [`MAX_REQUEST`] bytes, e.g. `{"op":"status"}`); the process answers
//! with one JSON document and closes the connection. `roam status` asks every
//! socket in the directory and removes the ones whose process is gone.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::cli::{CliError, CliResult, StatusArgs};
use crate::config::FileConfig;
use crate::limits::Limit;

/// One session as `roam status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SessionStatus {
    pub(crate) label: String,
    pub(crate) session_id: Option<String>,
    pub(crate) role: String,
    pub(crate) state: String,
    pub(crate) peer_addr: Option<String>,
    pub(crate) rtt_ms: Option<f64>,
    pub(crate) bytes_sent: u64,
    pub(crate) bytes_received: u64,
    pub(crate) bytes_replayed: u64,
    pub(crate) resumes: u64,
    pub(crate) streams: usize,
    /// Unix time (seconds) the session lost its transport, if suspended.
    pub(crate) suspended_since: Option<u64>,
    pub(crate) suspended_for_secs: Option<f64>,
    /// Parked (a relay's suspended session kept as its continuation, with
    /// no task or buffer; its byte counts are not read until it resumes).
    #[serde(default)]
    pub(crate) parked: bool,
}

/// One process as `roam status --json` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ProcessStatus {
    pub(crate) pid: u32,
    pub(crate) command: String,
    pub(crate) started: u64,
    pub(crate) sessions: Vec<SessionStatus>,
    /// A relay's caps and their use (empty for other processes, and in
    /// replies from versions that did not report them).
    #[serde(default)]
    pub(crate) limits: Vec<Limit>,
    /// A relay's shells (`--shell`), attached or parked.
    #[serde(default)]
    pub(crate) shells: Vec<ShellStatus>,
}

/// One shell of a relay, as `roam status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ShellStatus {
    pub(crate) user: String,
    pub(crate) name: String,
    pub(crate) pid: u32,
    /// A client is attached (else the shell is parked).
    pub(crate) attached: bool,
    /// The process id of the shell's worker (`roam shell-worker`) while a
    /// client is attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) worker: Option<u32>,
}

/// Longest request line a control socket reads (bytes).
pub(crate) const MAX_REQUEST: usize = 4096;
/// Longest reply `roam status` reads (bytes).
const MAX_REPLY: u64 = 64 << 20;
/// How long either side waits for the other on a control connection.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

/// A request to a control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum Request {
    /// Describe the process and its sessions ([`ProcessStatus`]).
    Status,
}

impl Request {
    /// Decodes one request (a JSON object, optionally newline-terminated).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() > MAX_REQUEST {
            return Err(format!("control request longer than {MAX_REQUEST} bytes"));
        }
        let line = bytes.strip_suffix(b"\n").unwrap_or(bytes);
        if line.contains(&b'\n') {
            return Err("control request spans several lines".to_string());
        }
        serde_json::from_slice(line).map_err(|e| format!("bad control request: {e}"))
    }

    /// Encodes the request as one line, newline included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// An error answer from a control socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ErrorReply {
    error: String,
}

/// Decodes a control socket's status reply.
pub(crate) fn decode_reply(bytes: &[u8]) -> Result<ProcessStatus, String> {
    if let Ok(e) = serde_json::from_slice::<ErrorReply>(bytes) {
        return Err(format!("control socket refused the request: {}", e.error));
    }
    serde_json::from_slice(bytes).map_err(|e| format!("bad control reply: {e}"))
}

/// Encodes a status reply.
pub(crate) fn encode_reply(p: &ProcessStatus) -> Result<Vec<u8>, String> {
    serde_json::to_vec(p).map_err(|e| e.to_string())
}

struct Entry {
    /// Tells this entry from the others (its watcher removes only it).
    serial: u64,
    label: String,
    handle: roam::SessionHandle,
}

/// What the sessions that have ended moved, and how they ended: the
/// metrics' counters are these plus the live sessions' figures, updated in
/// one step with the removal of the ended session's entry so that no
/// counter ever goes down.
#[derive(Debug, Clone, Default)]
pub(crate) struct Totals {
    /// Sessions listed so far (opened).
    pub(crate) opened: u64,
    /// Ended sessions, by how they ended ([`close_label`]).
    pub(crate) closed: std::collections::BTreeMap<&'static str, u64>,
    pub(crate) bytes_sent: u64,
    pub(crate) bytes_received: u64,
    pub(crate) bytes_replayed: u64,
    pub(crate) resumes: u64,
}

/// How a session ended, as a metrics label: `local`, `peer`, `peer_error`
/// (the peer closed it with an error code), `expired` (suspended past its
/// timeout) or `error`.
pub(crate) fn close_label(reason: &roam::CloseReason) -> &'static str {
    match reason {
        roam::CloseReason::Local { .. } => "local",
        roam::CloseReason::Peer { code: 0, .. } => "peer",
        roam::CloseReason::Peer { .. } => "peer_error",
        roam::CloseReason::Error(roam_proto::Error::Expired) => "expired",
        _ => "error",
    }
}

/// The sessions listed and the totals of the ended ones (one lock).
#[derive(Default)]
struct Sessions {
    entries: Vec<Entry>,
    next_serial: u64,
    totals: Totals,
}

/// Reports a process's caps and their use when asked.
type LimitsFn = Arc<dyn Fn() -> Vec<Limit> + Send + Sync>;
/// Reports a relay's shells when asked.
type ShellsFn = Arc<dyn Fn() -> Vec<ShellStatus> + Send + Sync>;
/// What lists a relay's parked sessions.
type ParkedFn = Arc<dyn Fn() -> Vec<SessionStatus> + Send + Sync>;

/// The sessions of this process.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    sessions: Arc<Mutex<Sessions>>,
    limits: Arc<Mutex<Option<LimitsFn>>>,
    shells: Arc<Mutex<Option<ShellsFn>>>,
    parked: Arc<Mutex<Option<ParkedFn>>>,
}

impl Registry {
    /// Makes status replies include the limits `f` reports.
    pub(crate) fn set_limits(&self, f: impl Fn() -> Vec<Limit> + Send + Sync + 'static) {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(f));
    }

    /// Makes status replies include the shells `f` reports.
    pub(crate) fn set_shells(&self, f: impl Fn() -> Vec<ShellStatus> + Send + Sync + 'static) {
        *self.shells.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(f));
    }

    /// The shells to report, if any.
    pub(crate) fn shells(&self) -> Vec<ShellStatus> {
        let f = self
            .shells
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        f.map_or_else(Vec::new, |f| f())
    }

    /// The limits to report, if any.
    pub(crate) fn limits(&self) -> Vec<Limit> {
        let f = self
            .limits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        f.map_or_else(Vec::new, |f| f())
    }

    /// Lists `handle` under `label` until the session closes; then adds
    /// what it moved, and how it ended, to the totals.
    pub(crate) fn add(&self, label: String, handle: roam::SessionHandle) {
        self.add_entry(label, handle, true);
    }

    /// [`Registry::add`] for a session restored from its continuation
    /// (parked or handed over): not a new session.
    pub(crate) fn add_restored(&self, label: String, handle: roam::SessionHandle) {
        self.add_entry(label, handle, false);
    }

    fn add_entry(&self, label: String, handle: roam::SessionHandle, new: bool) {
        let sessions = self.sessions.clone();
        let watch = handle.clone();
        let serial = {
            let mut s = self.lock_sessions();
            let serial = s.next_serial;
            s.next_serial += 1;
            s.totals.opened += u64::from(new);
            s.entries.push(Entry {
                serial,
                label,
                handle,
            });
            serial
        };
        tokio::spawn(async move {
            let reason = watch.closed().await;
            let st = watch.stats();
            let mut s = sessions.lock().unwrap_or_else(|e| e.into_inner());
            s.entries.retain(|x| x.serial != serial);
            if watch.is_detached() {
                // Not over: it goes on as its continuation (parked here, or
                // in the next relay) and is counted when it ends.
                return;
            }
            let t = &mut s.totals;
            t.bytes_sent += st.bytes_sent;
            t.bytes_received += st.bytes_received;
            t.bytes_replayed += st.bytes_replayed;
            t.resumes += st.resumes;
            *t.closed.entry(close_label(&reason)).or_default() += 1;
        });
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The listed sessions' stats and the ended ones' totals, read together
    /// (for the metrics).
    pub(crate) fn figures(&self) -> (Vec<roam::SessionStats>, Totals) {
        let s = self.lock_sessions();
        (
            s.entries.iter().map(|e| e.handle.stats()).collect(),
            s.totals.clone(),
        )
    }

    pub(crate) fn snapshot(&self) -> Vec<SessionStatus> {
        let now = SystemTime::now();
        self.lock_sessions()
            .entries
            .iter()
            .map(|e| {
                let s = e.handle.stats();
                SessionStatus {
                    label: e.label.clone(),
                    session_id: s.session_id.map(|i| i.to_string()),
                    role: format!("{:?}", s.role).to_lowercase(),
                    state: format!("{:?}", s.state).to_lowercase(),
                    peer_addr: s.peer_addr.map(|a| a.to_string()),
                    rtt_ms: s.rtt.map(|d| d.as_secs_f64() * 1000.0),
                    bytes_sent: s.bytes_sent,
                    bytes_received: s.bytes_received,
                    bytes_replayed: s.bytes_replayed,
                    resumes: s.resumes,
                    streams: s.streams,
                    suspended_since: s
                        .suspended_for
                        .and_then(|d| now.checked_sub(d))
                        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                        .map(|d| d.as_secs()),
                    suspended_for_secs: s.suspended_for.map(|d| d.as_secs_f64()),
                    parked: false,
                }
            })
            .chain(self.parked())
            .collect()
    }

    /// Makes status replies include the parked sessions `f` reports.
    pub(crate) fn set_parked(&self, f: impl Fn() -> Vec<SessionStatus> + Send + Sync + 'static) {
        *self.parked.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(f));
    }

    /// How many sessions are parked.
    pub(crate) fn parked_count(&self) -> usize {
        self.parked().len()
    }

    /// The parked sessions to report, if any.
    fn parked(&self) -> Vec<SessionStatus> {
        let f = self
            .parked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        f.map_or_else(Vec::new, |f| f())
    }
}

/// Removes the control socket when the process ends.
pub(crate) struct ControlSocket {
    path: PathBuf,
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn control_dir(config: &FileConfig) -> PathBuf {
    crate::paths::state_dir(config).join("control")
}

/// Starts this process's control socket. Failure is not fatal (status just
/// will not list this process).
pub(crate) fn start(
    config: &FileConfig,
    command: String,
    registry: Registry,
) -> Option<ControlSocket> {
    let dir = control_dir(config);
    if let Err(e) = crate::paths::ensure_private_dir(&dir) {
        tracing::warn!(
            "no control socket ({}: {e}); `roam status` will not list this process",
            dir.display()
        );
        return None;
    }
    let pid = std::process::id();
    let path = dir.join(format!("{pid}.sock"));
    let _ = std::fs::remove_file(&path);
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                "no control socket ({}: {e}); `roam status` will not list this process",
                path.display()
            );
            return None;
        }
    };
    let started = crate::named::unix_now();
    let command = Arc::new(command);
    tokio::spawn(async move {
        loop {
            let conn = match listener.accept().await {
                Ok((conn, _)) => conn,
                Err(e) => {
                    // Out of file descriptors or similar: wait, never give up.
                    tracing::debug!("control socket accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (registry, command) = (registry.clone(), command.clone());
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    CONTROL_TIMEOUT,
                    answer(conn, pid, &command, started, &registry),
                )
                .await;
            });
        }
    });
    Some(ControlSocket { path })
}

/// Reads one request from `conn` and answers it.
async fn answer(
    conn: UnixStream,
    pid: u32,
    command: &str,
    started: u64,
    registry: &Registry,
) -> std::io::Result<()> {
    let mut conn = tokio::io::BufReader::new(conn);
    let mut line = Vec::new();
    (&mut conn)
        .take(MAX_REQUEST as u64 + 1)
        .read_until(b'\n', &mut line)
        .await?;
    let reply = match Request::decode(&line) {
        Ok(Request::Status) => encode_reply(&ProcessStatus {
            pid,
            command: command.to_string(),
            started,
            sessions: registry.snapshot(),
            limits: registry.limits(),
            shells: registry.shells(),
        }),
        Err(e) => Err(e),
    };
    let bytes =
        reply.unwrap_or_else(|error| serde_json::to_vec(&ErrorReply { error }).unwrap_or_default());
    conn.get_mut().write_all(&bytes).await?;
    conn.get_mut().shutdown().await
}

async fn query(path: &Path) -> Option<ProcessStatus> {
    let fetch = async {
        let mut conn = UnixStream::connect(path).await.ok()?;
        conn.write_all(&Request::Status.encode()).await.ok()?;
        let mut buf = Vec::new();
        (&mut conn)
            .take(MAX_REPLY)
            .read_to_end(&mut buf)
            .await
            .ok()?;
        decode_reply(&buf).ok()
    };
    tokio::time::timeout(CONTROL_TIMEOUT, fetch)
        .await
        .ok()
        .flatten()
}

/// `roam status`.
pub(crate) async fn status(args: StatusArgs, config: &FileConfig) -> CliResult {
    let dir = control_dir(config);
    let mut procs = Vec::new();
    if let Ok(rd) = std::fs::read_dir(&dir) {
        let mut paths: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "sock"))
            .collect();
        paths.sort();
        for p in paths {
            match query(&p).await {
                Some(s) => procs.push(s),
                None => {
                    // The process is gone (or hung): drop its stale socket if nobody listens.
                    if UnixStream::connect(&p).await.is_err() {
                        let _ = std::fs::remove_file(&p);
                    }
                }
            }
        }
    }
    let detached = crate::named::list(&crate::named::dir(config));
    if args.json {
        let all = serde_json::json!({ "processes": procs, "detached": detached });
        println!(
            "{}",
            serde_json::to_string_pretty(&all).map_err(|e| CliError(e.to_string()))?
        );
        return Ok(0);
    }
    print_detached(&detached);
    if procs.is_empty() {
        println!(
            "no running roam processes (state dir {})",
            crate::paths::state_dir(config).display()
        );
        return Ok(0);
    }
    for p in &procs {
        println!("pid {}  {}", p.pid, p.command);
        if !p.limits.is_empty() {
            let parts: Vec<String> = p
                .limits
                .iter()
                .map(|l| {
                    let by = l.holder.as_deref().map_or(String::new(), |h| {
                        format!(" ({})", h.chars().take(16).collect::<String>())
                    });
                    format!("{} {}/{}{by}", l.name, l.used, l.max)
                })
                .collect();
            println!("  limits: {}", parts.join(", "));
        }
        if !p.shells.is_empty() {
            let parts: Vec<String> = p
                .shells
                .iter()
                .map(|s| {
                    let state = match (s.attached, s.worker) {
                        (true, Some(w)) => format!("attached, worker pid {w}"),
                        (true, None) => "attached".to_string(),
                        (false, _) => "parked".to_string(),
                    };
                    format!("{} ({}, pid {}, {state})", s.name, s.user, s.pid)
                })
                .collect();
            println!("  shells: {}", parts.join(", "));
        }
        if p.sessions.is_empty() {
            println!("  (no sessions)");
        }
        for s in &p.sessions {
            let id = s
                .session_id
                .as_deref()
                .map_or("-", |i| &i[..i.len().min(12)]);
            let rtt = s.rtt_ms.map_or("-".to_string(), |r| format!("{r:.1} ms"));
            let suspended = s.suspended_for_secs.map_or(String::new(), |d| {
                format!(
                    "  {} for {}",
                    if s.parked { "parked" } else { "suspended" },
                    human_secs(d)
                )
            });
            println!(
                "  {id}  {:<10} {:<6} peer {:<22} rtt {:<9} sent {:<10} recv {:<10} replayed {}{suspended}  {}",
                s.state,
                s.role,
                s.peer_addr.as_deref().unwrap_or("-"),
                rtt,
                human_bytes(s.bytes_sent),
                human_bytes(s.bytes_received),
                human_bytes(s.bytes_replayed),
                s.label,
            );
        }
    }
    Ok(0)
}

/// The detached named sessions, for `roam status`.
fn print_detached(detached: &[crate::named::DetachedStatus]) {
    for d in detached {
        match &d.error {
            None => println!(
                "detached {:<16} {}{} -> {}  {} {}  {} pending{}  (re-attach: roam {} --name {} {} {})",
                d.name,
                d.listen
                    .as_ref()
                    .map_or(String::new(), |l| format!("{l} -> ")),
                d.relay,
                d.target,
                if d.killed {
                    "client killed, last journaled"
                } else {
                    "for"
                },
                human_secs(d.detached_for_secs as f64),
                human_bytes(d.pending_bytes),
                match (d.input_taken, d.output_printed) {
                    (Some(i), Some(o)) => format!(
                        "  input taken {i} B, output printed {o} B"
                    ),
                    _ => String::new(),
                },
                if d.listen.is_some() { "forward" } else { "pipe" },
                d.name,
                d.relay,
                match &d.listen {
                    Some(l) => format!("{l} {}", d.target),
                    None => d.target.clone(),
                }
            ),
            Some(e) => println!("detached {:<16} unreadable: {e}", d.name),
        }
    }
}

pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

pub(crate) fn human_secs(s: f64) -> String {
    match s {
        s if s < 120.0 => format!("{s:.0}s"),
        s if s < 7200.0 => format!("{:.0}m", s / 60.0),
        s => format!("{:.1}h", s / 3600.0),
    }
}
