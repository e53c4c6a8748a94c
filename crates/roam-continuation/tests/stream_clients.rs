//! The Icecast-like example with several listeners over real loopback
//! sockets: suspended listeners are frozen (no driver, no socket) while the
//! others play on; on resume each continues from its position or jumps to
//! live, as it asked.

mod common;

#[path = "../examples/support/stream.rs"]
mod stream;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bounded, cli, cut, heal, start, wait_stats, wait_until};
use roam_sim::proxy::FaultProxy;
use stream::{Broadcast, Listened, OnResume, Request};

const LIMIT: Duration = Duration::from_secs(60);

struct Listener {
    req: Request,
    seen: Arc<Mutex<Listened>>,
    session: roam::SessionHandle,
    task: tokio::task::JoinHandle<Result<Listened, String>>,
}

async fn listener(
    proxy: &FaultProxy,
    key: roam_proto::PublicKey,
    req: Request,
    want: u64,
) -> Listener {
    let session = roam::connect(&proxy.addr().to_string(), cli::client_config(Some(key)))
        .await
        .expect("connect");
    let mut s = session.open_stream(req.meta().as_bytes()).expect("open");
    let s2 = session.clone();
    tokio::spawn(async move {
        while let Ok((mut st, _)) = s2.accept_stream().await {
            let _ = roam_continuation::read_attrs(&mut st).await;
        }
    });
    let seen = Arc::new(Mutex::new(Listened::default()));
    let seen2 = seen.clone();
    let r = req.clone();
    let task = tokio::spawn(async move {
        stream::listen(&mut s, &r, want, |l| *seen2.lock().unwrap() = *l).await
    });
    Listener {
        req,
        seen,
        session,
        task,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_continue_or_jump_to_live_and_cost_nothing_while_away() {
    common::init_logging();
    let dir = tempfile::tempdir().unwrap();
    let b = Broadcast {
        period: Duration::from_millis(5),
        chunk_len: 512,
    };
    let srv = start(
        dir.path(),
        0,
        vec![stream::service(b)],
        |_| {},
        move |host, handle| stream::on_session(b, host, handle),
    )
    .await;
    let mounts = ["/radio", "/news"];
    let policies = [
        OnResume::Continue,
        OnResume::Continue,
        OnResume::Live,
        OnResume::Continue,
        OnResume::Live,
        OnResume::Continue,
    ];
    let want = 600; // 3 s of broadcast each
    let mut proxies = Vec::new();
    let mut ls = Vec::new();
    for (k, p) in policies.iter().enumerate() {
        let proxy = FaultProxy::start(srv.addr).await.unwrap();
        let req = Request {
            mount: mounts[k % 2].into(),
            on_resume: *p,
        };
        ls.push(listener(&proxy, srv.key, req, want).await);
        proxies.push(proxy);
    }
    for l in &ls {
        wait_until(LIMIT, "chunks", || l.seen.lock().unwrap().chunks >= 40).await;
    }
    // The first three go away: frozen, while the other three play on.
    for p in &proxies[..3] {
        cut(p);
    }
    wait_stats(&srv.host, "three frozen, three live", |s| {
        s.frozen == 3 && s.live == 3 && s.live_suspended == 0
    })
    .await;
    let frozen_at: Vec<u64> = ls[..3]
        .iter()
        .map(|l| l.seen.lock().unwrap().last)
        .collect();
    let playing_before = ls[3].seen.lock().unwrap().chunks;
    // The others play on (at least 60 chunks, 0.3 s of broadcast) while
    // the three stay frozen.
    wait_until(LIMIT, "the others to play on", || {
        ls[3].seen.lock().unwrap().chunks > playing_before + 60
    })
    .await;
    assert_eq!(srv.host.stats().frozen, 3);
    let head_at_resume = b.head();
    for (p, l) in proxies[..3].iter().zip(&ls) {
        heal(p);
        l.session.redial_now();
    }
    let mut results = Vec::new();
    for l in ls {
        let r = bounded(LIMIT, "a listener", l.task).await.unwrap().unwrap();
        results.push((l.req.on_resume, r));
    }
    for (k, (policy, r)) in results.iter().enumerate() {
        assert_eq!(r.chunks, want, "listener {k}");
        match policy {
            OnResume::Continue => {
                assert_eq!(r.jumps, 0, "listener {k}");
                assert_eq!(r.last, r.first + want - 1, "listener {k}: contiguous");
            }
            OnResume::Live if k < 3 => {
                assert_eq!(r.jumps, 1, "listener {k}: one jump to live");
                assert!(r.last > head_at_resume, "listener {k}");
            }
            OnResume::Live => assert_eq!(r.jumps, 0, "listener {k}"),
        }
    }
    // The continuing ones were behind live by the suspension and caught up
    // from the history: they resumed exactly after the chunk they had.
    assert!(frozen_at[0] < head_at_resume && frozen_at[1] < head_at_resume);
    let st = srv.host.stats();
    assert_eq!((st.suspends, st.resumes), (3, 3));
    srv.stop().await;
}
