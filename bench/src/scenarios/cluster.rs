//! Scenario 7: live sessions moving between the hosts of a cluster
//! (`roam_continuation::cluster`, issue 10 item 9).
//!
//! Three `roam_continuation::Host`s of one service run in the harness
//! process on loopback (shared service key, a host key each, one cluster
//! file), with their clients beside them. Three measurements:
//!
//! 1. **Stall vs state size.** A session holds `n` bytes of attributes
//!    (pseudo-random, so zstd cannot shrink them) and its client ping-pongs
//!    64-byte echoes in a loop, stamping each completed round trip. The
//!    session moves from host to host; the client-visible stall of a move is
//!    the longest gap between consecutive completed round trips ending after
//!    the move began. Beside it the host's own figures (`MoveReport`: frozen
//!    time, whole move, bytes pre-copied and transferred). Measured with the
//!    pre-copy (attributes copied while the session runs, only changed ones
//!    travel after the freeze) and without (`HostConfig::precopy = false`:
//!    everything travels after the freeze).
//! 2. **Drain.** `n` echo sessions at one host, each proven by an echo;
//!    `Host::drain()` moves them all to the two others. Time to its return,
//!    and until every client saw `SessionEvent::Resumed` and then completed
//!    an echo at its new host.
//! 3. **Throughput with periodic moves.** A bulk download (the server writes
//!    a position-dependent pattern, the client checks every byte) with a move
//!    every 2, 5 or 10 s, and without moves; MB/s and the loss against no
//!    moves (the Service Continuations paper's Fig. 8). Each download is
//!    timed (K + ½ intervals with K moves), not of a fixed size: the
//!    issue's sizes end within one interval on loopback.
//!
//! Any lost, duplicated or corrupted byte, and any move that fails, is a
//! scenario error; a state size the library refuses is reported as refused.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam::{RoamStream, SessionEvent, SessionHandle};
use roam_continuation::{
    ClusterConfig, ClusterIdentity, Continuation, Host, HostConfig, ManagedSession, Service,
};
use roam_proto::Keypair;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::progress;
use crate::peers::Lab;
use crate::stats::{median, summary, Summary};
use crate::Ctx;

/// The service every host runs.
const SERVICE: &str = "bench";
/// Bytes of one ping-pong round trip.
const PING: usize = 64;
/// Write block of the bulk download (bytes).
const BLOCK: usize = 64 * 1024;
/// Longest wait for any one step (a connect, an echo, a move).
const STEP: Duration = Duration::from_secs(60);
/// Round trips completed after a move before its stall is read.
const AFTER_MOVE: usize = 50;
/// Read gaps of a download at least this long are kept (to find each
/// move's stall).
const GAP: Duration = Duration::from_millis(1);
/// A move's stall is the longest read gap ending between its start and
/// this long after its end.
const AFTER_MOVE_WINDOW: Duration = Duration::from_millis(200);
/// Connections opened at once while setting up a drain.
const CONNECT_PARALLEL: usize = 32;

/// Byte `i` of the position-dependent pattern (download and ballast).
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// `n` pseudo-random bytes (splitmix64): state that does not compress.
fn noise(n: usize) -> Vec<u8> {
    let mut x = 0x0123_4567_89ab_cdefu64;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        v.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    v.truncate(n);
    v
}

fn err(what: impl std::fmt::Display) -> io::Error {
    io::Error::other(what.to_string())
}

/// `f` within `STEP`, its time-out an error naming `what`.
async fn step<T>(what: &str, f: impl std::future::Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(STEP, f)
        .await
        .map_err(|_| err(format!("{what}: no result within {STEP:?}")))?
}

/// One state size, with or without the pre-copy.
#[derive(Debug, Serialize)]
pub(crate) struct StallRow {
    /// Attribute bytes the session holds.
    pub(crate) state_bytes: usize,
    pub(crate) precopy: bool,
    /// Moves measured (one session moving around the three hosts).
    pub(crate) moves: usize,
    /// Client-visible stall: longest gap between completed round trips.
    pub(crate) stall_ms: Option<Summary>,
    /// Median gap between round trips away from moves (the loop's pace).
    pub(crate) baseline_rtt_ms: Option<f64>,
    /// Host side: freeze request to commit.
    pub(crate) frozen_ms: Option<Summary>,
    /// Host side: the whole move, from the offer.
    pub(crate) total_ms: Option<Summary>,
    pub(crate) precopy_bytes: Option<usize>,
    /// Median bytes of the final transfer (compressed record).
    pub(crate) transfer_bytes: Option<f64>,
    /// Why this size was not measured (the library refused it), if so.
    pub(crate) refused: Option<String>,
}

