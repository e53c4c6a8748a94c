//! `roam migrate-accept`: the destination side of a move. Accepts roam
//! sessions from authorized keys only; each migration stream brings one
//! process's images, which are restored here with the process's address.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roam_criu::{AddressLock, Criu};
use tokio::io::AsyncWriteExt;

use super::host::{self, IfAddr};
use super::wire::{self, Frame};
use super::DEFAULT_PORT;
use crate::cli::{CliError, CliResult, MigrateAcceptArgs};
use crate::config::FileConfig;

/// Longest wait for the source's next frame (between two image chunks, or
/// for the commit after a restore): past it the migration is undone.
const FRAME_TIMEOUT: Duration = Duration::from_secs(60);

/// What every migration here shares.
struct Host {
    /// CRIU.
    criu: Criu,
    /// Where images are received (a directory per migration inside):
    /// `--images-dir`, else see [`super::images_parent`].
    images_dir: Option<PathBuf>,
    /// The interface to put addresses on (default: the one whose subnet
    /// holds the address).
    dev: Option<String>,
    /// One migration at a time.
    busy: tokio::sync::Mutex<()>,
}

impl Host {
    /// Removes the images directories that a `migrate-accept` killed
    /// outright left in the places this one receives into (see
    /// [`super::sweep`]): at the start and after each move, off the
    /// freeze.
    async fn sweep(&self) {
        let parents = match &self.images_dir {
            Some(dir) => vec![dir.clone()],
            None => vec![std::env::temp_dir(), PathBuf::from(super::SHM)],
        };
        let _ = tokio::task::spawn_blocking(move || {
            for parent in parents {
                super::report_sweep("roam migrate-accept", &parent, super::sweep(&parent));
            }
        })
        .await;
    }
}

/// Runs the destination until SIGINT or SIGTERM.
pub(crate) async fn run(args: MigrateAcceptArgs, config: &FileConfig) -> CliResult {
    if !nix::unistd::geteuid().is_root() {
        return Err(CliError(
            "roam migrate-accept must run as root (CRIU restores processes as their own \
             users, and addresses are added to interfaces)"
                .into(),
        ));
    }
    let criu = Criu::locate()
        .map_err(|e| CliError(format!("cannot accept processes without CRIU: {e}")))?
        .log_level(args.criu_log.into());
    // The restores (CRIU, its lazy-pages daemon) ahead of this host's
    // other work: they run inside the source's freeze.
    if let Err(e) = super::raise_priority() {
        eprintln!(
            "roam migrate-accept: warning: {e}; restores will compete with this host's other work"
        );
    }
    let state = crate::paths::state_dir(config);
    let key_path = args.key.clone().unwrap_or_else(|| state.join("server.key"));
    let keypair = crate::keys::load_or_create(&key_path)?;
    let authorized = crate::keys::read_authorized(&args.authorized_keys)?;
    if authorized.is_empty() {
        return Err(CliError(format!(
            "{} lists no key: nobody could send a process",
            args.authorized_keys.display()
        )));
    }
    let listen = args
        .listen
        .clone()
        .unwrap_or_else(|| format!("0.0.0.0:{DEFAULT_PORT}"));
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| CliError(format!("cannot listen on {listen}: {e}")))?;
    let local = listener.local_addr().map_or(listen, |a| a.to_string());
    let images_dir = args.images_dir.clone();
    eprintln!(
        "roam migrate-accept: listening on {local} (CRIU {}, images in {}, key {}; {} authorized keys)",
        criu.version(),
        images_dir.as_ref().map_or_else(
            || format!("{} ({} for post-copy)", std::env::temp_dir().display(), super::SHM),
            |d| d.display().to_string()
        ),
        keypair.public(),
        authorized.len()
    );
    let host = Arc::new(Host {
        criu,
        images_dir,
        dev: args.dev.clone(),
        busy: tokio::sync::Mutex::new(()),
    });
    host.sweep().await;
    let server = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair,
        authorized_keys: Some(Arc::new(authorized)),
        addresses: Vec::new(),
        session: roam_proto::Config::default(),
    });
    roam::serve(
        listener,
        server,
        crate::serve::shutdown_signal(),
        move |session: roam::SessionHandle| {
            tokio::spawn(serve_session(host.clone(), session));
        },
    )
    .await
    .map_err(|e| CliError(format!("serving failed: {e}")))?;
    Ok(0)
}

