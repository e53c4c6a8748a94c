//! Client and server over real loopback sockets: several streams both ways,
//! every byte checked, with and without the TCP connection being killed.

mod common;

use std::time::Duration;

use common::*;
use roam::SessionEvent;
use tokio::time::timeout;

const MB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_streams_both_ways() {
    timeout(Duration::from_secs(60), async {
        let mut server = TestServer::start().await;
        let session = roam::connect(&server.addr.to_string(), client_config(Some(server.key)))
            .await
            .unwrap();
        let tasks = run_transfer(&session, 4, 2 * MB).await;
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), 2 * MB);
        }
        check_server_reports(&mut server, 4, 2 * MB).await;
        let stats = session.stats();
        assert_eq!(stats.bytes_sent, 8 * MB);
        assert_eq!(stats.bytes_received, 8 * MB);
        // No resume is expected here, but a heavily loaded machine can starve
        // a debug build past `suspend_after`; correctness is what is checked.
        let reason = timeout(Duration::from_secs(5), session.close(0, "done"))
            .await
            .unwrap();
        assert!(
            matches!(reason, roam::CloseReason::Local { code: 0 }),
            "{reason:?}"
        );
        server.stop();
        timeout(Duration::from_secs(5), &mut server.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    })
    .await
    .expect("test timed out");
}

