//! Demand fetch of a VM's disk (`roam resume --vm --demand-fetch`): an
//! image of a stored version served to QEMU over NBD from a Unix socket,
//! its chunks fetched from the store when the guest first touches them and
//! the rest filled in behind it — the paper's demand-fetch policy with
//! fully proactive background fill.
//!
//! A [`DemandImage`] is a cache file in DIR (sparse, the image's full size,
//! under a hidden name until it is complete) and a per-chunk state: absent
//! or present, clean or dirty. A read of an absent chunk fetches it through
//! the [`Fetch`] it was given (in roam: lookaside first, then the store,
//! every chunk checked against the manifest exactly as copy-in checks it),
//! writes it into the cache file and marks it present. A write to an absent
//! chunk fetches it first unless the write covers the whole chunk, then
//! goes to the cache file and marks the chunk dirty. Each chunk has its own
//! lock, held across the fetch: concurrent readers of one missing chunk
//! fetch it once, and the background fill never overwrites a chunk the
//! guest already wrote. [`DemandImage::fill`] fetches the remaining chunks
//! in order, a few at once; [`DemandImage::finish`] renames the complete
//! file to its image name, an ordinary file a later `roam suspend --vm`
//! reads.
//!
//! The guest's fetches come before the fill's. All fill workers but one
//! start no new chunk while a demand fetch is in flight or was in the last
//! [`DEMAND_HOLD`]: a guest touching its disk or memory finds at most one
//! background chunk ahead of its own on the link, not [`FILL_WINDOW`] of
//! them (at 1 Mbit/s a 128 KiB chunk is a second of waiting each). The one
//! worker that never waits keeps the fill going under a guest that never
//! stops faulting.
//!
//! The NBD protocol is `roam_nbd`'s sans-IO codec; [`serve`] drives it over
//! each accepted connection, one request at a time (replies in order). The
//! cache file is read and written with positioned I/O of at most 32 MiB per
//! request straight from the async tasks: a local file, not worth a thread
//! hop per request here.
//!
//! Every write also queues its chunks for trickle write-back
//! ([`DemandImage::take_settled`]): `roam resume --trickle` uploads the
//! chunks the guest has left alone for a while (`store::trickle`), and a
//! chunk written again after that is queued again.
//!
//! Non-goals: keeping the present map across a crash of roam (the hidden
//! cache file is then left, never taken for a complete image).

use std::collections::BTreeMap;
use std::future::Future;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use roam_nbd::{
    decode_request, encode_simple_reply, Command, Export, Handshake, HandshakeEvent, CMD_FLAG_FUA,
    EINVAL, EIO,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex;

/// Chunks the background fill fetches at once (8, as copy-in's window: a
/// remote store's latency is paid once per window, not once per chunk).
const FILL_WINDOW: usize = 8;

/// How long after a demand fetch the background fill stays at one chunk in
/// flight (1 s: a guest's faults come in bursts, and the next one should
/// not find a full window of background chunks queued ahead of it).
const DEMAND_HOLD: Duration = Duration::from_secs(1);

/// How often a held fill worker looks again (50 ms).
const HOLD_POLL: Duration = Duration::from_millis(50);

/// One fetched chunk: its verified bytes and whether they came from a
/// lookaside file (else from the store).
pub(crate) type Fetched = (Vec<u8>, bool);

/// Fetches chunk `index` of the image, verified; the error is one line for
/// the user.
pub(crate) type Fetch =
    Arc<dyn Fn(u64) -> Pin<Box<dyn Future<Output = Result<Fetched, String>> + Send>> + Send + Sync>;

/// Why a chunk was fetched (for the counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// A read or partial write of the guest needed it.
    Demand,
    /// The background fill.
    Background,
}

/// One chunk's state, behind its own lock.
#[derive(Debug, Default)]
struct ChunkState {
    /// Its bytes are in the cache file.
    present: bool,
    /// The guest wrote to it.
    dirty: bool,
}

/// Counts of what a [`DemandImage`] fetched.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DemandCounts {
    /// Chunks present in the cache file.
    pub(crate) present: u64,
    /// Chunks fetched for the guest (reads, partial writes).
    pub(crate) demand_chunks: u64,
    /// Bytes of those.
    pub(crate) demand_bytes: u64,
    /// Chunks fetched by the background fill.
    pub(crate) background_chunks: u64,
    /// Bytes of those.
    pub(crate) background_bytes: u64,
    /// Chunks (either kind) that came from a lookaside file.
    pub(crate) lookaside_chunks: u64,
    /// Chunks the guest wrote.
    pub(crate) dirty: u64,
}