/// One source's session: each migration stream it opens, one after another.
/// A post-copy move's pages stream ([`wire::STREAM_PAGES`]) is handed to the
/// migration under way.
async fn serve_session(host: Arc<Host>, session: roam::SessionHandle) {
    let peer = session
        .stats()
        .peer_addr
        .map_or_else(|| "?".to_string(), |a| a.to_string());
    let (meta_tx, mut meta_rx) = tokio::sync::mpsc::channel::<roam::RoamStream>(1);
    let (pages_tx, mut pages_rx) = tokio::sync::mpsc::channel::<roam::RoamStream>(2);
    {
        let session = session.clone();
        let peer = peer.clone();
        tokio::spawn(async move {
            while let Ok((stream, meta)) = session.accept_stream().await {
                if meta == wire::STREAM_META {
                    if meta_tx.send(stream).await.is_err() {
                        return;
                    }
                } else if meta == wire::STREAM_PAGES {
                    if pages_tx.try_send(stream).is_err() {
                        tracing::warn!(
                            "a pages stream from {peer} that no move waits for: refused"
                        );
                    }
                } else if let Some(why) = wire::other_version(&meta) {
                    // Another version of the migration stream: the source
                    // is told why, in the one frame every version shares.
                    eprintln!("roam migrate-accept: a migration from {peer} refused: {why}");
                    tokio::spawn(async move {
                        let mut stream = stream;
                        let _ =
                            wire::write_frame(&mut stream, &Frame::Failed { reason: why }).await;
                        let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                    });
                } else {
                    tracing::warn!(
                        "a stream from {peer} for {:?}, not a migration: refused",
                        String::from_utf8_lossy(&meta)
                    );
                }
            }
        });
    }
    // A source killed outright, or cut off, is noticed within
    // `LOST_GRACE` (the grace the source gives its destination) instead of
    // at `FRAME_TIMEOUT`.
    let lost = super::watch_lost(&session, "source");
    while let Some(stream) = meta_rx.recv().await {
        let _one = host.busy.lock().await;
        // A pages stream left by an earlier move is not this one's.
        while pages_rx.try_recv().is_ok() {}
        let (mut rd, mut wr) = tokio::io::split(stream);
        match receive(&host, &mut rd, &lost, &mut wr, &mut pages_rx).await {
            Ok(msg) => eprintln!("roam migrate-accept: {msg} (from {peer})"),
            Err(reason) => {
                eprintln!("roam migrate-accept: a migration from {peer} failed: {reason}");
                let _ = wire::write_frame(&mut wr, &Frame::Failed { reason }).await;
                // Let the source's sending end: read and drop what it
                // still sends, until it stops (or a minute passes, or the
                // source is lost).
                while let Ok(f) = next(&mut rd, &lost).await {
                    if matches!(f, Frame::Sent | Frame::Abort { .. }) {
                        break;
                    }
                }
            }
        }
        let _ = wr.flush().await;
        host.sweep().await;
    }
}

/// Why the source is lost (its session suspended for longer than
/// [`super::LOST_GRACE`], or ended), once it is.
type SourceLost = tokio::sync::watch::Receiver<Option<String>>;

