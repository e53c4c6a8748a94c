//! Lookaside: chunks of a version taken from local files instead of the
//! store, each accepted only if its plaintext hashes to the manifest's hash.
//!
//! ISR's lookaside cache (Kozuch & Satyanarayanan, §7.2) consults an index
//! of local or portable files by the SHA-1 the server's reply carries;
//! before a local file replaces the fetch, its hash is recomputed, and a
//! mismatch ("version skew" between the file and its index) falls back to
//! the server. A stale or missing device costs time, never correctness.
//!
//! roam's version of it, and why:
//! - **What is indexed**: plain files — an older resumed copy of the
//!   environment's images, a copy on a USB disk, a read-only medium with a
//!   distribution's disk image. Each file is cut at the store's chunk
//!   boundaries (every [`CHUNK_SIZE`] bytes from its start, as a suspend
//!   cuts an image) and each piece's SHA-256 is computed — the same hash
//!   the manifest (ISR's keyring) records for every chunk. A chunk of the
//!   manifest whose hash is found in the index is read from there. The
//!   manifest's SHA-256 is of the plaintext and unkeyed, so no secret is
//!   needed to index, and the index never leaves this process.
//! - **Index at resume, not at suspend**: the paper's tool writes an index
//!   file onto the medium. Here the index is built when the resume starts,
//!   from the files as they are then, and only for hashes the manifest
//!   wants; so there is no index format to keep in step with its files, any
//!   directory works without preparation, and scanning stops once every
//!   wanted chunk is found. The cost is one read of the lookaside files
//!   (local disk speed; SHA-256 at several hundred MB/s).
//! - **Self-validating**: a located chunk is read again at the moment it is
//!   used and its length and SHA-256 checked against the manifest's entry
//!   ([`chunk_matches`]); anything else — the file changed or vanished since the
//!   index was built, a read error — rejects that chunk, which is then
//!   fetched from the store (and verified there as any fetched chunk is).
//!   Nothing read from lookaside is written without that check.
//! - **Aligned only**: pieces are taken at multiples of [`CHUNK_SIZE`] in
//!   each file, as fixed-size chunking makes them; data that moved by a
//!   non-multiple inside a file is not found (content-defined chunking
//!   would find it; the store does not use it).
//!
//! [`LookasideIndex`] is the pure core (fed bytes, answers where a chunk
//! is; no IO); [`Lookaside`] walks directories and reads files around it.
//! A lookaside path that does not exist or cannot be read is reported in
//! [`LookasideScan`], not an error: as with ISR's misplaced media, the
//! resume goes on from the store (the caller decides how loudly to say so).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::chunk::{ChunkRef, CHUNK_SIZE};
use crate::manifest::Manifest;

/// Where a wanted chunk was seen: which source file, and where in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Location {
    /// Index of the source file (its position in the scan's file list).
    pub source: usize,
    /// Byte offset of the chunk in that file (a multiple of [`CHUNK_SIZE`]).
    pub offset: u64,
    /// The chunk's length (at most [`CHUNK_SIZE`]; shorter at a file's end).
    pub len: usize,
}

/// The pure core of lookaside: which plaintext hashes a manifest wants, and
/// where pieces with those hashes were seen. Fed with [`note`]; no IO.
///
/// [`note`]: LookasideIndex::note
#[derive(Debug, Default)]
pub struct LookasideIndex {
    /// (SHA-256, length) of every chunk the manifest names, not yet found:
    /// a piece is recorded only if it is wanted, so the index stays as
    /// small as the manifest whatever the lookaside holds.
    wanted: HashSet<([u8; 32], usize)>,
    /// Where each found chunk is (the first place seen).
    found: HashMap<([u8; 32], usize), Location>,
}

impl LookasideIndex {
    /// An index wanting every chunk of every image of `manifest`.
    pub fn for_manifest(manifest: &Manifest) -> Self {
        let mut wanted = HashSet::new();
        for image in &manifest.images {
            for (i, chunk) in image.chunks.iter().enumerate() {
                if let Some(len) = image.chunk_len(i as u64) {
                    wanted.insert((chunk.hash, len));
                }
            }
        }
        LookasideIndex {
            wanted,
            found: HashMap::new(),
        }
    }

    /// Whether every wanted chunk has been found (scanning can stop).
    pub fn complete(&self) -> bool {
        self.wanted.is_empty()
    }

