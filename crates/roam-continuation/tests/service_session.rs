//! A service set carried in a managed session's continuation when a
//! cluster moves the session (issue 15; `docs/SERVICE.md`, "A set carried
//! in a session's continuation").
//!
//! A real roam client sends numbered requests over its managed session to
//! a front-end (the set's root, inside a cluster host); the front-end
//! forwards each over a Unix socket to its back-end, a child process
//! (`examples/service_ledger.rs`) that appends a line to a ledger file (its
//! effect) and answers. The cluster moves the session between two hosts
//! mid-stream: the front-end saves the set's cut into the session's
//! continuation, the back-end ends, and the destination's resume routine
//! restarts a back-end from its part. What the user cares about: every
//! reply arrives once, in order, with the right value, and the ledger holds
//! each request's effect exactly once; a destination that cannot run the
//! back-end refuses the move before it commits and the session goes on at
//! its source, nothing lost.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{bounded, cli, init_logging, wait_until};
use roam::RoamStream;
use roam_continuation::service_set::{check_cut, Restored, SessionSet};
use roam_continuation::{
    ClusterConfig, ClusterIdentity, Continuation, Host, HostConfig, ManagedSession, MoveError,
    MoveReport, Service,
};
use roam_proto::Keypair;
use roam_service::{Interval, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;

#[path = "../examples/service_ledger.rs"]
#[allow(dead_code, unreachable_pub)]
mod ledger;

/// The value request `seq` carries.
fn value(seq: u64) -> u64 {
    seq.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5555
}

/// What one host's front-end needs, and what it measured.
struct Front {
    /// The back-end program (missing on a host that cannot run it).
    backend: PathBuf,
    /// Where each set incarnation's sockets go (one directory each).
    work: PathBuf,
    /// The ledger file (shared by both hosts, like a shared store).
    ledger: PathBuf,
    /// The back-end's pause between its reply and its export (ms): a cut
    /// then usually falls after a reply the front-end has and before the
    /// back-end's export, so the restart replays a request and discards
    /// its reply.
    think_ms: u64,
    /// Sets started here (fresh or restored).
    starts: AtomicUsize,
    /// Sets restarted here from a cut.
    restored: AtomicUsize,
    /// Size of each cut saved here (bytes).
    cuts: Mutex<Vec<usize>>,
}

impl Front {
    fn limits() -> Limits {
        Limits::default()
    }

    /// Starts the back-end and joins it to `root`: fresh, or from its part
    /// of a restored cut. Returns the set (running) and the child.
    async fn start_set(
        &self,
        root: roam_continuation::service_set::Member,
        restored: Option<Restored>,
    ) -> std::io::Result<(SessionSet, Child)> {
        let n = self.starts.fetch_add(1, Ordering::SeqCst);
        let dir = self.work.join(n.to_string());
        std::fs::create_dir_all(&dir)?;
        let control = UnixListener::bind(dir.join("control.sock"))?;
        let req = UnixListener::bind(dir.join("req.sock"))?;
        let rep = UnixListener::bind(dir.join("rep.sock"))?;
        let mut child = Command::new(&self.backend)
            .arg(dir.join("control.sock"))
            .arg(&dir)
            .arg(&self.ledger)
            .arg(self.think_ms.to_string())
            .kill_on_drop(true)
            .spawn()?;
        let parts = restored.as_ref().map(|r| r.parts.clone());
        let controls = common::join_members(
            &control,
            &["ledger"],
            parts.as_deref(),
            std::slice::from_mut(&mut child),
            None,
        )
        .await?;
        let accept = |l: UnixListener| async move {
            tokio::time::timeout(Duration::from_secs(10), l.accept())
                .await
                .map_err(|_| std::io::Error::other("the back-end never connected"))?
                .map(|(s, _)| s)
        };
        root.add_writer(ledger::REQUESTS, accept(req).await?)?;
        root.add_reader(ledger::REPLIES, accept(rep).await?)?;
        let set = match restored {
            None => SessionSet::new(root, controls, Self::limits()),
            Some(r) => {
                self.restored.fetch_add(1, Ordering::SeqCst);
                r.start(controls).await?
            }
        };
        Ok((set, child))
    }
}

/// The front-end's loop for one session: requests from the client go to
/// the back-end, replies come back; at a freeze request (between requests)
/// the set's cut goes into the continuation and the session suspends.
async fn serve(
    front: Arc<Front>,
    session: ManagedSession,
    mut stream: RoamStream,
    mut set: SessionSet,
    mut child: Child,
    mut pending: Vec<u8>,
) {
    let mut buf = vec![0u8; 64];
    loop {
        tokio::select! {
            biased;
            _ = session.freeze_requested() => {
                session.store("pending", &pending).expect("store pending");
                match set.save(&session).await {
                    Ok(saved) => {
                        front.cuts.lock().unwrap().push(saved.bytes);
                        match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
                            Ok(Ok(s)) => assert!(s.success(), "back-end exit: {s}"),
                            other => panic!("the back-end did not end: {other:?}"),
                        }
                        let cont = Continuation::new("front").stream("main", stream);
                        let _ = session.suspend(cont).await;
                        return;
                    }
                    Err(failed) => {
                        eprintln!("save failed, the set goes on here: {}", failed.error);
                        set = failed.set;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            r = stream.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        // The client is done: so is the set.
                        let _ = child.kill().await;
                        return;
                    }
                    Ok(n) => n,
                };
                pending.extend_from_slice(&buf[..n]);
                while pending.len() >= 16 {
                    let req: Vec<u8> = pending.drain(..16).collect();
                    let root = set.root();
                    root.write_all(ledger::REQUESTS, &req).await.expect("request to the back-end");
                    let mut reply = [0u8; 16];
                    let mut got = 0;
                    while got < 16 {
                        let k = root.read(ledger::REPLIES, &mut reply[got..]).await.expect("reply");
                        assert!(k > 0, "the back-end closed its replies");
                        got += k;
                    }
                    if stream.write_all(&reply).await.is_err() {
                        return;
                    }
                    root.export(&reply[..8], Interval::Deterministic)
                        .await
                        .expect("root export");
                }
            }
        }
    }
}

