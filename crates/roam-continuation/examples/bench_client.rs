//! Client of `bench_server`: asks for numbered updates and checks that every
//! index arrives exactly once, in order, whatever happens to the connection
//! or the server in between.
//!
//! Options: `--connect ADDR`, `--server-key KEY` (pin; default trust on
//! first use), `--count N` (default 10000), `--interval-us U` (default 0,
//! flat out), `--report-every N` (a `progress` line every N updates).
//! Prints `ok N` and exits 0 when all N arrived; `error ...` and exit 1 if
//! anything was lost, repeated or reordered.

#[path = "support/bench.rs"]
mod bench;
#[path = "support/cli.rs"]
mod cli;

use std::time::Duration;

use roam_continuation::{read_attrs, ATTRS_META};

#[tokio::main]
async fn main() {
    let addr = cli::arg("--connect").unwrap_or_else(|| "127.0.0.1:7447".into());
    let key = cli::arg("--server-key").map(|k| k.parse().expect("--server-key: a public key"));
    let params = bench::Params {
        count: cli::arg_or("--count", 10_000),
        interval: Duration::from_micros(cli::arg_or("--interval-us", 0)),
    };
    let every: u64 = cli::arg_or("--report-every", 1000);
    let session = match roam::connect(&addr, cli::client_config(key)).await {
        Ok(s) => s,
        Err(e) => {
            println!("error connecting: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "connected {}",
        session.id().map(|i| i.to_string()).unwrap_or_default()
    );
    let mut stream = session
        .open_stream(params.meta().as_bytes())
        .expect("open stream");
    // Exported attributes arrive on their own stream after each resume.
    let s2 = session.clone();
    tokio::spawn(async move {
        while let Ok((mut st, meta)) = s2.accept_stream().await {
            if meta == ATTRS_META {
                match read_attrs(&mut st).await {
                    Ok(a) => {
                        let off = a
                            .get("offset")
                            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                            .map(u64::from_le_bytes);
                        println!("attrs offset={}", off.unwrap_or(0));
                    }
                    Err(e) => println!("attrs unreadable: {e}"),
                }
            }
        }
    });
    let mut events = session.events();
    tokio::spawn(async move {
        while let Ok(ev) = events.recv().await {
            if let roam::SessionEvent::Resumed { suspended_for, .. } = ev {
                println!("resumed after {} ms", suspended_for.as_millis());
            }
        }
    });
    let result = bench::read_updates(&mut stream, |n| {
        if every > 0 && n % every == 0 {
            println!("progress {n}");
        }
    })
    .await;
    match result {
        Ok(n) if n == params.count => {
            println!("ok {n}");
            let _ = tokio::time::timeout(Duration::from_secs(2), session.close(0, "done")).await;
        }
        Ok(n) => {
            println!("error: stream ended after {n} of {} updates", params.count);
            std::process::exit(1);
        }
        Err(e) => {
            println!("error: {e}");
            std::process::exit(1);
        }
    }
}
