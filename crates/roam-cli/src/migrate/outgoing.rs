//! The source's images on their way to the destination: each file goes as
//! soon as CRIU closes it during the dump (an inotify watch on the images
//! directory), and the post-dump step sends only what is left, instead of
//! every file inside the freeze.
//!
//! CRIU writes the images of a frozen tree one file after another (at
//! 1,000 connections a `tcp-stream-*.img` per socket while it dumps the
//! files, then the memory's maps, the cores, the process tree and the
//! inventory last) and closes each once written; everything is closed
//! before its post-dump step. A file is read once its writer closed it, so
//! it is whole. One written again after it went (CRIU does not do that
//! today) is noticed by its next close, or by its length or modification
//! time at the post-dump step, and goes again: the destination replaces
//! its copy.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};

use super::source::Outbox;
use super::wire::{self, Frame};
use super::{mb, Progress};

/// Bytes per data frame of a large image.
const CHUNK: usize = 256 << 10;

/// Image files up to this size travel whole, many to a
/// [`Frame::Files`], and are read without leaving the runtime's thread (a
/// blocking-pool trip costs more than the read of a few hundred bytes on
/// a tmpfs).
const SMALL: u64 = 64 << 10;

/// How long the watching thread lets closed files gather before it reads
/// again. Woken for each of 1,000 files, it (and the sending it woke) cut
/// into CRIU's dump at every close: the dump took about 40 ms longer, as
/// long as the sending saved.
const BATCH: std::time::Duration = std::time::Duration::from_millis(5);

/// The files of a directory as their writers close them: a thread reads
/// the inotify watch (blocking; tokio's `AsyncFd` needs `unsafe` to take a
/// descriptor, which this crate forbids) and hands the names over.
pub(crate) struct Closed {
    /// The inotify instance, shared with the reading thread.
    inotify: Arc<Inotify>,
    /// The directory's watch: removed when this is dropped, which ends the
    /// thread (its last event is `IN_IGNORED`).
    wd: WatchDescriptor,
    /// The image files closed, a batch per read.
    rx: tokio::sync::mpsc::UnboundedReceiver<Vec<String>>,
}

impl Closed {
    /// Watches `dir` for files closed after writing (or moved in whole).
    pub(crate) fn watch(dir: &Path) -> std::io::Result<Closed> {
        let inotify = Arc::new(Inotify::init(InitFlags::IN_CLOEXEC)?);
        let wd = inotify.add_watch(
            dir,
            AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO,
        )?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let reader = inotify.clone();
        let spawned = std::thread::Builder::new()
            .name("roam-images-watch".into())
            .spawn(move || {
                // Below the move's -10, where CRIU runs: see `BATCH`.
                let _ = rustix::process::setpriority_process(None, 0);
                loop {
                    match reader.read_events() {
                        Ok(events) => {
                            let ended = events
                                .iter()
                                .any(|e| e.mask.contains(AddWatchFlags::IN_IGNORED));
                            let names = images(events);
                            if !names.is_empty() && tx.send(names).is_err() || ended {
                                return;
                            }
                            std::thread::sleep(BATCH);
                        }
                        Err(nix::errno::Errno::EINTR) => {}
                        Err(_) => return,
                    }
                }
            });
        if let Err(e) = spawned {
            let _ = inotify.rm_watch(wd);
            return Err(e);
        }
        Ok(Closed { inotify, wd, rx })
    }

    /// The image files closed since the last call, waiting for one; `None`
    /// once the watch has ended (the directory went, or an error).
    pub(crate) async fn next(&mut self) -> Option<Vec<String>> {
        self.rx.recv().await
    }
}

impl Drop for Closed {
    fn drop(&mut self) {
        let _ = self.inotify.rm_watch(self.wd);
    }
}

