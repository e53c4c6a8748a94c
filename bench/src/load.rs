//! The load generator: one target server (sink, source, echo) and the client
//! operations that drive it. Every peer is driven by this same code; a peer
//! only decides how a connection to the target is made (see `peers`).
//!
//! Wire protocol between a client and the target (one connection, first
//! byte selects the operation):
//! - `U` upload: the client writes any number of bytes, then half-closes;
//!   the target answers with the count it received (u64, big endian) and
//!   closes. The client checks the count.
//! - `D` download: the client sends `block: u32` and `millis: u32` (and
//!   half-closes, in [`download`]); the target writes `block`-sized blocks of [`FILL`] for that long, then
//!   [`END`] and the count it wrote (u64), then half-closes. The client
//!   checks both, so a lost or corrupted byte fails the run.
//! - `E` echo: everything is written back until end-of-stream.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Operation byte: sink.
pub(crate) const OP_UPLOAD: u8 = b'U';
/// Operation byte: source.
pub(crate) const OP_DOWNLOAD: u8 = b'D';
/// Operation byte: echo.
pub(crate) const OP_ECHO: u8 = b'E';
/// Every bulk payload byte.
pub(crate) const FILL: u8 = 0x5A;
/// Marks the end of a download's payload (never equal to [`FILL`]).
const END: u8 = 0x00;
/// Largest block a download may ask for (bytes).
const MAX_BLOCK: usize = 1 << 20;
/// Read buffer of the target and of bulk clients (bytes).
const READ_BUF: usize = 256 * 1024;

/// Anything a peer hands out as a connection to the target.
pub(crate) trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

/// A connection to the target through some peer.
pub(crate) type Conn = Box<dyn Duplex>;

/// Accept-queue length the target asks for (the kernel caps it at
/// `net.core.somaxconn`, 4096 on the CI machine; socat's listeners ask the same).
pub(crate) const TARGET_BACKLOG: u32 = 4096;

/// The target's listening socket on a free loopback port, with a backlog of
/// [`TARGET_BACKLOG`]. `TcpListener::bind` asks for 128 (std's value): the
/// relay connects thousands of streams to the target in a burst (scenario
/// 4 opens 10,000 in about two seconds), the queue overflowed, the kernel
/// answered with SYN cookies and dropped handshakes, and a connection the
/// relay already held as established could be reset by the target's kernel
/// ("Connection reset by peer"), which the relay passes on as a stream reset.
pub(crate) fn target_listener() -> io::Result<TcpListener> {
    target_listener_on(SocketAddr::from(([127, 0, 0, 1], 0)))
}

/// As [`target_listener`], on `addr` (an IPv4 address; port 0: a free
/// one): scenario 11 binds the target to a network namespace's LAN address.
pub(crate) fn target_listener_on(addr: SocketAddr) -> io::Result<TcpListener> {
    let s = tokio::net::TcpSocket::new_v4()?;
    s.set_reuseaddr(true)?;
    s.bind(addr)?;
    s.listen(TARGET_BACKLOG)
}

/// Runs the target server on `listener` until the process ends.
pub(crate) async fn serve_targets(listener: TcpListener) -> io::Result<()> {
    loop {
        let (sock, _) = match listener.accept().await {
            Ok(a) => a,
            // Out of descriptors or a connection that died in the backlog: go on.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        tokio::spawn(async move {
            // Errors concern one connection only (a peer's readiness probe
            // connects and closes without a byte, for instance).
            let _ = handle_target(sock).await;
        });
    }
}