/// Why the source is lost, once it is (pending forever if `lost`'s sender
/// is gone without a word).
async fn source_lost(lost: &SourceLost) -> String {
    let mut lost = lost.clone();
    loop {
        if let Some(why) = lost.borrow_and_update().clone() {
            return why;
        }
        if lost.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A post-copy move's pages stream, within [`FRAME_TIMEOUT`], unless the
/// source is lost first.
async fn pages_stream(
    pages_rx: &mut tokio::sync::mpsc::Receiver<roam::RoamStream>,
    lost: &SourceLost,
) -> Result<roam::RoamStream, String> {
    tokio::select! {
        biased;
        p = tokio::time::timeout(FRAME_TIMEOUT, pages_rx.recv()) => match p {
            Ok(Some(p)) => Ok(p),
            Ok(None) => Err("the source's session ended before its pages stream came".into()),
            Err(_) => Err(format!(
                "a post-copy move whose pages stream did not come in {} s",
                FRAME_TIMEOUT.as_secs()
            )),
        },
        why = source_lost(lost) => Err(why),
    }
}

/// The source's next frame, within [`FRAME_TIMEOUT`], unless the source is
/// lost first (a frame already here still comes first).
async fn next(
    rd: &mut tokio::io::ReadHalf<roam::RoamStream>,
    lost: &SourceLost,
) -> Result<Frame, String> {
    let frame = tokio::select! {
        biased;
        f = tokio::time::timeout(FRAME_TIMEOUT, wire::read_frame(rd)) => f,
        why = source_lost(lost) => return Err(why),
    };
    match frame {
        Ok(Ok(f)) => Ok(f),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err("the source closed the stream".into())
        }
        Ok(Err(e)) => Err(format!("the stream from the source failed: {e}")),
        Err(_) => Err(format!(
            "nothing from the source for {} s",
            FRAME_TIMEOUT.as_secs()
        )),
    }
}

/// One migration: offer, images, restore, commit. An error is the reason
/// sent back; everything this side did is undone by then.
async fn receive(
    host: &Host,
    rd: &mut tokio::io::ReadHalf<roam::RoamStream>,
    lost: &SourceLost,
    wr: &mut tokio::io::WriteHalf<roam::RoamStream>,
    pages_rx: &mut tokio::sync::mpsc::Receiver<roam::RoamStream>,
) -> Result<String, String> {
    let (address, process, post_copy) = match next(rd, lost).await? {
        Frame::Hello {
            address,
            process,
            pid_space,
            lazy,
        } => {
            if !pid_space.is_empty() && pid_space == host::pid_space(None) {
                return Err(format!(
                    "this host shares the pid namespace of {process} (on the same machine): \
                     its restore here would need the pids its frozen original holds; run \
                     migrate-accept in a pid namespace of its own (unshare --pid --fork \
                     --mount-proc)"
                ));
            }
            (address, process, lazy)
        }
        other => return Err(format!("expected an offer, got {other:?}")),
    };
    // No address: it stays at the source, whose clients follow the process
    // to this host's own address (roam sessions).
    let target = match address.is_empty() {
        true => None,
        false => Some(place(host, &address)?),
    };
    let send = |e: std::io::Error| format!("the stream to the source failed: {e}");
    wire::write_frame(
        wr,
        &Frame::Ready {
            detail: format!(
                "CRIU {}, {}",
                host.criu.version(),
                target
                    .as_ref()
                    .map_or("its clients follow it here", |t| t.dev.as_str())
            ),
        },
    )
    .await
    .map_err(send)?;
    // The first image frame comes once CRIU, having frozen the tree, has
    // closed its first image (the source sends them as they are written).
    // A post-copy move (its offer says so) opened its pages stream before
    // the dump began: it is here by then, or about to be, and the images
    // go to memory and its lazy-pages daemon starts early.
    let first = next(rd, lost).await?;
    let mut pages = match post_copy {
        true => Some(pages_stream(pages_rx, lost).await?),
        false => None,
    };
    let create = |parent: &Path| {
        super::WorkDir::create(parent, "roam-accept-", std::process::id()).map_err(|e| {
            format!(
                "cannot make an images directory in {}: {e}",
                parent.display()
            )
        })
    };
    let images = match &host.images_dir {
        Some(dir) => create(dir)?,
        None => super::images_parent(pages.is_some())
            .and_then(|dir| create(&dir).ok())
            .map_or_else(|| create(&std::env::temp_dir()), Ok)?,
    };
    // The process is frozen at the source from here on. While its images
    // arrive, a post-copy move's lazy-pages daemon starts as soon as the
    // images it reads at its start are written, instead of at the
    // restore's request (stopped when dropped, should the move go no
    // further).
    let (early_tx, early_rx) = tokio::sync::oneshot::channel();
    let starting = async {
        match pages.take() {
            None => (None, None),
            // Not started (the images it needs never came): the stream
            // stays for a start at the restore's request.
            Some(p) => match early_rx.await {
                Err(_) => (None, Some(p)),
                Ok(()) => (Some(LazyPages::start(host, &images.path, p).await), None),
            },
        }
    };
    let (received, (daemon, unused)) = tokio::join!(
        receive_all(&images.path, rd, lost, first, early_tx),
        starting
    );
    pages = unused;
    let daemon = daemon.transpose();
    received?;
    let mut lazy_pages = daemon?;
    // Every image is here: the source asks for the restore at once, its
    // process frozen there until ours runs (so it must not share this
    // host's pid space: the restored pids are the frozen ones'); a restore
    // that fails here rolls its dump back and it runs on there.
    // Meanwhile the lock is taken and the address put here behind it
    // (`nft`, `ip`), off the restore's path. Not earlier: a destination
    // killed while the images travel must leave neither behind.
    let preparing = target.clone().map(|t| {
        tokio::task::spawn_blocking(move || -> Result<(Placed, AddressLock), String> {
            let lock = AddressLock::new(None, t.addr)
                .map_err(|e| format!("cannot lock {} here: {e}", t.addr))?;
            // (On an error the lock is lifted as it drops.) On a lease
            // until the commit: a `migrate-accept` killed outright before
            // it leaves no address behind for long.
            let leased = host::Leased::add(&t)
                .map_err(|e| format!("cannot put {} here: {}", t.cidr(), e.0))?;
            Ok((Placed(Some(leased)), lock))
        })
    });
    let asked = async {
        wire::write_frame(wr, &Frame::Stored).await.map_err(send)?;
        // The process's connections over loopback, if any, come first.
        Ok::<_, String>(match next(rd, lost).await? {
            Frame::Loopback(conns) => (conns, next(rd, lost).await?),
            other => (Vec::new(), other),
        })
    }
    .await;
    // Awaited whatever the answer, so that a refusal below finds the
    // address and the lock in place to undo (as they drop: the address,
    // then the lock).
    let (lock, placed) = match preparing {
        None => (None, Placed(None)),
        Some(p) => {
            let (placed, lock) = p
                .await
                .map_err(|e| format!("the address thread failed: {e}"))??;
            (Some(lock), placed)
        }
    };
    let (loopback, ask) = asked?;
    let lazy = match ask {
        Frame::Restore => false,
        Frame::RestoreLazy => true,
        Frame::Abort { reason } => return Err(format!("the source gave up: {reason}")),
        other => return Err(format!("expected the restore, got {other:?}")),
    };
    if lazy != post_copy {
        return Err(format!(
            "the source asked for a {} restore after offering a {} move",
            if lazy { "post-copy" } else { "whole" },
            if post_copy { "post-copy" } else { "whole" },
        ));
    }
    // Post-copy: the memory comes over the pages stream, through CRIU's
    // lazy-pages daemon, started before the restore (which connects to it):
    // above, while the images arrived, or now (if the images it reads at
    // its start came only with the last of them).
    if lazy && lazy_pages.is_none() {
        let stream = pages
            .take()
            .ok_or("a post-copy restore without the source's pages stream")?;
        lazy_pages = Some(LazyPages::start(host, &images.path, stream).await?);
    }
    // The restored pids must be free: a zombie of an earlier move (a
    // failed restore's) would hold them.
    reap_orphans();
    // Both ends of a loopback connection are rebuilt here, one after the
    // other: their packets wait until both exist (see Frame::Loopback).
    let held = if loopback.is_empty() {
        None
    } else {
        match AddressLock::connections(None, &loopback) {
            Ok(l) => Some(l),
            Err(e) => {
                return Err(format!(
                    "cannot hold the process's {} loopback connections here: {e}",
                    loopback.len()
                ));
            }
        }
    };
    let t = Instant::now();
    let restored = super::restore(host.criu.clone(), images.path.clone(), lazy).await;
    // CRIU has rebuilt every socket (or none is left): TCP retransmits
    // what was dropped meanwhile.
    if let Some(held) = held {
        if let Err(e) = held.release() {
            eprintln!("roam migrate-accept: warning: releasing the loopback connections: {e}");
        }
    }
    let restored = match restored {
        Ok(r) => r,
        Err(e) => {
            keep_log(&images, "the restore");
            return Err(format!("restore failed: {e}"));
        }
    };
    let restore_us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
    let pid = restored.pid;
    let commit = async {
        wire::write_frame(wr, &Frame::Restored { pid, restore_us })
            .await
            .map_err(send)?;
        let mut captured = Vec::new();
        loop {
            match next(rd, lost).await? {
                Frame::Packets(ps) => captured.extend(ps),
                Frame::Commit => return Ok(captured),
                Frame::Abort { reason } => return Err(format!("the source gave up: {reason}")),
                other => return Err(format!("expected the commit, got {other:?}")),
            }
        }
    };
    let captured = match commit.await {
        Ok(c) => c,
        Err(e) => {
            // The source still has the process: ours must go, silently
            // (the lock drops its sockets' last packets).
            kill_and_wait(pid, true);
            return Err(format!("{e}; the restored copy (pid {pid}) was killed"));
        }
    };
    // The address is the process's now, for good: its lease, renewed
    // until now, made infinite before `LIVE` (one netlink request), so no
    // kill of this process after the commit costs the process its address.
    if let Some(Err(e)) = placed.keep() {
        eprintln!("roam migrate-accept: warning: {}", e.0);
    }
    if let Some(lock) = lock {
        let _ = lock.release();
    }
    // The neighbours first (their next packets for the address come here),
    // then what reached the source during the freeze: the peers' answers
    // to it must not go to the old host.
    let announced = target.as_ref().map_or(Ok(()), host::announce);
    let reinjected = match (target.as_ref().map(|t| t.addr), captured.is_empty()) {
        (Some(addr), false) => match super::packets::reinject(&captured, addr) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("roam migrate-accept: warning: re-injecting captured packets: {e}");
                0
            }
        },
        _ => 0,
    };
    wire::write_frame(
        wr,
        &Frame::Live {
            reinjected: reinjected as u64,
        },
    )
    .await
    .map_err(send)?;
    // Post-copy: the images directory stays until the daemon is done with
    // it, and a daemon that fails takes the process down with it.
    let memory = match lazy_pages.take() {
        Some(l) => {
            l.watch(pid, process.clone(), images);
            "; its memory follows (post-copy)"
        }
        None => {
            drop(images);
            ""
        }
    };
    match announced {
        Err(e) => eprintln!("roam migrate-accept: warning: {}", e.0),
        // A second announcement a second later, for a neighbour that missed
        // the first.
        Ok(()) => {
            if let Some(again) = target.clone() {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let _ = host::announce(&again);
                });
            }
        }
    }
    Ok(format!(
        "{process} runs here as pid {pid} {} (restore {} ms; {reinjected} packets \
         captured at the source re-injected){memory}",
        target.as_ref().map_or_else(
            || "(its address stayed at the source; its clients follow it here)".to_string(),
            |t| format!("with {}", t.cidr())
        ),
        restore_us / 1000
    ))
}

