//! `roam migrate-process` and `roam migrate-accept`: a running process,
//! with its TCP connections, listening and UDP sockets, moves to another
//! host and takes its address along (issue 12; `docs/ARCHITECTURE.md`,
//! "Process migration").
//!
//! CRIU does the checkpoint and the restore ([`roam_criu`]); roam moves the
//! images over an encrypted, authenticated roam session (no shared
//! filesystem), moves the address, and keeps the step that can fail — the
//! destination — inside CRIU's post-dump step, so that a failure anywhere
//! before the destination has the process rolls the dump back and the
//! process runs on at the source, its connections untouched.
//!
//! The sequence (source A, destination B, both holding a roam address lock
//! that drops every TCP packet of the address while it moves):
//! 1. A asks B whether it can host the address ([`wire::Frame::Hello`]);
//!    nothing is frozen until B says it can.
//! 2. A locks the address and has CRIU dump the process with its
//!    connections. While the process is frozen (sockets in repair mode) and
//!    the images complete, A streams them to B and asks for a restore.
//! 3. B locks the address, puts it on its interface and restores. If that
//!    fails it undoes both and says why; A refuses CRIU's post-dump step and
//!    the dump rolls back.
//! 4. Once B has the process, A lets CRIU finish (the old process dies
//!    without a packet), takes the address off and tells B to commit; B
//!    lifts its lock and announces the address (gratuitous ARP). The peers'
//!    TCP retransmissions reach the restored process.

pub(crate) mod dest;
pub(crate) mod host;
pub(crate) mod outgoing;
pub(crate) mod packets;
pub(crate) mod pages;
pub(crate) mod source;
pub(crate) mod wire;

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// The port `roam migrate-accept` listens on unless told otherwise.
pub(crate) const DEFAULT_PORT: u16 = 7448;

/// Phases and byte counts on stderr: one line per phase, and on a terminal
/// a progress bar while images travel.
pub(crate) struct Progress {
    /// When the command started.
    start: Instant,
    /// Whether stderr is a terminal (bar and carriage returns).
    tty: bool,
    /// Whether a bar is on the current line.
    bar: bool,
    /// When the bar was last drawn (at most every 100 ms).
    drawn: Option<Instant>,
}

impl Progress {
    /// A progress reporter starting now.
    pub(crate) fn new() -> Progress {
        Progress {
            start: Instant::now(),
            tty: std::io::stderr().is_terminal(),
            bar: false,
            drawn: None,
        }
    }

    /// Time since the command started.
    pub(crate) fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Starts a phase: `roam: [  0.12 s] MESSAGE`.
    pub(crate) fn phase(&mut self, msg: &str) {
        self.end_bar();
        eprintln!(
            "roam: [{:>7.2} s] {msg}",
            self.start.elapsed().as_secs_f64()
        );
    }

    /// A function that prints a phase's line as [`Progress::phase`] does,
    /// for another thread (a step CRIU runs while this side waits; no bar
    /// is drawn then).
    pub(crate) fn line_maker(&self) -> impl Fn(&str) + Send + 'static {
        let start = self.start;
        move |msg| eprintln!("roam: [{:>7.2} s] {msg}", start.elapsed().as_secs_f64())
    }

    /// Shows `done` of `total` bytes sent (a bar on a terminal).
    pub(crate) fn bytes(&mut self, done: u64, total: u64) {
        if !self.tty {
            return;
        }
        let now = Instant::now();
        if done < total
            && self
                .drawn
                .is_some_and(|t| now - t < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(now);
        let frac = if total == 0 {
            1.0
        } else {
            done as f64 / total as f64
        };
        let width = 30;
        let filled = ((frac * f64::from(width)) as usize).min(width as usize);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r      images {} / {} [{}{}] {:>3.0}%",
            mb(done),
            mb(total),
            "#".repeat(filled),
            " ".repeat(width as usize - filled),
            frac * 100.0
        );
        let _ = err.flush();
        self.bar = true;
    }

    /// Ends the bar's line, if one is drawn.
    fn end_bar(&mut self) {
        if self.bar {
            eprintln!();
            self.bar = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.end_bar();
    }
}

