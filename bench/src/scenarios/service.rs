//! Scenario 12: service continuations (issue 15), measured like §7 of the
//! paper (Sultan, Bohra, Iftode): the cost of each primitive of
//! `roam-service`'s sans-IO core (Table 3), and the throughput of a
//! two-process TTCP-like stream with a move of the whole set every 2 s
//! against none (Fig. 9-10).
//!
//! - **Primitives**, in this process, no I/O: `associate`, `export` eager
//!   (copies the snapshot) against `export_owned` lazy (swaps buffers) at
//!   several snapshot sizes; bytes through a `WriteEnd` and a `ReadEnd`
//!   (with the reader's log) against one plain `memcpy`; and a move's
//!   sans-IO work (`Cut::of`, `encode`, `decode`, `resume`) against the
//!   bytes the readers logged since their last export.
//! - **Stream**: a producer and a consumer, each a
//!   `roam_continuation::service_set::Member` on its own tokio task, joined
//!   by one Unix socket; the coordinator holds their `Control`s (over Unix
//!   socket pairs) and moves the set with `move_set` onto new socket pairs
//!   and new members restarted from their parts, as the service-set test
//!   does with processes. The producer writes a fixed pattern (byte `p` of
//!   the stream is `p % 251`) and exports its position after every chunk;
//!   the consumer checks every byte against the pattern and exports its
//!   position. A byte out of place fails the scenario.
//! - **Fig. 10**: the same stream with a producer that never exports, so
//!   each restart replays it from byte 0 and discards what the consumer
//!   already has; the stall after each move (until the consumer checks a
//!   new byte) against the stream position at the move.
//! - **Eager against lazy in the running stream** (Fig. 9's two servers):
//!   the producer writes 8 KiB chunks and exports its position padded to
//!   10 KiB after each, with `Member::export` (eager: the snapshot copied
//!   at every export) or `Member::export_owned` (lazy: two alternating
//!   buffers, no copy); the consumer exports every 8 KiB. Each mode with
//!   moves every 0.5 s and without, interleaved; throughput, the
//!   producer's mean time per export call, and move times.
//!
//! Timings never fail the run; a mismatch or a refused move does.

use std::hint::black_box;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam_continuation::service_set::{join, move_set, Control, Member, MoveOutcome};
use roam_service::{ChannelId, Cut, Interval, Limits, Process};
use serde::Serialize;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;

use crate::peers::Lab;
use crate::scenarios::progress;
use crate::stats::{median, summary, Summary};
use crate::Ctx;

/// The stream's one channel, producer to consumer.
const DATA: ChannelId = ChannelId(1);
/// Period of the stream's byte pattern (a prime, so chunk boundaries drift).
const PERIOD: usize = 251;
/// Bytes the producer writes per call (and exports after).
const CHUNK: usize = 64 << 10;
/// Bytes between the consumer's exports in the large-log run (half the
/// default log cap of 16 MiB).
const BIG_LOG: usize = 8 << 20;
/// Seconds between moves in the moving runs (the paper's shortest period).
const MOVE_EVERY_S: f64 = 2.0;
/// Bytes the producer writes between exports in the eager/lazy runs (the
/// paper's 8 KB).
const EXPORT_CHUNK: usize = 8 << 10;
/// Bytes of the producer's snapshot in the eager/lazy runs (the paper's
/// largest, 10 KB).
const EXPORT_STATE: usize = 10 << 10;
/// Seconds between moves in the moving eager/lazy runs (short, so that a
/// quick run of 2 s moves 3 times).
const EXPORT_MOVE_EVERY_S: f64 = 0.5;

/// How the stream's producer exports its position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ProducerExport {
    /// `Member::export`: the snapshot copied at every export.
    Eager,
    /// `Member::export_owned`: two alternating buffers, no copy.
    Lazy,
    /// Never: each restart replays the stream from byte 0 (Fig. 10).
    Never,
}

impl ProducerExport {
    /// The word for the report.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ProducerExport::Eager => "eager",
            ProducerExport::Lazy => "lazy",
            ProducerExport::Never => "never",
        }
    }
}

