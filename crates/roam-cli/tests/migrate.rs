//! `roam migrate-process` moves a running, unmodified server with a live
//! TCP connection to another host, address and all, and fails safely
//! (issue 12).
//!
//! Topology: a LAN (roam-sim's `Lan`: a bridge and three hosts, each a
//! network namespace): a client host, host A where a Python echo server runs
//! on a service address of its own, and host B running `roam migrate-accept`.
//! `roam migrate-process` runs on A (`nsenter --net`, as the server). The
//! client streams 64-bit sequence numbers through the server and checks
//! every echoed word across the move.
//!
//! Needs root, iproute2, nftables, python3 and CRIU >= 4.1 (and redis-server
//! for its test)
//! (`$ROAM_CRIU` or `criu` on `PATH`). Without them the tests say why and
//! pass, except when `$ROAM_CRIU` is set (CI sets it).

mod common;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::roam_in;
use roam_sim::echo::{alive, start_echo_family, EchoStream, UdpEcho};
use roam_sim::netns::{self, ChildGuard, Lan};

const CLIENT: usize = 0;
const A: usize = 1;
const B: usize = 2;
/// A host that has the service address in its neighbour cache and no
/// traffic with it: only an announcement can update its entry.
const WATCHER: usize = 3;
/// The echo server's port (inside the LAN's namespaces only).
const PORT: u16 = 7100;
/// `roam migrate-accept`'s port on B.
const ACCEPT_PORT: u16 = 7448;

/// Whether the tests can run here; panics when `$ROAM_CRIU` is set and
/// something is missing.
fn can_run() -> bool {
    let required = std::env::var_os("ROAM_CRIU").is_some_and(|v| !v.is_empty());
    let skip = |why: String| {
        assert!(!required, "ROAM_CRIU is set but {why}");
        eprintln!("skipped: {why}");
        false
    };
    if let Err(why) = netns::available() {
        return skip(why);
    }
    for tool in ["nft", "python3", "nsenter"] {
        if !netns::installed(tool) {
            return skip(format!("{tool} is not installed"));
        }
    }
    if let Err(e) = roam_criu::Criu::locate() {
        return skip(format!("no usable CRIU: {e}"));
    }
    true
}

/// [`can_run`], and `tool` (a real server a test moves) is installed;
/// panics when `$ROAM_CRIU` is set and it is not.
fn can_run_with(tool: &str) -> bool {
    if !can_run() {
        return false;
    }
    if !netns::installed(tool) {
        assert!(
            std::env::var_os("ROAM_CRIU").is_none(),
            "ROAM_CRIU is set but {tool} is not installed"
        );
        eprintln!("skipped: {tool} is not installed");
        return false;
    }
    true
}

