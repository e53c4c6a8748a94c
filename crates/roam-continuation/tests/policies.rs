//! Expiry, dependencies, compatibility vectors and store corruption, over
//! real loopback sockets.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bench, bounded, client, cut, heal, start, wait_stats, wait_until};
use redb::ReadableTable;
use roam_continuation::{DiscardReason, Error, Generation, Incompatible, Service};
use roam_sim::proxy::FaultProxy;

const LIMIT: Duration = Duration::from_secs(60);

fn params() -> bench::Params {
    bench::Params {
        count: 0,
        interval: Duration::from_millis(1),
    }
}

type Log = Arc<Mutex<Vec<(roam::SessionId, DiscardReason, bool)>>>;

/// The bench service with a discard log (id, reason, whether the `offset`
/// attribute came along).
fn logged(generation: Generation, expiry: Duration, log: &Log) -> Service {
    let log = log.clone();
    bench::service(generation, expiry).on_discard(move |d| {
        log.lock()
            .unwrap()
            .push((d.id, d.reason.clone(), d.attrs.contains_key("offset")))
    })
}

/// Waits for the client's session to end (its resume refused).
async fn wait_closed(c: &common::Client) -> roam::CloseReason {
    bounded(LIMIT, "the client session to end", c.session.closed()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_discards_everything_and_honours_overrides() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let first = Arc::new(Mutex::new(None::<roam::SessionId>));
    let f2 = first.clone();
    let srv = start(
        dir.path(),
        0,
        vec![logged(Generation::Eager, Duration::from_millis(400), &log)],
        |_| {},
        move |host, handle| {
            bench::on_session_with(host, handle, |s| {
                // The first session overrides the service's expiry.
                let mut f = f2.lock().unwrap();
                if f.is_none() {
                    *f = Some(s.id());
                    s.set_expiry(Duration::from_secs(60));
                }
            })
        },
    )
    .await;
    let (p1, p2) = (
        FaultProxy::start(srv.addr).await.unwrap(),
        FaultProxy::start(srv.addr).await.unwrap(),
    );
    let keep = client(&p1, srv.key, params()).await;
    wait_until(LIMIT, "first adopted", || first.lock().unwrap().is_some()).await;
    let gone = client(&p2, srv.key, params()).await;
    for c in [&keep, &gone] {
        wait_until(LIMIT, "updates", || c.received.load(Ordering::Relaxed) > 20).await;
    }
    let gone_id = gone.session.id().unwrap();
    cut(&p1);
    cut(&p2);
    wait_stats(&srv.host, "both suspended", |s| s.suspends == 2).await;
    wait_stats(&srv.host, "one expired", |s| {
        s.discarded == 1 && s.frozen == 1
    })
    .await;
    assert_eq!(
        log.lock().unwrap().as_slice(),
        &[(gone_id, DiscardReason::Expired, true)],
        "discard callback with the last attributes"
    );
    assert_eq!(
        srv.host.store().len().unwrap(),
        1,
        "nothing left of the expired one"
    );
    assert_eq!(srv.host.frozen_ids(), vec![keep.session.id().unwrap()]);

    // The expired client is told its session is gone; the other resumes.
    heal(&p1);
    heal(&p2);
    gone.session.redial_now();
    keep.session.redial_now();
    let reason = wait_closed(&gone).await;
    assert!(
        matches!(
            reason,
            roam::CloseReason::Error(roam_proto::Error::UnknownSession)
        ),
        "{reason:?}"
    );
    let before = keep.received.load(Ordering::Relaxed);
    wait_until(LIMIT, "the kept session to go on", || {
        keep.received.load(Ordering::Relaxed) > before + 50
    })
    .await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_session_that_expires_before_freezing_is_released_too() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let lazy = Generation::Lazy {
        after: Duration::from_secs(30),
    };
    let srv = start(
        dir.path(),
        0,
        vec![logged(lazy, Duration::from_millis(300), &log)],
        |_| {},
        bench::on_session,
    )
    .await;
    let p = FaultProxy::start(srv.addr).await.unwrap();
    let c = client(&p, srv.key, params()).await;
    wait_until(LIMIT, "updates", || c.received.load(Ordering::Relaxed) > 20).await;
    cut(&p);
    wait_stats(&srv.host, "released", |s| {
        s.discarded == 1 && s.live == 0 && s.frozen == 0
    })
    .await;
    assert_eq!(log.lock().unwrap()[0].1, DiscardReason::Expired);
    heal(&p);
    c.session.redial_now();
    wait_closed(&c).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dependencies_cascade_suspension_and_expiry() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let parent = Arc::new(Mutex::new(None::<roam::SessionId>));
    let p2 = parent.clone();
    let srv = start(
        dir.path(),
        0,
        vec![logged(Generation::Eager, Duration::from_millis(2000), &log)],
        |_| {},
        move |host, handle| {
            bench::on_session_with(host, handle, |s| {
                let mut p = p2.lock().unwrap();
                match *p {
                    None => *p = Some(s.id()),
                    Some(parent) => {
                        s.depend_on(parent).expect("depend");
                        assert!(matches!(
                            s.depend_on(s.id()),
                            Err(Error::DependencyCycle(_))
                        ));
                        // The child itself would be kept for a minute.
                        s.set_expiry(Duration::from_secs(60));
                    }
                }
            })
        },
    )
    .await;
    let (pp, pc) = (
        FaultProxy::start(srv.addr).await.unwrap(),
        FaultProxy::start(srv.addr).await.unwrap(),
    );
    let par = client(&pp, srv.key, params()).await;
    wait_until(LIMIT, "parent adopted", || parent.lock().unwrap().is_some()).await;
    let child = client(&pc, srv.key, params()).await;
    for c in [&par, &child] {
        wait_until(LIMIT, "updates", || c.received.load(Ordering::Relaxed) > 20).await;
    }
    let (pid, cid) = (par.session.id().unwrap(), child.session.id().unwrap());

    // Suspending the parent suspends the child too, although its client is
    // still connected (it re-dials at once and resumes from the continuation).
    cut(&pp);
    wait_stats(&srv.host, "parent and child suspended", |s| s.suspends == 2).await;
    wait_stats(&srv.host, "child resumed", |s| {
        s.resumes == 1 && s.live == 1
    })
    .await;

    // The parent expires: the child, live, goes with it.
    wait_stats(&srv.host, "both discarded", |s| s.discarded == 2).await;
    let got = log.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![
            (pid, DiscardReason::Expired, true),
            (cid, DiscardReason::ParentGone(pid), true),
        ]
    );
    let reason = wait_closed(&child).await;
    assert!(
        matches!(
            reason,
            roam::CloseReason::Error(roam_proto::Error::UnknownSession)
        ),
        "{reason:?}"
    );
    let st = srv.host.stats();
    assert_eq!((st.live, st.frozen), (0, 0));
    assert!(srv.host.store().is_empty().unwrap());
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incompatible_hosts_refuse_and_name_the_mismatch() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let with = |version: &str, region: Option<&str>| {
        let mut s = Service::new(bench::SERVICE)
            .version(version)
            .routine("updates", bench::resume);
        if let Some(r) = region {
            s = s.property("region", r);
        }
        vec![s]
    };
    let setup = |host: &roam_continuation::Host, handle| {
        bench::on_session_with(host, handle, |s| s.require("region", "eu"))
    };
    let srv = start(dir.path(), 0, with("1", Some("eu")), |_| {}, setup).await;
    let port = srv.addr.port();
    let p = FaultProxy::start(srv.addr).await.unwrap();
    let c = client(&p, srv.key, params()).await;
    wait_until(LIMIT, "updates", || c.received.load(Ordering::Relaxed) > 20).await;
    let id = c.session.id().unwrap();
    cut(&p);
    wait_stats(&srv.host, "frozen", |s| s.frozen == 1).await;
    srv.crash().await;

    // Version 2 of the service: refused, and the error names the property.
    let refusals = Arc::new(Mutex::new(Vec::new()));
    let r2 = refusals.clone();
    let keypair = common::cli::load_or_create_key(dir.path()).unwrap();
    let mut config =
        roam_continuation::HostConfig::new(dir.path(), common::cli::server_config(keypair));
    config.offload_after = Duration::from_secs(1);
    let mut tries = 0;
    let host = loop {
        let r2 = r2.clone();
        match roam_continuation::Host::builder(config.clone())
            .service(with("2", Some("eu")).pop().unwrap())
            .on_refused(move |id, e| r2.lock().unwrap().push((id, e.clone())))
            .open()
            .await
        {
            Ok((h, _)) => break h,
            // The crashed host may still be releasing the database.
            Err(Error::Store(e)) if tries < 100 && e.to_string().contains("already open") => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("open: {e}"),
        }
    };
    let want = Incompatible::Mismatch {
        service: "bench".into(),
        property: "version".into(),
        required: "1".into(),
        found: Some("2".into()),
    };
    match host.check(id).await {
        Err(Error::Incompatible(e)) => {
            assert_eq!(e, want);
            assert_eq!(
                e.to_string(),
                "continuation requires version = \"1\" but service \"bench\" on this host has version = \"2\""
            );
        }
        other => panic!("expected a version mismatch, got {other:?}"),
    }
    // A resume attempt is refused ("busy": retry later) and reported.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let h = host.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(async move {
        h.serve(
            listener,
            async {
                let _ = stop_rx.await;
            },
            |_| {},
        )
        .await
    });
    heal(&p);
    c.session.redial_now();
    wait_until(LIMIT, "a refusal", || !refusals.lock().unwrap().is_empty()).await;
    assert_eq!(refusals.lock().unwrap()[0], (id, want));
    assert!(host.stats().refused >= 1);
    assert_eq!(host.stats().frozen, 1, "kept for a compatible host");
    assert!(!c.session.is_closed(), "busy is not fatal for the client");
    p.refuse(true);
    let _ = stop_tx.send(());
    let _ = serving.await;
    drop(host);

    // A host that lacks the required property says so too.
    let srv = start(dir.path(), port, with("1", None), |_| {}, setup).await;
    match srv.host.check(id).await {
        Err(Error::Incompatible(Incompatible::Mismatch {
            property,
            found: None,
            ..
        })) => {
            assert_eq!(property, "region")
        }
        other => panic!("expected a missing region, got {other:?}"),
    }
    srv.crash().await;

    // The compatible version takes it back: nothing was lost meanwhile.
    let srv = start(dir.path(), port, with("1", Some("eu")), |_| {}, setup).await;
    assert!(srv.host.check(id).await.is_ok());
    heal(&p);
    c.session.redial_now();
    let before = c.received.load(Ordering::Relaxed);
    wait_until(LIMIT, "updates after the compatible resume", || {
        c.received.load(Ordering::Relaxed) > before + 50
    })
    .await;
    assert!(!c.task.is_finished(), "no error in the update sequence");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_or_truncated_entries_are_reported_and_skipped() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let svc = |log: &Log| vec![logged(Generation::Eager, Duration::from_secs(60), log)];
    let srv = start(
        dir.path(),
        0,
        svc(&log),
        |c| c.offload_after = Duration::ZERO,
        bench::on_session,
    )
    .await;
    let port = srv.addr.port();
    let mut proxies = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..3 {
        let p = FaultProxy::start(srv.addr).await.unwrap();
        clients.push(client(&p, srv.key, params()).await);
        proxies.push(p);
    }
    for c in &clients {
        wait_until(LIMIT, "updates", || c.received.load(Ordering::Relaxed) > 20).await;
    }
    for p in &proxies {
        cut(p);
    }
    wait_stats(&srv.host, "all frozen on disk", |s| {
        s.frozen == 3 && s.frozen_in_memory == 0
    })
    .await;
    srv.crash().await;

    // Damage two entries behind the host's back.
    let ids: Vec<roam::SessionId> = clients.iter().map(|c| c.session.id().unwrap()).collect();
    {
        let db = redb::Database::create(dir.path().join("continuations.redb")).unwrap();
        let meta: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("meta");
        let body: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("body");
        let tx = db.begin_write().unwrap();
        {
            let mut b = tx.open_table(body).unwrap();
            let mut v = b
                .get(ids[0].0.as_slice())
                .unwrap()
                .unwrap()
                .value()
                .to_vec();
            let mid = v.len() / 2;
            v[mid] ^= 0x40;
            b.insert(ids[0].0.as_slice(), v.as_slice()).unwrap();
            let mut m = tx.open_table(meta).unwrap();
            let v = m
                .get(ids[1].0.as_slice())
                .unwrap()
                .unwrap()
                .value()
                .to_vec();
            m.insert(ids[1].0.as_slice(), &v[..v.len() - 7]).unwrap();
            m.insert(b"not a session id".as_slice(), b"junk".as_slice())
                .unwrap();
        }
        tx.commit().unwrap();
    }

    let srv = start(dir.path(), port, svc(&log), |_| {}, bench::on_session).await;
    let mut keys: Vec<String> = srv.report.corrupt.iter().map(|c| c.key.clone()).collect();
    keys.sort();
    let mut want = vec![
        ids[1].to_string(),
        "6e6f7420612073657373696f6e206964".to_string(),
    ];
    want.sort();
    assert_eq!(keys, want, "{:?}", srv.report.corrupt);
    assert_eq!(srv.report.loaded, 2);
    assert!(matches!(
        srv.host.check(ids[0]).await,
        Err(Error::Corrupt(_))
    ));

    for p in &proxies {
        heal(p);
    }
    for c in &clients {
        c.session.redial_now();
    }
    // The damaged ones are refused as unknown; the intact one goes on.
    for c in &clients[..2] {
        let r = wait_closed(c).await;
        assert!(
            matches!(
                r,
                roam::CloseReason::Error(roam_proto::Error::UnknownSession)
            ),
            "{r:?}"
        );
    }
    let before = clients[2].received.load(Ordering::Relaxed);
    wait_until(LIMIT, "the intact session to go on", || {
        clients[2].received.load(Ordering::Relaxed) > before + 50
    })
    .await;
    let got = log.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, ids[0]);
    assert!(
        matches!(got[0].1, DiscardReason::Corrupt(_)),
        "{:?}",
        got[0].1
    );
    let q = srv.host.store().quarantined().unwrap();
    assert_eq!(q.len(), 3, "{q:?}");
    assert_eq!(srv.host.stats().corrupt, 3);
    srv.stop().await;
}