fn front_service(front: Arc<Front>) -> Service {
    let check = front.clone();
    Service::new("front")
        .version("1")
        .on_move_in(move |attrs| {
            check_cut(attrs, Front::limits())?;
            if !check.backend.exists() {
                return Err(format!(
                    "no back-end program at {}",
                    check.backend.display()
                ));
            }
            Ok(())
        })
        .routine("front", move |mut r| {
            let front = front.clone();
            async move {
                let stream = r.take_stream("main").expect("the stream moved");
                let restored = SessionSet::restore(&r.session, Front::limits())
                    .expect("restore the cut")
                    .expect("the continuation carries a cut");
                let pending = r.session.retrieve("pending").unwrap_or_default();
                let root = restored.root.clone();
                let (set, child) = front
                    .start_set(root, Some(restored))
                    .await
                    .expect("restart the back-end");
                serve(front, r.session, stream, set, child, pending).await;
            }
        })
}

struct Node {
    name: String,
    host: Host,
    front: Arc<Front>,
    stop: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
}

struct Cluster {
    service_key: Keypair,
    config: ClusterConfig,
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
    ledger: PathBuf,
}

/// Two hosts `h0`, `h1` on loopback; `backend_ok[i]` says whether host `i`
/// has the back-end program.
async fn start_cluster(backend_ok: [bool; 2], think_ms: u64) -> Cluster {
    init_logging();
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger");
    let service_key = Keypair::generate().unwrap();
    let mut text = "cluster test\n".to_string();
    let mut prepared = Vec::new();
    for i in 0..2 {
        let clients = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peers = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let key = Keypair::generate().unwrap();
        let name = format!("h{i}");
        text.push_str(&format!(
            "host {name} clients={} peers={} key={}\n",
            clients.local_addr().unwrap(),
            peers.local_addr().unwrap(),
            key.public()
        ));
        prepared.push((name, clients, peers, key));
    }
    let config = ClusterConfig::parse(&text).unwrap();
    let mut nodes = Vec::new();
    for (i, (name, clients, peers, key)) in prepared.into_iter().enumerate() {
        let state = dir.path().join(format!("{name}-state"));
        let work = dir.path().join(format!("{name}-sets"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let backend = if backend_ok[i] {
            common::example("service_ledger")
        } else {
            dir.path().join("no-such-back-end")
        };
        let front = Arc::new(Front {
            backend,
            work,
            ledger: ledger.clone(),
            think_ms,
            starts: AtomicUsize::new(0),
            restored: AtomicUsize::new(0),
            cuts: Mutex::new(Vec::new()),
        });
        let mut sc = cli::server_config(service_key.clone());
        sc.max_sessions_per_ip = 1000;
        let mut hc = HostConfig::new(&state, sc);
        hc.cluster = Some(ClusterIdentity::new(config.clone(), &name, key).unwrap());
        let (host, _) = Host::builder(hc)
            .service(front_service(front.clone()))
            .open()
            .await
            .unwrap();
        let (s1, r1) = oneshot::channel::<()>();
        let (s2, r2) = oneshot::channel::<()>();
        let (h, h2, f) = (host.clone(), host.clone(), front.clone());
        let serve_task = tokio::spawn(async move {
            h.serve(
                clients,
                async {
                    let _ = r1.await;
                },
                move |handle| {
                    let Ok(s) = h2.adopt("front", handle) else {
                        return;
                    };
                    let f = f.clone();
                    tokio::spawn(async move {
                        let Ok((stream, _)) = s.handle().accept_stream().await else {
                            return;
                        };
                        let root = roam_continuation::service_set::Member::fresh(Front::limits());
                        let (set, child) =
                            f.start_set(root, None).await.expect("start the back-end");
                        serve(f, s, stream, set, child, Vec::new()).await;
                    });
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
            front,
            stop: vec![s1, s2],
            tasks: vec![serve_task, peer_task],
        });
    }
    Cluster {
        service_key,
        config,
        nodes,
        _dir: dir,
        ledger,
    }
}

impl Cluster {
    /// The index of the node holding session `id` live.
    fn holder(&self, id: roam::SessionId) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.host
                .sessions()
                .iter()
                .any(|r| r.id == id && r.state == "live")
        })
    }

    async fn shutdown(mut self) {
        for n in &mut self.nodes {
            for s in n.stop.drain(..) {
                let _ = s.send(());
            }
        }
        for n in &mut self.nodes {
            for t in n.tasks.drain(..) {
                let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
            }
        }
    }
}

/// A client sending `n` numbered requests (a short pause every 8) and
/// checking each reply: its number (in order, none twice) and its value.
struct Client {
    session: roam::SessionHandle,
    replies: Arc<AtomicU64>,
    /// The reader's first error, as soon as it has one.
    error: Arc<Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<Result<u64, String>>,
}

async fn client(c: &Cluster, host: &str, n: u64) -> Client {
    let config = cli::client_config(Some(c.service_key.public()));
    let session = roam::connect(&c.config.hosts[host].clients, config)
        .await
        .expect("connect");
    let stream = session.open_stream(b"front").unwrap();
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        for seq in 0..n {
            let mut req = seq.to_be_bytes().to_vec();
            req.extend_from_slice(&value(seq).to_be_bytes());
            w.write_all(&req).await.map_err(|e| e.to_string())?;
            if seq % 8 == 7 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        Ok::<_, String>(w)
    });
    let replies = Arc::new(AtomicU64::new(0));
    let seen = replies.clone();
    let error = Arc::new(Mutex::new(None));
    let failed = error.clone();
    let task = tokio::spawn(async move {
        let r = read_replies(&mut r, n, &seen).await;
        if let Err(e) = &r {
            *failed.lock().unwrap() = Some(e.clone());
        }
        r?;
        let w = writer.await.map_err(|e| e.to_string())??;
        drop(w);
        Ok(n)
    });
    Client {
        session,
        replies,
        error,
        task,
    }
}

