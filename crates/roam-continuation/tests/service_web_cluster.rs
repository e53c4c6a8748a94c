//! The M-Apache-like web service behind a cluster host, with an outside
//! client (issue 15; `docs/SERVICE.md`, "The web service behind a cluster
//! host").
//!
//! A real roam client connects to a cluster host and speaks HTTP/1.1 over
//! its managed session: it downloads a large static file, then places
//! dynamic orders. The host's front-end (the service set's root, in the
//! host's process) serves the static file itself and hands each order to
//! its CGI-like back-end process (`examples/web_server.rs`, role `cgi`),
//! which appends the order to a ledger file (its effect outside the set)
//! and streams the page back in frames; the front-end forwards them to the
//! client as HTTP chunks. The cluster moves the session between its two
//! hosts at seeded random moments, in the middle of the download and of
//! dynamic pages: the front-end's position (file offset, a half-read
//! frame) and the set's cut travel in the session's continuation, and the
//! destination restarts the back-end from its part.
//!
//! What the user cares about: the downloaded file is the site's, byte for
//! byte (SHA-256); every page arrives once, whole and right; the ledger
//! (read from the file, not from the processes) holds every order exactly
//! once; no back-end process is left behind.

mod common;

#[path = "../examples/support/web.rs"]
mod web;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::set_front::{self, Cluster, Front, REPLIES, REQUESTS};
use common::{bounded, wait_until};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use roam::RoamStream;
use roam_continuation::service_set::SessionSet;
use roam_continuation::ManagedSession;
use roam_service::Interval;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Child;

/// The static file the client downloads, in the site's `www/`.
const BIG: &str = "big.bin";
/// Bytes of the static file read and sent per step.
const FILE_CHUNK: usize = 64 << 10;
/// The largest request head the front-end accepts (bytes).
const MAX_HEAD: usize = 8192;

/// What the front-end is doing between two steps; stored in the session
/// (`web`) at a save, with the back-end's bytes of a frame not yet
/// forwarded (`back`) and the client's bytes of a request not yet handled
/// (`pending`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for a request.
    Idle,
    /// Sending the static file from `offset` (its head is out).
    Static { offset: u64, len: u64 },
    /// Forwarding an order's page from the back-end (its head is out).
    Dynamic,
}

impl State {
    fn encode(self) -> String {
        match self {
            State::Idle => "idle".into(),
            State::Static { offset, len } => format!("static {offset} {len}"),
            State::Dynamic => "dynamic".into(),
        }
    }

    fn decode(bytes: &[u8]) -> State {
        let text = String::from_utf8_lossy(bytes);
        let words: Vec<&str> = text.split(' ').collect();
        match words[..] {
            ["static", offset, len] => State::Static {
                offset: offset.parse().expect("offset"),
                len: len.parse().expect("len"),
            },
            ["dynamic"] => State::Dynamic,
            _ => State::Idle,
        }
    }
}

/// The site's document root: beside the host's set directories.
fn www(front: &Front) -> PathBuf {
    front
        .work
        .parent()
        .expect("the cluster directory")
        .join("www")
}

