//! Listener for `stream_server`: checks every chunk and that the stream is
//! contiguous (`--resume continue`) or only jumps forward (`--resume live`).
//!
//! Options: `--connect ADDR`, `--server-key KEY`, `--mount PATH` (default
//! `/radio`), `--resume continue|live`, `--chunks N` (default 1000).
//! Prints `ok chunks=N jumps=J first=F last=L`.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/stream.rs"]
mod stream;

use std::time::Duration;

#[tokio::main]
async fn main() {
    let addr = cli::arg("--connect").unwrap_or_else(|| "127.0.0.1:8000".into());
    let key = cli::arg("--server-key").map(|k| k.parse().expect("--server-key: a public key"));
    let req = stream::Request {
        mount: cli::arg("--mount").unwrap_or_else(|| "/radio".into()),
        on_resume: if cli::arg("--resume").as_deref() == Some("live") {
            stream::OnResume::Live
        } else {
            stream::OnResume::Continue
        },
    };
    let want: u64 = cli::arg_or("--chunks", 1000);
    let session = match roam::connect(&addr, cli::client_config(key)).await {
        Ok(s) => s,
        Err(e) => {
            println!("error connecting: {e}");
            std::process::exit(1);
        }
    };
    let mut s = session
        .open_stream(req.meta().as_bytes())
        .expect("open stream");
    // Exported attributes (`roam/attrs`) are not needed here; drain them.
    let s2 = session.clone();
    tokio::spawn(async move {
        while let Ok((mut st, _)) = s2.accept_stream().await {
            let _ = roam_continuation::read_attrs(&mut st).await;
        }
    });
    match stream::listen(&mut s, &req, want, |l| {
        if l.chunks % 100 == 0 {
            println!("progress {} at chunk {}", l.chunks, l.last);
        }
    })
    .await
    {
        Ok(l) => {
            println!(
                "ok chunks={} jumps={} first={} last={}",
                l.chunks, l.jumps, l.first, l.last
            );
            let _ = tokio::time::timeout(Duration::from_secs(2), session.close(0, "done")).await;
        }
        Err(e) => {
            println!("error: {e}");
            std::process::exit(1);
        }
    }
}
