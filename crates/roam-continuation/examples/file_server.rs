//! A file server whose downloads survive disconnections, restarts and moves
//! between hosts (M-Apache-like: a download's continuation is the file's
//! name and the offset reached).
//!
//! ```text
//! cargo run -p roam-continuation --example file_server -- --listen 127.0.0.1:8080 --state-dir /tmp/files --root /srv/files
//! cargo run -p roam-continuation --example file_client -- --connect 127.0.0.1:8080 --server-key <key> --file big.iso --out /tmp/big.iso
//! ```
//!
//! The client opens one stream whose metadata is the file's path under
//! `--root`; the server answers with the file's length (8 bytes, big
//! endian) and then its bytes, and finishes the stream. Asked for a
//! continuation (the client went away, the host shuts down, or the session
//! moves), it stores `path` and `offset` (bytes handed to the session so
//! far) and suspends; the resumed routine reopens the file and goes on at
//! `offset`. Nothing is re-sent or skipped: what the session had buffered
//! travels in the protocol snapshot.
//!
//! As a cluster host (`docs/PROTOCOL.md` §14): `--cluster FILE --host NAME
//! --host-key FILE --service-key FILE [--etcd URL]` (see `support/cluster.rs`); every
//! host needs the same files under its `--root`. Stops on Ctrl-C, keeping
//! every download for the next start.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/cluster.rs"]
mod cluster;

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use roam::RoamStream;
use roam_continuation::{Continuation, Host, HostConfig, ManagedSession, Service};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

/// Bytes read from the file per write to the stream.
const CHUNK: usize = 64 * 1024;

/// `meta` as a path under `root`, refusing anything that could leave it.
fn resolve(root: &Path, meta: &[u8]) -> Option<PathBuf> {
    let rel = std::str::from_utf8(meta).ok()?;
    let rel = Path::new(rel);
    if rel.as_os_str().is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return None;
    }
    Some(root.join(rel))
}

/// Sends `path` from `offset` on `stream`, answering freeze requests at
/// chunk boundaries with a continuation.
async fn send(
    s: ManagedSession,
    mut stream: RoamStream,
    root: Arc<PathBuf>,
    rel: String,
    mut offset: u64,
) {
    let Some(path) = resolve(&root, rel.as_bytes()) else {
        let _ = stream.shutdown().await;
        return;
    };
    let mut file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{}: {e}", path.display());
            let _ = stream.shutdown().await;
            return;
        }
    };
    if offset == 0 {
        let len = file.metadata().await.map(|m| m.len()).unwrap_or(0);
        if stream.write_all(&len.to_be_bytes()).await.is_err() {
            return;
        }
        offset = 0;
        let _ = s.store("header_sent", [1]);
    }
    if file.seek(std::io::SeekFrom::Start(offset)).await.is_err() {
        return;
    }
    let mut buf = vec![0u8; CHUNK];
    'sending: loop {
        if s.freeze_pending().is_some() {
            break;
        }
        let n = match file.read(&mut buf).await {
            Ok(0) => {
                let _ = stream.shutdown().await;
                // Done; the client closes the session when it has it all.
                s.freeze_requested().await;
                break;
            }
            Ok(n) => n,
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                return;
            }
        };
        // `write` either takes bytes or waits without taking any, so a
        // freeze request between two writes leaves `offset` exact.
        let mut pos = 0;
        while pos < n {
            tokio::select! {
                r = stream.write(&buf[pos..n]) => match r {
                    Ok(w) => {
                        pos += w;
                        offset += w as u64;
                    }
                    Err(_) => return,
                },
                _ = s.freeze_requested() => break 'sending,
            }
        }
    }
    let _ = s.store("path", rel.as_bytes());
    let _ = s.store("offset", offset.to_le_bytes());
    let _ = s
        .suspend(Continuation::new("send").stream("download", stream))
        .await;
}

fn service(root: Arc<PathBuf>) -> Service {
    Service::new("files")
        .version("1")
        .routine("send", move |mut r| {
            let root = root.clone();
            async move {
                let path = r
                    .session
                    .retrieve("path")
                    .and_then(|p| String::from_utf8(p).ok());
                let offset = r
                    .session
                    .retrieve("offset")
                    .and_then(|o| o.try_into().ok())
                    .map(u64::from_le_bytes);
                match (r.take_stream("download"), path, offset) {
                    (Some(stream), Some(path), Some(offset)) => {
                        send(r.session, stream, root, path, offset).await
                    }
                    // The download had ended both ways: nothing left to send.
                    _ => {
                        r.session.freeze_requested().await;
                        let _ = r.session.suspend(Continuation::new("send")).await;
                    }
                }
            }
        })
}

fn on_session(host: &Host, root: Arc<PathBuf>, handle: roam::SessionHandle) {
    let Ok(s) = host.adopt("files", handle) else {
        return;
    };
    tokio::spawn(async move {
        let (stream, meta) = tokio::select! {
            r = s.handle().accept_stream() => match r {
                Ok(x) => x,
                Err(_) => return,
            },
            _ = s.freeze_requested() => {
                let _ = s.suspend(Continuation::new("send")).await;
                return;
            }
        };
        let rel = String::from_utf8_lossy(&meta).into_owned();
        send(s, stream, root, rel, 0).await;
    });
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = cli::arg("--listen").unwrap_or_else(|| "127.0.0.1:8080".into());
    let state_dir = PathBuf::from(cli::arg("--state-dir").ok_or("--state-dir is required")?);
    let root = Arc::new(PathBuf::from(
        cli::arg("--root").ok_or("--root is required")?,
    ));
    let keypair = cli::load_or_create_key(&state_dir)?;
    let public = keypair.public();
    let mut config = HostConfig::new(&state_dir, cli::server_config(keypair));
    let peers = cluster::configure(&mut config)?;
    let (host, report) = Host::builder(config)
        .service(service(root.clone()))
        .open()
        .await?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!(
        "listening {} key {public} suspended {}",
        listener.local_addr()?,
        report.loaded
    );
    if let Some(p) = peers {
        tokio::spawn(cluster::serve_peers(host.clone(), p));
    }
    let h = host.clone();
    host.serve(
        listener,
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
        move |handle| on_session(&h, root.clone(), handle),
    )
    .await?;
    println!("stopped; {} downloads kept", host.stats().frozen);
    Ok(())
}
