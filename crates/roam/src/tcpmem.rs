//! The kernel's TCP memory pressure, and how much receive buffer one session
//! connection may ask for while it lasts.
//!
//! Why: when the TCP sockets of a machine (of every process) hold more than
//! `net.ipv4.tcp_mem[1]` pages, Linux enters *memory pressure*. Under it a
//! socket may only grow its buffers while its own usage times the number of
//! TCP sockets stays below `tcp_mem[2]`, that is while it holds no more than
//! a fair share. Every other arriving segment is dropped. A relay with 1,000
//! busy targets reaches pressure on loopback (their send buffers alone hold
//! ~1.5 GB), and then the one connection that carries every stream of a
//! session, the busiest socket on the machine, is the one that drops: with
//! its auto-tuned 17 MB receive buffer it lost segments, the sender
//! retransmitted and timed out, and 1,000 streams crawled at 5-30 MB/s in
//! all where socat's 1,000 connections moved 700-900 MB/s. Held to its share
//! (`SO_RCVBUF`), the same connection dropped nothing and moved 324 MB/s.
//!
//! So while the kernel reports pressure, each session connection's receive
//! buffer is set to [`SHARE_FRACTION`] of the per-socket share; when pressure
//! is over it is set back to a large fixed size (`net.core.rmem_max`: once
//! set, the kernel does not auto-tune that socket again). The readings come
//! from `/proc` of the process's network namespace, at most every
//! [`REFRESH`], shared by every driver of the process. Elsewhere than Linux
//! nothing is read and nothing changes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How often the process re-reads the kernel's figures (any driver may).
pub(crate) const REFRESH: Duration = Duration::from_millis(100);
/// Page size the kernel counts `tcp_mem` in (bytes).
const PAGE: u64 = 4096;
/// Part of the per-socket share given to the receive buffer: the kernel
/// doubles `SO_RCVBUF` for its bookkeeping and counts the send queue too.
const SHARE_FRACTION: (u64, u64) = (2, 5);
/// How long pressure must have been over before buffers are given back
/// (the kernel leaves pressure below `tcp_mem[0]` and may re-enter it at
/// once: without this, a connection flapped between held and 8 MB).
pub(crate) const RELEASE_AFTER: Duration = Duration::from_secs(2);
/// Smallest receive buffer asked for under pressure (bytes).
const MIN_RCVBUF: u64 = 64 * 1024;
/// Largest receive buffer asked for under pressure (bytes): above this the
/// share is no limit worth setting.
const MAX_RCVBUF: u64 = 16 * 1024 * 1024;

/// What a session connection's receive buffer should be now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Advice {
    /// No pressure: leave the kernel's auto-tuning alone (or give back a
    /// large buffer to a connection that was held).
    Free,
    /// Under pressure: at most this many bytes (`SO_RCVBUF`).
    Hold(usize),
}

/// Reads `/proc` text: whether TCP is under pressure, and the receive buffer
/// that keeps one socket within its share. `protocols` is
/// `/proc/net/protocols`, `sockstat` is `/proc/net/sockstat`, `tcp_mem` is
/// `/proc/sys/net/ipv4/tcp_mem`. `None` when the text is not understood.
#[cfg(test)]
pub(crate) fn advise(protocols: &str, sockstat: &str, tcp_mem: &str) -> Option<Advice> {
    if !under_pressure(protocols)? {
        return Some(Advice::Free);
    }
    hold(sockstat, tcp_mem)
}

/// Whether `/proc/net/protocols` says TCP (v4 or v6) is under memory pressure.
fn under_pressure(protocols: &str) -> Option<bool> {
    let mut header = protocols.lines().next()?.split_whitespace();
    let press_col = header.position(|c| c == "press")?;
    Some(
        protocols
            .lines()
            .filter(|l| l.starts_with("TCP ") || l.starts_with("TCPv6 "))
            .any(|l| l.split_whitespace().nth(press_col) == Some("yes")),
    )
}

/// The hold under pressure: [`SHARE_FRACTION`] of `tcp_mem[2]` pages over the
/// TCP sockets allocated (`alloc` of `/proc/net/sockstat`), within bounds.
fn hold(sockstat: &str, tcp_mem: &str) -> Option<Advice> {
    let tcp = sockstat.lines().find(|l| l.starts_with("TCP:"))?;
    let mut words = tcp.split_whitespace();
    let sockets: u64 = loop {
        if words.next()? == "alloc" {
            break words.next()?.parse().ok()?;
        }
    };
    let hard: u64 = tcp_mem.split_whitespace().nth(2)?.parse().ok()?;
    let share = hard.saturating_mul(PAGE) / sockets.max(1);
    let rcvbuf = (share * SHARE_FRACTION.0 / SHARE_FRACTION.1).clamp(MIN_RCVBUF, MAX_RCVBUF);
    Some(Advice::Hold(rcvbuf as usize))
}

/// The process-wide reading: when it was taken (ms after [`epoch`], plus
/// one so 0 means never) and what it said ([`encode`]).
static TAKEN: AtomicU64 = AtomicU64::new(0);
static ADVICE: AtomicU64 = AtomicU64::new(0);
/// When pressure was last seen (ms after [`epoch`], plus one; 0: never).
static PRESSED: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn encode(a: Advice) -> u64 {
    match a {
        Advice::Free => 0,
        Advice::Hold(n) => n as u64,
    }
}

fn decode(v: u64) -> Advice {
    match v {
        0 => Advice::Free,
        n => Advice::Hold(n as usize),
    }
}

