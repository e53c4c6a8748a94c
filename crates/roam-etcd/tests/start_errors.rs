//! `EtcdServer::start`'s errors. A test binary of its own: it sets
//! `$ROAM_ETCD_BIN`, which would race with tests starting a real etcd.

use std::io;

use roam_etcd::testing::EtcdServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_errors_are_precise() {
    std::env::set_var("ROAM_ETCD_BIN", "/nonexistent/etcd");
    let err = EtcdServer::start().await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::NotFound);
    assert!(
        err.to_string().contains("apt-get install etcd-server"),
        "{err}"
    );

    // A binary that exits at once: its status, promptly.
    std::env::set_var("ROAM_ETCD_BIN", "/bin/false");
    let start = std::time::Instant::now();
    let err = EtcdServer::start().await.unwrap_err();
    assert!(err.to_string().contains("exited at start"), "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
    std::env::remove_var("ROAM_ETCD_BIN");
}
