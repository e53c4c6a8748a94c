//! Fault tests of the real `roam` binary between two network namespaces
//! ([`roam_sim::netns::NetPair`]): a client host running `roam pipe` (or ssh
//! with `roam pipe` as its ProxyCommand) and a server host running `roam
//! serve` and the target, joined by a veth pair.
//!
//! - the client's link down for 20 s, then up;
//! - the client's address changed mid-transfer;
//! - the server's address changed mid-transfer, the client learning the new
//!   one from its resolver (`roam serve` has no way to announce addresses or
//!   a move yet, so a DNS change is how the client is told);
//! - real OpenSSH through `roam pipe`: remote output keeps streaming across a
//!   30 s outage and a client address change, every line exactly once.
//!
//! Every transfer is verified byte for byte; the time from the end of a fault
//! to the resumed session is printed. Needs root (skips with the reason
//! otherwise). Bounded by watchdogs; namespaces and processes are removed
//! when a test ends, passed or not.

mod faults_common;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use faults_common::*;
use roam_sim::netns::{NetPair, Side};
use roam_sim::sshd::{self, PrivateSshd};

/// Where `roam serve` listens in the server namespace.
const RELAY_PORT: u16 = 7447;
/// Bytes each way of the paced transfers, and their pace (bytes/s).
const LEN: u64 = 12 << 20;
const RATE: u64 = 1 << 20;
/// Bytes received before a fault is injected.
const FAULT_AT: u64 = 2 << 20;

