//! `roam intercept` (issue 13, racks): an unmodified client's TCP
//! connections to a chosen port become roam sessions when the peer host runs
//! `roam serve`, and stay plain TCP when it does not.
//!
//! Topology: a LAN (roam-sim's `Lan`: a bridge and three hosts, each a
//! network namespace): the client host running `roam intercept`, an
//! *enhanced* host running `roam serve` and an echo server, and an
//! *ordinary* host running only the echo server. The client streams 64-bit
//! sequence numbers through the echo server and checks every echoed word.
//!
//! Needs root, iproute2, nftables and python3; without them the tests say
//! why and pass.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::roam_in;
use roam_sim::echo::{start_echo, EchoStream};
use roam_sim::netns::{self, ChildGuard, Lan};

const CLIENT: usize = 0;
const ENHANCED: usize = 1;
const ORDINARY: usize = 2;
/// The echo servers' port, the one intercepted.
const PORT: u16 = 5001;
/// The HTTP servers' port (`roam run` tests).
const HTTP_PORT: u16 = 8000;
/// redis-server's port (`roam run` test).
const REDIS_PORT: u16 = 6379;

/// Whether the tests can run here.
fn can_run() -> bool {
    if let Err(why) = netns::available() {
        eprintln!("skipped: {why}");
        return false;
    }
    for tool in ["nft", "python3", "nsenter"] {
        if !netns::installed(tool) {
            eprintln!("skipped: {tool} is not installed");
            return false;
        }
    }
    true
}

/// A started `roam` process whose stderr lines arrive on a channel.
struct Logged {
    child: ChildGuard,
    lines: mpsc::Receiver<String>,
    seen: String,
}

impl Logged {
    fn spawn(mut cmd: Command, name: &'static str) -> Logged {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = ChildGuard::spawn(&mut cmd).expect("start roam");
        let err = child.child_mut().stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[{name}] {line}");
                let _ = tx.send(line);
            }
        });
        Logged {
            child,
            lines,
            seen: String::new(),
        }
    }

    /// Waits (at most `within`) for a line containing `needle`.
    fn wait_for(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {needle:?} within {within:?}; so far:\n{}",
                    self.seen
                ),
            }
        }
    }
}

/// The LAN, an echo server on the enhanced and the ordinary host, `roam
/// serve` on the enhanced one, and `roam intercept --port PORT` on the
/// client host.
struct Setup {
    lan: Lan,
    /// `roam intercept` on the client host (a stand-in for tests of `roam run`).
    intercept: Logged,
    /// Its agent's port on the client host's 127.0.0.1 (0 without it).
    agent_port: u16,
    _relay: Logged,
    _echoes: Vec<ChildGuard>,
    client_state: tempfile::TempDir,
    _relay_state: tempfile::TempDir,
}

impl Setup {
    fn new(name: &str) -> Setup {
        Setup::start(name, true)
    }

    /// The LAN, the echo servers and the relay; `roam intercept` only if
    /// `intercept` (else a `sleep` stands in for it).
    fn start(name: &str, intercept: bool) -> Setup {
        let lan = Lan::new(name, 3).expect("LAN");
        let mut echoes = Vec::new();
        for host in [ENHANCED, ORDINARY] {
            let addr = SocketAddr::from((lan.addr(host), PORT));
            echoes.push(ChildGuard::new(start_echo(lan.ns(host), PORT, || {
                lan.tcp_connect(host, addr, Duration::from_secs(1))
            })));
        }
        let relay_state = tempfile::tempdir().expect("state dir");
        let mut cmd = roam_in(&lan, ENHANCED, relay_state.path());
        cmd.args(["serve", "--listen", "0.0.0.0:7447", "--allow"])
            .arg(format!("*:{PORT}"))
            .arg("--allow")
            .arg(format!("*:{HTTP_PORT}"))
            .arg("--allow")
            .arg(format!("*:{REDIS_PORT}"))
            .arg("--allow")
            .arg(format!("*:{PG_PORT}"));
        let mut relay = Logged::spawn(cmd, "serve");
        relay.wait_for("listening on", Duration::from_secs(20));
        let client_state = tempfile::tempdir().expect("state dir");
        let mut agent_port = 0;
        let intercept = if intercept {
            let mut cmd = roam_in(&lan, CLIENT, client_state.path());
            cmd.args(["intercept", "--port", &PORT.to_string()]);
            let mut intercept = Logged::spawn(cmd, "intercept");
            let line = intercept.wait_for("go through roam", Duration::from_secs(20));
            agent_port = line
                .split("agent 127.0.0.1:")
                .nth(1)
                .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no agent port in {line:?}"));
            intercept
        } else {
            let mut sleep = Command::new("sleep");
            sleep.arg("600");
            Logged::spawn(sleep, "sleep")
        };
        Setup {
            lan,
            intercept,
            agent_port,
            _relay: relay,
            _echoes: echoes,
            client_state,
            _relay_state: relay_state,
        }
    }

    /// A verified echo stream from the client host to `host`'s echo server,
    /// connected as an ordinary program would: straight to its address.
    fn echo_to(&self, host: usize) -> EchoStream {
        let sock = self
            .lan
            .tcp_connect(
                CLIENT,
                SocketAddr::from((self.lan.addr(host), PORT)),
                Duration::from_secs(10),
            )
            .expect("connect");
        EchoStream::start(sock)
    }

    /// The client host's `roam intercept` rule sets (table names).
    fn tables(&self) -> Vec<String> {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.lan.ns(CLIENT)))
            .args(["--", "nft", "list", "tables"])
            .output()
            .expect("nft list tables");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter(|w| w.starts_with("roam_intercept_"))
            .map(str::to_owned)
            .collect()
    }

    /// `roam status --json` on the client host: the intercept's sessions.
    fn sessions(&self) -> Vec<serde_json::Value> {
        let out = roam_in(&self.lan, CLIENT, self.client_state.path())
            .args(["status", "--json"])
            .output()
            .expect("roam status");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("status: {e}: {}", String::from_utf8_lossy(&out.stdout)));
        v["processes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["command"].as_str().unwrap_or("").starts_with("intercept"))
            .flat_map(|p| p["sessions"].as_array().cloned().unwrap_or_default())
            .collect()
    }

    /// Destroys every TCP connection host `i` has with the client host
    /// (`ss -K`: an RST goes to the client); returns how many.
    fn kill_connections(&self, i: usize) -> usize {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.lan.ns(i)))
            .args(["--", "ss", "-K", "-t", "dst"])
            .arg(self.lan.addr(CLIENT).to_string())
            .output()
            .expect("ss -K");
        assert!(out.status.success(), "ss -K: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("ESTAB"))
            .count()
    }

    /// Runs the Python client `script` (arguments: the enhanced host's
    /// address, `port`, a `cut` flag file it writes when it is under way, a
    /// `healed` flag file it waits for) under `roam run` on the client host;
    /// cuts the client host's link for 2 s once `cut` exists, then writes
    /// `healed`; the client must succeed within `within`.
    fn run_client_across_a_cut(&self, script: &str, port: u16, within: Duration) {
        let flags = tempfile::tempdir().expect("flag dir");
        let cut = flags.path().join("cut");
        let healed = flags.path().join("healed");
        let mut cmd = roam_in(&self.lan, CLIENT, self.client_state.path());
        cmd.args(["run", "--port", &port.to_string(), "--"])
            .args(["python3", "-c", script])
            .arg(self.lan.addr(ENHANCED).to_string())
            .arg(port.to_string())
            .arg(&cut)
            .arg(&healed);
        let mut run = Logged::spawn(cmd, "run");
        run.wait_for("runs a roam relay", Duration::from_secs(20));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !cut.exists() {
            assert!(Instant::now() < deadline, "the client never got going");
            std::thread::sleep(Duration::from_millis(10));
        }
        self.ip(CLIENT, &["link", "set", "roam0", "down"]);
        std::thread::sleep(Duration::from_secs(2));
        self.ip(CLIENT, &["link", "set", "roam0", "up"]);
        std::fs::write(&healed, b"").expect("flag");
        let status = run
            .child
            .wait_timeout(within)
            .expect("wait")
            .expect("the client finished");
        assert!(status.success(), "{status}: {}", run.seen);
    }

    fn ip(&self, i: usize, args: &[&str]) {
        let out = Command::new("ip")
            .args(["-n", self.lan.ns(i)])
            .args(args)
            .output()
            .expect("ip");
        assert!(out.status.success(), "ip {args:?}: {out:?}");
    }
}

