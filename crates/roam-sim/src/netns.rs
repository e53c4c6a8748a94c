//! Two-host network topologies from Linux network namespaces, for tests over
//! a real kernel network stack.
//!
//! [`NetPair::new`] creates two namespaces, `roam-<prefix>-<pid>-c` (the
//! client "host") and `roam-<prefix>-<pid>-s` (the server "host"), joined by a
//! veth pair named `roam0` on both ends, with addresses from `10.199.X.0/24`
//! (X chosen per pair). Those addresses exist only inside the two namespaces,
//! so traffic between them never leaves the machine. A test can then take the
//! client's link down and up, or change either side's address, while
//! processes run inside ([`NetPair::command`], [`NetPair::spawn_in`]) or
//! sockets are opened inside from the test process itself
//! ([`NetPair::tcp_listen`], [`NetPair::tcp_connect`], [`NetPair::in_ns`]).
//!
//! The pair is a guard: dropping it (also while unwinding from a panic) kills
//! every process left in the namespaces and deletes them. Namespaces left
//! behind by a test process that was killed outright are removed by the next
//! [`NetPair::new`] once their creator's pid is gone.
//!
//! [`Lan`] puts any number of hosts on one bridged Ethernet segment instead,
//! for addresses that move between hosts.
//!
//! Needs root and iproute2; [`available`] says why not, so tests can skip
//! with a clear message. Non-goals: delay and loss (this kernel has no netem;
//! use [`crate::proxy::FaultProxy`]), and IPv6.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// Name of the veth end inside each namespace.
pub const IFACE: &str = "roam0";
/// Prefix of every namespace this module creates.
pub const NS_PREFIX: &str = "roam-";
/// How long [`NetPair`]'s drop waits for killed processes to exit.
const KILL_WAIT: Duration = Duration::from_secs(3);

/// Which end of a [`NetPair`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The client host (`...-c`).
    Client,
    /// The server host (`...-s`).
    Server,
}

/// Whether `program` is on `PATH` (`command -v`): for tests that need a
/// tool to say why they skip.
pub fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Checks that network namespaces can be made here: running as root, with
/// iproute2's `ip`, and `ip netns add` actually working (it does not inside
/// some unprivileged containers). The error says what is missing.
pub fn available() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("network namespace tests need root (run as root or with sudo)".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Err(format!(
                "`ip -V` failed: {}",
                String::from_utf8_lossy(&o.stderr)
            ))
        }
        Err(e) => {
            return Err(format!(
                "iproute2 `ip` not runnable ({e}); apt-get install iproute2"
            ))
        }
    }
    let probe = format!("{NS_PREFIX}probe-{}-{}", std::process::id(), next_id());
    ip(&["netns", "add", &probe]).map_err(|e| format!("cannot create a network namespace: {e}"))?;
    ip(&["netns", "del", &probe]).map_err(|e| format!("cannot delete a network namespace: {e}"))?;
    Ok(())
}

/// A process-wide counter, so pairs made by one test process differ.
fn next_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Runs `ip ARGS`, turning a non-zero exit into an error carrying its stderr.
fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Names of all network namespaces starting with `roam-` (any creator).
pub fn roam_namespaces() -> Vec<String> {
    let out = match Command::new("ip").args(["netns", "list"]).output() {
        Ok(o) => o,
        Err(_) => return Vec::new(),
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        // Lines look like "name (id: 3)" or just "name".
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(NS_PREFIX))
        .map(str::to_owned)
        .collect()
}

