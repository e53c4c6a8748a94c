//! Lookaside end to end: two versions suspended into a real local directory
//! store, then restored with real lookaside directories — the same
//! version's files (fresh), the older version's (stale), a copy with
//! tampered chunks, a copy changed after it was indexed, a path that does
//! not exist. Every restored image is compared with the version's
//! original by SHA-256 and byte for byte, and every backend read is
//! counted, so "taken locally" is checked against what the store sent.
//!
//! The images are random from a seed: `ROAM_STORE_SEED` (printed) replays
//! a run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use roam_store::{
    BackendError, ChunkBackend, LocalDir, Lookaside, Manifest, RestoreStats, Store, UserSecret,
    CHUNK_SIZE,
};
use sha2::{Digest, Sha256};

/// The disk image: 64 chunks of 128 KiB.
const DISK_LEN: usize = 64 * CHUNK_SIZE;
/// The memory image: 3 chunks, the last one short.
const MEMORY_LEN: usize = 300_000;
/// Disk chunks rewritten between version 1 and version 2.
const CHANGED_DISK: [usize; 3] = [5, 20, 40];

/// The seed of this run's images (printed, so a failure replays).
fn seed() -> u64 {
    let seed = std::env::var("ROAM_STORE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x100c_a51d);
    eprintln!("ROAM_STORE_SEED={seed}");
    seed
}

/// `len` random bytes from `rng`.
fn random(rng: &mut SmallRng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    v
}

/// A backend that counts the chunk objects read from it.
struct CountingGets<B> {
    /// The real backend.
    inner: B,
    /// `get` calls for `chunks/` objects so far.
    chunk_gets: AtomicU64,
}

impl<B: ChunkBackend> ChunkBackend for CountingGets<B> {
    async fn put_if_absent(&self, name: &str, bytes: Vec<u8>) -> Result<bool, BackendError> {
        self.inner.put_if_absent(name, bytes).await
    }
    async fn get(&self, name: &str, max_len: u64) -> Result<Vec<u8>, BackendError> {
        if name.starts_with("chunks/") {
            self.chunk_gets.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.get(name, max_len).await
    }
    async fn exists(&self, name: &str) -> Result<bool, BackendError> {
        self.inner.exists(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<String>, BackendError> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, name: &str) -> Result<bool, BackendError> {
        self.inner.delete(name).await
    }
}

/// Two versions of a disk and a memory image, suspended into a store in a
/// temporary directory, with the files of each version kept on disk.
struct Fixture {
    /// Holds every directory below.
    root: tempfile::TempDir,
    /// The store.
    store: Store<CountingGets<LocalDir>>,
    /// Version 1's files (`disk`, `memory`): a stale lookaside for v2.
    v1_dir: PathBuf,
    /// Version 2's files: a fresh lookaside for v2.
    v2_dir: PathBuf,
    /// Version 2's images, (name, bytes).
    v2: Vec<(&'static str, Vec<u8>)>,
    /// Version 2's manifest.
    m2: Manifest,
}

/// Writes `images` into a new directory `dir`.
fn write_dir(dir: &Path, images: &[(&'static str, Vec<u8>)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, bytes) in images {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

impl Fixture {
    async fn new() -> Fixture {
        let mut rng = SmallRng::seed_from_u64(seed());
        let root = tempfile::tempdir().unwrap();
        let store = Store::new(
            CountingGets {
                inner: LocalDir::open(root.path().join("store")).unwrap(),
                chunk_gets: AtomicU64::new(0),
            },
            UserSecret::from_bytes([0x1a; 32]),
        );
        let v1 = vec![
            ("disk", random(&mut rng, DISK_LEN)),
            ("memory", random(&mut rng, MEMORY_LEN)),
        ];
        let mut v2 = v1.clone();
        for i in CHANGED_DISK {
            v2[0].1[i * CHUNK_SIZE..(i + 1) * CHUNK_SIZE]
                .copy_from_slice(&random(&mut rng, CHUNK_SIZE));
        }
        // The memory image's first chunk changes too.
        v2[1].1[..CHUNK_SIZE].copy_from_slice(&random(&mut rng, CHUNK_SIZE));
        let (m1, _) = store
            .suspend("lab", 1, v1.iter().map(|(n, b)| (*n, b.as_slice())), None)
            .await
            .unwrap();
        let (m2, stats) = store
            .suspend(
                "lab",
                2,
                v2.iter().map(|(n, b)| (*n, b.as_slice())),
                Some(&m1),
            )
            .await
            .unwrap();
        assert_eq!(stats.chunks_uploaded, CHANGED_DISK.len() as u64 + 1);
        let v1_dir = root.path().join("v1");
        let v2_dir = root.path().join("v2");
        write_dir(&v1_dir, &v1);
        write_dir(&v2_dir, &v2);
        Fixture {
            root,
            store,
            v1_dir,
            v2_dir,
            v2,
            m2,
        }
    }

    /// Chunks in version 2 (both images).
    fn chunks(&self) -> u64 {
        self.m2.images.iter().map(|i| i.chunks.len() as u64).sum()
    }

    /// Restores every image of version 2 with `lookaside`, checks each
    /// against the original by SHA-256 and byte for byte, checks that the
    /// store sent exactly the chunks the counts say, and returns the totals.
    async fn restore_checked(&self, lookaside: Option<&Lookaside>) -> RestoreStats {
        let before = self.store.backend().chunk_gets.load(Ordering::Relaxed);
        let mut total = RestoreStats::default();
        for (name, expected) in &self.v2 {
            let mut out = Vec::new();
            let mut last = RestoreStats::default();
            let stats = self
                .store
                .restore_image_from(&self.m2, name, &mut out, lookaside, &mut |s| last = *s)
                .await
                .unwrap();
            assert_eq!(stats, last, "{name}: the last progress is the result");
            assert_eq!(stats.bytes, expected.len() as u64, "{name}: length");
            assert_eq!(
                hex::encode(Sha256::digest(&out)),
                hex::encode(Sha256::digest(expected)),
                "{name}: SHA-256 of the restored image"
            );
            assert!(out == *expected, "{name}: restored bytes differ");
            assert_eq!(stats.chunks, stats.chunks_lookaside + stats.chunks_fetched);
            assert_eq!(stats.bytes, stats.bytes_lookaside + stats.bytes_fetched);
            total.add(&stats);
        }
        let gets = self.store.backend().chunk_gets.load(Ordering::Relaxed) - before;
        assert_eq!(gets, total.chunks_fetched, "backend reads = chunks fetched");
        assert_eq!(total.chunks, self.chunks());
        total
    }
}

/// The same version's files as lookaside: every chunk is taken locally,
/// the store sends nothing.
#[tokio::test]
async fn fresh_lookaside_takes_every_chunk_locally() {
    let f = Fixture::new().await;
    let la = Lookaside::scan(std::slice::from_ref(&f.v2_dir), &f.m2);
    let scan = la.scan_report();
    assert!(scan.unusable.is_empty(), "{:?}", scan.unusable);
    assert_eq!(scan.files, 2);
    let s = f.restore_checked(Some(&la)).await;
    eprintln!("fresh: {s:?}");
    assert_eq!(s.chunks_lookaside, f.chunks());
    assert!(
        s.bytes_lookaside * 10 >= s.bytes * 9,
        "≥ 90 % taken locally"
    );
    assert_eq!(s.chunks_fetched, 0);
    assert_eq!(s.object_bytes_fetched, 0);
    assert_eq!(s.chunks_rejected, 0);
}

/// The older version's files: result is the new version; only the chunks
/// that changed come from the store.
#[tokio::test]
async fn stale_lookaside_hits_only_unchanged_chunks() {
    let f = Fixture::new().await;
    let la = Lookaside::scan(std::slice::from_ref(&f.v1_dir), &f.m2);
    let s = f.restore_checked(Some(&la)).await;
    eprintln!("stale: {s:?}");
    let changed = CHANGED_DISK.len() as u64 + 1;
    assert_eq!(s.chunks_fetched, changed);
    assert_eq!(s.chunks_lookaside, f.chunks() - changed);
    assert_eq!(s.bytes_fetched, changed * CHUNK_SIZE as u64);
    assert!(
        s.object_bytes_fetched >= s.bytes_fetched,
        "random: no shrink"
    );
    assert_eq!(s.chunks_rejected, 0);
}

/// A lookaside copy whose chunks were tampered with before the resume:
/// those chunks are not found there and come from the store.
#[tokio::test]
async fn tampered_lookaside_chunks_come_from_the_store() {
    let f = Fixture::new().await;
    let dir = f.root.path().join("tampered");
    write_dir(&dir, &f.v2);
    let mut disk = f.v2[0].1.clone();
    disk[7 * CHUNK_SIZE + 100] ^= 0x01;
    disk[30 * CHUNK_SIZE] ^= 0x80;
    std::fs::write(dir.join("disk"), &disk).unwrap();
    // The memory file cut short: its last, short chunk is gone.
    std::fs::write(dir.join("memory"), &f.v2[1].1[..2 * CHUNK_SIZE]).unwrap();
    let la = Lookaside::scan(std::slice::from_ref(&dir), &f.m2);
    let s = f.restore_checked(Some(&la)).await;
    assert_eq!(s.chunks_fetched, 3);
    assert_eq!(s.chunks_lookaside, f.chunks() - 3);
}

/// Files changed after they were indexed (the paper's version skew): the
/// bytes read at use no longer hash to the manifest's, so they are refused
/// and fetched; a file removed after the scan likewise. This is the check
/// that keeps lookaside from ever writing wrong data.
#[tokio::test]
async fn lookaside_changed_after_indexing_is_refused_per_chunk() {
    let f = Fixture::new().await;
    let dir = f.root.path().join("skewed");
    write_dir(&dir, &f.v2);
    let la = Lookaside::scan(std::slice::from_ref(&dir), &f.m2);
    assert_eq!(la.index().found() as u64, f.chunks());
    let mut disk = f.v2[0].1.clone();
    for i in [2, 9, 63] {
        disk[i * CHUNK_SIZE + 5] ^= 0xff;
    }
    std::fs::write(dir.join("disk"), &disk).unwrap();
    std::fs::remove_file(dir.join("memory")).unwrap();
    let s = f.restore_checked(Some(&la)).await;
    eprintln!("skewed: {s:?}");
    assert_eq!(s.chunks_rejected, 3 + 3);
    assert_eq!(s.chunks_fetched, 3 + 3);
    assert_eq!(s.chunks_lookaside, f.chunks() - 6);
}

/// A lookaside path that does not exist is reported, not fatal; a file
/// given directly (not a directory) is used; subdirectories are walked.
#[tokio::test]
async fn missing_path_is_reported_and_files_and_subdirectories_work() {
    let f = Fixture::new().await;
    let missing = f.root.path().join("no-such-dir");
    let nested = f.root.path().join("media/a/b");
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::write(nested.join("disk.img"), &f.v2[0].1).unwrap();
    let la = Lookaside::scan(
        &[
            missing.clone(),
            f.root.path().join("media"),
            f.v1_dir.join("memory"),
        ],
        &f.m2,
    );
    let scan = la.scan_report();
    assert_eq!(scan.unusable.len(), 1, "{:?}", scan.unusable);
    assert_eq!(scan.unusable[0].0, missing);
    assert_eq!(scan.unusable[0].1.kind(), std::io::ErrorKind::NotFound);
    let s = f.restore_checked(Some(&la)).await;
    // The disk from media/, the memory's two unchanged chunks from v1.
    assert_eq!(s.chunks_fetched, 1);
    // A device named directly is refused, not read.
    let la = Lookaside::scan(&[PathBuf::from("/dev/zero")], &f.m2);
    let scan = la.scan_report();
    assert_eq!(scan.unusable.len(), 1);
    assert_eq!(scan.unusable[0].1.kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(scan.files, 0);
    // Only a missing path: everything from the store, still correct.
    let la = Lookaside::scan(&[missing], &f.m2);
    let s = f.restore_checked(Some(&la)).await;
    assert_eq!(s.chunks_lookaside, 0);
    assert_eq!(s.chunks_fetched, f.chunks());
}
