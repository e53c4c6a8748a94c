//! `roam run -- CMD`: CMD's TCP connections become roam sessions wherever
//! the other host runs roam, by interposition (issue 13, rocks), both ways.
//!
//! CMD starts with roam's preload library (crates/roam-preload, embedded in
//! this binary and written once to the state directory) in `LD_PRELOAD`.
//! The library talks to this process (the agent) over a private Unix socket
//! (`run/<pid>.sock` in the state directory). One message per connection,
//! the first byte saying which:
//!
//! | message | bytes after the first | answer |
//! |---|---|---|
//! | `C` connect | the program's port on 127.0.0.1, the destination's IPv4 address and port | `+` |
//! | `6` connect | the program's port on ::1, the destination's IPv6 address and port | `+` |
//! | `L` listen | the listener's IPv4 address (0: any, also for a dual-stack `::`) and port | `+` |
//! | `l` listen | an IPv6-only listener's address (`::`: any) and port | `+` |
//! | `Q` who is the peer | the socket's local address and port, its peer's on 127.0.0.1 | a peer (below) |
//! | `q` who is the peer | the IPv6 socket's port on ::1 (its peer: the agent) | a peer |
//! | `w` who is the peer | the port on ::1 the socket's peer (the relay) connected from | a peer |
//!
//! A peer is `+`, an IPv4 address and port; `=`, an IPv6 address and port;
//! or `-` (not one the agent carries).
//!
//! **Outgoing.** The library's `connect` binds a TCP socket headed for a
//! non-loopback address to loopback (127.0.0.1; ::1 for an IPv6
//! destination, `::ffff:127.0.0.1` for an IPv4-mapped one), registers it
//! (`C` or `6`) and connects to the agent's TCP port there instead. The agent carries each accepted connection
//! exactly as `roam intercept` does ([`crate::intercept::carry`]): a stream
//! of one session per enhanced host, plain TCP to an ordinary one.
//! Connections the library did not register are refused (the agent port is
//! reachable by any local user; the registration socket is not).
//!
//! **Incoming.** When the program first listens on a non-loopback address
//! (`L`), the agent becomes this host's relay: it listens on the relay port
//! (`--relay-port`) for roam sessions and connects each of their streams,
//! from loopback, to the program's listener for the stream's port (other
//! ports are refused). The library's `accept` asks (`Q`) who such a
//! connection is for and returns the roam client's address, so the program
//! logs and checks the real client. When the relay port is taken (a `roam
//! serve` already runs here), that relay serves this host and the program
//! sees its connections as coming from it.
//!
//! The program's descriptors are ordinary sockets to loopback, so a link cut
//! or a new address at either end never reaches them. No root is needed.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};

use crate::cli::{CliError, CliResult, RunArgs};
use crate::config::FileConfig;
use crate::control::Registry;
use crate::intercept::{carry, Ctx, Probe};

/// The preload library, built by build.rs from crates/roam-preload.
static PRELOAD: &[u8] = include_bytes!(env!("ROAM_PRELOAD_SO"));

/// How long a registration waits for its connection.
const REGISTRATION_TTL: Duration = Duration::from_secs(30);

