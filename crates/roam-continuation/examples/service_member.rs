//! One process of a three-process service set, for the service-set tests
//! (`tests/service_set.rs`): a producer `w` writes numbered records to a
//! forwarder `f` over channel 1, which forwards them to a consumer `r` over
//! channel 2. Records 2-5 of every eight are written in a nondeterministic
//! interval with payloads from this process's own randomness.
//!
//! ```text
//! service_member ROLE SITE_DIR CONTROL_SOCKET OUT_DIR RECORDS [LOG_CAP [TRANSPORT]]
//! ```
//!
//! The member joins the coordinator on CONTROL_SOCKET (fresh, or restarted
//! from its part, frozen until thawed), sets up its channels in SITE_DIR,
//! says it is ready, and runs. TRANSPORT is how the channels are made:
//! `unix` (the default: `c1.sock`, `c2.sock`, the reader listens), `tcp`
//! (the reader listens on a loopback port it writes to `c1.port`,
//! `c2.port`) or `fifo` (named pipes `c1.fifo`, `c2.fifo`). LOG_CAP 0
//! keeps the default cap. `w` writes `OUT_DIR/w.hist` (its records' fingerprints) once
//! it has produced RECORDS records; `r` writes `OUT_DIR/r.consumed` once it
//! has consumed them, or `OUT_DIR/r.error` if a record arrives out of
//! order. The process exits when the coordinator ends it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::Rng;
use roam_continuation::service_set::{join, Endpoint, Member};
use roam_service::{ChannelId, Interval, Limits};
use sha2::{Digest, Sha256};
use tokio::net::unix::pipe;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

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

/// How the members' channels are made.
#[derive(Clone, Copy)]
enum Transport {
    /// Unix stream sockets; the reader listens.
    Unix,
    /// TCP over loopback; the reader listens on a port it publishes.
    Tcp,
    /// Named pipes.
    Fifo,
}

/// Retries `attempt` every 10 ms for up to 10 s.
async fn retry<T>(what: &str, mut attempt: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..1000 {
        if let Some(t) = attempt().await {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: the reader never appeared");
}

/// Makes the FIFO at `path` unless it exists.
fn fifo(path: &Path) {
    match nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
        Err(e) => panic!("mkfifo {}: {e}", path.display()),
    }
}

/// The writing end of channel `name` at `site`.
async fn writer_end(t: Transport, site: &Path, name: &str) -> Endpoint {
    match t {
        Transport::Unix => {
            let path = site.join(format!("{name}.sock"));
            retry(name, async || UnixStream::connect(&path).await.ok())
                .await
                .into()
        }
        Transport::Tcp => {
            let path = site.join(format!("{name}.port"));
            retry(name, async || {
                let port: u16 = std::fs::read_to_string(&path).ok()?.parse().ok()?;
                TcpStream::connect(("127.0.0.1", port)).await.ok()
            })
            .await
            .into()
        }
        Transport::Fifo => {
            let path = site.join(format!("{name}.fifo"));
            fifo(&path);
            // Opening a FIFO's write end fails (ENXIO) until it has a reader.
            retry(name, async || {
                pipe::OpenOptions::new().open_sender(&path).ok()
            })
            .await
            .into()
        }
    }
}

/// The reading end of channel `name` at `site`.
async fn reader_end(t: Transport, site: &Path, name: &str) -> Endpoint {
    match t {
        Transport::Unix => {
            let path = site.join(format!("{name}.sock"));
            let _ = std::fs::remove_file(&path);
            let listener = UnixListener::bind(&path).expect("bind channel socket");
            listener.accept().await.expect("accept channel").0.into()
        }
        Transport::Tcp => {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let port = listener.local_addr().expect("port").port();
            publish(
                &site.join(format!("{name}.port")),
                port.to_string().as_bytes(),
            );
            listener.accept().await.expect("accept channel").0.into()
        }
        Transport::Fifo => {
            let path = site.join(format!("{name}.fifo"));
            fifo(&path);
            // Read-write: no end of file before the writer opens.
            pipe::OpenOptions::new()
                .read_write(true)
                .open_receiver(&path)
                .expect("open the FIFO")
                .into()
        }
    }
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
        eprintln!(
            "usage: service_member ROLE SITE_DIR CONTROL_SOCKET OUT_DIR RECORDS [LOG_CAP [TRANSPORT]]"
        );
        std::process::exit(2);
    };
    let mut limits = Limits::default();
    match rest
        .first()
        .map(|cap| cap.parse().expect("LOG_CAP is a number"))
    {
        None | Some(0) => {}
        Some(cap) => limits.log_bytes = cap,
    }
    let transport = match rest.get(1).map(String::as_str) {
        None | Some("unix") => Transport::Unix,
        Some("tcp") => Transport::Tcp,
        Some("fifo") => Transport::Fifo,
        Some(other) => panic!("TRANSPORT {other:?}: unix, tcp or fifo"),
    };
    let records: u64 = records.parse().expect("RECORDS is a number");
    let (site, out) = (PathBuf::from(site), PathBuf::from(out));
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let m = join(&mut control, role, limits).await.expect("join");
    match role.as_str() {
        "w" => m.add_writer(C1, writer_end(transport, &site, "c1").await),
        "f" => {
            let listening = tokio::spawn({
                let site = site.clone();
                async move { reader_end(transport, &site, "c1").await }
            });
            let c2 = writer_end(transport, &site, "c2").await;
            m.add_writer(C2, c2).expect("c2");
            m.add_reader(C1, listening.await.expect("c1"))
        }
        "r" => m.add_reader(C2, reader_end(transport, &site, "c2").await),
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
