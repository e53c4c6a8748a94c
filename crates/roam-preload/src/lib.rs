//! The LD_PRELOAD library of `roam run` (issue 13, rocks: reliable sockets
//! by interposition).
//!
//! `roam run -- CMD` starts CMD with this library preloaded and three
//! variables set: `ROAM_RUN_AGENT` (the agent's TCP port on 127.0.0.1),
//! `ROAM_RUN_REGISTER` (the agent's private Unix socket) and optionally
//! `ROAM_RUN_PORTS` (comma-separated ports; empty: every port).
//!
//! **Outgoing** (`connect`). For an IPv4 TCP socket heading for a
//! non-loopback address (on a chosen port) the library:
//!
//! 1. binds the socket to 127.0.0.1 (port chosen by the kernel) unless the
//!    program bound it already;
//! 2. tells the agent, over the Unix socket, "the connection from local port
//!    L is for A:P", and waits for its acknowledgement;
//! 3. connects the socket to the agent instead.
//!
//! **Incoming** (`listen`, `accept`, `accept4`). A TCP socket that listens
//! on a non-loopback IPv4 address (or on `::` accepting IPv4 too), on a
//! chosen port, is announced to the agent, which then takes roam sessions
//! for it on the relay port and connects each of their streams to the
//! listener from loopback. `accept` returns those connections with the
//! roam client's address, not the agent's.
//!
//! **Peer addresses** (`getpeername`, and `accept`'s address). A socket
//! whose real peer is on loopback may be one the agent carries; the agent is
//! asked, and its answer (the destination the program connected to, or the
//! roam client that connected to it) replaces the loopback address.
//!
//! The program keeps ordinary TCP descriptors (blocking or not, in epoll,
//! poll or select, dup'ed, inherited across fork and exec): only their peer
//! is the agent, which carries the bytes as a roam stream when the other
//! host runs roam and as plain TCP when it does not. Bound to loopback, the
//! descriptors never see the network: a link cut or a new address at this
//! end is the session's business. Anything else (other families, UDP,
//! loopback, an unset environment, a failed registration) goes to the real
//! call untouched; a failed registration is reported once on stderr.
//!
//! Everything here runs inside foreign programs: no allocation on these
//! paths beyond the environment read at load, no panic (every failure falls
//! back to the real call's result), errno preserved as the real call leaves
//! it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use libc::{c_int, c_void, sockaddr, sockaddr_in, sockaddr_un, socklen_t};

/// The real `connect`'s type.
type ConnectFn = unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int;

/// What `roam run` told this process.
struct Setup {
    /// The agent's port on 127.0.0.1.
    agent_port: u16,
    /// The agent's port on ::1 (0: none; IPv6 destinations are not carried).
    agent6_port: u16,
    /// The agent's registration socket.
    register: sockaddr_un,
    /// The path's length within `register` (for `connect`'s length).
    register_len: socklen_t,
    /// Destination ports to carry; empty: all.
    ports: Vec<u16>,
}

/// The setup, read once; `None` outside `roam run` or with a malformed
/// environment (then every call is the real one).
fn setup() -> Option<&'static Setup> {
    static SETUP: OnceLock<Option<Setup>> = OnceLock::new();
    SETUP.get_or_init(read_setup).as_ref()
}

/// Reads the setup from the environment `roam run` set.
fn read_setup() -> Option<Setup> {
    let agent_port = std::env::var("ROAM_RUN_AGENT").ok()?.parse().ok()?;
    let agent6_port = std::env::var("ROAM_RUN_AGENT6")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let path = std::env::var("ROAM_RUN_REGISTER").ok()?;
    let ports = std::env::var("ROAM_RUN_PORTS")
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.trim().parse().ok())
        .collect();
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut register: sockaddr_un = unsafe { std::mem::zeroed() };
    register.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_bytes();
    if bytes.len() >= register.sun_path.len() {
        return None;
    }
    for (dst, &b) in register.sun_path.iter_mut().zip(bytes) {
        *dst = b as libc::c_char;
    }
    let register_len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as socklen_t;
    Some(Setup {
        agent_port,
        agent6_port,
        register,
        register_len,
        ports,
    })
}

