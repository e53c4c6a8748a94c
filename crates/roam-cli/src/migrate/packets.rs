//! Packets that arrive for a moving process during its freeze: captured at
//! the source, re-injected at the destination once the process runs there
//! (the paper's §3.3), so that its peers' segments sent during the freeze
//! are not left to their retransmission timers.
//!
//! Capture: a packet socket (`AF_PACKET`, `SOCK_DGRAM`, all IPv4 or all
//! IPv6, the moving address's family) in the source's network namespace
//! sees each packet as it arrives, before netfilter — where the address lock
//! then drops it. Every TCP and UDP
//! packet to the moving address is kept (from the lock until the address
//! leaves the source), duplicates (loopback shows a packet twice) once.
//! Re-injection: a raw socket of the address's family (`IPPROTO_RAW`: the
//! packet's own header, its source the peer's address) sends each one to the
//! address, which is local at the destination, so the kernel delivers it as
//! if it had just arrived. Its TCP or UDP checksum is computed afresh first
//! (a captured packet from a sender with checksum offload may carry only a
//! partial one). An IPv6 packet is taken only when its fixed header is
//! followed directly by TCP or UDP (no extension headers, so no fragments).

use std::collections::HashSet;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use socket2::{Domain, Protocol, SockAddr, SockFilter, Socket, Type};

/// Most packets kept (beyond it the rest are left to retransmission).
const MAX_PACKETS: usize = 100_000;

/// Most bytes kept.
const MAX_BYTES: usize = 64 << 20;

/// `ETH_P_IP`, in network byte order as a packet socket's protocol.
const ETH_P_IP_BE: i32 = (0x0800u16).to_be() as i32;

/// `ETH_P_IPV6`, likewise.
const ETH_P_IPV6_BE: i32 = (0x86ddu16).to_be() as i32;

/// A capture running on a thread of its own.
pub(crate) struct Capture {
    /// Wakes the thread and tells it to stop (when dropped).
    stop: std::os::unix::net::UnixStream,
    /// Set once the address is locked (see [`Capture::locked`]).
    locked: Arc<AtomicBool>,
    /// The thread; returns the packets and its socket.
    thread: std::thread::JoinHandle<(Vec<Vec<u8>>, Socket)>,
}

impl Capture {
    /// Starts capturing TCP and UDP packets to `addr` in this namespace.
    pub(crate) fn start(addr: IpAddr) -> std::io::Result<Capture> {
        let family = match addr {
            IpAddr::V4(_) => ETH_P_IP_BE,
            IpAddr::V6(_) => ETH_P_IPV6_BE,
        };
        let sock = Socket::new(Domain::PACKET, Type::DGRAM, Some(Protocol::from(family)))?;
        // Only packets to the address reach the queue: the thread does not
        // wake (and take CPU from the move) for the rest of the namespace's
        // traffic, the move's own session among it.
        sock.attach_filter(&to_address(addr))?;
        sock.set_nonblocking(true)?;
        sock.set_recv_buffer_size(8 << 20)?;
        let (stop, stopped) = std::os::unix::net::UnixStream::pair()?;
        let locked = Arc::new(AtomicBool::new(false));
        let thread = {
            let locked = locked.clone();
            std::thread::spawn(move || {
                let kept = capture(&sock, addr, &stopped, &locked);
                (kept, sock)
            })
        };
        Ok(Capture {
            stop,
            locked,
            thread,
        })
    }

    /// Says the address's lock is in place. A capture starts before the
    /// lock, so that no packet falls between the two (one that did waited
    /// for its sender's retransmission, 200 ms or more); until this, it
    /// keeps TCP segments only: one that reached the process before the
    /// lock is a duplicate at the destination, which TCP drops there, but
    /// a UDP datagram would be delivered twice.
    pub(crate) fn locked(&self) {
        self.locked.store(true, Ordering::Relaxed);
    }

    /// Stops, and returns the packets captured, in arrival order. The
    /// socket is closed on a thread of its own (see [`close_later`]).
    pub(crate) fn finish(self) -> Vec<Vec<u8>> {
        drop(self.stop);
        match self.thread.join() {
            Ok((kept, sock)) => {
                close_later(sock);
                kept
            }
            Err(_) => Vec::new(),
        }
    }
}

