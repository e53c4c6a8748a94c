//! `roam intercept`: every TCP connection this host opens to chosen ports
//! becomes a roam stream when the other end runs a roam relay, with nothing
//! inside the programs (issue 13, racks: reliable network connections by
//! packet filter).
//!
//! An nftables rule set (one table, `ip roam_intercept_<pid>`) redirects
//! outgoing connections to the ports to this process's agent socket on
//! loopback. For each connection the agent reads the destination the program
//! asked for (`SO_ORIGINAL_DST`) and looks its host up:
//!
//! - *enhanced* — `roam serve` answers on the relay port there: the
//!   connection becomes a stream (target: the original destination) of one
//!   session to that host, shared by every connection to it. The session
//!   survives link loss, address changes and suspension; the program's own
//!   connection is to loopback and never sees them.
//! - *ordinary* — nothing answers there: the agent connects to the original
//!   destination itself (its socket marked so the rules let it pass) and
//!   copies bytes both ways, so the peer gets exactly what it would have.
//!
//! Detection is one TCP connect to the relay port (refused or silent for
//! `--probe-timeout`: ordinary), reused as the session's first transport
//! when it succeeds; answers are kept per host (ordinary ones for
//! `--recheck`, enhanced ones while the session lives). The rules skip
//! loopback and this host's own addresses (a relay here reaching its
//! targets) and the agent's marked sockets. They are removed on exit; rule
//! sets left by a process that died are removed by the next `roam
//! intercept`, or by `roam intercept --cleanup`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use crate::cli::{CliError, CliResult, InterceptArgs, ProbeArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay_over, explain_stream_error};
use crate::control::Registry;

/// The firewall mark of the agent's own direct connections (`roam` in
/// ASCII): the rules let them pass instead of redirecting them again.
const MARK: u32 = 0x726f_616d;
/// The prefix of the rule sets' table names (`roam_intercept_<pid>`).
const TABLE_PREFIX: &str = "roam_intercept_";
/// The firewall mark of `--incoming`'s connections to local servers (and,
/// through their conntrack mark, of the servers' answers): `roan`.
const MARK_IN: u32 = 0x726f_616e;
/// The routing table that brings marked answers back to the agent: every
/// address is local there.
const ROUTE_TABLE: u32 = 0x726f;

