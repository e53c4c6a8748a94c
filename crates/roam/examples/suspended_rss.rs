//! Measures the resident memory a suspended session costs, on the client
//! and on the relay (server), with many sessions at once.
//!
//! ```text
//! cargo run --release -p roam --example suspended_rss -- client 10000
//! cargo run --release -p roam --example suspended_rss -- relay 10000
//! ```
//!
//! `client`: the server runs in a child process; this process opens N
//! sessions (one stream each, a few bytes written), then the child is killed,
//! so every session suspends (re-dials are refused). `relay`: the server runs
//! here; a child process opens the sessions and is killed. Each mode prints
//! RSS before, with the sessions active, and with them suspended, and the
//! cost per suspended session. Needs about N + 100 file descriptors.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use std::io::BufRead;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Mutex;

/// Connections opened at once while setting up.
const PARALLEL: usize = 64;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn session_config() -> roam_proto::Config {
    roam_proto::Config {
        suspend_after: Duration::from_secs(5),
        ..Default::default()
    }
}

fn server_config(n: usize) -> roam::ServerConfig {
    let mut c = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair: roam::Keypair::generate().unwrap(),
        authorized_keys: None,
        addresses: Vec::new(),
        session: session_config(),
    });
    c.max_connections = n + 64;
    c.max_sessions = n + 64;
    c.max_sessions_per_ip = n + 64;
    c.max_sessions_per_key = n + 64;
    c
}

fn client_config() -> roam::ClientConfig {
    let mut c = roam::ClientConfig::new(roam_proto::ClientConfig {
        keypair: roam::Keypair::generate().unwrap(),
        server_trust: roam_proto::ServerTrust::FirstUse,
        session: session_config(),
    });
    c.watch_network = false;
    c
}

/// Runs a server that keeps every stream open and reads it; returns its
/// handles as they arrive.
async fn run_server(n: usize) -> (std::net::SocketAddr, Arc<Mutex<Vec<roam::SessionHandle>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handles = Arc::new(Mutex::new(Vec::new()));
    let h2 = handles.clone();
    tokio::spawn(roam::serve(
        listener,
        server_config(n),
        std::future::pending::<()>(),
        move |s: roam::SessionHandle| {
            let h2 = h2.clone();
            tokio::spawn(async move {
                h2.lock().await.push(s.clone());
                while let Ok((mut stream, _)) = s.accept_stream().await {
                    tokio::spawn(async move {
                        let mut buf = [0u8; 1024];
                        while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                    });
                }
            });
        },
    ));
    (addr, handles)
}

/// Opens `n` sessions with one stream each and a few bytes written.
async fn open_sessions(addr: &str, n: usize) -> Vec<(roam::SessionHandle, roam::RoamStream)> {
    let sem = Arc::new(tokio::sync::Semaphore::new(PARALLEL));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let addr = addr.to_string();
        let sem = sem.clone();
        tasks.push(tokio::spawn(async move {
            let _p = sem.acquire().await.unwrap();
            let s = roam::connect(&addr, client_config()).await.unwrap();
            let mut st = s.open_stream(b"rss").unwrap();
            st.write_all(&[1u8; 200]).await.unwrap();
            st.flush().await.unwrap();
            (s, st)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn wait_suspended(states: impl Fn() -> (usize, usize)) {
    for _ in 0..600 {
        let (suspended, total) = states();
        if suspended == total {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("not all sessions suspended: {:?}", states());
}

/// Starts this program as a child with `args`; returns it and its first line.
fn spawn_child(exe: &std::path::Path, args: &[&str]) -> (Child, String) {
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line.trim().to_string())
}

fn report(what: &str, n: usize, base: u64, active: u64, suspended: u64) {
    println!(
        "{what}: {n} sessions; RSS base {base} KiB, active {active} KiB ({:.1} KiB/session), suspended {suspended} KiB ({:.2} KiB/session)",
        (active.saturating_sub(base)) as f64 / n as f64,
        (suspended.saturating_sub(base)) as f64 / n as f64,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("client");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let exe = std::env::current_exe().unwrap();
    match mode {
        // Child: a server printing its address.
        "serve" => {
            let (addr, _h) = run_server(n).await;
            println!("{addr}");
            std::future::pending::<()>().await;
        }
        // Child: clients that connect and then wait to be killed.
        "clients" => {
            let addr = args.get(3).expect("address");
            let _s = open_sessions(addr, n).await;
            println!("ready");
            std::future::pending::<()>().await;
        }
        "client" => {
            let (mut child, addr) = spawn_child(&exe, &["serve", &n.to_string()]);
            let base = rss_kib();
            let sessions = open_sessions(&addr, n).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let active = rss_kib();
            child.kill().unwrap();
            let _ = child.wait();
            wait_suspended(|| {
                let s = sessions
                    .iter()
                    .filter(|(s, _)| s.stats().state == roam::State::Suspended)
                    .count();
                (s, sessions.len())
            })
            .await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let suspended = rss_kib();
            report("client", n, base, active, suspended);
            // Exit with everything still held, so a heap profiler's "leaked"
            // list is what the suspended sessions hold.
            std::process::exit(0);
        }
        "relay" => {
            let (addr, handles) = run_server(n).await;
            let base = rss_kib();
            let (mut child, _) = spawn_child(&exe, &["clients", &n.to_string(), &addr.to_string()]);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let active = rss_kib();
            child.kill().unwrap();
            let _ = child.wait();
            let hs = handles.lock().await.clone();
            wait_suspended(|| {
                let s = hs
                    .iter()
                    .filter(|s| s.stats().state == roam::State::Suspended)
                    .count();
                (s, hs.len())
            })
            .await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let suspended = rss_kib();
            report("relay", n, base, active, suspended);
            std::process::exit(0);
        }
        _ => eprintln!("usage: suspended_rss client|relay [N]"),
    }
}