/// The front-end's loop for one session. Each step (a piece of the static
/// file sent, the client's bytes read, the back-end's bytes forwarded)
/// ends with the root's export, so at a freeze request, handled between
/// two steps, the root's state is its last export plus what the session
/// stores: the front-end's position and the bytes it holds.
async fn serve(
    front: Arc<Front>,
    session: ManagedSession,
    mut stream: RoamStream,
    mut set: SessionSet,
    mut child: Child,
    mut pending: Vec<u8>,
) {
    let www = www(&front);
    let mut state = session
        .retrieve("web")
        .map(|s| State::decode(&s))
        .unwrap_or(State::Idle);
    let mut back = session.retrieve("back").unwrap_or_default();
    let mut file: Option<std::fs::File> = None;
    let mut from_client = vec![0u8; 4096];
    let mut from_back = vec![0u8; 64 << 10];
    let mut piece = vec![0u8; FILE_CHUNK];
    loop {
        let sending = matches!(state, State::Static { .. });
        tokio::select! {
            biased;
            _ = session.freeze_requested() => {
                session.store("web", state.encode()).expect("store web");
                session.store("back", &back).expect("store back");
                match front.save(&session, set, &mut child, &pending).await {
                    Ok(()) => {
                        let _ = session.suspend(set_front::continuation(stream)).await;
                        return;
                    }
                    Err(s) => set = s,
                }
                continue;
            }
            _ = std::future::ready(()), if sending => {
                let State::Static { offset, len } = &mut state else { unreachable!() };
                if *offset == *len {
                    state = State::Idle;
                } else {
                    use std::os::unix::fs::FileExt;
                    if file.is_none() {
                        file = Some(std::fs::File::open(www.join(BIG)).expect("open the file"));
                    }
                    let want = (*len - *offset).min(FILE_CHUNK as u64) as usize;
                    file.as_ref()
                        .expect("open")
                        .read_exact_at(&mut piece[..want], *offset)
                        .expect("read the file");
                    if stream.write_all(&piece[..want]).await.is_err() {
                        return;
                    }
                    *offset += want as u64;
                }
            }
            r = stream.read(&mut from_client) => {
                match r {
                    Ok(0) | Err(_) => {
                        // The client is done: so is the set.
                        let _ = child.kill().await;
                        return;
                    }
                    Ok(n) => pending.extend_from_slice(&from_client[..n]),
                }
            }
            r = set.root().read(REPLIES, &mut from_back) => {
                match r {
                    Ok(n) if n > 0 => back.extend_from_slice(&from_back[..n]),
                    other => {
                        let e = other.err().unwrap_or_else(|| std::io::ErrorKind::UnexpectedEof.into());
                        back_end_gone(&session, &mut child, e).await;
                        return;
                    }
                }
                if !forward_frames(&mut back, &mut state, &mut stream).await {
                    return;
                }
            }
        }
        if state == State::Idle {
            if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                let head: Vec<u8> = pending.drain(..end + 4).collect();
                match start_request(&head, &www, &mut stream, &set).await {
                    Ok(next) => state = next,
                    Err(e) => {
                        back_end_gone(&session, &mut child, e).await;
                        return;
                    }
                }
            } else {
                assert!(pending.len() <= MAX_HEAD, "a request head too long");
            }
        }
        set.root()
            .export(b"", Interval::Deterministic)
            .await
            .expect("root export");
    }
}

/// Answers one request head: a dynamic order goes to the back-end, the
/// static file is sent from the next steps, anything else is not found.
/// An error if the back-end's channel failed.
async fn start_request(
    head: &[u8],
    www: &Path,
    stream: &mut RoamStream,
    set: &SessionSet,
) -> std::io::Result<State> {
    let text = String::from_utf8_lossy(head);
    let mut words = text.lines().next().unwrap_or("").split(' ');
    let target = match (words.next(), words.next(), words.next()) {
        (Some("GET"), Some(target), Some("HTTP/1.1")) => target.to_string(),
        _ => {
            let _ = stream
                .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                .await;
            return Ok(State::Idle);
        }
    };
    if let Some((id, size)) = web::order_query(&target) {
        let _ = stream
            .write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
                  Transfer-Encoding: chunked\r\n\r\n",
            )
            .await;
        set.root()
            .write_all(REQUESTS, format!("ORDER {id} {size}\n").as_bytes())
            .await?;
        return Ok(State::Dynamic);
    }
    if target.trim_start_matches('/') == BIG {
        let len = std::fs::metadata(www.join(BIG))?.len();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
             Content-Length: {len}\r\n\r\n"
        );
        let _ = stream.write_all(head.as_bytes()).await;
        return Ok(State::Static { offset: 0, len });
    }
    let _ = stream
        .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n\r\nnot found\n")
        .await;
    Ok(State::Idle)
}

/// Forwards every whole frame in `back` to the client as an HTTP chunk
/// (the empty frame ends the page: the last chunk, and the front-end is
/// idle again); a frame still arriving stays in `back`. False if the
/// client's stream failed.
async fn forward_frames(back: &mut Vec<u8>, state: &mut State, stream: &mut RoamStream) -> bool {
    while back.len() >= 4 {
        let len = u32::from_be_bytes(back[..4].try_into().expect("4 bytes")) as usize;
        assert!(len <= web::FRAME, "the back-end sent an oversized frame");
        assert_eq!(*state, State::Dynamic, "a frame outside a page");
        if back.len() < 4 + len {
            break;
        }
        let mut out = Vec::with_capacity(len + 16);
        if len == 0 {
            out.extend_from_slice(b"0\r\n\r\n");
            *state = State::Idle;
        } else {
            out.extend_from_slice(format!("{len:x}\r\n").as_bytes());
            out.extend_from_slice(&back[4..4 + len]);
            out.extend_from_slice(b"\r\n");
        }
        back.drain(..4 + len);
        if stream.write_all(&out).await.is_err() {
            return false;
        }
    }
    true
}

/// The back-end's channels failed: its state since its last export went
/// with it, so the session ends here; a move waiting for it is called off.
async fn back_end_gone(session: &ManagedSession, child: &mut Child, e: std::io::Error) {
    eprintln!("back-end cgi is gone ({e}); the session ends");
    session.decline_freeze(format!("back-end cgi is gone: {e}"));
    let _ = child.kill().await;
}

