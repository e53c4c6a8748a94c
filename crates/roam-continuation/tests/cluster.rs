//! A cluster of hosts on loopback (`docs/PROTOCOL.md` §14): live sessions
//! move between them mid-stream and their clients follow; every byte is
//! checked (a position-dependent pattern, echoed back). Failure cases leave
//! the session working at its source.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{bounded, cli, init_logging, wait_until};
use roam::RoamStream;
use roam_continuation::cluster::etcd::EtcdOptions;
use roam_continuation::cluster::link::Link;
use roam_continuation::cluster::wire::{Msg, Refusal};
use roam_continuation::{ClusterConfig, Continuation, Host, ManagedSession, MoveError, Service};
use roam_etcd::testing::EtcdServer;
use roam_proto::Keypair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Byte `i` of the test pattern.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// The echo service: echoes its stream; at each freeze request it stores
/// how much it echoed and suspends. `ballast` bytes of attributes make the
/// state bigger (pre-copied when the session moves).
fn echo_service(version: &str, echoed: Arc<AtomicU64>) -> Service {
    Service::new("echo")
        .version(version)
        .routine("echo", move |mut r| {
            let echoed = echoed.clone();
            async move {
                match r.take_stream("main") {
                    Some(stream) => echo_loop(r.session, stream, echoed).await,
                    // The stream ended both ways before the move: idle on.
                    None => {
                        r.session.freeze_requested().await;
                        let _ = r.session.suspend(Continuation::new("echo")).await;
                    }
                }
            }
        })
}

async fn echo_loop(s: ManagedSession, mut stream: RoamStream, echoed: Arc<AtomicU64>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            _ = s.freeze_requested() => {
                let n = echoed.load(Ordering::SeqCst);
                s.store("echoed", n.to_le_bytes()).expect("store");
                let _ = s.suspend(Continuation::new("echo").stream("main", stream)).await;
                return;
            }
            r = stream.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        let _ = stream.shutdown().await;
                        // Keep answering freezes until the session goes.
                        s.freeze_requested().await;
                        let _ = s.suspend(Continuation::new("echo").stream("main", stream)).await;
                        return;
                    }
                    Ok(n) => n,
                };
                if stream.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                echoed.fetch_add(n as u64, Ordering::SeqCst);
            }
        }
    }
}

/// One running host of the test cluster, with its state directory.
type Node = common::ClusterHost<tempfile::TempDir>;

struct TestCluster {
    service_key: Keypair,
    config: ClusterConfig,
    nodes: Vec<Node>,
    echoed: Arc<AtomicU64>,
}

/// More lines of the cluster file: hosts that this test plays itself (or
/// that are down), operators.
#[derive(Default)]
struct Extra {
    /// `host NAME clients=.. peers=.. key=..` (fields pre-formatted).
    hosts: Vec<String>,
    /// Operator names and keys.
    operators: Vec<(String, roam_proto::PublicKey)>,
    /// etcd's URL: the hosts keep the cluster's directory there (lease TTL
    /// 2 s).
    etcd: Option<String>,
    /// The cap on a continuation kept in etcd, if not the default.
    etcd_cap: Option<usize>,
    /// The one client address every host announces (§9.1), instead of
    /// the cluster's: a proxy in front of a host, so that the proxy's
    /// refusal cuts the client off, with no other address to try.
    announce: Option<String>,
}

/// A real etcd for one test (killed when dropped) and the `Extra` that
/// points the hosts at it.
async fn with_etcd() -> (EtcdServer, Extra) {
    let etcd = EtcdServer::start().await.expect("etcd");
    let extra = Extra {
        etcd: Some(etcd.url()),
        ..Extra::default()
    };
    (etcd, extra)
}

/// The hex form of a session id, as in its etcd keys.
fn hex_id(id: roam::SessionId) -> String {
    id.0.iter().map(|b| format!("{b:02x}")).collect()
}

/// Asserts that etcd (at `url`, if the cluster uses one) agrees with the
/// cluster about `id`, live at host `holder`: no record (nothing that could
/// resume a stale copy of it) and, if it has an owner key (it moved or was
/// suspended), that key names `holder`.
async fn assert_etcd_agrees(url: Option<&str>, id: roam::SessionId, holder: &str) {
    let Some(url) = url else { return };
    let db = roam_etcd::Client::connect(&[url.to_string()])
        .await
        .unwrap();
    let hex = hex_id(id);
    let record = format!("/roam/test/record/{hex}");
    let got = db.get(record.as_bytes()).await.unwrap();
    assert!(got.is_none(), "{record} left in etcd for a live session");
    let owner = format!("/roam/test/owner/{hex}");
    let got = db.get(owner.as_bytes()).await.unwrap().map(|kv| kv.value);
    assert!(
        got.is_none() || got.as_deref() == Some(holder.as_bytes()),
        "{owner} names {:?}, but the session is live at {holder}",
        got.map(|v| String::from_utf8_lossy(&v).into_owned())
    );
}

