//! The paper's client-server benchmark: the server sends numbered updates on
//! one stream; after any suspension — including a restart of the server
//! process — the client must receive every index exactly once, in order.
//!
//! Protocol: the client opens a stream with metadata
//! `bench/updates count=<N> interval_us=<U>` (count 0 = forever, interval 0 =
//! as fast as flow control allows). The server sends updates of 16 bytes
//! each: the index (u64 LE) and `check(index)` (u64 LE); after `count`
//! updates it finishes the stream.
//!
//! Continuation: the attributes `offset` (bytes of the update sequence
//! written into the session, u64 LE; exported, so the client sees where the
//! server resumed), `count` and `interval_us`, the stream `updates`, and the
//! routine `updates`. The byte offset, not the index, is what makes a resume
//! exact: a half-written update is completed, never repeated.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::time::Duration;

use roam::{RoamStream, SessionHandle};
use roam_continuation::{Continuation, Generation, Host, ManagedSession, Resumed, Service};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Service name.
pub const SERVICE: &str = "bench";
/// Version property: continuations require it.
pub const VERSION: &str = "1";
/// Bytes per update.
pub const UPDATE_LEN: u64 = 16;
/// Stream metadata prefix.
pub const META: &str = "bench/updates";

/// Every suspension of this process (report, time from the freeze request
/// to the stored continuation), for measurements.
pub static REPORTS: std::sync::Mutex<Vec<(roam_continuation::SuspendReport, Duration)>> =
    std::sync::Mutex::new(Vec::new());

/// The second word of update `i`: any mix-up of bytes shows.
pub fn check(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED
}

/// Byte `k` of the update sequence.
pub fn byte_at(k: u64) -> u8 {
    let i = k / UPDATE_LEN;
    let w = if k % UPDATE_LEN < 8 { i } else { check(i) };
    w.to_le_bytes()[(k % 8) as usize]
}

fn fill(offset: u64, buf: &mut [u8]) {
    for (j, b) in buf.iter_mut().enumerate() {
        *b = byte_at(offset + j as u64);
    }
}

/// Parameters a client asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Updates to send before finishing (0 = forever).
    pub count: u64,
    /// Pause between updates (zero = flat out).
    pub interval: Duration,
}

impl Params {
    /// The stream metadata asking for these parameters.
    pub fn meta(&self) -> String {
        format!(
            "{META} count={} interval_us={}",
            self.count,
            self.interval.as_micros()
        )
    }

    /// Parses stream metadata.
    pub fn parse(meta: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(meta).ok()?;
        let mut words = text.split_whitespace();
        if words.next()? != META {
            return None;
        }
        let kv: HashMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
        Some(Self {
            count: kv.get("count").and_then(|v| v.parse().ok()).unwrap_or(0),
            interval: Duration::from_micros(
                kv.get("interval_us")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            ),
        })
    }
}

/// The service, with its resume routine. `generation` lets the caller pick
/// eager or lazy continuations.
pub fn service(generation: Generation, expiry: Duration) -> Service {
    Service::new(SERVICE)
        .version(VERSION)
        .property("update_len", UPDATE_LEN.to_string())
        .generation(generation)
        .expiry(expiry)
        .routine("updates", resume)
}

fn u64_attr(s: &ManagedSession, name: &str) -> u64 {
    s.retrieve(name)
        .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
        .map_or(0, u64::from_le_bytes)
}

/// The resume routine: picks the updates up at the stored offset.
pub async fn resume(mut r: Resumed) {
    let Some(stream) = r.take_stream("updates") else {
        eprintln!("session {}: updates stream is gone", r.session.id());
        return;
    };
    let s = r.session;
    let offset = u64_attr(&s, "offset");
    let params = Params {
        count: u64_attr(&s, "count"),
        interval: Duration::from_micros(u64_attr(&s, "interval_us")),
    };
    println!(
        "resumed {} at update {} after {:?}",
        s.id(),
        offset / UPDATE_LEN,
        r.suspended_for
    );
    run(s, stream, offset, params).await;
}

/// What `on_session` does: adopt the session, wait for its updates stream,
/// run it.
pub fn on_session(host: &Host, handle: SessionHandle) {
    on_session_with(host, handle, |_| {});
}

