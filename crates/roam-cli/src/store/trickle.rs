//! Trickle write-back (`roam resume --vm --demand-fetch --trickle RATE`):
//! while the resumed guest runs, the disk chunks it wrote go to the store
//! in the background, at most RATE bits per second of chunk objects, so the
//! next `roam suspend --vm` finds them stored and has little left to push
//! (ISR's trickle reintegration, from Coda; the paper's "window of
//! vulnerability" between suspend and a clean site shrinks with it).
//!
//! What is written: each chunk exactly as a suspend writes it
//! (`Store::put_chunk`: convergent encryption, so the object is the one the
//! suspend would make; a chunk the store has already costs one exists
//! call). A chunk is taken once the guest has left it alone for
//! [`REST`] (Coda's aging window: a log's last block, rewritten every
//! second, goes once it rests, not on every write), and a chunk written
//! again after it went is queued again. Nothing here decides what the next
//! version holds: the suspend reads the stopped VM's disk whole and names
//! every chunk it finds; a trickled chunk only saves it the upload.
//!
//! Until a suspend's manifest names them, trickled chunks are referenced by
//! the run's lease (`roam_store::Lease`, `leases/<env>/<run>.<seq>`): an id
//! is leased before its upload starts, the lease is rewritten (next `seq`,
//! the old one deleted) whenever ids are added and at least every
//! [`LEASE_RENEW`], and it vouches for [`LEASE_TTL`]. `roam store gc` keeps
//! every chunk of a live lease and deletes stale ones (a crashed run's).
//! When `roam resume` ends, [`release`] deletes the run's leases: by then
//! the suspend's version names what it needs, and the rest is garbage.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use roam_store::{Lease, Store};

use super::AnyBackend;
use crate::demand::DemandImage;

/// How long a chunk must have gone unwritten before it is written back
/// (1 s).
pub(crate) const REST: Duration = Duration::from_secs(1);

/// How often the trickle looks for rested chunks (200 ms).
const POLL: Duration = Duration::from_millis(200);

/// How long a lease vouches for its chunks (10 min): a gc on a machine
/// whose clock is up to this much ahead could still take them.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(600);

/// How often a lease is renewed when no chunk is added (1 min).
const LEASE_RENEW: Duration = Duration::from_secs(60);

/// Longest pause after a failed upload before the next try (30 s); it
/// starts at 1 s and doubles.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Least time between two progress lines on stderr (5 s), except the one
/// that says nothing is pending.
const REPORT_EVERY: Duration = Duration::from_secs(5);

/// `--trickle RATE`: `off`, or bits per second with an optional `k`, `M` or
/// `G` (decimal) and an optional `bit`/`bps` (`10M`, `500kbit`, `2Mbps`).
/// Returns bytes per second, `None` for `off`.
pub(crate) fn parse_rate(text: &str) -> Result<Option<u64>, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("bit")
        .or_else(|| lower.strip_suffix("bps"))
        .unwrap_or(&lower);
    let (digits, scale) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 1e3),
        Some('m') => (&body[..body.len() - 1], 1e6),
        Some('g') => (&body[..body.len() - 1], 1e9),
        _ => (body, 1.0),
    };
    let bits = digits
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|v| v * scale)
        .ok_or_else(|| {
            format!(
                "--trickle {text:?}: expected `off` or a rate in bits per second such as 10M, \
                 500kbit or 2Mbps"
            )
        })?;
    let bytes = (bits / 8.0).floor();
    if bytes < 1024.0 {
        return Err(format!(
            "--trickle {text:?}: at least 8kbit (1 KiB/s); use `off` to write nothing back"
        ));
    }
    Ok(Some(bytes.min(1e15) as u64))
}

/// What the trickle has done so far (shared with the summary).
#[derive(Debug, Default)]
pub(crate) struct TrickleCounts {
    /// Chunks written back (uploaded, or found in the store already).
    pub(crate) chunks: AtomicU64,
    /// Of those, found in the store already (no upload).
    pub(crate) found: AtomicU64,
    /// Object bytes uploaded (compressed and sealed).
    pub(crate) object_bytes: AtomicU64,
    /// Plaintext bytes of the chunks written back.
    pub(crate) bytes: AtomicU64,
    /// Leases written (the first and each renewal).
    pub(crate) leases: AtomicU64,
}

/// One run's trickle: where it writes and what it has done.
pub(crate) struct Trickle {
    /// The store.
    pub(crate) store: Arc<Store<AnyBackend>>,
    /// The environment resumed.
    pub(crate) env: String,
    /// This run's id in its leases.
    pub(crate) run: String,
    /// Most object bytes per second.
    pub(crate) rate: u64,
    /// The counts.
    pub(crate) counts: TrickleCounts,
    /// Set by [`Trickle::stop`]: [`Trickle::run`] returns at its next
    /// safe point (never in the middle of an upload or a lease write).
    stopping: AtomicBool,
}

