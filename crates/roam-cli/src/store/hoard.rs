//! `roam hoard`: Internet Suspend/Resume's *fully proactive hoarding* — the
//! resume site fetches an environment's newest version before the user
//! arrives, so that the resume itself moves little.
//!
//! Layout of a hoard directory, and why:
//! - `DIR/images/<image>`: the hoarded version's images, plaintext, whole.
//!   That is what `roam resume --lookaside DIR` already indexes (files cut
//!   at the store's chunk boundaries, each piece found by its SHA-256, read
//!   again and checked when used), so a resume needs no second mechanism,
//!   and a stale or altered hoard costs fetches, never wrong bytes. Sealed
//!   chunk objects would be no safer here: hoarding needs the user's
//!   secret at this site to open the manifest (to know what to fetch), and
//!   whoever reads the secret reads the chunks.
//! - `DIR/HOARD`: which environment and version the images are, written
//!   last (atomically) by each hoard. It marks DIR as a cache: `roam
//!   resume` refuses to write into a hoard, and a hoard refuses a
//!   directory holding other files, so neither is taken for the other.
//! - `DIR/.incoming.<pid>/`: the next version's images while they are
//!   written, taking every chunk the current images hold (lookaside) and
//!   fetching the rest; renamed into `images/` only once all are complete.
//!   A failure or a signal removes it and leaves the previous hoard whole.
//! - `DIR/.lock`: the pid of the roam process hoarding into DIR (one at a
//!   time; a lock whose process is gone is taken over).
//!
//! A hoard of the version DIR already holds reads and hashes every local
//! chunk again and fetches only those that no longer match (a repair).
//! `--follow` polls the store's version list (one listing per interval) and
//! hoards each newer version; it stops on SIGINT or SIGTERM.

use std::io::Write as _;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::{Duration, Instant};

use roam_store::{Lookaside, RestoreStats};

use super::{
    closing, file_name_ok, finish, image_list, mb, ms, open, print_out, restore_one, Fail, Opened,
    Reporter,
};
use crate::cli::{CliError, CliResult, HoardArgs};
use crate::config::FileConfig;

/// The file that marks a directory as a hoard and names what it holds.
pub(crate) const MARKER: &str = "HOARD";

/// The marker's first line.
const MARKER_HEAD: &str =
    "roam hoard: a cache for `roam resume --lookaside DIR`, not an environment to run";

/// The directory of the hoarded images, in DIR.
pub(crate) const IMAGES: &str = "images";

/// The lock file, in DIR.
const LOCK: &str = ".lock";

/// Prefix of the directory a hoard writes the next version into.
const INCOMING: &str = ".incoming.";

/// `--interval` unless given.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);

/// The shortest `--interval`: a store is asked at most ten times a second.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// What a hoard directory's marker says it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hoarded {
    /// The environment.
    pub(crate) env: String,
    /// Its version in `images/`.
    pub(crate) version: u64,
}

/// What `dir/HOARD` says: `None` if there is no marker, `Some(Err)` if the
/// file is there but is not a hoard's marker.
pub(crate) fn read_marker(dir: &Path) -> Option<Result<Hoarded, String>> {
    let path = dir.join(MARKER);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(Err(format!("cannot read {}: {e}", path.display()))),
    };
    let mut lines = text.lines();
    if lines.next() != Some(MARKER_HEAD) {
        return Some(Err(format!(
            "{} is not a roam hoard's marker",
            path.display()
        )));
    }
    let (mut env, mut version) = (None, None);
    for line in lines {
        match line.split_once(": ") {
            Some(("env", v)) => env = Some(v.to_owned()),
            Some(("version", v)) => version = v.parse().ok(),
            _ => {}
        }
    }
    Some(match (env, version) {
        (Some(env), Some(version)) => Ok(Hoarded { env, version }),
        _ => Err(format!(
            "{} lacks its environment or version",
            path.display()
        )),
    })
}

