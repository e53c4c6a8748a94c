//! Named client sessions that outlive their client process (`roam pipe
//! --name`): the record a detached session leaves in the state directory,
//! the lock that keeps two processes off one name, and the listing `roam
//! status` shows.
//!
//! A record is `<state>/sessions/<name>.detached`, mode 0600 in a 0700
//! directory (it holds the session's resume secret). Layout, all lengths
//! little-endian:
//!
//! ```text
//! "RMDT" | version u8 (1) | header len u32 | header (JSON)
//!        | continuation len u64 | continuation
//!        | upload len u64 | upload | download len u64 | download
//! ```
//!
//! The header names the relay, the target, the stream, when the session was
//! detached and the stream lists of `roam::Detached`. `upload` holds bytes
//! taken from the old client's stdin that the session had not accepted yet;
//! `download` holds bytes the session delivered that never reached the old
//! client's stdout. The next client sends and prints them first, so nothing
//! the old process took is lost.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::FileConfig;

/// Magic of a detached-session record.
const MAGIC: [u8; 4] = *b"RMDT";
/// The record layout this version writes and reads.
const VERSION: u8 = 1;
/// Largest header accepted.
const MAX_HEADER: usize = 64 * 1024;
/// Largest section accepted (a continuation holds at most the session's
/// buffers, which are far smaller).
const MAX_SECTION: u64 = 1 << 30;
/// Longest session name.
const MAX_NAME: usize = 64;

/// What a record says besides its byte sections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Header {
    /// The session's name.
    pub(crate) name: String,
    /// The relay (`host:port`) the session resumes at.
    pub(crate) relay: String,
    /// The target the stream goes to, as given to `roam pipe`.
    pub(crate) target: String,
    /// The stream's id in the session.
    pub(crate) stream: u64,
    /// Unix time (seconds) of the detach.
    pub(crate) detached_at: u64,
    /// Process id of the client that detached.
    pub(crate) pid: u32,
    /// Whether the old client's stdin had ended (the stream's upload is
    /// finished; the next client reads no stdin).
    pub(crate) stdin_done: bool,
    /// Whether the stream's upload was finished (end-of-stream sent).
    #[serde(default)]
    pub(crate) finished: bool,
    /// Whether the download had ended (the next client prints `download`
    /// and nothing more arrives).
    pub(crate) stdout_done: bool,
    /// `roam::Detached::unaccepted`.
    pub(crate) unaccepted: Vec<u64>,
    /// `roam::Detached::orphans`.
    pub(crate) orphans: Vec<u64>,
}

/// A detached session as it sits in its record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) header: Header,
    /// The client continuation (`roam::Detached::blob`).
    pub(crate) continuation: Vec<u8>,
    /// Bytes from the old stdin the session had not taken.
    pub(crate) upload: Vec<u8>,
    /// Bytes for stdout the old client had not written.
    pub(crate) download: Vec<u8>,
}

impl Record {
    /// The record's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.header).expect("a header always serializes");
        let mut out = Vec::with_capacity(
            32 + header.len() + self.continuation.len() + self.upload.len() + self.download.len(),
        );
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        for section in [&self.continuation, &self.upload, &self.download] {
            out.extend_from_slice(&(section.len() as u64).to_le_bytes());
            out.extend_from_slice(section);
        }
        out
    }

    /// Reads a record; the error names what is wrong with it.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = bytes;
        let magic = take(&mut r, 4, "magic")?;
        if magic != MAGIC {
            return Err("not a roam detached-session record".into());
        }
        let version = take(&mut r, 1, "version")?[0];
        if version != VERSION {
            return Err(format!(
                "record format {version}, but this roam reads format {VERSION}"
            ));
        }
        let len = u32::from_le_bytes(take(&mut r, 4, "header length")?.try_into().unwrap());
        if len as usize > MAX_HEADER {
            return Err(format!(
                "header of {len} bytes is over the {MAX_HEADER} limit"
            ));
        }
        let header: Header = serde_json::from_slice(take(&mut r, len as usize, "header")?)
            .map_err(|e| format!("header: {e}"))?;
        check_name(&header.name).map_err(|e| format!("header: {e}"))?;
        let mut sections = Vec::with_capacity(3);
        for what in ["continuation", "upload", "download"] {
            let n = u64::from_le_bytes(take(&mut r, 8, what)?.try_into().unwrap());
            if n > MAX_SECTION {
                return Err(format!("{what} of {n} bytes is over the limit"));
            }
            sections.push(take(&mut r, n as usize, what)?.to_vec());
        }
        if !r.is_empty() {
            return Err(format!("{} bytes after the record", r.len()));
        }
        let download = sections.pop().unwrap_or_default();
        let upload = sections.pop().unwrap_or_default();
        let continuation = sections.pop().unwrap_or_default();
        Ok(Self {
            header,
            continuation,
            upload,
            download,
        })
    }
}