async fn handle_target(mut sock: TcpStream) -> io::Result<()> {
    let mut op = [0u8; 1];
    sock.read_exact(&mut op).await?;
    match op[0] {
        OP_UPLOAD => {
            let mut buf = vec![0u8; READ_BUF];
            let mut total: u64 = 0;
            loop {
                let n = sock.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                // Every byte checked, as a download's client does: the
                // two directions cost the harness the same, and a
                // corrupt byte fails the sample (the count never comes).
                if let Some(p) = first_not_fill(&buf[..n]) {
                    return Err(bad(format!(
                        "upload: corrupt payload byte {:#x} at offset {}",
                        buf[p],
                        total + p as u64
                    )));
                }
                total += n as u64;
            }
            sock.write_all(&total.to_be_bytes()).await?;
            sock.shutdown().await
        }
        OP_DOWNLOAD => {
            let mut req = [0u8; 8];
            sock.read_exact(&mut req).await?;
            let block =
                (u32::from_be_bytes([req[0], req[1], req[2], req[3]]) as usize).clamp(1, MAX_BLOCK);
            let millis = u32::from_be_bytes([req[4], req[5], req[6], req[7]]);
            let buf = vec![FILL; block];
            let deadline = Instant::now() + Duration::from_millis(millis.into());
            let mut sent: u64 = 0;
            loop {
                sock.write_all(&buf).await?;
                sent += block as u64;
                if Instant::now() >= deadline {
                    break;
                }
            }
            let mut trailer = [0u8; 9];
            trailer[0] = END;
            trailer[1..].copy_from_slice(&sent.to_be_bytes());
            sock.write_all(&trailer).await?;
            sock.shutdown().await?;
            // Wait for the client to close so the last bytes are not reset.
            let mut sink = [0u8; 1024];
            while sock.read(&mut sink).await? > 0 {}
            Ok(())
        }
        OP_ECHO => {
            sock.set_nodelay(true)?;
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = sock.read(&mut buf).await?;
                if n == 0 {
                    return sock.shutdown().await;
                }
                sock.write_all(&buf[..n]).await?;
            }
        }
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown operation byte {other:#x}"),
        )),
    }
}

/// One bulk transfer as the client saw it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transfer {
    /// Payload bytes moved (checked against the other end's count).
    pub(crate) bytes: u64,
    /// From the first byte written to the other end's confirmation.
    pub(crate) elapsed: Duration,
}

impl Transfer {
    /// Throughput in megabytes (10^6 bytes) per second.
    pub(crate) fn mbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e6
    }
}

/// Offset of the first byte of `b` that is not [`FILL`], if any.
///
/// Checks 64 bytes at a time with a branch-free fold the compiler turns
/// into vector instructions: `iter().position` (one byte, one branch)
/// checked about 2.5 GB/s and took a seventh of this 2-core machine's
/// CPU during a download, CPU the relays under test then lacked, while
/// an upload's sink checked nothing (downloads measured 20 % below
/// uploads through roam for that reason).
pub(crate) fn first_not_fill(b: &[u8]) -> Option<usize> {
    const LANES: usize = 64;
    let mut clean = 0;
    for c in b.chunks_exact(LANES) {
        if c.iter().fold(0u8, |acc, &x| acc | (x ^ FILL)) != 0 {
            break;
        }
        clean += LANES;
    }
    b[clean..]
        .iter()
        .position(|&x| x != FILL)
        .map(|p| clean + p)
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Writes `block`-sized writes for `duration`, half-closes, and waits for
/// the target's count (which must match). `start` lets several clients share
/// one starting moment.
pub(crate) async fn upload(
    conn: &mut Conn,
    block: usize,
    duration: Duration,
    start: Option<Instant>,
) -> io::Result<Transfer> {
    let buf = vec![FILL; block.max(1)];
    let start = start.unwrap_or_else(Instant::now);
    let deadline = start + duration;
    conn.write_all(&[OP_UPLOAD]).await?;
    let mut sent: u64 = 0;
    loop {
        conn.write_all(&buf).await?;
        sent += buf.len() as u64;
        if Instant::now() >= deadline {
            break;
        }
    }
    conn.flush().await?;
    conn.shutdown().await?;
    let mut count = [0u8; 8];
    conn.read_exact(&mut count)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("waiting for the sink's count: {e}")))?;
    let elapsed = start.elapsed();
    let got = u64::from_be_bytes(count);
    if got != sent {
        return Err(bad(format!("sink received {got} bytes of {sent} sent")));
    }
    Ok(Transfer {
        bytes: sent,
        elapsed,
    })
}

