//! What a `roam resume` killed by a signal it cannot catch (SIGKILL, the
//! OOM killer, a power cut of the process) leaves in DIR, and the sweep of
//! it at the next resume into DIR (issue 14).
//!
//! A resume names everything it makes in DIR after its pid:
//! - `.roam-ram.PID`: the mount point of the guest RAM's FUSE file system
//!   (lazy memory with `--demand-fetch`). Killed, roam leaves it mounted
//!   in its mount namespace: the kernel aborts the connection when the
//!   last `/dev/fuse` descriptor closes (roam's, opened close-on-exec), so
//!   every access fails with `ENOTCONN`, but the mount stays until
//!   unmounted;
//! - `.roam-nbd-<image>.PID.sock`: the NBD sockets QEMU's disks are served
//!   on;
//! - `.roam-resume-qmp.PID`: QEMU's QMP socket (QEMU binds it);
//! - `.<image>.roam-resume.PID`: a copy-in temporary, renamed to `<image>`
//!   once complete;
//! - `.<image>.roam-demand.PID`: a demand-fetched image's cache file. Its
//!   map of present chunks lived in roam's memory only, so the file cannot
//!   be taken up again.
//!
//! [`sweep`] removes those whose process is gone: no `/proc/PID`, a zombie,
//! or a live process that is not roam (pids are reused): neither its
//! `comm` is `roam` nor its executable is this one. A live roam's files
//! are left alone: it may be a concurrent resume into the same DIR. A
//! mount point is detached (`umount2(MNT_DETACH)`, after aborting its FUSE
//! connection if `/sys/fs/fuse/connections` shows one) and removed.
//!
//! Non-goals: a resume in another pid namespace sharing DIR (its pids mean
//! nothing here; resumes into one DIR are expected to share one);
//! leftovers of `roam suspend` or `roam hoard` (they are not in DIR).

use std::io;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

/// What a leftover is, by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `.roam-ram.PID`: the guest RAM's FUSE mount point.
    RamMount,
    /// `.roam-nbd-<image>.PID.sock`.
    NbdSocket,
    /// `.roam-resume-qmp.PID`.
    QmpSocket,
    /// `.<image>.roam-resume.PID`.
    CopyIn,
    /// `.<image>.roam-demand.PID`.
    DemandCache,
}

impl Kind {
    /// What it is, for the report line.
    fn what(self) -> &'static str {
        match self {
            Kind::RamMount => "guest-RAM FUSE mount point",
            Kind::NbdSocket => "NBD socket",
            Kind::QmpSocket => "QMP socket",
            Kind::CopyIn => "unfinished copy-in",
            Kind::DemandCache => "demand-fetch cache file",
        }
    }

    /// Whether an entry of this type can be this kind of leftover (any
    /// other type is not roam's and is left alone).
    fn fits(self, t: std::fs::FileType) -> bool {
        match self {
            Kind::RamMount => t.is_dir(),
            Kind::NbdSocket | Kind::QmpSocket => t.is_socket(),
            Kind::CopyIn | Kind::DemandCache => t.is_file(),
        }
    }
}

/// A pid as roam writes it: decimal digits, not 0.
fn pid(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|&p| p != 0)
}

/// The kind and pid of a resume's leftover named `name`, if it is one.
fn parse(name: &str) -> Option<(Kind, u32)> {
    if let Some(p) = name.strip_prefix(".roam-ram.") {
        return pid(p).map(|p| (Kind::RamMount, p));
    }
    if let Some(p) = name.strip_prefix(".roam-resume-qmp.") {
        return pid(p).map(|p| (Kind::QmpSocket, p));
    }
    if let Some(rest) = name
        .strip_prefix(".roam-nbd-")
        .and_then(|r| r.strip_suffix(".sock"))
    {
        let (image, p) = rest.rsplit_once('.')?;
        return pid(p)
            .filter(|_| !image.is_empty())
            .map(|p| (Kind::NbdSocket, p));
    }
    let rest = name.strip_prefix('.')?;
    let (stem, p) = rest.rsplit_once('.')?;
    let p = pid(p)?;
    for (suffix, kind) in [
        (".roam-resume", Kind::CopyIn),
        (".roam-demand", Kind::DemandCache),
    ] {
        if stem
            .strip_suffix(suffix)
            .is_some_and(|image| !image.is_empty())
        {
            return Some((kind, p));
        }
    }
    None
}

/// Why `pid` is no live roam process (`None`: it is one, not a zombie,
/// and either named `roam` or running this executable: a test binary, a
/// renamed roam).
fn gone(pid: u32) -> Option<String> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let Ok(stat) = std::fs::read_to_string(proc.join("stat")) else {
        return Some("no longer running".into());
    };
    // The state follows the command, which may hold `)`: the last one.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    if matches!(state, Some("Z" | "X" | "x")) {
        return Some("a zombie".into());
    }
    let comm = std::fs::read_to_string(proc.join("comm")).unwrap_or_default();
    let comm = comm.trim_end();
    if comm == "roam" {
        return None;
    }
    // A replaced binary reads `PATH (deleted)`.
    let exe = |p: &Path| {
        std::fs::read_link(p).ok().map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_suffix(" (deleted)")
                .map_or(l.clone(), str::to_owned)
        })
    };
    match (exe(&proc.join("exe")), exe(Path::new("/proc/self/exe"))) {
        (Some(theirs), Some(mine)) if theirs == mine => None,
        _ => Some(format!("its pid now runs {comm:?}, not roam")),
    }
}