async fn read_replies(
    r: &mut tokio::io::ReadHalf<RoamStream>,
    n: u64,
    seen: &AtomicU64,
) -> Result<(), String> {
    let mut reply = [0u8; 16];
    for seq in 0..n {
        r.read_exact(&mut reply)
            .await
            .map_err(|e| format!("reply {seq}: {e}"))?;
        let got = u64::from_be_bytes(reply[..8].try_into().unwrap());
        let v = u64::from_be_bytes(reply[8..].try_into().unwrap());
        if got != seq {
            return Err(format!("reply {seq} came as number {got}"));
        }
        if v != ledger::reply(seq, value(seq)) {
            return Err(format!("reply {seq} has the wrong value"));
        }
        seen.store(seq + 1, Ordering::SeqCst);
    }
    // Nothing more may come: a reply twice would show here.
    match tokio::time::timeout(Duration::from_millis(300), r.read(&mut reply)).await {
        Err(_) => {}
        Ok(Ok(0)) => {}
        Ok(other) => return Err(format!("after the last reply: {other:?}")),
    }
    Ok(())
}

/// Waits (at most 30 s) for `at_least` replies; fails at once with the
/// client's error if it has one.
async fn wait_replies(cl: &Client, at_least: u64) {
    let r = cl.replies.clone();
    let error = cl.error.clone();
    wait_until(Duration::from_secs(30), "replies", move || {
        if let Some(e) = error.lock().unwrap().as_ref() {
            panic!("the client: {e}");
        }
        r.load(Ordering::SeqCst) >= at_least
    })
    .await;
}

