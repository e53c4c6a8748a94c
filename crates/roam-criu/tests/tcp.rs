//! CRIU, driven by roam-criu, checkpoints an unmodified server in the middle
//! of a TCP conversation and restores it: the connection survives, and every
//! byte the client sent comes back once, in order (issue 12, the engine under
//! `roam migrate-process`).
//!
//! Topology: two network namespaces joined by a veth pair (roam-sim's
//! `NetPair`); the server, a Python echo server started with only its
//! network namespace changed (`nsenter --net`, so CRIU sees it in its own
//! mount namespace), runs on the server side; the client is a socket of this
//! test process made in the client namespace. The client streams 64-bit
//! sequence numbers and checks every echoed word.
//!
//! Needs root, iproute2, nftables, python3 and CRIU >= 4.1 (`$ROAM_CRIU` or
//! `criu` on `PATH`; `scripts/criu-build` builds one). Without them the tests
//! say why and pass, except when `$ROAM_CRIU` is set (CI sets it): then a
//! CRIU that does not work is a failure.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use roam_criu::{AddressLock, Criu, DumpOptions, Error, NetworkLock, RestoreOptions};
use roam_sim::echo::{alive, start_echo, EchoStream};
use roam_sim::netns::{self, Lan, NetPair, Side};

/// Port of the echo server (inside its own namespace: nothing else binds there).
const PORT: u16 = 7100;

/// CRIU, or `None` (with the reason printed) where the machine cannot run
/// these tests. Panics instead when `$ROAM_CRIU` is set.
fn criu() -> Option<Criu> {
    let required = std::env::var_os("ROAM_CRIU").is_some_and(|v| !v.is_empty());
    let skip = |why: String| {
        assert!(!required, "ROAM_CRIU is set but {why}");
        eprintln!("skipped: {why}");
    };
    if let Err(why) = netns::available() {
        skip(why);
        return None;
    }
    for tool in ["nft", "python3", "nsenter"] {
        if !netns::installed(tool) {
            skip(format!("{tool} is not installed"));
            return None;
        }
    }
    match Criu::locate() {
        Ok(c) => Some(c),
        Err(e) => {
            skip(format!("no usable CRIU: {e}"));
            None
        }
    }
}

/// CRIU running in the server side of a new namespace pair, and the pair.
fn setup(name: &str) -> Option<(Criu, NetPair)> {
    let criu = criu()?;
    let pair = NetPair::new(name).expect("network namespaces");
    let criu = criu.in_netns(pair.ns(Side::Server));
    Some((criu, pair))
}

/// [`start_echo`] on the pair's server side; also returns its address.
fn start_echo_on(pair: &NetPair) -> (Child, SocketAddr) {
    let addr = SocketAddr::from((pair.server_addr(), PORT));
    let child = start_echo(pair.ns(Side::Server), PORT, || {
        pair.tcp_connect(Side::Client, addr, Duration::from_secs(1))
    });
    (child, addr)
}

/// A dump of established connections under CRIU's nftables lock.
fn locked_tcp_dump() -> DumpOptions {
    DumpOptions {
        tcp_established: true,
        network_lock: NetworkLock::Nftables,
        ..DumpOptions::default()
    }
}

/// The restore that goes with [`locked_tcp_dump`].
fn locked_tcp_restore() -> RestoreOptions {
    RestoreOptions {
        tcp_established: true,
        network_lock: NetworkLock::Nftables,
        ..RestoreOptions::default()
    }
}