/// Two hosts serving the site in `dir/www` (a `len`-byte seeded
/// `big.bin`, its SHA-256 returned), their back-ends writing to the
/// ledger in `dir/out`.
async fn start_cluster(len: usize, seed: u64) -> (Cluster, [u8; 32]) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let www = dir.path().join("www");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::create_dir_all(&www).unwrap();
    let mut bytes = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
    std::fs::write(www.join(BIG), &bytes).unwrap();
    let digest = Sha256::digest(&bytes).into();
    let backend = tokio::task::spawn_blocking(|| common::example("web_server"))
        .await
        .expect("build");
    let c = set_front::start_cluster(
        dir,
        |f, s, st, set, c, p| Box::pin(serve(f, s, st, set, c, p)),
        |_, work| {
            Front::new(backend.clone(), "cgi", work, vec![out.clone().into()])
                .with_lead(vec!["cgi".into()])
        },
    )
    .await;
    (c, digest)
}

/// Reads one response head; its `Content-Length` if it has one, and
/// whether it is chunked.
async fn response_head(
    r: &mut BufReader<tokio::io::ReadHalf<RoamStream>>,
) -> Result<(Option<u64>, bool), String> {
    let mut line = String::new();
    r.read_line(&mut line).await.map_err(|e| e.to_string())?;
    if line != "HTTP/1.1 200 OK\r\n" {
        return Err(format!("status line {line:?}"));
    }
    let (mut len, mut chunked) = (None, false);
    loop {
        line.clear();
        r.read_line(&mut line).await.map_err(|e| e.to_string())?;
        if line == "\r\n" {
            return Ok((len, chunked));
        }
        if line.is_empty() {
            return Err("the response head ended early".into());
        }
        let (name, value) = line.trim_end().split_once(": ").ok_or("a header line")?;
        match name {
            "Content-Length" => len = Some(value.parse().map_err(|_| "Content-Length")?),
            "Transfer-Encoding" => chunked = value == "chunked",
            _ => {}
        }
    }
}

/// Reads a chunked body whole.
async fn chunked_body(
    r: &mut BufReader<tokio::io::ReadHalf<RoamStream>>,
) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        r.read_line(&mut line).await.map_err(|e| e.to_string())?;
        let len = usize::from_str_radix(line.trim_end(), 16)
            .map_err(|_| format!("a chunk size line {line:?}"))?;
        let at = body.len();
        body.resize(at + len, 0);
        r.read_exact(&mut body[at..])
            .await
            .map_err(|e| e.to_string())?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf).await.map_err(|e| e.to_string())?;
        if &crlf != b"\r\n" {
            return Err(format!("after a chunk: {crlf:?}"));
        }
        if len == 0 {
            return Ok(body);
        }
    }
}

/// What the client saw.
struct Seen {
    /// Body bytes of the download received so far.
    downloaded: AtomicU64,
    /// Orders answered so far.
    answered: AtomicU64,
}

