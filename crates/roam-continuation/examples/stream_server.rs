//! An Icecast-like streaming server: numbered chunks at a fixed rate per
//! mount; each listener's position is its continuation. Suspended listeners
//! cost no socket and no task; resumed ones continue from their position or
//! jump to live, as they asked.
//!
//! ```text
//! cargo run -p roam-continuation --example stream_server -- --listen 127.0.0.1:8000 --state-dir /tmp/radio
//! cargo run -p roam-continuation --example stream_client -- --connect 127.0.0.1:8000 --mount /radio --resume live
//! ```
//! Options: `--rate N` chunks per second (default 100), `--chunk-len N`
//! bytes (default 1024). As a cluster host (listeners move between hosts,
//! `docs/PROTOCOL.md` §14): `--cluster FILE --host NAME --host-key FILE
//! --service-key FILE [--etcd URL]` (see `support/cluster.rs`). Stops on Ctrl-C,
//! keeping every listener.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/stream.rs"]
mod stream;

use std::path::PathBuf;
use std::time::Duration;

use roam_continuation::{Host, HostConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listen = cli::arg("--listen").unwrap_or_else(|| "127.0.0.1:8000".into());
    let state_dir = PathBuf::from(cli::arg("--state-dir").ok_or("--state-dir is required")?);
    let rate: u64 = cli::arg_or("--rate", 100);
    let b = stream::Broadcast {
        period: Duration::from_micros(1_000_000 / rate.max(1)),
        chunk_len: cli::arg_or("--chunk-len", 1024),
    };
    let keypair = cli::load_or_create_key(&state_dir)?;
    let public = keypair.public();
    let mut config = HostConfig::new(&state_dir, cli::server_config(keypair));
    let peers = cluster::configure(&mut config)?;
    let (host, report) = Host::builder(config)
        .service(stream::service(b))
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
        move |handle| stream::on_session(b, &h, handle),
    )
    .await?;
    Ok(())
}