/// The producer of one stream run.
#[derive(Clone, Copy, Debug)]
struct Producer {
    /// How it exports.
    export: ProducerExport,
    /// Bytes of its snapshot (its 8-byte position, padded).
    state_bytes: usize,
    /// Bytes it writes between two exports.
    chunk: usize,
}

/// The producer of the stream runs before the eager/lazy ones: an eager
/// export of its 8-byte position after every 64 KiB.
const STANDARD: Producer = Producer {
    export: ProducerExport::Eager,
    state_bytes: 8,
    chunk: CHUNK,
};

/// One export size: eager against lazy.
#[derive(Debug, Serialize)]
pub(crate) struct ExportRow {
    /// Bytes of the exported snapshot.
    pub(crate) snapshot_bytes: usize,
    /// Median ns of `Process::export` (copies the snapshot).
    pub(crate) eager_ns: f64,
    /// Median ns of `Process::export_owned` (swaps buffers).
    pub(crate) lazy_ns: f64,
    /// eager / lazy.
    pub(crate) ratio: f64,
}

/// One logged size: a move's sans-IO work.
#[derive(Debug, Serialize)]
pub(crate) struct CutRow {
    /// Bytes the consumer read since its last export (its log).
    pub(crate) logged_bytes: usize,
    /// Bytes of the encoded cut.
    pub(crate) encoded_bytes: usize,
    /// Median µs of `Cut::of` over both processes.
    pub(crate) of_us: f64,
    /// Median µs of `Cut::encode`.
    pub(crate) encode_us: f64,
    /// Median µs of `Cut::decode`.
    pub(crate) decode_us: f64,
    /// Median µs of `Cut::resume`.
    pub(crate) resume_us: f64,
    /// Median µs of the four together (each sample timed whole).
    pub(crate) total_us: f64,
}

/// One run of the stream.
#[derive(Debug, Serialize)]
pub(crate) struct StreamRun {
    /// Seconds between moves; `None`: no move.
    pub(crate) move_every_s: Option<f64>,
    /// Bytes the consumer reads between its exports (what a move carries
    /// back in its log is up to this).
    pub(crate) consumer_export_bytes: usize,
    /// Whether the producer exports its position after every chunk
    /// (`false`: never, the paper's Fig. 10: each restart replays the
    /// whole stream, discarded up to the consumer's position).
    pub(crate) producer_exports: bool,
    /// How the producer exports.
    pub(crate) export: ProducerExport,
    /// Bytes of the producer's snapshot.
    pub(crate) state_bytes: usize,
    /// Bytes the producer writes between two exports.
    pub(crate) producer_chunk: usize,
    /// Mean ns of the producer's export calls (0 if it never exports).
    pub(crate) export_ns: f64,
    /// How long the run streamed.
    pub(crate) seconds: f64,
    /// Bytes the consumer checked, in stream order, not counting re-reads.
    pub(crate) bytes: u64,
    /// `bytes` per second, in MB (10^6).
    pub(crate) mb_per_s: f64,
    /// Moves made during the run.
    pub(crate) moves: usize,
    /// Each move's `move_set`, from the first freeze to the last thaw (ms).
    pub(crate) move_ms: Vec<f64>,
    /// Each move's restarted parts, encoded (bytes): snapshots and logs.
    pub(crate) cut_bytes: Vec<usize>,
    /// Each move's stream position (bytes the consumer had checked when
    /// the move began): what a producer that never exports replays and
    /// has discarded.
    pub(crate) position_at_move: Vec<u64>,
    /// Each move's stall: ms from the end of `move_set` until the consumer
    /// checks a byte past `position_at_move` (the producer's discarded
    /// replay and the consumer's log replay), at most until the next move.
    pub(crate) stall_ms: Vec<f64>,
}