/// Waits (at most 10 s) until `addr` accepts connections from the client
/// host; `what` names the server in the failure.
fn wait_listening(lan: &Lan, addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while lan
        .tcp_connect(CLIENT, addr, Duration::from_secs(1))
        .is_err()
    {
        assert!(Instant::now() < deadline, "{what} never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A LAN with the echo server on A's service address, a verified stream
/// through it from the client host, and `roam migrate-accept` on B.
struct Setup {
    lan: Lan,
    /// The server's own address on A (IPv4, or IPv6 for the IPv6 move).
    service: IpAddr,
    /// Waits for the original server process (this test is its parent):
    /// reaped the moment CRIU ends it, as on a real host whose init reaps
    /// it.
    reaper: Option<std::thread::JoinHandle<()>>,
    pid: i32,
    /// The verified stream through the echo server (none for other servers).
    stream: Option<EchoStream>,
    /// The source's state directory (its client key).
    src_state: tempfile::TempDir,
    _dst_state: tempfile::TempDir,
    /// B's images directory when the test names none: its own, so that
    /// what migrate-accept keeps of a failed restore (CRIU's logs) goes
    /// with the test instead of staying in /dev/shm. Dropped after
    /// migrate-accept (fields drop after [`Setup`]'s `drop`).
    _images: Option<tempfile::TempDir>,
    accept: Option<ChildGuard>,
}

impl Setup {
    /// `images_dir`: where B writes received images (default a directory
    /// of the test's own, removed with it).
    fn new(name: &str, images_dir: Option<&Path>) -> Setup {
        Setup::holding(name, images_dir, 0)
    }

    /// [`Setup::new`], the server holding `ballast_mb` MB of memory.
    fn holding(name: &str, images_dir: Option<&Path>, ballast_mb: u32) -> Setup {
        Setup::with_server_at(name, images_dir, false, |lan, service| {
            echo_server(lan, service, ballast_mb)
        })
    }

    /// The LAN, the service address on A, the server `start` starts there
    /// (with its echo stream, if it is the echo server), and B's
    /// `roam migrate-accept`.
    fn with_server(
        name: &str,
        images_dir: Option<&Path>,
        start: impl FnOnce(&Lan, Ipv4Addr) -> (Child, Option<EchoStream>),
    ) -> Setup {
        Setup::with_server_at(name, images_dir, false, |lan, service| {
            let IpAddr::V4(v4) = service else {
                unreachable!("an IPv4 service address")
            };
            start(lan, v4)
        })
    }

    /// The echo server on an IPv6 service address (`fd00:198::100/64` on A;
    /// every host has an address of that /64 too), with its verified
    /// stream, and B's `roam migrate-accept` (reached over IPv4).
    fn ipv6(name: &str) -> Setup {
        Setup::with_server_at(name, None, true, |lan, service| {
            echo_server(lan, service, 0)
        })
    }

    /// The LAN, the service address on A (IPv6 when `v6`: then every host
    /// gets `fd00:198::(i+1)/64` beside its IPv4 address, without duplicate
    /// address detection), the server `start` starts there, and B's
    /// `roam migrate-accept`, in a pid namespace of its own, as on a host of
    /// its own: B restores the process while it is frozen on A, still
    /// holding its pids (every process there dies with migrate-accept).
    fn with_server_at(
        name: &str,
        images_dir: Option<&Path>,
        v6: bool,
        start: impl FnOnce(&Lan, IpAddr) -> (Child, Option<EchoStream>),
    ) -> Setup {
        let lan = Lan::new(name, 4).expect("LAN");
        let service = if v6 {
            for i in 0..4 {
                add_addr6(&lan, i, host6(u16::try_from(i + 1).expect("host")));
            }
            let service = host6(0x100);
            add_addr6(&lan, A, service);
            IpAddr::V6(service)
        } else {
            let service = lan.subnet_addr(100);
            lan.add_addr(A, service).expect("service address on A");
            IpAddr::V4(service)
        };
        let (server, stream) = start(&lan, service);
        let pid = i32::try_from(server.id()).expect("pid");
        let reaper = Some(reap(server));

        let src_state = tempfile::tempdir().expect("state dir");
        let dst_state = tempfile::tempdir().expect("state dir");
        let keygen = Command::new(env!("CARGO_BIN_EXE_roam"))
            .arg("keygen")
            .env("ROAM_STATE_DIR", src_state.path())
            .output()
            .expect("roam keygen");
        assert!(keygen.status.success(), "{keygen:?}");
        let keys = dst_state.path().join("migrate_keys");
        std::fs::write(&keys, &keygen.stdout).expect("authorized keys");
        let mut cmd = lan.command_own_pids(B, env!("CARGO_BIN_EXE_roam"));
        cmd.env("ROAM_STATE_DIR", dst_state.path())
            .stdin(Stdio::null());
        cmd.arg("migrate-accept")
            .arg("--listen")
            .arg(format!("{}:{ACCEPT_PORT}", lan.addr(B)))
            .arg("--authorized-keys")
            .arg(&keys)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // migrate-accept's default for a post-copy move is /dev/shm: the
        // test's own directory there (else in the temporary directory).
        let owned = match images_dir {
            Some(_) => None,
            None => Some(
                tempfile::Builder::new()
                    .prefix("roam-test-images-")
                    .tempdir_in(if Path::new("/dev/shm").is_dir() {
                        Path::new("/dev/shm").to_path_buf()
                    } else {
                        std::env::temp_dir()
                    })
                    .expect("B's images dir"),
            ),
        };
        let images = images_dir.or(owned.as_ref().map(tempfile::TempDir::path));
        cmd.arg("--images-dir").arg(images.expect("an images dir"));
        let mut accept = ChildGuard::spawn(&mut cmd).expect("roam migrate-accept");
        // Its first line says it listens; the rest is logged as it comes.
        let err = accept.child_mut().stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[migrate-accept] {line}");
                let _ = tx.send(line);
            }
        });
        let first = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("migrate-accept said nothing");
        assert!(first.contains("listening on"), "{first}");
        Setup {
            lan,
            service,
            reaper,
            pid,
            stream,
            src_state,
            _dst_state: dst_state,
            _images: owned,
            accept: Some(accept),
        }
    }

    /// Ends the echo stream, checks that every byte it sent came back once
    /// and in order, and starts a new one on a new connection (`what`
    /// names it in the failure). Returns the bytes the old one sent.
    fn finish_stream_and_reconnect(&mut self, what: &str) -> u64 {
        let conn = self
            .lan
            .tcp_connect(
                CLIENT,
                SocketAddr::from((self.service, PORT)),
                Duration::from_secs(5),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let old = self.stream.replace(EchoStream::start(conn));
        let (sent, echoed) = old.expect("an echo stream").finish();
        assert_eq!(echoed, sent, "every byte sent came back once, in order");
        sent
    }

    /// Starts `roam migrate-process` and reads its stderr until a line
    /// containing `phase` (within a minute). Returns the command, the rest
    /// of its stderr, and what it said so far.
    fn migrate_until(&self, phase: &str) -> (Child, BufReader<std::process::ChildStderr>, String) {
        let mut child = self.start_migrate(&[]);
        let mut err = BufReader::new(child.stderr.take().expect("stderr"));
        let mut seen = String::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut line = String::new();
            let n = err
                .read_line(&mut line)
                .expect("read migrate-process's stderr");
            assert!(
                n > 0 && Instant::now() < deadline,
                "no {phase:?} phase: {seen}"
            );
            seen.push_str(&line);
            if line.contains(phase) {
                break;
            }
        }
        (child, err, seen)
    }

    /// The move did not happen: the server runs on A (not B) with its
    /// address, no lock is left on either host, and its connection carries
    /// on (2 MB more) with every byte; a new one then echoes too.
    fn assert_still_at_source(&mut self) {
        assert!(alive(self.pid), "the server is gone");
        assert!(
            self.runs_on(A, self.pid) && !self.runs_on(B, self.pid),
            "the server is not on A alone"
        );
        assert!(self.has_service(A), "A lost the address");
        assert!(!self.has_service(B), "B kept the address");
        assert!(
            !self.has_lock(A) && !self.has_lock(B),
            "an address lock was left"
        );
        let at = self.echo().echoed();
        self.echo()
            .wait_echoed(at + (2 << 20), Duration::from_secs(30));
        self.finish_stream_and_reconnect("connect again");
    }

    /// The move happened: the server runs on B alone and its connection
    /// carries on (1 MB more, every byte checked).
    fn assert_moved_and_echoing(&self) {
        assert!(
            self.runs_on(B, self.pid) && !self.runs_on(A, self.pid),
            "the server is not on B alone"
        );
        let at = self.echo().echoed();
        self.echo()
            .wait_echoed(at + (1 << 20), Duration::from_secs(10));
    }

    /// The echo stream.
    fn echo(&self) -> &EchoStream {
        self.stream.as_ref().expect("an echo stream")
    }

    /// `roam migrate-process` of the server to B, started.
    fn start_migrate(&self, extra: &[&str]) -> Child {
        let mut cmd = roam_in(&self.lan, A, self.src_state.path());
        cmd.arg("migrate-process")
            .arg(self.pid.to_string())
            .arg("--to")
            .arg(format!("{}:{ACCEPT_PORT}", self.lan.addr(B)))
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.spawn().expect("roam migrate-process")
    }

    /// Runs `roam migrate-process` on A (bounded: it is killed after 3 min).
    fn migrate(&self, extra: &[&str]) -> Output {
        let child = self.start_migrate(extra);
        let pid = child.id();
        let watchdog = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(180);
            while Instant::now() < deadline {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        });
        let out = child.wait_with_output().expect("wait for migrate-process");
        let _ = watchdog.join();
        eprintln!(
            "migrate-process: {}\nstdout:\n{}stderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Runs `roam migrate-process` on A and, as soon as it says the server
    /// is frozen (the address locked), opens a new TCP connection to the
    /// server from the client host: its SYN reaches A during the freeze.
    /// Returns the command's output and how long that connect took.
    fn migrate_with_syn_in_freeze(
        &self,
        extra: &[&str],
    ) -> (Output, Duration, std::net::UdpSocket) {
        let mut child = self.start_migrate(extra);
        let err = child.stderr.take().expect("stderr");
        let mut out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let addr = SocketAddr::from((self.service, PORT));
        std::thread::scope(|scope| {
            let stderr = scope.spawn(move || {
                let mut all = String::new();
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if line.contains("freezing and dumping") {
                        let _ = tx.send(());
                    }
                    all.push_str(&line);
                    all.push('\n');
                }
                all
            });
            let stdout = scope.spawn(move || {
                let mut all = Vec::new();
                let _ = std::io::Read::read_to_end(&mut out, &mut all);
                all
            });
            rx.recv_timeout(Duration::from_secs(60))
                .expect("migrate-process never froze the server");
            // One datagram during the freeze, sent once: the lock drops it
            // at A, and only its capture and re-injection can answer it.
            let any = if self.service.is_ipv6() {
                "[::]:0"
            } else {
                "0.0.0.0:0"
            };
            let udp = self
                .lan
                .in_ns(CLIENT, || std::net::UdpSocket::bind(any))
                .expect("client namespace")
                .expect("UDP socket");
            udp.send_to(b"in the freeze", addr)
                .expect("a datagram sent during the freeze");
            let t = Instant::now();
            let conn = self
                .lan
                .tcp_connect(CLIENT, addr, Duration::from_secs(10))
                .expect("a connection opened during the freeze");
            let took = t.elapsed();
            drop(conn);
            let status = child.wait().expect("wait for migrate-process");
            let out = Output {
                status,
                stdout: stdout.join().expect("stdout reader"),
                stderr: stderr.join().expect("stderr reader").into_bytes(),
            };
            eprintln!(
                "migrate-process: {}\nstdout:\n{}stderr:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out, took, udp)
        })
    }

    /// Host `i`'s link-layer address.
    fn mac(&self, i: usize) -> String {
        let out = Command::new("ip")
            .args(["-n", self.lan.ns(i), "-o", "link", "show", "roam0"])
            .output()
            .expect("ip link");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace()
            .skip_while(|w| *w != "link/ether")
            .nth(1)
            .unwrap_or_else(|| panic!("no link/ether in {text}"))
            .to_owned()
    }

    /// Sets host `i`'s neighbour entry for `addr` to `mac` in state `nud`.
    fn set_neighbour(&self, i: usize, addr: IpAddr, mac: &str, nud: &str) {
        let ok = Command::new("ip")
            .args(["-n", self.lan.ns(i), "neigh", "replace"])
            .arg(addr.to_string())
            .args(["lladdr", mac, "dev", "roam0", "nud", nud])
            .status()
            .expect("ip neigh replace");
        assert!(ok.success());
    }

    /// Waits (at most 3 s) until the idle watcher has B's link-layer
    /// address `mac_b` for the service: only B's announcement can put it
    /// there (A's is `mac_a`).
    fn wait_announced(&self, mac_a: &str, mac_b: &str) {
        let deadline = Instant::now() + Duration::from_secs(3);
        while !self.neighbour(WATCHER).contains(mac_b) {
            assert!(
                Instant::now() < deadline,
                "the watcher still has {} for the service (A {mac_a}, B {mac_b}): no announcement",
                self.neighbour(WATCHER).trim()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The link-layer address host `i` has cached for the service address.
    fn neighbour(&self, i: usize) -> String {
        let out = Command::new("ip")
            .args([
                "-n",
                self.lan.ns(i),
                "neigh",
                "show",
                &self.service.to_string(),
            ])
            .output()
            .expect("ip neigh");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A counter of the `Tcp:` line of host `i`'s `/proc/net/snmp`.
    fn tcp_counter(&self, i: usize, name: &str) -> u64 {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.lan.ns(i)))
            .args(["--", "cat", "/proc/net/snmp"])
            .output()
            .expect("read /proc/net/snmp");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
        let (names, values) = (tcp.next().unwrap_or(""), tcp.next().unwrap_or(""));
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| panic!("no Tcp {name} in {text}"))
    }

    /// Whether host `i` has the service address.
    fn has_service(&self, i: usize) -> bool {
        let out = Command::new("ip")
            .args(["-n", self.lan.ns(i), "-o", "addr", "show"])
            .output()
            .expect("ip addr");
        String::from_utf8_lossy(&out.stdout).contains(&format!("{}/", self.service))
    }

    /// Waits (at most 2 s) until host `i` has the service address for good
    /// (`valid_lft forever`): B's lease on it made permanent at the commit.
    fn wait_permanent(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let out = Command::new("ip")
                .args(["-n", self.lan.ns(i), "-o", "addr", "show"])
                .output()
                .expect("ip addr");
            let text = String::from_utf8_lossy(&out.stdout);
            let line = text
                .lines()
                .find(|l| l.contains(&format!(" {}/", self.service)));
            if line.is_some_and(|l| l.contains("valid_lft forever preferred_lft forever")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the address is not there for good: {line:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether host `i` still has an address lock (a `roam_lock_` table).
    fn has_lock(&self, i: usize) -> bool {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.lan.ns(i)))
            .args(["--", "nft", "list", "tables"])
            .output()
            .expect("nft list tables");
        String::from_utf8_lossy(&out.stdout).contains("roam_lock_")
    }

    /// Whether `pid` is a process of host `i`, as that host sees it (B's
    /// processes by their pid in its own pid namespace: a restored process
    /// has its old pid there).
    fn runs_on(&self, i: usize, pid: i32) -> bool {
        self.host_pid(i, pid).is_some()
    }

    /// The nice value of process `pid` (as its own pid namespace numbers
    /// it) on host `i`, if it runs there.
    fn nice_on(&self, i: usize, pid: i32) -> Option<i32> {
        let p = self.host_pid(i, pid)?;
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // `PID (COMM) STATE ...`: the nice value is the 19th field, the
        // 17th after COMM.
        let rest = &stat[stat.rfind(')')? + 1..];
        rest.split_whitespace().nth(16)?.parse().ok()
    }

    /// This machine's pid of the live (not zombie) process `pid` of host
    /// `i`, as its own pid namespace numbers it.
    fn host_pid(&self, i: usize, pid: i32) -> Option<String> {
        let out = Command::new("ip")
            .args(["netns", "pids", self.lan.ns(i)])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .find(|p| {
                // `NSpid:` lists its pid in every namespace, its own last.
                let status = std::fs::read_to_string(format!("/proc/{p}/status"));
                let own = status.ok().and_then(|st| {
                    st.lines()
                        .find_map(|l| l.strip_prefix("NSpid:"))
                        .and_then(|l| l.split_whitespace().last().map(str::to_owned))
                });
                own.is_some_and(|own| own == pid.to_string())
                    && !std::fs::read_to_string(format!("/proc/{p}/stat"))
                        .is_ok_and(|st| st.contains(") Z "))
            })
            .map(str::to_owned)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        drop(self.accept.take());
        // The server, if it runs on A still (at B it died with
        // migrate-accept, its pid namespace's first process).
        if self.runs_on(A, self.pid) {
            let _ = Command::new("kill")
                .args(["-9", &self.pid.to_string()])
                .status();
        }
        if let Some(r) = self.reaper.take() {
            let _ = r.join();
        }
    }
}

/// The summary's packet counts: (arrived during the freeze, re-injected).
fn reinjection(stdout: &str) -> (u64, u64) {
    let line = stdout
        .lines()
        .find(|l| l.contains("packets arrived during the freeze"))
        .unwrap_or_else(|| panic!("no packet count: {stdout}"));
    let num = |t: Option<&str>| {
        t.and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("unreadable packet count: {line}"))
    };
    (num(Some(line)), num(line.split(": ").nth(1)))
}

/// Waits until `dir` is empty, at most `within`; fails with `what`.
fn wait_empty(dir: &Path, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while std::fs::read_dir(dir).map_or(0, Iterator::count) > 0 {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The echo server on A's `service` address (served on `::` for an IPv6
/// one) holding `ballast_mb` MB, and a stream through it from the client
/// host, 2 MB already echoed and verified.
fn echo_server(lan: &Lan, service: IpAddr, ballast_mb: u32) -> (Child, Option<EchoStream>) {
    let addr = SocketAddr::from((service, PORT));
    let server = start_echo_family(lan.ns(A), PORT, ballast_mb, service.is_ipv6(), || {
        lan.tcp_connect(CLIENT, addr, Duration::from_secs(1))
    });
    let sock = lan
        .tcp_connect(CLIENT, addr, Duration::from_secs(5))
        .expect("connect");
    let stream = EchoStream::start(sock);
    stream.wait_echoed(2 << 20, Duration::from_secs(30));
    (server, Some(stream))
}

/// `fd00:198::last`: an address of the IPv6 move's /64.
fn host6(last: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x198, 0, 0, 0, 0, 0, last)
}

/// Adds `addr/64` to host `i`, usable at once (no duplicate address
/// detection).
fn add_addr6(lan: &Lan, i: usize, addr: Ipv6Addr) {
    let ok = Command::new("ip")
        .args(["-n", lan.ns(i), "addr", "add", &format!("{addr}/64")])
        .args(["dev", "roam0", "nodad"])
        .status()
        .expect("ip addr add");
    assert!(ok.success(), "cannot add {addr} to host {i}");
}

/// Waits for `child` on a thread of its own.
fn reap(mut child: Child) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let _ = child.wait();
    })
}