/// An image served on demand (module docs).
pub(crate) struct DemandImage {
    /// The image's name (the NBD export's name too).
    name: String,
    /// Its length in bytes.
    len: u64,
    /// Chunk size in bytes (the store's, 128 KiB).
    chunk_size: u64,
    /// The cache file.
    file: std::fs::File,
    /// Where the cache file is while incomplete.
    tmp: PathBuf,
    /// Where it goes when complete.
    target: PathBuf,
    /// Per-chunk state, one lock each.
    chunks: Vec<Mutex<ChunkState>>,
    /// Gets a chunk's verified bytes.
    fetch: Fetch,
    /// [`DemandCounts::present`].
    present: AtomicU64,
    /// [`DemandCounts::demand_chunks`].
    demand_chunks: AtomicU64,
    /// [`DemandCounts::demand_bytes`].
    demand_bytes: AtomicU64,
    /// [`DemandCounts::background_chunks`].
    background_chunks: AtomicU64,
    /// [`DemandCounts::background_bytes`].
    background_bytes: AtomicU64,
    /// [`DemandCounts::lookaside_chunks`].
    lookaside_chunks: AtomicU64,
    /// [`DemandCounts::dirty`].
    dirty: AtomicU64,
    /// Called with a line for the user when a fetch fails.
    report: Arc<dyn Fn(&str) + Send + Sync>,
    /// Demand fetches in flight (the fill holds back while any is).
    demand_in_flight: AtomicU64,
    /// When the last demand fetch ended (the fill holds back for
    /// [`DEMAND_HOLD`] after it); `None` before the first.
    last_demand: std::sync::Mutex<Option<Instant>>,
    /// Chunks written since they were last taken for trickle write-back,
    /// with the time of their last write (a chunk is taken once it has
    /// rested; see [`DemandImage::take_settled`]). Changed only under the
    /// chunk's own lock, so a write after a take queues the chunk again.
    unsent: std::sync::Mutex<BTreeMap<u64, Instant>>,
}

/// A chunk taken for trickle write-back: its index and its bytes as they
/// were when taken.
pub(crate) struct Settled {
    /// The chunk's index in the image.
    pub(crate) index: u64,
    /// Its bytes (a consistent copy: taken under the chunk's lock).
    pub(crate) bytes: Vec<u8>,
}

impl DemandImage {
    /// Creates the cache file `tmp` (mode 0600, sparse, `len` bytes) for
    /// image `name` of `chunk_size`-byte chunks, renamed to `target` by
    /// [`DemandImage::finish`].
    pub(crate) fn create(
        name: &str,
        len: u64,
        chunk_size: u64,
        (tmp, target): (&Path, &Path),
        fetch: Fetch,
        report: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Result<DemandImage, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(tmp)
            .and_then(|f| f.set_len(len).map(|()| f))
            .map_err(|e| format!("cannot create the cache file {}: {e}", tmp.display()))?;
        let n = len.div_ceil(chunk_size);
        Ok(DemandImage {
            name: name.to_owned(),
            len,
            chunk_size,
            file,
            tmp: tmp.to_owned(),
            target: target.to_owned(),
            chunks: (0..n).map(|_| Mutex::new(ChunkState::default())).collect(),
            fetch,
            present: AtomicU64::new(0),
            demand_chunks: AtomicU64::new(0),
            demand_bytes: AtomicU64::new(0),
            background_chunks: AtomicU64::new(0),
            background_bytes: AtomicU64::new(0),
            lookaside_chunks: AtomicU64::new(0),
            dirty: AtomicU64::new(0),
            report,
            demand_in_flight: AtomicU64::new(0),
            last_demand: std::sync::Mutex::new(None),
            unsent: std::sync::Mutex::new(BTreeMap::new()),
        })
    }

    /// The image's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Where the cache file is while incomplete.
    pub(crate) fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Whether every chunk `[offset, offset + len)` touches is present now
    /// (a chunk being fetched counts as absent).
    pub(crate) fn all_present(&self, offset: u64, len: u64) -> bool {
        self.chunks_of(offset, len).all(|i| {
            self.chunks
                .get(i as usize)
                .and_then(|c| c.try_lock().ok())
                .is_some_and(|s| s.present)
        })
    }

