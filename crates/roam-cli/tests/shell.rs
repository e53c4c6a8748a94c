//! `roam shell` end to end, with the client on a real terminal (tmux, on a
//! private server socket this test starts and kills): a command's output;
//! the client killed with -9 while the shell prints, then a new client
//! process re-attaching by name and getting every line printed meanwhile;
//! a window resize; the shell's exit status; a shell printing megabytes
//! while its client is away (it must not block); a relay upgrade
//! (`--takeover`) with the client attached: the same shell goes on and the
//! client re-attaches by itself; a key that is not authorized (skips,
//! saying why, without tmux). The network cut (a fault proxy) while the
//! shell prints: once it is back the same client is shown what was printed. A thousand parked shells and what they cost
//! the relay (clients on ptys of the test's own). A relay running as root
//! starting the shell as the account named, with its supplementary groups,
//! for that account's keys only, and only while the keys file and every
//! directory on its way are the account's or root's alone; a shell whose
//! account cannot enter its home starting in `/`, saying why (throwaway
//! system accounts and groups; skips, saying why, unless root with
//! `useradd`).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, keygen, wait_for_port, Guard, BIN};

/// A tmux server of this test's own; killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start() -> Option<Self> {
        // Tests run on threads of one process: each its own server.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let socket = format!("roam-shell-test-{}-{n}", std::process::id());
        let ok = Command::new("tmux")
            .args(["-L", &socket, "-f", "/dev/null", "start-server"])
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Self { socket })
    }

    fn cmd(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("running tmux")
    }

    /// A window running `command` on a 100 × 30 terminal.
    fn window(&self, name: &str, command: &str) {
        let out = self.cmd(&[
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            "100",
            "-y",
            "30",
            command,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Everything on the window's screen and in its history.
    fn text(&self, name: &str) -> String {
        let out = self.cmd(&["capture-pane", "-p", "-J", "-S", "-5000", "-t", name]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, name: &str, text: &str) {
        let out = self.cmd(&["send-keys", "-t", name, "-l", text]);
        assert!(out.status.success());
        let out = self.cmd(&["send-keys", "-t", name, "Enter"]);
        assert!(out.status.success());
    }

    fn wait_for(&self, name: &str, needle: &str) -> String {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.text(name);
            if text.contains(needle) {
                return text;
            }
            assert!(
                Instant::now() < end,
                "{needle:?} never appeared in window {name}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn pane_pid(&self, name: &str) -> i32 {
        let out = self.cmd(&["list-panes", "-t", name, "-F", "#{pane_pid}"]);
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

/// The shells `roam status --json` lists for the relay with this state dir.
fn listed_shells(relay_state: &Path) -> Vec<serde_json::Value> {
    let out = Command::new(BIN)
        .env("ROAM_STATE_DIR", relay_state)
        .args(["status", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["shells"].as_array().cloned().unwrap_or_default())
        .collect()
}

#[test]
fn a_shell_survives_its_client_being_killed_and_shows_what_it_missed() {
    let Some(tmux) = Tmux::start() else {
        eprintln!("SKIP: tmux is not installed (apt-get install tmux)");
        return;
    };
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .unwrap()
        .unwrap()
        .name;
    let dir = tempfile::tempdir().unwrap();
    let (relay_state, alice, mallory, keys) = (
        dir.path().join("relay"),
        dir.path().join("alice"),
        dir.path().join("mallory"),
        dir.path().join("keys"),
    );
    for d in [&relay_state, &alice, &mallory, &keys] {
        std::fs::create_dir_all(d).unwrap();
    }
    let alice_key = keygen(&alice);
    keygen(&mallory);
    let key_file = keys.join(format!("{user}.keys"));
    std::fs::write(&key_file, format!("{alice_key}\n")).unwrap();
    let port = free_port();
    let relay_cmd = |takeover: bool| {
        let mut c = Command::new(BIN);
        c.env("ROAM_STATE_DIR", &relay_state)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--shell"])
            .arg("--shell-keys")
            .arg(keys.join("%u.keys"))
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(dir.path().join(format!("relay-{takeover}.log")))
                    .map_or_else(|_| Stdio::null(), Stdio::from),
            );
        if takeover {
            c.arg("--takeover");
        }
        c
    };
    // The relays' logs, for a failure's message.
    let logs = || {
        ["false", "true"]
            .iter()
            .map(|n| {
                std::fs::read_to_string(dir.path().join(format!("relay-{n}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n--- successor ---\n")
    };
    let mut relay = Guard(relay_cmd(false).spawn().unwrap());
    wait_for_port(port);
    let shell = |state: &Path, tail: &str| {
        format!(
            "ROAM_STATE_DIR={} {BIN} shell {user}@127.0.0.1:{port} --name work{tail}",
            state.display()
        )
    };

    // A new shell; a command's output.
    tmux.window("first", &format!("exec env {}", shell(&alice, "")));
    tmux.wait_for("first", "new shell \"work\"");
    tmux.keys("first", "echo hello-$((6*7))");
    tmux.wait_for("first", "hello-42");

    // The shell prints 300 lines starting a second from now; the client is
    // killed before, so every one of them is printed while nobody watches.
    tmux.keys(
        "first",
        "(sleep 1; seq 1 300 | sed s/^/line-/; echo all-done) &",
    );
    std::thread::sleep(Duration::from_millis(300));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(tmux.pane_pid("first")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(2));

    // A new client process re-attaches by name: every line is there,
    // once and in order, then the screen goes on live.
    tmux.window(
        "second",
        &format!("sh -c '{}; echo EXIT=$?; sleep 30'", shell(&alice, "")),
    );
    let text = tmux.wait_for("second", "all-done");
    assert!(text.contains("re-attached to shell \"work\""), "{text}");
    let lines: Vec<u32> = text
        .lines()
        .filter_map(|l| l.rsplit("line-").next().filter(|_| l.contains("line-")))
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    assert_eq!(lines, (1..=300).collect::<Vec<u32>>(), "{text}");

    // The window size follows the client's terminal.
    tmux.keys("second", "stty size");
    tmux.wait_for("second", "30 100");
    let out = tmux.cmd(&["resize-window", "-t", "second", "-x", "90", "-y", "25"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::thread::sleep(Duration::from_millis(300));
    tmux.keys("second", "stty size");
    tmux.wait_for("second", "25 90");

    // A shell that prints far more than anyone holds for a client that is
    // away (killed: its session waits, suspended, on the relay) never
    // blocks: it finishes while nobody is attached.
    let done = dir.path().join("big-done");
    tmux.keys(
        "second",
        &format!("(sleep 1; seq 1 1500000; touch {}) &", done.display()),
    );
    std::thread::sleep(Duration::from_millis(300));
    let pattern = format!("shell {user}@127.0.0.1:{port}");
    let killed = Command::new("pkill")
        .args(["-KILL", "-f", &pattern])
        .status()
        .unwrap();
    assert!(killed.success(), "no client to kill");
    let end = Instant::now() + Duration::from_secs(60);
    while !done.exists() {
        assert!(
            Instant::now() < end,
            "the shell blocked on a client that is away"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The next client gets the current screen; the shell's exit status is
    // the client's.
    tmux.window(
        "third",
        &format!("sh -c '{}; echo EXIT=$?; sleep 30'", shell(&alice, "")),
    );
    tmux.wait_for("third", "1500000");
    tmux.keys("third", "echo PID=$$=$((1+1))");
    let text = tmux.wait_for("third", "=2");
    let pid_of = |text: &str| {
        text.lines()
            .filter_map(|l| l.split("PID=").nth(1))
            .filter_map(|r| r.strip_suffix("=2"))
            .next_back()
            .map(str::to_string)
    };
    let pid = pid_of(&text).expect("the shell's pid");
    let shells = || listed_shells(&relay_state);
    let listed = shells();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], "work");
    assert_eq!(listed[0]["attached"], true);
    assert_eq!(listed[0]["pid"].to_string(), pid);

    // A relay upgrade while the client is attached: the new relay takes
    // the shell over (its pty, screen and scrollback) and the client
    // re-attaches by itself; the same shell process goes on.
    let _successor = Guard(relay_cmd(true).spawn().unwrap());
    let end = Instant::now() + Duration::from_secs(30);
    while relay.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < end, "the old relay never handed over");
        std::thread::sleep(Duration::from_millis(50));
    }
    tmux.keys("third", "echo after-$((2+3)) PID=$$=$((1+1))");
    let text = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tmux.wait_for("third", "after-5")
    }))
    .unwrap_or_else(|_| panic!("no output after the upgrade; relay logs:\n{}", logs()));
    assert_eq!(pid_of(&text).as_deref(), Some(pid.as_str()), "{text}");

    // The new relay is not the shell's parent: the exit is seen, its
    // status is not (the client says so and exits 0).
    tmux.keys("third", "exit 7");
    let text = tmux.wait_for("third", "EXIT=0");
    assert!(text.contains("exit status was lost"), "{text}");
    assert_eq!(
        shells(),
        Vec::<serde_json::Value>::new(),
        "the shell is gone"
    );
    let _ = &mut relay;

    // A key that is not in the account's file gets no shell.
    tmux.window(
        "mallory",
        &format!("sh -c '{}; echo EXIT=$?; sleep 30'", shell(&mallory, "")),
    );
    let text = tmux.wait_for("mallory", "EXIT=1");
    assert!(text.contains("refused the shell"), "{text}");
    assert!(text.contains("is not in"), "{text}");
}

/// `(rss KiB, descriptors, sockets, threads)` of a process, from `/proc`.
fn usage(pid: u32) -> (f64, usize, usize, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> usize {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let mut fds = 0;
    let mut sockets = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        fds += 1;
        if let Ok(t) = std::fs::read_link(e.unwrap().path()) {
            if t.to_string_lossy().starts_with("socket:") {
                sockets += 1;
            }
        }
    }
    (field("VmRSS:") as f64, fds, sockets, field("Threads:"))
}

/// A `roam shell` client on a pty of this test's own (no tmux): a thread
/// collects everything it prints; typed bytes go to the pty. The client is
/// killed when this is dropped.
struct PtyClient {
    child: Guard,
    master: std::fs::File,
    output: std::sync::mpsc::Receiver<Vec<u8>>,
    /// Everything the client printed so far.
    seen: Vec<u8>,
}

impl PtyClient {
    /// `roam shell TARGET EXTRA…` with its state in `state`, on a 30 × 120
    /// pty.
    fn start(state: &Path, target: &str, extra: &[&str]) -> Self {
        use std::io::Read;
        let size = nix::pty::Winsize {
            ws_row: 30,
            ws_col: 120,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(Some(&size), None).unwrap();
        let slave = || Stdio::from(pty.slave.try_clone().unwrap());
        let child = Guard(
            Command::new(BIN)
                .env("ROAM_STATE_DIR", state)
                .arg("shell")
                .arg(target)
                .args(extra)
                .stdin(slave())
                .stdout(slave())
                .stderr(slave())
                .spawn()
                .unwrap(),
        );
        drop(pty.slave);
        let master = std::fs::File::from(pty.master);
        let mut reader = master.try_clone().unwrap();
        let (tx, output) = std::sync::mpsc::channel();
        // Ends when the client's end of the pty is closed (EIO) or this
        // client is dropped.
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            master,
            output,
            seen: Vec::new(),
        }
    }

    /// Everything the client printed so far, as text.
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen).into_owned()
    }

    /// Waits (at most `limit`) until `found` finds something in what the
    /// client printed; panics with the text if it never does.
    fn wait_until<T>(&mut self, limit: Duration, found: impl Fn(&str) -> Option<T>) -> T {
        let end = Instant::now() + limit;
        loop {
            if let Some(t) = found(&self.text()) {
                return t;
            }
            let left = end.saturating_duration_since(Instant::now());
            match self.output.recv_timeout(left) {
                Ok(b) => self.seen.extend_from_slice(&b),
                Err(_) => panic!("not found in what the client printed:\n{}", self.text()),
            }
        }
    }

    /// Waits (at most 30 s) for `needle` in what the client printed.
    fn wait_for(&mut self, needle: &str) -> String {
        self.wait_until(Duration::from_secs(30), |t| {
            t.contains(needle).then(|| t.to_string())
        })
    }

    /// Types `bytes` on the client's terminal.
    fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.master.write_all(bytes).unwrap();
    }

    /// Waits (at most `limit`) for the client to exit; its exit code, or
    /// `None` if it is still running.
    fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let end = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.0.try_wait().unwrap() {
                return Some(st.code().unwrap_or(-1));
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A relay serving `/bin/sh` shells (small: a thousand fit anywhere) to
/// one client key, on a free port; its log in `dir/relay.log` if `log`.
struct ShRelay {
    relay: Guard,
    relay_state: std::path::PathBuf,
    /// The client's state directory (its key is the authorized one).
    client: std::path::PathBuf,
    /// `user@127.0.0.1:port`.
    target: String,
}

impl ShRelay {
    fn start(dir: &Path, log: bool) -> Self {
        let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
            .unwrap()
            .unwrap()
            .name;
        let (relay_state, client, keys) = (dir.join("relay"), dir.join("client"), dir.join("keys"));
        for d in [&relay_state, &client, &keys] {
            std::fs::create_dir_all(d).unwrap();
        }
        let key = keygen(&client);
        std::fs::write(keys.join(format!("{user}.keys")), format!("{key}\n")).unwrap();
        let port = free_port();
        let stderr = if log {
            Stdio::from(std::fs::File::create(dir.join("relay.log")).unwrap())
        } else {
            Stdio::null()
        };
        let relay = Guard(
            Command::new(BIN)
                .env("ROAM_STATE_DIR", &relay_state)
                .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--shell"])
                .arg("--shell-keys")
                .arg(keys.join("%u.keys"))
                .args(["--shell-program", "/bin/sh", "-v"])
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .unwrap(),
        );
        wait_for_port(port);
        ShRelay {
            relay,
            relay_state,
            client,
            target: format!("{user}@127.0.0.1:{port}"),
        }
    }
}

/// The `roam shell-worker` processes whose parent is `relay`.
fn workers_of(relay: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // After the command's name (in parentheses): state, then ppid.
        let mut rest = stat.rsplit(')').next().unwrap_or("").split_whitespace();
        let (state, ppid) = (rest.next(), rest.next().and_then(|p| p.parse::<u32>().ok()));
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid == Some(relay)
            && state != Some("Z")
            && String::from_utf8_lossy(&cmdline).contains("shell-worker")
        {
            out.push(pid);
        }
    }
    out
}

/// The worker pid `roam status` lists for the only shell, once there is
/// one other than `not` (at most 10 s).
fn listed_worker(relay_state: &Path, not: Option<u64>) -> u64 {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let shells = listed_shells(relay_state);
        let w = shells.first().and_then(|s| s["worker"].as_u64());
        if let Some(w) = w.filter(|w| Some(*w) != not) {
            return w;
        }
        assert!(Instant::now() < end, "no new worker listed: {shells:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `/proc/PID/status` of worker `pid`, once it runs `roam shell-worker`
/// (after `setpriv` has exec'd it; at most 10 s).
fn worker_status(pid: u64) -> String {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains("shell-worker") {
            return std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        }
        assert!(Instant::now() < end, "worker {pid} never ran shell-worker");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The numbers `N` of every `wk-N` in `text` (not `wk-N-end`), in order.
fn wk_lines(text: &str) -> Vec<u32> {
    text.match_indices("wk-")
        .filter_map(|(i, _)| {
            let rest = &text[i + 3..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let after = rest[digits.len()..].chars().next();
            (!digits.is_empty() && after != Some('-'))
                .then(|| digits.parse().ok())
                .flatten()
        })
        .collect()
}

/// The shell issue's "kill -9 of the per-session shell process, then
/// re-attach": while a client is attached its shell has a worker process
/// (`roam shell-worker`, a child of the relay, listed by `roam status`).
/// Killed with -9 in the middle of the shell's output, it is replaced at
/// once and the same client sees the output go on; after a detach there is
/// no worker left; a new client re-attaching gets every line printed, once
/// and in order, from the relay's journal of what the killed worker read.
/// A client killed with -9 leaves no worker either (its session is
/// suspended), and the next client takes the shell over.
#[test]
fn a_shell_worker_killed_mid_output_loses_no_line() {
    let dir = tempfile::tempdir().unwrap();
    let sh = ShRelay::start(dir.path(), true);
    let relay_pid = sh.relay.0.id();
    let log = || std::fs::read_to_string(dir.path().join("relay.log")).unwrap_or_default();
    let mut client = PtyClient::start(&sh.client, &sh.target, &["--name", "wk"]);
    client.wait_for("new shell");
    let first = listed_worker(&sh.relay_state, None);
    assert_eq!(
        workers_of(relay_pid),
        vec![first as u32],
        "the listed worker is the relay's child"
    );

    client
        .send(b"for i in $(seq 1 400); do echo wk-$i; sleep 0.005; done; echo wk-$((400+1))-end\r");
    client.wait_until(Duration::from_secs(30), |t| {
        (wk_lines(t).len() >= 50).then_some(())
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    client.wait_for("wk-401-end");
    let second = listed_worker(&sh.relay_state, Some(first));
    assert!(log().contains("ended while attached"), "{}", log());
    assert_eq!(
        workers_of(relay_pid),
        vec![second as u32],
        "one worker at a time"
    );

    // Detached: the shell is parked, with no worker.
    client.send(b"\r~.");
    assert_eq!(
        client.wait_exit(Duration::from_secs(30)),
        Some(0),
        "{}",
        client.text()
    );
    // The relay reaps the worker before `roam status` says the shell is
    // parked; a worker that has exited is a zombie until then, and not in
    // `workers_of`: wait for what the relay says, then look for workers.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let shells = listed_shells(&sh.relay_state);
        if shells[0]["attached"] == false && shells[0]["worker"].is_null() {
            break;
        }
        assert!(
            Instant::now() < end,
            "the shell is not parked: {shells:?}\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        workers_of(relay_pid),
        Vec::<u32>::new(),
        "a worker outlived its client"
    );

    // A new client: the scrollback and screen hold every line once.
    let mut again = PtyClient::start(&sh.client, &sh.target, &["--name", "wk"]);
    let text = again.wait_for("wk-401-end");
    assert!(text.contains("re-attached"), "{text}");
    assert_eq!(wk_lines(&text), (1..=400).collect::<Vec<u32>>(), "{text}");

    // A client killed with -9: its session is suspended on the relay, and
    // its shell's worker goes until the session resumes.
    listed_worker(&sh.relay_state, None);
    drop(again);
    // The relay logs the suspension once it has reaped the worker (which
    // is a zombie, not in `workers_of`, a moment before): wait for the log.
    let end = Instant::now() + Duration::from_secs(20);
    while !log().contains("session is suspended") {
        assert!(
            Instant::now() < end,
            "the client's session was never suspended (workers {:?})\n{}",
            workers_of(relay_pid),
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        workers_of(relay_pid),
        Vec::<u32>::new(),
        "a worker outlived its client's connection\n{}",
        log()
    );
    // Another client takes the shell over and it goes on.
    let mut third = PtyClient::start(&sh.client, &sh.target, &["--name", "wk"]);
    third.wait_for("wk-401-end");
    third.send(b"echo fin-$((2*21))\r");
    third.wait_for("fin-42");
}

/// The network drops while a client is attached, through a fault proxy:
/// every connection is reset and new ones are refused, so the client's
/// session is suspended on the relay (its worker goes, its stream waits).
/// The shell prints meanwhile, into the relay's parked terminal. When the
/// path is back the session resumes and the client, without typing
/// anything, is shown what was printed while it was away.
#[test]
fn a_shell_shows_what_it_printed_while_the_network_was_down() {
    let Some(tmux) = Tmux::start() else {
        eprintln!("SKIP: tmux is not installed (apt-get install tmux)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let sh = ShRelay::start(dir.path(), true);
    let log = || std::fs::read_to_string(dir.path().join("relay.log")).unwrap_or_default();
    let (user, relay_addr) = sh.target.split_once('@').unwrap();
    let proxy = roam_sim::proxy::FaultProxy::spawn(relay_addr.parse().unwrap()).unwrap();
    tmux.window(
        "blip",
        &format!(
            "exec env ROAM_STATE_DIR={} {BIN} shell {user}@{} --name blip",
            sh.client.display(),
            proxy.addr()
        ),
    );
    tmux.wait_for("blip", "new shell \"blip\"");
    listed_worker(&sh.relay_state, None);

    // The marker is printed once the test says so (the typed line does not
    // hold it), then `printed` is made.
    let (started, go, printed) = (
        dir.path().join("started"),
        dir.path().join("go"),
        dir.path().join("printed"),
    );
    tmux.keys(
        "blip",
        &format!(
            "touch {}; while [ ! -e {} ]; do sleep 0.05; done; echo MARK-$((40+2)); touch {}",
            started.display(),
            go.display(),
            printed.display()
        ),
    );
    // The shell runs the line (its echo on the client's screen is not
    // enough: tmux sends the Enter apart, and it may still be on its way
    // when the network is cut), and its echo is on the client's screen.
    let end = Instant::now() + Duration::from_secs(20);
    while !started.exists() {
        assert!(
            Instant::now() < end,
            "the shell never ran the line\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    tmux.wait_for("blip", "touch ");

    // The network goes: the relay suspends the client's session and stops
    // its worker (it logs that once the worker is reaped); the client's
    // re-dials are refused.
    proxy.refuse(true);
    proxy.reset_all();
    let end = Instant::now() + Duration::from_secs(30);
    while !log().contains("session is suspended") {
        assert!(
            Instant::now() < end,
            "the client's session was never suspended\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let shells = listed_shells(&sh.relay_state);
    assert!(shells[0]["worker"].is_null(), "{shells:?}");

    // The shell prints while nobody sees it: the relay reads it into the
    // shell's parked terminal.
    std::fs::write(&go, b"").unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    while !printed.exists() {
        assert!(Instant::now() < end, "the shell never printed\n{}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The relay reads a parked shell's pty as soon as it is readable; a
    // moment for that, so the marker is not still in the pty for the next
    // worker to read as live output.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !tmux.text("blip").contains("MARK-42"),
        "the client saw the marker through a cut network"
    );

    // The network is back: the client's session resumes, and its screen
    // shows the marker without anything typed.
    proxy.refuse(false);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tmux.wait_for("blip", "MARK-42")
    }))
    .unwrap_or_else(|_| {
        panic!(
            "what the shell printed while the network was down never reached the client\n\
             shells: {:?}\nproxy: {:?}\nrelay log:\n{}",
            listed_shells(&sh.relay_state),
            proxy.stats(),
            log()
        )
    });
    // And it goes on live.
    tmux.keys("blip", "echo after-$((6*7))");
    tmux.wait_for("blip", "after-42");
}

/// Starts a shell named `name` with a client on a pty of its own, waits
/// until it runs, and detaches the client (`~.`).
fn park_one(state: &Path, target: &str, name: &str) {
    let mut client = PtyClient::start(state, target, &["--name", name]);
    client.wait_for("new shell");
    client.send(b"~.");
    assert!(
        client.wait_exit(Duration::from_secs(30)).is_some(),
        "client of {name} did not detach"
    );
}

/// A thousand detached shells (item 5 of the shell issue): each costs the
/// relay its pty and child descriptors and a few KiB, and no socket or
/// thread; `roam status` lists them all as parked.
#[test]
fn a_thousand_parked_shells_cost_the_relay_a_few_kib_each() {
    const SHELLS: usize = 1000;
    let dir = tempfile::tempdir().unwrap();
    let ShRelay {
        relay,
        relay_state,
        client,
        target,
    } = ShRelay::start(dir.path(), false);
    let pid = relay.0.id();
    // One shell first, so that what every shell shares (buffers, tables)
    // is not counted against the thousand.
    park_one(&client, &target, "warm-up");
    std::thread::sleep(Duration::from_millis(300));
    let before = usage(pid);
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (client, target) = (client.clone(), target.clone());
            std::thread::spawn(move || {
                for i in (w..SHELLS).step_by(8) {
                    park_one(&client, &target, &format!("p-{i}"));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a client failed");
    }
    std::thread::sleep(Duration::from_millis(1000));
    let after = usage(pid);
    let per_shell_kib = (after.0 - before.0) / SHELLS as f64;
    let fds = (after.1 - before.1) as f64 / SHELLS as f64;
    eprintln!(
        "{SHELLS} parked shells: {per_shell_kib:.1} KiB and {fds:.2} descriptors each; sockets {} -> {}, threads {} -> {}",
        before.2, after.2, before.3, after.3
    );
    assert!(
        per_shell_kib < 32.0,
        "{per_shell_kib:.1} KiB per parked shell"
    );
    assert!(fds <= 3.0, "{fds} descriptors per parked shell");
    assert!(
        after.2 <= before.2 + 2,
        "sockets {} -> {}",
        before.2,
        after.2
    );
    assert!(
        after.3 <= before.3 + 2,
        "threads {} -> {}",
        before.3,
        after.3
    );
    let shells = listed_shells(&relay_state);
    assert_eq!(shells.len(), SHELLS + 1);
    assert!(shells.iter().all(|s| s["attached"] == false), "all parked");
    // No roam process of their own: each client's worker ended with it.
    assert_eq!(workers_of(pid), Vec::<u32>::new(), "workers left running");
    // Killing the relay closes the ptys: every shell gets SIGHUP and ends
    // (no shell holds another's pty master: they are close-on-exec).
    let pids: Vec<i32> = shells
        .iter()
        .map(|s| s["pid"].as_i64().unwrap() as i32)
        .collect();
    drop(relay);
    let end = Instant::now() + Duration::from_secs(20);
    let alive = |p: &i32| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|st| {
            st.rsplit(')')
                .next()
                .is_some_and(|r| !r.trim_start().starts_with('Z'))
        })
    };
    loop {
        let left = pids.iter().filter(|p| alive(p)).count();
        if left == 0 {
            break;
        }
        if Instant::now() > end {
            for p in pids.iter().filter(|p| alive(p)) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            panic!("{left} shells outlived their relay");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A system account made for one test (`useradd --system`, a group of its
/// own, a home under `parent`, `/bin/sh`), removed with its home and group
/// (`userdel -r`) when dropped, also when the test fails; any process still
/// running as it is killed first, by pid.
struct TempUser {
    name: String,
    /// Known once the account is looked up; `None` until then (nothing to
    /// kill).
    uid: Option<u32>,
    gid: u32,
    home: std::path::PathBuf,
}

impl TempUser {
    /// Creates the account: `roamt` and a suffix unique to this process and
    /// call (a name already taken is skipped).
    fn create(parent: &Path) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..5 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos();
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("roamt{:x}{:x}{:04x}", std::process::id(), n, nanos & 0xffff);
            if nix::unistd::User::from_name(&name).unwrap().is_some() {
                continue;
            }
            let home = parent.join(&name);
            let out = Command::new("useradd")
                .args([
                    "--system",
                    "--user-group",
                    "--create-home",
                    "--shell",
                    "/bin/sh",
                ])
                .arg("--home-dir")
                .arg(&home)
                .arg(&name)
                .output()
                .expect("running useradd");
            if !out.status.success() {
                // Not ours: nothing to remove.
                eprintln!(
                    "useradd {name}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                continue;
            }
            // From here on the account is removed whatever happens.
            let mut user = TempUser {
                name,
                uid: None,
                gid: 0,
                home,
            };
            let pw = nix::unistd::User::from_name(&user.name)
                .unwrap()
                .expect("the account just made");
            assert_ne!(pw.uid.as_raw(), 0, "useradd made a root account");
            user.uid = Some(pw.uid.as_raw());
            user.gid = pw.gid.as_raw();
            assert_eq!(pw.dir, user.home);
            return user;
        }
        panic!("could not make a test account with useradd");
    }

    fn uid(&self) -> u32 {
        self.uid.expect("looked up")
    }

    /// Writes `keys` as the account's roam authorized keys at the relay's
    /// default place (`~/.config/roam/authorized_keys`), owned by the
    /// account, mode 0600, as `Account::authorize` wants it.
    fn authorize(&self, keys: &str) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.home.join(".config/roam");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("authorized_keys");
        std::fs::write(&file, keys).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        for p in [self.home.join(".config"), dir, file.clone()] {
            std::os::unix::fs::chown(&p, self.uid, Some(self.gid)).unwrap();
        }
        file
    }

    /// Pids of the processes whose real or effective uid is `uid`.
    fn processes(uid: u32) -> Vec<i32> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|st| {
                    st.lines()
                        .find_map(|l| l.strip_prefix("Uid:"))
                        .is_some_and(|ids| {
                            ids.split_whitespace()
                                .take(2)
                                .any(|id| id == uid.to_string())
                        })
                })
            })
            .collect()
    }
}

impl Drop for TempUser {
    fn drop(&mut self) {
        if let Some(uid) = self.uid.filter(|&u| u != 0) {
            // A fresh account's processes are this test's, and userdel
            // refuses an account that still runs any.
            let end = Instant::now() + Duration::from_secs(10);
            loop {
                let left = Self::processes(uid);
                if left.is_empty() || Instant::now() > end {
                    break;
                }
                for pid in left {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        match Command::new("userdel").args(["-r", &self.name]).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "WARNING: userdel -r {} failed: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("WARNING: userdel -r {}: {e}", self.name),
        }
    }
}

/// A system group made for one test (`groupadd --system`), removed
/// (`groupdel`) when dropped, also when the test fails.
struct TempGroup {
    name: String,
    gid: u32,
}

impl TempGroup {
    /// Creates the group: `roamg` and a suffix unique to this process and
    /// call.
    fn create() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..5 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos();
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let name = format!("roamg{:x}{:x}{:04x}", std::process::id(), n, nanos & 0xffff);
            if nix::unistd::Group::from_name(&name).unwrap().is_some() {
                continue;
            }
            let out = Command::new("groupadd")
                .args(["--system", &name])
                .output()
                .expect("running groupadd");
            if !out.status.success() {
                eprintln!(
                    "groupadd {name}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                continue;
            }
            // From here on the group is removed whatever happens.
            let mut group = TempGroup { name, gid: 0 };
            group.gid = nix::unistd::Group::from_name(&group.name)
                .unwrap()
                .expect("the group just made")
                .gid
                .as_raw();
            assert_ne!(group.gid, 0, "groupadd made group 0");
            return group;
        }
        panic!("could not make a test group with groupadd");
    }

    /// Makes `user` a member (a supplementary group of theirs).
    fn add(&self, user: &str) {
        let out = Command::new("usermod")
            .args(["--append", "--groups", &self.name, user])
            .output()
            .expect("running usermod");
        assert!(
            out.status.success(),
            "usermod --append --groups {} {user}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
}

impl Drop for TempGroup {
    fn drop(&mut self) {
        match Command::new("groupdel").arg(&self.name).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "WARNING: groupdel {} failed: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("WARNING: groupdel {}: {e}", self.name),
        }
    }
}

/// Why this machine cannot run the account tests, if it cannot.
fn account_skip_reason() -> Option<&'static str> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root (the test makes a system account)");
    }
    let found = Command::new("useradd")
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    (!found).then_some("useradd is not installed (apt-get install passwd)")
}

/// What the shell says about itself (`printf` of the fields below), parsed
/// from a client's output; the command's own echo (with its `%s`) is
/// skipped.
#[derive(Debug, PartialEq)]
struct Identity {
    uid: String,
    gid: String,
    groups: String,
    home: String,
    user: String,
    logname: String,
    shell: String,
    cwd: String,
    /// The shell's effective capabilities (`CapEff` in `/proc`), hex.
    caps: String,
}

/// The command whose output [`Identity::parse`] reads.
const WHO_AM_I: &str = "printf 'ID[%s|%s|%s|%s|%s|%s|%s|%s|%s]\\n' \"$(id -u)\" \"$(id -g)\" \"$(id -G)\" \"$HOME\" \"$USER\" \"$LOGNAME\" \"$SHELL\" \"$(pwd)\" \"$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)\"";

impl Identity {
    fn parse(text: &str) -> Option<Self> {
        text.lines()
            .filter(|l| !l.contains("%s"))
            .filter_map(|l| l.split_once("ID[")?.1.split_once(']'))
            .map(|(fields, _)| fields.split('|').map(str::to_string).collect::<Vec<_>>())
            .find(|f| f.len() == 9)
            .map(|f| {
                let mut f = f.into_iter();
                let mut next = || f.next().unwrap();
                Identity {
                    uid: next(),
                    gid: next(),
                    groups: next(),
                    home: next(),
                    user: next(),
                    logname: next(),
                    shell: next(),
                    cwd: next(),
                    caps: next(),
                }
            })
    }
}

/// A relay running as root (here with supplementary groups 0 and 4, when
/// `setpriv` can give it those) starts a shell as the account the client
/// names: the account's uid and gid and its supplementary groups from
/// `/etc/group` (a throwaway group it is a member of) and none of the
/// relay's, no capability, its home as `HOME` and working directory, its
/// name as `USER` and `LOGNAME`, its login shell. The authorized keys are
/// at the default place (`~/.config/roam/authorized_keys`). The same client
/// key gets no shell as root or as another account whose file does not
/// list it, nor as its own account once that file, or a directory on its
/// way (`~/.config`, `~/.config/roam`, the home), is writable by others or
/// owned by someone else — the refusal names the directory and says why —
/// and gets one again once they are put right. Skips, saying why, unless
/// root with `useradd`.
#[test]
fn a_root_relay_starts_the_shell_as_the_named_account_and_only_for_its_keys() {
    if let Some(why) = account_skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // The accounts' homes: under a directory they may pass through (a
    // temporary directory is root's alone).
    let homes = tempfile::tempdir().unwrap();
    std::fs::set_permissions(homes.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let (relay_state, alice, bob) = (
        dir.path().join("relay"),
        dir.path().join("alice"),
        dir.path().join("bob"),
    );
    for d in [&relay_state, &alice, &bob] {
        std::fs::create_dir_all(d).unwrap();
    }
    let alice_key = keygen(&alice);
    let bob_key = keygen(&bob);
    let a = TempUser::create(homes.path());
    let b = TempUser::create(homes.path());
    let a_keys = a.authorize(&format!("{alice_key}\n"));
    b.authorize(&format!("{bob_key}\n"));
    // A supplementary group of a's, as an ssh login would get it.
    let extra = TempGroup::create();
    extra.add(&a.name);

    let port = free_port();
    let log = dir.path().join("relay.log");
    let setpriv = Command::new("setpriv")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let mut relay_cmd = if setpriv {
        let mut c = Command::new("setpriv");
        c.args(["--groups", "0,4", "--", BIN]);
        c
    } else {
        eprintln!("note: no setpriv; the relay has no supplementary groups to drop");
        Command::new(BIN)
    };
    let relay = Guard(
        relay_cmd
            .env("ROAM_STATE_DIR", &relay_state)
            .env_remove("RUST_LOG")
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--shell"])
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap(),
    );
    wait_for_port(port);
    if setpriv {
        let status = std::fs::read_to_string(format!("/proc/{}/status", relay.0.id())).unwrap();
        let groups = status.lines().find(|l| l.starts_with("Groups:")).unwrap();
        assert_eq!(
            groups.split_whitespace().skip(1).collect::<Vec<_>>(),
            ["0", "4"],
            "the relay's groups"
        );
    }
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();

    // Alice's key, in a's file: a shell as a.
    let mut client = PtyClient::start(&alice, &format!("{}@127.0.0.1:{port}", a.name), &[]);
    client.wait_for("new shell");
    client.send(format!("{WHO_AM_I}\r").as_bytes());
    let who = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        client.wait_until(Duration::from_secs(30), Identity::parse)
    }))
    .unwrap_or_else(|_| panic!("no answer from the shell; relay log:\n{}", logs()));
    eprintln!("the shell, as the relay started it: {who:?}");
    let groups: std::collections::BTreeSet<u32> = who
        .groups
        .split_whitespace()
        .map(|g| g.parse().unwrap())
        .collect();
    assert!(
        !groups.contains(&0) && !groups.contains(&4),
        "the relay's groups 0 and 4 leaked into the shell's: {who:?}"
    );
    assert_eq!(
        groups,
        [a.gid, extra.gid].into(),
        "the account's own group and its supplementary one, no other"
    );
    let home = a.home.display().to_string();
    assert_eq!(
        who,
        Identity {
            uid: a.uid().to_string(),
            gid: a.gid.to_string(),
            groups: who.groups.clone(),
            home: home.clone(),
            user: a.name.clone(),
            logname: a.name.clone(),
            shell: "/bin/sh".into(),
            cwd: home,
            caps: "0000000000000000".into(),
        },
        "{}",
        client.text()
    );
    let listed = listed_shells(&relay_state);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["user"], a.name.as_str(), "{listed:?}");
    // The shell's worker (the terminal emulator that parses everything the
    // shell prints) runs as the account too, with its groups and no
    // capability: never as the root relay.
    let worker = listed_worker(&relay_state, None);
    let status = worker_status(worker);
    let field = |name: &str| -> Vec<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in the worker's status:\n{status}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    let (uid, gid) = (a.uid().to_string(), a.gid.to_string());
    assert_eq!(field("Uid:"), vec![uid.clone(); 4], "the worker's uids");
    assert_eq!(field("Gid:"), vec![gid.clone(); 4], "the worker's gids");
    let worker_groups: std::collections::BTreeSet<u32> = field("Groups:")
        .iter()
        .map(|g| g.parse().unwrap())
        .collect();
    assert_eq!(
        worker_groups,
        [a.gid, extra.gid].into(),
        "the worker's groups"
    );
    assert_eq!(
        field("CapEff:"),
        ["0000000000000000"],
        "the worker's capabilities"
    );
    // The shell's exit status is the client's.
    client.send(b"exit 3\r");
    assert_eq!(
        client.wait_exit(Duration::from_secs(30)),
        Some(3),
        "{}",
        client.text()
    );

    // The same key, for accounts whose files do not list it: refused.
    let refused = |target: &str, why: &str| {
        let mut c = PtyClient::start(&alice, &format!("{target}@127.0.0.1:{port}"), &[]);
        let code = c.wait_exit(Duration::from_secs(30));
        c.wait_until(Duration::from_secs(5), |t| t.contains(why).then_some(()));
        let text = c.text();
        assert_eq!(code, Some(1), "{target}: {text}");
        assert!(text.contains("refused the shell"), "{target}: {text}");
    };
    refused("root", "root");
    refused(&b.name, "is not in");
    // Its own account's file, writable by the group; then owned by b.
    std::fs::set_permissions(&a_keys, std::fs::Permissions::from_mode(0o620)).unwrap();
    refused(&a.name, "writable by nobody else");
    std::fs::set_permissions(&a_keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&a_keys, b.uid, Some(b.gid)).unwrap();
    refused(&a.name, "must be owned by");
    std::os::unix::fs::chown(&a_keys, a.uid, Some(a.gid)).unwrap();
    // A directory on the way to it (sshd's StrictModes): `~/.config`
    // writable by its group, `~/.config/roam` by others, the home owned by
    // b; each refusal names the directory and what is wrong with it.
    let chmod = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    let config = a.home.join(".config");
    let roam_dir = config.join("roam");
    let on_the_way = |dir: &Path, what: &str| {
        format!(
            "the directory {} on the way to {} is {what}; each directory up to / must be owned by {:?} or root and writable by nobody else",
            dir.display(),
            a_keys.display(),
            a.name
        )
    };
    chmod(&config, 0o775);
    refused(
        &a.name,
        &on_the_way(&config, "writable by its group (mode 0775)"),
    );
    chmod(&config, 0o755);
    chmod(&roam_dir, 0o757);
    refused(
        &a.name,
        &on_the_way(&roam_dir, "writable by others (mode 0757)"),
    );
    chmod(&roam_dir, 0o755);
    std::os::unix::fs::chown(&a.home, b.uid, None).unwrap();
    refused(
        &a.name,
        &on_the_way(&a.home, &format!("owned by uid {} ({})", b.uid(), b.name)),
    );
    std::os::unix::fs::chown(&a.home, a.uid, None).unwrap();
    assert_eq!(
        listed_shells(&relay_state),
        Vec::<serde_json::Value>::new(),
        "no shell runs"
    );
    // Put right, the same key gets a shell again.
    let mut client = PtyClient::start(&alice, &format!("{}@127.0.0.1:{port}", a.name), &[]);
    client.wait_for("new shell");
    client.send(b"exit 4\r");
    assert_eq!(
        client.wait_exit(Duration::from_secs(30)),
        Some(4),
        "{}",
        client.text()
    );
    drop(relay);
}

/// A shell whose account cannot enter its home starts anyway, in `/`, and
/// its terminal says why first, as sshd's "Could not chdir to home
/// directory": a home the account may not search (root's, mode 0700) and
/// a home that is gone, from a relay running as root (which checks as the
/// account, with `setpriv`), and a home that is gone from a relay running
/// as the account itself. `HOME` is still the home. The keys are outside
/// the home (`--shell-keys`), so the client is authorized all along.
/// Skips, saying why, unless root with `useradd`.
#[test]
fn a_shell_whose_home_cannot_be_entered_starts_in_root_saying_why() {
    if let Some(why) = account_skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // Homes, keys and the unprivileged relay's state: under a directory
    // the account may pass through.
    let homes = tempfile::tempdir().unwrap();
    std::fs::set_permissions(homes.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let (relay_state, alice) = (dir.path().join("relay"), dir.path().join("alice"));
    for d in [&relay_state, &alice] {
        std::fs::create_dir_all(d).unwrap();
    }
    let alice_key = keygen(&alice);
    let c = TempUser::create(homes.path());
    let keys = homes.path().join("keys");
    std::fs::create_dir(&keys).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o755)).unwrap();
    let key_file = keys.join(format!("{}.keys", c.name));
    std::fs::write(&key_file, format!("{alice_key}\n")).unwrap();
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o644)).unwrap();

    // A relay: as root, or (`as_account`) as c, with setpriv.
    let relay = |port: u16, state: &Path, as_account: bool| {
        let mut cmd = if as_account {
            let mut c_cmd = Command::new("setpriv");
            c_cmd
                .arg(format!("--reuid={}", c.uid()))
                .arg(format!("--regid={}", c.gid))
                .args(["--clear-groups", "--", BIN]);
            c_cmd
        } else {
            Command::new(BIN)
        };
        let log = dir.path().join(format!("relay-{as_account}.log"));
        Guard(
            cmd.env("ROAM_STATE_DIR", state)
                .env("HOME", state)
                .env_remove("RUST_LOG")
                .env_remove("XDG_CONFIG_HOME")
                .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--shell"])
                .arg("--shell-keys")
                .arg(keys.join("%u.keys"))
                .stdout(Stdio::null())
                .stderr(Stdio::from(std::fs::File::create(log).unwrap()))
                .spawn()
                .unwrap(),
        )
    };
    // A shell as c through the relay on `port`: the notice its client
    // printed first, and where the shell is.
    let shell = |port: u16| {
        let mut client = PtyClient::start(&alice, &format!("{}@127.0.0.1:{port}", c.name), &[]);
        client.wait_for("new shell");
        client.send(format!("{WHO_AM_I}\r").as_bytes());
        let who = client.wait_until(Duration::from_secs(30), Identity::parse);
        let text = client.text();
        client.send(b"exit 5\r");
        assert_eq!(client.wait_exit(Duration::from_secs(30)), Some(5), "{text}");
        (text, who)
    };
    let home = c.home.display().to_string();
    let check = |port: u16, why: &str| {
        let (text, who) = shell(port);
        let notice = format!("Could not chdir to home directory {home}: {why}; starting in /");
        assert!(text.contains(&notice), "no {notice:?} in:\n{text}");
        assert_eq!(who.cwd, "/", "{text}");
        assert_eq!(who.home, home, "{text}");
        assert_eq!(who.uid, c.uid().to_string(), "{text}");
    };

    let port = free_port();
    let root_relay = relay(port, &relay_state, false);
    wait_for_port(port);
    // The home as it is: the shell starts there, with nothing to say.
    let (text, who) = shell(port);
    assert_eq!(who.cwd, home, "{text}");
    assert!(!text.contains("Could not chdir"), "{text}");

    // Root's, mode 0700: c may not enter it.
    std::fs::set_permissions(&c.home, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&c.home, Some(0), Some(0)).unwrap();
    check(port, "Permission denied");
    std::os::unix::fs::chown(&c.home, c.uid, Some(c.gid)).unwrap();

    // Gone (moved away; back before the account is removed).
    let away = homes.path().join(format!("{}.away", c.name));
    std::fs::rename(&c.home, &away).unwrap();
    check(port, "No such file or directory");
    drop(root_relay);

    // A relay running as c, its home still gone: it checks by itself.
    let c_state = homes.path().join("c-relay");
    std::fs::create_dir(&c_state).unwrap();
    std::os::unix::fs::chown(&c_state, c.uid, Some(c.gid)).unwrap();
    let port = free_port();
    let c_relay = relay(port, &c_state, true);
    wait_for_port(port);
    check(port, "No such file or directory");
    drop(c_relay);
    std::fs::rename(&away, &c.home).unwrap();
}

/// A root relay whose binary the account may not execute (a copy in a
/// directory only root may enter) cannot run the shell's worker as the
/// account, so it refuses the shell up front, naming the account and the
/// binary and saying how to fix it, instead of starting a shell whose
/// workers die at start. Skips, saying why, unless root with `useradd`.
#[test]
fn a_root_relay_the_account_cannot_execute_refuses_its_shell_saying_why() {
    if let Some(why) = account_skip_reason() {
        eprintln!("SKIP: {why}");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let homes = tempfile::tempdir().unwrap();
    std::fs::set_permissions(homes.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let (relay_state, alice) = (dir.path().join("relay"), dir.path().join("alice"));
    for d in [&relay_state, &alice] {
        std::fs::create_dir_all(d).unwrap();
    }
    let alice_key = keygen(&alice);
    let a = TempUser::create(homes.path());
    a.authorize(&format!("{alice_key}\n"));
    // The relay's binary, where only root may go.
    let private = dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let bin = private.join("roam");
    std::fs::copy(BIN, &bin).unwrap();
    let port = free_port();
    let log = dir.path().join("relay.log");
    let relay = Guard(
        Command::new(&bin)
            .env("ROAM_STATE_DIR", &relay_state)
            .env_remove("RUST_LOG")
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--shell"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap(),
    );
    wait_for_port(port);
    let mut c = PtyClient::start(&alice, &format!("{}@127.0.0.1:{port}", a.name), &[]);
    let code = c.wait_exit(Duration::from_secs(30));
    let why = format!("user {:?} cannot execute {}", a.name, bin.display());
    c.wait_until(Duration::from_secs(5), |t| t.contains(&why).then_some(()));
    let text = c.text();
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("refused the shell"), "{text}");
    assert!(text.contains("/usr/local/bin"), "no advice in: {text}");
    assert!(
        listed_shells(&relay_state).is_empty(),
        "a shell was started"
    );
    drop(relay);
}
