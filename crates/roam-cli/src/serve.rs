//! `roam serve`: the relay (rocks' rockd). Each stream names a target
//! `host:port`; allowed targets get a TCP connection and the bytes are piped
//! both ways. The target connection outlives suspensions of the client.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam::RoamStream;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use crate::cli::{CliError, CliResult, ServeArgs};
use crate::config::{parse_duration, FileConfig};
use crate::control::Registry;
use crate::limits::{server_limits, FdBudget, TargetCaps};
use crate::pump::{HalfState, PumpEnd};
use crate::takeover::{HandedSession, HandedStream};
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
    /// The client's end of the stream is gone: its local connection ended
    /// with the process that held it (a named `roam forward` re-attached
    /// without it).
    pub(crate) const CLIENT_GONE: u64 = roam_proto::code::APPLICATION_BASE + 5;
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
    // SIGUSR2 asks for a takeover, and its default action ends the process:
    // its handler is installed first, before the relay says it listens (or
    // READY=1). A SIGUSR2 that arrives while the relay starts (or takes
    // over) waits for the takeover socket instead of killing the relay and
    // its sessions.
    let usr2 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2()).ok();
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
    let park_after = match args
        .park_after
        .as_deref()
        .or(config.serve.park_after.as_deref())
        .unwrap_or("10s")
        .trim()
    {
        // At once, as the help says.
        "0" | "0s" => Duration::ZERO,
        t => parse_duration(t)?,
    };
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
    let takeover_path = args
        .takeover_socket
        .clone()
        .unwrap_or_else(|| state.join("serve.takeover"));
    // `--takeover`: everything comes from the running relay.
    let mut handover: Option<Received> = None;
    if args.takeover {
        let format = args
            .takeover_format
            .unwrap_or(crate::takeover::STATE_FORMAT);
        handover = Some(receive_takeover(&takeover_path, format).await?);
    }
    let listener = match handover.as_mut() {
        Some(h) => {
            let fd = h.listener.try_clone().map_err(|e| CliError(format!("handed-over listener: {e}")))?;
            adopt_listener(fd, "listener")?
        }
        None => crate::limits::listen(&listen).await.map_err(|e| {
            CliError(format!("cannot listen on {listen}: {e}; is another relay running? choose another address with --listen (or take it over with --takeover)"))
        })?,
    };
    let local = listener
        .local_addr()
        .map_or(listen.clone(), |a| a.to_string());
    // Kept to hand over: the server owns `listener` itself.
    let listener_fd = {
        use std::os::fd::AsFd;
        listener
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| CliError(format!("cannot duplicate the listener: {e}")))?
    };
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
    eprintln_whole!(
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
    let handoffs: Arc<crate::metrics::Handoffs> = Arc::default();
    let mut metrics_fd = None;
    let handed_metrics = handover.as_mut().and_then(|h| h.metrics.take());
    if let Some(addr) = args.metrics.or_else(|| config.serve.metrics.clone()) {
        let l = match handed_metrics {
            Some(fd) => adopt_listener(fd, "metrics listener")?,
            None => TcpListener::bind(&addr).await.map_err(|e| {
                CliError(format!(
                    "cannot serve metrics on {addr}: {e}; choose another address with --metrics"
                ))
            })?,
        };
        {
            use std::os::fd::AsFd;
            metrics_fd = l.as_fd().try_clone_to_owned().ok();
        }
        let at = l.local_addr().map_or(addr, |a| a.to_string());
        eprintln_whole!("roam serve: metrics at http://{at}/metrics");
        tokio::spawn(crate::metrics::serve(
            l,
            crate::metrics::Sources {
                sessions: registry.clone(),
                targets: targets.clone(),
                server: server.stats.clone(),
                handoffs: handoffs.clone(),
            },
        ));
    }
    let _control = crate::control::start(config, format!("serve {local}"), registry.clone());
    let relay = Relay::new(
        Arc::new(rules),
        targets,
        Some(registry.clone()),
        server.proto.clone(),
        handoffs,
    );
    relay.set_park_after(park_after);
    {
        let r = Arc::downgrade(&relay);
        registry.set_parked(move || r.upgrade().map(|r| r.parked_status()).unwrap_or_default());
    }
    if args.shell {
        let _ = relay.shells.set(crate::shell::host::ShellHost::new(
            args.shell_keys.clone(),
            args.shell_program.clone(),
        ));
    }
    {
        // Shells in `roam status` and the metrics (also those adopted by a
        // relay started without --shell).
        let r = Arc::downgrade(&relay);
        registry.set_shells(move || {
            r.upgrade()
                .and_then(|r| r.shells.get().map(|h| h.status()))
                .unwrap_or_default()
        });
    }
    // Closed while sessions are still arriving: a resume for one not here
    // yet waits in the backlog instead of being refused as unknown.
    let (gate, gate_rx) = watch::channel(handover.is_some());
    server.accept_paused = Some(gate_rx);
    let stats = server.stats.clone();
    let handed_over = Arc::new(tokio::sync::Notify::new());
    // Serving from here: handed-over sessions run as their wave arrives.
    let serving = {
        let handed_over = handed_over.clone();
        let signal = shutdown_signal();
        tokio::spawn(serve_relay(listener, server, relay.clone(), async move {
            tokio::select! {
                _ = signal => {}
                _ = handed_over.notified() => {}
            }
        }))
    };
    let mut taken = 0;
    if let Some(h) = handover {
        // Each wave is ours once its receipt is written (the old relay
        // then lets go of it); the final receipt commits the shells and the
        // end, after which the old relay exits.
        let listen = h.listen;
        // Streams opened meanwhile (a shell's client re-attaching) wait
        // until the shells are here too.
        relay.streams_paused.send_replace(true);
        let (waves_tx, mut waves) = tokio::sync::mpsc::unbounded_channel::<Vec<HandedSession>>();
        let adopting = {
            let relay = relay.clone();
            tokio::spawn(async move {
                let mut n = 0;
                while let Some(wave) = waves.recv().await {
                    n += wave.len();
                    relay.park(wave);
                }
                n
            })
        };
        let mut rest = h.rest;
        let old_pid = rustix::net::sockopt::socket_peercred(rest.sock())
            .ok()
            .map(|c| c.pid.as_raw_nonzero().get());
        let received = tokio::task::spawn_blocking(move || {
            let r = crate::takeover::recv_waves(&mut rest, |wave| {
                let _ = waves_tx.send(wave);
            });
            (rest, r)
        })
        .await
        .map_err(|e| CliError(format!("takeover: {e}")))?;
        let adopted = adopting.await.unwrap_or(0);
        let (rest, shells) = match received {
            (rest, Ok((shells, n))) => {
                // systemd learns the new main process before the old one can exit.
                crate::sdnotify::notify(&format!("MAINPID={}", std::process::id()));
                let sent = tokio::task::spawn_blocking(move || {
                    let r = crate::takeover::send_taken(&rest, n);
                    (rest, r)
                })
                .await;
                match sent {
                    Ok((rest, Ok(()))) => (rest, Ok(shells)),
                    Ok((rest, Err(e))) => (rest, Err(e.to_string())),
                    Err(e) => return Err(CliError(format!("takeover: {e}"))),
                }
            }
            (rest, Err(e)) => (rest, Err(e.to_string())),
        };
        drop(rest);
        match shells {
            Ok(shells) => {
                eprintln_whole!(
                    "roam serve: took over {adopted} sessions, {} shells and the listener {listen} from the running relay",
                    shells.len(),
                );
                relay.adopt_shells(shells);
                taken = adopted;
                tokio::spawn(report_stops(relay.clone(), adopted));
            }
            Err(e) if adopted == 0 => {
                if let Some(pid) = old_pid {
                    crate::sdnotify::notify(&format!("MAINPID={pid}"));
                }
                return Err(CliError(format!(
                    "takeover failed part-way ({e}); the running relay keeps serving"
                )));
            }
            Err(e) => {
                // Those sessions are ours (their receipts went out) and the
                // old relay serves the rest: both serve until this one is
                // told otherwise.
                tracing::error!("takeover failed part-way ({e}) after {adopted} sessions moved here; serving them while the old relay keeps the rest");
                eprintln_whole!("roam serve: takeover failed part-way ({e}); serving the {adopted} sessions that moved here, the old relay keeps the rest");
                taken = adopted;
            }
        }
        relay.streams_paused.send_replace(false);
        gate.send_replace(false);
    }
    let takeover_listener = bind_takeover_socket(&takeover_path, args.takeover);
    crate::sdnotify::notify(&format!(
        "READY=1\nSTATUS=listening on {local}; {taken} sessions taken over"
    ));
    if let Some(l) = takeover_listener {
        tokio::spawn(offer_takeover(
            l,
            usr2,
            relay,
            gate,
            stats,
            local.clone(),
            listener_fd,
            metrics_fd,
            handed_over,
        ));
    } else if let Some(mut usr2) = usr2 {
        // Handled all the same: its default action would end the relay.
        tokio::spawn(async move {
            while usr2.recv().await.is_some() {
                tracing::warn!("SIGUSR2 ignored: this relay has no takeover socket");
            }
        });
    }
    serving
        .await
        .map_err(|e| CliError(format!("relay failed: {e}")))?
        .map_err(|e| CliError(format!("relay failed: {e}")))?;
    Ok(0)
}