/// The next `connect` in the lookup order (libc's).
fn real_connect() -> Option<ConnectFn> {
    static REAL: OnceLock<usize> = OnceLock::new();
    let p = *REAL.get_or_init(|| {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name has no
        // preconditions; it returns null when there is no such symbol.
        unsafe { libc::dlsym(libc::RTLD_NEXT, c"connect".as_ptr()) as usize }
    });
    if p == 0 {
        return None;
    }
    // SAFETY: `p` is the address of libc's `connect`, whose C signature is
    // exactly `ConnectFn`.
    Some(unsafe { std::mem::transmute::<usize, ConnectFn>(p) })
}

/// Set once a registration failed and was reported.
static REPORTED: AtomicBool = AtomicBool::new(false);

/// `connect(2)`, interposed: see the crate documentation.
///
/// # Safety
///
/// As `connect(2)`: `addr` points to `len` readable bytes (or is null, which
/// the real call rejects).
#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let Some(real) = real_connect() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: the caller's contract for `addr` and `len` is the real
    // call's; `carried` only reads `addr` after checking `len`.
    match unsafe { carried(fd, addr, len) } {
        Some((setup, dest)) => {
            // SAFETY: the caller's arguments, checked by `carried`.
            unsafe { redirect(real, fd, addr, len, setup, dest) }
        }
        // SAFETY: the caller's arguments, untouched.
        None => unsafe { real(fd, addr, len) },
    }
}

/// A destination the agent carries.
#[derive(Clone, Copy)]
enum Dest {
    /// An IPv4 address and port (host order): of an `AF_INET` socket, or an
    /// IPv4-mapped address on an `AF_INET6` one (`mapped`).
    V4 { ip: u32, port: u16, mapped: bool },
    /// An IPv6 address and port.
    V6 { ip: [u8; 16], port: u16 },
}

