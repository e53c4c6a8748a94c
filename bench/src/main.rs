//! # roam-bench — roam against the tools people use today, in one run
//!
//! Runs six scenarios (throughput, latency, set-up, failure detection and
//! resume, memory, many sessions) against direct TCP, a socat relay, two
//! chained socat relays, an `ssh -L` tunnel to a private sshd, and `roam
//! forward` / `roam pipe` / a library session to `roam serve`, all on
//! 127.0.0.1, and writes `results.json`, `results.md` (opening with the
//! issue's targets, met or not) and PNG plots. A seventh scenario,
//! `cluster`, measures live moves of sessions between three in-process
//! `roam_continuation` hosts (stall, drain, throughput with moves).
//! Scenario 11, `interpose`, runs one client program plain, under `roam
//! run` and through `roam forward` between two network namespaces (set-up,
//! round trips, throughput).
//! Scenario 12, `service`, measures service continuations (roam-service
//! and its tokio layer): each primitive's cost, and a two-member stream
//! moved every 2 s against none.
//! Scenario 13, `isr`, suspends a QEMU guest to an S3 store in another
//! network namespace and resumes it over `tbf`-limited links (copy-in,
//! demand fetch, lookaside).
//!
//! ## Design
//! - **One load generator** (`load`): a target process (sink, source, echo)
//!   and client operations written once; a peer only decides how a
//!   connection is made (`peers`), so every peer is driven by the same code.
//! - **Same hops**: compared peers cross the same number of relay
//!   processes (`socat` with `roam-session`: one; `socat2`, `ssh -L`, `roam
//!   forward`, `roam pipe`: two).
//! - **Ratios, not absolutes**: peers alternate within every cell of every
//!   scenario (rotated order per round), so drift on a shared machine hits
//!   them alike; reports give medians and roam/peer ratios from one run.
//! - **Correctness first**: every transfer is checked (counts, payload,
//!   echoes). A scenario that fails is recorded as `"status": "error"` and
//!   the run exits non-zero; timing never fails a run.
//! - **Bounded and clean**: every scenario has a time budget; every child
//!   process is killed when its guard drops.
//!
//! Non-goals: absolute numbers comparable across machines; WAN emulation
//! (this kernel has no netem; the fault proxy black-holes instead).

#![forbid(unsafe_code)]

mod agent;
mod diag;
mod load;
mod peers;
mod plot;
mod procs;
mod report;
mod scenarios;
mod stats;
mod targets;

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use serde::Serialize;

use crate::peers::{Env, Lab};
use crate::scenarios::progress;

