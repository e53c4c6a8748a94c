//! `roam migrate-process PID --to HOST`: the source side of a move.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use roam_criu::{AddressLock, Criu, DumpOptions, NetworkLock};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use super::host::{self, IfAddr, ProcessInfo};
use super::outgoing::{Closed, Outgoing};
use super::wire::{self, Frame};
use super::{mb, ms, Progress, DEFAULT_PORT};
use crate::cli::{CliError, CliResult, MigrateProcessArgs};
use crate::config::FileConfig;

/// Longest wait for the destination's answer to one request (a restore of a
/// large process takes a while).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// The source: moves process `args.pid` to `args.to`.
pub(crate) async fn run(args: MigrateProcessArgs, config: &FileConfig) -> CliResult {
    let mut progress = Progress::new();
    let criu = Criu::locate()
        .map_err(|e| CliError(format!("cannot move a process: {e}")))?
        .log_level(args.criu_log.into());
    let info = host::inspect(args.pid)?;
    let address = own_address(args.address.as_deref(), &info)?;
    // Clients that follow the process to another address: its key proves
    // the redirect here is the same server.
    let follow = match (&args.sessions_to, &args.server_key) {
        (Some(at), Some(key)) => {
            let port = match crate::target::split_host_port(at)? {
                (_, Some(p)) => p,
                (_, None) => {
                    return Err(CliError(format!(
                        "--sessions-to {at}: say the port the process listens on (HOST:PORT)"
                    )))
                }
            };
            Some(Follow {
                to: at.clone(),
                port,
                key: crate::keys::read_key(key)?,
            })
        }
        _ => None,
    };
    let to = match crate::target::split_host_port(&args.to)? {
        (h, Some(p)) => crate::target::join(&h, p),
        (h, None) => crate::target::join(&h, DEFAULT_PORT),
    };
    progress.phase(&format!(
        "moving {} ({}; {}) {} to {to}",
        info.label(),
        plural(info.pids.len(), "process", "processes"),
        info.sockets(),
        match &follow {
            None => format!("with {}", address.cidr()),
            Some(f) => format!(
                "(its roam clients follow it to {}; {} stays here)",
                f.to, address.addr
            ),
        }
    ));
    // Before anything is frozen: the freeze's steps here (CRIU, nft, ip,
    // the images' sending) ahead of this host's other work.
    if let Err(e) = super::raise_priority() {
        progress.phase(&format!(
            "warning: {e}; the freeze will compete with this host's other work"
        ));
    }
    let session = crate::connect::connect_migrate_accept(&to, args.client.key.as_deref(), config)
        .await
        .map_err(|e| CliError(format!("{}; nothing was moved", e.0)))?;
    let stream = session
        .open_stream(wire::STREAM_META)
        .map_err(|e| CliError(format!("cannot open a stream to {to}: {e}")))?;
    let (rd, wr) = tokio::io::split(stream);
    // Frames go out through a task of their own, whole: cancelling a
    // step (a signal, the destination's early refusal) never leaves half
    // a frame on the stream ahead of the `ABORT` that follows.
    let (mut wr, writer) = Outbox::spawn(wr);
    let (answers_tx, mut answers) = spawn_reader(rd);
    // A destination that dies or drops off the network must not keep the
    // process frozen while the session waits to resume: past a short grace
    // the move is called off (until the destination has restored it).
    watch_session(&session, answers_tx, wr.lost.clone());
    let refused = |why: String| {
        CliError(format!(
            "{to} cannot take the process: {why}; nothing was frozen"
        ))
    };
    wr.send(&Frame::Hello {
        // Empty: the address stays here (its clients follow the process).
        address: match follow {
            None => address.cidr(),
            Some(_) => String::new(),
        },
        process: info.label(),
        pid_space: host::pid_space(Some(args.pid)),
        lazy: args.lazy_pages,
    })
    .await
    .map_err(|e| refused(e.to_string()))?;
    let ready = match answer(&mut answers).await {
        Ok(Frame::Ready { detail }) => detail,
        Ok(Frame::Failed { reason }) => return Err(refused(reason)),
        Ok(other) => return Err(refused(format!("it answered {other:?} to the offer"))),
        Err(e) => return Err(refused(e)),
    };
    progress.phase(&format!("{to} can host it ({ready})"));
    // Post-copy: a second stream carries CRIU's page-server protocol to
    // the destination's lazy-pages daemon from the frozen process's memory
    // (`pages::PageServer`, which holds the socket pair CRIU's lazy dump
    // inherits until the daemon has every page).
    let (mut lazy, criu_pages) = match args.lazy_pages {
        false => (None, None),
        true => {
            let pages = session
                .open_stream(wire::STREAM_PAGES)
                .map_err(|e| refused(format!("cannot open its pages stream: {e}")))?;
            let (ours, criu_end) = std::os::unix::net::UnixStream::pair().map_err(|e| {
                CliError(format!(
                    "cannot make a socket pair for the pages: {e}; nothing was frozen"
                ))
            })?;
            let server = super::pages::PageServer::start(&info.pids, pages, ours).map_err(|e| {
                CliError(format!("cannot serve its memory: {e}; nothing was frozen"))
            })?;
            (Some(server), Some(std::os::fd::OwnedFd::from(criu_end)))
        }
    };

    // Post-copy with a stock CRIU: room for the lazy dump's page pipes
    // (`roam_criu::PipeRoom`), before anything is frozen: its memory work
    // inside the freeze is halved with it. The CRIU roam builds captures
    // no lazy memory into pipes and needs none.
    // Without the room such a dump is slower, not wrong.
    let room = match criu_pages {
        Some(_) if !criu.knows_lazy_unpiped() => match roam_criu::PipeRoom::make() {
            Ok(room) => Some(room),
            Err(e) => {
                progress.phase(&format!(
                    "warning: {e}; its lazy dump fills smaller page pipes, in a longer freeze"
                ));
                None
            }
        },
        _ => None,
    };

    // Post-copy: on tmpfs, as at the destination (see `images_parent`).
    let images_at = args
        .images_dir
        .clone()
        .or_else(|| super::images_parent(args.lazy_pages));
    let images_parent = images_at.unwrap_or_else(std::env::temp_dir);
    super::report_sweep("roam", &images_parent, super::sweep(&images_parent));
    let images = super::WorkDir::create(&images_parent, "roam-migrate-", args.pid.unsigned_abs())
        .map_err(|e| {
        CliError(format!(
            "cannot make an images directory in {}: {e}; nothing was frozen",
            images_parent.display()
        ))
    })?;
    // From the lock on, a signal must not kill roam (the address would
    // stay locked): SIGINT, SIGTERM and SIGHUP call the move off while it
    // can be (until the destination has restored the process), and are
    // ignored after that, while the hand-over completes.
    let interrupt = catch_signals()?;
    // The tree's connections over loopback are held here too, from before
    // the dump until CRIU has ended or resumed the tree: CRIU reads one end
    // of such a connection after the other, and a packet between the two
    // reads (the other end sending into a window the first had opened)
    // leaves images that disagree — the sender counts bytes as delivered
    // that the receiver's image lacks, and the restored connection stalls
    // for good.
    let loopback_held = host::inspect(args.pid)
        .map(|i| i.loopback)
        .unwrap_or_else(|_| info.loopback.clone());
    let loopback_lock = if loopback_held.is_empty() {
        None
    } else {
        Some(AddressLock::connections(None, &loopback_held).map_err(|e| {
            CliError(format!(
                "cannot hold its {} loopback connections: {e}; nothing was frozen",
                loopback_held.len()
            ))
        })?)
    };
    // The address is locked (and its packets captured) in CRIU's
    // pre-dump step, after CRIU's own start-up and just before it freezes
    // the tree: the tree serves while CRIU starts. With --sessions-to it
    // is locked now, as its sessions' connections are cut before the dump.
    let lock_address = {
        let addr = address.addr;
        let capture = !args.no_reinject && follow.is_none();
        move || Locked::take(addr, capture)
    };
    let locked: std::sync::Arc<std::sync::Mutex<Option<Locked>>> = std::sync::Arc::default();
    if follow.is_some() {
        let l = lock_address().map_err(|e| CliError(format!("{e}; nothing was frozen")))?;
        put(&locked, l);
        // The sessions' connections here cannot be rebuilt at another
        // address: cut now (the lock keeps new ones out), the process sees
        // them fail and its sessions wait for their clients to resume.
        cut_connections(&address, &mut progress).await;
    }
    // About how much memory follows after the freeze (post-copy): read
    // before it, as an estimate for the progress lines.
    let lazy_bytes = if args.lazy_pages {
        anonymous_bytes(&info.pids)
    } else {
        None
    };
    // Said from CRIU's pre-dump step, once the address is locked.
    let freezing = {
        let line = progress.line_maker();
        let msg = format!("freezing and dumping {}", info.label());
        move || line(&msg)
    };

    // CRIU runs on a thread of its own; its post-dump step (the process
    // frozen, the images complete) hands the images directory over here
    // and waits for the verdict: `Ok` once the destination has restored
    // the process (CRIU then ends it here), the reason otherwise (CRIU
    // resumes it here, its connections untouched).
    let (images_tx, mut images_rx) = mpsc::channel::<PathBuf>(1);
    let (verdict_tx, verdict_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    let dump = {
        let dir = images.path.clone();
        let pid = args.pid;
        let locked = locked.clone();
        tokio::task::spawn_blocking(move || {
            let opts = DumpOptions {
                tcp_established: true,
                network_lock: NetworkLock::Skip,
                ..DumpOptions::default()
            };
            let mut step = |p: &Path| {
                images_tx
                    .blocking_send(p.to_path_buf())
                    .map_err(|_| "roam stopped waiting".to_string())?;
                verdict_rx
                    .recv()
                    .unwrap_or_else(|_| Err("roam stopped waiting".into()))
            };
            // Locks the address (unless locked already), then CRIU
            // freezes the tree.
            let mut pre = || {
                let mut slot = locked.lock().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(lock_address()?);
                }
                freezing();
                Ok(())
            };
            // Post-copy (`criu_pages`): a lazy dump; its memory is served
            // after the step, until the destination has all of it.
            criu.dump_steps(pid, &dir, &opts, criu_pages, &mut pre, &mut step)
        })
    };
    // The images go as CRIU closes them, while it still dumps
    // (`outgoing`); the post-dump step sends what is left.
    let mut outgoing = Outgoing::new(&images.path);
    let mut watch = match Closed::watch(&images.path) {
        Ok(w) => Some(w),
        Err(e) => {
            progress.phase(&format!(
                "warning: cannot watch the images directory ({e}); the images travel after \
                 the dump"
            ));
            None
        }
    };
    // What ended the sending before the post-dump step, if anything: an
    // error, or the destination's answer (a refusal: a full disk).
    let mut early_end: Option<Result<Frame, String>> = None;
    let stepped = loop {
        tokio::select! {
            biased;
            dir = images_rx.recv() => break dir,
            closed = async {
                match watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            } => match closed {
                Some(names) => {
                    if let Err(e) = outgoing.send_early(&mut wr, &names).await {
                        early_end = Some(Err(e));
                        watch = None;
                    }
                }
                // The rest goes at the post-dump step.
                None => watch = None,
            },
            _ = interrupt.wait(), if early_end.is_none() => {
                early_end = Some(Err("interrupted by a signal".to_string()));
                watch = None;
            }
            f = answers.recv(), if early_end.is_none() => {
                early_end = Some(f.unwrap_or_else(|| Err("the stream to the destination ended".into())));
                watch = None;
            }
        }
    };
    // What CRIU closed but the watch has not named yet goes with the rest
    // (`send_rest` lists the directory).
    drop(watch);
    let mut timings = Timings::default();
    // The destination restored the process inside the post-dump step:
    // its pid there (post-copy: its memory served from here).
    let mut restored = None;
    let mut serving = None;
    // The address lock, taken by now if the dump reached its post-dump
    // step.
    let mut held: Option<Locked> = None;
    if stepped.is_some() {
        // The tree is frozen from here on: every connection it has is read
        // while the images travel, not after.
        let inspected = {
            let pid = args.pid;
            tokio::task::spawn_blocking(move || host::inspect(pid))
        };
        held = take(&locked);
        if let Some(h) = &held {
            timings.dump = h.at.elapsed();
            timings.lock = h.took;
            if let Some(e) = &h.capture_failed {
                progress.phase(&format!(
                    "warning: cannot capture packets during the freeze ({e}); peers will \
                     retransmit them"
                ));
            }
        }
        let sent = Instant::now();
        // Post-copy: the lazy dump wrote none of the private memory; the
        // destination fetches it as it needs it.
        let outcome = match held {
            None => Err("roam's address lock was not taken before the freeze".to_string()),
            Some(_) => tokio::select! {
                r = send_images(
                    &mut wr,
                    &mut answers,
                    &mut outgoing,
                    early_end,
                    &mut progress,
                    &timings,
                    &to,
                ) => r,
                _ = interrupt.wait() => Err("interrupted by a signal".to_string()),
            },
        };
        timings.transfer = sent.elapsed();
        let server = lazy.take();
        let outcome = match outcome {
            Ok(()) => {
                // The process stays frozen here (its sockets in repair
                // mode) until the destination has restored it: a restore
                // that fails there rolls the dump back. Post-copy: its
                // memory stays here, served to the destination.
                progress.phase(&format!(
                    "images sent; {to} restores {} while {}",
                    info.label(),
                    match (&server, lazy_bytes) {
                        (Some(_), Some(n)) => format!("its memory (about {}) stays here", mb(n)),
                        (Some(_), None) => "its memory stays here".to_string(),
                        (None, _) => "it stays frozen here".to_string(),
                    }
                ));
                let ask = match server {
                    Some(_) => Frame::RestoreLazy,
                    None => Frame::Restore,
                };
                let loopback = match inspected.await {
                    Ok(Ok(i)) => i.loopback,
                    _ => info.loopback.clone(),
                };
                let asked = Instant::now();
                let r = match unheld(&loopback, &loopback_held) {
                    // Its images may disagree: called off.
                    Some((a, b)) => Err(format!(
                        "its loopback connection {a} - {b} opened while it was being frozen, \
                         unheld: its two ends' images may disagree"
                    )),
                    None => tokio::select! {
                        r = ask_restore(&mut wr, &mut answers, &to, &loopback, ask) => r,
                        _ = interrupt.wait() => Err("interrupted by a signal".to_string()),
                    },
                };
                if let Some(server) = server {
                    match r {
                        Ok(_) => serving = Some(server),
                        Err(_) => server.stop(),
                    }
                }
                if let Ok((pid, us)) = r {
                    timings.restore = Duration::from_micros(us);
                    timings.wait = asked.elapsed().saturating_sub(timings.restore);
                    restored = Some(pid);
                }
                r.map(|_| ())
            }
            Err(e) => {
                // Called off: CRIU's page server (it starts even after a
                // refused step) sees its socket close and ends at once.
                if let Some(server) = server {
                    server.stop();
                }
                Err(e)
            }
        };
        let _ = verdict_tx.send(outcome);
    }
    let serving_some = serving.is_some();
    if let Some(server) = lazy.take() {
        // The dump failed before its post-dump step.
        server.stop();
    }
    drop(verdict_tx);
    // Post-copy: the process runs at the destination; CRIU ends it here
    // (its repair-mode sockets close without a packet, its memory is
    // unmapped: 0.1-0.2 s at 1 GB) while the address is handed over, not
    // before.
    // (`held` is taken only for the branch that runs.)
    if let (Some(new_pid), Some(server), Some(h)) = (
        restored,
        serving,
        held.take_if(|_| restored.is_some() && serving_some),
    ) {
        return finish_lazily(
            LazyMove {
                new_pid,
                follow,
                server,
                dump,
                lock: h.lock,
                capture: h.capture,
                frozen_at: h.at,
                timings,
                room,
                lazy_bytes,
            },
            wr,
            &mut answers,
            &args,
            &info,
            &address,
            &to,
            progress,
            writer,
            &session,
            images,
        )
        .await;
    }
    if let (Some(new_pid), Some(h)) = (restored, held.take()) {
        // The process runs at the destination (behind its lock) and CRIU
        // ends it here (its repair-mode sockets close without a packet)
        // while the address is handed over.
        progress.phase(&match follow {
            None => format!(
                "restored at {to} as pid {new_pid}; handing over {}",
                address.addr
            ),
            Some(_) => format!("restored at {to} as pid {new_pid}; its clients follow it there"),
        });
        let mut done = hand_over(
            &mut wr,
            &mut answers,
            &address,
            follow.is_some(),
            h.capture,
            h.lock,
            &to,
            h.at,
            &mut timings,
        )
        .await;
        let handed = Instant::now();
        let dumped = match dump.await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(format!("the dump thread failed: {e}")),
        };
        let gone = wait_gone(&info.pids);
        timings.end = handed.elapsed();
        if let Err(e) = &dumped {
            done.warnings
                .push(format!("CRIU reported a failure after the move: {e}"));
        }
        if !gone {
            done.warnings.push(format!(
                "{} still runs here besides at {to}: CRIU did not end it (kill it; its \
                 connections live at {to})",
                info.label()
            ));
        }
        let moved = Moved {
            args: &args,
            info: &info,
            address: &address,
            to: &to,
            new_pid,
            done: &done,
            timings: &timings,
            image_bytes: dumped.map_or(0, |d| d.image_bytes),
            post_copy: None,
        };
        return conclude(images, wr, writer, &session, progress, follow, &moved).await;
    }
    // Called off (or the dump failed): CRIU resumed the process here.
    let dumped = dump
        .await
        .map_err(|e| CliError(format!("the dump thread failed: {e}")))?;
    // Resumed: its loopback connections carry on (TCP retransmits what
    // the lock dropped).
    drop(loopback_lock);
    let unlocked = match held.or_else(|| take(&locked)) {
        Some(h) => {
            drop(h.capture);
            h.lock.release()
        }
        None => Ok(()),
    };
    let e = match dumped {
        Err(roam_criu::Error::Aborted { reason }) => reason,
        Err(other) => {
            images.keep(false);
            eprintln!(
                "roam: CRIU's log of the dump is kept in {}",
                images.path.display()
            );
            other.to_string()
        }
        Ok(_) => {
            // CRIU completed a dump without asking the post-dump step:
            // the process ended here and runs nowhere; its images stay.
            images.keep(true);
            let _ = wr
                .send(&Frame::Abort {
                    reason: "the dump ended without its post-dump step".into(),
                })
                .await;
            wr.close(writer).await;
            return Err(CliError(format!(
                "{} is NOT RUNNING: CRIU ended it without the post-dump step that has {to} \
                 restore it; its images are kept in {} (`criu restore -D DIR \
                 --tcp-established` brings it back)",
                info.label(),
                images.path.display()
            )));
        }
    };
    let _ = wr.send(&Frame::Abort { reason: e.clone() }).await;
    wr.close(writer).await;
    let mut msg = format!(
        "{} was not moved and runs on here with its connections: {e}",
        info.label()
    );
    if let Err(u) = unlocked {
        msg.push_str(&format!(
            "\nAND its address stays locked: {u} (remove the table with `nft list tables`)"
        ));
    }
    Err(CliError(msg))
}