/// `roam intercept`.
pub(crate) async fn run(args: InterceptArgs, config: &FileConfig) -> CliResult {
    if args.cleanup {
        let mut removed = remove_tables(|_| true)?;
        if remove_routes() {
            removed.push(format!("the policy route to table {ROUTE_TABLE}"));
        }
        eprintln!(
            "roam intercept: removed {} rule set{}{}",
            removed.len(),
            if removed.len() == 1 { "" } else { "s" },
            if removed.is_empty() {
                String::new()
            } else {
                format!(" ({})", removed.join(", "))
            }
        );
        return Ok(0);
    }
    if args.ports.is_empty() {
        return Err(CliError(
            "name at least one port to intercept (--port PORT, repeatable), or --cleanup".into(),
        ));
    }
    if args.ports.contains(&args.probe.relay_port) {
        return Err(CliError(format!(
            "port {} is the relay port (--relay-port): its own connections cannot be intercepted",
            args.probe.relay_port
        )));
    }
    if args.ports.contains(&0) {
        return Err(CliError("port 0 cannot be intercepted".into()));
    }
    let probe = Probe::parse(&args.probe)?;
    if !nix::unistd::Uid::effective().is_root() {
        return Err(CliError(
            "roam intercept must run as root: it installs nftables rules and marks its sockets"
                .into(),
        ));
    }
    crate::limits::raise_fd_limit();
    let stale = remove_tables(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())?;
    if !stale.is_empty() {
        eprintln!(
            "roam intercept: removed rule sets left by processes that are gone: {}",
            stale.join(", ")
        );
    }
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .map_err(|e| CliError(format!("cannot listen on 127.0.0.1: {e}")))?;
    let agent = listener
        .local_addr()
        .map_err(|e| CliError(format!("agent socket: {e}")))?
        .port();
    let registry = Registry::default();
    let (stop_relay, stop_rx) = tokio::sync::watch::channel(false);
    let mut incoming = None;
    if args.incoming {
        let state = crate::paths::state_dir(config);
        let key = crate::serve::start_host_relay(
            probe.relay_port,
            &state,
            registry.clone(),
            Arc::new(Transparent {
                ports: args.ports.clone(),
            }),
            stop_rx,
        )
        .await
        .map_err(|why| {
            CliError(format!(
                "--incoming: the relay port {} {why}; is a relay (roam serve) running here? \
                 (then leave out --incoming: it serves this host, and the servers see its address)",
                probe.relay_port
            ))
        })?;
        incoming = Some((Routes::install()?, key));
    }
    // IPv6 connections are redirected to ::1 (none where the host has no
    // IPv6 loopback).
    let listener6 = TcpListener::bind(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 0)))
        .await
        .ok();
    let agent6 = listener6
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .map(|a| a.port());
    let rules = Rules::install(&args.ports, agent, agent6, args.incoming)?;
    let ports = args
        .ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let _control =
        crate::control::start(config, format!("intercept ports {ports}"), registry.clone());
    eprintln!(
        "roam intercept: connections to port{} {ports} go through roam where the peer runs a \
         relay on port {} (agent 127.0.0.1:{agent}, rules: table inet {})",
        if args.ports.len() == 1 { "" } else { "s" },
        probe.relay_port,
        rules.table
    );
    if let Some((_, key)) = &incoming {
        eprintln!(
            "roam intercept: incoming: roam sessions on port {} (server key {key}) reach the \
             servers on port{} {ports} here with their clients' own addresses",
            probe.relay_port,
            if args.ports.len() == 1 { "" } else { "s" },
        );
    }
    let ctx = Arc::new(Ctx::new(
        config,
        args.client.key.clone(),
        probe,
        registry,
        true,
        "intercept",
    ));
    let mut accept_log = roam::LogThrottle::new(Duration::from_secs(10));
    // Installed once, before the loop: a signal between two turns is not lost.
    let mut stop_signal = std::pin::pin!(crate::signals::exit_signal());
    let code = loop {
        tokio::select! {
            accepted = listener.accept() => take(&ctx, accepted, &mut accept_log).await,
            accepted = async {
                match &listener6 {
                    Some(l) => l.accept().await,
                    None => std::future::pending().await,
                }
            } => take(&ctx, accepted, &mut accept_log).await,
            sig = &mut stop_signal => break 128 + sig,
        }
    };
    // New connections to the ports are plain again from here on.
    let _ = stop_relay.send(true);
    rules.remove()?;
    ctx.close_all().await;
    drop(incoming);
    Ok(code)
}

/// Carries a connection the rules redirected to the agent.
async fn take(
    ctx: &Arc<Ctx>,
    accepted: std::io::Result<(TcpStream, SocketAddr)>,
    log: &mut roam::LogThrottle,
) {
    match accepted {
        Ok((tcp, from)) => match original_destination(&tcp, from.is_ipv6()) {
            // The rules never redirect to loopback: such a "destination" is
            // a connection made straight to the agent's port (by any local
            // user), which must not be carried (carried plainly, it would
            // connect to the agent again, and again).
            Ok(dest) if dest.ip().is_loopback() || dest.ip().is_unspecified() => {
                tracing::warn!("refused a connection from {from} made straight to the agent");
            }
            Ok(dest) => {
                tokio::spawn(carry(ctx.clone(), tcp, dest));
            }
            Err(e) => tracing::warn!("a redirected connection without its destination: {e}"),
        },
        Err(e) => {
            if let Some(n) = log.allow(Instant::now()) {
                tracing::warn!("accept failed: {e}; retrying ({n} more not logged)");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `--incoming`'s way to the local servers: a connection to the stream's
/// target (one of this host's addresses, an intercepted port) whose source
/// is the roam client's own address and port (`IP_TRANSPARENT`), marked so
/// that the server's answers come back to it ([`Routes`], and the route
/// chain of [`Rules`]).
struct Transparent {
    /// The intercepted ports: the only ones served.
    ports: Vec<u16>,
}

impl crate::serve::Dialer for Transparent {
    fn dial<'a>(
        &'a self,
        host: &'a str,
        port: u16,
        session: &'a roam::SessionHandle,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = std::io::Result<crate::serve::Dialed>> + Send + 'a>,
    > {
        Box::pin(async move {
            use std::io::{Error, ErrorKind};
            if !self.ports.contains(&port) {
                return Err(Error::new(
                    ErrorKind::PermissionDenied,
                    format!("port {port} is not intercepted here"),
                ));
            }
            let ip: IpAddr = host.parse().map_err(|_| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("{host} is not an IP address"),
                )
            })?;
            // Only this host: a spoofed source must never reach the network.
            if std::net::UdpSocket::bind((ip, 0)).is_err() {
                return Err(Error::new(
                    ErrorKind::PermissionDenied,
                    format!("{ip} is not an address of this host"),
                ));
            }
            let target = SocketAddr::new(ip, port);
            let sock = socket2::Socket::new(
                socket2::Domain::for_address(target),
                socket2::Type::STREAM,
                None,
            )?;
            sock.set_mark(MARK_IN)?;
            // The client's address; its port is the kernel's choice (the
            // program's own port is not known here). IPv4 only: an IPv6
            // client's stream reaches the server from this host's address.
            let client = session
                .stats()
                .peer_addr
                .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()));
            if let (IpAddr::V4(_), Some(SocketAddr::V4(c))) = (ip, client) {
                sock.set_ip_transparent_v4(true)?;
                sock.bind(&SocketAddr::V4(SocketAddrV4::new(*c.ip(), 0)).into())?;
            }
            sock.set_nonblocking(true)?;
            sock.set_cloexec(true)?;
            let sock = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(sock));
            let tcp = sock.connect(target).await?;
            Ok((tcp, Box::new(()) as Box<dyn Send>))
        })
    }
}

