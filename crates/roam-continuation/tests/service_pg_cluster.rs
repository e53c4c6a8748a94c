//! A roam client's multi-transaction request against a real PostgreSQL,
//! served by a cluster host's front-end whose back-end is the
//! PostgreSQL-running process (`examples/pg_frontend.rs`, second form),
//! while the cluster moves the client's session between its two hosts
//! (`Host::move_session`) at seeded random moments (issue 15; see
//! `docs/SERVICE.md`, "Effects in a database, over a cluster").
//!
//! The front-end (the root of a `SessionSet` in the host's process)
//! forwards the client's request to the back-end over the set's request
//! channel and each reply line (one per committed transaction) back to
//! the client, exporting after each step. A move saves the set's cut into
//! the session's continuation wherever the back-end is, between two
//! statements or with its `COMMIT` in flight; the destination starts the
//! back-end again from its part, which learns the fate of the transaction
//! at its `COMMIT` from PostgreSQL (`pg_xact_status`).
//!
//! What a user cares about, checked in the database and at the client:
//! every transaction committed exactly once (one `effects` row each, each
//! account's balance their sum), and every reply line arrived once, in
//! order, with the balance that commit left. A destination whose staged
//! back-end is killed (SIGKILL) before its thaw starts it again from the
//! cut, and nothing is lost or doubled.
//!
//! Seeds: 200 requests by default (`ROAM_PG_CLUSTER_RUNS` to change),
//! four at a time, 1-4 moves each.
//!
//! Needs root (PostgreSQL runs as the `postgres` user) and Debian's
//! `postgresql`; without them the tests say why and pass, unless `CI` is
//! set, where they fail.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pg::{need_pg, Postgres};
use common::set_front::{self, Cluster, Front, REPLIES, REQUESTS};
use common::{bounded, wait_until};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use roam::RoamStream;
use roam_continuation::service_set::SessionSet;
use roam_continuation::ManagedSession;
use roam_service::Interval;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Child;

#[path = "../examples/pg_frontend.rs"]
#[allow(dead_code, unreachable_pub)]
mod pg_frontend;

/// Transactions per request.
const TRANSACTIONS: u64 = 12;

/// The front-end's loop for one session: the client's bytes go to the
/// back-end, the back-end's reply lines to the client, and the root
/// exports after each step, so at a freeze request (handled between two
/// steps) its state is its last export and the set's cut goes into the
/// continuation.
async fn serve(
    front: Arc<Front>,
    session: ManagedSession,
    mut stream: RoamStream,
    mut set: SessionSet,
    mut child: Child,
    pending: Vec<u8>,
) {
    let mut from_client = vec![0u8; 64];
    let mut from_back = vec![0u8; 4096];
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
            r = stream.read(&mut from_client) => {
                let n = match r {
                    Ok(0) | Err(_) => {
                        // The client is done: so is the set.
                        let _ = child.kill().await;
                        return;
                    }
                    Ok(n) => n,
                };
                if let Err(e) = set.root().write_all(REQUESTS, &from_client[..n]).await {
                    back_end_gone(&session, &mut child, e).await;
                    return;
                }
                set.root().export(b"", Interval::Deterministic).await.expect("root export");
            }
            r = set.root().read(REPLIES, &mut from_back) => {
                let n = match r {
                    Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
                    other => other,
                };
                let n = match n {
                    Ok(n) => n,
                    Err(e) => {
                        back_end_gone(&session, &mut child, e).await;
                        return;
                    }
                };
                if stream.write_all(&from_back[..n]).await.is_err() {
                    return;
                }
                set.root().export(b"", Interval::Deterministic).await.expect("root export");
            }
        }
    }
}

/// The back-end's channels failed: its state since its last export went
/// with it, so the session ends here; a move waiting for it is called off.
async fn back_end_gone(session: &ManagedSession, child: &mut Child, e: std::io::Error) {
    eprintln!("back-end pg is gone ({e}); the session ends");
    session.decline_freeze(format!("back-end pg is gone: {e}"));
    let _ = child.kill().await;
}

/// Two hosts whose front-ends run `pg_frontend` against `pg`; their
/// back-ends note each restart's fate in the cluster directory's `out/`.
async fn start_cluster(pg: &Postgres) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let backend = tokio::task::spawn_blocking(|| common::example("pg_frontend"))
        .await
        .expect("build");
    let port = pg.port;
    set_front::start_cluster(
        dir,
        |f, s, st, set, c, p| Box::pin(serve(f, s, st, set, c, p)),
        |_, work| {
            let args = vec![port.to_string().into(), out.clone().into()];
            Front::new(backend.clone(), "pg", work, args)
        },
    )
    .await
}

/// How a batch of requests runs.
#[derive(Debug, Clone, Copy, Default)]
struct Mode {
    /// Before each request's first move, its destination is told to kill
    /// (SIGKILL) the back-end it stages, before its thaw.
    kill_staged: bool,
}

/// What the moves of a batch of requests did.
#[derive(Debug, Default)]
struct Report {
    /// Moves that committed.
    moved: u32,
    /// Moves that did not, and why.
    not_moved: Vec<String>,
    /// Restarts that found a transaction between `COMMIT` sent and its
    /// reply read, by the fate PostgreSQL gave: committed, aborted.
    committed: u32,
    /// See `committed`.
    aborted: u32,
    /// Restarts with no transaction at its `COMMIT`.
    idle: u32,
    /// Staged back-ends that did not start (killed), started again from
    /// the session's cut.
    fallbacks: usize,
}