/// A listening socket handed over by the running relay, ready for tokio;
/// `what` names it in the error.
fn adopt_listener(fd: OwnedFd, what: &str) -> Result<TcpListener, CliError> {
    let std_l = std::net::TcpListener::from(fd);
    std_l
        .set_nonblocking(true)
        .and_then(|()| TcpListener::from_std(std_l))
        .map_err(|e| CliError(format!("handed-over {what} unusable: {e}")))
}

/// What `--takeover` received first (the listening sockets), and the
/// reader the sessions' waves follow on.
struct Received {
    listen: String,
    listener: OwnedFd,
    metrics: Option<OwnedFd>,
    rest: crate::takeover::Receiving,
}

/// `--takeover`: asks the relay on `path` for everything it holds.
async fn receive_takeover(path: &std::path::Path, format: u32) -> Result<Received, CliError> {
    let path = path.to_path_buf();
    let shown = path.display().to_string();
    tokio::task::spawn_blocking(move || -> Result<Received, CliError> {
        let mut sock = std::os::unix::net::UnixStream::connect(&path).map_err(|e| {
            CliError(format!(
                "cannot take over: no relay answers on {shown}: {e}; is `roam serve` running with this --takeover-socket?"
            ))
        })?;
        let _ = sock.set_read_timeout(Some(TAKEOVER_IO_TIMEOUT));
        let _ = sock.set_write_timeout(Some(TAKEOVER_IO_TIMEOUT));
        let answer = crate::takeover::hello_with_format(&mut sock, format)
            .map_err(|e| CliError(format!("cannot take over from {shown}: {e}")))?;
        if !answer.ok {
            return Err(CliError(format!(
                "the running relay (roam {}, state format {}) refused the takeover: {}",
                answer.version,
                answer.format,
                answer.error.unwrap_or_default()
            )));
        }
        let (l, rest) = crate::takeover::recv_listeners(sock)
            .map_err(|e| CliError(format!("takeover from {shown} failed part-way: {e}; the old relay keeps serving")))?;
        Ok(Received {
            listen: l.listen,
            listener: l.listener,
            metrics: l.metrics,
            rest,
        })
    })
    .await
    .map_err(|e| CliError(format!("takeover: {e}")))?
}

/// How long either side of a takeover waits on the other's socket.
const TAKEOVER_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// Binds the takeover socket (replacing a stale one; a live one belongs to
/// another relay unless `replace`, after a takeover).
fn bind_takeover_socket(path: &std::path::Path, replace: bool) -> Option<tokio::net::UnixListener> {
    if path.exists() && !replace && std::os::unix::net::UnixStream::connect(path).is_ok() {
        tracing::warn!(
            "no takeover socket: another relay serves {}; give this one its own --takeover-socket to upgrade it without loss",
            path.display()
        );
        return None;
    }
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        let _ = crate::paths::ensure_private_dir(dir);
    }
    match tokio::net::UnixListener::bind(path) {
        Ok(l) => {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
            Some(l)
        }
        Err(e) => {
            tracing::warn!("no takeover socket at {}: {e}", path.display());
            None
        }
    }
}

/// Serves takeovers: on a `roam serve --takeover` connection (or SIGUSR2,
/// which starts one), hands everything over and ends the relay; on any
/// failure puts the sessions back and goes on.
#[allow(clippy::too_many_arguments)]
async fn offer_takeover(
    listener: tokio::net::UnixListener,
    mut usr2: Option<tokio::signal::unix::Signal>,
    relay: Arc<Relay>,
    gate: watch::Sender<bool>,
    stats: roam::ServerStats,
    local: String,
    listener_fd: OwnedFd,
    metrics_fd: Option<OwnedFd>,
    handed_over: Arc<tokio::sync::Notify>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = async { match usr2.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {
                start_successor();
                continue;
            }
        };
        let sock = match conn.and_then(|(c, _)| c.into_std()) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("takeover socket: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let hello = tokio::task::spawn_blocking(move || {
            let mut sock = sock;
            let _ = sock.set_nonblocking(false);
            let _ = sock.set_read_timeout(Some(TAKEOVER_IO_TIMEOUT));
            let _ = sock.set_write_timeout(Some(TAKEOVER_IO_TIMEOUT));
            let r = crate::takeover::answer(&mut sock, crate::takeover::STATE_FORMAT);
            (sock, r)
        })
        .await;
        let (sock, hello) = match hello {
            Ok((sock, Ok(Ok(_)))) if !same_user(&sock) => {
                tracing::warn!("takeover refused: the new process runs as another user");
                continue;
            }
            Ok((sock, Ok(Ok(hello)))) => (sock, hello),
            Ok((_, Ok(Err(refusal)))) => {
                tracing::warn!("takeover refused: {refusal}");
                eprintln_whole!("roam serve: takeover refused: {refusal}");
                continue;
            }
            Ok((_, Err(e))) => {
                tracing::warn!("takeover socket: {e}");
                continue;
            }
            Err(e) => {
                tracing::warn!("takeover: {e}");
                continue;
            }
        };
        let started = Instant::now();
        eprintln_whole!(
            "roam serve: handing over to a new relay (roam {})",
            hello.version
        );
        gate.send_replace(true);
        crate::sdnotify::notify("RELOADING=1\nSTATUS=handing over to a new relay");
        // Shells first: their clients are told to re-attach (to the next
        // relay) while their sessions are still here to carry it.
        relay.streams_paused.send_replace(true);
        let shells = match relay.shells.get() {
            Some(host) => host.take_all().await,
            None => Vec::new(),
        };
        let (listener_dup, metrics_dup) = (
            listener_fd.try_clone(),
            metrics_fd.as_ref().map(|f| f.try_clone()).transpose(),
        );
        let (Ok(listener_dup), Ok(metrics_dup)) = (listener_dup, metrics_dup) else {
            tracing::error!("takeover failed: cannot duplicate the listening sockets; serving on");
            // Shells first, so that a client's re-attach finds its shell.
            relay.adopt_shells(shells);
            relay.resume_after_failed_handover(Vec::new());
            gate.send_replace(false);
            continue;
        };
        let fail = |e: String, moved: usize, shells: Vec<crate::shell::host::HandedShell>| {
            if moved == 0 {
                tracing::error!("takeover failed part-way ({e}); the sessions stay here");
                eprintln_whole!("roam serve: takeover failed part-way ({e}); serving on");
            } else {
                tracing::error!("takeover failed part-way ({e}) after {moved} sessions moved to the new relay; serving the rest here");
                eprintln_whole!("roam serve: takeover failed part-way ({e}) after {moved} sessions moved to the new relay; serving the rest");
            }
            crate::sdnotify::notify(&format!(
                "MAINPID={}\nREADY=1\nSTATUS=takeover failed; serving on",
                std::process::id()
            ));
            relay.adopt_shells(shells);
            relay.resume_after_failed_handover(Vec::new());
            gate.send_replace(false);
        };
        let local2 = local.clone();
        let sent = tokio::task::spawn_blocking(move || {
            let r = crate::takeover::send_listeners(
                &sock,
                &local2,
                &listener_dup,
                metrics_dup.as_ref(),
            );
            (sock, r)
        })
        .await;
        let sock = match sent {
            Ok((sock, Ok(()))) => Arc::new(sock),
            Ok((_, Err(e))) => {
                fail(e.to_string(), 0, shells);
                continue;
            }
            Err(e) => {
                fail(e.to_string(), 0, shells);
                continue;
            }
        };
        // Wave after wave: each is taken out, sent and committed by the new
        // relay's receipt while the later ones keep running here.
        let deadline = Instant::now() + HANDOVER_WAIT;
        let (mut moved, mut waves) = (0usize, 0usize);
        let (mut taking_out, mut sending) = (Duration::ZERO, Duration::ZERO);
        let mut failed = None;
        loop {
            let t = Instant::now();
            let stopped_ns = crate::takeover::monotonic_ns();
            let wave = relay
                .take_wave(crate::takeover::WAVE, &stats, deadline)
                .await;
            taking_out += t.elapsed();
            if wave.is_empty() {
                break;
            }
            let t = Instant::now();
            let s = sock.clone();
            let sent = tokio::task::spawn_blocking(move || {
                let r = crate::takeover::send_wave(&s, &wave, stopped_ns);
                (wave, r)
            })
            .await;
            sending += t.elapsed();
            match sent {
                Ok((wave, Ok(()))) => {
                    moved += wave.len();
                    waves += 1;
                    // Our copies of its sockets close; the new relay's
                    // keep them open.
                    drop(wave);
                }
                Ok((wave, Err(e))) => {
                    relay.park(wave);
                    failed = Some(e.to_string());
                    break;
                }
                Err(e) => {
                    failed = Some(format!("{e}; a wave of sessions was lost"));
                    break;
                }
            }
        }
        if let Some(e) = failed {
            fail(e, moved, shells);
            continue;
        }
        let t = Instant::now();
        let sent = tokio::task::spawn_blocking(move || {
            let r = crate::takeover::send_end(&sock, &shells, moved);
            (shells, r)
        })
        .await;
        sending += t.elapsed();
        match sent {
            Ok((shells, Ok(()))) => {
                eprintln_whole!(
                    "roam serve: handed {moved} sessions and {} shells to the new relay in {} ms ({} ms taking them out, {} ms sending, {waves} waves); exiting",
                    shells.len(),
                    started.elapsed().as_millis(),
                    taking_out.as_millis(),
                    sending.as_millis(),
                );
                drop(shells);
                relay
                    .handoffs
                    .out
                    .fetch_add(moved as u64, Ordering::Relaxed);
                handed_over.notify_one();
                return;
            }
            Ok((shells, Err(e))) => fail(e.to_string(), moved, shells),
            Err(e) => fail(format!("{e}; the shells were lost"), moved, Vec::new()),
        }
    }
}

