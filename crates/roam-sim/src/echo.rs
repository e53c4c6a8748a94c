//! A real echo server for tests that move processes (CRIU, `roam
//! migrate-process`), and a client that checks every byte through it.
//!
//! The server is an unmodified Python program in a network namespace; the
//! client streams 64-bit sequence numbers and checks that each one comes
//! back once and in order, across whatever the test does to the server.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

/// The echo server: over TCP one connection at a time, every byte sent
/// back; over UDP (same port, a thread of its own) every datagram sent back
/// to its sender. Arguments: the port, optionally megabytes of memory to
/// hold (random bytes, so that a checkpoint has to copy them), and
/// optionally `6` to serve on IPv6 (`::`) instead of IPv4. The
/// datagram `roam:check-memory` is answered `intact` while that memory
/// still hashes as it did at start, else `CORRUPT` (a restore that lost or
/// zeroed a page).
pub const ECHO_SERVER: &str = r#"
import hashlib, os, socket, sys, threading
ballast = os.urandom(int(sys.argv[2]) << 20) if len(sys.argv) > 2 else b""
digest = hashlib.sha256(ballast).digest()
v6 = len(sys.argv) > 3 and sys.argv[3] == "6"
fam, anyaddr = (socket.AF_INET6, "::") if v6 else (socket.AF_INET, "0.0.0.0")
def udp():
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.bind((anyaddr, int(sys.argv[1])))
    while True:
        d, a = u.recvfrom(65536)
        if d == b"roam:check-memory":
            d = b"intact" if hashlib.sha256(ballast).digest() == digest else b"CORRUPT"
        u.sendto(d, a)
threading.Thread(target=udp, daemon=True).start()
s = socket.socket(fam)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((anyaddr, int(sys.argv[1])))
s.listen(8)
while True:
    c, _ = s.accept()
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d)
    c.close()
"#;

/// Starts the echo server on `port` in namespace `ns`, in a session of its own with its
/// stdio on /dev/null (so CRIU dumps it alone), and waits until `connect`
/// reaches it. Returns it: this test process is its parent, so it must be
/// reaped for its pid to be free for a restore. The namespace's owner (a
/// `NetPair` or `Lan`) kills it when dropped.
pub fn start_echo(ns: &str, port: u16, connect: impl Fn() -> std::io::Result<TcpStream>) -> Child {
    start_echo_holding(ns, port, 0, connect)
}

/// [`start_echo`], the server holding `ballast_mb` megabytes of written
/// memory.
pub fn start_echo_holding(
    ns: &str,
    port: u16,
    ballast_mb: u32,
    connect: impl Fn() -> std::io::Result<TcpStream>,
) -> Child {
    start_echo_family(ns, port, ballast_mb, false, connect)
}

