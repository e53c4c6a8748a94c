//! A service set carried in a managed session's continuation when a
//! cluster moves the session (issue 15; `docs/SERVICE.md`, "A set carried
//! in a session's continuation").
//!
//! A real roam client sends numbered requests over its managed session to
//! a front-end (the set's root, inside a cluster host); the front-end
//! forwards each over a Unix socket to its back-end, a child process
//! (`examples/service_ledger.rs`) that appends a line to a ledger file (its
//! effect) and answers. The cluster moves the session between two hosts
//! mid-stream: the front-end saves the set's cut into the session's
//! continuation, the back-end ends, and the destination's resume routine
//! restarts a back-end from its part. What the user cares about: every
//! reply arrives once, in order, with the right value, and the ledger holds
//! each request's effect exactly once; a destination that cannot run the
//! back-end, or whose back-end fails as it starts (it is started, frozen,
//! before the move commits), refuses the move before it commits and the
//! session goes on at its source, nothing lost, no back-end left behind;
//! a back-end that refuses its part mid-move calls the move off at once;
//! one stuck on a request (the front-end waiting for its reply) calls it off
//! at the save's bound instead of the move's freeze timeout;
//! a destination's back-end killed after its staging, before its thaw, is
//! started again from the same cut once the move has committed.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::set_front::{self, alive, Cluster, Front};
use common::{bounded, wait_until};
use roam::RoamStream;
use roam_continuation::service_set::{Member, SessionSet, DEFAULT_SAVE_TIMEOUT};
use roam_continuation::{ManagedSession, MoveError, MoveReport};
use roam_service::Interval;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Child;
use tokio::sync::oneshot;

#[path = "../examples/service_ledger.rs"]
#[allow(dead_code, unreachable_pub)]
mod ledger;

/// The value request `seq` carries.
fn value(seq: u64) -> u64 {
    seq.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5555
}

/// The front-end's loop for one session: requests from the client go to
/// the back-end, replies come back; at a freeze request (between requests)
/// the set's cut goes into the continuation and the session suspends.
async fn serve(
    front: Arc<Front>,
    session: ManagedSession,
    mut stream: RoamStream,
    mut set: SessionSet,
    mut child: Child,
    mut pending: Vec<u8>,
) {
    let mut buf = vec![0u8; 64];
    loop {
        tokio::select! {
            biased;
            _ = session.freeze_requested() => {
                match front.save(&session, set, &mut child, &pending).await {
                    Ok(()) => {
                        let _ = session.suspend(set_front::continuation(stream)).await;
                        return;
                    }
                    Err(s) => set = s,
                }
            }
            r = stream.read(&mut buf) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        // The client is done: so is the set.
                        let _ = child.kill().await;
                        return;
                    }
                    Ok(n) => n,
                };
                pending.extend_from_slice(&buf[..n]);
                while pending.len() >= 16 {
                    let req: Vec<u8> = pending.drain(..16).collect();
                    // Not a quiescent point: a move that asks meanwhile
                    // waits for the reply at most the save's bound, then
                    // is declined (a stuck back-end).
                    let asked = ask(set.root(), &req);
                    let reply = match session
                        .busy("the reply of back-end ledger", DEFAULT_SAVE_TIMEOUT, asked)
                        .await
                    {
                        Ok(reply) => reply,
                        Err(e) => {
                            // The back-end is gone (killed): its state
                            // since its last export went with it, so the
                            // session cannot go on here or anywhere; it
                            // ends, every reply sent exact. A move waiting
                            // for it is called off.
                            eprintln!("back-end ledger is gone ({e}); the session ends");
                            session.decline_freeze(format!("back-end ledger is gone: {e}"));
                            let _ = child.kill().await;
                            return;
                        }
                    };
                    if stream.write_all(&reply).await.is_err() {
                        return;
                    }
                    set.root().export(&reply[..8], Interval::Deterministic)
                        .await
                        .expect("root export");
                }
            }
        }
    }
}

