//! `roam demo`: a self-contained story. A relay and an echo target run on
//! loopback in this process; a client session streams data through a
//! simulated link to the relay, the link is cut mid-transfer and restored,
//! and the session suspends, resumes and delivers every byte exactly once.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use roam::SessionEvent;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

use crate::cli::{CliError, CliResult, DemoArgs};
use crate::control::human_bytes;
use crate::target::AllowRule;

/// Fraction of the transfer after which the link is cut.
const CUT_AT: f64 = 0.4;
/// How long the link stays down.
const DOWN_FOR: Duration = Duration::from_millis(1500);
/// Upper bound for the whole demo.
const DEMO_LIMIT: Duration = Duration::from_secs(60);

/// `roam demo`.
pub(crate) async fn run(args: DemoArgs) -> CliResult {
    let size = crate::config::parse_size(&args.size)?;
    if size == 0 {
        return Err(CliError("--size must be positive".into()));
    }
    match timeout(DEMO_LIMIT, story(size)).await {
        Ok(r) => r,
        Err(_) => Err(CliError(format!(
            "demo did not finish within {DEMO_LIMIT:?}"
        ))),
    }
}

async fn story(size: u64) -> CliResult {
    let started = Instant::now();
    println!("roam demo: one session, one stream, a link that dies mid-transfer\n");

    // 1. The target (an echo service) and the relay, both on loopback.
    let echo = TcpListener::bind("127.0.0.1:0").await?;
    let echo_addr = echo.local_addr()?;
    tokio::spawn(echo_service(echo));
    let relay_listener = TcpListener::bind("127.0.0.1:0").await?;
    let relay_addr = relay_listener.local_addr()?;
    let server_kp = roam_proto::Keypair::generate()?;
    let server_key = server_kp.public();
    let server = roam::ServerConfig::new(roam_proto::ServerConfig {
        keypair: server_kp,
        authorized_keys: None,
        addresses: Vec::new(),
        session: roam_proto::Config::default(),
    });
    let rules = Arc::new(vec![AllowRule::parse(&echo_addr.to_string())?]);
    let (stop_relay, mut stop_rx) = watch::channel(false);
    let relay = tokio::spawn(crate::serve::run_relay(
        relay_listener,
        server,
        rules,
        crate::limits::TargetCaps::new(1024, crate::limits::DEFAULT_TARGETS_PER_SESSION),
        None,
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    ));
    let link = Link::start(relay_addr).await?;
    println!(
        "  1. relay (like `roam serve`) on {relay_addr}, allowing only the echo target {echo_addr}"
    );
    println!(
        "     client reaches the relay through a simulated network link at {}",
        link.addr
    );

    // 2. The client session, pinned to the relay's key.
    let mut client = roam::ClientConfig::new(roam_proto::ClientConfig {
        keypair: roam_proto::Keypair::generate()?,
        server_trust: roam_proto::ServerTrust::Pinned(server_key),
        session: roam_proto::Config::default(),
    });
    client.watch_network = false; // the link is simulated: the demo says when it is back
    let session = roam::connect(&link.addr.to_string(), client)
        .await
        .map_err(|e| CliError(e.to_string()))?;
    let mut events = session.events();
    let id = session.id().map(|i| i.to_string()).unwrap_or_default();
    println!(
        "  2. session {} established (Noise XX, server key pinned)",
        &id[..id.len().min(16)]
    );

    // 3. Stream data to the echo target and read it back, hashing both ways.
    let stream = session
        .open_stream(echo_addr.to_string().as_bytes())
        .map_err(|e| CliError(e.to_string()))?;
    let (mut rd, mut wr) = tokio::io::split(stream);
    let received = Arc::new(AtomicU64::new(0));
    let writer = tokio::spawn(async move {
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut rng = 0x243F_6A88_85A3_08D3u64;
        let mut sent = 0u64;
        while sent < size {
            let n = (size - sent).min(buf.len() as u64) as usize;
            for chunk in buf[..n].chunks_mut(8) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                chunk.copy_from_slice(&rng.to_le_bytes()[..chunk.len()]);
            }
            hash.update(&buf[..n]);
            wr.write_all(&buf[..n]).await?;
            sent += n as u64;
        }
        wr.shutdown().await?;
        Ok::<_, std::io::Error>(hash.finalize())
    });
    let progress = received.clone();
    let reader = tokio::spawn(async move {
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            progress.fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok::<_, std::io::Error>(hash.finalize())
    });
    println!(
        "  3. streaming {} to the echo target and back through the relay...",
        human_bytes(size)
    );

    // 4. Cut the link mid-transfer.
    let cut_at = (size as f64 * CUT_AT) as u64;
    while received.load(Ordering::Relaxed) < cut_at {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    link.set_up(false);
    link.kill();
    let cut_time = Instant::now();
    println!(
        "  4. {} echoed back so far: the link goes DOWN (both TCP connections reset)",
        human_bytes(received.load(Ordering::Relaxed))
    );
    let reason = wait_for(&mut events, |e| match e {
        SessionEvent::Suspended { reason } => Some(format!("{reason:?}")),
        _ => None,
    })
    .await?;
    println!(
        "     session SUSPENDED after {} ({reason}); the stream stays open, writes are buffered",
        ms(cut_time.elapsed())
    );
    tokio::time::sleep(DOWN_FOR).await;
    let mut redials = 0;
    while let Ok(ev) = events.try_recv() {
        if matches!(ev, SessionEvent::Redialing { .. }) {
            redials += 1;
        }
    }
    println!(
        "     link down for {}: {redials} re-dial attempts failed (exponential backoff with jitter)",
        ms(cut_time.elapsed())
    );

    // 5. Link back: tell the client, as Linux's netlink would for a real interface.
    link.set_up(true);
    let up_time = Instant::now();
    session.redial_now();
    let (replayed, suspended_for) = wait_for(&mut events, |e| match e {
        SessionEvent::Resumed {
            bytes_replayed,
            suspended_for,
            ..
        } => Some((*bytes_replayed, *suspended_for)),
        _ => None,
    })
    .await?;
    let resume_latency = up_time.elapsed();
    println!(
        "  5. link UP again: session RESUMED {} after the link came back",
        ms(resume_latency)
    );
    println!(
        "     (suspended for {}; the client replays {} the relay had not acknowledged)",
        ms(suspended_for),
        human_bytes(replayed)
    );

    // 6. Verify.
    let sent_hash = writer.await.map_err(|e| CliError(e.to_string()))??;
    let recv_hash = reader.await.map_err(|e| CliError(e.to_string()))??;
    let got = received.load(Ordering::Relaxed);
    let stats = session.stats();
    let ok = sent_hash == recv_hash && got == size;
    println!(
        "  6. transfer complete: {} sent, {} echoed back, over {} TCP connections",
        human_bytes(size),
        human_bytes(got),
        stats.transports
    );
    println!("     sha256 sent     {}", hex::encode(sent_hash));
    println!("     sha256 received {}", hex::encode(recv_hash));
    let _ = timeout(
        Duration::from_secs(3),
        session.close(roam_proto::code::NO_ERROR, "demo done"),
    )
    .await;
    let _ = stop_relay.send(true);
    let _ = timeout(Duration::from_secs(5), relay).await;
    if !ok {
        return Err(CliError(
            "demo FAILED: the data did not survive intact".into(),
        ));
    }
    println!(
        "\nevery byte arrived exactly once, in order. link-up to resumed: {}; total {}.",
        ms(resume_latency),
        ms(started.elapsed())
    );
    println!("next: run `roam serve` on a host and `ssh -o ProxyCommand='roam pipe %h %p' host`.");
    Ok(0)
}

