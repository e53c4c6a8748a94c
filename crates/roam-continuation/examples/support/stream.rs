//! An Icecast-like broadcast: a source produces numbered chunks at a fixed
//! rate on each mount; every listener gets the chunks from its position on.
//! A listener's position is its continuation: a suspended listener costs no
//! socket and no task, and on resume it continues from its position (the
//! server catches it up from the history) or, if it asked so, jumps to live.
//!
//! Protocol: the client opens a stream with metadata
//! `stream/listen mount=<path> resume=continue|live`. Chunks are
//! `index` (u64 LE), `len` (u32 LE), then `len` payload bytes that depend on
//! the mount and the index. Chunk `i` of a mount is due at wall-clock time
//! `i × period`, so the live position is the same across server restarts.
//!
//! Continuation: attributes `mount`, `resume`, `index` (next chunk, u64 LE,
//! exported) and `sent` (bytes of that chunk already written, u64 LE), the
//! stream `audio`, the routine `listener`.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use roam::{RoamStream, SessionHandle};
use roam_continuation::{Continuation, Generation, Host, ManagedSession, Resumed, Service};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Service name.
pub const SERVICE: &str = "stream";
/// Stream metadata prefix.
pub const META: &str = "stream/listen";
/// Chunk header: index (8) and length (4).
pub const HEADER: usize = 12;
/// Chunks kept for listeners that fall behind (at 100/s, 100 s).
pub const HISTORY: u64 = 10_000;

/// What a listener wants after a suspension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnResume {
    /// Continue from the position it had (catching up from the history).
    Continue,
    /// Skip to the live position.
    Live,
}

impl OnResume {
    fn as_str(self) -> &'static str {
        match self {
            Self::Continue => "continue",
            Self::Live => "live",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "continue" => Some(Self::Continue),
            "live" => Some(Self::Live),
            _ => None,
        }
    }
}

/// The broadcast parameters (same on every start of the server).
#[derive(Debug, Clone, Copy)]
pub struct Broadcast {
    /// Time between chunks.
    pub period: Duration,
    /// Payload bytes per chunk.
    pub chunk_len: u32,
}

impl Broadcast {
    /// Index of the newest chunk available now.
    pub fn head(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        (now.as_micros() / self.period.as_micros().max(1)) as u64
    }

    /// How long until chunk `i` is available.
    fn until(&self, i: u64) -> Duration {
        let due = Duration::from_micros(i.saturating_mul(self.period.as_micros() as u64));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        due.saturating_sub(now)
    }

    /// The bytes of chunk `i` of `mount` (header and payload).
    pub fn chunk(&self, mount: &str, i: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.chunk_len as usize);
        out.extend_from_slice(&i.to_le_bytes());
        out.extend_from_slice(&self.chunk_len.to_le_bytes());
        let seed = mount_seed(mount);
        out.extend((0..self.chunk_len).map(|j| payload_byte(seed, i, j)));
        out
    }
}

fn mount_seed(mount: &str) -> u64 {
    mount.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Payload byte `j` of chunk `i`.
pub fn payload_byte(seed: u64, i: u64, j: u32) -> u8 {
    (seed
        ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(j).wrapping_mul(0xff51_afd7_ed55_8ccd))
    .rotate_left(j % 61) as u8
}

/// A listener's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Which broadcast.
    pub mount: String,
    /// What to do after a suspension.
    pub on_resume: OnResume,
}

impl Request {
    /// The stream metadata for this request.
    pub fn meta(&self) -> String {
        format!(
            "{META} mount={} resume={}",
            self.mount,
            self.on_resume.as_str()
        )
    }

    fn parse(meta: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(meta).ok()?;
        let mut words = text.split_whitespace();
        if words.next()? != META {
            return None;
        }
        let kv: HashMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
        Some(Self {
            mount: kv.get("mount")?.to_string(),
            on_resume: OnResume::parse(kv.get("resume").copied().unwrap_or("continue"))?,
        })
    }
}

/// The service: one routine, `listener`.
pub fn service(b: Broadcast) -> Service {
    Service::new(SERVICE)
        .version("1")
        .property("chunk_len", b.chunk_len.to_string())
        .generation(Generation::Eager)
        .expiry(Duration::from_secs(3600))
        .routine("listener", move |r| resume(b, r))
}

fn u64_attr(s: &ManagedSession, name: &str) -> u64 {
    s.retrieve(name)
        .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
        .map_or(0, u64::from_le_bytes)
}

