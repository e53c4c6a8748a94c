//! The transport seam: sessions over Unix-domain sockets and over
//! transports the caller hands in, every byte checked, across the loss of
//! the transport they started on.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::time::timeout;

const MB: u64 = 1 << 20;

/// A server on a Unix-domain socket, a client dialing `unix:PATH`: streams
/// both ways, every byte checked on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_runs_over_a_unix_socket() {
    timeout(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("roam.sock");
        let mut server = TestServer::start_unix(&path);
        let addr = format!("unix:{}", path.display());
        let session = roam::connect(&addr, client_config(Some(server.key)))
            .await
            .unwrap();
        for t in run_transfer(&session, 3, 2 * MB).await {
            assert_eq!(t.await.unwrap().unwrap(), 2 * MB);
        }
        check_server_reports(&mut server, 3, 2 * MB).await;
        assert_eq!(session.stats().bytes_received, 6 * MB);
        let _ = timeout(Duration::from_secs(5), session.close(0, "done")).await;
        server.stop();
    })
    .await
    .expect("test timed out");
}

/// The client is handed its first transport (one end of a socket pair whose
/// other end the test splices to the server), not a connection it dialed.
/// Mid-transfer the test cuts that transport; the session re-dials the
/// server's own socket (`unix:PATH`), resumes, and every byte arrives once,
/// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_in_transport_is_used_then_replaced_on_loss() {
    timeout(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("roam.sock");
        let mut server = TestServer::start_unix(&path);
        let (ours, theirs) = UnixStream::pair().unwrap();
        let upstream = UnixStream::connect(&path).await.unwrap();
        let splice = tokio::spawn(async move {
            let mut theirs = theirs;
            let mut upstream = upstream;
            let _ = tokio::io::copy_bidirectional(&mut theirs, &mut upstream).await;
        });
        let addr = format!("unix:{}", path.display());
        let session = roam::connect_over(ours.into(), &addr, client_config(Some(server.key)))
            .await
            .unwrap();
        let len = 16 * MB;
        let tasks = run_transfer(&session, 2, len).await;
        // Cut the handed-in transport once some bytes have moved.
        timeout(Duration::from_secs(20), async {
            while session.stats().bytes_received < 2 * MB {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("bytes moved over the handed-in transport");
        splice.abort();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), len);
        }
        check_server_reports(&mut server, 2, len).await;
        let stats = session.stats();
        assert!(stats.resumes >= 1, "{stats:?}");
        let _ = timeout(Duration::from_secs(5), session.close(0, "done")).await;
        server.stop();
    })
    .await
    .expect("test timed out");
}

/// A descriptor adopted from elsewhere (here a connected TCP socket made
/// with std, as a process handing its connections over would pass them)
/// carries a session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_descriptor_carries_a_session() {
    timeout(Duration::from_secs(60), async {
        let mut server = TestServer::start().await;
        let addr = server.addr;
        let sock = tokio::task::spawn_blocking(move || std::net::TcpStream::connect(addr))
            .await
            .unwrap()
            .unwrap();
        let t = roam::Transport::adopt(std::os::fd::OwnedFd::from(sock)).unwrap();
        let session = roam::connect_over(t, &addr.to_string(), client_config(Some(server.key)))
            .await
            .unwrap();
        let mut s = session.open_stream(b"5 1048576").unwrap();
        let mut buf = vec![0u8; MB as usize];
        fill_pattern(5, 0, &mut buf);
        s.write_all(&buf).await.unwrap();
        s.shutdown().await.unwrap();
        assert_eq!(read_pattern(&mut s, 1005).await.unwrap(), MB);
        check_server_reports(&mut server, 1, MB).await;
        let _ = timeout(Duration::from_secs(5), session.close(0, "done")).await;
        server.stop();
    })
    .await
    .expect("test timed out");
}
