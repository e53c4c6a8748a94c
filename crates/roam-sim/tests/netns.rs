//! Tests of the network-namespace fixture: a real TCP transfer between two
//! namespaces, link down/up, address changes, and cleanup (also on panic).
//! Skipped, with the reason printed, when namespaces cannot be made here.

use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use roam_sim::netns::{self, NetPair, Side};

macro_rules! require_netns {
    () => {
        if let Err(why) = netns::available() {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
}

const PORT: u16 = 5000;
const T: Duration = Duration::from_secs(5);

fn ours(prefix: &str) -> Vec<String> {
    let stem = format!("roam-{prefix}-{}-", std::process::id());
    netns::roam_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&stem))
        .collect()
}

/// Echo server on `side` at its address: echoes each accepted connection
/// until EOF, for `conns` connections.
fn echo_server(pair: &NetPair, conns: usize) -> thread::JoinHandle<Vec<SocketAddr>> {
    let at = SocketAddr::V4(SocketAddrV4::new(pair.server_addr(), PORT));
    let l = pair
        .tcp_listen(Side::Server, at)
        .expect("listen in server ns");
    thread::spawn(move || {
        let mut peers = Vec::new();
        for _ in 0..conns {
            let (mut s, peer) = l.accept().expect("accept");
            peers.push(peer);
            let mut r = s.try_clone().expect("clone");
            std::io::copy(&mut r, &mut s).ok();
        }
        peers
    })
}

#[test]
fn transfer_link_flap_and_address_changes() {
    require_netns!();
    let pair = NetPair::new("fixt").expect("make pair");
    assert_eq!(ours("fixt").len(), 2);
    let srv = SocketAddr::V4(SocketAddrV4::new(pair.server_addr(), PORT));
    let server = echo_server(&pair, 2);

    // 1. A transfer across the veth, byte-exact.
    let mut c = pair.tcp_connect(Side::Client, srv, T).expect("connect");
    c.set_read_timeout(Some(T)).unwrap();
    let data: Vec<u8> = (0..4_000_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
    let mut w = c.try_clone().unwrap();
    let d2 = data.clone();
    let writer = thread::spawn(move || w.write_all(&d2).unwrap());
    let mut got = vec![0u8; data.len()];
    c.read_exact(&mut got).unwrap();
    writer.join().unwrap();
    assert!(got == data);

    // 2. Link down: the connection stalls but survives a short outage.
    pair.link_down().unwrap();
    c.write_all(b"during outage").unwrap();
    c.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut b = [0u8; 13];
    assert!(c.read_exact(&mut b).is_err(), "data crossed a downed link");
    // New connections fail while down.
    assert!(pair
        .tcp_connect(Side::Client, srv, Duration::from_millis(300))
        .is_err());
    let up_at = Instant::now();
    pair.link_up().unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.read_exact(&mut b).expect("data after link up");
    assert_eq!(&b, b"during outage");
    eprintln!("bare TCP resumed {:?} after link up", up_at.elapsed());
    drop(c);

    // 3. Client address change: the server sees connections from the new one.
    let old = pair.change_client_addr(pair.subnet_addr(11)).unwrap();
    assert_eq!(pair.client_addr(), pair.subnet_addr(11));
    assert_ne!(old, pair.client_addr());
    let mut c = pair
        .tcp_connect(Side::Client, srv, T)
        .expect("connect from new addr");
    c.write_all(b"x").unwrap();
    c.read_exact(&mut b[..1]).unwrap();
    drop(c);

    // 4. Server address change: the old address stops answering.
    let old_srv = srv;
    pair.change_server_addr(pair.subnet_addr(12)).unwrap();
    assert!(pair
        .tcp_connect(Side::Client, old_srv, Duration::from_millis(500))
        .is_err());
    // The listener was bound to the old address; listen again on the new one.
    let new_srv = SocketAddr::V4(SocketAddrV4::new(pair.server_addr(), PORT));
    let l2 = pair.tcp_listen(Side::Server, new_srv).unwrap();
    let c = pair
        .tcp_connect(Side::Client, new_srv, T)
        .expect("connect to new server addr");
    let (_s, peer) = l2.accept().unwrap();
    assert_eq!(peer.ip(), std::net::IpAddr::V4(pair.subnet_addr(11)));
    drop(c);

    let peers = server.join().unwrap();
    assert_eq!(peers[0].ip(), std::net::IpAddr::V4(old));
    assert_eq!(peers[1].ip(), std::net::IpAddr::V4(pair.subnet_addr(11)));
    drop(pair);
    assert!(
        ours("fixt").is_empty(),
        "namespaces left behind: {:?}",
        ours("fixt")
    );
}

#[test]
fn run_spawn_and_cleanup_kills_processes() {
    require_netns!();
    let pair = NetPair::new("procs").expect("make pair");
    let out = pair
        .run_in(
            Side::Client,
            Command::new("ip").args(["-o", "-4", "addr", "show", "roam0"]),
        )
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{}/24", pair.client_addr())),
        "{text}"
    );

    // Names for programs in the namespace, changeable while they run.
    let srv = std::net::IpAddr::V4(pair.server_addr());
    pair.set_hosts(Side::Client, &[("relay", srv)]).unwrap();
    let out = pair
        .run_in(
            Side::Client,
            Command::new("getent").args(["hosts", "relay"]),
        )
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains(&srv.to_string()));
    let moved = std::net::IpAddr::V4(pair.subnet_addr(99));
    pair.set_hosts(Side::Client, &[("relay", moved)]).unwrap();
    let out = pair
        .run_in(
            Side::Client,
            Command::new("getent").args(["hosts", "relay"]),
        )
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains(&moved.to_string()));
    let hosts_dir = format!("/etc/netns/{}", pair.ns(Side::Client));

    // A process left running inside is killed when the pair drops.
    let mut sleeper = pair
        .command(Side::Server, "sleep")
        .arg("1000")
        .spawn()
        .expect("spawn sleep in ns");
    let pid = sleeper.id();
    let guarded = pair
        .spawn_in(Side::Client, Command::new("sleep").arg("1000"))
        .unwrap();
    let guarded_pid = guarded.id();
    // `ip netns exec` enters the namespace after it was spawned: on a loaded
    // machine that takes a moment, so look for the pid for up to 10 s.
    let in_ns = || {
        let ns_pids = Command::new("ip")
            .args(["netns", "pids", pair.ns(Side::Server)])
            .output()
            .unwrap();
        String::from_utf8_lossy(&ns_pids.stdout)
            .split_whitespace()
            .any(|p| p == pid.to_string())
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !in_ns() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(in_ns(), "pid {pid} never appeared in the server namespace");
    drop(guarded);
    assert!(
        !std::path::Path::new(&format!("/proc/{guarded_pid}/cmdline")).exists()
            || std::fs::read_to_string(format!("/proc/{guarded_pid}/stat"))
                .map_or(true, |s| s.contains(") Z"))
    );

    drop(pair);
    let st = sleeper.wait().unwrap();
    assert!(!st.success(), "sleep should have been killed");
    assert!(ours("procs").is_empty());
    assert!(
        !std::path::Path::new(&hosts_dir).exists(),
        "{hosts_dir} left behind"
    );
}

