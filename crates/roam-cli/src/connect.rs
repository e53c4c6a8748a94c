//! Client side shared by `pipe`, `forward` and the store client: key, known
//! servers, connect.

use std::path::Path;

use roam_proto::{PublicKey, ServerTrust};

use crate::cli::CliError;
use crate::config::FileConfig;
use crate::keys::KnownServers;

/// Why connecting to a relay failed.
pub(crate) enum ConnectFailure {
    /// The library's error (unreachable, not roam, refused, ...).
    Roam(roam::Error),
    /// A local problem or a refusal already explained for the user.
    Cli(CliError),
}

impl From<CliError> for ConnectFailure {
    fn from(e: CliError) -> Self {
        ConnectFailure::Cli(e)
    }
}

impl ConnectFailure {
    pub(crate) fn into_cli(self) -> CliError {
        match self {
            ConnectFailure::Roam(e) => CliError(e.to_string()),
            ConnectFailure::Cli(e) => e,
        }
    }
}

/// What a client connects to, so that its messages name the server as the
/// user knows it: a relay, a store server behind `--store roam://`, or the
/// destination of `roam migrate-process`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerKind {
    /// A relay (`roam serve`), or another server reached like one.
    Relay,
    /// A store server (`roam store serve`, `--store roam://HOST:PORT`).
    Store,
    /// A `roam migrate-accept` server (`roam migrate-process --to HOST`).
    MigrateAccept,
}

impl ServerKind {
    /// The server at `addr` (`host:port`) as messages name it.
    pub(crate) fn name(self, addr: &str) -> String {
        match self {
            ServerKind::Relay => format!("relay {addr}"),
            ServerKind::Store => format!("the store server roam://{addr}"),
            ServerKind::MigrateAccept => format!("the migrate-accept server at {addr}"),
        }
    }

    /// What kind of server it is, in a sentence.
    pub(crate) fn noun(self) -> &'static str {
        match self {
            ServerKind::Relay => "relay",
            ServerKind::Store => "store server",
            ServerKind::MigrateAccept => "migrate-accept server",
        }
    }

    /// The command that serves this kind of server, for "check that it
    /// runs there" hints.
    fn command(self) -> &'static str {
        match self {
            ServerKind::Relay => "roam serve",
            ServerKind::Store => "roam store serve",
            ServerKind::MigrateAccept => "roam migrate-accept",
        }
    }
}

/// The key a relay is pinned to, and under which `known_servers` entry.
pub(crate) struct Pin {
    /// The pinned key.
    pub(crate) key: PublicKey,
    /// The entry it came from: the relay's name, or one of its addresses.
    pub(crate) entry: String,
}

/// Resolves `relay` (`host:port`) to its addresses (empty if it does not resolve).
async fn resolve(relay: &str) -> Vec<std::net::SocketAddr> {
    match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::lookup_host(relay),
    )
    .await
    {
        Ok(Ok(addrs)) => addrs.collect(),
        _ => Vec::new(),
    }
}

/// The key pinned for `relay`, by its name first and else by any address it
/// resolves to (as ssh's CheckHostIP): so `localhost:P` is not trusted anew
/// when `127.0.0.1:P` was pinned with another key. Warns when the name and
/// an address are pinned to different keys (naming the server as `kind`).
pub(crate) async fn pinned_key(
    relay: &str,
    known: &KnownServers,
    kind: ServerKind,
) -> Result<Option<Pin>, CliError> {
    let by_name = known.lookup(relay)?;
    let mut by_addr = Vec::new();
    for a in resolve(relay).await {
        let entry = a.to_string();
        if entry != relay {
            if let Some(k) = known.lookup(&entry)? {
                by_addr.push(Pin { key: k, entry });
            }
        }
    }
    match by_name {
        Some(key) => {
            for p in by_addr.iter().filter(|p| p.key != key) {
                crate::notices::notice(&format!(
                    "warning: {} is pinned with key {key}, but its address {} is pinned with key {} (in {}); using the key pinned for {relay}",
                    kind.name(relay),
                    p.entry,
                    p.key,
                    known.path().display()
                ));
            }
            Ok(Some(Pin {
                key,
                entry: relay.to_string(),
            }))
        }
        None => Ok(by_addr.into_iter().next()),
    }
}