/// [`start_echo_holding`], serving on IPv6 (`::`, TCP and UDP) when `v6`.
pub fn start_echo_family(
    ns: &str,
    port: u16,
    ballast_mb: u32,
    v6: bool,
    connect: impl Fn() -> std::io::Result<TcpStream>,
) -> Child {
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .args(["--", "setsid", "python3", "-c", ECHO_SERVER])
        .arg(port.to_string())
        .arg(ballast_mb.to_string())
        .arg(if v6 { "6" } else { "4" })
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the echo server");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match connect() {
            Ok(probe) => {
                drop(probe);
                break;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "echo server never listened: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
    // Let the server finish with the probe and return to accept().
    thread::sleep(Duration::from_millis(100));
    child
}

/// A client streaming 64-bit sequence numbers through the echo server and
/// checking each one that comes back.
pub struct EchoStream {
    /// Bytes echoed back and verified so far.
    pub echoed: Arc<AtomicU64>,
    /// The longest wait between two reads so far, in microseconds: the
    /// pause the client saw.
    longest_gap: Arc<AtomicU64>,
    /// Tells the writer to stop.
    stop: Arc<AtomicBool>,
    /// The writer: bytes it sent.
    writer: thread::JoinHandle<u64>,
    /// The reader: bytes it verified, or the first wrong one.
    reader: thread::JoinHandle<Result<u64, String>>,
}

impl EchoStream {
    /// Starts writing and checking on `sock`.
    pub fn start(sock: TcpStream) -> EchoStream {
        let echoed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut w = sock.try_clone().expect("clone socket");
        let mut r = sock;
        r.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("read timeout");
        let writer = {
            let stop = stop.clone();
            thread::spawn(move || {
                let mut sent = 0u64;
                let mut next = 0u64;
                let mut buf = Vec::with_capacity(8192);
                while !stop.load(Ordering::Relaxed) {
                    buf.clear();
                    for _ in 0..1024 {
                        buf.extend_from_slice(&next.to_le_bytes());
                        next += 1;
                    }
                    if w.write_all(&buf).is_err() {
                        break;
                    }
                    sent += buf.len() as u64;
                }
                let _ = w.shutdown(Shutdown::Write);
                sent
            })
        };
        let longest_gap = Arc::new(AtomicU64::new(0));
        let reader = {
            let echoed = echoed.clone();
            let longest_gap = longest_gap.clone();
            thread::spawn(move || {
                let mut last = Instant::now();
                let mut expect = 0u64;
                let mut word = [0u8; 8];
                let mut have = 0usize;
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = match r.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) => return Err(format!("read after {expect} words: {e}")),
                    };
                    let gap = u64::try_from(last.elapsed().as_micros()).unwrap_or(u64::MAX);
                    longest_gap.fetch_max(gap, Ordering::Relaxed);
                    last = Instant::now();
                    for &b in &buf[..n] {
                        word[have] = b;
                        have += 1;
                        if have == 8 {
                            let got = u64::from_le_bytes(word);
                            if got != expect {
                                return Err(format!("word {expect} came back as {got}"));
                            }
                            expect += 1;
                            have = 0;
                        }
                    }
                    echoed.fetch_add(n as u64, Ordering::Relaxed);
                }
                if have != 0 {
                    return Err(format!("a partial word after {expect} words"));
                }
                Ok(expect * 8)
            })
        };
        EchoStream {
            echoed,
            longest_gap,
            stop,
            writer,
            reader,
        }
    }

    /// Waits until `n` bytes have been echoed.
    pub fn wait_echoed(&self, n: u64, within: Duration) {
        assert!(
            self.echoed_within(n, within),
            "only {} of {n} bytes echoed within {within:?}",
            self.echoed.load(Ordering::Relaxed)
        );
    }

    /// Whether `n` bytes have been echoed within `within` (for a caller
    /// that says more about a failure than [`EchoStream::wait_echoed`]).
    pub fn echoed_within(&self, n: u64, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while self.echoed.load(Ordering::Relaxed) < n {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Stops writing, waits for the last echo, and returns (sent, echoed).
    pub fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self.writer.join().expect("writer");
        let echoed = self
            .reader
            .join()
            .expect("reader")
            .unwrap_or_else(|e| panic!("echo stream broken: {e}"));
        (sent, echoed)
    }

    /// The longest pause between two reads so far: what the client saw of
    /// a freeze.
    pub fn longest_gap(&self) -> Duration {
        Duration::from_micros(self.longest_gap.load(Ordering::Relaxed))
    }

    /// Forgets the pauses seen so far (to measure from now on).
    pub fn reset_gap(&self) {
        self.longest_gap.store(0, Ordering::Relaxed);
    }

    /// Bytes echoed back and verified so far.
    pub fn echoed(&self) -> u64 {
        self.echoed.load(Ordering::Relaxed)
    }
}

/// Whether `pid` runs (a zombie counts as gone).
pub fn alive(pid: i32) -> bool {
    // A zombie still has /proc/PID: count it as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// A UDP client of the echo server: numbered requests, each resent every
/// 100 ms until its own answer comes back.
pub struct UdpEcho {
    /// The client's socket (made in the client's namespace).
    sock: std::net::UdpSocket,
    /// The server.
    to: std::net::SocketAddr,
    /// The next request's number.
    next: u64,
}

impl UdpEcho {
    /// A client of `to` on `sock`.
    pub fn new(sock: std::net::UdpSocket, to: std::net::SocketAddr) -> UdpEcho {
        UdpEcho { sock, to, next: 0 }
    }

    /// Sends `n` requests one after another, each until answered (at most
    /// `within` for all); returns how many sends it took.
    pub fn rounds(&mut self, n: u64, within: Duration) -> Result<u64, String> {
        let deadline = Instant::now() + within;
        let mut sends = 0;
        self.sock
            .set_read_timeout(Some(Duration::from_millis(100)))
            .map_err(|e| e.to_string())?;
        for _ in 0..n {
            let want = self.next.to_le_bytes();
            self.next += 1;
            'answered: loop {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "request {} unanswered within {within:?}",
                        self.next - 1
                    ));
                }
                self.sock
                    .send_to(&want, self.to)
                    .map_err(|e| format!("send: {e}"))?;
                sends += 1;
                let sent = Instant::now();
                let mut buf = [0u8; 64];
                while sent.elapsed() < Duration::from_millis(100) {
                    match self.sock.recv(&mut buf) {
                        Ok(8) if buf[..8] == want => break 'answered,
                        // An answer to an earlier send of an earlier request.
                        Ok(_) => continue,
                        Err(_) => break,
                    }
                }
            }
        }
        Ok(sends)
    }
}