/// A connection to the enhanced host is carried by a roam session: the
/// client host's link goes down for 3 s, then the network resets the
/// session's TCP connection (the enhanced host's kernel destroys it, as a
/// middlebox dropping its state would: `ss -K`), and the unmodified
/// client's stream goes on with every byte, once and in order. (The same
/// reset ends a plain TCP connection, as the ordinary-host test shows.)
#[test]
fn a_connection_to_an_enhanced_host_survives_a_link_cut_and_a_reset_connection() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("icpt_enh");
    let echo = s.echo_to(ENHANCED);
    echo.wait_echoed(2 << 20, Duration::from_secs(30));
    s.intercept
        .wait_for("runs a roam relay", Duration::from_secs(5));
    let sessions = s.sessions();
    assert_eq!(
        sessions.len(),
        1,
        "one session to the enhanced host: {sessions:?}"
    );
    assert!(sessions[0]["streams"].as_u64() >= Some(1), "{sessions:?}");

    // The link goes down for 3 s.
    s.ip(CLIENT, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(3));
    s.ip(CLIENT, &["link", "set", "roam0", "up"]);
    let at = echo.echoed();
    echo.wait_echoed(at + (2 << 20), Duration::from_secs(60));

    // The enhanced host's kernel destroys every TCP connection from the
    // client host (RST to the client).
    let killed = s.kill_connections(ENHANCED);
    assert!(killed >= 1, "no connection from the client host to kill");
    let at = echo.echoed();
    echo.wait_echoed(at + (2 << 20), Duration::from_secs(60));
    let resumes = s.sessions()[0]["resumes"].as_u64().unwrap_or(0);
    assert!(resumes >= 1, "the session resumed on a new connection");
    let (sent, echoed) = echo.finish();
    assert_eq!(echoed, sent, "every byte sent came back once, in order");
    eprintln!(
        "{echoed} bytes through the enhanced host across a link cut and a reset ({resumes} resumes)"
    );
}

/// A connection to an ordinary host (no relay) stays plain TCP, with every
/// byte; then a crash (SIGKILL) leaves the rule set behind, and `roam
/// intercept --cleanup` removes it.
#[test]
fn a_connection_to_an_ordinary_host_stays_plain_and_cleanup_removes_a_crashed_rule_set() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("icpt_ord");
    let t = Instant::now();
    let echo = s.echo_to(ORDINARY);
    echo.wait_echoed(4 << 20, Duration::from_secs(30));
    let took = t.elapsed();
    let line = s
        .intercept
        .wait_for("is an ordinary host", Duration::from_secs(5));
    assert!(line.contains("refused"), "{line}");
    assert!(
        s.sessions().is_empty(),
        "no roam session to an ordinary host"
    );
    // Plain TCP, as without roam: a reset by the network ends it.
    assert!(s.kill_connections(ORDINARY) >= 1);
    // The program sees the reset (its reader fails: `finish` panics) or an
    // early end of its stream.
    let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| echo.finish()));
    if let Ok((sent, echoed)) = ended {
        assert!(
            echoed < sent,
            "a plain connection survived a reset: {echoed} of {sent}"
        );
    }
    eprintln!("ordinary host: first 4 MiB verified in {took:?}, then the reset ended it");

    // A connection made straight to the agent's port (any local user can)
    // is refused, not carried: carried plainly it would reach the agent
    // again, without end.
    let mut straight = s
        .lan
        .tcp_connect(
            CLIENT,
            SocketAddr::from(([127, 0, 0, 1], s.agent_port)),
            Duration::from_secs(5),
        )
        .expect("connect to the agent");
    straight
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    std::thread::sleep(Duration::from_secs(1));
    let established = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", s.lan.ns(CLIENT)))
        .args(["--", "ss", "-tnH", "state", "established"])
        .output()
        .expect("ss");
    let n = String::from_utf8_lossy(&established.stdout).lines().count();
    assert!(n < 10, "{n} connections on the client host: a loop?");
    let mut byte = [0u8; 1];
    let ended = std::io::Read::read(&mut straight, &mut byte);
    assert!(
        match &ended {
            Ok(n) => *n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        },
        "the agent did not close a straight connection: {ended:?}"
    );
    s.intercept
        .wait_for("made straight to the agent", Duration::from_secs(5));

    assert_eq!(s.tables().len(), 1, "{:?}", s.tables());
    s.intercept
        .child
        .signal(nix::sys::signal::Signal::SIGKILL)
        .expect("kill roam intercept");
    let _ = s.intercept.child.wait_timeout(Duration::from_secs(10));
    assert_eq!(s.tables().len(), 1, "a killed intercept leaves its rules");
    let out = roam_in(&s.lan, CLIENT, s.client_state.path())
        .args(["intercept", "--cleanup"])
        .output()
        .expect("roam intercept --cleanup");
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("removed 1 rule set"),
        "{out:?}"
    );
    assert!(s.tables().is_empty(), "{:?}", s.tables());
    // Plain connections work again without the agent (to the enhanced
    // host: the reset above ended the ordinary host's echo server too).
    let echo = s.echo_to(ENHANCED);
    echo.wait_echoed(1 << 20, Duration::from_secs(30));
    let (sent, echoed) = echo.finish();
    assert_eq!(echoed, sent);
}

/// A clean exit (SIGTERM) removes the rule set.
#[test]
fn a_signal_ends_the_intercept_and_removes_its_rules() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("icpt_sig");
    assert_eq!(s.tables().len(), 1);
    s.intercept
        .child
        .signal(nix::sys::signal::Signal::SIGTERM)
        .expect("SIGTERM");
    let status = s
        .intercept
        .child
        .wait_timeout(Duration::from_secs(10))
        .expect("wait")
        .expect("roam intercept exited");
    assert_eq!(status.code(), Some(128 + 15));
    assert!(s.tables().is_empty(), "{:?}", s.tables());
}

/// Waits (at most 10 s) until `addr` takes connections from host `from`
/// of `lan`; `what` names the server in the failure.
fn wait_listening(lan: &Lan, from: usize, addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while lan.tcp_connect(from, addr, Duration::from_secs(1)).is_err() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An HTTP server (python3 -m http.server) on `host`, serving `dir`.
fn http_server(lan: &Lan, host: usize, dir: &Path) -> ChildGuard {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{}", lan.ns(host)))
        .args([
            "--",
            "python3",
            "-m",
            "http.server",
            &HTTP_PORT.to_string(),
            "--bind",
        ])
        .arg(lan.addr(host).to_string())
        .arg("--directory")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let server = ChildGuard::spawn(&mut cmd).expect("http.server");
    let addr = SocketAddr::from((lan.addr(host), HTTP_PORT));
    wait_listening(lan, host, addr, "http.server never listened");
    server
}

/// A file no two 8-byte words of which are alike, and its SHA-256.
fn pattern_file(path: &Path, len: usize) -> Vec<u8> {
    use sha2::Digest;
    let body: Vec<u8> = (0..len as u64 / 8)
        .flat_map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).to_le_bytes())
        .collect();
    std::fs::write(path, &body).expect("write the file");
    sha2::Sha256::digest(&body).to_vec()
}

