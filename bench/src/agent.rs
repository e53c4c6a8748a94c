//! Helper processes: this same binary run as `roam-bench agent ...`, so that
//! a target server, a library relay and a many-session client each have a
//! process (and an RSS) of their own. The parent talks to an agent through
//! its stdin and stdout, one line per command and per answer. Scenario 11's
//! measuring client is an agent too: `roam run` starts it as the program
//! it interposes on, and it prints its figures as one line of JSON.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Subcommand;
use roam::SessionHandle;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::load;

/// Copy buffer per direction in the library relay, as `roam serve` uses (bytes).
const RELAY_COPY_BUF: usize = 64 * 1024;
/// Sessions the many-session client connects at once.
const CONNECT_CONCURRENCY: usize = 64;

/// The agent roles.
#[derive(Debug, Subcommand)]
pub(crate) enum AgentCmd {
    /// Target server (sink, source, echo) on 127.0.0.1:0; prints `addr A`.
    Targets {
        /// Listen here instead (port 0: a free one), e.g. a network
        /// namespace's LAN address (scenario 11).
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// roam relay built on the library (`roam::serve`) with the connection
    /// and session caps raised, piping each stream to the `host:port` it
    /// names, as `roam serve` does. Prints `addr A`; answers `states`.
    Relay {
        /// Echo every stream inside the relay instead of connecting its
        /// target (one socket per session instead of two: 10,000 sessions
        /// then fit in a 20,000-descriptor limit).
        #[arg(long)]
        echo: bool,
    },
    /// Fault proxy (`roam_sim::proxy::FaultProxy`) to `upstream`; prints
    /// `addr A`; answers `blackhole on` / `blackhole off` with `ok`.
    Proxy {
        #[arg(long)]
        upstream: SocketAddr,
    },
    /// Many-session client: `open N`, `write BYTES`, `states`, `exit`.
    MemClient {
        /// Relay addresses (`host:port`, comma-separated); sessions take
        /// them in turn.
        #[arg(long, value_delimiter = ',')]
        relay: Vec<String>,
        /// The target every stream names.
        #[arg(long)]
        target: String,
    },
    /// Scenario 11's measuring client (run plain, under `roam run`, or
    /// through `roam forward`): set-up times, 1-byte round trips and bulk
    /// throughput to a target; prints one line of JSON.
    InterposeClient(crate::scenarios::interpose::ClientArgs),
}

/// Runs an agent role in this process (never returns on success).
pub(crate) fn run(cmd: AgentCmd) -> i32 {
    crate::procs::raise_nofile(1 << 20);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("agent: runtime: {e}");
            return 1;
        }
    };
    let r = rt.block_on(async move {
        match cmd {
            AgentCmd::Targets { listen } => {
                let l = match listen {
                    Some(a) => load::target_listener_on(a)?,
                    None => load::target_listener()?,
                };
                println!("addr {}", l.local_addr()?);
                load::serve_targets(l).await
            }
            AgentCmd::Relay { echo } => relay(echo).await,
            AgentCmd::Proxy { upstream } => proxy(upstream).await,
            AgentCmd::MemClient { relay, target } => mem_client(relay, target).await,
            AgentCmd::InterposeClient(args) => {
                let report = crate::scenarios::interpose::client(&args).await?;
                println!(
                    "{}",
                    serde_json::to_string(&report).map_err(io::Error::other)?
                );
                Ok(())
            }
        }
    });
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("agent: {e}");
            1
        }
    }
}

/// Counts sessions by state: `(active, suspended, other)`.
fn count_states(handles: &[SessionHandle]) -> (usize, usize, usize) {
    let mut c = (0, 0, 0);
    for h in handles {
        match h.stats().state {
            roam::State::Active => c.0 += 1,
            roam::State::Suspended => c.1 += 1,
            _ => c.2 += 1,
        }
    }
    c
}

fn states_line(handles: &[SessionHandle]) -> String {
    let (a, s, o) = count_states(handles);
    format!("states active={a} suspended={s} other={o}")
}

async fn proxy(upstream: SocketAddr) -> io::Result<()> {
    let proxy = roam_sim::proxy::FaultProxy::start(upstream).await?;
    println!("addr {}", proxy.addr());
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        match line.trim() {
            "blackhole on" => proxy.blackhole(true),
            "blackhole off" => proxy.blackhole(false),
            other => {
                println!("error unknown command {other:?}");
                continue;
            }
        }
        println!("ok");
    }
    Ok(())
}