/// Restores the process in `images` here with its established TCP
/// connections, behind roam's address lock (not CRIU's), on a blocking
/// thread; `lazy`: its memory comes from a lazy-pages daemon already
/// running on `images` (post-copy).
pub(crate) async fn restore(
    criu: roam_criu::Criu,
    images: std::path::PathBuf,
    lazy: bool,
) -> Result<roam_criu::Restored, String> {
    tokio::task::spawn_blocking(move || {
        criu.restore(
            &images,
            &roam_criu::RestoreOptions {
                tcp_established: true,
                network_lock: roam_criu::NetworkLock::Skip,
                lazy_pages: lazy,
                ..roam_criu::RestoreOptions::default()
            },
        )
        .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| format!("the restore thread failed: {e}"))?
}

/// The nice value both ends of a move run at (and with them every program
/// they start: CRIU, its lazy-pages daemon, `nft`, `ip`). The freeze is a
/// chain of short steps in several processes on each host; on a host busy
/// with other work each step waits for a CPU, and the waits add up: at
/// 1,000 connections and a load of 6-8 on 2 cores the freeze's median was
/// about twice the idle one. CRIU gives a restored process back its own
/// nice value (the one it was dumped with), so nothing it restores keeps
/// this one.
pub(crate) const MOVE_NICE: i32 = -10;

/// How long a move's session may stay suspended before either end gives
/// the move up (a blip shorter than this goes unnoticed).
pub(crate) const LOST_GRACE: Duration = Duration::from_secs(2);

/// Watches a move's session to or from `peer` ("source", "destination"):
/// the returned flag says why the peer is lost once the session stays
/// suspended for [`LOST_GRACE`] or ends. The watching task ends with the
/// receiver.
pub(crate) fn watch_lost(
    session: &roam::SessionHandle,
    peer: &'static str,
) -> tokio::sync::watch::Receiver<Option<String>> {
    use roam::SessionEvent;
    use tokio::sync::broadcast::error::RecvError;
    let (tx, rx) = tokio::sync::watch::channel(None);
    let mut events = session.events();
    tokio::spawn(async move {
        let why = loop {
            let event = tokio::select! {
                _ = tx.closed() => return,
                e = events.recv() => e,
            };
            match event {
                Ok(SessionEvent::Suspended { reason }) => {
                    // Back within the grace: a blip, go on.
                    let back = tokio::time::timeout(LOST_GRACE, async {
                        loop {
                            match events.recv().await {
                                Ok(SessionEvent::Resumed { .. }) => return true,
                                Ok(SessionEvent::Closed { .. }) | Err(RecvError::Closed) => {
                                    return false
                                }
                                _ => {}
                            }
                        }
                    })
                    .await;
                    if back != Ok(true) {
                        break format!(
                            "the {peer} became unreachable (no answer for {} s after the \
                             session was lost: {reason:?})",
                            LOST_GRACE.as_secs()
                        );
                    }
                }
                Ok(SessionEvent::Closed { reason }) => {
                    break format!("the session with the {peer} ended: {reason:?}")
                }
                Err(RecvError::Closed) => return,
                _ => {}
            }
        };
        let _ = tx.send(Some(why));
    });
    rx
}

/// Sets every thread of this process to [`MOVE_NICE`] (threads made later
/// inherit it from the thread that makes them, programs from the thread
/// that starts them), with `renice`: Linux keeps a nice value per thread.
/// Called before anything is frozen; `Err` says why not (the move goes on
/// at the usual priority).
pub(crate) fn raise_priority() -> Result<(), String> {
    let tids: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map_err(|e| format!("cannot list this process's threads: {e}"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let out = std::process::Command::new("renice")
        .arg("-n")
        .arg(MOVE_NICE.to_string())
        .arg("-p")
        .args(&tids)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run renice: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "renice -n {MOVE_NICE} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Shared memory: a tmpfs on most Linux hosts.
pub(crate) const SHM: &str = "/dev/shm";

/// Where a move's images go at either end without `--images-dir`: a
/// post-copy move's (a few MB: no memory) on the tmpfs at [`SHM`] when
/// there is one, else the temporary directory (`None`). CRIU writes and
/// reads them while the process is frozen: a file per TCP connection and
/// a log of megabytes at 1,000 connections. On a disk that is busy
/// (builds, the other end's writes on one machine) creating them took
/// 0.1-0.3 s of the freeze at the destination, and the source's dump took
/// 0.28-0.54 s at 1 GB and 1,000 connections instead of 0.12-0.21 s.
pub(crate) fn images_parent(post_copy: bool) -> Option<std::path::PathBuf> {
    let shm = std::path::Path::new(SHM);
    (post_copy && shm.is_dir()).then(|| shm.to_path_buf())
}

/// How every move's directory is named: `roam-migrate-` at the source,
/// `roam-accept-` at the destination, then a pid and a time stamp.
const WORK_PREFIXES: [&str; 2] = ["roam-migrate-", "roam-accept-"];

/// The file that marks a move's directory as kept on purpose (CRIU's log
/// of a failure, or the only images of a process that runs nowhere):
/// [`sweep`] leaves such a directory alone.
const KEPT_MARK: &str = "roam-kept";

/// A directory younger than this is not swept: it may be between its
/// creation and its owner's lock (microseconds, but a sweep must never
/// remove a live move's images).
const SWEEP_MIN_AGE: Duration = Duration::from_secs(60);

/// A move's private directory for its images and CRIU's logs, at either
/// end: mode 0700, locked (`flock`) for as long as this value lives, and
/// removed when it is dropped unless kept. The lock is what tells a live
/// move's directory from one left by a roam killed outright (SIGKILL, the
/// OOM killer), which had no chance to remove it: the kernel releases the
/// lock with the killed process's descriptors, and the next [`sweep`] of
/// the same parent removes the directory, which can hold the process's
/// whole memory (a source killed while its images travel left 317 MB in
/// `/tmp` at 300 MB of memory).
pub(crate) struct WorkDir {
    /// The directory.
    pub(crate) path: std::path::PathBuf,
    /// Keep it when dropped ([`WorkDir::keep`]).
    keep: std::sync::atomic::AtomicBool,
    /// The exclusive lock on the directory, held until it is removed.
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl WorkDir {
    /// Makes `<parent>/<prefix><id>-<nanoseconds>` (mode 0700) and locks it.
    pub(crate) fn create(
        parent: &std::path::Path,
        prefix: &str,
        id: u32,
    ) -> std::io::Result<WorkDir> {
        use std::os::unix::fs::DirBuilderExt;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = parent.join(format!("{prefix}{id}-{stamp}"));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        let locked = std::fs::File::open(&path).and_then(|dir| {
            nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock)
                .map_err(|(_, e)| std::io::Error::from(e))
        });
        match locked {
            Ok(lock) => Ok(WorkDir {
                path,
                keep: std::sync::atomic::AtomicBool::new(false),
                _lock: lock,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir(&path);
                Err(e)
            }
        }
    }

    /// Keeps the directory after this value is gone, marked so that no
    /// sweep removes it: with its images (`images`: they are the only copy
    /// of a process), or with CRIU's logs only.
    pub(crate) fn keep(&self, images: bool) {
        self.keep.store(true, std::sync::atomic::Ordering::Relaxed);
        if !images {
            remove_images(&self.path);
        }
        let _ = std::fs::write(
            self.path.join(KEPT_MARK),
            "kept by roam on purpose: remove this directory when done with it\n",
        );
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Removes the move directories under `parent` that no roam holds any
/// more (see [`WorkDir`]): this user's, a minute old or more, not kept on
/// purpose, and unlocked. Returns how many went and the bytes they held.
/// Errors (a parent that cannot be read, a directory that went meanwhile)
/// only make it remove less.
pub(crate) fn sweep(parent: &std::path::Path) -> (usize, u64) {
    use std::os::unix::fs::MetadataExt;
    let me = nix::unistd::geteuid().as_raw();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return (0, 0);
    };
    let mut swept = (0, 0);
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !WORK_PREFIXES.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let path = e.path();
        // Not followed: a symbolic link is not a move's directory.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_some_and(|age| age >= SWEEP_MIN_AGE);
        if !meta.is_dir() || meta.uid() != me || !old || path.join(KEPT_MARK).exists() {
            continue;
        }
        let Ok(dir) = std::fs::File::open(&path) else {
            continue;
        };
        // Held: a live move's. Taken: its roam is gone.
        let Ok(_held) = nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock)
        else {
            continue;
        };
        let bytes: u64 = std::fs::read_dir(&path)
            .map(|files| {
                files
                    .flatten()
                    .filter_map(|f| f.metadata().ok())
                    .filter(std::fs::Metadata::is_file)
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        if std::fs::remove_dir_all(&path).is_ok() {
            swept.0 += 1;
            swept.1 += bytes;
        }
    }
    swept
}

/// Says what [`sweep`] removed, if anything (`who`: the command's name).
pub(crate) fn report_sweep(who: &str, parent: &std::path::Path, (n, bytes): (usize, u64)) {
    if n > 0 {
        eprintln!(
            "{who}: removed {n} images {} in {} that a roam killed outright left behind ({})",
            if n == 1 { "directory" } else { "directories" },
            parent.display(),
            mb(bytes)
        );
    }
}

/// Removes everything but CRIU's logs (`*.log`) from an images directory:
/// what is kept of a failed dump or restore (the images can be as large as
/// the process's memory).
pub(crate) fn remove_images(dir: &std::path::Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if !roam_criu::is_log(&e.file_name().to_string_lossy()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// `12.3 MB` (decimal megabytes, as transfer tools print them).
pub(crate) fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// `412 ms`, or `1.32 s` from a second on.
pub(crate) fn ms(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

/// Runs `cmd` (a shell line) for a test, failing the test with its stderr;
/// returns its stdout, trimmed.
#[cfg(test)]
pub(crate) fn sh(cmd: &str) -> String {
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .expect("sh");
    assert!(
        o.status.success(),
        "`{cmd}`: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::{sweep, WorkDir, KEPT_MARK};
    use std::time::{Duration, SystemTime};

    /// Backdates a directory past the sweep's minimum age.
    fn age(path: &std::path::Path) {
        let then = SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::open(path)
            .expect("open dir")
            .set_modified(then)
            .expect("set mtime");
    }

    /// A sweep removes the directory of a move whose roam is gone (its
    /// lock released), with its images, and leaves a live move's, one kept
    /// on purpose, a young one and anything not a move's.
    #[test]
    fn a_sweep_removes_only_what_a_killed_roam_left() {
        let parent = tempfile::tempdir().expect("parent");
        let live = WorkDir::create(parent.path(), "roam-migrate-", 7).expect("live");
        std::fs::write(live.path.join("pages-1.img"), vec![0u8; 4096]).expect("write");
        age(&live.path);
        // What a roam killed outright leaves: its directory, unlocked.
        let dead = parent.path().join("roam-accept-9-1");
        std::fs::create_dir(&dead).expect("dead");
        std::fs::write(dead.join("pages-1.img"), vec![0u8; 10_000]).expect("write");
        std::fs::write(dead.join("restore.log"), b"log").expect("write");
        age(&dead);
        let kept = WorkDir::create(parent.path(), "roam-migrate-", 8).expect("kept");
        kept.keep(false);
        age(&kept.path);
        let kept_path = kept.path.clone();
        drop(kept);
        let young = parent.path().join("roam-migrate-10-1");
        std::fs::create_dir(&young).expect("young");
        let other = parent.path().join("roam-other-1");
        std::fs::create_dir(&other).expect("other");
        age(&other);

        assert_eq!(sweep(parent.path()), (1, 10_003));
        assert!(!dead.exists(), "the dead move's directory is gone");
        assert!(
            live.path.join("pages-1.img").exists(),
            "a live move's images stay"
        );
        assert!(kept_path.join(KEPT_MARK).exists(), "a kept directory stays");
        assert!(young.exists() && other.exists());
        assert_eq!(sweep(parent.path()), (0, 0), "nothing more to sweep");

        // Its roam gone (the value dropped), a live move's directory is
        // removed with it; one whose roam died is swept.
        let live_path = live.path.clone();
        drop(live);
        assert!(!live_path.exists());
        let gone = WorkDir::create(parent.path(), "roam-migrate-", 11).expect("gone");
        let gone_path = gone.path.clone();
        std::mem::forget(gone);
        age(&gone_path);
        // Forgotten, its lock is still held by this process's descriptor:
        // still a live move's as far as a sweep can tell.
        assert_eq!(sweep(parent.path()), (0, 0));
    }
}
