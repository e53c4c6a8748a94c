//! Persistent continuations: an embedded redb database in the state
//! directory (`continuations.redb`, mode 0600 in a 0700 directory: the
//! entries hold resume secrets).
//!
//! Tables, all keyed by the 16-byte session id:
//! - `meta`: the small uncompressed part of a record (see [`crate::record`]);
//! - `body`: the zstd-compressed rest (see [`crate::record`]);
//! - `quarantine`: entries that failed a check, kept for inspection with the
//!   reason, never restored.
//!
//! Every change to one continuation (its meta and body together) is one write
//! transaction, committed durably before the caller hears back. A single
//! writer thread batches whatever requests queued up meanwhile into that one
//! transaction (group commit), so a thousand simultaneous suspends cost a few
//! disk syncs rather than a thousand. Reads use redb's concurrent read
//! transactions.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;

use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use roam_proto::codec::{put_lp_bytes, Reader};
use roam_proto::SessionId;
use tokio::sync::oneshot;

use crate::record::{Corrupt, Meta};

const META: TableDefinition<&[u8], &[u8]> = TableDefinition::new("meta");
const BODY: TableDefinition<&[u8], &[u8]> = TableDefinition::new("body");
const QUARANTINE: TableDefinition<&[u8], &[u8]> = TableDefinition::new("quarantine");
/// File name of the database inside the state directory.
pub const DB_FILE: &str = "continuations.redb";
/// Requests committed in one transaction at most.
const MAX_BATCH: usize = 1024;

/// Why the store failed. I/O and database errors are the host's problem
/// (disk full, permissions); corruption is reported per entry.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// Creating the state directory or the database file failed.
    Io(io::Error),
    /// The database refused an operation.
    Db(String),
    /// The writer thread is gone (the store is shutting down).
    Closed,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "continuation store: {e}"),
            Self::Db(e) => write!(f, "continuation store database: {e}"),
            Self::Closed => write!(f, "continuation store is closed"),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<io::Error> for StoreError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn db_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Db(e.to_string())
}

/// One queued change.
enum Op {
    Put {
        id: SessionId,
        meta: Vec<u8>,
        body: Vec<u8>,
    },
    Delete(SessionId),
    Quarantine {
        key: Vec<u8>,
        reason: String,
    },
}

struct Request {
    ops: Vec<Op>,
    reply: oneshot::Sender<Result<(), String>>,
}

/// A stored continuation as bytes: its meta entry and, if present, its body.
pub(crate) type RawEntry = (Vec<u8>, Option<Vec<u8>>);

/// One stored entry found by a scan: its key and its meta, or why the meta
/// is unreadable.
pub(crate) struct Scanned {
    pub(crate) key: Vec<u8>,
    pub(crate) meta: Result<Meta, Corrupt>,
}

/// The continuation database. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    db: Arc<Database>,
    path: PathBuf,
    writer: Mutex<Option<mpsc::Sender<Request>>>,
    thread: Mutex<Option<thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the writer after its last batch; joining
        // it releases the database file for a later `open` in this process.
        drop(self.writer.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.path)
            .finish()
    }
}

