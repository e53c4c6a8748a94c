//! A front-end that runs a client's multi-transaction request against a
//! real PostgreSQL, as a member of a service set (issue 15's database
//! example; `tests/service_pg.rs` moves it between two sites mid-request).
//!
//! ```text
//! pg_frontend CONTROL_SOCKET PG_PORT RUN TRANSACTIONS OUT_DIR
//! pg_frontend CONTROL_SOCKET CHANNEL_DIR PG_PORT OUT_DIR
//! ```
//!
//! The request: transactions `k = 0 .. TRANSACTIONS`, each adding `k + 1`
//! to account `RUN` and inserting the row `(RUN, k)` into `effects`, on
//! PostgreSQL at 127.0.0.1:PG_PORT (user and database `postgres`).
//!
//! The first form (role `fe`) runs the request given on its command line.
//! The second (role `pg`) is the back-end of a session's service set
//! (`tests/service_pg_cluster.rs`: a roam client's request reaches it
//! through a cluster host's front-end): it connects
//! `CHANNEL_DIR/req.sock` (channel 1, which it reads) and
//! `CHANNEL_DIR/rep.sock` (channel 2, which it writes), reads one request
//! of 16 bytes, `RUN:u64 TRANSACTIONS:u64` big-endian, and answers one
//! line per committed transaction, [`reply_line`]`(RUN, k, balance)`, the
//! balance being the account's after that commit.
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
//! A reply line is written after its `COMMIT`'s reply and before the
//! export that follows; a restart whose snapshot names a transaction that
//! PostgreSQL reports `committed` writes that transaction's line again
//! (the balance read back), so the replay's bytes are the same and the
//! set's write discard drops the line if the front-end already has it.
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
use roam_service::{ChannelId, Interval, Limits};
use tokio::net::UnixStream;
use tokio_postgres::{Client, NoTls};

/// Channel 1 (second form): the front-end's request, read here.
pub const REQUESTS: ChannelId = ChannelId(1);
/// Channel 2 (second form): one reply line per committed transaction,
/// written here.
pub const REPLIES: ChannelId = ChannelId(2);

/// The reply line for transaction `k` of request `run`, committed with
/// the account at `balance` (31 bytes).
pub fn reply_line(run: i32, k: u64, balance: i64) -> String {
    format!("{run:08} {k:08} {balance:012}\n")
}

/// The length of a [`reply_line`].
pub const REPLY_LEN: usize = 31;

/// The request this process runs.
#[derive(Clone, Copy)]
struct Request {
    /// The account (and `effects.run`).
    run: i32,
    /// How many transactions.
    transactions: u64,
}

/// The snapshot: the request, the next transaction, this incarnation's
/// name and the transaction in flight while `COMMIT` may have been sent.
struct State {
    /// The request being run.
    req: Request,
    /// The next transaction to run.
    k: u64,
    /// The `application_name` of the incarnation that exported this.
    app: String,
    /// The 64-bit id of transaction `k`, between the export just before
    /// its `COMMIT` and the one after its reply.
    committing: Option<String>,
}

impl State {
    /// `RUN TRANSACTIONS K APP [XID]`.
    fn encode(&self) -> Vec<u8> {
        let head = format!(
            "{} {} {} {}",
            self.req.run, self.req.transactions, self.k, self.app
        );
        match &self.committing {
            Some(xid) => format!("{head} {xid}"),
            None => head,
        }
        .into_bytes()
    }

    /// The inverse of [`State::encode`].
    fn decode(bytes: &[u8]) -> State {
        let text = String::from_utf8_lossy(bytes);
        let mut words = text.split(' ');
        let mut number = |what: &str| -> u64 {
            words
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("snapshot: {what}"))
        };
        let run = i32::try_from(number("run")).expect("snapshot: run");
        let transactions = number("transactions");
        let k = number("k");
        State {
            req: Request { run, transactions },
            k,
            app: words.next().expect("snapshot: app").to_string(),
            committing: words.next().map(str::to_string),
        }
    }
}

/// Appends a line to `OUT_DIR/resumes` in one `write` (an `O_APPEND`
/// write of one buffer is not interleaved with another process's, so
/// back-ends restarting at once cannot mix their lines).
fn note(out: &std::path::Path, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out.join("resumes"))
        .expect("resumes file");
    f.write_all(format!("{line}\n").as_bytes())
        .expect("write resumes");
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

/// Reads the request from the front-end (second form): 16 bytes,
/// `RUN:u64 TRANSACTIONS:u64` big-endian.
async fn read_request(m: &Member) -> Request {
    let mut buf = [0u8; 16];
    let mut got = 0;
    while got < buf.len() {
        match m
            .read(REQUESTS, &mut buf[got..])
            .await
            .expect("read request")
        {
            0 => panic!("the front-end closed before its request"),
            n => got += n,
        }
    }
    let word = |at: usize| u64::from_be_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
    Request {
        run: i32::try_from(word(0)).expect("RUN fits an i32"),
        transactions: word(8),
    }
}

