//! Relay takeover (`roam serve --takeover`): a running relay hands its
//! listener, sessions and target connections to a new process, again and
//! again, while sessions move data both ways; every byte is checked (a
//! counter pattern per direction, continuity checked on arrival, totals
//! compared at the end) and no target connection may be reset. And a new
//! process speaking another state format is refused while the old relay
//! keeps serving. Real `roam` processes, real sockets, all on 127.0.0.1;
//! every child is killed when its guard drops, even when a test fails.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{free_port, http_get, roam, sample, Guard, BIN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A `roam serve` process and its stderr lines.
struct Serve {
    child: Guard,
    lines: mpsc::Receiver<String>,
}

impl Serve {
    fn start(state: &Path, port: u16, target: u16, extra: &[&str]) -> Serve {
        Self::start_env(state, port, target, extra, &[])
    }

    /// [`Serve::start`] with more environment variables.
    fn start_env(
        state: &Path,
        port: u16,
        target: u16,
        extra: &[&str],
        env: &[(&str, &Path)],
    ) -> Serve {
        let mut cmd = roam(state);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--allow", &format!("127.0.0.1:{target}")])
            .args(extra);
        if std::env::var_os("TAKEOVER_DEBUG").is_some() {
            cmd.arg("-v");
        }
        let mut child = cmd
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if std::env::var_os("TAKEOVER_DEBUG").is_some() {
                    eprintln!("[{}] {line}", std::process::id());
                }
                let _ = tx.send(line);
            }
        });
        Serve {
            child: Guard(child),
            lines,
        }
    }

    /// Waits for a stderr line containing `needle`; `None` if the process
    /// ended (or `limit` passed) first. Lines before it are returned too.
    fn wait_for(&self, needle: &str, limit: Duration) -> Result<String, Vec<String>> {
        let end = Instant::now() + limit;
        let mut seen = Vec::new();
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return Ok(l),
                Ok(l) => seen.push(l),
                Err(_) => return Err(seen),
            }
        }
    }

    /// Waits (bounded) for the process to exit; its status.
    fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.0.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

/// Byte `i` of a direction's pattern (`salt` tells the directions apart).
fn pattern(i: u64, salt: u64) -> u8 {
    ((i.wrapping_mul(31).wrapping_add(salt) ^ (i >> 8)) % 251) as u8
}

const UP: u64 = 1;
const DOWN: u64 = 2;

/// What the target saw on one connection.
#[derive(Debug, Default)]
struct TargetReport {
    up_received: u64,
    down_sent: u64,
    error: Option<String>,
}

/// A target that checks the upward pattern and sends the downward one until
/// the client finishes; reports each connection.
async fn run_target(l: tokio::net::TcpListener, reports: Arc<Mutex<Vec<TargetReport>>>) {
    run_target_counting(l, reports, Arc::default()).await
}

/// [`run_target`], adding each checked upward byte to `up` as it arrives
/// (all connections together): a test can wait until data flows.
async fn run_target_counting(
    l: tokio::net::TcpListener,
    reports: Arc<Mutex<Vec<TargetReport>>>,
    up: Arc<AtomicU64>,
) {
    loop {
        let Ok((c, _)) = l.accept().await else { return };
        let (reports, up) = (reports.clone(), up.clone());
        tokio::spawn(async move {
            let (mut r, mut w) = c.into_split();
            let stop = Arc::new(AtomicBool::new(false));
            let sent = Arc::new(AtomicU64::new(0));
            let writer = {
                let (stop, sent) = (stop.clone(), sent.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    let mut err = None;
                    while !stop.load(Ordering::SeqCst) {
                        let chunk: Vec<u8> = (i..i + 4096).map(|k| pattern(k, DOWN)).collect();
                        if let Err(e) = w.write_all(&chunk).await {
                            err = Some(format!("target write: {e}"));
                            break;
                        }
                        i += 4096;
                        sent.store(i, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    let _ = w.shutdown().await;
                    err
                })
            };
            let mut got = 0u64;
            let mut buf = vec![0u8; 65536];
            let mut error = None;
            loop {
                match r.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        if let Some(k) = (0..n).find(|&k| buf[k] != pattern(got + k as u64, UP)) {
                            error = Some(format!("upward byte {} wrong", got + k as u64));
                            break;
                        }
                        got += n as u64;
                        up.fetch_add(n as u64, Ordering::SeqCst);
                    }
                    Err(e) => {
                        error = Some(format!("target read after {got} bytes: {e}"));
                        break;
                    }
                }
            }
            stop.store(true, Ordering::SeqCst);
            let werr = writer.await.unwrap_or(Some("writer panicked".into()));
            reports.lock().unwrap().push(TargetReport {
                up_received: got,
                down_sent: sent.load(Ordering::SeqCst),
                error: error.or(werr),
            });
        });
    }
}