/// A live connection of an unmodified server survives dump and restore:
/// while the server is gone (dumped, not yet restored) the client keeps
/// writing; afterwards every byte comes back once and in order, and the
/// connection is the same one (no reset, no reconnect).
#[test]
fn an_echo_servers_live_connection_survives_dump_and_restore_with_every_byte() {
    let Some((criu, pair)) = setup("criu_tcp") else {
        return;
    };
    let (mut server, addr) = start_echo_on(&pair);
    let pid = i32::try_from(server.id()).expect("pid");
    let sock = pair
        .tcp_connect(Side::Client, addr, Duration::from_secs(5))
        .expect("connect");
    let local = sock.local_addr().expect("local addr");
    let stream = EchoStream::start(sock);
    stream.wait_echoed(4 << 20, Duration::from_secs(30));

    let images = tempfile::tempdir().expect("images dir");
    let dumped = criu
        .dump(pid, images.path(), &locked_tcp_dump())
        .unwrap_or_else(|e| panic!("{e}"));
    // CRIU killed it; reaping it frees its pid for the restore.
    let status = server.wait().expect("reap the dumped server");
    assert!(!status.success(), "the dumped server exited on its own");
    let at_dump = stream.echoed.load(Ordering::Relaxed);
    // The client keeps writing into the locked connection meanwhile.
    thread::sleep(Duration::from_millis(300));
    assert_eq!(
        stream.echoed.load(Ordering::Relaxed),
        at_dump,
        "bytes came back while the server was dumped"
    );

    let restored = criu
        .restore(images.path(), &locked_tcp_restore())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(restored.pid, pid, "CRIU restores the server's pid");
    assert!(alive(pid), "the restored server is not running");
    stream.wait_echoed(at_dump + (4 << 20), Duration::from_secs(30));
    let (sent, echoed) = stream.finish();
    assert_eq!(echoed, sent, "every byte sent came back");
    eprintln!(
        "{local} -> {addr}: {sent} bytes, dump {:?} ({} image bytes), restore {:?}",
        dumped.elapsed, dumped.image_bytes, restored.elapsed
    );
}

/// An epoll echo server whose epoll also watches a pipe (not a socket), and
/// a UDP socket registered under an fd number that was then closed and
/// taken by the listening socket (so the epoll lists fd 4 twice, for two
/// different sockets, and one of them is open only as a dup). CRIU must
/// tell the targets apart: the patched CRIU (`scripts/criu-patches/0004`)
/// matches a socket target by its inode and leaves the rest to `kcmp`.
const EPOLL_SERVER: &str = r#"
import os, select, socket, sys
ep = select.epoll()
spare = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ep.register(spare.fileno(), select.EPOLLIN)
keep = os.dup(spare.fileno())
spare.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(8)
ep.register(s.fileno(), select.EPOLLIN)
r, w = os.pipe()
ep.register(r, select.EPOLLIN)
conns = {}
while True:
    for fd, _ in ep.poll():
        if fd == s.fileno():
            c, _ = s.accept()
            conns[c.fileno()] = c
            ep.register(c.fileno(), select.EPOLLIN)
        elif fd in conns:
            d = conns[fd].recv(65536)
            if not d:
                ep.unregister(fd)
                conns.pop(fd).close()
            else:
                conns[fd].sendall(d)
"#;

/// The epoll's targets as its fdinfo lists them (`tfd: N ...` lines).
fn epoll_targets(pid: i32) -> Vec<String> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("list fds");
    for fd in fds.flatten() {
        let link = std::fs::read_link(fd.path()).unwrap_or_default();
        if link.to_string_lossy() == "anon_inode:[eventpoll]" {
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .expect("epoll fdinfo");
            return info
                .lines()
                .filter(|l| l.starts_with("tfd:"))
                .map(str::to_owned)
                .collect();
        }
    }
    panic!("{pid} has no epoll");
}