/// Scenario 12's result.
#[derive(Debug, Serialize)]
pub(crate) struct Service {
    /// Median ns per `associate` (a fresh process's writer and reader end,
    /// `Process::new` included).
    pub(crate) associate_ns: f64,
    /// Eager against lazy export, one row per snapshot size.
    pub(crate) exports: Vec<ExportRow>,
    /// GB/s through a writer and a reader end (write, send, receive, read,
    /// with the reader's log trimmed by an export every MiB).
    pub(crate) ends_gb_per_s: f64,
    /// GB/s of one plain copy of the same chunks.
    pub(crate) memcpy_gb_per_s: f64,
    /// ends / memcpy throughput.
    pub(crate) ends_ratio: f64,
    /// A move's sans-IO work, one row per logged size.
    pub(crate) cuts: Vec<CutRow>,
    /// Runs of the stream, alternating none / moves, then moves with a
    /// consumer that exports rarely (large logs).
    pub(crate) stream: Vec<StreamRun>,
    /// Median MB/s with moves / without (the consumer exporting every
    /// chunk in both).
    pub(crate) stream_ratio: f64,
    /// Fig. 10: MB/s with moves of a producer that never exports / the
    /// median MB/s with moves of one that exports every chunk.
    pub(crate) never_exporting_ratio: f64,
    /// Eager against lazy in the running stream: median MB/s of the lazy
    /// runs / the eager runs, without moves.
    pub(crate) lazy_eager_still: f64,
    /// The same with moves every 0.5 s.
    pub(crate) lazy_eager_moving: f64,
    /// Median over the eager runs of the producer's mean ns per export.
    pub(crate) eager_export_ns: f64,
    /// Median over the lazy runs of the producer's mean ns per export.
    pub(crate) lazy_export_ns: f64,
    /// Moves of the eager runs (ms, freeze to thaw).
    pub(crate) eager_move_ms: Summary,
    /// Moves of the lazy runs (ms, freeze to thaw).
    pub(crate) lazy_move_ms: Summary,
    /// Over every move of every run (ms).
    pub(crate) move_ms: Summary,
    /// What was run, for the report.
    pub(crate) notes: Vec<String>,
}

