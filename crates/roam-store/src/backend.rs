//! The storage seam: [`ChunkBackend`], what [`crate::Store`] needs from a
//! place that keeps named objects, and its errors.
//!
//! Two implementations: [`crate::LocalDir`] (a directory) and `S3`
//! (any S3-compatible service). A third, in `roam-cli`
//! (`store_remote.rs`), reaches either of them behind a `roam store serve`
//! through a roam session (`docs/STORE-REMOTE.md`). Objects are immutable once written: a name
//! is content-addressed (chunks) or a version (manifests), so "put if
//! absent" is the only write.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::PathBuf;

/// Longest object name, bytes.
pub const MAX_NAME_LEN: usize = 200;

/// Where objects live. Names are `/`-separated segments of
/// `A-Z a-z 0-9 . _ -` ([`check_name`]), at most [`MAX_NAME_LEN`] bytes.
pub trait ChunkBackend: Send + Sync {
    /// Stores `bytes` under `name` unless an object of that name exists.
    /// Returns whether it wrote. The write is atomic: a crash or error never
    /// leaves a partial object under `name`.
    fn put_if_absent(
        &self,
        name: &str,
        bytes: Vec<u8>,
    ) -> impl Future<Output = Result<bool, BackendError>> + Send;

    /// The object's bytes ([`BackendError::NotFound`] if there is none). An
    /// object longer than `max_len` is refused ([`BackendError::TooLarge`])
    /// without reading more than `max_len + 1` of its bytes into memory: a
    /// hostile store cannot make the reader allocate without bound.
    fn get(
        &self,
        name: &str,
        max_len: u64,
    ) -> impl Future<Output = Result<Vec<u8>, BackendError>> + Send;

    /// Whether an object called `name` exists.
    fn exists(&self, name: &str) -> impl Future<Output = Result<bool, BackendError>> + Send;

    /// The names of all objects whose name starts with `prefix` (a
    /// directory-like prefix ending in `/`, or empty for all), sorted.
    fn list(&self, prefix: &str) -> impl Future<Output = Result<Vec<String>, BackendError>> + Send;

    /// Deletes the object; returns whether it existed.
    fn delete(&self, name: &str) -> impl Future<Output = Result<bool, BackendError>> + Send;
}

/// What a backend operation failed on.
#[derive(Debug)]
#[non_exhaustive]
pub enum BackendError {
    /// No object of that name.
    NotFound {
        /// The object's name.
        name: String,
    },
    /// The object is longer than the reader allows (not an object this
    /// store wrote).
    TooLarge {
        /// The object's name.
        name: String,
        /// Its length as far as known (at least `max + 1`).
        len: u64,
        /// The most the reader allowed.
        max: u64,
    },
    /// The name breaks [`check_name`]'s rules (API misuse).
    InvalidName {
        /// The name given.
        name: String,
    },
    /// A local file operation failed (disk full, permissions, IO error).
    Io {
        /// What was being done ("write", "fsync", "rename", ...).
        op: &'static str,
        /// The object's name (or the prefix, for a listing).
        name: String,
        /// The file or directory involved.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// A remote store refused or failed the request.
    Remote {
        /// What was being done ("put", "get", ...).
        op: &'static str,
        /// The object's name (or the prefix, for a listing).
        name: String,
        /// The client's description of the failure.
        message: String,
    },
    /// The backend's configuration is unusable (bad endpoint URL, ...).
    Config(String),
}

impl BackendError {
    /// Whether the failure is a full disk (ENOSPC) or an exceeded quota.
    pub fn is_storage_full(&self) -> bool {
        match self {
            BackendError::Io { source, .. } => {
                source.kind() == io::ErrorKind::StorageFull
                    || source.kind() == io::ErrorKind::QuotaExceeded
            }
            _ => false,
        }
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::NotFound { name } => write!(f, "object {name} not found"),
            BackendError::TooLarge { name, len, max } => {
                write!(f, "object {name} is {len} bytes, at most {max} expected")
            }
            BackendError::InvalidName { name } => write!(
                f,
                "invalid object name {name:?} (segments of A-Z a-z 0-9 . _ -, \
                 at most {MAX_NAME_LEN} bytes)"
            ),
            BackendError::Io {
                op,
                name,
                path,
                source,
            } => {
                write!(f, "{op} of object {name} at {}: {source}", path.display())?;
                if self.is_storage_full() {
                    f.write_str(" (ENOSPC: no space left; free space or use another store)")?;
                }
                Ok(())
            }
            BackendError::Remote { op, name, message } => {
                write!(f, "{op} of object {name}: {message}")
            }
            BackendError::Config(why) => write!(f, "backend configuration: {why}"),
        }
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BackendError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Checks an object name: 1-[`MAX_NAME_LEN`] bytes, `/`-separated non-empty
/// segments of `A-Z a-z 0-9 . _ -`, none `.` or `..`.
pub fn check_name(name: &str) -> Result<(), BackendError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        });
    if ok {
        Ok(())
    } else {
        Err(BackendError::InvalidName {
            name: name.to_owned(),
        })
    }
}

/// Checks a listing prefix: empty, or a valid name followed by `/`.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), BackendError> {
    if prefix.is_empty() {
        return Ok(());
    }
    match prefix.strip_suffix('/') {
        Some(p) => check_name(p),
        None => Err(BackendError::InvalidName {
            name: prefix.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["chunks/ab12", "manifests/vm-1/3", "a"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "/a",
            "a/",
            "a//b",
            "a/../b",
            ".",
            "a b",
            "a%b",
            "é",
            &"x".repeat(201),
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert!(check_prefix("").is_ok());
        assert!(check_prefix("chunks/").is_ok());
        assert!(check_prefix("chunks").is_err());
    }
}