/// `roam run`.
pub(crate) async fn run(args: RunArgs, config: &FileConfig) -> CliResult {
    let Some((program, program_args)) = args.command.split_first() else {
        return Err(CliError(
            "name the program to run after `--`, e.g. `roam run -- curl URL`".into(),
        ));
    };
    let probe = Probe::parse(&args.probe)?;
    let dir = crate::paths::state_dir(config).join("run");
    crate::paths::ensure_private_dir(&dir)
        .map_err(|e| CliError(format!("cannot use {}: {e}", dir.display())))?;
    let library = install_preload(&dir)?;
    let register_path = dir.join(format!("{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&register_path);
    let register = UnixListener::bind(&register_path)
        .map_err(|e| CliError(format!("cannot listen on {}: {e}", register_path.display())))?;
    let _unlink = Unlink(register_path.clone());
    let agent = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .await
        .map_err(|e| CliError(format!("cannot listen on 127.0.0.1: {e}")))?;
    let agent_port = agent
        .local_addr()
        .map_err(|e| CliError(format!("agent socket: {e}")))?
        .port();
    // IPv6 destinations come to ::1 (none if this host has no IPv6
    // loopback: then they are not carried).
    let agent6 = TcpListener::bind(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 0)))
        .await
        .ok();
    let agent6_port = agent6
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .map_or(0, |a| a.port());
    let registry = Registry::default();
    let ctx_registry = registry.clone();
    let label = format!("run {}", program.to_string_lossy());
    let _control = crate::control::start(config, label, registry.clone());
    let ctx = Arc::new(Ctx::new(
        config,
        args.client.key.clone(),
        probe,
        registry,
        false,
        "run",
    ));
    let agent_state = Arc::new(Agent {
        agent_port,
        relay_port: probe.relay_port,
        state: crate::paths::state_dir(config),
        registry: ctx_registry,
        pending: Mutex::default(),
        carried: Arc::default(),
        listeners: Mutex::default(),
        dialed: Arc::default(),
        relay: Mutex::new(RelayState::NotStarted),
        stop: tokio::sync::watch::channel(false).0,
    });

    let mut preload = std::ffi::OsString::from(&library);
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    let ports = args
        .ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut child = tokio::process::Command::new(program)
        .args(program_args)
        .env("LD_PRELOAD", preload)
        .env("ROAM_RUN_AGENT", agent_port.to_string())
        .env("ROAM_RUN_AGENT6", agent6_port.to_string())
        .env("ROAM_RUN_REGISTER", &register_path)
        .env("ROAM_RUN_PORTS", ports)
        .spawn()
        .map_err(|e| CliError(format!("cannot run {}: {e}", Path::new(program).display())))?;

    // The program's exit status, once its own process has ended while
    // processes it started go on.
    let mut exited: Option<std::process::ExitStatus> = None;
    // Installed once, before the loop: a signal between two turns is not lost.
    let mut stop_signal = std::pin::pin!(crate::signals::exit_signal());
    let status = loop {
        tokio::select! {
            r = register.accept() => {
                if let Ok((conn, _)) = r {
                    tokio::spawn(registration(conn, agent_state.clone()));
                }
            }
            r = agent.accept() => {
                if let Ok((tcp, from)) = r {
                    take(&agent_state, &ctx, tcp, from);
                }
            }
            r = async {
                match &agent6 {
                    Some(l) => l.accept().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Ok((tcp, from)) = r {
                    take(&agent_state, &ctx, tcp, from);
                }
            }
            status = child.wait(), if exited.is_none() => {
                let status = status.map_err(|e| CliError(format!("waiting for the program: {e}")))?;
                let left = settled_descendants(&register_path).await;
                if left.is_empty() {
                    break status;
                }
                // A daemon (`nginx`, `sh -c 'server &'`): the program's own
                // process is gone, its children still hold connections and
                // listeners that this process carries.
                eprintln!(
                    "roam run: the program exited ({}), but {} process{} it started still \
                     run{} (pid {}): serving their connections until they end \
                     (a signal is passed on to them)",
                    describe(status),
                    left.len(),
                    if left.len() == 1 { "" } else { "es" },
                    if left.len() == 1 { "s" } else { "" },
                    left.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                );
                exited = Some(status);
            }
            _ = tokio::time::sleep(LEFT_CHECK), if exited.is_some() => {
                if settled_descendants(&register_path).await.is_empty() {
                    if let Some(status) = exited {
                        break status;
                    }
                }
            }
            sig = &mut stop_signal => {
                // The program decides: it gets the signal and ends (or not).
                let pids = match (exited, child.id()) {
                    (None, Some(pid)) => vec![pid as i32],
                    _ => descendants(&register_path).0,
                };
                for pid in pids {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::try_from(sig).ok(),
                    );
                }
            }
        }
    };
    // The relay (if the program listened) takes no more sessions.
    let _ = agent_state.stop.send(true);
    // What the program wrote before it ended is delivered before the
    // sessions close.
    ctx.close_all().await;
    Ok(exit_code(status))
}