/// Whether the process on the other end of `sock` runs as this user (or as
/// root): only they may take the relay's sessions (the socket is 0600 in a
/// 0700 directory as well).
fn same_user(sock: &std::os::unix::net::UnixStream) -> bool {
    match rustix::net::sockopt::socket_peercred(sock) {
        Ok(c) => {
            let peer = c.uid.as_raw();
            peer == 0 || peer == nix::unistd::getuid().as_raw()
        }
        Err(_) => false,
    }
}

/// SIGUSR2: starts `roam serve --takeover` from this executable with this
/// process's arguments (the new binary, if it was replaced on disk).
fn start_successor() {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("SIGUSR2: cannot find this executable: {e}");
            return;
        }
    };
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if !args.iter().any(|a| a == "--takeover") {
        args.push("--takeover".into());
    }
    match std::process::Command::new(&exe).args(&args).spawn() {
        Ok(child) => eprintln_whole!(
            "roam serve: SIGUSR2: started {} --takeover (pid {})",
            exe.display(),
            child.id()
        ),
        Err(e) => tracing::error!("SIGUSR2: cannot start {}: {e}", exe.display()),
    }
}

/// Completes on Ctrl-C or SIGTERM; the handlers are installed by the call
/// (a signal sent once the server said it listens is never the default
/// action's).
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    let signal = crate::signals::interrupt_or_terminate();
    async move {
        signal.await;
    }
}

/// What the sessions of one relay share: the policy, the caps, and the
/// state of a handover (`crate::takeover`).
pub(crate) struct Relay {
    rules: Arc<Vec<AllowRule>>,
    targets: Arc<TargetCaps>,
    registry: Option<Registry>,
    /// The protocol configuration parked sessions are restored with.
    proto: roam_proto::ServerConfig,
    /// `true` while the relay hands over: session tasks stop accepting
    /// streams, pumps stop, and each session is taken out into `handed`.
    handing: watch::Sender<bool>,
    /// `true` while shells are taken out, just before `handing`: sessions
    /// accept no new stream, so a client's re-attach (it was told to)
    /// waits in its session and moves with it to the next relay.
    streams_paused: watch::Sender<bool>,
    /// Session tasks running (each hands its session over or ends).
    live: AtomicUsize,
    /// Running session tasks, by a key of their own: what a handover wave
    /// sends to one of them to have it hand its session over.
    tasks: Mutex<HashMap<u64, oneshot::Sender<HandOver>>>,
    /// Sessions moved by takeovers, and how long those taken over here
    /// were stopped (the metrics read them).
    pub(crate) handoffs: Arc<crate::metrics::Handoffs>,
    /// The next key in `tasks`.
    next_task: std::sync::atomic::AtomicU64,
    /// Sessions received in a handover (or put back after a failed one),
    /// waiting for their client's resume, and since when.
    parked: Mutex<HashMap<roam::SessionId, Box<Parked>>>,
    /// How long a parked session waits for its client.
    suspend_timeout: Duration,
    /// Park a session suspended this long (`--park-after`; milliseconds,
    /// `u64::MAX`: never).
    park_after_ms: AtomicU64,
    /// Sessions being parked right now (a resume for one is told to retry).
    parking: Mutex<std::collections::HashSet<roam::SessionId>>,
    /// The shells (`--shell`), if this relay serves them.
    pub(crate) shells: std::sync::OnceLock<Arc<crate::shell::host::ShellHost>>,
    /// Hands sessions that came with their client connection to the server.
    adopter: roam::Adopter,
    /// The server's end of `adopter` (its config takes it).
    adoptions: roam::Adoptions,
    /// How streams reach their targets when not by a plain TCP connect
    /// (`roam run` reaches its program's listeners this way).
    dialer: std::sync::OnceLock<Arc<dyn Dialer>>,
}

/// A connection a [`Dialer`] made, with what it must keep alive as long as
/// the connection is relayed.
pub(crate) type Dialed = (TcpStream, Box<dyn Send>);

/// How a relay reaches a stream's target instead of a TCP connect to it:
/// the seam `roam run` uses to hand incoming sessions to the program it
/// runs (and to tell it who the client is).
pub(crate) trait Dialer: Send + Sync {
    /// Connects to the target `host:port` of a stream of `session` (whose
    /// client is at `session.stats().peer_addr`, and may move). The error is
    /// logged and the stream reset as an unreachable target.
    fn dial<'a>(
        &'a self,
        host: &'a str,
        port: u16,
        session: &'a roam::SessionHandle,
    ) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<Dialed>> + Send + 'a>>;
}

impl Relay {
    /// A relay with `rules` and `targets` whose parked sessions are restored
    /// under `proto`; it counts takeovers in `handoffs`.
    pub(crate) fn new(
        rules: Arc<Vec<AllowRule>>,
        targets: Arc<TargetCaps>,
        registry: Option<Registry>,
        proto: roam_proto::ServerConfig,
        handoffs: Arc<crate::metrics::Handoffs>,
    ) -> Arc<Self> {
        let suspend_timeout = proto.session.resume_timeout;
        let (adopter, adoptions) = roam::adoption_queue();
        Arc::new(Self {
            rules,
            targets,
            registry,
            proto,
            handing: watch::channel(false).0,
            streams_paused: watch::channel(false).0,
            live: AtomicUsize::new(0),
            tasks: Mutex::new(HashMap::new()),
            handoffs,
            next_task: std::sync::atomic::AtomicU64::new(0),
            parked: Mutex::new(HashMap::new()),
            suspend_timeout,
            park_after_ms: AtomicU64::new(u64::MAX),
            parking: Mutex::new(std::collections::HashSet::new()),
            shells: std::sync::OnceLock::new(),
            adopter,
            adoptions,
            dialer: std::sync::OnceLock::new(),
        })
    }

    /// Reaches targets through `dialer` from now on, instead of a TCP
    /// connect (set once; later calls are ignored).
    pub(crate) fn set_dialer(&self, dialer: Arc<dyn Dialer>) {
        let _ = self.dialer.set(dialer);
    }