impl Store {
    /// Opens (or creates) the store in `state_dir`. The directory is created
    /// with mode 0700 and the database file with 0600; an existing file
    /// readable by others is tightened to 0600 (with a warning).
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        if !state_dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(state_dir)?;
        }
        let path = state_dir.join(DB_FILE);
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let mode = fs::metadata(&path)?.permissions().mode();
                if mode & 0o077 != 0 {
                    tracing::warn!(
                        "{} had mode {:o}; continuations hold resume secrets, setting 0600",
                        path.display(),
                        mode & 0o777
                    );
                    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
                }
            }
            Err(e) => return Err(e.into()),
        }
        let db = Arc::new(Database::create(&path).map_err(db_err)?);
        {
            let tx = db.begin_write().map_err(db_err)?;
            tx.open_table(META).map_err(db_err)?;
            tx.open_table(BODY).map_err(db_err)?;
            tx.open_table(QUARANTINE).map_err(db_err)?;
            tx.commit().map_err(db_err)?;
        }
        let (tx, rx) = mpsc::channel();
        let wdb = db.clone();
        let thread = thread::Builder::new()
            .name("roam-cont-store".into())
            .spawn(move || writer(&wdb, &rx))?;
        Ok(Self {
            inner: Arc::new(Inner {
                db,
                path,
                writer: Mutex::new(Some(tx)),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// Path of the database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    async fn submit(&self, ops: Vec<Op>) -> Result<(), StoreError> {
        let rx = self.enqueue(ops)?;
        Self::committed(rx).await
    }

    /// Queues `ops` for the writer now (requests commit in queue order);
    /// await the receiver with [`Store::committed`].
    fn enqueue(&self, ops: Vec<Op>) -> Result<oneshot::Receiver<Result<(), String>>, StoreError> {
        let (reply, rx) = oneshot::channel();
        let w = self.inner.writer.lock().unwrap_or_else(|e| e.into_inner());
        let w = w.as_ref().ok_or(StoreError::Closed)?;
        w.send(Request { ops, reply })
            .map_err(|_| StoreError::Closed)?;
        Ok(rx)
    }

    /// Waits for a queued request to be committed.
    async fn committed(rx: oneshot::Receiver<Result<(), String>>) -> Result<(), StoreError> {
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::Db(e)),
            Err(_) => Err(StoreError::Closed),
        }
    }

    /// Queues a continuation's write without waiting: it commits before any
    /// request queued after it (a later delete of the same id cannot be
    /// overtaken). Await the result with [`Store::put_done`].
    pub(crate) fn put_queued(
        &self,
        id: SessionId,
        meta: Vec<u8>,
        body: Vec<u8>,
    ) -> Result<oneshot::Receiver<Result<(), String>>, StoreError> {
        self.enqueue(vec![Op::Put { id, meta, body }])
    }

    /// The outcome of a [`Store::put_queued`].
    pub(crate) async fn put_done(
        rx: oneshot::Receiver<Result<(), String>>,
    ) -> Result<(), StoreError> {
        Self::committed(rx).await
    }

    /// Writes one continuation (meta and body in one transaction).
    pub(crate) async fn put(
        &self,
        id: SessionId,
        meta: Vec<u8>,
        body: Vec<u8>,
    ) -> Result<(), StoreError> {
        self.submit(vec![Op::Put { id, meta, body }]).await
    }

    /// Deletes continuations (one transaction).
    pub(crate) async fn delete(&self, ids: Vec<SessionId>) -> Result<(), StoreError> {
        self.submit(ids.into_iter().map(Op::Delete).collect()).await
    }

    /// Moves an entry (by raw key) to the quarantine table.
    pub(crate) async fn quarantine(&self, key: Vec<u8>, reason: String) -> Result<(), StoreError> {
        self.submit(vec![Op::Quarantine { key, reason }]).await
    }

    /// Blocking: every meta entry, decoded or with the reason it is unreadable.
    pub(crate) fn scan(&self) -> Result<Vec<Scanned>, StoreError> {
        let tx = self.inner.db.begin_read().map_err(db_err)?;
        let t = tx.open_table(META).map_err(db_err)?;
        let mut out = Vec::new();
        for row in t.iter().map_err(db_err)? {
            let (k, v) = row.map_err(db_err)?;
            let key = k.value().to_vec();
            let meta = if key.len() == 16 {
                Meta::decode(v.value())
            } else {
                Err(Corrupt::new("key is not a session id"))
            };
            out.push(Scanned { key, meta });
        }
        // Bodies without a meta entry (a torn edit by hand) are corrupt too.
        let b = tx.open_table(BODY).map_err(db_err)?;
        for row in b.iter().map_err(db_err)? {
            let (k, _) = row.map_err(db_err)?;
            let key = k.value().to_vec();
            if t.get(key.as_slice()).map_err(db_err)?.is_none() {
                out.push(Scanned {
                    key,
                    meta: Err(Corrupt::new("body without meta entry")),
                });
            }
        }
        Ok(out)
    }

    /// Blocking: the raw meta and body of one continuation (`None` body if
    /// the meta exists but the body does not).
    pub(crate) fn get(&self, id: &SessionId) -> Result<Option<RawEntry>, StoreError> {
        let tx = self.inner.db.begin_read().map_err(db_err)?;
        let m = tx.open_table(META).map_err(db_err)?;
        let Some(meta) = m.get(id.0.as_slice()).map_err(db_err)? else {
            return Ok(None);
        };
        let b = tx.open_table(BODY).map_err(db_err)?;
        let body = b
            .get(id.0.as_slice())
            .map_err(db_err)?
            .map(|v| v.value().to_vec());
        Ok(Some((meta.value().to_vec(), body)))
    }

    /// Blocking: number of stored continuations.
    pub fn len(&self) -> Result<u64, StoreError> {
        let tx = self.inner.db.begin_read().map_err(db_err)?;
        let t = tx.open_table(META).map_err(db_err)?;
        t.len().map_err(db_err)
    }

    /// Blocking: whether the store holds no continuation.
    pub fn is_empty(&self) -> Result<bool, StoreError> {
        Ok(self.len()? == 0)
    }

    /// Blocking: quarantined entries as (raw key, reason).
    pub fn quarantined(&self) -> Result<Vec<(Vec<u8>, String)>, StoreError> {
        let tx = self.inner.db.begin_read().map_err(db_err)?;
        let t = tx.open_table(QUARANTINE).map_err(db_err)?;
        let mut out = Vec::new();
        for row in t.iter().map_err(db_err)? {
            let (k, v) = row.map_err(db_err)?;
            let mut r = Reader::new(v.value());
            let reason = r
                .lp_bytes(usize::MAX, "reason")
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_else(|_| "(unreadable)".into());
            out.push((k.value().to_vec(), reason));
        }
        Ok(out)
    }
}