    /// Chunks found so far (distinct hashes).
    pub fn found(&self) -> usize {
        self.found.len()
    }

    /// Hashes the piece `bytes` seen at `offset` of source `source`, and
    /// records its place if the manifest wants it and it was not seen yet.
    /// Returns whether it was recorded. Pieces longer than [`CHUNK_SIZE`]
    /// are no chunk and are ignored.
    pub fn note(&mut self, source: usize, offset: u64, bytes: &[u8]) -> bool {
        if bytes.is_empty() || bytes.len() > CHUNK_SIZE {
            return false;
        }
        self.note_hashed(source, offset, Sha256::digest(bytes).into(), bytes.len())
    }

    /// [`LookasideIndex::note`] of a piece of `len` bytes whose SHA-256 is
    /// `hash` (computed by the caller).
    fn note_hashed(&mut self, source: usize, offset: u64, hash: [u8; 32], len: usize) -> bool {
        let key = (hash, len);
        if !self.wanted.remove(&key) {
            return false;
        }
        self.found.insert(
            key,
            Location {
                source,
                offset,
                len,
            },
        );
        true
    }

    /// Where a piece that should be `chunk` (of `len` bytes, as the
    /// manifest implies) was seen, if anywhere. The bytes there must still
    /// pass [`chunk_matches`] when read.
    pub fn locate(&self, chunk: &ChunkRef, len: usize) -> Option<Location> {
        self.found.get(&(chunk.hash, len)).copied()
    }
}

/// Whether `bytes` are chunk `chunk` of `len` bytes: its length and the
/// SHA-256 of its plaintext match the manifest's. The one check every
/// chunk taken from lookaside passes before it is used.
pub fn chunk_matches(chunk: &ChunkRef, len: usize, bytes: &[u8]) -> bool {
    bytes.len() == len && <[u8; 32]>::from(Sha256::digest(bytes)) == chunk.hash
}

/// What a scan of the lookaside paths found.
#[derive(Debug, Default)]
pub struct LookasideScan {
    /// Regular files read.
    pub files: u64,
    /// Bytes read from them (a scan stops early once every chunk is found).
    pub bytes_scanned: u64,
    /// Distinct chunks of the manifest found.
    pub chunks_found: u64,
    /// Of those, the ones taken at their places in a directory laid out as
    /// the version's images, unread ([`Lookaside::laid_out_then_scan`]).
    pub by_place: u64,
    /// Paths given that do not exist, or could not be read, with why; the
    /// resume goes on without them.
    pub unusable: Vec<(PathBuf, io::Error)>,
    /// Files and directories under the given paths that could not be read
    /// (permissions, vanished during the scan); skipped.
    pub skipped: u64,
}

/// Lookaside sources for one resume: the index of the files found under the
/// given paths, and those files' paths to read chunks from.
#[derive(Debug)]
pub struct Lookaside {
    /// Where wanted chunks are.
    index: LookasideIndex,
    /// The files, by [`Location::source`] (shared with the blocking reads
    /// of [`Lookaside::read_async`]).
    sources: Vec<Arc<Path>>,
    /// What the scan found.
    scan: LookasideScan,
}

/// Chunks a scan reads from a file at once (32: 4 MiB), then hashes on
/// several threads.
const SCAN_BATCH: usize = 32;

/// Threads a scan hashes on: the machine's parallelism, at most
/// [`SCAN_BATCH`].
fn scan_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(SCAN_BATCH)
}