/// Median ns per call of `f`, over `samples` samples of `iters` calls.
fn per_call_ns(samples: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        v.push(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    median(&v)
}

/// Calls per sample so that one sample copies about 16 MiB (at least 10).
fn iters_for(bytes: usize) -> usize {
    ((16usize << 20) / bytes.max(1)).clamp(10, 20_000)
}

fn bad(e: roam_service::Error) -> io::Error {
    io::Error::other(e.to_string())
}

/// Limits with room for the largest logged size measured.
fn big_limits() -> Limits {
    Limits {
        log_bytes: 64 << 20,
        hold_bytes: 64 << 20,
        send_bytes: 64 << 20,
    }
}

/// What [`primitives`] measured.
struct Primitives {
    /// Median ns per `associate`.
    associate_ns: f64,
    /// Eager against lazy export, per snapshot size.
    exports: Vec<ExportRow>,
    /// GB/s through the ends, GB/s of one copy, and their ratio.
    through: [f64; 3],
    /// A move's sans-IO work, per logged size.
    cuts: Vec<CutRow>,
}

/// The sans-IO primitives (Table 3 and more).
fn primitives(full: bool) -> io::Result<Primitives> {
    let samples = if full { 31 } else { 11 };
    let limits = Limits::default();
    // associate: two per fresh process.
    let associate_ns = per_call_ns(samples, 2000, || {
        let mut p = Process::new(limits);
        let _ = black_box(p.associate_writer(ChannelId(1)).is_ok());
        let _ = black_box(p.associate_reader(ChannelId(2)).is_ok());
        black_box(p);
    }) / 2.0;

    // export, eager against lazy.
    let mut sizes = vec![1 << 10, 64 << 10, 1 << 20];
    if full {
        sizes.push(16 << 20);
    }
    let mut exports = Vec::new();
    for &size in &sizes {
        let mut p = Process::new(limits);
        p.associate_writer(ChannelId(1)).map_err(bad)?;
        p.associate_reader(ChannelId(2)).map_err(bad)?;
        let snap = vec![7u8; size];
        let iters = iters_for(size);
        let eager_ns = per_call_ns(samples, iters, || {
            p.export(black_box(&snap), Interval::Deterministic);
        });
        // Lazy: the application fills one buffer while the other is the
        // exported snapshot; the export swaps them.
        let mut spare = vec![7u8; size];
        let lazy_ns = per_call_ns(samples, iters, || {
            let buf = std::mem::take(&mut spare);
            spare = p
                .export_owned(black_box(buf), Interval::Deterministic)
                .unwrap_or_default();
        });
        if p.snapshot().map(<[u8]>::len) != Some(size) {
            return Err(io::Error::other("export lost the snapshot"));
        }
        exports.push(ExportRow {
            snapshot_bytes: size,
            eager_ns,
            lazy_ns,
            ratio: crate::stats::ratio(eager_ns, lazy_ns),
        });
    }

    // Bytes through the ends against one memcpy.
    let total: usize = if full { 256 << 20 } else { 64 << 20 };
    let chunk = pattern(0, CHUNK);
    let mut out = vec![0u8; CHUNK];
    let mut ends = Vec::new();
    let mut copies = Vec::new();
    for _ in 0..samples.min(11) {
        let mut w = Process::new(limits);
        let mut r = Process::new(limits);
        w.associate_writer(DATA).map_err(bad)?;
        r.associate_reader(DATA).map_err(bad)?;
        let t = Instant::now();
        let mut moved = 0usize;
        while moved < total {
            let we = w.writer(DATA).map_err(bad)?;
            let n = we.write(&chunk).map_err(bad)?;
            let k = we.pending().len();
            r.reader(DATA).map_err(bad)?.receive(we.pending());
            we.sent(k).map_err(bad)?;
            let re = r.reader(DATA).map_err(bad)?;
            let mut got = 0;
            while got < n {
                got += re.read(&mut out);
            }
            moved += n;
            if moved % (1 << 20) == 0 {
                r.export(&[], Interval::Deterministic);
                w.export(&[], Interval::Deterministic);
            }
        }
        ends.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        if black_box(&out[..]) != &chunk[..] {
            return Err(io::Error::other("bytes through the ends changed"));
        }
        let t = Instant::now();
        let mut moved = 0usize;
        while moved < total {
            out.copy_from_slice(black_box(&chunk));
            black_box(&mut out);
            moved += CHUNK;
        }
        copies.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let (ends_gbs, copy_gbs) = (median(&ends), median(&copies));
    let through = [ends_gbs, copy_gbs, crate::stats::ratio(ends_gbs, copy_gbs)];

    // A move's sans-IO work against the logged bytes.
    let mut logged_sizes = vec![0usize, 64 << 10, 1 << 20];
    if full {
        logged_sizes.push(16 << 20);
    } else {
        logged_sizes.push(4 << 20);
    }
    let limits = big_limits();
    let mut cuts = Vec::new();
    for &logged in &logged_sizes {
        let mut w = Process::new(limits);
        let mut r = Process::new(limits);
        w.associate_writer(DATA).map_err(bad)?;
        r.associate_reader(DATA).map_err(bad)?;
        w.export(&0u64.to_be_bytes(), Interval::Deterministic);
        r.export(&0u64.to_be_bytes(), Interval::Deterministic);
        let data = pattern(0, logged);
        let we = w.writer(DATA).map_err(bad)?;
        if we.write(&data).map_err(bad)? != logged {
            return Err(io::Error::other("the writer did not take the log's bytes"));
        }
        let k = we.pending().len();
        r.reader(DATA).map_err(bad)?.receive(we.pending());
        we.sent(k).map_err(bad)?;
        let re = r.reader(DATA).map_err(bad)?;
        re.consume(re.unread().len()).map_err(bad)?;
        let n = (samples / 2).max(5);
        let (mut of, mut enc, mut dec, mut res, mut tot) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut encoded_bytes = 0;
        for _ in 0..n {
            let t0 = Instant::now();
            let cut = Cut::of([&w, &r]).map_err(bad)?;
            let t1 = Instant::now();
            let bytes = cut.encode();
            let t2 = Instant::now();
            let back = Cut::decode(&bytes).map_err(bad)?;
            let t3 = Instant::now();
            let procs = back.resume(limits).map_err(bad)?;
            let t4 = Instant::now();
            // The consumer restarts at its last export and reads the
            // whole log again.
            if procs.len() != 2 || back.logged_bytes() != logged as u64 {
                return Err(io::Error::other("the cut lost its log"));
            }
            encoded_bytes = bytes.len();
            let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
            of.push(us(t0, t1));
            enc.push(us(t1, t2));
            dec.push(us(t2, t3));
            res.push(us(t3, t4));
            tot.push(us(t0, t4));
            black_box(procs);
        }
        cuts.push(CutRow {
            logged_bytes: logged,
            encoded_bytes,
            of_us: median(&of),
            encode_us: median(&enc),
            decode_us: median(&dec),
            resume_us: median(&res),
            total_us: median(&tot),
        });
    }
    Ok(Primitives {
        associate_ns,
        exports,
        through,
        cuts,
    })
}

/// `len` bytes of the stream's pattern from stream position `at`.
fn pattern(at: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((at + i) % PERIOD as u64) as u8)
        .collect()
}

/// What the tasks of a stream run share with the coordinator.
struct Shared {
    /// Highest stream position the consumer checked.
    checked: AtomicU64,
    /// The first mismatch or failure of a member's task.
    failure: Mutex<Option<String>>,
    /// Set when the run ends.
    stop: AtomicBool,
    /// ns the producer spent in its export calls.
    export_ns: AtomicU64,
    /// The producer's export calls.
    exports: AtomicU64,
}

impl Shared {
    fn fail(&self, why: String) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        f.get_or_insert(why);
    }
}

