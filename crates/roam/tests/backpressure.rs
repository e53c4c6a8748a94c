//! A transport whose peer stops reading: the driver must sleep until the
//! socket is writable again, not spin on an overdue heartbeat or ACK deadline.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use roam_proto::Keypair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Loose bound on driver wake-ups per second while the transport is backed
/// up. A sleeping driver wakes a few times a second at most (its own tick);
/// the spinning one woke hundreds of thousands of times a second.
const MAX_WAKEUPS_PER_SEC: u64 = 100;

/// Copies `from` into `to` until `stall` is set, then stops reading for good
/// (the connection stays open, as behind a peer that no longer reads).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stall: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if stall.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        let Ok(Ok(n)) = timeout(Duration::from_millis(20), from.read(&mut buf)).await else {
            continue;
        };
        if n == 0 || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A one-connection proxy that forwards until told to stall.
async fn stalling_proxy(upstream: SocketAddr, stall: Arc<AtomicBool>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                return;
            };
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            held.push(tokio::spawn(pump(cr, sw, stall.clone())));
            held.push(tokio::spawn(pump(sr, cw, stall.clone())));
        }
    });
    addr
}

/// CPU time (user + system) this process has used, in clock ticks.
fn cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_sleeps_while_the_transport_is_backed_up() {
    init_logging();
    // Far more unacknowledged data allowed than the socket buffers hold, so
    // the records back up in the driver; heartbeats fall due quickly; the
    // silence timer stays far off.
    let session = roam_proto::Config {
        heartbeat_interval: Duration::from_millis(100),
        suspend_after: Duration::from_secs(60),
        stream_window: 256 << 20,
        session_window: 256 << 20,
        stream_send_buffer: 256 << 20,
        session_send_buffer: 256 << 20,
        ..fast_session()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server_addr = listener.local_addr().unwrap();
    let kp = Keypair::generate().unwrap();
    let key = kp.public();
    let mut sconf = server_config(kp);
    sconf.proto.session = session.clone();
    tokio::spawn(roam::serve(
        listener,
        sconf,
        std::future::pending::<()>(),
        |s: roam::SessionHandle| {
            tokio::spawn(async move {
                while let Ok((mut stream, _)) = s.accept_stream().await {
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                    });
                }
            });
        },
    ));
    let stall = Arc::new(AtomicBool::new(false));
    let proxy = stalling_proxy(server_addr, stall.clone()).await;
    let mut cconf = client_config(Some(key));
    cconf.proto.session = session;
    let client = timeout(
        Duration::from_secs(10),
        roam::connect(&proxy.to_string(), cconf),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    stall.store(true, Ordering::Relaxed);

    let mut stream = client.open_stream(b"sink").unwrap();
    let writer = tokio::spawn(async move {
        let chunk = vec![7u8; 256 * 1024];
        loop {
            if stream.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    // Let the kernel buffers fill and the driver's own buffer back up.
    let mut last = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let sent = client.stats().bytes_sent;
        if sent == last && sent > 0 {
            break;
        }
        last = sent;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let measure = Duration::from_secs(2);
    let (w0, c0) = (client.stats().driver_wakeups, cpu_ticks());
    tokio::time::sleep(measure).await;
    let (w1, c1) = (client.stats().driver_wakeups, cpu_ticks());
    let wakeups = w1 - w0;
    let cpu = c0.zip(c1).map(|(a, b)| b - a);
    eprintln!(
        "backed up for {measure:?}: {wakeups} driver wake-ups, {cpu:?} CPU ticks; {} bytes sent",
        client.stats().bytes_sent
    );
    assert_eq!(
        client.stats().state,
        roam::State::Active,
        "the transport is still up (stalled, not dead)"
    );
    assert!(
        wakeups < MAX_WAKEUPS_PER_SEC * measure.as_secs(),
        "driver spun while backed up: {wakeups} wake-ups in {measure:?}"
    );
    writer.abort();
}
