//! A front-end running a multi-transaction request against a real
//! PostgreSQL (Debian's, started here on a temporary data directory and a
//! free loopback port) is moved between two sites at random moments,
//! including between sending `COMMIT` and reading its reply
//! (`examples/pg_frontend.rs` says how it learns a transaction's fate).
//!
//! What a user of such a service cares about, checked in the database and
//! not in the front-end's memory: every transaction of every request
//! committed exactly once (one `effects` row per transaction, and each
//! account's balance the sum of its transactions), whatever the move
//! points; a destination killed mid-move leaves the request running at
//! the source with nothing lost or doubled.
//!
//! Needs root (PostgreSQL runs as the `postgres` user) and Debian's
//! `postgresql`; without them the tests say why and pass, unless `CI` is
//! set (CI installs both), where they fail.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use roam_continuation::service_set::{move_set, Control, MoveOutcome};
use roam_service::Limits;
use tokio::net::UnixListener;
use tokio::process::{Child, Command};

use common::pg::{need_pg, Postgres};

/// Transactions per request.
const TRANSACTIONS: u64 = 12;

/// A started front-end: its process and its control.
struct Frontend {
    child: Child,
    control: Control,
}

/// How a batch of requests runs.
#[derive(Debug, Clone, Copy, Default)]
struct Mode {
    /// The first move's destination dies once it has joined.
    sabotage: bool,
    /// Milliseconds each front-end waits between its export before
    /// `COMMIT` and the `COMMIT` (`ROAM_PG_THINK_MS`).
    think_ms: u64,
}