/// What a client saw on its session's one stream.
#[derive(Debug)]
struct ClientReport {
    up_sent: u64,
    down_received: u64,
    /// Transports the client session used: 1 when it never had to resume.
    transports: u64,
}

/// One client session: writes the upward pattern until `stop`, then
/// finishes; reads and checks the downward pattern to its end.
async fn run_client(
    relay: String,
    server_key: roam::PublicKey,
    target: u16,
    stop: Arc<AtomicBool>,
) -> Result<ClientReport, String> {
    let mut config = roam::ClientConfig::new(roam_proto::ClientConfig {
        keypair: roam::Keypair::generate().unwrap(),
        server_trust: roam_proto::ServerTrust::Pinned(server_key),
        session: roam_proto::Config::default(),
    });
    config.watch_network = false;
    config.backoff_initial = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    let session = roam::connect(&relay, config)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let stream = session
        .open_stream(format!("127.0.0.1:{target}").as_bytes())
        .map_err(|e| format!("open: {e}"))?;
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let chunk: Vec<u8> = (i..i + 4096).map(|k| pattern(k, UP)).collect();
            w.write_all(&chunk)
                .await
                .map_err(|e| format!("client write after {i}: {e}"))?;
            i += 4096;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        w.shutdown()
            .await
            .map_err(|e| format!("client finish: {e}"))?;
        Ok::<u64, String>(i)
    });
    let mut got = 0u64;
    let mut buf = vec![0u8; 65536];
    loop {
        let n = r
            .read(&mut buf)
            .await
            .map_err(|e| format!("client read after {got}: {e}"))?;
        if n == 0 {
            break;
        }
        if let Some(k) = (0..n).find(|&k| buf[k] != pattern(got + k as u64, DOWN)) {
            return Err(format!("downward byte {} wrong", got + k as u64));
        }
        got += n as u64;
    }
    let up_sent = writer.await.map_err(|e| e.to_string())??;
    let transports = session.stats().transports;
    let _ = session.close(0, "done").await;
    Ok(ClientReport {
        up_sent,
        down_received: got,
        transports,
    })
}