/// The writer thread: one transaction per batch of queued requests.
fn writer(db: &Database, rx: &mpsc::Receiver<Request>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let result = commit(db, &batch).map_err(|e| e.to_string());
        if let Err(e) = &result {
            tracing::error!(
                "continuation store: write of {} requests failed: {e}",
                batch.len()
            );
        }
        for r in batch {
            let _ = r.reply.send(result.clone());
        }
    }
}

fn commit(db: &Database, batch: &[Request]) -> Result<(), StoreError> {
    let tx = db.begin_write().map_err(db_err)?;
    {
        let mut meta = tx.open_table(META).map_err(db_err)?;
        let mut body = tx.open_table(BODY).map_err(db_err)?;
        let mut quarantine = tx.open_table(QUARANTINE).map_err(db_err)?;
        for op in batch.iter().flat_map(|r| &r.ops) {
            match op {
                Op::Put {
                    id,
                    meta: m,
                    body: b,
                } => {
                    meta.insert(id.0.as_slice(), m.as_slice()).map_err(db_err)?;
                    body.insert(id.0.as_slice(), b.as_slice()).map_err(db_err)?;
                }
                Op::Delete(id) => {
                    meta.remove(id.0.as_slice()).map_err(db_err)?;
                    body.remove(id.0.as_slice()).map_err(db_err)?;
                }
                Op::Quarantine { key, reason } => {
                    let m = meta
                        .remove(key.as_slice())
                        .map_err(db_err)?
                        .map(|v| v.value().to_vec());
                    let b = body
                        .remove(key.as_slice())
                        .map_err(db_err)?
                        .map(|v| v.value().to_vec());
                    let mut v = Vec::new();
                    put_lp_bytes(&mut v, reason.as_bytes());
                    put_lp_bytes(&mut v, m.as_deref().unwrap_or_default());
                    put_lp_bytes(&mut v, b.as_deref().unwrap_or_default());
                    quarantine
                        .insert(key.as_slice(), v.as_slice())
                        .map_err(db_err)?;
                }
            }
        }
    }
    tx.commit().map_err(db_err)
}
