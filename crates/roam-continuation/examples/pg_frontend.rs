//! A front-end that runs a client's multi-transaction request against a
//! real PostgreSQL, as a member of a service set (issue 15's database
//! example; `tests/service_pg.rs` moves it between two sites mid-request).
//!
//! ```text
//! pg_frontend CONTROL_SOCKET PG_PORT RUN TRANSACTIONS OUT_DIR
//! ```
//!
//! The request: transactions `k = 0 .. TRANSACTIONS`, each adding `k + 1`
//! to account `RUN` and inserting the row `(RUN, k)` into `effects`, on
//! PostgreSQL at 127.0.0.1:PG_PORT (user and database `postgres`).
//!
//! Exactly once across a move. The snapshot (the process's exported state)
//! is the next transaction `k`, this incarnation's PostgreSQL
//! `application_name`, and, between an export made just before `COMMIT` is
//! sent and the export after its reply, the transaction's 64-bit id
//! (`pg_current_xact_id()`). A process restarted from its part:
//! 1. waits until the coordinator thaws it (the source has ended);
//! 2. ends the old incarnation's server process (`pg_terminate_backend` on
//!    its `application_name`), so no `COMMIT` of the old one can arrive
//!    later, and waits until that process has gone;
//! 3. if the snapshot names a transaction, asks PostgreSQL its fate,
//!    `pg_xact_status(xid8)`: `committed` means the old incarnation's
//!    `COMMIT` went through (the move fell between sending it and reading
//!    the reply) and `k + 1` is next; `aborted` means it did not, and `k` is
//!    run again.
//!
//! `pg_xact_status` is PostgreSQL's own record of a transaction's fate
//! (the commit log), kept for every transaction newer than the oldest
//! frozen one, so it needs no table or two-phase commit of its own; the
//! 64-bit `xid8` form does not wrap. Prepared transactions would work too
//! but leave a transaction to clean up when the front-end dies.
//!
//! `ROAM_PG_THINK_MS` (default 0): milliseconds the front-end spends after
//! its export before `COMMIT` and before sending it (a slow front-end; the
//! tests use it so that moves land there and the "aborted" fate is taken).
//!
//! Every effect (each statement) waits while the member is frozen
//! (`Member::running`, and `export`), so a frozen source acts no more. The
//! process appends one line per restart to `OUT_DIR/resumes` ("committed",
//! "aborted" or "idle" for a snapshot with no transaction in flight) and
//! writes `OUT_DIR/done` when the request is complete.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use roam_continuation::service_set::{join, Member};
use roam_service::{Interval, Limits};
use tokio::net::UnixStream;
use tokio_postgres::{Client, NoTls};

/// The snapshot: the next transaction, this incarnation's name and the
/// transaction in flight while `COMMIT` may have been sent.
struct State {
    /// The next transaction to run.
    k: u64,
    /// The `application_name` of the incarnation that exported this.
    app: String,
    /// The 64-bit id of transaction `k`, between the export just before
    /// its `COMMIT` and the one after its reply.
    committing: Option<String>,
}

impl State {
    fn encode(&self) -> Vec<u8> {
        match &self.committing {
            Some(xid) => format!("{} {} {xid}", self.k, self.app),
            None => format!("{} {}", self.k, self.app),
        }
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> State {
        let text = String::from_utf8_lossy(bytes);
        let mut words = text.split(' ');
        State {
            k: words.next().and_then(|k| k.parse().ok()).expect("k"),
            app: words.next().expect("app").to_string(),
            committing: words.next().map(str::to_string),
        }
    }
}

/// Appends a line to `OUT_DIR/resumes`.
fn note(out: &std::path::Path, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out.join("resumes"))
        .expect("resumes file");
    writeln!(f, "{line}").expect("write resumes");
}

/// Ends the old incarnation's server process and waits until it is gone
/// (at most 10 s).
async fn end_old(db: &Client, old_app: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = db
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1",
                &[&old_app],
            )
            .await
            .expect("terminate the old incarnation's backend");
        if rows.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{old_app}'s backend never went");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The fate of a transaction whose backend is gone: true when committed.