/// The allocator and configuration the `roam` binary ships with
/// (`.cargo/config.toml`): the agents' library clients and relays then hold
/// memory as `roam pipe`, `roam forward` and `roam serve` would, and the
/// memory scenario measures what a session holds, not what glibc's arenas
/// keep from the active phase.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Benchmark suite of roam: throughput, latency, set-up, resume, memory and
/// many-session fairness against direct TCP, socat and ssh -L, and moves
/// between cluster hosts, on loopback.
#[derive(Debug, Parser)]
#[command(name = "roam-bench", version)]
struct Cli {
    #[command(subcommand)]
    agent: Option<Top>,
    /// CI smoke run: every scenario, short (about 2 minutes).
    #[arg(long, conflicts_with_all = ["full", "self_check"])]
    quick: bool,
    /// Full run: more rounds, longer samples, 10,000-session memory.
    #[arg(long, conflicts_with = "self_check")]
    full: bool,
    /// Tiny run of every scenario (tens of seconds): does the harness work?
    #[arg(long)]
    self_check: bool,
    /// Output directory for results.json, results.md and the plots.
    #[arg(long, default_value = "bench/out")]
    out: PathBuf,
    /// The roam binary [default: `roam` next to this binary].
    #[arg(long)]
    roam: Option<PathBuf>,
    /// Only these scenarios (comma-separated): throughput, latency, setup,
    /// resume, memory, many, cluster, takeover, shell, migrate, interpose,
    /// service, isr.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only these peers (comma-separated result names, e.g. socat,roam-forward);
    /// for investigating one peer. Ratios against missing peers show as –.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Clients of the many-sessions scenario instead of the mode's 1,000.
    #[arg(long)]
    many_clients: Option<usize>,
    /// Session counts of the memory scenario through `roam serve`
    /// (comma-separated) instead of the mode's, e.g. 9000.
    #[arg(long, value_delimiter = ',')]
    memory_serve_sessions: Vec<usize>,
    /// Measuring window (seconds) of the many-sessions scenario instead of the mode's.
    #[arg(long)]
    many_seconds: Option<f64>,
    /// Cases of the migrate scenario instead of the mode's, as
    /// CONNECTIONSxMB (comma-separated), e.g. 1000x1000.
    #[arg(long, value_delimiter = ',', value_parser = parse_migrate_case)]
    migrate_cases: Vec<(usize, usize)>,
    /// Only these movers of the migrate scenario (comma-separated): criu,
    /// roam, no-reinject, lazy.
    #[arg(long, value_delimiter = ',', value_parser = parse_mover)]
    migrate_movers: Vec<scenarios::migrate::Mover>,
    /// Links of the isr scenario instead of the mode's, as MBITxROUNDS
    /// (comma-separated), e.g. 100x3.
    #[arg(long, value_delimiter = ',', value_parser = parse_isr_link)]
    isr_links: Vec<(u32, usize)>,
}

/// `100x3`: a link rate (Mbit/s) of the isr scenario and its rounds.
fn parse_isr_link(s: &str) -> Result<(u32, usize), String> {
    let (rate, rounds) = s
        .split_once('x')
        .ok_or_else(|| format!("{s}: expected MBITxROUNDS, e.g. 100x3"))?;
    let rate = rate
        .trim()
        .parse::<u32>()
        .map_err(|e| format!("{s}: {e}"))?;
    let rounds = rounds
        .trim()
        .parse::<usize>()
        .map_err(|e| format!("{s}: {e}"))?;
    Ok((rate.max(1), rounds.max(1)))
}

/// `1000x1000`: connections and MB of a migrate case.
fn parse_migrate_case(s: &str) -> Result<(usize, usize), String> {
    let (n, mb) = s
        .split_once('x')
        .ok_or_else(|| format!("{s}: expected CONNECTIONSxMB, e.g. 1000x1000"))?;
    let num = |t: &str| t.trim().parse::<usize>().map_err(|e| format!("{s}: {e}"));
    Ok((num(n)?.max(1), num(mb)?.max(1)))
}

/// A migrate mover by its short name.
fn parse_mover(s: &str) -> Result<scenarios::migrate::Mover, String> {
    scenarios::migrate::Mover::ALL
        .into_iter()
        .find(|m| m.short() == s)
        .ok_or_else(|| format!("{s}: expected one of criu, roam, no-reinject, lazy"))
}

#[derive(Debug, Subcommand)]
enum Top {
    /// Internal: run a helper process (see the agent module).
    #[command(subcommand, hide = true)]
    Agent(agent::AgentCmd),
}