/// The protocol's client settings: the user's client key (`key`, else the
/// config's, else `<state>/client.key`, created on first use) and the
/// relay's pinned key, if any (else trust on first use).
pub(crate) fn client_proto(
    key: Option<&Path>,
    config: &FileConfig,
    pinned: Option<PublicKey>,
) -> Result<roam_proto::ClientConfig, CliError> {
    let key_path = key
        .map(Path::to_path_buf)
        .or_else(|| config.client.key.clone())
        .unwrap_or_else(|| crate::paths::state_dir(config).join("client.key"));
    Ok(roam_proto::ClientConfig {
        keypair: crate::keys::load_or_create(&key_path)?,
        server_trust: pinned.map_or(ServerTrust::FirstUse, ServerTrust::Pinned),
        session: roam_proto::Config::default(),
    })
}

/// Connects to the relay at `relay` (`host:port`) with the user's client key,
/// pinning its key on first use (under its name and the address reached) and
/// refusing loudly if a pinned key changed.
pub(crate) async fn connect_relay(
    relay: &str,
    key: Option<&Path>,
    config: &FileConfig,
) -> Result<roam::SessionHandle, ConnectFailure> {
    connect_relay_over(relay, key, config, None).await
}

/// Connects to the store server at `addr` (`host:port`) as
/// [`connect_relay`] does to a relay (the user's client key, the server's
/// key pinned on first use); every message names it as the store server
/// `roam://ADDR`, and `Err` is the whole message for the user.
pub(crate) async fn connect_store_server(
    addr: &str,
    config: &FileConfig,
) -> Result<roam::SessionHandle, CliError> {
    connect_named(addr, None, config, ServerKind::Store).await
}

/// Connects to the `roam migrate-accept` server at `addr` (`host:port`)
/// with the client key `key` (else the user's), as [`connect_relay`] does to
/// a relay; every message names it as the migrate-accept server at `ADDR`,
/// and `Err` is the whole message for the user.
pub(crate) async fn connect_migrate_accept(
    addr: &str,
    key: Option<&Path>,
    config: &FileConfig,
) -> Result<roam::SessionHandle, CliError> {
    connect_named(addr, key, config, ServerKind::MigrateAccept).await
}

/// [`connect_server`] to a server other than a relay, with the library's
/// errors (unreachable, a handshake that never completes) explained in
/// words that name it as `kind`.
async fn connect_named(
    addr: &str,
    key: Option<&Path>,
    config: &FileConfig,
    kind: ServerKind,
) -> Result<roam::SessionHandle, CliError> {
    let started = std::time::Instant::now();
    match connect_server(addr, key, config, None, kind).await {
        Ok(s) => Ok(s),
        Err(ConnectFailure::Cli(e)) => Err(e),
        Err(ConnectFailure::Roam(e)) => {
            let name = kind.name(addr);
            let handshake = roam_proto::Config::default().handshake_timeout;
            Err(CliError(match e {
                roam::Error::Unreachable { source, .. } => format!(
                    "cannot reach {name}: {source}; check the host and port, and that \
                     `{}` runs there",
                    kind.command()
                ),
                e if e.protocol() == Some(&roam_proto::Error::HandshakeFailed)
                    && started.elapsed() >= handshake =>
                {
                    format!(
                        "{name} accepted the connection but did not answer the secure \
                         handshake within {} s (the network drops its packets, or it is not a \
                         roam {})",
                        handshake.as_secs(),
                        kind.noun()
                    )
                }
                e => format!("{name} could not be used: {e}"),
            }))
        }
    }
}

/// [`connect_relay`] over `first`, a connection to the relay the caller
/// already made (`None`: dial `relay`); re-dials go to `relay`.
pub(crate) async fn connect_relay_over(
    relay: &str,
    key: Option<&Path>,
    config: &FileConfig,
    first: Option<roam::Transport>,
) -> Result<roam::SessionHandle, ConnectFailure> {
    connect_server(relay, key, config, first, ServerKind::Relay).await
}

