//! Scenario 10: a running process moves to another host with its
//! connections and its address — the engine of issue 12 (CRIU through
//! `roam-criu`), measured against the number of connections and the memory
//! the process holds, as the paper's figures are (Live migration of many
//! connections: freezes under 200 ms at 1 GB).
//!
//! Per case (`n` connections, `m` MB): three network namespaces on one
//! bridged segment (roam-sim's `Lan`): the client host, host A and host B.
//! On A a Python server holds `m` MB of touched memory and echoes on every
//! connection; this process opens `n` connections to its service address
//! from the client host. One of them is the probe: it sends one byte and
//! waits for its echo, again and again, timing each round trip. Then the
//! server moves: CRIU dumps it on A (established connections; the server is
//! gone once the images are complete), the address leaves A for B, CRIU
//! restores it on B, and the client host forgets the address's link-layer
//! address (a gratuitous ARP's effect). Throughout, roam's address lock
//! (`roam_criu::AddressLock`: TCP to and from the address dropped, on A until
//! the address has left, on B until the restore is done) stands in for
//! CRIU's per-connection lock, which aborts CRIU past ~1,000 descriptors.
//! Afterwards every connection must echo a token of its own.
//!
//! Each case is moved three ways, one after another on fresh namespaces:
//! - `criu`, the reference: CRIU's dump and restore driven directly (local
//!   images directory, no transfer), roam's address lock, and the client
//!   host told to forget the address's link-layer address (what a
//!   gratuitous ARP does);
//! - `roam`: `roam migrate-process` on A to `roam migrate-accept` on B —
//!   images over an encrypted roam session, the address moved and
//!   announced by the command, packets of the freeze re-injected at B (B's
//!   `migrate-accept` runs in a pid namespace of its own: A's frozen server
//!   keeps its pid until B has restored it);
//! - `roam --no-reinject`: the same without the re-injection;
//! - `roam --lazy-pages`: post-copy — the images travel without the
//!   server's private memory, B restores at once and the memory follows
//!   over the session after the freeze.
//!
//! Reported per case and mover: dump and restore times, the transfer (roam
//! only), the time from the start of the move until the address answers
//! on B ("moved"; for roam, the command's wall time), the probe's longest
//! round trip across the move ("freeze" as the peer sees it: with packets
//! left to retransmission it includes the client's TCP retransmission
//! timeout), the images' size, packets re-injected and the connections
//! intact; with `--lazy-pages`, the memory that followed after the freeze.
//!
//! Needs root, nftables, python3 and CRIU >= 4.1 (`$ROAM_CRIU` or `criu` on
//! `PATH`); skipped with the reason otherwise.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use roam_criu::{AddressLock, Criu, DumpOptions, NetworkLock, RestoreOptions};
use roam_sim::netns::{self, Lan};
use serde::Serialize;

use super::progress;
use crate::peers::Lab;
use crate::Ctx;

/// The paper's freeze (ms) at 1 GB and many connections.
pub(crate) const PAPER_FREEZE_MS: f64 = 200.0;
/// The issue's goal for the freeze (ms).
pub(crate) const GOAL_FREEZE_MS: f64 = 50.0;