/// One request to the back-end and its reply; an error if the back-end's
/// channels failed or closed.
async fn ask(root: &Member, req: &[u8]) -> std::io::Result<[u8; 16]> {
    root.write_all(ledger::REQUESTS, req).await?;
    let mut reply = [0u8; 16];
    let mut got = 0;
    while got < 16 {
        match root.read(ledger::REPLIES, &mut reply[got..]).await? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            k => got += k,
        }
    }
    Ok(reply)
}

/// How a host's back-end behaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    /// It runs.
    Ok,
    /// The host has no back-end program.
    Missing,
    /// The program exists but exits as it starts (its ledger cannot be
    /// opened here).
    FailsToStart,
    /// It runs with a request log cap of 0: it refuses its part whenever
    /// it has read a request it has not exported yet.
    RefusesParts,
}

/// Two hosts `h0`, `h1` on loopback, host `i`'s back-end as `backends[i]`.
async fn start_cluster(backends: [Backend; 2], think_ms: u64) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    set_front::start_cluster(
        dir,
        |f, s, st, set, c, p| Box::pin(serve(f, s, st, set, c, p)),
        |i, work| {
            let backend = if backends[i] == Backend::Missing {
                root.join("no-such-back-end")
            } else {
                common::example("service_ledger")
            };
            let ledger = if backends[i] == Backend::FailsToStart {
                root.join("no-such-dir").join("ledger")
            } else {
                root.join("ledger")
            };
            let mut args = vec![ledger.into(), think_ms.to_string().into()];
            if backends[i] == Backend::RefusesParts {
                args.push("0".into());
            }
            Front::new(backend, "ledger", work, args)
        },
    )
    .await
}

/// The ledger file both hosts' back-ends append to (like a shared store).
fn ledger(c: &Cluster) -> PathBuf {
    c.dir.path().join("ledger")
}

/// A client sending `n` numbered requests (a short pause every 8) and
/// checking each reply: its number (in order, none twice) and its value.
struct Client {
    session: roam::SessionHandle,
    replies: Arc<AtomicU64>,
    /// The reader's first error, as soon as it has one.
    error: Arc<Mutex<Option<String>>>,
    /// The stream's write half once every request is sent: held open (the
    /// front-end ends its session when the client closes it) until the
    /// client is dropped or its session closed.
    _writer: Arc<Mutex<Option<tokio::io::WriteHalf<RoamStream>>>>,
    task: tokio::task::JoinHandle<Result<u64, String>>,
}

async fn client(c: &Cluster, host: &str, n: u64) -> Client {
    client_pausing(c, host, n, None).await
}

/// A [`client`] that, given `pause` `(k, go)`, sends its first `k`
/// requests, then waits for `go` before it sends the rest.
async fn client_pausing(
    c: &Cluster,
    host: &str,
    n: u64,
    pause: Option<(u64, oneshot::Receiver<()>)>,
) -> Client {
    let (session, stream) = c.connect(host).await;
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        let mut pause = pause;
        for seq in 0..n {
            if pause.as_ref().is_some_and(|(k, _)| *k == seq) {
                let (_, go) = pause.take().expect("checked");
                go.await
                    .map_err(|_| "the test never let the client go on")?;
            }
            let mut req = seq.to_be_bytes().to_vec();
            req.extend_from_slice(&value(seq).to_be_bytes());
            w.write_all(&req).await.map_err(|e| e.to_string())?;
            if seq % 8 == 7 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        Ok::<_, String>(w)
    });
    let replies = Arc::new(AtomicU64::new(0));
    let seen = replies.clone();
    let error = Arc::new(Mutex::new(None));
    let failed = error.clone();
    let held = Arc::new(Mutex::new(None));
    let hold = held.clone();
    let task = tokio::spawn(async move {
        let r = read_replies(&mut r, n, &seen).await;
        if let Err(e) = &r {
            *failed.lock().unwrap() = Some(e.clone());
        }
        r?;
        let w = writer.await.map_err(|e| e.to_string())??;
        *hold.lock().unwrap() = Some(w);
        Ok(n)
    });
    Client {
        session,
        replies,
        error,
        _writer: held,
        task,
    }
}

