//! Harness shared by the `faults_*` tests: deterministic byte streams with
//! verification, child processes killed on drop, a watchdog bounding each
//! test, a target server behind the relay, and helpers that start `roam serve`
//! and `roam pipe` (on the loopback or inside a network namespace).
//!
//! Every stream is checked byte for byte (and by SHA-256) and must end exactly
//! where it should: nothing lost, nothing duplicated, nothing reordered.

// Each test binary uses a different subset of this module.
#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The `roam` binary under test: `ROAM_BIN` if set, else the one cargo built
/// for this test run.
pub(crate) fn roam_bin() -> PathBuf {
    std::env::var_os("ROAM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_roam")))
}

/// Megabytes each way for the bulk transfers (`ROAM_FAULT_MB`, default `default`).
pub(crate) fn megabytes(default: u64) -> u64 {
    std::env::var("ROAM_FAULT_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Byte `i` of the test stream `seed`: a splitmix64 of the 8-byte block index.
/// Any offset can be generated, so writers and verifiers agree regardless of
/// how the stream was chunked.
pub(crate) fn pattern_fill(seed: u64, offset: u64, buf: &mut [u8]) {
    for (k, b) in buf.iter_mut().enumerate() {
        let i = offset + k as u64;
        let mut z = (seed ^ 0x9e37_79b9_7f4a_7c15)
            .wrapping_add((i / 8).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        *b = (z >> (8 * (i % 8))) as u8;
    }
}

/// sha256 of the first `len` bytes of stream `seed`.
pub(crate) fn pattern_sha256(seed: u64, len: u64) -> String {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        pattern_fill(seed, off, &mut buf[..n]);
        h.update(&buf[..n]);
        off += n as u64;
    }
    hex(&h.finalize())
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes moved so far in one direction, watched by the test to time faults.
#[derive(Clone, Default)]
pub(crate) struct Progress(pub Arc<AtomicU64>);

impl Progress {
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Waits until at least `n` bytes moved; false on timeout.
    pub(crate) fn wait_for(&self, n: u64, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while self.get() < n {
            if Instant::now() > end {
                return false;
            }
            thread::sleep(Duration::from_millis(5));
        }
        true
    }
    /// Waits until more than `than` bytes moved; returns how long it took.
    pub(crate) fn wait_beyond(&self, than: u64, timeout: Duration) -> Option<Duration> {
        let t0 = Instant::now();
        self.wait_for(than + 1, timeout).then(|| t0.elapsed())
    }
}

/// Writes `len` bytes of stream `seed` to `w`, at most `rate` bytes/s if
/// given, then closes the writer (by dropping it). Returns the sha256 written.
pub(crate) fn send_pattern(
    mut w: impl Write,
    seed: u64,
    len: u64,
    rate: Option<u64>,
    progress: Progress,
) -> io::Result<String> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 15];
    let t0 = Instant::now();
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        pattern_fill(seed, off, &mut buf[..n]);
        w.write_all(&buf[..n])?;
        h.update(&buf[..n]);
        off += n as u64;
        progress.0.store(off, Ordering::Relaxed);
        if let Some(rate) = rate {
            let due = t0 + Duration::from_secs_f64(off as f64 / rate as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
        }
    }
    w.flush()?;
    Ok(hex(&h.finalize()))
}

/// Reads stream `seed` from `r`: exactly `len` bytes, each equal to the
/// pattern, then end of stream. Returns the sha256 read, or where it went wrong.
pub(crate) fn verify_pattern(
    mut r: impl Read,
    seed: u64,
    len: u64,
    progress: Progress,
) -> Result<String, String> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut want = vec![0u8; 1 << 16];
    let mut off = 0u64;
    while off < len {
        let cap = (len - off).min(buf.len() as u64) as usize;
        let n = match r.read(&mut buf[..cap]) {
            Ok(0) => {
                return Err(format!(
                    "stream {seed}: end of stream after {off} of {len} bytes"
                ))
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(format!(
                    "stream {seed}: read error after {off} of {len} bytes: {e}"
                ))
            }
        };
        pattern_fill(seed, off, &mut want[..n]);
        if buf[..n] != want[..n] {
            let k = buf[..n]
                .iter()
                .zip(&want[..n])
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(format!(
                "stream {seed}: wrong byte at offset {} (got {:#04x}, want {:#04x})",
                off + k as u64,
                buf[k],
                want[k]
            ));
        }
        h.update(&buf[..n]);
        off += n as u64;
        progress.0.store(off, Ordering::Relaxed);
    }
    // Exactly once: nothing may follow.
    match r.read(&mut buf[..1]) {
        Ok(0) => Ok(hex(&h.finalize())),
        Ok(_) => Err(format!(
            "stream {seed}: extra bytes after the expected {len}"
        )),
        Err(e) => Err(format!(
            "stream {seed}: error instead of end of stream: {e}"
        )),
    }
}

