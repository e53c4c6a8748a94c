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
    /// Written by the journal of a client that was still attached (it was
    /// killed or crashed before it could detach), not by a detach.
    #[serde(default)]
    pub(crate) journal: bool,
    /// Bytes of input the session's clients had taken from their stdin so
    /// far, `upload` included; the next client's stdin follows them.
    /// `None` in records of an older roam.
    #[serde(default)]
    pub(crate) input_taken: Option<u64>,
    /// Bytes of the target's output the session's clients had printed, not
    /// counting `download`; the next client's stdout follows them.
    #[serde(default)]
    pub(crate) output_printed: Option<u64>,
    /// For `roam forward --name`: the local address it listens on (a
    /// forward's record has no stream of its own).
    #[serde(default)]
    pub(crate) listen: Option<String>,
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

impl Header {
    /// A record's `continuation` with this header's stream lists, as
    /// `roam::resume` takes it.
    pub(crate) fn detached(&self, continuation: Vec<u8>) -> roam::Detached {
        let ids = |v: &[u64]| v.iter().map(|&i| roam_proto::StreamId(i)).collect();
        roam::Detached::new(continuation, ids(&self.unaccepted), ids(&self.orphans))
    }

    /// The header of a journal copy of session `name` (relay, target, and
    /// for a forward its local address) written by this process; the
    /// journal fills in the rest.
    pub(crate) fn new(name: &str, relay: &str, target: &str, listen: Option<String>) -> Self {
        Self {
            name: name.to_string(),
            relay: relay.to_string(),
            target: target.to_string(),
            stream: 0,
            detached_at: 0,
            pid: std::process::id(),
            stdin_done: false,
            finished: false,
            stdout_done: false,
            unaccepted: Vec::new(),
            orphans: Vec::new(),
            journal: true,
            input_taken: None,
            output_printed: None,
            listen,
        }
    }
}

impl Record {
    /// The record's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        encode_parts(
            &self.header,
            &self.continuation,
            &self.upload,
            &self.download,
            &mut out,
        );
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

/// A record's bytes from its parts, into `out` (cleared first; a journal
/// reuses one buffer for every copy).
pub(crate) fn encode_parts(
    header: &Header,
    continuation: &[u8],
    upload: &[u8],
    download: &[u8],
    out: &mut Vec<u8>,
) {
    let header = serde_json::to_vec(header).expect("a header always serializes");
    out.clear();
    out.reserve(32 + header.len() + continuation.len() + upload.len() + download.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    for section in [continuation, upload, download] {
        out.extend_from_slice(&(section.len() as u64).to_le_bytes());
        out.extend_from_slice(section);
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

/// Magic of a journal slot file.
const SLOT_MAGIC: [u8; 4] = *b"RMJ1";
/// Bytes before a slot's record: magic, sequence number, record length.
const SLOT_HEADER: u64 = 20;

/// The two slot files of `name`'s journal.
fn slot_paths(dir: &Path, name: &str) -> [PathBuf; 2] {
    [0, 1].map(|i| dir.join(format!("{name}.journal-{i}")))
}

/// A named session's records, while a client holds it: two slot files
/// written in turn, each `"RMJ1" | seq u64 | len u64 | record` (little-
/// endian). A copy is written in three steps — the slot's seq is zeroed,
/// the record written, then seq and length set in one 16-byte write — so a
/// process killed mid-copy leaves that slot unusable and the other one,
/// the previous copy, whole. The previous copy is still good then: a
/// journal copy is written before the bytes it covers leave (see
/// `roam::JournalEntry`). The newest usable slot is the record. No file is
/// created, renamed or removed per copy.
pub(crate) struct JournalFile {
    files: [std::fs::File; 2],
    /// The slot the next copy goes to (the older one).
    next: usize,
    /// The next copy's sequence number.
    seq: u64,
}

impl JournalFile {
    /// Opens (creating, mode 0600) `name`'s slots, continuing their numbering.
    pub(crate) fn open(dir: &Path, name: &str) -> std::io::Result<Self> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        crate::paths::ensure_private_dir(dir)?;
        let open = |p: &PathBuf| -> std::io::Result<std::fs::File> {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(p)?;
            if f.metadata()?.len() < SLOT_HEADER {
                let mut head = [0u8; SLOT_HEADER as usize];
                head[..4].copy_from_slice(&SLOT_MAGIC);
                f.write_all_at(&head, 0)?;
            }
            Ok(f)
        };
        let [a, b] = slot_paths(dir, name);
        let files = [open(&a)?, open(&b)?];
        let seqs = [slot_seq(&files[0]), slot_seq(&files[1])];
        Ok(Self {
            next: usize::from(seqs[1] < seqs[0]),
            seq: seqs[0].max(seqs[1]) + 1,
            files,
        })
    }

    /// Writes `record` (encoded) as the newest copy; `sync` also flushes it
    /// to disk (a detach: the record must survive a power cut too).
    pub(crate) fn write(&mut self, record: &[u8], sync: bool) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let f = &self.files[self.next];
        f.write_all_at(&[0u8; 16], 4)?;
        f.write_all_at(record, SLOT_HEADER)?;
        if sync {
            f.sync_data()?;
        }
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&self.seq.to_le_bytes());
        head[8..].copy_from_slice(&(record.len() as u64).to_le_bytes());
        f.write_all_at(&head, 4)?;
        if sync {
            f.sync_data()?;
        }
        self.seq += 1;
        self.next ^= 1;
        Ok(())
    }
}