/// A `roam run -- curl` download of a pattern file of `len` bytes from
/// `host`'s HTTP server (started here), with curl's `extra` options.
struct Download {
    /// Where curl writes the file.
    out: std::path::PathBuf,
    /// The file's SHA-256.
    want: Vec<u8>,
    /// `roam run -- curl`, running.
    run: Logged,
    _http: ChildGuard,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

impl Download {
    fn start(s: &Setup, host: usize, len: usize, extra: &[&str]) -> Download {
        let site = tempfile::tempdir().expect("site");
        let want = pattern_file(&site.path().join("f.bin"), len);
        let http = http_server(&s.lan, host, site.path());
        let got = tempfile::tempdir().expect("download dir");
        let out = got.path().join("f.bin");
        let mut cmd = roam_in(&s.lan, CLIENT, s.client_state.path());
        cmd.args(["run", "--", "curl", "--silent", "--show-error", "--fail"])
            .args(extra)
            .arg("-o")
            .arg(&out)
            .arg(format!("http://{}:{HTTP_PORT}/f.bin", s.lan.addr(host)));
        Download {
            out,
            want,
            run: Logged::spawn(cmd, "run"),
            _http: http,
            _dirs: (site, got),
        }
    }
}

/// `roam run -- curl` downloads from the enhanced host: a plain curl, its
/// connection carried by a session, goes on across a 2 s link cut and a new
/// address for the client host (the old one gone for good), and the file
/// arrives whole (SHA-256). Without roam, curl's connection, bound to the old
/// address, could not survive that.
#[test]
fn roam_run_curl_survives_a_link_cut_and_a_new_client_address() {
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") {
        eprintln!("skipped: needs curl too");
        return;
    }
    let s = Setup::start("run_curl", false);
    // (The server and directories live as long as these bindings.)
    let Download {
        out,
        want,
        mut run,
        _http,
        _dirs,
    } = Download::start(&s, ENHANCED, 24 << 20, &["--limit-rate", "4M"]);
    run.wait_for("runs a roam relay", Duration::from_secs(20));
    let size = || std::fs::metadata(&out).map_or(0, |m| m.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while size() < 2 << 20 {
        assert!(Instant::now() < deadline, "the download never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.ip(CLIENT, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    s.ip(CLIENT, &["link", "set", "roam0", "up"]);
    let old = s.lan.addr(CLIENT);
    s.lan.del_addr(CLIENT, old).expect("remove the old address");
    s.lan
        .add_addr(CLIENT, s.lan.subnet_addr(77))
        .expect("add the new address");
    let at = size();
    let status = run
        .child
        .wait_timeout(Duration::from_secs(90))
        .expect("wait")
        .unwrap_or_else(|| panic!("curl did not finish; {at} bytes at the address change"));
    assert!(status.success(), "roam run -- curl: {status}\n{}", run.seen);
    let body = std::fs::read(&out).expect("the download");
    assert_eq!(body.len(), 24 << 20, "length");
    assert!(
        sha2::Sha256::digest(&body).to_vec() == want,
        "the file differs"
    );
    eprintln!("curl: 24 MiB whole across a link cut and an address change ({at} bytes before it)");
}

/// `roam run -- curl` against an ordinary host (no relay): plain TCP, the
/// file whole, and the host named ordinary.
#[test]
fn roam_run_curl_against_an_ordinary_host_is_plain() {
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") {
        eprintln!("skipped: needs curl too");
        return;
    }
    let s = Setup::start("run_plain", false);
    let Download {
        out,
        want,
        mut run,
        _http,
        _dirs,
    } = Download::start(&s, ORDINARY, 4 << 20, &[]);
    run.wait_for("is an ordinary host", Duration::from_secs(20));
    let status = run
        .child
        .wait_timeout(Duration::from_secs(60))
        .expect("wait")
        .expect("curl finished");
    assert!(status.success(), "{status}\n{}", run.seen);
    let body = std::fs::read(&out).expect("the download");
    assert!(
        sha2::Sha256::digest(&body).to_vec() == want,
        "the file differs"
    );
}

/// `roam run -- redis-cli` against redis-server on the enhanced host:
/// redis-cli (hiredis: a non-blocking connect, then poll) works through the
/// preload, its replies in order across a link cut. (Needs redis-server
/// and redis-cli.)
#[test]
fn roam_run_redis_cli_counts_through_a_link_cut() {
    if !can_run() || !netns::installed("redis-server") || !netns::installed("redis-cli") {
        eprintln!("skipped: needs redis-server and redis-cli too");
        return;
    }
    let s = Setup::start("run_redis", false);
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{}", s.lan.ns(ENHANCED)))
        .args(["--", "redis-server", "--bind"])
        .arg(s.lan.addr(ENHANCED).to_string())
        .args(["--port", &REDIS_PORT.to_string()])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
        .args(["--dir", "/tmp", "--logfile", ""])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _redis = ChildGuard::spawn(&mut cmd).expect("redis-server");
    let addr = SocketAddr::from((s.lan.addr(ENHANCED), REDIS_PORT));
    wait_listening(&s.lan, ENHANCED, addr, "redis never listened");
    // redis-cli reads commands from stdin: 200 INCRs, then (after the link
    // cut) 200 more.
    let (tx, rx) = mpsc::channel::<()>();
    let mut cmd = roam_in(&s.lan, CLIENT, s.client_state.path());
    cmd.args([
        "run",
        "--port",
        &REDIS_PORT.to_string(),
        "--",
        "redis-cli",
        "-h",
    ])
    .arg(s.lan.addr(ENHANCED).to_string())
    .args(["-p", &REDIS_PORT.to_string()])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("roam run -- redis-cli");
    let mut stdin = child.stdin.take().expect("stdin");
    let feeder = std::thread::spawn(move || {
        use std::io::Write;
        for _ in 0..200 {
            writeln!(stdin, "INCR roam:run").expect("write");
        }
        stdin.flush().expect("flush");
        let _ = rx.recv_timeout(Duration::from_secs(60));
        for _ in 0..200 {
            writeln!(stdin, "INCR roam:run").expect("write");
        }
    });
    let (line_tx, replies) = mpsc::channel::<String>();
    let out = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = line_tx.send(line);
        }
    });
    let next = |n: u64| {
        let line = replies
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("no reply {n} within 30 s: {e}"));
        assert_eq!(line.trim(), n.to_string(), "reply {n}");
    };
    for n in 1..=200 {
        next(n);
    }
    s.ip(CLIENT, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    s.ip(CLIENT, &["link", "set", "roam0", "up"]);
    tx.send(()).expect("feeder");
    for n in 201..=400 {
        next(n);
    }
    feeder.join().expect("feeder");
    let out = child.wait_with_output().expect("roam run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(err.contains("runs a roam relay"), "carried by roam: {err}");
}

/// The client of [`roam_run_connection_survives_fork_and_exec`]: connects,
/// echoes 1,000 lines, forks; the child execs a new Python that takes the
/// inherited descriptor, echoes 1,000 lines, says so (a file), waits for
/// the link to heal (another file) and echoes 1,000 more. Every line must
/// come back exactly.
const FORK_EXEC_CLIENT: &str = r#"
import os, socket, sys, time
addr, port, cut, healed = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def echo(s, f, first, n):
    for i in range(first, first + n):
        line = b"line %d\n" % i
        s.sendall(line)
        got = f.readline()
        assert got == line, (got, line)
s = socket.create_connection((addr, port))
echo(s, s.makefile("rb"), 0, 1000)
fd = s.detach()
os.set_inheritable(fd, True)
pid = os.fork()
if pid == 0:
    child = (
        "import os, socket, sys, time\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "f = s.makefile('rb')\n"
        "def echo(first, n):\n"
        "    for i in range(first, first + n):\n"
        "        line = b'line %d\\n' % i\n"
        "        s.sendall(line)\n"
        "        got = f.readline()\n"
        "        assert got == line, (got, line)\n"
        "echo(1000, 1000)\n"
        "open(sys.argv[2], 'w').close()\n"
        "while not os.path.exists(sys.argv[3]):\n"
        "    time.sleep(0.01)\n"
        "echo(2000, 1000)\n"
    )
    os.execv(sys.executable, [sys.executable, "-c", child, str(fd), cut, healed])
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"#;

/// A Python client under `roam run` connects to the enhanced host's echo
/// server, then forks, and the child execs a new Python that goes on with
/// the inherited connection across a link cut: every echoed line checked.
/// The connection survives fork and exec, as in rocks.
#[test]
fn roam_run_connection_survives_fork_and_exec() {
    if !can_run() {
        return;
    }
    let s = Setup::start("run_fork", false);
    s.run_client_across_a_cut(FORK_EXEC_CLIENT, PORT, Duration::from_secs(60));
}

/// Both ends under `roam run` (rocks both ways, no relay installed
/// anywhere): `python3 -m http.server` run with `roam run` on a host makes
/// that host enhanced (the agent takes roam sessions on the relay port as
/// soon as the server listens), and `roam run -- curl` from another host
/// downloads through a session across a 2 s link cut and a new client
/// address, the file whole (SHA-256). The server, unmodified, logs the real
/// client's address, not the agent's loopback one; a plain curl (not under
/// roam) still reaches it directly; and a carried socket's `getpeername`
/// names the server, not the agent.
#[test]
fn roam_run_on_both_ends_carries_a_download_and_the_server_sees_the_real_client() {
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") {
        eprintln!("skipped: needs curl too");
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    let lan = Lan::new("run_both", 2).expect("LAN");
    let site = tempfile::tempdir().expect("site");
    let want = pattern_file(&site.path().join("f.bin"), 24 << 20);
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    // The stock module, on `::` (IPv4 clients included, as IPv4-mapped
    // addresses): it logs each request's client address.
    cmd.args(["run", "--", "python3", "-u", "-m", "http.server"])
        .arg(HTTP_PORT.to_string())
        .args(["--bind", "::"])
        .arg("--directory")
        .arg(site.path());
    let mut server = Logged::spawn(cmd, "run server");
    server.wait_for(
        "roam clients reach it through the relay",
        Duration::from_secs(20),
    );
    let client_addr = lan.addr(C);

    let client_state = tempfile::tempdir().expect("state dir");
    let got = tempfile::tempdir().expect("download dir");
    let out = got.path().join("f.bin");
    let url = format!("http://{}:{HTTP_PORT}/f.bin", lan.addr(S));
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "curl", "--silent", "--show-error", "--fail"])
        .args(["--limit-rate", "4M", "-o"])
        .arg(&out)
        .arg(&url);
    let mut run = Logged::spawn(cmd, "run curl");
    run.wait_for("runs a roam relay", Duration::from_secs(20));
    let line = server.wait_for("GET /f.bin", Duration::from_secs(20));
    assert!(
        line.starts_with(&format!("::ffff:{client_addr} ")),
        "the server should log the client's address {client_addr}, not the agent's: {line:?}"
    );
    let size = || std::fs::metadata(&out).map_or(0, |m| m.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while size() < 2 << 20 {
        assert!(Instant::now() < deadline, "the download never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ip = |args: &[&str]| {
        let o = Command::new("ip")
            .args(["-n", lan.ns(C)])
            .args(args)
            .output()
            .expect("ip");
        assert!(o.status.success(), "ip {args:?}: {o:?}");
    };
    ip(&["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    ip(&["link", "set", "roam0", "up"]);
    lan.del_addr(C, client_addr)
        .expect("remove the old address");
    let new_addr = lan.subnet_addr(77);
    lan.add_addr(C, new_addr).expect("add the new address");
    let at = size();
    let status = run
        .child
        .wait_timeout(Duration::from_secs(90))
        .expect("wait")
        .unwrap_or_else(|| panic!("curl did not finish; {at} bytes at the address change"));
    assert!(status.success(), "roam run -- curl: {status}\n{}", run.seen);
    let body = std::fs::read(&out).expect("the download");
    assert_eq!(body.len(), 24 << 20, "length");
    assert!(
        sha2::Sha256::digest(&body).to_vec() == want,
        "the file differs"
    );

    // An ordinary client (no roam) connects straight to the listener.
    let plain = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lan.ns(C)))
        .args(["--", "curl", "--silent", "--show-error", "--fail", "-o"])
        .arg(got.path().join("plain.bin"))
        .arg(&url)
        .output()
        .expect("curl");
    assert!(plain.status.success(), "plain curl: {plain:?}");
    let plain_body = std::fs::read(got.path().join("plain.bin")).expect("plain download");
    assert!(sha2::Sha256::digest(&plain_body).to_vec() == want);
    let line = server.wait_for("GET /f.bin", Duration::from_secs(20));
    assert!(
        line.starts_with(&format!("::ffff:{new_addr} ")),
        "a plain client is logged with its own address {new_addr}: {line:?}"
    );

    // A carried socket names its real peer.
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "python3", "-c"]).arg(format!(
        "import socket; s = socket.create_connection(('{}', {HTTP_PORT})); \
             print('%s:%d' % s.getpeername())",
        lan.addr(S)
    ));
    let peer = cmd.output().expect("python getpeername");
    assert_eq!(
        String::from_utf8_lossy(&peer.stdout).trim(),
        format!("{}:{HTTP_PORT}", lan.addr(S)),
        "getpeername on a carried socket: {peer:?}"
    );
    // The same from an IPv6 socket to the IPv4-mapped address (as Java and
    // other dual-stack programs connect): carried, and named as mapped.
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "python3", "-c"]).arg(format!(
        "import socket; s = socket.socket(socket.AF_INET6); \
         s.connect(('::ffff:{}', {HTTP_PORT})); \
         s.sendall(b'GET /f.bin HTTP/1.0\\r\\n\\r\\n'); \
         print('%s %d' % s.getpeername()[:2], len(s.recv(12)))",
        lan.addr(S)
    ));
    let peer = cmd.output().expect("python getpeername");
    assert_eq!(
        String::from_utf8_lossy(&peer.stdout).trim(),
        format!("::ffff:{} {HTTP_PORT} 12", lan.addr(S)),
        "a carried IPv4-mapped socket: {peer:?}"
    );
    assert!(
        String::from_utf8_lossy(&peer.stderr).contains("runs a roam relay"),
        "the mapped connection was not carried: {peer:?}"
    );
    eprintln!(
        "both ends under roam run: 24 MiB whole across a link cut and an address change \
         ({at} bytes before it); the server saw {client_addr}"
    );
}

