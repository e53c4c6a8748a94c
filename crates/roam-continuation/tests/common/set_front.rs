//! A test cluster whose hosts serve a front-end with a back-end process
//! (`service_session.rs`, `service_pg_cluster.rs`): the front-end is the
//! root of a [`SessionSet`] in the host's process, its back-end an example
//! binary joined to it over a control socket and two channels (requests
//! [`REQUESTS`], replies [`REPLIES`]); a move carries the set's cut in the
//! session's continuation and the destination starts the back-end again
//! from its part. Each test brings its own front-end loop ([`Serve`]) and
//! back-end program ([`Front::new`]).

use std::ffi::OsString;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use roam::RoamStream;
use roam_continuation::service_set::{
    check_move_in, Control, Member, Restored, SessionSet, Staged,
};
use roam_continuation::{ClusterConfig, Continuation, Host, ManagedSession, Service};
use roam_proto::Keypair;
use roam_service::{ChannelId, Limits};
use tokio::net::UnixListener;
use tokio::process::{Child, Command};

use super::{cli, init_logging, wait_until};

/// Channel 1: the front-end's requests, read by the back-end.
pub const REQUESTS: ChannelId = ChannelId(1);
/// Channel 2: the back-end's replies, read by the front-end.
pub const REPLIES: ChannelId = ChannelId(2);

/// A front-end's loop for one session: its [`Front`], the session, the
/// client's stream, the running set, the back-end's process and the
/// client's bytes not yet handled (stored at the last save).
pub type Serve = fn(
    Arc<Front>,
    ManagedSession,
    RoamStream,
    SessionSet,
    Child,
    Vec<u8>,
) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// What one host's front-end needs, and what it measured.
pub struct Front {
    /// The back-end program (missing on a host that cannot run it).
    pub backend: PathBuf,
    /// The back-end's role in the set.
    pub role: &'static str,
    /// Where each set incarnation's sockets go (one directory each).
    pub work: PathBuf,
    /// The back-end's arguments before `CONTROL_SOCKET CHANNEL_DIR`.
    pub lead: Vec<OsString>,
    /// The back-end's arguments after `CONTROL_SOCKET CHANNEL_DIR`.
    pub args: Vec<OsString>,
    /// Sets started here (fresh or restored).
    pub starts: AtomicUsize,
    /// Sets restarted here from a cut (staged at a move's check, or in the
    /// resume routine).
    pub restored: AtomicUsize,
    /// Sets staged at a move's check that the resume routine ran.
    pub staged_runs: AtomicUsize,
    /// Kill (SIGKILL) the next back-end staged here right after its
    /// staging: the move commits with it dead, frozen, never thawed.
    pub kill_staged: AtomicBool,
    /// Each back-end killed so (its pid).
    pub killed: Mutex<Vec<u32>>,
    /// Why each staged set the resume routine ran did not start (it then
    /// started the set again from the session's cut).
    pub fallbacks: Mutex<Vec<String>>,
    /// Every back-end process started here.
    pub pids: Mutex<Vec<u32>>,
    /// Size of each cut saved here (bytes).
    pub cuts: Mutex<Vec<usize>>,
}

impl Front {
    /// A front-end whose back-end is `backend` (role `role`), run as
    /// `backend CONTROL_SOCKET CHANNEL_DIR args...`, with its sockets
    /// under `work`.
    pub fn new(backend: PathBuf, role: &'static str, work: PathBuf, args: Vec<OsString>) -> Self {
        Front {
            backend,
            role,
            work,
            lead: Vec::new(),
            args,
            starts: AtomicUsize::new(0),
            restored: AtomicUsize::new(0),
            staged_runs: AtomicUsize::new(0),
            kill_staged: AtomicBool::new(false),
            killed: Mutex::new(Vec::new()),
            fallbacks: Mutex::new(Vec::new()),
            pids: Mutex::new(Vec::new()),
            cuts: Mutex::new(Vec::new()),
        }
    }

    /// The same front-end, its back-end run as `backend lead...
    /// CONTROL_SOCKET CHANNEL_DIR args...`.
    pub fn with_lead(mut self, lead: Vec<OsString>) -> Self {
        self.lead = lead;
        self
    }

    /// The set's limits.
    pub fn limits() -> Limits {
        Limits::default()
    }

