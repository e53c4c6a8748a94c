//! `roam serve`: the relay (rocks' rockd). Each stream names a target
//! `host:port`; allowed targets get a TCP connection and the bytes are piped
//! both ways. The target connection outlives suspensions of the client.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use roam::RoamStream;
use tokio::net::{TcpListener, TcpStream};

use crate::cli::{CliError, CliResult, ServeArgs};
use crate::config::{parse_duration, FileConfig};
use crate::control::Registry;
use crate::limits::{server_limits, FdBudget, TargetCaps};
use crate::target::{split_host_port, AllowRule};

/// Default listen address.
pub(crate) const DEFAULT_LISTEN: &str = "0.0.0.0:7447";
/// Default allow-list: the local ssh server only — never an open proxy by default.
pub(crate) const DEFAULT_ALLOW: &str = "127.0.0.1:22";
/// How long the relay waits for a target to accept.
const TARGET_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Stream reset codes the relay uses (roam's application range, §10).
pub(crate) mod reset {
    /// The target is not on the relay's allow-list.
    pub(crate) const TARGET_NOT_ALLOWED: u64 = roam_proto::code::APPLICATION_BASE + 1;
    /// The relay could not connect to the target.
    pub(crate) const TARGET_UNREACHABLE: u64 = roam_proto::code::APPLICATION_BASE + 2;
    /// The stream's metadata is not a `host:port` target.
    pub(crate) const BAD_TARGET: u64 = roam_proto::code::APPLICATION_BASE + 3;
    /// The relay is at its target-connection limit (per session or overall).
    pub(crate) const TARGET_LIMIT: u64 = roam_proto::code::APPLICATION_BASE + 4;
}

/// What a client tells its user when the relay reset its stream.
pub(crate) fn describe_reset(code: u64, target: &str) -> String {
    match code {
        reset::TARGET_NOT_ALLOWED => format!(
            "relay refused target {target}: not allowed (code {code:#x}); the relay's operator can permit it with `roam serve --allow {target}`"
        ),
        reset::TARGET_UNREACHABLE => {
            format!("relay could not connect to {target} (code {code:#x}); check that the service runs on the relay host")
        }
        reset::BAD_TARGET => format!("relay rejected target {target:?} as malformed (code {code:#x}); use HOST:PORT"),
        reset::TARGET_LIMIT => format!(
            "relay refused the connection to {target}: it is at its target-connection limit (code {code:#x}); close other connections through this relay or try again later (its operator sees the limits in `roam status`)"
        ),
        c => format!("stream to {target} was reset by the relay (code {c:#x})"),
    }
}

/// `roam serve`.
pub(crate) async fn run(args: ServeArgs, config: &FileConfig) -> CliResult {
    let listen = args
        .listen
        .or_else(|| config.serve.listen.clone())
        .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
    let allow_text = if !args.allow.is_empty() {
        args.allow
    } else {
        config
            .serve
            .allow
            .clone()
            .unwrap_or_else(|| vec![DEFAULT_ALLOW.to_string()])
    };
    let rules = allow_text
        .iter()
        .map(|a| AllowRule::parse(a))
        .collect::<Result<Vec<_>, _>>()?;
    let state = crate::paths::state_dir(config);
    let key_path = args
        .key
        .or_else(|| config.serve.key.clone())
        .unwrap_or_else(|| state.join("server.key"));
    let keypair = crate::keys::load_or_create(&key_path)?;
    let authorized = match args
        .authorized_keys
        .or_else(|| config.serve.authorized_keys.clone())
    {
        Some(p) => Some(Arc::new(crate::keys::read_authorized(&p)?)),
        None => None,
    };
    let suspend_timeout = parse_duration(
        args.suspend_timeout
            .as_deref()
            .or(config.serve.suspend_timeout.as_deref())
            .unwrap_or("3d"),
    )?;
    let idle_suspend_timeout = parse_duration(
        args.idle_suspend_timeout
            .as_deref()
            .or(config.serve.idle_suspend_timeout.as_deref())
            .unwrap_or("60s"),
    )?;
    let nofile = crate::limits::raise_fd_limit();
    let budget = FdBudget::for_limit(nofile);
    let pick = |flag: Option<usize>, file: Option<usize>, default: usize, name: &str| {
        let v = flag.or(file).unwrap_or(default);
        if v == 0 {
            Err(CliError(format!("--{name} must be at least 1")))
        } else {
            Ok(v)
        }
    };
    let max_connections = pick(
        args.max_connections,
        config.serve.max_connections,
        budget.connections,
        "max-connections",
    )?;
    let max_targets = pick(
        args.max_targets,
        config.serve.max_targets,
        budget.targets,
        "max-targets",
    )?;
    let max_targets_per_session = pick(
        args.max_targets_per_session,
        config.serve.max_targets_per_session,
        crate::limits::DEFAULT_TARGETS_PER_SESSION,
        "max-targets-per-session",
    )?;
    let needed = budget.needed(max_connections, max_targets);
    if needed as u64 > nofile {
        tracing::warn!(
            "--max-connections {max_connections} and --max-targets {max_targets} may need {needed} file descriptors, more than the open-file limit {nofile}; the relay may run out of descriptors under load"
        );
    }
    let listener = crate::limits::listen(&listen).await.map_err(|e| {
        CliError(format!("cannot listen on {listen}: {e}; is another relay running? choose another address with --listen"))
    })?;
    let local = listener
        .local_addr()
        .map_or(listen.clone(), |a| a.to_string());
    let public = keypair.public();
    let mut server = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: authorized.clone(),
        addresses: Vec::new(),
        session: roam_proto::Config {
            resume_timeout: suspend_timeout,
            idle_resume_timeout: Some(idle_suspend_timeout),
            ..Default::default()
        },
    });
    server.max_connections = max_connections;
    server.busy_overflow = budget.busy_overflow;
    server.max_sessions = pick(
        args.max_sessions,
        config.serve.max_sessions,
        server.max_sessions,
        "max-sessions",
    )?;
    server.max_sessions_per_ip = pick(
        args.max_sessions_per_ip,
        config.serve.max_sessions_per_ip,
        server.max_sessions_per_ip,
        "max-sessions-per-ip",
    )?;
    server.max_sessions_per_key = pick(
        args.max_sessions_per_key,
        config.serve.max_sessions_per_key,
        server.max_sessions_per_key,
        "max-sessions-per-key",
    )?;
    let targets = TargetCaps::new(max_targets, max_targets_per_session);
    tracing::info!(
        "limits: {} connections (+{} busy answers), {} sessions, {} per IP, {} per key, {max_targets} targets, {max_targets_per_session} per session; open-file limit {nofile}",
        server.max_connections,
        server.busy_overflow,
        server.max_sessions,
        server.max_sessions_per_ip,
        server.max_sessions_per_key,
    );
    eprintln!(
        "roam serve: listening on {local}; server key {public}; allowed targets: {}; clients: {}",
        allow_text.join(", "),
        authorized
            .as_ref()
            .map_or("any key".to_string(), |k| format!(
                "{} authorized keys",
                k.len()
            )),
    );
    let registry = Registry::default();
    {
        let (server, targets) = (server.clone(), targets.clone());
        registry.set_limits(move || {
            let mut l = server_limits(&server);
            l.extend(targets.limits());
            l
        });
    }
    if let Some(addr) = args.metrics.or_else(|| config.serve.metrics.clone()) {
        let l = TcpListener::bind(&addr).await.map_err(|e| {
            CliError(format!(
                "cannot serve metrics on {addr}: {e}; choose another address with --metrics"
            ))
        })?;
        let at = l.local_addr().map_or(addr, |a| a.to_string());
        eprintln!("roam serve: metrics at http://{at}/metrics");
        tokio::spawn(crate::metrics::serve(
            l,
            crate::metrics::Sources {
                sessions: registry.clone(),
                targets: targets.clone(),
                server: server.stats.clone(),
            },
        ));
    }
    let _control = crate::control::start(config, format!("serve {local}"), registry.clone());
    run_relay(
        listener,
        server,
        Arc::new(rules),
        targets,
        Some(registry),
        shutdown_signal(),
    )
    .await
    .map_err(|e| CliError(format!("relay failed: {e}")))?;
    Ok(0)
}