async fn resume(b: Broadcast, mut r: Resumed) {
    let Some(stream) = r.take_stream("audio") else {
        return;
    };
    let s = r.session;
    let req = Request {
        mount: String::from_utf8_lossy(&s.retrieve("mount").unwrap_or_default()).into_owned(),
        on_resume: OnResume::parse(&String::from_utf8_lossy(
            &s.retrieve("resume").unwrap_or_default(),
        ))
        .unwrap_or(OnResume::Continue),
    };
    let index = u64_attr(&s, "index");
    let sent = u64_attr(&s, "sent");
    let jump = req.on_resume == OnResume::Live;
    println!(
        "listener {} back at chunk {index} after {:?} ({})",
        s.id(),
        r.suspended_for,
        req.on_resume.as_str()
    );
    run(b, s, stream, req, index, sent, jump).await;
}

/// `on_session`: adopt, read the request, stream from live.
pub fn on_session(b: Broadcast, host: &Host, handle: SessionHandle) {
    let Ok(session) = host.adopt(SERVICE, handle) else {
        return;
    };
    tokio::spawn(async move {
        let (stream, meta) = tokio::select! {
            r = session.handle().accept_stream() => match r {
                Ok(x) => x,
                Err(_) => return,
            },
            _ = session.freeze_requested() => return,
        };
        let Some(req) = Request::parse(&meta) else {
            return;
        };
        session.store("mount", req.mount.as_bytes()).ok();
        session.store("resume", req.on_resume.as_str()).ok();
        let start = b.head();
        run(b, session, stream, req, start, 0, false).await;
    });
}

/// Streams chunks from `index` (of which `sent` bytes already went out)
/// until the session ends or roam asks for the continuation. With
/// `jump_to_live`, the current chunk is completed, then the listener skips
/// to the live position.
async fn run(
    b: Broadcast,
    session: ManagedSession,
    mut stream: RoamStream,
    req: Request,
    mut index: u64,
    mut sent: u64,
    mut jump_to_live: bool,
) {
    let mut chunk = Vec::new();
    let mut chunk_index = u64::MAX;
    loop {
        if sent == 0 {
            let head = b.head();
            if jump_to_live {
                index = index.max(head);
                jump_to_live = false;
            }
            // Fell out of the history: continue from its oldest chunk.
            index = index.max(head.saturating_sub(HISTORY));
        }
        if chunk_index != index {
            chunk = b.chunk(&req.mount, index);
            chunk_index = index;
        }
        let wait = b.until(index);
        tokio::select! {
            biased;
            _ = session.freeze_requested() => {
                session.store("index", index.to_le_bytes()).ok();
                session.store("sent", sent.to_le_bytes()).ok();
                session.export("index").ok();
                match session.suspend(Continuation::new("listener").stream("audio", stream)).await {
                    Ok(r) => println!("listener {} suspended at chunk {index}: {} bytes stored", r.id, r.stored_bytes),
                    Err(e) => eprintln!("suspend failed: {e}"),
                }
                return;
            }
            () = tokio::time::sleep(wait), if !wait.is_zero() => {}
            n = stream.write(&chunk[sent as usize..]), if wait.is_zero() => match n {
                Ok(n) => {
                    sent += n as u64;
                    if sent as usize == chunk.len() {
                        index += 1;
                        sent = 0;
                    }
                }
                Err(_) => return,
            },
        }
    }
}

/// What a listener saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Listened {
    /// Chunks received.
    pub chunks: u64,
    /// Forward jumps (only allowed when listening with `resume=live`).
    pub jumps: u64,
    /// First and last chunk index.
    pub first: u64,
    /// Last chunk index.
    pub last: u64,
}

/// Client: reads and checks chunks until `want` arrived; calls `progress`
/// after each one.
pub async fn listen(
    stream: &mut RoamStream,
    req: &Request,
    want: u64,
    mut progress: impl FnMut(&Listened),
) -> Result<Listened, String> {
    let seed = mount_seed(&req.mount);
    let mut seen = Listened::default();
    let mut header = [0u8; HEADER];
    let mut payload = Vec::new();
    while seen.chunks < want {
        stream
            .read_exact(&mut header)
            .await
            .map_err(|e| format!("after {} chunks: {e}", seen.chunks))?;
        let i = u64::from_le_bytes(header[..8].try_into().expect("8"));
        let len = u32::from_le_bytes(header[8..].try_into().expect("4"));
        if len > 1 << 20 {
            return Err(format!("chunk {i}: absurd length {len}"));
        }
        payload.resize(len as usize, 0);
        stream
            .read_exact(&mut payload)
            .await
            .map_err(|e| format!("inside chunk {i}: {e}"))?;
        if let Some(j) = (0..len).find(|&j| payload[j as usize] != payload_byte(seed, i, j)) {
            return Err(format!("chunk {i}: byte {j} is wrong"));
        }
        if seen.chunks == 0 {
            seen.first = i;
        } else if i != seen.last + 1 {
            if req.on_resume == OnResume::Live && i > seen.last + 1 {
                seen.jumps += 1;
            } else {
                return Err(format!("chunk {i} after chunk {}", seen.last));
            }
        }
        seen.last = i;
        seen.chunks += 1;
        progress(&seen);
    }
    Ok(seen)
}
