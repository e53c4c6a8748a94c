//! roam-store end to end: real images through both real backends — a local
//! directory (and a 1 MiB tmpfs for a full disk) and a real S3 server
//! (s3s-fs, started on a free 127.0.0.1 port) — every byte compared.
//!
//! The images are random from a seed: `ROAM_STORE_SEED` (printed) replays a
//! run. The S3 tests find the server binary through `$ROAM_S3S_FS`
//! (`scripts/s3s-build` builds it); without it they say why and pass. The
//! full-disk test needs root (mount); without it, it says why and passes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use roam_store::{
    chunk_ref, new_run_id, open_chunk, BackendError, ChunkBackend, ChunkFault, Lease, LocalDir,
    Manifest, ManifestError, Store, StoreError, UserSecret, CHUNK_SIZE,
};
use sha2::{Digest, Sha256};

/// The disk image's length: 10 MB, 77 chunks (the last one short).
const DISK_LEN: usize = 10_000_000;
/// The memory image's length: 3 chunks, the last one short.
const MEMORY_LEN: usize = 300_000;
/// Chunk index that is made a copy of [`DUP_OF`]: one repeat in the disk.
const DUP_AT: usize = 10;
/// See [`DUP_AT`].
const DUP_OF: usize = 3;

/// The seed of this run's images (printed, so a failure replays).
fn seed() -> u64 {
    let seed = std::env::var("ROAM_STORE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x15a5_2002);
    eprintln!("ROAM_STORE_SEED={seed}");
    seed
}

/// `len` random bytes from `rng`.
fn random(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    v
}

/// A backend wrapper that counts the calls the store makes.
struct Counting<B> {
    /// The real backend.
    inner: B,
    /// `exists` calls so far.
    exists: AtomicU64,
    /// `put_if_absent` calls so far.
    puts: AtomicU64,
}

impl<B> Counting<B> {
    fn new(inner: B) -> Self {
        Counting {
            inner,
            exists: AtomicU64::new(0),
            puts: AtomicU64::new(0),
        }
    }

    /// (exists, put) calls since the last call of this.
    fn take(&self) -> (u64, u64) {
        (
            self.exists.swap(0, Ordering::Relaxed),
            self.puts.swap(0, Ordering::Relaxed),
        )
    }
}

impl<B: ChunkBackend> ChunkBackend for Counting<B> {
    async fn put_if_absent(&self, name: &str, bytes: Vec<u8>) -> Result<bool, BackendError> {
        self.puts.fetch_add(1, Ordering::Relaxed);
        self.inner.put_if_absent(name, bytes).await
    }
    async fn get(&self, name: &str, max_len: u64) -> Result<Vec<u8>, BackendError> {
        self.inner.get(name, max_len).await
    }
    async fn exists(&self, name: &str) -> Result<bool, BackendError> {
        self.exists.fetch_add(1, Ordering::Relaxed);
        self.inner.exists(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<String>, BackendError> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, name: &str) -> Result<bool, BackendError> {
        self.inner.delete(name).await
    }
}

/// The user secret of the tests' user.
fn alice() -> UserSecret {
    UserSecret::from_bytes([0xa1; 32])
}

/// Restores `image` of `m` and checks it equals `expected`, byte for byte
/// and by SHA-256.
async fn check_restore<B: ChunkBackend>(
    store: &Store<B>,
    m: &Manifest,
    image: &str,
    expected: &[u8],
) {
    let mut out = Vec::new();
    let n = store.restore_image(m, image, &mut out).await.unwrap();
    assert_eq!(n, expected.len() as u64);
    assert_eq!(
        Sha256::digest(&out),
        Sha256::digest(expected),
        "{image}: SHA-256 of the restored image"
    );
    assert!(out == expected, "{image}: restored bytes differ");
}

/// The scenario both backends run: suspend (dedup inside the image),
/// restore, an incremental suspend that uploads exactly the 3 changed
/// chunks and asks nothing about the others, restore of both versions
/// through freshly loaded manifests, gc after dropping version 1.
async fn round_trip_incremental_gc<B: ChunkBackend>(store: &Store<Counting<B>>) {
    let mut rng = SmallRng::seed_from_u64(seed());
    let mut disk = random(&mut rng, DISK_LEN);
    let dup = disk[DUP_OF * CHUNK_SIZE..(DUP_OF + 1) * CHUNK_SIZE].to_vec();
    disk[DUP_AT * CHUNK_SIZE..(DUP_AT + 1) * CHUNK_SIZE].copy_from_slice(&dup);
    let memory = random(&mut rng, MEMORY_LEN);
    let disk_chunks = DISK_LEN.div_ceil(CHUNK_SIZE) as u64;
    let memory_chunks = MEMORY_LEN.div_ceil(CHUNK_SIZE) as u64;
    let total = disk_chunks + memory_chunks;

    // Version 1: everything but the repeated chunk is uploaded.
    let started = Instant::now();
    let (m1, stats) = store
        .suspend(
            "laptop-vm",
            1,
            [("disk", &disk[..]), ("memory", &memory[..])],
            None,
        )
        .await
        .unwrap();
    eprintln!("suspend v1: {stats:?} in {:?}", started.elapsed());
    assert_eq!(stats.chunks_total, total);
    assert_eq!(stats.chunks_repeated, 1, "chunk {DUP_AT} repeats {DUP_OF}");
    assert_eq!(stats.chunks_uploaded, total - 1);
    assert_eq!(stats.chunks_present, 0);
    assert_eq!(stats.bytes_read, (DISK_LEN + MEMORY_LEN) as u64);
    let disk_entry = m1.image("disk").unwrap();
    assert_eq!(disk_entry.len, DISK_LEN as u64);
    assert_eq!(disk_entry.chunks[DUP_AT], disk_entry.chunks[DUP_OF]);
    let chunks_v1: BTreeSet<String> = m1.chunks().map(|c| c.object_name()).collect();
    assert_eq!(chunks_v1.len() as u64, total - 1);
    let listed: BTreeSet<String> = store
        .backend()
        .list("chunks/")
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(listed, chunks_v1, "the backend holds exactly v1's chunks");
    // Random data does not compress: each object is its chunk plus the
    // 2-byte header and the 16-byte tag.
    assert_eq!(
        stats.bytes_uploaded,
        (DISK_LEN + MEMORY_LEN - CHUNK_SIZE) as u64 + 18 * (total - 1)
    );
    // One exists call for the manifest's name, one per distinct chunk.
    assert_eq!(store.backend().take(), (1 + total - 1, total));

    let started = Instant::now();
    check_restore(store, &m1, "disk", &disk).await;
    check_restore(store, &m1, "memory", &memory).await;
    eprintln!("restore v1: {:?}", started.elapsed());

    // Demand fetch of single chunks, including the short last one.
    let last = disk_chunks - 1;
    let got = store.read_chunk(&m1, "disk", last).await.unwrap();
    assert_eq!(got, &disk[last as usize * CHUNK_SIZE..]);
    assert!(matches!(
        store.read_chunk(&m1, "disk", disk_chunks).await,
        Err(StoreError::ChunkOutOfRange { index, chunks, .. }) if index == disk_chunks && chunks == disk_chunks
    ));
    assert!(matches!(
        store.read_chunk(&m1, "swap", 0).await,
        Err(StoreError::NoSuchImage(n)) if n == "swap"
    ));

    // Version 2: 3 chunks changed (the first, one in the middle, the short
    // last one); the memory image unchanged.
    let mut disk2 = disk.clone();
    for index in [0, 20, last as usize] {
        disk2[index * CHUNK_SIZE] ^= 0x5a;
    }
    let (m2, stats) = store
        .suspend(
            "laptop-vm",
            2,
            [("disk", &disk2[..]), ("memory", &memory[..])],
            Some(&m1),
        )
        .await
        .unwrap();
    eprintln!("suspend v2: {stats:?}");
    assert_eq!(stats.chunks_uploaded, 3, "exactly the changed chunks");
    assert_eq!(stats.chunks_unchanged, total - 3);
    assert_eq!(stats.chunks_present, 0);
    assert_eq!(
        store.backend().take(),
        (1 + 3, 3 + 1),
        "no exists call for unchanged chunks (one for the manifest name)"
    );
    // The same version again is refused.
    assert!(matches!(
        store
            .suspend("laptop-vm", 2, [("disk", &disk2[..])], Some(&m2))
            .await,
        Err(StoreError::VersionExists { version: 2, .. })
    ));
    assert_eq!(store.versions("laptop-vm").await.unwrap(), vec![1, 2]);

    // Both versions restore through manifests read back from the backend.
    let loaded1 = store.load_manifest("laptop-vm", 1).await.unwrap();
    let loaded2 = store.load_manifest("laptop-vm", 2).await.unwrap();
    assert_eq!(loaded1, m1);
    assert_eq!(loaded2, m2);
    check_restore(store, &loaded2, "disk", &disk2).await;
    check_restore(store, &loaded2, "memory", &memory).await;
    check_restore(store, &loaded1, "disk", &disk).await;

    // Without v1, gc deletes exactly the 3 chunks only v1 used.
    assert!(store.delete_manifest("laptop-vm", 1).await.unwrap());
    let chunks_v2: BTreeSet<String> = m2.chunks().map(|c| c.object_name()).collect();
    let only_v1: Vec<String> = chunks_v1.difference(&chunks_v2).cloned().collect();
    assert_eq!(only_v1.len(), 3);
    let report = store
        .gc(std::slice::from_ref(&loaded2), SystemTime::now())
        .await
        .unwrap();
    assert_eq!(report.deleted, only_v1);
    assert_eq!(report.chunks_examined, chunks_v1.len() as u64 + 3);
    assert_eq!(report.chunks_kept, chunks_v2.len() as u64);
    let listed: BTreeSet<String> = store
        .backend()
        .list("chunks/")
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(listed, chunks_v2);
    assert!(matches!(
        store.load_manifest("laptop-vm", 1).await,
        Err(StoreError::ManifestMissing { version: 1, .. })
    ));
    assert!(matches!(
        store.read_chunk(&m1, "disk", 0).await,
        Err(StoreError::ChunkMissing { index: 0, .. })
    ));
    check_restore(store, &loaded2, "disk", &disk2).await;
    // A second gc finds nothing to delete.
    assert!(store
        .gc(&[loaded2], SystemTime::now())
        .await
        .unwrap()
        .deleted
        .is_empty());
}

#[tokio::test]
async fn local_dir_round_trip_incremental_gc() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(Counting::new(LocalDir::open(dir.path()).unwrap()), alice());
    round_trip_incremental_gc(&store).await;
    // Nothing left in the temporary-file directory.
    assert_eq!(
        std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
        0
    );
}

/// A small two-image environment suspended as version 1 into `dir`.
async fn small_env(dir: &Path) -> (Store<LocalDir>, Manifest, Vec<u8>) {
    let mut rng = SmallRng::seed_from_u64(seed() ^ 1);
    let disk = random(&mut rng, 5 * CHUNK_SIZE + 17);
    let store = Store::new(LocalDir::open(dir).unwrap(), alice());
    let (m, _) = store
        .suspend("desk", 1, [("disk", &disk[..])], None)
        .await
        .unwrap();
    (store, m, disk)
}

/// Trickle write-back's contract with gc: chunks a running environment
/// wrote back (`put_chunk`, sealed as a suspend seals them) that no
/// manifest references yet survive a gc while their lease is live, are
/// found by the next suspend (uploaded 0 times again), and once the lease
/// is stale gc deletes it and the chunks no version took.
#[tokio::test]
async fn leased_chunks_survive_gc_until_the_lease_is_stale() {
    let dir = tempfile::tempdir().unwrap();
    let (store, m1, disk) = small_env(dir.path()).await;
    let mut rng = SmallRng::seed_from_u64(seed() ^ 0x7e1c);
    // Two chunks of the disk change while the environment runs: both are
    // written back; a third is written back and later overwritten again.
    let mut disk2 = disk.clone();
    let (a, b) = (random(&mut rng, CHUNK_SIZE), random(&mut rng, CHUNK_SIZE));
    disk2[..CHUNK_SIZE].copy_from_slice(&a);
    disk2[CHUNK_SIZE..2 * CHUNK_SIZE].copy_from_slice(&b);
    let overwritten = random(&mut rng, CHUNK_SIZE);
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut lease = Lease {
        env: "desk".into(),
        run: new_run_id().unwrap(),
        seq: 1,
        expires_unix_ms: now_ms + 60_000,
        chunks: [&a, &b, &overwritten]
            .iter()
            .map(|c| store.chunk_ref(c).id)
            .collect(),
    };
    store.write_lease(&lease).await.unwrap();
    let mut trickled = Vec::new();
    for c in [&a, &b, &overwritten] {
        let (chunk, wrote) = store.put_chunk(c).await.unwrap();
        assert!(wrote.is_some(), "a new chunk is uploaded");
        trickled.push(chunk.object_name());
    }
    // gc keeps version 1 and the leased chunks.
    let report = store
        .gc(std::slice::from_ref(&m1), SystemTime::now())
        .await
        .unwrap();
    assert_eq!(report.deleted, Vec::<String>::new());
    assert_eq!((report.chunks_leased, report.leases_live), (3, 1));
    assert!(report.leases_expired.is_empty());
    // The suspend finds the two it needs stored: nothing to upload.
    let (m2, stats) = store
        .suspend("desk", 2, [("disk", &disk2[..])], Some(&m1))
        .await
        .unwrap();
    assert_eq!((stats.chunks_uploaded, stats.chunks_present), (0, 2));
    // The run ends without releasing its lease; once stale, gc deletes it
    // and the overwritten chunk no version references.
    lease.expires_unix_ms = now_ms + 1;
    lease.seq = 2;
    store.write_lease(&lease).await.unwrap();
    assert!(store.delete_lease(&lease_name(&lease, 1)).await.unwrap());
    let later = SystemTime::now() + Duration::from_secs(1);
    let report = store.gc(&[m1, m2], later).await.unwrap();
    assert_eq!(report.deleted, vec![trickled[2].clone()]);
    assert_eq!(report.leases_expired, vec![lease.object_name()]);
    assert_eq!((report.chunks_leased, report.leases_live), (0, 0));
    assert!(store.leases(Some("desk")).await.unwrap().is_empty());
    // A lease sealed with another secret stops gc before it deletes.
    let other = Store::new(
        LocalDir::open(dir.path()).unwrap(),
        UserSecret::from_bytes([3; 32]),
    );
    other.write_lease(&lease).await.unwrap();
    let err = store.gc(&[], SystemTime::now()).await.unwrap_err();
    assert!(
        err.to_string().contains("sealed with another store secret"),
        "{err}"
    );
    assert!(store.backend().exists(&trickled[0]).await.unwrap());
}

/// The object name of `lease` at sequence number `seq`.
fn lease_name(lease: &Lease, seq: u64) -> String {
    roam_store::lease_object_name(&lease.env, &lease.run, seq)
}

#[tokio::test]
async fn tampered_swapped_and_missing_chunks_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let (store, m, disk) = small_env(dir.path()).await;
    let entry = m.image("disk").unwrap().clone();
    let local = store.backend();

    // One flipped bit in chunk 2's object on disk.
    let path2 = local.path_of(&entry.chunks[2].object_name()).unwrap();
    let original = std::fs::read(&path2).unwrap();
    let mut bad = original.clone();
    bad[100] ^= 1;
    std::fs::write(&path2, &bad).unwrap();
    let err = store.read_chunk(&m, "disk", 2).await.unwrap_err();
    let id2 = entry.chunks[2].id_hex();
    match &err {
        StoreError::ChunkCorrupt {
            image,
            index,
            id,
            fault,
        } => {
            assert_eq!((image.as_str(), *index, id), ("disk", 2, &id2));
            assert_eq!(*fault, ChunkFault::Authentication);
        }
        e => panic!("expected ChunkCorrupt, got {e}"),
    }
    let text = err.to_string();
    assert!(text.contains("chunk 2") && text.contains(&id2), "{text}");
    // A restore stops at chunk 2 with the same error, having written only
    // chunks 0 and 1.
    let mut out = Vec::new();
    assert!(matches!(
        store.restore_image(&m, "disk", &mut out).await,
        Err(StoreError::ChunkCorrupt { index: 2, .. })
    ));
    assert_eq!(out, &disk[..2 * CHUNK_SIZE]);

    // Chunk 4's object copied over chunk 2's: a valid object, the wrong one.
    let path4 = local.path_of(&entry.chunks[4].object_name()).unwrap();
    std::fs::copy(&path4, &path2).unwrap();
    assert!(matches!(
        store.read_chunk(&m, "disk", 2).await,
        Err(StoreError::ChunkCorrupt {
            index: 2,
            fault: ChunkFault::Authentication,
            ..
        })
    ));
    // Truncated.
    std::fs::write(&path2, &original[..10]).unwrap();
    assert!(matches!(
        store.read_chunk(&m, "disk", 2).await,
        Err(StoreError::ChunkCorrupt {
            index: 2,
            fault: ChunkFault::TooShort { len: 10 },
            ..
        })
    ));
    // Longer than any chunk object: refused before it is read whole.
    std::fs::write(&path2, vec![1u8; 300_000]).unwrap();
    assert!(matches!(
        store.read_chunk(&m, "disk", 2).await,
        Err(StoreError::ChunkCorrupt { index: 2, fault: ChunkFault::TooLong { len }, .. })
            if len == roam_store::MAX_CHUNK_OBJECT_LEN + 1
    ));
    // Gone.
    std::fs::remove_file(&path2).unwrap();
    assert!(matches!(
        store.read_chunk(&m, "disk", 2).await,
        Err(StoreError::ChunkMissing { index: 2, ref id, .. }) if *id == id2
    ));
    // Put back: whole again.
    std::fs::write(&path2, &original).unwrap();
    check_restore(&store, &m, "disk", &disk).await;
}