/// The address lock of a move, and the capture of the packets it drops.
struct Locked {
    /// The lock (TCP to and from the address dropped).
    lock: AddressLock,
    /// Copies of the dropped packets, for the destination (`None`:
    /// `--no-reinject`, `--sessions-to`, or it could not start).
    capture: Option<super::packets::Capture>,
    /// Why the capture could not start, if it was wanted.
    capture_failed: Option<String>,
    /// When the lock was begun: the freeze starts here.
    at: Instant,
    /// How long taking the lock and starting the capture took.
    took: Duration,
}

impl Locked {
    /// Locks `addr` and, if `capture`, starts capturing its packets. `Err`:
    /// why it could not be locked.
    fn take(addr: std::net::IpAddr, capture: bool) -> Result<Locked, String> {
        // The freeze counts from here: packets are dropped from some
        // point while the lock is being made.
        let at = Instant::now();
        // The capture first: a packet the lock drops before the capture
        // runs would wait for its sender's retransmission.
        let (capture, capture_failed) = match capture {
            false => (None, None),
            true => match super::packets::Capture::start(addr) {
                Ok(c) => (Some(c), None),
                Err(e) => (None, Some(e.to_string())),
            },
        };
        let lock = AddressLock::new(None, addr).map_err(|e| format!("cannot lock {addr}: {e}"))?;
        if let Some(c) = &capture {
            c.locked();
        }
        Ok(Locked {
            lock,
            capture,
            capture_failed,
            at,
            took: at.elapsed(),
        })
    }
}