/// A session's journal writer (`roam::SessionHandle::set_journal`) that
/// stores each copy in `file`: `encode` turns the copy into the record's
/// bytes (in a buffer reused for every copy). Copies are not synced: a
/// killed process's writes survive in the page cache, and a power cut is
/// what a detach (which syncs) is for. If a copy cannot be written, the
/// journal's files are removed (a stale copy could not be resumed) and the
/// user is told.
pub(crate) fn journal_writer(
    dir: PathBuf,
    name: String,
    file: std::sync::Arc<std::sync::Mutex<JournalFile>>,
    mut encode: impl FnMut(&roam::JournalEntry<'_>, &mut Vec<u8>) + Send + 'static,
) -> roam::JournalWriter {
    let mut bytes = Vec::new();
    Box::new(move |entry: &roam::JournalEntry<'_>| {
        encode(entry, &mut bytes);
        let written = file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write(&bytes, false);
        written.inspect_err(|e| {
            remove_all(&dir, &name);
            crate::notices::notice(&format!(
                "session {name:?}: its journal cannot be written ({e}): if this process is killed now, the session is lost (a detach still saves it)"
            ));
        })
    })
}

/// A slot file's sequence number (0: empty, damaged or mid-write).
fn slot_seq(f: &std::fs::File) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut head = [0u8; SLOT_HEADER as usize];
    match f.read_exact_at(&mut head, 0) {
        Ok(()) if head[..4] == SLOT_MAGIC => u64::from_le_bytes(head[4..12].try_into().unwrap()),
        _ => 0,
    }
}

/// Reads a journal slot file: its sequence number and record, `Ok(None)`
/// for an empty slot (or one whose copy was cut off: the other slot has
/// the previous copy). Bytes after the record (an older, longer copy's
/// tail) are ignored.
pub(crate) fn parse_slot(bytes: &[u8]) -> Result<Option<(u64, Record)>, String> {
    if bytes.len() < SLOT_HEADER as usize || bytes[..4] != SLOT_MAGIC {
        return Err("not a roam journal slot".to_string());
    }
    let seq = u64::from_le_bytes(bytes[4..12].try_into().unwrap());
    let len = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
    if seq == 0 {
        return Ok(None);
    }
    let body = usize::try_from(len)
        .ok()
        .and_then(|len| bytes.get(SLOT_HEADER as usize..(SLOT_HEADER as usize).checked_add(len)?))
        .ok_or("shorter than its length")?;
    Ok(Some((seq, Record::decode(body)?)))
}

