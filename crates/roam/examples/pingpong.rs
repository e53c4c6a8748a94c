//! 1-byte ping-pong latency through any TCP path (a relay, a forward, socat),
//! for comparing them in one run.
//!
//! ```text
//! pingpong echo 127.0.0.1:7000            # a TCP echo server
//! pingpong ping 127.0.0.1:7001 2000 [1]   # round trips of N bytes: median and p99
//! pingpong bulk 127.0.0.1:7001 200        # MiB echoed: throughput each way
//! ```

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Round trips before measuring.
const WARM_UP: usize = 50;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let addr = args.get(2).map(String::as_str).unwrap_or("127.0.0.1:7000");
    match args.get(1).map(String::as_str) {
        Some("echo") => {
            let l = TcpListener::bind(addr).await?;
            loop {
                let (mut s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
        Some("ping") => {
            let n: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2000);
            let size: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(1);
            let mut s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            let out = vec![0x5au8; size];
            let mut back = vec![0u8; size];
            let mut times = Vec::with_capacity(n);
            for i in 0..WARM_UP + n {
                let t = Instant::now();
                s.write_all(&out).await?;
                s.read_exact(&mut back).await?;
                assert_eq!(back, out, "echo differs");
                if i >= WARM_UP {
                    times.push(t.elapsed());
                }
            }
            times.sort();
            let q = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            println!(
                "{addr}: {n} round trips of {size} B: median {:.1} us, p99 {:.1} us",
                us(q(0.5)),
                us(q(0.99))
            );
            Ok(())
        }
        Some("bulk") => {
            let mib: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(200);
            let s = TcpStream::connect(addr).await?;
            let (mut r, mut w) = s.into_split();
            let t = Instant::now();
            let writer = tokio::spawn(async move {
                let chunk = vec![0x5au8; 64 * 1024];
                for _ in 0..mib * 16 {
                    w.write_all(&chunk).await?;
                }
                w.shutdown().await
            });
            let mut buf = vec![0u8; 64 * 1024];
            let mut got = 0;
            while got < mib << 20 {
                let n = r.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                got += n;
            }
            writer.await.expect("writer")?;
            let secs = t.elapsed().as_secs_f64();
            println!(
                "{addr}: {mib} MiB echoed in {secs:.2} s: {:.0} MiB/s each way",
                got as f64 / secs / (1 << 20) as f64
            );
            Ok(())
        }
        _ => {
            eprintln!("usage: pingpong echo ADDR | ping ADDR [N] [SIZE] | bulk ADDR [MIB]");
            Ok(())
        }
    }
}