/// Connects to `CHANNEL_DIR/name` (the front-end listens there).
async fn connect(path: &std::path::Path) -> UnixStream {
    for _ in 0..1000 {
        if let Ok(s) = UnixStream::connect(path).await {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{}: nobody listens", path.display());
}

/// Runs the request (`given`, or read from the front-end when `None`)
/// against PostgreSQL on `port`, answering the front-end in the second
/// form (`channels`).
async fn run(m: Member, port: u16, given: Option<Request>, out: PathBuf) {
    let channels = given.is_none();
    let app = format!("roam-fe-{:016x}", rand::random::<u64>());
    let config =
        format!("host=127.0.0.1 port={port} user=postgres dbname=postgres application_name={app}");
    let (db, connection) = tokio_postgres::connect(&config, NoTls)
        .await
        .expect("connect to PostgreSQL");
    tokio::spawn(connection);
    // A restarted member acts only once thawed: the source has ended.
    m.running().await;
    let reply = |req: Request, k: u64, balance: i64| {
        let m = &m;
        async move {
            if channels {
                m.write_all(REPLIES, reply_line(req.run, k, balance).as_bytes())
                    .await
                    .expect("reply");
            }
        }
    };
    let (req, mut k) = match m.snapshot() {
        Some(bytes) => {
            let state = State::decode(&bytes);
            end_old(&db, &state.app).await;
            let mut k = state.k;
            let fate = match &state.committing {
                Some(xid) if committed(&db, xid).await => {
                    // Its reply line again: the same bytes, discarded if
                    // the front-end already has them.
                    let balance: i64 = db
                        .query_one(
                            "SELECT balance FROM accounts WHERE id = $1",
                            &[&state.req.run],
                        )
                        .await
                        .expect("balance")
                        .get(0);
                    reply(state.req, k, balance).await;
                    k += 1;
                    "committed"
                }
                Some(_) => "aborted",
                None => "idle",
            };
            note(&out, fate);
            (state.req, k)
        }
        // Fresh (or restarted before its first export, having done
        // nothing): the request from the command line or the front-end.
        None => match given {
            Some(req) => (req, 0),
            None => (read_request(&m).await, 0),
        },
    };
    let export = |k: u64, committing: Option<String>| {
        let state = State {
            req,
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
    while k < req.transactions {
        m.running().await;
        db.batch_execute("BEGIN").await.expect("BEGIN");
        m.running().await;
        let add = k as i64 + 1;
        let balance: i64 = db
            .query_one(
                "UPDATE accounts SET balance = balance + $1 WHERE id = $2 RETURNING balance",
                &[&add, &req.run],
            )
            .await
            .expect("UPDATE")
            .get(0);
        m.running().await;
        db.execute(
            "INSERT INTO effects (run, k) VALUES ($1, $2)",
            &[&req.run, &(k as i64)],
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
        reply(req, k, balance).await;
        k += 1;
        export(k, None).await;
    }
    if !channels {
        std::fs::write(out.join("done"), b"").expect("done file");
    }
    std::future::pending::<()>().await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (control, role, port, given, channels, out) = match &args[..] {
        [_, control, port, run_id, transactions, out] => {
            let req = Request {
                run: run_id.parse().expect("RUN is a number"),
                transactions: transactions.parse().expect("TRANSACTIONS is a number"),
            };
            (control, "fe", port, Some(req), None, out)
        }
        [_, control, dir, port, out] => (control, "pg", port, None, Some(dir), out),
        _ => {
            eprintln!(
                "usage: pg_frontend CONTROL_SOCKET PG_PORT RUN TRANSACTIONS OUT_DIR\n   \
                 or: pg_frontend CONTROL_SOCKET CHANNEL_DIR PG_PORT OUT_DIR"
            );
            std::process::exit(2);
        }
    };
    let port: u16 = port.parse().expect("PG_PORT is a port");
    let mut control = UnixStream::connect(control).await.expect("control socket");
    let m = join(&mut control, role, Limits::default())
        .await
        .expect("join");
    if let Some(dir) = channels {
        let dir = std::path::Path::new(dir);
        m.add_reader(REQUESTS, connect(&dir.join("req.sock")).await)
            .expect("requests");
        m.add_writer(REPLIES, connect(&dir.join("rep.sock")).await)
            .expect("replies");
    }
    let app = tokio::spawn(run(m.clone(), port, given, PathBuf::from(out)));
    m.ready(&mut control).await.expect("ready");
    let served = m.serve_control(control).await;
    app.abort();
    std::process::exit(if served.is_ok() { 0 } else { 1 });
}