/// The SHA-256 of each of `pieces`, in order, computed on up to `threads`
/// threads.
fn hash_all(pieces: &[&[u8]], threads: usize) -> Vec<[u8; 32]> {
    let digest = |p: &&[u8]| -> [u8; 32] { Sha256::digest(p).into() };
    if threads <= 1 || pieces.len() <= 1 {
        return pieces.iter().map(digest).collect();
    }
    let per = pieces.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = pieces
            .chunks(per)
            .map(|group| scope.spawn(move || group.iter().map(digest).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl Lookaside {
    /// Indexes the files under `paths` (each a directory, walked without
    /// following symbolic links, or a file) for the chunks of `manifest`.
    /// Only regular files are read (below a directory, links, devices and
    /// FIFOs are passed over; named directly, a device or FIFO is reported
    /// unusable). Blocking: reads up to every byte under
    /// `paths` (run it where blocking is fine, e.g. `spawn_blocking`).
    /// Never fails: what could not be read is in [`Lookaside::scan`].
    pub fn scan(paths: &[PathBuf], manifest: &Manifest) -> Lookaside {
        Lookaside::laid_out_then_scan(&[], paths, manifest)
    }

    /// [`Lookaside::scan`] of `paths`, after taking `laid_out`: directories
    /// that hold `manifest`'s own images under their names (a hoard of this
    /// very version). Their chunks are recorded at their places without
    /// being read now (an image file of another length is passed over);
    /// each is still checked when read, like any other, so an altered one
    /// is fetched from the store. Only what they lack is looked for in
    /// `paths`.
    pub fn laid_out_then_scan(
        laid_out: &[PathBuf],
        paths: &[PathBuf],
        manifest: &Manifest,
    ) -> Lookaside {
        let mut la = Lookaside {
            index: LookasideIndex::for_manifest(manifest),
            sources: Vec::new(),
            scan: LookasideScan::default(),
        };
        for dir in laid_out {
            for image in &manifest.images {
                let path = dir.join(&image.name);
                match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() && m.len() == image.len => {}
                    _ => continue,
                }
                let source = la.sources.len();
                la.sources.push(Arc::from(path.as_path()));
                la.scan.files += 1;
                for (i, chunk) in image.chunks.iter().enumerate() {
                    if let Some(len) = image.chunk_len(i as u64) {
                        let offset = i as u64 * CHUNK_SIZE as u64;
                        if la.index.note_hashed(source, offset, chunk.hash, len) {
                            la.scan.by_place += 1;
                        }
                    }
                }
            }
        }
        let mut buf = vec![0u8; SCAN_BATCH * CHUNK_SIZE];
        for path in paths {
            if let Err(e) = std::fs::symlink_metadata(path).and_then(|_| std::fs::metadata(path)) {
                la.scan.unusable.push((path.clone(), e));
                continue;
            }
            // The path itself may be a symbolic link (a mount point's
            // alias); links below it are not followed.
            let mut stack = vec![path.clone()];
            let mut top = true;
            while let Some(p) = stack.pop() {
                if la.index.complete() {
                    break;
                }
                let meta = if top {
                    std::fs::metadata(&p)
                } else {
                    std::fs::symlink_metadata(&p)
                };
                let meta = match meta {
                    Ok(m) => m,
                    Err(e) if top => {
                        la.scan.unusable.push((p, e));
                        break;
                    }
                    Err(_) => {
                        la.scan.skipped += 1;
                        continue;
                    }
                };
                if meta.is_dir() {
                    match std::fs::read_dir(&p) {
                        Ok(entries) => {
                            let mut children: Vec<PathBuf> =
                                entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
                            // Reverse order on the stack: files are read in
                            // name order.
                            children.sort_unstable_by(|a, b| b.cmp(a));
                            stack.extend(children);
                        }
                        Err(e) if top => la.scan.unusable.push((p, e)),
                        Err(_) => la.scan.skipped += 1,
                    }
                } else if meta.is_file() {
                    match la.index_file(&p, &mut buf) {
                        Ok(()) => {}
                        Err(e) if top => la.scan.unusable.push((p, e)),
                        Err(_) => la.scan.skipped += 1,
                    }
                } else if top {
                    // A device or FIFO named directly: reading one could
                    // block or never end.
                    la.scan.unusable.push((
                        p,
                        io::Error::new(
                            io::ErrorKind::InvalidInput,
                            "not a directory or a regular file",
                        ),
                    ));
                }
                top = false;
            }
        }
        la.scan.chunks_found = la.index.found() as u64;
        la
    }

    /// Reads the file at `path` into the index, [`SCAN_BATCH`] chunks at a
    /// time, the batch's chunks hashed on up to [`scan_threads`] threads
    /// (hashing is most of a scan's time) and noted in file order.
    fn index_file(&mut self, path: &Path, buf: &mut [u8]) -> io::Result<()> {
        let mut file = File::open(path)?;
        let source = self.sources.len();
        self.sources.push(Arc::from(path));
        self.scan.files += 1;
        let mut offset = 0u64;
        let threads = scan_threads();
        while !self.index.complete() {
            let n = read_full(&mut file, buf)?;
            if n == 0 {
                break;
            }
            self.scan.bytes_scanned += n as u64;
            let pieces: Vec<&[u8]> = buf[..n].chunks(CHUNK_SIZE).collect();
            for (piece, hash) in pieces.iter().zip(hash_all(&pieces, threads)) {
                self.index.note_hashed(source, offset, hash, piece.len());
                offset += piece.len() as u64;
            }
            if n < buf.len() {
                break;
            }
        }
        Ok(())
    }

    /// What the scan found.
    pub fn scan_report(&self) -> &LookasideScan {
        &self.scan
    }

    /// The index (for tests and reports).
    pub fn index(&self) -> &LookasideIndex {
        &self.index
    }

    /// Chunk `chunk` (of `len` bytes) from a lookaside file, if the index
    /// knows a place for it: `Found(bytes)` only if the bytes read there now
    /// pass [`chunk_matches`]; `Rejected` if a place was known but its bytes did
    /// not (changed since the scan, unreadable); `Absent` otherwise.
    /// Blocking (one read of at most [`CHUNK_SIZE`] bytes from a local
    /// file); async code uses [`Lookaside::read_async`].
    pub fn read(&self, chunk: &ChunkRef, len: usize) -> LookasideRead {
        match self.place(chunk, len) {
            Some((path, offset)) => read_checked(&path, offset, *chunk, len),
            None => LookasideRead::Absent,
        }
    }

    /// [`Lookaside::read`] on tokio's blocking threads, so reading and
    /// hashing several chunks overlap (a restore keeps several in flight)
    /// and the async threads never wait on the disk.
    pub async fn read_async(&self, chunk: &ChunkRef, len: usize) -> LookasideRead {
        let Some((path, offset)) = self.place(chunk, len) else {
            return LookasideRead::Absent;
        };
        let chunk = *chunk;
        tokio::task::spawn_blocking(move || read_checked(&path, offset, chunk, len))
            .await
            .unwrap_or(LookasideRead::Rejected)
    }

    /// The file and offset the index has for `chunk`, if any.
    fn place(&self, chunk: &ChunkRef, len: usize) -> Option<(Arc<Path>, u64)> {
        let loc = self.index.locate(chunk, len)?;
        Some((self.sources.get(loc.source)?.clone(), loc.offset))
    }
}

/// Reads `len` bytes at `offset` of `path`: `Found` only if they are
/// `chunk` ([`chunk_matches`]), else `Rejected`.
fn read_checked(path: &Path, offset: u64, chunk: ChunkRef, len: usize) -> LookasideRead {
    let bytes = (|| {
        let mut file = File::open(path)?;
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = vec![0u8; len];
        let n = read_full(&mut file, &mut bytes)?;
        bytes.truncate(n);
        Ok::<_, io::Error>(bytes)
    })();
    match bytes {
        Ok(bytes) if chunk_matches(&chunk, len, &bytes) => LookasideRead::Found(bytes),
        _ => LookasideRead::Rejected,
    }
}

/// What [`Lookaside::read`] found for one chunk.
#[derive(Debug, PartialEq, Eq)]
pub enum LookasideRead {
    /// The chunk's plaintext, verified against the manifest.
    Found(Vec<u8>),
    /// A place was indexed, but what is there now is not the chunk (the
    /// file changed or cannot be read): fetch it from the store.
    Rejected,
    /// No lookaside file holds the chunk: fetch it from the store.
    Absent,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{chunk_ref, UserSecret};
    use crate::manifest::ImageEntry;

    /// The batch's hashes come back in the pieces' order whatever the
    /// number of threads (a piece noted at the wrong offset would be a
    /// rejected chunk at every read).
    #[test]
    fn batch_hashes_keep_the_pieces_order() {
        let data: Vec<u8> = (0..7 * 1000u32).map(|i| (i * 31 % 251) as u8).collect();
        let pieces: Vec<&[u8]> = data.chunks(1000).collect();
        let one: Vec<[u8; 32]> = pieces.iter().map(|p| Sha256::digest(p).into()).collect();
        for threads in 1..=9 {
            assert_eq!(hash_all(&pieces, threads), one, "{threads} threads");
        }
        assert!(hash_all(&[], 2).is_empty());
    }

    fn manifest_of(secret: &UserSecret, image: &[u8]) -> Manifest {
        Manifest {
            env: "e".into(),
            version: 1,
            images: vec![ImageEntry {
                name: "disk".into(),
                len: image.len() as u64,
                chunks: image
                    .chunks(CHUNK_SIZE)
                    .map(|c| chunk_ref(secret, c))
                    .collect(),
            }],
        }
    }

    #[test]
    fn index_records_only_wanted_pieces_once() {
        let s = UserSecret::from_bytes([1; 32]);
        let image: Vec<u8> = (0..CHUNK_SIZE * 2 + 10).map(|i| (i % 253) as u8).collect();
        let m = manifest_of(&s, &image);
        let mut index = LookasideIndex::for_manifest(&m);
        assert!(!index.complete());
        assert!(!index.note(0, 0, b"not a chunk"));
        assert!(!index.note(0, 0, &[]));
        assert!(!index.note(0, 0, &vec![0u8; CHUNK_SIZE + 1]));
        assert!(index.note(3, 0, &image[..CHUNK_SIZE]));
        assert!(!index.note(4, 0, &image[..CHUNK_SIZE]), "seen already");
        let tail = &image[2 * CHUNK_SIZE..];
        assert!(index.note(3, 7, tail));
        let c0 = m.images[0].chunks[0];
        assert_eq!(
            index.locate(&c0, CHUNK_SIZE),
            Some(Location {
                source: 3,
                offset: 0,
                len: CHUNK_SIZE
            })
        );
        assert_eq!(index.locate(&c0, 10), None, "length is part of the key");
        assert!(index.note(3, 1, &image[CHUNK_SIZE..2 * CHUNK_SIZE]));
        assert!(index.complete());
        assert_eq!(index.found(), 3);
    }

    /// A directory laid out as the version's images: every chunk taken at
    /// its place unread, and read back when used; an altered chunk is
    /// refused when read; an image of another length is not taken by
    /// place, and the scan of the other paths finds its chunks instead.
    #[test]
    fn a_laid_out_directory_is_taken_by_place_and_checked_when_read() {
        let s = UserSecret::from_bytes([3; 32]);
        let image: Vec<u8> = (0..CHUNK_SIZE * 3 + 99)
            .map(|i| (i * 7 % 249) as u8)
            .collect();
        let m = manifest_of(&s, &image);
        let tmp = tempfile::tempdir().unwrap();
        let (hoard, other) = (tmp.path().join("hoard"), tmp.path().join("other"));
        std::fs::create_dir_all(&hoard).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(hoard.join("disk"), &image).unwrap();
        std::fs::write(other.join("copy"), &image).unwrap();

        let la = Lookaside::laid_out_then_scan(
            std::slice::from_ref(&hoard),
            std::slice::from_ref(&other),
            &m,
        );
        let scan = la.scan_report();
        assert_eq!((scan.by_place, scan.chunks_found), (4, 4));
        assert_eq!(scan.bytes_scanned, 0, "nothing read ahead");
        let entry = &m.images[0];
        for (i, chunk) in entry.chunks.iter().enumerate() {
            let len = entry.chunk_len(i as u64).unwrap();
            match la.read(chunk, len) {
                LookasideRead::Found(b) => {
                    assert_eq!(b, image[i * CHUNK_SIZE..i * CHUNK_SIZE + len], "chunk {i}")
                }
                _ => panic!("chunk {i} not found at its place"),
            }
        }
        let mut altered = image.clone();
        altered[CHUNK_SIZE + 5] ^= 1;
        std::fs::write(hoard.join("disk"), &altered).unwrap();
        assert!(matches!(
            la.read(&entry.chunks[1], CHUNK_SIZE),
            LookasideRead::Rejected
        ));

        // Another length: not this version's image; found by the scan.
        std::fs::write(hoard.join("disk"), &image[..CHUNK_SIZE]).unwrap();
        let la = Lookaside::laid_out_then_scan(
            std::slice::from_ref(&hoard),
            std::slice::from_ref(&other),
            &m,
        );
        let scan = la.scan_report();
        assert_eq!((scan.by_place, scan.chunks_found), (0, 4));
        assert!(matches!(
            la.read(&entry.chunks[2], CHUNK_SIZE),
            LookasideRead::Found(_)
        ));
    }

    #[test]
    fn accept_checks_length_and_hash() {
        let s = UserSecret::from_bytes([2; 32]);
        let c = chunk_ref(&s, b"chunk bytes");
        assert!(chunk_matches(&c, 11, b"chunk bytes"));
        assert!(!chunk_matches(&c, 11, b"chunk bytez"));
        assert!(!chunk_matches(&c, 10, b"chunk byte"));
        assert!(!chunk_matches(&c, 12, b"chunk bytes"));
    }
}