/// `--trickle RATE` as parsed: bytes per second, `None` for `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rate(pub(crate) Option<u64>);

/// The `--trickle` value parser.
pub(crate) fn rate_arg(text: &str) -> Result<Rate, String> {
    parse_rate(text).map(Rate)
}

/// Milliseconds since the Unix epoch, `now` being `t`.
fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Trickle {
    /// A trickle of `env` into `store` at `rate` bytes per second, with a
    /// fresh run id.
    pub(crate) fn new(
        store: Arc<Store<AnyBackend>>,
        env: &str,
        rate: u64,
    ) -> Result<Trickle, String> {
        let run = roam_store::new_run_id().map_err(|e| format!("trickle: {e}"))?;
        Ok(Trickle {
            store,
            env: env.to_owned(),
            run,
            rate,
            counts: TrickleCounts::default(),
            stopping: AtomicBool::new(false),
        })
    }

    /// Asks [`Trickle::run`] to return at its next safe point.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Whether [`Trickle::stop`] was called.
    fn stopped(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// Sleeps until `until` in steps of at most [`POLL`]; `false` if
    /// stopped meanwhile.
    async fn pause_until(&self, until: Instant) -> bool {
        loop {
            if self.stopped() {
                return false;
            }
            let now = Instant::now();
            if now >= until {
                return true;
            }
            tokio::time::sleep((until - now).min(POLL)).await;
        }
    }

    /// A one-line account: `12 chunks written back (1.5 MB; 200000 bytes
    /// of objects uploaded, 3 chunks found stored), 2 pending`.
    pub(crate) fn summary(&self, pending: u64) -> String {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "{} chunks written back ({}; {} bytes of objects uploaded, {} chunks found stored), \
             {pending} pending",
            l(&self.counts.chunks),
            super::mb(l(&self.counts.bytes)),
            l(&self.counts.object_bytes),
            l(&self.counts.found),
        )
    }

    /// Writes the lease naming `ids` as the next one of this run, then
    /// deletes the one before (the new one is in place first, so gc always
    /// finds one of them).
    async fn renew(&self, lease: &mut Lease, ids: Vec<[u8; 32]>) -> Result<(), String> {
        let previous = (lease.seq > 0).then(|| lease.object_name());
        lease.seq += 1;
        lease.chunks = ids;
        lease.expires_unix_ms = unix_ms(SystemTime::now() + LEASE_TTL);
        self.store
            .write_lease(lease)
            .await
            .map_err(|e| format!("writing trickle lease {}: {e}", lease.object_name()))?;
        self.counts.leases.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = previous {
            // A lease left over is only stale later; gc then deletes it.
            let _ = self.store.delete_lease(&old).await;
        }
        Ok(())
    }

    /// Writes back the rested chunks of `images` until [`Trickle::stop`];
    /// `report` gets the progress lines and failures. Failures
    /// (a store that does not answer) put the chunk back and pause,
    /// doubling up to [`MAX_BACKOFF`]; the guest is never held up.
    pub(crate) async fn run(
        self: Arc<Self>,
        images: Vec<Arc<DemandImage>>,
        report: Arc<dyn Fn(&str) + Send + Sync>,
    ) {
        let mut lease = Lease {
            env: self.env.clone(),
            run: self.run.clone(),
            seq: 0,
            expires_unix_ms: 0,
            chunks: Vec::new(),
        };
        // What each written-back place (image, chunk index) holds now, and
        // how many places hold each id: the lease names only these, so it
        // stays at most the disks' chunk count however often a chunk is
        // rewritten (an id no place holds any more is garbage: dropped at
        // the next lease).
        let mut held: HashMap<(usize, u64), [u8; 32]> = HashMap::new();
        let mut refs: HashMap<[u8; 32], u32> = HashMap::new();
        // An id was added since the last lease: lease it before any upload.
        let mut lease_stale = false;
        let mut renewed = Instant::now();
        // The token bucket: the next upload may start at `next_at`.
        let mut next_at = Instant::now();
        let mut backoff = Duration::from_secs(1);
        let mut last_report: Option<Instant> = None;
        let mut sent_since_report = false;
        loop {
            if !self.pause_until(Instant::now() + POLL).await {
                return;
            }
            let pending = || images.iter().map(|i| i.unsent()).sum::<u64>();
            let mut failed = None;
            'images: for (k, image) in images.iter().enumerate() {
                loop {
                    if !self.pause_until(next_at).await {
                        return;
                    }
                    let taken = match image.take_settled(Instant::now(), REST).await {
                        Ok(Some(t)) => t,
                        Ok(None) => break,
                        Err(e) => {
                            failed = Some(e);
                            break 'images;
                        }
                    };
                    let taken_at = Instant::now();
                    let id = self.store.chunk_ref(&taken.bytes).id;
                    let old = held.insert((k, taken.index), id);
                    if old != Some(id) {
                        lease_stale |= !refs.contains_key(&id);
                        *refs.entry(id).or_insert(0) += 1;
                        if let Some(Entry::Occupied(mut e)) = old.map(|o| refs.entry(o)) {
                            *e.get_mut() -= 1;
                            if *e.get() == 0 {
                                e.remove();
                            }
                        }
                    }
                    if lease_stale {
                        let ids = refs.keys().copied().collect();
                        if let Err(e) = self.renew(&mut lease, ids).await {
                            image.requeue(taken.index, taken_at);
                            failed = Some(e);
                            break 'images;
                        }
                        lease_stale = false;
                        renewed = Instant::now();
                    }
                    match self.store.put_chunk(&taken.bytes).await {
                        Ok((_, wrote)) => {
                            let c = &self.counts;
                            c.chunks.fetch_add(1, Ordering::Relaxed);
                            c.bytes
                                .fetch_add(taken.bytes.len() as u64, Ordering::Relaxed);
                            match wrote {
                                Some(n) => {
                                    c.object_bytes.fetch_add(n, Ordering::Relaxed);
                                    next_at = next_at.max(taken_at)
                                        + Duration::from_secs_f64(n as f64 / self.rate as f64);
                                }
                                None => {
                                    c.found.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            sent_since_report = true;
                        }
                        Err(e) => {
                            image.requeue(taken.index, taken_at);
                            failed = Some(format!("{} chunk {}: {e}", image.name(), taken.index));
                            break 'images;
                        }
                    }
                }
            }
            if let Some(e) = failed {
                report(&format!(
                    "trickle: {e}; trying again in {} s (the guest runs on; the suspend \
                     uploads what is not written back)",
                    backoff.as_secs()
                ));
                if !self.pause_until(Instant::now() + backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            backoff = Duration::from_secs(1);
            if lease.seq > 0 && renewed.elapsed() >= LEASE_RENEW {
                let ids = refs.keys().copied().collect();
                match self.renew(&mut lease, ids).await {
                    Ok(()) => renewed = Instant::now(),
                    Err(e) => report(&format!("trickle: {e}")),
                }
            }
            let p = pending();
            let due = last_report.is_none_or(|t| t.elapsed() >= REPORT_EVERY);
            if sent_since_report && (p == 0 || due) {
                report(&format!("trickle: {}", self.summary(p)));
                last_report = Some(Instant::now());
                sent_since_report = false;
            }
        }
    }
}

/// Deletes every lease of `run` of `env` (the run is over: what a suspend
/// needed is in its version). Returns how many it deleted.
pub(crate) async fn release(
    store: &Store<AnyBackend>,
    env: &str,
    run: &str,
) -> Result<u64, String> {
    use roam_store::ChunkBackend;
    let prefix = format!("leases/{env}/");
    let mine = format!("{prefix}{run}.");
    let names = store
        .backend()
        .list(&prefix)
        .await
        .map_err(|e| format!("listing the trickle leases: {e}"))?;
    let mut n = 0;
    for name in names.iter().filter(|n| n.starts_with(&mine)) {
        if store
            .delete_lease(name)
            .await
            .map_err(|e| format!("deleting trickle lease {name}: {e}"))?
        {
            n += 1;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_in_bits_per_second() {
        assert_eq!(parse_rate("off"), Ok(None));
        assert_eq!(parse_rate("OFF"), Ok(None));
        assert_eq!(parse_rate("10M"), Ok(Some(1_250_000)));
        assert_eq!(parse_rate("10mbit"), Ok(Some(1_250_000)));
        assert_eq!(parse_rate("500kbit"), Ok(Some(62_500)));
        assert_eq!(parse_rate("2Mbps"), Ok(Some(250_000)));
        assert_eq!(parse_rate("1G"), Ok(Some(125_000_000)));
        assert_eq!(parse_rate("80000"), Ok(Some(10_000)));
        for bad in ["", "fast", "-1M", "0", "NaN", "inf", "1k", "10X", "M"] {
            let e = parse_rate(bad).unwrap_err();
            assert!(e.starts_with("--trickle"), "{bad}: {e}");
        }
    }
}