/// Kills every process in namespace `ns`, waits for them, and deletes it.
fn destroy_ns(ns: &str) {
    // Files `ip netns exec` would bind-mount into the namespace's programs.
    let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
    let pids = |ns: &str| -> Vec<i32> {
        Command::new("ip")
            .args(["netns", "pids", ns])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let deadline = Instant::now() + KILL_WAIT;
    loop {
        let live = pids(ns);
        if live.is_empty() || Instant::now() > deadline {
            break;
        }
        for p in live {
            let _ = nix::sys::signal::kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        thread::sleep(Duration::from_millis(20));
    }
    let _ = ip(&["netns", "del", ns]);
}

/// Runs `f` on a helper thread that has entered the named network namespace
/// (`/run/netns/NS`); sockets it creates stay in that namespace.
fn in_named_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    let ns_file = File::open(format!("/run/netns/{ns}"))?;
    thread::scope(|s| {
        s.spawn(move || {
            // setns(2) on a thread changes only that thread's namespace.
            nix::sched::setns(&ns_file, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            Ok(f())
        })
        .join()
        .map_err(|_| io::Error::other("closure run in a network namespace panicked"))?
    })
}

/// Deletes `roam-<prefix>-<pid>-<role>` namespaces ([`NetPair`]'s `-c` and
/// `-s`, [`Lan`]'s `-sw` and `-hN`) whose creating process is gone (a test
/// process killed before its guards ran). Prefixes have no `-`.
fn remove_stale() {
    for ns in roam_namespaces() {
        let Some(rest) = ns.strip_prefix(NS_PREFIX) else {
            continue;
        };
        let mut parts = rest.split('-');
        let (Some(_prefix), Some(pid), Some(_role)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            destroy_ns(&ns);
        }
    }
}

/// Namespace stems in use by this process, so two live pairs or LANs never
/// share one.
static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Creates namespace `ns` with its loopback up, first removing a leftover of
/// the same name (a reused pid of a killed run).
fn fresh_ns(ns: &str) -> io::Result<()> {
    if roam_namespaces().iter().any(|n| n == ns) {
        destroy_ns(ns);
    }
    ip(&["netns", "add", ns])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])
}

/// Checks `prefix`, clears stale namespaces, and claims the stem
/// `roam-<prefix>-<pid>` for a new [`NetPair`] or [`Lan`] (released by its
/// drop).
fn claim_stem(prefix: &str) -> io::Result<String> {
    if prefix.is_empty()
        || !prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("netns prefix {prefix:?} must be non-empty [A-Za-z0-9_]"),
        ));
    }
    remove_stale();
    let stem = format!("{NS_PREFIX}{prefix}-{}", std::process::id());
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    if live.contains(&stem) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("a NetPair or Lan with prefix {prefix:?} is alive in this process"),
        ));
    }
    live.push(stem.clone());
    Ok(stem)
}

/// Two network namespaces joined by a veth pair. See the [module docs](self).
#[derive(Debug)]
pub struct NetPair {
    stem: String,
    client_ns: String,
    server_ns: String,
    /// X of 10.199.X.0/24.
    subnet: u8,
    client_addr: Mutex<Ipv4Addr>,
    server_addr: Mutex<Ipv4Addr>,
}

impl NetPair {
    /// Creates `roam-<prefix>-<pid>-c` and `roam-<prefix>-<pid>-s` with a
    /// veth pair between them: client `10.199.X.1/24`, server `10.199.X.2/24`,
    /// both links and both loopbacks up. `prefix` names the test; it must be
    /// unique among the pairs alive in this process.
    pub fn new(prefix: &str) -> io::Result<NetPair> {
        let stem = claim_stem(prefix)?;
        // Each namespace has its own stack, so subnets need not differ between
        // pairs; distinct ones just make captures and logs easier to tell apart.
        let subnet = ((std::process::id().wrapping_mul(7).wrapping_add(next_id())) % 254 + 1) as u8;
        let pair = NetPair {
            client_ns: format!("{stem}-c"),
            server_ns: format!("{stem}-s"),
            stem,
            subnet,
            client_addr: Mutex::new(Ipv4Addr::new(10, 199, subnet, 1)),
            server_addr: Mutex::new(Ipv4Addr::new(10, 199, subnet, 2)),
        };
        // From here on, `pair`'s Drop cleans up whatever was made.
        for ns in [&pair.client_ns, &pair.server_ns] {
            fresh_ns(ns)?;
        }
        ip(&[
            "link",
            "add",
            "name",
            IFACE,
            "netns",
            &pair.client_ns,
            "type",
            "veth",
            "peer",
            "name",
            IFACE,
            "netns",
            &pair.server_ns,
        ])?;
        for (ns, addr) in [
            (&pair.client_ns, pair.client_addr()),
            (&pair.server_ns, pair.server_addr()),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", IFACE])?;
            ip(&["-n", ns, "link", "set", IFACE, "up"])?;
        }
        Ok(pair)
    }

    /// The namespace name of `side`.
    pub fn ns(&self, side: Side) -> &str {
        match side {
            Side::Client => &self.client_ns,
            Side::Server => &self.server_ns,
        }
    }

