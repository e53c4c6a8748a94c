//! `roam forward`: a local port forward; every accepted connection is a new
//! stream of one shared session, so all of them survive network changes.

use tokio::net::TcpStream;

use crate::cli::{CliError, CliResult, ForwardArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay, explain_stream_error};
use crate::control::Registry;
use crate::target::{relay_addr, split_host_port};

/// `roam forward`.
pub(crate) async fn run(args: ForwardArgs, config: &FileConfig) -> CliResult {
    let (_, relay) = relay_addr(&args.relay)?;
    match split_host_port(&args.target)? {
        (h, Some(_)) if !h.is_empty() => {}
        _ => {
            return Err(CliError(format!(
                "target {:?} must be HOST:PORT",
                args.target
            )))
        }
    }
    crate::limits::raise_fd_limit();
    let listener = crate::limits::listen(&args.listen)
        .await
        .map_err(|e| CliError(format!("cannot listen on {}: {e}", args.listen)))?;
    let local = listener
        .local_addr()
        .map_or(args.listen.clone(), |a| a.to_string());
    let mut session = connect_relay(&relay, args.client.key.as_deref(), config)
        .await
        .map_err(|e| e.into_cli())?;
    let label = format!("forward {local} -> {relay} -> {}", args.target);
    let registry = Registry::default();
    registry.add(label.clone(), session.clone());
    tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
    let _control = crate::control::start(config, label.clone(), registry.clone());
    eprintln!("roam forward: {local} -> {} via {relay}", args.target);
    // Set when the relay lost the session: the next local connection opens a
    // new one (nothing else is lost: its streams are gone either way).
    let mut lost = false;
    let mut accept_log = roam::LogThrottle::new(std::time::Duration::from_secs(10));
    let result = loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, from)) => {
                    if lost {
                        match connect_relay(&relay, args.client.key.as_deref(), config).await {
                            Ok(s) => {
                                session = s;
                                lost = false;
                                registry.add(label.clone(), session.clone());
                                tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
                                crate::notices::notice(&format!("new session with relay {relay}"));
                            }
                            Err(e) => {
                                crate::notices::notice(&format!(
                                    "connection from {from} dropped: {}", e.into_cli().0
                                ));
                                continue;
                            }
                        }
                    }
                    let stream = match session.open_stream(args.target.as_bytes()) {
                        Ok(s) => s,
                        Err(e) => break Err(CliError(format!("session ended: {e}"))),
                    };
                    tokio::spawn(forward_one(tcp, stream, args.target.clone(), from));
                }
                Err(e) => {
                    // Out of file descriptors (or a connection that died in
                    // the backlog): retrying at once would spin, so pause,
                    // and log once per 10 s.
                    if let Some(n) = accept_log.allow(std::time::Instant::now()) {
                        tracing::warn!("accept failed: {e}; retrying ({n} more not logged)");
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            reason = session.closed(), if !lost => {
                if crate::notices::is_session_lost(&reason) {
                    crate::notices::notice(&format!(
                        "{}; the next connection to {local} opens a new session",
                        crate::notices::lost_message(&reason, &relay)
                    ));
                    lost = true;
                } else {
                    break Err(CliError(roam::Error::Closed(reason).to_string()));
                }
            }
            sig = crate::signals::exit_signal() => break Ok(128 + sig),
        }
    };
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(3),
        session.close(roam_proto::code::NO_ERROR, ""),
    )
    .await;
    result
}

async fn forward_one(
    mut tcp: TcpStream,
    mut stream: roam::RoamStream,
    target: String,
    from: std::net::SocketAddr,
) {
    let _ = tcp.set_nodelay(true);
    if let Err(e) = crate::pump::pump(&mut tcp, &mut stream).await {
        eprintln!(
            "roam forward: connection from {from}: {}",
            explain_stream_error(&e, &target)
        );
    }
}
