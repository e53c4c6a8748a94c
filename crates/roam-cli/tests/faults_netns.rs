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