/// Closes a packet socket on a thread of its own: the kernel's release of
/// one waits for an RCU grace period (`synchronize_net` in
/// `packet_release`), 15-20 ms measured here, which must not fall inside a
/// move's freeze.
pub(crate) fn close_later<T: Send + 'static>(socket: T) {
    let _ = std::thread::Builder::new()
        .name("roam-close".into())
        .spawn(move || drop(socket));
}

/// A classic BPF program for a cooked (`SOCK_DGRAM`) packet socket, whose
/// data begins with the IP header: accepts the packets whose destination is
/// `addr` (IPv4 at offset 16, IPv6 at 24) and drops the rest.
fn to_address(addr: IpAddr) -> Vec<SockFilter> {
    /// `BPF_LD | BPF_W | BPF_ABS`: load the big-endian word at `k`.
    const LD_WORD: u16 = 0x20;
    /// `BPF_JMP | BPF_JEQ | BPF_K`: skip `jt` if equal to `k`, else `jf`.
    const JEQ: u16 = 0x15;
    /// `BPF_RET | BPF_K`: keep `k` bytes (0: drop).
    const RET: u16 = 0x06;
    /// Kept whole.
    const ALL: u32 = 0x0004_0000;
    let (offset, words): (u32, Vec<u32>) = match addr {
        IpAddr::V4(a) => (16, vec![u32::from_be_bytes(a.octets())]),
        IpAddr::V6(a) => (
            24,
            a.octets()
                .chunks(4)
                .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    };
    let n = words.len();
    let mut prog = Vec::with_capacity(2 * n + 2);
    for (i, w) in words.into_iter().enumerate() {
        prog.push(SockFilter::new(LD_WORD, 0, 0, offset + 4 * i as u32));
        // A mismatch jumps over the rest and the accept, to the drop.
        let to_drop = (2 * (n - 1 - i) + 1) as u8;
        prog.push(SockFilter::new(JEQ, 0, to_drop, w));
    }
    prog.push(SockFilter::new(RET, 0, 0, ALL));
    prog.push(SockFilter::new(RET, 0, 0, 0));
    prog
}

/// The capture thread's loop: reads what arrives until `stopped` ends
/// (its other end dropped), then what was queued by then.
fn capture(
    sock: &Socket,
    addr: IpAddr,
    stopped: &std::os::unix::net::UnixStream,
    locked: &AtomicBool,
) -> Vec<Vec<u8>> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut kept = Vec::new();
    let mut seen = HashSet::new();
    let mut bytes = 0usize;
    let mut buf = vec![0u8; 65536];
    let mut r = sock;
    let mut drain = |r: &mut &Socket| {
        // Non-blocking: until the queue is empty, or a bounded number of
        // reads should packets go on arriving faster than they are read.
        for _ in 0..DRAIN_READS {
            let Ok(n) = r.read(&mut buf) else { break };
            let p = &buf[..n];
            if is_carried_to(p, addr)
                && (locked.load(Ordering::Relaxed) || !is_udp(p))
                && kept.len() < MAX_PACKETS
                && bytes + n <= MAX_BYTES
                && seen.insert(p.to_vec())
            {
                bytes += n;
                kept.push(p.to_vec());
            }
        }
    };
    loop {
        let mut fds = [
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(stopped.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            // Not expected; a capture that cannot wait keeps what it has.
            Err(_) => break,
        }
        let stop = fds[1].revents().is_some_and(|e| !e.is_empty());
        // A packet that arrived before the stop is kept.
        drain(&mut r);
        if stop {
            break;
        }
    }
    kept
}

/// Most reads of one drain.
const DRAIN_READS: usize = 10_000;

/// `IPPROTO_TCP`.
const TCP: u8 = 6;
/// `IPPROTO_UDP`.
const UDP: u8 = 17;

/// Whether `p` is a whole TCP or UDP packet (unfragmented, its transport
/// header complete) to `addr`, of `addr`'s family.
pub(crate) fn is_carried_to(p: &[u8], addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => is_carried_to_v4(p, a),
        IpAddr::V6(a) => is_carried_to_v6(p, a),
    }
}