/// iperf3's port (intercept test).
const IPERF_PORT: u16 = 5201;

/// PostgreSQL's port (`roam run -- psql` test).
const PG_PORT: u16 = 5432;

/// A PostgreSQL server (Debian's, as the `postgres` user) on `host`, on a
/// fresh data directory inside `dir`, trusting every client.
fn postgres(lan: &Lan, host: usize, dir: &Path) -> ChildGuard {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let run = |args: &[&str]| {
        let out = Command::new("setpriv")
            .args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--",
            ])
            .args(args)
            .output()
            .expect("setpriv");
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    let data = dir.join("data");
    let _ = Command::new("chown")
        .arg("postgres:postgres")
        .arg(dir)
        .status();
    run(&[
        "initdb",
        "-D",
        &data.to_string_lossy(),
        "-A",
        "trust",
        "-U",
        "postgres",
        "--no-sync",
        "-E",
        "UTF8",
    ]);
    std::fs::write(
        data.join("pg_hba.conf"),
        "local all all trust\nhost all all 0.0.0.0/0 trust\n",
    )
    .expect("pg_hba.conf");
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{}", lan.ns(host)))
        .args([
            "--",
            "setpriv",
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
            "postgres",
            "-D",
        ])
        .arg(&data)
        .arg("-k")
        .arg(dir)
        .args(["-p", &PG_PORT.to_string(), "-c", "fsync=off"])
        // Dynamic shared memory as files in the data directory (removed
        // with it), not /dev/shm segments that a killed server leaves.
        .args(["-c", "dynamic_shared_memory_type=mmap", "-c"])
        .arg(format!("listen_addresses={}", lan.addr(host)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let server = ChildGuard::spawn(&mut cmd).expect("postgres");
    let addr = SocketAddr::from((lan.addr(host), PG_PORT));
    let deadline = Instant::now() + Duration::from_secs(20);
    while lan.tcp_connect(host, addr, Duration::from_secs(1)).is_err() {
        assert!(Instant::now() < deadline, "postgres never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// `roam run -- psql` holds a transaction open against PostgreSQL on the
/// enhanced host across a 2 s link cut and a new client address: the same
/// backend and the same transaction go on after them (`pg_backend_pid`,
/// `txid_current`), a 3.2 MB result arrives whole after them (SHA-256
/// computed by the server), and the commit makes every row exist exactly
/// once, all written by that one transaction (checked afterwards by a
/// separate psql on the server host).
#[test]
fn roam_run_psql_holds_a_transaction_across_a_link_cut_and_a_new_client_address() {
    use sha2::Digest;
    use std::io::Write;
    if !can_run() {
        return;
    }
    for tool in ["psql", "initdb", "postgres", "setpriv"] {
        if !netns::installed(tool) {
            eprintln!("skipped: {tool} is not installed (Debian's postgresql)");
            return;
        }
    }
    let pg_dir = tempfile::tempdir().expect("postgres dir");
    let s = Setup::start("run_psql", false);
    let _pg = postgres(&s.lan, ENHANCED, pg_dir.path());
    let server = s.lan.addr(ENHANCED).to_string();
    let mut cmd = roam_in(&s.lan, CLIENT, s.client_state.path());
    cmd.args(["run", "--port", &PG_PORT.to_string(), "--", "psql", "-h"])
        .arg(&server)
        .args(["-p", &PG_PORT.to_string(), "-U", "postgres", "-X", "-q"])
        .args(["-A", "-t", "-v", "ON_ERROR_STOP=1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut psql = ChildGuard::spawn(&mut cmd).expect("roam run -- psql");
    let mut input = psql.child_mut().stdin.take().expect("stdin");
    let output = psql.child_mut().stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(output).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut ask = |sql: &str| -> String {
        input.write_all(sql.as_bytes()).expect("write to psql");
        input.flush().expect("flush");
        lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("no answer from psql to {sql:?}"))
    };
    let before = ask("BEGIN;\nCREATE TABLE t (i int, h text);\n\
         INSERT INTO t SELECT g, md5(g::text) FROM generate_series(1, 50000) g;\n\
         SELECT txid_current(), pg_backend_pid();\n");
    // Bytes both ways before the cut.
    let check_big = |line: &str, rows: usize| {
        let (digest, body) = line.split_once('|').expect("digest|body");
        assert_eq!(body.len(), rows * 32, "the result's length");
        assert_eq!(
            hex(&sha2::Sha256::digest(body.as_bytes())),
            digest,
            "the result differs from what the server sent"
        );
    };
    const BIG: &str =
        "SELECT encode(sha256(convert_to(string_agg(h, '' ORDER BY i), 'UTF8')), 'hex'), \
                       string_agg(h, '' ORDER BY i) FROM t;\n";
    check_big(&ask(BIG), 50_000);

    s.ip(CLIENT, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    s.ip(CLIENT, &["link", "set", "roam0", "up"]);
    let old = s.lan.addr(CLIENT);
    s.lan.del_addr(CLIENT, old).expect("remove the old address");
    s.lan
        .add_addr(CLIENT, s.lan.subnet_addr(77))
        .expect("add the new address");

    let after = ask(
        "INSERT INTO t SELECT g, md5(g::text) FROM generate_series(50001, 100000) g;\n\
         SELECT txid_current(), pg_backend_pid();\n",
    );
    assert_eq!(
        after, before,
        "the same transaction in the same backend (txid|pid)"
    );
    check_big(&ask(BIG), 100_000);
    assert_eq!(ask("COMMIT;\nSELECT 'committed';\n"), "committed");
    drop(input);
    let status = psql
        .wait_timeout(Duration::from_secs(30))
        .expect("wait")
        .expect("psql ended");
    assert!(status.success(), "roam run -- psql: {status}");

    // On the server host, through its Unix socket: each row once, all of
    // them from that one transaction.
    let out = Command::new("setpriv")
        .args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .args(["psql", "-h"])
        .arg(pg_dir.path())
        .args([
            "-p",
            &PG_PORT.to_string(),
            "-U",
            "postgres",
            "-X",
            "-A",
            "-t",
        ])
        .args([
            "-c",
            "SELECT count(*), count(DISTINCT i), min(i), max(i), count(DISTINCT xmin::text) FROM t",
        ])
        .output()
        .expect("psql on the server");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "100000|100000|1|100000|1",
        "{out:?}"
    );
    eprintln!("psql: one transaction ({before}) across a link cut and an address change");
}

/// Lower-case hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Against ordinary servers (nothing of roam on their host) `roam run`
/// changes nothing of what is exchanged:
///
/// - HTTP: a recorder (`socat -r/-R`) in front of `python3 -m http.server`
///   on the server host writes down both directions. The request `roam run
///   -- curl` sent is byte for byte the one a plain curl sends, and what the
///   server sent is byte for byte what curl received (its `-D` headers and
///   its body, 4 MiB).
/// - ssh: `roam run -- ssh` logs in to an ordinary sshd and reads 8 MiB
///   whose SHA-256 matches the file's (and ssh's own MACs would have
///   refused any changed byte). sshd logs one connection.
#[test]
fn roam_run_against_ordinary_http_and_sshd_servers_changes_no_byte() {
    use roam_sim::netns::{NetPair, Side};
    use roam_sim::sshd::PrivateSshd;
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") || !netns::installed("socat") {
        eprintln!("skipped: needs curl and socat too");
        return;
    }
    if let Err(why) = roam_sim::sshd::available() {
        eprintln!("skipped: {why}");
        return;
    }
    let pair = NetPair::new("run_ordinary").expect("namespaces");
    let server = pair.addr(Side::Server);
    let site = tempfile::tempdir().expect("site");
    let want = pattern_file(&site.path().join("f.bin"), 4 << 20);
    let mut http = Command::new("nsenter");
    http.arg(format!("--net=/run/netns/{}", pair.ns(Side::Server)))
        .args(["--", "python3", "-m", "http.server", "8000", "--bind"])
        .arg(server.to_string())
        .arg("--directory")
        .arg(site.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _http = ChildGuard::spawn(&mut http).expect("http.server");
    let listening = |port: u16| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", pair.ns(Side::Server)))
                .args(["--", "ss", "-Hltn"])
                .arg(format!("sport = :{port}"))
                .output()
                .expect("ss");
            if !out.stdout.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "nothing listens on {port}");
            std::thread::sleep(Duration::from_millis(30));
        }
    };
    listening(8000);
    let work = tempfile::tempdir().expect("work dir");
    let state = tempfile::tempdir().expect("state dir");
    let roam_run = |args: &[&std::ffi::OsStr]| {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", pair.ns(Side::Client)))
            .arg("--")
            .arg(env!("CARGO_BIN_EXE_roam"))
            .env("ROAM_STATE_DIR", state.path())
            .args(["run", "--probe-timeout", "1s", "--"])
            .args(args);
        c
    };
    // One recorded HTTP exchange: (request, response as sent, curl's
    // headers and body as received).
    let exchange = |name: &str, through_roam: bool| -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let (req, resp) = (
            work.path().join(format!("{name}.req")),
            work.path().join(format!("{name}.resp")),
        );
        let mut rec = Command::new("nsenter");
        rec.arg(format!("--net=/run/netns/{}", pair.ns(Side::Server)))
            .args(["--", "socat", "-r"])
            .arg(&req)
            .arg("-R")
            .arg(&resp)
            .arg(format!("TCP-LISTEN:8001,bind={server},reuseaddr"))
            .arg(format!("TCP:{server}:8000"))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let mut rec = ChildGuard::spawn(&mut rec).expect("socat recorder");
        listening(8001);
        let (headers, body) = (
            work.path().join(format!("{name}.h")),
            work.path().join(format!("{name}.b")),
        );
        let url = format!("http://{server}:8001/f.bin");
        let curl: Vec<&std::ffi::OsStr> = vec![
            "curl".as_ref(),
            "--silent".as_ref(),
            "--show-error".as_ref(),
            "--fail".as_ref(),
            "-D".as_ref(),
            headers.as_os_str(),
            "-o".as_ref(),
            body.as_os_str(),
            url.as_ref(),
        ];
        let out = if through_roam {
            roam_run(&curl).output()
        } else {
            pair.command(Side::Client, curl[0])
                .args(&curl[1..])
                .output()
        }
        .expect("curl");
        assert!(out.status.success(), "{name}: {out:?}");
        if through_roam {
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("is an ordinary host"),
                "{out:?}"
            );
        }
        rec.wait_timeout(Duration::from_secs(10))
            .expect("wait")
            .expect("the recorder ended with its connection");
        let read = |p: &Path| std::fs::read(p).expect("read");
        let mut received = read(&headers);
        received.extend(read(&body));
        assert!(
            sha2::Sha256::digest(read(&body)).to_vec() == want,
            "{name}: the body differs"
        );
        (read(&req), read(&resp), received)
    };
    let (plain_req, _, _) = exchange("plain", false);
    let (req, sent, received) = exchange("roam", true);
    assert!(
        req == plain_req,
        "the server got another request through roam run:\n{}\nvs plain:\n{}",
        String::from_utf8_lossy(&req),
        String::from_utf8_lossy(&plain_req)
    );
    assert!(
        sent == received,
        "curl did not receive exactly what the server sent ({} vs {} bytes)",
        received.len(),
        sent.len()
    );

    let sshd = PrivateSshd::start(
        Some((&pair, Side::Server)),
        SocketAddr::from((server, 2222)),
    )
    .expect("sshd");
    let ssh = sshd.ssh_command(None);
    let mut args: Vec<&std::ffi::OsStr> = vec![ssh.get_program()];
    args.extend(ssh.get_args());
    let big = site.path().join("big.bin");
    let want_big = pattern_file(&big, 8 << 20);
    let cat_big = format!("cat {}", big.display());
    args.push(cat_big.as_ref());
    let out = roam_run(&args).output().expect("roam run -- ssh");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ssh: {err}");
    assert!(
        err.contains("is an ordinary host"),
        "ssh went through the agent: {err}"
    );
    assert_eq!(out.stdout.len(), 8 << 20, "ssh output length");
    assert!(
        sha2::Sha256::digest(&out.stdout).to_vec() == want_big,
        "ssh: the file differs"
    );
    let accepted = sshd
        .log()
        .iter()
        .filter(|l| l.contains("Accepted publickey"))
        .count();
    assert_eq!(accepted, 1, "sshd's log: {:?}", sshd.log());
}