/// The client: GETs the file (checks its length and SHA-256), then places
/// orders `0..orders` one after another and checks each page whole; then
/// checks that nothing more comes.
async fn client(
    stream: RoamStream,
    len: u64,
    digest: [u8; 32],
    orders: u64,
    seed: u64,
    seen: Arc<Seen>,
) -> Result<(), String> {
    let (r, mut w) = tokio::io::split(stream);
    let mut r = BufReader::with_capacity(64 << 10, r);
    let io = |e: std::io::Error| e.to_string();
    w.write_all(format!("GET /{BIG} HTTP/1.1\r\nHost: site\r\n\r\n").as_bytes())
        .await
        .map_err(io)?;
    let (got_len, _) = response_head(&mut r).await?;
    if got_len != Some(len) {
        return Err(format!("download length {got_len:?}, want {len}"));
    }
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut left = len;
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = r.read(&mut buf[..want]).await.map_err(io)?;
        if n == 0 {
            return Err(format!("the download ended {left} bytes short"));
        }
        hash.update(&buf[..n]);
        left -= n as u64;
        let before = seen.downloaded.fetch_add(n as u64, Ordering::SeqCst);
        // A reader slower than loopback (4 ms per 256 KiB), so that the
        // moves fall inside the download.
        if before >> 18 != (before + n as u64) >> 18 {
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
    }
    if <[u8; 32]>::from(hash.finalize()) != digest {
        return Err("the download's SHA-256 is not the file's".into());
    }
    for id in 0..orders {
        let size = web::order_size(seed, id);
        w.write_all(format!("GET /order?id={id}&size={size} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .map_err(io)?;
        let (_, chunked) = response_head(&mut r).await?;
        if !chunked {
            return Err(format!("order {id}: not chunked"));
        }
        // The page is on its way: a move now falls in its middle.
        tokio::time::sleep(Duration::from_millis(id % 4)).await;
        let body = chunked_body(&mut r).await?;
        if body != web::page(id, size) {
            return Err(format!(
                "order {id}: a wrong page ({} bytes, want {size})",
                body.len()
            ));
        }
        seen.answered.fetch_add(1, Ordering::SeqCst);
    }
    // Nothing more may come: a chunk twice would show here.
    match tokio::time::timeout(Duration::from_millis(300), r.read(&mut buf)).await {
        Err(_) | Ok(Ok(0)) => Ok(()),
        Ok(other) => Err(format!("after the last page: {other:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outside_client_downloads_and_orders_through_a_cluster_that_moves_its_session_and_every_byte_and_order_arrives_once(
) {
    bounded(Duration::from_secs(240), "test", async {
        let seed = web::seed();
        const LEN: usize = 32 << 20;
        const ORDERS: u64 = 60;
        let (c, digest) = start_cluster(LEN, seed).await;
        let c = Arc::new(c);
        let (session, stream) = c.connect("h0").await;
        let id = session.id().expect("a session id");
        let seen = Arc::new(Seen {
            downloaded: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        });
        let started = Instant::now();
        let task = tokio::spawn(client(
            stream,
            LEN as u64,
            digest,
            ORDERS,
            seed,
            seen.clone(),
        ));
        // Moves at seeded moments until the client is done; each noted
        // with where the client was.
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut in_download, mut in_orders, mut not_moved) = (0u32, 0u32, Vec::new());
        let mut stalls = Vec::new();
        while !task.is_finished() && started.elapsed() < Duration::from_secs(150) {
            tokio::time::sleep(Duration::from_millis(rng.gen_range(5..80))).await;
            if task.is_finished() {
                break;
            }
            let c2 = c.clone();
            wait_until(
                Duration::from_secs(10),
                "a host serves the session",
                move || c2.holder(id).is_some(),
            )
            .await;
            let at = c.holder(id).expect("held");
            let downloading = seen.downloaded.load(Ordering::SeqCst) < LEN as u64;
            let t = Instant::now();
            match c.nodes[at]
                .host
                .move_session(id, &c.nodes[1 - at].name)
                .await
            {
                Ok(_) if downloading => in_download += 1,
                Ok(_) => in_orders += 1,
                Err(e) => not_moved.push(e.to_string()),
            }
            stalls.push(t.elapsed());
        }
        let checked = bounded(Duration::from_secs(60), "the client", task)
            .await
            .expect("the client's task");
        stalls.sort();
        println!(
            "moved {in_download} times during the download and {in_orders} during the orders \
             ({} not moved: {not_moved:?}); {:?} in all; move calls took median {:?}, max {:?}",
            not_moved.len(),
            started.elapsed(),
            stalls.get(stalls.len() / 2),
            stalls.last()
        );
        if let Err(e) = checked {
            panic!("the client (seed {seed}): {e}");
        }
        assert!(in_download >= 2, "moves during the download: {in_download}");
        assert!(in_orders >= 2, "moves during the orders: {in_orders}");
        assert!(
            not_moved.len() as u32 <= (in_download + in_orders) / 4,
            "too many moves failed: {not_moved:?}"
        );
        // The ledger, outside the set: every order exactly once, in order.
        let ledger =
            std::fs::read_to_string(c.dir.path().join("out").join("ledger")).expect("the ledger");
        let want: String = (0..ORDERS)
            .map(|i| web::ledger_line(i, web::order_size(seed, i)))
            .collect();
        assert_eq!(ledger, want, "the ledger holds every order once");
        assert!(
            !c.dir.path().join("out").join("error").exists(),
            "a back-end failed: {:?}",
            std::fs::read_to_string(c.dir.path().join("out").join("error"))
        );
        let restarts: usize = c
            .nodes
            .iter()
            .map(|n| n.data.restored.load(Ordering::SeqCst))
            .sum();
        let landed = std::fs::read_to_string(c.dir.path().join("out").join("landed"))
            .map(|s| s.lines().count())
            .unwrap_or(0);
        println!(
            "back-ends restarted from a cut: {restarts}; orders a restarted back-end found already \
             in the ledger (not written again): {landed}"
        );
        assert!(restarts as u32 >= in_download + in_orders);
        let Ok(c) = Arc::try_unwrap(c) else {
            panic!("the cluster is still shared")
        };
        c.close_and_reap(&session).await;
    })
    .await;
}