/// Waits (at most `limit`) until `counter` is above `floor`; whether it got
/// there.
fn wait_above(counter: &AtomicU64, floor: u64, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while counter.load(Ordering::SeqCst) <= floor {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// The relay's public key from its start-up line.
fn server_key(line: &str) -> roam::PublicKey {
    let at = line.find("server key ").expect("key in start-up line") + "server key ".len();
    let hex: String = line[at..]
        .chars()
        .take_while(|c| c.is_ascii_hexdigit())
        .collect();
    hex.parse().expect("server key parses")
}

/// A checking target, a relay in its own state directory, and the relay's
/// key: what every test here starts from.
struct Fixture {
    dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
    reports: Arc<Mutex<Vec<TargetReport>>>,
    target: u16,
    port: u16,
    key: roam::PublicKey,
}

impl Fixture {
    /// Starts the target and the first relay (returned beside it).
    fn start() -> (Fixture, Serve) {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let reports = Arc::new(Mutex::new(Vec::new()));
        let target = {
            let l = rt
                .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
                .unwrap();
            let port = l.local_addr().unwrap().port();
            rt.spawn(run_target(l, reports.clone()));
            port
        };
        let port = free_port();
        let relay = Serve::start(dir.path(), port, target, &[]);
        let key = server_key(
            &relay
                .wait_for("listening on", Duration::from_secs(20))
                .expect("relay starts"),
        );
        let f = Fixture {
            dir,
            rt,
            reports,
            target,
            port,
            key,
        };
        (f, relay)
    }

    /// `n` clients moving data both ways until `stop`.
    fn clients(
        &self,
        n: usize,
        stop: &Arc<AtomicBool>,
    ) -> Vec<tokio::task::JoinHandle<Result<ClientReport, String>>> {
        (0..n)
            .map(|_| {
                self.rt.spawn(run_client(
                    format!("127.0.0.1:{}", self.port),
                    self.key,
                    self.target,
                    stop.clone(),
                ))
            })
            .collect()
    }

    /// Waits (each at most `limit`) for the clients' results.
    fn results(
        &self,
        clients: Vec<tokio::task::JoinHandle<Result<ClientReport, String>>>,
        limit: Duration,
    ) -> Vec<Result<ClientReport, String>> {
        self.rt.block_on(async {
            let mut out = Vec::new();
            for c in clients {
                out.push(
                    tokio::time::timeout(limit, c)
                        .await
                        .map_err(|_| format!("client did not finish in {limit:?}"))
                        .and_then(|r| r.map_err(|e| e.to_string()))
                        .and_then(|r| r),
                );
            }
            out
        })
    }

    /// Every client succeeded, each had exactly one target connection that
    /// saw no error, and every byte written either way arrived once.
    fn check(&self, results: &[Result<ClientReport, String>]) {
        let sessions = results.len();
        // The target's reports arrive after each connection's end.
        let end = Instant::now() + Duration::from_secs(10);
        while self.reports.lock().unwrap().len() < sessions && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        let reports = std::mem::take(&mut *self.reports.lock().unwrap());
        let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert!(failed.is_empty(), "clients failed: {failed:?}");
        let bad: Vec<_> = reports.iter().filter(|r| r.error.is_some()).collect();
        assert!(bad.is_empty(), "target connections failed: {bad:?}");
        assert_eq!(
            reports.len(),
            sessions,
            "one target connection per session, never redialed"
        );
        let mut up: Vec<u64> = results
            .iter()
            .map(|r| r.as_ref().unwrap().up_sent)
            .collect();
        let mut up_got: Vec<u64> = reports.iter().map(|r| r.up_received).collect();
        let mut down: Vec<u64> = reports.iter().map(|r| r.down_sent).collect();
        let mut down_got: Vec<u64> = results
            .iter()
            .map(|r| r.as_ref().unwrap().down_received)
            .collect();
        for v in [&mut up, &mut up_got, &mut down, &mut down_got] {
            v.sort_unstable();
        }
        assert_eq!(up, up_got, "every byte written upward arrived once");
        assert_eq!(down, down_got, "every byte written downward arrived once");
        assert!(
            up.iter().all(|&n| n > 0) && down.iter().all(|&n| n > 0),
            "every session moved data both ways"
        );
    }
}

/// Upgrades the relay `rounds` times under load on `sessions` sessions.
/// The client connections move with the sessions (PROTOCOL §13.6): no client ever
/// dials again.
fn upgrade_under_load(sessions: usize, rounds: usize) {
    let (f, mut relay) = Fixture::start();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = f.clients(sessions, &stop);
    std::thread::sleep(Duration::from_millis(500));
    for round in 0..rounds {
        let next = Serve::start(f.dir.path(), f.port, f.target, &["--takeover"]);
        let took = next.wait_for("took over", Duration::from_secs(30));
        assert!(took.is_ok(), "round {round}: no takeover: {took:?}");
        let handed = relay.wait_for("handed", Duration::from_secs(30));
        assert!(handed.is_ok(), "round {round}: old relay: {handed:?}");
        let status = relay.wait_exit(Duration::from_secs(20));
        assert!(
            status.is_some_and(|s| s.success()),
            "round {round}: the old relay did not exit cleanly: {status:?}"
        );
        relay = next;
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, Ordering::SeqCst);
    let results = f.results(clients, Duration::from_secs(60));
    f.check(&results);
    let redialed: Vec<u64> = results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|r| r.transports)
        .filter(|&t| t != 1)
        .collect();
    assert!(
        redialed.is_empty(),
        "{} of {sessions} clients dialed again (transports used: {redialed:?}): their connections did not move with the relay",
        redialed.len()
    );
    f.rt.shutdown_timeout(Duration::from_secs(1));
}

/// 100 sessions, 20 upgrades in a row (issue 11, item 7).
#[test]
fn relay_upgrades_twenty_times_under_load_without_losing_a_byte() {
    upgrade_under_load(100, 20);
}

/// The new relay's metrics (the metrics listener moves with the relay)
/// count the sessions it took over with their client connections, and how
/// long each was stopped.
#[test]
fn the_new_relay_counts_the_handoffs_in_its_metrics() {
    let (f, mut relay) = Fixture::start();
    // A relay of its own, with metrics: the fixture's has none.
    drop(relay);
    let metrics = format!("127.0.0.1:{}", free_port());
    let state = f.dir.path().join("m");
    std::fs::create_dir_all(&state).unwrap();
    let port = free_port();
    relay = Serve::start(&state, port, f.target, &["--metrics", &metrics]);
    let key = server_key(
        &relay
            .wait_for("listening on", Duration::from_secs(20))
            .expect("relay starts"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..10)
        .map(|_| {
            f.rt.spawn(run_client(
                format!("127.0.0.1:{port}"),
                key,
                f.target,
                stop.clone(),
            ))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let next = Serve::start(
        &state,
        port,
        f.target,
        &["--takeover", "--metrics", &metrics],
    );
    assert!(next.wait_for("took over", Duration::from_secs(30)).is_ok());
    assert!(relay
        .wait_exit(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
    let report = next.wait_for("each was stopped for", Duration::from_secs(10));
    assert!(report.is_ok(), "{report:?}");
    let (status, text) = http_get(&metrics, "/metrics");
    assert!(status.contains("200"), "{status}");
    assert_eq!(
        sample(
            &text,
            r#"roam_handoffs_total{direction="in",connection="moved"}"#
        ),
        Some(10),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"roam_handoffs_total{direction="in",connection="resume"}"#
        ),
        Some(0)
    );
    assert_eq!(
        sample(&text, "roam_handoff_stop_seconds_count"),
        Some(10),
        "{text}"
    );
    stop.store(true, Ordering::SeqCst);
    let results = f.results(clients, Duration::from_secs(60));
    f.check(&results);
    assert!(results.iter().all(|r| r.as_ref().unwrap().transports == 1));
    drop(next);
    f.rt.shutdown_timeout(Duration::from_secs(1));
}

/// A new process that reads another state format is refused with an error
/// naming both formats; the running relay keeps its sessions and serves on.
#[test]
fn takeover_with_another_state_format_is_refused_and_the_relay_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reports = Arc::new(Mutex::new(Vec::new()));
    let target = {
        let l = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = l.local_addr().unwrap().port();
        rt.spawn(run_target(l, reports.clone()));
        port
    };
    let port = free_port();
    let mut relay = Serve::start(dir.path(), port, target, &[]);
    let key = server_key(
        &relay
            .wait_for("listening on", Duration::from_secs(20))
            .expect("relay starts"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let client = rt.spawn(run_client(
        format!("127.0.0.1:{port}"),
        key,
        target,
        stop.clone(),
    ));
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new(BIN)
        .env("ROAM_STATE_DIR", dir.path())
        .env("HOME", dir.path())
        .args(["serve", "--takeover", "--takeover-format", "99"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused takeover must fail: {err}");
    assert!(
        err.contains("state format mismatch")
            && err.contains("99")
            && err.contains("keeps serving"),
        "error names the formats: {err}"
    );
    assert!(
        relay.wait_exit(Duration::from_millis(300)).is_none(),
        "the old relay keeps running"
    );
    // The session keeps moving data, and new sessions are accepted.
    std::thread::sleep(Duration::from_millis(300));
    let second = rt.spawn(run_client(
        format!("127.0.0.1:{port}"),
        key,
        target,
        stop.clone(),
    ));
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    for c in [client, second] {
        let r = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(30), c).await })
            .expect("client finishes")
            .unwrap()
            .expect("client ok");
        assert!(r.up_sent > 0 && r.down_received > 0, "{r:?}");
    }
    rt.shutdown_timeout(Duration::from_secs(1));
}

/// Kills a process by pid when dropped (a successor the relay started).
struct PidGuard(u32);

impl Drop for PidGuard {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-9", &self.0.to_string()])
            .status();
    }
}

/// SIGUSR2 makes the running relay start its own successor
/// (`roam serve --takeover` from its executable), which takes everything
/// over; the session goes on, every byte checked.
#[test]
fn sigusr2_starts_a_successor_that_takes_over() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reports = Arc::new(Mutex::new(Vec::new()));
    let up = Arc::new(AtomicU64::new(0));
    let target = {
        let l = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = l.local_addr().unwrap().port();
        rt.spawn(run_target_counting(l, reports.clone(), up.clone()));
        port
    };
    let port = free_port();
    let mut relay = Serve::start(dir.path(), port, target, &[]);
    let key = server_key(
        &relay
            .wait_for("listening on", Duration::from_secs(20))
            .expect("relay starts"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let client = rt.spawn(run_client(
        format!("127.0.0.1:{port}"),
        key,
        target,
        stop.clone(),
    ));
    // The session is the relay's, its stream connected to the target, once
    // upward bytes arrive there.
    assert!(
        wait_above(&up, 0, Duration::from_secs(20)),
        "the session's bytes never reached the target"
    );
    let pid = relay.child.0.id();
    assert!(Command::new("kill")
        .args(["-USR2", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    // The successor inherits the relay's stderr.
    let started = relay
        .wait_for("--takeover (pid ", Duration::from_secs(20))
        .expect("successor started");
    let successor: u32 = started
        .rsplit("(pid ")
        .next()
        .and_then(|s| s.trim_end_matches(')').parse().ok())
        .expect("successor pid");
    let _successor = PidGuard(successor);
    let took = relay.wait_for("took over 1 sessions", Duration::from_secs(20));
    assert!(took.is_ok(), "successor took over: {took:?}");
    let status = relay.wait_exit(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "old relay: {status:?}");
    // The session goes on through the successor alone.
    let at_exit = up.load(Ordering::SeqCst);
    assert!(
        wait_above(&up, at_exit, Duration::from_secs(20)),
        "no byte moved after the old relay exited"
    );
    stop.store(true, Ordering::SeqCst);
    let r = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), client).await })
        .expect("client finishes")
        .unwrap()
        .expect("client ok");
    let end = Instant::now() + Duration::from_secs(10);
    while reports.lock().unwrap().is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let reports = reports.lock().unwrap();
    assert_eq!(reports.len(), 1, "one target connection, never redialed");
    assert!(reports[0].error.is_none(), "{:?}", reports[0]);
    assert_eq!(reports[0].up_received, r.up_sent);
    assert_eq!(reports[0].down_sent, r.down_received);
    assert!(r.up_sent > 0 && r.down_received > 0);
    rt.shutdown_timeout(Duration::from_secs(1));
}

/// SIGUSR2 sent the moment the relay says it listens (a reload right after
/// start-up) starts a successor too: the handler is in place before the
/// relay announces itself, where SIGUSR2's default action used to end it.
#[test]
fn sigusr2_right_after_start_up_is_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (port, target) = (free_port(), free_port());
    let mut relay = Serve::start(dir.path(), port, target, &[]);
    relay
        .wait_for("listening on", Duration::from_secs(20))
        .expect("relay starts");
    relay.child.signal("USR2");
    let started = relay.wait_for("--takeover (pid ", Duration::from_secs(20));
    let successor: u32 = started
        .as_ref()
        .ok()
        .and_then(|l| l.rsplit("(pid ").next())
        .and_then(|s| s.trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| {
            let status = relay.wait_exit(Duration::from_secs(1));
            panic!("no successor: {started:?}, relay {status:?}")
        });
    let _successor = PidGuard(successor);
    let took = relay.wait_for("took over 0 sessions", Duration::from_secs(20));
    assert!(took.is_ok(), "successor took over: {took:?}");
    let status = relay.wait_exit(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "old relay: {status:?}");
}

/// Under systemd (`Type=notify`, `NotifyAccess=all`): the relay says
/// `READY=1` once it listens; on a takeover the old one says `RELOADING=1`,
/// and the new one names itself the main process and says `READY=1`. The
/// notification socket is a datagram socket this test binds, as systemd's.
#[test]
fn systemd_notifications_follow_the_takeover() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let recv = || {
        let mut buf = [0u8; 4096];
        let n = notify.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let env = [("NOTIFY_SOCKET", notify_path.as_path())];
    let port = free_port();
    let target = free_port();
    let relay = Serve::start_env(dir.path(), port, target, &[], &env);
    let first = recv();
    assert!(first.lines().any(|l| l == "READY=1"), "{first:?}");
    let next = Serve::start_env(dir.path(), port, target, &["--takeover"], &env);
    let successor = next.child.0.id();
    let mut seen = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        let m = recv();
        seen.push(m.clone());
        if m.lines().any(|l| l == "READY=1") {
            break;
        }
    }
    let all = seen.join("|");
    assert!(all.contains("RELOADING=1"), "old relay reloading: {seen:?}");
    let mainpid = format!("MAINPID={successor}");
    let at_main = seen.iter().position(|m| m.lines().any(|l| l == mainpid));
    let at_ready = seen.iter().position(|m| m.lines().any(|l| l == "READY=1"));
    assert!(
        at_main.is_some() && at_ready.is_some() && at_main <= at_ready,
        "successor names itself main, then ready: {seen:?}"
    );
    drop(relay);
}

/// A successor that dies part-way through the handover (here: this test,
/// playing one, reads the start of it and hangs up without its receipt):
/// the old relay puts every session back and serves on; the sessions resume
/// on it with every byte, and their target connections are the same ones.
#[test]
fn a_successor_that_dies_mid_handover_leaves_the_old_relay_serving() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reports = Arc::new(Mutex::new(Vec::new()));
    let target = {
        let l = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = l.local_addr().unwrap().port();
        rt.spawn(run_target(l, reports.clone()));
        port
    };
    let port = free_port();
    let mut relay = Serve::start(dir.path(), port, target, &[]);
    let key = server_key(
        &relay
            .wait_for("listening on", Duration::from_secs(20))
            .expect("relay starts"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..5)
        .map(|_| {
            rt.spawn(run_client(
                format!("127.0.0.1:{port}"),
                key,
                target,
                stop.clone(),
            ))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // The fake successor: hello with the right format (the relay's
    // STATE_FORMAT, 3 since client connections move too), then read part
    // of the handover and hang up.
    let mut sock =
        std::os::unix::net::UnixStream::connect(dir.path().join("serve.takeover")).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let hello = br#"{"magic":"roam-takeover","format":3,"version":"test"}"#;
    sock.write_all(&(hello.len() as u32).to_le_bytes()).unwrap();
    sock.write_all(hello).unwrap();
    let mut len = [0u8; 4];
    sock.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
    sock.read_exact(&mut answer).unwrap();
    assert!(
        String::from_utf8_lossy(&answer).contains("\"ok\":true"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let mut some = [0u8; 64];
    sock.read_exact(&mut some).unwrap();
    drop(sock);
    let failed = relay.wait_for("serving on", Duration::from_secs(40));
    assert!(failed.is_ok(), "old relay noticed: {failed:?}");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        relay.wait_exit(Duration::from_millis(100)).is_none(),
        "the old relay keeps running"
    );
    stop.store(true, Ordering::SeqCst);
    let results: Vec<_> = clients
        .into_iter()
        .map(|c| {
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), c).await })
                .expect("client finishes")
                .unwrap()
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(10);
    while reports.lock().unwrap().len() < 5 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let reports = std::mem::take(&mut *reports.lock().unwrap());
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "clients failed: {failed:?}");
    assert_eq!(reports.len(), 5, "one target connection per session");
    assert!(reports.iter().all(|r| r.error.is_none()), "{reports:?}");
    let mut up: Vec<u64> = results
        .iter()
        .map(|r| r.as_ref().unwrap().up_sent)
        .collect();
    let mut up_got: Vec<u64> = reports.iter().map(|r| r.up_received).collect();
    let mut down: Vec<u64> = reports.iter().map(|r| r.down_sent).collect();
    let mut down_got: Vec<u64> = results
        .iter()
        .map(|r| r.as_ref().unwrap().down_received)
        .collect();
    for v in [&mut up, &mut up_got, &mut down, &mut down_got] {
        v.sort_unstable();
    }
    assert_eq!(up, up_got);
    assert_eq!(down, down_got);
    // The old relay took its sessions back on their connections.
    let transports: Vec<u64> = results
        .iter()
        .map(|r| r.as_ref().unwrap().transports)
        .collect();
    assert_eq!(transports, [1; 5], "no client dialed again");
    rt.shutdown_timeout(Duration::from_secs(1));
}
