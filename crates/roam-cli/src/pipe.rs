//! `roam pipe`: stdin/stdout as one stream to a target through the relay
//! (an ssh `ProxyCommand`), with a direct-TCP fallback when the host runs no relay.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

use crate::cli::{CliError, CliResult, Fallback, PipeArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay, explain_stream_error, ConnectFailure};
use crate::control::Registry;
use crate::target::{is_loopback_host, join, pipe_target, relay_addr, split_host_port};

/// Copy buffer (bytes).
const COPY_BUF: usize = 64 * 1024;
/// How long to wait for the relay to acknowledge our close on exit.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// `roam pipe`.
pub(crate) async fn run(args: PipeArgs, config: &FileConfig) -> CliResult {
    let (relay_host, relay) = relay_addr(&args.relay)?;
    let (target, target_port) = pipe_target(&args.target)?;
    let fallback = if args.no_fallback {
        Fallback::Never
    } else {
        args.fallback
            .or(config.client.fallback)
            .unwrap_or(if config.client.no_fallback {
                Fallback::Never
            } else {
                Fallback::Auto
            })
    };
    let session = match connect_relay(&relay, args.client.key.as_deref(), config).await {
        Ok(s) => s,
        Err(ConnectFailure::Roam(e)) if e.is_no_roam_server() && fallback != Fallback::Never => {
            let state = crate::paths::state_dir(config);
            let known = crate::keys::KnownServers::new(&state);
            if fallback == Fallback::Auto {
                if let Some(pin) = crate::connect::pinned_key(&relay, &known).await? {
                    return Err(CliError(format!(
                        "no roam relay answers at {relay} ({e}), but its key is pinned (as {} in {}): refusing to fall back to an unprotected direct connection. Check that `roam serve` runs there; pass --fallback always to connect directly anyway",
                        pin.entry,
                        known.path().display()
                    )));
                }
            }
            let target_host = split_host_port(&target)?.0;
            let direct = if is_loopback_host(&target_host) {
                join(&relay_host, target_port)
            } else {
                target.clone()
            };
            eprintln!("roam: no roam relay at {relay} ({e}); connecting directly to {direct} without session protection");
            return direct_pipe(&direct).await;
        }
        Err(e) => return Err(e.into_cli()),
    };
    let registry = Registry::default();
    registry.add(format!("pipe {relay} -> {target}"), session.clone());
    let _control = crate::control::start(config, format!("pipe {relay} -> {target}"), registry);
    tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
    let stream = session
        .open_stream(target.as_bytes())
        .map_err(|e| CliError(e.to_string()))?;
    let (rd, wr) = tokio::io::split(stream);
    // A signal (ssh sends SIGHUP to its ProxyCommand on exit) drops the copy:
    // the stream is finished with what was written, and the session closed.
    let outcome = tokio::select! {
        r = shuttle(rd, wr) => Ok(r),
        sig = crate::signals::exit_signal() => Err(sig),
    };
    let closed =
        tokio::time::timeout(CLOSE_WAIT, session.close(roam_proto::code::NO_ERROR, "")).await;
    match outcome {
        Err(sig) => {
            tracing::info!(
                "signal {sig}: session closed ({})",
                if closed.is_ok() {
                    "acknowledged"
                } else {
                    "relay did not answer in time"
                }
            );
            Ok(128 + sig)
        }
        Ok(Ok(())) => Ok(0),
        Ok(Err(e)) => match closed {
            Ok(reason) if crate::notices::is_session_lost(&reason) => {
                crate::notices::notice(&crate::notices::lost_message(&reason, &relay));
                Ok(crate::notices::EXIT_SESSION_LOST)
            }
            _ => Err(CliError(explain_stream_error(&e, &target))),
        },
    }
}

/// Copies stdin → `wr` and `rd` → stdout. Each direction ends on its own: the
/// remote finishing its side (half-close) does not stop the upload, and stdin
/// reaching its end only finishes ours. Done when both are done, or when the
/// remote side fails (reset).
async fn shuttle<R, W>(rd: R, mut wr: W) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let up = async move {
        let mut stdin = BufReader::with_capacity(COPY_BUF, tokio::io::stdin());
        let r = tokio::io::copy_buf(&mut stdin, &mut wr).await;
        let _ = wr.shutdown().await;
        r
    };
    let down = async move {
        let mut rd = BufReader::with_capacity(COPY_BUF, rd);
        let mut stdout = tokio::io::stdout();
        tokio::io::copy_buf(&mut rd, &mut stdout).await?;
        stdout.flush().await
    };
    tokio::pin!(up);
    tokio::pin!(down);
    tokio::select! {
        r = &mut down => {
            r?;
            // Tell our reader the remote is done, as a TCP half-close would:
            // fd 1 now points at /dev/null, so the pipe's reader sees EOF.
            release_stdout();
            // The remote finished sending; keep uploading until stdin ends or
            // the remote refuses more (a reset surfaces as a write error,
            // which after the remote's end is no failure of ours).
            if let Err(e) = up.await {
                tracing::debug!("upload after the remote finished: {e}");
            }
            Ok(())
        }
        r = &mut up => {
            if let Err(e) = r {
                tracing::debug!("stdin: {e}");
            }
            down.await
        }
    }
}

/// Replaces standard output by `/dev/null`, closing our end of the pipe or
/// socket the caller reads.
fn release_stdout() {
    match std::fs::OpenOptions::new().write(true).open("/dev/null") {
        Ok(null) => {
            if let Err(e) = nix::unistd::dup2_stdout(&null) {
                tracing::debug!("closing stdout: {e}");
            }
        }
        Err(e) => tracing::debug!("opening /dev/null: {e}"),
    }
}

async fn direct_pipe(addr: &str) -> CliResult {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| CliError(format!("direct connection to {addr} failed too: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let (rd, wr) = tcp.into_split();
    shuttle(rd, wr)
        .await
        .map_err(|e| CliError(format!("connection to {addr}: {e}")))?;
    Ok(0)
}
