//! Scenario 9: interactive shells — `roam shell` against `ssh` and `mosh`,
//! each client on a real pseudo-terminal this process reads, all on
//! loopback in the same run.
//!
//! - **Keystroke echo latency**: one character typed at the shell prompt
//!   until the terminal shows it (the remote line editor echoes it), `n`
//!   times per peer (p50, p99).
//! - **Re-attach**: the shell starts printing `lines` numbered lines, the
//!   client is killed with -9 before the first one, and a new client process
//!   re-attaches: the time from starting it until the last line is on its
//!   terminal, and how many of the lines printed while nobody watched reach
//!   the new terminal. `roam shell --name` re-attaches by name; for ssh the
//!   usual answer is tmux on the server (`ssh -t host tmux new -A -s NAME`,
//!   then `tmux attach`), which redraws only the screen; mosh cannot
//!   re-attach once its client process is gone (its session key died with
//!   it), so it has no figure there.

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::progress;
use crate::peers::{ssh_base_args, Lab};
use crate::procs::{free_port, lo, wait_listening, Proc};
use crate::stats::{summary, Summary};
use crate::Ctx;

/// Terminal size every client gets.
const ROWS: u16 = 30;
const COLS: u16 = 100;
/// Longest wait for one expected output.
const WAIT: Duration = Duration::from_secs(20);

/// One client's figures.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) peer: String,
    /// Keystroke to echo (µs); `None` if the peer could not run.
    pub(crate) echo_us: Option<Summary>,
    /// Starting a new client until the last line printed while away is on
    /// its terminal (ms); `None`: the peer cannot re-attach.
    pub(crate) reattach_ms: Option<Summary>,
    /// Of the lines printed while no client was attached, how many reached
    /// the new client's terminal (the screen and its scrollback).
    pub(crate) lines_kept: Option<usize>,
    /// Why a figure is missing.
    pub(crate) note: Option<String>,
}

/// What detached (parked) shells cost the relay: `roam shell` clients
/// each start a shell and detach (`~.`), leaving it running with no client
/// and no session. Per parked shell, from the relay's `/proc` before and
/// after.
#[derive(Debug, Serialize)]
pub(crate) struct Parked {
    pub(crate) shells: usize,
    /// Relay RSS per parked shell (KiB).
    pub(crate) rss_kib_per_shell: f64,
    /// Relay descriptors per parked shell.
    pub(crate) fds_per_shell: f64,
    /// Relay threads added in all (tasks are not threads: one task per shell).
    pub(crate) threads_added: i64,
    /// Sockets the relay holds after they all detached, minus before.
    pub(crate) sockets_added: i64,
    /// RSS of one shell process (KiB, the median), for scale.
    pub(crate) shell_rss_kib: f64,
}

/// The scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct ShellBench {
    pub(crate) keystrokes: usize,
    pub(crate) lines: usize,
    pub(crate) reattach_rounds: usize,
    pub(crate) rows: Vec<Row>,
    pub(crate) parked: Option<Parked>,
}

/// `(rss KiB, descriptors, sockets, threads)` of a process.
fn proc_usage(pid: u32) -> io::Result<(f64, i64, i64, i64)> {
    let rss = crate::procs::rss_bytes(pid)? as f64 / 1024.0;
    let mut fds = 0;
    let mut sockets = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        fds += 1;
        if let Ok(t) = std::fs::read_link(e?.path()) {
            if t.to_string_lossy().starts_with("socket:") {
                sockets += 1;
            }
        }
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Ok((rss, fds, sockets, threads))
}

/// A client on a pseudo-terminal; everything it writes is collected.
struct Term {
    master: std::fs::File,
    seen: Arc<(Mutex<Vec<u8>>, Condvar)>,
    child: Child,
}

