//! What a migration needs to know and change on a host: the process tree's
//! sockets and addresses (`/proc`), the host's interface addresses, moving
//! an address on and off (`ip`), and telling the neighbours where it went
//! (a gratuitous ARP from a packet socket).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use crate::cli::CliError;

/// The sockets of a process tree, as a migration reports them.
#[derive(Debug, Default)]
pub(crate) struct ProcessInfo {
    /// The root's pid.
    pub(crate) pid: i32,
    /// The root's command name (`/proc/PID/comm`).
    pub(crate) name: String,
    /// The tree's processes (the root and its descendants): every one of
    /// their pids must be free again before the tree can be restored where
    /// these pids are visible.
    pub(crate) pids: Vec<i32>,
    /// Established TCP connections.
    pub(crate) established: usize,
    /// Listening TCP sockets.
    pub(crate) listening: usize,
    /// UDP sockets.
    pub(crate) udp: usize,
    /// Local addresses the tree's sockets are bound to, wildcards and
    /// loopback left out: the candidates for the process's own address.
    pub(crate) addresses: BTreeSet<IpAddr>,
    /// Established TCP connections over loopback (this end, the peer):
    /// where both ends are the tree's, both are restored at the
    /// destination, and their packets must be held back until both are.
    pub(crate) loopback: Vec<(SocketAddr, SocketAddr)>,
}

impl ProcessInfo {
    /// `PID (name)`.
    pub(crate) fn label(&self) -> String {
        format!("{} ({})", self.pid, self.name)
    }

    /// `3 TCP connections, 1 listening socket, 0 UDP sockets`.
    pub(crate) fn sockets(&self) -> String {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        format!(
            "{} TCP connection{}, {} listening socket{}, {} UDP socket{}",
            self.established,
            s(self.established),
            self.listening,
            s(self.listening),
            self.udp,
            s(self.udp)
        )
    }
}

/// Which pid space process `pid` (this process if `None`) lives in: the
/// machine's boot id and the pid namespace's identity
/// (`BOOT_ID/pid:[INODE]`; the initial namespace has the same inode on
/// every machine). Empty if either cannot be read.
pub(crate) fn pid_space(pid: Option<i32>) -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::read_link(match pid {
        Some(p) => format!("/proc/{p}/ns/pid"),
        None => "/proc/self/ns/pid".to_string(),
    })
    .map(|l| l.to_string_lossy().into_owned())
    .unwrap_or_default();
    match (boot.trim(), ns.as_str()) {
        ("", _) | (_, "") => String::new(),
        (boot, ns) => format!("{boot}/{ns}"),
    }
}

/// The pids of the tree rooted at `pid`: it and its descendants.
fn tree(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() && out.len() < 100_000 {
        let p = out[i];
        i += 1;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            out.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
    }
    out
}

/// Inspects the process tree rooted at `pid`: a precise error if there is
/// no such process or it cannot be read (not root).
pub(crate) fn inspect(pid: i32) -> Result<ProcessInfo, CliError> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).map_err(|e| {
        CliError(if e.kind() == std::io::ErrorKind::NotFound {
            format!("no process {pid} here")
        } else {
            format!("cannot read process {pid}: {e}")
        })
    })?;
    let pids = tree(pid);
    let mut inodes = BTreeSet::new();
    for p in &pids {
        let dir = std::fs::read_dir(format!("/proc/{p}/fd")).map_err(|e| {
            CliError(format!(
                "cannot list the descriptors of process {p}: {e} (moving a process needs root)"
            ))
        })?;
        for fd in dir.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let t = target.to_string_lossy();
                if let Some(n) = t
                    .strip_prefix("socket:[")
                    .and_then(|r| r.strip_suffix(']'))
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    inodes.insert(n);
                }
            }
        }
    }
    let mut info = ProcessInfo {
        pid,
        name: comm.trim().to_owned(),
        pids,
        ..ProcessInfo::default()
    };
    for table in ["tcp", "tcp6", "udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for row in parse_sockets(&text) {
            if !inodes.contains(&row.inode) {
                continue;
            }
            match (table.starts_with("tcp"), row.state) {
                (true, 0x01) => {
                    info.established += 1;
                    if row.local.is_loopback() && row.remote.ip().is_loopback() {
                        info.loopback
                            .push((SocketAddr::new(row.local, row.local_port), row.remote));
                    }
                }
                (true, 0x0A) => info.listening += 1,
                (true, _) => {}
                (false, _) => info.udp += 1,
            }
            if !row.local.is_unspecified() && !row.local.is_loopback() {
                info.addresses.insert(row.local);
            }
        }
    }
    Ok(info)
}