/// Whether this connect is one to carry: `roam run`'s environment is set,
/// `fd` is a TCP socket and `addr` a non-loopback IPv4 address (on an IPv4
/// socket, or IPv4-mapped on an IPv6 one) or a global IPv6 address (when
/// the agent listens on ::1), on a chosen port. Returns the setup and the
/// destination.
///
/// # Safety
///
/// `addr` is null or points to `len` readable bytes.
unsafe fn carried(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> Option<(&'static Setup, Dest)> {
    let setup = setup()?;
    if addr.is_null() || (len as usize) < std::mem::size_of::<sockaddr_in>() {
        return None;
    }
    // SAFETY: non-null with at least sizeof(sockaddr_in) readable bytes;
    // read unaligned, as the caller's buffer may be any byte array.
    let v4 = unsafe { std::ptr::read_unaligned(addr as *const sockaddr_in) };
    let (dest, domain) = match c_int::from(v4.sin_family) {
        libc::AF_INET => (
            Dest::V4 {
                ip: u32::from_be(v4.sin_addr.s_addr),
                port: u16::from_be(v4.sin_port),
                mapped: false,
            },
            libc::AF_INET,
        ),
        libc::AF_INET6 if (len as usize) >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: at least sizeof(sockaddr_in6) readable bytes, read
            // unaligned.
            let v6 = unsafe { std::ptr::read_unaligned(addr as *const libc::sockaddr_in6) };
            let port = u16::from_be(v6.sin6_port);
            let ip = v6.sin6_addr.s6_addr;
            let dest = match mapped_v4(&ip) {
                Some(ip) => Dest::V4 {
                    ip,
                    port,
                    mapped: true,
                },
                None => Dest::V6 { ip, port },
            };
            (dest, libc::AF_INET6)
        }
        _ => return None,
    };
    let port = match dest {
        Dest::V4 { ip, port, .. } => {
            if ip >> 24 == 127 || ip == 0 {
                return None;
            }
            port
        }
        Dest::V6 { ip, port } => {
            // Loopback, unspecified, link-local (no scope to carry) and
            // multicast stay with the real call; so does all of IPv6 when
            // the agent has no ::1 port.
            let special = ip == std::net::Ipv6Addr::LOCALHOST.octets()
                || ip == [0; 16]
                || (ip[0] == 0xfe && ip[1] & 0xc0 == 0x80)
                || ip[0] == 0xff;
            if special || setup.agent6_port == 0 {
                return None;
            }
            port
        }
    };
    if port == 0 || (!setup.ports.is_empty() && !setup.ports.contains(&port)) {
        return None;
    }
    if sock_opt(fd, libc::SO_TYPE)? != libc::SOCK_STREAM
        || sock_opt(fd, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP
        || sock_opt(fd, libc::SO_DOMAIN)? != domain
    {
        return None;
    }
    Some((setup, dest))
}

/// Registers `dest` for `fd`'s loopback port with the agent and connects
/// `fd` to the agent; anything that fails before the agent connect falls
/// back to the real connect to `addr`.
///
/// # Safety
///
/// `addr` points to `len` readable bytes (checked by [`carried`]).
unsafe fn redirect(
    real: ConnectFn,
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
    setup: &Setup,
    dest: Dest,
) -> c_int {
    let (here, agent) = match dest {
        Dest::V4 { mapped: false, .. } => (
            Endpoint::V4(loopback(0)),
            Endpoint::V4(loopback(setup.agent_port)),
        ),
        Dest::V4 { mapped: true, .. } => (
            Endpoint::V6(loopback6(0, true)),
            Endpoint::V6(loopback6(setup.agent_port, true)),
        ),
        Dest::V6 { .. } => (
            Endpoint::V6(loopback6(0, false)),
            Endpoint::V6(loopback6(setup.agent6_port, false)),
        ),
    };
    let Some(local_port) = bind_loopback(fd, &here) else {
        report("could not bind the socket to loopback");
        // SAFETY: the caller's arguments.
        return unsafe { real(fd, addr, len) };
    };
    if let Err(why) = register(real, setup, local_port, dest) {
        report(why);
        // SAFETY: the caller's arguments.
        return unsafe { real(fd, addr, len) };
    }
    let (p, n) = agent.raw();
    // SAFETY: `p` points to the valid socket address in `agent`, `n` bytes.
    unsafe { real(fd, p, n) }
}

/// A socket address of either family, on the stack.
enum Endpoint {
    V4(sockaddr_in),
    V6(libc::sockaddr_in6),
}

impl Endpoint {
    /// Its pointer and length, for bind and connect.
    fn raw(&self) -> (*const sockaddr, socklen_t) {
        match self {
            Endpoint::V4(a) => (
                a as *const sockaddr_in as *const sockaddr,
                std::mem::size_of::<sockaddr_in>() as socklen_t,
            ),
            Endpoint::V6(a) => (
                a as *const libc::sockaddr_in6 as *const sockaddr,
                std::mem::size_of::<libc::sockaddr_in6>() as socklen_t,
            ),
        }
    }
}

/// Binds `fd` to `here` (loopback, port 0) unless it is bound already;
/// returns its local port.
fn bind_loopback(fd: c_int, here: &Endpoint) -> Option<u16> {
    let bound = local_port(fd)?;
    if bound != 0 {
        return Some(bound);
    }
    let (p, n) = here.raw();
    // SAFETY: `p` points to a valid socket address of `n` bytes.
    let r = unsafe { libc::bind(fd, p, n) };
    if r != 0 {
        return None;
    }
    local_port(fd).filter(|&p| p != 0)
}

/// `fd`'s local port (0: unbound), either family.
fn local_port(fd: c_int) -> Option<u16> {
    local_name(fd).map(|me| u16::from_be(me.sin6_port))
}

/// `fd`'s local address (`getsockname`), in a `sockaddr_in6` that holds
/// either family (`sin6_family` says which; an `AF_INET` address has its
/// port at the same offset and its address in the next four bytes).
fn local_name(fd: c_int) -> Option<libc::sockaddr_in6> {
    // SAFETY: sockaddr_in6 is plain old data; all-zero is a valid value,
    // and it is large enough for either family.
    let mut me: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in6>() as socklen_t;
    // SAFETY: `me` is writable for `len` bytes and `len` is writable.
    let r = unsafe {
        libc::getsockname(
            fd,
            &mut me as *mut libc::sockaddr_in6 as *mut sockaddr,
            &mut len,
        )
    };
    (r == 0).then_some(me)
}

/// Tells the agent that the connection from loopback port `local_port` is
/// for `dest`, and waits for its one-byte acknowledgement: `C`, the local
/// port, the IPv4 destination and port (9 bytes), or `6`, the local port,
/// the IPv6 destination and port (21 bytes), all in network order.
fn register(
    real: ConnectFn,
    setup: &Setup,
    local_port: u16,
    dest: Dest,
) -> Result<(), &'static str> {
    let saved = errno();
    let mut msg = [0u8; 21];
    let n = match dest {
        Dest::V4 { ip, port, .. } => {
            msg[0] = b'C';
            msg[1..3].copy_from_slice(&local_port.to_be_bytes());
            msg[3..7].copy_from_slice(&ip.to_be_bytes());
            msg[7..9].copy_from_slice(&port.to_be_bytes());
            9
        }
        Dest::V6 { ip, port } => {
            msg[0] = b'6';
            msg[1..3].copy_from_slice(&local_port.to_be_bytes());
            msg[3..19].copy_from_slice(&ip);
            msg[19..21].copy_from_slice(&port.to_be_bytes());
            21
        }
    };
    let mut ack = [0u8; 1];
    let result = if ask(real, setup, &msg[..n], &mut ack) == Some(1) && ack[0] == b'+' {
        Ok(())
    } else {
        Err("the agent did not acknowledge the registration")
    };
    set_errno(saved);
    result
}