    /// Parks sessions suspended for `d` from now on.
    pub(crate) fn set_park_after(&self, d: Duration) {
        self.park_after_ms.store(
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// How long a session stays suspended before it is parked, if ever.
    fn park_after(&self) -> Option<Duration> {
        match self.park_after_ms.load(Ordering::Relaxed) {
            u64::MAX => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// The parked sessions, for `roam status`.
    pub(crate) fn parked_status(&self) -> Vec<crate::control::SessionStatus> {
        let now = std::time::SystemTime::now();
        self.parked()
            .values()
            .map(|p| (&p.session, p.suspended_for()))
            .map(|(s, suspended)| crate::control::SessionStatus {
                label: "relay session (parked)".into(),
                session_id: Some(s.id.to_string()),
                role: "server".into(),
                state: "suspended".into(),
                peer_addr: None,
                rtt_ms: None,
                bytes_sent: 0,
                bytes_received: 0,
                bytes_replayed: 0,
                resumes: 0,
                streams: s.streams.len(),
                suspended_since: now
                    .checked_sub(suspended)
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs()),
                suspended_for_secs: Some(suspended.as_secs_f64()),
                parked: true,
            })
            .collect()
    }

    fn parking(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<roam::SessionId>> {
        self.parking.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn parked(&self) -> std::sync::MutexGuard<'_, HashMap<roam::SessionId, Box<Parked>>> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves shells handed over (or given back by a failed takeover); a
    /// relay started without `--shell` serves them anyway (they would die
    /// otherwise) with the default key files.
    pub(crate) fn adopt_shells(&self, shells: Vec<crate::shell::host::HandedShell>) {
        if shells.is_empty() {
            return;
        }
        let host = self
            .shells
            .get_or_init(|| {
                tracing::warn!(
                    "shells were handed over to a relay without --shell: serving them anyway"
                );
                crate::shell::host::ShellHost::new(None, None)
            })
            .clone();
        for sh in shells {
            let name = sh.name.clone();
            if let Err(e) = host.adopt(sh) {
                tracing::error!("shell {name} could not be adopted: {e}");
            }
        }
    }

    /// Takes on sessions handed over (or given back by a failed takeover):
    /// one that came with its client connection runs on it at once (the
    /// server adopts it); the others wait for their client's resume.
    pub(crate) fn park(self: &Arc<Self>, sessions: Vec<HandedSession>) {
        let now = Instant::now();
        let mut waiting = Vec::new();
        for mut s in sessions {
            let from_takeover = s.stopped_ns.is_some();
            let Some(live) = s.live.take() else {
                if from_takeover {
                    self.handoffs.resume_in.fetch_add(1, Ordering::Relaxed);
                }
                waiting.push(s);
                continue;
            };
            if from_takeover {
                self.handoffs.moved_in.fetch_add(1, Ordering::Relaxed);
            }
            let id = s.id;
            let Some(restored) = self.restore_handed(s, Duration::ZERO) else {
                continue;
            };
            if self
                .adopter
                .adopt(roam::Adoption { restored, live })
                .is_err()
            {
                tracing::error!(
                    "handed-over session {id}: the server has stopped; its connections close"
                );
            }
        }
        let mut p = self.parked();
        for s in waiting {
            p.insert(s.id, Parked::new(s, now, Duration::ZERO));
        }
    }

    /// Drops parked sessions whose clients did not come back within the
    /// suspend timeout (their target connections close).
    fn expire_parked(&self) {
        let timeout = self.suspend_timeout;
        self.parked().retain(|id, p| {
            let keep = p.suspended_for() < timeout;
            if !keep {
                tracing::info!(
                    "parked session {id} expired: its client did not resume within {timeout:?}"
                );
            }
            keep
        });
    }

    /// Asked by the server for a resume that names a session it does not
    /// hold: a parked one is restored and its relays start again.
    async fn lookup(self: Arc<Self>, id: roam::SessionId) -> roam::LookupResult {
        let Some(p) = self.parked().remove(&id) else {
            if *self.handing.borrow() || self.parking().contains(&id) {
                // A resume that reached this relay while it hands over (its
                // handshake began before the accept gate closed: the
                // session is on its way to the next relay) or while the
                // session is being parked (it is in the map a moment
                // later). "Busy, try again" brings the client back;
                // "unknown" would count towards giving the session up.
                return Err(roam_proto::Error::ServerBusy);
            }
            return Ok(None);
        };
        let offline = p.at.elapsed();
        Ok(self.restore_handed(p.session, offline))
    }

    /// Restores a handed-over session (`offline`: how long it was parked)
    /// as the server installs it; once installed, its relays start again.
    /// `None` when its state is refused (logged; its target connections
    /// close).
    fn restore_handed(
        self: &Arc<Self>,
        parked: HandedSession,
        offline: Duration,
    ) -> Option<roam::Restored> {
        let id = parked.id;
        let stopped_ns = parked.stopped_ns;
        // Counted from here: a handover now waits for this session to be
        // installed (or dropped) rather than miss it in between.
        let live = LiveGuard::new(self);
        let session = match roam_proto::Session::restore_server(
            &self.proto,
            std::time::Instant::now(),
            &parked.detached.blob,
            offline,
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("handed-over session {id}: its state was refused ({e}); its target connections close");
                return None;
            }
        };
        let HandedSession {
            detached, streams, ..
        } = parked;
        let relay = self.clone();
        Some(roam::Restored::new(
            session,
            detached.unaccepted,
            detached.orphans,
            Box::new(move |handle: roam::SessionHandle| {
                if let Some(ns) = stopped_ns {
                    let us = crate::takeover::monotonic_ns().saturating_sub(ns) / 1000;
                    relay
                        .handoffs
                        .stops_us
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(us);
                }
                tracing::debug!(
                    "handed-over session {id} resumed; {} streams relayed again",
                    streams.len()
                );
                if let Some(r) = &relay.registry {
                    r.add_restored(
                        format!("relay session from {}", fmt_peer(handle.stats().peer_addr)),
                        handle.clone(),
                    );
                }
                tokio::spawn(run_session(relay, handle, streams, live));
            }),
        ))
    }

    /// Takes the next wave of sessions (at most `max`) out of their pumps
    /// and drivers for a handover: parked ones first, then running ones.
    /// The caller has stopped the server accepting. Empty when none is left
    /// (or `deadline` passed with sessions still starting: they are not
    /// handed over).
    pub(crate) async fn take_wave(
        &self,
        max: usize,
        stats: &roam::ServerStats,
        deadline: Instant,
    ) -> Vec<HandedSession> {
        // Resumes of parked sessions are answered "busy" from here on, and
        // sessions still in their handshake get a task when it completes,
        // which a later wave takes.
        self.handing.send_replace(true);
        let mut out: Vec<HandedSession> = {
            let mut p = self.parked();
            let ids: Vec<roam::SessionId> = p.keys().take(max).copied().collect();
            ids.iter()
                .filter_map(|id| p.remove(id))
                .map(|p| p.session)
                .collect()
        };
        if !out.is_empty() {
            return out;
        }
        loop {
            let triggers: Vec<oneshot::Sender<HandOver>> = {
                let mut t = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
                let keys: Vec<u64> = t.keys().take(max).copied().collect();
                keys.iter().filter_map(|k| t.remove(k)).collect()
            };
            if !triggers.is_empty() {
                let replies: Vec<_> = triggers
                    .into_iter()
                    .filter_map(|t| {
                        let (tx, rx) = oneshot::channel();
                        t.send(tx).ok().map(|()| rx)
                    })
                    .collect();
                for rx in replies {
                    if let Ok(Some(h)) = rx.await {
                        out.push(h);
                    }
                }
                if out.is_empty() {
                    // They all ended meanwhile.
                    continue;
                }
                return out;
            }
            let live = self.live.load(Ordering::SeqCst);
            let held = stats.usage().sessions;
            if live == 0 && held == 0 {
                return out;
            }
            if Instant::now() >= deadline {
                tracing::warn!("handover: {live} session tasks and {held} sessions still starting or ending after {HANDOVER_WAIT:?}; they are not handed over");
                return out;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Registers a running session task: `trigger` asks it to hand its
    /// session over. Unregistered when the returned guard drops.
    fn register(self: &Arc<Self>, trigger: oneshot::Sender<HandOver>) -> TaskGuard {
        let key = self.next_task.fetch_add(1, Ordering::SeqCst);
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, trigger);
        TaskGuard(self.clone(), key)
    }

    /// After a failed handover: the sessions wait here for their clients
    /// again and the relay goes on.
    pub(crate) fn resume_after_failed_handover(self: &Arc<Self>, sessions: Vec<HandedSession>) {
        self.streams_paused.send_replace(false);
        self.park(sessions);
        self.handing.send_replace(false);
    }
}

/// Once the sessions of a takeover run here (or after 5 s), says how long
/// they were stopped: from the old relay stopping each to this one running
/// it (sessions whose client connection did not move count once their
/// client resumed).
async fn report_stops(relay: Arc<Relay>, sessions: usize) {
    let end = Instant::now() + Duration::from_secs(5);
    let v = loop {
        let v = relay.handoffs.stops();
        if v.len() >= sessions || Instant::now() >= end {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    if v.is_empty() {
        return;
    }
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    eprintln_whole!(
        "roam serve: {} of {sessions} handed-over sessions running here; each was stopped for p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (from the old relay stopping it to this one running it)",
        v.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}

/// Where a session task sends its session when a handover wave takes it
/// (`None`: it could not be handed over, e.g. it had just ended).
type HandOver = oneshot::Sender<Option<HandedSession>>;

/// Keeps a session task in [`Relay::tasks`] while it runs.
struct TaskGuard(Arc<Relay>, u64);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

/// How long a handover waits for every session to be taken out.
const HANDOVER_WAIT: Duration = Duration::from_secs(5);

/// Counts a session in [`Relay::live`] from the moment the relay takes it
/// on (a new session's callback, a parked session's lookup) until its task
/// ends, so that a handover waits for it.
struct LiveGuard(Arc<Relay>);

impl LiveGuard {
    fn new(relay: &Arc<Relay>) -> Self {
        relay.live.fetch_add(1, Ordering::SeqCst);
        Self(relay.clone())
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Starts this host's relay for an agent (`roam run` around a server,
/// `roam intercept --incoming`): on `port` of every address, with the state
/// directory's server key (any client key), every stream reaching its
/// target through `dialer`, until `stop` turns true. Returns the server key.
pub(crate) async fn start_host_relay(
    port: u16,
    state: &std::path::Path,
    registry: Registry,
    dialer: Arc<dyn Dialer>,
    mut stop: watch::Receiver<bool>,
) -> Result<roam_proto::PublicKey, String> {
    // Every address, IPv6 (and IPv4 through it) where the host has IPv6.
    let listener = match crate::limits::listen(&format!("[::]:{port}")).await {
        Ok(l) => l,
        Err(_) => {
            let at = format!("0.0.0.0:{port}");
            crate::limits::listen(&at)
                .await
                .map_err(|e| format!("cannot listen on {at} ({e})"))?
        }
    };
    let keypair = crate::keys::load_or_create(&state.join("server.key"))
        .map_err(|e| format!("has no server key ({})", e.0))?;
    let public = keypair.public();
    let config = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: None,
        addresses: Vec::new(),
        session: roam_proto::Config::default(),
    });
    // Every target: the dialer decides which it reaches.
    let rules = Arc::new(vec![
        AllowRule::parse("*:*").map_err(|e| format!("cannot allow targets ({e})"))?
    ]);
    let relay = Relay::new(
        rules,
        TargetCaps::new(1024, crate::limits::DEFAULT_TARGETS_PER_SESSION),
        Some(registry),
        config.proto.clone(),
        Arc::default(),
    );
    relay.set_dialer(dialer);
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = serve_relay(listener, config, relay, shutdown).await {
            eprintln!("roam: the relay on port {port} stopped: {e}");
        }
    });
    Ok(public)
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
    let relay = Relay::new(
        rules,
        targets,
        registry,
        config.proto.clone(),
        Arc::default(),
    );
    serve_relay(listener, config, relay, shutdown).await
}

/// Runs `relay` on `listener` until `shutdown`, restoring parked sessions
/// when their clients resume.
pub(crate) async fn serve_relay(
    listener: TcpListener,
    mut config: roam::ServerConfig,
    relay: Arc<Relay>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let sweeper = {
        let relay = Arc::downgrade(&relay);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                match relay.upgrade() {
                    Some(r) => r.expire_parked(),
                    None => return,
                }
            }
        })
    };
    let on_session = {
        let relay = relay.clone();
        move |session: roam::SessionHandle| {
            let peer = session.stats().peer_addr;
            tracing::info!(
                "new session {} from {}",
                session.id().map(|i| i.to_string()).unwrap_or_default(),
                fmt_peer(peer)
            );
            if let Some(r) = &relay.registry {
                r.add(
                    format!("relay session from {}", fmt_peer(peer)),
                    session.clone(),
                );
            }
            let live = LiveGuard::new(&relay);
            tokio::spawn(run_session(relay.clone(), session, Vec::new(), live));
        }
    };
    let lookup = {
        let relay = relay.clone();
        move |id| relay.clone().lookup(id)
    };
    config.adoptions = Some(relay.adoptions.clone());
    let r = roam::serve_with_restore(listener, config, shutdown, on_session, lookup).await;
    sweeper.abort();
    r
}

/// One session's task: relays each stream the client opens (and, after a
/// handover, those it brought along) until the session ends or the relay
/// hands over, when a wave ([`Relay::take_wave`]) takes the session out.
async fn run_session(
    relay: Arc<Relay>,
    session: roam::SessionHandle,
    resumed: Vec<HandedStream>,
    _live: LiveGuard,
) {
    let handing = relay.handing.subscribe();
    let mut paused = relay.streams_paused.subscribe();
    let (trigger_tx, mut trigger) = oneshot::channel::<HandOver>();
    let _registered = relay.register(trigger_tx);
    // Stops this session's relays when a wave takes it or it is parked.
    let (stop_tx, stop) = watch::channel(false);
    let leave: Leave;
    let mut triggered = false;
    // Parking: once suspended for --park-after (never a session that
    // carries a shell: the shell host parks shells its own way). Checked by
    // a timer, not by subscribing to the session's events: a subscription
    // costs each session its event buffer (~26 KiB).
    let park_after = relay.park_after();
    let mut park_check = park_after.map(|d| tokio::time::Instant::now() + d.max(PARK_CHECK_MIN));
    let mut has_shell = false;
    let mut relays: JoinSet<Option<(HandedStream, RoamStream)>> = JoinSet::new();
    for st in resumed {
        match session.stream(roam::StreamId(st.id)) {
            Ok(stream) => {
                relays.spawn(relay_stream(
                    relay.clone(),
                    stream,
                    st.target.clone(),
                    session.clone(),
                    Some(st),
                    stop.clone(),
                ));
            }
            Err(e) => tracing::warn!("handed-over stream {} to {} is gone: {e}", st.id, st.target),
        }
    }
    let mut streams = Vec::new();
    let mut handles = Vec::new();
    loop {
        tokio::select! {
            _ = sleep_until_some(park_check) => {
                let Some(d) = park_after else { continue };
                let st = session.stats();
                let now = tokio::time::Instant::now();
                match st.suspended_for {
                    // A session with no open stream is left to its own, much
                    // shorter, idle expiry (--idle-suspend-timeout).
                    Some(f) if st.state == roam::State::Suspended
                        && f >= d
                        && !has_shell
                        && st.streams > 0 =>
                    {
                        leave = Leave::Park(f);
                        break;
                    }
                    Some(f) if st.state == roam::State::Suspended => {
                        park_check = Some(now + d.saturating_sub(f).max(PARK_CHECK_MIN));
                    }
                    _ => park_check = Some(now + d.max(PARK_CHECK_MIN)),
                }
            }
            _ = paused.changed() => {}
            r = session.accept_stream(), if !*handing.borrow() && !*paused.borrow() => match r {
                Ok((stream, meta)) => {
                    if let Some(open) = crate::shell::wire::Open::parse(&meta) {
                        has_shell = true;
                        match relay.shells.get() {
                            Some(host) => {
                                tokio::spawn(host.clone().serve(stream, Some(session.clone()), open));
                            }
                            None => {
                                tokio::spawn(crate::shell::host::refuse(
                                    stream,
                                    "this relay does not serve shells (it runs without --shell)".into(),
                                ));
                            }
                        }
                        continue;
                    }
                    let target = String::from_utf8_lossy(&meta).into_owned();
                    relays.spawn(relay_stream(relay.clone(), stream, target, session.clone(), None, stop.clone()));
                }
                Err(_) => {
                    // Over: the relays end with the session (each delivers
                    // what the session still holds for its target; the
                    // `stop_tx` dropped here asks them nothing).
                    relays.detach_all();
                    return;
                }
            },
            Some(r) = relays.join_next(), if !relays.is_empty() => {
                // A relay that stopped for a handover (it may finish before
                // this loop sees `handing`): keep what it hands over.
                if let Ok(Some((st, handle))) = r {
                    streams.push(st);
                    handles.push(handle);
                }
            }
            r = &mut trigger, if !triggered => {
                triggered = true;
                // Dropped without a wave (the relay is going away): serve on.
                if let Ok(to) = r {
                    leave = Leave::Wave(to);
                    break;
                }
            }
        }
    }
    let _ = stop_tx.send(true);
    // Handing over: every relay stops where it is, then the session leaves
    // its driver. The streams stay open until the export is taken, so none
    // is reset as dropped.
    while let Some(r) = relays.join_next().await {
        if let Ok(Some((st, handle))) = r {
            streams.push(st);
            handles.push(handle);
        }
    }
    let reply = match leave {
        Leave::Wave(reply) => reply,
        Leave::Park(suspended_for) => {
            if let Err(streams) = park(&relay, &session, streams, suspended_for).await {
                // It ended instead (its client resumed and closed it, or
                // it expired): what its relays held still goes out.
                deliver_after_end(&relay, &session, streams, handles).await;
            }
            return;
        }
    };
    let Some(id) = session.id() else {
        let _ = reply.send(None);
        return;
    };
    match session.detach_live().await {
        Ok((detached, live)) => {
            let _ = reply.send(Some(HandedSession {
                id,
                detached,
                streams,
                live,
                stopped_ns: None,
            }));
            drop(handles);
        }
        Err(e) => {
            tracing::info!("session {id} not handed over: {e}");
            let _ = reply.send(None);
            // It ended as the wave came (its client closed it): there is
            // nothing to hand over, but its relays were stopped with what
            // the client sent before the close still on its way to the
            // targets. Deliver it, as the relays of a session that ends do;
            // this task (so the handover's wait for it) lasts until then.
            deliver_after_end(&relay, &session, streams, handles).await;
        }
    }
}

/// The relays of a session that ended while they were stopped for a
/// handover or for parking: each is run again, and finds its session
/// closed at once, so it does what the relay of a session that ends does:
/// delivers what its stream still holds to the target (the bytes it had
/// read first; dialing the target again if it was stopped while dialing),
/// within [`TARGET_DRAIN_LIMIT`], then closes the connection, and logs how
/// that went. `streams[i]` is what the relay of `handles[i]` returned.
async fn deliver_after_end(
    relay: &Arc<Relay>,
    session: &roam::SessionHandle,
    streams: Vec<HandedStream>,
    handles: Vec<RoamStream>,
) {
    // Never asked to stop: the sender lives until they are all done.
    let (_keep, stop) = watch::channel(false);
    let mut set = JoinSet::new();
    for (st, stream) in streams.into_iter().zip(handles) {
        set.spawn(relay_stream(
            relay.clone(),
            stream,
            st.target.clone(),
            session.clone(),
            Some(st),
            stop.clone(),
        ));
    }
    while set.join_next().await.is_some() {}
}

/// A session kept as its continuation, waiting for its client's resume.
struct Parked {
    session: HandedSession,
    /// Parked (or received in a handover) at: its continuation has been
    /// offline since.
    at: Instant,
    /// How long it had been suspended by then (its suspend timeout counts
    /// from the suspension).
    before: Duration,
}

impl Parked {
    /// Boxed: the map's table then holds a pointer per slot, not the whole
    /// session.
    fn new(session: HandedSession, at: Instant, before: Duration) -> Box<Self> {
        Box::new(Self {
            session,
            at,
            before,
        })
    }

    /// How long it has been suspended.
    fn suspended_for(&self) -> Duration {
        self.before + self.at.elapsed()
    }
}

/// The shortest interval between a session's checks for parking.
const PARK_CHECK_MIN: Duration = Duration::from_secs(1);

/// Why a session task lets go of its session.
enum Leave {
    /// A handover wave takes it: the session goes to this reply.
    Wave(HandOver),
    /// It has been suspended this long (at least `--park-after`): it
    /// becomes a parked continuation here.
    Park(Duration),
}

/// Completes at `t`, never without one.
async fn sleep_until_some(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Parks a suspended session: its continuation and its streams' target
/// connections (the relays are stopped already) wait in the parked map,
/// with no task or buffer, until its client resumes (`Relay::lookup`) or
/// the suspend timeout passes. A resume that arrives meanwhile is answered
/// "busy, try again" rather than "unknown". A session that ended meanwhile
/// is not parked: its streams come back.
async fn park(
    relay: &Arc<Relay>,
    session: &roam::SessionHandle,
    streams: Vec<HandedStream>,
    suspended_for: Duration,
) -> Result<(), Vec<HandedStream>> {
    let Some(id) = session.id() else {
        return Err(streams);
    };
    relay.parking().insert(id);
    match session.detach().await {
        Ok(detached) => {
            tracing::debug!(
                "session {id} parked after {:?} suspended",
                relay.park_after().unwrap_or_default()
            );
            let mut session = HandedSession {
                id,
                detached,
                streams,
                live: None,
                stopped_ns: None,
            };
            // Kept for days, perhaps: no spare capacity.
            session.detached.blob.shrink_to_fit();
            session.streams.shrink_to_fit();
            for st in &mut session.streams {
                st.up.pending.shrink_to_fit();
                st.down.pending.shrink_to_fit();
            }
            relay
                .parked()
                .insert(id, Parked::new(session, Instant::now(), suspended_for));
            relay.parking().remove(&id);
            Ok(())
        }
        Err(e) => {
            tracing::debug!("session {id} not parked: {e}");
            relay.parking().remove(&id);
            Err(streams)
        }
    }
}

fn fmt_peer(peer: Option<SocketAddr>) -> String {
    peer.map_or_else(|| "?".to_string(), |p| p.to_string())
}

/// How long a relay keeps delivering, to a target that reads slowly, the
/// bytes its session received before it closed.
const TARGET_DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Completes when the session's task asks its relays to stop (`stop` turns
/// `true`: a handover wave takes the session, or it is parked); never once
/// the task is gone. The task returns when its session ends and leaves the
/// relays to finish on their own, which drops the sender: that is no
/// request to stop. Taken for one, it made a relay hand its target
/// connection to nobody, closing it with every byte the session still held
/// for the target (up to a stream window) unsent, and nothing logged.
async fn stop_asked(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Connects one stream to its target (if allowed and under the caps) and
/// copies both ways until either side ends or the session does. A stream
/// handed over from another relay (`resumed`) brings its target connection
/// and the bytes in flight. Returns the stream's state when the relay hands
/// over (and the stream handle, to be dropped after the session's export).
/// `stop` is the session task's stop channel ([`stop_asked`]).
async fn relay_stream(
    relay: Arc<Relay>,
    mut stream: RoamStream,
    target: String,
    session: roam::SessionHandle,
    resumed: Option<HandedStream>,
    mut stop: watch::Receiver<bool>,
) -> Option<(HandedStream, RoamStream)> {
    let peer = fmt_peer(session.stats().peer_addr);
    let targets = &relay.targets;
    let parsed = match split_host_port(&target) {
        Ok((host, Some(port))) if !host.is_empty() => Some((host, port)),
        _ => None,
    };
    let Some((host, port)) = parsed else {
        tracing::warn!("refused stream from {peer}: target {target:?} is not HOST:PORT");
        targets.note_refused("bad_target");
        stream.reset(reset::BAD_TARGET);
        return None;
    };
    if !relay.rules.iter().any(|r| r.matches(&host, port)) {
        tracing::warn!(
            "refused stream from {peer} to {target}: target not allowed (permit it with --allow {target})"
        );
        targets.note_refused("not_allowed");
        stream.reset(reset::TARGET_NOT_ALLOWED);
        return None;
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
            return None;
        }
    };
    let (adopted, up, down) = match resumed {
        Some(st) => (st.tcp, st.up, st.down),
        None => (None, HalfState::default(), HalfState::default()),
    };
    // What the dialer keeps alive while the target connection is relayed.
    let mut _dial_keep: Option<Box<dyn Send>> = None;
    let mut tcp = match adopted {
        Some(fd) => {
            let std_tcp = std::net::TcpStream::from(fd);
            match std_tcp
                .set_nonblocking(true)
                .and_then(|()| TcpStream::from_std(std_tcp))
            {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(
                        "stream from {peer}: handed-over connection to {target} unusable: {e}"
                    );
                    stream.reset(reset::TARGET_UNREACHABLE);
                    return None;
                }
            }
        }
        None => {
            let connect = async {
                match relay.dialer.get() {
                    Some(d) => d
                        .dial(&host, port, &session)
                        .await
                        .map(|(t, keep)| (t, Some(keep))),
                    None => TcpStream::connect((host.as_str(), port))
                        .await
                        .map(|t| (t, None)),
                }
            };
            let dial = tokio::select! {
                d = tokio::time::timeout(TARGET_CONNECT_TIMEOUT, connect) => d,
                // Handing over while dialing: the new relay dials again.
                _ = stop_asked(&mut stop) => {
                    let id = stream.id().0;
                    return Some((HandedStream { id, target, tcp: None, up, down }, stream));
                }
            };
            let t = match dial {
                Ok(Ok((t, keep))) => {
                    _dial_keep = keep;
                    t
                }
                Ok(Err(e)) => {
                    tracing::warn!("stream from {peer}: cannot connect to {target}: {e}");
                    targets.note_refused("unreachable");
                    stream.reset(reset::TARGET_UNREACHABLE);
                    return None;
                }
                Err(_) => {
                    tracing::warn!("stream from {peer}: connecting to {target} timed out");
                    targets.note_refused("unreachable");
                    stream.reset(reset::TARGET_UNREACHABLE);
                    return None;
                }
            };
            let _ = t.set_nodelay(true);
            targets.note_connected();
            tracing::info!("stream from {peer} connected to {target}");
            t
        }
    };
    let mut ended_with = None;
    let end = crate::pump::pump_until(&mut stream, &mut tcp, up, down, async {
        tokio::select! {
            _ = stop_asked(&mut stop) => {}
            reason = session.closed() => ended_with = Some(reason),
        }
    })
    .await;
    let end = match (ended_with, end) {
        (Some(reason), PumpEnd::Stopped(up, _)) => {
            // The session is over: nobody can use this target connection again.
            // What the client sent before it closed is delivered first (a slow
            // target may still be reading it; a graceful close must not cut
            // it short), within a bound; then the connection closes.
            let drained = tokio::time::timeout(
                TARGET_DRAIN_LIMIT,
                crate::pump::finish_one(&mut stream, &mut tcp, up),
            )
            .await;
            tracing::info!(
                "stream from {peer} to {target} ended with its session ({}); {}",
                roam::Error::Closed(reason),
                match drained {
                    Ok(Ok(n)) => format!("its last {n} bytes delivered"),
                    Ok(Err(e)) => format!("delivering its last bytes: {e}"),
                    Err(_) => format!(
                        "the target did not take its last bytes within {TARGET_DRAIN_LIMIT:?}"
                    ),
                }
            );
            return None;
        }
        (_, end) => end,
    };
    match end {
        PumpEnd::Finished(Ok((up, down))) => {
            tracing::info!("stream from {peer} to {target} done: {up} bytes up, {down} down");
            None
        }
        PumpEnd::Finished(Err(e)) => {
            tracing::info!("stream from {peer} to {target} ended: {e}");
            stream.reset(roam_proto::code::NO_ERROR);
            // Not a clean end (the client reset its stream, say, because
            // its own connection died): the target gets a reset too, not
            // an end-of-stream that would pass a cut-off request as whole.
            let _ = socket2::SockRef::from(&tcp).set_linger(Some(std::time::Duration::ZERO));
            None
        }
        PumpEnd::Stopped(up, down) => {
            let fd = match tcp.into_std() {
                Ok(t) => OwnedFd::from(t),
                Err(e) => {
                    tracing::warn!(
                        "stream from {peer} to {target}: cannot hand over its connection: {e}"
                    );
                    stream.reset(roam_proto::code::NO_ERROR);
                    return None;
                }
            };
            let id = stream.id().0;
            Some((
                HandedStream {
                    id,
                    target,
                    tcp: Some(fd),
                    up,
                    down,
                },
                stream,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A relay allowing `target` (its protocol configuration, for the
    /// server), and a client configuration pinned to its key.
    fn relay_and_client(
        target: &str,
    ) -> (Arc<Relay>, roam_proto::ServerConfig, roam::ClientConfig) {
        let keypair = roam_proto::Keypair::generate().unwrap();
        let server_key = keypair.public();
        let proto = roam_proto::ServerConfig {
            keypair,
            authorized_keys: None,
            addresses: Vec::new(),
            session: roam_proto::Config::default(),
        };
        let relay = Relay::new(
            Arc::new(vec![AllowRule::parse(target).unwrap()]),
            TargetCaps::new(16, crate::limits::DEFAULT_TARGETS_PER_SESSION),
            None,
            proto.clone(),
            Arc::default(),
        );
        let mut client = roam::ClientConfig::new(roam_proto::ClientConfig {
            keypair: roam_proto::Keypair::generate().unwrap(),
            server_trust: roam_proto::ServerTrust::Pinned(server_key),
            session: roam_proto::Config::default(),
        });
        client.watch_network = false;
        (relay, proto, client)
    }

    /// What the relay of a test's one stream returned, with its session.
    type Relayed = (Option<(HandedStream, RoamStream)>, roam::SessionHandle);

    /// A relay server on loopback whose first session's first stream is
    /// relayed by `relay_stream` with `stop` as its stop channel; what the
    /// relay returns comes back on the receiver. Returns the server's
    /// address, that receiver, the server's shutdown and its task.
    async fn relay_one_stream(
        relay: Arc<Relay>,
        proto: roam_proto::ServerConfig,
        stop: watch::Receiver<bool>,
    ) -> (
        String,
        oneshot::Receiver<Relayed>,
        oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay_addr = listener.local_addr().unwrap().to_string();
        let (relayed_tx, relayed) = oneshot::channel::<Relayed>();
        let relayed_tx = Mutex::new(Some(relayed_tx));
        let (shut, shut_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(roam::serve(
            listener,
            roam::ServerConfig::new(proto),
            async move {
                let _ = shut_rx.await;
            },
            move |session: roam::SessionHandle| {
                let relay = relay.clone();
                let stop = stop.clone();
                let tx = relayed_tx.lock().unwrap().take();
                tokio::spawn(async move {
                    let (stream, meta) = session.accept_stream().await.unwrap();
                    let target = String::from_utf8(meta).unwrap();
                    let r = relay_stream(relay, stream, target, session.clone(), None, stop).await;
                    if let Some(tx) = tx {
                        let _ = tx.send((r, session));
                    }
                });
            },
        ));
        (relay_addr, relayed, shut, server)
    }

    /// A relay whose session task is gone — it returns when its session
    /// ends and leaves the relays to finish, dropping their stop channel's
    /// sender — still delivers to its target every byte the client sent
    /// before it closed the session, then closes the target connection.
    /// Before, the dropped sender read as a stop: the relay handed its
    /// target connection to nobody (closing it) with what it held unsent.
    /// Under `roam serve` that took the session task winning a race at the
    /// close (a slow target lost the last ~900 KiB of 24 MiB now and then);
    /// here the sender is gone from the start, so it is not left to chance.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_whose_session_task_is_gone_delivers_every_byte_sent_before_the_close() {
        const UPLOAD: usize = 1 << 20;
        // The target: accepts, says so, and reads nothing until told to
        // (after the close), then reads to end-of-file.
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target_addr = target.local_addr().unwrap().to_string();
        let (accepted_tx, accepted) = oneshot::channel();
        let (go, go_rx) = oneshot::channel::<()>();
        let reader = tokio::spawn(async move {
            let (mut c, _) = target.accept().await.unwrap();
            let _ = accepted_tx.send(());
            let _ = go_rx.await;
            let mut got = Vec::new();
            c.read_to_end(&mut got).await.map(|_| got)
        });

        // The relay's side: one stream, relayed with a stop channel whose
        // sender is already gone.
        let (relay, proto, client) = relay_and_client(&target_addr);
        let (relay_addr, mut ended, shut, server) =
            relay_one_stream(relay, proto, watch::channel(false).1).await;

        // The client: opens the stream, waits for the target connection
        // (the relay is pumping), then sends, finishes and closes
        // (acknowledged: the relay's session has every byte, and is over).
        let limit = Duration::from_secs(30);
        let upload: Vec<u8> = (0..UPLOAD).map(|i| (i % 251) as u8).collect();
        let run = async {
            let session = roam::connect(&relay_addr, client).await.unwrap();
            let mut stream = session.open_stream(target_addr.as_bytes()).unwrap();
            tokio::select! {
                r = accepted => r.unwrap(),
                r = &mut ended => panic!(
                    "the relay ended before it connected (handed over: {})",
                    r.is_ok_and(|(h, _)| h.is_some())
                ),
            }
            let mut wrote = stream.write_all(&upload).await;
            if wrote.is_ok() {
                wrote = stream.shutdown().await;
            }
            let closed = session.close(roam_proto::code::NO_ERROR, "").await;
            let _ = go.send(());
            let got = reader.await.unwrap().unwrap();
            let handed = (&mut ended).await.unwrap().0.map(|(st, _)| st.id);
            (wrote, closed, got, handed)
        };
        let (wrote, closed, got, handed) = tokio::time::timeout(limit, run)
            .await
            .expect("the relay delivered within 30 s");
        assert_eq!(handed, None, "the relay must not hand its stream over");
        assert_eq!(got.len(), UPLOAD, "bytes at the target");
        assert!(got == upload, "the target got other bytes");
        wrote.unwrap();
        assert!(
            matches!(closed, roam_proto::CloseReason::Local { .. }),
            "{closed:?}"
        );
        let _ = shut.send(());
        let _ = server.await;
    }

    /// A session whose client closes it while its relay is stopped for a
    /// handover (the wave and the close in the same instant: the session
    /// task's `detach_live` then finds it closed, and nothing is handed
    /// over) still delivers to the target every byte the client sent
    /// before the close, then closes the target connection
    /// (`deliver_after_end`). Before, the stopped relay's target connection
    /// was dropped with those bytes unsent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_closed_while_its_relay_is_stopped_for_a_handover_delivers_every_byte() {
        // Within the relay's stream window (1 MiB): the stopped relay's
        // session takes it all.
        const UPLOAD: usize = 512 << 10;
        // The target: says when it accepts a connection, reads nothing
        // until told to, then reads each connection to its end and reports
        // what it got. (A wave that stops the relay while it dials drops
        // that connection unused, and the relay dials again.)
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target_addr = target.local_addr().unwrap().to_string();
        let (accepted_tx, mut accepted) = tokio::sync::mpsc::unbounded_channel();
        let (go, go_rx) = watch::channel(false);
        let (got_tx, mut got_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = target.accept().await {
                let _ = accepted_tx.send(());
                let mut go = go_rx.clone();
                let got_tx = got_tx.clone();
                tokio::spawn(async move {
                    let _ = go.wait_for(|g| *g).await;
                    let mut got = Vec::new();
                    let _ = c.read_to_end(&mut got).await;
                    let _ = got_tx.send(got);
                });
            }
        });

        // The relay's side: one stream, relayed until the test's wave.
        let (relay, proto, client) = relay_and_client(&target_addr);
        let (wave, stop) = watch::channel(false);
        let (relay_addr, stopped, shut, server) =
            relay_one_stream(relay.clone(), proto, stop).await;

        let upload: Vec<u8> = (0..UPLOAD).map(|i| (i % 251) as u8).collect();
        let run = async {
            let session = roam::connect(&relay_addr, client).await.unwrap();
            let mut stream = session.open_stream(target_addr.as_bytes()).unwrap();
            accepted.recv().await.unwrap();
            // The wave stops the relay...
            wave.send_replace(true);
            let (handed, relay_session) = stopped.await.unwrap();
            let (st, handle) = handed.expect("a relay stopped by a wave hands its stream over");
            // ...and before the session task takes the session out, the
            // client sends (into the relay's session: its relay is
            // stopped, so nothing of it reaches the target) and closes:
            // there is nothing to hand over.
            let mut wrote = stream.write_all(&upload).await;
            if wrote.is_ok() {
                wrote = stream.shutdown().await;
            }
            let closed = session.close(roam_proto::code::NO_ERROR, "").await;
            relay_session.closed().await;
            let refused = relay_session.detach_live().await.err();
            go.send_replace(true);
            deliver_after_end(&relay, &relay_session, vec![st], vec![handle]).await;
            // Every connection the target got is closed now: one carries
            // the upload, any other (a dial the wave cut short) nothing.
            let mut got = Vec::new();
            while got.is_empty() {
                match tokio::time::timeout(Duration::from_secs(5), got_rx.recv()).await {
                    Ok(Some(g)) => got = g,
                    _ => break,
                }
            }
            (wrote, closed, refused, got)
        };
        let (wrote, closed, refused, got) = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .expect("delivered within 30 s");
        wrote.unwrap();
        assert!(
            matches!(closed, roam_proto::CloseReason::Local { .. }),
            "{closed:?}"
        );
        assert_eq!(refused, Some(roam_proto::ExportError::Closed));
        assert_eq!(got.len(), UPLOAD, "bytes at the target");
        assert!(got == upload, "the target got other bytes");
        let _ = shut.send(());
        let _ = server.await;
    }

    /// The race itself, through `serve_relay`: a session of several
    /// streams, each to a target that reads slowly, so the relay holds up
    /// to a stream window of each when the client's close arrives. The
    /// close wakes the session task before the streams' relays (it waits
    /// in `accept_stream`), so on one worker it returns first, and the
    /// relays found its stop channel's sender gone: at random, one in two
    /// lost what it held. Every byte must reach every target.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_of_several_streams_closed_with_bytes_held_delivers_them_all() {
        use sha2::{Digest, Sha256};
        const STREAMS: usize = 4;
        // Sessions in turn (each with a one in four chance, or so, of
        // ending with no relay losing the race).
        const ROUNDS: usize = 3;
        // Beyond what the kernel takes (the relay's send buffer grows to
        // 4 MiB), plus more than a window.
        const UPLOAD: usize = 6 << 20;
        // The targets: each reads 64 KiB per millisecond at most, and
        // reports the length and digest of what it got at end-of-file.
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target_addr = target.local_addr().unwrap().to_string();
        let (report, mut reports) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let Ok((mut c, _)) = target.accept().await else {
                    return;
                };
                let report = report.clone();
                tokio::spawn(async move {
                    let mut h = Sha256::new();
                    let mut n = 0usize;
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match c.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => {
                                h.update(&buf[..k]);
                                n += k;
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                        }
                    }
                    let _ = report.send((n, h.finalize().to_vec()));
                });
            }
        });
        let (relay, proto, client) = relay_and_client(&target_addr);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay_addr = listener.local_addr().unwrap().to_string();
        let (shut, shut_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(serve_relay(
            listener,
            roam::ServerConfig::new(proto),
            relay,
            async move {
                let _ = shut_rx.await;
            },
        ));
        let upload: Arc<Vec<u8>> = Arc::new((0..UPLOAD).map(|i| (i % 251) as u8).collect());
        let want = Sha256::digest(&upload[..]).to_vec();
        for round in 0..ROUNDS {
            let got = tokio::time::timeout(
                Duration::from_secs(60),
                held_at_close(
                    &relay_addr,
                    client.clone(),
                    &target_addr,
                    STREAMS,
                    &upload,
                    &mut reports,
                ),
            )
            .await
            .expect("every target got end-of-file within 60 s");
            for (i, (n, digest)) in got.iter().enumerate() {
                assert_eq!(*n, UPLOAD, "round {round}: bytes at target {i}");
                assert!(*digest == want, "round {round}: target {i} got other bytes");
            }
        }
        let _ = shut.send(());
        let _ = server.await;
    }

    /// One session of [`a_session_of_several_streams_closed_with_bytes_held_delivers_them_all`]:
    /// `streams` streams each send `upload` and finish, the session is
    /// closed, and the targets' reports (length, digest) come back.
    async fn held_at_close(
        relay_addr: &str,
        client: roam::ClientConfig,
        target_addr: &str,
        streams: usize,
        upload: &Arc<Vec<u8>>,
        reports: &mut tokio::sync::mpsc::UnboundedReceiver<(usize, Vec<u8>)>,
    ) -> Vec<(usize, Vec<u8>)> {
        let session = roam::connect(relay_addr, client).await.unwrap();
        let mut writers = Vec::new();
        for _ in 0..streams {
            let mut stream = session.open_stream(target_addr.as_bytes()).unwrap();
            let upload = upload.clone();
            writers.push(tokio::spawn(async move {
                stream.write_all(&upload).await?;
                stream.shutdown().await?;
                // Kept until the close: a stream dropped unread
                // would be reset once its bytes are acknowledged.
                Ok::<_, std::io::Error>(stream)
            }));
        }
        let mut held = Vec::new();
        for w in writers {
            held.push(w.await.unwrap().unwrap());
        }
        let closed = session.close(roam_proto::code::NO_ERROR, "").await;
        assert!(
            matches!(closed, roam_proto::CloseReason::Local { .. }),
            "{closed:?}"
        );
        let mut got = Vec::new();
        for _ in 0..streams {
            got.push(reports.recv().await.unwrap());
        }
        drop(held);
        got
    }
}