/// Holds `DIR/.lock` (removed on drop).
struct Lock(PathBuf);

impl Lock {
    /// Takes DIR's lock, or says which process holds it. A lock naming a
    /// process that no longer runs is taken over.
    fn take(dir: &Path) -> Result<Lock, CliError> {
        let path = dir.join(LOCK);
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    let _ = writeln!(f, "{}", std::process::id());
                    return Ok(Lock(path));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let pid = std::fs::read_to_string(&path)
                        .ok()
                        .and_then(|t| t.trim().parse::<u32>().ok());
                    match pid {
                        Some(pid) if Path::new(&format!("/proc/{pid}")).exists() => {
                            return Err(CliError(format!(
                                "{} is being hoarded into by process {pid} (one hoard at a time; \
                                 {} is its lock)",
                                dir.display(),
                                path.display()
                            )))
                        }
                        // Its process is gone (or it is being written):
                        // a stale lock is removed and taken once.
                        _ => {
                            let _ = std::fs::remove_file(&path);
                        }
                    }
                }
                Err(e) => return Err(not_writable(dir, &e)),
            }
        }
        Err(CliError(format!(
            "cannot take the lock {} (another hoard keeps taking it)",
            path.display()
        )))
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Removes a directory tree on drop (the next version's images while they
/// are written: gone on failure, cancellation, and once moved in place).
struct RemoveDirOnDrop(PathBuf);

impl Drop for RemoveDirOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The error for a hoard directory roam cannot write to.
fn not_writable(dir: &Path, e: &std::io::Error) -> CliError {
    CliError(format!(
        "the hoard directory {} is not writable: {e} (choose a directory you can write, or fix \
         its permissions)",
        dir.display()
    ))
}

/// Makes `dir` a hoard of `env` (or checks that it is one) and locks it.
/// Refuses a directory holding other files, another environment's hoard,
/// and a path that cannot be a directory.
fn prepare(dir: &Path, env: &str) -> Result<(Lock, Option<Hoarded>), CliError> {
    let shown = dir.display();
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => {
            return Err(CliError(format!(
                "{shown} is not a directory: a hoard is a directory (name a new one)"
            )))
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| CliError(format!("cannot create the hoard directory {shown}: {e}")))?;
        }
        Err(e) => return Err(CliError(format!("cannot use {shown} as a hoard: {e}"))),
    }
    let held = match read_marker(dir) {
        Some(Err(e)) => return Err(CliError(format!("{e}: not hoarding into {shown}"))),
        Some(Ok(h)) if h.env != env => {
            return Err(CliError(format!(
                "{shown} is a hoard of environment {}, not {env}: hoard {env} into another \
                 directory",
                h.env
            )))
        }
        Some(Ok(h)) => Some(h),
        None => {
            let other = std::fs::read_dir(dir)
                .map_err(|e| CliError(format!("cannot read {shown}: {e}")))?
                .filter_map(Result::ok)
                .map(|e| e.file_name())
                .find(|n| {
                    let n = n.to_string_lossy();
                    n != LOCK && n != IMAGES && !n.starts_with(INCOMING)
                });
            if let Some(name) = other {
                return Err(CliError(format!(
                    "{shown} holds other files ({}) and is no hoard (no {MARKER}): hoard into a \
                     new or empty directory",
                    name.to_string_lossy()
                )));
            }
            None
        }
    };
    let lock = Lock::take(dir)?;
    Ok((lock, held))
}

/// `roam hoard`.
pub(crate) async fn run(args: HoardArgs, config: &FileConfig) -> CliResult {
    finish(run_inner(args, config).await)
}

/// `roam hoard`, with usage errors apart.
async fn run_inner(args: HoardArgs, config: &FileConfig) -> Result<i32, Fail> {
    let interval = match args.interval.as_deref() {
        None => DEFAULT_INTERVAL,
        Some(t) => crate::config::parse_duration(t)
            .ok()
            .filter(|d| *d >= MIN_INTERVAL)
            .ok_or_else(|| {
                Fail::Usage(format!(
                    "invalid --interval {t:?}: a duration of at least 100ms, such as 30s or 5m"
                ))
            })?,
    };
    let opened = open(&args.location, config, false)?;
    closing(&opened, hoard_opened(&args, &opened, interval)).await
}

