//! A live connection moving between two servers (`SessionHandle::detach_live`
//! and an `Adoption`, `docs/PROTOCOL.md` §13.6), as a relay takeover moves
//! it between processes: server A takes the session out with its socket, the
//! client keeps writing meanwhile, server B restores the session and adopts
//! the socket. The client never notices: one transport, no resume, and every
//! byte it wrote comes back once, in order, through both servers.

mod common;

use std::time::Duration;

use common::{client_config, fill_pattern, init_logging, pattern_byte, server_config};
use roam_proto::Keypair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;

/// Bytes the client writes before the move, and in all.
const BEFORE: u64 = 3 << 20;
const TOTAL: u64 = 8 << 20;
/// The pattern's seed.
const SEED: u64 = 41;

/// Echoes `stream` from `from` until `to` bytes have come back.
async fn echo(stream: &mut roam::RoamStream, mut from: u64, to: u64) -> u64 {
    let mut buf = vec![0u8; 32 * 1024];
    while from < to {
        let want = (to - from).min(buf.len() as u64) as usize;
        let n = stream.read(&mut buf[..want]).await.expect("server read");
        assert!(n > 0, "stream ended at {from}");
        stream.write_all(&buf[..n]).await.expect("server write");
        from += n as u64;
    }
    from
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_connection_moves_to_another_server_and_the_client_sees_nothing() {
    init_logging();
    let key = Keypair::generate().unwrap();
    let (to_a, mut on_a) = mpsc::unbounded_channel();
    let la = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = la.local_addr().unwrap();
    let (stop_a, a_stopped) = oneshot::channel::<()>();
    let a = tokio::spawn(roam::serve(
        la,
        server_config(key.clone()),
        async {
            let _ = a_stopped.await;
        },
        move |h| {
            let _ = to_a.send(h);
        },
    ));
    let (adopter, adoptions) = roam::adoption_queue();
    let mut cb = server_config(key.clone());
    cb.adoptions = Some(adoptions);
    let (stop_b, b_stopped) = oneshot::channel::<()>();
    let b = tokio::spawn(roam::serve(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        cb,
        async {
            let _ = b_stopped.await;
        },
        |_| panic!("server B sees no new session"),
    ));

    let client = roam::connect(&addr.to_string(), client_config(Some(key.public())))
        .await
        .unwrap();
    let stream = client.open_stream(b"echo").unwrap();
    let (mut cr, mut cw) = tokio::io::split(stream);
    // The client writes everything, pausing once the first part is out, and
    // reads every byte back in a task of its own.
    let (part_sent, part_sent_rx) = oneshot::channel();
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        let mut off = 0;
        let mut part_sent = Some(part_sent);
        while off < TOTAL {
            if off >= BEFORE {
                if let Some(tx) = part_sent.take() {
                    let _ = tx.send(());
                }
            }
            let n = (TOTAL - off).min(buf.len() as u64) as usize;
            fill_pattern(SEED, off, &mut buf[..n]);
            cw.write_all(&buf[..n]).await.expect("client write");
            off += n as u64;
        }
        cw
    });
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        let mut off = 0u64;
        while off < TOTAL {
            let n = cr.read(&mut buf).await.expect("client read");
            assert!(n > 0, "echo ended at {off}");
            for (k, b) in buf[..n].iter().enumerate() {
                assert_eq!(
                    *b,
                    pattern_byte(SEED, off + k as u64),
                    "byte {}",
                    off + k as u64
                );
            }
            off += n as u64;
        }
        off
    });

    // Server A echoes the first part, then lets go of the session with its
    // connection while the client goes on writing.
    let ha = timeout(Duration::from_secs(10), on_a.recv())
        .await
        .unwrap()
        .unwrap();
    let (mut sa, meta) = ha.accept_stream().await.unwrap();
    assert_eq!(meta, b"echo");
    let id = sa.id();
    let echoed = echo(&mut sa, 0, BEFORE).await;
    timeout(Duration::from_secs(10), part_sent_rx)
        .await
        .unwrap()
        .unwrap();
    let (detached, live) = ha.detach_live().await.unwrap();
    let live = live.expect("an established connection at rest moves");
    assert!(sa.read(&mut [0u8; 1]).await.is_err(), "A's stream is over");
    drop((sa, ha));
    // While nobody serves it, the client's bytes wait in the socket.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Server B restores the session and adopts the connection.
    let (installed, on_b) = oneshot::channel();
    let session = roam_proto::Session::restore_server(
        &server_config(key.clone()).proto,
        std::time::Instant::now(),
        &detached.blob,
        Duration::ZERO,
    )
    .unwrap();
    let restored = roam::Restored::new(
        session,
        detached.unaccepted,
        detached.orphans,
        Box::new(move |h| {
            let _ = installed.send(h);
        }),
    );
    adopter
        .adopt(roam::Adoption { restored, live })
        .expect("server B is running");
    let hb = timeout(Duration::from_secs(10), on_b)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hb.stats().state, roam::State::Active);
    let mut sb = hb.stream(id).unwrap();
    echo(&mut sb, echoed, TOTAL).await;

    let cw = timeout(Duration::from_secs(30), writer)
        .await
        .unwrap()
        .unwrap();
    let got = timeout(Duration::from_secs(30), reader)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, TOTAL);
    let stats = client.stats();
    assert_eq!(stats.transports, 1, "the client never dialed again");
    assert_eq!(stats.resumes, 0, "the client never resumed");
    assert_eq!(stats.state, roam::State::Active);
    drop(cw);
    let _ = client.close(0, "done").await;
    let _ = stop_a.send(());
    let _ = stop_b.send(());
    let _ = timeout(Duration::from_secs(10), a).await;
    let _ = timeout(Duration::from_secs(10), b).await;
}