    /// `10.199.X.host`, an address in this pair's subnet (for address changes).
    pub fn subnet_addr(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 199, self.subnet, host)
    }

    /// The client's current address.
    pub fn client_addr(&self) -> Ipv4Addr {
        *self.client_addr.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The server's current address.
    pub fn server_addr(&self) -> Ipv4Addr {
        *self.server_addr.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current address of `side`.
    pub fn addr(&self, side: Side) -> Ipv4Addr {
        match side {
            Side::Client => self.client_addr(),
            Side::Server => self.server_addr(),
        }
    }

    /// A command running `program` inside `side`'s namespace (`ip netns exec
    /// NS program`); add arguments, environment and stdio as usual. `ip netns
    /// exec` execs the program, so the child's pid is the program's.
    pub fn command(&self, side: Side, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.ns(side)]).arg(program);
        c
    }

    /// Rewrites `cmd` (program, arguments, environment, working directory) to
    /// run inside `side`'s namespace. Stdio settings cannot be read back from a
    /// `Command`: set them on the returned one.
    pub fn wrap(&self, side: Side, cmd: &Command) -> Command {
        let mut c = self.command(side, cmd.get_program());
        c.args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        if let Some(d) = cmd.get_current_dir() {
            c.current_dir(d);
        }
        c
    }

    /// Runs `cmd` inside `side`'s namespace to completion and returns its
    /// output (stdin is null).
    pub fn run_in(&self, side: Side, cmd: &Command) -> io::Result<Output> {
        self.wrap(side, cmd).stdin(Stdio::null()).output()
    }

    /// Starts `cmd` inside `side`'s namespace with stdin and stdout piped and
    /// stderr inherited; the child is killed when the guard drops. For other
    /// stdio, build with [`NetPair::command`] and wrap in [`ChildGuard::spawn`].
    pub fn spawn_in(&self, side: Side, cmd: &Command) -> io::Result<ChildGuard> {
        let mut c = self.wrap(side, cmd);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        ChildGuard::spawn(&mut c)
    }

    /// Runs `f` on a helper thread that has entered `side`'s network
    /// namespace. Sockets created in `f` stay in that namespace wherever they
    /// are used afterwards, so the test process itself can be a host of the
    /// topology.
    pub fn in_ns<T: Send>(&self, side: Side, f: impl FnOnce() -> T + Send) -> io::Result<T> {
        in_named_ns(self.ns(side), f)
    }

    /// A TCP listener bound to `addr` inside `side`'s namespace.
    pub fn tcp_listen(&self, side: Side, addr: SocketAddr) -> io::Result<TcpListener> {
        self.in_ns(side, || TcpListener::bind(addr))?
    }

    /// A TCP connection to `addr` made from inside `side`'s namespace.
    pub fn tcp_connect(
        &self,
        side: Side,
        addr: SocketAddr,
        timeout: Duration,
    ) -> io::Result<TcpStream> {
        self.in_ns(side, || TcpStream::connect_timeout(&addr, timeout))?
    }

    /// Sets the `/etc/hosts` that programs started in `side`'s namespace
    /// through `ip netns exec` see (it bind-mounts `/etc/netns/<ns>/hosts`
    /// over `/etc/hosts`), e.g. to give the server a name. The file is
    /// rewritten in place, so running programs see later changes on their next
    /// lookup (glibc reads the file on every lookup): that is how a test moves
    /// a name to a new address. Removed when the pair drops.
    pub fn set_hosts(&self, side: Side, entries: &[(&str, std::net::IpAddr)]) -> io::Result<()> {
        let dir = format!("/etc/netns/{}", self.ns(side));
        std::fs::create_dir_all(&dir)?;
        let mut text = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for (name, addr) in entries {
            text.push_str(&format!("{addr} {name}\n"));
        }
        // Truncate and write (not rename): keeps the inode the bind mounts
        // of already running programs point at.
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(format!("{dir}/hosts"))?;
        io::Write::write_all(&mut f, text.as_bytes())
    }

    /// Sets `side`'s veth end up or down.
    pub fn set_link(&self, side: Side, up: bool) -> io::Result<()> {
        ip(&[
            "-n",
            self.ns(side),
            "link",
            "set",
            IFACE,
            if up { "up" } else { "down" },
        ])
    }

    /// Takes the client's link down: nothing passes until [`NetPair::link_up`].
    pub fn link_down(&self) -> io::Result<()> {
        self.set_link(Side::Client, false)
    }

    /// Brings the client's link back up.
    pub fn link_up(&self) -> io::Result<()> {
        self.set_link(Side::Client, true)
    }

    fn change_addr(&self, side: Side, new: Ipv4Addr) -> io::Result<Ipv4Addr> {
        let slot = match side {
            Side::Client => &self.client_addr,
            Side::Server => &self.server_addr,
        };
        let mut cur = slot.lock().unwrap_or_else(|e| e.into_inner());
        let ns = self.ns(side);
        // Delete, then add, as a host moving networks does. (Adding first
        // would not help: deleting a primary address also deletes the
        // secondaries of its subnet unless promote_secondaries is set.)
        ip(&[
            "-n",
            ns,
            "addr",
            "del",
            &format!("{}/24", *cur),
            "dev",
            IFACE,
        ])?;
        ip(&["-n", ns, "addr", "add", &format!("{new}/24"), "dev", IFACE])?;
        Ok(std::mem::replace(&mut *cur, new))
    }

    /// Moves the client to `new` (same /24, see [`NetPair::subnet_addr`]):
    /// adds it, deletes the old one; connections from the old address stop
    /// working. Returns the old address.
    pub fn change_client_addr(&self, new: Ipv4Addr) -> io::Result<Ipv4Addr> {
        self.change_addr(Side::Client, new)
    }

    /// Moves the server to `new`, as [`NetPair::change_client_addr`] does.
    pub fn change_server_addr(&self, new: Ipv4Addr) -> io::Result<Ipv4Addr> {
        self.change_addr(Side::Server, new)
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        destroy_ns(&self.client_ns);
        destroy_ns(&self.server_ns);
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|s| s != &self.stem);
    }
}