/// Whether `p`, an IPv4 or IPv6 packet, carries UDP (IPv6: in its fixed
/// header's next header).
fn is_udp(p: &[u8]) -> bool {
    match p.first().map(|b| b >> 4) {
        Some(4) => p.get(9) == Some(&UDP),
        Some(6) => p.get(6) == Some(&UDP),
        _ => false,
    }
}

/// [`is_carried_to`] for an IPv6 address: the fixed header's next header is
/// TCP or UDP (extension headers, fragments among them, are not followed),
/// and the payload length is the packet's (jumbograms are not taken).
fn is_carried_to_v6(p: &[u8], addr: Ipv6Addr) -> bool {
    if p.len() < 40 || p[0] >> 4 != 6 {
        return false;
    }
    let payload = usize::from(u16::from_be_bytes([p[4], p[5]]));
    // The header's length first: a shorter packet (cut, or lying about its
    // length) is never read past its end.
    if payload != p.len() - 40 {
        return false;
    }
    let header = match p[6] {
        TCP => 20,
        UDP if payload >= 8 => {
            if usize::from(u16::from_be_bytes([p[44], p[45]])) != payload {
                return false;
            }
            8
        }
        _ => return false,
    };
    payload >= header && p[24..40] == addr.octets()
}

/// [`is_carried_to`] for an IPv4 address.
fn is_carried_to_v4(p: &[u8], addr: Ipv4Addr) -> bool {
    if p.len() < 20 || p[0] >> 4 != 4 {
        return false;
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
    // More-fragments flag or a fragment offset: not a whole segment.
    let frag = u16::from_be_bytes([p[6], p[7]]) & 0x3fff;
    // The header's lengths first: a shorter packet (cut, or lying about its
    // length) is never read past its end.
    if ihl < 20 || total != p.len() {
        return false;
    }
    let header = match p[9] {
        TCP => 20,
        // A UDP datagram's own length must agree with the IP header's.
        UDP if total >= ihl + 8 => {
            if usize::from(u16::from_be_bytes([p[ihl + 4], p[ihl + 5]])) != total - ihl {
                return false;
            }
            8
        }
        _ => return false,
    };
    total >= ihl + header && frag == 0 && p[16..20] == addr.octets()
}

/// The ones' complement sum of `data` (16-bit big-endian words), folded.
fn sum(mut acc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for w in &mut chunks {
        acc += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc
}

/// The length of `p`'s IP header (an IPv6 packet's fixed header: extension
/// headers are never taken), the transport protocol, and where the source
/// and destination addresses lie (the pseudo-header's).
fn ip_header(p: &[u8]) -> (usize, u8, std::ops::Range<usize>) {
    if p[0] >> 4 == 6 {
        (40, p[6], 8..40)
    } else {
        (usize::from(p[0] & 0x0f) * 4, p[9], 12..20)
    }
}

/// Where the checksum sits in `p`'s transport header, and the protocol.
fn checksum_at(p: &[u8]) -> (usize, u8) {
    let (hl, proto, _) = ip_header(p);
    match proto {
        UDP => (hl + 6, UDP),
        _ => (hl + 16, TCP),
    }
}

/// The ones' complement sum of `p`'s pseudo-header and transport segment.
/// The two families' pseudo-headers sum alike: both addresses, the
/// protocol and the transport length (IPv6's 32-bit length is below 2^16
/// here, so it adds as one word).
fn transport_sum(p: &[u8], proto: u8) -> u32 {
    let (ihl, _, addrs) = ip_header(p);
    let len = p.len() - ihl;
    let acc = sum(0, &p[addrs]);
    let acc = sum(
        acc + u32::from(proto) + u32::try_from(len).unwrap_or(0),
        &[],
    );
    sum(acc, &p[ihl..])
}

/// Sets `p`'s TCP or UDP checksum (`p` as [`is_carried_to`] accepts it).
pub(crate) fn fix_checksum(p: &mut [u8]) {
    let (at, proto) = checksum_at(p);
    p[at] = 0;
    p[at + 1] = 0;
    let mut c = !(transport_sum(p, proto) as u16);
    // UDP: an all-zero checksum means "none"; its value is sent as ones.
    if proto == UDP && c == 0 {
        c = 0xffff;
    }
    p[at..at + 2].copy_from_slice(&c.to_be_bytes());
}

/// Whether `p`'s TCP or UDP checksum is right.
#[cfg(test)]
fn checksum_ok(p: &[u8]) -> bool {
    let (_, proto) = checksum_at(p);
    transport_sum(p, proto) == 0xffff
}

/// Delivers `packets` (TCP or UDP packets to `addr`, local here) as if they
/// had just arrived. Returns how many were sent.
pub(crate) fn reinject(packets: &[Vec<u8>], addr: IpAddr) -> std::io::Result<usize> {
    // IPPROTO_RAW: the packets carry their own IP header (for IPv6 too:
    // Linux sets IPV6_HDRINCL on such a socket).
    let domain = match addr {
        IpAddr::V4(_) => Domain::IPV4,
        IpAddr::V6(_) => Domain::IPV6,
    };
    let sock = Socket::new(domain, Type::RAW, Some(Protocol::from(255)))?;
    let to = SockAddr::from(SocketAddr::new(addr, 0));
    let mut sent = 0;
    for p in packets {
        if !is_carried_to(p, addr) {
            continue;
        }
        let mut p = p.clone();
        fix_checksum(&mut p);
        sock.send_to(&p, &to)?;
        sent += 1;
    }
    Ok(sent)
}

/// Packs packets into frame payloads of at most `max` bytes each: per
/// packet a big-endian `u16` length and its bytes.
pub(crate) fn pack(packets: &[Vec<u8>], max: usize) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut cur = Vec::new();
    for p in packets {
        let Ok(len) = u16::try_from(p.len()) else {
            continue;
        };
        if !cur.is_empty() && cur.len() + 2 + p.len() > max {
            out.push(std::mem::take(&mut cur));
        }
        cur.extend_from_slice(&len.to_be_bytes());
        cur.extend_from_slice(p);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Unpacks a [`pack`]ed payload; `None` if it is malformed.
pub(crate) fn unpack(mut payload: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    while !payload.is_empty() {
        let [a, b, rest @ ..] = payload else {
            return None;
        };
        let n = usize::from(u16::from_be_bytes([*a, *b]));
        if n == 0 || rest.len() < n {
            return None;
        }
        out.push(rest[..n].to_vec());
        payload = &rest[n..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An IPv4 address as [`is_carried_to`] takes it.
    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    /// `fd00::<last>`.
    fn fd00(last: u16) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, last)
    }

    /// An IPv6 packet from fd00::1 to fd00::2 carrying `transport`
    /// (protocol `proto`).
    fn packet6(proto: u8, transport: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x60;
        p[4..6].copy_from_slice(&u16::try_from(transport.len()).unwrap().to_be_bytes());
        p[6] = proto;
        p[7] = 64;
        p[8..24].copy_from_slice(&fd00(1).octets());
        p[24..40].copy_from_slice(&fd00(2).octets());
        p.extend_from_slice(transport);
        p
    }

    /// A UDP datagram fd00::1:40000 -> fd00::2:7100 carrying `data`.
    fn datagram6(data: &[u8]) -> Vec<u8> {
        let mut u = Vec::new();
        u.extend_from_slice(&40000u16.to_be_bytes());
        u.extend_from_slice(&7100u16.to_be_bytes());
        u.extend_from_slice(&u16::try_from(8 + data.len()).unwrap().to_be_bytes());
        u.extend_from_slice(&[0, 0]);
        u.extend_from_slice(data);
        packet6(UDP, &u)
    }

    /// A SYN fd00::1:40000 -> fd00::2:7100, seq 12345, window 65535.
    fn syn6() -> Vec<u8> {
        let mut t = vec![0u8; 20];
        t[0..2].copy_from_slice(&40000u16.to_be_bytes());
        t[2..4].copy_from_slice(&7100u16.to_be_bytes());
        t[4..8].copy_from_slice(&12345u32.to_be_bytes());
        t[12] = 5 << 4;
        t[13] = 0x02;
        t[14..16].copy_from_slice(&65535u16.to_be_bytes());
        packet6(TCP, &t)
    }

    #[test]
    fn ipv6_checksums_match_an_independent_implementation() {
        // Both values computed by a few lines of Python over the same
        // pseudo-header (addresses, 32-bit length, next header) and segment.
        let mut d = datagram6(b"abc");
        assert!(is_carried_to(&d, IpAddr::V6(fd00(2))));
        fix_checksum(&mut d);
        assert_eq!(u16::from_be_bytes([d[46], d[47]]), 0x8974);
        assert!(checksum_ok(&d));
        d[42] ^= 1;
        assert!(!checksum_ok(&d));
        let mut syn = syn6();
        assert!(is_carried_to(&syn, IpAddr::V6(fd00(2))));
        fix_checksum(&mut syn);
        assert_eq!(u16::from_be_bytes([syn[56], syn[57]]), 0xcda8);
    }

    #[test]
    fn only_whole_ipv6_tcp_and_udp_packets_to_the_address_are_taken() {
        let to = IpAddr::V6(fd00(2));
        let d = datagram6(b"hello");
        assert!(is_carried_to(&d, to));
        assert!(!is_carried_to(&d, IpAddr::V6(fd00(3))));
        assert!(
            !is_carried_to(&d, v4(10, 0, 0, 2)),
            "an IPv6 packet is not an IPv4 one"
        );
        assert!(!is_carried_to(&datagram(b"x"), to), "nor the other way");
        let mut bad_len = d.clone();
        bad_len[45] += 1;
        assert!(!is_carried_to(&bad_len, to), "UDP length disagrees");
        let mut short = d.clone();
        short.pop();
        assert!(!is_carried_to(&short, to), "payload length disagrees");
        let mut frag = d.clone();
        frag[6] = 44; // a fragment header
        assert!(!is_carried_to(&frag, to));
        let mut icmp = d.clone();
        icmp[6] = 58;
        assert!(!is_carried_to(&icmp, to));
        assert!(!is_carried_to(&syn6()[..59], to), "a cut TCP header");
        assert!(!is_carried_to(&d[..39], to));
        // Headers that claim more than the packet holds are refused, never
        // read past its end.
        let mut lying = datagram6(b"");
        lying[4..6].copy_from_slice(&100u16.to_be_bytes());
        assert!(!is_carried_to(&lying[..41], to));
        assert!(!is_carried_to(&lying, to));
        let mut lying4 = datagram(b"");
        lying4[2..4].copy_from_slice(&1000u16.to_be_bytes());
        assert!(!is_carried_to(&lying4[..22], v4(10, 0, 0, 2)));
        assert!(!is_carried_to(&lying4, v4(10, 0, 0, 2)));
    }

    /// A TCP segment from 10.0.0.1:40000 to 10.0.0.2:7100 carrying `data`.
    fn segment(data: &[u8]) -> Vec<u8> {
        let total = 40 + data.len();
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&u16::try_from(total).unwrap().to_be_bytes());
        p[8] = 64;
        p[9] = 6;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&40000u16.to_be_bytes());
        p[22..24].copy_from_slice(&7100u16.to_be_bytes());
        p[24..28].copy_from_slice(&12345u32.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = 0x18;
        p[34..36].copy_from_slice(&65535u16.to_be_bytes());
        p[40..].copy_from_slice(data);
        p
    }

    #[test]
    fn checksums_verify_and_catch_a_changed_byte() {
        for data in [&b""[..], b"x", b"hello, world", &[0xff; 1001]] {
            let mut p = segment(data);
            assert!(is_carried_to(&p, v4(10, 0, 0, 2)));
            fix_checksum(&mut p);
            assert!(checksum_ok(&p), "{data:?}");
            let last = p.len() - 1;
            p[last] ^= 1;
            assert!(!checksum_ok(&p));
        }
        for data in [&b""[..], b"x", b"hello, world", &[0xff; 1001]] {
            let mut p = datagram(data);
            assert!(is_carried_to(&p, v4(10, 0, 0, 2)));
            fix_checksum(&mut p);
            assert!(checksum_ok(&p), "UDP {data:?}");
            assert_ne!(u16::from_be_bytes([p[26], p[27]]), 0, "0 would mean none");
            let last = p.len() - 1;
            p[last] ^= 1;
            assert!(!checksum_ok(&p));
        }
        // A known datagram: 10.0.0.1:40000 -> 10.0.0.2:7100 carrying "abc";
        // its checksum as an independent implementation computes it.
        let mut d = datagram(b"abc");
        fix_checksum(&mut d);
        assert_eq!(u16::from_be_bytes([d[26], d[27]]), 0x6f76);
        // A known segment: SYN 10.0.0.1:40000 -> 10.0.0.2:7100, seq 12345,
        // no data, window 65535; its checksum as an independent
        // implementation (a few lines of Python) computes it.
        let mut syn = segment(b"");
        syn[33] = 0x02;
        fix_checksum(&mut syn);
        assert_eq!(u16::from_be_bytes([syn[36], syn[37]]), 0xb3aa);
    }

    /// A UDP datagram from 10.0.0.1:40000 to 10.0.0.2:7100 carrying `data`.
    fn datagram(data: &[u8]) -> Vec<u8> {
        let total = 28 + data.len();
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&u16::try_from(total).unwrap().to_be_bytes());
        p[8] = 64;
        p[9] = 17;
        p[12..16].copy_from_slice(&[10, 0, 0, 1]);
        p[16..20].copy_from_slice(&[10, 0, 0, 2]);
        p[20..22].copy_from_slice(&40000u16.to_be_bytes());
        p[22..24].copy_from_slice(&7100u16.to_be_bytes());
        p[24..26].copy_from_slice(&u16::try_from(8 + data.len()).unwrap().to_be_bytes());
        p[28..].copy_from_slice(data);
        p
    }

    #[test]
    fn only_whole_tcp_and_udp_packets_to_the_address_are_taken() {
        let p = segment(b"abc");
        assert!(is_carried_to(&p, v4(10, 0, 0, 2)));
        assert!(!is_carried_to(&p, v4(10, 0, 0, 3)));
        let d = datagram(b"abc");
        assert!(is_carried_to(&d, v4(10, 0, 0, 2)));
        let mut bad_len = d.clone();
        bad_len[25] += 1;
        assert!(!is_carried_to(&bad_len, v4(10, 0, 0, 2)));
        let mut icmp = p.clone();
        icmp[9] = 1;
        assert!(!is_carried_to(&icmp, v4(10, 0, 0, 2)));
        let mut frag = p.clone();
        frag[6] = 0x20;
        assert!(!is_carried_to(&frag, v4(10, 0, 0, 2)));
        assert!(!is_carried_to(&p[..30], v4(10, 0, 0, 2)));
        assert!(!is_carried_to(&d[..27], v4(10, 0, 0, 2)));
    }

    /// A migration's freeze in miniature, over IPv6 on a veth pair between two
    /// namespaces: the server's input for its address is dropped (as the
    /// source's lock does) while the client sends UDP datagrams and TCP
    /// bytes; the capture keeps them; the drop is lifted and the captured
    /// packets are re-injected; the server's sockets receive exactly what
    /// was sent. The client's retransmission timer is held at 3 s and its
    /// tail loss probes are off, so the TCP bytes, arriving well before
    /// that, came through re-injection.
    #[test]
    fn ipv6_packets_dropped_during_a_freeze_are_captured_and_reinjected_whole() {
        use super::super::sh;
        use roam_sim::netns::{NetPair, Side, IFACE};
        use std::io::Write;
        if let Err(why) = roam_sim::netns::available() {
            eprintln!("SKIP: {why}");
            return;
        }
        if !roam_sim::netns::installed("nft") {
            eprintln!("SKIP: nft (nftables) is not installed");
            return;
        }
        let pair = NetPair::new("pkt6").expect("namespaces");
        let (c, s) = (pair.ns(Side::Client), pair.ns(Side::Server));
        let (caddr, saddr) = (fd00(1), fd00(2));
        sh(&format!(
            "ip -n {c} addr add {caddr}/64 dev {IFACE} nodad && \
             ip -n {s} addr add {saddr}/64 dev {IFACE} nodad && \
             ip -n {c} -6 route replace fd00::/64 dev {IFACE} rto_min 3s && \
             ip netns exec {c} sysctl -qw net.ipv4.tcp_early_retrans=0"
        ));
        let (udp, listener) = pair
            .in_ns(Side::Server, || {
                (
                    std::net::UdpSocket::bind((saddr, 0)).expect("udp"),
                    std::net::TcpListener::bind((saddr, 0)).expect("tcp"),
                )
            })
            .expect("server namespace");
        let (udp_to, tcp_to) = (udp.local_addr().unwrap(), listener.local_addr().unwrap());
        let (cudp, mut ctcp) = pair
            .in_ns(Side::Client, || {
                (
                    std::net::UdpSocket::bind((caddr, 0)).expect("client udp"),
                    std::net::TcpStream::connect(tcp_to).expect("connect"),
                )
            })
            .expect("client namespace");
        let (mut stcp, _) = listener.accept().expect("accept");
        sh(&format!(
            "ip netns exec {s} nft -f - <<'EOF'
table inet roam_pkt6_test {{
    chain input {{
        type filter hook input priority 0; policy accept;
        ip6 daddr {saddr} meta l4proto {{ tcp, udp }} drop
    }}
}}
EOF"
        ));
        let capture = pair
            .in_ns(Side::Server, || Capture::start(IpAddr::V6(saddr)))
            .expect("server namespace")
            .expect("capture");
        // A datagram before the capture is told of the lock is not kept (in
        // a move it reached the process before the lock), then the drop is
        // in place, as a move's lock: UDP is kept from here.
        cudp.send_to(b"before the lock", udp_to).expect("send");
        std::thread::sleep(Duration::from_millis(50));
        capture.locked();
        let sent_at = std::time::Instant::now();
        let datagrams: Vec<Vec<u8>> = (0u8..3)
            .map(|i| vec![b'a' + i; 100 + usize::from(i)])
            .collect();
        for d in &datagrams {
            cudp.send_to(d, udp_to).expect("send");
        }
        let bytes: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        ctcp.write_all(&bytes).expect("write");
        std::thread::sleep(Duration::from_millis(300));
        stcp.set_nonblocking(true).unwrap();
        udp.set_nonblocking(true).unwrap();
        let mut buf = vec![0u8; 65536];
        assert!(
            stcp.read(&mut buf).is_err() && udp.recv(&mut buf).is_err(),
            "the drop (the lock) let something through"
        );
        sh(&format!(
            "ip netns exec {s} nft delete table inet roam_pkt6_test"
        ));
        let packets = capture.finish();
        assert!(
            packets.len() >= 4,
            "3 datagrams and the TCP bytes captured: {} packets",
            packets.len()
        );
        let n = pair
            .in_ns(Side::Server, || reinject(&packets, IpAddr::V6(saddr)))
            .expect("server namespace")
            .expect("re-inject");
        assert_eq!(n, packets.len());
        udp.set_nonblocking(false).unwrap();
        udp.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        for d in &datagrams {
            let got = udp.recv(&mut buf).expect("a re-injected datagram");
            assert_eq!(&buf[..got], &d[..], "datagrams whole and in order");
        }
        udp.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        assert!(udp.recv(&mut buf).is_err(), "each datagram once");
        stcp.set_nonblocking(false).unwrap();
        stcp.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut got = Vec::new();
        while got.len() < bytes.len() {
            match stcp.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => got.extend_from_slice(&buf[..k]),
                Err(e) => panic!(
                    "TCP bytes not delivered after {} of {}: {e}",
                    got.len(),
                    bytes.len()
                ),
            }
        }
        assert_eq!(got, bytes, "every TCP byte once, in order");
        assert!(
            sent_at.elapsed() < Duration::from_millis(2800),
            "delivered only after {:?}: by retransmission, not re-injection",
            sent_at.elapsed()
        );
    }

    #[test]
    fn packing_round_trips_within_the_frame_limit() {
        let packets: Vec<Vec<u8>> = (0..50).map(|i| segment(&vec![i; 300])).collect();
        let frames = pack(&packets, 4096);
        assert!(frames.len() > 1 && frames.iter().all(|f| f.len() <= 4096));
        let back: Vec<Vec<u8>> = frames.iter().flat_map(|f| unpack(f).unwrap()).collect();
        assert_eq!(back, packets);
        assert_eq!(unpack(&[0, 5, 1, 2]), None);
        assert_eq!(unpack(&[0, 0]), None);
    }
}