/// The server: holds `argv[2]` MB of touched memory, echoes on every
/// connection (non-blocking, one selector), prints "ready" once listening.
const SERVER: &str = r#"
import os, resource, selectors, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
ballast = bytearray(int(sys.argv[2]) << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
sel = selectors.DefaultSelector()
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", int(sys.argv[1])))
ls.listen(4096)
ls.setblocking(False)
sel.register(ls, selectors.EVENT_READ)
os.write(1, b"ready\n")
os.close(1)
os.open("/dev/null", os.O_WRONLY)
while True:
    for key, _ in sel.select():
        s = key.fileobj
        if s is ls:
            try:
                c, _ = ls.accept()
            except BlockingIOError:
                continue
            c.setblocking(False)
            sel.register(c, selectors.EVENT_READ)
            continue
        try:
            d = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            continue
        except OSError:
            d = b""
        if not d:
            sel.unregister(s)
            s.close()
            continue
        s.setblocking(True)
        s.sendall(d)
        s.setblocking(False)
"#;

/// The server's port (inside the LAN's namespaces only).
const PORT: u16 = 7200;
/// Longest wait for one echo.
const ECHO_TIMEOUT: Duration = Duration::from_secs(20);
/// Probe round trips before the move, so the connection is warm.
const PROBE_WARMUP: Duration = Duration::from_millis(300);

/// How a case moves the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mover {
    /// CRIU driven directly, images in a local directory (the reference).
    Criu,
    /// `roam migrate-process`, packets of the freeze re-injected.
    Roam,
    /// `roam migrate-process --no-reinject`.
    RoamNoReinject,
    /// `roam migrate-process --lazy-pages` (post-copy).
    RoamLazy,
}

impl Mover {
    /// Every mover, in the order each case runs them.
    pub(crate) const ALL: [Mover; 4] = [
        Mover::Criu,
        Mover::Roam,
        Mover::RoamNoReinject,
        Mover::RoamLazy,
    ];

    /// Its name on the command line (`--migrate-movers`).
    pub(crate) fn short(self) -> &'static str {
        match self {
            Mover::Criu => "criu",
            Mover::Roam => "roam",
            Mover::RoamNoReinject => "no-reinject",
            Mover::RoamLazy => "lazy",
        }
    }

    /// The report's name for it.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Mover::Criu => "criu (reference)",
            Mover::Roam => "roam migrate-process",
            Mover::RoamNoReinject => "roam --no-reinject",
            Mover::RoamLazy => "roam --lazy-pages",
        }
    }
}

/// One measured move.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    /// How the server was moved.
    pub(crate) mover: Mover,
    /// Connections the server holds (the probe among them).
    pub(crate) connections: usize,
    /// MB of touched memory the server holds.
    pub(crate) memory_mb: usize,
    /// CRIU's dump request, wall time.
    pub(crate) dump_ms: f64,
    /// CRIU's restore request, wall time.
    pub(crate) restore_ms: f64,
    /// Sending the images to B (roam only).
    pub(crate) transfer_ms: Option<f64>,
    /// Packets that arrived at A during the freeze and were re-injected at B
    /// (roam only).
    pub(crate) reinjected: Option<u64>,
    /// From the dump's start until the address answers on B.
    pub(crate) moved_ms: f64,
    /// The probe's longest round trip across the move.
    pub(crate) freeze_ms: f64,
    /// The probe's median round trip before the move.
    pub(crate) probe_rtt_ms: f64,
    /// Bytes of the images directory (roam: the images sent).
    pub(crate) image_bytes: u64,
    /// MB of memory that followed after the freeze (`--lazy-pages` only).
    pub(crate) followed_mb: Option<f64>,
    /// Connections that echoed their token after the move.
    pub(crate) intact: usize,
}

/// The scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct Migrate {
    /// The CRIU binary and its version.
    pub(crate) criu: String,
    pub(crate) rows: Vec<Row>,
}

pub(crate) async fn run(ctx: Arc<Ctx>, _lab: Arc<Lab>) -> io::Result<Migrate> {
    let cases = ctx.plan.migrate_cases.clone();
    let movers = ctx.plan.migrate_movers.clone();
    let roam = ctx.env.roam.clone();
    tokio::task::spawn_blocking(move || measure_all(&cases, &movers, &roam))
        .await
        .map_err(|e| io::Error::other(format!("migrate scenario: {e}")))?
}

