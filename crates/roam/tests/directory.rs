//! The directory seam (`roam::Directory`, `docs/PROTOCOL.md` §9.3): three
//! servers of one service on loopback, one client. The server application
//! echoes a stream and, at quiescent points, takes its session out of the
//! host it runs on (`SessionHandle::detach`) and hands it to the next host.
//! The old host's directory then answers `Elsewhere` (the client is
//! redirected with a `Moved` refusal), the new host's answers `Stored`
//! (the session is restored there). The client follows every move on its
//! own; every byte it writes comes back exactly once, in order.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{client_config, fill_pattern, init_logging, server_config};
use roam::{Detached, Directory, Locating, Location, Restored, SessionHandle, SessionId};
use roam_proto::{Keypair, StreamId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::timeout;

/// Where each session is: the host index, and its continuation while it is
/// on its way there.
#[derive(Default)]
struct Cluster {
    addrs: Vec<SocketAddr>,
    sessions: Mutex<HashMap<SessionId, (usize, Option<Detached>)>>,
}

/// One host's view of the cluster.
struct HostDirectory {
    me: usize,
    cluster: Arc<Cluster>,
    service_key: Keypair,
    installed: mpsc::UnboundedSender<(usize, SessionHandle)>,
}

impl Directory for HostDirectory {
    fn locate(&self, id: SessionId) -> Locating {
        let mut map = self.cluster.sessions.lock().unwrap();
        let answer = match map.get_mut(&id) {
            None => Location::Unknown,
            Some((host, _)) if *host != self.me => {
                Location::Elsewhere(self.cluster.addrs[*host].to_string())
            }
            Some((_, cont)) => match cont.take() {
                // Installed already (a second resume raced the first).
                None => Location::Unknown,
                Some(d) => {
                    let cfg = server_config(self.service_key.clone()).proto;
                    match roam_proto::Session::restore_server(
                        &cfg,
                        std::time::Instant::now(),
                        &d.blob,
                        Duration::ZERO,
                    ) {
                        Ok(session) => {
                            let tx = self.installed.clone();
                            let me = self.me;
                            Location::Stored(Box::new(Restored::new(
                                session,
                                d.unaccepted,
                                d.orphans,
                                Box::new(move |h| {
                                    let _ = tx.send((me, h));
                                }),
                            )))
                        }
                        Err(e) => panic!("restore failed: {e}"),
                    }
                }
            },
        };
        Box::pin(std::future::ready(answer))
    }
}

/// The echo application's state for the one session, shared by its hosts.
struct App {
    stream: Mutex<Option<StreamId>>,
    echoed: AtomicU64,
    moves: AtomicU64,
    /// Times the application started on a restored session.
    installs: AtomicU64,
    /// Move after every this many echoed bytes.
    every: u64,
    cluster: Arc<Cluster>,
}

impl App {
    /// Echoes on host `me` until the next move point, then hands the
    /// session to the next host; or until end-of-stream.
    async fn run(self: Arc<Self>, me: usize, handle: SessionHandle) {
        let sid = *self.stream.lock().unwrap();
        let mut stream = match sid {
            Some(id) => {
                self.installs.fetch_add(1, Ordering::SeqCst);
                handle.stream(id).expect("stream after restore")
            }
            None => {
                let (s, _) = handle.accept_stream().await.expect("first stream");
                *self.stream.lock().unwrap() = Some(s.id());
                s
            }
        };
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let echoed = self.echoed.load(Ordering::SeqCst);
            let until_move = self.every - echoed % self.every;
            if until_move == self.every && echoed > 0 && self.moves_due(echoed) {
                break;
            }
            let want = buf.len().min(until_move as usize);
            let n = stream.read(&mut buf[..want]).await.expect("server read");
            if n == 0 {
                stream.shutdown().await.expect("server finish");
                return;
            }
            stream.write_all(&buf[..n]).await.expect("server write");
            self.echoed.fetch_add(n as u64, Ordering::SeqCst);
        }
        // A quiescent point: everything read was written back.
        let next = (me + 1) % self.cluster.addrs.len();
        let id = handle.id().unwrap();
        // Detached before the stream handle is dropped: dropping it on a
        // live session would finish the stream.
        let detached = handle.detach().await.expect("detach");
        drop(stream);
        self.moves.fetch_add(1, Ordering::SeqCst);
        self.cluster
            .sessions
            .lock()
            .unwrap()
            .insert(id, (next, Some(detached)));
    }

    /// Whether the move for `echoed` bytes has not happened yet.
    fn moves_due(&self, echoed: u64) -> bool {
        self.moves.load(Ordering::SeqCst) < echoed / self.every
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_follows_its_server_across_three_hosts_mid_transfer() {
    init_logging();
    let service_key = Keypair::generate().unwrap();
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(l.local_addr().unwrap());
        listeners.push(l);
    }
    let cluster = Arc::new(Cluster {
        addrs: addrs.clone(),
        ..Default::default()
    });
    const LEN: u64 = 6 << 20;
    const EVERY: u64 = 256 << 10;
    let app = Arc::new(App {
        stream: Mutex::new(None),
        echoed: AtomicU64::new(0),
        moves: AtomicU64::new(0),
        installs: AtomicU64::new(0),
        every: EVERY,
        cluster: cluster.clone(),
    });
    let (installed_tx, mut installed_rx) = mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut servers = Vec::new();
    for (me, listener) in listeners.into_iter().enumerate() {
        let dir = Arc::new(HostDirectory {
            me,
            cluster: cluster.clone(),
            service_key: service_key.clone(),
            installed: installed_tx.clone(),
        });
        let app = app.clone();
        let mut stop = stop_rx.clone();
        servers.push(tokio::spawn(roam::serve_with_directory(
            listener,
            server_config(service_key.clone()),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
            move |h| {
                tokio::spawn(app.clone().run(me, h));
            },
            dir,
        )));
    }
    // Restored sessions run the application on the host that installed them.
    let app2 = app.clone();
    tokio::spawn(async move {
        while let Some((me, h)) = installed_rx.recv().await {
            tokio::spawn(app2.clone().run(me, h));
        }
    });

    timeout(Duration::from_secs(120), async {
        let session = roam::connect(
            &addrs[0].to_string(),
            client_config(Some(service_key.public())),
        )
        .await
        .unwrap();
        let stream = session.open_stream(b"echo").unwrap();
        let (mut r, mut w) = tokio::io::split(stream);
        let writer = tokio::spawn(async move {
            let mut buf = vec![0u8; 8 * 1024];
            let mut off = 0;
            while off < LEN {
                fill_pattern(7, off, &mut buf);
                w.write_all(&buf).await.unwrap();
                off += buf.len() as u64;
            }
            w.shutdown().await.unwrap();
        });
        let got = common::read_pattern(&mut r, 7).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got, LEN, "every byte came back exactly once, in order");
        let moves = app.moves.load(Ordering::SeqCst);
        assert_eq!(moves, LEN / EVERY, "moved at every quiescent point");
        assert_eq!(
            app.installs.load(Ordering::SeqCst),
            moves,
            "each move installed at its destination once"
        );
        let stats = session.stats();
        eprintln!("{moves} moves, {} client resumes", stats.resumes);
        assert_eq!(
            stats.bytes_sent, LEN,
            "no byte sent twice by the application"
        );
        let _ = timeout(Duration::from_secs(5), session.close(0, "done")).await;
    })
    .await
    .expect("test timed out");
    let _ = stop_tx.send(true);
    for s in servers {
        let _ = timeout(Duration::from_secs(10), s).await;
    }
}