/// Takes the lock out of `slot` (shared with the dump's thread, which
/// takes it in CRIU's pre-dump step).
fn take(slot: &std::sync::Mutex<Option<Locked>>) -> Option<Locked> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Puts `l` in `slot`.
fn put(slot: &std::sync::Mutex<Option<Locked>>, l: Locked) {
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(l);
}

/// The private anonymous memory of the processes `pids` (the
/// `Anonymous:` lines of `/proc/PID/smaps_rollup`), about what a lazy
/// dump leaves to follow after the freeze; `None` if none could be read.
fn anonymous_bytes(pids: &[i32]) -> Option<u64> {
    let mut total = None;
    for p in pids {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")) else {
            continue;
        };
        let kb: u64 = text
            .lines()
            .filter_map(|l| l.strip_prefix("Anonymous:"))
            .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        *total.get_or_insert(0) += kb * 1024;
    }
    total
}

/// CRIU's dump, phase by phase, from the timestamps of its log (`(SS.uuuuuu)
/// MESSAGE`, seconds since CRIU started): its start-up before the pre-dump
/// step (the tree still serves: roam locks the address at that step), then
/// from the step to the tree's memory map dumped, its files and sockets,
/// and its memory and the rest until the post-dump step (where the lazy
/// memory was left in place, [`roam_criu::LAZY_UNPIPED_ENV`], it says so).
/// Marks of the first task only (a tree of several interleaves them).
/// `None` without the marks.
fn criu_phases(log: &str) -> Option<String> {
    let at = |mark: &str| -> Option<f64> {
        let line = log.lines().find(|l| l.contains(mark))?;
        let t = line.strip_prefix('(')?.split(')').next()?;
        t.trim().parse::<f64>().ok()
    };
    let pre = at("Running pre-dump scripts")?;
    let files = at("Dumping opened files")?;
    let pages = at("Dumping pages")?;
    let post = at("Running post-dump scripts")?;
    let d = |a: f64, b: f64| ms(Duration::from_secs_f64((b - a).max(0.0)));
    // What the patched CRIU logs once it leaves lazy pages out of its pipes.
    let unpiped = log.contains("Lazy pages stay in the tree's memory");
    Some(format!(
        "CRIU's start-up {} (before the freeze), then freezing and the memory map {}, files and \
         sockets {}, memory and the rest {}{}",
        d(0.0, pre),
        d(pre, files),
        d(files, pages),
        d(pages, post),
        if unpiped {
            " (its lazy pages left in place)"
        } else {
            ""
        }
    ))
}

