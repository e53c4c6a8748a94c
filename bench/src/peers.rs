//! The peers roam is measured against, each an external process started and
//! killed by the harness, all on 127.0.0.1:
//!
//! | peer | path of one connection |
//! |---|---|
//! | `direct` | client → target (the physical limit) |
//! | `socat` | client → `socat` relay → target |
//! | `socat2` | client → `socat` relay → second `socat` relay → target |
//! | `ssh-L` | client → `ssh -L` → private `sshd` → target |
//! | `roam-forward` | client → `roam forward` → `roam serve` → target |
//! | `roam-pipe` | client → `roam pipe` (stdin/stdout) → `roam serve` → target |
//! | `roam-pipe-named` | as `roam-pipe`, with `--name` (the session journaled to survive `kill -9`) |
//! | `roam-session` | a stream of a library session in the harness → `roam serve` → target |
//!
//! `socat`, `roam-session` and `direct`'s neighbours differ in hops on
//! purpose: `socat` and `roam-session` cross one relay process (compare them),
//! `socat2`, `ssh-L`, `roam-forward` and `roam-pipe` cross two (a process
//! next to the client and one next to the target; compare those).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::task::{Context, Poll};
use std::time::Duration;

use roam_sim::sshd::PrivateSshd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::agent::Agent;
use crate::load::{self, Conn};
use crate::procs::{free_port, lo, wait_listening, Proc};

/// The cipher the `ssh -L` peer uses (OpenSSH's fastest on AES-NI machines).
pub(crate) const SSH_CIPHER: &str = "aes128-gcm@openssh.com";
/// How long a peer process may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Peer names, as they appear in the results.
pub(crate) const DIRECT: &str = "direct";
pub(crate) const SOCAT: &str = "socat";
pub(crate) const SSH: &str = "ssh-L";
pub(crate) const ROAM_FORWARD: &str = "roam-forward";
pub(crate) const ROAM_PIPE: &str = "roam-pipe";
pub(crate) const ROAM_PIPE_NAMED: &str = "roam-pipe-named";
pub(crate) const SOCAT2: &str = "socat2";
pub(crate) const ROAM_SESSION: &str = "roam-session";

/// Where a run keeps its scratch files and which binaries it drives.
pub(crate) struct Env {
    /// Scratch directory (keys, state dirs, logs), removed at the end.
    pub(crate) dir: PathBuf,
    /// The `roam` binary under test.
    pub(crate) roam: PathBuf,
    /// This binary, for agents.
    pub(crate) me: PathBuf,
}

impl Env {
    pub(crate) fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// State dir for roam clients (pipe, forward) and for the relay.
    pub(crate) fn client_state(&self) -> PathBuf {
        self.dir.join("roam-client-state")
    }

    pub(crate) fn relay_state(&self) -> PathBuf {
        self.dir.join("roam-relay-state")
    }

    /// A `roam` command with its own state dir and no user configuration.
    pub(crate) fn roam_cmd(&self, state: &Path) -> Command {
        let mut c = Command::new(&self.roam);
        self.roam_env(&mut c, state);
        c
    }

    /// Gives `c` (a `roam` command, or one that runs `roam` inside a
    /// network namespace) the state dir `state` and no user configuration.
    pub(crate) fn roam_env(&self, c: &mut Command, state: &Path) {
        c.env("ROAM_STATE_DIR", state)
            .env("XDG_CONFIG_HOME", self.dir.join("xdg-config"))
            .env_remove("RUST_LOG");
    }
}

/// How to open one connection to the target through a peer.
#[derive(Clone)]
pub(crate) enum Dial {
    /// A TCP connection to this address (target, socat, ssh -L, roam forward).
    Tcp(SocketAddr),
    /// A process whose stdin/stdout carry the connection (`roam pipe`, `ssh -W`, `socat STDIO`).
    Process {
        program: PathBuf,
        args: Vec<String>,
        envs: Vec<(String, PathBuf)>,
        log: PathBuf,
    },
    /// A new stream of a library session living in this process, to `target`.
    Session {
        session: roam::SessionHandle,
        target: String,
    },
}

/// A peer under its result name.
#[derive(Clone)]
pub(crate) struct Peer {
    pub(crate) name: &'static str,
    pub(crate) dial: Dial,
}

