//! A post-copy move's memory at the source: the destination's lazy-pages
//! daemon asks for pages over the pages stream ([`super::wire::STREAM_PAGES`])
//! in CRIU's page-server protocol, and they come from the frozen process
//! itself, never from images (nothing of the lazy memory is written here).
//!
//! CRIU's lazy dump ([`roam_criu::Criu::dump_lazily_then`]) keeps the tree
//! frozen until the socket of its page server closes, and only then ends
//! it. [`PageServer`] answers every request of the daemon itself, reading
//! the memory of the frozen process with `process_vm_readv` (what CRIU
//! would send: the tree cannot change while frozen), from B's restore
//! (inside CRIU's post-dump step, so that a failure can still roll the
//! dump back) to the daemon's last page; then it closes CRIU's socket. CRIU's page server serves
//! nothing: the CRIU roam builds (`scripts/criu-build`, patch 0003) leaves
//! the lazy memory out of its page pipes when asked
//! (`CRIU_LAZY_PAGES_UNPIPED=1`), which takes the capture of the whole
//! memory out of the freeze; a stock CRIU still captures it, unused.
//! After a refused step CRIU resumes the tree once the socket closes.
//!
//! The protocol (CRIU's `criu/page-xfer.c`): each request is a
//! `page_server_iov` of 24 bytes, little-endian `{cmd: u32, nr_pages: u32,
//! vaddr: u64, dst_id: u64}`; the daemon sends `PS_IOV_GET` (7) with the
//! task's pid (as the images know it) in `dst_id`, and the answer is the
//! same header with `cmd = PS_IOV_ADD_F | PE_PRESENT << 16` followed by the
//! pages; `PS_IOV_CLOSE` / `PS_IOV_FORCE_CLOSE` end it, answered with a
//! 4-byte status 0. The daemon may have several requests in flight; they
//! are answered in order.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes of a request header.
const HEADER: usize = 24;
/// Bytes of a page.
const PAGE: u64 = 4096;
/// `PS_IOV_GET`: send me these pages.
const PS_IOV_GET: u32 = 7;
/// `PS_IOV_ADD_F`: pages follow, with flags in the high 16 bits.
const PS_IOV_ADD_F: u32 = 6;
/// `PE_PRESENT`, the flag of an answer's pages.
const PE_PRESENT: u32 = 1 << 2;
/// `PS_IOV_CLOSE` and `PS_IOV_FORCE_CLOSE`: the daemon is done.
const PS_IOV_CLOSE: u32 = 0x1023;
const PS_IOV_FORCE_CLOSE: u32 = 0x1024;
/// The most pages one request may ask for (CRIU's daemon asks for at most
/// 4 MiB at a time; a larger one is a broken peer).
const MAX_REQUEST_PAGES: u32 = 16 << 8;

/// One request of the daemon's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// `nr_pages` pages from `vaddr` of task `pid` (as the images know it).
    Get { pid: u64, vaddr: u64, nr_pages: u32 },
    /// The daemon has every page.
    Close,
}

impl Request {
    /// Decodes one request header (sans-IO).
    pub(crate) fn decode(h: &[u8; HEADER]) -> Result<Request, String> {
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        match u32_at(0) {
            PS_IOV_GET => {
                let nr_pages = u32_at(4);
                if nr_pages == 0 || nr_pages > MAX_REQUEST_PAGES {
                    return Err(format!("a request for {nr_pages} pages"));
                }
                Ok(Request::Get {
                    pid: u64_at(16),
                    vaddr: u64_at(8),
                    nr_pages,
                })
            }
            PS_IOV_CLOSE | PS_IOV_FORCE_CLOSE => Ok(Request::Close),
            other => Err(format!("an unexpected page-server command {other:#x}")),
        }
    }
}

impl Request {
    /// The request's header as the daemon sends it (`Close` as
    /// `PS_IOV_CLOSE`): what [`Request::decode`] reads back.
    pub(crate) fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        match *self {
            Request::Get {
                pid,
                vaddr,
                nr_pages,
            } => {
                h[0..4].copy_from_slice(&PS_IOV_GET.to_le_bytes());
                h[4..8].copy_from_slice(&nr_pages.to_le_bytes());
                h[8..16].copy_from_slice(&vaddr.to_le_bytes());
                h[16..24].copy_from_slice(&pid.to_le_bytes());
            }
            Request::Close => h[0..4].copy_from_slice(&PS_IOV_CLOSE.to_le_bytes()),
        }
        h
    }
}

/// The answer's header to a [`Request::Get`] (the pages follow it).
pub(crate) fn answer_header(pid: u64, vaddr: u64, nr_pages: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&(PS_IOV_ADD_F | PE_PRESENT << 16).to_le_bytes());
    h[4..8].copy_from_slice(&nr_pages.to_le_bytes());
    h[8..16].copy_from_slice(&vaddr.to_le_bytes());
    h[16..24].copy_from_slice(&pid.to_le_bytes());
    h
}