async fn committed(db: &Client, xid: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let row = db
            .query_one("SELECT pg_xact_status($1::text::xid8)", &[&xid])
            .await
            .expect("pg_xact_status");
        match row.get::<_, Option<String>>(0).as_deref() {
            Some("committed") => return true,
            Some("aborted") => return false,
            Some("in progress") if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => panic!("transaction {xid}: status {other:?}"),
        }
    }
}

async fn run(m: Member, port: u16, run: i32, transactions: u64, out: PathBuf) {
    let app = format!("roam-fe-{run}-{:016x}", rand::random::<u64>());
    let config =
        format!("host=127.0.0.1 port={port} user=postgres dbname=postgres application_name={app}");
    let (db, connection) = tokio_postgres::connect(&config, NoTls)
        .await
        .expect("connect to PostgreSQL");
    tokio::spawn(connection);
    // A restarted member acts only once thawed: the source has ended.
    m.running().await;
    let mut k = 0;
    if let Some(bytes) = m.snapshot() {
        let state = State::decode(&bytes);
        end_old(&db, &state.app).await;
        k = state.k;
        let fate = match &state.committing {
            Some(xid) if committed(&db, xid).await => {
                k += 1;
                "committed"
            }
            Some(_) => "aborted",
            None => "idle",
        };
        note(&out, fate);
    }
    let export = |k: u64, committing: Option<String>| {
        let state = State {
            k,
            app: app.clone(),
            committing,
        };
        let m = &m;
        async move {
            m.export(&state.encode(), Interval::Deterministic)
                .await
                .expect("export")
        }
    };
    export(k, None).await;
    let think = Duration::from_millis(
        std::env::var("ROAM_PG_THINK_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(0),
    );
    while k < transactions {
        m.running().await;
        db.batch_execute("BEGIN").await.expect("BEGIN");
        m.running().await;
        let add = k as i64 + 1;
        db.execute(
            "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
            &[&add, &run],
        )
        .await
        .expect("UPDATE");
        m.running().await;
        db.execute(
            "INSERT INTO effects (run, k) VALUES ($1, $2)",
            &[&run, &(k as i64)],
        )
        .await
        .expect("INSERT");
        let xid: String = db
            .query_one("SELECT pg_current_xact_id()::text", &[])
            .await
            .expect("xact id")
            .get(0);
        // From here to the next export a restart asks PostgreSQL.
        export(k, Some(xid)).await;
        if !think.is_zero() {
            tokio::time::sleep(think).await;
        }
        // COMMIT is an effect like any statement: a source frozen here
        // never sends it, its backend is ended by the destination and the
        // transaction's fate is "aborted" (run again); frozen after this
        // point, the fate says whether it went through.
        m.running().await;
        db.batch_execute("COMMIT").await.expect("COMMIT");
        k += 1;
        export(k, None).await;
    }
    std::fs::write(out.join("done"), b"").expect("done file");
    std::future::pending::<()>().await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, control, port, run_id, transactions, out] = &args[..] else {
        eprintln!("usage: pg_frontend CONTROL_SOCKET PG_PORT RUN TRANSACTIONS OUT_DIR");
        std::process::exit(2);
    };
    let port: u16 = port.parse().expect("PG_PORT is a port");
    let run_id: i32 = run_id.parse().expect("RUN is a number");
    let transactions: u64 = transactions.parse().expect("TRANSACTIONS is a number");
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let m = join(&mut control, "fe", Limits::default())
        .await
        .expect("join");
    let app = tokio::spawn(run(
        m.clone(),
        port,
        run_id,
        transactions,
        PathBuf::from(out),
    ));
    m.ready(&mut control).await.expect("ready");
    let served = m.serve_control(control).await;
    app.abort();
    std::process::exit(if served.is_ok() { 0 } else { 1 });
}