/// Takes `n` bytes off the front of `r`.
fn take<'a>(r: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], String> {
    if r.len() < n {
        return Err(format!("truncated in the {what}"));
    }
    let (a, b) = r.split_at(n);
    *r = b;
    Ok(a)
}

/// Checks a session name: 1-64 of `A-Z a-z 0-9 . _ -`, not starting with a dot.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!(
            "session name {name:?} must be 1 to {MAX_NAME} characters"
        ));
    }
    if name.starts_with('.')
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(format!(
            "session name {name:?} may hold only letters, digits, '.', '_' and '-', and must not start with '.'"
        ));
    }
    Ok(())
}

/// The directory of named sessions.
pub(crate) fn dir(config: &FileConfig) -> PathBuf {
    crate::paths::state_dir(config).join("sessions")
}

/// Where the record of `name` lives.
pub(crate) fn record_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.detached"))
}

/// Writes `record` atomically, readable by its owner only.
pub(crate) fn save(dir: &Path, record: &Record) -> std::io::Result<PathBuf> {
    crate::paths::ensure_private_dir(dir)?;
    let path = record_path(dir, &record.header.name);
    crate::paths::write_atomic(&path, &record.encode(), 0o600, true)?;
    Ok(path)
}

/// Reads the record of `name`, if there is one.
pub(crate) fn load(dir: &Path, name: &str) -> Result<Option<Record>, String> {
    let path = record_path(dir, name);
    match std::fs::read(&path) {
        Ok(bytes) => Record::decode(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Removes the record of `name` (gone already is fine).
pub(crate) fn remove(dir: &Path, name: &str) {
    let path = record_path(dir, name);
    if let Err(e) = std::fs::remove_file(&path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", path.display());
        }
    }
}

/// Holds the name for this process: while it lives, no other process can
/// attach to the session. Released when dropped (or when the process dies,
/// however it dies).
pub(crate) struct NameLock {
    lock: nix::fcntl::Flock<std::fs::File>,
}

impl NameLock {
    /// Takes the lock of `name`, or says which process holds it.
    pub(crate) fn take(dir: &Path, name: &str) -> Result<Self, String> {
        use std::os::unix::fs::OpenOptionsExt;
        crate::paths::ensure_private_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("{name}.lock"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let lock = match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        {
            Ok(l) => l,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                return Err(format!(
                    "session {name:?} is attached to another roam process{}; detach it first (`roam detach {name}`)",
                    if holder.is_empty() {
                        String::new()
                    } else {
                        format!(" (pid {holder})")
                    }
                ));
            }
            Err((_, e)) => return Err(format!("locking {}: {e}", path.display())),
        };
        let before = std::fs::read_to_string(&path).unwrap_or_default();
        let mut me = Self { lock };
        me.mark(&std::process::id().to_string());
        // A pid left behind means its process died without detaching or
        // ending the session (kill -9, a crash, a power cut): say so, rather
        // than silently starting a new session.
        let died = before.trim().parse::<u32>().ok();
        if let (Some(pid), false) = (died, record_path(dir, name).exists()) {
            crate::notices::notice(&format!(
                "the previous client of session {name:?} (pid {pid}) ended without detaching it (killed?): that session cannot be re-attached; starting a new one"
            ));
        }
        Ok(me)
    }

    /// Records in the lock file who holds the name (a pid) or how the last
    /// holder let go (`detached`, `ended`).
    pub(crate) fn mark(&mut self, what: &str) {
        let _ = self.lock.set_len(0);
        let _ = std::io::Seek::rewind(&mut *self.lock);
        let _ = writeln!(&mut *self.lock, "{what}");
    }
}

/// The process attached to `name`, if one is (from its lock).
pub(crate) fn attached_pid(dir: &Path, name: &str) -> Option<u32> {
    let path = dir.join(format!("{name}.lock"));
    let file = std::fs::File::open(&path).ok()?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockSharedNonblock) {
        Ok(_) => None, // nobody holds it
        Err(_) => std::fs::read_to_string(&path).ok()?.trim().parse().ok(),
    }
}

/// One detached session as `roam status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DetachedStatus {
    pub(crate) name: String,
    pub(crate) relay: String,
    pub(crate) target: String,
    /// Unix time (seconds) of the detach.
    pub(crate) detached_at: u64,
    pub(crate) detached_for_secs: u64,
    /// Bytes waiting in the record for the next client (upload + download).
    pub(crate) pending_bytes: u64,
    /// Why the record cannot be used, if it cannot.
    pub(crate) error: Option<String>,
}