/// Carries a connection that reached the agent from `from` if the program
/// registered it (else it is refused: someone else's).
fn take(agent: &Arc<Agent>, ctx: &Arc<Ctx>, tcp: tokio::net::TcpStream, from: SocketAddr) {
    let key = (from.is_ipv6(), from.port());
    // The registration moves from `pending` to `carried` under `pending`'s
    // lock, so that a `getpeername` asked meanwhile (`Agent::outgoing`)
    // finds it in one or the other (it was in neither for a moment, and
    // the program then saw the agent's address).
    let taken = {
        let mut p = agent.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|_, (_, at)| at.elapsed() < REGISTRATION_TTL);
        p.remove(&key)
            .map(|(dest, _)| (dest, Entry::insert(&agent.carried, key, dest)))
    };
    // (A socket the program had bound to another local address reaches the
    // agent from that address: the registration, not the source, says it
    // is ours.)
    match taken {
        Some((dest, keep)) => {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                carry(ctx, tcp, dest).await;
                drop(keep);
            });
        }
        None => tracing::warn!("refused an unregistered connection from {from}"),
    }
}

/// How often `roam run` looks for the program's processes once its own
/// process has ended.
const LEFT_CHECK: Duration = Duration::from_millis(500);

/// The live processes that run with this `roam run`'s preload (their
/// environment names `register`, the agent's socket): what the program
/// started and left running. Read from `/proc/*/environ` (the initial
/// environment, inherited across fork and exec; a process that clears its
/// environment before exec is not found). Second: the processes that
/// cannot be told yet, their environment read as empty (see [`Seen`]).
fn descendants(register: &Path) -> (Vec<i32>, Vec<i32>) {
    let needle = needle(register);
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return (Vec::new(), Vec::new());
    };
    let (mut ours, mut unsure) = (Vec::new(), Vec::new());
    for pid in dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()) {
        if pid == me {
            continue;
        }
        match seen(pid, &needle) {
            Seen::Ours => ours.push(pid),
            Seen::Unsure => unsure.push(pid),
            Seen::Other => {}
        }
    }
    (ours, unsure)
}

/// [`descendants`], once none of the processes that could be the program's
/// is in the middle of an `execve`: a child that `sh -c 'server & exit'`
/// left is often still exec'ing the server when the shell has ended, and
/// its environment reads as empty until the new program's is in place. It
/// looks again at those processes every 10 ms, for up to half a second (a
/// process whose environment is really empty, `env -i`, is waited for that
/// long, then counted out).
async fn settled_descendants(register: &Path) -> Vec<i32> {
    let needle = needle(register);
    let (mut ours, mut unsure) = descendants(register);
    for _ in 0..50 {
        if !ours.is_empty() || unsure.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut still = Vec::new();
        for pid in unsure {
            match seen(pid, &needle) {
                Seen::Ours => ours.push(pid),
                Seen::Unsure => still.push(pid),
                Seen::Other => {}
            }
        }
        unsure = still;
    }
    ours
}

/// What `roam run`'s preload leaves in the environment of the processes it
/// runs in: `ROAM_RUN_REGISTER=<register>`, NUL-terminated.
fn needle(register: &Path) -> Vec<u8> {
    let mut n = b"ROAM_RUN_REGISTER=".to_vec();
    n.extend_from_slice(register.as_os_str().as_encoded_bytes());
    n.push(0);
    n
}

/// What a process is to [`descendants`].
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// It runs with this `roam run`'s preload.
    Ours,
    /// Its environment reads as empty and it is no kernel thread: most
    /// likely in the middle of an `execve` (the kernel shows no environment
    /// until the new program's is set up).
    Unsure,
    /// Another process, a kernel thread, a zombie, or gone.
    Other,
}

/// What process `pid` is, from its `/proc` files.
fn seen(pid: i32, needle: &[u8]) -> Seen {
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return Seen::Other;
    };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Seen::Other;
    };
    classify(&env, &stat, needle)
}

/// [`seen`] from the contents of a process's `environ` and `stat`.
fn classify(env: &[u8], stat: &str, needle: &[u8]) -> Seen {
    // The fields after the command's closing parenthesis: state (3rd
    // field), ..., flags (9th).
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return Seen::Other;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // A zombie is gone for our purposes (its parent has not reaped it).
    if fields.first().is_none_or(|s| *s == "Z") {
        return Seen::Other;
    }
    if env.windows(needle.len()).any(|w| w == needle) {
        return Seen::Ours;
    }
    /// `PF_KTHREAD` of the kernel's task flags.
    const PF_KTHREAD: u64 = 0x0020_0000;
    let kernel = fields
        .get(6)
        .and_then(|f| f.parse::<u64>().ok())
        .is_none_or(|flags| flags & PF_KTHREAD != 0);
    match env.is_empty() && !kernel {
        true => Seen::Unsure,
        false => Seen::Other,
    }
}