/// A cluster of hosts (`versions`) that announce only the address of a
/// fault proxy in front of h0, and a transfer of `len` bytes through it,
/// 256 KiB of them echoed and checked: the proxy's refusal cuts the client
/// off, with no other address to try.
async fn behind_proxy(
    versions: &[&str],
    mut extra: Extra,
    len: u64,
) -> (TestCluster, roam_sim::proxy::FaultProxy, Transfer) {
    // The proxy's address goes into the hosts' settings, h0's address
    // into the proxy's: it dials nothing until the client comes.
    let nowhere = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let proxy = roam_sim::proxy::FaultProxy::start(nowhere).await.unwrap();
    extra.announce = Some(proxy.addr().to_string());
    let c = start_cluster(versions, extra).await;
    proxy.set_upstream(c.client_addr("h0").parse().unwrap());
    let t = transfer_to(
        &c,
        &proxy.addr().to_string(),
        len,
        Duration::from_millis(5),
        Duration::ZERO,
    )
    .await;
    wait_verified(&t, 256 << 10).await;
    (c, proxy, t)
}

/// Waits (bounded, 20 s) until etcd's `owner` key holds `want` (`None`:
/// until it is gone).
async fn wait_owner(db: &roam_etcd::Client, owner: &[u8], want: Option<&str>, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let o = db.get(owner).await.unwrap().map(|kv| kv.value);
        if o.as_deref() == want.map(str::as_bytes) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: owner is {:?}",
            o.map(|v| String::from_utf8_lossy(&v).into_owned())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (at most 30 s) for the record at `record` to be in etcd; its value.
/// Long: a resume under way when the client was cut off leaves the session
/// restored at its host, and counted suspended again (frozen, its record
/// written) only 15 s later, when that resume has not completed.
async fn wait_record(db: &roam_etcd::Client, record: &[u8]) -> Vec<u8> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(kv) = db.get(record).await.unwrap() {
            return kv.value;
        }
        assert!(std::time::Instant::now() < deadline, "record in etcd");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Extra {
    /// A host listed in the file whose ports are closed.
    async fn down(name: &str) -> String {
        let c = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let p = TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!(
            "host {name} clients={} peers={} key={}\n",
            c.local_addr().unwrap(),
            p.local_addr().unwrap(),
            Keypair::generate().unwrap().public()
        )
    }
}

/// Starts `versions.len()` hosts (host `i` runs the echo service at
/// `versions[i]`), with `extra` lines in their cluster file.
async fn start_cluster(versions: &[&str], extra: Extra) -> TestCluster {
    init_logging();
    let mut lines = String::new();
    for h in &extra.hosts {
        lines.push_str(h);
    }
    for (n, k) in &extra.operators {
        lines.push_str(&format!("operator {n} key={k}\n"));
    }
    let echoed = Arc::new(AtomicU64::new(0));
    let common::ClusterHosts {
        service_key,
        config,
        nodes,
    } = common::start_cluster_hosts(
        versions.len(),
        &lines,
        |hc| {
            // Every test client comes from 127.0.0.1.
            hc.server.max_sessions_per_ip = 100_000;
            if let Some(a) = &extra.announce {
                hc.server.proto.addresses = vec![a.clone()];
            }
            if let Some(url) = &extra.etcd {
                let mut opts = EtcdOptions::new(vec![url.clone()]);
                opts.lease_ttl = Duration::from_secs(2);
                if let Some(cap) = extra.etcd_cap {
                    opts.record_cap = cap;
                }
                hc.cluster = hc.cluster.take().map(|ident| ident.with_etcd(opts));
            }
        },
        |i, _| {
            let dir = tempfile::tempdir().unwrap();
            let e2 = echoed.clone();
            common::HostSpec {
                state: dir.path().to_path_buf(),
                service: echo_service(versions[i], echoed.clone()),
                on_session: move |host: &Host, handle| {
                    let Ok(s) = host.adopt("echo", handle) else {
                        return;
                    };
                    let e = e2.clone();
                    tokio::spawn(async move {
                        let Ok((stream, _)) = s.handle().accept_stream().await else {
                            return;
                        };
                        echo_loop(s, stream, e).await;
                    });
                },
                data: dir,
            }
        },
    )
    .await;
    TestCluster {
        service_key,
        config,
        nodes,
        echoed,
    }
}

impl TestCluster {
    fn client_addr(&self, host: &str) -> String {
        self.config.hosts[host].clients.clone()
    }

    /// The index of the node holding session `id` live or frozen.
    fn holder(&self, id: roam::SessionId) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.host.sessions().iter().any(|r| {
                r.id == id && (r.state == "live" || r.state == "suspended" || r.state == "frozen")
            })
        })
    }

    async fn shutdown(mut self) {
        common::stop_cluster_hosts(&mut self.nodes).await;
    }
}

/// A client streaming `len` pattern bytes through the echo and checking
/// every byte that comes back. `pace`: a pause after each 64 KiB written.
struct Transfer {
    session: roam::SessionHandle,
    written: Arc<AtomicU64>,
    verified: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Result<u64, String>>,
}

async fn transfer(c: &TestCluster, host: &str, len: u64, pace: Duration) -> Transfer {
    transfer_paced(c, host, len, pace, Duration::ZERO).await
}

/// [`transfer`] whose reader also pauses `read_pace` after each read: the
/// echo then spends most of its time blocked writing to the client.
async fn transfer_paced(
    c: &TestCluster,
    host: &str,
    len: u64,
    pace: Duration,
    read_pace: Duration,
) -> Transfer {
    transfer_to(c, &c.client_addr(host), len, pace, read_pace).await
}