/// An epoll server survives dump and restore with every byte and every
/// epoll registration, including a pipe's and a socket's that the epoll
/// lists under an fd number now used by another socket.
#[test]
fn an_epoll_server_keeps_every_registration_and_byte_across_dump_and_restore() {
    let Some((criu, pair)) = setup("criu_epoll") else {
        return;
    };
    let addr = SocketAddr::from((pair.server_addr(), PORT));
    let mut server = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", pair.ns(Side::Server)))
        .args(["--", "setsid", "python3", "-c", EPOLL_SERVER])
        .arg(PORT.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the epoll server");
    let pid = i32::try_from(server.id()).expect("pid");
    let deadline = Instant::now() + Duration::from_secs(10);
    let sock = loop {
        match pair.tcp_connect(Side::Client, addr, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "epoll server never listened: {e}"
                );
                thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let stream = EchoStream::start(sock);
    stream.wait_echoed(2 << 20, Duration::from_secs(30));
    let before = epoll_targets(pid);
    // The UDP socket, the listener (both as fd 4), the pipe, the connection.
    assert_eq!(before.len(), 4, "epoll targets before: {before:?}");

    let images = tempfile::tempdir().expect("images dir");
    criu.dump(pid, images.path(), &locked_tcp_dump())
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = server.wait();
    let at_dump = stream.echoed.load(Ordering::Relaxed);
    let restored = criu
        .restore(images.path(), &locked_tcp_restore())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(restored.pid, pid);
    let after = epoll_targets(pid);
    assert_eq!(
        after.len(),
        before.len(),
        "epoll targets before {before:?}, after {after:?}"
    );
    stream.wait_echoed(at_dump + (2 << 20), Duration::from_secs(30));
    let (sent, echoed) = stream.finish();
    assert_eq!(echoed, sent, "every byte sent came back");
    // A new connection is accepted through the restored epoll.
    let mut again = pair
        .tcp_connect(Side::Client, addr, Duration::from_secs(5))
        .expect("connect after the restore");
    again
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    std::io::Write::write_all(&mut again, b"still here").expect("write");
    let mut buf = [0u8; 10];
    std::io::Read::read_exact(&mut again, &mut buf).expect("echo after the restore");
    assert_eq!(&buf, b"still here");
    // The pair kills the restored server with its namespace.
}

/// A dump that cannot be done leaves the process running and says why, with
/// CRIU's own message and its log.
#[test]
fn a_dump_without_tcp_established_fails_precisely_and_leaves_the_server_running() {
    let Some((criu, pair)) = setup("criu_refuse") else {
        return;
    };
    let (mut server, addr) = start_echo_on(&pair);
    let pid = i32::try_from(server.id()).expect("pid");
    let sock = pair
        .tcp_connect(Side::Client, addr, Duration::from_secs(5))
        .expect("connect");
    let stream = EchoStream::start(sock);
    stream.wait_echoed(1 << 20, Duration::from_secs(30));
    let images = tempfile::tempdir().expect("images dir");
    let err = criu
        .dump(pid, images.path(), &DumpOptions::default())
        .expect_err("an established connection without tcp_established must not dump");
    let text = err.to_string();
    assert!(matches!(err, Error::Failed { op: "dump", .. }), "{err:?}");
    assert!(
        text.contains(&images.path().join("dump.log").display().to_string()),
        "names the log: {text}"
    );
    assert!(
        text.to_lowercase().contains("tcp") || text.contains("established"),
        "says it is the TCP connection: {text}"
    );
    assert!(alive(pid), "a failed dump left the server stopped or dead");
    // And the connection still works.
    let at = stream.echoed.load(Ordering::Relaxed);
    stream.wait_echoed(at + (1 << 20), Duration::from_secs(30));
    let (sent, echoed) = stream.finish();
    assert_eq!(echoed, sent);
    let _ = server.kill();
    let _ = server.wait();
}

/// A move whose far side fails rolls back: the post-dump step sees complete
/// images while the server is frozen (no byte echoed meanwhile), refuses,
/// and CRIU gives the server back its sockets. The server runs on with the
/// same connection and every byte, and the dump names the step's reason.
#[test]
fn a_refused_post_dump_step_rolls_the_dump_back_and_the_connection_carries_on() {
    let Some((criu, pair)) = setup("criu_rollback") else {
        return;
    };
    let (mut server, addr) = start_echo_on(&pair);
    let pid = i32::try_from(server.id()).expect("pid");
    let sock = pair
        .tcp_connect(Side::Client, addr, Duration::from_secs(5))
        .expect("connect");
    let stream = EchoStream::start(sock);
    stream.wait_echoed(2 << 20, Duration::from_secs(30));
    let images = tempfile::tempdir().expect("images dir");
    let mut seen: Option<(bool, u64, u64)> = None;
    let err = criu
        .dump_then(pid, images.path(), &locked_tcp_dump(), &mut |dir| {
            // Bytes echoed before the freeze may still sit in the
            // client's receive buffer (tcp_rmem allows 32 MiB here): the
            // client drains them first, then nothing may come back.
            let mut before = stream.echoed.load(Ordering::Relaxed);
            let settle = Instant::now();
            while settle.elapsed() < Duration::from_secs(5) {
                thread::sleep(Duration::from_millis(100));
                let now = stream.echoed.load(Ordering::Relaxed);
                if now == before {
                    break;
                }
                before = now;
            }
            thread::sleep(Duration::from_millis(300));
            let after = stream.echoed.load(Ordering::Relaxed);
            seen = Some((
                dir.join("inventory.img").exists() && dir.join("pages-1.img").exists(),
                before,
                after,
            ));
            Err("the destination ran out of disk".into())
        })
        .expect_err("a refused post-dump step must fail the dump");
    assert!(
        matches!(&err, Error::Aborted { reason } if reason == "the destination ran out of disk"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("runs on here"),
        "says where the process is: {err}"
    );
    let (complete, before, after) = seen.expect("the post-dump step never ran");
    assert!(complete, "the step ran before the images were complete");
    assert_eq!(before, after, "bytes came back while the server was frozen");
    assert!(alive(pid), "the rolled-back server is not running");
    assert!(
        server.try_wait().expect("try_wait").is_none(),
        "the rolled-back server exited"
    );
    let at = stream.echoed.load(Ordering::Relaxed);
    stream.wait_echoed(at + (2 << 20), Duration::from_secs(30));
    let (sent, echoed) = stream.finish();
    assert_eq!(echoed, sent, "every byte sent came back");
    let _ = server.kill();
    let _ = server.wait();
}

/// Dumping a process that does not exist is a precise error, not a hang.
#[test]
fn dumping_a_missing_process_says_so() {
    let Some((criu, _pair)) = setup("criu_missing") else {
        return;
    };
    let images = tempfile::tempdir().expect("images dir");
    // Pids are below /proc/sys/kernel/pid_max (at most 2^22).
    let missing = 4_194_303;
    assert!(!Path::new(&format!("/proc/{missing}")).exists());
    let err = criu
        .dump(missing, images.path(), &DumpOptions::default())
        .expect_err("no such process");
    assert!(matches!(err, Error::Failed { op: "dump", .. }), "{err:?}");
}

/// The process moves to another host and takes its address along: dumped on
/// host A, its service address taken off A and put on B, restored on B, the
/// client's host told to look the address up again (what B's gratuitous ARP
/// would do). The client's connection carries on with every byte, and host
/// A no longer has the process. roam's address lock (not CRIU's) keeps the
/// gaps quiet: on A, TCP for the address is dropped from the dump until the
/// address has left; on B, from its arrival until the restore is done.
#[test]
fn a_live_connection_follows_its_server_to_another_host_with_its_address() {
    let Some(criu) = criu() else {
        return;
    };
    const CLIENT: usize = 0;
    const A: usize = 1;
    const B: usize = 2;
    let lan = Lan::new("criu_move", 3).expect("LAN");
    let service = lan.subnet_addr(100);
    lan.add_addr(A, service).expect("service address on A");
    let addr = SocketAddr::from((service, PORT));
    let mut server = start_echo(lan.ns(A), PORT, || {
        lan.tcp_connect(CLIENT, addr, Duration::from_secs(1))
    });
    let pid = i32::try_from(server.id()).expect("pid");
    let sock = lan
        .tcp_connect(CLIENT, addr, Duration::from_secs(5))
        .expect("connect");
    let stream = EchoStream::start(sock);
    stream.wait_echoed(4 << 20, Duration::from_secs(30));

    let images = tempfile::tempdir().expect("images dir");
    let started = Instant::now();
    // roam's address lock instead of CRIU's: on A from before the dump
    // until the address has left, on B from before it arrives until the
    // restore is done.
    let lock_a = AddressLock::new(Some(lan.ns(A)), service.into()).expect("lock on A");
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
        .unwrap_or_else(|e| panic!("{e}"));
    server.wait().expect("reap the dumped server");
    let at_dump = stream.echoed.load(Ordering::Relaxed);
    lan.del_addr(A, service).expect("service address off A");
    lock_a.release().expect("unlock A");
    let lock_b = AddressLock::new(Some(lan.ns(B)), service.into()).expect("lock on B");
    lan.add_addr(B, service).expect("service address on B");
    let restored = criu
        .in_netns(lan.ns(B))
        .restore(
            images.path(),
            &RestoreOptions {
                tcp_established: true,
                network_lock: NetworkLock::Skip,
                ..RestoreOptions::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
    lock_b.release().expect("unlock B");
    lan.forget_neighbor(service).expect("neighbor caches");
    let moved = started.elapsed();
    assert_eq!(restored.pid, pid);
    assert!(alive(pid), "the restored server is not running");
    let in_b = Command::new("ip")
        .args(["netns", "pids", lan.ns(B)])
        .output()
        .expect("ip netns pids");
    assert!(
        String::from_utf8_lossy(&in_b.stdout)
            .split_whitespace()
            .any(|p| p == pid.to_string()),
        "the restored server is not on host B"
    );
    stream.wait_echoed(at_dump + (4 << 20), Duration::from_secs(30));
    let (sent, echoed) = stream.finish();
    assert_eq!(echoed, sent, "every byte sent came back");
    eprintln!(
        "moved A -> B with {service}: {sent} bytes verified; dump {:?}, restore {:?}, \
         dump to address back {moved:?}, {} image bytes",
        dumped.elapsed, restored.elapsed, dumped.image_bytes
    );
}

/// roam's address lock drops TCP for its address while held, in its
/// namespace only, and is gone once released or dropped.
#[test]
fn the_address_lock_drops_tcp_for_its_address_until_released() {
    let Some((_criu, pair)) = setup("criu_lock") else {
        return;
    };
    let (mut server, addr) = start_echo_on(&pair);
    let connect = || pair.tcp_connect(Side::Client, addr, Duration::from_millis(500));
    connect().expect("reachable before the lock");
    let lock = AddressLock::new(Some(pair.ns(Side::Server)), addr.ip()).expect("lock");
    let err = connect().expect_err("a locked address must not answer");
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::TimedOut,
        "dropped silently, not refused: {err}"
    );
    lock.release().expect("release");
    connect().expect("reachable after release");
    {
        let _dropped = AddressLock::new(Some(pair.ns(Side::Server)), addr.ip()).expect("lock");
        assert!(connect().is_err());
    }
    connect().expect("reachable once the lock is dropped");
    let tables = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", pair.ns(Side::Server)))
        .args(["--", "nft", "list", "tables"])
        .output()
        .expect("nft list tables");
    assert!(
        !String::from_utf8_lossy(&tables.stdout).contains("roam_lock"),
        "a lock table was left behind: {}",
        String::from_utf8_lossy(&tables.stdout)
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// Not a test on its own: the holder process of
/// [`a_lock_whose_holder_is_killed_outright_is_lifted_with_it`], run by it
/// (`ROAM_LOCK_HOLDER=NS ADDR`): takes the address lock, says `locked`,
/// and waits to be killed.
#[test]
#[ignore = "run by a_lock_whose_holder_is_killed_outright_is_lifted_with_it"]
fn lock_holder() {
    let Ok(spec) = std::env::var("ROAM_LOCK_HOLDER") else {
        return;
    };
    let (ns, addr) = spec.split_once(' ').expect("NS ADDR");
    let lock = AddressLock::new(Some(ns), addr.parse().expect("an address")).expect("lock");
    println!("locked {}", lock.table());
    std::thread::sleep(Duration::from_secs(60));
}

/// A holder killed outright (SIGKILL: no drop, no release) does not leave
/// its address locked: the lock's nftables table is owned by an `nft`
/// process reading the holder's pipe, and ends with it. (Before, a
/// `migrate-process` killed mid-move left its process unreachable at the
/// source for good.)
#[test]
fn a_lock_whose_holder_is_killed_outright_is_lifted_with_it() {
    use std::io::BufRead;
    let Some((_criu, pair)) = setup("criu_lkill") else {
        return;
    };
    let (mut server, addr) = start_echo_on(&pair);
    let connect = || pair.tcp_connect(Side::Client, addr, Duration::from_millis(500));
    connect().expect("reachable before the lock");
    let mut holder = Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "lock_holder", "--ignored", "--nocapture"])
        .env(
            "ROAM_LOCK_HOLDER",
            format!("{} {}", pair.ns(Side::Server), addr.ip()),
        )
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the holder");
    let mut lines = std::io::BufReader::new(holder.stdout.take().expect("piped")).lines();
    let table = loop {
        let line = lines
            .next()
            .expect("the holder ended before it locked")
            .expect("read");
        if let Some(t) = line.strip_prefix("locked ") {
            break t.to_string();
        }
    };
    let tables = || {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", pair.ns(Side::Server)))
            .args(["--", "nft", "list", "tables"])
            .output()
            .expect("nft list tables");
        assert!(
            out.status.success(),
            "nft list tables: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(tables().contains(&table), "the lock's table: {}", tables());
    connect().expect_err("a locked address must not answer");
    holder.kill().expect("SIGKILL the holder");
    holder.wait().expect("reap the holder");
    // The holder's nft reads the end of its pipe and exits: bounded wait.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while tables().contains(&table) {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed holder's lock is still there: {}",
            tables()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    connect().expect("reachable once the holder is gone");
    let _ = server.kill();
    let _ = server.wait();
}

/// The connection lock holds back the packets of the loopback connections
/// it names, both ways, and no others: bytes written on a held connection
/// do not arrive while it is held and do arrive, retransmitted, once it is
/// released (as CRIU's unsent data does when both ends of a loopback
/// connection are restored one after the other); another loopback
/// connection in the same namespace carries on meanwhile.
#[test]
fn the_connection_lock_holds_a_loopback_connections_packets_until_released() {
    use std::io::{Read, Write};
    let Some((_criu, pair)) = setup("criu_conns") else {
        return;
    };
    // Two loopback connections made inside the server namespace.
    let conns = pair
        .in_ns(Side::Server, || {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            let mut out = Vec::new();
            for _ in 0..2 {
                let c =
                    std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
                let (a, _) = l.accept().expect("accept");
                out.push((c, a));
            }
            out
        })
        .expect("in the namespace");
    let [(mut held_c, mut held_a), (mut free_c, mut free_a)] =
        <[_; 2]>::try_from(conns).expect("two connections");
    for s in [&held_a, &held_c, &free_a] {
        s.set_read_timeout(Some(Duration::from_millis(700)))
            .expect("timeout");
    }
    let ends = (
        held_c.local_addr().expect("local"),
        held_c.peer_addr().expect("peer"),
    );
    let lock = AddressLock::connections(Some(pair.ns(Side::Server)), &[ends]).expect("lock");
    let mut buf = [0u8; 16];
    held_c.write_all(b"to the server").expect("write");
    held_a.write_all(b"to the client").expect("write");
    for (s, what) in [
        (&mut held_a, "client to server"),
        (&mut held_c, "server to client"),
    ] {
        let err = s.read(&mut buf).expect_err("a held connection delivered");
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{what}: {err}"
        );
    }
    free_c.write_all(b"free").expect("write");
    free_a
        .read_exact(&mut buf[..4])
        .expect("another connection is not held");
    assert_eq!(&buf[..4], b"free");
    lock.release().expect("release");
    for (s, want) in [
        (&mut held_a, b"to the server"),
        (&mut held_c, b"to the client"),
    ] {
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.read_exact(&mut buf[..want.len()])
            .expect("retransmitted after the release");
        assert_eq!(&buf[..want.len()], want);
    }
    assert!(
        AddressLock::connections(Some(pair.ns(Side::Server)), &[]).is_err(),
        "an empty list is refused"
    );
}

/// Not a test on its own: the holder process of
/// [`a_pipe_room_whose_holder_is_killed_outright_is_put_back`], run by it
/// (`ROAM_PIPE_ROOM_HOLDER=1`): makes the room, says `raised`, and waits to
/// be killed.
#[test]
#[ignore = "run by a_pipe_room_whose_holder_is_killed_outright_is_put_back"]
fn pipe_room_holder() {
    if std::env::var_os("ROAM_PIPE_ROOM_HOLDER").is_none() {
        return;
    }
    let room = roam_criu::PipeRoom::make().expect("make room");
    println!("raised {}", room.raised());
    std::thread::sleep(Duration::from_secs(60));
}

/// `fs.pipe-max-size` raised for CRIU's page pipes (`PipeRoom`) goes back
/// to its old value when the room is dropped, and when its holder is
/// killed outright (SIGKILL: no drop): a `migrate-process` killed mid-move
/// left it at 4 MiB for good before.
#[test]
fn a_pipe_room_whose_holder_is_killed_outright_is_put_back() {
    use std::io::BufRead;
    const PATH: &str = "/proc/sys/fs/pipe-max-size";
    let read = || std::fs::read_to_string(PATH).expect("read pipe-max-size");
    let old = read();
    let caps = std::fs::read_to_string("/proc/self/status").expect("status");
    let cap_sys_resource = caps
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|c| c & (1 << 24) != 0);
    if cap_sys_resource || old.trim().parse::<u64>().unwrap_or(0) >= roam_criu::LAZY_PIPE_BYTES {
        eprintln!(
            "skipped: nothing to raise here (CAP_SYS_RESOURCE {cap_sys_resource}, \
             fs.pipe-max-size {})",
            old.trim()
        );
        return;
    }
    // Whatever fails below, the machine keeps its value.
    struct PutBack(String);
    impl Drop for PutBack {
        fn drop(&mut self) {
            let _ = std::fs::write(PATH, self.0.trim());
        }
    }
    let _put_back = PutBack(old.clone());

    // Dropped: back at once.
    let room = roam_criu::PipeRoom::make().expect("make room");
    assert!(room.raised());
    assert_eq!(read().trim(), "4194304");
    drop(room);
    assert_eq!(read(), old, "not put back when dropped");

    // Killed outright: its watcher puts it back.
    let mut holder = Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "pipe_room_holder", "--ignored", "--nocapture"])
        .env("ROAM_PIPE_ROOM_HOLDER", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the holder");
    let mut lines = std::io::BufReader::new(holder.stdout.take().expect("piped")).lines();
    loop {
        let line = lines
            .next()
            .expect("the holder ended before it made room")
            .expect("read");
        if line == "raised true" {
            break;
        }
    }
    assert_eq!(read().trim(), "4194304");
    holder.kill().expect("SIGKILL the holder");
    holder.wait().expect("reap the holder");
    let deadline = Instant::now() + Duration::from_secs(5);
    while read() != old {
        assert!(
            Instant::now() < deadline,
            "fs.pipe-max-size is still {} 5 s after its holder was killed (was {})",
            read().trim(),
            old.trim()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