/// Where the clients of a process whose connections are roam sessions
/// resume once it has moved (`--sessions-to`).
struct Follow {
    /// `HOST:PORT` at the destination.
    to: String,
    /// The port the process listens on (there, and here until the move).
    port: u16,
    /// The process's roam server key.
    key: roam_proto::Keypair,
}

/// Cuts every established TCP connection of `address` on this host (the
/// socket-destroy netlink request, as `ss -K` sends it): a roam session's
/// connection the process holds could not be rebuilt at another address;
/// cut, it fails in the process, whose session waits for a resume. Gives
/// the process a moment to close them before it is frozen.
async fn cut_connections(address: &IfAddr, progress: &mut Progress) {
    let out = std::process::Command::new("ss")
        .args(["-K", "-t", "-n", "state", "established", "src"])
        .arg(address.addr.to_string())
        .output();
    let cut = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .skip(1)
            .filter(|l| !l.trim().is_empty())
            .count(),
        Ok(o) => {
            progress.phase(&format!(
                "warning: could not cut the sessions' connections (ss -K: {}); the restore \
                 will refuse them",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
            0
        }
        Err(e) => {
            progress.phase(&format!(
                "warning: could not cut the sessions' connections (ss: {e}); the restore will \
                 refuse them"
            ));
            0
        }
    };
    progress.phase(&format!(
        "cut {} here; its clients will resume at the destination",
        plural(cut, "session connection", "session connections")
    ));
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// After a move with `--sessions-to`: answers every resume at the process's
/// old address and port with the session protocol's `Moved` refusal naming
/// the destination (`docs/PROTOCOL.md` §9.3), for `secs` seconds or until a
/// signal. A new session is told the service moved and closed.
async fn redirect(follow: Follow, address: &IfAddr, secs: u64) -> Result<(), CliError> {
    /// Every session lives at the destination now.
    struct Elsewhere(String);
    impl roam::Directory for Elsewhere {
        fn locate(&self, _id: roam_proto::SessionId) -> roam::Locating {
            Box::pin(std::future::ready(roam::Location::Elsewhere(
                self.0.clone(),
            )))
        }
    }
    let here = std::net::SocketAddr::new(address.addr, follow.port);
    let listener = tokio::net::TcpListener::bind(here).await.map_err(|e| {
        CliError(format!(
            "moved, but cannot listen on {here} to send its clients on ({e}): they will not \
             find it at {}",
            follow.to
        ))
    })?;
    eprintln!(
        "roam: sending the clients that resume at {here} on to {} for {secs} s (Ctrl-C stops)",
        follow.to
    );
    let config = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair: follow.key,
        authorized_keys: None,
        addresses: Vec::new(),
        session: roam_proto::Config::default(),
    });
    let to = follow.to.clone();
    let signal = crate::serve::shutdown_signal();
    let stop = async move {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(secs)) => {}
            _ = signal => {}
        }
    };
    roam::serve_with_directory(
        listener,
        config,
        stop,
        move |session: roam::SessionHandle| {
            let to = to.clone();
            tokio::spawn(async move {
                let why = format!("this service moved to {to}");
                let _ = tokio::time::timeout(Duration::from_secs(5), session.close(0, &why)).await;
            });
        },
        std::sync::Arc::new(Elsewhere(follow.to)),
    )
    .await
    .map_err(|e| CliError(format!("the redirect at {here} failed: {e}")))
}

