//! Measurements (ignored by default; run with
//! `cargo test --release -p roam-continuation --test measure -- --ignored --nocapture`):
//! continuation sizes, suspend and resume latency on one host, memory and
//! descriptors per active and per suspended session, and 64 / 1,000
//! simultaneous suspends and resumes. Results are in this crate's README.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{bench, bounded, client, cut, fd_count, heal, start, wait_stats, wait_until};
use roam_continuation::Generation;
use roam_sim::proxy::FaultProxy;

const LIMIT: Duration = Duration::from_secs(120);

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn summary(mut v: Vec<Duration>) -> String {
    v.sort();
    let n = v.len();
    let mean = v.iter().sum::<Duration>() / n as u32;
    format!(
        "mean {:.2} ms, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (n={n})",
        ms(mean),
        ms(v[n / 2]),
        ms(v[(n * 99 / 100).min(n - 1)]),
        ms(v[n - 1])
    )
}

fn take_reports() -> Vec<(roam_continuation::SuspendReport, Duration)> {
    std::mem::take(&mut *bench::REPORTS.lock().unwrap())
}

/// Waits for the client's next `Resumed` event after `t0`; returns the delay.
async fn resumed_after(
    events: &mut tokio::sync::broadcast::Receiver<roam::SessionEvent>,
    t0: Instant,
) -> Duration {
    loop {
        match events.recv().await {
            Ok(roam::SessionEvent::Resumed { .. }) => return t0.elapsed(),
            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(e) => panic!("events: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; prints results"]
async fn sizes_and_latencies() {
    let dir = tempfile::tempdir().unwrap();
    for (label, offload) in [
        ("in memory", Duration::from_secs(60)),
        ("from the store", Duration::ZERO),
    ] {
        let srv = start(
            dir.path().join(label.replace(' ', "_")).as_path(),
            0,
            vec![bench::service(Generation::Eager, Duration::from_secs(600))],
            |c| c.offload_after = offload,
            bench::on_session,
        )
        .await;
        let proxy = FaultProxy::start(srv.addr).await.unwrap();
        let c = client(
            &proxy,
            srv.key,
            bench::Params {
                count: 0,
                interval: Duration::from_millis(1),
            },
        )
        .await;
        let mut events = c.session.events();
        let mut suspend = Vec::new();
        let mut cut_to_frozen = Vec::new();
        let mut resume = Vec::new();
        let mut first_update = Vec::new();
        take_reports();
        for round in 0..20u64 {
            let at = c.received.load(Ordering::Relaxed) + 50;
            wait_until(LIMIT, "updates", || {
                c.received.load(Ordering::Relaxed) >= at
            })
            .await;
            let t = Instant::now();
            cut(&proxy);
            wait_stats(&srv.host, "frozen", |s| {
                s.frozen == 1 && s.suspends == round + 1
            })
            .await;
            cut_to_frozen.push(t.elapsed());
            if offload.is_zero() {
                wait_stats(&srv.host, "offloaded", |s| s.frozen_in_memory == 0).await;
            }
            heal(&proxy);
            let before = c.received.load(Ordering::Relaxed);
            let t0 = Instant::now();
            c.session.redial_now();
            resume.push(bounded(LIMIT, "resume", resumed_after(&mut events, t0)).await);
            wait_until(LIMIT, "an update", || {
                c.received.load(Ordering::Relaxed) > before
            })
            .await;
            first_update.push(t0.elapsed());
        }
        let reports = take_reports();
        suspend.extend(reports.iter().map(|(_, d)| *d));
        let (r, _) = &reports[reports.len() - 1];
        println!("== bench session, resumed {label}");
        println!(
            "continuation (idle, 1 ms updates): protocol {} B, record {} B raw, {} B stored (zstd)",
            r.protocol_bytes, r.raw_bytes, r.stored_bytes
        );
        println!("suspend, freeze request -> stored: {}", summary(suspend));
        println!(
            "suspend, cut -> frozen:             {}",
            summary(cut_to_frozen)
        );
        println!("resume, re-dial -> Resumed:         {}", summary(resume));
        println!(
            "resume, re-dial -> next update:     {}",
            summary(first_update)
        );
        srv.stop().await;
    }

    // A session cut while sending flat out: its send buffer is full of
    // unacknowledged and unsent updates.
    let srv = start(
        dir.path().join("busy").as_path(),
        0,
        vec![bench::service(Generation::Eager, Duration::from_secs(600))],
        |_| {},
        bench::on_session,
    )
    .await;
    let proxy = FaultProxy::start(srv.addr).await.unwrap();
    proxy.set_delay(Duration::from_millis(20));
    let c = client(
        &proxy,
        srv.key,
        bench::Params {
            count: 0,
            interval: Duration::ZERO,
        },
    )
    .await;
    wait_until(LIMIT, "updates", || {
        c.received.load(Ordering::Relaxed) >= 100_000
    })
    .await;
    take_reports();
    cut(&proxy);
    wait_stats(&srv.host, "frozen", |s| s.frozen == 1).await;
    let (r, d) = take_reports().pop().unwrap();
    println!(
        "== busy bench session (send buffer full): protocol {} B, record {} B raw, {} B stored (zstd); suspend {:.2} ms",
        r.protocol_bytes, r.raw_bytes, r.stored_bytes, ms(d)
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; prints results"]
async fn memory_and_descriptors_per_session() {
    let n = 1000;
    let dir = tempfile::tempdir().unwrap();
    let srv = start(
        dir.path(),
        0,
        vec![common::idle_service()],
        |c| c.offload_after = Duration::ZERO,
        common::idle_on_session,
    )
    .await;
    let (addr, key) = (srv.addr, srv.key);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (rss0, fd0) = (rss_kib(), fd_count());
    // n suspended sessions: connect, handshake, vanish.
    for _ in 0..n {
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        common::raw_handshake(&mut sock, key).await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    wait_stats(&srv.host, "frozen", |s| {
        s.frozen == n && s.live == 0 && s.in_transition == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss1, fd1) = (rss_kib(), fd_count());
    // n active sessions: the client sockets stay open (this process holds
    // both ends: one descriptor each side).
    let mut socks = Vec::new();
    for _ in 0..n {
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        common::raw_handshake(&mut sock, key).await;
        socks.push(sock);
    }
    wait_stats(&srv.host, "live", |s| s.live == n).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (rss2, fd2) = (rss_kib(), fd_count());
    println!("== {n} sessions each");
    println!(
        "suspended: {:.2} KiB RSS and {:.3} descriptors per session (store: {} continuations)",
        (rss1 as f64 - rss0 as f64) / n as f64,
        (fd1 as f64 - fd0 as f64) / n as f64,
        srv.host.store().len().unwrap()
    );
    println!(
        "active:    {:.2} KiB RSS and {:.3} server-side descriptors per session",
        (rss2 as f64 - rss1 as f64) / n as f64,
        (fd2 as f64 - fd1 as f64) / n as f64 - 1.0
    );
    drop(socks);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; prints results"]
async fn simultaneous_suspends_and_resumes() {
    for n in [64usize, 1000] {
        let dir = tempfile::tempdir().unwrap();
        let srv = start(
            dir.path(),
            0,
            vec![bench::service(Generation::Eager, Duration::from_secs(600))],
            |c| c.offload_after = Duration::from_secs(600),
            bench::on_session,
        )
        .await;
        let proxy = FaultProxy::start(srv.addr).await.unwrap();
        let mut clients = Vec::new();
        for _ in 0..n {
            clients.push(
                client(
                    &proxy,
                    srv.key,
                    bench::Params {
                        count: 0,
                        interval: Duration::from_millis(20),
                    },
                )
                .await,
            );
        }
        for c in &clients {
            wait_until(LIMIT, "updates", || c.received.load(Ordering::Relaxed) >= 2).await;
        }
        take_reports();
        let t = Instant::now();
        cut(&proxy);
        wait_stats(&srv.host, "all frozen", |s| {
            s.frozen == n && s.in_transition == 0
        })
        .await;
        let all_frozen = t.elapsed();
        let per: Vec<Duration> = take_reports().into_iter().map(|(_, d)| d).collect();
        heal(&proxy);
        let mut waits = Vec::new();
        let t0 = Instant::now();
        for c in &clients {
            let mut ev = c.session.events();
            c.session.redial_now();
            waits.push(tokio::spawn(
                async move { resumed_after(&mut ev, t0).await },
            ));
        }
        let mut resumes = Vec::new();
        for w in waits {
            resumes.push(bounded(LIMIT, "resume", w).await.unwrap());
        }
        let all_resumed = t0.elapsed();
        wait_stats(&srv.host, "all live", |s| s.live == n).await;
        println!("== {n} simultaneous");
        println!(
            "suspend: all {n} frozen {:.1} ms after the cut; per session (freeze request -> stored) {}",
            ms(all_frozen),
            summary(per)
        );
        println!(
            "resume: all {n} resumed {:.1} ms after the re-dial; per session {}",
            ms(all_resumed),
            summary(resumes)
        );
        for c in &clients {
            let _ = tokio::time::timeout(Duration::from_millis(100), c.session.close(0, "")).await;
        }
        srv.crash().await;
    }
}