/// The policy route of `--incoming`: packets marked [`MARK_IN`] are routed
/// by table [`ROUTE_TABLE`], where every address is local, so a server's
/// answer to a client address reaches the agent's transparent socket.
/// Removed when dropped (and by `--cleanup`).
struct Routes;

impl Routes {
    fn install() -> Result<Routes, CliError> {
        // A crashed agent's leftovers first: the rule must be there once.
        remove_routes();
        let (mark, table) = (format!("{MARK_IN:#x}"), ROUTE_TABLE.to_string());
        ip(&["rule", "add", "fwmark", &mark, "lookup", &table])?;
        let routes = Routes;
        ip(&[
            "route",
            "add",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            &table,
        ])?;
        Ok(routes)
    }
}

impl Drop for Routes {
    fn drop(&mut self) {
        remove_routes();
    }
}

/// Removes `--incoming`'s policy route; whether there was one.
fn remove_routes() -> bool {
    let (mark, table) = (format!("{MARK_IN:#x}"), ROUTE_TABLE.to_string());
    let mut removed = false;
    // (At most a few: one per crashed agent that installed it.)
    for _ in 0..16 {
        if ip(&["rule", "del", "fwmark", &mark, "lookup", &table]).is_err() {
            break;
        }
        removed = true;
    }
    let _ = ip(&["route", "flush", "table", &table]);
    removed
}