/// The whole move: the server runs on B with the same pid and connection,
/// its address moved from A to B, no lock left, and every byte the client
/// sent came back once and in order, the stream flowing again within
/// seconds of the command's end. B announced the address (gratuitous
/// ARP): a host with no traffic to the server has B's link-layer address
/// for it afterwards.
#[test]
fn a_running_server_moves_to_another_host_with_its_connection_and_address() {
    if !can_run() {
        return;
    }
    let received = tempfile::tempdir().expect("B's images dir");
    let mut s = Setup::new("mig_move", Some(received.path()));
    let (mac_a, mac_b) = (s.mac(A), s.mac(B));
    // The watcher has A's link-layer address for the service. B knows the
    // client's already, so it sends no ARP request of its own from the
    // service address (any ARP packet from an address updates the other
    // hosts' entries for it): only the announcement can update the watcher.
    let neigh =
        |host: usize, addr: IpAddr, mac: &str, nud: &str| s.set_neighbour(host, addr, mac, nud);
    neigh(WATCHER, s.service, &mac_a, "stale");
    neigh(B, s.lan.addr(CLIENT).into(), &s.mac(CLIENT), "permanent");
    let mut udp = UdpEcho::new(
        s.lan
            .in_ns(CLIENT, || std::net::UdpSocket::bind("0.0.0.0:0"))
            .expect("client namespace")
            .expect("UDP socket"),
        SocketAddr::from((s.service, PORT)),
    );
    udp.rounds(20, Duration::from_secs(10))
        .expect("UDP echo before the move");
    let csum_errors = s.tcp_counter(B, "InCsumErrors");
    s.echo().reset_gap();
    let (out, syn_connect, freeze_udp) = s.migrate_with_syn_in_freeze(&[]);
    let done = Instant::now();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "migrate-process failed: {stderr}");
    assert!(
        stdout.contains(&format!("moved {} (python3)", s.pid)) && stdout.contains("freeze "),
        "summary: {stdout}"
    );
    assert!(
        stdout.contains(&format!("{}/24", s.service))
            && stdout.contains("1 TCP connection, 1 listening socket, 1 UDP socket"),
        "the summary names the address and the connection: {stdout}"
    );
    // CRIU logged at its default level (warnings), whose log has none of
    // the debug marks the dump's phases are read from.
    assert!(
        stdout.contains("CRIU's phases with --criu-log debug"),
        "{stdout}"
    );
    for phase in [
        "can host it",
        "freezing and dumping",
        "sending",
        "restored at",
    ] {
        assert!(stderr.contains(phase), "no {phase:?} phase shown: {stderr}");
    }
    assert!(s.runs_on(B, s.pid), "the server is not on host B");
    assert!(!s.runs_on(A, s.pid), "the server is still on host A");
    assert!(!s.has_service(A), "the address stayed on A");
    assert!(s.has_service(B), "the address is not on B");
    s.wait_permanent(B);
    assert!(!s.has_lock(A) && !s.has_lock(B), "an address lock was left");
    wait_empty(
        received.path(),
        Duration::from_secs(3),
        "B kept the images of a move",
    );
    // B announced the address: the idle watcher's cache moved to B.
    s.wait_announced(&mac_a, &mac_b);

    let at = s.echo().echoed();
    s.echo().wait_echoed(at + (1 << 20), Duration::from_secs(8));
    let resumed = done.elapsed();
    let pause = s.echo().longest_gap();
    // What reached A during the freeze (the new connection's SYN at least,
    // and whatever the stream sent) was delivered at B, with valid
    // checksums: every captured packet re-injected.
    let (captured, reinjected) = reinjection(&stdout);
    assert!(
        captured >= 1,
        "the SYN sent during the freeze was not captured: {stdout}"
    );
    assert_eq!(reinjected, captured, "{stdout}");
    assert_eq!(
        s.tcp_counter(B, "InCsumErrors"),
        csum_errors,
        "B dropped re-injected packets for their checksums"
    );
    s.echo()
        .wait_echoed(at + (4 << 20), Duration::from_secs(30));
    let sent =
        s.finish_stream_and_reconnect("the moved server accepts new connections on its address");
    // The listening socket moved too: the new connection echoes.
    let at = s.echo().echoed();
    s.echo()
        .wait_echoed(at + (1 << 20), Duration::from_secs(10));
    // The datagram sent once during the freeze was answered (from B).
    freeze_udp
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    let n = freeze_udp
        .recv(&mut buf)
        .expect("no answer to the datagram sent during the freeze");
    assert_eq!(&buf[..n], b"in the freeze");
    // The UDP socket moved too: the same server answers datagrams at B.
    let sends = udp
        .rounds(20, Duration::from_secs(10))
        .expect("UDP echo after the move");
    eprintln!(
        "moved: {sent} bytes verified; the client's longest pause {pause:?} ({reinjected} \
         packets re-injected); a connection opened during the freeze took {syn_connect:?}; \
         stream flowing again {resumed:?} after the command; 20 UDP requests answered with \
         {sends} sends"
    );
}