/// [`transfer_paced`] to any address (a proxy in front of a host).
async fn transfer_to(
    c: &TestCluster,
    addr: &str,
    len: u64,
    pace: Duration,
    read_pace: Duration,
) -> Transfer {
    let config = cli::client_config(Some(c.service_key.public()));
    transfer_with(addr, config, len, pace, read_pace).await
}

/// [`transfer_to`] with the client's configuration.
async fn transfer_with(
    addr: &str,
    config: roam::ClientConfig,
    len: u64,
    pace: Duration,
    read_pace: Duration,
) -> Transfer {
    let session = roam::connect(addr, config).await.expect("connect");
    let stream = session.open_stream(b"echo").unwrap();
    let (mut r, mut w) = tokio::io::split(stream);
    let written = Arc::new(AtomicU64::new(0));
    let verified = Arc::new(AtomicU64::new(0));
    let w2 = written.clone();
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(off + k as u64);
            }
            w.write_all(&buf[..n]).await.map_err(|e| e.to_string())?;
            off += n as u64;
            w2.store(off, Ordering::SeqCst);
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
        }
        w.shutdown().await.map_err(|e| e.to_string())
    });
    let v2 = verified.clone();
    let task = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut off = 0u64;
        loop {
            let n = r
                .read(&mut buf)
                .await
                .map_err(|e| format!("read at {off}: {e}"))?;
            if n == 0 {
                break;
            }
            for (k, b) in buf[..n].iter().enumerate() {
                if *b != pattern(off + k as u64) {
                    return Err(format!("byte {} is wrong", off + k as u64));
                }
            }
            off += n as u64;
            v2.store(off, Ordering::SeqCst);
            if !read_pace.is_zero() {
                tokio::time::sleep(read_pace).await;
            }
        }
        writer
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("writer: {e}"))?;
        Ok(off)
    });
    Transfer {
        session,
        written,
        verified,
        task,
    }
}

async fn wait_verified(t: &Transfer, at_least: u64) {
    let v = t.verified.clone();
    wait_until(Duration::from_secs(30), "echoed bytes", move || {
        v.load(Ordering::SeqCst) >= at_least
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_moves_mid_transfer_and_every_byte_comes_back() {
    moves_mid_transfer(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_session_moves_mid_transfer_and_every_byte_comes_back() {
    let (_etcd, extra) = with_etcd().await;
    moves_mid_transfer(extra).await;
}

async fn moves_mid_transfer(extra: Extra) {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster(&["1", "1", "1"], extra).await;
        const LEN: u64 = 24 << 20;
        let t = transfer(&c, "h0", LEN, Duration::ZERO).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 1 << 20).await;
        // h0 → h1 → h2 → h0 → h1 while data flows both ways.
        let mut at = 0;
        for round in 1..=4u64 {
            let to = (at + 1) % 3;
            let report = c.nodes[at]
                .host
                .move_session(id, &c.nodes[to].name)
                .await
                .unwrap_or_else(|e| panic!("move {round}: {e}"));
            assert_eq!(report.to, c.nodes[to].name);
            assert_eq!(report.revision, round, "one revision per move");
            at = to;
            wait_verified(&t, (round + 1) * (2 << 20)).await;
            wait_until(Duration::from_secs(10), "the destination holds it", || {
                c.holder(id) == Some(at)
            })
            .await;
        }
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        assert_eq!(c.echoed.load(Ordering::SeqCst), LEN);
        let outs: u64 = c.nodes.iter().map(|n| n.host.stats().moves_out).sum();
        let ins: u64 = c.nodes.iter().map(|n| n.host.stats().moves_in).sum();
        assert_eq!((outs, ins), (4, 4));
        c.shutdown().await;
    })
    .await;
}

/// The client reads slowly, so the application is nearly always blocked
/// writing to it when a move asks for its continuation. The client must
/// not be sent away before the application answers: its credit is what
/// unblocks the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_waits_for_an_application_blocked_writing_to_a_slow_reader() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster(&["1", "1"], Extra::default()).await;
        const LEN: u64 = 12 << 20;
        let t = transfer_paced(&c, "h0", LEN, Duration::ZERO, Duration::from_millis(2)).await;
        let id = t.session.id().unwrap();
        let mut at = 0;
        for round in 1..=4u64 {
            // The send window is full again before each move.
            let w = t.written.load(Ordering::SeqCst);
            wait_until(Duration::from_secs(30), "the echo backed up", || {
                t.written.load(Ordering::SeqCst) > w
                    && t.written.load(Ordering::SeqCst) - t.verified.load(Ordering::SeqCst)
                        >= 1 << 20
            })
            .await;
            let to = 1 - at;
            let report = c.nodes[at]
                .host
                .move_session(id, &c.nodes[to].name)
                .await
                .unwrap_or_else(|e| panic!("move {round}: {e}"));
            assert_eq!(report.revision, round);
            at = to;
        }
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        c.shutdown().await;
    })
    .await;
}