fn ms(d: Duration) -> String {
    if d < Duration::from_secs(2) {
        format!("{:.1} ms", d.as_secs_f64() * 1000.0)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

async fn wait_for<T>(
    events: &mut tokio::sync::broadcast::Receiver<SessionEvent>,
    mut pick: impl FnMut(&SessionEvent) -> Option<T>,
) -> Result<T, CliError> {
    let wait = async {
        loop {
            match events.recv().await {
                Ok(SessionEvent::Closed { reason }) => {
                    return Err(CliError(format!(
                        "session closed unexpectedly: {}",
                        roam::Error::Closed(reason)
                    )))
                }
                Ok(e) => {
                    if let Some(t) = pick(&e) {
                        return Ok(t);
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => return Err(CliError(e.to_string())),
            }
        }
    };
    timeout(Duration::from_secs(20), wait)
        .await
        .map_err(|_| CliError("demo: expected session event did not come".into()))?
}

async fn echo_service(listener: TcpListener) {
    while let Ok((sock, _)) = listener.accept().await {
        tokio::spawn(async move {
            let (mut r, mut w) = sock.into_split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
            let _ = w.shutdown().await;
        });
    }
}

/// A loopback TCP relay standing in for the network between client and
/// relay: its connections can be cut, and while it is down new ones die at once.
struct Link {
    addr: SocketAddr,
    kill: watch::Sender<u64>,
    up: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Link {
    async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (kill, kill_rx) = watch::channel(0u64);
        let (up, up_rx) = watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !*up_rx.borrow() {
                    let _ = socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO));
                    continue;
                }
                let mut kill_rx = kill_rx.clone();
                kill_rx.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = kill_rx.changed() => {
                            let _ = socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO));
                            let _ = socket2::SockRef::from(&server).set_linger(Some(Duration::ZERO));
                        }
                    }
                });
            }
        });
        Ok(Self {
            addr,
            kill,
            up,
            task,
        })
    }

    fn kill(&self) {
        self.kill.send_modify(|n| *n += 1);
    }

    fn set_up(&self, up: bool) {
        let _ = self.up.send(up);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
        self.kill();
    }
}