/// `roam hoard` once the store is open.
async fn hoard_opened(args: &HoardArgs, opened: &Opened, interval: Duration) -> Result<i32, Fail> {
    let env = args.env.as_str();
    let dir = args.dir.as_path();
    // The store first: an unknown environment or a wrong secret leaves no
    // directory behind.
    let newest = opened.version(env, args.version).await?;
    let manifest = opened
        .store
        .load_manifest(env, newest)
        .await
        .map_err(|e| opened.explain(e))?;
    let (_lock, _) = prepare(dir, env)?;
    let mut stop: Pin<Box<dyn std::future::Future<Output = i32> + Send>> =
        Box::pin(crate::signals::exit_signal());
    let mut rep = Reporter::new();
    tokio::select! {
        r = hoard_version(opened, &manifest, dir, &mut rep) => r?,
        sig = &mut stop => {
            return Err(Fail::Run(CliError(format!(
                "interrupted by signal {sig} while hoarding {env} version {newest}: its partial \
                 images were removed{}",
                held_note(dir)
            ))));
        }
    };
    if !args.follow {
        return Ok(0);
    }
    let mut held = newest;
    rep.phase(&format!(
        "following {env}: asking {} for a newer version every {} (SIGINT or SIGTERM stops)",
        opened.desc,
        ms(interval)
    ));
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            sig = &mut stop => return Ok(stopped(&mut rep, sig, env, held)),
        }
        let round = async {
            let versions = opened.versions(env).await?;
            let newest = *versions.last().unwrap_or(&1);
            if newest == held {
                return Ok(None);
            }
            rep.phase(&format!("{env} version {newest} is in the store"));
            let manifest = opened
                .store
                .load_manifest(env, newest)
                .await
                .map_err(|e| opened.explain(e))?;
            hoard_version(opened, &manifest, dir, &mut rep).await?;
            Ok::<_, Fail>(Some(newest))
        };
        tokio::select! {
            r = round => match r {
                Ok(Some(v)) => held = v,
                Ok(None) => {}
                Err(Fail::Run(CliError(e)) | Fail::Usage(e)) => {
                    eprintln_whole!(
                        "roam: warning: {e} (the hoard keeps version {held}; trying again in {})",
                        ms(interval)
                    );
                }
            },
            sig = &mut stop => return Ok(stopped(&mut rep, sig, env, held)),
        }
    }
}

/// The line a `--follow` stopped by signal `sig` ends with; exit status 0.
fn stopped(rep: &mut Reporter, sig: i32, env: &str, held: u64) -> i32 {
    rep.phase(&format!(
        "stopped by signal {sig}: the hoard holds {env} version {held}"
    ));
    0
}

/// `; the hoard holds E version V as before`, from DIR's marker.
fn held_note(dir: &Path) -> String {
    match read_marker(dir) {
        Some(Ok(h)) => format!(
            "; the hoard holds {} version {} as before",
            h.env, h.version
        ),
        _ => String::new(),
    }
}