/// Where `address` (`ADDR/PREFIX`) goes here: refused if this host has it
/// already or no interface (or not `--dev`) is on its subnet.
fn place(host: &Host, address: &str) -> Result<IfAddr, String> {
    let (addr, prefix) = host::parse_cidr(address)?;
    let here = host::addresses().map_err(|e| e.0)?;
    if here.iter().any(|a| a.addr == addr) {
        return Err(format!("{addr} is already on this host"));
    }
    let dev = match &host.dev {
        Some(d) => d.clone(),
        None => here
            .iter()
            .find(|a| a.covers(addr) && !a.addr.is_loopback())
            .map(|a| a.dev.clone())
            .ok_or_else(|| {
                format!("no interface here is on {addr}'s subnet (start migrate-accept with --dev)")
            })?,
    };
    Ok(IfAddr { dev, addr, prefix })
}

/// The moved address on this host's interface, on a lease renewed until
/// the move is committed ([`Placed::keep`]): taken off again when dropped
/// (by [`host::Leased`]'s drop). `None`: no address was put here.
struct Placed(Option<host::Leased>);

impl Placed {
    /// The address stays for good ([`host::Leased::keep`]: tens of
    /// microseconds, unless a renewal is under way, which it waits for);
    /// `None` if no address was put here.
    fn keep(self) -> Option<Result<(), CliError>> {
        self.0.map(host::Leased::keep)
    }
}

