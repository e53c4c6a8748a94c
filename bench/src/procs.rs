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

/// Asks a roam process's control socket (`<state>/control/<pid>.sock`, as
/// `roam status` does) for its status: one request line
/// `{"op":"status"}`, then the JSON reply until end-of-file.
pub(crate) async fn control_status(
    path: &Path,
    timeout: Duration,
) -> io::Result<serde_json::Value> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut sock = tokio::net::UnixStream::connect(path).await?;
        sock.write_all(b"{\"op\":\"status\"}\n").await?;
        let mut text = Vec::new();
        sock.read_to_end(&mut text).await?;
        serde_json::from_slice::<serde_json::Value>(&text).map_err(io::Error::other)
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| io::Error::other(format!("{}: no answer", path.display())))?
}

/// Clock ticks per second of `/proc/PID/stat` times (`getconf CLK_TCK`,
/// 100 on Linux when it cannot be asked).
fn clk_tck() -> f64 {
    static T: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|v: &f64| *v > 0.0)
            .unwrap_or(100.0)
    })
}

/// One process's line of `/proc/PID/stat`: parent pid, its own CPU ticks
/// (utime + stime) and the CPU ticks of its children it has reaped
/// (cutime + cstime).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StatCpu {
    pub(crate) ppid: u32,
    pub(crate) own_ticks: u64,
    pub(crate) reaped_children_ticks: u64,
}

/// Parses the text of `/proc/PID/stat` (the command name may hold spaces
/// and parentheses, so fields are counted after the last `)`).
pub(crate) fn parse_stat(text: &str) -> Option<StatCpu> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state): field k is f[k - 3].
    let n = |k: usize| f.get(k - 3).and_then(|v| v.parse::<u64>().ok());
    Some(StatCpu {
        ppid: u32::try_from(n(4)?).ok()?,
        own_ticks: n(14)? + n(15)?,
        reaped_children_ticks: n(16)? + n(17)?,
    })
}

/// CPU seconds used so far by the processes `roots` and all their live
/// descendants (each one's utime + stime), plus what the children they
/// reaped had used (cutime + cstime): everything the process trees consumed,
/// as the kernel accounts it, except children that exited unreaped or were
/// reaped by a process outside the trees. Missing roots count 0.
pub(crate) fn tree_cpu_seconds(roots: &[u32]) -> f64 {
    if roots.is_empty() {
        return 0.0;
    }
    let mut procs: Vec<(u32, StatCpu)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(st) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|t| parse_stat(&t))
            {
                procs.push((pid, st));
            }
        }
    }
    let parent: std::collections::HashMap<u32, u32> =
        procs.iter().map(|(p, s)| (*p, s.ppid)).collect();
    let in_tree = |mut pid: u32| {
        for _ in 0..64 {
            if roots.contains(&pid) {
                return true;
            }
            match parent.get(&pid) {
                Some(&pp) if pp != 0 && pp != pid => pid = pp,
                _ => return false,
            }
        }
        false
    };
    let ticks: u64 = procs
        .iter()
        .filter(|(p, _)| in_tree(*p))
        .map(|(_, s)| s.own_ticks + s.reaped_children_ticks)
        .sum();
    ticks as f64 / clk_tck()
}

/// CPU seconds (utime + stime) this process has used, all threads, not its
/// children.
pub(crate) fn self_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|t| parse_stat(&t))
        .map_or(f64::NAN, |s| s.own_ticks as f64 / clk_tck())
}

/// `/proc/net/netstat` and `/proc/net/snmp` counters (`TcpExt:TCPBacklogDrop`,
/// `Tcp:RetransSegs`, ...), as `Group:Name` → value. Both files come in
/// pairs of lines: names, then values.
pub(crate) fn net_counters() -> std::collections::BTreeMap<String, u64> {
    let mut m = std::collections::BTreeMap::new();
    for path in ["/proc/net/netstat", "/proc/net/snmp"] {
        if let Ok(text) = std::fs::read_to_string(path) {
            parse_net_counters(&text, &mut m);
        }
    }
    m
}

pub(crate) fn parse_net_counters(text: &str, m: &mut std::collections::BTreeMap<String, u64>) {
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.chunks(2) {
        let [names, values] = pair else { continue };
        let (Some((g1, names)), Some((g2, values))) =
            (names.split_once(':'), values.split_once(':'))
        else {
            continue;
        };
        if g1 != g2 {
            continue;
        }
        for (n, v) in names.split_whitespace().zip(values.split_whitespace()) {
            if let Ok(v) = v.parse::<u64>() {
                m.insert(format!("{g1}:{n}"), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let t =
            "4242 (a (b) c) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 9 3 20 0 1 0 100 1000 10";
        assert_eq!(
            parse_stat(t),
            Some(StatCpu {
                ppid: 17,
                own_ticks: 325,
                reaped_children_ticks: 12
            })
        );
    }

    #[test]
    fn own_cpu_and_trees_are_readable() {
        assert!(self_cpu_seconds() >= 0.0);
        assert!(tree_cpu_seconds(&[std::process::id()]) >= 0.0);
        assert_eq!(tree_cpu_seconds(&[]), 0.0);
    }

    #[test]
    fn net_counters_pair_names_and_values() {
        let text =
            "TcpExt: SyncookiesSent TCPBacklogDrop\nTcpExt: 0 7\nIpExt: InOctets\nIpExt: 99\n";
        let mut m = std::collections::BTreeMap::new();
        parse_net_counters(text, &mut m);
        assert_eq!(m.get("TcpExt:TCPBacklogDrop"), Some(&7));
        assert_eq!(m.get("IpExt:InOctets"), Some(&99));
    }
}
