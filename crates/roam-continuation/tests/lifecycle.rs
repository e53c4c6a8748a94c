//! Suspend and resume over real loopback sockets: eager and lazy
//! generation, repeated suspensions, exported attributes, a host restarted
//! in-process (crash and graceful), and that a suspended session holds no
//! socket or task.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{bench, bounded, client, cut, heal, start, wait_stats, wait_until};
use roam_continuation::Generation;
use roam_sim::proxy::FaultProxy;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_suspensions_free_the_session_and_resume_exactly() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let srv = start(
        dir.path(),
        0,
        vec![bench::service(Generation::Eager, Duration::from_secs(60))],
        |_| {},
        bench::on_session,
    )
    .await;
    let proxy = FaultProxy::start(srv.addr).await.unwrap();
    let params = bench::Params {
        count: 4000,
        interval: Duration::from_micros(500),
    };
    let c = client(&proxy, srv.key, params).await;
    for (round, at) in [300u64, 1500, 2500].into_iter().enumerate() {
        wait_until(LIMIT, "updates before the cut", || {
            c.received.load(Ordering::Relaxed) >= at
        })
        .await;
        cut(&proxy);
        wait_stats(&srv.host, "the session to be frozen", |s| {
            s.frozen == 1 && s.live == 0 && s.in_transition == 0
        })
        .await;
        let before = c.received.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        heal(&proxy);
        c.session.redial_now();
        wait_stats(&srv.host, "the session to resume", |s| {
            s.live == 1 && s.frozen == 0 && s.resumes == round as u64 + 1
        })
        .await;
        wait_until(LIMIT, "updates after the resume", || {
            c.received.load(Ordering::Relaxed) > before
        })
        .await;
    }
    let n = bounded(LIMIT, "the transfer", c.task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, params.count);
    let offsets = c.attrs_offsets.lock().unwrap().clone();
    assert_eq!(offsets.len(), 3, "one roam/attrs message per resume");
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");
    let st = srv.host.stats();
    assert_eq!((st.suspends, st.resumes, st.discarded), (3, 3, 0));
    assert!(
        srv.host.store().is_empty().unwrap(),
        "resumed continuations are deleted"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_generation_keeps_running_until_the_threshold() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let srv = start(
        dir.path(),
        0,
        vec![bench::service(
            Generation::Lazy {
                after: Duration::from_millis(2000),
            },
            Duration::from_secs(60),
        )],
        |_| {},
        bench::on_session,
    )
    .await;
    let proxy = FaultProxy::start(srv.addr).await.unwrap();
    let params = bench::Params {
        count: 3000,
        interval: Duration::from_micros(500),
    };
    let c = client(&proxy, srv.key, params).await;
    wait_until(LIMIT, "updates", || {
        c.received.load(Ordering::Relaxed) >= 200
    })
    .await;

    // A short disconnection: the application keeps running, nothing frozen.
    cut(&proxy);
    wait_stats(&srv.host, "a live suspended session", |s| {
        s.live_suspended == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        srv.host.stats().frozen,
        0,
        "lazy: not frozen before the threshold"
    );
    heal(&proxy);
    c.session.redial_now();
    wait_stats(&srv.host, "the live resume", |s| {
        s.live == 1 && s.live_suspended == 0
    })
    .await;
    assert_eq!(srv.host.stats().suspends, 0);

    // A long one: frozen once the threshold passes.
    let at = c.received.load(Ordering::Relaxed) + 200;
    wait_until(LIMIT, "more updates", || {
        c.received.load(Ordering::Relaxed) >= at
    })
    .await;
    cut(&proxy);
    wait_stats(&srv.host, "the lazy freeze", |s| {
        s.frozen == 1 && s.live == 0
    })
    .await;
    heal(&proxy);
    c.session.redial_now();
    let n = bounded(LIMIT, "the transfer", c.task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, params.count);
    assert_eq!(srv.host.stats().resumes, 1);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_crash_and_graceful_restart_lose_nothing() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let svc = || vec![bench::service(Generation::Eager, Duration::from_secs(60))];
    let srv = start(
        dir.path(),
        0,
        svc(),
        |c| c.offload_after = Duration::ZERO,
        bench::on_session,
    )
    .await;
    let port = srv.addr.port();
    let key = srv.key;
    let proxy = FaultProxy::start(srv.addr).await.unwrap();
    let params = bench::Params {
        count: 3000,
        interval: Duration::from_micros(500),
    };
    let c = client(&proxy, key, params).await;
    wait_until(LIMIT, "updates", || {
        c.received.load(Ordering::Relaxed) >= 500
    })
    .await;

    // 1. Crash while the client is away: the continuation is already on disk.
    cut(&proxy);
    wait_stats(&srv.host, "frozen", |s| {
        s.frozen == 1 && s.frozen_in_memory == 0
    })
    .await;
    srv.crash().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let srv = start(dir.path(), port, svc(), |_| {}, bench::on_session).await;
    assert_eq!(srv.report.loaded, 1);
    assert_eq!(srv.host.stats().frozen, 1);
    heal(&proxy);
    c.session.redial_now();
    wait_stats(&srv.host, "resumed after the crash", |s| {
        s.live == 1 && s.resumes == 1
    })
    .await;

    // 2. Graceful stop while the client is connected: the session is frozen
    //    on the way out (FreezeReason::Shutdown) and resumes after the start.
    let at = c.received.load(Ordering::Relaxed) + 300;
    wait_until(LIMIT, "more updates", || {
        c.received.load(Ordering::Relaxed) >= at
    })
    .await;
    proxy.refuse(true);
    srv.stop().await;
    let srv = start(dir.path(), port, svc(), |_| {}, bench::on_session).await;
    assert_eq!(srv.report.loaded, 1, "graceful stop keeps the live session");
    heal(&proxy);
    c.session.redial_now();
    let n = bounded(LIMIT, "the transfer", c.task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, params.count);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_cut_with_a_full_send_buffer_resumes_exactly() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let srv = start(
        dir.path(),
        0,
        vec![bench::service(Generation::Eager, Duration::from_secs(60))],
        |c| c.offload_after = Duration::ZERO,
        bench::on_session,
    )
    .await;
    let proxy = FaultProxy::start(srv.addr).await.unwrap();
    // Latency keeps megabytes in flight, so the cut catches a full send
    // buffer: unacknowledged and unsent updates go into the continuation.
    proxy.set_delay(Duration::from_millis(30));
    let params = bench::Params {
        count: 400_000,
        interval: Duration::ZERO,
    };
    let c = client(&proxy, srv.key, params).await;
    for at in [50_000u64, 200_000] {
        wait_until(LIMIT, "updates", || {
            c.received.load(Ordering::Relaxed) >= at
        })
        .await;
        cut(&proxy);
        wait_stats(&srv.host, "frozen on disk", |s| {
            s.frozen == 1 && s.frozen_in_memory == 0
        })
        .await;
        heal(&proxy);
        c.session.redial_now();
    }
    let n = bounded(LIMIT, "the transfer", c.task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, params.count);
    srv.stop().await;
}