impl Peer {
    /// Opens a connection to the target. `nodelay` applies to our own TCP
    /// socket (latency tests set it; bulk tests keep Nagle, like bulk apps).
    pub(crate) async fn connect(&self, nodelay: bool) -> io::Result<Conn> {
        Ok(self.connect_pid(nodelay).await?.0)
    }

    /// As [`Peer::connect`], and the pid of the process carrying the
    /// connection when the dial started one (`roam pipe`, `ssh -W`, ...),
    /// for CPU accounting.
    pub(crate) async fn connect_pid(&self, nodelay: bool) -> io::Result<(Conn, Option<u32>)> {
        match &self.dial {
            Dial::Tcp(a) => Ok((load::tcp(*a, nodelay).await?, None)),
            Dial::Session { session, target } => {
                let s = session
                    .open_stream(target.as_bytes())
                    .map_err(io::Error::other)?;
                Ok((Box::new(s), None))
            }
            Dial::Process {
                program,
                args,
                envs,
                log,
            } => {
                let err = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)?;
                let mut cmd = tokio::process::Command::new(program);
                cmd.args(args)
                    .env_remove("RUST_LOG")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(err)
                    .kill_on_drop(true);
                for (k, v) in envs {
                    cmd.env(k, v);
                }
                let mut child = cmd.spawn().map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot start {}: {e}", program.display()))
                })?;
                let pid = child.id();
                let stdin = child.stdin.take();
                let stdout = child
                    .stdout
                    .take()
                    .ok_or_else(|| io::Error::other("no stdout"))?;
                let c: Conn = Box::new(ProcessConn {
                    child: Some(child),
                    stdin,
                    stdout,
                });
                Ok((c, pid))
            }
        }
    }
}

/// A connection carried by a child's stdin (our writes) and stdout (our
/// reads). Shutting down closes stdin. Dropping closes stdin too and gives
/// the child [`PROCESS_EXIT_GRACE`] to finish on its own (a `roam pipe`
/// closes its session gracefully on end-of-file, so the relay does not keep
/// a suspended session for days), then kills it.
struct ProcessConn {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    stdout: ChildStdout,
}

/// How long a dropped connection's process may take to exit by itself.
const PROCESS_EXIT_GRACE: Duration = Duration::from_secs(5);

impl Drop for ProcessConn {
    fn drop(&mut self) {
        self.stdin = None;
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if tokio::time::timeout(PROCESS_EXIT_GRACE, child.wait())
                    .await
                    .is_err()
                {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
            });
        }
        // Without a runtime the child is killed as it drops (`kill_on_drop`).
    }
}

impl AsyncRead for ProcessConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stdout).poll_read(cx, buf)
    }
}

impl AsyncWrite for ProcessConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.stdin.as_mut() {
            Some(w) => Pin::new(w).poll_write(cx, data),
            None => Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.stdin.as_mut() {
            Some(w) => Pin::new(w).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Closing the pipe is the child's end-of-file.
        self.stdin = None;
        Poll::Ready(Ok(()))
    }
}

/// The target server process.
pub(crate) struct Targets {
    /// The process; killed when dropped.
    _agent: Agent,
    pub(crate) addr: SocketAddr,
}

impl Targets {
    pub(crate) fn pid(&self) -> u32 {
        self._agent.pid()
    }

    pub(crate) async fn start(env: &Env) -> io::Result<Targets> {
        let mut agent = Agent::spawn(&env.me, &["targets"], &env.log("agents"))?;
        let addr = agent.addr().await?;
        Ok(Targets {
            _agent: agent,
            addr,
        })
    }
}

/// A socat relay: `socat TCP-LISTEN:P,fork,reuseaddr TCP:target`.
pub(crate) struct Socat {
    proc: Proc,
    pub(crate) addr: SocketAddr,
}

/// socat's options on both legs: `nodelay` (as roam and ssh set on theirs).
pub(crate) const SOCAT_OPTS: &str = "nodelay";

impl Socat {
    pub(crate) async fn start(env: &Env, target: SocketAddr, name: &str) -> io::Result<Socat> {
        let port = free_port()?;
        let mut cmd = Command::new("socat");
        // -t: after one side's end-of-file, wait this long for the other
        // direction (the sink's count) before exiting; default 0.5 s.
        cmd.args(["-t", "30"])
            .arg(format!(
                "TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr,backlog=4096,{SOCAT_OPTS}"
            ))
            .arg(format!("TCP:{target},{SOCAT_OPTS}"));
        let proc = Proc::spawn(name, &mut cmd, Some(&env.log(name)))?;
        wait_listening(lo(port), &proc, START_TIMEOUT).await?;
        Ok(Socat {
            proc,
            addr: lo(port),
        })
    }
}