/// An exit status in words.
fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => status.to_string(),
    }
}

/// The program's exit status as ours: its code, or 128 + its signal.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// What the agent knows of the program's connections and listeners.
struct Agent {
    /// The agent's TCP port on 127.0.0.1 (outgoing connections' peer).
    agent_port: u16,
    /// Where this host's relay listens, once the program listens.
    relay_port: u16,
    /// The state directory (the relay's server key).
    state: PathBuf,
    /// Sessions for `roam status`.
    registry: Registry,
    /// Registered outgoing connections not yet at the agent: the program's
    /// loopback [`Port`] → (destination, registered when).
    pending: Mutex<HashMap<Port, (SocketAddr, Instant)>>,
    /// Outgoing connections being carried: the program's loopback [`Port`]
    /// → the destination it asked for.
    carried: Arc<Mutex<HashMap<Port, SocketAddr>>>,
    /// The program's listeners: port → the address it listens on
    /// (unspecified: every address).
    listeners: Mutex<HashMap<u16, std::net::IpAddr>>,
    /// Incoming connections the relay made to the program: the agent's
    /// loopback source port → the session of the roam client (asked for
    /// the client's current address).
    dialed: Arc<Mutex<HashMap<Port, roam::SessionHandle>>>,
    /// This host's relay for the program's listeners.
    relay: Mutex<RelayState>,
    /// Set when the program has ended: the relay stops.
    stop: tokio::sync::watch::Sender<bool>,
}

/// A loopback port of the program: (on ::1 rather than 127.0.0.1, number).
type Port = (bool, u16);

/// Whether `roam run` serves the program's listeners on the relay port.
enum RelayState {
    /// The program has not listened yet.
    NotStarted,
    /// Listening on the relay port.
    Running,
    /// The relay port was taken (said once): another relay serves this host.
    Unavailable,
}

/// An entry of one of the agent's port maps, removed when dropped (when
/// its connection ends).
struct Entry<K: std::hash::Hash + Eq, V> {
    map: Arc<Mutex<HashMap<K, V>>>,
    port: K,
}

impl<K: std::hash::Hash + Eq + Copy, V> Entry<K, V> {
    /// Maps `port` to `value` in `map` until the entry is dropped.
    fn insert(map: &Arc<Mutex<HashMap<K, V>>>, port: K, value: V) -> Entry<K, V> {
        map.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port, value);
        Entry {
            map: map.clone(),
            port,
        }
    }
}

impl<K: std::hash::Hash + Eq, V> Drop for Entry<K, V> {
    fn drop(&mut self) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.port);
    }
}

/// Serves one message of the preload library (the table in the module
/// documentation); anything malformed is dropped without an answer.
async fn registration(mut conn: tokio::net::UnixStream, agent: Arc<Agent>) {
    let mut msg = [0u8; 21];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        conn.read_exact(&mut msg[..1]).await?;
        let len = match msg[0] {
            b'C' => 8,
            b'6' => 20,
            b'L' => 6,
            b'l' => 18,
            b'Q' => 12,
            b'q' | b'w' => 2,
            _ => return Err(std::io::ErrorKind::InvalidData.into()),
        };
        conn.read_exact(&mut msg[1..=len]).await
    })
    .await;
    if !matches!(read, Ok(Ok(_))) {
        return;
    }
    let answer = match Message::decode(&msg) {
        Some(Message::Connect { port, dest }) => {
            agent
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert((dest.is_ipv6(), port), (dest, Instant::now()));
            b"+".to_vec()
        }
        Some(Message::Query6 { port }) => answer(agent.outgoing((true, port))),
        Some(Message::QueryIn6 { port }) => answer(agent.client((true, port))),
        Some(Message::Listen { addr }) => {
            agent
                .listeners
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(addr.port(), addr.ip());
            start_relay(&agent, addr.port()).await;
            b"+".to_vec()
        }
        Some(Message::Query { local, peer }) => answer(agent.peer_of(local, peer)),
        None => return,
    };
    let _ = conn.write_all(&answer).await;
}