/// One drain.
#[derive(Debug, Serialize)]
pub(crate) struct DrainRow {
    pub(crate) sessions: usize,
    /// Whether the hosts reused links to their destinations.
    pub(crate) reuse_links: bool,
    pub(crate) moved: usize,
    /// `drain()` call to its return.
    pub(crate) drain_ms: f64,
    /// `drain()` call to the last client's `Resumed` event.
    pub(crate) all_resumed_ms: f64,
    /// `drain()` call to the last client's echo at its new host.
    pub(crate) all_echoed_ms: f64,
    /// Sessions that ended at each host.
    pub(crate) per_host: BTreeMap<String, usize>,
}

/// One download of a throughput run.
#[derive(Debug, Serialize)]
pub(crate) struct TputSample {
    pub(crate) round: usize,
    pub(crate) mbps: f64,
    /// Bytes received and checked.
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
    pub(crate) moves: usize,
    /// Median `frozen` of this download's moves (ms).
    pub(crate) frozen_median_ms: Option<f64>,
    /// Each move's stall as the client saw it: the longest read gap
    /// ending between the move's start and 200 ms after its end (ms).
    pub(crate) stall_ms: Vec<f64>,
    /// Those stalls' share of the download's time (%).
    pub(crate) stalled_pct: f64,
}

/// Throughput at one move interval.
#[derive(Debug, Serialize)]
pub(crate) struct TputRow {
    /// Seconds between moves; `None`: no moves.
    pub(crate) move_every_s: Option<f64>,
    /// Length of each download.
    pub(crate) seconds: f64,
    /// Median bytes of a download.
    pub(crate) median_bytes: f64,
    pub(crate) median_mbps: f64,
    /// Total moves over the rounds.
    pub(crate) moves: usize,
    /// Loss against no moves, percent of its median MB/s.
    pub(crate) loss_pct: f64,
    /// Median stall of a move as the client saw it (ms).
    pub(crate) median_stall_ms: f64,
    /// Median over the rounds of the moves' stalls' share of the time (%):
    /// the loss the moves explain, less sensitive to the machine's drift
    /// between downloads than `loss_pct`.
    pub(crate) stalled_pct: f64,
    pub(crate) samples: Vec<TputSample>,
}

/// The scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct Cluster {
    pub(crate) hosts: usize,
    pub(crate) ping_bytes: usize,
    pub(crate) stall: Vec<StallRow>,
    pub(crate) drain: Vec<DrainRow>,
    /// Drain sizes of the issue that this mode runs with fewer sessions.
    pub(crate) drain_note: String,
    pub(crate) throughput: Vec<TputRow>,
    pub(crate) throughput_rounds: usize,
    pub(crate) notes: Vec<String>,
}

// ---------------------------------------------------------------- service

/// The bench service: routine `echo` (echoes its stream; its state is the
/// echoed count plus `ballast` bytes of attributes) and routine `source`
/// (writes the pattern from its stored position up to its stored total).
fn service() -> Service {
    Service::new(SERVICE)
        .version("1")
        .routine("echo", |mut r| async move {
            match r.take_stream("main") {
                Some(s) => echo_loop(r.session, s).await,
                None => idle(r.session).await,
            }
        })
        .routine("source", |mut r| async move {
            match r.take_stream("main") {
                Some(s) => source_loop(r.session, s).await,
                None => idle(r.session).await,
            }
        })
}

/// A session without a stream: answers freezes until it goes.
async fn idle(s: ManagedSession) {
    s.freeze_requested().await;
    let _ = s.suspend(Continuation::new("echo")).await;
}

/// A new session: its first stream's metadata says what it is,
/// `echo:<ballast bytes>` or `source:<total bytes>`.
async fn adopt(host: Host, handle: SessionHandle) {
    let Ok(s) = host.adopt(SERVICE, handle) else {
        return;
    };
    let Ok((stream, meta)) = s.handle().accept_stream().await else {
        return;
    };
    let meta = String::from_utf8_lossy(&meta).into_owned();
    let (kind, n) = meta.split_once(':').unwrap_or((&meta, "0"));
    let n: u64 = n.parse().unwrap_or(0);
    match kind {
        "source" => {
            let _ = s.store("total", n.to_le_bytes());
            let _ = s.store("pos", 0u64.to_le_bytes());
            source_loop(s, stream).await;
        }
        _ => {
            if n > 0 {
                let ballast = noise(n as usize);
                if let Err(e) = s.store("ballast", ballast) {
                    // Tell the client: a stream that closes at once.
                    progress(&format!("cluster: {n} B of state refused: {e}"));
                    drop(stream);
                    idle(s).await;
                    return;
                }
            }
            echo_loop(s, stream).await;
        }
    }
}