/// How much of everything a mode runs.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Plan {
    pub(crate) mode: &'static str,
    pub(crate) blocks: Vec<usize>,
    pub(crate) tput_rounds: usize,
    pub(crate) tput_seconds: f64,
    pub(crate) lat_rounds: usize,
    pub(crate) lat_iters: usize,
    pub(crate) setup_samples: usize,
    pub(crate) setup_process_samples: usize,
    pub(crate) resume_rounds: usize,
    pub(crate) stream_counts: Vec<usize>,
    /// Session counts of scenario 5 through `roam serve` (piped streams).
    pub(crate) mem_serve_counts: Vec<usize>,
    /// Session counts of scenario 5 through the echoing library relay.
    pub(crate) mem_counts: Vec<usize>,
    pub(crate) many_clients: usize,
    pub(crate) many_warmup_seconds: f64,
    pub(crate) many_seconds: f64,
    pub(crate) many_rounds: usize,
    /// Attribute bytes of the sessions moved in scenario 7's stall test.
    pub(crate) cluster_state_bytes: Vec<usize>,
    /// Moves per state size (and pre-copy on or off) in scenario 7.
    pub(crate) cluster_moves: usize,
    /// Sessions per drain in scenario 7.
    pub(crate) cluster_drains: Vec<usize>,
    /// Bytes each download of scenario 7's throughput test gets at least.
    pub(crate) cluster_download_bytes: u64,
    /// Moves per download of that test: each lasts that many intervals and
    /// a half, with a move at each interval's end.
    pub(crate) cluster_min_moves: usize,
    /// Seconds between moves during those downloads (plus a run without).
    pub(crate) cluster_move_every_s: Vec<f64>,
    /// Rounds of scenario 7's throughput test.
    pub(crate) cluster_tput_rounds: usize,
    /// Session counts of scenario 8 (relay takeover).
    pub(crate) takeover_sessions: Vec<usize>,
    /// Takeovers per session count in scenario 8.
    pub(crate) takeover_rounds: usize,
    /// Keystrokes per client in scenario 9 (shells).
    pub(crate) shell_keystrokes: usize,
    /// Re-attaches per client in scenario 9.
    pub(crate) shell_rounds: usize,
    /// Detached shells parked at once in scenario 9.
    pub(crate) shell_parked: usize,
    /// Scenario 10's cases: (connections, MB of process memory).
    pub(crate) migrate_cases: Vec<(usize, usize)>,
    /// Scenario 10's movers, in the order each case runs them.
    pub(crate) migrate_movers: Vec<scenarios::migrate::Mover>,
    /// Rounds of scenario 11 (`roam run`): each runs every way's full
    /// client process once.
    pub(crate) interpose_rounds: usize,
    /// First-connection samples per way and round in scenario 11.
    pub(crate) interpose_first_per_round: usize,
    /// Connections after the first per full client process in scenario 11.
    pub(crate) interpose_later: usize,
    /// Measured 1-byte round trips per full client process in scenario 11.
    pub(crate) interpose_round_trips: usize,
    /// Seconds of each upload and download in scenario 11.
    pub(crate) interpose_seconds: f64,
    /// Seconds of each stream run of scenario 12 (service continuations),
    /// with moves every 2 s and without.
    pub(crate) service_stream_seconds: f64,
    /// Pairs of stream runs (moves, none) in scenario 12, and rounds of its
    /// eager/lazy runs.
    pub(crate) service_rounds: usize,
    /// Seconds of each of scenario 12's eager/lazy stream runs (four per
    /// round: eager and lazy, with moves every 0.5 s and without).
    pub(crate) service_export_seconds: f64,
    /// Scenario 13's links: (rate in Mbit/s for `tbf`, rounds of resumes
    /// at it; the slowest takes minutes per round).
    pub(crate) isr_links: Vec<(u32, usize)>,
}

/// The state sizes of scenario 7 (bytes of attributes).
const STATE_BYTES: [usize; 6] = [0, 1000, 10_000, 100_000, 1_000_000, 10_000_000];

/// The write block sizes of scenario 1 (bytes).
const BLOCKS: [usize; 6] = [1, 16, 100, 1000, 16 * 1024, 64 * 1024];