/// A journal slot file's bytes holding `record` as copy `seq`.
pub(crate) fn encode_slot(seq: u64, record: &Record) -> Vec<u8> {
    let body = record.encode();
    let mut out = Vec::with_capacity(SLOT_HEADER as usize + body.len());
    out.extend_from_slice(&SLOT_MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// The newest usable copy in `name`'s journal: `Ok(None)` if it has no
/// slots; an error naming the damage if none of its slots is usable.
fn load_journal(dir: &Path, name: &str) -> Result<Option<Record>, String> {
    let mut best: Option<(u64, Record)> = None;
    let mut seen = Vec::new();
    for path in slot_paths(dir, name) {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        match parse_slot(&bytes) {
            Ok(Some((seq, r))) if best.as_ref().is_none_or(|(b, _)| seq > *b) => {
                best = Some((seq, r))
            }
            Ok(_) => {}
            Err(e) => seen.push(format!("{}: {e}", path.display())),
        }
    }
    match best {
        Some((_, r)) => Ok(Some(r)),
        None if seen.len() == 2 => Err(seen.join("; ")),
        None => Ok(None),
    }
}

/// Where a named pipe's stdout writer marks how much it printed (see
/// `stdio::Mark`).
pub(crate) fn mark_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.printed"))
}

/// Removes every record of `name` (its journal slots, a record of an
/// older roam) and its output mark.
pub(crate) fn remove_all(dir: &Path, name: &str) {
    remove(dir, name);
    for p in slot_paths(dir, name) {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(mark_path(dir, name));
}

/// Whether `name` has a record a client could re-attach from.
pub(crate) fn has_record(dir: &Path, name: &str) -> bool {
    matches!(load(dir, name), Ok(Some(_)))
}

/// Reads the record of `name`, if there is one: the newest copy in its
/// journal, else a record an older roam left.
pub(crate) fn load(dir: &Path, name: &str) -> Result<Option<Record>, String> {
    if let Some(r) = load_journal(dir, name)? {
        return Ok(Some(r));
    }
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
        if let (Some(pid), false) = (died, has_record(dir, name)) {
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
    /// Left by a client that was killed (its journal), not detached.
    #[serde(default)]
    pub(crate) killed: bool,
    /// Bytes of input the session took; the next client's stdin follows.
    #[serde(default)]
    pub(crate) input_taken: Option<u64>,
    /// Bytes of output printed; the next client's stdout follows.
    #[serde(default)]
    pub(crate) output_printed: Option<u64>,
    /// A `roam forward --name` session: its local address.
    #[serde(default)]
    pub(crate) listen: Option<String>,
}

/// Every detached session in `dir`, by name.
pub(crate) fn list(dir: &Path) -> Vec<DetachedStatus> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let now = unix_now();
    let mut out: Vec<DetachedStatus> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            // A record of an older roam, or a journal's slot.
            let file = p.file_name()?.to_str()?;
            let name = file
                .strip_suffix(".detached")
                .or_else(|| file.strip_suffix(".journal-0"))
                .or_else(|| file.strip_suffix(".journal-1"))?;
            Some(name.to_string())
        })
        .collect::<std::collections::BTreeSet<String>>()
        .into_iter()
        // The journal of a session whose client is attached: a live
        // session, listed with the others.
        .filter(|name| attached_pid(dir, name).is_none())
        .filter_map(|name| {
            let mark = mark_path(dir, &name);
            let loaded = match load(dir, &name) {
                Ok(Some(r)) => Ok(r),
                Ok(None) => return None,
                Err(e) => Err(e),
            };
            Some(match loaded {
                Ok(r) => DetachedStatus {
                    name,
                    relay: r.header.relay,
                    target: r.header.target,
                    detached_at: r.header.detached_at,
                    detached_for_secs: now.saturating_sub(r.header.detached_at),
                    pending_bytes: (r.upload.len() + r.download.len()) as u64,
                    error: None,
                    killed: r.header.journal,
                    input_taken: r.header.input_taken,
                    listen: r.header.listen,
                    // A killed client's mark is ahead of its journal.
                    output_printed: match (r.header.journal, r.header.output_printed) {
                        (true, Some(o)) => {
                            Some(crate::stdio::Mark::read(&mark).map_or(o, |m| m.max(o)))
                        }
                        (_, o) => o,
                    },
                },
                Err(e) => DetachedStatus {
                    name,
                    relay: String::new(),
                    target: String::new(),
                    detached_at: 0,
                    detached_for_secs: 0,
                    pending_bytes: 0,
                    error: Some(e),
                    killed: false,
                    input_taken: None,
                    output_printed: None,
                    listen: None,
                },
            })
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
                journal: true,
                input_taken: Some(12),
                output_printed: None,
                listen: None,
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

    /// The journal's slots: the newest whole copy is the record; a copy
    /// cut off mid-write leaves the previous one; numbering goes on in a
    /// new process; the seed a fuzzer starts from parses.
    #[test]
    fn the_journal_keeps_the_newest_whole_copy() {
        let dir = tempfile::tempdir().unwrap();
        let copy = |n: u64| {
            let mut r = sample();
            r.header.input_taken = Some(n);
            r
        };
        let mut j = JournalFile::open(dir.path(), "backup-1").unwrap();
        assert_eq!(load(dir.path(), "backup-1"), Ok(None), "no copy yet");
        for n in 1..=3 {
            j.write(&copy(n).encode(), false).unwrap();
            assert_eq!(load(dir.path(), "backup-1"), Ok(Some(copy(n))));
        }
        // Copy 4 goes to the slot of copy 2; cut off after its first step.
        use std::os::unix::fs::FileExt;
        let [a, b] = slot_paths(dir.path(), "backup-1");
        let older = if slot_seq(&std::fs::File::open(&a).unwrap()) == 2 {
            &a
        } else {
            &b
        };
        let f = std::fs::OpenOptions::new().write(true).open(older).unwrap();
        f.write_all_at(&[0u8; 16], 4).unwrap();
        f.write_all_at(b"half a record", SLOT_HEADER).unwrap();
        assert_eq!(
            load(dir.path(), "backup-1"),
            Ok(Some(copy(3))),
            "the previous copy"
        );
        // A new process continues after copy 3 and keeps it until its own is whole.
        drop(j);
        let mut j = JournalFile::open(dir.path(), "backup-1").unwrap();
        j.write(&copy(5).encode(), false).unwrap();
        assert_eq!(load(dir.path(), "backup-1"), Ok(Some(copy(5))));
        j.write(&copy(6).encode(), true).unwrap();
        assert_eq!(load(dir.path(), "backup-1"), Ok(Some(copy(6))));
        assert!(list(dir.path())[0].input_taken == Some(6));
        // Both slots damaged: the error names them.
        for p in [&a, &b] {
            std::fs::write(p, b"garbage").unwrap();
        }
        let e = load(dir.path(), "backup-1").unwrap_err();
        assert!(e.contains("journal-0") && e.contains("journal-1"), "{e}");
        remove_all(dir.path(), "backup-1");
        assert_eq!(load(dir.path(), "backup-1"), Ok(None));
        // The fuzzer's seed is a slot holding copy 7.
        let seed = include_bytes!("../../../fuzz/seeds/cli_parsers/journal_slot");
        assert!(matches!(parse_slot(&seed[1..]), Ok(Some((7, _)))));
        // The fuzz target's round trip: the canonical form (without the
        // older copy's tail) parses to itself.
        let again = crate::parsers::journal_slot(&seed[1..]).unwrap().unwrap();
        assert!(!again.ends_with(b"tail of an older copy"));
        assert_eq!(
            crate::parsers::journal_slot(&again),
            Ok(Some(again.clone()))
        );
        let mut cut = again.clone();
        cut.truncate(again.len() - 1);
        assert!(crate::parsers::journal_slot(&cut)
            .unwrap_err()
            .contains("shorter"));
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