/// Hoards the version `manifest` lists into `dir` (prepared and locked): the
/// images are written into `.incoming.<pid>/` from the chunks `images/`
/// holds and the store, then moved into `images/`, images of no longer
/// present names removed, and the marker rewritten. Prints the summary line.
async fn hoard_version(
    opened: &Opened,
    manifest: &roam_store::Manifest,
    dir: &Path,
    rep: &mut Reporter,
) -> Result<(), Fail> {
    let (env, version) = (manifest.env.as_str(), manifest.version);
    if let Some(bad) = manifest.images.iter().find(|i| !file_name_ok(&i.name)) {
        return Err(Fail::Run(CliError(format!(
            "{env} version {version} has an image named {:?}, which cannot be a file name",
            bad.name
        ))));
    }
    let start = Instant::now();
    // Leftovers of a hoard that was killed (the lock is ours: no other
    // hoard writes here).
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.filter_map(Result::ok) {
            if e.file_name().to_string_lossy().starts_with(INCOMING) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let incoming = dir.join(format!("{INCOMING}{}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&incoming)
        .map_err(|e| not_writable(dir, &e))?;
    let _incoming_guard = RemoveDirOnDrop(incoming.clone());
    let images_dir = dir.join(IMAGES);
    rep.phase(&format!(
        "hoarding {env} version {version} from {} into {}",
        opened.desc,
        dir.display()
    ));
    // The chunks the hoard holds (any older version) are found by hash.
    let lookaside = {
        let (paths, m) = (vec![images_dir.clone()], manifest.clone());
        let la = tokio::task::spawn_blocking(move || Lookaside::scan(&paths, &m))
            .await
            .map_err(|e| CliError(format!("reading the hoard's images failed: {e}")))?;
        let scan = la.scan_report();
        rep.phase(&format!(
            "{} of the version's chunks already here ({} read in {} files)",
            scan.chunks_found,
            mb(scan.bytes_scanned),
            scan.files
        ));
        la
    };
    let mut totals = RestoreStats::default();
    for image in &manifest.images {
        let tmp = incoming.join(format!(".{}.part", image.name));
        let target = incoming.join(&image.name);
        let chunks = image.chunks.len() as u64;
        rep.phase(&format!(
            "{}: {} in {chunks} chunks",
            image.name,
            mb(image.len)
        ));
        let stats = restore_one(
            opened,
            manifest,
            &image.name,
            (&tmp, &target),
            Some(&lookaside),
            |done| rep.image(&image.name, done.chunks, chunks, done.bytes, image.len),
        )
        .await
        .inspect_err(|_| rep.end_bar())?;
        rep.phase(&format!(
            "{}: done, {} chunks fetched, {} already here",
            image.name, stats.chunks_fetched, stats.chunks_lookaside
        ));
        totals.add(&stats);
    }
    // Every image is complete: they replace the previous version's.
    match std::fs::DirBuilder::new().mode(0o700).create(&images_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(not_writable(dir, &e).into()),
    }
    for image in &manifest.images {
        let (from, to) = (incoming.join(&image.name), images_dir.join(&image.name));
        std::fs::rename(&from, &to).map_err(|e| {
            CliError(format!(
                "cannot move {} to {}: {e}",
                from.display(),
                to.display()
            ))
        })?;
    }
    if let Ok(entries) = std::fs::read_dir(&images_dir) {
        for e in entries.filter_map(Result::ok) {
            let name = e.file_name();
            if manifest.image(&name.to_string_lossy()).is_none() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let marker = format!(
        "{MARKER_HEAD}\nenv: {env}\nversion: {version}\nstore: {}\nimages: {}\nhoarded: {} \
         (seconds since 1970)\n",
        opened.desc,
        image_list(manifest),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    crate::paths::write_atomic(&dir.join(MARKER), marker.as_bytes(), 0o600, true)
        .map_err(|e| not_writable(dir, &e))?;
    let elapsed = start.elapsed();
    let here = totals.chunks_lookaside;
    print_out(&format!(
        "hoarded {env} version {version} from {} into {}: {} chunks, {} fetched ({}; {} bytes, \
         {} bytes of objects), {here} already here ({}; {} bytes), every chunk verified, in {}\n",
        opened.desc,
        dir.display(),
        totals.chunks,
        totals.chunks_fetched,
        mb(totals.bytes_fetched),
        totals.bytes_fetched,
        totals.object_bytes_fetched,
        mb(totals.bytes_lookaside),
        totals.bytes_lookaside,
        ms(elapsed)
    ));
    Ok(())
}