async fn relay(echo: bool) -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let keypair = roam::Keypair::generate().map_err(io::Error::other)?;
    let mut config = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: None,
        addresses: Vec::new(),
        session: roam_proto::Config::default(),
    });
    // A benchmark's clients all come from 127.0.0.1 with one key: lift the
    // per-address and per-key caps with the overall ones.
    config.max_connections = 1_000_000;
    config.max_sessions = 1_000_000;
    config.max_sessions_per_ip = 1_000_000;
    config.max_sessions_per_key = 1_000_000;
    let sessions: Arc<Mutex<Vec<SessionHandle>>> = Arc::default();
    let s2 = sessions.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            match line.trim() {
                "states" => {
                    let hs = s2.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    println!("{}", states_line(&hs));
                }
                "exit" => std::process::exit(0),
                other => println!("error unknown command {other:?}"),
            }
        }
        // The parent went away: so do we.
        std::process::exit(0);
    });
    println!("addr {}", listener.local_addr()?);
    roam::serve(
        listener,
        config,
        std::future::pending::<()>(),
        move |session: SessionHandle| {
            sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(session.clone());
            tokio::spawn(async move {
                while let Ok((stream, meta)) = session.accept_stream().await {
                    if echo {
                        tokio::spawn(echo_stream(stream));
                    } else {
                        tokio::spawn(relay_stream(stream, meta));
                    }
                }
            });
        },
    )
    .await
}

/// Echo buffer of the in-relay echo (bytes).
const ECHO_BUF: usize = 2048;

/// The target protocol's echo, inside the relay: skips the operation byte.
async fn echo_stream(mut stream: roam::RoamStream) {
    let mut buf = [0u8; ECHO_BUF];
    let mut first = true;
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let skip = usize::from(std::mem::take(&mut first));
        if stream.write_all(&buf[skip..n]).await.is_err() {
            return;
        }
    }
}

async fn relay_stream(mut stream: roam::RoamStream, meta: Vec<u8>) {
    let target = String::from_utf8_lossy(&meta).into_owned();
    let Ok(mut tcp) = TcpStream::connect(target.as_str()).await else {
        stream.reset(roam_proto::code::APPLICATION_BASE + 2);
        return;
    };
    let _ = tcp.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional_with_sizes(
        &mut stream,
        &mut tcp,
        RELAY_COPY_BUF,
        RELAY_COPY_BUF,
    )
    .await;
}

/// A client configuration with a fresh key, trusting the server on first use.
pub(crate) fn client_config(keypair: &roam::Keypair) -> roam::ClientConfig {
    roam::ClientConfig::new(roam_proto::ClientConfig {
        keypair: keypair.clone(),
        server_trust: roam_proto::ServerTrust::FirstUse,
        session: roam_proto::Config::default(),
    })
}

/// Opens a session and one stream to `target`, and checks a 1 KiB echo on it.
pub(crate) async fn open_echo_session(
    relay: &str,
    target: &str,
    config: roam::ClientConfig,
) -> io::Result<(SessionHandle, roam::RoamStream)> {
    let session = roam::connect(relay, config)
        .await
        .map_err(io::Error::other)?;
    let mut stream = session
        .open_stream(target.as_bytes())
        .map_err(io::Error::other)?;
    let mut msg = vec![load::OP_ECHO];
    msg.extend(std::iter::repeat_n(load::FILL, 1024));
    stream.write_all(&msg).await?;
    let mut back = vec![0u8; 1024];
    stream.read_exact(&mut back).await?;
    if back != msg[1..] {
        return Err(io::Error::other(
            "echo through a new session came back different",
        ));
    }
    Ok((session, stream))
}

async fn mem_client(relays: Vec<String>, target: String) -> io::Result<()> {
    let keypair = roam::Keypair::generate().map_err(io::Error::other)?;
    let mut sessions: Vec<SessionHandle> = Vec::new();
    let mut streams: Vec<roam::RoamStream> = Vec::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    println!("started");
    while let Some(line) = lines.next_line().await? {
        let mut words = line.split_whitespace();
        let (cmd, count) = (
            words.next(),
            words.next().and_then(|w| w.parse::<usize>().ok()),
        );
        // `open N via K`: every new session through relay K only (a staged
        // opening); plain `open N` spreads them over the relays.
        let via = match (words.next(), words.next().map(str::parse::<usize>)) {
            (Some("via"), Some(Ok(k))) if k < relays.len() => Some(k),
            (None, _) => None,
            _ => {
                println!("error bad command {line:?}");
                continue;
            }
        };
        match (cmd, count) {
            (Some("open"), Some(n)) => {
                let sem = Arc::new(tokio::sync::Semaphore::new(CONNECT_CONCURRENCY));
                let mut set = tokio::task::JoinSet::new();
                for i in 0..n {
                    let permit = sem
                        .clone()
                        .acquire_owned()
                        .await
                        .map_err(io::Error::other)?;
                    let r = relays[via.unwrap_or(i % relays.len().max(1))].clone();
                    let (t, c) = (target.clone(), client_config(&keypair));
                    set.spawn(async move {
                        let _permit = permit;
                        tokio::time::timeout(Duration::from_secs(60), open_echo_session(&r, &t, c))
                            .await
                            .unwrap_or_else(|_| Err(io::Error::other("session set-up timed out")))
                    });
                }
                let mut failed = None;
                while let Some(r) = set.join_next().await {
                    match r.map_err(io::Error::other).and_then(|r| r) {
                        Ok((h, s)) => {
                            sessions.push(h);
                            streams.push(s);
                        }
                        Err(e) => failed = Some(e),
                    }
                }
                match failed {
                    Some(e) => println!("error {e}"),
                    None => println!("ready {}", sessions.len()),
                }
            }
            (Some("write"), Some(bytes)) => {
                let data: Arc<[u8]> = vec![load::FILL; bytes].into();
                let mut set = tokio::task::JoinSet::new();
                for mut s in streams.drain(..) {
                    let d = data.clone();
                    set.spawn(async move { s.write_all(&d).await.map(|_| s) });
                }
                let mut failed = None;
                while let Some(r) = set.join_next().await {
                    match r.map_err(io::Error::other).and_then(|r| r) {
                        Ok(s) => streams.push(s),
                        Err(e) => failed = Some(e),
                    }
                }
                match failed {
                    Some(e) => println!("error {e}"),
                    None => println!("written"),
                }
            }
            (Some("states"), _) => println!("{}", states_line(&sessions)),
            (Some("heap"), _) => println!("{}", heap_line()),
            (Some("exit"), _) => break,
            _ => println!("error unknown command {line:?}"),
        }
    }
    std::process::exit(0)
}

