//! One process of a three-process service set, for the service-set tests
//! (`tests/service_set.rs`): a producer `w` writes numbered records to a
//! forwarder `f` over channel 1, which forwards them to a consumer `r` over
//! channel 2. Records 2-5 of every eight are written in a nondeterministic
//! interval with payloads from this process's own randomness.
//!
//! ```text
//! service_member ROLE SITE_DIR CONTROL_SOCKET OUT_DIR RECORDS [LOG_CAP]
//! ```
//!
//! The member joins the coordinator on CONTROL_SOCKET (fresh, or restarted
//! from its part, frozen until thawed), sets up its channel sockets in
//! SITE_DIR (`c1.sock`, `c2.sock`: the reader listens), says it is ready,
//! and runs. `w` writes `OUT_DIR/w.hist` (its records' fingerprints) once
//! it has produced RECORDS records; `r` writes `OUT_DIR/r.consumed` once it
//! has consumed them, or `OUT_DIR/r.error` if a record arrives out of
//! order. The process exits when the coordinator ends it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::Rng;
use roam_continuation::service_set::{join, Member};
use roam_service::{ChannelId, Interval, Limits};
use sha2::{Digest, Sha256};
use tokio::net::{UnixListener, UnixStream};

const C1: ChannelId = ChannelId(1);
const C2: ChannelId = ChannelId(2);

fn mark(record: &[u8]) -> [u8; 8] {
    Sha256::digest(record)[..8].try_into().expect("8 bytes")
}

/// Writes `bytes` to `path` whole (temp file, then rename).
fn publish(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).expect("write result");
    std::fs::rename(&tmp, path).expect("publish result");
}

async fn connect(path: &Path) -> UnixStream {
    for _ in 0..1000 {
        if let Ok(s) = UnixStream::connect(path).await {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} never listened", path.display());
}

async fn accept(path: &Path) -> UnixStream {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).expect("bind channel socket");
    listener.accept().await.expect("accept channel").0
}