/// Sends `msg` to the agent over a new connection to its Unix socket and
/// reads its answer into `reply` until that is full or the agent closes;
/// returns how many bytes came (`None`: no agent). Leaves errno alone.
fn ask(real: ConnectFn, setup: &Setup, msg: &[u8], reply: &mut [u8]) -> Option<usize> {
    let saved = errno();
    // SAFETY: plain socket(2) call.
    let s = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        set_errno(saved);
        return None;
    }
    let result = (|| {
        // SAFETY: `setup.register` is a valid sockaddr_un and
        // `register_len` covers its family and path.
        let r = unsafe {
            real(
                s,
                &setup.register as *const sockaddr_un as *const sockaddr,
                setup.register_len,
            )
        };
        if r != 0 {
            return None;
        }
        // SAFETY: `msg` is readable for its length.
        let n = unsafe { libc::write(s, msg.as_ptr() as *const c_void, msg.len()) };
        if n != msg.len() as isize {
            return None;
        }
        let mut got = 0;
        while got < reply.len() {
            // SAFETY: `reply[got..]` is writable for its length.
            let n = unsafe {
                libc::read(
                    s,
                    reply[got..].as_mut_ptr() as *mut c_void,
                    reply.len() - got,
                )
            };
            match n {
                n if n > 0 => got += n as usize,
                0 => break,
                _ if errno() == libc::EINTR => continue,
                _ => return None,
            }
        }
        Some(got)
    })();
    // SAFETY: `s` is our descriptor, closed once.
    unsafe { libc::close(s) };
    set_errno(saved);
    result
}

/// The real `listen`'s type.
type ListenFn = unsafe extern "C" fn(c_int, c_int) -> c_int;
/// The real `accept4`'s type (`accept` is `accept4` with no flags).
type Accept4Fn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;
/// The real `getpeername`'s type.
type GetpeernameFn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;

/// The address of the next definition of `name` in the lookup order
/// (libc's), looked up once into `slot`; 0 if there is none.
fn next_symbol(slot: &OnceLock<usize>, name: &std::ffi::CStr) -> usize {
    *slot.get_or_init(|| {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name has no
        // preconditions; it returns null when there is no such symbol.
        unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize }
    })
}