/// `roam intercept` at both ends (racks both ways, nothing in any program):
/// the server host runs `roam intercept --port 8000 --incoming` beside an
/// unmodified `python3 -m http.server`, the client host `roam intercept
/// --port 8000`, and a plain curl downloads 24 MiB across a 2 s link cut,
/// the file whole. The server logs the client host's own address (the
/// agent connects to it transparently), not the agent's. Then iperf3 runs
/// both ways (`-R`) across a 1 s link cut each (skipped without iperf3).
/// SIGTERM removes the server host's rule set and its policy route.
#[test]
fn intercept_at_both_ends_carries_curl_and_iperf3_across_link_cuts_and_the_server_sees_the_client()
{
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") {
        eprintln!("skipped: needs curl too");
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    let lan = Lan::new("icpt_in", 2).expect("LAN");
    let site = tempfile::tempdir().expect("site");
    let want = pattern_file(&site.path().join("f.bin"), 24 << 20);
    let mut http = Command::new("nsenter");
    http.arg(format!("--net=/run/netns/{}", lan.ns(S)))
        .args(["--", "python3", "-u", "-m", "http.server"])
        .arg(HTTP_PORT.to_string())
        .arg("--bind")
        .arg(lan.addr(S).to_string())
        .arg("--directory")
        .arg(site.path());
    let mut http = Logged::spawn(http, "http.server");
    let addr = SocketAddr::from((lan.addr(S), HTTP_PORT));
    wait_listening(&lan, S, addr, "http.server never listened");
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    cmd.args(["intercept", "--incoming", "--port", &HTTP_PORT.to_string()])
        .args(["--port", &IPERF_PORT.to_string()]);
    let mut server = Logged::spawn(cmd, "intercept in");
    server.wait_for("incoming: roam sessions on port", Duration::from_secs(20));
    let client_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["intercept", "--port", &HTTP_PORT.to_string()])
        .args(["--port", &IPERF_PORT.to_string()]);
    let mut client = Logged::spawn(cmd, "intercept out");
    client.wait_for("go through roam", Duration::from_secs(20));

    let got = tempfile::tempdir().expect("download dir");
    let out = got.path().join("f.bin");
    let mut curl = Command::new("nsenter");
    curl.arg(format!("--net=/run/netns/{}", lan.ns(C)))
        .args(["--", "curl", "--silent", "--show-error", "--fail"])
        .args(["--limit-rate", "4M", "-o"])
        .arg(&out)
        .arg(format!("http://{}:{HTTP_PORT}/f.bin", lan.addr(S)));
    let mut curl = Logged::spawn(curl, "curl");
    client.wait_for("runs a roam relay", Duration::from_secs(20));
    let line = http.wait_for("GET /f.bin", Duration::from_secs(20));
    assert!(
        line.starts_with(&format!("{} ", lan.addr(C))),
        "the server should log the client host's address {}: {line:?}",
        lan.addr(C)
    );
    let size = || std::fs::metadata(&out).map_or(0, |m| m.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while size() < 2 << 20 {
        assert!(Instant::now() < deadline, "the download never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ip = |host: usize, args: &[&str]| -> String {
        let o = Command::new("ip")
            .args(["-n", lan.ns(host)])
            .args(args)
            .output()
            .expect("ip");
        assert!(o.status.success(), "ip {args:?}: {o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    ip(C, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    ip(C, &["link", "set", "roam0", "up"]);
    let at = size();
    let status = curl
        .child
        .wait_timeout(Duration::from_secs(90))
        .expect("wait")
        .unwrap_or_else(|| panic!("curl did not finish; {at} bytes at the cut"));
    assert!(status.success(), "curl: {status}");
    let body = std::fs::read(&out).expect("the download");
    assert_eq!(body.len(), 24 << 20, "length");
    assert!(
        sha2::Sha256::digest(&body).to_vec() == want,
        "the file differs"
    );

    // iperf3 both ways (its control and data connections intercepted at
    // both ends), with a 1 s link cut in each run: each run completes, and the
    // receiver counts what the sender did (less what was in flight when
    // iperf3's timer ended the test).
    if netns::installed("iperf3") {
        let mut iperf = Command::new("nsenter");
        iperf
            .arg(format!("--net=/run/netns/{}", lan.ns(S)))
            .args(["--", "iperf3", "-s", "-B"])
            .arg(lan.addr(S).to_string())
            .args(["-p", &IPERF_PORT.to_string()]);
        let _iperf = ChildGuard::spawn(iperf.stdout(Stdio::null()).stderr(Stdio::null()))
            .expect("iperf3 -s");
        let addr = SocketAddr::from((lan.addr(S), IPERF_PORT));
        wait_listening(&lan, S, addr, "iperf3 never listened");
        for reverse in [false, true] {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{}", lan.ns(C)))
                .args(["--", "iperf3", "-J", "-t", "4", "-b", "200M", "-c"])
                .arg(lan.addr(S).to_string())
                .args(["-p", &IPERF_PORT.to_string()]);
            if reverse {
                c.arg("-R");
            }
            let run = c
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("iperf3 -c");
            std::thread::sleep(Duration::from_millis(1500));
            ip(C, &["link", "set", "roam0", "down"]);
            std::thread::sleep(Duration::from_secs(1));
            ip(C, &["link", "set", "roam0", "up"]);
            let out = run.wait_with_output().expect("iperf3 -c");
            let report: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("iperf3's JSON report");
            assert!(
                out.status.success() && report.get("error").is_none(),
                "iperf3: {report}"
            );
            let sent = report["end"]["sum_sent"]["bytes"]
                .as_u64()
                .expect("bytes sent");
            let received = report["end"]["sum_received"]["bytes"]
                .as_u64()
                .expect("bytes received");
            // iperf3 stops counting at its timer: what is still in flight
            // then (sockets, agents, session) is sent but not received.
            // It checks no content; the curl download above does.
            assert!(
                received > 10 << 20 && received <= sent && sent - received <= 8 << 20,
                "reverse {reverse}: sent {sent}, received {received}"
            );
            eprintln!(
                "iperf3{}: {sent} bytes sent, {received} received across a 1 s link cut",
                if reverse { " -R" } else { "" }
            );
        }
    }

    assert!(ip(S, &["rule"]).contains("0x726f616e"), "no policy route");
    server
        .child
        .signal(nix::sys::signal::Signal::SIGTERM)
        .expect("SIGTERM");
    server
        .child
        .wait_timeout(Duration::from_secs(10))
        .expect("wait")
        .expect("roam intercept --incoming ended");
    assert!(
        !ip(S, &["rule"]).contains("0x726f616e"),
        "the policy route is left"
    );
    assert!(ip(S, &["route", "show", "table", "29295"])
        .trim()
        .is_empty());
    eprintln!("intercept --incoming: 24 MiB whole across a link cut ({at} bytes before it)");
}

/// A server under `roam run` that answers each line with its connection's
/// `getpeername()` (rocks §8: roam as a source of information about
/// mobility, e.g. for a program that also sends UDP to its client).
const WHERE_SERVER: &str = r#"
import socket, sys
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("0.0.0.0", int(sys.argv[1])))
l.listen()
c, a = l.accept()
print("accepted", a[0], file=sys.stderr, flush=True)
for line in c.makefile("rb"):
    c.sendall(("%s\n" % c.getpeername()[0]).encode())
"#;

/// A client that sends a line for each line of its stdin and prints the
/// answer.
const WHERE_CLIENT: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
f = s.makefile("rb")
for line in sys.stdin:
    s.sendall(b"where?\n")
    print(f.readline().decode().strip(), flush=True)
"#;

/// A server under `roam run` learns where its roam client is *now*: its
/// `getpeername()` names the client host's address, and after the client
/// host's address changes (the old one deleted) the same connection names
/// the new one. Both programs are unmodified Python under `roam run`.
#[test]
fn roam_run_getpeername_follows_a_client_that_moves() {
    use std::io::Write;
    if !can_run() {
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    const WHERE_PORT: u16 = 9000;
    let lan = Lan::new("run_where", 2).expect("LAN");
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    cmd.args(["run", "--", "python3", "-c", WHERE_SERVER])
        .arg(WHERE_PORT.to_string());
    let mut server = Logged::spawn(cmd, "run server");
    server.wait_for(
        "roam clients reach it through the relay",
        Duration::from_secs(20),
    );
    let client_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "python3", "-c", WHERE_CLIENT])
        .arg(lan.addr(S).to_string())
        .arg(WHERE_PORT.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut client = ChildGuard::spawn(&mut cmd).expect("roam run -- python3");
    let mut input = client.child_mut().stdin.take().expect("stdin");
    let output = client.child_mut().stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(output).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut ask = || -> String {
        input.write_all(b"?\n").expect("write");
        input.flush().expect("flush");
        lines
            .recv_timeout(Duration::from_secs(60))
            .expect("an answer")
    };
    let old = lan.addr(C);
    assert_eq!(ask(), old.to_string(), "the client's address");
    server.wait_for(&format!("accepted {old}"), Duration::from_secs(5));
    lan.del_addr(C, old).expect("remove the old address");
    let new = lan.subnet_addr(77);
    lan.add_addr(C, new).expect("add the new address");
    assert_eq!(ask(), new.to_string(), "where the client is now");
    drop(input);
    let _ = client.wait_timeout(Duration::from_secs(10));
}

/// A threaded echo server: each connection echoes until its client's
/// end-of-stream, then closes.
const THREADED_ECHO: &str = r#"
import socket, sys, threading
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("0.0.0.0", int(sys.argv[1])))
l.listen(64)
def serve(c):
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d)
    c.close()
