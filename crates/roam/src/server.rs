//! Server: accepts TCP connections, reads each one's opening and routes it
//! ([`roam_proto::route_opening`]) to a new session, to the driver of the
//! session it resumes, or — for a session not live here — to what the
//! [`Directory`] says: a stored continuation, another host, or nowhere.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::transport::{network_peer, Listener, Transport};
use roam_proto::{route_opening, Hello, Opening, Session, SessionId};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::detach::{Directory, Location, LookupDirectory, LookupResult, NoDirectory, Restored};
use crate::driver::{reject, Conn, Driver, Handoff, Kind, OnSession, Routing, ServerSide};
use crate::handle::{Inner, SessionHandle};
use crate::limits::{suppressed_note, BusySlot, LogThrottle, Refusal, SharedThrottle};
use crate::ServerConfig;

/// Resumes queued for one session's driver.
const HANDOFF_QUEUE: usize = 4;
/// Longest wait for the opening of a connection that will be answered busy:
/// short, since it holds a file descriptor beyond the connection cap.
const BUSY_HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// At most one line per this interval for each kind of flood (accept
/// errors, connections over the cap, refused sessions).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Routes resumes: session id → the channel into that session's driver.
#[derive(Default)]
pub(crate) struct Registry {
    sessions: Mutex<HashMap<SessionId, mpsc::Sender<Box<Handoff>>>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, mpsc::Sender<Box<Handoff>>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn get(&self, id: &SessionId) -> Option<mpsc::Sender<Box<Handoff>>> {
        self.lock().get(id).cloned()
    }
}

impl Routing for Registry {
    fn remove(&self, id: &SessionId) {
        self.lock().remove(id);
    }
}

/// Everything a connection task needs, shared.
struct Ctx {
    config: ServerConfig,
    registry: Arc<Registry>,
    on_session: OnSession,
    shutdown: watch::Receiver<bool>,
    running: mpsc::Sender<()>,
    /// Asked about resumes for sessions not in the registry (continuations,
    /// other hosts).
    directory: Arc<dyn Directory>,
    /// Throttles the warnings about refused new sessions.
    refusals: SharedThrottle,
    /// The connection cap (an adopted connection takes a slot if one is free).
    limit: Arc<Semaphore>,
}

/// Runs a roam server on `listener` until `shutdown` completes: a
/// `TcpListener`, or a `UnixListener` for local clients (they connect to
/// `unix:PATH`; all of them count as one address, [`crate::UNIX_PEER`], for
/// `max_sessions_per_ip`).
///
/// `on_session` is called (on the session's driver task: keep it short, e.g.
/// spawn) with each new session once its handshake has completed; resumes of
/// existing sessions are handled here and never reach it. On shutdown the
/// server stops accepting, closes every session gracefully, and returns once
/// they have stopped or `shutdown_grace` has passed.
pub async fn serve<F>(
    listener: impl Into<Listener>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
    on_session: F,
) -> io::Result<()>
where
    F: Fn(SessionHandle) + Send + Sync + 'static,
{
    serve_inner(
        listener,
        config,
        shutdown,
        Arc::new(on_session),
        Arc::new(NoDirectory),
    )
    .await
}

/// [`serve`], plus a `lookup` asked whenever a resume names a session that
/// is not in the routing map — one taken out with
/// [`SessionHandle::detach`] and kept as a continuation (PROTOCOL.md §13),
/// possibly by an earlier process. See [`LookupResult`] for its answers; a
/// session it returns is installed (routing map, new driver), its
/// [`Restored::on_installed`] gets the handle, and the resume proceeds on it.
/// `on_session` still sees only new sessions.
pub async fn serve_with_restore<F, L, Fut>(
    listener: impl Into<Listener>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
    on_session: F,
    lookup: L,
) -> io::Result<()>
where
    F: Fn(SessionHandle) + Send + Sync + 'static,
    L: Fn(SessionId) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = LookupResult> + Send + 'static,
{
    serve_inner(
        listener,
        config,
        shutdown,
        Arc::new(on_session),
        Arc::new(LookupDirectory(lookup)),
    )
    .await
}