/// The producer: `next_seq` and its history in its snapshot.
async fn producer(m: Member, out: PathBuf, records: u64) {
    let (mut next, mut hist) = match m.snapshot() {
        Some(s) => (
            u64::from_be_bytes(s[..8].try_into().unwrap()),
            s[8..].to_vec(),
        ),
        None => (0, Vec::new()),
    };
    let snapshot = |next: u64, hist: &[u8]| {
        let mut s = next.to_be_bytes().to_vec();
        s.extend_from_slice(hist);
        s
    };
    while next < records {
        let want = if (2..6).contains(&(next % 8)) {
            Interval::Nondeterministic
        } else {
            Interval::Deterministic
        };
        if m.interval() != want || rand::thread_rng().gen_ratio(1, 20) {
            m.export(&snapshot(next, &hist), want)
                .await
                .expect("export");
        }
        let len = 1 + (next.wrapping_mul(0x9e37_79b9) % 40) as usize;
        let mut record = next.to_be_bytes().to_vec();
        record.push(len as u8);
        if want == Interval::Nondeterministic {
            record.extend((0..len).map(|_| rand::random::<u8>()));
        } else {
            record.extend((0..len).map(|i| (next as usize * 31 + i) as u8));
        }
        hist.extend_from_slice(&mark(&record));
        next += 1;
        m.write_all(C1, &record).await.expect("write record");
        // Paced (about 4,000 records a second) so that a test's moves
        // land while records flow.
        if next % 4 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    m.export(&snapshot(next, &hist), Interval::Deterministic)
        .await
        .expect("final export");
    publish(&out.join("w.hist"), &hist);
    std::future::pending::<()>().await;
}

/// Now and then a reader falls behind for a few milliseconds, so a freeze
/// finds bytes in its channel's socket that the cut must drain.
async fn lag() {
    if rand::thread_rng().gen_ratio(1, 4) {
        let ms = rand::thread_rng().gen_range(1..6);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The forwarder: bytes read and not yet forwarded are its snapshot.
async fn forwarder(m: Member) {
    let mut buf = m.snapshot().unwrap_or_default();
    let mut chunk = vec![0u8; 4096];
    loop {
        if !buf.is_empty() {
            m.write_all(C2, &buf).await.expect("forward");
            buf.clear();
        }
        lag().await;
        let want = rand::thread_rng().gen_range(1..chunk.len());
        let n = m.read(C1, &mut chunk[..want]).await.expect("read c1");
        if n == 0 {
            std::future::pending::<()>().await;
        }
        buf.extend_from_slice(&chunk[..n]);
        if rand::thread_rng().gen_ratio(1, 4) {
            m.export(&buf, Interval::Deterministic)
                .await
                .expect("export");
        }
    }
}

/// The consumer: next expected record, partial bytes and fingerprints.
async fn consumer(m: Member, out: PathBuf, records: u64) {
    let (mut expect, mut partial, mut consumed) = match m.snapshot() {
        Some(s) => {
            let n = u32::from_be_bytes(s[8..12].try_into().unwrap()) as usize;
            (
                u64::from_be_bytes(s[..8].try_into().unwrap()),
                s[12..12 + n].to_vec(),
                s[12 + n..].to_vec(),
            )
        }
        None => (0, Vec::new(), Vec::new()),
    };
    let mut chunk = vec![0u8; 4096];
    while expect < records {
        lag().await;
        let want = rand::thread_rng().gen_range(1..chunk.len());
        let n = m.read(C2, &mut chunk[..want]).await.expect("read c2");
        if n == 0 {
            break;
        }
        partial.extend_from_slice(&chunk[..n]);
        while partial.len() >= 9 && partial.len() >= 9 + partial[8] as usize {
            let record: Vec<u8> = partial.drain(..9 + partial[8] as usize).collect();
            let seq = u64::from_be_bytes(record[..8].try_into().unwrap());
            if seq != expect {
                publish(
                    &out.join("r.error"),
                    format!("record {seq} arrived where {expect} was due").as_bytes(),
                );
                std::process::exit(3);
            }
            expect += 1;
            consumed.extend_from_slice(&mark(&record));
        }
        if rand::thread_rng().gen_ratio(1, 3) {
            let mut s = expect.to_be_bytes().to_vec();
            s.extend_from_slice(&(partial.len() as u32).to_be_bytes());
            s.extend_from_slice(&partial);
            s.extend_from_slice(&consumed);
            m.export(&s, Interval::Deterministic).await.expect("export");
        }
    }
    publish(&out.join("r.consumed"), &consumed);
    std::future::pending::<()>().await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, role, site, control, out, records, rest @ ..] = &args[..] else {
        eprintln!("usage: service_member ROLE SITE_DIR CONTROL_SOCKET OUT_DIR RECORDS [LOG_CAP]");
        std::process::exit(2);
    };
    let mut limits = Limits::default();
    if let Some(cap) = rest.first() {
        limits.log_bytes = cap.parse().expect("LOG_CAP is a number");
    }
    let records: u64 = records.parse().expect("RECORDS is a number");
    let (site, out) = (PathBuf::from(site), PathBuf::from(out));
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let m = join(&mut control, role, limits).await.expect("join");
    match role.as_str() {
        "w" => m.add_writer(C1, connect(&site.join("c1.sock")).await),
        "f" => {
            let listening = tokio::spawn({
                let p = site.join("c1.sock");
                async move { accept(&p).await }
            });
            let c2 = connect(&site.join("c2.sock")).await;
            m.add_writer(C2, c2).expect("c2");
            m.add_reader(C1, listening.await.expect("accept c1"))
        }
        "r" => m.add_reader(C2, accept(&site.join("c2.sock")).await),
        _ => panic!("unknown role {role}"),
    }
    .expect("associate");
    let app = {
        let m = m.clone();
        let role = role.clone();
        tokio::spawn(async move {
            match role.as_str() {
                "w" => producer(m, out, records).await,
                "f" => forwarder(m).await,
                _ => consumer(m, out, records).await,
            }
        })
    };
    // Ready: the coordinator may now end the old site and thaw this one.
    m.ready(&mut control).await.expect("ready");
    let served = m.serve_control(control).await;
    app.abort();
    std::process::exit(if served.is_ok() { 0 } else { 1 });
}