fn measure_all(cases: &[(usize, usize)], movers: &[Mover], roam: &Path) -> io::Result<Migrate> {
    netns::available().map_err(skip)?;
    for tool in ["nft", "python3", "nsenter"] {
        if !netns::installed(tool) {
            return Err(skip(format!("{tool} is not installed")));
        }
    }
    let criu = Criu::locate().map_err(|e| skip(e.to_string()))?;
    let mut rows = Vec::new();
    for &(n, mb) in cases {
        for &mover in movers {
            let row = measure(&criu, roam, mover, n, mb)?;
            progress(&format!(
            "migrate {n} connections, {mb} MB, {}: dump {:.0} ms, restore {:.0} ms, moved {:.0} ms, \
             probe freeze {:.0} ms, {:.1} MB of images, {}/{n} intact",
            mover.label(),
            row.dump_ms,
            row.restore_ms,
            row.moved_ms,
            row.freeze_ms,
            row.image_bytes as f64 / 1e6,
            row.intact
        ));
            rows.push(row);
        }
    }
    Ok(Migrate {
        criu: format!("{} ({})", criu.path().display(), criu.version()),
        rows,
    })
}

/// The error that makes `main` report the scenario as skipped.
fn skip(why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("skipped: {why}"))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn measure(criu: &Criu, roam: &Path, mover: Mover, n: usize, mb: usize) -> io::Result<Row> {
    const CLIENT: usize = 0;
    const A: usize = 1;
    let lan = Lan::new("bench_migrate", 3)?;
    let service = lan.subnet_addr(100);
    lan.add_addr(A, service)?;
    let addr = SocketAddr::from((service, PORT));
    let mut server = start_server(lan.ns(A), mb)?;
    let result = (|| -> io::Result<Row> {
        let pid = i32::try_from(server.id()).map_err(io::Error::other)?;
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            let c = lan.tcp_connect(CLIENT, addr, Duration::from_secs(10))?;
            c.set_read_timeout(Some(ECHO_TIMEOUT))?;
            c.set_nodelay(true)?;
            conns.push(c);
        }
        // Every connection proven before the move.
        for (i, c) in conns.iter_mut().enumerate() {
            echo_token(c, i, 0)?;
        }
        let probe = Probe::start(conns[0].try_clone()?);
        thread::sleep(PROBE_WARMUP);

        let moved = match mover {
            Mover::Criu => move_with_criu(criu, &lan, service, pid, &mut server)?,
            Mover::Roam | Mover::RoamNoReinject | Mover::RoamLazy => {
                move_with_roam(roam, &lan, pid, &mut server, mover)?
            }
        };
        // A few round trips after the move, then the probe's verdict.
        let after = probe.rounds();
        let deadline = Instant::now() + ECHO_TIMEOUT;
        while probe.rounds() < after + 20 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        let (freeze, rtt) = probe.finish()?;
        let mut intact = 0;
        for (i, c) in conns.iter_mut().enumerate().skip(1) {
            if echo_token(c, i, 1).is_ok() {
                intact += 1;
            }
        }
        // The probe's connection counts if the probe saw its echoes after the move.
        if freeze < ECHO_TIMEOUT {
            intact += 1;
        }
        Ok(Row {
            mover,
            connections: n,
            memory_mb: mb,
            dump_ms: moved.dump_ms,
            restore_ms: moved.restore_ms,
            transfer_ms: moved.transfer_ms,
            reinjected: moved.reinjected,
            moved_ms: moved.moved_ms,
            freeze_ms: ms(freeze),
            probe_rtt_ms: ms(rtt),
            image_bytes: moved.image_bytes,
            followed_mb: moved.followed_mb,
            intact,
        })
    })();
    // Whatever happened, `lan`'s drop kills the server (on A or B).
    let _ = server.kill();
    let _ = server.wait();
    drop(lan);
    let row = result?;
    if row.intact != n {
        return Err(io::Error::other(format!(
            "{} of {n} connections did not survive the move",
            n - row.intact
        )));
    }
    Ok(row)
}