/// A mount of `/proc/self/mountinfo`.
#[derive(Debug)]
pub(crate) struct Mount {
    /// The kernel's device number of the mounted file system (the name of
    /// a FUSE connection in /sys/fs/fuse/connections).
    dev: u64,
    /// The file system type (`fuse` for a memory mount).
    fstype: String,
    /// The mount's source (the FUSE library names ours `roam-memory`).
    source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mounts at `path` (absolute, no symlinks), oldest first, from
/// `mountinfo`'s text.
pub(crate) fn mounts_at(mountinfo: &str, path: &Path) -> Vec<Mount> {
    let want = path.to_string_lossy();
    let mut found = Vec::new();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let (Some(dev), Some(point)) = (fields.get(2), fields.get(4)) else {
            continue;
        };
        if unescape(point) != want {
            continue;
        }
        // Optional fields end with a lone `-`; type and source follow.
        let Some(sep) = fields.iter().skip(6).position(|f| *f == "-") else {
            continue;
        };
        let (Some(fstype), Some(source)) = (fields.get(7 + sep), fields.get(8 + sep)) else {
            continue;
        };
        let dev = dev
            .split_once(':')
            .and_then(|(maj, min)| Some((maj.parse::<u64>().ok()?, min.parse::<u64>().ok()?)));
        let Some((major, minor)) = dev else {
            continue;
        };
        found.push(Mount {
            // The kernel's dev_t: major in the bits above 20.
            dev: (major << 20) | minor,
            fstype: unescape(fstype),
            source: unescape(source),
        });
    }
    found
}

/// Detaches whatever FUSE mounts are at `path` and removes the directory;
/// returns what was done. A mount of another type is not roam's: left.
fn remove_mount_point(path: &Path) -> Result<String, String> {
    let mut detached = 0;
    let mut notes = String::new();
    // Mounts may be stacked; each round detaches the top one.
    for _ in 0..8 {
        let info = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let Some(top) = mounts_at(&info, path).pop() else {
            break;
        };
        if !top.fstype.starts_with("fuse") {
            return Err(format!(
                "a {} file system ({}) is mounted there, not roam's FUSE: left as it is",
                top.fstype, top.source
            ));
        }
        // A server that died leaves its connection aborted (its /dev/fuse
        // descriptor closed); one still held somewhere (a descriptor
        // inherited by a process that lives on) would hang its readers:
        // abort it, where the FUSE control file system shows it.
        let abort = PathBuf::from(format!("/sys/fs/fuse/connections/{}/abort", top.dev));
        match std::fs::write(&abort, "1") {
            Ok(()) => notes += &format!(", its FUSE connection aborted ({})", abort.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => notes += &format!(" (writing {} failed: {e})", abort.display()),
        }
        nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH).map_err(|e| {
            format!(
                "umount2({}, MNT_DETACH) failed: {e} (as root: umount -l {0}; rmdir {0})",
                path.display()
            )
        })?;
        detached += 1;
    }
    std::fs::remove_dir(path).map_err(|e| format!("rmdir failed: {e}"))?;
    Ok(match detached {
        0 => format!("removed (not mounted here){notes}"),
        1 => format!("unmounted (lazily) and removed{notes}"),
        n => format!("{n} mounts detached (lazily), removed{notes}"),
    })
}

/// Removes the leftovers in `dir` of resumes whose process is gone
/// (module docs); `report` gets one line per leftover (what was removed,
/// and which pid left it) and one per error. Never fails: a leftover that
/// stays is reported and does not stop the resume (its names are not
/// this process's).
pub(crate) fn sweep(dir: &Path, report: &mut dyn FnMut(&str)) {
    if !Path::new("/proc/self/stat").exists() {
        report(&format!(
            "warning: /proc is not mounted, so it is not known which resume processes live: \
             leftovers of killed resumes in {} are not swept",
            dir.display()
        ));
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            report(&format!(
                "warning: cannot list {} for leftovers of killed resumes: {e}",
                dir.display()
            ));
            return;
        }
    };
    // Mount points are compared with mountinfo's absolute paths.
    let base = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let me = std::process::id();
    let mut gone_of = std::collections::HashMap::new();
    let mut found = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                report(&format!(
                    "warning: cannot list {} for leftovers of killed resumes: {e}",
                    dir.display()
                ));
                return;
            }
        };
        let name = entry.file_name();
        let Some((kind, pid)) = name.to_str().and_then(parse) else {
            continue;
        };
        // The type from the directory entry: a stat of a dead FUSE mount
        // point fails (ENOTCONN).
        if pid == me || !entry.file_type().is_ok_and(|t| kind.fits(t)) {
            continue;
        }
        if let Some(why) = gone_of.entry(pid).or_insert_with(|| gone(pid)) {
            found.push((base.join(&name), kind, pid, why.clone()));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    for (path, kind, pid, why) in found {
        let done = match kind {
            Kind::RamMount => remove_mount_point(&path),
            _ => std::fs::remove_file(&path)
                .map(|()| "removed".to_owned())
                .map_err(|e| format!("cannot remove it: {e}")),
        };
        match done {
            Ok(how) => report(&format!(
                "swept a leftover of resume process {pid} ({why}): {} {} {how}",
                kind.what(),
                path.display()
            )),
            Err(e) => report(&format!(
                "warning: a leftover of resume process {pid} ({why}) stays: {} {}: {e}",
                kind.what(),
                path.display()
            )),
        }
    }
}

#[cfg(test)]
mod tests;