/// One site's members: their controls (producer, consumer) and tasks.
struct Site {
    controls: Vec<Control>,
    tasks: Vec<JoinHandle<()>>,
}

impl Site {
    /// Ends every task of this site (frozen or ended members wait forever).
    fn abort(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

/// The producer: its snapshot is its stream position (padded to
/// `how.state_bytes`), exported after every `how.chunk` bytes as
/// `how.export` says (never: it restarts from position 0).
async fn producer(m: Member, shared: Arc<Shared>, how: Producer) -> io::Result<()> {
    let mut pos = m
        .snapshot()
        .and_then(|s| {
            s.get(..8)
                .map(|b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])))
        })
        .unwrap_or(0);
    // The pattern from offset 0 to PERIOD + chunk: any chunk is a slice.
    let chunk = how.chunk;
    let pat = pattern(0, PERIOD + chunk);
    let size = how.state_bytes.max(8);
    // The eager export's state, or the lazy export's spare buffer (the
    // other one is the exported snapshot).
    let mut state = vec![0u8; size];
    while !shared.stop.load(Ordering::Relaxed) {
        let off = (pos % PERIOD as u64) as usize;
        m.write_all(DATA, &pat[off..off + chunk]).await?;
        pos += chunk as u64;
        let t = Instant::now();
        match how.export {
            ProducerExport::Never => continue,
            ProducerExport::Eager => {
                state[..8].copy_from_slice(&pos.to_be_bytes());
                m.export(&state, Interval::Deterministic).await?;
            }
            ProducerExport::Lazy => {
                state[..8].copy_from_slice(&pos.to_be_bytes());
                let snapshot = std::mem::take(&mut state);
                state = m
                    .export_owned(snapshot, Interval::Deterministic)
                    .await?
                    .unwrap_or_default();
                // The first spare is a restarted member's imported
                // snapshot, or none.
                state.resize(size, 0);
            }
        }
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        shared.export_ns.fetch_add(ns, Ordering::Relaxed);
        shared.exports.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// The consumer: checks every byte; its snapshot is its stream position.
async fn consumer(m: Member, shared: Arc<Shared>, export_every: usize) -> io::Result<()> {
    let mut pos = m
        .snapshot()
        .and_then(|s| {
            s.get(..8)
                .map(|b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])))
        })
        .unwrap_or(0);
    let pat = pattern(0, PERIOD + CHUNK);
    let mut buf = vec![0u8; CHUNK];
    let mut since_export = 0usize;
    loop {
        let n = m.read(DATA, &mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        let off = (pos % PERIOD as u64) as usize;
        if buf[..n] != pat[off..off + n] {
            let i = (0..n).find(|&i| buf[i] != pat[off + i]).unwrap_or(0);
            return Err(io::Error::other(format!(
                "stream byte {} is {} where {} was due",
                pos + i as u64,
                buf[i],
                pat[off + i]
            )));
        }
        pos += n as u64;
        shared.checked.fetch_max(pos, Ordering::Relaxed);
        since_export += n;
        if since_export >= export_every {
            m.export(&pos.to_be_bytes(), Interval::Deterministic)
                .await?;
            since_export = 0;
        }
    }
}