/// What the hand-over did.
struct HandedOver {
    /// Packets captured here during the freeze.
    captured: usize,
    /// Of those, re-injected at the destination.
    reinjected: u64,
    /// First lock to the destination's go.
    freeze: Duration,
    /// What went wrong without undoing the move.
    warnings: Vec<String>,
}

/// The process runs at the destination (behind its lock): takes the
/// address off this host (unless `keep_address`: its clients follow it),
/// sends what was captured during the freeze, has
/// the destination take the address live and lifts the lock here.
#[allow(clippy::too_many_arguments)]
async fn hand_over(
    wr: &mut Outbox,
    answers: &mut mpsc::Receiver<Answer>,
    address: &IfAddr,
    keep_address: bool,
    capture: Option<super::packets::Capture>,
    lock: AddressLock,
    to: &str,
    frozen_at: Instant,
    timings: &mut Timings,
) -> HandedOver {
    let mut warnings = Vec::new();
    if !keep_address {
        if let Err(e) = host::del_address(address) {
            warnings.push(format!(
                "could not take {} off this host: {}",
                address.cidr(),
                e.0
            ));
        }
    }
    let committed = Instant::now();
    let captured = capture
        .map(super::packets::Capture::finish)
        .unwrap_or_default();
    let mut packets_sent = Ok(());
    for payload in super::packets::pack(&captured, wire::MAX_PAYLOAD) {
        let frame = super::packets::unpack(&payload).map(Frame::Packets);
        if let Some(frame) = frame {
            packets_sent = wr.send(&frame).await;
            if packets_sent.is_err() {
                break;
            }
        }
    }
    let mut reinjected = 0;
    let live = match packets_sent.and(wr.send(&Frame::Commit).await) {
        Err(e) => Err(e.to_string()),
        Ok(()) => match answer(answers).await {
            Ok(Frame::Live { reinjected: n }) => {
                reinjected = n;
                Ok(())
            }
            Ok(Frame::Failed { reason }) => Err(reason),
            Ok(other) => Err(format!("it answered {other:?} to the commit")),
            Err(e) => Err(e),
        },
    };
    timings.handover = committed.elapsed();
    let freeze = frozen_at.elapsed();
    if let Err(e) = lock.release() {
        warnings.push(format!("could not lift this host's address lock: {e}"));
    }
    if let Err(e) = live {
        warnings.push(format!(
            "{to} did not confirm the address is live there: {e} (the process runs there; \
             check `ip addr` and `nft list tables` on {to})"
        ));
    }
    HandedOver {
        captured: captured.len(),
        reinjected,
        freeze,
        warnings,
    }
}

/// A move that happened, as its summary tells it.
#[derive(Clone, Copy)]
struct Moved<'a> {
    /// The command's arguments.
    args: &'a MigrateProcessArgs,
    /// The process as it was here.
    info: &'a ProcessInfo,
    /// Its address.
    address: &'a IfAddr,
    /// The destination.
    to: &'a str,
    /// Its pid there.
    new_pid: i32,
    /// What the hand-over did.
    done: &'a HandedOver,
    /// The phases.
    timings: &'a Timings,
    /// Bytes of the images sent.
    image_bytes: u64,
    /// Post-copy: the memory that followed after the freeze, and how long
    /// it took.
    post_copy: Option<(u64, Duration)>,
}

/// The end of a move that happened, with or without post-copy: drops the
/// images, closes the writer and the session, prints the summary and, with
/// `--sessions-to`, sends the clients that resume here on to the
/// destination. The exit status.
async fn conclude(
    images: super::WorkDir,
    wr: Outbox,
    writer: tokio::task::JoinHandle<std::io::Result<()>>,
    session: &roam::SessionHandle,
    progress: Progress,
    follow: Option<Follow>,
    moved: &Moved<'_>,
) -> CliResult {
    // Read after the freeze (the log is megabytes at 1,000 sockets).
    let phases = std::fs::read_to_string(images.path.join("dump.log"))
        .ok()
        .and_then(|log| criu_phases(&log));
    drop(images);
    wr.close(writer).await;
    let _ = session.close(0, "moved").await;
    let total = progress.elapsed();
    drop(progress);
    let status = report(moved, total, phases.as_deref())?;
    match follow {
        Some(f) => redirect(f, moved.address, moved.args.redirect_for)
            .await
            .map(|()| status),
        None => Ok(status),
    }
}

