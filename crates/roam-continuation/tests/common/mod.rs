//! Shared helpers for the integration tests: an in-process host running the
//! bench service, clients behind fault proxies, bounded waits.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use roam_continuation::{Host, HostConfig, HostStats, OpenReport, Service};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[path = "../../examples/support/bench.rs"]
pub mod bench;
#[path = "../../examples/support/cli.rs"]
pub mod cli;
/// A real PostgreSQL for the database tests.
pub mod pg;
/// A cluster whose hosts serve a front-end with a back-end process.
pub mod set_front;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use roam_continuation::{read_attrs, ATTRS_META};
use roam_sim::proxy::FaultProxy;

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_logging() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A host serving on 127.0.0.1.
pub struct Running {
    pub host: Host,
    pub addr: SocketAddr,
    pub key: roam_proto::PublicKey,
    pub report: OpenReport,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Running {
    /// Graceful stop: sessions are asked for their continuations first.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
        }
    }

    /// Crash: the serving task is aborted, nothing is asked or flushed
    /// beyond what was already committed.
    pub async fn crash(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Opens a host on `dir` (key kept there) with `services`, serving on
/// `port` (0 for any), calling `on_session` for new sessions.
pub async fn start<F>(
    dir: &Path,
    port: u16,
    services: Vec<Service>,
    tune: impl FnOnce(&mut HostConfig),
    on_session: F,
) -> Running
where
    F: Fn(&Host, roam::SessionHandle) + Send + Sync + 'static,
{
    let keypair = cli::load_or_create_key(dir).expect("server key");
    let key = keypair.public();
    let mut config = HostConfig::new(dir, cli::server_config(keypair));
    tune(&mut config);
    // A host dropped just before (an in-process "restart") may still be
    // releasing the database on one of its tasks: retry briefly.
    let mut tries = 0;
    let (host, report) = loop {
        let mut b = Host::builder(config.clone());
        for s in &services {
            b = b.service(s.clone());
        }
        match b.open().await {
            Ok(x) => break x,
            Err(roam_continuation::Error::Store(e))
                if tries < 100 && e.to_string().contains("already open") =>
            {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("open host: {e}"),
        }
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop_tx, task) = spawn_serve(&host, listener, on_session);
    Running {
        host,
        addr,
        key,
        report,
        stop: Some(stop_tx),
        task: Some(task),
    }
}

// A cluster of hosts in this process (the cluster and service-set tests).

/// One host of a test cluster ([`start_cluster_hosts`]), serving clients
/// and peers on loopback.
pub struct ClusterHost<T> {
    /// Its name in the cluster file (`h0`, `h1`, ...).
    pub name: String,
    /// The host.
    pub host: Host,
    /// What the test keeps with the host (its front-end, its state
    /// directory): [`HostSpec::data`].
    pub data: T,
    /// Stop signals of its client and peer listeners.
    stop: Vec<oneshot::Sender<()>>,
    /// Its client and peer listeners' tasks.
    tasks: Vec<JoinHandle<std::io::Result<()>>>,
}

impl<T> ClusterHost<T> {
    /// Kills the host: both ports stop at once, nothing is handed over.
    pub fn kill(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.stop.clear();
    }
}

/// Stops `hosts`: every listener is told to stop first, then each task
/// gets 10 s to end.
pub async fn stop_cluster_hosts<T>(hosts: &mut [ClusterHost<T>]) {
    for n in hosts.iter_mut() {
        for s in n.stop.drain(..) {
            let _ = s.send(());
        }
    }
    for n in hosts.iter_mut() {
        for t in n.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

/// What a test gives [`start_cluster_hosts`] for one host.
pub struct HostSpec<T, F> {
    /// The host's state directory (it must exist).
    pub state: std::path::PathBuf,
    /// The service it runs.
    pub service: Service,
    /// Called with the host for each new client session.
    pub on_session: F,
    /// What the test keeps with the host ([`ClusterHost::data`]).
    pub data: T,
}

/// A test cluster started by [`start_cluster_hosts`].
pub struct ClusterHosts<T> {
    /// The service key every host serves with (the key clients pin).
    pub service_key: roam_proto::Keypair,
    /// The cluster file, parsed.
    pub config: roam_continuation::ClusterConfig,
    /// The hosts `h0`, `h1`, ... in that order.
    pub nodes: Vec<ClusterHost<T>>,
}

/// Starts `count` cluster hosts `h0`, `h1`, ... in this process: each
/// with its own host key and client and peer listeners on 127.0.0.1 (port
/// 0), all serving with one new service key; `extra_lines` (whole lines)
/// end the cluster file. Host `i`'s state directory, service,
/// new-session callback and data come from `spec(i, name)`; `tune`
/// adjusts each host's configuration (its cluster identity already set)
/// before the host opens.
pub async fn start_cluster_hosts<T, F>(
    count: usize,
    extra_lines: &str,
    tune: impl Fn(&mut HostConfig),
    mut spec: impl FnMut(usize, &str) -> HostSpec<T, F>,
) -> ClusterHosts<T>
where
    F: Fn(&Host, roam::SessionHandle) + Send + Sync + 'static,
{
    use roam_continuation::{ClusterConfig, ClusterIdentity};
    use roam_proto::Keypair;
    use tokio::net::TcpListener;
    let service_key = Keypair::generate().unwrap();
    let mut text = "cluster test\n".to_string();
    let mut prepared = Vec::new();
    for i in 0..count {
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
    text.push_str(extra_lines);
    let config = ClusterConfig::parse(&text).unwrap();
    let mut nodes = Vec::new();
    for (i, (name, clients, peers, key)) in prepared.into_iter().enumerate() {
        let HostSpec {
            state,
            service,
            on_session,
            data,
        } = spec(i, &name);
        let mut hc = HostConfig::new(&state, cli::server_config(service_key.clone()));
        hc.cluster = Some(ClusterIdentity::new(config.clone(), &name, key).unwrap());
        tune(&mut hc);
        let (host, _) = Host::builder(hc).service(service).open().await.unwrap();
        let (s1, serve_task) = spawn_serve(&host, clients, on_session);
        let (s2, r2) = oneshot::channel::<()>();
        let h = host.clone();
        let peer_task = tokio::spawn(async move {
            h.serve_peers(peers, async {
                let _ = r2.await;
            })
            .await
        });
        nodes.push(ClusterHost {
            name,
            host,
            data,
            stop: vec![s1, s2],
            tasks: vec![serve_task, peer_task],
        });
    }
    ClusterHosts {
        service_key,
        config,
        nodes,
    }
}

/// Serves `host`'s clients on `listener` in a task, calling `on_session`
/// for new sessions, until the returned sender sends or is dropped.
fn spawn_serve<F>(
    host: &Host,
    listener: tokio::net::TcpListener,
    on_session: F,
) -> (oneshot::Sender<()>, JoinHandle<std::io::Result<()>>)
where
    F: Fn(&Host, roam::SessionHandle) + Send + Sync + 'static,
{
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let h = host.clone();
    let h2 = host.clone();
    let task = tokio::spawn(async move {
        h.serve(
            listener,
            async {
                let _ = stop_rx.await;
            },
            move |handle| on_session(&h2, handle),
        )
        .await
    });
    (stop_tx, task)
}

/// Polls `f` every 10 ms until it holds; panics with `what` after `limit`.
pub async fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits for the host's stats to satisfy `f`.
pub async fn wait_stats(host: &Host, what: &str, f: impl Fn(&HostStats) -> bool) {
    let h = host.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let last = h.stats();
        if f(&last) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; stats {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `fut` with a time limit.
pub async fn bounded<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Sockets among this process's open file descriptors.
pub fn socket_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .map(|t| t.to_string_lossy().starts_with("socket:"))
                        .unwrap_or(false)
                })
                .count()
        })
        .unwrap_or(0)
}

/// A bench client behind `proxy`: received count, attrs seen, and the task
/// that returns the final count or an error.
pub struct Client {
    pub received: Arc<AtomicU64>,
    pub attrs_offsets: Arc<std::sync::Mutex<Vec<u64>>>,
    pub task: tokio::task::JoinHandle<Result<u64, String>>,
    pub session: roam::SessionHandle,
}

pub async fn client(
    proxy: &FaultProxy,
    key: roam_proto::PublicKey,
    params: bench::Params,
) -> Client {
    let session = roam::connect(&proxy.addr().to_string(), cli::client_config(Some(key)))
        .await
        .expect("connect");
    let mut stream = session.open_stream(params.meta().as_bytes()).expect("open");
    let received = Arc::new(AtomicU64::new(0));
    let attrs_offsets = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = session.clone();
    let a2 = attrs_offsets.clone();
    tokio::spawn(async move {
        while let Ok((mut st, meta)) = s2.accept_stream().await {
            assert_eq!(meta, ATTRS_META);
            let a = read_attrs(&mut st).await.expect("attrs");
            let off = u64::from_le_bytes(a["offset"].as_slice().try_into().expect("u64"));
            a2.lock().unwrap().push(off);
        }
    });
    let r2 = received.clone();
    let task = tokio::spawn(async move {
        bench::read_updates(&mut stream, |n| r2.store(n, Ordering::Relaxed)).await
    });
    Client {
        received,
        attrs_offsets,
        task,
        session,
    }
}

/// Cuts the client off (both sides see a reset; re-dials are refused).
pub fn cut(proxy: &FaultProxy) {
    proxy.refuse(true);
    proxy.reset_all();
}

pub fn heal(proxy: &FaultProxy) {
    proxy.refuse(false);
}

/// A bare protocol client (no driver): completes the first handshake over
/// `sock` and returns the session id. Dropping the socket afterwards looks
/// to the server like a lost transport.
pub async fn raw_handshake(
    sock: &mut tokio::net::TcpStream,
    server_key: roam_proto::PublicKey,
) -> roam::SessionId {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let cfg = roam_proto::ClientConfig {
        keypair: roam_proto::Keypair::generate().expect("keygen"),
        server_trust: roam_proto::ServerTrust::Pinned(server_key),
        session: cli::session_config(),
    };
    let mut s = roam_proto::Session::client(cfg);
    let now = std::time::Instant::now();
    let tid = s.connect(now, None).expect("connect");
    let mut out = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let now = std::time::Instant::now();
        while s.poll_transmit(now, &mut out).is_some() {
            sock.write_all(&out).await.expect("write");
            out.clear();
        }
        while let Some(ev) = s.poll_event() {
            if let roam_proto::Event::Connected { session_id, .. } = ev {
                // Flush what the handshake still has to say.
                while s.poll_transmit(now, &mut out).is_some() {
                    sock.write_all(&out).await.expect("write");
                    out.clear();
                }
                return session_id;
            }
        }
        let n = sock.read(&mut buf).await.expect("read");
        assert!(n > 0, "server closed during the handshake");
        s.handle_input(now, tid, &buf[..n])
            .expect("handshake input");
    }
}

/// A minimal service for counting tests: it stores one attribute and
/// suspends as soon as roam asks.
pub fn idle_service() -> Service {
    Service::new("idle")
        .version("1")
        .routine("idle", |r| async move {
            idle_loop(r.session).await;
        })
}

/// Adopts into the idle service.
pub fn idle_on_session(host: &Host, handle: roam::SessionHandle) {
    let Ok(s) = host.adopt("idle", handle) else {
        return;
    };
    s.store("user", b"someone").ok();
    tokio::spawn(idle_loop(s));
}

async fn idle_loop(s: roam_continuation::ManagedSession) {
    s.freeze_requested().await;
    let _ = s
        .suspend(roam_continuation::Continuation::new("idle"))
        .await;
}

// Example binaries run as child processes (`bench_server`, `bench_client`).

/// How long a child process's expected line may take.
pub const PROC_LIMIT: Duration = Duration::from_secs(60);

/// Path of an example binary of this package, built if missing.
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> -> target/<profile>/examples/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join("examples").join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "-p", "roam-continuation", "--example", name]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building example {name} failed");
    }
    path
}