/// Starts both members (fresh, or from restarted parts) on new sockets.
async fn start_site(
    parts: Option<Vec<Vec<u8>>>,
    limits: Limits,
    shared: &Arc<Shared>,
    export_every: usize,
    how: Producer,
) -> io::Result<Site> {
    let (w_sock, r_sock) = UnixStream::pair()?;
    let mut socks = [Some(w_sock), Some(r_sock)];
    let mut controls = Vec::new();
    let mut tasks = Vec::new();
    for (i, role) in ["producer", "consumer"].into_iter().enumerate() {
        let (mut mine, theirs) = UnixStream::pair()?;
        let part = parts.as_ref().and_then(|p| p.get(i).cloned());
        let (member, control) = tokio::join!(
            join(&mut mine, role, limits),
            Control::accept(theirs, |_| part)
        );
        let (member, mut control) = (member?, control?);
        let sock = socks[i]
            .take()
            .ok_or_else(|| io::Error::other("socket used twice"))?;
        if i == 0 {
            member.add_writer(DATA, sock)?;
        } else {
            member.add_reader(DATA, sock)?;
        }
        member.ready(&mut mine).await?;
        control.ready().await?;
        controls.push(control);
        let m = member.clone();
        let s = shared.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = m.serve_control(mine).await {
                s.fail(format!("{role}'s control: {e}"));
            }
        }));
        let s = shared.clone();
        tasks.push(tokio::spawn(async move {
            let r = if i == 0 {
                producer(member, s.clone(), how).await
            } else {
                consumer(member, s.clone(), export_every).await
            };
            if let Err(e) = r {
                s.fail(format!("{role}: {e}"));
            }
        }));
    }
    Ok(Site { controls, tasks })
}