/// [`connect_relay_over`] to a server of any `kind`, named so in its
/// messages.
async fn connect_server(
    relay: &str,
    key: Option<&Path>,
    config: &FileConfig,
    first: Option<roam::Transport>,
    kind: ServerKind,
) -> Result<roam::SessionHandle, ConnectFailure> {
    let state = crate::paths::state_dir(config);
    let known = KnownServers::new(&state);
    let pinned = pinned_key(relay, &known, kind).await?;
    let proto = client_proto(key, config, pinned.as_ref().map(|p| p.key))?;
    let public = proto.keypair.public();
    let connected = match first {
        Some(t) => roam::connect_over(t, relay, roam::ClientConfig::new(proto)).await,
        None => roam::connect(relay, roam::ClientConfig::new(proto)).await,
    };
    match connected {
        Ok(session) => {
            if let Some(k) = session.peer_key() {
                let addr = session.stats().peer_addr.map(|a| a.to_string());
                let mut names = vec![relay.to_string()];
                names.extend(addr.filter(|a| a != relay));
                let mut added = Vec::new();
                for name in names {
                    match known.lookup(&name) {
                        Ok(None) => match known.add(&name, &k) {
                            Ok(()) => added.push(name),
                            // Like ssh: the connection stands, the user is told.
                            Err(e) => crate::notices::notice(&format!(
                                "warning: could not pin {} key for {name}: {}",
                                kind.noun(),
                                e.0
                            )),
                        },
                        Ok(Some(_)) => {}
                        Err(e) => crate::notices::notice(&format!("warning: {}", e.0)),
                    }
                }
                if pinned.is_none() && !added.is_empty() {
                    eprintln!(
                        "roam: trusting {} on first use (key {k}); pinned for {}",
                        kind.name(relay),
                        added.join(" and ")
                    );
                }
            }
            Ok(session)
        }
        Err(e) => match e.protocol() {
            Some(roam_proto::Error::ServerKeyMismatch { expected, actual }) => {
                let entry = pinned.map_or_else(|| relay.to_string(), |p| p.entry);
                let mut msg = known.mismatch_message(&entry, expected, actual, kind.noun());
                if entry != relay {
                    msg.push_str(&format!(
                        "\n(The key was pinned for {entry}, an address {relay} resolves to.)"
                    ));
                }
                Err(ConnectFailure::Cli(CliError(msg)))
            }
            Some(roam_proto::Error::Unauthorized) => Err(ConnectFailure::Cli(CliError(format!(
                "{} refused our client key: add this line to its authorized keys file{}:\n{public}",
                kind.name(relay),
                match kind {
                    ServerKind::Relay => "",
                    ServerKind::Store | ServerKind::MigrateAccept => " (its --authorized-keys)",
                }
            )))),
            Some(roam_proto::Error::ServerBusy) => Err(ConnectFailure::Cli(CliError(match kind {
                ServerKind::MigrateAccept => format!(
                    "{} is busy (at one of its connection or session limits, or taking \
                     another process); try again later",
                    kind.name(relay)
                ),
                ServerKind::Relay | ServerKind::Store => format!(
                    "{} is busy (at one of its connection or session limits); try again later, or ask its operator (`roam status` on the {} shows {})",
                    kind.name(relay),
                    kind.noun(),
                    match kind {
                        ServerKind::Store => "its sessions",
                        _ => "the limits",
                    }
                ),
            }))),
            _ => Err(ConnectFailure::Roam(e)),
        },
    }
}

/// Explains an I/O error from a relayed stream, naming the relay's reset codes.
pub(crate) fn explain_stream_error(e: &std::io::Error, target: &str) -> String {
    let code = e
        .get_ref()
        .and_then(|i| i.downcast_ref::<roam_proto::StreamError>())
        .and_then(|se| match se {
            roam_proto::StreamError::Reset(code) => Some(*code),
            _ => None,
        });
    match code {
        Some(c) => crate::serve::describe_reset(c, target),
        None => format!("stream to {target} failed: {e}"),
    }
}