/// What one move measured.
struct Moved {
    dump_ms: f64,
    restore_ms: f64,
    transfer_ms: Option<f64>,
    reinjected: Option<u64>,
    moved_ms: f64,
    image_bytes: u64,
    followed_mb: Option<f64>,
    /// A destination that must outlive the checks after the move (the
    /// restored server lives in its pid namespace and dies with it):
    /// killed when dropped.
    _keep: Option<KillOnDrop>,
}

/// A child killed and reaped when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The reference move: CRIU driven directly, images in a local directory.
fn move_with_criu(
    criu: &Criu,
    lan: &Lan,
    service: std::net::Ipv4Addr,
    pid: i32,
    server: &mut Child,
) -> io::Result<Moved> {
    const A: usize = 1;
    const B: usize = 2;
    let images = tempfile::tempdir()?;
    // roam's own lock on the service address (one rule, whatever the
    // number of connections), on A from before the dump until the
    // address has left, on B from before it arrives until the restore.
    let t0 = Instant::now();
    let lock_a = AddressLock::new(Some(lan.ns(A)), service.into()).map_err(io::Error::other)?;
    let dumped = criu
        .clone()
        .in_netns(lan.ns(A))
        .dump(
            pid,
            images.path(),
            &DumpOptions {
                tcp_established: true,
                network_lock: NetworkLock::Skip,
                ..DumpOptions::default()
            },
        )
        .map_err(io::Error::other)?;
    let _ = server.wait();
    lan.del_addr(A, service)?;
    lock_a.release().map_err(io::Error::other)?;
    let lock_b = AddressLock::new(Some(lan.ns(B)), service.into()).map_err(io::Error::other)?;
    lan.add_addr(B, service)?;
    let restored = criu
        .clone()
        .in_netns(lan.ns(B))
        .restore(
            images.path(),
            &RestoreOptions {
                tcp_established: true,
                network_lock: NetworkLock::Skip,
                ..RestoreOptions::default()
            },
        )
        .map_err(io::Error::other)?;
    lock_b.release().map_err(io::Error::other)?;
    lan.forget_neighbor(service)?;
    let moved = t0.elapsed();
    Ok(Moved {
        dump_ms: ms(dumped.elapsed),
        restore_ms: ms(restored.elapsed),
        transfer_ms: None,
        reinjected: None,
        moved_ms: ms(moved),
        image_bytes: dumped.image_bytes,
        followed_mb: None,
        _keep: None,
    })
}

