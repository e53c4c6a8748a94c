//! `roam cluster` against three real `file_server` processes (the
//! roam-continuation example) serving one service: a `file_client` process
//! downloads a 64 MiB file while the operator moves its session from host
//! to host with `roam cluster move`, drains a host with `roam cluster
//! drain`, and the host the session left is killed (SIGKILL) right after;
//! the download's length and SHA-256 must match the file. Ports are probed
//! free on 127.0.0.1; every process is killed at the end, even on failure.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use roam_proto::Keypair;
use sha2::{Digest, Sha256};

const LIMIT: Duration = Duration::from_secs(120);

/// Prefixes of the variables cargo sets for a test binary (the cargo book,
/// "Environment variables Cargo sets for crates"; OUT_DIR because roam-cli
/// has a build script).
const SET_FOR_TESTS: [&str; 8] = [
    "OUT_DIR",
    "CARGO_PKG_",
    "CARGO_MANIFEST_",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
];

/// The directory of the workspace's example binaries (roam-continuation's
/// among them), which cargo (re)builds first, once: they belong to another
/// package, so `cargo test -p roam-cli` does not build them. `--workspace --examples` resolves features as `cargo test
/// --workspace` does, so under the whole suite (CI) this finds the examples
/// that build made and compiles nothing; `-p roam-continuation` would
/// resolve them without the other members' features and compile roam and
/// its dependencies a second time (2 minutes of CI's test run).
fn examples() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-q", "--workspace", "--examples"]);
    // Not the variables cargo set for this test (CARGO_PKG_NAME=roam-cli,
    // CARGO_MANIFEST_DIR, OUT_DIR, ...): ring's build script asks to be re-run when
    // they change, and cargo compares them with its own environment, so
    // with them ring, and everything above it, would be built again here and
    // once more by the next `cargo test`.
    for (var, _) in std::env::vars_os() {
        let var = var.to_string_lossy();
        if SET_FOR_TESTS.iter().any(|p| var.starts_with(p)) {
            cmd.env_remove(&*var);
        }
    }
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    assert!(
        cmd.status().expect("cargo build").success(),
        "building the workspace's examples"
    );
    dir.join("examples")
}

/// A child whose stdout lines arrive on a channel; killed on drop.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: String,
}

impl Proc {
    fn spawn(bin: &Path, name: &str, args: &[&str]) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        let n = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("  [{n}] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            name: name.to_string(),
        }
    }

    fn expect(&self, prefix: &str) -> String {
        let deadline = Instant::now() + LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!("{}: no line {prefix:?} within {LIMIT:?}", self.name),
            }
        }
    }

    /// Waits for a `progress N` line with N ≥ `bytes`.
    fn progress(&self, bytes: u64) {
        let deadline = Instant::now() + LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let n = l
                        .strip_prefix("progress ")
                        .and_then(|n| n.parse::<u64>().ok());
                    if n.is_some_and(|n| n >= bytes) {
                        return;
                    }
                    assert!(
                        !l.starts_with("done"),
                        "{}: finished before {bytes}",
                        self.name
                    );
                }
                Err(_) => panic!("{}: no progress to {bytes} within {LIMIT:?}", self.name),
            }
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A free port on 127.0.0.1, as `addr:port` ([`roam_sim::ports`]).
fn free_port() -> String {
    let port = roam_sim::ports::free_loopback_port().expect("a free port");
    format!("127.0.0.1:{port}")
}

fn write_key(path: &Path) -> Keypair {
    let kp = Keypair::generate().expect("keygen");
    let hex: String = kp
        .private_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .expect("key file");
    writeln!(f, "{hex}").expect("write key");
    kp
}

/// Runs `roam cluster ...`; returns stdout, panicking on a non-zero exit.
fn roam_cluster(cluster: &Path, op_key: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_roam"))
        .arg("cluster")
        .arg("--cluster-file")
        .arg(cluster)
        .arg("--key")
        .arg(op_key)
        .args(args)
        .output()
        .expect("run roam cluster");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "roam cluster {args:?} failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Which host holds `id`, from `roam cluster status --json` (which exits
/// 1 while a host is down: its JSON still lists the others).
fn holder_of_live(cluster: &Path, op_key: &Path, id: &str) -> Option<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_roam"))
        .args(["cluster", "--cluster-file"])
        .arg(cluster)
        .arg("--key")
        .arg(op_key)
        .args(["status", "--json"])
        .output()
        .expect("status");
    let json = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&json).expect("status JSON");
    v.as_array()?.iter().find_map(|h| {
        h["sessions"]
            .as_array()?
            .iter()
            .any(|s| s["id"] == id)
            .then(|| h["host"].as_str().unwrap_or_default().to_string())
    })
}