/// Echoes until a freeze request; then stores its count and suspends.
async fn echo_loop(s: ManagedSession, mut stream: RoamStream) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut echoed = s
        .retrieve("echoed")
        .and_then(|v| v.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    loop {
        tokio::select! {
            _ = s.freeze_requested() => {
                let _ = s.store("echoed", echoed.to_le_bytes());
                let _ = s.suspend(Continuation::new("echo").stream("main", stream)).await;
                return;
            }
            r = stream.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        let _ = stream.shutdown().await;
                        s.freeze_requested().await;
                        let _ = s.suspend(Continuation::new("echo").stream("main", stream)).await;
                        return;
                    }
                    Ok(n) => n,
                };
                if stream.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                echoed += n as u64;
            }
        }
    }
}

/// Writes the pattern from `pos` to `total`, then finishes the stream; at a
/// freeze request stores `pos` and suspends. `write` is cancel-safe: a
/// write that loses the race wrote nothing, so `pos` is exact.
async fn source_loop(s: ManagedSession, mut stream: RoamStream) {
    let get = |n: &str| {
        s.retrieve(n)
            .and_then(|v| v.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    let total = get("total");
    let mut pos = get("pos");
    let mut buf = vec![0u8; BLOCK];
    let mut filled = (0, 0); // the pattern in `buf` covers [filled.0, filled.1)
    while pos < total {
        if pos >= filled.1 {
            let n = (total - pos).min(BLOCK as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(pos + k as u64);
            }
            filled = (pos, pos + n as u64);
        }
        let from = (pos - filled.0) as usize;
        let to = (filled.1 - filled.0) as usize;
        tokio::select! {
            biased;
            _ = s.freeze_requested() => {
                let _ = s.store("pos", pos.to_le_bytes());
                let _ = s.suspend(Continuation::new("source").stream("main", stream)).await;
                return;
            }
            r = stream.write(&buf[from..to]) => match r {
                Ok(n) if n > 0 => pos += n as u64,
                _ => return,
            },
        }
    }
    let _ = stream.shutdown().await;
    let _ = s.store("pos", pos.to_le_bytes());
    s.freeze_requested().await;
    let _ = s
        .suspend(Continuation::new("source").stream("main", stream))
        .await;
}

// ---------------------------------------------------------------- cluster

/// One running host.
struct Node {
    name: String,
    host: Host,
    clients: String,
    stop: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<io::Result<()>>>,
}

/// Three hosts of one service on loopback, in this process.
struct Fleet {
    service_key: Keypair,
    nodes: Vec<Node>,
    /// Every host's `HostConfig::reuse_links`.
    reuse_links: bool,
    _dir: tempfile::TempDir,
}

/// Session knobs of hosts and clients: the roam defaults.
fn session_config() -> roam_proto::Config {
    roam_proto::Config::default()
}

impl Fleet {
    /// Starts `n` hosts; `precopy` is every host's `HostConfig::precopy`.
    async fn start(ctx: &Ctx, n: usize, precopy: bool) -> io::Result<Fleet> {
        Self::start_with(ctx, n, precopy, true).await
    }

    /// [`Fleet::start`], with `HostConfig::reuse_links` as given.
    async fn start_with(
        ctx: &Ctx,
        n: usize,
        precopy: bool,
        reuse_links: bool,
    ) -> io::Result<Fleet> {
        let dir = tempfile::Builder::new()
            .prefix("cluster-")
            .tempdir_in(&ctx.env.dir)?;
        let service_key = Keypair::generate().map_err(err)?;
        let mut text = "cluster bench\n".to_string();
        let mut prepared = Vec::new();
        for i in 0..n {
            let clients = TcpListener::bind("127.0.0.1:0").await?;
            let peers = TcpListener::bind("127.0.0.1:0").await?;
            let key = Keypair::generate().map_err(err)?;
            let name = format!("h{i}");
            text.push_str(&format!(
                "host {name} clients={} peers={} key={}\n",
                clients.local_addr()?,
                peers.local_addr()?,
                key.public()
            ));
            prepared.push((name, clients, peers, key));
        }
        let config = ClusterConfig::parse(&text).map_err(err)?;
        let mut nodes = Vec::new();
        for (name, clients, peers, key) in prepared {
            let state = dir.path().join(&name);
            std::fs::create_dir_all(&state)?;
            let mut server = roam::ServerConfig::new(roam_proto::ServerConfig {
                keypair: service_key.clone(),
                authorized_keys: None,
                addresses: Vec::new(),
                session: session_config(),
            });
            server.max_connections = 1 << 16;
            server.max_sessions = 1 << 20;
            server.max_sessions_per_ip = 1 << 20;
            server.max_sessions_per_key = 1 << 20;
            let mut hc = HostConfig::new(&state, server);
            hc.cluster = Some(ClusterIdentity::new(config.clone(), &name, key).map_err(err)?);
            hc.precopy = precopy;
            hc.reuse_links = reuse_links;
            let (host, _) = Host::builder(hc)
                .service(service())
                .open()
                .await
                .map_err(err)?;
            let client_addr = clients.local_addr()?.to_string();
            let (s1, r1) = oneshot::channel::<()>();
            let (s2, r2) = oneshot::channel::<()>();
            let (h, h2) = (host.clone(), host.clone());
            let serve = tokio::spawn(async move {
                h.serve(
                    clients,
                    async {
                        let _ = r1.await;
                    },
                    move |handle| {
                        tokio::spawn(adopt(h2.clone(), handle));
                    },
                )
                .await
            });
            let h = host.clone();
            let peer_task = tokio::spawn(async move {
                h.serve_peers(peers, async {
                    let _ = r2.await;
                })
                .await
            });
            nodes.push(Node {
                name,
                host,
                clients: client_addr,
                stop: vec![s1, s2],
                tasks: vec![serve, peer_task],
            });
        }
        Ok(Fleet {
            service_key,
            nodes,
            reuse_links,
            _dir: dir,
        })
    }

    /// A client configuration pinning the service key.
    fn client_config(&self, keypair: &Keypair) -> roam::ClientConfig {
        let mut c = roam::ClientConfig::new(roam_proto::ClientConfig {
            keypair: keypair.clone(),
            server_trust: roam_proto::ServerTrust::Pinned(self.service_key.public()),
            session: session_config(),
        });
        c.backoff_initial = Duration::from_millis(20);
        c.backoff_max = Duration::from_millis(200);
        c.watch_network = false;
        c
    }

    /// A session to host `at` with one stream whose metadata is `meta`.
    async fn open(
        &self,
        keypair: &Keypair,
        at: usize,
        meta: &str,
    ) -> io::Result<(SessionHandle, RoamStream)> {
        let session = roam::connect(&self.nodes[at].clients, self.client_config(keypair))
            .await
            .map_err(err)?;
        let stream = session.open_stream(meta.as_bytes()).map_err(err)?;
        Ok((session, stream))
    }

    /// The index of the host holding session `id` live.
    fn holder(&self, id: roam::SessionId) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.host
                .sessions()
                .iter()
                .any(|r| r.id == id && r.state == "live")
        })
    }

    /// Stops every host (aborting what does not stop within a few seconds).
    async fn stop(mut self) {
        for n in &mut self.nodes {
            for s in n.stop.drain(..) {
                let _ = s.send(());
            }
        }
        for n in &mut self.nodes {
            for t in n.tasks.drain(..) {
                let abort = t.abort_handle();
                if tokio::time::timeout(Duration::from_secs(10), t)
                    .await
                    .is_err()
                {
                    abort.abort();
                }
            }
        }
    }
}