/// The ledger holds `n` lines, request `i`'s effect on line `i`, each once.
fn assert_ledger(path: &std::path::Path, n: u64) {
    let text = std::fs::read_to_string(path).expect("ledger");
    let lines: Vec<&str> = text.lines().collect();
    let want: Vec<String> = (0..n).map(|i| format!("{i} {}", value(i))).collect();
    if lines != want {
        let first = lines
            .iter()
            .zip(&want)
            .position(|(a, b)| *a != b)
            .unwrap_or(lines.len().min(want.len()));
        panic!(
            "ledger: {} lines for {n} requests; first difference at line {first}: {:?}",
            lines.len(),
            lines.get(first)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_moves_a_session_with_its_back_end_and_every_effect_happens_once() {
    bounded(Duration::from_secs(180), "test", async {
        let c = start_cluster([true, true], 2).await;
        const N: u64 = 1500;
        const MOVES: u64 = 6;
        let cl = client(&c, "h0", N).await;
        let id = cl.session.id().unwrap();
        let mut at = 0;
        let mut reports: Vec<MoveReport> = Vec::new();
        for round in 1..=MOVES {
            wait_replies(&cl, round * (N / (MOVES + 2))).await;
            let to = 1 - at;
            let report = c.nodes[at]
                .host
                .move_session(id, &c.nodes[to].name)
                .await
                .unwrap_or_else(|e| panic!("move {round}: {e}"));
            assert_eq!(report.revision, round);
            at = to;
            wait_until(Duration::from_secs(10), "the destination serves it", || {
                c.holder(id) == Some(at)
            })
            .await;
            reports.push(report);
        }
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&c.ledger, N);
        let restored: usize = c
            .nodes
            .iter()
            .map(|n| n.front.restored.load(Ordering::SeqCst))
            .sum();
        assert_eq!(restored as u64, MOVES, "one restart from a cut per move");
        let cuts: Vec<usize> = c
            .nodes
            .iter()
            .flat_map(|n| n.front.cuts.lock().unwrap().clone())
            .collect();
        assert_eq!(cuts.len() as u64, MOVES);
        let frozen: Vec<u128> = reports.iter().map(|r| r.frozen.as_micros()).collect();
        let total: Vec<u128> = reports.iter().map(|r| r.total.as_micros()).collect();
        let transfer: Vec<usize> = reports.iter().map(|r| r.transfer_bytes).collect();
        println!(
            "moves {MOVES}: frozen µs {frozen:?}, total µs {total:?}, cut bytes {cuts:?}, transfer bytes {transfer:?}"
        );
        let _ = tokio::time::timeout(Duration::from_secs(5), cl.session.close(0, "done")).await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_cannot_run_the_back_end_leaves_the_session_at_its_source() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster([true, false], 2).await;
        const N: u64 = 600;
        let cl = client(&c, "h0", N).await;
        let id = cl.session.id().unwrap();
        wait_replies(&cl, N / 4).await;
        let started = Instant::now();
        match c.nodes[0].host.move_session(id, "h1").await {
            Err(MoveError::Refused(r)) => {
                let why = r.to_string();
                assert!(why.contains("no back-end program"), "refusal: {why}");
            }
            other => panic!("the move should be refused: {other:?}"),
        }
        println!("refused after {:?}", started.elapsed());
        wait_until(Duration::from_secs(10), "the source serves it", || {
            c.holder(id) == Some(0)
        })
        .await;
        let before = cl.replies.load(Ordering::SeqCst);
        wait_replies(&cl, before + 50).await;
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&c.ledger, N);
        assert_eq!(c.nodes[1].front.starts.load(Ordering::SeqCst), 0);
        assert_eq!(
            c.nodes[0].front.restored.load(Ordering::SeqCst),
            1,
            "the source restarted its set from the cut it saved"
        );
        let _ = tokio::time::timeout(Duration::from_secs(5), cl.session.close(0, "done")).await;
        c.shutdown().await;
    })
    .await;
}