/// Runs `ip ARGS`.
fn ip(args: &[&str]) -> Result<(), CliError> {
    let out = std::process::Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| CliError(format!("cannot run ip: {e} (install iproute2)")))?;
    if !out.status.success() {
        return Err(CliError(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// What the agent knows of a destination host.
#[derive(Clone)]
enum Peer {
    /// It runs a relay: the session every connection to it rides on.
    Enhanced(roam::SessionHandle),
    /// It does not (as of `since`): connections to it stay plain TCP.
    Ordinary { since: Instant },
}

/// How hosts are asked whether they run a relay.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probe {
    /// Where enhanced hosts run their relay.
    pub(crate) relay_port: u16,
    /// How long an ordinary host stays ordinary.
    pub(crate) recheck: Duration,
    /// How long the relay port may stay silent.
    pub(crate) timeout: Duration,
}

impl Probe {
    /// From the command line's `--relay-port`, `--recheck` and
    /// `--probe-timeout`.
    pub(crate) fn parse(args: &ProbeArgs) -> Result<Probe, CliError> {
        Ok(Probe {
            relay_port: args.relay_port,
            recheck: crate::config::parse_duration(&args.recheck)
                .map_err(|e| CliError(format!("--recheck: {e}")))?,
            timeout: crate::config::parse_duration(&args.probe_timeout)
                .map_err(|e| CliError(format!("--probe-timeout: {e}")))?,
        })
    }
}

/// The agent's shared state (also `roam run`'s).
pub(crate) struct Ctx {
    /// What is known of each destination host.
    peers: Mutex<HashMap<IpAddr, Peer>>,
    /// Held while a host is being probed.
    probing: Mutex<HashMap<IpAddr, Arc<tokio::sync::Mutex<()>>>>,
    /// Where enhanced hosts run their relay.
    relay_port: u16,
    /// The client key (`--key`), default the state directory's.
    key: Option<std::path::PathBuf>,
    /// The configuration (state directory, known servers).
    config: FileConfig,
    /// How long an ordinary host stays ordinary before it is asked again.
    recheck: Duration,
    /// How long the relay port may stay silent before a host is ordinary.
    probe_timeout: Duration,
    /// Sessions for `roam status`.
    registry: Registry,
    /// Mark direct connections (`roam intercept`: its rules skip them).
    mark: bool,
    /// The command, for messages (`intercept`, `run`).
    name: &'static str,
    /// Connections being carried.
    active: std::sync::atomic::AtomicUsize,
}

impl Ctx {
    /// The agent's state: hosts asked as `probe` says, direct connections
    /// marked if `mark`, messages signed `roam NAME`.
    pub(crate) fn new(
        config: &FileConfig,
        key: Option<std::path::PathBuf>,
        probe: Probe,
        registry: Registry,
        mark: bool,
        name: &'static str,
    ) -> Ctx {
        Ctx {
            peers: Mutex::new(HashMap::new()),
            probing: Mutex::new(HashMap::new()),
            relay_port: probe.relay_port,
            key,
            config: config.clone(),
            recheck: probe.recheck,
            probe_timeout: probe.timeout,
            registry,
            mark,
            name,
            active: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Waits (at most 3 s) for the connections being carried to end, then
    /// closes every session (each waits at most 3 s to deliver what it
    /// holds).
    pub(crate) async fn close_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.active.load(std::sync::atomic::Ordering::Relaxed) > 0
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let sessions: Vec<roam::SessionHandle> = {
            let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
            peers
                .values()
                .filter_map(|p| match p {
                    Peer::Enhanced(s) => Some(s.clone()),
                    Peer::Ordinary { .. } => None,
                })
                .collect()
        };
        for s in sessions {
            let _ = tokio::time::timeout(
                Duration::from_secs(3),
                s.close(roam_proto::code::NO_ERROR, ""),
            )
            .await;
        }
    }
}

/// How one connection is carried.
enum Route {
    /// As a stream of this session.
    Stream(roam::SessionHandle),
    /// Plain, straight to the destination.
    Direct,
}

/// Carries one redirected connection, for `dest`: as a roam stream or plain.
pub(crate) async fn carry(ctx: Arc<Ctx>, tcp: TcpStream, dest: SocketAddr) {
    use std::sync::atomic::Ordering;
    ctx.active.fetch_add(1, Ordering::Relaxed);
    carry_one(&ctx, tcp, dest).await;
    ctx.active.fetch_sub(1, Ordering::Relaxed);
}

async fn carry_one(ctx: &Arc<Ctx>, mut tcp: TcpStream, dest: SocketAddr) {
    let _ = tcp.set_nodelay(true);
    let target = dest.to_string();
    let route = route(ctx, dest.ip()).await;
    if let Route::Stream(session) = &route {
        match session.open_stream(target.as_bytes()) {
            Ok(mut stream) => {
                if let Err(e) = crate::pump::pump(&mut tcp, &mut stream).await {
                    eprintln!(
                        "roam {}: connection to {target}: {}",
                        ctx.name,
                        explain_stream_error(&e, &target)
                    );
                }
                return;
            }
            Err(e) => {
                // The session ended (its relay lost it or went away): the
                // next connection asks again; this one is plain.
                forget(ctx, dest.ip(), session);
                eprintln!(
                    "roam {}: {}: the session ended ({e}); this connection goes direct",
                    ctx.name,
                    dest.ip()
                );
            }
        }
    }
    if let Err(e) = direct(&mut tcp, dest, ctx.mark).await {
        tracing::debug!("direct connection to {target}: {e}");
    }
}

/// How connections to `host` go: the known answer, else a fresh probe
/// (connections to a host being probed wait for its answer).
async fn route(ctx: &Ctx, host: IpAddr) -> Route {
    if let Some(r) = known_route(ctx, host) {
        return r;
    }
    // One probe per host at a time: the others wait for its answer.
    let gate = ctx
        .probing
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(host)
        .or_default()
        .clone();
    let _probing = gate.lock().await;
    if let Some(r) = known_route(ctx, host) {
        return r;
    }
    let relay = SocketAddr::new(host, ctx.relay_port).to_string();
    let answer = match detect(ctx, &relay).await {
        Ok(session) => {
            eprintln!(
                "roam {}: {host} runs a roam relay (port {}): its connections are roam \
                 sessions",
                ctx.name, ctx.relay_port
            );
            ctx.registry
                .add(format!("{} -> {relay}", ctx.name), session.clone());
            tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
            Peer::Enhanced(session)
        }
        Err(why) => {
            eprintln!(
                "roam {}: {host} is an ordinary host ({why}): its connections stay plain \
                 TCP (asked again in {})",
                ctx.name,
                crate::control::human_secs(ctx.recheck.as_secs_f64())
            );
            Peer::Ordinary {
                since: Instant::now(),
            }
        }
    };
    let route = match &answer {
        Peer::Enhanced(s) => Route::Stream(s.clone()),
        Peer::Ordinary { .. } => Route::Direct,
    };
    ctx.peers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(host, answer);
    route
}

/// The route the last answer about `host` gives, while it holds: its
/// session until that ends, plain until the recheck is due.
fn known_route(ctx: &Ctx, host: IpAddr) -> Option<Route> {
    match ctx
        .peers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&host)?
    {
        Peer::Enhanced(s) if !s.is_closed() => Some(Route::Stream(s.clone())),
        Peer::Ordinary { since } if since.elapsed() < ctx.recheck => Some(Route::Direct),
        _ => None,
    }
}

/// Whether a roam relay answers at `relay`: one TCP connect (bounded by the
/// probe timeout), then the session's handshake over that connection.
async fn detect(ctx: &Ctx, relay: &str) -> Result<roam::SessionHandle, String> {
    let tcp = match tokio::time::timeout(ctx.probe_timeout, TcpStream::connect(relay)).await {
        Err(_) => {
            return Err(format!(
                "port {} silent for {}",
                ctx.relay_port,
                crate::control::human_secs(ctx.probe_timeout.as_secs_f64())
            ))
        }
        Ok(Err(e)) => return Err(format!("port {}: {e}", ctx.relay_port)),
        Ok(Ok(tcp)) => tcp,
    };
    // A handshake with something that is not a relay may hang: bounded too.
    let handshake = connect_relay_over(
        relay,
        ctx.key.as_deref(),
        &ctx.config,
        Some(roam::Transport::from(tcp)),
    );
    match tokio::time::timeout(ctx.probe_timeout + Duration::from_secs(5), handshake).await {
        Err(_) => Err(format!(
            "port {} accepted but no roam handshake came back",
            ctx.relay_port
        )),
        Ok(Err(e)) => Err(format!("no roam session: {}", e.into_cli().0)),
        Ok(Ok(s)) => Ok(s),
    }
}

/// Drops `session` as `host`'s route, if it still is.
fn forget(ctx: &Ctx, host: IpAddr, session: &roam::SessionHandle) {
    let mut peers = ctx.peers.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(Peer::Enhanced(s)) = peers.get(&host) {
        if s.id() == session.id() {
            peers.remove(&host);
        }
    }
}

/// Connects to `dest` (with a marked socket if `mark`: the rules let it
/// pass) and copies bytes both ways until both sides are done; a refused or
/// failed connect resets the program's connection, as the peer would have.
async fn direct(tcp: &mut TcpStream, dest: SocketAddr, mark: bool) -> std::io::Result<()> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(dest),
        socket2::Type::STREAM,
        None,
    )?;
    if mark {
        sock.set_mark(MARK)?;
    }
    sock.set_nonblocking(true)?;
    sock.set_cloexec(true)?;
    let sock = tokio::net::TcpSocket::from_std_stream(std::net::TcpStream::from(sock));
    let mut out = match sock.connect(dest).await {
        Ok(s) => s,
        Err(e) => {
            // Tell the program as the peer would have: a reset.
            let _ = socket2::SockRef::from(&*tcp).set_linger(Some(Duration::ZERO));
            return Err(e);
        }
    };
    let _ = out.set_nodelay(true);
    tokio::io::copy_bidirectional(tcp, &mut out)
        .await
        .map(|_| ())
}

