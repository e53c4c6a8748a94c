//! `roam forward`: a local port forward; every accepted connection is a new
//! stream of one shared session, so all of them survive network changes.
//! With `--name` the session also outlives the process (see [`Named`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::net::TcpStream;

use crate::cli::{CliError, CliResult, ForwardArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay, explain_stream_error};
use crate::control::Registry;
use crate::named::{self, Header, JournalFile, NameLock, Record};
use crate::target::{relay_addr, split_host_port};

/// `roam forward`.
pub(crate) async fn run(args: ForwardArgs, config: &FileConfig) -> CliResult {
    let (_, relay) = relay_addr(&args.relay)?;
    match split_host_port(&args.target)? {
        (h, Some(_)) if !h.is_empty() => {}
        _ => {
            return Err(CliError(format!(
                "target {:?} must be HOST:PORT",
                args.target
            )))
        }
    }
    crate::limits::raise_fd_limit();
    let listener = crate::limits::listen(&args.listen)
        .await
        .map_err(|e| CliError(format!("cannot listen on {}: {e}", args.listen)))?;
    let local = listener
        .local_addr()
        .map_or(args.listen.clone(), |a| a.to_string());
    let named = match &args.name {
        Some(name) => Some(Named::take(name, &relay, &args, config)?),
        None => None,
    };
    let mut session = match &named {
        Some(n) => n.attach(&args, config).await?,
        None => connect_relay(&relay, args.client.key.as_deref(), config)
            .await
            .map_err(|e| e.into_cli())?,
    };
    let label = format!("forward {local} -> {relay} -> {}", args.target);
    let registry = Registry::default();
    registry.add(label.clone(), session.clone());
    tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
    let _control = crate::control::start(config, label.clone(), registry.clone());
    eprintln!("roam forward: {local} -> {} via {relay}", args.target);
    // Set when the relay lost the session: the next local connection opens a
    // new one (nothing else is lost: its streams are gone either way).
    let mut lost = false;
    let mut accept_log = roam::LogThrottle::new(std::time::Duration::from_secs(10));
    // Installed once, before the loop: a signal between two turns is not lost.
    let mut stop_signal: std::pin::Pin<Box<dyn std::future::Future<Output = i32> + Send>> =
        if named.is_none() {
            Box::pin(crate::signals::exit_signal())
        } else {
            Box::pin(crate::signals::detach_signal())
        };
    let stop = loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, from)) => {
                    if lost {
                        match connect_relay(&relay, args.client.key.as_deref(), config).await {
                            Ok(s) => {
                                session = s;
                                lost = false;
                                if let Some(n) = &named {
                                    session.set_journal(n.journal());
                                }
                                registry.add(label.clone(), session.clone());
                                tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
                                crate::notices::notice(&format!("new session with relay {relay}"));
                            }
                            Err(e) => {
                                crate::notices::notice(&format!(
                                    "connection from {from} dropped: {}", e.into_cli().0
                                ));
                                continue;
                            }
                        }
                    }
                    let stream = match session.open_stream(args.target.as_bytes()) {
                        Ok(s) => s,
                        Err(e) => break Stop::Exit(Err(CliError(format!("session ended: {e}")))),
                    };
                    tokio::spawn(forward_one(tcp, stream, args.target.clone(), from));
                }
                Err(e) => {
                    // Out of file descriptors (or a connection that died in
                    // the backlog): retrying at once would spin, so pause,
                    // and log once per 10 s.
                    if let Some(n) = accept_log.allow(std::time::Instant::now()) {
                        tracing::warn!("accept failed: {e}; retrying ({n} more not logged)");
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
            reason = session.closed(), if !lost => {
                if crate::notices::is_session_lost(&reason) {
                    crate::notices::notice(&format!(
                        "{}; the next connection to {local} opens a new session",
                        crate::notices::lost_message(&reason, &relay)
                    ));
                    lost = true;
                } else {
                    break Stop::Exit(Err(CliError(roam::Error::Closed(reason).to_string())));
                }
            }
            sig = &mut stop_signal => break if named.is_none() {
                Stop::Exit(Ok(128 + sig))
            } else {
                Stop::Detach(sig)
            },
        }
    };
    let result = match (stop, &named) {
        (Stop::Detach(sig), Some(n)) if !lost => return n.detach(&session, sig).await,
        // A session the relay lost has nothing to save: end as unnamed.
        (Stop::Detach(sig), _) => Ok(128 + sig),
        (Stop::Exit(r), _) => r,
    };
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(3),
        session.close(roam_proto::code::NO_ERROR, ""),
    )
    .await;
    if let Some(n) = &named {
        session.clear_journal();
        named::remove_all(&n.dir, &n.name);
    }
    result
}

/// How the accept loop ended.
enum Stop {
    /// With this result (the session is closed).
    Exit(CliResult),
    /// A named forward got a detach signal (its number).
    Detach(i32),
}

/// A named forward (`roam forward --name`): its name lock, its journal, and
/// how it attaches and detaches. The session outlives the process; the
/// local connections cannot (they end with the process that accepted them),
/// so a re-attach resets their streams and the relay closes their target
/// connections.
struct Named {
    name: String,
    dir: PathBuf,
    _lock: NameLock,
    file: Arc<Mutex<JournalFile>>,
    /// What every record of this session says besides its state.
    base: Header,
}