while True:
    c, _ = l.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// A client that uses the socket calls a program may use, each on its own
/// connection and thread, every echoed byte compared: blocking
/// sendmsg/recvmsg, writev/readv on the descriptor, a dup by fcntl and by
/// dup2, send/recv and half-close (shutdown, then end-of-stream); and
/// non-blocking sockets driven by epoll (selectors), poll and select. It
/// writes `cut` after its first rounds and goes on until `healed` exists
/// plus a few rounds. Prints "ok" when every check held.
const SYSCALLS_CLIENT: &str = r#"
import fcntl, os, select, selectors, socket, sys, threading, time
host, port, cut, healed = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
errors = []
rounds_after = {}

def more(name, r):
    if r == 3:
        open(cut, "a").close()
    if os.path.exists(healed):
        rounds_after[name] = rounds_after.get(name, 0) + 1
    return r < 5 or rounds_after.get(name, 0) < 3

def exact(read, n):
    b = bytearray()
    while len(b) < n:
        d = read(n - len(b))
        if not d:
            raise EOFError("end of stream after %d of %d bytes" % (len(b), n))
        b += d
    return bytes(b)

def blocking(name, slot):
    s = socket.create_connection((host, port))
    fd = s.fileno()
    r = 0
    while more(name, r):
        data = os.urandom(3000 + r)
        s.sendmsg([data[:1000], data[1000:]])
        got = exact(lambda n: s.recvmsg(n)[0], len(data))
        if got != data: errors.append(name + " sendmsg/recvmsg")
        os.writev(fd, [data[:7], data[7:]])
        a, b = bytearray(7), bytearray(len(data) - 7)
        views, filled = [memoryview(a), memoryview(b)], 0
        while filled < len(data):
            n = os.readv(fd, views)
            if n == 0: raise EOFError("readv")
            filled += n
            while n:
                k = min(n, len(views[0]))
                views[0] = views[0][k:]
                n -= k
                if len(views[0]) == 0 and len(views) > 1:
                    views.pop(0)
        if bytes(a + b) != data: errors.append(name + " writev/readv")
        d1 = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 200)
        os.write(d1, data)
        if exact(lambda n: os.read(d1, n), len(data)) != data: errors.append(name + " fcntl dup")
        os.close(d1)
        d2 = os.dup2(fd, 300 + slot)
        s.send(data)
        if exact(lambda n: os.read(d2, n), len(data)) != data: errors.append(name + " dup2")
        os.close(d2)
        r += 1
        time.sleep(0.02)
    s.sendall(b"last words")
    s.shutdown(socket.SHUT_WR)
    if exact(s.recv, 10) != b"last words": errors.append(name + " before half-close")
    if s.recv(10) != b"": errors.append(name + " end of stream")
    s.close()

