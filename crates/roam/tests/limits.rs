//! The library server's admission limits over real loopback sockets: the
//! busy answer over the connection cap and its bounded overflow, the per-IP
//! and per-key session caps, and the usage they report.

mod common;

use std::time::{Duration, Instant};

use common::{client_config, server_config};
use roam_proto::Keypair;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Starts a server with `tune` applied; returns its address, key, stats and a stopper.
async fn start(
    tune: impl FnOnce(&mut roam::ServerConfig),
) -> (
    std::net::SocketAddr,
    roam_proto::PublicKey,
    roam::ServerStats,
    oneshot::Sender<()>,
) {
    common::init_logging();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let kp = Keypair::generate().unwrap();
    let key = kp.public();
    let mut config = server_config(kp);
    tune(&mut config);
    let stats = config.stats.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    tokio::spawn(roam::serve(
        listener,
        config,
        async move {
            let _ = stopped.await;
        },
        // Keep every session: a server session whose handles are all
        // dropped is closed (abandoned).
        move |session| held.lock().unwrap().push(session),
    ));
    (addr, key, stats, stop)
}

fn is_busy(r: &Result<roam::SessionHandle, roam::Error>) -> bool {
    matches!(r, Err(e) if e.protocol() == Some(&roam_proto::Error::ServerBusy))
}

#[tokio::test]
async fn over_the_connection_cap_busy_at_once_and_beyond_the_overflow_closed() {
    let (addr, key, stats, _stop) = start(|c| {
        c.max_connections = 1;
        c.busy_overflow = 1;
    })
    .await;
    // Holds the only connection (no opening: it waits for the hello timeout).
    let _silent = TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(stats.usage().connections, 1);

    let t0 = Instant::now();
    let r = roam::connect(&addr.to_string(), client_config(Some(key))).await;
    assert!(is_busy(&r), "{:?}", r.err());
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());

    // One silent connection takes the only busy-answer slot; the next one
    // is closed without an answer, at once.
    let _waiting = TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(stats.usage().busy_answering, 1);
    let mut dropped = TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(1), dropped.read(&mut b))
        .await
        .expect("closed at once")
        .unwrap_or(0);
    assert_eq!(n, 0);
    let refused = stats.usage().refused;
    assert!(
        refused.get("connections").is_some_and(|&n| n >= 2),
        "{refused:?}"
    );
    assert_eq!(refused.get("connections_dropped"), Some(&1), "{refused:?}");
}

#[tokio::test]
async fn per_ip_and_per_key_caps_refuse_and_release() {
    let (addr, key, stats, _stop) = start(|c| {
        c.max_sessions_per_ip = 2;
        c.max_sessions_per_key = 1;
    })
    .await;
    let addr = addr.to_string();
    let keyed = client_config(Some(key));
    let a = roam::connect(&addr, keyed.clone()).await.unwrap();
    // Same key again: connected, then closed by the server with SERVER_BUSY.
    let b = roam::connect(&addr, keyed.clone()).await;
    if let Ok(b) = b {
        let reason = tokio::time::timeout(Duration::from_secs(2), b.closed())
            .await
            .expect("closed promptly");
        match reason {
            roam::CloseReason::Peer { code, reason } => {
                assert_eq!(code, roam_proto::code::SERVER_BUSY, "{reason}");
                assert!(reason.contains("client key"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Wait for the refused session to be released.
    let end = Instant::now() + Duration::from_secs(5);
    while stats.usage().sessions != 1 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let u = stats.usage();
    assert_eq!(u.sessions, 1);
    assert_eq!(u.top_key.map(|k| k.1), Some(1));
    // Another key from the same address: the second of 2 per IP.
    let c = roam::connect(&addr, client_config(Some(key)))
        .await
        .unwrap();
    let d = roam::connect(&addr, client_config(Some(key))).await;
    assert!(is_busy(&d), "{:?}", d.err());
    assert_eq!(stats.usage().top_ip.map(|t| t.1), Some(2));
    // Each refusal is counted under its cap (the metrics read these).
    let refused = stats.usage().refused;
    assert_eq!(refused.get("per_key"), Some(&1), "{refused:?}");
    assert_eq!(refused.get("per_ip"), Some(&1), "{refused:?}");
    assert_eq!(refused.get("sessions"), None, "{refused:?}");
    // Closing one frees a place.
    a.close(roam_proto::code::NO_ERROR, "").await;
    let end = Instant::now() + Duration::from_secs(5);
    while stats.usage().sessions != 1 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = roam::connect(&addr, client_config(Some(key))).await;
    assert!(e.is_ok(), "{:?}", e.err());
    drop(c);
}