/// jemalloc's own counters, as `heap allocated=A active=B resident=C`
/// (bytes): what the process's live allocations hold, the pages they sit
/// in, and the allocator's resident pages (its metadata and pages not yet
/// given back included). Beside RSS they show where a session's memory
/// goes: live data, partly used pages, or pages kept.
fn heap_line() -> String {
    use tikv_jemalloc_ctl::{epoch, stats};
    let read = || -> Result<(usize, usize, usize), tikv_jemalloc_ctl::Error> {
        epoch::advance()?;
        Ok((
            stats::allocated::read()?,
            stats::active::read()?,
            stats::resident::read()?,
        ))
    };
    match read() {
        Ok((a, b, c)) => format!("heap allocated={a} active={b} resident={c}"),
        Err(e) => format!("error jemalloc counters: {e}"),
    }
}

/// Parent side: an agent child process and its command line.
pub(crate) struct Agent {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Agent {
    /// Starts `me agent <args>`, its stderr appended to `log`.
    pub(crate) fn spawn(me: &Path, args: &[&str], log: &Path) -> io::Result<Agent> {
        Agent::start(tokio::process::Command::new(me), args, log)
    }

    /// As [`Agent::spawn`], inside the network namespace `netns` (`nsenter
    /// --net=/run/netns/NETNS`, which execs the agent: the child is the
    /// agent itself).
    pub(crate) fn spawn_in(netns: &str, me: &Path, args: &[&str], log: &Path) -> io::Result<Agent> {
        let mut cmd = tokio::process::Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{netns}"))
            .arg("--")
            .arg(me);
        Agent::start(cmd, args, log)
    }

    /// Starts `cmd agent <args>` (`cmd` runs this binary), its stderr
    /// appended to `log`.
    fn start(mut cmd: tokio::process::Command, args: &[&str], log: &Path) -> io::Result<Agent> {
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let mut child = cmd
            .arg("agent")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| io::Error::other("no stdin"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout"))?;
        Ok(Agent {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// The next line the agent prints; an `error ...` line is an error.
    pub(crate) async fn line(&mut self, timeout: Duration) -> io::Result<String> {
        let l = tokio::time::timeout(timeout, self.lines.next_line())
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("agent silent for {timeout:?}"),
                )
            })??
            .ok_or_else(|| io::Error::other("agent exited (see agents.log)"))?;
        match l.strip_prefix("error ") {
            Some(e) => Err(io::Error::other(format!("agent: {e}"))),
            None => Ok(l),
        }
    }

    /// Sends one command line and returns the answer line.
    pub(crate) async fn cmd(&mut self, cmd: &str, timeout: Duration) -> io::Result<String> {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        self.line(timeout).await
    }

    /// Reads the `addr A` line an agent prints once listening.
    pub(crate) async fn addr(&mut self) -> io::Result<SocketAddr> {
        let l = self.line(Duration::from_secs(20)).await?;
        l.strip_prefix("addr ")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| io::Error::other(format!("agent said {l:?} instead of its address")))
    }

    /// Asks for `states` and parses `(active, suspended, other)`.
    pub(crate) async fn states(&mut self) -> io::Result<(usize, usize, usize)> {
        let l = self.cmd("states", Duration::from_secs(20)).await?;
        let num = |key: &str| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse::<usize>().ok())
                .ok_or_else(|| io::Error::other(format!("bad states line {l:?}")))
        };
        Ok((num("active=")?, num("suspended=")?, num("other=")?))
    }

    /// Asks a many-session client for `heap` and parses jemalloc's
    /// `(allocated, active, resident)` bytes.
    pub(crate) async fn heap(&mut self) -> io::Result<(u64, u64, u64)> {
        let l = self.cmd("heap", Duration::from_secs(20)).await?;
        let num = |key: &str| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| io::Error::other(format!("bad heap line {l:?}")))
        };
        Ok((num("allocated=")?, num("active=")?, num("resident=")?))
    }
}