    /// Starts the back-end and joins it to `root`: fresh (`parts` `None`),
    /// or from its part of a restored cut (then it stays frozen). Returns
    /// its control (ready) and the child; a back-end that fails to start
    /// is reaped before the error returns.
    async fn launch(
        &self,
        root: &Member,
        parts: Option<&[Vec<u8>]>,
    ) -> std::io::Result<(Vec<Control>, Child)> {
        let n = self.starts.fetch_add(1, Ordering::SeqCst);
        let dir = self.work.join(n.to_string());
        std::fs::create_dir_all(&dir)?;
        let control = UnixListener::bind(dir.join("control.sock"))?;
        let req = UnixListener::bind(dir.join("req.sock"))?;
        let rep = UnixListener::bind(dir.join("rep.sock"))?;
        let mut cmd = Command::new(&self.backend);
        cmd.args(&self.lead)
            .arg(dir.join("control.sock"))
            .arg(&dir)
            .args(&self.args);
        let mut child = cmd.kill_on_drop(true).spawn()?;
        if let Some(pid) = child.id() {
            self.pids.lock().unwrap().push(pid);
        }
        let joined = async {
            let controls = super::join_members(
                &control,
                &[self.role],
                parts,
                std::slice::from_mut(&mut child),
                None,
            )
            .await?;
            let accept = |l: UnixListener| async move {
                tokio::time::timeout(Duration::from_secs(10), l.accept())
                    .await
                    .map_err(|_| std::io::Error::other("the back-end never connected"))?
                    .map(|(s, _)| s)
            };
            root.add_writer(REQUESTS, accept(req).await?)?;
            root.add_reader(REPLIES, accept(rep).await?)?;
            Ok::<_, std::io::Error>(controls)
        }
        .await;
        match joined {
            Ok(controls) => Ok((controls, child)),
            Err(e) => {
                let _ = child.start_kill();
                let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
                Err(e)
            }
        }
    }

    /// Starts the back-end and joins it to `root`: fresh, or from its part
    /// of a restored cut. Returns the set (running) and the child.
    pub async fn start_set(
        &self,
        root: Member,
        restored: Option<Restored>,
    ) -> std::io::Result<(SessionSet, Child)> {
        let parts = restored.as_ref().map(|r| r.parts.clone());
        let (controls, child) = self.launch(&root, parts.as_deref()).await?;
        let set = match restored {
            None => SessionSet::new(root, controls, Self::limits()),
            Some(r) => {
                self.restored.fetch_add(1, Ordering::SeqCst);
                r.start(controls).await?
            }
        };
        Ok((set, child))
    }

    /// At a move's destination, before the commit: the back-end started
    /// from its part of the moving session's cut, frozen, kept with the
    /// restarted root for the resume routine.
    async fn stage(&self, restored: Restored) -> std::io::Result<Staged<Child>> {
        let parts = restored.parts.clone();
        let (controls, mut child) = self.launch(&restored.root, Some(&parts)).await?;
        self.restored.fetch_add(1, Ordering::SeqCst);
        if self.kill_staged.swap(false, Ordering::SeqCst) {
            self.kill(&mut child).await;
        }
        Staged::new(restored, controls, child)
    }

    /// Kills a staged back-end (SIGKILL) and reaps it: it dies between its
    /// staging and its thaw.
    async fn kill(&self, child: &mut Child) {
        use std::os::unix::process::ExitStatusExt;
        let pid = child.id().expect("the staged back-end runs");
        child.start_kill().expect("SIGKILL the staged back-end");
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("the killed back-end exits")
            .expect("reap the killed back-end");
        assert_eq!(status.signal(), Some(9), "killed by SIGKILL: {status}");
        self.killed.lock().unwrap().push(pid);
    }

    /// In the resume routine: the set restarted from the session's cut
    /// (taken out of it) with a back-end started from its part.
    async fn restore_set(&self, session: &ManagedSession) -> (SessionSet, Child) {
        let restored = SessionSet::restore(session, Self::limits())
            .expect("restore the cut")
            .expect("the continuation carries a cut");
        let root = restored.root.clone();
        self.start_set(root, Some(restored))
            .await
            .expect("restart the back-end")
    }

    /// At a freeze request, between two of the front-end's steps (the
    /// root's state equals its last export): stores the client's `pending`
    /// bytes and saves the set's cut into the session, then waits for the
    /// back-end to exit; the caller then suspends the session. A save that
    /// fails (the move is called off) gives the set back, to go on here.
    pub async fn save(
        &self,
        session: &ManagedSession,
        set: SessionSet,
        child: &mut Child,
        pending: &[u8],
    ) -> Result<(), SessionSet> {
        session.store("pending", pending).expect("store pending");
        match set.save(session).await {
            Ok(saved) => {
                self.cuts.lock().unwrap().push(saved.bytes);
                match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
                    Ok(Ok(s)) => assert!(s.success(), "back-end exit: {s}"),
                    other => panic!("the back-end did not end: {other:?}"),
                }
                Ok(())
            }
            Err(failed) => {
                eprintln!("save failed, the set goes on here: {}", failed.error);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(failed.set)
            }
        }
    }
}

/// The continuation a front-end suspends its session with: the client's
/// stream.
pub fn continuation(stream: RoamStream) -> Continuation {
    Continuation::new("front").stream("main", stream)
}

