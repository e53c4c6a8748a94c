//! The demand-fetch NBD server against QEMU's own NBD client (`qemu-io`,
//! `qemu-img` from qemu-utils), every byte compared with the image, and
//! against a real roam store with a tampered chunk. Without qemu-utils
//! the client tests say why and pass.

use std::process::Command;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use roam_store::{ChunkBackend, LocalDir, Store, UserSecret, CHUNK_SIZE};

use super::*;

/// 9.5 chunks of 128 KiB: the last chunk is short.
const LEN: usize = 9 * 128 * 1024 + 64 * 1024;

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_be_bytes()[1])
        .collect()
}

fn have_qemu_utils() -> bool {
    let ok = ["qemu-io", "qemu-img"].iter().all(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !ok {
        eprintln!("SKIP: qemu-io/qemu-img not installed (Debian: qemu-utils)");
    }
    ok
}

/// An image over `source`, served on a socket in `dir`; counts fetches.
struct Served {
    image: Arc<DemandImage>,
    sock: PathBuf,
    fetches: Arc<AtomicUsize>,
    reports: Arc<StdMutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn serve_bytes(dir: &Path, source: Arc<Vec<u8>>, bad_chunk: Option<u64>) -> Served {
    let fetches = Arc::new(AtomicUsize::new(0));
    let counter = fetches.clone();
    let fetch: Fetch = Arc::new(move |index| {
        let source = source.clone();
        let counter = counter.clone();
        Box::pin(async move {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
            if Some(index) == bad_chunk {
                return Err(format!("chunk {index} is corrupt: tag mismatch"));
            }
            let start = index as usize * CHUNK_SIZE;
            let end = (start + CHUNK_SIZE).min(source.len());
            Ok((source[start..end].to_vec(), false))
        })
    });
    serve_with(dir, LEN as u64, fetch, fetches)
}

fn serve_with(dir: &Path, len: u64, fetch: Fetch, fetches: Arc<AtomicUsize>) -> Served {
    let reports = Arc::new(StdMutex::new(Vec::new()));
    let r = reports.clone();
    let image = Arc::new(
        DemandImage::create(
            "disk.img",
            len,
            CHUNK_SIZE as u64,
            (&dir.join(".disk.img.part"), &dir.join("disk.img")),
            fetch,
            Arc::new(move |line: &str| r.lock().unwrap().push(line.to_owned())),
        )
        .unwrap(),
    );
    let sock = dir.join("nbd.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let task = tokio::spawn(serve(listener, image.clone()));
    Served {
        image,
        sock,
        fetches,
        reports,
        task,
    }
}

fn uri(sock: &Path) -> String {
    format!("nbd+unix:///disk.img?socket={}", sock.display())
}

/// `qemu-io` with commands `cmds` on the export; (success, output).
async fn qemu_io(sock: &Path, cmds: &[&str]) -> (bool, String) {
    let mut cmd = tokio::process::Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    let out = cmd
        .arg(uri(sock))
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && !text.contains("failed"), text)
}

/// The whole export read by `qemu-img convert`.
async fn read_all(sock: &Path, dir: &Path) -> Vec<u8> {
    let out_file = dir.join("copy.raw");
    let out = tokio::process::Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(uri(sock))
        .arg(&out_file)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "qemu-img convert: {out:?}");
    std::fs::read(&out_file).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_reads_and_writes_every_byte_through_demand_fetch() {
    if !have_qemu_utils() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let source = Arc::new(pattern(LEN));
    let s = serve_bytes(tmp.path(), source.clone(), None);
    let mut expect = (*source).clone();

    // A small read fetches the one chunk it touches, and the bytes match.
    let (ok, text) = qemu_io(&s.sock, &["read -v 131072 16"]).await;
    assert!(ok, "{text}");
    let hex: String = source[131_072..131_088]
        .iter()
        .map(|b| format!("{b:02x} "))
        .collect();
    assert!(text.contains(hex.trim_end()), "{text}\nwants {hex}");
    assert_eq!(s.image.counts().present, 1);
    assert_eq!(s.image.counts().demand_chunks, 1);

    // Writes: a partial one into an absent chunk (fetched first), one
    // across a chunk boundary, one covering chunk 5 whole (not fetched),
    // zeroes into the short last chunk; each checked by qemu-io's pattern read.
    let cs = CHUNK_SIZE;
    let writes: [(usize, usize, u8); 3] = [
        (3 * cs + 100, 5000, 0xab),
        (2 * cs - 512, 1024, 0xcd),
        (5 * cs, cs, 0xef),
    ];
    for (off, len, pat) in writes {
        let (ok, text) = qemu_io(
            &s.sock,
            &[
                &format!("write -P {pat:#x} {off} {len}"),
                &format!("read -P {pat:#x} {off} {len}"),
            ],
        )
        .await;
        assert!(ok, "{text}");
        expect[off..off + len].fill(pat);
    }
    let (ok, text) = qemu_io(&s.sock, &[&format!("write -z {} 4096", 9 * cs + 4096)]).await;
    assert!(ok, "{text}");
    expect[9 * cs + 4096..9 * cs + 8192].fill(0);
    let c = s.image.counts();
    // Chunk 5 was written whole: present and dirty, never fetched.
    // Fetched for the guest: 1 (the read), 3 (partial write), 2 (the
    // boundary write; 1 was present), 9 (zeroes in part of it).
    assert_eq!(c.demand_chunks, 4, "{c:?}");
    assert_eq!(c.dirty, 5, "{c:?}");

    // The whole export, every byte, as QEMU reads it.
    let all = read_all(&s.sock, tmp.path()).await;
    assert_eq!(all.len(), LEN);
    assert!(
        all == expect,
        "the export differs from the image plus the writes"
    );
    let fetched_by_demand = s.fetches.load(Ordering::SeqCst);

    // The background fill fetches nothing twice and skips chunk 5; the
    // finished file is the image plus the writes.
    s.image.fill().await.unwrap();
    let c = s.image.counts();
    assert_eq!(c.present, 10);
    assert_eq!(c.demand_chunks + c.background_chunks, 9, "{c:?}");
    assert_eq!(s.fetches.load(Ordering::SeqCst), 9);
    assert!(fetched_by_demand <= 9);
    let done = s.image.finish().unwrap();
    assert_eq!(std::fs::read(done).unwrap(), expect);
    assert!(!tmp.path().join(".disk.img.part").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_of_a_missing_chunk_fetch_it_once() {
    let tmp = tempfile::tempdir().unwrap();
    let source = Arc::new(pattern(LEN));
    let s = serve_bytes(tmp.path(), source.clone(), None);
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let image = s.image.clone();
        tasks.push(tokio::spawn(async move {
            image.read(4 * CHUNK_SIZE as u64 + i * 1000, 777).await
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let got = t.await.unwrap().unwrap();
        let at = 4 * CHUNK_SIZE + i * 1000;
        assert_eq!(got, source[at..at + 777]);
    }
    assert_eq!(s.fetches.load(Ordering::SeqCst), 1);
    // A fill racing reads still fetches each chunk once.
    let image = s.image.clone();
    let fill = tokio::spawn(async move { image.fill().await });
    let got = s.image.read(0, LEN as u32).await.unwrap();
    fill.await.unwrap().unwrap();
    assert!(got == *source);
    assert_eq!(s.fetches.load(Ordering::SeqCst), 10);
}

/// What the slow link of [`the_guests_fetches_pass_the_fill`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnLink {
    /// Chunk N was asked for.
    Asked(u64),
    /// Chunk N went over the link.
    Sent(u64),
}

/// The guest's fetches come before the fill's: over a link that carries
/// one chunk at a time, in the order asked (a slow store), a guest read in
/// the middle of the fill finds the fill's whole window ahead of it the
/// first time, and at most the one background chunk of the fill's unheld
/// worker while it goes on fetching. The fill still completes, every chunk
/// fetched once, every byte right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guests_fetches_pass_the_fill() {
    const CHUNKS: u64 = 64;
    let tmp = tempfile::tempdir().unwrap();
    let len = CHUNKS as usize * CHUNK_SIZE;
    let source = Arc::new(pattern(len));
    let link = Arc::new(tokio::sync::Mutex::new(()));
    let log = Arc::new(StdMutex::new(Vec::new()));
    let fetches = Arc::new(AtomicUsize::new(0));
    let fetch: Fetch = {
        let (source, log, counter) = (source.clone(), log.clone(), fetches.clone());
        Arc::new(move |index| {
            let (source, link, log, counter) =
                (source.clone(), link.clone(), log.clone(), counter.clone());
            Box::pin(async move {
                counter.fetch_add(1, Ordering::SeqCst);
                log.lock().unwrap().push(OnLink::Asked(index));
                // tokio's mutex is fair: the link serves in the order asked.
                let wire = link.lock().await;
                tokio::time::sleep(Duration::from_millis(10)).await;
                log.lock().unwrap().push(OnLink::Sent(index));
                drop(wire);
                let start = index as usize * CHUNK_SIZE;
                Ok((source[start..start + CHUNK_SIZE].to_vec(), false))
            })
        })
    };
    let s = serve_with(tmp.path(), len as u64, fetch, fetches);
    let image = s.image.clone();
    let fill = tokio::spawn(async move { image.fill().await });
    let deadline = Instant::now() + Duration::from_secs(20);
    while s.image.counts().background_chunks < 4 {
        assert!(Instant::now() < deadline, "the fill did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Chunks sent ahead of chunk `index`, asked for by the guest.
    let ahead_of = |index: u64| {
        let log = log.lock().unwrap();
        let asked = log.iter().position(|e| *e == OnLink::Asked(index)).unwrap();
        let sent = log.iter().position(|e| *e == OnLink::Sent(index)).unwrap();
        log[asked..sent]
            .iter()
            .filter(|e| matches!(e, OnLink::Sent(_)))
            .count()
    };
    let mut waited = Vec::new();
    for index in [63u64, 62, 61, 60] {
        let at = index * CHUNK_SIZE as u64;
        let got = s.image.read(at, 4096).await.unwrap();
        assert_eq!(got, source[at as usize..at as usize + 4096]);
        waited.push(ahead_of(index));
    }
    assert!(
        waited[0] >= FILL_WINDOW / 2,
        "the first guest read should find the fill's window ahead of it: {waited:?}"
    );
    assert!(
        waited[1..].iter().all(|&n| n <= 2),
        "later guest reads waited behind the fill (chunks sent ahead of each: {waited:?})"
    );
    fill.await.unwrap().unwrap();
    let c = s.image.counts();
    assert_eq!((c.present, c.demand_chunks), (CHUNKS, 4), "{c:?}");
    assert_eq!(s.fetches.load(Ordering::SeqCst), CHUNKS as usize);
    let done = s.image.finish().unwrap();
    assert!(std::fs::read(done).unwrap() == *source);
}

/// The trickle queue: a written chunk is taken once it has rested, with
/// the bytes it holds then; a write after the take queues it again; a
/// chunk still being written is not taken; a failed upload puts it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_chunks_are_taken_for_trickle_once_rested_and_again_after_a_rewrite() {
    let tmp = tempfile::tempdir().unwrap();
    let source = Arc::new(pattern(LEN));
    let s = serve_bytes(tmp.path(), source.clone(), None);
    let rest = Duration::from_millis(300);
    let at = |c: u64| c * CHUNK_SIZE as u64;
    s.image.write(at(2) + 10, 5, Some(b"hello")).await.unwrap();
    s.image.write(at(9), 3, None).await.unwrap();
    assert_eq!(s.image.unsent(), 2);
    // Not rested yet.
    let now = std::time::Instant::now();
    assert!(s.image.take_settled(now, rest).await.unwrap().is_none());
    let later = now + rest;
    let first = s.image.take_settled(later, rest).await.unwrap().unwrap();
    assert_eq!(first.index, 2);
    let mut expect = source[2 * CHUNK_SIZE..3 * CHUNK_SIZE].to_vec();
    expect[10..15].copy_from_slice(b"hello");
    assert!(first.bytes == expect, "chunk 2 as written");
    let last = s.image.take_settled(later, rest).await.unwrap().unwrap();
    assert_eq!(
        (last.index, last.bytes.len()),
        (9, 64 * 1024),
        "short last chunk"
    );
    assert_eq!(&last.bytes[..3], &[0, 0, 0]);
    assert_eq!(s.image.unsent(), 0);
    assert!(s.image.take_settled(later, rest).await.unwrap().is_none());
    // Written again after it went: queued again, with the new bytes.
    s.image.write(at(2) + 10, 5, Some(b"HELLO")).await.unwrap();
    assert_eq!(s.image.unsent(), 1);
    let again = s
        .image
        .take_settled(std::time::Instant::now() + rest, rest)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((again.index, &again.bytes[10..15]), (2, &b"HELLO"[..]));
    // A failed upload puts it back.
    s.image.requeue(2, std::time::Instant::now());
    assert_eq!(s.image.unsent(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fetch_is_an_io_error_for_qemu_and_a_line_for_the_user() {
    if !have_qemu_utils() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let s = serve_bytes(tmp.path(), Arc::new(pattern(LEN)), Some(2));
    let (ok, text) = qemu_io(&s.sock, &[&format!("read {} 4096", 2 * CHUNK_SIZE)]).await;
    assert!(!ok, "the read of a bad chunk succeeded: {text}");
    assert!(text.contains("Input/output error"), "{text}");
    let reports = s.reports.lock().unwrap().join("\n");
    assert!(
        reports.contains("chunk 2 is corrupt") && reports.contains("I/O error"),
        "{reports}"
    );
    // Other chunks still serve, and the fill reports the bad chunk.
    let (ok, text) = qemu_io(&s.sock, &["read 0 4096"]).await;
    assert!(ok, "{text}");
    assert!(s.image.fill().await.is_err());
    assert!(s.image.finish().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_chunk_in_a_real_store_is_refused_on_demand() {
    if !have_qemu_utils() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::new(
        LocalDir::open(tmp.path().join("store")).unwrap(),
        UserSecret::from_bytes([7; 32]),
    ));
    let source = pattern(LEN);
    let (manifest, _) = store
        .suspend("lab", 1, [("disk.img", &source[..])], None)
        .await
        .unwrap();
    // Chunk 6's object replaced by other bytes of the same length.
    let name = manifest.image("disk.img").unwrap().chunks[6].object_name();
    let mut object = store.backend().get(&name, u64::MAX).await.unwrap();
    object[40] ^= 1;
    store.backend().delete(&name).await.unwrap();
    store.backend().put_if_absent(&name, object).await.unwrap();
    let manifest = Arc::new(manifest);
    let fetches = Arc::new(AtomicUsize::new(0));
    let fetch: Fetch = {
        let (store, manifest) = (store.clone(), manifest.clone());
        Arc::new(move |index| {
            let (store, manifest) = (store.clone(), manifest.clone());
            Box::pin(async move {
                store
                    .read_chunk(&manifest, "disk.img", index)
                    .await
                    .map(|b| (b, false))
                    .map_err(|e| e.to_string())
            })
        })
    };
    let s = serve_with(tmp.path(), LEN as u64, fetch, fetches);
    let (ok, text) = qemu_io(&s.sock, &[&format!("read -P 0 {} 512", 6 * CHUNK_SIZE)]).await;
    assert!(!ok && text.contains("Input/output error"), "{text}");
    let reports = s.reports.lock().unwrap().join("\n");
    assert!(
        reports.contains("chunk 6") && reports.contains("corrupt"),
        "{reports}"
    );
    // An untampered chunk reads back exactly.
    let (ok, text) = qemu_io(&s.sock, &["read -v 0 16"]).await;
    assert!(ok, "{text}");
    let data = s
        .image
        .read(5 * CHUNK_SIZE as u64, CHUNK_SIZE as u32)
        .await
        .unwrap();
    assert_eq!(data, source[5 * CHUNK_SIZE..6 * CHUNK_SIZE]);
}

/// `served`'s image mounted at `mnt` (checked to be a mount point), or
/// `None` after saying why it cannot be (no /dev/fuse, no right to mount):
/// the test then passes without it.
fn mount_or_skip(served: &Served, mnt: &Path) -> Option<fuse::MemoryMount> {
    let mount = match fuse::mount(served.image.clone(), mnt, tokio::runtime::Handle::current()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("SKIP: {e}");
            return None;
        }
    };
    assert!(
        fuse::is_mounted(mnt),
        "{} is not a mount point",
        mnt.display()
    );
    Some(mount)
}

/// The memory image as a FUSE file: a one-page read fetches only its own
/// chunk although the kernel reads ahead (refused while absent), every byte
/// reads back, a write marks its chunk dirty, and the mount is gone after
/// the drop. Without the right to mount FUSE (root, /dev/fuse) it says why
/// and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_over_fuse_fetches_only_the_faulting_chunk() {
    use std::os::unix::fs::FileExt as _;
    let tmp = tempfile::tempdir().unwrap();
    let source = Arc::new(pattern(LEN));
    let served = serve_bytes(tmp.path(), source.clone(), None);
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mount) = mount_or_skip(&served, &mnt) else {
        return;
    };
    let file = mnt.join("disk.img");
    let (first, whole, fetched_first) = {
        let (file, fetches) = (file.clone(), served.fetches.clone());
        tokio::task::spawn_blocking(move || {
            let f = std::fs::File::open(&file).unwrap();
            assert_eq!(f.metadata().unwrap().len(), LEN as u64);
            let mut page = vec![0u8; 4096];
            let at = 5 * CHUNK_SIZE as u64 + 8192;
            f.read_exact_at(&mut page, at).unwrap();
            let fetched_first = fetches.load(Ordering::SeqCst);
            let whole = std::fs::read(&file).unwrap();
            (page, whole, fetched_first)
        })
        .await
        .unwrap()
    };
    let at = 5 * CHUNK_SIZE + 8192;
    assert_eq!(first, source[at..at + 4096], "the page read back differs");
    assert_eq!(
        fetched_first, 1,
        "a one-page read fetched {fetched_first} chunks: readahead was not refused"
    );
    assert!(whole == *source, "the whole file read back differs");
    assert_eq!(served.fetches.load(Ordering::SeqCst), 10, "each chunk once");
    {
        let file = file.clone();
        tokio::task::spawn_blocking(move || {
            let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
            f.write_all_at(b"guest page", 3 * CHUNK_SIZE as u64 + 10)
                .unwrap();
            f.sync_all().unwrap();
        })
        .await
        .unwrap();
    }
    assert_eq!(served.image.counts().dirty, 1, "the write's chunk is dirty");
    let cache = std::fs::read(served.image.tmp_path()).unwrap();
    let w = 3 * CHUNK_SIZE + 10;
    assert_eq!(&cache[w..w + 10], b"guest page");
    drop(mount);
    assert!(
        !super::fuse::is_mounted(&mnt),
        "{} is still mounted",
        mnt.display()
    );
}

/// A file of the mount still open when the mount is dropped (`umount`
/// answers `EBUSY`, and the FUSE library's own unmount gives up there):
/// the mount is gone from the tree after the drop all the same, and the
/// open file can still be closed. Without the right to mount FUSE it says
/// why and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_dropped_while_a_file_is_open_still_goes() {
    let tmp = tempfile::tempdir().unwrap();
    let served = serve_bytes(tmp.path(), Arc::new(pattern(LEN)), None);
    // A space in the path: the mount table writes it escaped.
    let mnt = tmp.path().join("mem mnt");
    std::fs::create_dir(&mnt).unwrap();
    let Some(mount) = mount_or_skip(&served, &mnt) else {
        return;
    };
    let file = mnt.join("disk.img");
    let open = tokio::task::spawn_blocking(move || std::fs::File::open(file).unwrap())
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    tokio::task::spawn_blocking(move || drop(mount))
        .await
        .unwrap();
    assert!(
        !super::fuse::is_mounted(&mnt),
        "{} is still mounted after the drop",
        mnt.display()
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the drop took {:?}",
        t0.elapsed()
    );
    drop(open);
}
