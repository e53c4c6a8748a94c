//! The LD_PRELOAD library of `roam run` (issue 13, rocks: reliable sockets
//! by interposition).
//!
//! `roam run -- CMD` starts CMD with this library preloaded and three
//! variables set: `ROAM_RUN_AGENT` (the agent's TCP port on 127.0.0.1),
//! `ROAM_RUN_REGISTER` (the agent's private Unix socket) and optionally
//! `ROAM_RUN_PORTS` (comma-separated destination ports; empty: every port).
//! The library replaces one call, `connect`. For an IPv4 TCP socket heading
//! for a non-loopback address (on a chosen port) it:
//!
//! 1. binds the socket to 127.0.0.1 (port chosen by the kernel) unless the
//!    program bound it already;
//! 2. tells the agent, over the Unix socket, "the connection from local port
//!    L is for A:P", and waits for its acknowledgement;
//! 3. connects the socket to the agent instead.
//!
//! The program keeps an ordinary TCP descriptor (blocking or not, in epoll,
//! poll or select, dup'ed, inherited across fork and exec): only its peer is
//! the agent, which carries the bytes as a roam stream when A runs a relay
//! and as plain TCP when it does not. Bound to loopback, the descriptor never
//! sees the network: a link cut or a new address at this end is the
//! session's business. Anything else (other families, UDP, loopback, an
//! unset environment, a failed registration) goes to the real `connect`
//! untouched; a failed registration is reported once on stderr.
//!
//! Everything here runs inside foreign programs: no allocation on the
//! connect path beyond the environment read at load, no panic (every
//! failure falls back to the real call), errno preserved as the real call
//! leaves it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use libc::{c_int, c_void, sockaddr, sockaddr_in, sockaddr_un, socklen_t};

/// The real `connect`'s type.
type ConnectFn = unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int;

/// What `roam run` told this process.
struct Setup {
    /// The agent's port on 127.0.0.1 (network byte order in `sockaddr_in`).
    agent_port: u16,
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

fn read_setup() -> Option<Setup> {
    let agent_port = std::env::var("ROAM_RUN_AGENT").ok()?.parse().ok()?;
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
            unsafe { redirect(real, fd, addr, len, setup, &dest) }
        }
        // SAFETY: the caller's arguments, untouched.
        None => unsafe { real(fd, addr, len) },
    }
}