async fn read_replies(
    r: &mut tokio::io::ReadHalf<RoamStream>,
    n: u64,
    seen: &AtomicU64,
) -> Result<(), String> {
    let mut reply = [0u8; 16];
    for seq in 0..n {
        r.read_exact(&mut reply)
            .await
            .map_err(|e| format!("reply {seq}: {e}"))?;
        let got = u64::from_be_bytes(reply[..8].try_into().unwrap());
        let v = u64::from_be_bytes(reply[8..].try_into().unwrap());
        if got != seq {
            return Err(format!("reply {seq} came as number {got}"));
        }
        if v != ledger::reply(seq, value(seq)) {
            return Err(format!("reply {seq} has the wrong value"));
        }
        seen.store(seq + 1, Ordering::SeqCst);
    }
    // Nothing more may come: a reply twice would show here.
    match tokio::time::timeout(Duration::from_millis(300), r.read(&mut reply)).await {
        Err(_) => {}
        Ok(Ok(0)) => {}
        Ok(other) => return Err(format!("after the last reply: {other:?}")),
    }
    Ok(())
}

/// Waits (at most 30 s) for `at_least` replies; fails at once with the
/// client's error if it has one.
async fn wait_replies(cl: &Client, at_least: u64) {
    let r = cl.replies.clone();
    let error = cl.error.clone();
    wait_until(Duration::from_secs(30), "replies", move || {
        if let Some(e) = error.lock().unwrap().as_ref() {
            panic!("the client: {e}");
        }
        r.load(Ordering::SeqCst) >= at_least
    })
    .await;
}