/// Asks the target to write `block`-sized writes for `duration` and reads
/// until its end marker; checks every payload byte and the count.
pub(crate) async fn download(
    conn: &mut Conn,
    block: usize,
    duration: Duration,
) -> io::Result<Transfer> {
    let start = Instant::now();
    let mut req = [0u8; 9];
    req[0] = OP_DOWNLOAD;
    req[1..5].copy_from_slice(&(block as u32).to_be_bytes());
    req[5..9].copy_from_slice(&(duration.as_millis().min(u32::MAX as u128) as u32).to_be_bytes());
    conn.write_all(&req).await?;
    conn.flush().await?;
    // Nothing more to send: half-close, as a request/response client does.
    // (`roam pipe` keeps its stdout open until its stdin ends, so a client
    // that waited for end-of-file with its request side open would wait
    // forever.)
    conn.shutdown().await?;
    let mut buf = vec![0u8; READ_BUF];
    let mut payload: u64 = 0;
    // Bytes of the trailer after END, once END was seen.
    let mut trailer: Option<Vec<u8>> = None;
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        let mut chunk = &buf[..n];
        if trailer.is_none() {
            match first_not_fill(chunk) {
                None => {
                    payload += n as u64;
                    continue;
                }
                Some(p) => {
                    payload += p as u64;
                    if chunk[p] != END {
                        return Err(bad(format!(
                            "corrupt payload byte {:#x} at offset {}",
                            chunk[p], payload
                        )));
                    }
                    chunk = &chunk[p + 1..];
                    trailer = Some(Vec::with_capacity(8));
                }
            }
        }
        if let Some(t) = trailer.as_mut() {
            t.extend_from_slice(chunk);
            if t.len() > 8 {
                return Err(bad("bytes after the download trailer".into()));
            }
        }
    }
    let elapsed = start.elapsed();
    let t = trailer.ok_or_else(|| {
        bad(format!(
            "stream ended after {payload} bytes without the end marker"
        ))
    })?;
    let count: [u8; 8] = t
        .as_slice()
        .try_into()
        .map_err(|_| bad("truncated download trailer".into()))?;
    let sent = u64::from_be_bytes(count);
    if sent != payload {
        return Err(bad(format!("received {payload} bytes of {sent} sent")));
    }
    Ok(Transfer {
        bytes: payload,
        elapsed,
    })
}

/// Asks the target to write `block`-sized writes until well after `end`,
/// and counts the payload bytes that arrive between `from` and `end` (a
/// steady-state window: buffers along the path are already full by `from`).
/// Stops reading at `end`; the caller then drops the connection. Every
/// byte read is checked.
pub(crate) async fn download_window(
    conn: &mut Conn,
    block: usize,
    from: Instant,
    end: Instant,
) -> io::Result<u64> {
    // The source stops a while after the window (the client stops reading at its end).
    let source_for = end.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
    let mut req = [0u8; 9];
    req[0] = OP_DOWNLOAD;
    req[1..5].copy_from_slice(&(block as u32).to_be_bytes());
    req[5..9].copy_from_slice(&(source_for.as_millis().min(u32::MAX as u128) as u32).to_be_bytes());
    conn.write_all(&req).await?;
    conn.flush().await?;
    // Smaller than the bulk buffer: a thousand of these run at once.
    let mut buf = vec![0u8; 64 * 1024];
    let mut in_window: u64 = 0;
    let mut total: u64 = 0;
    loop {
        let n = match tokio::time::timeout_at(end.into(), conn.read(&mut buf)).await {
            Err(_) => return Ok(in_window),
            Ok(r) => r?,
        };
        let now = Instant::now();
        if now >= end {
            // Completed after the window (a busy scheduler polls late): not counted.
            return Ok(in_window);
        }
        if n == 0 {
            return Err(bad(format!(
                "stream ended after {total} bytes, {:?} before the end of the measuring window",
                end - now
            )));
        }
        if let Some(p) = first_not_fill(&buf[..n]) {
            let tail = &buf[p..n.min(p + 16)];
            let hex: Vec<String> = tail.iter().map(|b| format!("{b:02x}")).collect();
            return Err(bad(format!(
                "unexpected byte at stream offset {} ({:?} before the window's end): {} (read of {n} bytes)",
                total + p as u64,
                end - now,
                hex.join(" ")
            )));
        }
        total += n as u64;
        if now >= from {
            in_window += n as u64;
        }
    }
}

