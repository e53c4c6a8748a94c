//! A real PostgreSQL for the database tests (`service_pg.rs`,
//! `service_pg_cluster.rs`): Debian's, started as the `postgres` user on a
//! temporary data directory and a free loopback port, with the tables
//! `accounts (id, balance)` and `effects (run, k)`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child as StdChild, Command as StdCommand, Stdio};
use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

/// Debian's PostgreSQL binaries, or why the test cannot run.
pub fn pg_bin() -> Result<PathBuf, String> {
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
pub fn need_pg() -> Option<PathBuf> {
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
pub struct Postgres {
    /// The postmaster.
    child: StdChild,
    /// Its loopback port.
    pub port: u16,
    /// Its data directory and socket directory (removed on drop).
    _dir: tempfile::TempDir,
}

impl Postgres {
    /// `tool` from `bin`, run as the `postgres` user.
    fn as_postgres(bin: &Path, tool: &str) -> StdCommand {
        let mut cmd = StdCommand::new("setpriv");
        cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(bin.join(tool));
        cmd
    }

    /// Initialises a data directory, starts the server on a free port
    /// and creates the tables.
    pub async fn start(bin: &Path) -> Postgres {
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

    /// The connection string (user and database `postgres`).
    pub fn config(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }
}

impl Postgres {
    /// A connection to the server, with accounts `0..runs` at balance 0.
    pub async fn accounts(&self, runs: i32) -> tokio_postgres::Client {
        let (db, conn) = tokio_postgres::connect(&self.config(), NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        for run in 0..runs {
            db.execute("INSERT INTO accounts VALUES ($1, 0)", &[&run])
                .await
                .expect("account");
        }
        db
    }
}

/// Checks in the database that each request `0..runs` committed each of
/// its `transactions` exactly once: one `effects` row per transaction and
/// the balance their sum (transaction `k` adds `k + 1`); `context` goes in
/// the failure message.
pub async fn assert_exactly_once(
    db: &tokio_postgres::Client,
    runs: i32,
    transactions: u64,
    context: &str,
) {
    let want_balance = (transactions * (transactions + 1) / 2) as i64;
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
            (transactions as i64, transactions as i64, want_balance),
            "request {run} (seed {run}): effects rows, distinct transactions, balance ({context})"
        );
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