/// The destination the program connected to, before the redirect (`v6`:
/// the connection came to the agent's IPv6 socket).
fn original_destination(tcp: &TcpStream, v6: bool) -> std::io::Result<SocketAddr> {
    let sock = socket2::SockRef::from(tcp);
    let dst = if v6 {
        sock.original_dst_v6()?
    } else {
        sock.original_dst_v4()?
    };
    dst.as_socket()
        .ok_or_else(|| std::io::Error::other("not an IP destination"))
}

/// This process's rule set; removed when dropped.
struct Rules {
    /// The table's name.
    table: String,
    /// Already removed.
    removed: bool,
}

impl Rules {
    /// Redirects new outgoing TCP connections to `ports` (other than to
    /// loopback or this host's own addresses, and other than the agent's
    /// marked sockets) to 127.0.0.1:`agent`, and over IPv6 to
    /// [::1]:`agent6` (IPv6 is left alone without it). One `inet` table.
    fn install(
        ports: &[u16],
        agent: u16,
        agent6: Option<u16>,
        incoming: bool,
    ) -> Result<Rules, CliError> {
        let table = format!("{TABLE_PREFIX}{}", std::process::id());
        let set = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        // `--incoming`: the agent's transparent connections mark their
        // conntrack entry, and the servers' answers on them take the mark
        // (and so the policy route back to the agent).
        let answers = if incoming {
            format!(
                "\tchain incoming {{\n\
                 \t\ttype route hook output priority mangle; policy accept;\n\
                 \t\tmeta mark {MARK_IN:#x} ct mark set {MARK_IN:#x}\n\
                 \t\tct mark {MARK_IN:#x} meta mark set {MARK_IN:#x}\n\
                 \t}}\n"
            )
        } else {
            String::new()
        };
        let v6 = match agent6 {
            Some(p) => format!("\t\tmeta nfproto ipv6 tcp dport {{ {set} }} redirect to :{p}\n"),
            None => String::new(),
        };
        nft(&format!(
            "table inet {table} {{\n\
             \tchain output {{\n\
             \t\ttype nat hook output priority -100; policy accept;\n\
             \t\tmeta mark {MARK:#x} return\n\
             \t\tip daddr 127.0.0.0/8 return\n\
             \t\tip6 daddr ::1 return\n\
             \t\tfib daddr type local return\n\
             \t\tmeta nfproto ipv4 tcp dport {{ {set} }} redirect to :{agent}\n\
             {v6}\
             \t}}\n{answers}}}\n"
        ))?;
        Ok(Rules {
            table,
            removed: false,
        })
    }

