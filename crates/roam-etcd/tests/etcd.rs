//! roam-etcd against a real etcd (started by `EtcdServer`, never a mock).

use std::time::{Duration, Instant};

use roam_etcd::testing::EtcdServer;
use roam_etcd::{Client, CmpOp, Compare, Error, Op, OpResponse, Txn};

async fn setup() -> (EtcdServer, Client) {
    let etcd = EtcdServer::start().await.expect("start etcd");
    let client = Client::connect(&[etcd.url()]).await.expect("connect");
    (etcd, client)
}

/// A URL nothing listens on (bound then closed).
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    format!("http://127.0.0.1:{port}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_round_trip_with_binary_keys() {
    let (_etcd, c) = setup().await;
    let k1 = vec![b'p', 0xff, 0x00, 0x01];
    let v1 = vec![0x00, 0xff, 0x00, 0xfe, 0x80];
    let r1 = c.put(&k1, &v1, 0).await.unwrap();
    assert!(r1 > 0);
    let kv = c.get(&k1).await.unwrap().expect("present");
    assert_eq!(kv.key, k1);
    assert_eq!(kv.value, v1);
    assert_eq!(kv.version, 1);
    assert_eq!(kv.create_revision, r1);
    assert_eq!(kv.mod_revision, r1);
    assert_eq!(kv.lease, 0);

    // Empty value round-trips (the gateway omits it).
    let r2 = c.put(&[b'p', 0xff, 0xff], b"", 0).await.unwrap();
    assert_eq!(r2, r1 + 1);
    let kv = c.get(&[b'p', 0xff, 0xff]).await.unwrap().unwrap();
    assert!(kv.value.is_empty());
    // Overwrite bumps the version.
    let r3 = c.put(&k1, b"second", 0).await.unwrap();
    let kv = c.get(&k1).await.unwrap().unwrap();
    assert_eq!(
        (kv.version, kv.mod_revision, kv.create_revision),
        (2, r3, r1)
    );

    // Outside the 0xff prefix, on both sides.
    c.put(b"p", b"below", 0).await.unwrap();
    c.put(b"q", b"above", 0).await.unwrap();
    c.put(&[b'p', 0xfe, 0xff], b"below too", 0).await.unwrap();

    // Prefix ending in 0xff: range_end carries into 'q'.
    let kvs = c.get_prefix(&[b'p', 0xff]).await.unwrap();
    let keys: Vec<Vec<u8>> = kvs.iter().map(|kv| kv.key.clone()).collect();
    assert_eq!(keys, vec![k1.clone(), vec![b'p', 0xff, 0xff]]);
    let all_p = c.get_prefix(b"p").await.unwrap();
    assert_eq!(all_p.len(), 4);
    let everything = c.get_prefix(b"").await.unwrap();
    assert_eq!(everything.len(), 5);
    // A prefix of 0xff bytes only: range to the end of the keyspace.
    c.put(&[0xff, 0xff, 0x00], b"top", 0).await.unwrap();
    let top = c.get_prefix(&[0xff, 0xff]).await.unwrap();
    assert_eq!(top.len(), 1);
    assert_eq!(top[0].value, b"top");

    assert_eq!(c.delete(&k1).await.unwrap(), 1);
    assert_eq!(c.delete(&k1).await.unwrap(), 0);
    assert_eq!(c.get(&k1).await.unwrap(), None);
    assert!(c.get_prefix(b"nothing-here").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txn_has_a_single_winner() {
    let (_etcd, c) = setup().await;
    const N: usize = 16;
    let key = b"leader".to_vec();
    let mut tasks = Vec::new();
    for i in 0..N {
        let c = c.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let mine = format!("candidate-{i}").into_bytes();
            let r = c
                .txn(Txn {
                    compare: vec![Compare::Version(key.clone(), CmpOp::Equal, 0)],
                    success: vec![Op::Put {
                        key: key.clone(),
                        value: mine.clone(),
                        lease: 0,
                    }],
                    failure: vec![Op::Get { key }],
                })
                .await
                .unwrap();
            (mine, r)
        }));
    }
    let mut winners = Vec::new();
    let mut losers_saw = Vec::new();
    for t in tasks {
        let (mine, r) = t.await.unwrap();
        assert_eq!(r.responses.len(), 1);
        assert!(r.revision > 0);
        if r.succeeded {
            assert!(matches!(r.responses[0], OpResponse::Put));
            winners.push(mine);
        } else {
            match &r.responses[0] {
                OpResponse::Get(kvs) => {
                    assert_eq!(kvs.len(), 1);
                    losers_saw.push(kvs[0].value.clone());
                }
                other => panic!("loser got {other:?}"),
            }
        }
    }
    assert_eq!(winners.len(), 1, "exactly one winner");
    assert_eq!(losers_saw.len(), N - 1);
    assert!(losers_saw.iter().all(|v| *v == winners[0]));
    assert_eq!(c.get(&key).await.unwrap().unwrap().value, winners[0]);

    // A failure branch with a delete and a get of an absent key.
    let r = c
        .txn(Txn {
            compare: vec![Compare::Value(
                key.clone(),
                CmpOp::Equal,
                b"nobody".to_vec(),
            )],
            success: vec![],
            failure: vec![
                Op::Delete { key: key.clone() },
                Op::Get { key: key.clone() },
            ],
        })
        .await
        .unwrap();
    assert!(!r.succeeded);
    assert!(matches!(r.responses[0], OpResponse::Delete(1)));
    assert!(matches!(&r.responses[1], OpResponse::Get(kvs) if kvs.is_empty()));
    // An empty transaction succeeds with no responses.
    let r = c.txn(Txn::default()).await.unwrap();
    assert!(r.succeeded);
    assert!(r.responses.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txn_mod_revision_fencing() {
    let (_etcd, c) = setup().await;
    let key = b"fenced".to_vec();
    let mut rev = c.put(&key, b"0", 0).await.unwrap();
    let mut stale = Vec::new();
    for i in 1..=50u32 {
        let r = c
            .txn(Txn {
                compare: vec![Compare::ModRevision(key.clone(), CmpOp::Equal, rev)],
                success: vec![Op::Put {
                    key: key.clone(),
                    value: i.to_string().into_bytes(),
                    lease: 0,
                }],
                failure: vec![],
            })
            .await
            .unwrap();
        assert!(r.succeeded, "update {i} at revision {rev}");
        stale.push(rev);
        rev = r.revision;
        // Every older revision is now refused, and changes nothing.
        let old = stale[(i as usize * 7) % stale.len()];
        let r = c
            .txn(Txn {
                compare: vec![Compare::ModRevision(key.clone(), CmpOp::Equal, old)],
                success: vec![Op::Put {
                    key: key.clone(),
                    value: b"stale".to_vec(),
                    lease: 0,
                }],
                failure: vec![Op::Get { key: key.clone() }],
            })
            .await
            .unwrap();
        assert!(!r.succeeded, "stale revision {old} accepted");
        match &r.responses[0] {
            OpResponse::Get(kvs) => {
                assert_eq!(kvs[0].value, i.to_string().into_bytes());
                assert_eq!(kvs[0].mod_revision, rev);
            }
            other => panic!("{other:?}"),
        }
    }
    let kv = c.get(&key).await.unwrap().unwrap();
    assert_eq!(kv.value, b"50");
    assert_eq!(kv.version, 51);
    // The other comparisons, against the final state.
    let r = c
        .txn(Txn {
            compare: vec![
                Compare::ModRevision(key.clone(), CmpOp::Less, rev + 1),
                Compare::ModRevision(key.clone(), CmpOp::Greater, rev - 1),
                Compare::Version(key.clone(), CmpOp::NotEqual, 0),
                Compare::Value(key.clone(), CmpOp::Equal, b"50".to_vec()),
                Compare::Lease(key.clone(), CmpOp::Equal, 0),
            ],
            ..Txn::default()
        })
        .await
        .unwrap();
    assert!(r.succeeded);
}

/// Polls `get(key)` until it is absent; bounded by `limit`.
async fn wait_gone(c: &Client, key: &[u8], limit: Duration) -> Duration {
    let start = Instant::now();
    for _ in 0..1000 {
        if c.get(key).await.unwrap().is_none() {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "key still present after {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("key still present after 1000 polls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_keep_alive_expire_and_revoke() {
    let (_etcd, c) = setup().await;
    let lease = c.grant(Duration::from_secs(2)).await.unwrap();
    assert!(lease.id != 0);
    assert!(lease.ttl >= Duration::from_secs(2), "{lease:?}");
    c.put(b"ephemeral", b"here", lease.id).await.unwrap();
    assert_eq!(c.get(b"ephemeral").await.unwrap().unwrap().lease, lease.id);

    // Kept alive past 3 s.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(3500) {
        let ttl = c.keep_alive_once(lease.id).await.unwrap();
        assert!(ttl.is_some_and(|t| t >= Duration::from_secs(1)), "{ttl:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(c.get(b"ephemeral").await.unwrap().is_some());

    // Left alone: gone within ~4 s (TTL plus etcd's expiry check).
    let took = wait_gone(&c, b"ephemeral", Duration::from_secs(6)).await;
    assert!(
        took >= Duration::from_secs(1),
        "expired too early: {took:?}"
    );
    assert_eq!(c.keep_alive_once(lease.id).await.unwrap(), None);
    match c.revoke(lease.id).await {
        Err(Error::Server { status, message }) => {
            assert_eq!(status, 404);
            assert!(message.contains("lease not found"), "{message}");
        }
        other => panic!("revoking an expired lease: {other:?}"),
    }

    // Revoke removes keys at once.
    let lease = c.grant(Duration::from_millis(10_500)).await.unwrap();
    assert_eq!(lease.ttl, Duration::from_secs(11));
    c.put(b"a", b"1", lease.id).await.unwrap();
    c.put(b"b", b"2", lease.id).await.unwrap();
    c.put(b"c", b"3", 0).await.unwrap();
    c.revoke(lease.id).await.unwrap();
    assert_eq!(c.get(b"a").await.unwrap(), None);
    assert_eq!(c.get(b"b").await.unwrap(), None);
    assert!(c.get(b"c").await.unwrap().is_some());
    assert_eq!(c.keep_alive_once(lease.id).await.unwrap(), None);
    // A lease never granted.
    assert_eq!(c.keep_alive_once(12345).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_precise_and_bounded() {
    // A closed port: Unreachable, quickly.
    let start = Instant::now();
    let dead = dead_url();
    match Client::connect(std::slice::from_ref(&dead)).await {
        Err(Error::Unreachable(msg)) => assert!(msg.contains(&dead), "{msg}"),
        other => panic!("connect to a closed port: {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(matches!(
        Client::connect(&[]).await,
        Err(Error::Unreachable(_))
    ));
    assert!(matches!(
        Client::connect(&["https://127.0.0.1:1".to_string()]).await,
        Err(Error::Unreachable(_))
    ));

    let (mut etcd, c) = setup().await;
    match c.put(b"k", b"v", 0x7777_7777).await {
        Err(Error::Server { status, message }) => {
            assert_eq!(status, 404);
            assert!(message.contains("lease not found"), "{message}");
        }
        other => panic!("put with a nonexistent lease: {other:?}"),
    }
    // An empty key is refused by etcd, with its message.
    match c.put(b"", b"v", 0).await {
        Err(Error::Server { message, .. }) => assert!(message.contains("key"), "{message}"),
        other => panic!("put with an empty key: {other:?}"),
    }

    // Killed mid-use: requests in flight and after fail, bounded by the timeout.
    let c = c.with_timeout(Duration::from_secs(2));
    let mut tasks = Vec::new();
    for i in 0..8u32 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            loop {
                match c.put(format!("busy{i}").as_bytes(), b"x", 0).await {
                    Ok(_) => {}
                    Err(e) => return (e, start.elapsed()),
                }
                assert!(start.elapsed() < Duration::from_secs(20), "never failed");
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    etcd.kill();
    let killed = Instant::now();
    for t in tasks {
        let (e, _) = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("a request hung past the client timeout")
            .unwrap();
        assert!(
            matches!(e, Error::Unreachable(_) | Error::Timeout(_)),
            "{e:?}"
        );
    }
    assert!(killed.elapsed() < Duration::from_secs(3));
    let start = Instant::now();
    assert!(matches!(
        c.get(b"k").await,
        Err(Error::Unreachable(_) | Error::Timeout(_))
    ));
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_endpoint_used_when_first_is_dead() {
    let etcd = EtcdServer::start().await.unwrap();
    let c = Client::connect(&[dead_url(), etcd.url()]).await.unwrap();
    c.put(b"k", b"v", 0).await.unwrap();
    assert_eq!(c.get(b"k").await.unwrap().unwrap().value, b"v");
    // Also without the scheme.
    let bare = etcd.url().trim_start_matches("http://").to_string();
    let c2 = Client::connect(&[dead_url(), bare]).await.unwrap();
    assert_eq!(c2.get(b"k").await.unwrap().unwrap().value, b"v");
}
