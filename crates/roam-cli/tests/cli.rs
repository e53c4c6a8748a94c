//! End-to-end tests of the `roam` binary: relay + pipe moving data with a
//! SHA-256 check, refusal of a disallowed target, `status --json`, the direct
//! fallback, and `demo`. Every child process is killed when its guard drops,
//! even when a test fails. All traffic stays on 127.0.0.1.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{free_port, http_get, roam, sample, slow_reader, status_json, Guard, BIN};
use sha2::{Digest, Sha256};

/// A target that hashes everything it receives and answers `"<sha256> <len>\n"`.
fn start_sink() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            std::thread::spawn(move || {
                let mut h = Sha256::new();
                let mut n = 0u64;
                let mut buf = [0u8; 65536];
                loop {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => {
                            h.update(&buf[..k]);
                            n += k as u64;
                        }
                    }
                }
                let _ = writeln!(c, "{} {n}", hex(&h.finalize()));
            });
        }
    });
    port
}

/// A target that holds connections open and echoes.
fn start_echo() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { return };
            std::thread::spawn(move || {
                let mut w = c.try_clone().unwrap();
                let _ = std::io::copy(&mut c, &mut w);
            });
        }
    });
    port
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A running relay; its stderr lines are collected.
struct Relay {
    _child: Guard,
    port: u16,
    lines: mpsc::Receiver<String>,
}

impl Relay {
    fn start(state: &Path, allow: &[String]) -> Relay {
        Self::start_with(state, allow, &[])
    }

    /// [`Relay::start`] with more flags.
    fn start_with(state: &Path, allow: &[String], extra: &[&str]) -> Relay {
        let port = free_port();
        let mut cmd = roam(state);
        cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
        for a in allow {
            cmd.args(["--allow", a]);
        }
        cmd.args(extra);
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
                let _ = tx.send(line);
            }
        });
        let relay = Relay {
            _child: Guard(child),
            port,
            lines,
        };
        relay.wait_for("listening on", Duration::from_secs(20));
        relay
    }

    fn wait_for(&self, needle: &str, limit: Duration) -> String {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => {}
                Err(_) => panic!("relay never logged {needle:?}"),
            }
        }
    }
}