/// The next `listen` in the lookup order (libc's).
fn real_listen() -> Option<ListenFn> {
    static REAL: OnceLock<usize> = OnceLock::new();
    let p = next_symbol(&REAL, c"listen");
    // SAFETY: a non-zero `p` is libc's `listen`, whose C signature is
    // exactly `ListenFn`.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, ListenFn>(p) })
}

/// The next `accept4` in the lookup order (libc's).
fn real_accept4() -> Option<Accept4Fn> {
    static REAL: OnceLock<usize> = OnceLock::new();
    let p = next_symbol(&REAL, c"accept4");
    // SAFETY: a non-zero `p` is libc's `accept4`, whose C signature is
    // exactly `Accept4Fn`.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, Accept4Fn>(p) })
}

/// The next `getpeername` in the lookup order (libc's): the library's own
/// calls must not go through its interposed one.
fn real_getpeername() -> Option<GetpeernameFn> {
    static REAL: OnceLock<usize> = OnceLock::new();
    let p = next_symbol(&REAL, c"getpeername");
    // SAFETY: a non-zero `p` is libc's `getpeername`, whose C signature is
    // exactly `GetpeernameFn`.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, GetpeernameFn>(p) })
}

/// Set once a listener's announcement failed and was reported.
static LISTEN_REPORTED: AtomicBool = AtomicBool::new(false);

/// `listen(2)`, interposed: a TCP socket listening on a non-loopback
/// address (or every address), on a chosen port, is announced to the agent
/// (`L` with an IPv4 address, for dual-stack `::` too; `l` with an IPv6
/// one), which then takes roam sessions for it. The real call's result is
/// returned either way.
///
/// # Safety
///
/// As `listen(2)`.
#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let Some(real) = real_listen() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: the caller's arguments, untouched.
    let r = unsafe { real(fd, backlog) };
    if r != 0 {
        return r;
    }
    let (Some(setup), Some(connect)) = (setup(), real_connect()) else {
        return r;
    };
    let chosen = |port: u16| setup.ports.is_empty() || setup.ports.contains(&port);
    let mut msg = [0u8; 19];
    let n = if let Some((ip, port)) =
        listening_v4(fd).filter(|&(ip, port)| ip >> 24 != 127 && chosen(port))
    {
        msg[0] = b'L';
        msg[1..5].copy_from_slice(&ip.to_be_bytes());
        msg[5..7].copy_from_slice(&port.to_be_bytes());
        7
    } else if let Some((ip, port)) = listening_v6(fd).filter(|&(_, port)| chosen(port)) {
        msg[0] = b'l';
        msg[1..17].copy_from_slice(&ip);
        msg[17..19].copy_from_slice(&port.to_be_bytes());
        19
    } else {
        0
    };
    if n > 0 {
        let mut ack = [0u8; 1];
        let answered = ask(connect, setup, &msg[..n], &mut ack) == Some(1) && ack[0] == b'+';
        if !answered && !LISTEN_REPORTED.swap(true, Ordering::Relaxed) {
            say("roam run: a listening socket takes plain TCP only: the agent did not answer\n");
        }
    }
    r
}

