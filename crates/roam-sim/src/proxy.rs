//! Loopback TCP fault proxy (reset, black-hole, delay, refuse) for tests over
//! real sockets.
//!
//! A [`FaultProxy`] listens on `127.0.0.1:0` and forwards every accepted
//! connection to one upstream address. While it runs, a test can:
//!
//! - [`reset_all`](FaultProxy::reset_all): abort every current connection with
//!   a TCP RST on both sides (`SO_LINGER` 0, then close), the way a NAT reboot
//!   or a middlebox timeout looks to the endpoints;
//! - [`blackhole`](FaultProxy::blackhole): stop forwarding in both directions
//!   while keeping every connection open. Bytes are *held*, never dropped:
//!   a real black hole loses packets, but TCP retransmits them once the path
//!   heals, so "stall, then carry on with nothing lost" is what the endpoints
//!   of a real TCP connection observe. New connections are accepted but get no
//!   upstream connection until the hole is lifted;
//! - [`set_delay`](FaultProxy::set_delay): add one-way latency to every chunk,
//!   preserving order;
//! - [`blackhole_current`](FaultProxy::blackhole_current): silence every
//!   current connection for good while new ones work (the old path died
//!   quietly, a new one exists: an address change, a NAT rebinding);
//! - [`refuse`](FaultProxy::refuse): reset new connections right after accept;
//! - [`reset_every`](FaultProxy::reset_every): periodic chaos, a
//!   [`reset_all`](FaultProxy::reset_all) every period.
//!
//! It runs either on the caller's tokio runtime ([`FaultProxy::start`], for
//! async tests) or on a thread of its own ([`FaultProxy::spawn`], for blocking
//! tests). Dropping the handle stops the listener and closes every connection;
//! a spawned proxy also joins its thread.
//!
//! Non-goals: packet-level faults (loss, reordering, duplication) cannot be
//! expressed on a TCP byte stream; the simulator in [`crate::net`] covers
//! those. The proxy only ever connects to the upstream address it is given.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Largest chunk read from one side before it is queued for the other.
const CHUNK_BYTES: usize = 64 * 1024;
/// Chunks queued per direction before the proxy stops reading. Bounds memory
/// (64 KiB x 64 = 4 MiB per direction) and makes a slow or stalled reader push
/// back on the writer, as a real path would.
const QUEUE_CHUNKS: usize = 64;

/// Counters of one proxy, a snapshot taken by [`FaultProxy::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProxyStats {
    /// Connections accepted from clients (refused ones included).
    pub accepted: u64,
    /// Connections reset right after accept because refusing was on.
    pub refused: u64,
    /// Connections currently open (client accepted and not yet closed).
    pub active: u64,
    /// Connections aborted by [`FaultProxy::reset_all`] or chaos mode.
    pub resets: u64,
    /// Connections stalled for good by [`FaultProxy::blackhole_current`].
    pub stalled: u64,
    /// Times chaos mode ([`FaultProxy::reset_every`]) fired.
    pub chaos_rounds: u64,
    /// Bytes delivered from clients to the upstream.
    pub bytes_up: u64,
    /// Bytes delivered from the upstream to clients.
    pub bytes_down: u64,
}

/// State shared by the handle and every task of one proxy.
struct Shared {
    /// Where new connections go ([`FaultProxy::set_upstream`] changes it).
    upstream: std::sync::Mutex<SocketAddr>,
    /// `true` while black-holed; tasks wait on it before reading or writing.
    blackhole: watch::Sender<bool>,
    /// Bumped by every reset; each connection resets on a change it did not
    /// see at accept time.
    reset_gen: watch::Sender<u64>,
    /// Bumped by [`FaultProxy::blackhole_current`]; each connection stalls
    /// for good on a change it did not see at accept time.
    stall_gen: watch::Sender<u64>,
    /// Chaos period; `None` disables chaos mode.
    chaos: watch::Sender<Option<Duration>>,
    /// `true` makes the accept loop reset new connections.
    refuse: watch::Sender<bool>,
    /// One-way added latency per chunk, in nanoseconds.
    delay_ns: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    active: AtomicU64,
    resets: AtomicU64,
    stalled: AtomicU64,
    chaos_rounds: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

impl Shared {
    fn new(upstream: SocketAddr) -> Self {
        Shared {
            upstream: std::sync::Mutex::new(upstream),
            blackhole: watch::Sender::new(false),
            reset_gen: watch::Sender::new(0),
            stall_gen: watch::Sender::new(0),
            chaos: watch::Sender::new(None),
            refuse: watch::Sender::new(false),
            delay_ns: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            active: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            stalled: AtomicU64::new(0),
            chaos_rounds: AtomicU64::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
        }
    }