/// Two socat relays in a chain: client → `a` → `b` → target (two hops, as
/// `roam forward` → `roam serve` and `ssh -L` → sshd).
pub(crate) struct Socat2 {
    pub(crate) a: Socat,
    pub(crate) b: Socat,
}

impl Socat2 {
    pub(crate) async fn start(env: &Env, target: SocketAddr) -> io::Result<Socat2> {
        let b = Socat::start(env, target, "socat2-b").await?;
        let a = Socat::start(env, b.addr, "socat2-a").await?;
        Ok(Socat2 { a, b })
    }
}

/// The private sshd and an `ssh -N -L` tunnel through it.
pub(crate) struct Ssh {
    /// Declared first: the tunnel dies before its server.
    tunnel: Proc,
    pub(crate) sshd: PrivateSshd,
    pub(crate) addr: SocketAddr,
}

/// The `ssh` arguments every use shares: throwaway key, no config, no host
/// key checks, the benchmark cipher.
pub(crate) fn ssh_base_args(sshd: &PrivateSshd) -> Vec<String> {
    let mut a: Vec<String> = vec!["-F".into(), "/dev/null".into(), "-i".into()];
    a.push(sshd.user_key().display().to_string());
    for o in [
        "StrictHostKeyChecking=no",
        "UserKnownHostsFile=/dev/null",
        "GlobalKnownHostsFile=/dev/null",
        "BatchMode=yes",
        "IdentitiesOnly=yes",
        "LogLevel=ERROR",
        "Compression=no",
    ] {
        a.push("-o".into());
        a.push(o.into());
    }
    a.push("-c".into());
    a.push(SSH_CIPHER.into());
    a.push("-p".into());
    a.push(sshd.addr().port().to_string());
    a
}

impl Ssh {
    pub(crate) async fn start(env: &Env, target: SocketAddr) -> io::Result<Ssh> {
        roam_sim::sshd::available().map_err(io::Error::other)?;
        let sshd_port = free_port()?;
        let sshd = tokio::task::spawn_blocking(move || PrivateSshd::start(None, lo(sshd_port)))
            .await
            .map_err(io::Error::other)??;
        let port = free_port()?;
        let mut cmd = Command::new("ssh");
        cmd.args(ssh_base_args(&sshd))
            .args(["-N", "-o", "ExitOnForwardFailure=yes", "-L"])
            .arg(format!("127.0.0.1:{port}:{target}"))
            .arg(format!("root@{}", sshd.addr().ip()));
        let proc = Proc::spawn("ssh -L", &mut cmd, Some(&env.log("ssh")))?;
        wait_listening(lo(port), &proc, START_TIMEOUT).await?;
        Ok(Ssh {
            tunnel: proc,
            sshd,
            addr: lo(port),
        })
    }

    /// `ssh -W target`: a new ssh connection per use, stdio-forwarded.
    pub(crate) fn stdio_peer(&self, env: &Env, name: &'static str, target: SocketAddr) -> Peer {
        let mut args = ssh_base_args(&self.sshd);
        args.push("-W".into());
        args.push(target.to_string());
        args.push(format!("root@{}", self.sshd.addr().ip()));
        Peer {
            name,
            dial: Dial::Process {
                program: "ssh".into(),
                args,
                envs: Vec::new(),
                log: env.log("ssh-W"),
            },
        }
    }
}

/// The caps of the run's `roam serve` (its defaults allow 128 sessions per
/// address and key and 256 targets per session). Within this machine's
/// 20,000 open files: 2,048 connections + 12,000 targets + reserve.
pub(crate) const LAB_SERVE_CAPS: &[&str] = &[
    "--max-connections",
    "2048",
    "--max-sessions",
    "16384",
    "--max-sessions-per-ip",
    "16384",
    "--max-sessions-per-key",
    "16384",
    "--max-targets",
    "12000",
    "--max-targets-per-session",
    "12000",
];

/// `roam serve` on a free port, allowing the target only.
pub(crate) struct RoamServe {
    pub(crate) proc: Proc,
    pub(crate) addr: SocketAddr,
    pub(crate) state: PathBuf,
}

