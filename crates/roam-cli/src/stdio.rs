//! Standard input and output for sessions that can detach (`roam pipe
//! --name`): each is served by a thread that can be stopped at any moment
//! without losing a byte. A stopped reader has handed over every byte it took
//! from stdin (nothing waits in a buffer of tokio's or the kernel's that
//! would be dropped with the process); a stopped writer hands back every
//! byte it did not write. Both go into the detached session's record, to be
//! sent, or printed, first after the re-attach.
//!
//! The threads never block for long in a system call: they `poll` with a
//! short timeout, and look at the stop flag between polls. A read or write
//! only follows a poll that said it would not block (for a pipe, a write of
//! at most `PIPE_BUF` bytes after `POLLOUT` does not).

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::poll::{poll, PollFd, PollFlags};
use tokio::sync::mpsc;

/// Bytes taken from stdin per read.
const READ_CHUNK: usize = 64 * 1024;
/// Bytes written to stdout per write: `PIPE_BUF`, which a pipe that polled
/// writable takes without blocking.
const WRITE_CHUNK: usize = 4096;
/// How long one poll waits before the stop flag is looked at again (ms).
const POLL_MS: u16 = 20;

/// What the stdin thread hands over.
#[derive(Debug)]
pub(crate) enum Input {
    /// Bytes read from stdin.
    Data(Vec<u8>),
    /// Stdin reached its end (or failed: the error is logged).
    Eof,
}

/// A stdin reader thread that can be stopped.
pub(crate) struct StdinReader {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Chunks read; the channel closes when the thread ends.
    pub(crate) rx: mpsc::Receiver<Input>,
}

impl StdinReader {
    /// Starts reading fd 0.
    pub(crate) fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel(4);
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("roam-stdin".into())
            .spawn(move || read_loop(&flag, &tx))
            .expect("spawning the stdin thread");
        Self {
            stop,
            thread: Some(thread),
            rx,
        }
    }

    /// Stops the thread and returns every byte it read that the caller has
    /// not received yet, in order, and whether stdin had ended.
    pub(crate) async fn stop(mut self) -> (Vec<u8>, bool) {
        self.stop.store(true, Ordering::SeqCst);
        let mut rest = Vec::new();
        let mut eof = false;
        // Draining unblocks a thread waiting for room in the channel; the
        // channel closes when the thread has seen the flag and ended.
        while let Some(input) = self.rx.recv().await {
            match input {
                Input::Data(d) => rest.extend_from_slice(&d),
                Input::Eof => eof = true,
            }
        }
        if let Some(t) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        (rest, eof)
    }
}

fn read_loop(stop: &AtomicBool, tx: &mpsc::Sender<Input>) {
    let stdin = std::io::stdin();
    let fd = stdin.as_fd();
    let mut buf = vec![0u8; READ_CHUNK];
    while !stop.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(&mut fds, POLL_MS) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::debug!("polling stdin: {e}");
                let _ = tx.blocking_send(Input::Eof);
                return;
            }
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match nix::unistd::read(fd, &mut buf) {
            Ok(0) => {
                let _ = tx.blocking_send(Input::Eof);
                return;
            }
            Ok(n) => {
                if tx.blocking_send(Input::Data(buf[..n].to_vec())).is_err() {
                    return;
                }
            }
            Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
            Err(e) => {
                tracing::debug!("reading stdin: {e}");
                let _ = tx.blocking_send(Input::Eof);
                return;
            }
        }
    }
}

/// A stdout writer thread that can be stopped.
/// Where a [`StdoutWriter`] records, right after each write, how far the
/// output has come: a process killed between two writes leaves in it the
/// exact count of bytes it printed (a named pipe's journal lags behind).
pub(crate) struct Mark {
    /// The mark file: 8 bytes, little-endian, at offset 0.
    pub(crate) file: std::fs::File,
    /// The output position of the first byte this writer writes.
    pub(crate) base: u64,
}