/// Runs a child to completion with `input` on stdin, bounded in time.
fn run_with_input(mut cmd: Command, input: Vec<u8>, limit: Duration) -> (i32, Vec<u8>, String) {
    let mut child = Guard(
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stdin = child.0.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut stdout = child.0.stdout.take().unwrap();
    let mut stderr = child.0.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stdout.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let end = Instant::now() + limit;
    let code = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st.code().unwrap_or(-1);
        }
        assert!(
            Instant::now() < end,
            "child did not finish within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = feeder.join();
    (code, out.join().unwrap(), err.join().unwrap())
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn serve_and_pipe_move_data_with_checksum() {
    let state = tempfile::tempdir().unwrap();
    let sink = start_sink();
    let relay = Relay::start(state.path(), &[format!("127.0.0.1:{sink}")]);
    let data = random_bytes(3 << 20);
    let want = format!("{} {}\n", hex(&Sha256::digest(&data)), data.len());
    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        &format!("127.0.0.1:{}", relay.port),
        &sink.to_string(),
    ]);
    let (code, out, err) = run_with_input(cmd, data, Duration::from_secs(60));
    assert_eq!(code, 0, "stderr: {err}");
    assert_eq!(String::from_utf8_lossy(&out), want, "stderr: {err}");
    assert!(
        err.contains("trusting relay"),
        "first use is announced: {err}"
    );
    let known = std::fs::read_to_string(state.path().join("known_servers")).unwrap();
    assert!(
        known.starts_with(&format!("127.0.0.1:{} ", relay.port)),
        "{known}"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(state.path().join("server.key"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
}

/// `roam serve --metrics`: the figures a scraper reads follow real traffic
/// (3 MiB through a pipe, checked by SHA-256; a refused target), counters
/// only grow, and ended sessions stay counted.
#[test]
fn serve_metrics_count_sessions_bytes_and_refusals() {
    let state = tempfile::tempdir().unwrap();
    let sink = start_sink();
    let relay = Relay::start_with(
        state.path(),
        &[format!("127.0.0.1:{sink}")],
        &["--metrics", "127.0.0.1:0"],
    );
    let line = relay.wait_for("metrics at http://", Duration::from_secs(20));
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap()
        .to_string();
    let (status, before) = http_get(&addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(before.ends_with("# EOF\n"), "{before}");
    assert_eq!(sample(&before, "roam_sessions_opened_total"), Some(0));

    let data = random_bytes(3 << 20);
    let want = format!("{} {}\n", hex(&Sha256::digest(&data)), data.len());
    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        &format!("127.0.0.1:{}", relay.port),
        &sink.to_string(),
    ]);
    let (code, out, err) = run_with_input(cmd, data, Duration::from_secs(60));
    assert_eq!(code, 0, "stderr: {err}");
    assert_eq!(String::from_utf8_lossy(&out), want, "stderr: {err}");
    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        "--no-fallback",
        &format!("127.0.0.1:{}", relay.port),
        "127.0.0.1:9",
    ]);
    let (code, _, _) = run_with_input(cmd, b"x".to_vec(), Duration::from_secs(30));
    assert_ne!(code, 0);

    // Both sessions end at the relay shortly after their clients exit.
    let end = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let (_, text) = http_get(&addr, "/metrics");
        let closed: u64 = text
            .lines()
            .filter(|l| l.starts_with("roam_sessions_closed_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        if closed == 2 {
            break text;
        }
        assert!(
            Instant::now() < end,
            "sessions never counted closed:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        sample(&text, "roam_sessions_opened_total"),
        Some(2),
        "{text}"
    );
    let received = sample(&text, "roam_bytes_received_total").unwrap();
    assert!(received >= 3 << 20, "3 MiB came in: {received}\n{text}");
    assert_eq!(
        sample(&text, "roam_streams_refused_total{reason=\"not_allowed\"}"),
        Some(1),
        "{text}"
    );
    assert_eq!(
        sample(&text, "roam_target_connections_opened_total"),
        Some(1),
        "{text}"
    );
    assert_eq!(sample(&text, "roam_target_connections"), Some(0), "{text}");
    assert!(text.contains("roam_limit{limit="), "{text}");
    // Counters only grow: a later scrape never reads less.
    let (_, later) = http_get(&addr, "/metrics");
    assert!(sample(&later, "roam_bytes_received_total").unwrap() >= received);
    assert_eq!(http_get(&addr, "/nope").0, "HTTP/1.1 404 Not Found");
}

#[test]
fn disallowed_target_is_refused_with_message() {
    let state = tempfile::tempdir().unwrap();
    let sink = start_sink();
    let relay = Relay::start(state.path(), &[]); // default: 127.0.0.1:22 only
    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        "--no-fallback",
        &format!("127.0.0.1:{}", relay.port),
        &sink.to_string(),
    ]);
    let (code, out, err) = run_with_input(cmd, b"hello".to_vec(), Duration::from_secs(30));
    assert_ne!(code, 0);
    assert!(out.is_empty());
    assert!(
        err.contains(&format!(
            "relay refused target 127.0.0.1:{sink}: not allowed"
        )),
        "client said: {err}"
    );
    let line = relay.wait_for("refused stream", Duration::from_secs(10));
    assert!(
        line.contains(&format!("127.0.0.1:{sink}")) && line.contains("--allow"),
        "{line}"
    );
}