def nonblocking(name, wait):
    s = socket.create_connection((host, port))
    s.setblocking(False)
    r = 0
    while more(name, r):
        data = os.urandom(200000 + r)
        out, got = memoryview(data), bytearray()
        while len(got) < len(data):
            want_write = len(out) > 0
            readable, writable = wait(s, want_write)
            if writable and out:
                try:
                    out = out[s.send(out[:65536]):]
                except BlockingIOError:
                    pass
            if readable:
                try:
                    d = s.recv(65536)
                    if not d: raise EOFError(name)
                    got += d
                except BlockingIOError:
                    pass
        if bytes(got) != data: errors.append(name + " bytes")
        r += 1
        time.sleep(0.02)
    s.close()

sel = {}
def by_epoll(s, w):
    k = sel.setdefault(threading.get_ident(), selectors.EpollSelector())
    ev = selectors.EVENT_READ | (selectors.EVENT_WRITE if w else 0)
    try: k.modify(s, ev)
    except KeyError: k.register(s, ev)
    evs = k.select(5)
    return any(e & selectors.EVENT_READ for _, e in evs), any(e & selectors.EVENT_WRITE for _, e in evs)
def by_poll(s, w):
    p = select.poll(); p.register(s, select.POLLIN | (select.POLLOUT if w else 0))
    evs = p.poll(5000)
    return any(e & select.POLLIN for _, e in evs), any(e & select.POLLOUT for _, e in evs)
def by_select(s, w):
    rl, wl, _ = select.select([s], [s] if w else [], [], 5)
    return bool(rl), bool(wl)

def run(f, *a):
    try: f(*a)
    except Exception as e: errors.append("%s: %r" % (a[0], e))
ts = [threading.Thread(target=run, args=(blocking, "blocking%d" % i, i)) for i in range(3)]
ts += [threading.Thread(target=run, args=(nonblocking, n, w)) for n, w in [("epoll", by_epoll), ("poll", by_poll), ("select", by_select)]]
for t in ts: t.start()
for t in ts: t.join()
print("ok" if not errors else "FAILED: %s" % errors, flush=True)
sys.exit(1 if errors else 0)
"#;