#[test]
fn cleanup_on_panic() {
    require_netns!();
    let r = std::panic::catch_unwind(|| {
        let _pair = NetPair::new("panics").expect("make pair");
        assert_eq!(ours("panics").len(), 2);
        panic!("test failure inside a netns test");
    });
    assert!(r.is_err());
    assert!(
        ours("panics").is_empty(),
        "left behind: {:?}",
        ours("panics")
    );
}

#[test]
fn duplicate_prefix_is_refused() {
    require_netns!();
    let _a = NetPair::new("dup").expect("make pair");
    let b = NetPair::new("dup");
    assert_eq!(b.unwrap_err().kind(), std::io::ErrorKind::AlreadyExists);
    assert!(NetPair::new("bad-prefix").is_err());
}

/// A `Lan`'s hosts reach each other over the bridge; an address moved from
/// one host to another (removed, added, neighbors told) is then served by the
/// new host; dropping the LAN removes all its namespaces.
#[test]
fn a_lan_address_moved_between_hosts_is_reached_at_its_new_host() {
    require_netns!();
    let lan = netns::Lan::new("lan_move", 3).expect("LAN");
    assert_eq!(ours("lan_move").len(), 4, "a switch and three hosts");
    let service = lan.subnet_addr(100);
    let at = SocketAddr::from((service, PORT));
    // One listener on each candidate host, each answering with its own name.
    let serve = |host: usize, name: &'static [u8]| {
        lan.add_addr(host, service).expect("add the address");
        let l = lan
            .in_ns(host, || std::net::TcpListener::bind(at))
            .expect("enter ns")
            .expect("listen");
        thread::spawn(move || {
            if let Ok((mut c, _)) = l.accept() {
                let _ = c.write_all(name);
            }
        })
    };
    let ask = || {
        let mut c = lan.tcp_connect(0, at, T).expect("connect");
        let mut answer = Vec::new();
        c.read_to_end(&mut answer).expect("read");
        answer
    };
    let first = serve(1, b"host 1");
    assert_eq!(ask(), b"host 1");
    first.join().expect("host 1");
    lan.del_addr(1, service).expect("remove the address");
    let second = serve(2, b"host 2");
    lan.forget_neighbor(service).expect("neighbors");
    assert_eq!(
        ask(),
        b"host 2",
        "the moved address is served by its new host"
    );
    second.join().expect("host 2");
    // The hosts' own addresses stay reachable across the bridge.
    let own = SocketAddr::from((lan.addr(2), PORT + 1));
    let l = lan
        .in_ns(2, || std::net::TcpListener::bind(own))
        .expect("enter ns")
        .expect("listen");
    let t = thread::spawn(move || l.accept().map(|_| ()));
    lan.tcp_connect(1, own, T).expect("host 1 reaches host 2");
    t.join().expect("accept").expect("accepted");
    drop(lan);
    assert!(
        ours("lan_move").is_empty(),
        "namespaces left: {:?}",
        ours("lan_move")
    );
}
