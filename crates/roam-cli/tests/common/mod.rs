//! Helpers shared by the end-to-end tests of the `roam` binary (`cli`,
//! `shell`, `takeover`, `abuse_client`, `abuse_relay`, `intercept`, `migrate`): the binary's path, a child process killed when its
//! guard drops, a free loopback port, a `roam` command in a private state
//! directory (also inside a test LAN's host), a client key, a metrics scrape,
//! and the seeded test data of the store tests (`seed`, `random`, `sha`). Included with `mod common;` (a directory, so
//! cargo does not build it as a test of its own; the `faults_*` tests share
//! `faults_common` the same way).

// Each test binary uses a different subset of this module.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The `roam` binary cargo built for this test run.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_roam");

/// Kills the child (SIGKILL) and reaps it when dropped, so a failing test
/// leaves no process behind.
pub(crate) struct Guard(pub(crate) Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Guard {
    /// Waits for the child to exit, at most `limit`; its exit code.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(st) = self.0.try_wait().unwrap() {
                return Some(st.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends the child signal `sig` (`kill -SIG`).
    pub(crate) fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.0.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }
}

/// A free loopback port for a child process that must be told its port
/// (outside the kernel's ephemeral range: [`roam_sim::ports`]).
pub(crate) fn free_port() -> u16 {
    roam_sim::ports::free_loopback_port().unwrap()
}

/// Waits (at most 20 s) until something accepts connections on the
/// loopback `port`; panics if nothing does.
pub(crate) fn wait_for_port(port: u16) {
    let end = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < end, "the relay never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `roam` with its state, and its `HOME`, in `state`, and no `RUST_LOG` or
/// `XDG_CONFIG_HOME` from the environment: nothing outside the test's
/// directory is read or written.
pub(crate) fn roam(state: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.env("ROAM_STATE_DIR", state)
        .env("HOME", state)
        .env_remove("RUST_LOG")
        .env_remove("XDG_CONFIG_HOME");
    c
}

/// Makes a client key in the state directory `dir` (`roam keygen`);
/// returns its public key, as a line for an authorized keys file.
pub(crate) fn keygen(dir: &Path) -> String {
    let out = Command::new(BIN)
        .env("ROAM_STATE_DIR", dir)
        .arg("keygen")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "roam keygen: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `GET path` on `addr`: the status line and the body.
pub(crate) fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut all = String::new();
    c.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap_or((&all, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

/// The value of the sample `name` (labels included, exactly) in `text`.
pub(crate) fn sample(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// `roam status --json` of the state directory `state`, parsed.
#[allow(dead_code)]
pub(crate) fn status_json(state: &Path) -> serde_json::Value {
    let out = roam(state).args(["status", "--json"]).output().unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "roam status --json: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Reads `r` to its end slower than a bulk sender writes (4 KiB every
/// 2 ms), so a roam client writing to it holds output it has not printed.
#[allow(dead_code)]
pub(crate) fn slow_reader(
    mut r: impl std::io::Read + Send + 'static,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = r.read(&mut buf) {
            v.extend_from_slice(&buf[..n]);
            std::thread::sleep(Duration::from_millis(2));
        }
        v
    })
}

/// `roam` run inside host `i` of `lan` (its network namespace) with its own
/// state directory `state`.
#[allow(dead_code)]
pub(crate) fn roam_in(lan: &roam_sim::netns::Lan, i: usize, state: &Path) -> Command {
    let mut c = lan.command(i, BIN);
    c.env("ROAM_STATE_DIR", state)
        .stdin(std::process::Stdio::null());
    c
}

/// The run's seed: `$ROAM_TEST_SEED`, else `default` (each test file has
/// its own); printed so a failure replays.
pub(crate) fn seed(default: u64) -> u64 {
    let seed = std::env::var("ROAM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    eprintln!("ROAM_TEST_SEED={seed}");
    seed
}

/// `len` pseudo-random bytes (splitmix64 from `*state`).
pub(crate) fn random(state: &mut u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Hex SHA-256 of `bytes`.
pub(crate) fn sha(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}