/// Hosts on one Ethernet segment: a switch namespace
/// `roam-<prefix>-<pid>-sw` holding a bridge, and host namespaces
/// `roam-<prefix>-<pid>-h0`, `-h1`, ... each with a veth [`IFACE`] plugged
/// into the bridge. Host `i` has `10.198.X.(i+1)/24` (X per LAN); more
/// addresses of the subnet can be added to and removed from any host
/// ([`Lan::add_addr`], [`Lan::del_addr`]) and the other hosts made to look
/// them up again ([`Lan::forget_neighbor`]), as a service address moves with
/// a migrated process.
/// Dropping the LAN kills every process in its namespaces and deletes them.
#[derive(Debug)]
pub struct Lan {
    /// `roam-<prefix>-<pid>`, claimed in the live registry.
    stem: String,
    /// The switch namespace (holds the bridge).
    switch: String,
    /// The host namespaces, in order.
    hosts: Vec<String>,
    /// X of 10.198.X.0/24.
    subnet: u8,
}

/// Name of the bridge in a [`Lan`]'s switch namespace.
const BRIDGE: &str = "br0";

impl Lan {
    /// Creates the switch and `hosts` hosts (at most 200), every link up.
    /// `prefix` names the test ([A-Za-z0-9_], unique among the LANs and
    /// pairs alive in this process).
    pub fn new(prefix: &str, hosts: usize) -> io::Result<Lan> {
        if hosts == 0 || hosts > 200 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a LAN has 1 to 200 hosts, not {hosts}"),
            ));
        }
        let stem = claim_stem(prefix)?;
        let subnet =
            ((std::process::id().wrapping_mul(13).wrapping_add(next_id())) % 254 + 1) as u8;
        let lan = Lan {
            switch: format!("{stem}-sw"),
            hosts: (0..hosts).map(|i| format!("{stem}-h{i}")).collect(),
            stem,
            subnet,
        };
        // From here on, `lan`'s Drop cleans up whatever was made.
        for ns in std::iter::once(&lan.switch).chain(&lan.hosts) {
            fresh_ns(ns)?;
        }
        ip(&["-n", &lan.switch, "link", "add", BRIDGE, "type", "bridge"])?;
        ip(&["-n", &lan.switch, "link", "set", BRIDGE, "up"])?;
        for (i, ns) in lan.hosts.iter().enumerate() {
            let port = format!("p{i}");
            ip(&[
                "link",
                "add",
                "name",
                IFACE,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                &lan.switch,
            ])?;
            ip(&["-n", &lan.switch, "link", "set", &port, "master", BRIDGE])?;
            ip(&["-n", &lan.switch, "link", "set", &port, "up"])?;
            let addr = format!("{}/24", lan.addr(i));
            ip(&["-n", ns, "addr", "add", &addr, "dev", IFACE])?;
            ip(&["-n", ns, "link", "set", IFACE, "up"])?;
        }
        Ok(lan)
    }

    /// The namespace of host `i`.
    pub fn ns(&self, i: usize) -> &str {
        &self.hosts[i]
    }

    /// `10.198.X.last`: an address of this LAN's subnet.
    pub fn subnet_addr(&self, last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 198, self.subnet, last)
    }

    /// Host `i`'s own address (`10.198.X.(i+1)`).
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        self.subnet_addr(u8::try_from(i + 1).unwrap_or(u8::MAX))
    }

    /// Adds `addr` (of the LAN's /24) to host `i`.
    pub fn add_addr(&self, i: usize, addr: Ipv4Addr) -> io::Result<()> {
        ip(&[
            "-n",
            self.ns(i),
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            IFACE,
        ])
    }

    /// Removes `addr` from host `i`.
    pub fn del_addr(&self, i: usize, addr: Ipv4Addr) -> io::Result<()> {
        ip(&[
            "-n",
            self.ns(i),
            "addr",
            "del",
            &format!("{addr}/24"),
            "dev",
            IFACE,
        ])
    }

    /// Makes every other host forget which link-layer address `addr` had, so
    /// their next packet to it asks again and reaches whichever host has it
    /// now: what a gratuitous ARP from that host does on a real segment.
    pub fn forget_neighbor(&self, addr: Ipv4Addr) -> io::Result<()> {
        for ns in &self.hosts {
            // `flush` of an address nobody has resolved is not an error.
            ip(&[
                "-n",
                ns,
                "neigh",
                "flush",
                "to",
                &addr.to_string(),
                "dev",
                IFACE,
            ])?;
        }
        Ok(())
    }

    /// A command running `program` on host `i`: in its network namespace
    /// only (`nsenter --net`, which execs: the child's pid is the
    /// program's), sharing this machine's mounts and pid space.
    pub fn command(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns(i)))
            .arg("--")
            .arg(program);
        c
    }

    /// A command running `program` on host `i` with a pid space of its own,
    /// as on a machine of its own (`nsenter --net` then `unshare --pid
    /// --fork --kill-child --mount-proc`): a process it restores may take a
    /// pid still used on another host, and every process in it dies with
    /// it. The child is `unshare`, `program` its child.
    pub fn command_own_pids(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns(i)))
            .args([
                "--",
                "unshare",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
            ])
            .arg(program);
        c
    }

    /// Runs `f` on a helper thread inside host `i`'s namespace (see
    /// [`NetPair::in_ns`]).
    pub fn in_ns<T: Send>(&self, i: usize, f: impl FnOnce() -> T + Send) -> io::Result<T> {
        in_named_ns(self.ns(i), f)
    }

    /// A TCP connection to `addr` made from inside host `i`'s namespace.
    pub fn tcp_connect(
        &self,
        i: usize,
        addr: SocketAddr,
        timeout: Duration,
    ) -> io::Result<TcpStream> {
        self.in_ns(i, || TcpStream::connect_timeout(&addr, timeout))?
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain(std::iter::once(&self.switch)) {
            destroy_ns(ns);
        }
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|s| s != &self.stem);
    }
}

/// A child process killed (SIGKILL) and reaped when the guard drops.
/// Dereferences to the [`Child`] for its pipes and pid.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
}

impl ChildGuard {
    /// Spawns `cmd` and guards the child.
    pub fn spawn(cmd: &mut Command) -> io::Result<ChildGuard> {
        Ok(ChildGuard {
            child: cmd.spawn()?,
        })
    }

    /// Guards an already spawned child.
    pub fn new(child: Child) -> ChildGuard {
        ChildGuard { child }
    }

    /// The child (to take its pipes).
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Sends `sig` to the child.
    pub fn signal(&self, sig: Signal) -> io::Result<()> {
        nix::sys::signal::kill(Pid::from_raw(self.child.id() as i32), sig).map_err(io::Error::from)
    }

    /// Waits at most `timeout` for the child to exit on its own.
    pub fn wait_timeout(
        &mut self,
        timeout: Duration,
    ) -> io::Result<Option<std::process::ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(Some(st));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
