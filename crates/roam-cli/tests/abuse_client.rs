//! Everyday misuse and abuse on the client side (issue 8): signals ending
//! `roam pipe`/`forward` must close the session (no leak on the relay), a full
//! disk must not corrupt state files, shared keys and bad key lists are
//! refused, keys are pinned by name and address, a pinned relay is never
//! replaced by a plaintext connection, and a relay that restarted without the
//! session is reported with exit code 3. Real `roam` processes on 127.0.0.1;
//! every child is killed and every mount removed even when a test fails.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{free_port, roam, status_json, Guard};

/// Collects a child's stderr lines.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            let _ = tx.send(line);
        }
    });
    rx
}

/// Waits for a line containing `needle`; all lines seen so far on failure.
fn wait_line(rx: &mpsc::Receiver<String>, needle: &str, limit: Duration) -> Result<String, String> {
    let end = Instant::now() + limit;
    let mut seen = String::new();
    loop {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(l) if l.contains(needle) => return Ok(l),
            Ok(l) => {
                seen.push_str(&l);
                seen.push('\n');
            }
            Err(_) => return Err(seen),
        }
    }
}

/// A running relay.
struct Relay {
    child: Guard,
    port: u16,
    _lines: mpsc::Receiver<String>,
}

impl Relay {
    fn start(state: &Path, port: u16, allow: &str) -> Relay {
        let mut child = roam(state)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--allow", allow])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = lines_of(&mut child);
        let child = Guard(child);
        wait_line(&lines, "listening on", Duration::from_secs(20))
            .unwrap_or_else(|seen| panic!("relay did not start:\n{seen}"));
        Relay {
            child,
            port,
            _lines: lines,
        }
    }