/// The current advice and its reading's number (a connection re-checks
/// itself only when the number changed), re-read from `/proc` when the last reading is older
/// than [`REFRESH`] (by whichever driver asks first). Cheap otherwise: two
/// atomic loads. A hold lasts until pressure has been over for
/// [`RELEASE_AFTER`]. Unreadable figures (not Linux, no `/proc`) advise `Free`.
pub(crate) fn current(now: Instant) -> (u64, Advice) {
    let ms = now.saturating_duration_since(epoch()).as_millis() as u64 + 1;
    let taken = TAKEN.load(Ordering::Acquire);
    let last = || (taken, decode(ADVICE.load(Ordering::Relaxed)));
    if taken != 0 && ms.saturating_sub(taken) < REFRESH.as_millis() as u64 {
        return last();
    }
    // One reader per refresh; the others use the previous reading.
    if TAKEN
        .compare_exchange(taken, ms, Ordering::AcqRel, Ordering::Relaxed)
        .is_err()
    {
        return last();
    }
    let advice = match read().unwrap_or(Advice::Free) {
        Advice::Hold(n) => {
            PRESSED.store(ms, Ordering::Relaxed);
            Advice::Hold(n)
        }
        Advice::Free => {
            let pressed = PRESSED.load(Ordering::Relaxed);
            if pressed != 0 && ms.saturating_sub(pressed) < RELEASE_AFTER.as_millis() as u64 {
                // Hysteresis: keep the last hold a while.
                decode(ADVICE.load(Ordering::Relaxed))
            } else {
                Advice::Free
            }
        }
    };
    ADVICE.store(encode(advice), Ordering::Relaxed);
    (ms, advice)
}

#[cfg(target_os = "linux")]
fn read() -> Option<Advice> {
    let protocols = std::fs::read_to_string("/proc/net/protocols").ok()?;
    // The common case reads one file only.
    if !under_pressure(&protocols)? {
        return Some(Advice::Free);
    }
    let sockstat = std::fs::read_to_string("/proc/net/sockstat").ok()?;
    let tcp_mem = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_mem").ok()?;
    hold(&sockstat, &tcp_mem)
}

#[cfg(not(target_os = "linux"))]
fn read() -> Option<Advice> {
    None
}

/// The receive buffer a connection gets back when pressure is over: the
/// largest `SO_RCVBUF` an unprivileged process may set.
pub(crate) fn released_rcvbuf() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(4 * 1024 * 1024)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "protocol  size sockets  memory press maxhdr  slab module     cl co di ac io in de sh ss gs se re sp bi br ha uh gp em\n";

    fn protocols(press: &str) -> String {
        format!(
            "{HEADER}AF_VSOCK  1240      0      -1   NI       0   yes  kernel      y  n  n  n  n  n  n  n  n  n  n  n  n  n  n  n  n  n  n\n\
             TCPv6     2432      0  428000   {press}     192   yes  kernel      y  y  y  y  y  y  y  y  y  y  y  y  y  n  y  y  y  y  y\n\
             TCP       2304   4015  428000   {press}     192   yes  kernel      y  y  y  y  y  y  y  y  y  y  y  y  y  n  y  y  y  y  y\n"
        )
    }

    const SOCKSTAT: &str = "sockets: used 4100\nTCP: inuse 4015 orphan 0 tw 774 alloc 4015 mem 428043\nUDP: inuse 0 mem 0\n";
    const TCP_MEM: &str = "287898\t383867\t575796\n";

    #[test]
    fn no_pressure_leaves_buffers_alone() {
        assert_eq!(
            advise(&protocols("no"), SOCKSTAT, TCP_MEM),
            Some(Advice::Free)
        );
    }

    /// The figures of the 1,000-streams benchmark under pressure: 4,015
    /// sockets share 575,796 pages (587 KB each); the receive buffer asked
    /// for is two fifths of that, which the kernel doubles to 470 KB, within
    /// the share (a 256 KiB `SO_RCVBUF` measured 324 MB/s there, 512 KiB
    /// dropped again).
    #[test]
    fn pressure_holds_a_socket_to_its_share() {
        let Some(Advice::Hold(n)) = advise(&protocols("yes"), SOCKSTAT, TCP_MEM) else {
            panic!("expected a hold");
        };
        let share = 575_796 * 4096 / 4015;
        assert_eq!(n as u64, share * 2 / 5);
        assert!(2 * n as u64 <= share, "{n}");
    }

    #[test]
    fn few_sockets_or_many_stay_within_bounds() {
        let one = SOCKSTAT.replace("alloc 4015", "alloc 1");
        assert_eq!(
            advise(&protocols("yes"), &one, TCP_MEM),
            Some(Advice::Hold(MAX_RCVBUF as usize))
        );
        let crowd = SOCKSTAT.replace("alloc 4015", "alloc 10000000");
        assert_eq!(
            advise(&protocols("yes"), &crowd, TCP_MEM),
            Some(Advice::Hold(MIN_RCVBUF as usize))
        );
    }

    #[test]
    fn text_it_does_not_understand_gives_no_advice() {
        assert_eq!(advise("", SOCKSTAT, TCP_MEM), None);
        assert_eq!(advise(&protocols("yes"), "TCP: inuse 3\n", TCP_MEM), None);
        assert_eq!(advise(&protocols("yes"), SOCKSTAT, "1 2\n"), None);
        assert_eq!(advise(&protocols("yes"), SOCKSTAT, "a b c\n"), None);
    }

    /// This machine's own `/proc` is understood (whatever its pressure).
    #[cfg(target_os = "linux")]
    #[test]
    fn this_machines_figures_are_understood() {
        assert!(read().is_some());
        assert!(released_rcvbuf() > 0);
    }
}