    fn upstream(&self) -> SocketAddr {
        *self.upstream.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_ns.load(Ordering::Relaxed))
    }

    fn reset_all(&self) {
        self.reset_gen.send_modify(|g| *g += 1);
    }
}

/// Waits until the black hole is lifted (returns at once when it is off).
async fn wait_open(rx: &mut watch::Receiver<bool>) {
    // The sender lives in `Shared`, which outlives every task: no error here.
    let _ = rx.wait_for(|on| !*on).await;
}

/// A loopback TCP fault proxy. See the [module docs](self).
///
/// Every method is synchronous and cheap, so a blocking test and an async test
/// drive it the same way.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// Dropping it tells every task to stop (their receivers see the close).
    shutdown: Option<watch::Sender<()>>,
    /// The proxy's own thread, for [`FaultProxy::spawn`].
    thread: Option<thread::JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.shared.upstream())
            .field("stats", &self.stats())
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy to `upstream` on the current tokio runtime, listening on
    /// `127.0.0.1:0`.
    ///
    /// # Panics
    /// Panics if called outside a tokio runtime.
    pub async fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(upstream));
        let (shutdown, shutdown_rx) = watch::channel(());
        tokio::spawn(accept_loop(listener, shared.clone(), shutdown_rx.clone()));
        tokio::spawn(chaos_loop(shared.clone(), shutdown_rx));
        Ok(FaultProxy {
            addr,
            shared,
            shutdown: Some(shutdown),
            thread: None,
        })
    }

    /// Starts a proxy to `upstream` on a thread of its own (with its own
    /// single-threaded runtime), for blocking tests. Works from inside a
    /// runtime too. Dropping the handle stops and joins the thread.
    pub fn spawn(upstream: SocketAddr) -> io::Result<FaultProxy> {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = thread::Builder::new()
            .name(format!("fault-proxy->{upstream}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let mut proxy = match FaultProxy::start(upstream).await {
                        Ok(p) => p,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    // The caller's handle takes the shutdown sender; this
                    // thread runs the proxy until that handle drops it.
                    let stop_tx = proxy.shutdown.take().expect("fresh proxy");
                    let mut stop_rx = stop_tx.subscribe();
                    if tx
                        .send(Ok((proxy.addr, proxy.shared.clone(), stop_tx)))
                        .is_err()
                    {
                        return;
                    }
                    let _ = stop_rx.changed().await;
                    // Let the tasks see the close and drop their sockets.
                    tokio::task::yield_now().await;
                });
                // Dropping the runtime aborts whatever tasks remain.
            })?;
        match rx.recv() {
            Ok(Ok((addr, shared, stop_tx))) => Ok(FaultProxy {
                addr,
                shared,
                shutdown: Some(stop_tx),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(io::Error::other("fault proxy thread died during start-up"))
            }
        }
    }

    /// The address clients connect to (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address every connection is forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream()
    }

    /// Forwards connections accepted from now on to `upstream`; current
    /// ones stay where they are. For a test whose upstream's own settings
    /// need the proxy's address: start the proxy first (towards any
    /// address: it dials nothing until a client comes), then point it.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = upstream;
    }

    /// Aborts every current connection with a TCP RST towards both the client
    /// and the upstream. Data queued in the proxy is discarded. Connections
    /// accepted after this call are not affected.
    pub fn reset_all(&self) {
        self.shared.reset_all();
    }

    /// Turns the black hole on or off. While on, nothing is forwarded in
    /// either direction, connections stay open, and new connections are
    /// accepted but not connected upstream. Held bytes flow again, in order,
    /// when it is turned off.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// Black-holes every current connection for good, while new connections
    /// work normally: the path an endpoint was using died silently (its
    /// address went away, a NAT forgot it), but a new path is there. Bytes
    /// queued in the proxy are dropped; the sockets stay open, silent, until
    /// [`reset_all`](Self::reset_all) or the proxy stops.
    pub fn blackhole_current(&self) {
        self.shared.stall_gen.send_modify(|g| *g += 1);
    }

    /// Sets the one-way latency added to every chunk from now on, in both
    /// directions. Order is preserved; [`Duration::ZERO`] turns it off.
    pub fn set_delay(&self, delay: Duration) {
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.shared.delay_ns.store(ns, Ordering::Relaxed);
    }

    /// While on, new connections are reset right after accept (current ones
    /// are left alone).
    pub fn refuse(&self, on: bool) {
        self.shared.refuse.send_replace(on);
    }

    /// Chaos mode: a [`reset_all`](Self::reset_all) every `period`, the first
    /// one a period from now. `None` turns it off.
    pub fn reset_every(&self, period: Option<Duration>) {
        let period = period.filter(|p| !p.is_zero());
        self.shared.chaos.send_replace(period);
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        let s = &self.shared;
        ProxyStats {
            accepted: s.accepted.load(Ordering::Relaxed),
            refused: s.refused.load(Ordering::Relaxed),
            active: s.active.load(Ordering::Relaxed),
            resets: s.resets.load(Ordering::Relaxed),
            stalled: s.stalled.load(Ordering::Relaxed),
            chaos_rounds: s.chaos_rounds.load(Ordering::Relaxed),
            bytes_up: s.bytes_up.load(Ordering::Relaxed),
            bytes_down: s.bytes_down.load(Ordering::Relaxed),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Closing the channel stops the accept loop, the chaos loop and every
        // connection task.
        drop(self.shutdown.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Closes a socket with a RST instead of a FIN.
fn rst(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => return,
        };
        let client = match accepted {
            Ok((c, _)) => c,
            // EMFILE and friends: back off briefly instead of spinning.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        if *shared.refuse.borrow() {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            rst(&client);
            continue;
        }
        let _ = client.set_nodelay(true);
        let mut signals = Signals {
            reset: shared.reset_gen.subscribe(),
            stall: shared.stall_gen.subscribe(),
            stop: stop.clone(),
        };
        signals.reset.borrow_and_update();
        signals.stall.borrow_and_update();
        shared.active.fetch_add(1, Ordering::Relaxed);
        let shared2 = shared.clone();
        tokio::spawn(async move {
            connection(client, &shared2, signals).await;
            shared2.active.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

async fn chaos_loop(shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    let mut period_rx = shared.chaos.subscribe();
    loop {
        let period = *period_rx.borrow_and_update();
        tokio::select! {
            _ = stop.changed() => return,
            _ = period_rx.changed() => continue,
            _ = async {
                match period {
                    Some(p) => tokio::time::sleep(p).await,
                    None => std::future::pending().await,
                }
            } => {
                shared.chaos_rounds.fetch_add(1, Ordering::Relaxed);
                shared.reset_all();
            }
        }
    }
}

/// How a connection ended.
enum End {
    /// Both directions finished with a FIN: close normally.
    Clean,
    /// An error on either side, a reset request, or refusal: abort both with RST.
    Abort,
    /// The proxy is shutting down.
    Shutdown,
    /// [`FaultProxy::blackhole_current`]: hold both sockets, silent.
    Stall,
}

/// What one connection task listens to besides its sockets.
struct Signals {
    reset: watch::Receiver<u64>,
    stall: watch::Receiver<u64>,
    stop: watch::Receiver<()>,
}

impl Signals {
    /// Holds a stalled connection's sockets until a reset (then RST) or the
    /// proxy stops.
    async fn hold_stalled(&mut self, shared: &Shared, socks: &[&TcpStream]) {
        shared.stalled.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            _ = self.reset.changed() => {
                shared.resets.fetch_add(1, Ordering::Relaxed);
                socks.iter().for_each(|s| rst(s));
            }
            _ = self.stop.changed() => {}
        }
    }
}

async fn connection(mut client: TcpStream, shared: &Shared, mut sig: Signals) {
    // A black hole swallows SYNs too: do not connect upstream until lifted.
    let mut hole = shared.blackhole.subscribe();
    let upstream = tokio::select! {
        r = async {
            wait_open(&mut hole).await;
            TcpStream::connect(shared.upstream()).await
        } => r,
        _ = sig.reset.changed() => {
            shared.resets.fetch_add(1, Ordering::Relaxed);
            rst(&client);
            return;
        }
        _ = sig.stall.changed() => {
            sig.hold_stalled(shared, &[&client]).await;
            return;
        }
        _ = sig.stop.changed() => return,
    };
    let mut upstream = match upstream {
        Ok(u) => u,
        Err(_) => {
            // Upstream refused or unreachable: the client sees a reset, as it
            // would connecting directly.
            rst(&client);
            return;
        }
    };
    let _ = upstream.set_nodelay(true);

    let end = {
        let (cr, cw) = client.split();
        let (ur, uw) = upstream.split();
        let up = pump(cr, uw, shared, &shared.bytes_up);
        let down = pump(ur, cw, shared, &shared.bytes_down);
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => match r {
                Ok(_) => End::Clean,
                Err(_) => End::Abort,
            },
            _ = sig.reset.changed() => {
                shared.resets.fetch_add(1, Ordering::Relaxed);
                End::Abort
            }
            _ = sig.stall.changed() => End::Stall,
            _ = sig.stop.changed() => End::Shutdown,
        }
    };
    match end {
        End::Clean | End::Shutdown => {}
        End::Abort => {
            rst(&client);
            rst(&upstream);
        }
        End::Stall => sig.hold_stalled(shared, &[&client, &upstream]).await,
    }
}

/// One chunk in flight from one side to the other.
struct Chunk {
    /// When it may be written (read time plus the delay then in force).
    due: Instant,
    /// The bytes; `None` is the reader's end of stream (forwarded as a FIN).
    data: Option<Vec<u8>>,
}

/// Forwards one direction until EOF (then half-closes the other side) or an
/// error. The reader and writer halves run concurrently, joined by a bounded
/// queue, so a delay adds latency without capping throughput at one chunk per
/// delay.
async fn pump<R, W>(mut from: R, mut to: W, shared: &Shared, counter: &AtomicU64) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, mut rx) = mpsc::channel::<Chunk>(QUEUE_CHUNKS);
    let mut hole_r = shared.blackhole.subscribe();
    let mut hole_w = shared.blackhole.subscribe();
    let read = async move {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            wait_open(&mut hole_r).await;
            let n = from.read(&mut buf).await?;
            let due = Instant::now() + shared.delay();
            let data = (n > 0).then(|| buf[..n].to_vec());
            if tx.send(Chunk { due, data }).await.is_err() || n == 0 {
                return Ok::<(), io::Error>(());
            }
        }
    };
    let write = async move {
        while let Some(chunk) = rx.recv().await {
            tokio::time::sleep_until(chunk.due).await;
            wait_open(&mut hole_w).await;
            match chunk.data {
                Some(d) => {
                    to.write_all(&d).await?;
                    counter.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                None => {
                    to.shutdown().await?;
                    return Ok(());
                }
            }
        }
        Ok(())
    };
    tokio::try_join!(read, write).map(|_| ())
}

/// Runs a plain TCP echo server on `127.0.0.1:0` on the current runtime until
/// the returned sender is dropped; returns its address. Test helper.
pub async fn echo_server() -> io::Result<(SocketAddr, watch::Sender<()>)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    let (stop, mut stop_rx) = watch::channel(());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = tokio::select! {
                r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
                _ = stop_rx.changed() => return,
            };
            let mut stop2 = stop_rx.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                tokio::select! {
                    _ = tokio::io::copy(&mut r, &mut w) => {}
                    _ = stop2.changed() => {}
                }
            });
        }
    });
    Ok((addr, stop))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| {
                (i as u32)
                    .wrapping_mul(2654435761)
                    .rotate_left(seed as u32 % 31) as u8
                    ^ seed
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_intact_and_counted() {
        let (echo, _stop) = echo_server().await.unwrap();
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let data = pattern(4 << 20, 7);
        let (mut r, mut w) = s.split();
        let send = async {
            w.write_all(&data).await.unwrap();
            w.shutdown().await.unwrap();
        };
        let mut got = Vec::new();
        let recv = async { r.read_to_end(&mut got).await.unwrap() };
        tokio::join!(send, recv);
        assert!(got == data, "echoed bytes differ");
        let st = proxy.stats();
        assert_eq!(st.accepted, 1);
        assert_eq!(st.bytes_up, data.len() as u64);
        assert_eq!(st.bytes_down, data.len() as u64);
    }

    #[tokio::test]
    async fn reset_errors_both_ends() {
        // The upstream is our own listener so we can watch its side too.
        let up = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let proxy = FaultProxy::start(up.local_addr().unwrap()).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut u, _) = up.accept().await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        u.read_exact(&mut b).await.unwrap();
        proxy.reset_all();
        let deadline = Duration::from_secs(5);
        let rc = tokio::time::timeout(deadline, c.read(&mut b))
            .await
            .unwrap();
        let ru = tokio::time::timeout(deadline, u.read(&mut b))
            .await
            .unwrap();
        assert_eq!(rc.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(ru.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(proxy.stats().resets, 1);
        // New connections still work after a reset.
        let mut c2 = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut u2, _) = up.accept().await.unwrap();
        c2.write_all(b"pong").await.unwrap();
        u2.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"pong");
    }

    #[tokio::test]
    async fn set_upstream_moves_new_connections_only() {
        let first = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let second = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let proxy = FaultProxy::start(first.local_addr().unwrap())
            .await
            .unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut old_up, _) = first.accept().await.unwrap();
        proxy.set_upstream(second.local_addr().unwrap());
        assert_eq!(proxy.upstream(), second.local_addr().unwrap());
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        let d = Duration::from_secs(5);
        let (mut new_up, _) = tokio::time::timeout(d, second.accept())
            .await
            .unwrap()
            .unwrap();
        let mut b = [0u8; 3];
        old.write_all(b"old").await.unwrap();
        old_up.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"old", "the open connection stays with the first");
        new.write_all(b"new").await.unwrap();
        new_up.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"new");
    }

    #[tokio::test]
    async fn blackhole_stalls_then_resumes() {
        let (echo, _stop) = echo_server().await.unwrap();
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        s.write_all(b"one").await.unwrap();
        let mut b = [0u8; 3];
        s.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"one");

        proxy.blackhole(true);
        s.write_all(b"two").await.unwrap();
        let stalled = tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut b)).await;
        assert!(stalled.is_err(), "black hole forwarded data");
        // A connection made during the black hole is held too.
        let mut late = TcpStream::connect(proxy.addr()).await.unwrap();
        late.write_all(b"new").await.unwrap();

        proxy.blackhole(false);
        let d = Duration::from_secs(5);
        tokio::time::timeout(d, s.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b, b"two");
        tokio::time::timeout(d, late.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b, b"new");
    }

    #[tokio::test]
    async fn blackhole_current_spares_new_connections() {
        let (echo, _stop) = echo_server().await.unwrap();
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut b = [0u8; 3];
        old.write_all(b"old").await.unwrap();
        old.read_exact(&mut b).await.unwrap();
        proxy.blackhole_current();
        old.write_all(b"two").await.unwrap();
        let stalled =
            tokio::time::timeout(Duration::from_millis(300), old.read_exact(&mut b)).await;
        assert!(stalled.is_err(), "a stalled connection forwarded data");
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        new.write_all(b"new").await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), new.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b, b"new");
        assert_eq!(proxy.stats().stalled, 1);
        // A reset still reaches the stalled connection.
        proxy.reset_all();
        let r = tokio::time::timeout(Duration::from_secs(5), old.read(&mut b))
            .await
            .unwrap();
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    }

    #[tokio::test]
    async fn delay_adds_latency_in_order() {
        let (echo, _stop) = echo_server().await.unwrap();
        let proxy = FaultProxy::start(echo).await.unwrap();
        proxy.set_delay(Duration::from_millis(100));
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let t0 = std::time::Instant::now();
        for i in 0..10u8 {
            s.write_all(&[i]).await.unwrap();
        }
        let mut b = [0u8; 10];
        s.read_exact(&mut b).await.unwrap();
        let rtt = t0.elapsed();
        assert_eq!(b, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        // 100 ms each way.
        assert!(rtt >= Duration::from_millis(200), "rtt {rtt:?}");
        assert!(rtt < Duration::from_millis(600), "rtt {rtt:?}");
        proxy.set_delay(Duration::ZERO);
        let t1 = std::time::Instant::now();
        s.write_all(b"x").await.unwrap();
        s.read_exact(&mut b[..1]).await.unwrap();
        assert!(t1.elapsed() < Duration::from_millis(100));
    }

    #[tokio::test]
    async fn refuse_resets_new_connections() {
        let (echo, _stop) = echo_server().await.unwrap();
        let proxy = FaultProxy::start(echo).await.unwrap();
        let mut kept = TcpStream::connect(proxy.addr()).await.unwrap();
        kept.write_all(b"a").await.unwrap();
        let mut b = [0u8; 1];
        kept.read_exact(&mut b).await.unwrap();
        proxy.refuse(true);
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b))
            .await
            .unwrap();
        assert!(
            matches!(r, Err(ref e) if e.kind() == io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
        // The connection made before refusing still works.
        kept.write_all(b"b").await.unwrap();
        kept.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"b");
        proxy.refuse(false);
        let st = proxy.stats();
        assert_eq!((st.accepted, st.refused), (2, 1));
    }

    #[tokio::test]
    async fn chaos_resets_periodically() {
        let (echo, _stop) = echo_server().await.unwrap();
        let proxy = FaultProxy::start(echo).await.unwrap();
        proxy.reset_every(Some(Duration::from_millis(100)));
        let mut b = [0u8; 1];
        for _ in 0..3 {
            let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
            let r = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b))
                .await
                .unwrap();
            assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        }
        proxy.reset_every(None);
        assert!(proxy.stats().chaos_rounds >= 3);
    }

    #[test]
    fn spawned_proxy_from_blocking_code() {
        let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let echo_addr = echo.local_addr().unwrap();
        let t = thread::spawn(move || {
            let (mut s, _) = echo.accept().unwrap();
            let mut r = s.try_clone().unwrap();
            std::io::copy(&mut r, &mut s).unwrap();
        });
        let proxy = FaultProxy::spawn(echo_addr).unwrap();
        let mut s = std::net::TcpStream::connect(proxy.addr()).unwrap();
        s.write_all(b"hello").unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hello");
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(s.read(&mut b).unwrap(), 0);
        t.join().unwrap();
        assert_eq!(proxy.stats().bytes_up, 5);
        drop(proxy); // joins the proxy thread
    }

    #[test]
    fn drop_closes_connections() {
        let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let proxy = FaultProxy::spawn(echo.local_addr().unwrap()).unwrap();
        let mut s = std::net::TcpStream::connect(proxy.addr()).unwrap();
        let (_u, _) = echo.accept().unwrap();
        let addr = proxy.addr();
        drop(proxy);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        // Either a FIN or a RST, never a hang.
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
        assert!(std::net::TcpStream::connect(addr).is_err());
    }
}