    /// Removes the rule set now.
    fn remove(mut self) -> Result<(), CliError> {
        self.removed = true;
        nft(&format!("delete table inet {}\n", self.table))
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        if !self.removed {
            let _ = nft(&format!("delete table inet {}\n", self.table));
        }
    }
}

/// Removes the intercept rule sets whose owner pid `which` accepts; returns
/// their names.
fn remove_tables(which: impl Fn(u32) -> bool) -> Result<Vec<String>, CliError> {
    let out = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map_err(|e| CliError(format!("cannot run nft: {e} (install nftables)")))?;
    if !out.status.success() {
        return Err(CliError(format!(
            "nft list tables failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let mut removed = Vec::new();
    for (family, name) in intercept_tables(&String::from_utf8_lossy(&out.stdout)) {
        let owner = name[TABLE_PREFIX.len()..].parse::<u32>().unwrap_or(0);
        if which(owner) {
            nft(&format!("delete table {family} {name}\n"))?;
            removed.push(name);
        }
    }
    Ok(removed)
}

/// The intercept tables named in `nft list tables` output: (family, name)
/// (`inet`; `ip` from versions before IPv6).
fn intercept_tables(listing: &str) -> Vec<(String, String)> {
    listing
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("table"), Some(family), Some(name)) if name.starts_with(TABLE_PREFIX) => {
                    Some((family.to_owned(), name.to_owned()))
                }
                _ => None,
            }
        })
        .collect()
}

/// Runs `nft -f -` with `script`.
fn nft(script: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| CliError(format!("cannot run nft: {e} (install nftables)")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| CliError(format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| CliError(format!("waiting for nft: {e}")))?;
    if !out.status.success() {
        return Err(CliError(format!(
            "nft failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_intercept_tables_are_listed() {
        let listing = "table ip nat\ntable inet roam_intercept_42\ntable ip roam_lock_1_0\n\
                       table ip roam_intercept_7\n";
        assert_eq!(
            intercept_tables(listing),
            vec![
                ("inet".to_string(), "roam_intercept_42".to_string()),
                ("ip".to_string(), "roam_intercept_7".to_string())
            ]
        );
    }
}