/// A peer address as the library reads it: `+`, IPv4 address, port; `=`,
/// IPv6 address, port; `-` if there is none.
fn answer(peer: Option<SocketAddr>) -> Vec<u8> {
    match peer {
        Some(SocketAddr::V4(a)) => {
            let mut r = vec![b'+'];
            r.extend_from_slice(&a.ip().octets());
            r.extend_from_slice(&a.port().to_be_bytes());
            r
        }
        Some(SocketAddr::V6(a)) => {
            let mut r = vec![b'='];
            r.extend_from_slice(&a.ip().octets());
            r.extend_from_slice(&a.port().to_be_bytes());
            r
        }
        None => b"-".to_vec(),
    }
}

impl Agent {
    /// The peer a program's socket between `local` and its loopback `peer`
    /// (127.0.0.1) stands for: the destination of an outgoing connection
    /// (its peer is the agent), or the roam client of an incoming one (its
    /// peer is the relay's loopback source).
    fn peer_of(&self, local: SocketAddrV4, peer: SocketAddrV4) -> Option<SocketAddr> {
        if !peer.ip().is_loopback() {
            return None;
        }
        if peer.port() != self.agent_port {
            return self.client((false, peer.port()));
        }
        self.outgoing((false, local.port()))
    }

    /// Where the roam client of the incoming connection the relay made from
    /// loopback `port` is *now* (it may have moved since it connected).
    fn client(&self, port: Port) -> Option<SocketAddr> {
        let session = self
            .dialed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&port)
            .cloned()?;
        session
            .stats()
            .peer_addr
            .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
    }

    /// The destination of the program's outgoing connection from loopback
    /// `port`: carried, or registered and not yet accepted by the agent
    /// (the program's connect returns as soon as the kernel has the
    /// connection).
    fn outgoing(&self, port: Port) -> Option<SocketAddr> {
        let carried = self
            .carried
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&port)
            .copied();
        carried.or_else(|| {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&port)
                .map(|(dest, _)| *dest)
        })
    }
}

/// A message of the preload library.
#[derive(Debug, PartialEq, Eq)]
enum Message {
    /// `C` (IPv4) or `6` (IPv6): the connection from loopback `port`
    /// (127.0.0.1 or ::1, as `dest`'s family) is for `dest`.
    Connect { port: u16, dest: SocketAddr },
    /// `q`: the destination of the IPv6 connection from [::1]:`port`?
    Query6 { port: u16 },
    /// `L` (IPv4, or IPv6 `::` that takes IPv4 too) or `l` (IPv6 only):
    /// the program listens on `addr` (unspecified: every address).
    Listen { addr: SocketAddr },
    /// `w`: the client of the incoming connection from [::1]:`port`?
    QueryIn6 { port: u16 },
    /// `Q`: who is the peer of the program's socket `local` ↔ `peer`?
    Query {
        local: SocketAddrV4,
        peer: SocketAddrV4,
    },
}

impl Message {
    /// Decodes a message (its type byte first); `None` if malformed.
    fn decode(msg: &[u8]) -> Option<Message> {
        let addr = |b: &[u8]| -> Option<SocketAddrV4> {
            let b: &[u8; 6] = b.get(..6)?.try_into().ok()?;
            Some(SocketAddrV4::new(
                Ipv4Addr::new(b[0], b[1], b[2], b[3]),
                u16::from_be_bytes([b[4], b[5]]),
            ))
        };
        let (kind, rest) = msg.split_first()?;
        match kind {
            b'C' => {
                let port = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?);
                Some(Message::Connect {
                    port,
                    dest: SocketAddr::V4(addr(rest.get(2..)?)?),
                })
            }
            b'6' => {
                let port = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?);
                let ip: [u8; 16] = rest.get(2..18)?.try_into().ok()?;
                let dport = u16::from_be_bytes(rest.get(18..20)?.try_into().ok()?);
                Some(Message::Connect {
                    port,
                    dest: SocketAddr::from((ip, dport)),
                })
            }
            b'q' => Some(Message::Query6 {
                port: u16::from_be_bytes(rest.get(..2)?.try_into().ok()?),
            }),
            b'L' => Some(Message::Listen {
                addr: SocketAddr::V4(addr(rest)?),
            }),
            b'l' => {
                let ip: [u8; 16] = rest.get(..16)?.try_into().ok()?;
                let port = u16::from_be_bytes(rest.get(16..18)?.try_into().ok()?);
                Some(Message::Listen {
                    addr: SocketAddr::from((ip, port)),
                })
            }
            b'w' => Some(Message::QueryIn6 {
                port: u16::from_be_bytes(rest.get(..2)?.try_into().ok()?),
            }),
            b'Q' => Some(Message::Query {
                local: addr(rest)?,
                peer: addr(rest.get(6..)?)?,
            }),
            _ => None,
        }
    }
}