impl RoamServe {
    pub(crate) async fn start(env: &Env, allow: &[SocketAddr]) -> io::Result<RoamServe> {
        let state = env.relay_state();
        std::fs::create_dir_all(&state)?;
        let port = free_port()?;
        let mut cmd = env.roam_cmd(&state);
        // Info level: the relay's per-stream "ended: <error>" lines explain
        // a reset, and a failing scenario prints them (see `diagnose`).
        cmd.arg("-v")
            .arg("serve")
            .arg("--listen")
            .arg(lo(port).to_string())
            .arg("--key")
            .arg(state.join("server.key"));
        for a in allow {
            cmd.arg("--allow").arg(a.to_string());
        }
        // Caps raised so the scenarios fit: 1,000 sessions from one address
        // and key (many), 10,000 streams in one session (resume).
        cmd.args(LAB_SERVE_CAPS);
        let proc = Proc::spawn("roam serve", &mut cmd, Some(&env.log("roam-serve")))?;
        wait_listening(lo(port), &proc, START_TIMEOUT).await?;
        Ok(RoamServe {
            proc,
            addr: lo(port),
            state,
        })
    }

    /// The relay's control socket (`roam status` reads the same).
    pub(crate) fn control_socket(&self) -> PathBuf {
        self.state
            .join("control")
            .join(format!("{}.sock", self.proc.pid()))
    }

    /// `roam pipe` through this relay to `target`, one process per connection.
    pub(crate) fn pipe_peer(&self, env: &Env, name: &'static str, target: SocketAddr) -> Peer {
        Peer {
            name,
            dial: Dial::Process {
                program: env.roam.clone(),
                args: vec![
                    "pipe".into(),
                    "--no-fallback".into(),
                    self.addr.to_string(),
                    target.to_string(),
                ],
                envs: vec![
                    ("ROAM_STATE_DIR".into(), env.client_state()),
                    ("XDG_CONFIG_HOME".into(), env.dir.join("xdg-config")),
                ],
                log: env.log("roam-pipe"),
            },
        }
    }

    /// `roam pipe --name` through this relay to `target`, one process per
    /// connection, each under a name of its own (its pid): a named session
    /// keeps its journal, whose cost this peer shows against `roam-pipe`.
    pub(crate) fn named_pipe_peer(
        &self,
        env: &Env,
        name: &'static str,
        target: SocketAddr,
    ) -> Peer {
        Peer {
            name,
            dial: Dial::Process {
                program: "/bin/sh".into(),
                args: vec![
                    "-c".into(),
                    "exec \"$0\" pipe --name \"bench-$$\" \"$1\" \"$2\"".into(),
                    env.roam.to_string_lossy().into_owned(),
                    self.addr.to_string(),
                    target.to_string(),
                ],
                envs: vec![
                    ("ROAM_STATE_DIR".into(), env.client_state()),
                    ("XDG_CONFIG_HOME".into(), env.dir.join("xdg-config")),
                ],
                log: env.log("roam-pipe-named"),
            },
        }
    }
}

/// `roam forward` through a relay.
pub(crate) struct RoamForward {
    pub(crate) proc: Proc,
    pub(crate) addr: SocketAddr,
}

impl RoamForward {
    pub(crate) async fn start(
        env: &Env,
        relay: SocketAddr,
        target: SocketAddr,
    ) -> io::Result<RoamForward> {
        let port = free_port()?;
        let mut cmd = env.roam_cmd(&env.client_state());
        cmd.arg("forward")
            .arg(relay.to_string())
            .arg(lo(port).to_string())
            .arg(target.to_string());
        let proc = Proc::spawn("roam forward", &mut cmd, Some(&env.log("roam-forward")))?;
        wait_listening(lo(port), &proc, START_TIMEOUT).await?;
        Ok(RoamForward {
            proc,
            addr: lo(port),
        })
    }
}

/// Every peer process of the relayed scenarios, started once per run.
pub(crate) struct Lab {
    pub(crate) targets: Targets,
    pub(crate) socat: Socat,
    pub(crate) socat2: Socat2,
    pub(crate) ssh: Ssh,
    pub(crate) serve: RoamServe,
    pub(crate) forward: RoamForward,
    /// The `roam-session` peer: a library session to `serve`, in this process.
    pub(crate) session: roam::SessionHandle,
}