/// One row of `/proc/net/{tcp,udp}[6]`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SocketRow {
    /// The local address (IPv4-mapped IPv6 addresses as IPv4).
    pub(crate) local: IpAddr,
    /// The local port.
    pub(crate) local_port: u16,
    /// The remote address and port (unspecified for a listening socket).
    pub(crate) remote: SocketAddr,
    /// The TCP state (1 established, 10 listening; 7 for unconnected UDP).
    pub(crate) state: u8,
    /// The socket's inode.
    pub(crate) inode: u64,
}

/// Parses a `/proc/net/{tcp,udp}[6]` table (rows it cannot read are skipped).
pub(crate) fn parse_sockets(text: &str) -> Vec<SocketRow> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, local_port) = parse_hex_endpoint(f.get(1)?)?;
            let (remote, remote_port) = parse_hex_endpoint(f.get(2)?)?;
            let state = u8::from_str_radix(f.get(3)?, 16).ok()?;
            let inode = f.get(9)?.parse().ok()?;
            Some(SocketRow {
                local,
                local_port,
                remote: SocketAddr::new(remote, remote_port),
                state,
                inode,
            })
        })
        .collect()
}

/// The kernel's hex form of an endpoint: `ADDR:PORT` (the port in
/// big-endian hex).
fn parse_hex_endpoint(hex: &str) -> Option<(IpAddr, u16)> {
    let (addr, port) = hex.split_once(':')?;
    Some((parse_hex_addr(addr)?, u16::from_str_radix(port, 16).ok()?))
}

/// The kernel's hex form of an address: 8 digits (IPv4) or 32 (IPv6), each
/// 32-bit word in host (little-endian) order.
fn parse_hex_addr(hex: &str) -> Option<IpAddr> {
    let word = |i: usize| -> Option<[u8; 4]> {
        let w = u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok()?;
        Some(w.to_le_bytes())
    };
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            let v6 = Ipv6Addr::from(b);
            Some(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4))
        }
        _ => None,
    }
}

/// An address on one of this host's interfaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IfAddr {
    /// The interface (`eth0`).
    pub(crate) dev: String,
    /// The address.
    pub(crate) addr: IpAddr,
    /// Its prefix length.
    pub(crate) prefix: u8,
}

impl IfAddr {
    /// `ADDR/PREFIX`.
    pub(crate) fn cidr(&self) -> String {
        format!("{}/{}", self.addr, self.prefix)
    }

    /// Whether `ip` is inside this address's subnet.
    pub(crate) fn covers(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix.min(32)));
                let mask = mask.unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix.min(128)));
                let mask = mask.unwrap_or(0);
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }
}

/// Parses `ADDR/PREFIX` (`10.1.2.3/24`); a bare address gets the full
/// prefix (/32 or /128).
pub(crate) fn parse_cidr(text: &str) -> Result<(IpAddr, u8), String> {
    let (a, p) = match text.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (text, None),
    };
    let addr: IpAddr = a
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not an address (e.g. 10.1.2.3/24)"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let prefix = match p {
        Some(p) => p
            .trim()
            .parse::<u8>()
            .ok()
            .filter(|&n| n <= max)
            .ok_or_else(|| format!("{text:?}: the prefix length must be 0 to {max}"))?,
        None => max,
    };
    Ok((addr, prefix))
}

/// Runs `ip ARGS`; its stderr is the error.
fn ip(args: &[&str]) -> Result<String, CliError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| CliError(format!("cannot run `ip` (iproute2): {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(CliError(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Every address on this host's interfaces (`ip -o addr show`).
pub(crate) fn addresses() -> Result<Vec<IfAddr>, CliError> {
    Ok(parse_ip_addr(&ip(&["-o", "addr", "show"])?))
}

/// Parses `ip -o addr show`: `2: eth0    inet 10.1.2.3/24 brd ... scope global eth0`.
pub(crate) fn parse_ip_addr(text: &str) -> Vec<IfAddr> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if !matches!(*f.get(2)?, "inet" | "inet6") {
                return None;
            }
            // `veth0@if5` names the peer's index after the '@'.
            let dev = f.get(1)?.trim_end_matches(':');
            let dev = dev.split('@').next()?.to_owned();
            let (addr, prefix) = parse_cidr(f.get(3)?).ok()?;
            Some(IfAddr { dev, addr, prefix })
        })
        .collect()
}

