//! A throwaway OpenSSH server for tests: Debian's `/usr/sbin/sshd` on a test
//! port, with a host key, a user key and a config that live in a temporary
//! directory, so nothing of the machine's own ssh setup is read or changed.
//!
//! [`PrivateSshd::start`] runs `sshd -D -e -f <tmp>/sshd_config` on the
//! loopback or inside one side of a [`NetPair`], waits until it listens, and
//! kills it on drop. [`PrivateSshd::ssh_command`] builds the matching client
//! command line (`ssh -F /dev/null -i <key> ... root@host`), optionally through
//! a `ProxyCommand` such as `roam pipe`.
//!
//! Needs root (sshd logs in as root with the throwaway key) and the Debian
//! packages `openssh-server` and `openssh-client`; [`available`] says what
//! is missing.

use std::io::{self, BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use crate::netns::{ChildGuard, NetPair, Side};

/// Debian's sshd.
pub const SSHD: &str = "/usr/sbin/sshd";
/// How long [`PrivateSshd::start`] waits for "Server listening".
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// Checks for root, `sshd`, `ssh` and `ssh-keygen`; the error names the
/// missing piece and the package that brings it.
pub fn available() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("the private sshd fixture needs root".into());
    }
    if !Path::new(SSHD).exists() {
        return Err(format!("{SSHD} missing: apt-get install openssh-server"));
    }
    for tool in ["ssh", "ssh-keygen"] {
        // Only whether it runs matters; `-?` prints usage and exits non-zero.
        let run = Command::new(tool)
            .arg("-?")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if run.is_err() {
            return Err(format!("`{tool}` missing: apt-get install openssh-client"));
        }
    }
    Ok(())
}

/// A free port on 127.0.0.1 for sshd ([`crate::ports::free_loopback_port`]).
pub fn free_loopback_port() -> io::Result<u16> {
    crate::ports::free_loopback_port()
}

fn keygen(path: &Path, comment: &str) -> io::Result<()> {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(path)
        .stdin(Stdio::null())
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ssh-keygen failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// A running throwaway sshd. See the [module docs](self).
#[derive(Debug)]
pub struct PrivateSshd {
    addr: SocketAddr,
    /// Host key, user key, authorized_keys, config, pid file, known_hosts.
    dir: tempfile::TempDir,
    /// Lines sshd wrote to stderr so far (its log, thanks to `-e`).
    log: Arc<Mutex<Vec<String>>>,
    /// Declared last: the process is killed before the directory is removed.
    _child: ChildGuard,
}

impl PrivateSshd {
    /// Starts sshd listening on `addr` (a concrete IP and port: sshd has no
    /// port 0), on the loopback of this namespace (`place` = `None`) or inside
    /// `place`'s namespace. Returns once sshd reports it is listening.
    pub fn start(place: Option<(&NetPair, Side)>, addr: SocketAddr) -> io::Result<PrivateSshd> {
        let dir = tempfile::Builder::new().prefix("roam-sshd-").tempdir()?;
        let d = dir.path();
        keygen(&d.join("host_ed25519"), "roam-test-host")?;
        keygen(&d.join("user_ed25519"), "roam-test-user")?;
        std::fs::copy(d.join("user_ed25519.pub"), d.join("authorized_keys"))?;
        // The privilege-separation directory sshd insists on.
        std::fs::create_dir_all("/run/sshd")?;
        let listen = match addr.ip() {
            IpAddr::V6(ip) => format!("[{ip}]"),
            IpAddr::V4(ip) => ip.to_string(),
        };
        let config = format!(
            "# Throwaway sshd for roam tests; everything it reads is in this directory.\n\
             ListenAddress {listen}\n\
             Port {port}\n\
             HostKey {dir}/host_ed25519\n\
             PidFile {dir}/sshd.pid\n\
             AuthorizedKeysFile {dir}/authorized_keys\n\
             StrictModes no\n\
             UsePAM no\n\
             PermitRootLogin prohibit-password\n\
             PubkeyAuthentication yes\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             UseDNS no\n\
             PrintMotd no\n\
             PrintLastLog no\n\
             LoginGraceTime 30\n\
             MaxStartups 64\n\
             LogLevel INFO\n",
            port = addr.port(),
            dir = d.display(),
        );
        let config_path = d.join("sshd_config");
        std::fs::write(&config_path, config)?;

        let mut cmd = match place {
            Some((pair, side)) => pair.command(side, SSHD),
            None => Command::new(SSHD),
        };
        cmd.arg("-D").arg("-e").arg("-f").arg(&config_path);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = ChildGuard::spawn(&mut cmd)?;

        let log = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        let stderr = child.stderr.take().expect("stderr is piped");
        let log2 = log.clone();
        thread::Builder::new()
            .name("sshd-log".into())
            .spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if line.contains("Server listening on") {
                        let _ = ready_tx.send(());
                    }
                    log2.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            })?;
        match ready_rx.recv_timeout(START_TIMEOUT) {
            Ok(()) => Ok(PrivateSshd {
                addr,
                dir,
                log,
                _child: child,
            }),
            Err(_) => {
                let status = child.wait_timeout(Duration::from_millis(200))?;
                let text = log.lock().unwrap_or_else(|e| e.into_inner()).join("\n");
                Err(io::Error::other(format!(
                    "sshd did not start listening on {addr} (exit: {status:?}); log:\n{text}"
                )))
            }
        }
    }

    /// Where sshd listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The throwaway user's private key (authorized for root).
    pub fn user_key(&self) -> PathBuf {
        self.dir.path().join("user_ed25519")
    }

    /// The temporary directory holding keys, config and known_hosts.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// sshd's log so far, one line per entry.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// An `ssh` client command logging in as root to this sshd with the
    /// throwaway key, ignoring every user or system ssh config, in batch mode.
    /// With `proxy_command`, ssh talks through it instead of connecting
    /// itself (`%h` and `%p` expand to this sshd's address and port). Append
    /// the remote command as arguments.
    pub fn ssh_command(&self, proxy_command: Option<&str>) -> Command {
        let mut c = Command::new("ssh");
        c.args(["-F", "/dev/null", "-i"]).arg(self.user_key());
        c.arg("-o").arg(format!(
            "UserKnownHostsFile={}",
            self.dir.path().join("known_hosts").display()
        ));
        c.args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=15",
            // roam keeps the session; ssh's own keepalives would add a
            // second, shorter liveness deadline on top of it.
            "-o",
            "ServerAliveInterval=0",
            "-o",
            "TCPKeepAlive=no",
        ]);
        if let Some(pc) = proxy_command {
            c.arg("-o").arg(format!("ProxyCommand={pc}"));
        }
        c.arg("-p").arg(self.addr.port().to_string());
        c.arg(format!("root@{}", self.addr.ip()));
        c
    }
}