impl Lab {
    pub(crate) async fn start(env: &Env, config: roam::ClientConfig) -> io::Result<Lab> {
        std::fs::create_dir_all(env.client_state())?;
        std::fs::create_dir_all(env.dir.join("xdg-config"))?;
        // One client key for every roam client, made before any of them runs
        // (concurrent first runs would race to create it).
        let st = env
            .roam_cmd(&env.client_state())
            .arg("keygen")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !st.success() {
            return Err(io::Error::other(format!("roam keygen failed ({st})")));
        }
        let targets = Targets::start(env).await?;
        let socat = Socat::start(env, targets.addr, "socat").await?;
        let socat2 = Socat2::start(env, targets.addr).await?;
        let ssh = Ssh::start(env, targets.addr).await?;
        let serve = RoamServe::start(env, &[targets.addr]).await?;
        // forward pins the relay's key on first use; pipes then find it pinned.
        let forward = RoamForward::start(env, serve.addr, targets.addr).await?;
        let session = roam::connect(&serve.addr.to_string(), config)
            .await
            .map_err(|e| io::Error::other(format!("library session to roam serve: {e}")))?;
        Ok(Lab {
            targets,
            socat,
            socat2,
            session,
            ssh,
            serve,
            forward,
        })
    }

    /// The peers of the throughput and latency scenarios, in a fixed order.
    pub(crate) fn stream_peers(&self, env: &Env) -> Vec<Peer> {
        vec![
            Peer {
                name: DIRECT,
                dial: Dial::Tcp(self.targets.addr),
            },
            Peer {
                name: SOCAT,
                dial: Dial::Tcp(self.socat.addr),
            },
            Peer {
                name: SOCAT2,
                dial: Dial::Tcp(self.socat2.a.addr),
            },
            Peer {
                name: SSH,
                dial: Dial::Tcp(self.ssh.addr),
            },
            Peer {
                name: ROAM_FORWARD,
                dial: Dial::Tcp(self.forward.addr),
            },
            self.serve.pipe_peer(env, ROAM_PIPE, self.targets.addr),
            self.serve
                .named_pipe_peer(env, ROAM_PIPE_NAMED, self.targets.addr),
            Peer {
                name: ROAM_SESSION,
                dial: Dial::Session {
                    session: self.session.clone(),
                    target: self.targets.addr.to_string(),
                },
            },
        ]
    }

    /// The long-lived processes whose CPU time a peer's traffic costs (their
    /// trees, see [`crate::procs::tree_cpu_seconds`]): socat's listener (and
    /// the child it forks per connection), both socats of `socat2`, `ssh -L`
    /// and the private sshd (with the session processes it forks), `roam
    /// forward` and `roam serve`. `roam pipe` adds its per-connection process
    /// (see [`Peer::connect_pid`]); `roam-session` adds the harness's own
    /// share (see the throughput scenario). Nothing for `direct`: only the
    /// load generator and the target touch its bytes, and they are the same
    /// for every peer.
    pub(crate) fn cpu_roots(&self, peer: &str) -> Vec<u32> {
        match peer {
            SOCAT => vec![self.socat.proc.pid()],
            SOCAT2 => vec![self.socat2.a.proc.pid(), self.socat2.b.proc.pid()],
            SSH => {
                let mut v = vec![self.ssh.tunnel.pid()];
                v.extend(
                    std::fs::read_to_string(self.ssh.sshd.dir().join("sshd.pid"))
                        .ok()
                        .and_then(|t| t.trim().parse::<u32>().ok()),
                );
                v
            }
            ROAM_FORWARD => vec![self.forward.proc.pid(), self.serve.proc.pid()],
            ROAM_PIPE | ROAM_PIPE_NAMED | ROAM_SESSION => vec![self.serve.proc.pid()],
            _ => Vec::new(),
        }
    }

    /// Fails if a peer process died.
    pub(crate) fn check_alive(&self) -> io::Result<()> {
        self.socat.proc.check_alive()?;
        self.socat2.a.proc.check_alive()?;
        self.socat2.b.proc.check_alive()?;
        self.ssh.tunnel.check_alive()?;
        self.serve.proc.check_alive()?;
        self.forward.proc.check_alive()
    }
}

/// Peer order for round `round`: rotated, so that each peer runs first,
/// last and in between equally often and drift cancels out of the medians.
pub(crate) fn order(n: usize, round: usize) -> Vec<usize> {
    (0..n).map(|i| (i + round) % n.max(1)).collect()
}