/// How long an address put here for a move lives unless renewed: the
/// kernel removes an address whose valid lifetime ends (IPv4 and IPv6), so
/// the address a `migrate-accept` killed outright had added goes within
/// this and a second of its last renewal (measured on Linux 6.18: 3.05-3.32
/// s after a 3 s address was added, 3.3-4.0 s after it was renewed; the
/// kernel checks lifetimes on whole-second boundaries) instead of staying
/// beside the same address at the source, where the process runs on.
pub(crate) const LEASE: Duration = Duration::from_secs(3);

/// How often a lease is renewed: a third of it, so that two renewals in a
/// row may come late (a loaded host) before the address goes.
const RENEW_EVERY: Duration = Duration::from_secs(1);

/// The arguments of `ip addr VERB` for `a` on a lease of `lease`
/// (whole seconds, never 0, which would be gone at once): preferred as
/// long as valid (a preferred lifetime that ends first would make the
/// address deprecated, IPv6 then avoiding it as a source), and for IPv6 no
/// duplicate-address detection (the address has just left the other host;
/// `change` too, which replaces the address's flags with the ones given).
/// [`make_permanent`] ends the lease.
pub(crate) fn address_args(verb: &str, a: &IfAddr, lease: Duration) -> Vec<String> {
    let life = lease.as_secs().max(1).to_string();
    let mut args: Vec<String> = ["addr", verb, &a.cidr(), "dev", &a.dev]
        .iter()
        .map(|s| (*s).to_string())
        .collect();
    if a.addr.is_ipv6() {
        args.push("nodad".into());
    }
    args.extend([
        "valid_lft".into(),
        life.clone(),
        "preferred_lft".into(),
        life,
    ]);
    args
}

/// Runs `ip` with [`address_args`].
fn set_address(verb: &str, a: &IfAddr, lease: Duration) -> Result<(), CliError> {
    let args = address_args(verb, a, lease);
    ip(&args.iter().map(String::as_str).collect::<Vec<_>>()).map(|_| ())
}

/// Renews `a`'s lease (`ip addr change`). This runs beside the rest of a
/// move, whose reaping of orphans (`migrate-accept` as its pid namespace's
/// first process: its own children look like them) may take this `ip`
/// before its own wait does: a wait that finds no child counts as done
/// (the next renewal would say if it was not).
fn renew(a: &IfAddr) -> Result<(), CliError> {
    let args = address_args("change", a, LEASE);
    match Command::new("ip").args(&args).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(CliError(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ECHILD as i32) => Ok(()),
        Err(e) => Err(CliError(format!("cannot run `ip` (iproute2): {e}"))),
    }
}

/// An address put on its interface for a move, on a [`LEASE`] that a
/// thread renews while this lives: if the process holding it is killed
/// outright, the address goes within the lease. Taken off when dropped,
/// unless kept ([`Leased::keep`]).
pub(crate) struct Leased {
    /// The address (`None` once kept or taken off).
    addr: Option<IfAddr>,
    /// Dropped to stop the renewing thread.
    stop: Option<std::sync::mpsc::Sender<()>>,
    /// The renewing thread.
    renewer: Option<std::thread::JoinHandle<()>>,
}

impl Leased {
    /// Puts `a` on its interface with a finite lifetime, set by the same
    /// `ip addr add` (one command, as before there was a lease: this runs
    /// while the process is frozen at the source), and starts renewing it.
    pub(crate) fn add(a: &IfAddr) -> Result<Leased, CliError> {
        set_address("add", a, LEASE)?;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let renewed = a.clone();
        let renewer = std::thread::Builder::new()
            .name("roam-lease".into())
            .spawn(move || {
                // Until the sender is dropped (nothing is ever sent).
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(RENEW_EVERY)
                {
                    // (`change` would put the address back, were it gone:
                    // wanted while the move goes on.)
                    if let Err(e) = renew(&renewed) {
                        eprintln!(
                            "roam migrate-accept: warning: cannot renew {}'s lease: {}",
                            renewed.cidr(),
                            e.0
                        );
                    }
                }
            });
        let mut leased = Leased {
            addr: Some(a.clone()),
            stop: Some(stop),
            renewer: None,
        };
        match renewer {
            Ok(r) => leased.renewer = Some(r),
            // (The drop takes the address off again.)
            Err(e) => {
                return Err(CliError(format!(
                    "cannot start a thread to renew {}'s lease: {e}",
                    a.cidr()
                )))
            }
        }
        Ok(leased)
    }

    /// Stops the renewing thread, once no renewal is under way (one after
    /// this would put the address back).
    fn stop(&mut self) {
        self.stop = None;
        if let Some(r) = self.renewer.take() {
            let _ = r.join();
        }
    }