/// The move over IPv6: the server (listening on `::`) moves with its
/// connection, its listening and UDP sockets and its IPv6 address; B
/// announces the address with an unsolicited Neighbor Advertisement (an
/// idle host's stale entry for it takes B's link-layer address); the
/// datagram and the SYN sent during the freeze are captured at A and
/// re-injected at B; every byte of the stream comes back once, in order.
#[test]
fn an_ipv6_server_moves_with_its_connections_and_its_address_is_announced() {
    if !can_run() {
        return;
    }
    let mut s = Setup::ipv6("mig_v6");
    let (mac_a, mac_b) = (s.mac(A), s.mac(B));
    let neigh =
        |host: usize, addr: IpAddr, mac: &str, nud: &str| s.set_neighbour(host, addr, mac, nud);
    neigh(WATCHER, s.service, &mac_a, "stale");
    neigh(B, host6(1).into(), &s.mac(CLIENT), "permanent");
    s.echo().reset_gap();
    let (out, syn_connect, freeze_udp) = s.migrate_with_syn_in_freeze(&[]);
    let done = Instant::now();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "migrate-process failed: {stderr}");
    assert!(
        stdout.contains(&format!("{}/64", s.service))
            && stdout.contains("1 TCP connection, 1 listening socket, 1 UDP socket"),
        "the summary names the IPv6 address and the sockets: {stdout}"
    );
    assert!(
        s.runs_on(B, s.pid) && !s.runs_on(A, s.pid),
        "the server is not on B alone"
    );
    assert!(
        !s.has_service(A) && s.has_service(B),
        "the address did not move to B"
    );
    s.wait_permanent(B);
    assert!(!s.has_lock(A) && !s.has_lock(B), "an address lock was left");
    s.wait_announced(&mac_a, &mac_b);
    let at = s.echo().echoed();
    s.echo().wait_echoed(at + (1 << 20), Duration::from_secs(8));
    let resumed = done.elapsed();
    let pause = s.echo().longest_gap();
    let (captured, reinjected) = reinjection(&stdout);
    assert!(captured >= 1, "nothing captured in the freeze: {stdout}");
    assert_eq!(reinjected, captured, "{stdout}");
    freeze_udp
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    let n = freeze_udp
        .recv(&mut buf)
        .expect("no answer to the datagram sent during the freeze");
    assert_eq!(&buf[..n], b"in the freeze");
    let sent = s.finish_stream_and_reconnect("the moved server accepts IPv6 connections");
    let at = s.echo().echoed();
    s.echo()
        .wait_echoed(at + (1 << 20), Duration::from_secs(10));
    eprintln!(
        "moved over IPv6: {sent} bytes verified; the client's longest pause {pause:?} \
         ({reinjected} packets re-injected); a connection opened during the freeze took \
         {syn_connect:?}; stream flowing again {resumed:?} after the command"
    );
}

/// The same move with `--no-reinject`: still every byte (TCP retransmits
/// what the freeze dropped), and the client's pause is reported next to
/// the re-injecting move's (the benchmark compares them).
#[test]
fn without_reinjection_the_move_still_delivers_every_byte() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("mig_noreinj", None);
    s.echo().reset_gap();
    let (out, syn_connect, _) = s.migrate_with_syn_in_freeze(&["--no-reinject"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("left to retransmission (--no-reinject)"),
        "{stdout}"
    );
    let at = s.echo().echoed();
    let want = at + (2 << 20);
    if !s.echo().echoed_within(want, Duration::from_secs(30)) {
        // It failed once in CI (1.1 of the 2 MB within 30 s) and never
        // here: say what TCP was doing at both ends.
        let ss = |i: usize| {
            s.lan
                .command(i, "ss")
                .arg("-tnoie")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_else(|e| format!("ss: {e}"))
        };
        panic!(
            "only {} of {want} bytes echoed within 30 s after the move (longest pause {:?})\n\
             TCP at the client:\n{}\nTCP at B:\n{}",
            s.echo().echoed(),
            s.echo().longest_gap(),
            ss(CLIENT),
            ss(B)
        );
    }
    let pause = s.echo().longest_gap();
    s.finish_stream_and_reconnect("connect after the move");
    eprintln!(
        "moved without re-injection: the client's longest pause {pause:?}; a connection \
         opened during the freeze took {syn_connect:?} (its SYN retransmitted)"
    );
}

/// Asks the echo server (over UDP) whether its memory still hashes as it
/// did when it started: `intact` or `CORRUPT`.
fn memory_verdict(s: &Setup) -> String {
    let udp = s
        .lan
        .in_ns(CLIENT, || std::net::UdpSocket::bind("0.0.0.0:0"))
        .expect("client namespace")
        .expect("UDP socket");
    udp.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    for _ in 0..5 {
        udp.send_to(b"roam:check-memory", SocketAddr::from((s.service, PORT)))
            .expect("send");
        if let Ok((n, _)) = udp.recv_from(&mut buf) {
            return String::from_utf8_lossy(&buf[..n]).into_owned();
        }
    }
    panic!("the server never answered the memory check");
}

