//! Fault tests of the real `roam` binary on the loopback, through
//! [`roam_sim::proxy::FaultProxy`]:
//!
//! - bulk: 50 MB each way through `roam pipe` while the proxy resets every
//!   connection every 0.5 s; both streams verified byte for byte and by
//!   SHA-256, and the relay's target connection must be the same one
//!   throughout. (`ROAM_FAULT_MB` changes the size; debug builds default to
//!   16 MB so `cargo test` without `--release` stays quick.)
//! - expiry: a session black-holed past the relay's `--suspend-timeout`
//!   ends on both sides with its reason printed, and the relay closes the
//!   target connection.
//!
//! No root needed. Each test is bounded by a watchdog that kills its
//! processes, and every process is killed when the test ends, passed or not.

mod faults_common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use faults_common::*;
use roam_sim::proxy::FaultProxy;

/// Period of the proxy's chaos resets.
const RESET_PERIOD: Duration = Duration::from_millis(500);
/// The bulk transfer is paced to last about this long (seconds).
const TRANSFER_SECS: u64 = 6;

#[test]
fn bulk_each_way_through_resets_every_half_second() {
    let wd = Watchdog::new(
        "bulk_each_way_through_resets_every_half_second",
        Duration::from_secs(300),
    );
    let dir = tempfile::tempdir().unwrap();
    let len = megabytes(if cfg!(debug_assertions) { 16 } else { 50 }) << 20;

    let target_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target_listener.local_addr().unwrap();
    // Paced so the transfer spans many chaos periods whatever the machine's speed.
    let rate = len / TRANSFER_SECS;
    let target = Target::start(target_listener, UP_SEED, DOWN_SEED, len, Some(rate), false);
    let (relay, relay_addr) = start_relay(
        None,
        dir.path(),
        "127.0.0.1:0",
        &target_addr.to_string(),
        &[],
    );
    wd.watch(&relay);
    let proxy = FaultProxy::spawn(relay_addr).unwrap();
    proxy.reset_every(Some(RESET_PERIOD));

    let t0 = Instant::now();
    let mut pipe = start_pipe(
        None,
        dir.path(),
        &proxy.addr().to_string(),
        &target_addr.to_string(),
    );
    wd.watch(&pipe);
    let client = ClientTransfer::start(&mut pipe, len, Some(rate));
    let status = pipe.wait_timeout(Duration::from_secs(280));
    let elapsed = t0.elapsed();
    proxy.reset_every(None);
    let stats = proxy.stats();
    eprintln!(
        "bulk: {} MiB each way in {elapsed:.2?} ({:.1} MiB/s each way) through {} resets \
         ({} proxy connections, {} chaos rounds)",
        len >> 20,
        (len >> 20) as f64 / elapsed.as_secs_f64(),
        stats.resets,
        stats.accepted,
        stats.chaos_rounds,
    );
    check_bulk(client, target, len);
    let status = status.expect("roam pipe did not exit after the transfer");
    assert!(
        status.success(),
        "roam pipe exited with {status}; stderr:\n{}",
        pipe.log()
    );
    assert!(
        stats.resets >= 5,
        "only {} resets hit the transfer (took {elapsed:?})",
        stats.resets
    );
    drop(relay);
}