/// Closes `sessions` at once (each given a second at most).
async fn close_all(sessions: Vec<SessionHandle>) {
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(1), s.close(0, "done")).await;
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// Sends one `PING`-byte message numbered `k` and checks its echo.
async fn echo_once(stream: &mut RoamStream, k: u64) -> io::Result<()> {
    let mut msg = [0u8; PING];
    for (i, b) in msg.iter_mut().enumerate() {
        *b = pattern(k * PING as u64 + i as u64);
    }
    stream.write_all(&msg).await?;
    let mut back = [0u8; PING];
    stream.read_exact(&mut back).await?;
    if back != msg {
        return Err(err(format!("echo {k} came back altered")));
    }
    Ok(())
}

// ---------------------------------------------------------------- 1. stall

/// Ping-pong on `stream` until `stop`, stamping each completed round trip.
fn ping_pong(
    mut stream: RoamStream,
    stamps: Arc<Mutex<Vec<Instant>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<io::Result<RoamStream>> {
    tokio::spawn(async move {
        let mut k = 0u64;
        while !stop.load(Ordering::Relaxed) {
            step("a ping-pong round trip", echo_once(&mut stream, k)).await?;
            k += 1;
            stamps.lock().map_err(err)?.push(Instant::now());
        }
        Ok(stream)
    })
}

/// Moves one session of `state` bytes `moves` times around the fleet.
async fn stall_row(
    ctx: &Ctx,
    fleet: &Fleet,
    state: usize,
    precopy: bool,
    moves: usize,
) -> io::Result<StallRow> {
    let mut row = StallRow {
        state_bytes: state,
        precopy,
        moves: 0,
        stall_ms: None,
        baseline_rtt_ms: None,
        frozen_ms: None,
        total_ms: None,
        precopy_bytes: None,
        transfer_bytes: None,
        refused: None,
    };
    let (session, mut stream) = step(
        "a session to h0",
        fleet.open(&ctx.keypair, 0, &format!("echo:{state}")),
    )
    .await?;
    // The first echo proves the state was stored (a refused state closes
    // the stream).
    if let Err(e) = step("the first echo", echo_once(&mut stream, u64::MAX / 2)).await {
        row.refused = Some(format!(
            "the host refused {state} bytes of attributes (the stream closed: {e})"
        ));
        close_all(vec![session]).await;
        return Ok(row);
    }
    let id = session.id().ok_or_else(|| err("no session id"))?;
    let stamps = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let pinger = ping_pong(stream, stamps.clone(), stop.clone());
    let count = |s: &Arc<Mutex<Vec<Instant>>>| s.lock().map_or(0, |v| v.len());
    let wait_count = |n: usize| {
        let stamps = stamps.clone();
        step("round trips after the move", async move {
            while count(&stamps) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(())
        })
    };
    wait_count(AFTER_MOVE).await?;
    let (mut stalls, mut frozen, mut total, mut transfer) = (vec![], vec![], vec![], vec![]);
    let mut baseline = vec![];
    let mut at = 0;
    for i in 0..moves {
        let to = (at + 1) % fleet.nodes.len();
        let began = Instant::now();
        let report = fleet.nodes[at]
            .host
            .move_session(id, &fleet.nodes[to].name)
            .await
            .map_err(|e| err(format!("move {i} of a {state}-byte session: {e}")))?;
        at = to;
        let done = count(&stamps);
        wait_count(done + AFTER_MOVE).await?;
        let v = stamps.lock().map_err(err)?.clone();
        // Gaps whose end follows the move's start: the stall is the longest.
        let mut longest = 0.0f64;
        for w in v.windows(2) {
            let gap = (w[1] - w[0]).as_secs_f64() * 1000.0;
            if w[1] >= began {
                longest = longest.max(gap);
            } else {
                baseline.push(gap);
            }
        }
        stamps.lock().map_err(err)?.clear();
        wait_count(AFTER_MOVE).await?;
        stalls.push(longest);
        frozen.push(report.frozen.as_secs_f64() * 1000.0);
        total.push(report.total.as_secs_f64() * 1000.0);
        transfer.push(report.transfer_bytes as f64);
        row.precopy_bytes = Some(report.precopy_bytes);
    }
    stop.store(true, Ordering::Relaxed);
    step("the ping-pong to stop", async {
        pinger.await.map_err(err)?.map(drop)
    })
    .await?;
    if fleet.holder(id) != Some(at) {
        return Err(err(format!(
            "the session is not live at {} after its last move",
            fleet.nodes[at].name
        )));
    }
    close_all(vec![session]).await;
    row.moves = moves;
    row.stall_ms = Some(summary(&stalls));
    row.baseline_rtt_ms = Some(median(&baseline));
    row.frozen_ms = Some(summary(&frozen));
    row.total_ms = Some(summary(&total));
    row.transfer_bytes = Some(median(&transfer));
    Ok(row)
}

/// One unmeasured 0-byte session moved once around the fleet, with an echo
/// at each host: the first links, handshakes and store writes are not
/// measured.
async fn warm_up(ctx: &Ctx, fleet: &Fleet) -> io::Result<()> {
    let (session, mut stream) =
        step("a warm-up session", fleet.open(&ctx.keypair, 0, "echo:0")).await?;
    let id = session.id().ok_or_else(|| err("no session id"))?;
    step("a warm-up echo", echo_once(&mut stream, 0)).await?;
    let n = fleet.nodes.len();
    for i in 0..n {
        let to = (i + 1) % n;
        fleet.nodes[i]
            .host
            .move_session(id, &fleet.nodes[to].name)
            .await
            .map_err(|e| err(format!("warm-up move: {e}")))?;
        step("a warm-up echo", echo_once(&mut stream, 1 + i as u64)).await?;
    }
    close_all(vec![session]).await;
    Ok(())
}

// ---------------------------------------------------------------- 2. drain

/// Drains `n` echo sessions from h0.
async fn drain_row(ctx: &Ctx, fleet: &Fleet, n: usize) -> io::Result<DrainRow> {
    let sem = Arc::new(tokio::sync::Semaphore::new(CONNECT_PARALLEL));
    let mut opening = Vec::with_capacity(n);
    for _ in 0..n {
        let sem = sem.clone();
        let kp = ctx.keypair.clone();
        let cfg = fleet.client_config(&kp);
        let addr = fleet.nodes[0].clients.clone();
        opening.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await.map_err(err)?;
            step("a session to drain", async {
                let session = roam::connect(&addr, cfg).await.map_err(err)?;
                let mut stream = session.open_stream(b"echo:0").map_err(err)?;
                echo_once(&mut stream, 0).await?;
                Ok((session, stream))
            })
            .await
        }));
    }
    let mut clients = Vec::with_capacity(n);
    for t in opening {
        clients.push(t.await.map_err(err)??);
    }
    let ids: Vec<roam::SessionId> = clients
        .iter()
        .map(|(s, _)| s.id().ok_or_else(|| err("no session id")))
        .collect::<io::Result<_>>()?;
    // Each client waits for its Resumed event, then echoes at its new host.
    let mut watchers = Vec::with_capacity(n);
    let mut sessions = Vec::with_capacity(n);
    for (session, mut stream) in clients {
        let mut events = session.events();
        sessions.push(session);
        watchers.push(tokio::spawn(async move {
            step("a drained client's Resumed event", async {
                loop {
                    match events.recv().await {
                        Ok(SessionEvent::Resumed { .. }) => break,
                        Ok(SessionEvent::Closed { .. }) => {
                            return Err(err("a drained session closed"))
                        }
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(e) => return Err(err(e)),
                    }
                }
                Ok(())
            })
            .await?;
            let resumed = Instant::now();
            step("an echo after the drain", echo_once(&mut stream, 1)).await?;
            Ok::<_, io::Error>((resumed, Instant::now(), stream))
        }));
    }
    let began = Instant::now();
    let report = fleet.nodes[0].host.drain().await.map_err(err)?;
    let drain_ms = began.elapsed().as_secs_f64() * 1000.0;
    if !report.failed.is_empty() || report.moved != n {
        return Err(err(format!(
            "drain of {n} moved {} and failed {}: {:?}",
            report.moved,
            report.failed.len(),
            report.failed.first()
        )));
    }
    let (mut last_resumed, mut last_echo) = (began, began);
    let mut streams = Vec::with_capacity(n);
    for w in watchers {
        let (r, e, s) = w.await.map_err(err)??;
        last_resumed = last_resumed.max(r);
        last_echo = last_echo.max(e);
        streams.push(s);
    }
    let mut per_host = BTreeMap::new();
    for id in &ids {
        let at = fleet
            .holder(*id)
            .ok_or_else(|| err("a drained session is live nowhere"))?;
        if at == 0 {
            return Err(err("a drained session is still at h0"));
        }
        *per_host.entry(fleet.nodes[at].name.clone()).or_insert(0) += 1;
    }
    close_all(sessions).await;
    drop(streams);
    Ok(DrainRow {
        sessions: n,
        reuse_links: fleet.reuse_links,
        moved: report.moved,
        drain_ms,
        all_resumed_ms: (last_resumed - began).as_secs_f64() * 1000.0,
        all_echoed_ms: (last_echo - began).as_secs_f64() * 1000.0,
        per_host,
    })
}

