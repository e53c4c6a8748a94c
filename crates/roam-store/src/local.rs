//! [`LocalDir`]: objects as files in a directory (a USB disk, an NFS mount,
//! a test's temporary directory).
//!
//! Layout under the root: `objects/<xx>/<yy>/<leaf>`, where `xx` and `yy`
//! are the first two bytes (hex) of SHA-256(name) — a 2-level fan-out of
//! 65,536 directories that spreads chunk and manifest names alike — and
//! `<leaf>` is the name with each `/` written as `%` (a character names
//! never contain, so the leaf gives the name back). Writes go to
//! `tmp/<random>.tmp`, are fsynced, renamed into place, and the directory is
//! fsynced: an object exists whole under its name or not at all.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::backend::{check_name, check_prefix, BackendError, ChunkBackend};

/// A directory of objects (module docs for the layout).
#[derive(Clone, Debug)]
pub struct LocalDir {
    /// The root directory; shared with blocking tasks.
    root: Arc<PathBuf>,
}

/// Age after which a temporary file is a crash's leftover (1 hour).
const STALE_TMP: std::time::Duration = std::time::Duration::from_secs(3600);

/// Distinguishes temporary files written by this process at once.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl LocalDir {
    /// A store rooted at `root` (created if missing, with `objects/` and
    /// `tmp/`). Temporary files left by a crash more than an hour ago are
    /// removed (younger ones may be another process's writes in progress).
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, BackendError> {
        let root = root.into();
        for sub in ["objects", "tmp"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(|source| BackendError::Io {
                op: "create directory",
                name: String::new(),
                path: dir.clone(),
                source,
            })?;
        }
        if let Ok(entries) = fs::read_dir(root.join("tmp")) {
            for e in entries.flatten() {
                let stale = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > STALE_TMP);
                if stale {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        Ok(LocalDir {
            root: Arc::new(root),
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that holds (or would hold) the object `name`.
    pub fn path_of(&self, name: &str) -> Result<PathBuf, BackendError> {
        check_name(name)?;
        Ok(object_path(&self.root, name))
    }

    /// Runs blocking file work off the async runtime's threads.
    async fn blocking<T: Send + 'static>(
        &self,
        op: &'static str,
        name: &str,
        f: impl FnOnce(&Path) -> Result<T, BackendError> + Send + 'static,
    ) -> Result<T, BackendError> {
        let root = Arc::clone(&self.root);
        tokio::task::spawn_blocking(move || f(&root))
            .await
            .map_err(|e| BackendError::Io {
                op,
                name: name.to_owned(),
                path: self.root.to_path_buf(),
                source: io::Error::other(e.to_string()),
            })?
    }
}

/// `objects/<xx>/<yy>/<leaf>` for `name` (already checked).
fn object_path(root: &Path, name: &str) -> PathBuf {
    let h = Sha256::digest(name.as_bytes());
    root.join("objects")
        .join(hex::encode(&h[..1]))
        .join(hex::encode(&h[1..2]))
        .join(name.replace('/', "%"))
}

/// A file error naming the object and the path.
fn io_err(op: &'static str, name: &str, path: &Path) -> impl FnOnce(io::Error) -> BackendError {
    let name = name.to_owned();
    let path = path.to_path_buf();
    move |source| BackendError::Io {
        op,
        name,
        path,
        source,
    }
}

/// Writes `bytes` to a fresh temporary file, fsyncs it, renames it to
/// `dest` and fsyncs `dest`'s directory. On failure the temporary file is
/// removed and nothing appears at `dest`.
fn write_atomically(
    root: &Path,
    name: &str,
    dest: &Path,
    bytes: &[u8],
) -> Result<(), BackendError> {
    let dir = dest.parent().unwrap_or(root);
    fs::create_dir_all(dir).map_err(io_err("create directory", name, dir))?;
    let tmp = root.join("tmp").join(format!(
        "{}-{}.tmp",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err("create", name, &tmp))?;
        f.write_all(bytes).map_err(io_err("write", name, dest))?;
        f.sync_all().map_err(io_err("fsync", name, dest))?;
        drop(f);
        fs::rename(&tmp, dest).map_err(io_err("rename", name, dest))?;
        // The rename is durable once the directory is.
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("fsync directory", name, dir))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

impl ChunkBackend for LocalDir {
    async fn put_if_absent(&self, name: &str, bytes: Vec<u8>) -> Result<bool, BackendError> {
        let dest = self.path_of(name)?;
        let owned = name.to_owned();
        self.blocking("put", name, move |root| {
            match fs::symlink_metadata(&dest) {
                Ok(_) => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("stat", &owned, &dest)(e)),
            }
            write_atomically(root, &owned, &dest, &bytes)?;
            Ok(true)
        })
        .await
    }

    async fn get(&self, name: &str, max_len: u64) -> Result<Vec<u8>, BackendError> {
        use std::io::Read;
        let path = self.path_of(name)?;
        let owned = name.to_owned();
        self.blocking("get", name, move |_| {
            let file = match fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(BackendError::NotFound { name: owned })
                }
                Err(e) => return Err(io_err("open", &owned, &path)(e)),
            };
            // Read at most one byte past the limit, whatever the file's
            // size says (it may grow meanwhile).
            let mut bytes = Vec::new();
            file.take(max_len.saturating_add(1))
                .read_to_end(&mut bytes)
                .map_err(io_err("read", &owned, &path))?;
            if bytes.len() as u64 > max_len {
                return Err(BackendError::TooLarge {
                    name: owned,
                    len: bytes.len() as u64,
                    max: max_len,
                });
            }
            Ok(bytes)
        })
        .await
    }

    async fn exists(&self, name: &str) -> Result<bool, BackendError> {
        let path = self.path_of(name)?;
        let owned = name.to_owned();
        self.blocking("stat", name, move |_| match fs::symlink_metadata(&path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err("stat", &owned, &path)(e)),
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, BackendError> {
        check_prefix(prefix)?;
        let prefix = prefix.to_owned();
        let p2 = prefix.clone();
        self.blocking("list", &p2, move |root| {
            let objects = root.join("objects");
            let read = |dir: &Path| fs::read_dir(dir).map_err(io_err("list", &prefix, dir));
            let mut names = Vec::new();
            for l1 in read(&objects)? {
                let l1 = l1.map_err(io_err("list", &prefix, &objects))?.path();
                if !l1.is_dir() {
                    continue;
                }
                for l2 in read(&l1)? {
                    let l2 = l2.map_err(io_err("list", &prefix, &l1))?.path();
                    if !l2.is_dir() {
                        continue;
                    }
                    for leaf in read(&l2)? {
                        let leaf = leaf.map_err(io_err("list", &prefix, &l2))?;
                        // Files this backend did not write are ignored.
                        let Some(leaf) = leaf.file_name().to_str().map(|s| s.replace('%', "/"))
                        else {
                            continue;
                        };
                        if check_name(&leaf).is_ok() && leaf.starts_with(&prefix) {
                            names.push(leaf);
                        }
                    }
                }
            }
            names.sort();
            Ok(names)
        })
        .await
    }

    async fn delete(&self, name: &str) -> Result<bool, BackendError> {
        let path = self.path_of(name)?;
        let owned = name.to_owned();
        self.blocking("delete", name, move |_| match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err("delete", &owned, &path)(e)),
        })
        .await
    }
}