    /// Its chunk count.
    pub(crate) fn chunk_count(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// What was fetched so far.
    pub(crate) fn counts(&self) -> DemandCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DemandCounts {
            present: l(&self.present),
            demand_chunks: l(&self.demand_chunks),
            demand_bytes: l(&self.demand_bytes),
            background_chunks: l(&self.background_chunks),
            background_bytes: l(&self.background_bytes),
            lookaside_chunks: l(&self.lookaside_chunks),
            dirty: l(&self.dirty),
        }
    }

    /// Byte range of chunk `index` in the image.
    fn chunk_range(&self, index: u64) -> (u64, u64) {
        let start = index * self.chunk_size;
        (start, (start + self.chunk_size).min(self.len))
    }

    /// Fetches chunk `index` into the cache file; the caller holds its lock
    /// and it is not present.
    async fn load(&self, index: u64, state: &mut ChunkState, why: Why) -> Result<(), String> {
        let (start, end) = self.chunk_range(index);
        let _demand = (why == Why::Demand).then(|| DemandFetch::new(self));
        let (bytes, lookaside) = (self.fetch)(index).await?;
        if bytes.len() as u64 != end - start {
            return Err(format!(
                "{} chunk {index}: {} bytes fetched, {} expected",
                self.name,
                bytes.len(),
                end - start
            ));
        }
        self.file
            .write_all_at(&bytes, start)
            .map_err(|e| format!("writing {}: {e}", self.tmp.display()))?;
        state.present = true;
        self.present.fetch_add(1, Ordering::Relaxed);
        let (chunks, total) = match why {
            Why::Demand => (&self.demand_chunks, &self.demand_bytes),
            Why::Background => (&self.background_chunks, &self.background_bytes),
        };
        chunks.fetch_add(1, Ordering::Relaxed);
        total.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        if lookaside {
            self.lookaside_chunks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Makes chunk `index` present.
    pub(crate) async fn ensure(&self, index: u64, why: Why) -> Result<(), String> {
        let Some(lock) = self.chunks.get(index as usize) else {
            return Err(format!("{}: no chunk {index}", self.name));
        };
        let mut state = lock.lock().await;
        if state.present {
            return Ok(());
        }
        self.load(index, &mut state, why).await
    }

    /// The chunks `[offset, offset + len)` touches.
    fn chunks_of(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        if len == 0 {
            return 0..0;
        }
        offset / self.chunk_size..(offset + len - 1) / self.chunk_size + 1
    }

    /// `len` bytes at `offset` (in range: the codec checked), fetching the
    /// chunks not present.
    pub(crate) async fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, String> {
        for index in self.chunks_of(offset, u64::from(len)) {
            self.ensure(index, Why::Demand).await?;
        }
        let mut buf = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(|e| format!("reading {}: {e}", self.tmp.display()))?;
        Ok(buf)
    }

    /// Writes `data` at `offset` (or `len` zero bytes when `data` is
    /// `None`); a chunk not present is fetched first unless the write
    /// covers it whole.
    pub(crate) async fn write(
        &self,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
    ) -> Result<(), String> {
        for index in self.chunks_of(offset, len) {
            let (start, end) = self.chunk_range(index);
            let from = offset.max(start);
            let to = (offset + len).min(end);
            let mut state = self.chunks[index as usize].lock().await;
            let whole = from == start && to == end;
            if !state.present && !whole {
                self.load(index, &mut state, Why::Demand).await?;
            }
            let piece = match data {
                Some(d) => {
                    std::borrow::Cow::Borrowed(&d[(from - offset) as usize..(to - offset) as usize])
                }
                None => std::borrow::Cow::Owned(vec![0u8; (to - from) as usize]),
            };
            self.file
                .write_all_at(&piece, from)
                .map_err(|e| format!("writing {}: {e}", self.tmp.display()))?;
            if !state.present {
                state.present = true;
                self.present.fetch_add(1, Ordering::Relaxed);
            }
            if !state.dirty {
                state.dirty = true;
                self.dirty.fetch_add(1, Ordering::Relaxed);
            }
            self.unsent_map().insert(index, Instant::now());
        }
        Ok(())
    }

    /// The trickle queue, a poisoned lock taken as is (its map stays
    /// consistent: every change is one insert or remove).
    fn unsent_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Instant>> {
        self.unsent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Chunks written since they were last taken for write-back.
    pub(crate) fn unsent(&self) -> u64 {
        self.unsent_map().len() as u64
    }

    /// Takes the lowest chunk written since it was last taken whose last
    /// write is at least `rest` before `now`, with its bytes, out of the
    /// trickle queue; `None` if no chunk has rested that long. A write to
    /// it after this queues it again.
    pub(crate) async fn take_settled(
        &self,
        now: Instant,
        rest: Duration,
    ) -> Result<Option<Settled>, String> {
        loop {
            let candidate = self
                .unsent_map()
                .iter()
                .find(|(_, at)| now.saturating_duration_since(**at) >= rest)
                .map(|(i, _)| *i);
            let Some(index) = candidate else {
                return Ok(None);
            };
            let Some(lock) = self.chunks.get(index as usize) else {
                self.unsent_map().remove(&index);
                continue;
            };
            let _state = lock.lock().await;
            {
                // Written again since it was picked: not rested any more.
                let mut unsent = self.unsent_map();
                match unsent.get(&index) {
                    Some(at) if now.saturating_duration_since(*at) >= rest => {
                        unsent.remove(&index);
                    }
                    _ => continue,
                }
            }
            let (start, end) = self.chunk_range(index);
            let mut bytes = vec![0u8; (end - start) as usize];
            if let Err(e) = self.file.read_exact_at(&mut bytes, start) {
                self.unsent_map().insert(index, now);
                return Err(format!("reading {}: {e}", self.tmp.display()));
            }
            return Ok(Some(Settled { index, bytes }));
        }
    }

    /// Puts chunk `index` back in the trickle queue (its upload failed),
    /// unless a write queued it again meanwhile.
    pub(crate) fn requeue(&self, index: u64, written: Instant) {
        self.unsent_map().entry(index).or_insert(written);
    }

    /// Makes the cache file's writes durable.
    pub(crate) fn flush(&self) -> Result<(), String> {
        self.file
            .sync_data()
            .map_err(|e| format!("syncing {}: {e}", self.tmp.display()))
    }

    /// How long the background fill's extra workers should still hold
    /// back for the guest's fetches: `Some` while a demand fetch is in
    /// flight ([`HOLD_POLL`]) or ended less than [`DEMAND_HOLD`] ago (the
    /// rest of it); `None` when the fill may use its whole window.
    fn demand_hold(&self) -> Option<Duration> {
        if self.demand_in_flight.load(Ordering::Acquire) > 0 {
            return Some(HOLD_POLL);
        }
        let last = *self.last_demand.lock().unwrap_or_else(|p| p.into_inner());
        let left = DEMAND_HOLD.checked_sub(last?.elapsed())?;
        (!left.is_zero()).then_some(left.min(HOLD_POLL))
    }

    /// Fetches every chunk not yet present (the background fill), in order
    /// with [`FILL_WINDOW`] chunks in flight, one while the guest fetches
    /// (module docs); the first failure ends it.
    pub(crate) async fn fill(self: &Arc<Self>) -> Result<(), String> {
        let next = Arc::new(AtomicU64::new(0));
        let mut workers = tokio::task::JoinSet::new();
        for worker in 0..FILL_WINDOW {
            let (image, next) = (self.clone(), next.clone());
            workers.spawn(async move {
                loop {
                    // Worker 0 never holds back: the fill always moves.
                    while let Some(wait) = image.demand_hold().filter(|_| worker > 0) {
                        tokio::time::sleep(wait).await;
                    }
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= image.chunk_count() {
                        return Ok(());
                    }
                    image.ensure(index, Why::Background).await?;
                }
            });
        }
        let mut failed = None;
        while let Some(done) = workers.join_next().await {
            let done = done.unwrap_or_else(|e| Err(format!("a fill task failed: {e}")));
            if let (Err(e), None) = (done, &failed) {
                // The other workers stop at their next chunk.
                next.store(u64::MAX / 2, Ordering::Relaxed);
                failed = Some(e);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// After [`DemandImage::fill`]: syncs the cache file and renames it to
    /// the image's name.
    pub(crate) fn finish(&self) -> Result<PathBuf, String> {
        let present = self.present.load(Ordering::Relaxed);
        if present != self.chunk_count() {
            return Err(format!(
                "{}: only {present} of {} chunks present; not renamed",
                self.name,
                self.chunk_count()
            ));
        }
        self.file
            .sync_all()
            .map_err(|e| format!("syncing {}: {e}", self.tmp.display()))?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| {
            format!(
                "cannot rename {} to {}: {e}",
                self.tmp.display(),
                self.target.display()
            )
        })?;
        Ok(self.target.clone())
    }
}

/// A demand fetch in flight, counted in [`DemandImage::demand_in_flight`]
/// until dropped (also when the fetch fails or its future is dropped),
/// which stamps [`DemandImage::last_demand`].
struct DemandFetch<'a>(&'a DemandImage);

impl<'a> DemandFetch<'a> {
    /// Counts one more demand fetch in flight on `image`.
    fn new(image: &'a DemandImage) -> Self {
        image.demand_in_flight.fetch_add(1, Ordering::AcqRel);
        DemandFetch(image)
    }
}

impl Drop for DemandFetch<'_> {
    fn drop(&mut self) {
        *self.0.last_demand.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.0.demand_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `image` as an NBD export (named after the image; the default
/// export `""` is the same image) to every client of `listener` until
/// the task is aborted.
pub(crate) async fn serve(listener: UnixListener, image: Arc<DemandImage>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let image = image.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &image).await {
                (image.report)(&format!("NBD client of {}: {e}", image.name));
            }
        });
    }
}

/// Reads more bytes into `buf`; `false` at the end of the stream.
async fn read_more(stream: &mut UnixStream, buf: &mut Vec<u8>) -> Result<bool, String> {
    let mut chunk = [0u8; 64 * 1024];
    let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

/// One NBD client: handshake, then requests until it disconnects.
async fn connection(mut stream: UnixStream, image: &DemandImage) -> Result<(), String> {
    let export = |name: &str| Export {
        name: name.to_owned(),
        size: image.len,
        read_only: false,
    };
    let mut out = Vec::new();
    let mut hs = Handshake::new(vec![export(&image.name), export("")], &mut out);
    let mut buf = Vec::new();
    loop {
        stream.write_all(&out).await.map_err(|e| e.to_string())?;
        out.clear();
        let (used, event) = hs.handle(&buf, &mut out).map_err(|e| e.to_string())?;
        buf.drain(..used);
        match event {
            HandshakeEvent::NeedMore => {
                stream.write_all(&out).await.map_err(|e| e.to_string())?;
                out.clear();
                if !read_more(&mut stream, &mut buf).await? {
                    return Ok(());
                }
            }
            HandshakeEvent::Closed => {
                stream.write_all(&out).await.map_err(|e| e.to_string())?;
                return Ok(());
            }
            HandshakeEvent::Transmission { .. } => {
                stream.write_all(&out).await.map_err(|e| e.to_string())?;
                out.clear();
                break;
            }
        }
    }
    loop {
        let decoded = decode_request(&buf, image.len, false).map_err(|e| e.to_string())?;
        let Some(d) = decoded else {
            if !read_more(&mut stream, &mut buf).await? {
                return Ok(());
            }
            continue;
        };
        let consumed = d.consumed;
        match d.request {
            Err(refusal) => {
                (image.report)(&format!("NBD request refused: {}", refusal.reason));
                encode_simple_reply(refusal.cookie, refusal.errno, &[], &mut out);
            }
            Ok(r) => {
                let result = match r.command {
                    Command::Disc => return Ok(()),
                    Command::Read => image.read(r.offset, r.len).await,
                    Command::Write => image
                        .write(r.offset, u64::from(r.len), Some(d.payload))
                        .await
                        .map(|()| Vec::new()),
                    Command::WriteZeroes => image
                        .write(r.offset, u64::from(r.len), None)
                        .await
                        .map(|()| Vec::new()),
                    // Trim is advisory: the data stays as it was.
                    Command::Trim => Ok(Vec::new()),
                    Command::Flush => image.flush().map(|()| Vec::new()),
                };
                let result = result.and_then(|data| {
                    if r.flags & CMD_FLAG_FUA != 0 && r.command != Command::Read {
                        image.flush()?;
                    }
                    Ok(data)
                });
                match result {
                    Ok(data) => encode_simple_reply(r.cookie, 0, &data, &mut out),
                    Err(e) => {
                        (image.report)(&format!(
                            "NBD {:?} of {} bytes at offset {} of {} failed (an I/O error for QEMU, \
                             never the data): {e}",
                            r.command, r.len, r.offset, image.name
                        ));
                        let errno = if e.contains("no chunk") { EINVAL } else { EIO };
                        encode_simple_reply(r.cookie, errno, &[], &mut out);
                    }
                }
            }
        }
        buf.drain(..consumed);
        stream.write_all(&out).await.map_err(|e| e.to_string())?;
        out.clear();
    }
}

pub(crate) mod fuse;

#[cfg(test)]
mod tests;