/// The move through `roam migrate-process` (on A) to `roam migrate-accept`
/// (on B), as `mover` says (re-injection or not, post-copy); the figures
/// from its summary.
fn move_with_roam(
    roam: &Path,
    lan: &Lan,
    pid: i32,
    server: &mut Child,
    mover: Mover,
) -> io::Result<Moved> {
    let no_reinject = mover == Mover::RoamNoReinject;
    let lazy = mover == Mover::RoamLazy;
    const A: usize = 1;
    const B: usize = 2;
    let state = tempfile::tempdir()?;
    let in_ns = |i: usize| {
        let mut c = lan.command(i, roam);
        c.env("ROAM_STATE_DIR", state.path()).stdin(Stdio::null());
        c
    };
    let key = in_ns(A).arg("keygen").output()?;
    if !key.status.success() {
        return Err(io::Error::other("roam keygen failed"));
    }
    let keys = state.path().join("migrate_keys");
    std::fs::write(&keys, &key.stdout)?;
    let listen = format!("{}:7448", lan.addr(B));
    // B restores while A's frozen server still holds its pid (inside A's
    // post-dump step, with or without post-copy): a pid namespace of its
    // own gives B the pid space a host of its own would (everything in it
    // dies with migrate-accept).
    let mut accept = lan.command_own_pids(B, roam);
    accept
        .env("ROAM_STATE_DIR", state.path())
        .stdin(Stdio::null());
    let mut accept = accept
        .arg("migrate-accept")
        .arg("--listen")
        .arg(&listen)
        .arg("--authorized-keys")
        .arg(&keys)
        // Experiments: more arguments for `migrate-accept`.
        .args(
            std::env::var("ROAM_BENCH_ACCEPT_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let result = (|| -> io::Result<Moved> {
        let mut err = io::BufReader::new(
            accept
                .stderr
                .take()
                .ok_or_else(|| io::Error::other("no stderr"))?,
        );
        let mut first = String::new();
        io::BufRead::read_line(&mut err, &mut first)?;
        if !first.contains("listening on") {
            return Err(io::Error::other(format!("migrate-accept: {first}")));
        }
        // Drained, so that its log never blocks it; shown with
        // `ROAM_BENCH_MIGRATE_PHASES=1`.
        let phases = std::env::var_os("ROAM_BENCH_MIGRATE_PHASES").is_some();
        thread::spawn(move || {
            for line in io::BufRead::lines(err).map_while(Result::ok) {
                if phases {
                    progress(&format!("[migrate-accept] {line}"));
                }
            }
        });
        let mut cmd = in_ns(A);
        cmd.arg("migrate-process")
            .arg(pid.to_string())
            .arg("--to")
            .arg(&listen)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if no_reinject {
            cmd.arg("--no-reinject");
        }
        if lazy {
            cmd.arg("--lazy-pages");
        }
        // CRIU's phases need its debug log, which lengthens the freeze;
        // `ROAM_BENCH_MIGRATE_PHASES=warnings` (or another level) prints
        // roam's phases with CRIU logging at that level instead.
        if let Some(v) = std::env::var_os("ROAM_BENCH_MIGRATE_PHASES") {
            let level = v
                .to_str()
                .filter(|l| ["errors", "warnings", "info", "debug"].contains(l))
                .unwrap_or("debug");
            cmd.args(["--criu-log", level]);
        }
        // Experiments: more arguments for the command (whitespace-separated).
        if let Ok(extra) = std::env::var("ROAM_BENCH_MIGRATE_ARGS") {
            cmd.args(extra.split_whitespace());
        }
        let t0 = Instant::now();
        let child = cmd.spawn()?;
        // The server is this process's child: reaped the moment CRIU ends
        // it at A (after B restored it in its own pid namespace), as a
        // real host's init would reap it.
        let waiter = thread::spawn(move || child.wait_with_output());
        let mut reaped = false;
        while !waiter.is_finished() {
            if !reaped {
                reaped = server.try_wait()?.is_some();
            }
            thread::sleep(Duration::from_micros(200));
        }
        let out = waiter
            .join()
            .map_err(|_| io::Error::other("migrate-process waiter panicked"))??;
        let moved = t0.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "roam migrate-process failed: {}{}",
                String::from_utf8_lossy(&out.stderr),
                stdout
            )));
        }
        // The command's own account: its summary, and its phases with
        // `ROAM_BENCH_MIGRATE_PHASES=1` (where the freeze goes).
        progress(&format!("migrate-process said:\n{}", stdout.trim_end()));
        if std::env::var_os("ROAM_BENCH_MIGRATE_PHASES").is_some() {
            progress(&format!(
                "migrate-process phases:\n{}",
                String::from_utf8_lossy(&out.stderr).trim_end()
            ));
        }
        let field = |name: &str| summary_ms(&stdout, name);
        Ok(Moved {
            dump_ms: field("dump").unwrap_or(f64::NAN),
            restore_ms: field("restore").unwrap_or(f64::NAN),
            transfer_ms: field("transfer"),
            reinjected: stdout
                .lines()
                .find(|l| l.contains("packets arrived during the freeze"))
                .and_then(|l| {
                    if no_reinject {
                        Some("0")
                    } else {
                        l.split(": ").nth(1)?.split_whitespace().next()
                    }
                })
                .and_then(|n| n.parse().ok()),
            moved_ms: ms(moved),
            image_bytes: stdout
                .split("; ")
                .find(|p| p.ends_with("MB of images"))
                .and_then(|p| p.split_whitespace().next()?.parse::<f64>().ok())
                .map_or(0, |mb| (mb * 1e6) as u64),
            followed_mb: stdout
                .lines()
                .find_map(|l| l.trim().strip_prefix("post-copy: "))
                .and_then(|l| l.split_whitespace().next()?.parse().ok()),
            _keep: None,
        })
    })();
    // The restored server lives in migrate-accept's pid namespace: it must
    // outlive the checks.
    match result {
        Ok(mut m) => {
            m._keep = Some(KillOnDrop(accept));
            Ok(m)
        }
        other => {
            let _ = accept.kill();
            let _ = accept.wait();
            other
        }
    }
}