/// One stream run of `seconds`, moving the set every `every` seconds; the
/// consumer exports every `export_every` bytes, the producer as `how`
/// says.
async fn stream_run(
    seconds: f64,
    every: Option<f64>,
    export_every: usize,
    how: Producer,
) -> io::Result<StreamRun> {
    let limits = Limits::default();
    let shared = Arc::new(Shared {
        checked: AtomicU64::new(0),
        failure: Mutex::new(None),
        stop: AtomicBool::new(false),
        export_ns: AtomicU64::new(0),
        exports: AtomicU64::new(0),
    });
    let mut site = start_site(None, limits, &shared, export_every, how).await?;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(seconds);
    let mut move_ms = Vec::new();
    let mut cut_bytes = Vec::new();
    let mut position_at_move = Vec::new();
    let mut stall_ms = Vec::new();
    let mut next = every.map(|e| t0 + Duration::from_secs_f64(e));
    let result = loop {
        let wake = next.map_or(end, |n| n.min(end));
        tokio::time::sleep_until(wake.into()).await;
        if let Some(why) = shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            break Err(io::Error::other(why));
        }
        if Instant::now() >= end {
            break Ok(());
        }
        let Some(n) = next else { continue };
        next = Some(n + Duration::from_secs_f64(every.unwrap_or(seconds)));
        let mut new_site = None;
        let mut size = 0;
        // The stream position once the set is frozen (read in `start`,
        // after every part was taken).
        let mut at = 0;
        let t = Instant::now();
        let outcome = {
            let (slot, size, at, shared) = (&mut new_site, &mut size, &mut at, &shared);
            move_set(&mut site.controls, limits, |parts| async move {
                *at = shared.checked.load(Ordering::Relaxed);
                *size = parts.iter().map(Vec::len).sum();
                let s = start_site(Some(parts), limits, shared, export_every, how).await?;
                let controls = s.controls;
                *slot = Some(s.tasks);
                Ok(controls)
            })
            .await
        };
        let ms = t.elapsed().as_secs_f64() * 1e3;
        match outcome {
            Ok(MoveOutcome::Moved(controls)) => {
                let old = std::mem::replace(
                    &mut site,
                    Site {
                        controls,
                        tasks: new_site.unwrap_or_default(),
                    },
                );
                old.abort();
                move_ms.push(ms);
                cut_bytes.push(size);
                position_at_move.push(at);
                // The stall: polled every 100 µs, bounded by the next move
                // and the run's end.
                let moved = Instant::now();
                let limit = next.map_or(end, |n| n.min(end));
                while shared.checked.load(Ordering::Relaxed) <= at && Instant::now() < limit {
                    tokio::time::sleep(Duration::from_micros(100)).await;
                }
                stall_ms.push(moved.elapsed().as_secs_f64() * 1e3);
            }
            Ok(MoveOutcome::Refused(why)) => {
                break Err(io::Error::other(format!("move refused: {why}")))
            }
            Ok(MoveOutcome::DestinationFailed(e)) => {
                break Err(io::Error::other(format!("destination failed: {e}")))
            }
            Err(e) => break Err(e),
        }
    };
    let elapsed = t0.elapsed().as_secs_f64();
    let bytes = shared.checked.load(Ordering::Relaxed);
    shared.stop.store(true, Ordering::Relaxed);
    site.abort();
    result?;
    if bytes == 0 {
        return Err(io::Error::other("the stream moved no byte"));
    }
    let exports = shared.exports.load(Ordering::Relaxed);
    Ok(StreamRun {
        move_every_s: every,
        consumer_export_bytes: export_every,
        producer_exports: how.export != ProducerExport::Never,
        export: how.export,
        state_bytes: how.state_bytes,
        producer_chunk: how.chunk,
        export_ns: if exports == 0 {
            0.0
        } else {
            shared.export_ns.load(Ordering::Relaxed) as f64 / exports as f64
        },
        seconds: elapsed,
        bytes,
        mb_per_s: bytes as f64 / elapsed / 1e6,
        moves: move_ms.len(),
        move_ms,
        cut_bytes,
        position_at_move,
        stall_ms,
    })
}