#[test]
fn status_json_lists_live_sessions() {
    let state = tempfile::tempdir().unwrap();
    let echo = start_echo();
    let relay = Relay::start(state.path(), &[format!("127.0.0.1:{echo}")]);
    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        &format!("127.0.0.1:{}", relay.port),
        &echo.to_string(),
    ]);
    let mut pipe = Guard(
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Prove the stream is up: one line echoed back.
    let mut stdin = pipe.0.stdin.take().unwrap();
    stdin.write_all(b"ping\n").unwrap();
    let mut line = String::new();
    BufReader::new(pipe.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ping\n");

    let out = roam(state.path())
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let procs = v["processes"].as_array().unwrap();
    let pipe_proc = procs
        .iter()
        .find(|p| p["command"].as_str().unwrap_or("").starts_with("pipe"))
        .unwrap_or_else(|| panic!("no pipe process in {v}"));
    let s = &pipe_proc["sessions"][0];
    assert_eq!(s["state"], "active", "{v}");
    assert_eq!(s["role"], "client");
    assert_eq!(s["peer_addr"], format!("127.0.0.1:{}", relay.port));
    assert!(s["bytes_sent"].as_u64().unwrap() >= 5);
    let serve_proc = procs
        .iter()
        .find(|p| p["command"].as_str().unwrap_or("").starts_with("serve"))
        .unwrap();
    assert_eq!(serve_proc["sessions"][0]["role"], "server", "{v}");

    // Human-readable form too.
    let text = roam(state.path()).arg("status").output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("active"));
    drop(stdin);
}

#[test]
fn pipe_falls_back_to_direct_tcp_without_relay() {
    let state = tempfile::tempdir().unwrap();
    let sink = start_sink();
    let no_relay = free_port();
    let data = random_bytes(100_000);
    let want = format!("{} {}\n", hex(&Sha256::digest(&data)), data.len());
    let mut cmd = roam(state.path());
    cmd.args(["pipe", &format!("127.0.0.1:{no_relay}"), &sink.to_string()]);
    let (code, out, err) = run_with_input(cmd, data.clone(), Duration::from_secs(30));
    assert_eq!(code, 0, "{err}");
    assert_eq!(String::from_utf8_lossy(&out), want);
    assert!(err.contains("connecting directly"), "{err}");

    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        "--no-fallback",
        &format!("127.0.0.1:{no_relay}"),
        &sink.to_string(),
    ]);
    let (code, _, err) = run_with_input(cmd, data, Duration::from_secs(30));
    assert_ne!(code, 0);
    assert!(err.contains("cannot reach"), "{err}");
}

#[test]
fn demo_exits_zero() {
    let state = tempfile::tempdir().unwrap();
    let mut cmd = roam(state.path());
    cmd.args(["demo", "--size", "2M"]);
    let (code, out, err) = run_with_input(cmd, Vec::new(), Duration::from_secs(60));
    let out = String::from_utf8_lossy(&out);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(
        out.contains("RESUMED") && out.contains("exactly once"),
        "{out}"
    );
}

#[test]
fn help_has_examples_everywhere() {
    for sub in ["serve", "pipe", "forward", "status", "keygen", "demo"] {
        let out = Command::new(BIN).args([sub, "--help"]).output().unwrap();
        assert!(out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Examples:"),
            "{sub} --help has examples"
        );
    }
}

/// Byte `i` of the stream a [`PatternTarget`] sends.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// A target that sends `total` pattern bytes at a pace (so that some are
/// sent while the client is detached) and reads slowly (so that the client
/// holds unsent bytes when it detaches); once both directions are done it
/// reports the SHA-256 and length of what it received.
struct PatternTarget {
    port: u16,
    received: std::sync::Arc<std::sync::atomic::AtomicU64>,
    report: mpsc::Receiver<(String, u64)>,
}