/// A child process (an example binary) whose stdout lines arrive on a
/// channel; killed on drop.
pub struct Proc {
    pub child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    pub name: String,
}

impl Proc {
    /// Runs example `bin` with `args`; `name` labels its output.
    pub fn spawn(bin: &str, name: &str, args: &[&str]) -> Self {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let mut child = Command::new(example(bin))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        let n = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("  [{n}] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            name: name.to_string(),
        }
    }

    /// Waits for a line starting with `prefix`; returns it. A line starting
    /// with `error` fails the test.
    pub fn expect(&self, prefix: &str) -> String {
        let deadline = std::time::Instant::now() + PROC_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(l) if l.starts_with("error") => panic!("{}: {l}", self.name),
                Ok(_) => {}
                Err(_) => panic!("{}: no line {prefix:?} within {PROC_LIMIT:?}", self.name),
            }
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A free TCP port on 127.0.0.1, as `addr:port` ([`roam_sim::ports`]).
pub fn free_port() -> String {
    let port = roam_sim::ports::free_loopback_port().expect("a free port");
    format!("127.0.0.1:{port}")
}

/// A new keypair, its private key written to `path` in hex (mode 0600).
pub fn write_key(path: &Path) -> roam_proto::Keypair {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let kp = roam_proto::Keypair::generate().expect("keygen");
    let hex: String = kp
        .private_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .expect("key file");
    writeln!(f, "{hex}").expect("write key");
    kp
}

/// The coordinator's side of starting a service set's processes (the
/// service-set tests): accepts one control connection per member of
/// `roles` on `listener` (each within 10 s), handing each its part of
/// `parts` when the set restarts from a cut, and returns them in `roles`'
/// order. `sabotage` kills that child (SIGKILL) once every member has
/// joined. Then waits until every member is ready, failing at once if a
/// child exits first (its peers would wait on its sockets).
pub async fn join_members(
    listener: &tokio::net::UnixListener,
    roles: &[&str],
    parts: Option<&[Vec<u8>]>,
    children: &mut [tokio::process::Child],
    sabotage: Option<usize>,
) -> std::io::Result<Vec<roam_continuation::service_set::Control>> {
    use roam_continuation::service_set::Control;
    let mut controls = Vec::new();
    for _ in roles {
        let (socket, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .map_err(|_| std::io::Error::other("a member never joined"))??;
        let control = Control::accept(socket, |role| {
            let i = roles.iter().position(|r| *r == role)?;
            parts.map(|p| p[i].clone())
        })
        .await?;
        controls.push(control);
    }
    controls.sort_by_key(|c| roles.iter().position(|r| *r == c.role));
    if let Some(i) = sabotage {
        children[i].start_kill()?;
        children[i].wait().await?;
    }
    let ready = async {
        for c in &mut controls {
            c.ready().await?;
        }
        Ok::<(), std::io::Error>(())
    };
    let exited = async {
        loop {
            for (child, role) in children.iter_mut().zip(roles) {
                if let Some(status) = child.try_wait()? {
                    return Err::<(), _>(std::io::Error::other(format!(
                        "member {role} exited before it was ready: {status}"
                    )));
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        r = ready => r?,
        r = exited => r?,
    }
    Ok(controls)
}