/// A process that is killed (and reaped) on drop, with its stderr collected.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Spawns `cmd` with stderr captured (and echoed with a `[name]` prefix
    /// when `ROAM_FAULT_VERBOSE` is set).
    pub(crate) fn spawn(name: &str, cmd: &mut Command) -> Proc {
        cmd.stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("piped");
        let (log2, tag) = (log.clone(), name.to_string());
        let verbose = std::env::var_os("ROAM_FAULT_VERBOSE").is_some();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if verbose {
                    eprintln!("[{tag}] {line}");
                }
                log2.lock().unwrap().push(line);
            }
        });
        Proc {
            name: name.into(),
            child,
            log,
        }
    }
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
    /// Waits up to `timeout` for the process to exit by itself.
    pub(crate) fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() > end {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if thread::panicking() {
            eprintln!(
                "---- stderr of {} ----\n{}\n---- end of {} ----",
                self.name,
                self.log(),
                self.name
            );
        }
    }
}

/// Kills the registered processes if the test is still running after its
/// time limit, so every blocking read in the test ends and the test fails
/// instead of hanging.
pub(crate) struct Watchdog {
    done: Arc<AtomicBool>,
    pids: Arc<Mutex<Vec<u32>>>,
}

impl Watchdog {
    pub(crate) fn new(test: &'static str, limit: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let pids: Arc<Mutex<Vec<u32>>> = Arc::default();
        let (d, p) = (done.clone(), pids.clone());
        thread::spawn(move || {
            let end = Instant::now() + limit;
            while Instant::now() < end {
                if d.load(Ordering::Relaxed) {
                    return;
                }
                thread::sleep(Duration::from_millis(100));
            }
            eprintln!("WATCHDOG: {test} still running after {limit:?}; killing its processes");
            for pid in p.lock().unwrap().iter() {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        });
        Watchdog { done, pids }
    }
    pub(crate) fn watch(&self, p: &Proc) {
        self.pids.lock().unwrap().push(p.pid());
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
    }
}

/// The target behind the relay: accepts connections on `listener`; on the
/// first, reads and verifies stream `up_seed` while writing stream
/// `down_seed` (paced at `rate`). Counts connections: a session that survived
/// its faults reaches the target over exactly one.
pub(crate) struct Target {
    pub(crate) accepted: Arc<AtomicU64>,
    /// Bytes of the client's stream verified at the target.
    pub(crate) up: Progress,
    /// Bytes of the target's stream written.
    pub(crate) down: Progress,
    /// (sha256 received, sha256 sent), or what went wrong.
    pub(crate) result: thread::JoinHandle<Result<(String, String), String>>,
}

impl Target {
    /// With `half_close_early`, the target shuts down its sending side as
    /// soon as it has sent everything, while still receiving (TCP half-close);
    /// otherwise only once it has also received everything.
    pub(crate) fn start(
        listener: TcpListener,
        up_seed: u64,
        down_seed: u64,
        len: u64,
        rate: Option<u64>,
        half_close_early: bool,
    ) -> Target {
        let accepted = Arc::new(AtomicU64::new(0));
        let (up, down) = (Progress::default(), Progress::default());
        let (acc, up2, down2) = (accepted.clone(), up.clone(), down.clone());
        let result = thread::spawn(move || {
            let sock = accept_within(&listener, TARGET_ACCEPT_WAIT)?;
            // Longer than any outage a test makes: a stuck relay fails the
            // test instead of hanging it.
            sock.set_read_timeout(Some(TARGET_IDLE_LIMIT))
                .map_err(|e| e.to_string())?;
            sock.set_write_timeout(Some(TARGET_IDLE_LIMIT))
                .map_err(|e| e.to_string())?;
            acc.fetch_add(1, Ordering::Relaxed);
            // Count (and refuse) any further connection: there should be none.
            let acc2 = acc.clone();
            thread::spawn(move || {
                while let Ok(s) = accept_within(&listener, TARGET_ACCEPT_WAIT) {
                    acc2.fetch_add(1, Ordering::Relaxed);
                    drop(s);
                }
            });
            let w = sock.try_clone().map_err(|e| e.to_string())?;
            let (received_tx, received_rx) = std::sync::mpsc::channel::<()>();
            let writer = thread::spawn(move || {
                let sha = send_pattern(&w, down_seed, len, rate, down2)
                    .map_err(|e| format!("target write: {e}"))?;
                if !half_close_early {
                    // Sender dropped (reader done or failed) also ends the wait.
                    let _ = received_rx.recv();
                }
                w.shutdown(std::net::Shutdown::Write)
                    .map_err(|e| format!("target shutdown: {e}"))?;
                Ok::<_, String>(sha)
            });
            let got = verify_pattern(&sock, up_seed, len, up2);
            drop(received_tx);
            let sent = writer
                .join()
                .map_err(|_| "target writer panicked".to_string())?;
            Ok((got?, sent?))
        });
        Target {
            accepted,
            up,
            down,
            result,
        }
    }
    pub(crate) fn connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

/// How long a target waits for the relay's connection.
pub(crate) const TARGET_ACCEPT_WAIT: Duration = Duration::from_secs(120);
/// A target gives up on a connection idle this long.
pub(crate) const TARGET_IDLE_LIMIT: Duration = Duration::from_secs(120);

/// Accepts one connection, or fails after `wait` (so no thread blocks forever).
pub(crate) fn accept_within(listener: &TcpListener, wait: Duration) -> Result<TcpStream, String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let end = Instant::now() + wait;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < end => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(format!("target: no connection within {wait:?}"));
            }
            Err(e) => return Err(format!("target accept: {e}")),
        }
    }
}

