//! [`Store`]: suspend, restore, demand fetch and garbage collection on top of
//! a [`ChunkBackend`].

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::backend::{BackendError, ChunkBackend};
use crate::chunk::{
    chunk_ref, object_name, open_chunk, seal_chunk, ChunkFault, ChunkRef, UserSecret, CHUNK_SIZE,
    MAX_CHUNK_OBJECT_LEN,
};
use crate::lease::{open_lease, seal_lease, Lease, LeaseError, MAX_LEASE_LEN};
use crate::lookaside::{Lookaside, LookasideRead};
use crate::manifest::{
    manifest_object_name, open_manifest, seal_manifest, valid_env_name, valid_image_name,
    ImageEntry, Manifest, ManifestError, MAX_IMAGE_LEN, MAX_MANIFEST_LEN,
};

/// Chunks a suspend checks and uploads at once (each holds its 128 KiB
/// plaintext and sealed object in memory).
const UPLOAD_WINDOW: usize = 8;

/// Chunks [`Store::restore_image`] fetches at once (8 × 128 KiB in memory).
const RESTORE_WINDOW: usize = 8;

/// Listings [`Store::leases`] tries before it takes a lease deleted under
/// it as replaced (5).
const LEASE_LIST_ATTEMPTS: u32 = 5;

/// A user's encrypted chunk store on one backend.
#[derive(Debug)]
pub struct Store<B> {
    /// Where the objects live.
    backend: B,
    /// Derives every key and object name.
    secret: UserSecret,
}

/// What a suspend did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SuspendStats {
    /// Chunks in the new version, repeats included.
    pub chunks_total: u64,
    /// Chunks written to the backend.
    pub chunks_uploaded: u64,
    /// Object bytes written (after compression and sealing), manifest not
    /// included.
    pub bytes_uploaded: u64,
    /// Chunks the previous manifest already had: skipped without asking the
    /// backend.
    pub chunks_unchanged: u64,
    /// Chunks the backend already held (an exists call said so).
    pub chunks_present: u64,
    /// Chunks identical to one earlier in this suspend.
    pub chunks_repeated: u64,
    /// Image bytes read.
    pub bytes_read: u64,
}

impl SuspendStats {
    /// Chunks settled so far: uploaded, or found already stored (unchanged,
    /// present or repeated). Equals [`SuspendStats::chunks_total`] once a
    /// suspend has returned; while it runs, the uploads in flight are the
    /// difference.
    pub fn chunks_done(&self) -> u64 {
        self.chunks_uploaded + self.chunks_present + self.chunks_unchanged + self.chunks_repeated
    }
}

/// A suspend's progress callback ([`Store::suspend_with_progress`]): called
/// with the image being read and the totals so far each time a chunk is
/// settled (stored or found stored).
pub type SuspendProgress<'a> = dyn FnMut(&str, &SuspendStats) + Send + 'a;

/// Where the chunks of a restore came from ([`Store::restore_image_from`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreStats {
    /// Chunks written so far.
    pub chunks: u64,
    /// Plaintext bytes written so far.
    pub bytes: u64,
    /// Of those chunks, taken from lookaside files (verified by hash).
    pub chunks_lookaside: u64,
    /// Plaintext bytes of the chunks taken from lookaside: the bytes the
    /// store did not have to send.
    pub bytes_lookaside: u64,
    /// Chunks a lookaside file was indexed for but whose bytes there no
    /// longer matched the manifest (fetched from the store instead).
    pub chunks_rejected: u64,
    /// Chunks fetched from the store.
    pub chunks_fetched: u64,
    /// Plaintext bytes of the chunks fetched from the store.
    pub bytes_fetched: u64,
    /// Object bytes the backend sent for them (compressed and sealed): what
    /// crossed the network.
    pub object_bytes_fetched: u64,
}

impl RestoreStats {
    /// Adds `other`'s counts to these (totals over several images).
    pub fn add(&mut self, other: &RestoreStats) {
        self.chunks += other.chunks;
        self.bytes += other.bytes;
        self.chunks_lookaside += other.chunks_lookaside;
        self.bytes_lookaside += other.bytes_lookaside;
        self.chunks_rejected += other.chunks_rejected;
        self.chunks_fetched += other.chunks_fetched;
        self.bytes_fetched += other.bytes_fetched;
        self.object_bytes_fetched += other.object_bytes_fetched;
    }
}