impl Named {
    /// Takes the name (refused while another process holds it).
    fn take(
        name: &str,
        relay: &str,
        args: &ForwardArgs,
        config: &FileConfig,
    ) -> Result<Self, CliError> {
        named::check_name(name).map_err(CliError)?;
        let dir = named::dir(config);
        let lock = NameLock::take(&dir, name).map_err(CliError)?;
        let file = JournalFile::open(&dir, name)
            .map_err(|e| CliError(format!("{}: {e}", dir.display())))?;
        Ok(Self {
            name: name.to_string(),
            dir,
            _lock: lock,
            file: Arc::new(Mutex::new(file)),
            base: Header::new(name, relay, &args.target, Some(args.listen.clone())),
        })
    }

    /// The session's journal: its record, rewritten before each byte that
    /// would make the last one stale (see `pipe::journal_writer`).
    fn journal(&self) -> roam::JournalWriter {
        let base = self.base.clone();
        named::journal_writer(
            self.dir.clone(),
            self.name.clone(),
            self.file.clone(),
            move |entry, bytes| {
                let header = Header {
                    detached_at: named::unix_now(),
                    ..base.clone()
                };
                named::encode_parts(&header, entry.blob, &[], &[], bytes);
            },
        )
    }

    /// Re-attaches the session saved under the name, or opens a new one;
    /// journaled either way.
    async fn attach(
        &self,
        args: &ForwardArgs,
        config: &FileConfig,
    ) -> Result<roam::SessionHandle, CliError> {
        let name = &self.name;
        let relay = &self.base.relay;
        let Some(record) = named::load(&self.dir, name).map_err(CliError)? else {
            return self.open(args, config).await;
        };
        let h = &record.header;
        if h.listen.as_deref() != Some(args.listen.as_str())
            || h.relay != *relay
            || h.target != args.target
        {
            return Err(CliError(match &h.listen {
                Some(l) => format!(
                    "session {name:?} forwards {l} to {} through relay {}: give those, or choose another name",
                    h.target, h.relay
                ),
                None => format!(
                    "session {name:?} is a `roam pipe` session: re-attach it with `roam pipe --name {name} {} {}`",
                    h.relay, h.target
                ),
            }));
        }
        let since = named::unix_now().saturating_sub(h.detached_at);
        let when = crate::control::human_secs(since as f64);
        let offline = std::time::Duration::from_secs(if h.journal { 0 } else { since });
        if h.journal {
            eprintln!(
                "roam forward: session {name:?} was not detached: its client (pid {}) was killed or crashed; re-attaching from its journal (last written {when} ago) at {relay}...",
                h.pid
            );
        } else {
            eprintln!(
                "roam forward: re-attaching session {name:?} (detached {when} ago) at {relay}..."
            );
        }
        let proto = crate::connect::client_proto(args.client.key.as_deref(), config, None)?;
        let detached = h.detached(record.continuation);
        match roam::resume_journaled(
            relay,
            roam::ClientConfig::new(proto),
            detached,
            offline,
            Some(self.journal()),
        )
        .await
        {
            Ok(session) => {
                // Their local connections ended with the old process.
                let gone = session.stream_ids();
                for id in &gone {
                    if let Ok(mut s) = session.stream(*id) {
                        s.reset(crate::serve::reset::CLIENT_GONE);
                    }
                }
                eprintln!(
                    "roam forward: session {name:?} re-attached after {when}{}",
                    match gone.len() {
                        0 => String::new(),
                        n => format!("; the {n} connection(s) it carried ended with the old process, their streams are reset"),
                    }
                );
                Ok(session)
            }
            Err(e) => {
                crate::notices::notice(&format!(
                    "session {name:?} (left {when} ago) cannot be re-attached and is lost: {e}; starting a new one"
                ));
                self.open(args, config).await
            }
        }
    }

    /// A new session, journaled from the start.
    async fn open(
        &self,
        args: &ForwardArgs,
        config: &FileConfig,
    ) -> Result<roam::SessionHandle, CliError> {
        let session = connect_relay(&self.base.relay, args.client.key.as_deref(), config)
            .await
            .map_err(|e| e.into_cli())?;
        session.set_journal(self.journal());
        Ok(session)
    }

    /// Detaches the session (a signal, or `roam detach`): its continuation
    /// is saved, synced, for the next process.
    async fn detach(&self, session: &roam::SessionHandle, sig: i32) -> CliResult {
        let name = &self.name;
        let detached = session.detach().await.map_err(|e| {
            CliError(format!(
                "signal {sig}: session {name:?} could not be detached ({e}); it is lost"
            ))
        })?;
        let record = Record {
            header: Header {
                detached_at: named::unix_now(),
                journal: false,
                unaccepted: detached.unaccepted.iter().map(|s| s.0).collect(),
                orphans: detached.orphans.iter().map(|s| s.0).collect(),
                ..self.base.clone()
            },
            continuation: detached.blob,
            upload: Vec::new(),
            download: Vec::new(),
        };
        JournalFile::open(&self.dir, name)
            .and_then(|mut f| f.write(&record.encode(), true))
            .map_err(|e| {
                CliError(format!(
                    "session {name:?} was detached but its state could not be saved in {} ({e}): it is lost",
                    self.dir.display()
                ))
            })?;
        eprintln!(
            "roam forward: session {name:?} detached (saved in {}); re-attach with `roam forward --name {name} {} {} {}`",
            self.dir.display(),
            self.base.relay,
            self.base.listen.as_deref().unwrap_or_default(),
            self.base.target
        );
        Ok(0)
    }
}

async fn forward_one(
    mut tcp: TcpStream,
    mut stream: roam::RoamStream,
    target: String,
    from: std::net::SocketAddr,
) {
    let _ = tcp.set_nodelay(true);
    if let Err(e) = crate::pump::pump(&mut tcp, &mut stream).await {
        eprintln!(
            "roam forward: connection from {from}: {}",
            explain_stream_error(&e, &target)
        );
    }
}
