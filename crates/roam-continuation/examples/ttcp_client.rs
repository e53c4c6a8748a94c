//! The client of the TTCP-like two-process stream (`support/ttcp.rs`):
//! asks a `ttcp_frontend` for `--bytes` bytes over a roam session, checks
//! every byte against the stream's pattern (a byte lost, repeated or out
//! of place fails it), and reports the bytes and the throughput.
//!
//! ```text
//! cargo build --release -p roam-continuation --example ttcp_producer --example ttcp_frontend --example ttcp_client
//! target/release/examples/ttcp_frontend --listen 127.0.0.1:7100 --state-dir /tmp/ttcp --export lazy --state-bytes 10240
//! target/release/examples/ttcp_client --connect 127.0.0.1:7100 --server-key KEY --bytes 1G
//! ```
//!
//! `KEY` is the one `ttcp_frontend` prints. With two `ttcp_frontend`s as
//! the hosts of a cluster (`--cluster FILE --host NAME --host-key FILE
//! --service-key FILE`, see `support/cluster.rs`), `roam cluster move`
//! moves the client's session, and its producer, mid-stream; the client
//! notices nothing but a short pause.
//!
//! Options: `--bytes N` (a `K`, `M` or `G` suffix is binary; default
//! 64M), `--progress-every N` (default 0: no progress lines). Prints
//! `progress BYTES` lines, then `ok bytes=N seconds=S mb_per_s=R` (MB are
//! 10^6 bytes), or `error: ...` and exits with status 1.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/ttcp.rs"]
mod ttcp;

use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

/// How long the client waits, after the last byte, for a byte too many
/// (a duplicate at the stream's end would arrive in it), in ms.
const TAIL_WAIT_MS: u64 = 300;

/// Prints `error: ...` and exits with status 1.
fn fail(why: String) -> ! {
    println!("error: {why}");
    std::process::exit(1);
}

#[tokio::main]
async fn main() {
    let addr = cli::arg("--connect").unwrap_or_else(|| "127.0.0.1:7100".into());
    let key = cli::arg("--server-key").map(|k| {
        k.parse()
            .unwrap_or_else(|_| fail("--server-key: not a public key".into()))
    });
    let total = cli::arg("--bytes").map_or(64 << 20, |b| {
        ttcp::parse_bytes(&b).unwrap_or_else(|| fail(format!("--bytes {b}: not a byte count")))
    });
    let every: u64 = cli::arg_or("--progress-every", 0);
    let session = match roam::connect(&addr, cli::client_config(key)).await {
        Ok(s) => s,
        Err(e) => fail(format!("connecting to {addr}: {e}")),
    };
    let mut stream = session
        .open_stream(ttcp::meta(total).as_bytes())
        .unwrap_or_else(|e| fail(format!("opening the stream: {e}")));
    // Exported attributes (`roam/attrs`) are not needed here; drain them.
    let s2 = session.clone();
    tokio::spawn(async move {
        while let Ok((mut st, _)) = s2.accept_stream().await {
            let _ = roam_continuation::read_attrs(&mut st).await;
        }
    });
    let started = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    let mut scratch = Vec::new();
    let mut got: u64 = 0;
    let mut next_report = every;
    while got < total {
        let want = (total - got).min(buf.len() as u64) as usize;
        let n = match stream.read(&mut buf[..want]).await {
            Ok(0) => fail(format!("the stream ended at byte {got} of {total}")),
            Ok(n) => n,
            Err(e) => fail(format!("reading at byte {got}: {e}")),
        };
        if let Some((p, was, due)) = ttcp::first_mismatch(got, &buf[..n], &mut scratch) {
            fail(format!(
                "stream byte {p} is {was:#04x} where {due:#04x} was due"
            ));
        }
        got += n as u64;
        if every > 0 && got >= next_report {
            println!("progress {got}");
            next_report += every;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    // Nothing more may come: a byte twice at the end would show here.
    match tokio::time::timeout(Duration::from_millis(TAIL_WAIT_MS), stream.read(&mut buf)).await {
        Err(_) | Ok(Ok(0)) => {}
        Ok(Ok(n)) => fail(format!("{n} bytes after the last of {total}")),
        Ok(Err(e)) => fail(format!("after the last byte: {e}")),
    }
    println!(
        "ok bytes={got} seconds={seconds:.3} mb_per_s={:.1}",
        got as f64 / seconds / 1e6
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), session.close(0, "done")).await;
}
