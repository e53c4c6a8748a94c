//! Small helpers shared by the example binaries: arguments, the server key
//! kept in the state directory, roam configurations.

#![allow(dead_code, unreachable_pub)]

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use roam_proto::{Keypair, PublicKey, ServerTrust};

/// `--name value` from the command line.
pub fn arg(name: &str) -> Option<String> {
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        if a == name {
            return it.next();
        }
    }
    None
}

/// `--name value` parsed, or `default`.
pub fn arg_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    arg(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Whether `--name` is present.
pub fn flag(name: &str) -> bool {
    std::env::args().skip(1).any(|a| a == name)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The server's static key, created (mode 0600) on first start so clients
/// that pinned it keep trusting the restarted server: `--service-key FILE`
/// if given (the key every host of a cluster shares), else
/// `<state dir>/server.key`.
pub fn load_or_create_key(state_dir: &Path) -> std::io::Result<Keypair> {
    if !state_dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)?;
    }
    match arg("--service-key") {
        Some(p) => load_or_create_key_file(Path::new(&p)),
        None => load_or_create_key_file(&state_dir.join("server.key")),
    }
}

/// A private key in a file (64 hex digits), created (mode 0600) if missing.
pub fn load_or_create_key_file(path: &Path) -> std::io::Result<Keypair> {
    let path = path.to_path_buf();
    if let Ok(text) = std::fs::read_to_string(&path) {
        let t = text.trim();
        let mut b = [0u8; 32];
        if t.len() == 64 {
            for (i, c) in b.iter_mut().enumerate() {
                *c = u8::from_str_radix(&t[2 * i..2 * i + 2], 16)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            }
            return Ok(Keypair::from_private(b));
        }
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a 64-digit hex key", path.display()),
        ));
    }
    let kp = Keypair::generate().map_err(std::io::Error::other)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    writeln!(f, "{}", hex(&kp.private_bytes()))?;
    Ok(kp)
}

/// Session knobs for the examples: quick heartbeats, and a suspension
/// noticed within a few seconds when the path just goes silent.
pub fn session_config() -> roam_proto::Config {
    roam_proto::Config {
        heartbeat_interval: Duration::from_millis(500),
        suspend_after: Duration::from_secs(5),
        ..Default::default()
    }
}

/// A server configuration around `keypair`.
pub fn server_config(keypair: Keypair) -> roam::ServerConfig {
    let mut c = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: None,
        addresses: Vec::new(),
        session: session_config(),
    });
    c.max_sessions = 100_000;
    c
}

/// A client configuration pinning `server_key` (or trusting on first use),
/// re-dialing quickly.
pub fn client_config(server_key: Option<PublicKey>) -> roam::ClientConfig {
    let mut c = roam::ClientConfig::new(roam_proto::ClientConfig {
        keypair: Keypair::generate().expect("random source"),
        server_trust: server_key.map_or(ServerTrust::FirstUse, ServerTrust::Pinned),
        session: session_config(),
    });
    c.backoff_initial = Duration::from_millis(50);
    c.backoff_max = Duration::from_millis(500);
    c.watch_network = false;
    c
}
