//! The paper's benchmark across a real server process restart: the
//! `bench_server` example runs as a child process; while its client is cut
//! off, the server is killed (SIGKILL) and started again on the same state
//! directory and port; the `bench_client` example must still receive every
//! index exactly once, in order. Bounded in time; ports from the kernel.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Proc, PROC_LIMIT};
use roam_sim::proxy::FaultProxy;

fn start_server(state: &Path, listen: &str) -> (Proc, String, String, String) {
    let p = Proc::spawn(
        "bench_server",
        "bench_server",
        &[
            "--listen",
            listen,
            "--state-dir",
            state.to_str().expect("utf-8 path"),
            "--offload-ms",
            "0",
        ],
    );
    let l = p.expect("listening ");
    let w: Vec<&str> = l.split_whitespace().collect();
    (p, w[1].to_string(), w[3].to_string(), w[5].to_string())
}

#[test]
fn every_update_arrives_once_in_order_across_server_process_restarts() {
    let state = tempfile::tempdir().expect("tempdir");
    let (server, addr, key, loaded) = start_server(state.path(), "127.0.0.1:0");
    assert_eq!(loaded, "0");
    let proxy = FaultProxy::spawn(addr.parse().expect("addr")).expect("proxy");
    let count = 6000;
    let client = Proc::spawn(
        "bench_client",
        "bench_client",
        &[
            "--connect",
            &proxy.addr().to_string(),
            "--server-key",
            &key,
            "--count",
            &count.to_string(),
            "--interval-us",
            "500",
            "--report-every",
            "100",
        ],
    );
    client.expect("connected");
    let mut server = server;
    for at in [1000, 3000] {
        client.expect(&format!("progress {at}"));
        // Cut the client off; the server suspends the session to disk.
        proxy.refuse(true);
        proxy.reset_all();
        server.expect("suspended ");
        // Crash the server while the client is away, then start it again.
        server.child.kill().expect("kill server");
        server.child.wait().expect("reap server");
        let (s, addr2, key2, loaded) = start_server(state.path(), &addr);
        assert_eq!(
            (addr2.as_str(), key2.as_str(), loaded.as_str()),
            (addr.as_str(), key.as_str(), "1")
        );
        server = s;
        proxy.refuse(false);
        client.expect("resumed after");
        server.expect("resumed ");
    }
    let done = client.expect("ok ");
    assert_eq!(done, format!("ok {count}"));
    let mut client = client;
    let deadline = Instant::now() + PROC_LIMIT;
    let status = loop {
        if let Some(s) = client.child.try_wait().expect("wait client") {
            break s;
        }
        assert!(Instant::now() < deadline, "client did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "client: {status}");
}