/// Makes this process the host's relay for the program's listeners, the
/// first time the program listens (`port`, for the message). A taken relay
/// port is said once: the relay already there serves this host.
async fn start_relay(agent: &Arc<Agent>, port: u16) {
    {
        let mut state = agent.relay.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*state, RelayState::NotStarted) {
            return;
        }
        // Claimed before the await: one start only.
        *state = RelayState::Running;
    }
    let started = crate::serve::start_host_relay(
        agent.relay_port,
        &agent.state,
        agent.registry.clone(),
        Arc::new(ToProgram(agent.clone())),
        agent.stop.subscribe(),
    )
    .await;
    match started {
        Ok(key) => eprintln!(
            "roam run: the program listens on port {port}: roam clients reach it through the \
             relay on port {} (server key {key}); other clients connect as before",
            agent.relay_port
        ),
        Err(why) => {
            *agent.relay.lock().unwrap_or_else(|e| e.into_inner()) = RelayState::Unavailable;
            eprintln!(
                "roam run: the program listens on port {port}, but {why}: roam clients reach it \
                 only through a relay already on this host (and the program sees that relay's \
                 address), others connect as before"
            );
        }
    }
}

/// The relay's way to its targets: the program's listeners, from loopback,
/// each connection remembered with its roam client until it ends.
struct ToProgram(Arc<Agent>);

impl crate::serve::Dialer for ToProgram {
    fn dial<'a>(
        &'a self,
        _host: &'a str,
        port: u16,
        session: &'a roam::SessionHandle,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<crate::serve::Dialed>> + Send + 'a>,
    > {
        Box::pin(async move {
            let bound = self
                .0
                .listeners
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&port)
                .copied()
                .ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::ConnectionRefused,
                        format!("the program does not listen on port {port}"),
                    )
                })?;
            // From loopback of the listener's family, to the listener (its
            // address, or loopback for "every address").
            let (sock, from) = match bound {
                std::net::IpAddr::V4(_) => (
                    tokio::net::TcpSocket::new_v4()?,
                    std::net::IpAddr::from(Ipv4Addr::LOCALHOST),
                ),
                std::net::IpAddr::V6(_) => (
                    tokio::net::TcpSocket::new_v6()?,
                    std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
                ),
            };
            let to = if bound.is_unspecified() { from } else { bound };
            // Bound first, remembered before the connect: the program's
            // accept may ask who it is before the connect returns here.
            sock.bind(SocketAddr::new(from, 0))?;
            let source = (from.is_ipv6(), sock.local_addr()?.port());
            let keep = Entry::insert(&self.0.dialed, source, session.clone());
            let tcp = sock.connect(SocketAddr::new(to, port)).await?;
            Ok((tcp, Box::new(keep) as Box<dyn Send>))
        })
    }
}

/// Writes the preload library into `dir` (once per version, named by its
/// digest) and returns its path.
fn install_preload(dir: &Path) -> Result<PathBuf, CliError> {
    let digest = hex::encode(&sha2::Sha256::digest(PRELOAD)[..8]);
    let path = dir.join(format!("libroam_preload-{digest}.so"));
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == PRELOAD.len() as u64) {
        return Ok(path);
    }
    let tmp = dir.join(format!(".libroam_preload-{}.tmp", std::process::id()));
    std::fs::write(&tmp, PRELOAD)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            CliError(format!("cannot write {}: {e}", path.display()))
        })?;
    Ok(path)
}

