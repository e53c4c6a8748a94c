//! Packets that arrive for a moving process during its freeze: captured at
//! the source, re-injected at the destination once the process runs there
//! (the paper's §3.3), so that its peers' segments sent during the freeze
//! are not left to their retransmission timers.
//!
//! Capture: a packet socket (`AF_PACKET`, `SOCK_DGRAM`, all IPv4) in the
//! source's network namespace sees each packet as it arrives, before
//! netfilter — where the address lock then drops it. Every TCP and UDP
//! packet to the moving address is kept (from the lock until the address
//! leaves the source), duplicates (loopback shows a packet twice) once.
//! Re-injection: a raw IPv4 socket (`IPPROTO_RAW`: the packet's own header,
//! its source the peer's address) sends each one to the address, which is
//! local at the destination, so the kernel delivers it as if it had just
//! arrived. Its TCP or UDP checksum is computed afresh first (a captured
//! packet from a sender with checksum offload may carry only a partial
//! one). IPv4 only.

use std::collections::HashSet;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Most packets kept (beyond it the rest are left to retransmission).
const MAX_PACKETS: usize = 100_000;

/// Most bytes kept.
const MAX_BYTES: usize = 64 << 20;

/// `ETH_P_IP`, in network byte order as a packet socket's protocol.
const ETH_P_IP_BE: i32 = (0x0800u16).to_be() as i32;

/// A capture running on a thread of its own.
pub(crate) struct Capture {
    /// Tells the thread to stop.
    stop: Arc<AtomicBool>,
    /// The thread; returns the packets.
    thread: std::thread::JoinHandle<Vec<Vec<u8>>>,
}

impl Capture {
    /// Starts capturing TCP and UDP packets to `addr` (IPv4) in this
    /// namespace.
    pub(crate) fn start(addr: Ipv4Addr) -> std::io::Result<Capture> {
        let sock = Socket::new(
            Domain::PACKET,
            Type::DGRAM,
            Some(Protocol::from(ETH_P_IP_BE)),
        )?;
        // Wakes up to look at the stop flag.
        sock.set_read_timeout(Some(Duration::from_millis(5)))?;
        sock.set_recv_buffer_size(8 << 20)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || capture(&sock, addr, &stop))
        };
        Ok(Capture { stop, thread })
    }

    /// Stops, and returns the packets captured, in arrival order.
    pub(crate) fn finish(self) -> Vec<Vec<u8>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The capture thread's loop.
fn capture(sock: &Socket, addr: Ipv4Addr, stop: &AtomicBool) -> Vec<Vec<u8>> {
    let mut kept = Vec::new();
    let mut seen = HashSet::new();
    let mut bytes = 0usize;
    let mut buf = vec![0u8; 65536];
    let mut r = sock;
    loop {
        // Drain what is queued before looking at the flag: a packet that
        // arrived before the stop is kept.
        match r.read(&mut buf) {
            Ok(n) => {
                let p = &buf[..n];
                if is_carried_to(p, addr)
                    && kept.len() < MAX_PACKETS
                    && bytes + n <= MAX_BYTES
                    && seen.insert(p.to_vec())
                {
                    bytes += n;
                    kept.push(p.to_vec());
                }
            }
            Err(_) if stop.load(Ordering::Relaxed) => return kept,
            Err(_) => {}
        }
    }
}

/// `IPPROTO_TCP`.
const TCP: u8 = 6;
/// `IPPROTO_UDP`.
const UDP: u8 = 17;

/// Whether `p` is a whole IPv4 TCP or UDP packet (unfragmented, its
/// transport header complete) to `addr`.
pub(crate) fn is_carried_to(p: &[u8], addr: Ipv4Addr) -> bool {
    if p.len() < 20 || p[0] >> 4 != 4 {
        return false;
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
    // More-fragments flag or a fragment offset: not a whole segment.
    let frag = u16::from_be_bytes([p[6], p[7]]) & 0x3fff;
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
    ihl >= 20
        && total == p.len()
        && total >= ihl + header
        && frag == 0
        && p[16..20] == addr.octets()
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

/// Where the checksum sits in `p`'s transport header, and the protocol.
fn checksum_at(p: &[u8]) -> (usize, u8) {
    let ihl = usize::from(p[0] & 0x0f) * 4;
    match p[9] {
        UDP => (ihl + 6, UDP),
        _ => (ihl + 16, TCP),
    }
}

/// The ones' complement sum of `p`'s pseudo-header and transport segment.
fn transport_sum(p: &[u8], proto: u8) -> u32 {
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let len = p.len() - ihl;
    let acc = sum(0, &p[12..20]);
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

/// Delivers `packets` (IPv4 TCP or UDP packets to `addr`, local here) as if they
/// had just arrived. Returns how many were sent.
pub(crate) fn reinject(packets: &[Vec<u8>], addr: Ipv4Addr) -> std::io::Result<usize> {
    // IPPROTO_RAW: the packets carry their own IP header.
    let sock = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(255)))?;
    let to = SockAddr::from(SocketAddr::new(IpAddr::V4(addr), 0));
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
            assert!(is_carried_to(&p, Ipv4Addr::new(10, 0, 0, 2)));
            fix_checksum(&mut p);
            assert!(checksum_ok(&p), "{data:?}");
            let last = p.len() - 1;
            p[last] ^= 1;
            assert!(!checksum_ok(&p));
        }
        for data in [&b""[..], b"x", b"hello, world", &[0xff; 1001]] {
            let mut p = datagram(data);
            assert!(is_carried_to(&p, Ipv4Addr::new(10, 0, 0, 2)));
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
        assert!(is_carried_to(&p, Ipv4Addr::new(10, 0, 0, 2)));
        assert!(!is_carried_to(&p, Ipv4Addr::new(10, 0, 0, 3)));
        let d = datagram(b"abc");
        assert!(is_carried_to(&d, Ipv4Addr::new(10, 0, 0, 2)));
        let mut bad_len = d.clone();
        bad_len[25] += 1;
        assert!(!is_carried_to(&bad_len, Ipv4Addr::new(10, 0, 0, 2)));
        let mut icmp = p.clone();
        icmp[9] = 1;
        assert!(!is_carried_to(&icmp, Ipv4Addr::new(10, 0, 0, 2)));
        let mut frag = p.clone();
        frag[6] = 0x20;
        assert!(!is_carried_to(&frag, Ipv4Addr::new(10, 0, 0, 2)));
        assert!(!is_carried_to(&p[..30], Ipv4Addr::new(10, 0, 0, 2)));
        assert!(!is_carried_to(&d[..27], Ipv4Addr::new(10, 0, 0, 2)));
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
