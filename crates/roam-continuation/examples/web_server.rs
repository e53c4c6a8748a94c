//! An M-Apache-like web service as a service set (issue 15's web-server
//! example; `tests/service_web.rs` moves it between two sites mid-download
//! and mid-request): three processes, each a member of the set.
//!
//! ```text
//! web_server ROLE CHANNEL_DIR CONTROL_SOCKET OUT_DIR WWW_DIR DOWNLOAD ORDERS SEED
//! ```
//!
//! - `fe`, the front-end: reads HTTP/1.1 requests from the client on
//!   channel 1 and answers on channel 2 (two Unix sockets in CHANNEL_DIR,
//!   `req.sock` and `resp.sock`). `GET /order?id=I&size=S` is a dynamic
//!   page: the front-end hands it to the back-end over channel 3 and
//!   forwards what comes back on channel 4 as chunks
//!   (`Transfer-Encoding: chunked`). Any other path is a static file of
//!   WWW_DIR, sent with `Content-Length`.
//! - `be`, the CGI-like back-end, on two named pipes (`cgi-in.fifo`,
//!   `cgi-out.fifo`): for each order it appends one line to
//!   `OUT_DIR/ledger` (the effect outside the set) and streams the page in
//!   frames of 64 KiB (`support/web.rs`).
//! - `cl`, the client: GETs DOWNLOAD (a path, or `-` for none) into
//!   `OUT_DIR/download.bin`, then orders `0 .. ORDERS` (sizes from SEED),
//!   writing one line per answer (`ID SIZE SHA256`) to `OUT_DIR/answers`;
//!   then it writes `OUT_DIR/client.done`. The client's connection is two
//!   of the set's channels, so it moves with the set, as the consumer of
//!   `service_member.rs` does.
//!
//! - `cgi` (`web_server cgi CONTROL_SOCKET CHANNEL_DIR OUT_DIR`): the
//!   same back-end behind a cluster host's front-end
//!   (`tests/service_web_cluster.rs`: the front-end is the set's root in
//!   the host's process and an outside roam client is its client), on the
//!   Unix sockets `req.sock` (orders, channel 1) and `rep.sock` (pages,
//!   channel 2) the front-end listens on.
//!
//! Every process is deterministic: its output bytes depend only on its
//! snapshot and the bytes it reads (never on how reads are split), so a
//! replay from its last export writes the same bytes and the restarted
//! ends discard what the peer already has.
//!
//! Exactly once outside the set. Effects are file writes made right after
//! `Member::running` with no await between (this runtime has one thread, so
//! a freeze cannot fall between the check and the write):
//! - the client writes at positions its snapshot records (the download's
//!   offset, the answers file's length), so a replay rewrites the same
//!   bytes in place;
//! - the back-end's snapshot records where the next ledger line goes. A
//!   back-end that replays an order after a move finds the ledger longer
//!   than that: it checks that the line there is this order's (the old
//!   incarnation's write landed) and does not write it again. It exports
//!   only between orders and every 1 MiB of a page, so a move in the middle
//!   of a page replays the order from its start. It appends a line to
//!   `OUT_DIR/landed` each time it finds its effect already made.
//!
//! An error (a malformed message, a ledger that disagrees) is written to
//! `OUT_DIR/error` and the process exits with status 3. The process exits
//! when the coordinator ends it.

use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use roam_continuation::service_set::{join, Member};
use roam_service::{ChannelId, Interval, Limits};
use sha2::{Digest, Sha256};
use tokio::net::unix::pipe;
use tokio::net::{UnixListener, UnixStream};

#[path = "support/web.rs"]
mod web;

/// HTTP requests, client to front-end.
const REQ: ChannelId = ChannelId(1);
/// HTTP responses, front-end to client.
const RESP: ChannelId = ChannelId(2);
/// Orders, front-end to back-end (`ORDER id size\n`).
const CGI_IN: ChannelId = ChannelId(3);
/// Pages, back-end to front-end: frames of a `u32` big-endian length and
/// that many bytes; length 0 ends the page.
const CGI_OUT: ChannelId = ChannelId(4);
/// Orders to a `cgi` back-end (behind a cluster host's front-end,
/// `tests/service_web_cluster.rs`): its `req.sock`.
const CGI_ORDERS: ChannelId = ChannelId(1);
/// Pages from a `cgi` back-end: its `rep.sock`, framed as on [`CGI_OUT`].
const CGI_PAGES: ChannelId = ChannelId(2);
/// A process exports at least once per this many bytes of a response, so
/// its peers' logs stay small (bytes).
const EXPORT_EVERY: u64 = 1 << 20;
/// Bytes a static file is read and sent in.
const FILE_CHUNK: usize = 64 << 10;