/// The IPv4 address (host order; 0: any) and port a TCP socket listens on,
/// if IPv4 clients reach it: an `AF_INET` socket, or an `AF_INET6` one
/// bound to `::` without `IPV6_V6ONLY` or to an IPv4-mapped address.
fn listening_v4(fd: c_int) -> Option<(u32, u16)> {
    if sock_opt(fd, libc::SO_TYPE)? != libc::SOCK_STREAM
        || sock_opt(fd, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP
    {
        return None;
    }
    let me = local_name(fd)?;
    let port = u16::from_be(me.sin6_port);
    match c_int::from(me.sin6_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in (family AF_INET) into
            // `me`, which is larger; read unaligned as a plain copy.
            let v4 = unsafe {
                std::ptr::read_unaligned(&me as *const libc::sockaddr_in6 as *const sockaddr_in)
            };
            Some((u32::from_be(v4.sin_addr.s_addr), port))
        }
        libc::AF_INET6 => {
            let a = me.sin6_addr.s6_addr;
            if a == [0; 16] {
                let mut v6only: c_int = 0;
                let mut olen = std::mem::size_of::<c_int>() as socklen_t;
                // SAFETY: `v6only` is writable for `olen` bytes.
                let r = unsafe {
                    libc::getsockopt(
                        fd,
                        libc::IPPROTO_IPV6,
                        libc::IPV6_V6ONLY,
                        &mut v6only as *mut c_int as *mut c_void,
                        &mut olen,
                    )
                };
                (r == 0 && v6only == 0).then_some((0, port))
            } else {
                mapped_v4(&a).map(|ip| (ip, port))
            }
        }
        _ => None,
    }
}

/// The IPv6 address and port an IPv6-only TCP listener listens on: `::`
/// with `IPV6_V6ONLY` set, or a global address (not loopback, link-local,
/// multicast or IPv4-mapped). Dual-stack `::` is [`listening_v4`]'s.
fn listening_v6(fd: c_int) -> Option<([u8; 16], u16)> {
    if sock_opt(fd, libc::SO_TYPE)? != libc::SOCK_STREAM
        || sock_opt(fd, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP
        || sock_opt(fd, libc::SO_DOMAIN)? != libc::AF_INET6
    {
        return None;
    }
    let me = local_name(fd)?;
    let ip = me.sin6_addr.s6_addr;
    let port = u16::from_be(me.sin6_port);
    if ip == [0; 16] {
        // (Dual-stack `::` is announced as IPv4's "any", which reaches it.)
        return (listening_v4(fd).is_none()).then_some((ip, port));
    }
    let special = ip == std::net::Ipv6Addr::LOCALHOST.octets()
        || (ip[0] == 0xfe && ip[1] & 0xc0 == 0x80)
        || ip[0] == 0xff
        || mapped_v4(&ip).is_some();
    (!special).then_some((ip, port))
}

/// The IPv4 address (host order) inside an IPv4-mapped IPv6 address.
fn mapped_v4(a: &[u8; 16]) -> Option<u32> {
    (a[..10] == [0; 10] && a[10] == 0xff && a[11] == 0xff)
        .then(|| u32::from_be_bytes([a[12], a[13], a[14], a[15]]))
}

/// `accept(2)`, interposed: see [`accept4`].
///
/// # Safety
///
/// As `accept(2)`.
#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the caller's arguments, under accept(2)'s contract.
    unsafe { accept4(fd, addr, len, 0) }
}

/// `accept4(2)`, interposed: a connection the agent made for a roam client
/// is returned with that client's address (in `addr`) instead of the
/// agent's loopback one.
///
/// # Safety
///
/// As `accept4(2)`: `addr` is null or writable for `*len` bytes, `len` null
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let Some(real) = real_accept4() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let cap = if addr.is_null() || len.is_null() {
        0
    } else {
        // SAFETY: `len` is non-null and readable, per the contract.
        unsafe { *len }
    };
    // SAFETY: the caller's arguments, untouched.
    let conn = unsafe { real(fd, addr, len, flags) };
    if conn >= 0 && cap > 0 {
        // SAFETY: `addr` is writable for `cap` bytes and `len` writable,
        // per the contract (checked non-null above).
        unsafe { rewrite_peer(conn, addr, len, cap) };
    }
    conn
}

/// `getpeername(2)`, interposed: a socket the agent carries names its real
/// peer (the destination the program connected to, or the roam client that
/// connected to it), not the agent.
///
/// # Safety
///
/// As `getpeername(2)`: `addr` writable for `*len` bytes, `len` writable.
#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let Some(real) = real_getpeername() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let cap = if addr.is_null() || len.is_null() {
        0
    } else {
        // SAFETY: `len` is non-null and readable, per the contract.
        unsafe { *len }
    };
    // SAFETY: the caller's arguments, untouched.
    let r = unsafe { real(fd, addr, len) };
    if r == 0 && cap > 0 {
        // SAFETY: as for the real call, checked non-null above.
        unsafe { rewrite_peer(fd, addr, len, cap) };
    }
    r
}