impl Plan {
    fn quick() -> Plan {
        Plan {
            mode: "quick",
            blocks: BLOCKS.to_vec(),
            tput_rounds: 1,
            tput_seconds: 0.3,
            lat_rounds: 1,
            lat_iters: 1000,
            setup_samples: 20,
            setup_process_samples: 5,
            resume_rounds: 1,
            stream_counts: vec![1, 100, 1000, 10_000],
            mem_serve_counts: vec![1000],
            mem_counts: vec![],
            many_clients: 1000,
            many_warmup_seconds: 3.0,
            many_seconds: 2.0,
            many_rounds: 1,
            cluster_state_bytes: STATE_BYTES.to_vec(),
            cluster_moves: 10,
            cluster_drains: vec![64, 1000],
            cluster_download_bytes: 64_000_000,
            cluster_min_moves: 2,
            cluster_move_every_s: vec![2.0, 5.0, 10.0],
            cluster_tput_rounds: 1,
            takeover_sessions: vec![10, 1000],
            takeover_rounds: 3,
            shell_keystrokes: 200,
            shell_rounds: 2,
            shell_parked: 100,
            migrate_cases: vec![(10, 10), (100, 100)],
            migrate_movers: scenarios::migrate::Mover::ALL.to_vec(),
            interpose_rounds: 3,
            interpose_first_per_round: 3,
            interpose_later: 20,
            interpose_round_trips: 1000,
            interpose_seconds: 0.3,
            service_stream_seconds: 6.0,
            service_rounds: 1,
            service_export_seconds: 2.0,
            isr_links: vec![(100, 1)],
        }
    }

    fn full() -> Plan {
        Plan {
            mode: "full",
            blocks: BLOCKS.to_vec(),
            tput_rounds: 5,
            tput_seconds: 2.0,
            lat_rounds: 5,
            lat_iters: 5000,
            setup_samples: 200,
            setup_process_samples: 30,
            resume_rounds: 3,
            stream_counts: vec![1, 100, 1000, 10_000],
            mem_serve_counts: vec![1000, 9000, 10_000],
            mem_counts: vec![10_000],
            many_clients: 1000,
            many_warmup_seconds: 5.0,
            many_seconds: 5.0,
            many_rounds: 3,
            cluster_state_bytes: STATE_BYTES.to_vec(),
            cluster_moves: 30,
            cluster_drains: vec![64, 1000],
            cluster_download_bytes: 400_000_000,
            cluster_min_moves: 3,
            cluster_move_every_s: vec![2.0, 5.0, 10.0],
            cluster_tput_rounds: 3,
            takeover_sessions: vec![10, 1000, 10_000],
            takeover_rounds: 5,
            shell_keystrokes: 1000,
            shell_rounds: 5,
            shell_parked: 1000,
            migrate_cases: vec![
                (10, 10),
                (100, 10),
                (1000, 10),
                (10000, 10),
                (100, 100),
                (100, 1000),
                (1000, 1000),
            ],
            migrate_movers: scenarios::migrate::Mover::ALL.to_vec(),
            interpose_rounds: 8,
            interpose_first_per_round: 5,
            interpose_later: 100,
            interpose_round_trips: 5000,
            interpose_seconds: 1.0,
            service_stream_seconds: 20.0,
            service_rounds: 2,
            service_export_seconds: 8.0,
            isr_links: vec![(100, 3), (10, 3), (1, 1)],
        }
    }

    fn self_check() -> Plan {
        Plan {
            mode: "self-check",
            blocks: vec![1, 64 * 1024],
            tput_rounds: 1,
            tput_seconds: 0.1,
            lat_rounds: 1,
            lat_iters: 100,
            setup_samples: 3,
            setup_process_samples: 2,
            resume_rounds: 1,
            stream_counts: vec![1, 100],
            mem_serve_counts: vec![20],
            mem_counts: vec![20],
            many_clients: 20,
            many_warmup_seconds: 0.2,
            many_seconds: 0.3,
            many_rounds: 1,
            cluster_state_bytes: vec![0, 10_000, 1_000_000],
            cluster_moves: 2,
            cluster_drains: vec![16],
            cluster_download_bytes: 8_000_000,
            cluster_min_moves: 2,
            cluster_move_every_s: vec![0.1],
            cluster_tput_rounds: 1,
            takeover_sessions: vec![10],
            takeover_rounds: 2,
            shell_keystrokes: 20,
            shell_rounds: 1,
            shell_parked: 10,
            migrate_cases: vec![(10, 10)],
            migrate_movers: scenarios::migrate::Mover::ALL.to_vec(),
            interpose_rounds: 1,
            interpose_first_per_round: 1,
            interpose_later: 3,
            interpose_round_trips: 100,
            interpose_seconds: 0.1,
            service_stream_seconds: 2.5,
            service_rounds: 1,
            service_export_seconds: 1.0,
            isr_links: vec![(100, 1)],
        }
    }

