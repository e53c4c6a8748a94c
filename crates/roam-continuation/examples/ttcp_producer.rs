//! The back-end of the TTCP-like two-process stream (`support/ttcp.rs`):
//! a member of the service set whose root is the front-end
//! (`ttcp_frontend`, or the host of `tests/service_ttcp.rs`), which starts
//! it; not run by hand.
//!
//! ```text
//! ttcp_producer CONTROL_SOCKET CHANNEL_DIR TOTAL EXPORT STATE_BYTES
//! ```
//!
//! It joins the front-end on `CONTROL_SOCKET` (role `producer`), connects
//! `CHANNEL_DIR/data.sock` (channel 1, which it writes) and writes bytes
//! `0 .. TOTAL` of the stream's pattern in chunks of 8 KiB. After each
//! chunk it exports its position, its snapshot padded to `STATE_BYTES`
//! (at least 8): `EXPORT` is `eager` (`Member::export`, the snapshot
//! copied at every export), `lazy` (`Member::export_owned`: it fills one
//! buffer while the other is the exported snapshot, and the export swaps
//! them) or `never` (a restart replays from byte 0, and what the
//! front-end already has is discarded). Then it waits until the
//! front-end ends it (`END`: the set moved away) or closes its control
//! socket, and exits.
//!
//! Deterministic: what it writes depends only on its snapshot, so a
//! restart from its last export writes again the same bytes, and the
//! set's channel discards those the front-end has.

#[path = "support/ttcp.rs"]
mod ttcp;

use std::path::Path;
use std::time::Duration;

use roam_continuation::service_set::join;
use roam_service::Interval;
use tokio::net::UnixStream;
use ttcp::Export;

/// Connects `path`, retrying for up to 10 s (the front-end binds it
/// before it starts this process, so a retry is rare).
async fn connect(path: &Path) -> UnixStream {
    for _ in 0..1000 {
        if let Ok(s) = UnixStream::connect(path).await {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("ttcp_producer: {}: nobody listens", path.display());
    std::process::exit(3);
}

/// Exits with status 1 after naming what failed.
fn die(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("ttcp_producer: {what}: {e}");
    std::process::exit(1);
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, control, dir, total, export, state_bytes] = &args[..] else {
        eprintln!("usage: ttcp_producer CONTROL_SOCKET CHANNEL_DIR TOTAL EXPORT STATE_BYTES");
        std::process::exit(2);
    };
    let total: u64 = total.parse().unwrap_or_else(|e| die("TOTAL", e));
    let export = Export::parse(export).unwrap_or_else(|| die("EXPORT", "not eager, lazy or never"));
    let state_bytes: usize = state_bytes
        .parse::<usize>()
        .unwrap_or_else(|e| die("STATE_BYTES", e))
        .max(8);
    let mut control = UnixStream::connect(control)
        .await
        .unwrap_or_else(|e| die("control socket", e));
    let member = join(&mut control, ttcp::ROLE, ttcp::limits())
        .await
        .unwrap_or_else(|e| die("join", e));
    member
        .add_writer(ttcp::DATA, connect(&Path::new(dir).join("data.sock")).await)
        .unwrap_or_else(|e| die("data channel", e));
    let mut pos = member
        .snapshot()
        .and_then(|s| s.get(..8).map(|b| b.try_into().unwrap_or([0; 8])))
        .map_or(0, u64::from_be_bytes);
    member
        .ready(&mut control)
        .await
        .unwrap_or_else(|e| die("ready", e));
    let m = member.clone();
    tokio::spawn(async move {
        if let Err(e) = m.serve_control(control).await {
            die("control", e);
        }
        // END, or the front-end closed the socket: the set is elsewhere.
        std::process::exit(0);
    });
    // The state the eager export copies, and the lazy export's spare
    // buffer (the other one is the exported snapshot).
    let mut state = vec![0u8; state_bytes];
    let mut chunk = vec![0u8; ttcp::CHUNK];
    while pos < total {
        let n = (total - pos).min(ttcp::CHUNK as u64) as usize;
        ttcp::fill(pos, &mut chunk[..n]);
        member
            .write_all(ttcp::DATA, &chunk[..n])
            .await
            .unwrap_or_else(|e| die("write", e));
        pos += n as u64;
        match export {
            Export::Eager => {
                state[..8].copy_from_slice(&pos.to_be_bytes());
                member
                    .export(&state, Interval::Deterministic)
                    .await
                    .unwrap_or_else(|e| die("export", e));
            }
            Export::Lazy => {
                state[..8].copy_from_slice(&pos.to_be_bytes());
                let snapshot = std::mem::take(&mut state);
                state = member
                    .export_owned(snapshot, Interval::Deterministic)
                    .await
                    .unwrap_or_else(|e| die("export", e))
                    .unwrap_or_else(|| vec![0u8; state_bytes]);
                // A restarted member's first spare is its imported
                // snapshot, whatever its size.
                state.resize(state_bytes, 0);
            }
            Export::Never => {}
        }
    }
    // The whole stream is written: wait for the front-end's END.
    std::future::pending::<()>().await;
}