/// If `fd`'s real peer is on loopback and the agent carries it, writes the
/// peer the program should see into `addr` (as much as `cap` bytes allow,
/// in the socket's own family) and its full length into `*len`.
///
/// The question depends on the loopback peer: the agent's own port (an
/// outgoing connection, known by its local port: `Q` on 127.0.0.1, `q` on
/// ::1) or another port (an incoming connection the agent's relay made
/// from that port: `Q` on 127.0.0.1, `w` on ::1). The answer is `+` and an
/// IPv4 address and port, `=` and an IPv6 address and port, or `-`.
///
/// # Safety
///
/// `addr` is writable for `cap` bytes and `len` is writable.
unsafe fn rewrite_peer(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, cap: socklen_t) {
    let (Some(setup), Some(connect)) = (setup(), real_connect()) else {
        return;
    };
    let saved = errno();
    let Some((family, peer, pport)) = real_peer(fd) else {
        return;
    };
    let Some(lport) = local_port(fd) else {
        return;
    };
    let mut msg = [0u8; 13];
    let n = match peer {
        Ip::V4(pip) if pip >> 24 == 127 => {
            msg[0] = b'Q';
            msg[5..7].copy_from_slice(&lport.to_be_bytes());
            msg[7..11].copy_from_slice(&pip.to_be_bytes());
            msg[11..13].copy_from_slice(&pport.to_be_bytes());
            13
        }
        Ip::V6(pip) if pip == std::net::Ipv6Addr::LOCALHOST.octets() => {
            let (kind, port) = if setup.agent6_port != 0 && pport == setup.agent6_port {
                (b'q', lport)
            } else {
                (b'w', pport)
            };
            msg[0] = kind;
            msg[1..3].copy_from_slice(&port.to_be_bytes());
            3
        }
        _ => return,
    };
    let mut reply = [0u8; 19];
    let got = ask(connect, setup, &msg[..n], &mut reply);
    set_errno(saved);
    let (real, port) = match (got, reply[0]) {
        (Some(7), b'+') => (
            Ip::V4(u32::from_be_bytes([reply[1], reply[2], reply[3], reply[4]])),
            u16::from_be_bytes([reply[5], reply[6]]),
        ),
        (Some(19), b'=') => {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&reply[1..17]);
            (Ip::V6(ip), u16::from_be_bytes([reply[17], reply[18]]))
        }
        _ => return,
    };
    let mut out = [0u8; std::mem::size_of::<libc::sockaddr_in6>()];
    let size = match (family, real) {
        (libc::AF_INET, Ip::V4(ip)) => {
            let mut a = loopback(port);
            a.sin_addr.s_addr = ip.to_be();
            // SAFETY: `out` is larger than a sockaddr_in; written unaligned.
            unsafe { std::ptr::write_unaligned(out.as_mut_ptr() as *mut sockaddr_in, a) };
            std::mem::size_of::<sockaddr_in>()
        }
        (libc::AF_INET6, real) => {
            // SAFETY: sockaddr_in6 is plain old data; all-zero is valid.
            let mut a: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
            a.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            a.sin6_port = port.to_be();
            a.sin6_addr.s6_addr = match real {
                Ip::V4(ip) => std::net::Ipv4Addr::from(ip).to_ipv6_mapped().octets(),
                Ip::V6(ip) => ip,
            };
            // SAFETY: `out` is exactly a sockaddr_in6; written unaligned.
            unsafe { std::ptr::write_unaligned(out.as_mut_ptr() as *mut libc::sockaddr_in6, a) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
        // An IPv6 client cannot be named on an IPv4 socket: left as it is.
        _ => return,
    };
    let n = size.min(cap as usize);
    // SAFETY: `addr` is writable for `cap` >= `n` bytes; `out` readable for
    // `n`; they do not overlap (`out` is on our stack).
    unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), addr as *mut u8, n) };
    // SAFETY: `len` is writable, per the contract.
    unsafe { *len = size as socklen_t };
}