/// Request `run`: a client on a seeded host asks for `TRANSACTIONS`
/// transactions and checks every reply line (once, in order, the balance
/// that commit left), while the session is moved 1-4 times at seeded
/// random moments. Returns the moves that committed and why others did
/// not.
async fn request(c: Arc<Cluster>, run: i32, mode: Mode) -> (u32, Vec<String>) {
    let seed = run as u64;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut at = rng.gen_range(0..2usize);
    let (session, stream) = c.connect(&c.nodes[at].name).await;
    let id = session.id().expect("a session id");
    let (mut r, mut w) = tokio::io::split(stream);
    let mut req = (run as u64).to_be_bytes().to_vec();
    req.extend_from_slice(&TRANSACTIONS.to_be_bytes());
    w.write_all(&req).await.expect("send the request");
    let reader = tokio::spawn(async move {
        let mut line = [0u8; pg_frontend::REPLY_LEN];
        for k in 0..TRANSACTIONS {
            r.read_exact(&mut line)
                .await
                .map_err(|e| format!("reply {k}: {e}"))?;
            let balance = ((k + 1) * (k + 2) / 2) as i64;
            let want = pg_frontend::reply_line(run, k, balance);
            if line[..] != *want.as_bytes() {
                return Err(format!(
                    "reply {k}: {:?}, want {want:?}",
                    String::from_utf8_lossy(&line)
                ));
            }
        }
        // Nothing more may come: a line twice would show here.
        match tokio::time::timeout(Duration::from_millis(200), r.read(&mut line)).await {
            Err(_) | Ok(Ok(0)) => Ok(()),
            Ok(other) => Err(format!("after the last reply: {other:?}")),
        }
    });
    let mut moved = 0;
    let mut not_moved = Vec::new();
    for i in 0..rng.gen_range(1..=4) {
        tokio::time::sleep(Duration::from_micros(rng.gen_range(0..60_000))).await;
        if reader.is_finished() {
            break;
        }
        let c2 = c.clone();
        wait_until(
            Duration::from_secs(10),
            "a host serves the session",
            move || c2.holder(id).is_some(),
        )
        .await;
        at = c.holder(id).expect("held");
        let to = 1 - at;
        if mode.kill_staged && i == 0 {
            c.nodes[to].data.kill_staged.store(true, Ordering::SeqCst);
        }
        match c.nodes[at].host.move_session(id, &c.nodes[to].name).await {
            Ok(_) => moved += 1,
            Err(e) => not_moved.push(e.to_string()),
        }
    }
    let checked = bounded(Duration::from_secs(60), "the replies", reader)
        .await
        .expect("the reader's task");
    if let Err(e) = checked {
        panic!("request {run} (seed {seed}): {e} (moved {moved}, not moved {not_moved:?})");
    }
    drop(w);
    let _ = tokio::time::timeout(Duration::from_secs(5), session.close(0, "done")).await;
    (moved, not_moved)
}

/// Runs requests `0..runs` (seeds `0..runs`, four at a time) under
/// `mode`, checks in the database that each committed every transaction
/// exactly once, stops the cluster, and returns what the moves did.
async fn requests(pg: &Postgres, runs: i32, mode: Mode) -> Report {
    let db = pg.accounts(runs).await;
    let c = Arc::new(start_cluster(pg).await);
    let mut report = Report::default();
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = 0;
    loop {
        while tasks.len() < 4 && next < runs {
            tasks.spawn(request(c.clone(), next, mode));
            next += 1;
        }
        let Some(done) = tasks.join_next().await else {
            break;
        };
        let (moved, not_moved) = done.expect("a request's task");
        report.moved += moved;
        report.not_moved.extend(not_moved);
    }
    let resumes =
        std::fs::read_to_string(c.dir.path().join("out").join("resumes")).unwrap_or_default();
    for line in resumes.lines() {
        match line {
            "committed" => report.committed += 1,
            "aborted" => report.aborted += 1,
            "idle" => report.idle += 1,
            other => panic!("resumes file says {other:?}"),
        }
    }
    report.fallbacks = c
        .nodes
        .iter()
        .map(|n| n.data.fallbacks.lock().unwrap().len())
        .sum();
    common::pg::assert_exactly_once(&db, runs, TRANSACTIONS, &format!("{report:?}")).await;
    let Ok(c) = Arc::try_unwrap(c) else {
        panic!("the cluster is still shared")
    };
    let pids = c.backend_pids();
    c.shutdown().await;
    for pid in pids {
        wait_until(Duration::from_secs(10), "every back-end gone", move || {
            !set_front::alive(pid)
        })
        .await;
    }
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_moves_a_clients_pg_request_and_every_transaction_commits_once_and_every_reply_arrives_once(
) {
    let Some(bin) = need_pg() else { return };
    let runs = std::env::var("ROAM_PG_CLUSTER_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let started = Instant::now();
    let pg = Postgres::start(&bin).await;
    let report = requests(&pg, runs, Mode::default()).await;
    eprintln!("{runs} requests in {:?}: {report:?}", started.elapsed());
    assert!(report.moved >= runs as u32, "{report:?}");
    // A move fell between COMMIT sent and its reply read at least once,
    // and PostgreSQL's record of the fate decided.
    assert!(report.committed + report.aborted > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_back_end_killed_mid_move_restarts_from_the_cut_and_nothing_is_lost_or_doubled(
) {
    let Some(bin) = need_pg() else { return };
    let started = Instant::now();
    let pg = Postgres::start(&bin).await;
    let report = requests(&pg, 12, Mode { kill_staged: true }).await;
    eprintln!("12 requests in {:?}: {report:?}", started.elapsed());
    assert!(report.fallbacks >= 1, "{report:?}");
}
