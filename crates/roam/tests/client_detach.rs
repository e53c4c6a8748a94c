//! A client session taken out of its process (`SessionHandle::detach`) and
//! re-attached from its blob with `roam::resume`: mid-transfer, both ways,
//! with the server writing while the client is away; every byte checked.

mod common;

use std::time::Duration;

use common::{client_config, fill_pattern, pattern_byte, TestServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Writes pattern bytes `from..to` of `seed`.
async fn write_range<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, seed: u64, from: u64, to: u64) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut off = from;
    while off < to {
        let n = (to - off).min(buf.len() as u64) as usize;
        fill_pattern(seed, off, &mut buf[..n]);
        w.write_all(&buf[..n]).await.expect("write");
        off += n as u64;
    }
}

/// Reads and checks pattern bytes from `from` until `to` (or the end of the
/// stream when `to` is `None`); returns the offset reached.
async fn read_range<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    seed: u64,
    from: u64,
    to: Option<u64>,
) -> u64 {
    let mut buf = vec![0u8; 16 * 1024];
    let mut off = from;
    while to.is_none_or(|t| off < t) {
        let want = to.map_or(buf.len() as u64, |t| (t - off).min(buf.len() as u64)) as usize;
        let n = r.read(&mut buf[..want]).await.expect("read");
        if n == 0 {
            break;
        }
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(
                *b,
                pattern_byte(seed, off + k as u64),
                "byte {}",
                off + k as u64
            );
        }
        off += n as u64;
    }
    off
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_client_session_resumes_from_its_blob_with_every_byte() {
    let mut server = TestServer::start().await;
    let config = client_config(Some(server.key));
    let addr = server.addr.to_string();
    let len: u64 = 4 << 20;
    let session = roam::connect(&addr, config.clone()).await.unwrap();
    let mut stream = session.open_stream(format!("7 {len}").as_bytes()).unwrap();
    let id = stream.id();

    // Half of the upload and a quarter of the download before the detach.
    write_range(&mut stream, 7, 0, len / 2).await;
    let got = read_range(&mut stream, 1007, 0, Some(len / 4)).await;
    let detached = session.detach().await.expect("detach");
    assert!(
        stream.write_all(b"x").await.is_err(),
        "a detached session's stream refuses writes"
    );
    drop(stream);
    drop(session);

    // The server keeps writing into the suspended session meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let blob = detached.blob.clone();
    let session = tokio::time::timeout(
        Duration::from_secs(10),
        roam::resume(&addr, config.clone(), detached, Duration::from_millis(300)),
    )
    .await
    .expect("resume in time")
    .expect("resume");
    let stream = session.stream(id).expect("the stream survives the detach");
    let (mut r, mut w) = tokio::io::split(stream);
    let ((), rest_down) = tokio::join!(
        async {
            write_range(&mut w, 7, len / 2, len).await;
            w.shutdown().await.expect("finish");
        },
        read_range(&mut r, 1007, got, None),
    );
    assert_eq!(rest_down, len, "every byte of the download, once");
    common::check_server_reports(&mut server, 1, len).await;

    // The same blob again: the server has moved on (the session resumed
    // elsewhere since), so its stale resume is refused, never merged.
    let stale = roam::Detached::new(blob, Vec::new(), Vec::new());
    let again = tokio::time::timeout(
        Duration::from_secs(15),
        roam::resume(&addr, config, stale, Duration::ZERO),
    )
    .await
    .expect("a stale resume ends");
    assert!(again.is_err(), "a replayed continuation must not resume");
    // ... and the live session is untouched by it.
    for t in common::run_transfer(&session, 1, 64 << 10).await {
        assert_eq!(t.await.unwrap(), Ok(64 << 10));
    }
    common::check_server_reports(&mut server, 1, 64 << 10).await;
    session.close(0, "").await;
    server.stop();
}

#[tokio::test]
async fn a_blob_that_is_not_a_client_continuation_is_refused_precisely() {
    let server = TestServer::start().await;
    let config = client_config(Some(server.key));
    let junk = roam::Detached::new(b"not a continuation".to_vec(), Vec::new(), Vec::new());
    let err = roam::resume(&server.addr.to_string(), config, junk, Duration::ZERO)
        .await
        .expect_err("junk must not resume");
    assert!(matches!(err, roam::Error::Restore(_)), "{err}");
    assert!(err.to_string().contains("cannot restore"), "{err}");
}