/// Starts an echo exchange (writes the operation byte).
pub(crate) async fn start_echo(conn: &mut Conn) -> io::Result<()> {
    conn.write_all(&[OP_ECHO]).await?;
    conn.flush().await
}

/// `warmup + iters` ping-pongs of `size` bytes on an echo connection (after
/// [`start_echo`]); returns the round-trip times of the last `iters`, in
/// nanoseconds. Every echoed message is compared with what was sent.
pub(crate) async fn ping_pong(
    conn: &mut Conn,
    size: usize,
    warmup: usize,
    iters: usize,
) -> io::Result<Vec<u64>> {
    let mut msg = vec![FILL; size.max(1)];
    let mut back = vec![0u8; msg.len()];
    let mut rtts = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        msg[0] = i as u8;
        let t = Instant::now();
        conn.write_all(&msg).await?;
        conn.read_exact(&mut back).await?;
        let rtt = t.elapsed();
        if back != msg {
            return Err(bad(format!("echo {i} came back different")));
        }
        if i >= warmup {
            rtts.push(rtt.as_nanos() as u64);
        }
    }
    Ok(rtts)
}

/// One 1-byte echo on a fresh connection (the operation byte travels with
/// it), for set-up times.
pub(crate) async fn echo_once(conn: &mut Conn) -> io::Result<()> {
    conn.write_all(&[OP_ECHO, 0x42]).await?;
    conn.flush().await?;
    let mut b = [0u8; 1];
    conn.read_exact(&mut b).await?;
    if b[0] != 0x42 {
        return Err(bad(format!("echo returned {:#x}", b[0])));
    }
    Ok(())
}