#[tokio::test]
async fn manifest_refused_under_wrong_secret_or_another_name() {
    let dir = tempfile::tempdir().unwrap();
    let (store, m, _) = small_env(dir.path()).await;

    let mallory = Store::new(
        LocalDir::open(dir.path()).unwrap(),
        UserSecret::from_bytes([0xb0; 32]),
    );
    let err = mallory.load_manifest("desk", 1).await.unwrap_err();
    assert!(
        matches!(
            &err,
            StoreError::Manifest {
                source: ManifestError::WrongSecret,
                version: 1,
                ..
            }
        ),
        "{err}"
    );
    eprintln!("wrong secret: {err}");

    // The sealed manifest copied to another version and to another name.
    let sealed = store
        .backend()
        .get("manifests/desk/1", 1 << 20)
        .await
        .unwrap();
    for (env, version) in [("desk", 5), ("office", 1)] {
        let name = format!("manifests/{env}/{version}");
        assert!(store
            .backend()
            .put_if_absent(&name, sealed.clone())
            .await
            .unwrap());
        let err = store.load_manifest(env, version).await.unwrap_err();
        eprintln!("copied to {name}: {err}");
        match err {
            StoreError::Manifest {
                source:
                    ManifestError::Misplaced {
                        sealed_env,
                        sealed_version,
                    },
                ..
            } => assert_eq!((sealed_env.as_str(), sealed_version), ("desk", 1)),
            e => panic!("expected Misplaced, got {e}"),
        }
    }
    // One flipped byte in the sealed body.
    let mut bad = sealed.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    store.backend().delete("manifests/desk/1").await.unwrap();
    store
        .backend()
        .put_if_absent("manifests/desk/1", bad)
        .await
        .unwrap();
    assert!(matches!(
        store.load_manifest("desk", 1).await,
        Err(StoreError::Manifest {
            source: ManifestError::Authentication,
            ..
        })
    ));
    // And the one that was there still opens (sanity of the test itself).
    let path = store.backend().path_of("manifests/desk/1").unwrap();
    std::fs::write(path, &sealed).unwrap();
    assert_eq!(store.load_manifest("desk", 1).await.unwrap(), m);
}