    /// The address stays for good (its lifetime made infinite): the move is
    /// committed. One netlink request (tens of microseconds, so it runs
    /// before `LIVE`, leaving no window in which a killed `migrate-accept`
    /// has committed a move whose address then ends with its lease), after
    /// a renewal under way, if any, has ended. On an error the address goes
    /// when its lease ends.
    pub(crate) fn keep(mut self) -> Result<(), CliError> {
        self.stop();
        let Some(a) = self.addr.take() else {
            return Ok(());
        };
        make_permanent(&a).map_err(|e| {
            CliError(format!(
                "cannot keep {} here for good: {}; it goes within {} s",
                a.cidr(),
                e.0,
                LEASE.as_secs()
            ))
        })
    }
}

impl Drop for Leased {
    fn drop(&mut self) {
        self.stop();
        if let Some(a) = self.addr.take() {
            let _ = del_address(&a);
        }
    }
}

/// Makes `a`'s lifetime infinite, as `ip addr change ... valid_lft forever
/// preferred_lft forever` does, through one rtnetlink request
/// (`RTM_NEWADDR` with `NLM_F_REPLACE`: the address must be there) instead
/// of an `ip` process (3-5 ms). IPv6 keeps `nodad`, as `change` replaces
/// the address's flags.
pub(crate) fn make_permanent(a: &IfAddr) -> Result<(), CliError> {
    use nix::sys::socket::{
        self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
    };
    use std::os::fd::AsRawFd;
    let fail = |what: &str, e: String| CliError(format!("{what}: {e}"));
    let index = nix::net::if_::if_nametoindex(a.dev.as_str())
        .map_err(|e| fail(&format!("no interface {}", a.dev), e.to_string()))?;
    let fd = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )
    .map_err(|e| fail("cannot open a netlink socket", e.to_string()))?;
    let request = permanent_request(a, index);
    socket::sendto(
        fd.as_raw_fd(),
        &request,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )
    .map_err(|e| fail("cannot send the netlink request", e.to_string()))?;
    // The acknowledgement: an `NLMSG_ERROR` whose code is 0 on success.
    let mut buf = [0u8; 1024];
    let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())
        .map_err(|e| fail("no netlink answer", e.to_string()))?;
    match netlink_ack(&buf[..n]) {
        Some(0) => Ok(()),
        Some(code) => Err(CliError(format!(
            "the kernel refused: {}",
            nix::errno::Errno::from_raw(-code).desc()
        ))),
        None => Err(CliError("an unreadable netlink answer".into())),
    }
}