/// A suspended session that moves leaves no copy behind, in the source's
/// store or in etcd: a stale copy must never resume. At most the
/// destination's copy is in etcd, until the client resumes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_suspended_session_moves_and_leaves_no_copy_behind() {
    let (etcd, extra) = with_etcd().await;
    bounded(Duration::from_secs(90), "test", async {
        // Cut off at the proxy, the client has no way to resume before
        // the move (from h0's own address it would, taking the record out
        // before the test could see it).
        const LEN: u64 = 4 << 20;
        let (c, proxy, t) = behind_proxy(&["1", "1"], extra, LEN).await;
        let id = t.session.id().unwrap();
        let db = roam_etcd::Client::connect(&[etcd.url()]).await.unwrap();
        let hex = hex_id(id);
        let owner = format!("/roam/test/owner/{hex}").into_bytes();
        let record = format!("/roam/test/record/{hex}").into_bytes();
        // The client is cut off: h0 suspends the session into a
        // continuation, in its store and in etcd.
        proxy.refuse(true);
        proxy.reset_all();
        wait_owner(&db, &owner, Some("h0"), "h0 owns it in etcd").await;
        // The owner key alone does not prove this suspension's record is
        // written: a session that suspended and resumed earlier in the
        // transfer (a stall on a loaded machine) keeps its owner key, and
        // the record of the suspension above may still be on its way.
        let sealed = wait_record(&db, &record).await;
        assert!(
            !sealed.windows(4).any(|w| w == b"echo"),
            "etcd holds the record sealed, not in the clear"
        );
        let r = c.nodes[0].host.move_session(id, "h1").await.expect("move");
        assert_eq!(r.to, "h1");
        assert!(!c.nodes[0].host.frozen_ids().contains(&id));
        // Nothing of it is h0's any more: in etcd the record is gone or
        // h1's (h1 writes it if it is still frozen 200 ms after the move;
        // the client, walking the announced addresses, may resume first).
        let o = db.get(&owner).await.unwrap().map(|kv| kv.value);
        assert!(
            o.is_none() || o.as_deref() == Some(b"h1".as_slice()),
            "owner after the move: {o:?}"
        );
        assert_eq!(c.nodes[0].host.stats().frozen, 0);
        // The client comes back (to h0, sent on to h1), resumes at h1.
        proxy.refuse(false);
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        assert_eq!(c.holder(id), Some(1));
        assert!(
            db.get(&record).await.unwrap().is_none(),
            "taken out at the resume"
        );
        // h1 owns it while it is live there, until it ends.
        let o = db.get(&owner).await.unwrap().map(|kv| kv.value);
        assert!(
            o.is_none() || o.as_deref() == Some(b"h1".as_slice()),
            "owner after the resume: {o:?}"
        );
        t.session.close(0, "done").await;
        wait_owner(
            &db,
            &owner,
            None,
            "the owner key released at the session's end",
        )
        .await;
        c.shutdown().await;
    })
    .await;
}

/// A resume that reaches the host and dies half-way (the client is cut
/// off again before the host's answer reaches it) leaves the session
/// suspended. The host had restored it from its continuation for that
/// resume, taking it out of its store and of etcd; it puts it back at
/// once, not when its 15 s wait for the handshake runs out (a host lost
/// meanwhile would have lost the session). Then the client comes back and
/// every byte arrives, once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_resume_that_dies_half_way_puts_the_session_back_at_once() {
    let (etcd, extra) = with_etcd().await;
    bounded(Duration::from_secs(60), "test", async {
        const LEN: u64 = 2 << 20;
        let (c, proxy, t) = behind_proxy(&["1"], extra, LEN).await;
        let id = t.session.id().unwrap();
        let db = roam_etcd::Client::connect(&[etcd.url()]).await.unwrap();
        let record = format!("/roam/test/record/{}", hex_id(id)).into_bytes();
        // 400 ms each way: the client's resume reaches h0, h0's answer
        // is still on its way when the client is cut off again.
        proxy.set_delay(Duration::from_millis(400));
        let h0 = &c.nodes[0].host;
        let resumes = h0.stats().resumes;
        proxy.reset_all();
        wait_until(
            Duration::from_secs(20),
            "h0 restoring it for the resume",
            || h0.stats().resumes > resumes,
        )
        .await;
        assert!(
            db.get(&record).await.unwrap().is_none(),
            "taken out of etcd for the resume"
        );
        proxy.refuse(true);
        proxy.reset_all();
        let cut = std::time::Instant::now();
        wait_record(&db, &record).await;
        let took = cut.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "put back in etcd {took:?} after its resume died, not at once"
        );
        assert_eq!(h0.frozen_ids(), vec![id], "frozen at h0 again");
        proxy.set_delay(Duration::ZERO);
        proxy.refuse(false);
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        c.shutdown().await;
    })
    .await;
}

/// A continuation above the cluster's cap stays on its host only: the
/// host says so (its `unshared` counter, an error in the log), etcd holds
/// nothing of it, and the session resumes there as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_continuation_above_the_cap_stays_on_its_host() {
    let (etcd, mut extra) = with_etcd().await;
    extra.etcd_cap = Some(256);
    bounded(Duration::from_secs(60), "test", async {
        let c = start_cluster(&["1"], extra).await;
        let proxy = roam_sim::proxy::FaultProxy::start(c.client_addr("h0").parse().unwrap())
            .await
            .unwrap();
        const LEN: u64 = 1 << 20;
        let t = transfer_to(
            &c,
            &proxy.addr().to_string(),
            LEN,
            Duration::from_millis(5),
            Duration::ZERO,
        )
        .await;
        wait_verified(&t, 64 << 10).await;
        proxy.refuse(true);
        proxy.reset_all();
        // (The client may resume at once from h0's own address, which the
        // host announced: the continuation was made and judged anyway.)
        wait_until(Duration::from_secs(20), "the continuation", || {
            c.nodes[0].host.stats().unshared == 1
        })
        .await;
        assert_eq!(c.nodes[0].host.stats().suspends, 1);
        let db = roam_etcd::Client::connect(&[etcd.url()]).await.unwrap();
        assert!(db
            .get_prefix(b"/roam/test/record/")
            .await
            .unwrap()
            .is_empty());
        proxy.refuse(false);
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN);
        c.shutdown().await;
    })
    .await;
}