/// Polls `ready` until true or `timeout`.
pub(crate) fn wait_until(timeout: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if ready() {
            return true;
        }
        thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Waits until something accepts TCP connections at `addr` (from this namespace).
pub(crate) fn wait_listening(addr: SocketAddr, timeout: Duration) -> bool {
    wait_until(timeout, || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
    })
}

/// Seeds of the two bulk streams.
pub(crate) const UP_SEED: u64 = 0x5eed_0001;
pub(crate) const DOWN_SEED: u64 = 0x5eed_0002;

/// Where a process runs: this namespace, or one side of a pair.
pub(crate) type Place<'a> = Option<(&'a roam_sim::netns::NetPair, roam_sim::netns::Side)>;

/// A command for the roam binary at `place`, with its own state directory.
pub(crate) fn roam_command(place: Place<'_>, state: &std::path::Path) -> Command {
    let mut c = match place {
        Some((pair, side)) => pair.command(side, roam_bin()),
        None => Command::new(roam_bin()),
    };
    c.env("ROAM_STATE_DIR", state).stdin(Stdio::null());
    // `ROAM_FAULT_RUST_LOG=debug` turns up the children's logging (see
    // `ROAM_FAULT_VERBOSE` to echo it); an inherited RUST_LOG is ignored.
    match std::env::var_os("ROAM_FAULT_RUST_LOG") {
        Some(level) => c.env("RUST_LOG", level),
        None => c.env_remove("RUST_LOG"),
    };
    c
}

/// Starts `roam serve -v` listening on `listen`, allowing `allow`, plus
/// `extra` arguments; returns it and the address it reports listening on.
pub(crate) fn start_relay(
    place: Place<'_>,
    dir: &std::path::Path,
    listen: &str,
    allow: &str,
    extra: &[&str],
) -> (Proc, SocketAddr) {
    let mut c = roam_command(place, &dir.join("relay-state"));
    c.args(["serve", "-v", "--listen", listen, "--allow", allow, "--key"])
        .arg(dir.join("server.key"))
        .args(extra)
        .stdout(Stdio::null());
    let relay = Proc::spawn("serve", &mut c);
    let mut addr = None;
    let ok = wait_until(Duration::from_secs(20), || {
        let log = relay.log();
        addr = log
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split(';').next())
            .and_then(|a| a.trim().parse().ok());
        addr.is_some()
    });
    assert!(
        ok,
        "roam serve did not report listening; stderr:\n{}",
        relay.log()
    );
    (relay, addr.expect("checked"))
}

/// Starts `roam pipe --no-fallback RELAY TARGET` with stdin and stdout piped.
pub(crate) fn start_pipe(
    place: Place<'_>,
    dir: &std::path::Path,
    relay: &str,
    target: &str,
) -> Proc {
    let mut c = roam_command(place, &dir.join("client-state"));
    c.args(["pipe", "-v", "--no-fallback", relay, target])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    Proc::spawn("pipe", &mut c)
}

/// Pumps stream `UP_SEED` into the pipe's stdin (closing it at the end) and
/// verifies stream `DOWN_SEED` from its stdout, on two threads. Returns the
/// client-side progress counters (sent, received) and the joined results.
pub(crate) struct ClientTransfer {
    pub(crate) sent: Progress,
    pub(crate) received: Progress,
    writer: thread::JoinHandle<io::Result<String>>,
    reader: thread::JoinHandle<Result<String, String>>,
}