    /// Time budget of one scenario; past it the scenario is an error.
    fn budget(&self) -> Duration {
        match self.mode {
            "full" => Duration::from_secs(1800),
            _ => Duration::from_secs(300),
        }
    }
}

/// What every scenario gets.
pub(crate) struct Ctx {
    pub(crate) plan: Plan,
    pub(crate) env: Env,
    /// The client key of library sessions (the relays accept any key).
    pub(crate) keypair: roam::Keypair,
    /// Open files allowed per process (children inherit it).
    pub(crate) nofile: u64,
    /// `--peers`: empty means all.
    pub(crate) peers: Vec<String>,
}

impl Ctx {
    /// Whether peer `name` takes part in this run.
    pub(crate) fn wants(&self, name: &str) -> bool {
        self.peers.is_empty() || self.peers.iter().any(|p| p == name)
    }
}

/// A scenario's result as the report shows it.
#[derive(Debug, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub(crate) enum Outcome<T> {
    Ok(T),
    Error { error: String },
    Skipped { why: String },
}

impl<T> Outcome<T> {
    fn is_error(&self) -> bool {
        matches!(self, Outcome::Error { .. })
    }
    pub(crate) fn ok(&self) -> Option<&T> {
        match self {
            Outcome::Ok(t) => Some(t),
            _ => None,
        }
    }
}

/// When the run started (for progress lines).
pub(crate) fn started() -> Instant {
    static T: OnceLock<Instant> = OnceLock::new();
    *T.get_or_init(Instant::now)
}

/// Every scenario's outcome.
#[derive(Debug, Serialize)]
pub(crate) struct Scenarios {
    pub(crate) throughput: Outcome<scenarios::throughput::Throughput>,
    pub(crate) latency: Outcome<scenarios::latency::Latency>,
    pub(crate) setup: Outcome<scenarios::setup::Setup>,
    pub(crate) resume: Outcome<scenarios::resume::Resume>,
    pub(crate) memory: Outcome<scenarios::memory::Memory>,
    pub(crate) many: Outcome<scenarios::many::Many>,
    pub(crate) cluster: Outcome<scenarios::cluster::Cluster>,
    pub(crate) takeover: Outcome<scenarios::takeover::Takeover>,
    pub(crate) shell: Outcome<scenarios::shell::ShellBench>,
    pub(crate) migrate: Outcome<scenarios::migrate::Migrate>,
    pub(crate) interpose: Outcome<scenarios::interpose::Interpose>,
    pub(crate) service: Outcome<scenarios::service::Service>,
    pub(crate) isr: Outcome<scenarios::isr::Isr>,
}

impl Scenarios {
    fn errors(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        let s = self;
        for (name, err) in [
            ("throughput", s.throughput.is_error()),
            ("latency", s.latency.is_error()),
            ("setup", s.setup.is_error()),
            ("resume", s.resume.is_error()),
            ("memory", s.memory.is_error()),
            ("many", s.many.is_error()),
            ("cluster", s.cluster.is_error()),
            ("takeover", s.takeover.is_error()),
            ("shell", s.shell.is_error()),
            ("migrate", s.migrate.is_error()),
            ("interpose", s.interpose.is_error()),
            ("service", s.service.is_error()),
            ("isr", s.isr.is_error()),
        ] {
            if err {
                v.push(name);
            }
        }
        v
    }
}