/// Whether this connect is one to carry: `roam run`'s environment is set,
/// `fd` is an IPv4 TCP socket and `addr` a non-loopback IPv4 address on a
/// chosen port. Returns the setup and the destination.
///
/// # Safety
///
/// `addr` is null or points to `len` readable bytes.
unsafe fn carried(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> Option<(&'static Setup, sockaddr_in)> {
    let setup = setup()?;
    if addr.is_null() || (len as usize) < std::mem::size_of::<sockaddr_in>() {
        return None;
    }
    // SAFETY: non-null with at least sizeof(sockaddr_in) readable bytes;
    // read unaligned, as the caller's buffer may be any byte array.
    let dest = unsafe { std::ptr::read_unaligned(addr as *const sockaddr_in) };
    if c_int::from(dest.sin_family) != libc::AF_INET {
        return None;
    }
    let ip = u32::from_be(dest.sin_addr.s_addr);
    let port = u16::from_be(dest.sin_port);
    if ip >> 24 == 127 || ip == 0 || port == 0 {
        return None;
    }
    if !setup.ports.is_empty() && !setup.ports.contains(&port) {
        return None;
    }
    if sock_opt(fd, libc::SO_TYPE)? != libc::SOCK_STREAM
        || sock_opt(fd, libc::SO_PROTOCOL)? != libc::IPPROTO_TCP
        || sock_opt(fd, libc::SO_DOMAIN)? != libc::AF_INET
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
    dest: &sockaddr_in,
) -> c_int {
    let Some(local_port) = bind_loopback(fd) else {
        report("could not bind the socket to 127.0.0.1");
        // SAFETY: the caller's arguments.
        return unsafe { real(fd, addr, len) };
    };
    if let Err(why) = register(real, setup, local_port, dest) {
        report(why);
        // SAFETY: the caller's arguments.
        return unsafe { real(fd, addr, len) };
    }
    let agent = loopback(setup.agent_port);
    // SAFETY: `agent` is a valid sockaddr_in on the stack, its size given.
    unsafe {
        real(
            fd,
            &agent as *const sockaddr_in as *const sockaddr,
            std::mem::size_of::<sockaddr_in>() as socklen_t,
        )
    }
}

/// Binds `fd` to 127.0.0.1 on a kernel-chosen port unless it is bound
/// already; returns its local port.
fn bind_loopback(fd: c_int) -> Option<u16> {
    let bound = local_port(fd)?;
    if bound != 0 {
        return Some(bound);
    }
    let any = loopback(0);
    // SAFETY: `any` is a valid sockaddr_in on the stack, its size given.
    let r = unsafe {
        libc::bind(
            fd,
            &any as *const sockaddr_in as *const sockaddr,
            std::mem::size_of::<sockaddr_in>() as socklen_t,
        )
    };
    if r != 0 {
        return None;
    }
    local_port(fd).filter(|&p| p != 0)
}

/// `fd`'s local port (0: unbound).
fn local_port(fd: c_int) -> Option<u16> {
    // SAFETY: sockaddr_in is plain old data; all-zero is a valid value.
    let mut me: sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sockaddr_in>() as socklen_t;
    // SAFETY: `me` is writable for `len` bytes and `len` is writable.
    let r =
        unsafe { libc::getsockname(fd, &mut me as *mut sockaddr_in as *mut sockaddr, &mut len) };
    (r == 0).then(|| u16::from_be(me.sin_port))
}

/// Tells the agent that the connection from 127.0.0.1:`local_port` is for
/// `dest`, and waits for its one-byte acknowledgement (8 bytes out: the
/// local port, the destination address and port, all in network order).
fn register(
    real: ConnectFn,
    setup: &Setup,
    local_port: u16,
    dest: &sockaddr_in,
) -> Result<(), &'static str> {
    // SAFETY: plain socket(2) call.
    let s = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return Err("no socket for the agent");
    }
    let saved = errno();
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
            return Err("the agent's socket refused the registration");
        }
        let mut msg = [0u8; 8];
        msg[0..2].copy_from_slice(&local_port.to_be_bytes());
        msg[2..6].copy_from_slice(&u32::from_be(dest.sin_addr.s_addr).to_be_bytes());
        msg[6..8].copy_from_slice(&u16::from_be(dest.sin_port).to_be_bytes());
        // SAFETY: `msg` is readable for its length.
        let n = unsafe { libc::write(s, msg.as_ptr() as *const c_void, msg.len()) };
        if n != msg.len() as isize {
            return Err("writing to the agent failed");
        }
        let mut ack = [0u8; 1];
        // SAFETY: `ack` is writable for its length.
        let n = unsafe { libc::read(s, ack.as_mut_ptr() as *mut c_void, 1) };
        if n != 1 || ack[0] != b'+' {
            return Err("the agent did not acknowledge the registration");
        }
        Ok(())
    })();
    // SAFETY: `s` is our descriptor, closed once.
    unsafe { libc::close(s) };
    set_errno(saved);
    result
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
    let saved = errno();
    let line = format!("roam run: a connection is left as plain TCP: {why}\n");
    // SAFETY: `line` is readable for its length; fd 2 may be closed, in
    // which case the write fails harmlessly.
    unsafe { libc::write(2, line.as_ptr() as *const c_void, line.len()) };
    set_errno(saved);
}

fn errno() -> c_int {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() }
}

fn set_errno(v: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = v };
}
