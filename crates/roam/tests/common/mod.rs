//! Shared helpers for roam's loopback tests: configs, a byte pattern that
//! exposes loss, duplication and reordering, a server that checks and echoes
//! patterns, and a killable TCP proxy.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use roam_proto::{Keypair, ServerTrust};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};

/// Byte `i` of the pattern with `seed`: depends on the absolute offset, so any
/// lost, repeated or reordered chunk changes what the reader sees.
pub fn pattern_byte(seed: u64, i: u64) -> u8 {
    (i.wrapping_add(seed << 40)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> 56) as u8
}

pub fn fill_pattern(seed: u64, offset: u64, buf: &mut [u8]) {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(seed, offset + k as u64);
    }
}

/// Writes `len` pattern bytes, then finishes the stream.
pub async fn write_pattern<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    seed: u64,
    len: u64,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 32 * 1024];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        fill_pattern(seed, off, &mut buf[..n]);
        w.write_all(&buf[..n]).await?;
        off += n as u64;
    }
    w.shutdown().await
}

/// Reads to end-of-stream checking every byte; returns how many were read.
pub async fn read_pattern<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    seed: u64,
) -> Result<u64, String> {
    let mut buf = vec![0u8; 32 * 1024];
    let mut off = 0u64;
    loop {
        let n = r
            .read(&mut buf)
            .await
            .map_err(|e| format!("read at {off}: {e}"))?;
        if n == 0 {
            return Ok(off);
        }
        for (k, b) in buf[..n].iter().enumerate() {
            let want = pattern_byte(seed, off + k as u64);
            if *b != want {
                return Err(format!(
                    "byte {} is {b:#x}, expected {want:#x}",
                    off + k as u64
                ));
            }
        }
        off += n as u64;
    }
}

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_logging() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

pub fn fast_session() -> roam_proto::Config {
    roam_proto::Config {
        heartbeat_interval: Duration::from_millis(500),
        // Generous: debug builds on a loaded 2-core machine can stall for a
        // second or two. Tests cut connections explicitly instead.
        suspend_after: Duration::from_secs(5),
        // Short, so that tests of a server that lost a session end quickly.
        refusal_grace: Duration::from_secs(2),
        ..Default::default()
    }
}

pub fn client_config(server_key: Option<roam_proto::PublicKey>) -> roam::ClientConfig {
    let mut c = roam::ClientConfig::new(roam_proto::ClientConfig {
        keypair: Keypair::generate().unwrap(),
        server_trust: server_key.map_or(ServerTrust::FirstUse, ServerTrust::Pinned),
        session: fast_session(),
    });
    c.watch_network = false;
    c
}

pub fn server_config(keypair: Keypair) -> roam::ServerConfig {
    roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: None,
        addresses: Vec::new(),
        session: fast_session(),
    })
}

/// Result of one server-side stream: metadata, bytes checked, or the error.
pub type StreamReport = Result<(Vec<u8>, u64), String>;

/// A running test server. Each stream's metadata is `"seed len"`: the server
/// checks the pattern it receives with that seed and sends `len` bytes of the
/// pattern with `seed + 1000` back.
pub struct TestServer {
    pub addr: SocketAddr,
    pub key: roam_proto::PublicKey,
    pub reports: mpsc::UnboundedReceiver<StreamReport>,
    pub sessions: mpsc::UnboundedReceiver<roam::SessionHandle>,
    stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    pub async fn start_on(addr: SocketAddr) -> Self {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        Self::start_listening(listener.into(), addr)
    }

    /// The server on a Unix-domain socket at `path` (`addr` is then
    /// `roam::UNIX_PEER`; clients connect to `unix:PATH`).
    pub fn start_unix(path: &std::path::Path) -> Self {
        let listener = tokio::net::UnixListener::bind(path).unwrap();
        Self::start_listening(listener.into(), roam::UNIX_PEER)
    }