impl Term {
    fn spawn(cmd: &mut Command) -> io::Result<Term> {
        let size = nix::pty::Winsize {
            ws_row: ROWS,
            ws_col: COLS,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(&size, None).map_err(io::Error::from)?;
        let slave = |p: &OwnedFd| p.try_clone().map(Stdio::from);
        cmd.stdin(slave(&pty.slave)?)
            .stdout(slave(&pty.slave)?)
            .stderr(slave(&pty.slave)?)
            .env("TERM", "xterm")
            .env("LANG", "C.UTF-8")
            .env("LC_ALL", "C.UTF-8");
        let child = cmd.spawn()?;
        drop(pty.slave);
        let master = std::fs::File::from(pty.master);
        let seen = Arc::new((Mutex::new(Vec::new()), Condvar::new()));
        let mut rd = master.try_clone()?;
        let s = seen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n) = rd.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let (m, c) = &*s;
                m.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]);
                c.notify_all();
            }
        });
        Ok(Term {
            master,
            seen,
            child,
        })
    }

    fn len(&self) -> usize {
        self.seen.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.master.write_all(bytes)
    }

    /// Waits until `needle` appears in the output from byte `from` on.
    fn wait_for(&self, from: usize, needle: &[u8], limit: Duration) -> io::Result<()> {
        let end = Instant::now() + limit;
        let (m, c) = &*self.seen;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let start = from.min(g.len());
            if g[start..].windows(needle.len()).any(|w| w == needle) {
                return Ok(());
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{:?} never appeared; the terminal's last bytes: {:?}",
                        String::from_utf8_lossy(needle),
                        String::from_utf8_lossy(&g[g.len().saturating_sub(300)..])
                    ),
                ));
            }
            g = c.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Runs `line` at the prompt and waits for `marker` in its output.
    fn run(&mut self, line: &str, marker: &str) -> io::Result<()> {
        let from = self.len();
        self.send(format!("{line}\r").as_bytes())?;
        self.wait_for(from, marker.as_bytes(), WAIT)
    }

    /// Waits for a prompt that runs commands.
    fn ready(&mut self) -> io::Result<()> {
        self.run("echo READY-$((40+2))", "READY-42")
    }

    /// `n` keystrokes, each until its echo (µs); the line is erased after.
    fn echo_latency(&mut self, n: usize) -> io::Result<Vec<f64>> {
        let mut v = Vec::with_capacity(n);
        for k in 0..n {
            let c = b'a' + (k % 26) as u8;
            let from = self.len();
            let t = Instant::now();
            self.send(&[c])?;
            self.wait_for(from, &[c], WAIT)?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
            if k % 50 == 49 {
                self.send(&[0x15])?; // ^U: erase the line
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.send(&[0x15])?;
        Ok(v)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Numbered lines `line-1` … `line-n` that reached the terminal.
    fn lines_kept(&self, n: usize) -> usize {
        let text = self.text();
        let mut seen = std::collections::BTreeSet::new();
        for part in text.split("line-").skip(1) {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(i) = digits.parse::<usize>() {
                seen.insert(i);
            }
        }
        (1..=n).filter(|i| seen.contains(i)).count()
    }
}

impl Drop for Term {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The command that makes a shell print `lines` lines, starting 1 s later
/// (after the client is killed), then `all-done`.
fn print_later(lines: usize) -> String {
    format!("(sleep 1; seq 1 {lines} | sed s/^/line-/; echo all-$((0))-done) &")
}

/// `roam shell`: its own relay with `--shell`, a fresh client key.
async fn roam_row(
    ctx: Arc<Ctx>,
    n: usize,
    lines: usize,
    rounds: usize,
    parked: usize,
) -> io::Result<(Row, Option<Parked>)> {
    let dir = ctx.env.dir.join("shell-scenario");
    let (relay_state, client_state, keys) =
        (dir.join("relay"), dir.join("client"), dir.join("keys"));
    for d in [&relay_state, &client_state, &keys] {
        std::fs::create_dir_all(d)?;
    }
    let out = ctx.env.roam_cmd(&client_state).arg("keygen").output()?;
    let key = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .ok()
        .flatten()
        .map_or_else(|| "root".to_string(), |u| u.name);
    std::fs::write(keys.join(format!("{user}.keys")), format!("{key}\n"))?;
    let port = free_port()?;
    let mut cmd = ctx.env.roam_cmd(&relay_state);
    cmd.args(["serve", "--listen", &lo(port).to_string(), "--shell"])
        .arg("--shell-keys")
        .arg(keys.join("%u.keys"));
    let relay = Proc::spawn(
        "roam serve --shell (shell scenario)",
        &mut cmd,
        Some(&ctx.env.log("shell-relay")),
    )?;
    wait_listening(lo(port), &relay, Duration::from_secs(20)).await?;
    let c2 = ctx.clone();
    let client = move |name: &str| {
        let mut c = c2.env.roam_cmd(&client_state);
        c.args(["shell", &format!("{user}@{}", lo(port)), "--name", name]);
        c
    };
    let relay_pid = relay.pid();
    tokio::task::spawn_blocking(move || {
        let mut t = Term::spawn(&mut client("echo"))?;
        t.ready()?;
        let echo = t.echo_latency(n)?;
        drop(t);
        let mut reattach = Vec::new();
        let mut kept = lines;
        for round in 0..rounds {
            let name = format!("away-{round}");
            let mut first = Term::spawn(&mut client(&name))?;
            first.ready()?;
            first.run(&print_later(lines), "seq 1")?;
            first.kill();
            std::thread::sleep(Duration::from_millis(1500));
            let t = Instant::now();
            let second = Term::spawn(&mut client(&name))?;
            second.wait_for(0, b"all-0-done", WAIT)?;
            reattach.push(t.elapsed().as_secs_f64() * 1e3);
            kept = kept.min(second.lines_kept(lines));
        }
        let row = Row {
            peer: "roam shell".into(),
            echo_us: Some(summary(&echo)),
            reattach_ms: Some(summary(&reattach)),
            lines_kept: Some(kept),
            note: None,
        };
        if parked == 0 {
            return Ok((row, None));
        }
        // Let the shells and sessions above settle, then park `parked` more.
        std::thread::sleep(Duration::from_millis(500));
        let before = proc_usage(relay_pid)?;
        let mut shell_rss = Vec::new();
        for i in 0..parked {
            let mut t = Term::spawn(&mut client(&format!("parked-{i}")))?;
            t.ready()?;
            if i % 50 == 0 {
                // The shell's own size: a child of the relay's `setsid`.
                t.run("echo RSS=$(ps -o rss= -p $$)=$((1+1))-END", "=2-END")?;
                let text = t.text();
                if let Some(v) = text
                    .rsplit("RSS=")
                    .next()
                    .and_then(|r| r.split('=').next())
                    .and_then(|v| v.trim().parse::<f64>().ok())
                {
                    shell_rss.push(v);
                }
            }
            t.send(b"\r~.")?;
            let end = Instant::now() + WAIT;
            while t.child.try_wait()?.is_none() {
                if Instant::now() > end {
                    return Err(io::Error::other("a shell client did not detach on ~."));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            if (i + 1) % 100 == 0 {
                progress(&format!("shell: {} shells parked", i + 1));
            }
        }
        std::thread::sleep(Duration::from_millis(1000));
        let after = proc_usage(relay_pid)?;
        let k = parked as f64;
        Ok((
            row,
            Some(Parked {
                shells: parked,
                rss_kib_per_shell: (after.0 - before.0) / k,
                fds_per_shell: (after.1 - before.1) as f64 / k,
                threads_added: after.3 - before.3,
                sockets_added: after.2 - before.2,
                shell_rss_kib: summary(&shell_rss).median,
            }),
        ))
    })
    .await
    .map_err(io::Error::other)?
}

/// `ssh -tt` to the lab's private sshd; re-attach through tmux there.
fn ssh_row(lab: &Lab, n: usize, lines: usize, rounds: usize) -> io::Result<Row> {
    let base = ssh_base_args(&lab.ssh.sshd);
    let addr = lab.ssh.sshd.addr();
    let ssh = |remote: &[&str]| {
        let mut c = Command::new("ssh");
        c.args(&base)
            .arg("-tt")
            .arg("-p")
            .arg(addr.port().to_string())
            .arg(format!("root@{}", addr.ip()))
            .args(remote);
        c
    };
    let mut t = Term::spawn(&mut ssh(&[]))?;
    t.ready()?;
    let echo = t.echo_latency(n)?;
    drop(t);
    if Command::new("tmux").arg("-V").output().is_err() {
        return Ok(Row {
            peer: "ssh".into(),
            echo_us: Some(summary(&echo)),
            reattach_ms: None,
            lines_kept: None,
            note: Some("tmux is not installed: no re-attach figure".into()),
        });
    }
    let socket = format!("roam-bench-{}", std::process::id());
    let mut reattach = Vec::new();
    let mut kept = lines;
    for round in 0..rounds {
        let name = format!("away-{round}");
        let mut first = Term::spawn(&mut ssh(&["tmux", "-L", &socket, "new", "-A", "-s", &name]))?;
        first.ready()?;
        first.run(&print_later(lines), "seq 1")?;
        first.kill();
        std::thread::sleep(Duration::from_millis(1500));
        let t = Instant::now();
        let second = Term::spawn(&mut ssh(&["tmux", "-L", &socket, "attach", "-t", &name]))?;
        second.wait_for(0, b"all-0-done", WAIT)?;
        reattach.push(t.elapsed().as_secs_f64() * 1e3);
        kept = kept.min(second.lines_kept(lines));
    }
    let _ = Command::new("tmux")
        .args(["-L", &socket, "kill-server"])
        .output();
    Ok(Row {
        peer: "ssh + tmux".into(),
        echo_us: Some(summary(&echo)),
        reattach_ms: Some(summary(&reattach)),
        lines_kept: Some(kept),
        note: Some("echo through plain ssh -tt; re-attach with tmux on the server".into()),
    })
}

/// `mosh` through the lab's private sshd (echo only: it cannot re-attach).
fn mosh_row(lab: &Lab, n: usize) -> io::Result<Row> {
    if Command::new("mosh-server")
        .arg("--version")
        .output()
        .is_err()
    {
        return Ok(Row {
            peer: "mosh".into(),
            echo_us: None,
            reattach_ms: None,
            lines_kept: None,
            note: Some("mosh is not installed (apt-get install mosh)".into()),
        });
    }
    let addr = lab.ssh.sshd.addr();
    let mut ssh = String::from("ssh");
    for a in ssh_base_args(&lab.ssh.sshd) {
        ssh.push(' ');
        ssh.push_str(&a);
    }
    ssh.push_str(&format!(" -p {}", addr.port()));
    let mut cmd = Command::new("mosh");
    cmd.arg(format!("--ssh={ssh}"))
        .arg("--predict=never")
        .arg(format!("root@{}", addr.ip()));
    let mut t = Term::spawn(&mut cmd)?;
    t.ready()?;
    let echo = t.echo_latency(n)?;
    Ok(Row {
        peer: "mosh".into(),
        echo_us: Some(summary(&echo)),
        reattach_ms: None,
        lines_kept: None,
        note: Some(
            "local echo prediction off (it would show a guess, not the shell's echo); cannot re-attach after its client is killed"
                .into(),
        ),
    })
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<ShellBench> {
    let n = ctx.plan.shell_keystrokes;
    let rounds = ctx.plan.shell_rounds;
    let lines = 300;
    progress(&format!(
        "shell: roam shell, {n} keystrokes, {rounds} re-attaches"
    ));
    let (roam, parked) = roam_row(ctx.clone(), n, lines, rounds, ctx.plan.shell_parked).await?;
    progress("shell: ssh");
    let l = lab.clone();
    let ssh = tokio::task::spawn_blocking(move || ssh_row(&l, n, lines, rounds))
        .await
        .map_err(io::Error::other)??;
    progress("shell: mosh");
    let l = lab.clone();
    let mosh = tokio::task::spawn_blocking(move || mosh_row(&l, n))
        .await
        .map_err(io::Error::other)?
        .unwrap_or_else(|e| Row {
            peer: "mosh".into(),
            echo_us: None,
            reattach_ms: None,
            lines_kept: None,
            note: Some(format!("mosh failed: {e}")),
        });
    Ok(ShellBench {
        keystrokes: n,
        lines,
        reattach_rounds: rounds,
        rows: vec![roam, ssh, mosh],
        parked,
    })
}
