//! Test support: a real etcd on a temp data dir and free loopback ports.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let etcd = roam_etcd::testing::EtcdServer::start().await?;
//! let client = roam_etcd::Client::connect(&[etcd.url()]).await.unwrap();
//! client.put(b"k", b"v", 0).await.unwrap();
//! # Ok(()) }
//! ```

use std::fs::File;
use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tempfile::TempDir;

use crate::Client;

/// The binary used unless `$ROAM_ETCD_BIN` names another.
const DEFAULT_BIN: &str = "/usr/bin/etcd";
/// How long one start may take to answer.
const START_DEADLINE: Duration = Duration::from_secs(20);
/// Starts retried with fresh ports when etcd could not bind its ports.
const PORT_ATTEMPTS: usize = 5;
/// Log lines quoted in a start error.
const TAIL_LINES: usize = 25;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A running etcd: a child process with its data in a temp dir. It is killed
/// on [`EtcdServer::kill`] or on drop, and its directory removed on drop.
/// etcd's log goes to `etcd.log` in that directory.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    url: String,
    name: String,
    /// Held for its drop, which removes the data dir and log.
    _dir: TempDir,
}

enum StartError {
    /// etcd exited because a port was taken: worth a try with other ports.
    PortTaken(String),
    /// Anything else.
    Fatal(io::Error),
}

impl EtcdServer {
    /// Starts `/usr/bin/etcd` (or `$ROAM_ETCD_BIN`) with `--data-dir` in a
    /// fresh temp dir, `--listen-client-urls`/`--advertise-client-urls`
    /// `http://127.0.0.1:<free port>`, `--listen-peer-urls`
    /// `http://127.0.0.1:<free port>`, `--initial-advertise-peer-urls`/
    /// `--initial-cluster` matching, and a unique `--name`; waits (bounded,
    /// at most 20 s) until it answers. Otherwise an error with a precise
    /// message (e.g. "etcd not installed: apt-get install etcd-server", or
    /// etcd's exit status and the last lines of its log). Free ports may be
    /// taken by another process before etcd binds them: if etcd exits with
    /// "address already in use", it is started again on new ports (5 tries).
    ///
    /// "Answers" means the client port lists this very etcd (by its unique
    /// name) as a member, so another process that grabbed the port is not
    /// taken for it.
    pub async fn start() -> io::Result<EtcdServer> {
        let bin = std::env::var_os("ROAM_ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN));
        if !bin.exists() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "etcd not installed: apt-get install etcd-server ({} does not exist; \
                     $ROAM_ETCD_BIN may name another binary)",
                    bin.display()
                ),
            ));
        }
        let mut tries = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            match Self::start_once(&bin).await {
                Ok(server) => return Ok(server),
                Err(StartError::PortTaken(msg)) => tries.push(msg),
                Err(StartError::Fatal(e)) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "etcd could not bind its ports in {PORT_ATTEMPTS} tries: {}",
                tries.join(" | ")
            ),
        ))
    }

    async fn start_once(bin: &Path) -> Result<EtcdServer, StartError> {
        let fatal = StartError::Fatal;
        let dir = tempfile::Builder::new()
            .prefix("roam-etcd-")
            .tempdir()
            .map_err(|e| fatal(with_context(e, "creating etcd's temp dir")))?;
        let (client_port, peer_port) =
            free_ports().map_err(|e| fatal(with_context(e, "finding free ports")))?;
        let name = format!(
            "roam-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let url = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log_path = dir.path().join("etcd.log");
        let log = File::create(&log_path)
            .map_err(|e| fatal(with_context(e, "creating etcd's log file")))?;
        let log2 = log
            .try_clone()
            .map_err(|e| fatal(with_context(e, "creating etcd's log file")))?;
        let mut cmd = Command::new(bin);
        cmd.arg("--name")
            .arg(&name)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(&url)
            .arg("--advertise-client-urls")
            .arg(&url)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("{name}={peer}"))
            .arg("--initial-cluster-state")
            .arg("new")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        if cfg!(target_arch = "aarch64") {
            cmd.env("ETCD_UNSUPPORTED_ARCH", "arm64");
        }
        let child = cmd.spawn().map_err(|e| {
            fatal(if e.kind() == io::ErrorKind::NotFound {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "etcd not installed: apt-get install etcd-server ({}: {e})",
                        bin.display()
                    ),
                )
            } else {
                with_context(e, &format!("starting {}", bin.display()))
            })
        })?;
        // From here on, drop kills it.
        let mut server = EtcdServer {
            child: Some(child),
            url,
            name,
            _dir: dir,
        };
        let started = Instant::now();
        loop {
            if let Some(child) = server.child.as_mut() {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        let tail = log_tail(&log_path);
                        let msg = format!(
                            "etcd ({}) exited at start with {status}; last lines of its log:\n{tail}",
                            server.url
                        );
                        return Err(if tail.contains("address already in use") {
                            StartError::PortTaken(msg)
                        } else {
                            fatal(io::Error::other(msg))
                        });
                    }
                    Ok(None) => {}
                    Err(e) => return Err(fatal(with_context(e, "waiting for etcd"))),
                }
            }
            if server.answers().await {
                return Ok(server);
            }
            if started.elapsed() > START_DEADLINE {
                server.kill();
                return Err(fatal(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "etcd ({}) did not answer within {START_DEADLINE:?}; last lines of its log:\n{}",
                        server.url,
                        log_tail(&log_path)
                    ),
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the client port answers as this etcd (member list holds our name).
    async fn answers(&self) -> bool {
        let Ok(client) =
            Client::connect_within(std::slice::from_ref(&self.url), Duration::from_secs(1)).await
        else {
            return false;
        };
        let Ok(m) = client
            .call("member_list", "/v3/cluster/member/list", json!({}))
            .await
        else {
            return false;
        };
        m.get("members")
            .and_then(|v| v.as_array())
            .is_some_and(|members| {
                members
                    .iter()
                    .any(|member| member.get("name").and_then(|n| n.as_str()) == Some(&self.name))
            })
    }

    /// The client URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// SIGKILLs it (also on Drop) and waits; the temp dir goes on Drop.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        // Killed first; `_dir` (a TempDir) then removes itself.
        self.kill();
    }
}

fn with_context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Two distinct free loopback ports (both held at once while probing, so
/// they differ). Another process may take them before etcd binds: the caller
/// retries on "address already in use".
fn free_ports() -> io::Result<(u16, u16)> {
    let a = TcpListener::bind("127.0.0.1:0")?;
    let b = TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// The last lines of etcd's log, for error messages.
fn log_tail(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
        }
        Err(e) => format!("(log {} unreadable: {e})", path.display()),
    }
}