macro_rules! require_netns {
    () => {
        if let Some(why) = netns_skip_reason() {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
}

/// A pair with `roam serve` and a bulk target on the server side, and a
/// `roam pipe` moving paced data both ways on the client side.
struct Bulk {
    // Field order is drop order: processes first, then the namespaces.
    pipe: Proc,
    relay: Proc,
    client: Option<ClientTransfer>,
    target: Option<Target>,
    _dir: tempfile::TempDir,
    pair: NetPair,
}

impl Bulk {
    /// `relay_name`: reach the relay by this name (set in the client's
    /// /etc/hosts) instead of by address.
    fn start(prefix: &str, wd: &Watchdog, relay_name: Option<&str>) -> Bulk {
        let pair = NetPair::new(prefix).expect("create namespaces");
        let dir = tempfile::tempdir().unwrap();
        let target_listener = pair
            .tcp_listen(Side::Server, "127.0.0.1:0".parse().unwrap())
            .unwrap();
        let target_addr = target_listener.local_addr().unwrap();
        let target = Target::start(target_listener, UP_SEED, DOWN_SEED, LEN, Some(RATE), false);
        let (relay, _) = start_relay(
            Some((&pair, Side::Server)),
            dir.path(),
            &format!("0.0.0.0:{RELAY_PORT}"),
            &target_addr.to_string(),
            &[],
        );
        wd.watch(&relay);
        let relay_host = match relay_name {
            Some(name) => {
                pair.set_hosts(Side::Client, &[(name, IpAddr::V4(pair.server_addr()))])
                    .unwrap();
                format!("{name}:{RELAY_PORT}")
            }
            None => format!("{}:{RELAY_PORT}", pair.server_addr()),
        };
        let mut pipe = start_pipe(
            Some((&pair, Side::Client)),
            dir.path(),
            &relay_host,
            &target_addr.to_string(),
        );
        wd.watch(&pipe);
        let client = ClientTransfer::start(&mut pipe, LEN, Some(RATE));
        Bulk {
            pipe,
            relay,
            client: Some(client),
            target: Some(target),
            _dir: dir,
            pair,
        }
    }

    fn client(&self) -> &ClientTransfer {
        self.client.as_ref().expect("running")
    }

    fn target(&self) -> &Target {
        self.target.as_ref().expect("running")
    }

    fn wait_received(&self, n: u64) {
        assert!(
            self.client().received.wait_for(n, Duration::from_secs(60)),
            "transfer did not reach {n} bytes; pipe stderr:\n{}",
            self.pipe.log()
        );
    }

    fn resumption(&self) -> Resumption {
        Resumption::start(&self.pipe, &self.client().received, Some(&self.target().up))
    }

    fn wait_resumed(&self, r: &Resumption) -> Resumed {
        r.wait(
            &self.pipe,
            &self.client().received,
            Some(&self.target().up),
            Duration::from_secs(60),
        )
    }

    /// Waits for the transfer to end and verifies both streams.
    fn finish(mut self) {
        let status = self.pipe.wait_timeout(Duration::from_secs(120));
        check_bulk(
            self.client.take().expect("running"),
            self.target.take().expect("running"),
            LEN,
        );
        let status = status.expect("roam pipe did not exit after the transfer");
        assert!(
            status.success(),
            "roam pipe exited with {status}; stderr:\n{}",
            self.pipe.log()
        );
    }
}

#[test]
fn link_down_20s_then_up() {
    require_netns!();
    let wd = Watchdog::new("link_down_20s_then_up", Duration::from_secs(240));
    let run = Bulk::start("linkdown", &wd, None);
    run.wait_received(FAULT_AT);
    run.pair.link_down().unwrap();
    thread::sleep(Duration::from_secs(20));
    assert!(
        run.pipe.log().contains("suspended"),
        "client never noticed the dead link:\n{}",
        run.pipe.log()
    );
    let r = run.resumption();
    run.pair.link_up().unwrap();
    let resumed = run.wait_resumed(&r);
    eprintln!("link down 20 s, then up: {resumed}");
    assert!(
        resumed.session.is_some() && resumed.down.is_some() && resumed.up.flatten().is_some(),
        "{resumed}"
    );
    run.finish();
}

#[test]
fn client_address_change_mid_transfer() {
    require_netns!();
    let wd = Watchdog::new(
        "client_address_change_mid_transfer",
        Duration::from_secs(240),
    );
    let run = Bulk::start("clientmove", &wd, None);
    run.wait_received(FAULT_AT);
    let new = run.pair.subnet_addr(11);
    let r = run.resumption();
    run.pair.change_client_addr(new).unwrap();
    let resumed = run.wait_resumed(&r);
    eprintln!("client address changed: {resumed}");
    assert!(resumed.session.is_some(), "{resumed}");
    assert!(
        wait_until(Duration::from_secs(10), || run
            .relay
            .log()
            .contains(&format!("to Some({new}:"))),
        "relay did not see the client at {new}:\n{}",
        run.relay.log()
    );
    run.finish();
}

#[test]
fn server_address_change_told_by_dns() {
    server_move("servermove", Duration::from_secs(40));
}

/// As above, but the session must resume on the client's first re-dial after
/// its 5 s silence timeout.
#[test]
fn server_address_change_resumes_on_first_redial() {
    server_move("servermove2", Duration::from_secs(8));
}

/// The server's address changes mid-transfer and the name the client dials
/// is moved to the new address (`roam serve` cannot announce addresses or
/// ask clients to move, so DNS is how the client is told).
fn server_move(prefix: &str, limit: Duration) {
    require_netns!();
    let wd = Watchdog::new("server_move", Duration::from_secs(240));
    let run = Bulk::start(prefix, &wd, Some("roam-relay"));
    run.wait_received(FAULT_AT);
    let new = run.pair.subnet_addr(12);
    let r = run.resumption();
    run.pair.change_server_addr(new).unwrap();
    run.pair
        .set_hosts(Side::Client, &[("roam-relay", IpAddr::V4(new))])
        .unwrap();
    let resumed = run.wait_resumed(&r);
    eprintln!("server address changed (client told through DNS): {resumed}");
    let session = resumed.session.expect("never resumed");
    assert!(
        session < limit,
        "resumed only after {session:?} (limit {limit:?})"
    );
    run.finish();
}

/// Lines of the remote command's output.
const LINES: usize = 400;

#[test]
fn ssh_streams_across_outage_and_address_change() {
    require_netns!();
    if let Err(why) = sshd::available() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let wd = Watchdog::new(
        "ssh_streams_across_outage_and_address_change",
        Duration::from_secs(300),
    );
    let pair = NetPair::new("ssh").expect("create namespaces");
    let dir = tempfile::tempdir().unwrap();
    let sshd_addr: SocketAddr = "127.0.0.1:2222".parse().unwrap();
    let sshd = PrivateSshd::start(Some((&pair, Side::Server)), sshd_addr).expect("start sshd");
    let (relay, _) = start_relay(
        Some((&pair, Side::Server)),
        dir.path(),
        &format!("0.0.0.0:{RELAY_PORT}"),
        &sshd_addr.to_string(),
        &[],
    );
    wd.watch(&relay);

    let proxy = format!(
        "{} pipe -v --no-fallback {}:{RELAY_PORT} %h:%p",
        roam_bin().display(),
        pair.server_addr()
    );
    let mut ssh = sshd.ssh_command(Some(&proxy));
    ssh.env("ROAM_STATE_DIR", dir.path().join("client-state"));
    ssh.arg(format!(
        "for i in $(seq 1 {LINES}); do echo line $i; sleep 0.1; done"
    ));
    let mut ssh = pair.wrap(Side::Client, &ssh);
    ssh.stdin(Stdio::null()).stdout(Stdio::piped());
    let t0 = Instant::now();
    let mut ssh = Proc::spawn("ssh", &mut ssh);
    wd.watch(&ssh);

    // Every line with its arrival time.
    let lines: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let got = Progress::default();
    let stdout = ssh.child.stdout.take().unwrap();
    let (l2, g2) = (lines.clone(), got.clone());
    let reader = thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            l2.lock().unwrap().push((line, Instant::now()));
            g2.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let wait_lines = |n: u64| {
        assert!(
            got.wait_for(n, Duration::from_secs(60)),
            "only {} lines arrived; ssh stderr:\n{}",
            got.get(),
            ssh.log()
        );
    };

    // A client address change while the output streams.
    wait_lines(20);
    let r = Resumption::start(&ssh, &got, None);
    pair.change_client_addr(pair.subnet_addr(11)).unwrap();
    let moved = r.wait(&ssh, &got, None, Duration::from_secs(30));
    eprintln!("ssh: client address changed: {moved}");

    // A 30 s outage.
    wait_lines(60);
    pair.link_down().unwrap();
    thread::sleep(Duration::from_secs(30));
    let r = Resumption::start(&ssh, &got, None);
    let up_at = Instant::now();
    pair.link_up().unwrap();
    let back = r.wait(&ssh, &got, None, Duration::from_secs(60));
    eprintln!("ssh: 30 s outage, link-up -> {back}");

    let status = ssh.wait_timeout(Duration::from_secs(120));
    reader.join().unwrap();
    let status = status.expect("ssh did not finish");
    assert!(
        status.success(),
        "ssh exited with {status}; stderr:\n{}\nsshd log:\n{}",
        ssh.log(),
        sshd.log().join("\n")
    );

    let lines = lines.lock().unwrap();
    assert!(lines.len() >= 60, "got {} of {LINES} lines", lines.len());
    for (i, (line, _)) in lines.iter().enumerate() {
        assert_eq!(
            line,
            &format!("line {}", i + 1),
            "line {} out of order, lost or duplicated",
            i + 1
        );
    }
    assert_eq!(lines.len(), LINES, "got {} of {LINES} lines", lines.len());
    // Output kept streaming live after the outage, not only as one burst.
    let live = lines
        .iter()
        .filter(|(_, t)| t.duration_since(up_at) > Duration::from_secs(2))
        .count();
    let at = |t: Instant| format!("{:.1} s", t.duration_since(t0).as_secs_f64());
    eprintln!(
        "ssh timeline: line 1 at {}, line 60 at {}, link up at {}, line {LINES} at {}",
        at(lines[0].1),
        at(lines[59].1),
        at(up_at),
        at(lines[LINES - 1].1)
    );
    eprintln!(
        "ssh: {LINES} lines exactly once in order; {live} arrived live more than 2 s after link-up"
    );
    assert!(
        moved.session.is_some(),
        "no resume after the address change: {moved}"
    );
    assert!(
        back.session.is_some() && back.down.is_some(),
        "no resume after the outage: {back}"
    );
    assert!(live > 0, "nothing streamed after the outage");
}

/// Stream `seed` from byte `from` to `len`, written to `w` at `rate`
/// bytes/s; stops quietly when the reader is gone (a killed client).
fn feed_pattern(mut w: impl std::io::Write, seed: u64, from: u64, len: u64, rate: u64) {
    let t0 = Instant::now();
    let mut buf = vec![0u8; 1 << 14];
    let mut off = from;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        pattern_fill(seed, off, &mut buf[..n]);
        if w.write_all(&buf[..n]).is_err() {
            return;
        }
        off += n as u64;
        let due = t0 + Duration::from_secs_f64((off - from) as f64 / rate as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
}

/// Everything `r` gives until its end, counted into `got` as it comes.
fn collect(mut r: impl std::io::Read, got: Progress) -> Vec<u8> {
    let mut v = Vec::new();
    let mut buf = vec![0u8; 1 << 14];
    while let Ok(n @ 1..) = r.read(&mut buf) {
        v.extend_from_slice(&buf[..n]);
        got.0
            .store(v.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
    v
}

/// `roam pipe --name`, killed with SIGKILL mid-transfer both ways; the
/// client host's address changes; a new process re-attaches the session by
/// name from the new address. The target's one connection (never
/// re-made) receives the client's stream whole and once, the input fed to
/// the second process from the byte the journal names; the first
/// process's output up to its printed count followed by the second's is the
/// target's stream, whole and once.
#[test]
fn a_named_pipe_killed_reattaches_from_a_new_address() {
    require_netns!();
    let wd = Watchdog::new(
        "a_named_pipe_killed_reattaches_from_a_new_address",
        Duration::from_secs(180),
    );
    const LEN: u64 = 4 << 20;
    let pair = NetPair::new("namedkill").expect("create namespaces");
    let dir = tempfile::tempdir().unwrap();
    let target_listener = pair
        .tcp_listen(Side::Server, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let target_addr = target_listener.local_addr().unwrap().to_string();
    let target = Target::start(target_listener, UP_SEED, DOWN_SEED, LEN, Some(RATE), false);
    let (relay, _) = start_relay(
        Some((&pair, Side::Server)),
        dir.path(),
        &format!("0.0.0.0:{RELAY_PORT}"),
        &target_addr,
        &[],
    );
    wd.watch(&relay);
    let relay_host = format!("{}:{RELAY_PORT}", pair.server_addr());
    let named = || {
        let mut c = roam_command(
            Some((&pair, Side::Client)),
            &dir.path().join("client-state"),
        );
        c.args(["pipe", "-v", "--name", "job", &relay_host, &target_addr])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        c
    };

    let mut first = Proc::spawn("pipe-1", &mut named());
    wd.watch(&first);
    let stdin = first.child.stdin.take().unwrap();
    let stdout = first.child.stdout.take().unwrap();
    let feeder = thread::spawn(move || feed_pattern(stdin, UP_SEED, 0, LEN, RATE));
    let got1 = Progress::default();
    let g = got1.clone();
    let reader = thread::spawn(move || collect(stdout, g));
    assert!(
        target.up.wait_for(1 << 20, Duration::from_secs(60))
            && got1.wait_for(1 << 20, Duration::from_secs(60)),
        "the transfer did not get going:\n{}",
        first.log()
    );
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    feeder.join().unwrap();
    let out1 = reader.join().unwrap();

    let new = pair.subnet_addr(11);
    pair.change_client_addr(new).unwrap();
    let status = roam_command(None, &dir.path().join("client-state"))
        .args(["status", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let d = &v["detached"][0];
    assert_eq!(d["killed"], true, "{v}");
    let taken = d["input_taken"].as_u64().expect("input_taken");
    let printed = d["output_printed"].as_u64().expect("output_printed") as usize;
    assert!(taken < LEN && printed < LEN as usize, "mid-transfer: {v}");
    assert!(
        printed <= out1.len() && out1.len() - printed <= 4096,
        "printed {printed} of the {} bytes the first process wrote",
        out1.len()
    );

    let mut second = Proc::spawn("pipe-2", &mut named());
    wd.watch(&second);
    let stdin = second.child.stdin.take().unwrap();
    let stdout = second.child.stdout.take().unwrap();
    let feeder = thread::spawn(move || feed_pattern(stdin, UP_SEED, taken, LEN, 4 * RATE));
    let reader = thread::spawn(move || collect(stdout, Progress::default()));
    let exit = second.wait_timeout(Duration::from_secs(120));
    feeder.join().unwrap();
    let out2 = reader.join().unwrap();
    assert!(
        exit.is_some_and(|s| s.success()),
        "the second process: {exit:?}\n{}",
        second.log()
    );
    assert!(second.log().contains("journal"), "{}", second.log());
    assert!(
        wait_until(Duration::from_secs(10), || relay
            .log()
            .contains(&format!("to Some({new}:"))),
        "relay did not see the client at {new}:\n{}",
        relay.log()
    );
    let (got_up, sent_down) = target
        .result
        .join()
        .expect("target thread")
        .expect("target side");
    assert_eq!(
        got_up,
        pattern_sha256(UP_SEED, LEN),
        "client->target stream"
    );
    assert_eq!(sent_down, pattern_sha256(DOWN_SEED, LEN));
    assert_eq!(
        target.accepted.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "one target connection: the session survived the kill as one"
    );
    let mut down = out1[..printed].to_vec();
    down.extend_from_slice(&out2);
    assert_eq!(down.len() as u64, LEN, "target->client length");
    let mut want = vec![0u8; LEN as usize];
    pattern_fill(DOWN_SEED, 0, &mut want);
    assert!(down == want, "target->client stream, once and in order");
    eprintln!(
        "killed after {taken} bytes up and {printed} printed; re-attached from {new}; both streams whole"
    );
}