/// Every detached session in `dir`, by name.
pub(crate) fn list(dir: &Path) -> Vec<DetachedStatus> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let now = unix_now();
    let mut out: Vec<DetachedStatus> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "detached"))
        .map(|p| {
            let name = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            match std::fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| Record::decode(&b))
            {
                Ok(r) => DetachedStatus {
                    name,
                    relay: r.header.relay,
                    target: r.header.target,
                    detached_at: r.header.detached_at,
                    detached_for_secs: now.saturating_sub(r.header.detached_at),
                    pending_bytes: (r.upload.len() + r.download.len()) as u64,
                    error: None,
                },
                Err(e) => DetachedStatus {
                    name,
                    relay: String::new(),
                    target: String::new(),
                    detached_at: 0,
                    detached_for_secs: 0,
                    pending_bytes: 0,
                    error: Some(e),
                },
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            header: Header {
                name: "backup-1".into(),
                relay: "relay.example:7447".into(),
                target: "127.0.0.1:9000".into(),
                stream: 4,
                detached_at: 1_700_000_000,
                pid: 42,
                stdin_done: false,
                finished: false,
                stdout_done: true,
                unaccepted: vec![8],
                orphans: vec![],
            },
            continuation: vec![1, 2, 3],
            upload: b"up".to_vec(),
            download: b"down".to_vec(),
        }
    }

    #[test]
    fn a_record_round_trips_and_every_damage_is_named() {
        let r = sample();
        let bytes = r.encode();
        assert_eq!(Record::decode(&bytes).unwrap(), r);
        for cut in 0..bytes.len() {
            let e = Record::decode(&bytes[..cut]).unwrap_err();
            assert!(e.contains("truncated"), "cut at {cut}: {e}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Record::decode(&longer)
            .unwrap_err()
            .contains("after the record"));
        let mut newer = bytes.clone();
        newer[4] = 9;
        assert!(Record::decode(&newer).unwrap_err().contains("format 9"));
        assert!(Record::decode(b"RMSC....")
            .unwrap_err()
            .contains("not a roam"));
    }

    #[test]
    fn names_are_plain_file_names() {
        for ok in ["a", "work-shell", "db_1.2", &"x".repeat(64)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".hidden", "../x", "a/b", "sp ace", &"x".repeat(65), "é"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_second_process_cannot_take_a_held_name() {
        let dir = tempfile::tempdir().unwrap();
        let held = NameLock::take(dir.path(), "n").unwrap();
        assert_eq!(attached_pid(dir.path(), "n"), Some(std::process::id()));
        // flock locks belong to the open file: a second open conflicts even
        // within one process, as another process's would.
        let e = NameLock::take(dir.path(), "n").err().unwrap();
        assert!(e.contains("attached to another roam process"), "{e}");
        drop(held);
        assert_eq!(attached_pid(dir.path(), "n"), None);
        assert!(NameLock::take(dir.path(), "n").is_ok());
    }
}
