//! The client of `file_server`: downloads one file over a roam session that
//! survives disconnections and the server moving between hosts, and prints
//! its length and SHA-256.
//!
//! ```text
//! cargo run -p roam-continuation --example file_client -- --connect 127.0.0.1:8080 --server-key <key> --file big.iso --out /tmp/big.iso
//! ```
//! Prints `session ID` first (for `roam cluster move`), `progress BYTES`
//! lines as the download goes (every 4 MiB), then `done BYTES SHA256HEX`.
//! `--pace-ms-per-mib N` slows the download down (N ms per MiB read), for
//! demonstrations and tests that act in the middle of it.

#[path = "support/cli.rs"]
mod cli;

use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = cli::arg("--connect").ok_or("--connect HOST:PORT is required")?;
    let key = cli::arg("--server-key")
        .map(|k| k.parse())
        .transpose()
        .map_err(|e| format!("--server-key: {e}"))?;
    let file = cli::arg("--file").ok_or("--file PATH is required")?;
    let session = roam::connect(&addr, cli::client_config(key)).await?;
    println!("session {}", session.id().ok_or("no session id")?);
    let mut stream = session.open_stream(file.as_bytes())?;
    let mut out = match cli::arg("--out") {
        Some(p) => Some(tokio::fs::File::create(p).await?),
        None => None,
    };
    let mut len = [0u8; 8];
    stream.read_exact(&mut len).await?;
    let len = u64::from_be_bytes(len);
    let mut hash = Sha256::new();
    let mut got = 0u64;
    let mut next_report = 4 << 20;
    let pace = std::time::Duration::from_millis(cli::arg_or("--pace-ms-per-mib", 0));
    let mut next_pause = 1 << 20;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        if let Some(f) = out.as_mut() {
            f.write_all(&buf[..n]).await?;
        }
        got += n as u64;
        if got >= next_report {
            println!("progress {got}");
            next_report += 4 << 20;
        }
        if !pace.is_zero() && got >= next_pause {
            tokio::time::sleep(pace).await;
            next_pause += 1 << 20;
        }
    }
    if got != len {
        return Err(format!("the server announced {len} bytes and sent {got}").into());
    }
    let digest: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    println!("done {got} {digest}");
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), session.close(0, "done")).await;
    Ok(())
}