#[tokio::test]
async fn bad_image_names_are_refused_before_any_upload() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(LocalDir::open(dir.path()).unwrap(), alice());
    let bytes = vec![7u8; 3 * CHUNK_SIZE];
    let err = store
        .suspend("vm", 1, [("disk", &bytes[..]), ("disk", &bytes[..1])], None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Manifest { source: ManifestError::DuplicateImage { name }, .. } if name == "disk"),
        "{err}"
    );
    let err = store
        .suspend("vm", 1, [("", &bytes[..])], None)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            StoreError::Manifest {
                source: ManifestError::BadImageName { index: 0 },
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        store.suspend("../x", 1, [("disk", &bytes[..])], None).await,
        Err(StoreError::InvalidEnvName(_))
    ));
    // The first attempt stored the first image's one distinct chunk, no
    // manifest; the empty name was refused before reading anything.
    assert_eq!(store.backend().list("chunks/").await.unwrap().len(), 1);
    assert!(store.versions("vm").await.unwrap().is_empty());
}

#[tokio::test]
async fn another_user_shares_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, m, disk) = small_env(dir.path()).await;
    let bob = Store::new(
        LocalDir::open(dir.path()).unwrap(),
        UserSecret::from_bytes([0xb0; 32]),
    );
    // The same bytes under bob's secret: every chunk uploaded again, under
    // other names.
    let (mb, stats) = bob
        .suspend("bobs-desk", 1, [("disk", &disk[..])], None)
        .await
        .unwrap();
    assert_eq!(stats.chunks_uploaded, stats.chunks_total);
    let a: BTreeSet<_> = m.chunks().map(|c| c.id).collect();
    assert!(mb.chunks().all(|c| !a.contains(&c.id)));
    check_restore(&store, &m, "disk", &disk).await;
    check_restore(&bob, &mb, "disk", &disk).await;
}