#[test]
fn suspended_past_timeout_expires_cleanly() {
    let wd = Watchdog::new(
        "suspended_past_timeout_expires_cleanly",
        Duration::from_secs(120),
    );
    let dir = tempfile::tempdir().unwrap();
    let target_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target_listener.local_addr().unwrap();
    let (relay, relay_addr) = start_relay(
        None,
        dir.path(),
        "127.0.0.1:0",
        &target_addr.to_string(),
        &["--suspend-timeout", "3s"],
    );
    wd.watch(&relay);
    let proxy = FaultProxy::spawn(relay_addr).unwrap();
    let mut pipe = start_pipe(
        None,
        dir.path(),
        &proxy.addr().to_string(),
        &target_addr.to_string(),
    );
    wd.watch(&pipe);

    // One exchange proves the session works end to end.
    let mut stdin = pipe.child.stdin.take().unwrap();
    let mut stdout = pipe.child.stdout.take().unwrap();
    stdin.write_all(b"hello\n").unwrap();
    stdin.flush().unwrap();
    let mut target =
        accept_within(&target_listener, Duration::from_secs(30)).expect("relay connects to target");
    target
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut b = [0u8; 6];
    target.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"hello\n");
    target.write_all(b"world\n").unwrap();
    stdout.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"world\n");

    // Cut the path without telling anyone. Both ends suspend after their
    // liveness timeout (5 s); the relay then keeps the session 3 s more.
    proxy.blackhole(true);
    let cut = Instant::now();
    let mut rest = Vec::new();
    let end = target.read_to_end(&mut rest);
    let target_closed_after = cut.elapsed();
    eprintln!("expiry: relay closed the target connection {target_closed_after:.2?} after the cut ({end:?})");
    assert!(rest.is_empty(), "unexpected bytes at the target: {rest:?}");
    assert!(
        target_closed_after >= Duration::from_secs(3),
        "target closed after {target_closed_after:?}, before the suspend timeout could have passed"
    );
    assert!(
        target_closed_after < Duration::from_secs(40),
        "target closed only after {target_closed_after:?}"
    );
    assert!(
        wait_until(Duration::from_secs(10), || relay.log().contains("closed")),
        "relay printed no reason for ending the session; stderr:\n{}",
        relay.log()
    );
    let relay_reason = relay
        .log()
        .lines()
        .rfind(|l| l.contains("closed"))
        .unwrap_or_default()
        .to_string();
    eprintln!("expiry: relay says: {relay_reason}");

    // The client learns on its next contact with the relay.
    proxy.blackhole(false);
    let status = pipe.wait_timeout(Duration::from_secs(40));
    let client_log = pipe.log();
    let status = status.unwrap_or_else(|| {
        panic!("roam pipe still running 40 s after the path healed; stderr:\n{client_log}")
    });
    eprintln!(
        "expiry: roam pipe exited with {status}; its last words: {}",
        client_log.lines().last().unwrap_or("")
    );
    assert!(!status.success(), "an expired session must not exit 0");
    assert!(
        client_log.lines().any(|l| l.starts_with("roam:")),
        "roam pipe printed no reason; stderr:\n{client_log}"
    );
    // stdout ends (no stray bytes) once the client gives up.
    let mut tail = Vec::new();
    let _ = stdout.read_to_end(&mut tail);
    assert!(tail.is_empty(), "bytes after expiry: {tail:?}");
    drop(stdin);
}

/// TCP half-close, no faults: the target sends everything and shuts down its
/// sending side while the client is still uploading. `roam pipe` must keep
/// uploading until its stdin ends, as a TCP connection would.
#[test]
fn half_close_keeps_the_other_direction() {
    let wd = Watchdog::new(
        "half_close_keeps_the_other_direction",
        Duration::from_secs(120),
    );
    let dir = tempfile::tempdir().unwrap();
    let len = 8 << 20;
    let target_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target_listener.local_addr().unwrap();
    // The target's stream finishes at once; the client's takes ~2 s.
    let target = Target::start(target_listener, UP_SEED, DOWN_SEED, len, None, true);
    let (relay, relay_addr) = start_relay(
        None,
        dir.path(),
        "127.0.0.1:0",
        &target_addr.to_string(),
        &[],
    );
    wd.watch(&relay);
    let mut pipe = start_pipe(
        None,
        dir.path(),
        &relay_addr.to_string(),
        &target_addr.to_string(),
    );
    wd.watch(&pipe);
    let client = ClientTransfer::start(&mut pipe, len, Some(len / 2));
    let status = pipe.wait_timeout(Duration::from_secs(60));
    check_bulk(client, target, len);
    assert!(
        status.is_some_and(|s| s.success()),
        "roam pipe: {status:?}; stderr:\n{}",
        pipe.log()
    );
}

/// The path dies silently mid-transfer while a new one works (the proxy
/// black-holes the current connection only): both ends declare it dead
/// after their 5 s of silence, and the client's first re-dial must resume
/// the session at once. (On the loopback the dead connection's kernel
/// buffers absorb roam's in-flight window; `faults_netns`'s server move
/// covers the case where they do not.)
#[test]
fn silent_path_loss_resumes_on_first_redial() {
    let wd = Watchdog::new(
        "silent_path_loss_resumes_on_first_redial",
        Duration::from_secs(120),
    );
    let dir = tempfile::tempdir().unwrap();
    let len = 64 << 20;
    // Fast enough to fill the kernel buffers behind the dead path.
    let rate = 8 << 20;
    let Setup {
        target,
        relay: _relay,
        proxy,
        mut pipe,
        client,
    } = through_proxy(&wd, dir.path(), len, rate, &[]);
    assert!(client.received.wait_for(4 << 20, Duration::from_secs(30)));
    let r = Resumption::start(&pipe, &client.received, Some(&target.up));
    proxy.blackhole_current();
    let resumed = r.wait(
        &pipe,
        &client.received,
        Some(&target.up),
        Duration::from_secs(60),
    );
    eprintln!("silent path loss: {resumed}");
    let status = pipe.wait_timeout(Duration::from_secs(60));
    check_bulk(client, target, len);
    assert!(
        status.is_some_and(|s| s.success()),
        "roam pipe: {status:?}; stderr:\n{}",
        pipe.log()
    );
    let session = resumed.session.expect("never resumed");
    // 5 s of silence before the transport is declared dead, then one dial.
    assert!(
        session < Duration::from_secs(8),
        "resumed only after {session:?}"
    );
}