/// [`on_session`], with `setup` run on the adopted session first (set an
/// expiry, a dependency, a requirement...).
pub fn on_session_with(host: &Host, handle: SessionHandle, setup: impl FnOnce(&ManagedSession)) {
    let session = match host.adopt(SERVICE, handle) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot adopt session: {e}");
            return;
        }
    };
    setup(&session);
    tokio::spawn(async move {
        let (stream, meta) = tokio::select! {
            r = session.handle().accept_stream() => match r {
                Ok(x) => x,
                Err(_) => return,
            },
            // Suspended before asking for anything: nothing to continue.
            _ = session.freeze_requested() => return,
        };
        let Some(params) = Params::parse(&meta) else {
            eprintln!(
                "session {}: unexpected stream {:?}",
                session.id(),
                String::from_utf8_lossy(&meta)
            );
            return;
        };
        session.store("count", params.count.to_le_bytes()).ok();
        session
            .store(
                "interval_us",
                (params.interval.as_micros() as u64).to_le_bytes(),
            )
            .ok();
        run(session, stream, 0, params).await;
    });
}

/// Sends updates from byte `offset` until done or asked to freeze.
pub async fn run(session: ManagedSession, mut stream: RoamStream, mut offset: u64, params: Params) {
    let end = if params.count == 0 {
        u64::MAX
    } else {
        params.count * UPDATE_LEN
    };
    let mut buf = vec![0u8; 64 * 1024];
    let mut ticker = (!params.interval.is_zero()).then(|| {
        let mut t = tokio::time::interval(params.interval);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    // With an interval, updates become due one per tick.
    let mut due = if ticker.is_some() {
        offset.div_ceil(UPDATE_LEN) * UPDATE_LEN
    } else {
        end
    };
    let mut finished = false;
    loop {
        if offset >= end && !finished {
            let _ = stream.shutdown().await;
            finished = true;
        }
        let len = (due.min(end) - offset).min(buf.len() as u64) as usize;
        fill(offset, &mut buf[..len]);
        tokio::select! {
            biased;
            _ = session.freeze_requested() => {
                let asked = std::time::Instant::now();
                // Quiescent point: nothing is half-done except bytes of an
                // update, and `offset` says exactly how many went out.
                session.store("offset", offset.to_le_bytes()).ok();
                session.export("offset").ok();
                let cont = Continuation::new("updates").stream("updates", stream);
                match session.suspend(cont).await {
                    Ok(r) => {
                        println!(
                            "suspended {} at update {}: {} bytes stored ({} protocol, {} raw)",
                            r.id, offset / UPDATE_LEN, r.stored_bytes, r.protocol_bytes, r.raw_bytes
                        );
                        REPORTS.lock().unwrap_or_else(|e| e.into_inner()).push((r, asked.elapsed()));
                    }
                    Err(e) => eprintln!("suspend failed: {e}"),
                }
                return;
            }
            // One `write` is cancel-safe: it copies into the session or not at all.
            n = stream.write(&buf[..len]), if len > 0 => match n {
                Ok(n) => offset += n as u64,
                Err(_) => return, // the session is over
            },
            _ = async { ticker.as_mut().expect("checked").tick().await }, if len == 0 && !finished && ticker.is_some() => {
                due += UPDATE_LEN;
            }
            // All sent: keep the session (and answer freezes) until the
            // client has read everything and closes.
            _ = session.handle().closed(), if finished => return,
        }
    }
}

/// Client: reads updates, checking each one; calls `progress` with the
/// number received so far after every update. Returns the number received
/// at end-of-stream.
pub async fn read_updates(
    stream: &mut RoamStream,
    mut progress: impl FnMut(u64),
) -> Result<u64, String> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut have = Vec::with_capacity(UPDATE_LEN as usize);
    let mut next = 0u64;
    loop {
        let n = stream
            .read(&mut buf)
            .await
            .map_err(|e| format!("read after {next} updates: {e}"))?;
        if n == 0 {
            if !have.is_empty() {
                return Err(format!("stream ended inside update {next}"));
            }
            return Ok(next);
        }
        for &b in &buf[..n] {
            have.push(b);
            if have.len() == UPDATE_LEN as usize {
                let i = u64::from_le_bytes(have[..8].try_into().expect("8 bytes"));
                let c = u64::from_le_bytes(have[8..].try_into().expect("8 bytes"));
                if i != next {
                    return Err(format!("expected update {next}, got {i}"));
                }
                if c != check(i) {
                    return Err(format!("update {i} has a bad check word"));
                }
                next += 1;
                have.clear();
                progress(next);
            }
        }
    }
}