/// A tmpfs mounted for one test, unmounted (lazily, so even a busy mount
/// goes) when dropped, even if the test failed.
struct Tmpfs {
    /// The mount point (inside `_dir`).
    path: PathBuf,
    /// Holds the mount point's parent until after the unmount.
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (mount's syntax, e.g. `1m`), or says why not.
    fn mount(size: &str) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed (not root?): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs { path, _dir: dir })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

#[tokio::test]
async fn full_disk_is_an_error_and_leaves_no_partial_object() {
    let fs = match Tmpfs::mount("1m") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let mut rng = SmallRng::seed_from_u64(seed() ^ 2);
    let image = random(&mut rng, 4 * 1024 * 1024);
    let store = Store::new(LocalDir::open(&fs.path).unwrap(), alice());
    let err = store
        .suspend("big", 1, [("disk", &image[..])], None)
        .await
        .unwrap_err();
    let text = err.to_string();
    eprintln!("full disk: {text}");
    let StoreError::Backend(be) = &err else {
        panic!("expected a backend error, got {text}");
    };
    assert!(be.is_storage_full(), "{text}");
    assert!(
        text.contains("No space left") && text.contains("ENOSPC"),
        "{text}"
    );
    assert!(text.contains("chunks/"), "names the object: {text}");
    assert!(
        text.contains(&fs.path.display().to_string()),
        "names the path: {text}"
    );

    // Every object under a final name is whole: each listed chunk opens and
    // verifies; no temporary file is left; no manifest was written.
    let refs: std::collections::HashMap<String, (roam_store::ChunkRef, usize)> = image
        .chunks(CHUNK_SIZE)
        .map(|c| {
            let r = chunk_ref(&alice(), c);
            (r.object_name(), (r, c.len()))
        })
        .collect();
    let listed = store.backend().list("").await.unwrap();
    assert!(!listed.is_empty(), "some chunks fit before the disk filled");
    for name in &listed {
        let (r, len) = refs
            .get(name)
            .unwrap_or_else(|| panic!("unexpected object {name}"));
        let object = store.backend().get(name, 1 << 20).await.unwrap();
        open_chunk(&alice(), r, *len, &object)
            .unwrap_or_else(|f| panic!("{name} is not whole: {f}"));
    }
    assert_eq!(
        std::fs::read_dir(fs.path.join("tmp")).unwrap().count(),
        0,
        "no temporary file left"
    );
    assert!(store.versions("big").await.unwrap().is_empty());
    eprintln!(
        "{} whole chunks stored before the disk filled",
        listed.len()
    );
}

/// The S3 backend's tests (cargo feature `s3`, on by default).
#[cfg(feature = "s3")]
mod s3 {
    use super::*;
    use roam_store::{S3Config, S3};
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
    use std::process::{Child, Stdio};
    use std::time::Duration;