// ---------------------------------------------------------------- 3. throughput

/// Downloads for `span` (and at least `min_bytes`) checking every byte,
/// moving the session at every multiple of `every` within the span. The
/// source would write without end: the client stops reading at the end and
/// closes the session. Any lost, repeated or altered byte breaks the
/// position-dependent pattern. Returns MB/s, bytes, moves, their frozen
/// times (ms), their stalls as the client saw them (ms: the longest read
/// gap ending during the move or just after it) and the seconds taken.
async fn download(
    fleet: &Fleet,
    keypair: &Keypair,
    min_bytes: u64,
    span: Duration,
    every: Option<Duration>,
) -> io::Result<(f64, u64, usize, Vec<f64>, Vec<f64>, f64)> {
    let (session, mut stream) = step(
        "a download session",
        fleet.open(keypair, 0, &format!("source:{}", u64::MAX / 2)),
    )
    .await?;
    let id = session.id().ok_or_else(|| err("no session id"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let began = Instant::now();
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; BLOCK];
        let mut off = 0u64;
        let mut last = Instant::now();
        let mut gaps: Vec<(Instant, Duration)> = Vec::new();
        while !(stop2.load(Ordering::Relaxed) && off >= min_bytes) {
            let n = stream
                .read(&mut buf)
                .await
                .map_err(|e| err(format!("download read at byte {off}: {e}")))?;
            if n == 0 {
                return Err(err(format!("download ended at byte {off}")));
            }
            if let Some(k) = (0..n).find(|&k| buf[k] != pattern(off + k as u64)) {
                return Err(err(format!("download byte {} is wrong", off + k as u64)));
            }
            off += n as u64;
            let now = Instant::now();
            if now - last >= GAP {
                gaps.push((now, now - last));
            }
            last = now;
        }
        Ok::<_, io::Error>((off, Instant::now(), gaps))
    });
    let mut moves = 0;
    let mut frozen = Vec::new();
    let mut windows = Vec::new();
    let mut at = 0;
    let end = tokio::time::Instant::now() + span;
    if let Some(every) = every {
        let mut next = tokio::time::Instant::now() + every;
        while next < end && !reader.is_finished() {
            tokio::time::sleep_until(next).await;
            let to = (at + 1) % fleet.nodes.len();
            let from = Instant::now();
            let r = fleet.nodes[at]
                .host
                .move_session(id, &fleet.nodes[to].name)
                .await
                .map_err(|e| err(format!("move {moves} of a download: {e}")))?;
            frozen.push(r.frozen.as_secs_f64() * 1000.0);
            windows.push((from, Instant::now()));
            moves += 1;
            at = to;
            next += every;
        }
    }
    tokio::time::sleep_until(end).await;
    stop.store(true, Ordering::Relaxed);
    let (n, ended, gaps) = step("the download's end", async { reader.await.map_err(err)? }).await?;
    close_all(vec![session]).await;
    let secs = (ended - began).as_secs_f64();
    let stalls: Vec<f64> = windows
        .iter()
        .map(|(from, to)| {
            gaps.iter()
                .filter(|(end, _)| end >= from && *end <= *to + AFTER_MOVE_WINDOW)
                .map(|(_, g)| g.as_secs_f64() * 1000.0)
                .fold(0.0, f64::max)
        })
        .collect();
    Ok((n as f64 / secs / 1e6, n, moves, frozen, stalls, secs))
}