/// Post-copy (`--lazy-pages`): the server runs at B before its 96 MB of
/// memory are there; the memory follows over the roam session while it
/// runs. Its connection carries on with every byte, its memory hashes as
/// before the move, and the summary counts the memory that followed.
#[test]
fn with_lazy_pages_the_server_runs_at_the_destination_and_its_memory_follows() {
    if !can_run() {
        return;
    }
    let pipes_before = std::fs::read_to_string("/proc/sys/fs/pipe-max-size").expect("read");
    let mut s = Setup::holding("mig_lazy", None, 96);
    assert_eq!(memory_verdict(&s), "intact", "before the move");
    let nice = s.nice_on(A, s.pid).expect("the server's nice value at A");
    // At debug level CRIU's log has the marks the summary's phases need.
    let out = s.migrate(&["--lazy-pages", "--criu-log", "debug"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The images held no memory: it followed, all of it.
    let followed: f64 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("post-copy: "))
        .and_then(|l| l.split(" MB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no post-copy line: {stdout}"));
    assert!(followed >= 96.0, "only {followed} MB followed: {stdout}");
    // The progress said about how much was to follow (the server's
    // anonymous memory, its 96 MB of ballast among it).
    let stderr = String::from_utf8_lossy(&out.stderr);
    let to_follow: f64 = stderr
        .lines()
        .find(|l| l.contains("sending the rest of its memory"))
        .and_then(|l| l.split("(about ").nth(1))
        .and_then(|l| l.split(" MB to follow)").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure of the memory to follow: {stderr}"));
    assert!(
        (96.0..followed * 1.5).contains(&to_follow),
        "{to_follow} MB to follow, {followed} MB followed"
    );
    // The summary breaks the dump down from CRIU's log.
    assert!(
        stdout.contains("in the dump: address lock and capture")
            && stdout.contains("files and sockets"),
        "{stdout}"
    );
    // The CRIU roam builds (patch 0003) leaves the lazy memory in the
    // frozen server instead of capturing it into page pipes inside the
    // freeze, and roam served every page itself (the memory hashes as
    // before, below); a stock CRIU captures it.
    let criu = roam_criu::Criu::locate().expect("criu");
    assert_eq!(
        stdout.contains("its lazy pages left in place"),
        criu.knows_lazy_unpiped(),
        "{stdout}"
    );
    let images: f64 = stdout
        .split(" of images")
        .next()
        .and_then(|l| l.rsplit("; ").next())
        .and_then(|l| l.split(" MB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no image size: {stdout}"));
    assert!(
        images < 50.0,
        "{images} MB of images: memory went inside the freeze"
    );
    assert!(
        s.has_service(B) && !s.has_service(A),
        "the address did not move"
    );
    assert!(!s.runs_on(A, s.pid), "the server still runs on A");
    assert!(!s.has_lock(A) && !s.has_lock(B), "an address lock was left");
    // Both ends ran the move at a raised priority: the server runs on at
    // its own.
    assert_eq!(
        s.nice_on(B, s.pid),
        Some(nice),
        "the restored server's nice value"
    );
    let at = s.echo().echoed();
    s.echo()
        .wait_echoed(at + (2 << 20), Duration::from_secs(30));
    s.finish_stream_and_reconnect("connect after the move");
    assert_eq!(memory_verdict(&s), "intact", "after the move");
    // A stock CRIU's lazy dump fills bigger pipes than this host allows by
    // default (roam raises the limit for it); the limit is back where it
    // was.
    assert_eq!(
        std::fs::read_to_string("/proc/sys/fs/pipe-max-size").expect("pipe-max-size"),
        pipes_before
    );
}

/// A roam relay (with the echo server it reaches over loopback as its
/// child) moves to B, whose address is not A's: the service address stays
/// at A, the relay's sessions' connections are cut in the freeze, and A
/// answers their resumes with `Moved` to B. A `roam forward` client's
/// stream through the relay to the echo server goes on with every byte,
/// over a connection to B's own address.
#[test]
fn a_roam_relay_moves_to_another_address_and_its_clients_follow_it() {
    if !can_run() {
        return;
    }
    const RELAY_PORT: u16 = 7447;
    const LOCAL_PORT: u16 = 7300;
    let relay_state = tempfile::tempdir().expect("relay state");
    let relay_log = relay_state.path().join("relay.log");
    let key = relay_state.path().join("server.key");
    let mut s = Setup::with_server("mig_follow", None, |lan, service| {
        // The relay execs from the shell that started the echo server: the
        // server is the relay's child, and both move.
        let tree = format!(
            "python3 -c \"$ROAM_ECHO\" {PORT} & exec {} serve --listen 0.0.0.0:{RELAY_PORT} \
             --allow 127.0.0.1:{PORT} --key {} 2>>{}",
            env!("CARGO_BIN_EXE_roam"),
            key.display(),
            relay_log.display()
        );
        let relay = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", lan.ns(A)))
            .args(["--", "setsid", "sh", "-c", &tree])
            .env("ROAM_ECHO", roam_sim::echo::ECHO_SERVER)
            .env("ROAM_STATE_DIR", relay_state.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the relay");
        wait_listening(lan, SocketAddr::from((service, RELAY_PORT)), "the relay");
        wait_listening(lan, SocketAddr::from((service, PORT)), "the echo server");
        (relay, None)
    });
    let client_state = tempfile::tempdir().expect("client state");
    let mut forward = roam_in(&s.lan, CLIENT, client_state.path());
    forward
        .args(["forward", "-v"])
        .arg(format!("{}:{RELAY_PORT}", s.service))
        .arg(format!("127.0.0.1:{LOCAL_PORT}"))
        .arg(format!("127.0.0.1:{PORT}"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(client_state.path().join("forward.log")).expect("log"),
        ));
    let _forward = ChildGuard::spawn(&mut forward).expect("roam forward");
    let logs = || {
        format!(
            "relay log:\n{}\nforward log:\n{}",
            std::fs::read_to_string(&relay_log).unwrap_or_default(),
            std::fs::read_to_string(client_state.path().join("forward.log")).unwrap_or_default()
        )
    };
    let local = SocketAddr::from(([127, 0, 0, 1], LOCAL_PORT));
    // Not a probe connection: the echo server takes one connection at a
    // time, and a second one waiting in its accept queue would be an
    // in-flight connection, which CRIU refuses to dump.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !logs().contains(&format!("roam forward: 127.0.0.1:{LOCAL_PORT}")) {
        assert!(
            Instant::now() < deadline,
            "roam forward never listened\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let sock = s
        .lan
        .tcp_connect(CLIENT, local, Duration::from_secs(5))
        .expect("connect through the forward");
    s.stream = Some(EchoStream::start(sock));
    // Waits until `more` bytes beyond what has come back so far are
    // echoed, else fails saying `what`, with both logs.
    let wait_echoed = |s: &Setup, more: u64, what: &str| {
        let until = s.echo().echoed() + more;
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.echo().echoed() < until {
            assert!(Instant::now() < deadline, "{what}\n{}", logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_echoed(&s, 2 << 20, "nothing echoed before the move");

    let b = format!("{}:{RELAY_PORT}", s.lan.addr(B));
    let key_arg = key.display().to_string();
    let service = s.service.to_string();
    let args = [
        "--address",
        &service,
        "--sessions-to",
        &b,
        "--server-key",
        &key_arg,
        "--redirect-for",
        "8",
    ];
    // The relay's connection to the echo server is over loopback, both
    // its ends in the tree: unless its packets are held back while CRIU
    // dumps (A) and restores (B) one end after the other, the restore
    // fails at times (the unsent data of the end rebuilt first draws a
    // reset: 9 runs in 28 here) or the stream stalls after the move (the
    // two images disagree: 1 run in 9 under load).
    let out = s.migrate(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs()
    );
    assert!(
        stdout.contains(&format!("roam clients resume at {b}")),
        "{stdout}"
    );
    assert!(
        s.runs_on(B, s.pid) && !s.runs_on(A, s.pid),
        "the relay is not on B alone"
    );
    assert!(s.has_service(A) && !s.has_service(B), "the address moved");
    assert!(!s.has_lock(A) && !s.has_lock(B), "an address lock was left");
    wait_echoed(&s, 2 << 20, "the stream stopped at the move");
    // The client's session now lives on a connection to B's own address.
    let conns = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", s.lan.ns(CLIENT)))
        .args(["--", "ss", "-t", "-n", "state", "established", "dst"])
        .arg(&b)
        .output()
        .expect("ss");
    let conns = String::from_utf8_lossy(&conns.stdout);
    assert!(conns.lines().count() > 1, "no connection to {b}: {conns}");
    let (sent, echoed) = s.stream.take().expect("stream").finish();
    assert_eq!(echoed, sent, "every byte sent came back once, in order");
}

/// A destination whose disk fills half-way through the images: the dump is
/// rolled back, the server runs on at A with its address and connection
/// (every byte), nothing is left on B (no address, no lock, no images), and
/// the error says what happened and where the process is.
#[test]
fn a_destination_that_runs_out_of_disk_leaves_the_server_running_at_the_source() {
    if !can_run() {
        return;
    }
    let disk = tempfile::tempdir().expect("mount point");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=512k", "roam-test-full"])
        .arg(disk.path())
        .status()
        .expect("mount");
    assert!(mounted.success(), "mount a small tmpfs");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(disk.path());
    let mut s = Setup::new("mig_full", Some(disk.path()));
    let source_images = tempfile::tempdir().expect("source images dir");
    let out = s.migrate(&["--images-dir", &source_images.path().display().to_string()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("No space left on device"),
        "names the cause: {stderr}"
    );
    assert!(
        stderr.contains("runs on here with its connections"),
        "says where the process is: {stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(disk.path())
        .expect("read the images disk")
        .collect();
    assert!(left.is_empty(), "B left images behind: {left:?}");
    let left: Vec<_> = std::fs::read_dir(source_images.path())
        .expect("read the source's images dir")
        .collect();
    assert!(left.is_empty(), "A left images behind: {left:?}");
    s.assert_still_at_source();
}

/// Refusals before anything is frozen: an unknown client key, and a
/// destination that already has the address. The server never stops.
#[test]
fn a_refused_move_freezes_nothing_and_says_why() {
    if !can_run() {
        return;
    }
    let s = Setup::new("mig_refuse", None);
    // A key B does not list.
    let stranger = tempfile::tempdir().expect("state dir");
    let mut cmd = roam_in(&s.lan, A, stranger.path());
    let out = cmd
        .arg("migrate-process")
        .arg(s.pid.to_string())
        .arg("--to")
        .arg(format!("{}:{ACCEPT_PORT}", s.lan.addr(B)))
        .output()
        .expect("roam migrate-process");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("refused our client key") && stderr.contains("nothing was moved"),
        "{stderr}"
    );
    // The destination is named as what it is, not as a relay.
    let named = format!(
        "the migrate-accept server at {}:{ACCEPT_PORT}",
        s.lan.addr(B)
    );
    assert!(
        stderr.contains(&named) && !stderr.contains("relay"),
        "{stderr}"
    );
    // Nothing listens on the port asked for.
    let mut cmd = roam_in(&s.lan, A, stranger.path());
    let out = cmd
        .arg("migrate-process")
        .arg(s.pid.to_string())
        .arg("--to")
        .arg(format!("{}:{}", s.lan.addr(B), ACCEPT_PORT + 1))
        .output()
        .expect("roam migrate-process");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let unreachable = format!(
        "cannot reach the migrate-accept server at {}:{}",
        s.lan.addr(B),
        ACCEPT_PORT + 1
    );
    assert!(
        stderr.contains(&unreachable)
            && stderr.contains("`roam migrate-accept` runs there")
            && stderr.contains("nothing was moved")
            && !stderr.contains("relay"),
        "{stderr}"
    );
    // B has the address already.
    let IpAddr::V4(service) = s.service else {
        unreachable!("an IPv4 service address")
    };
    s.lan.add_addr(B, service).expect("address on B");
    let out = s.migrate(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("already on this host") && stderr.contains("nothing was frozen"),
        "{stderr}"
    );
    // A process with no address of its own needs --address.
    let out = s.migrate(&["--address", "10.255.255.1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("not on any interface of this host"),
        "{stderr}"
    );
    assert!(s.runs_on(A, s.pid) && alive(s.pid));
    let at = s.echo().echoed();
    s.echo()
        .wait_echoed(at + (1 << 20), Duration::from_secs(10));
}

/// A destination in the source's own pid namespace (B's migrate-accept
/// started without a pid namespace of its own, on the same machine) could
/// not restore the process while its frozen original holds the pids: it
/// refuses at the offer, saying why and what to do, and nothing is frozen;
/// the server runs on at A.
#[test]
fn a_destination_sharing_the_sources_pid_namespace_is_refused_before_any_freeze() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("mig_pidns", None);
    let port = ACCEPT_PORT + 1;
    // Where a failed restore's logs would go, were it not refused.
    let images = tempfile::tempdir().expect("images dir");
    let mut cmd = s.lan.command(B, env!("CARGO_BIN_EXE_roam"));
    cmd.env("ROAM_STATE_DIR", s._dst_state.path())
        .arg("migrate-accept")
        .arg("--images-dir")
        .arg(images.path())
        .arg("--listen")
        .arg(format!("{}:{port}", s.lan.addr(B)))
        .arg("--authorized-keys")
        .arg(s._dst_state.path().join("migrate_keys"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut shared = ChildGuard::spawn(&mut cmd).expect("migrate-accept in our pid namespace");
    // Read to the end (a closed pipe would end it when it logs).
    let (tx, rx) = std::sync::mpsc::channel();
    let err = shared.child_mut().stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("[shared migrate-accept] {line}");
            let _ = tx.send(line);
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("migrate-accept said nothing");
    assert!(first.contains("listening on"), "{first}");
    let out = roam_in(&s.lan, A, s.src_state.path())
        .arg("migrate-process")
        .arg(s.pid.to_string())
        .arg("--to")
        .arg(format!("{}:{port}", s.lan.addr(B)))
        .output()
        .expect("roam migrate-process");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("shares the pid namespace")
            && stderr.contains("a pid namespace of its own")
            && stderr.contains("nothing was frozen"),
        "{stderr}"
    );
    drop(shared);
    assert!(s.runs_on(A, s.pid) && alive(s.pid), "the server left A");
    s.assert_still_at_source();
}

/// A destination that cannot restore (another program holds the server's
/// port there) after the images arrived, while the server is frozen at A:
/// the dump is rolled back and the server runs on at A — the same process,
/// never ended nor restored from images — with its address and connection,
/// every byte intact, and the error says what failed at B.
#[test]
fn a_restore_that_fails_at_the_destination_leaves_the_server_running_at_the_source() {
    if !can_run() {
        return;
    }
    let received = tempfile::tempdir().expect("B's images dir");
    let mut s = Setup::new("mig_back", Some(received.path()));
    let squatter = squat_port(&s);
    let started_before = started(s.pid);
    let out = s.migrate(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("could not restore it") && stderr.contains("Address already in use"),
        "names B's failure: {stderr}"
    );
    assert!(
        stderr.contains("was not moved and runs on here with its connections"),
        "says the server runs on here: {stderr}"
    );
    assert_eq!(
        started(s.pid),
        started_before,
        "the server at A is not the process that ran before the move"
    );
    s.assert_still_at_source();
    // The port free at B, the same server moves: the failed restore left
    // nothing there in its way (its processes reaped, their pids free).
    drop(squatter);
    let out = s.migrate(&[]);
    assert!(
        out.status.success(),
        "a move after a failed one: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.assert_moved_and_echoing();
}

/// When process `pid` started (`/proc/PID/stat`'s field 22, in clock
/// ticks since boot): a process CRIU restored has a new one.
fn started(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("process {pid}: {e}"));
    // The fields after the command's closing parenthesis, from field 3.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    rest.split_whitespace()
        .nth(22 - 3)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no start time in {stat}"))
}

/// Something else listening on the server's port on B (its restore there
/// fails), until dropped.
fn squat_port(s: &Setup) -> ChildGuard {
    let mut squatter = ChildGuard::spawn(
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", s.lan.ns(B)))
            .args(["--", "python3", "-c"])
            .arg(format!(
                "import socket, time\ns = socket.socket()\ns.bind(('0.0.0.0', {PORT}))\n\
                 s.listen()\nprint('up', flush=True)\ntime.sleep(600)"
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::piped()),
    )
    .expect("squatter");
    let mut up = String::new();
    BufReader::new(squatter.child_mut().stdout.take().expect("stdout"))
        .read_line(&mut up)
        .expect("squatter's line");
    assert_eq!(up.trim(), "up");
    squatter
}

/// Post-copy, a restore that fails at B (its port is taken there): A's
/// lazy dump is rolled back — its page server, which CRIU starts even
/// after a refused post-dump step, finds roam's end of its socket closed
/// and ends at once — and the server runs on at A with its address and
/// connection, every byte intact and its 96 MB of memory hashing as
/// before; the error says what failed at B.
#[test]
fn with_lazy_pages_a_restore_that_fails_at_the_destination_leaves_the_server_at_the_source() {
    if !can_run() {
        return;
    }
    let mut s = Setup::holding("mig_lazyback", None, 96);
    let _squatter = squat_port(&s);
    let out = s.migrate(&["--lazy-pages"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("runs on here with its connections")
            && stderr.contains("could not restore it"),
        "names B's failure: {stderr}"
    );
    s.assert_still_at_source();
    assert_eq!(memory_verdict(&s), "intact", "after the move called off");
}

/// SIGTERM while the images travel (the server holds 300 MB, so they take
/// a while): the move is called off, the dump rolled back, the server runs
/// on at A with its address and connection, every byte intact, no lock
/// left, and the command says so and exits 1.
#[test]
fn a_signal_while_the_images_travel_calls_the_move_off() {
    if !can_run() {
        return;
    }
    let received = tempfile::tempdir().expect("B's images dir");
    let mut s = Setup::holding("mig_signal", Some(received.path()), 300);
    let (mut child, mut err, mut seen) = s.migrate_until("sending");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).expect("stderr");
    seen.push_str(&rest);
    let status = child.wait().expect("wait");
    eprintln!("{seen}");
    assert_eq!(status.code(), Some(1), "{seen}");
    assert!(
        seen.contains("runs on here with its connections") && seen.contains("interrupted"),
        "{seen}"
    );
    wait_empty(received.path(), Duration::from_secs(5), "B kept the images");
    s.assert_still_at_source();
}

/// `roam migrate-process` killed outright (SIGKILL: no handler, no drop)
/// while the images travel, the server frozen inside CRIU's post-dump
/// step behind the address lock: CRIU, losing its RPC peer, lets the server
/// run on at A, and the lock ends with the killed process (its nftables
/// table is owned by the `nft` reading that process's pipe), so the server
/// serves its connection and new ones at A; B gives the move up and keeps
/// nothing. The killed command could not remove its images directory at A
/// (300 MB: the server's memory); the next move of the server, which then
/// succeeds, removes it and says so.
#[test]
fn a_source_killed_outright_while_the_images_travel_leaves_the_server_serving_at_the_source() {
    if !can_run() {
        return;
    }
    let received = tempfile::tempdir().expect("B's images dir");
    let mut s = Setup::holding("mig_skill", Some(received.path()), 300);
    let (mut child, _err, seen) = s.migrate_until("sending");
    assert!(
        s.has_lock(A),
        "the address is locked while the images travel"
    );
    child.kill().expect("SIGKILL migrate-process");
    let status = child.wait().expect("wait");
    eprintln!("{seen}\n{status}");
    wait_empty(
        received.path(),
        Duration::from_secs(20),
        "B kept the images",
    );
    s.assert_still_at_source();

    // What the killed command left at A: its images directory, named
    // after the server's pid.
    let prefix = format!("roam-migrate-{}-", s.pid);
    let left: Vec<PathBuf> = std::fs::read_dir(std::env::temp_dir())
        .expect("list the temporary directory")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    assert_eq!(left.len(), 1, "one images directory left at A: {left:?}");
    let bytes: u64 = std::fs::read_dir(&left[0])
        .expect("list it")
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    assert!(
        bytes > 100 << 20,
        "it holds the memory's images: {bytes} bytes"
    );
    // As if the next move came an hour later (a sweep leaves directories
    // younger than a minute alone).
    std::fs::File::open(&left[0])
        .expect("open it")
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .expect("backdate it");
    let out = s.migrate(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the next move: {stderr}");
    assert!(
        stderr.contains("removed 1 images directory") && !left[0].exists(),
        "the next move removes what the killed one left: {stderr}"
    );
    s.assert_moved_and_echoing();
}

/// redis-server with 1,000 clients, each INCR-ing a key of its own in a
/// loop (one command each per round, all clients per round), while redis
/// moves to B: every reply is the one expected — each client's counter
/// goes up by exactly one per command across the move, nothing lost,
/// nothing repeated — and the rounds go on at B. (Needs redis-server; CI
/// installs it.)
#[test]
fn redis_with_a_thousand_counting_clients_moves_without_a_lost_or_repeated_increment() {
    if !can_run_with("redis-server") {
        return;
    }
    const CLIENTS: usize = 1000;
    const REDIS_PORT: u16 = 6379;
    // 1,000 client sockets here and 1,000 descriptors in redis.
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .expect("getrlimit");
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard)
        .expect("setrlimit");
    let s = Setup::with_server("mig_redis", None, |lan, service| {
        let server = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", lan.ns(A)))
            .args([
                "--",
                "setsid",
                "redis-server",
                "--bind",
                "0.0.0.0",
                "--port",
            ])
            .arg(REDIS_PORT.to_string())
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--daemonize",
                "no",
                "--maxclients",
                "4000",
                "--dir",
                "/tmp",
                "--logfile",
                "",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let addr = SocketAddr::from((service, REDIS_PORT));
        wait_listening(lan, addr, "redis");
        (server, None)
    });
    let addr = SocketAddr::from((s.service, REDIS_PORT));
    let mut conns: Vec<BufReader<std::net::TcpStream>> = (0..CLIENTS)
        .map(|_| {
            let c = s
                .lan
                .tcp_connect(CLIENT, addr, Duration::from_secs(5))
                .expect("connect to redis");
            c.set_read_timeout(Some(Duration::from_secs(60)))
                .expect("timeout");
            c.set_nodelay(true).expect("nodelay");
            BufReader::new(c)
        })
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rounds = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let worker = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            use std::io::Write;
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (i, c) in conns.iter_mut().enumerate() {
                    c.get_mut()
                        .write_all(format!("INCR roam:{i}\r\n").as_bytes())
                        .map_err(|e| format!("client {i}, round {round}: write: {e}"))?;
                }
                for (i, c) in conns.iter_mut().enumerate() {
                    let mut line = String::new();
                    c.read_line(&mut line)
                        .map_err(|e| format!("client {i}, round {round}: read: {e}"))?;
                    let want = format!(":{}\r\n", round + 1);
                    if line != want {
                        return Err(format!(
                            "client {i}, round {round}: got {line:?}, expected {want:?}"
                        ));
                    }
                }
                round += 1;
                rounds.store(round, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(round)
        })
    };
    let wait_rounds = |n: u64, within: Duration| {
        let deadline = Instant::now() + within;
        while rounds.load(std::sync::atomic::Ordering::Relaxed) < n {
            assert!(
                Instant::now() < deadline && !worker.is_finished(),
                "only {} rounds",
                rounds.load(std::sync::atomic::Ordering::Relaxed)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_rounds(5, Duration::from_secs(60));
    let out = s.migrate(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("moved") && stdout.contains("(redis-server)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{} TCP connections", CLIENTS)),
        "every client's connection moved: {stdout}"
    );
    assert!(s.runs_on(B, s.pid), "redis is not on B");
    let at = rounds.load(std::sync::atomic::Ordering::Relaxed);
    wait_rounds(at + 10, Duration::from_secs(60));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let done = worker
        .join()
        .expect("worker")
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("redis: {CLIENTS} clients x {done} INCRs each, every reply in sequence");
}

/// The destination killed (SIGKILL) while 300 MB of images travel: the
/// source notices within seconds (the session to it is lost and does not
/// come back), calls the move off, and the server runs on at A with its
/// address and connection, every byte intact, no lock left.
#[test]
fn a_destination_killed_half_way_leaves_the_server_running_at_the_source() {
    if !can_run() {
        return;
    }
    let received = tempfile::tempdir().expect("B's images dir");
    let mut s = Setup::holding("mig_kill", Some(received.path()), 300);
    let (mut child, mut err, mut seen) = s.migrate_until("sending");
    let killed = Instant::now();
    s.accept
        .as_ref()
        .expect("migrate-accept")
        .signal(nix::sys::signal::Signal::SIGKILL)
        .expect("kill migrate-accept");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).expect("stderr");
    seen.push_str(&rest);
    let status = child.wait().expect("wait");
    let noticed = killed.elapsed();
    eprintln!("{seen}");
    assert_eq!(status.code(), Some(1), "{seen}");
    assert!(
        seen.contains("runs on here with its connections") && seen.contains("unreachable"),
        "{seen}"
    );
    assert!(
        noticed < Duration::from_secs(20),
        "the source took {noticed:?} to give up on a dead destination"
    );
    s.assert_still_at_source();
    eprintln!("a dead destination noticed in {noticed:?}");
}

/// `roam migrate-accept` killed outright (SIGKILL: nothing undone) after it
/// put the service address on B, before the move is committed: B's
/// address goes with its lease (3 s, renewed only while migrate-accept
/// lives) instead of staying beside A's for good, and the server, its dump
/// rolled back, serves its connection and new ones at A. The hook: A is
/// stopped (SIGSTOP) as it says the images are sent, so that the move
/// cannot be committed, B's address is waited for, B killed, A continued.
/// (Before the lease the address stayed at B: this failed at "B kept the
/// address".)
#[test]
fn a_destination_killed_outright_after_adding_the_address_leaves_it_at_the_source_alone() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    if !can_run() {
        return;
    }
    let received = tempfile::tempdir().expect("B's images dir");
    let mut s = Setup::holding("mig_lease", Some(received.path()), 300);
    let (mut child, mut err, mut seen) = s.migrate_until("images sent");
    let source = Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    kill(source, Signal::SIGSTOP).expect("stop migrate-process");
    // B adds the address as it says the images are stored; its lease is
    // renewed while it waits for A (which it gives up on after 2 s).
    let deadline = Instant::now() + Duration::from_secs(1);
    while !s.has_service(B) {
        assert!(Instant::now() < deadline, "B never added the address");
        std::thread::sleep(Duration::from_millis(5));
    }
    s.accept
        .as_ref()
        .expect("migrate-accept")
        .signal(Signal::SIGKILL)
        .expect("kill migrate-accept");
    let killed = Instant::now();
    kill(source, Signal::SIGCONT).expect("continue migrate-process");
    // Gone within the lease, the kernel's check of lifetimes and a margin.
    let bound = Duration::from_secs(3 + 3);
    while s.has_service(B) {
        assert!(
            killed.elapsed() < bound,
            "B kept the address {:?} after migrate-accept was killed",
            killed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let gone = killed.elapsed();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).expect("stderr");
    seen.push_str(&rest);
    let status = child.wait().expect("wait");
    eprintln!("{seen}");
    assert_eq!(status.code(), Some(1), "{seen}");
    assert!(seen.contains("runs on here with its connections"), "{seen}");
    s.assert_still_at_source();
    eprintln!("B's address went {gone:?} after migrate-accept was killed");
}

/// nginx (a master and two workers: a process tree) serving 100 concurrent
/// downloads of a 16 MiB file to slow readers moves to B in the middle of
/// them: every download completes, each body's SHA-256 is the file's, and
/// nginx serves new requests at B. (Needs nginx; CI installs it.)
#[test]
fn nginx_moves_in_the_middle_of_a_hundred_downloads_each_arriving_whole() {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    if !can_run_with("nginx") {
        return;
    }
    const DOWNLOADS: usize = 100;
    const SIZE: usize = 16 << 20;
    const HTTP_PORT: u16 = 8080;
    let site = tempfile::tempdir().expect("nginx prefix");
    // A file no two 8-byte words of which are alike: a shifted or repeated
    // piece would change the digest.
    let body: Vec<u8> = (0..SIZE as u64 / 8)
        .flat_map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).to_le_bytes())
        .collect();
    let want = Sha256::digest(&body);
    std::fs::create_dir(site.path().join("html")).expect("html dir");
    std::fs::write(site.path().join("html/big.bin"), &body).expect("the file");
    drop(body);
    let s = Setup::with_server("mig_nginx", None, |lan, service| {
        let conf = site.path().join("nginx.conf");
        std::fs::write(
            &conf,
            format!(
                "user root root;\nworker_processes 2;\npid {prefix}/nginx.pid;\n\
                 error_log {prefix}/error.log;\n\
                 events {{ worker_connections 1024; }}\n\
                 http {{\n  access_log off;\n  sendfile on;\n\
                 \x20 client_body_temp_path {prefix}/tmp;\n\
                 \x20 server {{\n    listen {service}:{HTTP_PORT};\n\
                 \x20   root {prefix}/html;\n  }}\n}}\n",
                prefix = site.path().display()
            ),
        )
        .expect("nginx.conf");
        let server = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", lan.ns(A)))
            .args(["--", "setsid", "nginx", "-g", "daemon off;", "-c"])
            .arg(&conf)
            .arg("-p")
            .arg(site.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nginx");
        let addr = SocketAddr::from((service, HTTP_PORT));
        wait_listening(lan, addr, "nginx");
        (server, None)
    });
    let addr = SocketAddr::from((s.service, HTTP_PORT));
    // Each download reads 32 KiB every 16 ms (~2 MB/s): 16 MiB take ~8 s.
    let progress = Arc::new(AtomicUsize::new(0));
    let downloads: Vec<_> = (0..DOWNLOADS)
        .map(|i| {
            let mut c = s
                .lan
                .tcp_connect(CLIENT, addr, Duration::from_secs(5))
                .expect("connect to nginx");
            c.set_read_timeout(Some(Duration::from_secs(60)))
                .expect("timeout");
            let progress = progress.clone();
            std::thread::spawn(move || -> Result<(usize, Vec<u8>), String> {
                c.write_all(b"GET /big.bin HTTP/1.1\r\nHost: roam\r\nConnection: close\r\n\r\n")
                    .map_err(|e| format!("download {i}: request: {e}"))?;
                let mut all = Vec::with_capacity(SIZE + 1024);
                let mut buf = vec![0u8; 32 << 10];
                let mut counted = false;
                loop {
                    let n = c
                        .read(&mut buf)
                        .map_err(|e| format!("download {i}: read at {}: {e}", all.len()))?;
                    if n == 0 {
                        break;
                    }
                    all.extend_from_slice(&buf[..n]);
                    if !counted && all.len() >= 1 << 20 {
                        counted = true;
                        progress.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(16));
                }
                let head = all
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .ok_or_else(|| format!("download {i}: no header in {} bytes", all.len()))?;
                if !all.starts_with(b"HTTP/1.1 200") {
                    return Err(format!(
                        "download {i}: {:?}",
                        String::from_utf8_lossy(&all[..head])
                    ));
                }
                Ok((i, all.split_off(head + 4)))
            })
        })
        .collect();
    // Every download under way (1 MiB in, ~15 to go) before the move.
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress.load(Ordering::Relaxed) < DOWNLOADS {
        assert!(Instant::now() < deadline, "the downloads never got going");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = s.migrate(&[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("moved") && stdout.contains("(nginx)"),
        "{stdout}"
    );
    assert!(s.runs_on(B, s.pid), "nginx is not on B");
    let mut whole = 0;
    for d in downloads {
        let (i, got) = d
            .join()
            .expect("download thread")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.len(), SIZE, "download {i}: body length");
        assert!(
            Sha256::digest(&got) == want,
            "download {i}: the body differs from the file"
        );
        whole += 1;
    }
    // And a new download, at B.
    let mut c = s
        .lan
        .tcp_connect(CLIENT, addr, Duration::from_secs(5))
        .expect("connect to nginx at B");
    c.write_all(b"HEAD /big.bin HTTP/1.1\r\nHost: roam\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut head = String::new();
    c.read_to_string(&mut head).expect("response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    eprintln!("nginx: {whole} of {DOWNLOADS} downloads of {SIZE} bytes whole across the move");
}