/// A post-copy restore's memory supply: CRIU's lazy-pages daemon, and the
/// task that carries its page-server protocol over the pages stream. Both
/// are stopped when dropped (the move did not happen), unless handed to
/// [`LazyPages::watch`].
struct LazyPages {
    /// The daemon (`None` once handed over).
    daemon: Option<std::process::Child>,
    /// Copies between the daemon's socket and the pages stream; its result
    /// is the bytes that came from the source.
    pump: Option<tokio::task::JoinHandle<std::io::Result<u64>>>,
}

impl LazyPages {
    /// Starts the daemon on `images` with one end of a socket pair whose
    /// other end is pumped to and from the move's pages stream (the source
    /// opened it before the dump). The daemon reads the inventory and the
    /// process tree's images at its start: they must be written.
    async fn start(
        host: &Host,
        images: &Path,
        mut pages: roam::RoamStream,
    ) -> Result<LazyPages, String> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| format!("cannot make a socket for CRIU's lazy-pages daemon: {e}"))?;
        let criu = host.criu.clone();
        let dir = images.to_path_buf();
        let daemon = tokio::task::spawn_blocking(move || {
            criu.lazy_pages_daemon(&dir, std::os::fd::OwnedFd::from(theirs))
        })
        .await
        .map_err(|e| format!("the lazy-pages thread failed: {e}"))?
        .map_err(|e| format!("cannot start CRIU's lazy-pages daemon: {e}"))?;
        daemons(daemon.id(), true);
        let pump = tokio::spawn(async move {
            ours.set_nonblocking(true)?;
            let mut ours = tokio::net::UnixStream::from_std(ours)?;
            let (from_source, _) = tokio::io::copy_bidirectional(&mut pages, &mut ours).await?;
            Ok(from_source)
        });
        Ok(LazyPages {
            daemon: Some(daemon),
            pump: Some(pump),
        })
    }

    /// Waits for the daemon in the background: once it ends, every page is
    /// in place (status 0) or some never will be, and then the process
    /// `pid` is killed before it reads zeros where its memory should be.
    /// The images directory goes once the daemon is done with it.
    fn watch(mut self, pid: i32, process: String, images: super::WorkDir) {
        let (Some(mut daemon), Some(pump)) = (self.daemon.take(), self.pump.take()) else {
            return;
        };
        let started = Instant::now();
        let id = daemon.id();
        tokio::spawn(async move {
            let status = tokio::task::spawn_blocking(move || daemon.wait()).await;
            daemons(id, false);
            let ok = matches!(&status, Ok(Ok(s)) if s.success());
            if ok {
                let bytes = match tokio::time::timeout(Duration::from_secs(5), pump).await {
                    Ok(Ok(Ok(n))) => n,
                    _ => 0,
                };
                eprintln!(
                    "roam migrate-accept: {process}'s memory is all here ({} after the freeze, in {})",
                    super::mb(bytes),
                    super::ms(started.elapsed())
                );
                drop(images);
            } else {
                pump.abort();
                // Not reaping: another move's CRIU may be ending now.
                kill_and_wait(pid, false);
                keep_log(&images, "the lazy pages");
                eprintln!(
                    "roam migrate-accept: {process} (pid {pid}) was KILLED: its memory stopped \
                     arriving from the source ({}; CRIU's log lazy-pages.log is kept)",
                    match status {
                        Ok(Ok(s)) => format!("CRIU's lazy-pages daemon ended: {s}"),
                        Ok(Err(e)) => format!("cannot wait for CRIU's lazy-pages daemon: {e}"),
                        Err(e) => format!("the lazy-pages thread failed: {e}"),
                    }
                );
            }
        });
    }
}