/// Runs scenario 12.
pub(crate) async fn run(ctx: Arc<Ctx>, _lab: Arc<Lab>) -> io::Result<Service> {
    let full = ctx.plan.mode == "full";
    progress("service: primitives (sans-IO)");
    let Primitives {
        associate_ns,
        exports,
        through,
        cuts,
    } = tokio::task::spawn_blocking(move || primitives(full))
        .await
        .map_err(io::Error::other)??;
    let seconds = ctx.plan.service_stream_seconds;
    let mut stream = Vec::new();
    for round in 0..ctx.plan.service_rounds {
        // Alternate which goes first, so drift hits both alike.
        let order = if round % 2 == 0 {
            [None, Some(MOVE_EVERY_S)]
        } else {
            [Some(MOVE_EVERY_S), None]
        };
        for every in order {
            progress(&format!(
                "service: stream {seconds} s, {}",
                every.map_or("no move".into(), |e| format!("a move every {e} s"))
            ));
            stream.push(stream_run(seconds, every, CHUNK, STANDARD).await?);
        }
    }
    // Move time against logged bytes over real sockets: the consumer
    // exports every BIG_LOG bytes, so each move carries up to that back.
    progress(&format!(
        "service: stream {seconds} s, a move every {MOVE_EVERY_S} s, consumer exports every {} MiB",
        BIG_LOG >> 20
    ));
    stream.push(stream_run(seconds, Some(MOVE_EVERY_S), BIG_LOG, STANDARD).await?);
    // Fig. 10: a producer that never exports replays the whole stream
    // after each move, discarded up to the consumer's position.
    progress(&format!(
        "service: stream {seconds} s, a move every {MOVE_EVERY_S} s, the producer never exports"
    ));
    let never_how = Producer {
        export: ProducerExport::Never,
        ..STANDARD
    };
    let never = stream_run(seconds, Some(MOVE_EVERY_S), CHUNK, never_how).await?;
    let never_mbs = never.mb_per_s;
    stream.push(never);
    // Eager against lazy in the running stream, interleaved (the order
    // flips each round, so drift hits both alike).
    let export_seconds = ctx.plan.service_export_seconds;
    for round in 0..ctx.plan.service_rounds {
        let mut order = [ProducerExport::Eager, ProducerExport::Lazy];
        if round % 2 == 1 {
            order.reverse();
        }
        for every in [None, Some(EXPORT_MOVE_EVERY_S)] {
            for export in order {
                progress(&format!(
                    "service: stream {export_seconds} s, {} export of {} KiB every {} KiB, {}",
                    export.as_str(),
                    EXPORT_STATE >> 10,
                    EXPORT_CHUNK >> 10,
                    every.map_or("no move".into(), |e| format!("a move every {e} s"))
                ));
                let how = Producer {
                    export,
                    state_bytes: EXPORT_STATE,
                    chunk: EXPORT_CHUNK,
                };
                stream.push(stream_run(export_seconds, every, EXPORT_CHUNK, how).await?);
            }
        }
    }
    let standard = |r: &StreamRun| {
        r.consumer_export_bytes == CHUNK
            && r.export == STANDARD.export
            && r.state_bytes == STANDARD.state_bytes
            && r.producer_chunk == STANDARD.chunk
    };
    let mbs = |moving: bool| -> Vec<f64> {
        stream
            .iter()
            .filter(|r| r.move_every_s.is_some() == moving && standard(r))
            .map(|r| r.mb_per_s)
            .collect()
    };
    let stream_ratio = crate::stats::ratio(median(&mbs(true)), median(&mbs(false)));
    let never_exporting_ratio = crate::stats::ratio(never_mbs, median(&mbs(true)));
    let of_mode = |export: ProducerExport| {
        stream
            .iter()
            .filter(move |r| r.export == export && r.state_bytes == EXPORT_STATE)
    };
    let mode_mbs = |export: ProducerExport, moving: bool| -> f64 {
        let v: Vec<f64> = of_mode(export)
            .filter(|r| r.move_every_s.is_some() == moving)
            .map(|r| r.mb_per_s)
            .collect();
        median(&v)
    };
    let mode_export_ns = |export: ProducerExport| -> f64 {
        let v: Vec<f64> = of_mode(export).map(|r| r.export_ns).collect();
        median(&v)
    };
    let mode_moves = |export: ProducerExport| -> Summary {
        let v: Vec<f64> = of_mode(export).flat_map(|r| r.move_ms.clone()).collect();
        summary(&v)
    };
    let lazy_eager_still = crate::stats::ratio(
        mode_mbs(ProducerExport::Lazy, false),
        mode_mbs(ProducerExport::Eager, false),
    );
    let lazy_eager_moving = crate::stats::ratio(
        mode_mbs(ProducerExport::Lazy, true),
        mode_mbs(ProducerExport::Eager, true),
    );
    let eager_export_ns = mode_export_ns(ProducerExport::Eager);
    let lazy_export_ns = mode_export_ns(ProducerExport::Lazy);
    let eager_move_ms = mode_moves(ProducerExport::Eager);
    let lazy_move_ms = mode_moves(ProducerExport::Lazy);
    let all_moves: Vec<f64> = stream.iter().flat_map(|r| r.move_ms.clone()).collect();
    Ok(Service {
        associate_ns,
        exports,
        ends_gb_per_s: through[0],
        memcpy_gb_per_s: through[1],
        ends_ratio: through[2],
        cuts,
        move_ms: summary(&all_moves),
        stream,
        stream_ratio,
        never_exporting_ratio,
        lazy_eager_still,
        lazy_eager_moving,
        eager_export_ns,
        lazy_export_ns,
        eager_move_ms,
        lazy_move_ms,
        notes: vec![
            format!(
                "Stream: one Unix socket producer -> consumer, {CHUNK}-byte writes, each followed by the producer's export (its 8-byte position); the consumer exports every {CHUNK} bytes read and checks every byte."
            ),
            "Moves in process: new socket pairs and members restarted from their parts (tokio tasks), not new processes; the move time is move_set from the first freeze to the last thaw.".into(),
        ],
    })
}