impl ClientTransfer {
    pub(crate) fn start(pipe: &mut Proc, len: u64, rate: Option<u64>) -> ClientTransfer {
        let stdin = pipe.child.stdin.take().expect("piped stdin");
        let stdout = pipe.child.stdout.take().expect("piped stdout");
        let (sent, received) = (Progress::default(), Progress::default());
        let (s2, r2) = (sent.clone(), received.clone());
        let writer = thread::spawn(move || send_pattern(stdin, UP_SEED, len, rate, s2));
        let reader = thread::spawn(move || verify_pattern(stdout, DOWN_SEED, len, r2));
        ClientTransfer {
            sent,
            received,
            writer,
            reader,
        }
    }
    /// (sha256 sent, sha256 received).
    pub(crate) fn finish(self) -> (Result<String, String>, Result<String, String>) {
        let w = self
            .writer
            .join()
            .expect("writer thread")
            .map_err(|e| format!("writing to roam pipe: {e}"));
        let r = self.reader.join().expect("reader thread");
        (w, r)
    }
}

/// Checks both directions of a bulk transfer of `len` bytes each way.
pub(crate) fn check_bulk(client: ClientTransfer, target: Target, len: u64) {
    let (sent_up, got_down) = client.finish();
    let target_result = target.result.join().expect("target thread");
    let want_up = pattern_sha256(UP_SEED, len);
    let want_down = pattern_sha256(DOWN_SEED, len);
    let sent_up = sent_up.expect("client side, sending");
    let got_down = got_down.expect("client side, receiving");
    let (got_up, sent_down) = target_result.expect("target side");
    assert_eq!(sent_up, want_up);
    assert_eq!(sent_down, want_down);
    assert_eq!(got_up, want_up, "client->target stream differs");
    assert_eq!(got_down, want_down, "target->client stream differs");
    eprintln!("verified {len} bytes each way: up sha256 {got_up}, down sha256 {got_down}");
    let conns = target.accepted.load(Ordering::Relaxed);
    assert_eq!(
        conns, 1,
        "the relay connected to the target {conns} times: the session did not survive as one"
    );
}

/// `Some(reason)` when this test must skip (not root, no netns support).
pub(crate) fn netns_skip_reason() -> Option<String> {
    roam_sim::netns::available().err()
}

/// Times how long a session takes to come back after a fault ends: until the
/// client logs a resume, and until bytes flow again each way.
pub(crate) struct Resumption {
    start: Instant,
    log_lines: usize,
    down0: u64,
    up0: Option<u64>,
}

/// What [`Resumption::wait`] measured (`None`: not within the limit).
#[derive(Debug)]
pub(crate) struct Resumed {
    /// Until the client logged "resumed".
    pub(crate) session: Option<Duration>,
    /// Until the client received more.
    pub(crate) down: Option<Duration>,
    /// Until the target received more (outer `None`: not tracked).
    pub(crate) up: Option<Option<Duration>>,
}

impl std::fmt::Display for Resumed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Option<Duration>| {
            d.map_or("never".to_string(), |d| format!("{} ms", d.as_millis()))
        };
        write!(
            f,
            "session resumed after {}, bytes flowing to the client after {}",
            ms(self.session),
            ms(self.down)
        )?;
        if let Some(up) = self.up {
            write!(f, ", to the target after {}", ms(up))?;
        }
        Ok(())
    }
}

impl Resumption {
    /// Starts the clock now. `client_log` is the process whose stderr
    /// carries roam's client log (the pipe, or ssh running it); `up` is
    /// tracked if given.
    pub(crate) fn start(client_log: &Proc, down: &Progress, up: Option<&Progress>) -> Resumption {
        Resumption {
            start: Instant::now(),
            log_lines: client_log.log.lock().unwrap().len(),
            down0: down.get(),
            up0: up.map(Progress::get),
        }
    }

    /// Waits (at most `limit`) until all of it happened.
    pub(crate) fn wait(
        &self,
        client_log: &Proc,
        down: &Progress,
        up: Option<&Progress>,
        limit: Duration,
    ) -> Resumed {
        let mut r = Resumed {
            session: None,
            down: None,
            up: self.up0.map(|_| None),
        };
        let done = |r: &Resumed| {
            r.session.is_some() && r.down.is_some() && r.up.is_none_or(|u| u.is_some())
        };
        while self.start.elapsed() < limit && !done(&r) {
            let now = self.start.elapsed();
            if r.session.is_none()
                && client_log.log.lock().unwrap()[self.log_lines..]
                    .iter()
                    .any(|l| l.contains(" resumed "))
            {
                r.session = Some(now);
            }
            if r.down.is_none() && down.get() > self.down0 {
                r.down = Some(now);
            }
            if let (Some(None), Some(up), Some(up0)) = (r.up, up, self.up0) {
                if up.get() > up0 {
                    r.up = Some(Some(now));
                }
            }
            thread::sleep(Duration::from_millis(2));
        }
        r
    }
}