/// Removes a path when dropped.
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process in the middle of `execve` (its environment empty) is not
    /// counted out: `roam run` waits for it to show its environment.
    #[test]
    fn a_process_whose_environment_reads_empty_is_unsure_unless_a_kernel_thread() {
        let needle = needle(Path::new("/state/run/42.sock"));
        let stat = |state: &str, flags: u64| {
            format!("123 (python3 (x)) {state} 1 123 123 0 -1 {flags} 0 0 0 0 1 2")
        };
        let env = b"PATH=/bin\0ROAM_RUN_REGISTER=/state/run/42.sock\0HOME=/\0";
        assert_eq!(classify(env, &stat("S", 0x40_0000), &needle), Seen::Ours);
        assert_eq!(classify(b"", &stat("R", 0x40_0100), &needle), Seen::Unsure);
        assert_eq!(
            classify(b"", &stat("S", 0x20_8040), &needle),
            Seen::Other,
            "a kernel thread"
        );
        assert_eq!(classify(env, &stat("Z", 0x40_0000), &needle), Seen::Other);
        let other = b"ROAM_RUN_REGISTER=/state/run/43.sock\0";
        assert_eq!(classify(other, &stat("S", 0), &needle), Seen::Other);
        assert_eq!(classify(env, "garbage", &needle), Seen::Other);
    }

    /// A process that really has an empty environment is waited for, then
    /// counted out; the test process itself (its environment set) is not
    /// `roam run`'s.
    #[tokio::test]
    async fn settled_descendants_count_out_an_empty_environment_in_time() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .env_clear()
            .spawn()
            .expect("sleep");
        let pid = child.id() as i32;
        let register = Path::new("/nonexistent/roam-run-test.sock");
        let (ours, unsure) = descendants(register);
        assert!(ours.is_empty(), "{ours:?}");
        assert!(unsure.contains(&pid), "{unsure:?} lacks {pid}");
        let t0 = std::time::Instant::now();
        assert!(settled_descendants(register).await.is_empty());
        let took = t0.elapsed();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            (Duration::from_millis(400)..Duration::from_secs(5)).contains(&took),
            "{took:?}"
        );
    }

    #[test]
    fn the_library_messages_decode_and_malformed_ones_are_refused() {
        assert_eq!(
            Message::decode(&[b'C', 0x9c, 0x40, 10, 0, 0, 7, 0x1f, 0x90]),
            Some(Message::Connect {
                port: 40_000,
                dest: SocketAddr::from(([10, 0, 0, 7], 8080))
            })
        );
        let mut six = vec![b'6', 0x9c, 0x40];
        six.extend_from_slice(&"fd00::7".parse::<std::net::Ipv6Addr>().unwrap().octets());
        six.extend_from_slice(&[0x1f, 0x90]);
        assert_eq!(
            Message::decode(&six),
            Some(Message::Connect {
                port: 40_000,
                dest: "[fd00::7]:8080".parse().unwrap()
            })
        );
        assert_eq!(
            Message::decode(&[b'q', 0x9c, 0x40]),
            Some(Message::Query6 { port: 40_000 })
        );
        assert_eq!(Message::decode(&six[..10]), None);
        assert_eq!(
            Message::decode(&[b'L', 0, 0, 0, 0, 0x1f, 0x90]),
            Some(Message::Listen {
                addr: SocketAddr::from(([0, 0, 0, 0], 8080))
            })
        );
        assert_eq!(
            Message::decode(&[b'Q', 127, 0, 0, 1, 0x1f, 0x90, 127, 0, 0, 1, 0x9c, 0x40]),
            Some(Message::Query {
                local: SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8080),
                peer: SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40_000)
            })
        );
        assert_eq!(Message::decode(&[b'C', 1, 2, 3]), None);
        assert_eq!(Message::decode(&[b'X', 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(Message::decode(&[]), None);
    }

    #[test]
    fn the_embedded_library_exports_connect() {
        assert!(PRELOAD.starts_with(b"\x7fELF"), "not an ELF object");
        assert!(
            PRELOAD.windows(8).any(|w| w == b"connect\0"),
            "no connect symbol"
        );
        for symbol in [&b"accept4\0"[..], b"listen\0", b"getpeername\0"] {
            assert!(
                PRELOAD.windows(symbol.len()).any(|w| w == symbol),
                "no {} symbol",
                String::from_utf8_lossy(symbol)
            );
        }
    }
}