/// Where one restored chunk came from.
enum Source {
    /// A lookaside file (its bytes passed the hash check).
    Lookaside,
    /// The store: the object's length, and whether a lookaside place was
    /// indexed but failed the check.
    Store {
        /// Object bytes fetched.
        object_len: u64,
        /// Whether lookaside had a place for it that failed the check.
        rejected: bool,
    },
}

/// What a garbage collection did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Chunk objects found in the backend.
    pub chunks_examined: u64,
    /// Of those, kept: referenced by a kept manifest or a live lease.
    pub chunks_kept: u64,
    /// Of the kept chunks, those only a live trickle lease references
    /// (written back by a running environment, not yet in a version).
    pub chunks_leased: u64,
    /// Live trickle leases found (runs writing back now).
    pub leases_live: u64,
    /// Names of the stale leases deleted (their runs ended without
    /// releasing them), sorted.
    pub leases_expired: Vec<String>,
    /// Names of the chunk objects deleted, sorted.
    pub deleted: Vec<String>,
}

/// Why a store operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend failed (disk full, network, permissions).
    Backend(BackendError),
    /// No manifest for this environment and version.
    ManifestMissing {
        /// The environment.
        env: String,
        /// The version.
        version: u64,
    },
    /// The manifest was refused (wrong secret, altered, replayed under
    /// another name or version, malformed).
    Manifest {
        /// The environment asked for.
        env: String,
        /// The version asked for.
        version: u64,
        /// Why.
        source: ManifestError,
    },
    /// A manifest for this version exists already; versions are immutable.
    VersionExists {
        /// The environment.
        env: String,
        /// The version.
        version: u64,
    },
    /// The environment name is not usable ([`valid_env_name`]).
    InvalidEnvName(String),
    /// The manifest has no image of this name.
    NoSuchImage(String),
    /// The chunk index is past the image's end.
    ChunkOutOfRange {
        /// The image.
        image: String,
        /// The index asked for.
        index: u64,
        /// The image's chunk count.
        chunks: u64,
    },
    /// A chunk the manifest names is not in the backend (deleted by a gc
    /// that did not keep this manifest, or never uploaded).
    ChunkMissing {
        /// The image.
        image: String,
        /// The chunk's index in it.
        index: u64,
        /// The chunk's id (hex).
        id: String,
    },
    /// A chunk object is not the chunk the manifest names (tampered,
    /// swapped, truncated); no data from it is returned.
    ChunkCorrupt {
        /// The image.
        image: String,
        /// The chunk's index in it.
        index: u64,
        /// The chunk's id (hex).
        id: String,
        /// What the check found.
        fault: ChunkFault,
    },
    /// Reading an image to suspend failed.
    ImageRead {
        /// The image.
        image: String,
        /// The reader's error.
        source: io::Error,
    },
    /// An image is longer than a manifest can describe.
    ImageTooLong {
        /// The image.
        image: String,
    },
    /// A trickle lease in the store could not be opened (another secret,
    /// altered): gc refuses to guess which chunks it protects.
    Lease {
        /// The lease's object name.
        name: String,
        /// Why.
        source: LeaseError,
    },
    /// Writing a restored image failed.
    ImageWrite {
        /// The image.
        image: String,
        /// The writer's error.
        source: io::Error,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Backend(e) => write!(f, "storage: {e}"),
            StoreError::ManifestMissing { env, version } => {
                write!(f, "environment {env:?} has no version {version}")
            }
            StoreError::Manifest {
                env,
                version,
                source,
            } => write!(f, "manifest of {env:?} version {version} refused: {source}"),
            StoreError::VersionExists { env, version } => write!(
                f,
                "environment {env:?} already has a version {version}; suspend under a new one"
            ),
            StoreError::InvalidEnvName(name) => write!(
                f,
                "invalid environment name {name:?} (1-128 bytes of A-Z a-z 0-9 . _ -)"
            ),
            StoreError::NoSuchImage(name) => write!(f, "no image {name:?} in the manifest"),
            StoreError::ChunkOutOfRange {
                image,
                index,
                chunks,
            } => write!(f, "image {image:?} has {chunks} chunks, no chunk {index}"),
            StoreError::ChunkMissing { image, index, id } => {
                write!(f, "image {image:?} chunk {index} (object {id}) is missing")
            }
            StoreError::ChunkCorrupt {
                image,
                index,
                id,
                fault,
            } => write!(
                f,
                "image {image:?} chunk {index} (object {id}) is corrupt: {fault}"
            ),
            StoreError::ImageRead { image, source } => {
                write!(f, "reading image {image:?}: {source}")
            }
            StoreError::ImageTooLong { image } => {
                write!(f, "image {image:?} is longer than {MAX_IMAGE_LEN} bytes")
            }
            StoreError::ImageWrite { image, source } => {
                write!(f, "writing image {image:?}: {source}")
            }
            StoreError::Lease { name, source } => {
                write!(f, "trickle lease {name} refused: {source}")
            }
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Backend(e) => Some(e),
            StoreError::Manifest { source, .. } => Some(source),
            StoreError::Lease { source, .. } => Some(source),
            StoreError::ImageRead { source, .. } | StoreError::ImageWrite { source, .. } => {
                Some(source)
            }
            _ => None,
        }
    }
}

