//! `roam cluster`: the operator's view of a cluster of roam-continuation
//! hosts (`docs/PROTOCOL.md` §14): every host's sessions, moving one, and
//! draining a host. Each request goes to a host's cluster port over the
//! Noise IK channel, with the operator key listed in the cluster file.

use std::time::Duration;

use roam_continuation::cluster::wire::{Msg, SessionRow};
use roam_continuation::cluster::{config::Member, operator_request};
use roam_continuation::ClusterConfig;
use roam_proto::{Keypair, SessionId};
use serde::Serialize;

use crate::cli::{CliError, CliResult, ClusterAction, ClusterArgs};

/// One host as `roam cluster status --json` shows it.
#[derive(Debug, Serialize)]
struct HostStatus {
    host: String,
    /// `null` when the host answered; otherwise why not.
    error: Option<String>,
    sessions: Vec<SessionJson>,
}

/// One session as `roam cluster status --json` shows it.
#[derive(Debug, Serialize)]
struct SessionJson {
    id: String,
    service: String,
    state: String,
}

impl From<&SessionRow> for SessionJson {
    fn from(r: &SessionRow) -> Self {
        Self {
            id: r.id.to_string(),
            service: r.service.clone(),
            state: r.state.clone(),
        }
    }
}

/// What every request needs.
struct Ctx {
    config: ClusterConfig,
    key: Keypair,
    wait: Duration,
}

impl Ctx {
    async fn ask(&self, m: &Member, req: &Msg) -> Result<Msg, String> {
        operator_request(
            &m.peers,
            &self.config.name,
            &self.key,
            &m.key,
            req,
            self.wait,
        )
        .await
    }

    fn host(&self, name: &str) -> Result<&Member, CliError> {
        self.config.hosts.get(name).ok_or_else(|| {
            CliError(format!(
                "no host {name:?} in cluster {} (hosts: {})",
                self.config.name,
                self.config
                    .hosts
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
    }

    /// Every host's status, in file order; a host that does not answer
    /// carries the reason.
    async fn statuses(&self) -> Vec<HostStatus> {
        let mut out = Vec::new();
        for m in self.config.hosts.values() {
            let (error, sessions) = match self.ask(m, &Msg::Status).await {
                Ok(Msg::StatusReply { sessions, .. }) => {
                    (None, sessions.iter().map(SessionJson::from).collect())
                }
                Ok(other) => (Some(format!("unexpected answer {other:?}")), Vec::new()),
                Err(e) => (Some(e), Vec::new()),
            };
            out.push(HostStatus {
                host: m.name.clone(),
                error,
                sessions,
            });
        }
        out
    }
}

/// Prints a DONE answer; returns the exit code (1 if anything failed).
fn report_done(what: &str, answer: Result<Msg, String>) -> CliResult {
    match answer {
        Ok(Msg::Done { moved, failures }) => {
            println!("{what}: {moved} session(s) moved");
            for f in &failures {
                println!("  failed (stays where it was): {f}");
            }
            Ok(if failures.is_empty() { 0 } else { 1 })
        }
        Ok(other) => Err(CliError(format!("{what}: unexpected answer {other:?}"))),
        Err(e) => Err(CliError(format!("{what}: {e}"))),
    }
}

/// `roam cluster`.
pub(crate) async fn run(args: ClusterArgs) -> CliResult {
    let text = std::fs::read_to_string(&args.cluster_file).map_err(|e| {
        CliError(format!(
            "cannot read the cluster file {}: {e}",
            args.cluster_file.display()
        ))
    })?;
    let config = ClusterConfig::parse(&text)
        .map_err(|e| CliError(format!("{}: {e}", args.cluster_file.display())))?;
    let key = crate::keys::read_key(&args.key)?;
    if config.operator_by_key(&key.public()).is_none() {
        return Err(CliError(format!(
            "the key in {} ({}) is not an operator of cluster {}: add `operator NAME key={}` to the cluster file on every host",
            args.key.display(),
            key.public(),
            config.name,
            key.public()
        )));
    }
    let wait = crate::config::parse_duration(&args.timeout).map_err(CliError)?;
    let ctx = Ctx { config, key, wait };
    match args.action {
        ClusterAction::Status { json } => {
            let hosts = ctx.statuses().await;
            if json {
                println!("{}", serde_json::to_string_pretty(&hosts)?);
            } else {
                for h in &hosts {
                    match &h.error {
                        Some(e) => println!("{}: not answering: {e}", h.host),
                        None => {
                            println!("{}: {} session(s)", h.host, h.sessions.len());
                            for s in &h.sessions {
                                println!("  {}  {:<10} {}", s.id, s.state, s.service);
                            }
                        }
                    }
                }
            }
            Ok(if hosts.iter().any(|h| h.error.is_some()) {
                1
            } else {
                0
            })
        }
        ClusterAction::Move { session, to } => {
            let id: SessionId = session.parse().map_err(|e| {
                CliError(format!(
                    "session id {session:?}: {e} (as `roam cluster status` shows it)"
                ))
            })?;
            ctx.host(&to)?;
            let holder = ctx
                .statuses()
                .await
                .into_iter()
                .find(|h| h.sessions.iter().any(|s| s.id == id.to_string()))
                .ok_or_else(|| CliError(format!("no host of the cluster holds session {id}")))?;
            if holder.host == to {
                println!("session {id} is already on {to}");
                return Ok(0);
            }
            let m = ctx.host(&holder.host)?;
            report_done(
                &format!("move {id} from {} to {to}", holder.host),
                ctx.ask(m, &Msg::Move { id, to: to.clone() }).await,
            )
        }
        ClusterAction::Drain { host } => {
            let m = ctx.host(&host)?;
            report_done(&format!("drain {host}"), ctx.ask(m, &Msg::Drain).await)
        }
    }
}