/// The tree's pids as the images know them (in the root's pid namespace)
/// mapped to this host's, from `/proc/PID/status` (`NSpid`).
pub(crate) fn pid_map(pids: &[i32]) -> Result<HashMap<u64, i32>, String> {
    let nspids = |pid: i32| -> Result<Vec<u64>, String> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| format!("cannot read /proc/{pid}/status: {e}"))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .ok_or_else(|| format!("no NSpid in /proc/{pid}/status"))?
            .split_whitespace()
            .map(|n| n.parse().map_err(|e| format!("NSpid of {pid}: {e}")))
            .collect()
    };
    let root = *pids.first().ok_or("no process")?;
    let level = nspids(root)?.len();
    let mut map = HashMap::new();
    for &pid in pids {
        let ns = nspids(pid)?;
        let v = ns
            .get(level - 1)
            .ok_or_else(|| format!("{pid} is outside the pid namespace of {root}"))?;
        map.insert(*v, pid);
    }
    Ok(map)
}

/// The memory of a post-copy move at the source, served to the
/// destination's lazy-pages daemon over the pages stream.
pub(crate) struct PageServer {
    /// Answers; the bytes sent to the destination.
    task: tokio::task::JoinHandle<Result<u64, String>>,
    /// Open: pages flow to the destination; closed: they wait (while the
    /// address is handed over, whose few frames would otherwise queue
    /// behind megabytes of memory and share the CPU with them). Only after
    /// the hand-over of the stream: the restore needs the pages it asks
    /// for.
    gate: tokio::sync::watch::Sender<bool>,
    /// When it started.
    started: Instant,
}

impl PageServer {
    /// Starts answering the daemon's requests on `pages` from the memory
    /// of the tree `pids` (the frozen tree's, from `/proc`); `criu` is the
    /// other end of the socket pair CRIU's lazy dump serves on: held
    /// until the daemon has every page, since CRIU keeps the tree frozen
    /// until it closes.
    pub(crate) fn start(
        pids: &[i32],
        pages: roam::RoamStream,
        criu: std::os::unix::net::UnixStream,
    ) -> Result<PageServer, String> {
        let map = pid_map(pids)?;
        let (gate, open) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(serve(map, pages, criu, open));
        Ok(PageServer {
            task,
            gate,
            started: Instant::now(),
        })
    }

    /// Holds the pages back (`false`) or lets them flow (`true`).
    pub(crate) fn flow(&self, open: bool) {
        let _ = self.gate.send(open);
    }

    /// Stops (the move did not happen): CRIU's page server, if it serves,
    /// sees its socket close and ends.
    pub(crate) fn stop(self) {
        self.task.abort();
    }

    /// Waits until the destination has every page: the bytes sent and how
    /// long serving took, or why it did not finish.
    pub(crate) async fn finish(self) -> Result<(u64, Duration), String> {
        let bytes = match self.task.await {
            Ok(r) => r?,
            Err(e) => return Err(format!("the pages task failed: {e}")),
        };
        Ok((bytes, self.started.elapsed()))
    }
}

/// A request for more than this is read on a blocking thread (a page
/// fault's single page is read in place).
const READ_IN_PLACE: usize = 256 << 10;

/// Reads `buf.len()` bytes at `vaddr` of process `pid` (with
/// `process_vm_readv`: twice as fast as `/proc/PID/mem` here, 0.22 against
/// 0.45-0.5 s per GB), large reads on a blocking thread; gives the buffer
/// back.
async fn read_memory(pid: i32, mut buf: Vec<u8>, vaddr: u64) -> std::io::Result<Vec<u8>> {
    if buf.len() <= READ_IN_PLACE {
        read_exact_of(pid, &mut buf, vaddr)?;
        return Ok(buf);
    }
    tokio::task::spawn_blocking(move || {
        read_exact_of(pid, &mut buf, vaddr)?;
        Ok(buf)
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Fills `buf` from `vaddr` of process `pid`'s memory, or fails.
fn read_exact_of(pid: i32, buf: &mut [u8], vaddr: u64) -> std::io::Result<()> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    let pid = nix::unistd::Pid::from_raw(pid);
    let mut done = 0;
    while done < buf.len() {
        let remote = [RemoteIoVec {
            base: vaddr as usize + done,
            len: buf.len() - done,
        }];
        let n = process_vm_readv(
            pid,
            &mut [std::io::IoSliceMut::new(&mut buf[done..])],
            &remote,
        )
        .map_err(std::io::Error::from)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} bytes short", buf.len() - done),
            ));
        }
        done += n;
    }
    Ok(())
}

