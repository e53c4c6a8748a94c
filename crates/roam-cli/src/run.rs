//! `roam run -- CMD`: CMD's outgoing TCP connections become roam sessions
//! wherever the peer runs a relay, by interposition (issue 13, rocks).
//!
//! CMD starts with roam's preload library (crates/roam-preload, embedded in
//! this binary and written once to the state directory) in `LD_PRELOAD`. Its
//! `connect` binds an IPv4 TCP socket headed for a non-loopback address to
//! 127.0.0.1, registers "local port → destination" with this process over a
//! private Unix socket, and connects to this process's agent port instead.
//! The agent carries each accepted connection exactly as `roam intercept`
//! does ([`crate::intercept::carry`]): a stream of one session per enhanced
//! host, plain TCP to an ordinary one. Connections the preload did not
//! register are refused (the agent port is reachable by any local user; the
//! registration socket is not).
//!
//! The program's descriptors are ordinary sockets to loopback, so a link cut
//! or a new address at this end never reaches them. No root is needed.

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
    let registry = Registry::default();
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
    let pending: Arc<Mutex<HashMap<u16, (SocketAddrV4, Instant)>>> = Arc::default();

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
        .env("ROAM_RUN_REGISTER", &register_path)
        .env("ROAM_RUN_PORTS", ports)
        .spawn()
        .map_err(|e| CliError(format!("cannot run {}: {e}", Path::new(program).display())))?;

    let status = loop {
        tokio::select! {
            r = register.accept() => {
                if let Ok((conn, _)) = r {
                    tokio::spawn(registration(conn, pending.clone()));
                }
            }
            r = agent.accept() => {
                if let Ok((tcp, from)) = r {
                    let dest = {
                        let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
                        p.retain(|_, (_, at)| at.elapsed() < REGISTRATION_TTL);
                        p.remove(&from.port()).map(|(d, _)| d)
                    };
                    // (A socket the program had bound to another local
                    // address reaches the agent from that address: the
                    // registration, not the source, says it is ours.)
                    match dest {
                        Some(dest) => {
                            tokio::spawn(carry(ctx.clone(), tcp, dest));
                        }
                        // Not registered by the preload: someone else's.
                        _ => tracing::warn!("refused an unregistered connection from {from}"),
                    }
                }
            }
            status = child.wait() => break status,
            sig = crate::signals::exit_signal() => {
                // The program decides: it gets the signal and ends (or not).
                if let Some(pid) = child.id() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::try_from(sig).ok(),
                    );
                }
            }
        }
    };
    let status = status.map_err(|e| CliError(format!("waiting for the program: {e}")))?;
    // What the program wrote before it ended is delivered before the
    // sessions close.
    ctx.close_all().await;
    Ok(exit_code(status))
}

/// The program's exit status as ours: its code, or 128 + its signal.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// Serves one registration: 8 bytes (the program's loopback port, the
/// destination address and port, network order), answered `+`.
async fn registration(
    mut conn: tokio::net::UnixStream,
    pending: Arc<Mutex<HashMap<u16, (SocketAddrV4, Instant)>>>,
) {
    let mut msg = [0u8; 8];
    let read = tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut msg)).await;
    if !matches!(read, Ok(Ok(_))) {
        return;
    }
    let (port, dest) = decode_registration(&msg);
    pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(port, (dest, Instant::now()));
    let _ = conn.write_all(b"+").await;
}

/// Decodes a registration: (the program's loopback port, its destination).
fn decode_registration(msg: &[u8; 8]) -> (u16, SocketAddrV4) {
    let port = u16::from_be_bytes([msg[0], msg[1]]);
    let ip = Ipv4Addr::new(msg[2], msg[3], msg[4], msg[5]);
    let dport = u16::from_be_bytes([msg[6], msg[7]]);
    (port, SocketAddrV4::new(ip, dport))
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

    #[test]
    fn a_registration_names_the_port_and_the_destination() {
        let (port, dest) = decode_registration(&[0x9c, 0x40, 10, 0, 0, 7, 0x1f, 0x90]);
        assert_eq!(port, 40_000);
        assert_eq!(dest, SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 7), 8080));
    }

    #[test]
    fn the_embedded_library_exports_connect() {
        assert!(PRELOAD.starts_with(b"\x7fELF"), "not an ELF object");
        assert!(
            PRELOAD.windows(8).any(|w| w == b"connect\0"),
            "no connect symbol"
        );
    }
}