impl PatternTarget {
    fn start(total: u64) -> Self {
        use std::sync::atomic::Ordering;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let received = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (tx, report) = mpsc::channel();
        let count = received.clone();
        std::thread::spawn(move || {
            let Ok((mut c, _)) = l.accept() else { return };
            let mut w = c.try_clone().unwrap();
            let writer = std::thread::spawn(move || {
                let mut off = 0u64;
                while off < total {
                    let n = (total - off).min(16 * 1024);
                    let chunk: Vec<u8> = (off..off + n).map(pattern).collect();
                    if w.write_all(&chunk).is_err() {
                        return;
                    }
                    off += n;
                    std::thread::sleep(Duration::from_millis(3));
                }
                let _ = w.shutdown(std::net::Shutdown::Write);
            });
            let mut h = Sha256::new();
            let mut buf = [0u8; 16 * 1024];
            loop {
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        h.update(&buf[..k]);
                        count.fetch_add(k as u64, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
            let _ = writer.join();
            let _ = tx.send((hex(&h.finalize()), count.load(Ordering::SeqCst)));
        });
        Self {
            port,
            received,
            report,
        }
    }
}

/// `roam pipe --name`: the first process is detached mid-transfer in both
/// directions (SIGTERM), `roam status` lists the session, and a second
/// process re-attaches it: the target receives every byte of the upload
/// exactly once — including those the first process took from its stdin but
/// had not sent — and the two processes' outputs together are exactly what
/// the target sent, also what it sent while nobody was attached.
#[test]
fn a_named_pipe_detaches_and_reattaches_with_every_byte_once() {
    use std::os::fd::AsFd;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let state = tempfile::tempdir().unwrap();
    let down_total: u64 = 4 << 20;
    let target = PatternTarget::start(down_total);
    let relay = Relay::start(state.path(), &[format!("127.0.0.1:{}", target.port)]);
    let relay_addr = format!("127.0.0.1:{}", relay.port);
    let target_arg = target.port.to_string();
    let upload = random_bytes(16 << 20);

    // The first client's stdin is a pipe whose read end the test keeps too:
    // what the client had not read when it left is still there to take.
    let (stdin_r, stdin_w) = nix::unistd::pipe().unwrap();
    let keep_r = stdin_r.try_clone().unwrap();
    let mut first = Guard(
        roam(state.path())
            .args(["pipe", "--name", "job", &relay_addr, &target_arg])
            .stdin(Stdio::from(stdin_r))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let feeder = {
        let (stop, written, upload) = (stop.clone(), written.clone(), upload.clone());
        std::thread::spawn(move || {
            let mut w = std::fs::File::from(stdin_w);
            for chunk in upload.chunks(8 * 1024) {
                if stop.load(Ordering::SeqCst) || w.write_all(chunk).is_err() {
                    return;
                }
                written.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            }
            // Stays open: the first client must not see the end of its stdin.
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    // Read slower than the target sends: at the detach the client holds
    // output it has taken from the session and not printed.
    let reader1 = slow_reader(first.0.stdout.take().unwrap());
    // Detach once the target has part of the upload, mid-stream both ways.
    let end = Instant::now() + Duration::from_secs(30);
    while target.received.load(Ordering::SeqCst) < 512 << 10 {
        assert!(Instant::now() < end, "the upload never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = first.0.wait().unwrap();
    let mut err1 = String::new();
    first
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err1)
        .unwrap();
    assert_eq!(status.code(), Some(0), "detach exits 0: {err1}");
    assert!(err1.contains("detached"), "{err1}");
    let got1 = reader1.join().unwrap();

    // Take back what the first client left unread in its stdin pipe.
    stop.store(true, Ordering::SeqCst);
    nix::fcntl::fcntl(
        keep_r.as_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .unwrap();
    let mut keep = std::fs::File::from(keep_r);
    let mut unread = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match keep.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => unread.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if feeder.is_finished() {
                    match keep.read(&mut buf) {
                        Ok(n) if n > 0 => unread.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            Err(e) => panic!("reading the leftover stdin: {e}"),
        }
    }
    feeder.join().unwrap();
    let consumed = written.load(Ordering::SeqCst) as usize - unread.len();
    assert!(
        consumed < upload.len(),
        "the detach must come mid-upload (consumed {consumed})"
    );

    // Listed while detached.
    let v = status_json(state.path());
    assert_eq!(v["detached"][0]["name"], "job", "{v}");
    assert_eq!(
        v["detached"][0]["target"],
        format!("127.0.0.1:{}", target.port),
        "{v}"
    );
    let record = state.path().join("sessions/job.journal-0");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&record).unwrap().permissions().mode() & 0o777,
        0o600
    );
    std::thread::sleep(Duration::from_millis(300));

    // The second client gets the rest of the upload (from where the first
    // left its stdin) and prints the rest of the download.
    let mut cmd = roam(state.path());
    cmd.args(["pipe", "--name", "job", &relay_addr, &target_arg]);
    let (code, got2, err2) =
        run_with_input(cmd, upload[consumed..].to_vec(), Duration::from_secs(60));
    assert_eq!(code, 0, "{err2}");
    assert!(err2.contains("re-attached"), "{err2}");
    assert!(!record.exists(), "the record is used up by the re-attach");

    let (sha, n) = target
        .report
        .recv_timeout(Duration::from_secs(30))
        .expect("target report");
    assert_eq!(
        n,
        upload.len() as u64,
        "upload length at the target; consumed {consumed} written {} first: {err1}\nsecond: {err2}",
        written.load(Ordering::SeqCst)
    );
    assert_eq!(
        sha,
        hex(&Sha256::digest(&upload)),
        "upload bytes at the target"
    );
    let mut got = got1.clone();
    got.extend_from_slice(&got2);
    assert_eq!(
        got.len() as u64,
        down_total,
        "download length ({} + {})",
        got1.len(),
        got2.len()
    );
    assert!(
        got.iter().enumerate().all(|(i, b)| *b == pattern(i as u64)),
        "download bytes in order, once"
    );
    assert!(
        !got1.is_empty() && !got2.is_empty(),
        "both clients printed part of it"
    );

    // The name is free again and nothing is left detached.
    let v = status_json(state.path());
    assert_eq!(v["detached"], serde_json::json!([]), "{v}");
}

/// `roam pipe --name`, killed outright (SIGKILL) mid-transfer both ways:
/// its journal leaves the session re-attachable. `roam status` lists it as
/// left by a killed client with how much input the session took and how
/// much output was printed; a new process fed the upload from that byte on
/// re-attaches: the target receives every byte of the upload exactly once,
/// and the first process's output up to the printed count followed by the
/// second's is exactly what the target sent (any bytes the first printed
/// past the count, at most one 4 KiB write, are the same bytes again).
#[test]
fn a_named_pipe_killed_with_sigkill_reattaches_from_its_journal_with_every_byte_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let state = tempfile::tempdir().unwrap();
    let down_total: u64 = 4 << 20;
    let target = PatternTarget::start(down_total);
    let relay = Relay::start(state.path(), &[format!("127.0.0.1:{}", target.port)]);
    let relay_addr = format!("127.0.0.1:{}", relay.port);
    let target_arg = target.port.to_string();
    let upload = random_bytes(16 << 20);

    let mut first = Guard(
        roam(state.path())
            .args(["pipe", "--name", "job", &relay_addr, &target_arg])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let feeder = {
        let mut w = first.0.stdin.take().unwrap();
        let (stop, upload) = (stop.clone(), upload.clone());
        std::thread::spawn(move || {
            for chunk in upload.chunks(8 * 1024) {
                if stop.load(Ordering::SeqCst) || w.write_all(chunk).is_err() {
                    return;
                }
            }
            // Stays open: the first client must not see the end of its stdin.
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    // Read slower than the target sends: the client holds output it has
    // not printed, and prints between the journal's copies.
    let reader1 = slow_reader(first.0.stdout.take().unwrap());
    let end = Instant::now() + Duration::from_secs(30);
    while target.received.load(Ordering::SeqCst) < 1 << 20 {
        assert!(Instant::now() < end, "the upload never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    first.0.kill().unwrap();
    let status = first.0.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "killed by SIGKILL");
    stop.store(true, Ordering::SeqCst);
    feeder.join().unwrap();
    let got1 = reader1.join().unwrap();
    assert!(
        (got1.len() as u64) < down_total,
        "the kill must come mid-download ({} bytes printed)",
        got1.len()
    );

    // Listed as left by a killed client, with where input and output stand.
    let v = status_json(state.path());
    let d = &v["detached"][0];
    assert_eq!(d["name"], "job", "{v}");
    assert_eq!(d["killed"], true, "{v}");
    let taken = d["input_taken"].as_u64().expect("input_taken") as usize;
    let printed = d["output_printed"].as_u64().expect("output_printed") as usize;
    assert!(
        taken > 0 && taken < upload.len(),
        "mid-upload: {taken} of {}",
        upload.len()
    );
    assert!(
        printed <= got1.len() && got1.len() - printed <= 4096,
        "printed {printed}, the first client wrote {}",
        got1.len()
    );
    let record = state.path().join("sessions/job.journal-0");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&record).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let mut cmd = roam(state.path());
    cmd.args(["pipe", "--name", "job", &relay_addr, &target_arg]);
    let (code, got2, err2) = run_with_input(cmd, upload[taken..].to_vec(), Duration::from_secs(60));
    assert_eq!(code, 0, "{err2}");
    assert!(err2.contains("journal"), "{err2}");
    assert!(
        err2.contains(&format!("follows byte {taken}")),
        "the new client says where its stdin goes on: {err2}"
    );
    let left: Vec<String> = std::fs::read_dir(state.path().join("sessions"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "job.lock")
        .collect();
    assert!(
        left.is_empty(),
        "the journal and the output mark are gone with the session: {left:?}"
    );

    let (sha, n) = target
        .report
        .recv_timeout(Duration::from_secs(30))
        .expect("target report");
    assert_eq!(
        n,
        upload.len() as u64,
        "upload length at the target: {err2}"
    );
    assert_eq!(
        sha,
        hex(&Sha256::digest(&upload)),
        "upload bytes at the target"
    );
    let repeated = &got1[printed..];
    assert_eq!(
        &got2[..repeated.len().min(got2.len())],
        &repeated[..repeated.len().min(got2.len())],
        "bytes printed past the count come again, the same"
    );
    let mut got = got1[..printed].to_vec();
    got.extend_from_slice(&got2);
    assert_eq!(
        got.len() as u64,
        down_total,
        "download length ({printed} + {})",
        got2.len()
    );
    assert!(
        got.iter().enumerate().all(|(i, b)| *b == pattern(i as u64)),
        "download bytes in order, once"
    );
}

/// A target that reads slower than the client sends gets every byte: the
/// client finishes, sees the target's end and closes the session while the
/// relay still holds megabytes for the target. The relay used to drop the
/// target connection with the session, losing them (found by the named-pipe
/// test below).
#[test]
fn a_slow_target_gets_every_byte_sent_before_the_session_closed() {
    let state = tempfile::tempdir().unwrap();
    let target = PatternTarget::start(256 << 10);
    let relay = Relay::start(state.path(), &[format!("127.0.0.1:{}", target.port)]);
    let upload = random_bytes(8 << 20);
    let mut cmd = roam(state.path());
    cmd.args([
        "pipe",
        &format!("127.0.0.1:{}", relay.port),
        &target.port.to_string(),
    ]);
    let (code, got, err) = run_with_input(cmd, upload.clone(), Duration::from_secs(60));
    assert_eq!(code, 0, "{err}");
    assert_eq!(got.len(), 256 << 10, "the whole download");
    let (sha, n) = target
        .report
        .recv_timeout(Duration::from_secs(30))
        .expect("target report");
    assert_eq!(n, upload.len() as u64, "upload length at the target");
    assert_eq!(
        sha,
        hex(&Sha256::digest(&upload)),
        "upload bytes at the target"
    );
}