/// Prints the summary of a move that happened and its warnings; the exit
/// status.
fn report(moved: &Moved<'_>, total: Duration, criu_phases: Option<&str>) -> CliResult {
    let Moved {
        args,
        info,
        address,
        to,
        new_pid,
        done,
        timings,
        image_bytes,
        post_copy,
    } = *moved;
    println!(
        "moved {} to {to} (pid {new_pid} there) {}: {}",
        info.label(),
        match &args.sessions_to {
            None => format!("with {}", address.cidr()),
            Some(at) => format!(
                "(its roam clients resume at {at}; {} stays here)",
                address.addr
            ),
        },
        info.sockets()
    );
    println!(
        "  {} packets arrived during the freeze: {}",
        done.captured,
        if args.no_reinject {
            "left to retransmission (--no-reinject)".to_string()
        } else {
            format!("{} re-injected at the destination", done.reinjected)
        }
    );
    println!(
        // CRIU ends the process here during the hand-over, outside the
        // freeze; "end at the source" is what was left of it after.
        "  freeze {} (dump {}, transfer {}, end at the source {} after the hand-over, restore {}, waits {}, hand-over {}); {} of images; total {}",
        ms(done.freeze),
        ms(timings.dump),
        ms(timings.transfer),
        ms(timings.end),
        ms(timings.restore),
        ms(timings.wait),
        ms(timings.handover),
        mb(image_bytes),
        ms(total),
    );
    println!(
        "  in the dump: address lock and capture {}; {}",
        ms(timings.lock),
        criu_phases.unwrap_or(match args.criu_log {
            crate::cli::CriuLog::Debug => "CRIU's log has no phase marks",
            _ => "CRIU's phases with --criu-log debug",
        })
    );
    if let Some((bytes, took)) = post_copy {
        println!(
            "  post-copy: {} of memory followed after the freeze, in {}",
            mb(bytes),
            ms(took)
        );
    }
    for w in &done.warnings {
        eprintln!("roam: warning: {w}");
    }
    Ok(if done.warnings.is_empty() { 0 } else { 1 })
}

/// A post-copy move whose destination has the process running (behind its
/// lock) while its memory is served from here.
struct LazyMove {
    /// The process's pid at the destination.
    new_pid: i32,
    /// Where its roam clients follow it (`--sessions-to`).
    follow: Option<Follow>,
    /// The memory's server (CRIU's lazy dump's page server, by now).
    server: super::pages::PageServer,
    /// CRIU's dump, which ends the process here after the post-dump step.
    dump: tokio::task::JoinHandle<Result<roam_criu::Dumped, roam_criu::Error>>,
    /// The address lock here.
    lock: AddressLock,
    /// The packets captured during the freeze.
    capture: Option<super::packets::Capture>,
    /// When the address was locked.
    frozen_at: Instant,
    /// Phases so far.
    timings: Timings,
    /// Room for the pipes of CRIU's page server, while it serves.
    room: Option<roam_criu::PipeRoom>,
    /// About how much memory follows (read before the freeze).
    lazy_bytes: Option<u64>,
}

/// The first connection of `now` (each as its two ends) that `held` has
/// neither way round.
fn unheld(
    now: &[(std::net::SocketAddr, std::net::SocketAddr)],
    held: &[(std::net::SocketAddr, std::net::SocketAddr)],
) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
    now.iter()
        .find(|&&(a, b)| !held.contains(&(a, b)) && !held.contains(&(b, a)))
        .copied()
}

/// Asks the destination to restore the process now (`ask`: [`Frame::Restore`],
/// or [`Frame::RestoreLazy`]: its memory to follow, post-copy), while it is
/// frozen here, holding back the packets of its `loopback` connections
/// until it is restored ([`Frame::Loopback`]); its pid there and the
/// restore's time in µs, or why not.
async fn ask_restore(
    wr: &mut Outbox,
    answers: &mut mpsc::Receiver<Answer>,
    to: &str,
    loopback: &[(std::net::SocketAddr, std::net::SocketAddr)],
    ask: Frame,
) -> Result<(i32, u64), String> {
    if !loopback.is_empty() {
        wr.send(&Frame::Loopback(loopback.to_vec()))
            .await
            .map_err(|e| format!("the stream to {to} failed: {e}"))?;
    }
    wr.send(&ask)
        .await
        .map_err(|e| format!("the stream to {to} failed: {e}"))?;
    match answer(answers).await? {
        Frame::Restored { pid, restore_us } => Ok((pid, restore_us)),
        Frame::Failed { reason } => Err(format!("{to} could not restore it: {reason}")),
        other => Err(format!("{to} answered {other:?} instead of restoring")),
    }
}

