//! A back-end process of a service set carried in a managed session's
//! continuation (`tests/service_session.rs`): it reads numbered requests
//! from its front-end, appends one line per request to a ledger file (its
//! effect outside the set) and answers each.
//!
//! ```text
//! service_ledger CONTROL_SOCKET CHANNEL_DIR LEDGER THINK_MS [LOG_CAP]
//! ```
//!
//! It joins the front-end (the set's root) on `CONTROL_SOCKET` (role
//! `ledger`), connects `CHANNEL_DIR/req.sock` (channel 1, requests, which
//! it reads) and `CHANNEL_DIR/rep.sock` (channel 2, replies, which it
//! writes). A request is 16 bytes: `seq:u64 value:u64`, big-endian; its
//! reply is `seq:u64 reply(seq, value):u64`. For each request it appends
//! `seq value\n` to `LEDGER`, answers, waits `THINK_MS` and exports its
//! state: the next request number and the ledger's length. `LOG_CAP`
//! (bytes, default 16 MiB) caps its request channel's log: at 0, every cut
//! taken between reading a request and exporting is refused (the test of a
//! back-end refusing its part mid-move). A `LEDGER` it cannot open makes it
//! exit with an error before it is ready (the test of a back-end that
//! fails to start at a move's destination).
//!
//! Exactly once: a process restarted from its part first truncates the
//! ledger to the length its snapshot recorded (lines appended after its
//! last export are for requests it reads again from its log), then
//! replays; its replayed replies the front-end already has are discarded.
//! The ledger's append runs with no await between the member's
//! `running()` and the write, on a one-thread runtime, so no freeze can
//! fall between them.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use roam_continuation::service_set::join;
use roam_service::{ChannelId, Interval, Limits};
use tokio::net::UnixStream;

/// Channel 1: the front-end's requests, read here.
pub const REQUESTS: ChannelId = ChannelId(1);
/// Channel 2: the replies, written here.
pub const REPLIES: ChannelId = ChannelId(2);

/// The reply to request `seq` carrying `value` (the test checks it).
pub fn reply(seq: u64, value: u64) -> u64 {
    value.rotate_left(17) ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

async fn connect(path: &Path) -> UnixStream {
    for _ in 0..1000 {
        if let Ok(s) = UnixStream::connect(path).await {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{}: nobody listens", path.display());
}

fn snapshot(next: u64, ledger_len: u64) -> Vec<u8> {
    let mut s = next.to_be_bytes().to_vec();
    s.extend_from_slice(&ledger_len.to_be_bytes());
    s
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (control, dir, ledger, think, cap) = match &args[..] {
        [_, control, dir, ledger, think] => (control, dir, ledger, think, None),
        [_, control, dir, ledger, think, cap] => (control, dir, ledger, think, Some(cap)),
        _ => {
            eprintln!("usage: service_ledger CONTROL_SOCKET CHANNEL_DIR LEDGER THINK_MS [LOG_CAP]");
            std::process::exit(2);
        }
    };
    let think = Duration::from_millis(think.parse().expect("THINK_MS"));
    let mut limits = Limits::default();
    if let Some(cap) = cap {
        limits.log_bytes = cap.parse().expect("LOG_CAP");
    }
    let dir = Path::new(dir);
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let member = join(&mut control, "ledger", limits).await.expect("join");
    member
        .add_reader(REQUESTS, connect(&dir.join("req.sock")).await)
        .expect("requests");
    member
        .add_writer(REPLIES, connect(&dir.join("rep.sock")).await)
        .expect("replies");
    let mut file = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(ledger)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("ledger: cannot open {ledger}: {e}");
            std::process::exit(3);
        }
    };
    let (mut next, mut ledger_len) = match member.snapshot() {
        Some(s) => {
            let next = u64::from_be_bytes(s[..8].try_into().expect("snapshot"));
            let len = u64::from_be_bytes(s[8..16].try_into().expect("snapshot"));
            (next, len)
        }
        None => {
            // A fresh start exports at once, so every part it gives has a
            // snapshot naming the ledger's length.
            let len = file.metadata().expect("ledger").len();
            member
                .export(&snapshot(0, len), Interval::Deterministic)
                .await
                .expect("first export");
            (0, len)
        }
    };
    member.ready(&mut control).await.expect("ready");
    let m = member.clone();
    tokio::spawn(async move {
        if let Err(e) = m.serve_control(control).await {
            eprintln!("ledger: control: {e}");
            std::process::exit(1);
        }
        // END: the set moved away (its part is in the session's cut).
        std::process::exit(0);
    });
    // A restarted process waits for its thaw (the source's back-end has
    // ended by then) before it touches the ledger.
    member.running().await;
    file.set_len(ledger_len).expect("truncate the ledger");
    let mut req = [0u8; 16];
    loop {
        let mut got = 0;
        while got < req.len() {
            let n = member.read(REQUESTS, &mut req[got..]).await.expect("read");
            if n == 0 {
                return;
            }
            got += n;
        }
        let seq = u64::from_be_bytes(req[..8].try_into().expect("seq"));
        let value = u64::from_be_bytes(req[8..].try_into().expect("value"));
        assert_eq!(seq, next, "requests in order");
        member.running().await;
        let line = format!("{seq} {value}\n");
        file.write_all(line.as_bytes()).expect("ledger write");
        ledger_len += line.len() as u64;
        let mut out = seq.to_be_bytes().to_vec();
        out.extend_from_slice(&reply(seq, value).to_be_bytes());
        member.write_all(REPLIES, &out).await.expect("reply");
        next += 1;
        if !think.is_zero() {
            tokio::time::sleep(think).await;
        }
        member
            .export(&snapshot(next, ledger_len), Interval::Deterministic)
            .await
            .expect("export");
    }
}