/// The client asks to move (`MOVE_ASK`): to a named replica, then to any
/// (the host picks the one holding the fewest sessions), mid-transfer,
/// every byte checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_asks_to_move_to_a_named_replica_then_to_any() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster(&["1", "1", "1"], Extra::default()).await;
        // h2 holds two sessions, h0 and h1 none.
        let mut others = Vec::new();
        for _ in 0..2 {
            others.push(transfer(&c, "h2", 1 << 20, Duration::from_millis(20)).await);
        }
        const LEN: u64 = 16 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(1)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 1 << 20).await;
        t.session.ask_move("h1");
        wait_until(Duration::from_secs(20), "the move to h1", || {
            c.holder(id) == Some(1)
        })
        .await;
        let v = t.verified.load(Ordering::SeqCst);
        wait_verified(&t, v + (1 << 20)).await;
        // Any host: h0 holds none, h2 two: the least loaded is h0.
        t.session.ask_move("");
        wait_until(
            Duration::from_secs(20),
            "the move to the least loaded",
            || c.holder(id) == Some(0),
        )
        .await;
        // A name that is no host of the cluster is declined: it stays.
        t.session.ask_move("nowhere");
        let v = t.verified.load(Ordering::SeqCst);
        wait_verified(&t, v + (1 << 20)).await;
        assert_eq!(c.holder(id), Some(0));
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        for o in others {
            assert_eq!(o.task.await.unwrap().expect("other transfer"), 1 << 20);
        }
        let outs: u64 = c.nodes.iter().map(|n| n.host.stats().moves_out).sum();
        assert_eq!(outs, 2);
        c.shutdown().await;
    })
    .await;
}