/// The rtnetlink message that makes `a` (on interface `index`) permanent:
/// `nlmsghdr`, `ifaddrmsg`, then `IFA_LOCAL`, `IFA_ADDRESS` and
/// `IFA_CACHEINFO` with both lifetimes infinite (native byte order, as the
/// kernel reads them). Its sequence number is [`NETLINK_SEQ`]: one request
/// per socket.
pub(crate) fn permanent_request(a: &IfAddr, index: u32) -> Vec<u8> {
    /// `RTM_NEWADDR`.
    const RTM_NEWADDR: u16 = 20;
    /// `NLM_F_REQUEST | NLM_F_ACK | NLM_F_REPLACE`.
    const FLAGS: u16 = 0x1 | 0x4 | 0x100;
    /// `IFA_ADDRESS`: the address (the peer's, on a point-to-point link).
    const IFA_ADDRESS: u16 = 1;
    /// `IFA_LOCAL`: the local address.
    const IFA_LOCAL: u16 = 2;
    /// `IFA_CACHEINFO`: the lifetimes.
    const IFA_CACHEINFO: u16 = 6;
    /// `IFA_F_NODAD`.
    const IFA_F_NODAD: u8 = 0x02;
    /// An infinite lifetime.
    const INFINITY: u32 = u32::MAX;
    let (family, flags, octets): (u8, u8, Vec<u8>) = match a.addr {
        IpAddr::V4(v4) => (2, 0, v4.octets().to_vec()),
        IpAddr::V6(v6) => (10, IFA_F_NODAD, v6.octets().to_vec()),
    };
    let mut m = Vec::with_capacity(80);
    m.extend_from_slice(&0u32.to_ne_bytes()); // length, set below
    m.extend_from_slice(&RTM_NEWADDR.to_ne_bytes());
    m.extend_from_slice(&FLAGS.to_ne_bytes());
    m.extend_from_slice(&NETLINK_SEQ.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // to the kernel
    m.extend_from_slice(&[family, a.prefix, flags, 0]); // scope: global
    m.extend_from_slice(&index.to_ne_bytes());
    let mut attr = |kind: u16, data: &[u8]| {
        m.extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(data);
        m.resize(m.len().next_multiple_of(4), 0);
    };
    attr(IFA_LOCAL, &octets);
    attr(IFA_ADDRESS, &octets);
    let cache: Vec<u8> = [INFINITY, INFINITY, 0, 0]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    attr(IFA_CACHEINFO, &cache);
    let len = m.len() as u32;
    m[..4].copy_from_slice(&len.to_ne_bytes());
    m
}

/// The sequence number of [`permanent_request`], which its acknowledgement
/// echoes.
const NETLINK_SEQ: u32 = 1;

/// The error code of the acknowledgement of [`permanent_request`]
/// (`NLMSG_ERROR`, type 2, echoing [`NETLINK_SEQ`]: 0 or a negative errno);
/// `None` if `answer` is not one.
pub(crate) fn netlink_ack(answer: &[u8]) -> Option<i32> {
    /// `NLMSG_ERROR`.
    const NLMSG_ERROR: u16 = 2;
    let kind = u16::from_ne_bytes(answer.get(4..6)?.try_into().ok()?);
    let seq = u32::from_ne_bytes(answer.get(8..12)?.try_into().ok()?);
    if kind != NLMSG_ERROR || seq != NETLINK_SEQ {
        return None;
    }
    Some(i32::from_ne_bytes(answer.get(16..20)?.try_into().ok()?))
}

/// Takes `a` off its interface.
pub(crate) fn del_address(a: &IfAddr) -> Result<(), CliError> {
    ip(&["addr", "del", &a.cidr(), "dev", &a.dev]).map(|_| ())
}

/// Tells the neighbours on `a`'s link that its address is here now, sent at
/// once from this process through a packet socket, from this host's
/// link-layer address: for IPv4 one gratuitous ARP request (sender and
/// target both the address, broadcast); for IPv6 one unsolicited Neighbor
/// Advertisement with the override flag to all nodes (RFC 4861 §7.2.6),
/// which replaces the link-layer address of any neighbour cache entry for
/// it. Without it the neighbours keep sending to the old host until their
/// cache entry goes stale (tens of seconds).
pub(crate) fn announce(a: &IfAddr) -> Result<(), CliError> {
    use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};
    use std::os::fd::AsRawFd;
    let addr = a.addr;
    let fail = |what: &str, e: nix::Error| {
        CliError(format!(
            "cannot announce {addr} on {} ({what}: {e}); neighbours will find the address \
             within tens of seconds",
            a.dev
        ))
    };
    // The interface's own link-layer address, with its index.
    let link = nix::ifaddrs::getifaddrs()
        .map_err(|e| fail("listing interfaces", e))?
        .filter(|i| i.interface_name == a.dev)
        .find_map(|i| i.address.and_then(|s| s.as_link_addr().copied()))
        .ok_or_else(|| CliError(format!("no link-layer address for {}", a.dev)))?;
    let mac = link
        .addr()
        .ok_or_else(|| CliError(format!("{} has no Ethernet address", a.dev)))?;
    let fd = socket::socket(
        AddressFamily::Packet,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::EthAll,
    )
    .map_err(|e| fail("opening a packet socket", e))?;
    let frame = match addr {
        IpAddr::V4(v4) => garp_frame(mac, v4),
        IpAddr::V6(v6) => unsolicited_na_frame(mac, v6),
    };
    socket::sendto(fd.as_raw_fd(), &frame, &link, MsgFlags::empty())
        .map_err(|e| fail("sending", e))?;
    // Its close waits for an RCU grace period: not on the hand-over's path.
    super::packets::close_later(fd);
    Ok(())
}

/// An Ethernet frame carrying a gratuitous ARP request for `addr` from
/// `mac`, padded to the 60-byte minimum.
pub(crate) fn garp_frame(mac: [u8; 6], addr: Ipv4Addr) -> Vec<u8> {
    let mut f = Vec::with_capacity(60);
    f.extend_from_slice(&[0xff; 6]); // to everyone
    f.extend_from_slice(&mac);
    f.extend_from_slice(&0x0806u16.to_be_bytes()); // ARP
    f.extend_from_slice(&1u16.to_be_bytes()); // Ethernet
    f.extend_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    f.extend_from_slice(&[6, 4]);
    f.extend_from_slice(&1u16.to_be_bytes()); // request
    f.extend_from_slice(&mac);
    f.extend_from_slice(&addr.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&addr.octets());
    f.resize(60, 0);
    f
}