    /// A real S3 server (s3s-fs) on a free 127.0.0.1 port, killed when dropped.
    struct S3Server {
        /// The server process.
        child: Child,
        /// Its data directory (buckets are directories in it).
        root: tempfile::TempDir,
        /// Where it listens.
        addr: SocketAddr,
    }

    /// Access key of the test server.
    const ACCESS_KEY: &str = "roam-test";
    /// Secret key of the test server.
    const SECRET_KEY: &str = "roam-test-secret-key";
    /// The test bucket.
    const BUCKET: &str = "roam";

    impl S3Server {
        /// Starts `$ROAM_S3S_FS`, or says why the S3 tests cannot run.
        fn start() -> Result<S3Server, String> {
            let Some(bin) = std::env::var_os("ROAM_S3S_FS").filter(|v| !v.is_empty()) else {
                return Err(
                    "ROAM_S3S_FS is not set (ROAM_S3S_FS=$(scripts/s3s-build) runs these tests)"
                        .into(),
                );
            };
            // From here on the variable is set: failing to start is a failure.
            let root = tempfile::tempdir().unwrap();
            std::fs::create_dir(root.path().join(BUCKET)).unwrap();
            for _attempt in 0..5 {
                // A free port: bound, then released for the server to take.
                let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                    .and_then(|l| l.local_addr())
                    .unwrap()
                    .port();
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                let mut child = Command::new(&bin)
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
                    .arg(root.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .unwrap_or_else(|e| panic!("ROAM_S3S_FS={bin:?} does not start: {e}"));
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    if TcpStream::connect(addr).is_ok() {
                        return Ok(S3Server { child, root, addr });
                    }
                    if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
                        let _ = child.kill();
                        let _ = child.wait();
                        break; // the port was taken meanwhile: try another
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            panic!("ROAM_S3S_FS={bin:?} did not start listening");
        }

        /// The backend configuration for this server's bucket.
        fn config(&self) -> S3Config {
            S3Config {
                endpoint: format!("http://{}", self.addr),
                bucket: BUCKET.into(),
                region: "us-east-1".into(),
                access_key_id: ACCESS_KEY.into(),
                secret_access_key: SECRET_KEY.into(),
                allow_http: true,
            }
        }
    }

    impl Drop for S3Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn s3_round_trip_incremental_gc() {
        let server = match S3Server::start() {
            Ok(s) => s,
            Err(why) => {
                eprintln!("skipping: {why}");
                return;
            }
        };
        let store = Store::new(Counting::new(S3::new(&server.config()).unwrap()), alice());
        round_trip_incremental_gc(&store).await;

        // A chunk object altered on the server's disk: refused, named.
        let m = store.load_manifest("laptop-vm", 2).await.unwrap();
        let chunk = m.image("memory").unwrap().chunks[1];
        let file = server
            .root
            .path()
            .join(BUCKET)
            .join("chunks")
            .join(chunk.id_hex());
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[50] ^= 0x10;
        std::fs::write(&file, &bytes).unwrap();
        let err = store.read_chunk(&m, "memory", 1).await.unwrap_err();
        assert!(
            matches!(&err, StoreError::ChunkCorrupt { index: 1, id, fault: ChunkFault::Authentication, .. } if *id == chunk.id_hex()),
            "{err}"
        );
        // Another user's store on the same bucket cannot open the manifest.
        let other = Store::new(
            S3::new(&server.config()).unwrap(),
            UserSecret::from_bytes([0xb0; 32]),
        );
        assert!(matches!(
            other.load_manifest("laptop-vm", 2).await,
            Err(StoreError::Manifest {
                source: ManifestError::WrongSecret,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn s3_wrong_credentials_are_a_remote_error() {
        let server = match S3Server::start() {
            Ok(s) => s,
            Err(why) => {
                eprintln!("skipping: {why}");
                return;
            }
        };
        let mut config = server.config();
        config.secret_access_key = "not-the-key".into();
        let backend = S3::new(&config).unwrap();
        let err = backend.exists("chunks/00").await.unwrap_err();
        eprintln!("wrong credentials: {err}");
        assert!(
            matches!(err, BackendError::Remote { op: "head", .. }),
            "{err}"
        );
    }
}