/// A stream dropped while the peer still sends (a download whose client
/// went away) is reset once our own bytes are delivered: the peer's writes
/// fail with a reset instead of streaming on to nobody for as long as it
/// has data, and everything we wrote arrived, checked byte by byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_dropped_unread_stops_the_peers_sending() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    timeout(Duration::from_secs(60), async {
        let mut server = TestServer::start().await;
        let session = roam::connect(&server.addr.to_string(), client_config(Some(server.key)))
            .await
            .unwrap();
        // The server would send 1 TB back; we send 256 KiB, read 1 MiB of
        // the answer (checked), and drop the stream.
        let ours = 256 * 1024;
        let mut stream = session
            .open_stream(format!("7 {}", 1u64 << 40).as_bytes())
            .unwrap();
        let mut buf = vec![0u8; ours as usize];
        fill_pattern(7, 0, &mut buf);
        stream.write_all(&buf).await.unwrap();
        let mut got = vec![0u8; MB as usize];
        stream.read_exact(&mut got).await.unwrap();
        let mut want = vec![0u8; MB as usize];
        fill_pattern(1007, 0, &mut want);
        assert!(got == want, "the answer's first MiB differs");
        drop(stream);
        let report = timeout(Duration::from_secs(20), server.reports.recv())
            .await
            .expect("the server kept sending to a dropped stream")
            .unwrap();
        let err = report.expect_err("the server's writer should have been reset");
        assert!(err.contains("reset"), "{err}");
        let received = session.stats().bytes_received;
        assert!(received < 1 << 32, "{received} bytes received");
        // The session goes on: a new stream both ways, every byte checked.
        let tasks = run_transfer(&session, 1, MB).await;
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), MB);
        }
        let _ = timeout(Duration::from_secs(5), session.close(0, "done")).await;
        server.stop();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_survives_killed_connections() {
    timeout(Duration::from_secs(90), async {
        let mut server = TestServer::start().await;
        let proxy = Proxy::start(server.addr).await;
        let session = roam::connect(&proxy.addr.to_string(), client_config(Some(server.key)))
            .await
            .unwrap();
        let mut events = session.events();
        let len = 4 * MB;
        let tasks = run_transfer(&session, 3, len).await;

        // Cut the connection three times while data flows both ways.
        for round in 1..=3u64 {
            let target = round * len * 3 / 4;
            timeout(Duration::from_secs(30), async {
                while session.stats().bytes_received < target {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await
            .expect("transfer progressed");
            proxy.kill();
            // Wait for the suspension and the resume.
            let mut suspended = false;
            loop {
                match timeout(Duration::from_secs(15), events.recv())
                    .await
                    .expect("resume in time")
                    .unwrap()
                {
                    SessionEvent::Suspended { .. } => suspended = true,
                    SessionEvent::Resumed { .. } => break,
                    SessionEvent::Closed { reason } => panic!("session closed: {reason:?}"),
                    _ => {}
                }
            }
            assert!(suspended, "saw a suspension before the resume");
        }
        for t in tasks {
            assert_eq!(
                t.await.unwrap().unwrap(),
                len,
                "client received every byte exactly once"
            );
        }
        check_server_reports(&mut server, 3, len).await;
        let stats = session.stats();
        assert!(stats.resumes >= 3, "{} resumes", stats.resumes);
        assert_eq!(
            stats.bytes_sent,
            3 * len,
            "first transmissions count each byte once"
        );
        assert_eq!(stats.bytes_received, 3 * len);
        timeout(Duration::from_secs(5), session.close(0, "done"))
            .await
            .unwrap();
        server.stop();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_down_then_up_resumes_and_reports_address() {
    timeout(Duration::from_secs(60), async {
        let mut server = TestServer::start().await;
        let proxy = Proxy::start(server.addr).await;
        let session = roam::connect(&proxy.addr.to_string(), client_config(Some(server.key)))
            .await
            .unwrap();
        let server_session = timeout(Duration::from_secs(5), server.sessions.recv())
            .await
            .unwrap()
            .unwrap();
        let mut server_events = server_session.events();
        let mut events = session.events();
        let tasks = run_transfer(&session, 1, 256 * 1024).await;
        proxy.set_up(false);
        proxy.kill();
        // Re-dials fail while the link is down; backoff keeps them sparse.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let redials_while_down = {
            let mut n = 0;
            while let Ok(ev) = events.try_recv() {
                if matches!(ev, SessionEvent::Redialing { .. }) {
                    n += 1;
                }
            }
            n
        };
        assert!(
            (2..=8).contains(&redials_while_down),
            "{redials_while_down} re-dials in 700 ms"
        );
        assert!(session.stats().suspended_for.is_some());
        let up_at = tokio::time::Instant::now();
        proxy.set_up(true);
        loop {
            match timeout(Duration::from_secs(10), events.recv())
                .await
                .expect("resumed")
                .unwrap()
            {
                SessionEvent::Resumed { .. } => break,
                SessionEvent::Closed { reason } => panic!("closed: {reason:?}"),
                _ => {}
            }
        }
        let took = up_at.elapsed();
        assert!(
            took < Duration::from_secs(6),
            "link up to resumed took {took:?}"
        );
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        // The server saw the client come back from a new source port.
        // (The server learns it when the client's first record on the new
        // transport arrives, which can be just after the client resumed.)
        let mut moved = false;
        while let Ok(Ok(ev)) = timeout(Duration::from_secs(2), server_events.recv()).await {
            if matches!(ev, SessionEvent::PeerAddressChanged { .. }) {
                moved = true;
                break;
            }
        }
        assert!(moved, "server reported the peer's address change");
        server.stop();
    })
    .await
    .expect("test timed out");
}

/// Something on the path answers the client's resumes with a forged
/// cleartext refusal (UnknownSession) for a second: the session survives,
/// resumes at the genuine server, and every byte arrives (PROTOCOL.md §12).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_refusals_shorter_than_the_grace_cost_only_a_retry() {
    timeout(Duration::from_secs(60), async {
        let mut server = TestServer::start().await;
        let proxy = Proxy::start(server.addr).await;
        let session = roam::connect(&proxy.addr.to_string(), client_config(Some(server.key)))
            .await
            .unwrap();
        let mut events = session.events();
        let tasks = run_transfer(&session, 4, 16 * MB).await;
        // The forger: answers every connection with "ROAM" 00 02 and hangs up.
        let forger = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let forger_addr = forger.local_addr().unwrap();
        let forged = tokio::spawn(async move {
            let mut n = 0u32;
            while let Ok((mut c, _)) = forger.accept().await {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 256];
                let _ = c.read(&mut buf).await;
                let _ = c.write_all(b"ROAM\x00\x02").await;
                n += 1;
            }
            n
        });
        while session.stats().bytes_received < MB {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        proxy.redirect(forger_addr);
        proxy.kill();
        assert!(session.stats().bytes_received < 64 * MB, "cut mid-transfer");
        // Refused at least once, then the path heals within the grace.
        let refused = timeout(Duration::from_secs(5), async {
            loop {
                if let Ok(SessionEvent::ResumeRefused { error }) = events.recv().await {
                    return error;
                }
            }
        })
        .await
        .expect("a refusal reached the client");
        assert_eq!(refused, roam_proto::Error::UnknownSession);
        assert!(!session.is_closed(), "one forged refusal ended the session");
        proxy.redirect(server.addr);
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), 16 * MB);
        }
        check_server_reports(&mut server, 4, 16 * MB).await;
        assert!(session.stats().resumes >= 1);
        forged.abort();
        server.stop();
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_ends_session_with_unknown_session() {
    timeout(Duration::from_secs(30), async {
        let server = TestServer::start().await;
        let proxy = Proxy::start(server.addr).await;
        let session = roam::connect(&proxy.addr.to_string(), client_config(None))
            .await
            .unwrap();
        let _s = session.open_stream(b"1 0").unwrap();
        // A new server with no memory of the session takes the old one's place.
        let other = TestServer::start().await;
        proxy.redirect(other.addr);
        let killed = std::time::Instant::now();
        proxy.kill();
        let reason = timeout(Duration::from_secs(20), session.closed())
            .await
            .expect("closed");
        assert_eq!(
            reason,
            roam::CloseReason::Error(roam_proto::Error::UnknownSession)
        );
        // Refusals in clear are unauthenticated: they end the session only
        // once they have persisted for the grace (PROTOCOL.md §12).
        let grace = common::fast_session().refusal_grace;
        assert!(
            killed.elapsed() >= grace,
            "ended after {:?}",
            killed.elapsed()
        );
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_key_mismatch_is_refused() {
    timeout(Duration::from_secs(10), async {
        let server = TestServer::start().await;
        let wrong = roam_proto::Keypair::generate().unwrap().public();
        let err = roam::connect(&server.addr.to_string(), client_config(Some(wrong)))
            .await
            .unwrap_err();
        match err.protocol() {
            Some(roam_proto::Error::ServerKeyMismatch { expected, actual }) => {
                assert_eq!(*expected, wrong);
                assert_eq!(*actual, server.key);
            }
            other => panic!("unexpected error {err} ({other:?})"),
        }
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_roam_server_is_detected() {
    timeout(Duration::from_secs(10), async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let err = roam::connect(&addr.to_string(), client_config(None))
            .await
            .unwrap_err();
        assert!(err.is_no_roam_server(), "{err}");
        // And a closed port reads as "no roam server" too.
        drop(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let err = roam::connect(&closed.to_string(), client_config(None))
            .await
            .unwrap_err();
        assert!(err.is_no_roam_server(), "{err}");
    })
    .await
    .expect("test timed out");
}

/// Under paused time: a client that cannot get back expires after its resume
/// timeout, and so does the server's side of the session; backoff keeps the
/// re-dials sparse meanwhile.
#[tokio::test]
async fn unreachable_session_expires_under_paused_clock() {
    let mut server = TestServer::start().await;
    let proxy = Proxy::start(server.addr).await;
    let mut config = client_config(Some(server.key));
    config.proto.session.resume_timeout = Duration::from_secs(120);
    let session = roam::connect(&proxy.addr.to_string(), config)
        .await
        .unwrap();
    let server_session = server.sessions.recv().await.unwrap();
    let mut events = session.events();
    tokio::time::pause();
    let start = tokio::time::Instant::now();
    drop(proxy); // the path is gone for good: re-dials are refused
    let reason = timeout(Duration::from_secs(600), session.closed())
        .await
        .expect("expired");
    assert_eq!(reason, roam::CloseReason::Error(roam_proto::Error::Expired));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(120) && took < Duration::from_secs(130),
        "expired after {took:?}"
    );
    let mut redials = 0;
    while let Ok(ev) = events.try_recv() {
        redials += matches!(ev, SessionEvent::Redialing { .. }) as u32;
    }
    // 120 s at up to 5 s apart (jittered down to 2.5 s): a few dozen, not thousands.
    assert!((20..=60).contains(&redials), "{redials} re-dials");
    // The server's side has no transport either and expires too (its own
    // resume timeout is the 3-day default, so close it instead of waiting).
    assert!(
        server_session.stats().suspended_for.is_some()
            || server_session.stats().state != roam::State::Active
    );
    server.stop();
}