/// The rest of a post-copy move: the process runs at the destination and
/// CRIU ended it here; the address is handed over while its memory flows
/// from the images here; the move is complete once the last page is there.
#[allow(clippy::too_many_arguments)]
async fn finish_lazily(
    mut m: LazyMove,
    mut wr: Outbox,
    answers: &mut mpsc::Receiver<Answer>,
    args: &MigrateProcessArgs,
    info: &ProcessInfo,
    address: &IfAddr,
    to: &str,
    mut progress: Progress,
    writer: tokio::task::JoinHandle<std::io::Result<()>>,
    session: &roam::SessionHandle,
    images: super::WorkDir,
) -> CliResult {
    progress.phase(&format!(
        "restored at {to} as pid {} (its memory follows); handing over {}",
        m.new_pid, address.addr
    ));
    m.server.flow(false);
    let done = hand_over(
        &mut wr,
        answers,
        address,
        m.follow.is_some(),
        m.capture.take(),
        m.lock,
        to,
        m.frozen_at,
        &mut m.timings,
    )
    .await;
    m.server.flow(true);
    progress.phase(&format!(
        "{} runs at {to}; sending the rest of its memory{}",
        info.label(),
        m.lazy_bytes
            .map(|n| format!(" (about {} to follow)", mb(n)))
            .unwrap_or_default()
    ));
    // CRIU's lazy dump serves the memory from the frozen process here
    // until the destination has all of it, then ends the process: the
    // dump completes only then.
    let followed = m.server.finish().await;
    let ended = Instant::now();
    let dumped = match m.dump.await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("the dump thread failed: {e}")),
    };
    drop(m.room);
    m.timings.end = ended.elapsed();
    let followed = match (followed, &dumped) {
        (Ok(f), Ok(_)) => f,
        (followed, _) => {
            let why = match (followed, &dumped) {
                (Err(why), _) => why,
                (Ok(_), Err(e)) => format!("CRIU's page server failed: {e}"),
                (Ok(_), Ok(_)) => unreachable!("handled above"),
            };
            // Without every page the copy at the destination is killed
            // there; CRIU ends the frozen one here after a clean hang-up
            // and resumes it after a broken one.
            let here = match (&dumped, wait_gone(&info.pids)) {
                (Err(_), false) => format!(
                    "CRIU resumed the frozen copy here (pid {}), but without its address \
                     and with its connections out of step with their peers",
                    info.pid
                ),
                _ => "CRIU ended the copy here".to_string(),
            };
            return Err(CliError(format!(
                "{} was LOST: it had started at {to} (pid {}), but its memory stopped \
                 following it ({why}); {to} kills a copy that misses pages, and {here}",
                info.label(),
                m.new_pid,
            )));
        }
    };
    let image_bytes = dumped.map(|d| d.image_bytes).unwrap_or(0);
    let moved = Moved {
        args,
        info,
        address,
        to,
        new_pid: m.new_pid,
        done: &done,
        timings: &m.timings,
        image_bytes,
        post_copy: Some(followed),
    };
    conclude(images, wr, writer, session, progress, m.follow, &moved).await
}

/// Catches SIGINT, SIGTERM and SIGHUP from now on: each sets the latch
/// returned.
fn catch_signals() -> Result<std::sync::Arc<Latch>, CliError> {
    use tokio::signal::unix::{signal, SignalKind};
    let latch = std::sync::Arc::new(Latch::default());
    for kind in [
        SignalKind::interrupt(),
        SignalKind::terminate(),
        SignalKind::hangup(),
    ] {
        let mut sig = signal(kind).map_err(|e| CliError(format!("cannot catch signals: {e}")))?;
        let latch = latch.clone();
        tokio::spawn(async move {
            while sig.recv().await.is_some() {
                latch.set();
            }
        });
    }
    Ok(latch)
}