/// The ledger holds `n` lines, request `i`'s effect on line `i`, each once.
fn assert_ledger(path: &std::path::Path, n: u64) {
    let text = std::fs::read_to_string(path).expect("ledger");
    let lines: Vec<&str> = text.lines().collect();
    let want: Vec<String> = (0..n).map(|i| format!("{i} {}", value(i))).collect();
    if lines != want {
        let first = lines
            .iter()
            .zip(&want)
            .position(|(a, b)| *a != b)
            .unwrap_or(lines.len().min(want.len()));
        panic!(
            "ledger: {} lines for {n} requests; first difference at line {first}: {:?}",
            lines.len(),
            lines.get(first)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_moves_a_session_with_its_back_end_and_every_effect_happens_once() {
    bounded(Duration::from_secs(180), "test", async {
        let c = start_cluster([Backend::Ok, Backend::Ok], 2).await;
        const N: u64 = 1500;
        const MOVES: u64 = 6;
        let cl = client(&c, "h0", N).await;
        let id = cl.session.id().unwrap();
        let mut at = 0;
        let mut reports: Vec<MoveReport> = Vec::new();
        for round in 1..=MOVES {
            wait_replies(&cl, round * (N / (MOVES + 2))).await;
            let to = 1 - at;
            let report = c.nodes[at]
                .host
                .move_session(id, &c.nodes[to].name)
                .await
                .unwrap_or_else(|e| panic!("move {round}: {e}"));
            assert_eq!(report.revision, round);
            at = to;
            wait_until(Duration::from_secs(10), "the destination serves it", || {
                c.holder(id) == Some(at)
            })
            .await;
            reports.push(report);
        }
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&ledger(&c), N);
        let restored: usize = c
            .nodes
            .iter()
            .map(|n| n.data.restored.load(Ordering::SeqCst))
            .sum();
        assert_eq!(restored as u64, MOVES, "one restart from a cut per move");
        let staged: usize = c
            .nodes
            .iter()
            .map(|n| n.data.staged_runs.load(Ordering::SeqCst))
            .sum();
        assert_eq!(
            staged as u64, MOVES,
            "each destination ran the back-end it started before the commit"
        );
        let cuts: Vec<usize> = c
            .nodes
            .iter()
            .flat_map(|n| n.data.cuts.lock().unwrap().clone())
            .collect();
        assert_eq!(cuts.len() as u64, MOVES);
        let frozen: Vec<u128> = reports.iter().map(|r| r.frozen.as_micros()).collect();
        let total: Vec<u128> = reports.iter().map(|r| r.total.as_micros()).collect();
        let transfer: Vec<usize> = reports.iter().map(|r| r.transfer_bytes).collect();
        println!(
            "moves {MOVES}: frozen µs {frozen:?}, total µs {total:?}, cut bytes {cuts:?}, transfer bytes {transfer:?}"
        );
        assert_eq!(
            c.backend_pids().len() as u64,
            MOVES + 1,
            "one back-end per incarnation"
        );
        c.close_and_reap(&cl.session).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_cannot_run_the_back_end_leaves_the_session_at_its_source() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster([Backend::Ok, Backend::Missing], 2).await;
        const N: u64 = 600;
        let mut cl = client(&c, "h0", N).await;
        refused_and_served_at_source(&c, &mut cl, N, &["no back-end program"]).await;
        assert_eq!(c.nodes[1].data.starts.load(Ordering::SeqCst), 0);
        let _ = tokio::time::timeout(Duration::from_secs(5), cl.session.close(0, "done")).await;
        c.shutdown().await;
    })
    .await;
}

/// Once a quarter of the client's `n` requests are answered, asks h0 to
/// move its session to h1 and expects a refusal whose text holds every
/// one of `says`; then the session goes on at h0: every reply arrives once
/// and in order, the ledger holds each line once, and h0 restarted its set
/// from the cut it saved, once.
async fn refused_and_served_at_source(c: &Cluster, cl: &mut Client, n: u64, says: &[&str]) {
    let id = cl.session.id().unwrap();
    wait_replies(cl, n / 4).await;
    let started = Instant::now();
    match c.nodes[0].host.move_session(id, "h1").await {
        Err(MoveError::Refused(r)) => {
            let why = r.to_string();
            assert!(says.iter().all(|s| why.contains(s)), "refusal: {why}");
        }
        other => panic!("the move should be refused: {other:?}"),
    }
    println!("refused after {:?}", started.elapsed());
    wait_until(Duration::from_secs(10), "the source serves it", || {
        c.holder(id) == Some(0)
    })
    .await;
    let before = cl.replies.load(Ordering::SeqCst);
    wait_replies(cl, before + 50).await;
    let got = (&mut cl.task)
        .await
        .unwrap()
        .expect("every reply once, in order");
    assert_eq!(got, n);
    assert_ledger(&ledger(c), n);
    assert_eq!(
        c.nodes[0].data.restored.load(Ordering::SeqCst),
        1,
        "the source restarted its set from the cut it saved"
    );
}

/// The move was called off (declined), in words containing each of `says`.
fn assert_declined<T: std::fmt::Debug>(result: Result<T, MoveError>, says: &[&str]) {
    match result {
        Err(MoveError::Declined(why)) => {
            assert!(says.iter().all(|w| why.contains(w)), "declined: {why}");
        }
        other => panic!("the move should be called off: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_end_that_fails_to_start_at_the_destination_refuses_the_move_before_the_commit() {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster([Backend::Ok, Backend::FailsToStart], 2).await;
        const N: u64 = 600;
        let mut cl = client(&c, "h0", N).await;
        refused_and_served_at_source(&c, &mut cl, N, &["starting the back-end", "ledger"]).await;
        let b = &c.nodes[1].data;
        assert_eq!(b.starts.load(Ordering::SeqCst), 1, "one start tried at h1");
        assert_eq!(b.restored.load(Ordering::SeqCst), 0);
        assert_eq!(b.staged_runs.load(Ordering::SeqCst), 0);
        let pids = b.pids.lock().unwrap().clone();
        assert_eq!(pids.len(), 1, "h1 started one back-end process");
        for pid in pids {
            wait_until(Duration::from_secs(5), "h1's back-end gone", move || {
                !alive(pid)
            })
            .await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), cl.session.close(0, "done")).await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_end_refusing_its_part_mid_move_calls_the_move_off_at_once() {
    bounded(Duration::from_secs(120), "test", async {
        // 150 ms between each reply and the back-end's export: the move's
        // freeze (between two of the front-end's requests) finds a request
        // read and not exported, over the log cap of 0, and the back-end
        // refuses its part.
        let c = start_cluster([Backend::RefusesParts, Backend::Ok], 150).await;
        const N: u64 = 30;
        let cl = client(&c, "h0", N).await;
        let id = cl.session.id().unwrap();
        wait_replies(&cl, 5).await;
        let started = Instant::now();
        let result = c.nodes[0].host.move_session(id, "h1").await;
        let took = started.elapsed();
        assert_declined(result, &["back-end ledger refused its part"]);
        println!("called off after {took:?}");
        assert!(
            took < Duration::from_secs(3),
            "called off after {took:?}, not at once"
        );
        wait_until(Duration::from_secs(10), "the source serves it", || {
            c.holder(id) == Some(0)
        })
        .await;
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&ledger(&c), N);
        assert_eq!(c.nodes[1].data.starts.load(Ordering::SeqCst), 0);
        assert!(
            c.nodes[0].data.cuts.lock().unwrap().is_empty(),
            "no cut saved"
        );
        assert_eq!(
            c.nodes[0].data.restored.load(Ordering::SeqCst),
            0,
            "the set kept running: nothing restarted"
        );
        let _ = tokio::time::timeout(Duration::from_secs(5), cl.session.close(0, "done")).await;
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_end_killed_mid_move_calls_the_move_off_at_once() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    bounded(Duration::from_secs(120), "test", async {
        let c = Arc::new(start_cluster([Backend::Ok, Backend::Ok], 2).await);
        const N: u64 = 200;
        let cl = client(&c, "h0", N).await;
        let id = cl.session.id().unwrap();
        // Every request answered: the front-end waits for the client, so
        // the move's freeze finds it at once and it saves the set.
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        let pids = c.nodes[0].data.pids.lock().unwrap().clone();
        let [pid] = pids[..] else {
            panic!("one back-end at h0: {pids:?}")
        };
        let pid = Pid::from_raw(pid as i32);
        // Stopped, the back-end cannot answer the save's FREEZE; killed
        // while the save waits for it, it dies in the middle of the move.
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
        let started = Instant::now();
        let mover = {
            let c = c.clone();
            tokio::spawn(async move { c.nodes[0].host.move_session(id, "h1").await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !mover.is_finished(),
            "the move waits for the stopped back-end"
        );
        let killed = Instant::now();
        kill(pid, Signal::SIGKILL).expect("SIGKILL");
        let result = mover.await.unwrap();
        let (took, after_kill) = (started.elapsed(), killed.elapsed());
        assert_declined(
            result,
            &["back-end ledger did not freeze: member ledger is gone"],
        );
        println!("called off {after_kill:?} after the kill ({took:?} after the move began)");
        assert!(
            after_kill < Duration::from_secs(3),
            "called off {after_kill:?} after the kill, not at once"
        );
        assert_eq!(c.nodes[1].data.starts.load(Ordering::SeqCst), 0);
        assert!(
            c.nodes[0].data.cuts.lock().unwrap().is_empty(),
            "no cut saved"
        );
        assert_eq!(c.holder(id), Some(0), "the session is still at its source");
        // Every reply was exact and once (checked by the client), and so
        // is every effect.
        assert_ledger(&ledger(&c), N);
        let _ = tokio::time::timeout(Duration::from_secs(5), cl.session.close(0, "done")).await;
        let Ok(c) = Arc::try_unwrap(c) else {
            panic!("the cluster is still shared")
        };
        c.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_back_end_calls_the_move_off_within_the_save_bound_and_serves_on_once_continued()
{
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster([Backend::Ok, Backend::Ok], 2).await;
        const N: u64 = 400;
        const FIRST: u64 = 150;
        let (go, gate) = oneshot::channel();
        let cl = client_pausing(&c, "h0", N, Some((FIRST, gate))).await;
        let id = cl.session.id().unwrap();
        // The first requests all answered: the front-end waits for the
        // client, so the move's freeze finds it between requests and it
        // saves the set.
        wait_replies(&cl, FIRST).await;
        let pids = c.nodes[0].data.pids.lock().unwrap().clone();
        let [pid] = pids[..] else {
            panic!("one back-end at h0: {pids:?}")
        };
        let pid = Pid::from_raw(pid as i32);
        // Stopped, the back-end cannot answer the save's FREEZE.
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
        let started = Instant::now();
        let result = c.nodes[0].host.move_session(id, "h1").await;
        let took = started.elapsed();
        kill(pid, Signal::SIGCONT).expect("SIGCONT");
        assert_declined(
            result,
            &[
                "back-end ledger did not freeze",
                &format!("did not answer FREEZE within {DEFAULT_SAVE_TIMEOUT:?}"),
            ],
        );
        println!("called off after {took:?} (bound {DEFAULT_SAVE_TIMEOUT:?})");
        assert!(
            took >= DEFAULT_SAVE_TIMEOUT && took < DEFAULT_SAVE_TIMEOUT + Duration::from_secs(1),
            "called off after {took:?}, not at the save's bound of {DEFAULT_SAVE_TIMEOUT:?}"
        );
        assert_eq!(c.holder(id), Some(0), "the session is still at its source");
        assert_eq!(c.nodes[1].data.starts.load(Ordering::SeqCst), 0);
        assert!(
            c.nodes[0].data.cuts.lock().unwrap().is_empty(),
            "no cut saved"
        );
        // Continued, the back-end answers what it missed, is thawed and
        // serves the rest at the source.
        go.send(()).expect("the client waits");
        wait_replies(&cl, FIRST + 50).await;
        assert_eq!(
            c.nodes[0].data.restored.load(Ordering::SeqCst),
            0,
            "the set kept running: nothing restarted"
        );
        // Its control answers in step again: the next move takes the set.
        let report = c.nodes[0]
            .host
            .move_session(id, "h1")
            .await
            .expect("a move once the back-end runs again");
        assert_eq!(report.revision, 1);
        wait_until(Duration::from_secs(10), "h1 serves it", || {
            c.holder(id) == Some(1)
        })
        .await;
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&ledger(&c), N);
        assert_eq!(c.nodes[0].data.cuts.lock().unwrap().len(), 1);
        assert_eq!(c.nodes[1].data.staged_runs.load(Ordering::SeqCst), 1);
        c.close_and_reap(&cl.session).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_end_stuck_on_a_request_calls_the_move_off_within_the_bound_and_serves_on_once_continued(
) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster([Backend::Ok, Backend::Ok], 2).await;
        const N: u64 = 400;
        const FIRST: u64 = 150;
        let (go, gate) = oneshot::channel();
        let cl = client_pausing(&c, "h0", N, Some((FIRST, gate))).await;
        let id = cl.session.id().unwrap();
        wait_replies(&cl, FIRST).await;
        let pids = c.nodes[0].data.pids.lock().unwrap().clone();
        let [pid] = pids[..] else {
            panic!("one back-end at h0: {pids:?}")
        };
        let pid = Pid::from_raw(pid as i32);
        // Stopped, then sent the next requests: the front-end forwards one
        // and waits for its reply, which does not come. The routine is not
        // at a quiescent point, so it cannot save.
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
        go.send(()).expect("the client waits");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            cl.replies.load(Ordering::SeqCst),
            FIRST,
            "no reply from a stopped back-end"
        );
        let started = Instant::now();
        let result = c.nodes[0].host.move_session(id, "h1").await;
        let took = started.elapsed();
        kill(pid, Signal::SIGCONT).expect("SIGCONT");
        assert_declined(
            result,
            &[
                "the reply of back-end ledger did not finish",
                &format!("within {DEFAULT_SAVE_TIMEOUT:?}"),
            ],
        );
        println!("called off after {took:?} (bound {DEFAULT_SAVE_TIMEOUT:?})");
        assert!(
            took >= DEFAULT_SAVE_TIMEOUT && took < DEFAULT_SAVE_TIMEOUT + Duration::from_secs(1),
            "called off after {took:?}, not at the bound of {DEFAULT_SAVE_TIMEOUT:?} (the move's freeze timeout is 10 s)"
        );
        assert_eq!(c.holder(id), Some(0), "the session is still at its source");
        assert_eq!(c.nodes[1].data.starts.load(Ordering::SeqCst), 0);
        assert!(
            c.nodes[0].data.cuts.lock().unwrap().is_empty(),
            "no cut saved"
        );
        // Continued, the back-end answers and the set serves on at the
        // source, nothing restarted.
        wait_replies(&cl, FIRST + 50).await;
        assert_eq!(c.nodes[0].data.restored.load(Ordering::SeqCst), 0);
        // The next move takes the set.
        let report = c.nodes[0]
            .host
            .move_session(id, "h1")
            .await
            .expect("a move once the back-end runs again");
        assert_eq!(report.revision, 1);
        wait_until(Duration::from_secs(10), "h1 serves it", || {
            c.holder(id) == Some(1)
        })
        .await;
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&ledger(&c), N);
        assert_eq!(c.nodes[1].data.staged_runs.load(Ordering::SeqCst), 1);
        c.close_and_reap(&cl.session).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_back_end_killed_after_staging_is_started_again_from_the_cut_and_every_effect_happens_once(
) {
    bounded(Duration::from_secs(120), "test", async {
        let c = start_cluster([Backend::Ok, Backend::Ok], 2).await;
        // h1 kills the back-end it stages for the move right after its
        // staging: the move commits with it dead, frozen, never thawed.
        c.nodes[1].data.kill_staged.store(true, Ordering::SeqCst);
        const N: u64 = 900;
        let cl = client(&c, "h0", N).await;
        let id = cl.session.id().unwrap();
        // A third answered, the rest in flight (the back-end answers one
        // request per 2 ms at most).
        wait_replies(&cl, N / 3).await;
        let report = c.nodes[0]
            .host
            .move_session(id, "h1")
            .await
            .expect("the move commits");
        assert_eq!(report.revision, 1);
        wait_until(Duration::from_secs(10), "h1 serves it", || {
            c.holder(id) == Some(1)
        })
        .await;
        let h1 = &c.nodes[1].data;
        let killed = h1.killed.lock().unwrap().clone();
        let [killed] = killed[..] else {
            panic!("one staged back-end killed at h1: {killed:?}")
        };
        assert!(!alive(killed), "the killed back-end is gone");
        // The replies go on after the move, in order, each once (the
        // client checks every one).
        let before = cl.replies.load(Ordering::SeqCst);
        assert!(before < N, "the move came with requests in flight");
        wait_replies(&cl, (before + 50).min(N)).await;
        let got = cl.task.await.unwrap().expect("every reply once, in order");
        assert_eq!(got, N);
        assert_ledger(&ledger(&c), N);
        assert_eq!(h1.staged_runs.load(Ordering::SeqCst), 1);
        let fallbacks = h1.fallbacks.lock().unwrap().clone();
        assert_eq!(fallbacks.len(), 1, "one start again from the cut");
        assert!(
            fallbacks[0].contains("back-end ledger did not thaw"),
            "the error names the back-end: {}",
            fallbacks[0]
        );
        assert_eq!(
            h1.restored.load(Ordering::SeqCst),
            2,
            "h1 restarted the set from the same cut twice: staged, then again"
        );
        let h1_pids = h1.pids.lock().unwrap().clone();
        assert_eq!(h1_pids.len(), 2, "the staged back-end, then its successor");
        assert_eq!(h1_pids[0], killed);
        assert_eq!(
            c.nodes[0].data.cuts.lock().unwrap().len(),
            1,
            "one cut saved"
        );
        println!("fell back after: {}", fallbacks[0]);
        c.close_and_reap(&cl.session).await;
    })
    .await;
}
