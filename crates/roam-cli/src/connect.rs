//! Client side shared by `pipe` and `forward`: key, known servers, connect.

use std::path::Path;

use roam_proto::ServerTrust;

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

/// Connects to the relay at `relay` (`host:port`) with the user's client key,
/// pinning its key on first use and refusing loudly if a pinned key changed.
pub(crate) async fn connect_relay(
    relay: &str,
    key: Option<&Path>,
    config: &FileConfig,
) -> Result<roam::SessionHandle, ConnectFailure> {
    let state = crate::paths::state_dir(config);
    let key_path = key
        .map(Path::to_path_buf)
        .or_else(|| config.client.key.clone())
        .unwrap_or_else(|| state.join("client.key"));
    let keypair = crate::keys::load_or_create(&key_path)?;
    let known = KnownServers::new(&state);
    let pinned = known.lookup(relay)?;
    let proto = roam_proto::ClientConfig {
        keypair,
        server_trust: pinned.map_or(ServerTrust::FirstUse, ServerTrust::Pinned),
        session: roam_proto::Config::default(),
    };
    match roam::connect(relay, roam::ClientConfig::new(proto)).await {
        Ok(session) => {
            if pinned.is_none() {
                if let Some(k) = session.peer_key() {
                    known.add(relay, &k)?;
                    eprintln!("roam: trusting relay {relay} on first use (key {k})");
                }
            }
            Ok(session)
        }
        Err(e) => match e.protocol() {
            Some(roam_proto::Error::ServerKeyMismatch { expected, actual }) => {
                Err(ConnectFailure::Cli(CliError(known.mismatch_message(relay, expected, actual))))
            }
            Some(roam_proto::Error::Unauthorized) => Err(ConnectFailure::Cli(CliError(format!(
                "relay {relay} refused our client key: add this line to its authorized keys file:\n{}",
                crate::keys::load_or_create(&key_path).map(|k| k.public().to_string()).unwrap_or_default()
            )))),
            Some(roam_proto::Error::ServerBusy) => Err(ConnectFailure::Cli(CliError(format!(
                "relay {relay} is busy (at its connection or session limit); try again later, or ask its operator (`roam status` on the relay shows the limits)"
            )))),
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