/// Runs one scenario on its own task, bounded by the plan's budget; errors,
/// panics and time-outs become `Outcome::Error`.
async fn scenario<T, F>(
    name: &str,
    env: &Env,
    only: &[String],
    lab: &Result<Arc<Lab>, String>,
    budget: Duration,
    f: impl FnOnce(Arc<Lab>) -> F,
) -> Outcome<T>
where
    F: Future<Output = io::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    if !only.is_empty() && !only.iter().any(|o| o == name) {
        return Outcome::Skipped {
            why: "not selected with --only".into(),
        };
    }
    let lab = match lab {
        Ok(l) => l.clone(),
        Err(e) => {
            return Outcome::Error {
                error: format!("peers did not start: {e}"),
            }
        }
    };
    progress(&format!("scenario {name}: start"));
    let net0 = procs::net_counters();
    let task = tokio::spawn(f(lab.clone()));
    let abort = task.abort_handle();
    let out = match tokio::time::timeout(budget, task).await {
        Err(_) => {
            abort.abort();
            Outcome::Error {
                error: format!("did not finish within its budget of {budget:?}"),
            }
        }
        Ok(Err(join)) => Outcome::Error {
            error: format!("panicked: {join}"),
        },
        // A scenario that cannot run on this machine (a missing tool) says
        // so with `Unsupported`: reported as skipped, with the reason.
        Ok(Ok(Err(e))) if e.kind() == io::ErrorKind::Unsupported => {
            Outcome::Skipped { why: e.to_string() }
        }
        Ok(Ok(Err(e))) => Outcome::Error {
            error: e.to_string(),
        },
        Ok(Ok(Ok(v))) => Outcome::Ok(v),
    };
    match &out {
        Outcome::Error { error } => {
            progress(&format!("scenario {name}: ERROR: {error}"));
            diag::report(env, &lab, &net0);
        }
        _ => progress(&format!("scenario {name}: done")),
    }
    out
}

fn main() {
    let cli = Cli::parse();
    if let Some(Top::Agent(cmd)) = cli.agent {
        std::process::exit(agent::run(cmd));
    }
    started();
    let plan = if cli.full {
        Plan::full()
    } else if cli.self_check {
        Plan::self_check()
    } else {
        Plan::quick()
    };
    let mut plan = plan;
    if let Some(n) = cli.many_clients {
        plan.many_clients = n.max(1);
    }
    if !cli.memory_serve_sessions.is_empty() {
        plan.mem_serve_counts = cli.memory_serve_sessions.clone();
    }
    if let Some(s) = cli.many_seconds {
        plan.many_seconds = s.max(0.1);
    }
    if !cli.isr_links.is_empty() {
        plan.isr_links = cli.isr_links.clone();
    }
    if !cli.migrate_cases.is_empty() {
        plan.migrate_cases = cli.migrate_cases.clone();
    }
    if !cli.migrate_movers.is_empty() {
        plan.migrate_movers = cli.migrate_movers.clone();
    }
    let known = [
        "throughput",
        "latency",
        "setup",
        "resume",
        "memory",
        "many",
        "cluster",
        "takeover",
        "shell",
        "migrate",
        "interpose",
        "service",
        "isr",
    ];
    if let Some(bad) = cli.only.iter().find(|o| !known.contains(&o.as_str())) {
        eprintln!(
            "roam-bench: unknown scenario {bad:?}; choose from {}",
            known.join(", ")
        );
        std::process::exit(2);
    }
    let nofile = procs::raise_nofile(1 << 20);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("roam-bench: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = rt.block_on(async move {
        tokio::select! {
            code = run(cli, plan, nofile) => code,
            // Dropping `run` drops the peers' guards, which kill them.
            _ = interrupted() => {
                eprintln!("roam-bench: interrupted; stopping every peer process");
                130
            }
        }
    });
    // Agents and peer processes were killed as their guards dropped; do not
    // wait for stray blocking tasks.
    rt.shutdown_timeout(Duration::from_secs(2));
    std::process::exit(code);
}

/// Completes on SIGINT or SIGTERM.
async fn interrupted() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
}