impl Drop for LazyPages {
    fn drop(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
            daemons(daemon.id(), false);
        }
        if let Some(pump) = self.pump.take() {
            pump.abort();
        }
    }
}

/// Kills `pid` and waits (up to 5 s) until it is gone.
fn kill_and_wait(pid: i32, reap: bool) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if reap {
            reap_orphans();
        }
        if !Path::new(&format!("/proc/{pid}")).exists() || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The lazy-pages daemons running here (their pids): children of this
/// process that outlive their move, left by [`reap_orphans`] to the
/// handles that wait for them.
static DAEMONS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Adds a lazy-pages daemon's pid to [`DAEMONS`] (`running`) or removes it.
fn daemons(pid: u32, running: bool) {
    let mut list = DAEMONS.lock().unwrap_or_else(|e| e.into_inner());
    list.retain(|&p| p != pid);
    if running {
        list.push(pid);
    }
}

/// Whether `pid` is a lazy-pages daemon of ours.
fn is_daemon(pid: u32) -> bool {
    DAEMONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&pid)
}

/// Reaps the zombies this process inherited, when it is its pid
/// namespace's first process (`unshare --pid --fork --mount-proc roam
/// migrate-accept`, as where hosts share one pid space): the processes of
/// a restored tree, or of a failed restore, end up its children, and a
/// zombie keeps its pid, which a later restore of the same process needs.
/// Called only between the programs one move runs here (CRIU, `ip`), which
/// their own handles wait for, and never for a lazy-pages daemon (which
/// outlives its move: see [`daemons`]); the `ip` that renews the address's
/// lease meanwhile takes a child reaped here as done (`host::renew`).
/// Elsewhere init reaps orphans and this does nothing.
fn reap_orphans() {
    use nix::sys::wait::{waitpid, WaitPidFlag};
    if std::process::id() != 1 {
        return;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `PID (COMM) STATE PPID ...`; COMM may hold anything, even `)`.
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let mut rest = stat[close + 1..].split_whitespace();
        let (state, ppid) = (rest.next(), rest.next());
        // (A failed restore's tasks are CRIU's forks, named `criu` still:
        // a daemon is told apart by its pid.)
        let daemon = u32::try_from(pid).is_ok_and(is_daemon);
        if state == Some("Z") && ppid == Some("1") && !daemon {
            let _ = waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        }
    }
}

