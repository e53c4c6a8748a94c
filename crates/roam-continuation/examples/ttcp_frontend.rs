//! The front-end of the TTCP-like two-process stream (`support/ttcp.rs`):
//! a roam host whose service, for each client's session, starts a
//! `ttcp_producer` process and forwards what it writes to the client; the
//! pair is a service set carried in the session's continuation.
//!
//! ```text
//! cargo build --release -p roam-continuation --example ttcp_producer --example ttcp_frontend --example ttcp_client
//! target/release/examples/ttcp_frontend --listen 127.0.0.1:7100 --state-dir /tmp/ttcp
//! target/release/examples/ttcp_client --connect 127.0.0.1:7100 --server-key KEY --bytes 1G
//! ```
//!
//! Options: `--producer PATH` (default: `ttcp_producer` next to this
//! program), `--export eager|lazy|never` (how the producer exports its
//! position after every 8 KiB; default `lazy`), `--state-bytes N` (its
//! snapshot's size, default 8), `--root-export eager|lazy` (how this
//! front-end, the set's root, exports its forwarded position after each
//! forward: `Member::export` or `Member::export_owned`; default the
//! producer's `--export`, `eager` when that is `never`, so both processes
//! run the same variant as in the paper), `--root-state-bytes N` (the
//! root's snapshot's size, default 8; the paper's large state is in this
//! first process), `--work DIR` (the sets' sockets, default
//! `STATE_DIR/sets`). As a cluster host (sessions, with their producers,
//! move between hosts: `roam cluster -c FILE -k KEY move SESSION --to
//! HOST`): `--cluster FILE --host NAME --host-key FILE --service-key FILE`
//! (see `support/cluster.rs`). Stops on Ctrl-C.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/ttcp.rs"]
mod ttcp;

use std::path::PathBuf;
use std::sync::Arc;

use roam_continuation::{Host, HostConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = cli::arg("--listen").unwrap_or_else(|| "127.0.0.1:7100".into());
    let state_dir = PathBuf::from(cli::arg("--state-dir").ok_or("--state-dir is required")?);
    let producer = match cli::arg("--producer") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()?
            .parent()
            .ok_or("this program has no directory")?
            .join("ttcp_producer"),
    };
    let export = cli::arg("--export").unwrap_or_else(|| "lazy".into());
    let export = ttcp::Export::parse(&export).ok_or("--export: one of eager, lazy or never")?;
    let root_export = match cli::arg("--root-export") {
        Some(e) => ttcp::Export::parse(&e).ok_or("--root-export: one of eager or lazy")?,
        None if export == ttcp::Export::Never => ttcp::Export::Eager,
        None => export,
    };
    let work = cli::arg("--work").map_or_else(|| state_dir.join("sets"), PathBuf::from);
    // Sockets of a previous run's sets are stale.
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let front = ttcp::Front::new(producer, work, export, cli::arg_or("--state-bytes", 8))
        .with_root(root_export, cli::arg_or("--root-state-bytes", 8))
        .map_err(|e| format!("--root-export: {e}"))?;
    let front = Arc::new(front);
    let keypair = cli::load_or_create_key(&state_dir)?;
    let public = keypair.public();
    let mut config = HostConfig::new(&state_dir, cli::server_config(keypair));
    let peers = cluster::configure(&mut config)?;
    let (host, report) = Host::builder(config)
        .service(ttcp::service(front.clone()))
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
        move |handle| ttcp::on_session(front.clone(), &h, handle),
    )
    .await?;
    Ok(())
}