/// The page server's task: answers every request from the memory of the
/// frozen tree until the daemon says it has every page and hangs up,
/// then closes `criu` (CRIU's page server, which has served nothing,
/// ends with success and ends the tree).
async fn serve(
    map: HashMap<u64, i32>,
    pages: roam::RoamStream,
    criu: std::os::unix::net::UnixStream,
    mut open: tokio::sync::watch::Receiver<bool>,
) -> Result<u64, String> {
    let (mut pr, mut pw) = tokio::io::split(pages);
    // Bytes of the stream read but not yet answered (a partial request).
    let mut pending: Vec<u8> = Vec::with_capacity(HEADER * 16);
    let mut sent = 0u64;
    let mut page_buf = Vec::new();
    let mut daemon_done = false;
    let failed = |e: std::io::Error| format!("the pages stream failed: {e}");
    loop {
        while pending.len() >= HEADER {
            let mut h = [0u8; HEADER];
            h.copy_from_slice(&pending[..HEADER]);
            pending.drain(..HEADER);
            match Request::decode(&h).map_err(|e| format!("the destination sent {e}"))? {
                Request::Close => {
                    pw.write_all(&0i32.to_le_bytes()).await.map_err(failed)?;
                    daemon_done = true;
                }
                Request::Get {
                    pid,
                    vaddr,
                    nr_pages,
                } => {
                    let real = *map.get(&pid).ok_or_else(|| {
                        format!("the destination asked for pages of an unknown task {pid}")
                    })?;
                    let len = u64::from(nr_pages) * PAGE;
                    page_buf.resize(len as usize, 0);
                    page_buf = read_memory(real, std::mem::take(&mut page_buf), vaddr)
                        .await
                        .map_err(|e| {
                            format!(
                                "cannot read {nr_pages} pages at {vaddr:#x} of {real}'s memory: {e}"
                            )
                        })?;
                    if open.wait_for(|o| *o).await.is_err() {
                        return Err("roam stopped serving the memory".into());
                    }
                    pw.write_all(&answer_header(pid, vaddr, nr_pages))
                        .await
                        .map_err(failed)?;
                    pw.write_all(&page_buf).await.map_err(failed)?;
                    sent += HEADER as u64 + len;
                }
            }
        }
        let mut buf = [0u8; HEADER * 16];
        // A plain read: the daemon's next requests, or its hang-up.
        match pr.read(&mut buf).await.map_err(failed)? {
            0 => {
                // The daemon hung up: fine once it said it is done.
                if !daemon_done {
                    return Err("the destination closed the pages stream early".into());
                }
                // Every page is there: CRIU's page server sees its socket
                // close, ends with success and ends the tree.
                drop(criu);
                pw.shutdown().await.map_err(failed)?;
                return Ok(sent);
            }
            n => pending.extend_from_slice(&buf[..n]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(cmd: u32, nr: u32, vaddr: u64, id: u64) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0..4].copy_from_slice(&cmd.to_le_bytes());
        h[4..8].copy_from_slice(&nr.to_le_bytes());
        h[8..16].copy_from_slice(&vaddr.to_le_bytes());
        h[16..24].copy_from_slice(&id.to_le_bytes());
        h
    }

    #[test]
    fn requests_decode_as_criu_encodes_them() {
        assert_eq!(
            Request::decode(&header(7, 3, 0x7f00_0000_1000, 42)),
            Ok(Request::Get {
                pid: 42,
                vaddr: 0x7f00_0000_1000,
                nr_pages: 3
            })
        );
        assert_eq!(
            Request::decode(&header(0x1024, 0, 0, 0)),
            Ok(Request::Close)
        );
        assert_eq!(
            Request::decode(&header(0x1023, 0, 0, 0)),
            Ok(Request::Close)
        );
        assert!(Request::decode(&header(7, 0, 0, 1)).is_err());
        assert!(Request::decode(&header(7, MAX_REQUEST_PAGES + 1, 0, 1)).is_err());
        assert!(Request::decode(&header(1, 1, 0, 1)).is_err());
        // What the fuzz target checks (cli_parsers): encode is decode's inverse.
        let get = header(7, 3, 0x7f00_0000_1000, 42);
        assert_eq!(Request::decode(&get).map(|r| r.encode()), Ok(get));
        assert_eq!(Request::Close.encode(), header(0x1023, 0, 0, 0));
    }

    #[test]
    fn an_answer_is_add_f_with_present_and_the_request_s_fields() {
        let h = answer_header(42, 0x1000, 3);
        assert_eq!(h, header(6 | 4 << 16, 3, 0x1000, 42));
    }

    /// What the destination gets is the process's memory byte for byte,
    /// read in place or (over 256 KiB) on a blocking thread; an address the
    /// process has not mapped is a precise error, not zeros.
    #[tokio::test]
    async fn memory_is_read_byte_for_byte_and_an_unmapped_address_is_an_error() {
        let me = std::process::id() as i32;
        for len in [PAGE as usize, READ_IN_PLACE + 3 * PAGE as usize] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let got = read_memory(me, vec![0; len], data.as_ptr() as u64)
                .await
                .expect("read");
            assert!(got == data, "{len} bytes read back differ");
        }
        // Page 0 is never mapped.
        let err = read_memory(me, vec![0; PAGE as usize], 0)
            .await
            .expect_err("page 0 read");
        assert_eq!(err.raw_os_error(), Some(nix::libc::EFAULT), "{err}");
    }

    #[test]
    fn this_process_maps_to_itself() {
        let me = std::process::id() as i32;
        let map = pid_map(&[me]).expect("pid map");
        assert_eq!(map.get(&(me as u64)), Some(&me));
    }
}