/// Fails the run: the reason in `OUT_DIR/error`, exit status 3.
fn fail(out: &Path, why: &str) -> ! {
    publish(&out.join("error"), why.as_bytes());
    std::process::exit(3)
}

/// Writes `bytes` to `path` whole (temp file, then rename).
fn publish(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).expect("write result");
    std::fs::rename(&tmp, path).expect("publish result");
}

/// Reads exactly `buf.len()` bytes of channel `id`; `Ok(false)` when the
/// channel ends before the first byte.
async fn read_exact(m: &Member, id: ChannelId, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let n = m.read(id, &mut buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// Reads channel `id` up to and including `end`, byte by byte so that
/// nothing past it is taken; `None` when the channel ends first.
async fn read_until(
    m: &Member,
    id: ChannelId,
    end: &[u8],
    max: usize,
) -> io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(end) {
        if line.len() >= max || !read_exact(m, id, &mut byte).await? {
            return Ok(None);
        }
        line.push(byte[0]);
    }
    Ok(Some(line))
}

/// What the front-end is doing: its snapshot.
enum FrontEnd {
    /// Waiting for the next request.
    Idle,
    /// Sending a static file from `offset` (the headers are out).
    Static {
        path: PathBuf,
        offset: u64,
        len: u64,
    },
    /// Forwarding a dynamic page from the back-end; `forwarded` bytes of
    /// it are out.
    Dynamic { forwarded: u64 },
}

impl FrontEnd {
    fn encode(&self) -> Vec<u8> {
        match self {
            FrontEnd::Idle => "idle".to_string(),
            FrontEnd::Static { path, offset, len } => {
                format!("static {offset} {len} {}", path.display())
            }
            FrontEnd::Dynamic { forwarded } => format!("dynamic {forwarded}"),
        }
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> FrontEnd {
        let text = String::from_utf8_lossy(bytes);
        let words: Vec<&str> = text.splitn(4, ' ').collect();
        let number = |w: &str| -> u64 { w.parse().expect("a number in the snapshot") };
        match words[..] {
            ["static", offset, len, path] => FrontEnd::Static {
                path: path.into(),
                offset: number(offset),
                len: number(len),
            },
            ["dynamic", forwarded] => FrontEnd::Dynamic {
                forwarded: number(forwarded),
            },
            _ => FrontEnd::Idle,
        }
    }
}

/// The target of a request head (`GET TARGET HTTP/1.1`).
fn target(head: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(head).ok()?;
    let mut words = text.lines().next()?.split(' ');
    match (words.next(), words.next(), words.next()) {
        (Some("GET"), Some(target), Some("HTTP/1.1")) => Some(target.to_string()),
        _ => None,
    }
}

async fn front_end(m: Member, www: PathBuf, out: PathBuf) -> io::Result<()> {
    let mut state = m
        .snapshot()
        .map(|s| FrontEnd::decode(&s))
        .unwrap_or(FrontEnd::Idle);
    // The open static file, by path (reopened after a restart).
    let mut open: Option<(PathBuf, std::fs::File)> = None;
    let mut chunk = vec![0u8; FILE_CHUNK];
    loop {
        match &mut state {
            FrontEnd::Idle => {
                let Some(head) = read_until(&m, REQ, b"\r\n\r\n", 8192).await? else {
                    // The client is gone (this incarnation moved away).
                    std::future::pending::<()>().await;
                    unreachable!()
                };
                let Some(target) = target(&head) else {
                    fail(&out, "the front-end got a malformed request");
                };
                if let Some((id, size)) = web::order_query(&target) {
                    m.write_all(
                        RESP,
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
                          Transfer-Encoding: chunked\r\n\r\n",
                    )
                    .await?;
                    m.write_all(CGI_IN, format!("ORDER {id} {size}\n").as_bytes())
                        .await?;
                    state = FrontEnd::Dynamic { forwarded: 0 };
                    continue;
                }
                let name = target.trim_start_matches('/');
                let path = www.join(name);
                let len = match std::fs::metadata(&path) {
                    Ok(meta) if meta.is_file() && !name.split('/').any(|p| p == "..") => meta.len(),
                    _ => {
                        m.write_all(
                            RESP,
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n\r\nnot found\n",
                        )
                        .await?;
                        m.export(&state.encode(), Interval::Deterministic).await?;
                        continue;
                    }
                };
                let headers = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
                     Content-Length: {len}\r\n\r\n"
                );
                m.write_all(RESP, headers.as_bytes()).await?;
                state = FrontEnd::Static {
                    path,
                    offset: 0,
                    len,
                };
            }
            FrontEnd::Static { path, offset, len } => {
                if *offset == *len {
                    state = FrontEnd::Idle;
                    m.export(&state.encode(), Interval::Deterministic).await?;
                    continue;
                }
                if open.as_ref().is_none_or(|(p, _)| p != path) {
                    open = Some((path.clone(), std::fs::File::open(&*path)?));
                }
                let file = &open.as_ref().expect("open").1;
                let want = (*len - *offset).min(FILE_CHUNK as u64) as usize;
                file.read_exact_at(&mut chunk[..want], *offset)?;
                m.write_all(RESP, &chunk[..want]).await?;
                let before = *offset;
                *offset += want as u64;
                if *offset / EXPORT_EVERY != before / EXPORT_EVERY && *offset < *len {
                    m.export(&state.encode(), Interval::Deterministic).await?;
                }
            }
            FrontEnd::Dynamic { forwarded } => {
                let mut len = [0u8; 4];
                if !read_exact(&m, CGI_OUT, &mut len).await? {
                    fail(&out, "the back-end's pipe ended");
                }
                let len = u32::from_be_bytes(len) as usize;
                if len == 0 {
                    m.write_all(RESP, b"0\r\n\r\n").await?;
                    state = FrontEnd::Idle;
                    m.export(&state.encode(), Interval::Deterministic).await?;
                    continue;
                }
                if len > web::FRAME {
                    fail(&out, "the back-end sent an oversized frame");
                }
                let mut piece = format!("{len:x}\r\n").into_bytes();
                let start = piece.len();
                piece.resize(start + len, 0);
                read_exact(&m, CGI_OUT, &mut piece[start..]).await?;
                piece.extend_from_slice(b"\r\n");
                m.write_all(RESP, &piece).await?;
                let before = *forwarded;
                *forwarded += len as u64;
                if *forwarded / EXPORT_EVERY != before / EXPORT_EVERY {
                    m.export(&state.encode(), Interval::Deterministic).await?;
                }
            }
        }
    }
}

/// The back-end's snapshot.
struct BackEnd {
    /// Where the next ledger line goes (bytes from the ledger's start).
    ledger_at: u64,
    /// The order whose page is being sent: id, size, bytes sent.
    page: Option<(u64, u64, u64)>,
}

impl BackEnd {
    fn encode(&self) -> Vec<u8> {
        match self.page {
            Some((id, size, sent)) => format!("{} {id} {size} {sent}", self.ledger_at),
            None => self.ledger_at.to_string(),
        }
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> BackEnd {
        let text = String::from_utf8_lossy(bytes);
        let n: Vec<u64> = text
            .split(' ')
            .map(|w| w.parse().expect("a number"))
            .collect();
        BackEnd {
            ledger_at: n[0],
            page: (n.len() == 4).then(|| (n[1], n[2], n[3])),
        }
    }
}

/// Records `line` in the ledger at `*at`, once: if the ledger already holds
/// it there (an earlier incarnation's write landed before the cut's
/// snapshot knew), it is not written again. True when it was already there.
/// Synchronous on purpose: called right after `Member::running`, it ends
/// before the member can be frozen.
fn record(ledger: &Path, at: &mut u64, line: &[u8], out: &Path) -> bool {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(ledger)
        .expect("open the ledger");
    let len = file.metadata().expect("ledger size").len();
    let end = *at + line.len() as u64;
    let landed = if len >= end {
        let mut have = vec![0u8; line.len()];
        file.read_exact_at(&mut have, *at).expect("read the ledger");
        if have != line {
            fail(out, &format!("the ledger holds another line at {at}"));
        }
        true
    } else if len == *at {
        file.write_all(line).expect("append to the ledger");
        false
    } else {
        fail(out, &format!("the ledger is {len} bytes, expected {at}"));
    };
    *at = end;
    landed
}

/// The back-end: orders read on `orders`, pages written on `pages`.
async fn back_end(m: Member, out: PathBuf, orders: ChannelId, pages: ChannelId) -> io::Result<()> {
    let mut state = m
        .snapshot()
        .map(|s| BackEnd::decode(&s))
        .unwrap_or(BackEnd {
            ledger_at: 0,
            page: None,
        });
    let ledger = out.join("ledger");
    loop {
        let Some((id, size, sent)) = &mut state.page else {
            let Some(line) = read_until(&m, orders, b"\n", 256).await? else {
                std::future::pending::<()>().await;
                unreachable!()
            };
            let text = String::from_utf8_lossy(&line);
            let words: Vec<&str> = text.trim_end().split(' ').collect();
            let (id, size) = match words[..] {
                ["ORDER", id, size] => match (id.parse(), size.parse()) {
                    (Ok(id), Ok(size)) => (id, size),
                    _ => fail(&out, "the back-end got a malformed order"),
                },
                _ => fail(&out, "the back-end got a malformed order"),
            };
            m.running().await;
            let line = web::ledger_line(id, size);
            if record(&ledger, &mut state.ledger_at, line.as_bytes(), &out) {
                let mut notes = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(out.join("landed"))?;
                writeln!(notes, "{id}")?;
            }
            state.page = Some((id, size, 0));
            continue;
        };
        if *sent == *size {
            m.write_all(pages, &0u32.to_be_bytes()).await?;
            state.page = None;
            m.export(&state.encode(), Interval::Deterministic).await?;
            continue;
        }
        let len = (*size - *sent).min(web::FRAME as u64) as usize;
        let mut frame = (len as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&web::page_frame(*id, *sent / web::FRAME as u64, len));
        m.write_all(pages, &frame).await?;
        let before = *sent;
        *sent += len as u64;
        if *sent / EXPORT_EVERY != before / EXPORT_EVERY && *sent < *size {
            m.export(&state.encode(), Interval::Deterministic).await?;
        }
    }
}

/// The client's snapshot.
struct Client {
    /// The next request of the script.
    next: u64,
    /// Bytes of the answers file written.
    answers_at: u64,
    /// The download in progress: its length and the bytes written.
    download: Option<(u64, u64)>,
}

impl Client {
    fn encode(&self) -> Vec<u8> {
        match self.download {
            Some((len, at)) => format!("{} {} {len} {at}", self.next, self.answers_at),
            None => format!("{} {}", self.next, self.answers_at),
        }
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> Client {
        let text = String::from_utf8_lossy(bytes);
        let n: Vec<u64> = text
            .split(' ')
            .map(|w| w.parse().expect("a number"))
            .collect();
        Client {
            next: n[0],
            answers_at: n[1],
            download: (n.len() == 4).then(|| (n[2], n[3])),
        }
    }
}

/// The value of header `name` in a response head (lower-case match).
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Reads a response head; fails the run unless it is `200 OK`.
async fn response_head(m: &Member, out: &Path) -> io::Result<String> {
    let Some(head) = read_until(m, RESP, b"\r\n\r\n", 8192).await? else {
        fail(out, "the response channel ended");
    };
    let head = String::from_utf8_lossy(&head).into_owned();
    if !head.starts_with("HTTP/1.1 200 ") {
        fail(out, &format!("response {head:?}"));
    }
    Ok(head)
}

/// Writes `bytes` at `at` of `path` (created if missing).
fn write_at(path: &Path, at: u64, bytes: &[u8]) -> io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    file.write_all_at(bytes, at)
}

async fn client(
    m: Member,
    out: PathBuf,
    download: Option<String>,
    orders: u64,
    seed: u64,
) -> io::Result<()> {
    let mut state = m.snapshot().map(|s| Client::decode(&s)).unwrap_or(Client {
        next: 0,
        answers_at: 0,
        download: None,
    });
    let first_order = u64::from(download.is_some());
    let total = first_order + orders;
    let mut buf = vec![0u8; FILE_CHUNK];
    while state.next < total {
        if let (Some(path), 0) = (&download, state.next) {
            let target = out.join("download.bin");
            let (len, mut at) = match state.download {
                Some(progress) => progress,
                None => {
                    let request = format!("GET {path} HTTP/1.1\r\nHost: web\r\n\r\n");
                    m.write_all(REQ, request.as_bytes()).await?;
                    let head = response_head(&m, &out).await?;
                    let Some(len) = header(&head, "content-length").and_then(|v| v.parse().ok())
                    else {
                        fail(&out, "a static file without Content-Length");
                    };
                    (len, 0)
                }
            };
            while at < len {
                let want = (len - at).min(buf.len() as u64) as usize;
                let n = m.read(RESP, &mut buf[..want]).await?;
                if n == 0 {
                    fail(&out, "the download ended early");
                }
                m.running().await;
                write_at(&target, at, &buf[..n])?;
                let before = at;
                at += n as u64;
                if at / EXPORT_EVERY != before / EXPORT_EVERY && at < len {
                    state.download = Some((len, at));
                    m.export(&state.encode(), Interval::Deterministic).await?;
                }
            }
            state.download = None;
            state.next += 1;
            m.export(&state.encode(), Interval::Deterministic).await?;
            continue;
        }
        let id = state.next - first_order;
        let size = web::order_size(seed, id);
        let request = format!("GET /order?id={id}&size={size} HTTP/1.1\r\nHost: web\r\n\r\n");
        m.write_all(REQ, request.as_bytes()).await?;
        let head = response_head(&m, &out).await?;
        if header(&head, "transfer-encoding") != Some("chunked") {
            fail(&out, "a dynamic page not chunked");
        }
        let (mut hash, mut got) = (Sha256::new(), 0u64);
        loop {
            let Some(line) = read_until(&m, RESP, b"\r\n", 32).await? else {
                fail(&out, "the response channel ended in a page");
            };
            let text = String::from_utf8_lossy(&line[..line.len() - 2]).into_owned();
            let Ok(len) = usize::from_str_radix(&text, 16) else {
                fail(&out, &format!("chunk size {text:?}"));
            };
            if len > 0 {
                buf.resize(buf.len().max(len), 0);
                read_exact(&m, RESP, &mut buf[..len]).await?;
                hash.update(&buf[..len]);
                got += len as u64;
            }
            let mut crlf = [0u8; 2];
            read_exact(&m, RESP, &mut crlf).await?;
            if &crlf != b"\r\n" {
                fail(&out, "a chunk not followed by CRLF");
            }
            if len == 0 {
                break;
            }
        }
        let line = format!("{id} {got} {}\n", web::hex(&hash.finalize()));
        m.running().await;
        write_at(&out.join("answers"), state.answers_at, line.as_bytes())?;
        state.answers_at += line.len() as u64;
        state.next += 1;
        m.export(&state.encode(), Interval::Deterministic).await?;
    }
    publish(&out.join("client.done"), b"");
    Ok(())
}

/// Retries `attempt` every millisecond for up to 10 s (a peer's socket or
/// FIFO appears within milliseconds of its start; the retry's period is
/// part of every move's time).
async fn retry<T>(what: &str, mut attempt: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..10_000 {
        if let Some(t) = attempt().await {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{what}: the peer never appeared");
}

/// Binds a channel's Unix socket (the reader's side listens).
fn listen(dir: &Path, name: &str) -> UnixListener {
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    UnixListener::bind(&path).expect("bind a channel socket")
}

async fn connect(dir: &Path, name: &str) -> UnixStream {
    let path = dir.join(name);
    retry(name, async || UnixStream::connect(&path).await.ok()).await
}

/// The FIFO `name` in `dir`, made unless it exists.
fn fifo(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    match nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => path,
        Err(e) => panic!("mkfifo {}: {e}", path.display()),
    }
}

/// A FIFO's read end, opened read-write so it has no end of file before
/// its writer opens.
fn fifo_reader(dir: &Path, name: &str) -> pipe::Receiver {
    pipe::OpenOptions::new()
        .read_write(true)
        .open_receiver(fifo(dir, name))
        .expect("open a FIFO")
}

/// A FIFO's write end (its open fails until the reader has opened it).
async fn fifo_writer(dir: &Path, name: &str) -> pipe::Sender {
    let path = fifo(dir, name);
    retry(name, async || {
        pipe::OpenOptions::new().open_sender(&path).ok()
    })
    .await
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, role, control, dir, out] = &args[..] {
        if role == "cgi" {
            cgi(control, Path::new(dir), PathBuf::from(out)).await;
        }
    }
    let [_, role, dir, control, out, www, download, orders, seed] = &args[..] else {
        eprintln!(
            "usage: web_server ROLE CHANNEL_DIR CONTROL_SOCKET OUT_DIR WWW_DIR DOWNLOAD ORDERS SEED\n       web_server cgi CONTROL_SOCKET CHANNEL_DIR OUT_DIR"
        );
        std::process::exit(2);
    };
    let (dir, out, www) = (PathBuf::from(dir), PathBuf::from(out), PathBuf::from(www));
    let download = (download != "-").then(|| download.clone());
    let orders: u64 = orders.parse().expect("ORDERS is a number");
    let seed: u64 = seed.parse().expect("SEED is a number");
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let m = join(&mut control, role, Limits::default())
        .await
        .expect("join");
    match role.as_str() {
        "fe" => {
            let requests = listen(&dir, "req.sock");
            m.add_reader(CGI_OUT, fifo_reader(&dir, "cgi-out.fifo"))
                .expect("cgi-out");
            m.add_writer(RESP, connect(&dir, "resp.sock").await)
                .expect("resp");
            m.add_writer(CGI_IN, fifo_writer(&dir, "cgi-in.fifo").await)
                .expect("cgi-in");
            let (socket, _) = requests.accept().await.expect("accept the client");
            m.add_reader(REQ, socket).expect("req");
        }
        "be" => {
            m.add_reader(CGI_IN, fifo_reader(&dir, "cgi-in.fifo"))
                .expect("cgi-in");
            m.add_writer(CGI_OUT, fifo_writer(&dir, "cgi-out.fifo").await)
                .expect("cgi-out");
        }
        "cl" => {
            let responses = listen(&dir, "resp.sock");
            m.add_writer(REQ, connect(&dir, "req.sock").await)
                .expect("req");
            let (socket, _) = responses.accept().await.expect("accept the front-end");
            m.add_reader(RESP, socket).expect("resp");
        }
        _ => panic!("unknown role {role}"),
    }
    let app = {
        let (m, role, out) = (m.clone(), role.clone(), out.clone());
        tokio::spawn(async move {
            let done = match role.as_str() {
                "fe" => front_end(m, www, out.clone()).await,
                "be" => back_end(m, out.clone(), CGI_IN, CGI_OUT).await,
                "cgi" => back_end(m, out.clone(), CGI_ORDERS, CGI_PAGES).await,
                _ => client(m, out.clone(), download, orders, seed).await,
            };
            if let Err(e) = done {
                fail(&out, &format!("{role}: {e}"));
            }
            std::future::pending::<()>().await;
        })
    };
    // Ready: the coordinator may now end the old site and thaw this one.
    m.ready(&mut control).await.expect("ready");
    let served = m.serve_control(control).await;
    app.abort();
    std::process::exit(if served.is_ok() { 0 } else { 1 });
}

/// The `cgi` back-end: the set's only process besides a cluster host's
/// front-end (its root, in the host's process), reached over the Unix
/// sockets `req.sock` (orders) and `rep.sock` (pages) in `dir`, which the
/// front-end listens on. Never returns.
async fn cgi(control: &str, dir: &Path, out: PathBuf) -> ! {
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let m = join(&mut control, "cgi", Limits::default())
        .await
        .expect("join");
    m.add_reader(CGI_ORDERS, connect(dir, "req.sock").await)
        .expect("req");
    m.add_writer(CGI_PAGES, connect(dir, "rep.sock").await)
        .expect("rep");
    let app = {
        let (m, out) = (m.clone(), out.clone());
        tokio::spawn(async move {
            if let Err(e) = back_end(m, out.clone(), CGI_ORDERS, CGI_PAGES).await {
                fail(&out, &format!("cgi: {e}"));
            }
            std::future::pending::<()>().await;
        })
    };
    m.ready(&mut control).await.expect("ready");
    let served = m.serve_control(control).await;
    app.abort();
    std::process::exit(if served.is_ok() { 0 } else { 1 });
}