impl Mark {
    /// Records that `written` bytes of this writer are out. One 8-byte
    /// `pwrite`: a kill lands before or after it, never inside.
    fn record(&self, written: u64) {
        use std::os::unix::fs::FileExt;
        if let Err(e) = self
            .file
            .write_all_at(&(self.base + written).to_le_bytes(), 0)
        {
            tracing::debug!("recording the output position: {e}");
        }
    }

    /// The position a mark file holds, if it holds one.
    pub(crate) fn read(path: &std::path::Path) -> Option<u64> {
        let bytes = std::fs::read(path).ok()?;
        Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
    }
}

pub(crate) struct StdoutWriter {
    /// Bytes written to stdout so far (updated after each write).
    pub(crate) written: tokio::sync::watch::Receiver<u64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<Vec<u8>, String>>>,
    tx: Option<mpsc::Sender<Vec<u8>>>,
}

impl StdoutWriter {
    /// Starts writing to fd 1.
    pub(crate) fn start(mark: Option<Mark>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel(4);
        let (count, written) = tokio::sync::watch::channel(0u64);
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("roam-stdout".into())
            .spawn(move || write_loop(&flag, rx, &count, mark.as_ref()))
            .expect("spawning the stdout thread");
        Self {
            written,
            stop,
            thread: Some(thread),
            tx: Some(tx),
        }
    }

    /// Queues `data` for stdout; waits while four chunks are queued.
    /// Fails once the writer has failed (stdout closed).
    pub(crate) async fn write(&self, data: Vec<u8>) -> Result<(), ()> {
        match &self.tx {
            Some(tx) => tx.send(data).await.map_err(|_| ()),
            None => Err(()),
        }
    }

    /// Writes everything queued, then ends the thread. The error, if stdout
    /// failed, says why.
    pub(crate) async fn finish(mut self) -> Result<(), String> {
        self.tx = None;
        match self.thread.take() {
            Some(t) => match tokio::task::spawn_blocking(move || t.join()).await {
                Ok(Ok(r)) => r.map(|_| ()),
                _ => Err("the stdout thread failed".into()),
            },
            None => Ok(()),
        }
    }

    /// Stops at once and returns every queued byte that was not written, in
    /// order (they go to the next client's stdout).
    pub(crate) async fn stop(mut self) -> Vec<u8> {
        self.stop.store(true, Ordering::SeqCst);
        self.tx = None;
        match self.thread.take() {
            Some(t) => match tokio::task::spawn_blocking(move || t.join()).await {
                Ok(Ok(Ok(rest))) => rest,
                Ok(Ok(Err(e))) => {
                    tracing::debug!("stdout: {e}");
                    Vec::new()
                }
                _ => Vec::new(),
            },
            None => Vec::new(),
        }
    }
}

/// Writes chunks until the channel closes. Returns the bytes not written
/// when stopped (empty otherwise), or why stdout failed.
fn write_loop(
    stop: &AtomicBool,
    mut rx: mpsc::Receiver<Vec<u8>>,
    count: &tokio::sync::watch::Sender<u64>,
    mark: Option<&Mark>,
) -> Result<Vec<u8>, String> {
    let mut total = 0u64;
    let stdout = std::io::stdout();
    let fd = stdout.as_fd();
    let mut left = Vec::new();
    loop {
        if stop.load(Ordering::SeqCst) {
            // Whatever is queued was never written: hand it back.
            while let Ok(more) = rx.try_recv() {
                left.extend_from_slice(&more);
            }
            return Ok(left);
        }
        if left.is_empty() {
            match rx.blocking_recv() {
                Some(chunk) => left = chunk,
                None => return Ok(Vec::new()),
            }
            continue;
        }
        let mut fds = [PollFd::new(fd, PollFlags::POLLOUT)];
        match poll(&mut fds, POLL_MS) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(format!("polling stdout: {e}")),
        }
        if fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP))
        {
            return Err("stdout was closed by its reader".into());
        }
        let n = left.len().min(WRITE_CHUNK);
        match nix::unistd::write(fd, &left[..n]) {
            Ok(w) => {
                left.drain(..w);
                total += w as u64;
                if let Some(m) = mark {
                    m.record(total);
                }
                count.send_replace(total);
            }
            Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
            Err(e) => return Err(format!("writing stdout: {e}")),
        }
    }
}