impl From<BackendError> for StoreError {
    fn from(e: BackendError) -> Self {
        StoreError::Backend(e)
    }
}

/// Reads until `buf` is full or the reader ends; returns the bytes read.
async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]).await {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl<B: ChunkBackend> Store<B> {
    /// A store of `secret`'s user on `backend`.
    pub fn new(backend: B, secret: UserSecret) -> Self {
        Store { backend, secret }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Chunks `reader` into the backend as image `name`. Chunks whose id is
    /// in `unchanged` (the previous version's) or `seen` (this suspend's)
    /// are neither uploaded nor asked about; every other chunk is added to
    /// `seen`. Up to [`UPLOAD_WINDOW`] chunks are checked and uploaded at
    /// once; when this returns, none is in flight (also on error).
    async fn put_chunks<R: AsyncRead + Unpin>(
        &self,
        name: &str,
        reader: &mut R,
        unchanged: &HashSet<[u8; 32]>,
        seen: &mut HashSet<[u8; 32]>,
        stats: &mut SuspendStats,
        progress: &mut SuspendProgress<'_>,
    ) -> Result<ImageEntry, StoreError> {
        let upload =
            |chunk: ChunkRef, plain: Vec<u8>| async move { self.put_known(chunk, &plain).await };
        /// Counts a finished upload and reports it.
        fn record(
            done: Result<Option<u64>, StoreError>,
            name: &str,
            stats: &mut SuspendStats,
            progress: &mut SuspendProgress<'_>,
        ) -> Result<(), StoreError> {
            match done? {
                Some(len) => {
                    stats.chunks_uploaded += 1;
                    stats.bytes_uploaded += len;
                }
                None => stats.chunks_present += 1,
            }
            progress(name, stats);
            Ok(())
        }
        let mut pending = FuturesUnordered::new();
        let mut buf = vec![0u8; CHUNK_SIZE];
        let mut entry = ImageEntry {
            name: name.to_owned(),
            len: 0,
            chunks: Vec::new(),
        };
        let result: Result<(), StoreError> = async {
            loop {
                let n =
                    read_full(reader, &mut buf)
                        .await
                        .map_err(|source| StoreError::ImageRead {
                            image: name.to_owned(),
                            source,
                        })?;
                if n == 0 {
                    break;
                }
                entry.len += n as u64;
                if entry.len > MAX_IMAGE_LEN {
                    return Err(StoreError::ImageTooLong {
                        image: name.to_owned(),
                    });
                }
                stats.bytes_read += n as u64;
                stats.chunks_total += 1;
                let plain = &buf[..n];
                let chunk = chunk_ref(&self.secret, plain);
                entry.chunks.push(chunk);
                if unchanged.contains(&chunk.id) {
                    stats.chunks_unchanged += 1;
                    progress(name, stats);
                } else if !seen.insert(chunk.id) {
                    stats.chunks_repeated += 1;
                    progress(name, stats);
                } else {
                    pending.push(upload(chunk, plain.to_vec()));
                    if pending.len() >= UPLOAD_WINDOW {
                        if let Some(done) = pending.next().await {
                            record(done, name, stats, progress)?;
                        }
                    }
                }
                if n < CHUNK_SIZE {
                    break;
                }
            }
            while let Some(done) = pending.next().await {
                record(done, name, stats, progress)?;
            }
            Ok(())
        }
        .await;
        // On an error, let the uploads in flight finish (their results
        // dropped), so nothing is still being written when this returns.
        while pending.next().await.is_some() {}
        result.map(|()| entry)
    }

    /// Stores one chunk as a suspend does: unless the backend has its
    /// object already (an exists call), seals it (convergent encryption:
    /// the same plaintext gives the same object) and puts it. Returns its
    /// [`ChunkRef`] and `Some(object bytes)` if it wrote. The trickle
    /// write-back of a running environment uploads through this too, so a
    /// chunk it wrote is the very object a later suspend would write.
    pub async fn put_chunk(&self, plain: &[u8]) -> Result<(ChunkRef, Option<u64>), StoreError> {
        let chunk = chunk_ref(&self.secret, plain);
        Ok((chunk, self.put_known(chunk, plain).await?))
    }

    /// [`Store::put_chunk`] of `plain`, whose ref `chunk` is known.
    async fn put_known(&self, chunk: ChunkRef, plain: &[u8]) -> Result<Option<u64>, StoreError> {
        let object = chunk.object_name();
        if self.backend.exists(&object).await? {
            return Ok(None);
        }
        let sealed = seal_chunk(&self.secret, plain);
        let len = sealed.object.len() as u64;
        let wrote = self.backend.put_if_absent(&object, sealed.object).await?;
        Ok(wrote.then_some(len))
    }

    /// The [`ChunkRef`] `plain` has for this store's user (no I/O).
    pub fn chunk_ref(&self, plain: &[u8]) -> ChunkRef {
        chunk_ref(&self.secret, plain)
    }

    /// Writes `lease` (sealed) under [`Lease::object_name`]; a lease of
    /// that name existing already is an error (write the next `seq`).
    pub async fn write_lease(&self, lease: &Lease) -> Result<(), StoreError> {
        let name = lease.object_name();
        let sealed = seal_lease(&self.secret, lease).map_err(|source| StoreError::Lease {
            name: name.clone(),
            source,
        })?;
        if !self.backend.put_if_absent(&name, sealed).await? {
            return Err(StoreError::Backend(BackendError::Remote {
                op: "put",
                name,
                message: "a lease of this name exists already".into(),
            }));
        }
        Ok(())
    }

    /// Deletes the lease object `name`; returns whether it existed.
    pub async fn delete_lease(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.backend.delete(name).await?)
    }

    /// Every trickle lease in the store (of environment `env` only, if
    /// given), opened. A lease replaced while this reads (deleted between
    /// the listing and its read) makes it list again, so the result is a
    /// consistent view of some moment; a lease that does not open is
    /// [`StoreError::Lease`].
    pub async fn leases(&self, env: Option<&str>) -> Result<Vec<Lease>, StoreError> {
        let prefix = match env {
            Some(e) if !valid_env_name(e) => return Err(StoreError::InvalidEnvName(e.to_owned())),
            Some(e) => format!("leases/{e}/"),
            None => "leases/".to_owned(),
        };
        let mut attempts = 0;
        'again: loop {
            attempts += 1;
            let mut out = Vec::new();
            for name in self.backend.list(&prefix).await? {
                let sealed = match self.backend.get(&name, MAX_LEASE_LEN).await {
                    Ok(b) => b,
                    Err(BackendError::NotFound { .. }) if attempts < LEASE_LIST_ATTEMPTS => {
                        continue 'again
                    }
                    // Replaced again and again: its run renews it, and a
                    // newer lease of the run was in the last listing or
                    // comes after it.
                    Err(BackendError::NotFound { .. }) => continue,
                    Err(e) => return Err(e.into()),
                };
                let lease = open_lease(&self.secret, &name, &sealed)
                    .map_err(|source| StoreError::Lease { name, source })?;
                out.push(lease);
            }
            return Ok(out);
        }
    }

    /// Suspends version `version` of environment `env`: reads each image to
    /// its end, uploads the chunks the backend lacks, then writes the sealed
    /// manifest as `manifests/<env>/<version>` (last, so a manifest only
    /// ever names chunks that are stored).
    ///
    /// With `previous` (the last version's manifest, whose chunks must still
    /// be stored), chunks it references are skipped without even an exists
    /// call: an incremental suspend costs one request per changed chunk.
    pub async fn suspend<N, R, I>(
        &self,
        env: &str,
        version: u64,
        images: I,
        previous: Option<&Manifest>,
    ) -> Result<(Manifest, SuspendStats), StoreError>
    where
        N: AsRef<str>,
        R: AsyncRead + Unpin,
        I: IntoIterator<Item = (N, R)>,
    {
        self.suspend_with_progress(env, version, images, previous, &mut |_, _| {})
            .await
    }

    /// [`Store::suspend`], calling `progress` with the image being read and
    /// the totals so far each time a chunk is settled (for a progress bar:
    /// [`SuspendStats::chunks_done`] of the chunks the images' lengths
    /// imply).
    pub async fn suspend_with_progress<N, R, I>(
        &self,
        env: &str,
        version: u64,
        images: I,
        previous: Option<&Manifest>,
        progress: &mut SuspendProgress<'_>,
    ) -> Result<(Manifest, SuspendStats), StoreError>
    where
        N: AsRef<str>,
        R: AsyncRead + Unpin,
        I: IntoIterator<Item = (N, R)>,
    {
        if !valid_env_name(env) {
            return Err(StoreError::InvalidEnvName(env.to_owned()));
        }
        let name = manifest_object_name(env, version);
        if self.backend.exists(&name).await? {
            return Err(StoreError::VersionExists {
                env: env.to_owned(),
                version,
            });
        }
        let unchanged: HashSet<[u8; 32]> = previous
            .map(|m| m.chunks().map(|c| c.id).collect())
            .unwrap_or_default();
        let mut seen = HashSet::new();
        let mut stats = SuspendStats::default();
        let mut manifest = Manifest {
            env: env.to_owned(),
            version,
            images: Vec::new(),
        };
        for (image, mut reader) in images {
            // Checked before the image is read, not when the manifest is
            // sealed after every upload.
            let image_err = |source| StoreError::Manifest {
                env: env.to_owned(),
                version,
                source,
            };
            let index = manifest.images.len();
            if !valid_image_name(image.as_ref()) {
                return Err(image_err(ManifestError::BadImageName { index }));
            }
            if manifest.image(image.as_ref()).is_some() {
                return Err(image_err(ManifestError::DuplicateImage {
                    name: image.as_ref().to_owned(),
                }));
            }
            let entry = self
                .put_chunks(
                    image.as_ref(),
                    &mut reader,
                    &unchanged,
                    &mut seen,
                    &mut stats,
                    progress,
                )
                .await?;
            manifest.images.push(entry);
        }
        let manifest_err = |source| StoreError::Manifest {
            env: env.to_owned(),
            version,
            source,
        };
        let sealed = seal_manifest(&self.secret, &manifest).map_err(manifest_err)?;
        if !self.backend.put_if_absent(&name, sealed).await? {
            return Err(StoreError::VersionExists {
                env: env.to_owned(),
                version,
            });
        }
        Ok((manifest, stats))
    }

    /// Reads and opens the manifest of `env` version `version`.
    pub async fn load_manifest(&self, env: &str, version: u64) -> Result<Manifest, StoreError> {
        if !valid_env_name(env) {
            return Err(StoreError::InvalidEnvName(env.to_owned()));
        }
        let sealed = match self
            .backend
            .get(&manifest_object_name(env, version), MAX_MANIFEST_LEN)
            .await
        {
            Ok(b) => b,
            Err(BackendError::NotFound { .. }) => {
                return Err(StoreError::ManifestMissing {
                    env: env.to_owned(),
                    version,
                })
            }
            Err(e) => return Err(e.into()),
        };
        open_manifest(&self.secret, env, version, &sealed).map_err(|source| StoreError::Manifest {
            env: env.to_owned(),
            version,
            source,
        })
    }

    /// The versions of `env` that have a manifest, ascending.
    pub async fn versions(&self, env: &str) -> Result<Vec<u64>, StoreError> {
        if !valid_env_name(env) {
            return Err(StoreError::InvalidEnvName(env.to_owned()));
        }
        let prefix = format!("manifests/{env}/");
        let mut versions: Vec<u64> = self
            .backend
            .list(&prefix)
            .await?
            .iter()
            .filter_map(|n| n.strip_prefix(&prefix)?.parse().ok())
            .collect();
        versions.sort_unstable();
        Ok(versions)
    }

    /// Deletes the manifest of `env` version `version` (its chunks stay
    /// until a [`Store::gc`] that does not keep it); returns whether it
    /// existed.
    pub async fn delete_manifest(&self, env: &str, version: u64) -> Result<bool, StoreError> {
        if !valid_env_name(env) {
            return Err(StoreError::InvalidEnvName(env.to_owned()));
        }
        Ok(self
            .backend
            .delete(&manifest_object_name(env, version))
            .await?)
    }

    /// Fetches, verifies and returns chunk `index` of `image` (demand
    /// fetch). The bytes are returned only if the AEAD tag, the length and
    /// the plaintext's SHA-256 all match the manifest.
    pub async fn read_chunk(
        &self,
        manifest: &Manifest,
        image: &str,
        index: u64,
    ) -> Result<Vec<u8>, StoreError> {
        self.fetch_chunk(manifest, image, index, None)
            .await
            .map(|(bytes, _)| bytes)
    }

    /// Chunk `index` of `image`, from `lookaside` if a file there holds it
    /// and its bytes pass the hash check now, else fetched from the backend
    /// and verified as [`Store::read_chunk`] does.
    async fn fetch_chunk(
        &self,
        manifest: &Manifest,
        image: &str,
        index: u64,
        lookaside: Option<&Lookaside>,
    ) -> Result<(Vec<u8>, Source), StoreError> {
        let entry = manifest
            .image(image)
            .ok_or_else(|| StoreError::NoSuchImage(image.to_owned()))?;
        let (Some(len), Some(chunk)) = (
            entry.chunk_len(index),
            usize::try_from(index)
                .ok()
                .and_then(|i| entry.chunks.get(i)),
        ) else {
            return Err(StoreError::ChunkOutOfRange {
                image: image.to_owned(),
                index,
                chunks: entry.chunks.len() as u64,
            });
        };
        let found = match lookaside {
            Some(l) => l.read_async(chunk, len).await,
            None => LookasideRead::Absent,
        };
        let rejected = match found {
            LookasideRead::Found(bytes) => return Ok((bytes, Source::Lookaside)),
            LookasideRead::Rejected => true,
            LookasideRead::Absent => false,
        };
        let object = match self
            .backend
            .get(&object_name(&chunk.id), MAX_CHUNK_OBJECT_LEN)
            .await
        {
            Ok(o) => o,
            Err(BackendError::TooLarge { len, .. }) => {
                return Err(StoreError::ChunkCorrupt {
                    image: image.to_owned(),
                    index,
                    id: chunk.id_hex(),
                    fault: ChunkFault::TooLong { len },
                })
            }
            Err(BackendError::NotFound { .. }) => {
                return Err(StoreError::ChunkMissing {
                    image: image.to_owned(),
                    index,
                    id: chunk.id_hex(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        let object_len = object.len() as u64;
        let bytes = open_chunk(&self.secret, chunk, len, &object).map_err(|fault| {
            StoreError::ChunkCorrupt {
                image: image.to_owned(),
                index,
                id: chunk.id_hex(),
                fault,
            }
        })?;
        Ok((
            bytes,
            Source::Store {
                object_len,
                rejected,
            },
        ))
    }

    /// Writes image `image` of `manifest` to `writer`, every chunk verified
    /// ([`Store::read_chunk`]) before its bytes are written; returns the
    /// bytes written. On a corrupt or missing chunk the writer holds the
    /// chunks before it only.
    pub async fn restore_image<W: AsyncWrite + Unpin>(
        &self,
        manifest: &Manifest,
        image: &str,
        writer: &mut W,
    ) -> Result<u64, StoreError> {
        self.restore_image_with_progress(manifest, image, writer, &mut |_| {})
            .await
    }

    /// [`Store::restore_image`], calling `progress` with the bytes written
    /// so far after each chunk is written.
    pub async fn restore_image_with_progress<W: AsyncWrite + Unpin>(
        &self,
        manifest: &Manifest,
        image: &str,
        writer: &mut W,
        progress: &mut (dyn FnMut(u64) + Send + '_),
    ) -> Result<u64, StoreError> {
        self.restore_image_from(manifest, image, writer, None, &mut |s| progress(s.bytes))
            .await
            .map(|s| s.bytes)
    }

    /// [`Store::restore_image_with_progress`], taking each chunk from
    /// `lookaside` when a file there holds it (checked against the
    /// manifest's hash as it is read; see [`Lookaside`]) and from the
    /// backend otherwise. `progress` gets the counts after each chunk is
    /// written; the result is the image's counts: where its chunks came
    /// from and how many bytes crossed from the backend.
    pub async fn restore_image_from<W: AsyncWrite + Unpin>(
        &self,
        manifest: &Manifest,
        image: &str,
        writer: &mut W,
        lookaside: Option<&Lookaside>,
        progress: &mut (dyn FnMut(&RestoreStats) + Send + '_),
    ) -> Result<RestoreStats, StoreError> {
        let entry = manifest
            .image(image)
            .ok_or_else(|| StoreError::NoSuchImage(image.to_owned()))?;
        let write_err = |source| StoreError::ImageWrite {
            image: image.to_owned(),
            source,
        };
        // Up to RESTORE_WINDOW chunks are fetched at once (a remote store's
        // latency is paid once per window, not per chunk); they are written
        // in order.
        let mut chunks = futures_util::stream::iter(0..entry.chunks.len() as u64)
            .map(|index| self.fetch_chunk(manifest, image, index, lookaside))
            .buffered(RESTORE_WINDOW);
        let mut stats = RestoreStats::default();
        while let Some(chunk) = chunks.next().await {
            let (bytes, source) = chunk?;
            writer.write_all(&bytes).await.map_err(write_err)?;
            let len = bytes.len() as u64;
            stats.chunks += 1;
            stats.bytes += len;
            match source {
                Source::Lookaside => {
                    stats.chunks_lookaside += 1;
                    stats.bytes_lookaside += len;
                }
                Source::Store {
                    object_len,
                    rejected,
                } => {
                    stats.chunks_fetched += 1;
                    stats.bytes_fetched += len;
                    stats.object_bytes_fetched += object_len;
                    stats.chunks_rejected += u64::from(rejected);
                }
            }
            progress(&stats);
        }
        writer.flush().await.map_err(write_err)?;
        Ok(stats)
    }

    /// Deletes every chunk object that no manifest in `keep` and no live
    /// trickle lease (at `now`) references, deletes the stale leases, and
    /// reports what it did. Manifests are not touched. The chunks are
    /// listed before the leases are read, and a running environment leases
    /// a chunk before it uploads it, so a chunk written back while gc runs
    /// is either in a lease gc reads or not in its listing: never deleted.
    /// Must not run while a suspend to this store is under way (its new
    /// chunks are in no manifest yet).
    pub async fn gc(&self, keep: &[Manifest], now: SystemTime) -> Result<GcReport, StoreError> {
        let now_ms = now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let referenced: HashSet<String> = keep
            .iter()
            .flat_map(|m| m.chunks())
            .map(|c| c.object_name())
            .collect();
        let listed = self.backend.list("chunks/").await?;
        let mut report = GcReport::default();
        let mut leased: HashSet<String> = HashSet::new();
        for lease in self.leases(None).await? {
            if lease.is_live(now_ms) {
                report.leases_live += 1;
                leased.extend(lease.chunks.iter().map(object_name));
            } else {
                let name = lease.object_name();
                self.backend.delete(&name).await?;
                report.leases_expired.push(name);
            }
        }
        report.leases_expired.sort();
        for name in listed {
            report.chunks_examined += 1;
            if referenced.contains(&name) {
                report.chunks_kept += 1;
            } else if leased.contains(&name) {
                report.chunks_kept += 1;
                report.chunks_leased += 1;
            } else {
                self.backend.delete(&name).await?;
                report.deleted.push(name);
            }
        }
        Ok(report)
    }
}
