//! Tests of the throwaway sshd fixture: a real `ssh` login and remote command,
//! on the loopback and inside a network namespace.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use roam_sim::netns::{self, NetPair, Side};
use roam_sim::sshd::{self, PrivateSshd};

#[test]
fn ssh_echo_on_loopback() {
    if let Err(why) = sshd::available() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let port = sshd::free_loopback_port().unwrap();
    let d =
        PrivateSshd::start(None, SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)).unwrap();
    let out = d.ssh_command(None).arg("echo hello").output().unwrap();
    assert!(
        out.status.success(),
        "ssh failed: {}\nsshd log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log().join("\n")
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");

    // Through a ProxyCommand (here a plain TCP relay, socat or nc if present,
    // else skipped): the shape roam's `pipe` is used in.
    let relay = ["socat", "nc.openbsd"].into_iter().find(|t| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {t}"))
            .output()
            .is_ok_and(|o| o.status.success())
    });
    match relay {
        Some("socat") => {
            let out = d
                .ssh_command(Some("socat - TCP:%h:%p"))
                .arg("echo via proxy")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(String::from_utf8_lossy(&out.stdout), "via proxy\n");
        }
        Some(nc) => {
            let out = d
                .ssh_command(Some(&format!("{nc} %h %p")))
                .arg("echo via proxy")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        None => eprintln!("no socat/nc: ProxyCommand path not exercised"),
    }
}

#[test]
fn ssh_into_a_namespace() {
    if let Err(why) = sshd::available().and_then(|_| netns::available()) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let pair = NetPair::new("sshd").unwrap();
    let at = SocketAddr::new(IpAddr::V4(pair.server_addr()), 2222);
    let d = PrivateSshd::start(Some((&pair, Side::Server)), at).unwrap();
    let mut ssh = d.ssh_command(None);
    ssh.arg("ip -o -4 addr show roam0");
    let out = pair.run_in(Side::Client, &ssh).unwrap();
    assert!(
        out.status.success(),
        "ssh failed: {}\nsshd log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log().join("\n")
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&pair.server_addr().to_string()), "{text}");
}