/// A checking target, a relay behind a fault proxy, and a `roam pipe`
/// through the proxy moving `len` bytes each way at `rate`.
struct Setup {
    target: Target,
    relay: Proc,
    proxy: FaultProxy,
    pipe: Proc,
    client: ClientTransfer,
}

/// Starts a [`Setup`]; `extra` are the relay's further arguments. Every
/// process is watched by `wd`.
fn through_proxy(
    wd: &Watchdog,
    dir: &std::path::Path,
    len: u64,
    rate: u64,
    extra: &[&str],
) -> Setup {
    let target_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target_addr = target_listener.local_addr().unwrap();
    let target = Target::start(target_listener, UP_SEED, DOWN_SEED, len, Some(rate), false);
    let (relay, relay_addr) =
        start_relay(None, dir, "127.0.0.1:0", &target_addr.to_string(), extra);
    wd.watch(&relay);
    let proxy = FaultProxy::spawn(relay_addr).unwrap();
    let mut pipe = start_pipe(
        None,
        dir,
        &proxy.addr().to_string(),
        &target_addr.to_string(),
    );
    wd.watch(&pipe);
    let client = ClientTransfer::start(&mut pipe, len, Some(rate));
    Setup {
        target,
        relay,
        proxy,
        pipe,
        client,
    }
}

/// The relay's sessions as `roam status --json` reports them.
fn relay_sessions(dir: &std::path::Path) -> Vec<serde_json::Value> {
    let out = roam_command(None, &dir.join("relay-state"))
        .args(["status", "--json"])
        .output()
        .expect("roam status runs");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["processes"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter_map(|p| p["sessions"].as_array())
                .flatten()
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// A session suspended past the relay's `--park-after` is parked: it
/// becomes its continuation with its target connection, with no task or
/// buffer left (`roam status` says "parked"). When its client comes back,
/// the resume restores it: every byte written either way, before and
/// during the outage, arrives once, over the same target connection.
#[test]
fn a_parked_session_resumes_with_every_byte() {
    let wd = Watchdog::new(
        "a_parked_session_resumes_with_every_byte",
        Duration::from_secs(120),
    );
    let dir = tempfile::tempdir().unwrap();
    let len = 8 << 20;
    // Paced, so bytes are in flight both ways when the path goes dark.
    let rate = 2 << 20;
    let Setup {
        target,
        relay,
        proxy,
        mut pipe,
        client,
    } = through_proxy(&wd, dir.path(), len, rate, &["--park-after", "0s"]);
    assert!(client.received.wait_for(1 << 20, Duration::from_secs(30)));
    let active = relay_sessions(dir.path());
    assert_eq!(active.len(), 1, "{active:?}");
    assert_eq!(active[0]["parked"], false);
    // Dark until the relay has noticed (5 s of silence) and parked it.
    proxy.blackhole(true);
    let mut seen = Vec::new();
    let parked = wait_until(Duration::from_secs(30), || {
        seen = relay_sessions(dir.path());
        seen.len() == 1 && seen[0]["parked"] == true && seen[0]["state"] == "suspended"
    });
    assert!(parked, "never parked: {seen:?}\nrelay:\n{}", relay.log());
    let before = (client.sent.get(), client.received.get());
    proxy.blackhole(false);
    let status = pipe.wait_timeout(Duration::from_secs(90));
    let after_park = client.received.get();
    check_bulk(client, target, len);
    assert!(
        status.is_some_and(|s| s.success()),
        "roam pipe: {status:?}; stderr:\n{}",
        pipe.log()
    );
    assert!(
        after_park > before.1 && before.1 < len,
        "bytes must have flowed after the parked session resumed ({before:?} -> {after_park})"
    );
}