/// An Ethernet frame carrying an unsolicited IPv6 Neighbor Advertisement
/// for `addr` from `mac`: from `addr` to all nodes (ff02::1), hop limit
/// 255, flags override only (not solicited, not a router), with a target
/// link-layer address option naming `mac`.
pub(crate) fn unsolicited_na_frame(mac: [u8; 6], addr: Ipv6Addr) -> Vec<u8> {
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    // ICMPv6: type 136, code 0, checksum, flags (O), target, option 2.
    let mut icmp = Vec::with_capacity(32);
    icmp.extend_from_slice(&[136, 0, 0, 0]);
    icmp.extend_from_slice(&0x2000_0000u32.to_be_bytes());
    icmp.extend_from_slice(&addr.octets());
    icmp.extend_from_slice(&[2, 1]);
    icmp.extend_from_slice(&mac);
    // The checksum covers the pseudo-header: both addresses, the 32-bit
    // length and the next header (58).
    let mut words = Vec::with_capacity(72);
    words.extend_from_slice(&addr.octets());
    words.extend_from_slice(&all_nodes.octets());
    words.extend_from_slice(&u32::try_from(icmp.len()).unwrap_or(0).to_be_bytes());
    words.extend_from_slice(&[0, 0, 0, 58]);
    words.extend_from_slice(&icmp);
    let mut acc: u32 = words
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    icmp[2..4].copy_from_slice(&(!(acc as u16)).to_be_bytes());

    let mut f = Vec::with_capacity(14 + 40 + icmp.len());
    f.extend_from_slice(&[0x33, 0x33, 0, 0, 0, 1]); // all nodes' multicast MAC
    f.extend_from_slice(&mac);
    f.extend_from_slice(&0x86ddu16.to_be_bytes()); // IPv6
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&u16::try_from(icmp.len()).unwrap_or(0).to_be_bytes());
    f.extend_from_slice(&[58, 255]); // ICMPv6, hop limit 255
    f.extend_from_slice(&addr.octets());
    f.extend_from_slice(&all_nodes.octets());
    f.extend_from_slice(&icmp);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsolicited_neighbor_advertisement_overrides_from_our_link_address() {
        let mac = [2, 0, 0, 0, 0, 7];
        let addr: Ipv6Addr = "fd00::2".parse().unwrap();
        let f = unsolicited_na_frame(mac, addr);
        assert_eq!(f.len(), 14 + 40 + 32);
        assert_eq!(&f[..6], &[0x33, 0x33, 0, 0, 0, 1]);
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[12..14], &[0x86, 0xdd]);
        assert_eq!(&f[18..20], &[0, 32], "payload length");
        assert_eq!(&f[20..22], &[58, 255], "ICMPv6, hop limit 255");
        assert_eq!(&f[22..38], &addr.octets(), "from the address");
        let icmp = &f[54..];
        assert_eq!(icmp[0], 136, "a Neighbor Advertisement");
        assert_eq!(icmp[4], 0x20, "override, not solicited, not a router");
        assert_eq!(&icmp[8..24], &addr.octets(), "target");
        assert_eq!(&icmp[24..26], &[2, 1], "target link-layer address option");
        assert_eq!(&icmp[26..32], &mac);
        // As a few lines of Python compute it over the same message.
        assert_eq!(u16::from_be_bytes([icmp[2], icmp[3]]), 0x5a93);
    }

    #[test]
    fn proc_net_rows_give_endpoints_state_and_inode() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n\
   1: 6405C60A:1BBC 0105C60A:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 20 4 30 10 -1\n";
        let rows = parse_sockets(tcp);
        assert_eq!(
            rows,
            vec![
                SocketRow {
                    local: "127.0.0.1".parse().unwrap(),
                    local_port: 8080,
                    remote: "0.0.0.0:0".parse().unwrap(),
                    state: 0x0A,
                    inode: 12345
                },
                SocketRow {
                    local: "10.198.5.100".parse().unwrap(),
                    local_port: 7100,
                    remote: "10.198.5.1:54000".parse().unwrap(),
                    state: 1,
                    inode: 777
                },
            ]
        );
        // IPv4-mapped in tcp6 reads as IPv4; a real IPv6 address stays one.
        assert_eq!(
            parse_hex_addr("0000000000000000FFFF00006405C60A"),
            Some("10.198.5.100".parse().unwrap())
        );
        assert_eq!(
            parse_hex_addr("B80D0120000000000000000001000000"),
            Some("2001:db8::1".parse().unwrap())
        );
    }

    #[test]
    fn ip_addr_output_gives_device_address_and_prefix() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n\