async fn run(cli: Cli, plan: Plan, nofile: u64) -> i32 {
    let me = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("roam-bench: cannot find my own binary: {e}");
            return 1;
        }
    };
    let roam = cli
        .roam
        .clone()
        .unwrap_or_else(|| me.with_file_name("roam"));
    if !roam.exists() {
        eprintln!(
            "roam-bench: no roam binary at {} (build it: cargo build --release -p roam-cli, or pass --roam)",
            roam.display()
        );
        return 2;
    }
    let dir = match tempfile::Builder::new().prefix("roam-bench-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("roam-bench: cannot create a scratch directory: {e}");
            return 1;
        }
    };
    if let Err(e) = std::fs::create_dir_all(&cli.out) {
        eprintln!("roam-bench: cannot create {}: {e}", cli.out.display());
        return 1;
    }
    let keypair = match roam::Keypair::generate() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("roam-bench: key generation failed: {e}");
            return 1;
        }
    };
    let machine = report::Machine::probe(nofile);
    let tools = report::Tools::probe(&roam);
    progress(&format!(
        "mode {}; {} cores, {}; roam: {}",
        plan.mode, machine.cores, machine.cpu_model, tools.roam
    ));
    let ctx = Arc::new(Ctx {
        plan: plan.clone(),
        env: Env {
            dir: dir.path().to_path_buf(),
            roam: roam.clone(),
            me,
        },
        keypair,
        nofile,
        peers: cli.peers.clone(),
    });
    let lab = match Lab::start(&ctx.env, agent::client_config(&ctx.keypair)).await {
        Ok(l) => Ok(Arc::new(l)),
        Err(e) => {
            progress(&format!("peers did not start: {e}"));
            Err(e.to_string())
        }
    };
    let budget = plan.budget();
    let only = &cli.only;
    let c = &ctx;
    let scen = Scenarios {
        throughput: scenario("throughput", &c.env, only, &lab, budget, |l| {
            scenarios::throughput::run(c.clone(), l)
        })
        .await,
        latency: scenario("latency", &c.env, only, &lab, budget, |l| {
            scenarios::latency::run(c.clone(), l)
        })
        .await,
        setup: scenario("setup", &c.env, only, &lab, budget, |l| {
            scenarios::setup::run(c.clone(), l)
        })
        .await,
        resume: scenario("resume", &c.env, only, &lab, budget, |l| {
            scenarios::resume::run(c.clone(), l)
        })
        .await,
        memory: scenario("memory", &c.env, only, &lab, budget, |l| {
            scenarios::memory::run(c.clone(), l)
        })
        .await,
        many: scenario("many", &c.env, only, &lab, budget, |l| {
            scenarios::many::run(c.clone(), l)
        })
        .await,
        cluster: scenario("cluster", &c.env, only, &lab, budget, |l| {
            scenarios::cluster::run(c.clone(), l)
        })
        .await,
        takeover: scenario("takeover", &c.env, only, &lab, budget, |l| {
            scenarios::takeover::run(c.clone(), l)
        })
        .await,
        shell: scenario("shell", &c.env, only, &lab, budget, |l| {
            scenarios::shell::run(c.clone(), l)
        })
        .await,
        migrate: scenario("migrate", &c.env, only, &lab, budget, |l| {
            scenarios::migrate::run(c.clone(), l)
        })
        .await,
        interpose: scenario("interpose", &c.env, only, &lab, budget, |l| {
            scenarios::interpose::run(c.clone(), l)
        })
        .await,
        service: scenario("service", &c.env, only, &lab, budget, |l| {
            scenarios::service::run(c.clone(), l)
        })
        .await,
        isr: scenario("isr", &c.env, only, &lab, budget, |l| {
            scenarios::isr::run(c.clone(), l)
        })
        .await,
    };
    drop(lab);
    let errors = scen.errors();
    let results = report::Results::new(plan, machine, tools, scen);
    let mut code = 0;
    match report::write_all(&results, &cli.out) {
        Ok(files) => {
            for f in files {
                progress(&format!("wrote {}", f.display()));
            }
        }
        Err(e) => {
            eprintln!("roam-bench: writing results: {e}");
            code = 1;
        }
    }
    if errors.is_empty() {
        progress("all scenarios ran without error");
    } else {
        progress(&format!("scenarios with errors: {}", errors.join(", ")));
        code = 1;
    }
    // Logs of the peers, for a failing run.
    if code != 0 {
        let logs = cli.out.join("logs");
        if std::fs::create_dir_all(&logs).is_ok() {
            if let Ok(rd) = std::fs::read_dir(dir.path()) {
                for e in rd.flatten() {
                    if e.path().extension().is_some_and(|x| x == "log") {
                        let _ = std::fs::copy(e.path(), logs.join(e.file_name()));
                    }
                }
            }
            progress(&format!("peer logs copied to {}", logs.display()));
        }
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_serialize_with_a_status_field() {
        #[derive(Serialize)]
        struct Data {
            x: u32,
        }
        let ok = serde_json::to_value(Outcome::Ok(Data { x: 1 })).unwrap();
        assert_eq!(ok, serde_json::json!({"status": "ok", "x": 1}));
        let e = serde_json::to_value(Outcome::<Data>::Error {
            error: "boom".into(),
        })
        .unwrap();
        assert_eq!(e, serde_json::json!({"status": "error", "error": "boom"}));
    }

    #[test]
    fn quick_mode_covers_the_issue() {
        let q = Plan::quick();
        assert_eq!(q.blocks, [1, 16, 100, 1000, 16384, 65536]);
        assert_eq!(q.stream_counts, [1, 100, 1000, 10_000]);
        assert_eq!(q.many_clients, 1000);
        let f = Plan::full();
        assert_eq!(f.mem_serve_counts, [1000, 9000, 10_000]);
        assert_eq!(f.mem_counts, [10_000]);
        for p in [&q, &f] {
            assert_eq!(
                p.cluster_state_bytes,
                [0, 1000, 10_000, 100_000, 1_000_000, 10_000_000]
            );
            assert_eq!(p.cluster_drains, [64, 1000]);
            assert_eq!(p.cluster_move_every_s, [2.0, 5.0, 10.0]);
        }
        // Issue 12's figures: connections 10 to 10,000 and 10 MB to 1 GB,
        // and the target's case (1 GB, 1,000 connections), in full runs.
        let conns: Vec<usize> = f.migrate_cases.iter().map(|c| c.0).collect();
        let mbs: Vec<usize> = f.migrate_cases.iter().map(|c| c.1).collect();
        for n in [10, 100, 1000, 10_000] {
            assert!(conns.contains(&n), "{n} connections");
        }
        for mb in [10, 100, 1000] {
            assert!(mbs.contains(&mb), "{mb} MB");
        }
        assert!(f.migrate_cases.contains(&(1000, 1000)));
        assert!(!q.migrate_cases.is_empty());
        // Scenario 11: peers alternate within rounds, and the first
        // connection has more samples than rounds.
        for p in [&q, &f] {
            assert!(p.interpose_rounds >= 3 && p.interpose_first_per_round >= 3);
            assert!(p.interpose_later > 0 && p.interpose_round_trips > 0);
        }
        // Scenario 12: streams long enough for moves every 2 s.
        assert!(q.service_stream_seconds >= 6.0 && f.service_stream_seconds >= 20.0);
        // Scenario 13: the issue's three link rates in full runs, one in
        // quick runs (CI's time).
        let rates = |p: &Plan| p.isr_links.iter().map(|l| l.0).collect::<Vec<_>>();
        assert_eq!(rates(&f), [100, 10, 1]);
        assert_eq!(rates(&q), [100]);
    }

    #[test]
    fn peer_order_rotates() {
        let rounds: Vec<Vec<usize>> = (0..3).map(|r| peers::order(3, r)).collect();
        assert_eq!(rounds, [vec![0, 1, 2], vec![1, 2, 0], vec![2, 0, 1]]);
    }
}
