//! A cluster whose directory is a real etcd (`docs/PROTOCOL.md` §14.6),
//! with real host processes: `bench_server` hosts keep their suspended
//! sessions' continuations in etcd too, so when the host holding them is
//! killed (SIGKILL) another host claims them once the dead host's lease
//! expires, and the `bench_client` processes, which walk the addresses
//! the cluster announced, resume there and receive every index exactly
//! once, in order. Ports are probed free on 127.0.0.1; etcd runs on a
//! temporary data dir; every process is killed at the end, even on failure.

mod common;

use std::time::Instant;

use common::{free_port, write_key, Proc};
use roam_etcd::testing::EtcdServer;
use roam_sim::proxy::FaultProxy;

#[test]
fn sessions_suspended_on_a_killed_host_resume_on_another_host() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let etcd = match rt.block_on(EtcdServer::start()) {
        Ok(e) => e,
        Err(e) => panic!("etcd: {e}"),
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let service_key = d.join("service.key");
    let service = write_key(&service_key);
    // h0 is reached through a proxy that can cut its clients off (as a
    // load balancer in front of it would): its clients' address in the
    // cluster file, which hosts announce and redirect to, is the proxy's.
    let h0_listen = free_port();
    let proxy = FaultProxy::spawn(h0_listen.parse().unwrap()).expect("proxy");
    let mut text = "cluster bench\n".to_string();
    let mut hosts = Vec::new();
    for i in 0..2 {
        let name = format!("h{i}");
        let key_path = d.join(format!("{name}.key"));
        let kp = write_key(&key_path);
        let (listen, peers) = match i {
            0 => (h0_listen.clone(), free_port()),
            _ => (free_port(), free_port()),
        };
        let clients = match i {
            0 => proxy.addr().to_string(),
            _ => listen.clone(),
        };
        text.push_str(&format!(
            "host {name} clients={clients} peers={peers} key={}\n",
            kp.public()
        ));
        hosts.push((name, key_path, listen));
    }
    let cluster = d.join("cluster.conf");
    std::fs::write(&cluster, &text).expect("cluster file");
    let url = etcd.url();
    let mut servers: Vec<Proc> = hosts
        .iter()
        .map(|(name, key_path, clients)| {
            let state = d.join(format!("state-{name}"));
            let p = Proc::spawn(
                "bench_server",
                name,
                &[
                    "--listen",
                    clients,
                    "--state-dir",
                    state.to_str().unwrap(),
                    "--offload-ms",
                    "0",
                    "--cluster",
                    cluster.to_str().unwrap(),
                    "--host",
                    name,
                    "--host-key",
                    key_path.to_str().unwrap(),
                    "--service-key",
                    service_key.to_str().unwrap(),
                    "--etcd",
                    &url,
                    "--etcd-ttl",
                    "2",
                ],
            );
            p.expect("listening ");
            p
        })
        .collect();

    // Three clients reach h0 through the proxy.
    let count = 3000;
    let clients: Vec<Proc> = (0..3)
        .map(|i| {
            Proc::spawn(
                "bench_client",
                &format!("client{i}"),
                &[
                    "--connect",
                    &proxy.addr().to_string(),
                    "--server-key",
                    &service.public().to_string(),
                    "--count",
                    &count.to_string(),
                    "--interval-us",
                    "500",
                    "--report-every",
                    "500",
                ],
            )
        })
        .collect();
    for c in &clients {
        c.expect("connected");
        c.expect("progress 1000");
    }
    // Cut them off: h0 suspends the three sessions into continuations,
    // kept in its store and in etcd. Then h0 dies outright.
    proxy.refuse(true);
    proxy.reset_all();
    for _ in 0..3 {
        servers[0].expect("suspended ");
    }
    servers[0].kill9();
    let killed = Instant::now();

    // Each client finds h1 among the announced addresses; h1 claims its
    // session once h0's lease has expired, and it goes on from there.
    for c in &clients {
        c.expect("resumed after");
    }
    eprintln!(
        "all three resumed on h1 {:?} after h0 was killed",
        killed.elapsed()
    );
    for c in &clients {
        assert_eq!(c.expect("ok "), format!("ok {count}"), "{}", c.name);
    }
    for _ in 0..3 {
        servers[1].expect("resumed ");
    }
    // Nothing is left in etcd: every claimed record was taken out before
    // its session resumed.
    let left = rt.block_on(async {
        let c = roam_etcd::Client::connect(std::slice::from_ref(&url))
            .await
            .unwrap();
        c.get_prefix(b"/roam/bench/record/").await.unwrap()
    });
    assert!(left.is_empty(), "records left in etcd: {}", left.len());
    for s in servers.iter_mut() {
        s.kill9();
    }
    drop(etcd);
}