#[test]
fn an_operator_moves_and_drains_a_download_across_three_host_processes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // The file, the same on every host.
    let root = d.join("root");
    std::fs::create_dir(&root).expect("root");
    let len = 64usize << 20;
    let mut data = vec![0u8; len];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
    std::fs::write(root.join("big.bin"), &data).expect("file");
    let want: String = Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    drop(data);

    // Keys and the cluster file.
    let service_key = d.join("service.key");
    let service = write_key(&service_key);
    let op_key = d.join("op.key");
    let op = write_key(&op_key);
    let mut text = "cluster files\n".to_string();
    let mut hosts = Vec::new();
    for i in 0..3 {
        let name = format!("h{i}");
        let key_path = d.join(format!("{name}.key"));
        let kp = write_key(&key_path);
        let (clients, peers) = (free_port(), free_port());
        text.push_str(&format!(
            "host {name} clients={clients} peers={peers} key={}\n",
            kp.public()
        ));
        hosts.push((name, key_path, clients));
    }
    text.push_str(&format!("operator ops key={}\n", op.public()));
    let cluster = d.join("cluster.conf");
    std::fs::write(&cluster, &text).expect("cluster file");

    let examples = examples();
    let server_bin = examples.join("file_server");
    let client_bin = examples.join("file_client");
    let mut servers: Vec<Proc> = hosts
        .iter()
        .map(|(name, key_path, clients)| {
            let state = d.join(format!("state-{name}"));
            let p = Proc::spawn(
                &server_bin,
                name,
                &[
                    "--listen",
                    clients,
                    "--state-dir",
                    state.to_str().unwrap(),
                    "--root",
                    root.to_str().unwrap(),
                    "--cluster",
                    cluster.to_str().unwrap(),
                    "--host",
                    name,
                    "--host-key",
                    key_path.to_str().unwrap(),
                    "--service-key",
                    service_key.to_str().unwrap(),
                ],
            );
            p.expect("listening ");
            p.expect("cluster port ");
            p
        })
        .collect();

    let client = Proc::spawn(
        &client_bin,
        "client",
        &[
            "--connect",
            &hosts[0].2,
            "--server-key",
            &service.public().to_string(),
            "--file",
            "big.bin",
            "--pace-ms-per-mib",
            "40",
        ],
    );
    let id = client
        .expect("session ")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    client.progress(8388608);
    assert_eq!(
        holder_of_live(&cluster, &op_key, &id).as_deref(),
        Some("h0")
    );

    // h0 → h1 by hand.
    let out = roam_cluster(&cluster, &op_key, &["move", &id, "--to", "h1"]);
    assert!(out.contains("1 session(s) moved"), "{out}");
    client.progress(20971520);
    assert_eq!(
        holder_of_live(&cluster, &op_key, &id).as_deref(),
        Some("h1")
    );
    // The host it left dies at once: nothing depends on it any more.
    servers[0].kill9();

    // Drain h1: h0 is dead, so the drain skips it and the session goes to h2.
    let out = roam_cluster(&cluster, &op_key, &["drain", "h1"]);
    assert!(out.contains("drain h1: 1 session(s) moved"), "{out}");
    client.progress(37748736);
    assert_eq!(
        holder_of_live(&cluster, &op_key, &id).as_deref(),
        Some("h2")
    );
    client.progress(50331648);

    let done = client.expect("done ");
    let w: Vec<&str> = done.split_whitespace().collect();
    assert_eq!(w[1], len.to_string(), "every byte arrived once");
    assert_eq!(w[2], want, "the download's SHA-256 matches the file");
    // `status` reports the dead host instead of failing silently.
    let out = Command::new(env!("CARGO_BIN_EXE_roam"))
        .args(["cluster", "--cluster-file"])
        .arg(&cluster)
        .arg("--key")
        .arg(&op_key)
        .arg("status")
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("h0: not answering"), "{text}");
    assert_eq!(out.status.code(), Some(1));
    for s in servers.iter_mut() {
        s.kill9();
    }
}

#[test]
fn roam_cluster_refuses_a_key_that_is_not_an_operator() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let h = write_key(&d.join("h.key"));
    let key = d.join("me.key");
    write_key(&key);
    let cluster = d.join("c.conf");
    std::fs::write(
        &cluster,
        format!(
            "cluster c\nhost a clients=127.0.0.1:1 peers=127.0.0.1:2 key={}\n",
            h.public()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_roam"))
        .args(["cluster", "--cluster-file"])
        .arg(&cluster)
        .arg("--key")
        .arg(&key)
        .arg("status")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not an operator of cluster c"), "{err}");
    // A broken cluster file names the line.
    std::fs::write(&cluster, "cluster c\nhost a clients=x\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_roam"))
        .args(["cluster", "--cluster-file"])
        .arg(&cluster)
        .arg("--key")
        .arg(&key)
        .arg("status")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2"), "{err}");
}