/// Starts one front-end for request `run`, fresh or from its restarted
/// part; `sabotage` kills it once it has joined (a destination that dies
/// mid-move).
#[allow(clippy::too_many_arguments)]
async fn start(
    listener: &UnixListener,
    control_path: &Path,
    port: u16,
    run: i32,
    out: &Path,
    part: Option<Vec<u8>>,
    sabotage: bool,
    think_ms: u64,
) -> std::io::Result<Frontend> {
    let mut child = Command::new(common::example("pg_frontend"))
        .arg(control_path)
        .arg(port.to_string())
        .arg(run.to_string())
        .arg(TRANSACTIONS.to_string())
        .arg(out)
        .env("ROAM_PG_THINK_MS", think_ms.to_string())
        .kill_on_drop(true)
        .spawn()?;
    let (socket, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .map_err(|_| std::io::Error::other("the front-end never joined"))??;
    let mut control = Control::accept(socket, |_| part).await?;
    if sabotage {
        // Dead before the coordinator hears it is ready: a READY it sent
        // first may still be in the socket, so its exit is checked below.
        child.start_kill()?;
        child.wait().await?;
    }
    tokio::select! {
        r = control.ready() => r?,
        status = child.wait() => {
            return Err(std::io::Error::other(format!(
                "the front-end exited before it was ready: {}",
                status?
            )));
        }
    }
    if let Some(status) = child.try_wait()? {
        return Err(std::io::Error::other(format!(
            "the front-end exited as it became ready: {status}"
        )));
    }
    Ok(Frontend { child, control })
}

/// What one request's moves did.
#[derive(Debug, Default)]
struct Report {
    /// Moves that completed.
    moved: u32,
    /// Moves whose destination died (the request went on at the source).
    destination_failed: u32,
    /// Restarts that found a transaction between `COMMIT` sent and its
    /// reply read, by the fate PostgreSQL gave: committed, aborted.
    committed: u32,
    aborted: u32,
    /// Restarts with no transaction at its `COMMIT`.
    idle: u32,
}

/// Runs request `run` with moves at random moments (seeded), waits for it
/// to finish and returns what the moves did, under `mode`.
async fn request(port: u16, run: i32, seed: u64, mode: Mode) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let control_path = dir.path().join("control.sock");
    let listener = UnixListener::bind(&control_path).unwrap();
    let out = dir.path().to_path_buf();
    let mut fe = start(
        &listener,
        &control_path,
        port,
        run,
        &out,
        None,
        false,
        mode.think_ms,
    )
    .await
    .expect("fresh start");
    let mut report = Report::default();
    let moves = rng.gen_range(1..=4);
    for i in 0..moves {
        tokio::time::sleep(Duration::from_micros(rng.gen_range(0..40_000))).await;
        if out.join("done").exists() {
            break;
        }
        let mut started = None;
        let outcome = move_set(
            std::slice::from_mut(&mut fe.control),
            Limits::default(),
            |mut plan| {
                let started = &mut started;
                let (listener, control_path, out) = (&listener, &control_path, &out);
                async move {
                    let part = plan.pop();
                    let sabotage = mode.sabotage && i == 0;
                    let Frontend { child, control } = start(
                        listener,
                        control_path,
                        port,
                        run,
                        out,
                        part,
                        sabotage,
                        mode.think_ms,
                    )
                    .await?;
                    *started = Some(child);
                    Ok(vec![control])
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: the source front-end failed: {e}"));
        match outcome {
            MoveOutcome::Moved(mut controls) => {
                report.moved += 1;
                let old = std::mem::replace(
                    &mut fe,
                    Frontend {
                        child: started.expect("started"),
                        control: controls.pop().expect("one control"),
                    },
                );
                let mut child = old.child;
                let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
                    .await
                    .expect("the source front-end exits")
                    .unwrap();
                assert!(status.success(), "seed {seed}: source front-end {status}");
            }
            MoveOutcome::Refused(why) => panic!("seed {seed}: move refused: {why}"),
            MoveOutcome::DestinationFailed(_) => report.destination_failed += 1,
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !out.join("done").exists() {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: request {run} did not finish ({report:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = fe.control.end().await;
    let _ = tokio::time::timeout(Duration::from_secs(10), fe.child.wait()).await;
    let resumes = std::fs::read_to_string(out.join("resumes")).unwrap_or_default();
    for line in resumes.lines() {
        match line {
            "committed" => report.committed += 1,
            "aborted" => report.aborted += 1,
            "idle" => report.idle += 1,
            other => panic!("seed {seed}: resumes file says {other:?}"),
        }
    }
    report
}

/// Runs `runs` requests (seeds `0..runs`, four at a time), then checks in
/// the database that each committed every transaction exactly once.
async fn requests(pg: &Postgres, runs: i32, mode: Mode) -> Report {
    let db = pg.accounts(runs).await;
    // Built before the requests start, not inside one (it would stall
    // the others' timers).
    tokio::task::spawn_blocking(|| common::example("pg_frontend"))
        .await
        .expect("build");
    let mut total = Report::default();
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = 0;
    loop {
        while tasks.len() < 4 && next < runs {
            let port = pg.port;
            tasks.spawn(request(port, next, next as u64, mode));
            next += 1;
        }
        let Some(done) = tasks.join_next().await else {
            break;
        };
        let r = done.expect("a request's task");
        total.moved += r.moved;
        total.destination_failed += r.destination_failed;
        total.committed += r.committed;
        total.aborted += r.aborted;
        total.idle += r.idle;
    }
    common::pg::assert_exactly_once(&db, runs, TRANSACTIONS, &format!("{total:?}")).await;
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transaction_commits_exactly_once_whatever_the_move_points() {
    let Some(bin) = need_pg() else { return };
    let pg = Postgres::start(&bin).await;
    let runs = std::env::var("ROAM_PG_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let report = requests(&pg, runs, Mode::default()).await;
    eprintln!("{runs} requests: {report:?}");
    assert!(report.moved >= runs as u32 / 2, "{report:?}");
    // The move fell between COMMIT sent and its reply read at least once,
    // and PostgreSQL's record of the fate decided.
    assert!(report.committed + report.aborted > 0, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_killed_mid_move_leaves_the_request_at_the_source() {
    let Some(bin) = need_pg() else { return };
    let pg = Postgres::start(&bin).await;
    let report = requests(
        &pg,
        8,
        Mode {
            sabotage: true,
            ..Mode::default()
        },
    )
    .await;
    eprintln!("{report:?}");
    assert!(report.destination_failed >= 1, "{report:?}");
}

/// A front-end frozen after its export before `COMMIT` but before sending
/// it (it spends 3 ms there, a slow front-end) never sends that `COMMIT`:
/// the destination ends its backend, PostgreSQL reports the transaction
/// aborted, and the destination runs it again. Checked in the database:
/// every transaction still committed exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_before_commit_is_sent_runs_the_transaction_again_exactly_once() {
    let Some(bin) = need_pg() else { return };
    let pg = Postgres::start(&bin).await;
    let report = requests(
        &pg,
        40,
        Mode {
            think_ms: 3,
            ..Mode::default()
        },
    )
    .await;
    eprintln!("40 requests, 3 ms before each COMMIT: {report:?}");
    assert!(
        report.aborted > 0,
        "no move fell before a COMMIT: {report:?}"
    );
}
