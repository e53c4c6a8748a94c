//! Cluster flags shared by the example servers (`docs/PROTOCOL.md` §14):
//!
//! - `--cluster FILE`: the cluster file (the same on every host);
//! - `--host NAME`: this host's name in it;
//! - `--host-key FILE`: this host's own key (created if missing; its public
//!   half must be the `key=` of this host's line);
//! - `--service-key FILE`: the key clients pin, shared by every host (see
//!   `cli::load_or_create_key`);
//! - `--etcd URL[,URL..]`: keep the cluster's directory on etcd (suspended
//!   sessions survive the loss of their host; `docs/PROTOCOL.md` §14.6);
//!   `--etcd-ttl SECS` sets the hosts' lease TTL (default 10).
//!
//! With them the server also listens on its `peers=` address for moves from
//! the other hosts and the operator's `roam cluster` requests.

#![allow(dead_code, unreachable_pub)]

use std::path::Path;

use roam_continuation::cluster::etcd::EtcdOptions;
use roam_continuation::{ClusterConfig, ClusterIdentity, Host, HostConfig};

use super::cli;

/// Applies the cluster flags to `config`; returns this host's peers
/// address if the host runs in a cluster.
pub fn configure(config: &mut HostConfig) -> Result<Option<String>, Box<dyn std::error::Error>> {
    let Some(file) = cli::arg("--cluster") else {
        return Ok(None);
    };
    let name = cli::arg("--host").ok_or("--cluster needs --host NAME")?;
    let key_path = cli::arg("--host-key").ok_or("--cluster needs --host-key FILE")?;
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{file}: {e}"))?;
    let cluster = ClusterConfig::parse(&text).map_err(|e| format!("{file}: {e}"))?;
    let host_key = cli::load_or_create_key_file(Path::new(&key_path))?;
    let peers = cluster
        .hosts
        .get(&name)
        .map(|m| m.peers.clone())
        .ok_or_else(|| format!("host {name:?} is not in {file}"))?;
    let mut ident = ClusterIdentity::new(cluster, &name, host_key)?;
    if let Some(urls) = cli::arg("--etcd") {
        let mut opts = EtcdOptions::new(urls.split(',').map(str::to_string).collect());
        if let Some(t) = cli::arg("--etcd-ttl") {
            let secs: u64 = t
                .parse()
                .map_err(|_| format!("--etcd-ttl {t}: not a number of seconds"))?;
            opts.lease_ttl = std::time::Duration::from_secs(secs.max(1));
        }
        ident = ident.with_etcd(opts);
    }
    config.cluster = Some(ident);
    Ok(Some(peers))
}

/// Serves the cluster port at `peers` until Ctrl-C.
pub async fn serve_peers(host: Host, peers: String) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(&peers).await?;
    println!("cluster port {}", listener.local_addr()?);
    host.serve_peers(listener, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