// ---------------------------------------------------------------- run

/// Runs the scenario with the plan's sizes.
pub(crate) async fn run(ctx: Arc<Ctx>, _lab: Arc<Lab>) -> io::Result<Cluster> {
    let p = &ctx.plan;
    let mut notes = vec![
        "Three roam_continuation hosts of one service and their clients, all in the harness process on 127.0.0.1 (the machine's cores are shared by hosts and clients).".to_string(),
        "State: one attribute of pseudo-random bytes (zstd cannot shrink it). With pre-copy it is copied while the session runs and only the changed echo counter travels after the freeze; without (HostConfig::precopy = false) it all travels after the freeze.".to_string(),
        format!("Stall: longest gap between consecutive completed {PING}-byte echo round trips (client side) ending after the move began; {AFTER_MOVE} round trips after each move complete before it is read."),
    ];
    // Two fleets, with and without the pre-copy, alternating per size (the
    // order rotated) so that drift on the machine hits both alike.
    let fleets = [
        Fleet::start(&ctx, 3, true).await?,
        Fleet::start(&ctx, 3, false).await?,
    ];
    for f in &fleets {
        warm_up(&ctx, f).await?;
    }
    let mut stall = Vec::new();
    for (i, &size) in p.cluster_state_bytes.iter().enumerate() {
        for j in crate::peers::order(2, i) {
            let precopy = j == 0;
            let row = stall_row(&ctx, &fleets[j], size, precopy, p.cluster_moves).await?;
            progress(&format!(
                "cluster stall: {size} B, pre-copy {precopy}: {}",
                match (&row.stall_ms, &row.refused) {
                    (Some(s), _) => format!("median {:.2} ms, max {:.2} ms", s.median, s.max),
                    (_, Some(r)) => format!("refused: {r}"),
                    _ => String::new(),
                }
            ));
            stall.push(row);
        }
    }
    for f in fleets {
        f.stop().await;
    }
    stall.sort_by_key(|r| (!r.precopy, r.state_bytes));
    let mut drain = Vec::new();
    for &n in &p.cluster_drains {
        // Without link reuse first: the figure it is compared to.
        for reuse in [false, true] {
            let fleet = Fleet::start_with(&ctx, 3, true, reuse).await?;
            warm_up(&ctx, &fleet).await?;
            let row = drain_row(&ctx, &fleet, n).await?;
            progress(&format!(
                "cluster drain of {n} (link reuse {reuse}): {:.1} ms, all resumed {:.1} ms, all echoed {:.1} ms",
                row.drain_ms, row.all_resumed_ms, row.all_echoed_ms
            ));
            drain.push(row);
            fleet.stop().await;
        }
    }
    let missing: Vec<String> = [64, 1000]
        .iter()
        .filter(|n| !p.cluster_drains.contains(n))
        .map(|n| n.to_string())
        .collect();
    let drain_note = if missing.is_empty() {
        String::new()
    } else {
        format!(
            "{} mode drains {:?} sessions instead of the issue's 64 and 1,000",
            p.mode, p.cluster_drains
        )
    };
    // Throughput: downloads of (K + 1/2) intervals with a move at each of
    // the K interval boundaries (K = `cluster_min_moves`), and without moves
    // as long as the shortest case; rounds rotate the order.
    let fleet = Fleet::start(&ctx, 3, true).await?;
    warm_up(&ctx, &fleet).await?;
    let k = p.cluster_min_moves as f64 + 0.5;
    let shortest = p
        .cluster_move_every_s
        .iter()
        .copied()
        .fold(1.0f64, f64::min);
    let mut cases: Vec<(Option<f64>, f64)> = vec![(None, k * shortest)];
    cases.extend(p.cluster_move_every_s.iter().map(|s| (Some(*s), k * s)));
    let mut samples: Vec<Vec<TputSample>> = cases.iter().map(|_| Vec::new()).collect();
    for round in 0..p.cluster_tput_rounds {
        for i in crate::peers::order(cases.len(), round) {
            let (every, span) = cases[i];
            let (mbps, bytes, moves, frozen, stalls, secs) = download(
                &fleet,
                &ctx.keypair,
                p.cluster_download_bytes,
                Duration::from_secs_f64(span),
                every.map(Duration::from_secs_f64),
            )
            .await?;
            progress(&format!(
                "cluster download of {} MB, move every {}: {mbps:.1} MB/s, {moves} moves",
                bytes / 1_000_000,
                every.map_or("(never)".into(), |e| format!("{e} s"))
            ));
            samples[i].push(TputSample {
                round,
                mbps,
                bytes,
                seconds: bytes as f64 / mbps / 1e6,
                moves,
                frozen_median_ms: (!frozen.is_empty()).then(|| median(&frozen)),
                stall_ms: stalls.clone(),
                stalled_pct: stalls.iter().sum::<f64>() / 1000.0 / secs * 100.0,
            });
        }
    }
    fleet.stop().await;
    let none = median(&samples[0].iter().map(|s| s.mbps).collect::<Vec<_>>());
    let throughput = cases
        .into_iter()
        .zip(samples)
        .map(|((every, span), samples)| {
            let m = median(&samples.iter().map(|s| s.mbps).collect::<Vec<_>>());
            let stalled = median(&samples.iter().map(|s| s.stalled_pct).collect::<Vec<_>>());
            TputRow {
                move_every_s: every,
                seconds: span,
                median_bytes: median(&samples.iter().map(|s| s.bytes as f64).collect::<Vec<_>>()),
                median_mbps: m,
                moves: samples.iter().map(|s| s.moves).sum(),
                loss_pct: (1.0 - m / none) * 100.0,
                median_stall_ms: median(
                    &samples
                        .iter()
                        .flat_map(|s| s.stall_ms.iter().copied())
                        .collect::<Vec<_>>(),
                ),
                stalled_pct: stalled,
                samples,
            }
        })
        .collect();
    notes.push(format!(
        "Throughput: one session downloads (64 KiB writes; the client checks every byte against a position-dependent pattern, so a lost, repeated or altered byte is an error) for {} and a half intervals, moving h0 -> h1 -> h2 -> h0 at each interval boundary, and at least {} MB; without moves for as long as the shortest case. \
         Loss is against the median MB/s without moves; the machine's drift between downloads can exceed the 1 % goal, so beside it are the moves' stalls as the client's reads saw them (per move, the longest read gap ending between the move's start and 200 ms after its end) and their share of the download's time. The download is timed rather than of a fixed size because the issue's sizes (400 MB full, 64 MB quick) take well under one 2 s interval on loopback.",
        p.cluster_min_moves,
        p.cluster_download_bytes as f64 / 1e6,
    ));
    Ok(Cluster {
        hosts: 3,
        ping_bytes: PING,
        stall,
        drain,
        drain_note,
        throughput,
        throughput_rounds: p.cluster_tput_rounds,
        notes,
    })
}
