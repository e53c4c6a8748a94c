//! The paper's benchmark server: numbered updates that survive suspensions
//! and restarts of this process.
//!
//! ```text
//! cargo run -p roam-continuation --example bench_server -- --listen 127.0.0.1:7447 --state-dir /tmp/bench
//! cargo run -p roam-continuation --example bench_client -- --connect 127.0.0.1:7447 --server-key <key> --count 100000
//! ```
//! Options: `--lazy-ms N` (lazy generation after N ms suspended; default
//! eager), `--expiry-s N` (default 3600), `--offload-ms N` (default 30000).
//! As a cluster host (sessions move between hosts, `docs/PROTOCOL.md` §14):
//! `--cluster FILE --host NAME --host-key FILE --service-key FILE [--etcd URL]` (see
//! `support/cluster.rs`).
//! Stops on Ctrl-C, keeping every session for the next start.

#[path = "support/bench.rs"]
mod bench;
#[path = "support/cli.rs"]
mod cli;
#[path = "support/cluster.rs"]
mod cluster;

use std::path::PathBuf;
use std::time::Duration;

use roam_continuation::{Generation, Host, HostConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = cli::arg("--listen").unwrap_or_else(|| "127.0.0.1:7447".into());
    let state_dir = PathBuf::from(cli::arg("--state-dir").ok_or("--state-dir is required")?);
    let generation = match cli::arg("--lazy-ms").and_then(|v| v.parse().ok()) {
        Some(ms) => Generation::Lazy {
            after: Duration::from_millis(ms),
        },
        None => Generation::Eager,
    };
    let expiry = Duration::from_secs(cli::arg_or("--expiry-s", 3600));
    let keypair = cli::load_or_create_key(&state_dir)?;
    let public = keypair.public();
    let mut config = HostConfig::new(&state_dir, cli::server_config(keypair));
    config.offload_after = Duration::from_millis(cli::arg_or("--offload-ms", 30_000));
    let peers = cluster::configure(&mut config)?;
    let (host, report) = Host::builder(config)
        .service(bench::service(generation, expiry))
        .open()
        .await?;
    for c in &report.corrupt {
        eprintln!("corrupt entry {} quarantined: {}", c.key, c.reason);
    }
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
        move |handle| bench::on_session(&h, handle),
    )
    .await?;
    println!("stopped; {} sessions kept", host.stats().frozen);
    Ok(())
}