/// The front-end's service: a move's destination checks for the back-end
/// program and stages the back-end from its part before the commit; the
/// resume routine runs the staged set (or, if it died, starts the set
/// again from the session's cut) under `serve`.
pub fn front_service(front: Arc<Front>, serve: Serve) -> Service {
    let check = front.clone();
    let prepare = front.clone();
    Service::new("front")
        .version("1")
        .on_move_in(move |attrs| check_move_in(attrs, Front::limits(), "back-end", &check.backend))
        .prepare_move_in(move |attrs| {
            let restored = Restored::from_attrs(attrs, Front::limits());
            let front = prepare.clone();
            async move {
                let Some(restored) = restored.map_err(|e| e.to_string())? else {
                    return Ok(None);
                };
                let staged = front
                    .stage(restored)
                    .await
                    .map_err(|e| format!("starting the back-end: {e}"))?;
                Ok(Some(staged))
            }
        })
        .routine("front", move |mut r| {
            let front = front.clone();
            async move {
                let stream = r.take_stream("main").expect("the stream moved");
                let pending = r.session.retrieve("pending").unwrap_or_default();
                let (set, child) = match r.take_prepared::<Staged<Child>>() {
                    // Moved in: the back-end started before the commit.
                    Some(staged) => {
                        front.staged_runs.fetch_add(1, Ordering::SeqCst);
                        match staged.start(&r.session).await {
                            Ok(started) => started,
                            // A staged back-end died before its thaw: it
                            // ran nothing since its part was taken, and
                            // the session still carries the cut.
                            Err(e) => {
                                eprintln!(
                                    "the staged set did not start ({e}); starting it again from the session's cut"
                                );
                                front.fallbacks.lock().unwrap().push(e.to_string());
                                front.restore_set(&r.session).await
                            }
                        }
                    }
                    None => front.restore_set(&r.session).await,
                };
                serve(front, r.session, stream, set, child, pending).await;
            }
        })
}

/// One cluster host in this process, with its front-end.
pub type Node = super::ClusterHost<Arc<Front>>;

/// Two hosts `h0`, `h1` on loopback serving one front-end service.
pub struct Cluster {
    /// The key clients pin.
    pub service_key: Keypair,
    /// The cluster file, parsed.
    pub config: ClusterConfig,
    /// `h0`, `h1`.
    pub nodes: Vec<Node>,
    /// The hosts' state and the sets' sockets (and whatever the test keeps
    /// there).
    pub dir: tempfile::TempDir,
}

/// Starts two hosts `h0`, `h1` in `dir`, host `i`'s front-end from
/// `front(i, work)` (`work`, created, is where its sets' sockets go), each
/// new session served by `serve` with a fresh set.
pub async fn start_cluster(
    dir: tempfile::TempDir,
    serve: Serve,
    mut front: impl FnMut(usize, PathBuf) -> Front,
) -> Cluster {
    init_logging();
    let super::ClusterHosts {
        service_key,
        config,
        nodes,
    } = super::start_cluster_hosts(
        2,
        "",
        |hc| hc.server.max_sessions_per_ip = 1000,
        |i, name| {
            let state = dir.path().join(format!("{name}-state"));
            let work = dir.path().join(format!("{name}-sets"));
            std::fs::create_dir_all(&state).unwrap();
            std::fs::create_dir_all(&work).unwrap();
            let front = Arc::new(front(i, work));
            let f = front.clone();
            super::HostSpec {
                state,
                service: front_service(front.clone(), serve),
                on_session: move |host: &Host, handle| {
                    let Ok(s) = host.adopt("front", handle) else {
                        return;
                    };
                    let f = f.clone();
                    tokio::spawn(async move {
                        let Ok((stream, _)) = s.handle().accept_stream().await else {
                            return;
                        };
                        let root = Member::fresh(Front::limits());
                        let (set, child) =
                            f.start_set(root, None).await.expect("start the back-end");
                        serve(f, s, stream, set, child, Vec::new()).await;
                    });
                },
                data: front,
            }
        },
    )
    .await;
    Cluster {
        service_key,
        config,
        nodes,
        dir,
    }
}

impl Cluster {
    /// A client's session to `host` and its stream to the front-end.
    pub async fn connect(&self, host: &str) -> (roam::SessionHandle, RoamStream) {
        let config = cli::client_config(Some(self.service_key.public()));
        let session = roam::connect(&self.config.hosts[host].clients, config)
            .await
            .expect("connect");
        let stream = session.open_stream(b"front").unwrap();
        (session, stream)
    }

    /// The index of the node holding session `id` live.
    pub fn holder(&self, id: roam::SessionId) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.host
                .sessions()
                .iter()
                .any(|r| r.id == id && r.state == "live")
        })
    }

    /// Stops both hosts.
    pub async fn shutdown(mut self) {
        super::stop_cluster_hosts(&mut self.nodes).await;
    }

    /// Every back-end process either host started, in start order per host.
    pub fn backend_pids(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .flat_map(|n| n.data.pids.lock().unwrap().clone())
            .collect()
    }

    /// Closes the client's `session`, stops both hosts and waits until
    /// every back-end process they started is gone.
    pub async fn close_and_reap(self, session: &roam::SessionHandle) {
        let pids = self.backend_pids();
        let _ = tokio::time::timeout(Duration::from_secs(5), session.close(0, "done")).await;
        self.shutdown().await;
        for pid in pids {
            wait_until(Duration::from_secs(10), "every back-end gone", move || {
                !alive(pid)
            })
            .await;
        }
    }
}

/// Whether process `pid` still exists (a zombie counts as gone: it runs
/// nothing).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        // The state follows the parenthesised command name.
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}