2: eth0@if7    inet 10.198.5.2/24 scope global eth0\\       valid_lft forever preferred_lft forever\n\
2: eth0@if7    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever\n";
        let a = parse_ip_addr(text);
        assert_eq!(a.len(), 3);
        assert_eq!(a[1].dev, "eth0");
        assert_eq!(a[1].cidr(), "10.198.5.2/24");
        assert!(a[1].covers("10.198.5.100".parse().unwrap()));
        assert!(!a[1].covers("10.198.6.100".parse().unwrap()));
        assert!(!a[1].covers("fe80::1".parse().unwrap()));
        assert!(a[2].covers("fe80::2".parse().unwrap()));
    }

    #[test]
    fn a_gratuitous_arp_names_the_address_twice_from_our_link_address() {
        let mac = [2, 0, 0, 0, 0, 7];
        let f = garp_frame(mac, Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(f.len(), 60);
        assert_eq!(&f[..6], &[0xff; 6]);
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[12..14], &[0x08, 0x06]);
        assert_eq!(&f[20..22], &[0, 1], "a request");
        assert_eq!(&f[22..28], &mac, "sender hardware address");
        assert_eq!(&f[28..32], &[10, 1, 2, 3], "sender protocol address");
        assert_eq!(&f[38..42], &[10, 1, 2, 3], "target protocol address");
    }

    /// The IPv6 announcement on a real link: a neighbour whose cache holds
    /// a stale link-layer address for the address (the old host's) learns
    /// this host's from the one advertisement.
    #[test]
    fn an_ipv6_announcement_updates_a_neighbours_stale_cache_entry() {
        use roam_sim::netns::{NetPair, Side, IFACE};
        if let Err(why) = roam_sim::netns::available() {
            eprintln!("SKIP: {why}");
            return;
        }
        let pair = NetPair::new("na6").expect("namespaces");
        let (c, s) = (pair.ns(Side::Client), pair.ns(Side::Server));
        let run = |cmd: String| super::super::sh(&cmd);
        run(format!(
            "ip -n {c} addr add fd00::1/64 dev {IFACE} nodad && \
             ip -n {s} addr add fd00::2/64 dev {IFACE} nodad && \
             ip -n {c} -6 neigh replace fd00::2 lladdr 02:00:00:00:00:99 dev {IFACE} nud stale"
        ));
        let mac = run(format!(
            "ip netns exec {s} cat /sys/class/net/{IFACE}/address"
        ));
        let entry = || run(format!("ip -n {c} -6 neigh show fd00::2 dev {IFACE}"));
        assert!(entry().contains("02:00:00:00:00:99"), "{}", entry());
        let a = IfAddr {
            dev: IFACE.to_owned(),
            addr: "fd00::2".parse().unwrap(),
            prefix: 64,
        };
        pair.in_ns(Side::Server, || announce(&a))
            .expect("server namespace")
            .expect("announce");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        while !entry().contains(&mac) {
            assert!(
                std::time::Instant::now() < deadline,
                "the neighbour still has {:?}, not {mac}",
                entry()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    fn the_request_that_ends_a_lease_is_well_formed() {
        let v4 = IfAddr {
            dev: "eth0".into(),
            addr: "10.1.2.3".parse().unwrap(),
            prefix: 24,
        };
        let m = permanent_request(&v4, 7);
        // Header 16, ifaddrmsg 8, two 8-byte addresses, cache info 20.
        assert_eq!(m.len(), 60);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 60);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), 20);
        assert_eq!(&m[16..20], &[2, 24, 0, 0]);
        assert_eq!(u32::from_ne_bytes(m[20..24].try_into().unwrap()), 7);
        assert_eq!(&m[28..32], &[10, 1, 2, 3]);
        assert_eq!(&m[44..52], &[0xff; 8], "both lifetimes infinite");
        let v6 = IfAddr {
            dev: "eth0".into(),
            addr: "fd00::2".parse().unwrap(),
            prefix: 64,
        };
        let m = permanent_request(&v6, 7);
        assert_eq!(m.len(), 84);
        assert_eq!(&m[16..19], &[10, 64, 0x02], "IPv6 keeps nodad");
        // An acknowledgement: code 0, or a negative errno; anything else
        // is not one.
        assert_eq!(
            u32::from_ne_bytes(m[8..12].try_into().unwrap()),
            NETLINK_SEQ
        );
        let mut ack = vec![0u8; 36];
        ack[4..6].copy_from_slice(&2u16.to_ne_bytes());
        assert_eq!(netlink_ack(&ack), None, "another request's acknowledgement");
        ack[8..12].copy_from_slice(&NETLINK_SEQ.to_ne_bytes());
        assert_eq!(netlink_ack(&ack), Some(0));
        ack[16..20].copy_from_slice(&(-17i32).to_ne_bytes());
        assert_eq!(netlink_ack(&ack), Some(-17));
        ack[4..6].copy_from_slice(&20u16.to_ne_bytes());
        assert_eq!(netlink_ack(&ack), None);
        assert_eq!(netlink_ack(&ack[..10]), None);
    }

    #[test]
    fn an_address_is_added_with_its_lease_in_one_command() {
        let v4 = IfAddr {
            dev: "eth0".into(),
            addr: "10.1.2.3".parse().unwrap(),
            prefix: 24,
        };
        assert_eq!(
            address_args("add", &v4, LEASE).join(" "),
            "addr add 10.1.2.3/24 dev eth0 valid_lft 3 preferred_lft 3"
        );
        let v6 = IfAddr {
            dev: "eth0".into(),
            addr: "fd00::2".parse().unwrap(),
            prefix: 64,
        };
        assert_eq!(
            address_args("change", &v6, Duration::from_millis(2500)).join(" "),
            "addr change fd00::2/64 dev eth0 nodad valid_lft 2 preferred_lft 2"
        );
        assert_eq!(
            address_args("add", &v6, Duration::from_millis(300)).join(" "),
            "addr add fd00::2/64 dev eth0 nodad valid_lft 1 preferred_lft 1",
            "never 0: gone at once"
        );
    }

    /// On a real link: an address added on a lease that nobody renews is
    /// gone within the lease and a second (what a killed `migrate-accept`
    /// leaves); renewed it stays past the lease; kept it stays for good;
    /// dropped it goes at once.
    #[test]
    fn a_leased_address_stays_while_renewed_and_goes_when_not() {
        use roam_sim::netns::{NetPair, Side, IFACE};
        use std::time::Instant;
        if let Err(why) = roam_sim::netns::available() {
            eprintln!("SKIP: {why}");
            return;
        }
        let pair = NetPair::new("lease").expect("namespaces");
        let s = pair.ns(Side::Server).to_owned();
        let at = |last: u8| IfAddr {
            dev: IFACE.to_owned(),
            addr: IpAddr::V4(Ipv4Addr::new(10, 77, 0, last)),
            prefix: 24,
        };
        let here = |a: &IfAddr| {
            super::super::sh(&format!("ip -n {s} -o addr show dev {IFACE}"))
                .contains(&format!(" {} ", a.cidr()))
        };
        pair.in_ns(Side::Server, || {
            // Unrenewed.
            let lone = at(5);
            set_address("add", &lone, LEASE).expect("add");
            let added = Instant::now();
            assert!(here(&lone));
            while here(&lone) {
                assert!(
                    added.elapsed() < LEASE + Duration::from_secs(1),
                    "{} outlived its lease",
                    lone.cidr()
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            eprintln!("an unrenewed lease ended after {:?}", added.elapsed());
            // Renewed, then kept.
            let kept = at(6);
            let leased = Leased::add(&kept).expect("lease");
            std::thread::sleep(LEASE + Duration::from_millis(1500));
            assert!(here(&kept), "a renewed lease ended");
            leased.keep().expect("keep");
            std::thread::sleep(LEASE + Duration::from_millis(1500));
            assert!(here(&kept), "a kept address went");
            let out = super::super::sh(&format!("ip -n {s} -o addr show dev {IFACE}"));
            assert!(
                out.contains("valid_lft forever preferred_lft forever"),
                "{out}"
            );
            // Dropped.
            let dropped = at(7);
            drop(Leased::add(&dropped).expect("lease"));
            assert!(!here(&dropped), "a dropped lease stayed");
        })
        .expect("server namespace");
    }

    #[test]
    fn cidr_parsing_is_strict() {
        assert_eq!(
            parse_cidr("10.1.2.3/24"),
            Ok(("10.1.2.3".parse().unwrap(), 24))
        );
        assert_eq!(
            parse_cidr("10.1.2.3"),
            Ok(("10.1.2.3".parse().unwrap(), 32))
        );
        assert!(parse_cidr("10.1.2.3/33").is_err());
        assert!(parse_cidr("host/24").is_err());
    }
}
