//! Suspended sessions cost no socket and no task: 10,000 of them (set
//! `ROAM_CONT_SESSIONS` to change) leave this process with no more open
//! sockets or live tasks than before they were created.

mod common;

use std::time::Duration;

use common::{bounded, socket_count, start, wait_stats};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_suspended_sessions_hold_zero_sockets() {
    common::init_logging();
    let n: usize = std::env::var("ROAM_CONT_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let dir = tempfile::tempdir().unwrap();
    let srv = start(
        dir.path(),
        0,
        vec![common::idle_service()],
        |c| c.offload_after = Duration::ZERO,
        common::idle_on_session,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sockets_before = socket_count();
    let tasks_before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let addr = srv.addr;
    let key = srv.key;
    let started = std::time::Instant::now();
    bounded(Duration::from_secs(300), "creating the sessions", async {
        let mut set = tokio::task::JoinSet::new();
        for k in 0..n {
            if set.len() >= 32 {
                set.join_next().await.unwrap().unwrap();
            }
            set.spawn(async move {
                let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
                common::raw_handshake(&mut sock, key).await;
                // Give the server the last handshake bytes, then vanish.
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(sock);
                k
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    })
    .await;
    wait_stats(&srv.host, "every session frozen", |s| {
        s.frozen == n && s.live == 0 && s.in_transition == 0
    })
    .await;
    println!(
        "{n} sessions created and suspended in {:?}; store holds {}",
        started.elapsed(),
        srv.host.store().len().unwrap()
    );
    assert_eq!(srv.host.store().len().unwrap(), n as u64);
    // Let the last sockets and tasks wind down.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sockets = socket_count();
    let tasks = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    println!("sockets {sockets_before} -> {sockets}, tasks {tasks_before} -> {tasks}");
    assert!(
        sockets <= sockets_before,
        "{n} suspended sessions hold {} sockets",
        sockets - sockets_before
    );
    assert!(tasks <= tasks_before + 2, "tasks {tasks_before} -> {tasks}");
    srv.stop().await;
}