/// The rate-based policy (SC §7.1.3): the path to h0 slows down (a proxy
/// adds latency), the client's inbound rate falls by more than 25 % below
/// its best, it asks to move, and the session goes on from the other
/// replica, reached directly, every byte checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_throughput_drops_asks_to_move_and_is_moved() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster(&["1", "1"], Extra::default()).await;
        let proxy = roam_sim::proxy::FaultProxy::start(c.client_addr("h0").parse().unwrap())
            .await
            .unwrap();
        let mut config = cli::client_config(Some(c.service_key.public()));
        let mut policy = roam::MovePolicy::default();
        policy.window = Duration::from_millis(500);
        config.move_when_slow = Some(policy);
        // ~6 MB/s both ways, paced by the writer.
        const LEN: u64 = 48 << 20;
        let t = transfer_with(
            &proxy.addr().to_string(),
            config,
            LEN,
            Duration::from_millis(10),
            Duration::ZERO,
        )
        .await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 4 << 20).await;
        assert_eq!(c.holder(id), Some(0));
        assert_eq!(
            c.nodes[0].host.stats().moves_out,
            0,
            "no move while the rate holds"
        );
        // The path degrades: 40 ms each way caps the echo far below its pace.
        proxy.set_delay(Duration::from_millis(40));
        wait_until(Duration::from_secs(30), "the move away from h0", || {
            c.holder(id) == Some(1)
        })
        .await;
        assert_eq!(c.nodes[0].host.stats().moves_out, 1);
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hundred_consecutive_moves_among_three_hosts() {
    hundred_moves(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_one_hundred_consecutive_moves_among_three_hosts() {
    let (_etcd, extra) = with_etcd().await;
    hundred_moves(extra).await;
}

async fn hundred_moves(extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(180), "test", async {
        let c = start_cluster(&["1", "1", "1"], extra).await;
        // Paced so that it still runs when the last move is done.
        const LEN: u64 = 64 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(2)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 64 << 10).await;
        let mut at = 0usize;
        let mut frozen = Vec::new();
        for i in 0..100 {
            let to = (at + 1 + i % 2) % 3;
            let r = c.nodes[at]
                .host
                .move_session(id, &c.nodes[to].name)
                .await
                .unwrap_or_else(|e| panic!("move {i}: {e}"));
            frozen.push(r.frozen);
            at = to;
            // Traffic flows at the destination before the next move.
            let v = t.verified.load(Ordering::SeqCst);
            wait_verified(&t, v + 1).await;
        }
        assert!(
            t.verified.load(Ordering::SeqCst) < LEN,
            "the transfer was still running during all 100 moves"
        );
        let got = t.task.await.unwrap().expect("transfer");
        assert_eq!(got, LEN);
        assert!(t.written.load(Ordering::SeqCst) == LEN);
        frozen.sort();
        eprintln!(
            "100 moves: frozen median {:?}, max {:?}",
            frozen[50], frozen[99]
        );
        assert_eq!(c.holder(id), Some(at));
        assert_etcd_agrees(etcd.as_deref(), id, &c.nodes[at].name).await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_destination_is_refused_naming_the_property() {
    incompatible_refused(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_an_incompatible_destination_is_refused_naming_the_property() {
    let (_etcd, extra) = with_etcd().await;
    incompatible_refused(extra).await;
}

async fn incompatible_refused(extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(60), "test", async {
        let c = start_cluster(&["1", "2"], extra).await;
        const LEN: u64 = 4 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(1)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 256 << 10).await;
        match c.nodes[0].host.move_session(id, "h1").await {
            Err(MoveError::Refused(Refusal::Incompatible {
                property,
                required,
                found,
            })) => {
                assert_eq!(property, "version");
                assert_eq!(required, "1");
                assert_eq!(found.as_deref(), Some("2"));
            }
            other => panic!("expected an incompatibility, got {other:?}"),
        }
        // Nothing moved: the session runs on at h0 to the end.
        assert_eq!(c.holder(id), Some(0));
        assert_eq!(t.task.await.unwrap().expect("transfer"), LEN);
        match c.nodes[0].host.move_session(id, "nowhere").await {
            Err(MoveError::UnknownHost(h)) => assert_eq!(h, "nowhere"),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.holder(id), Some(0));
        assert_etcd_agrees(etcd.as_deref(), id, "h0").await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_destination_leaves_the_session_at_the_source() {
    unreachable_destination(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_an_unreachable_destination_leaves_the_session_at_the_source() {
    let (_etcd, extra) = with_etcd().await;
    unreachable_destination(extra).await;
}

async fn unreachable_destination(mut extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(60), "test", async {
        extra.hosts.push(Extra::down("gone").await);
        let c = start_cluster(&["1"], extra).await;
        const LEN: u64 = 4 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(1)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 256 << 10).await;
        let e = c.nodes[0].host.move_session(id, "gone").await.unwrap_err();
        assert!(matches!(e, MoveError::Link(_)), "{e}");
        assert_eq!(c.holder(id), Some(0));
        assert_eq!(t.task.await.unwrap().expect("transfer"), LEN);
        assert_eq!(c.holder(id), Some(0));
        assert_etcd_agrees(etcd.as_deref(), id, "h0").await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_dies_during_the_transfer_leaves_the_session_at_the_source() {
    dying_destination(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_destination_that_dies_during_the_transfer_leaves_the_session_at_the_source() {
    let (_etcd, extra) = with_etcd().await;
    dying_destination(extra).await;
}

async fn dying_destination(mut extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(90), "test", async {
        // "d" is a host of the cluster that accepts the offer and then dies
        // (its connection drops) when the transfer arrives. Its client port
        // is closed: the client, told to move there, finds nobody and goes
        // back to h0.
        init_logging();
        let d_key = Keypair::generate().unwrap();
        let d_peers = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let d_clients = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let d_clients_addr = d_clients.local_addr().unwrap();
        drop(d_clients);
        extra.hosts.push(format!(
            "host d clients={d_clients_addr} peers={} key={}\n",
            d_peers.local_addr().unwrap(),
            d_key.public()
        ));
        let c = start_cluster(&["1"], extra).await;
        // The dying destination.
        let d_config = c.config.clone();
        let dying = tokio::spawn(async move {
            let (sock, _) = d_peers.accept().await.unwrap();
            let mut link = Link::accept(sock, &d_config.name, &d_key, |k| {
                d_config.host_by_key(k).is_some()
            })
            .await
            .unwrap();
            loop {
                match link.recv().await.unwrap() {
                    Msg::Offer { .. } => link.send(&Msg::Accept).await.unwrap(),
                    Msg::Precopy { .. } => link.send(&Msg::Accept).await.unwrap(),
                    Msg::Transfer { .. } => return, // dies: the connection drops
                    m => panic!("unexpected {m:?}"),
                }
            }
        });
        const LEN: u64 = 4 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(1)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 256 << 10).await;
        let e = c.nodes[0].host.move_session(id, "d").await.unwrap_err();
        assert!(
            matches!(e, MoveError::Link(_)),
            "the move fails on the lost connection: {e}"
        );
        dying.await.unwrap();
        // The session is back at h0 (as a continuation until its client
        // returns from the dead destination) and finishes there.
        assert_eq!(t.task.await.unwrap().expect("transfer"), LEN);
        assert_eq!(c.holder(id), Some(0));
        assert_etcd_agrees(etcd.as_deref(), id, "h0").await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_killed_right_after_the_switch_does_not_stop_the_session() {
    source_killed_after_switch(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_the_source_killed_right_after_the_switch_does_not_stop_the_session() {
    let (_etcd, extra) = with_etcd().await;
    source_killed_after_switch(extra).await;
}

async fn source_killed_after_switch(extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(60), "test", async {
        let mut c = start_cluster(&["1", "1"], extra).await;
        const LEN: u64 = 8 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(1)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 256 << 10).await;
        c.nodes[0].host.move_session(id, "h1").await.expect("move");
        c.nodes[0].kill();
        assert_eq!(t.task.await.unwrap().expect("transfer"), LEN);
        assert_eq!(c.holder(id), Some(1));
        assert_etcd_agrees(etcd.as_deref(), id, "h1").await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_and_operators_outside_the_cluster_are_refused() {
    outsiders_refused(Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_hosts_and_operators_outside_the_cluster_are_refused() {
    let (_etcd, extra) = with_etcd().await;
    outsiders_refused(extra).await;
}

async fn outsiders_refused(extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(60), "test", async {
        let c = start_cluster(&["1", "1"], extra).await;
        let h0 = &c.config.hosts["h0"];
        // A stranger that knows h0's key but is not in the file.
        let stranger = Keypair::generate().unwrap();
        let r = Link::connect(&h0.peers, "test", &stranger, &h0.key).await;
        let refused = match r {
            Err(_) => true,
            Ok(mut l) => l.call(&Msg::Status).await.is_err(),
        };
        assert!(refused, "a key outside the cluster file gets nothing");
        // The right keys but another cluster's name.
        let h1_key_holder = Keypair::generate().unwrap();
        let r = Link::connect(&h0.peers, "other", &h1_key_holder, &h0.key).await;
        let refused = match r {
            Err(_) => true,
            Ok(mut l) => l.call(&Msg::Status).await.is_err(),
        };
        assert!(refused);
        // A client session at h0 that a stranger tries to take: no offer
        // can even be made, and the session is untouched.
        let t = transfer(&c, "h0", 1 << 20, Duration::ZERO).await;
        let id = t.session.id().unwrap();
        assert_eq!(t.task.await.unwrap().expect("transfer"), 1 << 20);
        assert_eq!(c.holder(id), Some(0));
        assert_etcd_agrees(etcd.as_deref(), id, "h0").await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_status_and_moves_and_drains() {
    bounded(Duration::from_secs(120), "test", async {
        init_logging();
        let op = Keypair::generate().unwrap();
        let stranger = Keypair::generate().unwrap();
        let c = start_cluster(
            &["1", "1", "1"],
            Extra {
                operators: vec![("alice".into(), op.public())],
                ..Default::default()
            },
        )
        .await;
        let h0 = c.config.hosts["h0"].clone();
        let ask = |key: Keypair, req: Msg| {
            let h0 = h0.clone();
            async move {
                roam_continuation::cluster::operator_request(
                    &h0.peers,
                    "test",
                    &key,
                    &h0.key,
                    &req,
                    Duration::from_secs(30),
                )
                .await
            }
        };
        assert!(
            ask(stranger, Msg::Status).await.is_err(),
            "an operator missing from the file is refused"
        );
        // An operator may not play a host.
        let r = ask(
            op.clone(),
            Msg::Abort {
                id: roam::SessionId([1; 16]),
            },
        )
        .await;
        assert!(matches!(r, Ok(Msg::Refuse(_))), "{r:?}");
        // Status, then a move by hand.
        let t = transfer(&c, "h0", 1 << 20, Duration::from_millis(2)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 64 << 10).await;
        match ask(op.clone(), Msg::Status).await.unwrap() {
            Msg::StatusReply { host, sessions } => {
                assert_eq!(host, "h0");
                assert!(
                    sessions.iter().any(|r| r.id == id && r.service == "echo"),
                    "{sessions:?}"
                );
            }
            m => panic!("{m:?}"),
        }
        match ask(
            op.clone(),
            Msg::Move {
                id,
                to: "h2".into(),
            },
        )
        .await
        .unwrap()
        {
            Msg::Done { moved: 1, failures } => assert!(failures.is_empty()),
            m => panic!("{m:?}"),
        }
        assert_eq!(t.task.await.unwrap().expect("transfer"), 1 << 20);
        assert_eq!(c.holder(id), Some(2));
        // Sessions to drain: 64 clients, each with a small transfer.
        let mut ts = Vec::new();
        for _ in 0..64 {
            ts.push(transfer(&c, "h0", 64 << 10, Duration::from_millis(20)).await);
        }
        for t in &ts {
            wait_verified(t, 64 << 10).await;
        }
        let started = std::time::Instant::now();
        match ask(op.clone(), Msg::Drain).await.unwrap() {
            Msg::Done { moved, failures } => {
                assert!(failures.is_empty(), "{failures:?}");
                assert_eq!(moved, 64);
            }
            m => panic!("{m:?}"),
        }
        eprintln!("drained 64 sessions in {:?}", started.elapsed());
        let ids: Vec<roam::SessionId> = ts.iter().map(|t| t.session.id().unwrap()).collect();
        wait_until(
            Duration::from_secs(20),
            "every session held elsewhere",
            || ids.iter().all(|id| matches!(c.holder(*id), Some(1 | 2))),
        )
        .await;
        assert!(c.nodes[0].host.sessions().iter().all(|r| r.state != "live"));
        for t in ts {
            assert_eq!(t.task.await.unwrap().expect("transfer"), 64 << 10);
        }
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_moves_a_thousand_sessions_and_every_one_keeps_working() {
    drain_keeps_every_session(1000, Extra::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_drain_moves_every_session_and_each_keeps_working() {
    let (_etcd, extra) = with_etcd().await;
    drain_keeps_every_session(1000, extra).await;
}

async fn drain_keeps_every_session(n: usize, extra: Extra) {
    let etcd = extra.etcd.clone();
    bounded(Duration::from_secs(240), "test", async {
        let c = start_cluster(&["1", "1", "1"], extra).await;
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            let session = roam::connect(
                &c.client_addr("h0"),
                cli::client_config(Some(c.service_key.public())),
            )
            .await
            .unwrap_or_else(|e| panic!("client {i}: {e}"));
            let mut stream = session.open_stream(b"echo").unwrap();
            let hello = (i as u64).to_be_bytes();
            stream.write_all(&hello).await.unwrap();
            let mut back = [0u8; 8];
            stream.read_exact(&mut back).await.unwrap();
            assert_eq!(back, hello);
            clients.push((session, stream));
        }
        let report = c.nodes[0].host.drain().await.expect("drain");
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(report.moved, n);
        eprintln!("drained {n} sessions in {:?}", report.elapsed);
        // Every session answers from its new host, with its own bytes.
        let started = std::time::Instant::now();
        for (i, (session, stream)) in clients.iter_mut().enumerate() {
            let msg = (i as u64 | 1 << 62).to_be_bytes();
            stream.write_all(&msg).await.unwrap();
            let mut back = [0u8; 8];
            stream.read_exact(&mut back).await.unwrap();
            assert_eq!(back, msg, "session {i} echoes after the drain");
            let id = session.id().unwrap();
            assert!(
                matches!(c.holder(id), Some(1 | 2)),
                "session {i} is elsewhere"
            );
        }
        eprintln!(
            "all {n} echoed from their new hosts {:?} later",
            started.elapsed()
        );
        assert!(
            c.nodes[0].host.sessions().is_empty(),
            "nothing left on the drained host"
        );
        let ins: u64 = c.nodes[1..].iter().map(|n| n.host.stats().moves_in).sum();
        assert_eq!(ins, n as u64);
        if let Some(url) = &etcd {
            // Every session is live again: etcd keeps no record of any.
            let db = roam_etcd::Client::connect(std::slice::from_ref(url))
                .await
                .unwrap();
            let left = db.get_prefix(b"/roam/test/record/").await.unwrap();
            assert!(left.is_empty(), "records left in etcd: {}", left.len());
        }
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_shedding_moves_heavy_sessions_to_the_least_loaded_replicas() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster(&["1", "1", "1"], Extra::default()).await;
        // h1 already holds 4 sessions, h2 none; h0 holds 6: 3 heavy, 3 light.
        let mut on_h1 = Vec::new();
        for _ in 0..4 {
            on_h1.push(transfer(&c, "h1", 64 << 10, Duration::from_millis(50)).await);
        }
        let mut heavy = Vec::new();
        for _ in 0..3 {
            heavy.push(transfer(&c, "h0", 8 << 20, Duration::from_millis(5)).await);
        }
        let mut light = Vec::new();
        for _ in 0..3 {
            light.push(transfer(&c, "h0", 64 << 10, Duration::from_millis(50)).await);
        }
        for t in &heavy {
            wait_verified(t, 2 << 20).await;
        }
        for t in on_h1.iter().chain(&light) {
            wait_verified(t, 16 << 10).await;
        }
        let policy = roam_continuation::ShedPolicy::heavier_than(2 << 20, 10);
        let report = c.nodes[0].host.shed(&policy).await.expect("shed");
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        assert_eq!(report.moved, 3, "exactly the heavy sessions moved");
        for t in &heavy {
            let id = t.session.id().unwrap();
            wait_until(Duration::from_secs(10), "heavy session on h2", || {
                c.holder(id) == Some(2)
            })
            .await;
        }
        for t in &light {
            assert_eq!(
                c.holder(t.session.id().unwrap()),
                Some(0),
                "light ones stay"
            );
        }
        for t in heavy.into_iter().chain(light).chain(on_h1) {
            t.task.await.unwrap().expect("transfer");
        }
        c.shutdown().await;
    })
    .await;
}

/// With etcd, a live session's owner is a key there: none while it stays
/// on the host that created it, the destination's from each move's commit
/// (compared to the source: the single-winner transactions themselves are
/// tested against etcd in `cluster::etcd`'s unit tests), released at the
/// session's end. Every byte is checked throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_etcd_a_live_sessions_owner_follows_its_moves() {
    let (etcd, extra) = with_etcd().await;
    bounded(Duration::from_secs(90), "test", async {
        let c = start_cluster(&["1", "1", "1"], extra).await;
        const LEN: u64 = 8 << 20;
        let t = transfer(&c, "h0", LEN, Duration::from_millis(2)).await;
        let id = t.session.id().unwrap();
        wait_verified(&t, 256 << 10).await;
        let db = roam_etcd::Client::connect(&[etcd.url()]).await.unwrap();
        let owner = format!("/roam/test/owner/{}", hex_id(id)).into_bytes();
        // Never suspended nor moved: no key (its host knows it).
        assert!(db.get(&owner).await.unwrap().is_none());
        c.nodes[0].host.move_session(id, "h1").await.expect("move");
        // Written by the destination before it answered the commit.
        let o = db.get(&owner).await.unwrap().map(|kv| kv.value);
        assert_eq!(o.as_deref(), Some(b"h1".as_slice()));
        let before = t.verified.load(Ordering::SeqCst);
        wait_verified(&t, before + (256 << 10)).await;
        c.nodes[1]
            .host
            .move_session(id, "h2")
            .await
            .expect("move on");
        let o = db.get(&owner).await.unwrap().map(|kv| kv.value);
        assert_eq!(o.as_deref(), Some(b"h2".as_slice()));
        assert_eq!(t.task.await.unwrap().expect("transfer"), LEN);
        assert_eq!(c.holder(id), Some(2));
        t.session.close(0, "done").await;
        wait_owner(
            &db,
            &owner,
            None,
            "the owner key released at the session's end",
        )
        .await;
        c.shutdown().await;
    })
    .await;
}