/// The names of image files among `events`, once each, in order: CRIU's
/// logs are not images, and an overflowed queue names nothing (the
/// post-dump step lists the directory anyway).
fn images(events: Vec<InotifyEvent>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in events {
        let Some(name) = e.name else { continue };
        let name = name.to_string_lossy().into_owned();
        if is_image(&name) && !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// Whether a file of the images directory is an image to send: CRIU's
/// logs are not, nor roam's mark of a kept directory.
pub(crate) fn is_image(name: &str) -> bool {
    !roam_criu::is_log(name) && name != super::KEPT_MARK
}

/// During the dump, small images are sent once this many bytes of them
/// wait (at the step, in frames of up to [`wire::MAX_PAYLOAD`]): CRIU
/// closes them a few at a time, and a frame each would cost more than it
/// saves.
const EARLY_FRAME: usize = 64 << 10;

/// The largest image sent during the dump: at 1 GB and 1,000
/// connections a post-copy move's images are 1,000 of about 100 bytes and
/// two of 0.2-1.5 MB (sent during the dump: 8-15 ms less in the freeze).
const EARLY_MAX: u64 = 4 << 20;

/// Which images [`Outgoing::send`] sends, and what it shows.
enum Send<'a> {
    /// Up to [`EARLY_MAX`] bytes, silently (during the dump).
    Early,
    /// Any, updating this progress (with the bytes sent when the step
    /// began, and the total it counts towards).
    Shown(&'a mut Progress, u64, u64),
}

/// How a file looked when it was read: its length and modification time.
type Stamp = (u64, Option<SystemTime>);

/// The images sent so far, and the small ones waiting to fill a frame.
pub(crate) struct Outgoing {
    /// The images directory.
    dir: PathBuf,
    /// Each image sent, as it was when read.
    sent: HashMap<String, Stamp>,
    /// Small images read but not yet sent: they go many to a frame.
    batch: Vec<(String, Vec<u8>)>,
    /// The encoded size of `batch`.
    batch_bytes: usize,
    /// Files and bytes sent before the post-dump step.
    pub(crate) early: (usize, u64),
    /// Bytes sent (or batched) in all.
    bytes: u64,
}

impl Outgoing {
    /// Nothing sent yet from `dir`.
    pub(crate) fn new(dir: &Path) -> Outgoing {
        Outgoing {
            dir: dir.to_path_buf(),
            sent: HashMap::new(),
            batch: Vec::new(),
            batch_bytes: 0,
            early: (0, 0),
            bytes: 0,
        }
    }

    /// Sends the images CRIU closed while it still dumps (`names`, from
    /// [`Closed`]), up to [`EARLY_MAX`] each; small ones wait in the batch
    /// for more. Larger ones (the memory of a move without post-copy) wait
    /// for the post-dump step, where a signal or the destination's refusal
    /// can stop them half-way.
    pub(crate) async fn send_early(
        &mut self,
        wr: &mut Outbox,
        names: &[String],
    ) -> Result<(), String> {
        for name in names {
            let before = self.bytes;
            if self.send(wr, name, Send::Early).await? {
                self.early.0 += 1;
                self.early.1 += self.bytes - before;
            }
        }
        // On their way now, not at the step, once there are enough for a
        // frame worth its cost.
        if self.batch_bytes >= EARLY_FRAME {
            self.flush(wr).await?;
        }
        Ok(())
    }

    /// The post-dump step's part: every image not sent yet, or changed
    /// since it was, then [`Frame::Sent`]. Says how much is left to send
    /// and shows its progress.
    pub(crate) async fn send_rest(
        &mut self,
        wr: &mut Outbox,
        progress: &mut Progress,
        dumped: &str,
    ) -> Result<(), String> {
        let mut left = Vec::new();
        let listing =
            std::fs::read_dir(&self.dir).map_err(|e| format!("cannot list the images: {e}"))?;
        for e in listing {
            let e = e.map_err(|e| format!("cannot list the images: {e}"))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(meta) = e.metadata() else { continue };
            if !meta.is_file() || !is_image(&name) {
                continue;
            }
            if self.sent.get(&name) != Some(&(meta.len(), meta.modified().ok())) {
                left.push((name, meta.len()));
            }
        }
        // In name order, as before the watch: small images of one kind
        // travel together.
        left.sort();
        let total: u64 = left.iter().map(|(_, n)| n).sum();
        progress.phase(&format!(
            "dumped in {dumped}; sending {} files, {} of images{}",
            left.len(),
            mb(total),
            match self.early {
                (0, _) => String::new(),
                (n, b) => format!(" ({n} files, {} sent during the dump)", mb(b)),
            }
        ));
        let start = self.bytes;
        for (name, _) in &left {
            self.send(wr, name, Send::Shown(&mut *progress, start, total))
                .await?;
        }
        self.flush(wr).await?;
        wr.send(&Frame::Sent)
            .await
            .map_err(|e| format!("sending the images failed: {e}"))
    }

    /// Sends one image unless it was sent as it is (or is larger than
    /// `how` allows); whether it was.
    async fn send(&mut self, wr: &mut Outbox, name: &str, how: Send<'_>) -> Result<bool, String> {
        let unreadable = |e: std::io::Error| format!("cannot read image {name}: {e}");
        let mut f = match std::fs::File::open(self.dir.join(name)) {
            Ok(f) => f,
            // Gone again (not an image CRIU keeps): nothing to send.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(unreadable(e)),
        };
        let meta = f.metadata().map_err(unreadable)?;
        let stamp = (meta.len(), meta.modified().ok());
        if !meta.is_file() || self.sent.get(name) == Some(&stamp) {
            return Ok(false);
        }
        let size = meta.len();
        let mut shown = match how {
            Send::Early if size > EARLY_MAX => return Ok(false),
            Send::Early => None,
            Send::Shown(progress, start, total) => Some((progress, start, total)),
        };
        if size <= SMALL {
            let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
            f.read_to_end(&mut bytes).map_err(unreadable)?;
            if bytes.len() as u64 != size {
                return Err(format!("image {name} changed size while it was read"));
            }
            let cost = wire::files_entry_overhead(name) + bytes.len();
            if self.batch_bytes + cost > wire::MAX_PAYLOAD {
                self.flush(wr).await?;
            }
            self.batch_bytes += cost;
            self.batch.push((name.to_string(), bytes));
            self.bytes += size;
        } else {
            // Large ones in chunks, read off the runtime's threads, after
            // the small ones read before them.
            self.flush(wr).await?;
            wr.send(&Frame::File {
                name: name.to_string(),
                size,
            })
            .await
            .map_err(|e| format!("sending the images failed: {e}"))?;
            let mut buf = vec![0u8; CHUNK];
            let mut left = size;
            while left > 0 {
                let want = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
                tokio::task::block_in_place(|| f.read_exact(&mut buf[..want]))
                    .map_err(unreadable)?;
                wr.send(&Frame::Data(buf[..want].to_vec()))
                    .await
                    .map_err(|e| format!("sending the images failed: {e}"))?;
                left -= want as u64;
                self.bytes += want as u64;
                if let Some((progress, start, total)) = shown.as_mut() {
                    progress.bytes(self.bytes - *start, *total);
                }
            }
        }
        self.sent.insert(name.to_string(), stamp);
        Ok(true)
    }

    /// Sends the small images waiting in the batch.
    async fn flush(&mut self, wr: &mut Outbox) -> Result<(), String> {
        if self.batch.is_empty() {
            return Ok(());
        }
        self.batch_bytes = 0;
        wr.send(&Frame::Files(std::mem::take(&mut self.batch)))
            .await
            .map_err(|e| format!("sending the images failed: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::Closed;

    /// The watch's next batch, within 5 s.
    async fn next(w: &mut Closed) -> Option<Vec<String>> {
        tokio::time::timeout(std::time::Duration::from_secs(5), w.next())
            .await
            .expect("an event within 5 s")
    }

    /// The watch names each file once its writer has closed it, not
    /// while it is open, and never a log; it ends when the directory goes.
    #[tokio::test]
    async fn a_file_is_named_once_its_writer_closed_it() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("dir");
        let mut watch = Closed::watch(dir.path()).expect("watch");
        let mut open = std::fs::File::create(dir.path().join("core-1.img")).expect("create");
        open.write_all(b"half").expect("write");
        std::fs::write(dir.path().join("dump.log"), b"log").expect("log");
        std::fs::write(dir.path().join("tcp-stream-1.img"), b"whole").expect("write");
        assert_eq!(
            next(&mut watch).await,
            Some(vec!["tcp-stream-1.img".to_string()])
        );
        drop(open);
        assert_eq!(next(&mut watch).await, Some(vec!["core-1.img".to_string()]));
        drop(dir);
        assert_eq!(
            next(&mut watch).await,
            None,
            "the watch ends with its directory"
        );
    }
}