/// Keeps a move's directory with CRIU's logs only (and says so).
fn keep_log(images: &super::WorkDir, what: &str) {
    images.keep(false);
    eprintln!(
        "roam migrate-accept: CRIU's log of {what} is kept in {}",
        images.path.display()
    );
}

/// Receives every image file until [`Frame::Sent`]. A thread of its
/// own writes them (most are a few hundred bytes, one per socket: a
/// blocking-pool trip each would cost more than the write). `early`
/// fires once the images a lazy-pages daemon reads at its start (the
/// inventory and the process tree, small: they come whole, in a
/// [`Frame::Files`]) are written, or else once all are.
async fn receive_all(
    dir: &Path,
    rd: &mut tokio::io::ReadHalf<roam::RoamStream>,
    lost: &SourceLost,
    first: Frame,
    early: tokio::sync::oneshot::Sender<()>,
) -> Result<(), String> {
    /// What the writer thread does next.
    enum Op {
        /// Create this file; the data that follows goes into it.
        Open(String),
        /// Append to the current file.
        Data(Vec<u8>),
        /// Write these whole files.
        Whole(Vec<(String, Vec<u8>)>),
        /// Say that everything before is written.
        Mark(tokio::sync::oneshot::Sender<()>),
    }
    /// What a lazy-pages daemon reads at its start (CRIU's
    /// `prepare_dummy_pstree`; it also reads each process's `ids-N.img`
    /// if there, which the source sends before these two as it sends
    /// the small images in name order, and which the daemon does not
    /// need: without them it goes on).
    const EARLY: [&str; 2] = ["inventory.img", "pstree.img"];
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Op>(64);
    let dir = dir.to_path_buf();
    let writer = std::thread::spawn(move || -> Result<(), String> {
        use std::io::Write;
        // A file the source sends again (written again by CRIU after it
        // went during the dump) replaces the first copy.
        let create = |name: &str| {
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join(name))
                .map_err(|e| format!("cannot create image {name} here: {e}"))
        };
        // At the nice value of ordinary work, not the move's -10: the
        // images come while CRIU still dumps at the source, which on a
        // host shared with the source (two cores here) this must not slow.
        let _ = rustix::process::setpriority_process(None, 0);
        let mut cur: Option<(String, std::fs::File)> = None;
        while let Some(op) = rx.blocking_recv() {
            match op {
                Op::Open(name) => {
                    let f = create(&name)?;
                    cur = Some((name, f));
                }
                Op::Whole(files) => {
                    cur = None;
                    for (name, bytes) in files {
                        create(&name)?
                            .write_all(&bytes)
                            .map_err(|e| format!("cannot write image {name} here: {e}"))?;
                    }
                }
                Op::Data(d) => {
                    if let Some((name, f)) = cur.as_mut() {
                        f.write_all(&d)
                            .map_err(|e| format!("cannot write image {name} here: {e}"))?;
                    }
                }
                Op::Mark(done) => {
                    let _ = done.send(());
                }
            }
        }
        Ok(())
    });
    let fed = async {
        let gone = || "the image writer stopped".to_string();
        let mut first = Some(first);
        let mut early = Some(early);
        // Which of [`EARLY`] came in the whole files so far.
        let mut seen = [false; EARLY.len()];
        loop {
            let frame = match first.take() {
                Some(f) => f,
                None => next(rd, lost).await?,
            };
            // At the end everything is here (a source that sent the
            // early images otherwise than whole).
            if matches!(frame, Frame::Sent) {
                if let Some(done) = early.take() {
                    tx.send(Op::Mark(done)).await.map_err(|_| gone())?;
                }
            }
            match frame {
                Frame::File { name, mut size } => {
                    tx.send(Op::Open(name.clone())).await.map_err(|_| gone())?;
                    while size > 0 {
                        match next(rd, lost).await? {
                            Frame::Data(d) if d.len() as u64 <= size => {
                                size -= d.len() as u64;
                                tx.send(Op::Data(d)).await.map_err(|_| gone())?;
                            }
                            Frame::Data(_) => {
                                return Err(format!("image {name} is longer than announced"))
                            }
                            Frame::Abort { reason } => {
                                return Err(format!("the source gave up: {reason}"))
                            }
                            other => return Err(format!("expected image data, got {other:?}")),
                        }
                    }
                }
                Frame::Files(files) => {
                    for (name, _) in &files {
                        if let Some(i) = EARLY.iter().position(|e| e == name) {
                            seen[i] = true;
                        }
                    }
                    tx.send(Op::Whole(files)).await.map_err(|_| gone())?;
                    if seen.iter().all(|&s| s) {
                        if let Some(done) = early.take() {
                            tx.send(Op::Mark(done)).await.map_err(|_| gone())?;
                        }
                    }
                }
                Frame::Sent => return Ok(()),
                Frame::Abort { reason } => return Err(format!("the source gave up: {reason}")),
                other => return Err(format!("expected an image, got {other:?}")),
            }
        }
    }
    .await;
    drop(tx);
    let written = tokio::task::spawn_blocking(move || writer.join())
        .await
        .map_err(|e| format!("the image writer failed: {e}"))?
        .map_err(|_| "the image writer panicked".to_string())?;
    // The writer's own error (a full disk) explains a stop best.
    written?;
    fed
}