    pub fn start_listening(listener: roam::Listener, addr: SocketAddr) -> Self {
        init_logging();
        let kp = Keypair::generate().unwrap();
        let key = kp.public();
        let (rtx, reports) = mpsc::unbounded_channel();
        let (stx, sessions) = mpsc::unbounded_channel();
        let (stop, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(roam::serve(
            listener,
            server_config(kp),
            async move {
                let _ = stop_rx.await;
            },
            move |session: roam::SessionHandle| {
                let rtx = rtx.clone();
                let _ = stx.send(session.clone());
                tokio::spawn(async move {
                    while let Ok((stream, meta)) = session.accept_stream().await {
                        let rtx = rtx.clone();
                        tokio::spawn(async move {
                            let text = String::from_utf8_lossy(&meta).to_string();
                            let mut it = text.split(' ').map(|x| x.parse::<u64>().unwrap_or(0));
                            let (seed, len) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
                            let (mut r, mut w) = tokio::io::split(stream);
                            let writer = tokio::spawn(async move {
                                write_pattern(&mut w, seed + 1000, len).await
                            });
                            let got = read_pattern(&mut r, seed).await;
                            let wrote = writer
                                .await
                                .map_err(|e| e.to_string())
                                .and_then(|r| r.map_err(|e| e.to_string()));
                            let _ = rtx.send(got.and_then(|n| wrote.map(|_| (meta, n))));
                        });
                    }
                });
            },
        ));
        Self {
            addr,
            key,
            reports,
            sessions,
            stop: Some(stop),
            task,
        }
    }

    pub fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// A loopback TCP proxy whose current connections can be cut at will, and
/// which can refuse new ones for a while (link down).
pub struct Proxy {
    pub addr: SocketAddr,
    kill: watch::Sender<u64>,
    up: watch::Sender<bool>,
    upstream: watch::Sender<SocketAddr>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (kill, kill_rx) = watch::channel(0u64);
        let (up, up_rx) = watch::channel(true);
        let (upstream_tx, upstream_rx) = watch::channel(upstream);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if !*up_rx.borrow() {
                    drop(client); // link down: the connection dies at once
                    continue;
                }
                let mut kill_rx = kill_rx.clone();
                kill_rx.mark_unchanged();
                let upstream = *upstream_rx.borrow();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut c, mut s) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut c, &mut s) => {}
                        _ = kill_rx.changed() => {
                            // Abort: RST towards both ends, as a dying link would leave them.
                            let _ = socket2::SockRef::from(&c).set_linger(Some(Duration::ZERO));
                            let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                        }
                    }
                });
            }
        });
        Self {
            addr,
            kill,
            up,
            upstream: upstream_tx,
            task,
        }
    }

    /// Cuts every connection now open.
    pub fn kill(&self) {
        self.kill.send_modify(|n| *n += 1);
    }

    /// Sends new connections to another server.
    pub fn redirect(&self, upstream: SocketAddr) {
        let _ = self.upstream.send(upstream);
    }

    /// Link down (`false`: new connections are dropped) or up.
    pub fn set_up(&self, up: bool) {
        let _ = self.up.send(up);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.kill();
    }
}

pub type SharedHandle = Arc<roam::SessionHandle>;

/// Opens `streams` streams of `len` bytes each way and checks everything.
pub async fn run_transfer(
    session: &roam::SessionHandle,
    streams: u64,
    len: u64,
) -> Vec<tokio::task::JoinHandle<Result<u64, String>>> {
    let mut tasks = Vec::new();
    for seed in 1..=streams {
        let stream = session
            .open_stream(format!("{seed} {len}").as_bytes())
            .unwrap();
        tasks.push(tokio::spawn(async move {
            let (mut r, mut w) = tokio::io::split(stream);
            let writer = tokio::spawn(async move { write_pattern(&mut w, seed, len).await });
            let got = read_pattern(&mut r, seed + 1000).await?;
            writer
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            Ok(got)
        }));
    }
    tasks
}

/// Takes `streams` reports from `server`, each of a stream whose `len` bytes
/// all arrived checked.
pub async fn check_server_reports(server: &mut TestServer, streams: u64, len: u64) {
    for _ in 0..streams {
        let report = tokio::time::timeout(Duration::from_secs(30), server.reports.recv())
            .await
            .expect("server report")
            .unwrap();
        let (meta, n) = report.expect("server side check");
        assert_eq!(
            n,
            len,
            "server received all bytes of {:?}",
            String::from_utf8_lossy(&meta)
        );
    }
}