/// [`serve`], plus a [`Directory`] asked whenever a resume names a session
/// that is not live here: a [`Location::Stored`] session is installed as
/// with [`serve_with_restore`]; for [`Location::Elsewhere`] the client is
/// told the address of the host that holds it (a `Moved` refusal,
/// `docs/PROTOCOL.md` §9.3) and resumes there; [`Location::Unknown`] and
/// [`Location::Refused`] refuse the resume.
pub async fn serve_with_directory<F>(
    listener: impl Into<Listener>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
    on_session: F,
    directory: Arc<dyn Directory>,
) -> io::Result<()>
where
    F: Fn(SessionHandle) + Send + Sync + 'static,
{
    serve_inner(listener, config, shutdown, Arc::new(on_session), directory).await
}

async fn serve_inner(
    listener: impl Into<Listener>,
    config: ServerConfig,
    shutdown: impl Future<Output = ()>,
    on_session: OnSession,
    directory: Arc<dyn Directory>,
) -> io::Result<()> {
    let listener: Listener = listener.into();
    let max_connections = config.max_connections.max(1);
    let limit = Arc::new(Semaphore::new(max_connections));
    config
        .stats
        .set_connection_limit(limit.clone(), max_connections);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (running_tx, mut running_rx) = mpsc::channel::<()>(1);
    let grace = config.shutdown_grace;
    let ctx = Arc::new(Ctx {
        config,
        registry: Arc::new(Registry::default()),
        on_session,
        shutdown: stop_rx,
        running: running_tx,
        directory,
        refusals: SharedThrottle::new(LOG_EVERY),
        limit: limit.clone(),
    });
    if let Some(rx) = ctx.config.adoptions.as_ref().and_then(|a| a.take()) {
        tokio::spawn(adopt_all(ctx.clone(), rx));
    }
    // Accept errors and connections over the cap come in floods: one line per
    // LOG_EVERY each, with a count of the rest.
    let mut accept_errors = LogThrottle::new(LOG_EVERY);
    let mut over_cap = LogThrottle::new(LOG_EVERY);
    let mut paused = ctx.config.accept_paused.clone();
    tokio::pin!(shutdown);
    let result = loop {
        if let Some(gate) = paused.as_mut() {
            // Closed gate: wait (without accepting) until it opens again, or
            // its sender is gone (then it stays open), or shutdown.
            let (stop, gone) = tokio::select! {
                _ = &mut shutdown => (true, false),
                r = gate.wait_for(|p| !*p) => (false, r.is_err()),
            };
            if stop {
                break Ok(());
            }
            if gone {
                paused = None;
            }
        }
        let accepted = tokio::select! {
            _ = &mut shutdown => break Ok(()),
            r = listener.accept() => r,
            // The gate closed while waiting: stop accepting at once.
            _ = gate_closes(&mut paused) => continue,
        };
        match accepted {
            Ok((sock, peer)) => match limit.clone().try_acquire_owned() {
                Ok(permit) => {
                    tokio::spawn(handle_connection(ctx.clone(), sock, peer, permit));
                }
                Err(_) => {
                    let busy = ctx.config.stats.busy_slot(ctx.config.busy_overflow);
                    if let Some(n) = over_cap.allow(std::time::Instant::now()) {
                        tracing::warn!(
                            "at the limit of {max_connections} connections: answering new ones \"busy\" (raise it with max_connections){}",
                            suppressed_note(n)
                        );
                    }
                    match busy {
                        Some(slot) => {
                            tokio::spawn(answer_busy(ctx.clone(), sock, peer, slot));
                        }
                        // Even the busy answers are at their cap: close at once.
                        None => drop(sock),
                    }
                }
            },
            Err(e) if is_transient(&e) => {
                if let Some(n) = accept_errors.allow(std::time::Instant::now()) {
                    tracing::warn!("accept failed: {e}; retrying{}", suppressed_note(n));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => break Err(e),
        }
    };
    drop(listener);
    let _ = stop_tx.send(true);
    drop(ctx);
    // Every driver and connection task holds a `running` sender; all dropped = all stopped.
    let _ = tokio::time::timeout(grace + Duration::from_secs(1), running_rx.recv()).await;
    result
}

/// Completes when the accept gate closes (never without a gate, or once its
/// sender is gone).
async fn gate_closes(gate: &mut Option<watch::Receiver<bool>>) {
    match gate {
        Some(g) => {
            if g.wait_for(|p| *p).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}

/// Answers a connection over the connection cap with the Busy refusal
/// (status 5): reads its hello for at most [`BUSY_HELLO_TIMEOUT`], so the
/// client learns at once to try later instead of waiting in the backlog.
async fn answer_busy(ctx: Arc<Ctx>, mut sock: Transport, peer: SocketAddr, _slot: BusySlot) {
    let _running = ctx.running.clone();
    let timeout = ctx.config.hello_timeout.min(BUSY_HELLO_TIMEOUT);
    match tokio::time::timeout(timeout, read_opening(&mut sock)).await {
        Ok(Ok((Opening::New { hello, .. } | Opening::Resume { hello, .. }, _))) => {
            tracing::debug!("connection from {peer}: at the connection limit, answered busy");
            reject(sock, hello, roam_proto::Error::ServerBusy).await;
        }
        _ => tracing::debug!("connection from {peer}: at the connection limit, no opening"),
    }
}

/// Reads a connection's opening until [`route_opening`] decides, and returns
/// its decision with the bytes read. A connection that closes first fails
/// the handshake.
async fn read_opening(sock: &mut Transport) -> Result<(Opening, Vec<u8>), roam_proto::Error> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        match route_opening(&buf) {
            Opening::Incomplete => {}
            decided => return Ok((decided, buf)),
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(roam_proto::Error::HandshakeFailed),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Writes `reply` (if any) and closes: a refusal decided before any session.
async fn refuse_raw(mut sock: Transport, reply: Vec<u8>) {
    use tokio::io::AsyncWriteExt;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        if !reply.is_empty() {
            let _ = sock.write_all(&reply).await;
        }
        let _ = sock.shutdown().await;
    })
    .await;
}

/// Accept errors that concern one connection or a passing resource shortage.
fn is_transient(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || e.raw_os_error().is_some_and(|c| c == 23 || c == 24) // ENFILE, EMFILE
}

async fn handle_connection(
    ctx: Arc<Ctx>,
    mut sock: Transport,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
) {
    let _running = ctx.running.clone();
    let (opening, buf) =
        match tokio::time::timeout(ctx.config.hello_timeout, read_opening(&mut sock)).await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                tracing::debug!("connection from {peer}: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(
                    "connection from {peer}: no opening within {:?}",
                    ctx.config.hello_timeout
                );
                return;
            }
        };
    match opening {
        Opening::Resume { id, hello, used } => {
            let rest = buf[used..].to_vec();
            // Boxed: a channel allocates its slots up front, 32 at a time.
            let h = Box::new(Handoff {
                sock,
                hello,
                rest,
                peer,
                permit,
            });
            resume(&ctx, id, h).await;
        }
        Opening::New { hello, used } => {
            let rest = buf[used..].to_vec();
            new_session(&ctx, sock, peer, permit, hello, rest).await;
        }
        Opening::Refuse { error, reply } => {
            tracing::debug!("connection from {peer}: {error}");
            refuse_raw(sock, reply).await;
        }
        _ => {}
    }
}

/// Routes a resume: to the live session's driver, else where the directory
/// says. The directory is asked once; the routing map is looked at again
/// after it answers, since it may have waited for another connection to
/// install the session.
async fn resume(ctx: &Arc<Ctx>, id: SessionId, mut h: Box<Handoff>) {
    let peer = h.peer;
    let mut asked = false;
    loop {
        if let Some(tx) = ctx.registry.get(&id) {
            match tx.send(h).await {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => h = back,
            }
        }
        if asked {
            break;
        }
        asked = true;
        match ctx.directory.locate(id).await {
            Location::Stored(restored) => {
                install(ctx, id, *restored, h).await;
                return;
            }
            Location::Elsewhere(addr) => {
                match h.hello.redirect(&addr) {
                    Some(reply) => {
                        tracing::info!(
                            "resume of session {id} from {peer}: it lives at {addr}; redirected"
                        );
                        refuse_raw(h.sock, reply).await;
                    }
                    None => {
                        tracing::warn!("resume of session {id} from {peer}: its host's address {addr:?} is unusable; refused");
                        reject(h.sock, h.hello, roam_proto::Error::UnknownSession).await;
                    }
                }
                return;
            }
            Location::Refused(e) => {
                tracing::info!("refused resume of session {id} from {peer}: {e}");
                reject(h.sock, h.hello, e).await;
                return;
            }
            Location::Unknown => {}
        }
    }
    tracing::info!(
        "refused resume from {peer}: no session {id} (expired, closed or server restarted)"
    );
    reject(h.sock, h.hello, roam_proto::Error::UnknownSession).await;
}

/// Starts a new session on `sock` (within the session caps) and spawns its driver.
async fn new_session(
    ctx: &Arc<Ctx>,
    sock: Transport,
    peer: SocketAddr,
    permit: OwnedSemaphorePermit,
    hello: Hello,
    rest: Vec<u8>,
) {
    let slot = match ctx.config.stats.admit(
        Some(peer.ip()),
        ctx.config.max_sessions,
        ctx.config.max_sessions_per_ip,
    ) {
        Ok(slot) => slot,
        Err(refusal) => {
            if let Some(n) = ctx.refusals.allow() {
                let why = match refusal {
                    Refusal::Sessions(max) => format!("at the limit of {max} sessions"),
                    Refusal::PerIp(max) => {
                        format!("{} already holds {max} sessions, its limit", peer.ip())
                    }
                };
                tracing::warn!(
                    "refused new session from {peer}: {why}; answered busy{}",
                    suppressed_note(n)
                );
            }
            reject(sock, hello, roam_proto::Error::ServerBusy).await;
            return;
        }
    };
    let now = Instant::now().into_std();
    let (session, tid) = match Session::accept(&ctx.config.proto, now, &hello, network_peer(peer)) {
        Ok(s) => s,
        Err(e) => {
            if let Some(n) = ctx.refusals.allow() {
                tracing::warn!("refused new session from {peer}: {e}{}", suppressed_note(n));
            }
            reject(sock, hello, e).await;
            return;
        }
    };
    let Some(id) = session.id() else { return };
    crate::sockopt::configure(&sock, ctx.config.proto.session.suspend_after * 2);
    let (tx, rx) = mpsc::channel(HANDOFF_QUEUE);
    ctx.registry.lock().insert(id, tx);
    let inner = Inner::new(session);
    let side = ServerSide {
        id,
        handoffs: rx,
        registry: ctx.registry.clone(),
        on_session: ctx.on_session.clone(),
        shutdown: ctx.shutdown.clone(),
        shutdown_grace: ctx.config.shutdown_grace,
        _running: ctx.running.clone(),
        slot,
        max_sessions_per_key: ctx.config.max_sessions_per_key,
    };
    let mut driver = Driver::new(
        inner,
        Conn::new(tid, sock, peer, Some(permit)),
        Kind::Server(Box::new(side)),
    );
    driver.initial_input(&rest);
    tracing::debug!("new session {id} from {peer}");
    // A task of its own, sized to the driver alone: this one (hello
    // parsing, lookups, refusals) ends here and frees its memory.
    tokio::spawn(driver.run::<crate::driver::AsServer>());
}

/// Puts a restored session into the routing map, queues the resume that
/// asked for it, tells the caller its handle and runs its driver.
async fn install(ctx: &Arc<Ctx>, id: SessionId, restored: Restored, h: Box<Handoff>) {
    let (tx, rx) = mpsc::channel(HANDOFF_QUEUE);
    let existing = {
        let mut reg = ctx.registry.lock();
        let existing = reg.get(&id).cloned();
        if existing.is_none() {
            reg.insert(id, tx.clone());
        }
        existing
    };
    if let Some(existing) = existing {
        // Installed by another connection meanwhile: that copy wins.
        tracing::warn!("session {id} restored twice; keeping the first");
        if let Err(mpsc::error::SendError(h)) = existing.send(h).await {
            reject(h.sock, h.hello, roam_proto::Error::UnknownSession).await;
        }
        return;
    }
    // A fresh channel has room for the first handoff.
    let _ = tx.try_send(h);
    drop(tx);
    run_restored(ctx, id, restored, rx, None);
}

/// Installs sessions handed over with their live connections (relay
/// takeover, [`crate::Adoption`]) as they arrive, until the server stops.
async fn adopt_all(ctx: Arc<Ctx>, mut rx: mpsc::UnboundedReceiver<crate::Adoption>) {
    let mut stop = ctx.shutdown.clone();
    loop {
        let a = tokio::select! {
            a = rx.recv() => a,
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(a) = a else { return };
        adopt(&ctx, a);
    }
}

/// Installs one adopted session on its connection. A connection or state
/// that is refused is dropped (the client sees its transport end and
/// resumes) and the session is installed suspended, waiting for that resume.
fn adopt(ctx: &Arc<Ctx>, a: crate::Adoption) {
    let crate::Adoption { mut restored, live } = a;
    let Some(id) = restored.session.id() else {
        return;
    };
    let now = Instant::now().into_std();
    let conn = match restored.session.adopt_transport(now, &live.state) {
        Ok(tid) => match Transport::adopt(live.fd) {
            Ok(sock) => {
                crate::sockopt::configure(&sock, ctx.config.proto.session.suspend_after * 2);
                let mut c = Conn::new(
                    tid,
                    sock,
                    live.peer,
                    ctx.limit.clone().try_acquire_owned().ok(),
                );
                let mut unsent = live.unsent;
                c.queue(&mut unsent);
                Some(c)
            }
            Err(e) => {
                tracing::warn!("session {id}: its handed-over connection is unusable ({e}); waiting for the client to resume");
                restored.session.handle_transport_closed(now, tid);
                None
            }
        },
        Err(e) => {
            tracing::warn!("session {id}: its handed-over connection state was refused ({e}); waiting for the client to resume");
            None
        }
    };
    let (tx, rx) = mpsc::channel(HANDOFF_QUEUE);
    {
        let mut reg = ctx.registry.lock();
        if reg.contains_key(&id) {
            tracing::warn!("session {id} adopted twice; keeping the first");
            return;
        }
        reg.insert(id, tx);
    }
    tracing::debug!(
        "adopted session {id}{}",
        if conn.is_some() {
            " on its connection"
        } else {
            ""
        }
    );
    run_restored(ctx, id, restored, rx, conn);
}

/// Runs a restored session (in the routing map already): announces its
/// handle, then spawns its driver, on `conn` or waiting for a resume.
fn run_restored(
    ctx: &Arc<Ctx>,
    id: SessionId,
    restored: Restored,
    handoffs: mpsc::Receiver<Box<Handoff>>,
    conn: Option<Conn>,
) {
    let Restored {
        session,
        unaccepted,
        orphans,
        on_installed,
    } = restored;
    let inner = Inner::new(session);
    {
        let mut sh = inner.lock();
        sh.connected = true;
        let rare = sh.rare();
        rare.incoming.extend(unaccepted);
        rare.orphans.extend(orphans);
        sh.tidy();
    }
    on_installed(SessionHandle::new(inner.clone()));
    let side = ServerSide {
        id,
        handoffs,
        registry: ctx.registry.clone(),
        on_session: ctx.on_session.clone(),
        shutdown: ctx.shutdown.clone(),
        shutdown_grace: ctx.config.shutdown_grace,
        _running: ctx.running.clone(),
        slot: ctx.config.stats.slot_unchecked(),
        max_sessions_per_key: usize::MAX,
    };
    tracing::debug!("restored session {id}");
    let driver = match conn {
        Some(c) => Driver::new(inner, c, Kind::Server(Box::new(side))),
        None => Driver::restored(inner, Kind::Server(Box::new(side))),
    };
    tokio::spawn(driver.run::<crate::driver::AsServer>());
}