/// An IP address: IPv4 (host order) or IPv6 (network order bytes).
#[derive(Clone, Copy)]
enum Ip {
    V4(u32),
    V6([u8; 16]),
}

/// `fd`'s family and real peer (from the real `getpeername`), if it is a
/// TCP socket; an IPv4-mapped peer of an IPv6 socket is given as IPv4.
fn real_peer(fd: c_int) -> Option<(c_int, Ip, u16)> {
    let real = real_getpeername()?;
    let saved = errno();
    let peer = (|| {
        if sock_opt(fd, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP {
            return None;
        }
        // SAFETY: sockaddr_in6 is plain old data; all-zero is valid, and
        // it is large enough for either family.
        let mut a: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        let mut n = std::mem::size_of::<libc::sockaddr_in6>() as socklen_t;
        let p = &mut a as *mut libc::sockaddr_in6 as *mut sockaddr;
        // SAFETY: `a` is writable for `n` bytes, `n` writable.
        if unsafe { real(fd, p, &mut n) } != 0 {
            return None;
        }
        let port = u16::from_be(a.sin6_port);
        match c_int::from(a.sin6_family) {
            libc::AF_INET => {
                // SAFETY: the kernel wrote a sockaddr_in into the larger
                // `a`; read unaligned as a plain copy.
                let v4 = unsafe { std::ptr::read_unaligned(p as *const sockaddr_in) };
                Some((
                    libc::AF_INET,
                    Ip::V4(u32::from_be(v4.sin_addr.s_addr)),
                    port,
                ))
            }
            libc::AF_INET6 => {
                let ip = a.sin6_addr.s6_addr;
                let peer = mapped_v4(&ip).map_or(Ip::V6(ip), Ip::V4);
                Some((libc::AF_INET6, peer, port))
            }
            _ => None,
        }
    })();
    set_errno(saved);
    peer
}

/// 127.0.0.1:`port`.
fn loopback(port: u16) -> sockaddr_in {
    // SAFETY: sockaddr_in is plain old data; all-zero is a valid value.
    let mut a: sockaddr_in = unsafe { std::mem::zeroed() };
    a.sin_family = libc::AF_INET as libc::sa_family_t;
    a.sin_port = port.to_be();
    a.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
    a
}

/// `[::1]:port`, or `[::ffff:127.0.0.1]:port` if `mapped`.
fn loopback6(port: u16, mapped: bool) -> libc::sockaddr_in6 {
    // SAFETY: sockaddr_in6 is plain old data; all-zero is a valid value.
    let mut a: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    a.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    a.sin6_port = port.to_be();
    a.sin6_addr.s6_addr = if mapped {
        std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped().octets()
    } else {
        std::net::Ipv6Addr::LOCALHOST.octets()
    };
    a
}

/// An integer socket option of `fd` at `SOL_SOCKET`.
fn sock_opt(fd: c_int, opt: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: `v` is writable for `len` bytes and `len` is writable.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            &mut v as *mut c_int as *mut c_void,
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

/// Says once, on stderr, that a connection was left plain and why.
fn report(why: &str) {
    if REPORTED.swap(true, Ordering::Relaxed) {
        return;
    }
    say(&format!(
        "roam run: a connection is left as plain TCP: {why}\n"
    ));
}

/// Writes `line` to stderr, errno untouched.
fn say(line: &str) {
    let saved = errno();
    // SAFETY: `line` is readable for its length; fd 2 may be closed, in
    // which case the write fails harmlessly.
    unsafe { libc::write(2, line.as_ptr() as *const c_void, line.len()) };
    set_errno(saved);
}

/// This thread's `errno`.
fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() }
}

/// Sets this thread's `errno`.
fn set_errno(v: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = v };
}
