//! Child processes and small system helpers: process-group guards that kill
//! on drop, free loopback ports, readiness polling, RSS, file limits.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// A long-lived child (socat, sshd's client, `roam serve`, ...) started in a
/// process group of its own. Dropping it kills the whole group (socat forks a
/// child per connection) and reaps the leader.
pub(crate) struct Proc {
    name: String,
    pid: u32,
    /// Behind a mutex so a shared `&Proc` can check liveness (`try_wait`).
    child: std::sync::Mutex<Child>,
}

impl Proc {
    /// Spawns `cmd` in a new process group; stdin is null, stdout and stderr
    /// go to `log` (a file in the run's temporary directory) if given.
    pub(crate) fn spawn(name: &str, cmd: &mut Command, log: Option<&Path>) -> io::Result<Proc> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0).stdin(Stdio::null());
        match log {
            Some(path) => {
                let f = std::fs::File::create(path)?;
                cmd.stdout(f.try_clone()?).stderr(f);
            }
            None => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        let child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start {name}: {e}")))?;
        Ok(Proc {
            name: name.to_string(),
            pid: child.id(),
            child: std::sync::Mutex::new(child),
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Fails if the process has already exited (it should be serving).
    pub(crate) fn check_alive(&self) -> io::Result<()> {
        let mut child = self.child.lock().unwrap_or_else(|e| e.into_inner());
        match child.try_wait()? {
            None => Ok(()),
            Some(st) => Err(io::Error::other(format!(
                "{} exited unexpectedly ({st})",
                self.name
            ))),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A port on 127.0.0.1 that was free a moment ago. Racy by nature; fine for
/// programs (sshd, socat, `roam serve`) that cannot report a port 0 choice.
pub(crate) fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// `127.0.0.1:port`.
pub(crate) fn lo(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// Waits until `addr` accepts a TCP connection (the probe connection is
/// closed at once), checking that `proc` is still alive meanwhile.
pub(crate) async fn wait_listening(
    addr: SocketAddr,
    proc: &Proc,
    timeout: Duration,
) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        proc.check_alive()?;
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{} did not listen on {addr} within {timeout:?}", proc.name),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Resident set size of `pid`, in bytes (`VmRSS` of `/proc/PID/status`).
pub(crate) fn rss_bytes(pid: u32) -> io::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::other(format!("no VmRSS for pid {pid}")))
}

/// Raises this process's open-file limit (inherited by every child) so that
/// 10,000 sessions, their proxies and their targets fit. Root may raise the
/// hard limit; otherwise the soft limit goes up to the hard one. Returns the
/// soft limit now in force.
pub(crate) fn raise_nofile(wanted: u64) -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return 0;
    };
    if soft >= wanted {
        return soft;
    }
    if setrlimit(Resource::RLIMIT_NOFILE, wanted, wanted.max(hard)).is_ok() {
        return wanted;
    }
    let target = wanted.min(hard);
    if setrlimit(Resource::RLIMIT_NOFILE, target, hard).is_ok() {
        return target;
    }
    soft
}

/// Runs `program args` and returns the first non-empty line of its output
/// (stdout, else stderr), for tool versions in the report.
pub(crate) fn version_line(program: &str, args: &[&str]) -> String {
    match Command::new(program).args(args).output() {
        Ok(out) => {
            let text = if out.stdout.iter().any(|b| !b.is_ascii_whitespace()) {
                out.stdout
            } else {
                out.stderr
            };
            String::from_utf8_lossy(&text)
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("")
                .to_string()
        }
        Err(e) => format!("unavailable ({e})"),
    }
}