/// A duration of the summary's freeze line, `NAME 12 ms` or `NAME 1.32 s`,
/// in ms.
fn summary_ms(text: &str, name: &str) -> Option<f64> {
    let at = text.find(&format!("{name} "))? + name.len() + 1;
    let mut words = text[at..].split([' ', ',', ')', ';']);
    let value: f64 = words.next()?.parse().ok()?;
    match words.next()? {
        "ms" => Some(value),
        "s" => Some(value * 1e3),
        _ => None,
    }
}

/// Starts the server on `ns` (network namespace only, a session of its own)
/// and waits for its "ready".
fn start_server(ns: &str, mb: usize) -> io::Result<Child> {
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .args(["--", "setsid", "python3", "-c", SERVER])
        .arg(PORT.to_string())
        .arg(mb.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("no stdout"))?;
    let mut line = [0u8; 6];
    if let Err(e) = out.read_exact(&mut line) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(io::Error::other(format!(
            "migration server did not start: {e}"
        )));
    }
    // The server closed its end after "ready": CRIU sees no pipe to us.
    drop(out);
    Ok(child)
}

/// Sends connection `i`'s token for `round` and checks its echo.
fn echo_token(c: &mut TcpStream, i: usize, round: u64) -> io::Result<()> {
    let token = ((i as u64) << 8 | round).to_le_bytes();
    c.write_all(&token)?;
    let mut back = [0u8; 8];
    c.read_exact(&mut back)?;
    if back != token {
        return Err(io::Error::other(format!(
            "connection {i}: token {token:?} came back as {back:?}"
        )));
    }
    Ok(())
}

/// One-byte round trips on one connection, timed.
struct Probe {
    /// Set to end the round trips.
    stop: Arc<AtomicBool>,
    /// Round trips completed so far.
    rounds: Arc<std::sync::atomic::AtomicUsize>,
    /// The thread doing them; returns every round trip's time.
    worker: thread::JoinHandle<io::Result<Vec<Duration>>>,
}

impl Probe {
    fn start(mut c: TcpStream) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let worker = {
            let (stop, rounds) = (stop.clone(), rounds.clone());
            thread::spawn(move || {
                let mut rtts = Vec::new();
                let mut b = [0u8; 1];
                let mut k = 0u8;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    c.write_all(&[k])?;
                    c.read_exact(&mut b)?;
                    if b[0] != k {
                        return Err(io::Error::other("the probe's byte came back wrong"));
                    }
                    rtts.push(t.elapsed());
                    rounds.fetch_add(1, Ordering::Relaxed);
                    k = k.wrapping_add(1);
                    thread::sleep(Duration::from_millis(1));
                }
                Ok(rtts)
            })
        };
        Probe {
            stop,
            rounds,
            worker,
        }
    }

    fn rounds(&self) -> usize {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Stops; returns the longest round trip and the median of the others.
    fn finish(self) -> io::Result<(Duration, Duration)> {
        self.stop.store(true, Ordering::Relaxed);
        let mut rtts = self
            .worker
            .join()
            .map_err(|_| io::Error::other("probe panicked"))??;
        rtts.sort();
        let longest = rtts.last().copied().unwrap_or_default();
        let median = rtts.get(rtts.len() / 2).copied().unwrap_or_default();
        Ok((longest, median))
    }
}