/// Waits (up to 5 s) until every process of the dumped tree has ended here
/// (dead: gone, or a zombie its parent has yet to reap — orphans are
/// reaped by init, here up to a second or two later) after CRIU ended it:
/// a copy left running here would run twice. Returns whether they ended.
fn wait_gone(pids: &[i32]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    let ended = |p: &i32| {
        // `PID (COMM) STATE ...`: the state follows the last parenthesis.
        std::fs::read_to_string(format!("/proc/{p}/stat")).map_or(true, |st| {
            st.rfind(") ")
                .and_then(|i| st[i + 2..].chars().next())
                .is_some_and(|state| matches!(state, 'Z' | 'X'))
        })
    };
    loop {
        if pids.iter().all(ended) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The sending half of the migration stream, behind a writer task that
/// writes each frame whole, and flushes whenever no other frame waits.
pub(crate) struct Outbox {
    /// Encoded frames for the writer task.
    tx: mpsc::Sender<Vec<u8>>,
    /// Set once the session to the destination is lost: a frame queued
    /// then would wait forever behind the blocked writer.
    lost: std::sync::Arc<Latch>,
}

/// A flag that is set once and wakes whoever waits for it (a signal came;
/// the session to the destination is lost).
#[derive(Default)]
struct Latch {
    /// Set.
    flag: std::sync::atomic::AtomicBool,
    /// Wakes the waiters.
    notify: tokio::sync::Notify,
}

impl Latch {
    /// Sets the flag and wakes every waiter.
    fn set(&self) {
        self.flag.store(true, std::sync::atomic::Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether it is set.
    fn is_set(&self) -> bool {
        self.flag.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Completes once set (at once if it is).
    async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

impl Outbox {
    /// Starts the writer task on `wr`.
    fn spawn(
        mut wr: tokio::io::WriteHalf<roam::RoamStream>,
    ) -> (Outbox, tokio::task::JoinHandle<std::io::Result<()>>) {
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(16);
        let writer = tokio::spawn(async move {
            while let Some(mut batch) = rx.recv().await {
                // Small frames (one image per socket) go out together.
                while batch.len() < (1 << 20) {
                    match rx.try_recv() {
                        Ok(more) => batch.extend_from_slice(&more),
                        Err(_) => break,
                    }
                }
                wr.write_all(&batch).await?;
                if rx.is_empty() {
                    wr.flush().await?;
                }
            }
            wr.flush().await
        });
        (
            Outbox {
                tx,
                lost: std::sync::Arc::default(),
            },
            writer,
        )
    }

    /// Queues one frame (waits while 16 are queued).
    pub(crate) async fn send(&mut self, frame: &Frame) -> std::io::Result<()> {
        let broken = || {
            std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the stream to the destination broke",
            )
        };
        tokio::select! {
            r = self.tx.send(wire::encode(frame)) => r.map_err(|_| broken()),
            _ = self.lost.wait() => Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                format!(
                    "the destination became unreachable (its session was lost and did not \
                     come back within {} s)",
                    SUSPEND_GRACE.as_secs()
                ),
            )),
        }
    }

    /// Sends what is queued (at most 5 s, nothing once the session is
    /// lost) and stops the writer.
    async fn close(self, writer: tokio::task::JoinHandle<std::io::Result<()>>) {
        drop(self.tx);
        // Nothing more goes through a lost session.
        if !self.lost.is_set() {
            let _ = tokio::time::timeout(Duration::from_secs(5), writer).await;
        }
    }
}

/// `1 process`, `3 processes`.
fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// How long each phase of the freeze took.
#[derive(Debug, Default)]
struct Timings {
    /// Lock and CRIU's dump, until the images were complete.
    dump: Duration,
    /// Of `dump`: taking the address lock and starting the capture.
    lock: Duration,
    /// Sending the images.
    transfer: Duration,
    /// The destination's restore (as it measured it).
    restore: Duration,
    /// CRIU ending the process here (its sockets closed in repair mode)
    /// until every process of the tree was reaped: during the hand-over,
    /// outside the freeze; what was left of it after.
    end: Duration,
    /// The round trip of the restore request, less the restore.
    wait: Duration,
    /// Commit until the destination said the address is live.
    handover: Duration,
}

/// The address that moves with the process: `--address`, else the one
/// address its sockets are bound to; it must be on one of this host's
/// interfaces (its prefix and interface come from there).
fn own_address(given: Option<&str>, info: &ProcessInfo) -> Result<IfAddr, CliError> {
    let here = host::addresses()?;
    let ip = match given {
        Some(text) => host::parse_cidr(text).map_err(CliError)?.0,
        None => match info.addresses.len() {
            1 => *info
                .addresses
                .iter()
                .next()
                .unwrap_or(&std::net::IpAddr::from([0, 0, 0, 0])),
            0 => {
                return Err(CliError(format!(
                    "{}'s sockets are bound to no particular address (only wildcards or \
                     loopback): say which address moves with it with --address ADDR",
                    info.label()
                )))
            }
            _ => {
                let list: Vec<String> = info.addresses.iter().map(|a| a.to_string()).collect();
                return Err(CliError(format!(
                    "{}'s sockets use several addresses ({}): say which one moves with it \
                     with --address ADDR",
                    info.label(),
                    list.join(", ")
                )));
            }
        },
    };
    here.into_iter().find(|a| a.addr == ip).ok_or_else(|| {
        CliError(format!(
            "{ip} is not on any interface of this host (see `ip addr`): the address that \
             moves must be the process's own, here"
        ))
    })
}

/// One answer of the destination, or why none will come.
type Answer = Result<Frame, String>;

/// How long the session to the destination may stay suspended during a
/// move before the move gives up on the destination.
const SUSPEND_GRACE: Duration = super::LOST_GRACE;

/// Reports (as an error among the destination's answers) a session to the
/// destination that stays suspended for [`SUSPEND_GRACE`] or ends.
fn watch_session(
    session: &roam::SessionHandle,
    tx: mpsc::Sender<Result<Frame, String>>,
    lost_flag: std::sync::Arc<Latch>,
) {
    let mut lost = super::watch_lost(session, "destination");
    tokio::spawn(async move {
        let why = loop {
            if let Some(why) = lost.borrow_and_update().clone() {
                break why;
            }
            if lost.changed().await.is_err() {
                return;
            }
        };
        lost_flag.set();
        let _ = tx.send(Err(why)).await;
    });
}

/// Reads the destination's frames on a task of its own, so that an early
/// refusal is seen while images are still being sent. Returns a sender
/// too, for other reasons to stop waiting for an answer.
fn spawn_reader(
    mut rd: tokio::io::ReadHalf<roam::RoamStream>,
) -> (mpsc::Sender<Answer>, mpsc::Receiver<Answer>) {
    let (tx, rx) = mpsc::channel(4);
    let theirs = tx.clone();
    tokio::spawn(async move {
        loop {
            let r = wire::read_frame(&mut rd).await.map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    "the destination closed the stream".to_string()
                } else {
                    format!("the stream to the destination failed: {e}")
                }
            });
            let end = r.is_err();
            if tx.send(r).await.is_err() || end {
                return;
            }
        }
    });
    (theirs, rx)
}

/// The destination's next frame, within [`ANSWER_TIMEOUT`].
async fn answer(answers: &mut mpsc::Receiver<Result<Frame, String>>) -> Result<Frame, String> {
    match tokio::time::timeout(ANSWER_TIMEOUT, answers.recv()).await {
        Ok(Some(r)) => r,
        Ok(None) => Err("the stream to the destination ended".into()),
        Err(_) => Err(format!(
            "no answer from the destination within {} s",
            ANSWER_TIMEOUT.as_secs()
        )),
    }
}

/// Sends the images CRIU's dump left to send (`early`: what ended the
/// sending during the dump instead, if anything) and waits for the
/// destination to have them all.
async fn send_images(
    wr: &mut Outbox,
    answers: &mut mpsc::Receiver<Result<Frame, String>>,
    outgoing: &mut Outgoing,
    early: Option<Result<Frame, String>>,
    progress: &mut Progress,
    timings: &Timings,
    to: &str,
) -> Result<(), String> {
    let reply = match early {
        Some(r) => r,
        None => {
            let dumped = ms(timings.dump);
            let send = outgoing.send_rest(wr, progress, &dumped);
            // The destination may refuse half-way (a full disk): its
            // answer ends the sending.
            let early = tokio::select! {
                r = send => { r?; None }
                f = answers.recv() => Some(f.unwrap_or_else(|| Err("the stream to the destination ended".into()))),
            };
            match early {
                Some(r) => r,
                None => answer(answers).await,
            }
        }
    };
    match reply? {
        Frame::Stored => Ok(()),
        Frame::Failed { reason } => Err(format!("{to} could not take the images: {reason}")),
        other => Err(format!("{to} answered {other:?} to the images")),
    }
}

#[cfg(test)]
mod tests {
    use super::unheld;

    #[test]
    fn a_loopback_connection_is_held_either_way_round() {
        let a = "127.0.0.1:42218".parse().unwrap();
        let b = "127.0.0.1:7100".parse().unwrap();
        let c = "127.0.0.1:42219".parse().unwrap();
        assert_eq!(unheld(&[(a, b), (b, a)], &[(a, b)]), None);
        assert_eq!(unheld(&[(b, a)], &[(a, b)]), None);
        assert_eq!(unheld(&[(a, b), (c, b)], &[(a, b)]), Some((c, b)));
        assert_eq!(unheld(&[], &[]), None);
    }
}
