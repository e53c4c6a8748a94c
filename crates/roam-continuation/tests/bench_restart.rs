//! The paper's benchmark across a real server process restart: the
//! `bench_server` example runs as a child process; while its client is cut
//! off, the server is killed (SIGKILL) and started again on the same state
//! directory and port; the `bench_client` example must still receive every
//! index exactly once, in order. Bounded in time; ports from the kernel.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use roam_sim::proxy::FaultProxy;

const LIMIT: Duration = Duration::from_secs(60);

/// Path of an example binary of this package, built if missing.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> -> target/<profile>/examples/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join("examples").join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "roam-continuation", "--example", name]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building example {name} failed");
    }
    path
}

/// A child process whose stdout lines arrive on a channel; killed on drop.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: &'static str,
}

impl Proc {
    fn spawn(name: &'static str, args: &[&str]) -> Self {
        let mut child = Command::new(example(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("  [{name}] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines, name }
    }

    /// Waits for a line starting with `prefix`; returns it.
    fn expect(&self, prefix: &str) -> String {
        let deadline = Instant::now() + LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(l) if l.starts_with("error") => panic!("{}: {l}", self.name),
                Ok(_) => {}
                Err(_) => panic!("{}: no line {prefix:?} within {LIMIT:?}", self.name),
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(state: &Path, listen: &str) -> (Proc, String, String, String) {
    let p = Proc::spawn(
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
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = client.child.try_wait().expect("wait client") {
            break s;
        }
        assert!(Instant::now() < deadline, "client did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "client: {status}");
}