/// An unmodified Python client under `roam run` uses, on six connections
/// from six threads, the socket calls programs use (see
/// [`SYSCALLS_CLIENT`]) across a 2 s link cut, every echoed byte compared;
/// the server echoes with threads. Each call works on the carried
/// descriptor as it would on a plain one, and the cut passes unnoticed.
#[test]
fn roam_run_carries_threads_epoll_poll_select_sendmsg_readv_dup_and_half_close() {
    if !can_run() {
        return;
    }
    let s = Setup::start("run_calls", false);
    let mut echo = Command::new("nsenter");
    echo.arg(format!("--net=/run/netns/{}", s.lan.ns(ENHANCED)))
        .args(["--", "python3", "-c", THREADED_ECHO])
        .arg(HTTP_PORT.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let _echo = ChildGuard::spawn(&mut echo).expect("threaded echo");
    let addr = SocketAddr::from((s.lan.addr(ENHANCED), HTTP_PORT));
    wait_listening(&s.lan, ENHANCED, addr, "the echo server never listened");
    s.run_client_across_a_cut(SYSCALLS_CLIENT, HTTP_PORT, Duration::from_secs(90));
}

/// `roam run` at both ends over IPv6: the server host runs `python3 -m
/// http.server` on its IPv6 address under `roam run` (whose relay then
/// listens on `[::]:7447`), and `roam run -- curl` downloads 24 MiB from
/// `http://[v6]:8000`
/// across a 2 s link cut and a new IPv6 address for the client host (the
/// old one gone), the file whole (SHA-256); the client's agent found the
/// relay over IPv6, the server logged the client's IPv6 address (not
/// `[::1]`), and `getpeername` on a carried IPv6 socket names the server.
#[test]
fn roam_run_carries_an_ipv6_download_across_a_link_cut_and_a_new_address() {
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") {
        eprintln!("skipped: needs curl too");
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    let lan = Lan::new("run_v6", 2).expect("LAN");
    let v6 = |host: u8| format!("fd72:6f61:6d::{host}");
    let ip = |i: usize, args: &[&str]| {
        let o = Command::new("ip")
            .args(["-n", lan.ns(i)])
            .args(args)
            .output()
            .expect("ip");
        assert!(o.status.success(), "ip {args:?}: {o:?}");
    };
    ip(
        C,
        &[
            "-6",
            "addr",
            "add",
            &format!("{}/64", v6(1)),
            "dev",
            "roam0",
            "nodad",
        ],
    );
    ip(
        S,
        &[
            "-6",
            "addr",
            "add",
            &format!("{}/64", v6(2)),
            "dev",
            "roam0",
            "nodad",
        ],
    );
    let site = tempfile::tempdir().expect("site");
    let want = pattern_file(&site.path().join("f.bin"), 24 << 20);
    // The server under `roam run` too: its IPv6-only listener makes the
    // host enhanced, and its log names each request's client.
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    cmd.args(["run", "--", "python3", "-u", "-m", "http.server"])
        .arg(HTTP_PORT.to_string())
        .args(["--bind", &v6(2), "--directory"])
        .arg(site.path());
    let mut server = Logged::spawn(cmd, "run server");
    server.wait_for(
        "roam clients reach it through the relay",
        Duration::from_secs(20),
    );
    let addr: SocketAddr = format!("[{}]:{HTTP_PORT}", v6(2)).parse().expect("addr");
    wait_listening(&lan, C, addr, "http.server never answered over IPv6");

    let client_state = tempfile::tempdir().expect("state dir");
    let got = tempfile::tempdir().expect("download dir");
    let out = got.path().join("f.bin");
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args([
        "run",
        "--",
        "curl",
        "-g",
        "--silent",
        "--show-error",
        "--fail",
    ])
    .args(["--limit-rate", "4M", "-o"])
    .arg(&out)
    .arg(format!("http://[{}]:{HTTP_PORT}/f.bin", v6(2)));
    let mut run = Logged::spawn(cmd, "run curl");
    let line = run.wait_for("runs a roam relay", Duration::from_secs(20));
    assert!(line.contains(&v6(2)), "{line}");
    let line = server.wait_for("GET /f.bin", Duration::from_secs(20));
    assert!(
        line.starts_with(&format!("{} ", v6(1))),
        "the server should log the client's IPv6 address {}: {line:?}",
        v6(1)
    );
    let size = || std::fs::metadata(&out).map_or(0, |m| m.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while size() < 2 << 20 {
        assert!(Instant::now() < deadline, "the download never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    ip(C, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    ip(C, &["link", "set", "roam0", "up"]);
    // (The kernel drops the old IPv6 address with the link: it is gone
    // for good, and the client host comes back with a new one.)
    let _ = Command::new("ip")
        .args(["-n", lan.ns(C), "-6", "addr", "del"])
        .arg(format!("{}/64", v6(1)))
        .args(["dev", "roam0"])
        .output();
    ip(
        C,
        &[
            "-6",
            "addr",
            "add",
            &format!("{}/64", v6(77)),
            "dev",
            "roam0",
            "nodad",
        ],
    );
    let at = size();
    let status = run
        .child
        .wait_timeout(Duration::from_secs(90))
        .expect("wait")
        .unwrap_or_else(|| panic!("curl did not finish; {at} bytes at the address change"));
    assert!(status.success(), "roam run -- curl: {status}\n{}", run.seen);
    let body = std::fs::read(&out).expect("the download");
    assert_eq!(body.len(), 24 << 20, "length");
    assert!(
        sha2::Sha256::digest(&body).to_vec() == want,
        "the file differs"
    );
    // The carried socket names its real peer, not the agent's [::1].
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "python3", "-c"]).arg(format!(
        "import socket; s = socket.create_connection(('{}', {HTTP_PORT})); \
         print('%s %d' % s.getpeername()[:2])",
        v6(2)
    ));
    let peer = cmd.output().expect("python getpeername");
    assert_eq!(
        String::from_utf8_lossy(&peer.stdout).trim(),
        format!("{} {HTTP_PORT}", v6(2)),
        "getpeername on a carried IPv6 socket: {peer:?}"
    );
    eprintln!("IPv6: 24 MiB whole across a link cut and a new address ({at} bytes before it)");
}

/// A server that accepts one connection, forks, and has the child exec a
/// new Python that echoes on the inherited descriptor (naming its peer
/// first) while the parent keeps its copy open until the child ends.
const FORK_EXEC_SERVER: &str = r#"
import os, socket, sys
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("0.0.0.0", int(sys.argv[1])))
l.listen()
c, a = l.accept()
print("accepted", a[0], file=sys.stderr, flush=True)
fd = c.detach()
os.set_inheritable(fd, True)
pid = os.fork()
if pid == 0:
    child = (
        "import socket, sys\n"
        "s = socket.socket(fileno=int(sys.argv[1]))\n"
        "print('child serves', s.getpeername()[0], file=sys.stderr, flush=True)\n"
        "while True:\n"
        "    d = s.recv(65536)\n"
        "    if not d:\n"
        "        break\n"
        "    s.sendall(d)\n"
    )
    os.execv(sys.executable, [sys.executable, "-c", child, str(fd)])
os.waitpid(pid, 0)
"#;

/// Both ends fork and exec while connected, both under `roam run` (rocks
/// §4's fork, exec and shared sockets): the server's child execs and echoes
/// on the accepted connection (its `getpeername` after the exec names the
/// client host), the client's child execs and goes on across a 2 s link cut
/// and a new client address; every echoed line is checked (3,000), and the
/// server ends with its client's connection.
#[test]
fn roam_run_client_and_server_both_fork_and_exec_across_a_cut_and_a_new_address() {
    if !can_run() {
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    const FORK_PORT: u16 = 9100;
    let lan = Lan::new("run_forks", 2).expect("LAN");
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    cmd.args(["run", "--", "python3", "-c", FORK_EXEC_SERVER])
        .arg(FORK_PORT.to_string());
    let mut server = Logged::spawn(cmd, "run server");
    server.wait_for(
        "roam clients reach it through the relay",
        Duration::from_secs(20),
    );
    let flags = tempfile::tempdir().expect("flag dir");
    let cut = flags.path().join("cut");
    let healed = flags.path().join("healed");
    let client_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "python3", "-c", FORK_EXEC_CLIENT])
        .arg(lan.addr(S).to_string())
        .arg(FORK_PORT.to_string())
        .arg(&cut)
        .arg(&healed);
    let mut run = Logged::spawn(cmd, "run client");
    let old = lan.addr(C);
    server.wait_for(&format!("accepted {old}"), Duration::from_secs(20));
    server.wait_for(&format!("child serves {old}"), Duration::from_secs(20));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cut.exists() {
        assert!(
            Instant::now() < deadline,
            "the client's child never got going"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let ip = |args: &[&str]| {
        let o = Command::new("ip")
            .args(["-n", lan.ns(C)])
            .args(args)
            .output()
            .expect("ip");
        assert!(o.status.success(), "ip {args:?}: {o:?}");
    };
    ip(&["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    ip(&["link", "set", "roam0", "up"]);
    lan.del_addr(C, old).expect("remove the old address");
    lan.add_addr(C, lan.subnet_addr(77))
        .expect("add the new address");
    std::fs::write(&healed, b"").expect("flag");
    let status = run
        .child
        .wait_timeout(Duration::from_secs(60))
        .expect("wait")
        .expect("the client finished");
    assert!(status.success(), "{status}: {}", run.seen);
    let status = server
        .child
        .wait_timeout(Duration::from_secs(20))
        .expect("wait")
        .expect("the server ended with its client's connection");
    assert!(status.success(), "server: {status}: {}", server.seen);
}

/// A program that leaves a server running and exits at once (a daemon, or
/// `sh -c 'server &'`): `roam run` says so, keeps carrying the server's
/// connections and its relay while the server runs (a client under `roam
/// run` reaches it and gets its own address from `getpeername`), and ends
/// with the program's exit status once the server has ended.
#[test]
fn roam_run_serves_what_a_daemonizing_program_leaves_running() {
    use std::io::Write;
    if !can_run() {
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    const WHERE_PORT: u16 = 9000;
    let lan = Lan::new("run_daemon", 2).expect("LAN");
    let scripts = tempfile::tempdir().expect("scripts");
    let server_py = scripts.path().join("where_server.py");
    std::fs::write(&server_py, WHERE_SERVER).expect("script");
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    cmd.args(["run", "--", "sh", "-c"]).arg(format!(
        "python3 {} {WHERE_PORT} & exit 3",
        server_py.display()
    ));
    let mut server = Logged::spawn(cmd, "run sh");
    server.wait_for("still runs", Duration::from_secs(20));
    server.wait_for(
        "roam clients reach it through the relay",
        Duration::from_secs(20),
    );

    let client_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["run", "--", "python3", "-c", WHERE_CLIENT])
        .arg(lan.addr(S).to_string())
        .arg(WHERE_PORT.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut client = ChildGuard::spawn(&mut cmd).expect("roam run -- python3");
    let mut input = client.child_mut().stdin.take().expect("stdin");
    let mut output = BufReader::new(client.child_mut().stdout.take().expect("stdout"));
    input.write_all(b"?\n").expect("write");
    input.flush().expect("flush");
    let mut answer = String::new();
    output.read_line(&mut answer).expect("an answer");
    assert_eq!(answer.trim(), lan.addr(C).to_string());
    drop(input);
    let status = client
        .wait_timeout(Duration::from_secs(20))
        .expect("wait")
        .expect("the client ended");
    assert!(status.success(), "client: {status}");
    // The server ends with its one connection, and `roam run` with it.
    let status = server
        .child
        .wait_timeout(Duration::from_secs(20))
        .expect("wait")
        .expect("roam run ended after the server it left running");
    assert_eq!(status.code(), Some(3), "the program's own exit status");
}

/// `roam intercept` over IPv6 at both ends: the client host's rule set
/// redirects a plain curl's IPv6 connection to the agent on `[::1]`, the
/// agent finds the server host's `roam intercept --incoming` over IPv6, and
/// 24 MiB arrive whole (SHA-256) across a 2 s link cut. (IPv6 addresses are
/// kept across the cut, `keep_addr_on_down`: intercept cannot survive an
/// address the program's own socket is bound to going away.)
#[test]
fn intercept_carries_an_ipv6_download_across_a_link_cut() {
    use sha2::Digest;
    if !can_run() || !netns::installed("curl") {
        eprintln!("skipped: needs curl too");
        return;
    }
    const C: usize = 0;
    const S: usize = 1;
    let lan = Lan::new("icpt_v6", 2).expect("LAN");
    let v6 = |host: u8| format!("fd72:6f61:6e::{host}");
    let ip = |i: usize, args: &[&str]| {
        let o = Command::new("ip")
            .args(["-n", lan.ns(i)])
            .args(args)
            .output()
            .expect("ip");
        assert!(o.status.success(), "ip {args:?}: {o:?}");
    };
    let o = Command::new("ip")
        .args(["netns", "exec", lan.ns(C), "sysctl", "-qw"])
        .arg("net.ipv6.conf.roam0.keep_addr_on_down=1")
        .output()
        .expect("sysctl");
    assert!(o.status.success(), "sysctl: {o:?}");
    for (host, last) in [(C, 1), (S, 2)] {
        let a = format!("{}/64", v6(last));
        ip(host, &["-6", "addr", "add", &a, "dev", "roam0", "nodad"]);
    }
    let site = tempfile::tempdir().expect("site");
    let want = pattern_file(&site.path().join("f.bin"), 24 << 20);
    let mut http = Command::new("nsenter");
    http.arg(format!("--net=/run/netns/{}", lan.ns(S)))
        .args(["--", "python3", "-m", "http.server"])
        .arg(HTTP_PORT.to_string())
        .args(["--bind", &v6(2), "--directory"])
        .arg(site.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _http = ChildGuard::spawn(&mut http).expect("http.server");
    let addr: SocketAddr = format!("[{}]:{HTTP_PORT}", v6(2)).parse().expect("addr");
    wait_listening(&lan, S, addr, "http.server never listened");
    let server_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, S, server_state.path());
    cmd.args(["intercept", "--incoming", "--port", &HTTP_PORT.to_string()]);
    let mut server = Logged::spawn(cmd, "intercept in");
    server.wait_for("incoming: roam sessions on port", Duration::from_secs(20));
    let client_state = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&lan, C, client_state.path());
    cmd.args(["intercept", "--port", &HTTP_PORT.to_string()]);
    let mut client = Logged::spawn(cmd, "intercept out");
    client.wait_for("go through roam", Duration::from_secs(20));

    let got = tempfile::tempdir().expect("download dir");
    let out = got.path().join("f.bin");
    let mut curl = Command::new("nsenter");
    curl.arg(format!("--net=/run/netns/{}", lan.ns(C)))
        .args(["--", "curl", "-g", "--silent", "--show-error", "--fail"])
        .args(["--limit-rate", "4M", "-o"])
        .arg(&out)
        .arg(format!("http://[{}]:{HTTP_PORT}/f.bin", v6(2)));
    let mut curl = Logged::spawn(curl, "curl");
    let line = client.wait_for("runs a roam relay", Duration::from_secs(20));
    assert!(line.contains(&v6(2)), "{line}");
    let size = || std::fs::metadata(&out).map_or(0, |m| m.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while size() < 2 << 20 {
        assert!(Instant::now() < deadline, "the download never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    ip(C, &["link", "set", "roam0", "down"]);
    std::thread::sleep(Duration::from_secs(2));
    ip(C, &["link", "set", "roam0", "up"]);
    let at = size();
    let status = curl
        .child
        .wait_timeout(Duration::from_secs(90))
        .expect("wait")
        .unwrap_or_else(|| panic!("curl did not finish; {at} bytes at the cut"));
    assert!(status.success(), "curl: {status}");
    let body = std::fs::read(&out).expect("the download");
    assert_eq!(body.len(), 24 << 20, "length");
    assert!(
        sha2::Sha256::digest(&body).to_vec() == want,
        "the file differs"
    );
}