/// Completes on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// Runs a relay on `listener` until `shutdown`.
pub(crate) async fn run_relay(
    listener: TcpListener,
    config: roam::ServerConfig,
    rules: Arc<Vec<AllowRule>>,
    targets: Arc<TargetCaps>,
    registry: Option<Registry>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    roam::serve(
        listener,
        config,
        shutdown,
        move |session: roam::SessionHandle| {
            let peer = session.stats().peer_addr;
            tracing::info!(
                "new session {} from {}",
                session.id().map(|i| i.to_string()).unwrap_or_default(),
                fmt_peer(peer)
            );
            if let Some(r) = &registry {
                r.add(
                    format!("relay session from {}", fmt_peer(peer)),
                    session.clone(),
                );
            }
            let rules = rules.clone();
            let targets = targets.clone();
            tokio::spawn(async move {
                while let Ok((stream, meta)) = session.accept_stream().await {
                    tokio::spawn(relay_stream(
                        stream,
                        meta,
                        rules.clone(),
                        targets.clone(),
                        session.clone(),
                    ));
                }
            });
        },
    )
    .await
}

fn fmt_peer(peer: Option<SocketAddr>) -> String {
    peer.map_or_else(|| "?".to_string(), |p| p.to_string())
}

/// Connects one stream to its target (if allowed and under the caps) and
/// copies both ways until either side ends or the session does.
async fn relay_stream(
    mut stream: RoamStream,
    meta: Vec<u8>,
    rules: Arc<Vec<AllowRule>>,
    targets: Arc<TargetCaps>,
    session: roam::SessionHandle,
) {
    let peer = fmt_peer(session.stats().peer_addr);
    let target = String::from_utf8_lossy(&meta).into_owned();
    let parsed = match split_host_port(&target) {
        Ok((host, Some(port))) if !host.is_empty() => Some((host, port)),
        _ => None,
    };
    let Some((host, port)) = parsed else {
        tracing::warn!("refused stream from {peer}: target {target:?} is not HOST:PORT");
        targets.note_refused("bad_target");
        stream.reset(reset::BAD_TARGET);
        return;
    };
    if !rules.iter().any(|r| r.matches(&host, port)) {
        tracing::warn!(
            "refused stream from {peer} to {target}: target not allowed (permit it with --allow {target})"
        );
        targets.note_refused("not_allowed");
        stream.reset(reset::TARGET_NOT_ALLOWED);
        return;
    }
    let session_label = session
        .id()
        .map_or_else(|| "?".to_string(), |i| i.to_string());
    // Held until the target connection is closed (dialing included).
    let _permit = match targets.take(&session_label) {
        Ok(p) => p,
        Err(why) => {
            if let Some(n) = targets.log_allowed() {
                let note = if n == 0 {
                    String::new()
                } else {
                    format!(" ({n} similar refusals in the last interval not logged)")
                };
                tracing::warn!(
                    "refused stream of session {session_label} from {peer} to {target}: {why}; reset with code {:#x}{note}",
                    reset::TARGET_LIMIT
                );
            }
            targets.note_refused("target_limit");
            stream.reset(reset::TARGET_LIMIT);
            return;
        }
    };
    let dial = tokio::time::timeout(
        TARGET_CONNECT_TIMEOUT,
        TcpStream::connect((host.as_str(), port)),
    )
    .await;
    let mut tcp = match dial {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::warn!("stream from {peer}: cannot connect to {target}: {e}");
            targets.note_refused("unreachable");
            stream.reset(reset::TARGET_UNREACHABLE);
            return;
        }
        Err(_) => {
            tracing::warn!("stream from {peer}: connecting to {target} timed out");
            targets.note_refused("unreachable");
            stream.reset(reset::TARGET_UNREACHABLE);
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    targets.note_connected();
    tracing::info!("stream from {peer} connected to {target}");
    let copied = tokio::select! {
        r = crate::pump::pump(&mut stream, &mut tcp) => r,
        // The session expired or was closed: nobody can use this target
        // connection again, so it closes now rather than when a read fails.
        reason = session.closed() => {
            tracing::info!("stream from {peer} to {target} ended with its session: {}", roam::Error::Closed(reason));
            return;
        }
    };
    match copied {
        Ok((up, down)) => {
            tracing::info!("stream from {peer} to {target} done: {up} bytes up, {down} down")
        }
        Err(e) => {
            tracing::info!("stream from {peer} to {target} ended: {e}");
            stream.reset(roam_proto::code::NO_ERROR);
        }
    }
}