    /// Sessions the relay lists in `roam status --json` (its state dir).
    fn sessions(&self, state: &Path) -> usize {
        let out = roam(state).args(["status", "--json"]).output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let pid = self.child.0.id();
        v["processes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["pid"].as_u64() == Some(u64::from(pid)))
            .map(|p| p["sessions"].as_array().map_or(0, Vec::len))
            .sum()
    }
}

/// An echo target that counts connections opened and closed by the relay,
/// and of those closed, the ones that ended with a reset.
struct Target {
    port: u16,
    opened: Arc<AtomicU64>,
    closed: Arc<AtomicU64>,
    aborted: Arc<AtomicU64>,
}

fn start_target() -> Target {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let opened = Arc::new(AtomicU64::new(0));
    let closed = Arc::new(AtomicU64::new(0));
    let aborted = Arc::new(AtomicU64::new(0));
    let (o, c, a) = (opened.clone(), closed.clone(), aborted.clone());
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { return };
            o.fetch_add(1, Ordering::SeqCst);
            let (c, a) = (c.clone(), a.clone());
            std::thread::spawn(move || {
                let mut w = conn.try_clone().unwrap();
                if std::io::copy(&mut conn, &mut w).is_err() {
                    a.fetch_add(1, Ordering::SeqCst);
                }
                c.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    Target {
        port,
        opened,
        closed,
        aborted,
    }
}

fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ok()
}

/// Starts `roam pipe` to the relay at 127.0.0.1 with stdin/stdout piped;
/// checks an echo round trip of numbered lines through it.
fn start_pipe(state: &Path, relay_port: u16, target_port: u16) -> (Guard, mpsc::Receiver<String>) {
    start_pipe_named(state, "127.0.0.1", relay_port, target_port)
}

#[test]
fn signals_end_pipe_and_forward_and_the_relay_frees_the_session() {
    let state = tempfile::tempdir().unwrap();
    let target = start_target();
    let relay = Relay::start(
        state.path(),
        free_port(),
        &format!("127.0.0.1:{}", target.port),
    );
    for (n, (sig, code)) in [("HUP", 129), ("TERM", 143), ("INT", 130)]
        .into_iter()
        .enumerate()
    {
        let (mut pipe, _lines) = start_pipe(state.path(), relay.port, target.port);
        assert!(wait_until(Duration::from_secs(5), || relay
            .sessions(state.path())
            == 1));
        pipe.signal(sig);
        assert_eq!(
            pipe.wait_exit(Duration::from_secs(6)),
            Some(code),
            "roam pipe exits 128+signal on SIG{sig}"
        );
        // The relay freed the session and closed the target connection at once,
        // not after the 3-day suspend timeout.
        assert!(
            wait_until(Duration::from_secs(5), || relay.sessions(state.path()) == 0),
            "relay still holds the session after SIG{sig}"
        );
        assert!(
            wait_until(Duration::from_secs(5), || target
                .closed
                .load(Ordering::SeqCst)
                == n as u64 + 1),
            "target connection still open after SIG{sig}"
        );
    }

    // roam forward: a local connection, then SIGHUP.
    let local = free_port();
    let mut child = roam(state.path())
        .args([
            "forward",
            &format!("127.0.0.1:{}", relay.port),
            &format!("127.0.0.1:{local}"),
            &format!("127.0.0.1:{}", target.port),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut child);
    let mut forward = Guard(child);
    wait_line(&lines, "roam forward:", Duration::from_secs(10)).expect("forward started");
    let mut c = std::net::TcpStream::connect(("127.0.0.1", local)).unwrap();
    c.write_all(b"ping\n").unwrap();
    let mut buf = [0u8; 5];
    c.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping\n");
    forward.signal("HUP");
    assert_eq!(forward.wait_exit(Duration::from_secs(6)), Some(129));
    assert!(wait_until(Duration::from_secs(5), || relay
        .sessions(state.path())
        == 0));
    assert!(wait_until(Duration::from_secs(5), || target
        .closed
        .load(Ordering::SeqCst)
        == 4));
    assert_eq!(target.opened.load(Ordering::SeqCst), 4);
}

/// A tmpfs mounted for one test, unmounted on drop.
struct TinyFs {
    dir: tempfile::TempDir,
}

impl TinyFs {
    /// `None` (with a message) when not root or mount fails.
    fn mount(size: &str) -> Option<TinyFs> {
        if !nix_is_root() {
            eprintln!("skipped: mounting a tmpfs needs root");
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("roam-fulldisk")
            .tempdir()
            .unwrap();
        let ok = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "roamtest",
            ])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipped: cannot mount a tmpfs");
            return None;
        }
        Some(TinyFs { dir })
    }

    fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// Fills the filesystem; returns the filler's path.
    fn fill(&self) -> PathBuf {
        let p = self.path().join("filler");
        let mut f = std::fs::File::create(&p).unwrap();
        let block = vec![0xa5u8; 4096];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
        p
    }

    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

fn nix_is_root() -> bool {
    // The effective uid, from /proc (no libc call needed).
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

#[test]
fn a_full_disk_leaves_no_broken_state_files() {
    let Some(fs) = TinyFs::mount("256k") else {
        return;
    };
    let state = fs.path();
    let filler = fs.fill();
    // No key can be written: a clear error, and nothing left behind.
    let out = roam(&state)
        .args([
            "pipe",
            "--no-fallback",
            &format!("127.0.0.1:{}", free_port()),
            "22",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot write key file"), "{err}");
    assert_eq!(
        fs.names(),
        vec!["filler".to_string()],
        "no key file, no temporary file"
    );
    let out = roam(&state)
        .args(["keygen", "--out"])
        .arg(state.join("server.key"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(fs.names(), vec!["filler".to_string()]);

    // With room again, everything works; keys are created whole.
    std::fs::remove_file(&filler).unwrap();
    let target = start_target();
    let relay_state = tempfile::tempdir().unwrap();
    let relay = Relay::start(
        relay_state.path(),
        free_port(),
        &format!("127.0.0.1:{}", target.port),
    );
    let (mut pipe, _l) = start_pipe(&state, relay.port, target.port);
    pipe.signal("TERM");
    assert_eq!(pipe.wait_exit(Duration::from_secs(6)), Some(143));
    let known = std::fs::read_to_string(state.join("known_servers")).unwrap();
    assert_eq!(known.lines().count(), 1, "{known}");

    // Full again: pinning a new relay fails with a warning, the connection
    // stands, and known_servers keeps exactly its old contents.
    let relay2_state = tempfile::tempdir().unwrap();
    let relay2 = Relay::start(
        relay2_state.path(),
        free_port(),
        &format!("127.0.0.1:{}", target.port),
    );
    fs.fill();
    let (mut pipe, lines) = start_pipe(&state, relay2.port, target.port);
    wait_line(&lines, "could not pin relay key", Duration::from_secs(5))
        .unwrap_or_else(|seen| panic!("no warning about pinning:\n{seen}"));
    pipe.signal("TERM");
    assert_eq!(pipe.wait_exit(Duration::from_secs(6)), Some(143));
    assert_eq!(
        std::fs::read_to_string(state.join("known_servers")).unwrap(),
        known
    );
    assert!(
        fs.names().iter().all(|n| !n.contains(".tmp.")),
        "temporary files left: {:?}",
        fs.names()
    );
}

#[test]
fn shared_private_keys_and_bad_key_lists_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let state = tempfile::tempdir().unwrap();
    let key = state.path().join("client.key");
    let out = roam(state.path())
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success());
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = roam(state.path())
        .args([
            "pipe",
            "--no-fallback",
            &format!("127.0.0.1:{}", free_port()),
            "22",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("chmod 600") && err.contains("0644"), "{err}");

    // authorized_keys: empty, or a private key file by mistake.
    let empty = state.path().join("empty");
    std::fs::write(&empty, "# nobody yet\n").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    for (file, needle) in [(&empty, "lists no keys"), (&key, "private key file")] {
        let out = roam(state.path())
            .args(["serve", "--listen", "127.0.0.1:0", "--authorized-keys"])
            .arg(file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{err}");
    }

    // Partial wildcards are refused at start-up instead of never matching.
    let out = roam(state.path())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--allow",
            "127.0.0.*:22",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("partial wildcards"), "{err}");
}

#[test]
fn relay_keys_are_pinned_by_name_and_address() {
    let state = tempfile::tempdir().unwrap();
    let target = start_target();
    let relay_state = tempfile::tempdir().unwrap();
    let relay = Relay::start(
        relay_state.path(),
        free_port(),
        &format!("127.0.0.1:{}", target.port),
    );
    // First use through the name: both the name and the address are pinned.
    let (mut pipe, _l) = start_pipe_named(state.path(), "localhost", relay.port, target.port);
    pipe.signal("TERM");
    assert_eq!(pipe.wait_exit(Duration::from_secs(6)), Some(143));
    let known = std::fs::read_to_string(state.path().join("known_servers")).unwrap();
    assert!(
        known.contains(&format!("localhost:{} ", relay.port)),
        "{known}"
    );
    assert!(
        known.contains(&format!("127.0.0.1:{} ", relay.port)),
        "{known}"
    );

    // Another client pinned the address with a different key: the name is
    // not trusted anew on first use, it is refused loudly.
    let other = tempfile::tempdir().unwrap();
    let fake = roam_proto::Keypair::generate().unwrap().public();
    std::fs::write(
        other.path().join("known_servers"),
        format!("127.0.0.1:{} {fake}\n", relay.port),
    )
    .unwrap();
    let out = roam(other.path())
        .args([
            "pipe",
            &format!("localhost:{}", relay.port),
            &target.port.to_string(),
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("HAS CHANGED"), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{}", relay.port)), "{err}");
}

/// `roam pipe HOST:RELAY_PORT TARGET_PORT` with its stdio piped.
fn spawn_pipe(state: &Path, host: &str, relay_port: u16, target_port: u16) -> Child {
    roam(state)
        .args([
            "pipe",
            &format!("{host}:{relay_port}"),
            &target_port.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts `roam pipe` to the relay at `host:relay_port` with stdin/stdout
/// piped; checks an echo round trip of 100 numbered lines through it.
fn start_pipe_named(
    state: &Path,
    host: &str,
    relay_port: u16,
    target_port: u16,
) -> (Guard, mpsc::Receiver<String>) {
    let mut child = spawn_pipe(state, host, relay_port, target_port);
    let lines = lines_of(&mut child);
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let guard = Guard(child);
    for i in 0..100u32 {
        writeln!(stdin, "line {i}").unwrap();
    }
    stdin.flush().unwrap();
    for i in 0..100u32 {
        let mut l = String::new();
        stdout.read_line(&mut l).unwrap();
        assert_eq!(l, format!("line {i}\n"), "echo through the pipe");
    }
    // Keep stdin open (leaked into the thread) so only a signal ends the pipe.
    std::thread::spawn(move || {
        let _keep = (stdin, stdout);
        std::thread::sleep(Duration::from_secs(120));
    });
    (guard, lines)
}

#[test]
fn a_pinned_relay_is_never_silently_replaced_by_plain_tcp() {
    let state = tempfile::tempdir().unwrap();
    let target = start_target();
    let dead_relay = free_port(); // nothing listens there
    let key = roam_proto::Keypair::generate().unwrap().public();
    std::fs::write(
        state.path().join("known_servers"),
        format!("127.0.0.1:{dead_relay} {key}\n"),
    )
    .unwrap();
    let relay = format!("127.0.0.1:{dead_relay}");
    let out = roam(state.path())
        .args(["pipe", &relay, &target.port.to_string()])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("refusing to fall back"), "{err}");
    assert_eq!(
        target.opened.load(Ordering::SeqCst),
        0,
        "no direct connection"
    );

    // Asked explicitly, it connects directly (and says so).
    let mut child = Guard(
        roam(state.path())
            .args([
                "pipe",
                "--fallback",
                "always",
                &relay,
                &target.port.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stdin = child.0.stdin.take().unwrap();
    stdin.write_all(b"direct\n").unwrap();
    drop(stdin);
    let mut out = String::new();
    child
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(out, "direct\n");
    assert_eq!(child.wait_exit(Duration::from_secs(10)), Some(0));
    assert_eq!(target.opened.load(Ordering::SeqCst), 1);
}

#[test]
fn a_relay_restarted_without_the_session_is_reported_with_exit_code_3() {
    let state = tempfile::tempdir().unwrap();
    let relay_state = tempfile::tempdir().unwrap();
    let target = start_target();
    let port = free_port();
    let allow = format!("127.0.0.1:{}", target.port);
    let relay = Relay::start(relay_state.path(), port, &allow);
    let (mut pipe, lines) = start_pipe(state.path(), port, target.port);
    // kill -9: the relay forgets everything.
    drop(relay);
    wait_line(&lines, "session suspended", Duration::from_secs(10))
        .unwrap_or_else(|seen| panic!("the pipe did not say it lost the relay:\n{seen}"));
    let _relay = Relay::start(relay_state.path(), port, &allow);
    let started = Instant::now();
    wait_line(&lines, "refused to resume", Duration::from_secs(15))
        .unwrap_or_else(|seen| panic!("no refusal notice:\n{seen}"));
    let msg = wait_line(&lines, "no longer knows", Duration::from_secs(40))
        .unwrap_or_else(|seen| panic!("no lost-session message:\n{seen}"));
    assert!(msg.contains("restarted"), "{msg}");
    assert_eq!(pipe.wait_exit(Duration::from_secs(10)), Some(3));
    // Not at the first refusal: after the refusal grace (10 s by default).
    assert!(
        started.elapsed() >= Duration::from_secs(9),
        "{:?}",
        started.elapsed()
    );
}

/// A target that sends a banner, finishes its side at once, then keeps
/// reading (slowly): `roam pipe`'s download is over while its upload goes
/// on. Lose the session under that upload (the relay restarted without
/// it): the input was not delivered, so the pipe must say so and exit 3,
/// not 0 (it used to count any upload failure after the download's end as
/// the remote's choice).
#[test]
fn an_upload_lost_after_the_download_ended_is_no_success() {
    let state = tempfile::tempdir().unwrap();
    let relay_state = tempfile::tempdir().unwrap();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_port = l.local_addr().unwrap().port();
    let received = Arc::new(AtomicU64::new(0));
    let count = received.clone();
    std::thread::spawn(move || {
        let Ok((mut c, _)) = l.accept() else { return };
        let _ = c.write_all(b"banner\n");
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut buf = [0u8; 16 << 10];
        while let Ok(n @ 1..) = c.read(&mut buf) {
            count.fetch_add(n as u64, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    let port = free_port();
    let allow = format!("127.0.0.1:{target_port}");
    let relay = Relay::start(relay_state.path(), port, &allow);
    let mut child = spawn_pipe(state.path(), "127.0.0.1", port, target_port);
    let lines = lines_of(&mut child);
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut pipe = Guard(child);
    // Endless input (bounded: 2 GiB or 120 s), until the pipe stops taking it.
    std::thread::spawn(move || {
        let chunk = vec![0x5au8; 64 << 10];
        let end = Instant::now() + Duration::from_secs(120);
        for _ in 0..(2u64 << 30) / (64 << 10) {
            if Instant::now() > end || stdin.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let mut out = Vec::new();
    stdout.read_to_end(&mut out).unwrap();
    assert_eq!(out, b"banner\n", "the whole download, then its end");
    assert!(
        wait_until(Duration::from_secs(20), || received.load(Ordering::SeqCst)
            > 1 << 20),
        "the upload goes on after the download ended"
    );
    // kill -9: the relay forgets the session; a new one answers at its port.
    drop(relay);
    wait_line(&lines, "session suspended", Duration::from_secs(10))
        .unwrap_or_else(|seen| panic!("the pipe did not say it lost the relay:\n{seen}"));
    let _relay = Relay::start(relay_state.path(), port, &allow);
    let msg = wait_line(&lines, "no longer knows", Duration::from_secs(40))
        .unwrap_or_else(|seen| panic!("no lost-session message:\n{seen}"));
    assert!(msg.contains("restarted"), "{msg}");
    assert_eq!(pipe.wait_exit(Duration::from_secs(10)), Some(3));
}

#[test]
fn forward_opens_a_new_session_after_the_relay_lost_its_own() {
    let state = tempfile::tempdir().unwrap();
    let relay_state = tempfile::tempdir().unwrap();
    let target = start_target();
    let port = free_port();
    let allow = format!("127.0.0.1:{}", target.port);
    let relay = Relay::start(relay_state.path(), port, &allow);
    let local = free_port();
    let mut child = roam(state.path())
        .args([
            "forward",
            &format!("127.0.0.1:{port}"),
            &format!("127.0.0.1:{local}"),
            &allow,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut child);
    let mut forward = Guard(child);
    wait_line(&lines, "roam forward:", Duration::from_secs(10)).expect("forward started");
    let echo = |tag: &[u8]| {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", local)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(tag).unwrap();
        let mut buf = vec![0u8; tag.len()];
        c.read_exact(&mut buf).unwrap();
        assert_eq!(buf, tag);
    };
    echo(b"before\n");
    // The relay dies with the session and comes back without it.
    drop(relay);
    let _relay = Relay::start(relay_state.path(), port, &allow);
    wait_line(&lines, "no longer knows", Duration::from_secs(40))
        .unwrap_or_else(|seen| panic!("forward did not notice the lost session:\n{seen}"));
    assert_eq!(
        forward.0.try_wait().unwrap(),
        None,
        "forward must keep running"
    );
    echo(b"after the relay restarted\n");
    wait_line(&lines, "new session", Duration::from_secs(5)).expect("new session announced");
    forward.signal("TERM");
    assert_eq!(forward.wait_exit(Duration::from_secs(6)), Some(143));
}

/// The session ids a relay (state dir `state`) lists.
fn relay_session_ids(state: &Path) -> Vec<String> {
    let out = roam(state).args(["status", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["sessions"].as_array().cloned().unwrap_or_default())
        .filter_map(|s| s["session_id"].as_str().map(str::to_string))
        .collect()
}

/// `roam forward --name`: killed with SIGKILL while a local connection is
/// open, it leaves its session re-attachable (`roam status` lists it as
/// left by a killed client). The same command re-attaches the same relay
/// session; the connection the old process carried is reset (the relay
/// closes its target connection) and new local connections work. `roam
/// detach` then detaches it cleanly (exit 0), and a third process
/// re-attaches it again: still the one session at the relay.
#[test]
fn a_named_forward_outlives_kill_9_and_detach_with_its_session() {
    let state = tempfile::tempdir().unwrap();
    let relay_state = tempfile::tempdir().unwrap();
    let target = start_target();
    let port = free_port();
    let allow = format!("127.0.0.1:{}", target.port);
    let _relay = Relay::start(relay_state.path(), port, &allow);
    let local = free_port();
    let listen = format!("127.0.0.1:{local}");
    let start = |what: &str| {
        let mut child = roam(state.path())
            .args([
                "forward",
                "--name",
                "fw",
                &format!("127.0.0.1:{port}"),
                &listen,
                &allow,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = lines_of(&mut child);
        let line = wait_line(&lines, what, Duration::from_secs(20))
            .unwrap_or_else(|seen| panic!("no {what:?} from forward:\n{seen}"));
        (Guard(child), lines, line)
    };
    let echo = |c: &mut std::net::TcpStream, tag: &[u8]| {
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(tag).unwrap();
        let mut buf = vec![0u8; tag.len()];
        c.read_exact(&mut buf).unwrap();
        assert_eq!(buf, tag);
    };
    let connect = || {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match std::net::TcpStream::connect(("127.0.0.1", local)) {
                Ok(c) => return c,
                Err(e) if Instant::now() > end => panic!("connecting to the forward: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    };

    let (mut first, _l1, _) = start("roam forward: 127.0.0.1");
    let mut c1 = connect();
    echo(&mut c1, b"one\n");
    let ids = relay_session_ids(relay_state.path());
    assert_eq!(ids.len(), 1, "{ids:?}");
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    // The local connection ended with the process.
    c1.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    assert!(matches!(c1.read(&mut buf), Ok(0) | Err(_)));
    let v = status_json(state.path());
    let d = &v["detached"][0];
    assert_eq!(d["name"], "fw", "{v}");
    assert_eq!(d["killed"], true, "{v}");
    assert_eq!(d["listen"], listen.as_str(), "{v}");

    let (second, _l2, line) = start("re-attached");
    assert!(line.contains("1 connection(s)"), "{line}");
    assert!(
        wait_until(Duration::from_secs(10), || target
            .closed
            .load(Ordering::SeqCst)
            == 1),
        "the relay closes the old connection's target connection"
    );
    assert_eq!(
        target.aborted.load(Ordering::SeqCst),
        1,
        "with a reset: the target must not take the cut-off connection as complete"
    );
    let mut c2 = connect();
    echo(&mut c2, b"two\n");
    assert_eq!(
        relay_session_ids(relay_state.path()),
        ids,
        "the same session"
    );

    let out = roam(state.path()).args(["detach", "fw"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut second = second;
    assert_eq!(second.wait_exit(Duration::from_secs(10)), Some(0));
    let v = status_json(state.path());
    assert_eq!(v["detached"][0]["name"], "fw", "{v}");
    assert_eq!(v["detached"][0]["killed"], false, "{v}");

    let (_third, _l3, _) = start("re-attached");
    let mut c3 = connect();
    echo(&mut c3, b"three\n");
    assert_eq!(relay_session_ids(relay_state.path()), ids);
    assert_eq!(target.opened.load(Ordering::SeqCst), 3);
}