/// Connects a plain TCP client socket.
pub(crate) async fn tcp(addr: SocketAddr, nodelay: bool) -> io::Result<Conn> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(nodelay)?;
    Ok(Box::new(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast check finds a wrong byte wherever it is (inside a
    /// 64-byte lane, on its edges, in the tail) and nothing in clean input.
    #[test]
    fn first_not_fill_finds_every_position() {
        for len in [0usize, 1, 63, 64, 65, 127, 128, 1000] {
            let clean = vec![FILL; len];
            assert_eq!(first_not_fill(&clean), None, "clean, len {len}");
            for at in 0..len {
                let mut b = clean.clone();
                b[at] = END;
                assert_eq!(first_not_fill(&b), Some(at), "len {len}, at {at}");
                b[len - 1] ^= 1;
                assert_eq!(
                    first_not_fill(&b),
                    Some(at),
                    "two wrong, len {len}, at {at}"
                );
            }
        }
    }

    /// A corrupt byte in an upload fails it: the sink sends no count.
    #[tokio::test]
    async fn upload_with_a_corrupt_byte_gets_no_count() {
        let a = target().await;
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(&[OP_UPLOAD, FILL, FILL, 0x77, FILL])
            .await
            .unwrap();
        s.shutdown().await.unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got).await;
        assert!(
            got.is_empty(),
            "the sink answered a corrupt upload: {got:?}"
        );
    }

    async fn target() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(serve_targets(l));
        a
    }

    /// The target's accept queue holds a relay's burst: 1,000 connections
    /// made while nobody accepts (the kernel queues them, no SYN cookies),
    /// then every one echoes its own byte once the server runs. And the
    /// queue is as long as asked (up to `somaxconn`), as `ss` reports it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn target_queue_holds_a_burst_and_every_connection_echoes() {
        let l = target_listener().unwrap();
        let addr = l.local_addr().unwrap();
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(TARGET_BACKLOG);
        let backlog = TARGET_BACKLOG.min(somaxconn);
        if let Ok(o) = std::process::Command::new("ss")
            .args(["-ltnH", &format!("sport = :{}", addr.port())])
            .output()
        {
            let text = String::from_utf8_lossy(&o.stdout);
            if let Some(q) = text.split_whitespace().nth(2) {
                assert_eq!(q.parse::<u32>().unwrap(), backlog, "{text}");
            }
        }
        // A kernel capping queues below 1,000 (somaxconn) gets a smaller burst.
        let n = 1000.min(backlog as usize);
        let mut conns = Vec::with_capacity(n);
        for i in 0..n {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(&[OP_ECHO, i as u8]).await.unwrap();
            conns.push(s);
        }
        tokio::spawn(serve_targets(l));
        tokio::time::timeout(Duration::from_secs(60), async {
            for (i, s) in conns.iter_mut().enumerate() {
                let mut b = [0u8; 1];
                s.read_exact(&mut b)
                    .await
                    .unwrap_or_else(|e| panic!("connection {i}: {e}"));
                assert_eq!(b[0], i as u8, "connection {i}");
            }
        })
        .await
        .expect("every queued connection echoed within 60 s");
    }

    #[tokio::test]
    async fn operations_round_trip_and_check_counts() {
        let a = target().await;
        for block in [1, 100, 65536] {
            let mut c = tcp(a, false).await.unwrap();
            let t = upload(&mut c, block, Duration::from_millis(30), None)
                .await
                .unwrap();
            assert!(t.bytes >= block as u64);
            let mut c = tcp(a, false).await.unwrap();
            let t = download(&mut c, block, Duration::from_millis(30))
                .await
                .unwrap();
            assert!(t.bytes >= block as u64);
        }
        let mut c = tcp(a, true).await.unwrap();
        start_echo(&mut c).await.unwrap();
        let r = ping_pong(&mut c, 1024, 2, 10).await.unwrap();
        assert_eq!(r.len(), 10);
        let mut c = tcp(a, true).await.unwrap();
        echo_once(&mut c).await.unwrap();
    }

    #[tokio::test]
    async fn download_window_counts_inside_the_window_only() {
        let a = target().await;
        let mut c = tcp(a, false).await.unwrap();
        let from = Instant::now() + Duration::from_millis(50);
        let end = from + Duration::from_millis(100);
        let n = download_window(&mut c, 4096, from, end).await.unwrap();
        assert!(n > 0);
        assert!(Instant::now() >= end);
    }

    #[tokio::test]
    async fn download_window_rejects_corrupt_bytes() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = [0u8; 9];
            s.read_exact(&mut req).await.unwrap();
            s.write_all(&[FILL, FILL, 0x77]).await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let mut c = tcp(a, false).await.unwrap();
        let now = Instant::now();
        let e = download_window(&mut c, 10, now, now + Duration::from_secs(3))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("offset 2"), "{e}");
    }

    #[tokio::test]
    async fn download_detects_a_short_stream() {
        // A "target" that sends payload and a trailer claiming more.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = [0u8; 9];
            s.read_exact(&mut req).await.unwrap();
            s.write_all(&[FILL; 10]).await.unwrap();
            let mut t = vec![END];
            t.extend_from_slice(&11u64.to_be_bytes());
            s.write_all(&t).await.unwrap();
        });
        let mut c = tcp(a, false).await.unwrap();
        let e = download(&mut c, 10, Duration::from_millis(1))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("10 bytes of 11"), "{e}");
    }
}
