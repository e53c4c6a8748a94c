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

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child as StdChild, Command as StdCommand, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use roam_continuation::service_set::{move_set, Control, MoveOutcome};
use roam_service::Limits;
use tokio::net::UnixListener;
use tokio::process::{Child, Command};
use tokio_postgres::NoTls;

/// Transactions per request.
const TRANSACTIONS: u64 = 12;

/// Debian's PostgreSQL binaries, or why the test cannot run.
fn pg_bin() -> Result<PathBuf, String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not root (PostgreSQL runs as the postgres user)".into());
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| "Debian's postgresql is not installed".to_string())?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    found.sort();
    found
        .pop()
        .ok_or_else(|| "no /usr/lib/postgresql/*/bin/initdb".to_string())
}

/// Skips (or, under CI, fails) when PostgreSQL cannot run here.
fn need_pg() -> Option<PathBuf> {
    match pg_bin() {
        Ok(bin) => Some(bin),
        Err(why) if std::env::var_os("CI").is_some() => panic!("{why}"),
        Err(why) => {
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// A PostgreSQL server on a temporary data directory; stopped on drop.
struct Postgres {
    child: StdChild,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Postgres {
    fn as_postgres(bin: &Path, tool: &str) -> StdCommand {
        let mut cmd = StdCommand::new("setpriv");
        cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(bin.join(tool));
        cmd
    }

    async fn start(bin: &Path) -> Postgres {
        let dir = tempfile::tempdir().expect("data dir");
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let chown = StdCommand::new("chown")
            .arg("-R")
            .arg("postgres:postgres")
            .arg(dir.path())
            .status()
            .expect("chown");
        assert!(chown.success());
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let init = Self::as_postgres(bin, "initdb")
            .args(["--auth=trust", "-U", "postgres", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(init.success(), "initdb: {init}");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Self::as_postgres(bin, "postgres")
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=200",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres");
        let pg = Postgres {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let db = loop {
            match tokio_postgres::connect(&pg.config(), NoTls).await {
                Ok((db, conn)) => {
                    tokio::spawn(conn);
                    break db;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "postgres never listened: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        db.batch_execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL);
             CREATE TABLE effects (run int NOT NULL, k bigint NOT NULL);",
        )
        .await
        .expect("schema");
        pg
    }

    fn config(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // SIGINT: fast shutdown (the postmaster ends its server processes).
        let _ = StdCommand::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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
    let (db, conn) = tokio_postgres::connect(&pg.config(), NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    for run in 0..runs {
        db.execute("INSERT INTO accounts VALUES ($1, 0)", &[&run])
            .await
            .expect("account");
    }
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
    let want_balance = (TRANSACTIONS * (TRANSACTIONS + 1) / 2) as i64;
    for run in 0..runs {
        let row = db
            .query_one(
                "SELECT count(*), count(DISTINCT k), \
                 (SELECT balance FROM accounts WHERE id = $1) \
                 FROM effects WHERE run = $1",
                &[&run],
            )
            .await
            .expect("check");
        let (rows, distinct, balance): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(
            (rows, distinct, balance),
            (TRANSACTIONS as i64, TRANSACTIONS as i64, want_balance),
            "request {run} (seed {run}): effects rows, distinct transactions, balance ({total:?})"
        );
    }
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
